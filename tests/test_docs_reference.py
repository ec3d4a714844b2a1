"""The repository reads as reference: no work journal, no path of one machine.

Every tracked text file is searched for the markers of a journal of who did what when (work
sessions, helpers, a lead, engineers, agents (not Buildkite's ``agents:`` key), "not in git",
a date with the time of day it was worked on, how a number moved since an earlier run) and
for absolute paths outside the repository (``/work``, ``/tmp``, ``/home``, ``/root``,
``/Users``); every tracked Markdown file for headings dated or titled by an issue. The
reference pages name what is measured, the command and the machine; history is git's. A
date as a fact (when a release was published, a report's ``created`` field) is fine.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JOURNAL = re.compile(
    r"\bsessions? \d+\b|\bsessions? of 20\d\d|\bsession-\d+\b|\bhelper [A-Z]\b|\bhelpers'"
    r"|\bhelper's\b|\bthe lead('s)?\b|\bengineers?\b|\bintegrators?\b|\bagents\b(?!:)"
    r"|\bnot in git\b|\bat filing\b|\bwork periods?\b"
    # a day's work: a date with the time of day, or a dated list item
    r"|\b20\d\d-\d\d-\d\d,? (?:morning|afternoon|evening|night)\b|^\s*[*-] \(20\d\d-\d\d-\d\d\)"
    # how numbers moved: an earlier run's figure set beside the latest
    r"|\bmeasured just before\b|\ban earlier timing\b|\bthe earlier native runs\b"
    r"|\bfigure before\b|\bnot been run since\b|\bfor lack of time\b", re.IGNORECASE)
# a Markdown heading that carries a date or names an issue ("## Shrinking (issue 13), 2026-12-03")
JOURNAL_HEADING = re.compile(r"^#{1,6}\s.*(?:\b20\d\d-\d\d-\d\d\b|\bissue \d+)", re.IGNORECASE)
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


def hits(pattern: re.Pattern[str], suffix: str = "") -> list[str]:
    """Every line of the tracked text files (those whose name ends in ``suffix``) that
    ``pattern`` matches, as ``path:line: text``."""
    found = []
    for path in tracked_text_files():
        if not path.name.endswith(suffix):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    return found


def test_no_file_reads_as_a_work_journal() -> None:
    found = hits(JOURNAL)
    assert not found, "journal markers:\n" + "\n".join(found)


def test_no_heading_is_dated_or_titled_by_an_issue() -> None:
    found = hits(JOURNAL_HEADING, ".md")
    assert not found, "headings of a journal:\n" + "\n".join(found)


def test_no_file_names_a_path_outside_the_repository() -> None:
    found = hits(MACHINE_PATH)
    assert not found, "paths of one machine:\n" + "\n".join(found)


def test_the_patterns_catch_what_they_are_for() -> None:
    for line in ("Session 9 (2026-12-04)", "helper B's commit", "the lead's job",
                 "shared with three other agents", "scripts (not in git)",
                 "Fix (2026-12-03, evening): the weight term is `expm1(2 delta)`",
                 "* (2026-12-03) Every structural choice is a Hypothesis draw",
                 "output is not this helper's to interpret and is recorded as measured",
                 "6 min 41 s for the tree without the serving terms measured just before",
                 "## An earlier timing: the two `triton-unified` pairs only (2-core CPU)",
                 "was the idle box's figure before.", "The session-3 record was 10 min 46 s",
                 "(not investigated for lack of time)",
                 "the full benchmark has not been run since."):
        assert JOURNAL.search(line), line
    for line in ("## F17: which inputs reach the products unrounded (2026-12-03, evening)",
                 "### CPU (2 cores, the CI machine's kind), 2026-12-02",
                 "## Shrinking: block tables and selections (issue 13), 2026-12-03",
                 "## Parameter coverage (issue 10 item 1)"):
        assert JOURNAL_HEADING.search(line), line
    for line in ("see /work/notes/S3.md", "--report /tmp/doc2/r.json", "/home/me/x"):
        assert MACHINE_PATH.search(line), line
    for line in ("difftest.run.session.Session", "a helper function", "deadline=None",
                 "~/.cache/difftest/vllm", "/sys/class/kfd", "scratch/tmp/x",
                 '  "created": "2026-12-02T14:23:26Z",', "vLLM 0.34.0 (published 2026-11-20)",
                 "## F28: `kernel_paged_attention_2d` loads the tokens before its window (open)"):
        assert not JOURNAL.search(line) and not MACHINE_PATH.search(line), line
        assert not JOURNAL_HEADING.search(line), line
