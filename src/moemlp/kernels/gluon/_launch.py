"""The launcher of the Gluon grouped GEMM: validates, allocates, builds the TMA descriptors and the
persistent grid (one CTA per SM). Reads nothing on the host from ``splits``."""

from __future__ import annotations

import functools

import torch

from .._cuda_context import bind_context
from .._launcher import launch
from ._compat import why_unavailable

# 128×128×64 tiles, 4 stages: (128 + 128)·64·2 B = 32 KiB a stage, 128 KiB of ring + 2 × 32 KiB of
# epilogue tiles = 192 KiB of the 227 KiB an sm_90 CTA may use; a 5th stage would not fit.
BM, BN, BK = 128, 128, 64
STAGES = 4
# An fp32 C doubles the two epilogue tiles to 128 KiB: 3 stages (96 KiB) keep the total at 224 KiB.
STAGES_FP32_OUT = 3
BM_PROMOTED = 64
# Cooperative plain tiles (_engine.py): 2 × 64 rows × 256 columns, m64n256 wgmma, 3 stages of
# (2 · 64 + 256) · 64 · 2 B = 48 KiB (144 KiB) + two bf16 epilogue tiles of 64 × 256 (64 KiB): 208 KiB.
# bf16 C only: an fp32 C's tiles (128 KiB) would leave room for one stage.
BM_COOP, BN_COOP, STAGES_COOP = 64, 256, 3
# Depth of each promoted tensor-core product (a multiple of BK): the promoted mainloop waits for the
# product and adds it to the fp32 total once per PROMOTE_DEPTH / BK steps (docs/DECISIONS.md,
# "FC2_DGRAD's promoted products 128 deep on both kernels").
PROMOTE_DEPTH = 128
GROUP_M = 8
# The expert table is held in registers by every partition, E_BLOCK / 32 values a lane per field
# (starts, ends, tile ends): 256 experts keep that at 24 registers in the 40-register producer.
MAX_EXPERTS = 256

# FP8 blockwise GEMM (_engine.grouped_gemm_fp8_kernel): cooperative 128-row tiles, 128-deep steps (one
# scale block each), stages of (128 + 128) × 128 codes = 32 KiB, 2 epilogue tiles of 64 × 128 (bf16 16
# KiB each, fp32 32 KiB). A bf16 C leaves room for 6 stages (224 KiB): where experts average fewer
# than DGRAD_COOPERATIVE_ROWS rows the GEMM waits on its bytes, and 6 stages ran 1.05x (qwen3's FC2)
# and 1.04x (gpt-oss's) the 4-stage kernel, the same bits; on large experts 0.97x (mixtral) and
# 1.01x (deepseek-v3), so they keep 4 (docs/DECISIONS.md, "Deeper rings where the bytes bind"). fp32
# C and fp8_wgrad_kernel keep 4 (not measured deeper).
FP8_BM, FP8_BK, FP8_STAGES = 64, 128, 4
FP8_STAGES_BF16_OUT = 6
# FC1 (_fc1.py): 64 output columns a tile (its 64 gates and 64 ups make the 128-column accumulator),
# each consumer's epilogue tiles h's halves in bf16 and z, BM × 64 each. bf16 on 128-row ping-pong
# tiles, the gate and up halves through one h tile a consumer in turn: 2 × (16 + 16)
# KiB of epilogue tiles with a bf16 z leave room for 5 stages of (128 + 128) × 64 × 2 B = 32 KiB, 224
# KiB of the 227; an fp32 z (32 KiB a consumer) leaves 4. With two h tiles a consumer 4 stages fit
# (3 with an fp32 z): small experts wait on their bytes, so the ring takes the room.
# fp8_block on the FP8 tiles above: 2 × (8 + 8 + 16) KiB with z in fp32 and 5 stages of 32 KiB (224
# KiB); 5 measured 1.04× 4 at 1024 and 2048 rows an expert, 0.97× at 256 (docs/DECISIONS.md).
FC1_BM, FC1_STAGES = 128, 5
FC1_FP8_STAGES = 5
# bf16 FC1 on cooperative tiles: 2 × 64 rows × 128 output columns (256 gate and up columns, m64n256
# wgmma), the plain GEMM's 3 stages of 48 KiB (144 KiB) + each consumer's one bf16 h tile (the gate,
# then the up half) and bf16 z tile of 64 × 128 (2 × 32 KiB): 208 KiB. A bf16 z only (an fp32 z tile
# would not fit), and G a multiple of 128 (a tile's gates in one block).
FC1_COOP_BN = 256
# fc1 takes those tiles by default where experts average at least this many rows (M / E, no device
# read), else ping-pong: at 256 rows an expert ping-pong measured 1.02× cooperative, at 1024 and 2048
# cooperative 1.18× and 1.03× ping-pong (docs/DECISIONS.md, "bf16 FC1 on cooperative 128 × 256 GLU tiles").
FC1_COOPERATIVE_ROWS = 512


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _device_reason(device_index: int) -> str:
    """``why_unavailable`` for one CUDA device, asked once: the per-launch check is on the host's path."""
    return why_unavailable(torch.device("cuda", device_index))


@functools.cache
def _smem_layout(block: tuple[int, int], fp32: bool = False):
    """The NVMMA shared layout of a TMA block of bf16 (or fp32) elements, built once per block."""
    from ._compat import gl

    return gl.NVMMASharedLayout.get_default_for(list(block), gl.float32 if fp32 else gl.bfloat16)


@functools.cache
def _fp8_smem_layout(block: tuple[int, int]):
    """The NVMMA shared layout of a TMA block of e4m3 codes."""
    from ._compat import gl

    return gl.NVMMASharedLayout.get_default_for(list(block), gl.float8e4nv)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _check(a: torch.Tensor, b: torch.Tensor, splits: torch.Tensor, out: torch.Tensor | None, b_layout: str,
           out_dtype: torch.dtype) -> None:
    for name, t in (("a", a), ("b", b), ("splits", splits)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"grouped_gemm: {name} must be a torch.Tensor, got {type(t).__name__}")
    if b_layout not in ("nk", "kn"):
        raise ValueError(
            f"grouped_gemm: b_layout must be 'nk' (B is (E, N, K)) or 'kn' (B is (E, K, N)), got {b_layout!r}"
        )
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"grouped_gemm: out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    if a.dim() != 2:
        raise ValueError(f"grouped_gemm: a must be (M, K), got shape {tuple(a.shape)}")
    if b.dim() != 3:
        raise ValueError(
            f"grouped_gemm: b must be (E, {'N, K' if b_layout == 'nk' else 'K, N'}), got shape {tuple(b.shape)}"
        )
    if splits.dim() != 1:
        raise ValueError(f"grouped_gemm: splits must be (E,), got shape {tuple(splits.shape)}")
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise TypeError(f"grouped_gemm: a and b must be bfloat16, got {a.dtype} and {b.dtype}")
    if splits.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"grouped_gemm: splits must be int32 or int64, got {splits.dtype}")
    if a.device.type != "cuda" or b.device != a.device or splits.device != a.device:
        raise TypeError(
            f"grouped_gemm: a, b and splits must be on one CUDA device, got {a.device}, {b.device}, {splits.device}"
        )
    M, K = a.shape
    E, N, Kb = b.shape if b_layout == "nk" else (b.shape[0], b.shape[2], b.shape[1])
    if Kb != K:
        raise ValueError(f"grouped_gemm: b's K dimension must be a's K = {K}, got {Kb} (b_layout {b_layout!r})")
    if splits.shape[0] != E:
        raise ValueError(f"grouped_gemm: splits must have one entry per expert (E = {E}), got {splits.shape[0]}")
    if E > MAX_EXPERTS:
        raise ValueError(f"grouped_gemm: at most {MAX_EXPERTS} experts (the table is held in registers), got {E}")
    # TMA: every row stride a multiple of 16 bytes, i.e. of 8 bf16 elements.
    if K % 8 or N % 8:
        raise ValueError(f"grouped_gemm: K and N must be multiples of 8 for TMA (16-byte rows), got K={K}, N={N}")
    if b_layout == "kn" and E > 1 and K % BK:
        # The experts are stacked along K: a K block that straddles two would read the next
        # expert's rows (TMA zero-fills only at the tensor's edge).
        raise ValueError(f"grouped_gemm: with b_layout 'kn' and several experts K must be a multiple of {BK}, got {K}")
    for name, t in (("a", a), ("b", b), ("splits", splits)):
        if not t.is_contiguous():
            raise ValueError(f"grouped_gemm: {name} must be contiguous (call .contiguous() first)")
    for name, t in (("a", a), ("b", b)):
        if t.data_ptr() % 16:
            raise ValueError(f"grouped_gemm: {name} must start on a 16-byte boundary for TMA")
    if out is not None:
        if out.shape != (M, N) or out.dtype != out_dtype or out.device != a.device:
            raise ValueError(
                f"grouped_gemm: out must be ({M}, {N}) {out_dtype} on {a.device}, "
                f"got {tuple(out.shape)} {out.dtype} on {out.device}"
            )
        if not out.is_contiguous() or out.data_ptr() % 16:
            raise ValueError("grouped_gemm: out must be contiguous and start on a 16-byte boundary")


