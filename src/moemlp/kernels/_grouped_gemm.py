"""The grouped-GEMM kernel family of the Triton backend, and the launchers that size its grids.

Two GEMM shapes cover the six GEMMs of SPEC §1:

* ``_grouped_gemm_kernel``: out[R_e, n] = A[R_e, :] @ B[e] (row-grouped A, per-expert B), one
  persistent launch over every expert's m-tiles, with a constexpr ``EPILOGUE``:
  FC1 (x @ W1ᵀ → h, z = round(act(h)·p)), FC2 (z @ W2ᵀ → y), FC2_DGRAD (dy @ W2 → g_z, kept in
  fp32; dprobs partials, g_h = round(g_z·p·act'(h)), round(z) for dW2), FC1_DGRAD (g_h @ W1 → dx).
* ``_grouped_wgrad_kernel``: dW[e] = G[R_e]ᵀ @ X[R_e] with K = that expert's row count, and the
  bias gradient Σ_rows G as a second loop of the same program.

plus ``_dprobs_reduce_kernel``, which sums the dprobs partials in a fixed order.

Expert offsets are computed inside every kernel from ``splits`` (never read on the host): splits are
clamped (negative → 0 rows, a sum past M truncated at M), so bad device splits cannot make a kernel
read or write out of bounds. Grids come from static bounds (the tile count of M rows spread over E
experts is at most cdiv(M, BM) + E + 1); the persistent loop runs over the real tile count read on
the device. Rows past Σsplits (capacity) are covered by "capacity tiles" that write zeros, so every
output row is written by exactly one program. No atomics: every sum has a fixed order.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton < 3.4 has no host-side descriptors
    TensorDescriptor = None

from ._activations import glu_backward, glu_forward, unary_backward, unary_forward
from .quantize import FLT_MAX, _per_block_spread, block_scale_values, code_values, fp8_block_columns, unpack_e2m1

# Under TRITON_INTERPRET=1, tl.dot on bf16 operands returns garbage (numpy has no bf16 matmul;
# triton 3.9, 2026-11-30: max error 2.7e10 on a 16×16 product), so dot operands are upcast to fp32
# there. The GPU path never takes this branch.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

FC1: tl.constexpr = tl.constexpr(0)
FC2: tl.constexpr = tl.constexpr(1)
FC2_DGRAD: tl.constexpr = tl.constexpr(2)
FC1_DGRAD: tl.constexpr = tl.constexpr(3)


@triton.jit
def _rounded(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 x rounded to nearest even in dtype, the one rounding of each stored output.

    The triton 3.9 interpreter truncates fp32 → bf16 (2026-11-30: 508 of 1024 random values off by
    one ulp against torch's RTNE), which would double the rounding error the CPU suite measures; under
    the interpreter the bf16 rounding is done on the bits instead. The GPU path converts directly."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        bits = tl.where(x != x, 0x7FC0, bits)  # NaN stays a (quiet) NaN
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _expert_table(splits_ptr, E, M, E_BLOCK: tl.constexpr, BM: tl.constexpr):
    """Per-expert row ranges [starts, ends) and m-tile counts, clamped so that bad splits stay in
    bounds: each split to [0, M], the running end to M."""
    idx = tl.arange(0, E_BLOCK)
    # int64: 1024 experts × splits of up to 2^31 rows would overflow an int32 running sum.
    s = tl.load(splits_ptr + idx, mask=idx < E, other=0).to(tl.int64)
    s = tl.minimum(tl.maximum(s, 0), M)
    cum = tl.cumsum(s, 0)
    ends = tl.minimum(cum, M).to(tl.int32)
    starts = tl.minimum(cum - s, M).to(tl.int32)
    tiles = (ends - starts + BM - 1) // BM
    tile_cum = tl.cumsum(tiles, 0)  # inclusive; past E it stays at the total
    return idx, starts, ends, tiles, tile_cum


@triton.jit
def _pick(idx, vec, e):
    """vec[e] as a scalar (vectors of the expert table live in registers)."""
    return tl.sum(tl.where(idx == e, vec, 0))


@triton.jit
def _grouped_gemm_kernel(
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
    a_scale_ptr,  # FP8: fp32 dequant scale of row m, K block kb at m·stride_asm + kb·stride_ask; A_DQ: uint8
    b_scale_ptr,  # FP8: fp32 dequant scale of B's 128×128 tile (n//128, k//128) of expert e (strides below);
    #               B_DQ: uint8 scale code of B(n, K block kb) of expert e, e·stride_bse + n·stride_bsn + kb·stride_bsk
    acc_scale_ptr,  # ACC_SCALE: fp32 scalar multiplied onto the accumulator (nvfp4's per-tensor factors)
    cq_g_ptr,  # QUANT_G: (N1, P_pad) e4m3 code bits of g_hᵀ in the weight-gradient layout (below)
    cq_gs_ptr,  # QUANT_G: (P_pad/128, N1) fp32 dequantization scale of each 128-row block and column
    cq_z_ptr,  # QUANT_Z: (F, P_pad) the same of z
    cq_zs_ptr,  # QUANT_Z: (P_pad/128, F)
    P_pad,  # QUANT_*: padded rows (⌈M/128⌉ + E)·128 of the weight-gradient layout
    M,
    N,
    K,
    E,  # N: output columns of this GEMM (F for FC1/FC2_DGRAD, H for FC2/FC1_DGRAD)
    stride_am,  # A_DQ: a's row stride in bytes (K, or ⌈K/2⌉ for packed nvfp4); else a is (M, K) contiguous
    stride_be,
    stride_bn,
    stride_bk,  # B_DQ nvfp4: the stride of a packed pair of K (B(n, k) in byte k // 2)
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
    QUANT_G: tl.constexpr,  # FC2_DGRAD, fp8_block: also store g_h quantized in 128-row blocks, transposed
    QUANT_Z: tl.constexpr,  # FC2_DGRAD, fp8_block: z quantized so instead of z itself (STORE_Z)
    POW2: tl.constexpr,  # QUANT_*: power-of-two scales (the recipe's pow2_scales)
    A_DQ: tl.constexpr,  # 0, or 1 mxfp8 / 2 nvfp4: a holds codes blocked along K, dequantized to bf16 as loaded
    B_DQ: tl.constexpr,  # the same for b (the weights' codes; scales per (n, K block))
):
    TWO_ACC: tl.constexpr = GLU and EPILOGUE == FC1  # gate and up columns of one F block
    pid = tl.program_id(0)
    idx, starts, ends, tiles, tile_cum = _expert_table(splits_ptr, E, M, E_BLOCK, BM)
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
        e_first_tile = _pick(idx, tile_cum - tiles, e)
        row_start = tl.where(
            is_real, _pick(idx, starts, e) + (tm - e_first_tile) * BM, total_rows + (tm - real_m_tiles) * BM
        )
        row_end = tl.where(is_real, _pick(idx, ends, e), M)
        k_iters = tl.where(is_real, k_tiles, 0)  # capacity tiles read nothing

        rows = row_start + tl.arange(0, BM)
        row_mask = rows < row_end

        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if TWO_ACC:
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
            if TWO_ACC:
                n_b0 = (n_b0 // G) * (2 * G) + n_b0 % G  # the host asks G == F or G % BN == 0
        else:
            rows64 = rows.to(tl.int64)  # M·K overflows int32 at 128k rows × 16k columns
            offs_n = tn * BN + tl.arange(0, BN)
            n_mask = offs_n < N
            if TWO_ACC:
                n_b = (offs_n // G) * (2 * G) + offs_n % G  # gate row of f in W1; up row = + G
            else:
                n_b = offs_n
            b_base = b_ptr + e.to(tl.int64) * stride_be
            a_ptrs = a_ptr + rows64[:, None] * K + offs_k[None, :]
            b_ptrs = b_base + n_b[None, :] * stride_bn + offs_k[:, None] * stride_bk
            # A_DQ / B_DQ: each step's block-scale codes (and nvfp4's packed codes, which are too
            # narrow for the pipeliner's asynchronous copies) are loaded one step ahead into
            # registers; mxfp8's codes are loaded in their step (asynchronous copies, pipelined).
            if A_DQ != 0:
                a_s = _dq_scales_a(a_scale_ptr, rows64, row_mask, 0, K, stride_asm, stride_ask, A_DQ, BK)
                if A_DQ == 2:
                    a_c = _dq_codes_a(a_ptr, rows64, row_mask, 0, K, stride_am, A_DQ, BK)
            if B_DQ != 0:
                b_s_base = b_scale_ptr + e.to(tl.int64) * stride_bse
                bu_base = b_base + G * stride_bn  # TWO_ACC: the up rows
                bu_s_base = b_s_base + G * stride_bsn
                b_s = _dq_scales_b(b_s_base, n_b, n_mask, 0, K, stride_bsn, stride_bsk, B_DQ, BK)
                if B_DQ == 2:
                    b_c = _dq_codes_b(b_base, n_b, n_mask, 0, K, stride_bn, stride_bk, B_DQ, BK)
                if TWO_ACC:
                    bu_s = _dq_scales_b(bu_s_base, n_b, n_mask, 0, K, stride_bsn, stride_bsk, B_DQ, BK)
                    if B_DQ == 2:
                        bu_c = _dq_codes_b(bu_base, n_b, n_mask, 0, K, stride_bn, stride_bk, B_DQ, BK)
        for kk in range(0, k_iters):
            if USE_TMA:
                a = a_desc.load([row_start, kk * BK])
                if B_KMAJOR:
                    b = tl.trans(b_desc.load([e, n_b0, kk * BK]).reshape(BN, BK))
                else:
                    b = b_desc.load([e, kk * BK, n_b0]).reshape(BK, BN)
                if TWO_ACC:
                    b_up = tl.trans(b_desc.load([e, n_b0 + G, kk * BK]).reshape(BN, BK))
            else:
                k_mask = offs_k < K - kk * BK
                k_next = (kk + 1) * BK
                if A_DQ != 0:
                    if A_DQ == 1:
                        a_c = _dq_codes_a(a_ptr, rows64, row_mask, kk * BK, K, stride_am, A_DQ, BK)
                    a = _dq_values_a(a_c, a_s, A_DQ, BM, BK)
                    a_s = _dq_scales_a(a_scale_ptr, rows64, row_mask, k_next, K, stride_asm, stride_ask, A_DQ, BK)
                    if A_DQ == 2:
                        a_c = _dq_codes_a(a_ptr, rows64, row_mask, k_next, K, stride_am, A_DQ, BK)
                else:
                    a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                if B_DQ != 0:
                    if B_DQ == 1:
                        b_c = _dq_codes_b(b_base, n_b, n_mask, kk * BK, K, stride_bn, stride_bk, B_DQ, BK)
                    b = _dq_values_b(b_c, b_s, B_DQ, BN, BK)
                    b_s = _dq_scales_b(b_s_base, n_b, n_mask, k_next, K, stride_bsn, stride_bsk, B_DQ, BK)
                    if B_DQ == 2:
                        b_c = _dq_codes_b(b_base, n_b, n_mask, k_next, K, stride_bn, stride_bk, B_DQ, BK)
                    if TWO_ACC:
                        if B_DQ == 1:
                            bu_c = _dq_codes_b(bu_base, n_b, n_mask, kk * BK, K, stride_bn, stride_bk, B_DQ, BK)
                        b_up = _dq_values_b(bu_c, bu_s, B_DQ, BN, BK)
                        bu_s = _dq_scales_b(bu_s_base, n_b, n_mask, k_next, K, stride_bsn, stride_bsk, B_DQ, BK)
                        if B_DQ == 2:
                            bu_c = _dq_codes_b(bu_base, n_b, n_mask, k_next, K, stride_bn, stride_bk, B_DQ, BK)
                else:
                    b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                    if TWO_ACC:
                        b_up = tl.load(b_ptrs + G * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                a_ptrs += BK
                b_ptrs += BK * stride_bk
            if INTERPRETED:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
                if TWO_ACC:
                    b_up = b_up.to(tl.float32)
            if FP8:
                # Scales of this step, loaded in it: one step ahead gained nothing on the H200
                # (±5% on the four FC1 shapes, 2026-11-30; benchmarks/NOTES.md).
                a_s = tl.load(a_s_ptrs + kk * stride_ask, mask=row_mask, other=0.0)
                acc += _fp8_product(a, b, a_s, _b_scale(b_s_ptrs + kk * stride_bsk, ns_mask, B_SCALE_SCALAR),
                                    B_SCALE_SCALAR)  # fmt: skip
                if TWO_ACC:
                    b_su = _b_scale(b_su_ptrs + kk * stride_bsk, ns_mask, B_SCALE_SCALAR)
                    acc_up += _fp8_product(a, b_up, a_s, b_su, B_SCALE_SCALAR)
            else:
                acc = _accumulate(a, b, acc, unit, PROMOTE, DOT_PRECISION)
                if TWO_ACC:
                    acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)

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
        part = _epilogue_chunks(
            acc,
            acc_up,
            tn * BN,
            rows,
            row_mask,
            row_start,
            is_real,
            e,
            p,
            bias_ptr,
            out_ptr,
            z_ptr,
            h_ptr,
            N,
            N1,
            G,
            p0,
            p1,
            p2,
            BM,
            BN,
            SUBTILE,
            EPILOGUE,
            ACT,
            GLU,
            HAS_PROBS,
            HAS_BIAS,
            SCALE_BIAS,
            STORE_Z,
            INTERPRETED,
            tm,
            cq_g_ptr,
            cq_gs_ptr,
            cq_z_ptr,
            cq_zs_ptr,
            P_pad,
            QUANT_G,
            QUANT_Z,
            POW2,
        )
        if STORE_PARTIAL:
            # Σ_f g_z·a over this F tile, chunks added in column order: a fixed order.
            part = tl.where(is_real, part, 0.0)
            tl.store(partial_ptr + tn.to(tl.int64) * M + rows, part, mask=row_mask)


# Load-path dequantization (A_DQ / B_DQ): codes blocked along K become bf16 code·block_scale, the
# values of quantize.dequantized's pass bit for bit (the fp32 product is exact, and so is its bf16
# rounding but for mxfp8's tiny-block caveat, _operands.py). Codes and scales past K or outside the
# row / column masks load as 0, so those values are 0. RECIPE: 1 mxfp8 (blocks of 32), 2 nvfp4 (16,
# codes packed in pairs along K).


@triton.jit
def _dq_scales_a(s_ptr, rows64, row_mask, k0, K, stride_asm, stride_ask, RECIPE: tl.constexpr, BK: tl.constexpr):
    """(BM, BK/B) block-scale codes of A's K step at k0."""
    B: tl.constexpr = 32 if RECIPE == 1 else 16
    tl.static_assert(BK % B == 0, "a K step holds whole scale blocks")
    kb = k0 // B + tl.arange(0, BK // B)
    return tl.load(s_ptr + rows64[:, None] * stride_asm + kb[None, :] * stride_ask,
                   mask=row_mask[:, None] & (kb * B < K)[None, :], other=0)  # fmt: skip


