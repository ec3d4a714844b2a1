"""The backend protocol: what a kernel adapter declares and how it is called.

A backend receives :class:`RunInputs` and pulls what it needs (the cache in its in-page
order, the framework's sparse page table, the stored query), then returns its output
``[total_q, num_q_heads, head_dim]``. Everything a comparison must know about the backend is
declared, never guessed: which cases it supports (with the reason when not), the precision of
its rounding stages, and what it writes on rows that attend nothing.

Three capabilities are optional, each its own protocol so that a call site checks for it by
type: a :class:`ReferenceBackend` also computes the float64 :class:`Reference` the others are
judged against, a :class:`ConfigurableBackend` builds configured copies of itself from the
options of a name like ``base[key=value,...]``, and a :class:`ReleaseSelectableBackend`
(one that runs the kernels of a chosen vLLM or AITER release) says apart what it refuses in
every release, which is all that generation asks (:func:`refusal_in_every_release`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Protocol, TypeGuard, runtime_checkable

import torch

from difftest.case.selection import SparseRow, build_rows, page_table
from difftest.case.spec import Case
from difftest.contract.exported_call import ExportedCall
from difftest.contract.kernel_call import KernelCall
from difftest.inputs.case_data import CaseData, generate
from difftest.inputs.kv_cache import CachePool, CacheViews, build_cache
from difftest.machine.devices import to_device


class EmptyRowOutput(enum.Enum):
    """What a backend writes on a row whose context length is 0."""

    ZERO = "zero"
    UNTOUCHED = "untouched"
    UNDEFINED = "undefined"


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here, and why not."""

    available: bool
    reason: str = ""


@dataclass(frozen=True)
class Precision:
    """Rounding stages of a backend, as dtype names (see :mod:`difftest.primitives.dtypes`).

    ``operands``: what q and K/V are rounded to before the matrix products (a q or K/V
    already of that dtype is taken to reach them unrounded, any scale applied outside the
    products; :meth:`difftest.contract.tolerance.Tolerance.of`); ``probabilities``:
    what the softmax weights are rounded to before the PV product; ``output``: the stored
    output dtype; ``rounded_products``: each product ``q_i k_i`` of a logit is rounded to
    ``operands`` before the sum (an elementwise multiply and a reduction instead of a dot);
    ``flushes_subnormal_outputs``: an output below ``output``'s normal range may be stored as
    zero (flush-to-zero, e.g. a GPU's FTZ mode on the last stage).
    ``scaled_query_rounded``: q times the softmax scale is rounded to ``operands`` before
    the products, so a q already of that dtype is rounded too (the scale is inside).
    """

    operands: str
    probabilities: str
    output: str
    rounded_products: bool = False
    flushes_subnormal_outputs: bool = False
    scaled_query_rounded: bool = False


@dataclass(frozen=True)
class Reference:
    """The float64 truth of a case, with the magnitudes the tolerance needs.

    ``output`` and ``abs_output`` (``sum_i p_i |v_i|``) are ``[total_q, Hq, D]``;
    ``logit_magnitude`` is ``max_i ||q o k_i||_2 * softmax_scale`` per ``[total_q, Hq]``;
    ``context_lens`` is ``[total_q]``.
    """

    output: torch.Tensor
    abs_output: torch.Tensor
    logit_magnitude: torch.Tensor
    context_lens: torch.Tensor
    bias_magnitude: torch.Tensor | None = None
    """Per ``[total_q, Hq]``, the largest additive logit term a kernel forms in float32 at
    the logits that carry a row's weight (a sink, ALiBi's offset at the row's own token);
    ``None``: no such term (docs/tolerance.md#sinks-and-alibi)."""


@runtime_checkable
class Backend(Protocol):
    """A kernel under test. Plug-ins implement this; see :mod:`difftest.contract.registry`."""

    name: str
    in_page_orders: tuple[str, ...]  # caches it reads, built (and timed) before it runs

    def availability(self) -> Availability:
        """Can it run on this machine at all (imports, hardware)?"""
        ...

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """``None`` if the case is within the backend's capabilities, else why not."""
        ...

    def precision(self, case: Case, device: torch.device) -> Precision:
        """Declared rounding stages for this case on this device."""
        ...

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """Declared output on rows with context length 0."""
        ...

    def versions(self) -> dict[str, str]:
        """Versions of what it wraps (recorded in every report)."""
        ...

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """Compute the decode output for ``inputs.case``, stating each kernel call it makes
        with :meth:`RunInputs.state` (built from the arguments the call is made with)."""
        ...