def _check_acc_scale(where: str, acc_scale, device: torch.device) -> None:
    """The accumulator factor of a bf16 launch (nvfp4's product of 1/S_enc): None, or a 0-d fp32
    tensor on the operands' device, read by the kernel (never on the host)."""
    if acc_scale is None:
        return
    if not isinstance(acc_scale, torch.Tensor):
        raise TypeError(f"{where}: acc_scale must be a 0-d float32 tensor or None, got {type(acc_scale).__name__}")
    if acc_scale.dim() != 0:
        raise ValueError(f"{where}: acc_scale must be a 0-d tensor (one factor), got shape {tuple(acc_scale.shape)}")
    if acc_scale.dtype != torch.float32:
        raise TypeError(f"{where}: acc_scale must be float32, got {acc_scale.dtype}")
    if acc_scale.device != device:
        raise ValueError(f"{where}: acc_scale must be on the operands' device {device}, got {acc_scale.device}")


def _check_depth(where: str, name: str, depth: int, zero_ok: bool) -> None:
    """A promoted product's depth: a positive multiple of BK (or 0, off, where ``zero_ok``)."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0 or depth % BK or (depth == 0 and not zero_ok):
        allowed = f"0 or a positive multiple of {BK}" if zero_ok else f"a positive multiple of {BK}"
        raise ValueError(f"{where}: {name} must be {allowed} (a product's depth), got {depth!r}")


def _out_unless_trivial(out, M: int, N: int, K: int, E: int, out_dtype: torch.dtype,
                        device) -> tuple[torch.Tensor, bool]:
    """C (allocated when not given), and whether it is final already: nothing to compute (M or N is 0)
    or C = 0 (K or E is 0), so that no kernel launches."""
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=device)
    if M == 0 or N == 0:
        return out, True
    if K == 0 or E == 0:
        return out.zero_(), True
    return out, False


def supports(a: torch.Tensor, b: torch.Tensor, b_layout: str = "nk") -> str:
    """Why the engine cannot take these operands ("" when it can): the shape rules of ``grouped_gemm``
    that a caller with a fallback checks before choosing this path (no device read)."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        return "bf16 operands only"
    E = b.shape[0]
    K, N = (b.shape[2], b.shape[1]) if b_layout == "nk" else (b.shape[1], b.shape[2])
    if E > MAX_EXPERTS:
        return f"more than {MAX_EXPERTS} experts"
    if K % 8 or N % 8:
        return "K or N not a multiple of 8"
    if b_layout == "kn" and E > 1 and K % BK:
        return f"K not a multiple of {BK} with B as (E, K, N)"
    if not (a.is_contiguous() and b.is_contiguous()) or a.data_ptr() % 16 or b.data_ptr() % 16:
        return "operands not contiguous and 16-byte aligned"
    return why_unavailable(a.device)


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    splits: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    b_layout: str = "nk",
    out_dtype: torch.dtype = torch.bfloat16,
    promote: int = 0,
    cooperative: bool | None = None,
    acc_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """C[R_e] = A[R_e] @ B_e for every expert e, R_e the rows between offsets[e-1] and offsets[e]
    (offsets = cumsum(splits), computed on the device). a (M, K) bf16 with rows grouped by expert;
    b bf16 as (E, N, K) with B_e = b[e]ᵀ (``b_layout="nk"``: C = A @ W[e]ᵀ, the forward GEMMs) or as
    (E, K, N) with B_e = b[e] (``"kn"``: C = A @ W[e], the dgrads, read in place); splits (E,)
    int32/int64 on a's device. Returns C (M, N) in ``out_dtype`` (bf16, rounded once, or the fp32
    accumulator itself), written into ``out`` when given. ``promote`` (a multiple of 64, 0: off): each
    ``promote``-deep product is added to the fp32 accumulator with a round-to-nearest add (error
    bounded by promote·2^-23 for any K, where one tensor-core chain errs like K·2^-24), on 64-row
    tiles. ``cooperative``: both consumer warpgroups on one tile of 128 rows, 256 columns (a bf16 C)
    or, promoted, 128 columns (FC2_DGRAD's cooperative mainloop), rather than ping-pong tiles of
    128 (64 promoted) × 128; None: cooperative for a bf16 C without promotion (measured 0.88-1.19×
    ping-pong at the four model shapes' GEMMs, docs/DECISIONS.md), ping-pong otherwise. Both give
    the same bits. ``acc_scale`` (a 0-d fp32 tensor on a's device, nvfp4's product of per-tensor
    factors): the fp32 accumulator is multiplied by it, once, before it is rounded to C, as the
    Triton kernel's ACC_SCALE does. Rows past
    Σsplits get 0. Splits are clamped on the device (negative → 0 rows, a running sum past M stops
    at M), never read on the host."""
    _check_depth("grouped_gemm", "promote", promote, zero_ok=True)
    if cooperative is not None and not isinstance(cooperative, bool):
        raise TypeError(f"grouped_gemm: cooperative must be True, False or None, got {cooperative!r}")
    if cooperative and not promote and out_dtype != torch.bfloat16:
        raise ValueError(f"grouped_gemm: unpromoted cooperative tiles take a bf16 C (got out_dtype {out_dtype})")
    if isinstance(a, torch.Tensor):
        _check_acc_scale("grouped_gemm", acc_scale, a.device)
    _check(a, b, splits, out, b_layout, out_dtype)
    reason = why_unavailable(a.device)
    if reason:
        raise RuntimeError(f"grouped_gemm: the Gluon engine cannot run here: {reason}")
    from ._compat import TensorDescriptor
    from ._engine import MAXNREG, NUM_WARPS, grouped_gemm_kernel

    M, K = a.shape
    kmajor = b_layout == "nk"
    E, N = (b.shape[0], b.shape[1]) if kmajor else (b.shape[0], b.shape[2])
    out, done = _out_unless_trivial(out, M, N, K, E, out_dtype, a.device)
    if done:
        return out
    if cooperative is None:
        cooperative = not promote and out_dtype == torch.bfloat16
    # Promoted: the total and two products in flight are 3 × 64 registers at 64 rows (at 128 rows
    # they would not fit). Ring 4 × 24 KiB + 2 fp32 C tiles × 32 KiB = 160 KiB.
    if cooperative and promote:
        bm, bn, stages, parts = BM_PROMOTED, BN, STAGES, 2  # 4 × 32 KiB + 2 fp32 tiles × 32 KiB
    elif cooperative:
        bm, bn, stages, parts = BM_COOP, BN_COOP, STAGES_COOP, 2
    else:
        bm, bn, parts = (BM_PROMOTED if promote else BM), BN, 1
        stages = STAGES if (out_dtype == torch.bfloat16 or promote) else STAGES_FP32_OUT
    b_block = (bn, BK) if kmajor else (BK, bn)
    bind_context(a.device)  # the descriptors are encoded on this thread (kernels/_cuda_context.py)
    a_desc = TensorDescriptor.from_tensor(a, [bm, BK], _smem_layout((bm, BK)))
    b_desc = TensorDescriptor.from_tensor(b.view(E * b.shape[1], b.shape[2]), list(b_block), _smem_layout(b_block))
    c_desc = TensorDescriptor.from_tensor(out, [bm, bn], _smem_layout((bm, bn), out_dtype == torch.float32))
    e_block = max(32, 1 << (E - 1).bit_length())
    # Static bound on the tile count (M rows over E experts make at most cdiv(M, tile rows) + E
    # m-tiles, capacity included), so the grid needs no device read.
    tile_bound = (-(-M // (bm * parts)) + E) * -(-N // bn)
    device_index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    grid = (min(_num_sms(device_index), tile_bound),)
    with torch.cuda.device(a.device):
        # acc_scale None: a constexpr None, so the kernel without the factor is the one compiled before it
        launch(grouped_gemm_kernel, grid,
            a_desc, b_desc, c_desc, out, acc_scale, splits, E, M, N, K,
            BM=bm, BN=bn, BK=BK, STAGES=stages, GROUP_M=GROUP_M, E_BLOCK=e_block, B_KMAJOR=kmajor,
            PROMOTE=promote // BK, A_PARTS=parts, ACC_SCALE=acc_scale is not None, num_warps=NUM_WARPS,
            maxnreg=MAXNREG,
        )
    return out


# FC2_DGRAD's fused kernel (_fc2_dgrad.py): 64-row promoted tiles, stages of 24 KiB (ping-pong) or 32 KiB
# (cooperative), two fp32 epilogue tiles of 32 KiB. The epilogue reads its accumulator back in chunks of
# 64 columns.
DGRAD_CW = 64
# Ring stages of FC2_DGRAD on ping-pong tiles with the staged epilogue: 6 × 24 KiB (bf16) or 6 × 24
# KiB of e4m3 codes (fp8_block, 64 + 128 rows × 128) + 64 KiB of fp32 epilogue tiles = 208 KiB. Where
# experts are small the kernel is bound by its bytes' rate, and a deeper ring keeps more of them in
# flight while a warpgroup's epilogue waits on h: 6 stages ran 1.10x (qwen3) and 1.19x (gpt-oss) the
# 4-stage kernel in bf16, 1.01x and 1.02x under fp8_block, the same bits (docs/DECISIONS.md, "A 6-stage
# ring for ping-pong FC2_DGRAD", "Deeper rings where the bytes bind"). With G = 1 (gate and up
# interleaved column by column) bf16 takes 5: the offline sm_90 compile at 6 keeps 14 tile-loop values
# in local memory, at 5 none, and 5 ran 1.09x (gpt-oss) the 4-stage kernel. The register epilogue's
# bf16 tiles (96 KiB) leave no room; cooperative tiles measured no gain at 5 under fp8_block and keep
# STAGES, as does fp8_block at G = 1 (not measured).
DGRAD_PINGPONG_STAGES = 6
DGRAD_INTERLEAVED_STAGES = 5
# Cooperative 128-row tiles (both consumers issuing at once on one tile) where experts average at least
# this many rows, else 64-row tiles in ping-pong, where half of a 128-row tile over a small expert would
# be empty (docs/DECISIONS.md, "Cooperative 128-row tiles for FC2_DGRAD on large experts").
DGRAD_COOPERATIVE_ROWS = 1024
# FC2_DGRAD's default for ``epilogue_warpgroup`` (bf16): cooperative tiles at every expert size, the
# epilogue on a third warpgroup (_fc2_dgrad.EPI_WG). Off: faster alone at mixtral (1.06x) and gpt-oss
# (1.15x), level at deepseek-v3, 0.85x qwen3's ping-pong, and no step beyond its noise (docs/DECISIONS.md,
# "FC2_DGRAD's epilogue on a third, MMA-free warpgroup").
DGRAD_EPILOGUE_WARPGROUP = False
# The GLU kinds the fused epilogue implements (ActivationSpec.kernel_id): swiglu, clamped_swiglu.
DGRAD_ACTIVATIONS = (0, 1)


def _dgrad_stages(cooperative: bool, scaled: bool, regs: bool, G: int) -> int:
    """FC2_DGRAD's ring stages: on ping-pong tiles with the staged epilogue DGRAD_PINGPONG_STAGES, or
    DGRAD_INTERLEAVED_STAGES for bf16 at G = 1; else STAGES."""
    if cooperative or regs or (scaled and G == 1):
        return STAGES
    return DGRAD_INTERLEAVED_STAGES if G == 1 else DGRAD_PINGPONG_STAGES


def _fp8_stages(out_dtype: torch.dtype, M: int, E: int) -> int:
    """grouped_gemm_fp8's ring stages: FP8_STAGES_BF16_OUT for a bf16 C where experts average fewer
    than DGRAD_COOPERATIVE_ROWS rows, else FP8_STAGES."""
    small = M < DGRAD_COOPERATIVE_ROWS * E
    return FP8_STAGES_BF16_OUT if out_dtype == torch.bfloat16 and small else FP8_STAGES


def _register_epilogue_why(h: torch.Tensor, g_h: torch.Tensor, z: torch.Tensor | None, G: int, scaled: bool) -> str:
    """Why FC2_DGRAD cannot take the epilogue in the accumulator's layout (_fc2_dgrad._regs_epilogue;
    "" when it can): bf16, a tile's BN gates in one G block (G a multiple of BN), and h, g_h and z
    bf16, contiguous and 16-byte aligned for their TMA copies."""
    if scaled:
        return "fp8_block stores fp32 g_h and z (the staged epilogue)"
    if G % BN:
        return f"the GLU interleave {G} is not a multiple of {BN}"
    outs = (h, g_h) if z is None else (h, g_h, z)
    if not all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.data_ptr() % 16 == 0 for t in outs):
        return "h, g_h and z not contiguous, 16-byte aligned bf16"
    return ""


def fc2_dgrad_supports(dy: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, activation_id: int, glu: bool) -> str:
    """Why the fused FC2_DGRAD cannot take these operands ("" when it can): dy (M, H), w2 (E, H, F)
    contiguous or the transposed view of a contiguous (E, F, H), h (M, 2F), all bf16 (no device read)."""
    if not glu or activation_id not in DGRAD_ACTIVATIONS:
        return "the fused epilogue implements swiglu and clamped_swiglu"
    if dy.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16 or h.dtype != torch.bfloat16:
        return "bf16 operands only"
    E, H, F = w2.shape
    if E > MAX_EXPERTS:
        return f"more than {MAX_EXPERTS} experts"
    if H % 8 or F % 8:
        return "H or F not a multiple of 8"
    if not (dy.is_contiguous() and h.is_contiguous()) or dy.data_ptr() % 16 or w2.data_ptr() % 16:
        return "operands not contiguous and 16-byte aligned"
    if w2.is_contiguous():
        if E > 1 and H % BK:
            return f"H not a multiple of {BK} with W2 as (E, H, F)"
    elif not w2.transpose(1, 2).is_contiguous():
        return "W2 neither contiguous nor the transposed view of a contiguous tensor"
    if dy.device.type != "cuda":
        return "not a CUDA tensor"
    return _device_reason(_index(dy.device))


def fc2_dgrad_fp8_supports(dy: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, activation_id: int, glu: bool,
                           outs: tuple = ()) -> str:
    """Why the fused FC2_DGRAD cannot take fp8_block's operands ("" when it can): dy (M, H) e4m3 codes,
    w2 the transposed view of W2's K-major codes (E, F, H), h (M, 2F) bf16, and ``outs`` (g_h, z; None
    for one not written) contiguous bf16 or fp32 (no device read)."""
    if not glu or activation_id not in DGRAD_ACTIVATIONS:
        return "the fused epilogue implements swiglu and clamped_swiglu"
    fp8 = torch.float8_e4m3fn
    if dy.dtype != fp8 or w2.dtype != fp8 or h.dtype != torch.bfloat16:
        return "e4m3 codes of dy and W2 and a bf16 h only"
    E, H, F = w2.shape
    if E > MAX_EXPERTS:
        return f"more than {MAX_EXPERTS} experts"
    if H % 16:
        return "H not a multiple of 16 (TMA's 16-byte rows of codes)"
    if not w2.transpose(1, 2).is_contiguous() or (w2.is_contiguous() and E * F * H > 0):
        return "W2's codes not the transposed view of a contiguous (E, F, H)"
    if not (dy.is_contiguous() and h.is_contiguous()) or dy.data_ptr() % 16 or w2.data_ptr() % 16:
        return "operands not contiguous and 16-byte aligned"
    for out in outs:
        if out is not None and (out.dtype not in (torch.bfloat16, torch.float32) or not out.is_contiguous()):
            return "g_h and z must be contiguous bf16 or fp32"
    if dy.device.type != "cuda":
        return "not a CUDA tensor"
    return _device_reason(_index(dy.device))


def fc2_dgrad(
    dy: torch.Tensor,  # (M, H) bf16, rows grouped by expert
    w2: torch.Tensor,  # (E, H, F) bf16: contiguous, or the transposed view of a contiguous (E, F, H)
    splits: torch.Tensor,  # (E,) int32 / int64 on the device
    h: torch.Tensor,  # (M, 2F) bf16, the forward's stored pre-activation
    g_h: torch.Tensor,  # (M, 2F) bf16, written
    *,
    z: torch.Tensor | None,  # (M, F) bf16, written when given (dW2's operand)
    probs: torch.Tensor | None,  # (M,) fp32 / bf16 / fp16
    dprobs_partials: bool,
    glu_interleave: int,
    activation_id: int,
    params: tuple[float, float, float],
    promote_depth: int = PROMOTE_DEPTH,
    cooperative: bool | None = None,
    register_epilogue: bool | None = None,
    epilogue_warpgroup: bool | None = None,
    dy_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    acc_scale: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The MLP's FC2_DGRAD on the engine: g_z = dy[R_e] @ W2[e] in fp32 (each ``promote_depth``-deep
    product promoted),
    then g_h = g_z·p·act'(h), z = act(h)·p and the dprobs partials Σ_f g_z·a of each 128-column tile
    (returned, (⌈F/128⌉, M) fp32, when asked). Capacity rows get zeros. ``cooperative``: 128-row
    tiles, each consumer warpgroup taking 64 of its rows, both issuing at once (else 64-row tiles in
    ping-pong); the same bits either way; None: cooperative where the experts average at least
    DGRAD_COOPERATIVE_ROWS rows (M / E, no device read). ``register_epilogue``: the epilogue in the
    accumulator's layout (True; a ValueError where it cannot take these tensors) or staged through an
    fp32 shared tile (False), the same g_h and z bits, the dprobs partials summed in another order;
    None: in the accumulator's layout on cooperative tiles where it applies, staged otherwise
    (docs/DECISIONS.md, "FC2_DGRAD's epilogue in the accumulator's layout"). ``epilogue_warpgroup``:
    cooperative tiles whose two consumers run only mainloops and hand each tile's fp32 g_z to a third
    warpgroup that runs the staged epilogue meanwhile (bf16 only; True with fp8_block, with
    ``cooperative=False`` or with ``register_epilogue=True`` is a ValueError); the same g_h and z bits
    and the staged epilogue's partials; None: ``DGRAD_EPILOGUE_WARPGROUP``.

    fp8_block (``dy_scale`` and ``w2_scale`` given): dy holds e4m3 codes with dy_scale (M, ⌈H/128⌉)
    fp32 their 1×128 scales, w2 the transposed view of W2's K-major codes (E, F, H) with w2_scale
    (E, ⌈F/128⌉, ⌈H/128⌉) fp32 their 128×128 tile scales (any strides); each 128-deep product is
    scaled into g_z (``promote_depth`` is not read), and g_h and z may be fp32.

    ``acc_scale`` (bf16 only; a 0-d fp32 tensor on dy's device, nvfp4's product of per-tensor
    factors): g_z is the promoted fp32 total times it, once, before any epilogue form reads it (the
    Triton kernel's ACC_SCALE), so g_h, z and the partials all see the scaled g_z. The caller checked
    ``fc2_dgrad_supports`` (bf16) or ``fc2_dgrad_fp8_supports``."""
    from ._compat import TensorDescriptor
    from ._engine import EPI_MAXNREG, MAXNREG, NUM_WARPS
    from ._fc2_dgrad import fc2_dgrad_kernel

    _check_depth("fc2_dgrad", "promote_depth", promote_depth, zero_ok=False)
    for name, flag in (("cooperative", cooperative), ("register_epilogue", register_epilogue),
                       ("epilogue_warpgroup", epilogue_warpgroup)):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"fc2_dgrad: {name} must be a bool or None, got {type(flag).__name__}")
    scaled = dy_scale is not None
    if scaled != (w2_scale is not None):
        raise ValueError("fc2_dgrad: dy_scale and w2_scale come together (fp8_block) or not at all")
    if acc_scale is not None and scaled:
        raise ValueError("fc2_dgrad: acc_scale multiplies a bf16 accumulator; fp8_block's codes take dy_scale and "
                         "w2_scale")  # fmt: skip
    _check_acc_scale("fc2_dgrad", acc_scale, dy.device)
    M, H = dy.shape
    E, _, F = w2.shape
    if scaled:
        if w2.is_contiguous() and E * F * H > 0:
            raise ValueError("fc2_dgrad: fp8_block's W2 must be the transposed view of its K-major codes (E, F, H)")
        kb, nb = -(-H // FP8_BK), -(-F // BN)
        if tuple(dy_scale.shape) != (M, kb) or tuple(w2_scale.shape) != (E, nb, kb):
            raise ValueError(f"fc2_dgrad: dy_scale must be ({M}, {kb}) and w2_scale ({E}, {nb}, {kb}), got "
                             f"{tuple(dy_scale.shape)} and {tuple(w2_scale.shape)}")  # fmt: skip
    if epilogue_warpgroup:
        clash = [why for why, bad in (("fp8_block", scaled), ("cooperative=False", cooperative is False),
                                      ("register_epilogue=True", register_epilogue is True)) if bad]
        if clash:
            raise ValueError(f"fc2_dgrad: the epilogue warpgroup (bf16, cooperative tiles, staged epilogue) "
                             f"cannot run with {' and '.join(clash)}")
    elif epilogue_warpgroup is None:
        epilogue_warpgroup = (DGRAD_EPILOGUE_WARPGROUP and not scaled and cooperative is not False
                              and register_epilogue is not True)
    if epilogue_warpgroup:
        cooperative, register_epilogue = True, False
    if cooperative is None:
        cooperative = M >= DGRAD_COOPERATIVE_ROWS * E
    why_not_regs = _register_epilogue_why(h, g_h, z, glu_interleave, scaled)
    if register_epilogue and why_not_regs:
        raise ValueError(f"fc2_dgrad: the register epilogue cannot take these tensors: {why_not_regs}")
    # By default only on cooperative tiles, whose epilogue nothing else overlaps: there it ran 1.05x
    # on mixtral and level on deepseek-v3; in ping-pong, where the other warpgroup's mainloop already
    # hides the staged epilogue, 0.96-0.98x.
    regs = (cooperative if register_epilogue is None else register_epilogue) and not why_not_regs
    N1 = h.shape[1]
    partial = torch.empty((-(-F // BN), M), dtype=torch.float32, device=dy.device) if dprobs_partials else None
    if M == 0 or F == 0:
        return partial
    if H == 0 or E == 0:
        # g_z = 0: g_h, z and the partials are 0 whatever h holds (no activation read).
        g_h.zero_()
        if z is not None:
            z.zero_()
        if partial is not None:
            partial.zero_()
        return partial
    bm = BM_PROMOTED
    kmajor = not w2.is_contiguous()  # the transposed view of a contiguous (E, F, H): B as (E·F, H)
    b2d = w2.transpose(1, 2).reshape(E * F, H) if kmajor else w2.view(E * H, F)
    bk = FP8_BK if scaled else BK
    b_block = (BN, bk) if kmajor else (bk, BN)
    layout = _fp8_smem_layout if scaled else _smem_layout
    bind_context(dy.device)
    a_desc = TensorDescriptor.from_tensor(dy, [bm, bk], layout((bm, bk)))
    b_desc = TensorDescriptor.from_tensor(b2d, list(b_block), layout(b_block))
    if scaled:
        scale_args = (dy_scale, dy_scale.stride(0), dy_scale.stride(1), w2_scale, *w2_scale.stride())
    else:
        scale_args = (dy, 0, 0, dy, 0, 0, 0)  # never read: SCALED is off
    if regs:
        out_layout = _smem_layout((bm, BN))
        h_desc = TensorDescriptor.from_tensor(h, [bm, BN], out_layout)
        gh_desc = TensorDescriptor.from_tensor(g_h, [bm, BN], out_layout)
        z_desc = TensorDescriptor.from_tensor(z, [bm, BN], out_layout) if z is not None else gh_desc
    else:
        h_desc = gh_desc = z_desc = a_desc  # never used: REGS is off
    e_block = max(32, 1 << (E - 1).bit_length())
    a_parts = 2 if cooperative else 1
    tile_bound = (-(-M // (bm * a_parts)) + E) * -(-F // BN)
    grid = (min(_num_sms(_index(dy.device)), tile_bound),)
    dummy = g_h  # never dereferenced: the constexpr flags switch its loads and stores off
    with torch.cuda.device(dy.device):
        launch(fc2_dgrad_kernel, grid,
            a_desc, b_desc, h_desc, gh_desc, z_desc, h, g_h, z if z is not None else dummy,
            probs if probs is not None else dummy, partial if partial is not None else dummy, acc_scale, *scale_args,
            splits,
            E, M, F, H, N1,
            float(params[0]), float(params[1]), float(params[2]),
            BM=bm, BN=BN, BK=bk, STAGES=_dgrad_stages(cooperative, scaled, regs, glu_interleave), GROUP_M=GROUP_M,
            E_BLOCK=e_block, B_KMAJOR=kmajor, CW=DGRAD_CW,
            G=glu_interleave, CHAIN=1 if scaled else promote_depth // BK, ACT=activation_id,
            HAS_PROBS=probs is not None, STORE_Z=z is not None, STORE_PARTIAL=partial is not None, A_PARTS=a_parts,
            SCALED=scaled, REGS=regs, EPI_WG=epilogue_warpgroup, ACC_SCALE=acc_scale is not None, num_warps=NUM_WARPS,
            maxnreg=EPI_MAXNREG if epilogue_warpgroup else MAXNREG,
        )  # fmt: skip
    return partial


def fp8_supports(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> str:
    """Why ``grouped_gemm_fp8`` cannot take these operands ("" when it can): a (M, K) and b (E, N, K)
    e4m3 codes, contiguous and 16-byte aligned, with K a multiple of 16, N of 8, and ``out`` a
    contiguous bf16 or fp32 C (no device read)."""
    fp8 = torch.float8_e4m3fn
    if a.dtype != fp8 or b.dtype != fp8 or b.dim() != 3:
        return "e4m3 codes with B as (E, N, K) only"
    E, N, K = b.shape
    if E > MAX_EXPERTS:
        return f"more than {MAX_EXPERTS} experts"
    if K % 16 or N % 8:
        return "K not a multiple of 16 or N not of 8 (TMA's 16-byte rows)"
    if not (a.is_contiguous() and b.is_contiguous()) or a.data_ptr() % 16 or b.data_ptr() % 16:
        return "operands not contiguous and 16-byte aligned"
    if out.dtype not in (torch.bfloat16, torch.float32) or not out.is_contiguous() or out.data_ptr() % 16:
        return "C must be a contiguous, 16-byte aligned bf16 or fp32 tensor"
    if a.device.type != "cuda":
        return "not a CUDA tensor"
    return _device_reason(_index(a.device))


def grouped_gemm_fp8(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    splits: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """fp8_block's grouped GEMM on the engine: C[R_e] = dequant(A)[R_e] @ dequant(B[e])ᵀ, with a (M, K)
    float8_e4m3fn codes (rows grouped by expert) and a_scale (M, ⌈K/128⌉) fp32 their 1×128 scales
    (any strides), b (E, N, K) float8_e4m3fn codes and b_scale (E, ⌈N/128⌉, ⌈K/128⌉) fp32 their
    128×128 block scales (any strides). Each 128-deep product is scaled and added to the fp32
    accumulator as the Triton kernel adds it. Returns C (M, N) in ``out_dtype`` (bf16 or fp32), written
    into ``out`` when given; rows past Σsplits get 0. Splits are clamped on the device and never read
    on the host."""
    fp8 = torch.float8_e4m3fn
    for name, t in (("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale), ("splits", splits)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"grouped_gemm_fp8: {name} must be a torch.Tensor, got {type(t).__name__}")
    if a.dtype != fp8 or b.dtype != fp8:
        raise TypeError(f"grouped_gemm_fp8: a and b must be float8_e4m3fn codes, got {a.dtype} and {b.dtype}")
    if a_scale.dtype != torch.float32 or b_scale.dtype != torch.float32:
        raise TypeError(f"grouped_gemm_fp8: the scales must be float32, got {a_scale.dtype} and {b_scale.dtype}")
    if splits.dtype not in (torch.int32, torch.int64) or splits.dim() != 1:
        raise TypeError(
            f"grouped_gemm_fp8: splits must be (E,) int32 or int64, got {tuple(splits.shape)} {splits.dtype}"
        )
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"grouped_gemm_fp8: out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(
            f"grouped_gemm_fp8: a must be (M, K) and b (E, N, K), got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    M, K = a.shape
    E, N, Kb = b.shape
    if Kb != K:
        raise ValueError(f"grouped_gemm_fp8: b's K dimension must be a's K = {K}, got {Kb}")
    if splits.shape[0] != E:
        raise ValueError(f"grouped_gemm_fp8: splits must have one entry per expert (E = {E}), got {splits.shape[0]}")
    kb, nb = -(-K // FP8_BK), -(-N // BN)
    if tuple(a_scale.shape) != (M, kb) or tuple(b_scale.shape) != (E, nb, kb):
        raise ValueError(f"grouped_gemm_fp8: a_scale must be ({M}, {kb}) and b_scale ({E}, {nb}, {kb}), got "
                         f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)}")  # fmt: skip
    if E > MAX_EXPERTS:
        raise ValueError(f"grouped_gemm_fp8: at most {MAX_EXPERTS} experts (the table is held in registers), got {E}")
    if K % 16 or N % 8:
        raise ValueError(
            f"grouped_gemm_fp8: K must be a multiple of 16 and N of 8 for TMA (16-byte rows), got K={K}, N={N}"
        )
    devices = {t.device for t in (a, a_scale, b, b_scale, splits)}
    if len(devices) != 1 or a.device.type != "cuda":
        raise TypeError(f"grouped_gemm_fp8: every tensor must be on one CUDA device, got {sorted(map(str, devices))}")
    for name, t in (("a", a), ("b", b), ("splits", splits)):
        if not t.is_contiguous():
            raise ValueError(f"grouped_gemm_fp8: {name} must be contiguous (call .contiguous() first)")
    if a.data_ptr() % 16 or b.data_ptr() % 16:
        raise ValueError("grouped_gemm_fp8: a and b must start on a 16-byte boundary for TMA")
    if out is not None and (out.shape != (M, N) or out.dtype != out_dtype or out.device != a.device
                            or not out.is_contiguous() or out.data_ptr() % 16):  # fmt: skip
        raise ValueError(f"grouped_gemm_fp8: out must be a contiguous, 16-byte aligned ({M}, {N}) {out_dtype} "
                         f"on {a.device}")  # fmt: skip
    reason = why_unavailable(a.device)
    if reason:
        raise RuntimeError(f"grouped_gemm_fp8: the Gluon engine cannot run here: {reason}")
    from ._compat import TensorDescriptor
    from ._engine import MAXNREG, NUM_WARPS, grouped_gemm_fp8_kernel

    out, done = _out_unless_trivial(out, M, N, K, E, out_dtype, a.device)
    if done:
        return out
    bind_context(a.device)
    a_desc = TensorDescriptor.from_tensor(a, [FP8_BM, FP8_BK], _fp8_smem_layout((FP8_BM, FP8_BK)))
    b_desc = TensorDescriptor.from_tensor(b.view(E * N, K), [BN, FP8_BK], _fp8_smem_layout((BN, FP8_BK)))
    c_desc = TensorDescriptor.from_tensor(out, [FP8_BM, BN], _smem_layout((FP8_BM, BN), out_dtype == torch.float32))
    e_block = max(32, 1 << (E - 1).bit_length())
    tile_bound = (-(-M // (2 * FP8_BM)) + E) * -(-N // BN)
    grid = (min(_num_sms(_index(a.device)), tile_bound),)
    with torch.cuda.device(a.device):
        launch(grouped_gemm_fp8_kernel, grid,
            a_desc, b_desc, c_desc, out, a_scale, a_scale.stride(0), a_scale.stride(1), b_scale, b_scale.stride(0),
            b_scale.stride(1), b_scale.stride(2), splits, E, M, N, K,
            BM=FP8_BM, BN=BN, BK=FP8_BK, STAGES=_fp8_stages(out_dtype, M, E), GROUP_M=GROUP_M, E_BLOCK=e_block,
            num_warps=NUM_WARPS, maxnreg=MAXNREG,
        )  # fmt: skip
    return out


def fc1_supports(x: torch.Tensor, w1: torch.Tensor, h: torch.Tensor, z: torch.Tensor | None, activation_id: int,
                 glu: bool, glu_interleave: int) -> str:
    """Why FC1 on the engine cannot take these operands ("" when it can): x (M, H) and w1 (E, N1, H)
    both bf16 or both e4m3 codes (fp8_block), contiguous and 16-byte aligned, H positive with 16-byte
    rows, N1 = 2F with gate / up blocks of G = ``glu_interleave`` columns, G a multiple of 64 (a
    tile's 64 gates in one block); h (M, N1) bf16 and z (M, F) bf16 or fp32 (or None), contiguous
    (no device read)."""
    if not glu or activation_id not in DGRAD_ACTIVATIONS:
        return "the fused epilogue implements swiglu and clamped_swiglu"
    if x.dtype not in (torch.bfloat16, torch.float8_e4m3fn) or w1.dtype != x.dtype or w1.dim() != 3:
        return "x and W1 (E, N1, H) both bf16 or both e4m3 codes only"
    E, N1, H = w1.shape
    G = glu_interleave
    if E == 0 or E > MAX_EXPERTS:
        return f"1 to {MAX_EXPERTS} experts"
    if H == 0 or (H * x.element_size()) % 16:
        return "H not positive with 16-byte rows (TMA)"
    if N1 % 2 or G <= 0 or G % (BN // 2) or (N1 // 2) % G:
        return f"gate / up blocks of G columns, G a multiple of {BN // 2} dividing F"
    if not (x.is_contiguous() and w1.is_contiguous()) or x.data_ptr() % 16 or w1.data_ptr() % 16:
        return "operands not contiguous and 16-byte aligned"
    if h.dtype != torch.bfloat16 or not h.is_contiguous() or h.data_ptr() % 16:
        return "h must be a contiguous, 16-byte aligned bf16 tensor (TMA stores)"
    if z is not None and (z.dtype not in (torch.bfloat16, torch.float32) or not z.is_contiguous()
                          or z.data_ptr() % 16):  # fmt: skip
        return "z must be a contiguous, 16-byte aligned bf16 or fp32 tensor (TMA stores)"
    if x.device.type != "cuda":
        return "not a CUDA tensor"
    return _device_reason(_index(x.device))


def fc1_cooperative_why(scaled: bool, fp32_z: bool, glu_interleave: int) -> str:
    """Why FC1 cannot take bf16 cooperative tiles ("" when it can; ``fc1_cooperative`` says whether
    it does by default)."""
    if scaled:
        return "bf16 operands (fp8_block has its own cooperative tiles)"
    if fp32_z:
        return "a bf16 z or none (an fp32 z's shared tiles would not fit beside the ring)"
    if glu_interleave % (FC1_COOP_BN // 2):
        return f"gate / up blocks of a multiple of {FC1_COOP_BN // 2} columns (G = {glu_interleave})"
    return ""


def fc1_cooperative(M: int, E: int, scaled: bool, fp32_z: bool, glu_interleave: int) -> bool:
    """Whether ``fc1(cooperative=None)`` takes bf16 cooperative tiles: where they apply and the
    experts average at least FC1_COOPERATIVE_ROWS rows."""
    return not fc1_cooperative_why(scaled, fp32_z, glu_interleave) and M >= FC1_COOPERATIVE_ROWS * E


def fc1(
    x: torch.Tensor,  # (M, H) bf16 or e4m3 codes, rows grouped by expert
    w1: torch.Tensor,  # (E, N1, H) bf16 or e4m3 codes
    splits: torch.Tensor,  # (E,) int32 / int64 on the device
    h: torch.Tensor,  # (M, N1) bf16, written
    *,
    z: torch.Tensor | None,  # (M, F) bf16 / fp32, written when given
    bias: torch.Tensor | None,  # (E, N1) fc1_bias, contiguous
    probs: torch.Tensor | None,  # (M,) fp32 / bf16 / fp16
    glu_interleave: int,
    activation_id: int,
    params: tuple[float, float, float],
    x_scale: torch.Tensor | None = None,  # fp8_block: (M, ⌈H/128⌉) fp32, any strides
    w1_scale: torch.Tensor | None = None,  # fp8_block: (E, ⌈N1/128⌉, ⌈H/128⌉) fp32 tile scales, any strides
    cooperative: bool | None = None,
    acc_scale: torch.Tensor | None = None,  # bf16: 0-d fp32, the accumulator's factor (nvfp4's 1/S_enc product)
    z_mx: bool = False,  # bf16 z holds mxfp8's values of the fp32 z (1×32 blocks along F): FC2's operand
) -> None:
    """FC1 on the engine: h = x[R_e] @ W1[e]ᵀ (+ b1) in fp32, rounded once to bf16, and z =
    act(gate, up)·p from the fp32 h; capacity rows get zeros. bf16 operands one unpromoted chain a
    tile (the Triton kernel's arithmetic), on 128-row ping-pong tiles of 64 output columns or, with
    ``cooperative``, 128-row cooperative tiles of 128 (G a multiple of 128, z bf16 or None); the same
    bits either way; None: ``fc1_cooperative``. fp8_block's codes (the scales given) on
    cooperative tiles, each 128-deep product scaled into h. ``acc_scale`` (bf16 only): h's fp32
    accumulator times it, once, before the bias, the GLU and the probs (the Triton kernel's
    ACC_SCALE). ``z_mx`` (mxfp8): z written as its mxfp8 values (code · 2^(e − 127), 1×32 blocks along
    F, from the fp32 z; ``quant.dequantized(z, mxfp8)``'s bits), FC2's operand with no fp32 z and no
    pass over it. The caller checked ``fc1_supports``; the scales' shapes, ``acc_scale``, ``z_mx`` and
    ``cooperative`` are checked here."""
    from ._compat import TensorDescriptor
    from ._engine import MAXNREG, NUM_WARPS
    from ._fc1 import fc1_kernel

    scaled = x_scale is not None
    if scaled != (w1_scale is not None):
        raise ValueError("fc1: x_scale and w1_scale come together (fp8_block) or not at all")
    if acc_scale is not None and scaled:
        raise ValueError("fc1: acc_scale multiplies a bf16 accumulator; fp8_block's codes take x_scale and w1_scale")
    _check_acc_scale("fc1", acc_scale, x.device)
    if z_mx and (scaled or acc_scale is not None or z is None or z.dtype != torch.bfloat16):
        raise ValueError("fc1: z_mx writes mxfp8's values of z into a bf16 z, from bf16 operands with no factor")
    M, H = x.shape
    E, N1, _ = w1.shape
    F = N1 // 2
    if scaled:
        kb, nb = -(-H // FP8_BK), -(-N1 // BN)
        if tuple(x_scale.shape) != (M, kb) or tuple(w1_scale.shape) != (E, nb, kb):
            raise ValueError(f"fc1: x_scale must be ({M}, {kb}) and w1_scale ({E}, {nb}, {kb}), got "
                             f"{tuple(x_scale.shape)} and {tuple(w1_scale.shape)}")  # fmt: skip
    if bias is not None and (tuple(bias.shape) != (E, N1) or not bias.is_contiguous()):
        raise ValueError(f"fc1: bias must be a contiguous ({E}, {N1}), got {tuple(bias.shape)}")
    if cooperative is not None and not isinstance(cooperative, bool):
        raise TypeError(f"fc1: cooperative must be True, False or None, got {cooperative!r}")
    fp32_z = z is not None and z.dtype == torch.float32
    why_not_coop = fc1_cooperative_why(scaled, fp32_z, glu_interleave)
    if cooperative and why_not_coop:
        raise ValueError(f"fc1: bf16 cooperative tiles take {why_not_coop}")
    if cooperative is None:
        cooperative = fc1_cooperative(M, E, scaled, fp32_z, glu_interleave)
    if M == 0 or F == 0:
        return
    bn = BN
    if scaled:
        bm, bk, stages, a_parts = FP8_BM, FP8_BK, FC1_FP8_STAGES, 2
    elif cooperative:
        bm, bk, stages, a_parts, bn = BM_COOP, BK, STAGES_COOP, 2, FC1_COOP_BN
    else:
        bm, bk, stages, a_parts = FC1_BM, BK, FC1_STAGES - fp32_z, 1
    layout = _fp8_smem_layout if scaled else _smem_layout
    bind_context(x.device)
    a_desc = TensorDescriptor.from_tensor(x, [bm, bk], layout((bm, bk)))
    b_desc = TensorDescriptor.from_tensor(w1.view(E * N1, H), [bn // 2, bk], layout((bn // 2, bk)))
    out_block = (bm, bn // 2)
    h_desc = TensorDescriptor.from_tensor(h, list(out_block), _smem_layout(out_block))
    if z is not None:
        z_desc = TensorDescriptor.from_tensor(z, list(out_block), _smem_layout(out_block, z.dtype == torch.float32))
    else:
        z_desc = h_desc  # never used: STORE_Z is off
    if scaled:
        scale_args = (x_scale, x_scale.stride(0), x_scale.stride(1), w1_scale, *w1_scale.stride())
    else:
        scale_args = (x, 0, 0, x, 0, 0, 0)  # never read: SCALED is off
    e_block = max(32, 1 << (E - 1).bit_length())
    tile_bound = (-(-M // (bm * a_parts)) + E) * -(-F // (bn // 2))
    grid = (min(_num_sms(_index(x.device)), tile_bound),)
    dummy = h  # never dereferenced: the constexpr flags switch its loads and stores off
    with torch.cuda.device(x.device):
        launch(fc1_kernel, grid,
            a_desc, b_desc, h_desc, z_desc, h, z if z is not None else dummy, bias if bias is not None else dummy,
            probs if probs is not None else dummy, acc_scale, *scale_args, splits, E, M, F, H, N1,
            float(params[0]), float(params[1]), float(params[2]),
            BM=bm, BN=bn, BK=bk, STAGES=stages, GROUP_M=GROUP_M, E_BLOCK=e_block, G=glu_interleave,
            ACT=activation_id, HAS_BIAS=bias is not None, HAS_PROBS=probs is not None, STORE_Z=z is not None,
            SCALED=scaled, A_PARTS=a_parts, ACC_SCALE=acc_scale is not None, MX_Z=z_mx, num_warps=NUM_WARPS,
            maxnreg=MAXNREG,
        )  # fmt: skip


# fp8_block's weight gradients (_wgrad.py): the FP8 tiles above, 128 rows of N (two consumers' halves)
# × 128 columns of K, GROUP_N n-tiles sharing each Xᵀ k-tile.
WGRAD_GROUP_N = 8


def fp8_wgrad_supports(g_t: torch.Tensor, x_t: torch.Tensor, out_dtype: torch.dtype, experts: int = 1) -> str:
    """Why fp8_block's weight gradient on the engine cannot take these operands ("" when it can): the
    transposed codes Gᵀ (N, P) and Xᵀ (K, P) (``quantize_wgrad(..., transposed=True)``'s), contiguous
    and 16-byte aligned, dW (E, N, K) in bf16 or fp32 with 16-byte rows, and 1 to MAX_EXPERTS
    ``experts`` (no device read)."""
    fp8 = torch.float8_e4m3fn
    if g_t.dtype != fp8 or x_t.dtype != fp8 or g_t.dim() != 2 or x_t.dim() != 2:
        return "2-D e4m3 codes only"
    if not 0 < experts <= MAX_EXPERTS:
        return f"1 to {MAX_EXPERTS} experts"
    if out_dtype not in (torch.bfloat16, torch.float32):
        return "dW in bf16 or fp32 only"
    K = x_t.shape[0]
    if (K * (2 if out_dtype == torch.bfloat16 else 4)) % 16:
        return "dW's rows not 16-byte multiples (TMA)"
    if g_t.shape[0] % 4 or K % 4:
        return "G's or X's columns not a multiple of 4 (the scales' rows are loaded by TMA)"
    if not (g_t.is_contiguous() and x_t.is_contiguous()) or g_t.data_ptr() % 16 or x_t.data_ptr() % 16:
        return "codes not contiguous and 16-byte aligned"
    if g_t.device.type != "cuda":
        return "not a CUDA tensor"
    return _device_reason(_index(g_t.device))


def fp8_wgrad(
    g_t: torch.Tensor,  # (N, P) e4m3 codes of Gᵀ
    g_scales: torch.Tensor,  # (P/128, N) fp32
    x_t: torch.Tensor,  # (K, P) e4m3 codes of Xᵀ
    x_scales: torch.Tensor,  # (P/128, K) fp32
    splits: torch.Tensor,  # (E,) int32 / int64, the splits the operands were quantized with
    T: int,  # source rows of both operands
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """dW (E, N, K) in ``out_dtype``: dW[e] = dequant(G)[R_e]ᵀ @ dequant(X)[R_e], zeros for an expert
    with no rows, as ``kernels.gemm.launch.fp8_grouped_wgrad`` computes it (the same bits), on the
    engine. The caller checked ``fp8_wgrad_supports``; the shapes are checked here."""
    from ._compat import TensorDescriptor
    from ._engine import MAXNREG, NUM_WARPS
    from ._wgrad import fp8_wgrad_kernel

    (N, P), K, E = g_t.shape, x_t.shape[0], splits.shape[0]
    if x_t.shape[1] != P or P % FP8_BK or P != (-(-T // FP8_BK) + E) * FP8_BK:
        raise ValueError(f"fp8_wgrad: Gᵀ and Xᵀ must have P = (⌈T/128⌉ + E)·128 rows for T = {T}, E = {E}, got "
                         f"{tuple(g_t.shape)} and {tuple(x_t.shape)}")  # fmt: skip
    if tuple(g_scales.shape) != (P // FP8_BK, N) or tuple(x_scales.shape) != (P // FP8_BK, K):
        raise ValueError(f"fp8_wgrad: the scales must be ({P // FP8_BK}, {N}) and ({P // FP8_BK}, {K}), got "
                         f"{tuple(g_scales.shape)} and {tuple(x_scales.shape)}")  # fmt: skip
    if E > MAX_EXPERTS:
        raise ValueError(f"fp8_wgrad: at most {MAX_EXPERTS} experts (the table is held in registers), got {E}")
    out = torch.empty((E, N, K), dtype=out_dtype, device=g_t.device)
    if out.numel() == 0:
        return out
    bind_context(g_t.device)
    g_desc = TensorDescriptor.from_tensor(g_t, [FP8_BM, FP8_BK], _fp8_smem_layout((FP8_BM, FP8_BK)))
    x_desc = TensorDescriptor.from_tensor(x_t, [BN, FP8_BK], _fp8_smem_layout((BN, FP8_BK)))
    # The scales by TMA, a [1, ·] row of a block's scales a stage (unswizzled fp32).
    gs_desc = TensorDescriptor.from_tensor(g_scales.contiguous(), [1, 2 * FP8_BM], _smem_layout((1, 2 * FP8_BM), True))
    xs_desc = TensorDescriptor.from_tensor(x_scales.contiguous(), [1, BN], _smem_layout((1, BN), True))
    c2d = out.view(E * N, K)
    c_desc = TensorDescriptor.from_tensor(c2d, [FP8_BM, BN], _smem_layout((FP8_BM, BN), out_dtype == torch.float32))
    e_block = max(32, 1 << (E - 1).bit_length())
    tiles = E * -(-N // (2 * FP8_BM)) * -(-K // BN)
    grid = (min(_num_sms(_index(g_t.device)), tiles),)
    with torch.cuda.device(g_t.device):
        launch(fp8_wgrad_kernel, grid,
            g_desc, x_desc, gs_desc, xs_desc, c_desc, c2d, splits, E, T, N, K,
            BM=FP8_BM, BN=BN, STAGES=FP8_STAGES, GROUP_N=WGRAD_GROUP_N, E_BLOCK=e_block,
            num_warps=NUM_WARPS, maxnreg=MAXNREG,
        )  # fmt: skip
    return out


# bf16 weight gradients (_wgrad.wgrad_kernel): ping-pong 128 × 128 tiles of dW. A bf16 dW takes 32 rows a
# step, 8 stages of (128 + 128) × 32 × 2 B = 128 KiB: 32-row steps waste at most 31 rows of MMAs on an
# expert's last step (64-row ones up to 63, a third of a 128-row expert's work) and zero half as many
# bytes there: 3-11 % faster where experts have 128-256 rows, the same bits. An fp32 dW (main_grad)
# has two 64 KiB epilogue tiles beside the ring: 32-row steps in 6 stages of 16 KiB, or 64-row steps
# in 3 stages of 32 KiB, which halve the barrier round trips a row. Each won where the other lost:
# 64-row steps 1.2-1.3x on gpt-oss's dW1 and dW2 (128 rows an expert), 32-row steps 1.15x on
# qwen3's (256), so the split is at 192 rows an expert on average (docs/DECISIONS.md).
WGRAD_BM, WGRAD_BN = 128, 128
WGRAD_FP32_LONG_STEP_ROWS = 192


def _wgrad_step(out_dtype: torch.dtype, rows_per_expert: float) -> tuple[int, int]:
    """(rows a step, stages) of the bf16 weight-gradient kernel for a dW in ``out_dtype``."""
    if out_dtype != torch.float32:
        return 32, 8
    return (64, 3) if rows_per_expert <= WGRAD_FP32_LONG_STEP_ROWS else (32, 6)


def wgrad_supports(g: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype, experts: int = 1) -> str:
    """Why the bf16 weight gradient on the engine cannot take these operands ("" when it can): G (T, N)
    and X (T, K) bf16, contiguous and 16-byte aligned with 16-byte rows, dW in bf16 or fp32, and 1 to
    MAX_EXPERTS ``experts`` (no device read)."""
    if g.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or g.dim() != 2 or x.dim() != 2:
        return "2-D bf16 operands only"
    if g.shape[0] != x.shape[0]:
        return "G and X must have the same rows"
    if not 0 < experts <= MAX_EXPERTS:
        return f"1 to {MAX_EXPERTS} experts"
    if out_dtype not in (torch.bfloat16, torch.float32):
        return "dW in bf16 or fp32 only"
    if g.shape[1] % 8 or x.shape[1] % 8:
        return "N or K not a multiple of 8 (TMA: 16-byte rows)"
    if not (g.is_contiguous() and x.is_contiguous()) or g.data_ptr() % 16 or x.data_ptr() % 16:
        return "operands not contiguous and 16-byte aligned"
    if g.device.type != "cuda" or x.device != g.device:
        return "not CUDA tensors on one device"
    return _device_reason(_index(g.device))


def wgrad(
    g: torch.Tensor,  # (T, N) bf16, rows grouped by expert
    x: torch.Tensor,  # (T, K) bf16
    splits: torch.Tensor,  # (E,) int32 / int64 on g's device
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    acc_scale: torch.Tensor | None = None,  # 0-d fp32 on g's device: dW's factor (nvfp4's 1/S_enc product)
) -> torch.Tensor:
    """dW (E, N, K) in ``out_dtype``: dW[e] = G[R_e]ᵀ @ X[R_e], one chained fp32 accumulator a tile
    (times ``acc_scale`` where given, once, before its rounding) rounded once, zeros for an expert
    with no rows: the bits of ``kernels.gemm.launch.launch_grouped_wgrad`` on the same operands (and
    ``acc_factors``), on the engine. Splits are clamped on the device (negative → 0 rows, a running
    sum past T stops at T), never read on the host. Raises where ``wgrad_supports`` names a reason."""
    if not isinstance(splits, torch.Tensor) or splits.dim() != 1 or splits.dtype not in (torch.int32, torch.int64):
        raise TypeError("wgrad: splits must be a 1-D int32 or int64 tensor")
    if isinstance(g, torch.Tensor):
        _check_acc_scale("wgrad", acc_scale, g.device)
    why = wgrad_supports(g, x, out_dtype, splits.shape[0])
    if why:
        raise ValueError(f"wgrad: the engine cannot take these operands: {why}")
    if splits.device != g.device:
        raise ValueError(f"wgrad: splits must be on {g.device}, got {splits.device}")
    from ._compat import TensorDescriptor
    from ._engine import MAXNREG, NUM_WARPS
    from ._wgrad import wgrad_kernel

    (T, N), K, E = g.shape, x.shape[1], splits.shape[0]
    out = torch.empty((E, N, K), dtype=out_dtype, device=g.device)
    if out.numel() == 0:
        return out
    if T == 0:
        return out.zero_()
    bind_context(g.device)
    fp32 = out_dtype == torch.float32
    bk, stages = _wgrad_step(out_dtype, T / E)
    g_desc = TensorDescriptor.from_tensor(g, [bk, WGRAD_BM], _smem_layout((bk, WGRAD_BM)))
    x_desc = TensorDescriptor.from_tensor(x, [bk, WGRAD_BN], _smem_layout((bk, WGRAD_BN)))
    c2d = out.view(E * N, K)
    c_desc = TensorDescriptor.from_tensor(c2d, [WGRAD_BM, WGRAD_BN], _smem_layout((WGRAD_BM, WGRAD_BN), fp32))
    e_block = max(32, 1 << (E - 1).bit_length())
    tiles = E * -(-N // WGRAD_BM) * -(-K // WGRAD_BN)
    grid = (min(_num_sms(_index(g.device)), tiles),)
    with torch.cuda.device(g.device):
        launch(wgrad_kernel, grid,
            g_desc, x_desc, c_desc, c2d, acc_scale, splits, E, T, N, K,
            BM=WGRAD_BM, BN=WGRAD_BN, BK=bk, STAGES=stages, GROUP_N=WGRAD_GROUP_N, E_BLOCK=e_block,
            ACC_SCALE=acc_scale is not None, num_warps=NUM_WARPS, maxnreg=MAXNREG,
        )  # fmt: skip
    return out
