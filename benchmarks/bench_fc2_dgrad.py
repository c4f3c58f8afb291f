"""FC2_DGRAD with its fused epilogue (dSwiGLU · probs → g_h, z, dprobs partials) at the model shapes:
the Triton kernel beside the Gluon engine's (kernels/gluon/_fc2_dgrad.py). Before timing, the
engine's g_h and z are checked bitwise against the Triton kernel's and both dprobs against float64
on the same h (SPEC §1: 1e-6). Then forward + backward of ``grouped_mlp`` with FC2_DGRAD on each
path (``MOEMLP_GLUON=0`` keeps it on Triton).

    PYTHONPATH=src python3 benchmarks/bench_fc2_dgrad.py [--shapes a,b] [--rep-ms 100]
"""

from __future__ import annotations

import argparse
import os

import torch

from moemlp import grouped_mlp
from moemlp._config import MLPConfig
from moemlp.activations import ACTIVATIONS
from moemlp.bench.common import GPU_SHAPES, print_table, routed_problem, time_ms
from moemlp.kernels import gluon, operands
from moemlp.kernels.gemm import launch


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


def bench_shape(shape, rep_ms: int) -> dict:
    dev = torch.device("cuda")
    x, splits, probs, w1, w2, dy = routed_problem(shape, dev)
    M, H, F = shape.rows, shape.hidden, shape.ffn
    cfg = MLPConfig(ACTIVATIONS["swiglu"], (), F, False)
    W1, W2 = operands.weights((w1, w2), None)
    h = torch.empty((M, 2 * F), dtype=x.dtype, device=dev)
    z_fwd = torch.empty((M, F), dtype=x.dtype, device=dev)
    operands.gemm("fc1", x, W1, splits=splits, out=h, z=z_fwd, probs=probs, N=F, K=H, N1=2 * F, cfg=cfg)
    del z_fwd

    def triton_path(g_h, z):
        return launch.launch_grouped_gemm("fc2_dgrad", a=dy, b=W2.dgrad().b, b_strides=W2.dgrad().strides,
                                          splits=splits, out=g_h, N=F, K=H, N1=2 * F, cfg=cfg, probs=probs, z=z,
                                          h=h, dprobs_partials=True)  # fmt: skip

    def engine_path(g_h, z):
        return gluon.fc2_dgrad(dy, w2, splits, h, g_h, z=z, probs=probs, dprobs_partials=True, glu_interleave=F,
                               activation_id=0, params=(0.0, 0.0, 0.0))  # fmt: skip

    def dprobs_of(part):
        d = torch.empty_like(probs)
        launch.launch_dprobs_reduce(partial=part, dy=dy, fc2_bias=None, splits=splits, dprobs=d, bias_term=False)
        return d

    ref = _dprobs_float64(dy, w2, h, splits, F)
    paths = {"triton": triton_path, "gluon": engine_path}
    outs = {}
    row = {"shape": shape.name, "rows_per_expert": M / shape.experts}
    for name, fn in paths.items():
        g_h = torch.full((M, 2 * F), float("nan"), dtype=x.dtype, device=dev)
        z = torch.full((M, F), float("nan"), dtype=x.dtype, device=dev)
        part = fn(g_h, z)
        d = dprobs_of(part)
        row[f"{name}_dprobs_err"] = float(torch.linalg.vector_norm(d.double() - ref) / torch.linalg.vector_norm(ref))
        outs[name] = (g_h, z)
        if name != "triton":
            same = torch.equal(g_h, outs["triton"][0]) and torch.equal(z, outs["triton"][1])
            if not same:
                raise SystemExit(f"{shape.name} {name}: g_h / z differ from the Triton kernel's "
                                 f"({int((g_h != outs['triton'][0]).sum())} g_h elements)")
            if not row[f"{name}_dprobs_err"] <= 1e-6:
                raise SystemExit(f"{shape.name} {name}: dprobs error {row[f'{name}_dprobs_err']:.2e} > 1e-6")
    g_h, z = outs.pop("triton")
    outs.clear()
    a = torch.randn(M, H, device=dev, dtype=x.dtype)
    b = torch.randn(H, F, device=dev, dtype=x.dtype)
    t_mm = time_ms(lambda: torch.mm(a, b), dev, rep_ms=rep_ms).median
    for name, fn in paths.items():
        t = time_ms(lambda fn=fn: dprobs_of(fn(g_h, z)), dev, rep_ms=rep_ms)
        row[f"{name}_ms"] = t.median
        row[f"{name}_pct_mm"] = 100.0 * t_mm / t.median
    # forward + backward of the whole MLP with FC2_DGRAD on each path
    leaves = [t.requires_grad_() for t in (x, probs, w1, w2)]

    def step():
        return torch.autograd.grad(grouped_mlp(x, splits, probs, w1, w2), leaves, dy)

    for name, env in (("step_triton", "0"), ("step_gluon", "1")):
        os.environ["MOEMLP_GLUON"] = env
        try:
            row[f"{name}_ms"] = time_ms(step, dev, rep_ms=rep_ms).median
        finally:
            os.environ.pop("MOEMLP_GLUON")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(GPU_SHAPES))
    p.add_argument("--rep-ms", type=int, default=100)
    args = p.parse_args()
    reason = gluon.why_unavailable()
    if reason:
        raise SystemExit(f"the Gluon engine cannot run here: {reason}")
    rows = []
    for name in args.shapes.split(","):
        rows.append(bench_shape(GPU_SHAPES[name], args.rep_ms))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    print_table(rows, ["shape", "rows_per_expert", "triton_pct_mm", "gluon_pct_mm", "triton_dprobs_err",
                       "gluon_dprobs_err"],
                "FC2_DGRAD with its epilogue and the dprobs reduce, % of a dense torch.mm of the same FLOPs")
    print_table(rows, ["shape", "step_triton_ms", "step_gluon_ms"],
                "forward + backward of grouped_mlp, median ms")


if __name__ == "__main__":
    main()
