#!/usr/bin/env bash
# One device call: GPU tests, precision, bench. Logs and CSV/PNG under $OUT; short tables last.
# Usage (device): bash benchmarks/gpu_sweep.sh [pytest -k expression]
set -uo pipefail
OUT=${OUT:-/tmp/moemlp-out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  2>&1 | tee "$OUT/env.txt"
K=${1:-}
timeout 300 python3 -m pytest -q -m "gpu or multigpu" ${K:+-k "$K"} tests -p no:cacheprovider 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -25
timeout 120 python3 -m moemlp precision --out "$OUT" 2>&1 | tee "$OUT/precision.log" | tail -8
timeout 300 python3 -m moemlp bench --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -9
