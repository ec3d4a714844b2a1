"""One comparison of a backend's output against the reference, with a rich message.

Modelled on ``torch.testing._comparison``: a single function produces a structured result
(counts, greatest error, greatest error/tolerance) and a message that says where it failed:
request, query token, head, dim, and the page ids that query row attended. The runner adds
the :mod:`difftest.judgement.diagnosis` of a disagreement (what the worst rows read instead) as
``diagnosis``. :func:`compare_elements` also says which rows and heads were wrong
(:class:`WrongElements`), for the judgement of known bugs row by row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch

from difftest.case.selection import SparseRow, row_page_ids
from difftest.case.spec import Case
from difftest.contract.backend import EmptyRowOutput
from difftest.contract.tolerance import Reference, Tolerance
from difftest.primitives.cuda_graphs import GraphCache
from difftest.primitives.text import printable

WORST_LOCATIONS = 5


@dataclass(frozen=True)
class Location:
    """One output element, what it should be, and what its row read."""

    row: int
    request: int
    query_token: int
    head: int
    dim: int
    actual: float
    expected: float
    error: float
    tolerance: float
    context_len: int
    pages: tuple[int, ...]

    @property
    def ratio(self) -> float:
        """error / tolerance (inf when the actual value is not finite)."""
        return self.error / self.tolerance if self.tolerance > 0 else float("inf")

    def describe(self) -> str:
        """Multi-line human description."""
        return (
            f"request {self.request}, query token {self.query_token} (row {self.row}), "
            f"head {self.head}, dim {self.dim}: actual {self.actual:.6g}, expected "
            f"{self.expected:.6g}, |error| {self.error:.3g}, tolerance {self.tolerance:.3g} "
            f"(error/tolerance {self.ratio:.3g})\n"
            f"      that row attended {self.context_len} tokens on pages {_ranges(self.pages)}"
        )


def _ranges(pages: tuple[int, ...]) -> str:
    if not pages:
        return "(none)"
    parts, start, prev = [], pages[0], pages[0]
    for p in (*pages[1:], None):
        if p is not None and p == prev + 1:
            prev = p
            continue
        parts.append(str(start) if start == prev else f"{start}..{prev}")
        if p is not None:
            start = prev = p
    return ", ".join(parts)


@dataclass(frozen=True)
class Comparison:
    """Result of :func:`compare`."""

    backend: str
    agrees: bool
    checked: int
    mismatched: int
    nonfinite: int
    max_abs_error: float
    max_ratio: float
    empty_rows: int
    empty_row_policy: str
    empty_row_violations: int
    tolerance: str
    worst: tuple[Location, ...]
    diagnosis: tuple[str, ...] = ()
    # fields a report written before they existed lacks (read with their default)
    READ_OPTIONAL: ClassVar[frozenset[str]] = frozenset({"diagnosis"})

    def message(self, case: Case, reference_name: str = "torch-ref") -> str:
        """The failure text (also meaningful when it agrees)."""
        verb = "agrees with" if self.agrees else "disagrees with"
        lines = [
            f"{self.backend} {verb} {reference_name} on case {case.case_id}"
            + (f" ({printable(case.name)})" if case.name else ""),
            f"  Mismatched elements: {self.mismatched} / {self.checked} "
            f"({100.0 * self.mismatched / max(self.checked, 1):.2f}%)",
            f"  Non-finite values in attended rows: {self.nonfinite}",
            f"  Greatest absolute error: {self.max_abs_error:.4g}; "
            f"greatest error/tolerance: {self.max_ratio:.4g}",
            f"  Rows with context length 0: {self.empty_rows} (declared output: "
            f"{self.empty_row_policy}; violations: {self.empty_row_violations})",
            f"  {self.tolerance}",
        ]
        if self.worst:
            lines.append("  Worst locations:")
            lines.extend(f"    {loc.describe()}" for loc in self.worst)
        if self.diagnosis:
            lines.append("  Diagnosis (what the worst rows read instead):")
            lines.extend(f"    {line}" for line in self.diagnosis)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (locations included)."""
        data = asdict(self)
        data["worst"] = [asdict(loc) | {"pages": list(loc.pages)} for loc in self.worst]
        data["diagnosis"] = list(self.diagnosis)
        return data


@dataclass(frozen=True)
class WrongElements:
    """Where a disagreeing output was wrong, per ``[row, head]`` on the host (bool): ``wrong``
    where any judged element of the row and head mismatched (non-finite ones included),
    ``finite_wrong`` where a finite element mismatched, and per row ``violations`` (an empty
    row that broke its declared output)."""

    wrong: torch.Tensor
    finite_wrong: torch.Tensor
    violations: torch.Tensor


_GRAPHS = GraphCache()  # the comparison's CUDA graphs, one per repeating signature


