"""mxfp8's values of an fp32 tile in registers: 1×32 blocks along each row, code · 2^(e − 127), the
bits of ``quant.dequantized(t, mxfp8)`` on the same fp32 values. FC1's epilogue writes z so, as FC2's
operand, in place of the fp32 z and the pass that would read it.

The arithmetic is shorter than formats.py's, which serves codes and scales as outputs: here only
the values leave, so the e4m3 rounding is the hardware conversion both ways with no int32 codes,
and e8m0's two powers of two come from s = amax/448 in integer steps on s's bits. Those steps give
formats.py's (``recipes._formats``'s) exponent and multipliers for every finite or infinite amax;
formats.py's selects for NaN amax and e = 255 have nothing to do here, since the block amax is a
``max.f32`` reduction, which ignores NaN (a block of NaNs alone gives NaN values either way)."""

from __future__ import annotations

from ._compat import gl, gluon


@gluon.jit
def _e8m0_multipliers(amax):
    """2^(127 − e) and 2^(e − 127) in fp32 for amax ≥ 0 (inf included), e the e8m0 exponent of
    s = amax · fp32(1/448) (SPEC §3): s's bits rounded up to the next exponent, clamped at 254, and
    0 where s ≤ 2^-127 (subnormal s with mantissa ≤ 0x400000); the multipliers' exponent fields,
    with 2^-127 (0x400000) at e = 254 and e = 0."""
    b = (amax * 0.002232142857142857).to(gl.int32, bitcast=True)
    e = gl.minimum((b + 0x7FFFFF) >> 23, 254)
    e = gl.where(b <= 0x400000, 0, e)
    q = gl.maximum((254 - e) << 23, 0x400000).to(gl.float32, bitcast=True)
    d = gl.maximum(e << 23, 0x400000).to(gl.float32, bitcast=True)
    return q, d


@gluon.jit
def mxfp8_values(v, BM: gl.constexpr, W: gl.constexpr):
    """[BM, W] fp32 → its mxfp8 values in fp32 (exact in bf16 for every block whose amax is above
    1.75·2^-117, as ``dequantized(..., tiny_blocks_exact=False)``), W a multiple of 32, the tile's
    columns starting on a block. The e4m3 conversion rounds to nearest even and saturates to ±448
    (cvt.rn.satfinite), as formats.e4m3_code's hardware path; a NaN gives NaN."""
    NB: gl.constexpr = W // 32
    v3 = v.reshape([BM, NB, 32])
    q, d = _e8m0_multipliers(gl.max(gl.abs(v3), axis=2))
    values = (v3 * gl.expand_dims(q, 2)).to(gl.float8e4nv).to(gl.float32) * gl.expand_dims(d, 2)
    return values.reshape([BM, W])
