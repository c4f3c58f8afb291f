"""Where the time of the grouped MLP under a recipe goes: each quantizer pass and GEMM of one
forward + backward, timed alone on one ANCHORS.md shape (written for the H200).

    PYTHONPATH=src python3 benchmarks/bench_recipe_parts.py [--shape mixtral-8x7b] [--out DIR]

Rows (triton.testing.do_bench medians, ms; GB/s where the part is a memory pass):
  quantize / dequantized passes of x (M, H), z-like (M, F) fp32, weights (E, 2F, H) and (E, H, F),
  the K-major copy of the weight codes, the wgrad quantizers, and the GEMMs: fp8 FC1, bf16 FC1
  (torch._grouped_mm), fp8 wgrad dW1 vs bf16 wgrad dW1 (moemlp's kernel).
The fp8_block weight-tile quantizer also runs at 4, 8 and 16 warps (the default launch uses 8).
"""

from __future__ import annotations

import argparse
import csv
import os

import torch

from moemlp.bench.kernels import SHAPES, bench
from moemlp.kernels import gemm as gg
from moemlp.kernels.quant import api as kq
from moemlp.recipes import recipe


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="mixtral-8x7b")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    H, F, E, top_k, tokens = SHAPES[args.shape]
    g = torch.Generator().manual_seed(0)
    choice = torch.rand(tokens, E, generator=g).topk(top_k, dim=1).indices
    splits = torch.bincount(choice.flatten(), minlength=E).cuda()
    M = tokens * top_k
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    zf = torch.randn(M, F, device="cuda", dtype=torch.float32)
    w1 = (torch.randn(E, 2 * F, H, device="cuda") * H**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, F, device="cuda") * F**-0.5).to(torch.bfloat16)
    g_h = torch.randn(M, 2 * F, device="cuda", dtype=torch.float32)
    fp8, mx, nv = recipe("fp8_block"), recipe("mxfp8"), recipe("nvfp4")
    rows = []

    def row(name, ms, gbytes=None):
        rows.append({"part": name, "ms": ms, "GB/s": (gbytes / ms * 1e3) if gbytes else float("nan")})
        print(f"{name:<48}{ms:>9.3f} ms" + (f"{gbytes / ms * 1e3:>9.0f} GB/s" if gbytes else ""), flush=True)

    gb = 1e-9
    row("fp8 quantize(x) rowwise", bench(lambda: kq.quantize(x, fp8, -1)), x.numel() * 3 * gb)
    row("fp8 quantize(z fp32) rowwise", bench(lambda: kq.quantize(zf, fp8, -1)), zf.numel() * 5 * gb)
    row("fp8 quantize_weight(w1) 128x128", bench(lambda: kq.quantize_weight(w1, fp8)), w1.numel() * 3 * gb)
    row("fp8 quantize_weight(w2) 128x128", bench(lambda: kq.quantize_weight(w2, fp8)), w2.numel() * 3 * gb)
    default_warps = kq._TILE_WARPS
    for nw in (4, 8, 16):  # the persistent weight-tile kernel at other warp counts (bits unchanged)
        kq._TILE_WARPS = nw
        try:
            row(f"  tile quantizer w1, {nw} warps", bench(lambda: kq.quantize_weight(w1, fp8)), w1.numel() * 3 * gb)
        except Exception as ex:  # a launch option the installed triton refuses
            print(f"  tile quantizer w1, {nw} warps: {type(ex).__name__}: {str(ex)[:120]}")
        finally:
            kq._TILE_WARPS = default_warps
    qw1 = kq.quantize_weight(w1, fp8)
    row("fp8 K-major copy of w1 codes (torch)", bench(lambda: qw1.codes.transpose(1, 2).contiguous()),
        w1.numel() * 2 * gb)
    row("fp8 quantize_weight(w1, transposed=True)", bench(lambda: kq.quantize_weight(w1, fp8, transposed=True)),
        w1.numel() * 4 * gb)
    row("fp8 quantize_wgrad(x)", bench(lambda: kq.quantize_wgrad(x, splits, fp8)), x.numel() * 3 * gb)
    row("fp8 quantize_wgrad(g_h fp32)", bench(lambda: kq.quantize_wgrad(g_h, splits, fp8, True)), g_h.numel() * 5 * gb)
    row("fp8 quantize_wgrad(g_h fp32, transposed=True)",
        bench(lambda: kq.quantize_wgrad(g_h, splits, fp8, True, transposed=True)), g_h.numel() * 5 * gb)
    qx = kq.quantize(x, fp8, -1)
    out = torch.empty(x.shape[0], w1.shape[1], device="cuda", dtype=torch.bfloat16)
    nb, kb = qw1.scales.shape[1:]
    row("fp8 FC1 GEMM (plain epilogue)", bench(lambda: gg.launch_grouped_gemm(
        "fc2", a=qx.codes, b=qw1.codes, b_strides=(2 * F * H, H, 1), splits=splits, out=out, N=2 * F, K=H,
        N1=2 * F, cfg=None, config=gg.default_config("fc2", 0, 0, False, fp8=True), a_scales=qx.scales,
        b_scales=qw1.scales, b_scale_strides=(nb * kb, kb, 1))))
    offs = torch.cumsum(splits, 0).to(torch.int32)
    row("bf16 FC1 GEMM torch._grouped_mm", bench(lambda: torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)))
    gq_t = kq.quantize_wgrad(g_h, splits, fp8, True, transposed=True)
    xq_t = kq.quantize_wgrad(x, splits, fp8, transposed=True)
    row("fp8 wgrad dW1 (quantizers' transposed codes)", bench(lambda: gg.fp8_grouped_wgrad(
        g_t=gq_t.codes_t, g_scales=gq_t.scales, x_t=xq_t.codes_t, x_scales=xq_t.scales, splits=splits, T=x.shape[0])))
    g_bf = g_h.bfloat16()
    dw = torch.empty(E, 2 * F, H, device="cuda", dtype=torch.bfloat16)
    cfg = gg.default_config("wgrad", 0, 0, True)
    row("bf16 wgrad dW1 (moemlp kernel)", bench(lambda: gg.launch_grouped_wgrad(g=g_bf, x=x, splits=splits, dw=dw, db=None,
                                                                               config=cfg)))
    for name, r in (("mxfp8", mx), ("nvfp4", nv)):
        row(f"{name} dequantized(x)", bench(lambda r=r: kq.dequantized(x, r, -1)), x.numel() * 4 * gb)
        row(f"{name} dequantized(z fp32)", bench(lambda r=r: kq.dequantized(zf, r, -1, tiny_blocks_exact=False)),
            zf.numel() * 6 * gb)
        row(f"{name} dequantized_weight(w1, -1)", bench(lambda r=r: kq.dequantized_weight(w1, r, -1)),
            w1.numel() * 4 * gb)
        row(f"{name} dequantized_weight(w1, -2)", bench(lambda r=r: kq.dequantized_weight(w1, r, -2)),
            w1.numel() * 4 * gb)
        row(f"{name} dequantized_wgrad(x)", bench(lambda r=r: kq.dequantized_wgrad(x, splits, r)), x.numel() * 4 * gb)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"recipe_parts_{args.shape}.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["part", "ms", "GB/s"])
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
