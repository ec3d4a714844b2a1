"""Deterministic case sets for the CLI: the first N cases Hypothesis draws under a fixed seed.

The set depends only on ``(count, seed)``, the strategy and Hypothesis's version (recorded in
every report), so two runners, or a baseline and a candidate image, see the same cases.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from cases.strategies import cases
from difftest.case import Case


def generated_cases(count: int, seed: int = 0,
                    strategy: st.SearchStrategy[Case] | None = None) -> list[Case]:
    """Up to ``count`` distinct cases, always the same ones for the same ``(count, seed)``."""
    if count <= 0:
        return []
    collected: dict[str, Case] = {}

    @hypothesis_seed(seed)
    @settings(max_examples=count, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck), derandomize=False)
    @given(strategy if strategy is not None else cases())
    def collect(case: Case) -> None:
        if len(collected) < count:
            collected.setdefault(case.case_id, case)

    collect()
    return list(collected.values())
