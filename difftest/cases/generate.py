"""Deterministic case sets for the CLI: the first N cases Hypothesis draws under a fixed seed.

The set depends only on ``(count, seed)``, the strategy and Hypothesis's version (recorded in
every report), so two runners, or a baseline and a candidate image, see the same cases.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from difftest.case import Case
from difftest.cases.strategies import cases


def generated_cases(count: int, seed: int = 0,
                    strategy: st.SearchStrategy[Case] | None = None) -> list[Case]:
    """``count`` distinct cases (fewer only if the strategy has fewer), always the same ones for
    the same ``(count, seed)``.

    Hypothesis may draw the same case twice; when that leaves the set short, the same seed is
    drawn again with a larger budget (each budget's draws are deterministic too).
    """
    if count <= 0:
        return []
    budget, found = count, 0
    while True:
        collected = _draw(budget, seed, strategy if strategy is not None else cases(), count)
        if len(collected) >= count or len(collected) <= found or budget >= 8 * count:
            return list(collected.values())
        found, budget = len(collected), budget * 2


def _draw(budget: int, seed: int, strategy: st.SearchStrategy[Case],
          count: int) -> dict[str, Case]:
    collected: dict[str, Case] = {}

    @hypothesis_seed(seed)
    @settings(max_examples=budget, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck), derandomize=False)
    @given(strategy)
    def collect(case: Case) -> None:
        if len(collected) < count:
            collected.setdefault(case.case_id, case)

    collect()
    return collected
