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
    constexprs = dict(BM=BM, BN=BN, STAGES=_launch.FP8_STAGES, GROUP_N=_launch.WGRAD_GROUP_N, E_BLOCK=128)
    sig = {"g_desc": desc([BM, 128], "fp8e4nv"), "x_desc": desc([BN, 128], "fp8e4nv"),
           "gs_desc": desc([1, 2 * BM], "fp32"), "xs_desc": desc([1, BN], "fp32"), "c_desc": desc([BM, BN], c),
           "c_ptr": f"*{c}", "splits_ptr": "*i32", "E": "i32", "T": "i32", "N": "i32", "K": "i32"}  # fmt: skip
    sig.update({name: "constexpr" for name in constexprs})
    sig = {name: sig[name] for name in _wgrad.fp8_wgrad_kernel.arg_names}  # in the kernel's order
    return compile_gluon_sm90(_wgrad.fp8_wgrad_kernel, sig, constexprs, ("c_ptr", "splits_ptr", "N", "K"),
                              _engine.NUM_WARPS, _engine.MAXNREG)  # fmt: skip


@needs_gluon
@pytest.mark.parametrize("out_fp32", [False, True], ids=["bf16-dW", "fp32-dW"])
def test_offline_sm90_compile(out_fp32):
    sass, usage, shared = _compile_sm90(out_fp32)
    # The engine's register split; one product in flight a consumer, nothing spilled.
    check_fp8_consumers(sass, usage, in_flight=1)
    # The producer: the two 64-row halves of the Gᵀ block, one Xᵀ block and the two scale rows a stage.
    assert len(re.findall(r"\bUTMALDG\.2D\b", sass)) == 5
    stage = (2 * _launch.FP8_BM + _launch.BN) * 128 + (2 * _launch.FP8_BM + _launch.BN) * 4
    tiles = 2 * _launch.FP8_BM * _launch.BN * (4 if out_fp32 else 2)
    assert _launch.FP8_STAGES * stage + tiles <= shared <= 227 * 1024, shared


