"""``difftest plot``: a PNG of error/tolerance against context and page id, and the matrix."""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

import pytest

from difftest import cli
from difftest.case.spec import Case
from difftest.reporting.plot import FLOOR_RATIO, INF_RATIO, points
from difftest.reporting.report import build_report
from difftest.run.session import Session

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory, device_name: str) -> dict:
    """A real run of three cases of different lengths and page ids, plus a synthetic failure."""
    session = Session.create(["triton-unified"], device=device_name,
                             artifacts=str(tmp_path_factory.mktemp("artifacts")))
    session.run(Case(num_blocks=2, seq_lens=(130,), block_tables=((0, 1),),
                     selections=((0, 1),), seed=1))
    session.run(Case(num_blocks=128, seq_lens=(300,), block_tables=((127, 5, 64),),
                     selections=((0, 1, 2),), seed=2))
    session.run(Case(num_blocks=8, seq_lens=(1, 17), block_tables=((3,), (6,)),
                     selections=((0,), (0,)), seed=3))
    built = build_report(session.records, session.backend_entries(), session.config(),
                         session.environment)
    failing = copy.deepcopy(next(c for c in built["cases"]
                                 if max(c["features"]["context_lens"]) == 130))
    failing["case_id"] = failing["case"]["id"] = "0" * 16
    failing["results"][0]["status"] = "disagree"
    failing["results"][0]["comparison"]["max_ratio"] = float("inf")
    built["cases"].append(failing)
    return built


def test_points_are_context_page_and_ratio_per_case(report) -> None:
    found = points(report)["triton-unified"]
    assert len(found) == 4
    contexts = sorted(p[0] for p in found)
    assert contexts == [17, 130, 130, 300]
    assert max(p[1] for p in found) == 127 * 16 + 7  # logical block 0 of 300 tokens, full
    assert all(FLOOR_RATIO <= p[2] <= INF_RATIO for p in found)
    assert max(p[2] for p in found) == INF_RATIO  # a non-finite output stays visible


def test_plot_writes_a_png(tmp_path: Path, report, capsys) -> None:
    source = tmp_path / "report.json"
    source.write_text(json.dumps(report))
    assert cli.main(["plot", str(source)]) == 0
    png = tmp_path / "report.png"
    assert f"wrote {png}" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1870, 572)  # 17 x 5.2 inches at 110 dpi
    assert len(data) > 30_000  # three drawn panels, not an empty canvas


def test_plot_of_an_unreadable_report_exits_2(tmp_path: Path, capsys) -> None:
    assert cli.main(["plot", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
