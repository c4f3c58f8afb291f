"""mxfp8's values of an fp32 tile in registers: 1×32 blocks along each row, code · 2^(e − 127) with
formats.py's arithmetic (the Triton quantizers' functions, called from the Gluon kernel), so the bits
of ``quant.dequantized(t, mxfp8)`` on the same fp32 values. FC1's epilogue writes z so, as FC2's
operand, in place of the fp32 z and the pass that would read it."""

from __future__ import annotations

from ..quant.formats import (
    abs_or_zero,
    e4m3_code,
    e4m3_signed_value,
    e8m0_dequant_multiplier,
    e8m0_exponent,
    e8m0_quant_multiplier,
)
from ._compat import gl, gluon


@gluon.jit
def mxfp8_values(v, BM: gl.constexpr, W: gl.constexpr):
    """[BM, W] fp32 → its mxfp8 values in fp32 (exact in bf16 for every block whose amax is above
    1.75·2^-117, as ``dequantized(..., tiny_blocks_exact=False)``), W a multiple of 32, the tile's
    columns starting on a block. The block's amax ignores NaN; a NaN gives the NaN code."""
    NB: gl.constexpr = W // 32
    v3 = v.reshape([BM, NB, 32])
    e = e8m0_exponent(gl.max(abs_or_zero(v3), axis=2))
    codes = e4m3_code(v3 * gl.expand_dims(e8m0_quant_multiplier(e), 2))
    values = e4m3_signed_value(codes) * gl.expand_dims(e8m0_dequant_multiplier(e), 2)
    return values.reshape([BM, W])
