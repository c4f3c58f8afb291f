"""FC1 with its GLU epilogue on the Gluon engine (moemlp.kernels.gluon.fc1) beside the Triton kernel
that the MLP runs, bf16 and fp8_block, at the four model shapes, after a bitwise check of h and z.

    PYTHONPATH=src python3 benchmarks/bench_fc1_engine.py [--shapes a,b] [--rep-ms 60] [--fp8-stages 4,5]

``--fp8-stages`` times fp8_block's engine kernel at each listed stage count (the launcher's
``FC1_FP8_STAGES`` set for the call), each checked bitwise first. The operands are the MLP's: the
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
    a_op, b_op = operands.act(x, r), operands.Weight(w1, r).forward()
    M, F, H = x.shape[0], shape.ffn, shape.hidden
    z_dtype = torch.float32 if fp8 else torch.bfloat16
    scales = dict(x_scale=a_op.scales, w1_scale=operands._tile_scales(b_op, 2 * F, H)) if fp8 else {}
    return x, splits.to(torch.int32), probs, a_op, b_op, M, F, H, z_dtype, scales


def _engine(a_op, b_op, splits, probs, M, F, z_dtype, scales):
    h = torch.empty((M, 2 * F), device=DEV, dtype=torch.bfloat16)
    z = torch.empty((M, F), device=DEV, dtype=z_dtype)
    spec = ACTIVATIONS["swiglu"]
    gluon.fc1(a_op.a, b_op.b, splits, h, z=z, bias=None, probs=probs, glu_interleave=F,
              activation_id=spec.kernel_id, params=(0.0, 0.0, 0.0), **scales)  # fmt: skip
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(GPU_SHAPES))
    ap.add_argument("--rep-ms", type=int, default=60)
    ap.add_argument("--fp8-stages", default=str(gluon_launch.FC1_FP8_STAGES))
    args = ap.parse_args()
    if gluon.why_unavailable():
        raise SystemExit(f"the engine cannot run here: {gluon.why_unavailable()}")
    rows = []
    for name in args.shapes.split(","):
        shape = GPU_SHAPES[name]
        for fp8 in (False, True):
            x, splits, probs, a_op, b_op, M, F, H, z_dtype, scales = _problem(shape, fp8)
            h_like = torch.empty((M, 2 * F), device=DEV, dtype=torch.bfloat16)
            why = gluon.fc1_supports(a_op.a, b_op.b, h_like, None, ACTIVATIONS["swiglu"].kernel_id, True, F)
            if why:
                print(f"{name} {'fp8' if fp8 else 'bf16'}: the engine cannot take it ({why})")
                continue
            flops = 2.0 * M * H * 2 * F
            h_t, z_t = _triton(a_op, b_op, splits, probs, M, F, H, z_dtype)
            t_triton = time_ms(lambda: _triton(a_op, b_op, splits, probs, M, F, H, z_dtype), DEV,
                               rep_ms=args.rep_ms)  # fmt: skip
            for stages in [int(s) for s in args.fp8_stages.split(",")] if fp8 else [gluon_launch.FC1_STAGES]:
                saved = gluon_launch.FC1_FP8_STAGES
                if fp8:
                    gluon_launch.FC1_FP8_STAGES = stages
                try:
                    h, z = _engine(a_op, b_op, splits, probs, M, F, z_dtype, scales)
                    torch.cuda.synchronize()
                    same = torch.equal(h, h_t) and torch.equal(z, z_t)
                    if not same:
                        print(f"{name}: the engine's h / z differ from the Triton kernel's "
                              f"({int((h != h_t).sum())} h, {int((z != z_t).sum())} z elements); not timed")
                        continue
                    t = time_ms(lambda: _engine(a_op, b_op, splits, probs, M, F, z_dtype, scales), DEV,
                                rep_ms=args.rep_ms)  # fmt: skip
                finally:
                    gluon_launch.FC1_FP8_STAGES = saved
                rows.append({"shape": name, "dtype": "fp8_block" if fp8 else "bf16", "stages": stages,
                             "triton_ms": round(t_triton.median, 3), "engine_ms": round(t.median, 3),
                             "engine/triton": round(t_triton.median / t.median, 3),
                             "engine_tflops": round(flops / t.median / 1e9, 0), "bits": "equal"})  # fmt: skip
                print(rows[-1], flush=True)
    print_table(rows, list(rows[0]) if rows else [], "FC1: the engine beside the Triton kernel (speed-up = triton/engine)")


if __name__ == "__main__":
    main()
