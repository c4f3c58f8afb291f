"""quantize_weights(): the weights' GEMM operands made once per optimizer step (TransformerEngine's
``is_first_microbatch`` scheme), under every recipe.

With gradient accumulation the weights do not change between the micro-batches of an optimizer
step, so the weight passes of each forward + backward can run once per step: ``quantize_weights``
runs them, and ``grouped_mlp(..., quantized_weights=qw)`` then runs none, forward or backward. What
it keeps follows from how the Triton path prepares a weight (kernels/operands.py):

* fp8_block: W1 and W2 quantized in 128×128 tiles, the codes for the forward GEMM and the K-major
  ``codes_t`` for the backward's dgrad from one quantizer pass (``WeightTiles``).
* mxfp8, nvfp4: the GEMMs are emulated on dequantized bf16 values, and each orientation of a weight
  has its own block axis (the forward reduces over its columns, the dgrad over its rows), so the
  two operands share nothing: both are kept, each made by the very call the uncached path makes
  per GEMM (``DequantizedWeight``).

The object remembers which tensors it was made from (``data_ptr`` and the in-place version counter
``_version``), so a call after an optimizer step that forgot to quantize again is an error instead
of a silent use of the old weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

__all__ = ["QuantizedWeights", "quantize_weights"]

_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True, eq=False)
class WeightTiles:
    """fp8_block: one weight (E, R, C) in 128×128 tiles. ``codes`` (E, R, C) float8_e4m3fn (the
    forward GEMM's operand), ``codes_t`` (E, C, R) float8_e4m3fn (the same codes K-major, the
    dgrad's), ``scales`` (E, ⌈R/128⌉, ⌈C/128⌉) fp32, the dequantization scale of each tile.
    2 bytes per weight element."""

    codes: Tensor
    codes_t: Tensor
    scales: Tensor

    @property
    def forward_operand(self) -> Tensor:
        return self.codes

    def tensors(self) -> list[Tensor]:
        """[codes, codes_t, scales]: the dgrad operand last, as ``cached_dgrad`` takes it."""
        return [self.codes, self.codes_t, self.scales]


@dataclass(frozen=True, eq=False)
class DequantizedWeight:
    """mxfp8 / nvfp4: one weight (E, R, C) as the emulated GEMMs read it, both orientations.
    ``forward_values`` (E, R, C) bf16, code·block_scale with blocks along C (the forward GEMM's
    reduction dim), and ``dgrad_values`` (E, R, C) bf16 with blocks along R (the dgrad's): what
    ``kq.dequantized_weight(w, recipe, dim=-1 / -2, out_dtype=bfloat16, tiny_blocks_exact=False)``
    returns. ``*_factor``: nvfp4's 0-d fp32 1/S_enc, which multiplies the GEMM's accumulator;
    under mxfp8, which has none, an empty (0,) fp32 tensor (the custom ops take tensors only).
    4 bytes per weight element: two bf16 copies."""

    forward_values: Tensor
    forward_factor: Tensor
    dgrad_values: Tensor
    dgrad_factor: Tensor

    @property
    def forward_operand(self) -> Tensor:
        return self.forward_values

    def tensors(self) -> list[Tensor]:
        """[forward_values, forward_factor, dgrad_values, dgrad_factor]: the dgrad operand last,
        as ``cached_dgrad`` takes it."""
        return [self.forward_values, self.forward_factor, self.dgrad_values, self.dgrad_factor]


@dataclass(frozen=True, eq=False)
class QuantizedWeights:
    """W1's and W2's GEMM operands, made by ``quantize_weights``; pass it to ``grouped_mlp``.

    ``fc1``, ``fc2``: a ``WeightTiles`` under fp8_block (codes, codes_t and tile scales: 2 bytes per
    weight element), a ``DequantizedWeight`` under mxfp8 and nvfp4 (the forward's and the dgrad's
    bf16 values: 4 bytes per weight element), held for as long as the object is kept.
    ``recipe_key``: the recipe it was made with; ``weight_dtype``: the weights' dtype then;
    ``*_version`` / ``*_data_ptr``: the weight tensors' in-place version counter and storage address
    then (version -1: an inference tensor, which has none).

    The staleness check sees in-place writes through the version counter: plain and foreach
    optimizers, ``copy_``, ``load_state_dict``. A fused optimizer (``torch.optim.AdamW(fused=True)``,
    torch 2.13) and in-place writes through ``.data`` (``param.data.copy_(master)``) change the
    parameters without bumping ``_version``, and inference tensors have no version counter, so after
    such writes the check passes: quantize again on each step's first micro-batch
    (``is_first_microbatch=True``) yourself.
    """

    fc1: Union[WeightTiles, DequantizedWeight]
    fc2: Union[WeightTiles, DequantizedWeight]
    recipe_key: str
    weight_dtype: torch.dtype
    fc1_version: int
    fc2_version: int
    fc1_data_ptr: int
    fc2_data_ptr: int

    def tensors(self) -> list[Tensor]:
        """W1's ``tensors()``, then W2's: the ``quantized_weights`` list of the ops (three tensors per
        weight under fp8_block, four under mxfp8 and nvfp4; kernels.operands.cached_weights)."""
        return [*self.fc1.tensors(), *self.fc2.tensors()]

    def check(self, fc1_weight: Tensor, fc2_weight: Tensor, recipe_key: str) -> None:
        """Raise ValueError unless these are the weights quantized, unchanged, under this recipe.
        Host-only (no device sync). Under ``torch.compiler.is_compiling()`` the shapes, dtypes and
        devices are checked but not the storage address nor the version counter, which the
        compiled graph cannot read: a compiled step must quantize again itself after an update."""
        if recipe_key != self.recipe_key:
            got = repr(recipe_key) if recipe_key else "no recipe"
            raise ValueError(
                f"quantized_weights: quantized under recipe {self.recipe_key!r}, but the call has {got}; "
                f"pass the same recipe"
            )
        for name, w, cached in (("fc1_weight", fc1_weight, self.fc1), ("fc2_weight", fc2_weight, self.fc2)):
            op = cached.forward_operand
            if tuple(w.shape) != tuple(op.shape) or w.device != op.device or w.dtype != self.weight_dtype:
                raise ValueError(
                    f"quantized_weights: made from a {name} of shape {tuple(op.shape)}, {self.weight_dtype} on "
                    f"{op.device}, got shape {tuple(w.shape)}, {w.dtype} on {w.device}"
                )
        if torch.compiler.is_compiling():
            return
        for name, w, ptr, version in (
            ("fc1_weight", fc1_weight, self.fc1_data_ptr, self.fc1_version),
            ("fc2_weight", fc2_weight, self.fc2_data_ptr, self.fc2_version),
        ):
            if w.data_ptr() != ptr or (version >= 0 and _version(w) != version):
                raise ValueError(
                    f"quantized_weights: {name} changed since it was quantized (optimizer step?): quantize again"
                )


def cached_fc1(tensors: Sequence[Tensor]) -> list[Tensor]:
    """W1's tensors of ``QuantizedWeights.tensors()`` (FC1 recomputed in the backward reads them)."""
    return list(tensors[: len(tensors) // 2])


def cached_dgrad(tensors: Sequence[Tensor]) -> list[Tensor]:
    """W1's and W2's dgrad operands in ``QuantizedWeights.tensors()``, two tensors per weight, in the
    form the backward's ``saved`` takes them: (codes_t, scales) under fp8_block, (values, factor)
    under mxfp8 and nvfp4; each weight's last two tensors."""
    half = len(tensors) // 2
    return [*tensors[half - 2 : half], *tensors[-2:]]


def _version(w: Tensor) -> int:
    """w's in-place version counter (bumped by every in-place op: an optimizer step, copy_,
    load_state_dict); -1 for an inference tensor, which has none."""
    return -1 if w.is_inference() else int(w._version)


def quantize_weights(fc1_weight: Tensor, fc2_weight: Tensor, recipe) -> QuantizedWeights:
    """Prepare W1 and W2 once for the micro-batches of an optimizer step.

    Args:
        fc1_weight: (E, N1, H) bf16 / fp16 / fp32, as grouped_mlp takes it.
        fc2_weight: (E, H, F), same dtype and device; N1 is F or 2F (GLU).
        recipe: 'fp8_block', 'mxfp8' or 'nvfp4' (name or object), the one the calls pass to
            grouped_mlp.

    Returns a ``QuantizedWeights`` for ``grouped_mlp(..., recipe=recipe, quantized_weights=qw)``,
    valid until the weights change (an optimizer step, any in-place write): grouped_mlp raises
    then. fp8_block: one quantizer pass per weight (codes and codes_t), kept at 2 bytes per weight
    element. mxfp8 / nvfp4: two dequantizing passes per weight (the forward's and the dgrad's bf16
    values), kept at 4 bytes per weight element. Each pass runs on the Triton quantizer where it runs
    (CUDA, or TRITON_INTERPRET=1 on the CPU), else with the torch reference (the same bits, SPEC §3;
    only the torch backend runs there, and it ignores the values).
    """
    from .recipes import resolve_recipe

    if recipe is None:
        raise ValueError(
            "recipe: quantize_weights needs the recipe the calls use ('fp8_block', 'mxfp8' or 'nvfp4'), got None"
        )
    r = resolve_recipe(recipe)
    for name, w in (("fc1_weight", fc1_weight), ("fc2_weight", fc2_weight)):
        if not isinstance(w, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
        if w.dim() != 3:
            raise ValueError(f"{name}: expected 3 dimensions (E, rows, cols), got shape {tuple(w.shape)}")
        if w.dtype not in _WEIGHT_DTYPES:
            raise TypeError(f"{name}: expected dtype bfloat16, float16 or float32 for {r.name}, got {w.dtype}")
    if fc2_weight.dtype != fc1_weight.dtype:
        raise TypeError(f"fc2_weight: expected dtype {fc1_weight.dtype} (fc1_weight's), got {fc2_weight.dtype}")
    if fc2_weight.device != fc1_weight.device:
        raise TypeError(f"fc2_weight: expected a tensor on {fc1_weight.device} (fc1_weight's), got {fc2_weight.device}")
    E, N1, H = fc1_weight.shape
    F = fc2_weight.shape[2]
    if E < 1:
        raise ValueError(f"fc1_weight: expected at least one expert, got shape {tuple(fc1_weight.shape)}")
    if tuple(fc2_weight.shape[:2]) != (E, H) or N1 not in (F, 2 * F):
        raise ValueError(
            f"fc2_weight: expected shape (E, H, F) = ({E}, {H}, F) with N1 = {N1} equal to F or 2F, "
            f"got {tuple(fc2_weight.shape)}"
        )
    prepare = _quantize if r.native else _dequantize
    return QuantizedWeights(
        prepare(fc1_weight, r), prepare(fc2_weight, r), recipe_key=r.key, weight_dtype=fc1_weight.dtype,
        fc1_version=_version(fc1_weight), fc2_version=_version(fc2_weight), fc1_data_ptr=fc1_weight.data_ptr(),
        fc2_data_ptr=fc2_weight.data_ptr(),
    )  # fmt: skip


def _triton_quantizer(device: torch.device):
    """kernels.quant.api where the Triton quantizer runs on ``device``, else None."""
    try:
        from . import kernels
    except ImportError:
        return None
    if not kernels.is_available(device):
        return None
    from .kernels.quant import api

    return api


def _quantizer(w: Tensor, use_triton: Optional[bool]):
    """kernels.quant.api, or None for the torch reference: ``use_triton`` None picks the Triton
    quantizer where it runs (tests force either path to compare their bits)."""
    kq = _triton_quantizer(w.device) if use_triton is not False else None
    if use_triton and kq is None:
        raise RuntimeError(f"the Triton quantizer cannot run on {w.device}")
    return kq


def _quantize(w: Tensor, r, use_triton: Optional[bool] = None) -> WeightTiles:
    """fp8_block: w's 128×128 tiles, codes, codes_t and scales contiguous."""
    with torch.no_grad():
        w = w.detach().contiguous()
        kq = _quantizer(w, use_triton)
        if kq is not None:
            q = kq.quantize_weight(w, r, transposed=True)
            return WeightTiles(q.codes, q.codes_t, q.scales)
        q = r.quantize_weight(w)
        return WeightTiles(q.codes.contiguous(), q.codes.transpose(-1, -2).contiguous(), q.scales.contiguous())


def _dequantize(w: Tensor, r, use_triton: Optional[bool] = None) -> DequantizedWeight:
    """mxfp8 / nvfp4: w's forward (dim -1) and dgrad (dim -2) operands. On the Triton quantizer these
    are the calls of kernels.operands.Weight.forward() / dgrad(), so the cached GEMMs read the bits
    the uncached ones compute."""
    with torch.no_grad():
        w = w.detach().contiguous()
        kq = _quantizer(w, use_triton)
        operands = []
        for dim in (-1, -2):
            if kq is not None:
                values, factor = kq.dequantized_weight(
                    w, r, dim=dim, out_dtype=torch.bfloat16, tiny_blocks_exact=False
                )
            else:
                values, factor = _reference_operand(w, r, dim)
            # no factor (mxfp8): an empty tensor, since the custom ops carry tensors only
            operands += [values, factor if factor is not None else w.new_empty(0, dtype=torch.float32)]
        return DequantizedWeight(*operands)


def _reference_operand(w: Tensor, r, dim: int) -> tuple[Tensor, Optional[Tensor]]:
    """(values, factor) as ``kq.dequantized_weight(w, r, dim, bfloat16, tiny_blocks_exact=False)``
    gives them, from the torch reference quantizer: code·block_scale rounded to bf16 (exact but for
    mxfp8's tiny blocks from an fp32 source, which both round to bf16's grid) and nvfp4's 1/S_enc;
    values contiguous in w's layout (the reference hands the dim -2 ones back as a moved view)."""
    q = r.quantize_weight(w, dim)
    if q.tensor_scale is None:
        return q.dequantize().to(torch.bfloat16).contiguous(), None
    # nvfp4 dequantizes to code·s·(1/S_enc): with S_enc = 1 it gives code·s, exact in fp32 and bf16
    one = torch.ones((), dtype=torch.float32, device=w.device)
    values = dataclasses.replace(q, tensor_scale=one).dequantize()
    return values.to(torch.bfloat16).contiguous(), one / q.tensor_scale
