"""An earlier report's case set, to run again: ``difftest run --cases-from baseline.json``
runs exactly the baseline's cases (corpus, generated and fitted ones), so a candidate's
report has the same cases whatever its generation would draw.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

from difftest.case.casefile import case_from_object
from difftest.case.spec import Case, CaseError
from difftest.reporting.report import ReportError, case_records, read_report


def recorded_runs(path: Path | str, backends: Sequence[str],
                  case_ids: Collection[str] | None = None
                  ) -> list[tuple[Case, tuple[str, ...] | None]]:
    """Every case of the report at ``path`` (those of ``case_ids`` only, when given), in its
    order, with the backends of ``backends`` that ran it there (a fitted variant runs on
    those only); ``None`` (every backend of this run) where the report names none of them, as
    when the release is in the name (``triton-unified[vllm=0.33.0]`` against
    ``[vllm=0.34.0]``).

    :class:`~difftest.reporting.report.ReportError` names the file and the entry it cannot
    read, or a case id of ``case_ids`` the report does not hold.
    """
    runs: list[tuple[Case, tuple[str, ...] | None]] = []
    records = case_records(read_report(path))
    if case_ids is not None:
        missing = sorted(set(case_ids) - {r.case_id for r in records})
        if missing:
            raise ReportError(f"{path}: holds no case {missing[0]} (--case-ids: "
                              f"{len(missing)} of {len(set(case_ids))} not in it)")
        records = [r for r in records if r.case_id in case_ids]
    for i, record in enumerate(records):
        try:
            case = case_from_object(record.case)  # checked as a case file is
        except (CaseError, TypeError, ValueError) as exc:
            raise ReportError(f"{path}: cases[{i}].case: {exc}") from exc
        names = tuple(r.backend for r in record.results if r.backend in backends)
        runs.append((case, names or None))
    return runs
