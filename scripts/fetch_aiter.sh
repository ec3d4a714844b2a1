#!/usr/bin/env bash
# Put one AITER release's Python tree beside the venv: bash scripts/fetch_aiter.sh NAME [DEST]
#
# NAME is a PyPI version of amd-aiter (0.1.7.post2.dev18: the pure-Python wheel, installed
# --no-deps) or a git tag of an AITER repository (v0.1.16: `git archive TAG aiter`). The
# repository is $DIFFTEST_AITER_REPO, a local clone (bare or not, read-only and another user's
# included: CI's shared ../shared/aiter/aiter-tags.git) or a URL, default
# https://github.com/ROCm/aiter.git (a URL is fetched at depth 1 into a temporary bare repo).
# DEST defaults to $DIFFTEST_AITER_ROOT/NAME (DIFFTEST_AITER_ROOT defaults to
# ~/.cache/difftest/aiter, where aiter-unified[aiter=NAME] looks); it then holds aiter/ and
# either the wheel's dist-info or a difftest-aiter-version file naming the tag's version. It is
# never on the venv's sys.path. Prints DEST's absolute path as its only line on stdout. Safe
# to run again: it does nothing when DEST holds the release.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=${1:-}
if ! [[ $NAME =~ ^v?[0-9]+\.[0-9]+\.[0-9]+([.-][0-9A-Za-z.]+)?$ ]]; then
  echo "fetch_aiter: NAME must be an amd-aiter version like 0.1.7.post2.dev18 or a tag like" \
       "v0.1.16, got '${NAME}' (usage: scripts/fetch_aiter.sh NAME [DEST])" >&2
  exit 2
fi
ROOT=${DIFFTEST_AITER_ROOT:-$HOME/.cache/difftest/aiter}
DEST=${2:-$ROOT/$NAME}
if [ -d "$DEST/aiter/ops/triton" ]; then
  echo "fetch_aiter: $DEST already holds $NAME" >&2
  cd "$DEST" && pwd
  exit 0
fi
mkdir -p "$(dirname "$DEST")"
rm -rf "$DEST.partial"
mkdir -p "$DEST.partial"
TEMP_REPO=
# a failed fetch leaves neither a partial tree nor a temporary repository behind
trap 'rm -rf "$DEST.partial" ${TEMP_REPO:+"$TEMP_REPO"}' EXIT
if [[ $NAME == v* ]]; then
  REPO=${DIFFTEST_AITER_REPO:-https://github.com/ROCm/aiter.git}
  SAFE=()
  if [ -d "$REPO" ]; then
    GIT_DIR_OF_REPO=$REPO
    # a shared repository another user owns (CI's read-only trees) is trusted for reading
    SAFE=(-c "safe.directory=$(cd "$REPO" && pwd)")
  else
    TEMP_REPO=$(mktemp -d)
    GIT_DIR_OF_REPO=$TEMP_REPO
    git init -q --bare "$GIT_DIR_OF_REPO"
    git -C "$GIT_DIR_OF_REPO" fetch -q --depth 1 "$REPO" "refs/tags/$NAME:refs/tags/$NAME"
  fi
  git ${SAFE[@]+"${SAFE[@]}"} -C "$GIT_DIR_OF_REPO" archive "$NAME" aiter | tar -x -C "$DEST.partial"
  echo "${NAME#v}" > "$DEST.partial/difftest-aiter-version"
  WHAT="tag $NAME of $REPO"
else
  PY=python3
  [ -x "${DIFFTEST_VENV:-.venv}/bin/python" ] && PY=${DIFFTEST_VENV:-.venv}/bin/python
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-compile \
    --target "$DEST.partial" "amd-aiter==$NAME" \
    2> >(grep -v "^WARNING: Location '.*' is ignored: it is neither" >&2) >&2
  WHAT="amd-aiter $NAME"
fi
[ -d "$DEST.partial/aiter/ops/triton" ] || {
  echo "fetch_aiter: $WHAT has no aiter/ops/triton" >&2; rm -rf "$DEST.partial"; exit 1; }
rm -rf "$DEST"
mv "$DEST.partial" "$DEST"
echo "fetch_aiter: put $WHAT into $DEST" >&2
cd "$DEST" && pwd
