"""Historical-bug benchmark: do the default strategies find bugs vLLM shipped, and only those?

    python -m benchmarks.history                      # the seeded bugs (CPU, 2 workers: ~2 min)
    python -m benchmarks.history --json out.json
    python -m benchmarks.history --pair 'triton-unified[vllm=0.30.0]' 'triton-unified[vllm=0.31.0]'

Each pair is a release with a known bug and the release that fixed it, as backend names
(``triton-unified[vllm=<version>]``: :mod:`difftest.backends.vllm_release` resolves versions
under ``$DIFFTEST_VLLM_ROOT``; the missing ones are fetched first, and offline the error says
what to run elsewhere). Per pair the cases are exactly the ones ``difftest run --no-corpus
--backends <buggy> --examples N --seed S`` draws: the capability-aware default strategy
(``Capabilities.probe([buggy], device).strategy()``) through
:func:`difftest.cases.generate.generated_cases`, drawn once in the main process (the ids'
hash is reported) and handed to worker processes (``--workers``, default 2), which split the
work into units: per pair one hunt, and the N cases on the fixed release and the venv's vLLM
(the control) in chunks.

The hunt runs the buggy release on the cases in order and stops at the first disagreement
that the pair's bug explains. Every disagreement it meets is **attributed by ablation**: the
case runs again with each of its active kernel modes switched off (:meth:`Case.mode_off`:
softcap, sliding window, canaries, fp8 queries, query lengths, split-K), and the modes whose
removal makes the release agree are the explanation. A known bug is shown when its mode is
in the explanation and no other known bug's mode is. A release with two known bugs can meet a
case that triggers both (0.13.0 has the window NaN and the softcap NaN, fixed only in 0.31.0):
no single mode explains it, so it is ablated once more with the other bug's mode off, and the
bug is told apart when that case still disagrees and its explanation is the bug's mode. The
verdict for a pair requires the bug to be shown so: the window pair is found only where the
window (not the softcap) explains the disagreement.

The first such failure is then shrunk by a Hypothesis search with the same seed (the same
examples in the same order, judged from the hunt's results; an example the search draws that
the hunt did not judge is counted as a replay miss) on the buggy release alone, within
``--shrink-runs`` kernel runs and ``--shrink-seconds`` seconds, whichever ends first (past
them, candidates pass unrun and the search ends with the smallest failure so far; the report
says which bound stopped it). The shrunk case runs on all three releases and is attributed
too. Every failure of the fixed release or the control is attributed the same way: one that
a known bug of that release explains (0.14.0 still has the softcap NaN) is listed with the
bug; any other is a false positive, and there must be none. Disagreements are not diagnosed
(``run_case(..., diagnose=False)``): the report has no use for it, and on the CPU it took a
third of the time (docs/history.md).

Cases drawn in this process are the ones a ``difftest run`` process draws with the same seed,
whatever either imported (docs/findings.md F11). Measured numbers and the profile are in
docs/history.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import multiprocessing
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from difftest import devices
from difftest.backend import Backend, RunInputs
from difftest.backends.vllm_paged_decode import loads_unread_slots_outside_the_window
from difftest.backends.vllm_release import ReleaseError, fetch_missing, release_specs
from difftest.case import MODE_DEFAULTS, Case, CaseError
from difftest.jsonfile import write_json
from difftest.runner import FAILING, CaseResult, Status, run_case
from difftest.sparse_table import build_rows

CONTROL = "triton-unified"  # the venv's vLLM (0.33.0)
# the modes an ablation switches off, one at a time (split-K off also clears its threshold)
ABLATION_MODES: tuple[str, ...] = tuple(m for m in MODE_DEFAULTS if m != "seq_threshold_3d")
FAILED = frozenset(s.value for s in FAILING)


def release_tuple(version: str) -> tuple[int, ...]:
    """``"0.30.0"`` -> ``(0, 30, 0)`` (the numeric leading parts only)."""
    parts = []
    for part in version.split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits or digits != part:
            break
        parts.append(int(digits))
    return tuple(parts)


@dataclass(frozen=True)
class HistoricalBug:
    """A bug vLLM shipped in the kernel of ``backend``: the last release with it, the first
    without (``""``: not fixed yet, no pair to hunt, but it explains failures), the kernel mode
    whose removal makes its failures agree (the ablation's explanation), and what a case needs
    to trigger it (a predicate, for tests)."""

    name: str
    buggy: str
    fixed: str
    cause: str
    mode: str
    needs: Callable[[Case], bool]
    backend: str = "triton-unified"

    def present_in(self, release: str) -> bool:
        """Whether ``release`` (``backend@version``, see :func:`_version`) has this bug."""
        backend, _, version = release.rpartition("@")
        return backend == self.backend and (
            not self.fixed or release_tuple(version) < release_tuple(self.fixed))

    def explains(self, release: str, case: Case) -> bool:
        """Whether a failure of ``release`` on ``case`` may be this bug."""
        return self.present_in(release) and self.needs(case)


def max_abs_logit(case: Case) -> float:
    """The largest ``|softmax_scale * q.k|`` over every query row and every token of the blocks
    some row attends (a superset of what each row attends)."""
    data = RunInputs(case, torch.device("cpu")).data
    if not data.physical_blocks:
        return 0.0
    keys = data.k_stored.to(torch.float64).flatten(0, 2) * case.k_scale  # [tokens, D]
    query = data.query.to(torch.float64).flatten(0, 1)  # [rows * heads, D]
    return float((query @ keys.T).abs().max()) * case.softmax_scale


def loads_unread_slots_past_the_context(case: Case) -> bool:
    """Whether, with ``canary``, some row's last 16-token tile holds slots past its context
    that no row reads (NaN there; fp8 canaries read as finite under the interpreter)."""
    if not case.canary or (case.is_fp8 and devices.interpreted()):
        return False
    rows = build_rows(case)
    read = set()
    for row in rows:
        ids = [seg.physical_block * case.block_size + t for seg in row.segments
               for t in range(seg.tokens)]
        read.update(ids[-case.sliding_window:] if case.sliding_window else ids)
    for row in rows:
        if row.segments:
            tail = row.segments[-1]
            end = -(-tail.tokens // case.page_size) * case.page_size
            base = tail.physical_block * case.block_size
            if any(base + t not in read for t in range(tail.tokens, end)):
                return True
    return False


EXP_OVERFLOW = 88.0  # float32 exp(y) is inf past y = 88.7


KNOWN_BUGS = (
    HistoricalBug("softcap-nan", "0.30.0", "0.31.0",
                  "apply_softcap computes tanh(y) as (e^y - e^-y) / (e^y + e^-y): inf / inf "
                  "= NaN once |y| = |s / softcap| passes ~88; 0.31.0 computes "
                  "1 - 2 / (e^2y + 1)", "softcap",
                  lambda case: case.softcap > 0
                  and max_abs_logit(case) > 0.9 * EXP_OVERFLOW * case.softcap),
    HistoricalBug("sliding-window-nan", "0.13.0", "0.14.0",
                  "logits outside the window are masked, but the loaded V tile is multiplied "
                  "by P = 0: a NaN slot before the window in the first tile poisons the row; "
                  "0.14.0 zeroes V outside the window", "sliding_window",
                  lambda case: case.sliding_window > 0 and case.canary),
    HistoricalBug("paged-tail-nan", "0.14.0", "0.30.0",
                  "kernel_paged_attention_2d loads every slot of a row's last tile and masks "
                  "only the logits: a NaN slot past seq_len (unwritten cache) makes P @ V NaN; "
                  "0.30.0 masks the K/V loads with abs_token_idx < seq_len (kv_load_mask)",
                  "canary", lambda case: loads_unread_slots_past_the_context(case),
                  backend="vllm-paged-decode"),
    HistoricalBug("paged-window-nan", "0.33.0", "",
                  "docs/findings.md F28: kernel_paged_attention_2d loads the tokens before "
                  "its sliding window and weights them by exp(-10000 - m) = 0", "sliding_window",
                  lambda case: loads_unread_slots_outside_the_window(
                      case, {"triton_interpret": str(devices.interpreted())}),
                  backend="vllm-paged-decode"),
)


def known_bugs(release: str, case: Case) -> list[str]:
    """The known bugs of ``release`` (``backend@version``) whose trigger ``case`` has (no
    kernel runs)."""
    return [b.name for b in KNOWN_BUGS if b.explains(release, case)]


# ----- attribution by ablation -------------------------------------------------------------
def active_modes(case: Case) -> tuple[str, ...]:
    """The kernel modes (and canaries) ``case`` switches on, in :data:`ABLATION_MODES` order."""
    return tuple(m for m in ABLATION_MODES if getattr(case, m) != MODE_DEFAULTS[m])


@dataclass
class Attribution:
    """Which modes explain a release's failure on a case: ``statuses`` per mode switched off
    (``agree`` there means the mode is needed), ``explanation`` (those modes), ``bugs`` (the
    known bugs of the release shown: its mode explains and no other bug's does), and
    ``told_apart``: for a case no single mode explains, the attribution with one known bug's
    mode off (keyed by that mode)."""

    statuses: dict[str, str] = field(default_factory=dict)
    explanation: list[str] = field(default_factory=list)
    bugs: list[str] = field(default_factory=list)
    told_apart: dict[str, Attribution] = field(default_factory=dict)

    def shows(self, bug: str) -> str:
        """How this attribution shows ``bug`` (a sentence), or ``""`` where it does not."""
        if bug in self.bugs:
            return f"switching off {' or '.join(self.explanation)} makes it agree"
        for mode, inner in self.told_apart.items():
            if bug in inner.bugs:
                return (f"no single mode explains it (two known bugs); with {mode} off it "
                        f"still fails, and switching off {' or '.join(inner.explanation)} "
                        "then makes it agree")
        return ""

    def shown(self) -> list[str]:
        """Every known bug this attribution shows, directly or told apart."""
        return [*self.bugs, *(b for inner in self.told_apart.values() for b in inner.bugs
                              if b not in self.bugs)]


def attribute(case: Case, version: str, status_of: Callable[[Case], str],
              depth: int = 1) -> Attribution:
    """Ablate ``case`` on a release of vLLM ``version`` (``status_of`` runs it there and gives
    the status): each active mode off in turn. Where no single mode explains the failure,
    once more (``depth``) with each known bug's mode off that still fails."""
    out = Attribution()
    for mode in active_modes(case):
        try:
            variant = case.mode_off(mode)
        except (CaseError, ValueError):
            out.statuses[mode] = "invalid"
            continue
        out.statuses[mode] = status_of(variant)
    out.explanation = [m for m, s in out.statuses.items() if s == Status.AGREE.value]
    present = [b for b in KNOWN_BUGS if b.present_in(version)]
    explaining = [b for b in present if b.mode in out.explanation]
    out.bugs = [b.name for b in explaining] if len(explaining) == 1 else []
    if not out.explanation and depth > 0:
        for bug in present:
            if out.statuses.get(bug.mode) in FAILED:
                out.told_apart[bug.mode] = attribute(case.mode_off(bug.mode), version,
                                                     status_of, depth - 1)
    return out


def describe_attribution(a: Attribution | None) -> str:
    """One line: each mode's status when switched off, and what that shows."""
    if a is None:
        return "-"
    if not a.statuses:
        return "no kernel mode on (nothing to ablate)"
    parts = ", ".join(f"{m} off: {s}" for m, s in a.statuses.items())
    bugs = a.shown()
    shown = f" -> {', '.join(bugs)}" if bugs else " -> no known bug shown"
    inner = "".join(f"; with {m} off [{describe_attribution(t)}]"
                    for m, t in a.told_apart.items())
    return f"{parts}{inner}{shown}"


# ----- results ---------------------------------------------------------------------------------
@dataclass
class Failure:
    """A backend failing one case (the ``example``-th of its pair's set, 0 for a shrunk case),
    its attribution, and the known bugs of its release that the attribution shows."""

    case: str
    example: int
    backend: str
    status: str
    detail: str
    attribution: Attribution
    known_bugs: list[str]


@dataclass
class PairOutcome:
    """What one (buggy, fixed) pair found."""

    name: str
    buggy: str
    fixed: str
    control: str
    cases_hash: str = ""  # of the drawn cases' ids, in order
    versions: dict[str, str] = field(default_factory=dict)
    found: bool = False
    status: str = ""
    examples: int = 0  # the first failure the bug explains: its number in the case set
    ran: int = 0  # examples the buggy release ran (not unsupported) up to that one
    seconds: float = 0.0  # the hunt's worker seconds from its first example to that failure
    first_case: dict[str, Any] | None = None
    first_detail: str = ""
    attribution: Attribution | None = None
    how: str = ""  # how the attribution shows the bug
    shrunk_case: dict[str, Any] | None = None
    shrunk_detail: str = ""
    shrink_runs: int = 0
    shrink_seconds: float = 0.0
    shrink_stopped: str = ""  # "runs" or "seconds" when a bound ended the search early
    replay_misses: int = 0  # examples the search drew before the failure that the hunt had not
    shrunk_statuses: dict[str, str] = field(default_factory=dict)
    shrunk_attribution: Attribution | None = None
    same_case_statuses: dict[str, dict[str, int]] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)  # every other failure seen
    profile: dict[str, float] = field(default_factory=dict)  # seconds, summed over units

    @property
    def unexplained(self) -> list[Failure]:
        """Failures no known bug of the failing release explains (false positives, or a bug
        not in :data:`KNOWN_BUGS`)."""
        return [f for f in self.failures if not f.known_bugs]


class Profile(Counter):
    """Seconds by part: ``inputs`` (tensors and caches), ``reference``, ``kernel <backend>``,
    ``compare`` (with the diagnosis of disagreements), ``ablation``, ``shrink`` (wall, its
    kernel runs included), ``wall`` (the unit's)."""

    def add(self, result: CaseResult) -> None:
        """Count one run's timings."""
        for key, seconds in result.timings.items():
            if key == "generate" or key.startswith("cache:"):
                self["inputs"] += seconds
            elif key in ("reference", "compare"):
                self[key] += seconds
            else:
                self[f"kernel {key}"] += seconds


# ----- the worker side -----------------------------------------------------------------------
_STATE: dict[str, Any] = {}


def _prepare_worker(device: str, workers: int, started: float) -> None:
    """A worker's one-time set-up: runtime, thread share, the backends."""
    devices.prepare_runtime(device)
    devices.share_cpu_threads(workers)
    _backends()
    _STATE["start"] = time.time() - started


def _backends() -> dict[str, Backend]:
    """The backends that take ``vllm=``, built once per process (no unrelated plug-in can
    break the run)."""
    if "known" not in _STATE:
        from difftest.backends.torch_ref import TorchReference
        from difftest.backends.triton_unified import TritonUnifiedAttention
        from difftest.backends.vllm_decode_attention import VllmDecodeAttention
        from difftest.backends.vllm_paged_decode import VllmPagedDecode
        from difftest.backends.vllm_triton_sparse import VllmTritonSparse

        _STATE["known"] = {b.name: b for b in (TorchReference(), TritonUnifiedAttention(),
                                               VllmTritonSparse(), VllmPagedDecode(),
                                               VllmDecodeAttention())}
        _STATE["chosen"] = {}
    return _STATE["known"]


def _backend(name: str) -> Backend:
    from difftest.registry import select

    chosen = _STATE.setdefault("chosen", {})
    if name not in chosen:
        chosen[name] = select(_backends(), [name])[0]
    return chosen[name]


def _device() -> torch.device:
    return torch.device("cpu" if devices.interpreted() else "cuda")


def _run(case: Case, backends: Sequence[Backend]) -> CaseResult:
    """``case`` on ``backends`` against ``torch-ref``, undiagnosed."""
    return run_case(case, _backend("torch-ref"), list(backends), _device(), diagnose=False)


def _version(backend: Backend) -> str:
    """``<backend base name>@<its vLLM version>``: the release a known bug is keyed by."""
    base = backend.name.split("[", 1)[0]
    return f"{base}@{backend.versions().get('vllm', '?')}"


def _detail(result: Any) -> str:
    c = result.comparison
    if c is not None:
        return (f"{c.mismatched}/{c.checked} elements mismatched, {c.nonfinite} non-finite, "
                f"max error/tolerance {c.max_ratio:.3g}")
    return (result.detail or "").strip().splitlines()[-1] if result.detail else ""


class _Runner:
    """Runs cases on one backend against ``torch-ref``, profiled."""

    def __init__(self, name: str, profile: Profile) -> None:
        self.backend = _backend(name)
        self.version, self.profile = _version(self.backend), profile

    def status(self, case: Case) -> str:
        """The backend's status on ``case``."""
        result = _run(case, [self.backend])
        self.profile.add(result)
        return result.results[0].status.value

    def attribute(self, case: Case) -> Attribution:
        """:func:`attribute` on this backend, its seconds counted as ``ablation``."""
        start = time.perf_counter()
        try:
            return attribute(case, self.version, self.status)
        finally:
            self.profile["ablation"] += time.perf_counter() - start

    def failure(self, case: Case, example: int, result: Any) -> Failure:
        """A failure of this backend, attributed."""
        attribution = self.attribute(case)
        return Failure(case.case_id, example, result.backend, result.status.value,
                       _detail(result), attribution, attribution.shown())


def agree_unit(names: Sequence[str], numbered: Sequence[tuple[int, dict[str, Any]]]
               ) -> dict[str, Any]:
    """Run the cases (``(example number, case dict)``) on the backends ``names``: status
    counts per backend and every failure, attributed."""
    start, profile = time.perf_counter(), Profile()
    runners = [_Runner(name, profile) for name in names]
    backends = [r.backend for r in runners]
    counts: dict[str, Counter[str]] = {name: Counter() for name in names}
    failures = []
    for number, data in numbered:
        case = Case.from_dict(data)
        result = _run(case, backends)
        profile.add(result)
        for runner, r in zip(runners, result.results, strict=True):
            counts[r.backend][r.status.value] += 1
            if r.status in FAILING:
                failures.append(runner.failure(case, number, r))
    profile["wall"] += time.perf_counter() - start
    return {"counts": {k: dict(v) for k, v in counts.items()}, "failures": failures,
            "profile": dict(profile), "worker_start": _STATE.pop("start", None)}


class _Disagreement(Exception):
    """Raised inside the Hypothesis search when the buggy release fails; carries the case."""

    def __init__(self, case: Case) -> None:
        super().__init__(f"disagreement on case {case.case_id}")
        self.case = case


def hunt_unit(target_name: str | None, names: tuple[str, str, str], cases: Sequence[dict],
              seed: int, shrink_runs: int, shrink_seconds: float) -> dict[str, Any]:
    """The buggy release (``names[0]``) on ``cases`` in order, stopping at the first failure
    that ``target_name`` explains (any failure, for ``None``); its shrunk case, run on all
    three ``names``; every failure met on the way, attributed."""
    start, profile = time.perf_counter(), Profile()
    target = next((b for b in KNOWN_BUGS if b.name == target_name), None)
    runner = _Runner(names[0], profile)
    outcome: dict[str, Any] = {"versions": {n: _version(_backend(n)) for n in names},
                               "failures": [], "ran": 0}
    judged: dict[str, bool] = {}  # case id -> whether the buggy release fails it as target
    for number, data in enumerate(cases, 1):
        case = Case.from_dict(data)
        result = _run(case, [runner.backend])
        profile.add(result)
        bug = result.results[0]
        judged[case.case_id] = False
        if bug.status in (Status.UNSUPPORTED, Status.UNAVAILABLE):
            continue
        outcome["ran"] += 1
        if bug.status not in FAILING:
            continue
        failure = runner.failure(case, number, bug)
        how = (failure.attribution.shows(target.name) if target
               else "any failure (no known bug named)")
        if not how:
            outcome["failures"].append(failure)
            continue
        judged[case.case_id] = True
        outcome.update(found=True, status=bug.status.value, examples=number,
                       seconds=time.perf_counter() - start, first_case=case.to_dict(),
                       first_detail=failure.detail, attribution=failure.attribution, how=how)
        break
    if outcome.get("found"):
        shrink_start = time.perf_counter()
        outcome.update(_shrink(default_strategy(runner.backend, _device()), len(cases), seed,
                               judged, runner, target, shrink_runs, shrink_seconds))
        profile["shrink"] += time.perf_counter() - shrink_start
        outcome["shrink_seconds"] = time.perf_counter() - shrink_start
        shrunk = Case.from_dict(outcome["shrunk_case"] or outcome["first_case"])
        final = _run(shrunk, [_backend(n) for n in names])
        profile.add(final)
        outcome["shrunk_statuses"] = {r.backend: r.status.value for r in final.results}
        outcome["shrunk_detail"] = _detail(final.results[0])
        outcome["shrunk_attribution"] = runner.attribute(shrunk)
        for name, r in zip(names[1:], final.results[1:], strict=True):
            if r.status in FAILING:
                outcome["failures"].append(_Runner(name, profile).failure(shrunk, 0, r))
    profile["wall"] += time.perf_counter() - start
    outcome["profile"] = dict(profile)
    outcome["worker_start"] = _STATE.pop("start", None)
    return outcome


def _shrink(strategy: st.SearchStrategy[Case], examples: int, seed: int,
            judged: dict[str, bool], runner: _Runner, target: HistoricalBug | None,
            max_runs: int, max_seconds: float) -> dict[str, Any]:
    """Shrink the hunt's failure: a Hypothesis search with ``difftest run``'s seed and
    settings generates the same examples in the same order (judged from ``judged``), fails on
    the hunt's failure and shrinks it on the buggy release. A candidate runs when the bug's
    trigger is in it (:meth:`HistoricalBug.explains`), and only within ``max_runs`` kernel
    runs and ``max_seconds`` seconds; past either it passes unrun."""
    state = {"runs": 0, "misses": 0, "stopped": "", "failed": False}
    deadline = time.perf_counter() + max_seconds

    def judge(case: Case) -> bool:
        if case.case_id in judged:
            return judged[case.case_id]
        if not state["failed"]:
            state["misses"] += 1  # drawn before the failure, but not one the hunt ran
        if target is not None and not target.explains(runner.version, case):
            return False
        if state["runs"] >= max_runs or time.perf_counter() > deadline:
            state["stopped"] = state["stopped"] or (
                "runs" if state["runs"] >= max_runs else "seconds")
            return False
        state["runs"] += 1
        judged[case.case_id] = runner.status(case) in FAILED
        return judged[case.case_id]

    @hypothesis_seed(seed)
    @settings(max_examples=examples, database=None, deadline=None, derandomize=False,
              phases=(Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck),
              report_multiple_bugs=False, print_blob=False, verbosity=Verbosity.quiet)
    @given(strategy)
    def probe(case: Case) -> None:
        if judge(case):
            state["failed"] = True
            raise _Disagreement(case)

    shrunk = None
    try:
        probe()
    except _Disagreement as found:
        shrunk = found.case.to_dict()
    return {"shrunk_case": shrunk, "shrink_runs": state["runs"],
            "shrink_stopped": state["stopped"], "replay_misses": state["misses"]}


# ----- the main process ----------------------------------------------------------------------
def default_strategy(backend: Backend, device: torch.device) -> st.SearchStrategy[Case]:
    """The cases ``difftest run --backends <backend>`` draws: the capability-aware default
    strategy (:class:`difftest.cases.capabilities.Capabilities`)."""
    from difftest.cases.capabilities import Capabilities

    return Capabilities.probe([backend], device).strategy()


def ids_hash(cases: Sequence[Case]) -> str:
    """A short hash of the cases' ids in order (equal hashes: the same case set)."""
    return hashlib.sha256(",".join(c.case_id for c in cases).encode()).hexdigest()[:12]


def chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    """``items`` in consecutive chunks of ``size`` (the last may be shorter)."""
    return [items[i:i + size] for i in range(0, len(items), max(1, size))]


def run_units(units: list[tuple[Callable[..., dict[str, Any]], tuple[Any, ...]]],
              workers: int, device: str) -> tuple[list[dict[str, Any]], list[float]]:
    """Run ``units`` (function, arguments) on ``workers`` spawned processes, in order of
    submission (in this process for one worker): their results, and each worker's start-up
    seconds (spawn, imports, backends)."""
    if workers <= 1:
        return [function(*args) for function, args in units], []
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=context, initializer=_prepare_worker,
            initargs=(device, workers, time.time())) as pool:
        results = [f.result() for f in [pool.submit(function, *args)
                                        for function, args in units]]
    starts = [r["worker_start"] for r in results if r.get("worker_start") is not None]
    return results, starts


