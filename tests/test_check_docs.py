"""scripts/check_docs.py: documented commands run, and what a doc shows must be what they print."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_docs", ROOT / "scripts" / "check_docs.py")
assert _spec is not None and _spec.loader is not None
check_docs = importlib.util.module_from_spec(_spec)
sys.modules["check_docs"] = check_docs
_spec.loader.exec_module(check_docs)

DOC = '''# A doc

```console
$ printf 'case 2b87f5584fbadcb0 took 1.5 s\\nsecond\\nthird\\n'
case 0123456789abcdef took 9.9 s
...
third
$ (exit 3)
$ echo $?
3
$ python -c "
print('multi')"
multi
```

```sh
echo quiet
```

<!-- docs-check: skip: needs a GPU -->
```sh
exit 1
```

## Troubleshooting

<!-- docs-check: unchecked 'GPU only': needs a GPU -->

```console
$ echo "tool: error: value 'x' is not one of a, b"; echo "exit=2"
...
```

| you see | meaning |
|---|---|
| `tool: error: value 'x' is not one of ...` | a bad value |
| `GPU only: something` | unchecked |
'''


def doc_at(tmp_path: Path, text: str) -> check_docs.Doc:
    path = tmp_path / "doc.md"
    path.write_text(text)
    return check_docs.parse(path)


def test_blocks_commands_and_messages_are_parsed(tmp_path: Path) -> None:
    doc = doc_at(tmp_path, DOC)
    commands = [c.text for b in doc.blocks for c in b.commands]
    assert commands[1:4] == ["(exit 3)", "echo $?", "python -c \"\nprint('multi')\""]
    assert [b.skip for b in doc.blocks] == [None, None, "needs a GPU", None]
    assert doc.blocks[0].commands[1].status_shown  # the next command echoes $?
    assert not doc.blocks[0].commands[0].status_shown
    assert [m for _, _, m in doc.messages] == ["tool: error: value 'x' is not one of ...",
                                                "GPU only: something"]
    assert doc.unchecked == {"GPU only": "needs a GPU"}


def test_a_doc_that_shows_what_its_commands_print_passes(tmp_path: Path) -> None:
    assert check_docs.check(doc_at(tmp_path, DOC), check_docs.environment(), tmp_path) == []


@pytest.mark.parametrize(("old", "new", "complaint"), [
    ("third\n$ (exit 3)", "fourth\n$ (exit 3)", "the doc shows\n    fourth"),
    ("```sh\necho quiet", "```sh\nfalse", "exited 1, and the doc shows no exit status"),
    ("| `tool: error: value 'x' is not one of ...`", "| `tool: error: value 'x' is not in ...`",
     "is printed by none of the section's commands"),
])
def test_a_doc_that_drifted_fails(tmp_path: Path, old: str, new: str, complaint: str) -> None:
    assert old in DOC
    problems = check_docs.check(doc_at(tmp_path, DOC.replace(old, new)), check_docs.environment(),
                               tmp_path)
    assert len(problems) == 1 and complaint in problems[0], problems


def test_placeholders_and_trimming() -> None:
    shown = ["a 0123456789abcdef in 1.0 s", "...", "end ... here"]
    assert check_docs.missing_line(shown, ["x", "a fedcba9876543210 in 22.5 s", "y",
                                           "end of it here"]) is None
    assert check_docs.missing_line(shown, ["end of it here", "a fedcba9876543210 in 2 s"]) \
        == "end ... here"
    # consecutive shown lines must be consecutive in the output
    assert check_docs.missing_line(["one", "two"], ["one", "between", "two"]) == "two"
    assert check_docs.normalise(f"  report:   {ROOT}/scratch/r.json pid 42  ") \
        == check_docs.normalise("report: <checkout>/scratch/r.json pid 7")
    assert check_docs.normalise("in /usr/lib/x.py") == check_docs.normalise("in /opt/y")
    # a pending file is named <case id>.<pid>.json
    assert check_docs.normalise("file art/pending/0123456789abcdef.4242.json: x") \
        == check_docs.normalise("file art/pending/<id>.<pid>.json: x")
    assert check_docs.normalise("file art/pending/0123456789abcdef.4242.json") \
        != check_docs.normalise("file art/crashes/<id>.<pid>.json")
