"""The ``aiter-gluon`` adapter: the K-trim, its pitfalls, options, and the real kernel's path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings

from difftest import cli
from difftest.backends.aiter_gluon import (
    EMULATED_OPTIONS,
    AiterGluon,
    aiter_availability,
    gluon_arguments,
    prepare_views,
)
from difftest.backends.pa_decode_gluon_emulator import DEFAULT_REVISION, make_emulator
from difftest.backends.torch_ref import TorchReference
from difftest.backends.vllm_imports import kernel_availability
from difftest.case.spec import Case
from difftest.contract import registry
from difftest.contract.backend import EmptyRowOutput, RunInputs
from difftest.generation.corpus import load_corpus
from difftest.generation.strategies import cases
from difftest.run.runner import BackendResult, CaseResult, Status, run_case

REPORTED = {c.name: c for c in load_corpus()}["lbhnc-128-blocks-2048-2040-page-2039"]
REPORT_ASSERTION = (
    "AssertionError: key/value caches must have the same number of blocks, but got "
    "key=torch.Size([2048, 1, 8, 16, 16]), value=torch.Size([2040, 1, 1, 128, 16])"
)


def emulated(**options: str) -> AiterGluon:
    return AiterGluon(emulated=True, options=options)


def run(case: Case, backends: list, device: torch.device) -> CaseResult:
    return run_case(case, TorchReference(), backends, device)


def statuses(result: CaseResult) -> dict[str, Status]:
    return {r.backend: r.status for r in result.results}


@pytest.fixture(scope="module")
def device(difftest_session) -> torch.device:
    return difftest_session.device


def test_k_trim_off_hits_the_reported_assertion_and_on_agrees(device: torch.device) -> None:
    """The report's case (fp8 LBHNC, 128 blocks): AITER 0.1.26's equal-block assertion with
    the report's shapes without the trim; agreement with it."""
    result = run(REPORTED, [emulated(k_trim="off"), emulated(),
                            emulated(k_trim="off", revision="v0.1.20")], device)
    off, on, public = result.results
    assert off.backend == "aiter-gluon@emulated[k_trim=off]"
    assert off.status is Status.ERROR
    assert off.detail.splitlines()[0] == REPORT_ASSERTION
    assert on.status is Status.AGREE, on.detail or on.comparison.message(REPORTED)
    # The public AITER contract (v0.1.20) never compares page counts: untrimmed K is fine.
    assert public.status is Status.AGREE
    assert off.versions["k_trim"] == "off" and on.versions["k_trim"] == "on"
    assert off.versions["emulator_revision"] == on.versions["emulator_revision"] == "v0.1.26"
    assert public.versions["emulator_revision"] == "v0.1.20"


def test_dense_planes_pass_with_every_trim_setting(device: torch.device) -> None:
    """LHBNC: equal page counts, nothing to trim, stride 8 either way."""
    dense = REPORTED.replace(kv_layout="LHBNC")
    result = run(dense, [emulated(k_trim=mode) for mode in ("on", "off", "before-stride")],
                 device)
    assert set(statuses(result).values()) == {Status.AGREE}


def test_trimming_before_the_stride_reads_wrong_pages(device: torch.device) -> None:
    """The pitfall: trim K first and the packing test sees equal shapes, so the stride is 8
    and page ids point at other blocks. The comparison flags exactly the row that reads
    them (row 0, on physical block 0 alone, reads the same ids either way) and names the
    pages it should have read, the last block's 2032..2039 included."""
    case = Case(num_blocks=128, seq_lens=(100, 1024), block_tables=((0,), tuple(range(120, 128))),
                selections=((0, -1, -1, -1, -1, -1, -1, -1), tuple(range(8))),
                kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=2.0, seed=7)
    inputs = RunInputs(case, device)
    args = gluon_arguments(inputs, "before-stride", "tensor", None, torch.float8_e4m3fn,
                           make_emulator().get_recommended_splits)
    assert args["key_cache"].shape[0] == args["value_cache"].shape[0] == 2040
    assert args["block_tables"][1, 56:64].tolist() == list(range(1016, 1024))  # not 2032..

    result = run(case, [emulated(k_trim="before-stride"), emulated()], device)
    wrong, right = result.results
    assert right.status is Status.AGREE
    assert wrong.status is Status.DISAGREE
    comparison = wrong.comparison
    elements = case.num_q_heads * case.head_dim
    assert comparison.mismatched == comparison.nonfinite == elements  # all of row 1, NaN
    assert {loc.row for loc in comparison.worst} == {1}
    pages = comparison.worst[0].pages
    assert pages == tuple(p for b in range(120, 128) for p in range(16 * b, 16 * b + 8))
    message = comparison.message(case)
    assert "2032..2039" in message and "request 1, query token 0 (row 1)" in message


