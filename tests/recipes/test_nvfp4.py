"""nvfp4's torch quantizer: hand-computed blocks and packing, the scalar model on random blocks, the
wgrad Hadamard transform and stochastic rounding.
"""

from __future__ import annotations

import math

import torch
from _recipe_model import FLT_MAX, HYPOTHESIS, INF, NAN, amax_of, codes_u8, f32, float_rows, model_nvfp4, model_s_enc
from hypothesis import given

from moemlp.recipes import recipe
from moemlp.recipes.nvfp4 import HADAMARD_SIGNS, hadamard16


def test_nvfp4_hand_block_and_packing():
    # amax_tensor 2688: S_enc = 1. Block 0 amax 6: s = e4m3(6·fp32(1/6)) = 1, inv = 1, codes are
    # the e2m1 roundings of the values. Block 1 amax 0: s = 0, inv = FLT_MAX, codes 0.
    x = torch.zeros(1, 34)
    x[0, :6] = torch.tensor([6.0, -0.75, 1.25, 2.5, 0.2, 2688.0 / 448])
    x[0, 32] = 2688.0  # a third, partial block of 2 with s = 448
    x[0, 33] = -700.0
    q = recipe("nvfp4").quantize(x)
    assert q.tensor_scale.item() == 1.0
    assert q.scales.float().tolist() == [[1.0, 0.0, 448.0]]
    assert q.codes.shape == (1, 17)
    assert q.codes[0, :3].tolist() == [7 | (10 << 4), 2 | (4 << 4), 0 | (7 << 4)]
    d = q.dequantize()[0]
    assert d[:6].tolist() == [6.0, -1.0, 1.0, 2.0, 0.0, 6.0]
    assert d[32].item() == 2688.0 and d[33].item() == -448.0 * 1.5  # 700/448 = 1.5625 -> 1.5


def test_nvfp4_nan_marks_its_block_only():
    x = torch.randn(2, 32)
    x[0, 3] = NAN
    q = recipe("nvfp4").quantize(x)
    d = q.dequantize()
    assert d[0, :16].isnan().all() and not d[0, 16:].isnan().any() and not d[1].isnan().any()
    clean = x.clone()
    clean[0, 3] = 0.0
    # everything outside the NaN's block is what the clean tensor gives (NaN is ignored by amax)
    assert torch.equal(d[:, 16:], recipe("nvfp4").quantize(clean).dequantize()[:, 16:])


def test_nvfp4_extreme_tensor_scales():
    # all zero: S_enc 1, everything 0; Inf: S_enc 1, Inf -> 6·448; tiny: S_enc FLT_MAX
    r = recipe("nvfp4")
    assert torch.equal(r.quantize(torch.zeros(1, 16)).dequantize(), torch.zeros(1, 16))
    q = r.quantize(torch.tensor([[INF, 1.0] + [0.0] * 14]))
    assert q.tensor_scale.item() == 1.0 and q.dequantize()[0, 0].item() == 2688.0
    # amax 1e-39: S_enc overflows to FLT_MAX, s = e4m3(1e-39·FLT_MAX/6) = 0.05859375, and
    # s·(1/S_enc) is an fp32 subnormal whose reciprocal overflows: inv is clamped to FLT_MAX, so
    # y = 1e-39·FLT_MAX = 0.34 rounds to 0.5 and dequantizes to 0.5·s·(1/S_enc), not to 1e-39
    q = r.quantize(torch.full((1, 16), 1e-39))
    assert q.tensor_scale.item() == FLT_MAX and q.scales[0, 0].float().item() == 0.05859375
    expected = f32(0.5) * f32(0.05859375) * (f32(1) / f32(FLT_MAX))
    assert q.dequantize()[0, 0].item() == float(expected)
    # a block 2^20 below the tensor amax: its e4m3 scale (448·2^-20 < 2^-10) underflows to 0, and
    # the block to zeros: the e4m3 block scale spans about 2^17 below the tensor amax, no more
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 1.0, 2.0**-20
    q = r.quantize(x)
    assert q.scales.float().tolist() == [[448.0, 0.0]] and q.dequantize()[0, 16].item() == 0.0



