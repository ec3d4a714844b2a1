"""Run every command block of the README and docs/workflows.md and compare with what they show.

    .venv/bin/python scripts/check_docs.py [--list] [--save DIR] [DOC.md ...]

Blocks, in document order, each document in one bash session from the checkout root with the
venv's ``bin`` first on ``PATH`` (so ``cd``, files and ``$?`` carry from one command to the
next); ``scratch/`` is emptied before each document:

* ```` ```console ````: each ``$ `` line is a command (continued while its quotes are open or
  it ends in ``\\``); the lines up to the next ``$ `` are the output it shows. A line ``...``
  skips any number of lines, ``...`` inside a line matches anything, and the shown lines are
  otherwise found in order, consecutively, in what the command printed (stdout and stderr).
  Case ids, output digests, paths, pids (also in a pending file's name, ``<id>.<pid>.json``),
  addresses, timings and runs of spaces are compared as placeholders; a doc writes the
  checkout's absolute path as ``<checkout>``. A command whose exit status the doc does not
  show (``$?``) must exit 0.
* ```` ```sh ````: the whole block is one command that must exit 0; a plain ```` ``` ````
  block right after it is the output it shows.
* ``<!-- docs-check: skip: REASON -->`` before a block skips it, printed with the reason (a
  GPU runner's commands, the test suite that CI runs as its own step).
* A table under a ``## Troubleshooting`` heading: the first backquoted text of each row is a
  message that must appear in the output of that section's commands (``...`` as above),
  unless ``<!-- docs-check: unchecked 'START': REASON -->`` names it by its start.

Prints one line per command and block, then the differences and the check's wall time; exit
status 1 when anything differs.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DOCS = ("README.md", "docs/workflows.md")
SCRATCH = "scratch"
DOC_TIMEOUT_S = 3600
SKIP = re.compile(r"<!-- docs-check: skip: (.+?) -->")
UNCHECKED = re.compile(r"<!-- docs-check: unchecked '(.+?)': (.+?) -->")
MARK = "@@docs-check"
PLACEHOLDERS = [
    (re.compile(r"\b[0-9a-f]{16}\b"), "<id>"),
    (re.compile(r"\b[0-9a-f]{12}\b"), "<digest>"),
    (re.compile(r"0x[0-9a-f]+"), "0x<address>"),
    (re.compile(r"\bpid \d+"), "pid <pid>"),
    (re.compile(r"<id>\.\d+\.json\b"), "<id>.<pid>.json"),  # a pending file's name
    (re.compile(r"\b\d+(\.\d+)? ?(s|ms|min)\b"), "<time>"),
    (re.compile(r"\b\d+(\.\d+)? cases/s\b"), "<rate>"),
    (re.compile(r"\[[#.]+\]"), "[<progress>]"),
]
ABSOLUTE_PATH = re.compile(r"(?<![\w.])/(?:[\w.+@-]+/)*[\w.+@-]+")


@dataclass
class Command:
    """One command of a document, with the output its block shows."""

    line: int
    text: str
    shown: list[str] | None  # None: the output is not shown (an sh block without one)
    status_shown: bool
    section: str


@dataclass
class Block:
    line: int
    commands: list[Command] = field(default_factory=list)
    skip: str | None = None


@dataclass
class Doc:
    path: Path
    blocks: list[Block]
    messages: list[tuple[int, str, str]]  # (line, section, message) of Troubleshooting tables
    unchecked: dict[str, str]


def _complete(text: str) -> bool:
    """Whether ``text`` is a whole shell command: quotes closed and no trailing ``\\``."""
    if text.endswith("\\"):
        return False
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return False
    return True


def _console(lines: list[str], first: int, section: str) -> list[Command]:
    commands: list[Command] = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            i += 1
            continue
        start, text = i, lines[i][2:]
        while not _complete(text) and i + 1 < len(lines):
            i += 1
            text += "\n" + lines[i]
        i += 1
        shown = []
        while i < len(lines) and not lines[i].startswith("$ "):
            shown.append(lines[i])
            i += 1
        commands.append(Command(first + start, text, shown, "$?" in text, section))
    for before, after in itertools.pairwise(commands):
        if re.fullmatch(r"echo \S*\$\?\S*", after.text.strip()):
            before.status_shown = True
    return commands


def parse(path: Path) -> Doc:
    """The command blocks and Troubleshooting messages of one markdown file."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    messages: list[tuple[int, str, str]] = []
    unchecked: dict[str, str] = {}
    section, pending_skip, i = "", None, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        if found := SKIP.search(line):
            pending_skip = found.group(1)
        for found in UNCHECKED.finditer(line):
            unchecked[found.group(1)] = found.group(2)
        if section == "Troubleshooting" and line.startswith("| `"):
            messages.append((i + 1, section, line.split("`")[1]))
        if not line.startswith("```"):
            if line.strip() and not line.startswith("<!--"):
                pending_skip = None
            i += 1
            continue
        info, end = line[3:].strip(), i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        body = lines[i + 1:end]
        block = Block(i + 1, skip=pending_skip)
        if info == "console":
            block.commands = _console(body, i + 2, section)
        elif info in ("sh", "bash"):
            block.commands = [Command(i + 2, "\n".join(body), None, False, section)]
            after = end + 1
            while after < len(lines) and not lines[after].strip():
                after += 1
            if after < len(lines) and lines[after].strip() == "```":
                close = after + 1
                while close < len(lines) and not lines[close].startswith("```"):
                    close += 1
                block.commands[0].shown = lines[after + 1:close]
                end = close
        if block.commands:
            blocks.append(block)
        pending_skip = None
        i = end + 1
    return Doc(path, blocks, messages, unchecked)


