"""Triton kernels of the dispatch: row gathers, with and without a k-way sum.

Both kernels only read and write rows: no atomics, so every output element is written by exactly
one program and the k-way sum runs in a fixed order (k = 0, 1, …) in fp32. The torch path in
dispatch.py performs the same additions in the same order, so the two agree bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["gather_rows", "gather_sum_rows"]

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


# Custom ops, so that torch.compile(fullgraph=True) treats each launch as one opaque op (with a fake
# implementation for shapes) on every device, the CPU interpreter included.


@torch.library.custom_op("moemlp::gather_rows", mutates_args=())
def gather_rows(src: Tensor, index: Tensor) -> Tensor:
    """out[i] = src[index[i]]; src (R, H) contiguous, index (M,) int64 on src's device."""
    out = torch.empty((index.shape[0], src.shape[1]), dtype=src.dtype, device=src.device)
    if out.numel():
        grid = (index.shape[0], triton.cdiv(src.shape[1], _BLOCK_H))
        _gather_rows_kernel[grid](src, index, out, src.shape[1], BLOCK_H=_BLOCK_H)
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
        grid = (T, triton.cdiv(src.shape[1], _BLOCK_H))
        acc_dtype = tl.float64 if src.dtype == torch.float64 else tl.float32
        _gather_sum_rows_kernel[grid](
            src, index, out, src.shape[1], K, BLOCK_H=_BLOCK_H, ACC_DTYPE=acc_dtype
        )
    return out.to(src.dtype) if fp32_store else out


@gather_sum_rows.register_fake
def _(src, index):
    return src.new_empty((index.shape[0], src.shape[1]))
