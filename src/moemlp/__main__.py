"""python -m moemlp {bench, precision}: the main jobs, with tables, CSV and PNG."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

# A step of a GPU model shape is 10-100 TFLOP: hours on a CPU. Past this many FLOPs per forward +
# backward a CPU run is refused instead of looking hung.
_CPU_FLOP_LIMIT = 5e11


def _device(arg: str | None) -> torch.device:
    if arg:
        return torch.device(arg)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _device_arg(arg: str) -> str:
    """--device: cpu or cuda[:N], checked against this machine."""
    try:
        device = torch.device(arg)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {arg!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {arg!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{arg!r}: this torch sees no CUDA device (torch.cuda.is_available() "
                                             f"is False); run on a machine with a GPU, or use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{arg!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    return arg


def _positive_int(arg: str) -> int:
    try:
        value = int(arg)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {arg!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _check_out(parser: argparse.ArgumentParser, out: str) -> None:
    """--out before any run: a folder that exists or can be made, and can be written."""
    if not out:
        parser.error("--out: expected a folder, got ''")
    if os.path.exists(out) and not os.path.isdir(out):
        parser.error(f"--out {out}: exists and is not a folder")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {out}: cannot make the folder ({e.strerror})")
    if not os.access(out, os.W_OK | os.X_OK):
        parser.error(f"--out {out}: the folder is not writable")


def _shape(arg: str):
    """--shape: a named shape, or H,F,E,TOP_K,TOKENS[:SKEW]."""
    from .bench.common import all_shapes, parse_shape

    named = all_shapes()
    if arg in named:
        return named[arg]
    if "," not in arg:
        raise argparse.ArgumentTypeError(
            f"unknown shape {arg!r}: one of {', '.join(named)}, or H,F,E,TOP_K,TOKENS[:SKEW]"
        )
    try:
        return parse_shape(arg)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _shapes(shapes, device):
    from .bench.common import default_shapes

    if not shapes:
        return list(default_shapes(device).values())
    shapes = list(dict.fromkeys(shapes))  # argparse made each a Shape
    if device.type != "cuda":
        heavy = [s for s in shapes if s.flops(True) > _CPU_FLOP_LIMIT]
        if heavy:
            raise SystemExit(
                f"--shape {heavy[0].name}: {heavy[0].flops(True) / 1e12:.0f} TFLOP per forward + backward, hours on "
                f"a CPU; shapes of that size are for a GPU (--device cuda). On a CPU use --shape cpu-small."
            )
    return shapes


def _peers(arg: str):
    from .bench.mlp import PEERS

    peers = tuple(p for p in arg.split(",") if p)
    unknown = [p for p in peers if p not in PEERS]
    if unknown or not peers:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {list(PEERS)}, got {arg!r}")
    return peers


def main(argv=None) -> int:
    from .bench.common import all_shapes
    from .bench.mlp import DEFAULT_PEERS
    from .bench.moe import DEFAULT_EP, ep_sizes

    shape_names = list(all_shapes())
    parser = argparse.ArgumentParser(prog="python -m moemlp", description=__doc__, allow_abbrev=False)
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="time moemlp against the torch compositions users run", allow_abbrev=False)
    b.add_argument("--moe", action="store_true", help="benchmark the whole MoE layer instead")
    b.add_argument("--ep", type=ep_sizes, default=None, metavar="N,N,...",
                   help="with --moe: expert-parallel world sizes, comma-separated (default 1,2); "
                        "sizes above the GPU count are skipped")
    b.add_argument("--recipes", action="store_true", help="fp8_block, mxfp8 and nvfp4 beside the bf16 path")
    b.add_argument("--parts", action="store_true",
                   help="the six GEMMs of forward + backward, each as a percentage of a dense torch.mm; with "
                        "--recipes, fp8_block's step part by part (GEMMs and quantizer passes)")
    b.add_argument("--hf", action="store_true",
                   help="a transformers decoder layer and model: the 'moemlp' experts backend against 'grouped_mm'")
    b.add_argument("--peers", type=_peers, default=None,
                   help="comma-separated: lean (the _grouped_mm composition users write), compiled (it under "
                        "torch.compile), te (three unfused ops as TransformerEngine on Hopper); default lean,compiled")
    b.add_argument("--rep-ms", type=_positive_int, default=None,
                   help="timing budget per measurement (ms, default 200; not with --moe, which times a fixed count)")
    p = sub.add_parser("precision", help="relative errors vs float64: the probability contract", allow_abbrev=False)
    for sp in (b, p):
        sp.add_argument("--shape", action="append", type=_shape, metavar="NAME|H,F,E,TOP_K,TOKENS[:SKEW]",
                        help=f"a shape (repeatable): one of {', '.join(shape_names)}, or your own as hidden size, "
                             f"per-expert FFN size, experts, experts a token and tokens, with an optional routing "
                             f"skew (expert e drawn with weight (e + 1)^-SKEW; 0, the default, is uniform), e.g. "
                             f"4096,1536,64,6,8192:1.2; default: every model shape on a GPU, cpu-small on a CPU")
        sp.add_argument("--device", type=_device_arg, default=None,
                        help="cuda[:N] or cpu (default: cuda when available)")
        sp.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
        sp.add_argument("--out", default="results", help="folder for CSV and PNG (default: results)")
    args = parser.parse_args(argv)
    device = _device(args.device)
    if args.backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error(f"--backend triton: Triton runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (slow); "
                     f"the device is {device}")

    if args.cmd == "bench":
        if (args.moe or args.hf) and args.shape:
            parser.error("--shape sets the expert block's shape (bench, --parts, --recipes, precision); "
                         f"{'--moe' if args.moe else '--hf'} runs its own model shapes")
        modes = [f for f in ("moe", "hf", "recipes", "parts") if getattr(args, f)]
        if args.moe and args.hf or (args.moe or args.hf) and (args.recipes or args.parts):
            parser.error(f"--{modes[0]} and --{modes[1]} are separate benches: run one at a time")
        if args.ep is not None and not args.moe:
            parser.error("--ep applies to --moe only")
        if args.peers is not None and modes:
            parser.error(f"--peers applies to the plain bench only, not --{modes[0]}")
        if args.rep_ms is not None and args.moe:
            parser.error("--rep-ms does not apply to --moe, which times a fixed number of steps")
        if args.hf and importlib.util.find_spec("transformers") is None:
            parser.error("--hf needs the transformers package (pip install transformers)")
        args.peers = DEFAULT_PEERS if args.peers is None else args.peers
        args.ep = DEFAULT_EP if args.ep is None else args.ep
        args.rep_ms = 200 if args.rep_ms is None else args.rep_ms
    _check_out(parser, args.out)

    if args.cmd == "bench":
        if args.moe:
            from .bench.moe import run_moe_bench

            run_moe_bench(args)
            return 0
        if args.hf:
            from .bench.hf import run_hf_bench

            run_hf_bench(args)
            return 0
        if args.parts and args.recipes:
            from .bench.parts import run_fp8_parts_bench

            run_fp8_parts_bench(_shapes(args.shape, device), device, args.out, args.rep_ms)
            return 0
        if args.parts:
            from .bench.parts import run_parts_bench

            run_parts_bench(_shapes(args.shape, device), device, args.out, args.rep_ms)
            return 0
        if args.recipes:
            from .bench.recipes import run_recipe_bench

            run_recipe_bench(_shapes(args.shape, device), device, args.backend, args.out, args.rep_ms)
            return 0
        from .bench.mlp import run_bench

        run_bench(_shapes(args.shape, device), device, args.backend, args.out, args.rep_ms, args.peers)
    elif args.cmd == "precision":
        from .bench.precision import run_precision

        run_precision(_shapes(args.shape, device), device, args.backend, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
