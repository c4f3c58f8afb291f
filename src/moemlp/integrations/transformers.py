"""moemlp as a Hugging Face transformers experts backend: ``experts_implementation="moemlp"``.

    import moemlp.integrations.transformers as moemlp_hf

    moemlp_hf.register()  # once per process, before the model runs
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="moemlp")

Since v5 every MoE model's experts module calls ``ExpertsInterface[config._experts_implementation]
(self, hidden_states, top_k_index, top_k_weights)``. The backend registered here computes

    y[t] = Σ_k w[t, k] · (act(x[t] W1[e]ᵀ + b1[e]) W2[e]ᵀ + b2[e]),   e = top_k_index[t, k]

with moemlp: the (token, k) slots sorted by expert on the device (moemlp.moe.dispatch, no host
read), one ``grouped_mlp`` call with the routing weights in fp32 (float64 for float64 experts) and
``scale_fc2_bias=True`` (the weight multiplies the expert output after its bias, as in
transformers: w·(z·W2ᵀ + b2) = (w·z)·W2ᵀ + w·b2), and the k outputs of a token summed in k order
in fp32.

Each experts module is mapped onto grouped_mlp's arguments once (``resolve_experts``): weights
(E, 2F, H) and (E, H, F), or (E, H, 2F) and (E, F, H) when ``is_transposed``; optional biases; the
gate. The gate (``_apply_gate``; by default act_fn(first half) · second half) is matched against
moemlp's activations by evaluating both in float64 on a probe that spans the clamp range, in both
column layouts (two halves, or gate and up interleaved column by column). A module whose gate
matches none raises ValueError naming it, or, with ``register(fallback="eager")`` or
``fallback="grouped_mm"``, runs its own forward or that transformers backend: never a silently
different result.
"""

from __future__ import annotations

import inspect
import math
import warnings
import weakref
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch
from torch import Tensor

try:
    import transformers
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface, use_experts_implementation
except ImportError as e:  # transformers absent, or a 4.x without the experts interface
    raise ImportError(
        "moemlp.integrations.transformers needs transformers>=5.7.0: pip install 'moemlp[transformers]'"
    ) from e
from packaging.version import Version  # a dependency of transformers

from .. import reference
from .._config import MLPConfig
from ..activations import resolve_activation
from ..functional import grouped_mlp
from ..moe.dispatch import BACKENDS, local_moe_forward, use_triton

__all__ = ["register", "prepare", "experts_forward", "resolve_experts", "ExpertsMapping", "MIN_TRANSFORMERS_VERSION"]

# 5.0-5.6 have ExpertsInterface, but PreTrainedModel.get_correct_experts_implementation accepts
# only the built-in names there ("eager", "grouped_mm", "batched_mm", "deepgemm"); 5.7 accepts any
# registered name.
MIN_TRANSFORMERS_VERSION = "5.7.0"
if Version(transformers.__version__).release < Version(MIN_TRANSFORMERS_VERSION).release:
    raise ImportError(
        f"moemlp.integrations.transformers needs transformers>={MIN_TRANSFORMERS_VERSION} (earlier versions "
        f"refuse experts_implementation names they do not ship), found {transformers.__version__}"
    )

# transformers' own backends, which register() must not replace.
_BUILTIN_NAMES = frozenset(ExpertsInterface._global_mapping) | {"eager"}

# The options of transformers' use_experts_implementation decorator, which it sets on each experts
# module under the same names. These four are mapped (is_concatenated only orders the layouts the
# gate probe tries); any other one at a value not its default (5.24: has_post_expert_norm, a norm
# between the down projection and the routing weight, which grouped_mlp applies inside) is refused.
_MAPPED_FLAGS = frozenset({"is_concatenated", "is_transposed", "has_bias", "has_gate"})
_OTHER_FLAGS = {
    name: p.default
    for name, p in inspect.signature(use_experts_implementation).parameters.items()
    if p.kind is p.KEYWORD_ONLY and name != "experts_interface" and name not in _MAPPED_FLAGS
}

