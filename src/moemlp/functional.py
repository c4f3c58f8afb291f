"""grouped_mlp(): validation, backend choice, the custom ops and the one autograd.Function.

Layers, as in quack: backend functions (reference.py / kernels/) → two ``torch.library`` custom
ops, ``moemlp::grouped_mlp_fwd`` and ``moemlp::grouped_mlp_bwd`` (opaque to ``torch.compile``,
so ``fullgraph=True`` holds although the torch backend has data-dependent shapes inside) → one
``autograd.Function`` → ``grouped_mlp``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Optional

import torch
from torch import Tensor

from . import reference
from ._config import MLPConfig
from ._quantized_weights import QuantizedWeights, cached_dgrad, cached_fc1
from ._validate import validate_index_values, validate_inputs, validate_split_values, weight_is_transposed
from ._x_index import RowIndex, gather_rows
from .activations import ACTIVATIONS, resolve_activation

__all__ = ["grouped_mlp"]

_BACKENDS = ("auto", "torch", "triton")


def _recipes():
    from . import recipes

    return recipes


def _kernels():
    """The Triton backend module, or None when triton cannot be imported here."""
    try:
        from . import kernels
    except ImportError:
        return None
    return kernels


def _backend_module(name: str):
    return reference if name == "torch" else _kernels()


def _make_config(
    activation: str, activation_params, glu_interleave: int, scale_fc2_bias: bool, recipe_key: str
) -> MLPConfig:
    return _config(activation, tuple(float(p) for p in activation_params), int(glu_interleave),
                   bool(scale_fc2_bias), recipe_key)  # fmt: skip


@functools.lru_cache(maxsize=64)
def _config(activation: str, activation_params: tuple, glu_interleave: int, scale_fc2_bias: bool,
            recipe_key: str) -> MLPConfig:  # fmt: skip
    """The ops' MLPConfig, built once per option set (MLPConfig and the recipes are frozen): the ops
    ask for it on every call, and parsing and validating a recipe's key there is host time a step."""
    recipe = _recipes().from_key(recipe_key) if recipe_key else None
    return MLPConfig(
        activation=ACTIVATIONS[activation],
        activation_params=activation_params,
        glu_interleave=glu_interleave,
        scale_fc2_bias=scale_fc2_bias,
        recipe=recipe,
    )


# --- the two custom ops -----------------------------------------------------------------------


