"""The `tl` activation table (moemlp/kernels/gemm/activations.py) against the torch table, elementwise.

Runs on the GPU (where tl.exp is the hardware's approximate exp2), or under TRITON_INTERPRET=1 in
a child pytest on a CPU-only machine (tests/_triton_env.py says why). Tolerance against the float64
evaluation of the torch table:
2e-6 relative + 1e-6 · (1 + |gate|)(1 + |up|) absolute. The exp-based tanh and sigmoid are accurate
to ~1e-6 relative (8 fp32 ulps; a bf16 output rounds at 4e-3), and the derivative formulas subtract
terms as large as (1 + |gate|)(1 + |up|): gelu'(-3.46) = 0.5(1 + t) + ..., t ≈ -0.9998, loses
about 13 bits to cancellation in any fp32 evaluation, torch's included.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import _triton_env
from moemlp.activations import ACTIVATIONS
from moemlp.kernels.gemm.activations import glu_backward, glu_forward, unary_backward, unary_forward

runnable = pytest.mark.skipif(
    not (torch.cuda.is_available() or _triton_env.RUN_CPU_CASES),
    reason="needs a CUDA GPU; on a CPU-only machine the child of test_table_under_interpreter runs it",
)


@pytest.mark.interpreter_child(seconds=6)
@pytest.mark.skipif(not _triton_env.START_CHILD, reason="runs the table test in a child on a CPU-only machine")
def test_table_under_interpreter():
    _triton_env.run_file_interpreted(__file__)


@triton.jit
def _apply(gate_ptr, up_ptr, out_ptr,  # (n,) fp32 inputs; out (4, n) fp32: a (fwd), a, d_gate, d_up (bwd)
           n, p0, p1, p2, KIND: tl.constexpr, GLU: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0)
    if GLU:
        up = tl.load(up_ptr + offs, mask=mask, other=0.0)
        a_fwd = glu_forward(gate, up, KIND, p0, p1, p2)
        a, d_gate, d_up = glu_backward(gate, up, KIND, p0, p1, p2)
    else:
        a_fwd = unary_forward(gate, KIND)
        a, d_gate = unary_backward(gate, KIND)
        d_up = tl.zeros_like(a)
    tl.store(out_ptr + offs, a_fwd, mask=mask)
    tl.store(out_ptr + n + offs, a, mask=mask)
    tl.store(out_ptr + 2 * n + offs, d_gate, mask=mask)
    tl.store(out_ptr + 3 * n + offs, d_up, mask=mask)


def _inputs(device):
    g = torch.Generator().manual_seed(0)
    # Spread over the interesting ranges: near 0 (tanh's series branch below 0.25), the clamp
    # limit 7, large |x| where sigmoid and tanh saturate, and exact kink points.
    base = torch.cat([
        torch.randn(4000, generator=g) * 3.0,
        torch.randn(1000, generator=g) * 0.05,
        torch.linspace(-30, 30, 601),
        torch.tensor([0.0, 7.0, -7.0, 0.25, -0.25, 1e-6, -1e-6]),
    ])
    up = torch.roll(base, 17) * 1.5
    return base.to(device), up.to(device)


@runnable
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_tl_table_matches_torch_table(name):
    spec = ACTIVATIONS[name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gate, up = _inputs(device)
    n = gate.numel()
    out = torch.empty(4, n, device=device)
    params = tuple(spec.defaults) + (0.0,) * (3 - len(spec.defaults))
    _apply[(triton.cdiv(n, 256),)](gate, up, out, n, *params, KIND=spec.kernel_id, GLU=spec.glu, BLOCK=256)

    def torch_table(dtype):
        gt, ut = gate.to(dtype), up.to(dtype)
        if spec.glu:
            a = spec.fn(gt, ut, *spec.defaults)
            d_gate, d_up = spec.grad(gt, ut, *spec.defaults)
        else:
            a = spec.fn(gt, *spec.defaults)
            d_gate, d_up = spec.grad(gt, *spec.defaults), torch.zeros_like(gt)
        return torch.stack([a, a, d_gate, d_up])

    ref64 = torch_table(torch.float64)
    err_tl = (out.double() - ref64).abs()
    scale = (1 + gate.double().abs()) * (1 + up.double().abs() if spec.glu else 1)
    bound = 2e-6 * ref64.abs() + 1e-6 * scale
    worst = (err_tl - bound).argmax()
    assert (err_tl <= bound).all(), (
        f"{name}: row {worst // n} at x=({gate[worst % n].item()}, {up[worst % n].item()}): "
        f"kernel {out.flatten()[worst].item()}, float64 {ref64.flatten()[worst].item()}"
    )
