"""FC1 under fp8_block beside its peers, on the ANCHORS.md shapes (H200; written 2026-11-30, not yet run).

    PYTHONPATH=src python3 benchmarks/bench_fp8.py [--shapes a,b] [--sweep] [--out DIR]

FC1 of each shape: out[R_e] = x[R_e] @ fc1_weight[e]ᵀ, M = tokens·top_k, K = H, N = 2F (SwiGLU),
FLOPs 2·M·N·K. Columns (triton.testing.do_bench medians, ms and TFLOP/s):

  fp8 gemm     moemlp's fp8_block GEMM on operands already quantized (kernels/_fp8_gemm.py)
  fp8 +q(x)    the same plus the 1×128 quantization of x: the per-call cost in training, where
               the 128×128 weight tiles are quantized once per optimizer step and serve forward
               and dgrad alike
  fp8 linear   fp8_block_grouped_linear: quantize x and the weights, then the GEMM
  q(x), q(w)   the Triton quantizers alone
  bf16         torch._grouped_mm on bf16 (the baseline the issue's ≥1.5x is against)
  rowwise      torch._scaled_grouped_mm, fp8 with one scale per row of x and per (expert, n) of w,
               use_fast_accum=True (torchao's fp8 rowwise MoE training), operands pre-quantized
--sweep adds the GEMM alone under other tile configs. A correctness line per shape compares the
fp8 GEMM with its fp32-dequantized emulation on the first experts (relative RMS) and gives the SNR
of fp8 and rowwise against bf16-input float64 products on those rows.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

from moemlp.kernels import quantize as kq
from moemlp.kernels._fp8_gemm import default_fp8_config, fp8_block_grouped_gemm, fp8_block_grouped_linear
from moemlp.kernels._grouped_gemm import GemmConfig
from moemlp.recipes import recipe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import SHAPES, bench  # noqa: E402

SWEEP = [
    GemmConfig(128, 128, 128, 8, 4),  # the default: scales loaded in the step that uses them
    GemmConfig(128, 128, 128, 8, 3),
    GemmConfig(128, 128, 128, 8, 5),
    GemmConfig(64, 128, 128, 4, 4),  # two CTAs per SM could overlap one's promotion with the other's MMA
    GemmConfig(64, 128, 128, 4, 6),
    GemmConfig(128, 128, 128, 8, 4, GROUP_M=16),
    GemmConfig(64, 64, 128, 8, 4, USE_TMA=False),  # the masked-pointer fallback (K % 16 != 0)
]


def fc1_problem(H, F, E, top_k, tokens, seed=0):
    """Uniform top-k routing as bench_kernels.problem; x unit variance, weights scaled to unit outputs."""
    g = torch.Generator().manual_seed(seed)
    choice = torch.rand(tokens, E, generator=g).topk(top_k, dim=1).indices
    splits = torch.bincount(choice.flatten(), minlength=E).cuda()
    M = tokens * top_k
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(E, 2 * F, H, device="cuda") * H**-0.5).to(torch.bfloat16)
    return x, w, splits


def rowwise_fp8(t: torch.Tensor, dim: int):
    """fp8 e4m3 with one power-of-two scale per slice along ``dim`` (torchao's rowwise recipe);
    returns the codes and the dequantization scales (dim squeezed)."""
    amax = t.float().abs().amax(dim=dim, keepdim=True).clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    codes = (t.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes, scale.reciprocal().squeeze(dim)


def tflops(flop, ms):
    return flop / ms / 1e9


def check(name, x, w, splits, qx, qw, out_fp8, out_rowwise, experts=2):
    """Accuracy on the rows of the first ``experts`` experts (a float64 product of the full shape takes
    minutes): fp8 GEMM vs its emulation, and both fp8 GEMMs vs the bf16 inputs' exact product."""
    rows = int(splits[:experts].sum())
    e_of = torch.repeat_interleave(torch.arange(experts, device="cuda"), splits[:experts])
    A = qx.dequantize()[:rows].double()
    B = qw.dequantize()
    emu = torch.empty(rows, w.shape[1], dtype=torch.float64, device="cuda")
    exact = torch.empty_like(emu)
    for e in range(experts):
        sel = e_of == e
        emu[sel] = A[sel] @ B[e].double().T
        exact[sel] = x[:rows][sel].double() @ w[e].double().T

    def snr(a):
        return float(10 * torch.log10(exact.pow(2).sum() / (a.double() - exact).pow(2).sum()))

    rel = float((out_fp8[:rows].double() - emu).norm() / emu.norm())
    line = f"{name}: fp8 vs emulation rel RMS {rel:.2e}; SNR vs exact: fp8_block {snr(out_fp8[:rows]):.1f} dB"
    if out_rowwise is not None:
        line += f", rowwise {snr(out_rowwise[:rows]):.1f} dB"
    print(line, flush=True)


def bench_shape(name, r, sweep=False):
    """The columns of the module docstring on one shape (its tensors are freed on return)."""
    H, F, E, top_k, tokens = SHAPES[name]
    x, w, splits = fc1_problem(H, F, E, top_k, tokens)
    M, N, K = x.shape[0], w.shape[1], H
    flop = 2.0 * M * N * K
    offs = torch.cumsum(splits, 0).to(torch.int32)
    qx, qw = kq.quantize(x, r, axis=-1), kq.quantize_weight(w, r)
    res = {"shape": name, "M": M, "N": N, "K": K, "E": E, "TFLOP": flop / 1e12}
    res["fp8 gemm"] = bench(lambda: fp8_block_grouped_gemm(qx, qw, splits, torch.bfloat16))
    res["fp8 +q(x)"] = bench(lambda: fp8_block_grouped_gemm(kq.quantize(x, r, axis=-1), qw, splits, torch.bfloat16))
    res["fp8 linear"] = bench(lambda: fp8_block_grouped_linear(x, w, splits, r))
    res["q(x)"] = bench(lambda: kq.quantize(x, r, axis=-1))
    res["q(w)"] = bench(lambda: kq.quantize_weight(w, r))
    wt = w.transpose(-2, -1)
    res["bf16"] = bench(lambda: torch._grouped_mm(x, wt, offs=offs))
    xr, sx = rowwise_fp8(x, -1)
    wr, sw = rowwise_fp8(w, -1)  # (E, N, K): one scale per (e, n); .transpose gives (E, K, N) col-major

    def rowwise():
        return torch._scaled_grouped_mm(
            xr, wr.transpose(-2, -1), sx, sw, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
        )

    out_rowwise = None
    try:
        out_rowwise = rowwise()
        res["rowwise"] = bench(rowwise)
    except (RuntimeError, NotImplementedError) as ex:  # the peer's constraints differ across torch versions
        print(f"{name}: torch._scaled_grouped_mm failed: {str(ex).splitlines()[0]}", flush=True)
        res["rowwise"] = float("nan")
    if sweep:
        for cfg in SWEEP:
            key = f"gemm {cfg.BM}x{cfg.BN} w{cfg.num_warps} s{cfg.num_stages} g{cfg.GROUP_M}"
            key += " ptr" if cfg.USE_TMA is False else ""
            res[key] = bench(lambda cfg=cfg: fp8_block_grouped_gemm(qx, qw, splits, torch.bfloat16, config=cfg))
    out_fp8 = fp8_block_grouped_gemm(qx, qw, splits, torch.float32)
    check(name, x, w, splits, qx, qw, out_fp8, out_rowwise)
    return res


def bench_fc1(shapes, sweep=False, out_dir=None):
    """Times the columns of the module docstring on each shape; prints a table, returns the rows."""
    r = recipe("fp8_block")
    rows = []
    for name in shapes:
        rows.append(bench_shape(name, r, sweep))
        torch.cuda.empty_cache()

    timed = [k for k in rows[0] if k not in ("shape", "M", "N", "K", "E", "TFLOP")]
    print(f"\nFC1, fp8_block (default config {default_fp8_config()}); ms (TFLOP/s = 2·M·N·K / time)")
    print(f"{'column':<34}" + "".join(f"{r_['shape']:>24}" for r_ in rows))
    for k in timed:
        cells = "".join(f"{r_[k]:>11.3f} ({tflops(r_['TFLOP'] * 1e12, r_[k]):>6.0f})    " for r_ in rows)
        print(f"{k:<34}{cells}")
    speed = "".join(f"{r_['bf16'] / r_['fp8 +q(x)']:>22.2f}x " for r_ in rows)
    print(f"{'bf16 / fp8 +q(x)':<34}{speed}")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "bench_fp8_fc1.csv")
        with open(path, "w", newline="") as f:
            wr_ = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr_.writeheader()
            wr_.writerows(rows)
        print(f"wrote {path}")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    bench_fc1(args.shapes.split(","), sweep=args.sweep, out_dir=args.out)


if __name__ == "__main__":
    main()
