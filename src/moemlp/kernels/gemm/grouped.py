"""The grouped GEMM of the MLP's forward and dgrad launches: out[R_e, n] = A[R_e, :] @ B[e] (row-
grouped A, per-expert B), one persistent launch over every expert's m-tiles, with a constexpr
``EPILOGUE`` (epilogue.py): FC1, FC2, FC2_DGRAD, FC1_DGRAD. The mainloop runs on the compute dtype
(bf16 tensor cores; exact emulation of mxfp8 / nvfp4 on their bf16 values, nvfp4's per-tensor
factors through ACC_SCALE) or on fp8_block's e4m3 codes (FP8: each 128-deep step promoted into the
fp32 accumulator with its block scales).

Tile scheduler: grids come from static bounds (the tile count of M rows spread over E experts is at
most cdiv(M, BM) + E + 1); the persistent loop runs over the real tile count read on the device.
Rows past Σsplits (capacity) are covered by "capacity tiles" that write zeros, so every output row
is written by exactly one program. No atomics: every sum has a fixed order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import expert_table, pick
from .epilogue import FC1, epilogue_chunks


@triton.jit
def grouped_gemm_kernel(
    a_ptr,  # (M, K) compute dtype, rows grouped by expert: x | z | dy | g_h
    b_ptr,  # (E, ·, ·) compute dtype weights; (n, k) of expert e at e·stride_be + n·stride_bn + k·stride_bk
    a_desc,  # TMA descriptor of a, block [BM, BK] (USE_TMA), else None
    b_desc,  # TMA descriptor of the (E, ·, ·) weights, block [1, BN, BK] (B_KMAJOR) or [1, BK, BN]
    splits_ptr,  # (E,) int32/int64 rows per expert, on the device
    probs_ptr,  # (M,) fp32/bf16/fp16 router probabilities, upcast exactly (HAS_PROBS)
    bias_ptr,  # (E, N1) fc1_bias (FC1) or (E, H) fc2_bias (FC2), compute dtype (HAS_BIAS)
    out_ptr,  # compute dtype: h (M, N1) | y (M, H) | g_h (M, N1) | dx (M, H)
    z_ptr,  # (M, F) compute dtype: round(act(h)·p), FC2's input and dW2's operand (STORE_Z)
    h_ptr,  # (M, N1) compute dtype: the stored pre-activation, read by FC2_DGRAD
    partial_ptr,  # (cdiv(F, BN), M) fp32: dprobs partials Σ_{f in tile} g_z·a (STORE_PARTIAL)
    a_scale_ptr,  # FP8: (M, ⌈K/128⌉) fp32 dequant scale of row m, K block kb at m·stride_asm + kb·stride_ask
    b_scale_ptr,  # FP8: (E, ⌈·/128⌉, ⌈·/128⌉) fp32 dequant scale of B's tile (n//128, k//128) of expert e
    acc_scale_ptr,  # ACC_SCALE: fp32 scalar multiplied onto the accumulator (nvfp4's per-tensor factors)
    M,
    N,
    K,
    E,  # N: output columns of this GEMM (F for FC1/FC2_DGRAD, H for FC2/FC1_DGRAD)
    stride_be,
    stride_bn,
    stride_bk,
    stride_asm,
    stride_ask,
    stride_bse,
    stride_bsn,
    stride_bsk,
    N1,
    G,  # h columns; GLU block width: gate block j at columns 2jG.., up block at 2jG+G..
    p0,
    p1,
    p2,  # activation parameters (fp32)
    unit,  # 1.0 (fp32), see _accumulate
    NUM_PROGS,
    EPILOGUE: tl.constexpr,
    ACT: tl.constexpr,
    GLU: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_BIAS: tl.constexpr,
    STORE_Z: tl.constexpr,
    STORE_PARTIAL: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    B_KMAJOR: tl.constexpr,
    SUBTILE: tl.constexpr,
    PROMOTE: tl.constexpr,
    FP8: tl.constexpr,  # e4m3 codes of A and B with block scales (fp8_block): promoted 128-deep steps
    ACC_SCALE: tl.constexpr,
    B_SCALE_SCALAR: tl.constexpr,  # FP8: every column of a tile has the same B scale
    PAIRED: tl.constexpr,  # FC1 with G == 1 (gate and up alternate column by column): see below
):
    TWO_ACC: tl.constexpr = GLU and EPILOGUE == FC1  # gate and up columns of one F block
    # PAIRED: one (BM, 2·BN) accumulator over the 2·BN consecutive W1 rows of the tile's BN gate/up
    # pairs, one contiguous B load per K step (TMA-able in either weight layout), split into gate
    # and up after the K loop; rather than two loads of every other W1 row, which the copy engine
    # cannot express and which read every other element along a weight stored (E, H, N1).
    tl.static_assert(not PAIRED or (TWO_ACC and not FP8), "PAIRED: FC1 with a GLU, not FP8")
    pid = tl.program_id(0)
    idx, starts, ends, tiles, tile_cum = expert_table(splits_ptr, E, M, E_BLOCK, BM)
    total_rows = tl.max(ends)
    real_m_tiles = tl.sum(tiles)
    cap_m_tiles = (M - total_rows + BM - 1) // BM  # zero-writing tiles over the capacity rows
    num_m = real_m_tiles + cap_m_tiles
    num_n = tl.cdiv(N, BN)
    offs_k = tl.arange(0, BK)
    k_tiles = tl.cdiv(K, BK)

    for tile in tl.range(pid, num_m * num_n, NUM_PROGS):
        # GROUP_M m-tiles share each B n-tile while it sits in L2.
        in_group = GROUP_M * num_n
        first_m = (tile // in_group) * GROUP_M
        group_size = tl.minimum(num_m - first_m, GROUP_M)
        tm = first_m + (tile % in_group) % group_size
        tn = (tile % in_group) // group_size

        is_real = tm < real_m_tiles
        e = tl.minimum(tl.sum((tile_cum <= tm).to(tl.int32)), E - 1)
        e_first_tile = pick(idx, tile_cum - tiles, e)
        row_start = tl.where(
            is_real, pick(idx, starts, e) + (tm - e_first_tile) * BM, total_rows + (tm - real_m_tiles) * BM
        )
        row_end = tl.where(is_real, pick(idx, ends, e), M)
        k_iters = tl.where(is_real, k_tiles, 0)  # capacity tiles read nothing

        rows = row_start + tl.arange(0, BM)
        row_mask = rows < row_end

        if PAIRED:
            acc2 = tl.zeros((BM, 2 * BN), dtype=tl.float32)  # columns: gate f0, up f0, gate f0 + 1, ...
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        if TWO_ACC and not PAIRED:
            acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        if FP8:
            tl.static_assert(BK == 128, "FP8: a K step is exactly one 128-deep scale block")
            tl.static_assert(B_KMAJOR, "FP8: Hopper's e4m3 wgmma reads both operands K-major")
            # One scale per row of A and per column of B (BN may span several 128-row weight tiles or
            # part of one); masked rows and columns get scale 0: their products are never stored.
            a_s_ptrs = a_scale_ptr + rows.to(tl.int64) * stride_asm
            if B_SCALE_SCALAR:
                # The tile's B rows lie in one 128-row weight tile (the host checked BN | 128, and
                # G % BN == 0 for a GLU): one scale per step, not a (BN,) vector in the accumulator's
                # column layout (BN/4 registers per thread, which spilled FC1's two accumulators).
                offs_ns = tn * BN
                ns_mask = offs_ns < N
            else:
                offs_ns = tn * BN + tl.arange(0, BN)
                ns_mask = offs_ns < N
            if TWO_ACC:
                n_w = (offs_ns // G) * (2 * G) + offs_ns % G  # gate row of f in W1; up row = + G
            else:
                n_w = offs_ns
            b_s_ptrs = b_scale_ptr + e.to(tl.int64) * stride_bse + (n_w // 128) * stride_bsn
            if TWO_ACC:
                b_su_ptrs = b_scale_ptr + e.to(tl.int64) * stride_bse + ((n_w + G) // 128) * stride_bsn
        if USE_TMA:
            # The copy engine zero-fills past K and past the weights' edges, so no masks: rows of
            # the next expert that a tile's last rows read are computed and never stored, and
            # columns past N likewise (the gate tile of the last F block may reach into up columns).
            n_b0 = tn * BN
            if PAIRED:
                n_b0 = 2 * tn * BN
            elif TWO_ACC:
                n_b0 = (n_b0 // G) * (2 * G) + n_b0 % G  # the host asks G == F or G % BN == 0
        else:
            rows64 = rows.to(tl.int64)  # M·K overflows int32 at 128k rows × 16k columns
            if PAIRED:
                n_b = 2 * tn * BN + tl.arange(0, 2 * BN)  # W1 rows of gate f, up f for the tile's f
                n_mask = n_b < N1
            else:
                offs_n = tn * BN + tl.arange(0, BN)
                n_mask = offs_n < N
                if TWO_ACC:
                    n_b = (offs_n // G) * (2 * G) + offs_n % G  # gate row of f in W1; up row = + G
                else:
                    n_b = offs_n
            b_base = b_ptr + e.to(tl.int64) * stride_be
            a_ptrs = a_ptr + rows64[:, None] * K + offs_k[None, :]
            b_ptrs = b_base + n_b[None, :] * stride_bn + offs_k[:, None] * stride_bk
        for kk in range(0, k_iters):
            if USE_TMA:
                a = a_desc.load([row_start, kk * BK])
                if PAIRED:
                    if B_KMAJOR:
                        b = tl.trans(b_desc.load([e, n_b0, kk * BK]).reshape(2 * BN, BK))
                    else:
                        b = b_desc.load([e, kk * BK, n_b0]).reshape(BK, 2 * BN)
                elif B_KMAJOR:
                    b = tl.trans(b_desc.load([e, n_b0, kk * BK]).reshape(BN, BK))
                else:
                    b = b_desc.load([e, kk * BK, n_b0]).reshape(BK, BN)
                if TWO_ACC and not PAIRED:
                    if B_KMAJOR:
                        b_up = tl.trans(b_desc.load([e, n_b0 + G, kk * BK]).reshape(BN, BK))
                    else:
                        b_up = b_desc.load([e, kk * BK, n_b0 + G]).reshape(BK, BN)
            else:
                k_mask = offs_k < K - kk * BK
                a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                if TWO_ACC and not PAIRED:
                    b_up = tl.load(b_ptrs + G * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                a_ptrs += BK
                b_ptrs += BK * stride_bk
            if INTERPRETED:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
                if TWO_ACC and not PAIRED:
                    b_up = b_up.to(tl.float32)
            if FP8:
                # Scales of this step, loaded in it: loading them one step ahead changed the four FC1
                # shapes by ±5%, noise (docs/DECISIONS.md, "fp8_block scales loaded one step ahead").
                a_s = tl.load(a_s_ptrs + kk * stride_ask, mask=row_mask, other=0.0)
                acc += _fp8_product(a, b, a_s, _b_scale(b_s_ptrs + kk * stride_bsk, ns_mask, B_SCALE_SCALAR),
                                    B_SCALE_SCALAR)  # fmt: skip
                if TWO_ACC:
                    b_su = _b_scale(b_su_ptrs + kk * stride_bsk, ns_mask, B_SCALE_SCALAR)
                    acc_up += _fp8_product(a, b_up, a_s, b_su, B_SCALE_SCALAR)
            elif PAIRED:
                acc2 = tl.dot(a, b, acc2, input_precision=DOT_PRECISION)
            else:
                acc = _accumulate(a, b, acc, unit, PROMOTE, DOT_PRECISION)
                if TWO_ACC:
                    acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)

        if PAIRED:
            # Even columns are the gates, odd the ups; each thread of the MMA layout holds
            # adjacent column pairs, so the split moves no data between threads.
            acc, acc_up = acc2.reshape(BM, BN, 2).split()

        if ACC_SCALE:
            f = tl.load(acc_scale_ptr)
            acc = acc * f
            if TWO_ACC:
                acc_up = acc_up * f
        if HAS_PROBS:
            p = tl.load(probs_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        else:
            p = tl.zeros((BM,), dtype=tl.float32)  # unused
        if not TWO_ACC:
            acc_up = acc  # unused
        # The epilogue runs on column chunks of BN / SUBTILE: act, act' and their operands are
        # five (BM, BN) fp32 tensors at once, which at 128×128 and 8 warps is 320 registers per
        # thread; ptxas spilled them (612 local loads in FC2_DGRAD) before the split.
        part = epilogue_chunks(
            acc, acc_up, tn * BN, (row_mask, row_start, is_real, e, p), (bias_ptr, out_ptr, z_ptr, h_ptr), (N, N1, G),
            (p0, p1, p2), BM, BN, SUBTILE, EPILOGUE, ACT, GLU, HAS_PROBS, HAS_BIAS, SCALE_BIAS, STORE_Z, INTERPRETED,
        )  # fmt: skip
        if STORE_PARTIAL:
            # Σ_f g_z·a over this F tile, chunks added in column order: a fixed order.
            part = tl.where(is_real, part, 0.0)
            tl.store(partial_ptr + tn.to(tl.int64) * M + rows, part, mask=row_mask)


@triton.jit
def _accumulate(a, b, acc, unit, PROMOTE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a @ b. With PROMOTE, each BK-deep product starts from a zero accumulator and is added
    to acc in fp32 (round to nearest), as DeepGEMM promotes fp8 partial sums.

    Hopper's tensor cores keep bf16 products exact but add into the fp32 accumulator with
    truncation, so the error of a K-deep chain grows linearly with K: one chained accumulator gave
    fp32 dprobs errors of 2.1e-6 (K = H = 2048) to 7.9e-6 (K = 7168) against float64, on course to
    pass SPEC §1's 1e-5 near K = 9000; promoted every BK = 64 they were 1.6e-7..2.8e-7, every BK =
    128 (FC2_DGRAD's step) 1.7e-7..2.7e-7 (bound BK·2^-23 for any data; docs/DECISIONS.md,
    "FC2_DGRAD promotes each 64-deep product", "… products 128 deep"). The multiply by ``unit`` (a
    runtime 1.0) keeps the compiler from folding the add back into the dot's accumulator."""
    if PROMOTE:
        acc += tl.dot(a, b, input_precision=DOT_PRECISION) * unit
    else:
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _b_scale(ptrs, n_mask, B_SCALE_SCALAR: tl.constexpr):
    """B's dequantization scale of one K step: one for the tile, or one per column (0 past N)."""
    if B_SCALE_SCALAR:
        b_s = tl.load(ptrs)
    else:
        b_s = tl.load(ptrs, mask=n_mask, other=0.0)
    return b_s


@triton.jit
def _fp8_product(a, b, a_s, b_s, B_SCALE_SCALAR: tl.constexpr):
    """The promotion (SPEC §3, fp8_block): a fresh 128-deep e4m3 × e4m3 tensor-core chain, scaled and
    returned in fp32 for an ordinary fp32 add into the accumulator. Products of two e4m3 codes are
    exact; on Hopper the chain itself keeps ~14 bits (DeepSeek-V3 §3.3.2), which is why it is cut
    every 128."""
    if B_SCALE_SCALAR:
        scale = (a_s * b_s)[:, None]
    else:
        scale = a_s[:, None] * b_s[None, :]
    return tl.dot(a, b, out_dtype=tl.float32) * scale
