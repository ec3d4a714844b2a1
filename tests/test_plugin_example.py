"""The worked plug-in of docs/plugins.md (``examples/plugins/sdpa_backend.py``) runs through
``difftest run --plugin`` and agrees with the reference, written against the public face only.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import difftest
from difftest import Case

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/plugins/sdpa_backend.py"
REFUSED = ("scaled_dot_product_attention has no logit softcap",)


def test_the_example_imports_difftest_through_its_public_face_only() -> None:
    tree = ast.parse((ROOT / EXAMPLE).read_text())
    imported = [(node.module, alias.name) for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("difftest")
                for alias in node.names]
    assert imported and {module for module, _ in imported} == {"difftest"}
    assert {name for _, name in imported} <= set(difftest.__all__)


def test_difftest_run_with_the_example_plugin_agrees(tmp_path: Path) -> None:
    """The corpus and 5 + 1 generated cases (both families, fitted to what it runs): every
    case agrees or is refused with its stated reason, and each run states its SDPA call."""
    report = tmp_path / "report.json"
    script = Path(sys.executable).with_name("difftest")
    done = subprocess.run([str(script), "run", "--plugin", EXAMPLE, "--backends", "torch-sdpa",
                           "--device", "cpu", "--examples", "5", "--artifacts",
                           str(tmp_path / "artifacts"), "--report", str(report)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [(case, result) for case in json.loads(report.read_text())["cases"]
               for result in case["results"]]
    assert {result["backend"] for _, result in results} == {"torch-sdpa"}
    statuses = [result["status"] for _, result in results]
    assert set(statuses) <= {"agree", "unsupported"} and statuses.count("agree") >= 10
    assert all(result["detail"] in REFUSED for _, result in results
               if result["status"] == "unsupported")
    agreed = [(case, result) for case, result in results if result["status"] == "agree"]
    assert all(result["calls"][0]["kernel"] == "sdpa" for _, result in agreed)
    cases = [Case.from_dict(case["case"]) for case, _ in agreed]
    assert any(c.dense and c.num_kv_heads > 1 for c in cases)  # grouped query heads
    assert any(c.sliding_window and c.canary for c in cases)  # the window's mask
    assert any(result["comparison"]["empty_rows"] for _, result in agreed)  # declared zero
