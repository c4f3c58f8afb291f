"""Dispatch and combine on one device: (token, k) slots sorted by expert, rows gathered into expert
order, expert outputs summed back per token.

Everything here runs on the device without a host read (CUDA-graph capturable):

    sorted_expert, perm = sort(expert_idx.flatten(), stable)     stable: ties keep (t, k) order
    splits[e]  = #slots with expert <= e  −  #slots with expert < e      (searchsorted, no bincount:
                 torch.bincount on CUDA reads max() on the host)
    src_token  = perm // K          row i of the permuted batch copies token src_token[i]
    row_of     = perm⁻¹ as (T, K)   permuted row of each (token, k) slot

Permute and unpermute are adjoint gathers, so neither direction needs a scatter or an atomic:

    permute    x_perm[i] = x[src_token[i]]             backward: dx[t] = Σ_k g[row_of[t, k]]
    unpermute  y[t] = Σ_k y_perm[row_of[t, k]]         backward: dy_perm[i] = dy[src_token[i]]

The k-sum runs in k order in fp32 (fp64 for fp64) with one rounding per output element: the
combine is deterministic and the Triton kernels (_kernels.py) and the torch path agree bit for bit.
The router probabilities travel beside the rows in fp32 (``permute_probs``) and are applied inside
the grouped MLP, whose fp32 dprobs come back through the same bijection.

On one device (``local_moe_forward``) the permute is not materialised: grouped_mlp gathers
x[src_token[i]] itself (``x_index = row_index(plan)``) and sums dx over row_of in k order, the
additions of permute's backward, so the results are the same bits. The expert-parallel path (ep.py)
still permutes: its rows leave for other ranks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .._x_index import RowIndex

__all__ = [
    "DispatchPlan",
    "plan_dispatch",
    "plan_dispatch_with_capacity",
    "expert_capacity",
    "DROP_POLICIES",
    "permute",
    "permute_probs",
    "row_index",
    "unpermute",
    "shuffle_rows",
    "use_triton",
    "local_dispatch",
    "local_combine",
    "local_moe_forward",
]

BACKENDS = ("auto", "torch", "triton")
DROP_POLICIES = ("probs", "position")


class DispatchPlan(NamedTuple):
    """M = T·K rows (plan_dispatch); plan_dispatch_with_capacity may lay out another M."""

    splits: Tensor  # (E,) int64, rows per expert, on the device
    src_token: Tensor  # (M,) int64, token copied into each permuted row
    perm: Tensor  # (M,) int64, flat slot t·K + k of each permuted row
    row_of: Tensor  # (T, K) int64, permuted row of each (token, k) slot


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(backend: str, device: torch.device) -> bool:
    """Whether the dispatch gathers run as Triton kernels: on CUDA unless backend="torch"; on CPU
    only for backend="triton" under TRITON_INTERPRET=1 (the CPU suite's way to run kernel code)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return False
    if device.type == "cuda":
        return True
    if backend == "triton":
        if not _interpreting():
            raise ValueError("backend: 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 on CPU")
        return True
    return False


def plan_dispatch(expert_idx: Tensor, num_experts: int) -> DispatchPlan:
    """Sort the (T, K) expert choices by expert; see the module docstring."""
    num_tokens, top_k = expert_idx.shape
    flat = expert_idx.reshape(-1)
    sorted_expert, perm = torch.sort(flat, stable=True)
    experts = torch.arange(num_experts, device=flat.device, dtype=sorted_expert.dtype)
    ends = torch.searchsorted(sorted_expert, experts, right=True)
    splits = torch.diff(ends, prepend=ends.new_zeros(1))
    src_token = torch.div(perm, top_k, rounding_mode="floor")
    rows = torch.arange(flat.numel(), device=flat.device, dtype=perm.dtype)
    # perm is a permutation: each index written once, so the scatter is deterministic.
    row_of = torch.empty_like(perm).scatter_(0, perm, rows).view(num_tokens, top_k)
    return DispatchPlan(splits, src_token, perm, row_of)


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows each expert keeps: ceil(T·k / E · capacity_factor), Megatron-Core's ``get_capacity``;
    a host int from shapes, never from data."""
    return math.ceil((num_tokens * top_k / num_experts) * capacity_factor)


def plan_dispatch_with_capacity(
    expert_idx: Tensor,  # (T, K) int64
    probs: Tensor,  # (T, K) the router probabilities (only their order is used, under "probs")
    num_experts: int,
    capacity: int,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> DispatchPlan:
    """Like ``plan_dispatch``, with at most ``capacity`` rows per expert (Megatron-Core's token
    dropping). No host read; the row count M is a host int from shapes.

    Which (token, k) slots an expert keeps: ``drop_policy="probs"``, the ``capacity`` slots of
    highest probability (ties: the earlier token); ``"position"``, its first ``capacity`` slots in
    token order. Kept rows come first, grouped by expert in token order (with nothing dropped,
    the plan of ``plan_dispatch``); ``splits`` counts only them. The dropped slots' rows lie past
    Σsplits, the capacity rows of grouped_mlp: their outputs and gradients are 0, so a dropped slot
    adds 0 to its token and gets 0 gradient, its probability included.

    M = T·K rows, the dropped ones at the end; with ``pad_to_capacity``, M = E·capacity + 1: every
    expert's capacity is reserved (Megatron-Core's ``moe_pad_expert_input_to_capacity``: a shape that
    does not depend on the routing), and the one row past E·capacity, never an expert's, is the zero
    row every dropped slot reads its output from (E·capacity may be fewer than the dropped slots).
    Rows past Σsplits gather token 0 and probability 0's slot; grouped_mlp does not read them.
    """
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy: expected one of {list(DROP_POLICIES)}, got {drop_policy!r}")
    num_tokens, top_k = expert_idx.shape
    flat = expert_idx.reshape(-1)
    device = flat.device
    num_slots = flat.numel()
    slots = torch.arange(num_slots, device=device, dtype=torch.int64)
    experts = torch.arange(num_experts, device=device, dtype=flat.dtype)

    # Rank of every slot among its expert's slots, in the policy's order.
    if drop_policy == "probs":
        # Stable sorts: by probability (descending), then by expert; ties keep slot = token order.
        by_prob = torch.sort(probs.detach().reshape(-1), descending=True, stable=True).indices
        ranked = by_prob[torch.sort(flat[by_prob], stable=True).indices]
    else:
        ranked = torch.sort(flat, stable=True).indices
    ranked_expert = flat[ranked]
    first = torch.searchsorted(ranked_expert, experts)  # (E,) first ranked slot of each expert
    rank = torch.empty_like(slots).scatter_(0, ranked, slots - first[ranked_expert])  # a bijection
    keep = rank < capacity

    # Kept slots grouped by expert (slot order inside), then the dropped ones: key E sorts last.
    key = torch.where(keep, flat, torch.full_like(flat, num_experts))
    sorted_key, perm = torch.sort(key, stable=True)
    ends = torch.searchsorted(sorted_key, experts, right=True)
    splits = torch.diff(ends, prepend=ends.new_zeros(1))
    row_of = torch.empty_like(perm).scatter_(0, perm, slots)
    if pad_to_capacity and num_slots:  # no tokens: no slot to read a zero row, and no token to gather
        num_rows = num_experts * capacity + 1
        # Kept rows (< E·capacity + 1 <= num_rows) keep their place; the rest are capacity rows.
        if num_rows <= num_slots:
            perm = perm[:num_rows]
        else:
            perm = torch.cat((perm, perm.new_zeros(num_rows - num_slots)))
        row_of = torch.where(keep, row_of, torch.full_like(row_of, num_experts * capacity))
    src_token = torch.div(perm, top_k, rounding_mode="floor")
    return DispatchPlan(splits, src_token, perm, row_of.view(num_tokens, top_k))


# --- the two gathers, torch and Triton ----------------------------------------------------------


def _gather(src: Tensor, index: Tensor, triton: bool) -> Tensor:
    if triton and src.dim() == 2:
        from . import _kernels

        return _kernels.gather_rows(src.contiguous(), index)
    return src.index_select(0, index)


def _gather_sum(src: Tensor, index: Tensor, triton: bool) -> Tensor:
    """out[t] = Σ_k src[index[t, k]], fp32 (fp64) accumulation in k order, one rounding."""
    if triton:
        from . import _kernels

        return _kernels.gather_sum_rows(src.contiguous(), index)
    acc_dtype = torch.float64 if src.dtype == torch.float64 else torch.float32
    acc = _cast(src.index_select(0, index[:, 0]), acc_dtype)
    for k in range(1, index.shape[1]):  # K (top_k) launches, not a per-token loop
        acc = acc + _cast(src.index_select(0, index[:, k]), acc_dtype)
    return _cast(acc, src.dtype)


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``, without the no-op ``t.to(t.dtype)``. torch 2.11's dynamo drops the
    gradient of an autograd.Function whose forward returns such an alias of an intermediate: the
    compiled backward then hands zeros to everything before it (tests/test_compile.py)."""
    return t if t.dtype == dtype else t.to(dtype)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, src_token: Tensor, row_of: Tensor, triton: bool) -> Tensor:
        ctx.save_for_backward(src_token, row_of)
        ctx.triton = triton
        return _gather(x, src_token, triton)

    @staticmethod
    def backward(ctx, grad_perm: Tensor):
        src_token, row_of = ctx.saved_tensors
        return (
            _gather_sum(grad_perm.contiguous(), row_of, ctx.triton),  # x
            None,  # src_token
            None,  # row_of
            None,  # triton
        )


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_perm: Tensor, row_of: Tensor, src_token: Tensor, triton: bool) -> Tensor:
        ctx.save_for_backward(src_token, row_of)
        ctx.triton = triton
        return _gather_sum(y_perm, row_of, triton)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        src_token, row_of = ctx.saved_tensors
        return (
            _gather(grad_y.contiguous(), src_token, ctx.triton),  # y_perm
            None,  # row_of
            None,  # src_token
            None,  # triton
        )


