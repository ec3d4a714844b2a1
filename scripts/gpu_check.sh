#!/usr/bin/env bash
# The checks a GPU machine adds to CI's CPU suite, each part's output under OUTDIR.
#
#   bash scripts/gpu_check.sh OUTDIR [run|fp|reference|suite|gluon|installed|export|speed|long|huge|all]
#
# run:   `difftest backends` and the main job over every backend, natively (an AITER
#        backend that cannot run on this GPU is --optional and says why in the report; a
#        known bug's NaN rows the bug's model does not predict show as "new failure beyond
#        known bug"), the worked plug-in of docs/plugins.md, and what the read-only check
#        of inputs costs on the device;
# gluon: ROCm with AITER: the real pa_decode_gluon (aiter-gluon, vllm-aiter) beside the
#        compiled-only backends on the same cases, so the numerics the CPU judged from the
#        emulator are the kernel's; finding F31 natively (vllm-aiter on the corpus's report
#        case, a float16 query on an fp8 cache: the kernel should fail to compile as
#        vllm-aiter@compiled does);
# fp:    the false-positive benchmark, sparse and dense families, 2000 examples each;
# reference: the reference's fused Triton kernels natively (their masks are each segment's
#        attended tokens, difftest.case.selection) against the torch formulation, and the
#        recorded inputs and verdicts bit for bit (a subset of suite, quick);
# long:  the long-context stratum (rows of 64k-256k tokens, caches past int32 element
#        offsets) with the serving terms natively;
# suite: the test suite under `pytest -n 4` (the GPU-only tests run here, not on CI);
# installed: the installed differential suite, `pytest -n 4 --pyargs difftest.kernel_tests`,
#        from a directory outside the checkout (one GPU per worker, JUnit and report kept);
# export: F28's failure recorded natively, exported (`difftest export`), and its script run
#        natively with `python -S` (no difftest on its path): it must exit 1;
# speed: docs/performance.md's GPU numbers, all in OUTDIR/speed.json (printed at the end);
#        its parts can run alone (OUTDIR speed-job, speed-shape or speed-pytest):
#   speed-job:    the README main job (`difftest run --examples 40 --jobs auto`, every backend)
#                 with an empty kernel cache, then warm: wall, cases/s, compiles per stage;
#                 then device-busy per stage over 40 of its cases (benchmarks/real_job.py);
#                 where PYTHONDONTWRITEBYTECODE is set, cold and warm again with the Python
#                 bytecode kept (OUTDIR/speed-bytecode.json);
#   speed-shape:  the production shape's cases/s pipelined and device-busy per stage
#                 (benchmarks/throughput.py);
#   speed-pytest: `pytest -n 1` and `pytest -n 4` of tests/test_differential.py on one GPU,
#                 each with an empty kernel cache.
#   Each speed part takes a few minutes (speed-job the longest: a cold main job); a part
#   stopped at SPEED_TIMEOUT seconds (default 560) keeps what it measured in speed.json.
# huge:  caches past int32 offsets (nightly) on AITER's Triton pa_decode: docs/findings.md
#        F36 says how its int32 page offsets fault interpreted; this is the GPU's symptom.
# torch, Triton, vLLM (and AITER on ROCm) come from the machine's image: nothing is installed
# here but difftest itself (`pip install --no-deps -e .` beforehand).
set -uo pipefail
out=${1:?usage: gpu_check.sh OUTDIR [run|fp|reference|suite|gluon|installed|export|speed|long|huge|all]}
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
  step plugin "$py" -m difftest.cli run --device cuda --examples 100 \
    --plugin examples/plugins/sdpa_backend.py --backends torch-sdpa --report "$out/plugin.json"
  step read_only "$py" -m benchmarks.read_only --device cuda --mib 2048
fi
if [ "$part" = fp ] || [ "$part" = all ]; then
  step fp "$py" -m benchmarks.false_positives --device cuda --examples 2000 \
    --parts 16 --workers 4 --families sparse,dense --profiles derandomized,dev \
    --json "$out/fp.json"