@torch.library.custom_op("moemlp::grouped_mlp_fwd", mutates_args=())
def _grouped_mlp_fwd_op(
    x: Tensor,
    splits: Tensor,
    probs: Optional[Tensor],
    fc1_weight: Tensor,
    fc2_weight: Tensor,
    fc1_bias: Optional[Tensor],
    fc2_bias: Optional[Tensor],
    activation: str,
    activation_params: list[float],
    glu_interleave: int,
    scale_fc2_bias: bool,
    recipe: str,
    backend: str,
    keep_dgrad: list[bool],
    quantized_weights: list[Tensor],
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(y, h, saved). ``keep_dgrad`` [W1, W2]: the weights whose dgrad the backward will run; the
    Triton backend under fp8_block returns their quantized dgrad operands in ``saved`` (codes_t and
    tile scales of each weight, kernels.operands.saved_dgrad) for grouped_mlp_bwd, so that each
    weight is quantized once per forward + backward. Under nvfp4 without the Hadamard option it holds
    x's routed amax instead when anything is kept (the backward's dW1 operand takes it rather than
    reading x for it). [] on the torch backend, under the other recipes, and when nothing is kept.

    ``quantized_weights``: [] or ``QuantizedWeights.tensors()`` (Triton): the GEMMs read those
    operands (fp8_block's codes, mxfp8's / nvfp4's dequantized values) and no weight is quantized;
    ``saved`` holds nvfp4's x amax alone then, since an op's output may not alias its input:
    _GroupedMLPFunction hands the cached dgrad operands to the backward itself, in front of it. The
    torch backend ignores them (its qdq_weight of the same unchanged weights gives the same values)."""
    cfg = _make_config(activation, activation_params, glu_interleave, scale_fc2_bias, recipe)
    args = (x, splits, probs, fc1_weight, fc2_weight, fc1_bias, fc2_bias, cfg)
    if backend == "torch":
        return (*reference.grouped_mlp_fwd(*args), [])
    if quantized_weights:
        return _kernels().grouped_mlp_fwd(*args, keep_dgrad=tuple(keep_dgrad), quantized=quantized_weights)
    return _kernels().grouped_mlp_fwd(*args, keep_dgrad=tuple(keep_dgrad))


@_grouped_mlp_fwd_op.register_fake
def _(x, splits, probs, fc1_weight, fc2_weight, fc1_bias, fc2_bias, *args):
    recipe, backend, keep_dgrad, quantized_weights = args[-4:]
    saved = []
    if backend != "torch" and recipe:
        from .kernels import saved_dgrad_like, takes_routed_amax

        r = _recipes().from_key(recipe)
        if not quantized_weights:
            saved = saved_dgrad_like((fc1_weight, fc2_weight), r, keep_dgrad)
        if any(keep_dgrad) and takes_routed_amax(r):
            saved.append(x.new_empty((), dtype=torch.float32))
    return x.new_empty(x.shape), x.new_empty((x.shape[0], fc1_weight.shape[1])), saved


@torch.library.custom_op("moemlp::grouped_mlp_bwd", mutates_args=())
def _grouped_mlp_bwd_op(
    dy: Tensor,
    x: Tensor,
    h: Tensor,
    splits: Tensor,
    probs: Optional[Tensor],
    fc1_weight: Tensor,
    fc2_weight: Tensor,
    fc1_bias: Optional[Tensor],
    fc2_bias: Optional[Tensor],
    activation: str,
    activation_params: list[float],
    glu_interleave: int,
    scale_fc2_bias: bool,
    recipe: str,
    backend: str,
    needs: list[bool],
    wgrad_fp32: bool,
    saved: list[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The six gradients; ``saved``: the forward op's, or the dgrad operands of ``quantized_weights``,
    which the Triton backend reads instead of quantizing the weights again (the torch backend has
    nothing to reuse: it gets none)."""
    cfg = _make_config(activation, activation_params, glu_interleave, scale_fc2_bias, recipe)
    kw = {"wgrad_dtype": torch.float32} if wgrad_fp32 else {}
    if backend != "torch":
        kw["saved"] = saved
    grads = _backend_module(backend).grouped_mlp_bwd(
        dy, x, h, splits, probs, fc1_weight, fc2_weight, fc1_bias, fc2_bias, cfg, tuple(needs), **kw
    )
    # A custom op returns tensors only: a gradient that was not asked for is an empty tensor.
    return tuple(g if g is not None else x.new_empty(0) for g in grads)


def _grad_like(t: Optional[Tensor], need: bool, x: Tensor) -> Tensor:
    # empty_like keeps t's strides: a transposed-layout weight gets its gradient in that layout
    return torch.empty_like(t) if (need and t is not None) else x.new_empty(0)


@_grouped_mlp_bwd_op.register_fake
def _(dy, x, h, splits, probs, fc1_weight, fc2_weight, fc1_bias, fc2_bias, *args):
    needs, wgrad_fp32 = args[-3], args[-2]
    grads = [
        _grad_like(t, need, x)
        for t, need in zip((x, probs, fc1_weight, fc2_weight, fc1_bias, fc2_bias), needs)
    ]
    if wgrad_fp32:
        grads[2:4] = [g.float() for g in grads[2:4]]
    return tuple(grads)


@torch.library.custom_op("moemlp::grouped_fc1", mutates_args=())
def _grouped_fc1_op(
    x: Tensor,
    splits: Tensor,
    fc1_weight: Tensor,
    fc1_bias: Optional[Tensor],
    activation: str,
    activation_params: list[float],
    glu_interleave: int,
    scale_fc2_bias: bool,
    recipe: str,
    backend: str,
    fc1_quantized: list[Tensor],
) -> Tensor:
    """h alone, recomputed in backward when recompute_fc1=True (forward kept only x).
    ``fc1_quantized``: [] or W1's tensors of ``QuantizedWeights.tensors()`` (Triton only)."""
    cfg = _make_config(activation, activation_params, glu_interleave, scale_fc2_bias, recipe)
    if backend == "torch":
        return reference.grouped_fc1(x, splits, fc1_weight, fc1_bias, cfg)
    return _kernels().grouped_fc1(x, splits, fc1_weight, fc1_bias, cfg, quantized=fc1_quantized)


@_grouped_fc1_op.register_fake
def _(x, splits, fc1_weight, *args):
    return x.new_empty((x.shape[0], fc1_weight.shape[1]))


# --- autograd ---------------------------------------------------------------------------------


class _GroupedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        splits,
        probs,
        fc1_weight,
        fc2_weight,
        fc1_bias,
        fc2_bias,
        activation,
        activation_params,
        glu_interleave,
        scale_fc2_bias,
        recipe_key,
        backend,
        recompute_fc1,
        main_grad_params,
        grad_enabled,
        quantized_weights,
    ):
        needs = _needs(ctx.needs_input_grad, probs, fc1_bias, fc2_bias) if grad_enabled else [False] * 6
        # The weights whose dgrad backward runs: FC2_DGRAD feeds dx, dprobs, dW1, db1 and dW2 (z);
        # FC1_DGRAD only dx. Their quantized operands come back in `saved` (fp8_block on Triton).
        keep_dgrad = [needs[0], any(needs[:5])]
        y, h, saved = _grouped_mlp_fwd_op(
            x,
            splits,
            probs,
            fc1_weight,
            fc2_weight,
            fc1_bias,
            fc2_bias,
            activation,
            activation_params,
            glu_interleave,
            scale_fc2_bias,
            recipe_key,
            backend,
            keep_dgrad,
            quantized_weights,
        )
        fc1_quantized = []
        if quantized_weights:
            # quantize_weights' tensors: the backward's dgrads read the cached dgrad operands
            # (fp8_block's codes_t and scales, mxfp8's / nvfp4's dgrad values and factor; the op
            # returns none, its outputs may not alias its inputs), recompute_fc1's FC1 W1's.
            # (then the op's own saved: nvfp4's x amax, or nothing)
            saved = (cached_dgrad(quantized_weights) if any(keep_dgrad) else []) + list(saved)
            fc1_quantized = cached_fc1(quantized_weights) if recompute_fc1 else []
        # Kept for backward: x, h (compute dtype), probs and the weights; a and z are recomputed.
        # With recompute_fc1, h is not kept either: backward runs FC1 again from x. Under fp8_block
        # on Triton also the weights' dgrad codes (1 byte per element) and tile scales (saved), or
        # with quantized_weights the cached dgrad operands, which the caller keeps alive anyway.
        ctx.save_for_backward(x, None if recompute_fc1 else h, splits, probs, fc1_weight, fc2_weight,
                              fc1_bias, fc2_bias, *fc1_quantized, *saved)
        ctx.num_fc1_quantized = len(fc1_quantized)
        ctx.options = (activation, activation_params, glu_interleave, scale_fc2_bias, recipe_key, backend)
        ctx.recompute_fc1 = recompute_fc1
        # The caller's weights whose gradient goes into their fp32 .main_grad (Megatron-Core style;
        # None for a frozen one), or None: fc1_weight and fc2_weight here may be contiguous copies.
        ctx.main_grad_params = main_grad_params
        return y

    @staticmethod
    def backward(ctx, dy):
        x, h, splits, probs, fc1_weight, fc2_weight, fc1_bias, fc2_bias, *saved = ctx.saved_tensors
        fc1_quantized, saved = saved[: ctx.num_fc1_quantized], saved[ctx.num_fc1_quantized :]
        if ctx.recompute_fc1:
            h = _grouped_fc1_op(x, splits, fc1_weight, fc1_bias, *ctx.options, fc1_quantized)
        needs = _needs(ctx.needs_input_grad, probs, fc1_bias, fc2_bias)
        dx, dprobs, dw1, dw2, db1, db2 = _grouped_mlp_bwd_op(
            dy.contiguous(),
            x,
            h,
            splits,
            probs,
            fc1_weight,
            fc2_weight,
            fc1_bias,
            fc2_bias,
            *ctx.options,
            needs,
            ctx.main_grad_params is not None,
            saved,
        )
        if ctx.main_grad_params is not None:
            dw1, dw2 = (None if w is None else _into_main_grad(w, dw)
                        for w, dw in zip(ctx.main_grad_params, (dw1, dw2)))
            needs[2] = dw1 is not None
            needs[3] = dw2 is not None
        return (
            dx if needs[0] else None,  # x
            None,  # splits
            dprobs if needs[1] else None,  # probs
            dw1 if needs[2] else None,  # fc1_weight
            dw2 if needs[3] else None,  # fc2_weight
            db1 if needs[4] else None,  # fc1_bias
            db2 if needs[5] else None,  # fc2_bias
            None,  # activation
            None,  # activation_params
            None,  # glu_interleave
            None,  # scale_fc2_bias
            None,  # recipe_key
            None,  # backend
            None,  # recompute_fc1
            None,  # main_grad_params
            None,  # grad_enabled
            None,  # quantized_weights
        )


