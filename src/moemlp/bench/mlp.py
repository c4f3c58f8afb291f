"""`python -m moemlp bench`: moemlp against the unfused torch composition, same process, same inputs."""

from __future__ import annotations

import os
import sys

import torch

from ..functional import grouped_mlp
from .common import (
    device_description,
    fwd_and_fwd_bwd_ms,
    print_table,
    routed_problem,
    saved_bytes_per_row,
    write_csv,
)
from .peers import torch_composition


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def bench_shape(shape, device, backend: str, rep_ms: int) -> dict:
    x, splits, probs, w1, w2, dy = routed_problem(shape, device)
    leaves = [t.requires_grad_() for t in (x, probs, w1, w2)]

    def ours():
        return grouped_mlp(x, splits, probs, w1, w2, backend=backend)

    def peer():
        return torch_composition(x, splits, probs, w1, w2)

    # Sanity before timing: the two must compute the same function.
    with torch.no_grad():
        agree = _rel(ours(), peer())
    if not agree < 2e-2:
        raise RuntimeError(f"{shape.name}: moemlp and the torch composition disagree (rel {agree:.3e})")

    row = {"shape": shape.name, "H": shape.hidden, "F": shape.ffn, "E": shape.experts,
           "top_k": shape.top_k, "tokens": shape.tokens, "M": shape.rows}
    for label, fn in (("moemlp", ours), ("torch", peer)):
        fwd, fwd_bwd = fwd_and_fwd_bwd_ms(fn, leaves, dy, device, rep_ms)
        row[f"{label}_fwd_ms"] = fwd
        row[f"{label}_fwdbwd_ms"] = fwd_bwd
        row[f"{label}_fwd_tflops"] = shape.flops(False) / fwd / 1e9
        row[f"{label}_fwdbwd_tflops"] = shape.flops(True) / fwd_bwd / 1e9
        row[f"{label}_saved_bytes_per_row"] = saved_bytes_per_row(fn, [x, w1, w2, splits], shape.rows)
    row["speedup_fwd"] = row["torch_fwd_ms"] / row["moemlp_fwd_ms"]
    row["speedup_fwdbwd"] = row["torch_fwdbwd_ms"] / row["moemlp_fwdbwd_ms"]
    row["rel_diff_y"] = agree
    return row


def plot(rows: list[dict], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written (pip install 'moemlp[bench]')")
        return False
    names = [r["shape"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, phase, label in ((axes[0], "fwd", "forward"), (axes[1], "fwdbwd", "forward + backward")):
        xs = range(len(names))
        ax.bar([i - 0.2 for i in xs], [r[f"moemlp_{phase}_tflops"] for r in rows], 0.4, label="moemlp")
        ax.bar([i + 0.2 for i in xs], [r[f"torch_{phase}_tflops"] for r in rows], 0.4,
               label="torch composition")
        ax.set_xticks(list(xs), names, rotation=20, ha="right")
        ax.set_title(label)
        ax.set_ylabel("TFLOP/s")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run_bench(shapes, device: torch.device, backend: str, out_dir: str, rep_ms: int) -> list[dict]:
    desc = device_description(device)
    print(f"moemlp bench on {desc}; backend={backend}; bf16, fp32 probs, SwiGLU, uniform top-k routing",
          flush=True)
    rows = []
    for i, shape in enumerate(shapes, 1):
        print(f"[{i}/{len(shapes)}] {shape.name}: H={shape.hidden} F={shape.ffn} E={shape.experts} "
              f"top_k={shape.top_k} tokens={shape.tokens} ...", flush=True)
        rows.append(bench_shape(shape, device, backend, rep_ms))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, "bench.csv")
    write_csv(csv_path, rows)
    png_path = os.path.join(out_dir, "bench.png")
    wrote_png = plot(rows, png_path, f"moemlp vs torch composition — {desc}")
    print()
    print_table(
        rows,
        ["shape", "moemlp_fwd_tflops", "torch_fwd_tflops", "speedup_fwd", "moemlp_fwdbwd_tflops",
         "torch_fwdbwd_tflops", "speedup_fwdbwd", "moemlp_saved_bytes_per_row",
         "torch_saved_bytes_per_row"],
        "TFLOP/s (forward 6·M·H·F, forward+backward 18·M·H·F), medians "
        + ("of triton's do_bench" if device.type == "cuda" else "of a host clock (CPU)")
        + "; saved = bytes kept for backward per routed row beyond x and the weights (probs counted)",
    )
    print(f"\nwrote {csv_path}" + (f" and {png_path}" if wrote_png else ""), file=sys.stderr)
    return rows
