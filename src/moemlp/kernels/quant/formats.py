"""Element and scale arithmetic of SPEC §3's formats in Triton: fp32 in, integer codes out (e4m3,
e8m0, e2m1), the same bits as the torch reference (moemlp.recipes._formats).

Every rounding is written out in integer arithmetic on the fp32 bit pattern (e4m3 round-to-nearest-
even incl. subnormals, e8m0, e2m1 thresholds) and every division is ``tl.div_rn``: the result
then does not depend on Triton's lowering of ``/`` (not IEEE-rounded on every version), nor on the
CPU interpreter's numpy emulation. One exception, for speed: on the GPU the e4m3 element codes of
fp8_block and mxfp8 (``e4m3_code``) and their decoding (``e4m3_signed_value``) use the hardware
conversions, whose rounding is the reference's (``HW_E4M3``); nvfp4's block scales keep the integer
path (``e4m3_code_integer``). And fp8_block's two scale divisions, 448/amax and 1/scale, are written
out on the GPU (``div_448``, ``rcp_rn``): the same IEEE-rounded quotients, without ``div.rn``'s call
to its slow path, which cost the quantizer kernels half their registers.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# e4m3 rounding and decoding by the GPU's conversions (cvt.rn.satfinite.e4m3x2.f32 and back), which
# are the reference's (below); the interpreter takes the integer path (numpy's float8 emulation
# reads the NaN pattern as 480).
HW_E4M3: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
FLT_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)


@triton.jit
def abs_or_zero(x):
    """|x| with NaN -> 0: block amax ignores NaN, as TE's fmaxf reduction does."""
    return tl.where(x != x, 0.0, tl.abs(x))


@triton.jit
def e4m3_code(v):
    """fp32 -> e4m3 code bits (int32 in [0, 256)): round to nearest even, saturate to ±448,
    NaN -> 0x7F whatever its sign (TransformerEngine's code: the hardware conversion's).

    HW_E4M3: the hardware conversion (RNE; satfinite saturates |v| past 448, and every |v| that the
    reference clamps to 448 first rounds to 448 or to 480 > 448, so both give 448; subnormals on
    the 2^-9 grid; -0 and negative underflow keep the sign; every NaN gives 0x7F). A NaN's sign
    would not be worth keeping: the GPU's arithmetic drops it (an fp32 -NaN times its block scale
    comes out +NaN), so it would depend on the path. The select of 0x7F for NaN repeats what the
    conversion gives, but without it (or with the sign OR-ed in instead) triton 3.6 stored wrong
    codes in some transposed outputs (docs/DECISIONS.md, "e4m3 NaN → 0x7F whatever its sign").
    The GPU quantizer tests check it bit for bit against the reference for fp8_block and mxfp8,
    signed NaNs included."""
    if HW_E4M3:
        return tl.where(v != v, 0x7F, v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32))
    else:
        return e4m3_code_integer(v)


