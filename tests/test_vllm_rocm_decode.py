"""vLLM's ROCm decode kernels as backends: ``kernel_paged_attention_2d`` (``ROCM_ATTN``'s
decode, on the shuffled cache through its interleaved-V mode) and ``decode_attention_fwd``
(split-KV decode on the plain page views); finding F28 and the expectation that lists it."""

from __future__ import annotations

import pytest
import torch

from difftest.backends.torch_ref import TorchReference
from difftest.backends.vllm_decode_attention import VllmDecodeAttention
from difftest.backends.vllm_imports import import_vllm_kernel
from difftest.backends.vllm_paged_decode import (
    VllmPagedDecode,
    loads_unread_slots_outside_the_window,
)
from difftest.case.spec import Case
from difftest.judgement.expectations import judge, load
from difftest.results.records import Status
from difftest.run.runner import run_case

CPU = torch.device("cpu")
# two requests: 300 tokens over blocks 2, 0 (block 0: page ids 0..7) and 5 (the last block),
# and 200 tokens whose second selection lane is -1
BASE = Case(num_blocks=6, seq_lens=(300, 200), block_tables=((2, 0, 5), (1, 3)),
            selections=((0, 1, 2), (0, 1, -1)), num_q_heads=16, seed=7)


def _available(backend: object) -> None:
    available = backend.availability()  # type: ignore[attr-defined]
    if not available.available:
        pytest.skip(available.reason)


@pytest.mark.parametrize(("backend", "changes"), [
    (VllmPagedDecode(), {}),
    (VllmPagedDecode(), {"kv_layout": "LHBNC", "kv_dtype": "float8_e4m3fn", "k_scale": 0.5,
                         "v_scale": 4.0}),
    (VllmDecodeAttention(), {"kv_layout": "LHBNC"}),
    (VllmDecodeAttention(), {"kv_dtype": "float8_e4m3fnuz", "query_dtype": "float32",
                             "k_scale": 2.0}),
], ids=["paged-fp16", "paged-lhbnc-fp8", "split-lhbnc", "split-fnuz-fp32-query"])
def test_the_kernels_agree_on_both_layouts_and_fp8(backend: object, changes: dict) -> None:
    _available(backend)
    result = run_case(BASE.replace(**changes), TorchReference(), [backend], CPU)
    (outcome,) = result.results
    assert outcome.status is Status.AGREE, outcome.detail or outcome.comparison
    (call,) = outcome.calls
    assert call.kernel in ("kernel_paged_attention_2d", "decode_attention_fwd")


def test_each_runs_the_mode_its_kernel_has_and_refuses_the_others() -> None:
    paged, split = VllmPagedDecode(), VllmDecodeAttention()
    _available(paged)
    window, softcap = BASE.replace(sliding_window=40), BASE.replace(softcap=5.0)
    assert paged.unsupported_reason(softcap, CPU) == \
        "kernel_paged_attention_2d has no logit softcap"
    assert split.unsupported_reason(window, CPU) == \
        "vLLM 0.33.0's decode_attention_fwd has no sliding window"
    assert "F1" in (split.unsupported_reason(BASE.replace(kv_dtype="bfloat16"), CPU) or "")
    for backend, case in [(paged, window), (split, softcap)]:
        (outcome,) = run_case(case, TorchReference(), [backend], CPU).results
        assert outcome.status is Status.AGREE, (backend.name, outcome.detail)


def test_split_k_segments_is_num_kv_splits_and_empty_rows_are_declared() -> None:
    """decode_attention_fwd splits each row into the case's split_k_segments parts; a padded
    request (context 0) is NaN there (declared undefined) and 0 in the paged kernel."""
    split = VllmDecodeAttention()
    _available(split)
    case = BASE.replace(seq_lens=(300, 0), block_tables=((2, 0, 5), ()),
                        selections=((0, 1, 2), (-1, -1, -1)), split_k_segments=8,
                        seq_threshold_3d=1)
    (outcome,) = run_case(case, TorchReference(), [split], CPU).results
    assert outcome.status is Status.AGREE, outcome.detail
    (call,) = outcome.calls
    assert call.arguments["num_kv_splits"].label == "8"
    assert outcome.comparison is not None and outcome.comparison.empty_rows == 1
    (paged,) = run_case(case, TorchReference(), [VllmPagedDecode()], CPU).results
    assert paged.status is Status.AGREE and paged.comparison.empty_row_policy == "zero"


