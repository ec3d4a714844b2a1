"""Reach: which changed lines of a vLLM or AITER bump a run executed.

Under Triton's interpreter a ``@triton.jit`` body runs as Python (compiled with its file's
name and line numbers), so one line trace covers a launcher and its kernels; on a GPU only
the host side is Python, and the lines inside ``@triton.jit`` bodies are counted apart as
not measurable there. :class:`LineTrace` (coverage.py) records the lines a run executes in
the files of every ``vllm`` and ``aiter`` package tree; ``difftest run --reach`` keeps them in
the report under ``config.reach``. :func:`tree_reach` diffs each file the candidate's run
executed between the baseline's and the candidate's tree of a backend (the ``vllm_path`` or
``aiter_path`` its versions name) and counts the changed statements of the candidate's file
that the run executed; each unreached hunk comes with the condition that kept it out (an
``if`` whose test ran and never took that branch, a function never called). :func:`reach_lines`
renders it for ``difftest gate``. Kernels compiled for a GPU the CPU cannot run are compared
by the fingerprints of their device code (:func:`device_code_lines`). docs/reach.md explains
the counting.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from difftest.contract.launches import clear_launches, counted_launches

PACKAGES = ("vllm", "aiter")
# the versions key naming the package tree a backend's kernels came from, per package
TREE_KEYS = {f"{package}_path": package for package in PACKAGES}


class LineTrace:
    """coverage.py's line trace over the files of every ``vllm`` and ``aiter`` package tree."""

    def __init__(self) -> None:
        import coverage

        self._coverage = coverage.Coverage(
            data_file=None, config_file=False, branch=False,
            include=[f"*/{name}/*" for name in PACKAGES])
        self.tracer = f"coverage.py {coverage.__version__}"

    def start(self) -> LineTrace:
        """Start tracing this process (threads started later included), and counting the
        launches of arch-emulated kernels anew."""
        clear_launches()
        self._coverage.start()
        return self

    def stop(self, kernel_bodies: bool) -> dict[str, Any]:
        """Stop, and return the record a report keeps: ``tracer``, ``kernel_bodies`` (whether
        ``@triton.jit`` bodies ran as Python) and ``files`` (path -> executed lines)."""
        self._coverage.stop()
        data = self._coverage.get_data()
        files = {path: sorted(data.lines(path) or ())
                 for path in sorted(data.measured_files())}
        return {"tracer": self.tracer, "kernel_bodies": kernel_bodies,
                "files": {path: lines for path, lines in files.items() if lines},
                "launches": counted_launches()}


def merge_reach(records: Iterable[Mapping[str, Any] | None]) -> dict[str, Any]:
    """One record of the lines several processes' records hold (shards, ``--jobs``)."""
    given = [r for r in records if r]
    files: dict[str, set[int]] = {}
    launches: dict[str, dict[str, int]] = {}
    for record in given:
        for path, lines in record["files"].items():
            files.setdefault(path, set()).update(lines)
        for module, counts in (record.get("launches") or {}).items():
            for launch, count in counts.items():
                launches.setdefault(module, {})
                launches[module][launch] = launches[module].get(launch, 0) + count
    return {"tracer": given[0]["tracer"] if given else "none",
            "kernel_bodies": all(r["kernel_bodies"] for r in given),
            "files": {path: sorted(lines) for path, lines in sorted(files.items())},
            "launches": {m: dict(sorted(c.items())) for m, c in sorted(launches.items())}}


@dataclass(frozen=True)
class Hunk:
    """Consecutive changed statements of the candidate's file that never ran."""

    first: int
    last: int
    statements: int
    reason: str


@dataclass(frozen=True)
class FileReach:
    """One changed file of a tree pair: changed statements run out of all, unreached hunks,
    and changed statements inside ``@triton.jit`` bodies that a GPU run cannot measure."""

    path: str
    changed: int
    ran: int
    unmeasured: int
    hunks: tuple[Hunk, ...]
    moved_from: str = ""  # the baseline tree's copy when it sits at another path


@dataclass(frozen=True)
class TreeReach:
    """The reach of one (baseline tree, candidate tree) pair of the backends that use it."""

    backends: tuple[str, ...]
    baseline: str
    candidate: str
    files: tuple[FileReach, ...]
    elsewhere: tuple[tuple[str, str], ...] = ()  # (the tree that ran it, path)
    problem: str = ""


