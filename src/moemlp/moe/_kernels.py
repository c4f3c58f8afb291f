"""Triton kernels of the row gathers: the dispatch's (with and without a k-way sum) and grouped_mlp's
``x_index`` (routed rows gathered from x; the adjoint, a segmented sum per token).

Every kernel only reads and writes rows: no atomics, so every output element is written by exactly
one program and each sum runs in a fixed order in fp32. The torch paths (dispatch.py, _x_index.py)
perform the same additions in the same order, so the two agree bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..kernels._launcher import cdiv, launch

__all__ = ["gather_rows", "gather_sum_rows", "gather_routed_rows", "segment_sum_rows"]

# The CPU interpreter (triton 3.9) truncates fp32 -> bf16 instead of rounding to
# nearest even; under it the k-sum is stored in fp32 and rounded by torch. The GPU rounds in the store.
_INTERPRET_BF16_STORE_FP32 = os.environ.get("TRITON_INTERPRET") == "1"

# One program per (row, 1024 columns): H = 7168 is 7 programs a row; a 2-byte row chunk of 2 KiB
# keeps loads vectorised without spilling.
_BLOCK_H = 1024


@triton.jit
def _gather_rows_kernel(
    src_ptr,  # (R, H) rows to copy from
    index_ptr,  # (M,) int64, source row of each output row
    out_ptr,  # (M, H) same dtype as src
    H,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    src_row = tl.load(index_ptr + row).to(tl.int64)  # int64 offsets: 256k rows × 16k cols overflow int32
    vals = tl.load(src_ptr + src_row * H + cols, mask=mask)
    tl.store(out_ptr + row.to(tl.int64) * H + cols, vals, mask=mask)


@triton.jit
def _gather_sum_rows_kernel(
    src_ptr,  # (R, H) rows to sum
    index_ptr,  # (T, K) int64, the K source rows of each output row, summed in k order
    out_ptr,  # (T, H) same dtype as src; fp32 accumulation (fp64 for fp64), one rounding in the store
    H,
    K,
    BLOCK_H: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=ACC_DTYPE)
    for k in range(0, K):  # fixed order: deterministic, and the same order as the torch path
        src_row = tl.load(index_ptr + row.to(tl.int64) * K + k).to(tl.int64)
        acc += tl.load(src_ptr + src_row * H + cols, mask=mask).to(ACC_DTYPE)
    tl.store(out_ptr + row.to(tl.int64) * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_routed_rows_kernel(
    x_ptr,  # (T, H) tokens
    x_index_ptr,  # (M,) int32/int64, token of each expert-input row; read for routed rows only
    routed_ptr,  # (1,) int64, Σsplits clamped to [0, M] on the device: rows past it are capacity
    out_ptr,  # (M, H) x's dtype; capacity rows are written as zeros
    T,
    H,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    routed = row < tl.load(routed_ptr)
    # A capacity row's index may be garbage: it is not loaded, and its output row is zero.
    token = tl.load(x_index_ptr + row, mask=routed, other=0).to(tl.int64)
    # No host read checks the indices of device tensors: an index out of [0, T) is clamped into it,
    # as bad device splits are, so nothing outside x is read (T >= 1: the launcher handles T = 0).
    token = tl.minimum(tl.maximum(token, 0), T - 1)
    read_cols = tl.where(routed, H, 0)  # a capacity row reads nothing and stores zeros
    vals = tl.load(x_ptr + token * H + cols, mask=cols < read_cols, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * H + cols, vals, mask=cols < H)


@triton.jit
def _segment_sum_rows_kernel(
    src_ptr,  # (M, H) rows to sum
    order_ptr,  # (L,) int64, rows grouped by output row, each group in the order it is summed
    offsets_ptr,  # (T + 1,) int64, output row t sums src[order[offsets[t]:offsets[t + 1]]]
    out_ptr,  # (T, H) src's dtype; fp32 accumulation (fp64 for fp64), one rounding in the store
    H,
    BLOCK_H: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    start = tl.load(offsets_ptr + t)
    end = tl.load(offsets_ptr + t + 1)
    acc = tl.zeros((BLOCK_H,), dtype=ACC_DTYPE)  # a row no index names stays exactly 0
    for j in range(start, end):  # in order, one program per output row: deterministic, no atomics
        src_row = tl.load(order_ptr + j).to(tl.int64)
        acc += tl.load(src_ptr + src_row * H + cols, mask=mask).to(ACC_DTYPE)
    tl.store(out_ptr + t.to(tl.int64) * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Custom ops, so that torch.compile(fullgraph=True) treats each launch as one opaque op (with a fake
# implementation for shapes) on every device, the CPU interpreter included.


@torch.library.custom_op("moemlp::gather_rows", mutates_args=())
def gather_rows(src: Tensor, index: Tensor) -> Tensor:
    """out[i] = src[index[i]]; src (R, H) contiguous, index (M,) int64 on src's device."""
    out = torch.empty((index.shape[0], src.shape[1]), dtype=src.dtype, device=src.device)
    if out.numel():
        grid = (index.shape[0], cdiv(src.shape[1], _BLOCK_H))
        launch(_gather_rows_kernel, grid, src, index, out, src.shape[1], BLOCK_H=_BLOCK_H)
    return out