def normalise(line: str) -> str:
    """A line with paths, ids and timings replaced by placeholders, spaces collapsed."""
    line = line.replace(str(ROOT), "<checkout>")
    line = ABSOLUTE_PATH.sub("<path>", line)
    for pattern, placeholder in PLACEHOLDERS:
        line = pattern.sub(placeholder, line)
    return " ".join(line.split())


def pattern(shown: str) -> re.Pattern[str]:
    """A shown line as a pattern: ``...`` inside it matches anything."""
    return re.compile(".*".join(re.escape(normalise(part)) for part in shown.split("...")))


def missing_line(shown: list[str], actual: list[str]) -> str | None:
    """The first shown line not found where it should be in ``actual``, or None."""
    out = [normalise(line) for line in actual if line.strip()]
    segments: list[list[str]] = [[]]
    for line in shown:
        if line.strip() == "...":
            segments.append([])
        elif line.strip():
            segments[-1].append(line)
    cursor = 0
    for segment in segments:
        if not segment:
            continue
        patterns = [pattern(line) for line in segment]
        for start in range(cursor, len(out) - len(segment) + 1):
            if all(p.fullmatch(out[start + k]) for k, p in enumerate(patterns)):
                cursor = start + len(segment)
                break
        else:
            # the longest prefix of the segment that is found, to name the line that differs
            for k in range(len(segment), 0, -1):
                if any(all(p.fullmatch(out[s + j]) for j, p in enumerate(patterns[:k]))
                       for s in range(cursor, len(out) - k + 1)):
                    return segment[k] if k < len(segment) else segment[0]
            return segment[0]
    return None


