"""The Triton backend's schedule: ``grouped_mlp_fwd`` / ``grouped_mlp_bwd`` with the contract of
reference.py, as launches of operands.py (recipe → GEMM operands, the GEMM and wgrad launches) and
gemm.launch (the dprobs reduce).

Forward, two launches:   FC1 (x @ W1ᵀ, epilogue: bias, act, ·p → h, z)   FC2 (z @ W2ᵀ + b2 → y)
Backward, up to six:     FC2_DGRAD (dy @ W2, epilogue: dprobs partials, g_h, round(z))
                         dprobs reduce    FC1_DGRAD (g_h @ W1 → dx)
                         wgrad dW1 (+ db1)    wgrad dW2 (+ db2)    [db alone when dW is not needed]
                         (under mxfp8 and nvfp4 without Hadamard dW2 right after FC2_DGRAD,
                         dy's and g_h's two operands from one values pass each: operands.both)

Inputs arrive validated (_validate.py): contiguous, on one device, splits of an integer dtype on
that device. Nothing here reads a tensor's values on the host (no .item(), .tolist(), .cpu(),
nonzero or data-dependent shapes), so a whole forward + backward can be captured in a CUDA graph.

Under a recipe (SPEC §3) the same launches take quantized operands (operands.py: fp8_block natively
on FP8 tensor cores, mxfp8 / nvfp4 as exact emulation on bf16 values), plus the quantizer passes:
FC1 stores z in fp32 and FC2_DGRAD stores g_h in fp32, the unrounded values the recipe quantizes
(as reference.py), and the biases' gradients come from unquantized operands. Under fp8_block each
weight is quantized once per forward + backward: ``grouped_mlp_fwd(..., keep_dgrad=(w1, w2))``
quantizes a weight the backward's dgrad will read with both layouts and returns its K-major codes
and tile scales (``saved``), which ``grouped_mlp_bwd(..., saved=saved)`` reads instead of
quantizing again. Across the micro-batches of an optimizer step, ``quantized`` (the tensors of
``moemlp.quantize_weights``) replaces even that pass, and under mxfp8 / nvfp4 the per-GEMM
dequantizing passes of the weights (the backward gets the dgrad operands as ``saved``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from .._validate import weight_is_transposed
from . import operands
from .gemm import launch
from .quant import supports


def unavailable_reason(device) -> str:
    """Why the Triton backend cannot run on ``device``; "" when it can."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        return f"triton is not importable ({exc})"
    device = torch.device(device)
    if device.type == "cuda":
        return ""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return ""
    if device.type == "cpu":
        return "tensors are on the CPU; the Triton kernels run on CUDA, or on the CPU only under TRITON_INTERPRET=1"
    return f"device type {device.type!r} is not supported by the Triton kernels (CUDA only)"


def is_available(device) -> bool:
    return unavailable_reason(device) == ""


def supports_recipe(recipe) -> bool:
    """None and every block-scaled recipe of SPEC §3 (fp8_block natively on FP8 tensor cores, mxfp8
    and nvfp4 as exact emulation on bf16 tensor cores)."""
    return recipe is None or supports(recipe)


def _check(cfg, **tensors: Optional[Tensor]) -> None:
    if not supports_recipe(cfg.recipe):
        raise ValueError(f"recipe: the triton backend has no implementation of {cfg.recipe!r}")
    # The kernels index rows with the shapes' own strides; a strided view would be read wrongly,
    # and copying it silently would hide a full extra pass from the caller. A weight may also be
    # the transposed view of a contiguous tensor without a recipe (operands.Weight reads it in place).
    for name, t in tensors.items():
        if t is None or t.is_contiguous():
            continue
        if not (name.endswith("_weight") and cfg.recipe is None and weight_is_transposed(t)):
            raise ValueError(f"{name}: the triton backend expects a contiguous tensor, got strides {t.stride()}")


