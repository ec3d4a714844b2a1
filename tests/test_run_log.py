"""The pytest run log: a worker killed mid-append loses only the line it was writing."""

from __future__ import annotations

from pathlib import Path

import pytest

from difftest.frontends.pytest_run import RunLog
from difftest.primitives.jsonfile import JSONFileError


def test_a_cut_last_line_is_dropped_and_the_complete_lines_kept(tmp_path: Path) -> None:
    log = RunLog(tmp_path, "gw0")
    log.write("worker", pid=1)
    log.write("case", record={"error": float("inf")})
    with open(log.path, "a") as fh:
        fh.write('{"kind": "case", "writer": "gw0", "rec')  # the process died here
    lines = RunLog.read(tmp_path)
    assert [line["kind"] for line in lines] == ["worker", "case"]
    assert lines[1]["record"] == {"error": "Infinity"}


def test_a_damaged_complete_line_names_the_file_and_line(tmp_path: Path) -> None:
    log = RunLog(tmp_path, "gw1")
    log.write("worker", pid=1)
    with open(log.path, "a") as fh:
        fh.write("not json\n")
    with pytest.raises(JSONFileError, match=r"gw1\.jsonl line 2"):
        RunLog.read(tmp_path)
