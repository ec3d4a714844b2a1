"""Historical-bug benchmark: do the default strategies find bugs releases shipped, and only those?

    python -m benchmarks.history                      # every fixed known bug (CPU, 2 workers)
    python -m benchmarks.history --bug aiter-page-48 --json out.json
    python -m benchmarks.history --pair 'triton-unified[vllm=0.30.0]' 'triton-unified[vllm=0.31.0]'

Each pair is a release with a known bug (:data:`KNOWN_BUGS`) and the release that fixed it, as
backend names: ``<backend>[vllm=<version>]`` for vLLM's kernels
(:mod:`difftest.backends.vllm_release` resolves versions under ``$DIFFTEST_VLLM_ROOT``) and
``aiter-unified[aiter=<tag>]`` for AITER's (:mod:`difftest.backends.aiter_triton`, under
``$DIFFTEST_AITER_ROOT``). The missing vLLM releases are fetched first (PyPI), and where that
fails the error says what to run elsewhere. An AITER pair runs as ``difftest bump aiter BUGGY
FIXED --backends aiter-unified --no-corpus --examples N`` (:func:`bump_pair`: the bump fetches
the tags from ``$DIFFTEST_AITER_REPO``): the bug is found at the first example where the buggy
release fails as the bug does and the fixed release agrees, every other failure is listed with
the known bugs of its release whose error or trigger it meets (a bump is not ablated or
shrunk), and the bump's verdict line is printed. The rest of this describes the vLLM pairs. Per
pair the cases are exactly the ones ``difftest run --no-corpus --backends <buggy> --examples N
--seed S`` runs on the buggy release (:func:`run_cases`): N examples of the sparse family, then
N/5 dense ones (the capability-aware default strategies, drawn over what the backend runs in
every release), each followed, where an older release of the backend lacks what it needs, by
its nearest variant every release runs; numbered in that order, drawn once in the main process
(the ids' hash is reported) and handed to worker processes (``--workers``, default 2), which
split the work into units: one hunt per (buggy, fixed) pair, shared by the bugs of that pair,
and the cases on the fixed release and the control (the bug's backend on the environment's
release, where that release has the fix; none for AITER, whose wheel predates the fixes) in
chunks.

The hunt runs the buggy release on the cases in order and stops once each of its bugs has a
first failure that the bug explains. A bug that makes the kernel raise (``error``: F23, F25,
F30 of docs/findings.md) is shown by that error on a case that meets its trigger. Every other
failure is **attributed by ablation**: the case runs again with each of its active kernel
modes switched off (:meth:`Case.mode_off`: softcap, sliding window, canaries, fp8 queries,
query lengths, split-K; the modes of the release's known bugs first), and the modes whose
removal makes the release agree are the explanation. A known bug is shown when its mode is
in the explanation and no other known bug's mode is (where two are, the bugs' triggers
decide). A release with two known bugs can meet a case that triggers both (0.13.0 has the
window NaN and the softcap NaN, fixed only in 0.31.0): no single mode explains it, so it is
ablated once more with the other bug's mode off, and the bug is told apart when that case
still disagrees and its explanation is the bug's mode. The verdict for a pair requires the
bug to be shown so: the window pair is found only where the window (not the softcap)
explains the disagreement.

The first such failure is then shrunk by a Hypothesis search of its family's strategy with
the same seed (an example the search draws that the hunt did not judge is counted as a
replay miss) on the buggy release alone, within ``--shrink-runs`` kernel runs and
``--shrink-seconds`` seconds, whichever ends first (past them, candidates pass unrun and the
search ends with the smallest failure so far; the report says which bound stopped it); then
each kernel mode the failure does not need is switched off. The shrunk case runs on every
release of the pair and is attributed too. Every failure of the fixed release or the
control is attributed the same way: one that a known bug of that release explains (0.14.0
still has the softcap NaN; every AITER release has F21, F22 and F24) is listed with the bug;
any other is a false positive, and there must be none. Disagreements are not diagnosed
(``run_case(..., diagnose=False)``): the report has no use for it, and on the CPU it took a
third of the time (docs/history.md).

Cases drawn in this process are the ones a ``difftest run`` process draws with the same seed,
whatever either imported (docs/findings.md F11). Measured numbers are in docs/history.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import multiprocessing
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from packaging.version import InvalidVersion, Version

from difftest.backends.aiter_release import AiterFetchError
from difftest.backends.aiter_release import fetch_missing as fetch_missing_aiter
from difftest.backends.vllm_paged_decode import loads_unread_slots_outside_the_window
from difftest.backends.vllm_release import ReleaseError, fetch_missing, release_specs
from difftest.case.selection import (
    build_rows,
    last_page_past_context,
    read_slots,
    window_page_before,
)
from difftest.case.spec import MODE_DEFAULTS, Case, CaseError
from difftest.contract.backend import Backend, RunInputs
from difftest.machine import devices
from difftest.primitives.jsonfile import write_json
from difftest.reporting.report import read_report
from difftest.run.runner import FAILING, CaseResult, Status, run_case

CONTROL = "triton-unified"  # the venv's vLLM (0.33.0)
# the modes an ablation switches off, one at a time (split-K off also clears its threshold)
ABLATION_MODES: tuple[str, ...] = tuple(m for m in MODE_DEFAULTS if m != "seq_threshold_3d")
FAILED = frozenset(s.value for s in FAILING)


def release_version(name: str) -> Version:
    """A release name as a version: ``"0.30.0"``, an AITER tag ``"v0.1.16.post3"``."""
    return Version(name.removeprefix("v"))


@dataclass(frozen=True)
class HistoricalBug:
    """A bug a release shipped in the kernel of ``backend``: the last release with it, the
    first without (``""``: not fixed yet, no pair to hunt, but it explains failures), the
    first with it where older releases lack it (``since``), the kernel mode whose removal
    makes its failures agree (the ablation's explanation; ``""`` for a bug of the geometry),
    or the text of the error the kernel raises (``error``: such a failure is shown by that
    error on a case meeting ``needs``), and what a case needs to trigger it."""

    name: str
    buggy: str
    fixed: str
    cause: str
    mode: str
    needs: Callable[[Case], bool]
    backend: str = "triton-unified"
    error: str = ""
    since: str = ""
    with_modes: tuple[str, ...] = ()  # other modes its failures need (a window NaN: canaries)

    @property
    def modes(self) -> tuple[str, ...]:
        """Every mode a failure of this bug needs: its own, then :attr:`with_modes`."""
        return (self.mode, *self.with_modes)

    @property
    def option(self) -> str:
        """The backend option that names a release: ``aiter`` (an AITER tag) or ``vllm``."""
        return "aiter" if self.backend.startswith("aiter-") else "vllm"

    @property
    def control(self) -> str:
        """The control backend: the bug's backend on the environment's release where that
        release has the fix (the venv's vLLM); none (``""``) for AITER, whose wheel
        (0.1.7.post2.dev18) predates the fixes."""
        return self.backend if self.option == "vllm" else ""

    def release_name(self, release: str) -> str:
        """The backend name that runs ``release``, e.g. ``aiter-unified[aiter=v0.1.11]``."""
        return f"{self.backend}[{self.option}={release}]"

    def present_in(self, release: str) -> bool:
        """Whether ``release`` (``backend@version``, see :func:`release_of`) has this bug."""
        backend, _, version = release.rpartition("@")
        if backend != self.backend:
            return False
        try:
            found = release_version(version)
        except InvalidVersion:
            return False
        return ((not self.fixed or found < release_version(self.fixed))
                and (not self.since or found >= release_version(self.since)))

    def explains(self, release: str, case: Case) -> bool:
        """Whether a failure of ``release`` on ``case`` may be this bug."""
        return self.present_in(release) and self.needs(case)

    def raised_by(self, release: str, case: Case, status: str, detail: str) -> bool:
        """Whether a result of ``release`` on ``case`` is this bug's error."""
        return (bool(self.error) and status == Status.ERROR.value and self.error in detail
                and self.explains(release, case))


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
    """Whether, with ``canary``, some row's last page (``page_size`` tokens) holds slots past
    its context that no row reads (NaN there)."""
    if not case.canary:
        return False
    rows = build_rows(case)
    read = read_slots(case, rows)
    return any(span is not None and not read.issuperset(span.slots(case.block_size))
               for span in (last_page_past_context(case, row) for row in rows))


def loads_unread_slots_before_the_window(case: Case) -> bool:
    """Whether, with ``canary`` and a sliding window, the page (``page_size`` tokens) where
    some row's window starts holds slots before the window that no row reads (NaN there)."""
    if not (case.canary and case.sliding_window):
        return False
    rows = build_rows(case)
    read = read_slots(case, rows)
    return any(span is not None and not read.issuperset(span.slots(case.block_size))
               for span in (window_page_before(case, row) for row in rows))


def _aiter_3d(case: Case) -> bool:
    """Whether AITER sends ``case`` to its 3-D kernel (on the arch a CPU run answers)."""
    from difftest.backends.aiter_triton import COMPUTE_UNITS
    from difftest.backends.aiter_unified import case_arch, kernel_path

    return kernel_path(case, COMPUTE_UNITS[case_arch(case)]) == "3D"


EXP_OVERFLOW = 88.0  # float32 exp(y) is inf past y = 88.7


def _softcap_overflows(case: Case) -> bool:
    return case.softcap > 0 and max_abs_logit(case) > 0.9 * EXP_OVERFLOW * case.softcap


KNOWN_BUGS = (
    HistoricalBug("softcap-nan", "0.30.0", "0.31.0",
                  "apply_softcap computes tanh(y) as (e^y - e^-y) / (e^y + e^-y): inf / inf "
                  "= NaN once |y| = |s / softcap| passes ~88; 0.31.0 computes "
                  "1 - 2 / (e^2y + 1)", "softcap", _softcap_overflows),
    HistoricalBug("sliding-window-nan", "0.13.0", "0.14.0",
                  "logits outside the window are masked, but the loaded V tile is multiplied "
                  "by P = 0: a NaN slot before the window in the first tile poisons the row; "
                  "0.14.0 zeroes V outside the window", "sliding_window",
                  lambda case: case.sliding_window > 0 and case.canary,
                  with_modes=("canary",)),
    HistoricalBug("paged-tail-nan", "0.14.0", "0.30.0",
                  "kernel_paged_attention_2d loads every slot of a row's last tile and masks "
                  "only the logits: a NaN slot past seq_len (unwritten cache) makes P @ V NaN; "
                  "0.30.0 masks the K/V loads with abs_token_idx < seq_len (kv_load_mask)",
                  "canary", loads_unread_slots_past_the_context,
                  backend="vllm-paged-decode"),
    HistoricalBug("paged-window-nan", "0.33.0", "",
                  "docs/findings.md F28: kernel_paged_attention_2d loads the tokens before "
                  "its sliding window and weights them by exp(-10000 - m) = 0", "sliding_window",
                  # fp8 NaN canaries are NaN interpreted too (F27: difftest.machine.interpreter)
                  lambda case: loads_unread_slots_outside_the_window(case, {}),
                  backend="vllm-paged-decode", with_modes=("canary",)),
    HistoricalBug("aiter-fp16-3d-assert", "v0.1.16", "v0.1.16.post3",
                  "docs/findings.md F23: select_3d_config asserts kv_cache_dtype in (bf16, "
                  "fp8), so an fp16 cache on the 3-D kernel (max_seqlen_k past 512, no window) "
                  "raises; v0.1.16.post3 keeps the assertion for gfx1250 only", "",
                  lambda case: case.kv_dtype == "float16" and _aiter_3d(case),
                  backend="aiter-unified", error="kv_cache_dtype only supports BF16",
                  since="v0.1.16"),
    HistoricalBug("aiter-page-48", "v0.1.11", "v0.1.12",
                  "docs/findings.md F25: select_2d_config sets TILE_SIZE = block_size for "
                  "decode batches and tl.arange needs a power of 2, so 48-token pages fail to "
                  "compile; v0.1.12 rounds the tile up", "",
                  lambda case: case.page_size == 48 and not case.query_lens,
                  backend="aiter-unified", error="arange's range must be a power of 2"),
    HistoricalBug("aiter-3d-head-80", "v0.1.11", "v0.1.12",
                  "docs/findings.md F30: the 3-D kernel's padded-head path (head sizes 80, "
                  "96) uses offs_d before defining it; v0.1.12 defines it", "",
                  lambda case: case.head_dim in (80, 96) and _aiter_3d(case),
                  backend="aiter-unified", error="name 'offs_d' is not defined"),
    HistoricalBug("aiter-softcap-nan", "v0.1.20.post1", "",
                  "docs/findings.md F21: AITER's apply_softcap is vLLM's before 0.31.0",
                  "softcap", _softcap_overflows, backend="aiter-unified"),
    HistoricalBug("aiter-window-nan", "v0.1.20.post1", "",
                  "docs/findings.md F22: NaN V slots of the window's first tile before the "
                  "window are multiplied by P = 0", "sliding_window",
                  loads_unread_slots_before_the_window, backend="aiter-unified",
                  with_modes=("canary",)),
    HistoricalBug("aiter-tail-nan", "v0.1.20.post1", "",
                  "docs/findings.md F24: NaN V slots of a row's last page past its context "
                  "are multiplied by P = 0", "canary", loads_unread_slots_past_the_context,
                  backend="aiter-unified"),
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
    known bugs of the release shown: its mode explains and no other bug's does, or it raised
    the bug's error: ``error``), and ``told_apart``: for a case no single mode explains, the
    attribution with one known bug's mode off (keyed by that mode)."""

    statuses: dict[str, str] = field(default_factory=dict)
    explanation: list[str] = field(default_factory=list)
    bugs: list[str] = field(default_factory=list)
    told_apart: dict[str, Attribution] = field(default_factory=dict)
    error: str = ""  # the known error the release raised (then nothing is ablated)

    def shows(self, bug: str) -> str:
        """How this attribution shows ``bug`` (a sentence), or ``""`` where it does not."""
        if bug in self.bugs and self.error:
            return f"it raises {self.error!r} on a case that meets the bug's trigger"
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


def _explaining(present: Sequence[HistoricalBug], explanation: Sequence[str],
                case: Case) -> list[HistoricalBug]:
    """The one known bug an ablation's ``explanation`` shows, or none: the bug whose mode is
    in it; of several, the one whose trigger the case has, else the one needing most of the
    explanation's modes (window and canaries off each agree: the window NaN, not a canary
    bug alone)."""
    explaining = [b for b in present if b.mode in explanation]
    if len(explaining) > 1:
        by_trigger = [b for b in explaining if b.needs(case)]
        if len(by_trigger) == 1:
            return by_trigger
        covered = [b for b in explaining if set(b.modes) <= set(explanation)]
        most = max((len(b.modes) for b in covered), default=0)
        explaining = [b for b in covered if len(b.modes) == most]
    return explaining if len(explaining) == 1 else []


def attribute(case: Case, version: str, status_of: Callable[[Case], str],
              depth: int = 1) -> Attribution:
    """Ablate ``case`` on a release ``version`` (``status_of`` runs it there and gives the
    status): each active mode off in turn, the modes of the release's known bugs first; the
    others only where no known bug is shown (they show none, but say what explains the
    failure). Where no single mode explains it, once more (``depth``) with each known bug's
    mode off that still fails, where the case has that bug's trigger and the variant the
    trigger of one other known bug (the modes of known bugs only, then)."""
    out = Attribution()
    present = [b for b in KNOWN_BUGS if b.present_in(version) and b.mode]
    known = {b.mode for b in present}
    active = active_modes(case)
    rest = [m for m in active if m not in known] if depth > 0 else []
    for modes in ([m for m in active if m in known], rest):
        if out.bugs:
            break
        for mode in modes:
            try:
                variant = case.mode_off(mode)
            except (CaseError, ValueError):
                out.statuses[mode] = "invalid"
                continue
            out.statuses[mode] = status_of(variant)
        out.explanation = [m for m, s in out.statuses.items() if s == Status.AGREE.value]
        out.bugs = [b.name for b in _explaining(present, out.explanation, case)]
    if not out.explanation and depth > 0:
        for bug in present:
            if out.statuses.get(bug.mode) not in FAILED or not bug.needs(case):
                continue
            variant = case.mode_off(bug.mode)
            # told apart only where one known bug's trigger is left (three stay tangled)
            if len([b for b in present if b is not bug and b.needs(variant)]) == 1:
                out.told_apart[bug.mode] = attribute(variant, version, status_of, depth - 1)
    return out


def describe_attribution(a: Attribution | None) -> str:
    """One line: each mode's status when switched off, and what that shows."""
    if a is None:
        return "-"
    if a.error:
        return f"raises {a.error!r} -> {', '.join(a.bugs)}"
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
    sparse: int = 0  # the case set: this many sparse cases, then the dense ones
    dense: int = 0
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
    """The backends that take ``vllm=`` or ``aiter=``, built once per process (no unrelated
    plug-in can break the run)."""
    if "known" not in _STATE:
        from difftest.backends.aiter_unified import AiterUnified
        from difftest.backends.torch_ref import TorchReference
        from difftest.backends.triton_unified import TritonUnifiedAttention
        from difftest.backends.vllm_decode_attention import VllmDecodeAttention
        from difftest.backends.vllm_paged_decode import VllmPagedDecode
        from difftest.backends.vllm_triton_sparse import VllmTritonSparse

        _STATE["known"] = {b.name: b for b in (TorchReference(), TritonUnifiedAttention(),
                                               VllmTritonSparse(), VllmPagedDecode(),
                                               VllmDecodeAttention(), AiterUnified())}
        _STATE["chosen"] = {}
    return _STATE["known"]


def _backend(name: str) -> Backend:
    from difftest.contract.registry import select

    chosen = _STATE.setdefault("chosen", {})
    if name not in chosen:
        chosen[name] = select(_backends(), [name])[0]
    return chosen[name]


def _device() -> torch.device:
    return torch.device("cpu" if devices.interpreted() else "cuda")


def _run(case: Case, backends: Sequence[Backend]) -> CaseResult:
    """``case`` on ``backends`` against ``torch-ref``, undiagnosed."""
    return run_case(case, _backend("torch-ref"), list(backends), _device(), diagnose=False)


def release_of(backend: Backend) -> str:
    """``<backend base name>@<its vLLM or AITER version>``: the release a known bug is keyed
    by."""
    base = backend.name.split("[", 1)[0]
    versions = backend.versions()
    return f"{base}@{versions.get('vllm') or versions.get('amd-aiter') or '?'}"


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
        self.version, self.profile = release_of(self.backend), profile
        # case id -> status and detail (ablations and the shrink meet a case twice)
        self.outcomes: dict[str, tuple[str, str]] = {}

    def outcome(self, case: Case) -> tuple[str, str]:
        """The backend's status on ``case`` and its detail."""
        if case.case_id not in self.outcomes:
            result = _run(case, [self.backend])
            self.profile.add(result)
            r = result.results[0]
            self.outcomes[case.case_id] = (r.status.value, r.detail or "")
        return self.outcomes[case.case_id]

    def status(self, case: Case) -> str:
        """The backend's status on ``case``."""
        return self.outcome(case)[0]

    def fails_as(self, case: Case, target: HistoricalBug | None) -> bool:
        """Whether the backend fails ``case``; for an error bug, with that bug's error."""
        status, detail = self.outcome(case)
        if target is not None and target.error:
            return target.raised_by(self.version, case, status, detail)
        return status in FAILED

    def attribute(self, case: Case) -> Attribution:
        """:func:`attribute` on this backend, its seconds counted as ``ablation``."""
        start = time.perf_counter()
        try:
            return attribute(case, self.version, self.status)
        finally:
            self.profile["ablation"] += time.perf_counter() - start

    def failure(self, case: Case, example: int, result: Any) -> Failure:
        """A failure of this backend, attributed: by a known bug's error where it raised
        one, else by ablation."""
        raised = [b for b in KNOWN_BUGS
                  if b.raised_by(self.version, case, result.status.value, result.detail or "")]
        attribution = (Attribution(bugs=[b.name for b in raised], error=raised[0].error)
                       if raised else self.attribute(case))
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


def hunt_unit(target_names: Sequence[str | None], names: Sequence[str],
              cases: Sequence[dict], sparse: int, seed: int, shrink_runs: int,
              shrink_seconds: float) -> dict[str, Any]:
    """The buggy release (``names[0]``) on ``cases`` in order (the first ``sparse`` of the
    sparse family, the rest dense), stopping once each of ``target_names`` has a first failure
    it explains (``None``: any failure); per target its shrunk case, run on all three
    ``names``; every other failure met on the way, attributed."""
    start, profile = time.perf_counter(), Profile()
    targets = {name: next((b for b in KNOWN_BUGS if b.name == name), None)
               for name in target_names}
    runner = _Runner(names[0], profile)
    outcome: dict[str, Any] = {"versions": {n: release_of(_backend(n)) for n in names},
                               "failures": [], "ran": 0, "targets": {}}
    found: dict[str | None, dict[str, Any]] = {}
    judged: dict[str, bool] = {}  # case id -> whether the buggy release fails it as a target
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
        print(f"hunt {names[0]}: example {example_label(number, sparse)} {bug.status.value}, "
              f"{describe_attribution(failure.attribution)} "
              f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
        shown = [(name, failure.attribution.shows(name) if target
                  else "any failure (no known bug named)")
                 for name, target in targets.items() if name not in found]
        shown = [(name, how) for name, how in shown if how]
        if not shown:
            outcome["failures"].append(failure)
            continue
        judged[case.case_id] = True
        for name, how in shown:
            found[name] = {"found": True, "status": bug.status.value, "examples": number,
                           "ran": outcome["ran"], "seconds": time.perf_counter() - start,
                           "first_case": case.to_dict(), "first_detail": failure.detail,
                           "attribution": failure.attribution, "how": how,
                           "first_failure": failure}
        if len(found) == len(targets):
            break
    for name, entry in found.items():
        dense = Case.from_dict(entry["first_case"]).dense
        count = len(cases) - sparse if dense else sparse
        shrink_start = time.perf_counter()
        entry.update(_shrink(default_strategy(runner.backend, _device(), dense)(), count, seed,
                             dict(judged), runner, targets[name], shrink_runs, shrink_seconds))
        shrunk, runs = _reduce(Case.from_dict(entry["shrunk_case"] or entry["first_case"]),
                               runner, targets[name])
        entry["shrunk_case"], entry["shrink_runs"] = shrunk.to_dict(), entry["shrink_runs"] + runs
        profile["shrink"] += time.perf_counter() - shrink_start
        entry["shrink_seconds"] = time.perf_counter() - shrink_start
        final = _run(shrunk, [_backend(n) for n in names])
        profile.add(final)
        entry["shrunk_statuses"] = {r.backend: r.status.value for r in final.results}
        entry["shrunk_detail"] = _detail(final.results[0])
        entry["shrunk_attribution"] = (
            runner.failure(shrunk, 0, final.results[0]).attribution
            if final.results[0].status in FAILING else None)
        entry["failures"] = [_Runner(n, profile).failure(shrunk, 0, r)
                             for n, r in zip(names[1:], final.results[1:], strict=True)
                             if r.status in FAILING]
    for name, entry in found.items():  # the other targets' first failures are failures too
        entry["failures"] += [e["first_failure"] for n, e in found.items() if n != name]
    for entry in found.values():
        entry.pop("first_failure")
    outcome["targets"] = {str(name): entry for name, entry in found.items()}
    profile["wall"] += time.perf_counter() - start
    outcome["profile"] = dict(profile)
    outcome["worker_start"] = _STATE.pop("start", None)
    return outcome


def _reduce(case: Case, runner: _Runner, target: HistoricalBug | None) -> tuple[Case, int]:
    """Switch off, one at a time, each active kernel mode (the bug's own and the family kept)
    whose removal keeps the failure as ``target``'s: the case and the kernel runs spent."""
    runs = 0
    for mode in active_modes(case):
        if mode == "dense" or (target is not None and mode == target.mode):
            continue
        try:
            variant = case.mode_off(mode)
        except (CaseError, ValueError):
            continue
        if target is not None and not target.explains(runner.version, variant):
            continue
        runs += 1
        if runner.fails_as(variant, target):
            case = variant
    return case, runs


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
        judged[case.case_id] = runner.fails_as(case, target)
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
def release_parts(name: str) -> tuple[str, str]:
    """``aiter-unified[aiter=v0.1.11]`` -> ``("aiter-unified", "v0.1.11")``."""
    base, _, option = name.partition("[")
    return base, option.rstrip("]").partition("=")[2]


def _recorded_detail(result: dict[str, Any]) -> str:
    """A report result's failure on one line, as :func:`_detail` gives a live one's."""
    c = result.get("comparison")
    if c:
        return (f"{c['mismatched']}/{c['checked']} elements mismatched, {c['nonfinite']} "
                f"non-finite, max error/tolerance {float(c['max_ratio']):.3g}")
    lines = (result.get("detail") or "").strip().splitlines()
    return lines[-1] if lines else ""


def _known_in(release: str, case: Case, status: str, detail: str) -> list[str]:
    """The known bugs of ``release`` whose error a failure raised or (for a bug of a kernel
    mode) whose trigger its case meets: a bump's failures are not ablated."""
    return [b.name for b in KNOWN_BUGS if b.raised_by(release, case, status, detail)
            or (not b.error and b.explains(release, case))]


def _outcome_failures(results: dict[str, dict[str, Any]], order: Sequence[Case], name: str,
                      release: str, skip: str = "") -> list[Failure]:
    """Every failing result of a bump's report (``results`` by case id) but case ``skip``'s,
    numbered by ``order``, with the known bugs of its release it shows (:func:`_known_in`)."""
    failures = []
    for number, case in enumerate(order, 1):
        result = results.get(case.case_id)
        if result is None or result["status"] not in FAILED or case.case_id == skip:
            continue
        bugs = _known_in(release, case, result["status"], result.get("detail") or "")
        raised = next((b.error for b in KNOWN_BUGS if b.name in bugs and b.error), "")
        failures.append(Failure(case.case_id, number, name, result["status"],
                                _recorded_detail(result), Attribution(bugs=bugs, error=raised),
                                bugs))
    return failures


def bump_pair(members: Sequence[tuple[HistoricalBug | None, str]], buggy_name: str,
              fixed_name: str, order: Sequence[Case], args: argparse.Namespace, device: str
              ) -> tuple[list[PairOutcome], str]:
    """An AITER pair through ``difftest bump aiter BUGGY FIXED``: the cases ``difftest run``
    runs on the buggy release (``order``, :func:`run_cases`), run again on the fixed release
    and gated. Per bug of ``members``, the first case where the buggy release fails as the bug
    does and the fixed release runs it without the bug (it agrees, or fails only as a known
    bug of its own), and every other failure; and the bump's verdict line. No shrinking: the
    bump's reports are the record."""
    backend, buggy = release_parts(buggy_name)
    _, fixed = release_parts(fixed_name)
    with tempfile.TemporaryDirectory() as directory:
        command = [sys.executable, "-m", "difftest", "bump", "aiter", buggy, fixed,
                   "--backends", backend, "--no-corpus", f"--examples={args.examples}",
                   f"--seed={args.seed}", f"--jobs={max(1, args.workers)}",
                   f"--device={device}", f"--report-dir={directory}"]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - started
        if done.returncode not in (0, 1):
            said = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"difftest bump aiter {buggy} {fixed} exited "
                               f"{done.returncode}: {said}")
        old, new = (read_report(Path(directory) / f"{side}.json")
                    for side in ("baseline", "candidate"))
    verdict = (done.stdout.strip().splitlines() or ["(no verdict)"])[-1]
    releases = {n: f"{backend}@{r['backends'][backend]['versions'].get('amd-aiter')}"
                for n, r in ((buggy_name, old), (fixed_name, new))}
    before, after = ({c["case_id"]: c["results"][0] for c in r["cases"]} for r in (old, new))
    sparse = sum(not c.dense for c in order)
    outcomes = []
    for target, name in members:
        outcome = PairOutcome(name, buggy_name, fixed_name, "", ids_hash(order), sparse,
                              len(order) - sparse, releases,
                              same_case_statuses={fixed_name: dict(Counter(
                                  r["status"] for r in after.values()))},
                              profile={"bump wall": seconds})
        ran = 0
        for number, case in enumerate(order, 1):
            result, fixed_result = before[case.case_id], after[case.case_id]
            ran += result["status"] not in ("unsupported", "unavailable")
            detail = result.get("detail") or ""
            shown = result["status"] in FAILED and (
                target is None or target.raised_by(releases[buggy_name], case,
                                                   result["status"], detail)
                or (not target.error and target.explains(releases[buggy_name], case)))
            fixed_known = _known_in(releases[fixed_name], case, fixed_result["status"],
                                    fixed_result.get("detail") or "")
            fixed_clean = fixed_result["status"] == Status.AGREE.value or (
                fixed_result["status"] in FAILED and fixed_known and name not in fixed_known)
            if shown and fixed_clean:
                outcome.found, outcome.status, outcome.examples, outcome.ran = (
                    True, result["status"], number, ran)
                outcome.seconds, outcome.first_case = seconds, case.to_dict()
                outcome.first_detail = _recorded_detail(result)
                outcome.attribution = Attribution(bugs=[name],
                                                  error=target.error if target else "")
                outcome.how = ("it fails as the bug does on a case that meets its trigger, "
                               f"and the fixed release {fixed_result['status']}s there"
                               + (f" (its own {', '.join(fixed_known)})" if fixed_known
                                  and fixed_result["status"] != "agree" else ""))
                break
        first = outcome.first_case["id"] if outcome.first_case else ""
        outcome.failures = (
            _outcome_failures(before, order, buggy_name, releases[buggy_name], first)
            + _outcome_failures(after, order, fixed_name, releases[fixed_name]))
        outcomes.append(outcome)
    return outcomes, verdict


def example_label(number: int, sparse: int) -> str:
    """``"12"``, or ``"53 (dense 3)"`` past the ``sparse`` cases of a case set."""
    return f"{number} (dense {number - sparse})" if number > sparse else str(number)


def run_cases(backend: Backend, device: torch.device, examples: int, seed: int) -> list[Case]:
    """The cases ``difftest run --no-corpus --backends <backend> --examples N --seed S`` runs
    on ``backend``, in order: each drawn example, and where an older release of the backend
    refuses it, the nearest variant every release runs
    (:meth:`difftest.generation.capabilities.Capabilities.fit`)."""
    from difftest.generation.capabilities import Capabilities
    from difftest.run.plan import RunPlan

    plan = RunPlan.drawn(Capabilities.probe([backend], device), [], examples, seed)
    return [run.case for run in plan.runs]


def default_strategy(backend: Backend, device: torch.device, dense: bool = False
                     ) -> Callable[..., st.SearchStrategy[Case]]:
    """The cases ``difftest run --backends <backend>`` draws: the capability-aware default
    strategy of the sparse or the dense family
    (:class:`difftest.generation.capabilities.Capabilities`), a function of its options."""
    from difftest.generation.capabilities import Capabilities

    capabilities = Capabilities.probe([backend], device)
    return capabilities.dense_strategy if dense else capabilities.strategy


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
    lines = [f"{'bug':20} {'buggy':28} {'found':5} {'example':>12} {'seconds':>7}  "
             "fixed / control on the same cases"]
    for o in outcomes:
        same = "; ".join(f"{name} {c}" for name, c in o.same_case_statuses.items())
        lines.append(f"{o.name:20} {o.buggy:28} {('yes' if o.found else 'NO'):5} "
                     f"{example_label(o.examples, o.sparse) if o.found else '-':>12} "
                     f"{o.seconds:>7.1f}  {same}")
    for o in outcomes:
        control = (f"control {o.control} ({o.versions[o.control]})" if o.control
                   else "no control (the environment's release predates the fix)")
        lines.append(f"\n{o.name}: {o.buggy} ({o.versions[o.buggy]}); fixed {o.fixed} "
                     f"({o.versions[o.fixed]}); {control}; cases {o.cases_hash} "
                     f"({o.sparse} sparse, {o.dense} dense)")
        if o.found:
            lines.append(f"  first failure it explains: example "
                         f"{example_label(o.examples, o.sparse)} ({o.ran} run by "
                         f"the buggy release), {o.seconds:.1f} s, {o.status}: {o.first_detail}")
            lines.append(f"    case {o.first_case['id'] if o.first_case else '-'}: "
                         f"{describe(o.first_case)}")
            lines.append(f"    ablation: {describe_attribution(o.attribution)}")
            lines.append(f"    verdict: {o.name} shown: {o.how}")
            bound = f", stopped by the {o.shrink_stopped} bound" if o.shrink_stopped else ""
            if o.shrunk_case is None:  # an AITER pair: the bump's reports are the record
                lines.append("  not shrunk: run through difftest bump")
            else:
                lines.append(f"  shrunk in {o.shrink_runs} runs, {o.shrink_seconds:.1f} s"
                             f"{bound} ({o.replay_misses} replay misses) to "
                             f"{o.shrunk_case['id']}: {describe(o.shrunk_case)}")
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
    parser.add_argument("--control", help="the control backend, '' for none (default: "
                        "the bug's, HistoricalBug.control)")
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
    from difftest.generation.capabilities import Capabilities
    from difftest.generation.generate import generated_cases

    pairs: list[tuple[HistoricalBug | None, str, str, str, str]] = [
        (None, buggy, buggy, fixed, CONTROL if args.control is None else args.control)
        for buggy, fixed in args.pair] or [
        (b, b.name, b.release_name(b.buggy), b.release_name(b.fixed),
         args.control if args.control is not None else b.control)
        for b in KNOWN_BUGS if b.fixed and (not args.bug or b.name in args.bug)]
    try:  # the vLLM releases the pairs name, fetched where missing (a bump fetches AITER's)
        fetch_missing(release_specs([n for _, _, *names in pairs for n in names]))
    except ReleaseError as exc:
        print(f"history: {exc}", file=sys.stderr)
        return 2
    # bugs of one (buggy, fixed, control) triple share its cases, its hunt and its runs; an
    # AITER pair runs as `difftest bump aiter BUGGY FIXED`
    groups: dict[tuple[str, str, str], list[tuple[HistoricalBug | None, str]]] = {}
    bumps: dict[tuple[str, str], list[tuple[HistoricalBug | None, str]]] = {}
    for target, name, *names in pairs:
        if "[aiter=" in names[0] and "[aiter=" in names[1]:
            bumps.setdefault((names[0], names[1]), []).append((target, name))
        else:
            groups.setdefault((names[0], names[1], names[2]), []).append((target, name))
    bumped: list[PairOutcome] = []
    verdicts = []
    for (buggy_name, fixed_name), members in bumps.items():
        try:
            fetch_missing_aiter([release_parts(n)[1] for n in (buggy_name, fixed_name)])
            order = run_cases(_backend(buggy_name), device, args.examples, args.seed)
            found, verdict = bump_pair(members, buggy_name, fixed_name, order, args,
                                       device_type)
        except (AiterFetchError, RuntimeError) as exc:
            print(f"history: {exc}", file=sys.stderr)
            return 2
        bumped += found
        verdicts.append(f"difftest bump aiter {release_parts(buggy_name)[1]} "
                        f"{release_parts(fixed_name)[1]}: {verdict}")
    outcomes: list[tuple[int, PairOutcome]] = []
    hunts, agrees, draw_seconds = [], [], 0.0
    for group, ((buggy_name, fixed_name, control_name), members) in enumerate(groups.items()):
        control = _backend(control_name).name if control_name else ""
        drawn_at = time.perf_counter()
        buggy = _backend(buggy_name)
        ran = run_cases(buggy, device, args.examples, args.seed)
        sparse, dense = [c for c in ran if not c.dense], [c for c in ran if c.dense]
        draw_seconds += time.perf_counter() - drawn_at
        names = (buggy_name, fixed_name, control) if control else (buggy_name, fixed_name)
        outcomes += [(group, PairOutcome(name, buggy_name, fixed_name, control,
                                         cases_hash=ids_hash(sparse + dense),
                                         sparse=len(sparse), dense=len(dense)))
                     for _, name in members]
        dicts = [c.to_dict() for c in sparse + dense]
        hunts.append((hunt_unit, ([t.name if t else None for t, _ in members], names, dicts,
                                  len(sparse), args.seed, args.shrink_runs,
                                  args.shrink_seconds)))
        agrees.append([(agree_unit, (names[1:], part))
                       for part in chunks(list(enumerate(dicts, 1)), args.chunk)])
    releases = list(dict.fromkeys(n for _, o in outcomes for n in (o.buggy, o.fixed, o.control)
                                  if n))
    swept_cases = generated_cases(args.sweep, args.seed, Capabilities.probe(
        [_backend(n) for n in releases], device).strategy) if args.sweep else []
    sweep_units = [(agree_unit, (releases, part)) for part in
                   chunks(list(enumerate((c.to_dict() for c in swept_cases), 1)), args.chunk)]
    prepared = time.perf_counter() - start
    # the hunts first (their shrinking is the longest unit), then the groups' chunks in turn
    order = [(i, None) for i in range(len(hunts))] + [
        (i, j) for j in range(max(map(len, agrees), default=0))
        for i in range(len(agrees)) if j < len(agrees[i])]
    units = [hunts[i] if j is None else agrees[i][j] for i, j in order]
    results, worker_starts = run_units(units + sweep_units, args.workers, device_type)
    by_unit = dict(zip(order, results, strict=False))
    for group, o in outcomes:
        hunt = by_unit[(group, None)]
        parts = [by_unit[(group, j)] for j in range(len(agrees[group]))]
        entry = hunt["targets"].get(o.name if o.name in hunt["targets"] else "None", {})
        o.versions, o.ran = hunt["versions"], hunt["ran"]
        for key, value in entry.items():
            if key != "failures":
                setattr(o, key, value)
        o.failures = (hunt["failures"] + entry.get("failures", [])
                      + [f for p in parts for f in p["failures"]])
        o.same_case_statuses = _merge_counts(parts)
        o.profile = dict(sum((Counter(r["profile"]) for r in [hunt, *parts]), Counter()))
        o.profile["hunt wall"] = hunt["profile"]["wall"]
    outcomes_only = [o for _, o in outcomes] + bumped
    sweep_results = results[len(units):]
    swept = _merge_counts(sweep_results)
    sweep_failures = [f for r in sweep_results for f in r["failures"]]
    total = time.perf_counter() - start
    print(summary(outcomes_only, swept, sweep_failures, len(swept_cases)))
    for verdict in verdicts:
        print(verdict)
    print(f"\ndrawing {draw_seconds:.1f} s and set-up {prepared - draw_seconds:.1f} s in the "
          f"main process; {len(units) + len(sweep_units)} units on {max(1, args.workers)} "
          f"worker(s)" + (f", worker start-up {', '.join(f'{s:.1f}' for s in worker_starts)} s"
                          if worker_starts else ""))
    print(f"total {total:.1f} s on {device.type}"
          f"{' (Triton interpreted)' if devices.interpreted() else ''}")
    if args.json:
        write_json(args.json, {"device": device.type, "interpreted": devices.interpreted(),
                               "strategy": "default (Capabilities.probe([buggy]): strategy(), "
                               "then dense_strategy())",
                               "seed": args.seed, "examples": args.examples,
                               "shrink_runs": args.shrink_runs,
                               "shrink_seconds": args.shrink_seconds,
                               "workers": args.workers, "chunk": args.chunk,
                               "seconds": {"total": total, "drawing": draw_seconds,
                                           "set_up": prepared - draw_seconds,
                                           "worker_start": worker_starts},
                               "outcomes": [asdict(o) for o in outcomes_only],
                               "sweep": {"cases": len(swept_cases), "statuses": swept,
                                         "failures": [asdict(f) for f in sweep_failures]}})
    missed = [o for o in outcomes_only if not o.found]
    unexplained = [f for o in outcomes_only for f in o.unexplained]
    unexplained += [f for f in sweep_failures if not f.known_bugs]
    return 1 if missed or unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
