"""The GLU activations of the engine's fused epilogues, kinds swiglu (0) and clamped_swiglu (1), in
fp32: written operation for operation as kernels/gemm/activations.py writes them, so that the
Gluon and Triton kernels give the same bits."""

from __future__ import annotations

import triton.language as tl

from ._compat import gl, gluon

_NAN = gl.constexpr(tl.PropagateNan.ALL) if gl is not None else None


@gluon.jit
def _sigmoid(x):
    return 1.0 / (1.0 + gl.exp(-x))


@gluon.jit
def _clamp(gate, up, limit):
    # min / max propagating NaN, as torch.clamp (the hardware min.f32 would return the limit)
    gate_c = gl.minimum(gate, limit, propagate_nan=_NAN)
    up_c = gl.minimum(gl.maximum(up, -limit, propagate_nan=_NAN), limit, propagate_nan=_NAN)
    return gate_c, up_c


@gluon.jit
def _glu_forward(gate, up, ACT: gl.constexpr, p0, p1, p2):
    """a = act(gate, up), as gemm/activations.py's glu_forward for kinds 0 and 1."""
    if ACT == 0:
        a = gate * _sigmoid(gate) * up
    else:
        gl.static_assert(ACT == 1)
        gate_c, up_c = _clamp(gate, up, p0)
        a = gate_c * _sigmoid(p1 * gate_c) * (up_c + p2)
    return a


@gluon.jit
def _glu_backward(gate, up, ACT: gl.constexpr, p0, p1, p2):
    """(a, da/dgate, da/dup), as gemm/activations.py's glu_backward for kinds 0 and 1."""
    if ACT == 0:
        s = _sigmoid(gate)
        silu = gate * s
        a = silu * up
        d_gate = (s + silu * (1.0 - s)) * up
        d_up = silu
    else:
        gl.static_assert(ACT == 1)
        gate_c, up_c = _clamp(gate, up, p0)
        s = _sigmoid(p1 * gate_c)
        glu = gate_c * s
        a = glu * (up_c + p2)
        d_gate = (s + p1 * glu * (1.0 - s)) * (up_c + p2)
        d_up = glu
        d_gate = gl.where(gate <= p0, d_gate, 0.0)
        d_up = gl.where((up >= -p0) & (up <= p0), d_up, 0.0)
    return a, d_gate, d_up
