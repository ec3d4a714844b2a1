"""``vllm-aiter`` and finding F14: rows that vLLM's AITER table builder cuts short are refused.

The case is the false-positive stretch's (docs/data/fp-vllm-aiter-duplicate-lane.json): one
request of 129 tokens, four query rows at positions 125..128, selections
``[[0, 0], [0, 0], [0, -1], [0, 0]]``. Rows 0-2 lie in block 0 and select it (rows 0 and 1
twice); row 3 lies in block 1 and selects only block 0, twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from difftest.backends.torch_ref import TorchReference
from difftest.backends.vllm_aiter import VllmAiter, cut_short_reason
from difftest.case.casefile import read_case
from difftest.case.selection import aiter_table_rows, build_rows, selection_is_canonical
from difftest.contract.backend import RunInputs
from difftest.contract.compare import compare
from difftest.contract.tolerance import Tolerance
from difftest.generation.capabilities import Capabilities
from difftest.run.runner import Status, run_case

F14_CASE = read_case(Path(__file__).resolve().parents[1]
                     / "docs" / "data" / "fp-vllm-aiter-duplicate-lane.json")
ACCEPT = VllmAiter(emulated=True, options={"irregular": "accept"})


@pytest.fixture(scope="module")
def device(difftest_session) -> torch.device:
    """The run device; each test here runs vLLM's sparse_pa, so each skips with the backend's
    reason where the installed vLLM cannot import it (a module it needs is missing)."""
    availability = VllmAiter(emulated=True).availability()
    if not availability.available:
        pytest.skip(availability.reason)
    return difftest_session.device


def test_the_f14_case_is_refused_naming_the_row_and_the_rule(device: torch.device) -> None:
    result = run_case(F14_CASE, TorchReference(), [VllmAiter(emulated=True)], device)
    (refused,) = result.results
    assert refused.status is Status.UNSUPPORTED
    assert refused.detail == cut_short_reason(F14_CASE, [3], ACCEPT.name)
    assert refused.detail.startswith(
        "row 3 (position 128) selects no lane of its own block 1, and its 2 valid lanes hold "
        "256 tokens, more than its causal length 129: vLLM's _build_sparse_block_table_kernel")
    assert "finding F14" in refused.detail
    assert refused.detail.endswith("vllm-aiter@emulated[irregular=accept] runs it anyway")


def test_rows_that_select_their_own_block_still_run_and_agree(device: torch.device) -> None:
    """Rows 0 and 1 (the duplicated block is their own, the tail) and the canonical row 2, with
    row 3 selecting its own block too: not canonical, but read as declared, so it runs."""
    case = F14_CASE.replace(selections=(*F14_CASE.selections[:3], (0, 1)))
    assert not selection_is_canonical(case)
    backend = VllmAiter(emulated=True)
    assert backend.unsupported_reason(case, device) is None
    (result,) = run_case(case, TorchReference(), [backend], device).results
    assert result.status is Status.AGREE, result.detail or result.comparison.message(case)


def test_forced_through_it_reads_the_modelled_table(device: torch.device) -> None:
    """``irregular=accept`` runs the F14 case: it disagrees with the declared semantics on row
    3 only, and agrees with the reference over :func:`aiter_table_rows` (block 0 and then the
    first token of block 0 again: context 129, not 256)."""
    assert [s.tokens for s in aiter_table_rows(F14_CASE)[3].segments] == [128, 1]
    inputs = RunInputs(F14_CASE, device)
    output = ACCEPT.run(inputs)
    tolerance = Tolerance(ACCEPT.precision(F14_CASE, device))
    empty = ACCEPT.empty_row_output(F14_CASE)
    declared = compare(ACCEPT.name, output, TorchReference().reference(inputs), tolerance,
                       empty, F14_CASE, inputs.rows)
    assert not declared.agrees
    assert {loc.row for loc in declared.worst} == {3}
    modelled = RunInputs(F14_CASE, device)
    modelled.__dict__["rows"] = aiter_table_rows(F14_CASE)  # the cached property, pre-empted
    assert modelled.rows != build_rows(F14_CASE)
    predicted = compare(ACCEPT.name, output, TorchReference().reference(modelled), tolerance,
                        empty, F14_CASE, modelled.rows)
    assert predicted.agrees, predicted.message(F14_CASE)


def test_generation_redraws_the_example_no_variant_fits(device: torch.device) -> None:
    """No variant (dtype or mode) changes a selection, so generation redraws such an example
    and says why."""
    capabilities = Capabilities.probe([VllmAiter(emulated=True)], device)
    assert not capabilities.accept(F14_CASE)
    assert (f"redrawn 1 example(s) vllm-aiter@emulated runs in no variant: "
            f"{cut_short_reason(F14_CASE, [3], ACCEPT.name)}") in capabilities.lines()
