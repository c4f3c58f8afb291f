"""Expert parallelism over torch.distributed: each rank routes its own tokens, sends every row to
the rank holding its expert, runs its local experts, and sends the results back.

With W ranks and E experts, rank r holds experts [r·E/W, (r+1)·E/W). On each rank:

    plan      = plan_dispatch(expert_idx, E)           rows sorted by global expert, hence by rank
    counts    all_to_all of splits (W, E/W) + status   recv[w, e]: rows from rank w for local e;
                                                       recv[w, E/W]: rank w's status (below)
    host read the per-rank row counts                  all_to_all_single needs them as ints: the
                                                       one host sync, inherent to EP
    x, probs  all_to_all (rows, and fp32 probs beside them; probs never rounded)
    regroup   (source rank, expert) order -> (expert, source rank) order: a bijective gather
    experts   grouped MLP on the local experts, splits = recv.sum(0)
    back      the inverse gather, all_to_all back, unpermute (k-ordered sum)

Every step is an autograd function whose backward runs the adjoint communication, so dx, the
router gradient (through the probs) and the local experts' gradients (from every rank's tokens)
come out of one ``backward()``. Collectives are issued in the same order on every rank (the graph
is the same on every rank), which NCCL and gloo require.

A rank that fails must not hang the others:

- before the row exchange (bad input, the router, the sort): the counts message carries one more
  column, the sender's status. A rank that raised there still joins the counts exchange, with its
  status set (``ep_failure_exchange``, entered by ``MoE.forward``), and re-raises its own error;
  the others see the status in the host read they make anyway and raise ``ExpertParallelError``.
  No collective is left half-issued, so the group stays usable, and the healthy path pays W more
  int64 in a message it already sends: no extra collective, no extra host sync.
- after it (the experts, the combine, backward): the others are inside an all-to-all that the
  failed rank will not join. They fail when the process group's timeout expires
  (``init_process_group(timeout=)`` / ``new_group(timeout=)``; gloo raises, NCCL's watchdog
  aborts the communicator). Such a group is unusable afterwards, as torch.distributed says of any
  timed-out collective. Telling them sooner would need a flag read on the host after the experts:
  a second sync on every healthy forward.

Teardown: import moemlp before ``init_process_group`` (see the import below), release every
layer, graph and traceback that holds the group, then ``destroy_process_group()``: the group's
worker threads are then joined while the interpreter is alive. A gloo worker thread that outlives
it can drop the last reference to a finished all-to-all's tensors during interpreter shutdown,
take the GIL there and abort the process (tests/moe/test_ep.py has the details and the check).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

# Not used here. torch.distributed.nn.functional writes ``group=group.WORLD`` as default arguments:
# imported after init_process_group (torch._dynamo imports it, and moemlp's first grouped_mlp call
# imports torch._dynamo), its functions keep the default group alive past destroy_process_group,
# and with it the group's worker threads, which can then abort the process at exit (gloo: a worker
# dropping a finished all-to-all's tensors takes the GIL during interpreter shutdown). Imported
# with moemlp, before any group exists, those defaults are None.
if dist.is_available():
    import torch.distributed.nn.functional  # noqa: F401
from torch import Tensor

from .dispatch import (
    DispatchPlan,
    ExpertsFn,
    permute,
    permute_probs,
    plan_dispatch,
    shuffle_rows,
    unpermute,
)

__all__ = [
    "ExpertParallelError",
    "check_same_options",
    "all_to_all",
    "ep_dispatch",
    "ep_combine",
    "ep_failure_exchange",
    "expert_parallel_moe_forward",
]


class ExpertParallelError(RuntimeError):
    """Another rank of the expert-parallel group raised before the row exchange."""


class _AllToAll(torch.autograd.Function):
    """Rows to other ranks (``all_to_all_single``); backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x: Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group) -> Tensor:
        ctx.group = group
        ctx.splits = (list(output_splits), list(input_splits))
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        output_splits, input_splits = ctx.splits
        return (
            _all_to_all(grad_out, input_splits, output_splits, ctx.group),  # x
            None,  # output_splits
            None,  # input_splits
            None,  # group
        )


def _all_to_all(x: Tensor, output_splits, input_splits, group) -> Tensor:
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(
        out, x.contiguous(), list(output_splits), list(input_splits), group=group
    )
    return out


