"""FC2_DGRAD under fp8_block alone on one ANCHORS.md shape: the FP8 launch with its fp32 z store
(codes None) and with the epilogue's wgrad quantization (WgradCodes), beside the bf16 launch.

    PYTHONPATH=src:tests python3 benchmarks/bench_fc2_dgrad_fp8.py [--shape mixtral-8x7b]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
from triton.testing import do_bench

from moemlp._config import MLPConfig
from moemlp.activations import ACTIVATIONS
from moemlp.kernels import _grouped_gemm as gg
from moemlp.kernels import _operands
from moemlp.recipes import recipe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import SHAPES, problem  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="mixtral-8x7b")
    args = p.parse_args()
    H, F, E, top_k, tokens = SHAPES[args.shape]
    x, splits, probs, w1, w2, dy = problem(H, F, E, top_k, tokens)
    M, N1 = x.shape[0], 2 * F
    h = torch.randn(M, N1, device="cuda", dtype=torch.bfloat16)
    r = recipe("fp8_block")
    cfg = MLPConfig(ACTIVATIONS["swiglu"], (), F, False, r)
    a = _operands.act(dy, r)
    b = _operands.Weight(w2, r).dgrad()
    kw = _operands.gemm_kwargs(a, b)
    config = gg.default_config("fc2_dgrad", F, H, True, 2, fp8=True)
    g_h = torch.empty(M, N1, device="cuda")
    z = torch.empty(M, F, device="cuda")
    partial = torch.empty(math.ceil(F / config.BN), M, device="cuda")
    codes = gg.WgradCodes.empty(M, E, N1, F, True, g=True, z=True, device="cuda")

    def run(c, store_z=True, partial=partial):
        gg.launch_grouped_gemm(
            gg.FC2_DGRAD.value, a.a, b.b, b.strides, splits, probs, None, g_h, None if c else z, h, partial,
            N=F, K=H, N1=N1, cfg=cfg, scale_bias=False, store_z=store_z, store_partial=partial is not None,
            config=config, wgrad_codes=c, **kw,
        )  # fmt: skip

    gbf = torch.empty(M, N1, device="cuda", dtype=torch.bfloat16)
    zbf = torch.empty(M, F, device="cuda", dtype=torch.bfloat16)
    cfg0 = MLPConfig(ACTIVATIONS["swiglu"], (), F, False, None)
    bcfg = gg.default_config("fc2_dgrad", F, H, True, 2)
    pb = torch.empty(math.ceil(F / bcfg.BN), M, device="cuda")

    def run_bf16():
        gg.launch_grouped_gemm(
            gg.FC2_DGRAD.value, dy, w2, (H * F, 1, F), splits, probs, None, gbf, zbf, h, pb, N=F, K=H, N1=N1,
            cfg=cfg0, scale_bias=False, store_z=True, store_partial=True, config=bcfg,
        )  # fmt: skip

    flops = 2 * M * H * F
    for name, fn in (
        ("bf16 FC2_DGRAD (bf16 g_h, z)", run_bf16),
        ("fp8 FC2_DGRAD, fp32 g_h + z", lambda: run(None)),
        ("fp8 FC2_DGRAD, fp32 g_h, no z", lambda: run(None, store_z=False)),
        ("fp8 FC2_DGRAD, fp32 g_h + wgrad codes", lambda: run(codes)),
    ):
        ms = do_bench(fn, rep=100)
        print(f"{name:<42}{ms:8.3f} ms {flops / ms / 1e9:7.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
