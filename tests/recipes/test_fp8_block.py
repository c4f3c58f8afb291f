"""fp8_block's torch quantizer: hand-computed blocks and tiles, and the scalar model on random blocks.
"""

from __future__ import annotations

import math

import torch
from _recipe_model import FLT_MAX, HYPOTHESIS, INF, NAN, codes_u8, float_rows, model_fp8_block
from hypothesis import given
from hypothesis import strategies as st

from moemlp.recipes import recipe


def test_fp8_block_hand_row_with_partial_block():
    # 130 columns: a full 128-block with amax 3 (scale 128 with pow2) and a 2-element block of its
    # own with amax 0.5 (scale 512): the partial block's amax is over its real elements only.
    x = torch.zeros(1, 130)
    x[0, 0], x[0, 1], x[0, 2] = 3.0, -1.0625 / 128, 0.1
    x[0, 128], x[0, 129] = 0.5, -0.25
    q = recipe("fp8_block").quantize(x)
    assert q.scales.tolist() == [[1 / 128, 1 / 512]]
    assert q.codes.shape == (1, 130) and q.codes.dtype == torch.float8_e4m3fn
    c = q.codes.float()[0]
    assert c[0] == 384.0 and c[1] == -1.0 and c[2] == 13.0  # 12.8 -> 13 (step 1 in [8, 16))
    assert c[128] == 256.0 and c[129] == -128.0
    assert q.dequantize()[0, 128].item() == 0.5


def test_fp8_block_zero_nan_inf_blocks():
    x = torch.zeros(3, 128)
    x[1, 0], x[1, 5] = NAN, 2.0  # NaN ignored by amax: the block is scaled by 2's scale
    x[2, 0], x[2, 1] = INF, 1.0  # Inf: scale 1, Inf saturates to 448, 1.0 stays 1.0
    q = recipe("fp8_block").quantize(x)
    assert q.scales[:, 0].tolist() == [1.0, 1 / 128, 1.0]
    d = q.dequantize()
    assert torch.equal(d[0], torch.zeros(128))
    assert math.isnan(d[1, 0]) and d[1, 5] == 2.0 and d[1, 1:5].eq(0).all()
    assert d[2, 0] == 448.0 and d[2, 1] == 1.0


def test_fp8_block_weight_tiles_hand():
    # (130, 129): four tiles; the 2×1 corner tile has its own amax.
    w = torch.full((130, 129), 0.001)
    w[0, 0] = 448.0  # tile (0, 0): scale 1
    w[129, 128] = 7.0  # tile (1, 1), two real elements: 448/7 = 64 exactly
    w[129, 0] = 1.0  # tile (1, 0): 448 -> 256 with pow2
    q = recipe("fp8_block").quantize_weight(w)
    assert q.scales.tolist() == [[1.0, 2.0**-18], [1 / 256, 1 / 64]]
    d = q.dequantize()
    assert d[0, 0] == 448.0 and d[129, 128] == 7.0 and d[129, 0] == 1.0
    # a tiny scale: tile (0, 1) holds only 0.001 -> scale 2^18 (448000 rounded down)
    assert q.scales[0, 1].item() == 2.0**-18
    # both GEMM orientations read the same tiles: the transpose quantizes to the transpose
    qt = recipe("fp8_block").quantize_weight(w.T.contiguous())
    assert torch.equal(qt.dequantize(), d.T)


def test_fp8_block_overflow_near_flt_max():
    # amax = FLT_MAX: scale = 448/FLT_MAX rounded down to 2^-120, x·scale = 255.99 rounds up to the
    # e4m3 value 256, and 256·2^120 = 2^128 overflows: TE's arithmetic dequantizes it to Inf
    q = recipe("fp8_block").quantize(torch.tensor([[FLT_MAX]]))
    assert q.scales.item() == 2.0**120 and q.codes.float().item() == 256.0
    assert q.dequantize().item() == INF



@HYPOTHESIS
@given(x=float_rows(), pow2=st.booleans())
def test_fp8_block_matches_model(x, pow2):
    q = recipe("fp8_block", pow2_scales=pow2).quantize(x)
    codes, scales = [], []
    for row in x.tolist():
        for b in range(0, len(row), 128):
            c, s = model_fp8_block(row[b : b + 128], pow2)
            codes += c
            scales.append(s)
    assert codes_u8(q.codes) == codes
    assert q.scales.flatten().tolist() == scales
