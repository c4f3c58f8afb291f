#!/usr/bin/env bash
# One device call: GPU tests in groups (each with its own time limit, failures listed with one line
# each), then precision and the benches. Logs, CSV and PNG under $OUT; short tables last.
# Usage (device): bash benchmarks/gpu_sweep.sh [tests|bench|all]   (default: all; ~9 min on an H200)
# The whole test directory took longer than one 300 s limit on the H200 (2026-11-30), so the groups
# below run separately and a group cut by its limit still leaves the others' results.
set -uo pipefail
OUT=${OUT:-/tmp/moemlp-out}
WHAT=${1:-all}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  2>&1 | tee "$OUT/env.txt"

group() {  # name, time limit (s), test files...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rf --tb=line -s "$@" > "$OUT/tests_$name.log" 2>&1
  echo "[$name] rc=$? $(grep -E '(passed|failed)' "$OUT/tests_$name.log" | tail -1)"
  grep -E '^FAILED' "$OUT/tests_$name.log" | head -8
}

if [ "$WHAT" != bench ]; then
  group bf16 150 tests/test_triton_backend.py tests/test_gpu_reference.py tests/test_training_options.py \
    tests/test_contract_triton.py
  group recipes 150 tests/test_recipes_triton.py tests/test_fp8_gemm.py tests/test_fp8_wgrad.py tests/test_recipes.py
  group quantizers 150 tests/test_quantize_triton.py tests/test_dequantized_triton.py
  group moe 90 tests/test_moe.py tests/test_dispatch.py tests/test_router.py
fi
if [ "$WHAT" != tests ]; then
  timeout 60 python3 -m moemlp precision --out "$OUT" > "$OUT/precision.log" 2>&1; tail -7 "$OUT/precision.log"
  timeout 120 python3 -m moemlp bench --rep-ms 100 --out "$OUT" > "$OUT/bench.log" 2>&1; tail -8 "$OUT/bench.log"
  timeout 70 python3 benchmarks/bench_recipe_parts.py --out "$OUT" > "$OUT/parts.log" 2>&1
  timeout 160 python3 -m moemlp bench --recipes --rep-ms 50 --out "$OUT" > "$OUT/bench_recipes.log" 2>&1
  grep -v Warn "$OUT/parts.log" | tail -40
  tail -7 "$OUT/bench_recipes.log"
fi
