"""`python -m moemlp bench`: moemlp against the torch compositions users run, same process, same inputs.

Peers (``--peers``, default ``lean,compiled``):

- ``lean``: ``lean_composition`` (bench/peers.py), what torchtitan and transformers' "grouped_mm"
  experts write, run eagerly;
- ``compiled``: the same function under ``torch.compile`` (inductor fuses silu · up · probs): the
  peer a torchtitan user gets, and the one to beat;
- ``te``: ``torch_composition``, the three unfused ops TransformerEngine runs on Hopper (probs rounded
  to bf16, the activation upcast).

Every timing is a median with its spread (p10–p90) and sample count; a spread over
``NOISY_SPREAD`` is flagged. Forward + backward is also taken as GPU time (``*_fwdbwd_gpu_ms``,
``bench.common.gpu_time_ms``: the kernels back to back, the host's launch time hidden behind a
preloaded queue, as in a model whose host runs ahead), so a shape where the host sets the wall time
shows it. On a CPU the numbers check that the command runs; they say nothing of
GPU speed.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

from ..functional import _resolve_backend, grouped_mlp
from .common import (
    device_description,
    fwd_and_fwd_bwd,
    gpu_time_ms,
    print_table,
    routed_problem,
    saved_bytes_per_row,
    write_csv,
)
from .peers import lean_composition, torch_composition

PEERS = ("lean", "compiled", "te")
DEFAULT_PEERS = ("lean", "compiled")
NOISY_SPREAD = 0.15  # (p90 − p10) / median above this: the timing is noise-dominated


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def _peer_fns(peers, x, splits, probs, w1, w2):
    fns = {}
    for name in peers:
        if name == "lean":
            fns[name] = lambda: lean_composition(x, splits, probs, w1, w2)
        elif name == "compiled":
            # A fresh compile a shape: dynamo keys its cache by the function's code, so shapes timed one
            # after another would share one recompile budget (2-3 graphs a shape: grad mode on and off),
            # and past it dynamo runs the function eagerly with no more than a warning.
            torch._dynamo.reset()
            compiled = torch.compile(lean_composition, dynamic=False)  # static shapes: its best case
            fns[name] = lambda compiled=compiled: compiled(x, splits, probs, w1, w2)
        elif name == "te":
            fns[name] = lambda: torch_composition(x, splits, probs, w1, w2)
        else:
            raise ValueError(f"--peers: unknown peer {name!r}; known: {list(PEERS)}")
    return fns


def bench_shape(shape, device, backend: str, rep_ms: int, peers=DEFAULT_PEERS) -> dict:
    x, splits, probs, w1, w2, dy = routed_problem(shape, device)
    leaves = [t.requires_grad_() for t in (x, probs, w1, w2)]

    def ours():
        return grouped_mlp(x, splits, probs, w1, w2, backend=backend)

    fns = {"moemlp": ours, **_peer_fns(peers, x, splits, probs, w1, w2)}
    row = {"shape": shape.name, "H": shape.hidden, "F": shape.ffn, "E": shape.experts,
           "top_k": shape.top_k, "tokens": shape.tokens, "M": shape.rows}
    # Sanity before timing: every peer computes the same function (bf16 roundings apart).
    with torch.no_grad():
        y = ours()
        for name, fn in fns.items():
            if name != "moemlp":
                agree = _rel(fn(), y)
                if not agree < 2e-2:
                    raise RuntimeError(f"{shape.name}: moemlp and peer {name!r} disagree (rel {agree:.3e})")
                row[f"rel_diff_y_{name}"] = agree
    for label, fn in fns.items():
        fwd, fwd_bwd = fwd_and_fwd_bwd(fn, leaves, dy, device, rep_ms)
        for phase, t in (("fwd", fwd), ("fwdbwd", fwd_bwd)):
            row[f"{label}_{phase}_ms"] = t.median
            row[f"{label}_{phase}_spread"] = t.spread
            row[f"{label}_{phase}_n"] = t.n
            row[f"{label}_{phase}_tflops"] = shape.flops(phase == "fwdbwd") / t.median / 1e9
        row[f"{label}_fwdbwd_gpu_ms"] = gpu_time_ms(lambda fn=fn: torch.autograd.grad(fn(), leaves, dy), device)
        row[f"{label}_saved_bytes_per_row"] = saved_bytes_per_row(fn, [x, w1, w2, splits], shape.rows)
    for name in fns:
        if name != "moemlp":
            for phase in ("fwd", "fwdbwd", "fwdbwd_gpu"):
                row[f"vs_{name}_{phase}"] = row[f"{name}_{phase}_ms"] / row[f"moemlp_{phase}_ms"]
    return row


def plot(rows: list[dict], labels: list[str], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written (pip install 'moemlp[bench]')")
        return False
    names = [r["shape"] for r in rows]
    width = 0.8 / len(labels)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, phase, title_ in ((axes[0], "fwd", "forward"), (axes[1], "fwdbwd", "forward + backward")):
        for j, label in enumerate(labels):
            xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(names))]
            ax.bar(xs, [r[f"{label}_{phase}_tflops"] for r in rows], width, label=label)
        ax.set_xticks(list(range(len(names))), names, rotation=20, ha="right")
        ax.set_title(title_)
        ax.set_ylabel("TFLOP/s")
    handles, legend = axes[0].get_legend_handles_labels()
    fig.legend(handles, legend, loc="lower center", ncol=len(labels))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def ran_backend(backend: str, device: torch.device) -> str:
    """The backend ``grouped_mlp(backend=backend)`` runs here (what "auto" resolves to)."""
    probe = torch.empty(1, 1, dtype=torch.bfloat16, device=device)
    return _resolve_backend(backend, probe, None)


@contextlib.contextmanager
def _compiled_or_error(shape_name: str, on: bool):
    """While the compiled peer is timed: a dynamo recompile-limit hit raises rather than letting the
    'compiled' column time the eager composition."""
    if not on:
        yield
        return
    from torch._dynamo import config as dynamo_config

    try:
        from torch._dynamo.exc import FailOnRecompileLimitHit
    except ImportError:  # a torch without the switch: the reset per shape (_peer_fns) is the guard
        yield
        return

    with dynamo_config.patch(fail_on_recompile_limit_hit=True):
        try:
            yield
        except FailOnRecompileLimitHit as exc:
            raise RuntimeError(
                f"{shape_name}: the compiled peer went past torch._dynamo's recompile limit "
                f"({dynamo_config.recompile_limit}), so it would have run eagerly; its figures are not "
                f"written") from exc


def run_bench(shapes, device: torch.device, backend: str, out_dir: str, rep_ms: int,
              peers=DEFAULT_PEERS) -> list[dict]:
    desc = device_description(device)
    ran = ran_backend(backend, device)
    print(f"moemlp bench on {desc}; backend={backend} (runs: {ran}); peers: {', '.join(peers)}; "
          f"bf16, fp32 probs, SwiGLU, uniform top-k routing", flush=True)
    if device.type != "cuda":
        print("  (CPU: these timings check that the command runs; they say nothing of GPU speed)", flush=True)
    rows = []
    for i, shape in enumerate(shapes, 1):
        print(f"[{i}/{len(shapes)}] {shape.name}: H={shape.hidden} F={shape.ffn} E={shape.experts} "
              f"top_k={shape.top_k} tokens={shape.tokens} ...", flush=True)
        with _compiled_or_error(shape.name, "compiled" in peers):
            row = bench_shape(shape, device, backend, rep_ms, peers)
        row["backend"] = ran
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, "bench.csv")
    write_csv(csv_path, rows)
    labels = ["moemlp", *peers]
    png_path = os.path.join(out_dir, "bench.png")
    wrote_png = plot(rows, labels, png_path, f"moemlp vs torch compositions — {desc}")

    print()
    times = []
    for r in rows:
        for label in labels:
            t = {"shape": r["shape"], "impl": label}
            for phase in ("fwd", "fwdbwd"):
                spread = r[f"{label}_{phase}_spread"]
                t[f"{phase} ms"] = r[f"{label}_{phase}_ms"]
                t[f"{phase} ±"] = f"{100 * spread:.0f}%" + (" !" if spread > NOISY_SPREAD else "")
                t[f"{phase} n"] = r[f"{label}_{phase}_n"]
                t[f"{phase} TFLOP/s"] = r[f"{label}_{phase}_tflops"]
            t["fwdbwd GPU ms"] = r[f"{label}_fwdbwd_gpu_ms"]
            t["saved B/row"] = r[f"{label}_saved_bytes_per_row"]
            times.append(t)
    print_table(times, list(times[0]),
                "median ms, ± = (p90 − p10) / median over n samples, TFLOP/s (forward 6·M·H·F, "
                "forward+backward 18·M·H·F); saved = bytes kept for backward per routed row beyond x and "
                "the weights")
    noisy = [f"{t['shape']}/{t['impl']}" for t in times if "!" in t["fwd ±"] + t["fwdbwd ±"]]
    if noisy:
        print(f"\nwarning: spread over {100 * NOISY_SPREAD:.0f}% (marked !) for {', '.join(noisy)}: "
              f"those ratios are noise-dominated; rerun on an idle machine or with a larger --rep-ms")
    ratio_cols = [f"vs_{p}_{phase}" for p in peers for phase in ("fwd", "fwdbwd", "fwdbwd_gpu")]
    print()
    print_table(rows, ["shape", *ratio_cols],
                "speed-up of moemlp = peer time / moemlp time (> 1: moemlp is faster); fwdbwd_gpu: GPU time, "
                "the host's launch time hidden (nan off a GPU)")
    print(f"\nwrote {csv_path}" + (f" and {png_path}" if wrote_png else ""), file=sys.stderr)
    return rows
