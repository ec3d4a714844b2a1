"""Capability-aware generation: every drawn example runs on every chosen backend.

A backend declares what it runs through ``unsupported_reason(case, device)``; generation asks
only what it refuses in every release (:func:`~difftest.contract.backend.
refusal_in_every_release`), so the vLLM or AITER release a backend loaded never changes a
seed's cases, fitted variants included: what one release lacks is ``unsupported`` on that
side. Probing a backend on a one-block case of every ``(kv_layout, query_dtype, kv_dtype)``
tells which dtype combinations it refuses outright (bf16 queries under Triton's interpreter,
fp32 queries on AITER). The strategy draws from every combination *some* chosen backend
runs, with the kernel modes (softcap, sliding window, ...) if some backend runs them, so no
argument a backend accepts is held fixed because another backend refuses it.

Each drawn example is then **fitted** per backend (:meth:`Capabilities.fit`): a backend that
refuses the drawn case runs the nearest variant it accepts, and one whose older releases
lack what its run needs (``unsupported_in_some_release``: a cast, a parameter) also runs the
nearest variant every release runs, so an old release still meets the example's boundary.
A variant has the same structure, seed and data with the fewest fields changed (another query
dtype, another KV dtype, a kernel mode off), so the boundary the example carries (the last
block, a page id past 2**16, a 1-token tail) is tested by every backend. A variant is a case of
its own (its own id, on disk before it runs; its ``name`` says what it was fitted from). A
refusal no variant avoids (a non-canonical selection some backend refuses) is met while
drawing: the example is drawn again, up to a few times, and kept anyway at the end (the backend
then reports it ``unsupported``).
:meth:`Capabilities.lines` says what was fitted or not drawn, for which backend and why.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

from difftest.case.spec import KV_LAYOUTS, Case, CaseError
from difftest.contract.backend import (
    Backend,
    refusal_in_every_release,
    refusal_in_some_release,
)
from difftest.generation.dense import CPU_COST, dense_cases
from difftest.generation.strategies import DtypeCombo, cases, dtype_combos
from difftest.primitives.dtypes import FP8_DTYPES, KV_DTYPES, QUERY_DTYPES, torch_dtype

REDRAWS = 4  # draws of an example some backend cannot run in any variant, before it is kept
MODE_PROBE = {"softcap": 30.0, "sliding_window": 1}  # a case with the kernel modes on


def probe_case(combo: DtypeCombo) -> Case:
    """The smallest case of ``(kv_layout, query_dtype, kv_dtype)``: one block, one token."""
    layout, query_dtype, kv_dtype = combo
    return Case(num_blocks=1, seq_lens=(1,), block_tables=((0,),), selections=((0,),),
                query_dtype=query_dtype, kv_dtype=kv_dtype, kv_layout=layout)


@dataclass(frozen=True)
class Fitted:
    """One run of an example: ``case`` (the drawn one, or a variant of it) on ``backends``.

    ``changes`` says how the case differs from the drawn one (empty for the drawn case), e.g.
    ``("query_dtype bfloat16 -> float16",)``.
    """

    case: Case
    backends: tuple[str, ...]
    changes: tuple[str, ...] = ()


def _with(case: Case, **changes: Any) -> Case | None:
    """``case`` with ``changes``, or ``None`` if that is no valid case."""
    if "kv_dtype" in changes and changes["kv_dtype"] not in FP8_DTYPES:
        changes |= {"k_scale": 1.0, "v_scale": 1.0}  # scales belong to fp8 KV only
    try:
        return case.replace(**changes)
    except (CaseError, ValueError):
        return None


def _modes_off(case: Case, modes: Sequence[str]) -> Case | None:
    """``case`` with ``modes`` off (:meth:`Case.mode_off`), or ``None`` if that is invalid."""
    try:
        for mode in modes:
            case = case.mode_off(mode)
    except (CaseError, ValueError):
        return None
    return case


def nearest(dtype: str, choices: Sequence[str]) -> list[str]:
    """The other ``choices``, those of ``dtype``'s width first, then in declared order."""
    width = torch_dtype(dtype).itemsize
    return sorted((c for c in choices if c != dtype),
                  key=lambda c: abs(torch_dtype(c).itemsize - width))


