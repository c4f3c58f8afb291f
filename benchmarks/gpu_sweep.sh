#!/usr/bin/env bash
# One device call: GPU tests in parallel groups (each with its own time limit, failures listed with
# one line each), then the benches, one at a time. Logs, CSV and PNG under $OUT; short tables last.
# Usage (device): bash benchmarks/gpu_sweep.sh [PART,PART...]   PART: tests bf16tests precision bench
#   recipes profile wgradq parts, run in that order; default tests,recipes,parts. A part whose time limit would
#   pass DEADLINE seconds from the start (default 590: the device's 600 s per call) is skipped.
# A cold H200 spends most of a test group's time compiling kernels (one Triton compile per recipe,
# dtype and constexpr set): run one after another, the groups ran past 600 s, so they
# run side by side here (16 CPU cores) and the benches run alone after them.
set -uo pipefail
OUT=${OUT:-/tmp/moemlp-out}
WHAT=,${1:-tests,recipes,parts},
DEADLINE=${DEADLINE:-590}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  2>&1 | tee "$OUT/env.txt"

group() {  # name, time limit (s), pytest arguments...  (runs in the background)
  local name=$1 limit=$2
  shift 2
  [[ -n ${GROUPS_ONLY:-} && ,$GROUPS_ONLY, != *,$name,* ]] && return 0  # GROUPS_ONLY=a,b: only those groups
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rf --tb=short "$@" > "$OUT/tests_$name.log" 2>&1
  echo "[$name] rc=$? $(grep -E '(passed|failed)' "$OUT/tests_$name.log" | tail -1)" > "$OUT/tests_$name.sum"
  grep -E '^FAILED' "$OUT/tests_$name.log" | head -8 >> "$OUT/tests_$name.sum"
}
has() { [[ $WHAT == *,$1,* ]]; }
fits() {  # part name, its time limit: whether it can still finish before DEADLINE
  if (( SECONDS + $2 > DEADLINE )); then echo "[$1] skipped: ${SECONDS} s gone, limit $2 s, deadline ${DEADLINE} s"; return 1; fi
}

if has tests || has bf16tests; then
  start=$(date +%s)
  if has bf16tests; then
    group bf16 ${TEST_LIMIT:-230} tests/test_triton_backend.py tests/reference/test_gpu_reference.py tests/test_training_options.py \
      tests/test_contract_triton.py &
    group moe ${TEST_LIMIT:-230} tests/moe/test_moe.py tests/moe/test_dispatch.py tests/moe/test_router.py &
  fi
  if has tests; then
    group recipes_mlp ${TEST_LIMIT:-230} tests/kernels/test_mlp_recipes.py &
    group recipes_gemm ${TEST_LIMIT:-230} tests/kernels/test_gemm_fp8.py tests/kernels/test_fp8_wgrad.py tests/recipes \
      tests/kernels/test_weight_reuse.py tests/kernels/test_weight_cache.py &
    group quant_fp8 ${TEST_LIMIT:-230} tests/kernels/test_quant.py -k "gpu and fp8_block" &
    group quant_mx ${TEST_LIMIT:-230} tests/kernels/test_quant.py -k "gpu and mxfp8" &
    group quant_nv ${TEST_LIMIT:-230} tests/kernels/test_quant.py -k "gpu and nvfp4" &
    group quant_rest ${TEST_LIMIT:-230} tests/kernels/test_quant.py -k "not (gpu and (fp8_block or mxfp8 or nvfp4))" &
    group dequant ${TEST_LIMIT:-230} tests/kernels/test_dequantized.py &
  fi
  wait
  cat "$OUT"/tests_*.sum
  echo "tests: $(( $(date +%s) - start )) s wall"
  # only the tail of each log comes back (the full ones can be too long to return)
  for f in "$OUT"/tests_*.log; do tail -150 "$f" > "$f.tail"; rm "$f"; done
fi
if has precision && fits precision 60; then
  timeout 60 python3 -m moemlp precision --out "$OUT" > "$OUT/precision.log" 2>&1; tail -7 "$OUT/precision.log"
fi
if has bench && fits bench 150; then
  timeout 150 python3 -m moemlp bench --rep-ms 100 --out "$OUT" > "$OUT/bench.log" 2>&1; tail -8 "$OUT/bench.log"
fi
if has recipes && fits recipes 230; then
  # RECIPE_SHAPES="--shape mixtral-8x7b --shape deepseek-v3-ep8": fewer shapes (default: all four)
  # shellcheck disable=SC2086
  timeout 230 python3 -m moemlp bench --recipes --rep-ms 50 ${RECIPE_SHAPES:-} --out "$OUT" > "$OUT/bench_recipes.log" 2>&1
  tail -9 "$OUT/bench_recipes.log"
fi
if has profile && fits profile 110; then  # fp8_block's kernel time per step, weights cached and not
  for shape in mixtral-8x7b deepseek-v3-ep8; do
    timeout 55 python3 benchmarks/profile_recipe.py --shape $shape --recipes bf16,fp8_block,fp8_block_wcache --steps 3 \
      > "$OUT/profile_$shape.log" 2>&1
  done
  cat "$OUT"/profile_*.log > "$OUT/profile.log"; rm "$OUT"/profile_*.log; grep '^==' "$OUT/profile.log"
fi
if has wgradq && fits wgradq 120; then  # the wgrad operand quantizer's tiles and the fp8 wgrad GEMM's configs
  timeout $(( DEADLINE - SECONDS )) python3 benchmarks/bench_wgrad_quantizer.py --gemm > "$OUT/wgrad_quantizer.log" 2>&1
  grep -v Warn "$OUT/wgrad_quantizer.log" | grep -A40 '^summed'
fi
if has parts && fits parts 60; then
  timeout $(( DEADLINE - SECONDS )) python3 benchmarks/bench_recipe_parts.py --out "$OUT" > "$OUT/parts.log" 2>&1
  grep -v Warn "$OUT/parts.log" | tail -45
fi