class _Shuffle(torch.autograd.Function):
    """out = src[index] for a bijection ``index``; backward gathers by ``inverse`` (no scatter)."""

    @staticmethod
    def forward(ctx, src: Tensor, index: Tensor, inverse: Tensor, triton: bool) -> Tensor:
        ctx.save_for_backward(inverse, index)
        ctx.triton = triton
        return _gather(src, index, triton)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        inverse, _ = ctx.saved_tensors
        return (
            _gather(grad_out.contiguous(), inverse, ctx.triton),  # src
            None,  # index
            None,  # inverse
            None,  # triton
        )


def permute(x: Tensor, plan: DispatchPlan, triton: bool = False) -> Tensor:
    """(T, H) tokens -> (T·K, H) rows grouped by expert."""
    return _Permute.apply(x, plan.src_token, plan.row_of, triton)


def permute_probs(probs: Tensor, plan: DispatchPlan) -> Tensor:
    """(T, K) fp32 router probabilities -> (T·K,) fp32 beside the permuted rows; never rounded."""
    return _Shuffle.apply(probs.reshape(-1), plan.perm, plan.row_of.reshape(-1), False)


def row_index(plan: DispatchPlan) -> RowIndex:
    """plan.src_token as grouped_mlp's ``x_index``, with the adjoint the plan already holds: row_of
    lists each token's K rows in k order, so dx sums them in the order permute's backward does
    (the same bits) and no sort runs."""
    num_tokens, top_k = plan.row_of.shape
    offsets = torch.arange(num_tokens + 1, device=plan.row_of.device, dtype=torch.int64) * top_k
    return RowIndex(plan.src_token, plan.row_of.reshape(-1), offsets)


