"""FC1 on the Gluon engine (moemlp.kernels.gluon.fc1), bf16 and fp8_block: an offline sm_90 compile
on any machine (one wgmma chain over a tile's gate and up halves, no serialized chain, registers,
shared memory), the input checks, and on an H200 h and z against the Triton kernel on the same
operands (the same products, chained or scaled the same way, and the same GLU formulas: the same
bits)."""

from __future__ import annotations

import functools
import re

import pytest
import torch

from _sm90 import check_fp8_consumers, compile_gluon_sm90
from moemlp.activations import ACTIVATIONS
from moemlp.kernels.gluon import _compat, _launch

needs_gluon = pytest.mark.skipif(bool(_compat.missing()), reason=f"triton lacks: {_compat.missing()}")


def _compile_sm90(G: int, act: int, probs: str, z: str, bias: bool, scaled: bool = True, e_block: int = 128,
                  coop: bool = False, store_z: bool = True, acc_scale: bool = False, mx_z: bool = False):
    from moemlp.kernels.gluon import _engine, _fc1

    gl = _compat.gl
    BN = _launch.FC1_COOP_BN if coop else _launch.BN
    if scaled:
        BM, BK, stages, code, ty = _launch.FP8_BM, _launch.FP8_BK, _launch.FC1_FP8_STAGES, "fp8e4nv", gl.float8e4nv
    elif coop:
        BM, BK, stages, code, ty = _launch.BM_COOP, _launch.BK, _launch.STAGES_COOP, "bf16", gl.bfloat16
    else:
        BM, BK, stages, code, ty = _launch.FC1_BM, _launch.BK, _launch.FC1_STAGES - (z == "fp32"), "bf16", gl.bfloat16

    def desc(block, code=code, ty=ty):
        layout = gl.NVMMASharedLayout.get_default_for(block, ty)
        return f"tensordesc<{code}[{block[0]},{block[1]}],{layout!r}>"

    constexprs = dict(BM=BM, BN=BN, BK=BK, STAGES=stages, GROUP_M=_launch.GROUP_M, E_BLOCK=e_block, G=G, ACT=act,
                      HAS_BIAS=bias, HAS_PROBS=True, STORE_Z=store_z, SCALED=scaled,
                      A_PARTS=2 if scaled or coop else 1, ACC_SCALE=acc_scale, MX_Z=mx_z)
    z_ty = gl.float32 if z == "fp32" else gl.bfloat16
    sig = {"a_desc": desc([BM, BK]), "b_desc": desc([BN // 2, BK]), "h_desc": desc([BM, BN // 2], "bf16", gl.bfloat16),
           "z_desc": desc([BM, BN // 2], z, z_ty), "h_ptr": "*bf16", "z_ptr": f"*{z}",
           "bias_ptr": "*bf16", "probs_ptr": f"*{probs}", "acc_scale_ptr": "*fp32", "a_scale_ptr": "*fp32",
           "stride_asm": "i32",
           "stride_ask": "i32", "b_scale_ptr": "*fp32", "stride_bse": "i32", "stride_bsn": "i32",
           "stride_bsk": "i32", "splits_ptr": "*i32", "E": "i32", "M": "i32", "N": "i32", "K": "i32", "N1": "i32",
           "p0": "fp32", "p1": "fp32", "p2": "fp32"}  # fmt: skip
    if not acc_scale:
        constexprs["acc_scale_ptr"] = None  # the launcher's argument with the factor off
    sig.update({name: "constexpr" for name in constexprs})
    divisible = ("h_ptr", "z_ptr", "bias_ptr", "probs_ptr", "splits_ptr", "N", "K", "N1")
    return compile_gluon_sm90(_fc1.fc1_kernel, sig, constexprs, divisible, _engine.NUM_WARPS, _engine.MAXNREG)


@needs_gluon
@pytest.mark.parametrize(
    "G, act, probs, z, bias",
    [
        pytest.param(768, 0, "fp32", "fp32", False, id="swiglu-halves-fp32z"),  # the MLP under fp8_block
        pytest.param(64, 1, "bf16", "bf16", True, id="clamped-G64-bias-bf16"),
    ],
)
def test_offline_sm90_compile_fp8(G, act, probs, z, bias):
    # At up to 32 experts nothing spills. At 128 the expert table (E_BLOCK / 32 registers a field) and
    # the epilogue's values live through the mainloop take a few registers more than the consumers
    # have: ptxas keeps some in local memory, stored once and reloaded once a tile, never in the K
    # loop (20 accesses in all here for swiglu, 36 with the clamped GLU's bias; the bound of 48
    # catches a mainloop that spills, which would take hundreds).
    for e_block, tile_spills in ((32, 0), (128, 48)):
        sass, usage, shared = _compile_sm90(G, act, probs, z, bias, e_block=e_block)
        # One m64n128k32 chain a step covers the tile's gates and ups at once.
        check_fp8_consumers(sass, usage, tile_spills=tile_spills)
    # The producer: two 64-row A blocks, and the gate and the up half of the B block, a stage.
    assert len(re.findall(r"\bUTMALDG\.2D\b", sass)) == 4
    # The epilogue's TMA stores: h's gate and up halves and z, from real tiles of both consumers.
    assert len(re.findall(r"\bUTMASTG\.2D\b", sass)) == 2 * 3
    # FC1_FP8_STAGES × (2 × 64 + 128) × 128 codes + each consumer's bf16 gate and up tiles and z tile
    # of 64 × 64, within sm_90's 227 KiB
    stage = (2 * _launch.FP8_BM + _launch.BN) * _launch.FP8_BK
    tiles = 2 * _launch.FP8_BM * (_launch.BN // 2) * (2 + 2 + (4 if z == "fp32" else 2))
    assert _launch.FC1_FP8_STAGES * stage + tiles <= shared <= 227 * 1024, shared


@needs_gluon
@pytest.mark.parametrize(
    "G, act, probs, bias, z",
    [
        pytest.param(768, 0, "fp32", False, "bf16", id="swiglu-halves"),  # qwen3
        pytest.param(64, 1, "bf16", True, "bf16", id="clamped-G64-bias-bf16probs"),  # gpt-oss
        pytest.param(768, 0, "fp32", False, "fp32", id="fp32-z"),
        pytest.param(768, 0, "fp32", False, None, id="h-alone"),  # recompute_fc1's launch
    ],
)
def test_offline_sm90_compile_bf16(G, act, probs, bias, z):
    sass, usage, shared = _compile_sm90(G, act, probs, z or "bf16", bias, scaled=False, store_z=z is not None)
    # Per consumer one unpromoted chain a tile: BK / 16 = 4 bf16 wgmma of m64n128k16 a step for each
    # of the tile's two 64-row halves, one group in flight (a wait for one outstanding, and the last
    # step's wait for none), nothing serialized.
    assert len(re.findall(r"HGMMA\.64x128x16\.F32\.BF16", sass)) == 2 * 2 * (_launch.BK // 16)
    assert not re.search(r"QGMMA", sass)
    assert len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", sass)) == 2
    assert len(re.findall(r"\bUTMALDG\.2D\b", sass)) == 3  # the A block, the gate and the up half of B
    assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, 0xe8\b", sass)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))
    assert regs <= 168, usage
    assert local == 0 and not re.search(r"\b(STL|LDL)\b", sass), "registers spill to local memory"
    # h's gate and up halves (one shared tile in turn) and z, from each consumer
    assert len(re.findall(r"\bUTMASTG\.2D\b", sass)) == 2 * (3 if z else 2)
    # 5 stages (4 with an fp32 z) × (128 + 128) × 64 × 2 B + each consumer's bf16 h tile and z tile of
    # 128 × 64, within sm_90's 227 KiB: the ring's 5th stage is the room a second h tile would take.
    assert _launch.FC1_STAGES == 5
    stage = (_launch.FC1_BM + _launch.BN) * _launch.BK * 2
    tile = _launch.FC1_BM * (_launch.BN // 2) * 2
    tiles = 2 * (tile + {"bf16": tile, "fp32": 2 * tile, None: 0}[z])
    stages = _launch.FC1_STAGES - (z == "fp32")
    assert stages * stage + tiles <= shared <= 227 * 1024, shared
    assert stages * stage + tiles + 2 * tile > 227 * 1024 or z is None  # no room for a second h tile


@needs_gluon
@pytest.mark.parametrize(
    "G, act, probs, bias, store_z",
    [
        pytest.param(768, 0, "fp32", False, True, id="swiglu-halves"),  # qwen3 / mixtral / deepseek
        pytest.param(128, 1, "bf16", True, True, id="clamped-G128-bias-bf16probs"),
        pytest.param(768, 0, "fp32", False, False, id="h-alone"),  # recompute_fc1's launch
    ],
)
def test_offline_sm90_compile_bf16_cooperative(G, act, probs, bias, store_z):
    sass, usage, shared = _compile_sm90(G, act, probs, "bf16", bias, scaled=False, coop=True, store_z=store_z)
    # Per consumer one unpromoted chain a tile over its 64-row half: BK / 16 = 4 wgmma of m64n256k16 a
    # step, one group in flight (a wait for one outstanding, and the last step's wait for none).
    assert len(re.findall(r"HGMMA\.64x256x16\.F32\.BF16", sass)) == 2 * (_launch.BK // 16)
    assert not re.search(r"HGMMA\.64x128", sass)
    assert len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", sass)) == 2
    # The producer: two 64-row A blocks, the gate and the up half of the B block, a stage.
    assert len(re.findall(r"\bUTMALDG\.2D\b", sass)) == 4
    assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, 0xe8\b", sass)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))
    assert regs <= 168, usage
    assert local == 0 and not re.search(r"\b(STL|LDL)\b", sass), "registers spill to local memory"
    # h's gate and up halves (one shared tile in turn) and z, from each consumer.
    assert len(re.findall(r"\bUTMASTG\.2D\b", sass)) == 2 * (3 if store_z else 2)
    # 3 stages × (2 × 64 + 256) × 64 × 2 B + each consumer's bf16 h tile and z tile (with z) of
    # 64 × 128, within sm_90's 227 KiB
    stage = (2 * _launch.BM_COOP + _launch.FC1_COOP_BN) * _launch.BK * 2
    tiles = 2 * (1 + store_z) * _launch.BM_COOP * (_launch.FC1_COOP_BN // 2) * 2
    assert _launch.STAGES_COOP * stage + tiles <= shared <= 227 * 1024, shared


@functools.cache
def _triton_fc1_contracts() -> bool:
    """Whether the Triton kernel's FC1, as an nvfp4 step runs it at mixtral's shape (bf16 values,
    bias, fp32 probs and z, gate / up halves) compiled for sm_90, contracts each accumulator value's
    factor multiply with its bias add into one fma (True) or keeps a multiply and an add (False);
    anything else fails here."""
    from _sm90 import compile_sm90, op_counts
    from moemlp.kernels.gemm import grouped, launch

    F, H = 1408, 1024
    cfg = launch.default_config("fc1", F, H, True, 2, emulated=True)
    ptr = {name: "*bf16" for name in ("a_ptr", "b_ptr", "out_ptr", "h_ptr", "bias_ptr")}
    ptr.update(splits_ptr="*i64", probs_ptr="*fp32", z_ptr="*fp32")
    desc = {"a_desc": f"tensordesc<bf16[{cfg.BM}, {cfg.BK}]>", "b_desc": f"tensordesc<bf16[1, {cfg.BN}, {cfg.BK}]>"}
    counts = []
    for acc_scale in (False, True):
        const = dict(EPILOGUE=0, ACT=ACTIVATIONS["swiglu"].kernel_id, GLU=True, HAS_PROBS=True, HAS_BIAS=True,
                     SCALE_BIAS=False, STORE_Z=True, STORE_PARTIAL=False, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK,
                     GROUP_M=cfg.GROUP_M, E_BLOCK=32, INTERPRETED=False, DOT_PRECISION="tf32", USE_TMA=True,
                     B_KMAJOR=True, SUBTILE=cfg.SUBTILE, PROMOTE=False, FP8=False, ACC_SCALE=acc_scale,
                     B_SCALE_SCALAR=False, PAIRED=False, G=F)  # fmt: skip
        sass = compile_sm90(grouped.grouped_gemm_kernel, const, ptr, desc, cfg.num_warps, cfg.num_stages)[1]
        counts.append(op_counts(sass, "FMUL", "FFMA", "FADD"))
    delta = tuple(counts[1][op] - counts[0][op] for op in ("FMUL", "FFMA", "FADD"))
    # 128 × 256 gate and up accumulators over 256 threads: 128 values a thread
    assert delta in ((0, 128, -128), (128, 0, 0)), (delta, counts[0])
    return delta[0] == 0


@needs_gluon
@pytest.mark.parametrize(
    "G, act, probs, z, bias, coop",
    [
        pytest.param(768, 0, "fp32", "fp32", False, False, id="qwen3-nvfp4"),  # fp32 z: ping-pong tiles
        pytest.param(1408, 0, "fp32", "fp32", True, False, id="mixtral-nvfp4-bias"),
        pytest.param(64, 1, "bf16", "bf16", True, False, id="clamped-G64-bias-bf16z"),
        pytest.param(768, 0, "fp32", "bf16", False, True, id="cooperative"),
    ],
)
def test_offline_sm90_compile_acc_scale(G, act, probs, z, bias, coop):
    """bf16 FC1 with the accumulator factor (nvfp4's, ``fc1(acc_scale=...)``): each consumer loads it
    once and multiplies each of its accumulator values by it before the epilogue, with the mainloop,
    registers and no spill of the kernel without it. With a bias the multiply and the bias add after
    it compile as the Triton kernel's do, both into one fma or both apart (h's bits would differ
    otherwise: one rounding of acc·f + b1 or two); triton 3.6 and 3.9 contract them, by their
    default FP fusion."""
    from _sm90 import check_acc_scale

    off = _compile_sm90(G, act, probs, z, bias, scaled=False, coop=coop)
    on = _compile_sm90(G, act, probs, z, bias, scaled=False, coop=coop, acc_scale=True)
    # a consumer's 128 × 128 (ping-pong) or 64 × 256 (cooperative) accumulator over its 128 threads
    check_acc_scale(off[:2], on[:2], 2 * 128, fused=bias and _triton_fc1_contracts())
    # shared memory: the same ring and tiles; the pointer's handoff to a partition may round up 16 bytes
    assert off[2] <= on[2] <= min(off[2] + 16, 227 * 1024), (on[2], off[2])


def _codes(*shape):
    return torch.zeros(*shape).to(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "change, words",
    [
        pytest.param(dict(activation_id=3), "swiglu and clamped_swiglu", id="geglu"),
        pytest.param(dict(x=torch.zeros(64, 256, dtype=torch.bfloat16)), "both bf16 or both e4m3", id="mixed"),
        pytest.param(dict(x=_codes(64, 200), w1=_codes(2, 256, 200)), "16-byte rows", id="odd-H"),
        pytest.param(dict(glu_interleave=32), "multiple of 64", id="G32"),
        pytest.param(dict(glu_interleave=192), "dividing F", id="G-not-dividing-F"),
        pytest.param(dict(z=torch.zeros(64, 128, dtype=torch.float16)), "bf16 or fp32", id="fp16-z"),
        pytest.param(dict(h=torch.zeros(64 * 256 + 1, dtype=torch.bfloat16)[1:].view(64, 256)), "16-byte aligned",
                     id="h-unaligned"),
        pytest.param(dict(z=torch.zeros(64 * 128 + 1)[1:].view(64, 128)), "16-byte aligned", id="z-unaligned"),
        pytest.param(dict(), "not a CUDA tensor", id="cpu"),
    ],
)
def test_supports_names_what_it_cannot_take(change, words):
    from moemlp.kernels.gluon import fc1_supports

    args = dict(x=_codes(64, 256), w1=_codes(2, 256, 256), h=torch.zeros(64, 256, dtype=torch.bfloat16),
                z=torch.zeros(64, 128), activation_id=0, glu=True, glu_interleave=128)  # fmt: skip
    args.update(change)
    reason = fc1_supports(**args)
    assert words in reason, reason


@pytest.mark.parametrize(
    "scales, words",
    [
        pytest.param((torch.ones(64, 2), torch.ones(2, 1, 2)), r"w1_scale \(2, 2, 2\)", id="shape"),
        pytest.param((torch.ones(64, 2), None), "come together", id="one-of-two"),
    ],
)
def test_scales_are_checked(scales, words):
    from moemlp.kernels.gluon import fc1

    x, w1 = _codes(64, 256), _codes(2, 256, 256)
    with pytest.raises(ValueError, match=words):
        fc1(x, w1, torch.zeros(2, dtype=torch.int32), torch.zeros(64, 256, dtype=torch.bfloat16), z=None, bias=None,
            probs=None, glu_interleave=128, activation_id=0, params=(0.0, 0.0, 0.0), x_scale=scales[0],
            w1_scale=scales[1])  # fmt: skip


@needs_gluon
@pytest.mark.parametrize("optional", [False, True], ids=["bare", "bias-probs-z-acc-scale"])
def test_launch_binds_each_tensor_to_its_parameter(monkeypatch, optional):
    """The launcher's positional arguments, bound on the CPU to the kernel's parameter names
    (``_sm90.bound_gluon_launch``): each tensor lands on the parameter of its name."""
    from _sm90 import bound_gluon_launch
    from moemlp.kernels.gluon import fc1
    from moemlp.kernels.gluon._fc1 import fc1_kernel

    M, H, F = 256, 128, 128
    x, w1 = torch.zeros(M, H, dtype=torch.bfloat16), torch.zeros(2, 2 * F, H, dtype=torch.bfloat16)
    h = torch.zeros(M, 2 * F, dtype=torch.bfloat16)
    z = torch.zeros(M, F, dtype=torch.bfloat16) if optional else None
    bias = torch.zeros(2, 2 * F, dtype=torch.bfloat16) if optional else None
    probs = torch.zeros(M) if optional else None
    acc_scale = torch.tensor(2.0) if optional else None
    splits = torch.tensor([M // 2, M // 2], dtype=torch.int32)
    kernel, bound, kw = bound_gluon_launch(monkeypatch, lambda: fc1(
        x, w1, splits, h, z=z, bias=bias, probs=probs, glu_interleave=F, activation_id=0, params=(0.5, 0.25, 0.125),
        acc_scale=acc_scale))  # fmt: skip
    assert kernel is fc1_kernel
    assert bound["a_desc"] == ("desc", x) and bound["h_ptr"] is h and bound["splits_ptr"] is splits
    assert bound["acc_scale_ptr"] is acc_scale and kw["ACC_SCALE"] is optional
    assert (kw["HAS_BIAS"], kw["HAS_PROBS"], kw["STORE_Z"]) == (optional,) * 3
    if optional:
        assert bound["z_ptr"] is z and bound["bias_ptr"] is bias and bound["probs_ptr"] is probs
    assert (bound["E"], bound["M"], bound["N"], bound["K"], bound["N1"]) == (2, M, F, H, 2 * F)
    assert (bound["p0"], bound["p1"], bound["p2"]) == (0.5, 0.25, 0.125)


# (splits, M, H, F, G, activation, params, bias, probs dtype, z dtype): one comment each
GPU_CASES = [
    pytest.param([700, 0, 512, 1300, 33, 900, 400, 251], 4163, 1024, 1408, None, "swiglu", (), False, torch.float32,
                 torch.float32, id="mixtral-like"),  # gate / up halves, 64 capacity rows, z fp32 (a recipe's)
    pytest.param([300, 0, 257, 129, 1, 500, 220], 1507, 2880 + 48, 384, 64, "clamped_swiglu", (7.0, 1.702, 1.0), True,
                 torch.bfloat16, torch.bfloat16, id="G64-bias-odd-H"),  # H ends in a partial 128-block
    pytest.param([1000], 1000, 256, 128, 128, "swiglu", (), True, torch.float32, torch.float32, id="one-expert"),
    pytest.param([0, 0, 0], 40, 256, 128, None, "swiglu", (), False, torch.float32, torch.float32,
                 id="all-capacity"),
    pytest.param([700, 700], 1000, 128, 192, None, "swiglu", (), False, torch.float32, torch.float32,
                 id="splits-past-M"),  # the running sum is clamped at M; F = 3 tiles of 64
    pytest.param([300, 0, 257], 600, 512, 192, 64, "swiglu", (), False, torch.float32, None,
                 id="h-alone"),  # recompute_fc1's launch; bf16: ping-pong, boundary tiles, 43 capacity rows
]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8_block"])
@pytest.mark.parametrize("splits_list, M, H, F, G, activation, params, bias, probs_dtype, z_dtype", GPU_CASES)
def test_gpu_matches_the_triton_kernel(splits_list, M, H, F, G, activation, params, bias, probs_dtype, z_dtype, fp8):
    # bf16 here with an fp32 z, no z or G = 64 or 192: the ping-pong tiles (5 stages, 4 with an fp32 z)
    _check_against_triton(splits_list, M, H, F, G, activation, params, bias, probs_dtype, z_dtype, fp8, None)


# bf16 on cooperative tiles (G a multiple of 128, z bf16 or none); the same columns as GPU_CASES
COOP_CASES = [
    pytest.param([700, 0, 512, 1300, 33, 900, 400, 251], 4163, 1024, 1408, None, "swiglu", (), False, torch.float32,
                 torch.bfloat16, id="mixtral-like"),  # gate / up halves, boundary tiles, 64 capacity rows
    pytest.param([300, 0, 257, 129, 1, 500, 220], 1507, 2880 + 48, 384, 128, "clamped_swiglu", (7.0, 1.702, 1.0),
                 True, torch.bfloat16, torch.bfloat16, id="G128-bias-odd-H"),  # 3 gate / up blocks of 128
    pytest.param([1000], 1000, 256, 128, 128, "swiglu", (), True, torch.float32, None, id="h-alone"),
    pytest.param([0, 0, 0], 40, 256, 128, None, "swiglu", (), False, torch.float32, torch.bfloat16,
                 id="all-capacity"),
    pytest.param([700, 700], 1000, 128, 256, None, "swiglu", (), False, torch.float32, torch.bfloat16,
                 id="splits-past-M"),  # the running sum is clamped at M; F = 2 tiles of 128
]


@pytest.mark.gpu
@pytest.mark.parametrize("splits_list, M, H, F, G, activation, params, bias, probs_dtype, z_dtype", COOP_CASES)
def test_gpu_cooperative_matches_the_triton_kernel(splits_list, M, H, F, G, activation, params, bias, probs_dtype,
                                                   z_dtype):  # fmt: skip
    _check_against_triton(splits_list, M, H, F, G, activation, params, bias, probs_dtype, z_dtype, False, True)


# bf16 with nvfp4's accumulator factor: (cases of GPU_CASES and COOP_CASES, cooperative)
ACC_SCALE_CASES = [
    pytest.param(*GPU_CASES[0].values, False, id="mixtral-like-fp32z"),  # nvfp4's FC1: fp32 z, ping-pong tiles
    pytest.param(*GPU_CASES[1].values, False, id="G64-bias-odd-H"),  # a bias: acc·f + b1
    pytest.param(*COOP_CASES[1].values, True, id="cooperative-G128-bias-odd-H"),
    pytest.param(*GPU_CASES[3].values, False, id="all-capacity"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("splits_list, M, H, F, G, activation, params, bias, probs_dtype, z_dtype, cooperative",
                         ACC_SCALE_CASES)  # fmt: skip
def test_gpu_acc_scale_matches_the_triton_kernel(splits_list, M, H, F, G, activation, params, bias, probs_dtype,
                                                 z_dtype, cooperative):  # fmt: skip
    """``acc_scale`` (nvfp4's product of 1/S_enc) against the Triton kernel's ACC_SCALE on the same
    bf16 values: h and z bit for bit (the factor's multiply and a bias add compile alike in both,
    test_offline_sm90_compile_acc_scale)."""
    _check_against_triton(splits_list, M, H, F, G, activation, params, bias, probs_dtype, z_dtype, False, cooperative,
                          acc_scale=True)  # fmt: skip


# mxfp8's z values from the epilogue (z bf16): (cases of GPU_CASES and COOP_CASES with a bf16 z, cooperative)
MX_Z_CASES = [
    pytest.param(*GPU_CASES[1].values[:-1], torch.bfloat16, False, id="G64-bias-odd-H"),  # ping-pong, boundary tiles
    pytest.param(*GPU_CASES[4].values[:-1], torch.bfloat16, False, id="splits-past-M"),  # F = 3 ping-pong tiles
    pytest.param(*COOP_CASES[0].values, True, id="cooperative-mixtral-like"),  # 4 blocks a tile row, capacity rows
    pytest.param(*COOP_CASES[1].values, True, id="cooperative-G128-bias-odd-H"),
    pytest.param(*COOP_CASES[3].values, True, id="all-capacity"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("splits_list, M, H, F, G, activation, params, bias, probs_dtype, z_dtype, cooperative",
                         MX_Z_CASES)  # fmt: skip
def test_gpu_z_mx_is_the_rowwise_pass_of_the_fp32_z(splits_list, M, H, F, G, activation, params, bias, probs_dtype,
                                                    z_dtype, cooperative):  # fmt: skip
    """``z_mx``: the bf16 z the epilogue writes is the Triton kernel's fp32 z through mxfp8's rowwise
    pass (``dequantized(z, mxfp8)``, as the step ran it), bit for bit; h the Triton kernel's."""
    _check_against_triton(splits_list, M, H, F, G, activation, params, bias, probs_dtype, z_dtype, False, cooperative,
                          z_mx=True)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("x_scale", [2.0**-59, 2.0**64], ids=["tiny", "overflowing"])
@pytest.mark.parametrize("case", [MX_Z_CASES[1].values, MX_Z_CASES[2].values], ids=["ping-pong", "cooperative"])
def test_gpu_z_mx_at_tiny_and_overflowing_blocks(case, x_scale):
    """``z_mx``'s e8m0 arithmetic at its ends, against the rowwise pass as bits. x·2^-59 makes z
    about 2^-118·p: blocks whose s = amax/448 is subnormal, on both sides of 2^-127 (e = 0 and
    e = 1). x·2^64 makes z about 2^128: blocks with an inf amax (e = 254, 2^-127) beside finite ones.
    Either way one NaN sits in each row's first block, which the block amax must ignore. The Triton
    kernel's fp32 z must reach those ends, or the case proves nothing."""
    z32 = _check_against_triton(*case[:-1], False, case[-1], z_mx=True, x_scale=x_scale)
    routed = z32[: min(sum(case[0]), case[1])]
    blocks = routed.reshape(routed.shape[0], -1, 32).abs().nan_to_num(nan=0.0, posinf=float("inf")).amax(-1)
    s_bits = (blocks * (1.0 / 448)).view(torch.int32)
    if x_scale < 1:
        assert ((s_bits > 0) & (s_bits <= 0x400000)).any() and ((s_bits > 0x400000) & (s_bits < 0x800000)).any()
    else:
        assert torch.isinf(blocks).any() and torch.isfinite(blocks).any()
    assert torch.isnan(routed[:, 5]).all() and not torch.isnan(routed[:, 6:32]).any()


@needs_gluon
@pytest.mark.parametrize("coop", [False, True], ids=["ping-pong", "cooperative"])
def test_offline_sm90_compile_z_mx(coop):
    """``z_mx`` on bf16 tiles: the same mainloop, registers (no spill) and shared memory as without it;
    the epilogue's e4m3 codes by the hardware conversion, two values an instruction, over a
    consumer's 8192 z values (ping-pong 128 × 64, cooperative 64 × 128) on its 128 threads, and the
    1×32 blocks' amax across the 4 threads that share a row's columns (shuffles, no barrier more)."""
    off = _compile_sm90(768, 0, "fp32", "bf16", False, scaled=False, coop=coop)
    on = _compile_sm90(768, 0, "fp32", "bf16", False, scaled=False, coop=coop, mx_z=True)
    for sass, usage, _ in (off, on):
        assert int(re.search(r"LOCAL:(\d+)", usage).group(1)) == 0 and not re.search(r"\b(STL|LDL)\b", sass)
    assert re.search(r"REG:(\d+)", on[1]).group(1) == re.search(r"REG:(\d+)", off[1]).group(1)
    assert on[2] == off[2]
    assert len(re.findall(r"F2FP\.SATFINITE\.E4M3", on[0])) == 2 * 8192 // 128 // 2
    assert not re.search(r"E4M3", off[0])
    for op in ("HGMMA", "BAR.SYNC", "UTMASTG"):
        assert on[0].count(op) == off[0].count(op), op
    assert on[0].count("SHFL") > off[0].count("SHFL")


@pytest.mark.parametrize(
    "change, words",
    [
        pytest.param(dict(glu_interleave=64), "multiple of 128", id="G64"),
        pytest.param(dict(z=torch.zeros(64, 128)), "bf16 z or none", id="fp32-z"),
        pytest.param(dict(x=_codes(64, 256), w1=_codes(2, 256, 256), x_scale=torch.ones(64, 2),
                          w1_scale=torch.ones(2, 2, 2)), "bf16 operands", id="fp8"),  # fmt: skip
    ],
)
def test_cooperative_is_checked(change, words):
    from moemlp.kernels.gluon import fc1

    args = dict(x=torch.zeros(64, 256, dtype=torch.bfloat16), w1=torch.zeros(2, 256, 256, dtype=torch.bfloat16),
                splits=torch.zeros(2, dtype=torch.int32), h=torch.zeros(64, 256, dtype=torch.bfloat16),
                z=torch.zeros(64, 128, dtype=torch.bfloat16), bias=None, probs=None, glu_interleave=128,
                activation_id=0, params=(0.0, 0.0, 0.0))  # fmt: skip
    args.update(change)
    with pytest.raises(ValueError, match=words):
        fc1(**args, cooperative=True)
    with pytest.raises(TypeError, match="True, False or None"):
        fc1(**args, cooperative="yes")


def test_cooperative_by_default_on_large_experts():
    from moemlp.kernels.gluon import fc1_cooperative

    rows = _launch.FC1_COOPERATIVE_ROWS
    assert fc1_cooperative(8 * rows, 8, False, False, 128)
    assert not fc1_cooperative(8 * rows - 1, 8, False, False, 128)  # experts below the threshold: ping-pong
    assert not fc1_cooperative(8 * rows, 8, False, False, 64)
    assert not fc1_cooperative(8 * rows, 8, False, True, 128)  # an fp32 z
    assert not fc1_cooperative(8 * rows, 8, True, False, 128)  # fp8_block


def _check_against_triton(splits_list, M, H, F, G, activation, params, bias, probs_dtype, z_dtype, fp8, cooperative,
                          acc_scale=False, z_mx=False, x_scale=1.0):  # fmt: skip
    """h and z against the Triton kernel's, bit for bit; returns the Triton kernel's fp32 z under
    ``z_mx`` (before the rowwise pass). ``x_scale`` (a power of two, not 1) scales x, to reach tiny or
    overflowing z, and makes W1's gate row 5 NaN, so that each row's first 1×32 block of z holds one
    NaN among finite values; the outputs then start as a NaN that no arithmetic makes and are compared
    as bits, so a NaN the kernels compute alike compares equal and one left unwritten does not."""
    from moemlp._config import MLPConfig
    from moemlp.kernels import operands
    from moemlp.kernels.gemm import launch
    from moemlp.kernels.gluon import fc1, fc1_supports, why_unavailable
    from moemlp.recipes import recipe

    if why_unavailable():
        pytest.skip(why_unavailable())
    torch.manual_seed(0)
    dev = "cuda"
    E, G = len(splits_list), G or F
    spec = ACTIVATIONS[activation]
    r = recipe("fp8_block") if fp8 else None
    x = torch.randn(M, H, device=dev, dtype=torch.bfloat16) * x_scale
    w1 = (torch.randn(E, 2 * F, H, device=dev) * H**-0.5).to(torch.bfloat16)
    if x_scale != 1.0:
        w1[:, 5] = float("nan")  # gate column 5 of h (G = F here: gates are W1's first F rows)
    b1 = torch.randn(E, 2 * F, device=dev, dtype=torch.bfloat16) if bias else None
    probs = torch.rand(M, device=dev).to(probs_dtype)
    splits = torch.tensor(splits_list, device=dev, dtype=torch.int32)
    a_op, b_op = operands.act(x, r, splits), operands.Weight(w1, r).forward()
    pp = tuple(params) + (0.0,) * (3 - len(params))
    h = torch.full((M, 2 * F), float("nan"), device=dev, dtype=torch.bfloat16)
    z = None if z_dtype is None else torch.full((M, F), float("nan"), device=dev, dtype=z_dtype)
    if x_scale != 1.0:  # bf16 0x7FBB: a NaN payload that no conversion produces
        h.view(torch.int16).fill_(0x7FBB)
        if z is not None:
            assert z_dtype == torch.bfloat16
            z.view(torch.int16).fill_(0x7FBB)
    assert fc1_supports(a_op.a, b_op.b, h, z, spec.kernel_id, True, G) == ""
    scales = dict(x_scale=a_op.scales, w1_scale=operands._tile_scales(b_op, 2 * F, H)) if fp8 else {}
    # nvfp4's factors: a product of two, neither a power of two, on the device
    f = launch._product((torch.tensor(3.7e-3, device=dev), torch.tensor(81.37, device=dev))) if acc_scale else None
    if acc_scale:
        scales["acc_scale"] = f
    if z_mx:
        scales["z_mx"] = True
    fc1(a_op.a, b_op.b, splits, h, z=z, bias=b1, probs=probs, glu_interleave=G, activation_id=spec.kernel_id,
        params=pp, cooperative=cooperative, **scales)  # fmt: skip
    h_t = torch.empty_like(h)
    # z_mx: the Triton kernel's fp32 z, then the rowwise mxfp8 pass the step ran before (its bf16 values)
    z_t = None if z is None else torch.empty(z.shape, device=dev, dtype=torch.float32 if z_mx else z.dtype)
    launch.launch_grouped_gemm(
        "fc1", a=a_op.a, b=b_op.b, b_strides=b_op.strides, splits=splits, out=h_t, N=F, K=H, N1=2 * F,
        cfg=MLPConfig(spec, tuple(params), G, False), probs=probs, bias=b1, z=z_t, a_scales=a_op.scales,
        b_scales=b_op.scales, b_scale_strides=b_op.scale_strides, acc_factors=(f,),
    )  # fmt: skip
    z32 = z_t
    if z_mx:
        from moemlp.kernels.quant import api as kq

        z_t = kq.dequantized(z_t, recipe("mxfp8"), -1, out_dtype=torch.bfloat16, tiny_blocks_exact=False)[0]
    torch.cuda.synchronize()
    routed = min(sum(splits_list), M)
    if x_scale != 1.0:
        pairs = [("h", h, h_t)] + ([] if z is None else [("z", z, z_t)])
        for name, got, want in pairs:
            differ = int((got.view(torch.int16) != want.view(torch.int16)).sum())
            assert differ == 0, f"{differ} of {got.numel()} {name} elements' bits differ from the Triton kernel's"
    else:
        assert not torch.isnan(h).any(), "h left unwritten"
        assert torch.equal(h, h_t), f"{int((h != h_t).sum())} of {h.numel()} h elements differ from the Triton kernel's"
        if z is not None:
            assert not torch.isnan(z).any(), "z left unwritten"
            differ = int((z != z_t).sum())
            assert torch.equal(z, z_t), f"{differ} of {z.numel()} z elements differ from the Triton kernel's"
    assert (h[routed:] == 0).all(), "capacity rows of h"
    if z is not None:
        assert (z[routed:] == 0).all(), "capacity rows of z"
    return z32
