#!/usr/bin/env bash
# One device call: the GPU suite on this tree; the model-shape wgrad quantizer test against the
# rejected OR-ed sign ($ORSRC, expected to fail); then the A/B (main's tree in $OLD/src against this
# one, alternating rounds while time lasts); short table last.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/e4m3-nan}; OLD=${OLD:-.ab/old}; ORSRC=${ORSRC:-.ab/orsrc/src}; mkdir -p "$OUT"
DEADLINE=440 bash benchmarks/gpu_sweep.sh suite
echo "== the model-shape test on the OR-ed sign (expected to fail) after ${SECONDS} s"
PYTHONPATH=$ORSRC:tests timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant.py \
  -k model_shape --tb=line 2>&1 | grep -E "Error|passed|failed" | cut -c1-200 | head -4
for round in 1 2; do
  for tree in old new; do
    left=$(( 585 - SECONDS )); (( left < 70 )) && break 2
    src=src; [[ $tree == old ]] && src=$OLD/src
    PYTHONPATH=$src:tests timeout $left python3 experiments/e4m3_nan/time_ab.py $tree 2>&1 | grep -v -i warn \
      >> "$OUT/ab.log"
  done
  echo "round $round after ${SECONDS} s"
done
python3 - "$OUT/ab.log" <<'PY'
import sys, collections
v = collections.defaultdict(list); dig = {}
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) < 3: continue
    if p[1] == "digest": dig.setdefault(p[0], set()).add(p[2]); continue
    for kv in p[2:]:
        k, val = kv.split("=")
        v[(p[1], k, p[0])].append(float(val))
print("digests", {k: sorted(s) for k, s in dig.items()})
keys = sorted({(s, k) for s, k, _ in v})
for s, k in keys:
    o, n = v.get((s, k, "old"), []), v.get((s, k, "new"), [])
    if o and n:
        mo, mn = min(o), min(n)
        print(f"{s:16s} {k:12s} old {mo:9.2f} new {mn:9.2f}  {mo / mn:.3f}x  (old {o}, new {n})")
PY
