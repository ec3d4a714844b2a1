"""``difftest``'s public face: every exported name resolves to the object of its home module,
is documented on the plug-in reference page, and ``import difftest`` stays light (the pytest
plugin loads it in every pytest run)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import difftest

PLUGINS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"

PROBE = """
import json, sys
import difftest
before = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "difftest"))
from difftest import Backend
print(json.dumps({"before": before, "torch": "torch" in sys.modules}))
"""


def test_every_public_name_resolves_to_its_home_modules_object() -> None:
    assert len(set(difftest.__all__)) == len(difftest.__all__)
    for name in difftest.__all__:
        value = getattr(difftest, name)
        home = sys.modules[difftest._HOME_OF[name]]
        assert value is getattr(home, name), name
    assert set(difftest.__all__) <= set(dir(difftest))
    assert not {n for n in dir(difftest) if not n.startswith("__")} - set(difftest.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Backends'"):
        difftest.Backends  # noqa: B018


def test_importing_difftest_imports_no_torch() -> None:
    """Nothing but the package itself loads until a name is used; the first name used then
    brings its module (and torch) in."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=300, check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["before"] == ["difftest"]
    assert seen["torch"]  # the protocol's module needs torch: the name really loaded it


def test_the_plugin_reference_documents_exactly_the_public_face() -> None:
    """docs/plugins.md's table of names is ``__all__``, and its code imports only from it."""
    page = PLUGINS_PAGE.read_text()
    table = page[page.index("| names | for |"):page.index("`import difftest` loads")]
    assert sorted(re.findall(r"`(\w+)`", table)) == sorted(difftest.__all__)
    imported = re.findall(r"^from (difftest[\w.]*) import", page, re.M)
    assert imported and set(imported) == {"difftest"}
