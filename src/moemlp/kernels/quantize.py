"""Triton quantizers for the recipes of SPEC §3: the same codes and scales as the torch reference
(moemlp.recipes), bit for bit.

Every rounding is written out in integer arithmetic on the fp32 bit pattern (e4m3 round-to-nearest-
even incl. subnormals, e8m0, e2m1 thresholds) and every division is ``tl.div_rn``: the result
then does not depend on Triton's lowering of ``/`` (not IEEE-rounded on every version), nor on the
CPU interpreter's numpy emulation. One exception, for speed: on the GPU the e4m3 element codes of
fp8_block and mxfp8 (``e4m3_code``) and their decoding (``e4m3_signed_value``) use the hardware
conversions, whose rounding is the reference's (``HW_E4M3``; checked bit for bit on the H200);
nvfp4's block scales keep the integer path (``e4m3_code_integer``). The ``@triton.jit``
helpers (``e4m3_code``, ``fp8_block_scale``, ``e8m0_exponent``, ``nvfp4_block_scale``,
``e2m1_code``) are meant to be called from GEMM epilogues too.

Launchers:
    quantize(x, recipe, axis)     x (…, M, K) contiguous; axis -1: 1×B blocks along K (rowwise),
                                  axis -2: B×1 blocks along M (columnwise)
    quantize_weight(w, recipe)    fp8_block: 128×128 tiles of the last two dims; others: axis -1
    quantize_wgrad(t, splits, recipe, is_grad)
                                  (T, K) operand of a weight-gradient GEMM: blocks along rows that
                                  restart at each expert's first row (nvfp4: Hadamard rotation and
                                  stochastic rounding as the recipe says)
Each returns a moemlp.recipes.QuantizedTensor laid out as the torch quantizer's (wgrad: see there).

The same kernels, with DEQUANT set, quantize and dequantize in one pass for the emulated recipes
(mxfp8, nvfp4, and fp8_block's weight-gradient GEMMs), writing code·block_scale in the input's layout:
    dequantized(x, recipe, axis, out_dtype)               -> (values, factor)   ≙ recipe.qdq(x, axis)
    dequantized_weight(w, recipe, dim, out_dtype)         -> (values, factor)   ≙ recipe.qdq_weight(w, dim)
    dequantized_wgrad(t, splits, recipe, is_grad, out_dtype)
                                                          -> (values, factor)   ≙ an operand of qdq_wgrad
    exact_dtype(recipe, src_dtype)                        the out_dtype that holds the values exactly
``factor`` is nvfp4's 0-d fp32 1/S_enc (None otherwise): ``values.float() * factor`` is the reference
bit for bit. The section above ``exact_dtype`` gives the exactness argument per recipe.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = [
    "quantize",
    "quantize_weight",
    "quantize_wgrad",
    "row_blocks",
    "RowBlocks",
    "supports",
    "dequantized",
    "dequantized_weight",
    "dequantized_wgrad",
    "exact_dtype",
]

_FP8_BLOCK, _MXFP8, _NVFP4 = 0, 1, 2
# e4m3 rounding and decoding by the GPU's conversions (cvt.rn.satfinite.e4m3x2.f32 and back), which
# are the reference's (below) but for the sign of a NaN code; the interpreter takes the integer path
# (numpy's float8 emulation reads the NaN pattern as 480).
HW_E4M3: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
_ROWWISE, _COLWISE, _TILES = 1, 0, 2
FLT_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)


# --- element and scale arithmetic (fp32 in, integer codes out) ---------------------------------------


@triton.jit
def abs_or_zero(x):
    """|x| with NaN -> 0: block amax ignores NaN, as TE's fmaxf reduction does."""
    return tl.where(x != x, 0.0, tl.abs(x))


@triton.jit
def e4m3_code(v):
    """fp32 -> e4m3 code bits (int32 in [0, 256)): round to nearest even, saturate to ±448,
    NaN -> 0x7F with v's sign bit.

    HW_E4M3: the hardware conversion (RNE; satfinite saturates |v| past 448, and every |v| that the
    reference clamps to 448 first rounds to 448 or to 480 > 448, so both give 448; subnormals on
    the 2^-9 grid; -0 and negative underflow keep the sign), with the NaN code's sign set here.
    Bit-exact with the reference on the H200 for fp8_block's and mxfp8's codes (2026-11-30)."""
    if HW_E4M3:
        sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
        hw = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        return tl.where(v != v, 0x7F | sign, hw)
    else:
        return e4m3_code_integer(v)


