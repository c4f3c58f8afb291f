"""`python -m moemlp bench --parts`: the six GEMMs of one forward + backward, each timed alone as
moemlp's Triton backend launches it (epilogues included) and reported as a percentage of a dense
``torch.mm`` of the same FLOPs, beside ``torch._grouped_mm`` on the same plain GEMM and, where this
triton has it, the Gluon engine on the plain GEMM.

The six GEMMs (M routed rows, H hidden, F per-expert FFN, N1 = 2F):

  fc1         h = x @ W1[e]ᵀ          (M, H) × (H, N1);  epilogue: SwiGLU · probs → z, h stored
  fc2         y = z @ W2[e]ᵀ          (M, F) × (F, H)
  fc2_dgrad   g_z = dy @ W2[e]        (M, H) × (H, F);   epilogue: dSwiGLU · probs → g_h, z,
                                                          dprobs row partials (then their reduce,
                                                          timed with it)
  fc1_dgrad   dx = g_h @ W1[e]        (M, N1) × (N1, H)
  fc1_wgrad   dW1[e] = g_hᵀ @ x       per expert (N1, R_e) × (R_e, H)
  fc2_wgrad   dW2[e] = dyᵀ @ z        per expert (H, R_e) × (R_e, F)

``% of mm`` is t(dense torch.mm of the same FLOPs) / t(kernel) · 100: 100 is a dense GEMM's speed;
the mm is timed just before and just after its kernel and the two medians averaged (``bracketed_ms``).
``% of bound`` is the kernel's lower bound over its time: the bound is the larger of that dense mm's
time and the time the GEMM's unavoidable bytes (``min_bytes``: each operand read once, each output
written once, every expert's weights included) take at the copy bandwidth measured in the same run
(``copy_gbps``). Where experts are small the weights dominate those bytes, and the bound is memory.
The dense mm has the forward's orientation for the forward and dgrad GEMMs, and (N, M) × (M, K) for
the weight gradients. ``grouped_mm`` is the plain GEMM with no epilogue (what the torch composition
runs before its separate elementwise ops). ``gluon`` is the Gluon engine on the same GEMM with the
weights read in place and no epilogue: bf16 C for fc1, fc2 and fc1_dgrad; for fc2_dgrad the fp32 g_z
with each 128-deep product promoted (what dprobs' accuracy needs), so that column is the engine's
speed on the GEMM an unfused FC2_DGRAD would run, not a path moemlp takes; for the weight gradients
``gluon.wgrad``, which moemlp runs where experts average at most ``operands.WGRAD_ENGINE_ROWS`` rows.
"""

from __future__ import annotations

import os

import torch

from .._config import MLPConfig
from ..activations import ACTIVATIONS
from .common import bracketed_ms, device_description, print_table, routed_problem, time_ms, write_csv
from .peers import _grouped_mm_ok

__all__ = ["run_parts_bench", "run_fp8_parts_bench", "min_bytes", "copy_gbps", "GEMMS", "FP8_PARTS"]

GEMMS = ("fc1", "fc2", "fc2_dgrad", "fc1_dgrad", "fc1_wgrad", "fc2_wgrad")


def min_bytes(gemm: str, M: int, H: int, F: int, E: int, elem: int = 2, probs: bool = True) -> int:
    """The bytes a GEMM of the step cannot avoid moving: each operand read once and each output
    written once, in ``elem``-byte elements (bf16: 2), every expert's weights (or weight gradients)
    whole. FC1 also reads fp32 probs and writes h and z; FC2_DGRAD reads h and probs and writes g_h,
    z and fp32 dprobs (its row partials are the kernel's choice, not counted)."""
    N1 = 2 * F
    p = 4 * M if probs else 0  # fp32 probs (and dprobs)
    w1, w2 = E * N1 * H, E * H * F
    elems = {
        "fc1": (M * H + w1 + M * N1 + M * F, p),
        "fc2": (M * F + w2 + M * H, 0),
        "fc2_dgrad": (M * H + w2 + 2 * M * N1 + M * F, 2 * p),
        "fc1_dgrad": (M * N1 + w1 + M * H, 0),
        "fc1_wgrad": (M * N1 + M * H + w1, 0),
        "fc2_wgrad": (M * H + M * F + w2, 0),
    }
    if gemm not in elems:
        raise ValueError(f"unknown GEMM {gemm!r}; one of {', '.join(elems)}")
    n, extra = elems[gemm]
    return elem * n + extra


