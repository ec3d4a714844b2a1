"""Historical-bug benchmark: do the strategies find bugs that shipped in vLLM, and only those?

    python -m benchmarks.history                      # the seeded bugs (CPU: a few minutes)
    python -m benchmarks.history --json out.json
    python -m benchmarks.history --pair 'triton-unified[vllm=0.30.0]' 'triton-unified[vllm=0.31.0]'

Each pair is a release with a known bug and the release that fixed it, as backend names
(``triton-unified[vllm=<version>]``: :mod:`difftest.backends.vllm_release` resolves versions
under ``$DIFFTEST_VLLM_ROOT``; fetch them with ``scripts/fetch_vllm.sh VERSION``). Per pair a
derandomized Hypothesis run of the strategies with the kernel modes drawn
(:func:`difftest.cases.strategies.cases` with :func:`difftest.cases.modes.with_kernel_modes`
in every case; ``--strategy default`` draws them as ``difftest run`` does, one case in eight)
runs every example on the buggy release, the fixed release and the venv's vLLM (the
control), against ``torch-ref``, until the buggy release first disagrees (or errors). Then
Hypothesis shrinks that case on the buggy release alone within a budget of kernel runs;
past it, new candidates pass without running, so the shrink ends with the smallest failing
case found. Reported per pair: the examples and seconds to the first disagreement, the
shrunk case, and every disagreement of the fixed release or the control on the same
examples and on the shrunk case. A failure there that a known bug of that release
explains (the fixed release of one bug may still carry another: 0.14.0 has 0.30.0's softcap
NaN) is listed as explained, with the bug's name; any other is a false positive, and there
must be none.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st

from difftest import devices
from difftest.backend import Backend, RunInputs
from difftest.case import Case
from difftest.jsonfile import write_json
from difftest.runner import FAILING, Status, run_case

CONTROL = "triton-unified"  # the venv's vLLM (0.33.0)


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
    """A bug vLLM shipped in ``unified_attention``: the last release with it, the first
    without, and the case fields it needs (a failure elsewhere is not this bug)."""

    name: str
    buggy: str
    fixed: str
    cause: str
    needs: Callable[[Case], bool]

    def explains(self, version: str, case: Case) -> bool:
        """Whether a failure of vLLM ``version`` on ``case`` may be this bug."""
        return release_tuple(version) < release_tuple(self.fixed) and self.needs(case)


def max_abs_logit(case: Case) -> float:
    """The largest ``|softmax_scale * q.k|`` over every query row and every token of the blocks
    some row attends (a superset of what each row attends)."""
    data = RunInputs(case, torch.device("cpu")).data
    if not data.physical_blocks:
        return 0.0
    keys = data.k_stored.to(torch.float64).flatten(0, 2) * case.k_scale  # [tokens, D]
    query = data.query.to(torch.float64).flatten(0, 1)  # [rows * heads, D]
    return float((query @ keys.T).abs().max()) * case.softmax_scale


EXP_OVERFLOW = 88.0  # float32 exp(y) is inf past y = 88.7


KNOWN_BUGS = (
    HistoricalBug("softcap-nan", "0.30.0", "0.31.0",
                  "apply_softcap computes tanh(y) as (e^y - e^-y) / (e^y + e^-y): inf / inf "
                  "= NaN once |y| = |s / softcap| passes ~88; 0.31.0 computes "
                  "1 - 2 / (e^2y + 1)",
                  lambda case: case.softcap > 0
                  and max_abs_logit(case) > 0.9 * EXP_OVERFLOW * case.softcap),
    HistoricalBug("sliding-window-nan", "0.13.0", "0.14.0",
                  "logits outside the window are masked, but the loaded V tile is multiplied "
                  "by P = 0: a NaN slot before the window in the first tile poisons the row; "
                  "0.14.0 zeroes V outside the window",
                  lambda case: case.sliding_window > 0 and case.canary),
)


@dataclass
class Failure:
    """A backend failing one case, and the known bugs of its release that may explain it."""

    case: str
    backend: str
    status: str
    detail: str
    known_bugs: list[str]


@dataclass
class PairOutcome:
    """What the hunt of one (buggy, fixed) pair found."""

    name: str
    buggy: str
    fixed: str
    control: str
    versions: dict[str, str] = field(default_factory=dict)
    found: bool = False
    status: str = ""
    examples: int = 0  # examples the buggy release ran up to and including the first failure
    seconds: float = 0.0
    first_case: dict[str, Any] | None = None
    shrunk_case: dict[str, Any] | None = None
    shrunk_detail: str = ""
    shrink_runs: int = 0
    shrunk_statuses: dict[str, str] = field(default_factory=dict)
    same_case_statuses: dict[str, dict[str, int]] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)  # every other failure seen

    @property
    def unexplained(self) -> list[Failure]:
        """Failures no known bug of the failing release explains (false positives, or a bug
        not in :data:`KNOWN_BUGS`)."""
        return [f for f in self.failures if not f.known_bugs]


class _Disagreement(Exception):
    """Raised inside the Hypothesis run when the buggy release fails; carries the case."""

    def __init__(self, case: Case) -> None:
        super().__init__(f"disagreement on case {case.case_id}")
        self.case = case


STRATEGIES = ("modes", "default")


def strategy_named(name: str) -> st.SearchStrategy[Case]:
    """``modes``: the strategies with the kernel modes drawn in every case (each mode on in
    half of them); ``default``: the strategies exactly as ``difftest run`` draws them (modes
    in one case in eight). Both in the interpreter's reach: no bf16, small batches and top-k."""
    from difftest.cases.modes import with_kernel_modes
    from difftest.cases.strategies import cases

    small = {"query_dtypes": ("float16", "float32"), "max_batch": 2, "max_topk": 4}
    if name == "default":
        return cases(**small)
    return cases(**small, kernel_modes=False).flatmap(with_kernel_modes)


