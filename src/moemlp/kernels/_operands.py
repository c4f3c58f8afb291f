"""GEMM operands of the Triton grouped MLP under each recipe (SPEC §3), in the form the grouped-GEMM
launchers take them.

Every GEMM of the MLP quantizes both operands along its reduction dim. Two ways to run that:

* native (fp8_block): e4m3 codes and fp32 block scales go to the FP8 mode of
  ``_grouped_gemm_kernel`` (forward and dgrad GEMMs) and to ``_fp8_wgrad`` (weight gradients); the
  partial sums are promoted every 128-deep step. Weights are quantized in 128×128 tiles, which
  serve both the forward (rows n, reduction k) and the dgrad (the same tiles read transposed): the
  dgrad takes a K-major copy of the codes (``codes_t``), since Hopper's e4m3 wgmma reads both
  operands K-major, stored by the same quantizer pass. Once per forward + backward: a forward whose
  backward will run a weight's dgrad quantizes it with both layouts, reads the codes and returns
  codes_t and the scales (``saved_dgrad``, 1 byte + 1/16384 fp32 per element, kept until the
  backward); the backward builds its Weight from them (``dgrad_weights``) and quantizes only a
  weight the forward did not keep. Across the micro-batches of an optimizer step even that pass
  can be skipped: ``moemlp.quantize_weights`` holds both layouts of each weight, and the forward
  builds its Weights from them (``cached_weights``).
* emulated (mxfp8, nvfp4): the bf16 kernels run on each operand's dequantized values
  code·block_scale in bf16; nvfp4's per-tensor factors (1/S_enc of each operand) multiply the fp32
  accumulator (ACC_SCALE) before any epilogue. By default a ``quantize.dequantized*`` pass stores
  the values first. In the forward and dgrad GEMMs the kernel can instead form them in its load
  path from the quantizer's codes and scales (``LOAD_PATH_ACT`` / ``LOAD_PATH_WEIGHT``: the
  kernel's A_DQ / B_DQ), the same bf16 values and so the same result bits; off, since it measured
  slower (the comment at the switches). The weight-gradient GEMMs (operands blocked along the rows
  in the expert-padded layout) always take the pass. Exact for
  nvfp4 and for every bf16/fp16 source; from an fp32 source (z and g_h always, x and weights
  with fp32 compute) mxfp8 values of a block whose amax is ≤ 1.05e-35 can lie below bf16's
  subnormal grid and round to it (absolute error ≤ 2^-134; ``tiny_blocks_exact=False``), instead
  of running the GEMMs on fp32 operands at a fraction of the speed.

Nothing here reads a tensor's values on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import quantize as kq

# mxfp8 / nvfp4: activations (A) and weights (B) of the forward and dgrad GEMMs reach the kernel as
# codes and scales, dequantized in its load path (True), or as bf16 values from a dequantize pass
# (False). Off: on the H200 (triton 3.6, 2026-11-30, benchmarks/bench_load_path.py) the load-path
# FC1 took 19.8 ms (mxfp8) and 42.1 ms (nvfp4) against 6.2 / 6.4 ms for the bf16 kernel on the
# pass's values (mixtral-8x7b), and the whole forward + backward 88.0 / 185.9 ms against 41.4 /
# 50.5 ms with the passes; benchmarks/NOTES.md says what limits it.
LOAD_PATH_ACT = False
LOAD_PATH_WEIGHT = False


def is_native(recipe) -> bool:
    from ..recipes import FP8BlockRecipe

    return isinstance(recipe, FP8BlockRecipe)


def _times(f: Optional[Tensor], g: Optional[Tensor]) -> Optional[Tensor]:
    """The product of two optional 0-d factors (one fp32 rounding), on the device."""
    if f is None:
        return g
    if g is None:
        return f
    return f * g


@dataclass
class ActOperand:
    """A of a grouped GEMM: (M, K) rows grouped by expert, quantized along K."""

    a: Tensor  # e4m3 codes (native), dequantized values, or (dq) mxfp8 / nvfp4 codes as uint8
    scales: Optional[Tensor] = None  # native: (M, ⌈K/128⌉) fp32; dq: (M, ⌈K/B⌉) uint8 scale codes
    factor: Optional[Tensor] = None  # nvfp4: 1/S_enc
    dq: int = 0  # the kernel's A_DQ: 1 mxfp8 / 2 nvfp4 codes dequantized in the load path


@dataclass
class WeightOperand:
    """B of a grouped GEMM: element (n, k) of expert e at e·strides[0] + n·strides[1] + k·strides[2]."""

    b: Tensor
    strides: tuple[int, int, int]
    scales: Optional[Tensor] = None  # native: the 128×128 tile scales ...
    scale_strides: Optional[tuple[int, int, int]] = None  # ... tile (n//128, k//128) of expert e
    factor: Optional[Tensor] = None
    dq: int = 0  # the kernel's B_DQ: b holds codes (strides in bytes), scales their (n, K block) codes


def _factor(q) -> Optional[Tensor]:
    """nvfp4: 1/S_enc of a quantize() result (IEEE division, as the dequantize pass's); else None."""
    return None if q.tensor_scale is None else torch.reciprocal(q.tensor_scale)


def act(t: Tensor, recipe) -> ActOperand:
    if is_native(recipe):
        q = kq.quantize(t, recipe, axis=-1)
        return ActOperand(q.codes, scales=q.scales)
    if LOAD_PATH_ACT:
        q = kq.quantize(t, recipe, axis=-1)
        return ActOperand(q.codes.view(torch.uint8), q.scales.view(torch.uint8), _factor(q), kq.recipe_id(recipe))
    values, factor = kq.dequantized(t, recipe, axis=-1, out_dtype=torch.bfloat16, tiny_blocks_exact=False)
    return ActOperand(values, factor=factor)


class Weight:
    """One expert weight (E, R, C) of the MLP (W1: (E, N1, H), W2: (E, H, F)), prepared lazily for
    the forward GEMM (B(n, k) = W[e, n, k]: reduction over C) and the dgrad GEMM (B(n, k) =
    W[e, k, n]: reduction over R).

    ``quantized``: w's fp8_block tiles quantized already (``quantize_weight(w, recipe)``, with
    ``codes_t`` for the dgrad), checked against w; ``from_saved`` builds one from a forward's
    ``saved()``."""

    def __init__(self, w: Tensor, recipe, quantized=None):
        self.w = w
        self.recipe = recipe
        if quantized is not None:
            _check_tiles(w, recipe, quantized.codes, quantized.codes_t, quantized.scales)
        self._q = quantized

    @classmethod
    def from_saved(cls, w: Tensor, recipe, codes_t: Tensor, scales: Tensor) -> Weight:
        """w with the dgrad operand that a forward kept of it (``saved()``): codes_t (E, C, R)
        float8_e4m3fn and scales (E, ⌈R/128⌉, ⌈C/128⌉) fp32. Its codes are codes_t's transposed
        view: the dgrad reads codes_t alone; ``forward()`` quantizes again (the GEMM takes
        contiguous codes)."""
        _check_tiles(w, recipe, None, codes_t, scales)
        return cls(w, recipe, _tiles_quantized(w, codes_t.transpose(-1, -2), codes_t, scales))

    @classmethod
    def from_cache(cls, w: Tensor, recipe, codes: Tensor, codes_t: Tensor, scales: Tensor) -> Weight:
        """w with both layouts quantized already (``moemlp.quantize_weights``): the forward reads
        ``codes`` and the dgrad ``codes_t``, with no quantizer pass of its own."""
        if not codes.is_contiguous():
            raise ValueError(f"codes: expected a contiguous tensor, got strides {tuple(codes.stride())}")
        return cls(w, recipe, _tiles_quantized(w, codes, codes_t, scales))

    def _quantized(self, transposed: bool):
        """fp8_block's tiles, with the transposed codes when the dgrad asks (one quantizer pass
        either way: the tile kernel stores both layouts)."""
        q = self._q
        if q is None or (transposed and q.codes_t is None) or (not transposed and not q.codes.is_contiguous()):
            self._q = kq.quantize_weight(self.w, self.recipe, transposed=transposed)
        return self._q

    def saved(self) -> list[Tensor]:
        """[codes_t, scales]: the dgrad operand of this weight for a later call (fp8_block). Before
        ``forward()`` this quantizes with both layouts, so the forward GEMM reads the codes of the
        same pass."""
        q = self._quantized(transposed=True)
        return [q.codes_t, q.scales]

    def forward(self) -> WeightOperand:
        E, R, C = self.w.shape
        if is_native(self.recipe):
            q = self._quantized(transposed=False)
            nr, nc = q.scales.shape[1:]
            return WeightOperand(q.codes, (R * C, C, 1), q.scales, (nr * nc, nc, 1))
        if LOAD_PATH_WEIGHT:
            # codes (E, R, C) (nvfp4: (E, R, ⌈C/2⌉)), scales (E, R, ⌈C/B⌉): B(n, k) = W[e, n, k]
            q = kq.quantize(self.w, self.recipe, axis=-1)
            c, s = q.codes.view(torch.uint8), q.scales.view(torch.uint8)
            return WeightOperand(c, tuple(c.stride()), s, tuple(s.stride()), _factor(q), kq.recipe_id(self.recipe))
        values, factor = kq.dequantized_weight(
            self.w, self.recipe, dim=-1, out_dtype=torch.bfloat16, tiny_blocks_exact=False
        )
        return WeightOperand(values, (R * C, C, 1), factor=factor)

    def dgrad(self) -> WeightOperand:
        E, R, C = self.w.shape
        if is_native(self.recipe):
            q = self._quantized(transposed=True)
            nr, nc = q.scales.shape[1:]
            # (E, C, R) K-major codes from the quantizer's transposed store; tile scales read transposed
            return WeightOperand(q.codes_t, (R * C, R, 1), q.scales, (nr * nc, 1, nc))
        if LOAD_PATH_WEIGHT:
            # codes (E, R, C) (nvfp4: (E, ⌈R/2⌉, C)), scales (E, ⌈R/B⌉, C): B(n, k) = W[e, k, n]
            q = kq.quantize(self.w, self.recipe, axis=-2)
            c, s = q.codes.view(torch.uint8), q.scales.view(torch.uint8)
            (ce, cr, cc), (se, sr, sc) = c.stride(), s.stride()
            return WeightOperand(c, (ce, cc, cr), s, (se, sc, sr), _factor(q), kq.recipe_id(self.recipe))
        values, factor = kq.dequantized_weight(
            self.w, self.recipe, dim=-2, out_dtype=torch.bfloat16, tiny_blocks_exact=False
        )
        return WeightOperand(values, (R * C, 1, C), factor=factor)


def _tiles_quantized(w: Tensor, codes: Tensor, codes_t: Tensor, scales: Tensor):
    """The QuantizedTensor of w's fp8_block 128×128 tiles, as quantize_weight returns it."""
    from ..recipes import QuantizedTensor, fp8_block

    return QuantizedTensor(
        codes=codes, scales=scales, shape=tuple(w.shape), axis=-1, block=(128, 128),
        _dequantize=fp8_block._dequantize_tiles, codes_t=codes_t,
    )  # fmt: skip


def _tiles(n: int) -> int:
    """128-wide weight tiles along a dim of n."""
    return -(-n // 128)


def _check_tiles(w: Tensor, recipe, codes: Optional[Tensor], codes_t: Optional[Tensor], scales: Tensor) -> None:
    """fp8_block tiles of w (E, R, C) as quantize_weight stores them, or an error naming what differs."""
    if not is_native(recipe):
        raise ValueError(f"recipe: a Weight takes quantized tiles under fp8_block only, got {recipe!r}")
    if w.dim() != 3:
        raise ValueError(f"w: expected an (E, R, C) expert weight, got shape {tuple(w.shape)}")
    E, R, C = w.shape
    expected = (
        ("codes", codes, (E, R, C), torch.float8_e4m3fn),
        ("codes_t", codes_t, (E, C, R), torch.float8_e4m3fn),
        ("scales", scales, (E, _tiles(R), _tiles(C)), torch.float32),
    )
    for name, t, shape, dtype in expected:
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} for a weight of shape {(E, R, C)}, got {tuple(t.shape)}")
        if t.dtype != dtype or t.device != w.device:
            raise TypeError(f"{name}: expected {dtype} on {w.device}, got {t.dtype} on {t.device}")
        if name != "codes" and not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def _kept(recipe, keep: Optional[Sequence[bool]]) -> Optional[tuple[bool, ...]]:
    """Which weights hand their dgrad operand from the forward to the backward; None: no list at
    all. fp8_block only: its tiles serve both GEMMs, the emulated recipes dequantize each
    orientation from the weight separately."""
    if recipe is None or not is_native(recipe) or keep is None or not any(keep):
        return None
    return tuple(bool(k) for k in keep)


def _not_kept(w: Tensor) -> list[Tensor]:
    return [w.new_empty(0, dtype=torch.float8_e4m3fn), w.new_empty(0, dtype=torch.float32)]


def saved_dgrad(weights: Sequence[Weight], recipe, keep: Optional[Sequence[bool]]) -> list[Tensor]:
    """What a forward hands its backward (``dgrad_weights``) of ``weights`` (W1, W2): [] when it
    keeps nothing, else two tensors per weight, ``Weight.saved()`` where ``keep`` says so and two
    empty tensors where it does not. Call it before the forward GEMMs (one quantizer pass)."""
    kept = _kept(recipe, keep)
    if kept is None:
        return []
    if len(kept) != len(weights):
        raise ValueError(f"keep: expected one flag per weight ({len(weights)}), got {len(kept)}")
    return [t for w, k in zip(weights, kept) for t in (w.saved() if k else _not_kept(w.w))]


def saved_dgrad_like(weights: Sequence[Tensor], recipe, keep: Optional[Sequence[bool]]) -> list[Tensor]:
    """Empty tensors of ``saved_dgrad``'s structure, shapes and dtypes (the forward op's fake)."""
    kept = _kept(recipe, keep)
    if kept is None:
        return []
    out = []
    for w, k in zip(weights, kept):
        if not k:
            out += _not_kept(w)
            continue
        E, R, C = w.shape
        out += [
            w.new_empty((E, C, R), dtype=torch.float8_e4m3fn),
            w.new_empty((E, _tiles(R), _tiles(C)), dtype=torch.float32),
        ]
    return out


def dgrad_weights(ws: Sequence[Tensor], recipe, saved: Sequence[Tensor]) -> list[Weight]:
    """One Weight per tensor of ``ws`` for the backward: from the forward's ``saved_dgrad`` where it
    kept one (checked against the weight), else quantized on first use."""
    if not saved:
        return [Weight(w, recipe) for w in ws]
    if len(saved) != 2 * len(ws):
        raise ValueError(f"saved: expected codes_t and scales of each of {len(ws)} weights, got {len(saved)} tensors")
    pairs = [saved[2 * i : 2 * i + 2] for i in range(len(ws))]
    # An empty pair is a weight the forward did not keep (an empty weight quantizes to nothing anyway).
    return [Weight.from_saved(w, recipe, *p) if p[0].numel() else Weight(w, recipe) for w, p in zip(ws, pairs)]


def cached_weights(ws: Sequence[Tensor], recipe, quantized: Sequence[Tensor]) -> list[Weight]:
    """One Weight per tensor of ``ws`` from ``quantize_weights``' tensors: codes, codes_t and scales
    of each weight in turn (checked against the weight); none of them quantizes again."""
    if len(quantized) != 3 * len(ws):
        raise ValueError(
            f"quantized: expected codes, codes_t and scales of each of {len(ws)} weights, got {len(quantized)} tensors"
        )
    return [Weight.from_cache(w, recipe, *quantized[3 * i : 3 * i + 3]) for i, w in enumerate(ws)]


def gemm_kwargs(a: ActOperand, b: WeightOperand) -> dict:
    """The recipe arguments of ``_grouped_gemm.launch_grouped_gemm`` for A @ B."""
    if a.dq or b.dq:
        return dict(a_scales=a.scales, b_scales=b.scales, b_scale_strides=b.scale_strides, dequant=(a.dq, b.dq),
                    acc_scale=_times(a.factor, b.factor))  # fmt: skip
    if a.scales is not None:
        return dict(a_scales=a.scales, b_scales=b.scales, b_scale_strides=b.scale_strides)
    return dict(acc_scale=_times(a.factor, b.factor))


def wgrad(
    g: Optional[Tensor],
    x: Optional[Tensor],
    splits: Tensor,
    recipe,
    out_dtype: torch.dtype,
    config,
    g_kmajor: Optional[tuple[Tensor, Tensor]] = None,
    x_kmajor: Optional[tuple[Tensor, Tensor]] = None,
    blocks=None,
) -> Tensor:
    """dW (E, g.shape[1], x.shape[1]) in out_dtype: dW[e] = Gq[R_e]ᵀ @ Xq[R_e], both operands
    quantized along the rows in blocks that restart at each expert's first row (g is the gradient:
    nvfp4's stochastic rounding applies to it). fp8_block: ``g_kmajor`` / ``x_kmajor`` (transposed
    codes, scales) of an operand quantized already (the FC2_DGRAD epilogue's ``WgradCodes``) stand
    for it; the other is quantized here. g or x may then be None (not both: T is read from one).
    ``blocks``: ``kq.row_blocks(splits, T, recipe.block)``, shared by the operands of one backward."""
    from . import _grouped_gemm as gg

    if is_native(recipe):
        from ._fp8_wgrad import fp8_block_grouped_wgrad_kmajor

        def kmajor(t, given, is_grad):
            if given is not None:
                return given
            q = kq.quantize_wgrad(t, splits, recipe, is_grad=is_grad, transposed=True, blocks=blocks)
            return q.codes_t, q.scales

        T = (g if g is not None else x).shape[0]
        g_t, g_s = kmajor(g, g_kmajor, True)
        x_t, x_s = kmajor(x, x_kmajor, False)
        return fp8_block_grouped_wgrad_kmajor(g_t, g_s, x_t, x_s, splits, T, out_dtype=out_dtype)
    gv, fg = kq.dequantized_wgrad(
        g, splits, recipe, is_grad=True, out_dtype=torch.bfloat16, tiny_blocks_exact=False, blocks=blocks
    )
    xv, fx = kq.dequantized_wgrad(
        x, splits, recipe, is_grad=False, out_dtype=torch.bfloat16, tiny_blocks_exact=False, blocks=blocks
    )
    dw = torch.empty((splits.shape[0], g.shape[1], x.shape[1]), dtype=out_dtype, device=g.device)
    gg.launch_grouped_wgrad(gv, xv, splits, None, dw, None, False, config, acc_scale=_times(fg, fx))
    return dw