@HYPOTHESIS
@given(x=float_rows())
def test_nvfp4_matches_model(x):
    q = recipe("nvfp4").quantize(x)
    s_enc = model_s_enc(amax_of(x.flatten().tolist()))
    assert q.tensor_scale.item() == s_enc
    codes, scales = [], []
    for row in x.tolist():
        row_codes = []
        for b in range(0, len(row), 16):
            c, s = model_nvfp4(row[b : b + 16], s_enc)
            row_codes += c
            scales.append(s)
        row_codes += [0] * (len(row_codes) % 2)
        codes += [lo | (hi << 4) for lo, hi in zip(row_codes[0::2], row_codes[1::2])]
    assert q.codes.flatten().tolist() == codes
    assert codes_u8(q.scales) == scales



def test_hadamard_butterfly_is_the_orthogonal_matrix():
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    q = torch.diag(torch.tensor(HADAMARD_SIGNS, dtype=torch.float64)) @ h / 4
    assert torch.allclose(q @ q.T, torch.eye(16, dtype=torch.float64))
    t = torch.randn(50, 16, dtype=torch.float32)
    assert torch.allclose(hadamard16(t).double(), t.double() @ q, rtol=0, atol=1e-5)


def test_hadamard_wgrad_is_rotate_then_quantize_per_expert():
    # qdq_wgrad with hadamard=True equals: rotate every complete 16-row group of each expert by
    # the butterfly (a tail of < 16 rows stays as it is), take S_enc over the rotated rows, then
    # quantize each expert's rows in 16-row blocks. Splits: a 37-row expert (2 groups + a 5-row
    # tail), an exact group, an expert too short for any group, capacity rows.
    from moemlp.recipes import nvfp4

    r = recipe("nvfp4", hadamard=True)
    g = torch.Generator().manual_seed(2)
    splits = torch.tensor([37, 16, 5])
    grad, act = torch.randn(60, 32, generator=g), torch.randn(60, 48, generator=g)
    act[5, 7] = 200.0  # an outlier, spread over its group by the rotation
    gq, aq = r.qdq_wgrad(grad, act, splits)
    for t, tq in ((grad, gq), (act, aq)):
        rot = t[:58].clone()
        for start in (0, 16, 37):
            rot[start : start + 16] = hadamard16(t[start : start + 16].T).T
        s_enc = nvfp4.tensor_scale(rot)
        off = 0
        for n in splits.tolist():
            xb, back = nvfp4.to_blocks(rot[off : off + n], 0, 16)
            assert torch.equal(tq[off : off + n], back(nvfp4.quantize_blocks(xb, s_enc)[2]))
            off += n
        assert tq[58:].eq(0).all()
    assert aq[:16, 7].abs().max() < 100  # the outlier no longer sits alone in its column block
    # the product survives the rotation: per expert g'^T a' approximates g^T a as well as
    # without the transform (within 1.5 dB; on Gaussian data the transform neither helps nor hurts)
    gp, ap = recipe("nvfp4").qdq_wgrad(grad, act, splits)
    ref = grad[:37].double().T @ act[:37].double()
    err_h = (gq[:37].double().T @ aq[:37].double() - ref).norm() / ref.norm()
    err_p = (gp[:37].double().T @ ap[:37].double() - ref).norm() / ref.norm()
    assert err_h < err_p * 10 ** (1.5 / 20)


def test_stochastic_rounding_is_unbiased_and_deterministic():
    # 0.3 (in units of the block scale) sits between the e2m1 values 0 and 0.5: rounding to nearest
    # gives 0.5 everywhere; stochastic rounding gives 0.5 with probability 0.6, so the mean over
    # 64k elements is 0.3 within 4 standard deviations (sd of the mean 0.5·√(0.24/65536) = 0.001).
    r = recipe("nvfp4", stochastic_rounding=True)
    n = 4096
    grad = torch.full((n, 16), 0.3)
    grad[::16] = 6.0  # every 16-row block's amax 6: S_enc = 448, s = 448, one unit = 1
    act = torch.randn(n, 16)
    splits = torch.tensor([n])
    gq, aq = r.qdq_wgrad(grad, act, splits)
    body = gq[grad == 0.3].double()
    scale = 6.0 / float(gq.max())  # undo the per-tensor factor exactly enough for a mean
    assert abs(body.mean().item() * scale - 0.3) < 4 * 0.5 * math.sqrt(0.24 / body.numel()) + 1e-6
    assert set((body * scale).round(decimals=4).unique().tolist()) <= {0.0, 0.5}
    gq2, aq2 = r.qdq_wgrad(grad, act, splits)
    assert torch.equal(gq, gq2) and torch.equal(aq, aq2)  # deterministic
    # act is never rounded stochastically
    assert torch.equal(aq, recipe("nvfp4").qdq_wgrad(grad, act, splits)[1])
