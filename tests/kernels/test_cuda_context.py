"""A launch from a thread with no CUDA context current (kernels/_cuda_context.py).

PyTorch's autograd worker thread for device 0 can reach a moemlp launch with no context current:
when its first launch is a kernel that another thread already loaded (``recompute_fc1`` re-runs FC1
in the backward), triton's host TMA descriptor encoding failed there with "invalid device context".
Each case launches a kernel on this thread, then the same kernel first thing on a new thread, checks
that no context was current there before the launch (what makes the case meaningful) and that the
result is the same bits."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from moemlp import grouped_mlp
from moemlp._config import MLPConfig
from moemlp.activations import ACTIVATIONS
from moemlp.bench.common import Shape, routed_problem

SHAPE = Shape("ctx", 256, 128, 8, 2, 512)


def _on_fresh_thread(fn):
    """fn() on a new thread; (whether a context was current there before fn, fn's result)."""
    out = {}

    def run():
        ctx = ctypes.c_void_p()
        ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(ctx))
        out["had_context"] = bool(ctx.value)
        try:
            out["result"] = fn()
            torch.cuda.synchronize()
        except BaseException as err:  # handed to the test's thread
            out["error"] = err

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if "error" in out:
        raise out["error"]
    return out["had_context"], out["result"]


@pytest.mark.gpu
def test_triton_fc1_on_a_fresh_thread():
    from moemlp.kernels import operands

    x, splits, probs, w1, _, _ = routed_problem(SHAPE, "cuda")
    M, H, F = SHAPE.rows, SHAPE.hidden, SHAPE.ffn
    cfg = MLPConfig(ACTIVATIONS["swiglu"], (), F, False)
    (W1,) = operands.weights((w1,), None)

    def fc1():
        h = torch.full((M, 2 * F), float("nan"), dtype=x.dtype, device="cuda")
        z = torch.full((M, F), float("nan"), dtype=x.dtype, device="cuda")
        operands.gemm("fc1", x, W1, splits=splits, out=h, z=z, probs=probs, N=F, K=H, N1=2 * F, cfg=cfg)
        return h, z

    h, z = fc1()
    had_context, (h_t, z_t) = _on_fresh_thread(fc1)
    assert not had_context
    assert torch.equal(h_t, h) and torch.equal(z_t, z)


@pytest.mark.gpu
def test_gluon_gemm_on_a_fresh_thread():
    from moemlp.kernels import gluon

    if gluon.why_unavailable():
        pytest.skip(gluon.why_unavailable())
    x, splits, _, w1, _, _ = routed_problem(SHAPE, "cuda")
    out = gluon.grouped_gemm(x, w1, splits)
    had_context, out_t = _on_fresh_thread(lambda: gluon.grouped_gemm(x, w1, splits))
    assert not had_context
    assert torch.equal(out_t, out)


@pytest.mark.gpu
def test_recompute_fc1_backward_after_a_forward():
    # The user-level case: a forward on this thread loads FC1; the backward recomputes FC1 on autograd's
    # worker thread. Gradients are compared with the stored-h backward's, which they equal bit for bit.
    x, splits, probs, w1, w2, dy = routed_problem(SHAPE, "cuda")
    leaves = [t.requires_grad_() for t in (x, probs, w1, w2)]
    with torch.no_grad():
        grouped_mlp(x, splits, probs, w1, w2)
    stored = torch.autograd.grad(grouped_mlp(x, splits, probs, w1, w2), leaves, dy)
    recomputed = torch.autograd.grad(grouped_mlp(x, splits, probs, w1, w2, recompute_fc1=True), leaves, dy)
    for a, b in zip(recomputed, stored):
        assert torch.equal(a, b)
