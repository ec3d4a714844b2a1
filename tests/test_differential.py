"""The differential suite: the pinned corpus and generated cases on every configured backend."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, target
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from difftest.case.spec import Case
from difftest.generation.corpus import load_corpus

CORPUS = load_corpus()


@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
def test_pinned_corpus(case: Case, check_case) -> None:
    result = check_case(case)
    assert result.results, "no backend under test was configured"


@given(data=st.data())
def test_generated_cases(data: st.DataObject, difftest_case_strategy: SearchStrategy[Case],
                         check_example) -> None:
    """Examples drawn over what some configured backend runs; every backend runs each, in
    the variant fitted to it (and a backend whose older releases lack what the example
    needs, also the variant every release runs); the search is steered by each backend's
    largest error/tolerance over them."""
    largest: dict[str, float] = {}
    for result in check_example(data.draw(difftest_case_strategy, label="case")):
        for r in result.results:
            # a known bug's result may be non-finite (a NaN row), which target() refuses
            if r.comparison is not None and math.isfinite(r.comparison.max_ratio):
                largest[r.backend] = max(largest.get(r.backend, 0.0), r.comparison.max_ratio)
    for backend, ratio in largest.items():
        target(ratio, label=f"error/tolerance {backend}")
