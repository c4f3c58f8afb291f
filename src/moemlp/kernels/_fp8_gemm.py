"""The native fp8_block grouped GEMM (SPEC §3): e4m3 operands on Hopper's FP8 tensor cores, block
scales applied by promoting each 128-deep partial sum into an fp32 accumulator (DeepGEMM's scheme,
as DeepSeek-V3 trains).

    out[R_e] = A[R_e] @ B[e]ᵀ (+ bias[e])       for every expert e, rows R_e grouped by expert

    A: (M, K) e4m3 codes, fp32 dequantization scales per row and 128-column block (M, ⌈K/128⌉)
       (``quantize(x, recipe, axis=-1)``: 1×128 blocks along the reduction dim)
    B: (E, N, K) e4m3 codes, fp32 dequantization scales per 128×128 tile (E, ⌈N/128⌉, ⌈K/128⌉)
       (``quantize_weight(w, recipe)``)

Per 128-deep K step (BK = 128 = one scale block of both operands):

    acc += dot(a_codes, b_codes) · (a_scale[:, None] · b_scale[None, :])

The products of two e4m3 codes are exact; the 128-deep partial sum is the tensor cores' (on
Hopper a limited-precision accumulation, ~14 bits per DeepSeek-V3 §3.3.2, which is why the chain is
cut every 128); the scaling and the add into ``acc`` are ordinary fp32 (round-to-nearest) CUDA-core
arithmetic. With ``pow2_scales`` (the recipe's default) the scale product is exact.

Expert offsets come from ``splits`` inside the kernel (``_grouped_gemm._expert_table``: clamped, no
host read), the launch is persistent over m-tiles × n-tiles, and rows past Σsplits are covered by
capacity tiles that write zeros. Operand tiles come through TMA descriptors where the code rows are
16-byte aligned (K % 16 == 0; the copy engine zero-fills the K tail and past each expert's N rows),
else through masked pointer loads (any K, N); scales through pointer loads. Not yet measured on the
H200 (benchmarks/NOTES.md, "fp8_block GEMM").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._grouped_gemm import INTERPRET, TensorDescriptor, _e_block, _expert_table, _num_programs, _pick, _rounded, _tma_ok

__all__ = ["Fp8GemmConfig", "fp8_block_grouped_gemm", "fp8_block_grouped_linear", "default_fp8_config"]

BLOCK = 128  # fp8_block's scale block along K, for both operands; the GEMM's BK


@triton.jit
def _fp8_block_grouped_gemm_kernel(
    a_ptr,  # (M, K) e4m3 codes, rows grouped by expert, contiguous
    a_scale_ptr,  # fp32 dequant scale of row m, K block kb at m·stride_asm + kb·stride_ask ((M, ⌈K/128⌉) or its .t())
    b_ptr,  # (E, N, K) e4m3 codes, contiguous (K-major: what FP8 wgmma wants for both operands)
    b_scale_ptr,  # (E, ⌈N/128⌉, ⌈K/128⌉) fp32 dequant scale per 128×128 tile, contiguous
    a_desc,  # TMA descriptor of the a codes, block [BM, BK] (USE_TMA), else None
    b_desc,  # TMA descriptor of the (E, N, K) b codes, block [1, BN, BK] (USE_TMA), else None
    splits_ptr,  # (E,) int32/int64 rows per expert, on the device
    bias_ptr,  # (E, N) any float dtype, added in fp32 (HAS_BIAS)
    out_ptr,  # (M, N) bf16 / fp16 / fp32
    M, N, K, E,
    stride_asm, stride_ask,
    NUM_PROGS,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,  # = 128, one scale block
    GROUP_M: tl.constexpr,
    E_BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    tl.static_assert(BK == 128, "a K step must be exactly one 128-deep scale block")
    pid = tl.program_id(0)
    idx, starts, ends, tiles, tile_cum = _expert_table(splits_ptr, E, M, E_BLOCK, BM)
    total_rows = tl.max(ends)
    real_m_tiles = tl.sum(tiles)
    cap_m_tiles = (M - total_rows + BM - 1) // BM  # zero-writing tiles over the capacity rows
    num_m = real_m_tiles + cap_m_tiles
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    n_tiles_128 = tl.cdiv(N, 128)  # rows of one expert's weight-scale grid
    offs_k = tl.arange(0, BK)

    for tile in tl.range(pid, num_m * num_n, NUM_PROGS):
        # GROUP_M m-tiles share each B n-tile while it sits in L2 (as _grouped_gemm_kernel).
        in_group = GROUP_M * num_n
        first_m = (tile // in_group) * GROUP_M
        group_size = tl.minimum(num_m - first_m, GROUP_M)
        tm = first_m + (tile % in_group) % group_size
        tn = (tile % in_group) // group_size

        is_real = tm < real_m_tiles
        e = tl.minimum(tl.sum((tile_cum <= tm).to(tl.int32)), E - 1)
        e_first_tile = _pick(idx, tile_cum - tiles, e)
        row_start = tl.where(
            is_real, _pick(idx, starts, e) + (tm - e_first_tile) * BM, total_rows + (tm - real_m_tiles) * BM
        )
        row_end = tl.where(is_real, _pick(idx, ends, e), M)
        k_iters = tl.where(is_real, k_tiles, 0)  # capacity tiles read nothing

        rows = row_start + tl.arange(0, BM)
        row_mask = rows < row_end
        rows64 = rows.to(tl.int64)  # M·K overflows int32 at 128k rows × 16k columns
        offs_n = tn * BN + tl.arange(0, BN)
        n_mask = offs_n < N
        e64 = e.to(tl.int64)
        # E·N·K passes 2^31 for real weights (mixtral FC1: 8 × 28672 × 4096 = 9.4e8; deepseek 32 ×
        # 4096 × 7168 = 9.4e8; 2^31 = 2.1e9 at a few more experts): int64 base per expert.
        a_ptrs = a_ptr + rows64[:, None] * K + offs_k[None, :]
        b_ptrs = b_ptr + e64 * N * K + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]  # (BK, BN)
        a_s_ptrs = a_scale_ptr + rows64 * stride_asm
        # one scale per column: BN may span several 128-row weight tiles (or part of one)
        b_s_ptrs = b_scale_ptr + (e64 * n_tiles_128 + offs_n // 128) * k_tiles

        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(0, k_iters):
            if USE_TMA:
                # The copy engine zero-fills past K and past the expert's N rows of B; rows of the
                # next expert that a tile's last rows read get scale 0 below and are never stored.
                a = a_desc.load([row_start, kk * BK])
                b = tl.trans(b_desc.load([e, tn * BN, kk * BK]).reshape(BN, BK))
            else:
                k_mask = offs_k < K - kk * BK
                a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                a_ptrs += BK
                b_ptrs += BK
            # Masked rows / columns get scale 0: their products are finite (codes 0) or never
            # stored (another expert's rows, which may hold NaN codes, only reach unstored rows).
            a_s = tl.load(a_s_ptrs + kk * stride_ask, mask=row_mask, other=0.0)
            b_s = tl.load(b_s_ptrs + kk, mask=n_mask, other=0.0)
            # The promotion: a fresh 128-deep tensor-core chain, scaled and added in fp32.
            acc += tl.dot(a, b, out_dtype=tl.float32) * (a_s[:, None] * b_s[None, :])

        if HAS_BIAS:
            bias = tl.load(bias_ptr + e64 * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            acc += bias[None, :]  # capacity tiles: e is clamped to a real expert, zeroed below
        acc = tl.where(is_real, acc, 0.0)
        out_mask = row_mask[:, None] & n_mask[None, :]
        # Every output row is stored by exactly one program: real tiles stop at their expert's end,
        # capacity tiles cover [Σsplits, M).
        out_ptrs = out_ptr + rows64[:, None] * N + offs_n[None, :]
        tl.store(out_ptrs, _rounded(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=out_mask)


# --------------------------------------------------------------------------------------------
# Launchers


@dataclass(frozen=True)
class Fp8GemmConfig:
    BM: int
    BN: int
    num_warps: int
    num_stages: int
    GROUP_M: int = 8
    USE_TMA: bool | None = None  # None: TMA when the codes allow it (16-byte aligned rows: K % 16 == 0)


def default_fp8_config() -> Fp8GemmConfig:
    """Unmeasured H200 guess (benchmarks/NOTES.md, "fp8_block GEMM"): a 128×128 tile at BK = 128 is
    32 KiB of e4m3 operands per stage (4 stages: 128 KiB of the 227 KiB); the fp32 accumulator plus
    the promoted partial are 2·64 registers per thread at 8 warps. Under the interpreter small tiles
    keep the CPU suite fast (16 is tl.dot's smallest side)."""
    if INTERPRET:
        return Fp8GemmConfig(16, 32, 4, 1, GROUP_M=4)
    return Fp8GemmConfig(128, 128, 8, 4)


def _parts(q, name: str) -> tuple[Tensor, Tensor]:
    """codes and scales of a QuantizedTensor-like object or a (codes, scales) pair."""
    if isinstance(q, (tuple, list)) and len(q) == 2:
        codes, scales = q
    elif hasattr(q, "codes") and hasattr(q, "scales"):
        codes, scales = q.codes, q.scales
    else:
        raise TypeError(f"{name}: expected a QuantizedTensor (or a (codes, scales) pair), got {type(q).__name__}")
    for t, what in ((codes, "codes"), (scales, "scales")):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}.{what}: expected a torch.Tensor, got {type(t).__name__}")
    if codes.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}.codes: expected torch.float8_e4m3fn, got {codes.dtype}")
    if scales.dtype != torch.float32:
        raise TypeError(f"{name}.scales: expected fp32 dequantization scales, got {scales.dtype}")
    if getattr(q, "rows", None) is not None:
        raise ValueError(f"{name}: a weight-gradient operand (padded row layout) is not a forward/dgrad operand")
    return codes, scales


