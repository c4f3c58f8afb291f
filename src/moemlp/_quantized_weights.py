"""quantize_weights(): fp8_block weight tiles quantized once per optimizer step (TransformerEngine's
``is_first_microbatch`` scheme).

Under fp8_block each forward quantizes W1 and W2 in 128×128 tiles, with the codes for the forward
GEMM and the K-major ``codes_t`` for the backward's dgrad from one quantizer pass (kernels/
operands.py). With gradient accumulation the weights do not change between the micro-batches of
an optimizer step, so that pass can run once per step: ``quantize_weights`` does it, and
``grouped_mlp(..., quantized_weights=qw)`` then runs no weight quantization at all, forward or
backward. The object remembers which tensors it was made from (``data_ptr`` and the in-place
version counter ``_version``), so a call after an optimizer step that forgot to quantize again is
an error instead of a silent use of the old weights.

Only fp8_block: mxfp8 and nvfp4 quantize a weight along each GEMM's own reduction dim (rows for
one orientation, columns for the other), so the forward and the dgrad share nothing, and the
Triton path runs them as dequantized bf16 values, computed per GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

__all__ = ["QuantizedWeights", "quantize_weights"]

_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True, eq=False)
class QuantizedWeights:
    """W1's and W2's fp8_block tiles, made by ``quantize_weights``; pass it to ``grouped_mlp``.

    The staleness check sees in-place writes through the version counter: plain and foreach
    optimizers, ``copy_``, ``load_state_dict``. A fused optimizer (``torch.optim.AdamW(fused=True)``,
    torch 2.13) writes the parameters without bumping ``_version``, so after its step the check
    passes: quantize again on each step's first micro-batch (``is_first_microbatch=True``) yourself.

    For each weight (E, R, C): ``codes`` (E, R, C) float8_e4m3fn (the forward GEMM's operand),
    ``codes_t`` (E, C, R) float8_e4m3fn (the same codes K-major, the dgrad's operand) and ``scales``
    (E, ⌈R/128⌉, ⌈C/128⌉) fp32, the dequantization scale of each 128×128 tile. ``recipe_key``: the
    recipe it was quantized with; ``*_version`` / ``*_data_ptr``: the weight tensors' in-place
    version counter and storage address then (version -1: an inference tensor, which has none).
    Holds 2 bytes per weight element (codes and codes_t) for as long as it is kept.
    """

    fc1_codes: Tensor
    fc1_codes_t: Tensor
    fc1_scales: Tensor
    fc2_codes: Tensor
    fc2_codes_t: Tensor
    fc2_scales: Tensor
    recipe_key: str
    fc1_version: int
    fc2_version: int
    fc1_data_ptr: int
    fc2_data_ptr: int

    def tensors(self) -> list[Tensor]:
        """[codes, codes_t, scales] of W1, then of W2: the ``quantized_weights`` list of the ops."""
        return [self.fc1_codes, self.fc1_codes_t, self.fc1_scales, self.fc2_codes, self.fc2_codes_t, self.fc2_scales]

    def check(self, fc1_weight: Tensor, fc2_weight: Tensor, recipe_key: str) -> None:
        """Raise ValueError unless these are the weights quantized, unchanged, under this recipe.
        Host-only (no device sync). Under ``torch.compiler.is_compiling()`` the shapes and devices
        are checked but not the storage address nor the version counter, which the
        compiled graph cannot read: a compiled step must quantize again itself after an update."""
        if recipe_key != self.recipe_key:
            got = repr(recipe_key) if recipe_key else "no recipe"
            raise ValueError(
                f"quantized_weights: quantized under recipe {self.recipe_key!r}, but the call has {got}; "
                f"pass the same recipe"
            )
        for name, w, codes in (("fc1_weight", fc1_weight, self.fc1_codes), ("fc2_weight", fc2_weight, self.fc2_codes)):
            if tuple(w.shape) != tuple(codes.shape) or w.device != codes.device:
                raise ValueError(
                    f"quantized_weights: made from a {name} of shape {tuple(codes.shape)} on {codes.device}, "
                    f"got shape {tuple(w.shape)} on {w.device}"
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


def _version(w: Tensor) -> int:
    """w's in-place version counter (bumped by every in-place op: an optimizer step, copy_,
    load_state_dict); -1 for an inference tensor, which has none."""
    return -1 if w.is_inference() else int(w._version)


def quantize_weights(fc1_weight: Tensor, fc2_weight: Tensor, recipe) -> QuantizedWeights:
    """Quantize W1 and W2 once for the micro-batches of an optimizer step (fp8_block only).

    Args:
        fc1_weight: (E, N1, H) bf16 / fp16 / fp32, as grouped_mlp takes it.
        fc2_weight: (E, H, F), same dtype and device; N1 is F or 2F (GLU).
        recipe: an fp8_block recipe (name or object), the one the calls pass to grouped_mlp.

    Returns a ``QuantizedWeights`` for ``grouped_mlp(..., recipe=recipe, quantized_weights=qw)``,
    valid until the weights change (an optimizer step, any in-place write): grouped_mlp raises
    then. One quantizer pass per weight, on the Triton quantizer where it runs (CUDA, or
    TRITON_INTERPRET=1 on the CPU), else with the torch reference (the same bits, SPEC §3) and
    a transposing copy for codes_t.

    mxfp8 and nvfp4 raise ValueError: each GEMM orientation of a weight has its own block axis
    under them, so there is no quantization that the forward and the backward could share.
    """
    from .recipes import FP8BlockRecipe, resolve_recipe

    if recipe is None:
        raise ValueError("recipe: quantize_weights needs the fp8_block recipe the calls use, got None")
    r = resolve_recipe(recipe)
    if not isinstance(r, FP8BlockRecipe):
        raise ValueError(
            f"recipe: quantize_weights supports fp8_block only, got {r.key!r}: mxfp8 and nvfp4 block a weight "
            f"along each GEMM's own reduction dim (rows for the forward, columns for the dgrad), so the forward "
            f"and the backward share no quantization to keep"
        )
    for name, w in (("fc1_weight", fc1_weight), ("fc2_weight", fc2_weight)):
        if not isinstance(w, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
        if w.dim() != 3:
            raise ValueError(f"{name}: expected 3 dimensions (E, rows, cols), got shape {tuple(w.shape)}")
        if w.dtype not in _WEIGHT_DTYPES:
            raise TypeError(f"{name}: expected dtype bfloat16, float16 or float32 for fp8_block, got {w.dtype}")
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
    q1, q2 = (_quantize(w, r) for w in (fc1_weight, fc2_weight))
    return QuantizedWeights(
        *q1, *q2, recipe_key=r.key, fc1_version=_version(fc1_weight), fc2_version=_version(fc2_weight),
        fc1_data_ptr=fc1_weight.data_ptr(), fc2_data_ptr=fc2_weight.data_ptr(),
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


def _quantize(w: Tensor, r, use_triton: Optional[bool] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(codes, codes_t, scales) of w's 128×128 tiles, contiguous; ``use_triton`` None: the Triton
    quantizer where it runs (tests force either path to compare their bits)."""
    with torch.no_grad():
        w = w.detach().contiguous()
        kq = _triton_quantizer(w.device) if use_triton is not False else None
        if use_triton and kq is None:
            raise RuntimeError(f"the Triton quantizer cannot run on {w.device}")
        if kq is not None:
            q = kq.quantize_weight(w, r, transposed=True)
            return q.codes, q.codes_t, q.scales
        q = r.quantize_weight(w)
        return q.codes.contiguous(), q.codes.transpose(-1, -2).contiguous(), q.scales.contiguous()
