"""The Triton backend: ``grouped_mlp_fwd`` / ``grouped_mlp_bwd`` with the contract of reference.py.

Inputs arrive validated (_validate.py): contiguous, on one device, splits of an integer dtype on
that device. Nothing here reads a tensor's values on the host (no .item(), .tolist(), .cpu(),
nonzero or data-dependent shapes), so a whole forward + backward can be captured in a CUDA graph.

Forward, two launches:   FC1 (x @ W1ᵀ, epilogue: bias, act, ·p → h, z)   FC2 (z @ W2ᵀ + b2 → y)
Backward, up to six:     FC2_DGRAD (dy @ W2, epilogue: dprobs partials, g_h, round(z))
                         dprobs reduce    FC1_DGRAD (g_h @ W1 → dx)
                         wgrad dW2 (+ db2)    wgrad dW1 (+ db1)    [db2 alone when dW2 is not needed]

Under a recipe (SPEC §3) the same launches take quantized operands (_operands.py: fp8_block natively
on FP8 tensor cores, mxfp8 / nvfp4 as exact emulation on bf16 values), plus the quantizer passes:
FC1 stores z in fp32 and FC2_DGRAD stores g_h in fp32, the unrounded values the recipe quantizes
(as reference.py), and the biases' gradients come from unquantized operands. Under fp8_block the
FC2_DGRAD epilogue can also quantize g_h and z for dW1 / dW2 itself (``_grouped_gemm.WgradCodes``;
off by default, ``FUSE_WGRAD_CODES`` says why). Under fp8_block each
weight is quantized once per forward + backward: ``grouped_mlp_fwd(..., keep_dgrad=(w1, w2))``
quantizes a weight the backward's dgrad will read with both layouts and returns its K-major codes
and tile scales (``saved``), which ``grouped_mlp_bwd(..., saved=saved)`` reads instead of
quantizing again. Across the micro-batches of an optimizer step, ``quantized`` (the tensors of
``moemlp.quantize_weights``) replaces even that pass.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

__all__ = ["is_available", "unavailable_reason", "supports_recipe", "grouped_mlp_fwd", "grouped_mlp_bwd", "grouped_fc1"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable_reason(device) -> str:
    """Why the Triton backend cannot run on ``device``; "" when it can."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        return f"triton is not importable ({exc})"
    device = torch.device(device)
    if device.type == "cuda":
        return ""
    if device.type == "cpu" and _interpreting():
        return ""
    if device.type == "cpu":
        return "tensors are on the CPU; the Triton kernels run on CUDA, or on the CPU only under TRITON_INTERPRET=1"
    return f"device type {device.type!r} is not supported by the Triton kernels (CUDA only)"


def is_available(device) -> bool:
    return unavailable_reason(device) == ""


def _check_recipe(cfg) -> None:
    if not supports_recipe(cfg.recipe):
        raise ValueError(f"recipe: the triton backend has no implementation of {cfg.recipe!r}")


