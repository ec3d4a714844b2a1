"""One reading of GPU visibility: ``--device auto``, pinning and fingerprints agree on it.

The hosts are faked by pointing :mod:`difftest.machine.gpus` at driver directories built under
``tmp_path``, so the real counting code runs and the same tests hold on any machine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from difftest.machine import devices, gpus, pinning
from difftest.machine.fingerprint import fingerprint
from difftest.machine.gpus import CUDA, HIP, ROCR, VisibilityError


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, int], None]:
    """Make a fake host: ``host("nvidia", 4)`` or ``host("amd", 2)``, no mask set."""
    for var in (*gpus.VISIBILITY_VARS, pinning.FAKE_GPUS_ENV):
        monkeypatch.delenv(var, raising=False)
    nvidia, kfd = tmp_path / "nvidia-gpus", tmp_path / "kfd-nodes"
    monkeypatch.setattr(gpus, "NVIDIA_GPUS_DIR", nvidia)
    monkeypatch.setattr(gpus, "KFD_NODES_DIR", kfd)

    def make(vendor: str, count: int) -> None:
        if vendor == "nvidia":
            for i in range(count):
                (nvidia / f"0000:{i:02x}:00.0").mkdir(parents=True)
            return
        (kfd / "0").mkdir(parents=True)  # the CPU's node: gpu_id 0
        (kfd / "0" / "gpu_id").write_text("0\n")
        for i in range(1, count + 1):
            (kfd / str(i)).mkdir()
            (kfd / str(i) / "gpu_id").write_text(f"{1000 + i}\n")

    return make


def _pinned_plan(n_workers: int, device: str = "auto") -> list[dict[str, str]]:
    vendor, physical = pinning.detect()
    return [pinning.assign(i, n_workers, pinning.runner_mask(), physical, vendor, device)
            for i in range(n_workers)]


def test_driver_files_are_counted(host) -> None:
    assert (gpus.gpu_vendor(), gpus.physical_gpu_count()) == (None, 0)
    host("amd", 2)
    assert (gpus.gpu_vendor(), gpus.physical_gpu_count()) == ("amd", 2)
    assert pinning.detect() == ("amd", 2)


@pytest.mark.parametrize(("mask", "visible"), [
    ("-1", ()),
    ("", ()),
    ("0,1", ("0", "1")),
    ("1,-1,0", ("1",)),
    (" 2 , 3 ", ("2", "3")),
    ("GPU-8932f937,MIG-GPU-8932f937/1/0", ("GPU-8932f937", "MIG-GPU-8932f937/1/0")),
])
def test_cuda_mask_on_a_four_gpu_host(host, monkeypatch: pytest.MonkeyPatch, mask: str,
                                      visible: tuple[str, ...]) -> None:
    host("nvidia", 4)
    monkeypatch.setenv(CUDA, mask)
    assert gpus.visible_in_this_process().entries == visible
    assert gpus.visible_gpu_count() == len(visible)
    # --device auto and pinning read the same mask the same way.
    assert devices.resolve("auto") == ("cuda" if visible else "cpu")
    plan = _pinned_plan(2)
    assert plan == ([{CUDA: visible[i % len(visible)]} for i in range(2)] if visible
                    else [{}, {}])
    assert fingerprint()["visibility"] == {CUDA: mask}


def test_minus_one_hides_every_gpu_from_auto_and_pinning_alike(host, monkeypatch) -> None:
    host("nvidia", 4)
    monkeypatch.setenv(CUDA, "-1")
    assert devices.resolve("auto") == "cpu"
    assert _pinned_plan(4) == [{}] * 4
    with pytest.raises(pinning.PinningError, match=r"no GPU is visible \(4 found by the "
                                                   r"drivers; CUDA_VISIBLE_DEVICES='-1'\)"):
        _pinned_plan(1, "cuda")


def test_an_invalid_index_ends_the_list_and_pinning_refuses_it(host, monkeypatch) -> None:
    host("nvidia", 4)
    monkeypatch.setenv(CUDA, "0,7,1")
    found = gpus.visible_in_this_process()
    assert found.entries == ("0",)  # what the CUDA runtime would see
    assert found.inconsistency == ("CUDA_VISIBLE_DEVICES=0,7,1 names GPU 7, but only 4 GPU(s) "
                                   "exist below it (indices 0..3)")
    assert devices.resolve("auto") == "cuda"
    with pytest.raises(pinning.PinningError, match="names GPU 7, but only 4"):
        _pinned_plan(2)
    monkeypatch.setenv(CUDA, "1,1,2")
    assert gpus.visible_in_this_process().entries == ("1",)
    with pytest.raises(pinning.PinningError, match="names GPU 1 twice"):
        _pinned_plan(2)


@pytest.mark.parametrize("mask", ["zero", "0,gpu1", "0x1", "1.5", "--1"])
def test_garbage_is_an_error_naming_the_variable_and_value(host, monkeypatch,
                                                           mask: str) -> None:
    host("nvidia", 4)
    monkeypatch.setenv(CUDA, mask)
    message = rf"CUDA_VISIBLE_DEVICES={mask!r}: entry '.+' is neither a GPU index nor a UUID"
    with pytest.raises(VisibilityError, match=message):
        devices.resolve("auto")
    with pytest.raises(pinning.PinningError, match=message):
        _pinned_plan(1)


def test_nvidia_ignores_rocm_variables(host, monkeypatch) -> None:
    host("nvidia", 4)
    monkeypatch.setenv(HIP, "-1")
    monkeypatch.setenv(ROCR, "")
    assert gpus.visible_gpu_count() == 4
    assert devices.resolve("auto") == "cuda"


def test_amd_masks_nest_and_auto_agrees_with_pinning(host, monkeypatch) -> None:
    host("amd", 4)
    monkeypatch.setenv(ROCR, "1,2,3")
    monkeypatch.setenv(HIP, "2,0")
    assert gpus.visible_in_this_process() == gpus.VisibleGpus((HIP, CUDA), ("2", "0"))
    assert _pinned_plan(2) == [{HIP: "2", CUDA: "2"}, {HIP: "0", CUDA: "0"}]
    monkeypatch.setenv(HIP, "-1")
    assert devices.resolve("auto") == "cpu" and _pinned_plan(2) == [{}, {}]
    monkeypatch.delenv(HIP)
    monkeypatch.setenv(CUDA, "")  # HIP reads CUDA_VISIBLE_DEVICES too
    assert devices.resolve("auto") == "cpu" and _pinned_plan(2) == [{}, {}]
    monkeypatch.setenv(ROCR, "")
    monkeypatch.setenv(CUDA, "0")
    assert gpus.visible_in_this_process().inconsistency == (
        "CUDA_VISIBLE_DEVICES=0 names GPU 0, but no GPU is left visible below it")


def test_amd_differing_hip_and_cuda_masks(host, monkeypatch) -> None:
    host("amd", 2)
    monkeypatch.setenv(HIP, "0,1")
    monkeypatch.setenv(CUDA, "1")
    found = gpus.visible_in_this_process()
    assert found.entries == ("0", "1")  # HIP reads HIP_VISIBLE_DEVICES first
    assert found.inconsistency is not None and "differ" in found.inconsistency
    with pytest.raises(pinning.PinningError, match="HIP_VISIBLE_DEVICES=0,1 and "
                                                   "CUDA_VISIBLE_DEVICES=1 differ"):
        _pinned_plan(1)


def test_no_gpu_host_sees_nothing_whatever_the_mask(host, monkeypatch) -> None:
    monkeypatch.setenv(CUDA, "0,1")
    assert gpus.visible_in_this_process() == gpus.VisibleGpus((), ())
    assert devices.resolve("auto") == "cpu" and _pinned_plan(2) == [{}, {}]
