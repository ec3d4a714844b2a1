"""The difftest command line: cross-backend differential testing of attention kernels.

backends  lists what this machine can run, and why a backend cannot
run       runs the pinned corpus plus a deterministic generated case set, ends in its verdict
repro     replays one case from a failure directory or case file, against its recording
export    writes a failure's kernel call as a script that runs without difftest
promote   pins a case into the regression corpus
merge     joins shard reports; gate compares a candidate report with a baseline
bump      runs an AITER or vLLM bump end to end: both releases, the same cases, the gate
audit     prints a report's parameter audit; plot draws a report
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from difftest.contract.registry import RegistryError, split_names
from difftest.machine import pinning
from difftest.machine.devices import DEVICE_CHOICES
from difftest.primitives.interrupts import Interrupted, catching_signals
from difftest.primitives.jsonfile import append_json_line
from difftest.primitives.text import printable
from difftest.reporting.gate import DEFAULT_MAX_RATIO_GROWTH, DEFAULT_RATIO_FLOOR
from difftest.results.artifacts import DEFAULT_ROOT, repro_command

if TYPE_CHECKING:
    from difftest.judgement.expectations import Judgement
    from difftest.results.records import CaseRecord
    from difftest.run.runner import CaseResult

EXIT_UNREADABLE = 2
EXIT_CODES = """exit status: 0 everything agreed (or the command succeeded); 1 a backend disagreed,
errored or crashed, or the gate failed; 2 the command could not run (bad arguments,
unknown backend, unreadable file), the message names what was wrong"""
BACKEND_SYNTAX = """backend names: comma-separated, as `difftest backends` lists them; a
backend that takes options is configured in its name, name@variant[key=value,...], e.g.
aiter-gluon@emulated[k_trim=off,revision=v0.1.20] (commas inside [...] stay with it)"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Help as written (line breaks kept), each option's default shown where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default == [] or default == argparse.SUPPRESS \
                or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def _count(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (allowed: an integer "
                                         ">= 0)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative (allowed: an integer >= 0)")
    return value


def _at_least(low: float) -> Callable[[str], float]:
    """argparse type: a finite number >= ``low``."""
    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= low):
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed (allowed: a finite "
                                             f"number >= {low:g})")
        return value
    return number


def _no_file_above(text: str) -> str:
    """``text``, refused where one of its parents is a file."""
    for parent in Path(text).parents:
        if parent.exists() and not parent.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r}: {parent} is a file, not a directory")
    return text


def _output_file(text: str) -> str:
    """argparse type: a file path that can be written (not a directory, nor under a file)."""
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory (allowed: a file path)")
    return _no_file_above(text)


