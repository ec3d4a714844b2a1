"""A report as JUnit XML, for CI systems that read test results (``difftest run --junit``).

One ``<testsuite>`` per backend under test, one ``<testcase>`` per (case, backend): a
disagreement is a ``<failure>``, an error or a crash an ``<error>``, each with its message
and the command that replays the case; ``unsupported`` and ``unavailable`` results are
``<skipped>`` with their reasons; a failure a known bug explains (docs/findings.md) is
``<skipped type="known-bug">`` naming the finding, with the failure's message and replay
command, as pytest writes an expected failure. A last suite, ``difftest run``, holds what
fails a run beyond its cases: crashes an earlier run left, backends asked for that could not
run, expected bugs that did not show. Format: docs/workflows.md.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from difftest.case.casefile import case_from_object
from difftest.judgement.expectations import judge
from difftest.judgement.expectations import load as load_expectations
from difftest.primitives.jsonfile import write_text
from difftest.reporting.report import case_records
from difftest.results.artifacts import repro_command
from difftest.results.records import CaseRecord, ResultRecord, Status

RUN_SUITE = "difftest run"


def known_bugs(report: dict[str, Any]) -> dict[tuple[str, str], str]:
    """``(case id, backend)`` -> the finding of the known bug that explains that failing
    result (:func:`difftest.judgement.expectations.judge` over the report's records)."""
    judgement = judge(case_records(report), load_expectations())
    return {(case.case_id, result.backend): finding
            for finding, pairs in judgement.known.items() for case, result in pairs}


def expected_bugs_not_seen(report: dict[str, Any]) -> list[str]:
    """The strict expected bugs that no failure of the report showed (each fails the run)."""
    return judge(case_records(report), load_expectations()).strict_unseen


def _message(case: CaseRecord, result: ResultRecord) -> str:
    """The failure text of one result, as the run prints it."""
    if result.status is Status.DISAGREE and result.comparison is not None:
        return result.comparison.message(case_from_object(case.case), case.reference)
    return f"{result.backend} {result.status.value} on case {case.case_id}:\n{result.detail}"


def _testcase(suite: ET.Element, case: CaseRecord, result: ResultRecord,
              known: str | None, plugins: tuple[str, ...]) -> str:
    """Add the testcase of ``result``; returns its outcome (``passed``, ``failures``,
    ``errors``, ``skipped``)."""
    name = f"{case.case_id} {case.name}".rstrip()
    element = ET.SubElement(suite, "testcase", name=name, classname=f"difftest.{result.backend}",
                            time=f"{result.seconds:.6f}")
    if result.ratio is not None or known:
        properties = ET.SubElement(element, "properties")
        if result.ratio is not None:
            ET.SubElement(properties, "property", name="error/tolerance",
                          value=f"{result.ratio:.6g}")
        if known:
            ET.SubElement(properties, "property", name="known_bug", value=known)
    if result.status is Status.AGREE:
        return "passed"
    if result.status in (Status.UNSUPPORTED, Status.UNAVAILABLE):
        ET.SubElement(element, "skipped", message=f"{result.status.value}: {result.detail}")
        return "skipped"
    text = _message(case, result)
    if case.artifact:
        text += f"\n\nreplay: {repro_command(case.artifact, plugins)}"
    if known:
        tag, kind, outcome = "skipped", "known-bug", "skipped"
        headline = f"known bug {known} (docs/findings.md {known}): {result.status.value}"
    else:
        failure = result.status is Status.DISAGREE
        tag, kind = ("failure", "disagree") if failure else ("error", result.status.value)
        outcome = "failures" if failure else "errors"
        headline = text.splitlines()[0]
    ET.SubElement(element, tag, type=kind, message=headline).text = text
    return outcome


def junit_xml(report: dict[str, Any], missing: Sequence[str] = ()) -> str:
    """The JUnit XML document of ``report``; ``missing``: the lines of backends asked for
    that could not run (:func:`difftest.reporting.report.unavailable_asked`)."""
    known = known_bugs(report)
    plugins = tuple(report.get("config", {}).get("plugins", ()))
    root = ET.Element("testsuites", name="difftest")
    suites: dict[str, ET.Element] = {}
    counts: dict[str, dict[str, int]] = {}
    for case in case_records(report):
        for result in case.results:
            suite = suites.get(result.backend)
            if suite is None:
                suite = suites[result.backend] = ET.SubElement(root, "testsuite",
                                                               name=result.backend)
            outcome = _testcase(suite, case, result, known.get((case.case_id, result.backend)),
                                plugins)
            tally = counts.setdefault(result.backend, {})
            tally[outcome] = tally.get(outcome, 0) + 1
            tally["time"] = tally.get("time", 0) + int(result.seconds * 1e6)
    run = ET.SubElement(root, "testsuite", name=RUN_SUITE)
    run_tally: dict[str, int] = {}
    checks = [(f"earlier crash {c.case_id}",
               f"an earlier run died in case {c.case_id}: replay with "
               f"{repro_command(c.artifact or '-', c.plugins or ())}")
              for c in case_records(report, "earlier_crashes")]
    checks += [(f"asked-for backend {line.split()[1]}", line) for line in missing]
    checks += [(f"expected bug {finding} shows",
                f"expected bug {finding} did not show: the cases met its condition on a "
                "release listed as having it and none failed (fixed? revisit its entry in "
                "the expectations file)") for finding in expected_bugs_not_seen(report)]
    for name, text in checks:
        element = ET.SubElement(run, "testcase", name=name, classname="difftest.run", time="0")
        ET.SubElement(element, "failure", type="run", message=text).text = text
        run_tally["failures"] = run_tally.get("failures", 0) + 1
    suites[RUN_SUITE], counts[RUN_SUITE] = run, run_tally
    total: dict[str, int] = {}
    for name, suite in suites.items():
        tally = counts[name]
        attributes = {"tests": sum(tally.get(k, 0) for k in ("passed", "failures", "errors",
                                                               "skipped")),
                      "failures": tally.get("failures", 0), "errors": tally.get("errors", 0),
                      "skipped": tally.get("skipped", 0)}
        for key, value in attributes.items():
            suite.set(key, str(value))
            total[key] = total.get(key, 0) + value
        suite.set("time", f"{tally.get('time', 0) / 1e6:.6f}")
        total["time"] = total.get("time", 0) + tally.get("time", 0)
    for key in ("tests", "failures", "errors", "skipped"):
        root.set(key, str(total.get(key, 0)))
    root.set("time", f"{total.get('time', 0) / 1e6:.6f}")
    run.set("timestamp", report.get("created", ""))
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, "unicode") + "\n"


def write_junit(path: Path | str, report: dict[str, Any], missing: Sequence[str] = ()) -> None:
    """Write :func:`junit_xml` of ``report`` to ``path``, atomically."""
    write_text(Path(path), junit_xml(report, missing))
