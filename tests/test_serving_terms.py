"""The serving terms (sinks, ALiBi, an fp8 output, per-token-head scale caches): fields and
their errors, the reference against a token-by-token computation, the tolerance that sees a
dropped term, every kernel that takes them agreeing, the ones that lack them refusing, the
diagnosis's recomputation, the cost model, and Triton's interpreter's fp8 rounding (F38)."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch

from difftest.backends.aiter_unified import AiterUnified
from difftest.backends.torch_ref import TorchReference
from difftest.backends.triton_unified import TritonUnifiedAttention
from difftest.backends.vllm_decode_attention import VllmDecodeAttention
from difftest.backends.vllm_paged_decode import VllmPagedDecode
from difftest.case.spec import MODE_DEFAULTS, SERVING_TERM_FIELDS, Case, CaseError
from difftest.contract.backend import EmptyRowOutput, Precision, RunInputs
from difftest.contract.compare import compare
from difftest.contract.tolerance import Tolerance
from difftest.generation.dense import dense_cases, interpreted_cost
from difftest.generation.generate import generated_cases
from difftest.inputs import serving_terms
from difftest.judgement.diagnosis import _RowModel
from difftest.machine import devices
from difftest.primitives.dtypes import finite_max
from difftest.run.runner import Status, run_case

CPU = torch.device("cpu")
# a decode request of 300 tokens over three blocks and one of 77, fp8 with scales off 1
BASE = Case(num_blocks=8, seq_lens=(300, 77), block_tables=((5, 2, 7), (1,)),
            selections=((0, 1, 2), (0, -1, -1)), num_q_heads=4, kv_dtype="float8_e4m3fn",
            k_scale=0.5, v_scale=2.0, seed=5)
# the kernels' case: two short decode rows (one block each), so the interpreter is quick
SMALL = BASE.replace(seq_lens=(45, 17), block_tables=((5,), (1,)), selections=((0,), (0,)))
TERMS = {"sinks": {"sinks": True}, "alibi": {"alibi": True},
         "output_scale": {"output_scale": 0.01},
         "kv_quant": {"kv_quant": "per_token_head"},
         "all": {"sinks": True, "alibi": True, "output_scale": 0.002,
                 "kv_quant": "per_token_head", "sliding_window": 20, "canary": True}}


def test_the_fields_are_off_by_default_and_refused_out_of_range_by_name() -> None:
    assert all(MODE_DEFAULTS[name] == getattr(BASE, name) for name in SERVING_TERM_FIELDS)
    assert not set(SERVING_TERM_FIELDS) & set(BASE.to_dict())  # ids of older cases kept
    on = BASE.replace(**TERMS["all"])
    assert set(on.serving_terms) == set(SERVING_TERM_FIELDS)
    assert Case.from_json(on.to_json()) == on
    bad = [({"output_scale": 1e7}, "output_scale"), ({"output_scale": -1.0}, "output_scale"),
           ({"kv_quant": "per_block"}, "kv_quant"), ({"sinks": 1}, "sinks"),
           ({"kv_quant": "per_token_head", "kv_dtype": "float16", "k_scale": 1.0,
             "v_scale": 1.0}, "kv_quant")]
    for change, field in bad:
        with pytest.raises(CaseError) as error:
            BASE.replace(**change)
        assert error.value.field == field and "allowed" in str(error.value)
    assert BASE.replace(output_scale=1.0).output_dtype == "float8_e4m3fn"
    assert BASE.replace(kv_dtype="float8_e4m3fnuz",
                        output_scale=1.0).output_dtype == "float8_e4m3fnuz"


def _token_by_token(case: Case, inputs: RunInputs) -> torch.Tensor:
    """Each row's attention, one token at a time, from the stored values and their scales."""
    data = inputs.data
    sinks, slopes = serving_terms.sinks(case), serving_terms.alibi_slopes(case)
    out = torch.zeros(case.total_q, case.num_q_heads, case.head_dim, dtype=torch.float64)
    for r, row in enumerate(inputs.rows):
        tokens = [(data.slot_of[s.physical_block], t) for s in row.segments
                  for t in range(s.tokens)]
        n = len(tokens)
        for h in range(case.num_q_heads):
            q = data.query[r, h].double()
            logits, values = [], []
            for j, (i, t) in enumerate(tokens):
                if case.sliding_window and j < n - case.sliding_window:
                    continue
                g = h // case.queries_per_kv
                k, v = data.k_stored[i, t, g].double(), data.v_stored[i, t, g].double()
                if case.kv_quant == "per_token_head":
                    k, v = k * float(data.k_token_scales[i, t, g]), v * float(
                        data.v_token_scales[i, t, g])
                else:
                    k, v = k * case.k_scale, v * case.v_scale
                s = float(q @ k) * case.softmax_scale
                if slopes is not None:
                    s += float(slopes[h]) * (j - (n - 1))
                logits.append(s)
                values.append(v)
            sink = [float(sinks[h])] if sinks is not None else []
            m = max(logits + sink)
            total = sum(math.exp(s - m) for s in logits + sink)
            for s, v in zip(logits, values, strict=True):
                out[r, h] += math.exp(s - m) / total * v
    if case.output_scale:
        limit = finite_max(case.output_dtype) * case.output_scale
        out = out.clamp(-limit, limit)
    return out


