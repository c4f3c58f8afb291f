"""The torch compositions moemlp is compared with: FC1 → activation · probs → FC2.

- ``lean_composition``: what users write (torchtitan, transformers' "grouped_mm" experts):
  ``torch._grouped_mm`` for both GEMMs, SwiGLU · probs in bf16, autograd through it all. The bench's
  main peer, eager and under ``torch.compile`` (which fuses silu · up · probs).
- ``torch_composition``: as TransformerEngine runs the block on Hopper: three ops, every intermediate
  in the compute dtype, probs rounded to it, any activation, biases; dprobs comes back through the
  compute dtype and is cast to probs.dtype at the end. The reference composition of the tests and of
  ``precision``.
- ``LeanMoE``: the whole MoE layer as users write it around ``lean_composition``: moemlp's own Router
  (so the routing is the same function), a stable argsort permute, the composition, unpermute and a
  sum over k. ``bench --moe``'s peer.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import Tensor, nn

from ..activations import resolve_activation
from ..reference import _split_glu


def _grouped_mm_ok(x: Tensor) -> bool:
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


def _grouped_linear(t: Tensor, w: Tensor, splits: Tensor, offs: Optional[Tensor]) -> Tensor:
    """t (M, K) @ w[e]^T per expert; torch._grouped_mm on Hopper, a per-expert loop elsewhere."""
    if offs is not None:
        return torch._grouped_mm(t, w.transpose(-2, -1), offs=offs)
    outs, start = [], 0
    for e, n in enumerate(splits.tolist()):
        outs.append(t[start : start + n] @ w[e].transpose(0, 1))
        start += n
    outs.append(t.new_zeros(t.shape[0] - start, w.shape[1]))  # capacity rows
    return torch.cat(outs)


def _bias_rows(bias: Tensor, splits: Tensor, num_rows: int) -> Tensor:
    """(E, K) per-expert bias -> (M, K) per row, 0 on capacity rows. No host read."""
    offsets = torch.cumsum(splits.to(bias.device), 0)
    rows = torch.arange(num_rows, device=bias.device)
    expert = torch.searchsorted(offsets, rows, right=True)
    valid = (expert < splits.numel())[:, None]
    return torch.where(valid, bias[expert.clamp(max=splits.numel() - 1)], 0)


def torch_composition(
    x: Tensor,
    splits: Tensor,
    probs: Optional[Tensor],
    fc1_weight: Tensor,
    fc2_weight: Tensor,
    fc1_bias: Optional[Tensor] = None,
    fc2_bias: Optional[Tensor] = None,
    *,
    activation: str = "swiglu",
    activation_params=None,
    glu_interleave: Optional[int] = None,
    scale_fc2_bias: bool = False,
) -> Tensor:
    """Differentiable (by autograd) unfused composition, every intermediate in x.dtype."""
    spec, params = resolve_activation(activation, activation_params)
    offs = torch.cumsum(splits, 0).to(torch.int32) if _grouped_mm_ok(x) else None
    h = _grouped_linear(x, fc1_weight, splits, offs)
    if fc1_bias is not None:
        h = h + _bias_rows(fc1_bias, splits, x.shape[0])
    if spec.glu:
        gate, up = _split_glu(h, glu_interleave or fc2_weight.shape[-1])
        a = spec.fn(gate, up, *params)
    else:
        a = spec.fn(h, *params)
    p = probs.to(x.dtype)[:, None] if probs is not None else None  # rounded, as TE does on Hopper
    z = a * p if p is not None else a
    y = _grouped_linear(z, fc2_weight, splits, offs)
    if fc2_bias is not None:
        b2 = _bias_rows(fc2_bias, splits, x.shape[0])
        y = y + (b2 * p if (scale_fc2_bias and p is not None) else b2)
    return y


def lean_composition(x: Tensor, splits: Tensor, probs: Optional[Tensor], fc1_weight: Tensor,
                     fc2_weight: Tensor) -> Tensor:
    """SwiGLU grouped MLP as users write it, all in x.dtype (probs rounded to it)::

        h = _grouped_mm(x, W1ᵀ, offs); gate, up = h.chunk(2, -1)
        y = _grouped_mm(silu(gate) · up · probs[:, None], W2ᵀ, offs)

    ``torch._grouped_mm`` where torch has it for these tensors (bf16; CUDA needs sm_90), else a
    per-expert loop of the same products. offs is computed on the device (no host read)."""
    if hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16 and (
        not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] >= 9
    ):
        offs = torch.cumsum(splits, 0).to(torch.int32)

        def mm(t, w):
            return torch._grouped_mm(t, w.transpose(-2, -1), offs=offs)
    else:

        def mm(t, w):
            return _grouped_linear(t, w, splits, None)

    gate, up = mm(x, fc1_weight).chunk(2, dim=-1)
    z = torch.nn.functional.silu(gate) * up
    if probs is not None:
        z = z * probs.to(x.dtype)[:, None]
    return mm(z, fc2_weight)


class LeanMoE(nn.Module):
    """The MoE layer as users write it in torch (transformers' "grouped_mm" experts, torchtitan)::

        probs, expert_idx = router(tokens)                 moemlp's Router: the same fp32 routing
        perm   = argsort(expert_idx.flatten(), stable)     slot t·k + j of each expert-sorted row
        splits = histc(expert_idx, E bins)                 no host sync (bincount on CUDA has one)
        y_rows = lean_composition(tokens[perm // k], splits, probs.flatten()[perm], W1, W2)
        y      = y_rows[argsort(perm)].view(T, k, H).sum(1)          probs already applied (bf16)
        y     += lean_composition(tokens, [T], None, shared W1, W2)  with a shared expert

    Gathers are index_select (their backward an index_add). The sum over k reads bf16 rows and
    accumulates in fp32 (torch's reduction), one rounding. ``from_moe`` copies a moemlp ``MoE``'s
    router and weights, so both layers compute the same function up to lean_composition's bf16
    roundings of silu · up and of probs."""

    def __init__(self, router: nn.Module, fc1_weight: Tensor, fc2_weight: Tensor,
                 shared_fc1_weight: Optional[Tensor] = None, shared_fc2_weight: Optional[Tensor] = None):
        super().__init__()
        self.router = router
        self.fc1_weight = nn.Parameter(fc1_weight)  # (E, 2F, H)
        self.fc2_weight = nn.Parameter(fc2_weight)  # (E, H, F)
        if (shared_fc1_weight is None) != (shared_fc2_weight is None):
            raise ValueError("shared_fc1_weight, shared_fc2_weight: give both or neither")
        self.shared_fc1_weight = None if shared_fc1_weight is None else nn.Parameter(shared_fc1_weight)  # (1, 2Fs, H)
        self.shared_fc2_weight = None if shared_fc2_weight is None else nn.Parameter(shared_fc2_weight)  # (1, H, Fs)

    @classmethod
    def from_moe(cls, moe) -> LeanMoE:
        """A copy of a one-device swiglu ``moemlp.MoE`` without biases, capacity or a shared-expert
        gate (what bench --moe builds): its router (deep-copied: same weights, buffers and options)
        and its expert weights, cloned."""
        experts, shared = moe.experts, moe.shared_experts
        unsupported = [
            name for name, bad in (
                ("ep_group", moe.ep_group is not None),
                ("activation", experts.activation != "swiglu"),
                ("glu_interleave", experts.glu_interleave is not None),
                ("biases", experts.fc1_bias is not None),
                ("recipe", experts.recipe is not None),
                ("capacity_factor", moe.capacity_factor is not None),
                ("shared_expert_gate", moe.shared_expert_gate is not None),
            ) if bad
        ]
        if unsupported:
            raise ValueError(f"moe: LeanMoE copies a plain swiglu layer on one device; this one has {unsupported}")

        def clone(t):
            return t.detach().clone()

        return cls(
            copy.deepcopy(moe.router),
            clone(experts.fc1_weight),
            clone(experts.fc2_weight),
            clone(shared.fc1_weight) if shared is not None else None,
            clone(shared.fc2_weight) if shared is not None else None,
        )

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs, expert_idx = self.router(tokens)  # (T, k) fp32, (T, k) int64
        num_tokens, top_k = expert_idx.shape
        num_experts = self.fc1_weight.shape[0]
        flat = expert_idx.reshape(-1)
        perm = torch.argsort(flat, stable=True)
        # bins [e, e + 1): exact for integer experts; counts exact in fp32 below 2^24 rows
        splits = torch.histc(flat.float(), bins=num_experts, min=0, max=num_experts).to(torch.int64)
        rows = tokens.index_select(0, perm // top_k)
        y_rows = lean_composition(rows, splits, probs.reshape(-1).index_select(0, perm), self.fc1_weight,
                                  self.fc2_weight)
        y = y_rows.index_select(0, torch.argsort(perm)).view(num_tokens, top_k, -1).sum(1)
        if self.shared_fc1_weight is not None:
            everyone = torch.full((1,), num_tokens, dtype=torch.int64, device=tokens.device)
            y = y + lean_composition(tokens, everyone, None, self.shared_fc1_weight, self.shared_fc2_weight)
        return y.view(x.shape)
