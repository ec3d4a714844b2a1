#!/usr/bin/env bash
# Set up (scripts/setup.sh --test) and run the test suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
# shellcheck disable=SC1091
. "${DIFFTEST_VENV:-.venv}/bin/activate"
if python -c "import ruff" >/dev/null 2>&1; then
  python -m ruff check .
else
  echo "test: ruff is not installed (offline setup), lint not run"
fi
# -rs: every skip with its reason; --durations: the slowest tests, so a log says where time went
if python -c "import xdist" >/dev/null 2>&1; then
  python -m pytest -n "${DIFFTEST_WORKERS:-2}" -rs --durations=15 "$@"
else
  echo "test: pytest-xdist is not installed (offline setup), the tests run in one process"
  python -m pytest -rs --durations=15 "$@"
fi
