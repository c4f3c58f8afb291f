"""The FC2_DGRAD epilogue's fp8_block quantization of g_h and z for the weight gradients
(``_grouped_gemm.WgradCodes``): codes and scales bit for bit those of the torch reference quantizer
(``recipe.quantize_wgrad``) on the fp32 values the same launch stores without it, the other outputs
unchanged, and the fp8 wgrad GEMM on them equal to the one on the quantizer's operands.

Without a GPU the kernels run under TRITON_INTERPRET=1 in a child pytest of this file
(tests/_triton_env.py says why).
"""

from __future__ import annotations

import math

import pytest
import torch

import _triton_env
from moemlp._config import MLPConfig
from moemlp.activations import ACTIVATIONS
from moemlp.recipes import recipe

interpreted = pytest.mark.skipif(
    not _triton_env.RUN_CPU_CASES,
    reason="CPU cases: run under TRITON_INTERPRET=1 in the child of test_cpu_cases_under_interpreter",
)


@pytest.mark.skipif(not _triton_env.START_CHILD, reason="runs the CPU cases in a child on a CPU-only machine")
def test_cpu_cases_under_interpreter():
    _triton_env.run_file_interpreted(__file__, timeout=300)


def _u8(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def check(device, splits, capacity, H, F, G, pow2, seed=0):
    from moemlp.kernels import _grouped_gemm as gg
    from moemlp.kernels import _operands
    from moemlp.kernels import quantize as kq
    from moemlp.kernels._fp8_wgrad import fp8_block_grouped_wgrad, fp8_block_grouped_wgrad_kmajor

    r = recipe("fp8_block", pow2_scales=pow2)
    cfg = MLPConfig(ACTIVATIONS["swiglu"], (), G, False, r)
    E, M, N1 = len(splits), sum(splits) + capacity, 2 * F
    gen = torch.Generator().manual_seed(seed)
    # per-row magnitudes from 2^-20 to 2^20: blocks of very different scales side by side
    mag = torch.randint(-20, 21, (M, 1), generator=gen)
    # an expert of one row at 2^-118: its g_h and z blocks have amax near 2^-126, where 448/amax
    # overflows fp32 and the scale saturates (VMAX)
    ends = torch.tensor(splits).cumsum(0)
    for e, n in enumerate(splits):
        if n == 1:
            mag[ends[e] - 1] = -118
    dy = (torch.randn(M, H, generator=gen) * 2.0 ** mag).bfloat16()
    h = (torch.randn(M, N1, generator=gen) * 2).bfloat16()
    probs = torch.rand(M, generator=gen)
    w2 = (torch.randn(E, H, F, generator=gen) * H**-0.5).bfloat16()
    x = torch.randn(M, 48, generator=gen).bfloat16()
    dy, h, probs, w2, x = (t.to(device) for t in (dy, h, probs, w2, x))
    s = torch.tensor(splits, dtype=torch.int64, device=device)

    a = _operands.act(dy, r)
    b = _operands.Weight(w2, r).dgrad()
    config = gg.default_config("fc2_dgrad", F, H, True, 2, fp8=True)
    assert gg.fp8_epilogue_blocks_ok(config, H)

    def launch(codes):
        g_h = torch.full((M, N1), float("nan"), device=device)
        z = torch.full((M, F), float("nan"), device=device) if codes is None else None
        partial = torch.empty((math.ceil(F / config.BN), M), device=device)
        gg.launch_grouped_gemm(
            gg.FC2_DGRAD.value, a.a, b.b, b.strides, s, probs, None, g_h, z, h, partial, N=F, K=H, N1=N1,
            cfg=cfg, scale_bias=False, store_z=True, store_partial=True, config=config, wgrad_codes=codes,
            **_operands.gemm_kwargs(a, b),
        )  # fmt: skip
        return g_h, z, partial

    g_ref, z_ref, part_ref = launch(None)
    codes = gg.WgradCodes.empty(M, E, N1, F, pow2, g=True, z=True, device=device)
    g_h, _, part = launch(codes)
    assert torch.equal(g_h, g_ref) and torch.equal(part, part_ref), "the other outputs changed"

    used = sum(math.ceil(n / 128) for n in splits) * 128  # the blocks of the experts' rows
    s_cpu = s.cpu()
    for what, t_ref, c_t, c_s in (("g_h", g_ref, codes.g_t, codes.g_s), ("z", z_ref, codes.z_t, codes.z_s)):
        q = r.quantize_wgrad(t_ref.cpu(), s_cpu, is_grad=what == "g_h")
        assert torch.equal(c_t[:, :used].cpu(), _u8(q.codes).t()[:, :used]), what + " codes"
        assert torch.equal(c_s[: used // 128].cpu(), q.scales[: used // 128]), what + " scales"
    # the wgrad GEMM on the epilogue's operands = on the quantizer's (the same kernel and values)
    xq = kq.quantize_wgrad(x, s, r, is_grad=False, transposed=True)
    gq = kq.quantize_wgrad(g_ref, s, r, is_grad=True, transposed=True)
    dw = fp8_block_grouped_wgrad_kmajor(codes.g_t, codes.g_s, xq.codes_t, xq.scales, s, M)
    assert torch.equal(dw, fp8_block_grouped_wgrad(gq, xq, s)), "dW1"


CASES = [
    # (id, splits, capacity rows, H, F, G): an empty expert, experts over one and two blocks
    ("halves", [150, 0, 37, 300], 20, 256, 64, 64),
    ("interleaved", [129, 128, 1], 5, 128, 64, 32),
]


@interpreted
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cpu_epilogue_codes_match_the_quantizer(case, pow2):
    check("cpu", *case[1:], pow2=pow2)


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [True, False])
def test_gpu_epilogue_codes_match_the_quantizer(pow2):
    check("cuda", [700, 0, 512, 1300, 33, 900, 400, 251], 64, 1024, 768, 768, pow2=pow2, seed=1)
    check("cuda", [300, 129, 0, 1], 3, 512, 256, 128, pow2=pow2, seed=2)


def test_wgrad_codes_refuse_bad_buffers():
    from moemlp.kernels import _grouped_gemm as gg

    codes = gg.WgradCodes.empty(300, 4, 64, 32, True, g=True, z=False, device="cpu")
    assert codes.P == (3 + 4) * 128
    codes.check(300, 4, 64, 32)
    with pytest.raises(ValueError, match="g_t"):
        codes.check(300, 5, 64, 32)  # P of another expert count
    with pytest.raises(ValueError, match="neither"):
        gg.WgradCodes(None, None, None, None, True).check(300, 4, 64, 32)


@interpreted
def test_cpu_backward_with_the_epilogue_codes_gives_the_same_bits(monkeypatch):
    # The backward's wiring of WgradCodes (off by default: _grouped_gemm.FUSE_WGRAD_CODES says why)
    # gives the gradients of the quantize_wgrad path bit for bit: the same codes, the same kernels.
    from moemlp import kernels as K
    from moemlp.kernels import _grouped_gemm as gg
    from test_triton_backend import make

    t, cfg = make([150, 0, 37, 140], 128, 64, M=340)
    cfg = MLPConfig(cfg.activation, cfg.activation_params, cfg.glu_interleave, cfg.scale_fc2_bias,
                    recipe("fp8_block"))  # fmt: skip
    args = (t["splits"], t["probs"], t["fc1_weight"], t["fc2_weight"], t["fc1_bias"], t["fc2_bias"])
    _, h = K.grouped_mlp_fwd(t["x"], *args, cfg)
    needs = (True, True, True, True, True, True)
    seen = []
    launch = gg.launch_grouped_gemm

    def spy(*a, **kw):
        seen.append(kw.get("wgrad_codes") is not None)
        return launch(*a, **kw)

    monkeypatch.setattr(gg, "launch_grouped_gemm", spy)
    monkeypatch.setattr(gg, "FUSE_WGRAD_CODES", False)
    before = K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, needs)
    monkeypatch.setattr(gg, "FUSE_WGRAD_CODES", True)
    after = K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, needs)
    assert seen.count(True) == 1 and not any(seen[: len(seen) // 2]), seen  # FC2_DGRAD of the second run
    for a, b in zip(before, after):
        assert torch.equal(a, b)
