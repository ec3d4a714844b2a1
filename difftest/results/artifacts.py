"""Where cases and failures live on disk, so nothing is lost when a process dies.

``begin`` writes the case to ``<root>/pending/<case_id>.<pid>.json`` (fsynced) before any kernel
runs, and :meth:`ArtifactStore.running` notes beside it, in ``<case_id>.<pid>.running`` (a few
bytes, fsynced: rewriting the case for every backend cost milliseconds at production shape),
which backend is running. ``finish``
removes it and, when a backend failed, leaves ``<root>/failures/<case_id>/`` with

* ``case.json``: the case (``difftest repro`` replays it),
* ``results.json``: the case's record (:class:`difftest.results.records.CaseRecord`), with a sha256
of
  every backend's output so a replay can be checked bit for bit,
* ``fingerprint.json``: the environment of the process that ran it,
* ``repro.txt``: the command that replays it, the one that exports its kernel call as a
  script for upstream, and the one that pins it into the corpus.

A pending file that outlives its process is a crash: :meth:`ArtifactStore.crashed` finds them
and :meth:`ArtifactStore.record_crash` turns one into a failure directory with status
``crash``.

Every file is strict JSON written atomically (:mod:`difftest.primitives.jsonfile`): a process killed
mid-write leaves the previous file or none, never a part.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from difftest.case.casefile import CaseFileError, case_from_object, read_case
from difftest.case.spec import Case, CaseError
from difftest.machine.fingerprint import fingerprint
from difftest.primitives.jsonfile import (
    JSONFileError,
    read_bounded,
    read_json,
    write_json,
    write_text,
)
from difftest.results.features import case_features
from difftest.results.records import CaseRecord, RecordError, ResultRecord, Status

DEFAULT_ROOT = "difftest-artifacts"
_RUNNING_BYTES = 4096  # a backend name


def repro_command(path: Path | str, plugins: Iterable[str] = ()) -> str:
    """The command that replays an artifact directory or case file (with the plug-ins that
    provided its backends), shell-quoted: pasting it runs exactly that."""
    words = ["difftest", "repro", str(path)]
    for plugin in plugins:
        words += ["--plugin", plugin]
    return shlex.join(words)


def export_command(path: Path | str, plugins: Iterable[str] = ()) -> str:
    """The command that writes a failure directory's kernel call as a script that runs
    without difftest (``difftest export``), shell-quoted."""
    words = ["difftest", "export", str(path)]
    for plugin in plugins:
        words += ["--plugin", plugin]
    return shlex.join(words)


def promote_command(path: Path | str, name: str = "NAME") -> str:
    """The command that pins the case of an artifact directory into the corpus (quoted)."""
    return shlex.join(["difftest", "promote", str(path), name])


def output_digest(output: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (equal digests: bit-identical outputs)."""
    data = output.detach().contiguous().cpu()
    digest = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
    digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


@dataclass(frozen=True)
class PendingCase:
    """A case a process began and had not finished."""

    path: Path
    case: Case
    backends: tuple[str, ...]
    pid: int
    host: str
    pid_domain: str
    running: str | None
    environment: dict[str, Any]
    plugins: tuple[str, ...] = ()