def grouped_mlp_fwd(
    x: Tensor,  # (M, H) compute dtype, rows grouped by expert
    splits: Tensor,  # (E,) int32/int64 on x.device
    probs: Optional[Tensor],  # (M,) fp32/bf16/fp16 or None
    fc1_weight: Tensor,  # (E, N1, H)
    fc2_weight: Tensor,  # (E, H, F)
    fc1_bias: Optional[Tensor],  # (E, N1)
    fc2_bias: Optional[Tensor],  # (E, H)
    cfg,  # MLPConfig
    keep_dgrad: Optional[tuple[bool, bool]] = None,  # (W1, W2): hand their dgrad operands to the backward
    quantized: Sequence[Tensor] = (),  # QuantizedWeights.tensors(): W1's operands, then W2's (quantize_weights)
) -> tuple[Tensor, ...]:
    """Returns y (M, H) and h (M, N1), both in x.dtype; capacity rows are 0. With ``keep_dgrad``
    also ``saved``, a list for ``grouped_mlp_bwd``: under fp8_block the codes_t (E, C, R) and
    scales of each weight kept (empty tensors for one not kept), else [] (operands.saved_dgrad);
    under nvfp4 without the Hadamard option, when any weight is kept, it ends with x's routed amax
    (0-d fp32, ``operands.act``), which the backward's dW1 operand takes.
    With ``quantized`` the GEMMs read those operands (fp8_block's codes, mxfp8's / nvfp4's
    dequantized values), no weight is quantized here (operands.cached_weights) and ``saved`` holds
    only the amax: the caller puts the cached dgrad operands in front of it."""
    _check(cfg, x=x, splits=splits, probs=probs, fc1_weight=fc1_weight, fc2_weight=fc2_weight, fc1_bias=fc1_bias,
           fc2_bias=fc2_bias)  # fmt: skip
    M, H = x.shape
    E, N1, _ = fc1_weight.shape
    F = fc2_weight.shape[2]
    r = cfg.recipe
    w1, w2 = operands.weights((fc1_weight, fc2_weight), r, quantized)
    # Before the GEMMs: a kept weight is quantized once with both layouts, its codes read here and
    # dropped on return, its codes_t and scales returned for the backward's dgrad.
    saved = operands.saved_dgrad((w1, w2), r, keep_dgrad) if not quantized else []
    h = torch.empty((M, N1), dtype=x.dtype, device=x.device)
    # nvfp4: x's amax is that of its routed rows, which the backward's dW1 operand of x takes too,
    # handed on as saved's last tensor (one read of x fewer in the backward)
    keep_x_amax = keep_dgrad is not None and any(keep_dgrad) and operands.takes_routed_amax(r)
    x_op, b1 = operands.act(x, r, splits), w1.forward()
    if keep_x_amax:
        saved.append(x_op.routed_amax)
    # round(a·p), FC2's input, freed on return; fp32 under a recipe, which quantizes the unrounded z,
    # or (mxfp8 with FC1 on the engine) the values that FC2 reads, written by FC1's epilogue
    z, z_values = operands.fc1_z(x_op, b1, w1, h, fc1_bias, F, cfg)
    y = torch.empty((M, H), dtype=x.dtype, device=x.device)
    # FC1: h = x @ W1[e]ᵀ (+ b1), z = act(h)·p
    operands.gemm_on("fc1", x_op, w1, b_op=b1, splits=splits, out=h, z=z, probs=probs, bias=fc1_bias, N=F, K=H,
                     N1=N1, cfg=cfg, z_values=z_values)  # fmt: skip
    del x_op, b1
    # FC2: y = z @ W2[e]ᵀ + b2 (· p with scale_fc2_bias)
    z_op = operands.ActOperand(z) if z_values else operands.act(z, r, splits)
    operands.gemm_on("fc2", z_op, w2, splits=splits, out=y, probs=probs, bias=fc2_bias, N=H, K=F, N1=N1, cfg=cfg)
    return (y, h) if keep_dgrad is None else (y, h, saved)


def grouped_fc1(
    x: Tensor,  # (M, H) compute dtype, rows grouped by expert
    splits: Tensor,  # (E,) int32/int64 on x.device
    fc1_weight: Tensor,  # (E, N1, H)
    fc1_bias: Optional[Tensor],  # (E, N1)
    cfg,  # MLPConfig
    quantized: Sequence[Tensor] = (),  # W1's tensors of QuantizedWeights.tensors() (quantize_weights)
) -> Tensor:
    """h (M, N1) alone, for recompute_fc1: the FC1 launch of the forward without z."""
    _check(cfg, x=x, splits=splits, fc1_weight=fc1_weight, fc1_bias=fc1_bias)
    M, H = x.shape
    N1 = fc1_weight.shape[1]
    F = N1 // 2 if cfg.glu else N1
    (w1,) = operands.weights((fc1_weight,), cfg.recipe, quantized)
    h = torch.empty((M, N1), dtype=x.dtype, device=x.device)
    operands.gemm("fc1", x, w1, splits=splits, out=h, bias=fc1_bias, N=F, K=H, N1=N1, cfg=cfg)
    return h


