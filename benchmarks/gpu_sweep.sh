#!/usr/bin/env bash
# One device call: GPU tests, precision, bench. Logs and CSV/PNG under $OUT; short tables last.
# Usage (device): bash benchmarks/gpu_sweep.sh [test files...]   (default: every test file)
set -uo pipefail
OUT=${OUT:-/tmp/moemlp-out}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  2>&1 | tee "$OUT/env.txt"
FILES=("$@"); [ ${#FILES[@]} -eq 0 ] && FILES=(tests)
# GPU-marked tests, plus tests that pick the GPU themselves when one is there.
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider "${FILES[@]}" 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -15
timeout 90 python3 -m moemlp precision --out "$OUT" 2>&1 | tee "$OUT/precision.log" | tail -7
timeout "${BENCH_TIMEOUT:-300}" python3 -m moemlp bench --rep-ms 100 --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -9