@gather_rows.register_fake
def _(src, index):
    return src.new_empty((index.shape[0], src.shape[1]))


@torch.library.custom_op("moemlp::gather_sum_rows", mutates_args=())
def gather_sum_rows(src: Tensor, index: Tensor) -> Tensor:
    """out[t] = Σ_k src[index[t, k]] in fp32 (fp64 for fp64), k in order; src (R, H) contiguous, index (T, K)."""
    T, K = index.shape
    fp32_store = _INTERPRET_BF16_STORE_FP32 and src.dtype == torch.bfloat16
    out_dtype = torch.float32 if fp32_store else src.dtype
    out = torch.empty((T, src.shape[1]), dtype=out_dtype, device=src.device)
    if out.numel():
        grid = (T, cdiv(src.shape[1], _BLOCK_H))
        acc_dtype = tl.float64 if src.dtype == torch.float64 else tl.float32
        launch(_gather_sum_rows_kernel, grid,
            src, index, out, src.shape[1], K, BLOCK_H=_BLOCK_H, ACC_DTYPE=acc_dtype
        )
    return out.to(src.dtype) if fp32_store else out


@gather_sum_rows.register_fake
def _(src, index):
    return src.new_empty((index.shape[0], src.shape[1]))


@torch.library.custom_op("moemlp::gather_routed_rows", mutates_args=())
def gather_routed_rows(x: Tensor, x_index: Tensor, routed: Tensor) -> Tensor:
    """out[i] = x[clamp(x_index[i], 0, T - 1)] for i < routed, else 0; x (T, H) contiguous,
    x_index (M,) int32/int64 and routed (1,) int64 on x's device. No host read."""
    M, H = x_index.shape[0], x.shape[1]
    if x.shape[0] == 0:  # no row of x to read, nor to clamp an index to: every row is 0
        return torch.zeros((M, H), dtype=x.dtype, device=x.device)
    out = torch.empty((M, H), dtype=x.dtype, device=x.device)
    if out.numel():
        grid = (M, cdiv(H, _BLOCK_H))
        launch(_gather_routed_rows_kernel, grid, x, x_index, routed, out, x.shape[0], H, BLOCK_H=_BLOCK_H)
    return out


@gather_routed_rows.register_fake
def _(x, x_index, routed):
    return x.new_empty((x_index.shape[0], x.shape[1]))


@torch.library.custom_op("moemlp::segment_sum_rows", mutates_args=())
def segment_sum_rows(src: Tensor, order: Tensor, offsets: Tensor) -> Tensor:
    """out[t] = Σ_{offsets[t] <= j < offsets[t+1]} src[order[j]], in j order, fp32 (fp64 for fp64)
    accumulation and one rounding; src (M, H) contiguous, order (L,) and offsets (T + 1,) int64."""
    T, H = offsets.shape[0] - 1, src.shape[1]
    fp32_store = _INTERPRET_BF16_STORE_FP32 and src.dtype == torch.bfloat16
    out = torch.empty((T, H), dtype=torch.float32 if fp32_store else src.dtype, device=src.device)
    if out.numel():
        grid = (T, cdiv(H, _BLOCK_H))
        acc_dtype = tl.float64 if src.dtype == torch.float64 else tl.float32
        launch(_segment_sum_rows_kernel, grid, src, order, offsets, out, H, BLOCK_H=_BLOCK_H, ACC_DTYPE=acc_dtype)
    return out.to(src.dtype) if fp32_store else out


@segment_sum_rows.register_fake
def _(src, order, offsets):
    return src.new_empty((offsets.shape[0] - 1, src.shape[1]))