def _header_end(node: ast.stmt) -> int:
    """The last line of a statement's own text: a compound statement's header only."""
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
        return max(node.lineno, body[0].lineno - 1)
    return node.end_lineno or node.lineno


def _is_jit(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef) and any(
        "jit" in ast.unparse(d) for d in node.decorator_list)


class _Statements:
    """Every statement of a source file with its header span, parent and enclosing jit."""

    def __init__(self, source: str) -> None:
        self.source = source
        tree = ast.parse(source)
        self.parent: dict[ast.AST, ast.AST] = {}
        self.nodes: list[ast.stmt] = []
        docstrings = {id(n.body[0]) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                        ast.AsyncFunctionDef)) and ast.get_docstring(n)}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
            if isinstance(node, ast.stmt) and id(node) not in docstrings:  # never executed
                self.nodes.append(node)
        self.nodes.sort(key=lambda n: n.lineno)

    def span(self, node: ast.stmt) -> range:
        """The lines of a statement's own text (decorators included for a definition)."""
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        return range(first, _header_end(node) + 1)

    def in_jit(self, node: ast.AST) -> bool:
        """Whether ``node`` lies inside a ``@triton.jit`` function body."""
        while node in self.parent:
            node = self.parent[node]
            if _is_jit(node):
                return True
        return False

    def ran(self, node: ast.stmt, executed: set[int]) -> bool:
        """Whether some line of the statement's own text was executed."""
        return any(line in executed for line in self.span(node))

    def why_not(self, node: ast.stmt, executed: set[int]) -> str:
        """The condition that kept ``node`` out: the innermost enclosing branch whose test
        ran and never entered it, or the function never called; else the last statement
        before it that ran in the innermost block that was entered."""
        child: ast.AST = node
        while not isinstance(self.parent.get(child), (ast.Module, type(None))):
            owner = self.parent[child]
            if isinstance(owner, (ast.If, ast.While)) and self.ran(owner, executed):
                branch = owner.orelse if child in owner.orelse else owner.body
                if any(self.ran(s, executed) for s in branch):  # entered, left early
                    break
                test = " ".join(ast.get_source_segment(self.source, owner.test).split())
                word = "if" if isinstance(owner, ast.If) else "while"
                side = "true" if child in owner.orelse else "false"
                return f"`{word} {_short(test)}` (line {owner.lineno}) was {side} each time it ran"
            if isinstance(owner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if not any(self.ran(s, executed) for s in ast.walk(owner)
                           if isinstance(s, ast.stmt) and s is not owner):
                    return f"function `{owner.name}` (line {owner.lineno}) never ran"
                break
            if isinstance(owner, (ast.For, ast.AsyncFor)) and self.ran(owner, executed) and (
                    not any(self.ran(s, executed) for s in owner.body)):
                return f"loop at line {owner.lineno} never iterated"
            child = owner
        line = getattr(child, "lineno", node.lineno)
        before = [n for n in self.nodes if n.lineno < line and self.ran(n, executed)
                  and self.parent.get(n) is self.parent.get(child)]
        if before:
            return f"its block stopped after line {before[-1].lineno}"
        return "nothing around it ran"


def _short(text: str, limit: int = 90) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def changed_lines(old: str | None, new: str) -> set[int]:
    """Lines of ``new`` (1-based) added or replaced relative to ``old`` (all, if no ``old``)."""
    new_lines = new.splitlines()
    if old is None:
        return set(range(1, len(new_lines) + 1))
    matcher = difflib.SequenceMatcher(None, old.splitlines(), new_lines, autojunk=False)
    return {j + 1 for tag, _, _, j1, j2 in matcher.get_opcodes() if tag != "equal"
            for j in range(j1, j2)}


def file_reach(path: str, old: str | None, new: str, executed: Iterable[int],
               kernel_bodies: bool) -> FileReach | None:
    """The reach of one file's change; ``None`` when no statement changed."""
    changed = changed_lines(old, new)
    statements = _Statements(new)
    ran = set(executed)
    touched = [n for n in statements.nodes if changed.intersection(statements.span(n))]
    if not touched:
        return None
    unmeasured = [n for n in touched if not kernel_bodies and statements.in_jit(n)]
    measured = [n for n in touched if n not in unmeasured]
    hunks: list[Hunk] = []
    run: list[ast.stmt] = []

    def close() -> None:
        if run:
            hunks.append(Hunk(run[0].lineno, _header_end(run[-1]), len(run),
                              statements.why_not(run[0], ran)))
            run.clear()

    for node in measured:
        if statements.ran(node, ran):
            close()
        elif run and not _adjacent(statements, run[-1], node, changed):
            close()
            run.append(node)
        else:
            run.append(node)
    close()
    reached = sum(statements.ran(n, ran) for n in measured)
    return FileReach(path, len(measured), reached, len(unmeasured), tuple(hunks))


def _adjacent(statements: _Statements, previous: ast.stmt, node: ast.stmt,
              changed: set[int]) -> bool:
    """Whether ``node`` continues the hunk ending at ``previous``: only changed lines and
    lines of no statement lie between them."""
    between = range(_header_end(previous) + 1, node.lineno)
    starts = {n.lineno for n in statements.nodes}
    return all(line in changed or line not in starts for line in between)


def _package_files(reach: Mapping[str, Any] | None, package: Path) -> dict[str, list[int]]:
    """The executed lines of ``reach``'s files under ``package``, by path inside it."""
    found = {}
    for path, lines in ((reach or {}).get("files") or {}).items():
        try:
            found[Path(path).relative_to(package).as_posix()] = lines
        except ValueError:
            continue
    return found


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def tree_reach(baseline: Mapping[str, Any], candidate: Mapping[str, Any]) -> list[TreeReach]:
    """Per (baseline tree, candidate tree) pair of the backends both reports name with a
    ``vllm_path`` or ``aiter_path``: the reach of every file the candidate's run executed
    in its tree that differs from the baseline tree's copy, and the changed files of the
    candidate's tree that ran from another tree (the venv's ``vllm.platforms``, say)."""
    pairs: dict[tuple[str, str], list[str]] = {}
    for name in sorted(baseline["backends"].keys() & candidate["backends"].keys()):
        ours = baseline["backends"][name].get("versions") or {}
        theirs = candidate["backends"][name].get("versions") or {}
        for key in TREE_KEYS:
            if ours.get(key) and theirs.get(key) and ours[key] != theirs[key]:
                pairs.setdefault((ours[key], theirs[key]), []).append(name)
    cand_reach = candidate["config"].get("reach")
    trees = []
    for (old, new), names in sorted(pairs.items()):
        if cand_reach is None:
            trees.append(TreeReach(tuple(names), old, new, (),
                                   problem="the candidate's run recorded no reach (difftest "
                                   "run --reach)"))
            continue
        if not Path(new).is_dir() or not Path(old).is_dir():
            missing = new if not Path(new).is_dir() else old
            trees.append(TreeReach(tuple(names), old, new, (), problem=f"{missing} is not on "
                                   "this machine (the gate diffs the trees the reports name)"))
            continue
        executed = _package_files(cand_reach, Path(new))
        found = []
        for relative in sorted(executed):
            new_text = _read(Path(new) / relative)
            old_text = _read(Path(old) / relative)
            moved = "" if old_text is not None else moved_from(Path(old), relative)
            if moved:
                old_text = _read(Path(old) / moved)
            if new_text is None or new_text == old_text:
                continue
            reach = file_reach(relative, old_text, new_text, executed[relative],
                               bool(cand_reach.get("kernel_bodies")))
            if reach is not None:
                found.append(dataclasses.replace(reach, moved_from=moved))
        trees.append(TreeReach(tuple(names), old, new, tuple(found),
                               _elsewhere(cand_reach, Path(new))))
    return trees


def moved_from(old: Path, relative: str) -> str:
    """The file of the ``old`` tree that ``relative`` (absent there) moved from: of the files
    with its name, the one whose directories best match its own (AITER moved
    ``ops/triton/unified_attention.py`` to ``ops/triton/attention/``); ``""`` when none, or
    when two match equally."""
    parts = Path(relative).parts
    scored = sorted(((difflib.SequenceMatcher(None, parts, path.relative_to(old).parts)
                      .ratio(), path.relative_to(old).as_posix())
                     for path in old.rglob(Path(relative).name) if path.is_file()),
                    reverse=True)
    if not scored or (len(scored) > 1 and scored[0][0] == scored[1][0]):
        return ""
    return scored[0][1]


def _elsewhere(reach: Mapping[str, Any], package: Path) -> tuple[tuple[str, str], ...]:
    """Files the run executed from another tree of the same package whose copy in
    ``package`` differs: code of the release that did not run, another copy did."""
    found = []
    for path in sorted(reach.get("files") or {}):
        head, sep, relative = path.rpartition(f"/{package.name}/")
        if not sep or Path(head) / package.name == package:
            continue
        ours = _read(package / relative)
        if ours is not None and ours != _read(Path(path)):
            found.append((f"{head}/{package.name}", relative))
    return tuple(found)


def reach_lines(baseline: Mapping[str, Any], candidate: Mapping[str, Any],
                max_hunks: int | None = None) -> list[str]:
    """The gate's reach section: per tree pair and changed file, the changed statements
    the candidate's run executed, each unreached hunk with its condition (the first
    ``max_hunks`` of a file, then how many more), and a plain warning when changed code went
    unreached."""
    trees = tree_reach(baseline, candidate)
    if not trees:
        return []
    tracer = (candidate["config"].get("reach") or {}).get("tracer", "no trace")
    bodies = (candidate["config"].get("reach") or {}).get("kernel_bodies")
    scope = ("kernel bodies traced" if bodies
             else "host side only: kernel bodies did not run as Python")
    lines = [f"reach of the changed code in the candidate's run ({tracer}; {scope}):"]
    unreached = unmeasured = 0
    for tree in trees:
        lines.append(f"  {', '.join(tree.backends)}: {tree.baseline} -> {tree.candidate}")
        if tree.problem:
            lines.append(f"    reach unknown: {tree.problem}")
            continue
        if not tree.files:
            lines.append("    no file the runs executed differs between the trees")
        for item in tree.files:
            note = (f", {item.unmeasured} inside @triton.jit bodies not measurable here"
                    if item.unmeasured else "")
            moved = f" (moved from {item.moved_from})" if item.moved_from else ""
            lines.append(f"    {item.path}{moved}: {item.ran} of {item.changed} changed "
                         f"statements ran{note}")
            shown = item.hunks if max_hunks is None else item.hunks[:max_hunks]
            for hunk in shown:
                where = (f"line {hunk.first}" if hunk.first == hunk.last
                         else f"lines {hunk.first}-{hunk.last}")
                lines.append(f"      unreached {where} ({hunk.statements} statements): "
                             f"{hunk.reason}")
            if len(shown) < len(item.hunks):
                rest = item.hunks[len(shown):]
                lines.append(f"      ... {len(rest)} more unreached hunks "
                             f"({sum(h.statements for h in rest)} statements; difftest gate "
                             "--all lists them)")
            unreached += item.changed - item.ran
            unmeasured += item.unmeasured
        for other in sorted({where for where, _ in tree.elsewhere}):
            paths = [path for where, path in tree.elsewhere if where == other]
            lines.append(f"    {len(paths)} files changed in the candidate's tree ran from "
                         f"{other} instead: {', '.join(paths)}")
    for module, counts in ((candidate["config"].get("reach") or {}).get("launches")
                           or {}).items():
        lines.append(f"  launches of {module} (arch emulation; the parameters as chosen):")
        lines += [f"    {count} x {launch}" for launch, count in counts.items()]
    if unreached or unmeasured:
        lines.append(f"REACH: {unreached} changed statements never ran"
                     + (f" and {unmeasured} were not measurable" if unmeasured else "")
                     + ": the verdict says nothing about them")
    elif all(not tree.problem for tree in trees):
        lines.append("REACH: every changed statement of the executed files ran")
    return lines


@dataclass(frozen=True)
class DeviceCodeChange:
    """One kernel on one arch across a bump: its specializations (the shapes run) compiled on
    both sides, those whose machine code changed, and the cases that ran a changed one."""

    kernel: str
    arch: str
    compared: int
    changed: int
    one_side: int
    resources: tuple[str, ...]
    backends: tuple[str, ...]
    case_ids: tuple[str, ...]


RESOURCES = ("vgprs", "sgprs", "lds_bytes", "spills", "occupancy")


def _device_code(report: Mapping[str, Any]
                 ) -> dict[tuple[str, str, str], tuple[dict[str, Any], set[str], set[str]]]:
    """``(kernel, arch, specialization) -> (fingerprint, case ids, backends)`` over every
    result's stated calls that carry ``device_code`` (read defensively: an entry without the
    fields is skipped)."""
    found: dict[tuple[str, str, str], tuple[dict[str, Any], set[str], set[str]]] = {}
    for case in report.get("cases") or ():
        for result in case.get("results") or ():
            for call in result.get("calls") or ():
                for code in (call.get("device_code") or ()) if isinstance(call, dict) else ():
                    if not isinstance(code, dict) or not all(
                            isinstance(code.get(k), str) for k in ("kernel", "arch", "sha256")):
                        continue
                    key = (code["kernel"], code["arch"], str(code.get("specialization", "")))
                    entry = found.setdefault(key, (code, set(), set()))
                    entry[1].add(str(case.get("case_id")))
                    entry[2].add(str(result.get("backend")))
    return found


def device_code_changes(baseline: Mapping[str, Any], candidate: Mapping[str, Any]
                        ) -> list[DeviceCodeChange]:
    """Per (kernel, arch) compiled on either side: the specializations both sides compiled,
    how many of them changed machine code (``sha256``), those only one side compiled, the
    resource changes (registers, LDS, spills, occupancy) of the changed ones, and the
    candidate's cases that ran a changed or new one."""
    ours, theirs = _device_code(baseline), _device_code(candidate)
    by_kernel: dict[tuple[str, str], list[tuple[str, str, str]]] = {}
    for key in sorted(ours.keys() | theirs.keys()):
        by_kernel.setdefault(key[:2], []).append(key)
    changes = []
    for (kernel, arch), keys in by_kernel.items():
        both = [k for k in keys if k in ours and k in theirs]
        changed = [k for k in both if ours[k][0]["sha256"] != theirs[k][0]["sha256"]]
        new = [k for k in keys if k in theirs and k not in ours]
        resources = dict.fromkeys(
            f"{field} {ours[k][0].get(field)} -> {theirs[k][0].get(field)}"
            for k in changed for field in RESOURCES
            if ours[k][0].get(field) != theirs[k][0].get(field))
        cases = sorted({c for k in changed + new for c in theirs[k][1]})
        backends = sorted({b for k in changed + new for b in theirs[k][2]})
        changes.append(DeviceCodeChange(kernel, arch, len(both), len(changed),
                                        len(keys) - len(both), tuple(resources),
                                        tuple(backends), tuple(cases)))
    return changes


def rocm_backend(name: str) -> str:
    """The backend that runs a compiled-only backend's kernels natively: ``name`` without
    its variant and options (``aiter-gluon@compiled[arch=gfx950]`` -> ``aiter-gluon``)."""
    return name.partition("[")[0].partition("@")[0]


def device_code_lines(baseline: Mapping[str, Any], candidate: Mapping[str, Any],
                      candidate_path: str = "CANDIDATE") -> list[str]:
    """The gate's device-code section: per arch and kernel compiled without running, whether
    its machine code changed between the sides for the shapes run, and for a change the
    command that runs those cases where the numerics can be checked (a ROCm runner)."""
    changes = device_code_changes(baseline, candidate)
    if not changes:
        return []
    lines = ["device code of the kernels compiled for GPUs this machine cannot run (by "
             "kernel, arch and specialization):"]
    for change in changes:
        shapes = f"{change.compared} shape{'s' if change.compared != 1 else ''}"
        extra = (f"; {change.one_side} compiled on one side only" if change.one_side else "")
        if not change.changed and not change.one_side:
            lines.append(f"  {change.arch}: {change.kernel} unchanged for {shapes}")
            continue
        what = (f"changed for {change.changed} of {shapes}" if change.changed
                else f"unchanged for {shapes}")
        resources = f" ({', '.join(change.resources[:4])})" if change.resources else ""
        lines.append(f"  {change.arch}: {change.kernel} {what}{resources}{extra}: numerics "
                     "need a ROCm runner")
        backends = ",".join(dict.fromkeys(rocm_backend(b) for b in change.backends))
        lines.append(f"    on a {change.arch} runner with the candidate's release: difftest run "
                     f"--backends {backends} --cases-from {candidate_path} --case-ids "
                     f"{','.join(change.case_ids)}")
    return lines
