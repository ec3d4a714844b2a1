"""How a bug is planted: a correct backend reads its inputs through a mutation.

A :class:`Mutation` may rewrite what the wrapped backend pulls from :class:`RunInputs` (the
case's kernel parameters, the sparse table, the scales, the cache views, the logical tables)
or its output. The wrapped
kernel is unchanged, so a mutant behaves exactly like a kernel with that one bug.

A bug that lives in an adapter's configuration rather than in its inputs (AITER's K-trim
switched off) is a :class:`MutantBackend` whose ``inner`` is the misconfigured backend and
whose ``origin`` is the correct one it is named after.

``Mutation.diagnosis`` names the :mod:`difftest.judgement.diagnosis` hypothesis that describes the
bug (what the mutated kernel reads instead), ``""`` where the bug leaves no wrong output to
diagnose (an error); the mutation benchmark checks that a kill is diagnosed so.

``Mutation.applies_to(case)`` is ``False`` only where the bug provably changes nothing the
kernel reads (a packed-layout bug on an LHBNC case, a scale swap with equal scales): there
the mutant *is* the correct backend, so such a case cannot kill it, whatever it reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from difftest import (
    Availability,
    Backend,
    CacheViews,
    Case,
    EmptyRowOutput,
    Precision,
    RunInputs,
)

Table = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Mutation:
    """One planted bug; every hook is optional and receives the correct value."""

    name: str
    description: str
    harmful: bool = True
    case: Callable[[Case], Case] | None = None  # the case the kernel reads its arguments from
    sparse_table: Callable[[Case, Table], Table] | None = None
    scales: Callable[[Case, Table], Table] | None = None
    cache: Callable[[Case, CacheViews], CacheViews] | None = None
    selections: Callable[[Case, torch.Tensor], torch.Tensor] | None = None
    seq_lens: Callable[[Case, torch.Tensor], torch.Tensor] | None = None
    output: Callable[[Case, torch.Tensor], torch.Tensor] | None = None
    precision: Callable[[Precision], Precision] | None = None
    applies_to: Callable[[Case], bool] | None = None
    diagnosis: str = ""

    def reachable(self, case: Case) -> bool:
        """Whether the bug can change anything on ``case`` (see the module docstring)."""
        return self.applies_to is None or self.applies_to(case)


class MutatedInputs:
    """A view of :class:`RunInputs` through a mutation (everything else passes through)."""

    def __init__(self, inner: RunInputs, mutation: Mutation) -> None:
        self._inner = inner
        self._mutation = mutation

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def case(self) -> Case:
        """The (possibly rewritten) case whose parameters the kernel is called with; the
        data, tables and caches stay the correct case's."""
        hook = self._mutation.case
        return hook(self._inner.case) if hook else self._inner.case

    @property
    def sparse_table(self) -> Table:
        """The (possibly corrupted) page table and context lengths."""
        table, ctx = self._inner.sparse_table
        hook = self._mutation.sparse_table
        return hook(self._inner.case, (table.clone(), ctx.clone())) if hook else (table, ctx)

    def scales(self) -> Table:
        """The (possibly corrupted) K and V scales."""
        scales = self._inner.scales()
        hook = self._mutation.scales
        return hook(self._inner.case, scales) if hook else scales

    def cache(self, in_page_order: str) -> CacheViews:
        """The (possibly corrupted) cache views."""
        views = self._inner.cache(in_page_order)
        hook = self._mutation.cache
        return hook(self._inner.case, views) if hook else views

    def selections(self) -> torch.Tensor:
        """The (possibly corrupted) top-k selections."""
        sel = self._inner.selections()
        hook = self._mutation.selections
        return hook(self._inner.case, sel.clone()) if hook else sel

    def seq_lens(self) -> torch.Tensor:
        """The (possibly corrupted) sequence lengths."""
        lens = self._inner.seq_lens()
        hook = self._mutation.seq_lens
        return hook(self._inner.case, lens.clone()) if hook else lens


class MutantBackend:
    """``<origin>!<mutation>``: the inner backend with one planted bug.

    ``origin`` is the correct backend the mutant is a faulty version of (default: ``inner``);
    it differs from ``inner`` only for configuration bugs.
    """

    def __init__(self, inner: Backend, mutation: Mutation, origin: Backend | None = None) -> None:
        self.inner = inner
        self.mutation = mutation
        self.origin = origin if origin is not None else inner
        self.name = f"{self.origin.name}!{mutation.name}"
        self.in_page_orders = inner.in_page_orders

    def availability(self) -> Availability:
        """The inner backend's."""
        return self.inner.availability()

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """The inner backend's."""
        return self.inner.unsupported_reason(case, device)

    def precision(self, case: Case, device: torch.device) -> Precision:
        """The inner backend's, unless the mutation declares a change."""
        declared = self.inner.precision(case, device)
        return self.mutation.precision(declared) if self.mutation.precision else declared

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """The inner backend's."""
        return self.inner.empty_row_output(case)

    def versions(self) -> dict[str, str]:
        """The inner backend's, plus the mutation."""
        return self.inner.versions() | {"mutation": self.mutation.name}

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """Run the inner backend on mutated inputs."""
        out = self.inner.run(MutatedInputs(inputs, self.mutation))  # type: ignore[arg-type]
        hook = self.mutation.output
        return hook(inputs.case, out) if hook else out
