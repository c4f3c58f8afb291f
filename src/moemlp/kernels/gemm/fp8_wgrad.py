"""The native fp8_block weight-gradient grouped GEMM (SPEC §3): e4m3 operands on Hopper's FP8 tensor
cores, block scales applied by promoting each 128-deep partial sum into an fp32 accumulator
(DeepGEMM's scheme, as the FP8 mode of grouped.py).

    dW[e] = G[R_e]ᵀ @ X[R_e]            for every expert e, R_e its rows; (E, N, K)

    G: (T, N) gradient rows, X: (T, K) activation rows, both grouped by expert and quantized along
       the rows (the reduction dim) in 1×128 blocks that restart at each expert's first row by
       ``quantize_wgrad(t, splits, recipe, is_grad, transposed=True)``, the expert-aligned padded
       layout of recipes.ExpertRows: P = (⌈T/128⌉ + E)·128 padded rows, expert e's rows from
       padded_start[e] = Σ_{e'<e} ⌈s_e'/128⌉·128, padding rows code 0; scales fp32 (P/128, ·),
       the dequantization scale of each 128-row block and column.

Every 128-row block b of the padded layout belongs to one expert (or none), so the sum over an
expert's rows is a sum over whole blocks, one K step each, with no mask along the reduction:

    dW[e] = Σ_{b of e} (G_codes[b]ᵀ @ X_codes[b]) · (g_scale[b, :, None] · x_scale[b, None, :])

Per step the 128-deep e4m3 × e4m3 product starts from zero on the tensor cores (fp32 out; the
products of two e4m3 codes are exact, the 128-deep sum is Hopper's limited-precision accumulation,
~14 bits per DeepSeek-V3 §3.3.2), then is scaled and added into the fp32 accumulator on the CUDA
cores: the promotion, ordinary fp32 round-to-nearest arithmetic. With ``pow2_scales`` (the recipe's
default) the scale product is exact. A padding row's codes are 0 in both operands, so it adds 0.

Operand layout. Hopper's FP8 wgmma takes both operands K-major in shared memory (the reduction dim
contiguous): the launcher takes Gᵀ (N, P) and Xᵀ (K, P), the quantizer's transposed store
(``codes_t``), written from the tile it holds: a torch transpose would be one more pass of
2·(N + K)·P bytes (~3 ms for mixtral's dW1 at 16k rows). The scales stay (P/128, ·), row-major: one
coalesced (BN,) and one (BK,) vector per step.

Tile schedule. One program per (expert, BN × BK output tile), expert-major, with GROUP_N n-tiles
sharing each Xᵀ k-tile while it sits in L2 (as wgrad.py). Not persistent: an expert's K loop is its
own block count (1-4 steps for a small expert, ~T/(128·E) for an average one, 0 for an empty one,
which stores zeros), so tiles differ in cost by orders of magnitude; a static round-robin over a
persistent grid would leave SMs idle behind the longest expert, while a plain grid lets the hardware
block scheduler hand out the next tile to whichever SM finishes first. Within a tile the scale
vectors of step k+1 are loaded before step k's dot (the sm_90 PTX has the loads before the step's
wgmma). Both scales are per column of the output (g's per n, x's per k), so both vectors stay in
the accumulator's layout; with the 64×128 default mixtral's dW1 takes 5.93 ms against 6.15 ms for
the bf16 wgrad.

Expert offsets come from ``splits`` inside the kernel (common.expert_table, clamped: negative → 0
rows, a sum past T truncated at T; no host read, CUDA-graph capturable); with clamped splits the
blocks used never pass P/128 = ⌈T/128⌉ + E, so bad splits cannot make it read out of bounds.
Operand tiles come through TMA descriptors (the transposed codes' rows are P bytes, a multiple of
128, so always 16-byte aligned; the copy engine zero-fills past N and K) or, with
``USE_TMA=False``, through masked pointer loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INTERPRET, TensorDescriptor, e_block, expert_table, pick, rounded, tma_ok

BLOCK = 128  # fp8_block's row block of both wgrad operands: one K step of the reduction


@triton.jit
def fp8_wgrad_kernel(
    gt_ptr,  # (N, P) e4m3 codes of Gᵀ, contiguous: padded rows (the reduction) contiguous, K-major
    g_scale_ptr,  # (P/128, N) fp32 dequantization scale of row block b, column n at b·stride_gsb + n·stride_gsn
    xt_ptr,  # (K, P) e4m3 codes of Xᵀ, contiguous
    x_scale_ptr,  # (P/128, K) fp32 at b·stride_xsb + k·stride_xsk
    gt_desc,  # TMA descriptor of Gᵀ, block [BN, 128] (USE_TMA), else None
    xt_desc,  # TMA descriptor of Xᵀ, block [BK, 128] (USE_TMA), else None
    splits_ptr,  # (E,) int32/int64 rows per expert, on the device
    out_ptr,  # (E, N, K) bf16 / fp16 / fp32
    T,  # source rows: the splits are clamped to them
    P,  # padded rows, (⌈T/128⌉ + E)·128
    N,
    K,
    E,
    stride_gsb,
    stride_gsn,
    stride_xsb,
    stride_xsk,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BR: tl.constexpr,  # = 128 rows, one scale block: one K step of the reduction
    GROUP_N: tl.constexpr,
    E_BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    tl.static_assert(BR == 128, "a reduction step must be exactly one 128-row scale block")
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    num_k = tl.cdiv(K, BK)
    per_expert = num_n * num_k
    e = pid // per_expert
    t = pid % per_expert
    # GROUP_N n-tiles share each Xᵀ k-tile while it sits in L2.
    in_group = GROUP_N * num_k
    first_n = (t // in_group) * GROUP_N
    group_size = tl.minimum(num_n - first_n, GROUP_N)
    tn = first_n + (t % in_group) % group_size
    tk = (t % in_group) // group_size

    # Row blocks per expert = ⌈clamped split / 128⌉; expert e's first block is the exclusive cumsum,
    # which is padded_start[e] / 128 of the quantizer's layout for valid splits.
    idx, starts, ends, blocks, block_cum = expert_table(splits_ptr, E, T, E_BLOCK, BR)
    n_blocks = pick(idx, blocks, e)
    first_block = pick(idx, block_cum - blocks, e)

    offs_n = tn * BN + tl.arange(0, BN)
    offs_k = tk * BK + tl.arange(0, BK)
    n_mask = offs_n < N
    k_mask = offs_k < K
    r0 = first_block.to(tl.int64) * BR  # int64: N·P passes 2^31 at 28672 columns × 75k padded rows
    if not USE_TMA:
        offs_r = tl.arange(0, BR)
        g_ptrs = gt_ptr + offs_n.to(tl.int64)[:, None] * P + (r0 + offs_r)[None, :]  # (BN, BR)
        x_ptrs = xt_ptr + offs_k.to(tl.int64)[None, :] * P + (r0 + offs_r)[:, None]  # (BR, BK)
    # Columns past N / K get scale 0 (their codes are 0 too: zero-filled or masked) and are not stored.
    gs_ptrs = g_scale_ptr + first_block.to(tl.int64) * stride_gsb + offs_n * stride_gsn
    xs_ptrs = x_scale_ptr + first_block.to(tl.int64) * stride_xsb + offs_k * stride_xsk
    # (masks as comparisons against a scalar limit: the triton 3.9 interpreter rejects a vector mask
    # and-ed with a scalar bool)
    g_s = tl.load(gs_ptrs, mask=offs_n < tl.where(n_blocks > 0, N, 0), other=0.0)
    x_s = tl.load(xs_ptrs, mask=offs_k < tl.where(n_blocks > 0, K, 0), other=0.0)

    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for i in range(0, n_blocks):
        if USE_TMA:
            r = (first_block + i) * BR  # int32 is enough here: P < 2^31 rows
            g = gt_desc.load([tn * BN, r])
            x = tl.trans(xt_desc.load([tk * BK, r]))
        else:
            g = tl.load(g_ptrs, mask=n_mask[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            g_ptrs += BR
            x_ptrs += BR
        # Step i+1's scales, issued before step i's dot so their latency hides behind the MMA.
        gs_ptrs += stride_gsb
        xs_ptrs += stride_xsb
        more = i + 1 < n_blocks
        g_s_next = tl.load(gs_ptrs, mask=offs_n < tl.where(more, N, 0), other=0.0)
        x_s_next = tl.load(xs_ptrs, mask=offs_k < tl.where(more, K, 0), other=0.0)
        # The promotion: a fresh 128-deep tensor-core chain, scaled and added in fp32.
        acc += tl.dot(g, x, out_dtype=tl.float32) * (g_s[:, None] * x_s[None, :])
        g_s = g_s_next
        x_s = x_s_next

    # Every output element is stored by exactly one program; an expert with no rows stores zeros.
    out_ptrs = out_ptr + e.to(tl.int64) * N * K + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    tl.store(out_ptrs, rounded(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=n_mask[:, None] & k_mask[None, :])


# --------------------------------------------------------------------------------------------
# Launcher


@dataclass(frozen=True)
class Fp8WgradConfig:
    BN: int  # output rows (G's columns) per tile
    BK: int  # output columns (X's columns) per tile
    num_warps: int
    num_stages: int
    GROUP_N: int = 8
    USE_TMA: bool | None = None  # None: TMA when the transposed codes allow it (16-byte aligned rows)


def default_fp8_wgrad_config() -> Fp8WgradConfig:
    """64×128 at 4 warps and 4 stages: the fastest of eight configs (benchmarks/bench_wgrad_quantizer.py
    --gemm; dW1 / dW2 of mixtral-8x7b 5.93 / 3.11 ms and of
    deepseek-v3-ep8 3.25 / 1.64 ms, 5-9 % faster than the earlier 128×128 at 8 warps, which was
    an unmeasured guess; moemlp's bf16 wgrad kernel took 6.15 / 3.09 and 3.49 / 1.71 ms). Each step ends in
    ``wgmma.wait_group 0`` (the promotion consumes the product at once), so no MMA overlaps the
    promotion within a CTA; at 64×128 (168 registers, 96 KiB of shared memory, offline sm_90) two
    CTAs fit per SM and one's promotion can overlap the other's MMA. 6 stages lost 30 % (one CTA per
    SM); 128×128 at 4 warps and 128×256 at 8 spill. Under the interpreter small tiles keep the CPU
    suite fast (16 is tl.dot's smallest side)."""
    if INTERPRET:
        return Fp8WgradConfig(16, 32, 4, 1, GROUP_N=2)
    return Fp8WgradConfig(64, 128, 4, 4)


def fp8_grouped_wgrad(
    *,
    g_t: Tensor,  # (N, P) e4m3 codes of Gᵀ (or their uint8 bits), contiguous
    g_scales: Tensor,  # (P/128, N) fp32
    x_t: Tensor,  # (K, P) e4m3 codes of Xᵀ
    x_scales: Tensor,  # (P/128, K) fp32
    splits: Tensor,  # (E,) int32/int64 on the device, the splits the operands were quantized with
    T: int,  # source rows of both operands
    out_dtype: torch.dtype = torch.float32,
    config: Fp8WgradConfig | None = None,
) -> Tensor:
    """dW (E, N, K) in ``out_dtype``: dW[e] = dequant(G)[R_e]ᵀ @ dequant(X)[R_e], zeros for an expert
    with no rows, from the transposed codes Gᵀ (N, P) and Xᵀ (K, P) (float8_e4m3fn or their uint8
    bits) with their fp32 scales (P/128, N) and (P/128, K), P = (⌈T/128⌉ + E)·128, T the source
    rows: ``quantize_wgrad(t, splits, recipe, transposed=True)``'s codes_t and scales."""
    for t, what in ((g_t, "g_t"), (x_t, "x_t"), (g_scales, "g_scales"), (x_scales, "x_scales")):
        if not isinstance(t, Tensor) or t.ndim != 2 or not t.is_contiguous():
            raise ValueError(f"{what}: expected a contiguous 2-D tensor")
    for t, what in ((g_t, "g_t"), (x_t, "x_t")):
        if t.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise TypeError(f"{what}: expected float8_e4m3fn codes (or their uint8 bits), got {t.dtype}")
    N, P = g_t.shape
    K = x_t.shape[0]
    if x_t.shape[1] != P or P % BLOCK:
        raise ValueError(f"x_t: expected (K, {P}) with P a multiple of 128, got {tuple(x_t.shape)}")
    for t, C, what in ((g_scales, N, "g_scales"), (x_scales, K, "x_scales")):
        if tuple(t.shape) != (P // BLOCK, C) or t.dtype != torch.float32:
            raise ValueError(f"{what}: expected ({P // BLOCK}, {C}) float32, got {tuple(t.shape)} {t.dtype}")
    if not isinstance(splits, Tensor) or splits.dtype not in (torch.int32, torch.int64) or splits.ndim != 1:
        raise TypeError("splits: expected an (E,) int32/int64 tensor")
    if P != (triton.cdiv(T, BLOCK) + splits.shape[0]) * BLOCK:
        raise ValueError(f"T: expected the rows with P = (ceil(T/128) + E)·128 = {P}, got T = {T}")
    return _launch(g_t.view(torch.float8_e4m3fn), g_scales, x_t.view(torch.float8_e4m3fn), x_scales, splits, T,
                   out_dtype, config)  # fmt: skip


def _launch(g_t, g_scales, x_t, x_scales, splits, T, out_dtype, config) -> Tensor:
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"out_dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    device = g_t.device
    for t, what in ((g_scales, "g scales"), (x_t, "x codes"), (x_scales, "x scales"), (splits, "splits")):
        if t.device != device:
            raise TypeError(f"{what}: expected a tensor on {device} (g's codes'), got {t.device}")
    config = config or default_fp8_wgrad_config()
    (N, P), K, E = g_t.shape, x_t.shape[0], splits.shape[0]
    out = torch.empty((E, N, K), dtype=out_dtype, device=device)
    if out.numel() == 0:
        return out
    use_tma = tma_ok(g_t, x_t) if config.USE_TMA is None else config.USE_TMA
    if use_tma and not tma_ok(g_t, x_t):
        raise ValueError("config: USE_TMA needs triton's TensorDescriptor and 16-byte aligned code rows")
    g_desc = TensorDescriptor.from_tensor(g_t, [config.BN, BLOCK]) if use_tma else None
    x_desc = TensorDescriptor.from_tensor(x_t, [config.BK, BLOCK]) if use_tma else None
    grid = (E * triton.cdiv(N, config.BN) * triton.cdiv(K, config.BK),)
    fp8_wgrad_kernel[grid](
        g_t, g_scales, x_t, x_scales, g_desc, x_desc, splits, out,
        T, P, N, K, E,
        g_scales.stride(0), g_scales.stride(1), x_scales.stride(0), x_scales.stride(1),
        BN=config.BN,
        BK=config.BK,
        BR=BLOCK,
        GROUP_N=config.GROUP_N,
        E_BLOCK=e_block(E),
        INTERPRETED=INTERPRET,
        USE_TMA=use_tma,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    return out
