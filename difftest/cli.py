"""The ``difftest`` command line.

``backends`` lists what this machine can run; ``run`` runs the corpus plus a deterministic
generated case set (``--shard K/N`` runs one part of it); ``repro`` replays one case from a
failure directory or case file and checks it against the recording; ``promote`` pins a case
into the corpus; ``merge`` joins shard reports; ``gate`` compares a candidate report with a
baseline; ``plot`` draws a report.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from difftest.artifacts import DEFAULT_ROOT, repro_command
from difftest.devices import DEVICE_CHOICES
from difftest.gate import DEFAULT_MAX_RATIO_GROWTH, DEFAULT_RATIO_FLOOR
from difftest.registry import RegistryError, split_names

if TYPE_CHECKING:
    from difftest.case import Case

EXIT_UNREADABLE = 2


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


def _output_file(text: str) -> str:
    """argparse type: a file path that can be written (not a directory, nor under a file)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory (allowed: a file path)")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r}: {parent} is a file, not a directory")
    return text


def _directory(text: str) -> str:
    """argparse type: a directory path (existing or not), not a file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file (allowed: a directory)")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r}: {parent} is a file, not a directory")
    return text


def _report_file(text: str) -> str:
    """argparse type: a report whose every case can be read (:mod:`difftest.cases.recorded`)."""
    from difftest.cases.recorded import recorded_runs
    from difftest.report import ReportError

    try:
        recorded_runs(text, ())
    except ReportError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _jobs(text: str) -> int:
    """argparse type: an integer >= 1, or ``auto`` (0: decided by :func:`_job_count`)."""
    if text == "auto":
        return 0
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed (allowed: an integer >= 1, "
                                         "or auto)")
    return int(text)


def _job_count(jobs: int, device: str) -> int:
    """``--jobs`` on ``device``: ``auto`` is one per core on the CPU, one on a GPU; more
    than one on a GPU is refused."""
    from difftest.jobs import auto_jobs

    if jobs == 0:
        return auto_jobs() if device == "cpu" else 1
    if jobs > 1 and device != "cpu":
        raise UsageError(f"--jobs {jobs}: jobs split a CPU run (one core each); with a GPU "
                         "allowed 1 or auto (one process per GPU: pytest -n, --shard)")
    return jobs


def _backend_names(text: str) -> list[str]:
    """argparse type: ``a,b[k=v,k2=v2],c`` as names (see :func:`difftest.registry.split_names`)."""
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
    from difftest import devices, gpus

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
    parser.add_argument("--reference", default="torch-ref", help="the reference backend")
    parser.add_argument("--artifacts", default=DEFAULT_ROOT, type=_directory,
                        help="directory for pending cases and failure artifacts")


class Progress:
    """A one-line progress bar on stderr (one line per case when stderr is not a terminal);
    without a total (a job of ``--jobs``), a count."""

    def __init__(self, total: int | None) -> None:
        self.total = total
        self.done = 0
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        """Advance by one case."""
        self.done += 1
        width = 30
        rate = self.done / max(time.perf_counter() - self.start, 1e-9)
        if self.total is None:  # a job of --jobs: how many it ran, of a set the jobs share
            line = f"{self.done} cases {rate:.2f} cases/s  {label}"
        else:
            filled = width * self.done // max(self.total, 1)
            line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                    f"{rate:.2f} cases/s  {label}")
        if self.tty:
            sys.stderr.write("\r" + line[:150].ljust(150))
            if self.done == self.total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def cmd_backends(args: argparse.Namespace) -> int:
    """List backends with availability, reasons and versions."""
    from difftest import devices, registry
    from difftest.report import backend_entry

    devices.prepare_runtime(devices.resolve(_device(args.device)))
    for name, backend in sorted(registry.discover(args.plugin).items()):
        entry = backend_entry(backend)
        state = "available" if entry["available"] else "unavailable"
        versions = ", ".join(f"{k} {v}" for k, v in entry["versions"].items())
        print(f"{name:<24} {state:<12} {entry['reason'] or versions}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run the corpus plus generated cases; exit 1 on any disagreement, error or crash."""
    from difftest import devices
    from difftest.audit import audit_json, audit_lines
    from difftest.cases.capabilities import Capabilities
    from difftest.cases.corpus import load_corpus
    from difftest.cases.generate import generated_cases
    from difftest.cases.recorded import recorded_runs
    from difftest.jobs import claimed
    from difftest.replay import report_previous_crashes
    from difftest.report import build_report, summary, write_report
    from difftest.session import Session
    from difftest.shard import Shard, ShardError

    try:
        shard = Shard.parse(args.shard, "--shard") if args.shard else None
        job = Shard.parse(args.job, "--job") if args.job else None
    except ShardError as exc:
        print(f"difftest run: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    if job is None:
        args.jobs = _job_count(args.jobs, devices.resolve(_device(args.device)))
        if args.jobs > 1:
            return _run_jobs(args)
    session = Session.create(args.backends, args.plugin, _device(args.device),
                             args.artifacts, args.reference)
    # the parent of --jobs turns earlier runs' pending cases into crashes, not each job
    earlier = [] if job else report_previous_crashes(args.artifacts, "difftest run")
    if args.cases_from:  # an earlier report's cases replace the corpus and generated ones
        args.no_corpus, args.examples = True, 0
    capabilities = Capabilities.probe(session.backends, session.device)
    runs: list[tuple[Case, tuple[str, ...] | None]] = [
        (case, None) for case in ([] if args.no_corpus else load_corpus())]
    runs += [(fitted.case, fitted.backends) for fitted in capabilities.fit_all(
        generated_cases(args.examples, args.seed, capabilities.strategy()))]
    runs += recorded_runs(args.cases_from, [b.name for b in session.backends]
                          ) if args.cases_from else []
    if shard is not None:
        runs = [(case, names) for case, names in runs if shard.contains(case)]
    # a job of --jobs runs the cases it claims first (the others take the rest)
    mine = runs if job is None else claimed(runs, Path(args.claims))
    progress = Progress(len(runs) if job is None else None)
    # On a GPU a worker process prepares the next cases' host-side inputs (Session.run_all);
    # on the CPU it would compete with the interpreted kernels for the cores.
    results = (zip(runs, session.run_all(runs), strict=True) if session.device.type == "cuda"
               else ((run, session.run(*run)) for run in mine))
    for (case, _), result in results:
        statuses = [r.status.value for r in result.results]
        progress.step(f"{case.case_id} {case.name or ''} {','.join(statuses)}")
        for message in result.failure_messages():
            print(message, file=sys.stderr)
            if result.artifact:
                print(f"  replay: {repro_command(result.artifact, session.plugins)}",
                      file=sys.stderr)
    config = session.config() | {"runner": "difftest run", "examples": args.examples,
                                 "seed": args.seed, "corpus": not args.no_corpus,
                                 "shard": str(shard) if shard else None,
                                 "cases_from": args.cases_from,
                                 "generation": capabilities.lines()}
    report = build_report(session.records, session.backend_entries(), config,
                          session.environment, earlier_crashes=earlier)
    report["config"]["audit"] = audit_json(report["cases"], session.backends, session.device)
    session.close()
    if job is None:
        print(summary(report))
        for line in capabilities.lines():
            print(f"generation: {line}")
        print("\n".join(audit_lines(report["cases"], session.backends, session.device)))
    if args.report:
        write_report(args.report, report)
        if job is None:
            print(f"report: {args.report}")
    return 1 if earlier or any(r.failed for r in session.results) else 0


def _run_jobs(args: argparse.Namespace) -> int:
    """``difftest run --jobs N``: N processes, one report (:mod:`difftest.jobs`)."""
    from difftest.audit import audit_lines
    from difftest.fingerprint import fingerprint
    from difftest.jobs import run_jobs
    from difftest.replay import report_previous_crashes
    from difftest.report import build_report, case_records, summary, write_report

    earlier = report_previous_crashes(args.artifacts, "difftest run")
    options = [f"--device={args.device}", f"--reference={args.reference}",
               f"--artifacts={args.artifacts}", f"--examples={args.examples}",
               f"--seed={args.seed}", *(f"--plugin={p}" for p in args.plugin)]
    options += [f"--backends={','.join(args.backends)}"] if args.backends else []
    options += ["--no-corpus"] if args.no_corpus else []
    options += [f"--cases-from={args.cases_from}"] if args.cases_from else []
    options += [f"--shard={args.shard}"] if args.shard else []
    report, crashes, problems = run_jobs(options, args.jobs, args.artifacts)
    for problem in problems:
        print(f"difftest run: {problem}", file=sys.stderr)
    for record in crashes:
        print(f"CRASH case {record.case_id}: replay with "
              f"{repro_command(record.artifact or '-', tuple(args.plugin))}", file=sys.stderr)
    found = [*earlier, *crashes]
    if report is None:  # every job died: a report of the crashes alone
        print("difftest run: no job wrote a report", file=sys.stderr)
        report = build_report([], {}, {"runner": "difftest run"}, fingerprint())
    report["config"] |= {"shard": args.shard, "jobs": args.jobs}
    if found:
        report["earlier_crashes"] = report.get("earlier_crashes", []) + [
            c.to_dict() for c in found]
    print(summary(report))
    for line in report["config"].get("generation", []):
        print(f"generation: {line}")
    print("\n".join(audit_lines(report["cases"], report["config"].get("backends", []))))
    if args.report:
        write_report(args.report, report)
        print(f"report: {args.report}")
    failed = any(record.failed for record in case_records(report))
    return 1 if found or problems or failed else 0


def cmd_repro(args: argparse.Namespace) -> int:
    """Replay one case on the local backends and show what differs from the recording."""
    from difftest.replay import replay

    return replay(Path(args.path), args.backends, args.plugin, _device(args.device),
                  args.reference, args.artifacts, args.report)


def cmd_promote(args: argparse.Namespace) -> int:
    """Pin a case (case JSON or artifact directory) into the regression corpus."""
    from difftest.casefile import read_case
    from difftest.cases.corpus import CORPUS_DIR, promote

    path = Path(args.path)
    case = read_case(path / "case.json" if path.is_dir() else path)
    try:
        written = promote(case, args.name, args.corpus or CORPUS_DIR)
    except ValueError as exc:  # the corpus name
        print(f"difftest promote: error: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    print(f"pinned {written}")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    """Join shard reports into one; refuse conflicting ones."""
    from difftest.report import ReportError, read_report, summary, write_report
    from difftest.shard import ShardError, merge_reports

    try:
        reports = [(str(p), read_report(p)) for p in args.reports]
        merged, warnings = merge_reports(reports, force=args.force)
    except (ReportError, ShardError) as exc:
        print(f"difftest merge: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    write_report(args.output, merged)
    print(summary(merged))
    print(f"merged {len(reports)} reports ({len(merged['cases'])} cases) into {args.output}")
    return 0


def cmd_gate(args: argparse.Namespace) -> int:
    """Compare a candidate report with a baseline; exit 1 on any regression."""
    from difftest.gate import environment_changes, format_result, gate
    from difftest.report import ReportError, read_report

    try:
        baseline, candidate = read_report(args.baseline), read_report(args.candidate)
    except ReportError as exc:
        print(f"difftest gate: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    changes = environment_changes(baseline, candidate)
    print(f"baseline {args.baseline} vs candidate {args.candidate}")
    print("environment changes:" if changes else "environment: identical versions")
    for line in changes:
        print(line)
    result = gate(baseline, candidate, args.max_ratio_growth, args.ratio_floor)
    print(format_result(result, show_all=args.all))
    return 1 if result.failed else 0


def cmd_plot(args: argparse.Namespace) -> int:
    """Draw a report as a PNG."""
    from difftest.plot import plot_report
    from difftest.report import ReportError, read_report

    try:
        report = read_report(args.report)
    except ReportError as exc:
        print(f"difftest plot: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    output = args.output or str(Path(args.report).with_suffix(".png"))
    print(f"wrote {plot_report(report, output)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="difftest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list backends with availability and reasons")
    _add_session_options(p)
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("run", help="run the corpus plus N generated cases")
    _add_session_options(p)
    p.add_argument("--backends", type=_backend_names,
                   help="comma-separated backends (default: all)")
    p.add_argument("--examples", type=_count, default=20, help="generated cases (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated case set")
    p.add_argument("--no-corpus", action="store_true", help="skip the pinned corpus")
    p.add_argument("--cases-from", type=_report_file, metavar="REPORT",
                   help="run exactly the cases of this report (a baseline's), instead of the "
                   "corpus and generated cases")
    p.add_argument("--shard", metavar="K/N",
                   help="run only shard K of N (1-based) of the case set, split by case id")
    p.add_argument("--jobs", type=_jobs, default=1, metavar="N|auto",
                   help="on the CPU, split the case set across N processes, one core each "
                   "(auto: one per core, at most 8; on a GPU, 1); one report (default 1)")
    p.add_argument("--job", help=argparse.SUPPRESS)  # K/N: one process of --jobs N
    p.add_argument("--claims", help=argparse.SUPPRESS)  # the jobs' claimed cases
    p.add_argument("--report", type=_output_file, help="write the JSON report here")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("repro", help="replay a failing case on the local backends")
    _add_session_options(p)
    p.add_argument("path", help="failure directory, case JSON or pending case file")
    p.add_argument("--backends", type=_backend_names,
                   help="comma-separated backends (default: all)")
    p.add_argument("--report", type=_output_file, help="write the replay as a JSON report here")
    p.set_defaults(func=cmd_repro)

    p = sub.add_parser("promote", help="pin a case into the regression corpus")
    p.add_argument("path", help="artifact directory or case JSON")
    p.add_argument("name", help="corpus name (letters, digits, '-', '_', '.')")
    p.add_argument("--corpus", type=_directory,
                   help="corpus directory (default: difftest/cases/corpus)")
    p.set_defaults(func=cmd_promote)

    p = sub.add_parser("merge", help="join shard reports into one report")
    p.add_argument("reports", nargs="+", help="reports to join")
    p.add_argument("-o", "--output", required=True, type=_output_file,
                   help="where to write the merged report")
    p.add_argument("--force", action="store_true",
                   help="merge even when fingerprints, configs or backends differ")
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser("gate", help="fail if CANDIDATE regressed against BASELINE")
    p.add_argument("baseline", help="report of the accepted image")
    p.add_argument("candidate", help="report of the image under review")
    p.add_argument("--max-ratio-growth", type=_at_least(1.0), default=DEFAULT_MAX_RATIO_GROWTH,
                   metavar="X", help="fail when error/tolerance grew more than X times "
                   "(default %(default)s)")
    p.add_argument("--ratio-floor", type=_at_least(0.0), default=DEFAULT_RATIO_FLOOR, metavar="R",
                   help="ignore growth while the candidate's error/tolerance <= R "
                   "(default %(default)s)")
    p.add_argument("--all", action="store_true", help="list unchanged rows too")
    p.set_defaults(func=cmd_gate)

    p = sub.add_parser("plot", help="draw error/tolerance and the agreement matrix as a PNG")
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
    from difftest.case import CaseError
    from difftest.casefile import CaseFileError
    from difftest.gpus import VisibilityError
    from difftest.jsonfile import JSONFileError
    from difftest.records import RecordError
    from difftest.registry import RegistryError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (RegistryError, CaseError, CaseFileError, VisibilityError, UsageError, OSError,
            json.JSONDecodeError, JSONFileError, RecordError) as exc:
        print(f"difftest {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE


if __name__ == "__main__":
    sys.exit(main())