@pytest.mark.parametrize(
    "change, words",
    [
        pytest.param(dict(g_t=torch.zeros(64, 384, dtype=torch.bfloat16)), "e4m3", id="bf16-codes"),
        pytest.param(dict(out_dtype=torch.float16), "bf16 or fp32", id="fp16-dW"),
        pytest.param(dict(x_t=torch.zeros(12, 384).to(torch.float8_e4m3fn), out_dtype=torch.bfloat16),
                     "16-byte", id="K12-bf16"),
        pytest.param(dict(g_t=torch.zeros(66, 384).to(torch.float8_e4m3fn)), "multiple of 4", id="N66"),
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


# ---- bf16 weight gradients (moemlp.kernels.gluon.wgrad) ----


def _compile_bf16_sm90(out_fp32: bool, rows_per_expert: int, acc_scale: bool = False):
    from moemlp.kernels.gluon import _engine, _wgrad

    gl = _compat.gl
    BM, BN = _launch.WGRAD_BM, _launch.WGRAD_BN
    BK, stages = _launch._wgrad_step(torch.float32 if out_fp32 else torch.bfloat16, rows_per_expert)

    def desc(block, dtype):
        ty = {"bf16": gl.bfloat16, "fp32": gl.float32}[dtype]
        return f"tensordesc<{dtype}[{block[0]},{block[1]}],{gl.NVMMASharedLayout.get_default_for(block, ty)!r}>"

    c = "fp32" if out_fp32 else "bf16"
    constexprs = dict(BM=BM, BN=BN, BK=BK, STAGES=stages, GROUP_N=_launch.WGRAD_GROUP_N, E_BLOCK=128,
                      ACC_SCALE=acc_scale)
    sig = {"g_desc": desc([BK, BM], "bf16"), "x_desc": desc([BK, BN], "bf16"), "c_desc": desc([BM, BN], c),
           "c_ptr": f"*{c}", "acc_scale_ptr": "*fp32", "splits_ptr": "*i32", "E": "i32", "T": "i32", "N": "i32",
           "K": "i32"}
    if not acc_scale:
        constexprs["acc_scale_ptr"] = None  # the launcher's argument with the factor off
    sig.update({name: "constexpr" for name in constexprs})
    sig = {name: sig[name] for name in _wgrad.wgrad_kernel.arg_names}
    sass, usage, shared = compile_gluon_sm90(_wgrad.wgrad_kernel, sig, constexprs, ("c_ptr", "splits_ptr", "N", "K"),
                                             _engine.NUM_WARPS, _engine.MAXNREG)  # fmt: skip
    return sass, usage, shared, BK, stages


@needs_gluon
@pytest.mark.parametrize(
    "out_fp32, rows_per_expert",
    [
        pytest.param(False, 128, id="bf16-dW"),
        pytest.param(True, 128, id="fp32-dW-64-row-steps"),  # small experts: 64 rows a step, 3 stages
        pytest.param(True, 256, id="fp32-dW-32-row-steps"),  # 32 rows a step, 6 stages
    ],
)
def test_bf16_offline_sm90_compile(out_fp32, rows_per_expert):
    sass, usage, shared, BK, stages = _compile_bf16_sm90(out_fp32, rows_per_expert)
    # Each consumer's step: one BK-deep wgmma of the 128 × 128 tile = 2 × BK/16 m64n128k16, both
    # operands read through transposed views (Gᵀ M-major, X N-major), one group kept in flight (wait 1)
    # in the loop, the tile's last waited for (wait 0) before its store: no serialized chain.
    mmas = len(re.findall(r"HGMMA\.64x128x16\.F32\.BF16 [^;]*tnspA\.tnspB", sass))
    assert mmas == 2 * 2 * BK // 16, mmas
    assert len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", sass)) == 2
    assert len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", sass)) == 2
    # The masked last step's barrier is its warpgroup's (128 threads on a named barrier), not the CTA's.
    assert re.search(r"BAR\.SYNC\.DEFER_BLOCKING 0x[1-9a-f], 0x80", sass)
    loads = len(re.findall(r"\bUTMALDG\.2D\b", sass))
    assert loads in (2, 4), loads  # one G block and one X block a stage (the producer's loop peeled once)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))
    assert regs <= 168, usage
    assert local == 0 and not re.search(r"\b(STL|LDL)\b", sass), "registers spill to local memory"
    stage = (_launch.WGRAD_BM + _launch.WGRAD_BN) * BK * 2
    tiles = 2 * _launch.WGRAD_BM * _launch.WGRAD_BN * (4 if out_fp32 else 2)
    assert stages * stage + tiles <= shared <= 227 * 1024, shared


@needs_gluon
@pytest.mark.parametrize(
    "out_fp32, rows_per_expert",
    [
        pytest.param(False, 128, id="bf16-dW"),  # qwen3's dW1 and dW2 under nvfp4
        pytest.param(True, 128, id="fp32-dW-64-row-steps"),
        pytest.param(True, 256, id="fp32-dW-32-row-steps"),
    ],
)
def test_bf16_offline_sm90_compile_acc_scale(out_fp32, rows_per_expert):
    """The bf16 weight gradient with dW's factor (nvfp4's, ``wgrad(acc_scale=...)``): each consumer
    loads it once and multiplies each accumulator value by it before the store's rounding, with the
    mainloop, registers and shared memory of the kernel without it."""
    from _sm90 import check_acc_scale

    off = _compile_bf16_sm90(out_fp32, rows_per_expert)
    on = _compile_bf16_sm90(out_fp32, rows_per_expert, acc_scale=True)
    # each consumer's 128 × 128 tile of dW over its 128 threads
    check_acc_scale(off[:2], on[:2], 2 * 128)
    # shared memory: the same ring and tiles; the pointer's handoff to a partition may round up 16 bytes
    assert off[2] <= on[2] <= min(off[2] + 16, 227 * 1024), (on[2], off[2])


@pytest.mark.parametrize(
    "change, words",
    [
        pytest.param(dict(g=torch.zeros(64, 128).to(torch.float8_e4m3fn)), "bf16", id="fp8-operand"),
        pytest.param(dict(x=torch.zeros(63, 64, dtype=torch.bfloat16)), "same rows", id="rows-differ"),
        pytest.param(dict(out_dtype=torch.float16), "bf16 or fp32", id="fp16-dW"),
        pytest.param(dict(x=torch.zeros(64, 12, dtype=torch.bfloat16)), "multiple of 8", id="K12"),
        pytest.param(dict(g=torch.zeros(128, 64, dtype=torch.bfloat16)[::2]), "contiguous", id="strided"),
        pytest.param(dict(experts=257), "1 to 256 experts", id="too-many-experts"),
        pytest.param(dict(), "not CUDA", id="cpu"),
    ],
)
def test_bf16_supports_names_what_it_cannot_take(change, words):
    from moemlp.kernels.gluon import wgrad_supports

    args = dict(g=torch.zeros(64, 128, dtype=torch.bfloat16), x=torch.zeros(64, 64, dtype=torch.bfloat16),
                out_dtype=torch.bfloat16)  # fmt: skip
    args.update(change)
    assert words in wgrad_supports(**args)


def test_bf16_launcher_rejects_what_supports_names():
    from moemlp.kernels.gluon import wgrad

    g = torch.zeros(64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the engine cannot take these operands: not CUDA"):
        wgrad(g, g, torch.tensor([64]))
    with pytest.raises(TypeError, match="1-D int32 or int64"):
        wgrad(g, g, torch.tensor([64.0]))


# (splits, T, N, K): one comment per case
BF16_GPU_CASES = [
    # ragged experts, an empty one, row counts not multiples of 64 (masked last steps), N and K
    # ending in partial tiles (N % 128: a tile straddling the next expert's rows of dW)
    pytest.param([700, 0, 512, 1300, 33, 900, 400, 251], 4096, 1408 + 8, 1024 + 72, id="ragged"),
    # small experts of a few steps, some of 64, 128 or 256 rows (whole 32-row steps: no masked one)
    pytest.param([128, 1, 255, 256, 64, 63, 65, 129] * 4, 3076, 768, 512, id="small-experts"),
    pytest.param([1000], 1000, 256, 256, id="one-expert"),
    pytest.param([700, 700], 1000, 192, 128, id="splits-past-T"),  # the running sum stops at T
    pytest.param([-5, 40, 30, 0], 100, 64, 64, id="negative-split-and-capacity"),  # rows 70..99: no expert
    pytest.param([300] * 3 + [0] * 2, 900, 8, 24, id="narrow"),  # N and K below one tile
]


def _bf16_operands(splits_list, T, N, K):
    """G (T, N), X (T, K) bf16 and the splits on the GPU, seeded; skips where the engine is unavailable."""
    from moemlp.kernels.gluon import why_unavailable

    if why_unavailable():
        pytest.skip(why_unavailable())
    torch.manual_seed(0)
    g = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    return g, x, torch.tensor(splits_list, device="cuda", dtype=torch.int64)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("splits_list, T, N, K", BF16_GPU_CASES)
def test_bf16_gpu_matches_the_triton_kernel(splits_list, T, N, K, out_dtype):
    from moemlp.kernels.gemm import launch
    from moemlp.kernels.gluon import wgrad, wgrad_supports

    g, x, splits = _bf16_operands(splits_list, T, N, K)
    E = len(splits_list)
    assert wgrad_supports(g, x, out_dtype, E) == ""
    dw = wgrad(g, x, splits, out_dtype)
    ref = torch.empty_like(dw)
    launch.launch_grouped_wgrad(g=g, x=x, splits=splits, dw=ref, db=None,
                                config=launch.default_config("wgrad", 0, 0, False, 2))  # fmt: skip
    torch.cuda.synchronize()
    assert dw.shape == (E, N, K) and dw.dtype == out_dtype
    assert torch.equal(dw, ref), f"{int((dw != ref).sum())} of {dw.numel()} dW elements differ from the Triton kernel's"
    # and against float64 on the clamped rows: the chained fp32 accumulator's error, rounded once
    rows = splits.clamp(min=0).cumsum(0).clamp(max=T).tolist()
    start = 0
    for e, end in enumerate(rows):
        exact = g[start:end].double().T @ x[start:end].double()
        bound = (g[start:end].double().abs().T @ x[start:end].double().abs()) * 2.0**-20 + exact.abs() * 2.0**-8
        assert ((dw[e].double() - exact).abs() <= bound).all(), f"expert {e}"
        if end == start:
            assert (dw[e] == 0).all(), f"expert {e} has no rows: dW must be 0"
        start = end
    assert torch.equal(wgrad(g, x, splits, out_dtype), dw), "two runs on the same inputs differ"


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("splits_list, T, N, K", [BF16_GPU_CASES[1], BF16_GPU_CASES[4]])
def test_bf16_gpu_acc_scale_matches_the_triton_kernel(splits_list, T, N, K, out_dtype):
    """dW's factor (nvfp4's product of 1/S_enc, ``wgrad(acc_scale=...)``) against the Triton kernel's
    ACC_SCALE (``acc_factors``) on the same bf16 values: the same chained accumulator times the same
    fp32 factor before the one rounding, so the same bits; an empty expert's dW 0."""
    from moemlp.kernels.gemm import launch
    from moemlp.kernels.gluon import wgrad

    g, x, splits = _bf16_operands(splits_list, T, N, K)
    f = launch._product((torch.tensor(3.7e-3, device="cuda"), torch.tensor(81.37, device="cuda")))
    dw = wgrad(g, x, splits, out_dtype, acc_scale=f)
    ref = torch.empty_like(dw)
    launch.launch_grouped_wgrad(g=g, x=x, splits=splits, dw=ref, db=None, acc_factors=(f,),
                                config=launch.default_config("wgrad", 0, 0, False, 2))  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(dw, ref), f"{int((dw != ref).sum())} of {dw.numel()} dW elements differ from the Triton kernel's"
    assert not torch.equal(dw, wgrad(g, x, splits, out_dtype)), "the factor was not applied"
    for e, rows in enumerate(splits_list):
        if rows <= 0:
            assert (dw[e] == 0).all(), f"expert {e} has no rows: dW must be 0"


@pytest.mark.gpu
def test_bf16_gpu_other_experts_rows_do_not_reach_a_masked_step():
    """Rows of the next expert share the last 64-row TMA block of an expert whose row count is not a
    multiple of 64; they are zeroed in both operands, so even inf and NaN there leave dW[e] finite."""
    from moemlp.kernels.gluon import wgrad, why_unavailable

    if why_unavailable():
        pytest.skip(why_unavailable())
    torch.manual_seed(0)
    g = torch.randn(200, 128, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(200, 64, device="cuda", dtype=torch.bfloat16)
    g[100:], x[100:] = float("inf"), float("nan")  # expert 1's rows
    dw = wgrad(g, x, torch.tensor([100, 100], device="cuda"))
    exact = g[:100].double().T @ x[:100].double()
    assert torch.isfinite(dw[0]).all()
    assert ((dw[0].double() - exact).abs() <= exact.abs() * 2.0**-7 + 1e-2).all()


@needs_gluon
@pytest.mark.parametrize("with_scale", [False, True], ids=["bf16", "acc-scale"])
def test_launch_binds_each_tensor_to_its_parameter(monkeypatch, with_scale):
    """The bf16 wgrad launcher's positional arguments, bound on the CPU to the kernel's parameter names
    (``_sm90.bound_gluon_launch``; ``wgrad_supports``, which asks for CUDA tensors, passed)."""
    from _sm90 import bound_gluon_launch
    from moemlp.kernels.gluon._wgrad import wgrad_kernel

    monkeypatch.setattr(_launch, "wgrad_supports", lambda *args: "")
    T, N, K = 256, 256, 128
    g, x = torch.zeros(T, N, dtype=torch.bfloat16), torch.zeros(T, K, dtype=torch.bfloat16)
    splits = torch.tensor([T // 2, T // 2], dtype=torch.int32)
    acc_scale = torch.tensor(2.0) if with_scale else None
    dw = []
    kernel, bound, kw = bound_gluon_launch(monkeypatch, lambda: dw.append(_launch.wgrad(g, x, splits,
                                                                                     acc_scale=acc_scale)))
    assert kernel is wgrad_kernel
    assert bound["g_desc"][1] is g and bound["x_desc"][1] is x and bound["splits_ptr"] is splits
    assert bound["c_ptr"].data_ptr() == dw[0].data_ptr() and bound["c_desc"][1].data_ptr() == dw[0].data_ptr()
    assert bound["acc_scale_ptr"] is acc_scale and kw["ACC_SCALE"] is with_scale
    assert (bound["E"], bound["T"], bound["N"], bound["K"]) == (2, T, N, K)


@needs_gluon
def test_fp8_launch_binds_each_tensor_to_its_parameter(monkeypatch):
    """fp8_block's wgrad launcher: its positional arguments, bound on the CPU to the kernel's parameter
    names (``_sm90.bound_gluon_launch``), each operand and its scales on their own parameters."""
    from _sm90 import bound_gluon_launch
    from moemlp.kernels.gluon._wgrad import fp8_wgrad_kernel

    T, N, K, E = 200, 256, 384, 2
    P = (-(-T // 128) + E) * 128
    fp8 = torch.float8_e4m3fn
    g_t, x_t = torch.zeros(N, P).to(fp8), torch.zeros(K, P).to(fp8)
    g_scales, x_scales = torch.ones(P // 128, N), torch.ones(P // 128, K)
    splits = torch.tensor([120, 80], dtype=torch.int32)
    dw = []
    kernel, bound, kw = bound_gluon_launch(monkeypatch, lambda: dw.append(_launch.fp8_wgrad(
        g_t, g_scales, x_t, x_scales, splits, T)))  # fmt: skip
    assert kernel is fp8_wgrad_kernel
    assert bound["g_desc"][1] is g_t and bound["x_desc"][1] is x_t
    assert bound["gs_desc"][1] is g_scales and bound["xs_desc"][1] is x_scales
    assert bound["c_ptr"].data_ptr() == dw[0].data_ptr() and bound["splits_ptr"] is splits
    assert (bound["E"], bound["T"], bound["N"], bound["K"]) == (E, T, N, K)
