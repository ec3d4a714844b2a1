"""Kernel modes (logit softcap, sliding window) and NaN canaries: fields, reference, cache,
adapters and their draws."""

from __future__ import annotations

import math

import pytest
import torch
from difftest.backends.aiter_gluon import AiterGluon
from difftest.backends.torch_ref import TorchReference
from difftest.backends.triton_unified import TritonUnifiedAttention
from difftest.backends.vllm_triton_sparse import VllmTritonSparse
from difftest.cases.modes import with_kernel_modes
from hypothesis import HealthCheck, find, settings
from hypothesis import strategies as st

from difftest.backend import RunInputs
from difftest.case import Case, CaseError
from difftest.runner import Status, run_case

BASE = Case(num_blocks=8, seq_lens=(300,), block_tables=((5, 2, 7),), selections=((0, 1, 2),),
            num_q_heads=2, seed=11)


def reference_output(case: Case) -> torch.Tensor:
    return TorchReference().reference(RunInputs(case, torch.device("cpu"))).output


def test_fields_at_their_off_values_keep_old_ids_and_json() -> None:
    data = BASE.to_dict()
    assert not {"softcap", "sliding_window", "canary"} & set(data)
    assert Case.from_dict(data).case_id == BASE.case_id
    moded = BASE.replace(softcap=0.02, sliding_window=40, canary=True)
    assert moded.case_id != BASE.case_id
    assert Case.from_json(moded.to_json()) == moded
    assert moded.kernel_modes == ("softcap", "sliding_window")
    assert BASE.replace(canary=True).kernel_modes == ()


@pytest.mark.parametrize(
    ("changes", "field", "allowed"),
    [
        ({"softcap": -1.0}, "softcap", "0 (off) or finite 0.001..10000"),
        ({"softcap": math.nan}, "softcap", "0 (off) or finite 0.001..10000"),
        ({"softcap": 1e-4}, "softcap", "0 (off) or finite 0.001..10000"),
        ({"sliding_window": -1}, "sliding_window", "0 (off) or integer 1..1048576"),
        ({"sliding_window": True}, "sliding_window", "0 (off) or integer 1..1048576"),
        ({"canary": "yes"}, "canary", "true or false"),
    ],
)
def test_bad_mode_fields_name_field_and_range(changes, field, allowed) -> None:
    with pytest.raises(CaseError) as err:
        BASE.replace(**changes)
    assert err.value.field == field and err.value.allowed == allowed


def attended_values(case: Case) -> torch.Tensor:
    """V of BASE's row in attend order: blocks 5 and 2 whole, then 44 tokens of block 7."""
    data = RunInputs(case, torch.device("cpu")).data
    v = data.v_stored.to(torch.float64)[:, :, 0]
    return torch.cat([v[data.slot_of[5]], v[data.slot_of[2]], v[data.slot_of[7], :44]])


def test_reference_softcap_limits() -> None:
    """A huge cap changes nothing; a tiny one flattens the softmax to the mean of V."""
    plain = reference_output(BASE)
    assert torch.allclose(reference_output(BASE.replace(softcap=1e4)), plain, atol=1e-6)
    flat = reference_output(BASE.replace(softcap=1e-3))
    mean = attended_values(BASE).mean(0)
    assert torch.allclose(flat[0], mean.expand_as(flat[0]), atol=1e-3)
    assert not torch.allclose(plain[0], mean.expand_as(plain[0]), atol=1e-2)


def test_reference_sliding_window_limits() -> None:
    """A window of 1 is the last attended token's V; one past the context is no window."""
    last = attended_values(BASE)[-1]
    one = reference_output(BASE.replace(sliding_window=1))
    assert torch.allclose(one[0], last.expand_as(one[0]))
    assert torch.equal(reference_output(BASE.replace(sliding_window=301)),
                       reference_output(BASE))
    assert not torch.allclose(reference_output(BASE.replace(sliding_window=100)),
                              reference_output(BASE), atol=1e-3)


def test_canaries_fill_every_slot_no_row_reads() -> None:
    """With a window of 40 the row reads tokens 260..299: slots 4..43 of logical block 2
    (physical 7); every other slot of the attended blocks is NaN, only with ``canary``."""
    case = BASE.replace(sliding_window=40, canary=True)
    inputs = RunInputs(case, torch.device("cpu"))
    k = inputs.cache("plain").k  # LBHNC: block b's K side is pages 16b..16b+7
    k_tokens = k.view(case.num_blocks, 16, 16, -1)[:, :8].flatten(1, 2)  # [blocks, 128, D]
    finite = torch.isfinite(k_tokens).all(-1)
    assert finite[7, 4:44].all() and not finite[7, :4].any() and not finite[7, 44:].any()
    assert not finite[5].any() and not finite[2].any()
    plain = RunInputs(case.replace(canary=False), torch.device("cpu")).cache("plain").k
    plain_tokens = plain.view(case.num_blocks, 16, 16, -1)[:, :8].flatten(1, 2)
    assert torch.isfinite(plain_tokens[5]).all() and torch.isfinite(plain_tokens[7, :44]).all()


@pytest.mark.parametrize("changes", [
    {"softcap": 0.01},  # |s / softcap| far past 88
    {"softcap": 30.0, "distribution": "outliers", "softmax_scale": 1.0},
    {"sliding_window": 21, "canary": True},  # the window starts mid-tile: NaN in the tile
    {"sliding_window": 1, "canary": True, "softcap": 0.05},
])
def test_triton_unified_agrees_in_every_mode(changes, device_name: str) -> None:
    case = BASE.replace(**changes)
    result = run_case(case, TorchReference(), [TritonUnifiedAttention()],
                      torch.device(device_name))
    assert result.results[0].status is Status.AGREE, result.results[0].detail


def test_backends_without_the_modes_declare_them_unsupported() -> None:
    cpu = torch.device("cpu")
    for backend in (VllmTritonSparse(), AiterGluon(emulated=True)):
        assert backend.unsupported_reason(BASE.replace(canary=True), cpu) is None
        reason = backend.unsupported_reason(BASE.replace(softcap=1.0, sliding_window=9), cpu)
        assert reason is not None and "softcap and sliding_window" in reason


def test_mode_draws_reach_the_boundaries() -> None:
    """The draws reach a cap that overflows exp in float32 and a window that starts one token
    past a tile boundary, each with the other modes off."""
    drawn = st.just(BASE).flatmap(with_kernel_modes)
    quick = settings(database=None, max_examples=500, suppress_health_check=list(HealthCheck))
    overflow = find(drawn, lambda c: 0 < c.softcap <= 0.01 and not c.sliding_window,
                    settings=quick)
    assert overflow.softcap > 0
    mid_tile = find(drawn, lambda c: c.sliding_window and (300 - c.sliding_window) % 16 == 1
                    and c.canary and not c.softcap, settings=quick)
    assert mid_tile.canary
