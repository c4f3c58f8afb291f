"""The torch semantics of SPEC §1: the reference every other backend is tested against.

Runs on any device in bf16, fp16, fp32 and float64. Accumulation is fp32 (float64 for float64
inputs): operands are upcast exactly and multiplied in the accumulation dtype, so the result does
not depend on which matmul kernel a device picks for low-precision inputs.

Vectorised over experts: the rows of each expert are scattered into a zero-padded
(E, C, ·) batch, C = the largest expert's row count, and every GEMM is one ``bmm``. Zero padding
makes an empty expert's weight and bias gradients exactly zero. Reading C is a host read of
``splits``: acceptable for the reference, never done by the Triton backend.

Recipes (SPEC §3) enter through the recipe object's quantize-dequantize methods, one call per GEMM
operand, along that GEMM's reduction dimension:
  ``recipe.qdq(t, dim)``              activations and gradients of the forward and dgrad GEMMs
  ``recipe.qdq_weight(w, dim)``       expert weights (E, A, B), reduction along ``dim``
  ``recipe.qdq_wgrad(grad, act, splits)`` both wgrad operands (M, ·), blocks along rows that
                                      restart at each expert's first row
each returning fp32 tensors whose values are the dequantized codes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._config import MLPConfig
from ._validate import validate_split_values, weight_is_transposed

__all__ = ["grouped_mlp_fwd", "grouped_mlp_bwd", "grouped_fc1", "ExpertLayout"]


class ExpertLayout:
    """Where each routed row sits in the padded (E, C, ·) batch."""

    def __init__(self, splits: Tensor, num_rows: int, device: torch.device):
        validate_split_values(splits, num_rows)  # the host read this layout needs anyway
        splits = splits.to(device=device, dtype=torch.int64)
        self.num_experts = splits.numel()
        offsets = torch.cumsum(splits, 0)
        self.total = int(offsets[-1]) if self.num_experts else 0  # rows past this are capacity
        self.capacity = int(splits.max()) if self.num_experts else 0
        rows = torch.arange(self.total, device=device)
        self.expert = torch.searchsorted(offsets, rows, right=True)  # (T,) expert of each row
        self.pos = rows - (offsets - splits)[self.expert]  # (T,) row within its expert
        self.num_rows = num_rows

    def pad(self, t: Tensor) -> Tensor:
        """(T, K) rows grouped by expert -> (E, C, K), zeros past each expert's rows."""
        out = t.new_zeros(self.num_experts, self.capacity, t.shape[-1])
        out[self.expert, self.pos] = t
        return out

    def unpad(self, t: Tensor) -> Tensor:
        """(E, C, K) -> (T, K)."""
        return t[self.expert, self.pos]

    def full(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        """(T, ...) -> (M, ...) in ``dtype`` with capacity rows zero; one rounding in the store."""
        out = torch.zeros((self.num_rows,) + tuple(t.shape[1:]), dtype=dtype, device=t.device)
        out[: self.total] = t
        return out


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _split_glu(h: Tensor, g: int) -> tuple[Tensor, Tensor]:
    """(T, N1) -> gate (T, F), up (T, F) for blocks [gate g | up g | ...]."""
    t, n1 = h.shape
    hv = h.reshape(t, n1 // (2 * g), 2, g)
    return hv[:, :, 0, :].reshape(t, n1 // 2), hv[:, :, 1, :].reshape(t, n1 // 2)


def _merge_glu(d_gate: Tensor, d_up: Tensor, g: int) -> Tensor:
    t, f = d_gate.shape
    return torch.stack(
        (d_gate.reshape(t, f // g, g), d_up.reshape(t, f // g, g)), dim=2
    ).reshape(t, 2 * f)


def activate(h: Tensor, cfg: MLPConfig) -> Tensor:
    """a = act(h), h in the accumulation dtype."""
    spec = cfg.activation
    if spec.glu:
        gate, up = _split_glu(h, cfg.glu_interleave)
        return spec.fn(gate, up, *cfg.activation_params)
    return spec.fn(h, *cfg.activation_params)


def activate_grad(h: Tensor, g_a: Tensor, cfg: MLPConfig) -> Tensor:
    """dL/dh given dL/da, both in the accumulation dtype."""
    spec = cfg.activation
    if spec.glu:
        gate, up = _split_glu(h, cfg.glu_interleave)
        d_gate, d_up = spec.grad(gate, up, *cfg.activation_params)
        return _merge_glu(d_gate * g_a, d_up * g_a, cfg.glu_interleave)
    return spec.grad(h, *cfg.activation_params) * g_a


def _operand(t: Tensor, acc: torch.dtype, recipe, dim: int) -> Tensor:
    return t.to(acc) if recipe is None else recipe.qdq(t, dim)


def _weight(w: Tensor, acc: torch.dtype, recipe, dim: int) -> Tensor:
    return w.to(acc) if recipe is None else recipe.qdq_weight(w, dim)


def _wgrad(g_p: Tensor, x_p: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
    """dW (E, P, Q) = g_pᵀ @ x_p per expert, in ``dtype``, stored in ``weight``'s layout: a
    transposed-layout weight gets the transposed view of a contiguous (E, Q, P) product, so its
    gradient accumulates without a copy."""
    if weight_is_transposed(weight):
        return torch.bmm(x_p.transpose(1, 2), g_p).to(dtype).transpose(1, 2)
    return torch.bmm(g_p.transpose(1, 2), x_p).to(dtype)


def _fc1(x, lay: ExpertLayout, fc1_weight, fc1_bias, acc, recipe) -> Tensor:
    """h in the accumulation dtype for the routed rows (T, N1)."""
    x_op = _operand(x[: lay.total], acc, recipe, -1)
    h_acc = lay.unpad(torch.bmm(lay.pad(x_op), _weight(fc1_weight, acc, recipe, -1).transpose(1, 2)))
    if fc1_bias is not None:
        h_acc = h_acc + fc1_bias.to(acc)[lay.expert]
    return h_acc


def grouped_fc1(x, splits, fc1_weight, fc1_bias, cfg: MLPConfig) -> Tensor:
    """h (M, N1) in x.dtype alone: the recomputation of FC1 in backward (recompute_fc1=True)."""
    lay = ExpertLayout(splits, x.shape[0], x.device)
    return lay.full(_fc1(x, lay, fc1_weight, fc1_bias, _acc_dtype(x.dtype), cfg.recipe), x.dtype)


def grouped_mlp_fwd(
    x: Tensor,  # (M, H), rows grouped by expert
    splits: Tensor,  # (E,) rows per expert
    probs: Optional[Tensor],  # (M,) or None
    fc1_weight: Tensor,  # (E, N1, H)
    fc2_weight: Tensor,  # (E, H, F)
    fc1_bias: Optional[Tensor],  # (E, N1)
    fc2_bias: Optional[Tensor],  # (E, H)
    cfg: MLPConfig,
) -> tuple[Tensor, Tensor]:
    """Returns y (M, H) in x.dtype and h (M, N1) in x.dtype, the pre-activation kept for backward."""
    acc = _acc_dtype(x.dtype)
    recipe = cfg.recipe
    lay = ExpertLayout(splits, x.shape[0], x.device)
    T = lay.total
    e = lay.expert

    h_acc = _fc1(x, lay, fc1_weight, fc1_bias, acc, recipe)
    p = probs[:T].to(acc) if probs is not None else None  # exact upcast; fp32 stays fp32

    z = activate(h_acc, cfg)  # from the unrounded accumulator
    if p is not None:
        z = z * p[:, None]
    z_op = z.to(x.dtype).to(acc) if recipe is None else recipe.qdq(z, -1)  # round(z)
    y_acc = lay.unpad(torch.bmm(lay.pad(z_op), _weight(fc2_weight, acc, recipe, -1).transpose(1, 2)))
    if fc2_bias is not None:
        b2 = fc2_bias.to(acc)[e]
        y_acc = y_acc + (b2 * p[:, None] if (cfg.scale_fc2_bias and p is not None) else b2)
    return lay.full(y_acc, x.dtype), lay.full(h_acc, x.dtype)


def grouped_mlp_bwd(
    dy: Tensor,  # (M, H)
    x: Tensor,  # (M, H)
    h: Tensor,  # (M, N1), the stored pre-activation
    splits: Tensor,
    probs: Optional[Tensor],
    fc1_weight: Tensor,
    fc2_weight: Tensor,
    fc1_bias: Optional[Tensor],
    fc2_bias: Optional[Tensor],
    cfg: MLPConfig,
    needs: tuple[bool, bool, bool, bool, bool, bool],  # dx, dprobs, dw1, dw2, db1, db2
    wgrad_dtype: Optional[torch.dtype] = None,  # dW1/dW2 dtype; None = the weights' (fp32 for main_grad)
) -> tuple[Optional[Tensor], ...]:
    """Returns (dx, dprobs, dfc1_weight, dfc2_weight, dfc1_bias, dfc2_bias); None where not needed."""
    need_dx, need_dprobs, need_dw1, need_dw2, need_db1, need_db2 = needs
    need_dprobs = need_dprobs and probs is not None
    need_db1 = need_db1 and fc1_bias is not None
    need_db2 = need_db2 and fc2_bias is not None
    acc = _acc_dtype(x.dtype)
    recipe = cfg.recipe
    lay = ExpertLayout(splits, x.shape[0], x.device)
    T = lay.total
    e = lay.expert
    dy_v = dy[:T]
    h_acc = h[:T].to(acc)
    p = probs[:T].to(acc) if probs is not None else None

    dx = dprobs = dw1 = dw2 = db1 = db2 = None
    if need_dw2 or need_db2:
        dy_p = lay.pad(dy_v.to(acc))  # (E, C, H)
        if need_db2:
            scaled = cfg.scale_fc2_bias and p is not None
            db2 = lay.pad(dy_v.to(acc) * p[:, None]).sum(1) if scaled else dy_p.sum(1)
            db2 = db2.to(fc2_bias.dtype)
        if need_dw2:
            z = activate(h_acc, cfg)  # recomputed from the stored h
            if p is not None:
                z = z * p[:, None]
            if recipe is None:
                dy_op, z_op = dy_p, lay.pad(z.to(x.dtype).to(acc))
            else:
                dy_q, z_q = recipe.qdq_wgrad(dy_v, z, splits)
                dy_op, z_op = lay.pad(dy_q), lay.pad(z_q)
            dw2 = _wgrad(dy_op, z_op, fc2_weight, wgrad_dtype or fc2_weight.dtype)

    if need_dx or need_dprobs or need_dw1 or need_db1:
        dy_op = _operand(dy_v, acc, recipe, -1)
        g_z = lay.unpad(torch.bmm(lay.pad(dy_op), _weight(fc2_weight, acc, recipe, -2)))  # (T, F)
        if need_dprobs:
            a = activate(h_acc, cfg)
            dp = (g_z * a).sum(-1)  # fp32 from fp32 g_z and a: nothing rounded first
            if cfg.scale_fc2_bias and fc2_bias is not None:
                dp = dp + (dy_v.to(acc) * fc2_bias.to(acc)[e]).sum(-1)
            dprobs = lay.full(dp, probs.dtype)  # the one store; no cast for fp32 probs
        if need_dx or need_dw1 or need_db1:
            g_a = g_z * p[:, None] if p is not None else g_z
            g_h_acc = activate_grad(h_acc, g_a, cfg)  # (T, N1)
            g_h = g_h_acc.to(x.dtype).to(acc) if recipe is None else None  # the one rounding
            if need_dx:
                g_op = g_h if recipe is None else recipe.qdq(g_h_acc, -1)
                w1 = _weight(fc1_weight, acc, recipe, -2)
                dx = lay.full(lay.unpad(torch.bmm(lay.pad(g_op), w1)), x.dtype)
            if need_dw1 or need_db1:
                if recipe is None:
                    g_p, x_p = lay.pad(g_h), lay.pad(x[:T].to(acc))
                else:
                    g_q, x_q = recipe.qdq_wgrad(g_h_acc, x[:T], splits)
                    g_p, x_p = lay.pad(g_q), lay.pad(x_q)
                if need_dw1:
                    dw1 = _wgrad(g_p, x_p, fc1_weight, wgrad_dtype or fc1_weight.dtype)
                if need_db1:
                    g_b = g_p if recipe is None else lay.pad(g_h_acc.to(x.dtype).to(acc))
                    db1 = g_b.sum(1).to(fc1_bias.dtype)
    return dx, dprobs, dw1, dw2, db1, db2
