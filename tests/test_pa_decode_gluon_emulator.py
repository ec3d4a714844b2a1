"""Tests of the pure-torch emulator of AITER's ``pa_decode_gluon``."""

from __future__ import annotations

import ast
import importlib.util
import math
import re
import subprocess
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from difftest.backends.pa_decode_gluon_emulator import (
    DEFAULT_REVISION,
    REVISIONS,
    ContractRevision,
    installed_as_aiter,
    make_emulator,
    make_pa_decode_gluon,
)
from difftest.backends.vllm_imports import kernel_availability

E4M3FN, E4M3FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
FP8_OF_ARCH = {"gfx950": E4M3FN, "gfx942": E4M3FNUZ}


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (E4M3FN, E4M3FNUZ)


def _cast(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Store ``values`` in ``dtype``, saturating fp8."""
    if _is_fp8(dtype):
        limit = torch.finfo(dtype).max
        values = values.clamp(-limit, limit)
    return values.to(dtype)


def _u(dtype: torch.dtype) -> float:
    """Unit roundoff."""
    return torch.finfo(dtype).eps / 2


def _x(dtype: torch.dtype) -> int:
    return 16 // torch.empty((), dtype=dtype).element_size()


# Layouts of §4, built from plain per-page data [P, bs, Hkv, D].
def _key_layout(plain: torch.Tensor, x: int) -> torch.Tensor:
    pages, bs, hkv, d = plain.shape
    grouped = plain.permute(0, 2, 3, 1).reshape(pages, hkv, d // x, x, bs)
    return grouped.permute(0, 1, 2, 4, 3).contiguous()  # [P, Hkv, D//x, bs, x]


def _value_layout_4d(plain: torch.Tensor) -> torch.Tensor:
    return plain.permute(0, 2, 3, 1).contiguous()  # [P, Hkv, D, bs]


def _value_layout_5d(plain: torch.Tensor, x: int) -> torch.Tensor:
    pages, bs, hkv, d = plain.shape
    normal = _value_layout_4d(plain).reshape(pages, hkv, d, bs // x, x)
    return normal.permute(0, 1, 3, 2, 4).contiguous()  # [P, Hkv, bs//x, D, x]


@dataclass(frozen=True)
class Case:
    """Inputs in AITER's layouts plus the plain data a float64 reference reads."""

    query: torch.Tensor  # [B*qlen, Hq, D] stored
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    context: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, W] int32
    k_plain: torch.Tensor  # [P, bs, Hkv, D] float64 stored values
    v_plain: torch.Tensor
    k_scale: torch.Tensor | None  # argument for the emulator
    v_scale: torch.Tensor | None
    k_scale_ref: torch.Tensor  # [P, bs, Hkv] float64 (ones without scales)
    v_scale_ref: torch.Tensor
    qlen: int
    kv_heads: int

    @property
    def group(self) -> int:
        return self.query.shape[1] // self.kv_heads