@triton.jit
def e4m3_code_integer(v):
    """``e4m3_code`` in integer arithmetic on the fp32 bits, on every device. nvfp4's block scales
    use it: with the hardware conversion three nvfp4 GPU quantizer tests gave codes that differ
    from the reference's (cause not found; docs/DECISIONS.md, "e4m3 by the hardware conversion")."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    is_nan = v != v
    a = tl.minimum(tl.abs(v), 448.0)  # saturation first: every |v| >= 448 codes as 448
    ab = a.to(tl.int32, bitcast=True)
    # normal e4m3 (a >= 2^-6, biased fp32 exponent >= 121): keep 3 mantissa bits, RNE on the 20
    # dropped ones, then rebias 127 -> 7
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal e4m3 (a < 2^-6): the code is a / 2^-9 rounded to nearest even (0..8; 8 is 2^-6)
    exp = ab >> 23
    mant24 = tl.where(exp > 0, (ab & 0x7FFFFF) | 0x800000, ab & 0x7FFFFF)
    shift = tl.minimum(141 - tl.maximum(exp, 1), 25)  # mant24·2^(exp-150) in units of 2^-9
    q = mant24 >> shift
    rem = mant24 & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(exp >= 121, normal, sub)
    return tl.where(is_nan, 0x7F, code | sign)


@triton.jit
def e4m3_value(code):
    """e4m3 code bits (int32, sign clear, not NaN) -> fp32."""
    exp = (code >> 3) & 0xF
    man = code & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    return tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # 2^-9


@triton.jit
def e4m3_signed_value(code):
    """e4m3 code bits (int32 in [0, 256)) -> fp32 with the sign; NaN codes (0x7F, 0xFF) -> NaN
    (HW_E4M3: the hardware conversion; else decoded from the bits: the interpreter reads the e4m3
    NaN pattern of a float8 tensor as 480)."""
    if HW_E4M3:
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    mag = e4m3_value(code & 0x7F)
    # the sign as a bit: on the GPU (triton 3.6) a select between mag and -mag gave +0.0 for code
    # 0x80, where the reference has -0
    v = (mag.to(tl.int32, bitcast=True) | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)
    return tl.where((code & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def _div_near(a, b):
    """a / b rounded to nearest even by ``div.rn.f32``'s fast path (the instructions ptxas emits for
    it on sm_90), for positive a, b with b, 1/b and a/b in [2^-100, 2^100], where that path is taken."""
    y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [b], dtype=tl.float32, is_pure=True, pack=1)
    y = tl.fma(y, tl.fma(-b, y, 1.0), y)  # one Newton step: 1/b to about half an ulp
    q = a * y
    return tl.fma(y, tl.fma(-b, q, a), q)  # the remainder's correction: a / b rounded to nearest even


@triton.jit
def _range_factor(x):
    """2^-64 for x > 2^100, 2^64 for x < 2^-100, else 1: x times it lies in [2^-100, 2^100] for the
    divisions below, where ``_div_near`` is exact (and 2^±64 is exact to scale back by)."""
    return tl.where(x > 1.2676506002282294e30, 5.421010862427522e-20,
                    tl.where(x < 7.888609052210118e-31, 1.8446744073709552e19, 1.0))  # fmt: skip


@triton.jit
def div_448(amax):
    """448 / amax rounded to nearest even, as ``tl.div_rn``, for amax ≥ 0 or NaN (0 -> Inf, Inf -> 0).

    HW_E4M3 (the GPU): ``div.rn``'s own fast path (reciprocal, one Newton step, one remainder
    correction), used where it is exact: operands scaled by 2^±64 into [2^-100, 2^100], which leaves
    the quotient exact (scaled back by one multiply, which also rounds an overflow to Inf as the
    division would); amax < 2^-120 gives Inf (448/amax > 2^128). Checked against ``tl.div_rn`` on
    every fp32 bit pattern (tests/kernels/test_quant.py, GPU)."""
    if HW_E4M3:
        f = _range_factor(amax)
        q = _div_near(448.0 + tl.zeros_like(amax), amax * f) * f
        q = tl.where(amax < 7.52316384526264e-37, float("inf"), q)  # 2^-120, and 0
        return tl.where(amax == float("inf"), 0.0, q)
    return tl.div_rn(448.0 + tl.zeros_like(amax), amax)


@triton.jit
def rcp_rn(s):
    """1 / s rounded to nearest even, as ``tl.div_rn``, for positive normal s (an fp8_block scale).

    HW_E4M3: ``_div_near`` on s scaled by 2^±64 into [2^-100, 2^100]. Past 2^126 the reciprocal is
    subnormal and scaling back rounds twice, so that candidate c is checked against the midpoints
    c ± 2^-150: the sign of 1 - s·m is exact in one fma on the scaled operands, and a wrong c is one
    subnormal ulp off. Checked against ``tl.div_rn`` on every positive normal fp32 (GPU test)."""
    if HW_E4M3:
        f = _range_factor(s)
        sf = s * f
        q = _div_near(1.0 + tl.zeros_like(s), sf) * f
        # past 2^126: q is subnormal; the midpoints around it, scaled by 2^64 (exact: 24 bits at most)
        qs = q * 1.8446744073709552e19
        half = 1.2924697071141057e-26  # 2^-150 · 2^64
        too_low = tl.fma(-sf, qs + half, 1.0) > 0.0  # 1/s above the upper midpoint
        too_high = tl.fma(-sf, qs - half, 1.0) < 0.0  # 1/s below the lower midpoint
        bits = q.to(tl.int32, bitcast=True)
        fixed = (bits + too_low.to(tl.int32) - too_high.to(tl.int32)).to(tl.float32, bitcast=True)
        return tl.where(s > 8.507059173023462e37, fixed, q)  # 2^126
    return tl.div_rn(1.0 + tl.zeros_like(s), s)


@triton.jit
def fp8_block_scale(amax, POW2: tl.constexpr, VMAX: tl.constexpr):
    """scale = 448 / amax (IEEE division); overflow -> VMAX (the source dtype's max); POW2 clears the
    mantissa; amax 0, Inf, NaN -> 1."""
    scale = div_448(amax)
    scale = tl.where(scale == float("inf"), VMAX, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)  # 0xFF800000
    bad = (amax == 0.0) | (amax == float("inf")) | (amax != amax)
    return tl.where(bad, 1.0, scale)


@triton.jit
def fp8_block_columns(x, POW2: tl.constexpr, VMAX: tl.constexpr):
    """fp8_block quantization of (R, C) fp32 values, one block per column (a weight-gradient
    operand's 128-row blocks): e4m3 code bits (R, C) int32 and the (C,) fp32 dequantization scales
    1/scale."""
    scale = fp8_block_scale(tl.max(abs_or_zero(x), axis=0), POW2, VMAX)
    codes = e4m3_code(x * scale[None, :])
    return codes, rcp_rn(scale)


@triton.jit
def e8m0_exponent(amax):
    """The biased e8m0 exponent (int32) of v = amax · fp32(1/448), SPEC §3."""
    v = amax * 0.002232142857142857  # 1/448, rounded to fp32 once as a constant
    b = v.to(tl.int32, bitcast=True)
    exp = (b >> 23) & 0xFF
    man = b & 0x7FFFFF
    bump = (man > 0) & (exp != 0xFE) & ~((exp == 0) & (man <= 0x400000))
    e = exp + bump.to(tl.int32)
    e = tl.where(v == 0.0, 0, e)
    e = tl.where(v == float("inf"), 0xFE, e)
    return tl.where(v != v, 0xFF, e)


@triton.jit
def e8m0_quant_multiplier(e):
    """2^(127 - e) in fp32 (e = 254 -> 2^-127, e = 255 -> NaN)."""
    b = tl.where(e == 254, 0x00400000, (254 - e) << 23)
    b = tl.where(e == 255, 0x7FFFFFFF, b)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def e8m0_dequant_multiplier(e):
    """2^(e - 127) in fp32 (e = 0 -> 2^-127, e = 255 -> NaN): recipes._formats.e8m0_dequant_multiplier."""
    b = tl.where(e == 0, 0x00400000, e << 23)
    b = tl.where(e == 255, 0x7FFFFFFF, b)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def nvfp4_tensor_scale(amax_t):
    """S_enc = min(2688 / amax_t, FLT_MAX) (fminf: NaN -> FLT_MAX); 1 when amax_t or S_enc is 0."""
    s = tl.div_rn(2688.0 + tl.zeros_like(amax_t), amax_t)
    s = tl.where((s != s) | (s > 3.4028234663852886e38), 3.4028234663852886e38, s)
    return tl.where((amax_t == 0.0) | (s == 0.0), 1.0, s)


@triton.jit
def nvfp4_block_scale(block_amax, s_enc):
    """(s code bits int32, inv fp32): s = e4m3(block_amax · (S_enc · fp32(1/6))),
    inv = min(1 / (float(s) · (1/S_enc)), FLT_MAX)."""
    s_code = e4m3_code_integer(block_amax * (s_enc * 0.16666666666666666))
    s_dec = tl.div_rn(1.0 + tl.zeros_like(s_enc), s_enc)
    denom = e4m3_value(s_code) * s_dec
    inv = tl.div_rn(1.0 + tl.zeros_like(denom), denom)
    inv = tl.where(inv > 3.4028234663852886e38, 3.4028234663852886e38, inv)
    return s_code, inv


@triton.jit
def e2m1_code(y):
    """fp32 -> e2m1 code (int32 in [0, 16)): round to nearest even, saturate to ±6, NaN -> 7."""
    a = tl.abs(y)
    idx = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    sign = ((y.to(tl.int32, bitcast=True) >> 28) & 8) * (y == y).to(tl.int32)
    return tl.where(y != y, 7, idx | sign)


@triton.jit
def e2m1_value(code):
    """e2m1 code (int32 in [0, 16)) -> fp32: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}."""
    m = code & 7
    mag = tl.where(m < 5, m.to(tl.float32) * 0.5, tl.where(m == 5, 3.0, tl.where(m == 6, 4.0, 6.0)))
    return (mag.to(tl.int32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)  # -0 kept


@triton.jit
def e2m1_value_rn(y):
    """``e2m1_value(e2m1_code(y))`` without the code, for the passes that write values: |y| rounded to
    nearest even with one mantissa bit (on the bits: a carry into bit 22, then the low 22 cleared) at
    |y| >= 1, to a multiple of 0.5 below (adding and taking off 1.5·2^22, where fp32's ulp is 0.5), then
    saturated to 6 and given y's sign; NaN -> +6, code 7's value. Equal bits to the code's round trip
    at every third fp32 pattern and at the ties (checked in torch, docs/DECISIONS.md)."""
    a = tl.abs(y)
    b = a.to(tl.int32, bitcast=True)
    hi = ((b + 0x1FFFFF + ((b >> 22) & 1)) & -0x400000).to(tl.float32, bitcast=True)
    lo = (a + 6291456.0) - 6291456.0
    mag = tl.minimum(tl.where(a < 1.0, lo, hi), 6.0)
    sign = y.to(tl.int32, bitcast=True) & -0x80000000
    return tl.where(y != y, 6.0, (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True))


@triton.jit
def e2m1_code_stochastic(y, u):
    """e2m1 code of y rounded up with probability (|y| − lo)/(hi − lo), decided by u < p for the
    uniform u in [0, 1); the torch reference is recipes._formats.e2m1_round_stochastic."""
    a = tl.minimum(tl.abs(y), 6.0)
    lo_idx = (
        (a >= 0.5).to(tl.int32)
        + (a >= 1.0).to(tl.int32)
        + (a >= 1.5).to(tl.int32)
        + (a >= 2.0).to(tl.int32)
        + (a >= 3.0).to(tl.int32)
        + (a >= 4.0).to(tl.int32)
        + (a >= 6.0).to(tl.int32)
    )
    lo = tl.where(lo_idx <= 4, lo_idx.to(tl.float32) * 0.5, tl.where(lo_idx == 5, 3.0, tl.where(lo_idx == 6, 4.0, 6.0)))
    # p = (a − lo) / step by the step's reciprocal: a − lo is exact (lo ≤ a ≤ 2·lo, or lo = 0) and the
    # step a power of two, so the product is the quotient; past 6 (lo_idx 7) a − lo = 0, so p = 0
    # with any factor, as the reference's p for step 0
    p = (a - lo) * tl.where(lo_idx < 4, 2.0, tl.where(lo_idx < 6, 1.0, 0.5))
    idx = lo_idx + (u < p).to(tl.int32)
    sign = ((y.to(tl.int32, bitcast=True) >> 28) & 8) * (y == y).to(tl.int32)
    return tl.where(y != y, 7, idx | sign)


@triton.jit
def block_scale_values(s, RECIPE: tl.constexpr):
    """Stored block-scale codes (uint8 / int32) -> fp32: mxfp8 e8m0 2^(s-127), nvfp4 e4m3 with the NaN
    mark 0x7F (a block holding a NaN) -> NaN."""
    s = s.to(tl.int32)
    if RECIPE == 1:
        return e8m0_dequant_multiplier(s)
    else:
        return tl.where(s == 0x7F, float("nan"), e4m3_value(s))


@triton.jit
def _mul32(x, c: tl.constexpr):
    return x * c  # uint32 arithmetic wraps mod 2^32


@triton.jit
def hash_uniform(index, value_bits):
    """Uniform fp32 in [0, 1) (multiples of 2^-24) from Wellons' lowbias32 of
    index·0x9E3779B9 + value_bits (mod 2^32): recipes._formats.hash_uniform with seed 0."""
    k = index.to(tl.uint32) * 0x9E3779B9 + value_bits.to(tl.uint32)
    k = k ^ (k >> 16)
    k = k * 0x7FEB352D
    k = k ^ (k >> 15)
    k = k * 0x846CA68B
    k = k ^ (k >> 16)
    return (k >> 8).to(tl.float32) * 5.960464477539063e-08  # 2^-24
