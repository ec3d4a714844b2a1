"""The pooled cache (difftest.inputs.kv_cache.CachePool) gives every case the bytes of a fresh
build_cache, in every sequence of cases; its Triton writer gives the torch path's bytes.

Bytes are compared as uint8 views, so NaN payloads count. The Triton kernel runs under the
interpreter in a CPU session (TRITON_INTERPRET=1, set by the CPU runtime) and compiled on a
GPU (the CUDA tests: ``python -m pytest tests/test_cache_reuse.py`` on a GPU machine).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from difftest.backends.torch_ref import TorchReference
from difftest.case.selection import build_rows
from difftest.case.spec import Case
from difftest.contract.backend import RunInputs
from difftest.generation.corpus import load_corpus
from difftest.inputs.case_data import generate
from difftest.inputs.kv_cache import (
    IN_PAGE_ORDERS,
    CachePool,
    PooledCacheModified,
    build_cache,
    write_attended,
)
from difftest.primitives.dtypes import KV_DTYPES
from difftest.results.records import Status
from difftest.run.runner import run_case
from tests.fake_backends import Perturbed, Rounded

CPU = torch.device("cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="the Triton writer runs on CPU tensors only under the interpreter "
                            "(a CPU session); a GPU session runs it compiled (the CUDA tests)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def generated(seed: int, num_blocks: int = 48, kv_dtype: str = "float16",
              layout: str = "LBHNC", block_zero: bool | None = None) -> Case:
    """A random case of fixed geometry: random requests, tables and selections (duplicates,
    padding, lanes past the request), canary and sliding window at random; ``block_zero``:
    whether physical block 0 is in a table (``None``: at random)."""
    rng = random.Random(seed)
    batch = rng.randint(1, 4)
    seq_lens = [0 if rng.random() < 0.15 else rng.randint(1, 700) for _ in range(batch)]
    needed = [-(-s // 128) for s in seq_lens]
    zero = rng.random() < 0.5 if block_zero is None else block_zero
    pool = list(range(0 if zero else 1, num_blocks))
    physical = rng.sample(pool, sum(needed))
    if zero and 0 not in physical and physical:
        physical[rng.randrange(len(physical))] = 0
    tables, at = [], 0
    for n in needed:
        tables.append(tuple(physical[at:at + n]))
        at += n
    topk = rng.randint(1, 8)
    lanes = (-1, 0, 0, 1, 2, 3, 4, 5, 9)
    selections = tuple(tuple(rng.choice(lanes) for _ in range(topk)) for _ in range(batch))
    scale = rng.choice((0.05, 0.5, 3.0)) if kv_dtype.startswith("float8") else 1.0
    return Case(num_blocks=num_blocks, seq_lens=tuple(seq_lens), block_tables=tuple(tables),
                selections=selections, kv_dtype=kv_dtype, k_scale=scale, v_scale=scale,
                kv_layout=layout, seed=seed, canary=rng.random() < 0.4,
                sliding_window=rng.choice((0, 0, 1, 40, 200)), name=f"generated-{seed}")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def assert_same_cache(pooled, fresh) -> None:
    assert pooled.raw.shape == fresh.raw.shape and pooled.raw.dtype == fresh.raw.dtype
    assert pooled.raw.stride() == fresh.raw.stride()
    assert torch.equal(bits(pooled.raw), bits(fresh.raw))
    for name in ("k", "v"):
        a, b = getattr(pooled, name), getattr(fresh, name)
        assert a.shape == b.shape and a.stride() == b.stride(), name
        assert a.data_ptr() - pooled.raw.data_ptr() == b.data_ptr() - fresh.raw.data_ptr()
    assert (pooled.layout, pooled.in_page_order, pooled.block_page_stride,
            pooled.v_page_offset) == (fresh.layout, fresh.in_page_order,
                                      fresh.block_page_stride, fresh.v_page_offset)


def run_sequence(cases: list[Case], pool: CachePool, device: torch.device) -> None:
    """Every case through the pool, both orders, each equal to a fresh build."""
    for case in cases:
        rows = build_rows(case)
        data = generate(case, rows, device)
        for order in IN_PAGE_ORDERS:
            assert_same_cache(pool.cache(case, data, order), build_cache(case, data, rows, order))
        assert pool.buffers() <= 4


def sequence(kv_dtype: str, layout: str, start: int, count: int = 6,
             num_blocks: int = 48) -> list[Case]:
    """Cases of one geometry (so the pool reuses its buffers): block 0 in the first, not in
    the second, then at random."""
    zeros = [True, False] + [None] * (count - 2)
    return [generated(start + i, num_blocks, kv_dtype, layout, zeros[i]) for i in range(count)]


@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_pooled_torch_path_equals_fresh_builds_over_a_sequence(kv_dtype: str, layout: str) -> None:
    cases = sequence(kv_dtype, layout, 100)
    assert any(c.canary for c in cases) and any(not c.canary for c in cases)
    run_sequence(cases, CachePool(triton=False), CPU)


@needs_interpreter
@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_pooled_triton_writer_equals_fresh_builds_over_a_sequence(kv_dtype: str,
                                                                   layout: str) -> None:
    run_sequence(sequence(kv_dtype, layout, 200), CachePool(triton=True), CPU)


@needs_interpreter
@pytest.mark.parametrize("case", load_corpus(), ids=lambda c: c.name)
def test_triton_writer_equals_the_torch_path_on_the_corpus(case: Case) -> None:
    """Into a buffer of garbage (every block it writes is written whole), byte for byte;
    then the corpus case through a pool after a generated case of its geometry."""
    rows = build_rows(case)
    data = generate(case, rows)
    for order in IN_PAGE_ORDERS:
        fresh = build_cache(case, data, rows, order)
        shape = fresh.raw.shape
        torch_path = torch.randint(0, 256, (fresh.raw.numel() * fresh.raw.element_size(),),
                                   dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        triton_path = torch_path.clone()
        write_attended(case, data, torch_path.view(fresh.raw.dtype).view(shape), order, False)
        write_attended(case, data, triton_path.view(fresh.raw.dtype).view(shape), order, True)
        assert torch.equal(torch_path, triton_path), order
    before = generated(case.seed + 1, case.num_blocks, case.kv_dtype, case.kv_layout)
    run_sequence([before, case], CachePool(triton=True), CPU)


def test_the_corpus_through_one_pool_equals_fresh_builds() -> None:
    """Keys change between corpus cases (blocks, dtypes, layouts): each slot is dropped and
    rebuilt, never more than one buffer per (layout, order)."""
    run_sequence(load_corpus() * 2, CachePool(triton=False), CPU)


def test_a_pool_reuses_its_buffer_and_drops_it_when_the_geometry_changes() -> None:
    pool = CachePool(triton=False)
    first, second = generated(1), generated(2)
    views = [pool.cache(c, generate(c, build_rows(c)), "plain") for c in (first, second)]
    assert views[0].raw.data_ptr() == views[1].raw.data_ptr() and pool.buffers() == 1
    other = generated(3, num_blocks=40)
    assert pool.cache(other, generate(other, build_rows(other)), "plain").raw.shape[0] == 40
    assert pool.buffers() == 1  # the 48-block buffer was dropped
    fp8 = generated(4, kv_dtype="float8_e4m3fn", layout="LHBNC")
    pool.cache(fp8, generate(fp8, build_rows(fp8)), "shuffled")
    assert pool.buffers() == 2
    pool.clear()
    assert pool.buffers() == 0


def test_runinputs_with_a_pool_give_the_caches_of_runinputs_without() -> None:
    pool = CachePool()
    for case in sequence("bfloat16", "LHBNC", 300, count=3):
        pooled, fresh = RunInputs(case, CPU, pool=pool), RunInputs(case, CPU)
        for order in IN_PAGE_ORDERS:
            assert_same_cache(pooled.cache(order), fresh.cache(order))
    assert RunInputs(generated(1), CPU).pool is None


def test_a_write_outside_the_attended_blocks_is_caught_within_check_chunks_cases() -> None:
    pool = CachePool(triton=False, check_chunks=4)
    cases = sequence("float16", "LBHNC", 400, count=8, num_blocks=48)
    case = cases[0]
    views = pool.cache(case, generate(case, build_rows(case)), "plain")
    attended = {b for c in cases[:6] for b in generate(c, build_rows(c)).physical_blocks}
    untouched = max(set(range(1, 48)) - attended)  # no build rewrites it
    views.raw[untouched, 1, 5] = 1.0  # a backend writing into its input cache
    with pytest.raises(PooledCacheModified, match="wrote into its input cache"):
        for later in cases[1:6]:
            pool.cache(later, generate(later, build_rows(later)), "plain")
    assert pool.buffers() == 0  # dropped: the next build is fresh and right
    run_sequence(cases[6:], pool, CPU)


class Agrees(Rounded):
    """Reads the plain cache (as a kernel would), then returns the rounded reference;
    ``poke`` also writes into that cache, as no kernel may."""

    name = "agrees"
    in_page_orders = ("plain",)
    poke = False

    def run(self, inputs: RunInputs) -> torch.Tensor:
        raw = inputs.cache("plain").raw
        if self.poke:
            raw[inputs.case.num_blocks - 1, 0, 0] = 2.0
        return super().run(inputs)


class Disagrees(Agrees, Perturbed):
    """Reads the plain cache, then returns fake_backends.Perturbed's wrong output."""

    name = "disagrees"


