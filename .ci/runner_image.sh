#!/usr/bin/env bash
# CI's runner-image leg: the suite on an environment built like a ROCm runner image.
#
# The "image" is a Python environment holding what such images preinstall, in versions other
# than the main leg's: torch 2.14.1, triton 3.8.0, vLLM 0.34.0 without its serving
# dependencies (--no-deps) and a stand-in `aiter` distribution (no kernels, no gluon: the real
# AITER backends must say they are unavailable and why). scripts/setup.sh makes a venv over it
# (PYTHON=<image python>), which must leave every file of the image as it was; then the tests
# that cover setup, the backends and the pytest plugin under -n run in that venv.
#
#   bash .ci/runner_image.sh [DIR]   DIR holds the image and the venvs, kept and reused (default:
#                                    a temporary directory, removed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${1:-}" ]; then
  WORK=$1
else
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT  # the image is about 6 GB (torch 2.14.1 with its CUDA libraries)
fi
IMAGE=$WORK/image
VENV=$WORK/venv
PIP=(-m pip install -q --progress-bar off --disable-pip-version-check --no-warn-conflicts)

if [ ! -x "$IMAGE/bin/python" ]; then
  python3 -m venv "$IMAGE"
  # difftest's runtime needs (scripts/setup.sh's runtime group), and pytest without
  # pytest-xdist, as on images that ship a test runner: setup adds xdist.
  "$IMAGE/bin/python" "${PIP[@]}" torch==2.14.1 triton==3.8.0 numpy packaging regex dill \
    "hypothesis>=6.100" "coverage>=7.4" "setuptools>=68" "pytest>=7.4"
  "$IMAGE/bin/python" "${PIP[@]}" --no-deps vllm==0.34.0
fi
site=$("$IMAGE/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if [ ! -d "$site/aiter" ]; then
  mkdir -p "$site/aiter" "$site/aiter-0.0.0+difftest.standin.dist-info"
  cat > "$site/aiter/__init__.py" <<'PY'
"""A stand-in for AITER in difftest's runner-image CI leg: no kernels, no gluon."""
PY
  printf 'Metadata-Version: 2.1\nName: aiter\nVersion: 0.0.0+difftest.standin\n' \
    > "$site/aiter-0.0.0+difftest.standin.dist-info/METADATA"
  printf 'aiter/__init__.py,,\n' > "$site/aiter-0.0.0+difftest.standin.dist-info/RECORD"
fi
echo "runner image: $("$IMAGE/bin/python" -c "import torch, triton, vllm, importlib.metadata as m
print(f'torch {torch.__version__}, triton {triton.__version__}, vllm {vllm.__version__}, aiter {m.version(\"aiter\")}')" 2>/dev/null)"

offline() {
  env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL PIP_NO_INDEX=1 \
    PIP_CONFIG_FILE=/dev/null PYTHON="$IMAGE/bin/python" "$@"
}
one_line() {  # setup's output must be its one summary line
  echo "$1"
  [ "$(echo "$1" | wc -l)" -eq 1 ] && grep -q '^setup (runtime+test): ' <<<"$1" || {
    echo "ci image: setup printed more than its one summary line"; exit 1; }
}
freeze_before=$("$IMAGE/bin/python" -m pip freeze --all)
stamp=$WORK/before-setup.stamp
touch "$stamp"
sleep 1
# Air-gapped first: the image has pytest but no pytest-xdist; setup and scripts/test.sh work
# without it (one process).
rm -rf "$WORK/venv-offline"
one_line "$(offline DIFFTEST_VENV="$WORK/venv-offline" bash scripts/setup.sh --test 2>&1)"
offline DIFFTEST_VENV="$WORK/venv-offline" bash scripts/test.sh -q -p no:cacheprovider \
  tests/test_setup.py
# Online: setup adds pytest-xdist and the project to the venv; then offline again.
one_line "$(PYTHON=$IMAGE/bin/python DIFFTEST_VENV=$VENV bash scripts/setup.sh --test 2>&1)"
one_line "$(offline DIFFTEST_VENV="$VENV" bash scripts/setup.sh --test 2>&1)"
changed=$(find "$IMAGE" -newer "$stamp" -type f -not -path '*/__pycache__/*' | head -n 5)
if [ "$freeze_before" != "$("$IMAGE/bin/python" -m pip freeze --all)" ] || [ -n "$changed" ]; then
  echo "ci image: setup changed the image:"; echo "$changed"
  diff <(echo "$freeze_before") <("$IMAGE/bin/python" -m pip freeze --all) || true
  exit 1
fi
echo "ci image: setup left the image unchanged (pip freeze and files)"

"$VENV/bin/difftest" backends
# Setup, the backends (real, emulated, vLLM 0.34.0's kernels) and the pytest plugin under -n.
"$VENV/bin/python" -m pytest -n "${DIFFTEST_WORKERS:-2}" -q -p no:cacheprovider -rs \
  tests/test_setup.py tests/test_registry.py tests/test_backend_protocol.py \
  tests/test_vllm_aiter.py tests/test_vllm_triton_sparse.py tests/test_aiter_gluon.py \
  tests/test_pinning.py tests/test_differential.py
