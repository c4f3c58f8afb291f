"""fp8_block: e4m3 codes, fp32 scales; 1×128 blocks for activations and gradients, 128×128 tiles
over the last two dims for weights (DeepSeek-V3's recipe, native on Hopper).

    scale = 448 / amax        (amax 0, Inf, NaN -> 1; overflow -> the source dtype's max)
    pow2_scales: clear scale's mantissa bits (a power of two, rounded down)
    code  = e4m3(x · scale)   dequantize: code · (1/scale); ``scales`` holds 1/scale
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import _formats as F
from ._base import (
    QuantizedTensor,
    Recipe,
    check_float,
    norm_axis,
    scales_from_axis,
    scales_to_axis,
    to_blocks,
    value_for_inf,
)

BLOCK = 128


def quantize_blocks(xb: Tensor, src_dtype: torch.dtype, pow2: bool, amax_dims=-1) -> tuple[Tensor, Tensor]:
    """xb fp32 with blocks spanning ``amax_dims`` -> (codes e4m3 like xb, scale_inv fp32 per block,
    keepdim over amax_dims)."""
    amax = F.abs_max(xb, dim=amax_dims)
    scale = F.fp8_block_scale(amax, pow2, value_for_inf(src_dtype))
    codes = F.e4m3_encode(xb * scale)
    scale_inv = F.f32(1.0, scale) / scale
    return codes, scale_inv


def _dequantize_rows(q: QuantizedTensor) -> Tensor:
    cb, back = to_blocks(q.codes.float(), q.axis, BLOCK)
    s = scales_from_axis(q.scales, q.axis)
    return back(cb * s[..., None])


def _dequantize_tiles(q: QuantizedTensor) -> Tensor:
    a, b = q.shape[-2:]
    cb = _tile(q.codes.float())
    out = (cb * q.scales[..., :, None, :, None]).flatten(-4, -3).flatten(-2, -1)
    return out[..., :a, :b]


def _tile(w: Tensor) -> Tensor:
    """(…, A, B) -> (…, nA, 128, nB, 128) fp32, zero-padded."""
    a, b = w.shape[-2:]
    pa, pb = -(-a // BLOCK) * BLOCK - a, -(-b // BLOCK) * BLOCK - b
    w = torch.nn.functional.pad(w.float(), (0, pb, 0, pa))
    return w.reshape(*w.shape[:-2], (a + pa) // BLOCK, BLOCK, (b + pb) // BLOCK, BLOCK)


@dataclass(frozen=True)
class FP8BlockRecipe(Recipe):
    """e4m3 with fp32 block scales: 1×128 (activations, gradients), 128×128 (weights)."""

    pow2_scales: bool = True
    name = "fp8_block"
    block = BLOCK
    kernel_id = 0
    native = True

    def _dequantizer(self, block):
        return _dequantize_tiles if len(block) == 2 else _dequantize_rows

    def quantize(self, x: Tensor, axis: int = -1) -> QuantizedTensor:
        """1×128 blocks along ``axis``."""
        check_float(x, "x")
        axis = norm_axis(axis, x.ndim)
        xb, back = to_blocks(x, axis, BLOCK)
        codes, scale_inv = quantize_blocks(xb, x.dtype, self.pow2_scales)
        return QuantizedTensor(
            codes=back(codes.float()).to(torch.float8_e4m3fn),  # exact: codes are e4m3 values
            scales=scales_to_axis(scale_inv[..., 0], axis),
            shape=tuple(x.shape),
            axis=axis,
            block=(BLOCK,),
            _dequantize=_dequantize_rows,
        )

    def quantize_weight(self, w: Tensor) -> QuantizedTensor:
        """128×128 tiles over the last two dims: one quantization serves both GEMM orientations."""
        check_float(w, "w")
        if w.ndim < 2:
            raise ValueError(f"w: expected at least 2 dims for 128x128 tiles, got shape {tuple(w.shape)}")
        a, b = w.shape[-2:]
        wt = _tile(w)
        codes, scale_inv = quantize_blocks(wt, w.dtype, self.pow2_scales, amax_dims=(-3, -1))
        codes = codes.float().flatten(-4, -3).flatten(-2, -1)[..., :a, :b].to(torch.float8_e4m3fn)
        return QuantizedTensor(
            codes=codes,
            scales=scale_inv[..., :, 0, :, 0],
            shape=tuple(w.shape),
            axis=-1,
            block=(BLOCK, BLOCK),
            _dequantize=_dequantize_tiles,
        )

    def qdq_weight(self, w: Tensor, dim: int) -> Tensor:
        return self.quantize_weight(w).dequantize()
