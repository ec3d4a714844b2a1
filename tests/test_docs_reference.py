"""The repository reads as reference: no work journal, no path of one machine.

Every tracked text file is searched for the markers of a journal of who did what when (work
sessions, helpers, a lead, engineers, agents (not Buildkite's ``agents:`` key), "not in git")
and for absolute paths outside the repository (``/work``, ``/tmp``, ``/home``, ``/root``,
``/Users``). The reference pages name what is measured, the command and the machine; history
is git's.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JOURNAL = re.compile(
    r"\bsessions? \d+\b|\bsessions? of 20\d\d|\bhelper [A-Z]\b|\bhelpers'|\bthe lead('s)?\b"
    r"|\bengineers?\b|\bintegrators?\b|\bagents\b(?!:)|\bnot in git\b|\bat filing\b"
    r"|\bwork periods?\b", re.IGNORECASE)
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp|home|root|Users)/")
SELF = Path(__file__).relative_to(ROOT).as_posix()


def tracked_text_files() -> list[Path]:
    """The repository's tracked files that are text (this file's patterns excepted)."""
    try:
        listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                                 check=True, timeout=60).stdout.decode()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout ({exc})")
    files = []
    for name in filter(None, listing.split("\0")):
        path = ROOT / name
        if name == SELF or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" not in data[:8192]:
            files.append(path)
    return files


def hits(pattern: re.Pattern[str]) -> list[str]:
    found = []
    for path in tracked_text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    return found


def test_no_file_reads_as_a_work_journal() -> None:
    found = hits(JOURNAL)
    assert not found, "journal markers:\n" + "\n".join(found)


def test_no_file_names_a_path_outside_the_repository() -> None:
    found = hits(MACHINE_PATH)
    assert not found, "paths of one machine:\n" + "\n".join(found)


def test_the_patterns_catch_what_they_are_for() -> None:
    for line in ("Session 9 (2026-12-04)", "helper B's commit", "the lead's job",
                 "shared with three other agents", "scripts (not in git)"):
        assert JOURNAL.search(line), line
    for line in ("see /work/notes/S3.md", "--report /tmp/doc2/r.json", "/home/me/x"):
        assert MACHINE_PATH.search(line), line
    for line in ("difftest.run.session.Session", "a helper function", "deadline=None",
                 "~/.cache/difftest/vllm", "/sys/class/kfd", "scratch/tmp/x"):
        assert not JOURNAL.search(line) and not MACHINE_PATH.search(line), line
