"""What a case exercises (dtypes, layout, boundaries), and which of it a run showed agreeing.

A run that says "agree" is only as good as what it covered; the report carries these
features per case, and :func:`coverage_table` says, per feature, how many cases agreed on
each backend.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from difftest.case import Case
from difftest.records import NOT_RUN, CaseRecord, Status
from difftest.sparse_table import build_rows, row_page_ids

PAGE_ID_2_16 = 1 << 16


def case_features(case: Case) -> dict[str, Any]:
    """Boundary features of a case, as the report records them
    (:data:`difftest.records.FEATURE_TYPES` lists them with their types)."""
    rows = build_rows(case)
    pages = [p for row in rows for p in row_page_ids(case, row)]
    tails = [seg.tokens for row in rows for seg in row.segments[-1:]]
    last_block = case.num_blocks - 1
    return {
        "query_dtype": case.query_dtype,
        "kv_dtype": case.kv_dtype,
        "kv_layout": case.kv_layout,
        "decode_query_len": case.decode_query_len,
        "num_blocks": case.num_blocks,
        "max_page_id": max(pages, default=-1),
        "context_lens": [row.context_len for row in rows],
        "last_block_attended": any(seg.physical_block == last_block
                                   for row in rows for seg in row.segments),
        "block_0_attended": any(seg.physical_block == 0 for row in rows for seg in row.segments),
        "page_ids_past_2_16": sum(p >= PAGE_ID_2_16 for p in pages),
        "report_boundary_2039": case.num_blocks == 128 and 2039 in pages,
        "one_token_tail": 1 in tails,
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
             f"  {'feature':<{width}}  " + "  ".join(f"{b:>22}" for b in backends)]
    for label in labels:
        cells = [f"{agree.get(b, Counter())[label]}/{ran[b][label]}" for b in backends]
        lines.append(f"  {label:<{width}}  " + "  ".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)