def variants(case: Case) -> Iterator[tuple[Case, tuple[str, ...]]]:
    """Cases near ``case``, fewest changes first: the query dtype and the KV dtype (the
    nearest first, :func:`nearest`), and the kernel modes (:attr:`Case.kernel_modes`: each one
    off, then all off, by :meth:`Case.mode_off`, which keeps the rows' selections valid)."""
    on = list(case.kernel_modes)
    mode_choices: list[tuple[tuple[str, ...], tuple[str, ...]]] = [((), ())]
    mode_choices += [((m,), (f"{m} off",)) for m in on]
    if len(on) > 1:
        mode_choices.append((tuple(on), ("kernel modes off",)))
    dtype_axes = [
        [({}, ())] + [({"query_dtype": q}, (f"query_dtype {case.query_dtype} -> {q}",))
                      for q in nearest(case.query_dtype, QUERY_DTYPES)],
        [({}, ())] + [({"kv_dtype": kv}, (f"kv_dtype {case.kv_dtype} -> {kv}",))
                      for kv in nearest(case.kv_dtype, KV_DTYPES)],
    ]
    choices = sorted(itertools.product(*dtype_axes, mode_choices),
                     key=lambda combo: sum(bool(part[0]) for part in combo))
    for query, kv, (off, mode_changes) in choices[1:]:  # the first is the case itself
        variant = _modes_off(case, off)
        if variant is not None:
            variant = _with(variant, **query[0], **kv[0])
        if variant is not None:
            yield variant, (*query[1], *kv[1], *mode_changes)