_LIMIT_ATTRS = ("limit", "swiglu_limit")  # gpt-oss, openai_privacy_filter | GLM-5, MiniMax-M3, HY-V4
_ALPHA_ATTRS = ("alpha", "swiglu_alpha")


class ExpertsMapping(NamedTuple):
    """How one experts module's tensors and gate map onto ``grouped_mlp``'s arguments."""

    fc1_name: str  # "gate_up_proj", or "up_proj" for a module without gate (has_gate=False)
    transposed: bool  # weights stored (E, in, out): fc1 (E, H, N1), down_proj (E, F, H)
    has_bias: bool  # <fc1_name>_bias (E, N1) and down_proj_bias (E, H)
    activation: str  # a moemlp activation name
    activation_params: tuple[tuple[str, float], ...]  # (name, value) pairs, grouped_mlp's activation_params
    glu_interleave: Optional[int]  # None: [gate F | up F]; 1: gate and up column by column; None for unary


# --- mapping a module --------------------------------------------------------------------------


def _tensor_attr(module, name: str) -> Tensor:
    t = getattr(module, name, None)
    if not isinstance(t, Tensor):
        raise ValueError(
            f"{type(module).__name__}.{name}: expected a tensor (the experts layout of transformers' "
            f"ExpertsInterface), got {type(t).__name__}"
        )
    return t


def _number_attr(module, names: tuple[str, ...]) -> Optional[float]:
    for name in names:
        v = getattr(module, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
    return None


def _layout(module) -> tuple[str, bool, bool, int, int]:
    """(fc1_name, transposed, has_bias, N1, F) after checking the weight and bias shapes."""
    cls = type(module).__name__
    for flag, default in _OTHER_FLAGS.items():
        value = getattr(module, flag, default)
        if value != default:
            raise ValueError(
                f"{cls}: {flag}={value!r} (a transformers experts option) has no moemlp equivalent; "
                f"use experts_implementation='grouped_mm', or register(fallback='eager')"
            )
    has_gate = bool(getattr(module, "has_gate", True))
    fc1_name = "gate_up_proj" if has_gate else "up_proj"
    transposed = bool(getattr(module, "is_transposed", False))
    fc1, fc2 = _tensor_attr(module, fc1_name), _tensor_attr(module, "down_proj")
    if fc1.dim() != 3 or fc2.dim() != 3:
        raise ValueError(
            f"{cls}: expected 3-D {fc1_name} and down_proj, got shapes {tuple(fc1.shape)} and {tuple(fc2.shape)}"
        )
    for name, t in ((fc1_name, fc1), ("down_proj", fc2)):
        if t.dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"{cls}.{name}: {t.dtype} weights; moemlp takes float64, float32, bfloat16 or float16 experts "
                f"(a quantized checkpoint's experts, e.g. FP8 with *_scale_inv tensors, are not covered: load "
                f"the model in bf16, or use experts_implementation='grouped_mm')"
            )
    E = fc1.shape[0]
    if transposed:
        H, N1 = fc1.shape[1:]
        F, H2 = fc2.shape[1:]
        want = f"{fc1_name} (E, H, {'2F' if has_gate else 'F'}) and down_proj (E, F, H) (is_transposed)"
    else:
        N1, H = fc1.shape[1:]
        H2, F = fc2.shape[1:]
        want = f"{fc1_name} (E, {'2F' if has_gate else 'F'}, H) and down_proj (E, H, F)"
    if fc2.shape[0] != E or H2 != H or N1 != (2 * F if has_gate else F):
        raise ValueError(f"{cls}: expected {want}, got {tuple(fc1.shape)} and {tuple(fc2.shape)}")
    has_bias = bool(getattr(module, "has_bias", False))
    if has_bias:
        for name, shape in ((f"{fc1_name}_bias", (E, N1)), ("down_proj_bias", (E, H))):
            b = _tensor_attr(module, name)
            if tuple(b.shape) != shape:
                raise ValueError(f"{cls}.{name}: expected shape {shape}, got {tuple(b.shape)}")
    return fc1_name, transposed, has_bias, N1, F


