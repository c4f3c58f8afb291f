"""GroupedMLP: the expert weights of one MoE layer as an nn.Module over grouped_mlp()."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Optional

import torch
from torch import Tensor, nn

from ._quantized_weights import quantize_weights
from ._validate import _COMPUTE_DTYPES
from .activations import resolve_activation
from .functional import _BACKENDS, _main_grad_weights, grouped_mlp

__all__ = ["GroupedMLP"]


class GroupedMLP(nn.Module):
    """E experts' FC1 → activation · probs → FC2, computed for all experts in one call.

    Parameters: ``fc1_weight`` (E, N1, H), ``fc2_weight`` (E, H, F) and, with ``bias=True``,
    ``fc1_bias`` (E, N1), ``fc2_bias`` (E, H); N1 = 2F for GLU activations. Weights are drawn as
    ``nn.Linear`` draws them per expert (uniform ±1/sqrt(fan_in)), biases start at zero.
    ``recompute_fc1`` and ``accumulate_into_main_grad`` are passed to grouped_mlp (see there);
    with the latter, give each weight an fp32 ``main_grad`` before the first backward.

    Gradient accumulation under a recipe (TransformerEngine's ``is_first_microbatch``): pass
    ``is_first_microbatch=True`` on an optimizer step's first micro-batch and False on the others;
    the weights are then quantized once per step (``moemlp.quantize_weights``, kept on the module
    as the plain attribute ``quantized_weights``, not in the state_dict) instead of in every
    forward. The results are the same bits. It holds 2 bytes per weight element under fp8_block
    (codes and transposed codes), 4 under mxfp8 and nvfp4 (two bf16 copies: the forward's and the
    dgrad's dequantized values) for as long as it is kept.
    """

    def __init__(
        self,
        *,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str = "swiglu",
        activation_params: Optional[Mapping[str, float]] = None,
        bias: bool = False,
        scale_fc2_bias: bool = False,
        glu_interleave: Optional[int] = None,
        recipe=None,
        backend: str = "auto",
        recompute_fc1: bool = False,
        accumulate_into_main_grad: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        for name, v in (("num_experts", num_experts), ("hidden_size", hidden_size),
                        ("ffn_hidden_size", ffn_hidden_size)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name}: expected >= 1, got {v}")
        spec, _ = resolve_activation(activation, activation_params)  # fail at construction
        if glu_interleave is not None and (
            not spec.glu or isinstance(glu_interleave, bool) or not isinstance(glu_interleave, int)
            or glu_interleave < 1 or ffn_hidden_size % glu_interleave
        ):
            raise ValueError(
                f"glu_interleave: expected None or a positive divisor of ffn_hidden_size = "
                f"{ffn_hidden_size} with a GLU activation, got {glu_interleave!r} with {activation!r}"
            )
        if dtype is not None and dtype not in _COMPUTE_DTYPES:
            raise TypeError(f"dtype: expected None or bfloat16, float16, float32 or float64 (the weights' and x's "
                            f"dtype), got {dtype!r}")  # fmt: skip
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend: expected one of {list(_BACKENDS)}, got {backend!r}")
        for name, flag in (("bias", bias), ("scale_fc2_bias", scale_fc2_bias), ("recompute_fc1", recompute_fc1),
                           ("accumulate_into_main_grad", accumulate_into_main_grad)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
        if recipe is not None:
            from .recipes import resolve_recipe

            resolve_recipe(recipe)  # fail at construction, not at the first forward
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        self.activation_params = dict(activation_params or {})
        self.scale_fc2_bias = scale_fc2_bias
        self.glu_interleave = glu_interleave
        self.recipe = recipe
        self.backend = backend
        self.recompute_fc1 = recompute_fc1
        self.accumulate_into_main_grad = accumulate_into_main_grad
        # This module's path in its parent ("shared_experts."), set by the parent: it prefixes the names
        # in main_grad errors, which would otherwise not say which module's weight lacks one.
        self._owner = ""
        # Both weights' GEMM operands under the recipe, set by forward(is_first_microbatch=True); a
        # plain attribute: derived from the weights, so neither a parameter nor a buffer (not saved).
        self.quantized_weights = None
        n1 = 2 * ffn_hidden_size if spec.glu else ffn_hidden_size
        kw = {"device": device, "dtype": dtype}
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, n1, hidden_size, **kw))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size, **kw))
        if bias:
            self.fc1_bias = nn.Parameter(torch.empty(num_experts, n1, **kw))
            self.fc2_bias = nn.Parameter(torch.empty(num_experts, hidden_size, **kw))
        else:
            self.register_parameter("fc1_bias", None)
            self.register_parameter("fc2_bias", None)
        # None: the weights are drawn from the global generator. An int (the MoE layer sets its first
        # global expert under expert parallelism): from a generator seeded with one draw of the global
        # generator plus this offset, so that ranks seeded alike (as their replicated router needs)
        # still hold different experts, and replicas of one expert shard the same ones.
        self.init_offset: Optional[int] = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        gen = None
        if self.init_offset is not None and self.fc1_weight.device.type != "meta":
            seed = int(torch.randint(0, 2**62, (1,)).item())
            gen = torch.Generator(device=self.fc1_weight.device).manual_seed(seed + self.init_offset)
        with torch.no_grad():
            for w in (self.fc1_weight, self.fc2_weight):
                bound = 1.0 / math.sqrt(w.shape[-1])
                w.uniform_(-bound, bound, generator=gen)
            for b in (self.fc1_bias, self.fc2_bias):
                if b is not None:
                    b.zero_()

    def forward(
        self,
        x: Tensor,
        splits: Tensor,
        probs: Optional[Tensor] = None,
        is_first_microbatch: Optional[bool] = None,
        x_index: Optional[Tensor] = None,
    ) -> Tensor:
        """y = grouped_mlp(x, splits, probs, the module's weights and options, x_index=x_index).

        ``is_first_microbatch`` (TransformerEngine's semantics), under a recipe (fp8_block, mxfp8,
        nvfp4): None: quantize the weights in this call, as always. True: quantize them now, keep
        the result on the module (``quantized_weights``) and use it. False: use the kept one,
        quantizing nothing (ValueError when there is none; after an optimizer step without a True
        call since, grouped_mlp finds the weights changed and raises, except after a fused
        optimizer's step, which does not bump the weights' version counter). Without a recipe it is
        accepted and ignored, so that a training loop can pass it whatever the recipe."""
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise TypeError(f"is_first_microbatch: expected None or a bool, got {type(is_first_microbatch).__name__}")
        if self.accumulate_into_main_grad and self._owner:
            _main_grad_weights(self.fc1_weight, self.fc2_weight, self._owner)
        quantized = None
        if is_first_microbatch is not None and self._caches_weights():
            if is_first_microbatch:
                self.quantized_weights = quantize_weights(self.fc1_weight, self.fc2_weight, self.recipe)
            elif self.quantized_weights is None:
                raise ValueError(
                    "is_first_microbatch=False: no weights quantized yet; pass is_first_microbatch=True on the "
                    "first micro-batch of each optimizer step"
                )
            quantized = self.quantized_weights
        return grouped_mlp(
            x,
            splits,
            probs,
            self.fc1_weight,
            self.fc2_weight,
            self.fc1_bias,
            self.fc2_bias,
            activation=self.activation,
            activation_params=self.activation_params,
            glu_interleave=self.glu_interleave,
            scale_fc2_bias=self.scale_fc2_bias,
            recipe=self.recipe,
            backend=self.backend,
            recompute_fc1=self.recompute_fc1,
            accumulate_into_main_grad=self.accumulate_into_main_grad,
            quantized_weights=quantized,
            x_index=x_index,
        )

    def _caches_weights(self) -> bool:
        """Whether is_first_microbatch applies: a recipe quantizes the weights."""
        return self.recipe is not None

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation!r}, "
            f"bias={self.fc1_bias is not None}, recipe={self.recipe!r}, backend={self.backend!r}"
        )