def _needs(n, probs, fc1_bias, fc2_bias) -> list[bool]:
    """The gradients backward computes (dx, dprobs, dW1, dW2, db1, db2) from ctx.needs_input_grad."""
    return [n[0], n[2] and probs is not None, n[3], n[4], n[5] and fc1_bias is not None,
            n[6] and fc2_bias is not None]


def _into_main_grad(weight: Tensor, dw: Tensor) -> Optional[Tensor]:
    """Add an fp32 weight gradient into weight.main_grad. As Megatron-Core's DDP expects: where the
    parameter carries ``grad_added_to_main_grad``, set it and hand autograd a zero gradient (so its
    hooks fire); otherwise autograd gets no gradient for it."""
    if dw.numel() == 0:
        return None
    weight.main_grad.add_(dw)
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return torch.zeros_like(weight)
    return None


# --- the public function ----------------------------------------------------------------------


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _resolve_backend(backend, x: Tensor, recipe) -> str:
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {list(_BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return "torch"
    kernels = _kernels()
    reason = None
    if kernels is None or not _triton_importable():
        reason = "triton is not installed (pip install 'moemlp[triton]')"
    elif x.dtype == torch.float64:
        reason = "the Triton kernels take bf16, fp16 or fp32 inputs; float64 runs on backend='torch'"
    elif not kernels.is_available(x.device):
        reason = kernels.unavailable_reason(x.device)
    elif recipe is not None and not getattr(kernels, "supports_recipe", lambda r: False)(recipe):
        reason = f"recipe {recipe.key!r} has no Triton implementation yet; it runs on backend='torch'"
    if backend == "auto":
        return "torch" if reason is not None else "triton"
    if reason is not None:
        raise ValueError(f"backend: 'triton' cannot run this call: {reason}")
    return "triton"


def _dense_weight(w: Tensor, recipe) -> Tensor:
    """w itself when the backends read it in place (contiguous, or transposed without a recipe),
    else a contiguous copy."""
    if w.is_contiguous() or (recipe is None and weight_is_transposed(w)):
        return w
    return w.contiguous()


def _main_grad_weights(fc1_weight: Tensor, fc2_weight: Tensor, owner: str = "") -> tuple | None:
    """The weights whose gradient a backward adds into ``.main_grad`` (accumulate_into_main_grad):
    those that require grad while grad is enabled (the caller's own tensors, not the contiguous copies
    the op may run on), None in the place of the others, or None when there are none. Each must hold
    a float32 ``main_grad`` of its shape on its device: anything else is an error naming it, prefixed
    by ``owner`` (a module's path, such as ``"shared_experts."``)."""
    grads = torch.is_grad_enabled()
    params = tuple(w if grads and w.requires_grad else None for w in (fc1_weight, fc2_weight))
    for name, w in zip((f"{owner}fc1_weight", f"{owner}fc2_weight"), params):
        if w is None:
            continue
        mg = getattr(w, "main_grad", None)
        if not isinstance(mg, Tensor):
            raise ValueError(f"{name}: accumulate_into_main_grad needs a tensor {name}.main_grad")
        if mg.shape != w.shape:
            raise ValueError(f"{name}.main_grad: expected shape {tuple(w.shape)}, got {tuple(mg.shape)}")
        if mg.dtype != torch.float32 or mg.device != w.device:
            raise TypeError(f"{name}.main_grad: expected float32 on {w.device}, got {mg.dtype} on {mg.device}")
    return None if all(w is None for w in params) else params


def grouped_mlp(
    x: Tensor,
    splits: Tensor,
    probs: Optional[Tensor],
    fc1_weight: Tensor,
    fc2_weight: Tensor,
    fc1_bias: Optional[Tensor] = None,
    fc2_bias: Optional[Tensor] = None,
    *,
    activation: str = "swiglu",
    activation_params: Optional[Mapping[str, float]] = None,
    glu_interleave: Optional[int] = None,
    scale_fc2_bias: bool = False,
    recipe=None,
    backend: str = "auto",
    recompute_fc1: bool = False,
    accumulate_into_main_grad: bool = False,
    quantized_weights=None,
    x_index: Optional[Tensor] = None,
) -> Tensor:
    """The expert block of an MoE layer for all experts at once (SPEC §1).

    Args:
        x: (M, H) bf16 / fp16 / fp32 (float64 on the torch backend); rows grouped by expert. With
            ``x_index``: (T, H), any T >= 0, the tokens the rows are gathered from.
        splits: (E,) int32/int64 rows per expert, any device; rows past Σsplits are capacity
            padding (outputs and gradients 0). CPU splits are checked on the host; device splits
            are never read on the host by the Triton path (bad values are clamped, not raised).
        probs: (M,) fp32 / bf16 / fp16 per-row scale (the router probability), or None (= 1).
            Used in fp32; its gradient is computed in fp32 and returned in probs.dtype.
        fc1_weight: (E, N1, H), N1 = 2F for GLU activations (gate first, then up), F otherwise.
        fc2_weight: (E, H, F).
        fc1_bias, fc2_bias: (E, N1), (E, H) or None.
        activation: 'swiglu', 'clamped_swiglu', 'situglu', 'geglu', 'srelu' or 'gelu'.
        activation_params: the activation's parameters by name, e.g. ``{"limit": 7.0}``.
        glu_interleave: g, with fc1 columns in blocks [gate g | up g | ...]; None = two halves.
        scale_fc2_bias: multiply fc2_bias by probs.
        recipe: None, a recipe name ('fp8_block', 'mxfp8', 'nvfp4') or a recipe object.
        backend: 'auto' (Triton on CUDA when it can run the call, else torch), 'torch', 'triton'.
        recompute_fc1: keep only x for backward and run FC1 again there (saves the (M, N1) h).
        accumulate_into_main_grad: add the weight gradients, computed in fp32, into each weight's
            fp32 ``main_grad`` (Megatron-Core's gradient-accumulation fusion) instead of ``.grad``.
            Each weight that will get a gradient (requires_grad, grad mode on) needs a float32
            ``main_grad`` of its shape on its device; frozen weights need none.
        quantized_weights: a ``QuantizedWeights`` from ``moemlp.quantize_weights(fc1_weight,
            fc2_weight, recipe)``, or None. The forward GEMMs and the backward's dgrads read its
            operands (fp8_block's codes; mxfp8's and nvfp4's dequantized bf16 values, both
            orientations), and no weight is quantized in the call's forward + backward; quantize
            once per optimizer step and pass it to every micro-batch (the results are the same
            bits). Checked on the host, without a device sync: ``recipe`` must be the one it was
            quantized with, and the weights the very tensors quantized (same ``data_ptr``), unchanged
            since (same in-place version counter ``_version``): after an optimizer step this raises
            ValueError, quantize again (a fused optimizer, ``fused=True``, does not bump ``_version``:
            its step goes unseen). Under ``torch.compiler.is_compiling()`` only shapes, dtypes and
            devices are checked (a graph cannot read data_ptr or _version): a compiled step must
            itself quantize again after the weights change. The torch backend (backend='torch', or
            'auto' where Triton cannot run) checks it and then ignores it: the reference quantizes
            the same unchanged weights to the same values.
        x_index: None, or (M,) int32/int64 on x's device: row i of the expert input is
            ``x[x_index[i]]``, so the caller need not materialise the permuted (M, H) rows. Rows are
            still grouped by expert through ``splits``; capacity rows (past Σsplits) read no index.
            dx has x's shape: dx[t] sums the rows that read token t, in ascending row order, in
            fp32 (fp64 for fp64) with one rounding; no atomics, the same bits on every run. An index
            out of [0, T) is a ValueError where it is checked without a device sync (CPU tensors, or
            the torch backend, which reads splits on the host anyway); on the GPU the Triton path
            clamps it into [0, T) instead, as it clamps device splits. Unfused for now: the rows
            are gathered into an (M, H) tensor before FC1.

    Non-contiguous tensors are copied to contiguous ones once, here, before the ops run, except a
    weight in the transposed layout without a recipe: the transposed view (``w.transpose(1, 2)``)
    of a contiguous (E, H, N1) / (E, F, H) tensor, as transformers' ``is_transposed`` experts
    (gpt-oss) store theirs. Both backends read it in place and return its gradient in the same
    layout (a transposed view of a contiguous tensor), so neither the forward nor the optimizer's
    gradient accumulation copies the weight. Under a recipe it is copied (the quantizers take
    contiguous weights).

    Returns:
        y (M, H) in x.dtype.
    """
    spec, params = resolve_activation(activation, activation_params)
    adjoint = None
    if isinstance(x_index, RowIndex):  # the MoE layer's x_index, with its k-ordered adjoint
        x_index, adjoint = x_index.index, (x_index.order, x_index.offsets)
    M, _, _, g = validate_inputs(
        x,
        splits,
        probs,
        fc1_weight,
        fc2_weight,
        fc1_bias,
        fc2_bias,
        glu=spec.glu,
        glu_interleave=glu_interleave,
        scale_fc2_bias=scale_fc2_bias,
        activation=spec.name,
        x_index=x_index,
    )
    recipe_obj = None if recipe is None else _recipes().resolve_recipe(recipe)
    be = _resolve_backend(backend, x, recipe_obj)
    # Values of CPU splits are checked here, for free. The torch backend checks device splits
    # inside its op (it reads them on the host anyway; under torch.compile a host read here would
    # be a data-dependent guard); the Triton path never reads device splits on the host.
    if splits.device.type == "cpu" and not torch.compiler.is_compiling():
        validate_split_values(splits, M, rows_of="x" if x_index is None else "x_index")
        if x_index is not None and x_index.device.type == "cpu":
            validate_index_values(x_index, int(splits.sum()), x.shape[0])
    for name, flag in (("recompute_fc1", recompute_fc1), ("accumulate_into_main_grad", accumulate_into_main_grad)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    main_grad_params = _main_grad_weights(fc1_weight, fc2_weight) if accumulate_into_main_grad else None
    if recipe_obj is not None and x.dtype == torch.float64:
        raise TypeError("recipe: block-scaled recipes take bf16, fp16 or fp32 inputs, got float64 x")
    quantized = []
    if quantized_weights is not None:
        if not isinstance(quantized_weights, QuantizedWeights):
            raise TypeError(
                f"quantized_weights: expected None or a QuantizedWeights from moemlp.quantize_weights, "
                f"got {type(quantized_weights).__name__}"
            )
        quantized_weights.check(fc1_weight, fc2_weight, recipe_obj.key if recipe_obj is not None else "")
        if be == "triton":
            quantized = quantized_weights.tensors()
    if splits.device != x.device:
        splits = splits.to(x.device, non_blocking=True)
    x = x.contiguous()
    if x_index is not None:
        # The gather runs where the MLP runs: Triton kernels on its Triton path, torch ops otherwise.
        x = gather_rows(x, x_index, splits.contiguous(), adjoint, be == "triton")
    return _GroupedMLPFunction.apply(
        x,
        splits.contiguous(),
        probs.contiguous() if probs is not None else None,
        _dense_weight(fc1_weight, recipe_obj),
        _dense_weight(fc2_weight, recipe_obj),
        fc1_bias.contiguous() if fc1_bias is not None else None,
        fc2_bias.contiguous() if fc2_bias is not None else None,
        spec.name,
        list(params),
        g,
        scale_fc2_bias,
        recipe_obj.key if recipe_obj is not None else "",
        be,
        recompute_fc1,
        main_grad_params,
        # In no_grad / inference_mode there is no backward, while ctx.needs_input_grad still
        # reflects requires_grad: nothing is kept for a backward then.
        torch.is_grad_enabled(),
        quantized,
    )
