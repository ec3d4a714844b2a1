"""The conftest's wall-clock limit: a test that runs past it stops and fails, unshrunk."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the checkout's conftest.py (tests/conftest.py is another module of that name)
_spec = importlib.util.spec_from_file_location("checkout_conftest", ROOT / "conftest.py")
assert _spec is not None and _spec.loader is not None
_checkout_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_checkout_conftest)
time_limit_from_env = _checkout_conftest.time_limit_from_env
ENDLESS_SEARCH = '''
import time
from hypothesis import given, settings, strategies as st

@settings(max_examples=10**6, deadline=None, database=None)
@given(st.integers())
def test_search(x):
    time.sleep(0.2)
'''


def test_a_search_past_the_limit_fails_at_the_limit(tmp_path: Path) -> None:
    (tmp_path / "test_endless.py").write_text(ENDLESS_SEARCH)
    env = {"DIFFTEST_TEST_TIME_LIMIT": "2", "PATH": "/usr/bin:/bin"}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-q", "-p", "no:cacheprovider",
         str(tmp_path / "test_endless.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "test_endless.py::test_search (runtest) ran past 2 s" in output, output
    assert "Falsifying example" not in output, output  # stopped, not shrunk
    assert time.monotonic() - started < 60, output


def test_the_limit_is_read_from_the_environment() -> None:
    assert time_limit_from_env({}) == 600.0
    assert time_limit_from_env({"DIFFTEST_TEST_TIME_LIMIT": "0"}) == 0.0
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(pytest.UsageError, match="DIFFTEST_TEST_TIME_LIMIT="):
            time_limit_from_env({"DIFFTEST_TEST_TIME_LIMIT": bad})
