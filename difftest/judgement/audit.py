"""Parameter coverage: which values every argument of every kernel call took over a run.

A blind spot is a kernel argument the cases never vary: a bug that lives on another value of
it cannot be caught. Each backend states the calls it made, from the arguments it made them
with (:mod:`difftest.contract.kernel_call`, recorded per result as ``calls``): every parameter of
the kernel's signature with the class of the value passed, the sizes the kernel reads from its
tensors' shapes, and, for those that never vary, the reason. This module only collects those
statements over a run's records and renders them; it knows no backend and no kernel.
:func:`audit` collects the distinct value classes per backend, kernel and argument over the
cases each backend ran; :func:`blind_spots` lists the arguments neither stated fixed nor
varied; :func:`audit_lines` renders them for a run's summary and :func:`audit_json` for a
report.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from difftest.contract.kernel_call import KernelCall, StatedArgument

RAN = frozenset({"agree", "disagree", "error", "crash"})  # the statuses of a kernel that ran


@dataclass(frozen=True)
class Coverage:
    """One argument of one backend's kernel over a run: its distinct value classes in
    first-seen order, the reason it is fixed (empty if it should vary) and where a size sits
    in the shapes."""

    backend: str
    kernel: str
    argument: str
    values: tuple[str, ...]
    fixed: str
    shape: str
    cases: int  # the cases in which the backend stated this kernel's call

    @property
    def blind(self) -> bool:
        """Not stated fixed, and a single value over the cases."""
        return not self.fixed and len(self.values) < 2


def _backend_name(backend: Any) -> str:
    return backend if isinstance(backend, str) else backend.name


def _results(item: Mapping[str, Any] | Any) -> list[Any]:
    results = item.get("results") if isinstance(item, Mapping) else item.results
    return list(results or [])


def _get(result: Any, name: str) -> Any:
    return result[name] if isinstance(result, Mapping) else getattr(result, name)


def _calls(result: Any) -> list[KernelCall]:
    """The stated calls of a result (a record object or its JSON entry)."""
    out = []
    for call in _get(result, "calls") if not isinstance(result, Mapping) else \
            result.get("calls", []):
        if isinstance(call, KernelCall):
            out.append(call)
        else:
            out.append(KernelCall(call["kernel"], {
                name: StatedArgument(**stated) for name, stated in call["arguments"].items()}))
    return out


def _status(result: Any) -> str:
    status = _get(result, "status")
    return str(getattr(status, "value", status))


def _known_findings(result: Any) -> list[str]:
    """The findings of a result that known bugs explain wholly (none otherwise), from a
    record object or its JSON entry."""
    known = result.get("known_bug") if isinstance(result, Mapping) else result.known_bug
    if not known or _status(result) not in RAN:
        return []
    if isinstance(known, Mapping):
        return [] if known["new_failure"] else [f["finding"] for f in known["findings"]]
    return [] if known.new_failure else known.names


def known_bug_counts(items: Iterable[Mapping[str, Any] | Any],
                     backends: Sequence[Any]) -> dict[str, dict[str, int]]:
    """Per backend name: the results known bugs explain wholly, by finding."""
    names = [_backend_name(b) for b in backends]
    out: dict[str, dict[str, int]] = {name: {} for name in names}
    for item in items:
        for result in _results(item):
            counts = out.get(_get(result, "backend"))
            if counts is not None:
                for finding in _known_findings(result):
                    counts[finding] = counts.get(finding, 0) + 1
    return out


def statements(items: Iterable[Mapping[str, Any] | Any],
               backends: Sequence[Any]) -> dict[str, tuple[int, list[KernelCall]]]:
    """Per backend name: the cases it ran and the calls it stated in them, from run records
    (a report's case entries or record objects with ``results``)."""
    names = [_backend_name(b) for b in backends]
    out: dict[str, tuple[int, list[KernelCall]]] = {name: (0, []) for name in names}
    for item in items:
        for result in _results(item):
            name = _get(result, "backend")
            if name in out and _status(result) in RAN:
                ran, calls = out[name]
                out[name] = (ran + 1, calls + _calls(result))
    return out


def audit(items: Iterable[Mapping[str, Any] | Any], backends: Sequence[Any]) -> list[Coverage]:
    """Every stated argument of every kernel each backend called, with the distinct value
    classes over the cases it ran (a backend that stated no call has no entry)."""
    out = []
    for name, (_, calls) in statements(items, backends).items():
        kernels: dict[str, dict[str, dict[str, Any]]] = {}
        counts: dict[str, int] = {}
        for call in calls:
            counts[call.kernel] = counts.get(call.kernel, 0) + 1
            arguments = kernels.setdefault(call.kernel, {})
            for argument, stated in call.arguments.items():
                entry = arguments.setdefault(argument, {"values": {}, "fixed": "",
                                                        "shape": stated.shape})
                entry["values"].setdefault(stated.label, None)
                entry["fixed"] = entry["fixed"] or stated.fixed
        for kernel, arguments in kernels.items():
            for argument, entry in arguments.items():
                values = tuple(entry["values"])
                # a reason it is fixed holds where it took one value; where it varied, it
                # is shown varying
                fixed = entry["fixed"] if len(values) < 2 else ""
                out.append(Coverage(name, kernel, argument, values, fixed, entry["shape"],
                                    counts[kernel]))
    return out


def blind_spots(items: Iterable[Mapping[str, Any] | Any],
                backends: Sequence[Any]) -> list[Coverage]:
    """The arguments that took one value though no backend statement says they are fixed."""
    return [c for c in audit(items, backends) if c.blind]


def audit_lines(items: Iterable[Mapping[str, Any] | Any], backends: Sequence[Any],
                max_values: int = 6) -> list[str]:
    """The audit as text: per backend and kernel, each argument's value classes (or why it
    is fixed), blind spots marked ``BLIND``; one line per backend that stated no call."""
    items = list(items)
    lines = [f"parameter coverage over {len(items)} cases"]
    coverage = audit(items, backends)
    known = known_bug_counts(items, backends)
    for name, (ran, _) in statements(items, backends).items():
        rows = [c for c in coverage if c.backend == name]
        bugs = ", ".join(f"{n} {finding}" for finding, n in sorted(known[name].items()))
        bugs = f"; known bugs explain {bugs}" if bugs else ""
        if not rows:
            lines.append(f"  {name}: ran {ran} case(s){bugs}, stated no kernel call"
                         if ran else f"  {name}: ran no case, not audited")
            continue
        width = max(len(c.argument) for c in rows)
        kernel = None
        for c in rows:
            if c.kernel != kernel:
                kernel = c.kernel
                lines.append(f"  {name} -> {kernel} ({c.cases} calls stated in {ran} cases"
                             f"{bugs})")
            where = f" ({c.shape})" if c.shape else ""
            shown = "; ".join(c.values[:max_values])
            more = f"; ... ({len(c.values)} in all)" if len(c.values) > max_values else ""
            head = f"{len(c.values)} value(s): {shown}{more}"
            if c.fixed:
                lines.append(f"    {c.argument.ljust(width)}  {head}{where}, fixed: {c.fixed}")
            else:
                flag = "BLIND " if c.blind else ""
                lines.append(f"    {c.argument.ljust(width)}  {flag}{head}{where}")
    return lines


def audit_json(items: Iterable[Mapping[str, Any] | Any],
               backends: Sequence[Any]) -> dict[str, Any]:
    """The audit as JSON: per backend that stated calls, the cases it ran and, per kernel and
    argument, its value classes, ``fixed`` (reason and where a size sits, or ``None``) and
    whether it is blind."""
    items = list(items)
    ran = {name: n for name, (n, _) in statements(items, backends).items()}
    out: dict[str, Any] = {"cases": len(items), "backends": {}}
    for c in audit(items, backends):
        entry = out["backends"].setdefault(c.backend, {"cases": ran[c.backend], "kernels": {}})
        kernel = entry["kernels"].setdefault(c.kernel, {"calls": c.cases, "arguments": []})
        fixed = {"reason": c.fixed, "shape": c.shape} if c.fixed else None
        kernel["arguments"].append({"name": c.argument, "values": list(c.values),
                                    "fixed": fixed, "blind": c.blind})
    return out
