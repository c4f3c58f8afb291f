"""Tile sweep of the weight-gradient operand quantizer (kernels/quant/ ``_wgrad_kernel``,
``WGRAD_TILE``) on the ANCHORS.md shapes, each tile's output checked bit for bit against the
default tile's before it is timed.

    PYTHONPATH=src python3 benchmarks/bench_wgrad_quantizer.py [--shapes mixtral-8x7b,deepseek-v3-ep8]
        [--recipes fp8_block,mxfp8,nvfp4] [--both] [--gemm]

What runs per step of the fp8_block / mxfp8 backward: fp8_block quantizes x, dy (bf16) and z, g_h
(fp32) with ``quantize_wgrad(..., transposed=True)`` (codes_t and scales for the fp8 wgrad GEMM);
mxfp8 writes their dequantized values (``dequantized_wgrad``), and so does nvfp4 (16-row blocks: an
amax pass, then the values; the recipe named ``nvfp4:...`` with its options, stochastic rounding on
the gradients dy and g_h only). Rows: operand, recipe, tile
(columns per program, warps), the library call with the row blocks computed once (``blocks=``; their
torch ops timed once apart) in ms (do_bench median), GB/s (bytes read + written), and whether the
bits equal the default tile's (storing the codes in rows as well, the former launch, cost 5-10 %:
docs/DECISIONS.md, "Quantizer tiles"). Then, per recipe, the summed time of the four operands for
each tile.

``--both``: dy and g_h as mxfp8's and nvfp4's backward quantizes them (without the Hadamard option),
in one ``dequantized_both`` call that writes their rowwise operand beside the wgrad one on the same
tile (both outputs compared); x and z stay single. The sums are then x + z + dy + g_h as a step runs
them, each timed (dy is not x counted twice).

``--gemm``: also the fp8 wgrad GEMM (``gemm.fp8_grouped_wgrad``, dW1 and dW2) per
``Fp8WgradConfig`` beside moemlp's bf16 wgrad kernel on the same operands, each config's result
checked against the default config's (relative difference; the 128-deep products' internal order
may differ between tile shapes).
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

import torch

from moemlp.bench.kernels import SHAPES, bench
from moemlp.kernels.quant import api as kq
from moemlp.recipes import from_key, recipe

TILES = {128: [(128, 8), (64, 8), (64, 4), (32, 4), (128, 16), (256, 16), (32, 8), (64, 2), (128, 4)],
         32: [(128, 4), (64, 4), (256, 4), (128, 8), (256, 8), (64, 2)],
         16: [(128, 2), (128, 8), (64, 1), (256, 4), (128, 4)]}  # fmt: skip


def launch(t, splits, r, tile, blocks, is_grad=False, both=False):
    """The library's own call with ``tile`` set (``kq.WGRAD_TILE``) and the row blocks computed once
    (``blocks=``, as a backward passes them), so the timing is the kernel's. Returns the outputs
    to compare: fp8_block's codes_t and scales, mxfp8's dequantized values, nvfp4's values and
    factor; with ``both``, ``dequantized_both``'s rowwise and wgrad values (and nvfp4's factors)."""
    default = kq.WGRAD_TILE[r.block]
    kq.WGRAD_TILE[r.block] = tile
    try:
        if both:
            outs = kq.dequantized_both(t, splits, r, is_grad, out_dtype=torch.bfloat16, tiny_blocks_exact=False,
                                       blocks=blocks)  # fmt: skip
            return tuple(o for o in outs if o is not None)
        if r.name == "fp8_block":
            q = kq.quantize_wgrad(t, splits, r, transposed=True, blocks=blocks)
            return q.codes_t, q.scales
        values, factor = kq.dequantized_wgrad(t, splits, r, is_grad, out_dtype=torch.bfloat16, tiny_blocks_exact=False,
                                              blocks=blocks)  # fmt: skip
        return (values,) if factor is None else (values, factor)
    finally:
        kq.WGRAD_TILE[r.block] = default


def _bytes(t):
    """t's bits as bytes, a 0-d tensor (nvfp4's factor) included."""
    return t.reshape(-1).view(torch.uint8)


GEMM_CONFIGS = [(128, 128, 8, 4), (128, 128, 8, 3), (64, 128, 4, 4), (64, 128, 4, 6), (128, 64, 4, 4),
                (128, 64, 8, 4), (64, 256, 8, 3), (256, 64, 8, 3)]  # (BN, BK, warps, stages)


def sweep_gemm(shape):
    from moemlp.kernels import gemm as gg
    from moemlp.kernels.gemm import Fp8WgradConfig, default_fp8_wgrad_config, fp8_grouped_wgrad

    H, F, E, top_k, tokens = SHAPES[shape]
    M = tokens * top_k
    gen = torch.Generator(device="cuda").manual_seed(1)
    splits = torch.full((E,), M // E, dtype=torch.int64, device="cuda")
    fp8 = recipe("fp8_block")
    x = torch.randn(M, H, device="cuda", generator=gen).bfloat16()
    g_h = torch.randn(M, 2 * F, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(M, H, device="cuda", generator=gen).bfloat16()
    z = torch.randn(M, F, device="cuda", generator=gen).bfloat16()
    print(f"\n{shape}: fp8 wgrad GEMM per config, ms (TFLOP/s); rel = |dW - dW(default)| / |dW(default)|")
    for name, g, a in (("dW1", g_h, x), ("dW2", dy, z)):
        gq = kq.quantize_wgrad(g, splits, fp8, True, transposed=True)
        aq = kq.quantize_wgrad(a, splits, fp8, transposed=True)
        flops = 2.0 * M * g.shape[1] * a.shape[1]

        def run(cfg):
            return fp8_grouped_wgrad(g_t=gq.codes_t, g_scales=gq.scales, x_t=aq.codes_t, x_scales=aq.scales,
                                     splits=splits, T=M, out_dtype=torch.bfloat16, config=cfg)  # fmt: skip

        ref = run(default_fp8_wgrad_config()).float()
        dw = torch.empty(E, g.shape[1], a.shape[1], device="cuda", dtype=torch.bfloat16)
        cfg16 = gg.default_config("wgrad", 0, 0, True)
        ms = bench(lambda: gg.launch_grouped_wgrad(g=g, x=a, splits=splits, dw=dw, db=None, config=cfg16))
        print(f"  {name} bf16 wgrad kernel            {ms:8.3f} ({flops / ms / 1e9:5.0f})")
        for c in GEMM_CONFIGS:
            cfg = Fp8WgradConfig(*c)
            try:
                out = run(cfg).float()
                d = ((out - ref).norm() / ref.norm()).item()
                ms = bench(lambda: run(cfg))
            except Exception as exc:
                print(f"  {name} fp8 {str(c):22s} failed: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            print(f"  {name} fp8 {str(c):22s} {ms:8.3f} ({flops / ms / 1e9:5.0f})  rel {d:.1e}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="mixtral-8x7b,deepseek-v3-ep8")
    p.add_argument("--recipes", default="fp8_block,mxfp8",
                   help="comma-separated: fp8_block, mxfp8, nvfp4[:hadamard=1,stochastic_rounding=1]")
    p.add_argument("--both", action="store_true",
                   help="dy and g_h through dequantized_both, as mxfp8's and nvfp4's backward runs them")
    p.add_argument("--gemm", action="store_true")
    args = p.parse_args()
    keys = re.split(r",(?![a-z_]+=)", args.recipes)  # a recipe's own options are comma-separated too
    totals = defaultdict(float)
    bad = set()
    print(f"{'shape':16s} {'operand':10s} {'recipe':9s} {'tile':10s} {'ms':>8s} {'GB/s':>7s}  bits")
    for shape in args.shapes.split(","):
        H, F, E, top_k, tokens = SHAPES[shape]
        M = tokens * top_k
        g = torch.Generator(device="cuda").manual_seed(0)
        splits = torch.full((E,), M // E, dtype=torch.int64, device="cuda")
        ops = {"x bf16": torch.randn(M, H, device="cuda", generator=g).bfloat16(),
               "z fp32": torch.randn(M, F, device="cuda", generator=g),
               "g_h fp32": torch.randn(M, 2 * F, device="cuda", generator=g) * 1e-3}  # fmt: skip
        # dy is x's shape and dtype: its time is x's, counted twice in the sums, except under a
        # stochastic rounding of the gradients, where dy is timed as the gradient it is
        for key in keys:
            r = from_key(key)
            grads = {"g_h fp32"}
            both = set()
            if args.both and r.name != "fp8_block" and not getattr(r, "hadamard", False):
                both = {"dy bf16", "g_h fp32"}
            if getattr(r, "stochastic_rounding", False) or both:
                ops["dy bf16"] = torch.randn(M, H, device="cuda", generator=g).bfloat16()
                grads.add("dy bf16")
            else:
                ops.pop("dy bf16", None)
            blocks = kq.row_blocks(splits, M, r.block)
            ms_rb = bench(lambda: kq.row_blocks(splits, M, r.block))
            print(f"{shape:16s} {'(row blocks)':10s} {key:9s} {'torch':10s} {ms_rb:8.3f}")
            for name, t in ops.items():
                is_grad, two = name in grads, name in both
                ref = launch(t, splits, r, kq.WGRAD_TILE[r.block], blocks, is_grad, two)
                for tile in TILES[r.block]:
                    label = f"{tile[0]}x{tile[1]}"
                    try:
                        outs = launch(t, splits, r, tile, blocks, is_grad, two)
                        same = len(outs) == len(ref) and all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(outs, ref))
                        ms = bench(lambda: launch(t, splits, r, tile, blocks, is_grad, two))
                    except Exception as exc:  # a tile that does not compile or launch: say so, go on
                        print(f"{shape:16s} {name:10s} {key:9s} {label:10s} failed: {type(exc).__name__}: {str(exc)[:80]}")
                        bad.add((shape, key, label))
                        continue
                    reads = 2 if r.name == "nvfp4" else 1  # nvfp4: its amax pass reads t once more
                    moved = t.numel() * (t.element_size() * reads + (1 if key == "fp8_block" else 2) * (2 if two else 1))
                    shown = name + (" both" if two else "")
                    print(f"{shape:16s} {shown:10s} {key:9s} {label:10s} {ms:8.3f} {moved / ms / 1e6:7.0f}  "
                          f"{'same' if same else 'DIFFER'}", flush=True)  # fmt: skip
                    if not same:
                        bad.add((shape, key, label))
                    totals[(shape, key, label)] += ms * (2 if name == "x bf16" and "dy bf16" not in ops else 1)
    print("\nsummed kernel ms of x, dy, z, g_h per shape and recipe (tiles that failed or differed left out), best first")
    for shape in args.shapes.split(","):
        for key in keys:
            rows = sorted((ms, label) for (s, k, label), ms in totals.items() if s == shape and k == key
                          and (s, k, label) not in bad)  # fmt: skip
            print(f"{shape} {key}: " + ", ".join(f"{label} {ms:.3f}" for ms, label in rows))
    if args.gemm:
        for shape in args.shapes.split(","):
            sweep_gemm(shape)


if __name__ == "__main__":
    main()
