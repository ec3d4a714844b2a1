"""The differential suite: the pinned corpus and generated cases on every configured backend."""

from __future__ import annotations

import pytest
from difftest.cases.corpus import load_corpus
from difftest.cases.strategies import cases
from hypothesis import given, target

from difftest.case import Case

CORPUS = load_corpus()


@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
def test_pinned_corpus(case: Case, check_case) -> None:
    result = check_case(case)
    assert result.results, "no backend under test was configured"


@given(case=cases())
def test_generated_cases(case: Case, check_case) -> None:
    result = check_case(case)
    for r in result.results:
        if r.comparison is not None:
            target(r.comparison.max_ratio, label=f"error/tolerance {r.backend}")
