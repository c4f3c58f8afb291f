"""Tile sweep of the 1-D block quantizer (kernels/quant/ ROW_TILE / COL_TILE[block]) on ANCHORS.md
shapes, each result checked bit for bit against the current default tile's (the GPU-tested one)
before it is timed: mxfp8 / nvfp4's dequantize passes (activations and weights), and fp8_block's
rowwise codes of a step's four activation operands (x and dy in bf16, z and g_h in fp32).

    PYTHONPATH=src python3 benchmarks/bench_quantizer_tiles.py [--shapes mixtral-8x7b,...]
        [--recipes fp8_block,mxfp8,nvfp4] [--axes row,col]

Rows: shape, part, recipe, tile, ms (do_bench median), GB/s (one read of the input + what it writes:
bf16 values, or fp8_block's one-byte codes; nvfp4's amax pass is inside the time, not the bytes),
and whether the bits equal the default's. Last, per shape, recipe and axis, the summed time of the
parts for each tile, best first.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from moemlp.bench.kernels import SHAPES, bench
from moemlp.kernels.quant import api as kq
from moemlp.recipes import recipe

ROW_TILES = [(32, 128, 4), (64, 128, 4), (64, 128, 8), (32, 256, 4), (64, 256, 8), (128, 128, 8), (16, 128, 4),
             (32, 128, 2), (64, 128, 2), (128, 128, 4)]
COL_TILES = [(64, 4), (128, 4), (128, 8), (256, 8), (32, 4)]


def parts_of(shape: str, key: str) -> dict:
    """{part name: (axis kind, fn(recipe) -> a tuple of the tensors whose bits are compared, input,
    bytes written per element)} of one shape and recipe."""
    H, F, E, top_k, tokens = SHAPES[shape]
    M = tokens * top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, H, device="cuda", generator=g).bfloat16()
    z = torch.randn(M, F, device="cuda", generator=g)
    if key == "fp8_block":  # the step's rowwise codes: x and dy (bf16, M × H), z (fp32, M × F), g_h (fp32, M × 2F)
        dy = torch.randn(M, H, device="cuda", generator=g).bfloat16()
        g_h = torch.randn(M, 2 * F, device="cuda", generator=g)

        def codes(t):
            return lambda r: (lambda q: (q.codes.view(torch.uint8), q.scales))(kq.quantize(t, r, -1))

        return {"quantize(x, -1)": ("row", codes(x), x, 1), "quantize(dy, -1)": ("row", codes(dy), dy, 1),
                "quantize(z fp32, -1)": ("row", codes(z), z, 1), "quantize(g_h fp32, -1)": ("row", codes(g_h), g_h, 1)}  # fmt: skip
    w1 = (torch.randn(E, 2 * F, H, device="cuda", generator=g) * H**-0.5).bfloat16()
    w2 = (torch.randn(E, H, F, device="cuda", generator=g) * F**-0.5).bfloat16()

    def values(f):  # the dequantize passes' bf16 values (their factor is a scalar)
        return lambda r: (f(r)[0],)

    return {
        "dequantized(x, -1)": ("row", values(lambda r: kq.dequantized(x, r, -1, tiny_blocks_exact=False)), x, 2),
        "dequantized(z fp32, -1)": ("row", values(lambda r: kq.dequantized(z, r, -1, tiny_blocks_exact=False)), z, 2),
        "dequantized_weight(w1, -1)": ("row", values(lambda r: kq.dequantized_weight(w1, r, -1)), w1, 2),
        "dequantized_weight(w2, -1)": ("row", values(lambda r: kq.dequantized_weight(w2, r, -1)), w2, 2),
        "dequantized_weight(w1, -2)": ("col", values(lambda r: kq.dequantized_weight(w1, r, -2)), w1, 2),
        "dequantized_weight(w2, -2)": ("col", values(lambda r: kq.dequantized_weight(w2, r, -2)), w2, 2),
    }


def same_bits(a, b) -> bool:
    return all(torch.equal(u.view(torch.uint8), v.view(torch.uint8)) for u, v in zip(a, b))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="mixtral-8x7b")
    p.add_argument("--recipes", default="fp8_block,mxfp8,nvfp4")
    p.add_argument("--axes", default="row,col", help="the parts swept: rowwise (ROW_TILE), columnwise (COL_TILE)")
    args = p.parse_args()
    shapes, keys, axes = args.shapes.split(","), args.recipes.split(","), args.axes.split(",")
    for axis in axes:
        if axis not in ("row", "col"):
            p.error(f"--axes: expected row or col, got {axis!r}")
    for name in shapes:
        if name not in SHAPES:
            p.error(f"--shapes: unknown shape {name!r}; known: {', '.join(SHAPES)}")
    for key in keys:
        if key not in ("fp8_block", "mxfp8", "nvfp4"):
            p.error(f"--recipes: expected fp8_block, mxfp8 or nvfp4, got {key!r}")
    default_row, default_col = kq.ROW_TILE, dict(kq.COL_TILE)
    totals = defaultdict(float)
    failed = set()
    print(f"{'shape':16s} {'part':28s} {'recipe':9s} {'tile':14s} {'ms':>8s} {'GB/s':>7s}  bits")
    for shape in shapes:
        for key in keys:
            r = recipe(key)
            for name, (kind, fn, t, out_bytes) in parts_of(shape, key).items():
                if kind not in axes:
                    continue
                kq.ROW_TILE, kq.COL_TILE = default_row, dict(default_col)
                ref = fn(r)
                for tile in ROW_TILES if kind == "row" else COL_TILES:
                    if kind == "row":
                        kq.ROW_TILE = tile
                    else:
                        kq.COL_TILE[r.block] = tile
                    ident = (shape, key, kind, tile)
                    try:
                        same = same_bits(fn(r), ref)
                        ms = bench(lambda: fn(r))
                    except Exception as exc:  # a tile that does not compile or launch: say so, go on
                        print(f"{shape:16s} {name:28s} {key:9s} {str(tile):14s} failed: {type(exc).__name__}: "
                              f"{str(exc)[:80]}")
                        failed.add(ident)
                        continue
                    gbs = t.numel() * (t.element_size() + out_bytes) / ms / 1e6
                    print(f"{shape:16s} {name:28s} {key:9s} {str(tile):14s} {ms:8.3f} {gbs:7.0f}  "
                          f"{'same' if same else 'DIFFER'}", flush=True)  # fmt: skip
                    if not same:
                        failed.add(ident)
                    totals[ident] += ms
                kq.ROW_TILE, kq.COL_TILE = default_row, dict(default_col)
    print("\nsummed ms per shape, recipe and axis (tiles that failed or differed left out), best first")
    for shape in shapes:
        for key in keys:
            for kind in ("row", "col"):
                rows = sorted((ms, tile) for (sh, k, kd, tile), ms in totals.items()
                              if (sh, k, kd) == (shape, key, kind) and (sh, k, kd, tile) not in failed)  # fmt: skip
                if rows:
                    print(f"{shape} {key} {kind}: " + ", ".join(f"{tile} {ms:.3f}" for ms, tile in rows))


if __name__ == "__main__":
    main()