# vLLM's split cache, two KV heads, 32-token blocks: a dense request of 100 tokens
SPLIT = Case(num_blocks=8, seq_lens=(100,), block_tables=((5, 2, 7, 1),),
             selections=((0, 1, 2, 3),), num_q_heads=4, num_kv_heads=2, head_dim=64,
             block_size=32, page_size=32, kv_layout="split", dense=True,
             kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=2.0, seed=5)


@pytest.mark.parametrize("base", [BASE, SPLIT], ids=["lbhnc", "split-2-kv-heads"])
@pytest.mark.parametrize("term", list(TERMS))
def test_the_reference_is_the_token_by_token_attention(term: str, base: Case) -> None:
    case = base.replace(**TERMS[term])
    inputs = RunInputs(case, CPU)
    reference = TorchReference().reference(inputs)
    expected = _token_by_token(case, inputs)
    assert float((reference.output - expected).abs().max()) < 1e-12
    if case.sinks or case.alibi:
        assert reference.bias_magnitude is not None
    # the diagnosis recomputes every row as the reference does
    model = _RowModel(inputs, Tolerance(Precision("float16", "float16", "float16")),
                      EmptyRowOutput.ZERO)
    for n in range(case.total_q):
        row = model.recompute(model.base(n)).output[0]
        assert float((row - reference.output[n]).abs().max()) < 1e-12


def test_a_saturating_fp8_output_is_the_clamped_attention() -> None:
    case = BASE.replace(output_scale=1e-3)
    reference = TorchReference().reference(RunInputs(case, CPU))
    limit = finite_max("float8_e4m3fn") * 1e-3
    assert float(reference.output.abs().max()) == pytest.approx(limit)


@pytest.mark.parametrize("term", ["sinks", "alibi", "kv_quant"])
def test_a_kernel_that_drops_a_term_is_outside_the_tolerance(term: str) -> None:
    """The reference without the term, judged as a float16 kernel's output of the case with
    it: the tolerance must see the difference."""
    case = BASE.replace(query_dtype="float16", **TERMS[term])
    without = case.replace(**{term: MODE_DEFAULTS[term]})
    truth = TorchReference().reference(RunInputs(case, CPU))
    wrong = TorchReference().reference(RunInputs(without, CPU)).output
    tolerance = Tolerance.of(Precision("float16", "float16", "float16"), case)
    verdict = compare("dropped", wrong, truth, tolerance, EmptyRowOutput.ZERO, case,
                      RunInputs(case, CPU).rows)
    assert not verdict.agrees


KERNELS = {"triton-unified": TritonUnifiedAttention, "aiter-unified": AiterUnified,
           "vllm-paged-decode": VllmPagedDecode}
TAKES = {"triton-unified": set(SERVING_TERM_FIELDS),
         "aiter-unified": {"sinks", "alibi", "output_scale"},
         "vllm-paged-decode": {"sinks", "alibi", "output_scale"}}


@pytest.mark.parametrize("term", list(TERMS))
def test_every_kernel_that_takes_a_term_agrees_and_the_others_refuse_it(
        term: str, device_name: str) -> None:
    device = torch.device(device_name)
    if device == CPU:
        devices.prepare_runtime("cpu")
    case = SMALL.replace(query_dtype="float16", **TERMS[term])
    backends = [cls() for cls in KERNELS.values()] + [VllmDecodeAttention()]
    available = [b for b in backends if b.availability().available]
    if len(available) < len(backends):
        pytest.skip("; ".join(f"{b.name}: {b.availability().reason}" for b in backends
                              if not b.availability().available))
    result = run_case(case, TorchReference(), available, device, diagnose=False)
    for outcome in result.results:
        takes = TAKES.get(outcome.backend, set())
        if set(case.serving_terms) <= takes:
            assert outcome.status is Status.AGREE, (outcome.backend, outcome.detail)
            stated = {name: arg.label for call in outcome.calls
                      for name, arg in call.arguments.items()}
            named = {"sinks": ("sinks", "sink_ptr"), "alibi": ("alibi_slopes",
                                                               "alibi_slopes_ptr"),
                     "output_scale": ("output_scale", "out_scale_inv"),
                     "kv_quant": ("k_scale_cache",)}
            for t in case.serving_terms:
                assert any(stated.get(name, "None") not in ("None", "default None", "1")
                           for name in named[t]), (outcome.backend, t, stated)
        else:
            assert outcome.status is Status.UNSUPPORTED, outcome.backend
            if len(case.kernel_modes) == 1:  # the reason names the term
                assert any(t in outcome.detail or "scale caches" in outcome.detail
                           for t in case.serving_terms), outcome.detail


