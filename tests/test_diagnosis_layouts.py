"""The diagnosis reads every layout through its layout object, and never fails on a generated
case of either family.

The row model recomputes a row from the physical cache as the case's layout addresses it
(``KVLayout.planes``): on every layout, the read a row should make recomputes the reference's
row. A fault-injected kernel (``mutants.kernel_faults``) run by the engine on generated
sparse and dense cases (several KV heads, head sizes 64-256, every layout) gets a diagnosis,
never ``diagnosis failed``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from difftest.backends.torch_ref import TorchReference
from difftest.case.spec import Case
from difftest.contract.backend import RunInputs
from difftest.contract.tolerance import Tolerance
from difftest.generation.dense import dense_cases
from difftest.generation.strategies import cases
from difftest.inputs.kv_cache import CacheViews
from difftest.judgement.diagnosis import FAILED, _RowModel, hypothesis_of
from difftest.run.runner import Status, run_case
from mutants.injection import MutantBackend, Mutation
from mutants.kernel_faults import Fault, PagedTorch

CPU = torch.device("cpu")


def _case(layout: str, block_size: int, page_size: int) -> Case:
    """Two requests over 4 KV heads of 2 query heads each, fp8, partial last blocks."""
    return Case(num_blocks=12, seq_lens=(2 * block_size - 5, block_size + 7),
                block_tables=((7, 2), (4, 11)), selections=((0, 1), (0, 1)),
                block_size=block_size, page_size=page_size, kv_layout=layout,
                num_q_heads=8, num_kv_heads=4, head_dim=64, query_dtype="float16",
                kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=2.0, name=f"{layout}-gqa")


LAYOUT_CASES = [_case("split", 32, 32), _case("LHBNC", 64, 16), _case("LBHNC", 64, 16)]


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: c.kv_layout)
def test_the_read_a_row_should_make_recomputes_the_reference(case: Case) -> None:
    """On every layout the model's planes hold K and V where the layout puts them: the
    correct read of each row recomputes the reference's row (split: ``raw[0]`` is block 0,
    not K)."""
    inputs = RunInputs(case, CPU)
    truth = TorchReference().reference(inputs)
    backend = PagedTorch()
    model = _RowModel(inputs, Tolerance.of(backend.precision(case, CPU), case),
                      backend.empty_row_output(case))
    for n in range(case.total_q):
        row = model.recompute(model.base(n))
        assert torch.allclose(row.output[0], truth.output[n], rtol=1e-9, atol=1e-12), n


def _swap_sides(case: Case, views: CacheViews) -> CacheViews:
    return dataclasses.replace(views, k=views.v, v=views.k)


SIDES_SWAPPED = Mutation("kv-swapped", "K read from the V view and V from the K view",
                         cache=_swap_sides, diagnosis="kv-sides-swapped")


def test_split_sides_swapped_are_named() -> None:
    """A kernel that reads V for K on vLLM's split cache is named as such."""
    case = LAYOUT_CASES[0]
    outcome = run_case(case, TorchReference(), [MutantBackend(PagedTorch(), SIDES_SWAPPED)],
                       CPU).results[0]
    assert outcome.status is Status.DISAGREE
    assert hypothesis_of(outcome.comparison.diagnosis[0]) == "kv-sides-swapped", (
        outcome.comparison.diagnosis)


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: c.kv_layout)
def test_kernel_faults_are_named_on_every_layout(case: Case) -> None:
    """The GQA head mapping and the KV head stride, on each layout's several KV heads."""
    for fault, expected in ((Fault(kv_heads_interleaved=True), "kv-heads-interleaved"),
                            (Fault(heads_page_major=True), "kv-heads-page-major")):
        outcome = run_case(case, TorchReference(), [PagedTorch(fault)], CPU).results[0]
        assert outcome.status is Status.DISAGREE
        assert hypothesis_of(outcome.comparison.diagnosis[0]) == expected, (
            outcome.comparison.diagnosis)


# A fault that disagrees on every case with context (a wrong scale), and one that reads past
# the window into NaN canaries (the diagnosis reruns the backend on finite canaries).
PROPERTY_FAULTS = [Fault(scale_twice=True, kv_heads_interleaved=True),
                   Fault(whole_pages_only=True, window_extra=1)]


@settings(max_examples=max(3, min(100, settings().max_examples // 8)), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(case=st.one_of(cases(max_batch=2, max_topk=4), dense_cases()),
       fault=st.sampled_from(PROPERTY_FAULTS))
def test_diagnosis_never_fails_on_a_generated_case(case: Case, fault: Fault) -> None:
    """Property: on generated cases of both families, every disagreement of a
    fault-injected kernel gets a diagnosis that does not fail (sparse cases kept small:
    the failures were the dense family's geometry; the nightly profile draws 100)."""
    outcome = run_case(case, TorchReference(), [PagedTorch(fault)], CPU).results[0]
    assert outcome.status in (Status.AGREE, Status.DISAGREE), outcome.detail
    if outcome.status is Status.DISAGREE:
        lines = outcome.comparison.diagnosis
        assert lines and not any(line.startswith(FAILED) for line in lines), lines
