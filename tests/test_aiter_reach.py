"""Reach into an AITER bump: the launcher and the interpreted Triton kernel bodies of an AITER
tree, its arch branches under emulation, and the device code of kernels compiled for GPUs
the CPU cannot run.

The planted-change tests copy the ``aiter/`` tree of AITER v0.1.20.post1 (from
``$DIFFTEST_AITER_REPO``; skipped with the command otherwise) and plant one change: a
launcher assertion that refuses batches of more than two rows (the gate fails on the new
errors, and the reach shows the assertion ran), a no-op statement in a kernel body (it ran,
interpreted), and a launch choice in ``select_2d_config``'s RDNA branch (unreached without
emulation, reached and launched with ``arch=gfx1201``). The device-code comparison is
checked on synthetic reports; its end-to-end test needs ``aiter-gluon@compiled``.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest

from difftest.case.spec import Case
from difftest.contract.registry import RegistryError, discover, select
from difftest.generation.corpus import load_corpus
from difftest.reporting.gate import gate, reach_lines
from difftest.reporting.report import build_report
from difftest.results.reach import (
    LineTrace,
    device_code_changes,
    device_code_lines,
    rocm_backend,
)
from difftest.run.session import Session
from tests.aiter_trees import aiter_tree

HOST = "ops/triton/attention/unified_attention.py"
KERNELS = "ops/triton/_triton_kernels/attention/unified_attention.py"
ASSERTION = '    assert causal, "Only causal attention is supported"\n'
PLANTED_ASSERTION = ('    assert causal and q.shape[0] <= 2, "planted: at most two rows"\n')
BODY = "\n    acc = acc * one_over_L\n"  # the 2-D kernel's epilogue (the 3-D one is indented)
PLANTED_BODY = BODY + "    acc = acc * 1.0  # planted\n"
RDNA = "        if arch.is_rdna:\n            num_stages_2d, num_warps = 1, 4\n"
PLANTED_RDNA = RDNA + "            num_warps = 8  # planted\n"
# two requests of 2 decode rows each: four rows, the 2-D kernel (max_seqlen_k 256)
ROWS = Case(num_blocks=8, seq_lens=(300, 200), block_tables=((3, 5, 1), (2, 6)),
            selections=((0, 2), (0, 2), (1, 0), (1, 0)), decode_query_len=2, num_q_heads=2,
            seed=11)
ONE_ROW = Case(num_blocks=8, seq_lens=(200,), block_tables=((3, 5),), selections=((0, 1),),
               num_q_heads=2, seed=5)


def _copy_tree(destination: Path, plants: dict[str, tuple[str, str]]) -> Path:
    """AITER v0.1.20.post1's ``aiter/`` under ``destination`` with each ``(old, new)`` of
    ``plants`` (by file inside ``aiter/``) replaced once."""
    tag = aiter_tree("v0.1.20.post1")
    shutil.copytree(tag.package, destination / "aiter")
    shutil.copy(tag.package.parent / "difftest-aiter-version", destination)
    for relative, (old, new) in plants.items():
        path = destination / "aiter" / relative
        source = path.read_text()
        assert source.count(old) == 1, (relative, old)
        path.write_text(source.replace(old, new))
    return destination


def _report(tree: Path, name: str, cases: list[Case], tmp_path: Path,
            monkeypatch: Any) -> dict[str, Any]:
    """``cases`` on ``name`` with ``tree`` as ``$DIFFTEST_AITER``, traced as ``--reach``."""
    monkeypatch.setenv("DIFFTEST_AITER", str(tree))
    trace = LineTrace().start()
    session = Session.create([name], [], "cpu", str(tmp_path / f"artifacts-{tree.name}"),
                             "torch-ref")
    for case in cases:
        session.run(case)
    report = build_report(session.records, session.backend_entries(),
                          {"reach": trace.stop(kernel_bodies=True)}, session.environment)
    session.close()
    return report


def _planted_line(tree: Path, relative: str, text: str) -> int:
    return (tree / "aiter" / relative).read_text().splitlines().index(text.rstrip("\n")) + 1


def test_a_planted_launcher_assertion_fails_the_gate_and_its_line_ran(
        tmp_path: Path, monkeypatch: Any) -> None:
    base = _copy_tree(tmp_path / "base", {})
    cand = _copy_tree(tmp_path / "cand", {HOST: (ASSERTION, PLANTED_ASSERTION),
                                          KERNELS: (BODY, PLANTED_BODY)})
    reports = [_report(tree, "aiter-unified", [ONE_ROW, ROWS], tmp_path, monkeypatch)
               for tree in (base, cand)]
    result = gate(*reports)
    assert result.failed
    assert {r.case_id: r.verdict for r in result.rows} == {
        ONE_ROW.case_id: "same", ROWS.case_id: "new error"}
    text = "\n".join(reach_lines(*reports))
    assert f"aiter-unified: {base / 'aiter'} -> {cand / 'aiter'}" in text
    assert f"    {HOST}: 1 of 1 changed statements ran" in text
    assert f"    {KERNELS}: 1 of 1 changed statements ran" in text  # a kernel body, interpreted
    assert text.endswith("REACH: every changed statement of the executed files ran")
    assert _planted_line(cand, KERNELS, PLANTED_BODY.splitlines()[-1]) in reports[1][
        "config"]["reach"]["files"][str(cand / "aiter" / KERNELS)]


def test_an_rdna_launch_branch_runs_only_under_gfx1201_emulation(tmp_path: Path,
                                                                 monkeypatch: Any) -> None:
    base = _copy_tree(tmp_path / "base", {})
    cand = _copy_tree(tmp_path / "cand", {HOST: (RDNA, PLANTED_RDNA)})
    planted = _planted_line(cand, HOST, PLANTED_RDNA.splitlines()[-1])
    cdna = [_report(tree, "aiter-unified[arch=gfx950]", [ONE_ROW], tmp_path, monkeypatch)
            for tree in (base, cand)]
    assert not gate(*cdna).failed
    lines = reach_lines(*cdna)
    assert (f"      unreached line {planted} (1 statements): `if arch.is_rdna` (line "
            f"{planted - 2}) was false each time it ran") in lines
    rdna = [_report(tree, "aiter-unified[arch=gfx1201]", [ONE_ROW], tmp_path, monkeypatch)
            for tree in (base, cand)]
    assert not gate(*rdna).failed  # warps do not change what the interpreter computes
    lines = reach_lines(*rdna)
    assert f"    {HOST}: 1 of 1 changed statements ran" in lines
    launches = [line for line in lines if "x kernel_unified_attention_2d" in line]
    # gfx1201's decode tiles: 6 waves per EU, 1 stage, and the planted 8 warps
    assert launches == ["    1 x kernel_unified_attention_2d num_warps=8 num_stages=1 "
                        "waves_per_eu=6 TILE_SIZE=16 BLOCK_M=16 BLOCK_Q=8"], lines


def _code(kernel: str, arch: str, specialization: str, sha: str, vgprs: int = 96
          ) -> dict[str, Any]:
    return {"kernel": kernel, "arch": arch, "specialization": specialization, "sha256": sha,
            "vgprs": vgprs, "sgprs": 40, "lds_bytes": 16384, "spills": 0, "occupancy": 4}


def _synthetic(codes: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """A report whose results state one kernel call each, carrying ``device_code``."""
    return {"backends": {}, "config": {}, "cases": [
        {"case_id": case_id, "results": [
            {"backend": "aiter-gluon@compiled[arch=gfx950]",
             "calls": [{"kernel": "pa_decode_gluon", "arguments": {}, "device_code": code}]}]}
        for case_id, code in codes.items()]}


def test_device_code_is_compared_by_kernel_arch_and_specialization() -> None:
    baseline = _synthetic({
        "a" * 16: [_code("decode", "gfx950", "D128 B16", "1"),
                   _code("decode", "gfx942", "D128 B16", "5")],
        "b" * 16: [_code("decode", "gfx950", "D64 B16", "2"),
                   _code("reduce", "gfx950", "S4", "3")],
        "c" * 16: [_code("decode", "gfx950", "D256 B16", "7")]})
    candidate = copy.deepcopy(baseline)
    first = candidate["cases"][0]["results"][0]["calls"][0]["device_code"]
    first[0] = _code("decode", "gfx950", "D128 B16", "1-changed", vgprs=104)
    candidate["cases"][2]["results"][0]["calls"][0]["device_code"].append(
        _code("decode", "gfx950", "D96 B16", "9"))  # a shape only the candidate compiled
    candidate["cases"][1]["results"][0]["calls"].append({"kernel": "x", "device_code": [
        {"kernel": "broken"}, "not an object"]})  # read defensively: skipped
    changes = {(c.kernel, c.arch): c for c in device_code_changes(baseline, candidate)}
    assert set(changes) == {("decode", "gfx950"), ("decode", "gfx942"), ("reduce", "gfx950")}
    decode = changes[("decode", "gfx950")]
    assert (decode.compared, decode.changed, decode.one_side) == (3, 1, 1)
    assert decode.resources == ("vgprs 96 -> 104",)
    assert decode.case_ids == ("a" * 16, "c" * 16)
    lines = device_code_lines(baseline, candidate, "cand.json")
    assert lines[1:] == [
        "  gfx942: decode unchanged for 1 shape",
        "  gfx950: decode changed for 1 of 3 shapes (vgprs 96 -> 104); 1 compiled on one "
        "side only: numerics need a ROCm runner",
        "    on a gfx950 runner with the candidate's release: difftest run --backends "
        f"aiter-gluon --cases-from cand.json --case-ids {'a' * 16},{'c' * 16}",
        "  gfx950: reduce unchanged for 1 shape"]
    assert device_code_lines(baseline, baseline) == [lines[0], *(
        f"  {arch}: {kernel} unchanged for {n} shape{'s' * (n > 1)}"
        for kernel, arch, n in (("decode", "gfx942", 1), ("decode", "gfx950", 3),
                                ("reduce", "gfx950", 1)))]
    assert device_code_lines({"cases": []}, {"cases": []}) == []
    assert rocm_backend("vllm-aiter@compiled[arch=gfx942,vllm=0.33.0]") == "vllm-aiter"


GLUON = "ops/triton/gluon/pa_decode_gluon.py"
LOG2_E = "LOG2_E: gl.constexpr = 1.4426950408889634"  # in the body of each gluon kernel
GROUP_BOUND = "        equivalent_query_group_size <= 64"  # an assertion of pa_decode_gluon


def _gluon_reports(plant: tuple[str, str], tmp_path: Path, monkeypatch: Any
                   ) -> dict[str, list[dict[str, Any]]]:
    """Per arch, the reports of ``aiter-gluon@compiled`` on the LBHNC corpus cases with
    v0.1.20.post1 and with a copy of it where every ``plant[0]`` of the gluon file reads
    ``plant[1]``; skipped where the compiled backend is not registered."""
    try:
        select(discover(), ["aiter-gluon@compiled[arch=gfx950]"])
    except RegistryError:
        pytest.skip("needs aiter-gluon@compiled")
    base = _copy_tree(tmp_path / "base", {})
    cand = _copy_tree(tmp_path / "cand", {})
    path = cand / "aiter" / GLUON
    assert plant[0] in path.read_text()
    path.write_text(path.read_text().replace(*plant))
    cases = [c for c in load_corpus() if c.kv_layout == "LBHNC"]
    return {arch: [_report(tree, f"aiter-gluon@compiled[arch={arch}]", cases, tmp_path,
                           monkeypatch) for tree in (base, cand)]
            for arch in ("gfx942", "gfx950")}


def test_a_planted_change_in_a_gluon_kernel_body_shows_as_changed_device_code(
        tmp_path: Path, monkeypatch: Any) -> None:
    """A constant of the gluon kernels' bodies changed: the launches and the emulated
    numerics agree, and the compiled code of every shape run differs, on each arch."""
    changed = LOG2_E.replace("1.4426950408889634", "1.44")
    for arch, reports in _gluon_reports((LOG2_E, changed), tmp_path, monkeypatch).items():
        assert not gate(*reports).failed
        changes = device_code_changes(*reports)
        assert changes and {c.arch for c in changes} == {arch}
        assert any(c.changed == c.compared > 0 for c in changes), changes
        assert any(line.startswith(f"  {arch}: ") and "numerics need a ROCm runner" in line
                   for line in device_code_lines(*reports))


def test_a_planted_gluon_launcher_assertion_fails_the_gate(tmp_path: Path,
                                                            monkeypatch: Any) -> None:
    """pa_decode_gluon asserting at most 8 query heads per KV head: the corpus's cases of 16
    now raise."""
    plant = (GROUP_BOUND, "        equivalent_query_group_size <= 8")
    for reports in _gluon_reports(plant, tmp_path, monkeypatch).values():
        result = gate(*reports)
        assert result.failed and "new error" in {r.verdict for r in result.rows}
