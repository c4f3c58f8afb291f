"""Shared problem builders for the grouped-MLP tests: random inputs, float64 evaluations, errors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moemlp
from moemlp.activations import ACTIVATIONS

GRAD_NAMES = ("x", "probs", "fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias")


@dataclass
class Problem:
    x: torch.Tensor
    splits: torch.Tensor
    probs: torch.Tensor | None
    fc1_weight: torch.Tensor
    fc2_weight: torch.Tensor
    fc1_bias: torch.Tensor | None
    fc2_bias: torch.Tensor | None
    dy: torch.Tensor
    kwargs: dict

    def tensors(self):
        return (self.x, self.probs, self.fc1_weight, self.fc2_weight, self.fc1_bias, self.fc2_bias)

    def cast(self, dtype, probs_dtype=None):
        """The same problem in another dtype (probs keep theirs unless probs_dtype is given)."""

        def c(t, d):
            return None if t is None else t.detach().to(d).requires_grad_(t.requires_grad)

        return Problem(
            c(self.x, dtype), self.splits, c(self.probs, probs_dtype or self.probs.dtype)
            if self.probs is not None else None,
            c(self.fc1_weight, dtype), c(self.fc2_weight, dtype), c(self.fc1_bias, dtype),
            c(self.fc2_bias, dtype), self.dy.detach().to(dtype), dict(self.kwargs),
        )


def make_problem(
    splits,
    H,
    F,
    *,
    capacity=0,
    activation="swiglu",
    bias=False,
    probs_dtype=torch.float32,
    dtype=torch.bfloat16,
    device="cpu",
    seed=0,
    **kwargs,
) -> Problem:
    """Random inputs at scales where every activation is exercised on both sides of its kinks.

    Values are drawn in float64 then rounded to ``dtype``: the float64 evaluation of the same
    problem sees exactly the rounded operands.
    """
    g = torch.Generator().manual_seed(seed)
    splits_t = torch.tensor(splits, dtype=torch.int64)
    E = len(splits)
    M = int(splits_t.sum()) + capacity
    glu = ACTIVATIONS[activation].glu
    N1 = 2 * F if glu else F

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)

    x = r(M, H)
    fc1_weight = r(E, N1, H, scale=2.0 / H**0.5)
    fc2_weight = r(E, H, F, scale=1.0 / F**0.5)
    fc1_bias = r(E, N1, scale=0.5) if bias else None
    fc2_bias = r(E, H, scale=0.5) if bias else None
    probs = None
    if probs_dtype is not None:
        probs = torch.rand(M, generator=g, dtype=torch.float64).to(probs_dtype).to(device)
    dy = r(M, H)
    p = Problem(x, splits_t.to(device), probs, fc1_weight, fc2_weight, fc1_bias, fc2_bias, dy,
                dict(activation=activation, **kwargs))
    for t in p.tensors():
        if t is not None:
            t.requires_grad_(True)
    return p


def run(p: Problem, **kw):
    """Forward and every gradient through torch.autograd.grad. Returns (y, grads dict)."""
    y = moemlp.grouped_mlp(
        p.x, p.splits, p.probs, p.fc1_weight, p.fc2_weight, p.fc1_bias, p.fc2_bias,
        **{**p.kwargs, **kw},
    )
    names = [n for n, t in zip(GRAD_NAMES, p.tensors()) if t is not None]
    inputs = [t for t in p.tensors() if t is not None]
    grads = torch.autograd.grad(y, inputs, p.dy)
    return y, dict(zip(names, grads))


def run_composition(p: Problem):
    """PyTorch's own same-dtype composition (autograd through unfused ops)."""
    from moemlp.bench.peers import torch_composition

    kw = {k: v for k, v in p.kwargs.items() if k in ("activation", "activation_params",
                                                   "glu_interleave", "scale_fc2_bias")}
    y = torch_composition(p.x, p.splits, p.probs, p.fc1_weight, p.fc2_weight, p.fc1_bias,
                          p.fc2_bias, **kw)
    names = [n for n, t in zip(GRAD_NAMES, p.tensors()) if t is not None]
    inputs = [t for t in p.tensors() if t is not None]
    grads = torch.autograd.grad(y, inputs, p.dy)
    return y, dict(zip(names, grads))


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """‖a − ref‖ / ‖ref‖ in float64; NaN never passes."""
    a64, r64 = a.detach().double().cpu(), ref.detach().double().cpu()
    num = torch.linalg.vector_norm(a64 - r64)
    den = torch.linalg.vector_norm(r64)
    if not torch.isfinite(num):
        return float("inf")
    return float(num / den) if den > 0 else float(num)


class ConversionRecorder(TorchDispatchMode):
    """Records every op whose output is an fp32 tensor of the given shape made by a dtype change."""

    _CONVERSIONS = {"_to_copy", "to", "type_as", "_to_copy.default", "convert_element_type"}

    def __init__(self, shape):
        super().__init__()
        self.shape = tuple(shape)
        self.ops = []
        self.conversions = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.ops.append(name)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for o in outs:
            if (isinstance(o, torch.Tensor) and o.dtype == torch.float32
                    and tuple(o.shape) == self.shape and name in self._CONVERSIONS):
                self.conversions.append(name)
            if name == "copy_" and isinstance(args[1], torch.Tensor) and args[1].dtype != args[0].dtype \
                    and tuple(args[0].shape) == self.shape and args[0].dtype == torch.float32:
                self.conversions.append("copy_ with dtype change")
        return out
