"""FC2_DGRAD with its fused epilogue (dSwiGLU · probs → g_h, z, dprobs partials) at the model shapes:
the Triton kernel beside the Gluon engine's (kernels/gluon/_fc2_dgrad.py) in both of its tile modes,
64-row tiles in ping-pong ("gluon") and cooperative 128-row tiles ("gluon_coop"). Before timing, the
engine's g_h and z are checked bitwise against the Triton kernel's and both dprobs against float64
on the same h (SPEC §1: 1e-6). Then forward + backward of ``grouped_mlp`` with FC2_DGRAD on each
path (``MOEMLP_GLUON=0`` keeps it on Triton; the engine's tile mode the library's choice).

``--depths 64,256`` times the engine with each depth of promoted product beside the default, and
``--triton-bk 64`` the Triton kernel with each K step (its promoted product is one step deep); a
Triton kernel and an engine of the same depth are checked bitwise against each other.

    PYTHONPATH=src python3 benchmarks/bench_fc2_dgrad.py [--shapes a,b] [--rep-ms 100] [--depths ...] [--triton-bk ...]
        [--regs] [--no-step] [--mainloop] [--epi] [--rounds N]

``--mainloop`` also times g_z = dy @ W2 alone on the engine's plain GEMM: the promoted mainloop on
ping-pong 64-row and cooperative 128-row tiles storing fp32 g_z (what FC2_DGRAD's fused epilogue
adds to each), and the unpromoted cooperative 128 × 256 bf16 GEMM (what promotion adds).

``--regs`` times each tile mode with each epilogue (``register_epilogue`` False and True, the second
where F is a multiple of 128): staged through an fp32 shared tile, or in the accumulator's layout,
each checked bitwise against the Triton kernel first. Without it each tile mode runs the library's
choice (the register epilogue on cooperative tiles where it applies).

``--epi`` also times cooperative tiles with the epilogue on a third, MMA-free warpgroup
(``epilogue_warpgroup=True``, "gluon_epi"; the consumers keep one promoted product in flight and hand
each tile's fp32 g_z over in shared memory), checked bitwise against the Triton kernel first, and the
step with it as the library's default ("step_gluon_epi"). ``--rounds N`` times every path N times in
turn and reports the median of the N medians.

Prediction for the epilogue warpgroup, written before its first GPU run (% of a dense mm, against
the library's cooperative choice on large experts and its ping-pong tiles on small ones, same run):
the g_z mainloop alone runs 78-82 % on cooperative tiles at mixtral and deepseek-v3 and the fused
kernel 61-71 %; with the epilogue (~9 µs a tile on 8 warps, ~15 µs on 4) behind a 30-55 µs
mainloop, mixtral 61 → 72-78, deepseek-v3 63-71 → 72-78; qwen3 (K = 2048, a ~20 µs mainloop, the
epilogue barely hidden) 41 → 45-52; gpt-oss (128 rows an expert: 128-row tiles half empty at
ragged ends) 33-37 → 36-42. Step: mixtral -0.7 to -1.0 ms (of ~26), deepseek-v3 -0.1 to -0.3 ms.
Measured (H100, against the best other mode): mixtral 67.8 → 71.8, deepseek-v3 64.9 → 65.9, qwen3
38.5 → 32.6, gpt-oss 32.2 → 37.0; no step beyond its noise (docs/DECISIONS.md).

Prediction for the register epilogue, written before its first GPU run (H200, % of a dense mm):
cooperative tiles, whose epilogue is exposed, mixtral 68 → ~78 and deepseek-v3 74 → ~82; ping-pong
qwen3 46 → ~50 (its epilogue is hidden already; h by TMA and fewer instructions); gpt-oss unchanged
(F = 2880 is not a multiple of 128: the staged epilogue). Measured: cooperative mixtral 60 → 63,
deepseek-v3 70 → 70; ping-pong 1-4 % slower (docs/DECISIONS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from moemlp import grouped_mlp
from moemlp._config import MLPConfig
from moemlp.activations import ACTIVATIONS
from moemlp.bench.common import GPU_SHAPES, print_table, routed_problem, time_ms
from moemlp.kernels import gluon, operands
from moemlp.kernels.gemm import launch
from moemlp.kernels.gluon import _launch as gluon_launch


def _dprobs_float64(dy, w2, h, splits, F):
    starts = torch.cumsum(splits, 0) - splits
    dprobs = torch.empty(dy.shape[0], dtype=torch.float64, device=dy.device)
    gate, up = h[:, :F].double(), h[:, F:].double()
    a = torch.nn.functional.silu(gate) * up
    for e in range(w2.shape[0]):  # per expert: g_z in float64, then Σ_f g_z · a
        s, t = int(starts[e]), int(starts[e] + splits[e])
        if t > s:
            dprobs[s:t] = ((dy[s:t].double() @ w2[e].double()) * a[s:t]).sum(1)
    return dprobs


def bench_shape(shape, rep_ms: int, depths: list[int], triton_bks: list[int], regs: bool = False,
                step_too: bool = True, mainloop: bool = False, epi: bool = False, rounds: int = 1) -> dict:
    dev = torch.device("cuda")
    x, splits, probs, w1, w2, dy = routed_problem(shape, dev)
    M, H, F = shape.rows, shape.hidden, shape.ffn
    cfg = MLPConfig(ACTIVATIONS["swiglu"], (), F, False)
    W1, W2 = operands.weights((w1, w2), None)
    h = torch.empty((M, 2 * F), dtype=x.dtype, device=dev)
    z_fwd = torch.empty((M, F), dtype=x.dtype, device=dev)
    operands.gemm("fc1", x, W1, splits=splits, out=h, z=z_fwd, probs=probs, N=F, K=H, N1=2 * F, cfg=cfg)
    del z_fwd

    default = launch.default_config("fc2_dgrad", F, H, True)

    def triton_path(bk):
        # 4 stages of 64-deep steps, 3 of 128-deep ones (4 would need 256 KiB of shared memory)
        config = dataclasses.replace(default, BK=bk, num_stages=4 if bk == 64 else 3)

        def run(g_h, z):
            return launch.launch_grouped_gemm("fc2_dgrad", a=dy, b=W2.dgrad().b, b_strides=W2.dgrad().strides,
                                              splits=splits, out=g_h, N=F, K=H, N1=2 * F, cfg=cfg, probs=probs,
                                              z=z, h=h, dprobs_partials=True, config=config)  # fmt: skip
        return run

    def engine_path(depth, cooperative, regs=None, epi=False):
        def run(g_h, z):
            return gluon.fc2_dgrad(dy, w2, splits, h, g_h, z=z, probs=probs, dprobs_partials=True,
                                   glu_interleave=F, activation_id=0, params=(0.0, 0.0, 0.0), promote_depth=depth,
                                   cooperative=cooperative, register_epilogue=regs,
                                   epilogue_warpgroup=epi)  # fmt: skip
        return run

    def dprobs_of(part):
        d = torch.empty_like(probs)
        launch.launch_dprobs_reduce(partial=part, dy=dy, fc2_bias=None, splits=splits, dprobs=d, bias_term=False)
        return d

    ref = _dprobs_float64(dy, w2, h, splits, F)
    paths = {"triton": triton_path(default.BK), "gluon": engine_path(gluon_launch.PROMOTE_DEPTH, False),
             "gluon_coop": engine_path(gluon_launch.PROMOTE_DEPTH, cooperative=True)}
    if regs:  # each tile mode with each epilogue, where the register one applies (F a multiple of 128)
        paths = {"triton": paths["triton"]}
        for label, coop in (("gluon", False), ("gluon_coop", True)):
            paths[label] = engine_path(gluon_launch.PROMOTE_DEPTH, coop, regs=False)
            if F % gluon_launch.BN == 0:
                paths[f"{label}_regs"] = engine_path(gluon_launch.PROMOTE_DEPTH, coop, regs=True)
    if epi:
        paths["gluon_epi"] = engine_path(gluon_launch.PROMOTE_DEPTH, True, epi=True)
    paths.update({f"triton_bk{bk}": triton_path(bk) for bk in triton_bks})
    paths.update({f"gluon_d{d}": engine_path(d, False) for d in depths})
    depth_of = {"triton": default.BK, "gluon": gluon_launch.PROMOTE_DEPTH, "gluon_coop": gluon_launch.PROMOTE_DEPTH,
                "gluon_regs": gluon_launch.PROMOTE_DEPTH, "gluon_coop_regs": gluon_launch.PROMOTE_DEPTH,
                "gluon_epi": gluon_launch.PROMOTE_DEPTH}
    depth_of.update({f"triton_bk{bk}": bk for bk in triton_bks})
    depth_of.update({f"gluon_d{d}": d for d in depths})
    outs = {}
    row = {"shape": shape.name, "rows_per_expert": M / shape.experts}
    for name, fn in paths.items():
        g_h = torch.full((M, 2 * F), float("nan"), dtype=x.dtype, device=dev)
        z = torch.full((M, F), float("nan"), dtype=x.dtype, device=dev)
        part = fn(g_h, z)
        d = dprobs_of(part)
        row[f"{name}_dprobs_err"] = float(torch.linalg.vector_norm(d.double() - ref) / torch.linalg.vector_norm(ref))
        if not row[f"{name}_dprobs_err"] <= 1e-6:
            raise SystemExit(f"{shape.name} {name}: dprobs error {row[f'{name}_dprobs_err']:.2e} > 1e-6")
        # the same depth of promoted product on the other kernel: g_h and z bitwise equal
        twin = next((o for o in outs if depth_of[o] == depth_of[name] and o.startswith("triton")), None)
        if twin is not None and not name.startswith("triton"):
            if not (torch.equal(g_h, outs[twin][0]) and torch.equal(z, outs[twin][1])):
                raise SystemExit(f"{shape.name} {name}: g_h / z differ from {twin}'s "
                                 f"({int((g_h != outs[twin][0]).sum())} g_h elements)")
        outs[name] = (g_h, z)
        del g_h, z
    g_h, z = outs.pop("triton")
    outs.clear()
    torch.cuda.empty_cache()
    a = torch.randn(M, H, device=dev, dtype=x.dtype)
    b = torch.randn(H, F, device=dev, dtype=x.dtype)
    medians = {name: [] for name in paths}
    mm_medians = []
    # Each path in turn, the dense mm too, so that a drift of the clocks touches every path and the
    # denominator alike (a dense mm ran 20 % slower in do_bench than in one launch under ncu).
    for _ in range(rounds):
        mm_medians.append(time_ms(lambda: torch.mm(a, b), dev, rep_ms=rep_ms).median)
        for name, fn in paths.items():
            medians[name].append(time_ms(lambda fn=fn: dprobs_of(fn(g_h, z)), dev, rep_ms=rep_ms).median)
    t_mm = sorted(mm_medians)[len(mm_medians) // 2]
    row["mm_ms"] = t_mm
    for name, ts in medians.items():
        row[f"{name}_ms"] = sorted(ts)[len(ts) // 2]
        row[f"{name}_pct_mm"] = 100.0 * t_mm / row[f"{name}_ms"]
        if rounds > 1:
            row[f"{name}_spread"] = (max(ts) - min(ts)) / row[f"{name}_ms"]
    if mainloop:  # the same g_z with no fused epilogue: what the epilogue costs on each tile mode
        g_z = torch.empty((M, F), dtype=torch.float32, device=dev)
        g_zb = torch.empty((M, F), dtype=x.dtype, device=dev)
        depth = gluon_launch.PROMOTE_DEPTH
        for name, fn in (
            ("mainloop", lambda: gluon.grouped_gemm(dy, w2, splits, g_z, b_layout="kn", out_dtype=torch.float32,
                                                    promote=depth, cooperative=False)),
            ("mainloop_coop", lambda: gluon.grouped_gemm(dy, w2, splits, g_z, b_layout="kn",
                                                         out_dtype=torch.float32, promote=depth, cooperative=True)),
            ("plain_coop", lambda: gluon.grouped_gemm(dy, w2, splits, g_zb, b_layout="kn", cooperative=True)),
        ):
            t = time_ms(fn, dev, rep_ms=rep_ms)
            row[f"{name}_ms"] = t.median
            row[f"{name}_pct_mm"] = 100.0 * t_mm / t.median
        del g_z, g_zb
    # forward + backward of the whole MLP with FC2_DGRAD on each path
    leaves = [t.requires_grad_() for t in (x, probs, w1, w2)]

    def step():
        return torch.autograd.grad(grouped_mlp(x, splits, probs, w1, w2), leaves, dy)

    steps = [("step_triton", "0", False), ("step_gluon", "1", False)] + ([("step_gluon_epi", "1", True)] if epi else [])
    default_epi = gluon_launch.DGRAD_EPILOGUE_WARPGROUP
    step_ms = {name: [] for name, _, _ in steps}
    for _ in range(rounds if step_too else 0):
        for name, env, with_epi in steps:
            os.environ["MOEMLP_GLUON"] = env
            gluon_launch.DGRAD_EPILOGUE_WARPGROUP = with_epi
            try:
                step_ms[name].append(time_ms(step, dev, rep_ms=rep_ms).median)
            finally:
                os.environ.pop("MOEMLP_GLUON")
                gluon_launch.DGRAD_EPILOGUE_WARPGROUP = default_epi
    for name, ts in step_ms.items() if step_too else ():
        row[f"{name}_ms"] = sorted(ts)[len(ts) // 2]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(GPU_SHAPES))
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--depths", default="", help="engine promoted-product depths to time beside the default")
    p.add_argument("--triton-bk", default="", help="Triton K steps to time beside the default")
    p.add_argument("--regs", action="store_true", help="also time the engine with the register epilogue")
    p.add_argument("--no-step", action="store_true", help="skip the forward + backward of grouped_mlp")
    p.add_argument("--epi", action="store_true", help="also time cooperative tiles with the epilogue warpgroup")
    p.add_argument("--rounds", type=int, default=1, help="time every path this many times in turn (median)")
    p.add_argument("--mainloop", action="store_true",
                   help="also time g_z alone: the promoted mainloop on each tile mode storing fp32 g_z, and "
                        "the unpromoted cooperative bf16 GEMM")
    args = p.parse_args()
    depths = [int(d) for d in args.depths.split(",") if d]
    triton_bks = [int(b) for b in args.triton_bk.split(",") if b]
    reason = gluon.why_unavailable()
    if reason:
        raise SystemExit(f"the Gluon engine cannot run here: {reason}")
    rows = []
    for name in args.shapes.split(","):
        rows.append(bench_shape(GPU_SHAPES[name], args.rep_ms, depths, triton_bks, args.regs, not args.no_step,
                                args.mainloop, args.epi, max(1, args.rounds)))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    names = (["triton", "gluon", "gluon_coop"] + (["gluon_regs", "gluon_coop_regs"] if args.regs else [])
             + (["gluon_epi"] if args.epi else [])
             + [f"triton_bk{b}" for b in triton_bks] + [f"gluon_d{d}" for d in depths])
    print_table(rows, ["shape"] + [f"{n}_dprobs_err" for n in names],
                "FC2_DGRAD: dprobs against float64 on the same h (SPEC §1: ≤ 1e-6)")
    timed = names + (["mainloop", "mainloop_coop", "plain_coop"] if args.mainloop else [])
    print_table(rows, ["shape", "rows_per_expert"] + [f"{n}_pct_mm" for n in timed],
                "FC2_DGRAD with its epilogue and the dprobs reduce, % of a dense torch.mm of the same FLOPs")
    if not args.no_step:
        print_table(rows, ["shape", "step_triton_ms", "step_gluon_ms"] + (["step_gluon_epi_ms"] if args.epi else []),
                    "forward + backward of grouped_mlp, median ms")


if __name__ == "__main__":
    main()