def test_run_case_with_a_pool_gives_the_same_verdicts_and_clears_it_after_a_failure() -> None:
    pool = CachePool()
    cases = [c for c in sequence("float16", "LBHNC", 500, count=4) if c.total_q][:3]
    for case in cases:
        with_pool = run_case(case, TorchReference(), [Agrees()], CPU, caches=pool)
        without = run_case(case, TorchReference(), [Agrees()], CPU)
        assert [r.status for r in with_pool.results] == [r.status for r in without.results]
        assert with_pool.results[0].status is Status.AGREE and pool.buffers() == 1
    result = run_case(cases[0], TorchReference(), [Disagrees()], CPU, caches=pool)
    assert result.results[0].status is Status.DISAGREE and pool.buffers() == 0


def test_run_case_blames_the_backend_that_wrote_into_a_pooled_cache() -> None:
    """A write outside the attended blocks agreed in its own case and was found by the pool
    a case later (``PooledCacheModified``, that case's error); the runner's read-only check
    of the inputs now makes it the writer's error in its own case, and the pool is dropped,
    so the next case builds afresh and agrees."""
    pool = CachePool(check_chunks=1)  # every restore verifies all of blocks 1..
    poking = Agrees()
    poking.poke = True
    cases = [c for c in sequence("float16", "LBHNC", 600, count=6) if c.total_q
             and 47 not in generate(c, build_rows(c)).physical_blocks][:2]
    first = run_case(cases[0], TorchReference(), [poking], CPU, caches=pool)
    assert first.results[0].status is Status.ERROR and pool.buffers() == 0
    assert first.results[0].detail.startswith("wrote into its inputs: the plain cache changed")
    second = run_case(cases[1], TorchReference(), [Agrees()], CPU, caches=pool)
    assert second.results[0].status is Status.AGREE


