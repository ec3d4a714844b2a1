"""Historical-bug benchmark: do the default strategies find bugs vLLM shipped, and only those?

    python -m benchmarks.history                      # the seeded bugs (CPU: a few minutes)
    python -m benchmarks.history --json out.json
    python -m benchmarks.history --pair 'triton-unified[vllm=0.30.0]' 'triton-unified[vllm=0.31.0]'

Each pair is a release with a known bug and the release that fixed it, as backend names
(``triton-unified[vllm=<version>]``: :mod:`difftest.backends.vllm_release` resolves versions
under ``$DIFFTEST_VLLM_ROOT``; fetch them with ``scripts/fetch_vllm.sh VERSION``). Per pair
the cases are exactly the ones ``difftest run --no-corpus --backends <buggy> --examples N
--seed S`` draws: the capability-aware default strategy
(``Capabilities.probe([buggy], device).strategy()``) through
:func:`difftest.cases.generate.generated_cases`. Every one of the N cases runs on the buggy
release, the fixed release and the venv's vLLM (the control) against ``torch-ref``; the first
failure of the buggy release that the pair's bug explains gives the example number and the
seconds to it. Then a Hypothesis search with the same seed (the same examples in the same
order, served from the results already computed) reaches that example and shrinks it on the
buggy release alone within a budget of kernel runs. Reported per pair: the first failing
example, seconds to it, the shrunk case, and every failure of the fixed release or the
control on the same N cases. A failure there that a known bug of that release explains (the
fixed release of one bug may still carry another: 0.14.0 has 0.30.0's softcap NaN) is listed
as explained, with the bug's name; any other is a false positive, and there must be none.

Cases drawn in this process may differ from a ``difftest run`` process's with the same seed
(docs/findings.md F11: Hypothesis draws constants of the imported local modules); the docs
record both.
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
from hypothesis import seed as hypothesis_seed
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
    off: dict[str, Any]  # case fields that take away what the bug needs

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
                  and max_abs_logit(case) > 0.9 * EXP_OVERFLOW * case.softcap,
                  {"softcap": 0.0}),
    HistoricalBug("sliding-window-nan", "0.13.0", "0.14.0",
                  "logits outside the window are masked, but the loaded V tile is multiplied "
                  "by P = 0: a NaN slot before the window in the first tile poisons the row; "
                  "0.14.0 zeroes V outside the window",
                  lambda case: case.sliding_window > 0 and case.canary,
                  {"canary": False}),
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
    examples: int = 0  # the first failing example's number in the case set (1-based)
    ran: int = 0  # examples the buggy release ran (not unsupported) up to that one
    seconds: float = 0.0  # from the first example to the first failure
    first_case: dict[str, Any] | None = None
    shrunk_case: dict[str, Any] | None = None
    shrunk_detail: str = ""
    shrink_runs: int = 0
    shrunk_statuses: dict[str, str] = field(default_factory=dict)
    isolated: str = ""  # how the failure was told apart from another known bug, if it was
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


def default_strategy(backend: Backend, device: torch.device) -> st.SearchStrategy[Case]:
    """The cases ``difftest run --backends <backend>`` draws: the capability-aware default
    strategy (:class:`difftest.cases.capabilities.Capabilities`)."""
    from difftest.cases.capabilities import Capabilities

    return Capabilities.probe([backend], device).strategy()


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
         examples: int, seed: int, shrink_runs: int) -> PairOutcome:
    """One pair on the ``examples`` cases ``difftest run --seed <seed>`` draws from
    ``strategy``: the first failure of the buggy release that is ``target`` (any failure
    when ``target`` is ``None``), its shrunk case, and every other failure.

    A failure is ``target`` when the case has what the bug needs and no other known bug of
    the release could explain it; when another could too, the case runs once more with the
    other bug's trigger off (:attr:`HistoricalBug.off`), and it is ``target`` if it still
    fails. So one release's two bugs are never confused.
    """
    from difftest.cases.generate import generated_cases

    buggy, fixed, control = backends
    outcome = PairOutcome(name, buggy.name, fixed.name, control.name,
                          versions={b.name: b.versions().get("vllm", "?") for b in backends})
    version = outcome.versions[buggy.name]
    counts: dict[str, Counter[str]] = {fixed.name: Counter(), control.name: Counter()}

    def record(case: Case, result: Any) -> None:
        failure = _failure(case, result, outcome.versions[result.backend])
        if failure not in outcome.failures:
            outcome.failures.append(failure)

    def fails(case: Case) -> bool:
        return run_case(case, reference, [buggy], device).results[0].status in FAILING

    def is_target(case: Case, confirm: bool) -> tuple[bool, str]:
        """Whether a failure on ``case`` is ``target``; ``confirm``: settle an ambiguous one
        by a run with the other known bugs' triggers off."""
        if target is None:
            return True, ""
        known = known_bugs(version, case)
        if known == [target.name]:
            return True, ""
        if target.name not in known or not confirm:
            return False, ""
        off = {k: v for b in KNOWN_BUGS if b.name in known and b is not target
               for k, v in b.off.items()}
        if fails(case.replace(**off)):
            return True, f"still fails with {off} ({', '.join(known)} could explain it)"
        return False, ""

    start = time.perf_counter()
    judged: dict[str, bool] = {}  # case id -> whether the buggy release fails it as target
    for number, case in enumerate(generated_cases(examples, seed, strategy), 1):
        result = run_case(case, reference, list(backends), device)
        bug, *others = result.results
        judged[case.case_id] = False
        for r in others:
            counts[r.backend][r.status.value] += 1
            if r.status in FAILING:
                record(case, r)
        if bug.status in (Status.UNSUPPORTED, Status.UNAVAILABLE):
            continue
        outcome.ran += not outcome.found
        if bug.status not in FAILING:
            continue
        hit, how = is_target(case, confirm=not outcome.found)
        judged[case.case_id] = hit
        if not hit:
            record(case, bug)
        elif not outcome.found:
            outcome.found, outcome.status = True, bug.status.value
            outcome.examples, outcome.isolated = number, how
            outcome.seconds = time.perf_counter() - start
            outcome.first_case = case.to_dict()
    if not outcome.found:
        outcome.seconds = time.perf_counter() - start
    outcome.same_case_statuses = {k: dict(v) for k, v in counts.items()}
    if outcome.found:
        _shrink(outcome, strategy, examples, seed, judged, fails, is_target, shrink_runs)
        shrunk = Case.from_dict(outcome.shrunk_case or outcome.first_case or {})
        final = run_case(shrunk, reference, list(backends), device)
        outcome.shrunk_statuses = {r.backend: r.status.value for r in final.results}
        outcome.shrunk_detail = _failure(shrunk, final.results[0], "").detail
        for r in final.results[1:]:
            if r.status in FAILING:
                record(shrunk, r)
    return outcome