def copy_gbps(device: torch.device, rep_ms: int, nbytes: int = 1 << 30) -> float:
    """Device-memory bandwidth as a plain copy reaches it: bytes read plus bytes written over the
    median time of ``dst.copy_(src)`` on two ``nbytes`` buffers."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), device, rep_ms=rep_ms).median
    return 2 * nbytes / t / 1e6


def _gluon_ready(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    from ..kernels.gluon import is_available

    return is_available(device)


def run_parts_bench(shapes, device: torch.device, out_dir: str, rep_ms: int) -> list[dict]:
    """Times the six GEMMs at each shape; prints one table and writes ``parts.csv``."""
    from ..kernels import is_available, operands, unavailable_reason
    from ..kernels.gemm import launch as launch_mod

    if not is_available(device):
        raise SystemExit(
            f"bench --parts times the Triton backend's launches, which cannot run here: {unavailable_reason(device)}"
        )
    gluon = _gluon_ready(device)
    if gluon:
        from ..kernels.gluon import grouped_gemm as gluon_gemm
        from ..kernels.gluon import wgrad as gluon_wgrad
        from ..kernels.gluon._launch import PROMOTE_DEPTH
    print(f"bench --parts on {device_description(device)}", flush=True)
    gbps = copy_gbps(device, rep_ms)
    print(f"  copy bandwidth {gbps:.0f} GB/s", flush=True)
    rows = []
    for shape in shapes:
        x, splits, probs, w1, w2, dy = routed_problem(shape, device)
        M, H, F = shape.rows, shape.hidden, shape.ffn
        N1 = 2 * F
        cfg = MLPConfig(ACTIVATIONS["swiglu"], (), F, False)
        W1, W2 = operands.weights((w1, w2), None)
        h = torch.empty((M, N1), dtype=x.dtype, device=device)
        z = torch.empty((M, F), dtype=x.dtype, device=device)
        y = torch.empty((M, H), dtype=x.dtype, device=device)
        g_h = torch.empty((M, N1), dtype=x.dtype, device=device)
        z_b = torch.empty((M, F), dtype=x.dtype, device=device)
        dx = torch.empty((M, H), dtype=x.dtype, device=device)
        dprobs = torch.empty_like(probs)

        def fc1():
            operands.gemm("fc1", x, W1, splits=splits, out=h, z=z, probs=probs, N=F, K=H, N1=N1, cfg=cfg)

        def fc2():
            operands.gemm("fc2", z, W2, splits=splits, out=y, probs=probs, N=H, K=F, N1=N1, cfg=cfg)

        def fc2_dgrad():
            partial = operands.gemm("fc2_dgrad", dy, W2, splits=splits, out=g_h, probs=probs, z=z_b, h=h,
                                    dprobs_partials=True, N=F, K=H, N1=N1, cfg=cfg)  # fmt: skip
            launch_mod.launch_dprobs_reduce(partial=partial, dy=dy, fc2_bias=None, splits=splits, dprobs=dprobs,
                                            bias_term=False)  # fmt: skip

        def fc1_dgrad():
            operands.gemm("fc1_dgrad", g_h, W1, splits=splits, out=dx, N=H, K=N1, N1=N1, cfg=cfg)

        def fc1_wgrad():
            operands.wgrad(g_h, x, splits, None, dtype=x.dtype, dw_dtype=w1.dtype)

        def fc2_wgrad():
            operands.wgrad(dy, z_b, splits, None, dtype=x.dtype, dw_dtype=w2.dtype)

        # One pass in schedule order first, so that each later launch reads real h, z and g_h.
        for fn in (fc1, fc2, fc2_dgrad, fc1_dgrad, fc1_wgrad, fc2_wgrad):
            fn()
        offs = torch.cumsum(splits, 0).to(torch.int32)
        grouped = _grouped_mm_ok(x)
        # (kernel, peer, gluon, dense A, dense B): the dense mm has the GEMM's FLOPs
        parts = {
            "fc1": (fc1, lambda: torch._grouped_mm(x, w1.transpose(1, 2), offs=offs),
                    lambda: gluon_gemm(x, w1, splits), (M, H), (H, N1)),
            "fc2": (fc2, lambda: torch._grouped_mm(z, w2.transpose(1, 2), offs=offs),
                    lambda: gluon_gemm(z, w2, splits), (M, F), (F, H)),
            "fc2_dgrad": (fc2_dgrad, lambda: torch._grouped_mm(dy, w2, offs=offs),
                          lambda: gluon_gemm(dy, w2, splits, b_layout="kn", out_dtype=torch.float32,
                                            promote=PROMOTE_DEPTH),
                          (M, H), (H, F)),
            "fc1_dgrad": (fc1_dgrad, lambda: torch._grouped_mm(g_h, w1, offs=offs),
                          lambda: gluon_gemm(g_h, w1, splits, b_layout="kn"), (M, N1), (N1, H)),
            "fc1_wgrad": (fc1_wgrad, lambda: torch._grouped_mm(g_h.t(), x, offs=offs),
                          lambda: gluon_wgrad(g_h, x, splits), (N1, M), (M, H)),
            "fc2_wgrad": (fc2_wgrad, lambda: torch._grouped_mm(dy.t(), z_b, offs=offs),
                          lambda: gluon_wgrad(dy, z_b, splits), (H, M), (M, F)),
        }
        for name, (kernel, peer, engine, a_shape, b_shape) in parts.items():
            a = torch.randn(a_shape, device=device, dtype=x.dtype)
            b = torch.randn(b_shape, device=device, dtype=x.dtype)
            flops = 2.0 * a_shape[0] * a_shape[1] * b_shape[1]
            t_k, t_mm = bracketed_ms(kernel, lambda: torch.mm(a, b), device, rep_ms=rep_ms)
            nbytes = min_bytes(name, M, H, F, shape.experts)
            t_bytes = nbytes / gbps / 1e6
            row = {
                "shape": shape.name,
                "gemm": name,
                "rows_per_expert": M / shape.experts,
                "mm_tflops": flops / t_mm / 1e9,
                "moemlp_ms": t_k,
                "moemlp_tflops": flops / t_k / 1e9,
                "moemlp_pct_mm": 100.0 * t_mm / t_k,
                "min_gb": nbytes / 1e9,
                "bound": "memory" if t_bytes > t_mm else "mm",
                "moemlp_pct_bound": 100.0 * max(t_mm, t_bytes) / t_k,
                "copy_gbps": gbps,
                "grouped_mm_pct_mm": float("nan"),
                "gluon_pct_mm": float("nan"),
            }
            if grouped:
                row["grouped_mm_pct_mm"] = 100.0 * t_mm / time_ms(peer, device, rep_ms=rep_ms).median
            if gluon and engine is not None:
                row["gluon_pct_mm"] = 100.0 * t_mm / time_ms(engine, device, rep_ms=rep_ms).median
            rows.append(row)
            print(f"  {shape.name:>16} {name:>10}: {row['moemlp_pct_mm']:5.1f}% of mm, "
                  f"{row['moemlp_pct_bound']:5.1f}% of its bound ({row['bound']})", flush=True)
        del parts
    write_csv(os.path.join(out_dir, "parts.csv"), rows)
    print_table(rows, ["shape", "gemm", "rows_per_expert", "mm_tflops", "moemlp_tflops", "moemlp_pct_mm",
                       "grouped_mm_pct_mm", "gluon_pct_mm", "min_gb", "bound", "moemlp_pct_bound"],
                "\nthe six GEMMs, % of a dense torch.mm of the same FLOPs (median ms of do_bench; nan: not run "
                f"here); % of the bound: the larger of the mm's time and min_gb at {gbps:.0f} GB/s")
    return rows


# fp8_block's step, part by part: (part, kind) in schedule order. "gemm": one GEMM on operands
# quantized beforehand, as moemlp launches it (epilogue included); "quant": one quantizer pass.
FP8_PARTS = (
    ("quant x", "quant"), ("fc1", "gemm"), ("quant z", "quant"), ("fc2", "gemm"),
    ("quant dy", "quant"), ("fc2_dgrad", "gemm"), ("quant g_h", "quant"), ("fc1_dgrad", "gemm"),
    ("wgrad quant g_h, x", "quant"), ("fc1_wgrad", "gemm"), ("wgrad quant dy, z", "quant"), ("fc2_wgrad", "gemm"),
    ("quant W1, both layouts", "weights"), ("quant W2, both layouts", "weights"),
)  # fmt: skip


def run_fp8_parts_bench(shapes, device: torch.device, out_dir: str, rep_ms: int) -> list[dict]:
    """``bench --parts --recipes``: fp8_block's forward + backward as its parts, each timed alone:
    the six GEMMs on operands quantized beforehand (which kernel ran, its TFLOP/s and % of a dense
    bf16 torch.mm of the same FLOPs) and the quantizer passes (their GB/s: bytes read and written).
    The weights' passes run once per step under ``quantize_weights`` (the ``_wcache`` columns of
    ``bench --recipes``), else in every forward. Prints one table; writes ``parts_fp8.csv``."""
    from ..kernels import is_available, unavailable_reason
    from ..recipes import recipe as make_recipe

    if not is_available(device):
        raise SystemExit(
            f"bench --parts times the Triton backend's launches, which cannot run here: {unavailable_reason(device)}"
        )
    r = make_recipe("fp8_block")
    print(f"bench --parts --recipes (fp8_block) on {device_description(device)}", flush=True)
    rows = []
    for shape in shapes:
        rows += _fp8_shape_rows(shape, r, device, rep_ms)
    write_csv(os.path.join(out_dir, "parts_fp8.csv"), rows)
    print_table(rows, ["shape", "part", "kernel", "ms", "pct_of_step", "tflops", "pct_mm", "gbps"],
                "\nfp8_block's forward + backward, part by part (median ms of do_bench; pct_of_step: of the sum of "
                "the parts but the weights' passes; pct_mm: of a dense bf16 torch.mm of the same FLOPs; gbps: the "
                "pass's bytes read and written)")  # fmt: skip
    return rows



def _fp8_shape_rows(shape, r, device: torch.device, rep_ms: int) -> list[dict]:
    """``run_fp8_parts_bench``'s rows of one shape, in FP8_PARTS' order."""
    from ..kernels import operands
    from ..kernels.gemm import launch as launch_mod
    from ..kernels.quant import api as kq

    rows = []
    x, splits, probs, w1, w2, dy = routed_problem(shape, device)
    M, H, F = shape.rows, shape.hidden, shape.ffn
    N1 = 2 * F
    cfg = MLPConfig(ACTIVATIONS["swiglu"], (), F, False, r)
    W1 = operands.Weight.from_cache(w1, r, *_tiles_of(kq.quantize_weight(w1, r, transposed=True)))
    W2 = operands.Weight.from_cache(w2, r, *_tiles_of(kq.quantize_weight(w2, r, transposed=True)))
    h = torch.empty((M, N1), dtype=x.dtype, device=device)
    z = torch.empty((M, F), dtype=torch.float32, device=device)  # fp32 under a recipe, as kernels/mlp.py
    y = torch.empty((M, H), dtype=x.dtype, device=device)
    g_h = torch.empty((M, N1), dtype=torch.float32, device=device)
    z_b = torch.empty((M, F), dtype=torch.float32, device=device)
    dx = torch.empty((M, H), dtype=x.dtype, device=device)
    dprobs = torch.empty_like(probs)
    blocks = operands.WgradBlocks(splits, M, r).get()
    ops = {}

    def quant_x():
        ops["x"] = operands.act(x, r, splits)

    def fc1():
        operands.gemm_on("fc1", ops["x"], W1, splits=splits, out=h, z=z, probs=probs, N=F, K=H, N1=N1, cfg=cfg)

    def quant_z():
        ops["z"] = operands.act(z, r, splits)

    def fc2():
        operands.gemm_on("fc2", ops["z"], W2, splits=splits, out=y, probs=probs, N=H, K=F, N1=N1, cfg=cfg)

    def quant_dy():
        ops["dy"] = operands.act(dy, r, splits)

    def fc2_dgrad():
        partial = operands.gemm_on("fc2_dgrad", ops["dy"], W2, splits=splits, out=g_h, probs=probs, z=z_b, h=h,
                                   dprobs_partials=True, N=F, K=H, N1=N1, cfg=cfg)  # fmt: skip
        launch_mod.launch_dprobs_reduce(partial=partial, dy=dy, fc2_bias=None, splits=splits, dprobs=dprobs,
                                        bias_term=False)  # fmt: skip

    def quant_g_h():
        ops["g_h"] = operands.act(g_h, r, splits)

    def fc1_dgrad():
        operands.gemm_on("fc1_dgrad", ops["g_h"], W1, splits=splits, out=dx, N=H, K=N1, N1=N1, cfg=cfg)

    def wgrad_quant(name, g, t):
        def run():
            g_op = kq.quantize_wgrad(g, splits, r, is_grad=True, transposed=True, blocks=blocks)
            ops[name] = (g_op, kq.quantize_wgrad(t, splits, r, is_grad=False, transposed=True, blocks=blocks))

        return run

    def wgrad(name, dtype):
        def run():
            g_op, t_op = ops[name]
            operands.fp8_wgrad(g_op, t_op, splits, M, dtype)

        return run

    fns = {
        "quant x": quant_x, "fc1": fc1, "quant z": quant_z, "fc2": fc2, "quant dy": quant_dy,
        "fc2_dgrad": fc2_dgrad, "quant g_h": quant_g_h, "fc1_dgrad": fc1_dgrad,
        "wgrad quant g_h, x": wgrad_quant("dw1", g_h, x), "fc1_wgrad": wgrad("dw1", w1.dtype),
        "wgrad quant dy, z": wgrad_quant("dw2", dy, z_b), "fc2_wgrad": wgrad("dw2", w2.dtype),
        "quant W1, both layouts": lambda: kq.quantize_weight(w1, r, transposed=True),
        "quant W2, both layouts": lambda: kq.quantize_weight(w2, r, transposed=True),
    }  # fmt: skip
    # One pass in schedule order first, so that each later launch reads real operands.
    for fn in fns.values():
        fn()
    # (dense A, dense B, the GEMM's kind, operand and weight (a wgrad's: its operands and dW's dtype),
    # for which kernel runs it)
    gemms = {
        "fc1": ((M, H), (H, N1), "fc1", "x", W1), "fc2": ((M, F), (F, H), "fc2", "z", W2),
        "fc2_dgrad": ((M, H), (H, F), "fc2_dgrad", "dy", W2),
        "fc1_dgrad": ((M, N1), (N1, H), "fc1_dgrad", "g_h", W1),
        "fc1_wgrad": ((N1, M), (M, H), None, "dw1", w1.dtype), "fc2_wgrad": ((H, M), (M, F), None, "dw2", w2.dtype),
    }  # fmt: skip
    moved = {  # bytes read + written by each quantizer pass (codes 1 B, scales ignored)
        "quant x": M * H * (2 + 1), "quant z": M * F * (4 + 1), "quant dy": M * H * (2 + 1),
        "quant g_h": M * N1 * (4 + 1), "wgrad quant g_h, x": M * (N1 * (4 + 1) + H * (2 + 1)),
        "wgrad quant dy, z": M * (H * (2 + 1) + F * (4 + 1)),
        "quant W1, both layouts": w1.numel() * (2 + 2), "quant W2, both layouts": w2.numel() * (2 + 2),
    }  # fmt: skip
    t_all, t_mm_of = {}, {}
    for name, kind in FP8_PARTS:  # each GEMM between two timings of its dense mm
        if kind == "gemm":
            a_shape, b_shape = gemms[name][:2]
            a = torch.randn(a_shape, device=device, dtype=x.dtype)
            b = torch.randn(b_shape, device=device, dtype=x.dtype)
            t_all[name], t_mm_of[name] = bracketed_ms(fns[name], lambda: torch.mm(a, b), device, rep_ms=rep_ms)
            del a, b
        else:
            t_all[name] = time_ms(fns[name], device, rep_ms=rep_ms).median
    step = sum(t for (name, kind), t in zip(FP8_PARTS, t_all.values()) if kind != "weights")
    for name, kind in FP8_PARTS:
        t = t_all[name]
        row = {"shape": shape.name, "part": name, "kind": kind, "ms": t, "pct_of_step": 100.0 * t / step,
               "kernel": "", "tflops": float("nan"), "pct_mm": float("nan"), "gbps": float("nan")}  # fmt: skip
        if kind == "gemm":
            a_shape, b_shape, gemm_kind, operand, weight = gemms[name]
            flops = 2.0 * a_shape[0] * a_shape[1] * b_shape[1]
            row.update(tflops=flops / t / 1e9, pct_mm=100.0 * t_mm_of[name] / t)
            if gemm_kind is None:
                g_op, t_op = ops[operand]
                engine = operands.fp8_wgrad_engine(g_op, t_op, splits, weight)
                row["kernel"] = "gluon fp8_wgrad" if engine else "triton"
            else:
                b_op = weight.forward() if gemm_kind in ("fc1", "fc2") else weight.dgrad()
                out = {"fc1": h, "fc2": y, "fc2_dgrad": g_h, "fc1_dgrad": dx}[gemm_kind]
                z_out = z_b if gemm_kind == "fc2_dgrad" else z
                engine = operands.engine_kernel(gemm_kind, ops[operand], b_op, weight, out=out, bias=None,
                                                h=h, z=z_out, cfg=cfg)  # fmt: skip
                row["kernel"] = f"gluon {engine}" if engine else "triton"
        else:
            row["gbps"] = moved[name] / t / 1e6
        rows.append(row)
        print(f"  {shape.name:>16} {name:>24}: {t:7.3f} ms {row['kernel']}", flush=True)
    print(f"  {shape.name:>16} {'sum but the weights':>24}: {step:7.3f} ms", flush=True)
    return rows


def _tiles_of(q) -> tuple:
    """codes, codes_t and scales of ``quantize_weight(..., transposed=True)``, for Weight.from_cache."""
    return q.codes, q.codes_t, q.scales
