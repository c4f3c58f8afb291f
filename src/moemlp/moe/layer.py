"""MoE: router -> dispatch -> grouped MLP -> combine, on one device or expert-parallel."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch.distributed as dist
from torch import Tensor, nn

from ..modules import GroupedMLP
from .dispatch import BACKENDS, local_moe_forward, use_triton
from .ep import ep_failure_exchange, expert_parallel_moe_forward
from .router import Router, _check_positive_int

__all__ = ["MoE"]


class MoE(nn.Module):
    """A Mixture-of-Experts feed-forward layer with fp32 routing probabilities end to end.

    ``y = moe(x)`` with x (T, H) or (B, S, H) returns y of the same shape and dtype:

        probs, expert_idx = router(x)           fp32 (T, k), see moemlp.moe.router
        rows sorted by expert on the device     no host sync on one device
        y_rows = experts(rows, splits, probs)   moemlp.grouped_mlp: the router probability
                                                multiplies inside the expert block, in fp32
        y[t] = Σ_k y_rows[row of (t, k)]        fixed k order, fp32 accumulation, no atomics

    Submodules: ``router`` (``router.weight`` (E, H) fp32, replicated on every rank) and
    ``experts`` (a ``GroupedMLP`` holding this rank's E/W experts; all E without ``ep_group``).

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
            be divisible by W; rank r holds experts [r·E/W, (r+1)·E/W). Every rank routes its
            own tokens. The row counts are read on the host once per forward (all_to_all_single
            takes Python ints): the one host sync, and only with W > 1.
        recompute_fc1: the experts keep only their input rows for backward and run FC1 again
            there (moemlp.grouped_mlp's option): saves the (T·k, 2F) pre-activation.
        accumulate_into_main_grad: expert weight gradients are computed in fp32 and added into
            ``experts.fc1_weight.main_grad`` / ``fc2_weight.main_grad`` (fp32 tensors the caller
            attaches, as Megatron-Core's DDP does) instead of ``.grad``. The router weight is
            fp32 already; its gradient goes to ``.grad`` as usual.
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
            device=device,
        )
        self.experts = GroupedMLP(
            num_experts=self.num_local_experts,
            hidden_size=hidden_size,
            ffn_hidden_size=ffn_hidden_size,
            activation=activation,
            activation_params=activation_params,
            recipe=recipe,
            backend=backend,
            recompute_fc1=recompute_fc1,
            accumulate_into_main_grad=accumulate_into_main_grad,
            device=device,
            dtype=dtype,
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, ep_size={self.ep_size}, "
            f"local_experts=[{self.local_expert_offset}, "
            f"{self.local_expert_offset + self.num_local_experts}), backend={self.backend!r}"
        )

    def forward(self, x: Tensor, is_first_microbatch: Optional[bool] = None) -> Tensor:
        """y of x's shape. ``is_first_microbatch`` goes to the experts (``GroupedMLP.forward``): under
        fp8_block, True quantizes the expert weights and keeps them for the step's later micro-batches,
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

        def run_experts(rows: Tensor, splits: Tensor, probs: Tensor) -> Tensor:
            return self.experts(rows, splits, probs, is_first_microbatch=is_first_microbatch)

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
        probs, expert_idx = self.router(tokens)
        if self.ep_group is None:
            y, _ = local_moe_forward(tokens, probs, expert_idx, self.num_experts, run_experts, triton)
        else:
            y = expert_parallel_moe_forward(
                tokens, probs, expert_idx, self.num_experts, run_experts, self.ep_group, triton
            )
        return y.view(x.shape)
