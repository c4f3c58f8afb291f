"""The Gluon grouped GEMM (moemlp.kernels.gluon) beside torch._grouped_mm on the MLP's two forward
GEMMs at the four model shapes, and a dense torch.mm of the same FLOPs as the ceiling.

    PYTHONPATH=src python3 benchmarks/bench_gluon_gemm.py [--shapes a,b] [--csv PATH]

Prediction, written before any measurement (H200, triton 3.6, 128×128×64 tiles, 4 stages,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--csv", default=None, help="also write the table as CSV here")
    args = parser.parse_args()
    start = time.time()
    dev = "cuda"
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    status = engine_status()
    print("gluon engine:", "ok" if not status else f"NOT RUN: {status}")
    if not status:
        from moemlp.kernels.gluon import grouped_gemm

    rows = []
    for name in args.shapes.split(","):
        H, F, E, top_k, tokens = SHAPES[name]
        M = tokens * top_k
        splits = routing(E, top_k, tokens).to(dev)
        offs = splits.cumsum(0).to(torch.int32)
        g = torch.Generator(device=dev).manual_seed(0)
        for gemm, N, K in (("FC1", 2 * F, H), ("FC2", H, F)):
            a = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
            b = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16, generator=g) * K**-0.5
            dense_b = b[0].T  # (K, N): one expert's weight, the whole M against it
            flops = 2.0 * M * N * K
            peer = torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
            ms_torch = triton.testing.do_bench(lambda: torch._grouped_mm(a, b.transpose(-2, -1), offs=offs))
            ms_dense = triton.testing.do_bench(lambda: torch.mm(a, dense_b))
            row = {"shape": name, "gemm": gemm, "M": M, "N": N, "K": K, "E": E,
                   "torch": tflops(flops, ms_torch), "dense": tflops(flops, ms_dense), "gluon": None, "note": ""}
            if not status:
                try:
                    out = grouped_gemm(a, b, splits)
                    torch.cuda.synchronize()
                    err = ((out.float() - peer.float()).abs().max() / peer.float().abs().max()).item()
                    if not err < 1e-2:
                        row["note"] = f"wrong: relative error {err:.3g} vs torch"
                    else:
                        ms = triton.testing.do_bench(lambda: grouped_gemm(a, b, splits, out=out))
                        row["gluon"] = tflops(flops, ms)
                        row["note"] = f"rel err vs torch {err:.1e}"
                except Exception as err:  # report and keep the torch columns
                    row["note"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
            rows.append(row)
            gl = f"{row['gluon']:7.1f}" if row["gluon"] is not None else "      -"
            print(f"{name:16s} {gemm} M={M:6d} N={N:6d} K={K:6d}  gluon {gl}  torch {row['torch']:7.1f}  "
                  f"dense {row['dense']:7.1f} TFLOP/s  {row['note']}", flush=True)
        torch.cuda.empty_cache()

    print(f"\nTFLOP/s (do_bench medians; FC1 2·M·2F·H, FC2 2·M·H·F), {time.time() - start:.0f} s in all")
    print("| shape | GEMM | gluon | torch._grouped_mm | gluon / torch | dense torch.mm |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ours = f"{r['gluon']:.0f}" if r["gluon"] is not None else "-"
        ratio = f"{r['gluon'] / r['torch']:.2f}" if r["gluon"] is not None else "-"
        print(f"| {r['shape']} | {r['gemm']} | {ours} | {r['torch']:.0f} | {ratio} | {r['dense']:.0f} |")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