@triton.jit
def _dq_codes_a(a_ptr, rows64, row_mask, k0, K, stride_am, RECIPE: tl.constexpr, BK: tl.constexpr):
    """A's codes of the K step at k0: (BM, BK) bytes, nvfp4 (BM, BK/2) packed pairs."""
    if RECIPE == 2:
        k2 = k0 // 2 + tl.arange(0, BK // 2)
        return tl.load(a_ptr + rows64[:, None] * stride_am + k2[None, :],
                       mask=row_mask[:, None] & (2 * k2 < K)[None, :], other=0)  # fmt: skip
    else:
        k = k0 + tl.arange(0, BK)
        return tl.load(a_ptr + rows64[:, None] * stride_am + k[None, :], mask=row_mask[:, None] & (k < K)[None, :],
                       other=0)  # fmt: skip


@triton.jit
def _dq_values_a(c, s, RECIPE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """A's (BM, BK) bf16 values from _dq_codes_a's codes and _dq_scales_a's scales."""
    B: tl.constexpr = 32 if RECIPE == 1 else 16
    sv = block_scale_values(s, RECIPE)
    if RECIPE == 2:
        c = unpack_e2m1(c, 1)
        sv = sv * 16384.0  # code_values' nvfp4 values are 2^-14 of the codes' (exact)
    return (code_values(c, RECIPE) * _per_block_spread(sv, BM, BK // B, B)).to(tl.bfloat16)


@triton.jit
def _dq_scales_b(s_base, n_b, n_mask, k0, K, stride_bsn, stride_bsk, RECIPE: tl.constexpr, BK: tl.constexpr):
    """(BK/B, BN) block-scale codes of B's K step at k0: B(n, block kb) at s_base + n·stride_bsn + kb·stride_bsk."""
    B: tl.constexpr = 32 if RECIPE == 1 else 16
    tl.static_assert(BK % B == 0, "a K step holds whole scale blocks")
    kb = k0 // B + tl.arange(0, BK // B)
    return tl.load(s_base + kb[:, None] * stride_bsk + n_b[None, :] * stride_bsn,
                   mask=(kb * B < K)[:, None] & n_mask[None, :], other=0)  # fmt: skip


@triton.jit
def _dq_codes_b(b_base, n_b, n_mask, k0, K, stride_bn, stride_bk, RECIPE: tl.constexpr, BK: tl.constexpr):
    """B's codes of the K step at k0, B(k, n) at b_base + n·stride_bn + k·stride_bk: (BK, BN) bytes,
    nvfp4 (BK/2, BN) packed pairs (byte k // 2)."""
    if RECIPE == 2:
        k2 = k0 // 2 + tl.arange(0, BK // 2)
        return tl.load(b_base + k2[:, None] * stride_bk + n_b[None, :] * stride_bn,
                       mask=(2 * k2 < K)[:, None] & n_mask[None, :], other=0)  # fmt: skip
    else:
        k = k0 + tl.arange(0, BK)
        return tl.load(b_base + k[:, None] * stride_bk + n_b[None, :] * stride_bn,
                       mask=(k < K)[:, None] & n_mask[None, :], other=0)  # fmt: skip


@triton.jit
def _dq_values_b(c, s, RECIPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """B's (BK, BN) bf16 values from _dq_codes_b's codes and _dq_scales_b's scales."""
    B: tl.constexpr = 32 if RECIPE == 1 else 16
    sv = block_scale_values(s, RECIPE)
    if RECIPE == 2:
        c = unpack_e2m1(c, 0)
        sv = sv * 16384.0
    spread = tl.reshape(tl.broadcast_to(sv[:, None, :], (BK // B, B, BN)), (BK, BN))
    return (code_values(c, RECIPE) * spread).to(tl.bfloat16)


@triton.jit
def _accumulate(a, b, acc, unit, PROMOTE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a @ b. With PROMOTE, each BK-deep product starts from a zero accumulator and is added
    to acc in fp32 (round to nearest), as DeepGEMM promotes fp8 partial sums.

    Hopper's tensor cores keep bf16 products exact but add into the fp32 accumulator with
    truncation, so the error of a K-deep chain grows linearly with K: on the H200 (2026-11-30,
    benchmarks/NOTES.md run 3) one chained accumulator gave fp32 dprobs errors of 2.1e-6
    (K = H = 2048) to 7.9e-6 (K = 7168) against float64, on course to pass SPEC §1's 1e-5 near
    K = 9000; promoted every BK = 64 they were 1.6e-7..2.8e-7 (bound 64·2^-23 = 7.6e-6 for any
    data). The multiply by ``unit`` (a runtime 1.0) keeps the compiler from folding the add back
    into the dot's accumulator."""
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


@triton.jit
def _epilogue_chunks(
    acc,
    acc_up,
    col0,
    rows,
    row_mask,
    row_start,
    is_real,
    e,
    p,
    bias_ptr,
    out_ptr,
    z_ptr,
    h_ptr,
    N,
    N1,
    G,
    p0,
    p1,
    p2,
    BM: tl.constexpr,
    BW: tl.constexpr,
    CHUNKS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    ACT: tl.constexpr,
    GLU: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_BIAS: tl.constexpr,
    STORE_Z: tl.constexpr,
    INTERPRETED: tl.constexpr,
    tm,  # the tile's m index: its 128-row block of the weight-gradient layout (QUANT_G / QUANT_Z)
    cq_g_ptr,
    cq_gs_ptr,
    cq_z_ptr,
    cq_zs_ptr,
    P_pad,
    QUANT_G: tl.constexpr,
    QUANT_Z: tl.constexpr,
    POW2: tl.constexpr,
):
    """The epilogue of a (BM, BW) tile in CHUNKS column chunks, halving recursively; returns the
    dprobs partial summed over the chunks in column order (a fixed order)."""
    if CHUNKS == 1:
        part = _epilogue(
            acc,
            acc_up,
            col0,
            rows,
            row_mask,
            row_start,
            is_real,
            e,
            p,
            bias_ptr,
            out_ptr,
            z_ptr,
            h_ptr,
            N,
            N1,
            G,
            p0,
            p1,
            p2,
            BM,
            BW,
            EPILOGUE,
            ACT,
            GLU,
            HAS_PROBS,
            HAS_BIAS,
            SCALE_BIAS,
            STORE_Z,
            INTERPRETED,
            tm,
            cq_g_ptr,
            cq_gs_ptr,
            cq_z_ptr,
            cq_zs_ptr,
            P_pad,
            QUANT_G,
            QUANT_Z,
            POW2,
        )
    else:
        acc0, acc1 = _halves(acc, BM, BW)
        up0, up1 = _halves(acc_up, BM, BW)
        part = _epilogue_chunks(
            acc0,
            up0,
            col0,
            rows,
            row_mask,
            row_start,
            is_real,
            e,
            p,
            bias_ptr,
            out_ptr,
            z_ptr,
            h_ptr,
            N,
            N1,
            G,
            p0,
            p1,
            p2,
            BM,
            BW // 2,
            CHUNKS // 2,
            EPILOGUE,
            ACT,
            GLU,
            HAS_PROBS,
            HAS_BIAS,
            SCALE_BIAS,
            STORE_Z,
            INTERPRETED,
            tm,
            cq_g_ptr,
            cq_gs_ptr,
            cq_z_ptr,
            cq_zs_ptr,
            P_pad,
            QUANT_G,
            QUANT_Z,
            POW2,
        )
        part += _epilogue_chunks(
            acc1,
            up1,
            col0 + BW // 2,
            rows,
            row_mask,
            row_start,
            is_real,
            e,
            p,
            bias_ptr,
            out_ptr,
            z_ptr,
            h_ptr,
            N,
            N1,
            G,
            p0,
            p1,
            p2,
            BM,
            BW // 2,
            CHUNKS // 2,
            EPILOGUE,
            ACT,
            GLU,
            HAS_PROBS,
            HAS_BIAS,
            SCALE_BIAS,
            STORE_Z,
            INTERPRETED,
            tm,
            cq_g_ptr,
            cq_gs_ptr,
            cq_z_ptr,
            cq_zs_ptr,
            P_pad,
            QUANT_G,
            QUANT_Z,
            POW2,
        )
    return part


@triton.jit
def _halves(x, BM: tl.constexpr, BN: tl.constexpr):
    """(BM, BN) → its column halves [0, BN/2) and [BN/2, BN)."""
    return x.reshape(BM, 2, BN // 2).permute(0, 2, 1).split()


@triton.jit
def _epilogue(
    acc,  # (BM, BNS) fp32: h's gate part (FC1), y (FC2), g_z (FC2_DGRAD) or dx (FC1_DGRAD)
    acc_up,  # (BM, BNS) fp32: h's up part (FC1 with a GLU)
    col0,  # first output column of the chunk (over F for FC1/FC2_DGRAD, over H otherwise)
    rows,
    row_mask,
    row_start,
    is_real,
    e,
    p,  # (BM,) fp32 probs of the rows
    bias_ptr,
    out_ptr,
    z_ptr,
    h_ptr,
    N,
    N1,
    G,
    p0,
    p1,
    p2,
    BM: tl.constexpr,
    BNS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    ACT: tl.constexpr,
    GLU: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_BIAS: tl.constexpr,
    STORE_Z: tl.constexpr,
    INTERPRETED: tl.constexpr,
    tm,  # the tile's m index: its 128-row block of the weight-gradient layout (QUANT_G / QUANT_Z)
    cq_g_ptr,
    cq_gs_ptr,
    cq_z_ptr,
    cq_zs_ptr,
    P_pad,
    QUANT_G: tl.constexpr,
    QUANT_Z: tl.constexpr,
    POW2: tl.constexpr,
):
    """Stores one column chunk of a tile's outputs; returns the chunk's dprobs partial (FC2_DGRAD)."""
    offs_n = col0 + tl.arange(0, BNS)
    n_mask = offs_n < N
    if GLU:
        n_h = (offs_n // G) * (2 * G) + offs_n % G  # gate column of f in h; up column = + G
    else:
        n_h = offs_n
    mask = row_mask[:, None] & n_mask[None, :]
    # Addresses: a 64-bit base per tile plus int32 offsets (BM·N1 < 2^31): (BM, BN) int64
    # pointer tensors would cost two registers per element.
    local = tl.arange(0, BM)[:, None]
    row_base = row_start.to(tl.int64)
    part = tl.zeros((BM,), dtype=tl.float32)
    if EPILOGUE == FC1:
        h_gate = acc
        if HAS_BIAS:
            bias_row = bias_ptr + e.to(tl.int64) * N1
            h_gate += tl.load(bias_row + n_h, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GLU:
            h_up = acc_up
            if HAS_BIAS:
                h_up += tl.load(bias_row + n_h + G, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        h_out = out_ptr + row_base * N1 + (local * N1 + n_h[None, :])
        tl.store(h_out, _rounded(tl.where(is_real, h_gate, 0.0), out_ptr.dtype.element_ty, INTERPRETED), mask=mask)
        if GLU:
            tl.store(
                h_out + G, _rounded(tl.where(is_real, h_up, 0.0), out_ptr.dtype.element_ty, INTERPRETED), mask=mask
            )
        if STORE_Z:  # off for recompute_fc1's h-only launch (grouped_fc1): z_ptr is None there
            if GLU:
                act = glu_forward(h_gate, h_up, ACT, p0, p1, p2)  # from the fp32 accumulator
            else:
                act = unary_forward(h_gate, ACT)
            z = act
            if HAS_PROBS:
                z = act * p[:, None]  # fp32 × fp32: an fp32 probs is never rounded
            z_out = z_ptr + row_base * N + (local * N + offs_n[None, :])
            tl.store(z_out, _rounded(tl.where(is_real, z, 0.0), z_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    elif EPILOGUE == FC2:
        y = acc
        if HAS_BIAS:
            bias = tl.load(bias_ptr + e.to(tl.int64) * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            if SCALE_BIAS:
                y += bias[None, :] * p[:, None]
            else:
                y += bias[None, :]
        y_out = out_ptr + row_base * N + (local * N + offs_n[None, :])
        tl.store(y_out, _rounded(tl.where(is_real, y, 0.0), out_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    elif EPILOGUE == FC2_DGRAD:
        g_z = acc  # fp32, never rounded before use
        h_in = h_ptr + row_base * N1 + (local * N1 + n_h[None, :])
        h_gate = tl.load(h_in, mask=mask, other=0.0).to(tl.float32)
        if GLU:
            h_up = tl.load(h_in + G, mask=mask, other=0.0).to(tl.float32)
            act, d_gate, d_up = glu_backward(h_gate, h_up, ACT, p0, p1, p2)
        else:
            act, d_gate = unary_backward(h_gate, ACT)
        part = tl.sum(tl.where(mask, g_z * act, 0.0), axis=1)  # fp32 from fp32 g_z and a
        g_a = g_z
        if HAS_PROBS:
            g_a = g_z * p[:, None]
        g_out = out_ptr + row_base * N1 + (local * N1 + n_h[None, :])
        g_gate = g_a * d_gate  # one fp32 value each for the store and the quantizer below
        tl.store(g_out, _rounded(tl.where(is_real, g_gate, 0.0), out_ptr.dtype.element_ty, INTERPRETED), mask=mask)
        if QUANT_G:
            _store_wgrad_codes(g_gate, row_mask, is_real, n_h, n_mask, N1, tm, cq_g_ptr, cq_gs_ptr, P_pad, BM, POW2)
        if GLU:
            g_up = g_a * d_up
            g_up_out = _rounded(tl.where(is_real, g_up, 0.0), out_ptr.dtype.element_ty, INTERPRETED)
            tl.store(g_out + G, g_up_out, mask=mask)
            if QUANT_G:
                _store_wgrad_codes(
                    g_up, row_mask, is_real, n_h + G, n_mask, N1, tm, cq_g_ptr, cq_gs_ptr, P_pad, BM, POW2
                )
        if STORE_Z:
            z = act
            if HAS_PROBS:
                z = act * p[:, None]
            if QUANT_Z:  # z is dW2's operand only: its codes replace the fp32 store
                _store_wgrad_codes(z, row_mask, is_real, offs_n, n_mask, N, tm, cq_z_ptr, cq_zs_ptr, P_pad, BM, POW2)
            else:
                z_out = z_ptr + row_base * N + (local * N + offs_n[None, :])
                tl.store(z_out, _rounded(tl.where(is_real, z, 0.0), z_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    else:
        tl.static_assert(EPILOGUE == FC1_DGRAD)
        dx_out = out_ptr + row_base * N + (local * N + offs_n[None, :])
        tl.store(dx_out, _rounded(tl.where(is_real, acc, 0.0), out_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    return part


@triton.jit
def _store_wgrad_codes(
    v, row_mask, is_real, cols, col_mask, n_cols, tm, codes_t_ptr, scales_ptr, P_pad,
    BM: tl.constexpr, POW2: tl.constexpr,
):  # fmt: skip
    """fp8_block's weight-gradient quantization of a (BM, ·) chunk of fp32 values (g_h or z) whose
    rows are one 128-row block of an expert: the tile starts at a multiple of 128 rows into its
    expert (BM = 128), so m-tile tm is block tm of ``quantize_wgrad``'s padded layout. Rows past the
    expert's end are its padding (value 0, code 0). Codes go to column c, padded row tm·128 + i of the
    transposed (·, P_pad) layout the fp8 wgrad GEMM reads; scales to (tm, c). The arithmetic is
    quantize._wgrad_kernel's (fp8_block_columns, an fp32 source: VMAX = FLT_MAX), so the codes and
    scales are those of quantize_wgrad on the stored fp32 values, bit for bit."""
    codes, scales = fp8_block_columns(tl.where(row_mask[:, None], v, 0.0), POW2, FLT_MAX)
    rp = tm.to(tl.int64) * BM + tl.arange(0, BM)
    live = cols < tl.where(is_real, n_cols, 0)  # capacity tiles store nothing: they are no block
    live = live & col_mask
    tl.store(codes_t_ptr + cols.to(tl.int64)[:, None] * P_pad + rp[None, :], tl.trans(codes.to(tl.uint8)),
             mask=live[:, None])  # fmt: skip
    tl.store(scales_ptr + tm.to(tl.int64) * n_cols + cols, scales, mask=live)


@triton.jit
def _grouped_wgrad_kernel(
    g_ptr,  # (M, P) compute dtype, rows grouped by expert: g_h (dW1, P = N1) | dy (dW2, P = H)
    x_ptr,  # (M, Q) compute dtype: x (dW1, Q = H) | round(z) (dW2, Q = F)
    g_desc,  # TMA descriptor of g, block [BK, BP] (USE_TMA), else None
    x_desc,  # TMA descriptor of x, block [BK, BQ] (USE_TMA), else None
    splits_ptr,  # (E,) int32/int64 rows per expert, on the device
    probs_ptr,  # (M,) fp32/bf16/fp16: db2 = Σ dy·p when SCALE_B
    dw_ptr,  # (E, P, Q) weight dtype
    db_ptr,  # (E, P) bias dtype
    acc_scale_ptr,  # ACC_SCALE: fp32 scalar multiplied onto dW's accumulator (nvfp4's per-tensor factors)
    M,
    P,
    Q,
    E,
    DO_W: tl.constexpr,
    DO_B: tl.constexpr,
    SCALE_B: tl.constexpr,
    BP: tl.constexpr,
    BQ: tl.constexpr,
    BK: tl.constexpr,
    GROUP_P: tl.constexpr,
    E_BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    ACC_SCALE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_p = tl.cdiv(P, BP)
    if DO_W:
        num_q = tl.cdiv(Q, BQ)
    else:
        num_q = 1
    per_expert = num_p * num_q
    e = pid // per_expert
    t = pid % per_expert
    in_group = GROUP_P * num_q
    first_p = (t // in_group) * GROUP_P
    group_size = tl.minimum(num_p - first_p, GROUP_P)
    tp = first_p + (t % in_group) % group_size
    tq = (t % in_group) // group_size

    idx, starts, ends, tiles, tile_cum = _expert_table(splits_ptr, E, M, E_BLOCK, 1)
    e_start = _pick(idx, starts, e)
    e_end = _pick(idx, ends, e)  # K of this expert = e_end - e_start rows; 0 rows → zeros
    offs_p = tp * BP + tl.arange(0, BP)
    offs_q = tq * BQ + tl.arange(0, BQ)
    p_mask = offs_p < P
    q_mask = offs_q < Q
    offs_k = tl.arange(0, BK)

    if DO_W:
        acc = tl.zeros((BP, BQ), dtype=tl.float32)
        tail_start = e_start
        if USE_TMA:
            # Row blocks wholly inside the expert through the copy engine; the last partial block
            # (rows of the next expert must not enter the sum) through masked loads below.
            full_blocks = (e_end - e_start) // BK
            for i in range(0, full_blocks):
                k0 = e_start + i * BK
                g = g_desc.load([k0, tp * BP])
                x = x_desc.load([k0, tq * BQ])
                if INTERPRETED:
                    g = g.to(tl.float32)
                    x = x.to(tl.float32)
                acc = tl.dot(tl.trans(g), x, acc, input_precision=DOT_PRECISION)
            tail_start = e_start + full_blocks * BK
        for k0 in range(tail_start, e_end, BK):
            rows = k0 + offs_k
            rows64 = rows.to(tl.int64)
            k_mask = rows < e_end
            g = tl.load(
                g_ptr + rows64[:, None] * P + offs_p[None, :], mask=k_mask[:, None] & p_mask[None, :], other=0.0
            )
            x = tl.load(
                x_ptr + rows64[:, None] * Q + offs_q[None, :], mask=k_mask[:, None] & q_mask[None, :], other=0.0
            )
            if INTERPRETED:
                g = g.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(tl.trans(g), x, acc, input_precision=DOT_PRECISION)
        if ACC_SCALE:
            acc = acc * tl.load(acc_scale_ptr)
        dw = dw_ptr + e.to(tl.int64) * P * Q + offs_p[:, None].to(tl.int64) * Q + offs_q[None, :]
        tl.store(dw, _rounded(acc, dw_ptr.dtype.element_ty, INTERPRETED), mask=p_mask[:, None] & q_mask[None, :])

    if DO_B:
        if tq == 0:
            # A second pass over this expert's rows of G, in the programs of the first Q tile only:
            # it re-reads G once in all (0.2 ms of mixtral's ~30 ms fwd+bwd) and keeps the dW
            # loop free of a branch. Fixed order: chunks of BK rows in sequence.
            acc_b = tl.zeros((BP,), dtype=tl.float32)
            for k0 in range(e_start, e_end, BK):
                rows = k0 + offs_k
                k_mask = rows < e_end
                g = tl.load(
                    g_ptr + rows.to(tl.int64)[:, None] * P + offs_p[None, :],
                    mask=k_mask[:, None] & p_mask[None, :],
                    other=0.0,
                ).to(tl.float32)
                if SCALE_B:
                    g = g * tl.load(probs_ptr + rows, mask=k_mask, other=0.0).to(tl.float32)[:, None]
                acc_b += tl.sum(g, axis=0)
            tl.store(
                db_ptr + e.to(tl.int64) * P + offs_p, _rounded(acc_b, db_ptr.dtype.element_ty, INTERPRETED), mask=p_mask
            )


@triton.jit
def _dprobs_reduce_kernel(
    partial_ptr,  # (num_parts, M) fp32 dprobs partials, one row per F tile of FC2_DGRAD
    dy_ptr,  # (M, H) compute dtype (BIAS_TERM)
    fc2_bias_ptr,  # (E, H) compute dtype (BIAS_TERM)
    splits_ptr,  # (E,) int32/int64
    dprobs_ptr,  # (M,) probs.dtype: the tensor returned to the user; one rounding in this store
    M,
    H,
    E,
    num_parts,
    BIAS_TERM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    E_BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < M
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for t in range(0, num_parts):  # fixed order, F tile 0 first: deterministic, no atomics
        acc += tl.load(partial_ptr + t * M + rows, mask=row_mask, other=0.0)
    if BIAS_TERM:
        # + Σ_j dy·fc2_bias[e(row)]: e(row) = number of experts whose rows end at or before it.
        idx, starts, ends, tiles, tile_cum = _expert_table(splits_ptr, E, M, E_BLOCK, 1)
        ends_v = tl.where(idx < E, ends, M + 1)
        e_row = tl.minimum(tl.sum((ends_v[None, :] <= rows[:, None]).to(tl.int32), axis=1), E - 1)
        live = row_mask & (rows < tl.max(ends))  # capacity rows keep dprobs = 0
        offs_h = tl.arange(0, BLOCK_H)
        for j0 in range(0, H, BLOCK_H):
            cols = j0 + offs_h
            m2 = live[:, None] & (cols < H)[None, :]
            dy = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], mask=m2, other=0.0)
            b = tl.load(fc2_bias_ptr + e_row.to(tl.int64)[:, None] * H + cols[None, :], mask=m2, other=0.0)
            acc += tl.sum(dy.to(tl.float32) * b.to(tl.float32), axis=1)
    tl.store(dprobs_ptr + rows, _rounded(acc, dprobs_ptr.dtype.element_ty, INTERPRETED), mask=row_mask)


# --------------------------------------------------------------------------------------------
# Launchers


@dataclass(frozen=True)
class GemmConfig:
    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int
    GROUP_M: int = 8
    SUBTILE: int = 1  # epilogue column chunks, a power of two
    PROMOTE: bool | None = None  # fp32 adds of BK-deep products; None: when dprobs partials are stored
    USE_TMA: bool | None = None  # None: TMA where the operands allow it (16-byte aligned rows)


def default_config(kind: str, N: int, K: int, glu: bool, elem_bytes: int = 2, fp8: bool = False) -> GemmConfig:
    """Tile shapes for the H200, checked with ptxas (no spills); measurements in benchmarks/NOTES.md.

    Under the interpreter every program runs in numpy: 16-row tiles keep the CPU suite fast (16 is
    tl.dot's smallest side), with the same epilogue chunking as on the GPU so that code runs too."""
    if fp8:
        return _fp8_config(kind, glu)
    if kind == "fc1" and glu:
        # Two 128×128 fp32 accumulators (gate, up) = one 128×256 tile, 128 registers per thread at
        # 8 warps; the epilogue in 4 chunks of 32 columns fits in the rest (254 registers, no
        # spills; 2 chunks spilled 55 local loads).
        # H200 2026-11-30: 3 stages beat 4 on mixtral (596 vs 565 TFLOP/s) and deepseek (616 vs 596),
        # lost 2.5% on qwen3.
        gpu = GemmConfig(128, 128, 64, 8, 3, SUBTILE=4)
    elif kind == "fc1":
        gpu = GemmConfig(128, 128, 64, 8, 4, SUBTILE=2)
    elif kind == "fc2_dgrad":
        # The epilogue holds g_z, h gate/up, a, act' at once, and PROMOTE a second accumulator in
        # the loop: 8 chunks of 16 columns compile without spills (238 registers; 4 chunks: 11
        # local loads; 128×256 spills at any chunking). H200 2026-11-30, with PROMOTE: 8 chunks
        # 1-4% faster than 4; 3 stages 8-11% slower than 4; h loaded before the K loop (91 local
        # loads) -6% to +5%, not kept.
        gpu = GemmConfig(128, 128, 64, 8, 4, SUBTILE=8)
    elif kind == "wgrad":
        # H200 2026-11-30 (pointer loads): 128×256 s3 beat 128×128 s4 by 16-27% on all four shapes.
        gpu = GemmConfig(128, 256, 64, 8, 3)
    else:
        # FC2 and FC1_DGRAD: plain epilogues; 128×256 is Hopper's usual best bf16 tile (202 regs).
        gpu = GemmConfig(128, 256, 64, 8, 3)
    if INTERPRET:
        return GemmConfig(16, 32 if gpu.SUBTILE > 1 else 16, 16, 4, 1, GROUP_M=4, SUBTILE=min(gpu.SUBTILE, 4))
    if elem_bytes == 4:
        # fp32 operands double every stage: 128×256 tiles at BK 64 and 3 stages would need 288 KiB of
        # shared memory (H200: 227 KiB per block; seen failing 2026-11-30). BK 32 and 2 stages:
        # (128 + 256)·32·4·2 = 96 KiB.
        return dataclasses.replace(gpu, BK=32, num_stages=min(gpu.num_stages, 2))
    return gpu


def _fp8_config(kind: str, glu: bool) -> GemmConfig:
    """fp8_block (FP8 mode): BK = 128, one scale block per K step. The promotion keeps each step's
    product in registers next to the accumulator, so a tile holds twice the fp32 values of a bf16
    one: FC1 with a GLU takes 64 columns of gate and of up (128×128 fp32 in all, as the others).
    H200 2026-11-30 (benchmarks/NOTES.md, "fp8_block GEMM"): 128×128, 8 warps, 4 stages was the
    best of the forward GEMM's sweep; 64×128 at 4 warps and 3/5 stages were 1-6% slower."""
    if kind == "fc1" and glu:
        gpu = GemmConfig(128, 64, 128, 8, 4, SUBTILE=2)
    elif kind == "fc1":
        gpu = GemmConfig(128, 128, 128, 8, 4, SUBTILE=2)
    elif kind == "fc2_dgrad":
        gpu = GemmConfig(128, 128, 128, 8, 4, SUBTILE=8)
    else:
        gpu = GemmConfig(128, 128, 128, 8, 4)
    if INTERPRET:
        # FC2_DGRAD keeps the GPU's 128-row tiles: its epilogue quantizes g_h and z in 128-row blocks.
        bm = 128 if kind == "fc2_dgrad" else 16
        return GemmConfig(bm, 32 if gpu.SUBTILE > 1 else 16, 128, 4, 1, GROUP_M=4, SUBTILE=min(gpu.SUBTILE, 4))
    return gpu


_NUM_SMS: dict[int, int] = {}


def _num_programs(device: torch.device, bound: int) -> int:
    if device.type != "cuda":
        return max(1, min(bound, 4))
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(bound, _NUM_SMS[index]))


def _e_block(E: int) -> int:
    return max(16, triton.next_power_of_2(E))


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """The copy engine wants 16-byte aligned bases and row strides: true for contiguous tensors
    whose rows are multiples of 8 bf16 elements, unless a caller passes an offset view."""
    if TensorDescriptor is None:
        return False
    for t in tensors:
        if t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:-1]):
            return False
    return True


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 compute: exact fp32 products ("ieee"), as the reference; bf16/fp16 ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


# Whether the grouped MLP's backward has FC2_DGRAD quantize g_h and z for the fp8 wgrads in its
# epilogue (WgradCodes). Off: on the H200 (triton 3.6, 2026-11-30, benchmarks/bench_fc2_dgrad_fp8.py)
# the launch took 19.8 ms with it against 4.5 ms storing fp32 g_h and z (mixtral-8x7b; deepseek-v3
# 6.19 vs 1.74), far more than the quantize_wgrad passes it saves (~3 ms). Suspected, not yet
# measured: the transposed byte stores of the codes from the MMA layout (benchmarks/NOTES.md).
FUSE_WGRAD_CODES = False


@dataclass
class WgradCodes:
    """fp8_block weight-gradient operands that the FC2_DGRAD epilogue quantizes from its fp32 values
    (``_store_wgrad_codes``): g_h for dW1 and z for dW2, each in ``quantize_wgrad``'s expert-aligned
    padded layout of P = (⌈M/128⌉ + E)·128 rows, transposed (K-major for the fp8 wgrad GEMM):
    codes (C, P) uint8 e4m3 bits, scales (P/128, C) fp32. Only the blocks of the experts' rows are
    written (the wgrad GEMM reads no other); None skips one operand. With z_t, z itself is not stored."""

    g_t: torch.Tensor | None
    g_s: torch.Tensor | None
    z_t: torch.Tensor | None
    z_s: torch.Tensor | None
    pow2: bool

    @staticmethod
    def empty(M: int, E: int, N1: int, F: int, pow2: bool, g: bool, z: bool, device) -> WgradCodes:
        P = (triton.cdiv(M, 128) + E) * 128

        def buffers(C):
            return (torch.empty((C, P), dtype=torch.uint8, device=device),
                    torch.empty((P // 128, C), dtype=torch.float32, device=device))  # fmt: skip

        g_t, g_s = buffers(N1) if g else (None, None)
        z_t, z_s = buffers(F) if z else (None, None)
        return WgradCodes(g_t, g_s, z_t, z_s, pow2)

    @property
    def P(self) -> int:
        return (self.g_t if self.g_t is not None else self.z_t).shape[1]

    def check(self, M: int, E: int, N1: int, F: int) -> None:
        P = (triton.cdiv(M, 128) + E) * 128
        for t, s, C, what in ((self.g_t, self.g_s, N1, "g"), (self.z_t, self.z_s, F, "z")):
            if t is None:
                continue
            if t.shape != (C, P) or t.dtype != torch.uint8 or not t.is_contiguous():
                raise ValueError(f"wgrad_codes.{what}_t: expected a contiguous ({C}, {P}) uint8 tensor")
            if s is None or s.shape != (P // 128, C) or s.dtype != torch.float32 or not s.is_contiguous():
                raise ValueError(f"wgrad_codes.{what}_s: expected a contiguous ({P // 128}, {C}) float32 tensor")
        if self.g_t is None and self.z_t is None:
            raise ValueError("wgrad_codes: neither g nor z asked for")

    def pointers(self, dummy):
        return tuple(t if t is not None else dummy for t in (self.g_t, self.g_s, self.z_t, self.z_s))


def fp8_epilogue_blocks_ok(config: GemmConfig, K: int) -> bool:
    """Whether an FP8 launch of reduction depth K runs 128-row m-tiles, which the epilogue's
    weight-gradient quantization needs: the config's BM, and the TMA mainloop (code rows 16-byte
    aligned; the masked-pointer fallback below runs 64-row tiles)."""
    return config.BM == 128 and (INTERPRET or (TensorDescriptor is not None and K % 16 == 0))


def launch_grouped_gemm(
    epilogue: int,
    a: torch.Tensor,
    b: torch.Tensor,
    b_strides: tuple[int, int, int],
    splits: torch.Tensor,
    probs,
    bias,
    out,
    z,
    h,
    partial,
    N: int,
    K: int,
    N1: int,
    cfg,  # MLPConfig
    scale_bias: bool,
    store_z: bool,
    store_partial: bool,
    config: GemmConfig,
    a_scales=None,  # fp8_block: (M, ⌈K/128⌉) fp32 dequant scales of a's e4m3 codes (any 2-D strides)
    b_scales=None,  # fp8_block: fp32 dequant scales of b's 128×128 tiles ...
    b_scale_strides: tuple[int, int, int] | None = None,  # ... tile (n//128, k//128) of expert e at e·s0 + ·s1 + ·s2
    acc_scale=None,  # 0-d fp32 tensor multiplied onto the fp32 accumulator (nvfp4's per-tensor factors)
    wgrad_codes: WgradCodes | None = None,  # FC2_DGRAD under fp8_block: g_h / z quantized for dW1 / dW2
    dequant: tuple[int, int] = (0, 0),  # (A, B): 1 mxfp8 / 2 nvfp4 codes dequantized in the load path (below)
) -> None:
    """``dequant``: an operand given as mxfp8 / nvfp4 codes blocked along K (uint8; nvfp4 packed in
    pairs along K), its uint8 block-scale codes in ``a_scales`` ((M, ⌈K/B⌉), any strides) or
    ``b_scales`` (element (n, K block) of expert e at e·s0 + n·s1 + kb·s2 of ``b_scale_strides``);
    b_strides then count bytes, k in pairs for nvfp4. The kernel forms the bf16 values the
    ``quantize.dequantized*`` passes would store and runs the bf16 product on them."""
    M = a.shape[0]
    E = splits.shape[0]
    a_dq, b_dq = dequant
    fp8 = a_scales is not None and not (a_dq or b_dq)
    if (a_dq and a_scales is None) or (b_dq and (b_scales is None or b_scale_strides is None)):
        raise ValueError("dequant: an operand decoded in the load path needs its block scales")
    if (a_dq or b_dq) and config.BK % (32 if 1 in dequant else 16):
        raise ValueError(f"dequant: BK {config.BK} must hold whole scale blocks")
    if wgrad_codes is not None:
        if epilogue != FC2_DGRAD.value or not fp8:
            raise ValueError("wgrad_codes: the FC2_DGRAD epilogue of an fp8_block GEMM quantizes for the wgrads")
        if not fp8_epilogue_blocks_ok(config, K):
            raise ValueError(f"wgrad_codes: needs 128-row tiles on the TMA path (config BM {config.BM}, K {K})")
        wgrad_codes.check(M, E, N1, N)
    if M == 0 or N == 0:
        return
    # cfg None: a plain GEMM (FC2's epilogue without probs: out = acc (+ bias)), no activation
    params = tuple(cfg.activation_params) + (0.0,) * (3 - len(cfg.activation_params)) if cfg else (0.0,) * 3
    glu = cfg is not None and cfg.glu
    dummy = a  # never dereferenced: the constexpr flags switch its loads and stores off
    b_kmajor = b_strides[2] == 1
    glu_gather = glu and epilogue == FC1.value
    use_tma = not (a_dq or b_dq) and _tma_ok(a, b) and (
        not glu_gather
        or N % cfg.glu_interleave == 0
        and (cfg.glu_interleave == N or cfg.glu_interleave % config.BN == 0)
    )
    if config.USE_TMA is not None:
        if config.USE_TMA and not use_tma:
            raise ValueError("config: USE_TMA needs 16-byte aligned operand rows (and GLU blocks a multiple of BN)")
        use_tma = config.USE_TMA
    elif fp8 and not use_tma and not INTERPRET:
        # Code rows not 16-byte aligned (K % 16 != 0): the masked-pointer mainloop holds (BM, 128)
        # pointer tensors besides the accumulator and the promoted product; at 128×128 every FP8
        # epilogue spilled (ptxas sm_90, triton 3.9: 173-217 local loads), at 64×64 and 8 warps
        # FC2 and FC2_DGRAD do not (FC1 with a GLU still spills 99). A fallback for odd shapes.
        config = dataclasses.replace(config, BM=64, BN=64, num_warps=8, num_stages=4)
    if wgrad_codes is not None and config.BM != 128:  # an operand row not 16-byte aligned after all
        raise ValueError("wgrad_codes: this launch fell back to 64-row tiles; quantize the operands separately")
    m_bound = triton.cdiv(M, config.BM) + E + 1
    bound = m_bound * triton.cdiv(N, config.BN)
    num_progs = _num_programs(a.device, bound)
    a_desc = b_desc = None
    if use_tma:
        a_desc = TensorDescriptor.from_tensor(a, [config.BM, config.BK])
        b_block = [1, config.BN, config.BK] if b_kmajor else [1, config.BK, config.BN]
        b_desc = TensorDescriptor.from_tensor(b, b_block)
    _grouped_gemm_kernel[(num_progs,)](
        a,
        b,
        a_desc,
        b_desc,
        splits,
        probs if probs is not None else dummy,
        bias if bias is not None else dummy,
        out,
        z if z is not None else dummy,
        h if h is not None else dummy,
        partial if partial is not None else dummy,
        a_scales if a_scales is not None else dummy,
        b_scales if b_scales is not None else dummy,
        acc_scale if acc_scale is not None else dummy,
        *(wgrad_codes.pointers(dummy) if wgrad_codes is not None else (dummy,) * 4),
        wgrad_codes.P if wgrad_codes is not None else 0,
        M,
        N,
        K,
        E,
        a.stride(0),
        b_strides[0],
        b_strides[1],
        b_strides[2],
        a_scales.stride(0) if a_scales is not None else 0,
        a_scales.stride(1) if a_scales is not None else 0,
        *(b_scale_strides if b_scales is not None else (0, 0, 0)),
        N1,
        cfg.glu_interleave if glu else 1,
        float(params[0]),
        float(params[1]),
        float(params[2]),
        1.0,
        num_progs,
        EPILOGUE=epilogue,
        ACT=cfg.activation.kernel_id if cfg else 0,
        GLU=glu,
        HAS_PROBS=probs is not None,
        HAS_BIAS=bias is not None,
        SCALE_BIAS=scale_bias and probs is not None,
        STORE_Z=store_z,
        STORE_PARTIAL=store_partial,
        BM=config.BM,
        BN=config.BN,
        BK=config.BK,
        GROUP_M=config.GROUP_M,
        E_BLOCK=_e_block(E),
        INTERPRETED=INTERPRET,
        DOT_PRECISION=_dot_precision(a.dtype),
        USE_TMA=use_tma,
        B_KMAJOR=b_kmajor,
        SUBTILE=config.SUBTILE,
        # g_z feeds dprobs, which SPEC §1 holds to fp32-accumulation accuracy (see _accumulate).
        PROMOTE=store_partial if config.PROMOTE is None else config.PROMOTE,
        FP8=fp8,
        ACC_SCALE=acc_scale is not None,
        B_SCALE_SCALAR=fp8 and 128 % config.BN == 0 and (not glu_gather or cfg.glu_interleave % config.BN == 0),
        QUANT_G=wgrad_codes is not None and wgrad_codes.g_t is not None,
        QUANT_Z=wgrad_codes is not None and wgrad_codes.z_t is not None,
        POW2=wgrad_codes is not None and wgrad_codes.pow2,
        A_DQ=a_dq,
        B_DQ=b_dq,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def launch_grouped_wgrad(
    g: torch.Tensor,
    x,
    splits: torch.Tensor,
    probs,
    dw,
    db,
    scale_b: bool,
    config: GemmConfig,
    acc_scale=None,  # 0-d fp32 tensor multiplied onto dW (not db): nvfp4's per-tensor factors
) -> None:
    M, P = g.shape
    E = splits.shape[0]
    Q = x.shape[1] if x is not None else 1
    do_w = dw is not None
    grid = (E * triton.cdiv(P, config.BM) * (triton.cdiv(Q, config.BN) if do_w else 1),)
    use_tma = do_w and M > 0 and _tma_ok(g, x)
    g_desc = TensorDescriptor.from_tensor(g, [config.BK, config.BM]) if use_tma else None
    x_desc = TensorDescriptor.from_tensor(x, [config.BK, config.BN]) if use_tma else None
    _grouped_wgrad_kernel[grid](
        g,
        x if x is not None else g,
        g_desc,
        x_desc,
        splits,
        probs if probs is not None else g,
        dw if dw is not None else g,
        db if db is not None else g,
        acc_scale if acc_scale is not None else g,
        M,
        P,
        Q,
        E,
        DO_W=do_w,
        DO_B=db is not None,
        SCALE_B=scale_b and probs is not None,
        BP=config.BM,
        BQ=config.BN,
        BK=config.BK,
        GROUP_P=config.GROUP_M,
        E_BLOCK=_e_block(E),
        INTERPRETED=INTERPRET,
        DOT_PRECISION=_dot_precision(g.dtype),
        USE_TMA=use_tma,
        ACC_SCALE=acc_scale is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def launch_dprobs_reduce(partial, dy, fc2_bias, splits, dprobs, num_parts: int, bias_term: bool) -> None:
    M = dprobs.shape[0]
    if M == 0:
        return
    H = dy.shape[1]
    E = splits.shape[0]
    e_block = _e_block(E)
    if INTERPRET:
        block_r = 16
    elif bias_term:
        # The expert of each row comes from a (rows × experts) comparison: ≤ 16k elements keeps it
        # at 128 registers per thread at 4 warps, also for 1024 experts.
        block_r = max(16, min(128, 16384 // e_block))
    else:
        block_r = 128
    _dprobs_reduce_kernel[(triton.cdiv(M, block_r),)](
        partial,
        dy,
        fc2_bias if fc2_bias is not None else dy,
        splits,
        dprobs,
        M,
        H,
        E,
        num_parts,
        BIAS_TERM=bias_term,
        BLOCK_R=block_r,
        BLOCK_H=16 if INTERPRET else 64,
        E_BLOCK=e_block,
        INTERPRETED=INTERPRET,
        num_warps=4,
    )
