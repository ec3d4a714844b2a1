"""benchmarks.device_busy: GPU work charged to the stage whose host call launched it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.device_busy import UNATTRIBUTED, attribute, host_calls, profiled_trace
from benchmarks.throughput import small_case
from difftest.run.session import Session


def _x(cat: str, name: str, ts: float, dur: float, correlation: int | None = None,
       tid: int = 1) -> dict:
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def test_activities_go_to_the_innermost_stage_that_launched_them_whenever_they_ran() -> None:
    trace = {"traceEvents": [
        _x("user_annotation", "stage:reference", 0, 100),
        _x("user_annotation", "stage:generate", 100, 50),
        _x("user_annotation", "stage:triton-unified", 200, 100),
        _x("user_annotation", "stage:cache:plain", 210, 5),  # nested in the backend's run
        _x("user_annotation", "not a stage", 0, 1000),
        _x("cuda_runtime", "cudaGraphLaunch", 10, 2, correlation=1),
        _x("cuda_driver", "cuLaunchKernelEx", 120, 3, correlation=2),
        _x("cuda_runtime", "cudaLaunchKernel", 212, 1, correlation=3),
        _x("cuda_runtime", "cudaLaunchKernel", 250, 1, correlation=4),
        _x("cuda_runtime", "cudaMemcpyAsync", 500, 1, correlation=5),
        # the graph's kernels run long after the reference's host call returned
        _x("kernel", "_scores_kernel", 160, 30, correlation=1),
        _x("kernel", "_values_kernel", 190, 20, correlation=1),
        _x("kernel", "_normal_rows_kernel", 125, 40, correlation=2),
        _x("gpu_memset", "Memset", 215, 4, correlation=3),
        _x("kernel", "kernel_unified_attention", 255, 120, correlation=4),
        _x("gpu_memcpy", "Memcpy DtoH", 501, 6, correlation=5),
        _x("kernel", "orphan", 600, 7, correlation=99),
    ]}
    busy = attribute(trace)
    seconds = {stage: round(b.seconds * 1e6, 6) for stage, b in busy.items()}
    assert seconds == {"reference": 50.0, "generate": 40.0, "cache:plain": 4.0,
                       "triton-unified": 120.0, UNATTRIBUTED: 13.0}
    assert busy["reference"].activities == 2
    assert busy["reference"].largest(1) == [("_scores_kernel", 30e-6)]


def test_host_calls_count_outermost_operators_and_runtime_calls_in_the_innermost_stage() -> None:
    trace = {"traceEvents": [
        _x("user_annotation", "stage:generate", 0, 100),
        _x("user_annotation", "stage:generate", 1000, 60),  # the next case
        _x("user_annotation", "stage:triton-unified", 200, 100),
        _x("user_annotation", "stage:cache:plain", 210, 30),  # nested in the backend's run
        _x("cpu_op", "aten::to", 10, 40),
        _x("cpu_op", "aten::copy_", 15, 30),  # inside aten::to: not counted again
        _x("cuda_runtime", "cudaMemcpyAsync", 20, 20, correlation=1),
        _x("cpu_op", "aten::pin_memory", 60, 25),
        _x("cpu_op", "aten::to", 1010, 30),
        _x("cpu_op", "aten::empty", 20, 5, tid=2),  # another thread: its own outermost op
        _x("cpu_op", "aten::index_fill_", 215, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 220, 4, correlation=2),
        _x("cpu_op", "aten::empty", 250, 2),
        _x("cpu_op", "aten::empty", 500, 2),  # outside every stage
    ]}
    host = host_calls(trace)
    assert round(host["generate"].seconds * 1e6, 6) == 160.0
    assert host["generate"].entries == 2
    assert _us(host["generate"].largest()) == [
        ("op aten::to", 2, 70.0), ("op aten::pin_memory", 1, 25.0),
        ("rt cudaMemcpyAsync", 1, 20.0), ("op aten::empty", 1, 5.0)]
    assert _us(host["cache:plain"].largest()) == [("op aten::index_fill_", 1, 10.0),
                                                  ("rt cudaLaunchKernel", 1, 4.0)]
    assert _us(host["triton-unified"].largest()) == [("op aten::empty", 1, 2.0)]
    assert _us(host[UNATTRIBUTED].largest()) == [("op aten::empty", 1, 2.0)]


def _us(calls: list[tuple[str, int, float]]) -> list[tuple[str, int, float]]:
    return [(name, count, round(seconds * 1e6, 6)) for name, count, seconds in calls]


def test_the_benchmark_refuses_device_busy_on_the_cpu_before_running_cases() -> None:
    """On the CPU there is no device work to profile: an error naming the option, at once."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.throughput", "--device", "cpu",
                           "--device-busy", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--device-busy needs a CUDA/ROCm GPU (the device is cpu)" in done.stderr
    assert "case 1" not in done.stdout


def test_a_real_profiled_case_charges_host_calls_to_the_runners_stages(tmp_path: Path) -> None:
    """The annotations wrap the runner's real stages: one small case through the session's
    pipeline under torch.profiler (CPU), each stage entered once, the reference's einsums
    inside the reference, and no device work on the CPU."""
    session = Session.create(["aiter-gluon@emulated"], device="cpu", artifacts=str(tmp_path))
    case = small_case(3, "float16")
    try:
        trace = profiled_trace(lambda: list(session.run_all([(case, None)])),
                               session.reference, session.backends, tmp_path / "trace.json")
    finally:
        session.close()
    host = host_calls(trace)
    assert {"generate", "reference", "aiter-gluon@emulated", "compare"} <= set(host)
    assert all(host[s].entries == 1 for s in ("generate", "reference", "compare"))
    assert all(h.seconds > 0 for stage, h in host.items() if stage != UNATTRIBUTED)
    assert any(name == "op aten::einsum" for name, _, _ in host["reference"].largest(50))
    assert attribute(trace) == {}