@runtime_checkable
class ReferenceBackend(Backend, Protocol):
    """A backend that can serve as the reference (``--reference`` / ``--difftest-reference``)."""

    def reference(self, inputs: RunInputs) -> Reference:
        """The float64 output of ``inputs.case`` and the magnitudes its tolerance needs."""
        ...

    def working_bytes(self, case: Case) -> int:
        """The memory :meth:`reference` allocates for ``case`` beyond the case's inputs and
        its outputs (an upper bound of its scratch): the runner refuses a case the device
        cannot hold before anything is allocated (:mod:`difftest.run.footprint`)."""
        ...


@runtime_checkable
class ConfigurableBackend(Backend, Protocol):
    """A backend that takes options in its name: ``base[key=value,...]``."""

    def with_options(self, options: Mapping[str, str]) -> Backend:
        """A copy configured by ``options``; raises ``ValueError`` naming a bad one."""
        ...


@runtime_checkable
class ReleaseSelectableBackend(Backend, Protocol):
    """A backend running the kernels of a chosen release: ``releases`` names the kinds it
    takes (``"vllm"``: ``vllm=`` or ``$DIFFTEST_VLLM``; ``"aiter"``: ``aiter=`` or
    ``$DIFFTEST_AITER``), which ``difftest bump`` reads. One whose ``unsupported_reason``
    depends on the release also says what it refuses in every release, and what some older
    release lacked, so generation fits its examples to those releases too; one that only has
    ``releases`` refuses the same in every release."""

    releases: tuple[str, ...]

    def unsupported_in_every_release(self, case: Case, device: torch.device) -> str | None:
        """What it refuses whatever release it loads (the adapter's, the device's and the
        interpreter's limits), read without loading a release; ``unsupported_reason`` adds
        what the loaded release lacks."""
        ...

    def unsupported_in_some_release(self, case: Case, device: torch.device) -> str | None:
        """What some release it takes refuses beyond that (a cast or a parameter older
        releases lack), read without loading a release: generation also gives those
        releases the nearest variant they run."""
        ...


def refusal_in_every_release(backend: Backend, case: Case, device: torch.device
                             ) -> str | None:
    """Why ``backend`` refuses ``case`` whatever release it loads: its
    ``unsupported_in_every_release`` where it has one, else its ``unsupported_reason``.

    Generation asks this, never the loaded release, so a seed's case set (fitted variants
    included) is the same under every release; a case the loaded release cannot run is then
    ``unsupported`` on that side of a bump (``difftest gate``: "no longer supported", "newly
    supported").
    """
    every_release = getattr(backend, "unsupported_in_every_release", None)
    if callable(every_release):
        return every_release(case, device)
    return backend.unsupported_reason(case, device)


def refusal_in_some_release(backend: Backend, case: Case, device: torch.device
                            ) -> str | None:
    """Why some release ``backend`` takes refuses ``case`` where it knows (its
    ``unsupported_in_some_release``: what its older releases lacked); ``None`` else.
    Generation also fits each example to those releases, so an old release runs the
    example's nearest variant it can instead of reporting the example ``unsupported`` only."""
    some_release = getattr(backend, "unsupported_in_some_release", None)
    return some_release(case, device) if callable(some_release) else None


def releases_taken(backend: Backend) -> tuple[str, ...]:
    """The release kinds ``backend`` runs the chosen release of (its ``releases``; none
    without)."""
    return tuple(getattr(backend, "releases", ()) or ())


REFERENCE_METHODS = ("reference", "working_bytes")  # what ReferenceBackend adds to Backend


def serves_as_reference(backend: Backend) -> TypeGuard[ReferenceBackend]:
    """Whether ``backend`` has the methods of :data:`REFERENCE_METHODS`, looked up
    dynamically.

    Not ``isinstance(backend, ReferenceBackend)``: from Python 3.12 a runtime-checkable
    protocol reads attributes statically (``inspect.getattr_static``), so the registry's guard,
    which delegates through ``__getattr__``, would never match.
    """
    return all(callable(getattr(backend, method, None)) for method in REFERENCE_METHODS)


