"""The bf16 weight gradients on the Gluon engine (moemlp.kernels.gluon.wgrad) beside torch._grouped_mm
(CUTLASS's varlen-K grouped GEMM, which operands.wgrad ran before) and the Triton wgrad kernel, at the
four model shapes; then the MLP's forward + backward with the weight gradients on each.

    PYTHONPATH=src python3 benchmarks/bench_wgrad_engine.py [--shapes a,b] [--rep-ms 40] [--sweep] [--sweep-fp32]

``--sweep`` times the bf16 dW kernel at other stage counts and n-groups; ``--sweep-fp32`` the fp32
dW (main_grad) kernel at each (row step, stages) of ``FP32_CONFIGS``, each checked bitwise against
the launcher's configuration first.

Prediction, written before any measurement (H200): the small-expert weight gradients are bound by
dW's stores (gpt-oss dW1 writes 4.25 GB, ~1.0 ms at 4.3 TB/s; its MMAs take ~0.7 ms at a dense mm's
rate), and CUTLASS takes 2.0 ms there because a tile's loads, MMAs and store do not overlap. The
engine's persistent ping-pong should overlap them: gpt-oss dW1 2.0 → ~1.2 ms and dW2 1.1 → ~0.65,
qwen3 dW1 0.52 → ~0.38 and dW2 0.27 → ~0.2; level with CUTLASS at 1024 rows an expert
(deepseek-v3-ep8) and ~0.9× at 2048 (mixtral), where CUTLASS's 128 × 256 tiles run at ~90 % of a
dense mm. The step: gpt-oss ~1.1 ms and qwen3 ~0.2 ms faster.

Every timed engine result is first compared with the Triton kernel's (the same bits) and with
torch._grouped_mm's (the relative max difference, bf16 roundings apart). do_bench medians.
"""

from __future__ import annotations

import argparse

import torch

from moemlp import grouped_mlp
from moemlp.bench.common import GPU_SHAPES, fwd_and_fwd_bwd, routed_problem, time_ms
from moemlp.kernels import gluon, operands
from moemlp.kernels.gemm import launch
from moemlp.kernels.gluon import _launch as gluon_launch

DEV = torch.device("cuda")


def _triton_wgrad(g, x, splits, out_dtype):
    dw = torch.empty((splits.shape[0], g.shape[1], x.shape[1]), dtype=out_dtype, device=g.device)
    launch.launch_grouped_wgrad(g=g, x=x, splits=splits, dw=dw, db=None,
                                config=launch.default_config("wgrad", 0, 0, False, 2))  # fmt: skip
    return dw


# fp32 dW: (rows a step, stages) that fit sm_90's 227 KiB beside the two 128 × 128 fp32 store tiles
# (128 KiB): a stage is (128 + 128) · rows · 2 bytes.
FP32_CONFIGS = ((32, 4), (32, 5), (32, 6), (64, 2), (64, 3))