def fp8_block_grouped_gemm(
    a,
    b,
    splits: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Tensor | None = None,
    config: Fp8GemmConfig | None = None,
) -> Tensor:
    """out (M, N) in ``out_dtype``: out[R_e] = dequant(A)[R_e] @ dequant(B[e])ᵀ (+ bias[e]); rows past
    Σsplits are 0.

    a: QuantizedTensor (or (codes, scales)) of an (M, K) operand, 1×128 blocks along K: codes
       float8_e4m3fn (M, K) contiguous, scales fp32 (M, ⌈K/128⌉), row-major or its transpose's view
       (``s.t().contiguous().t()``, DeepGEMM's layout: one coalesced load per K step).
    b: QuantizedTensor (or pair) of (E, N, K) weights in 128×128 tiles: codes (E, N, K) contiguous,
       scales fp32 (E, ⌈N/128⌉, ⌈K/128⌉) contiguous.
    splits: (E,) int32/int64 on the operands' device; never read on the host (bad values are clamped
       in the kernel: see _grouped_gemm).
    bias: (E, N) or None, any float dtype, added in fp32.
    """
    a_codes, a_scales = _parts(a, "a")
    b_codes, b_scales = _parts(b, "b")
    if a_codes.ndim != 2:
        raise ValueError(f"a.codes: expected (M, K), got shape {tuple(a_codes.shape)}")
    if b_codes.ndim != 3:
        raise ValueError(f"b.codes: expected (E, N, K), got shape {tuple(b_codes.shape)}")
    M, K = a_codes.shape
    E, N, Kb = b_codes.shape
    if Kb != K:
        raise ValueError(f"b.codes: expected K = {K} (a's columns) in (E, N, K), got shape {tuple(b_codes.shape)}")
    kb, nb = triton.cdiv(K, BLOCK), triton.cdiv(N, BLOCK)
    if tuple(a_scales.shape) != (M, kb):
        raise ValueError(f"a.scales: expected (M, ceil(K/128)) = {(M, kb)} (1x128 blocks), got {tuple(a_scales.shape)}")
    if tuple(b_scales.shape) != (E, nb, kb):
        raise ValueError(
            f"b.scales: expected (E, ceil(N/128), ceil(K/128)) = {(E, nb, kb)} (128x128 tiles), "
            f"got {tuple(b_scales.shape)}"
        )
    # the kernel indexes codes with the shapes' own strides; copying a view here would hide a pass
    for t, what in ((a_codes, "a.codes"), (b_codes, "b.codes"), (b_scales, "b.scales")):
        if not t.is_contiguous():
            raise ValueError(f"{what}: expected a contiguous tensor")
    if not isinstance(splits, Tensor) or splits.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"splits: expected an int32/int64 tensor, got {getattr(splits, 'dtype', type(splits))}")
    if tuple(splits.shape) != (E,):
        raise ValueError(f"splits: expected shape ({E},) (b's experts), got {tuple(splits.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"out_dtype: expected bf16, fp16 or fp32, got {out_dtype}")
    if bias is not None:
        if not isinstance(bias, Tensor) or not bias.is_floating_point():
            raise TypeError("bias: expected a floating-point tensor or None")
        if tuple(bias.shape) != (E, N):
            raise ValueError(f"bias: expected shape {(E, N)}, got {tuple(bias.shape)}")
        if not bias.is_contiguous():
            raise ValueError("bias: expected a contiguous tensor")
    device = a_codes.device
    for t, what in ((a_scales, "a.scales"), (b_codes, "b.codes"), (b_scales, "b.scales"), (splits, "splits")) + (
        ((bias, "bias"),) if bias is not None else ()
    ):
        if t.device != device:
            raise TypeError(f"{what}: expected a tensor on {device} (a.codes'), got {t.device}")

    out = torch.empty((M, N), dtype=out_dtype, device=device)
    if M == 0 or N == 0:
        return out
    if E == 0:
        return out.zero_()  # no expert: every row is capacity
    config = config or default_fp8_config()
    bound = (triton.cdiv(M, config.BM) + E + 1) * triton.cdiv(N, config.BN)
    num_progs = _num_programs(device, bound)
    use_tma = _tma_ok(a_codes, b_codes) if config.USE_TMA is None else config.USE_TMA
    if use_tma and not _tma_ok(a_codes, b_codes):
        raise ValueError("config: USE_TMA needs 16-byte aligned code rows (K % 16 == 0)")
    a_desc = TensorDescriptor.from_tensor(a_codes, [config.BM, BLOCK]) if use_tma else None
    b_desc = TensorDescriptor.from_tensor(b_codes, [1, config.BN, BLOCK]) if use_tma else None
    _fp8_block_grouped_gemm_kernel[(num_progs,)](
        a_codes, a_scales, b_codes, b_scales, a_desc, b_desc, splits,
        bias if bias is not None else a_scales,  # never dereferenced without HAS_BIAS
        out,
        M, N, K, E,
        a_scales.stride(0), a_scales.stride(1),
        num_progs,
        HAS_BIAS=bias is not None,
        BM=config.BM,
        BN=config.BN,
        BK=BLOCK,
        GROUP_M=config.GROUP_M,
        E_BLOCK=_e_block(E),
        INTERPRETED=INTERPRET,
        USE_TMA=use_tma,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    return out


def fp8_block_grouped_linear(
    x: Tensor,
    w: Tensor,
    splits: Tensor,
    recipe=None,
    bias: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: Fp8GemmConfig | None = None,
) -> Tensor:
    """out[R_e] = x[R_e] @ w[e]ᵀ (+ bias[e]) under fp8_block: x quantized 1×128 along K, w in 128×128
    tiles, both with the Triton quantizers (bit-exact with moemlp.recipes), then the fp8 GEMM.

    x (M, K) bf16/fp16/fp32 contiguous, w (E, N, K) contiguous, splits (E,) on x's device;
    ``recipe`` an FP8BlockRecipe (default: ``recipe("fp8_block")``); output in x.dtype by default.
    """
    from ..recipes import FP8BlockRecipe
    from ..recipes import recipe as make_recipe
    from . import quantize as kq

    r = make_recipe("fp8_block") if recipe is None else recipe
    if not isinstance(r, FP8BlockRecipe):
        raise TypeError(f"recipe: expected an fp8_block recipe, got {type(r).__name__}")
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"x, w: expected (M, K) and (E, N, K), got {tuple(x.shape)} and {tuple(w.shape)}")
    qx = kq.quantize(x, r, axis=-1)
    qw = kq.quantize_weight(w, r)
    return fp8_block_grouped_gemm(qx, qw, splits, out_dtype or x.dtype, bias=bias, config=config)