class ArtifactStore:
    """Case and failure files under ``root`` (one per process is fine; names never clash).

    ``environment`` is the fingerprint written with every pending case and failure (default:
    this process's, computed when needed); ``plugins`` go into the replay commands.
    """

    def __init__(self, root: Path | str = DEFAULT_ROOT,
                 environment: dict[str, Any] | None = None,
                 plugins: tuple[str, ...] = ()) -> None:
        self.root = Path(root)
        self.plugins = plugins
        self.pending_dir = self.root / "pending"
        self.failures_dir = self.root / "failures"
        self.environment = environment
        self._in_flight: dict[str, dict[str, Any]] = {}
        self._outputs: dict[str, dict[str, str]] = {}
        self.damaged: dict[Path, str] = {}  # pending files :meth:`pending` could not read

    def _pending_path(self, case: Case) -> Path:
        return self.pending_dir / f"{case.case_id}.{os.getpid()}.json"

    def _running_path(self, case: Case) -> Path:
        return running_path(self._pending_path(case))

    def _write_pending(self, case: Case) -> Path:
        # One line: indenting a production case's 8192 table entries doubled the encoding
        # (Python's encoder is C only without indent); crash recovery reads it as JSON.
        return write_json(self._pending_path(case), self._in_flight[case.case_id], indent=None)

    def begin(self, case: Case, backends: list[str]) -> Path:
        """Write the case to disk (fsynced) before it runs; ``backends[0]`` is the reference."""
        self.pending_dir.mkdir(parents=True, exist_ok=True)
        self._outputs[case.case_id] = {}
        self._in_flight[case.case_id] = {
            "case": case.to_dict(), "backends": backends, "pid": os.getpid(),
            "host": platform.node(), "pid_domain": pid_domain(), "running": None,
            "environment": self.environment if self.environment is not None else fingerprint(),
            "plugins": list(self.plugins),
        }
        return self._write_pending(case)

    def case_dict(self, case: Case) -> dict[str, Any] | None:
        """``case.to_dict()`` as :meth:`begin` wrote it (``None`` when ``case`` is not in
        flight), so the record need not serialise the case again."""
        in_flight = self._in_flight.get(case.case_id)
        return None if in_flight is None else in_flight["case"]

    def running(self, case: Case, backend: str) -> None:
        """Note on disk that ``backend`` now runs ``case`` (a crash is then attributed to it).

        Not fsynced: the note survives any crash of this process, which is what attribution
        needs; after a crash of the whole machine the case itself is still on disk (begin
        fsyncs it) but may be attributed to no backend. One fsync per case instead of one per
        backend (each 1 to 6 ms)."""
        if case.case_id in self._in_flight:
            self._in_flight[case.case_id]["running"] = backend
            write_text(self._running_path(case), backend, durable=False)

    def record_output(self, case: Case, backend: str, output: torch.Tensor) -> str:
        """Keep the digest of ``backend``'s output on ``case`` for its results."""
        digest = output_digest(output)
        self._outputs.setdefault(case.case_id, {})[backend] = digest
        return digest

    def outputs(self, case: Case) -> dict[str, str]:
        """Output digests recorded for ``case``, by backend."""
        return dict(self._outputs.get(case.case_id, {}))

    def finish(self, case: Case, record: CaseRecord) -> str | None:
        """Drop ``case``'s pending file; when ``record`` failed, write the failure directory,
        set ``record.artifact`` to it and return it."""
        in_flight = self._in_flight.pop(case.case_id, None)
        try:
            if record.failed:
                environment = in_flight["environment"] if in_flight else fingerprint()
                record.artifact = str(self.write_failure(case, record, environment))
        finally:  # the case ended (an unwritable failure directory is no crash of a backend)
            self._running_path(case).unlink(missing_ok=True)
            self._pending_path(case).unlink(missing_ok=True)
        return record.artifact

    def abandon(self) -> list[tuple[str, str | None]]:
        """Forget every case in flight (the run was interrupted, so they neither finished nor
        crashed): their pending files go, so no later run blames a backend. Returns each
        case id with the stage that was running (``None``: before any)."""
        left = []
        for case_id, in_flight in list(self._in_flight.items()):
            pending = self.pending_dir / f"{case_id}.{os.getpid()}.json"
            running_path(pending).unlink(missing_ok=True)
            pending.unlink(missing_ok=True)
            left.append((case_id, in_flight["running"]))
            del self._in_flight[case_id]
        return left

    def write_failure(self, case: Case, record: CaseRecord, environment: dict[str, Any],
                      plugins: tuple[str, ...] | None = None) -> Path:
        """``failures/<case_id>/`` with case.json, results.json, fingerprint.json, repro.txt
        (each written atomically); the replay command names ``plugins`` (default: this
        store's)."""
        directory = self.failures_dir / case.case_id
        record.artifact = str(directory)
        write_text(directory / "case.json", case.to_json() + "\n")
        write_json(directory / "results.json", record.to_dict())
        write_json(directory / "fingerprint.json", environment)
        plugins = self.plugins if plugins is None else plugins
        write_text(directory / "repro.txt",
            f"{repro_command(directory, plugins)}\n"
            "# the failing kernel call as a script for its maintainers (torch and the "
            "kernel's package only):\n"
            f"{export_command(directory, plugins)}\n"
            "# once fixed, pin it into the regression corpus:\n"
            f"{promote_command(directory)}\n")
        return directory

    def pending(self) -> list[PendingCase]:
        """Every pending case on disk (any process, any host). A file that cannot be read
        as one (damaged, foreign, of another version) goes to :attr:`damaged` with the
        reason, for the caller to report; one removed by its owner meanwhile is gone."""
        found: list[PendingCase] = []
        if not self.pending_dir.is_dir():
            return found
        for path in sorted(self.pending_dir.glob("*.json")):
            try:
                found.append(read_pending(path))
            except JSONFileError as exc:
                if path.exists():  # else finished by its owner right now
                    self.damaged[path] = str(exc)
        return found

    def crashed(self, pids: set[int] | None = None) -> list[PendingCase]:
        """Pending cases whose process is gone (or of ``pids``, known dead).

        Only cases written in this process's pid namespace are judged: a pid seen from
        another machine or container sharing the directory says nothing here.
        """
        domain = pid_domain()
        return [p for p in self.pending() if p.pid_domain in ("", domain) and (
            p.pid in pids if pids is not None else not pid_alive(p.pid))]

    def record_crash(self, pending: PendingCase, detail: str) -> CaseRecord:
        """Turn a dead process's pending case into a failure directory with status crash."""
        reference, *under_test = pending.backends
        if pending.running in under_test:
            crashed = [pending.running]
            where = f"while {pending.running} ran"
        else:
            crashed = under_test
            stage = pending.running or "input generation"
            where = f"in {stage}, before the backends under test ran"
        record = CaseRecord(
            case_id=pending.case.case_id, name=pending.case.name, case=pending.case.to_dict(),
            features=case_features(pending.case), reference=reference,
            results=[ResultRecord(name, Status.CRASH, detail=f"the process died {where}: "
                                  f"{detail}") for name in crashed],
            unjudged=[n for n in under_test if n not in crashed],
            plugins=list(pending.plugins))
        self.write_failure(pending.case, record, pending.environment, pending.plugins)
        running_path(pending.path).unlink(missing_ok=True)
        pending.path.unlink(missing_ok=True)
        return record

    def recover_crashes(self, detail: str, pids: set[int] | None = None) -> list[CaseRecord]:
        """:meth:`record_crash` every :meth:`crashed` case; ``detail`` says how it was found."""
        return [self.record_crash(p, f"{detail} (pid {p.pid} on {p.host or 'this host'})")
                for p in self.crashed(pids)]