def _gate_candidates(module, has_gate: bool) -> list[tuple[str, tuple[tuple[str, float], ...]]]:
    if not has_gate:
        return [("srelu", ()), ("gelu", ())]
    candidates = [("swiglu", ()), ("geglu", ())]
    limit = _number_attr(module, _LIMIT_ATTRS)
    if limit is not None and limit > 0:
        alpha = _number_attr(module, _ALPHA_ATTRS)
        if alpha is not None and alpha > 0:
            # gpt-oss: min(a, L)·σ(α·min(a, L)) · (clamp(b, ±L) + 1)
            candidates.append(("clamped_swiglu", (("limit", limit), ("alpha", alpha), ("offset", 1.0))))
        # clamped SiLU gate times clamped up (GLM-5, HY-V4, DeepSeek-V4): α = 1, no +1.
        candidates.append(("clamped_swiglu", (("limit", limit), ("alpha", 1.0), ("offset", 0.0))))
    # Softcapped SwiGLU (Inkling2): β1·tanh(a/β1)·σ(a) · β2·tanh(b/β2), the caps on act_fn's
    # gate_softcap / up_softcap submodules.
    act = getattr(module, "act_fn", None)
    beta1 = _number_attr(getattr(act, "gate_softcap", None), ("softcap",))
    beta2 = _number_attr(getattr(act, "up_softcap", None), ("softcap",))
    if beta1 is not None and beta2 is not None and beta1 > 0 and beta2 > 0:
        candidates.append(("situglu", (("beta1", beta1), ("beta2", beta2))))
    return candidates


def _probe(width: int, scale: float) -> Tensor:
    """(20, width) float64: 8 rows uniform in [-scale, scale] (past the module's known clamp), 8
    standard normal, and 4 of magnitudes 1 to 1e4 spread log-uniformly with random signs, so that a
    clamp held where the mapping does not look (an attribute of another name, a tensor) shows as a
    mismatch instead of passing for the unclamped gate."""
    g = torch.Generator().manual_seed(0)
    wide = (torch.rand(8, width, generator=g, dtype=torch.float64) * 2 - 1) * scale
    normal = torch.randn(8, width, generator=g, dtype=torch.float64)
    sign = torch.randint(0, 2, (4, width), generator=g).to(torch.float64) * 2 - 1
    far = sign * 10.0 ** (4 * torch.rand(4, width, generator=g, dtype=torch.float64))
    return torch.cat([wide, normal, far])


def _same(ours: Tensor, theirs) -> bool:
    # rtol 1e-6: far below the gap between two different candidates on the probe (gelu vs its
    # tanh form differ by ~1e-3, a wrong clamp or alpha by O(1)), far above float64 op-order
    # differences (~1e-15) and loose enough for a gate that computes in fp32 internally (~1e-7).
    return (
        isinstance(theirs, Tensor)
        and theirs.shape == ours.shape
        and bool(torch.allclose(theirs.to(torch.float64), ours, rtol=1e-6, atol=1e-9))
    )


