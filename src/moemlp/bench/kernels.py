"""The kernel benchmarks' shared parts: the model shapes, a routed problem on them, the torch
``_grouped_mm`` composition they are timed against, and do_bench medians. Imported by the scripts
under benchmarks/ (bench_kernels.py, profile_recipe.py, profile_host.py, the quantizer sweeps)."""

from __future__ import annotations

import torch

from .._config import MLPConfig
from ..activations import ACTIVATIONS

# (H, F, E, top_k, tokens), ANCHORS.md
SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, 4096),
    "mixtral-8x7b": (4096, 14336, 8, 2, 8192),
    "deepseek-v3-ep8": (7168, 2048, 32, 8, 4096),
    "gpt-oss-120b": (2880, 2880, 128, 4, 4096),
}


def problem(H, F, E, top_k, tokens, seed=0, dtype=torch.bfloat16, device="cuda"):
    """Uniform random top-k routing, rows grouped by expert; weights scaled to unit-variance outputs."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    choice = torch.rand(tokens, E, generator=g).topk(top_k, dim=1).indices
    splits = torch.bincount(choice.flatten(), minlength=E)
    M = tokens * top_k

    def r(*s, scale):
        return (torch.randn(*s, generator=g) * scale).to(device=device, dtype=dtype)

    x = r(M, H, scale=1.0)
    w1 = r(E, 2 * F, H, scale=H**-0.5)
    w2 = r(E, H, F, scale=F**-0.5)
    probs = torch.rand(M, generator=g).to(device=device, dtype=torch.float32)
    dy = r(M, H, scale=1.0)
    return x, splits.to(device), probs, w1, w2, dy


def mlp_step(shape: str, recipe, cached: bool = False, device="cuda", tokens=None, backend="auto"):
    """One grouped_mlp forward + backward on an ANCHORS.md shape, as a function of no arguments; fresh
    gradients each call, as after ``zero_grad(set_to_none=True)`` (backward into kept ``.grad`` would
    add an accumulation kernel per leaf that a step does not run). ``cached``: the weights quantized
    once beforehand (``quantize_weights``), as a later micro-batch of an optimizer step sees them.
    ``tokens`` replaces the shape's token count."""
    from .. import quantize_weights
    from ..functional import grouped_mlp

    H, F, E, top_k, shape_tokens = SHAPES[shape]
    x, splits, probs, w1, w2 = problem(H, F, E, top_k, tokens or shape_tokens, device=device)[:5]
    x, probs, w1, w2 = (t.detach().requires_grad_() for t in (x, probs, w1, w2))
    dy = torch.randn_like(x)
    qw = quantize_weights(w1, w2, recipe) if cached else None

    def step():
        for t in (x, probs, w1, w2):
            t.grad = None
        y = grouped_mlp(x, splits, probs, w1, w2, recipe=recipe, quantized_weights=qw, backend=backend)
        y.backward(dy)

    return step


def swiglu_cfg(F):
    spec = ACTIVATIONS["swiglu"]
    return MLPConfig(spec, (), F, False)


def composition(x, splits, probs, w1, w2):
    """TransformerEngine-on-Hopper style: _grouped_mm FC1 → SwiGLU · probs (rounded) → _grouped_mm FC2."""
    offs = torch.cumsum(splits, 0).to(torch.int32)
    h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    F = w2.shape[-1]
    gate, up = h[:, :F], h[:, F:]
    z = torch.nn.functional.silu(gate) * up * probs.to(x.dtype)[:, None]
    return torch._grouped_mm(z, w2.transpose(-2, -1), offs=offs)


def bench(fn, rep=200):
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=50, rep=rep, return_mode="median"))


def rel(a, b):
    a, b = a.double(), b.double()
    return (a - b).norm().item() / max(b.norm().item(), 1e-300)