def test_the_m3_decodes_refuse_the_terms_by_name_but_the_gluon_adapter_takes_sinks() -> None:
    """``pa_decode_gluon``'s contract has sinks: the adapter passes them (the emulator agrees,
    one-shot and partitioned); vLLM's MiniMax-M3 paths and the portable decode refuse."""
    from difftest.backends.aiter_gluon import AiterGluon
    from difftest.backends.vllm_aiter import VllmAiter
    from difftest.backends.vllm_triton_sparse import VllmTritonSparse

    case = BASE.replace(sinks=True, kv_dtype="float16", k_scale=1.0, v_scale=1.0,
                        seq_lens=(1300, 77), num_blocks=16,
                        block_tables=(tuple(range(2, 13)), (1,)),
                        selections=((0, 3, 5, 10), (0, -1, -1, -1)))
    for refusing in (VllmTritonSparse(), VllmAiter(emulated=True)):
        reason = refusing.unsupported_reason(case, CPU)
        assert reason is not None and "sinks" in reason
    adapters = [AiterGluon(emulated=True),
                AiterGluon(emulated=True).with_options({"splits": "1"})]
    assert AiterGluon(emulated=True).unsupported_reason(case.replace(alibi=True), CPU)
    result = run_case(case, TorchReference(), adapters, CPU, diagnose=False)
    for outcome in result.results:
        assert outcome.status is Status.AGREE, (outcome.backend, outcome.detail)
        stated = {n: a for call in outcome.calls for n, a in call.arguments.items()}
        assert stated["sinks"].label == "float32 [N]" and not stated["sinks"].fixed


def test_the_cost_model_bounds_what_the_cpu_draws() -> None:
    """The long-rows stratum's dense row (2049-8192 tokens) is shortened to the budget, yet
    stays past 2048 tokens."""
    from difftest.generation.cover import Cover

    cover = Cover(long_rows=True)
    drawn = generated_cases(6, 0, dense_cases, schedule=[cover] * 6, max_cost=512)
    for case in drawn:
        assert interpreted_cost(case) <= 512 + 16 * 3 * case.num_kv_heads * 24, case
        assert case.seq_lens[0] <= 16 * 512 // case.num_kv_heads or case.seq_lens[0] <= 2049
    free = generated_cases(6, 0, dense_cases, schedule=[cover] * 6)
    assert all(2049 <= c.seq_lens[0] <= 8192 for c in free)


def test_long_context_cases_are_one_decode_row_of_64k_to_256k_tokens() -> None:
    """The long-context stratum (``long_context=True``; with ``huge`` its cache also passes
    int32 element offsets, the nightly GPU check)."""
    drawn = generated_cases(2, 0, dense_cases, schedule=(), long_context=True,
                            kernel_modes=False)
    for case in drawn:
        assert case.batch == 1 and case.total_q == 1
        assert (1 << 16) <= case.seq_lens[0] <= (1 << 18)
        assert interpreted_cost(case) >= (1 << 12) * case.num_kv_heads


def test_f38_interpreter_rounds_fp8_downcasts_without_the_carry() -> None:
    """Triton 3.8.0's interpreter converts float32 31.67 to e4m3fn 16 (the rounding bit's
    carry into the exponent lost) and 1e-3 to 0 (subnormals truncated); the wrapped
    conversion gives torch's (and a GPU's) 32 and 2^-9, and saturates at 448."""
    import triton.language as tl
    from triton.runtime import interpreter

    from difftest.machine.interpreter import decode_fp8_specials

    values = np.array([31.67, 1e-3, 0.3, 500.0, -3.0], dtype=np.float32)
    own = inspect.unwrap(interpreter._convert_float)  # Triton's own, under every wrapper
    rtne = interpreter._ir.ROUNDING_MODE.RTNE
    raw = own(values, tl.float32, tl.float8e4nv, rtne).view(np.uint8)
    wrong = torch.from_numpy(raw.copy()).view(torch.float8_e4m3fn).float().tolist()
    assert wrong[:2] == [16.0, 0.0]
    assert decode_fp8_specials()
    fixed = interpreter._convert_float(values, tl.float32, tl.float8e4nv, rtne).view(np.uint8)
    right = torch.from_numpy(fixed.copy()).view(torch.float8_e4m3fn).float().tolist()
    assert right == [32.0, 2.0**-9, 0.3125, 448.0, -3.0]