def _directory(text: str) -> str:
    """argparse type: a directory path (existing or not), not a file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file (allowed: a directory)")
    return _no_file_above(text)


def _report_file(text: str) -> str:
    """argparse type: a report whose every case can be read (:mod:`difftest.run.recorded`)."""
    from difftest.reporting.report import ReportError
    from difftest.run.recorded import recorded_runs

    try:
        recorded_runs(text, ())
    except ReportError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _case_ids(text: str) -> list[str]:
    """argparse type: comma-separated case ids (16 hexadecimal digits each)."""
    ids = [part.strip() for part in text.split(",") if part.strip()]
    bad = [i for i in ids if not re.fullmatch(r"[0-9a-f]{16}", i)]
    if not ids or bad:
        raise argparse.ArgumentTypeError(
            f"{(bad or [text])[0]!r} is not a case id (allowed: 16 hexadecimal digits, "
            "comma-separated)")
    return ids


def _jobs(text: str) -> int:
    """argparse type: an integer >= 1, or ``auto`` (0: decided by :func:`_job_count`)."""
    if text == "auto":
        return 0
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed (allowed: an integer >= 1, "
                                         "or auto)")
    return int(text)


def _job_count(jobs: int, device: str) -> int:
    """``--jobs`` for the ``--device`` choice: ``auto`` is one job per core, at most 8 per
    visible GPU (unless ``--device cpu``; each pinned to one GPU, round-robin:
    :func:`difftest.run.jobs.job_environments`) or 8 on the CPU, at least one per GPU
    (:func:`difftest.run.jobs.auto_jobs`)."""
    from difftest.run.jobs import auto_jobs, visible_gpus

    if jobs:
        return jobs
    return auto_jobs(0 if device == "cpu" else visible_gpus())


def _backend_names(text: str) -> list[str]:
    """argparse type: ``a,b[k=v,k2=v2],c`` as names (see
    :func:`difftest.contract.registry.split_names`)."""
    try:
        names = split_names(text)
    except RegistryError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no backend (allowed: comma-separated "
                                         "backend names)")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{text!r} names {twice[0]!r} twice")
    return names


class UsageError(ValueError):
    """The command line asks for something this machine cannot do; the message says what."""


def _device(choice: str) -> str:
    """``--device`` as given, refused when it is ``cuda`` and no GPU is visible."""
    from difftest.machine import devices, gpus

    if choice == "cuda" and devices.visible_gpu_count() == 0:
        where = ", ".join(f"{k}={v!r}" for k, v in gpus.runner_mask().items())
        raise UsageError(f"--device cuda, but no GPU is visible "
                         f"({devices.physical_gpu_count()} found by the drivers; "
                         f"{where or 'no visibility variable set'})")
    return choice


def _add_session_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE:ATTR|FILE.py",
                        help="load extra backends (repeatable)")
    parser.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                        help="where kernels run (auto: a GPU if one is visible)")
    parser.add_argument("--reference", default="torch-ref",
                        help="the backend every other one is compared with")
    parser.add_argument("--artifacts", default=DEFAULT_ROOT, type=_directory,
                        help="directory for pending cases and failure artifacts")


class Progress:
    """Progress on stderr, each line naming every backend's status on the case just run: one
    line rewritten in place on a terminal; elsewhere (CI logs) a line every tenth of the
    cases and one above each failure printed in full, so a log stays short."""

    def __init__(self, total: int) -> None:
        self.total = total  # the run's cases (all jobs')
        self.done = 0
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()
        # every tenth of the run's cases: the jobs of --jobs, each counting its own, print
        # about ten lines together
        self.every = max(1, math.ceil(total / 10))

    def step(self, result: CaseResult, shown: bool = False) -> None:
        """Advance by one case; ``shown``: its failure is printed below this line (so this
        line is printed too)."""
        self.done += 1
        rate = self.done / max(time.perf_counter() - self.start, 1e-9)
        by_status: dict[str, list[str]] = {}
        for r in result.results:
            by_status.setdefault(r.status.value, []).append(r.backend)
        statuses = "; ".join(f"{status} {', '.join(names)}" for status, names in by_status.items())
        case = result.case
        name = f" {printable(case.name)}" if case.name else ""
        line = (f"{self.done}/{self.total} {rate:.2f} cases/s  {case.case_id}{name}: "
                f"{printable(statuses)}")
        if self.tty:
            sys.stderr.write("\r\033[K" + line[:shutil.get_terminal_size().columns - 1])
            if self.done == self.total or shown:
                sys.stderr.write("\n")
        elif shown or self.done % self.every == 0 or self.done == self.total:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


UNFIT = re.compile(r"could not fit for (?P<backend>\S+): (?P<count>\d+) example\(s\) ")
FULL_FAILURES = 3  # failing cases whose message is printed in full as they happen (all jobs)


def _new_failures(result: CaseResult, record: CaseRecord) -> list[str]:
    """The failure messages of ``result``'s new failures (those no known bug explains wholly,
    :attr:`~difftest.results.records.ResultRecord.is_new_failure`), one per backend: known
    bugs are named in the closing summary."""
    from difftest.results.records import FAILING

    new = {r.backend for r in record.new_failures}
    failing = [r for r in record.results if r.status in FAILING]
    return [message for r, message in zip(failing, result.failure_messages(), strict=True)
            if r.backend in new]


def _print_failure(messages: list[str], artifact: str | None, plugins: tuple[str, ...],
                   shown: int, limit: int) -> int:
    """Print a failing case's new failures (diagnosis included) and its replay command; after
    ``limit`` cases only the progress line and the summary name them. Returns the count of
    cases printed in full."""
    if shown >= limit:
        return shown
    for message in messages:
        print(message, file=sys.stderr)
    if artifact:
        print(f"  replay: {repro_command(artifact, plugins)}", file=sys.stderr)
    if shown + 1 == limit:
        print("(further failures: one line each in the summary; each one's message and replay "
              "command in its failure directory and the report)", file=sys.stderr)
    return shown + 1


def cmd_backends(args: argparse.Namespace) -> int:
    """List backends with availability, reasons and versions."""
    from difftest.contract import registry
    from difftest.machine import devices
    from difftest.reporting.report import backend_entry

    devices.prepare_runtime(devices.resolve(_device(args.device)))
    for name, backend in sorted(registry.discover(args.plugin).items()):
        entry = backend_entry(backend)
        state = "available" if entry["available"] else "unavailable"
        versions = ", ".join(f"{k} {v}" for k, v in entry["versions"].items())
        print(f"{name:<24} {state:<12} {entry['reason'] or versions}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run the corpus plus generated cases; exit 1 on any disagreement, error or crash."""
    from difftest.backends.vllm_release import ReleaseError, fetch_missing, release_specs
    from difftest.generation.capabilities import Capabilities
    from difftest.generation.corpus import load_corpus
    from difftest.machine import devices
    from difftest.reporting.report import case_records, unavailable_asked, write_report
    from difftest.results.reach import LineTrace
    from difftest.run.plan import RunPlan, execute, session_report
    from difftest.run.recorded import recorded_runs
    from difftest.run.replay import report_previous_crashes
    from difftest.run.session import Session
    from difftest.run.shard import Shard, ShardError

    try:
        shard = Shard.parse(args.shard, "--shard") if args.shard else None
        job = Shard.parse(args.job, "--job") if args.job else None
        if args.case_ids:  # every id named must be a case of the report
            if not args.cases_from:
                raise ValueError("--case-ids: allowed with --cases-from only (ids of that "
                                 "report's cases)")
            recorded_runs(args.cases_from, (), args.case_ids)
    except (ShardError, ValueError) as exc:
        print(f"difftest run: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    if job is None:
        try:  # the releases named by vllm= options or $DIFFTEST_VLLM, fetched once
            fetch_missing(release_specs(args.backends or []))
        except ReleaseError as exc:
            print(f"difftest run: {exc}", file=sys.stderr)
            return EXIT_UNREADABLE
        _check_writable(args)
        args.jobs = _job_count(args.jobs, args.device)
        if args.jobs > 1:
            return _run_jobs(args)
    else:
        from difftest.run.jobs import end_with_parent

        end_with_parent()
    trace = LineTrace().start() if args.reach else None
    session = Session.create(args.backends, args.plugin, _device(args.device),
                             args.artifacts, args.reference)
    # the parent of --jobs turns earlier runs' pending cases into crashes, not each job
    earlier = [] if job else report_previous_crashes(args.artifacts, "difftest run")
    if args.cases_from:  # an earlier report's cases replace the corpus and generated ones
        args.no_corpus, args.examples = True, 0
    capabilities = Capabilities.probe(session.backends, session.device)
    if args.cases_from:
        plan = RunPlan.build(capabilities, [], [], shard, recorded_runs(
            args.cases_from, [b.name for b in session.backends], args.case_ids))
    else:
        plan = RunPlan.drawn(capabilities, [] if args.no_corpus else load_corpus(),
                             args.examples, args.seed, shard)
    progress = Progress(len(plan.runs))
    shown, limit = 0, max(1, FULL_FAILURES // job.count) if job else FULL_FAILURES
    # a job of --jobs keeps each record on disk as it ends: one killed loses none
    finished = Path(f"{args.report}.records") if job and args.report else None
    interrupted: Interrupted | None = None
    try:
        for result in execute(session, plan, Path(args.claims) if job else None,
                              job.count if job else 1):
            record = session.records[-1]
            new = _new_failures(result, record) if result.failed else []
            progress.step(result, bool(new) and shown < limit)
            if finished is not None:
                append_json_line(finished, record.to_dict())
            if new:
                shown = _print_failure(new, result.artifact, session.plugins, shown, limit)
    except Interrupted as exc:
        interrupted = exc
    config = {"runner": "difftest run", "examples": args.examples, "seed": args.seed,
              "corpus": not args.no_corpus, "shard": str(shard) if shard else None,
              "cases_from": args.cases_from,
              "generation": list(plan.generation), "case_set": plan.counts()}
    if trace is not None:
        config["reach"] = trace.stop(kernel_bodies=devices.interpreted())
    if interrupted is not None:  # the case in flight neither finished nor crashed
        config["interrupted"] = {"signal": interrupted.name, "in_flight": [
            {"case_id": case_id, "running": running}
            for case_id, running in session.store.abandon()]}
    report = session_report(session, config, earlier)
    session.close()
    document = report.to_dict()
    if args.report:
        write_report(args.report, document)
    if job is None:
        missing = unavailable_asked(document["backends"], args.backends, args.optional,
                                    case_records(document), args.reference)
        _write_junit(args.junit, document, missing)
    if interrupted is not None:
        if job is None:
            print(f"difftest run: interrupted by {interrupted.name}: "
                  f"{len(document['cases'])} finished case(s) in a partial report "
                  f"({args.report or 'not written: no --report'}); the case in flight is "
                  "recorded as interrupted, not as a crash", file=sys.stderr)
        return interrupted.exit_status
    if job is not None:
        return 1 if report.failed else 0
    judgement = _print_closing(document, args.report, args.audit, missing)
    return 1 if report.earlier_crashes or missing or judgement.failed else 0


def _write_junit(path: str | None, report: dict[str, Any], missing: Sequence[str] = ()
                 ) -> None:
    """Write ``report`` as JUnit XML to ``path`` (``--junit``), when given."""
    if path:
        from difftest.reporting.junit import write_junit

        write_junit(path, report, missing)


def _check_writable(args: argparse.Namespace) -> None:
    """Refuse a report or artifacts location that cannot be written, before the first case
    (``OSError`` naming the path: exit 2)."""
    from difftest.primitives.jsonfile import check_writable

    for path in (args.report, args.junit):
        if path:
            check_writable(path)
    check_writable(args.artifacts, directory=True)

def _print_closing(report: dict[str, Any], path: str | None, full_audit: bool,
                   missing: Sequence[str] = ()) -> Judgement:
    """What a run prints at its end: the case set, generation's notes, the audit's blind
    spots (all of it with ``--audit``), why backends were unavailable, the summary, the known
    bugs met (:mod:`difftest.judgement.expectations`), the asked-for backends that could not run
    (``missing``), and the verdict line last; returns the run's failures sorted by the
    expectations."""
    from difftest.judgement.audit import audit_lines
    from difftest.judgement.expectations import judge
    from difftest.judgement.expectations import load as load_expectations
    from difftest.machine.kernel_compiles import describe, kernel_cache_dir
    from difftest.reporting.report import (
        blind_spot_lines,
        case_records,
        summary,
        unavailable_lines,
        verdict_line,
    )
    from difftest.results.features import coverage_table
    from difftest.run.plan import case_set_line

    config = report["config"]
    unavailable = {b for b, e in report["backends"].items() if not e["available"]}
    print()
    if config.get("case_set"):
        print(case_set_line(config["case_set"], config.get("shard"), len(report["cases"])))
    generation = [line for line in config.get("generation", [])  # unavailable: said once
                  if not any(line.startswith(f"not drawn for {b}: ") for b in unavailable)]
    if full_audit:
        print("\n".join(f"generation: {line}" for line in generation))
        print("\n".join(audit_lines(report["cases"], config.get("backends", []))))
        print(coverage_table(case_records(report)))
    else:
        audit = f"difftest audit {path}" if path else "--audit"
        fitted = [line for line in generation if line.startswith("fitted for ")]
        if fitted:
            print(f"generation: {len(fitted)} kinds of fitted variants (what changed for which "
                  f"backend and why: {audit})")
        unfit: dict[str, int] = {}  # backend -> examples no variant fits, one line each
        for line in generation:
            if match := UNFIT.match(line):
                unfit[match["backend"]] = unfit.get(match["backend"], 0) + int(match["count"])
        print("\n".join(f"generation: could not fit for {backend}: {count} example(s) "
                        f"reported unsupported (each reason: {audit})"
                        for backend, count in unfit.items()))
        print("\n".join(f"generation: {line}" for line in generation
                        if not line.startswith("fitted for ") and not UNFIT.match(line)))
        print("\n".join(blind_spot_lines(config.get("audit"), path)))
    if config.get("kernel_compiles") is not None:
        print(describe(config["kernel_compiles"], kernel_cache_dir()))
    print("\n".join(unavailable_lines(report)))
    judgement = judge(case_records(report), load_expectations())
    print(summary(report, unavailable=False, coverage=False, max_failures=10))
    for line in judgement.lines():
        print(line)
    for line in missing:
        print(f"FAILED: {line}")
    print(verdict_line(report, path, judgement, missing))
    return judgement



def _run_jobs(args: argparse.Namespace) -> int:
    """``difftest run --jobs N``: N processes, one report (:mod:`difftest.run.jobs`)."""
    from difftest.machine.bytecode import uncompiled_note
    from difftest.machine.fingerprint import fingerprint
    from difftest.reporting.report import Report, case_records, unavailable_asked, write_report
    from difftest.run.jobs import job_environments, run_jobs
    from difftest.run.replay import report_previous_crashes

    gpu_envs = job_environments(args.jobs, args.device)
    earlier = report_previous_crashes(args.artifacts, "difftest run")
    options = [f"--device={args.device}", f"--reference={args.reference}",
               f"--artifacts={args.artifacts}", f"--examples={args.examples}",
               f"--seed={args.seed}", *(f"--plugin={p}" for p in args.plugin)]
    options += [f"--backends={','.join(args.backends)}"] if args.backends else []
    options += ["--no-corpus"] if args.no_corpus else []
    options += [f"--cases-from={args.cases_from}"] if args.cases_from else []
    options += [f"--case-ids={','.join(args.case_ids)}"] if args.case_ids else []
    options += ["--reach"] if args.reach else []
    options += [f"--shard={args.shard}"] if args.shard else []
    for k, env in enumerate(gpu_envs, 1):
        if env:
            print(f"job {k}/{args.jobs}: {pinning.describe(env)}", file=sys.stderr)
    if note := uncompiled_note(args.jobs):
        print(note, file=sys.stderr)
    outcome = run_jobs(options, args.jobs, args.artifacts, gpu_envs)
    problems, crashes = outcome.problems, outcome.crashes
    for problem in problems:
        print(f"difftest run: {problem}", file=sys.stderr)
    for record in crashes:
        print(f"CRASH case {record.case_id} (a job of this run died in it): replay with "
              f"{repro_command(record.artifact or '-', tuple(args.plugin))}", file=sys.stderr)
    report = outcome.report
    if report is None:  # every job died before finishing a case: a report of the crashes
        problems.append("no job wrote a report")
        print("difftest run: no job wrote a report", file=sys.stderr)
        report = Report(fingerprint(), {"runner": "difftest run"}, {}, []).to_dict()
    report["config"] |= {"shard": args.shard, "jobs": args.jobs}
    if any(gpu_envs):
        report["config"]["job_gpus"] = [pinning.describe(env) for env in gpu_envs]
    # a job's crash is a case of this run; earlier runs' crashes are not
    known = {case["case_id"] for case in report["cases"]}
    report["cases"] += [c.to_dict() for c in crashes if c.case_id not in known]
    found = [*earlier, *crashes]
    if earlier:
        report["earlier_crashes"] = report.get("earlier_crashes", []) + [
            c.to_dict() for c in earlier]
    missing = unavailable_asked(report["backends"], args.backends, args.optional,
                                case_records(report), args.reference)
    if outcome.interrupted is not None:
        report["config"]["interrupted"] = {"signal": outcome.interrupted.name,
                                           "in_flight": outcome.in_flight}
        if args.report:
            write_report(args.report, report)
        _write_junit(args.junit, report, missing)
        print(f"difftest run: interrupted by {outcome.interrupted.name}: "
              f"{len(report['cases'])} finished case(s) in a partial report "
              f"({args.report or 'not written: no --report'})", file=sys.stderr)
        return outcome.interrupted.exit_status
    if args.report:
        write_report(args.report, report)
    _write_junit(args.junit, report, missing)
    judgement = _print_closing(report, args.report, args.audit, missing)
    return 1 if found or problems or missing or judgement.failed else 0


def cmd_audit(args: argparse.Namespace) -> int:
    """Print a report's parameter audit, feature coverage and known bugs."""
    from difftest.judgement.audit import audit_lines
    from difftest.judgement.expectations import judge
    from difftest.judgement.expectations import load as load_expectations
    from difftest.reporting.report import ReportError, case_records, read_report
    from difftest.results.features import coverage_table

    try:
        report = read_report(args.report)
    except ReportError as exc:
        print(f"difftest audit: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    tested = [b for b in report["config"].get("backends", [])
              if b != report["config"].get("reference")]
    print("\n".join(f"generation: {line}" for line in report["config"].get("generation", [])))
    print("\n".join(audit_lines(report["cases"], tested)))
    records = case_records(report)
    print(coverage_table(records))
    for line in judge(records, load_expectations()).lines():  # the known bugs, as run says
        print(line)
    return 0


def cmd_repro(args: argparse.Namespace) -> int:
    """Replay one case on the local backends and show what differs from the recording."""
    from difftest.run.replay import replay

    return replay(Path(args.path), args.backends, args.plugin, _device(args.device),
                  args.reference, args.artifacts, args.report, args.trust_recorded_paths)


def cmd_export(args: argparse.Namespace) -> int:
    """Write a failure's kernel call as a script that needs only torch and the kernel's
    package."""
    from difftest.run.export import ExportError, export

    try:
        exported = export(Path(args.path), Path(args.output) if args.output else None,
                          args.backend, args.plugin, _device(args.device))
    except ExportError as exc:
        print(f"difftest export: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    for note in exported.notes:
        print(f"note: {note}", file=sys.stderr)
    bug = f" (known bug {exported.known_bug})" if exported.known_bug else ""
    print(f"wrote {exported.script}" + (f" and {exported.tensors}" if exported.tensors else "")
          + f": {exported.backend}'s kernel call{bug}; run it with: python {exported.script}")
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    """Pin a case (case JSON or artifact directory) into the regression corpus."""
    from difftest.case.casefile import read_case
    from difftest.generation.corpus import CORPUS_DIR, promote
    from difftest.results.artifacts import read_failure_case

    path = Path(args.path)
    case = read_failure_case(path) if path.is_dir() else read_case(path)
    try:
        written = promote(case, args.name, args.corpus or CORPUS_DIR)
    except ValueError as exc:  # the corpus name
        print(f"difftest promote: error: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    print(f"pinned {written}")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    """Join shard reports into one (refusing conflicting ones) and print its verdict as
    ``run`` would; exit 0 once the merged report is written."""
    from difftest.judgement.expectations import judge
    from difftest.judgement.expectations import load as load_expectations
    from difftest.reporting.report import (
        ReportError,
        case_records,
        read_report,
        summary,
        verdict_line,
        write_report,
    )
    from difftest.run.shard import ShardError, merge_reports

    expectations = load_expectations()  # a bad file is refused before anything is written
    try:
        reports = [(str(p), read_report(p)) for p in args.reports]
        merged, warnings = merge_reports(reports, force=args.force)
    except (ReportError, ShardError) as exc:
        print(f"difftest merge: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    write_report(args.output, merged)
    _write_junit(args.junit, merged)
    print(summary(merged))
    print(f"merged {len(reports)} reports ({len(merged['cases'])} cases) into {args.output}")
    judgement = judge(case_records(merged), expectations)
    for line in judgement.lines():
        print(line)
    print(verdict_line(merged, args.output, judgement))
    return 0


def cmd_gate(args: argparse.Namespace) -> int:
    """Compare a candidate report with a baseline; exit 1 on any regression."""
    from difftest.reporting.gate import GateError, gate_lines
    from difftest.reporting.report import ReportError, read_report

    try:
        baseline, candidate = read_report(args.baseline), read_report(args.candidate)
        lines, result = gate_lines(baseline, candidate, args.baseline, args.candidate,
                                   args.max_ratio_growth, args.ratio_floor, args.all)
    except (ReportError, GateError) as exc:
        print(f"difftest gate: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    print("\n".join(lines))
    return 1 if result.failed else 0


def cmd_bump(args: argparse.Namespace) -> int:
    """Put both releases in place, run the baseline and the candidate on its cases, gate."""
    from difftest.run.bump import KINDS, Bump, BumpError, bump

    report_dir = Path(args.report_dir or f"reports/bump-{args.kind}-{args.old}-{args.new}")
    try:
        return bump(Bump(KINDS[args.kind], args.old, args.new, report_dir, args.backends,
                         args.examples, args.seed, not args.no_corpus,
                         str(args.jobs or "auto"),
                         _device(args.device), args.plugin))
    except BumpError as exc:
        print(f"difftest bump: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE


def cmd_plot(args: argparse.Namespace) -> int:
    """Draw a report as a PNG."""
    from difftest.reporting.plot import PlotUnavailable, plot_report
    from difftest.reporting.report import ReportError, read_report

    try:
        report = read_report(args.report)
        output = args.output or str(Path(args.report).with_suffix(".png"))
        print(f"wrote {plot_report(report, output)}")
    except (ReportError, PlotUnavailable) as exc:
        print(f"difftest plot: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="difftest", description=__doc__,
                                     epilog=EXIT_CODES, formatter_class=_Formatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, text: str, epilog: str = EXIT_CODES) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, epilog=epilog,
                              formatter_class=_Formatter)

    p = command("backends", "list backends with availability and reasons")
    _add_session_options(p)
    p.set_defaults(func=cmd_backends)

    p = command("run", "run the pinned corpus plus N generated cases on every backend; the "
                "last line is the verdict", f"{BACKEND_SYNTAX}\n\n{EXIT_CODES}")
    _add_session_options(p)
    p.add_argument("--backends", type=_backend_names, metavar="NAMES",
                   help="comma-separated backends under test (default: every known one)")
    p.add_argument("--optional", type=_backend_names, default=[], metavar="NAMES",
                   help="backends of --backends that may be unavailable without failing "
                   "the run")
    p.add_argument("--examples", type=_count, default=20,
                   help="generated examples (each may add variants fitted to the backends "
                   "that refuse it)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated case set")
    p.add_argument("--no-corpus", action="store_true", help="skip the pinned corpus")
    p.add_argument("--cases-from", type=_report_file, metavar="REPORT",
                   help="run exactly the cases of this report (a baseline's), instead of the "
                   "corpus and generated cases")
    p.add_argument("--case-ids", type=_case_ids, metavar="IDS",
                   help="with --cases-from: only these comma-separated case ids of it")
    p.add_argument("--shard", metavar="K/N",
                   help="run only shard K of N (1-based) of the case set, split by case id")
    p.add_argument("--jobs", type=_jobs, default=1, metavar="N|auto",
                   help="split the case set across N processes, one report; auto: one per "
                   "core, at most 8 per visible GPU (pinned round-robin) or 8 without GPUs")
    p.add_argument("--audit", action="store_true",
                   help="print the whole parameter audit and feature coverage (by default "
                   "only blind spots; `difftest audit REPORT` prints it later)")
    p.add_argument("--job", help=argparse.SUPPRESS)  # K/N: one process of --jobs N
    p.add_argument("--claims", help=argparse.SUPPRESS)  # the jobs' claimed cases
    p.add_argument("--reach", action="store_true",
                   help="record the lines run in the vllm package files (coverage.py), "
                   "for the gate's reach of a bump's changed code")
    p.add_argument("--report", type=_output_file, help="write the JSON report here")
    p.add_argument("--junit", type=_output_file, metavar="PATH",
                   help="write JUnit XML here: a testcase per (case, backend), failures with "
                   "their replay command, unsupported and unavailable skipped with the reason, "
                   "known bugs skipped as known-bug")
    p.set_defaults(func=cmd_run)

    p = command("repro", "replay a failing case on the local backends",
                f"{BACKEND_SYNTAX}\n\n{EXIT_CODES}")
    _add_session_options(p)
    p.add_argument("path", help="failure directory, case JSON or pending case file")
    p.add_argument("--backends", type=_backend_names, metavar="NAMES",
                   help="comma-separated backends (default: those of the recording)")
    p.add_argument("--report", type=_output_file, help="write the replay as a JSON report here")
    p.add_argument("--trust-recorded-paths", action="store_true",
                   help="also replay recorded backends whose options name a path "
                   "(vllm=DIR, aiter=DIR), which loads that directory's code: only for a "
                   "failure directory you trust")
    p.set_defaults(func=cmd_repro)

    p = command("export", "write a failure's kernel call as a script that runs without "
                "difftest (torch and the kernel's package only), for an upstream issue or "
                "test suite", f"{BACKEND_SYNTAX}\n\n{EXIT_CODES}")
    p.add_argument("path", help="failure directory (or case JSON, with --backend)")
    p.add_argument("-o", "--output", type=_output_file,
                   help="the script's path (default: test_<kernel>_<case id>.py in the "
                   "failure directory); its tensors go beside it, as .pt, when large")
    p.add_argument("--backend", metavar="NAME",
                   help="the backend whose call is exported (default: the one that failed)")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE:ATTR|FILE.py",
                   help="load extra backends (repeatable)")
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                   help="where the call is recorded (auto: a GPU if one is visible)")
    p.set_defaults(func=cmd_export)

    p = command("promote", "pin a case into the regression corpus")
    p.add_argument("path", help="artifact directory or case JSON")
    p.add_argument("name", help="corpus name (letters, digits, '-', '_', '.')")
    p.add_argument("--corpus", type=_directory,
                   help="corpus directory (default: difftest/generation/corpus)")
    p.set_defaults(func=cmd_promote)

    p = command("merge", "join shard reports into one report")
    p.add_argument("reports", nargs="+", help="reports to join")
    p.add_argument("-o", "--output", required=True, type=_output_file,
                   help="where to write the merged report")
    p.add_argument("--force", action="store_true",
                   help="merge even when fingerprints, configs or backends differ")
    p.add_argument("--junit", type=_output_file, metavar="PATH",
                   help="also write the merged report as JUnit XML here")
    p.set_defaults(func=cmd_merge)

    p = command("gate", "fail if CANDIDATE regressed against BASELINE")
    p.add_argument("baseline", help="report of the accepted image")
    p.add_argument("candidate", help="report of the image under review")
    p.add_argument("--max-ratio-growth", type=_at_least(1.0), default=DEFAULT_MAX_RATIO_GROWTH,
                   metavar="X", help="fail when error/tolerance grew more than X times")
    p.add_argument("--ratio-floor", type=_at_least(0.0), default=DEFAULT_RATIO_FLOOR, metavar="R",
                   help="ignore growth while the candidate's error/tolerance <= R")
    p.add_argument("--all", action="store_true",
                   help="list unchanged rows and every unreached hunk of the reach too")
    p.set_defaults(func=cmd_gate)

    p = command("bump", "gate an AITER or vLLM bump in one command: put both releases in "
                "place, run the baseline and the candidate on its cases with --reach, gate; "
                "the last line is the verdict", f"""{BACKEND_SYNTAX}

OLD and NEW: an amd-aiter version (0.1.7.post2.dev18) or tag (v0.1.20.post1), fetched from
$DIFFTEST_AITER_REPO where missing; or a vLLM release (0.34.0). Reports, logs and artifacts go
to --report-dir. Runners that run each side on its own image use difftest run and difftest
gate instead.

exit status: as difftest gate's (0 no regression, 1 a regression), 2 the bump could not run
(a release that cannot be fetched, a bad argument, a run that could not start)""")
    p.add_argument("kind", choices=("aiter", "vllm"), help="the kind of release bumped")
    p.add_argument("old", metavar="OLD", help="the baseline's release")
    p.add_argument("new", metavar="NEW", help="the candidate's release")
    p.add_argument("--backends", type=_backend_names, metavar="NAMES",
                   help="comma-separated backends (default: every backend that takes that "
                   "kind of release and runs here)")
    p.add_argument("--examples", type=_count, default=20,
                   help="generated examples of the baseline's case set")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated case set")
    p.add_argument("--no-corpus", action="store_true", help="skip the pinned corpus")
    p.add_argument("--jobs", type=_jobs, default=1, metavar="N|auto",
                   help="processes of each run (difftest run --jobs)")
    p.add_argument("--report-dir", type=_directory, metavar="DIR",
                   help="where the reports, logs and artifacts go (default: "
                   "reports/bump-KIND-OLD-NEW)")
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                   help="where kernels run (auto: a GPU if one is visible)")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE:ATTR|FILE.py",
                   help="load extra backends (repeatable)")
    p.set_defaults(func=cmd_bump)

    p = command("audit", "print a report's parameter audit (each kernel argument's values "
                "over the cases, blind spots marked) and feature coverage")
    p.add_argument("report", help="a JSON report")
    p.set_defaults(func=cmd_audit)

    p = command("plot", "draw error/tolerance and the agreement matrix as a PNG")
    p.add_argument("report", help="a JSON report")
    p.add_argument("-o", "--output", type=_output_file,
                   help="PNG path (default: REPORT with .png)")
    p.set_defaults(func=cmd_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``difftest`` console script.

    Exit status: 0 all agreed (or the command succeeded), 1 a backend disagreed, errored or
    crashed (or the gate failed), 2 the command could not run (bad arguments, unknown
    backend, unreadable file); the message then names what was wrong.
    """
    from difftest.case.casefile import CaseFileError
    from difftest.case.spec import CaseError
    from difftest.contract.registry import RegistryError
    from difftest.judgement.expectations import ExpectationError
    from difftest.machine.gpus import VisibilityError
    from difftest.primitives.jsonfile import JSONFileError
    from difftest.results.records import RecordError

    args = build_parser().parse_args(argv)
    try:
        with catching_signals():
            return int(args.func(args))
    except Interrupted as exc:  # outside a run's cases: nothing partial to keep
        if not getattr(args, "job", None):  # a job of --jobs: its parent says it once
            print(f"difftest {args.command}: {exc}", file=sys.stderr)
        return exc.exit_status
    except (RegistryError, CaseError, CaseFileError, VisibilityError, UsageError, OSError,
            json.JSONDecodeError, JSONFileError, RecordError, ExpectationError) as exc:
        print(f"difftest {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE


if __name__ == "__main__":
    sys.exit(main())
