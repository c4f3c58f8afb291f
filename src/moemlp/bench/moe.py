"""`python -m moemlp bench --moe [--ep 1,2,4,8]`: the MoE layer's forward + backward throughput per
rank at a fixed number of tokens and local experts per rank (weak scaling), on one device and
expert-parallel over each requested world size (spawned processes, no torchrun: NCCL on GPUs, gloo
on the CPU), and the share of time in each phase.

Phases, each timed on its own, forward + backward, on the inputs the layer itself produces.
On one device (ep 1) they are the calls of ``MoE._forward`` -> ``dispatch.local_moe_forward``, whose
experts gather their rows from the tokens (grouped_mlp's ``x_index``): no permuted copy of x exists,
and the bench checks once that the phases run in a row give the layer's y bit for bit.
  dispatch   router (fp32 logits, scores, top-k, aux loss), plan_dispatch (stable sort by expert,
             splits, src_token, row_of), permute_probs, row_index; backward: the probs' gather
             back and the router's, dx and dW of its fp32 GEMM included
  experts    moe.experts(x, splits, probs_rows, x_index): the gather of x's rows inside grouped_mlp,
             FC1, activation · probs, FC2; backward: the grouped MLP's and dx summed per token in
             k order from the gathered rows' gradient
  combine    unpermute: y[t] = Σ_k y_rows[row_of[t, k]], fp32 in k order; backward: a gather
  shared     (with shared experts) the shared expert's grouped_mlp on every token
Expert-parallel (ep > 1) rows permute instead, their rows leave the rank:
  dispatch   router, sort, permute, counts exchange, all-to-all, regroup by local expert
  experts    grouped_mlp on this rank's received rows
  combine    regroup back, all-to-all, k-ordered unpermute
Shares are of the phases' sum; the whole layer is timed too (its time is the headline).
On one GPU each time is also taken as GPU time (``*_gpu_ms``, ``bench.common.gpu_time_ms``): the
queue is preloaded so the host's launch time hides, as it does in a model whose host runs ahead of
the GPU. A phase timed alone from an empty queue counts its host time in full; the dispatch phase
is ~80 small kernels, so its wall share is mostly the host's. Outside
every phase: the sum of x's gradients from the router, the experts and the shared expert, and the
add of the shared expert's y.

The lean torch layer (one device): ``bench/peers.py``'s ``LeanMoE``, the MoE layer as users write
it around the bench's lean ``_grouped_mm`` composition (moemlp's own Router, copied; stable argsort;
index_select permute; ``_grouped_mm`` -> silu(gate)·up·probs in bf16 -> ``_grouped_mm``; unpermute by
the inverse permutation and a sum over k; with shared experts the same composition on every token),
on copies of the layer's router and weights, timed forward + backward in the same run. Before timing,
its y is checked against the layer's (``lean_max_err`` = max|Δy| / max|y|, a RuntimeError past
``LEAN_TOLERANCE``). ``speedup`` = lean_layer_ms / layer_ms.

The all-to-all, with EP: one row exchange of the layer (``ep.all_to_all`` on the rows this rank
sends, with the layer's own uneven splits), timed alone; a forward + backward runs four of them
(dispatch, combine and their adjoints; the fp32 probs beside the rows add 2/H of that). Bytes are
what this rank sends in one exchange, its own chunk included; bus bandwidth is nccl-tests'
definition for all-to-all, bytes / time · (W − 1) / W. Beside it, torch.distributed's
``all_to_all_single`` with equal splits and the same number of bytes, in the same run: the
difference is what uneven splits and the layer's row sizes cost. ``a2a_pct`` = 4 · a2a time /
layer time: above ~25 % overlapping the exchange with expert compute starts to pay.

Timing: a fixed number of iterations, one pair of device events each, median; every rank's
median, the slowest rank reported (the layer is as fast as its slowest member). (triton's
do_bench picks its iteration count from a first estimate, which may differ between EP ranks: a
collective called a different number of times would hang.) FLOPs of the experts: 18·T·k·H·F per
rank (balanced routing).

World sizes above the GPU count are skipped with a line saying so. On the CPU every world size
runs (gloo, one thread per process) at small shapes: the numbers check the harness, not gloo.
"""

