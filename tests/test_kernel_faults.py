"""Faults inside a kernel's loop (mutants/kernel_faults.py): the correct torch kernel agrees,
each fault is caught on a case that reaches it and named by the diagnosis, and where a fault
provably changes nothing it says so."""

from __future__ import annotations

import pytest
import torch

from difftest.backends.torch_ref import TorchReference
from difftest.case.spec import Case
from difftest.judgement.diagnosis import HYPOTHESIS_NAMES, hypothesis_of
from difftest.run.runner import Status, run_case
from mutants.kernel_faults import DIFFTEST_BACKENDS, FAULTS, PagedTorch, build_faults

CPU = torch.device("cpu")
MUTANTS = {m.name: m for m in build_faults()}
# Two requests over 2 KV heads of 4 query heads each, 64-token blocks of 16-token pages, a
# window shorter than the contexts and partial last pages: every fault but the unshifted
# softmax reaches it.
GQA = Case(num_blocks=8, seq_lens=(150, 90), block_tables=((5, 1, 6), (2, 7)),
           selections=((0, 1, 2), (0, 1, -1)), block_size=64, page_size=16, kv_layout="LHBNC",
           num_q_heads=8, num_kv_heads=2, head_dim=64, query_dtype="float16",
           kv_dtype="bfloat16", sliding_window=50, softmax_scale=0.2, name="gqa-window")
# Logits near a hundred: exp(s) overflows float32 on some heads without the maximum
# subtracted (on all of them the row is all NaN, which reads past a plane predict as well).
LARGE_LOGITS = GQA.replace(softmax_scale=5.0, sliding_window=0, name="large-logits")


def test_every_fault_is_loaded_with_a_known_hypothesis() -> None:
    assert [b.name for b in DIFFTEST_BACKENDS] == ["paged-torch", *MUTANTS]
    for mutation, _ in FAULTS:
        assert mutation.harmful and mutation.diagnosis in HYPOTHESIS_NAMES, mutation.name


def test_the_correct_kernel_agrees() -> None:
    for case in (GQA, LARGE_LOGITS):
        outcome = run_case(case, TorchReference(), [PagedTorch()], CPU).results[0]
        assert outcome.status is Status.AGREE, outcome.detail


@pytest.mark.parametrize("name", list(MUTANTS))
def test_each_fault_is_caught_and_named(name: str) -> None:
    mutant = MUTANTS[name]
    case = next(c for c in (GQA, LARGE_LOGITS) if mutant.mutation.reachable(c))
    outcome = run_case(case, TorchReference(), [mutant], CPU).results[0]
    assert outcome.status is Status.DISAGREE, outcome.detail
    lines = outcome.comparison.diagnosis
    assert hypothesis_of(lines[0]) == mutant.mutation.diagnosis, lines


def test_a_fault_reports_itself_unreachable_only_where_it_changes_nothing() -> None:
    """One KV head (no head mapping or stride to get wrong), no window, whole pages, scale 1
    and small logits: every fault is the correct kernel there."""
    plain = Case(num_blocks=4, seq_lens=(128,), block_tables=((2, 3),), selections=((0, 1),),
                 block_size=64, page_size=16, kv_layout="LHBNC", num_q_heads=4,
                 query_dtype="float16", kv_dtype="bfloat16", softmax_scale=1.0,
                 distribution="uniform", head_dim=64)
    reference = TorchReference()
    for name, mutant in MUTANTS.items():
        assert not mutant.mutation.reachable(plain), name
        assert run_case(plain, reference, [mutant], CPU).results[0].status is Status.AGREE
