"""The geometry kernels run at: layouts as objects, head sizes, KV heads (GQA), block sizes,
the dense family, and the backends that refuse what they cannot run."""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from difftest.backends.aiter_gluon import AiterGluon
from difftest.backends.torch_ref import TorchReference
from difftest.backends.triton_unified import TritonUnifiedAttention
from difftest.backends.vllm_triton_sparse import VllmTritonSparse
from difftest.case.layouts import LAYOUTS
from difftest.case.selection import build_rows
from difftest.case.spec import HEAD_DIMS, Case, CaseError
from difftest.contract.backend import RunInputs
from difftest.frontends.pytest_run import chosen_profile
from difftest.generation.capabilities import Capabilities
from difftest.generation.dense import (
    BLOCK_SIZES,
    DENSE_LAYOUTS,
    DENSE_SHARE,
    INT32_ELEMENTS,
    dense_cases,
    dense_rows,
)
from difftest.generation.generate import generated_cases
from difftest.generation.strategies import cases
from difftest.inputs.case_data import generate
from difftest.inputs.kv_cache import CachePool, build_cache, write_attended
from difftest.results.records import Status
from difftest.run.runner import run_case

CPU = torch.device("cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def dense(block: int = 32, head_dim: int = 80, kv_heads: int = 2, group: int = 3,
          layout: str = "split", seq_lens: tuple[int, ...] = (70, 33), dql: int = 1,
          page: int | None = None, spare: int = 3, **changes) -> Case:
    """A dense case: requests on blocks 1.. (block 0 and ``spare`` blocks past them unused)."""
    tables, at = [], 1
    for s in seq_lens:
        n = -(-s // block)
        tables.append(tuple(range(at, at + n)))
        at += n
    topk = max(len(t) for t in tables)
    rows = [tuple(r) for s in seq_lens for r in dense_rows(s, dql, block, topk)]
    fields = dict(num_blocks=at + spare, seq_lens=seq_lens, block_tables=tuple(tables),
                  selections=tuple(rows), decode_query_len=dql, num_q_heads=kv_heads * group,
                  num_kv_heads=kv_heads, head_dim=head_dim, block_size=block,
                  page_size=page or (16 if layout == "LBHNC" else block), kv_layout=layout,
                  softmax_scale=head_dim**-0.5, dense=True)
    return Case(**(fields | changes))


def naive_reference(case: Case) -> torch.Tensor:
    """Each row's causal attention from the logical tokens, written independently of
    torch-ref: the request's K/V gathered token by token, query head h on KV head
    h // (Hq / Hkv), float64 softmax."""
    data = generate(case, build_rows(case))
    out = torch.zeros((case.total_q, case.num_q_heads, case.head_dim), dtype=torch.float64)
    group = case.num_q_heads // case.num_kv_heads
    for row in range(case.total_q):
        request, pos = case.request_of_row(row), case.abs_pos(row)
        if pos < 0:
            continue
        table = case.block_tables[request]
        slots = [data.slot_of[table[t // case.block_size]] for t in range(pos + 1)]
        offsets = [t % case.block_size for t in range(pos + 1)]
        k = data.k_stored[slots, offsets].to(torch.float64) * case.k_scale  # [L, nkv, D]
        v = data.v_stored[slots, offsets].to(torch.float64) * case.v_scale
        kv_head = torch.arange(case.num_q_heads) // group  # [Hq]
        q = data.query[row].to(torch.float64)  # [Hq, D]
        scores = torch.einsum("hd,lhd->hl", q, k[:, kv_head]) * case.softmax_scale
        out[row] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=1), v[:, kv_head])
    return out


GEOMETRIES = [  # (block, head_dim, kv_heads, group, layout)
    (16, 64, 1, 1, "split"), (32, 80, 2, 3, "split"), (48, 96, 4, 2, "LHBNC"),
    (64, 128, 8, 1, "LBHNC"), (128, 256, 1, 16, "split"), (48, 80, 3, 5, "LBHNC"),
]


@pytest.mark.parametrize(("block", "head_dim", "kv_heads", "group", "layout"), GEOMETRIES)
def test_torch_ref_is_causal_attention_with_gqa(block, head_dim, kv_heads, group,
                                                  layout) -> None:
    case = dense(block, head_dim, kv_heads, group, layout, seq_lens=(block + 5, 0, 3), dql=2,
                 kv_dtype="float8_e4m3fn", k_scale=0.25, v_scale=2.0)
    truth = TorchReference().reference(RunInputs(case, CPU)).output
    torch.testing.assert_close(truth, naive_reference(case), rtol=1e-12, atol=1e-12)


def test_torch_ref_maps_query_heads_to_their_group() -> None:
    """Swapping two KV heads' data changes exactly the query heads of those two groups."""
    case = dense(kv_heads=4, group=2)
    inputs = RunInputs(case, CPU)
    data = inputs.data
    truth = TorchReference().reference(inputs).output
    swapped = data.k_stored.clone()
    swapped[:, :, [1, 2]] = data.k_stored[:, :, [2, 1]]
    object.__setattr__(data, "k_stored", swapped)
    moved = TorchReference().reference(inputs).output
    changed = [h for h in range(case.num_q_heads) if not torch.equal(truth[:, h], moved[:, h])]
    assert changed == [2, 3, 4, 5]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_layout_addresses_each_token_through_its_views(layout: str) -> None:
    """Token t of logical block l of a request, read through the page views at page id
    ``table[l] * block_page_stride + t // page_size``, is the stored token (K and V)."""
    case = dense(48, 80, 2, 2, layout, seq_lens=(100, 40), kv_dtype="bfloat16",
                 query_dtype="bfloat16")
    rows = build_rows(case)
    data = generate(case, rows)
    orders = LAYOUTS[layout].in_page_orders
    for order in orders:
        views = build_cache(case, data, rows, order)
        for request, table in enumerate(case.block_tables):
            for t in range(case.seq_lens[request]):
                block = table[t // case.block_size]
                page = block * views.block_page_stride + t % case.block_size // case.page_size
                slot = t % case.page_size
                stored = data.slot_of[block], t % case.block_size
                if order == "plain":
                    k, v = views.k[page, slot], views.v[page, slot]
                else:
                    x = 16 // views.raw.element_size()
                    k = views.k[page][:, :, slot].flatten(1)  # [nkv, D/x, x] -> [nkv, D]
                    v = views.v[page][:, slot // x, :, slot % x]
                assert torch.equal(k, data.k_stored[stored]), (order, request, t)
                assert torch.equal(v, data.v_stored[stored]), (order, request, t)


def test_split_layout_is_vllms_cache_and_has_no_shuffled_pages() -> None:
    case = dense(32, 64, 2, 1, "split", seq_lens=(40,))
    rows = build_rows(case)
    views = build_cache(case, generate(case, rows), rows, "plain")
    n, nkv, bs, d = case.num_blocks, 2, 32, 64
    assert views.raw.shape == (n, nkv, bs, 2 * d)  # vLLM's [num_blocks, nkv, block, 2 * D]
    assert views.k.shape == views.v.shape == (n, bs, nkv, d)
    assert views.v.data_ptr() - views.k.data_ptr() == d * views.raw.element_size()
    with pytest.raises(ValueError, match="layout split has no 'shuffled' pages"):
        build_cache(case, generate(case, rows), rows, "shuffled")


def pool_cases(seed: int, layout: str, count: int = 4) -> list[Case]:
    """Dense and sparse cases of one geometry (canaries, windows and padding at random)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        lens = tuple(0 if rng.random() < 0.2 else rng.randint(1, 150) for _ in range(2))
        lens = lens if any(lens) else (1, 0)
        case = dense(48, 80, 2, 2, layout, seq_lens=lens, spare=6 - sum(
            -(-s // 48) for s in lens), seed=rng.randint(0, 99), canary=rng.random() < 0.5,
            sliding_window=rng.choice((0, 1, 30)), kv_dtype=rng.choice(
                ("float16", "float8_e4m3fn")))
        out.append(case if rng.random() < 0.5 else case.replace(dense=False))
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
def test_the_pool_gives_fresh_bytes_at_other_geometries(layout: str, triton: bool) -> None:
    if triton and not INTERPRETED:
        pytest.skip("the Triton writer runs on CPU tensors only under the interpreter")
    pool = CachePool(triton=triton)
    for case in pool_cases(7, layout):
        rows = build_rows(case)
        data = generate(case, rows)
        for order in LAYOUTS[layout].in_page_orders:
            pooled, fresh = pool.cache(case, data, order), build_cache(case, data, rows, order)
            assert torch.equal(pooled.raw.view(torch.uint8), fresh.raw.view(torch.uint8))
            assert pooled.k.stride() == fresh.k.stride() and pooled.v.shape == fresh.v.shape


@pytest.mark.skipif(not INTERPRETED, reason="the Triton writer runs on CPU tensors only "
                                            "under the interpreter (a CPU session)")
@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC"])
def test_the_fused_writer_writes_the_torch_paths_bytes_at_other_geometries(layout) -> None:
    case = dense(48, 96, 3, 1, layout, seq_lens=(100, 7), canary=True, kv_dtype="float16")
    rows = build_rows(case)
    data = generate(case, rows)
    for order in ("plain", "shuffled"):
        fresh = build_cache(case, data, rows, order)
        paths = [torch.zeros_like(fresh.raw) for _ in range(2)]
        for path, triton in zip(paths, (False, True), strict=True):
            write_attended(case, data, path, order, triton)
        assert torch.equal(paths[0].view(torch.uint8), paths[1].view(torch.uint8)), order


@pytest.mark.parametrize(("block", "head_dim", "kv_heads", "group", "layout"), GEOMETRIES)
def test_triton_unified_agrees_on_dense_cases(block, head_dim, kv_heads, group,
                                              layout) -> None:
    case = dense(block, head_dim, kv_heads, group, layout, seq_lens=(block + 9, 0, 20), dql=2)
    result = run_case(case, TorchReference(), [TritonUnifiedAttention()], CPU).results[0]
    assert result.status is Status.AGREE, result.detail or result.comparison


class WrongGroup(TritonUnifiedAttention):
    """``unified_attention`` handed the K view with two KV heads swapped."""

    name = "triton-unified!wrong-group"

    def run(self, inputs: RunInputs) -> torch.Tensor:
        views = inputs.cache("plain")
        swapped = views.k.clone()
        swapped[:, :, [0, 1]] = views.k[:, :, [1, 0]]
        object.__setattr__(views, "k", swapped)
        return super().run(inputs)


def test_a_kernel_reading_the_wrong_kv_head_disagrees() -> None:
    case = dense(32, 64, 2, 4, "split", seq_lens=(40,))
    result = run_case(case, TorchReference(), [WrongGroup()], CPU).results[0]
    assert result.status is Status.DISAGREE


def test_dense_rows_run_as_one_sequence_per_request() -> None:
    from difftest.case.selection import kernel_sequences

    case = dense(seq_lens=(70, 0, 33), dql=3)
    assert kernel_sequences(case) == [(0, 3), (3, 1), (4, 1), (5, 1), (6, 3)]
    assert kernel_sequences(case.replace(dense=False)) == [(n, 1) for n in range(9)]


@pytest.mark.parametrize("backend", [VllmTritonSparse(), AiterGluon(emulated=True)],
                         ids=lambda b: b.name)
def test_the_sparse_decodes_refuse_other_geometry_and_say_which(backend) -> None:
    model = dense(128, 128, 1, 16, "LBHNC", seq_lens=(130,))
    assert backend.unsupported_reason(model.replace(dense=False), CPU) is None
    reason = backend.unsupported_reason(dense(48, 96, 2, 2, "split"), CPU)
    assert reason is not None and reason.startswith(
        "head_dim 96, block_size 48, page_size 48, num_kv_heads 2, kv_layout split: ")


def test_geometry_fields_left_at_the_model_keep_the_ids() -> None:
    """The dense flag off is left out of the content (the corpus ids stay)."""
    case = dense(128, 128, 1, 16, "LBHNC", seq_lens=(130,))
    assert "dense" in case.to_dict() and "dense" not in case.replace(dense=False).to_dict()
    assert case.replace(dense=False).case_id != case.case_id


def test_dense_family_draws_its_geometry() -> None:
    cases = generated_cases(60, 0, dense_cases)
    assert len(cases) == 60 and all(c.dense for c in cases)
    assert {c.block_size for c in cases} == set(BLOCK_SIZES)
    assert {c.head_dim for c in cases} == set(HEAD_DIMS)
    assert {c.kv_layout for c in cases} == set(DENSE_LAYOUTS)
    assert max(c.num_kv_heads for c in cases) == 8 and min(c.num_kv_heads for c in cases) == 1
    assert len({c.queries_per_kv for c in cases}) >= 8
    assert any(c.kernel_modes != ("dense",) for c in cases)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(dense_cases())
def test_every_dense_case_is_valid_and_round_trips(case: Case) -> None:
    assert Case.from_json(case.to_json()) == case
    for row in build_rows(case):
        assert row.context_len == max(row.abs_pos + 1, 0)


@given(st.sampled_from(sorted(LAYOUTS)), st.sampled_from((24, 40, 520)))
def test_block_sizes_off_the_grid_are_refused_by_name(layout: str, size: int) -> None:
    with pytest.raises(CaseError) as info:
        dense(32, 64, 1, 1, layout).replace(block_size=size, page_size=size)
    assert info.value.field == "page_size"


@pytest.fixture(scope="module")
def dense_strategy(difftest_session) -> st.SearchStrategy[Case]:
    """The dense family over what the configured backends run (as ``difftest run``)."""
    session = difftest_session
    return Capabilities.probe(session.backends, session.device).dense_strategy()


@settings(max_examples=max(1, settings.default.max_examples // (2 * DENSE_SHARE)))
@given(data=st.data())
def test_generated_dense_cases(data: st.DataObject, dense_strategy, check_example) -> None:
    """One dense example per ten of the profile's (ci 2, dev 5, nightly 200) on every
    configured backend, each in the variant fitted to it; a failure fails the test."""
    check_example(data.draw(dense_strategy, label="case"))


def test_huge_cases_put_their_last_block_past_int32_offsets() -> None:
    for case in generated_cases(6, 0, dense_cases, huge=True, kernel_modes=False):
        per_block = 2 * case.block_size * case.num_kv_heads * case.head_dim
        assert case.block_tables[0][0] == case.num_blocks - 1
        assert (case.num_blocks - 1) * per_block >= INT32_ELEMENTS


@pytest.mark.skipif(chosen_profile() != "nightly", reason="4 GiB caches: the nightly profile "
                    "runs them (HYPOTHESIS_PROFILE=nightly)")
def test_cases_past_int32_offsets(check_example) -> None:
    """Caches past 2**31 elements with the last block attended, on every configured backend;
    where the memory is short each is refused up front with the numbers (then skipped)."""
    results = [r for case in generated_cases(4, 0, dense_cases, huge=True)
               for result in check_example(case) for r in result.results]
    if all(r.detail.startswith("case refused before any allocation") for r in results):
        pytest.skip(results[0].detail)


def test_the_sparse_family_reaches_rows_past_2048_tokens_above_top_k_16() -> None:
    """With max_topk 64 the sparse strategy draws top-k 32 and 64, rows past 16 x 128
    tokens; the default (max_topk 16) draws the model's top-k at most."""
    drawn = generated_cases(40, 0, cases, max_topk=64)
    long = [c for c in drawn if max(r.context_len for r in build_rows(c)) > 2048]
    assert long and {c.topk for c in long} <= {32, 64}
    assert max(c.topk for c in generated_cases(40, 0, cases)) == 16


def test_triton_unified_agrees_on_a_row_of_top_k_32_past_2048_tokens() -> None:
    """One row selecting 18 blocks in a scrambled order, 2177 tokens, top-k 32."""
    lanes = (17, 0, *range(16, 0, -1)) + (-1,) * 14
    case = Case(num_blocks=20, seq_lens=(2177,), block_tables=(tuple(range(19, 1, -1)),),
                selections=(lanes,), num_q_heads=2)
    result = run_case(case, TorchReference(), [TritonUnifiedAttention()], CPU).results[0]
    assert build_rows(case)[0].context_len == 2177
    assert result.status is Status.AGREE, result.detail


class ReadsShuffled(TorchReference):
    """A backend that reads shuffled pages (and returns the reference)."""

    name = "reads-shuffled"
    in_page_orders = ("shuffled",)


def test_a_backend_reading_pages_the_layout_lacks_is_unsupported() -> None:
    split = dense(32, 64, 1, 1, "split", seq_lens=(40,))
    result = run_case(split, TorchReference(), [ReadsShuffled()], CPU).results[0]
    assert result.status is Status.UNSUPPORTED
    assert result.detail == ("it reads shuffled pages, and layout split has none (its in-page "
                             "orders: plain)")
    planes = split.replace(kv_layout="LHBNC")
    assert run_case(planes, TorchReference(), [ReadsShuffled()], CPU).results[0].status is \
        Status.AGREE
