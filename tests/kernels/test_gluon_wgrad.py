"""fp8_block's weight gradient on the Gluon engine (moemlp.kernels.gluon.fp8_wgrad): an offline sm_90
compile on any machine (e4m3 wgmma, no serialized chain, registers, shared memory), the input checks,
and on an H200 dW against the Triton FP8 wgrad kernel on the same quantized operands (the same
128-deep products, scaled and added in the same order: the same bits)."""

from __future__ import annotations

import re

import pytest
import torch

from _sm90 import check_fp8_consumers, compile_gluon_sm90
from moemlp.kernels.gluon import _compat, _launch

needs_gluon = pytest.mark.skipif(bool(_compat.missing()), reason=f"triton lacks: {_compat.missing()}")


def _compile_sm90(out_fp32: bool):
    from moemlp.kernels.gluon import _engine, _wgrad

    gl = _compat.gl
    BM, BN = _launch.FP8_BM, _launch.BN

    def desc(block, dtype):
        ty = {"fp8e4nv": gl.float8e4nv, "bf16": gl.bfloat16, "fp32": gl.float32}[dtype]
        return f"tensordesc<{dtype}[{block[0]},{block[1]}],{gl.NVMMASharedLayout.get_default_for(block, ty)!r}>"

    c = "fp32" if out_fp32 else "bf16"
    # The scales are contiguous (P/128, ·): a launch specializes their unit column strides to 1.
    constexprs = dict(BM=BM, BN=BN, STAGES=_launch.FP8_STAGES, GROUP_N=_launch.WGRAD_GROUP_N, E_BLOCK=128,
                      stride_gsn=1, stride_xsk=1)
    sig = {"g_desc": desc([BM, 128], "fp8e4nv"), "x_desc": desc([BN, 128], "fp8e4nv"), "c_desc": desc([BM, BN], c),
           "c_ptr": f"*{c}", "g_scale_ptr": "*fp32", "stride_gsb": "i32", "x_scale_ptr": "*fp32",
           "stride_xsb": "i32", "splits_ptr": "*i32", "E": "i32", "T": "i32", "N": "i32",
           "K": "i32"}  # fmt: skip
    sig.update({name: "constexpr" for name in constexprs})
    sig = {name: sig[name] for name in _wgrad.fp8_wgrad_kernel.arg_names}  # in the kernel's order
    return compile_gluon_sm90(_wgrad.fp8_wgrad_kernel, sig, constexprs, ("c_ptr", "splits_ptr", "N", "K"),
                              _engine.NUM_WARPS, _engine.MAXNREG)  # fmt: skip


@needs_gluon
@pytest.mark.parametrize("out_fp32", [False, True], ids=["bf16-dW", "fp32-dW"])
def test_offline_sm90_compile(out_fp32):
    from moemlp.kernels.gluon import _wgrad

    sass, usage, shared = _compile_sm90(out_fp32)
    # Its own register split: 240 a consumer (the engine's 232 spilled), 24 for the producer.
    check_fp8_consumers(sass, usage, _wgrad.CONSUMER_REGS.value, _wgrad.PRODUCER_REGS.value)
    # The producer: the two 64-row halves of the Gᵀ block and one Xᵀ block a stage.
    assert len(re.findall(r"\bUTMALDG\.2D\b", sass)) == 3
    stage = (2 * _launch.FP8_BM + _launch.BN) * 128
    tiles = 2 * _launch.FP8_BM * _launch.BN * (4 if out_fp32 else 2)
    assert _launch.FP8_STAGES * stage + tiles <= shared <= 227 * 1024, shared


@pytest.mark.parametrize(
    "change, words",
    [
        pytest.param(dict(g_t=torch.zeros(64, 384, dtype=torch.bfloat16)), "e4m3", id="bf16-codes"),
        pytest.param(dict(out_dtype=torch.float16), "bf16 or fp32", id="fp16-dW"),
        pytest.param(dict(x_t=torch.zeros(12, 384).to(torch.float8_e4m3fn), out_dtype=torch.bfloat16),
                     "16-byte", id="K12-bf16"),
        pytest.param(dict(experts=257), "1 to 256 experts", id="too-many-experts"),
        pytest.param(dict(), "not a CUDA tensor", id="cpu"),
    ],
)
def test_supports_names_what_it_cannot_take(change, words):
    from moemlp.kernels.gluon import fp8_wgrad_supports

    args = dict(g_t=torch.zeros(64, 384).to(torch.float8_e4m3fn), x_t=torch.zeros(32, 384).to(torch.float8_e4m3fn),
                out_dtype=torch.float32)  # fmt: skip
    args.update(change)
    assert words in fp8_wgrad_supports(**args)


def test_padded_rows_are_checked():
    from moemlp.kernels.gluon import fp8_wgrad

    codes = torch.zeros(64, 256).to(torch.float8_e4m3fn)  # P = 256, but T = 200 rows over 2 experts need 512
    with pytest.raises(ValueError, match=r"P = \(⌈T/128⌉ \+ E\)·128"):
        fp8_wgrad(codes, torch.ones(2, 64), codes, torch.ones(2, 64), torch.tensor([100, 100]), 200)


# (splits, T, N, K): ragged experts with an empty one, N and K ending in partial tiles; small experts of
# one or two blocks; one expert; bad splits clamped at T
GPU_CASES = [
    pytest.param([700, 0, 512, 1300, 33, 900, 400, 251], 4096, 1408 + 8, 1024 + 72, id="ragged"),
    pytest.param([128, 1, 255, 256, 129] * 4, 3076, 768, 512, id="small-experts"),
    pytest.param([1000], 1000, 256, 256, id="one-expert"),
    pytest.param([700, 700], 1000, 192, 128, id="splits-past-T"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits_list, T, N, K", GPU_CASES)
def test_gpu_matches_the_triton_kernel(splits_list, T, N, K, out_dtype):
    from moemlp.kernels.gemm import launch
    from moemlp.kernels.gluon import fp8_wgrad, fp8_wgrad_supports, why_unavailable
    from moemlp.kernels.quant import api as kq
    from moemlp.recipes import recipe

    if why_unavailable():
        pytest.skip(why_unavailable())
    torch.manual_seed(0)
    r = recipe("fp8_block")
    g = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    splits = torch.tensor(splits_list, device="cuda", dtype=torch.int32)
    blocks = kq.row_blocks(splits, T, r.block)
    qg = kq.quantize_wgrad(g, splits, r, is_grad=True, transposed=True, blocks=blocks)
    qx = kq.quantize_wgrad(x, splits, r, is_grad=False, transposed=True, blocks=blocks)
    assert fp8_wgrad_supports(qg.codes_t, qx.codes_t, out_dtype, len(splits_list)) == ""
    dw = fp8_wgrad(qg.codes_t, qg.scales, qx.codes_t, qx.scales, splits, T, out_dtype)
    ref = launch.fp8_grouped_wgrad(g_t=qg.codes_t, g_scales=qg.scales, x_t=qx.codes_t, x_scales=qx.scales,
                                   splits=splits, T=T, out_dtype=out_dtype)  # fmt: skip
    torch.cuda.synchronize()
    assert dw.shape == (len(splits_list), N, K)
    assert torch.equal(dw, ref), f"{int((dw != ref).sum())} of {dw.numel()} dW elements differ from the Triton kernel's"
    for e, rows in enumerate(splits_list):
        if rows == 0:
            assert (dw[e] == 0).all(), f"expert {e} has no rows: dW must be 0"
