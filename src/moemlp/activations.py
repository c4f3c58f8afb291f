"""The activation table: one entry per activation of SPEC §1, forward and derivative in torch.

The Triton kernels carry their own `tl` versions of the same formulas (kernels/gemm/activations.py),
keyed by the same ``kernel_id``; tests check the two tables agree elementwise.

Every function here works on fp32 or fp64 tensors and returns the same dtype: the grouped MLP
evaluates activations in fp32 from the fp32 accumulator (float64 in the float64 reference).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

__all__ = ["ActivationSpec", "ACTIVATIONS", "resolve_activation"]

_GELU_K = math.sqrt(2.0 / math.pi)  # gelu_tanh: 0.5·x·(1 + tanh(k·(x + 0.044715·x³)))
_GELU_C = 0.044715


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_GELU_K * (x + _GELU_C * x * x * x)))


def _gelu_tanh_grad(x: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(_GELU_K * (x + _GELU_C * x * x * x))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_K * (1.0 + 3.0 * _GELU_C * x * x)


# --- GLU activations: f(gate, up, *params) and (df/dgate, df/dup) ---------------------------------


def _swiglu(a, b):
    return a * torch.sigmoid(a) * b


def _swiglu_grad(a, b):
    s = torch.sigmoid(a)
    silu = a * s
    return (s + silu * (1.0 - s)) * b, silu


def _clamped_swiglu(a, b, limit, alpha, offset):
    a_c = torch.clamp(a, max=limit)
    b_c = torch.clamp(b, min=-limit, max=limit)
    return a_c * torch.sigmoid(alpha * a_c) * (b_c + offset)


def _clamped_swiglu_grad(a, b, limit, alpha, offset):
    # Gradient 0 where clamped; at the boundary itself it passes, as torch.clamp's backward does.
    a_c = torch.clamp(a, max=limit)
    b_c = torch.clamp(b, min=-limit, max=limit)
    s = torch.sigmoid(alpha * a_c)
    glu = a_c * s
    d_gate = (s + alpha * glu * (1.0 - s)) * (b_c + offset)
    d_up = glu
    d_gate = torch.where(a <= limit, d_gate, torch.zeros_like(d_gate))
    d_up = torch.where((b >= -limit) & (b <= limit), d_up, torch.zeros_like(d_up))
    return d_gate, d_up


def _situglu(a, b, beta1, beta2):
    return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a) * (beta2 * torch.tanh(b / beta2))


def _situglu_grad(a, b, beta1, beta2):
    ta = torch.tanh(a / beta1)
    s = torch.sigmoid(a)
    tb = torch.tanh(b / beta2)
    d_gate = ((1.0 - ta * ta) * s + beta1 * ta * s * (1.0 - s)) * (beta2 * tb)
    d_up = beta1 * ta * s * (1.0 - tb * tb)
    return d_gate, d_up


def _geglu(a, b):
    return _gelu_tanh(a) * b


def _geglu_grad(a, b):
    return _gelu_tanh_grad(a) * b, _gelu_tanh(a)


# --- unary activations: f(h, *params) and df/dh -----------------------------------------------


def _srelu(h):
    r = torch.relu(h)
    return r * r


def _srelu_grad(h):
    return 2.0 * torch.relu(h)


@dataclass(frozen=True)
class ActivationSpec:
    """One row of the table. ``params`` is the canonical ordered tuple of parameter values."""

    name: str
    kernel_id: int  # constexpr id the Triton epilogues switch on
    glu: bool
    param_names: tuple[str, ...]
    defaults: tuple[float, ...]
    fn: Callable
    grad: Callable
    # validate(params) -> error message or None
    check: Callable[[tuple[float, ...]], str | None]


def _no_check(params):
    return None


def _check_clamped(params):
    limit, alpha, offset = params
    if not (math.isfinite(limit) and limit > 0):
        return f"limit must be finite and > 0, got {limit}"
    if not (math.isfinite(alpha) and alpha > 0):
        return f"alpha must be finite and > 0, got {alpha}"
    if not math.isfinite(offset):
        return f"offset must be finite, got {offset}"
    return None


def _check_situ(params):
    for name, v in zip(("beta1", "beta2"), params):
        if not (math.isfinite(v) and v > 0):
            return f"{name} must be finite and > 0, got {v}"
    return None


ACTIVATIONS: Mapping[str, ActivationSpec] = {
    spec.name: spec
    for spec in (
        ActivationSpec("swiglu", 0, True, (), (), _swiglu, _swiglu_grad, _no_check),
        ActivationSpec(
            "clamped_swiglu",
            1,
            True,
            ("limit", "alpha", "offset"),
            (7.0, 1.702, 1.0),
            _clamped_swiglu,
            _clamped_swiglu_grad,
            _check_clamped,
        ),
        ActivationSpec(
            "situglu", 2, True, ("beta1", "beta2"), (4.0, 25.0), _situglu, _situglu_grad, _check_situ
        ),
        ActivationSpec("geglu", 3, True, (), (), _geglu, _geglu_grad, _no_check),
        ActivationSpec("srelu", 4, False, (), (), _srelu, _srelu_grad, _no_check),
        ActivationSpec("gelu", 5, False, (), (), _gelu_tanh, _gelu_tanh_grad, _no_check),
    )
}


def resolve_activation(
    activation: str, activation_params: Mapping[str, float] | None
) -> tuple[ActivationSpec, tuple[float, ...]]:
    """Validate an activation name and its parameters; return the spec and the ordered params."""
    if not isinstance(activation, str):
        raise TypeError(f"activation: expected a str, got {type(activation).__name__}")
    spec = ACTIVATIONS.get(activation)
    if spec is None:
        raise ValueError(
            f"activation: unknown activation {activation!r}; expected one of {sorted(ACTIVATIONS)}"
        )
    if activation_params is not None and not isinstance(activation_params, Mapping):
        raise TypeError(
            f"activation_params: expected a mapping of name to float, got {type(activation_params).__name__}"
        )
    given = dict(activation_params or {})
    unknown = sorted(set(given) - set(spec.param_names))
    if unknown:
        raise ValueError(
            f"activation_params: {activation!r} takes {list(spec.param_names) or 'no parameters'}, "
            f"got unknown {unknown}"
        )
    params = []
    for name, default in zip(spec.param_names, spec.defaults):
        v = given.get(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"activation_params[{name!r}]: expected a float, got {type(v).__name__}")
        params.append(float(v))
    params = tuple(params)
    err = spec.check(params)
    if err is not None:
        raise ValueError(f"activation_params: {activation}: {err}")
    return spec, params
