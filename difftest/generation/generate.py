"""Deterministic case sets for the CLI: the first N cases drawn under a fixed seed.

The set depends only on ``(count, seed)``, the strategy and Hypothesis's version (recorded in
every report), so two runners, a baseline and a candidate image, or two runs with other
modules, plug-ins, release trees or install kinds loaded, see the same cases. Two things make
it so:

* every choice comes from :class:`UniformProvider` (a Hypothesis backend): uniform over its
  range from a random generator seeded with the seed. Hypothesis's own provider also draws,
  one time in twenty, constants it reads from the source of every *local* module in
  ``sys.modules`` (docs/findings.md F11), and its generator copies choices between examples,
  so a strategy's odds held only loosely (F16);
* example ``i`` of the first :data:`~difftest.generation.covering.SCHEDULE` is drawn with its
  stratum as the strategy's ``cover``, so every kernel mode and boundary class appears in the
  first examples of every seed; the rest are free draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.internal.conjecture.data import ConjectureData
from hypothesis.internal.conjecture.providers import AVAILABLE_PROVIDERS, PrimitiveProvider
from hypothesis.internal.intervalsets import IntervalSet

from difftest.case.spec import Case
from difftest.generation.cover import FREE, Cover
from difftest.generation.covering import SCHEDULE
from difftest.generation.strategies import cases

BACKEND = "difftest-uniform"  # the name of UniformProvider among Hypothesis's backends
EXTRA_SIZE = 16  # strings and bytes: up to this many items past their minimum


class UniformProvider(PrimitiveProvider):
    """Hypothesis's five primitive draws, each uniform over its range, from the random
    generator Hypothesis seeds for the example: no constants from source files, no copies of
    earlier examples. Bounded integers and floats are what the case strategies draw."""

    lifetime = "test_case"

    def __init__(self, conjecturedata: ConjectureData | None, /) -> None:
        super().__init__(conjecturedata)
        if conjecturedata is None or conjecturedata._random is None:
            raise ValueError("UniformProvider: needs an example's seeded random generator")
        self._random = conjecturedata._random

    def draw_boolean(self, p: float = 0.5) -> bool:
        """True with probability ``p``."""
        return self._random.random() < p

    def draw_integer(self, min_value: int | None = None, max_value: int | None = None, *,
                     weights: dict[int, float] | None = None,
                     shrink_towards: int = 0) -> int:
        """A ``weights`` key with its probability, else uniform over the range (an open end
        is taken 2**64 from the other end, or from ``shrink_towards``)."""
        if weights:
            u = self._random.random()
            for value, p in weights.items():
                if u < p:
                    return value
                u -= p
        low = min_value if min_value is not None else (
            (max_value if max_value is not None else shrink_towards) - 2**64)
        high = max_value if max_value is not None else low + 2**65
        return self._random.randint(low, high)

    def draw_float(self, *, min_value: float = -math.inf, max_value: float = math.inf,
                   allow_nan: bool = True, smallest_nonzero_magnitude: float) -> float:
        """Uniform over ``[min_value, max_value]`` (an open end 1e6 from the other end or
        from 0); never NaN; magnitudes below ``smallest_nonzero_magnitude`` become 0 where
        0 is allowed, else that magnitude."""
        low = min_value if math.isfinite(min_value) else min(max_value, 0.0) - 1e6
        high = max_value if math.isfinite(max_value) else max(low, 0.0) + 1e6
        value = min(max(low + self._random.random() * (high - low), min_value), max_value)
        if 0 < abs(value) < smallest_nonzero_magnitude:
            value = 0.0 if min_value <= 0.0 <= max_value else math.copysign(
                smallest_nonzero_magnitude, value)
        return value

    def _size(self, min_size: int, max_size: int) -> int:
        return self._random.randint(min_size, min(max_size, min_size + EXTRA_SIZE))

    def draw_string(self, intervals: IntervalSet, *, min_size: int = 0,
                    max_size: int = 10**10) -> str:
        """Characters of ``intervals``, each uniform, up to :data:`EXTRA_SIZE` past
        ``min_size``."""
        if not intervals:
            return ""
        return "".join(chr(intervals[self._random.randrange(len(intervals))])
                       for _ in range(self._size(min_size, max_size)))

    def draw_bytes(self, min_size: int = 0, max_size: int = 10**10) -> bytes:
        """Uniform bytes, up to :data:`EXTRA_SIZE` past ``min_size``."""
        return self._random.randbytes(self._size(min_size, max_size))


AVAILABLE_PROVIDERS[BACKEND] = f"{__name__}.{UniformProvider.__name__}"


class CaseStrategy(Protocol):
    """A function of options returning a case strategy that takes the decisions of ``cover``:
    :func:`~difftest.generation.strategies.cases`, :func:`~difftest.generation.dense.dense_cases`,
    :meth:`~difftest.generation.capabilities.Capabilities.strategy` and its kin."""

    def __call__(self, *, cover: Cover = ..., **options: Any) -> st.SearchStrategy[Case]: ...


def generated_cases(count: int, seed: int = 0, strategy: CaseStrategy = cases,
                    schedule: Sequence[Cover] = SCHEDULE, **options: Any) -> list[Case]:
    """``count`` distinct cases (fewer only if the strategy has fewer), always the same ones for
    the same ``(count, seed)``, whatever else the process has imported.

    Example ``i`` is drawn from ``strategy(cover=schedule[i], **options)`` while
    ``i < len(schedule)`` (``schedule=()``: free draws only), later ones with ``cover=FREE``.
    Hypothesis may draw the same case twice; when that leaves the set short, the same seed is
    drawn again with a larger budget (the first draws stay the same).
    """
    if isinstance(strategy, st.SearchStrategy):
        raise TypeError("generated_cases: strategy is a function of the example's cover "
                        "(cases, dense_cases, capabilities.strategy), not a SearchStrategy: "
                        "pass capabilities.strategy, not capabilities.strategy()")
    if count <= 0:
        return []
    budget, found = count, 0
    while True:
        collected = _draw(budget, seed, lambda cover: strategy(cover=cover, **options), count,
                          schedule)
        if len(collected) >= count or len(collected) <= found or budget >= 8 * count:
            return list(collected.values())
        found, budget = len(collected), budget * 2


def _draw(budget: int, seed: int, strategy: Callable[[Cover], st.SearchStrategy[Case]],
          count: int, schedule: Sequence[Cover]) -> dict[str, Case]:
    collected: dict[str, Case] = {}
    examples = 0

    @hypothesis_seed(seed)
    @settings(max_examples=budget, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck), derandomize=False, backend=BACKEND)
    @given(st.data())
    def collect(data: st.DataObject) -> None:
        nonlocal examples
        cover = schedule[examples] if examples < len(schedule) else FREE
        examples += 1
        case = data.draw(strategy(cover))
        if len(collected) < count:
            collected.setdefault(case.case_id, case)

    collect()
    return collected
