#!/usr/bin/env bash
# The checks a GPU machine adds to CI's CPU suite, each part's output under OUTDIR.
#
#   bash scripts/gpu_check.sh OUTDIR [run|fp|suite|huge|all]
#
# run:   `difftest backends` and the main job over every backend, natively (an AITER
#        backend that cannot run on this GPU is --optional and says why in the report);
# fp:    the false-positive benchmark, sparse and dense families, 2000 examples each;
# suite: the test suite under `pytest -n 4` (the GPU-only tests run here, not on CI);
# huge:  caches past int32 offsets (nightly) on AITER's Triton pa_decode: docs/findings.md
#        F36 says how its int32 page offsets fault interpreted; this is the GPU's symptom.
# torch, Triton, vLLM (and AITER on ROCm) come from the machine's image: nothing is installed
# here but difftest itself (`pip install --no-deps -e .` beforehand).
set -uo pipefail
out=${1:?usage: gpu_check.sh OUTDIR [run|fp|suite|huge|all]}
part=${2:-all}
py=${PYTHON:-python3}
mkdir -p "$out"
real=torch-ref,triton-unified,vllm-triton-sparse,vllm-paged-decode,vllm-decode-attention
aiter=aiter-unified,aiter-unified@shuffled,aiter-pa-decode,aiter-gluon@emulated,vllm-aiter@emulated
status=0

step() {  # step NAME COMMAND...: run it, keep its output and status, time it
  local name=$1; shift
  local start=$SECONDS
  "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  echo "$name: exit $rc, $((SECONDS - start)) s" | tee -a "$out/summary.txt"
  [ "$rc" -eq 0 ] || status=1
}

if [ "$part" = run ] || [ "$part" = all ]; then
  step backends "$py" -m difftest.cli backends --device cuda
  step run "$py" -m difftest.cli run --device cuda --examples 100 \
    --backends "$real,$aiter" --optional aiter-unified,aiter-unified@shuffled,aiter-pa-decode \
    --report "$out/run.json"
fi
if [ "$part" = fp ] || [ "$part" = all ]; then
  step fp "$py" -m benchmarks.false_positives --device cuda --examples 2000 \
    --parts 16 --workers 4 --families sparse,dense --profiles derandomized,dev \
    --json "$out/fp.json"
fi
if [ "$part" = suite ] || [ "$part" = all ]; then
  step suite "$py" -m pytest -n 4 -q -rs -p no:cacheprovider
fi
if [ "$part" = huge ] || [ "$part" = all ]; then
  step huge env HYPOTHESIS_PROFILE=nightly "$py" -m pytest -q -rs -p no:cacheprovider \
    tests/test_geometry.py -k int32 --difftest-backends aiter-pa-decode \
    --difftest-report "$out/huge.json"
fi
exit "$status"
