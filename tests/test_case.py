"""Case validation, serialisation and identity."""

from __future__ import annotations

import pytest

from difftest.case.spec import Case, CaseError
from difftest.generation.corpus import load_corpus


def small(**changes) -> Case:
    base = dict(num_blocks=128, seq_lens=(200,), block_tables=((127, 3),),
                selections=((0, 1, -1),))
    base.update(changes)
    return Case(**base)


def test_geometry_of_the_report() -> None:
    case = small(kv_dtype="float8_e4m3fn", k_scale=0.5)
    assert (case.k_view_pages, case.v_view_pages, case.max_page_id) == (2048, 2040, 2039)
    dense = small(kv_layout="LHBNC")
    assert (dense.k_view_pages, dense.v_view_pages, dense.block_page_stride) == (1024, 1024, 8)


def test_json_round_trip_keeps_id_and_fields() -> None:
    for case in load_corpus():
        again = Case.from_json(case.to_json())
        assert again == case and again.case_id == case.case_id and again.name == case.name


def test_id_depends_on_content_not_name() -> None:
    assert small(name="a").case_id == small(name="b").case_id
    assert small(seed=1).case_id != small(seed=2).case_id


@pytest.mark.parametrize(
    ("changes", "field", "allowed"),
    [
        ({"block_tables": ((128, 3),)}, "block_tables[0][0]", "0..127 (num_blocks = 128)"),
        ({"num_kv_heads": 9}, "num_kv_heads", "integer 1..8"),
        ({"num_kv_heads": 3}, "num_q_heads", "a multiple of num_kv_heads"),
        ({"head_dim": 112}, "head_dim", "64, 80, 96, 128, 256"),
        ({"page_size": 24}, "page_size", "a multiple of 16 in 16..512"),
        ({"block_size": 136}, "block_size", "a multiple of page_size up to 512"),
        ({"kv_layout": "split"}, "page_size", "page_size = block_size"),
        ({"decode_query_len": 5}, "decode_query_len", "integer 1..4"),
        ({"query_dtype": "float64"}, "query_dtype", "float32, float16, bfloat16"),
        ({"k_scale": 2.0}, "k_scale", "1.0 (scales apply to fp8 KV only)"),
        ({"kv_dtype": "float8_e4m3fn", "v_scale": 0.0}, "v_scale", "finite 1e-06..1e+06"),
        ({"selections": ((0, 1, -2),)}, "selections[0][2]", "-1 (padding)"),
        ({"selections": ((0, 1),), "seq_lens": (200, 100), "block_tables": ((127, 3), (5,))},
         "selections", "batch * decode_query_len = 2"),
        ({"block_tables": ((127,),)}, "block_tables[0]", "exactly cdiv(seq_len, 128) = 2"),
        ({"block_tables": ((3, 3),)}, "block_tables[0][1]", "each physical block holds one"),
        ({"seq_lens": (0,), "block_tables": ((),), "num_blocks": 0}, "num_blocks",
         "integer 1..1048576"),
        ({"kv_layout": "NHD"}, "kv_layout", "LBHNC, LHBNC, split"),
        ({"dense": True, "selections": ((1, 0, -1),)}, "selections[0]",
         "its causal blocks in order, then -1: [0, 1, -1]"),
        ({"dense": True, "selections": ((0,),)}, "selections[0]", "at least 2 lanes"),
    ],
)
def test_bad_fields_name_field_and_range(changes, field, allowed) -> None:
    with pytest.raises(CaseError) as info:
        small(**changes)
    assert info.value.field == field
    assert allowed in str(info.value)
    assert str(info.value).startswith(f"{field}: ")


def test_from_dict_rejects_unknown_fields_and_wrong_ids() -> None:
    data = small().to_dict()
    with pytest.raises(CaseError, match=r"^k_cale: is not a case field"):
        Case.from_dict(data | {"k_cale": 1.0})
    with pytest.raises(CaseError, match=r"^id: "):
        Case.from_dict(data | {"id": "0" * 16})
