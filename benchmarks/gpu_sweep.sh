#!/usr/bin/env bash
# One device call: the GPU suite, then the benches, one at a time. Logs and CSV under $OUT; short
# tables last.
# Usage (device): bash benchmarks/gpu_sweep.sh [PART,PART...]   PART: suite gluon tables partsfp8 precision
#   bench partsbf16 recipes profile wgradq wgradq4 parts shapes shapes256, run in that order; default
#   suite,partsfp8,recipes. A part whose time limit would pass DEADLINE seconds from the start
#   (default 590: the device's 600 s per call) is skipped; the suite's limit shrinks to what is left,
#   down to 420 s.
# tables: the README's three tables from one machine in one call (a warm one, after the suite's):
#   bench, precision, then bench --recipes at the four model shapes, whatever SHAPES says.
# suite: every test, as the README runs them (-n 8; 4 to over 7 minutes on a cold host, most of it
# kernel compiles, so it leaves no room for another part in the same call); gluon: the Gluon
# engine's tests alone.
# `bash benchmarks/gpu_sweep.sh tree` (at the repository root) prints only the hash of the sources that env.txt names,
# to tell which checkout a device's copied working tree was (its .git may name another commit).
set -uo pipefail
tree=$(find src tests benchmarks -type f \( -name '*.py' -o -name '*.sh' \) -not -path '*/__pycache__/*' \
  | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12)
