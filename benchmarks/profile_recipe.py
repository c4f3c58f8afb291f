"""Per-kernel GPU time of one grouped-MLP forward + backward, by recipe (torch.profiler), on one
ANCHORS.md shape: where the time between the bf16 path and a recipe goes, launch by launch.

    PYTHONPATH=src python3 benchmarks/profile_recipe.py [--shape mixtral-8x7b] [--recipes bf16,fp8_block,fp8_block_wcache]

Prints, per recipe, each kernel's GPU time per step (ms, summed over its launches) and launch
count, largest first, and the step total; warm-up steps run first, then ``--steps`` profiled ones.
``RECIPE_wcache`` (e.g. ``fp8_block_wcache``, ``nvfp4_wcache``): the recipe with the weights quantized
once before the steps (``quantize_weights``), what a later micro-batch of an optimizer step runs.
``--trace`` also prints the launches of one step in order (≥ 0.05 ms), which tells the GEMMs of one
kernel apart (FC1, FC2, FC2_DGRAD, FC1_DGRAD of ``grouped_gemm_kernel``).
"""

from __future__ import annotations

import argparse

import torch

from moemlp.bench.kernels import mlp_step


def profile(
    shape: str, recipe: str | None, steps: int, trace: bool = False, cached: bool = False
) -> list[tuple[str, float, int]]:
    step = mlp_step(shape, recipe, cached)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    if trace:  # every kernel of the last step, in launch order
        kernels = [ev for ev in prof.events() if str(ev.device_type).endswith("CUDA")]
        kernels.sort(key=lambda ev: ev.time_range.start)
        per_step = len(kernels) // steps
        print(f"\n-- {shape} {recipe or 'bf16'}: the launches of one step, in order", flush=True)
        for ev in kernels[-per_step:]:
            ms = ev.time_range.elapsed_us() / 1e3
            if ms >= 0.05:
                print(f"{ms:8.3f} ms  {ev.name[:60]}")
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = ev.cuda_time_total
        if t > 0:
            rows.append((ev.key, t / 1e3 / steps, ev.count // steps))
    return sorted(rows, key=lambda r: -r[1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="mixtral-8x7b")
    p.add_argument("--recipes", default="bf16,fp8_block,mxfp8,nvfp4")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--trace", action="store_true", help="also every launch of one step, in order")
    args = p.parse_args()
    for name in args.recipes.split(","):
        cached = name.endswith("_wcache")  # weights quantized once outside the step (quantize_weights)
        recipe = None if name == "bf16" else name.removesuffix("_wcache")
        rows = profile(args.shape, recipe, args.steps, args.trace, cached)
        total = sum(r[1] for r in rows)
        print(f"\n== {args.shape} {name}: {total:.2f} ms of kernels per fwd+bwd step", flush=True)
        for key, ms, n in rows[:16]:
            print(f"{ms:8.3f} ms {n:3d}x  {key[:90]}")


if __name__ == "__main__":
    main()
