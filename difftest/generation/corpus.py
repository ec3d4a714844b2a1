"""The pinned regression corpus: named cases in ``difftest/generation/corpus/*.json``, run every
time."""

from __future__ import annotations

from pathlib import Path

from difftest.case.spec import Case
from difftest.primitives.jsonfile import write_text

CORPUS_DIR = Path(__file__).parent / "corpus"


def load_corpus(directory: Path | str = CORPUS_DIR) -> list[Case]:
    """Every pinned case, sorted by file name."""
    return [Case.from_json(p.read_text()) for p in sorted(Path(directory).glob("*.json"))]


def promote(case: Case, name: str, directory: Path | str = CORPUS_DIR) -> Path:
    """Pin ``case`` under ``name`` (a file-name-safe slug); refuses to overwrite another case."""
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"corpus name {name!r}: allowed letters, digits, '-', '_' and '.'")
    path = Path(directory) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    named = case.replace(name=name)
    if path.exists() and Case.from_json(path.read_text()).case_id != named.case_id:
        raise FileExistsError(f"{path} already pins a different case")
    write_text(path, named.to_json() + "\n")
    return path
