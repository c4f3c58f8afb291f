"""GEMM operands of the Triton grouped MLP under each recipe (SPEC §3), in the form the grouped-GEMM
launchers take them.

Every GEMM of the MLP quantizes both operands along its reduction dim. Two ways to run that:

* native (fp8_block): e4m3 codes and fp32 block scales go to the FP8 mode of
  ``_grouped_gemm_kernel`` (forward and dgrad GEMMs) and to ``_fp8_wgrad`` (weight gradients); the
  partial sums are promoted every 128-deep step. Weights are quantized once per call in 128×128
  tiles, which serve both the forward (rows n, reduction k) and the dgrad (the same tiles read
  transposed): the dgrad takes a K-major copy of the codes, since Hopper's e4m3 wgmma reads both
  operands K-major.
* emulated (mxfp8, nvfp4): each operand becomes its dequantized values code·block_scale in bf16
  (``quantize.dequantized*``), and the bf16 kernels run on them; nvfp4's per-tensor factors
  (1/S_enc of each operand) multiply the fp32 accumulator (ACC_SCALE) before any epilogue. Exact
  for nvfp4 and for every bf16/fp16 source; from an fp32 source (z and g_h always, x and weights
  with fp32 compute) mxfp8 values of a block whose amax is ≤ 1.05e-35 can lie below bf16's
  subnormal grid and round to it (absolute error ≤ 2^-134; ``tiny_blocks_exact=False``), instead
  of running the GEMMs on fp32 operands at a fraction of the speed.

Nothing here reads a tensor's values on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import quantize as kq


def is_native(recipe) -> bool:
    from ..recipes import FP8BlockRecipe

    return isinstance(recipe, FP8BlockRecipe)


def _times(f: Optional[Tensor], g: Optional[Tensor]) -> Optional[Tensor]:
    """The product of two optional 0-d factors (one fp32 rounding), on the device."""
    if f is None:
        return g
    if g is None:
        return f
    return f * g


@dataclass
class ActOperand:
    """A of a grouped GEMM: (M, K) rows grouped by expert, quantized along K."""

    a: Tensor  # e4m3 codes (native) or dequantized values
    scales: Optional[Tensor] = None  # native: (M, ⌈K/128⌉) fp32
    factor: Optional[Tensor] = None  # nvfp4: 1/S_enc


@dataclass
class WeightOperand:
    """B of a grouped GEMM: element (n, k) of expert e at e·strides[0] + n·strides[1] + k·strides[2]."""

    b: Tensor
    strides: tuple[int, int, int]
    scales: Optional[Tensor] = None  # native: the 128×128 tile scales ...
    scale_strides: Optional[tuple[int, int, int]] = None  # ... tile (n//128, k//128) of expert e
    factor: Optional[Tensor] = None


def act(t: Tensor, recipe) -> ActOperand:
    if is_native(recipe):
        q = kq.quantize(t, recipe, axis=-1)
        return ActOperand(q.codes, scales=q.scales)
    values, factor = kq.dequantized(t, recipe, axis=-1, out_dtype=torch.bfloat16, tiny_blocks_exact=False)
    return ActOperand(values, factor=factor)


class Weight:
    """One expert weight (E, R, C) of the MLP (W1: (E, N1, H), W2: (E, H, F)), prepared lazily for
    the forward GEMM (B(n, k) = W[e, n, k]: reduction over C) and the dgrad GEMM (B(n, k) =
    W[e, k, n]: reduction over R)."""

    def __init__(self, w: Tensor, recipe):
        self.w = w
        self.recipe = recipe
        self._q = None

    def _quantized(self, transposed: bool):
        """fp8_block's tiles, with the transposed codes when the dgrad asks (one quantizer pass
        either way: the tile kernel stores both layouts)."""
        if self._q is None or (transposed and self._q.codes_t is None):
            self._q = kq.quantize_weight(self.w, self.recipe, transposed=transposed)
        return self._q

    def forward(self) -> WeightOperand:
        E, R, C = self.w.shape
        if is_native(self.recipe):
            q = self._quantized(transposed=False)
            nr, nc = q.scales.shape[1:]
            return WeightOperand(q.codes, (R * C, C, 1), q.scales, (nr * nc, nc, 1))
        values, factor = kq.dequantized_weight(
            self.w, self.recipe, dim=-1, out_dtype=torch.bfloat16, tiny_blocks_exact=False
        )
        return WeightOperand(values, (R * C, C, 1), factor=factor)

    def dgrad(self) -> WeightOperand:
        E, R, C = self.w.shape
        if is_native(self.recipe):
            q = self._quantized(transposed=True)
            nr, nc = q.scales.shape[1:]
            # (E, C, R) K-major codes from the quantizer's transposed store; tile scales read transposed
            return WeightOperand(q.codes_t, (R * C, R, 1), q.scales, (nr * nc, 1, nc))
        values, factor = kq.dequantized_weight(
            self.w, self.recipe, dim=-2, out_dtype=torch.bfloat16, tiny_blocks_exact=False
        )
        return WeightOperand(values, (R * C, 1, C), factor=factor)


def gemm_kwargs(a: ActOperand, b: WeightOperand) -> dict:
    """The recipe arguments of ``_grouped_gemm.launch_grouped_gemm`` for A @ B."""
    if a.scales is not None:
        return dict(a_scales=a.scales, b_scales=b.scales, b_scale_strides=b.scale_strides)
    return dict(acc_scale=_times(a.factor, b.factor))


def wgrad(g: Tensor, x: Tensor, splits: Tensor, recipe, out_dtype: torch.dtype, config) -> Tensor:
    """dW (E, g.shape[1], x.shape[1]) in out_dtype: dW[e] = Gq[R_e]ᵀ @ Xq[R_e], both operands
    quantized along the rows in blocks that restart at each expert's first row (g is the gradient:
    nvfp4's stochastic rounding applies to it)."""
    from . import _grouped_gemm as gg

    if is_native(recipe):
        from ._fp8_wgrad import fp8_block_grouped_wgrad

        gq = kq.quantize_wgrad(g, splits, recipe, is_grad=True, transposed=True)
        xq = kq.quantize_wgrad(x, splits, recipe, is_grad=False, transposed=True)
        return fp8_block_grouped_wgrad(gq, xq, splits, out_dtype=out_dtype)
    gv, fg = kq.dequantized_wgrad(g, splits, recipe, is_grad=True, out_dtype=torch.bfloat16, tiny_blocks_exact=False)
    xv, fx = kq.dequantized_wgrad(x, splits, recipe, is_grad=False, out_dtype=torch.bfloat16, tiny_blocks_exact=False)
    dw = torch.empty((splits.shape[0], g.shape[1], x.shape[1]), dtype=out_dtype, device=g.device)
    gg.launch_grouped_wgrad(gv, xv, splits, None, dw, None, False, config, acc_scale=_times(fg, fx))
    return dw