def describe(case: dict[str, Any] | None) -> str:
    """The fields of a case that say what it exercises, on one line."""
    if case is None:
        return "-"
    keys = ("seq_lens", "selections", "num_blocks", "num_q_heads", "decode_query_len",
            "query_dtype", "kv_dtype", "kv_layout", "softmax_scale", "distribution", "seed",
            "softcap", "sliding_window", "canary", "q_scale", "query_lens", "split_k_segments")
    return ", ".join(f"{k}={case[k]}" for k in keys if k in case)


def _failure_lines(failures: list[Failure]) -> list[str]:
    return [f"    {f.backend} {f.status} on {f.case} (example {f.example or 'shrunk'}): "
            f"{f.detail}; ablation: {describe_attribution(f.attribution)}"
            + (f" (known bug of that release: {', '.join(f.known_bugs)})" if f.known_bugs
               else " (UNEXPLAINED: no known bug of that release)") for f in failures]


def summary(outcomes: list[PairOutcome], swept: dict[str, dict[str, int]],
            sweep_failures: list[Failure], sweep_size: int) -> str:
    """The terminal report: the table, the attributions and shrunk cases, the sweep."""
    lines = [f"{'bug':20} {'buggy':28} {'found':5} {'example':>7} {'seconds':>7}  "
             "fixed / control on the same cases"]
    for o in outcomes:
        same = "; ".join(f"{name} {c}" for name, c in o.same_case_statuses.items())
        lines.append(f"{o.name:20} {o.buggy:28} {('yes' if o.found else 'NO'):5} "
                     f"{o.examples if o.found else '-':>7} {o.seconds:>7.1f}  {same}")
    for o in outcomes:
        lines.append(f"\n{o.name}: {o.buggy} ({o.versions[o.buggy]}); fixed {o.fixed} "
                     f"({o.versions[o.fixed]}); control {o.control} "
                     f"({o.versions[o.control]}); cases {o.cases_hash}")
        if o.found:
            lines.append(f"  first failure it explains: example {o.examples} ({o.ran} run by "
                         f"the buggy release), {o.seconds:.1f} s, {o.status}: {o.first_detail}")
            lines.append(f"    case {o.first_case['id'] if o.first_case else '-'}: "
                         f"{describe(o.first_case)}")
            lines.append(f"    ablation: {describe_attribution(o.attribution)}")
            lines.append(f"    verdict: {o.name} shown: {o.how}")
            bound = f", stopped by the {o.shrink_stopped} bound" if o.shrink_stopped else ""
            shrunk_id = o.shrunk_case["id"] if o.shrunk_case else "-"
            lines.append(f"  shrunk in {o.shrink_runs} runs, {o.shrink_seconds:.1f} s{bound} "
                         f"({o.replay_misses} replay misses) to {shrunk_id}: "
                         f"{describe(o.shrunk_case)}")
            lines.append(f"    on the shrunk case: {o.shrunk_statuses}; {o.buggy}: "
                         f"{o.shrunk_detail}")
            lines.append(f"    ablation: {describe_attribution(o.shrunk_attribution)}")
        else:
            lines.append(f"  NOT FOUND in {o.ran} examples the buggy release ran")
        lines.append(f"  other failures: {len(o.failures)}")
        lines.extend(_failure_lines(o.failures))
        lines.append("  profile (s): " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                   sorted(o.profile.items())))
    if sweep_size:
        lines.append(f"\nsweep: the first {sweep_size} cases of the strategy of all releases "
                     "on every release")
        lines.extend(f"  {name:28} {counts}" for name, counts in swept.items())
        lines.extend(_failure_lines(sweep_failures))
    return "\n".join(lines)


