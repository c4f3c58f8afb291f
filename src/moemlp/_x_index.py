"""Gathered input rows (SPEC §1, ``x_index``): the expert input's row i is ``x[x_index[i]]``.

Unfused: the routed rows are gathered into an (M, H) tensor that the grouped MLP then reads, and
dx comes back through the adjoint, a segmented sum per token. A fused FC1 would gather inside its
loads; the autograd.Function below is the seam it replaces.

    forward   rows[i] = x[x_index[i]]  for i < Σsplits,  0 for capacity rows (index not read)
    backward  dx[t]   = Σ_{j in [offsets[t], offsets[t+1])} d_rows[order[j]]

``order`` lists the routed rows grouped by token and ``offsets`` delimits each token's group. By
default they come from a stable sort of the routed rows by token (capacity rows get the sentinel
key T and sort past every group), so each token sums its rows in ascending i; no atomics, one
program per (token, column block), fp32 accumulation (fp64 for fp64) and one rounding, so two runs
give the same bits. A caller that already holds the adjoint passes it in a ``RowIndex`` (the MoE
layer: its plan lists each token's K rows in k order, the order its permute's backward summed in).

Two paths with the same additions in the same order, so they agree bit for bit: Triton kernels
(moe/_kernels.py) where the MLP runs Triton, torch ops elsewhere. The torch path reads splits and
the indices on the host (as the torch backend does anyway) and raises ValueError for an index out
of [0, T); the Triton path reads nothing on the host and clamps such an index into [0, T), as it
clamps bad device splits. Both paths are torch.library custom ops: opaque to torch.compile.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ._validate import validate_index_values, validate_split_values

__all__ = ["RowIndex", "gather_rows", "routed_rows", "token_order"]


class RowIndex(NamedTuple):
    """An ``x_index`` with its adjoint already known (private: moemlp's MoE layer builds it)."""

    index: Tensor  # (M,) int32/int64, row of x of each expert-input row
    order: Tensor  # (L,) int64, expert-input rows grouped by token, each group in summation order
    offsets: Tensor  # (T + 1,) int64, token t's rows are order[offsets[t]:offsets[t + 1]]


def routed_rows(splits: Tensor, num_rows: int) -> Tensor:
    """(1,) int64 on splits' device: Σsplits with the grouped GEMM's clamping (negative counts as 0,
    a sum past M truncated at M), without a host read."""
    return splits.clamp(min=0).sum().clamp(max=num_rows).to(torch.int64).reshape(1)


def token_order(x_index: Tensor, splits: Tensor, num_tokens: int) -> tuple[Tensor, Tensor]:
    """(order (M,), offsets (T + 1,)): the routed rows stably sorted by token; no host read.
    Indices are clamped into [0, T) as the Triton forward clamps them (the torch path has already
    raised for any out of range); capacity rows get the key T and land past offsets[T]."""
    M = x_index.shape[0]
    device = x_index.device
    rows = torch.arange(M, device=device)
    token = x_index.to(torch.int64).clamp(0, max(num_tokens - 1, 0))
    key = torch.where(rows < routed_rows(splits, M), token, num_tokens)
    sorted_key, order = torch.sort(key, stable=True)  # stable: ascending i within each token
    offsets = torch.searchsorted(sorted_key, torch.arange(num_tokens + 1, device=device, dtype=torch.int64))
    return order, offsets


# --- the torch path: custom ops because they read splits and indices on the host ---------------


@torch.library.custom_op("moemlp::gather_routed_rows_torch", mutates_args=())
def _gather_routed_rows_torch(x: Tensor, x_index: Tensor, splits: Tensor) -> Tensor:
    """rows (M, H): x[x_index[i]] for the Σsplits routed rows, zeros past them; ValueError for bad
    splits or an index out of [0, T)."""
    M = x_index.shape[0]
    validate_split_values(splits, M, rows_of="x_index")
    total = int(splits.sum())
    validate_index_values(x_index, total, x.shape[0])
    rows = x.new_zeros((M, x.shape[1]))
    rows[:total] = x.index_select(0, x_index[:total])
    return rows


@_gather_routed_rows_torch.register_fake
def _(x, x_index, splits):
    return x.new_empty((x_index.shape[0], x.shape[1]))


@torch.library.custom_op("moemlp::segment_sum_rows_torch", mutates_args=())
def _segment_sum_rows_torch(src: Tensor, order: Tensor, offsets: Tensor) -> Tensor:
    """out[t] = Σ src[order[j]] over offsets[t] <= j < offsets[t+1], in j order: the additions of
    moe/_kernels.py's segment_sum_rows, so the same bits.

    Vectorised over tokens: step k adds every token's k-th row, for the tokens that have one. With
    the tokens sorted by row count (descending) those are a prefix, so the work is the M rows once
    and the launches number the largest count (K in an MoE), not the tokens."""
    T, H = offsets.shape[0] - 1, src.shape[1]
    acc_dtype = torch.float64 if src.dtype == torch.float64 else torch.float32
    acc = torch.zeros((T, H), dtype=acc_dtype, device=src.device)  # +0 start: a token no row names stays 0
    counts = offsets[1:] - offsets[:-1]
    if T and src.shape[0]:
        by_count = torch.argsort(counts, descending=True, stable=True)
        starts = offsets[:-1][by_count]
        # tokens with more than k rows, for k = 0 .. max count - 1 (one host read)
        have = (T - torch.cumsum(torch.bincount(counts), 0))[:-1].tolist()
        for k, n in enumerate(have):
            rows = order[starts[:n] + k]
            acc[:n] += src.index_select(0, rows).to(acc_dtype)
        acc = torch.empty_like(acc).index_copy_(0, by_count, acc)  # a permutation: no index written twice
    return acc.to(src.dtype)


@_segment_sum_rows_torch.register_fake
def _(src, order, offsets):
    return src.new_empty((offsets.shape[0] - 1, src.shape[1]))


# --- autograd ----------------------------------------------------------------------------------


def _segment_sum(src: Tensor, order: Tensor, offsets: Tensor, triton: bool) -> Tensor:
    if triton:
        from .moe import _kernels

        return _kernels.segment_sum_rows(src, order, offsets)
    return _segment_sum_rows_torch(src, order, offsets)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, x_index, splits, order, offsets, triton):
        ctx.save_for_backward(x_index, splits, order, offsets)
        ctx.num_tokens = x.shape[0]
        ctx.triton = triton
        if triton:
            from .moe import _kernels

            return _kernels.gather_routed_rows(x, x_index, routed_rows(splits, x_index.shape[0]))
        return _gather_routed_rows_torch(x, x_index, splits)

    @staticmethod
    def backward(ctx, d_rows):
        x_index, splits, order, offsets = ctx.saved_tensors
        if order is None:
            order, offsets = token_order(x_index, splits, ctx.num_tokens)
        return (
            _segment_sum(d_rows.contiguous(), order, offsets, ctx.triton),  # x
            None,  # x_index
            None,  # splits
            None,  # order
            None,  # offsets
            None,  # triton
        )


def gather_rows(
    x: Tensor,  # (T, H) contiguous
    x_index: Tensor,  # (M,) int32/int64 on x's device
    splits: Tensor,  # (E,) on x's device
    adjoint: Optional[tuple[Tensor, Tensor]],  # (order, offsets) of a RowIndex, or None: sorted here
    triton: bool,
) -> Tensor:
    """The (M, H) expert-input rows, differentiable in x; see the module docstring."""
    order, offsets = adjoint if adjoint is not None else (None, None)
    return _GatherRows.apply(x, x_index.contiguous(), splits, order, offsets, triton)
