"""Strict JSON files: non-finite numbers as strings, atomic replacement, clear read errors."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess

import pytest

from difftest.primitives import jsonfile
from difftest.primitives.jsonfile import (
    JSONFileError,
    append_json_line,
    number,
    read_json,
    read_json_lines,
    write_json,
)

VALUE = {"max_ratio": math.inf, "worst": [{"actual": math.nan, "error": -math.inf}],
         "name": "NaN", "n": 3}


def _strict(text: str) -> object:
    """Parse as RFC 8259 JSON: Python's ``NaN``/``Infinity`` extensions are an error."""
    def refuse(token: str) -> object:
        raise ValueError(f"non-standard token {token}")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_written_as_strings_a_strict_parser_accepts(tmp_path) -> None:
    path = write_json(tmp_path / "r.json", VALUE)
    assert _strict(path.read_text()) == {"max_ratio": "Infinity", "n": 3, "name": "NaN",
                                  "worst": [{"actual": "NaN", "error": "-Infinity"}]}
    assert number("Infinity", "f") == math.inf and number("-Infinity", "f") == -math.inf
    assert math.isnan(number("NaN", "f")) and number(2, "f") == 2.0


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq is not installed on this machine")
def test_jq_reads_a_file_with_non_finite_numbers(tmp_path) -> None:
    path = write_json(tmp_path / "r.json", VALUE)
    done = subprocess.run(["jq", "-c", ".worst[0].actual", str(path)], capture_output=True,
                          text=True, check=True)
    assert done.stdout.strip() == '"NaN"'


@pytest.mark.parametrize("value", ["inf", "nan", None, True, [1.0]])
def test_a_numeric_field_of_another_kind_is_an_error_naming_it(value) -> None:
    with pytest.raises(ValueError, match=r"^r\.json: cases\[0\]\.x: expected a number"):
        number(value, "r.json: cases[0].x")


def test_old_files_with_bare_tokens_still_read(tmp_path) -> None:
    path = tmp_path / "old.json"
    path.write_text('{"max_ratio": Infinity, "error": -Infinity, "actual": NaN}')
    old = read_json(path)
    assert old["max_ratio"] == math.inf and old["error"] == -math.inf
    assert math.isnan(old["actual"])


def test_a_truncated_file_is_an_error_naming_the_file(tmp_path) -> None:
    good = write_json(tmp_path / "r.json", VALUE)
    cut = tmp_path / "cut.json"
    text = good.read_text()
    for end in range(1, len(text) - 2):  # a write killed after any byte
        cut.write_text(text[:end])
        with pytest.raises(JSONFileError,
                           match=rf"^{re.escape(str(cut))}: not JSON: .* the file looks truncated"):
            read_json(cut)
    cut.write_text("hello")
    with pytest.raises(JSONFileError, match=r"cut\.json: not JSON: Expecting value") as error:
        read_json(cut)
    assert not str(error.value).endswith("looks truncated")
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(JSONFileError, match=r"empty\.json: empty"):
        read_json(tmp_path / "empty.json")
    with pytest.raises(JSONFileError, match=r"missing\.json: cannot read"):
        read_json(tmp_path / "missing.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(JSONFileError, match=r"bin\.json: not JSON \(not UTF-8"):
        read_json(tmp_path / "bin.json")


def test_a_write_killed_before_the_rename_leaves_the_previous_file(tmp_path, monkeypatch) -> None:
    path = write_json(tmp_path / "r.json", {"version": 1})
    before = path.read_text()

    def killed(src: str, dst: str) -> None:
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_json(path, {"version": 2, "big": list(range(10_000))})
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary left


def test_a_value_that_cannot_be_encoded_leaves_the_previous_file(tmp_path) -> None:
    path = write_json(tmp_path / "r.json", {"version": 1})
    with pytest.raises(TypeError):
        write_json(path, {"version": 2, "bad": object()})
    assert read_json(path) == {"version": 1}


def test_a_write_that_fails_midway_leaves_the_previous_file(tmp_path, monkeypatch) -> None:
    path = write_json(tmp_path / "r.json", {"version": 1})
    real_fsync = os.fsync

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(jsonfile.os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_json(path, {"version": 2})
    monkeypatch.setattr(jsonfile.os, "fsync", real_fsync)
    assert read_json(path) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_json_lines_are_strict_and_errors_name_the_line(tmp_path) -> None:
    log = tmp_path / "runs" / "gw0.jsonl"
    append_json_line(log, {"kind": "case", "ratio": math.inf})
    append_json_line(log, {"kind": "case", "ratio": 0.5})
    assert [_strict(line) for line in log.read_text().splitlines()] == [
        {"kind": "case", "ratio": "Infinity"}, {"kind": "case", "ratio": 0.5}]
    assert read_json_lines(log)[1] == {"kind": "case", "ratio": 0.5}
    with open(log, "a") as fh:
        fh.write('{"kind": "ca')
    with pytest.raises(JSONFileError, match=r"gw0\.jsonl line 3: not JSON"):
        read_json_lines(log)
