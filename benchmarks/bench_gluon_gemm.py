"""The Gluon grouped GEMM (moemlp.kernels.gluon) on ping-pong 128×128 and cooperative 128×256 tiles,
beside the Triton kernel and torch._grouped_mm, on the MLP's plain GEMMs (FC1 without its epilogue,
FC2, FC1_DGRAD) at the four model shapes, and a dense torch.mm of the same FLOPs as the ceiling.

    PYTHONPATH=src python3 benchmarks/bench_gluon_gemm.py [--shapes a,b] [--csv PATH] [--step N]

--step N also times grouped_mlp's bf16 forward + backward (GPU time) with FC2 and FC1_DGRAD on the
engine's cooperative tiles, as wired, and on the Triton kernel, N alternating rounds.

The first prediction, written before any measurement (H200, triton 3.6, 128×128×64 tiles, 4 stages,
ping-pong consumers, no cluster multicast), TFLOP/s Gluon vs torch._grouped_mm:

| shape | FC1 | FC2 | bound by |
|---|---|---|---|
| qwen3-30b-a3b | 380 vs 430 | 340 vs 390 | HBM as much as MMA: B is 805 / 403 MB for 206 / 103 GFLOP |
| mixtral-8x7b | 590 vs 640 | 600 vs 650 | MMA (3.85 / 1.92 TFLOP; B read twice with GROUP_M 8) |
| deepseek-v3-ep8 | 560 vs 610 | 540 vs 570 | MMA |
| gpt-oss-120b | 310 vs 280 | 290 vs 270 | HBM: B is 4.2 / 2.1 GB, ~128 rows an expert |

i.e. about 0.9× of CUTLASS's grouped kernel where the MMAs bound it: the same tile and schedule
family as CUTLASS's ping-pong, minus what Triton's lowering adds per k-step (two warpgroup
bar.syncs, one before the mbarrier wait and one before the single-thread arrive) and minus 2-CTA
multicast of B. On gpt-oss, where streaming 4.2 GB of weights sets the time and torch reaches only
280, the grouped m-tile order that reads each B column-block once could put it slightly ahead.

FLOPs: FC1 2·M·2F·H, FC2 2·M·H·F, M = tokens·top_k, uniform random top-k routing. Timings are
triton.testing.do_bench medians. Before any timing the engine runs once in a child process with a
time limit (a hang or a compile error on this triton is reported and the torch columns still run),
and every timed result is first compared with torch._grouped_mm's.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time

import torch
import triton

# (H, F, E, top_k, tokens), as in ANCHORS.md
SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, 4096),
    "mixtral-8x7b": (4096, 14336, 8, 2, 8192),
    "deepseek-v3-ep8": (7168, 2048, 32, 8, 4096),
    "gpt-oss-120b": (2880, 2880, 128, 4, 4096),
}

def engine_status() -> str:
    """"" when the engine runs and matches torch on a small ragged case (in a time-limited child
    process), else why not; an import error names the Gluon API this triton lacks."""
    try:
        from moemlp.kernels.gluon._smoke import why_engine_fails
    except Exception as err:
        return f"import failed: {type(err).__name__}: {err}"
    return why_engine_fails(timeout_s=150)


def routing(E: int, top_k: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """Rows per expert of uniform random top-k routing (each token picks top_k distinct experts)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    choice = torch.rand(tokens, E, generator=g).topk(top_k, dim=1).indices
    return torch.bincount(choice.flatten(), minlength=E).to(torch.int32)


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def triton_plain(a, b, splits, out, layout):
    """The Triton grouped GEMM as the MLP runs it for a plain FC2 (nk) or FC1_DGRAD (kn)."""
    from moemlp.kernels.gemm.launch import launch_grouped_gemm

    if layout == "nk":
        N, K = b.shape[1], b.shape[2]
        strides = (N * K, K, 1)
        kind = "fc2"
    else:
        K, N = b.shape[1], b.shape[2]
        strides = (K * N, 1, N)
        kind = "fc1_dgrad"
    launch_grouped_gemm(kind, a=a, b=b, b_strides=strides, splits=splits, out=out, N=N, K=K, N1=N, cfg=None)
    return out


