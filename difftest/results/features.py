"""What a case exercises (dtypes, layout, boundaries), and which of it a run showed agreeing.

A run that says "agree" is only as good as what it covered; the report carries these
features per case, and :func:`coverage_table` says, per feature, how many cases agreed on
each backend.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from difftest.case.selection import SparseRow, build_rows
from difftest.case.spec import Case
from difftest.primitives.text import printable
from difftest.results.records import NOT_RUN, CaseRecord, Status

PAGE_ID_2_16 = 1 << 16


def case_features(case: Case, rows: tuple[SparseRow, ...] | None = None) -> dict[str, Any]:
    """Boundary features of a case, as the report records them
    (:data:`difftest.results.records.FEATURE_TYPES` lists them with their types).

    ``rows``: the case's :func:`difftest.case.selection.build_rows`, when the caller has them.
    Page ids are counted per segment (a segment reads the consecutive pages
    ``base .. base + n - 1``, :func:`difftest.case.selection.row_page_ids`) rather than listed:
    a production case reads 16384 pages.
    """
    rows = build_rows(case) if rows is None else rows
    last_block, stride = case.num_blocks - 1, case.block_page_stride
    max_page, past_2_16, has_2039, last_attended, block_0, one_token_tail = (
        -1, 0, False, False, False, False)
    for row in rows:
        for seg in row.segments:
            last_attended = last_attended or seg.physical_block == last_block
            block_0 = block_0 or seg.physical_block == 0
            n = -(-seg.tokens // case.page_size)
            if n <= 0:
                continue
            base = seg.physical_block * stride
            max_page = max(max_page, base + n - 1)
            past_2_16 += max(0, min(n, base + n - PAGE_ID_2_16))
            has_2039 = has_2039 or base <= 2039 < base + n
        one_token_tail = one_token_tail or (bool(row.segments) and row.segments[-1].tokens == 1)
    return {
        "query_dtype": case.query_dtype,
        "kv_dtype": case.kv_dtype,
        "kv_layout": case.kv_layout,
        # the most query tokens of a request (decode_query_len, or the longest query_lens)
        "decode_query_len": max((case.query_len(r) for r in range(case.batch)),
                                default=case.decode_query_len),
        "num_blocks": case.num_blocks,
        "max_page_id": max_page,
        "context_lens": [row.context_len for row in rows],
        "last_block_attended": last_attended,
        "block_0_attended": block_0,
        "page_ids_past_2_16": past_2_16,
        "report_boundary_2039": case.num_blocks == 128 and has_2039,
        "one_token_tail": one_token_tail,
        "empty_rows": sum(row.context_len == 0 for row in rows),
        "scales": [case.k_scale, case.v_scale],
    }


def _labels(features: dict[str, Any]) -> list[str]:
    labels = [
        f"query {features['query_dtype']}",
        f"kv {features['kv_dtype']}",
        f"layout {features['kv_layout']}",
        f"query tokens/request {features['decode_query_len']}",
    ]
    flags = {
        "last physical block attended": features["last_block_attended"],
        "page id 2039 at 128 blocks": features["report_boundary_2039"],
        "page ids past 65536": features["page_ids_past_2_16"] > 0,
        "one-token tail": features["one_token_tail"],
        "rows with context 0": features["empty_rows"] > 0,
    }
    return labels + [name for name, hit in flags.items() if hit]


def coverage_table(cases: list[CaseRecord]) -> str:
    """Per feature and backend: agreeing cases / cases run (unsupported ones not counted)."""
    agree: dict[str, Counter[str]] = {}
    ran: dict[str, Counter[str]] = {}
    for case in cases:
        for label in _labels(case.features):
            for result in case.results:
                if result.status in NOT_RUN:
                    continue
                ran.setdefault(result.backend, Counter())[label] += 1
                if result.status is Status.AGREE:
                    agree.setdefault(result.backend, Counter())[label] += 1
    if not ran:
        return "coverage: no backend ran"
    backends = sorted(ran)
    labels = sorted({label for counts in ran.values() for label in counts})
    width = max(len(label) for label in labels)
    lines = ["coverage (agreeing / run):",
             f"  {'feature':<{width}}  " + "  ".join(f"{printable(b):>22}" for b in backends)]
    for label in labels:
        cells = [f"{agree.get(b, Counter())[label]}/{ran[b][label]}" for b in backends]
        lines.append(f"  {label:<{width}}  " + "  ".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)
