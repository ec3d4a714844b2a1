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
  ran it;
* :func:`host_calls` reads the same trace for the host side: each stage's span and the torch
  operators and CUDA runtime/driver calls it made (outermost operators only, so a ``to``
  that calls ``copy_`` counts once), which says where a stage's wall goes beyond its device
  work (copies, pinning, launches, synchronisations).
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

from difftest.contract import backend as backend_module
from difftest.run import runner

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


@dataclass
class StageHost:
    """One stage's host side over the profiled cases."""

    seconds: float = 0.0  # the stage's annotated spans, summed
    entries: int = 0  # how many times the stage ran
    by_name: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))

    def largest(self, count: int = 6) -> list[tuple[str, int, float]]:
        """The ``count`` calls (``op <name>`` or ``rt <name>``) that took most of the stage's
        host time: name, how many, seconds."""
        ranked = sorted(self.by_name.items(), key=lambda item: -item[1][1])[:count]
        return [(name, int(n), seconds) for name, (n, seconds) in ranked]


def _wrapped(label: str, fn: Any) -> Any:
    from torch.profiler import record_function

    def call(*args: Any, **kwargs: Any) -> Any:
        with record_function(PREFIX + label):
            return fn(*args, **kwargs)

    return call


@contextmanager
def labelled_stages(reference: Any, backends: list[Any]) -> Iterator[None]:
    """Annotate every stage of the runner (restored afterwards): generation
    (``runner.case_inputs``, prepared ahead or not), each cache build (``RunInputs.cache``),
    the reference (``reference.reference``), each backend's ``run`` and the comparison."""
    cache = backend_module.RunInputs.cache

    def labelled_cache(inputs: Any, order: str) -> Any:
        return _wrapped(f"cache:{order}", cache)(inputs, order)

    with ExitStack() as undo:
        for owner, attr, replacement in (
            (runner, "case_inputs", _wrapped("generate", runner.case_inputs)),
            (runner, "compare_elements", _wrapped("compare", runner.compare_elements)),
            (backend_module.RunInputs, "cache", labelled_cache),
            (reference, "reference", _wrapped("reference", reference.reference)),
            *((b, "run", _wrapped(b.name, b.run)) for b in backends),
        ):
            undo.callback(setattr, owner, attr, getattr(owner, attr))
            setattr(owner, attr, replacement)
        yield


def _complete_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]


def _stages(events: list[dict[str, Any]]) -> list[tuple[float, float, str]]:
    """The ``stage:`` annotations as (begin, end, stage name), by begin."""
    return sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)),
                   e["name"][len(PREFIX):]) for e in events
                  if e.get("cat") == "user_annotation" and e["name"].startswith(PREFIX))


def attribute(trace: dict[str, Any]) -> dict[str, StageBusy]:
    """Device seconds per stage from a Chrome trace (``torch.profiler``'s export).

    A GPU activity is charged to the innermost ``stage:`` annotation whose host interval
    holds the launch with the same correlation id; one without such a launch or annotation
    goes to :data:`UNATTRIBUTED`.
    """
    events = _complete_events(trace)
    annotations = _Annotations(_stages(events))
    launches = {e["args"]["correlation"]: float(e["ts"]) for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    busy: dict[str, StageBusy] = defaultdict(StageBusy)
    for e in events:
        if e.get("cat") not in GPU_CATEGORIES:
            continue
        launched = launches.get(e.get("args", {}).get("correlation"))
        stage = UNATTRIBUTED if launched is None else annotations.innermost(launched)
        seconds = float(e.get("dur", 0)) / 1e6
        busy[stage].seconds += seconds
        busy[stage].activities += 1
        busy[stage].by_name[e["name"]] += seconds
    return dict(busy)


def host_calls(trace: dict[str, Any]) -> dict[str, StageHost]:
    """Host seconds per stage from the same trace: the stage's spans, and the outermost torch
    operators (per thread) and the CUDA runtime/driver calls that began inside it, charged to
    the innermost stage; those outside every stage go to :data:`UNATTRIBUTED`."""
    events = _complete_events(trace)
    annotations = _Annotations(_stages(events))
    host: dict[str, StageHost] = defaultdict(StageHost)
    for begin, end, name in annotations.stages:
        host[name].seconds += (end - begin) / 1e6
        host[name].entries += 1
    calls = [e for e in events if e.get("cat") in LAUNCH_CATEGORIES]
    reach: dict[Any, float] = {}  # per thread, where the current outermost operator ends
    for e in sorted((e for e in events if e.get("cat") == "cpu_op"),
                    key=lambda e: (float(e["ts"]), -float(e.get("dur", 0)))):
        begin, thread = float(e["ts"]), e.get("tid")
        if begin >= reach.get(thread, float("-inf")):
            reach[thread] = begin + float(e.get("dur", 0))
            calls.append(e)
    for e in calls:
        kind = "op" if e.get("cat") == "cpu_op" else "rt"
        tally = host[annotations.innermost(float(e["ts"]))].by_name[f"{kind} {e['name']}"]
        tally[0] += 1
        tally[1] += float(e.get("dur", 0)) / 1e6
    return dict(host)


class _Annotations:
    """The ``stage:`` annotations of a trace, for finding the innermost around a moment."""

    def __init__(self, stages: list[tuple[float, float, str]]) -> None:
        self.stages = stages
        self.starts = [s[0] for s in stages]
        latest, self.reach = float("-inf"), []  # the latest end of annotations 0..i
        for _, end, _ in stages:
            latest = max(latest, end)
            self.reach.append(latest)

    def innermost(self, moment: float) -> str:
        """The shortest annotation holding ``moment`` (annotations nest or are disjoint: of
        those holding it, the one that began last); the walk back stops where no earlier
        annotation reaches ``moment``, so a trace of many cases costs about its events."""
        index = bisect.bisect_right(self.starts, moment) - 1
        while index >= 0 and self.reach[index] >= moment:
            begin, end, name = self.stages[index]
            if begin <= moment <= end:
                return name
            index -= 1
        return UNATTRIBUTED


def profiled_trace(run: Any, reference: Any, backends: list[Any], trace_path: Path
                   ) -> dict[str, Any]:
    """Call ``run()`` under ``torch.profiler`` (CPU, and CUDA where there is a GPU) with every
    stage annotated; the trace, kept at ``trace_path``, for :func:`attribute` and
    :func:`host_calls`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA]
                                          if torch.cuda.is_available() else [])]
    with labelled_stages(reference, backends), profile(activities=activities) as prof:
        run()
    prof.export_chrome_trace(str(trace_path))
    return json.loads(trace_path.read_text())
