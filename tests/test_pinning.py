"""GPU pinning of pytest-xdist workers: the pure assignment, and a real ``pytest -n 4``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from difftest.machine import gpus
from difftest.machine.gpus import visible_gpus
from difftest.machine.pinning import (
    FAKE_GPUS_ENV,
    PinningError,
    assign,
    describe,
    detect,
    runner_mask,
)

HIP_AND_CUDA = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


def _plan(n: int, mask: dict[str, str], physical: int, vendor: str | None,
          device: str = "auto") -> list[dict[str, str]]:
    return [assign(i, n, mask, physical, vendor, device) for i in range(n)]


def test_rocm_round_robin_four_workers_on_two_gpus() -> None:
    plan = _plan(4, {}, 2, "amd")
    assert [p["HIP_VISIBLE_DEVICES"] for p in plan] == ["0", "1", "0", "1"]
    assert all(p["HIP_VISIBLE_DEVICES"] == p["CUDA_VISIBLE_DEVICES"] for p in plan)
    assert set(plan[0]) == set(HIP_AND_CUDA)


def test_rocm_one_gpu_per_worker_when_enough() -> None:
    plan = _plan(4, {}, 8, "amd")
    assert [p["HIP_VISIBLE_DEVICES"] for p in plan] == ["0", "1", "2", "3"]


def test_rocm_respects_the_runners_hip_mask() -> None:
    plan = _plan(4, {"HIP_VISIBLE_DEVICES": "2,3"}, 4, "amd")
    assert [p["HIP_VISIBLE_DEVICES"] for p in plan] == ["2", "3", "2", "3"]
    assert [p["CUDA_VISIBLE_DEVICES"] for p in plan] == ["2", "3", "2", "3"]


def test_rocm_rocr_mask_alone_is_narrowed_in_place() -> None:
    plan = _plan(2, {"ROCR_VISIBLE_DEVICES": "4,5"}, 8, "amd")
    assert plan == [{"ROCR_VISIBLE_DEVICES": "4"}, {"ROCR_VISIBLE_DEVICES": "5"}]


def test_rocm_hip_mask_indexes_into_the_rocr_mask() -> None:
    mask = {"ROCR_VISIBLE_DEVICES": "4,5,6", "HIP_VISIBLE_DEVICES": "1,2"}
    assert [p["HIP_VISIBLE_DEVICES"] for p in _plan(2, mask, 8, "amd")] == ["1", "2"]
    with pytest.raises(PinningError, match=r"HIP_VISIBLE_DEVICES=0,3 names GPU 3, but only 3"):
        assign(0, 1, {"ROCR_VISIBLE_DEVICES": "4,5,6", "HIP_VISIBLE_DEVICES": "0,3"}, 8, "amd")


def test_rocm_cuda_mask_is_read_like_hip() -> None:
    plan = _plan(2, {"CUDA_VISIBLE_DEVICES": "1,0"}, 2, "amd")
    assert [p["HIP_VISIBLE_DEVICES"] for p in plan] == ["1", "0"]


def test_rocm_conflicting_hip_and_cuda_masks_are_an_error() -> None:
    with pytest.raises(PinningError, match="HIP_VISIBLE_DEVICES=0,1 and CUDA_VISIBLE_DEVICES=1"):
        assign(0, 2, {"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "1"}, 2, "amd")


def test_cuda_round_robin_and_mask() -> None:
    plan = _plan(3, {}, 2, "nvidia")
    assert plan == [{"CUDA_VISIBLE_DEVICES": v} for v in ("0", "1", "0")]
    plan = _plan(2, {"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"}, 4, "nvidia")
    assert [p["CUDA_VISIBLE_DEVICES"] for p in plan] == ["GPU-aaaa", "GPU-bbbb"]


def test_four_workers_share_one_gpu() -> None:
    """``pytest -n 4`` on a one-GPU machine: every worker on it (compiling and running side
    by side), as ``--jobs auto``'s jobs are (tests/test_jobs.py)."""
    assert _plan(4, {}, 1, "nvidia") == [{"CUDA_VISIBLE_DEVICES": "0"}] * 4
    assert _plan(4, {"CUDA_VISIBLE_DEVICES": "3"}, 8, "nvidia") == [
        {"CUDA_VISIBLE_DEVICES": "3"}] * 4


def test_cuda_ignores_rocm_variables() -> None:
    plan = _plan(2, {"HIP_VISIBLE_DEVICES": "7"}, 2, "nvidia")
    assert plan == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]


@pytest.mark.parametrize(("vendor", "var"), [("amd", "HIP_VISIBLE_DEVICES"),
                                             ("nvidia", "CUDA_VISIBLE_DEVICES")])