def step_rows(names, reps: int) -> list[dict]:
    """GPU time (host launch time hidden, ``gpu_time_ms``) of grouped_mlp's bf16 forward + backward
    with FC2 and FC1_DGRAD on the engine's cooperative tiles, as wired, and on the Triton kernel
    (``operands._engine_plain`` answering no), in ``reps`` alternating rounds; medians in ms."""
    from moemlp.bench.common import gpu_time_ms
    from moemlp.bench.kernels import mlp_step
    from moemlp.kernels import operands

    wired = operands._engine_plain
    device = torch.device("cuda")
    rows = []
    for name in names:
        step = mlp_step(name, None)
        times = {"engine": [], "triton": []}
        for _ in range(reps):
            for way, choice in (("engine", wired), ("triton", lambda *args: False)):
                operands._engine_plain = choice
                times[way].append(gpu_time_ms(step, device, iters=10))
        operands._engine_plain = wired
        row = {"shape": name, **{k: statistics.median(v) for k, v in times.items()}}
        rows.append(row)
        print(f"step {name:16s} engine plain {row['engine']:.3f} ms  triton plain {row['triton']:.3f} ms  "
              f"({row['triton'] / row['engine']:.3f}x; engine rounds {', '.join(f'{t:.2f}' for t in times['engine'])}; "
              f"triton rounds {', '.join(f'{t:.2f}' for t in times['triton'])})", flush=True)
        del step
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--csv", default=None, help="also write the table as CSV here")
    parser.add_argument("--step", type=int, default=0, metavar="N",
                        help="also time grouped_mlp's step with the engine's plain GEMM wired and not, N rounds")
    args = parser.parse_args()
    start = time.time()
    dev = "cuda"
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    status = engine_status()
    print("gluon engine:", "ok" if not status else f"NOT RUN: {status}")
    if not status:
        from moemlp.kernels.gluon import grouped_gemm

    ways = ("triton", "pingpong", "coop")
    rows = []
    for name in args.shapes.split(","):
        H, F, E, top_k, tokens = SHAPES[name]
        M = tokens * top_k
        splits = routing(E, top_k, tokens).to(dev)
        offs = splits.cumsum(0).to(torch.int32)
        g = torch.Generator(device=dev).manual_seed(0)
        # (GEMM, B's layout, N, K): FC1 and FC2 read W as (E, N, K), FC1_DGRAD reads W1 (E, 2F, H) in place
        for gemm, layout, N, K in (("FC1", "nk", 2 * F, H), ("FC2", "nk", H, F), ("FC1_DGRAD", "kn", H, 2 * F)):
            a = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
            b = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16, generator=g) * K**-0.5
            operand = b if layout == "nk" else b.transpose(1, 2).contiguous()  # (E, K, N): the same B_e
            dense_b = b[0].T  # (K, N): one expert's weight, the whole M against it
            flops = 2.0 * M * N * K
            peer = torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
            ms_torch = triton.testing.do_bench(lambda: torch._grouped_mm(a, b.transpose(-2, -1), offs=offs))
            ms_dense = triton.testing.do_bench(lambda: torch.mm(a, dense_b))
            row = {"shape": name, "gemm": gemm, "M": M, "N": N, "K": K, "E": E,
                   "torch": tflops(flops, ms_torch), "dense": tflops(flops, ms_dense),
                   **{w: None for w in ways}, "note": ""}
            runs = {"triton": lambda out: triton_plain(a, operand, splits, out, layout)}
            if not status:
                runs["pingpong"] = lambda out: grouped_gemm(a, operand, splits, out=out, b_layout=layout,
                                                            cooperative=False)
                runs["coop"] = lambda out: grouped_gemm(a, operand, splits, out=out, b_layout=layout,
                                                        cooperative=True)
            results = {}
            for way, fn in runs.items():
                try:
                    out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
                    fn(out)
                    torch.cuda.synchronize()
                    err = ((out.float() - peer.float()).abs().max() / peer.float().abs().max()).item()
                    if not err < 1e-2:
                        row["note"] += f" {way} wrong: rel err {err:.3g};"
                        continue
                    results[way] = out
                    row[way] = tflops(flops, triton.testing.do_bench(lambda: fn(out)))
                except Exception as err:  # report and keep the other columns
                    row["note"] += f" {way} failed: {type(err).__name__}: {str(err).splitlines()[0][:100]};"
            same = [w for w in ways[1:] if w in results and "triton" in results
                    and torch.equal(results[w], results["triton"])]
            row["note"] += f" bit-equal to triton: {','.join(same) or 'none'}"
            rows.append(row)
            cells = "  ".join(f"{w} {row[w]:6.1f}" if row[w] is not None else f"{w}      -" for w in ways)
            print(f"{name:16s} {gemm:9s} M={M:6d} N={N:6d} K={K:6d}  {cells}  torch {row['torch']:6.1f}  "
                  f"dense {row['dense']:6.1f} TFLOP/s {row['note']}", flush=True)
            runs = results = None  # drop this GEMM's operands before the next one's
        torch.cuda.empty_cache()

    steps = step_rows(args.shapes.split(","), args.step) if args.step and not status else []

    print(f"\nTFLOP/s (do_bench medians; FC1 2·M·2F·H, FC2 and FC1_DGRAD 2·M·H·F), {time.time() - start:.0f} s in all")
    print("| shape | GEMM | Triton | engine ping-pong 128×128 | engine cooperative 128×256 | torch._grouped_mm | "
          "cooperative / torch | dense torch.mm |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = " | ".join(f"{r[w]:.0f}" if r[w] is not None else "-" for w in ways)
        ratio = f"{r['coop'] / r['torch']:.2f}" if r["coop"] is not None else "-"
        print(f"| {r['shape']} | {r['gemm']} | {cells} | {r['torch']:.0f} | {ratio} | {r['dense']:.0f} |")
    if steps:
        print("\n| shape | step GPU time, engine plain GEMM (ms) | the same, Triton plain GEMM (ms) | ratio |")
        print("|---|---|---|---|")
        for r in steps:
            print(f"| {r['shape']} | {r['engine']:.3f} | {r['triton']:.3f} | {r['triton'] / r['engine']:.3f} |")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
