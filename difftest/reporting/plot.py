"""``difftest plot REPORT``: error/tolerance against context length and page id, and the matrix.

Three panels: each backend's greatest error/tolerance per case against the case's longest
attended context and against the highest page id it attends (page-id bugs show as a cliff
past a page id, length bugs as a trend), with the tolerance at 1, results that known kernel
bugs explain wholly drawn apart (hollow, grey); and the agreement matrix, backends by
verdict, as a heat map with counts: the failing statuses count new failures only, ``known
bug`` the results known bugs explain (the split ``difftest run`` printed, from the results'
records). Needs a working matplotlib (``pip install difftest[plot]``); one that fails to load
or draw is :class:`PlotUnavailable` with the reason.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from difftest.primitives.text import printable
from difftest.reporting.report import case_records
from difftest.results.features import PAGE_ID_2_16
from difftest.results.records import FAILING, CaseRecord, Status

# Ratios of 0 (exact) or inf (non-finite output) are drawn at these, so a log axis holds them;
# NaN ratios (0/0: a zero tolerance met exactly) are left out.
FLOOR_RATIO = 1e-4
INF_RATIO = 1e4


KNOWN_BUG = "known bug"
COLUMNS = (*(s.value for s in Status if s in FAILING or s is Status.AGREE), KNOWN_BUG,
           *(s.value for s in Status if s in (Status.UNSUPPORTED, Status.UNAVAILABLE)))


def points(report: dict[str, Any], known: bool = False
           ) -> dict[str, list[tuple[int, int, float]]]:
    """backend -> ``(max context length, max page id, error/tolerance)`` per compared case:
    of the results known bugs do not explain wholly, or with ``known`` of those they do."""
    found: dict[str, list[tuple[int, int, float]]] = {}
    for case in case_records(report):
        for result in case.results:
            ratio = result.ratio
            if ratio is None or math.isnan(ratio) or result.is_known_bug != known:
                continue
            found.setdefault(result.backend, []).append(
                (max(case.features["context_lens"], default=0), case.features["max_page_id"],
                 min(max(ratio, FLOOR_RATIO), INF_RATIO)))  # inf: non-finite output
    return found


def verdict_matrix(cases: list[CaseRecord]) -> dict[str, dict[str, int]]:
    """backend -> :data:`COLUMNS` -> results: statuses, failing ones counting new failures
    only, and ``known bug`` the failing results known bugs explain wholly."""
    matrix: dict[str, dict[str, int]] = {}
    for case in cases:
        for result in case.results:
            row = matrix.setdefault(result.backend, dict.fromkeys(COLUMNS, 0))
            row[KNOWN_BUG if result.is_known_bug else result.status.value] += 1
    return matrix


class PlotUnavailable(RuntimeError):
    """The plotting library is missing or broken; the message says what failed."""


def plot_report(report: dict[str, Any], path: Path | str, title: str | None = None) -> Path:
    """Draw the report's three panels into a PNG at ``path``; :class:`PlotUnavailable`
    when matplotlib is not installed, fails to load or fails to draw."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable("matplotlib is not installed (pip install 'difftest[plot]', "
                              "or pip install matplotlib)") from exc
    except Exception as exc:  # a broken install, a bad MPLBACKEND or matplotlibrc
        backend = os.environ.get("MPLBACKEND")
        where = f" (MPLBACKEND={backend!r})" if backend else ""
        raise PlotUnavailable(f"matplotlib fails to load{where}: {type(exc).__name__}: "
                              f"{exc}") from exc
    try:
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return _draw(plt, report, Path(path), title)
    except Exception as exc:
        raise PlotUnavailable(f"matplotlib failed to draw {path}: {type(exc).__name__}: "
                              f"{exc}") from exc


def _draw(plt: Any, report: dict[str, Any], out: Path, title: str | None) -> Path:
    """The three panels, written to ``out``."""
    by_backend = points(report)
    known_bugs = points(report, known=True)
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2), gridspec_kw={"width_ratios": [1, 1, 1.1]})
    markers = "os^Dv<>PX*"
    for i, (backend, pts) in enumerate(sorted(by_backend.items())):
        for ax, column in ((axes[0], 0), (axes[1], 1)):
            ax.scatter([p[column] for p in pts], [p[2] for p in pts], s=22, alpha=0.75,
                       marker=markers[i % len(markers)], label=printable(backend))
    known = [p for pts in known_bugs.values() for p in pts]
    if known:
        for ax, column in ((axes[0], 0), (axes[1], 1)):
            ax.scatter([p[column] for p in known], [p[2] for p in known], s=40,
                       facecolors="none", edgecolors="grey", label="known bug (not new)")
    for column, (ax, xlabel) in enumerate(((axes[0], "longest attended context (tokens)"),
                                           (axes[1], "highest page id attended"))):
        ax.set_yscale("log")
        ax.set_xscale("symlog", linthresh=16, linscale=0.5)
        largest = max((p[column] for pts in (*by_backend.values(), known) for p in pts),
                      default=16)
        ax.set_xlim(0, max(largest, 16) * 2)
        ax.axhline(1.0, color="crimson", linestyle="--", linewidth=1, label="tolerance")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("error / tolerance (greatest per case)")
        ax.grid(True, which="major", alpha=0.3)
    pages = [p[1] for pts in (*by_backend.values(), known) for p in pts]
    if pages and max(pages) > PAGE_ID_2_16 // 4:
        axes[1].axvline(PAGE_ID_2_16, color="grey", linestyle=":", linewidth=1,
                        label="page id 65536")
    if by_backend or known:
        axes[0].legend(fontsize=8, loc="best")
        axes[1].legend(fontsize=8, loc="best")
    else:
        for ax in axes[:2]:
            ax.text(0.5, 0.5, "no compared cases", ha="center", transform=ax.transAxes)

    cases = case_records(report)
    matrix = verdict_matrix(cases)
    backends = sorted(matrix)
    counts = [[matrix[b][c] for c in COLUMNS] for b in backends] or [[0] * len(COLUMNS)]
    heat = axes[2]
    heat.imshow(counts, cmap="Blues", aspect="auto")
    heat.set_xticks(range(len(COLUMNS)), COLUMNS, rotation=30, ha="right")
    heat.set_yticks(range(len(backends)), [printable(b) for b in backends])
    peak = max(max(row) for row in counts) or 1
    for r, row in enumerate(counts):
        for c, value in enumerate(row):
            heat.text(c, r, str(value), ha="center", va="center",
                      color="white" if value > peak / 2 else "black")
    heat.set_title("agreement matrix (failing statuses: new failures only)")
    fp = report.get("fingerprint", {})
    where = fp.get("gpu_arch") or ("cpu (Triton interpreted)" if fp.get("triton_interpret")
                                   else "cpu")
    results = [r for c in cases for r in c.results]
    new = sum(r.is_new_failure for r in results)
    known_results = sum(r.is_known_bug for r in results)
    fig.suptitle(title or f"{len(cases)} cases on {where}; reference "
                 f"{printable(cases[0].reference) if cases else '-'}; {new} new failure(s), "
                 f"{known_results} known bug result(s)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
