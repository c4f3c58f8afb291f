"""dprobs = Σ over FC2_DGRAD's per-N-tile partials (+ Σ_j dy·fc2_bias[e] with scale_fc2_bias), in a
fixed order (no atomics: SPEC §1 asks for the same bits on every run), rounded once into
probs.dtype by its store: for fp32 probs the tensor written here is the one returned.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import expert_table, rounded


@triton.jit
def dprobs_reduce_kernel(
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
        idx, starts, ends, tiles, tile_cum = expert_table(splits_ptr, E, M, E_BLOCK, 1)
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
    tl.store(dprobs_ptr + rows, rounded(acc, dprobs_ptr.dtype.element_ty, INTERPRETED), mask=row_mask)
