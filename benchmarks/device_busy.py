"""Device-busy time per stage of a case: the sum of the GPU's own work, launch overhead excluded.

The runner's stage times are wall clock (host work, launches, the synchronisation at each
stage's end), and a CUDA event pair around a launch includes the time the device waits for
the host to enqueue it. Neither says how much work the device itself does for a stage, the
floor that no host-side change can go below. This module measures that floor:

* :func:`labelled_stages` wraps the runner's stage entry points in ``record_function``
  annotations named ``stage:<name>`` (the runner's own stage names: ``generate``,
  ``cache:<order>``, ``reference``, each backend, ``compare``);
* :func:`attribute` reads the profiler's Chrome trace: each GPU activity (kernel, memcpy,
  memset; graph replays' kernels included) is charged to the innermost annotation around the
  host call that launched it (matched by CUPTI's correlation id), whatever moment the device
  ran it.
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from difftest import backend as backend_module
from difftest import runner

PREFIX = "stage:"
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
UNATTRIBUTED = "(outside every stage)"


@dataclass
class StageBusy:
    """One stage's device work over the profiled cases."""

    seconds: float = 0.0
    activities: int = 0
    by_name: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def largest(self, count: int = 3) -> list[tuple[str, float]]:
        """The ``count`` GPU activities (by name) that took most of the stage's time."""
        return sorted(self.by_name.items(), key=lambda item: -item[1])[:count]


def _wrapped(label: str, fn: Any) -> Any:
    from torch.profiler import record_function

    def call(*args: Any, **kwargs: Any) -> Any:
        with record_function(PREFIX + label):
            return fn(*args, **kwargs)

    return call


@contextmanager
def labelled_stages(reference: Any, backends: list[Any]) -> Iterator[None]:
    """Annotate every stage of the runner (restored afterwards): generation
    (``runner.prepared_inputs``), each cache build (``RunInputs.cache``), the reference
    (``reference.reference``), each backend's ``run`` and the comparison."""
    cache = backend_module.RunInputs.cache

    def labelled_cache(inputs: Any, order: str) -> Any:
        return _wrapped(f"cache:{order}", cache)(inputs, order)

    with ExitStack() as undo:
        for owner, attr, replacement in (
            (runner, "prepared_inputs", _wrapped("generate", runner.prepared_inputs)),
            (runner, "compare", _wrapped("compare", runner.compare)),
            (backend_module.RunInputs, "cache", labelled_cache),
            (reference, "reference", _wrapped("reference", reference.reference)),
            *((b, "run", _wrapped(b.name, b.run)) for b in backends),
        ):
            undo.callback(setattr, owner, attr, getattr(owner, attr))
            setattr(owner, attr, replacement)
        yield


def attribute(trace: dict[str, Any]) -> dict[str, StageBusy]:
    """Device seconds per stage from a Chrome trace (``torch.profiler``'s export).

    A GPU activity is charged to the innermost ``stage:`` annotation whose host interval
    holds the launch with the same correlation id; one without such a launch or annotation
    goes to :data:`UNATTRIBUTED`.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    stages = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)),
                      e["name"][len(PREFIX):]) for e in events
                     if e.get("cat") == "user_annotation" and e["name"].startswith(PREFIX))
    launches = {e["args"]["correlation"]: float(e["ts"]) for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    starts = [s[0] for s in stages]
    busy: dict[str, StageBusy] = defaultdict(StageBusy)
    for e in events:
        if e.get("cat") not in GPU_CATEGORIES:
            continue
        launched = launches.get(e.get("args", {}).get("correlation"))
        stage = UNATTRIBUTED if launched is None else _innermost(stages, starts, launched)
        seconds = float(e.get("dur", 0)) / 1e6
        busy[stage].seconds += seconds
        busy[stage].activities += 1
        busy[stage].by_name[e["name"]] += seconds
    return dict(busy)


def _innermost(stages: list[tuple[float, float, str]], starts: list[float],
               moment: float) -> str:
    """The shortest annotation holding ``moment`` (annotations nest or are disjoint)."""
    best: tuple[float, str] | None = None
    for begin, end, name in stages[:bisect.bisect_right(starts, moment)]:
        if begin <= moment <= end and (best is None or end - begin < best[0]):
            best = (end - begin, name)
    return UNATTRIBUTED if best is None else best[1]


def profiled_busy(run: Any, reference: Any, backends: list[Any], trace_path: Path
                  ) -> dict[str, StageBusy]:
    """Call ``run()`` under ``torch.profiler`` (CPU and CUDA) with every stage annotated;
    the trace is kept at ``trace_path``; device seconds per stage."""
    from torch.profiler import ProfilerActivity, profile

    with labelled_stages(reference, backends), profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
    prof.export_chrome_trace(str(trace_path))
    return attribute(json.loads(trace_path.read_text()))