def known_bugs(version: str, case: Case) -> list[str]:
    """The known bugs of vLLM ``version`` that a failure on ``case`` may be."""
    return [b.name for b in KNOWN_BUGS if b.explains(version, case)]


def _failure(case: Case, result: Any, version: str) -> Failure:
    c = result.comparison
    if c is not None:
        detail = (f"{c.mismatched}/{c.checked} elements mismatched, {c.nonfinite} non-finite, "
                  f"max error/tolerance {c.max_ratio:.3g}")
    else:
        detail = (result.detail or "").strip().splitlines()[-1] if result.detail else ""
    return Failure(case.case_id, result.backend, result.status.value, detail,
                   known_bugs(version, case))


def hunt(target: HistoricalBug | None, name: str, backends: tuple[Backend, Backend, Backend],
         reference: Backend, strategy: st.SearchStrategy[Case], device: torch.device,
         examples: int, shrink_runs: int) -> PairOutcome:
    """One pair: the first failure of the buggy release that is ``target`` (any failure when
    ``target`` is ``None``), its shrunk case, and every other failure on the same examples.

    A failure is ``target`` when the case has what the bug needs and no other known bug of
    the release could explain it, so one release's two bugs are never confused.
    """
    buggy, fixed, control = backends
    outcome = PairOutcome(name, buggy.name, fixed.name, control.name,
                          versions={b.name: b.versions().get("vllm", "?") for b in backends})
    counts: dict[str, Counter[str]] = {fixed.name: Counter(), control.name: Counter()}
    failing: set[str] = set()
    start = time.perf_counter()

    def record(case: Case, result: Any) -> None:
        failure = _failure(case, result, outcome.versions[result.backend])
        if failure not in outcome.failures:  # Hypothesis replays a failing example
            outcome.failures.append(failure)

    def is_target(case: Case) -> bool:
        if target is None:
            return True
        return known_bugs(outcome.versions[buggy.name], case) == [target.name]

    def judge(case: Case) -> bool:
        if outcome.found:  # shrinking: the buggy release alone, within the budget
            if outcome.shrink_runs >= shrink_runs or not is_target(case):
                return False
            outcome.shrink_runs += 1
            return run_case(case, reference, [buggy], device).results[0].status in FAILING
        result = run_case(case, reference, list(backends), device)
        bug, *others = result.results
        for r in others:
            counts[r.backend][r.status.value] += 1
        for r in result.results:
            if r.status in FAILING and not (r is bug and is_target(case)):
                record(case, r)
        if bug.status in (Status.UNSUPPORTED, Status.UNAVAILABLE):
            return False
        outcome.examples += 1
        if bug.status not in FAILING or not is_target(case):
            return False
        outcome.found, outcome.status = True, bug.status.value
        outcome.seconds = time.perf_counter() - start
        outcome.first_case = case.to_dict()
        return True

    @settings(max_examples=examples, database=None, deadline=None, derandomize=True,
              phases=(Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck),
              report_multiple_bugs=False, print_blob=False, verbosity=Verbosity.quiet)
    @given(strategy)
    def probe(case: Case) -> None:
        if case.case_id in failing or judge(case):
            failing.add(case.case_id)  # one raise site: Hypothesis tells bugs apart by it
            raise _Disagreement(case)

    try:
        probe()
    except _Disagreement as found:
        shrunk = found.case
        outcome.shrunk_case = shrunk.to_dict()
        final = run_case(shrunk, reference, list(backends), device)
        outcome.shrunk_statuses = {r.backend: r.status.value for r in final.results}
        outcome.shrunk_detail = _failure(shrunk, final.results[0], "").detail
        for r in final.results[1:]:
            if r.status in FAILING:
                record(shrunk, r)
    if not outcome.found:
        outcome.seconds = time.perf_counter() - start
    outcome.same_case_statuses = {k: dict(v) for k, v in counts.items()}
    return outcome


