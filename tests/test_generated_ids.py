"""The generated case sets are pinned: the ids of the first cases of a few seeds, both families.

``difftest gate`` compares a baseline and a candidate case by case id, and a failure is
replayed from its seed and count, so a change to the strategies, the covering schedule or the
way its decisions reach the draws must leave ``generated_cases(count, seed)`` as it was, or
say so by re-recording ``test_generated_ids.json`` (``python -m tests.test_generated_ids``).
The ids depend on Hypothesis's version too (docs/findings.md F11): under another version the
comparison is skipped with the recorded one named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hypothesis
import pytest

from difftest.generation.dense import dense_cases
from difftest.generation.generate import CaseStrategy, generated_cases
from difftest.generation.strategies import cases

RECORD = Path(__file__).with_name("test_generated_ids.json")
SEEDS = (0, 1, 2)
SPARSE, DENSE = 50, 10  # dense: one example per five sparse ones, as difftest run draws them
# a narrowed strategy: the schedule's decisions its limits rule out are drawn instead
NARROW: dict[str, Any] = dict(max_topk=4, max_blocks=160, max_batch=2)


FAMILIES: dict[str, tuple[int, CaseStrategy, dict[str, Any]]] = {
    "sparse": (SPARSE, cases, {}), "dense": (DENSE, dense_cases, {}),
    "narrow": (SPARSE // 2, cases, NARROW)}


def drawn_ids() -> dict[str, list[str]]:
    """Per family and seed, the ids of ``generated_cases(count, seed, strategy, **options)``."""
    return {f"{family}-{seed}": [c.case_id for c in generated_cases(count, seed, strategy,
                                                                    **options)]
            for family, (count, strategy, options) in FAMILIES.items() for seed in SEEDS}


def record(path: Path = RECORD) -> None:
    """Write the ids of the current code under this Hypothesis."""
    path.write_text(json.dumps({"hypothesis": hypothesis.__version__, "ids": drawn_ids()},
                               indent=1) + "\n")


def test_the_generated_case_ids_are_the_recorded_ones() -> None:
    recorded = json.loads(RECORD.read_text())
    if recorded["hypothesis"] != hypothesis.__version__:
        pytest.skip(f"ids recorded under Hypothesis {recorded['hypothesis']}, this is "
                    f"{hypothesis.__version__}: re-record with python -m tests.test_generated_ids")
    drawn = drawn_ids()
    changed = {name: _first_difference(ids, drawn.get(name, []))
               for name, ids in recorded["ids"].items() if drawn.get(name) != ids}
    assert not changed, f"generated cases differ from the record (set: first index): {changed}"


def _first_difference(a: list[str], b: list[str]) -> int:
    pairs = zip(a, b, strict=False)
    return next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    record()
