"""fp8_block's grouped GEMM on the Gluon engine (kernels/gluon, ``grouped_gemm_fp8``) beside the Triton
FP8 kernel and the engine's bf16 GEMM, at the model shapes' FC1 (K = H, N = 2F) and FC2 (K = F, N = H),
bf16 output, quantization not timed. Before timing, the engine's output is checked bitwise against the
Triton kernel's. TFLOP/s = 2·M·N·K / time; the dense bf16 ``torch.mm`` of the same FLOPs beside them.

    PYTHONPATH=src:tests/kernels python3 benchmarks/bench_fp8_engine.py [--shapes a,b] [--rep-ms 100]
"""

from __future__ import annotations

import argparse

import torch

from moemlp.bench.common import GPU_SHAPES, print_table, routed_problem, time_ms
from moemlp.kernels import gluon, quant
from moemlp.recipes import recipe


def _triton_fp8(qa, qb, splits, out):
    from moemlp.kernels import gemm

    E, N, K = qb.codes.shape
    nb, kb = qb.scales.shape[1:]
    gemm.launch_grouped_gemm(
        "fc2", a=qa.codes, b=qb.codes, b_strides=(N * K, K, 1), splits=splits, out=out, N=N, K=K, N1=N, cfg=None,
        config=gemm.default_config("fc2", 0, 0, False, fp8=True), a_scales=qa.scales, b_scales=qb.scales,
        b_scale_strides=(nb * kb, kb, 1),
    )  # fmt: skip
    return out


def bench(shape, gemm_name: str, rep_ms: int) -> dict:
    dev = torch.device("cuda")
    x, splits, _, w1, w2, dy = routed_problem(shape, dev)
    a, w = (x, w1) if gemm_name == "fc1" else (torch.randn(shape.rows, shape.ffn, device=dev).to(x.dtype), w2)
    r = recipe("fp8_block")
    qa, qb = quant.quantize(a, r, axis=-1), quant.quantize_weight(w, r)
    M, K = a.shape
    N = w.shape[1]
    out_e = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    out_t = torch.empty_like(out_e)
    out_b = torch.empty_like(out_e)
    gluon.grouped_gemm_fp8(qa.codes, qa.scales, qb.codes, qb.scales, splits, out_e)
    _triton_fp8(qa, qb, splits, out_t)
    torch.cuda.synchronize()
    if not torch.equal(out_e, out_t):
        differ = int((out_e != out_t).sum())
        raise SystemExit(f"{shape.name} {gemm_name}: {differ} elements differ from the Triton kernel's")
    flops = 2.0 * M * N * K
    row = {"shape": shape.name, "gemm": gemm_name, "rows_per_expert": M / shape.experts}
    timings = {
        "engine_fp8": lambda: gluon.grouped_gemm_fp8(qa.codes, qa.scales, qb.codes, qb.scales, splits, out_e),
        "triton_fp8": lambda: _triton_fp8(qa, qb, splits, out_t),
        "engine_bf16": lambda: gluon.grouped_gemm(a, w, splits, out_b),
    }
    mm_a, mm_b = torch.randn(M, K, device=dev, dtype=x.dtype), torch.randn(K, N, device=dev, dtype=x.dtype)
    timings["dense_mm_bf16"] = lambda: torch.mm(mm_a, mm_b)
    for name, fn in timings.items():
        row[f"{name}_tflops"] = flops / time_ms(fn, dev, rep_ms=rep_ms).median / 1e9
    row["fp8_over_bf16"] = row["engine_fp8_tflops"] / row["engine_bf16_tflops"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="mixtral-8x7b,deepseek-v3-ep8")
    p.add_argument("--rep-ms", type=int, default=100)
    args = p.parse_args()
    reason = gluon.why_unavailable()
    if reason:
        raise SystemExit(f"the Gluon engine cannot run here: {reason}")
    rows = []
    for name in args.shapes.split(","):
        for g in ("fc1", "fc2"):
            rows.append(bench(GPU_SHAPES[name], g, args.rep_ms))
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()
    print_table(rows, ["shape", "gemm", "rows_per_expert", "engine_fp8_tflops", "triton_fp8_tflops",
                       "engine_bf16_tflops", "dense_mm_bf16_tflops", "fp8_over_bf16"],
                "fp8_block grouped GEMM, bf16 out, TFLOP/s (the engine's bits = the Triton kernel's)")  # fmt: skip


if __name__ == "__main__":
    main()
