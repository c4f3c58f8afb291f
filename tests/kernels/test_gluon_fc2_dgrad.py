"""FC2_DGRAD on the Gluon engine (moemlp.kernels.gluon.fc2_dgrad): an offline sm_90 compile on any
machine, and on an H200 its outputs against float64 and against the Triton kernel it replaces, which
runs the same promoted arithmetic: g_h and z bitwise equal, dprobs within SPEC's 1e-6."""

from __future__ import annotations

import re

import pytest
import torch

from _sm90 import check_fp8_consumers, check_products_in_flight, compile_gluon_sm90, wgmma_groups
from moemlp.activations import ACTIVATIONS
from moemlp.kernels.gluon import _compat, _launch

needs_gluon = pytest.mark.skipif(bool(_compat.missing()), reason=f"triton lacks: {_compat.missing()}")


def _compile_sm90(b_kmajor: bool, G: int, act: int, probs: str, a_parts: int = 1, scaled: bool = False,
                  regs: bool = False, epi: bool = False, acc_scale: bool = False):
    """Compiles the fused FC2_DGRAD for sm_90 without a GPU; returns (sass, -res-usage, shared bytes).
    ``scaled``: fp8_block's kernel (e4m3 codes, 128-deep scaled steps, fp32 g_h and z); ``epi``: the
    epilogue warpgroup beside the cooperative consumers; ``acc_scale``: g_z times a factor read from
    memory (nvfp4's)."""
    from moemlp.kernels.gluon import _engine, _fc2_dgrad

    gl = _compat.gl
    BM, BN = _launch.BM_PROMOTED, _launch.BN
    BK = _launch.FP8_BK if scaled else _launch.BK
    code, ty = ("fp8e4nv", gl.float8e4nv) if scaled else ("bf16", gl.bfloat16)
    out = "fp32" if scaled else "bf16"

    def desc(block, code=code, ty=ty):
        return f"tensordesc<{code}[{block[0]},{block[1]}],{gl.NVMMASharedLayout.get_default_for(block, ty)!r}>"

    chain = 1 if scaled else _launch.PROMOTE_DEPTH // BK
    stages = _launch._dgrad_stages(a_parts == 2 or epi, scaled, regs, G)
    constexprs = dict(BM=BM, BN=BN, BK=BK, STAGES=stages, GROUP_M=_launch.GROUP_M, E_BLOCK=128,
                      B_KMAJOR=b_kmajor, CW=_launch.DGRAD_CW, G=G, CHAIN=chain, ACT=act, HAS_PROBS=True,
                      STORE_Z=True, STORE_PARTIAL=True, A_PARTS=a_parts, SCALED=scaled, REGS=regs,
                      EPI_WG=epi, ACC_SCALE=acc_scale)  # fmt: skip
    out_desc = desc([BM, BN], "bf16", gl.bfloat16)
    sig = {"a_desc": desc([BM, BK]), "b_desc": desc([BN, BK] if b_kmajor else [BK, BN]), "h_desc": out_desc,
           "gh_desc": out_desc, "z_desc": out_desc, "h_ptr": "*bf16",
           "gh_ptr": f"*{out}", "z_ptr": f"*{out}", "probs_ptr": f"*{probs}", "part_ptr": "*fp32",
           "acc_scale_ptr": "*fp32", "a_scale_ptr": "*fp32", "stride_asm": "i32", "stride_ask": "i32",
           "b_scale_ptr": "*fp32", "stride_bse": "i32", "stride_bsn": "i32", "stride_bsk": "i32",
           "splits_ptr": "*i32", "E": "i32", "M": "i32", "N": "i32", "K": "i32", "N1": "i32",
           "p0": "fp32", "p1": "fp32", "p2": "fp32"}  # fmt: skip
    if not acc_scale:
        constexprs["acc_scale_ptr"] = None  # the launcher's argument with the factor off
    sig.update({name: "constexpr" for name in constexprs})
    divisible = ("h_ptr", "gh_ptr", "z_ptr", "probs_ptr", "part_ptr", "splits_ptr", "N", "K", "N1")
    return compile_gluon_sm90(_fc2_dgrad.fc2_dgrad_kernel, sig, constexprs, divisible, _engine.NUM_WARPS,
                              _engine.EPI_MAXNREG if epi else _engine.MAXNREG)