fi
if [ "$part" = reference ]; then
  step reference "$py" -m pytest -q -rs -p no:cacheprovider tests/test_reference_fast.py \
    tests/test_reference_magnitudes.py tests/test_bit_identical.py
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
if [ "$part" = installed ] || [ "$part" = all ]; then
  mkdir -p "$out/installed"
  step installed bash -c "cd '$out/installed' && '$py' -m pytest -n 4 -q -rs -p no:cacheprovider \
    --pyargs difftest.kernel_tests --difftest-search-budget 120 --junitxml suite.xml \
    --difftest-report report.json"
fi
if [ "$part" = export ] || [ "$part" = all ]; then
  f28=$("$py" -c 'from difftest.case.spec import Case
case = Case(num_blocks=6, seq_lens=(300, 200), block_tables=((2, 0, 5), (1, 3)),
            selections=((0, 1, 2), (0, 1, -1)), num_q_heads=16, seed=7, sliding_window=40,
            canary=True)
open("'"$out"'/f28.json", "w").write(case.to_json())
print(case.case_id)')
  step export-record "$py" -m difftest.cli export "$out/f28.json" --backend vllm-paged-decode \
    --device cuda -o "$out/export/test_f28.py"
  site=$("$py" -c 'import sys; print(":".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))')
  step export-script bash -c "cd '$out/export' && ! PYTHONPATH='$site' '$py' -S test_f28.py --device cuda"
  echo "export: case $f28" >>"$out/summary.txt"
fi
speed_timeout=${SPEED_TIMEOUT:-560}
wants() { [ "$part" = "$1" ] || [ "$part" = speed ] || [ "$part" = all ]; }
if wants speed-job; then
  step speed-job timeout "$speed_timeout" "$py" -m benchmarks.real_job --device cuda \
    --passes cold,warm --device-busy 40 --work "$out/real-job" --json "$out/speed.json"
fi
if wants speed-job && [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
  # an image that writes no bytecode has every job compile its sources (docs/performance.md):
  # the job again with the bytecode kept, after one small run that writes it
  step speed-job-bytecode env PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX="$out/pycache" \
    bash -c "'$py' -m difftest.cli run --device cuda --examples 2 --no-corpus \
      --artifacts '$out/pycache-run' >/dev/null 2>&1; timeout '$speed_timeout' '$py' \
      -m benchmarks.real_job --device cuda --passes cold,warm --work '$out/real-job-bytecode' \
      --json '$out/speed-bytecode.json'"
fi
if wants speed-shape; then
  step speed-shape timeout "$speed_timeout" "$py" -m benchmarks.throughput --shape production \
    --device cuda --cases 20 --repeats 2 --device-busy 10 --json "$out/speed.json"
fi
if wants speed-pytest; then
  step speed-pytest timeout "$speed_timeout" "$py" -m benchmarks.real_job --device cuda \
    --passes none --pytest 1,4 --work "$out/real-job" --json "$out/speed.json"
fi
case "$part" in speed | speed-* | all)
  for name in speed-job speed-job-bytecode speed-shape speed-pytest; do
    [ -f "$out/$name.txt" ] && { echo "== $name"; grep -v '^\s*$' "$out/$name.txt" | tail -n 40; }
  done
  for numbers in speed.json speed-bytecode.json; do
    [ -f "$out/$numbers" ] && { echo "== $out/$numbers"; cat "$out/$numbers"; }
  done ;;
esac
if [ "$part" = huge ] || [ "$part" = all ]; then
  step huge env HYPOTHESIS_PROFILE=nightly "$py" -m pytest -q -rs -p no:cacheprovider \
    tests/test_geometry.py -k int32 --difftest-backends aiter-pa-decode \
    --difftest-report "$out/huge.json"
fi
exit "$status"
