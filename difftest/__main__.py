"""``python -m difftest``: the ``difftest`` command."""

from difftest.cli import main

raise SystemExit(main())