def takes_options(backend: Backend) -> TypeGuard[ConfigurableBackend]:
    """Whether ``backend`` has ``with_options()``, looked up dynamically (see
    :func:`serves_as_reference`)."""
    return callable(getattr(backend, "with_options", None))


@dataclass
class RunInputs:
    """Everything derived from a case that backends may read; built lazily, once per case.

    ``pool``: a session's :class:`~difftest.inputs.kv_cache.CachePool`, whose buffers the caches are
    built in (the same bytes; valid until the pool's next case); without one each cache is a
    fresh :func:`~difftest.inputs.kv_cache.build_cache`. ``calls``: the kernel calls the running
    backend stated (:meth:`state`); the runner empties it before each backend runs.
    ``exported``: the calls a backend stated by value (:meth:`export_call`), kept only where
    an export set it to a list (``None``: not kept).
    """

    case: Case
    device: torch.device
    _caches: dict[str, CacheViews] = field(default_factory=dict, repr=False)
    pool: CachePool | None = field(default=None, repr=False)
    calls: list[KernelCall] = field(default_factory=list, repr=False)
    exported: list[ExportedCall] | None = field(default=None, repr=False)

    def state(self, call: KernelCall) -> None:
        """Record the statement of a kernel call the running backend made
        (:func:`difftest.contract.kernel_call.kernel_call`, from the arguments it made it with)."""
        self.calls.append(call)

    def export_call(self, call: ExportedCall) -> None:
        """Keep the values of a kernel call the running backend is about to make, where an
        export asks for them (:mod:`difftest.contract.exported_call`); the output argument
        is copied now, before the kernel writes it."""
        if self.exported is None:
            return
        arguments = dict(call.arguments)
        if call.output is not None and isinstance(arguments.get(call.output), torch.Tensor):
            arguments[call.output] = arguments[call.output].clone()
        self.exported.append(replace(call, arguments=arguments))

    @cached_property
    def data(self) -> CaseData:
        """Stored tensors, generated on the run device."""
        return generate(self.case, self.rows, self.device)

    @cached_property
    def rows(self) -> tuple[SparseRow, ...]:
        """The framework's logical attend list per query row."""
        return build_rows(self.case)

    @cached_property
    def sparse_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The framework's page-16 table and context lengths (int32, on the device)."""
        table, ctx = page_table(self.case, self.rows)
        return table.to(self.device), ctx.to(self.device)

    def cache(self, in_page_order: str) -> CacheViews:
        """The physical cache and page-16 views in ``in_page_order`` (built once)."""
        if in_page_order not in self._caches:
            if self.pool is not None:
                self._caches[in_page_order] = self.pool.cache(self.case, self.data,
                                                              in_page_order)
            else:
                self._caches[in_page_order] = build_cache(
                    self.case, self.data, self.rows, in_page_order
                )
        return self._caches[in_page_order]

    def built_caches(self) -> dict[str, CacheViews]:
        """The caches built so far, by in-page order."""
        return dict(self._caches)

    def output(self, dtype: torch.dtype) -> torch.Tensor:
        """A fresh output buffer pre-filled with NaN, so unwritten rows show."""
        shape = (self.case.total_q, self.case.num_q_heads, self.case.head_dim)
        return torch.full(shape, float("nan"), dtype=dtype, device=self.device)

    def block_table(self) -> torch.Tensor:
        """The logical block table ``[batch, max_blocks]`` int32, rows padded with 0."""
        width = max(1, max(len(t) for t in self.case.block_tables))
        table = torch.zeros((self.case.batch, width), dtype=torch.int32)
        for r, row in enumerate(self.case.block_tables):
            if row:
                table[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
        return to_device(table, self.device)

    def seq_lens(self) -> torch.Tensor:
        """Per-request sequence lengths, int32."""
        return to_device(torch.tensor(self.case.seq_lens, dtype=torch.int32), self.device)

    def selections(self) -> torch.Tensor:
        """Top-k selections ``[1, total_q, topk]`` int32, as the indexer emits them."""
        return to_device(torch.tensor(self.case.selections, dtype=torch.int32), self.device)[None]

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """0-d fp32 K and V scales, as vLLM's layers register them."""
        scales = to_device(torch.tensor((self.case.k_scale, self.case.v_scale),
                                        dtype=torch.float32), self.device)
        return scales[0], scales[1]
