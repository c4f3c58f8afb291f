"""The torch backend on a CUDA device: same semantics as on the CPU (SPEC §1 on any device)."""

import pytest
import torch

import moemlp
from _cases import make_problem, rel_err, run

pytestmark = pytest.mark.gpu


def test_torch_backend_on_cuda_matches_cpu():
    p = make_problem([130, 0, 77, 201], 256, 128, capacity=7, bias=True, seed=30, scale_fc2_bias=True)
    y_cpu, g_cpu = run(p, backend="torch")
    pc = p.cast(torch.bfloat16)
    pc.x, pc.probs, pc.fc1_weight, pc.fc2_weight, pc.fc1_bias, pc.fc2_bias = (
        t.detach().cuda().requires_grad_() for t in pc.tensors())
    pc.splits, pc.dy = p.splits.cuda(), p.dy.cuda()
    y, g = run(pc, backend="torch")
    # Same fp32-accumulated formulas; only the summation order of the matmuls differs by device.
    assert rel_err(y, y_cpu) < 4e-3
    for name in g_cpu:
        assert rel_err(g[name], g_cpu[name]) < 4e-3, name
    assert g["probs"].dtype == torch.float32


@pytest.mark.long(seconds=40)
def test_inductor_compile_on_cuda():
    p = make_problem([64, 0, 50], 128, 64, seed=31)
    args = [t.detach().cuda().requires_grad_() for t in p.tensors() if t is not None]
    splits, dy = p.splits.cuda(), p.dy.cuda()

    def f(x, probs, w1, w2):
        return moemlp.grouped_mlp(x, splits, probs, w1, w2)

    y = f(*args)
    yc = torch.compile(f, fullgraph=True)(*args)
    assert torch.equal(y, yc)
    g = torch.autograd.grad(y, args, dy)
    gc = torch.autograd.grad(yc, args, dy)
    for a, b in zip(g, gc):
        assert torch.equal(a, b)