def _measured(actual: torch.Tensor, output: torch.Tensor, abs_output: torch.Tensor,
              logit_magnitude: torch.Tensor, context_lens: torch.Tensor,
              params: tuple[Tolerance, EmptyRowOutput]) -> tuple[torch.Tensor, ...]:
    """The comparison's device work, a pure function of its tensors (so it can be replayed
    from a CUDA graph, :mod:`difftest.primitives.cuda_graphs`): every number the verdict and the
    message need in one float64 tensor (counts are exact in float64 below 2**53; the maxima are
    float64 already), then what the worst locations read."""
    tolerance, empty_row_output = params
    ref = output
    got = actual.to(torch.float64)
    bound = tolerance.bound(Reference(output, abs_output, logit_magnitude, context_lens))
    active = (context_lens > 0)[:, None, None].expand_as(ref)
    error = (got - ref).abs()
    finite = torch.isfinite(got)
    error = torch.where(finite, error, torch.full_like(error, float("inf")))
    # an exact element is ratio 0 even where the bound is 0 (0/0 would make the maximum NaN)
    ratio = torch.where(active & (error > 0), error / bound, torch.zeros_like(error))
    mismatch = active & ~(error <= bound)

    empty = ~active[:, 0, 0]
    violations = torch.zeros_like(empty)
    if empty_row_output is EmptyRowOutput.ZERO:
        violations = empty & ~(got == 0).flatten(1).all(dim=1)
    elif empty_row_output is EmptyRowOutput.UNTOUCHED:
        violations = empty & ~torch.isnan(got).flatten(1).all(dim=1)

    zero = torch.zeros((), dtype=torch.float64, device=ref.device)
    active_err = torch.where(active, error, torch.zeros_like(error))
    counts = torch.stack([t.sum() for t in (active & ~finite, mismatch, active, empty,
                                            violations)]).to(torch.float64)
    maxima = torch.stack([active_err.max() if active_err.numel() else zero,
                          ratio.max() if ratio.numel() else zero]).to(torch.float64)
    return torch.cat((counts, maxima)), ratio, got, error, bound, mismatch, violations


def compare(
    backend: str,
    actual: torch.Tensor,
    reference: Reference,
    tolerance: Tolerance,
    empty_row_output: EmptyRowOutput,
    case: Case,
    rows: Sequence[SparseRow],
) -> Comparison:
    """Compare ``actual`` with ``reference`` element by element."""
    return compare_elements(backend, actual, reference, tolerance, empty_row_output, case,
                            rows)[0]


def compare_elements(
    backend: str,
    actual: torch.Tensor,
    reference: Reference,
    tolerance: Tolerance,
    empty_row_output: EmptyRowOutput,
    case: Case,
    rows: Sequence[SparseRow],
) -> tuple[Comparison, WrongElements | None]:
    """:func:`compare`, and where the output was wrong (``None`` when it agrees), read to the
    host before the comparison's next call reuses its buffers."""
    expected_shape = tuple(reference.output.shape)
    if tuple(actual.shape) != expected_shape:
        raise ValueError(f"{backend} returned shape {tuple(actual.shape)}, "
                         f"expected {expected_shape}")
    ref = reference.output
    args = (actual.detach().to(device=ref.device), ref, reference.abs_output,
            reference.logit_magnitude, reference.context_lens.to(ref.device))
    values, ratio, got, error, bound, mismatch, violations = _GRAPHS(
        _measured, args, (tolerance, empty_row_output))
    counts = values.tolist()  # the one device-to-host copy
    nonfinite, mismatched, checked, empty_rows, violated = (int(v) for v in counts[:5])
    max_abs_error, max_ratio = counts[5:]
    worst = _worst_locations(ratio, got, ref, error, bound, mismatch, case, rows) if (
        mismatched) else ()
    wrong = None
    if mismatched or violated:
        wrong = WrongElements(mismatch.any(dim=2).cpu(),
                              (mismatch & torch.isfinite(got)).any(dim=2).cpu(),
                              violations.cpu())
    comparison = Comparison(
        backend=backend,
        agrees=mismatched == 0 and not violated,
        checked=checked,
        mismatched=mismatched,
        nonfinite=nonfinite,
        max_abs_error=max_abs_error,
        max_ratio=max_ratio,
        empty_rows=empty_rows,
        empty_row_policy=empty_row_output.value,
        empty_row_violations=violated,
        tolerance=tolerance.describe(),
        worst=worst,
    )
    return comparison, wrong


def _worst_locations(
    ratio: torch.Tensor,
    got: torch.Tensor,
    ref: torch.Tensor,
    error: torch.Tensor,
    bound: torch.Tensor,
    mismatch: torch.Tensor,
    case: Case,
    rows: Sequence[SparseRow],
) -> tuple[Location, ...]:
    """The worst mismatching element of each of the worst rows."""
    ratio, got, ref, error, bound, mismatch = (
        t.cpu() for t in (ratio, got, ref, error, bound, mismatch))
    per_row = torch.where(mismatch, ratio, torch.zeros_like(ratio)).flatten(1)
    row_best, row_arg = per_row.max(dim=1)
    order = torch.argsort(row_best, descending=True)[:WORST_LOCATIONS]
    locations = []
    heads = case.head_dim
    for r in order.tolist():
        if row_best[r] <= 0:
            break
        flat = int(row_arg[r])
        h, d = divmod(flat, heads)
        locations.append(Location(
            row=r,
            request=case.request_of_row(r),
            query_token=case.query_token(r),
            head=h,
            dim=d,
            actual=float(got[r, h, d]),
            expected=float(ref[r, h, d]),
            error=float(error[r, h, d]),
            tolerance=float(bound[r, h, d]),
            context_len=rows[r].context_len,
            pages=row_page_ids(case, rows[r]),
        ))
    return tuple(locations)
