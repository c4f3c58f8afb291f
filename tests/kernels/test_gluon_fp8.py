"""fp8_block's grouped GEMM on the Gluon engine (moemlp.kernels.gluon.grouped_gemm_fp8): an offline
sm_90 compile on any machine (e4m3 wgmma, no serialized chain, registers, shared memory), the input
checks, and on an H200 the outputs against the Triton FP8 kernel (the same 128-deep products, scaled
and added in the same order: the same bits) and against the float64 emulation of test_gemm_fp8.py."""

from __future__ import annotations

import re

import pytest
import torch

from _sm90 import check_fp8_consumers, compile_gluon_sm90
from moemlp.kernels.gluon import _compat, _launch

needs_gluon = pytest.mark.skipif(bool(_compat.missing()), reason=f"triton lacks: {_compat.missing()}")


def _compile_sm90(out_fp32: bool, splits_dtype: str = "i32"):
    from moemlp.kernels.gluon import _engine

    gl = _compat.gl
    BM, BN, BK = _launch.FP8_BM, _launch.BN, _launch.FP8_BK

    def desc(block, dtype):
        ty = {"fp8e4nv": gl.float8e4nv, "bf16": gl.bfloat16, "fp32": gl.float32}[dtype]
        return f"tensordesc<{dtype}[{block[0]},{block[1]}],{gl.NVMMASharedLayout.get_default_for(block, ty)!r}>"

    c = "fp32" if out_fp32 else "bf16"
    stages = _launch._fp8_stages(torch.float32 if out_fp32 else torch.bfloat16, 256, 2)
    constexprs = dict(BM=BM, BN=BN, BK=BK, STAGES=stages, GROUP_M=_launch.GROUP_M, E_BLOCK=128)
    sig = {"a_desc": desc([BM, BK], "fp8e4nv"), "b_desc": desc([BN, BK], "fp8e4nv"), "c_desc": desc([BM, BN], c),
           "c_ptr": f"*{c}", "a_scale_ptr": "*fp32", "stride_asm": "i32", "stride_ask": "i32", "b_scale_ptr": "*fp32",
           "stride_bse": "i32", "stride_bsn": "i32", "stride_bsk": "i32", "splits_ptr": f"*{splits_dtype}",
           "E": "i32", "M": "i32", "N": "i32", "K": "i32"}  # fmt: skip
    sig.update({name: "constexpr" for name in constexprs})
    return compile_gluon_sm90(_engine.grouped_gemm_fp8_kernel, sig, constexprs, ("c_ptr", "splits_ptr", "N", "K"),
                              _engine.NUM_WARPS, _engine.MAXNREG)  # fmt: skip


@needs_gluon
@pytest.mark.parametrize("out_fp32", [False, True], ids=["bf16-out", "fp32-out"])
def test_offline_sm90_compile(out_fp32):
    sass, usage, shared = _compile_sm90(out_fp32)
    check_fp8_consumers(sass, usage)
    # The producer: two 64-row A blocks and one B block a stage.
    assert len(re.findall(r"\bUTMALDG\.2D\b", sass)) == 3
    # 6 stages (bf16 C) or 4 (fp32 C) × (2 × 64 + 128) × 128 codes + 2 epilogue tiles of 64 × 128,
    # within sm_90's 227 KiB
    stage = (2 * _launch.FP8_BM + _launch.BN) * _launch.FP8_BK
    tiles = 2 * _launch.FP8_BM * _launch.BN * (4 if out_fp32 else 2)
    stages = _launch._fp8_stages(torch.float32 if out_fp32 else torch.bfloat16, 256, 2)
    assert stages == (4 if out_fp32 else 6)
    assert stages * stage + tiles <= shared <= 227 * 1024, shared