@dataclass
class Capabilities:
    """What the chosen backends run on a device, and how generation fitted examples to them.

    ``combos``: the dtype combinations drawn (those some backend runs); ``refused``:
    ``(backend, combo, reason)`` for every combination a backend refuses; ``skipped``:
    ``(backend, reason)`` for backends left out (unavailable, a broken support check);
    ``modes_refused``: ``(backend, reason)`` for backends that refuse the kernel modes;
    ``fitted``: how often a backend ran a variant, by backend, changes and the reason it gave
    for the drawn case; ``unfit``: how often a backend could run no variant, by reason;
    ``examples``: how many examples were fitted.
    """

    device: torch.device
    backends: tuple[Backend, ...]
    combos: tuple[DtypeCombo, ...]
    refused: tuple[tuple[str, DtypeCombo, str], ...]
    skipped: tuple[tuple[str, str], ...] = ()
    modes_refused: tuple[tuple[str, str], ...] = ()
    fitted: Counter[tuple[str, tuple[str, ...], str]] = field(default_factory=Counter)
    unfit: Counter[tuple[str, str]] = field(default_factory=Counter)
    redrawn: Counter[tuple[str, str]] = field(default_factory=Counter)
    examples: int = 0
    examples_unfit: int = 0

    @classmethod
    def probe(cls, backends: Iterable[Backend], device: torch.device,
              layouts: Sequence[str] = KV_LAYOUTS,
              query_dtypes: Sequence[str] = QUERY_DTYPES,
              kv_dtypes: Sequence[str] = KV_DTYPES) -> Capabilities:
        """Ask every available backend about every dtype combination of the given axes.

        Unavailable backends are left out (they run no case here; ``skipped`` says why).
        """
        usable, skipped = [], []
        every = dtype_combos(layouts, query_dtypes, kv_dtypes)
        refused = []
        modes_refused = []
        for backend in backends:
            availability = backend.availability()
            if not availability.available:
                skipped.append((backend.name, f"unavailable: {availability.reason}"))
                continue
            try:
                answers = [(combo, refusal_in_every_release(backend, probe_case(combo),
                                                            device)) for combo in every]
                runs = [combo for combo, reason in answers if reason is None]
                # it runs the kernel modes if it runs one of them (fitting turns the others
                # off per example)
                mode_reasons = [refusal_in_every_release(
                    backend, probe_case(runs[0]).replace(**{mode: value}), device)
                    for mode, value in MODE_PROBE.items()] if runs else []
                mode_reason = ("; ".join(dict.fromkeys(r for r in mode_reasons if r))
                               if mode_reasons and all(mode_reasons) else None)
            except Exception as exc:  # a broken plug-in must not stop the run
                skipped.append((backend.name, f"its support check raised {exc!r}; generation "
                                "ignores it, the run reports it per case"))
                continue
            usable.append(backend)
            refused += [(backend.name, combo, reason) for combo, reason in answers
                        if reason is not None]
            if mode_reason is not None:
                modes_refused.append((backend.name, mode_reason))
        refusals = Counter(combo for _, combo, _ in refused)
        combos = tuple(c for c in every if refusals[c] < len(usable)) or every
        return cls(device, tuple(usable), combos, tuple(refused), tuple(skipped),
                   tuple(modes_refused))

    @property
    def draws_modes(self) -> bool:
        """Whether some backend runs the kernel modes (so the strategy draws them)."""
        return len(self.modes_refused) < len(self.backends)

    def refusal(self, backend: Backend, case: Case) -> str | None:
        """Why ``backend`` refuses ``case`` in every release (``None``: it runs it)."""
        return refusal_in_every_release(backend, case, self.device)

    def unsupported_by(self, case: Case) -> list[tuple[str, str]]:
        """``(backend, reason)`` for every chosen backend that refuses ``case`` itself."""
        return [(b.name, reason) for b in self.backends
                if (reason := self.refusal(b, case)) is not None]

    def _fit_one(self, backend: Backend, case: Case
                 ) -> tuple[Case, tuple[str, ...]] | None:
        """The drawn case or the nearest variant ``backend`` runs; ``None``: none."""
        if self.refusal(backend, case) is None:
            return case, ()
        for variant, changes in variants(case):
            if self.refusal(backend, variant) is None:
                return variant, changes
        return None

    def _fit_older(self, backend: Backend, case: Case, running: Case
                   ) -> tuple[Case, tuple[str, ...]] | None:
        """Where some release ``backend`` takes refuses ``running`` (its run of the drawn
        ``case``), the nearest variant of ``case`` that every such release runs; ``None``
        where none refuses it or no variant is left."""
        if refusal_in_some_release(backend, running, self.device) is None:
            return None
        for variant, changes in variants(case):
            if variant.case_id != running.case_id and self.refusal(backend, variant) is None \
                    and refusal_in_some_release(backend, variant, self.device) is None:
                return variant, changes
        return None

    def accept(self, case: Case) -> bool:
        """Whether every backend runs ``case`` or a variant of it; counts the refusals of the
        ones that run neither (the example is then drawn again)."""
        missing = [b for b in self.backends if self._fit_one(b, case) is None]
        self.redrawn.update((b.name, str(self.refusal(b, case)))
                            for b in missing)
        return not missing

    def fit(self, case: Case) -> list[Fitted]:
        """The runs of one drawn example: the drawn case on the backends that run it, each
        variant on the backends that run it instead, and the variants for the releases that
        refuse a backend's run (:meth:`_fit_older`) on that backend too (a backend that runs
        no variant is listed with the drawn case, where it reports ``unsupported``, and so is
        every backend the probe left out, which reports itself ``unavailable`` or its error);
        a run no backend is left for is dropped. Counted for :meth:`lines`."""
        groups: dict[str, tuple[Case, tuple[str, ...], list[str]]] = {
            case.case_id: (case, (), [name for name, _ in self.skipped])}
        self.examples += 1
        unfit = False
        for backend in self.backends:
            found = self._fit_one(backend, case)
            if found is None:
                unfit = True
                self.unfit[(backend.name, str(self.refusal(backend, case)))] += 1
                found = (case, ())
            elif found[1]:
                reason = str(self.refusal(backend, case))
                self.fitted[(backend.name, found[1], reason)] += 1
            variant, changes = found
            groups.setdefault(variant.case_id, (variant, changes, []))[2].append(backend.name)
            older = self._fit_older(backend, case, variant)
            if older is not None:  # also the nearest variant every release it takes runs
                self.fitted[(backend.name, older[1], f"for its releases that refuse it: "
                             f"{refusal_in_some_release(backend, variant, self.device)}")] += 1
                groups.setdefault(older[0].case_id, (*older, []))[2].append(backend.name)
        self.examples_unfit += unfit
        out = []
        for variant, changes, names in groups.values():
            if changes:
                variant = variant.replace(name=f"{case.case_id} fitted: {', '.join(changes)}")
            if names:
                out.append(Fitted(variant, tuple(names), changes))
        return out

    def fit_all(self, examples: Iterable[Case]) -> list[Fitted]:
        """The runs of ``examples`` (:meth:`fit`), each backend running a case at most once
        (two examples can share a variant)."""
        seen: set[tuple[str, str]] = set()
        out = []
        for example in examples:
            for fitted in self.fit(example):
                names = tuple(n for n in fitted.backends if (fitted.case.case_id, n) not in seen)
                seen.update((fitted.case.case_id, n) for n in names)
                if names:
                    out.append(Fitted(fitted.case, names, fitted.changes))
        return out

    def strategy(self, **options: Any) -> st.SearchStrategy[Case]:
        """:func:`~difftest.generation.strategies.cases` over what some backend runs, redrawing
        examples some backend runs in no variant; ``options`` go to it (``max_batch``, ...,
        ``cover``)."""
        return cases(combos=self.combos, accept=self.accept, redraws=REDRAWS,
                     kernel_modes=self.draws_modes, **options)

    def fitted_strategy(self, **options: Any) -> st.SearchStrategy[Case]:
        """:meth:`strategy`'s examples, each replaced by the first of its runs (:meth:`fit`):
        for one backend, the example or the nearest variant of it the backend runs."""
        return self.strategy(**options).map(lambda case: self.fit(case)[0].case)

    def dense_strategy(self, **options: Any) -> st.SearchStrategy[Case]:
        """:func:`~difftest.generation.dense.dense_cases` over the dtype pairs some backend runs
        (the geometry is drawn whatever the backends say: a backend that runs MiniMax-M3's
        geometry only reports such a case ``unsupported``, with its reason)."""
        pairs = tuple(dict.fromkeys((q, kv) for _, q, kv in self.combos))
        if self.device.type == "cpu":  # the cost model: what the interpreter runs in budget
            options.setdefault("max_cost", CPU_COST)
        return dense_cases(pairs=pairs, kernel_modes=self.draws_modes, **options)

    def lines(self) -> list[str]:
        """What generation fitted or left out, for which backend and why (empty: nothing)."""
        out = [f"not drawn for {name}: {reason}" for name, reason in self.skipped]
        by_reason: dict[tuple[str, str], list[DtypeCombo]] = {}
        for name, combo, reason in self.refused:
            if combo not in self.combos:
                by_reason.setdefault((name, reason), []).append(combo)
        for (name, reason), combos in by_reason.items():
            out.append(f"not drawn for {name}: {describe_combos(combos)}: {reason}")
        if not self.draws_modes:
            out += [f"not drawn for {name}: kernel modes ({', '.join(MODE_PROBE)}): {reason}"
                    for name, reason in self.modes_refused]
        for (name, changes, reason), count in sorted(self.fitted.items()):
            out.append(f"fitted for {name}: {count} of {self.examples} example(s) ran with "
                       f"{', '.join(changes)}: {reason}")
        for (name, reason), count in sorted(self.unfit.items()):
            out.append(f"could not fit for {name}: {count} example(s) reported unsupported: "
                       f"{reason}")
        for (name, reason), count in sorted(self.redrawn.items()):
            out.append(f"redrawn {count} example(s) {name} runs in no variant: {reason}")
        if self.examples:
            share = self.examples_unfit / self.examples
            out.append(f"examples some backend could not run: {self.examples_unfit} of "
                       f"{self.examples} ({share:.1%})")
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
    """Examples some of ``backends`` runs on ``device``, each fittable to all of them (see
    :class:`Capabilities`; run each through :meth:`Capabilities.fit`)."""
    return Capabilities.probe(backends, device).strategy(**options)


def cases_for_backend(backend: Backend, device: torch.device,
                      **options: Any) -> st.SearchStrategy[Case]:
    """What ``difftest run`` gives ``backend`` alone on ``device``: each drawn example, or
    the nearest variant of it the backend runs (:meth:`Capabilities.fit`). For hunts of one
    backend (the mutation benchmark): the modes and dtypes it refuses cost no examples."""
    return Capabilities.probe([backend], device).fitted_strategy(**options)