if [[ ${1:-} == tree ]]; then echo "$tree"; exit 0; fi
OUT=${OUT:-/tmp/moemlp-out}
WHAT=,${1:-suite,partsfp8,recipes},
DEADLINE=${DEADLINE:-590}
SHAPES=${SHAPES:---shape mixtral-8x7b --shape deepseek-v3-ep8}
mkdir -p "$OUT"
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
{ date -u; echo "source tree $tree";
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  2>&1 | tee "$OUT/env.txt"

has() { [[ $WHAT == *,$1,* ]]; }
fits() {  # part name, its time limit: whether it can still finish before DEADLINE
  if (( SECONDS + $2 > DEADLINE )); then echo "[$1] skipped: ${SECONDS} s gone, limit $2 s, deadline ${DEADLINE} s"; return 1; fi
}
tests() {  # name, time limit (s), pytest arguments...: a summary line and the failures, the log's tail kept
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m pytest -q -n 8 -p no:cacheprovider -rf --tb=short --durations=15 "$@" \
    > "$OUT/$name.log" 2>&1
  echo "[$name] rc=$? $(grep -E '(passed|failed)' "$OUT/$name.log" | tail -1) after ${SECONDS} s"
  grep -E '^FAILED' "$OUT/$name.log" | head -12
  tail -200 "$OUT/$name.log" > "$OUT/$name.log.tail"; rm "$OUT/$name.log"
}

# The suite: 570 s, or what is left before DEADLINE where that is less, but not under 420 s (a cold
# H100's pytest took 314 s), so that a DEADLINE a little under 570 still runs it.
if has suite && fits suite 420; then tests suite $(( DEADLINE - SECONDS < 570 ? DEADLINE - SECONDS : 570 )); fi
if has gluon && fits gluon 200; then tests gluon 200 tests/kernels/test_gluon_*.py; fi
if has tables && fits tables 480; then
  timeout 170 python3 -m moemlp bench --rep-ms 100 --out "$OUT" > "$OUT/bench.log" 2>&1
  echo "[bench] rc=$? after ${SECONDS} s"; tail -8 "$OUT/bench.log"
  timeout 60 python3 -m moemlp precision --out "$OUT" > "$OUT/precision.log" 2>&1
  echo "[precision] rc=$? after ${SECONDS} s"; tail -7 "$OUT/precision.log"
  # the four shapes took 254 s on a cold H100; what is left before DEADLINE, at least 240 s
  timeout $(( DEADLINE - SECONDS > 240 ? DEADLINE - SECONDS : 240 )) python3 -m moemlp bench --recipes --rep-ms 50 \
    --shape qwen3-30b-a3b --shape mixtral-8x7b --shape deepseek-v3-ep8 --shape gpt-oss-120b --out "$OUT" \
    > "$OUT/bench_recipes.log" 2>&1
  echo "[recipes] rc=$? after ${SECONDS} s"; tail -9 "$OUT/bench_recipes.log"
fi
if has partsfp8 && fits partsfp8 120; then
  # shellcheck disable=SC2086
  timeout 120 python3 -m moemlp bench --parts --recipes $SHAPES --rep-ms 40 --out "$OUT" > "$OUT/parts_fp8.log" 2>&1
  tail -32 "$OUT/parts_fp8.log"
fi
if has precision && fits precision 60; then
  timeout 60 python3 -m moemlp precision --out "$OUT" > "$OUT/precision.log" 2>&1; tail -7 "$OUT/precision.log"
fi
if has bench && fits bench 150; then
  timeout 150 python3 -m moemlp bench --rep-ms 100 --out "$OUT" > "$OUT/bench.log" 2>&1; tail -8 "$OUT/bench.log"
fi
if has partsbf16 && fits partsbf16 110; then  # the six bf16 GEMMs of a step, each alone (the README's parts table)
  timeout 110 python3 -m moemlp bench --parts --rep-ms 40 --out "$OUT" > "$OUT/parts_bf16.log" 2>&1; tail -9 "$OUT/parts_bf16.log"
fi
if has recipes && fits recipes 230; then
  # shellcheck disable=SC2086
  timeout 230 python3 -m moemlp bench --recipes --rep-ms 50 $SHAPES --out "$OUT" > "$OUT/bench_recipes.log" 2>&1
  tail -9 "$OUT/bench_recipes.log"
fi
if has profile && fits profile 250; then  # fp8_block's kernel time per step, weights cached and not
  # 120 s a shape: 60 s ran out at mixtral and deepseek-v3 on a cold machine (warm-up steps that
  # compile, then profiled steps of 25-30 ms each recipe).
  for shape in mixtral-8x7b deepseek-v3-ep8; do
    timeout 120 python3 benchmarks/profile_recipe.py --shape $shape --recipes bf16,fp8_block,fp8_block_wcache --steps 3 \
      > "$OUT/profile_$shape.log" 2>&1
  done
  cat "$OUT"/profile_*.log > "$OUT/profile.log"; rm "$OUT"/profile_*.log; grep '^==' "$OUT/profile.log"
fi
if has wgradq && fits wgradq 120; then  # the wgrad operand quantizer's tiles and the fp8 wgrad GEMM's configs
  timeout $(( DEADLINE - SECONDS )) python3 benchmarks/bench_wgrad_quantizer.py --gemm > "$OUT/wgrad_quantizer.log" 2>&1
  grep -v Warn "$OUT/wgrad_quantizer.log" | grep -A40 '^summed'
fi
if has wgradq4 && fits wgradq4 120; then  # nvfp4's wgrad operand quantizer tiles, plain and with its options
  timeout $(( DEADLINE - SECONDS )) python3 benchmarks/bench_wgrad_quantizer.py --shapes qwen3-30b-a3b,mixtral-8x7b \
    --recipes "nvfp4,nvfp4:hadamard=1,stochastic_rounding=1" > "$OUT/wgrad_quantizer_nvfp4.log" 2>&1
  grep -v Warn "$OUT/wgrad_quantizer_nvfp4.log" | grep -A6 '^summed'
fi
if has parts && fits parts 60; then
  timeout $(( DEADLINE - SECONDS )) python3 benchmarks/bench_recipe_parts.py --out "$OUT" > "$OUT/parts.log" 2>&1
  grep -v Warn "$OUT/parts.log" | tail -45
fi
if has shapes && fits shapes 300; then  # shapes users bring beyond the four models, and skewed routing
  # (H,F,E,TOP_K,TOKENS[:SKEW]): deepseek-moe-16b, Phi-3.5-MoE, DBRX and Llama-4-Scout's expert blocks;
  # mixtral and qwen3 with routing skewed toward the first experts. Each shape compiles the peer anew.
  timeout 300 python3 -m moemlp bench --rep-ms 50 --out "$OUT/shapes" --shape 2048,1408,64,6,8192 \
    --shape 4096,6400,16,2,8192 --shape 6144,10752,16,4,4096 --shape 5120,8192,16,1,8192 \
    --shape 4096,14336,8,2,8192:1.2 --shape 2048,768,128,8,4096:1 > "$OUT/shapes.log" 2>&1
  tail -12 "$OUT/shapes.log"
fi
if has shapes256 && fits shapes256 200; then  # 256 experts: deepseek-v3's expert block without expert
  # parallelism (128 rows an expert); ~45 GB of weights and their gradients, so a run of its own
  timeout 200 python3 -m moemlp bench --rep-ms 50 --out "$OUT/shapes256" --shape 7168,2048,256,8,4096 \
    > "$OUT/shapes256.log" 2>&1
  tail -6 "$OUT/shapes256.log"
fi