def _sweep_launch(g, x, splits, stages, group_n, bk=None, out_dtype=torch.bfloat16):
    """gluon.wgrad's launch with other stage counts, n-groups and row steps (the launcher fixes them)."""
    from moemlp.kernels._cuda_context import bind_context
    from moemlp.kernels.gluon import _launch as L
    from moemlp.kernels.gluon._compat import TensorDescriptor
    from moemlp.kernels.gluon._engine import MAXNREG, NUM_WARPS
    from moemlp.kernels.gluon._wgrad import wgrad_kernel

    (T, N), K, E = g.shape, x.shape[1], splits.shape[0]
    out = torch.empty((E, N, K), dtype=out_dtype, device=g.device)
    bind_context(g.device)
    bm, bn, bk = L.WGRAD_BM, L.WGRAD_BN, bk or L._wgrad_step(out_dtype, T / E)[0]
    g_desc = TensorDescriptor.from_tensor(g, [bk, bm], L._smem_layout((bk, bm)))
    x_desc = TensorDescriptor.from_tensor(x, [bk, bn], L._smem_layout((bk, bn)))
    c2d = out.view(E * N, K)
    c_desc = TensorDescriptor.from_tensor(c2d, [bm, bn], L._smem_layout((bm, bn), out_dtype == torch.float32))
    tiles = E * -(-N // bm) * -(-K // bn)
    grid = (min(L._num_sms(g.device.index or 0), tiles),)
    wgrad_kernel[grid](g_desc, x_desc, c_desc, c2d, None, splits, E, T, N, K, BM=bm, BN=bn, BK=bk, STAGES=stages,
                       GROUP_N=group_n, E_BLOCK=max(32, 1 << (E - 1).bit_length()), ACC_SCALE=False,
                       num_warps=NUM_WARPS, maxnreg=MAXNREG)  # fmt: skip
    return out


def gemm_rows(shape, rep_ms: int, sweep: bool, sweep_fp32: bool = False) -> list[dict]:
    x, splits, probs, w1, w2, dy = routed_problem(shape, "cuda")
    M, F = shape.rows, shape.ffn
    g_h = torch.randn(M, 2 * F, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(M, F, device="cuda", dtype=torch.bfloat16)
    offs = torch.cumsum(splits, 0).to(torch.int32)
    cases = {"dW1": (g_h, x), "dW2": (dy, z)}
    if shape.name == "gpt-oss-120b":  # its weights are transposed-layout: dWᵀ = xᵀ @ g
        cases.update({"dW1ᵀ": (x, g_h), "dW2ᵀ": (z, dy)})
    rows = []
    for name, (g, xx) in cases.items():
        flops = 2.0 * M * g.shape[1] * xx.shape[1]
        dw = gluon.wgrad(g, xx, splits)
        ref = _triton_wgrad(g, xx, splits, torch.bfloat16)
        cut = torch._grouped_mm(g.t(), xx, offs=offs)
        same = torch.equal(dw, ref)
        rel = ((dw.float() - cut.float()).abs().max() / cut.float().abs().max()).item()
        dw32 = gluon.wgrad(g, xx, splits, torch.float32)
        same32 = torch.equal(dw32, _triton_wgrad(g, xx, splits, torch.float32))
        t = {
            "cutlass": time_ms(lambda: torch._grouped_mm(g.t(), xx, offs=offs), DEV, rep_ms=rep_ms).median,
            "engine": time_ms(lambda: gluon.wgrad(g, xx, splits), DEV, rep_ms=rep_ms).median,
            "triton": time_ms(lambda: _triton_wgrad(g, xx, splits, torch.bfloat16), DEV, rep_ms=rep_ms).median,
            "engine_fp32": time_ms(lambda: gluon.wgrad(g, xx, splits, torch.float32), DEV, rep_ms=rep_ms).median,
            "triton_fp32": time_ms(lambda: _triton_wgrad(g, xx, splits, torch.float32), DEV,
                                   rep_ms=rep_ms).median,  # fmt: skip
        }
        row = {"shape": shape.name, "gemm": name, "rows_e": M / shape.experts, "bits_eq": same and same32,
               "rel_vs_cutlass": rel, **{f"{k}_ms": v for k, v in t.items()},
               "engine_tflops": flops / t["engine"] / 1e9, "x_cutlass": t["cutlass"] / t["engine"],
               "x_triton_fp32": t["triton_fp32"] / t["engine_fp32"]}  # fmt: skip
        if sweep:
            for stages in (3, 4):
                for group_n in (4, 8, 16):
                    out = _sweep_launch(g, xx, splits, stages, group_n)
                    assert torch.equal(out, dw), (stages, group_n)
                    row[f"s{stages}g{group_n}_ms"] = time_ms(lambda: _sweep_launch(g, xx, splits, stages, group_n),
                                                             DEV, rep_ms=rep_ms).median  # fmt: skip
        if sweep_fp32:
            for bk, stages in FP32_CONFIGS:
                out = _sweep_launch(g, xx, splits, stages, gluon_launch.WGRAD_GROUP_N, bk, torch.float32)
                assert torch.equal(out, dw32), (bk, stages)
                row[f"fp32_k{bk}s{stages}_ms"] = time_ms(
                    lambda bk=bk, stages=stages: _sweep_launch(g, xx, splits, stages, gluon_launch.WGRAD_GROUP_N, bk, torch.float32),
                    DEV, rep_ms=rep_ms).median  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    return rows


def step_row(shape, rep_ms: int) -> dict:
    """grouped_mlp forward + backward with the weight gradients on the engine, and on CUTLASS
    (WGRAD_ENGINE_ROWS 0 turns the engine's wgrad off for the A/B; nothing else changes)."""
    x, splits, probs, w1, w2, dy = routed_problem(shape, "cuda")
    leaves = [t.requires_grad_() for t in (x, probs, w1, w2)]
    row = {"shape": shape.name}
    keep = operands.WGRAD_ENGINE_ROWS
    grads = {}
    for label, rows in (("engine", 1 << 30), ("cutlass", 0)):
        operands.WGRAD_ENGINE_ROWS = rows
        try:
            grads[label] = torch.autograd.grad(grouped_mlp(x, splits, probs, w1, w2), leaves, dy)
            _, t = fwd_and_fwd_bwd(lambda: grouped_mlp(x, splits, probs, w1, w2), leaves, dy, DEV, rep_ms)
        finally:
            operands.WGRAD_ENGINE_ROWS = keep
        row[f"{label}_fwdbwd_ms"] = t.median
    # dx and dprobs do not depend on the wgrad kernel: the same bits
    row["dx_dprobs_eq"] = all(torch.equal(a, b) for a, b in zip(grads["engine"][:2], grads["cutlass"][:2]))
    row["speedup"] = row["cutlass_fwdbwd_ms"] / row["engine_fwdbwd_ms"]
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(GPU_SHAPES))
    ap.add_argument("--rep-ms", type=int, default=40)
    ap.add_argument("--sweep", action="store_true", help="also the stage counts and n-groups")
    ap.add_argument("--sweep-fp32", action="store_true", help="also the fp32 dW kernel's row steps and stages")
    ap.add_argument("--no-step", action="store_true")
    args = ap.parse_args()
    gemms, steps = [], []
    for name in args.shapes.split(","):
        gemms += gemm_rows(GPU_SHAPES[name], args.rep_ms, args.sweep, args.sweep_fp32)
    if not args.no_step:
        for name in args.shapes.split(","):
            steps.append(step_row(GPU_SHAPES[name], args.rep_ms))
    print("\n| shape | gemm | rows/e | bits = Triton | rel vs CUTLASS | CUTLASS ms | engine ms | × | TFLOP/s | "
          "Triton ms | fp32: Triton / engine ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in gemms:
        print(f"| {r['shape']} | {r['gemm']} | {r['rows_e']:.0f} | {r['bits_eq']} | {r['rel_vs_cutlass']:.1e} | "
              f"{r['cutlass_ms']:.3f} | {r['engine_ms']:.3f} | {r['x_cutlass']:.2f} | {r['engine_tflops']:.0f} | "
              f"{r['triton_ms']:.3f} | {r['triton_fp32_ms']:.3f} / {r['engine_fp32_ms']:.3f} |")
    if args.sweep:
        keys = [k for k in gemms[0] if k.startswith("s") and k.endswith("_ms") and k[1].isdigit()]
        print("\nsweep (ms): " + " ".join(keys))
        for r in gemms:
            print(f"{r['shape']:>16} {r['gemm']:>5} " + " ".join(f"{r[k]:.3f}" for k in keys))
    if args.sweep_fp32:
        keys = [k for k in gemms[0] if k.startswith("fp32_k")]
        print("\nfp32 dW sweep (ms; the launcher's own: engine_fp32_ms): " + " ".join(keys))
        for r in gemms:
            print(f"{r['shape']:>16} {r['gemm']:>5} {r['engine_fp32_ms']:.3f} " + " ".join(f"{r[k]:.3f}" for k in keys))
    if steps:
        print("\n| shape | fwd+bwd, wgrads on CUTLASS ms | on the engine ms | speedup | dx, dprobs bits equal |")
        print("|---|---|---|---|---|")
        for r in steps:
            print(f"| {r['shape']} | {r['cutlass_fwdbwd_ms']:.3f} | {r['engine_fwdbwd_ms']:.3f} | "
                  f"{r['speedup']:.3f} | {r['dx_dprobs_eq']} |")


if __name__ == "__main__":
    main()
