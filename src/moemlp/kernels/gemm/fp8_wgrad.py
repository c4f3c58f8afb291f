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

import triton
import triton.language as tl

from .common import expert_table, pick, rounded


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