def _resolve(module) -> ExpertsMapping:
    fc1_name, transposed, has_bias, n1, F = _layout(module)
    has_gate = fc1_name == "gate_up_proj"
    limit = _number_attr(module, _LIMIT_ATTRS)
    h = _probe(n1, 2.0 * limit if limit else 8.0)
    tried = []
    with torch.no_grad():
        try:
            theirs = module._apply_gate(h) if has_gate else module.act_fn(h)
        except Exception as e:  # a gate that cannot run on a CPU float64 probe cannot be matched
            raise ValueError(
                f"{type(module).__name__}: could not evaluate its {'_apply_gate' if has_gate else 'act_fn'} "
                f"on a CPU float64 probe to match it with a moemlp activation ({type(e).__name__}: {e}); "
                f"use experts_implementation='grouped_mm' or register(fallback='eager')"
            ) from e
        layouts = [None]
        if has_gate:
            layouts = [1, None] if getattr(module, "is_concatenated", True) is False else [None, 1]
        for glu_interleave in layouts:
            for name, params in _gate_candidates(module, has_gate):
                spec, ordered = resolve_activation(name, dict(params))
                cfg = MLPConfig(spec, ordered, glu_interleave or F, scale_fc2_bias=True)
                if _same(reference.activate(h, cfg), theirs):
                    return ExpertsMapping(fc1_name, transposed, has_bias, name, params, glu_interleave)
                tried.append(f"{name}{dict(params) or ''} {'interleaved' if glu_interleave else 'halves'}")
    what = "_apply_gate" if has_gate else f"act_fn ({type(getattr(module, 'act_fn', None)).__name__})"
    raise ValueError(
        f"{type(module).__name__}: its {what} matches no moemlp activation (tried {'; '.join(tried)}); "
        f"use experts_implementation='grouped_mm', or register(fallback='eager') to run such modules there"
    )


# module -> (signature, mapping or the message of the ValueError it raised, the gate objects whose
# ids the signature holds); recomputed when the signature changes. A message, not the exception: its
# traceback would hold the module and keep the weak key alive. The gate objects are held so that their
# ids cannot be reused by a replacement while the entry stands.
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _NotResolvedError(ValueError):
    """A module met first inside a torch.compile trace: never run on a fallback instead."""


def _act_id(module):
    # torch 2.11's dynamo cannot trace id(None): a gate-less module has no act_fn.
    act = getattr(module, "act_fn", None)
    return None if act is None else id(act)


def _gate_override(module):
    """The function of an ``_apply_gate`` set on the instance (over the class's), or None: a bound
    method's function, which (unlike the method) holds no reference to the module."""
    f = vars(module).get("_apply_gate")
    return getattr(f, "__func__", f)


def _gate_override_id(module):
    f = _gate_override(module)
    return None if f is None else id(f)


def _signature(module) -> tuple:
    fc1 = getattr(module, "gate_up_proj", None)
    if fc1 is None:
        fc1 = getattr(module, "up_proj", None)
    return (
        tuple(fc1.shape) if isinstance(fc1, Tensor) else None,
        getattr(module, "has_gate", True),
        getattr(module, "is_transposed", False),
        getattr(module, "is_concatenated", True),
        getattr(module, "has_bias", False),
        tuple(getattr(module, flag, default) for flag, default in _OTHER_FLAGS.items()),
        getattr(type(module), "_apply_gate", None),
        _gate_override_id(module),
        _act_id(module),
        tuple(getattr(module, a, None) for a in _LIMIT_ATTRS + _ALPHA_ATTRS),
        tuple(getattr(getattr(getattr(module, "act_fn", None), cap, None), "softcap", None)
              for cap in ("gate_softcap", "up_softcap")),
    )


def _lookup(module):
    """The module's mapping, or the message of the ValueError its mapping raised (cached)."""
    sig = _signature(module)
    hit = _CACHE.get(module)
    if hit is None or hit[0] != sig:
        if torch.compiler.is_compiling():
            # The probe reads values on the host (allclose), which a graph cannot hold.
            raise _NotResolvedError(
                f"{type(module).__name__}: not resolved yet; call moemlp.integrations.transformers.prepare(model) "
                f"(or run one forward) before torch.compile"
            )
        try:
            mapping = _resolve(module)
        except ValueError as e:
            mapping = str(e)
        hit = (sig, mapping, (getattr(module, "act_fn", None), _gate_override(module)))
        _CACHE[module] = hit
    return hit[1]