from __future__ import annotations

import argparse
import gc
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
from ..moe.dispatch import permute_probs, plan_dispatch, row_index, unpermute, use_triton
from ..moe.ep import all_to_all, ep_combine, ep_dispatch
from .common import device_description, event_ms, gpu_time_ms, print_table, write_csv
from .peers import LeanMoE

__all__ = ["run_moe_bench", "MoEShape", "ep_sizes", "DEFAULT_EP"]

DEFAULT_EP = [1, 2]


def ep_sizes(text: str) -> list[int]:
    """The ``--ep`` argument's type: comma-separated expert-parallel world sizes, e.g. "1,2,4,8"."""
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints such as 1,2,4,8, got {text!r}")
    return list(dict.fromkeys(sizes))


@dataclass(frozen=True)
class MoEShape:
    name: str
    hidden: int  # H
    ffn: int  # F
    local_experts: int  # E / W, fixed as W grows
    top_k: int
    tokens: int  # per rank, fixed as W grows
    ep: int  # expert-parallel ranks, W
    # DeepSeek-V3's other layer features: one shared expert of F, group-limited routing (8 groups,
    # the best 4; 2 and 1 on the small CPU shape), routed_scaling_factor 2.5.
    deepseek_features: bool = False

    @property
    def experts(self) -> int:  # E, all ranks together
        return self.local_experts * self.ep

    def flops_per_rank(self) -> float:
        """GLU expert MLP forward + backward on this rank's routed rows (balanced routing)."""
        return 18.0 * self.tokens * self.top_k * self.hidden * self.ffn


def moe_shape(on_gpu: bool, ep: int, deepseek_features: bool = False) -> MoEShape:
    """DeepSeek-V3's expert shape (H 7168, F 2048, top-8, sigmoid routing) with its 32 experts per
    GPU (256 experts over 8-way EP) and 4096 tokens per GPU; on the CPU a small shape.
    ``deepseek_features``: with its shared expert and group-limited routing too."""
    suffix = "+shared+groups" if deepseek_features else ""
    if on_gpu:
        return MoEShape("deepseek-v3-like" + suffix, 7168, 2048, 32, 8, 4096, ep, deepseek_features)
    return MoEShape("cpu-small" + suffix, 256, 128, 4, 2, 256, ep, deepseek_features)