@needs_gluon
@pytest.mark.parametrize(
    "b_kmajor, G, act, probs, a_parts",
    [
        pytest.param(False, 768, 0, "fp32", 1, id="swiglu-halves"),  # qwen3 / mixtral / deepseek: W2 (E, H, F)
        pytest.param(True, 1, 1, "fp32", 1, id="clamped-interleaved-T"),  # gpt-oss: W2 read transposed, G = 1
        pytest.param(False, 64, 0, "bf16", 1, id="swiglu-G64-bf16probs"),  # 64-column GLU blocks, bf16 probs
        pytest.param(False, 768, 0, "fp32", 2, id="swiglu-halves-cooperative"),  # 128-row tiles, both at once
        pytest.param(True, 1, 1, "fp32", 2, id="clamped-interleaved-T-cooperative"),
    ],
)
def test_offline_sm90_compile(b_kmajor, G, act, probs, a_parts):
    sass, usage, shared = _compile_sm90(b_kmajor, G, act, probs, a_parts)
    # Promoted 64-row tiles (or 64-row halves of a cooperative tile), per warpgroup: two products
    # of CHAIN steps of BK/16 m64n128k16 wgmma in flight, an odd one, and the one-step product of a
    # K that ends mid-chain; each product from zero, and no wgmma waited for before the next one is
    # issued but the last one's (ptxas serialized nothing).
    chain = _launch.PROMOTE_DEPTH // _launch.BK
    assert chain == 2
    check_products_in_flight(sass, "HGMMA.64x128x16.F32.BF16", _launch.BK // 16, chain, tail=True)
    assert re.search(r"USETMAXREG\.DEALLOC\.CTAPOOL 0x28\b", sass)
    assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, 0xe8\b", sass)
    if G % 8 == 0:
        # h's gate / up columns are contiguous runs of G: 16-byte vector loads and stores.
        assert re.search(r"\bLDG\.E\.128\b", sass) and re.search(r"\bSTG\.E\.128\b", sass)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))
    assert regs <= 168, usage
    assert local == 0 and not re.search(r"\b(STL|LDL)\b", sass), "registers spill to local memory"
    # 6 stages × 24 KiB (ping-pong, G > 1) or 5 × 24 KiB (ping-pong, G = 1) or 4 × 32 KiB (cooperative:
    # two 64-row A blocks) + 2 fp32 epilogue tiles × 32 KiB + barriers, within sm_90's 227 KiB a CTA
    stage = (a_parts * _launch.BM_PROMOTED + _launch.BN) * _launch.BK * 2
    stages = _launch._dgrad_stages(a_parts == 2, False, False, G)
    assert stages == ((6 if G > 1 else 5) if a_parts == 1 else 4)
    assert stages * stage + 64 * 1024 <= shared <= 227 * 1024, shared