def _paged_attention(stale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """kernel_paged_attention_2d called directly, outside the adapter: one sequence of 32
    tokens on pages 0 and 1, a sliding window of 16 (page 1 only), page 0 filled with
    ``stale``; returns the output and the float32 attention over page 1."""
    kernel = import_vllm_kernel(
        "vllm.v1.attention.ops.chunked_prefill_paged_decode").kernel_paged_attention_2d
    heads, dim, page, x = 16, 128, 16, 8
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, page, dim, generator=gen).half()
    v = torch.randn(2, page, dim, generator=gen).half()
    k[0], v[0] = stale, stale
    key = k.view(2, page, 1, dim // x, x).permute(0, 2, 3, 1, 4).contiguous()
    value = v.view(2, page // x, x, 1, dim).permute(0, 3, 1, 4, 2).contiguous()
    value = value.view(2, 1, dim, page)  # vLLM's 4-D view of the interleaved V
    q = torch.randn(1, heads, dim, generator=gen).half()
    out = torch.full_like(q, float("nan"))
    one = torch.tensor(1.0)
    kernel[(1, 1)](out, q, key, value, None, torch.tensor([[0, 1]], dtype=torch.int32),
                   torch.tensor([32], dtype=torch.int32), None, dim**-0.5, one, one, 1.0,
                   heads, heads, heads, 2, q.stride(0), q.stride(1), out.stride(0),
                   out.stride(1), page, page, dim, dim, False, 16, x, *key.stride(),
                   *value.stride(), True, torch.tensor([0, 1], dtype=torch.int32), False,
                   False, x)
    weights = torch.softmax(q.float() @ k[1].float().T * dim**-0.5, dim=-1)
    return out.float(), weights @ v[1].float()


def test_f28_a_nan_before_the_sliding_window_makes_the_row_nan() -> None:
    """Finding F28, outside the adapter: tokens before the window are loaded and weighted by
    exp(-10000 - m) = 0, so finite stale values there leave the output right and a NaN there
    (a freed block, uninitialised memory) makes every element NaN."""
    _available(VllmPagedDecode())
    out, expected = _paged_attention(0.5)
    assert (out - expected).abs().max() < 1e-3
    out, expected = _paged_attention(float("nan"))
    assert bool(out.isnan().all()) and bool(expected.isfinite().all())


def test_f28_is_a_known_bug_of_the_expectations_file() -> None:
    """The canary case of F28 disagrees (NaN) and the checkout's expectations file reports it
    as known bug F28; the same case without the canary agrees; the trigger predicate the
    history benchmark uses tells the two apart (and leaves out fp8 canaries when
    interpreted, which the interpreter reads as finite)."""
    backend = VllmPagedDecode()
    _available(backend)
    case = BASE.replace(sliding_window=40, canary=True)
    interpreted = {"triton_interpret": "True"}
    assert loads_unread_slots_outside_the_window(case, interpreted)
    assert not loads_unread_slots_outside_the_window(case.replace(canary=False), interpreted)
    fp8 = case.replace(kv_dtype="float8_e4m3fn")
    assert not loads_unread_slots_outside_the_window(fp8, interpreted)
    assert loads_unread_slots_outside_the_window(fp8, {"triton_interpret": "False"})
    records = [run_case(c, TorchReference(), [backend], CPU, known_bugs=load()).record()
               for c in (case, case.replace(canary=False))]
    assert [r.results[0].status for r in records] == [Status.DISAGREE, Status.AGREE]
    judgement = judge(records, load())
    assert list(judgement.known) == ["F28"] and not judgement.new and not judgement.failed


def _release_kernel(version: str) -> object:
    """``kernel_paged_attention_2d`` of a fetched release (skipped where it is not)."""
    from difftest.backends.vllm_release import ReleaseError, resolve

    try:
        release = resolve(version)
    except ReleaseError as err:
        pytest.skip(str(err))
    path = release.find("v1/attention/ops/chunked_prefill_paged_decode.py")
    if path is None:
        pytest.skip(f"vLLM {version} has no chunked_prefill_paged_decode.py")
    return import_vllm_kernel("vllm.v1.attention.ops.chunked_prefill_paged_decode",
                              lambda: release.load(path)).kernel_paged_attention_2d


@pytest.mark.parametrize(("version", "poisoned"), [("0.14.0", True), ("0.30.0", False)])
def test_a_nan_slot_past_seq_len_poisons_0_14_0_and_not_0_30_0(version: str,
                                                                poisoned: bool) -> None:
    """The history benchmark's ``paged-tail-nan``, outside the adapter: a sequence of 20
    tokens on pages 0 and 1 whose unwritten slots 20..31 hold NaN; 0.14.0 loads them into its
    last tile (NaN everywhere), 0.30.0 masks the loads (kv_load_mask) and matches float32."""
    kernel = _release_kernel(version)
    heads, dim, page, x, length = 16, 128, 16, 8, 20
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(2 * page, dim, generator=gen).half()
    v = torch.randn(2 * page, dim, generator=gen).half()
    k[length:], v[length:] = float("nan"), float("nan")
    key = k.view(2, page, 1, dim // x, x).permute(0, 2, 3, 1, 4).contiguous()
    value = v.view(2, page, 1, dim).permute(0, 2, 3, 1).contiguous()  # [pages, 1, D, 16]
    q = torch.randn(1, heads, dim, generator=gen).half()
    out = torch.full_like(q, float("nan"))
    one = torch.tensor(1.0)
    kernel[(1, 1)](out, q, key, value, None, torch.tensor([[0, 1]], dtype=torch.int32),
                   torch.tensor([length], dtype=torch.int32), None, dim**-0.5, one, one, 1.0,
                   heads, heads, heads, 2, q.stride(0), q.stride(1), out.stride(0),
                   out.stride(1), page, page, dim, dim, False, 0, x, *key.stride(),
                   *value.stride(), True, torch.tensor([0, 1], dtype=torch.int32), False,
                   False)
    weights = torch.softmax(q.float() @ k[:length].float().T * dim**-0.5, dim=-1)
    if poisoned:
        assert bool(out.isnan().all())
    else:
        assert (out.float() - weights @ v[:length].float()).abs().max() < 1e-3


def test_decode_attention_of_0_34_0_runs_the_sliding_window() -> None:
    """vLLM 0.34.0's decode_attention_fwd takes ``sliding_window`` (the last W keys)."""
    from difftest.backends.vllm_release import ReleaseError

    try:
        split = VllmDecodeAttention("0.34.0")
    except ReleaseError as err:
        pytest.skip(str(err))
    _available(split)
    (outcome,) = run_case(BASE.replace(sliding_window=40, canary=True), TorchReference(),
                          [split], CPU).results
    assert outcome.status is Status.AGREE, outcome.detail
    assert outcome.calls[0].arguments["sliding_window"].label == "40"



# a dense case of the default run: vLLM's split layout (plain pages only), 64-token pages,
# head size 256, 2 KV heads of 16 query heads each, three MTP rows
SPLIT = Case.from_dict({
    "schema": "difftest.case/1", "num_blocks": 6, "seq_lens": [128],
    "block_tables": [[5, 0]], "selections": [[0, 1], [0, 1], [0, 1]], "decode_query_len": 3,
    "num_q_heads": 32, "num_kv_heads": 2, "head_dim": 256, "page_size": 64,
    "block_size": 64, "kv_layout": "split", "softmax_scale": 0.0625,
    "distribution": "uniform", "seed": 267114565, "dense": True})


def test_the_standard_v_mode_runs_vllms_split_layout() -> None:
    """Where the release reads the shuffled cache (0.33.0) a split-layout case is refused
    with the reason; a release without the interleaved-V mode (0.30.0) runs it over the plain
    pages and agrees."""
    from difftest.backends.vllm_release import ReleaseError

    assert "has no shuffled pages" in (VllmPagedDecode().unsupported_reason(SPLIT, CPU) or "")
    try:
        old = VllmPagedDecode("0.30.0")
    except ReleaseError as err:
        pytest.skip(str(err))
    _available(old)
    (outcome,) = run_case(SPLIT, TorchReference(), [old], CPU).results
    assert outcome.status is Status.AGREE, outcome.detail
    assert "INTERLEAVED_V_PACK_FACTOR" not in outcome.calls[0].arguments


def test_a_vllm_that_disabled_triton_leaves_its_backends_unavailable(monkeypatch) -> None:
    """vLLM's triton_utils turns Triton off at import when it cannot read its own version
    (sources without a dist-info) or sees no single active driver; its @triton.jit then
    returns plain functions, which no backend can launch or inspect."""
    from vllm import triton_utils

    from difftest.backends.vllm_imports import triton_availability

    monkeypatch.setattr(triton_utils, "HAS_TRITON", False)
    for backend in (VllmPagedDecode(), VllmDecodeAttention()):
        available = backend.availability()
        assert not available.available
        assert available.reason.startswith("vLLM disabled Triton (vllm.triton_utils.HAS_TRITON")
    assert triton_availability().reason == available.reason
