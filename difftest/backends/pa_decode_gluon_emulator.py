"""Pure-torch emulator of AITER's ``pa_decode_gluon`` for machines without AMD GPUs.

The public entry: its parts are :mod:`~difftest.backends.pa_decode_gluon_contract` (the
launcher's preconditions per revision and its addressing, :class:`GluonEmulator`),
:mod:`~difftest.backends.pa_decode_gluon_numerics` (the kernels' computation) and
:mod:`~difftest.backends.pa_decode_gluon_fake_aiter` (the fake ``aiter`` modules).

It has the interface of ``aiter.ops.triton.gluon.pa_decode_gluon`` (argument names, shapes,
dtypes, layouts and the launcher's assertion messages) and computes what the Gluon kernels
compute, in float32 on any torch device. The contract it follows is
``shared/reference/aiter-pa-decode-gluon.md``; section numbers (§) below refer to it.

What is emulated:

* The launcher's preconditions (§2) with AITER's messages, raised as ``AssertionError``, per
  named contract revision (:data:`REVISIONS`). The gluon-import and arch checks are skipped.
  ``aiter.dtypes.fp8`` follows the emulated arch: ``"gfx950"`` (default, MI350/MI355)
  -> ``float8_e4m3fn``; ``"gfx942"`` (MI300/MI325) -> ``float8_e4m3fnuz``. The v0.1.26
  equal-block-count assertion is placed right after the 5-D ``key_cache`` check (its source
  is not public; only its message and line are known from the bug report).
  ``get_recommended_splits`` uses the configured CU count (default 304, an MI300X; an MI355X
  has 256).
* Addressing (§4): K, V, the per-token scales, the block table, the context lengths, the
  query and the query scale are read through the tensors' storage with the strides AITER
  passes and the unit strides it assumes, so offset or strided views (a V view starting 8
  pages into K's buffer) read exactly the bytes the kernel reads. ``x`` comes from the
  quant mode (16 with KV scales, else 8) as in the kernel. Only block-table entries
  ``j < cdiv(L, bs)`` are read, and page 0 must be readable.
* Numerics (§3.1, head-1 and multi-head PS kernels): q and K/V cast to ``compute_type``
  (a bf16/fp16 query cast to fp8 is clamped to the fp8 maximum first, so it saturates
  instead of producing NaN); logits ``(q.k) * softmax_scale * q_scale * k_scale`` in float32;
  masked logits -3.4e38; online softmax over ``context_partition_size``-token tiles (the
  running maximum after each tile is reproduced, because the probabilities are rounded
  relative to it); probabilities
  rounded to ``compute_type`` before PV; V scales folded in per tensor or per token with the
  kernel's ``FP8_MAX / max_tile`` trick; ``out = acc / l`` with ``l == 0 -> 1``; sinks; the
  result rounded to OUTPUT_DTYPE (bf16 for fp8 compute, else ``compute_type``), then stored
  in ``output.dtype`` (AITER's kernels do not compile for a float16 output or scratch under
  fp8 compute, finding F31; the emulator stores it anyway).
* Partitions (§3.3, §3.4): with ``max_context_partition_num`` S <= 1 the call is one-shot and
  rows with context length 0 are left untouched; with S > 1 each slot covers
  ``[j*c, min(L, (j+1)*c))``, ``c = cdiv(L, S)`` (``ps=True``) or one 256-token tile
  (``ps=False``), the scratch tensors are filled in AITER's format and the C++/FlyDSL PS
  reduce is emulated (an all-empty row gives 0).

Hazards where AITER gives silent garbage and the emulator raises ``ValueError`` instead:
fp8 K (or a 5-D fp8 V) without ``key_scale``/``value_scale`` (the kernel then assumes
``x = 8`` and misreads the ``x = 16`` layout; pass ``torch.ones(1)`` scales), reads outside
a tensor's storage, negative page ids, an ``output`` that cannot be reshaped as a view,
``ps=False`` with too few partitions, and scratch tensors of the wrong shape or strides.

Not emulated: the sliding-window partition schedule (any split gives the same result), the
split schedule of blocks larger than 256 tokens, the large-block non-PS kernel's
pre-scaling of fp8 probabilities by FP8_MAX (per-tensor scales), NaN/Inf propagation from
masked slots (AITER multiplies them by p = 0; the emulator drops them), the tile average
AITER returns for a row that sees no key although L > 0 (the emulator returns 0), the
Triton PS-reduce fallback (NaN for empty rows), and F31: under fp8 compute AITER's kernel
does not compile into a float16 ``output`` (one-shot) or ``temporary_output`` (partitions),
where the emulator computes a result (``aiter-gluon@compiled`` and ``vllm-aiter@compiled``
show the real failure).
"""

from __future__ import annotations

from collections.abc import Callable

from difftest.backends.pa_decode_gluon_contract import (
    ARCH_FP8,
    DEFAULT_ARCH,
    DEFAULT_NUM_CUS,
    DEFAULT_REVISION,
    REVISIONS,
    ContractRevision,
    GluonEmulator,
    make_emulator,
    resolve_revision,
)
from difftest.backends.pa_decode_gluon_fake_aiter import installed_as_aiter

__all__ = [
    "ARCH_FP8",
    "DEFAULT_ARCH",
    "DEFAULT_NUM_CUS",
    "DEFAULT_REVISION",
    "REVISIONS",
    "ContractRevision",
    "GluonEmulator",
    "get_recommended_splits",
    "installed_as_aiter",
    "make_emulator",
    "make_pa_decode_gluon",
    "pa_decode_gluon",
    "resolve_revision",
]


def make_pa_decode_gluon(
    revision: str | ContractRevision = DEFAULT_REVISION,
    arch: str = DEFAULT_ARCH,
    num_cus: int = DEFAULT_NUM_CUS,
) -> Callable[..., None]:
    """``pa_decode_gluon`` of the emulated build ``(revision, arch, num_cus)``."""
    return make_emulator(revision, arch, num_cus).pa_decode_gluon


_DEFAULT_EMULATOR = make_emulator()
pa_decode_gluon = _DEFAULT_EMULATOR.pa_decode_gluon
get_recommended_splits = _DEFAULT_EMULATOR.get_recommended_splits