def sweep(cases: list[Case], backends: list[Backend], reference: Backend,
          device: torch.device) -> tuple[dict[str, dict[str, int]], list[Failure]]:
    """Every backend on the same derandomized cases: status counts and failures."""
    versions = {b.name: b.versions().get("vllm", "?") for b in backends}
    counts: dict[str, Counter[str]] = {b.name: Counter() for b in backends}
    failures = []
    for case in cases:
        for r in run_case(case, reference, backends, device).results:
            counts[r.backend][r.status.value] += 1
            if r.status in FAILING:
                failures.append(_failure(case, r, versions[r.backend]))
    return {k: dict(v) for k, v in counts.items()}, failures


def describe(case: dict[str, Any] | None) -> str:
    """The fields of a case that say what it exercises, on one line."""
    if case is None:
        return "-"
    keys = ("seq_lens", "selections", "num_blocks", "num_q_heads", "decode_query_len",
            "query_dtype", "kv_dtype", "kv_layout", "softmax_scale", "distribution", "seed",
            "softcap", "sliding_window", "canary")
    return ", ".join(f"{k}={case[k]}" for k in keys if k in case)


def _failure_lines(failures: list[Failure]) -> list[str]:
    return [f"    {f.backend} {f.status} on {f.case}: {f.detail}"
            + (f" (known bug of that release: {', '.join(f.known_bugs)})" if f.known_bugs
               else " (UNEXPLAINED: no known bug of that release)") for f in failures]