def resolve_experts(module) -> ExpertsMapping:
    """How ``module`` (a transformers experts module) maps onto ``moemlp.grouped_mlp``; cached per
    module. Raises ValueError naming the module when its layout or gate has no moemlp equivalent."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module (an experts module), got {type(module).__name__}")
    mapping = _lookup(module)
    if isinstance(mapping, str):
        raise ValueError(mapping)
    return mapping


def prepare(model: torch.nn.Module, *, strict: bool = True) -> dict[str, ExpertsMapping]:
    """Resolve every experts module of ``model`` now ({qualified name: mapping}). The first forward
    does this by itself; call it before ``torch.compile``, whose trace cannot run the float64 probe,
    or to see how each module maps. ``strict=False`` leaves out modules that cannot be mapped (a
    ``fallback`` runs them) instead of raising ValueError."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict: expected a bool, got {type(strict).__name__}")
    mappings = {}
    for name, module in model.named_modules():
        # What use_experts_implementation sets on every experts module, beside the weights.
        if not (hasattr(module, "is_transposed") and hasattr(module, "has_bias")
                and isinstance(getattr(module, "down_proj", None), Tensor)):
            continue
        try:
            mappings[name] = resolve_experts(module)
        except ValueError as e:
            if strict:
                raise ValueError(f"model.{name}: {e}") from None
    return mappings


# --- the backend ------------------------------------------------------------------------------


def _routing_probs(top_k_weights: Tensor, top_k_index: Tensor, num_experts: int, dtype: torch.dtype) -> Tensor:
    """(T, K) routing weight of each slot, in fp32 (float64 for float64 experts)."""
    T, K = top_k_index.shape
    if not isinstance(top_k_weights, Tensor) or not top_k_weights.is_floating_point():
        got = top_k_weights.dtype if isinstance(top_k_weights, Tensor) else type(top_k_weights).__name__
        raise TypeError(f"top_k_weights: expected a floating-point tensor, got {got}")
    if top_k_weights.device != top_k_index.device:
        raise TypeError(
            f"top_k_weights: expected a tensor on {top_k_index.device} (top_k_index's device), "
            f"got {top_k_weights.device}"
        )
    if tuple(top_k_weights.shape) == (T, K):  # checked first: with K == E both forms have this shape
        weights = top_k_weights
    elif tuple(top_k_weights.shape) == (T, num_experts):
        # A dense (tokens, E) score matrix: slot k's weight is the score of its expert. Indices
        # outside [0, E) read expert 0's or E-1's score; their rows are dropped by the dispatch anyway.
        weights = top_k_weights.gather(1, top_k_index.clamp(0, num_experts - 1))
    else:
        raise ValueError(
            f"top_k_weights: expected shape (tokens, top_k) = {(T, K)} or (tokens, num_experts) = "
            f"{(T, num_experts)}, got {tuple(top_k_weights.shape)}"
        )
    # fp32: exact from bf16 / fp16, unchanged from fp32. float64 experts keep float64 weights
    # (grouped_mlp takes float64 probs with float64 x); other experts get float64 weights rounded.
    return weights.to(torch.float64 if dtype == torch.float64 else torch.float32)


def _check_routing(hidden_states, top_k_index, hidden: int) -> None:
    if not isinstance(hidden_states, Tensor) or hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
        raise ValueError(
            f"hidden_states: expected shape (tokens, {hidden}), got "
            f"{tuple(hidden_states.shape) if isinstance(hidden_states, Tensor) else type(hidden_states).__name__}"
        )
    if not isinstance(top_k_index, Tensor) or top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(
            f"top_k_index: expected shape (tokens, top_k) with tokens = {hidden_states.shape[0]}, got "
            f"{tuple(top_k_index.shape) if isinstance(top_k_index, Tensor) else type(top_k_index).__name__}"
        )
    if top_k_index.dtype.is_floating_point or top_k_index.dtype.is_complex or top_k_index.dtype == torch.bool:
        raise TypeError(f"top_k_index: expected an integer tensor, got {top_k_index.dtype}")
    if top_k_index.device != hidden_states.device:
        raise TypeError(
            f"top_k_index: expected a tensor on {hidden_states.device} (hidden_states' device), "
            f"got {top_k_index.device}"
        )
    if top_k_index.shape[1] == 0:
        raise ValueError(f"top_k_index: expected at least one slot a token, got shape {tuple(top_k_index.shape)}")