@settings(max_examples=30)
@given(case=cases(layouts=("LBHNC",)))
def test_the_trim_drops_only_rows_no_page_id_addresses(case: Case) -> None:
    """For every packed case: each page id a row uses lies below the V view's length, the K
    rows the trim drops are never addressed, and the trimmed K view holds the same bytes as
    the untrimmed one at every addressed id."""
    inputs = RunInputs(case, torch.device("cpu"))
    table, ctx = inputs.sparse_table
    used = torch.arange(table.shape[1]) < torch.div(ctx + 15, 16, rounding_mode="floor")[:, None]
    ids = table[used].long()
    assume(ids.numel() > 0)  # nothing addressed: every claim below is vacuous
    cache = inputs.cache("shuffled")
    views = prepare_views(cache.k, cache.v, "on")
    assert views.sides_packed and views.block_page_stride == 16
    assert views.key.shape[0] == cache.v.shape[0] == case.v_view_pages
    assert cache.k.shape[0] - views.key.shape[0] == case.pages_per_side
    assert bool((ids < case.v_view_pages).all())
    dropped = torch.arange(views.key.shape[0], cache.k.shape[0])
    assert not bool(torch.isin(ids, dropped).any())
    assert torch.equal(views.key[ids].view(torch.uint8), cache.k[ids].view(torch.uint8))


def test_views_and_scale_arguments() -> None:
    """The stride reads the untrimmed shapes; a longer V is refused; per-token scales are
    sized from the trimmed count."""
    key = torch.zeros(16, 1, 8, 16, 16, dtype=torch.float8_e4m3fn)
    packed = prepare_views(key, key[8:], "on")
    assert (packed.key.shape[0], packed.block_page_stride, packed.sides_packed) == (8, 16, True)
    assert prepare_views(key, key[8:], "off").key.shape[0] == 16
    assert prepare_views(key, key[8:], "before-stride").block_page_stride == 8
    assert prepare_views(key, key, "on").block_page_stride == 8
    with pytest.raises(RuntimeError, match=r"packed V view is longer than K \(16 > 8 pages\)"):
        prepare_views(key[:8], key, "on")

    inputs = RunInputs(REPORTED, torch.device("cpu"))
    splits = make_emulator().get_recommended_splits
    args = gluon_arguments(inputs, "on", "token", None, torch.float8_e4m3fn, splits)
    assert args["key_scale"].shape == args["value_scale"].shape == (2040, 1, 16, 1)
    assert args["compute_type"] is torch.float8_e4m3fn and args["output"].dtype == torch.bfloat16
    assert args["temporary_output"].dtype == torch.bfloat16
    assert args["max_context_partition_num"] == splits(REPORTED.total_q, 1) == 8
    assert args["exp_sums"].shape == (REPORTED.total_q, 1, 8, REPORTED.num_q_heads)


def test_per_token_scales(device: torch.device) -> None:
    """``scales=token`` agrees when trimmed; untrimmed, even the public AITER contract
    rejects K and V scales of different page counts."""
    result = run(REPORTED, [emulated(scales="token"),
                            emulated(scales="token", k_trim="off", revision="v0.1.20")], device)
    token, untrimmed = result.results
    assert token.status is Status.AGREE
    assert untrimmed.status is Status.ERROR
    assert untrimmed.detail.splitlines()[0] == (
        "AssertionError: Key and value scales must have same shape, but got key: "
        "torch.Size([2048, 1, 16, 1]), value: torch.Size([2040, 1, 16, 1])")


def test_empty_rows_follow_the_partition_count(device: torch.device) -> None:
    """With partitions the emulated reduce writes 0 on rows that attend nothing; one-shot
    (``splits=1``) leaves them untouched. Both declarations hold (e4m3fnuz: gfx942)."""
    case = {c.name: c for c in load_corpus()}["padded-request-and-empty-selection-fnuz"]
    case = case.replace(query_dtype="bfloat16")
    split, one_shot = emulated(), emulated(splits="1")
    assert split.empty_row_output(case) is EmptyRowOutput.ZERO
    assert one_shot.empty_row_output(case) is EmptyRowOutput.UNTOUCHED
    result = run(case, [split, one_shot], device)
    assert set(statuses(result).values()) == {Status.AGREE}
    assert all(r.comparison.empty_rows == 2 for r in result.results)


def test_unsupported_queries(device: torch.device) -> None:
    result = run(REPORTED.replace(query_dtype="float32"), [emulated()], device)
    assert result.results[0].status is Status.UNSUPPORTED
    assert "float32 queries are not supported" in result.results[0].detail


def test_options_names_and_versions() -> None:
    backend = emulated(revision="v0.1.20", k_trim="before-stride", splits="1")
    assert backend.name == "aiter-gluon@emulated[k_trim=before-stride,revision=v0.1.20,splits=1]"
    assert backend.with_options({}).name == "aiter-gluon@emulated"
    assert EMULATED_OPTIONS.choices["revision"][0] == DEFAULT_REVISION
    versions = backend.versions()
    assert versions["emulator_revision"] == "v0.1.20" and versions["k_trim"] == "before-stride"
    assert versions["kernel"].endswith("not AITER")
    with pytest.raises(ValueError, match="k_trim='maybe' is not one of on, off, before-stride"):
        emulated(k_trim="maybe")
    with pytest.raises(ValueError, match="unknown option 'revision'"):
        AiterGluon(options={"revision": "v0.1.20"})  # the real kernel has no revision


