#!/usr/bin/env bash
# The checks a GPU machine adds to CI's CPU suite, each part's output under OUTDIR.
#
#   bash scripts/gpu_check.sh OUTDIR [run|fp|suite|gluon|long|all]
#
# run:   `difftest backends` and the main job over every backend, natively (an AITER
#        backend that cannot run on this GPU is --optional and says why in the report), and
#        the worked plug-in of docs/plugins.md;
# gluon: ROCm with AITER: the real pa_decode_gluon (aiter-gluon, vllm-aiter) beside the
#        compiled-only backends on the same cases, so the numerics the CPU judged from the
#        emulator are the kernel's; finding F31 natively (vllm-aiter on the corpus's report
#        case, a float16 query on an fp8 cache: the kernel should fail to compile as
#        vllm-aiter@compiled does);
# fp:    the false-positive benchmark, sparse and dense families, 2000 examples each;
# long:  the long-context stratum (rows of 64k-256k tokens, caches past int32 element
#        offsets) with the serving terms natively, and the kernel modes the CPU cannot
#        interpret (fp8 queries) beside the serving terms in the main job's cases;
# suite: the test suite under `pytest -n 4` (the GPU-only tests run here, not on CI).
# torch, Triton, vLLM (and AITER on ROCm) come from the machine's image: nothing is installed
# here but difftest itself (`pip install --no-deps -e .` beforehand).
set -uo pipefail
out=${1:?usage: gpu_check.sh OUTDIR [run|fp|suite|gluon|long|all]}
part=${2:-all}
py=${PYTHON:-python3}
mkdir -p "$out"
real=torch-ref,triton-unified,vllm-triton-sparse,vllm-paged-decode,vllm-decode-attention
aiter=aiter-unified,aiter-unified@shuffled,aiter-gluon@emulated,vllm-aiter@emulated
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
    --backends "$real,$aiter" --optional aiter-unified,aiter-unified@shuffled \
    --report "$out/run.json"
  step plugin "$py" -m difftest.cli run --device cuda --examples 100 \
    --plugin examples/plugins/sdpa_backend.py --backends torch-sdpa --report "$out/plugin.json"
fi
if [ "$part" = fp ] || [ "$part" = all ]; then
  step fp "$py" -m benchmarks.false_positives --device cuda --examples 2000 \
    --parts 16 --workers 4 --families sparse,dense --profiles derandomized,dev \
    --json "$out/fp.json"
fi
if [ "$part" = gluon ] || [ "$part" = all ]; then
  gluon=aiter-gluon,vllm-aiter,aiter-gluon@compiled,vllm-aiter@compiled
  step gluon "$py" -m difftest.cli run --device cuda --examples 40 \
    --backends "torch-ref,$gluon" --optional "$gluon" --report "$out/gluon.json"
fi
if [ "$part" = long ] || [ "$part" = all ]; then
  step long "$py" -m pytest -q -rs -p no:cacheprovider tests/test_serving_terms.py \
    -k natively
fi
if [ "$part" = suite ] || [ "$part" = all ]; then
  step suite "$py" -m pytest -n 4 -q -rs -p no:cacheprovider
fi
exit "$status"