def _run(module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, m: ExpertsMapping,
         recipe, backend: str) -> Tensor:
    fc1 = getattr(module, m.fc1_name)  # (E, N1, H), or (E, H, N1) transposed
    fc2 = module.down_proj  # (E, H, F), or (E, F, H) transposed
    if m.transposed:
        # grouped_mlp's (E, out, in) as views of the stored (E, in, out): read in place, and each
        # weight's gradient comes back as the transposed view of a contiguous (E, in, out) tensor,
        # so neither the forward nor the gradient accumulation copies a weight (gpt-oss-120b: 6.4 GB
        # of experts, bf16).
        fc1, fc2 = fc1.transpose(1, 2), fc2.transpose(1, 2)
    dtype = fc1.dtype
    fc1_bias = fc2_bias = None
    if m.has_bias:
        fc1_bias = getattr(module, f"{m.fc1_name}_bias").to(dtype)  # (E, N1)
        fc2_bias = module.down_proj_bias.to(dtype)  # (E, H)
    num_experts, hidden = fc1.shape[0], fc1.shape[2]
    _check_routing(hidden_states, top_k_index, hidden)
    # A negative index names no expert; sorted as it is it would land in expert 0's rows. Like the
    # expert-parallel sentinels (>= E) it routes nowhere: mapped to E on the device, no host read.
    top_k_index = top_k_index.masked_fill(top_k_index < 0, num_experts)
    probs = _routing_probs(top_k_weights, top_k_index, num_experts, dtype)  # (T, K) fp32 / float64
    # The experts compute in their own dtype (as transformers' grouped_mm casts the input to it).
    x = hidden_states.to(dtype)  # (T, H)
    params = dict(m.activation_params)

    def experts(rows: Tensor, splits: Tensor, probs_perm: Tensor, x_index=None) -> Tensor:
        # rows is x itself and x_index picks each expert-input row from it (no permuted copy of x).
        return grouped_mlp(
            rows, splits, probs_perm, fc1, fc2, fc1_bias, fc2_bias,
            x_index=x_index,
            activation=m.activation,
            activation_params=params,
            glu_interleave=m.glu_interleave,
            scale_fc2_bias=True,
            recipe=recipe,
            backend=backend,
        )

    # Slot indices >= E (transformers' expert-parallel sentinels) sort after every expert and fall
    # past Σsplits: grouped_mlp gives their rows 0, so they add nothing.
    y, _ = local_moe_forward(x, probs, top_k_index, num_experts, experts, use_triton(backend, x.device))
    return y.to(hidden_states.dtype)


def _fallback_forward(module, fallback: str, why: str) -> Callable:
    """The forward that runs ``module`` on ``fallback``: a transformers backend, or for "eager" the
    module class's own forward, which transformers' ``use_experts_implementation`` wraps (functools
    .wraps keeps it as ``__wrapped__``). ValueError when there is none to find."""
    if fallback != "eager":
        return ALL_EXPERTS_FUNCTIONS[fallback]
    own = getattr(type(module).forward, "__wrapped__", None)
    if own is None:
        raise ValueError(f"{why}; and fallback='eager' finds no forward of its own in {type(module).__name__} "
                         f"(its forward is not transformers' use_experts_implementation wrapper)")
    return own


