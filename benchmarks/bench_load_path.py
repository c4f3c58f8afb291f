"""mxfp8 / nvfp4: the GEMMs' operands dequantized in the load path (kernel A_DQ / B_DQ) against a
dequantize pass that stores bf16 values first (kernels/_operands.py, LOAD_PATH_ACT / LOAD_PATH_WEIGHT),
beside moemlp's bf16 path, same process, same inputs.

    PYTHONPATH=src python3 benchmarks/bench_load_path.py [--shapes mixtral-8x7b,deepseek-v3-ep8] [--fc1-configs]
        [--modes both,act]

Part 1, FC1 alone (x @ W1ᵀ with the SwiGLU epilogue), the GEMM launch only, operands prepared
outside the timing: bf16 kernel on the pass's bf16 values vs the load-path kernel on codes, per tile
config (``--fc1-configs``: a few besides the default). Part 2, the whole MLP forward + backward
(quantizers included), load path off / on, with y checked bit for bit between the two. do_bench
medians (ms); a table per part, last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
from triton.testing import do_bench

from moemlp.functional import grouped_mlp
from moemlp.kernels import _grouped_gemm as gg
from moemlp.kernels import _operands

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import SHAPES, problem, swiglu_cfg  # noqa: E402

RECIPES = ("mxfp8", "nvfp4")


def ms(fn, rep=100):
    return float(do_bench(fn, warmup=25, rep=rep, return_mode="median"))


MODES = {"off": (False, False), "act": (True, False), "both": (True, True)}  # (activations, weights)


def set_load_path(mode: str):
    _operands.LOAD_PATH_ACT, _operands.LOAD_PATH_WEIGHT = MODES[mode]


def fc1_launch(x, splits, probs, w1, cfg, recipe, load_path: str, config):
    """A closure that runs FC1's launch alone on operands quantized (or dequantized) beforehand."""
    from moemlp._config import MLPConfig
    from moemlp.recipes import from_key

    r = from_key(recipe)
    set_load_path(load_path)
    ao = _operands.act(x, r)
    bo = _operands.Weight(w1, r).forward()
    kw = _operands.gemm_kwargs(ao, bo)
    M, H = x.shape
    N1 = w1.shape[1]
    F = N1 // 2
    h = torch.empty((M, N1), dtype=torch.bfloat16, device=x.device)
    z = torch.empty((M, F), dtype=torch.float32, device=x.device)
    mcfg = MLPConfig(cfg.activation, cfg.activation_params, cfg.glu_interleave, cfg.scale_fc2_bias, r)
    config = config or gg.default_config("fc1", F, H, True, 2)
    if config.BK < 32:  # the interpreter's config (a CPU try of this script), as kernels._gemm does
        config = dataclasses.replace(config, BK=32)

    def run():
        gg.launch_grouped_gemm(
            gg.FC1.value, ao.a, bo.b, bo.strides, splits, probs, None, h, z, None, None,
            N=F, K=H, N1=N1, cfg=mcfg, scale_bias=False, store_z=True, store_partial=False, config=config, **kw,
        )  # fmt: skip

    return run, h


FC1_CONFIGS = {
    "default": None,
    "128x64x64s3": gg.GemmConfig(128, 64, 64, 8, 3, SUBTILE=2),
    "64x128x64s3w4": gg.GemmConfig(64, 128, 64, 4, 3, SUBTILE=4),
}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="mixtral-8x7b,deepseek-v3-ep8")
    p.add_argument("--fc1-configs", action="store_true")
    p.add_argument("--modes", default="both", help="load-path modes beside 'off': both (A and B), act (A only)")
    p.add_argument("--rep-ms", type=int, default=100)
    args = p.parse_args()
    fc1_rows, mlp_rows = [], []
    for shape in args.shapes.split(","):
        H, F, E, top_k, tokens = SHAPES[shape]
        x, splits, probs, w1, w2, dy = problem(H, F, E, top_k, tokens)
        cfg = swiglu_cfg(F)
        flops_fc1 = 2 * x.shape[0] * H * 2 * F
        configs = FC1_CONFIGS if args.fc1_configs else {"default": None}
        for recipe in RECIPES:
            run_pass, h_pass = fc1_launch(x, splits, probs, w1, cfg, recipe, "off", None)
            t_pass = ms(run_pass, args.rep_ms)
            run_pass()
            for mode, (cname, config) in [(m, c) for m in args.modes.split(",") for c in configs.items()]:
                try:
                    run_lp, h_lp = fc1_launch(x, splits, probs, w1, cfg, recipe, mode, config)
                    t_lp = ms(run_lp, args.rep_ms)
                    run_lp()
                    same = "same bits" if config is None and torch.equal(h_lp, h_pass) else "-"
                    if config is None and same != "same bits":
                        same = f"DIFFERS (max {(h_lp.float() - h_pass.float()).abs().max().item():.3g})"
                except Exception as exc:  # a config that does not compile or fit: say so, go on
                    t_lp, same = float("nan"), f"failed: {type(exc).__name__}: {str(exc)[:60]}"
                fc1_rows.append((shape, recipe, f"{mode}:{cname}", t_pass, t_lp, flops_fc1 / t_lp / 1e9, same))
                print(f"[fc1] {shape} {recipe} {mode} {cname}: pass-path GEMM {t_pass:.3f} ms, load path {t_lp:.3f} ms "
                      f"({same})", flush=True)  # fmt: skip
        leaves = [t.requires_grad_() for t in (x, probs, w1, w2)]
        set_load_path("off")
        t_bf16 = ms(lambda: torch.autograd.grad(grouped_mlp(x, splits, probs, w1, w2), leaves, dy), args.rep_ms)
        for recipe in RECIPES:
            times, ys = [], []
            modes = ["off"] + args.modes.split(",")
            for mode in modes:
                set_load_path(mode)
                with torch.no_grad():
                    ys.append(grouped_mlp(x, splits, probs, w1, w2, recipe=recipe))
                times.append(ms(lambda: torch.autograd.grad(grouped_mlp(x, splits, probs, w1, w2, recipe=recipe),
                                                            leaves, dy), args.rep_ms))  # fmt: skip
            for mode, t, y in zip(modes[1:], times[1:], ys[1:]):
                same = "same bits" if torch.equal(ys[0], y) else "DIFFERS"
                mlp_rows.append((shape, recipe, mode, t_bf16, times[0], t, t_bf16 / t, same))
                print(f"[mlp] {shape} {recipe}: bf16 {t_bf16:.2f} ms, pass {times[0]:.2f} ms, load path ({mode}) "
                      f"{t:.2f} ms, y {same}", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    print(f"\nFC1 launch alone, ms (do_bench medians) on {torch.cuda.get_device_name()}")
    print(f"{'shape':16s} {'recipe':6s} {'mode:config':19s} {'pass':>8s} {'load':>8s} {'TFLOP/s':>8s}  y")
    for r in fc1_rows:
        print(f"{r[0]:16s} {r[1]:6s} {r[2]:19s} {r[3]:8.3f} {r[4]:8.3f} {r[5]:8.0f}  {r[6]}")
    print("\nWhole MLP forward+backward, ms; speedup = bf16 / load path")
    print(f"{'shape':16s} {'recipe':6s} {'mode':5s} {'bf16':>8s} {'pass':>8s} {'load':>8s} {'speedup':>8s}  y vs pass")
    for r in mlp_rows:
        print(f"{r[0]:16s} {r[1]:6s} {r[2]:5s} {r[3]:8.2f} {r[4]:8.2f} {r[5]:8.2f} {r[6]:8.3f}  {r[7]}")


if __name__ == "__main__":
    main()