def test_mask_naming_more_gpus_than_exist(vendor: str, var: str) -> None:
    with pytest.raises(PinningError, match=rf"{var}=0,1,2 names GPU 2, but only 2 GPU\(s\)"):
        assign(0, 4, {var: "0,1,2"}, 2, vendor)
    with pytest.raises(PinningError, match=rf"{var}=GPU-a,GPU-b,GPU-c names 3 GPUs, but only 2"):
        assign(0, 4, {var: "GPU-a,GPU-b,GPU-c"}, 2, vendor)


def test_mask_naming_a_gpu_twice() -> None:
    with pytest.raises(PinningError, match="names GPU 1 twice"):
        assign(0, 2, {"HIP_VISIBLE_DEVICES": "1,1"}, 2, "amd")


def test_empty_mask_means_cpu_and_is_an_error_with_device_cuda() -> None:
    assert _plan(4, {"HIP_VISIBLE_DEVICES": ""}, 2, "amd") == [{}] * 4
    with pytest.raises(PinningError, match=r"--difftest-device cuda, but no GPU is visible "
                                           r"\(2 found by the drivers; HIP_VISIBLE_DEVICES=''\)"):
        assign(0, 4, {"HIP_VISIBLE_DEVICES": ""}, 2, "amd", "cuda")


def test_negative_index_ends_the_mask_like_the_cuda_runtime() -> None:
    assert assign(0, 1, {"CUDA_VISIBLE_DEVICES": "-1"}, 2, "nvidia") == {}
    assert _plan(2, {"CUDA_VISIBLE_DEVICES": "1,-1,0"}, 2, "nvidia") == [
        {"CUDA_VISIBLE_DEVICES": "1"}] * 2


def test_no_gpu_means_no_pinning_and_device_cpu_never_pins() -> None:
    assert _plan(4, {}, 0, None) == [{}] * 4
    assert _plan(2, {}, 2, "amd", "cpu") == [{}] * 2
    with pytest.raises(PinningError, match=r"no GPU is visible \(0 found"):
        assign(0, 1, {}, 0, None, "cuda")


def test_bad_arguments() -> None:
    with pytest.raises(PinningError, match=r"worker index 4 outside 0\.\.3"):
        assign(4, 4, {}, 2, "amd")
    with pytest.raises(PinningError, match="--difftest-device 'tpu'"):
        assign(0, 1, {}, 2, "amd", "tpu")


def test_visible_gpus_names_the_variables_it_writes() -> None:
    found = visible_gpus({"ROCR_VISIBLE_DEVICES": "0,1"}, 4, "amd")
    assert found.variables == ("ROCR_VISIBLE_DEVICES",) and found.entries == ("0", "1")


def test_detect_reads_the_test_hook() -> None:
    assert detect({FAKE_GPUS_ENV: "amd:2"}) == ("amd", 2)
    assert detect({FAKE_GPUS_ENV: "nvidia:3"}) == ("nvidia", 3)
    assert detect({FAKE_GPUS_ENV: "2"}) == ("amd", 2)
    assert detect({FAKE_GPUS_ENV: "amd:0"}) == (None, 0)
    with pytest.raises(PinningError, match="expected VENDOR:COUNT"):
        detect({FAKE_GPUS_ENV: "intel:2"})
    assert detect({}) == (gpus.gpu_vendor(), gpus.physical_gpu_count())


def test_runner_mask_and_describe() -> None:
    env = {"HIP_VISIBLE_DEVICES": "1", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": ""}
    assert runner_mask(env) == {"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": ""}
    assert describe({"HIP_VISIBLE_DEVICES": "1"}) == "HIP_VISIBLE_DEVICES=1"
    assert describe({}) == "no GPU (CPU)"


# ----- a real pytest -n 4 ------------------------------------------------------------------

PLUGIN = (Path(__file__).parent / "fake_backends.py").read_text()

TESTS = '''
import json, os, pytest
from difftest.case.spec import Case

@pytest.mark.parametrize("seed", range(4))
def test_case(seed, check_case, tmp_path_factory):
    check_case(Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),),
                    selections=((0, 1),), seed=seed))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    seen = {v: os.environ.get(v) for v in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                                           "CUDA_VISIBLE_DEVICES")}
    with open(f"seen-{worker}-{seed}.json", "w") as fh:
        json.dump({"worker": worker, "seen": seen}, fh)
'''

CONFTEST = '''
import json, os

def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):  # the xdist controller
        import torch
        with open("controller.json", "w") as fh:
            json.dump({"gpu_runtime_initialized": torch.cuda.is_initialized(),
                       "visibility": {v: os.environ.get(v) for v in (
                           "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                           "CUDA_VISIBLE_DEVICES")}}, fh)
'''


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without GPU masks, xdist worker variables or the test hook."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTEST_") and k not in (
               "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES",
               FAKE_GPUS_ENV)}
    return env | {"HYPOTHESIS_PROFILE": "ci"} | extra


