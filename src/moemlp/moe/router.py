"""The top-k router, in fp32 from the logits to the probabilities the grouped MLP multiplies by.

Semantics follow Megatron-Core's ``TopKRouter`` (``moe_router_dtype="fp32"``):

    logits = x.float() @ weight.T                                  (T, E) fp32, weight (E, H) fp32
    scores = softmax(logits)           score="softmax"
           = sigmoid(logits)           score="sigmoid"
    expert_idx = topk(scores + expert_bias, k)                     bias only selects (DeepSeek-V3)
    probs = scores.gather(expert_idx)                              (T, k) fp32
    probs = probs / probs.sum(-1)      normalize_topk=True         (+1e-20 for sigmoid)

Auxiliary losses, Megatron-Core's formulas, computed on this call's tokens:

    aux_loss = coeff · E / (k · T²) · Σ_e counts[e] · Σ_t s[t, e]   s = softmax(logits), or for
                                                                   sigmoid scores / their row sum
    z_loss   = coeff · mean_t logsumexp(logits[t])²

They reach the training loss the way Megatron-Core's ``MoEAuxLossAutoScaler`` does: attached to
``probs`` by an autograd function that is the identity in forward and, in backward, feeds
``loss_scale`` (default 1.0) as the gradient of each loss. ``loss.backward()`` on the main loss
therefore also minimises the aux losses; nothing has to be added by hand. Set ``loss_scale`` to the
factor the main loss is scaled by (e.g. 1/num_microbatches) to keep them in proportion. The last
values are kept, detached, in ``aux_loss`` and ``z_loss`` for logging (no host read).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["Router", "SCORES"]

SCORES = ("softmax", "sigmoid")


class _AttachLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, ``scale`` is the gradient of ``loss`` (Megatron-Core's
    MoEAuxLossAutoScaler), so the loss's own graph back-propagates into the router."""

    @staticmethod
    def forward(ctx, out: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        shape, dtype, device = ctx.loss_meta
        return (
            grad_out,  # out
            torch.full(shape, ctx.scale, dtype=dtype, device=device),  # loss
            None,  # scale
        )


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return value


def _check_coeff(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    value = float(value)
    if not (value >= 0.0 and value != float("inf")):
        raise ValueError(f"{name}: expected a finite float >= 0, got {value}")
    return value


class Router(nn.Module):
    """Linear gate (E, H) in fp32, top-k selection, fp32 probabilities.

    ``forward(x)`` with x (T, H) of any float dtype returns ``(probs, expert_idx)``: probs (T, k)
    fp32 carrying the attached aux losses, expert_idx (T, k) int64 in descending score order.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        score: str = "softmax",
        normalize_topk: bool = True,
        expert_bias: bool = False,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        device=None,
    ):
        super().__init__()
        self.hidden_size = _check_positive_int("hidden_size", hidden_size)
        self.num_experts = _check_positive_int("num_experts", num_experts)
        self.top_k = _check_positive_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k: must be <= num_experts ({num_experts}), got {top_k}")
        if score not in SCORES:
            raise ValueError(f"score: expected one of {list(SCORES)}, got {score!r}")
        if not isinstance(normalize_topk, bool):
            raise TypeError(f"normalize_topk: expected a bool, got {type(normalize_topk).__name__}")
        if not isinstance(expert_bias, bool):
            raise TypeError(f"expert_bias: expected a bool, got {type(expert_bias).__name__}")
        self.score = score
        self.normalize_topk = normalize_topk
        self.aux_loss_coeff = _check_coeff("aux_loss_coeff", aux_loss_coeff)
        self.z_loss_coeff = _check_coeff("z_loss_coeff", z_loss_coeff)
        self.loss_scale = 1.0  # gradient fed to the aux losses in backward (see module docstring)
        # fp32 whatever the model dtype: bf16 logits reorder near-tied experts and round the probs.
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=torch.float32))
        if expert_bias:
            # Selection-only bias for aux-loss-free balancing; updated by update_expert_bias(), not
            # by the optimizer.
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device))
            self.register_buffer("tokens_per_expert", torch.zeros(num_experts, device=device))
        else:
            self.expert_bias = None
            self.tokens_per_expert = None
        self.aux_loss: Optional[Tensor] = None  # last values, detached, for logging
        self.z_loss: Optional[Tensor] = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)  # Megatron-Core's init_method_std default

    def _apply(self, fn, recurse=True):
        """Module casts move the router's tensors but keep them fp32: ``model.to(torch.bfloat16)``,
        ``.half()`` and ``.bfloat16()`` would otherwise round the gate weight, and the logits with it."""

        def keep_fp32(t: Tensor) -> Tensor:
            out = fn(t)
            if t.dtype == torch.float32 and out.dtype != torch.float32 and out.is_floating_point():
                return t.to(device=out.device)  # the device move without the dtype cast
            return out

        return super()._apply(keep_fp32, recurse)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"score={self.score!r}, normalize_topk={self.normalize_topk}, "
            f"expert_bias={self.expert_bias is not None}, aux_loss_coeff={self.aux_loss_coeff}, "
            f"z_loss_coeff={self.z_loss_coeff}"
        )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"x: expected shape (T, {self.hidden_size}), got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"x: expected a floating-point tensor, got {x.dtype}")
        if x.device != self.weight.device:
            raise TypeError(f"x: expected device {self.weight.device}, got {x.device}")
        if self.weight.dtype != torch.float32:
            # Module casts (.to, .half, .bfloat16) keep the weight fp32 (_apply below); this is a
            # weight swapped in by something else, e.g. FSDP's mixed-precision parameter cast.
            raise TypeError(
                f"router.weight: the router computes in fp32 and needs an fp32 weight, got {self.weight.dtype}; "
                f"keep it fp32 (with FSDP, give the router a MixedPrecisionPolicy(param_dtype=torch.float32))"
            )
        num_tokens = x.shape[0]
        E, k = self.num_experts, self.top_k

        # Under autocast a bf16 matmul would round the logits and reorder near-tied experts.
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = x.float() @ self.weight.t()  # (T, E) fp32; x upcast exactly
        if self.score == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
        if self.expert_bias is not None:
            _, expert_idx = torch.topk(scores.detach() + self.expert_bias, k, dim=-1)
        else:
            _, expert_idx = torch.topk(scores, k, dim=-1)
        probs = scores.gather(1, expert_idx)
        if self.normalize_topk:
            denom = probs.sum(-1, keepdim=True)
            probs = probs / (denom + 1e-20 if self.score == "sigmoid" else denom)

        counts = None
        if self.aux_loss_coeff > 0 or (self.expert_bias is not None and self.training):
            # Histogram by scatter_add of ones: integer adds, exact in any order; no host sync
            # (torch.bincount on CUDA reads max() on the host).
            counts = torch.zeros(E, dtype=torch.int64, device=x.device)
            counts.scatter_add_(0, expert_idx.reshape(-1), torch.ones_like(expert_idx.reshape(-1)))
        if self.expert_bias is not None and self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self.tokens_per_expert += counts

        if self.aux_loss_coeff > 0:
            if self.score == "softmax":
                s = scores
            else:
                s = scores / (scores.sum(-1, keepdim=True) + 1e-20)
            norm = self.aux_loss_coeff * E / (k * max(num_tokens, 1) ** 2)
            aux_loss = (s.sum(0) * counts.float()).sum() * norm
            self.aux_loss = aux_loss.detach()
            probs = _AttachLoss.apply(probs, aux_loss, self.loss_scale)
        if self.z_loss_coeff > 0:
            lse = torch.logsumexp(logits, dim=-1)
            z_loss = (lse * lse).sum() * (self.z_loss_coeff / max(num_tokens, 1))
            self.z_loss = z_loss.detach()
            probs = _AttachLoss.apply(probs, z_loss, self.loss_scale)
        return probs, expert_idx

    @torch.no_grad()
    def update_expert_bias(self, update_rate: float = 1e-3, group=None) -> None:
        """DeepSeek-V3's aux-loss-free balancing step (Megatron-Core's ``get_updated_expert_bias``):
        ``bias += rate · sign(mean(counts) − counts)`` with the token counts accumulated by the
        training forwards since the last call, summed over ``group`` (pass the data-parallel group,
        which contains the expert-parallel one). Call it once per optimizer step."""
        if self.expert_bias is None:
            raise ValueError("update_expert_bias: this router was built with expert_bias=False")
        update_rate = _check_coeff("update_rate", update_rate)
        counts = self.tokens_per_expert
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        offset = counts.mean() - counts
        self.expert_bias += torch.sign(offset) * update_rate
        counts.zero_()