def _shrink(outcome: PairOutcome, strategy: st.SearchStrategy[Case], examples: int,
            seed: int, judged: dict[str, bool], fails: Callable[[Case], bool],
            is_target: Callable[[Case, bool], tuple[bool, str]], shrink_runs: int) -> None:
    """Shrink the first target failure: a Hypothesis search with ``difftest run``'s seed and
    settings generates the same examples in the same order (judged from ``judged``, no
    kernel runs), fails on the first target failure and shrinks it on the buggy release, at
    most ``shrink_runs`` kernel runs (past them, candidates pass unrun)."""

    def judge(case: Case) -> bool:
        if case.case_id not in judged:
            run = outcome.shrink_runs < shrink_runs and is_target(case, False)[0]
            outcome.shrink_runs += run
            judged[case.case_id] = run and fails(case)
        return judged[case.case_id]

    @hypothesis_seed(seed)
    @settings(max_examples=examples, database=None, deadline=None, derandomize=False,
              phases=(Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck),
              report_multiple_bugs=False, print_blob=False, verbosity=Verbosity.quiet)
    @given(strategy)
    def probe(case: Case) -> None:
        if judge(case):
            raise _Disagreement(case)

    try:
        probe()
    except _Disagreement as found:
        outcome.shrunk_case = found.case.to_dict()


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
    lines = [f"{'bug':20} {'buggy':28} {'found':5} {'example':>7} {'seconds':>7}  "
             "fixed / control on the same cases"]
    for o in outcomes:
        same = "; ".join(f"{name} {c}" for name, c in o.same_case_statuses.items())
        lines.append(f"{o.name:20} {o.buggy:28} {('yes' if o.found else 'NO'):5} "
                     f"{o.examples if o.found else '-':>7} {o.seconds:>7.1f}  {same}")
    for o in outcomes:
        lines.append(f"\n{o.name}: {o.buggy} (vLLM {o.versions[o.buggy]}); fixed {o.fixed} "
                     f"(vLLM {o.versions[o.fixed]}); control {o.control} "
                     f"(vLLM {o.versions[o.control]})")
        if o.found:
            lines.append(f"  first failure: example {o.examples} ({o.ran} run by the buggy "
                         f"release), {o.seconds:.1f} s, {o.status}: {describe(o.first_case)}")
            if o.isolated:
                lines.append(f"  told apart from another known bug: {o.isolated}")
            shrunk_id = o.shrunk_case["id"] if o.shrunk_case else "-"
            lines.append(f"  shrunk in {o.shrink_runs} runs to {shrunk_id}: "
                         f"{describe(o.shrunk_case)}")
            lines.append(f"  on the shrunk case: {o.shrunk_statuses}; {o.buggy}: "
                         f"{o.shrunk_detail}")
        else:
            lines.append(f"  NOT FOUND in {o.ran} examples the buggy release ran")
        lines.append(f"  other failures on the same cases: {len(o.failures)}")
        lines.extend(_failure_lines(o.failures))
    if sweep_size:
        lines.append(f"\nsweep: the first {sweep_size} cases of the strategy of all releases "
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
    parser.add_argument("--examples", type=int, default=50,
                        help="cases per pair, as difftest run --examples")
    parser.add_argument("--seed", type=int, default=0, help="as difftest run --seed")
    parser.add_argument("--shrink-runs", type=int, default=60)
    parser.add_argument("--sweep", type=int, default=0,
                        help="cases of an every-release sweep of the strategy of all the "
                        "releases (0: none)")
    parser.add_argument("--json", help="write the outcomes here")
    args = parser.parse_args(argv)
    devices.prepare_runtime("cpu" if devices.visible_gpu_count() == 0 else "cuda")
    device = torch.device("cpu" if devices.interpreted() else "cuda")
    from difftest.backends.torch_ref import TorchReference
    from difftest.backends.triton_unified import TritonUnifiedAttention
    from difftest.backends.vllm_triton_sparse import VllmTritonSparse
    from difftest.cases.capabilities import Capabilities
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
    outcomes = []
    start = time.perf_counter()
    for target, name, buggy_name, fixed_name in pairs:
        buggy, fixed = select(known, [buggy_name, fixed_name])
        outcomes.append(hunt(target, name, (buggy, fixed, control), reference,
                             default_strategy(buggy, device), device, args.examples,
                             args.seed, args.shrink_runs))
    releases = select(known, [*dict.fromkeys(n for o in outcomes for n in (o.buggy, o.fixed)),
                              control.name])
    swept_cases = generated_cases(args.sweep, args.seed, Capabilities.probe(
        releases, device).strategy()) if args.sweep else []
    swept, sweep_failures = sweep(swept_cases, releases, reference, device)
    print(summary(outcomes, swept, sweep_failures, len(swept_cases)))
    print(f"\ntotal {time.perf_counter() - start:.1f} s on {device.type}"
          f"{' (Triton interpreted)' if devices.interpreted() else ''}")
    if args.json:
        write_json(args.json, {"device": device.type, "interpreted": devices.interpreted(),
                               "strategy": "default (Capabilities.probe([buggy]).strategy())",
                               "seed": args.seed, "examples": args.examples,
                               "shrink_runs": args.shrink_runs,
                               "outcomes": [asdict(o) for o in outcomes],
                               "sweep": {"cases": len(swept_cases), "statuses": swept,
                                         "failures": [asdict(f) for f in sweep_failures]}})
    missed = [o for o in outcomes if not o.found]
    unexplained = [f for o in outcomes for f in o.unexplained]
    unexplained += [f for f in sweep_failures if not f.known_bugs]
    return 1 if missed or unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
