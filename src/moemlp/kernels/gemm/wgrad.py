"""The weight-gradient grouped GEMM on the compute dtype (or a recipe's exact bf16 values):
dW[e] = G[R_e]ᵀ @ X[R_e] with K = that expert's row count, and the bias gradient Σ_rows G as a
second loop of the same program. One program per (expert, output tile): an empty expert stores zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import expert_table, pick, rounded


@triton.jit
def grouped_wgrad_kernel(
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

    idx, starts, ends, tiles, tile_cum = expert_table(splits_ptr, E, M, E_BLOCK, 1)
    e_start = pick(idx, starts, e)
    e_end = pick(idx, ends, e)  # K of this expert = e_end - e_start rows; 0 rows → zeros
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
        tl.store(dw, rounded(acc, dw_ptr.dtype.element_ty, INTERPRETED), mask=p_mask[:, None] & q_mask[None, :])

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
                db_ptr + e.to(tl.int64) * P + offs_p, rounded(acc_b, db_ptr.dtype.element_ty, INTERPRETED), mask=p_mask
            )
