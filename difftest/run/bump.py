"""One command per bump: ``difftest bump aiter OLD NEW`` and ``difftest bump vllm OLD NEW``.

A bump puts both releases in place (an AITER PyPI version or tag,
:mod:`difftest.backends.aiter_release`, offline from ``$DIFFTEST_AITER_REPO``; a vLLM release,
:func:`difftest.backends.vllm_release.fetch_missing`), then runs two ``difftest run
--reach`` processes with the release chosen by the environment (``$DIFFTEST_AITER`` or
``$DIFFTEST_VLLM``), so every backend keeps its plain name and the reports gate name for
name: the baseline draws the case set, the candidate runs exactly its cases
(``--cases-from``). Each run's output goes to a log beside its report. The gate of the two
reports follows (environment, reach of the changed code, device code of kernels compiled
without running, the table) and one verdict line ends it; the exit status is the gate's
(2: the bump could not run; ``128 + signal`` when interrupted).

The backends default to every one that takes that kind of release (its ``releases``,
:func:`difftest.contract.backend.releases_taken`) and runs here; the rest are named with
their reason. CI runners that run each side on its own image keep the two-step flow
(``difftest run`` per image, then ``difftest gate``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from difftest.contract import registry
from difftest.contract.backend import releases_taken
from difftest.machine import devices
from difftest.primitives.interrupts import Interrupted
from difftest.reporting.gate import gate_lines
from difftest.reporting.report import ReportError, read_report

EXIT_UNRUNNABLE = 2


class BumpError(ValueError):
    """The bump cannot run: a release that cannot be put in place, a backend that names its
    own release, no backend to run; the message says what to do."""


@dataclass(frozen=True)
class ReleaseKind:
    """What a bump of one kind of release needs: its name (the backend option and the
    ``releases`` entry), the environment variable that chooses the release for every backend,
    and how a named release is put in place (returning the value the variable gets)."""

    name: str
    title: str
    a_release: str  # "an AITER release", "a vLLM release"
    env: str
    put_in_place: Callable[[str], str]


def _aiter_in_place(spec: str) -> str:
    from difftest.backends.aiter_release import AiterFetchError, fetch_missing, in_place

    try:
        fetch_missing([spec])
    except AiterFetchError as exc:
        raise BumpError(str(exc)) from None
    return in_place(spec)


def _vllm_in_place(spec: str) -> str:
    from difftest.backends.vllm_release import ReleaseError, fetch_missing

    try:
        fetch_missing([spec])
    except ReleaseError as exc:
        raise BumpError(str(exc)) from None
    return spec


KINDS = {kind.name: kind for kind in (
    ReleaseKind("aiter", "AITER", "an AITER release", "DIFFTEST_AITER", _aiter_in_place),
    ReleaseKind("vllm", "vLLM", "a vLLM release", "DIFFTEST_VLLM", _vllm_in_place),
)}


@dataclass
class Bump:
    """One bump's settings: the release kind, the two releases, what ``difftest run`` gets."""

    kind: ReleaseKind
    old: str
    new: str
    report_dir: Path
    backends: Sequence[str] | None = None
    examples: int = 20
    seed: int = 0
    corpus: bool = True
    jobs: str = "1"
    device: str = "cpu"
    plugins: Sequence[str] = ()
    left_out: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.backends is not None:
            named = [n for n in self.backends
                     if f"[{self.kind.name}=" in n or f",{self.kind.name}=" in n]
            if named:
                raise BumpError(f"--backends {named[0]}: names its {self.kind.title} release; "
                                f"the bump chooses it on each side (drop {self.kind.name}=)")

    def choose_backends(self, spec: str) -> list[str]:
        """``--backends`` as given, else every discovered backend that takes this kind of
        release and is available with ``spec`` chosen (the others go to ``left_out``)."""
        if self.backends is not None:
            return list(self.backends)
        chosen = []
        saved = os.environ.get(self.kind.env)
        os.environ[self.kind.env] = spec  # availability with the baseline's release
        try:
            for name, backend in sorted(registry.discover(self.plugins).items()):
                if self.kind.name not in releases_taken(backend):
                    continue
                availability = backend.availability()
                if availability.available:
                    chosen.append(name)
                else:
                    self.left_out.append(f"{name} ({availability.reason})")
        finally:  # the process's own setting again (a caller's later backends read it)
            if saved is None:
                del os.environ[self.kind.env]
            else:
                os.environ[self.kind.env] = saved
        if not chosen:
            raise BumpError(f"no backend that takes {self.kind.a_release} runs here: "
                            + "; ".join(self.left_out))
        return chosen

    def command(self, side: str, backends: Sequence[str]) -> list[str]:
        """The ``difftest run`` of ``side`` (``baseline`` or ``candidate``)."""
        run = [sys.executable, "-m", "difftest", "run", f"--device={self.device}",
               f"--backends={','.join(backends)}", "--reach", f"--jobs={self.jobs}",
               f"--report={self.report_dir / f'{side}.json'}",
               f"--artifacts={self.report_dir / f'{side}-artifacts'}",
               *(f"--plugin={p}" for p in self.plugins)]
        if side == "candidate":
            return [*run, f"--cases-from={self.report_dir / 'baseline.json'}"]
        return [*run, f"--examples={self.examples}", f"--seed={self.seed}",
                *([] if self.corpus else ["--no-corpus"])]


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s" if seconds >= 60 else f"{seconds:.0f} s"


