"""``vllm-aiter`` and ``vllm-aiter@emulated``: vLLM's own MiniMax-M3 AITER decode, as shipped.

``minimax_m3_sparse_attn_decode_aiter`` end to end on the case: vLLM's Triton sparse-table
builder (``minimax_m3_build_sparse_block_table_decode``, stride read from the untrimmed views)
and its ``_run_gluon_decode`` (the K-trim of vLLM 0.33, absent in 0.32) calling AITER's
``pa_decode_gluon``, on the shuffled page-16 views, the logical block table, the indexer's
selections and 0-d fp32 scales for fp8 KV. Nothing of vLLM is re-implemented, so the
integration the fix patched is what runs, and the report names the vLLM version and path.

``vllm-aiter`` needs a ROCm GPU with AITER. ``vllm-aiter@emulated`` runs the same vLLM code
inside :func:`difftest.backends.pa_decode_gluon_emulator.installed_as_aiter`, on any machine (the
builder runs under the Triton interpreter on CPUs); option ``revision`` picks the emulated
contract (``vllm-aiter@emulated[revision=v0.1.20]``), and the arch follows the case's fp8
flavour as for ``aiter-gluon@emulated``. Declared capabilities are those of
:mod:`difftest.backends.aiter_gluon`, and one of vLLM's builder: a row that selects no lane of
its own block and whose valid lanes (duplicates counted) hold more tokens than its causal
length gets the causal length as its context, which cuts duplicated blocks short where the
declared semantics attends every copy (finding F14,
:func:`difftest.case.selection.aiter_table_rows`; vLLM assumes the indexer selects each row's own
block). A case with such a row is unsupported unless the option ``irregular=accept`` forces it
through (then it disagrees).

``vllm-aiter@emulated[vllm=0.34.0]`` (or ``vllm=/path/to/tree``, or ``$DIFFTEST_VLLM``) runs
that release's ``amd/ops/sparse_pa.py`` instead of the venv's
(:mod:`difftest.backends.vllm_release`); releases without it are unavailable, with the reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from difftest.backends.aiter_gluon import (
    EMULATED_OPTIONS,
    GluonCaller,
    aiter_availability,
    emulated_arch,
    gluon_empty_rows,
)
from difftest.backends.pa_decode_gluon_emulator import installed_as_aiter
from difftest.backends.vllm_adapter import VllmAdapter
from difftest.backends.vllm_triton_sparse import sparse_decode_labels
from difftest.case.selection import aiter_table_differs, selection_is_canonical
from difftest.case.spec import Case
from difftest.contract.backend import Availability, EmptyRowOutput, RunInputs
from difftest.contract.kernel_call import kernel_call
from difftest.contract.registry import OptionSpec
from difftest.primitives.dtypes import torch_dtype

IRREGULAR = {"irregular": ("refuse", "accept")}
REAL_OPTIONS = OptionSpec("vllm-aiter", IRREGULAR)
EMULATED_VLLM_OPTIONS = OptionSpec("vllm-aiter@emulated",
                                   {"revision": EMULATED_OPTIONS.choices["revision"], **IRREGULAR})


def cut_short_reason(case: Case, rows: list[int], accepting: str) -> str:
    """Why a case whose ``rows`` vLLM's builder cuts short is refused (finding F14): the
    first row and its numbers, the others by index, the rule, and ``accepting`` (the
    backend name that runs it anyway)."""
    n = rows[0]
    abs_pos = case.abs_pos(n)
    own = abs_pos // case.block_size
    lanes = sum(0 <= b <= own for b in case.selections[n])
    others = f" (also rows {', '.join(map(str, rows[1:]))})" if rows[1:] else ""
    return (f"row {n} (position {abs_pos}) selects no lane of its own block {own}, and its "
            f"{lanes} valid lanes hold {lanes * case.block_size} tokens, more than its causal "
            f"length {abs_pos + 1}{others}: vLLM's _build_sparse_block_table_kernel sets such "
            "a row's context to min(valid lanes x 128, causal length), which cuts duplicated "
            "blocks short where the declared semantics attends every copy (finding F14; vLLM "
            f"assumes the indexer selects each row's own block); {accepting} runs it anyway")


class VllmAiter(GluonCaller, VllmAdapter):
    """vLLM's ``minimax_m3_sparse_attn_decode_aiter`` on real AITER or, ``emulated``, on the
    ``pa_decode_gluon`` emulator."""

    real_options = REAL_OPTIONS
    emulated_options = EMULATED_VLLM_OPTIONS
    base = REAL_OPTIONS.base
    kernel_files = ("models/minimax_m3/amd/ops/sparse_pa.py",)
    kernel_module_name = "vllm.models.minimax_m3.amd.ops.sparse_pa"
    kernel_what = "MiniMax-M3 AITER decode"

    def __init__(self, emulated: bool = False, options: Mapping[str, str] | None = None) -> None:
        free, own = self.split_options(options or {}, own=True)
        GluonCaller.__init__(self, emulated, own)
        VllmAdapter.__init__(self, **free, name=self.name)

    def with_options(self, options: Mapping[str, str]) -> VllmAiter:
        """The same backend configured by ``options`` (relative to the defaults);
        ``vllm=<version or path>`` names the vLLM release whose ``sparse_pa.py`` runs."""
        return VllmAiter(self.emulated, options)

    def kernel_availability(self) -> Availability:
        """Real AITER unless emulated; then vLLM's module must import (a named release's
        imports are the release loader's)."""
        if not self.emulated and not (real := aiter_availability()).available:
            return real
        return super().kernel_availability()

    def unsupported_reason(self, case: Case, device: torch.device) -> str | None:
        """What ``pa_decode_gluon`` refuses; then rows vLLM's builder cuts short (F14)."""
        reason = super().unsupported_reason(case, device)
        if (reason is None and self.options["irregular"] == "refuse"
                and not selection_is_canonical(case)):
            rows = aiter_table_differs(case)
            if rows:
                accepting = self.with_options({**self.options, "irregular": "accept",
                                               **({"vllm": self.vllm} if self.vllm else {})})
                return cut_short_reason(case, rows, accepting.name)
        return reason

    def empty_row_output(self, case: Case) -> EmptyRowOutput:
        """From the splits vLLM asks for (``get_recommended_splits(total_q, 1)``)."""
        seqs = case.total_q * case.num_kv_heads
        return gluon_empty_rows(self._recommended_splits(case)(seqs, 1), self.emulated)

    def versions(self) -> dict[str, str]:
        """vLLM's version, path and how its kernel modules were loaded; AITER's version and
        commit, or the emulator's revision."""
        versions = {"torch": torch.__version__, **self.vllm_versions()}
        return {**self._kernel_versions(), **versions}

    def _aiter_for(self, case: Case) -> contextlib.AbstractContextManager[object]:
        """What vLLM's ``from aiter ... import`` lines find during the call: the installed
        AITER, or the emulator's fake modules."""
        if not self.emulated:
            return contextlib.nullcontext()
        # shadow_real: where the real AITER is also installed, this backend still means the
        # emulator; the fake modules are gone again when the call returns.
        return installed_as_aiter(self.options["revision"], emulated_arch(case),
                                  shadow_real=True)

    def run(self, inputs: RunInputs) -> torch.Tensor:
        """``minimax_m3_sparse_attn_decode_aiter`` over every query row."""
        sparse_pa = self.kernel_module()
        case = inputs.case
        cache = inputs.cache("shuffled")
        output = inputs.output(torch_dtype(case.query_dtype))
        k_scale, v_scale = inputs.scales() if case.is_fp8 else (None, None)

        decode = sparse_pa.minimax_m3_sparse_attn_decode_aiter
        arguments = dict(q=inputs.data.query, k_cache=cache.k, v_cache=cache.v,
                         topk_idx=inputs.selections(), block_table=inputs.block_table(),
                         seq_lens=inputs.seq_lens(), num_kv_heads=case.num_kv_heads,
                         sm_scale=case.softmax_scale, output=output, k_scale=k_scale,
                         v_scale=v_scale, decode_query_len=case.decode_query_len)
        with self._aiter_for(case):
            decode(**arguments)
        pages = f"{case.kv_dtype} {case.kv_layout} {{}} pages"
        inputs.state(kernel_call(decode, arguments, labels={
            **sparse_decode_labels(case, arguments),
            "k_cache": pages.format(cache.k.shape[0]), "v_cache": pages.format(cache.v.shape[0]),
        }, fixed=FIXED, sizes={"head_dim": (case.head_dim, "q.shape[2]")}))
        return output


FIXED = {
    "num_kv_heads": "vLLM's MiniMax-M3 AITER sparse PA asserts num_kv_heads == 1 per rank",
    "sparse_block_table": "the adapter lets vLLM build the sparse table (what the model "
                          "does); the framework's own table goes to pa_decode_gluon directly",
    "sparse_context_lens": "built with sparse_block_table, see there",
    "head_dim": "_run_gluon_decode raises for head_size != 128 (sparse_pa.py)",
}


def default_backends() -> list[VllmAiter]:
    """The registered names: ``vllm-aiter`` and ``vllm-aiter@emulated`` (default options)."""
    return [VllmAiter(), VllmAiter(emulated=True)]
