"""python -m moemlp {bench, precision}: the main jobs, with tables, CSV and PNG."""

from __future__ import annotations

import argparse
import sys

import torch


def _device(arg: str | None) -> torch.device:
    if arg:
        return torch.device(arg)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _shapes(names, device):
    from .bench.common import all_shapes, default_shapes

    if not names:
        return list(default_shapes(device).values())
    known = all_shapes()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--shape: unknown {unknown}; known: {sorted(known)}")
    return [known[n] for n in names]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moemlp", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="time moemlp against the unfused torch composition")
    b.add_argument("--shape", action="append", help="a model shape (repeatable); default: all for the device")
    b.add_argument("--moe", action="store_true", help="benchmark the whole MoE layer instead")
    b.add_argument("--recipes", action="store_true", help="fp8_block, mxfp8 and nvfp4 beside the bf16 path")
    p = sub.add_parser("precision", help="relative errors vs float64: the probability contract")
    p.add_argument("--shape", action="append", help="a model shape; default: the device's first")
    for sp in (b, p):
        sp.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
        sp.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
        sp.add_argument("--out", default="results", help="folder for CSV and PNG (default: results)")
    b.add_argument("--rep-ms", type=int, default=200, help="timing budget per measurement (ms)")
    args = parser.parse_args(argv)
    device = _device(args.device)

    if args.cmd == "bench":
        if args.moe:
            from .bench.moe import run_moe_bench

            run_moe_bench(args)
            return 0
        if args.recipes:
            from .bench.recipes import run_recipe_bench

            run_recipe_bench(_shapes(args.shape, device), device, args.backend, args.out, args.rep_ms)
            return 0
        from .bench.mlp import run_bench

        run_bench(_shapes(args.shape, device), device, args.backend, args.out, args.rep_ms)
    elif args.cmd == "precision":
        from .bench.precision import run_precision

        run_precision(_shapes(args.shape, device)[0], device, args.backend, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
