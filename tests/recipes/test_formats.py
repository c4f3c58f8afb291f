"""Element and scale formats of SPEC §3 (e4m3, e2m1, fp8_block's scale, e8m0, nvfp4's S_enc),
hand-computed.
"""

from __future__ import annotations

import math

import pytest
import torch
from _recipe_model import FLT_MAX, INF, NAN, codes_u8, f32, model_e8m0

from moemlp.recipes import _formats as F

# --- element formats: hand-computed -----------------------------------------------------------------

E4M3_CASES = [
    # (input, expected e4m3 value): ties, saturation, subnormals, signs
    (1.0625, 1.0),  # tie between 1.0 and 1.125: even mantissa
    (1.1875, 1.25),  # tie between 1.125 and 1.25: even mantissa is 1.25
    (2.0**-10, 0.0),  # half the smallest subnormal: ties to 0
    (3 * 2.0**-10, 2 * 2.0**-9),  # 1.5 subnormal steps: ties to 2
    (2.0**-9 * 0.51, 2.0**-9),  # just over half a step
    (0.0146484375, 0.015625),  # 7.5·2^-9: tie between subnormal 7 and normal 2^-6 (even: 8)
    (448.0, 448.0),
    (463.99, 448.0),  # saturation (RNE would give 448 anyway)
    (464.0, 448.0),  # the midpoint to the next (nonexistent) value: saturate
    (1e30, 448.0),
    (INF, 448.0),  # satfinite
    (-INF, -448.0),
    (-1.0625, -1.0),
]


@pytest.mark.parametrize("v,expected", E4M3_CASES, ids=[repr(c[0]) for c in E4M3_CASES])
def test_e4m3_encode_hand(v, expected):
    out = F.e4m3_encode(torch.tensor([v], dtype=torch.float32)).float().item()
    assert out == expected and math.copysign(1, out) == math.copysign(1, expected)


def test_e4m3_encode_nan_and_signed_zero():
    v = torch.tensor([NAN, NAN, -0.0, 0.0])
    v.view(torch.int32)[1] = -0x400000  # a NaN with the sign bit set (0xFFC00000)
    # every NaN gives 0x7F, the hardware conversion's code; torch's own conversion would give -NaN 0xFF
    assert codes_u8(F.e4m3_encode(v)) == [0x7F, 0x7F, 0x80, 0x00]


E2M1_CASES = [
    # every decision boundary (ties go to the even index), saturation, signs
    (0.25, 0.0),
    (0.2500001, 0.5),
    (0.75, 1.0),
    (0.7499999, 0.5),
    (1.25, 1.0),
    (1.2500001, 1.5),
    (1.75, 2.0),
    (2.5, 2.0),
    (2.5000002, 3.0),
    (3.5, 4.0),
    (5.0, 4.0),
    (5.0000005, 6.0),
    (6.0, 6.0),
    (100.0, 6.0),
    (INF, 6.0),
    (-3.5, -4.0),
    (-0.1, -0.0),
    (-INF, -6.0),
]


@pytest.mark.parametrize("v,expected", E2M1_CASES, ids=[repr(c[0]) for c in E2M1_CASES])
def test_e2m1_encode_hand(v, expected):
    code = F.e2m1_encode(torch.tensor([v], dtype=torch.float32))
    out = F.e2m1_decode(code).item()
    assert out == expected and math.copysign(1, out) == math.copysign(1, expected)


def test_e2m1_nan_saturates_positive():
    assert F.e2m1_encode(torch.tensor([NAN, -0.0])).tolist() == [7, 8]


FP8_SCALE_CASES = [
    # (amax, pow2, expected scale)
    (448.0, False, 1.0),
    (1.0, False, 448.0),
    (1.0, True, 256.0),  # 448 with the mantissa cleared
    (3.0, False, float(f32(448) / f32(3))),  # 149.33334: one fp32 division
    (3.0, True, 128.0),
    (0.0, True, 1.0),
    (INF, True, 1.0),
    (NAN, False, 1.0),
    (1e-39, False, FLT_MAX),  # fp32 subnormal amax: 448/amax overflows -> the dtype's max
    (1e-39, True, 2.0**127),
    (FLT_MAX, False, float(f32(448) / f32(FLT_MAX))),  # scale itself subnormal-adjacent, not 0
]


@pytest.mark.parametrize("amax,pow2,expected", FP8_SCALE_CASES)
def test_fp8_block_scale_hand(amax, pow2, expected):
    s = F.fp8_block_scale(torch.tensor([amax], dtype=torch.float32), pow2, FLT_MAX)
    assert s.item() == expected


def test_fp8_block_scale_overflow_uses_source_dtype_max():
    # a bf16 subnormal amax (as TE with a bf16 input): the scale is bf16's max, 0x7F7F0000
    amax = torch.tensor([2.0**-130], dtype=torch.float32)
    s = F.fp8_block_scale(amax, False, torch.finfo(torch.bfloat16).max)
    assert s.item() == torch.finfo(torch.bfloat16).max == float.fromhex("0x1.fep127")


E8M0_CASES = [
    # (amax, expected biased exponent)
    (448.0, 127),  # v = 1 exactly: no increment
    (449.0, 128),  # mantissa non-zero: round up
    (224.0, 126),
    (0.0, 0),
    (NAN, 0xFF),
    (INF, 0xFE),
    (FLT_MAX, 247),  # v = 2^128/448 = 1.14·2^119: biased 246, mantissa non-zero -> 247
    (448 * 2.0**-127, 0),  # v = 2^-127: subnormal, mantissa 0x400000: no increment
    (448 * 2.0**-127 * 1.25, 1),  # subnormal v, mantissa > 0x400000: increment
    (448 * 2.0**-140, 0),  # deep subnormal v
    (448 * 2.0**-126, 1),  # v = 2^-126, the smallest normal
]


@pytest.mark.parametrize("amax,expected", E8M0_CASES)
def test_e8m0_hand(amax, expected):
    assert F.e8m0_from_amax(torch.tensor([amax], dtype=torch.float32)).item() == expected
    assert model_e8m0(amax) == expected


def test_e8m0_multipliers_at_the_ends():
    e = torch.tensor([0, 1, 127, 253, 254, 255])
    q = F.e8m0_quant_multiplier(e).tolist()
    d = F.e8m0_dequant_multiplier(e).tolist()
    assert q[:5] == [2.0**127, 2.0**126, 1.0, 2.0**-126, 2.0**-127] and math.isnan(q[5])
    assert d[:5] == [2.0**-127, 2.0**-126, 1.0, 2.0**126, 2.0**127] and math.isnan(d[5])


NVFP4_SCALE_CASES = [
    # (amax_tensor, expected S_enc)
    (2688.0, 1.0),
    (1.0, 2688.0),
    (0.0, 1.0),
    (INF, 1.0),  # 2688/Inf = 0 -> 1
    (1e-39, FLT_MAX),  # overflow -> FLT_MAX
    (NAN, FLT_MAX),  # fminf drops the NaN
    (3.0, float(f32(2688) / f32(3))),
]


@pytest.mark.parametrize("amax,expected", NVFP4_SCALE_CASES)
def test_nvfp4_tensor_scale_hand(amax, expected):
    assert F.nvfp4_tensor_scale(torch.tensor(amax, dtype=torch.float32)).item() == expected
