"""Replaying one recorded case (``difftest repro``) and reporting crashes earlier runs left.

A replay reads a failure directory (``case.json`` with the recorded ``results.json`` and
``fingerprint.json``), a case file, or a pending file a dead process left; runs the case on
every backend this machine can build, the recorded ones included; and prints, per backend,
its status now (with the known bugs that explain it) beside the recorded one and whether its
output is bit-identical. It fails (exit 1) as ``difftest run`` would: on a new failure, not
on a result known bugs explain wholly.

A failure directory is data from elsewhere: a recorded backend name whose options name a path
(``triton-unified[vllm=<dir>]``, ``aiter=<dir>``) would import and run that path's Python.
Such names are replayed only when the command line names them again (``--backends``) or
trusts the directory (``--trust-recorded-paths``); otherwise the replay says what it skipped.
Plug-ins are only ever the command line's (``--plugin``), never the recording's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from difftest.case.casefile import CaseFileError, case_from_object, read_case_json
from difftest.case.spec import Case, CaseError
from difftest.primitives.text import printable
from difftest.results.artifacts import ArtifactStore, read_failure_case, read_results, repro_command
from difftest.results.records import CaseRecord, KnownBug, ResultRecord

REPLAYS = "replays"  # where difftest repro keeps its own artifacts, under --artifacts


def report_previous_crashes(root: str, found_by: str) -> list[CaseRecord]:
    """Turn cases left pending by dead processes (runs and replays) into crash artifacts,
    say so on stderr, and return their records."""
    records = []
    for store in (ArtifactStore(root), ArtifactStore(Path(root) / REPLAYS)):
        records += store.recover_crashes(f"found by {found_by} after the process died")
        for path, problem in store.damaged.items():
            print(f"WARNING damaged pending file {path}: {problem}; no crash can be recovered "
                  "from it: look at it, then delete it", file=sys.stderr)
    for record in records:
        print(f"CRASH case {record.case_id} (an earlier run died in it): replay with "
              f"{repro_command(record.artifact or '-', record.plugins or ())}",
              file=sys.stderr)
    return records


def load_source(path: Path) -> tuple[Case, dict[str, Any] | None, dict[str, Any] | None]:
    """``(case, recorded case entry, recorded fingerprint)`` from a failure directory, a case
    file or a pending file; :class:`~difftest.case.casefile.CaseFileError` names what is wrong."""
    if path.is_dir():
        recorded = path / "results.json"
        environment = path / "fingerprint.json"
        return (read_failure_case(path),
                read_results(recorded).to_dict() if recorded.is_file() else None,
                read_case_json(environment) if environment.is_file() else None)
    payload = read_case_json(path)
    if isinstance(payload, dict) and "case" in payload and "pid" in payload:  # a pending file
        try:
            return case_from_object(payload["case"]), None, payload.get("environment")
        except CaseError as exc:
            raise CaseFileError(f"{path}: case.{exc}") from exc
    try:
        return case_from_object(payload), None, None
    except CaseError as exc:
        raise CaseFileError(f"{path}: {exc}") from exc


def _environment_line(info: dict[str, Any]) -> str:
    versions = info.get("versions", {})
    device = info.get("gpu_arch") or ("cpu, Triton interpreted" if info.get("triton_interpret")
                                      else "cpu")
    parts = [device] + [f"{k} {versions[k]}" for k in ("torch", "triton", "vllm", "amd-aiter",
                                                       "aiter") if k in versions]
    if info.get("aiter_commit"):
        parts.append(f"aiter commit {info['aiter_commit']}")
    if info.get("triton_interpret") and info.get("omp_num_threads"):
        parts.append(f"OMP_NUM_THREADS={info['omp_num_threads']}")
    return ", ".join(parts)


def _short(digest: str | None) -> str:
    return digest[:12] if digest else "-"


def _ratio_text(entry: dict[str, Any]) -> str:
    return f"{entry['comparison']['max_ratio']:.4g}" if entry.get("comparison") else "-"


def path_options(name: str) -> list[str]:
    """The ``key=value`` options of backend ``name`` whose value names a path (a ``/``, or a
    leading ``.`` or ``~``): each would load code from there."""
    from difftest.contract import registry

    try:
        _, options = registry.parse_name(name)
    except registry.RegistryError:
        return []
    return [f"{key}={value}" for key, value in options.items()
            if "/" in value or "\\" in value or value.startswith((".", "~"))]


def replay_backends(recorded: dict[str, Any], plugins: Sequence[str], reference: str,
                    trust_paths: bool = False) -> tuple[list[str], dict[str, str]]:
    """Every installed backend, plus each recorded one this machine can build (a name with
    options, or one from a plug-in given with ``--plugin``), and the recorded ones left out
    with the reason: a name whose options name a path, unless ``trust_paths``."""
    from difftest.contract import registry

    installed = [b.name for b in registry.entry_point_backends()]
    known = registry.discover(plugins)
    names = [n for n in sorted(installed) if n != reference]
    skipped: dict[str, str] = {}
    for result in recorded.get("results", []):
        name = result["backend"]
        if name in names or name == reference:
            continue
        paths = path_options(name)
        if paths and not trust_paths:
            skipped[name] = (f"not run: its option {', '.join(paths)} names a path, whose "
                             "code the recording cannot vouch for; name it with --backends, or "
                             "pass --trust-recorded-paths, to run it")
            continue
        try:
            registry.select(known, [name])
        except registry.RegistryError:
            continue  # listed as "not run" with the hint to load its plug-in
        names.append(name)
    return names, skipped


def _known_text(result: dict[str, Any]) -> str:
    """``known bug F28 (rows 0..3)`` of a result entry, or ``""``."""
    record = ResultRecord.from_dict(result, "result")
    return record.known_bug.describe() if record.known_bug is not None else ""


def replay(path: Path, backend_names: list[str] | None, plugins: Sequence[str], device: str,
           reference: str, artifacts: str, report: str | None = None,
           trust_paths: bool = False) -> int:
    """Replay the case at ``path``, print what differs from the recording; 1 if a result is
    a new failure (one known bugs explain wholly is not); ``trust_paths``: replay recorded
    backends whose options name a path too.

    Raises :class:`~difftest.case.casefile.CaseFileError` (before anything is run or written) when
    ``path`` is not a readable case, failure directory or pending file.
    """
    from difftest.machine import devices
    from difftest.reporting.report import build_report, write_report
    from difftest.run.session import Session

    case, recorded, environment = load_source(path)
    names = backend_names
    skipped: dict[str, str] = {}
    if names is None and recorded:
        # the CPU runtime first: loading the backends imports vLLM, which decides then
        # whether Triton has a driver (the interpreter) or is a placeholder
        devices.prepare_runtime(devices.resolve(device))
        names, skipped = replay_backends(recorded, plugins, reference, trust_paths)
    session = Session.create(names, plugins, device, str(Path(artifacts) / REPLAYS), reference)
    report_previous_crashes(artifacts, "difftest repro")
    print(f"case {case.case_id} {printable(case.name)}".rstrip())
    if environment:
        print(f"  recorded on: {_environment_line(environment)}")
    print(f"  replayed on: {_environment_line(session.environment)}")
    result = session.run(case)
    replayed = session.records[-1]
    record = replayed.to_dict()
    recorded_results = {r["backend"]: r for r in (recorded or {}).get("results", [])}
    print(f"  {'backend':<24} {'status':<12} {'err/tol':<10} {'output':<13} recorded")
    for entry in record["results"]:
        was = recorded_results.get(entry["backend"])
        if was is None:
            verdict = ("not judged: the recorded run crashed first"
                       if entry["backend"] in (recorded or {}).get("unjudged", []) else "-")
        else:
            now, then = entry["output_sha256"], was.get("output_sha256")
            same = ("no output either time" if now is None and then is None
                    else "bit-identical" if now == then else "differs")
            known = _known_text(was)
            verdict = (f"{was['status']} {_ratio_text(was)} {_short(then)}: {same}"
                       + (f" (recorded as {known})" if known else ""))
        print(f"  {printable(entry['backend']):<24} {entry['status']:<12} "
              f"{_ratio_text(entry):<10} {_short(entry['output_sha256']):<13} {verdict}")
    for name, was in sorted(recorded_results.items()):
        if name not in {e["backend"] for e in record["results"]}:
            why = skipped.get(name, "pass --plugin/--backends to replay it")
            print(f"  {printable(name):<24} {'not run':<12} {'-':<10} {'-':<13} "
                  f"{was['status']} {_ratio_text(was)} ({why})")
    for outcome in replayed.results:
        if outcome.known_bug is not None:
            print(f"  {printable(outcome.backend)}: {_known_line(outcome.known_bug)}")
    # Why, or a refusal reads as a silent skip; an unavailable backend's reason where
    # --backends named it (`difftest backends` gives every reason).
    for entry in record["results"]:
        if entry["status"] == "unsupported" or (entry["status"] == "unavailable"
                                                and backend_names is not None):
            print(f"  {entry['backend']}: {entry['status']}: {entry['detail']}")
    for message in result.failure_messages():
        print(message)
    if result.artifact:
        print(f"replay artifacts: {result.artifact}")
    if report:
        config = session.config() | {"runner": "difftest repro", "source": str(path)}
        write_report(report, build_report(session.records, session.backend_entries(),
                                          config, session.environment))
    return 1 if replayed.new_failures else 0


def _known_line(known: KnownBug) -> str:
    """What a replayed result's known bugs mean for the replay's verdict."""
    if known.new_failure:
        return f"{known.describe()} (a new failure)"
    return (f"{known.describe()} (docs/findings.md {', '.join(known.names)}; not a new "
            "failure)")