def _check_contiguous(**tensors: Optional[Tensor]) -> None:
    # The kernels index rows with the shapes' own strides; a strided view would be read wrongly,
    # and copying it silently would hide a full extra pass from the caller.
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
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
    quantized: Sequence[Tensor] = (),  # fp8_block: codes, codes_t, scales of W1 then W2 (quantize_weights)
) -> tuple[Tensor, ...]:
    """Returns y (M, H) and h (M, N1), both in x.dtype; capacity rows are 0. With ``keep_dgrad``
    also ``saved``, a list for ``grouped_mlp_bwd``: under fp8_block the codes_t (E, C, R) and
    scales of each weight kept (empty tensors for one not kept), else [] (_operands.saved_dgrad).
    With ``quantized`` (fp8_block) the GEMMs read those codes and no weight is quantized here; the
    ``saved`` returned then holds the given codes_t and scales themselves."""
    from . import _grouped_gemm as gg

    _check_recipe(cfg)
    _check_contiguous(
        x=x,
        splits=splits,
        probs=probs,
        fc1_weight=fc1_weight,
        fc2_weight=fc2_weight,
        fc1_bias=fc1_bias,
        fc2_bias=fc2_bias,
    )
    M, H = x.shape
    E, N1, _ = fc1_weight.shape
    F = fc2_weight.shape[2]
    r = cfg.recipe
    w1 = w2 = None
    saved = []
    if r is not None:
        from . import _operands

        if quantized:
            w1, w2 = _operands.cached_weights((fc1_weight, fc2_weight), r, quantized)
        else:
            w1, w2 = _operands.Weight(fc1_weight, r), _operands.Weight(fc2_weight, r)
        # Before the GEMMs: a kept weight is quantized once with both layouts, its codes read here
        # and dropped on return, its codes_t and scales returned for the backward's dgrad.
        saved = _operands.saved_dgrad((w1, w2), r, keep_dgrad)
    h = torch.empty((M, N1), dtype=x.dtype, device=x.device)
    # round(a·p), FC2's input, freed on return; fp32 under a recipe, which quantizes the unrounded z
    z = torch.empty((M, F), dtype=x.dtype if r is None else torch.float32, device=x.device)
    y = torch.empty((M, H), dtype=x.dtype, device=x.device)
    _fc1(x, splits, probs, fc1_weight, fc1_bias, h, z, cfg, w1)
    # FC2: B[e] = W2[e]ᵀ, element (n, k) = W2[e, n, k], n over H, k over F.
    _gemm(
        gg.FC2.value,
        z,
        fc2_weight,
        (H * F, F, 1),
        "forward",
        splits,
        probs,
        fc2_bias,
        y,
        None,
        None,
        None,
        N=H,
        K=F,
        N1=N1,
        cfg=cfg,
        scale_bias=cfg.scale_fc2_bias,
        store_z=False,
        store_partial=False,
        kind="fc2",
        weight=w2,
    )
    return (y, h) if keep_dgrad is None else (y, h, saved)


def _fc1(x, splits, probs, fc1_weight, fc1_bias, h, z, cfg, weight) -> None:
    """FC1's launch, x @ W1[e]ᵀ (B element (n, k) = W1[e, n, k]) with its epilogue: h, and z when
    given (the forward; grouped_fc1's recompute stores h alone). ``weight``: W1's _operands.Weight."""
    from . import _grouped_gemm as gg

    M, H = x.shape
    N1 = fc1_weight.shape[1]
    F = N1 // 2 if cfg.glu else N1
    _gemm(
        gg.FC1.value, x, fc1_weight, (N1 * H, H, 1), "forward", splits, probs, fc1_bias, h, z, None, None,
        N=F, K=H, N1=N1, cfg=cfg, scale_bias=False, store_z=z is not None, store_partial=False, kind="fc1",
        weight=weight,
    )  # fmt: skip


def _gemm(
    epilogue,
    a,
    w,
    strides,
    orientation,
    splits,
    probs,
    bias,
    out,
    z,
    h,
    partial,
    *,
    N,
    K,
    N1,
    cfg,
    scale_bias,
    store_z,
    store_partial,
    kind,
    weight=None,
    config=None,
    wgrad_codes=None,
):
    """One grouped-GEMM launch: a @ B with B(n, k) = w[e, n, k] ("forward") or w[e, k, n] ("dgrad"),
    strides those of w read that way; under cfg.recipe both operands quantized first (_operands.py).
    ``weight``: an _operands.Weight of w to reuse its quantization across GEMMs. ``wgrad_codes``:
    _grouped_gemm.WgradCodes for the FC2_DGRAD epilogue under fp8_block."""
    from . import _grouped_gemm as gg

    r = cfg.recipe
    extra = {}
    if r is not None:
        from . import _operands

        a_op = _operands.act(a, r)
        w_op = weight or _operands.Weight(w, r)
        b_op = w_op.forward() if orientation == "forward" else w_op.dgrad()
        a, w, strides = a_op.a, b_op.b, b_op.strides
        extra = _operands.gemm_kwargs(a_op, b_op)
    dq = extra.get("dequant", (0, 0))
    fp8 = "a_scales" in extra and not any(dq)
    # codes dequantized in the load path: the bf16 kernel's tiles (the values it multiplies are bf16)
    config = config or gg.default_config(kind, N, K, cfg.glu, 2 if any(dq) else a.element_size(), fp8=fp8)
    if r is not None and not fp8 and config.BK < 32:
        # the interpreter's 16-deep steps hold half an mxfp8 block; 32 for both of the emulated
        # recipes' ways (load path or pass), whose results are then the same bits
        config = dataclasses.replace(config, BK=32)
    gg.launch_grouped_gemm(
        epilogue, a, w, strides, splits, probs, bias, out, z, h, partial,
        N=N, K=K, N1=N1, cfg=cfg, scale_bias=scale_bias, store_z=store_z, store_partial=store_partial,
        config=config, wgrad_codes=wgrad_codes, **extra,
    )  # fmt: skip