def _alibi_sinks_prefill(kernel: object, device: torch.device = CPU,
                         **extra: object) -> tuple[float, float]:
    """One sequence of 16 tokens whose last 8 are queries, ALiBi and a sink, through
    ``kernel`` (a ``unified_attention``) on a plain split cache; returns the largest
    difference of the last row from float64 attention with ALiBi relative to the query
    (Press et al.) and from the same with the offsets relative to the context's end
    (``t - context_len``, as the kernel forms them); the kernel runs on ``device``."""
    torch.manual_seed(0)
    heads, dim, block, n, queries = 1, 64, 16, 16, 8
    q = torch.randn(queries, heads, dim, dtype=torch.float16)
    k = torch.randn(1, block, heads, dim, dtype=torch.float16)
    v = torch.randn(1, block, heads, dim, dtype=torch.float16)
    sinks = torch.tensor([2.0], dtype=torch.float32)
    slopes = torch.tensor([0.5], dtype=torch.float32)
    out = torch.zeros(queries, heads, dim, dtype=torch.float16, device=device)

    def on(t: torch.Tensor) -> torch.Tensor:
        return t.to(device)

    kernel(q=on(q), k=on(k), v=on(v), out=out,
           cu_seqlens_q=on(torch.tensor([0, queries], dtype=torch.int32)), max_seqlen_q=queries,
           seqused_k=on(torch.tensor([n], dtype=torch.int32)), max_seqlen_k=n,
           softmax_scale=dim**-0.5, causal=True, window_size=(-1, -1),
           block_table=on(torch.zeros((1, 1), dtype=torch.int32)), softcap=0.0, q_descale=None,
           k_descale=None, v_descale=None, alibi_slopes=on(slopes), sinks=on(sinks), **extra)
    context = n - queries
    pos = n - 1  # the last row's position
    scores = (q[-1, 0].double() @ k[0, :, 0].double().T) * dim**-0.5

    def attention(offsets: torch.Tensor) -> torch.Tensor:
        s = torch.cat((scores + 0.5 * offsets, torch.tensor([2.0], dtype=torch.float64)))
        return torch.softmax(s, dim=0)[:-1] @ v[0, :, 0].double()

    tokens = torch.arange(n, dtype=torch.float64)
    relative = attention(tokens - pos)
    kernel_style = attention(tokens - context)
    row = out[-1, 0].double().cpu()
    return float((row - relative).abs().max()), float((row - kernel_style).abs().max())


def test_f39_unified_attention_offsets_alibi_from_the_context_end_beside_sinks(
        device_name: str) -> None:
    """vLLM's unified_attention adds ``slope * (t - context_len)`` to the logits, not
    ``slope * (t - query position)``: a per-row constant that softmax drops, unless a sink
    shares the denominator. The last row of an 8-token prefill then weights its sink by
    ``exp(-slope * 7)`` too little: it matches the kernel-style offsets, not ALiBi. On a
    GPU natively, else interpreted."""
    device = torch.device(device_name)
    if device == CPU:
        devices.prepare_runtime("cpu")
    from difftest.backends.triton_unified import TritonUnifiedAttention

    backend = TritonUnifiedAttention()
    if not backend.availability().available:
        pytest.skip(backend.availability().reason)
    to_alibi, to_kernel_style = _alibi_sinks_prefill(backend._kernel(), device)
    assert to_kernel_style < 2e-3 < to_alibi, (to_kernel_style, to_alibi)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the long-context stratum runs "
                    "natively on a GPU (scripts/gpu_check.sh long); interpreted, one 64k-token "
                    "row takes tens of minutes")
def test_long_context_rows_natively_on_a_gpu() -> None:
    """Four long-context cases (64k-256k tokens; the last two past int32 element offsets of
    the cache), each with the serving terms, on every kernel that takes them."""
    from difftest.backends.aiter_unified import AiterUnified

    device = torch.device("cuda")
    plain = generated_cases(2, 0, dense_cases, schedule=(), long_context=True)
    huge = generated_cases(2, 1, dense_cases, schedule=(), long_context=True, huge=True)
    backends = [b for b in (TritonUnifiedAttention(), VllmPagedDecode(), AiterUnified())
                if b.availability().available]
    for case in [*plain, *huge]:
        case = case.replace(sinks=True, output_scale=0.01)
        result = run_case(case, TorchReference(), backends, device, diagnose=False)
        for outcome in result.results:
            assert outcome.status in (Status.AGREE, Status.UNSUPPORTED), (
                outcome.backend, outcome.detail)
