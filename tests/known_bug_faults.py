"""A new finite bug inside known bugs' conditions: a plug-in for difftest's own tests.

``--plugin tests/known_bug_faults.py:PLUS_ONE`` wraps ``vllm-paged-decode`` (known bug F28)
and ``aiter-unified`` (F22, F24) so that every output element of a case with a sliding window
and NaN canaries is 1.0 too large: what a bump that adds a bug to a kernel with a known bug
looks like. Each keeps its base name (``<base>[fault=plus-one]``), its release and versions,
so the expectations concern it as they concern the kernel it wraps.
"""

from __future__ import annotations

from typing import Any

import torch

from difftest.contract import registry
from difftest.contract.backend import Backend, RunInputs

WRAPPED = ("vllm-paged-decode", "aiter-unified")


class PlusOne:
    """``inner`` with 1.0 added to every output element of window-and-canary cases."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = f"{inner.name}[fault=plus-one]"
        self.in_page_orders = inner.in_page_orders

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """The kernel's output, plus one inside the known bugs' conditions."""
        out = self.inner.run(inputs)
        case = inputs.case
        return out + 1.0 if case.sliding_window and case.canary else out


def plus_one() -> list[PlusOne]:
    """The wrapped backends."""
    installed = {b.name: b for b in registry.entry_point_backends()}
    return [PlusOne(installed[name]) for name in WRAPPED]


PLUS_ONE = plus_one