def summary(outcomes: list[PairOutcome], swept: dict[str, dict[str, int]],
            sweep_failures: list[Failure], sweep_size: int) -> str:
    """The terminal report: the table, the shrunk cases, the sweep."""
    lines = [f"{'bug':20} {'buggy':28} {'found':5} {'examples':>8} {'seconds':>7}  "
             "fixed / control on the same examples"]
    for o in outcomes:
        same = "; ".join(f"{name} {c}" for name, c in o.same_case_statuses.items())
        lines.append(f"{o.name:20} {o.buggy:28} {('yes' if o.found else 'NO'):5} "
                     f"{o.examples:>8} {o.seconds:>7.1f}  {same}")
    for o in outcomes:
        lines.append(f"\n{o.name}: {o.buggy} (vLLM {o.versions[o.buggy]}); fixed {o.fixed} "
                     f"(vLLM {o.versions[o.fixed]}); control {o.control} "
                     f"(vLLM {o.versions[o.control]})")
        if o.found:
            lines.append(f"  first failure: example {o.examples}, {o.seconds:.1f} s, {o.status}")
            shrunk_id = o.shrunk_case["id"] if o.shrunk_case else "-"
            lines.append(f"  shrunk in {o.shrink_runs} runs to {shrunk_id}: "
                         f"{describe(o.shrunk_case)}")
            lines.append(f"  on the shrunk case: {o.shrunk_statuses}; {o.buggy}: "
                         f"{o.shrunk_detail}")
        lines.append(f"  other failures on the same examples: {len(o.failures)}")
        lines.extend(_failure_lines(o.failures))
    if sweep_size:
        lines.append(f"\nsweep: the first {sweep_size} derandomized cases of the same strategy "
                     "on every release")
        lines.extend(f"  {name:28} {counts}" for name, counts in swept.items())
        lines.extend(_failure_lines(sweep_failures))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the pairs and the sweep; exit 1 when a bug is missed or a failure is unexplained."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", action="append", nargs=2, default=[],
                        metavar=("BUGGY", "FIXED"),
                        help="a buggy and a fixed backend name (default: the known bugs)")
    parser.add_argument("--control", default=CONTROL)
    parser.add_argument("--examples", type=int, default=50)
    parser.add_argument("--shrink-runs", type=int, default=60)
    parser.add_argument("--sweep", type=int, default=50,
                        help="cases of the every-release sweep (0: none)")
    parser.add_argument("--strategy", choices=STRATEGIES, default="modes",
                        help="modes: kernel modes in every case; default: as difftest run "
                        "draws them")
    parser.add_argument("--json", help="write the outcomes here")
    args = parser.parse_args(argv)
    devices.prepare_runtime("cpu" if devices.visible_gpu_count() == 0 else "cuda")
    device = torch.device("cpu" if devices.interpreted() else "cuda")
    from difftest.backends.torch_ref import TorchReference
    from difftest.backends.triton_unified import TritonUnifiedAttention
    from difftest.backends.vllm_triton_sparse import VllmTritonSparse
    from difftest.cases.generate import generated_cases

    from difftest.registry import select

    pairs: list[tuple[HistoricalBug | None, str, str, str]] = [
        (None, buggy, buggy, fixed) for buggy, fixed in args.pair] or [
        (b, b.name, f"triton-unified[vllm={b.buggy}]", f"triton-unified[vllm={b.fixed}]")
        for b in KNOWN_BUGS]
    # The backends that take vllm=, built directly: no unrelated plug-in can break the run.
    known = {b.name: b for b in (TorchReference(), TritonUnifiedAttention(), VllmTritonSparse())}
    reference = select(known, ["torch-ref"])[0]
    control = select(known, [args.control])[0]
    strategy = strategy_named(args.strategy)
    outcomes = []
    start = time.perf_counter()
    for target, name, buggy_name, fixed_name in pairs:
        buggy, fixed = select(known, [buggy_name, fixed_name])
        outcomes.append(hunt(target, name, (buggy, fixed, control), reference, strategy,
                             device, args.examples, args.shrink_runs))
    releases = list(dict.fromkeys(n for o in outcomes for n in (o.buggy, o.fixed)))
    swept_cases = generated_cases(args.sweep, 0, strategy) if args.sweep else []
    swept, sweep_failures = sweep(swept_cases, select(known, [*releases, control.name]),
                                  reference, device)
    print(summary(outcomes, swept, sweep_failures, len(swept_cases)))
    print(f"\ntotal {time.perf_counter() - start:.1f} s on {device.type}"
          f"{' (Triton interpreted)' if devices.interpreted() else ''}")
    if args.json:
        write_json(args.json, {"device": device.type, "interpreted": devices.interpreted(),
                               "strategy": args.strategy,
                               "examples": args.examples, "shrink_runs": args.shrink_runs,
                               "outcomes": [asdict(o) for o in outcomes],
                               "sweep": {"cases": len(swept_cases), "statuses": swept,
                                         "failures": [asdict(f) for f in sweep_failures]}})
    missed = [o for o in outcomes if not o.found]
    unexplained = [f for o in outcomes for f in o.unexplained]
    unexplained += [f for f in sweep_failures if not f.known_bugs]
    return 1 if missed or unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
