"""A/B of two variants' kernels in one GPU run: the per-kernel GPU time of a forward + backward step
(``profile_recipe.profile``) on each side, one process per side and round, the sides alternating, so
that clocks and neighbours drift alike on both. For levers that move a few kernels by less than the
step's run-to-run spread: judge the kernels the change touches, and read the step total beside them.

    git archive BASE src | tar -x -C /tmp/base      # B's sources, made where git works
    PYTHONPATH=src python3 benchmarks/ab_kernels.py --base /tmp/base/src [--shapes a,b]
        [--recipe fp8_block_wcache] [--kernels _wgrad_kernel,_quantize_kernel] [--rounds 3]
    PYTHONPATH=src python3 benchmarks/ab_kernels.py --set moemlp.kernels.quant.api:ROW_TILE=64,256,8
    PYTHONPATH=src python3 benchmarks/ab_kernels.py --recipe mxfp8 --set moemlp.kernels.quant.api:COL_TILE[32]=64,4

A is this checkout's src (with ``--set MODULE:NAME=INT[,INT...]`` applied to it: a tile constant, an
int or a tuple of ints; ``NAME[KEY]`` sets one entry of a dict constant keyed by ints), B is
``--base`` (default: the same src, unset). ``--recipe``: bf16, fp8_block, mxfp8, nvfp4, with
``_wcache`` for the weights quantized once outside the step. Prints,
per shape, the named kernels' summed ms in each round on each side, the mean difference A − B, and
the step totals alike; with ``--bf16``, also bf16's step (this src) and bf16's time ÷ each side's.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))


def child(recipe_name: str, shapes: list[str], steps: int, sets: list[str]) -> None:
    """One side's round: a JSON line per shape, {shape, total, kernels: {name: [ms, launches]}}."""
    sys.path.insert(0, HERE)
    from profile_recipe import profile

    for item in sets:  # MODULE:NAME=INT[,INT...] or MODULE:NAME[KEY]=INT[,INT...]
        target, value = item.split("=", 1)
        module, name = target.split(":")
        ints = tuple(int(v) for v in value.split(","))
        value = ints[0] if len(ints) == 1 else ints
        mod = importlib.import_module(module)
        if name.endswith("]"):  # an entry of a dict constant, e.g. quant.api's COL_TILE[32]
            name, key = name[:-1].split("[")
            table = getattr(mod, name)
            if int(key) not in table:
                raise SystemExit(f"--set {item}: {module}.{name} has no key {key}; it has {sorted(table)}")
            table[int(key)] = value
        else:
            setattr(mod, name, value)
    cached = recipe_name.endswith("_wcache")
    recipe = None if recipe_name == "bf16" else recipe_name.removesuffix("_wcache")
    for shape in shapes:
        rows = profile(shape, recipe, steps, cached=cached)
        print(json.dumps({"shape": shape, "total": sum(r[1] for r in rows),
                          "kernels": {key: [ms, n] for key, ms, n in rows}}), flush=True)  # fmt: skip


def run_side(src: str, recipe: str, shapes: list[str], steps: int, sets: list[str], timeout: int) -> list[dict]:
    tests = os.path.join(os.path.dirname(HERE), "tests")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(src), tests]))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", recipe, "--shapes", ",".join(shapes),
           "--steps", str(steps)] + [a for s in sets for a in ("--set", s)]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} (PYTHONPATH={env['PYTHONPATH']}) failed:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def touched(kernels: dict, names: list[str]) -> float:
    """The summed ms of the kernels whose name is one of names, or starts with one and '(' / '<'."""
    return sum(ms for key, (ms, _) in kernels.items()
               if any(key == n or key.startswith((n + "(", n + "<")) for n in names))  # fmt: skip


def mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else float("nan")


