"""Expert-parallel bookkeeping outside the forward: checkpoints across EP sizes, and the gradient
reduction of the parameters every EP rank holds in full.

Checkpoints. ``MoE.state_dict()`` on an expert-parallel rank holds that rank's E/W experts
(``experts.fc1_weight`` is (E/W, N1, H)) beside the replicated router and shared experts. The
portable form is the one-process layout, all E experts in global order:

    full = full_state_dict(model)              on every rank of every ep_group (a collective)
    if rank == 0: torch.save(full, path)
    ...                                        any EP size W' (W' = 1: no process group needed)
    load_full_state_dict(model, torch.load(path))

``full_state_dict_from_shards(model, [sd_0, …, sd_{W-1}])`` builds the same dictionary offline from
the plain ``state_dict()`` each EP rank saved (rank order), with no process group. Expert weights
are gathered along the expert dimension, so the model is the same on W' ranks for any W' that
divides E: rank r' takes experts [r'·E/W', (r'+1)·E/W').

Gradients. Each rank routes its own tokens, so the replicated parameters (``router.weight``, the
shared experts and their gate: ``MoE.replicated_parameters()``) get a gradient from this rank's
tokens only, while each expert's gradient already sums every rank's tokens (the all-to-all's
backward brings them home). ``sync_replicated_grads(model)`` all-reduces the former over each
layer's ``ep_group`` (SUM): the whole model's gradient is then that of Σ_ranks loss_rank, and EP
training equals one-process training on all ranks' tokens with the losses summed. With
``average=True`` every MoE gradient, the experts' included, is divided by W: the gradient of the
mean of the ranks' losses, as data-parallel averaging gives it. Call it after ``backward()`` and
before the optimizer step. If an outer data-parallel wrapper already all-reduces the replicated
parameters over a group containing the EP group, do not call it (they would be reduced twice);
exclude the expert weights from such a wrapper, since they differ per rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .layer import MoE

__all__ = [
    "full_state_dict",
    "full_state_dict_from_shards",
    "load_full_state_dict",
    "sync_replicated_grads",
]

_EXPERT_TENSORS = ("fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias")


def _moe_layers(module: nn.Module) -> list[tuple[str, MoE]]:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected an nn.Module, got {type(module).__name__}")
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MoE)]


def _expert_keys(name: str, moe: MoE) -> list[str]:
    prefix = f"{name}.experts." if name else "experts."
    return [prefix + t for t in _EXPERT_TENSORS if getattr(moe.experts, t) is not None]


def full_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` with every MoE layer's expert tensors gathered over its ``ep_group``
    into the one-process layout (E experts, global order), on every rank. A collective: every rank
    of each ep_group calls it. Tensors of layers without expert parallelism are returned as they are."""
    state = module.state_dict()
    for name, moe in _moe_layers(module):
        if moe.ep_group is None:
            continue
        for key in _expert_keys(name, moe):
            local = state[key].detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(moe.ep_size)]
            dist.all_gather(parts, local, group=moe.ep_group)
            state[key] = torch.cat(parts)
    return state


def full_state_dict_from_shards(module: nn.Module, shards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The one-process-layout state dict from the plain ``state_dict()`` of each of the W ranks of
    one EP group, in rank order; no process group. ``module`` names the MoE layers (any EP size:
    only its module names are used). Replicated entries are taken from ``shards[0]``."""
    if isinstance(shards, Mapping) or not isinstance(shards, Sequence) or not shards:
        raise TypeError("shards: expected a non-empty list of state dicts, one per EP rank in rank order")
    state = dict(shards[0])
    for name, moe in _moe_layers(module):
        for key in _expert_keys(name, moe):
            missing = [i for i, s in enumerate(shards) if key not in s]
            if missing:
                raise ValueError(f"shards: {key} missing from the state dicts of ranks {missing}")
            state[key] = torch.cat([s[key] for s in shards])
            if state[key].shape[0] != moe.num_experts:
                raise ValueError(
                    f"shards: {key} has {state[key].shape[0]} experts over {len(shards)} shards, "
                    f"the layer has num_experts={moe.num_experts}"
                )
    return state


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True):
    """Load a one-process-layout state dict (``full_state_dict``'s) into ``module`` at its own EP
    size: each MoE layer takes its experts [offset, offset + E/W) of every expert tensor. No
    communication. Returns ``module.load_state_dict``'s result."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict: expected a mapping, got {type(state_dict).__name__}")
    local = dict(state_dict)
    for name, moe in _moe_layers(module):
        for key in _expert_keys(name, moe):
            if key not in local:
                continue  # load_state_dict reports it under strict=True
            full = local[key]
            if not isinstance(full, Tensor) or full.dim() == 0 or full.shape[0] != moe.num_experts:
                got = tuple(full.shape) if isinstance(full, Tensor) else type(full).__name__
                raise ValueError(
                    f"state_dict: {key} expected {moe.num_experts} experts along dim 0 (the full "
                    f"layout of full_state_dict), got {got}"
                )
            local[key] = full.narrow(0, moe.local_expert_offset, moe.num_local_experts)
    return module.load_state_dict(local, strict=strict)


def _grad_of(p: nn.Parameter) -> Tensor:
    """The tensor holding p's gradient: ``.grad``, else a ``main_grad`` (accumulate_into_main_grad);
    zeros where backward left none, so that every rank takes part in the same collectives."""
    if p.grad is not None:
        return p.grad
    main = getattr(p, "main_grad", None)
    if main is not None:
        return main
    p.grad = torch.zeros_like(p)
    return p.grad


@torch.no_grad()
def sync_replicated_grads(module: nn.Module, *, average: bool = False) -> None:
    """All-reduce (SUM) the gradients of every MoE layer's replicated parameters over its
    ``ep_group``; with ``average=True`` divide all of the layer's gradients, experts' included, by
    the group size. One all-reduce per layer and gradient dtype, over a flat copy (fixed order).
    Layers without expert parallelism are left alone (unless ``average``: W = 1 divides by 1)."""
    if not isinstance(average, bool):
        raise TypeError(f"average: expected a bool, got {type(average).__name__}")
    for _, moe in _moe_layers(module):
        if moe.ep_group is None:
            continue
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in moe.replicated_parameters():
            g = _grad_of(p)
            by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=moe.ep_group)
            if average:
                flat /= moe.ep_size
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        if average:
            for p in moe.experts.parameters():
                g = p.grad if p.grad is not None else getattr(p, "main_grad", None)
                if g is not None:
                    g /= moe.ep_size