@needs_gluon
@pytest.mark.parametrize("a_parts", [1, 2], ids=["pingpong", "cooperative"])
@pytest.mark.parametrize("act", [0, 1], ids=["swiglu", "clamped"])
def test_offline_sm90_compile_register_epilogue(a_parts, act):
    """The epilogue in the accumulator's layout (bf16, G a multiple of 128): the same promoted
    mainloop, no spill, h's gate and up tiles by TMA and g_h's halves and z out by TMA (a consumer's
    two loads and three stores, both consumers), the fp32 staging tiles gone: the ring plus each
    consumer's bf16 gate, up and z tiles of 64 × 128, within 227 KiB."""
    sass, usage, shared = _compile_sm90(False, 768, act, "fp32", a_parts, regs=True)
    check_products_in_flight(sass, "HGMMA.64x128x16.F32.BF16", _launch.BK // 16, 2, tail=True)
    assert len(re.findall(r"\bUTMASTG\.2D\b", sass)) == 2 * 3
    # two h loads a consumer beside the producer's (the staged kernel's count: a_parts + 2)
    assert len(re.findall(r"\bUTMALDG\.2D\b", sass)) == a_parts + 2 + 2 * 2
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    assert regs <= 168, usage
    assert not re.search(r"\b(STL|LDL)\b", sass), "registers spill to local memory"
    stage = (a_parts * _launch.BM_PROMOTED + _launch.BN) * _launch.BK * 2
    tiles = 2 * 3 * _launch.BM_PROMOTED * _launch.BN * 2
    assert _launch.STAGES * stage + tiles <= shared <= 227 * 1024, shared


@needs_gluon
@pytest.mark.parametrize(
    "b_kmajor, G, act, spills",
    [
        pytest.param(False, 768, 0, False, id="swiglu-halves"),
        # the clamped GLU: the epilogue warpgroup keeps a few loop-carried values in local memory,
        # stored once and reloaded once a tile; nothing in the K loops
        pytest.param(False, 768, 1, True, id="clamped-halves"),
        pytest.param(True, 1, 1, True, id="clamped-interleaved-T"),  # gpt-oss: column by column, W2 transposed
    ],
)
def test_offline_sm90_compile_epilogue_warpgroup(b_kmajor, G, act, spills):
    """The epilogue warpgroup (EPI_WG): each consumer's promoted mainloop with one product in flight
    (a chain of two steps, the first left in flight, the second waited for, and the tail's one-step
    product), the registers moved to 152 a consumer, 168 for the epilogue warpgroup and 40 for the
    producer, no spill in the K loops, and the ring plus two fp32 handoff tiles within 227 KiB."""
    from _sm90 import loop_local_accesses
    from moemlp.kernels.gluon import _engine

    sass, usage, shared = _compile_sm90(b_kmajor, G, act, "fp32", 2, epi=True)
    per_step = _launch.BK // 16
    one = [(per_step, True, 1), (per_step, False, 0), (per_step, True, 0)]
    assert wgmma_groups(sass, "HGMMA.64x128x16.F32.BF16") == 2 * one
    consumer, epilogue = int(_engine.EPI_CONSUMER_REGS), int(_engine.EPI_REGS)
    assert 2 * consumer + epilogue + int(_engine.PRODUCER_REGS) == 4 * _engine.EPI_MAXNREG
    for regs in (consumer, epilogue):
        assert re.search(rf"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, {regs:#x}\b", sass), regs
    assert re.search(rf"USETMAXREG\.DEALLOC\.CTAPOOL {int(_engine.PRODUCER_REGS):#x}\b", sass)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    assert regs <= _engine.EPI_MAXNREG, usage
    in_loops, local = loop_local_accesses(sass, innermost=True)
    assert in_loops == 0, "registers spill inside the K loops"
    # Outside the K loops: triton 3.9 keeps 0 local-memory accesses with swiglu and ~40 with the
    # clamped GLU (values stored once, reloaded once a tile by the epilogue warpgroup); triton 3.6's
    # ptxas 6 and 86 (seen on the GPU machine). The bound catches a kernel that spills its epilogue
    # wholesale (a 64-column chunk is 96 values a thread).
    assert local <= (96 if spills else 8), f"{local} local-memory accesses"
    stage = (2 * _launch.BM_PROMOTED + _launch.BN) * _launch.BK * 2
    assert _launch.STAGES * stage + 2 * _launch.BM_PROMOTED * _launch.BN * 4 <= shared <= 227 * 1024, shared


@needs_gluon
@pytest.mark.parametrize(
    "b_kmajor, G, act, a_parts, regs, epi",
    [
        pytest.param(False, 768, 0, 1, False, False, id="pingpong-staged"),  # qwen3 / mixtral under nvfp4
        pytest.param(True, 1, 1, 1, False, False, id="pingpong-staged-interleaved-T"),  # gpt-oss
        pytest.param(False, 768, 0, 2, False, False, id="cooperative-staged"),
        pytest.param(False, 768, 0, 2, True, False, id="cooperative-regs"),
        pytest.param(False, 768, 0, 2, False, True, id="cooperative-epilogue-warpgroup"),
    ],
)
def test_offline_sm90_compile_acc_scale(b_kmajor, G, act, a_parts, regs, epi):
    """bf16 FC2_DGRAD with the accumulator factor (nvfp4's, ``fc2_dgrad(acc_scale=...)``) on every
    epilogue form: each consumer loads it once and multiplies each value of its promoted g_z by it
    before the epilogue reads g_z (the staged and register epilogues through _tile_loop, the epilogue
    warpgroup's handoff in _handoff_consumer), with the mainloop and registers of the kernel without
    it and no spill more."""
    from _sm90 import check_acc_scale
    from moemlp.kernels.gluon import _engine

    off = _compile_sm90(b_kmajor, G, act, "fp32", a_parts, regs=regs, epi=epi)
    on = _compile_sm90(b_kmajor, G, act, "fp32", a_parts, regs=regs, epi=epi, acc_scale=True)
    # each consumer's 64 × 128 g_z over its 128 threads
    check_acc_scale(off[:2], on[:2], 2 * 64)
    if epi:
        assert int(re.search(r"REG:(\d+)", on[1]).group(1)) <= _engine.EPI_MAXNREG, on[1]
    # shared memory: the same ring and tiles; the pointer's handoff to a partition may round up 16 bytes
    assert off[2] <= on[2] <= min(off[2] + 16, 227 * 1024), (on[2], off[2])


@needs_gluon
@pytest.mark.parametrize("a_parts", [1, 2], ids=["pingpong", "cooperative"])
def test_offline_sm90_compile_fp8(a_parts):
    """fp8_block's kernel (mixtral / deepseek: W2's K-major codes, G = F): per warpgroup one 128-deep
    product a step, BK / 32 = 4 e4m3 wgmma of m64n128k32 from zero, one wait each, no spill."""
    sass, usage, shared = _compile_sm90(True, 768, 0, "fp32", a_parts, scaled=True)
    check_fp8_consumers(sass, usage)
    # 6 stages (ping-pong) or 4 (cooperative) of e4m3 codes + 2 fp32 epilogue tiles × 32 KiB
    stage = (a_parts * _launch.BM_PROMOTED + _launch.BN) * _launch.FP8_BK
    stages = _launch._dgrad_stages(a_parts == 2, True, False, 768)
    assert stages == (6 if a_parts == 1 else 4)
    assert stages * stage + 64 * 1024 <= shared <= 227 * 1024, shared


def test_not_selected_off_gpu():
    # The MLP asks the engine only for CUDA tensors; on the CPU (and under the interpreter) the
    # Triton kernel runs.
    from moemlp._config import MLPConfig
    from moemlp.kernels.operands import _engine_fc2_dgrad

    cfg = MLPConfig(ACTIVATIONS["swiglu"], (), 8, False)
    t = torch.zeros(16, 16, dtype=torch.bfloat16)
    assert not _engine_fc2_dgrad(t, torch.zeros(2, 16, 8, dtype=torch.bfloat16), t, t, None, cfg)


# (splits, M, H, F, activation, params, G, W2 transposed, probs dtype, z stored): one comment each.
CASES = [
    pytest.param([300, 0, 5, 250, 100], 700, 256, 200, "swiglu", (), None, False, torch.float32, True,
                 id="ragged-capacity"),  # empty expert, a 5-row one, 45 capacity rows, F % 128 != 0
    pytest.param([300, 0, 5, 250, 100], 700, 256, 200, "swiglu", (), 8, False, torch.bfloat16, False,
                 id="G8-bf16probs-noz"),  # 8-column GLU blocks, bf16 probs upcast, no z
    pytest.param([131, 257, 1, 389], 778, 320, 136, "clamped_swiglu", (7.0, 1.702, 1.0), 1, True, torch.float32,
                 True, id="gptoss-like"),  # gate / up column by column, W2 read transposed, odd splits
    pytest.param([33, 70, 0, 129, 5, 256, 17], 510, 192, 384, "swiglu", (), None, False, torch.float32, True,
                 id="prime-E"),  # E = 7
    pytest.param([0, 0, 1000, 0, 0], 1000, 128, 256, "swiglu", (), None, False, torch.float32, True,
                 id="all-rows-in-one-expert"),
    pytest.param([700, 700], 1000, 128, 128, "swiglu", (), None, False, torch.float32, True,
                 id="splits-past-M"),  # the running sum is clamped at M
    pytest.param([64] * 16, 1024, 512, 256, "clamped_swiglu", (7.0, 1.702, 1.0), None, False, torch.float32, True,
                 id="64-row-experts"),  # every expert one 64-row tile
    pytest.param([300, 0, 5, 250, 100], 700, 256, 256, "swiglu", (), 128, False, torch.bfloat16, False,
                 id="G128-capacity-bf16probs-noz"),  # the register epilogue: blocks of 128, 45 capacity rows
]


@pytest.fixture(scope="module")
def engine_runs():
    from moemlp.kernels.gluon import why_unavailable
    from moemlp.kernels.gluon._smoke import why_engine_fails

    if why_unavailable():
        pytest.skip(why_unavailable())
    reason = why_engine_fails(timeout_s=240)
    if reason:
        pytest.fail(reason)


def _dprobs_float64(dy, w2, h, splits, F, G, activation, params):
    """Σ_f g_z·a in float64 on the stored h, splits clamped as the kernels clamp them; (dprobs, routed rows)."""
    M = dy.shape[0]
    rows = splits.to(torch.int64).clamp(0, M)
    cum = rows.cumsum(0)
    ends, starts = cum.clamp(max=M), (cum - rows).clamp(max=M)
    g_z = torch.zeros(M, F, dtype=torch.float64, device=dy.device)
    for e in range(w2.shape[0]):  # per expert
        s, t = int(starts[e]), int(ends[e])
        g_z[s:t] = dy[s:t].double() @ w2[e].double()
    f = torch.arange(F, device=dy.device)
    gate_col = (f // G) * 2 * G + f % G
    spec = ACTIVATIONS[activation]
    a = spec.fn(h[:, gate_col].double(), h[:, gate_col + G].double(), *params)
    routed = int(ends[-1])
    return (g_z * a).sum(1)[:routed], routed


# (cooperative tiles, epilogue): staged through an fp32 shared tile, in the accumulator's layout, or
# on the epilogue warpgroup (cooperative tiles only)
MODES = [
    pytest.param(False, "staged", id="pingpong-staged"),
    pytest.param(False, "regs", id="pingpong-regs"),
    pytest.param(True, "staged", id="cooperative-staged"),
    pytest.param(True, "regs", id="cooperative-regs"),
    pytest.param(True, "warpgroup", id="cooperative-warpgroup"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("cooperative, epilogue", MODES)
@pytest.mark.parametrize("splits_list, M, H, F, activation, params, G, transposed, probs_dtype, store_z", CASES)
def test_fc2_dgrad_gpu(splits_list, M, H, F, activation, params, G, transposed, probs_dtype, store_z, cooperative,
                       epilogue, engine_runs):
    from moemlp._config import MLPConfig
    from moemlp.kernels import operands
    from moemlp.kernels.gemm import launch
    from moemlp.kernels.gluon import fc2_dgrad, fc2_dgrad_supports

    torch.manual_seed(0)
    dev = "cuda"
    E = len(splits_list)
    G = G or F
    if epilogue == "regs" and G % _launch.BN:
        pytest.skip("the register epilogue takes G a multiple of 128")
    spec = ACTIVATIONS[activation]
    dy = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
    h = (2 * torch.randn(M, 2 * F, device=dev)).to(torch.bfloat16)
    w2 = (torch.randn(E, H, F, device=dev) * H**-0.5).to(torch.bfloat16)
    if transposed:  # the transposed view of a contiguous (E, F, H), as transformers' gpt-oss stores it
        w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    splits = torch.tensor(splits_list, device=dev, dtype=torch.int32)
    probs = torch.rand(M, device=dev).to(probs_dtype)
    assert fc2_dgrad_supports(dy, w2, h, spec.kernel_id, True) == ""
    pp = tuple(params) + (0.0,) * (3 - len(params))

    def engine(cooperative=cooperative, epilogue=epilogue):
        g_h = torch.full((M, 2 * F), float("nan"), device=dev, dtype=torch.bfloat16)
        z = torch.full((M, F), float("nan"), device=dev, dtype=torch.bfloat16) if store_z else None
        part = fc2_dgrad(dy, w2, splits, h, g_h, z=z, probs=probs, dprobs_partials=True, glu_interleave=G,
                         activation_id=spec.kernel_id, params=pp, cooperative=cooperative,
                         register_epilogue=epilogue == "regs",
                         epilogue_warpgroup=epilogue == "warpgroup")  # fmt: skip
        return g_h, z, part

    def dprobs_of(part):
        d = torch.empty(M, device=dev, dtype=probs.dtype)
        launch.launch_dprobs_reduce(partial=part, dy=dy, fc2_bias=None, splits=splits, dprobs=d, bias_term=False)
        return d

    g_h, z, part = engine()
    # The Triton kernel on the same operands: the same promoted 128-deep products and activation formulas.
    cfg = MLPConfig(spec, tuple(params), G, False)
    (W2,) = operands.weights((w2,), None)
    g_h_t = torch.empty_like(g_h)
    z_t = torch.empty_like(z) if store_z else None
    part_t = launch.launch_grouped_gemm("fc2_dgrad", a=dy, b=W2.dgrad().b, b_strides=W2.dgrad().strides,
                                        splits=splits, out=g_h_t, N=F, K=H, N1=2 * F, cfg=cfg, probs=probs, z=z_t,
                                        h=h, dprobs_partials=True)  # fmt: skip
    torch.cuda.synchronize()
    ref, routed = _dprobs_float64(dy, w2, h, splits, F, G, activation, params)

    assert not torch.isnan(g_h).any(), "g_h left unwritten"
    assert torch.equal(g_h, g_h_t), f"{int((g_h != g_h_t).sum())} g_h elements differ from the Triton kernel's"
    assert torch.equal(g_h[routed:], torch.zeros_like(g_h[routed:]))  # capacity rows
    if store_z:
        assert not torch.isnan(z).any(), "z left unwritten"
        assert torch.equal(z, z_t)
    assert torch.equal(part[:, routed:], torch.zeros_like(part[:, routed:]))
    dprobs = dprobs_of(part)
    assert dprobs.dtype == probs.dtype
    if routed:
        norm = torch.linalg.vector_norm(ref)
        err = float(torch.linalg.vector_norm(dprobs[:routed].double() - ref) / norm)
        err_t = float(torch.linalg.vector_norm(dprobs_of(part_t)[:routed].double() - ref) / norm)
        # SPEC §1's 1e-6 for fp32 probs; a bf16 probs is rounded once in the reduce's store.
        bound = 1e-6 if probs_dtype == torch.float32 else 2.0**-8
        assert err <= bound, (err, err_t)
    assert torch.equal(engine()[2], part), "two runs on the same inputs give different dprobs partials"
    if cooperative:  # the same 64-column chunks of the same products: the ping-pong kernel's partials
        same = engine(False, "staged" if epilogue == "warpgroup" else epilogue)[2]
        assert torch.equal(same, part), "the cooperative tiles' dprobs partials differ from ping-pong's"


# (cooperative, epilogue, g_h and z dtype): nvfp4's FC2_DGRAD stores fp32 g_h and z (the staged
# epilogue, on ping-pong or cooperative tiles); the register epilogue and the epilogue warpgroup in
# bf16, as their other tests run them
ACC_SCALE_MODES = [
    pytest.param(False, "staged", torch.float32, id="pingpong-staged-fp32"),
    pytest.param(True, "staged", torch.float32, id="cooperative-staged-fp32"),
    pytest.param(False, "regs", torch.bfloat16, id="pingpong-regs"),
    pytest.param(True, "regs", torch.bfloat16, id="cooperative-regs"),
    pytest.param(True, "warpgroup", torch.bfloat16, id="cooperative-warpgroup"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("cooperative, epilogue, out_dtype", ACC_SCALE_MODES)
@pytest.mark.parametrize(
    "splits_list, M, H, F, activation, params, G, transposed",
    [
        pytest.param([300, 0, 5, 250, 100], 700, 256, 256, "swiglu", (), 128, False,
                     id="ragged-capacity-G128"),  # an empty expert, a 5-row one, 45 capacity rows
        pytest.param([131, 257, 1, 389], 778, 320, 136, "clamped_swiglu", (7.0, 1.702, 1.0), 1, True,
                     id="gptoss-like"),  # gate / up column by column, W2 read transposed
    ],
)  # fmt: skip
def test_gpu_acc_scale_matches_the_triton_kernel(splits_list, M, H, F, activation, params, G, transposed,
                                                 cooperative, epilogue, out_dtype, engine_runs):  # fmt: skip
    """``acc_scale`` (nvfp4's product of 1/S_enc) against the Triton kernel's ACC_SCALE on the same
    bf16 values, on every epilogue form: g_z is the promoted total times the factor before any of
    them reads it, so g_h and z are the Triton kernel's bit for bit and dprobs is f·Σ g_z·a within
    SPEC's 1e-6. The Triton kernel stores its dprobs partials too: only then does it promote each
    128-deep product as the engine always does (``GemmConfig.PROMOTE``); unpromoted, its sums differ
    from the engine's in rounding, whatever the factor."""
    from moemlp._config import MLPConfig
    from moemlp.kernels import operands
    from moemlp.kernels.gemm import launch
    from moemlp.kernels.gluon import fc2_dgrad

    if epilogue == "regs" and G % _launch.BN:
        pytest.skip("the register epilogue takes G a multiple of 128")
    torch.manual_seed(0)
    dev = "cuda"
    E = len(splits_list)
    spec = ACTIVATIONS[activation]
    dy = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
    h = (2 * torch.randn(M, 2 * F, device=dev)).to(torch.bfloat16)
    w2 = (torch.randn(E, H, F, device=dev) * H**-0.5).to(torch.bfloat16)
    if transposed:
        w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    splits = torch.tensor(splits_list, device=dev, dtype=torch.int32)
    probs = torch.rand(M, device=dev)
    pp = tuple(params) + (0.0,) * (3 - len(params))
    f = launch._product((torch.tensor(3.7e-3, device=dev), torch.tensor(81.37, device=dev)))
    g_h = torch.full((M, 2 * F), float("nan"), device=dev, dtype=out_dtype)
    z = torch.full((M, F), float("nan"), device=dev, dtype=out_dtype)
    part = fc2_dgrad(dy, w2, splits, h, g_h, z=z, probs=probs, dprobs_partials=True, glu_interleave=G,
                     activation_id=spec.kernel_id, params=pp, cooperative=cooperative,
                     register_epilogue=epilogue == "regs", epilogue_warpgroup=epilogue == "warpgroup",
                     acc_scale=f)  # fmt: skip
    (W2,) = operands.weights((w2,), None)
    g_h_t, z_t = torch.empty_like(g_h), torch.empty_like(z)
    launch.launch_grouped_gemm("fc2_dgrad", a=dy, b=W2.dgrad().b, b_strides=W2.dgrad().strides, splits=splits,
                               out=g_h_t, N=F, K=H, N1=2 * F, cfg=MLPConfig(spec, tuple(params), G, False),
                               emulated=True, probs=probs, z=z_t, h=h, acc_factors=(f,),
                               dprobs_partials=True)  # fmt: skip
    dprobs = torch.empty(M, device=dev)
    launch.launch_dprobs_reduce(partial=part, dy=dy, fc2_bias=None, splits=splits, dprobs=dprobs, bias_term=False)
    torch.cuda.synchronize()
    ref, routed = _dprobs_float64(dy, w2, h, splits, F, G, activation, params)
    for name, got, want in (("g_h", g_h, g_h_t), ("z", z, z_t)):
        assert not torch.isnan(got).any(), f"{name} left unwritten"
        assert torch.equal(got, want), f"{int((got != want).sum())} {name} elements differ from the Triton kernel's"
        assert torch.equal(got[routed:], torch.zeros_like(got[routed:])), f"capacity rows of {name}"
    ref = ref * f.double()
    err = float(torch.linalg.vector_norm(dprobs[:routed].double() - ref) / torch.linalg.vector_norm(ref))
    assert err <= 1e-6, err


@needs_gluon
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("with_scale", [False, True], ids=["", "acc-scale"])
def test_launch_binds_each_tensor_to_its_parameter(monkeypatch, out_dtype, with_scale):
    """The launcher's positional arguments, bound on the CPU to the kernel's parameter names
    (``_sm90.bound_gluon_launch``): each tensor lands on the parameter of its name."""
    from _sm90 import bound_gluon_launch
    from moemlp.kernels.gluon import fc2_dgrad
    from moemlp.kernels.gluon._fc2_dgrad import fc2_dgrad_kernel

    M, H, F = 256, 128, 128
    dy, w2 = torch.zeros(M, H, dtype=torch.bfloat16), torch.zeros(2, H, F, dtype=torch.bfloat16)
    h = torch.zeros(M, 2 * F, dtype=torch.bfloat16)
    g_h, z, probs = torch.zeros(M, 2 * F, dtype=out_dtype), torch.zeros(M, F, dtype=out_dtype), torch.zeros(M)
    acc_scale = torch.tensor(2.0) if with_scale else None
    splits = torch.tensor([M // 2, M // 2], dtype=torch.int32)
    part = []
    kernel, bound, kw = bound_gluon_launch(monkeypatch, lambda: part.append(fc2_dgrad(
        dy, w2, splits, h, g_h, z=z, probs=probs, dprobs_partials=True, glu_interleave=F, activation_id=0,
        params=(0.5, 0.25, 0.125), cooperative=False, register_epilogue=False, epilogue_warpgroup=False,
        acc_scale=acc_scale)))  # fmt: skip
    assert kernel is fc2_dgrad_kernel
    assert bound["a_desc"] == ("desc", dy) and bound["h_ptr"] is h and bound["gh_ptr"] is g_h
    assert bound["z_ptr"] is z and bound["probs_ptr"] is probs and bound["part_ptr"] is part[0]
    assert bound["splits_ptr"] is splits
    assert bound["acc_scale_ptr"] is acc_scale and kw["ACC_SCALE"] is with_scale
    assert (bound["E"], bound["M"], bound["N"], bound["K"], bound["N1"]) == (2, M, F, H, 2 * F)
    assert (bound["p0"], bound["p1"], bound["p2"]) == (0.5, 0.25, 0.125)


@needs_gluon
@pytest.mark.parametrize(
    "H, rows, G, cooperative, regs",
    [
        pytest.param(4096, 1024, 128, True, True, id="coop-K4096-register"),
        pytest.param(6144, 1024, 128, True, True, id="coop-K6144-register"),
        pytest.param(4096, 512, 128, False, False, id="pingpong-staged"),
        pytest.param(2048, 1024, 64, True, False, id="coop-G64-staged"),
    ],
)
def test_default_tiles_and_epilogue(monkeypatch, H, rows, G, cooperative, regs):
    """With cooperative and register_epilogue left to the launcher: cooperative 128-row tiles where
    the experts average DGRAD_COOPERATIVE_ROWS rows, and on them the epilogue in the accumulator's
    layout where G is a multiple of 128; staged on ping-pong tiles (bound on the CPU)."""
    from _sm90 import bound_gluon_launch
    from moemlp.kernels.gluon import fc2_dgrad

    assert _launch.DGRAD_COOPERATIVE_ROWS == 1024
    E, F = 2, 128
    M = E * rows
    dy, w2 = torch.zeros(M, H, dtype=torch.bfloat16), torch.zeros(E, H, F, dtype=torch.bfloat16)
    h, g_h = torch.zeros(M, 2 * F, dtype=torch.bfloat16), torch.zeros(M, 2 * F, dtype=torch.bfloat16)
    z, probs = torch.zeros(M, F, dtype=torch.bfloat16), torch.zeros(M)
    splits = torch.tensor([rows] * E, dtype=torch.int32)
    _, _, kw = bound_gluon_launch(monkeypatch, lambda: fc2_dgrad(
        dy, w2, splits, h, g_h, z=z, probs=probs, dprobs_partials=True, glu_interleave=G, activation_id=0,
        params=(0.0, 0.0, 0.0)))  # fmt: skip
    assert (kw["A_PARTS"] == 2, kw["REGS"], kw["EPI_WG"]) == (cooperative, regs, False)


@pytest.mark.parametrize("name", ["cooperative", "register_epilogue", "epilogue_warpgroup"])
@pytest.mark.parametrize("value", [1, "yes"])
def test_tile_and_epilogue_choices_are_checked(name, value):
    """cooperative, register_epilogue and epilogue_warpgroup are True, False or None (the launcher's
    choice): anything else is refused by name."""
    from moemlp.kernels.gluon import fc2_dgrad

    t = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=f"{name} must be a bool or None"):
        fc2_dgrad(t, t.view(1, 64, 64), torch.zeros(1, dtype=torch.int32), t, t, z=None, probs=None,
                  dprobs_partials=False, glu_interleave=32, activation_id=0, params=(0.0, 0.0, 0.0),
                  **{name: value})  # fmt: skip


@pytest.mark.parametrize(
    "G, dtype, words",
    [
        pytest.param(64, torch.bfloat16, "interleave 64 is not a multiple of 128", id="G64"),
        pytest.param(128, torch.float32, "bf16", id="fp32-outputs"),
    ],
)
def test_register_epilogue_asked_where_it_cannot_run(G, dtype, words):
    """register_epilogue=True where the epilogue in the accumulator's layout cannot take the tensors
    is a ValueError naming why, raised before anything is launched (here, on the CPU)."""
    from moemlp.kernels.gluon import fc2_dgrad

    dy = torch.zeros(64, 64, dtype=torch.bfloat16)
    h = torch.zeros(64, 256, dtype=dtype)
    with pytest.raises(ValueError, match=f"register epilogue cannot take these tensors: .*{words}"):
        fc2_dgrad(dy, torch.zeros(1, 64, 128, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int32), h,
                  torch.zeros_like(h), z=None, probs=None, dprobs_partials=False, glu_interleave=G, activation_id=0,
                  params=(0.0, 0.0, 0.0), register_epilogue=True)  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, words",
    [
        pytest.param(dict(cooperative=False), "cooperative=False", id="pingpong"),
        pytest.param(dict(register_epilogue=True), "register_epilogue=True", id="register-epilogue"),
        pytest.param(dict(cooperative=False, register_epilogue=True), "cooperative=False and register_epilogue=True",
                     id="both"),
    ],
)
def test_epilogue_warpgroup_asked_where_it_cannot_run(kwargs, words):
    """epilogue_warpgroup=True runs the staged epilogue on cooperative tiles: asked beside ping-pong
    tiles or the register epilogue, it is a ValueError naming the clash, raised before any launch."""
    from moemlp.kernels.gluon import fc2_dgrad

    t = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"epilogue warpgroup .* cannot run with {words}$"):
        fc2_dgrad(t, t.view(1, 64, 64), torch.zeros(1, dtype=torch.int32), t, t, z=None, probs=None,
                  dprobs_partials=False, glu_interleave=32, activation_id=0, params=(0.0, 0.0, 0.0),
                  epilogue_warpgroup=True, **kwargs)  # fmt: skip


def test_epilogue_warpgroup_refused_under_fp8_block():
    from moemlp.kernels.gluon import fc2_dgrad

    t = torch.zeros(64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="epilogue warpgroup .* cannot run with fp8_block"):
        fc2_dgrad(t, t.view(1, 64, 128).transpose(1, 2).contiguous().transpose(1, 2), torch.zeros(1, dtype=torch.int32),
                  t, t, z=None, probs=None, dprobs_partials=False, glu_interleave=64, activation_id=0,
                  params=(0.0, 0.0, 0.0), epilogue_warpgroup=True, dy_scale=torch.ones(64, 1),
                  w2_scale=torch.ones(1, 1, 1))  # fmt: skip