def _merge_counts(parts: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    total: dict[str, Counter[str]] = {}
    for part in parts:
        for name, counts in part["counts"].items():
            total.setdefault(name, Counter()).update(counts)
    return {k: dict(v) for k, v in total.items()}


def main(argv: list[str] | None = None) -> int:
    """Run the pairs and the sweep; exit 1 when a bug is missed or a failure is unexplained."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", action="append", nargs=2, default=[],
                        metavar=("BUGGY", "FIXED"),
                        help="a buggy and a fixed backend name (default: the known bugs)")
    parser.add_argument("--control", help="the control backend (default: the buggy "
                        "backend's base name, the venv's vLLM)")
    parser.add_argument("--bug", action="append", default=[],
                        help="hunt only this known bug (repeatable; default: all)")
    parser.add_argument("--examples", type=int, default=50,
                        help="cases per pair, as difftest run --examples")
    parser.add_argument("--seed", type=int, default=0, help="as difftest run --seed")
    parser.add_argument("--shrink-runs", type=int, default=150,
                        help="kernel runs the shrink may spend")
    parser.add_argument("--shrink-seconds", type=float, default=120.0,
                        help="seconds the shrink may spend")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (1: none)")
    parser.add_argument("--chunk", type=int, default=10,
                        help="cases per unit of the fixed release and control runs")
    parser.add_argument("--sweep", type=int, default=0,
                        help="cases of an every-release sweep of the strategy of all the "
                        "releases (0: none)")
    parser.add_argument("--json", help="write the outcomes here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    device_type = "cpu" if devices.visible_gpu_count() == 0 else "cuda"
    devices.prepare_runtime(device_type)
    if args.workers <= 1:
        devices.share_cpu_threads(1)
    device = _device()
    from difftest.cases.capabilities import Capabilities
    from difftest.cases.generate import generated_cases

    pairs: list[tuple[HistoricalBug | None, str, str, str, str]] = [
        (None, buggy, buggy, fixed, args.control or CONTROL) for buggy, fixed in args.pair] or [
        (b, b.name, f"{b.backend}[vllm={b.buggy}]", f"{b.backend}[vllm={b.fixed}]",
         args.control or b.backend)
        for b in KNOWN_BUGS if b.fixed and (not args.bug or b.name in args.bug)]
    try:  # the releases the pairs name, fetched where missing
        fetch_missing(release_specs([n for _, _, *names in pairs for n in names]))
    except ReleaseError as exc:
        print(f"history: {exc}", file=sys.stderr)
        return 2
    outcomes, hunts, agrees, draw_seconds = [], [], [], 0.0
    for target, name, buggy_name, fixed_name, control_name in pairs:
        control = _backend(control_name).name
        drawn_at = time.perf_counter()
        drawn = generated_cases(args.examples, args.seed,
                                default_strategy(_backend(buggy_name), device))
        draw_seconds += time.perf_counter() - drawn_at
        names = (buggy_name, fixed_name, control)
        outcomes.append(PairOutcome(name, *names, cases_hash=ids_hash(drawn)))
        dicts = [c.to_dict() for c in drawn]
        hunts.append((hunt_unit, (target.name if target else None, names, dicts, args.seed,
                                  args.shrink_runs, args.shrink_seconds)))
        agrees.append([(agree_unit, ((fixed_name, control), part))
                       for part in chunks(list(enumerate(dicts, 1)), args.chunk)])
    releases = list(dict.fromkeys(n for o in outcomes for n in (o.buggy, o.fixed, o.control)))
    swept_cases = generated_cases(args.sweep, args.seed, Capabilities.probe(
        [_backend(n) for n in releases], device).strategy()) if args.sweep else []
    sweep_units = [(agree_unit, (releases, part)) for part in
                   chunks(list(enumerate((c.to_dict() for c in swept_cases), 1)), args.chunk)]
    prepared = time.perf_counter() - start
    # the hunts first (their shrinking is the longest unit), then the pairs' chunks in turn
    order = [(i, None) for i in range(len(hunts))] + [
        (i, j) for j in range(max(map(len, agrees), default=0))
        for i in range(len(agrees)) if j < len(agrees[i])]
    units = [hunts[i] if j is None else agrees[i][j] for i, j in order]
    results, worker_starts = run_units(units + sweep_units, args.workers, device_type)
    by_unit = dict(zip(order, results, strict=False))
    for i, o in enumerate(outcomes):
        hunt = by_unit[(i, None)]
        parts = [by_unit[(i, j)] for j in range(len(agrees[i]))]
        for key, value in hunt.items():
            if key not in ("profile", "worker_start", "failures"):
                setattr(o, key, value)
        o.failures = hunt["failures"] + [f for p in parts for f in p["failures"]]
        o.same_case_statuses = _merge_counts(parts)
        o.profile = dict(sum((Counter(r["profile"]) for r in [hunt, *parts]), Counter()))
        o.profile["hunt wall"] = hunt["profile"]["wall"]
    sweep_results = results[len(units):]
    swept = _merge_counts(sweep_results)
    sweep_failures = [f for r in sweep_results for f in r["failures"]]
    total = time.perf_counter() - start
    print(summary(outcomes, swept, sweep_failures, len(swept_cases)))
    print(f"\ndrawing {draw_seconds:.1f} s and set-up {prepared - draw_seconds:.1f} s in the "
          f"main process; {len(units) + len(sweep_units)} units on {max(1, args.workers)} "
          f"worker(s)" + (f", worker start-up {', '.join(f'{s:.1f}' for s in worker_starts)} s"
                          if worker_starts else ""))
    print(f"total {total:.1f} s on {device.type}"
          f"{' (Triton interpreted)' if devices.interpreted() else ''}")
    if args.json:
        write_json(args.json, {"device": device.type, "interpreted": devices.interpreted(),
                               "strategy": "default (Capabilities.probe([buggy]).strategy())",
                               "seed": args.seed, "examples": args.examples,
                               "shrink_runs": args.shrink_runs,
                               "shrink_seconds": args.shrink_seconds,
                               "workers": args.workers, "chunk": args.chunk,
                               "seconds": {"total": total, "drawing": draw_seconds,
                                           "set_up": prepared - draw_seconds,
                                           "worker_start": worker_starts},
                               "outcomes": [asdict(o) for o in outcomes],
                               "sweep": {"cases": len(swept_cases), "statuses": swept,
                                         "failures": [asdict(f) for f in sweep_failures]}})
    missed = [o for o in outcomes if not o.found]
    unexplained = [f for o in outcomes for f in o.unexplained]
    unexplained += [f for f in sweep_failures if not f.known_bugs]
    return 1 if missed or unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
