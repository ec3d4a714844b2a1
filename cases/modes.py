"""Hypothesis draws of the kernel modes where shipped bugs lived: softcap, sliding window, canaries.

Each mode is drawn after a case's structure, off first (so a shrink switches it off when the
failure does not need it), and otherwise biased toward its boundaries:

* ``softcap``: caps small enough that ``|s / softcap|`` passes 88 (where ``exp`` overflows
  in float32: vLLM 0.30.0's NaN), the values models ship (30, 50), and any cap in between;
* ``sliding_window``: 1, a row's context length and its neighbours, windows that start one
  token after or before a 16- or 32-token tile boundary (so the tile a kernel loads holds
  slots outside the window: vLLM 0.13.0's NaN), and any window up to the longest context;
* ``canary``: NaN in every KV slot no row reads, in about half the cases.

Use ``draw(with_kernel_modes(case))`` at the end of a case strategy, or
``strategy.flatmap(with_kernel_modes)``.
"""

from __future__ import annotations

from hypothesis import strategies as st

from difftest.case import SOFTCAP_RANGE, Case
from difftest.sparse_table import build_rows

SOFTCAPS = (50.0, 30.0, 1.0, 0.05, 0.01, 0.002)  # largest first: a shrink keeps the mode mild
TILE_SIZES = (16, 32)


def sliding_windows(longest_context: int) -> st.SearchStrategy[int]:
    """Windows for rows whose longest attended sequence is ``longest_context`` tokens."""
    longest = max(longest_context, 1)
    edges = {1, 2, longest - 1, longest, longest + 1}
    # windows starting one slot after and one before a tile boundary of the longest row
    edges |= {longest - tile * k - d for tile in TILE_SIZES for k in (1, 2) for d in (1, -1)}
    return st.one_of(st.sampled_from(sorted(w for w in edges if w >= 1)),
                     st.integers(1, longest))


@st.composite
def with_kernel_modes(draw: st.DrawFn, case: Case) -> Case:
    """``case`` with a softcap, a sliding window and canaries drawn (each may be off)."""
    softcap = 0.0
    if draw(st.booleans()):  # each mode is on in half the cases, independently
        softcap = draw(st.one_of(st.sampled_from(SOFTCAPS), st.floats(*SOFTCAP_RANGE)))
    window = 0
    if draw(st.booleans()):
        longest = max((row.context_len for row in build_rows(case)), default=0)
        window = draw(sliding_windows(longest))
    canary = draw(st.booleans())
    return case.replace(softcap=softcap, sliding_window=window, canary=canary)
