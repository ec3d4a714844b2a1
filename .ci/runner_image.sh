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
started=$SECONDS
if [ -n "${1:-}" ]; then
  WORK=$1
else
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT  # the image is about 6 GB (torch 2.14.1 with its CUDA libraries)
fi
IMAGE=$WORK/image
VENV=$WORK/venv
PIP=(-m pip install -q --progress-bar off --disable-pip-version-check --no-warn-conflicts)
image_pip() {  # pip into the image; an index set as a local folder without the package is no news
  "$IMAGE/bin/python" "${PIP[@]}" "$@" 2>&1 \
    | { grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor" || true; }
}

if [ ! -f "$IMAGE/built" ]; then  # built whole or not at all (a kept DIR after an interrupt)
  rm -rf "$IMAGE"
  python3 -m venv "$IMAGE"
  # difftest's runtime needs (scripts/setup.sh's runtime group), and pytest without
  # pytest-xdist, as on images that ship a test runner: setup adds xdist. torch 2.14.1 (a
  # CUDA build, 5.5 GB unpacked) is on the CI machines' local wheel disk: no download.
  image_pip torch==2.14.1 triton==3.8.0 numpy packaging regex dill "hypothesis>=6.100" \
    "coverage>=7.4" "setuptools>=68" "pytest>=7.4"
  image_pip --no-deps vllm==0.34.0
  site=$("$IMAGE/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  # The stand-in AITER: a distribution named aiter, without kernels or gluon.
  mkdir -p "$site/aiter" "$site/aiter-0.0.0+difftest.standin.dist-info"
  cat > "$site/aiter/__init__.py" <<'PY'
"""A stand-in for AITER in difftest's runner-image CI leg: no kernels, no gluon."""
PY
  printf 'Metadata-Version: 2.1\nName: aiter\nVersion: 0.0.0+difftest.standin\n' \
    > "$site/aiter-0.0.0+difftest.standin.dist-info/METADATA"
  printf 'aiter/__init__.py,,\n' > "$site/aiter-0.0.0+difftest.standin.dist-info/RECORD"
  touch "$IMAGE/built"
  echo "ci image: built the image in $((SECONDS - started)) s"
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
rm -rf "$VENV"
one_line "$(PYTHON=$IMAGE/bin/python DIFFTEST_VENV=$VENV bash scripts/setup.sh --test 2>&1)"
summary=$(offline DIFFTEST_VENV="$VENV" bash scripts/setup.sh --test 2>&1)
one_line "$summary"
# vLLM 0.34.0's sparse_pa.py imports its quantization utils, which pull in the serving stack
# the image lacks: setup must say which backend that leaves out, and why.
grep -q "kernels import partly, unavailable: vllm-aiter@emulated (vLLM 0.34.0's .* needs the \
module '" <<<"$summary" || { echo "ci image: setup did not name vllm-aiter@emulated as unavailable"
  exit 1; }
image_unchanged() {  # by setup and what ran after it: pip freeze and every file as they were
  local changed
  changed=$(find "$IMAGE" -newer "$stamp" -type f -not -path '*/__pycache__/*' | head -n 5)
  if [ "$freeze_before" != "$("$IMAGE/bin/python" -m pip freeze --all)" ] || [ -n "$changed" ]
  then
    echo "ci image: $1 changed the image:"; echo "$changed"
    diff <(echo "$freeze_before") <("$IMAGE/bin/python" -m pip freeze --all) || true
    exit 1
  fi
  echo "ci image: $1 left the image unchanged (pip freeze and files)"
}
image_unchanged setup

"$VENV/bin/difftest" backends
# Setup, the backends (real, emulated, vLLM 0.34.0's kernels; the tests of vllm-aiter skip
# naming the module its kernel lacks), the CLI and the pytest plugin under -n, through the
# README's test command.
DIFFTEST_VENV=$VENV bash scripts/test.sh -q -p no:cacheprovider \
  tests/test_setup.py tests/test_registry.py tests/test_backend_protocol.py \
  tests/test_vllm_aiter.py tests/test_vllm_aiter_irregular.py tests/test_builder_crosscheck.py \
  tests/test_pa_decode_gluon_emulator.py tests/test_vllm_triton_sparse.py \
  tests/test_aiter_gluon.py tests/test_cli.py tests/test_pinning.py tests/test_differential.py
image_unchanged "the tests"
echo "ci image: the runner-image leg took $((SECONDS - started)) s"