def run_doc(doc: Doc, env: dict[str, str], cwd: Path = ROOT,
            ) -> tuple[list[str], dict[int, tuple[int, list[str]]]]:
    """Run every command of ``doc`` that is not skipped in one bash session, in ``cwd``.

    Returns the skip lines and, by command index, its exit status and output lines.
    """
    commands = [c for b in doc.blocks if b.skip is None for c in b.commands]
    script = ["__status=0"]
    for n, command in enumerate(commands):
        script += [f"printf '\\n{MARK} begin {n}\\n'", "(exit $__status)",
                   "{", command.text, "} </dev/null 2>&1", "__status=$?",
                   f"printf '\\n{MARK} end {n} %d\\n' $__status"]
    shutil.rmtree(cwd / SCRATCH, ignore_errors=True)
    (cwd / SCRATCH).mkdir()
    process = subprocess.Popen(["bash"], cwd=cwd, env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    assert process.stdin is not None and process.stdout is not None
    results: dict[int, tuple[int, list[str]]] = {}
    try:
        process.stdin.write("\n".join(script) + "\n")
        process.stdin.close()
        current: list[str] = []
        started = time.monotonic()
        deadline = started + DOC_TIMEOUT_S
        for raw in process.stdout:
            line = raw.rstrip("\n")
            if line.startswith(f"{MARK} begin "):
                current, started = [], time.monotonic()
                n = int(line.split()[2])
                first = commands[n].text.splitlines()[0] if commands[n].text else ""
                print(f"{doc.path.name}:{commands[n].line}: $ {first[:100]}", flush=True)
            elif line.startswith(f"{MARK} end "):
                _, _, n_text, status = line.split()
                results[int(n_text)] = (int(status), current)
                print(f"  exit {status}, {time.monotonic() - started:.1f} s", flush=True)
            else:
                current.append(line)
            if time.monotonic() > deadline:
                break
    finally:  # the session and every command it started end with the check
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return [f"{doc.path.name}:{b.line}: skipped: {b.skip}" for b in doc.blocks if b.skip], \
        {id(c): results[n] for n, c in enumerate(commands) if n in results}


def check(doc: Doc, env: dict[str, str], cwd: Path = ROOT, save: Path | None = None,
          ) -> list[str]:
    """Run ``doc`` in ``cwd`` and return what differs from what it shows; with ``save``, write
    each command's output there (``<doc>-<line>.txt``)."""
    skips, results = run_doc(doc, env, cwd)
    for line in skips:
        print(line)
    problems: list[str] = []
    outputs: dict[str, list[str]] = {}
    for block in doc.blocks:
        if block.skip:
            continue
        for command in block.commands:
            where = f"{doc.path.name}:{command.line}"
            if id(command) not in results:
                problems.append(f"{where}: did not finish (the document ran past "
                                f"{DOC_TIMEOUT_S} s or bash stopped)")
                continue
            status, output = results[id(command)]
            if save is not None:
                save.mkdir(parents=True, exist_ok=True)
                (save / f"{doc.path.stem}-{command.line}.txt").write_text(
                    f"$ {command.text}\n" + "\n".join(output) + f"\n[exit {status}]\n")
            outputs.setdefault(command.section, []).extend(output)
            tail = "\n".join(f"    | {line}" for line in output[-40:])
            if status != 0 and not command.status_shown:
                problems.append(f"{where}: exited {status}, and the doc shows no exit status:"
                                f"\n{tail}")
            if command.shown is not None:
                missing = missing_line(command.shown, output)
                if missing is not None:
                    problems.append(f"{where}: the doc shows\n    {missing}\n  which is not "
                                    f"in the output where it should be; the output:\n{tail}")
    for line, section, message in doc.messages:
        if any(message.startswith(start) for start in doc.unchecked):
            print(f"{doc.path.name}:{line}: unchecked message: {message[:60]}")
            continue
        regex = pattern(message)
        if not any(regex.search(normalise(out)) for out in outputs.get(section, [])):
            problems.append(f"{doc.path.name}:{line}: the message `{message}` is printed by "
                            f"none of the section's commands (drifted from the tool's text?)")
    return problems


def environment() -> dict[str, str]:
    """The user's environment with the venv active and no CI profile chosen."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("CI", "HYPOTHESIS_PROFILE", "PYTHONPATH", "DIFFTEST_VENV")}
    venv = ROOT / ".venv"
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("docs", nargs="*", default=list(DEFAULT_DOCS))
    parser.add_argument("--list", action="store_true", help="list the commands, run nothing")
    parser.add_argument("--save", type=Path, metavar="DIR",
                        help="write each command's whole output to DIR (for editing a doc)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    problems: list[str] = []
    for name in args.docs:
        doc = parse(ROOT / name)
        if args.list:
            for block in doc.blocks:
                for command in block.commands:
                    state = f"skip: {block.skip}" if block.skip else "run"
                    print(f"{name}:{command.line}: [{state}] $ {command.text.splitlines()[0]}")
            continue
        problems += check(doc, environment(), save=args.save)
    for problem in problems:
        print(f"DIFFERS {problem}")
    if not args.list:
        print(f"docs check: {len(problems)} difference(s); "
              f"{time.monotonic() - started:.0f} s wall")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
