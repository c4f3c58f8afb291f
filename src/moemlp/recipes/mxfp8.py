"""mxfp8: e4m3 codes with one e8m0 (power-of-two) scale per 1×32 block (OCP MX, TE's rounding).

    v = amax · (1/448);  e = e8m0(v): v's biased exponent, rounded up (SPEC §3, _formats.py)
    code = e4m3(x · 2^(127 − e));  dequantize: code · 2^(e − 127)
Weights use the same 1×32 blocks along the GEMM's reduction dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import _formats as F
from ._base import QuantizedTensor, Recipe, check_float, norm_axis, scales_from_axis, scales_to_axis, to_blocks

BLOCK = 32


def quantize_blocks(xb: Tensor) -> tuple[Tensor, Tensor]:
    """xb (…, nb, 32) fp32 -> (codes e4m3 like xb, biased exponents int64 (…, nb, 1))."""
    e = F.e8m0_from_amax(F.abs_max(xb, dim=-1))
    codes = F.e4m3_encode(xb * F.e8m0_quant_multiplier(e))
    return codes, e


def _dequantize(q: QuantizedTensor) -> Tensor:
    cb, back = to_blocks(q.codes.float(), q.axis, BLOCK)
    e = scales_from_axis(q.scales, q.axis).view(torch.uint8).to(torch.int64)
    return back(cb * F.e8m0_dequant_multiplier(e)[..., None])


@dataclass(frozen=True)
class MXFP8Recipe(Recipe):
    """e4m3 with e8m0 scales, 1×32 blocks along every GEMM's reduction dim."""

    name = "mxfp8"
    block = BLOCK
    kernel_id = 1

    def _dequantizer(self, block):
        return _dequantize

    def quantize(self, x: Tensor, axis: int = -1) -> QuantizedTensor:
        """1×32 blocks along ``axis``; scales as float8_e8m0fnu (``.view(torch.uint8)`` gives e)."""
        check_float(x, "x")
        axis = norm_axis(axis, x.ndim)
        xb, back = to_blocks(x, axis, BLOCK)
        codes, e = quantize_blocks(xb)
        return QuantizedTensor(
            codes=back(codes.float()).to(torch.float8_e4m3fn),
            scales=scales_to_axis(e[..., 0].to(torch.uint8).view(torch.float8_e8m0fnu), axis),
            shape=tuple(x.shape),
            axis=axis,
            block=(BLOCK,),
            _dequantize=_dequantize,
        )

    def quantize_weight(self, w: Tensor, axis: int = -1) -> QuantizedTensor:
        """Weights: 1×32 blocks along ``axis`` (the reduction dim: -1 forward, -2 dgrad)."""
        return self.quantize(w, axis)
