"""The independent scalar model of SPEC §3's formats that the recipe tests check the torch
quantizers against: numpy float32 (IEEE round-to-nearest per operation) with brute-force
round-to-nearest-even onto the format's value table; it shares no code with the vectorised quantizers,
and computes exponents with frexp where the quantizers use bit masks. Plus the hypothesis strategy of
fp32 rows mixed with specials.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

f32 = np.float32
FLT_MAX = float(np.finfo(np.float32).max)
NAN = float("nan")
INF = float("inf")

# --- the independent scalar model -----------------------------------------------------------------

E4M3_TABLE = [(m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7) for e in range(16) for m in range(8)][
    :127
]  # code 0..126; 127 is NaN; 126 = 448
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def rne(v: float, table) -> int:
    """Index into a sorted non-negative value table of |v| rounded to nearest, ties to the even
    index, saturating at the last entry. Sign and NaN are the caller's."""
    a = abs(v)
    if a >= table[-1]:
        return len(table) - 1
    best = min(range(len(table)), key=lambda i: (abs(table[i] - a), i % 2))
    return best


def e4m3_code(v: float) -> int:
    if math.isnan(v):
        return 0x7F
    return rne(v, E4M3_TABLE) | (0x80 if math.copysign(1, v) < 0 else 0)


def e4m3_value(code: int) -> float:
    return math.copysign(E4M3_TABLE[code & 0x7F], -1 if code & 0x80 else 1)


def e2m1_code(v: float) -> int:
    if math.isnan(v):
        return 7
    return rne(v, E2M1_TABLE) | (8 if math.copysign(1, v) < 0 else 0)


def amax_of(block) -> float:
    return max([abs(float(v)) for v in block if not math.isnan(v)], default=0.0)


def model_fp8_block(block, pow2, vmax=FLT_MAX):
    amax = f32(amax_of(block))
    if amax == 0 or math.isinf(amax):
        scale = f32(1)
    else:
        with np.errstate(over="ignore", divide="ignore"):
            scale = f32(448) / amax
        if math.isinf(scale):
            scale = f32(vmax)
        if pow2:
            m, ex = math.frexp(float(scale))
            scale = f32(math.ldexp(1.0, ex - 1))
    codes = [e4m3_code(float(f32(v) * scale)) for v in block]
    return codes, float(f32(1) / scale)


def model_e8m0(amax) -> int:
    v = f32(amax) * f32(1 / 448)
    if math.isnan(v):
        return 0xFF
    if math.isinf(v):
        return 0xFE
    if v == 0:
        return 0
    m, ex = math.frexp(float(v))  # v = m·2^ex, m in [0.5, 1): smallest e with 2^(e-127) >= v
    k = ex - 1 if m == 0.5 else ex
    return max(0, k + 127)


def model_mxfp8(block):
    e = model_e8m0(amax_of(block))
    mult = f32(math.ldexp(1.0, 127 - e)) if e < 255 else f32(NAN)
    return [e4m3_code(float(f32(v) * mult)) for v in block], e


def model_s_enc(amax_t) -> np.float32:
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        s = f32(448 * 6) / f32(amax_t)
    s = f32(FLT_MAX) if (math.isnan(s) or s > FLT_MAX) else s
    return f32(1) if (amax_t == 0 or s == 0) else s


def model_nvfp4(block, s_enc):
    bamax = f32(amax_of(block))
    s = e4m3_code(float(bamax * (s_enc * f32(1 / 6))))
    with np.errstate(over="ignore", divide="ignore"):
        inv = f32(1) / (f32(e4m3_value(s)) * (f32(1) / s_enc))
    inv = min(inv, f32(FLT_MAX))
    with np.errstate(over="ignore", invalid="ignore"):  # Inf · inv saturates like any overflow
        codes = [e2m1_code(float(f32(v) * inv)) for v in block]
    if any(math.isnan(v) for v in block):
        s = 0x7F
    return codes, s


def codes_u8(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).flatten().tolist()


_special = st.sampled_from([0.0, -0.0, NAN, INF, -INF, 448.0, 464.0, 1e-39, -1e-45, FLT_MAX, 0.25, 2.5])


@st.composite
def float_rows(draw, max_cols=70):
    """(rows, cols) fp32 arrays mixing normal values at a random magnitude with specials."""
    rows = draw(st.integers(1, 3))
    cols = draw(st.integers(1, max_cols))
    mag = draw(st.sampled_from([1e-42, 1e-30, 1e-6, 1.0, 3e3, 1e30]))
    seed = draw(st.integers(0, 2**31 - 1))
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * f32(mag)
    n_special = draw(st.integers(0, 3))
    for _ in range(n_special):
        x[draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))] = draw(_special)
    return torch.from_numpy(x)


HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
