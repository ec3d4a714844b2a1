"""``difftest export``: a failure as a script that runs where difftest cannot be imported.

Each script runs in a Python started with ``-S`` whose path is this environment's site
directories, their ``.pth`` files unread: torch, Triton and vLLM import, the editable difftest
does not (checked). AITER's wheel is no importable ``aiter`` here, so its scripts take the
tree on their command line (``--tree``), and the installed route is taken through a package
``aiter`` made of the wheel's directories with an empty ``__init__``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from difftest.backends.aiter_triton import wheel_source
from difftest.case.spec import Case
from difftest.cli import main
from difftest.machine import devices
from difftest.run.export import ExportError, export
from difftest.run.session import Session

pytestmark = pytest.mark.skipif(not devices.interpreted(), reason="records the calls on the "
                                "CPU under TRITON_INTERPRET=1 (the GPU path: scripts/gpu_check.sh)")
# two requests over the sparse table: 300 tokens on blocks 2, 0, 5; 200 tokens on 1, 3
BASE = Case(num_blocks=6, seq_lens=(300, 200), block_tables=((2, 0, 5), (1, 3)),
            selections=((0, 1, 2), (0, 1, -1)), num_q_heads=16, seed=7)
WHEEL = wheel_source()


def site_path() -> str:
    """This environment's site directories, for a ``python -S`` that cannot see difftest."""
    dirs = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    if any((Path(p) / "difftest" / "__init__.py").is_file() for p in dirs):
        pytest.skip("difftest is installed into a site directory itself (not editable): no "
                    "path of these packages leaves it out")
    return os.pathsep.join(dirs)


def run_script(script: Path, *args: str, extra_path: str = "") -> subprocess.CompletedProcess[str]:
    """``python -S script --device cpu args`` where ``import difftest`` fails."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",
                                                            "CUDA_VISIBLE_DEVICES")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, site_path()) if p)
    blind = subprocess.run([sys.executable, "-S", "-c", "import difftest"], env=env,
                           cwd=script.parent, capture_output=True, text=True, timeout=60,
                           check=False)
    assert "No module named 'difftest'" in blind.stderr, blind.stderr
    return subprocess.run([sys.executable, "-S", str(script), "--device", "cpu", *args],
                          cwd=script.parent, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def failure(tmp_path: Path, case: Case, backend: str) -> Path:
    """The failure directory of ``backend`` on ``case`` (a run of difftest)."""
    session = Session.create([backend], [], "cpu", str(tmp_path / "art"))
    result = session.run(case)
    session.close()
    assert result.artifact, [r.status for r in result.results]
    return Path(result.artifact)


@pytest.fixture(scope="module")
def f21(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The script of finding F21 (AITER's wheel: a softcap of 0.01 gives NaN rows)."""
    if WHEEL is None:
        pytest.skip("no AITER wheel unpacked by scripts/setup.sh")
    directory = failure(tmp_path_factory.mktemp("f21"), BASE.replace(softcap=0.01),
                        "aiter-unified")
    exported = export(directory, device="cpu")
    assert exported.known_bug == "F21" and exported.backend == "aiter-unified"
    return exported.script


def test_f21_of_the_aiter_wheel_reproduces_from_a_tree_without_difftest(f21: Path) -> None:
    assert WHEEL is not None
    done = run_script(f21, "--tree", str(WHEEL.package.parent))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "unified_attention differs from the float64 reference" in done.stdout
    assert "4096 of 4096 elements" in done.stdout and "(4096 NaN or Inf)" in done.stdout
    assert "amd-aiter 0.1.7.post2.dev18" in done.stdout  # the recorded versions
    text = f21.read_text()
    assert "Known bug F21" in text and "'softcap': 0.01," in text
    assert f21.with_suffix(".pt").is_file()  # the inputs are large: a tensors file beside


def test_the_script_takes_an_installed_aiter_and_says_how_without_one(f21: Path,
                                                                     tmp_path: Path) -> None:
    """``aiter`` importable (here: the wheel's directories under an empty ``__init__``, as
    ROCm's real one is on a maintainer's machine): the script imports it; neither it nor
    ``--tree``: the script names both ways."""
    assert WHEEL is not None
    site = tmp_path / "site" / "aiter"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    for child in WHEEL.package.iterdir():
        if child.is_dir():
            (site / child.name).symlink_to(child)
    done = run_script(f21, extra_path=str(tmp_path / "site"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "(4096 NaN or Inf)" in done.stdout
    bare = run_script(f21)
    assert bare.returncode == 1 and "install amd-aiter, or pass --tree DIR" in bare.stderr


def test_f28_of_vllm_paged_decode_reproduces_without_difftest(tmp_path: Path) -> None:
    directory = failure(tmp_path, BASE.replace(sliding_window=40, canary=True),
                        "vllm-paged-decode")
    assert f"difftest export {directory}\n" in (directory / "repro.txt").read_text()
    out = tmp_path / "issue" / "repro.py"
    assert main(["export", str(directory), "-o", str(out), "--device", "cpu"]) == 0
    done = run_script(out)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "kernel_paged_attention_2d differs from the float64 reference" in done.stdout
    assert "row 0, head 0, dim 0: kernel nan" in done.stdout
    text = out.read_text()
    assert "Known bug F28" in text and "GRID = (2, 1)" in text and "'SLIDING_WINDOW': 40," in text
    # dropped into a test suite: its pytest function fails the same way
    env = {**os.environ, "REPRO_DEVICE": "cpu"}
    tested = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-p", "no:difftest", str(out)], cwd=out.parent, env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert tested.returncode == 1 and "1 failed" in tested.stdout, tested.stdout


def test_an_agreeing_case_exits_0_with_its_tensors_inline(tmp_path: Path) -> None:
    """A small fp8 case (the inputs fit in the script) on which the kernel agrees."""
    case = Case(num_blocks=1, seq_lens=(100,), block_tables=((0,),), selections=((0,),),
                num_q_heads=1, head_dim=64, kv_dtype="float8_e4m3fn", k_scale=0.5,
                v_scale=2.0, seed=3)
    path = tmp_path / "case.json"
    path.write_text(case.to_json())
    exported = export(path, tmp_path / "agree.py", "vllm-paged-decode", device="cpu")
    assert exported.tensors is None and exported.known_bug is None
    assert "TENSORS_INLINE = (" in exported.script.read_text()
    done = run_script(exported.script)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kernel_paged_attention_2d agrees with the float64 reference" in done.stdout


def test_what_cannot_be_exported_is_an_error_naming_why(tmp_path: Path) -> None:
    plugin = str(Path(__file__).with_name("fake_backends.py"))
    path, softcap = tmp_path / "case.json", tmp_path / "softcap.json"
    path.write_text(BASE.to_json())
    softcap.write_text(BASE.replace(softcap=5.0).to_json())
    with pytest.raises(ExportError, match="no recorded disagreement or error to export"):
        export(path, device="cpu")
    with pytest.raises(ExportError, match="rounded states no kernel call by value"):
        export(path, backend_name="rounded", plugins=[plugin], device="cpu")
    with pytest.raises(ExportError, match=r"does not run case \w+ here: "
                       "kernel_paged_attention_2d has no logit softcap"):
        export(softcap, backend_name="vllm-paged-decode", device="cpu")
    assert main(["export", str(path), "--device", "cpu"]) == 2