def test_registered_names() -> None:
    known = registry.discover()
    for name in ("aiter-gluon", "aiter-gluon@emulated", "vllm-aiter", "vllm-aiter@emulated",
                 "vllm-triton-sparse"):
        assert name in known


real_absent = pytest.mark.skipif(aiter_availability().available,
                                 reason="real AITER and a ROCm GPU are present")
real_present = pytest.mark.skipif(not aiter_availability().available,
                                  reason=aiter_availability().reason)


@real_absent
def test_real_aiter_is_unavailable_with_the_reason(device: torch.device) -> None:
    """Without ROCm, AMD GPU and AITER the real adapter is unavailable and never runs."""
    availability = AiterGluon().availability()
    assert not availability.available
    assert availability.reason.startswith("real AITER pa_decode_gluon needs ")
    result: BackendResult = run(REPORTED, [AiterGluon()], device).results[0]
    assert result.status is Status.UNAVAILABLE and result.detail == availability.reason
    assert result.comparison is None and result.versions == {}


@real_absent
def test_difftest_backends_lists_the_real_ones_as_unavailable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["backends", "--device", "auto"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line}
    for name in ("aiter-gluon", "vllm-aiter"):
        assert lines[name].split()[1] == "unavailable"
        assert lines[name].endswith(aiter_availability().reason)
    assert lines["aiter-gluon@emulated"].split()[1] == "available"
    kernel = kernel_availability("amd.ops.sparse_pa")  # vLLM without a module it imports
    if not kernel.available:
        assert lines["vllm-aiter@emulated"].split()[1] == "unavailable"
        assert lines["vllm-aiter@emulated"].endswith(kernel.reason)
    for name in ("aiter-gluon@emulated", "vllm-aiter@emulated")[:1 + kernel.available]:
        assert lines[name].split()[1] == "available"
        assert "emulator_revision v0.1.26" in lines[name] and "not AITER" in lines[name]


def aiter_tolerance(case: Case) -> float:
    """AITER's own test tolerance for variable-length sequences
    (op_tests/triton_tests/test_pa_decode_gluon.py): 5e-2, or 5e-3 for unquantised
    non-fp8 compute."""
    return 5e-2 if case.is_fp8 else 5e-3


@real_present
def test_emulator_matches_the_real_kernel(device: torch.device) -> None:
    """The emulator and the real ``pa_decode_gluon`` on the same arguments (K trimmed, so
    every contract revision accepts them), compared on attended rows with AITER's
    tolerance (``atol = rtol``)."""
    from aiter import dtypes
    from aiter.ops.triton.gluon.pa_decode_gluon import get_recommended_splits, pa_decode_gluon

    flavour = str(dtypes.fp8).removeprefix("torch.")
    arch = "gfx942" if dtypes.fp8 == torch.float8_e4m3fnuz else "gfx950"
    corpus = [c for c in load_corpus() if c.query_dtype != "float32"]
    for case in [*corpus, REPORTED.replace(kv_dtype=flavour),
                 REPORTED.replace(kv_dtype="bfloat16", query_dtype="bfloat16", k_scale=1.0,
                                  v_scale=1.0)]:
        if case.is_fp8 and case.kv_dtype != flavour:
            continue
        for splits in (None, 1):
            inputs = RunInputs(case, device)
            real = gluon_arguments(inputs, "on", "tensor", splits, dtypes.fp8,
                                   get_recommended_splits)
            emul = dict(real, output=real["output"].clone())
            pa_decode_gluon(**real)
            make_emulator(arch=arch).pa_decode_gluon(**emul)
            active = (inputs.sparse_table[1] > 0).cpu()
            tol = aiter_tolerance(case)
            expected = real["output"].float().cpu()[active]
            actual = emul["output"].float().cpu()[active]
            assert bool(active.any())
            torch.testing.assert_close(actual, expected, atol=tol, rtol=tol,
                                       msg=lambda m, c=case, s=splits: f"{c.name} splits={s}: {m}")


def test_an_aiter_without_gluon_is_named_as_such(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed ``aiter`` without the gluon kernel (a stand-in, an old build) makes the real
    backends unavailable with that named, found from the files alone (nothing imported)."""
    (tmp_path / "aiter").mkdir()
    (tmp_path / "aiter" / "__init__.py").write_text("raise RuntimeError('never imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    aiter_availability.cache_clear()
    try:
        reason = aiter_availability().reason
    finally:
        aiter_availability.cache_clear()
    assert f"the 'aiter' at {tmp_path / 'aiter'} has no ops/triton/gluon/pa_decode_gluon.py" \
        in reason, reason
