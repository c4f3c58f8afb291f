"""Tile sweep of the 1-D block quantizer (mxfp8 / nvfp4 dequantize passes, kernels/quant/
ROW_TILE / COL_TILE) on one ANCHORS.md shape, each result checked bit for bit against the current
default tile's (the GPU-tested one) before it is timed.

    PYTHONPATH=src python3 benchmarks/bench_quantizer_tiles.py [--shape mixtral-8x7b]

Rows: part, recipe, tile, ms (do_bench median), GB/s (one read of the input + the bf16 values
written; nvfp4's amax pass is inside the time, not the bytes), and whether the bits equal the
default's. Last, per recipe and axis, the summed time of the parts for each tile, best first.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from moemlp.bench.kernels import SHAPES, bench
from moemlp.kernels.quant import api as kq
from moemlp.recipes import recipe

ROW_TILES = [(32, 128, 4), (64, 128, 4), (64, 128, 8), (32, 256, 4), (64, 256, 8), (128, 128, 8), (16, 128, 4)]
COL_TILES = [(64, 4), (128, 4), (128, 8), (256, 8), (32, 4)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="mixtral-8x7b")
    args = p.parse_args()
    H, F, E, top_k, tokens = SHAPES[args.shape]
    M = tokens * top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, H, device="cuda", generator=g).bfloat16()
    z = torch.randn(M, F, device="cuda", generator=g)
    w1 = (torch.randn(E, 2 * F, H, device="cuda", generator=g) * H**-0.5).bfloat16()
    w2 = (torch.randn(E, H, F, device="cuda", generator=g) * F**-0.5).bfloat16()
    default_row, default_col = kq.ROW_TILE, kq.COL_TILE
    parts = {  # name: (axis kind, fn(recipe), input)
        "dequantized(x, -1)": ("row", lambda r: kq.dequantized(x, r, -1, tiny_blocks_exact=False), x),
        "dequantized(z fp32, -1)": ("row", lambda r: kq.dequantized(z, r, -1, tiny_blocks_exact=False), z),
        "dequantized_weight(w1, -1)": ("row", lambda r: kq.dequantized_weight(w1, r, -1), w1),
        "dequantized_weight(w2, -1)": ("row", lambda r: kq.dequantized_weight(w2, r, -1), w2),
        "dequantized_weight(w1, -2)": ("col", lambda r: kq.dequantized_weight(w1, r, -2), w1),
        "dequantized_weight(w2, -2)": ("col", lambda r: kq.dequantized_weight(w2, r, -2), w2),
    }
    totals = defaultdict(float)
    failed = []
    print(f"{'part':28s} {'recipe':6s} {'tile':14s} {'ms':>8s} {'GB/s':>7s}  bits")
    for key in ("mxfp8", "nvfp4"):
        r = recipe(key)
        for name, (kind, fn, t) in parts.items():
            kq.ROW_TILE, kq.COL_TILE = default_row, default_col
            ref = fn(r)[0]
            for tile in ROW_TILES if kind == "row" else COL_TILES:
                if kind == "row":
                    kq.ROW_TILE = tile
                else:
                    kq.COL_TILE = tile
                try:
                    same = torch.equal(fn(r)[0].view(torch.int16), ref.view(torch.int16))
                    ms = bench(lambda: fn(r))
                except Exception as exc:  # a tile that does not compile or launch: say so, go on
                    print(f"{name:28s} {key:6s} {str(tile):14s} failed: {type(exc).__name__}: {str(exc)[:80]}")
                    failed.append((key, kind, tile))
                    continue
                gbs = t.numel() * (t.element_size() + 2) / ms / 1e6
                print(f"{name:28s} {key:6s} {str(tile):14s} {ms:8.3f} {gbs:7.0f}  {'same' if same else 'DIFFER'}",
                      flush=True)  # fmt: skip
                if not same:
                    failed.append((key, kind, tile))
                totals[(key, kind, tile)] += ms
            kq.ROW_TILE, kq.COL_TILE = default_row, default_col
    print("\nsummed ms per recipe and axis (tiles that failed or differed left out), best first")
    for key in ("mxfp8", "nvfp4"):
        for kind in ("row", "col"):
            rows = sorted((ms, tile) for (k, kd, tile), ms in totals.items() if k == key and kd == kind
                          and (k, kd, tile) not in failed)  # fmt: skip
            print(f"{key} {kind}: " + ", ".join(f"{tile} {ms:.2f}" for ms, tile in rows))


if __name__ == "__main__":
    main()
