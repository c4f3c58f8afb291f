"""`python -m moemlp bench --moe`: the MoE layer's forward + backward throughput on one device and
expert-parallel over 2 (spawned processes, no torchrun), and the share of time in each phase.

Phases, each timed on its own, forward + backward, on the inputs the layer itself produces:
  dispatch   router, sort, permute (+ counts exchange, all-to-all, regroup with EP)
  experts    grouped_mlp on this rank's rows
  combine    (regroup back, all-to-all with EP,) k-ordered unpermute
Shares are of the phases' sum; the whole layer is timed too (its time is the headline).

Timing: a fixed number of iterations, one pair of device events each, median. (triton's do_bench
picks its iteration count from a first estimate, which may differ between EP ranks: a collective
called a different number of times would hang.) FLOPs of the experts: 18·T·k·H·F per rank.

With EP the all-to-alls and the one host sync of the row counts show in dispatch and combine.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..moe import MoE
from ..moe.dispatch import local_combine, local_dispatch, use_triton
from ..moe.ep import ep_combine, ep_dispatch
from .common import device_description, print_table, write_csv

__all__ = ["run_moe_bench", "MoEShape"]


@dataclass(frozen=True)
class MoEShape:
    name: str
    hidden: int  # H
    ffn: int  # F
    experts: int  # E, all ranks together
    top_k: int
    tokens: int  # per rank
    ep: int  # expert-parallel ranks

    def flops_per_rank(self) -> float:
        """GLU expert MLP forward + backward on this rank's routed rows (balanced routing)."""
        return 18.0 * self.tokens * self.top_k * self.hidden * self.ffn


# DeepSeek-V3's expert shape (H 7168, F 2048, top-8, sigmoid routing) with 32 experts per GPU (its
# 256 experts over 8-way EP): one GPU holds E = 32, EP over 2 GPUs E = 64.
GPU_SHAPES = (
    MoEShape("deepseek-v3-like", 7168, 2048, 32, 8, 4096, 1),
    MoEShape("deepseek-v3-like", 7168, 2048, 64, 8, 4096, 2),
)
CPU_SHAPES = (
    MoEShape("cpu-small", 256, 128, 8, 2, 256, 1),
    MoEShape("cpu-small", 256, 128, 8, 2, 256, 2),
)


def _time_ms(fn, device: torch.device, iters: int, warmup: int, group=None) -> float:
    for _ in range(warmup):
        fn()
    if group is not None:
        dist.barrier(group=group)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(shape: MoEShape, device: torch.device, backend: str, group, iters: int, warmup: int) -> dict:
    """Times the layer and its phases on this rank; every rank of ``group`` calls it in lockstep."""
    dtype = torch.bfloat16
    torch.manual_seed(0)
    moe = MoE(hidden_size=shape.hidden, ffn_hidden_size=shape.ffn, num_experts=shape.experts, top_k=shape.top_k, score="sigmoid", expert_bias=True,
              aux_loss_coeff=1e-4, ep_group=group, backend=backend, device=device, dtype=dtype)
    rank = dist.get_rank(group) if group is not None else 0
    g = torch.Generator(device=device).manual_seed(1 + rank)  # drawn on the device: 1 GB of rows

    def randn(*size, dtype=dtype):
        return torch.randn(size, generator=g, device=device, dtype=torch.float32).to(dtype)

    x = randn(shape.tokens, shape.hidden).requires_grad_()
    dy = randn(shape.tokens, shape.hidden)
    router_w, w1, w2 = moe.router.weight, moe.experts.fc1_weight, moe.experts.fc2_weight
    triton = use_triton(backend, device)

    def dispatch():
        probs, idx = moe.router(x)
        if group is None:
            return local_dispatch(x, probs, idx, shape.experts, triton)
        return ep_dispatch(x, probs, idx, shape.experts, group, triton)

    def combine(y_rows, state):
        return local_combine(y_rows, state) if group is None else ep_combine(y_rows, state)

    # The rows this rank's experts see (the routing is the same every iteration).
    x_rows, splits, p_rows, state = dispatch()
    g_rows = randn(*x_rows.shape)
    g_probs = randn(*p_rows.shape, dtype=torch.float32)
    x_rows_leaf = x_rows.detach().requires_grad_()
    p_rows_leaf = p_rows.detach().requires_grad_()
    y_rows_leaf = randn(*x_rows.shape).requires_grad_()
    expert_rows = int(splits.sum())

    def full():
        torch.autograd.grad(moe(x), [x, router_w, w1, w2], dy)

    def dispatch_phase():
        xr, _, pr, _ = dispatch()
        torch.autograd.grad([xr, pr], [x, router_w], [g_rows, g_probs])

    def experts_phase():
        y = moe.experts(x_rows_leaf, splits, p_rows_leaf)
        torch.autograd.grad(y, [x_rows_leaf, p_rows_leaf, w1, w2], g_rows)

    def combine_phase():
        torch.autograd.grad(combine(y_rows_leaf, state), [y_rows_leaf], dy)

    row = {"shape": shape.name, "ep": shape.ep, "H": shape.hidden, "F": shape.ffn, "E": shape.experts,
           "E_local": shape.experts // shape.ep, "top_k": shape.top_k, "tokens_per_rank": shape.tokens,
           "expert_rows": expert_rows}
    row["layer_ms"] = _time_ms(full, device, iters, warmup, group)
    phases = {}
    for name, fn in (("dispatch", dispatch_phase), ("experts", experts_phase), ("combine", combine_phase)):
        phases[name] = _time_ms(fn, device, iters, warmup, group)
    total = sum(phases.values())
    row["tokens_per_s"] = shape.tokens / row["layer_ms"] * 1e3  # per rank
    row["tflops"] = shape.flops_per_rank() / row["layer_ms"] / 1e9
    for name, ms in phases.items():
        row[f"{name}_ms"] = ms
    for name, ms in phases.items():
        row[f"{name}_pct"] = 100.0 * ms / total
    row["phases_sum_ms"] = total
    return row