def table(results: dict, names: list[str], bf16: dict) -> list[str]:
    """results[side][shape] = [round dicts]; lines of the summary table."""
    lines = [f"{'shape':16s} {'kernels A':>24s} {'kernels B':>24s} {'A-B':>7s} {'step A':>22s} {'step B':>22s} "
             f"{'A-B':>7s}" + (f" {'bf16':>7s} {'bf16/A':>6s} {'bf16/B':>6s}" if bf16 else "")]  # fmt: skip
    for shape in results["A"]:
        ka, kb = ([touched(r["kernels"], names) for r in results[s][shape]] for s in "AB")
        ta, tb = ([r["total"] for r in results[s][shape]] for s in "AB")
        row = (f"{shape:16s} {'/'.join(f'{v:.3f}' for v in ka):>24s} {'/'.join(f'{v:.3f}' for v in kb):>24s} "
               f"{mean(ka) - mean(kb):+7.3f} {'/'.join(f'{v:.2f}' for v in ta):>22s} "
               f"{'/'.join(f'{v:.2f}' for v in tb):>22s} {mean(ta) - mean(tb):+7.3f}")  # fmt: skip
        if bf16:
            b = bf16[shape]
            row += f" {b:7.3f} {b / mean(ta):6.3f} {b / mean(tb):6.3f}"
        lines.append(row)
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=None, help="B's src directory (default: this checkout's src)")
    p.add_argument("--set", action="append", default=[], metavar="MODULE:NAME=INT[,INT...]",
                   help="a constant set on side A only (repeatable)")  # fmt: skip
    p.add_argument("--shapes", default="qwen3-30b-a3b,gpt-oss-120b,deepseek-v3-ep8,mixtral-8x7b")
    p.add_argument("--recipe", default="fp8_block_wcache")
    p.add_argument("--kernels", default="_wgrad_kernel,_quantize_kernel", help="the kernels the change touches")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="profiled steps a round (after 3 warm-up steps)")
    p.add_argument("--bf16", action="store_true", help="also bf16's step, once, for the speed-up")
    p.add_argument("--timeout", type=int, default=300, help="seconds a side's round may take")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    shapes = args.shapes.split(",")
    if args.child:
        return child(args.child, shapes, args.steps, args.set)
    sys.path.insert(0, HERE)
    from moemlp.bench.kernels import SHAPES

    for shape in shapes:
        if shape not in SHAPES:
            p.error(f"--shapes: unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    if args.recipe.removesuffix("_wcache") not in ("bf16", "fp8_block", "mxfp8", "nvfp4"):
        p.error(f"--recipe: expected bf16, fp8_block, mxfp8 or nvfp4 (with _wcache), got {args.recipe!r}")
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps: at least 1")
    for item in args.set:
        target, _, value = item.partition("=")
        name = target.partition(":")[2]
        if (":" not in target or not value or not all(v.strip().lstrip("-").isdigit() for v in value.split(","))
                or not re.fullmatch(r"\w+(\[-?\d+\])?", name)):  # fmt: skip
            p.error(f"--set: expected MODULE:NAME=INT[,INT...] or MODULE:NAME[KEY]=INT[,INT...], got {item!r}")
    src_a = os.path.join(os.path.dirname(HERE), "src")
    src_b = args.base or src_a
    if not os.path.isdir(os.path.join(src_b, "moemlp")):
        p.error(f"--base: {src_b} holds no moemlp package")
    names = args.kernels.split(",")
    results = {"A": defaultdict(list), "B": defaultdict(list)}
    for r in range(args.rounds):
        for side, src, sets in (("A", src_a, args.set), ("B", src_b, [])):
            for row in run_side(src, args.recipe, shapes, args.steps, sets, args.timeout):
                results[side][row["shape"]].append(row)
            print(f"round {r + 1} of {args.rounds}, side {side} done", flush=True)
    bf16 = {}
    if args.bf16:
        bf16 = {row["shape"]: row["total"] for row in run_side(src_a, "bf16", shapes, args.steps, [], args.timeout)}
    print(f"\n{args.recipe}, kernels {', '.join(names)}; A: {src_a} {' '.join(args.set)}; B: {src_b}; "
          f"ms a step, {args.rounds} rounds")  # fmt: skip
    print("\n".join(table(results, names, bf16)))


if __name__ == "__main__":
    main()
