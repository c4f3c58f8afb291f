"""The torch compositions moemlp is compared with: FC1 → activation · probs → FC2.

- ``lean_composition``: what users write (torchtitan, transformers' "grouped_mm" experts):
  ``torch._grouped_mm`` for both GEMMs, SwiGLU · probs in bf16, autograd through it all. The bench's
  main peer, eager and under ``torch.compile`` (which fuses silu · up · probs).
- ``torch_composition``: as TransformerEngine runs the block on Hopper: three ops, every intermediate
  in the compute dtype, probs rounded to it, any activation, biases; dprobs comes back through the
  compute dtype and is cast to probs.dtype at the end. The reference composition of the tests and of
  ``precision``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

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