# --- expert parallelism: spawned processes ---------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ep_worker(rank, port, shape, device_type, backend, iters, warmup, results):
    try:
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // shape.ep))
            device = torch.device("cpu")
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=shape.ep,
                                timeout=timedelta(seconds=120))
        row = measure(shape, device, backend, dist.group.WORLD, iters, warmup)
        # Report the slowest rank: the layer is as fast as its slowest member.
        t = torch.tensor([row["layer_ms"]], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        row["layer_ms_max_rank"] = float(t)
        if rank == 0:
            results.put(row)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        results.put({"error": f"rank {rank}:\n{traceback.format_exc()}"})
        raise
    # Done and torn down: skip C++ static destructors, one of which aborted finished gloo ranks in
    # ~5 % of CPU runs (torch 2.13; "terminate called without an active exception"), which the
    # parent would report as a failed run. The row is already in the (synchronous) queue.
    os._exit(0)


def _run_ep(shape: MoEShape, device_type: str, backend: str, iters: int, warmup: int,
            timeout_s: float = 300.0) -> dict:
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").SimpleQueue()
    procs = mp.start_processes(_ep_worker, args=(_free_port(), shape, device_type, backend, iters, warmup,
                                                 results), nprocs=shape.ep, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not procs.join(timeout=1):
            if time.monotonic() > deadline:
                raise RuntimeError(f"EP benchmark did not finish within {timeout_s:.0f} s")
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
    rows = []
    while not results.empty():
        rows.append(results.get())
    errors = [r["error"] for r in rows if "error" in r]
    if errors or not rows:
        raise RuntimeError("EP benchmark failed:\n" + "\n".join(errors))
    return rows[0]


def _plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.6 * len(rows)))
    labels = [f"{r['shape']} ep{r['ep']}" for r in rows]
    left = [0.0] * len(rows)
    for name in ("dispatch", "experts", "combine"):
        ms = [r[f"{name}_ms"] for r in rows]
        ax.barh(labels, ms, left=left, label=name)
        left = [a + b for a, b in zip(left, ms)]
    ax.set_xlabel("forward + backward, ms per rank")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run_moe_bench(args) -> list[dict]:
    """Entry point of ``python -m moemlp bench --moe``; reads args.device, args.backend, args.out."""
    device_arg = getattr(args, "device", None)
    device = torch.device(device_arg) if device_arg else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = getattr(args, "backend", "auto")
    out = getattr(args, "out", "results")
    on_gpu = device.type == "cuda"
    shapes = GPU_SHAPES if on_gpu else CPU_SHAPES
    iters, warmup = (20, 5) if on_gpu else (5, 2)
    print(f"MoE layer benchmark on {device_description(device)}")

    rows = []
    for shape in shapes:
        if shape.ep == 1:
            row = measure(shape, device, backend, None, iters, warmup)
            row["layer_ms_max_rank"] = row["layer_ms"]
            if on_gpu:
                torch.cuda.empty_cache()  # the EP processes below share this GPU
        elif on_gpu and torch.cuda.device_count() < shape.ep:
            print(f"skipped {shape.name} ep{shape.ep}: needs {shape.ep} GPUs, found {torch.cuda.device_count()}")
            continue
        else:
            row = _run_ep(shape, device.type, backend, iters, warmup)
        rows.append(row)

    print_table(rows, ["shape", "ep", "E_local", "tokens_per_rank", "layer_ms", "tokens_per_s", "tflops",
                       "dispatch_pct", "experts_pct", "combine_pct", "phases_sum_ms"],
                "MoE layer forward + backward, per rank (bf16, fp32 router and probs)")
    csv_path = os.path.join(out, "moe_bench.csv")
    write_csv(csv_path, rows)
    print(f"wrote {csv_path}")
    png = os.path.join(out, "moe_bench.png")
    if _plot(rows, png):
        print(f"wrote {png}")
    return rows


if __name__ == "__main__":  # pragma: no cover - for a direct run
    import argparse

    run_moe_bench(argparse.Namespace(device=None, backend="auto", out="results"))
