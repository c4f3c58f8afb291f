"""`tl` versions of the activation table (moemlp.activations), switched on the constexpr kernel_id.

Every function takes and returns fp32 tensors: the epilogues evaluate activations from the fp32
accumulator (forward) or from the stored h upcast to fp32 (backward). The formulas are written the
way activations.py writes them, operation for operation, so the two tables agree to a few fp32 ulps;
tests/kernels/test_activations.py checks that elementwise.

Kernel ids (ActivationSpec.kernel_id): 0 swiglu, 1 clamped_swiglu, 2 situglu, 3 geglu (GLU);
4 srelu, 5 gelu (unary). Parameters arrive as three fp32 scalars p0, p1, p2 in the canonical order
of ActivationSpec.param_names (clamped_swiglu: limit, alpha, offset; situglu: beta1, beta2).
"""

from __future__ import annotations

import triton
import triton.language as tl

SWIGLU: tl.constexpr = tl.constexpr(0)
CLAMPED_SWIGLU: tl.constexpr = tl.constexpr(1)
SITUGLU: tl.constexpr = tl.constexpr(2)
GEGLU: tl.constexpr = tl.constexpr(3)
SRELU: tl.constexpr = tl.constexpr(4)
GELU: tl.constexpr = tl.constexpr(5)



_NAN: tl.constexpr = tl.constexpr(tl.PropagateNan.ALL)


@triton.jit
def _clamp_gate_up(gate, up, limit):
    # min/max propagating NaN, as torch.clamp does: the hardware min.f32 would return the limit.
    gate_c = tl.minimum(gate, limit, propagate_nan=_NAN)
    up_c = tl.minimum(tl.maximum(up, -limit, propagate_nan=_NAN), limit, propagate_nan=_NAN)
    return gate_c, up_c


@triton.jit
def _relu(h):
    return tl.maximum(h, 0.0, propagate_nan=_NAN)  # relu(NaN) = NaN, as torch.relu


@triton.jit
def tanh_f32(x):
    # libdevice's tanh does not run under the CPU interpreter, so one formula serves both paths.
    # (1 - e^-2|x|) / (1 + e^-2|x|) loses bits to cancellation near 0 (|x| = 1e-3 would keep only
    # 14 of 24), so below |x| = 0.25 the odd Taylor series to x^9 is used: its first dropped term,
    # 1382/155925·x^11, is < 1e-8 relative there; above, 1 - e ≥ 0.39 keeps the error ~1e-6.
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    t_big = (1.0 - e) / (1.0 + e)
    x2 = ax * ax
    t_small = ax * (
        1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
            -0.05396825396825397 + x2 * 0.021869488536155203)))
    )
    t = tl.where(ax < 0.25, t_small, t_big)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _gelu_inner(x):
    # k·(x + c·x³), k = sqrt(2/pi), c = 0.044715, in activations.py's order of operations.
    # Literals rather than module constexprs: the interpreter cannot multiply a constexpr by a tensor.
    return 0.7978845608028654 * (x + 0.044715 * x * x * x)


@triton.jit
def _gelu_tanh(x):
    return 0.5 * x * (1.0 + tanh_f32(_gelu_inner(x)))


@triton.jit
def _gelu_tanh_and_grad(x):
    t = tanh_f32(_gelu_inner(x))
    value = 0.5 * x * (1.0 + t)
    grad = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    return value, grad


@triton.jit
def glu_forward(gate, up, KIND: tl.constexpr, p0, p1, p2):
    """a = act(gate, up) for the GLU kinds 0..3."""
    if KIND == SWIGLU:
        a = gate * _sigmoid(gate) * up
    elif KIND == CLAMPED_SWIGLU:
        gate_c, up_c = _clamp_gate_up(gate, up, p0)
        a = gate_c * _sigmoid(p1 * gate_c) * (up_c + p2)
    elif KIND == SITUGLU:
        a = p0 * tanh_f32(gate / p0) * _sigmoid(gate) * (p1 * tanh_f32(up / p1))
    else:
        tl.static_assert(KIND == GEGLU)
        a = _gelu_tanh(gate) * up
    return a


@triton.jit
def glu_backward(gate, up, KIND: tl.constexpr, p0, p1, p2):
    """(a, da/dgate, da/dup): the backward needs a itself too (dprobs = Σ g_z·a)."""
    if KIND == SWIGLU:
        s = _sigmoid(gate)
        silu = gate * s
        a = silu * up
        d_gate = (s + silu * (1.0 - s)) * up
        d_up = silu
    elif KIND == CLAMPED_SWIGLU:
        # Gradient 0 where clamped; at the boundary it passes, as torch.clamp's backward does.
        gate_c, up_c = _clamp_gate_up(gate, up, p0)
        s = _sigmoid(p1 * gate_c)
        glu = gate_c * s
        a = glu * (up_c + p2)
        d_gate = (s + p1 * glu * (1.0 - s)) * (up_c + p2)
        d_up = glu
        d_gate = tl.where(gate <= p0, d_gate, 0.0)
        d_up = tl.where((up >= -p0) & (up <= p0), d_up, 0.0)
    elif KIND == SITUGLU:
        ta = tanh_f32(gate / p0)
        s = _sigmoid(gate)
        tb = tanh_f32(up / p1)
        a = p0 * ta * s * (p1 * tb)
        d_gate = ((1.0 - ta * ta) * s + p0 * ta * s * (1.0 - s)) * (p1 * tb)
        d_up = p0 * ta * s * (1.0 - tb * tb)
    else:
        tl.static_assert(KIND == GEGLU)
        g, dg = _gelu_tanh_and_grad(gate)
        a = g * up
        d_gate = dg * up
        d_up = g
    return a, d_gate, d_up


@triton.jit
def unary_forward(h, KIND: tl.constexpr):
    """a = act(h) for the unary kinds 4, 5."""
    if KIND == SRELU:
        r = _relu(h)
        a = r * r
    else:
        tl.static_assert(KIND == GELU)
        a = _gelu_tanh(h)
    return a


@triton.jit
def unary_backward(h, KIND: tl.constexpr):
    """(a, da/dh)."""
    if KIND == SRELU:
        r = _relu(h)
        a = r * r
        d = 2.0 * r
    else:
        tl.static_assert(KIND == GELU)
        a, d = _gelu_tanh_and_grad(h)
    return a, d
