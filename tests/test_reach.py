"""Reach and arch emulation: the gate says which changed lines of a bump ran.

The counting is checked on small sources (a branch whose test ran and never took it, a
function never called, ``@triton.jit`` bodies a GPU run cannot measure). The planted-change
test copies vLLM 0.34.0's ``triton_unified_attention.py`` (fetched by
``scripts/fetch_vllm.sh 0.34.0``; skipped with that command otherwise), plants a wrong
softmax scale inside its gfx1201 2D-decode launch branch, and runs the gate twice: without
emulation both sides agree and the reach shows the planted hunk unreached behind the RDNA
condition; with ``arch=gfx1201`` the candidate disagrees and the planted line ran. The same
for ``chunked_prefill_paged_decode``'s RDNA launch branch and ``vllm-paged-decode``, whose
wrapper runs only under emulation.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from difftest.backends.torch_ref import TorchReference
from difftest.backends.triton_unified import TritonUnifiedAttention, kernel_path
from difftest.backends.vllm_aiter import VllmAiter
from difftest.backends.vllm_arch import ARCHES, arch_of, on_arch
from difftest.backends.vllm_release import ReleaseError, release_root
from difftest.case.spec import Case
from difftest.contract.registry import RegistryError, select
from difftest.reporting.gate import gate, reach_lines
from difftest.reporting.report import build_report
from difftest.results.reach import LineTrace, file_reach, merge_reach
from difftest.run.runner import Status, run_case
from difftest.run.session import Session

OLD = """\
FLAG = False


def launch(n):
    tile = 16
    return tile * n
"""
NEW = """\
FLAG = False


def launch(n):
    tile = 16
    if FLAG:
        tile = 32
        n += 1
    return tile * n


def unused():
    return 3


@triton.jit
def kernel(x):
    y = x + 1
    return y