def run_pytest(directory: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python -m pytest ARGS`` in ``directory``, in a fresh process."""
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "-p", "no:randomly", *args], cwd=directory, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(gpus.physical_gpu_count() > 0,
                    reason="fakes GPUs; on a GPU machine the real ones would be pinned")
def test_pytest_n4_pins_each_worker_and_keeps_the_controller_gpu_free(tmp_path: Path) -> None:
    (tmp_path / "fast.py").write_text(PLUGIN)
    (tmp_path / "test_pinned.py").write_text(TESTS)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    done = run_pytest(tmp_path, "-n", "4", "--difftest-plugin", "fast.py",
                      "--difftest-backends", "rounded", "--difftest-report", "report.json",
                      env=clean_env(**{FAKE_GPUS_ENV: "amd:2"}))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    workers = report["workers"]
    assert sorted(workers) == ["gw0", "gw1", "gw2", "gw3"]
    for worker, entry in workers.items():
        gpu = str(int(worker[2:]) % 2)
        assert entry["gpu_env"] == {"HIP_VISIBLE_DEVICES": gpu, "CUDA_VISIBLE_DEVICES": gpu}
        assert entry["visibility"]["HIP_VISIBLE_DEVICES"] == gpu
        assert entry["device"] == "cpu"  # the GPUs are fake: the worker computes on the CPU
        assert entry["pid"] != os.getpid()
    assert sum(e["cases"] for e in workers.values()) == len(report["cases"]) == 4
    # What each test saw in its own process is what the controller assigned to its worker.
    for seen in tmp_path.glob("seen-*.json"):
        record = json.loads(seen.read_text())
        assert record["seen"]["HIP_VISIBLE_DEVICES"] == workers[record["worker"]]["gpu_env"][
            "HIP_VISIBLE_DEVICES"]
    assert len(list(tmp_path.glob("seen-*.json"))) == 4
    controller = json.loads((tmp_path / "controller.json").read_text())
    assert controller == {"gpu_runtime_initialized": False, "visibility": dict.fromkeys(
        ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"))}
    assert "worker gw3 (pid" in done.stdout and "HIP_VISIBLE_DEVICES=1" in done.stdout


@pytest.mark.skipif(gpus.physical_gpu_count() == 0, reason="needs a real GPU")
def test_pytest_n4_pins_each_worker_to_a_real_gpu(tmp_path: Path) -> None:
    """On a GPU machine (fewer GPUs than workers included): each worker computes on the GPU
    the controller assigned it, round-robin, and the controller never starts a runtime."""
    (tmp_path / "fast.py").write_text(PLUGIN)
    (tmp_path / "test_pinned.py").write_text(TESTS)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    done = run_pytest(tmp_path, "-n", "4", "--difftest-plugin", "fast.py",
                      "--difftest-backends", "rounded", "--difftest-report", "report.json",
                      env=clean_env())
    assert done.returncode == 0, done.stdout + done.stderr
    vendor, physical = detect()
    workers = json.loads((tmp_path / "report.json").read_text())["workers"]
    assert sorted(workers) == ["gw0", "gw1", "gw2", "gw3"]
    for worker, entry in workers.items():
        assert entry["gpu_env"] == assign(int(worker[2:]), 4, {}, physical, vendor)
        assert entry["device"] == "cuda" and entry["gpu_name"] and entry["pid"] != os.getpid()
    for seen in tmp_path.glob("seen-*.json"):
        record = json.loads(seen.read_text())
        gpu_env = workers[record["worker"]]["gpu_env"]
        assert {k: record["seen"][k] for k in gpu_env} == gpu_env
    assert len(list(tmp_path.glob("seen-*.json"))) == 4
    controller = json.loads((tmp_path / "controller.json").read_text())
    assert controller["gpu_runtime_initialized"] is False


def test_pytest_refuses_a_mask_naming_more_gpus_than_exist(tmp_path: Path) -> None:
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    done = run_pytest(tmp_path, "-n", "2", "-o", "difftest=true", env=clean_env(
        **{FAKE_GPUS_ENV: "amd:2", "HIP_VISIBLE_DEVICES": "0,1,2"}))
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    assert ("difftest GPU pinning: HIP_VISIBLE_DEVICES=0,1,2 names GPU 2, but only 2 GPU(s)"
            in done.stderr)


def test_pytest_refuses_device_cuda_without_a_visible_gpu(tmp_path: Path) -> None:
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    # Two (faked) AMD GPUs, all hidden by the runner's mask: the same on every machine.
    done = run_pytest(tmp_path, "--difftest-device", "cuda",
                      env=clean_env(HIP_VISIBLE_DEVICES="", **{FAKE_GPUS_ENV: "amd:2"}))
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    assert "--difftest-device cuda, but no GPU is visible" in done.stderr