def unpermute(y_perm: Tensor, plan: DispatchPlan, triton: bool = False) -> Tensor:
    """(T·K, H) expert outputs (already scaled by probs) -> (T, H), summed over k in k order."""
    return _Unpermute.apply(y_perm, plan.row_of, plan.src_token, triton)


def shuffle_rows(src: Tensor, index: Tensor, inverse: Tensor, triton: bool = False) -> Tensor:
    """src[index] for a bijection, with a gather (by ``inverse``) as its backward."""
    return _Shuffle.apply(src, index, inverse, triton)


# experts(x, splits, probs, x_index=None) -> y rows: with x_index (a RowIndex) x holds the tokens and
# the experts gather their rows (grouped_mlp's x_index); without, x holds the rows grouped by expert.
ExpertsFn = Callable[..., Tensor]


class LocalState(NamedTuple):
    """What the combine needs from the dispatch."""

    plan: DispatchPlan
    triton: bool


def local_dispatch(
    x: Tensor,  # (T, H)
    probs: Tensor,  # (T, K) fp32
    expert_idx: Tensor,  # (T, K) int64
    num_experts: int,
    triton: bool,
    plan: Optional[DispatchPlan] = None,
) -> tuple[Tensor, Tensor, Tensor, LocalState]:
    """Returns (x_perm (M, H), splits (E,), probs_perm (M,) fp32, state); no host read. M = T·K, or
    what ``plan`` (e.g. from plan_dispatch_with_capacity) lays out; by default plan_dispatch's."""
    if plan is None:
        plan = plan_dispatch(expert_idx, num_experts)
    x_perm = permute(x, plan, triton)
    probs_perm = permute_probs(probs, plan)
    return x_perm, plan.splits, probs_perm, LocalState(plan, triton)


def local_combine(y_perm: Tensor, state: LocalState) -> Tensor:
    """(T·K, H) expert outputs -> (T, H)."""
    return unpermute(y_perm, state.plan, state.triton)


def local_moe_forward(
    x: Tensor,  # (T, H)
    probs: Tensor,  # (T, K) fp32
    expert_idx: Tensor,  # (T, K) int64
    num_experts: int,
    experts: ExpertsFn,  # (x, splits, probs_perm, x_index) -> y_perm
    triton: bool,
    plan: Optional[DispatchPlan] = None,
) -> tuple[Tensor, DispatchPlan]:
    """Dispatch -> experts -> combine on one device; no host read. ``plan``: see local_dispatch. The
    experts gather their input rows from x through ``row_index(plan)``: the permuted copy of x is
    never made here."""
    if plan is None:
        plan = plan_dispatch(expert_idx, num_experts)
    probs_perm = permute_probs(probs, plan)
    y_perm = experts(x, plan.splits, probs_perm, row_index(plan))
    return unpermute(y_perm, plan, triton), plan
