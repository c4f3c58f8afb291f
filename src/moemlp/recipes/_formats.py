"""Element formats and scale arithmetic of SPEC §3 in torch: the bit-exact reference.

Every value here is computed in fp32 with the operation order TransformerEngine's CUDA kernels use
(common/recipe/recipe_common.cuh, util/ptx_arch_spec.cuh, cast/nvfp4/core_nvfp4.cuh), so codes and
scales agree with it bit for bit. Constants such as 1/448 and 1/6 are rounded to fp32 once and
held as fp32 0-d tensors: a Python float would reach the kernel as a double on some paths.

Block amax ignores NaN, as TE's ``fmaxf``/``__hmax`` reductions do: a NaN element stays NaN (or,
for e2m1, which has no NaN, marks its block: see nvfp4.py) and does not change its neighbours'
scale. Inf counts: an Inf in a block makes amax Inf, and the scale rules below apply.
"""

from __future__ import annotations

import torch
from torch import Tensor

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FLT_MAX = torch.finfo(torch.float32).max

# The 8 non-negative e2m1 values, indexed by the 3 magnitude bits of a code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def f32(value: float, like: Tensor) -> Tensor:
    """A 0-d fp32 tensor on like's device: the constant rounded to fp32 once."""
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def _bits(t: Tensor) -> Tensor:
    """fp32 -> its bit pattern as int64 in [0, 2^32)."""
    return t.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits(b: Tensor) -> Tensor:
    """int64 bit patterns in [0, 2^32) -> fp32."""
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def abs_max(t: Tensor, dim) -> Tensor:
    """amax(|t|) over ``dim`` (kept as size-1 dims), NaN ignored (TE's fmaxf reduction): 0 for an
    all-NaN block."""
    a = t.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(dim=dim, keepdim=True)


# --- e4m3 -----------------------------------------------------------------------------------------


def e4m3_encode(v: Tensor) -> Tensor:
    """fp32 -> float8_e4m3fn: round to nearest even, saturate to ±448, NaN -> 0x7F whatever its
    sign (the hardware conversion's code, so TransformerEngine's).

    The clamp comes first because torch's own conversion turned overflow into NaN in some
    versions; after it torch's conversion is plain RNE (checked by the tests on ties and
    subnormals). torch's conversion keeps a NaN's sign (0xFF), hence the NaN written in.
    """
    c = torch.clamp(v, -E4M3_MAX, E4M3_MAX)
    return torch.where(torch.isnan(c), torch.full_like(c, float("nan")), c).to(torch.float8_e4m3fn)


# --- fp8_block ------------------------------------------------------------------------------------


def fp8_block_scale(amax: Tensor, pow2: bool, value_for_inf: float) -> Tensor:
    """scale = 448 / amax (fp32 round-to-nearest division); amax 0, Inf or NaN -> 1.

    When 448 / amax overflows (amax below ~1.3e-36) the scale is the input dtype's largest finite
    value (TE's ``value_for_inf``), then, with ``pow2``, the mantissa bits are cleared.
    """
    scale = f32(E4M3_MAX, amax) / amax
    scale = torch.where(torch.isinf(scale), f32(value_for_inf, amax), scale)
    if pow2:
        scale = _from_bits(_bits(scale) & 0xFF800000)
    bad = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    return torch.where(bad, torch.ones_like(scale), scale)


# --- mxfp8 (e8m0) ---------------------------------------------------------------------------------


def e8m0_from_amax(amax: Tensor) -> Tensor:
    """The biased e8m0 exponent (int64 in [0, 255]) of v = amax · (1/448), SPEC §3.

    v's biased exponent, plus one when its mantissa is non-zero, except at 0xFE and for subnormal
    v with mantissa <= 0x400000 (then v <= 2^-127 already); v == 0 -> 0, NaN -> 0xFF, Inf -> 0xFE.
    """
    v = amax * f32(1.0 / E4M3_MAX, amax)
    b = _bits(v)
    exponent = (b >> 23) & 0xFF
    mantissa = b & 0x7FFFFF
    bump = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    e = exponent + bump.to(torch.int64)
    e = torch.where(v == 0, torch.zeros_like(e), e)
    e = torch.where(torch.isinf(v), torch.full_like(e, 0xFE), e)
    return torch.where(torch.isnan(v), torch.full_like(e, 0xFF), e)


def e8m0_quant_multiplier(e: Tensor) -> Tensor:
    """2^(127 - e) in fp32 (TE's exp2f_rcp): e = 254 -> 2^-127 (subnormal), e = 255 -> NaN."""
    b = torch.where(e == 254, torch.full_like(e, 0x00400000), (254 - e).clamp(min=0) << 23)
    b = torch.where(e == 255, torch.full_like(e, 0x7FFFFFFF), b)
    return _from_bits(b)


def e8m0_dequant_multiplier(e: Tensor) -> Tensor:
    """2^(e - 127) in fp32: e = 0 -> 2^-127 (subnormal), e = 255 -> NaN."""
    b = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
    b = torch.where(e == 255, torch.full_like(e, 0x7FFFFFFF), b)
    return _from_bits(b)