def grouped_fc1(
    x: Tensor,  # (M, H) compute dtype, rows grouped by expert
    splits: Tensor,  # (E,) int32/int64 on x.device
    fc1_weight: Tensor,  # (E, N1, H)
    fc1_bias: Optional[Tensor],  # (E, N1)
    cfg,  # MLPConfig
    quantized: Sequence[Tensor] = (),  # fp8_block: W1's codes, codes_t, scales (quantize_weights)
) -> Tensor:
    """h (M, N1) alone, for recompute_fc1: the FC1 launch of the forward without z."""
    _check_recipe(cfg)
    _check_contiguous(x=x, splits=splits, fc1_weight=fc1_weight, fc1_bias=fc1_bias)
    M, N1 = x.shape[0], fc1_weight.shape[1]
    w1 = None
    if quantized:
        from . import _operands

        (w1,) = _operands.cached_weights((fc1_weight,), cfg.recipe, quantized)
    h = torch.empty((M, N1), dtype=x.dtype, device=x.device)
    _fc1(x, splits, None, fc1_weight, fc1_bias, h, None, cfg, w1)
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
    saved: Sequence[Tensor] = (),  # grouped_mlp_fwd's saved (keep_dgrad): W1's and W2's dgrad operands
) -> tuple[Optional[Tensor], ...]:
    """Returns (dx, dprobs, dfc1_weight, dfc2_weight, dfc1_bias, dfc2_bias); None where not needed.
    A weight the forward did not keep (``saved`` empty, or its pair empty) is quantized here."""
    from . import _grouped_gemm as gg

    _check_recipe(cfg)
    _check_contiguous(
        dy=dy,
        x=x,
        h=h,
        splits=splits,
        probs=probs,
        fc1_weight=fc1_weight,
        fc2_weight=fc2_weight,
        fc1_bias=fc1_bias,
        fc2_bias=fc2_bias,
    )
    need_dx, need_dprobs, need_dw1, need_dw2, need_db1, need_db2 = needs
    need_dprobs = need_dprobs and probs is not None
    need_db1 = need_db1 and fc1_bias is not None
    need_db2 = need_db2 and fc2_bias is not None
    M, H = x.shape
    E, N1, _ = fc1_weight.shape
    F = fc2_weight.shape[2]
    device = x.device
    dx = dprobs = dw1 = dw2 = db1 = db2 = None

    need_g_h = need_dx or need_dw1 or need_db1
    r = cfg.recipe
    # Under a recipe g_h and z are the fp32 values the recipe quantizes (for dx, dW1 and dW2); the
    # bias gradients and the bf16 path take them rounded to x.dtype, as the reference.
    inter = x.dtype if r is None else torch.float32
    w2 = w1 = None
    if r is not None:
        from . import _operands

        # the forward's quantization where it kept one, else quantized once, for the dgrad only here
        w1, w2 = _operands.dgrad_weights((fc1_weight, fc2_weight), r, saved)
    wgrad_config = gg.default_config("wgrad", 0, 0, cfg.glu, x.element_size())
    if need_g_h or need_dprobs or need_dw2:
        # One FC2 dgrad pass gives every consumer of g_z: dprobs partials, g_h, and round(z) for
        # dW2 (recomputed from h here rather than in the wgrad kernel's prologue).
        elem = 2 if r is not None else x.element_size()  # recipes: e4m3 codes or bf16 values
        dgrad_config = gg.default_config("fc2_dgrad", F, H, cfg.glu, elem, fp8=_native(r))
        num_parts = _cdiv(F, dgrad_config.BN)
        codes = None
        if gg.FUSE_WGRAD_CODES and _native(r) and (need_dw1 or need_dw2) and gg.fp8_epilogue_blocks_ok(dgrad_config, H):
            # fp8_block: the epilogue also quantizes g_h and z for dW1 / dW2 from the fp32 values it
            # holds (its 128-row tiles are the wgrad layout's blocks): no quantize_wgrad pass re-reads
            # them, and z is not stored at all. Off by default: measured slower (FUSE_WGRAD_CODES).
            codes = gg.WgradCodes.empty(M, E, N1, F, r.pow2_scales, g=need_dw1, z=need_dw2, device=device)
        g_h = torch.empty((M, N1), dtype=inter, device=device)
        z = torch.empty((M, F), dtype=inter, device=device) if need_dw2 and codes is None else None
        partial = torch.empty((num_parts, M), dtype=torch.float32, device=device) if need_dprobs else None
        # g_z = dy @ W2[e]: element (n, k) = W2[e, k, n], n over F, k over H.
        _gemm(
            gg.FC2_DGRAD.value,
            dy,
            fc2_weight,
            (H * F, 1, F),
            "dgrad",
            splits,
            probs,
            None,
            g_h,
            z,
            h,
            partial,
            N=F,
            K=H,
            N1=N1,
            cfg=cfg,
            scale_bias=False,
            store_z=need_dw2,
            store_partial=need_dprobs,
            kind="fc2_dgrad",
            weight=w2,
            config=dgrad_config,
            wgrad_codes=codes,
        )
        if need_dprobs:
            dprobs = torch.empty((M,), dtype=probs.dtype, device=device)
            gg.launch_dprobs_reduce(
                partial, dy, fc2_bias, splits, dprobs, num_parts,
                bias_term=cfg.scale_fc2_bias and fc2_bias is not None,
            )  # fmt: skip
        if need_dx:
            dx = torch.empty((M, H), dtype=x.dtype, device=device)
            # dx = g_h @ W1[e]: element (n, k) = W1[e, k, n], n over H, k over N1.
            _gemm(
                gg.FC1_DGRAD.value,
                g_h,
                fc1_weight,
                (N1 * H, 1, H),
                "dgrad",
                splits,
                None,
                None,
                dx,
                None,
                None,
                None,
                N=H,
                K=N1,
                N1=N1,
                cfg=cfg,
                scale_bias=False,
                store_z=False,
                store_partial=False,
                kind="fc1_dgrad",
                weight=w1,
            )
        if r is None:
            if need_dw1 or need_db1:
                # The wgrad kernel stores its fp32 accumulator in dw's dtype: fp32 costs no extra pass.
                dw1 = torch.empty_like(fc1_weight, dtype=wgrad_dtype or fc1_weight.dtype) if need_dw1 else None
                db1 = torch.empty_like(fc1_bias) if need_db1 else None
                gg.launch_grouped_wgrad(g_h, x if need_dw1 else None, splits, None, dw1, db1, False, wgrad_config)
            if need_dw2:
                dw2 = torch.empty_like(fc2_weight, dtype=wgrad_dtype or fc2_weight.dtype)
                db2 = torch.empty_like(fc2_bias) if need_db2 else None
                gg.launch_grouped_wgrad(dy, z, splits, probs, dw2, db2, cfg.scale_fc2_bias, wgrad_config)
        else:
            # one row-block layout for every wgrad operand of this backward (the same splits and rows)
            from .quantize import row_blocks

            blocks = row_blocks(splits, M, r.block, x.device) if need_dw1 or need_dw2 else None
            if need_dw1:
                g_kmajor = (codes.g_t, codes.g_s) if codes is not None else None
                dw1 = _operands.wgrad(
                    g_h, x, splits, r, wgrad_dtype or fc1_weight.dtype, wgrad_config, g_kmajor, blocks=blocks
                )
            if need_db1:
                db1 = torch.empty_like(fc1_bias)
                gg.launch_grouped_wgrad(g_h.to(x.dtype), None, splits, None, None, db1, False, wgrad_config)
            if need_dw2:
                z_kmajor = (codes.z_t, codes.z_s) if codes is not None else None
                dw2 = _operands.wgrad(
                    dy, z, splits, r, wgrad_dtype or fc2_weight.dtype, wgrad_config, x_kmajor=z_kmajor, blocks=blocks
                )
    if need_db2 and db2 is None:
        db2 = torch.empty_like(fc2_bias)
        gg.launch_grouped_wgrad(dy, None, splits, probs, None, db2, cfg.scale_fc2_bias, wgrad_config)
    return dx, dprobs, dw1, dw2, db1, db2


def _native(recipe) -> bool:
    if recipe is None:
        return False
    from ._operands import is_native

    return is_native(recipe)


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def supports_recipe(recipe) -> bool:
    """None and every block-scaled recipe of SPEC §3 (fp8_block natively on FP8 tensor cores, mxfp8
    and nvfp4 as exact emulation on bf16 tensor cores)."""
    if recipe is None:
        return True
    from .quantize import supports

    return supports(recipe)
