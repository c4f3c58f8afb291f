"""The top-k router, in fp32 from the logits to the probabilities the grouped MLP multiplies by.

Semantics follow Megatron-Core's ``TopKRouter`` (``moe_router_dtype="fp32"``):

    logits = x.float() @ weight.T                                  (T, E) fp32, weight (E, H) fp32
    scores = softmax(logits)           score="softmax"
           = sigmoid(logits)           score="sigmoid"
    expert_idx = topk(scores + expert_bias, k)                     bias only selects (DeepSeek-V3)
    probs = scores.gather(expert_idx)                              (T, k) fp32
    probs = probs / probs.sum(-1)      normalize_topk=True         (+1e-20 for sigmoid)
    probs = probs · routed_scaling_factor                          (DeepSeek-V2/V3; default 1)

Group-limited routing (DeepSeek-V3's ``n_group`` / ``topk_group``: ``num_groups`` /
``topk_groups``): the E experts form ``num_groups`` contiguous groups of E/num_groups; each group is
scored by the sum of its two highest selection scores (``scores + expert_bias``); the top-k is then
taken only among the experts of the ``topk_groups`` best groups. Experts of the other groups are
never selected (masked with -inf, as DeepSeek-V3's inference code and Megatron-Core do;
transformers' port masks with 0.0, which differs only when every bias-corrected score of the
chosen groups is negative). The probabilities themselves are unchanged: only the selection is
limited. With expert parallelism the groups are contiguous ranges of global experts, as the ranks'
experts are: with ``num_groups`` a multiple of the EP size, group g lives on rank
g // (num_groups / W), so ``topk_groups`` bounds the number of ranks each token is sent to
(DeepSeek-V3's node-limited routing: 8 groups on 8 nodes, 4 chosen).

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

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["Router", "SharedExpertGate", "SCORES"]

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


def _autocast_off(device: torch.device):
    """Autocast off for the fp32 matmuls. Meta tensors have no autocast state (``torch.autocast("meta")``
    raises); a plain string test, since torch < 2.13's dynamo cannot trace
    ``torch.amp.is_autocast_available`` inside a fullgraph compile."""
    if device.type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


def _keeping_fp32(fn):
    """``fn`` (a module cast) that moves fp32 tensors to its device but leaves their dtype fp32."""

    def keep_fp32(t: Tensor) -> Tensor:
        out = fn(t)
        if t.dtype == torch.float32 and out.dtype != torch.float32 and out.is_floating_point():
            return t.to(device=out.device)  # the device move without the dtype cast
        return out

    return keep_fp32


def _check_fp32_weight(name: str, weight: Tensor) -> None:
    if weight.dtype != torch.float32:
        # Module casts (.to, .half, .bfloat16) keep the weight fp32 (_keeping_fp32); this is a
        # weight swapped in by something else, e.g. FSDP's mixed-precision parameter cast.
        raise TypeError(
            f"{name}: the router computes in fp32 and needs an fp32 weight, got {weight.dtype}; "
            f"keep it fp32 (with FSDP, give the router a MixedPrecisionPolicy(param_dtype=torch.float32))"
        )


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
        num_groups: Optional[int] = None,
        topk_groups: Optional[int] = None,
        routed_scaling_factor: float = 1.0,
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
        if (num_groups is None) != (topk_groups is None):
            raise ValueError(
                f"num_groups, topk_groups: give both or neither, got num_groups={num_groups!r}, "
                f"topk_groups={topk_groups!r}"
            )
        if num_groups is not None:
            _check_positive_int("num_groups", num_groups)
            _check_positive_int("topk_groups", topk_groups)
            if num_experts % num_groups:
                raise ValueError(f"num_groups: must divide num_experts ({num_experts}), got {num_groups}")
            if num_experts // num_groups < 2:
                raise ValueError(
                    f"num_groups: each group needs >= 2 experts (a group's score is the sum of its top-2 "
                    f"scores), got {num_groups} groups of {num_experts} experts"
                )
            if topk_groups > num_groups:
                raise ValueError(f"topk_groups: must be <= num_groups ({num_groups}), got {topk_groups}")
            if top_k > topk_groups * (num_experts // num_groups):
                raise ValueError(
                    f"top_k: must be <= topk_groups · experts per group = "
                    f"{topk_groups * (num_experts // num_groups)}, got {top_k}"
                )
        if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)):
            raise TypeError(f"routed_scaling_factor: expected a float, got {type(routed_scaling_factor).__name__}")
        if not (0.0 < float(routed_scaling_factor) < float("inf")):
            raise ValueError(f"routed_scaling_factor: expected a finite float > 0, got {routed_scaling_factor}")
        self.score = score
        self.normalize_topk = normalize_topk
        self.num_groups = num_groups
        self.topk_groups = topk_groups
        self.routed_scaling_factor = float(routed_scaling_factor)
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
        # The balancing state too: after ``to_empty`` (a model built on the meta device) these are
        # uninitialized memory until reset.
        if self.expert_bias is not None:
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()

    def _apply(self, fn, recurse=True):
        """Module casts move the router's tensors but keep them fp32: ``model.to(torch.bfloat16)``,
        ``.half()`` and ``.bfloat16()`` would otherwise round the gate weight, and the logits with it."""
        return super()._apply(_keeping_fp32(fn), recurse)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"score={self.score!r}, normalize_topk={self.normalize_topk}, "
            f"expert_bias={self.expert_bias is not None}, aux_loss_coeff={self.aux_loss_coeff}, "
            f"z_loss_coeff={self.z_loss_coeff}"
            + (f", num_groups={self.num_groups}, topk_groups={self.topk_groups}" if self.num_groups else "")
            + (f", routed_scaling_factor={self.routed_scaling_factor}" if self.routed_scaling_factor != 1.0 else "")
        )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"x: expected shape (T, {self.hidden_size}), got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"x: expected a floating-point tensor, got {x.dtype}")
        if x.device != self.weight.device:
            raise TypeError(f"x: expected device {self.weight.device}, got {x.device}")
        _check_fp32_weight("router.weight", self.weight)
        num_tokens = x.shape[0]
        E, k = self.num_experts, self.top_k

        # Under autocast a bf16 matmul would round the logits and reorder near-tied experts.
        with _autocast_off(x.device):
            logits = x.float() @ self.weight.t()  # (T, E) fp32; x upcast exactly
        if self.score == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
        selection = scores.detach()
        if self.expert_bias is not None:
            selection = selection + self.expert_bias
        if self.num_groups is not None:
            selection = self._limit_to_groups(selection)
        _, expert_idx = torch.topk(selection, k, dim=-1)
        probs = scores.gather(1, expert_idx)
        if self.normalize_topk:
            denom = probs.sum(-1, keepdim=True)
            probs = probs / (denom + 1e-20 if self.score == "sigmoid" else denom)
        if self.routed_scaling_factor != 1.0:
            probs = probs * self.routed_scaling_factor

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

    def _limit_to_groups(self, selection: Tensor) -> Tensor:
        """(T, E) selection scores with the experts outside each token's ``topk_groups`` best groups
        set to -inf; a group's score is the sum of its two highest selection scores (DeepSeek-V3)."""
        num_tokens = selection.shape[0]
        # (T, G, E/G), groups contiguous; the group width spelled out, so that T = 0 views too
        grouped = selection.view(num_tokens, self.num_groups, selection.shape[1] // self.num_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (T, G)
        best = group_scores.topk(self.topk_groups, dim=-1).indices  # (T, topk_groups)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(num_tokens, selection.shape[1])

    @torch.no_grad()
    def update_expert_bias(self, update_rate: float = 1e-3, group=None) -> None:
        """DeepSeek-V3's aux-loss-free balancing step (Megatron-Core's ``get_updated_expert_bias``):
        ``bias += rate · sign(mean(counts) − counts)`` with the token counts accumulated by the
        training forwards since the last call, summed over ``group`` (pass the data-parallel group,
        which contains the expert-parallel one). Call it once per optimizer step."""
        if self.expert_bias is None:
            raise ValueError("update_expert_bias: this router was built with expert_bias=False")
        update_rate = _check_coeff("update_rate", update_rate)
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group: expected a ProcessGroup or None, got {type(group).__name__}")
        counts = self.tokens_per_expert
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        offset = counts.mean() - counts
        self.expert_bias += torch.sign(offset) * update_rate
        counts.zero_()


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's shared-expert gate: ``sigmoid(x @ weight.T)``, one fp32 scale per token.

    ``weight`` (1, H) is fp32 and stays fp32 under module casts, like the router's. ``forward(x)``
    with x (T, H) of any float dtype returns (T,) fp32: the ``probs`` of the shared experts' grouped
    MLP call, which multiplies them inside the expert block in fp32 (SPEC §1) exactly as it does the
    router probabilities; its fp32 dprobs flows back into this weight.
    """

    def __init__(self, hidden_size: int, *, device=None):
        super().__init__()
        self.hidden_size = _check_positive_int("hidden_size", hidden_size)
        self.weight = nn.Parameter(torch.empty(1, hidden_size, device=device, dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def _apply(self, fn, recurse=True):
        return super()._apply(_keeping_fp32(fn), recurse)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}"

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"x: expected shape (T, {self.hidden_size}), got {tuple(x.shape)}")
        _check_fp32_weight("shared_expert_gate.weight", self.weight)
        with _autocast_off(x.device):
            return torch.sigmoid(x.float() @ self.weight.t()).view(-1)  # (T,) fp32