def make_case(
    *,
    seed: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    lengths: tuple[int, ...],
    kv_heads: int = 1,
    group: int = 4,
    head_size: int = 64,
    block_size: int = 16,
    qlen: int = 1,
    layout: str = "4d",
    scales: str | None = None,
    scale_values: tuple[float, float] = (1.0, 1.0),
) -> Case:
    """A random case; ``layout`` is ``"4d"``, ``"5d"`` or ``"lbhnc"`` (packed V view)."""
    gen = torch.Generator().manual_seed(seed)
    needed = sum(math.ceil(length / block_size) for length in lengths)
    if layout == "lbhnc":
        assert block_size == 16
        num_blocks = needed // 8 + 2
        pages = 16 * num_blocks
        candidates = torch.tensor([16 * b + j for b in range(num_blocks) for j in range(8)])
        ids = candidates[torch.randperm(len(candidates), generator=gen)[:needed]]
    else:
        pages = needed + 3
        ids = torch.randperm(pages, generator=gen)[:needed]
    width = max(math.ceil(length / block_size) for length in lengths) + 1
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    cursor = 0
    for row, length in enumerate(lengths):
        count = math.ceil(length / block_size)
        table[row, :count] = ids[cursor:cursor + count].int()
        cursor += count

    shape = (pages, block_size, kv_heads, head_size)
    k_real = torch.randn(shape, generator=gen, dtype=torch.float64)
    v_real = torch.randn(shape, generator=gen, dtype=torch.float64)
    k_scale_ref = torch.ones(pages, block_size, kv_heads, dtype=torch.float64)
    v_scale_ref = torch.ones_like(k_scale_ref)
    k_scale = v_scale = None
    if scales == "tensor":
        k_scale_ref = k_scale_ref * scale_values[0]
        v_scale_ref = v_scale_ref * scale_values[1]
        # 0-d, as vLLM passes them (AITER asserts equal shapes, so 0-d and [1] cannot mix).
        k_scale = torch.tensor(scale_values[0], dtype=torch.float32)
        v_scale = torch.tensor(scale_values[1], dtype=torch.float32)
    elif scales == "token":
        k_scale_ref = 0.25 + torch.rand(k_scale_ref.shape, generator=gen, dtype=torch.float64)
        v_scale_ref = 0.25 + torch.rand(v_scale_ref.shape, generator=gen, dtype=torch.float64)
        k_scale_ref = k_scale_ref.float().double()
        v_scale_ref = v_scale_ref.float().double()
        k_scale = k_scale_ref.float().permute(0, 2, 1).contiguous().unsqueeze(-1)
        v_scale = v_scale_ref.float().permute(0, 2, 1).contiguous().unsqueeze(-1)
    k_stored = _cast(k_real / k_scale_ref[..., None], kv_dtype)
    v_stored = _cast(v_real / v_scale_ref[..., None], kv_dtype)
    k_plain, v_plain = k_stored.double(), v_stored.double()

    x = _x(kv_dtype)
    key = _key_layout(k_plain, x).to(kv_dtype)
    if layout == "4d":
        value = _value_layout_4d(v_plain).to(kv_dtype)
    elif layout == "5d":
        value = _value_layout_5d(v_plain, x).to(kv_dtype)
    else:
        # One buffer: block b holds its 8 K pages, then its 8 V pages; V is viewed 8 pages in.
        page_elems = kv_heads * head_size * block_size
        buffer = torch.zeros(pages, page_elems, dtype=kv_dtype)
        key_view = buffer.view(pages, kv_heads, head_size // x, block_size, x)
        value_view = buffer.view(pages, kv_heads, block_size // x, head_size, x)[8:]
        key_view[ids] = key[ids]
        value_view[ids] = _value_layout_5d(v_plain, x).to(kv_dtype)[ids]
        key, value = key_view, value_view
        assert value.data_ptr() == key.data_ptr() + 8 * page_elems * key.element_size()

    query = torch.randn(len(lengths) * qlen, kv_heads * group, head_size, generator=gen)
    return Case(
        query=_cast(query, q_dtype),
        key_cache=key,
        value_cache=value,
        context=torch.tensor(lengths, dtype=torch.int32),
        block_tables=table,
        k_plain=k_plain,
        v_plain=v_plain,
        k_scale=k_scale,
        v_scale=v_scale,
        k_scale_ref=k_scale_ref,
        v_scale_ref=v_scale_ref,
        qlen=qlen,
        kv_heads=kv_heads,
    )


@dataclass(frozen=True)
class Reference:
    """float64 attention output with the per-element sums its rounding bound needs."""

    out: torch.Tensor  # [rows, Hq, D]
    abs_mean: torch.Tensor  # sum_t (p_t / l) |v_t|
    abs_sum: torch.Tensor  # sum_t |v_t| / l


def attend(
    logits: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax of ``logits`` [H, T] (plus sinks [H] in the denominator) applied to ``v``
    [T, H, D]: the output, sum (p/l)|v| and sum |v|/l, each [H, D]."""
    top = logits.max(dim=1, keepdim=True).values
    weights = torch.exp(logits - top)
    total = weights.sum(dim=1, keepdim=True)
    if sinks is not None:
        total = total + torch.exp(sinks.double()[:, None] - top)
    weights = weights / total
    out = torch.einsum("ht,thd->hd", weights, v)
    abs_mean = torch.einsum("ht,thd->hd", weights, v.abs())
    return out, abs_mean, v.abs().sum(0) / total


def reference(
    case: Case,
    q_eff: torch.Tensor,
    softmax_scale: float,
    query_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> Reference:
    """Straightforward float64 attention from the plain pages.

    Row ``b*qlen + i`` sees tokens ``t <= L - qlen + i`` (and, with a window W > 0,
    ``t >= L - W + 1 + i``: AITER's convention, §3.5); logits are
    ``softmax_scale * q_scale * k_scale[t] * <q, k_t>`` and V is ``v_scale[t] * v_t``.
    """
    out, abs_mean, abs_sum = (torch.zeros(q_eff.shape, dtype=torch.float64) for _ in range(3))
    bs, group = case.k_plain.shape[1], case.group
    heads = torch.arange(q_eff.shape[1]) // group
    for b, length in enumerate(case.context.tolist()):
        tokens = torch.arange(length)
        page = case.block_tables[b, tokens // bs].long()
        slot = tokens % bs
        k = case.k_plain[page, slot] * case.k_scale_ref[page, slot][..., None]  # [L, Hkv, D]
        v = case.v_plain[page, slot] * case.v_scale_ref[page, slot][..., None]
        for i in range(case.qlen):
            row = b * case.qlen + i
            seen = tokens <= length - case.qlen + i
            if window > 0:
                seen &= tokens >= length - window + 1 + i
            logits = torch.einsum("hd,thd->ht", q_eff[row].double(), k[seen][:, heads])
            logits = logits * softmax_scale
            if query_scale is not None:
                logits = logits * query_scale[row].double()
            out[row], abs_mean[row], abs_sum[row] = attend(logits, v[seen][:, heads], sinks)
    return Reference(out, abs_mean, abs_sum)


def assert_within_roundoff(
    actual: torch.Tensor,
    expected: Reference,
    *,
    compute_type: torch.dtype,
    output_dtype: torch.dtype,
    partials: bool,
) -> None:
    """Each element within the rounding of P, of the partials and of the output.

    Rounding p_t <= 1 to ``compute_type`` costs at most ``u_p * p_t + eta_p`` (``eta_p`` half
    the smallest subnormal spacing), so the output moves by at most
    ``u_p * sum (p/l)|v| + eta_p * sum |v|/l``; rounding the output (and each partial, a
    convex combination) to ``output_dtype`` adds ``u_out * sum (p/l)|v|``. A factor 2 absorbs
    the float32 arithmetic.
    """
    u_p, u_out = _u(compute_type), _u(output_dtype)
    eta_p = torch.finfo(compute_type).smallest_normal * u_p
    roundings = 2 if partials else 1
    bound = (u_p + roundings * u_out) * expected.abs_mean + eta_p * expected.abs_sum
    error = (actual.double() - expected.out).abs()
    ratio = float((error / (2 * bound + 1e-6)).max())
    assert ratio <= 1, f"max error {float(error.max()):.3g} is {ratio:.2f}x the bound"


def _run(
    emulator_call: Callable[..., None],
    case: Case,
    *,
    partitions: int,
    compute_type: torch.dtype,
    **kwargs: object,
) -> torch.Tensor:
    output = torch.full(case.query.shape, 7.0, dtype=kwargs.pop("output_dtype", torch.bfloat16))
    emulator_call(
        output, case.query, case.key_cache, case.value_cache, case.context,
        case.block_tables, kwargs.pop("softmax_scale", case.query.shape[-1] ** -0.5),
        case.qlen, partitions, compute_type=compute_type, key_scale=case.k_scale,
        value_scale=case.v_scale, **kwargs,
    )
    return output


ACCURACY_CASES = {
    "bf16-4d-gqa": (
        dict(q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, kv_heads=2, group=4),
        "gfx950", torch.bfloat16, (1,),
    ),
    "fp16-5d-mtp3": (
        dict(q_dtype=torch.float16, kv_dtype=torch.float16, group=8, qlen=3, layout="5d"),
        "gfx950", torch.float16, (1, 3),
    ),
    "e4m3fn-lbhnc-bf16q": (
        dict(q_dtype=torch.bfloat16, kv_dtype=E4M3FN, group=16, head_size=128,
             layout="lbhnc", scales="tensor", scale_values=(0.37, 1.7)),
        "gfx950", E4M3FN, (1, 5),
    ),
    "e4m3fn-lbhnc-bf16-compute": (
        dict(q_dtype=torch.bfloat16, kv_dtype=E4M3FN, group=16, head_size=128,
             layout="lbhnc", scales="tensor", scale_values=(0.37, 1.7)),
        "gfx950", torch.bfloat16, (1, 5),
    ),
    "e4m3fnuz-pertoken-bf16-compute": (
        dict(q_dtype=torch.bfloat16, kv_dtype=E4M3FNUZ, kv_heads=2, group=2, qlen=2,
             layout="5d", scales="token"),
        "gfx942", torch.bfloat16, (1, 2),
    ),
    "e4m3fnuz-pertoken-5d-mtp2": (
        dict(q_dtype=E4M3FNUZ, kv_dtype=E4M3FNUZ, kv_heads=2, group=2, qlen=2,
             layout="5d", scales="token"),
        "gfx942", E4M3FNUZ, (1, 2),
    ),
    "e4m3fn-kv-bf16-compute": (
        dict(q_dtype=torch.bfloat16, kv_dtype=E4M3FN, group=4, scales="tensor",
             scale_values=(0.8, 0.6)),
        "gfx950", torch.bfloat16, (4,),
    ),
}


@pytest.mark.parametrize("name", sorted(ACCURACY_CASES))
def test_matches_float64_reference(name: str) -> None:
    case_kwargs, arch, compute_type, partition_counts = ACCURACY_CASES[name]
    case = make_case(seed=11, lengths=(3, 37, 300, 517), **case_kwargs)
    emulator = make_emulator("v0.1.20", arch=arch)  # v0.1.26 rejects the packed LBHNC views
    q_eff = _cast(case.query.float(), compute_type).double()
    query_scale = None
    if case.query.dtype == E4M3FNUZ:  # per-token query scales on the fp8-query case
        query_scale = 0.5 + torch.rand(case.query.shape[0], case.query.shape[1], 1,
                                       generator=torch.Generator().manual_seed(3))
    softmax_scale = case.query.shape[-1] ** -0.5
    expected = reference(case, q_eff, softmax_scale, query_scale)
    output_dtype = torch.bfloat16 if _is_fp8(compute_type) else compute_type
    for partitions in partition_counts:
        actual = _run(
            emulator.pa_decode_gluon, case, partitions=partitions, compute_type=compute_type,
            output_dtype=output_dtype, query_scale=query_scale,
        )
        assert_within_roundoff(
            actual, expected, compute_type=compute_type, output_dtype=output_dtype,
            partials=partitions > 1,
        )


def test_sinks_join_the_denominator_in_both_paths() -> None:
    case = make_case(seed=5, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                     lengths=(9, 290), group=4)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    expected = reference(case, case.query.double(), 0.125, sinks=sinks)
    for partitions in (1, 3):
        actual = _run(make_pa_decode_gluon(), case, partitions=partitions,
                      compute_type=torch.bfloat16, softmax_scale=0.125, sinks=sinks)
        assert_within_roundoff(actual, expected, compute_type=torch.bfloat16,
                               output_dtype=torch.bfloat16, partials=partitions > 1)


def test_sliding_window() -> None:
    case = make_case(seed=12, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                     lengths=(3, 37, 300), qlen=2, group=2)
    expected = reference(case, case.query.double(), 0.125, window=20)
    run = make_pa_decode_gluon()
    for partitions in (1, 3):
        actual = _run(run, case, partitions=partitions, compute_type=torch.bfloat16,
                      softmax_scale=0.125, sliding_window=20)
        assert_within_roundoff(actual, expected, compute_type=torch.bfloat16,
                               output_dtype=torch.bfloat16, partials=partitions > 1)
    # vLLM passes -1 for "no window": the same as 0.
    assert torch.equal(
        _run(run, case, partitions=1, compute_type=torch.bfloat16, sliding_window=-1),
        _run(run, case, partitions=1, compute_type=torch.bfloat16, sliding_window=0),
    )


def test_causal_rows_ignore_later_tokens() -> None:
    case = make_case(seed=2, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, lengths=(20,),
                     qlen=2, group=2, layout="5d")
    before = _run(make_pa_decode_gluon(), case, partitions=1, compute_type=torch.bfloat16)
    # Change K and V of the last token (t = L-1): only row i = 1 may see it.
    page, slot = int(case.block_tables[0, 19 // 16]), 19 % 16
    k_plain, v_plain = case.k_plain.clone(), case.v_plain.clone()
    k_plain[page, slot] += 3.0
    v_plain[page, slot] -= 5.0
    changed = replace(
        case,
        key_cache=_key_layout(k_plain, 8).bfloat16(),
        value_cache=_value_layout_5d(v_plain, 8).bfloat16(),
    )
    after = _run(make_pa_decode_gluon(), changed, partitions=1, compute_type=torch.bfloat16)
    assert torch.equal(before[0], after[0])
    assert not torch.equal(before[1], after[1])


def test_empty_context_rows() -> None:
    case = make_case(seed=4, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                     lengths=(5, 0, 9), group=4)
    one_shot = _run(make_pa_decode_gluon(), case, partitions=1, compute_type=torch.bfloat16)
    assert bool((one_shot[1] == 7.0).all()), "one-shot must leave a ctx-0 row untouched"
    exp_sums = torch.full((3, 1, 3, 4), 9.0)
    max_logits = torch.full((3, 1, 3, 4), 9.0)
    temporary = torch.full((3, 1, 3, 4, 64), 9.0, dtype=torch.bfloat16)
    split = _run(make_pa_decode_gluon(), case, partitions=3, compute_type=torch.bfloat16,
                 exp_sums=exp_sums, max_logits=max_logits, temporary_output=temporary)
    assert bool((split[1] == 0).all()), "the PS reduce writes 0 for a ctx-0 row"
    assert bool((max_logits[1] == -torch.inf).all()) and bool((exp_sums[1] == 0).all())
    assert bool((temporary[1] == 0).all())
    # Row 0 (L=5, c=2): slots cover [0,2), [2,4), [4,5); all non-empty.
    assert bool(torch.isfinite(max_logits[0]).all()) and bool((exp_sums[0] >= 1).all())
    for row in (0, 2):
        torch.testing.assert_close(split[row], one_shot[row], atol=2e-2, rtol=2e-2)


def test_scales_scale_logits_and_output() -> None:
    case = make_case(seed=8, q_dtype=torch.bfloat16, kv_dtype=E4M3FN, lengths=(40, 280),
                     group=4, scales="tensor")
    run = make_pa_decode_gluon()
    base = _run(run, case, partitions=1, compute_type=E4M3FN)
    # k_scale multiplies the logits: doubling the scale equals doubling K (exact in fp8).
    doubled_k = replace(case, key_cache=(case.key_cache.float() * 2).to(E4M3FN))
    k_scaled = replace(case, k_scale=torch.tensor(2.0))
    assert torch.equal(_run(run, doubled_k, partitions=1, compute_type=E4M3FN),
                       _run(run, k_scaled, partitions=1, compute_type=E4M3FN))
    assert not torch.equal(_run(run, k_scaled, partitions=1, compute_type=E4M3FN), base)
    # v_scale multiplies the output.
    v_scaled = replace(case, v_scale=torch.tensor(2.0))
    assert torch.equal(_run(run, v_scaled, partitions=1, compute_type=E4M3FN), base * 2)
    # Scales are ignored when K is not fp8 (whatever their dtype).
    plain = make_case(seed=8, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, lengths=(40,))
    with_scales = replace(plain, k_scale=torch.tensor(3.0, dtype=torch.float16),
                          v_scale=torch.tensor(5.0))
    assert torch.equal(_run(run, plain, partitions=1, compute_type=torch.bfloat16),
                       _run(run, with_scales, partitions=1, compute_type=torch.bfloat16))


def test_fp8_compute_rounds_probabilities() -> None:
    case = make_case(seed=9, q_dtype=torch.bfloat16, kv_dtype=E4M3FN, lengths=(200, 450),
                     group=8, scales="tensor")
    # A query that fp8 represents exactly, so only the rounding of P differs.
    case = replace(case, query=case.query.to(E4M3FN).to(torch.bfloat16))
    run = make_pa_decode_gluon()
    expected = reference(case, case.query.double(), 0.125)
    fp8 = _run(run, case, partitions=1, compute_type=E4M3FN, softmax_scale=0.125)
    bf16 = _run(run, case, partitions=1, compute_type=torch.bfloat16, softmax_scale=0.125)
    fp8_error = float((fp8.double() - expected.out).abs().max())
    bf16_error = float((bf16.double() - expected.out).abs().max())
    assert float((fp8.double() - bf16.double()).abs().max()) > 2e-3
    assert fp8_error > 4 * bf16_error
    assert_within_roundoff(fp8, expected, compute_type=E4M3FN, output_dtype=torch.bfloat16,
                           partials=False)


def _packed_views(num_blocks: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's LBHNC fp8 page-16 views (K [16B,1,8,16,16], V 8 pages in) and the buffer."""
    gen = torch.Generator().manual_seed(1)
    buffer = torch.zeros(num_blocks * 16, 16 * 128, dtype=E4M3FN)
    for page in (0, 1, 8, 9, 16 * 7, 16 * 7 + 8, 16 * 127 + 7, 16 * 127 + 15):
        buffer[page] = (torch.randn(16 * 128, generator=gen)).to(E4M3FN)
    key = buffer.view(num_blocks * 16, 1, 8, 16, 16)
    value = buffer.view(num_blocks * 16, 1, 1, 128, 16)[8:]
    return buffer, key, value


def test_report_assertion_only_in_v0_1_26() -> None:
    _, key, value = _packed_views()
    assert tuple(key.shape) == (2048, 1, 8, 16, 16)
    assert tuple(value.shape) == (2040, 1, 1, 128, 16)
    query = torch.randn(3, 16, 128).bfloat16()
    context = torch.tensor([16, 2, 8], dtype=torch.int32)
    tables = torch.tensor([[0], [16 * 7], [16 * 127 + 7]], dtype=torch.int32)
    one = torch.ones(1)
    args = (query, key, value, context, tables, 128**-0.5, 1, 1)
    kwargs = dict(compute_type=E4M3FN, key_scale=one, value_scale=one)
    with pytest.raises(AssertionError) as excinfo:
        make_pa_decode_gluon("v0.1.26")(torch.empty_like(query), *args, **kwargs)
    assert str(excinfo.value) == (
        "key/value caches must have the same number of blocks, but got "
        "key=torch.Size([2048, 1, 8, 16, 16]), value=torch.Size([2040, 1, 1, 128, 16])"
    )
    untrimmed = torch.empty_like(query)
    make_pa_decode_gluon("v0.1.20")(untrimmed, *args, **kwargs)
    # vLLM 0.33 trims K to V's page count; every valid page id is below 2040.
    trimmed = torch.empty_like(query)
    make_pa_decode_gluon("v0.1.26")(trimmed, query, key[:2040], *args[2:], **kwargs)
    assert torch.equal(untrimmed, trimmed)
    assert bool(torch.isfinite(trimmed.float()).all()) and bool(trimmed.abs().sum() > 0)


def _base_args(**overrides) -> dict:
    """Valid fp8 arguments (4 seqs, Hkv 1, G 4, D 64, bs 16), with ``overrides`` applied."""
    args = dict(
        output=torch.empty(4, 4, 64, dtype=torch.bfloat16),
        query=torch.randn(4, 4, 64).bfloat16(),
        key_cache=torch.zeros(6, 1, 4, 16, 16, dtype=E4M3FN),
        value_cache=torch.zeros(6, 1, 1, 64, 16, dtype=E4M3FN),
        context_lengths=torch.tensor([3, 16, 20, 1], dtype=torch.int32),
        block_tables=torch.tensor([[1, 0], [2, 0], [3, 4], [5, 0]], dtype=torch.int32),
        softmax_scale=0.125,
        query_length=1,
        max_context_partition_num=1,
        compute_type=E4M3FN,
        key_scale=torch.ones(1),
        value_scale=torch.ones(1),
    )
    args.update(overrides)
    return args


PRECONDITIONS = {
    "query_length": (
        dict(query_length=5, query=torch.randn(20, 4, 64).bfloat16(),
             output=torch.empty(20, 4, 64, dtype=torch.bfloat16)),
        "query_length == 5 exceeds maximum of 4",
    ),
    "query_dtype": (
        dict(query=torch.randn(4, 4, 64)),
        "query tensor only support dtype in [(torch.float8_e4m3fn, torch.bfloat16, "
        "torch.float16)], but got query.dtype == torch.float32",
    ),
    "output_dtype": (
        dict(output=torch.empty(4, 4, 64)),
        "output tensor only support dtype in [(torch.bfloat16, torch.float16)], "
        "but got output.dtype == torch.float32",
    ),
    "group_size": (
        dict(query_length=4, query=torch.randn(16, 17, 64).bfloat16(),
             output=torch.empty(16, 17, 64, dtype=torch.bfloat16)),
        "equivalent_query_group_size=68 exceeds maximum of 64",
    ),
    "key_rank": (
        dict(key_cache=torch.zeros(6, 1, 64, 16, dtype=E4M3FN)),
        "Expected 5D key_cache tensor, but got shape torch.Size([6, 1, 64, 16])",
    ),
    "key_scale_dtype": (
        dict(key_scale=torch.ones(1, dtype=torch.float16)),
        "key_scale tensor only support dtype == torch.float32, "
        "but got key_scale.dtype == torch.float16",
    ),
    "scale_shapes": (
        dict(key_scale=torch.ones(6, 1, 16, 1), value_scale=torch.ones(5, 1, 16, 1)),
        "Key and value scales must have same shape, but got key: torch.Size([6, 1, 16, 1]), "
        "value: torch.Size([5, 1, 16, 1])",
    ),
    "query_scale_rank": (
        dict(query_scale=torch.ones(4, 4)),
        "Expected 3D query_scale tensor, but got shape torch.Size([4, 4])",
    ),
}


@pytest.mark.parametrize("name", sorted(PRECONDITIONS))
def test_preconditions_raise_aiters_messages(name: str) -> None:
    overrides, message = PRECONDITIONS[name]
    with pytest.raises(AssertionError) as excinfo:
        make_pa_decode_gluon("v0.1.20")(**_base_args(**overrides))
    assert str(excinfo.value) == message


def test_preconditions_are_explicit_raises_that_survive_python_O() -> None:
    """pytest rewrites the asserts of our installed distribution and -O drops them, so no
    part of the emulator may use an ``assert`` statement for AITER's preconditions."""
    from difftest.backends import (
        pa_decode_gluon_contract,
        pa_decode_gluon_emulator,
        pa_decode_gluon_fake_aiter,
        pa_decode_gluon_numerics,
    )

    for module in (pa_decode_gluon_contract, pa_decode_gluon_emulator,
                   pa_decode_gluon_fake_aiter, pa_decode_gluon_numerics):
        tree = ast.parse(Path(module.__file__).read_text())
        lines = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
        assert not lines, f"{module.__name__}: assert statements on lines {lines}"
    script = (
        "import torch\n"
        "from difftest.backends.pa_decode_gluon_emulator import make_pa_decode_gluon\n"
        "q = torch.zeros(20, 4, 64, dtype=torch.bfloat16)\n"
        "kv = torch.zeros(2, 1, 8, 16, 8, dtype=torch.bfloat16)\n"
        "try:\n"
        "    make_pa_decode_gluon()(torch.empty_like(q), q, kv, kv, torch.ones(4), "
        "torch.zeros(4, 1), 0.1, 5, 1)\n"
        "except AssertionError as exc:\n"
        "    print('AssertionError:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.strip() == "AssertionError: query_length == 5 exceeds maximum of 4", (
        done.stdout + done.stderr)


def test_fp8_flavour_follows_arch() -> None:
    gfx942 = make_pa_decode_gluon("v0.1.20", arch="gfx942")
    with pytest.raises(AssertionError) as excinfo:
        gfx942(**_base_args())
    assert str(excinfo.value) == (
        "key_cache tensor only support dtype in [(torch.float8_e4m3fnuz, torch.bfloat16, "
        "torch.float16)], but got key_cache.dtype == torch.float8_e4m3fn"
    )
    gfx942(**_base_args(
        key_cache=torch.zeros(6, 1, 4, 16, 16, dtype=E4M3FNUZ),
        value_cache=torch.zeros(6, 1, 1, 64, 16, dtype=E4M3FNUZ),
        compute_type=E4M3FNUZ,
    ))


def test_other_refusals() -> None:
    run = make_pa_decode_gluon()
    with pytest.raises(RuntimeError) as excinfo:
        run(**_base_args(value_cache=torch.zeros(6, 64, 16, dtype=E4M3FN)))
    assert str(excinfo.value) == "Unsupported value cache shape: torch.Size([6, 64, 16])"
    with pytest.raises(ValueError, match="misreads the x=16 fp8 layout"):
        run(**_base_args(key_scale=None, value_scale=None))
    with pytest.raises(ValueError, match="outside its storage"):
        run(**_base_args(block_tables=torch.tensor([[1, 0], [2, 0], [3, 9], [5, 0]],
                                                   dtype=torch.int32)))
    message = "unknown pa_decode_gluon contract revision 'v9'; known: v0.1.20, v0.1.26"
    with pytest.raises(ValueError, match=re.escape(message)):
        make_pa_decode_gluon("v9")


def test_revisions_and_splits() -> None:
    assert DEFAULT_REVISION == "v0.1.26" and set(REVISIONS) >= {"v0.1.20", "v0.1.26"}
    assert REVISIONS["v0.1.26"].asserts_equal_blocks
    assert not REVISIONS["v0.1.20"].asserts_equal_blocks
    custom = ContractRevision("custom", "none", True, "test")
    assert make_emulator(custom).revision is custom
    emulator = make_emulator(num_cus=304)
    assert [emulator.get_recommended_splits(n, 1) for n in (1, 76, 128, 608, 2048)] == [
        8, 8, 5, 1, 1,
    ]
    assert emulator.get_recommended_splits(16, 1, split_kv_blocks=4) == 8
    assert emulator.get_recommended_splits(64, 2, split_kv_blocks=2) == 6
    assert make_emulator(num_cus=256).get_recommended_splits(128, 1) == 4
    assert make_emulator(arch="gfx942").fp8 is E4M3FNUZ
    assert make_emulator().fp8 is E4M3FN


def _aiter_modules() -> dict:
    return {k: v for k, v in sys.modules.items() if k.split(".")[0] == "aiter"}


@pytest.mark.skipif(importlib.util.find_spec("aiter") is not None,
                    reason="an aiter package is installed (see the shadow_real test)")
def test_installed_as_aiter_registers_and_restores() -> None:
    before = _aiter_modules()
    with installed_as_aiter(revision="v0.1.20", arch="gfx942", num_cus=256) as emulator:
        from aiter import dtypes
        from aiter.ops.triton.gluon.pa_decode_gluon import (
            get_recommended_splits,
            pa_decode_gluon,
        )

        assert dtypes.fp8 is E4M3FNUZ and dtypes.bf16 is torch.bfloat16
        assert dtypes.fp16 is torch.float16
        assert get_recommended_splits(128, 1) == 4
        assert pa_decode_gluon.__self__ is emulator
        names = list(_aiter_modules())
        assert sorted(names) == sorted([
            "aiter", "aiter.dtypes", "aiter.ops", "aiter.ops.triton",
            "aiter.ops.triton.gluon", "aiter.ops.triton.gluon.pa_decode_gluon",
        ])
        assert all(sys.modules[name].__difftest_emulator__ == "v0.1.20" for name in names)
        with pytest.raises(RuntimeError, match="emulated 'aiter' module is already imported"):
            with installed_as_aiter():
                pass
    assert _aiter_modules() == before
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("aiter")


def test_installed_as_aiter_refuses_a_real_aiter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "aiter", raising=False)  # one imported earlier (ROCm)
    before = _aiter_modules()
    (tmp_path / "aiter").mkdir()
    (tmp_path / "aiter" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="real 'aiter' package is importable"):
        with installed_as_aiter():
            pass
    assert _aiter_modules() == before
    monkeypatch.setitem(sys.modules, "aiter", types.ModuleType("aiter"))
    with pytest.raises(RuntimeError, match="a real 'aiter' module is already imported"):
        with installed_as_aiter():
            pass


def test_installed_as_aiter_shadows_a_real_aiter_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``shadow_real``: a real AITER (imported, with submodules) is hidden for the block,
    no real submodule stays reachable, and all of it comes back exactly; nesting stays
    refused."""
    (tmp_path / "aiter").mkdir()
    (tmp_path / "aiter" / "__init__.py").write_text("REAL = True\n")
    (tmp_path / "aiter" / "extra.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    outside = _aiter_modules()  # an AITER this process imported before (ROCm), kept aside
    for name in outside:
        del sys.modules[name]
    try:
        real = importlib.import_module("aiter")
        importlib.import_module("aiter.extra")
        before = _aiter_modules()
        with installed_as_aiter(revision="v0.1.20", shadow_real=True) as emulator:
            from aiter.ops.triton.gluon.pa_decode_gluon import pa_decode_gluon

            assert pa_decode_gluon.__self__ is emulator
            assert not hasattr(sys.modules["aiter"], "REAL")
            assert "aiter.extra" not in sys.modules
            with pytest.raises(ModuleNotFoundError):
                importlib.import_module("aiter.extra")
            with pytest.raises(RuntimeError, match="an emulated 'aiter' module"):
                with installed_as_aiter(shadow_real=True):
                    pass
        assert _aiter_modules() == before and sys.modules["aiter"] is real
    finally:
        for name in list(_aiter_modules()):
            del sys.modules[name]
        sys.modules.update(outside)


@pytest.fixture
def vllm_sparse_pa(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The installed vLLM's unmodified ``sparse_pa`` module, loaded from its file.

    Its package ``__init__`` needs ``transformers``; ``SPARSE_BLOCK_SIZE`` is stubbed here.
    From vLLM 0.34 the file also imports its quantization utilities, which need the serving
    stack: without it the test skips naming the missing module.
    """
    kernel = kernel_availability("amd.ops.sparse_pa")
    if not kernel.available:
        pytest.skip(kernel.reason)
    spec = importlib.util.find_spec("vllm")
    path = Path(spec.submodule_search_locations[0]) / "models/minimax_m3/amd/ops/sparse_pa.py"
    stub = types.ModuleType("vllm.models.minimax_m3.common.ops.sparse_attn")
    stub.SPARSE_BLOCK_SIZE = 128
    monkeypatch.setitem(sys.modules, stub.__name__, stub)
    module_spec = importlib.util.spec_from_file_location("difftest_vllm_sparse_pa", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("revision", ["v0.1.20", "v0.1.26"])
def test_vllm_run_gluon_decode_calls_the_emulator(
    vllm_sparse_pa: types.ModuleType, revision: str
) -> None:
    buffer, key, value = _packed_views()
    gen = torch.Generator().manual_seed(6)
    query = torch.randn(4, 16, 128, generator=gen).bfloat16()
    sparse_bt = torch.zeros(4, 16, dtype=torch.int32)
    sparse_bt[0, :2] = torch.tensor([0, 1])
    sparse_bt[1, :1] = 16 * 7
    sparse_bt[3, :1] = 16 * 127 + 7
    sparse_ctx = torch.tensor([20, 3, 0, 16], dtype=torch.int32)
    output = torch.full_like(query, 7.0)
    scale = torch.tensor(1.0)
    with installed_as_aiter(revision=revision, shadow_real=True):
        vllm_sparse_pa._run_gluon_decode(
            query, key, value, sparse_bt, sparse_ctx, 1, 128**-0.5, output, scale, scale
        )
    # Reference from the raw pages: page p's K at buffer page p, V at buffer page p + 8.
    pages = buffer.float().view(-1, 8, 16, 16)  # [page, D//16, slot, 16]
    k_pages = pages.permute(0, 2, 1, 3).reshape(-1, 16, 128)  # [page, slot, D]
    v_pages = buffer.float().view(-1, 128, 16).transpose(1, 2)  # [page, slot, D]
    out, abs_mean, abs_sum = (torch.zeros(4, 16, 128, dtype=torch.float64) for _ in range(3))
    for row, length in enumerate(sparse_ctx.tolist()):
        if length == 0:
            continue
        tokens = torch.arange(length)
        page = sparse_bt[row, tokens // 16].long()
        k = k_pages[page, tokens % 16].double()
        v = v_pages[page + 8, tokens % 16].double()
        q = _cast(query[row].float(), E4M3FN).double()
        logits = q @ k.T * 128**-0.5
        out[row], abs_mean[row], abs_sum[row] = attend(logits, v[:, None].expand(-1, 16, -1))
    # get_recommended_splits(4, 1) = 8 partitions: the ctx-0 row is reduced to 0.
    assert bool((output[2] == 0).all())
    assert_within_roundoff(output, Reference(out, abs_mean, abs_sum), compute_type=E4M3FN,
                           output_dtype=torch.bfloat16, partials=True)