def _run(command: list[str], env: dict[str, str], log: Path) -> tuple[int, str]:
    """Run ``command`` with its output in ``log``; its exit status and last line. A signal
    that stops the bump stops the run too (it then writes its partial report)."""
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            status = process.wait()
        except Interrupted as stop:
            process.send_signal(stop.signum)
            process.wait()
            raise
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return status, lines[-1] if lines else "(no output)"


def bump(settings: Bump, print_line: Callable[[str], None] = print) -> int:
    """Run the bump ``settings`` describes; its exit status (the gate's; 2: it could not
    run). Prints what it does, the gate and one verdict line last."""
    kind = settings.kind
    started = time.perf_counter()
    specs = {side: kind.put_in_place(release)
             for side, release in (("baseline", settings.old), ("candidate", settings.new))}
    devices.prepare_runtime(devices.resolve(settings.device))  # before any availability
    backends = settings.choose_backends(specs["baseline"])
    settings.report_dir.mkdir(parents=True, exist_ok=True)
    print_line(f"bump {kind.name} {settings.old} -> {settings.new} on {', '.join(backends)}"
               + ("" if settings.backends is not None
                  else f" (every backend that takes {kind.a_release} and runs here)"))
    for line in settings.left_out:
        print_line(f"  left out: {line}")
    for side, release in (("baseline", settings.old), ("candidate", settings.new)):
        if specs[side] != release:
            print_line(f"  {side} {release}: {specs[side]} (the setup's wheel)")
    for side, release in (("baseline", settings.old), ("candidate", settings.new)):
        log = settings.report_dir / f"{side}.log"
        env = os.environ | {kind.env: specs[side]}
        began = time.perf_counter()
        status, last = _run(settings.command(side, backends), env, log)
        print_line(f"{side} {kind.env}={release}: {_minutes(time.perf_counter() - began)}, "
                   f"exit {status}: {last} (log {log})")
        if status not in (0, 1):
            if status >= 128:
                return status
            raise BumpError(f"the {side} run could not run (exit {status}); its log: {log}")
    paths = [settings.report_dir / f"{side}.json" for side in ("baseline", "candidate")]
    try:
        baseline, candidate = (read_report(path) for path in paths)
    except ReportError as exc:
        raise BumpError(str(exc)) from None
    lines, result = gate_lines(baseline, candidate, str(paths[0]), str(paths[1]))
    for line in lines:
        print_line(line)
    pairs = sum(r.backend != "*" for r in result.rows)
    failing = sum(r.fails for r in result.rows) + len(result.backend_findings)
    what = (f"{failing} regression(s)" if result.failed else "no regression")
    print_line(f"BUMP {'FAILED' if result.failed else 'PASSED'}: {kind.title} {settings.old} -> "
               f"{settings.new}: {what} in {len(baseline['cases'])} cases, {pairs} (case, "
               f"backend) pairs; {_minutes(time.perf_counter() - started)}; reports in "
               f"{settings.report_dir}")
    return 1 if result.failed else 0
