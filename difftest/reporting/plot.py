"""``difftest plot REPORT``: error/tolerance against context length and page id, and the matrix.

Three panels: each backend's greatest error/tolerance per case against the case's longest
attended context and against the highest page id it attends (page-id bugs show as a cliff
past a page id, length bugs as a trend), with the tolerance at 1; and the agreement matrix,
backends by status, as a heat map with counts. Needs matplotlib (``pip install difftest[plot]``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from difftest.reporting.report import case_records, status_matrix
from difftest.results.features import PAGE_ID_2_16
from difftest.results.records import STATUSES, Status

# Ratios of 0 (exact) or inf (non-finite output) are drawn at these, so a log axis holds them;
# NaN ratios (0/0: a zero tolerance met exactly) are left out.
FLOOR_RATIO = 1e-4
INF_RATIO = 1e4


def points(report: dict[str, Any]) -> dict[str, list[tuple[int, int, float]]]:
    """backend -> ``(max context length, max page id, error/tolerance)`` per compared case."""
    found: dict[str, list[tuple[int, int, float]]] = {}
    for case in case_records(report):
        for result in case.results:
            ratio = result.ratio
            if ratio is None or math.isnan(ratio):
                continue
            found.setdefault(result.backend, []).append(
                (max(case.features["context_lens"], default=0), case.features["max_page_id"],
                 min(max(ratio, FLOOR_RATIO), INF_RATIO)))  # inf: non-finite output
    return found


class PlotUnavailable(RuntimeError):
    """The plotting library is missing; the message says what to install."""


def plot_report(report: dict[str, Any], path: Path | str, title: str | None = None) -> Path:
    """Draw the report's three panels into a PNG at ``path``; :class:`PlotUnavailable`
    when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable("matplotlib is not installed (pip install 'difftest[plot]', "
                              "or pip install matplotlib)") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_backend = points(report)
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2), gridspec_kw={"width_ratios": [1, 1, 1.1]})
    markers = "os^Dv<>PX*"
    for i, (backend, pts) in enumerate(sorted(by_backend.items())):
        for ax, column in ((axes[0], 0), (axes[1], 1)):
            ax.scatter([p[column] for p in pts], [p[2] for p in pts], s=22, alpha=0.75,
                       marker=markers[i % len(markers)], label=backend)
    for column, (ax, xlabel) in enumerate(((axes[0], "longest attended context (tokens)"),
                                           (axes[1], "highest page id attended"))):
        ax.set_yscale("log")
        ax.set_xscale("symlog", linthresh=16, linscale=0.5)
        largest = max((p[column] for pts in by_backend.values() for p in pts), default=16)
        ax.set_xlim(0, max(largest, 16) * 2)
        ax.axhline(1.0, color="crimson", linestyle="--", linewidth=1, label="tolerance")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("error / tolerance (greatest per case)")
        ax.grid(True, which="major", alpha=0.3)
    pages = [p[1] for pts in by_backend.values() for p in pts]
    if pages and max(pages) > PAGE_ID_2_16 // 4:
        axes[1].axvline(PAGE_ID_2_16, color="grey", linestyle=":", linewidth=1,
                        label="page id 65536")
    if by_backend:
        axes[0].legend(fontsize=8, loc="best")
        axes[1].legend(fontsize=8, loc="best")
    else:
        for ax in axes[:2]:
            ax.text(0.5, 0.5, "no compared cases", ha="center", transform=ax.transAxes)

    cases = case_records(report)
    matrix = status_matrix(cases)
    backends = sorted(matrix)
    counts = [[matrix[b][s] for s in Status] for b in backends] or [[0] * len(STATUSES)]
    heat = axes[2]
    heat.imshow(counts, cmap="Blues", aspect="auto")
    heat.set_xticks(range(len(STATUSES)), STATUSES, rotation=30, ha="right")
    heat.set_yticks(range(len(backends)), backends)
    peak = max(max(row) for row in counts) or 1
    for r, row in enumerate(counts):
        for c, value in enumerate(row):
            heat.text(c, r, str(value), ha="center", va="center",
                      color="white" if value > peak / 2 else "black")
    heat.set_title("agreement matrix (cases per backend and status)")
    fp = report.get("fingerprint", {})
    where = fp.get("gpu_arch") or ("cpu (Triton interpreted)" if fp.get("triton_interpret")
                                   else "cpu")
    fig.suptitle(title or f"{len(cases)} cases on {where}; "
                 f"reference {cases[0].reference if cases else '-'}")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
