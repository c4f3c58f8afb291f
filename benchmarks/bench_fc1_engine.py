"""FC1 with its GLU epilogue on the Gluon engine (moemlp.kernels.gluon.fc1) beside the Triton kernel
that the MLP runs, bf16 and fp8_block, at the four model shapes, after a bitwise check of h and z.

    PYTHONPATH=src python3 benchmarks/bench_fc1_engine.py [--shapes a,b] [--rep-ms 60] [--fp8-stages 4,5]
        [--rounds N]

``--fp8-stages`` times fp8_block's engine kernel at each listed stage count (the launcher's
``FC1_FP8_STAGES`` set for the call), each checked bitwise first. bf16 is timed on ping-pong tiles
and, where G is a multiple of 128, on cooperative ones (``fc1(cooperative=)``). ``--rounds N`` times
every kernel of a shape N times in turn and reports the medians. The operands are the MLP's: the
routed rows of ``routed_problem``, fp32 probs, z in bf16 (bf16) or fp32 (fp8_block, a recipe's z),
G = F (gate and up halves). TFLOP/s = 2·M·H·2F / time. do_bench medians.

Prediction, written before the first run of the register epilogue (H200): bf16 reaches the engine's
plain GEMM (mixtral ~6.1 ms, 1.04× the Triton kernel) with 4 stages where 3 fitted beside the fp32
tiles; fp8_block's exposed epilogue (cooperative tiles) shrinks from ~2.2 ms over the plain FP8 GEMM
to ~1 ms (mixtral 6.3 → ~5.0 ms, 1.1× the Triton kernel's 5.65).
"""

from __future__ import annotations

import argparse

import torch

from moemlp._config import MLPConfig
from moemlp.activations import ACTIVATIONS
from moemlp.bench.common import GPU_SHAPES, print_table, routed_problem, time_ms
from moemlp.kernels import gluon, operands
from moemlp.kernels.gemm import launch
from moemlp.kernels.gluon import _launch as gluon_launch
from moemlp.recipes import recipe

DEV = torch.device("cuda")


def _problem(shape, fp8: bool):
    x, splits, probs, w1, _, _ = routed_problem(shape, DEV)
    r = recipe("fp8_block") if fp8 else None
    a_op, b_op = operands.act(x, r, splits), operands.Weight(w1, r).forward()
    M, F, H = x.shape[0], shape.ffn, shape.hidden
    z_dtype = torch.float32 if fp8 else torch.bfloat16
    scales = dict(x_scale=a_op.scales, w1_scale=operands._tile_scales(b_op, 2 * F, H)) if fp8 else {}
    return x, splits.to(torch.int32), probs, a_op, b_op, M, F, H, z_dtype, scales


def _engine(a_op, b_op, splits, probs, M, F, z_dtype, scales, coop=None):
    h = torch.empty((M, 2 * F), device=DEV, dtype=torch.bfloat16)
    z = torch.empty((M, F), device=DEV, dtype=z_dtype)
    spec = ACTIVATIONS["swiglu"]
    gluon.fc1(a_op.a, b_op.b, splits, h, z=z, bias=None, probs=probs, glu_interleave=F,
              activation_id=spec.kernel_id, params=(0.0, 0.0, 0.0), cooperative=coop, **scales)  # fmt: skip
    return h, z


def _triton(a_op, b_op, splits, probs, M, F, H, z_dtype):
    h = torch.empty((M, 2 * F), device=DEV, dtype=torch.bfloat16)
    z = torch.empty((M, F), device=DEV, dtype=z_dtype)
    launch.launch_grouped_gemm(
        "fc1", a=a_op.a, b=b_op.b, b_strides=b_op.strides, splits=splits, out=h, N=F, K=H, N1=2 * F,
        cfg=MLPConfig(ACTIVATIONS["swiglu"], (), F, False), probs=probs, bias=None, z=z, a_scales=a_op.scales,
        b_scales=b_op.scales, b_scale_strides=b_op.scale_strides,
    )  # fmt: skip
    return h, z