def grouped_mlp_bwd(
    dy: Tensor,  # (M, H) compute dtype
    x: Tensor,  # (M, H)
    h: Tensor,  # (M, N1), the stored pre-activation
    splits: Tensor,  # (E,)
    probs: Optional[Tensor],  # (M,) or None
    fc1_weight: Tensor,  # (E, N1, H)
    fc2_weight: Tensor,  # (E, H, F)
    fc1_bias: Optional[Tensor],  # (E, N1)
    fc2_bias: Optional[Tensor],  # (E, H)
    cfg,  # MLPConfig
    needs: tuple[bool, bool, bool, bool, bool, bool],  # dx, dprobs, dw1, dw2, db1, db2
    wgrad_dtype: Optional[torch.dtype] = None,  # dW1/dW2 dtype; None = the weights' (fp32 for main_grad)
    saved: Sequence[Tensor] = (),  # W1's and W2's dgrad operands (+ nvfp4's x amax): grouped_mlp_fwd's saved
) -> tuple[Optional[Tensor], ...]:
    """Returns (dx, dprobs, dfc1_weight, dfc2_weight, dfc1_bias, dfc2_bias); None where not needed.
    A weight without a dgrad operand in ``saved`` (``saved`` empty, or its pair empty) is quantized
    here (operands.dgrad_weights)."""
    _check(cfg, dy=dy, x=x, h=h, splits=splits, probs=probs, fc1_weight=fc1_weight, fc2_weight=fc2_weight,
           fc1_bias=fc1_bias, fc2_bias=fc2_bias)  # fmt: skip
    need_dx, need_dprobs, need_dw1, need_dw2, need_db1, need_db2 = needs
    need_dprobs = need_dprobs and probs is not None
    need_g_h = need_dx or need_dw1 or (need_db1 and fc1_bias is not None)
    M, H = x.shape
    E, N1, _ = fc1_weight.shape
    F = fc2_weight.shape[2]
    device = x.device
    r = cfg.recipe
    dx = dprobs = dw1 = db1 = z = None
    # Under a recipe g_h and z are the fp32 values the recipe quantizes (for dx, dW1 and dW2); the
    # bias gradients and the bf16 path take them rounded to x.dtype, as the reference.
    inter = x.dtype if r is None else torch.float32
    # the forward's or quantize_weights' dgrad operand where given, else quantized once, for the dgrad only here
    x_amax = None  # nvfp4: the forward's amax of x's routed rows, saved's last tensor (grouped_mlp_fwd)
    if operands.takes_routed_amax(r) and len(saved) % 2:
        *saved, x_amax = saved
    w1, w2 = operands.dgrad_weights((fc1_weight, fc2_weight), r, saved)
    blocks = operands.WgradBlocks(splits, M, r)

    def wgrad2(z: Optional[Tensor], dy_values: Optional[Tensor] = None):
        return operands.wgrad(
            dy, z, splits, r, dtype=x.dtype, dw_dtype=wgrad_dtype or fc2_weight.dtype,
            bias=fc2_bias if need_db2 else None, probs=probs, scale_bias=cfg.scale_fc2_bias, blocks=blocks,
            transposed=weight_is_transposed(fc2_weight), g_values=dy_values,
        )  # fmt: skip

    dw2 = db2 = None
    one_read = False  # dW2 run already, right after FC2_DGRAD
    if need_g_h or need_dprobs or need_dw2:
        # One FC2 dgrad pass gives every consumer of g_z: dprobs partials, g_h, and round(z) for
        # dW2 (recomputed from h here rather than in the wgrad kernel's prologue).
        g_h = torch.empty((M, N1), dtype=inter, device=device)
        z = torch.empty((M, F), dtype=inter, device=device) if need_dw2 else None
        # one_read recipes: dy's two operands (along H for FC2_DGRAD, along the rows for dW2) from one
        # values pass, and dW2 right after FC2_DGRAD so its values are not held through FC1_DGRAD and dW1
        one_read = operands.one_read(r) and need_dw2
        dy_op, dy_values = operands.both(dy, splits, r, blocks) if one_read else (operands.act(dy, r, splits), None)
        # FC2_DGRAD: g_z = dy @ W2[e]
        partial = operands.gemm_on("fc2_dgrad", dy_op, w2, splits=splits, out=g_h, probs=probs, z=z, h=h,
                                   dprobs_partials=need_dprobs, N=F, K=H, N1=N1, cfg=cfg)  # fmt: skip
        del dy_op
        if one_read:
            dw2, db2 = wgrad2(z, dy_values)
            del dy_values
            z = None
        if need_dprobs:
            dprobs = torch.empty((M,), dtype=probs.dtype, device=device)
            launch.launch_dprobs_reduce(
                partial=partial, dy=dy, fc2_bias=fc2_bias, splits=splits, dprobs=dprobs,
                bias_term=cfg.scale_fc2_bias and fc2_bias is not None,
            )
        # one_read recipes: g_h's two operands (FC1_DGRAD's, dW1's) from one values pass likewise
        g_values = None
        if need_dx:
            # FC1_DGRAD: dx = g_h @ W1[e]
            dx = torch.empty((M, H), dtype=x.dtype, device=device)
            g_op, g_values = (operands.both(g_h, splits, r, blocks) if operands.one_read(r) and need_dw1
                              else (operands.act(g_h, r, splits), None))  # fmt: skip
            operands.gemm_on("fc1_dgrad", g_op, w1, splits=splits, out=dx, N=H, K=N1, N1=N1, cfg=cfg)
            del g_op
        dw1, db1 = operands.wgrad(
            g_h, x if need_dw1 else None, splits, r, dtype=x.dtype, dw_dtype=wgrad_dtype or fc1_weight.dtype,
            bias=fc1_bias if need_db1 else None, blocks=blocks, transposed=weight_is_transposed(fc1_weight),
            g_values=g_values, x_amax=x_amax if need_dw1 else None,
        )  # fmt: skip
    if not one_read:
        dw2, db2 = wgrad2(z)
    return dx, dprobs, dw1, dw2, db1, db2
