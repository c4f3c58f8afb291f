"""mxfp8's torch quantizer: hand-computed blocks, and the scalar model on random blocks.
"""

from __future__ import annotations

import math

import torch
from _recipe_model import HYPOTHESIS, INF, NAN, codes_u8, float_rows, model_e8m0, model_mxfp8
from hypothesis import given

from moemlp.recipes import recipe


def test_mxfp8_hand_block():
    x = torch.zeros(2, 40)
    x[0, 0], x[0, 1], x[0, 2] = 448.0, 1.0, -0.0625  # amax 448: e = 127, codes are the values
    x[0, 32], x[0, 33] = 449.0, 3.0  # partial 8-block, amax 449: e = 128, multiplier 1/2
    x[1, 3] = 2.0**-130  # fp32 subnormal only: v subnormal, e = 0, multiplier 2^127
    q = recipe("mxfp8").quantize(x)
    assert q.scales.dtype == torch.float8_e8m0fnu
    assert q.scales.view(torch.uint8).tolist() == [[127, 128], [0, 0]]
    c = q.codes.float()
    assert c[0, :3].tolist() == [448.0, 1.0, -0.0625]
    assert c[0, 32].item() == 224.0 and c[0, 33].item() == 1.5  # 224.5 -> 224
    assert c[1, 3].item() == 2.0**-3
    d = q.dequantize()
    assert d[0, 32].item() == 448.0 and d[1, 3].item() == 2.0**-130


def test_mxfp8_nan_inf():
    x = torch.ones(2, 32)
    x[0, 4] = NAN  # amax ignores NaN: the block keeps e = 127 - 9 + 1 ... for amax 1
    x[1, 4] = INF  # e = 0xFE, multiplier 2^-127: Inf -> 448 -> 448·2^127 = Inf; 1.0 -> 0
    q = recipe("mxfp8").quantize(x)
    assert q.scales.view(torch.uint8)[:, 0].tolist() == [model_e8m0(1.0), 0xFE]
    d = q.dequantize()
    assert math.isnan(d[0, 4]) and d[0, 0] == 1.0
    assert d[1, 4] == INF and d[1, 0] == 0.0



@HYPOTHESIS
@given(x=float_rows())
def test_mxfp8_matches_model(x):
    q = recipe("mxfp8").quantize(x)
    codes, exps = [], []
    for row in x.tolist():
        for b in range(0, len(row), 32):
            c, e = model_mxfp8(row[b : b + 32])
            codes += c
            exps.append(e)
    assert codes_u8(q.codes) == codes
    assert q.scales.view(torch.uint8).flatten().tolist() == exps