def running_path(pending: Path) -> Path:
    """The file beside a pending case that names the backend running it."""
    return pending.with_suffix(".running")


def read_pending(path: Path | str) -> PendingCase:
    """A pending file, with the backend its ``.running`` sibling names (if any);
    :class:`JSONFileError` names the file and the field that is wrong."""
    payload = read_json(path)
    sibling = running_path(Path(path))
    running: str | None = None
    if sibling.exists():
        try:
            running = read_bounded(sibling, _RUNNING_BYTES).strip() or None
        except JSONFileError as exc:
            raise JSONFileError(f"{exc} (the backend note of pending case {path})") from exc
    if not isinstance(payload, dict):
        raise JSONFileError(f"{path}: not a pending case file (a JSON object expected)")
    try:
        backends = payload["backends"]
        if not (isinstance(backends, list) and backends
                and all(isinstance(b, str) for b in backends)):
            raise ValueError(f"backends: {backends!r:.80} (allowed: a non-empty list of "
                             "names, the reference first)")
        if isinstance(payload["pid"], bool) or not isinstance(payload["pid"], int):
            raise ValueError(f"pid: {payload['pid']!r:.40} (allowed: an integer)")
        plugins = payload.get("plugins", [])
        if not (isinstance(plugins, list) and all(isinstance(x, str) for x in plugins)):
            raise ValueError(f"plugins: {plugins!r:.80} (allowed: a list of strings)")
        environment = payload.get("environment") or {}
        if not isinstance(environment, dict):
            raise ValueError("environment: not a JSON object")
        return PendingCase(
            Path(path), case_from_object(payload["case"]), tuple(backends), payload["pid"],
            str(payload.get("host", "")), str(payload.get("pid_domain", "")),
            running or payload.get("running"), environment, tuple(plugins))
    except KeyError as exc:
        raise JSONFileError(f"{path}: field {exc.args[0]!r} missing: not a pending case "
                            "file") from exc
    except (CaseError, TypeError, ValueError) as exc:
        raise JSONFileError(f"{path}: not a pending case file: {exc}") from exc


def read_failure_case(directory: Path) -> Case:
    """The case of a failure directory (``case.json``), checked against the record beside it
    (``results.json``, when present): a directory whose two files hold different cases is
    refused with :class:`~difftest.case.casefile.CaseFileError` naming both."""
    case = read_case(directory / "case.json")
    recorded = directory / "results.json"
    if recorded.exists():
        try:
            record = read_results(recorded)
        except (JSONFileError, RecordError) as exc:
            raise CaseFileError(str(exc)) from exc
        if record.case_id != case.case_id:
            raise CaseFileError(f"{directory}: case.json holds case {case.case_id} but "
                                f"results.json records case {record.case_id} (a damaged or "
                                "hand-assembled failure directory: restore one of them)")
    return case


def read_results(path: Path | str) -> CaseRecord:
    """A failure directory's ``results.json`` read back; :class:`RecordError` (or
    :class:`JSONFileError`) names the file and the field that is wrong."""
    try:
        return CaseRecord.from_dict(read_json(path), "")
    except RecordError as exc:
        raise RecordError(f"{path}: {exc}") from exc


def pid_domain() -> str:
    """Where this process's pid means something: host, boot and pid namespace."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        boot = namespace = ""
    return f"{platform.node()}/{boot}/{namespace}"


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")