def _median(xs):
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(GPU_SHAPES))
    ap.add_argument("--rep-ms", type=int, default=60)
    ap.add_argument("--fp8-stages", default=str(gluon_launch.FC1_FP8_STAGES))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--bf16-only", action="store_true")
    args = ap.parse_args()
    if gluon.why_unavailable():
        raise SystemExit(f"the engine cannot run here: {gluon.why_unavailable()}")
    rows = []
    for name in args.shapes.split(","):
        shape = GPU_SHAPES[name]
        for fp8 in (False,) if args.bf16_only else (False, True):
            x, splits, probs, a_op, b_op, M, F, H, z_dtype, scales = _problem(shape, fp8)
            h_like = torch.empty((M, 2 * F), device=DEV, dtype=torch.bfloat16)
            why = gluon.fc1_supports(a_op.a, b_op.b, h_like, None, ACTIVATIONS["swiglu"].kernel_id, True, F)
            if why:
                print(f"{name} {'fp8' if fp8 else 'bf16'}: the engine cannot take it ({why})")
                continue
            flops = 2.0 * M * H * 2 * F
            h_t, z_t = _triton(a_op, b_op, splits, probs, M, F, H, z_dtype)
            # (label, stages, coop): the engine's variants at this shape
            if fp8:
                variants = [(f"fp8 {st} stages", st, None) for st in (int(v) for v in args.fp8_stages.split(","))]
            else:
                variants = [("ping-pong", gluon_launch.FC1_STAGES, False)]
                if not gluon_launch.fc1_cooperative_why(False, False, F):
                    variants.append(("cooperative", gluon_launch.STAGES_COOP, True))
            runs = {}
            for label, stages, coop in variants:
                saved = gluon_launch.FC1_FP8_STAGES
                if fp8:
                    gluon_launch.FC1_FP8_STAGES = stages
                try:
                    h, z = _engine(a_op, b_op, splits, probs, M, F, z_dtype, scales, coop)
                    torch.cuda.synchronize()
                finally:
                    gluon_launch.FC1_FP8_STAGES = saved
                if not (torch.equal(h, h_t) and torch.equal(z, z_t)):
                    print(f"{name} {label}: the engine's h / z differ from the Triton kernel's "
                          f"({int((h != h_t).sum())} h, {int((z != z_t).sum())} z elements); not timed")
                    continue
                runs[label] = (stages, coop)
            times = {label: [] for label in ["triton", *runs]}
            for _ in range(args.rounds):  # every kernel once a round, in turn
                times["triton"].append(time_ms(lambda: _triton(a_op, b_op, splits, probs, M, F, H, z_dtype), DEV,
                                               rep_ms=args.rep_ms).median)  # fmt: skip
                for label, (stages, coop) in runs.items():
                    saved = gluon_launch.FC1_FP8_STAGES
                    if fp8:
                        gluon_launch.FC1_FP8_STAGES = stages
                    try:
                        times[label].append(time_ms(lambda: _engine(a_op, b_op, splits, probs, M, F, z_dtype, scales,
                                                                    coop), DEV, rep_ms=args.rep_ms).median)
                    finally:
                        gluon_launch.FC1_FP8_STAGES = saved
            t_triton = _median(times["triton"])
            for label in runs:
                t = _median(times[label])
                rows.append({"shape": name, "dtype": "fp8_block" if fp8 else "bf16", "engine": label,
                             "triton_ms": round(t_triton, 3), "engine_ms": round(t, 3),
                             "engine/triton": round(t_triton / t, 3),
                             "engine_tflops": round(flops / t / 1e9, 0),
                             "rounds_ms": [round(v, 3) for v in times[label]], "bits": "equal"})  # fmt: skip
                print(rows[-1], flush=True)
    print_table(rows, [k for k in rows[0] if k != "rounds_ms"] if rows else [],
                "FC1: the engine beside the Triton kernel (speed-up = triton/engine)")


if __name__ == "__main__":
    main()
