"""`python -m moemlp bench --recipes`: the grouped MLP under each block-scaled recipe beside moemlp's
own bf16 path, same process, same inputs (quantization included in every timing: activations and
gradients per call, weights per call too, as a step that changes the weights must). On the Triton
path one more column per recipe, ``<recipe>_wcache``, times it with the weights quantized once
outside the call (``moemlp.quantize_weights``): what a later micro-batch of an optimizer step costs.
On a GPU each variant also gets a GPU time (``<label>_fwdbwd_gpu_ms``, ``bench.common.gpu_time_ms``:
the kernels back to back with the host's launch time hidden) and its speedup over bf16's GPU time,
which tells where a recipe's extra launches, not its kernels, set the wall time.

Before timing, each recipe's output is checked against the unquantized bf16 result (signal-to-noise
ratio in dB over y): a broken path is a loud error, not a fast number.
"""

from __future__ import annotations

import os
import sys

import torch

from .._quantized_weights import quantize_weights
from ..functional import grouped_mlp
from .common import device_description, fwd_and_fwd_bwd, gpu_time_ms, print_table, routed_problem, write_csv
from .mlp import NOISY_SPREAD

RECIPES = ("fp8_block", "mxfp8", "nvfp4")
WCACHE = "_wcache"  # <recipe>_wcache: weights quantized once per step (micro-batches after the first)
# y against the bf16 path, one seed per shape: fp8_block / mxfp8 ~24-26 dB and nvfp4 ~12-13 dB are
# what the torch emulation gives (tests/recipes/test_recipe_contract.py, MLP_FLOORS); 6 dB under is a broken path.
SANITY_DB = {"fp8_block": 18.0, "mxfp8": 18.0, "nvfp4": 6.0}


def _snr_db(a, ref) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return float(10 * torch.log10(ref.pow(2).sum() / (a - ref).pow(2).sum().clamp_min(1e-300)))


def bench_shape(shape, device, backend: str, rep_ms: int, recipes=RECIPES) -> dict:
    x, splits, probs, w1, w2, dy = routed_problem(shape, device)
    leaves = [t.requires_grad_() for t in (x, probs, w1, w2)]
    row = {"shape": shape.name, "H": shape.hidden, "F": shape.ffn, "E": shape.experts, "M": shape.rows}
    with torch.no_grad():
        y_bf16 = grouped_mlp(x, splits, probs, w1, w2, backend=backend)
    variants = [(None, None)] + [(name, name) for name in recipes]
    if backend != "torch" and (backend == "triton" or device.type == "cuda"):
        variants += [(name + WCACHE, name) for name in recipes]
    for label, name in variants:
        label = label or "bf16"
        qw = quantize_weights(w1, w2, name) if label.endswith(WCACHE) else None

        def fn(name=name, qw=qw):
            return grouped_mlp(x, splits, probs, w1, w2, backend=backend, recipe=name, quantized_weights=qw)

        if name is not None:
            with torch.no_grad():
                snr = _snr_db(fn(), y_bf16)
            if not snr >= SANITY_DB[name]:
                raise RuntimeError(f"{shape.name}: {name} output is {snr:.1f} dB from bf16's (< {SANITY_DB[name]})")
            row[f"{label}_snr_db"] = snr
        t_fwd, t_fwd_bwd = fwd_and_fwd_bwd(fn, leaves, dy, device, rep_ms)
        fwd, fwd_bwd = t_fwd.median, t_fwd_bwd.median
        row[f"{label}_fwd_ms"] = fwd
        row[f"{label}_fwdbwd_ms"] = fwd_bwd
        row[f"{label}_fwdbwd_spread"] = t_fwd_bwd.spread
        row[f"{label}_fwdbwd_n"] = t_fwd_bwd.n
        row[f"{label}_fwdbwd_tflops"] = shape.flops(True) / fwd_bwd / 1e9
        row[f"{label}_fwdbwd_gpu_ms"] = gpu_time_ms(lambda fn=fn: torch.autograd.grad(fn(), leaves, dy), device)
        if name is not None:
            row[f"{label}_speedup_fwd"] = row["bf16_fwd_ms"] / fwd
            row[f"{label}_speedup_fwdbwd"] = row["bf16_fwdbwd_ms"] / fwd_bwd
            row[f"{label}_speedup_fwdbwd_gpu"] = row["bf16_fwdbwd_gpu_ms"] / row[f"{label}_fwdbwd_gpu_ms"]
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def run_recipe_bench(shapes, device: torch.device, backend: str, out_dir: str, rep_ms: int) -> list[dict]:
    desc = device_description(device)
    print(f"moemlp bench --recipes on {desc}; backend={backend}; bf16 inputs, fp32 probs, SwiGLU", flush=True)
    rows = []
    for i, shape in enumerate(shapes, 1):
        print(f"[{i}/{len(shapes)}] {shape.name}: H={shape.hidden} F={shape.ffn} E={shape.experts} ...", flush=True)
        rows.append(bench_shape(shape, device, backend, rep_ms))
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, "bench_recipes.csv")
    write_csv(csv_path, rows)
    print()
    cols = ["shape", "bf16_fwdbwd_ms"]
    for name in RECIPES:
        cols += [f"{name}_fwdbwd_ms", f"{name}_speedup_fwdbwd", f"{name}_speedup_fwd", f"{name}_snr_db"]
    for name in RECIPES:
        if any(f"{name}{WCACHE}_fwdbwd_ms" in r for r in rows):
            cols += [f"{name}{WCACHE}_fwdbwd_ms", f"{name}{WCACHE}_speedup_fwdbwd"]
    if device.type == "cuda":  # GPU time: the host's launches hidden (NaN on a CPU, so not shown there)
        cols += ["bf16_fwdbwd_gpu_ms"] + [
            f"{label}_speedup_fwdbwd_gpu" for label in (*RECIPES, *(n + WCACHE for n in RECIPES))
            if any(f"{label}_speedup_fwdbwd_gpu" in r for r in rows)
        ]  # fmt: skip
    print_table(
        rows,
        cols,
        "forward+backward ms (medians"
        + (" of triton's do_bench" if device.type == "cuda" else " of a host clock (CPU)")
        + "); speedup = bf16 time / recipe time, quantization included; snr = y vs the bf16 path (dB)",
    )
    few = [f"{r['shape']}/{k[: -len('_fwdbwd_n')]}" for r in rows for k in r
           if k.endswith("_fwdbwd_n") and (r[k] < 5 or r[k.replace("_n", "_spread")] > NOISY_SPREAD)]
    if few:
        print(f"\nwarning: fewer than 5 samples or a spread over {100 * NOISY_SPREAD:.0f}% for {', '.join(few)}: "
              f"those medians are noise-prone; raise --rep-ms (each sample is one forward + backward)")
    print(f"\nwrote {csv_path}", file=sys.stderr)
    return rows
