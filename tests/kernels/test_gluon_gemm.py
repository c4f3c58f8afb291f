"""The Gluon grouped GEMM (moemlp.kernels.gluon): an offline sm_90 compile on any machine (which
instructions, registers, shared memory, no spills), input checks, and on an H200 the numbers against
torch._grouped_mm and a float64 reference on ragged splits."""

from __future__ import annotations

import re

import pytest
import torch

from _sm90 import check_products_in_flight, compile_gluon_sm90
from moemlp.kernels.gluon import _compat

needs_gluon = pytest.mark.skipif(bool(_compat.missing()), reason=f"triton lacks: {_compat.missing()}")

BM, BN, BK, STAGES, GROUP_M = 128, 128, 64, 4, 8


def _compile_sm90(e_block: int, splits_dtype: str, b_kmajor: bool = True, out_fp32: bool = False,
                  promote: int = 0, coop: bool = False, acc_scale: bool = False):
    """Compiles the engine for sm_90 without a GPU; returns (sass, cuobjdump -res-usage, shared bytes).
    coop: the launcher's cooperative tiles, 2 × 64 × 256 (2 × 64 × 128 promoted). acc_scale: the
    accumulator times a factor read from memory (nvfp4's; off, the launcher passes None for it)."""
    from moemlp.kernels.gluon import _engine, _launch

    gl = _compat.gl

    def desc(block, dtype="bf16"):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == "bf16" else gl.float32)
        return f"tensordesc<{dtype}[{block[0]},{block[1]}],{layout!r}>"

    c = "fp32" if out_fp32 else "bf16"
    if coop and promote:
        bm, bn, stages = _launch.BM_PROMOTED, BN, STAGES
    elif coop:
        bm, bn, stages = _launch.BM_COOP, _launch.BN_COOP, _launch.STAGES_COOP
    else:
        bm, bn, stages = (64 if promote else BM), BN, (3 if out_fp32 and not promote else STAGES)
    constexprs = dict(BM=bm, BN=bn, BK=BK, STAGES=stages, GROUP_M=GROUP_M, E_BLOCK=e_block, B_KMAJOR=b_kmajor,
                      PROMOTE=promote // BK, A_PARTS=2 if coop else 1, ACC_SCALE=acc_scale)
    sig = {"a_desc": desc([bm, BK]), "b_desc": desc([bn, BK] if b_kmajor else [BK, bn]),
           "c_desc": desc([bm, bn], c), "c_ptr": f"*{c}", "acc_scale_ptr": "*fp32",
           "splits_ptr": f"*{splits_dtype}", "E": "i32", "M": "i32", "N": "i32", "K": "i32"}
    if not acc_scale:
        constexprs["acc_scale_ptr"] = None
    sig.update({name: "constexpr" for name in constexprs})
    return compile_gluon_sm90(_engine.grouped_gemm_kernel, sig, constexprs, ("c_ptr", "splits_ptr", "N", "K"),
                              _engine.NUM_WARPS, _engine.MAXNREG)


@needs_gluon
@pytest.mark.parametrize(
    "e_block, splits_dtype, b_kmajor, out_fp32, promote",
    [
        pytest.param(128, "i32", True, False, False, id="E128-int32"),  # qwen3 / gpt-oss expert counts
        pytest.param(32, "i64", True, False, False, id="E32-int64"),  # the smallest table, int64 splits
        pytest.param(256, "i32", True, False, False, id="E256-int32"),  # the largest table the launcher accepts
        pytest.param(128, "i32", False, True, False, id="E128-kn-fp32"),  # W2 read in place, fp32 C
        pytest.param(32, "i32", False, False, False, id="E32-kn-bf16"),  # FC1_DGRAD's dx: W1 read in place
        pytest.param(128, "i32", False, True, 128, id="E128-kn-fp32-promoted"),  # FC2_DGRAD's g_z
        pytest.param(128, "i32", False, True, 64, id="E128-kn-fp32-promoted64"),  # one-step products
    ],
)
def test_offline_sm90_compile(e_block, splits_dtype, b_kmajor, out_fp32, promote):
    sass, usage, shared = _compile_sm90(e_block, splits_dtype, b_kmajor, out_fp32, promote)
    # Unpromoted, each consumer warpgroup's k-step is BM/64 m64 halves × BK/16 wgmma of m64n128k16,
    # emitted once per warpgroup.
    hgmma = re.findall(r"HGMMA\.64x128x16\.F32\.BF16(\S*)", sass)
    if promote:
        # Promoted (BM = 64, one m64 row block): products of promote/BK steps, two in flight, each
        # from zero and no wgmma waited for before the next is issued (ptxas serialized nothing),
        # and, where a product is longer than one step, the one-step product of a K that ends
        # mid-product.
        chain = promote // BK
        check_products_in_flight(sass, "HGMMA.64x128x16.F32.BF16", BK // 16, chain, tail=chain > 1)
    else:
        assert len(hgmma) == 2 * 2 * (BK // 16), len(hgmma)
    # The producer's A and B loads; a [BK, BN] = [64, 128] bf16 B block is 256 bytes wide, past the
    # 128-byte swizzle span that one TMA box may cover, so it takes two boxes.
    assert len(re.findall(r"\bUTMALDG\.2D\b", sass)) == (2 if b_kmajor else 3)
    assert len(re.findall(r"\bUTMASTG\.2D\b", sass)) >= 2  # TMA stores of both warpgroups
    assert re.search(r"\bSYNCS\.ARRIVE", sass) and re.search(r"\bSYNCS\.PHASECHK", sass)  # mbarriers
    # setmaxnreg: the producer gives registers back down to 40, the consumers take 232.
    assert re.search(r"USETMAXREG\.DEALLOC\.CTAPOOL 0x28\b", sass)
    assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, 0xe8\b", sass)
    assert re.search(r"\bSTG\.E\.(128|ENL2\.256)\b", sass)  # the masked vector stores of expert-boundary tiles
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))
    assert regs <= 168, usage  # 12 warps × 168 × 32 lanes fits 65,536 registers
    assert local == 0 and not re.search(r"\b(STL|LDL)\b", sass), "registers spill to local memory"
    # 4 stages × 32 KiB + 2 bf16 epilogue tiles × 32 KiB (or 3 stages + 2 fp32 tiles × 64 KiB) + barriers,
    # within sm_90's 227 KiB a CTA.
    low = 160 if promote else 224 if out_fp32 else 192
    assert low * 1024 <= shared <= 227 * 1024, shared


@needs_gluon
@pytest.mark.parametrize("b_kmajor, promote", [(True, 0), (False, 0), (False, 128)], ids=["nk", "kn", "kn-promoted"])
def test_offline_sm90_compile_cooperative(b_kmajor, promote):
    """The cooperative 128 × 256 tiles (FC2's nk and FC1_DGRAD's kn weights): each consumer issues
    BK/16 m64n256k16 wgmma a k-step on its 64 rows, within the same registers as ping-pong's two
    m64n128 halves, no spill, and the ring and epilogue tiles within sm_90's shared memory.
    Promoted (FC2_DGRAD's mainloop with an fp32 C): 128 × 128 tiles, two products in flight."""
    sass, usage, shared = _compile_sm90(32, "i32", b_kmajor, out_fp32=bool(promote), promote=promote, coop=True)
    if promote:
        check_products_in_flight(sass, "HGMMA.64x128x16.F32.BF16", BK // 16, promote // BK, tail=True)
    else:
        assert len(re.findall(r"HGMMA\.64x256x16\.F32\.BF16", sass)) == 2 * (BK // 16)
        assert not re.search(r"HGMMA\.64x128x16", sass)
    assert len(re.findall(r"\bUTMASTG\.2D\b", sass)) >= 2
    assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, 0xe8\b", sass)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))
    assert regs <= 168, usage
    assert local == 0 and not re.search(r"\b(STL|LDL)\b", sass), "registers spill to local memory"
    # 3 stages × (2 · 64 + 256) × 64 × 2 B + 2 bf16 tiles of 64 × 256 = 208 KiB (promoted: 4 stages ×
    # (2 · 64 + 128) × 64 × 2 B + 2 fp32 tiles of 64 × 128 = 192 KiB), + barriers
    assert (192 if promote else 208) * 1024 <= shared <= 227 * 1024, shared


@needs_gluon
@pytest.mark.parametrize(
    "b_kmajor, out_fp32, promote, coop",
    [
        pytest.param(True, False, 0, False, id="nk-pingpong"),
        pytest.param(True, False, 0, True, id="nk-coop"),  # FC2 without a bias under nvfp4
        pytest.param(False, False, 0, True, id="kn-coop"),  # FC1_DGRAD's dx under nvfp4
        pytest.param(False, True, 128, False, id="kn-fp32-promoted"),
    ],
)
def test_offline_sm90_compile_acc_scale(b_kmajor, out_fp32, promote, coop):
    """The accumulator factor (nvfp4's product of 1/S_enc, ``grouped_gemm(acc_scale=...)``): each
    consumer loads it once and multiplies each accumulator value by it before the store's rounding,
    on every tile shape, with the mainloop, registers and shared memory of the kernel without it."""
    from _sm90 import check_acc_scale

    off = _compile_sm90(32, "i32", b_kmajor, out_fp32, promote, coop)
    on = _compile_sm90(32, "i32", b_kmajor, out_fp32, promote, coop, acc_scale=True)
    # a consumer's accumulator: 128 × 128 (ping-pong), 64 × 256 (cooperative), 64 × 128 (promoted)
    # fp32 values over its 128 threads
    per_thread = (64 * 128 if promote else 128 * 128) // 128
    check_acc_scale(off[:2], on[:2], 2 * per_thread)
    # shared memory: the same ring and tiles; the pointer's handoff to a partition may round up 16 bytes
    assert off[2] <= on[2] <= min(off[2] + 16, 227 * 1024), (on[2], off[2])


def test_compat_reports_what_is_missing():
    missing = _compat.missing()
    assert isinstance(missing, list)
    if not missing:
        # 3.9 keeps async_copy_global_to_shared as a builtin that raises: the new name must win.
        assert _compat.tma_load is getattr(_compat.tma, "async_load", _compat.tma_load)
        assert _compat.tma_store is getattr(_compat.tma, "async_store", _compat.tma_store)
        assert _compat.warp_specialize is _compat.gl.warp_specialize
    if not torch.cuda.is_available():
        assert not _compat.is_available()
        assert _compat.why_unavailable()


@pytest.mark.parametrize("promote", [True, 32, -64, 100.0], ids=["bool", "not-a-step-multiple", "negative", "float"])
def test_promote_depth_is_checked(promote):
    """promote is a product depth in elements (0 or a multiple of the 64-deep K step): anything else
    is refused by name before any tensor is looked at, instead of being read as a step count."""
    from moemlp.kernels.gluon import grouped_gemm

    t = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="promote must be 0 or a positive multiple of 64"):
        grouped_gemm(t, t.view(1, 64, 64), torch.zeros(1, dtype=torch.int32), promote=promote)


@pytest.mark.parametrize(
    "opts, error, words",
    [
        pytest.param(dict(cooperative=1), TypeError, "cooperative must be True, False or None", id="int"),
        pytest.param(dict(cooperative=True, out_dtype=torch.float32), ValueError, "take a bf16 C", id="fp32-out"),
    ],
)
def test_cooperative_is_checked(opts, error, words):
    """Unpromoted cooperative tiles (64 × 256 a consumer) have room for a bf16 C's epilogue tiles
    only: an fp32 C is refused by name before any tensor is looked at."""
    from moemlp.kernels.gluon import grouped_gemm

    t = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(error, match=re.escape(words)):
        grouped_gemm(t, t.view(1, 64, 64), torch.zeros(1, dtype=torch.int32), **opts)


def _launch_on_cpu(launcher: str, **kw):
    """One of the engine's bf16 launchers on small CPU tensors of valid shapes, with ``kw`` added."""
    from moemlp.kernels import gluon

    bf = dict(dtype=torch.bfloat16)
    t, splits = torch.zeros(64, 128, **bf), torch.zeros(1, dtype=torch.int32)
    if launcher == "grouped_gemm":
        return gluon.grouped_gemm(t, torch.zeros(1, 64, 128, **bf), splits, **kw)
    if launcher == "wgrad":
        return gluon.wgrad(t, t, splits, **kw)
    common = dict(probs=None, glu_interleave=64, activation_id=0, params=(0.0, 0.0, 0.0))
    if launcher == "fc1":
        return gluon.fc1(t, torch.zeros(1, 128, 128, **bf), splits, t, z=None, bias=None, **common, **kw)
    return gluon.fc2_dgrad(t, torch.zeros(1, 128, 64, **bf), splits, t, torch.zeros_like(t), z=None,
                           dprobs_partials=False, **common, **kw)  # fmt: skip


@pytest.mark.parametrize("launcher", ["grouped_gemm", "fc1", "fc2_dgrad", "wgrad"])
@pytest.mark.parametrize(
    "acc_scale, error, words",
    [
        pytest.param(torch.ones((), dtype=torch.float64), TypeError, "acc_scale must be float32", id="fp64"),
        pytest.param(torch.ones((), dtype=torch.bfloat16), TypeError, "acc_scale must be float32", id="bf16"),
        pytest.param(torch.ones(1), ValueError, "acc_scale must be a 0-d tensor", id="shape-1"),
        pytest.param(2.0, TypeError, "acc_scale must be a 0-d float32 tensor or None", id="python-float"),
        pytest.param(torch.ones((), device="meta"), ValueError, "acc_scale must be on the operands' device",
                     id="other-device"),
    ],
)
def test_acc_scale_is_checked(launcher, acc_scale, error, words):
    """The accumulator factor of the bf16 launchers is one fp32 value on the operands' device, read
    by the kernel: anything else is refused by name before anything is launched (here on the CPU,
    before the operands' own device checks)."""
    with pytest.raises(error, match=re.escape(words)):
        _launch_on_cpu(launcher, acc_scale=acc_scale)


@pytest.mark.parametrize("launcher", ["fc1", "fc2_dgrad"])
def test_acc_scale_refused_beside_fp8_scales(launcher):
    """fp8_block's codes carry their own scales; a factor beside them is a ValueError naming both."""
    from moemlp.kernels import gluon

    codes, splits = torch.zeros(64, 128).to(torch.float8_e4m3fn), torch.zeros(1, dtype=torch.int32)
    h = torch.zeros(64, 128, dtype=torch.bfloat16)
    common = dict(probs=None, glu_interleave=64, activation_id=0, params=(0.0, 0.0, 0.0), acc_scale=torch.ones(()))
    with pytest.raises(ValueError, match="acc_scale multiplies a bf16 accumulator"):
        if launcher == "fc1":
            gluon.fc1(codes, torch.zeros(1, 128, 128).to(torch.float8_e4m3fn), splits, h, z=None, bias=None,
                      x_scale=torch.ones(64, 1), w1_scale=torch.ones(1, 1, 1), **common)  # fmt: skip
        else:
            w2 = torch.zeros(1, 64, 128).to(torch.float8_e4m3fn).transpose(1, 2)  # (E, H, F) view of (E, F, H)
            gluon.fc2_dgrad(codes, w2, splits, h, torch.zeros_like(h), z=None, dprobs_partials=False,
                            dy_scale=torch.ones(64, 1), w2_scale=torch.ones(1, 1, 1), **common)  # fmt: skip


@pytest.mark.parametrize(
    "a, b, splits, error, words",
    [
        pytest.param((64, 32), (2, 16, 32), ((2,), torch.int32), TypeError, "device", id="cpu-tensors"),
        pytest.param((64, 32), (2, 16, 32), ((2,), torch.float32), TypeError, "int32 or int64", id="float-splits"),
        pytest.param((64,), (2, 16, 32), ((2,), torch.int32), ValueError, "(M, K)", id="a-1d"),
        pytest.param((64, 32), (16, 32), ((2,), torch.int32), ValueError, "(E, N, K)", id="b-2d"),
    ],
)
def test_input_checks(a, b, splits, error, words):
    a_t = torch.zeros(a, dtype=torch.bfloat16)
    b_t = torch.zeros(b, dtype=torch.bfloat16)
    s_t = torch.zeros(splits[0], dtype=splits[1])
    from moemlp.kernels.gluon import grouped_gemm

    with pytest.raises(error, match=re.escape(words)):
        grouped_gemm(a_t, b_t, s_t)


# (splits, M, N, K): one comment per case says what it exercises.
CASES = [
    pytest.param([300, 0, 77, 128], 505, 256, 128, id="empty-expert"),  # expert 1 has no rows
    pytest.param([5, 200, 3], 208, 128, 64, id="fewer-rows-than-a-tile"),  # experts 0, 2: a partial tile alone
    pytest.param([131, 257, 1, 389], 778, 264, 200, id="odd-sizes"),  # odd splits; N, K not tile multiples
    pytest.param([33, 70, 0, 129, 5, 256, 17], 510, 384, 192, id="prime-E"),  # E = 7
    pytest.param([0, 0, 1000, 0, 0], 1000, 512, 256, id="all-rows-in-one-expert"),  # 8 m-tiles, one expert
    pytest.param([100, 50, 60], 300, 136, 72, id="capacity"),  # rows 210..299 are capacity padding
    pytest.param([128] * 8, 1024, 1024, 512, id="tile-aligned"),  # every m-tile full: TMA stores only
    pytest.param([64] * 16, 1024, 384, 128, id="half-tiles"),  # every m-tile but the last is a masked store
    pytest.param([700, 700], 1000, 128, 64, id="splits-past-M"),  # the running sum is clamped at M
]


def _reference(a, b, splits, M):
    """float64 C[R_e] = A[R_e] @ B[e]ᵀ (b as (E, N, K)) with the kernel's clamping of splits; capacity rows 0."""
    rows = splits.to(torch.int64).clamp(0, M)
    cum = rows.cumsum(0)
    ends = cum.clamp(max=M)
    starts = (cum - rows).clamp(max=M)  # from the unclamped sum: experts past M start at M, not before
    out = torch.zeros(M, b.shape[1], dtype=torch.float64, device=a.device)
    for e in range(b.shape[0]):  # per expert, not per token
        s, t = int(starts[e]), int(ends[e])
        out[s:t] = a[s:t].double() @ b[e].double().T
    return out, int(ends[-1])


@pytest.fixture(scope="module")
def engine_runs():
    """The engine once in a child process with a time limit: a hang on this triton fails the GPU
    tests with a message instead of stalling the session."""
    from moemlp.kernels.gluon import why_unavailable
    from moemlp.kernels.gluon._smoke import why_engine_fails

    if why_unavailable():
        pytest.skip(why_unavailable())
    reason = why_engine_fails(timeout_s=240)
    if reason:
        pytest.fail(reason)


# (b_layout, out dtype, splits dtype, promote, cooperative): the forward GEMMs' layout with both splits
# dtypes, and the dgrads' in-place weight layout with a bf16 C (FC1_DGRAD's dx) and an fp32 C
# (FC2_DGRAD's g_z); the bf16 GEMMs also on cooperative 128 × 256 tiles (FC2, FC1_DGRAD on large experts).
VARIANTS = [
    pytest.param("nk", torch.bfloat16, torch.int32, 0, False, id="nk-bf16-int32"),
    pytest.param("nk", torch.bfloat16, torch.int64, 0, False, id="nk-bf16-int64"),
    pytest.param("kn", torch.bfloat16, torch.int32, 0, False, id="kn-bf16"),
    pytest.param("kn", torch.float32, torch.int64, 0, False, id="kn-fp32"),
    pytest.param("kn", torch.float32, torch.int32, 128, False, id="kn-fp32-promoted"),  # FC2_DGRAD's g_z, 128-deep
    pytest.param("kn", torch.float32, torch.int64, 64, False, id="kn-fp32-promoted64"),  # 64-deep products
    pytest.param("nk", torch.bfloat16, torch.int64, 0, True, id="nk-bf16-coop"),
    pytest.param("kn", torch.bfloat16, torch.int32, 0, True, id="kn-bf16-coop"),
    pytest.param("kn", torch.float32, torch.int32, 128, True, id="kn-fp32-promoted-coop"),  # FC2_DGRAD's mainloop
]


@pytest.mark.gpu
@pytest.mark.parametrize("b_layout, out_dtype, splits_dtype, promote, cooperative", VARIANTS)
@pytest.mark.parametrize("splits_list, M, N, K", CASES)
def test_grouped_gemm_gpu(splits_list, M, N, K, b_layout, out_dtype, splits_dtype, promote, cooperative,
                          engine_runs):
    from moemlp.kernels.gluon import grouped_gemm, supports

    torch.manual_seed(0)
    dev = "cuda"
    E = len(splits_list)
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16) / K**0.5
    splits = torch.tensor(splits_list, device=dev, dtype=splits_dtype)
    ref, routed = _reference(a, b, splits, M)
    operand = b if b_layout == "nk" else b.transpose(1, 2).contiguous()  # (E, K, N): the same B_e
    opts = dict(b_layout=b_layout, out_dtype=out_dtype, promote=promote, cooperative=cooperative)
    if b_layout == "kn" and E > 1 and K % BK:
        # Experts stacked along K with a K block straddling two: refused, not read wrongly.
        assert supports(a, operand, b_layout)
        with pytest.raises(ValueError, match="multiple of 64"):
            grouped_gemm(a, operand, splits, **opts)
        return
    assert supports(a, operand, b_layout) == ""

    # Poisoned output: every row must be written, routed rows with products, capacity rows with 0.
    out = torch.full((M, N), float("nan"), device=dev, dtype=out_dtype)
    got = grouped_gemm(a, operand, splits, out=out, **opts)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).any(1).sum())} rows left unwritten"
    assert torch.equal(got[routed:], torch.zeros_like(got[routed:]))

    err = (got[:routed].double() - ref[:routed]).abs().max().item() if routed else 0.0
    scale = ref.abs().max().item()
    if out_dtype == torch.float32:
        # The fp32 accumulator itself: K ≤ 512 products of unit size summed in fp32 (2^-24 each).
        assert err <= scale * 2.0**-16, (err, scale)
    else:
        if sum(max(s, 0) for s in splits_list) <= M:
            offs = splits.to(torch.int32).cumsum(0).to(torch.int32)
            peer = torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
            torch_err = (peer[:routed].double() - ref[:routed]).abs().max().item() if routed else 0.0
        else:  # _grouped_mm takes no offsets past M; its bf16 error is the final rounding, ≤ 2^-8 relative
            torch_err = scale * 2.0**-8
        # quack's idiom: within 2× the error of PyTorch's own bf16 computation against float64, plus
        # one bf16 ulp of the largest value for the cases where both round identically (torch_err ~ 0).
        assert err <= 2 * torch_err + scale * 2.0**-8, (err, torch_err)

    again = grouped_gemm(a, operand, splits, **opts)
    torch.cuda.synchronize()
    assert torch.equal(again, got), "two runs on the same inputs differ"
    if cooperative:
        # The same K-ordered chain of products per element on either tile shape: the same bits.
        pingpong = grouped_gemm(a, operand, splits, **dict(opts, cooperative=False))
        torch.cuda.synchronize()
        assert torch.equal(got, pingpong), (got.double() - pingpong.double()).abs().max().item()