@needs_cuda
@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_gpu_pool_equals_fresh_builds_and_the_cpu(kv_dtype: str, layout: str) -> None:
    """The compiled kernel (the pool's default on CUDA) against the torch path on the GPU,
    and the GPU's bytes against the CPU's."""
    gpu = torch.device("cuda")
    pool = CachePool()
    for case in [*sequence(kv_dtype, layout, 700, count=8),
                 *(c for c in load_corpus() if c.kv_dtype == kv_dtype and c.kv_layout == layout)]:
        rows = build_rows(case)
        data = generate(case, rows, gpu)
        for order in IN_PAGE_ORDERS:
            pooled = pool.cache(case, data, order)
            assert_same_cache(pooled, build_cache(case, data, rows, order))
            assert torch.equal(bits(pooled.raw), bits(RunInputs(case, CPU).cache(order).raw))


@needs_cuda
def test_gpu_pool_equals_fresh_builds_at_production_shape() -> None:
    from benchmarks.throughput import production_case

    gpu = torch.device("cuda")
    pool = CachePool()
    for seed in (1, 2, 3):
        case = production_case(seed)
        if seed == 3:
            case = case.replace(kv_layout="LHBNC", canary=True, sliding_window=300)
        rows = build_rows(case)
        data = generate(case, rows, gpu)
        for order in IN_PAGE_ORDERS:
            fresh = build_cache(case, data, rows, order)
            pooled = pool.cache(case, data, order)
            assert torch.equal(pooled.raw.view(torch.uint8), fresh.raw.view(torch.uint8))
            del fresh


def test_a_new_geometry_refills_the_slots_memory_when_it_fits() -> None:
    """A smaller or narrower buffer after a larger one lives in the larger one's memory (no
    fresh pages), with the bytes of a fresh build; a larger one gets new memory."""
    pool = CachePool(triton=False)
    big = generated(1)  # 48 blocks, float16
    base = pool.cache(big, generate(big, build_rows(big)), "plain").raw.data_ptr()
    for case in (generated(2, num_blocks=40), generated(3, kv_dtype="float8_e4m3fn")):
        data = generate(case, build_rows(case))
        views = pool.cache(case, data, "plain")
        assert views.raw.data_ptr() == base and pool.buffers() == 1
        fresh = build_cache(case, data, build_rows(case), "plain").raw
        assert torch.equal(views.raw.view(torch.uint8), fresh.view(torch.uint8))
    bigger = generated(4, num_blocks=200)
    assert pool.cache(bigger, generate(bigger, build_rows(bigger)), "plain").raw.shape[0] == 200