# --- e2m1 and nvfp4 scales ------------------------------------------------------------------------


def nvfp4_tensor_scale(amax_tensor: Tensor) -> Tensor:
    """S_enc = min(448·6 / amax, FLT_MAX) (fminf: NaN -> FLT_MAX); 1 when amax is 0 or S_enc is 0."""
    s_enc = torch.fmin(f32(E4M3_MAX * E2M1_MAX, amax_tensor) / amax_tensor, f32(FLT_MAX, amax_tensor))
    bad = (amax_tensor == 0) | (s_enc == 0)
    return torch.where(bad, torch.ones_like(s_enc), s_enc)


def nvfp4_block_scales(block_amax: Tensor, s_enc: Tensor) -> tuple[Tensor, Tensor]:
    """Per 16-block: s = e4m3(block_amax · (S_enc · (1/6))) and the encode multiplier
    inv = min(1 / (float(s) · (1/S_enc)), FLT_MAX). Returns (s as float8_e4m3fn, inv fp32)."""
    s = e4m3_encode(block_amax * (s_enc * f32(1.0 / E2M1_MAX, s_enc)))
    s_dec = f32(1.0, s_enc) / s_enc
    inv = torch.fmin(f32(1.0, s_enc) / (s.float() * s_dec), f32(FLT_MAX, s_enc))
    return s, inv


def e2m1_encode(v: Tensor) -> Tensor:
    """fp32 -> e2m1 code (uint8 in [0, 16)): round to nearest even, saturate to ±6.

    Code = sign << 3 | index into E2M1_VALUES. The decision boundaries are the midpoints between
    neighbours; a value on a midpoint goes to the neighbour with an even index (0.25 -> 0,
    0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). -0.0 keeps its sign (code 8),
    as the hardware conversion does. NaN gives +6 (code 7), the saturating conversion's result;
    nvfp4.py marks such blocks through their scale.
    """
    a = v.abs()
    idx = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)).to(
        torch.uint8
    )
    sign = torch.signbit(v) & ~torch.isnan(v)
    idx = torch.where(torch.isnan(v), torch.full_like(idx, 7), idx)
    return idx | (sign.to(torch.uint8) << 3)


def e2m1_decode(code: Tensor) -> Tensor:
    """e2m1 code (uint8 in [0, 16)) -> fp32."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    mag = table[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def e2m1_round_stochastic(v: Tensor, u: Tensor) -> Tensor:
    """e2m1 code of v rounded stochastically: up to the next grid value with probability
    p = (|v| - lo) / (hi - lo), decided by ``u < p`` for a uniform u in [0, 1) (fp32, multiples
    of 2^-24). lo, hi bracket min(|v|, 6); the grid spacing is a power of two, so p is exact.
    Saturates to ±6; NaN -> code 7 as in :func:`e2m1_encode`."""
    a = torch.clamp(v.abs(), max=E2M1_MAX)
    # index of the largest grid value <= a
    lo_idx = (
        (a >= 0.5).to(torch.uint8) + (a >= 1.0) + (a >= 1.5) + (a >= 2.0) + (a >= 3.0) + (a >= 4.0) + (a >= 6.0)
    ).to(torch.uint8)
    table = torch.tensor(E2M1_VALUES + (6.0,), dtype=torch.float32, device=v.device)
    lo = table[lo_idx.long()]
    step = table[(lo_idx + 1).long()] - lo  # 0.5, 1 or 2; 0 past 6 (then p is never > u)
    p = torch.where(step > 0, (a - lo) / torch.where(step > 0, step, torch.ones_like(step)), step)
    idx = lo_idx + (u < p).to(torch.uint8)
    sign = torch.signbit(v) & ~torch.isnan(v)
    idx = torch.where(torch.isnan(v), torch.full_like(idx, 7), idx)
    return idx | (sign.to(torch.uint8) << 3)


def hash_uniform(seed: int, index: Tensor, value_bits: Tensor) -> Tensor:
    """A uniform fp32 in [0, 1) (multiples of 2^-24) from a 32-bit hash of (seed, index, value bits).

    Stateless and deterministic: the same tensor quantized twice gives the same codes (SPEC §1.3:
    gradients are deterministic by default), while the value bits make the draw change from step
    to step. Hash: Wellons' lowbias32 on index·0x9E3779B9 + value_bits + seed·0x85EBCA6B (mod 2^32);
    the Triton quantizer computes the same function.
    """
    m = 0xFFFFFFFF
    k = (_mul32(index & m, 0x9E3779B9) + value_bits + _mul32(torch.full_like(index, seed & m), 0x85EBCA6B)) & m
    k = k ^ (k >> 16)
    k = _mul32(k, 0x7FEB352D)
    k = k ^ (k >> 15)
    k = _mul32(k, 0x846CA68B)
    k = k ^ (k >> 16)
    return (k >> 8).to(torch.float32) * f32(2.0**-24, k)


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x · c) mod 2^32 for int64 x in [0, 2^32), without int64 overflow (16-bit halves of c)."""
    m = 0xFFFFFFFF
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & m