# (b_layout, cooperative): FC2 (nk) and FC1_DGRAD (kn) as the MLP runs them, and ping-pong tiles
ACC_SCALE_VARIANTS = [
    pytest.param("nk", True, id="nk-coop"),
    pytest.param("kn", True, id="kn-coop"),
    pytest.param("nk", False, id="nk-pingpong"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("b_layout, cooperative", ACC_SCALE_VARIANTS)
@pytest.mark.parametrize(
    "splits_list, M, N, K",
    [
        CASES[0],  # an empty expert
        CASES[7],  # masked stores at every expert's end
        pytest.param([100, 50, 60], 300, 136, 128, id="capacity"),  # 90 capacity rows; K whole steps (kn)
    ],
)
def test_grouped_gemm_gpu_acc_scale_matches_the_triton_kernel(splits_list, M, N, K, b_layout, cooperative,
                                                              engine_runs):
    """``acc_scale`` (nvfp4's product of 1/S_enc) on the engine against the Triton kernel's ACC_SCALE
    (``acc_factors``) on the same bf16 values: the same K-ordered chain a tile, the same one fp32
    multiply before the rounding, so the same bits; capacity rows 0."""
    from moemlp.kernels.gemm import launch
    from moemlp.kernels.gluon import grouped_gemm

    torch.manual_seed(0)
    dev = "cuda"
    E = len(splits_list)
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16) / K**0.5
    splits = torch.tensor(splits_list, device=dev, dtype=torch.int32)
    # two factors' product, as operands.gemm_on takes nvfp4's: neither a power of two
    f = launch._product((torch.tensor(3.7e-3, device=dev), torch.tensor(0.8137, device=dev)))
    if b_layout == "nk":
        operand, strides, kind = b, (N * K, K, 1), "fc2"
    else:  # (E, K, N): the same B_e read in place, as FC1_DGRAD reads W1
        operand, strides, kind = b.transpose(1, 2).contiguous(), (K * N, 1, N), "fc1_dgrad"
    out = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
    grouped_gemm(a, operand, splits, out=out, b_layout=b_layout, cooperative=cooperative, acc_scale=f)
    ref = torch.empty_like(out)
    launch.launch_grouped_gemm(kind, a=a, b=operand, b_strides=strides, splits=splits, out=ref, N=N, K=K, N1=N,
                               cfg=None, emulated=True, acc_factors=(f,))  # fmt: skip
    torch.cuda.synchronize()
    routed = min(sum(max(s, 0) for s in splits_list), M)
    assert not torch.isnan(out).any(), "rows left unwritten"
    assert torch.equal(out, ref), f"{int((out != ref).sum())} of {out.numel()} elements differ from the Triton kernel's"
    assert torch.equal(out[routed:], torch.zeros_like(out[routed:]))
    unscaled = grouped_gemm(a, operand, splits, b_layout=b_layout, cooperative=cooperative)
    assert not torch.equal(out[:routed], unscaled[:routed]), "the factor was not applied"


@needs_gluon
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
@pytest.mark.parametrize("with_scale", [False, True], ids=["bf16", "acc-scale"])
def test_launch_binds_each_tensor_to_its_parameter(monkeypatch, b_layout, with_scale):
    """The plain GEMM launcher's positional arguments, bound on the CPU to the kernel's parameter names
    (``_sm90.bound_gluon_launch``; the checks that ask for a CUDA device passed)."""
    from _sm90 import bound_gluon_launch
    from moemlp.kernels.gluon import _launch
    from moemlp.kernels.gluon._engine import grouped_gemm_kernel

    monkeypatch.setattr(_launch, "_check", lambda *args: None)
    monkeypatch.setattr(_launch, "why_unavailable", lambda device: "")
    M, N, K = 256, 384, 128
    a = torch.zeros(M, K, dtype=torch.bfloat16)
    b = torch.zeros((2, N, K) if b_layout == "nk" else (2, K, N), dtype=torch.bfloat16)
    out = torch.zeros(M, N, dtype=torch.bfloat16)
    acc_scale = torch.tensor(2.0) if with_scale else None
    splits = torch.tensor([M // 2, M // 2], dtype=torch.int32)
    kernel, bound, kw = bound_gluon_launch(monkeypatch, lambda: _launch.grouped_gemm(
        a, b, splits, out, b_layout=b_layout, acc_scale=acc_scale))  # fmt: skip
    assert kernel is grouped_gemm_kernel
    assert bound["a_desc"] == ("desc", a) and bound["c_desc"] == ("desc", out) and bound["c_ptr"] is out
    assert bound["b_desc"][1].data_ptr() == b.data_ptr() and kw["B_KMAJOR"] is (b_layout == "nk")
    assert bound["acc_scale_ptr"] is acc_scale and kw["ACC_SCALE"] is with_scale
    assert bound["splits_ptr"] is splits
    assert (bound["E"], bound["M"], bound["N"], bound["K"]) == (2, M, N, K)
