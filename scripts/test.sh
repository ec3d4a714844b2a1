#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check .
python -m pytest -n "${DIFFTEST_WORKERS:-2}" "$@"