def all_to_all(x: Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group) -> Tensor:
    """Autograd-aware ``all_to_all_single`` along dim 0."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


def _regroup_index(recv_counts: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """Gather indices between the received order and the local-expert order.

    recv_counts (W, E_local): chunk (w, e) holds recv_counts[w, e] rows, chunks in (w, e) order.
    Returns ``local_from_recv`` (row j of the (e, w)-ordered batch is received row
    local_from_recv[j]) and its inverse ``recv_from_local``.
    """
    W, E_local = recv_counts.shape
    device = recv_counts.device
    sizes_we = recv_counts.reshape(-1)
    starts_we = torch.cumsum(sizes_we, 0) - sizes_we  # (W·E_local,) in (w, e) order
    sizes_ew = recv_counts.t().reshape(-1)
    ends_ew = torch.cumsum(sizes_ew, 0)
    starts_ew = ends_ew - sizes_ew
    rows = torch.arange(num_rows, device=device, dtype=torch.int64)
    chunk_ew = torch.searchsorted(ends_ew, rows, right=True)  # (e, w) chunk of each local row
    e, w = chunk_ew // W, chunk_ew % W
    local_from_recv = starts_we[w * E_local + e] + (rows - starts_ew[chunk_ew])
    recv_from_local = torch.empty_like(local_from_recv).scatter_(0, local_from_recv, rows)
    return local_from_recv, recv_from_local


# --- failures before the row exchange ------------------------------------------------------------

_STATUS_OK, _STATUS_FAILED = 0, 1


class ep_failure_exchange:
    """Context manager around one expert-parallel forward on this rank: if the block raises before
    this rank has entered the counts exchange, it joins that exchange with its status column set
    (so the other ranks raise ``ExpertParallelError`` instead of waiting for the timeout) and lets
    the error propagate. Nothing runs on the healthy path but two ContextVar writes."""

    def __init__(self, group, num_experts: int, device: torch.device):
        self.group = group
        self.num_experts = num_experts
        self.device = device  # the counts travel here: CUDA for NCCL, the CPU for gloo
        self.reached_exchange = False
        self._outer: Optional[ep_failure_exchange] = None
        self._token = None

    def __enter__(self) -> ep_failure_exchange:
        self._outer = _ACTIVE_EXCHANGE.get()
        self._token = _ACTIVE_EXCHANGE.set(self)
        return self

    def _mark_reached(self) -> None:
        """This forward's counts exchange is issued: no guard around it may issue another."""
        guard = self
        while guard is not None:
            guard.reached_exchange = True
            guard = guard._outer

    def __exit__(self, exc_type, exc, tb) -> bool:
        _ACTIVE_EXCHANGE.reset(self._token)
        if exc_type is not None and not self.reached_exchange:
            self._mark_reached()
            try:
                _announce_failure(self.group, self.num_experts, self.device)
            except Exception as announce_error:  # the rank's own error is the one to report
                if hasattr(exc, "add_note"):
                    exc.add_note(f"moemlp: telling the other EP ranks failed too: {announce_error!r}")
        return False  # the rank's own error propagates


_ACTIVE_EXCHANGE: ContextVar[Optional[ep_failure_exchange]] = ContextVar("moemlp_ep_exchange", default=None)


def _announce_failure(group, num_experts: int, device: torch.device) -> None:
    """This rank's side of the counts exchange when it cannot dispatch: no rows, status failed."""
    W = dist.get_world_size(group)
    status = torch.zeros(W, num_experts // W + 1, dtype=torch.int64, device=device)
    status[:, -1] = _STATUS_FAILED
    dist.all_to_all_single(torch.empty_like(status), status, group=group)


def _exchange_counts(send_counts: Tensor, group, grads: int = 0) -> tuple[Tensor, list[int], list[int]]:
    """(W, E_local) rows this rank sends per (rank, local expert) -> (recv_counts (W, E_local),
    send_rows, recv_rows): the counts all_to_all and the one host read, with every rank's status.
    ``grads``: which of the exchanged rows' tensors need a gradient here (bit 0: x, bit 1: probs),
    riding in the status above its failure bit: the exchanges' backward runs only where they do, so
    ranks that disagree would pair their collectives wrongly."""
    W, E_local = send_counts.shape
    active = _ACTIVE_EXCHANGE.get()
    if active is not None:
        active._mark_reached()  # from here on a failure cannot be announced, only timed out
    status = torch.full((W, 1), _STATUS_OK | grads << 1, dtype=send_counts.dtype, device=send_counts.device)
    send = torch.cat((send_counts, status), 1)
    recv = torch.empty_like(send)
    # The counts travel on the device of the process group's backend (CPU for gloo, CUDA for NCCL).
    dist.all_to_all_single(recv, send, group=group)
    recv_counts = recv[:, :E_local]
    # The one host sync: all_to_all_single takes its split sizes as Python ints. The senders'
    # status rides along in the same read.
    host = torch.cat((send_counts.sum(1), recv_counts.sum(1), recv[:, E_local])).tolist()
    send_rows, recv_rows, statuses = host[:W], host[W : 2 * W], host[2 * W :]
    failed = [w for w, s in enumerate(statuses) if s & _STATUS_FAILED]
    if failed:
        raise ExpertParallelError(
            f"expert parallelism: rank(s) {failed} of the ep_group raised before the row exchange "
            f"(their own errors are in their processes); no rows were exchanged, the group is still usable"
        )
    flags = [s >> 1 for s in statuses]
    if len(set(flags)) > 1:
        what = [", ".join(n for b, n in ((1, "x"), (2, "probs")) if f & b) or "nothing" for f in flags]
        raise ValueError(
            f"expert parallelism: the ranks disagree on which inputs need a gradient (rank order: {what}); every "
            f"rank's backward must run the same exchanges. No rows were exchanged, the group is still usable"
        )
    return recv_counts, send_rows, recv_rows


def check_same_options(group, options: dict) -> None:
    """At construction: every rank of the ep_group built the same layer (one all_gather_object).
    Rows of another width or dtype would break the exchange or be misread, and other options would
    give each rank another function; a ValueError on every rank names what differs."""
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, options, group=group)
    differ = {k: [o.get(k) for o in every] for k in options if any(o.get(k) != options[k] for o in every)}
    if differ:
        raise ValueError(
            "ep_group: the ranks built different MoE layers (values in rank order): "
            + "; ".join(f"{k} {v}" for k, v in differ.items())
        )