def _feature_kwargs(shape: MoEShape) -> dict:
    if not shape.deepseek_features:
        return {}
    groups = 8 if shape.experts % 8 == 0 and shape.experts >= 32 else 2
    return dict(num_shared_experts=1, num_groups=groups, topk_groups=max(1, groups // 2), routed_scaling_factor=2.5)


def _time_ms(fn, device: torch.device, iters: int, warmup: int, group=None) -> float:
    for _ in range(warmup):
        fn()
    if group is not None:
        dist.barrier(group=group)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            times.append(event_ms(fn))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(shape: MoEShape, device: torch.device, backend: str, group, iters: int, warmup: int) -> dict:
    """Times the layer and its phases on this rank; every rank of ``group`` calls it in lockstep."""
    dtype = torch.bfloat16
    torch.manual_seed(0)
    moe = MoE(hidden_size=shape.hidden, ffn_hidden_size=shape.ffn, num_experts=shape.experts, top_k=shape.top_k,
              score="sigmoid", expert_bias=True, aux_loss_coeff=1e-4, ep_group=group, backend=backend,
              device=device, dtype=dtype, **_feature_kwargs(shape))
    rank = dist.get_rank(group) if group is not None else 0
    g = torch.Generator(device=device).manual_seed(1 + rank)  # drawn on the device: 1 GB of rows

    def randn(*size, dtype=dtype):
        return torch.randn(size, generator=g, device=device, dtype=torch.float32).to(dtype)

    x = randn(shape.tokens, shape.hidden).requires_grad_()
    dy = randn(shape.tokens, shape.hidden)
    router_w, w1, w2 = moe.router.weight, moe.experts.fc1_weight, moe.experts.fc2_weight
    shared_params = list(moe.shared_experts.parameters()) if moe.shared_experts is not None else []
    triton = use_triton(backend, device)

    if group is None:
        # One device: the calls of MoE._forward -> local_moe_forward (no capacity: plan_dispatch),
        # the experts gathering their rows from x through x_index; no permuted copy of x is made.
        def route():
            probs, idx = moe.router(x)
            plan = plan_dispatch(idx, shape.experts)
            return plan, permute_probs(probs, plan), row_index(plan)

        plan, p_rows, x_index = route()
        splits = plan.splits
        num_rows = x_index.index.shape[0]
        _check_local_phases(moe, x, plan, p_rows, x_index, triton)
    else:
        def dispatch():
            probs, idx = moe.router(x)
            return ep_dispatch(x, probs, idx, shape.experts, group, triton)

        x_rows, splits, p_rows, state = dispatch()
        num_rows = x_rows.shape[0]
    g_rows = randn(num_rows, shape.hidden)
    g_probs = randn(*p_rows.shape, dtype=torch.float32)
    p_rows_leaf = p_rows.detach().requires_grad_()
    y_rows_leaf = randn(num_rows, shape.hidden).requires_grad_()
    expert_rows = int(splits.sum())

    def full():
        torch.autograd.grad(moe(x), [x, router_w, w1, w2, *shared_params], dy)

    def shared_phase():  # the shared experts on every token, as the layer runs them
        torch.autograd.grad(moe._shared_forward(x, None), [x, *shared_params], dy)

    if group is None:
        x_leaf = x.detach().requires_grad_()

        def dispatch_phase():  # router, sort, index building; its backward: dprobs into the router
            _, pr, _ = route()
            torch.autograd.grad(pr, [x, router_w], g_probs)

        def experts_phase():  # grouped_mlp with x_index: the gather of x, and its segment sum in dx
            y = moe.experts(x_leaf, splits, p_rows_leaf, x_index=x_index)
            torch.autograd.grad(y, [x_leaf, p_rows_leaf, w1, w2], g_rows)

        def combine_phase():
            torch.autograd.grad(unpermute(y_rows_leaf, plan, triton), [y_rows_leaf], dy)
    else:
        x_rows_leaf = x_rows.detach().requires_grad_()

        def dispatch_phase():
            xr, _, pr, _ = dispatch()
            torch.autograd.grad([xr, pr], [x, router_w], [g_rows, g_probs])

        def experts_phase():
            y = moe.experts(x_rows_leaf, splits, p_rows_leaf)
            torch.autograd.grad(y, [x_rows_leaf, p_rows_leaf, w1, w2], g_rows)

        def combine_phase():
            torch.autograd.grad(ep_combine(y_rows_leaf, state), [y_rows_leaf], dy)

    row = {"shape": shape.name, "ep": shape.ep, "H": shape.hidden, "F": shape.ffn, "E": shape.experts,
           "E_local": shape.local_experts, "top_k": shape.top_k, "tokens_per_rank": shape.tokens,
           "expert_rows": expert_rows}
    times = {"layer": _time_ms(full, device, iters, warmup, group)}
    if group is None:  # the lean torch layer, on a copy of the same router and weights
        lean = LeanMoE.from_moe(moe)
        lean_max_err = _check_lean(moe, lean, x)
        lean_params = [x, *(p for p in lean.parameters() if p.requires_grad)]

        def lean_full():
            torch.autograd.grad(lean(x), lean_params, dy)

        times["lean_layer"] = _time_ms(lean_full, device, iters, warmup)
    phase_fns = [("dispatch", dispatch_phase), ("experts", experts_phase), ("combine", combine_phase)]
    if shared_params:
        phase_fns.append(("shared", shared_phase))
    for name, fn in phase_fns:
        times[name] = _time_ms(fn, device, iters, warmup, group)
    gpu = {}
    if group is None:  # GPU time, host launch time hidden (NaN off a GPU); no collectives here
        gpu = {name: gpu_time_ms(fn, device, iters=iters, warmup=warmup)
               for name, fn in [("layer", full), ("lean_layer", lean_full), *phase_fns]}
    if group is not None:
        times.update(_measure_all_to_all(state, x_rows.shape[1], dtype, device, group, iters, warmup))
    if group is not None:  # the slowest rank's median of each
        names = sorted(k for k in times if not k.endswith("_bytes"))
        t = torch.tensor([times[k] for k in names], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        times.update(zip(names, t.tolist()))

    row["layer_ms"] = times["layer"]
    if group is None:
        row["lean_layer_ms"] = times["lean_layer"]
        row["speedup"] = times["lean_layer"] / times["layer"]
        row["lean_max_err"] = lean_max_err
    row["tokens_per_s"] = shape.tokens / row["layer_ms"] * 1e3  # per rank
    row["tflops"] = shape.flops_per_rank() / row["layer_ms"] / 1e9  # per rank
    phases = {name: times[name] for name, _ in phase_fns}
    total = sum(phases.values())
    for name, ms in phases.items():
        row[f"{name}_ms"] = ms
    for name, ms in phases.items():
        row[f"{name}_pct"] = 100.0 * ms / total
    row["phases_sum_ms"] = total
    if gpu:
        row["layer_gpu_ms"] = gpu["layer"]
        row["lean_layer_gpu_ms"] = gpu["lean_layer"]
        row["speedup_gpu"] = gpu["lean_layer"] / gpu["layer"]
        gpu_total = sum(gpu[name] for name in phases)
        for name in phases:
            row[f"{name}_gpu_ms"] = gpu[name]
        for name in phases:
            row[f"{name}_gpu_pct"] = 100.0 * gpu[name] / gpu_total
    if group is not None:
        W = shape.ep
        nbytes = times["a2a_bytes"]
        row["a2a_MB"] = nbytes / 1e6
        row["a2a_ms"] = times["a2a"]
        row["a2a_busbw_GBps"] = nbytes / times["a2a"] / 1e6 * (W - 1) / W
        row["dist_a2a_ms"] = times["dist_a2a"]
        row["dist_busbw_GBps"] = times["dist_a2a_bytes"] / times["dist_a2a"] / 1e6 * (W - 1) / W
        row["a2a_pct"] = 100.0 * 4 * times["a2a"] / row["layer_ms"]
    return row


def _check_local_phases(moe, x, plan, p_rows, x_index, triton: bool) -> None:
    """The one-device phases, run in a row, give the layer's output bit for bit: the split times the
    calls the layer makes."""
    with torch.no_grad():
        y = unpermute(moe.experts(x, plan.splits, p_rows, x_index=x_index), plan, triton)
        if moe.shared_experts is not None:
            y = y + moe._shared_forward(x, None)
        if not torch.equal(y, moe(x)):
            raise RuntimeError("bench --moe: the one-device phases no longer compose to MoE's forward; "
                               "the phase split must follow moemlp.moe.layer / dispatch.local_moe_forward")


# The lean layer rounds silu·up and its product with bf16 probs to bf16, two roundings moemlp's fp32
# epilogue does not make; each bf16 rounding after them (y_rows, the k-sum, + shared) can then land an
# ulp away from moemlp's, 2^-8 to 2^-7 of the value. Measured 0.005 to 0.010 of max|y| (one ulp) at
# H 7168, F 2048; 2^-4 leaves room for a few ulps and still fails another function (a wrong routing,
# probability or weight is O(1)).
LEAN_TOLERANCE = 2.0**-4


def _check_lean(moe, lean, x) -> float:
    """max|y_lean − y| / max|y| on the same input; RuntimeError past LEAN_TOLERANCE."""
    with torch.no_grad():
        y, y_lean = moe(x).double(), lean(x).double()
    err = float((y_lean - y).abs().max() / y.abs().max())
    if not err <= LEAN_TOLERANCE:  # NaN fails too
        raise RuntimeError(f"bench --moe: the lean torch layer's y differs from MoE's by {err:.3g} of max|y| "
                           f"(tolerance {LEAN_TOLERANCE:.3g}): the peer no longer computes the same function")
    return err


def _measure_all_to_all(state, hidden: int, dtype, device, group, iters: int, warmup: int) -> dict:
    """One row exchange of the layer (its uneven splits), and torch.distributed's all_to_all_single
    with equal splits and the same bytes (the same on every rank: the largest rank's size)."""
    W = dist.get_world_size(group)
    rows_sent = sum(state.send_rows)
    x_send = torch.randn(rows_sent, hidden, device=device).to(dtype)

    def layer_a2a():
        all_to_all(x_send, state.recv_rows, state.send_rows, group)

    # Equal splits: every rank sends the same message, the largest rank's row count rounded up to W.
    sizes = torch.tensor([rows_sent], dtype=torch.int64, device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    peer_rows = -(-int(sizes) // W) * W
    send = torch.randn(peer_rows, hidden, device=device).to(dtype)
    recv = torch.empty_like(send)

    def dist_a2a():
        dist.all_to_all_single(recv, send, group=group)

    elem = torch.finfo(dtype).bits // 8
    return {
        "a2a": _time_ms(layer_a2a, device, iters, warmup, group),
        "a2a_bytes": rows_sent * hidden * elem,
        "dist_a2a": _time_ms(dist_a2a, device, iters, warmup, group),
        "dist_a2a_bytes": peer_rows * hidden * elem,
    }


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
        row["backend"] = dist.get_backend()
        if rank == 0:
            results.put(row)
        # The layer and its graphs, if in reference cycles, let go of the group now, so that
        # destroy_process_group joins its threads while the interpreter lives (moemlp.moe.ep).
        gc.collect()
        dist.barrier()  # every rank done with every collective before any tears down
        dist.destroy_process_group()
    except BaseException:
        results.put({"error": f"rank {rank}:\n{traceback.format_exc()}"})
        raise


def _run_ep(shape: MoEShape, device_type: str, backend: str, iters: int, warmup: int,
            timeout_s: float = 540.0) -> dict:
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").SimpleQueue()
    procs = mp.start_processes(_ep_worker, args=(_free_port(), shape, device_type, backend, iters, warmup,
                                                 results), nprocs=shape.ep, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            codes = [p.exitcode for p in procs.processes]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):  # the others would wait out their timeout
                deadline = min(deadline, time.monotonic() + 5)
            time.sleep(0.1)
        hung = [r for r, p in enumerate(procs.processes) if p.is_alive()]
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
    rows = []
    while not results.empty():
        rows.append(results.get())
    errors = [r["error"] for r in rows if "error" in r]
    codes = [p.exitcode for p in procs.processes]
    if errors or hung or not rows or any(c != 0 for c in codes):
        raise RuntimeError(f"EP benchmark ep{shape.ep} failed (exit codes {codes}, ranks still running after "
                           f"{timeout_s:.0f} s: {hung}):\n" + "\n".join(errors))
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
    for name in ("dispatch", "experts", "combine", "shared"):
        ms = [r.get(f"{name}_ms") or 0.0 for r in rows]  # "": a layer without shared experts
        ax.barh(labels, ms, left=left, label=name)
        left = [a + b for a, b in zip(left, ms)]
    ax.set_xlabel("forward + backward, ms per rank")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run_moe_bench(args) -> list[dict]:
    """Entry point of ``python -m moemlp bench --moe``; reads args.device, args.backend, args.out and
    args.ep (a list of world sizes, default [1, 2])."""
    device_arg = getattr(args, "device", None)
    device = torch.device(device_arg) if device_arg else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = getattr(args, "backend", "auto")
    out = getattr(args, "out", "results")
    ep_list = list(getattr(args, "ep", None) or DEFAULT_EP)
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in ep_list):
        raise ValueError(f"ep: expected a list of positive ints, got {ep_list!r}")
    on_gpu = device.type == "cuda"
    iters, warmup = (20, 5) if on_gpu else (5, 2)
    gpus = torch.cuda.device_count() if on_gpu else 0
    print(f"MoE layer benchmark on {device_description(device)}, ep {','.join(map(str, ep_list))}")

    rows = []
    for ep in ep_list:
        shape = moe_shape(on_gpu, ep)
        if ep == 1:
            row = measure(shape, device, backend, None, iters, warmup)
            row["backend"] = "-"
            rows.append(row)
            # The same layer with DeepSeek-V3's shared expert and group-limited routing: its time, and
            # the shared expert's share of the phases.
            row = measure(moe_shape(on_gpu, 1, deepseek_features=True), device, backend, None, iters, warmup)
            row["backend"] = "-"
            if on_gpu:
                torch.cuda.empty_cache()  # the EP processes below share this GPU
        elif on_gpu and gpus < ep:
            print(f"skipped ep{ep}: needs {ep} GPUs, found {gpus}")
            continue
        else:
            row = _run_ep(shape, device.type, backend, iters, warmup)
        rows.append(row)

    if not rows:
        return rows
    columns = list(dict.fromkeys(k for r in rows for k in r))  # EP rows add the all-to-all columns
    rows = [{k: r.get(k, "") for k in columns} for r in rows]
    csv_path = os.path.join(out, "moe_bench.csv")
    write_csv(csv_path, rows)
    print(f"wrote {csv_path}")
    png = os.path.join(out, "moe_bench.png")
    if _plot(rows, png):
        print(f"wrote {png}")
    ep_rows = [r for r in rows if r["ep"] > 1]
    if ep_rows:
        print_table(ep_rows, ["shape", "ep", "backend", "a2a_MB", "a2a_ms", "a2a_busbw_GBps", "dist_a2a_ms",
                              "dist_busbw_GBps", "a2a_pct"],
                    "One row all-to-all of the layer (4 per forward + backward) beside torch.distributed's "
                    "all_to_all_single at the same size")
    print_table(rows, ["shape", "ep", "E", "tokens_per_rank", "layer_ms", "lean_layer_ms", "speedup", "tflops",
                       "dispatch_pct", "experts_pct", "combine_pct", "shared_pct", "lean_max_err"],
                "MoE layer forward + backward, per rank, slowest rank (bf16, fp32 router and probs); "
                "lean_layer: the torch layer users write (bench/peers.py LeanMoE), one device; "
                "speedup = lean_layer_ms / layer_ms")
    gpu_rows = [r for r in rows if r.get("layer_gpu_ms") not in ("", None)]
    if on_gpu and gpu_rows:
        print_table(gpu_rows, ["shape", "layer_gpu_ms", "lean_layer_gpu_ms", "speedup_gpu", "dispatch_gpu_pct",
                               "experts_gpu_pct", "combine_gpu_pct", "shared_gpu_pct"],
                    "The same on one device as GPU time, the host's launch time hidden behind a preloaded "
                    "queue (bench.common.gpu_time_ms)")
    return rows


if __name__ == "__main__":  # pragma: no cover - for a direct run
    run_moe_bench(argparse.Namespace(device=None, backend="auto", out="results", ep=DEFAULT_EP))
