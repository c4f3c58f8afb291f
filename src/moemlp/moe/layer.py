"""MoE: router -> dispatch -> grouped MLP -> combine, on one device or expert-parallel."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..modules import GroupedMLP
from .dispatch import (
    BACKENDS,
    DROP_POLICIES,
    expert_capacity,
    local_moe_forward,
    plan_dispatch_with_capacity,
    use_triton,
)
from .ep import check_same_options, ep_failure_exchange, expert_parallel_moe_forward
from .router import Router, SharedExpertGate, _check_positive_int

__all__ = ["MoE"]


def _recipe_key(recipe) -> Optional[str]:
    """A recipe name or object as the key both spell alike (ranks may give either)."""
    from ..recipes import resolve_recipe

    r = resolve_recipe(recipe)
    return None if r is None else r.key


class MoE(nn.Module):
    """A Mixture-of-Experts feed-forward layer with fp32 routing probabilities end to end.

    ``y = moe(x)`` with x (T, H) or (B, S, H) returns y of the same shape and dtype:

        probs, expert_idx = router(x)           fp32 (T, k), see moemlp.moe.router
        rows sorted by expert on the device     no host sync on one device
        y_rows = experts(x, splits, probs,      moemlp.grouped_mlp: gathers its rows from x
                         x_index)               (x_index; with ep_group the rows are permuted and
                                                sent instead); the router probability multiplies
                                                inside the expert block, in fp32
        y[t] = Σ_k y_rows[row of (t, k)]        fixed k order, fp32 accumulation, no atomics

        y     += shared_experts(x) [· sigmoid(shared_expert_gate(x))]    with num_shared_experts > 0;
                                                on CUDA on a side stream, overlapping all of the above

    Submodules: ``router`` (``router.weight`` (E, H) fp32, replicated on every rank),
    ``experts`` (a ``GroupedMLP`` holding this rank's E/W experts; all E without ``ep_group``) and,
    with shared experts, ``shared_experts`` (a one-expert ``GroupedMLP`` of FFN size
    num_shared_experts · shared_expert_ffn_hidden_size, replicated) and ``shared_expert_gate``.
    Replicated parameters see only this rank's tokens: with ``ep_group``, reduce their gradients with
    ``moemlp.moe.sync_replicated_grads`` before the optimizer step.

    Args:
        hidden_size, ffn_hidden_size: H and F of each expert.
        num_experts: E, over all expert-parallel ranks together.
        top_k: experts per token, <= E.
        activation, activation_params, recipe, backend: passed to the grouped MLP;
            ``backend`` also picks the dispatch gathers (Triton on CUDA for "auto").
        score: "softmax" or "sigmoid" router scores.
        normalize_topk: divide the k selected probabilities by their sum.
        expert_bias: a selection-only bias for aux-loss-free balancing (DeepSeek-V3), updated
            by ``router.update_expert_bias(rate, group)`` once per optimizer step.
        aux_loss_coeff, z_loss_coeff: Megatron-Core's load-balancing and z losses; they are
            attached to the graph and reach the parameters through the main loss's
            ``backward()`` (Megatron-Core's MoEAuxLossAutoScaler); values in ``router.aux_loss``
            and ``router.z_loss`` for logging.
        ep_group: a torch.distributed process group of size W for expert parallelism; E must
            be divisible by W; rank r holds experts [r·E/W, (r+1)·E/W), drawn from a generator of
            their own (seed every rank alike: the router is replicated). Construction is collective
            (one all_gather of the options: ranks that differ get a ValueError). Every rank routes its
            own tokens. The row counts are read on the host once per forward (all_to_all_single
            takes Python ints): the one host sync, and only with W > 1.
        recompute_fc1: the experts keep only their input rows for backward and run FC1 again
            there (moemlp.grouped_mlp's option): saves the (T·k, 2F) pre-activation.
        accumulate_into_main_grad: expert weight gradients are computed in fp32 and added into
            ``experts.fc1_weight.main_grad`` / ``fc2_weight.main_grad`` (fp32 tensors the caller
            attaches, as Megatron-Core's DDP does) instead of ``.grad``; with shared experts, also
            ``shared_experts.fc1_weight`` / ``fc2_weight``'s. Frozen weights need none. The router
            weight is fp32 already; its gradient goes to ``.grad`` as usual.
        num_groups, topk_groups: group-limited routing (DeepSeek-V3's ``n_group``, ``topk_group``):
            top-k only among the experts of each token's ``topk_groups`` best groups of
            E/num_groups contiguous experts, a group scored by the sum of its top-2 (bias-corrected)
            scores. With ``ep_group``, groups are contiguous expert ranges like the ranks' shards;
            num_groups a multiple of W puts whole groups on ranks, and ``topk_groups`` then bounds the
            ranks a token is sent to. See moemlp.moe.router.
        routed_scaling_factor: multiplies the final routed probabilities (DeepSeek-V2/V3), inside
            the grouped MLP's fp32 probability path like the probabilities themselves.
        num_shared_experts: always-on experts run on every token beside the routed ones (DeepSeek-V2/V3,
            Qwen2-MoE, Qwen3-Next); 0 = none. Held as one expert of FFN size
            num_shared_experts · shared_expert_ffn_hidden_size (the same function as that many
            experts summed: DeepSeek-V3 builds it the same way) and run by one grouped_mlp call
            with splits = [T] on the layer's input, same activation, recipe and backend.
        shared_expert_ffn_hidden_size: F of one shared expert (default: ffn_hidden_size).
        shared_expert_gate: scale the shared experts' output per token by sigmoid(x @ w), w (1, H)
            fp32 (Qwen2-MoE); the scale goes in as the grouped MLP's ``probs``: multiplied in fp32
            inside the fused expert block, exactly like the router probabilities.
        shared_expert_overlap: on CUDA, run the shared experts on a side stream (default off: on the
            H200 it made the deepseek-v3-like layer 10 % slower, since the routed experts' persistent
            kernels already hold every SM and the two streams' kernels then queue behind each other;
            docs/DECISIONS.md). The side stream is issued
            before the router, so that they overlap the routing, the dispatch, the routed experts and,
            with ``ep_group``, the all-to-all and its host sync; their backward runs on that stream
            too (autograd runs each op's backward on its forward's stream) and overlaps the routed
            experts' backward. The results are the bits of ``False`` (one stream), forward and every
            gradient: the layer input's gradient from the router, the routed and the shared experts
            is summed in one fixed order whatever order autograd runs the branches in. No effect on
            the CPU, without shared experts, under ``torch.compile`` (one stream), or when autograd
            is on and x does not require grad (the shared experts' backward then has no point where
            it joins the main stream, so they run on it).
        capacity_factor: None (default) drops nothing. Otherwise each expert keeps at most
            C = ceil(T·k / E · capacity_factor) of this call's (token, k) slots (Megatron-Core's
            ``moe_expert_capacity_factor``; C is a host int from shapes, so no host sync); a dropped
            slot adds 0 to its token and gets 0 gradient, its probability included. The other slots'
            probabilities are not renormalised; aux losses and expert-bias counts see the routing
            before dropping. With ``ep_group`` each rank drops from its own tokens (C from its T) and
            sends only the kept rows.
        drop_policy: which slots an over-full expert keeps: "probs" (the highest probabilities,
            ties to the earlier token) or "position" (the earliest tokens); Megatron-Core's
            ``moe_token_drop_policy``.
        pad_to_capacity: the experts' input is E·C + 1 rows whatever the routing (Megatron-Core's
            ``moe_pad_expert_input_to_capacity``): a static shape; the padding rows are grouped_mlp's
            capacity rows (past Σsplits), which are not computed. Needs ``capacity_factor``; one
            device only (the all-to-all sizes stay data-dependent with ``ep_group``).
        device, dtype: of the expert weights; x must have this dtype. The router is fp32.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int,
        activation: str = "swiglu",
        activation_params: Optional[Mapping[str, float]] = None,
        score: str = "softmax",
        normalize_topk: bool = True,
        expert_bias: bool = False,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        recipe=None,
        ep_group=None,
        backend: str = "auto",
        recompute_fc1: bool = False,
        accumulate_into_main_grad: bool = False,
        num_groups: Optional[int] = None,
        topk_groups: Optional[int] = None,
        routed_scaling_factor: float = 1.0,
        num_shared_experts: int = 0,
        shared_expert_ffn_hidden_size: Optional[int] = None,
        shared_expert_gate: bool = False,
        shared_expert_overlap: bool = False,
        capacity_factor: Optional[float] = None,
        drop_policy: str = "probs",
        pad_to_capacity: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        for name, flag in (("recompute_fc1", recompute_fc1), ("accumulate_into_main_grad", accumulate_into_main_grad)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
        _check_positive_int("hidden_size", hidden_size)
        _check_positive_int("ffn_hidden_size", ffn_hidden_size)
        _check_positive_int("num_experts", num_experts)
        _check_positive_int("top_k", top_k)
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
        ep_size, ep_rank = 1, 0
        if ep_group is not None:
            if not dist.is_available() or not dist.is_initialized():
                raise ValueError("ep_group: torch.distributed is not initialized")
            if not isinstance(ep_group, dist.ProcessGroup):
                raise TypeError(f"ep_group: expected a ProcessGroup or None, got {type(ep_group).__name__}")
            ep_size, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
            if num_experts % ep_size:
                raise ValueError(
                    f"num_experts: must be divisible by the ep_group size {ep_size}, got {num_experts}"
                )
        if isinstance(num_shared_experts, bool) or not isinstance(num_shared_experts, int):
            raise TypeError(f"num_shared_experts: expected an int, got {type(num_shared_experts).__name__}")
        if num_shared_experts < 0:
            raise ValueError(f"num_shared_experts: expected an int >= 0, got {num_shared_experts}")
        if shared_expert_ffn_hidden_size is not None:
            _check_positive_int("shared_expert_ffn_hidden_size", shared_expert_ffn_hidden_size)
        if not isinstance(shared_expert_gate, bool):
            raise TypeError(f"shared_expert_gate: expected a bool, got {type(shared_expert_gate).__name__}")
        if not isinstance(shared_expert_overlap, bool):
            raise TypeError(f"shared_expert_overlap: expected a bool, got {type(shared_expert_overlap).__name__}")
        if num_shared_experts == 0 and (
            shared_expert_gate or shared_expert_ffn_hidden_size is not None
        ):
            raise ValueError(
                "num_shared_experts: shared_expert_gate / shared_expert_ffn_hidden_size "
                "need num_shared_experts >= 1, got 0"
            )
        if capacity_factor is not None:
            if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
                raise TypeError(f"capacity_factor: expected None or a float, got {type(capacity_factor).__name__}")
            if not (0.0 < float(capacity_factor) < math.inf):
                raise ValueError(f"capacity_factor: expected None or a finite float > 0, got {capacity_factor}")
            capacity_factor = float(capacity_factor)
        if not isinstance(drop_policy, str):
            raise TypeError(f"drop_policy: expected a str, got {type(drop_policy).__name__}")
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy: expected one of {list(DROP_POLICIES)}, got {drop_policy!r}")
        if not isinstance(pad_to_capacity, bool):
            raise TypeError(f"pad_to_capacity: expected a bool, got {type(pad_to_capacity).__name__}")
        if pad_to_capacity and capacity_factor is None:
            raise ValueError("pad_to_capacity: needs a capacity_factor (None drops nothing and pads nothing)")
        if pad_to_capacity and ep_size > 1:
            raise ValueError(
                f"pad_to_capacity: one device only (the expert-parallel path sends the kept rows), got an "
                f"ep_group of size {ep_size}"
            )
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.backend = backend
        self.recompute_fc1 = recompute_fc1
        self.accumulate_into_main_grad = accumulate_into_main_grad
        self.ep_group = ep_group if ep_size > 1 else None
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.local_expert_offset = ep_rank * self.num_local_experts  # first global expert held here
        self.router = Router(
            hidden_size,
            num_experts,
            top_k,
            score=score,
            normalize_topk=normalize_topk,
            expert_bias=expert_bias,
            aux_loss_coeff=aux_loss_coeff,
            z_loss_coeff=z_loss_coeff,
            num_groups=num_groups,
            topk_groups=topk_groups,
            routed_scaling_factor=routed_scaling_factor,
            device=device,
        )
        # Routed and shared experts run the same fused path with the same options.
        mlp_options = dict(
            hidden_size=hidden_size,
            activation=activation,
            activation_params=activation_params,
            recipe=recipe,
            backend=backend,
            recompute_fc1=recompute_fc1,
            accumulate_into_main_grad=accumulate_into_main_grad,
            device=device,
            dtype=dtype,
        )
        # Under expert parallelism every rank seeds alike (its router replica must match), so drawn as
        # one layer's would be each rank's experts would be the same values: they are drawn once, from a
        # stream of their own (built on the meta device, then given storage).
        self.experts = GroupedMLP(num_experts=self.num_local_experts, ffn_hidden_size=ffn_hidden_size,
                                  **{**mlp_options, "device": "meta" if ep_size > 1 else device})
        self.experts._owner = "experts."
        if ep_size > 1:
            self.experts.init_offset = self.local_expert_offset
            self.experts.to_empty(device=torch.get_default_device() if device is None else device)
            self.experts.reset_parameters()
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy
        self.pad_to_capacity = pad_to_capacity
        self.num_shared_experts = num_shared_experts
        self.shared_expert_ffn_hidden_size = shared_expert_ffn_hidden_size or ffn_hidden_size
        if num_shared_experts:
            self.shared_experts = GroupedMLP(
                num_experts=1, ffn_hidden_size=num_shared_experts * self.shared_expert_ffn_hidden_size, **mlp_options
            )
            self.shared_experts._owner = "shared_experts."
        else:
            self.shared_experts = None
        self.shared_expert_gate = SharedExpertGate(hidden_size, device=device) if shared_expert_gate else None
        self.shared_expert_overlap = shared_expert_overlap
        if ep_size > 1:
            check_same_options(ep_group, dict(
                num_experts=num_experts, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size, top_k=top_k,
                dtype=str(self.experts.fc1_weight.dtype), activation=activation,
                activation_params=dict(activation_params or {}), score=score, normalize_topk=normalize_topk,
                expert_bias=expert_bias, num_groups=num_groups, topk_groups=topk_groups,
                routed_scaling_factor=float(routed_scaling_factor), capacity_factor=capacity_factor,
                drop_policy=drop_policy, num_shared_experts=num_shared_experts,
                shared_expert_ffn_hidden_size=self.shared_expert_ffn_hidden_size,
                shared_expert_gate=shared_expert_gate, recipe=_recipe_key(recipe),
            ))

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The parameters every expert-parallel rank holds in full (router, shared experts, their
        gate), in a fixed order: what ``sync_replicated_grads`` reduces over ``ep_group``."""
        params = [self.router.weight]
        for module in (self.shared_experts, self.shared_expert_gate):
            if module is not None:
                params.extend(p for p in module.parameters())
        return params

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, ep_size={self.ep_size}, "
            f"local_experts=[{self.local_expert_offset}, "
            f"{self.local_expert_offset + self.num_local_experts}), backend={self.backend!r}"
            + (f", capacity_factor={self.capacity_factor}, drop_policy={self.drop_policy!r}, "
               f"pad_to_capacity={self.pad_to_capacity}" if self.capacity_factor is not None else "")
        )

    def forward(self, x: Tensor, is_first_microbatch: Optional[bool] = None) -> Tensor:
        """y of x's shape. ``is_first_microbatch`` goes to the experts (``GroupedMLP.forward``): under
        a recipe, True quantizes the expert weights and keeps them for the step's later micro-batches,
        which pass False; None quantizes in every call."""
        if self.ep_group is None:
            return self._forward(x, is_first_microbatch)
        # A rank that raises before the row exchange (its input, its router) still joins the
        # counts exchange, flagged, so the other ranks raise too instead of waiting out the
        # group's timeout (moemlp.moe.ep).
        with ep_failure_exchange(self.ep_group, self.num_experts, self.experts.fc1_weight.device):
            return self._forward(x, is_first_microbatch)

    def _forward(self, x: Tensor, is_first_microbatch: Optional[bool]) -> Tensor:
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise TypeError(f"is_first_microbatch: expected None or a bool, got {type(is_first_microbatch).__name__}")

        def run_experts(rows: Tensor, splits: Tensor, probs: Tensor, x_index=None) -> Tensor:
            return self.experts(rows, splits, probs, is_first_microbatch=is_first_microbatch, x_index=x_index)

        if not isinstance(x, Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() not in (2, 3) or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"x: expected shape (T, {self.hidden_size}) or (B, S, {self.hidden_size}), "
                f"got {tuple(x.shape)}"
            )
        weight = self.experts.fc1_weight
        if x.dtype != weight.dtype:
            raise TypeError(f"x: expected dtype {weight.dtype} (the experts' dtype), got {x.dtype}")
        if x.device != weight.device:
            raise TypeError(f"x: expected a tensor on {weight.device} (the experts' device), got {x.device}")
        tokens = x.reshape(-1, self.hidden_size).contiguous()  # copies only a non-contiguous x
        triton = use_triton(self.backend, tokens.device)
        router_tokens = routed_tokens = shared_tokens = tokens
        side = shared = None
        if self.shared_experts is not None:
            side = self._side_stream(tokens)
            router_tokens, routed_tokens, shared_tokens = _ForkTokens.apply(tokens, side)
        if side is not None:
            # Issued first: nothing on the main stream waits for the shared experts until the add.
            # _ForkTokens made the side stream wait for tokens and kept tokens' memory for it.
            with torch.cuda.stream(side):
                shared = self._shared_forward(shared_tokens, is_first_microbatch)
        probs, expert_idx = self.router(router_tokens)
        plan = None
        if self.capacity_factor is not None:
            # This rank's tokens: with ep_group each rank drops from its own T, as Megatron-Core does.
            capacity = expert_capacity(tokens.shape[0], self.top_k, self.num_experts, self.capacity_factor)
            plan = plan_dispatch_with_capacity(
                expert_idx, probs, self.num_experts, capacity, self.drop_policy, self.pad_to_capacity
            )
        if self.ep_group is None:
            y, _ = local_moe_forward(routed_tokens, probs, expert_idx, self.num_experts, run_experts, triton, plan=plan)
        else:
            y = expert_parallel_moe_forward(
                routed_tokens, probs, expert_idx, self.num_experts, run_experts, self.ep_group, triton, plan=plan
            )
        if side is not None:
            main = torch.cuda.current_stream(tokens.device)
            main.wait_stream(side)
            shared.record_stream(main)  # made on the side stream, read here: not reused before the add ran
        elif self.shared_experts is not None:
            shared = self._shared_forward(shared_tokens, is_first_microbatch)
        if shared is not None:
            y = y + shared
        return y.view(x.shape)

    def _side_stream(self, tokens: Tensor):
        """The stream the shared experts run on, or None for the caller's stream: see
        ``shared_expert_overlap`` for when."""
        if not (self.shared_expert_overlap and tokens.is_cuda) or torch.compiler.is_compiling():
            return None
        if torch.is_grad_enabled() and not tokens.requires_grad:
            # The side stream's backward joins the main stream in _ForkTokens' backward, which runs
            # only for an input that needs a gradient.
            return None
        return _side_stream(tokens.device.index if tokens.device.index is not None else torch.cuda.current_device())

    def _shared_forward(self, tokens: Tensor, is_first_microbatch: Optional[bool]) -> Tensor:
        """Every token through the shared experts: one grouped_mlp call, one expert, splits = [T]
        (a device tensor filled from the shape: no host sync), probs = the gate's fp32 sigmoid or None."""
        splits = torch.full((1,), tokens.shape[0], dtype=torch.int64, device=tokens.device)
        gate = self.shared_expert_gate(tokens) if self.shared_expert_gate is not None else None
        return self.shared_experts(tokens, splits, gate, is_first_microbatch=is_first_microbatch)


@functools.cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    """One side stream per device for every MoE layer's shared experts: layers run one after the other,
    and each joins the side stream back into the main one before it returns (forward) or before its
    input gradient is used (backward)."""
    return torch.cuda.Stream(device=device_index)


class _ForkTokens(torch.autograd.Function):
    """The layer input, handed to its three consumers (router, routed experts, shared experts) as three
    aliases, so that its gradient is their three gradients summed in an order fixed here.

    Left to autograd, the gradients of one tensor with several consumers are added in the order the
    engine runs the consumers' backward, which follows the order the forward created them in. With the
    shared experts issued before the routed ones (the side stream) that order changes, and in bf16
    (a + b) + c is not a + (b + c): on one CPU stream, merely issuing the shared experts first changed
    30% of a bf16 layer's dx elements. Here the sum is (shared + routed) + router whatever the issue
    order, the order autograd took with the shared experts issued last (it runs the last-created
    backward first), so the one-stream layer keeps its bits. Inside the shared alias there are at most
    two terms (the experts' and the gate's), whose sum does not depend on their order.

    With a side stream: forward makes it wait for the layer input and keeps the input's memory from
    being reused before the side stream's reads (forward and backward) are done; backward runs on the
    main stream (the forward's) and waits for the side stream, so everything the shared experts'
    backward wrote (dx, the gate's gradient, an fp32 main_grad) is ordered before what comes next."""

    @staticmethod
    def forward(ctx, tokens: Tensor, side):
        ctx.side = side
        ctx.set_materialize_grads(False)  # a missing gradient adds nothing (not a -0 turned into +0)
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(tokens.device))
            tokens.record_stream(side)
        return tokens.view_as(tokens), tokens.view_as(tokens), tokens.view_as(tokens)

    @staticmethod
    def backward(ctx, d_router, d_routed, d_shared):
        if ctx.side is not None:
            torch.cuda.current_stream(ctx.side.device).wait_stream(ctx.side)
        dx = None
        for d in (d_shared, d_routed, d_router):  # the fixed order, see the class docstring
            if d is not None:
                dx = d if dx is None else dx + d
        return (
            dx,  # tokens
            None,  # side
        )
