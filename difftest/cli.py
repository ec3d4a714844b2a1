"""The ``difftest`` command line."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from difftest.artifacts import DEFAULT_ROOT
from difftest.devices import DEVICE_CHOICES


def _add_session_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE:ATTR|FILE.py",
                        help="load extra backends (repeatable)")
    parser.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                        help="where kernels run (auto: a GPU if one is visible)")
    parser.add_argument("--reference", default="torch-ref", help="the reference backend")
    parser.add_argument("--artifacts", default=DEFAULT_ROOT,
                        help="directory for pending cases and failure artifacts")


def _backend_list(text: str | None) -> list[str] | None:
    return None if text is None else [n.strip() for n in text.split(",") if n.strip()]


class Progress:
    """A one-line progress bar on stderr (one line per case when stderr is not a terminal)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        """Advance by one case."""
        self.done += 1
        width = 30
        filled = width * self.done // max(self.total, 1)
        rate = self.done / max(time.perf_counter() - self.start, 1e-9)
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

    devices.prepare_runtime(devices.resolve(args.device))
    for name, backend in sorted(registry.discover(args.plugin).items()):
        entry = backend_entry(backend)
        state = "available" if entry["available"] else "unavailable"
        versions = ", ".join(f"{k} {v}" for k, v in entry["versions"].items())
        print(f"{name:<24} {state:<12} {entry['reason'] or versions}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run the corpus plus generated cases; exit 1 on any disagreement, error or crash."""
    from cases.corpus import load_corpus
    from cases.generate import generated_cases
    from difftest.report import build_report, summary, write_report
    from difftest.session import Session

    session = Session.create(_backend_list(args.backends), args.plugin, args.device,
                             args.artifacts, args.reference)
    case_set = ([] if args.no_corpus else load_corpus()) + generated_cases(args.examples,
                                                                          args.seed)
    progress = Progress(len(case_set))
    for case in case_set:
        result = session.run(case)
        worst = [r.status.value for r in result.results]
        progress.step(f"{case.case_id} {case.name or ''} {','.join(worst)}")
        for message in result.failure_messages():
            print(message, file=sys.stderr)
            if result.artifact:
                print(f"  replay: difftest repro {result.artifact}", file=sys.stderr)
    config = session.config() | {"examples": args.examples, "seed": args.seed,
                                 "corpus": not args.no_corpus}
    report = build_report(session.results, [session.reference, *session.backends], config)
    print(summary(report))
    if args.report:
        write_report(args.report, report)
        print(f"report: {args.report}")
    return 1 if any(r.failed for r in session.results) else 0


def cmd_repro(args: argparse.Namespace) -> int:
    """Replay one case (a case JSON or an artifact directory) on the local backends."""
    from difftest.case import Case
    from difftest.session import Session

    path = Path(args.path)
    case_file = path / "case.json" if path.is_dir() else path
    case = Case.from_json(case_file.read_text())
    session = Session.create(_backend_list(args.backends), args.plugin, args.device,
                             args.artifacts, args.reference)
    result = session.run(case)
    print(f"case {case.case_id} {case.name}".rstrip())
    for r in result.results:
        ratio = f"{r.comparison.max_ratio:.4g}" if r.comparison else "-"
        print(f"  {r.backend:<24} {r.status.value:<12} error/tolerance {ratio:<10} "
              f"{r.detail.splitlines()[0] if r.detail else ''}")
    for message in result.failure_messages():
        print(message)
    return 1 if result.failed else 0


def cmd_promote(args: argparse.Namespace) -> int:
    """Pin a case (case JSON or artifact directory) into the regression corpus."""
    from cases.corpus import CORPUS_DIR, promote
    from difftest.case import Case

    path = Path(args.path)
    case_file = path / "case.json" if path.is_dir() else path
    written = promote(Case.from_json(case_file.read_text()), args.name,
                      args.corpus or CORPUS_DIR)
    print(f"pinned {written}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="difftest", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list backends with availability and reasons")
    _add_session_options(p)
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("run", help="run the corpus plus N generated cases")
    _add_session_options(p)
    p.add_argument("--backends", help="comma-separated backends (default: all)")
    p.add_argument("--examples", type=int, default=20, help="generated cases (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated case set")
    p.add_argument("--no-corpus", action="store_true", help="skip the pinned corpus")
    p.add_argument("--report", help="write the JSON report here")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("repro", help="replay a failing case on the local backends")
    _add_session_options(p)
    p.add_argument("path", help="artifact directory or case JSON")
    p.add_argument("--backends", help="comma-separated backends (default: all)")
    p.set_defaults(func=cmd_repro)

    p = sub.add_parser("promote", help="pin a case into the regression corpus")
    p.add_argument("path", help="artifact directory or case JSON")
    p.add_argument("name", help="corpus name (letters, digits, '-', '_', '.')")
    p.add_argument("--corpus", help="corpus directory (default: cases/corpus)")
    p.set_defaults(func=cmd_promote)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``difftest`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
