#!/usr/bin/env bash
# One device call: the GPU suite (the exhaustive division test among it), then the A/B (main's tree
# in $OLD/src against this one, alternating rounds while time lasts); short table last.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/scale-div}; OLD=${OLD:-.ab/old}; mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } 2>&1
DEADLINE=430 bash benchmarks/gpu_sweep.sh suite
for round in 1 2; do
  for tree in old new; do
    left=$(( 585 - SECONDS )); (( left < 40 )) && break 2
    src=src; [[ $tree == old ]] && src=$OLD/src
    PYTHONPATH=$src:tests timeout $left python3 experiments/scale_div/time_ab.py $tree 2>&1 | grep -v -i warn \
      | tee -a "$OUT/ab.log"
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
