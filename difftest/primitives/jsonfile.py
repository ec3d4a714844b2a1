"""Strict JSON (RFC 8259) files, written atomically, and checked reading.

Python's ``json`` writes non-finite floats as the bare tokens ``Infinity``, ``-Infinity`` and
``NaN``, which strict parsers (jq, browsers) reject. :func:`write_json` writes them as the
strings ``"Infinity"``, ``"-Infinity"`` and ``"NaN"`` instead (docs/report-schema.md,
"Strict JSON"); the readers of numeric fields turn them back with :func:`number`.
:func:`read_json` still accepts the bare tokens, so reports written before read as before.

Every file read here is untrusted: only a regular file is read (a FIFO would block, a device
such as ``/dev/zero`` never ends), at most :data:`MAX_BYTES` of it, its JSON may nest at most
:data:`MAX_DEPTH` deep (deeper would reach Python's recursion limit in the parser or in the
readers after it), and parsing it may take at most :data:`MAX_PARSE_FACTOR` times its size in
memory (:func:`check_parse_cost`: Python's objects for ``[[],[],...]`` take 21 times the
text, so a file at the size cap could take 23 GB); each refusal is a :class:`JSONFileError`
naming the file. Numbers are parsed into shared objects (an id that recurs in every case is
one ``int``), which keeps a report's parse near twice its size.

:func:`write_json` (and :func:`write_text`) write the whole text to a temporary file in the
target's directory, fsync it and rename it over the target: a reader, or a process killed
mid-write, sees the old file or the new one, never a part. :func:`append_json_line` adds one
strict line to a JSON-lines log.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

NONFINITE = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}
MAX_BYTES = 1 << 30  # a report of thousands of production-shape cases is tens of MB
MAX_DEPTH = 64  # reports nest 8 deep
# Memory a parse may take, as a multiple of the text's length: difftest's reports and logs
# estimate 3.8 (indented) to 5.5 (compact), and take 2 to 3 (tests/test_bad_input.py)
MAX_PARSE_FACTOR = 10
# Upper estimates of what a parsed value costs beyond its text (CPython 3.11, 64-bit): an
# array or object with its table, a string object, a slot in its container
_CONTAINER_BYTES, _STRING_BYTES, _SLOT_BYTES = 100, 50, 8
_PARSE_ALLOWANCE = 1 << 20  # bytes any text may take besides (small files are never refused)
_CHUNK = 1 << 16  # bytes read at a time past the size a file had when opened (a read
# allocates all it asks for first)
# a string (its escapes unrolled: twice as fast as an alternation per character), or a run of
# text without brackets or quotes
_STRINGS_OR_TEXT = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[^\[\]{}"]+')


class JSONFileError(ValueError):
    """A JSON file cannot be read: missing, unreadable, empty, truncated or not JSON."""


def encode_nonfinite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by its string name (recursively)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: encode_nonfinite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode_nonfinite(v) for v in value]
    return value


def dumps(value: Any, indent: int | None = None) -> str:
    """RFC 8259 JSON text of ``value``, non-finite floats as their string names.

    Most values have no non-finite float: they are encoded as they are, without the copy
    :func:`encode_nonfinite` makes (14 ms for a production case's record); the encoder
    refuses a non-finite float (``allow_nan=False``), and only then is the value copied
    with the names in place. Both paths give the same text (tests/test_jsonfile.py).
    """
    try:
        return json.dumps(value, allow_nan=False, indent=indent)
    except ValueError:  # a non-finite float (or a circular value, which fails again below)
        return json.dumps(encode_nonfinite(value), allow_nan=False, indent=indent)


def number(value: Any, where: str) -> float:
    """A numeric field's value: a JSON number, or one of the strings of :data:`NONFINITE`.

    Raises ``ValueError`` naming ``where`` (the file and the field) for anything else.
    """
    if isinstance(value, str) and value in NONFINITE:
        return NONFINITE[value]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: expected a number (or one of "
                         f"{', '.join(map(repr, NONFINITE))}), got {value!r:.80}")
    return float(value)


def write_text(path: Path | str, text: str, durable: bool = True) -> Path:
    """Replace ``path`` by a file holding ``text``, atomically (temporary file in the same
    directory, fsync, rename); the directory is created when missing. ``durable=False``
    skips the fsync: the file then survives a crash of this process (the kernel holds it)
    but not necessarily one of the machine."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:  # name the file asked for, not the temporary one
        raise OSError(exc.errno, f"cannot write {target}: {exc.strerror}") from exc
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would ignore the user's umask
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, target)
    except OSError as exc:  # disk full, file too large: name the file asked for
        Path(tmp).unlink(missing_ok=True)
        raise OSError(exc.errno, f"cannot write {target}: {exc.strerror}") from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _umask() -> int:
    """This process's umask, read without changing it where Linux shows it (changing it
    briefly would race with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_writable(path: Path | str, directory: bool = False) -> None:
    """Raise ``OSError`` naming ``path`` when a file could not be written there (read-only
    location, no permission), found by creating and removing a file in the nearest existing
    directory: before a run, not after its last case. ``directory``: ``path`` is a directory
    files will be written in."""
    target = Path(path).absolute()
    where = target if directory else target.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        fd, probe = tempfile.mkstemp(dir=where, prefix=".difftest-probe-")
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write {path} ({exc.strerror} in {where})") from exc
    os.close(fd)
    os.unlink(probe)


def write_json(path: Path | str, value: Any, indent: int | None = 1) -> Path:
    """:func:`write_text` of the strict JSON of ``value`` and a final newline.

    The text is built before the file is touched, so a value that cannot be encoded leaves
    the previous file as it was.
    """
    return write_text(path, dumps(value, indent) + "\n")


def append_json_line(path: Path | str, value: Any) -> None:
    """Append ``value`` as one strict JSON line to ``path`` (flushed; directory created)."""
    line = dumps(value) + "\n"
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "a") as fh:
        fh.write(line)


def nesting_depth(text: str) -> int:
    """How deep the arrays and objects of JSON ``text`` nest (brackets inside strings do not
    count), without parsing it."""
    brackets = np.frombuffer(_STRINGS_OR_TEXT.sub("", text).encode("ascii"), dtype=np.uint8)
    if not brackets.size:
        return 0
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1).astype(np.int32)
    return max(int(np.cumsum(steps, dtype=np.int32).max()), 0)


def parse_cost(text: str) -> int:
    """An upper estimate of the memory (bytes) that parsing JSON ``text`` takes, the text
    included, from counts of its brackets, quotes and commas (no parse)."""
    containers = text.count("[") + text.count("{")
    return (sys.getsizeof(text) + _CONTAINER_BYTES * containers
            + _STRING_BYTES * (text.count('"') // 2) + _SLOT_BYTES * text.count(","))


def check_parse_cost(text: str, where: str) -> None:
    """:class:`JSONFileError` naming ``where`` when parsing ``text`` would take more than
    :data:`MAX_PARSE_FACTOR` times its length, plus a MiB (:func:`parse_cost`): checked before
    parsing."""
    cost = parse_cost(text)
    if cost > MAX_PARSE_FACTOR * len(text) + _PARSE_ALLOWANCE:
        raise JSONFileError(
            f"{where}: parsing it would take about {cost / len(text):.0f} times its "
            f"{len(text)} characters in memory (allowed: at most {MAX_PARSE_FACTOR} times; "
            "it holds mostly tiny arrays, objects or strings, which no difftest file does)")


class _SharedNumbers:
    """``parse_int``/``parse_float`` of one parse: equal numbers become one object."""

    def __init__(self) -> None:
        self.ints: dict[str, int] = {}
        self.floats: dict[str, float] = {}

    def int(self, text: str) -> int:
        value = self.ints.get(text)
        if value is None:
            value = self.ints[text] = int(text)
        return value

    def float(self, text: str) -> float:
        value = self.floats.get(text)
        if value is None:
            value = self.floats[text] = float(text)
        return value


def loads(text: str, where: str) -> Any:
    """Parse JSON ``text`` (strict, or with the bare non-finite tokens of older files);
    :class:`JSONFileError` names ``where`` and says what is wrong (also a text too costly to
    parse, :func:`check_parse_cost`, or nested too deep)."""
    if not text.strip():
        raise JSONFileError(f"{where}: empty (not JSON)")
    check_parse_cost(text, where)
    depth = nesting_depth(text)
    if depth > MAX_DEPTH:
        raise JSONFileError(f"{where}: nested {depth} deep (allowed: at most {MAX_DEPTH} "
                            "levels of arrays and objects)")
    numbers = _SharedNumbers()
    try:
        return json.loads(text, parse_int=numbers.int, parse_float=numbers.float)
    except json.JSONDecodeError as exc:
        cut = " - the file looks truncated" if _unclosed(text) else ""
        raise JSONFileError(f"{where}: not JSON: {exc.msg} (line {exc.lineno} column "
                            f"{exc.colno}){cut}") from exc


def _unclosed(text: str) -> bool:
    """Whether ``text`` ends inside a string, an object or an array it opened (the end of a
    JSON document is missing), counting brackets outside strings."""
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            escaped, in_string = (not escaped and char == "\\",
                                  in_string and (escaped or char != '"'))
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
    return in_string or depth > 0


def read_bounded(path: Path | str, limit: int | None = None) -> str:
    """The UTF-8 text of the regular file ``path``, at most ``limit`` bytes;
    :class:`JSONFileError` names the file when it is missing, not a regular file (a FIFO, a
    device, a directory), larger (default :data:`MAX_BYTES`), or not UTF-8."""
    limit = MAX_BYTES if limit is None else limit
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
    except OSError as exc:
        raise JSONFileError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # before fdopen, which refuses a directory naming
        os.close(fd)                    # only the descriptor
        mode = info.st_mode
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "not a regular file")
        raise JSONFileError(f"{path}: is {kind} (allowed: a regular file)")
    with os.fdopen(fd, "rb") as fh:
        try:
            # what the file holds, not the cap: read(limit + 1) allocated 1 GiB for any file
            data = fh.read(min(limit, info.st_size) + 1)
            while len(data) <= limit and (more := fh.read(_CHUNK)):  # it grew meanwhile
                data += more
        except OSError as exc:
            raise JSONFileError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if len(data) > limit:
        raise JSONFileError(f"{path}: larger than {limit} bytes (allowed: at most {limit})")
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise JSONFileError(f"{path}: not JSON (not UTF-8 text: {exc.reason})") from exc


def read_json(path: Path | str) -> Any:
    """Parse a JSON file; :class:`JSONFileError` names the file and what is wrong."""
    return loads(read_bounded(path), str(path))


def read_json_lines(path: Path | str) -> list[Any]:
    """Every non-blank line of a JSON-lines file, parsed; errors name the file and line."""
    text = read_bounded(path)
    return [loads(line, f"{path} line {n}")
            for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