class EPState(NamedTuple):
    """What the combine needs from the dispatch."""

    plan: DispatchPlan
    send_rows: list[int]  # rows this rank sends to each rank
    recv_rows: list[int]  # rows this rank receives from each rank
    local_from_recv: Tensor  # (M_local,) received row of each local-expert-ordered row
    recv_from_local: Tensor  # its inverse
    group: object
    triton: bool


def ep_dispatch(
    x: Tensor,  # (T, H) this rank's tokens
    probs: Tensor,  # (T, K) fp32
    expert_idx: Tensor,  # (T, K) int64, global expert ids
    num_experts: int,  # E, all ranks together
    group,
    triton: bool,
    plan: Optional[DispatchPlan] = None,
) -> tuple[Tensor, Tensor, Tensor, EPState]:
    """Returns (x_local (M, H), splits (E/W,), probs_local (M,) fp32, state): the rows this rank's
    experts process, grouped by local expert. ``plan``: by default plan_dispatch's; a
    plan_dispatch_with_capacity plan (without padding) sends only its Σsplits kept rows: the
    dropped ones stay here and come back as zeros."""
    W = dist.get_world_size(group)
    E_local = num_experts // W
    with ep_failure_exchange(group, num_experts, expert_idx.device):  # covers callers without one
        if plan is None:
            plan = plan_dispatch(expert_idx, num_experts)
        x_perm = permute(x, plan, triton)  # rows sorted by expert = by destination rank
        probs_perm = permute_probs(probs, plan)
        grads = int(x.requires_grad) | int(probs.requires_grad) << 1 if torch.is_grad_enabled() else 0
        recv_counts, send_rows, recv_rows = _exchange_counts(plan.splits.view(W, E_local), group, grads)
    if sum(send_rows) != x_perm.shape[0]:  # a capacity plan: the dropped rows past Σsplits stay home
        x_perm, probs_perm = x_perm[: sum(send_rows)], probs_perm[: sum(send_rows)]

    x_recv = all_to_all(x_perm, recv_rows, send_rows, group)
    probs_recv = all_to_all(probs_perm, recv_rows, send_rows, group)
    local_from_recv, recv_from_local = _regroup_index(recv_counts, sum(recv_rows))
    x_local = shuffle_rows(x_recv, local_from_recv, recv_from_local, triton)
    probs_local = shuffle_rows(probs_recv, local_from_recv, recv_from_local)
    state = EPState(plan, send_rows, recv_rows, local_from_recv, recv_from_local, group, triton)
    return x_local, recv_counts.sum(0), probs_local, state


def ep_combine(y_local: Tensor, state: EPState) -> Tensor:
    """(M, H) local expert outputs -> (T, H) this rank's tokens."""
    y_recv = shuffle_rows(y_local, state.recv_from_local, state.local_from_recv, state.triton)
    y_perm = all_to_all(y_recv, state.send_rows, state.recv_rows, state.group)
    dropped = state.plan.src_token.shape[0] - y_perm.shape[0]
    if dropped:  # the rows a capacity plan kept home: their outputs are 0
        y_perm = torch.cat((y_perm, y_perm.new_zeros((dropped,) + tuple(y_perm.shape[1:]))))
    return unpermute(y_perm, state.plan, state.triton)


def expert_parallel_moe_forward(
    x: Tensor,  # (T, H) this rank's tokens
    probs: Tensor,  # (T, K) fp32
    expert_idx: Tensor,  # (T, K) int64, global expert ids
    num_experts: int,  # E, all ranks together
    experts: ExpertsFn,  # this rank's experts: (x_local, splits (E_local,), probs_local) -> y_local
    group,
    triton: bool,
    plan: Optional[DispatchPlan] = None,
) -> Tensor:
    x_local, splits, probs_local, state = ep_dispatch(x, probs, expert_idx, num_experts, group, triton, plan)
    return ep_combine(experts(x_local, splits, probs_local), state)
