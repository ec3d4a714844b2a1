"""The physical cache and its page-16 views: addresses, shuffles and canaries."""

from __future__ import annotations

import pytest
import torch

from difftest.case.selection import build_rows
from difftest.case.spec import Case
from difftest.inputs.case_data import generate
from difftest.inputs.kv_cache import POISON, build_cache

KV = ("float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz")


def case_for(kv_dtype: str, layout: str) -> Case:
    scale = 0.5 if kv_dtype.startswith("float8") else 1.0
    return Case(num_blocks=128, seq_lens=(200, 37), block_tables=((127, 3), (0,)),
                selections=((0, 1, -1), (0, -1, -1)), kv_dtype=kv_dtype, k_scale=scale,
                v_scale=scale, kv_layout=layout, seed=11)


@pytest.mark.parametrize("kv_dtype", KV)
def test_lbhnc_views_have_the_reported_shapes(kv_dtype: str) -> None:
    case = case_for(kv_dtype, "LBHNC")
    views = build_cache(case, generate(case, build_rows(case)), build_rows(case), "shuffled")
    x = 16 // torch.empty((), dtype=views.raw.dtype).element_size()
    assert tuple(views.k.shape) == (2048, 1, 128 // x, 16, x)
    assert tuple(views.v.shape) == (2040, 1, 16 // x, 128, x)
    assert views.v.data_ptr() - views.k.data_ptr() == 8 * views.k.stride(0) * views.k.element_size()
    if x == 16:
        assert tuple(views.k.shape) == (2048, 1, 8, 16, 16)
        assert tuple(views.v.shape) == (2040, 1, 1, 128, 16)


@pytest.mark.parametrize("kv_dtype", KV)
@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC"])
def test_one_page_id_addresses_k_and_v_of_a_token(kv_dtype: str, layout: str) -> None:
    case = case_for(kv_dtype, layout)
    data = generate(case, build_rows(case))
    rows = build_rows(case)
    plain = build_cache(case, data, rows, "plain")
    shuffled = build_cache(case, data, rows, "shuffled")
    x = 16 // plain.raw.element_size()
    slot = data.slot_of[127]
    for t in (0, 15, 16, 127):  # physical block 127 is fully attended by row 0
        page = 127 * case.block_page_stride + t // 16
        i = t % 16
        k_ref = data.k_stored[slot, t, 0].float()
        v_ref = data.v_stored[slot, t, 0].float()
        assert torch.equal(plain.k[page, i, 0].float(), k_ref)
        assert torch.equal(plain.v[page, i, 0].float(), v_ref)
        k_sh = shuffled.k[page, 0].float()  # [D/x, 16, x]
        v_sh = shuffled.v[page, 0].float()  # [16/x, D, x]
        assert torch.equal(k_sh[:, i, :].reshape(-1), k_ref)
        assert torch.equal(v_sh[i // x, :, i % x], v_ref)


def test_unattended_pages_are_nan_and_unwritten_slots_are_poison() -> None:
    case = case_for("float16", "LBHNC")
    views = build_cache(case, generate(case, build_rows(case)), build_rows(case), "plain")
    k = views.k.float()
    assert torch.isnan(k[5 * 16]).all()  # block 5: owned by nobody
    # K-view pages 2040..2047 are the last block's V pages, seen through K (what the trim drops)
    assert torch.equal(views.k[2040:2048], views.v[2032:2040])
    # request 1 wrote 37 tokens of block 0: page 2 holds tokens 32..36, then poison
    assert torch.isfinite(k[2, :5]).all() and (k[2, 5:] == POISON).all()
    assert torch.isnan(k[3]).all()  # page 3 of block 0: no token attended
    # block 3 holds tokens 128..199 of request 0: pages 0..4 attended, page 5+ NaN
    assert torch.isfinite(k[3 * 16 + 4, :8]).all() and torch.isnan(k[3 * 16 + 5]).all()


def test_null_block_page_zero_is_finite_even_when_unowned() -> None:
    case = Case(num_blocks=8, seq_lens=(10,), block_tables=((7,),), selections=((0,),))
    views = build_cache(case, generate(case, build_rows(case)), build_rows(case), "plain")
    assert (views.k[0].float() == POISON).all() and (views.v[0].float() == POISON).all()
    assert torch.isnan(views.k[1].float()).all()
