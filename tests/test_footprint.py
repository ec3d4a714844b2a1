"""A case's memory is estimated from its fields, and a case that cannot fit is refused before
anything is allocated, with the numbers, as a case-level refusal (no backend error)."""

from __future__ import annotations

import time

import pytest
import torch

from difftest.backends.torch_ref import TorchReference
from difftest.backends.triton_unified import TritonUnifiedAttention
from difftest.case.spec import Case
from difftest.inputs.kv_cache import CachePool
from difftest.results.records import Status
from difftest.run import footprint
from difftest.run.footprint import GIB, refusal
from difftest.run.runner import run_case
from tests.fake_backends import Rounded

CPU = torch.device("cpu")
REFERENCE = TorchReference()


def one_request(num_blocks: int, **changes) -> Case:
    """The issue's shape: one 128-token request on the last block of a large cache."""
    return Case(num_blocks=num_blocks, seq_lens=(128,), block_tables=((num_blocks - 1,),),
                selections=((0,),), **changes)


def test_the_estimate_counts_each_in_page_order_of_the_layouts_buffer() -> None:
    case = one_request(196608)
    need = footprint.footprint(case, 2, REFERENCE)
    assert need.cache == 196608 * 2 * 128 * 128 * 2  # LBHNC [n, 2, 128, 128] fp16: 12 GiB
    assert need.orders == 2 and need.total > 2 * need.cache
    assert need.data == 2 * 128 * 128 * (2 + 4)  # one block held: stored K/V and their draws
    fp8 = footprint.footprint(case.replace(kv_dtype="float8_e4m3fn", k_scale=0.5), 1, REFERENCE)
    assert fp8.cache == need.cache // 2


@pytest.mark.parametrize("num_blocks", [196608, 1048576])
def test_a_cache_larger_than_the_memory_is_refused_with_the_numbers(num_blocks: int,
                                                                    monkeypatch) -> None:
    monkeypatch.setattr(footprint, "available_bytes", lambda device: (8 << 30, "a test"))
    reason = refusal(one_request(num_blocks), CPU, ["plain", "shuffled"], REFERENCE)
    assert reason is not None and reason.startswith("case refused before any allocation")
    cache = one_request(num_blocks).layout.raw_bytes(one_request(num_blocks), 2) / GIB
    assert f"cache {cache:.1f} GiB x 2 in-page orders" in reason
    assert "cpu has 8.0 GiB available (a test)" in reason and "num_blocks" in reason
    assert refusal(one_request(128), CPU, ["plain"], REFERENCE) is None


def test_pooled_buffers_count_as_available(monkeypatch) -> None:
    case = one_request(65536)  # 4 GiB per order
    monkeypatch.setattr(footprint, "available_bytes", lambda device: (1 << 30, "a test"))
    assert refusal(case, CPU, ["plain"], REFERENCE) is not None
    assert refusal(case, CPU, ["plain"], REFERENCE, reusable=5 << 30) is None


def huge() -> Case:
    """1 TiB of cache (vLLM's split layout, 2**20 blocks of 512 tokens, 8 KV heads), one
    block attended."""
    n = 1 << 20
    return Case(num_blocks=n, seq_lens=(512,), block_tables=((n - 1,),), selections=((0,),),
                num_q_heads=8, num_kv_heads=8, head_dim=64, block_size=512, page_size=512,
                kv_layout="split", dense=True)


def test_the_runner_refuses_the_case_for_every_backend_before_allocating() -> None:
    """Every backend is ``unsupported`` with the same reason, no reference is computed, and
    it is immediate."""
    case = huge()
    start = time.perf_counter()
    result = run_case(case, TorchReference(), [TritonUnifiedAttention(), Rounded()], CPU,
                      caches=CachePool())
    assert time.perf_counter() - start < 1.0 and "reference" not in result.timings
    assert {r.status for r in result.results} == {Status.UNSUPPORTED}
    details = {r.detail for r in result.results}
    assert len(details) == 1 and "GiB" in details.pop()


def test_only_the_caches_some_backend_builds_are_counted() -> None:
    """The reference reads no cache: with backends that build none, the 1 TiB cache is not
    needed and the case runs (one block of data)."""
    result = run_case(huge(), TorchReference(), [Rounded()], CPU)
    assert [r.status for r in result.results] == [Status.AGREE]
    assert footprint.footprint(huge(), 0, REFERENCE).total < 1 << 30


class ScratchHungry(TorchReference):
    """A reference that states 1 PiB of scratch."""

    name = "scratch-hungry"

    def working_bytes(self, case: Case) -> int:
        return 1 << 50


def test_the_reference_states_its_own_scratch() -> None:
    """The estimate takes the reference's scratch from the reference itself: a small case is
    refused under a reference that says it needs 1 PiB, and runs under torch-ref."""
    case = one_request(128)
    refused = run_case(case, ScratchHungry(), [Rounded()], CPU).results[0]
    assert refused.status is Status.UNSUPPORTED and "reference 1048576.0 GiB" in refused.detail
    assert run_case(case, REFERENCE, [Rounded()], CPU).results[0].status is Status.AGREE
    assert footprint.footprint(case, 1, REFERENCE).reference == REFERENCE.working_bytes(case)
