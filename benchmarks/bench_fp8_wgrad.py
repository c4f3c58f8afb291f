"""fp8_block's weight gradients on the Gluon engine (``gluon.fp8_wgrad``) beside the Triton FP8 wgrad
kernel (``gemm.fp8_grouped_wgrad``) on the same ``quantize_wgrad`` operands, at the four model shapes:
dW1 = g_hᵀ·x (N = 2F, K = H) and dW2 = dyᵀ·z (N = H, K = F), bf16 and fp32 dW. Every engine result
is first checked bitwise against the Triton kernel's. TFLOP/s = 2·M·N·K / time, do_bench medians,
quantization not timed. It uses only the public launchers, so ``PYTHONPATH=<another tree>/src`` times
that tree's engine beside the same Triton column.

    PYTHONPATH=src python3 benchmarks/bench_fp8_wgrad.py [--shapes a,b] [--rep-ms 40]

Prediction, written before the run (H200): with the scales loaded by TMA into each stage (no
global-memory latency in a step) and two products in flight, the engine reaches the rate of its
FP8 forward GEMMs, ~950-1050 TFLOP/s at mixtral and deepseek-v3 (now ~560-600 there, 0.91-0.96x the
Triton kernel): mixtral dW1 + dW2 9.0 -> ~6 ms; where experts are small (qwen3, gpt-oss, 128-256
rows) +10-25 %, since each tile's K loop is 1-2 steps and its store is what shows.
"""

from __future__ import annotations

import argparse

import torch

from moemlp.bench.common import GPU_SHAPES, print_table, routed_problem, time_ms
from moemlp.kernels import gluon
from moemlp.kernels.gemm import launch
from moemlp.kernels.quant import api as kq
from moemlp.recipes import recipe

DEV = torch.device("cuda")


def rows_for(shape, rep_ms: int) -> list[dict]:
    x, splits, _, _, _, dy = routed_problem(shape, DEV)
    M, F = shape.rows, shape.ffn
    r = recipe("fp8_block")
    g_h = torch.randn(M, 2 * F, device=DEV, dtype=torch.bfloat16)
    z = torch.randn(M, F, device=DEV, dtype=torch.bfloat16)
    blocks = kq.row_blocks(splits, M, r.block)
    out = []
    for name, (g, xx) in {"dW1": (g_h, x), "dW2": (dy, z)}.items():
        qg = kq.quantize_wgrad(g, splits, r, is_grad=True, transposed=True, blocks=blocks)
        qx = kq.quantize_wgrad(xx, splits, r, is_grad=False, transposed=True, blocks=blocks)
        flops = 2.0 * M * g.shape[1] * xx.shape[1]
        for out_dtype in (torch.bfloat16, torch.float32):
            row = {"shape": shape.name, "gemm": name, "dW": str(out_dtype).split(".")[-1], "rows_e": M / shape.experts}

            def triton():
                return launch.fp8_grouped_wgrad(g_t=qg.codes_t, g_scales=qg.scales, x_t=qx.codes_t, x_scales=qx.scales,
                                                splits=splits, T=M, out_dtype=out_dtype)  # fmt: skip

            ref = triton()
            row["triton_ms"] = time_ms(triton, DEV, rep_ms=rep_ms).median
            row["triton_tflops"] = flops / row["triton_ms"] / 1e9

            def engine():
                return gluon.fp8_wgrad(qg.codes_t, qg.scales, qx.codes_t, qx.scales, splits, M, out_dtype)

            dw = engine()
            torch.cuda.synchronize()
            assert torch.equal(dw, ref), f"{shape.name} {name}: {int((dw != ref).sum())} elements differ"
            row["engine_ms"] = time_ms(engine, DEV, rep_ms=rep_ms).median
            row["engine_tflops"] = flops / row["engine_ms"] / 1e9
            row["engine_x_triton"] = row["triton_ms"] / row["engine_ms"]
            out.append(row)
            print(row, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(GPU_SHAPES))
    ap.add_argument("--rep-ms", type=int, default=40)
    args = ap.parse_args()
    rows = []
    for name in args.shapes.split(","):
        rows += rows_for(GPU_SHAPES[name], args.rep_ms)
    keys = ["shape", "gemm", "dW", "rows_e", "triton_tflops", "engine_tflops", "engine_x_triton"]
    print_table(rows, keys, "fp8_block weight gradients: TFLOP/s, engine ÷ Triton kernel time")


if __name__ == "__main__":
    main()