"""


def test_a_branch_never_taken_is_unreached_with_its_condition() -> None:
    executed = {1, 4, 5, 6, 9, 12, 16}  # module level, launch() with FLAG false
    reach = file_reach("f.py", OLD, NEW, executed, kernel_bodies=True)
    assert reach is not None
    # changed: if FLAG, tile = 32, n += 1, def unused, return 3, def kernel, y =, return y
    assert (reach.changed, reach.ran, reach.unmeasured) == (8, 3, 0)
    reasons = {(h.first, h.last): h.reason for h in reach.hunks}
    assert reasons[(7, 8)] == "`if FLAG` (line 6) was false each time it ran"
    assert reasons[(13, 13)] == "function `unused` (line 12) never ran"
    assert reasons[(18, 19)] == "function `kernel` (line 17) never ran"


def test_kernel_bodies_of_a_gpu_run_are_not_measured() -> None:
    reach = file_reach("f.py", OLD, NEW, {1, 4, 5, 6, 9, 12, 16}, kernel_bodies=False)
    assert reach is not None and reach.unmeasured == 2  # the two lines inside @triton.jit
    assert all(h.first < 18 for h in reach.hunks)


def test_records_of_several_processes_merge() -> None:
    merged = merge_reach([{"tracer": "t", "kernel_bodies": True, "files": {"a": [1, 3]}},
                          None, {"tracer": "t", "kernel_bodies": False, "files": {"a": [2]}}])
    assert merged == {"tracer": "t", "kernel_bodies": False, "files": {"a": [1, 2, 3]},
                      "launches": {}}


def test_arch_queries_answer_for_the_emulated_architecture() -> None:
    rdna4, cdna3 = ARCHES["gfx1201"], ARCHES["gfx942"]
    assert on_arch(rdna4, "gfx1201") and on_arch(rdna4, "gfx12x") and on_arch(rdna4, "gfx1x")
    assert not on_arch(rdna4, "gfx1100") and not on_arch(rdna4, "mi3xx")
    assert on_arch(cdna3, "mi3xx") and on_arch(cdna3, "gfx9") and not on_arch(cdna3, "gfx950")
    assert on_arch(rdna4, "rdna") and on_arch(rdna4, "rdna4") and not on_arch(rdna4, "rdna3")
    assert not on_arch(cdna3, "rdna")
    with pytest.raises(ValueError, match=r"arch='gfx9999' is not emulated \(allowed: gfx1201"):
        arch_of("gfx9999")
    with pytest.raises(RegistryError, match="gfx9999"):
        select({"triton-unified": TritonUnifiedAttention()}, ["triton-unified[arch=gfx9999]"])


def test_vllm_aiter_takes_a_release(tmp_path: Path) -> None:
    with pytest.raises(ReleaseError, match=f"vllm={tmp_path}: no vLLM package"):
        VllmAiter(emulated=True).with_options({"vllm": str(tmp_path)})
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    backend = VllmAiter(emulated=True).with_options({"vllm": str(tmp_path)})
    assert backend.name == f"vllm-aiter@emulated[vllm={tmp_path}]"
    reason = backend.availability().reason
    assert "has no MiniMax-M3 AITER decode (models/minimax_m3/amd/ops/sparse_pa.py)" in reason


RELEASE = release_root() / "0.34.0"
KERNEL = "vllm/v1/attention/ops/triton_unified_attention.py"
BRANCH = "            elif is_gfx1201 and max_seqlen_q == 1 and q.element_size() <= 2:\n"
PLANT = "                softmax_scale = softmax_scale * 1.5  # planted\n"
# fp16 decode rows without split-K: vLLM's 2D kernel, gfx1201's 2D-decode branch
DECODE = Case(num_blocks=8, seq_lens=(300, 200), block_tables=((3, 5, 1), (2, 6)),
              selections=((0, 2), (1, 0)), num_q_heads=2, seed=11)


def _copy_release(destination: Path, plant: bool, kernel: str = KERNEL, branch: str = BRANCH,
                  line: str = PLANT) -> Path:
    """vLLM 0.34.0's attention ops with the package marker (and ``line`` planted after
    ``branch`` of ``kernel``, if ``plant``)."""
    shutil.copytree(RELEASE / "vllm/v1/attention/ops", destination / "vllm/v1/attention/ops")
    shutil.copy(RELEASE / "vllm/__init__.py", destination / "vllm/__init__.py")
    for info in RELEASE.glob("vllm-*.dist-info"):
        (destination / info.name).mkdir()
    if plant:
        path = destination / kernel
        source = path.read_text()
        assert source.count(branch) == 1
        path.write_text(source.replace(branch, branch + line))
    return destination


def _report(tree: Path, name: str, tmp_path: Path, monkeypatch: Any,
            case: Case = DECODE) -> dict[str, Any]:
    """One run of ``case`` on ``name`` with ``tree`` as ``$DIFFTEST_VLLM``, traced."""
    monkeypatch.setenv("DIFFTEST_VLLM", str(tree))
    trace = LineTrace().start()
    session = Session.create([name], [], "cpu", str(tmp_path / f"artifacts-{tree.name}"),
                             "torch-ref")
    session.run(case)
    report = build_report(session.records, session.backend_entries(),
                          {"reach": trace.stop(kernel_bodies=True)}, session.environment)
    session.close()
    return report


@pytest.mark.skipif(not (RELEASE / KERNEL).is_file(),
                    reason=f"vLLM 0.34.0 is not fetched under {RELEASE.parent} "
                    "(bash scripts/fetch_vllm.sh 0.34.0)")
def test_a_change_in_an_arch_branch_is_caught_with_that_arch_and_shown_unreached_without(
        tmp_path: Path, monkeypatch: Any) -> None:
    base = _copy_release(tmp_path / "base", plant=False)
    cand = _copy_release(tmp_path / "cand", plant=True)
    planted = (cand / KERNEL).read_text().splitlines().index(PLANT.rstrip("\n")) + 1

    plain = [_report(tree, "triton-unified", tmp_path, monkeypatch) for tree in (base, cand)]
    result = gate(*plain)
    assert not result.failed and {r.verdict for r in result.rows} == {"same"}
    lines = reach_lines(*plain)
    assert f"      unreached line {planted} (1 statements): `if (is_gfx1201 or is_gfx1100) " \
           "and not is_batch_invariant`" in "\n".join(lines)
    assert lines[-1].startswith("REACH: 1 changed statements never ran")

    name = "triton-unified[arch=gfx1201]"
    emulated = [_report(tree, name, tmp_path, monkeypatch) for tree in (base, cand)]
    result = gate(*emulated)
    assert result.failed and [r.verdict for r in result.rows] == ["new disagree"]
    assert emulated[1]["backends"][name]["versions"]["arch"].startswith("gfx1201 (RDNA4)")
    lines = reach_lines(*emulated)
    assert "ops/triton_unified_attention.py: 1 of 1 changed statements ran" in "\n".join(lines)
    # gfx1201's 2D decode launch for head size 128: TILE_SIZE 16, 2 warps, 1 stage
    assert ("    1 x kernel_unified_attention num_warps=2 num_stages=1 TILE_SIZE=16 BLOCK_M=16 "
            "BLOCK_Q=8 NUM_SEGMENTS_PER_SEQ=1 IS_3D=False") in lines
    assert lines[-1] == "REACH: every changed statement of the executed files ran"


def _tree(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        (root / "vllm" / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / "vllm" / relative).write_text(text)
    return root / "vllm"


def _reports(old: Path, new: Path, reach: dict[str, Any] | None) -> list[dict[str, Any]]:
    def report(path: Path, config: dict[str, Any]) -> dict[str, Any]:
        return {"backends": {"b": {"versions": {"vllm_path": str(path)}}}, "config": config}
    return [report(old, {}), report(new, {"reach": reach} if reach else {})]


def test_changed_files_another_tree_ran_are_named(tmp_path: Path) -> None:
    old = _tree(tmp_path / "old", {"k.py": OLD, "u.py": "X = 1\n"})
    new = _tree(tmp_path / "new", {"k.py": NEW, "u.py": "X = 2\n"})
    venv = _tree(tmp_path / "venv", {"u.py": "X = 1\n"})
    reach = {"tracer": "t", "kernel_bodies": True,
             "files": {str(new / "k.py"): [1, 4, 5, 6, 9, 12, 16], str(venv / "u.py"): [1]}}
    lines = reach_lines(*_reports(old, new, reach))
    assert "    k.py: 3 of 8 changed statements ran" in lines
    assert f"    1 files changed in the candidate's tree ran from {venv} instead: u.py" in lines
    assert lines[-1].startswith("REACH: 5 changed statements never ran")


def test_a_reach_it_cannot_measure_says_why(tmp_path: Path) -> None:
    old, new = _tree(tmp_path / "old", {"k.py": OLD}), _tree(tmp_path / "new", {"k.py": NEW})
    assert reach_lines(*_reports(old, new, None))[-1] == (
        "    reach unknown: the candidate's run recorded no reach (difftest run --reach)")
    gone = tmp_path / "gone" / "vllm"
    reach = {"tracer": "t", "kernel_bodies": True, "files": {}}
    assert reach_lines(*_reports(gone, new, reach))[-1] == (
        f"    reach unknown: {gone} is not on this machine (the gate diffs the trees the "
        "reports name)")
    assert reach_lines(*_reports(new, new, reach)) == []  # the same tree: no bump


@pytest.mark.skipif(not (RELEASE / KERNEL).is_file(),
                    reason=f"vLLM 0.34.0 is not fetched under {RELEASE.parent} "
                    "(bash scripts/fetch_vllm.sh 0.34.0)")
def test_an_emulated_arch_may_move_a_3d_batch_to_2d() -> None:
    """vLLM's rule says 3-D for 2 query blocks at threshold 2; gfx1201 halves the threshold
    for 16-bit decode, so its launch is 2-D, and the adapter accepts that path."""
    case = dataclasses.replace(DECODE, split_k_segments=16, seq_threshold_3d=2)
    assert kernel_path(case) == "3D"
    trace = LineTrace().start()
    backend = TritonUnifiedAttention().with_options({"vllm": "0.34.0", "arch": "gfx1201"})
    result = run_case(case, TorchReference(), [backend], torch.device("cpu"))
    launches = trace.stop(kernel_bodies=True)["launches"]
    assert result.results[0].status is Status.AGREE
    assert [k for counts in launches.values() for k in counts] == [
        "kernel_unified_attention num_warps=2 num_stages=1 TILE_SIZE=16 BLOCK_M=16 BLOCK_Q=8 "
        "NUM_SEGMENTS_PER_SEQ=1 IS_3D=False"]


def test_a_hunk_after_an_early_return_names_where_its_block_stopped() -> None:
    old = "def f(x):\n    if x:\n        return 1\n    return 2\n"
    new = "def f(x):\n    if x:\n        return 1\n        y = 3\n    return 2\n"
    reach = file_reach("f.py", old, new, {1, 2, 3}, kernel_bodies=True)
    assert reach is not None and reach.hunks[0].reason == "its block stopped after line 3"


PAGED = "vllm/v1/attention/ops/chunked_prefill_paged_decode.py"
RDNA_BRANCH = "        if on_rdna() and (TRITON_BLOCK_SIZE >= 32 or tile_size >= 4096):\n"
PAGED_PLANT = "            sm_scale = sm_scale * 1.5  # planted\n"
# head size 256 on 16-token pages: a 4096-element tile, which takes the RDNA branch
WIDE = Case(num_blocks=5, seq_lens=(300,), block_tables=((1, 2, 3),), selections=((0, 1, 2),),
            num_q_heads=2, num_kv_heads=1, head_dim=256, block_size=128, page_size=16,
            softmax_scale=256**-0.5, dense=True, seed=3)


@pytest.mark.skipif(not (RELEASE / PAGED).is_file(),
                    reason=f"vLLM 0.34.0 is not fetched under {RELEASE.parent} "
                    "(bash scripts/fetch_vllm.sh 0.34.0)")
def test_the_paged_decode_wrapper_runs_its_rdna_branch_only_under_emulation(
        tmp_path: Path, monkeypatch: Any) -> None:
    trees = [_copy_release(tmp_path / name, plant, PAGED, RDNA_BRANCH, PAGED_PLANT)
             for name, plant in (("base", False), ("cand", True))]
    planted = (trees[1] / PAGED).read_text().splitlines().index(PAGED_PLANT.rstrip("\n")) + 1

    plain = [_report(tree, "vllm-paged-decode", tmp_path, monkeypatch, WIDE) for tree in trees]
    assert {r.verdict for r in gate(*plain).rows} == {"same"}
    lines = "\n".join(reach_lines(*plain))
    assert (f"      unreached line {planted} (1 statements): function "
            "`chunked_prefill_paged_decode`") in lines, lines

    name = "vllm-paged-decode[arch=gfx1201]"
    emulated = [_report(tree, name, tmp_path, monkeypatch, WIDE) for tree in trees]
    assert [r.verdict for r in gate(*emulated).rows] == ["new disagree"]
    lines = reach_lines(*emulated)
    assert "ops/chunked_prefill_paged_decode.py: 1 of 1 changed statements ran" in "\n".join(
        lines)
    assert "    1 x kernel_paged_attention_2d num_warps=8 num_stages=1" in lines, lines