@triton.jit
def e4m3_code_integer(v):
    """``e4m3_code`` in integer arithmetic on the fp32 bits, on every device. nvfp4's block scales
    use it: with the hardware conversion three nvfp4 GPU quantizer tests failed on the H200
    (2026-11-30, codes differing from the reference's; the cause was not found before the
    session's device time ran out, benchmarks/NOTES.md)."""
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
    return tl.where(is_nan, 0x7F, code) | sign


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
    # the sign as a bit: a select between mag and -mag came out as +0.0 for code 0x80 on the H200
    # (triton 3.6, 2026-11-30: 604 of 2590 values +0 where the reference has -0)
    v = (mag.to(tl.int32, bitcast=True) | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)
    return tl.where((code & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def fp8_block_scale(amax, POW2: tl.constexpr, VMAX: tl.constexpr):
    """scale = 448 / amax (IEEE division); overflow -> VMAX (the source dtype's max); POW2 clears the
    mantissa; amax 0, Inf, NaN -> 1."""
    scale = tl.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)
    scale = tl.where(scale == float("inf"), VMAX, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)  # 0xFF800000
    bad = (amax == 0.0) | (amax == float("inf")) | (amax != amax)
    return tl.where(bad, 1.0, scale)


@triton.jit
def fp8_block_columns(x, POW2: tl.constexpr, VMAX: tl.constexpr):
    """fp8_block quantization of (R, C) fp32 values, one block per column (a weight-gradient
    operand's 128-row blocks): e4m3 code bits (R, C) int32 and the (C,) fp32 dequantization scales
    1/scale. Shared by _wgrad_kernel and the FC2_DGRAD epilogue (_grouped_gemm._store_wgrad_codes)."""
    scale = fp8_block_scale(tl.max(abs_or_zero(x), axis=0), POW2, VMAX)
    codes = e4m3_code(x * scale[None, :])
    return codes, tl.div_rn(1.0 + tl.zeros_like(scale), scale)


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
    step = tl.where(lo_idx < 4, 0.5, tl.where(lo_idx < 6, 1.0, tl.where(lo_idx == 6, 2.0, 0.0)))
    p = tl.where(step > 0, tl.div_rn(a - lo, tl.where(step > 0, step, 1.0)), 0.0)
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
def code_values(c, RECIPE: tl.constexpr):
    """Element codes (uint8 bits: e4m3 for mxfp8, one e2m1 nibble for nvfp4) -> fp32 values; nvfp4's
    come out 2^-14 times too small (multiply the block scale by 16384, see below). For a GEMM's load
    path (_grouped_gemm, A_DQ / B_DQ): a few instructions per element.

    mxfp8: ``e4m3_signed_value`` (the hardware conversion on the GPU). nvfp4: the nibble s e1 e0 m
    placed as fp16 bits s 0000 e1 e0 m 000000000 is the e2m1 value × 2^-14 (code 1, 0.5, lands on
    fp16's subnormal 2^-15), exact in fp16 and on conversion to fp32."""
    if RECIPE == 1:
        return e4m3_signed_value(c.to(tl.int32))
    else:
        c = c.to(tl.int16)
        return (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def unpack_e2m1(packed, AXIS: tl.constexpr):
    """(R, C) bytes of e2m1 pairs (element 2j in the low nibble, 2j+1 in the high) -> the codes,
    unpacked along AXIS: 1 -> (R, 2C), 0 -> (2R, C)."""
    lo = packed & 15
    hi = packed >> 4
    pairs = tl.join(lo, hi)  # (R, C, 2)
    if AXIS == 1:
        return tl.reshape(pairs, (packed.shape[0], 2 * packed.shape[1]))
    else:
        return tl.reshape(tl.permute(pairs, (0, 2, 1)), (2 * packed.shape[0], packed.shape[1]))


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


# --- the kernel ---------------------------------------------------------------------------------------


@triton.jit
def _per_block_max(v, BM: tl.constexpr, NB: tl.constexpr, B: tl.constexpr):
    """(BM, NB·B) → (BM, NB): the max of each row's NB consecutive blocks of B."""
    return tl.max(tl.reshape(v, (BM, NB, B)), axis=2)


@triton.jit
def _per_block_spread(v, BM: tl.constexpr, NB: tl.constexpr, B: tl.constexpr):
    """(BM, NB) → (BM, NB·B): each block's value over its B elements."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], (BM, NB, B)), (BM, NB * B))


@triton.jit
def _spread(v, AXIS: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr, BK: tl.constexpr):
    """A per-block value over the tile: rowwise tiles hold NB blocks per row, (BM, NB) → (BM, BK);
    columnwise (1, BK) and 128×128 (1, 1) values broadcast as they are."""
    if AXIS == 1:
        return _per_block_spread(v, BM, NB, BK // NB)
    else:
        return v


@triton.jit
def _quantize_kernel(
    x_ptr,  # (BATCH, M, K) bf16 / fp16 / fp32, contiguous
    codes_ptr,  # uint8: (BATCH, M, K); nvfp4 packed along the block axis: (BATCH, M, ⌈K/2⌉) or (BATCH, ⌈M/2⌉, K)
    #             DEQUANT: the values code·block_scale, (BATCH, M, K) in the output dtype
    scales_ptr,  # (BATCH, M, ⌈K/B⌉) rowwise, (BATCH, ⌈M/B⌉, K) columnwise, (BATCH, ⌈M/128⌉, ⌈K/128⌉) tiles
    #              DEQUANT: nvfp4: fp32 scalar, 1/S_enc (written by program (0, 0, 0)); others unused
    amax_ptr,  # nvfp4: fp32 scalar, the NaN-ignoring amax of the whole tensor
    M,
    K,
    codes_t_ptr,  # STORE_T: uint8 (BATCH, K, M), the codes transposed over the last two dims
    RECIPE: tl.constexpr,  # 0 fp8_block, 1 mxfp8, 2 nvfp4
    AXIS: tl.constexpr,  # 1 rowwise (blocks along K), 0 columnwise (along M), 2 128×128 tiles
    BM: tl.constexpr,  # tile rows; = the block for AXIS 0 (nvfp4: half of it, even/odd rows apart)
    BK: tl.constexpr,  # tile cols; = NB blocks for AXIS 1
    NB: tl.constexpr,  # AXIS 1: blocks per tile row (a 128-wide tile: 1 fp8_block, 4 mxfp8, 8 nvfp4)
    POW2: tl.constexpr,
    VMAX: tl.constexpr,
    DEQUANT: tl.constexpr,  # write code·block_scale in x's layout instead of codes and scales
    STORE_T: tl.constexpr,  # also store the codes transposed (fp8_block, mxfp8)
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)  # int64 offsets: E·A·B passes 2^31 for large weights
    x_ptr += batch * M * K
    if RECIPE == 2 and AXIS == 0:
        # two interleaved tiles, even and odd rows, so codes pack in pairs along the block axis
        rm = pid_m * (2 * BM) + 2 * tl.arange(0, BM)
        rk = pid_k * BK + tl.arange(0, BK)
        r_step = 1
        k_step = 0
        m0 = (rm < M)[:, None] & (rk < K)[None, :]
        m1 = ((rm + r_step) < M)[:, None] & ((rk + k_step) < K)[None, :]
        off = rm.to(tl.int64)[:, None] * K + rk[None, :]
        x0 = tl.load(x_ptr + off, mask=m0, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + off + r_step * K + k_step, mask=m1, other=0.0).to(tl.float32)
        a = tl.maximum(abs_or_zero(x0), abs_or_zero(x1))
        nan = ((x0 != x0) | (x1 != x1)).to(tl.int32)
        s_enc = nvfp4_tensor_scale(tl.load(amax_ptr))
        block_amax = tl.max(a, axis=0)[None, :]
        has_nan = tl.max(nan, axis=0)[None, :]
        s_code, inv = nvfp4_block_scale(block_amax, s_enc)
        c0 = e2m1_code(x0 * inv)
        c1 = e2m1_code(x1 * inv)
        s_code = tl.where(has_nan > 0, 0x7F, s_code)
        if DEQUANT:
            # code·s is exact (≤ 6 significant bits, 2^-10 … 2688); the NaN mark (s_code 0x7F, set
            # above for a block with a NaN) makes its block NaN
            s = block_scale_values(s_code, RECIPE)
            out_ty = codes_ptr.dtype.element_ty
            v_ptr = codes_ptr + batch * M * K + off
            tl.store(v_ptr, (e2m1_value(c0) * s).to(out_ty), mask=m0)
            tl.store(v_ptr + r_step * K + k_step, (e2m1_value(c1) * s).to(out_ty), mask=m1)
            s_dec = tl.div_rn(1.0 + tl.zeros_like(s_enc), s_enc)  # the reference's 1/S_enc
            tl.store(scales_ptr, s_dec, mask=(pid_m == 0) & (pid_k == 0) & (batch == 0))
        else:
            packed = c0 | (c1 << 4)
            c_off = batch * ((M + 1) // 2) * K + (rm // 2).to(tl.int64)[:, None] * K + rk[None, :]
            tl.store(codes_ptr + c_off, packed.to(tl.uint8), mask=(rm < M)[:, None] & (rk < K)[None, :])
            s_off = batch * tl.cdiv(M, 2 * BM) * K + pid_m.to(tl.int64) * K + rk[None, :]
            tl.store(scales_ptr + s_off, s_code.to(tl.uint8), mask=(rk < K)[None, :])
    elif RECIPE == 2:
        # rowwise: NB blocks of 16 side by side in a contiguous (BM, BK) tile; codes pack in pairs
        rm = pid_m * BM + tl.arange(0, BM)
        rk = pid_k * BK + tl.arange(0, BK)
        mask = (rm < M)[:, None] & (rk < K)[None, :]
        off = rm.to(tl.int64)[:, None] * K + rk[None, :]
        x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
        s_enc = nvfp4_tensor_scale(tl.load(amax_ptr))
        block_amax = _per_block_max(abs_or_zero(x), BM, NB, BK // NB)
        has_nan = _per_block_max((x != x).to(tl.int32), BM, NB, BK // NB)
        s_code, inv = nvfp4_block_scale(block_amax, s_enc)  # (BM, NB)
        c = e2m1_code(x * _per_block_spread(inv, BM, NB, BK // NB))
        s_code = tl.where(has_nan > 0, 0x7F, s_code)
        if DEQUANT:
            # code·s is exact (≤ 6 significant bits, 2^-10 … 2688); the NaN mark (s_code 0x7F, set
            # above for a block with a NaN) makes its block NaN
            s = block_scale_values(s_code, RECIPE)
            values = e2m1_value(c) * _per_block_spread(s, BM, NB, BK // NB)
            tl.store(codes_ptr + batch * M * K + off, values.to(codes_ptr.dtype.element_ty), mask=mask)
            s_dec = tl.div_rn(1.0 + tl.zeros_like(s_enc), s_enc)  # the reference's 1/S_enc
            tl.store(scales_ptr, s_dec, mask=(pid_m == 0) & (pid_k == 0) & (batch == 0))
        else:
            c0, c1 = tl.split(tl.reshape(c, (BM, BK // 2, 2)))  # elements 2j and 2j + 1
            kp = (K + 1) // 2
            rj = pid_k * (BK // 2) + tl.arange(0, BK // 2)
            c_off = batch * M * kp + rm.to(tl.int64)[:, None] * kp + rj[None, :]
            tl.store(codes_ptr + c_off, (c0 | (c1 << 4)).to(tl.uint8), mask=(rm < M)[:, None] & (2 * rj < K)[None, :])
            nb = tl.cdiv(K, BK // NB)
            rb = pid_k * NB + tl.arange(0, NB)
            s_off = batch * M * nb + rm.to(tl.int64)[:, None] * nb + rb[None, :]
            tl.store(scales_ptr + s_off, s_code.to(tl.uint8), mask=(rm < M)[:, None] & (rb < nb)[None, :])
    else:
        rm = pid_m * BM + tl.arange(0, BM)
        rk = pid_k * BK + tl.arange(0, BK)
        mask = (rm < M)[:, None] & (rk < K)[None, :]
        off = rm.to(tl.int64)[:, None] * K + rk[None, :]
        x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
        a = abs_or_zero(x)
        if AXIS == 1:
            amax = _per_block_max(a, BM, NB, BK // NB)  # (BM, NB)
        elif AXIS == 0:
            amax = tl.max(a, axis=0)[None, :]
        else:
            amax = tl.max(tl.max(a, axis=1), axis=0) + tl.zeros((1, 1), tl.float32)
        if RECIPE == 0:
            scale = fp8_block_scale(amax, POW2, VMAX)
            codes = e4m3_code(x * _spread(scale, AXIS, BM, NB, BK))
            scale_out = tl.div_rn(1.0 + tl.zeros_like(scale), scale)  # the dequantization scale
            dequant = scale_out
        else:
            e = e8m0_exponent(amax)
            codes = e4m3_code(x * _spread(e8m0_quant_multiplier(e), AXIS, BM, NB, BK))
            scale_out = e.to(tl.uint8)
            dequant = e8m0_dequant_multiplier(e)
        if DEQUANT:
            # one fp32 product, as the reference's code · scale (exact for power-of-two scales)
            values = e4m3_signed_value(codes) * _spread(dequant, AXIS, BM, NB, BK)
            tl.store(codes_ptr + batch * M * K + off, values.to(codes_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(codes_ptr + batch * M * K + off, codes.to(tl.uint8), mask=mask)
            if STORE_T:
                off_t = rk.to(tl.int64)[:, None] * M + rm[None, :]
                mask_t = (rk < K)[:, None] & (rm < M)[None, :]
                tl.store(codes_t_ptr + batch * M * K + off_t, tl.trans(codes.to(tl.uint8)), mask=mask_t)
            if AXIS == 1:
                nb = tl.cdiv(K, BK // NB)
                rb = pid_k * NB + tl.arange(0, NB)
                s_off = batch * M * nb + rm.to(tl.int64)[:, None] * nb + rb[None, :]
                tl.store(scales_ptr + s_off, scale_out, mask=(rm < M)[:, None] & (rb < nb)[None, :])
            elif AXIS == 0:
                s_off = batch * tl.cdiv(M, BM) * K + pid_m.to(tl.int64) * K + rk[None, :]
                tl.store(scales_ptr + s_off, scale_out, mask=(rk < K)[None, :])
            else:
                nbk = tl.cdiv(K, BK)
                s_off = batch * tl.cdiv(M, BM) * nbk + pid_m * nbk + pid_k + tl.zeros((1, 1), tl.int64)
                tl.store(scales_ptr + s_off, scale_out)


@triton.jit
def _amax_kernel(
    x_ptr,  # (N,) any float dtype, contiguous
    partial_ptr,  # (cdiv(N, BLOCK),) fp32: per-program NaN-ignoring amax; reduced by the launcher
    N,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, tl.max(abs_or_zero(x), axis=0))


@triton.jit
def _butterfly(v, H: tl.constexpr, BK: tl.constexpr):
    """One stage of width H of the fast Walsh-Hadamard transform along the 16 rows of v (16, BK):
    rows i and i+H of each group of 2H become (a + b, a - b)."""
    w = tl.permute(tl.reshape(v, (16 // (2 * H), 2, H * BK)), (0, 2, 1))
    a, b = tl.split(w)
    w = tl.permute(tl.join(a + b, a - b), (0, 2, 1))
    return tl.reshape(w, (16, BK))


@triton.jit
def hadamard16_rows(x, BK: tl.constexpr):
    """x (16, BK) fp32 -> Qᵀx, Q = diag(signs)·H16/4: signs, stages of width 1, 2, 4, 8, then ·1/4,
    the order of recipes.nvfp4.hadamard16, so the rounding is the same."""
    i = tl.arange(0, 16)
    sign = tl.where(((55272 >> i) & 1) == 1, -1.0, 1.0)  # negative at TE's wgrad sign positions
    v = x * sign[:, None]
    v = _butterfly(v, 1, BK)
    v = _butterfly(v, 2, BK)
    v = _butterfly(v, 4, BK)
    v = _butterfly(v, 8, BK)
    return v * 0.25


@triton.jit
def _wgrad_kernel(
    x_ptr,  # (T, K) bf16 / fp16 / fp32 operand of a weight-gradient GEMM, rows grouped by expert
    row_start_ptr,  # (NB,) int64 first source row of each row block (unused blocks: the rows they zero)
    row_count_ptr,  # (NB,) int32 its rows (0..B; fewer for an expert's last block, 0 for unused blocks)
    codes_ptr,  # uint8 (NB·B, K); nvfp4 packed along rows: (NB·B/2, K)
    #             DEQUANT: the values code·block_scale in the source layout (T, K), output dtype
    scales_ptr,  # (NB, K): fp32 1/scale, uint8 e8m0, uint8 e4m3; DEQUANT: nvfp4 fp32 scalar 1/S_enc
    amax_ptr,  # nvfp4: fp32 scalar (AMAX_ONLY: (NB, nK) partials written instead)
    T,
    K,
    codes_t_ptr,  # STORE_T: uint8 (K, NB·B), the padded codes transposed
    RECIPE: tl.constexpr,
    B: tl.constexpr,  # rows per block: 128, 32, 16
    BK: tl.constexpr,
    POW2: tl.constexpr,
    VMAX: tl.constexpr,
    HADAMARD: tl.constexpr,  # nvfp4: rotate complete 16-row blocks
    STOCHASTIC: tl.constexpr,  # nvfp4: stochastic rounding (gradient operand)
    AMAX_ONLY: tl.constexpr,  # nvfp4 first pass: the amax of the (rotated) operand
    DEQUANT: tl.constexpr,  # write code·block_scale back to the source rows instead of codes and scales
    STORE_T: tl.constexpr,  # store the codes transposed (fp8_block, mxfp8)
    STORE_ROWS: tl.constexpr,  # store the codes in rows (P, K); off with STORE_T: the wgrad GEMM reads only codes_t
):
    pid_b = tl.program_id(0)
    pid_k = tl.program_id(1)
    start = tl.load(row_start_ptr + pid_b)
    count = tl.load(row_count_ptr + pid_b)
    r = tl.arange(0, B)
    rk = pid_k * BK + tl.arange(0, BK)
    mask = (r < count)[:, None] & (rk < K)[None, :]
    src = (start + r)[:, None] * K + rk[None, :]  # int64: T·K passes 2^31 for long batches
    x = tl.load(x_ptr + src, mask=mask, other=0.0).to(tl.float32)
    # DEQUANT: a used block writes its rows; an unused one (count 0, x all zero, values +0) zeroes
    # rows [start, start + B) past Σsplits, so every row of the output is written exactly once
    out_mask = tl.where(count > 0, r < count, start + r < T)[:, None] & (rk < K)[None, :]
    if HADAMARD:
        x = tl.where(count == 16, hadamard16_rows(x, BK), x)
    if AMAX_ONLY:
        tl.store(amax_ptr + pid_b * tl.num_programs(1) + pid_k, tl.max(tl.max(abs_or_zero(x), axis=1), axis=0))
    elif RECIPE == 2:
        s_enc = nvfp4_tensor_scale(tl.load(amax_ptr))
        block_amax = tl.max(abs_or_zero(x), axis=0)[None, :]
        has_nan = tl.max((x != x).to(tl.int32), axis=0)[None, :]
        s_code, inv = nvfp4_block_scale(block_amax, s_enc)
        if STOCHASTIC:
            u = hash_uniform(src, x.to(tl.int32, bitcast=True))
            codes = e2m1_code_stochastic(x * inv, u)
        else:
            codes = e2m1_code(x * inv)
        s_code = tl.where(has_nan > 0, 0x7F, s_code)
        if DEQUANT:
            s = tl.where(has_nan > 0, float("nan"), e4m3_value(s_code))
            tl.store(codes_ptr + src, (e2m1_value(codes) * s).to(codes_ptr.dtype.element_ty), mask=out_mask)
            s_dec = tl.div_rn(1.0 + tl.zeros_like(s_enc), s_enc)  # the reference's 1/S_enc
            tl.store(scales_ptr, s_dec, mask=(pid_b == 0) & (pid_k == 0))
        else:
            c0, c1 = tl.split(tl.permute(tl.reshape(codes, (B // 2, 2, BK)), (0, 2, 1)))  # even, odd rows
            rp = pid_b.to(tl.int64) * (B // 2) + tl.arange(0, B // 2)
            tl.store(codes_ptr + rp[:, None] * K + rk[None, :], (c0 | (c1 << 4)).to(tl.uint8), mask=(rk < K)[None, :])
            tl.store(scales_ptr + pid_b.to(tl.int64) * K + rk[None, :], s_code.to(tl.uint8), mask=(rk < K)[None, :])
    else:
        if RECIPE == 0:
            codes, dequant = fp8_block_columns(x, POW2, VMAX)
            scale_out = dequant[None, :]
            dequant = scale_out
        else:
            e = e8m0_exponent(tl.max(abs_or_zero(x), axis=0)[None, :])
            codes = e4m3_code(x * e8m0_quant_multiplier(e))
            scale_out = e.to(tl.uint8)
            dequant = e8m0_dequant_multiplier(e)
        if DEQUANT:
            values = e4m3_signed_value(codes) * dequant
            tl.store(codes_ptr + src, values.to(codes_ptr.dtype.element_ty), mask=out_mask)
        else:
            rp = pid_b.to(tl.int64) * B + r
            if STORE_ROWS:
                tl.store(codes_ptr + rp[:, None] * K + rk[None, :], codes.to(tl.uint8), mask=(rk < K)[None, :])
            if STORE_T:
                P = tl.num_programs(0).to(tl.int64) * B
                tl.store(codes_t_ptr + rk.to(tl.int64)[:, None] * P + rp[None, :], tl.trans(codes.to(tl.uint8)),
                         mask=(rk < K)[:, None])
            tl.store(scales_ptr + pid_b.to(tl.int64) * K + rk[None, :], scale_out, mask=(rk < K)[None, :])


# --- launchers ------------------------------------------------------------------------------------------


def supports(recipe) -> bool:
    from ..recipes import FP8BlockRecipe, MXFP8Recipe, NVFP4Recipe

    return isinstance(recipe, (FP8BlockRecipe, MXFP8Recipe, NVFP4Recipe))


def recipe_id(recipe) -> int:
    """The kernels' RECIPE constexpr of a recipe: 0 fp8_block, 1 mxfp8, 2 nvfp4."""
    from ..recipes import FP8BlockRecipe, MXFP8Recipe, NVFP4Recipe

    if isinstance(recipe, FP8BlockRecipe):
        return _FP8_BLOCK
    if isinstance(recipe, MXFP8Recipe):
        return _MXFP8
    if isinstance(recipe, NVFP4Recipe):
        return _NVFP4
    raise ValueError(f"recipe: expected a moemlp recipe object, got {type(recipe).__name__}")


def _check(x: Tensor, name: str) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: expected bf16, fp16 or fp32, got {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"{name}: expected at least 2 dims, got shape {tuple(x.shape)}")
    # the kernel indexes rows with the shape's own strides; copying a view here would hide a pass
    if not x.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def tensor_amax(x: Tensor) -> Tensor:
    """fp32 0-d NaN-ignoring amax of all of x (two passes: per-program partials, then torch.amax,
    a fixed-order reduction; no host read)."""
    n = x.numel()
    block = 4096
    partial = torch.zeros(max(triton.cdiv(n, block), 1), dtype=torch.float32, device=x.device)
    if n:
        _amax_kernel[(triton.cdiv(n, block),)](x.reshape(-1), partial, n, BLOCK=block)
    return partial.amax()


def _vmax(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _block_axis(x: Tensor, axis: int, name: str = "axis") -> bool:
    """True for blocks along the last dim (rowwise), False for the second to last (columnwise)."""
    if isinstance(axis, bool) or not isinstance(axis, int) or axis not in (-1, -2, x.ndim - 1, x.ndim - 2):
        raise ValueError(f"{name}: the Triton quantizer blocks along dim -1 or -2, got {axis}")
    return axis % x.ndim == x.ndim - 1


# Tiles of _quantize_kernel for 1-D blocks: rowwise (rows, columns, warps), columnwise (columns,
# warps); the columns of a rowwise tile are a multiple of every recipe's block (128: 1 fp8_block,
# 4 mxfp8, 8 nvfp4 blocks side by side). The H200 ran nvfp4's former 32×(8+8) interleaved tiles at
# 263 GB/s and mxfp8's 32×32 at ~1.5 TB/s (2026-11-30); benchmarks/bench_quantizer_tiles.py sweeps.
ROW_TILE = (32, 128, 4)
# _wgrad_kernel: rows per block -> (columns per program, warps). Measured on the H200 (2026-11-30,
# benchmarks/bench_wgrad_quantizer.py, the four wgrad operands of mixtral-8x7b / deepseek-v3-ep8, bits
# equal for every tile): fp8_block's 128-row blocks 32 columns at 4 warps, 2.76 -> 1.35 / 2.32 ->
# 1.23 ms against the earlier 128 columns at 8 warps (143 registers: one CTA per SM; 32×4 takes ~120,
# several CTAs per SM keep more loads in flight); mxfp8's 32-row blocks 64 columns at 2 warps, 1.44 ->
# 1.34 / 1.08 -> 1.00 ms. nvfp4's 16-row blocks (Hadamard) were not swept. Settable for that bench.
WGRAD_TILE = {128: (32, 4), 32: (64, 2), 16: (128, 8)}
COL_TILE = (64, 4)


def _block_grid(x: Tensor, rid: int, block: int, rowwise: bool) -> tuple[tuple[int, int, int], int, int, int, int]:
    """(grid, BM, BK, NB, num_warps) of _quantize_kernel for 1-D blocks. Rowwise: ROW_TILE, NB
    blocks side by side. Columnwise: one block of rows per tile, COL_TILE's columns (nvfp4: two
    interleaved half-tiles, even and odd rows, so codes pack along the block axis)."""
    M, K = x.shape[-2:]
    batch = x.numel() // max(M * K, 1)
    if rowwise:
        bm, bk, warps = ROW_TILE
        nb = max(1, bk // block)
        return (triton.cdiv(M, bm), triton.cdiv(K, nb * block), batch), bm, nb * block, nb, warps
    bk, warps = COL_TILE
    if rid == _NVFP4:
        return (triton.cdiv(M, block), triton.cdiv(K, bk), batch), block // 2, bk, 1, warps
    return (triton.cdiv(M, block), triton.cdiv(K, bk), batch), block, bk, 1, warps


def quantize(x: Tensor, recipe, axis: int = -1):
    """Blocks along the last dim (axis -1) or the second to last (axis -2) of a contiguous x."""
    from ..recipes import QuantizedTensor, fp8_block, mxfp8, nvfp4

    _check(x, "x")
    rowwise = _block_axis(x, axis)
    axis = axis % x.ndim
    rid = recipe_id(recipe)
    block = recipe.block
    M, K = x.shape[-2:]
    lead = tuple(x.shape[:-2])
    nb = triton.cdiv(K if rowwise else M, block)
    scale_dtype = torch.float32 if rid == _FP8_BLOCK else torch.uint8
    scales = torch.empty(lead + ((M, nb) if rowwise else (nb, K)), dtype=scale_dtype, device=x.device)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    if rid == _NVFP4:
        amax = tensor_amax(x)
        codes = torch.empty(
            lead + ((M, (K + 1) // 2) if rowwise else ((M + 1) // 2, K)), dtype=torch.uint8, device=x.device
        )
    else:
        codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    grid, bm, bk, nblk, warps = _block_grid(x, rid, block, rowwise)
    if x.numel():
        _quantize_kernel[grid](
            x, codes, scales, amax, M, K, codes, STORE_T=False,
            RECIPE=rid, AXIS=_ROWWISE if rowwise else _COLWISE, BM=bm, BK=bk, NB=nblk,
            POW2=bool(getattr(recipe, "pow2_scales", False)), VMAX=_vmax(x.dtype), DEQUANT=False, num_warps=warps,
        )  # fmt: skip
    if rid == _NVFP4:
        return QuantizedTensor(
            codes=codes, scales=scales.view(torch.float8_e4m3fn), shape=tuple(x.shape), axis=axis,
            block=(block,), _dequantize=nvfp4._dequantize, tensor_scale=nvfp4_scale_from_amax(amax),
        )  # fmt: skip
    if rid == _MXFP8:
        return QuantizedTensor(
            codes=codes.view(torch.float8_e4m3fn), scales=scales.view(torch.float8_e8m0fnu), shape=tuple(x.shape),
            axis=axis, block=(block,), _dequantize=mxfp8._dequantize,
        )  # fmt: skip
    return QuantizedTensor(
        codes=codes.view(torch.float8_e4m3fn), scales=scales, shape=tuple(x.shape), axis=axis,
        block=(block,), _dequantize=fp8_block._dequantize_rows,
    )  # fmt: skip


def nvfp4_scale_from_amax(amax: Tensor) -> Tensor:
    from ..recipes import _formats

    return _formats.nvfp4_tensor_scale(amax)


# A 128×128 tile per program holds 16k fp32 values: at 4 warps 128 per thread, and the H200 ran the
# mixtral W1 pass at 879 GB/s (3.21 ms); 8 warps 1054 GB/s, 16 warps 1580 GB/s (1.78 ms), 2026-11-30.
_TILE_WARPS = 16


def quantize_weight(w: Tensor, recipe, transposed: bool = False):
    """fp8_block: 128×128 tiles over the last two dims; mxfp8, nvfp4: blocks along the last dim.
    ``transposed`` (fp8_block): also the codes transposed over the last two dims (``codes_t``), the
    K-major B of the dgrad GEMM, stored from the tile instead of by a separate transpose (the H200
    copied mixtral's W1 codes with torch at 323 GB/s, 5.8 ms, 2026-11-30)."""
    from ..recipes import QuantizedTensor, fp8_block

    if recipe_id(recipe) != _FP8_BLOCK:
        if transposed:
            raise ValueError("transposed: only fp8_block's 128x128 tiles serve both orientations")
        return quantize(w, recipe, axis=-1)
    _check(w, "w")
    M, K = w.shape[-2:]
    batch = w.numel() // max(M * K, 1)
    lead = tuple(w.shape[:-2])
    codes = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    codes_t = torch.empty(lead + (K, M), dtype=torch.uint8, device=w.device) if transposed else None
    scales = torch.empty(lead + (triton.cdiv(M, 128), triton.cdiv(K, 128)), dtype=torch.float32, device=w.device)
    if w.numel():
        grid = (triton.cdiv(M, 128), triton.cdiv(K, 128), batch)
        _quantize_kernel[grid](
            w, codes, scales, scales, M, K, codes_t if transposed else codes, STORE_T=transposed,
            RECIPE=_FP8_BLOCK, AXIS=_TILES, BM=128, BK=128, NB=1,
            POW2=bool(recipe.pow2_scales), VMAX=_vmax(w.dtype), DEQUANT=False, num_warps=_TILE_WARPS,
        )  # fmt: skip
    return QuantizedTensor(
        codes=codes.view(torch.float8_e4m3fn), scales=scales, shape=tuple(w.shape), axis=-1,
        block=(128, 128), _dequantize=fp8_block._dequantize_tiles,
        codes_t=codes_t.view(torch.float8_e4m3fn) if transposed else None,
    )  # fmt: skip


class RowBlocks(NamedTuple):
    """The expert-aligned row blocks of T-row weight-gradient operands (``row_blocks``): the same
    for every operand of one backward with the same splits, rows and recipe block, so a backward
    computes it once and passes it to each ``quantize_wgrad`` / ``dequantized_wgrad``."""

    start: Tensor  # (NB,) int64 first source row of each block (unused blocks: the rows they zero)
    count: Tensor  # (NB,) int32 rows of each block
    rows: Tensor  # (T,) int64 padded row of each source row, -1 past Σsplits
    nb: int  # NB = ⌈T/B⌉ + E
    block: int  # B


def row_blocks(splits: Tensor, num_rows: int, block: int, device=None) -> RowBlocks:
    """The row-block layout of (num_rows, ·) wgrad operands quantized in ``block``-row blocks with
    ``splits`` (torch ops on the device, no host read)."""
    device = splits.device if device is None else device
    return RowBlocks(*_row_blocks(splits, num_rows, block, device), block)


def _row_blocks(splits: Tensor, num_rows: int, block: int, device) -> tuple[Tensor, Tensor, Tensor, int]:
    """The expert-aligned row blocks of a (T, K) wgrad operand, with torch ops on the device (no
    host read): block p covers padded rows [p·B, p·B + B) and source rows [start, start + count);
    NB = ⌈T/B⌉ + E blocks is the worst case. Returns (start int64, count int32, rows int64, NB)
    where rows[t] is source row t's padded row, -1 past Σsplits (recipes' ExpertRows layout).

    The U = Σ⌈s_e/B⌉ used blocks come first; unused block p ≥ U has count 0 and start Σsplits + (p − U)·B:
    the rows past Σsplits that the dequantizing pass zeroes. They reach T: U ≤ ⌊Σs/B⌋ + E, so
    (NB − U)·B ≥ (⌈T/B⌉ − ⌊Σs/B⌋)·B ≥ T − Σs."""
    s = splits.to(device=device, dtype=torch.int64)
    num_experts = s.numel()
    nb = triton.cdiv(num_rows, block) + num_experts
    ends = torch.cumsum(s, 0)
    starts = ends - s
    blocks = (s + block - 1) // block
    first_block = torch.cumsum(blocks, 0) - blocks
    p = torch.arange(nb, device=device)
    e = torch.searchsorted(first_block + blocks, p, right=True)
    valid = e < num_experts
    ec = e.clamp(max=max(num_experts - 1, 0))
    start = starts[ec] + (p - first_block[ec]) * block
    count = torch.where(valid, (ends[ec] - start).clamp(0, block), torch.zeros_like(start))
    tail = s.sum() + (p - blocks.sum()) * block  # unused blocks: rows past Σsplits
    start = torch.where(valid, start, tail)
    t = torch.arange(num_rows, device=device)
    et = torch.searchsorted(ends, t, right=True)
    etc = et.clamp(max=max(num_experts - 1, 0))
    rows = first_block[etc] * block + t - starts[etc]
    rows = torch.where(et < num_experts, rows, torch.full_like(rows, -1))
    return start.contiguous(), count.to(torch.int32).contiguous(), rows, nb


def _wgrad_launch(
    t: Tensor, splits: Tensor, recipe, is_grad: bool, out: Tensor | None, transposed: bool = False, blocks=None
):
    """Both passes of a wgrad operand: nvfp4's amax pass, then the codes and scales (``out`` None) or
    the values written into ``out`` (T, K). Returns (codes, scales, rows, amax, factor, codes_t), the
    unused ones None: factor is nvfp4's 1/S_enc for ``out``; codes_t the (K, P) transposed codes.
    ``blocks``: the ``row_blocks`` of these splits, rows and block, computed once by the caller."""
    rid = recipe_id(recipe)
    B = recipe.block
    T, K = t.shape
    if blocks is None:
        blocks = row_blocks(splits, T, B, t.device)
    elif not isinstance(blocks, RowBlocks):
        raise TypeError(f"blocks: expected a RowBlocks from row_blocks(), got {type(blocks).__name__}")
    elif blocks.block != B or blocks.rows.shape[0] != T or blocks.nb != triton.cdiv(T, B) + splits.shape[0]:
        raise ValueError(
            f"blocks: made for {blocks.rows.shape[0]} rows in {blocks.block}-row blocks ({blocks.nb} blocks); this "
            f"operand has {T} rows, {recipe.name}'s {B}-row blocks and {splits.shape[0]} experts"
        )
    elif blocks.start.device != t.device:
        raise TypeError(f"blocks: expected tensors on {t.device}, got {blocks.start.device}")
    start, count, rows, nb, _ = blocks
    bk, warps = WGRAD_TILE[B]
    grid = (nb, triton.cdiv(K, bk))
    hadamard = rid == _NVFP4 and recipe.hadamard
    stochastic = rid == _NVFP4 and recipe.stochastic_rounding and is_grad
    pow2 = bool(getattr(recipe, "pow2_scales", False))
    common = dict(RECIPE=rid, B=B, BK=bk, POW2=pow2, VMAX=_vmax(t.dtype), HADAMARD=hadamard, STOCHASTIC=stochastic,
                  num_warps=warps)
    codes = scales = factor = codes_t = None
    if out is None:
        scales = torch.empty((nb, K), dtype=torch.float32 if rid == _FP8_BLOCK else torch.uint8, device=t.device)
        if transposed:  # the codes are only stored transposed; ``codes`` is codes_t's transposed view
            codes_t = torch.empty((K, nb * B), dtype=torch.uint8, device=t.device)
            codes = codes_t.t()
        else:
            codes = torch.empty((nb * B // (2 if rid == _NVFP4 else 1), K), dtype=torch.uint8, device=t.device)
    elif rid == _NVFP4:
        factor = torch.empty((), dtype=torch.float32, device=t.device)
    amax = torch.zeros((), dtype=torch.float32, device=t.device)
    # With no rows (T = 0) the launch still runs: every block is padding, so it writes code 0 and an
    # empty block's scale, as the reference does (the outputs are never left uninitialized).
    if K > 0 and nb > 0:
        if rid == _NVFP4:
            partial = torch.empty(grid, dtype=torch.float32, device=t.device)
            _wgrad_kernel[grid](
                t, start, count, partial, partial, partial, T, K, partial, AMAX_ONLY=True, DEQUANT=False,
                STORE_T=False, STORE_ROWS=False, **common,
            )  # fmt: skip
            amax = partial.amax()
        if out is None:
            _wgrad_kernel[grid](
                t, start, count, codes, scales, amax, T, K, codes_t if transposed else codes, AMAX_ONLY=False,
                DEQUANT=False, STORE_T=transposed, STORE_ROWS=not transposed, **common,
            )  # fmt: skip
        else:
            s_dec = factor if factor is not None else out
            _wgrad_kernel[grid](
                t, start, count, out, s_dec, amax, T, K, out, AMAX_ONLY=False, DEQUANT=True, STORE_T=False,
                STORE_ROWS=False, **common,
            )  # fmt: skip
    elif factor is not None:
        factor.fill_(1.0)  # no columns: amax 0, S_enc 1
    return codes, scales, rows, amax, factor, codes_t


def quantize_wgrad(
    t: Tensor, splits: Tensor, recipe, is_grad: bool = False, transposed: bool = False, blocks: RowBlocks | None = None
):
    """A (T, K) weight-gradient operand, blocks along rows restarting at each expert's first row, in
    the expert-aligned padded layout of ``recipe.quantize_wgrad`` (same codes, scales and rows).
    ``transposed``: the codes stored as (K, P) ``codes_t`` only (fp8_block and mxfp8), for the fp8
    wgrad GEMM's K-major operands; ``codes`` is then its transposed view. ``blocks``: ``row_blocks(splits,
    T, recipe.block)``, when the caller quantizes several operands with the same splits."""
    from ..recipes import QuantizedTensor, fp8_block, mxfp8, nvfp4

    _check_wgrad(t, splits)
    rid = recipe_id(recipe)
    if transposed and rid == _NVFP4:
        raise ValueError("transposed: nvfp4 codes are packed in pairs along the rows; no transposed copy")
    B = recipe.block
    codes, scales, rows, amax, _, codes_t = _wgrad_launch(t, splits, recipe, is_grad, None, transposed, blocks)
    codes_t = codes_t.view(torch.float8_e4m3fn) if codes_t is not None else None
    shape = (codes.shape[0] * (2 if rid == _NVFP4 else 1), t.shape[1])
    if rid == _NVFP4:
        return QuantizedTensor(
            codes=codes, scales=scales.view(torch.float8_e4m3fn), shape=shape, axis=0, block=(B,),
            _dequantize=nvfp4._dequantize, tensor_scale=nvfp4_scale_from_amax(amax), rows=rows,
        )  # fmt: skip
    if rid == _MXFP8:
        return QuantizedTensor(
            codes=codes.view(torch.float8_e4m3fn), scales=scales.view(torch.float8_e8m0fnu), shape=shape,
            axis=0, block=(B,), _dequantize=mxfp8._dequantize, rows=rows, codes_t=codes_t,
        )  # fmt: skip
    return QuantizedTensor(
        codes=codes.view(torch.float8_e4m3fn), scales=scales, shape=shape, axis=0, block=(B,),
        _dequantize=fp8_block._dequantize_rows, rows=rows, codes_t=codes_t,
    )  # fmt: skip


def _check_wgrad(t: Tensor, splits: Tensor) -> None:
    _check(t, "t")
    if t.ndim != 2:
        raise ValueError(f"t: expected a (T, K) operand, got shape {tuple(t.shape)}")
    if splits.device != t.device:
        raise TypeError(f"splits: expected a tensor on {t.device}, got {splits.device}")


# --- quantize-dequantize to exact values (the emulated recipes' GEMM operands) ---------------------------
#
# mxfp8 and nvfp4 have no tensor-core instruction on Hopper, and fp8_block's weight-gradient GEMMs run
# unscaled: each operand becomes its dequantized values code·block_scale, written once by the same
# kernels in x's own layout, and a bf16 grouped GEMM multiplies them exactly (fp32 accumulation).
# nvfp4's per-tensor 1/S_enc is not folded in: it comes back as ``factor`` for the GEMM to apply to
# its fp32 accumulator; the reference dequantizes (code·s)·(1/S_enc) left to right, so
# ``values.float() * factor`` is that reference bit for bit.
#
# Which dtype holds the values exactly (``exact_dtype``):
#   nvfp4       e2m1 × e4m3: ≤ 6 significant bits in [2^-10, 2688]: bf16 and fp16, any source.
#   mxfp8, fp8_block (pow2_scales=True)
#               code × 2^(−k): 4 significant bits, lowest bit 2^(−9−k). bf16's grid ends at 2^-133
#               (its smallest subnormal), so bf16 holds every value of a block whose scale 2^k is at
#               most 2^124: block amax > 448·2^-125 = 1.75·2^-117 ≈ 1.0532429e-35 (fp32 0x05600000;
#               for both recipes, measured: at that amax mxfp8's exponent is 2 and fp8_block's scale
#               2^125, one fp32 ulp above it 3 and 2^124), or amax 0 / Inf (NaN is ignored).
#               Below it a code finer than 2^-133 appears (2^-134 = 2^-9·2^-125, exact in fp32).
#               A bf16 or fp16 source never gets there: its elements are multiples of 2^-133, and a
#               power-of-two scale either keeps a value on a grid at least that coarse or leaves it
#               as the source element itself. So bf16 for bf16/fp16 sources, fp32 for fp32 ones
#               (exact in fp32: 2^-136 ≥ fp32's 2^-149). fp16 is too narrow (448·2^k passes 65504).
#   fp8_block (pow2_scales=False)
#               code × fp32(1/scale): up to 4 + 24 significant bits, rounded once in fp32 as the
#               reference rounds it: fp32 only.

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def exact_dtype(recipe, src_dtype: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The narrowest of bf16 / fp32 that holds every dequantized value of ``recipe`` exactly for a
    source of ``src_dtype`` (the table above): bf16 for nvfp4; bf16 for mxfp8 and fp8_block with
    power-of-two scales from a bf16/fp16 source, fp32 from an fp32 one; fp32 for fp8_block with
    pow2_scales=False."""
    rid = recipe_id(recipe)
    if rid == _NVFP4:
        return torch.bfloat16
    if rid == _FP8_BLOCK and not recipe.pow2_scales:
        return torch.float32
    return torch.bfloat16 if src_dtype in (torch.bfloat16, torch.float16) else torch.float32


def _check_out_dtype(recipe, src_dtype: torch.dtype, out_dtype, tiny_blocks_exact: bool = True) -> None:
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    rid = recipe_id(recipe)
    if out_dtype == torch.float32 or (rid == _NVFP4 and out_dtype == torch.float16):
        return
    if out_dtype == torch.bfloat16 and exact_dtype(recipe, src_dtype) == torch.bfloat16:
        return
    if out_dtype == torch.bfloat16 and not tiny_blocks_exact and not (rid == _FP8_BLOCK and not recipe.pow2_scales):
        return  # the caller accepts the tiny-block rounding below (see ``dequantized``)
    if rid == _FP8_BLOCK and not recipe.pow2_scales:
        why = "code·(1/scale) has up to 28 significant bits without power-of-two scales"
    elif out_dtype == torch.float16:
        why = "the values reach 448·2^k, far outside fp16's range"
    else:
        why = (
            f"from a {src_dtype} source, a block with amax ≤ 1.75·2^-117 (≈1.05e-35) has values on a grid "
            "finer than bf16's smallest subnormal 2^-133"
        )
    raise ValueError(
        f"out_dtype: {out_dtype} cannot hold {recipe.key}'s dequantized values exactly ({why}); "
        f"use out_dtype={exact_dtype(recipe, src_dtype)} (exact_dtype(recipe, src_dtype))"
    )


def _factor(rid: int, device) -> Tensor | None:
    """nvfp4: the 0-d fp32 that the kernel fills with 1/S_enc; None for the other recipes."""
    return torch.empty((), dtype=torch.float32, device=device) if rid == _NVFP4 else None


def dequantized(
    x: Tensor, recipe, axis: int = -1, out_dtype: torch.dtype = torch.bfloat16, tiny_blocks_exact: bool = True
):
    """(values, factor): x quantized with 1-D blocks along ``axis`` (-1 or -2) and dequantized to
    code·block_scale in ``out_dtype``, x's shape; ``factor`` the 0-d fp32 1/S_enc (nvfp4) or None.
    ``values.float() * factor`` (or ``values.float()``) is ``recipe.qdq(x, axis)`` bit for bit.
    One pass over x (nvfp4: after the tensor amax pass); no host read.

    ``tiny_blocks_exact=False`` lets an fp32 source dequantize onto bf16 under mxfp8 and pow2
    fp8_block: exact for every block whose amax is above 1.75·2^-117 (≈1.05e-35); in a block at or
    below it, values finer than bf16's smallest subnormal round to its 2^-133 grid (absolute error
    ≤ 2^-134). The Triton grouped MLP takes that for z and g_h (fp32 epilogue outputs) rather than
    run its emulated GEMMs on fp32 operands."""
    _check(x, "x")
    rowwise = _block_axis(x, axis)
    rid = recipe_id(recipe)
    _check_out_dtype(recipe, x.dtype, out_dtype, tiny_blocks_exact)
    M, K = x.shape[-2:]
    values = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    factor = _factor(rid, x.device)
    amax = tensor_amax(x) if rid == _NVFP4 else x  # x: a placeholder, read by nvfp4 only
    grid, bm, bk, nblk, warps = _block_grid(x, rid, recipe.block, rowwise)
    if x.numel():
        _quantize_kernel[grid](
            x, values, factor if factor is not None else values, amax, M, K, values, STORE_T=False,
            RECIPE=rid, AXIS=_ROWWISE if rowwise else _COLWISE, BM=bm, BK=bk, NB=nblk,
            POW2=bool(getattr(recipe, "pow2_scales", False)), VMAX=_vmax(x.dtype), DEQUANT=True, num_warps=warps,
        )  # fmt: skip
    elif factor is not None:
        factor.fill_(1.0)  # no elements: amax 0, S_enc 1
    return values, factor


def dequantized_weight(
    w: Tensor, recipe, dim: int = -1, out_dtype: torch.dtype = torch.bfloat16, tiny_blocks_exact: bool = True
):
    """(values, factor) of expert weights (…, A, B): fp8_block 128×128 tiles over the last two dims
    (``dim`` checked, then ignored: one quantization serves both orientations); the others 1-D blocks
    along ``dim`` (-1 or -2), nvfp4 with one S_enc for the whole tensor. Matches
    ``recipe.qdq_weight(w, dim)`` as ``dequantized`` matches ``qdq``; ``tiny_blocks_exact`` as there."""
    _check(w, "w")
    _block_axis(w, dim, "dim")
    if recipe_id(recipe) != _FP8_BLOCK:
        return dequantized(w, recipe, axis=dim, out_dtype=out_dtype, tiny_blocks_exact=tiny_blocks_exact)
    _check_out_dtype(recipe, w.dtype, out_dtype, tiny_blocks_exact)
    M, K = w.shape[-2:]
    batch = w.numel() // max(M * K, 1)
    values = torch.empty(w.shape, dtype=out_dtype, device=w.device)
    if w.numel():
        grid = (triton.cdiv(M, 128), triton.cdiv(K, 128), batch)
        _quantize_kernel[grid](
            w, values, values, w, M, K, values, STORE_T=False, RECIPE=_FP8_BLOCK, AXIS=_TILES, BM=128, BK=128, NB=1,
            POW2=bool(recipe.pow2_scales), VMAX=_vmax(w.dtype), DEQUANT=True, num_warps=_TILE_WARPS,
        )  # fmt: skip
    return values, None


def dequantized_wgrad(
    t: Tensor,
    splits: Tensor,
    recipe,
    is_grad: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    tiny_blocks_exact: bool = True,
    blocks: RowBlocks | None = None,
):
    """(values, factor) of a (T, K) weight-gradient operand: blocks along rows restarting at each
    expert's first row (nvfp4: Hadamard rotation and, for ``is_grad``, stochastic rounding as the
    recipe says), dequantized back into t's row layout; rows past Σsplits are 0. Matches the
    corresponding operand of ``recipe.qdq_wgrad(grad, act, splits)`` (grad: is_grad=True).
    ``tiny_blocks_exact``: as in ``dequantized``; ``blocks``: as in ``quantize_wgrad``."""
    _check_wgrad(t, splits)
    _check_out_dtype(recipe, t.dtype, out_dtype, tiny_blocks_exact)
    values = torch.empty(t.shape, dtype=out_dtype, device=t.device)
    _, _, _, _, factor, _ = _wgrad_launch(t, splits, recipe, is_grad, values, blocks=blocks)
    return values, factor
