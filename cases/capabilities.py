"""Capability-aware generation: draw only cases that every chosen backend runs.

A backend declares what it runs through ``unsupported_reason(case, device)``. Probing it on a
one-block case of every ``(kv_layout, query_dtype, kv_dtype)`` tells which dtype combinations
it refuses outright (bf16 queries under Triton's interpreter, fp32 queries on AITER); the
strategy then draws only the combinations all chosen backends run. A refusal that depends on
more than the dtypes (irregular selections on ``vllm-triton-sparse``) is met while drawing: the
case is drawn again, up to a few times. The kernel modes (softcap, sliding window) are drawn only
if every backend runs them. :meth:`Capabilities.lines` says what was not drawn, for
which backend and why, so a report still shows the part of the case space a run left out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from difftest.cases.strategies import DtypeCombo, cases, dtype_combos
from hypothesis import strategies as st

from difftest.backend import Backend
from difftest.case import KV_LAYOUTS, Case
from difftest.dtypes import KV_DTYPES, QUERY_DTYPES

REDRAWS = 4  # draws of a case some backend refuses before it is kept anyway
MODE_PROBE_SOFTCAP = 30.0
MODE_PROBE_WINDOW = 1


def probe_case(combo: DtypeCombo) -> Case:
    """The smallest case of ``(kv_layout, query_dtype, kv_dtype)``: one block, one token."""
    layout, query_dtype, kv_dtype = combo
    return Case(num_blocks=1, seq_lens=(1,), block_tables=((0,),), selections=((0,),),
                query_dtype=query_dtype, kv_dtype=kv_dtype, kv_layout=layout)


@dataclass
class Capabilities:
    """What the chosen backends run on a device, and what generation left out because of it.

    ``combos``: the dtype combinations drawn; ``refused``: ``(backend, combo, reason)`` for
    every combination a backend refuses; ``modes_refused``: ``(backend, reason)`` for every
    backend that refuses the kernel modes (softcap, sliding window), which are then not
    drawn; ``redrawn``: how often a drawn case was refused, by backend and reason (it grows
    as cases are drawn).
    """

    device: torch.device
    backends: tuple[Backend, ...]
    combos: tuple[DtypeCombo, ...]
    refused: tuple[tuple[str, DtypeCombo, str], ...]
    skipped: tuple[tuple[str, str], ...] = ()
    modes_refused: tuple[tuple[str, str], ...] = ()
    redrawn: Counter[tuple[str, str]] = field(default_factory=Counter)

    @classmethod
    def probe(cls, backends: Iterable[Backend], device: torch.device,
              layouts: Sequence[str] = KV_LAYOUTS,
              query_dtypes: Sequence[str] = QUERY_DTYPES,
              kv_dtypes: Sequence[str] = KV_DTYPES) -> Capabilities:
        """Ask every available backend about every dtype combination of the given axes.

        Unavailable backends are left out (they run no case here; ``skipped`` says why). If
        no combination suits every backend, the ones the most backends run are drawn.
        """
        usable, skipped = [], []
        every = dtype_combos(layouts, query_dtypes, kv_dtypes)
        refused = []
        for backend in backends:
            availability = backend.availability()
            if not availability.available:
                skipped.append((backend.name, f"unavailable: {availability.reason}"))
                continue
            try:
                answers = [(combo, backend.unsupported_reason(probe_case(combo), device))
                           for combo in every]
            except Exception as exc:  # a broken plug-in must not stop the run
                skipped.append((backend.name, f"its support check raised {exc!r}; generation "
                                "ignores it, the run reports it per case"))
                continue
            usable.append(backend)
            refused += [(backend.name, combo, reason) for combo, reason in answers
                        if reason is not None]
        refusals = Counter(combo for _, combo, _ in refused)
        fewest = min(refusals[c] for c in every)
        combos = tuple(c for c in every if refusals[c] == fewest)
        with_modes = probe_case(combos[0]).replace(softcap=MODE_PROBE_SOFTCAP,
                                                   sliding_window=MODE_PROBE_WINDOW)
        modes_refused = [(b.name, reason) for b in usable
                         if (reason := b.unsupported_reason(with_modes, device)) is not None
                         and b.unsupported_reason(probe_case(combos[0]), device) is None]
        return cls(device, tuple(usable), combos, tuple(refused), tuple(skipped),
                   tuple(modes_refused))

    def unsupported_by(self, case: Case) -> list[tuple[str, str]]:
        """``(backend, reason)`` for every chosen backend that refuses ``case``."""
        return [(b.name, reason) for b in self.backends
                if (reason := b.unsupported_reason(case, self.device)) is not None]

    def accept(self, case: Case) -> bool:
        """Whether every backend runs ``case``; counts the refusals of one that it does not."""
        refusals = self.unsupported_by(case)
        self.redrawn.update(refusals)
        return not refusals

    def strategy(self, **options: Any) -> st.SearchStrategy[Case]:
        """:func:`~difftest.cases.strategies.cases` drawing only what every backend runs;
        ``options`` go to it (``max_batch``, ``selection_modes``, ...)."""
        return cases(combos=self.combos, accept=self.accept, redraws=REDRAWS,
                     kernel_modes=not self.modes_refused, **options)

    def lines(self) -> list[str]:
        """What generation did not draw, for which backend and why (empty: nothing)."""
        out = [f"not drawn for {name}: {reason}" for name, reason in self.skipped]
        by_reason: dict[tuple[str, str], list[DtypeCombo]] = {}
        for name, combo, reason in self.refused:
            if combo not in self.combos:
                by_reason.setdefault((name, reason), []).append(combo)
        for (name, reason), combos in by_reason.items():
            out.append(f"not drawn for {name}: {describe_combos(combos)}: {reason}")
        out += [f"not drawn for {name}: kernel modes (softcap, sliding window): {reason}"
                for name, reason in self.modes_refused]
        kept = {c for _, c, _ in self.refused if c in self.combos}
        if kept:
            out.append(f"no dtype combination suits every backend; drawn: "
                       f"{describe_combos(sorted(kept))} (some backend refuses each)")
        for (name, reason), count in sorted(self.redrawn.items()):
            out.append(f"redrawn {count} case(s) {name} refuses: {reason}")
        return out


def describe_combos(combos: Sequence[DtypeCombo]) -> str:
    """``query bfloat16 x KV any x layout any``, or the list of triples when not a product."""
    axes = [sorted({c[i] for c in combos}, key=order.index)
            for i, order in enumerate((KV_LAYOUTS, QUERY_DTYPES, KV_DTYPES))]
    if len(set(combos)) != len(axes[0]) * len(axes[1]) * len(axes[2]):
        return ", ".join(f"{q} queries with {kv} KV in {lay}" for lay, q, kv in combos)
    everything = (KV_LAYOUTS, QUERY_DTYPES, KV_DTYPES)
    names = [", ".join(values) if tuple(values) != full else "any"
             for values, full in zip(axes, everything, strict=True)]
    return f"query {names[1]} x KV {names[2]} x layout {names[0]}"


def cases_for(backends: Iterable[Backend], device: torch.device,
              **options: Any) -> st.SearchStrategy[Case]:
    """Cases every one of ``backends`` runs on ``device`` (see :class:`Capabilities`)."""
    return Capabilities.probe(backends, device).strategy(**options)