def _make_forward(recipe, backend: str, fallback: Optional[str]) -> Callable:
    warned: set = set()

    def moemlp_experts_forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """transformers experts backend: (tokens, H) hidden states, (tokens, k) expert indices and
        (tokens, k) or (tokens, E) routing weights -> (tokens, H) in hidden_states' dtype."""
        # A module met first inside a torch.compile trace raises (_NotResolvedError: call prepare()),
        # whatever the fallback: running it there would hide that its mapping was never tried.
        mapping = _lookup(self)
        if isinstance(mapping, str):
            if fallback is None:
                raise ValueError(mapping)
            # No warning inside a trace (dynamo cannot trace warnings.warn); an eager forward or
            # prepare(strict=False) shows which modules are left out.
            if not torch.compiler.is_compiling() and type(self) not in warned:
                warned.add(type(self))
                warnings.warn(f"moemlp: {mapping}; running {type(self).__name__} on {fallback!r} instead",
                              stacklevel=2)
            return _fallback_forward(self, fallback, mapping)(self, hidden_states, top_k_index, top_k_weights)
        return _run(self, hidden_states, top_k_index, top_k_weights, mapping, recipe, backend)

    return moemlp_experts_forward


#: The backend with default options (recipe None, backend "auto", no fallback), for registering by hand.
experts_forward = _make_forward(None, "auto", None)

# The names register() has taken: a fallback is one of transformers' backends, not another moemlp one.
_REGISTERED: set = set()


def register(name: str = "moemlp", *, recipe=None, backend: str = "auto", fallback: Optional[str] = None) -> Callable:
    """Register moemlp with transformers' ExpertsInterface under ``name``; models then select it with
    ``experts_implementation=name`` (from_pretrained / from_config) or
    ``model.set_experts_implementation(name)``. Registering a name again replaces its options.

    Args:
        name: the experts_implementation name; not one of transformers' own ("eager", "grouped_mm", ...).
        recipe: passed to grouped_mlp: None, "fp8_block", "mxfp8", "nvfp4" or a recipe object.
        backend: "auto", "torch" or "triton", for grouped_mlp and the dispatch gathers.
        fallback: None (an experts module moemlp cannot map raises ValueError), "eager" (such
            modules run their own forward, the model's code), or the name of a registered
            transformers backend ("grouped_mm", "batched_mm"; not another moemlp registration) that
            such modules run on, with one warning per module class at its first
            eager forward (none inside a torch.compile trace: ``prepare(model, strict=False)`` lists
            the modules it maps). Under torch.compile, call ``prepare`` first: a module met first in
            the trace raises ValueError, fallback or not.

    Experts with quantized weights (an FP8 checkpoint's, with ``*_scale_inv`` tensors) are refused
    with a ValueError; transformers runs those through its own FP8 experts registry, which this does
    not register with.

    Returns:
        The registered forward function.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty str, got {name!r}")
    if name in _BUILTIN_NAMES:
        raise ValueError(f"name: {name!r} is one of transformers' own experts implementations; pick another")
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    if recipe is not None:
        from ..recipes import resolve_recipe

        recipe = resolve_recipe(recipe)  # raises on an unknown recipe, before any model runs
    if fallback is not None:
        if not isinstance(fallback, str):
            raise TypeError(f"fallback: expected None or a str, got {type(fallback).__name__}")
        invalid = fallback == name or fallback in _REGISTERED or fallback not in ALL_EXPERTS_FUNCTIONS
        if fallback != "eager" and invalid:
            known = sorted({"eager"} | {k for k in ALL_EXPERTS_FUNCTIONS if k != name and k not in _REGISTERED})
            raise ValueError(f"fallback: expected None or one of {known}, got {fallback!r}")
    forward = experts_forward if (recipe, backend, fallback) == (None, "auto", None) else _make_forward(
        recipe, backend, fallback
    )
    ExpertsInterface.register(name, forward)
    _REGISTERED.add(name)
    return forward
