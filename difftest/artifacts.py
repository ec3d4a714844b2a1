"""Where cases and failures live on disk, so nothing is lost when a process dies.

``begin`` writes the case to ``<root>/pending/`` before any kernel runs; ``finish`` removes it
and, when a backend failed, leaves ``<root>/failures/<case_id>/`` with the case, the per-backend
results, the environment fingerprint and the one command that replays it. A pending file
that outlives its process is a crash: :meth:`ArtifactStore.crashed` finds them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from difftest.case import Case
from difftest.fingerprint import fingerprint

if TYPE_CHECKING:
    from difftest.runner import CaseResult

DEFAULT_ROOT = "difftest-artifacts"


def repro_command(path: Path | str) -> str:
    """The command that replays an artifact directory or case file."""
    return f"difftest repro {path}"


@dataclass(frozen=True)
class PendingCase:
    """A case whose process died before finishing it."""

    path: Path
    case: Case
    backends: tuple[str, ...]
    pid: int


class ArtifactStore:
    """Case and failure files under ``root`` (one per process is fine; names never clash)."""

    def __init__(self, root: Path | str = DEFAULT_ROOT) -> None:
        self.root = Path(root)
        self.pending_dir = self.root / "pending"
        self.failures_dir = self.root / "failures"

    def _pending_path(self, case: Case) -> Path:
        return self.pending_dir / f"{case.case_id}.{os.getpid()}.json"

    def begin(self, case: Case, backends: list[str]) -> Path:
        """Write the case to disk (fsynced) before it runs."""
        self.pending_dir.mkdir(parents=True, exist_ok=True)
        path = self._pending_path(case)
        payload = {"case": case.to_dict(), "backends": backends, "pid": os.getpid()}
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as fh:
            json.dump(payload, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(path)
        return path

    def finish(self, result: CaseResult) -> str | None:
        """Drop the pending file; on failure write the failure directory and return it."""
        artifact = None
        if result.failed:
            artifact = str(self.write_failure(result.case, result.to_dict()))
        self._pending_path(result.case).unlink(missing_ok=True)
        return artifact

    def write_failure(self, case: Case, results: dict[str, Any]) -> Path:
        """``failures/<case_id>/`` with case.json, results.json, fingerprint.json, repro.txt."""
        directory = self.failures_dir / case.case_id
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "case.json").write_text(case.to_json())
        (directory / "results.json").write_text(json.dumps(results, indent=1))
        (directory / "fingerprint.json").write_text(json.dumps(fingerprint(), indent=1))
        (directory / "repro.txt").write_text(repro_command(directory) + "\n")
        return directory

    def crashed(self, alive: set[int] | None = None) -> list[PendingCase]:
        """Pending cases whose process is gone (``alive``: pids known to still run)."""
        found = []
        if not self.pending_dir.is_dir():
            return found
        for path in sorted(self.pending_dir.glob("*.json")):
            payload = json.loads(path.read_text())
            pid = int(payload["pid"])
            if (alive is not None and pid in alive) or (alive is None and _pid_alive(pid)):
                continue
            found.append(PendingCase(path, Case.from_dict(payload["case"]),
                                     tuple(payload["backends"]), pid))
        return found


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