def _operands(M=64, K=256, N=128, E=2, device="cpu"):
    a = torch.zeros(M, K, device=device).to(torch.float8_e4m3fn)
    b = torch.zeros(E, N, K, device=device).to(torch.float8_e4m3fn)
    return dict(a=a, a_scale=torch.ones(M, -(-K // 128), device=device), b=b,
                b_scale=torch.ones(E, -(-N // 128), -(-K // 128), device=device),
                splits=torch.tensor([M // 2, M // 2], dtype=torch.int32, device=device))  # fmt: skip


@pytest.mark.parametrize(
    "change, error, words",
    [
        pytest.param(dict(a=torch.zeros(64, 256, dtype=torch.bfloat16)), TypeError, "float8_e4m3fn", id="bf16-a"),
        pytest.param(dict(a_scale=torch.ones(64, 2, dtype=torch.bfloat16)), TypeError, "float32", id="bf16-scale"),
        pytest.param(dict(a_scale=torch.ones(64, 3)), ValueError, "a_scale must be (64, 2)", id="scale-shape"),
        pytest.param(dict(b_scale=torch.ones(2, 2, 2)), ValueError, "b_scale (2, 1, 2)", id="b-scale-shape"),
        pytest.param(dict(splits=torch.ones(3, dtype=torch.int32)), ValueError, "one entry per expert", id="splits"),
        pytest.param(dict(splits=torch.ones(2)), TypeError, "int32 or int64", id="float-splits"),
        pytest.param(dict(), TypeError, "one CUDA device", id="cpu-tensors"),
    ],
)
def test_input_checks(change, error, words):
    from moemlp.kernels.gluon import grouped_gemm_fp8

    args = {**_operands(), **change}
    with pytest.raises(error, match=re.escape(words)):
        grouped_gemm_fp8(args["a"], args["a_scale"], args["b"], args["b_scale"], args["splits"])


def test_k_must_suit_tma():
    from moemlp.kernels.gluon import grouped_gemm_fp8

    args = _operands(K=200)
    with pytest.raises(ValueError, match="K must be a multiple of 16"):
        grouped_gemm_fp8(args["a"], args["a_scale"], args["b"], args["b_scale"], args["splits"])


# (splits, capacity rows, K, N): ragged experts with an empty one and capacity rows, K and N ending in
# partial 128-blocks, E prime; all rows in one expert; more rows than splits (clamped)
GPU_CASES = [
    pytest.param([700, 0, 512, 1300, 33, 900, 400, 251], 64, 4096, 3584, id="mixtral-like"),
    pytest.param([300, 0, 257, 129, 1, 500, 220, 0, 90, 311, 64, 17, 128], 100, 2880 + 48, 2880 + 72, id="odd-sizes"),
    pytest.param([1000], 0, 1024, 256, id="one-expert"),
    pytest.param([0, 0, 0], 40, 256, 128, id="all-capacity"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits, cap, K, N", GPU_CASES)
def test_gpu_matches_the_triton_kernel(splits, cap, K, N, out_dtype):
    from test_gemm_fp8 import GPU_ORDER_BOUND, emulate, fp8_gemm, problem

    from moemlp.kernels.gluon import grouped_gemm_fp8, why_unavailable
    from moemlp.recipes import recipe

    if why_unavailable():
        pytest.skip(why_unavailable())
    M = sum(splits) + cap
    x, w, _ = problem(splits, M, K, N, device="cuda")
    r = recipe("fp8_block")
    qa, qb = r.quantize(x, -1), r.quantize_weight(w)
    sp = torch.tensor(splits, device="cuda")
    out = grouped_gemm_fp8(qa.codes, qa.scales, qb.codes, qb.scales, sp, out_dtype=out_dtype)
    ref = fp8_gemm(qa, qb, sp, out_dtype)
    torch.cuda.synchronize()
    assert torch.equal(out, ref), f"{int((out != ref).sum())} of {out.numel()} elements differ from the Triton kernel's"
    assert (out[sum(splits):] == 0).all(), "capacity rows"
    emu, mag = emulate(qa, qb, splits, M)
    if out_dtype == torch.float32:
        assert float(((out.double() - emu).abs() / mag.clamp(min=1e-300)).max()) <= GPU_ORDER_BOUND
    # transposed a-scale storage (DeepGEMM's layout): the same values, the same bits
    scales_t = qa.scales.t().contiguous().t()
    assert torch.equal(grouped_gemm_fp8(qa.codes, scales_t, qb.codes, qb.scales, sp, out_dtype=out_dtype), out)


# FC2_DGRAD under fp8_block (gluon.fc2_dgrad on codes): (splits, M, H, F, activation, params, G), one comment each
FC2_DGRAD_CASES = [
    pytest.param([300, 0, 5, 250, 100], 700, 256, 200, "swiglu", (), None, id="ragged-capacity"),  # F % 128 != 0
    pytest.param([131, 257, 1, 389], 778, 320, 136, "clamped_swiglu", (7.0, 1.702, 1.0), 1,
                 id="gptoss-like"),  # gate / up column by column, H ends in a partial 128-block
    pytest.param([33, 70, 0, 129, 5, 256, 17], 510, 192, 384, "swiglu", (), None, id="prime-E"),
    pytest.param([700, 700], 1000, 128, 128, "swiglu", (), None, id="splits-past-M"),  # clamped at M
]


@pytest.mark.gpu
@pytest.mark.parametrize("cooperative", [False, True], ids=["pingpong", "cooperative"])
@pytest.mark.parametrize("splits_list, M, H, F, activation, params, G", FC2_DGRAD_CASES)
def test_gpu_fc2_dgrad_matches_the_triton_kernel(splits_list, M, H, F, activation, params, G, cooperative):
    """The fused FC2_DGRAD on fp8_block's codes against the Triton kernel's FP8 mode on the same
    operands: g_z is the same sum of the same scaled 128-deep products, so g_h and z (fp32, as the
    MLP stores them under a recipe) are bitwise equal; the dprobs partials differ in their column
    order only, and each dprobs is within SPEC's 1e-6 of the Triton kernel's."""
    from moemlp._config import MLPConfig
    from moemlp.activations import ACTIVATIONS
    from moemlp.kernels import operands
    from moemlp.kernels.gemm import launch
    from moemlp.kernels.gluon import fc2_dgrad, fc2_dgrad_fp8_supports, why_unavailable
    from moemlp.recipes import recipe

    if why_unavailable():
        pytest.skip(why_unavailable())
    torch.manual_seed(0)
    dev = "cuda"
    E, G = len(splits_list), G or F
    spec = ACTIVATIONS[activation]
    r = recipe("fp8_block")
    dy = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
    h = (2 * torch.randn(M, 2 * F, device=dev)).to(torch.bfloat16)
    w2 = (torch.randn(E, H, F, device=dev) * H**-0.5).to(torch.bfloat16)
    splits = torch.tensor(splits_list, device=dev, dtype=torch.int32)
    probs = torch.rand(M, device=dev)
    a_op, b_op = operands.act(dy, r, splits), operands.Weight(w2, r).dgrad()
    codes = b_op.b.transpose(1, 2)
    pp = tuple(params) + (0.0,) * (3 - len(params))

    def nan(*shape):
        return torch.full(shape, float("nan"), device=dev)

    g_h, z = nan(M, 2 * F), nan(M, F)
    assert fc2_dgrad_fp8_supports(a_op.a, codes, h, spec.kernel_id, True, (g_h, z)) == ""
    part = fc2_dgrad(a_op.a, codes, splits, h, g_h, z=z, probs=probs, dprobs_partials=True, glu_interleave=G,
                     activation_id=spec.kernel_id, params=pp, cooperative=cooperative, dy_scale=a_op.scales,
                     w2_scale=operands._tile_scales(b_op, F, H))  # fmt: skip
    cfg = MLPConfig(spec, tuple(params), G, False)
    g_h_t, z_t = torch.empty_like(g_h), torch.empty_like(z)
    part_t = launch.launch_grouped_gemm(
        "fc2_dgrad", a=a_op.a, b=b_op.b, b_strides=b_op.strides, splits=splits, out=g_h_t, N=F, K=H, N1=2 * F,
        cfg=cfg, probs=probs, z=z_t, h=h, dprobs_partials=True, a_scales=a_op.scales, b_scales=b_op.scales,
        b_scale_strides=b_op.scale_strides,
    )  # fmt: skip
    torch.cuda.synchronize()
    routed = min(sum(splits_list), M)
    assert not torch.isnan(g_h).any() and not torch.isnan(z).any(), "g_h or z left unwritten"
    assert torch.equal(g_h, g_h_t), f"{int((g_h != g_h_t).sum())} g_h elements differ from the Triton kernel's"
    assert torch.equal(z, z_t), f"{int((z != z_t).sum())} z elements differ from the Triton kernel's"
    assert (g_h[routed:] == 0).all() and (z[routed:] == 0).all() and (part[:, routed:] == 0).all()

    def dprobs_of(p):
        d = torch.empty(M, device=dev)
        launch.launch_dprobs_reduce(partial=p, dy=dy, fc2_bias=None, splits=splits, dprobs=d, bias_term=False)
        return d

    d, d_t = dprobs_of(part)[:routed].double(), dprobs_of(part_t)[:routed].double()
    assert float(torch.linalg.vector_norm(d - d_t) / torch.linalg.vector_norm(d_t)) <= 1e-6


MLP_CASES = [
    # (E, H, F, rows, empty experts, capacity, options): the first with biases (FC2 under fp8_block
    # then stays on the Triton kernel, whose epilogue adds them), the second without
    pytest.param((8, 1024, 1408, 6000, (3,), 64, {}), id="mixtral_like-bias"),
    pytest.param((48, 1024, 384, 6000, (), 17, dict(bias=False)), id="qwen3_like"),
    # ~1500 rows an expert (one empty)
    pytest.param((4, 1024, 1408, 6000, (2,), 33, dict(bias=False)), id="large_experts"),
    # H past FC1_ENGINE_MAX_K: bf16 FC1 on the engine's cooperative tiles (G = F = 384, a multiple of
    # 128, ~600 rows an expert), or on the Triton kernel (G = F = 320; ~200 rows an expert)
    pytest.param((4, 4608, 384, 2400, (), 16, dict(bias=False)), id="wide_H"),
    pytest.param((4, 4608, 320, 2400, (), 16, dict(bias=False)), id="wide_H-G320"),
    pytest.param((12, 4608, 384, 2400, (), 16, dict(bias=False)), id="wide_H-small_experts"),
]
ENGINE_KERNELS = ("fc1", "grouped_gemm", "grouped_gemm_fp8", "fc2_dgrad", "fp8_wgrad")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", [None, "fp8_block"], ids=["bf16", "fp8_block"])
@pytest.mark.parametrize("case", MLP_CASES)
def test_gpu_mlp_same_bits_on_either_kernel(case, recipe_name, monkeypatch):
    """grouped_mlp's forward and backward with the GEMMs on the engine where it takes them and with
    MOEMLP_GLUON=0 (all on the Triton kernels): every output bitwise equal but dprobs, whose partials
    the two FC2_DGRAD kernels sum over a tile's columns in another order (within 1e-6); the engine
    ran where it should: FC1 (fp8_block; bf16 where H ≤ FC1_ENGINE_MAX_K or its cooperative tiles
    apply) and bf16's FC2_DGRAD (its weight gradients
    run on torch._grouped_mm either way), FC2 without a bias and FC1_DGRAD (bf16: cooperative 128 × 256
    tiles), and under fp8_block also both weight gradients."""
    from moemlp import kernels as K
    from moemlp._config import MLPConfig
    from moemlp.kernels import gluon
    from moemlp.kernels.gluon import _launch as gluon_launch
    from moemlp.kernels.gluon import why_unavailable
    from moemlp.kernels.operands import FC1_ENGINE_MAX_K
    from moemlp.recipes import recipe
    from test_triton_backend import GRADS, gpu_problem

    if why_unavailable():
        pytest.skip(why_unavailable())
    E, H, F, rows, empty, cap, kw = case
    t, cfg = gpu_problem(E, H, F, rows, empty, cap, **kw)
    fp8 = recipe_name is not None
    if fp8:
        cfg = MLPConfig(cfg.activation, cfg.activation_params, cfg.glu_interleave, cfg.scale_fc2_bias,
                        recipe(recipe_name))  # fmt: skip
    args = (t["splits"], t["probs"], t["fc1_weight"], t["fc2_weight"], t["fc1_bias"], t["fc2_bias"])
    calls = []
    for name in ENGINE_KERNELS:
        original = getattr(gluon, name)
        monkeypatch.setattr(gluon, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))

    def run(env):
        monkeypatch.setenv("MOEMLP_GLUON", env)
        y, h = K.grouped_mlp_fwd(t["x"], *args, cfg)
        return (y, h) + tuple(K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, (True,) * 6))

    engine = run("1")
    M = t["x"].shape[0]
    coop = cfg.glu_interleave % 128 == 0 and M >= gluon_launch.FC1_COOPERATIVE_ROWS * E
    fc1 = ["fc1"] if fp8 or H <= FC1_ENGINE_MAX_K or coop else []
    if fp8:
        fc2 = ["grouped_gemm_fp8"] if t["fc2_bias"] is None else []
        expected = [*fc1, *fc2, "fc2_dgrad", "grouped_gemm_fp8", "fp8_wgrad", "fp8_wgrad"]
    else:
        fc2 = ["grouped_gemm"] if t["fc2_bias"] is None else []
        expected = [*fc1, *fc2, "fc2_dgrad", "grouped_gemm"]
    assert calls == expected, calls
    calls.clear()
    triton_only = run("0")
    assert calls == [], calls
    torch.cuda.synchronize()
    for name, a, b in zip(("y", "h") + tuple(GRADS), engine, triton_only):
        if name == "dprobs":
            assert a.dtype == torch.float32
            assert float((a.double() - b.double()).norm() / b.double().norm()) <= 1e-6, name
        elif b is not None:
            assert torch.equal(a, b), f"{name}: {int((a != b).sum())} of {a.numel()} elements differ"


def test_stages_by_expert_size():
    # 6 stages where experts average < 1024 rows (bytes-bound) with a bf16 C, else 4: at mixtral's
    # 2048 rows an expert 6 stages measured slower; an fp32 C's tiles leave no room for 6.
    assert _launch._fp8_stages(torch.bfloat16, 256 * 128, 128) == 6
    assert _launch._fp8_stages(torch.bfloat16, 1023 * 8, 8) == 6
    assert _launch._fp8_stages(torch.bfloat16, 1024 * 8, 8) == 4
    assert _launch._fp8_stages(torch.float32, 256 * 128, 128) == 4
