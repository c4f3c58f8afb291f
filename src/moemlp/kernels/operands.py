"""GEMM operands of the Triton grouped MLP, for the compute dtype and under each recipe (SPEC §3),
and the launches that take them: ``gemm`` (FC1, FC2, FC2_DGRAD, FC1_DGRAD) and ``wgrad`` (a weight
gradient and its bias gradient). The schedule (mlp.py) calls these two and the dprobs reduce; the
recipe decides everything here, through its ``native`` flag.

Without a recipe the operands are the tensors themselves. Under a recipe every GEMM of the MLP
quantizes both operands along its reduction dim, one of two ways:

* native (fp8_block): e4m3 codes and fp32 block scales go to the FP8 mode of the grouped GEMM
  (forward and dgrad GEMMs; FC2 without a bias, FC2_DGRAD and FC1_DGRAD on the Gluon engine's
  FP8 mainloop where it runs, the same bits) and to ``fp8_wgrad`` (weight gradients, on the
  engine where experts are small); the partial sums are promoted every 128-deep step. Weights are quantized in 128×128
  tiles, which serve both the forward (rows n, reduction k) and the dgrad (the same tiles read
  transposed): the dgrad takes a K-major copy of the codes (``codes_t``), since Hopper's e4m3
  wgmma reads both operands K-major, stored by the same quantizer pass. Once per forward + backward: a forward whose
  backward will run a weight's dgrad quantizes it with both layouts, reads the codes and returns
  codes_t and the scales (``saved_dgrad``, 1 byte + 1/16384 fp32 per element, kept until the
  backward); the backward builds its Weight from them (``dgrad_weights``) and quantizes only a
  weight the forward did not keep. Across the micro-batches of an optimizer step even that pass
  can be skipped: ``moemlp.quantize_weights`` holds both layouts of each weight, and the forward
  builds its Weights from them (``cached_weights``).
* emulated (mxfp8, nvfp4): the bf16 kernels run on each operand's dequantized values
  code·block_scale in bf16, and go where bf16 tensors go (the Gluon engine, CUTLASS's weight
  gradients: ``_bf16_values``). nvfp4's per-tensor factors (1/S_enc of each operand) multiply the
  fp32 accumulator before any epilogue: their product (``launch._product``, on the device) is the
  engine kernels' ``acc_scale`` and the Triton kernels' ACC_SCALE, which apply it alike; CUTLASS
  (``torch._grouped_mm``) cannot, so an nvfp4 weight gradient that the engine does not take runs on
  the Triton kernel. A
  ``quantize.dequantized*`` pass stores the values first (docs/DECISIONS.md: forming them in the
  GEMM's load path was slower); a weight's two orientations (blocks along its columns for the
  forward, along its rows for the dgrad) are two passes, both of which ``moemlp.quantize_weights``
  can run once per optimizer step instead (``cached_weights``; the backward's dgrads read them
  through ``dgrad_weights``). Exact for
  nvfp4 and for every bf16/fp16 source; from an fp32 source (z and g_h always, x and weights
  with fp32 compute) mxfp8 values of a block whose amax is ≤ 1.05e-35 can lie below bf16's
  subnormal grid and round to it (absolute error ≤ 2^-134; ``tiny_blocks_exact=False``), instead
  of running the GEMMs on fp32 operands at a fraction of the speed.

Nothing here reads a tensor's values on the host.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import gluon
from .gemm import launch
from .quant import api as kq


def is_native(recipe) -> bool:
    """Whether recipe's GEMMs run on its codes (FP8 tensor cores) rather than on exact bf16 values."""
    return recipe is not None and recipe.native


@dataclass
class ActOperand:
    """A of a grouped GEMM: (M, K) rows grouped by expert, quantized along K."""

    a: Tensor  # (M, K) e4m3 codes (native) or dequantized bf16 values
    scales: Optional[Tensor] = None  # native: (M, ⌈K/128⌉) fp32
    factor: Optional[Tensor] = None  # nvfp4: 1/S_enc
    routed_amax: Optional[Tensor] = None  # act(..., splits): the amax of the rows below Σsplits


@dataclass
class WeightOperand:
    """B of a grouped GEMM: element (n, k) of expert e at e·strides[0] + n·strides[1] + k·strides[2]."""

    b: Tensor
    strides: tuple[int, int, int]
    scales: Optional[Tensor] = None  # native: the 128×128 tile scales ...
    scale_strides: Optional[tuple[int, int, int]] = None  # ... tile (n//128, k//128) of expert e
    factor: Optional[Tensor] = None


def one_read(recipe) -> bool:
    """Whether a tensor that a GEMM reads along K and a weight gradient along its rows (dy, g_h) takes
    both operands from one values pass (``both``): the emulated recipes, whose operands are values
    in the tensor's own layout, mxfp8's and nvfp4's without the Hadamard option (whose wgrad amax
    is taken after the rotation; kernels/quant ``dequantized_both``)."""
    return recipe is not None and (recipe.name == "mxfp8" or (recipe.name == "nvfp4" and not recipe.hadamard))


def both(t: Tensor, splits: Tensor, recipe, blocks: WgradBlocks) -> tuple[ActOperand, tuple[Tensor, Optional[Tensor]]]:
    """(``act(t, recipe, splits)``, the (values, factor) that ``wgrad`` makes of t as its gradient operand),
    the same bits, from one values pass over t (``one_read`` recipes): pass the second as ``wgrad``'s
    ``g_values``."""
    rows, rows_factor, values, factor = kq.dequantized_both(
        t, splits, recipe, is_grad=True, out_dtype=torch.bfloat16, tiny_blocks_exact=False, blocks=blocks.get()
    )
    return ActOperand(rows, factor=rows_factor), (values, factor)


def fc1_z(x_op: ActOperand, b_op: WeightOperand, weight: Weight, h: Tensor, bias: Optional[Tensor], F: int,
          cfg) -> tuple[Tensor, bool]:
    """FC1's z (M, F) for the forward, and whether it holds mxfp8's values: under mxfp8, where FC1
    runs on the engine (``engine_kernel``), its epilogue writes FC2's operand in bf16 (``gluon.fc1``'s
    ``z_mx``: the bits ``act`` would make of the fp32 z) instead of the fp32 z and a pass over it; else
    z in the compute dtype, or fp32 under a recipe (the unrounded values it quantizes)."""
    M = h.shape[0]
    r = cfg.recipe
    if r is not None and r.name == "mxfp8":
        z = torch.empty((M, F), dtype=torch.bfloat16, device=h.device)
        if engine_kernel("fc1", x_op, b_op, weight, out=h, bias=bias, h=None, z=z, cfg=cfg) == "fc1":
            return z, True
    return torch.empty((M, F), dtype=h.dtype if r is None else torch.float32, device=h.device), False


def takes_routed_amax(recipe) -> bool:
    """Whether a weight-gradient operand under recipe can take its tensor amax from a forward's pass
    (``act(t, recipe, splits)``'s ``routed_amax``): nvfp4 without the Hadamard option, whose wgrad
    amax is that of the rows below Σsplits as they are."""
    return recipe is not None and recipe.name == "nvfp4" and not recipe.hadamard


def act(t: Tensor, recipe, splits: Tensor) -> ActOperand:
    """t's operand for a GEMM that reads it along K, t's rows grouped by expert by ``splits``. Under
    nvfp4 the per-tensor amax is that of t's rows below Σsplits (``routed_amax``), as the
    reference quantizes only the routed rows: capacity rows belong to no expert (SPEC §1), so
    whatever they hold moves no routed row's result. For ``takes_routed_amax`` recipes that amax is
    also the one the backward's weight-gradient operand of the same t takes (``wgrad``'s
    ``x_amax``), handed on as ``routed_amax``."""
    if recipe is None:
        return ActOperand(t)
    if not is_native(recipe):
        routed = kq.routed_amax(t, splits) if recipe.name == "nvfp4" else None
        values, factor = kq.dequantized(t, recipe, axis=-1, out_dtype=torch.bfloat16, tiny_blocks_exact=False,
                                        amax=routed)  # fmt: skip
        return ActOperand(values, factor=factor, routed_amax=routed if takes_routed_amax(recipe) else None)
    q = kq.quantize(t, recipe, axis=-1)
    return ActOperand(q.codes, scales=q.scales)


class Weight:
    """One expert weight (E, R, C) of the MLP (W1: (E, N1, H), W2: (E, H, F)), prepared lazily for
    the forward GEMM (B(n, k) = W[e, n, k]: reduction over C) and the dgrad GEMM (B(n, k) =
    W[e, k, n]: reduction over R).

    ``quantized``: w's fp8_block tiles quantized already (``quantize_weight(w, recipe)``, with
    ``codes_t`` for the dgrad), checked against w; ``from_saved`` builds one from a forward's
    ``saved()``. ``dequantized``: under mxfp8 / nvfp4, {dim: (values, factor)} of the orientations
    dequantized already (dim -1 the forward's, -2 the dgrad's; ``from_dequantized``)."""

    def __init__(self, w: Tensor, recipe, quantized=None, dequantized=None):
        self.w = w
        self.recipe = recipe
        if quantized is not None:
            _check_tiles(w, recipe, quantized.codes, quantized.codes_t, quantized.scales)
        self._q = quantized
        for dim, (values, factor) in (dequantized or {}).items():
            _check_dequantized(w, recipe, dim, values, factor)
        self._dequantized = dict(dequantized or {})

    @classmethod
    def from_saved(cls, w: Tensor, recipe, codes_t: Tensor, scales: Tensor) -> Weight:
        """w with the dgrad operand that a forward kept of it (``saved()``): codes_t (E, C, R)
        float8_e4m3fn and scales (E, ⌈R/128⌉, ⌈C/128⌉) fp32. Its codes are codes_t's transposed
        view: the dgrad reads codes_t alone; ``forward()`` quantizes again (the GEMM takes
        contiguous codes)."""
        _check_tiles(w, recipe, None, codes_t, scales)
        return cls(w, recipe, _tiles_quantized(w, recipe, codes_t.transpose(-1, -2), codes_t, scales))

    @classmethod
    def from_cache(cls, w: Tensor, recipe, codes: Tensor, codes_t: Tensor, scales: Tensor) -> Weight:
        """w with both layouts quantized already (``moemlp.quantize_weights``): the forward reads
        ``codes`` and the dgrad ``codes_t``, with no quantizer pass of its own."""
        if not codes.is_contiguous():
            raise ValueError(f"codes: expected a contiguous tensor, got strides {tuple(codes.stride())}")
        return cls(w, recipe, _tiles_quantized(w, recipe, codes, codes_t, scales))

    @classmethod
    def from_dequantized(cls, w: Tensor, recipe, forward=None, dgrad=None) -> Weight:
        """w under mxfp8 / nvfp4 with its forward and / or dgrad operand dequantized already
        (``moemlp.quantize_weights``): each a pair (values, factor) of ``dequantized_weight``'s
        form, values (E, R, C) bf16 and factor nvfp4's 0-d fp32 1/S_enc, or for mxfp8 an empty
        tensor (the ops' form of None). An orientation not given is dequantized on use."""
        given = {}
        for dim, op in ((-1, forward), (-2, dgrad)):
            if op is not None:
                values, factor = op
                given[dim] = (values, _factor(factor))
        return cls(w, recipe, dequantized=given)

    def _dequantized_values(self, dim: int) -> tuple[Tensor, Optional[Tensor]]:
        """(values, factor) of the emulated GEMM operand with blocks along ``dim``: the cached one,
        else one dequantizing pass (not kept: each orientation is read by one GEMM per call)."""
        cached = self._dequantized.get(dim)
        if cached is not None:
            return cached
        return kq.dequantized_weight(self.w, self.recipe, dim=dim, out_dtype=torch.bfloat16, tiny_blocks_exact=False)

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
        if self.recipe is None:
            return _in_place(self.w, dgrad=False)
        if is_native(self.recipe):
            q = self._quantized(transposed=False)
            nr, nc = q.scales.shape[1:]
            return WeightOperand(q.codes, (R * C, C, 1), q.scales, (nr * nc, nc, 1))
        values, factor = self._dequantized_values(-1)
        return WeightOperand(values, (R * C, C, 1), factor=factor)

    def dgrad(self) -> WeightOperand:
        E, R, C = self.w.shape
        if self.recipe is None:
            return _in_place(self.w, dgrad=True)
        if is_native(self.recipe):
            q = self._quantized(transposed=True)
            nr, nc = q.scales.shape[1:]
            # (E, C, R) K-major codes from the quantizer's transposed store; tile scales read transposed
            return WeightOperand(q.codes_t, (R * C, R, 1), q.scales, (nr * nc, 1, nc))
        values, factor = self._dequantized_values(-2)
        return WeightOperand(values, (R * C, 1, C), factor=factor)


def _in_place(w: Tensor, dgrad: bool) -> WeightOperand:
    """The weight w (E, R, C) as B of the forward GEMM (B(n, k) = w[e, n, k]) or of the dgrad
    (B(n, k) = w[e, k, n]), read where it lies. w is contiguous, or the transposed view of a
    contiguous (E, C, R) tensor (transformers' is_transposed experts; _validate.weight_is_transposed).
    ``b`` is always the contiguous tensor itself, with dims (E, N, K) when K is its last (K-major:
    the forward of a contiguous weight, the dgrad of a transposed one), else (E, K, N): the two
    shapes the TMA descriptors of launch_grouped_gemm take."""
    stored = w if w.is_contiguous() else w.transpose(1, 2)  # contiguous (E, A, B)
    _, A, B = stored.shape
    k_major = w.is_contiguous() != dgrad
    return WeightOperand(stored, (A * B, B, 1) if k_major else (A * B, 1, B))


def _tiles_quantized(w: Tensor, recipe, codes: Tensor, codes_t: Tensor, scales: Tensor):
    """The QuantizedTensor of w's fp8_block 128×128 tiles, as quantize_weight returns it."""
    from ..recipes import QuantizedTensor

    return QuantizedTensor.of(recipe, codes, scales, w.shape, -1, (128, 128), codes_t=codes_t)


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


def _factor(t: Tensor) -> Optional[Tensor]:
    """The launcher's factor (None: none) from the ops' form of it, where none is an empty tensor."""
    return None if t.numel() == 0 else t


def _check_dequantized(w: Tensor, recipe, dim: int, values: Tensor, factor: Optional[Tensor]) -> None:
    """An emulated recipe's operand of w (E, R, C) as ``dequantized_weight(w, recipe, dim,
    bfloat16)`` returns it, or an error naming what differs."""
    if recipe is None or is_native(recipe):
        raise ValueError(f"recipe: a Weight takes dequantized values under mxfp8 or nvfp4 only, got {recipe!r}")
    if dim not in (-1, -2):
        raise ValueError(f"dim: expected -1 (the forward's operand) or -2 (the dgrad's), got {dim}")
    if tuple(values.shape) != tuple(w.shape):
        raise ValueError(f"values: expected shape {tuple(w.shape)} (the weight's), got {tuple(values.shape)}")
    if values.dtype != torch.bfloat16 or values.device != w.device:
        raise TypeError(f"values: expected torch.bfloat16 on {w.device}, got {values.dtype} on {values.device}")
    if not values.is_contiguous():
        raise ValueError(f"values: expected a contiguous tensor, got strides {tuple(values.stride())}")
    from ..recipes import NVFP4Recipe

    per_tensor = isinstance(recipe, NVFP4Recipe)  # nvfp4's 1/S_enc; mxfp8's scales are all per block
    if per_tensor and (
        factor is None or factor.shape != () or factor.dtype != torch.float32 or factor.device != w.device
    ):
        got = "none" if factor is None else f"{factor.dtype} of shape {tuple(factor.shape)} on {factor.device}"
        raise ValueError(f"factor: {recipe.key} expects a 0-d float32 1/S_enc on {w.device}, got {got}")
    if not per_tensor and factor is not None:
        raise ValueError(f"factor: {recipe.key} has no per-tensor factor, got a tensor of shape {tuple(factor.shape)}")


def _kept(recipe, keep: Optional[Sequence[bool]]) -> Optional[tuple[bool, ...]]:
    """Which weights hand their dgrad operand from the forward to the backward; None: no list at
    all. fp8_block only: its tiles serve both GEMMs, the emulated recipes dequantize each
    orientation from the weight separately."""
    if not is_native(recipe) or keep is None or not any(keep):
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
    """One Weight per tensor of ``ws`` for the backward, from two tensors per weight in ``saved``
    where there are: fp8_block's codes_t and scales (the forward's ``saved_dgrad``, or
    ``quantize_weights``' tiles), mxfp8's / nvfp4's dgrad values and factor (``quantize_weights``'
    only: their forward keeps nothing); checked against the weight. Else quantized on first use."""
    if not saved:
        return [Weight(w, recipe) for w in ws]
    if len(saved) != 2 * len(ws):
        what = "codes_t and scales" if is_native(recipe) else "the dgrad values and factor"
        raise ValueError(f"saved: expected {what} of each of {len(ws)} weights, got {len(saved)} tensors")
    pairs = [saved[2 * i : 2 * i + 2] for i in range(len(ws))]
    # An empty pair is a weight the forward did not keep (an empty weight quantizes to nothing anyway).
    if not is_native(recipe):
        return [Weight.from_dequantized(w, recipe, dgrad=p) if p[0].numel() else Weight(w, recipe)
                for w, p in zip(ws, pairs)]  # fmt: skip
    return [Weight.from_saved(w, recipe, *p) if p[0].numel() else Weight(w, recipe) for w, p in zip(ws, pairs)]


def weights(ws: Sequence[Tensor], recipe, quantized: Sequence[Tensor] = ()) -> list[Weight]:
    """One Weight per tensor of ``ws`` for a forward: from ``quantize_weights``' tensors when a
    recipe runs and they are given (``cached_weights``), else quantized on first use."""
    if recipe is not None and quantized:
        return cached_weights(ws, recipe, quantized)
    return [Weight(w, recipe) for w in ws]


def cached_weights(ws: Sequence[Tensor], recipe, quantized: Sequence[Tensor]) -> list[Weight]:
    """One Weight per tensor of ``ws`` from ``quantize_weights``' tensors (``QuantizedWeights.tensors()``),
    each weight's in turn, checked against the weight; none of them quantizes again. fp8_block:
    codes, codes_t and scales; mxfp8 / nvfp4: the forward's values and factor, then the dgrad's."""
    native = is_native(recipe)
    per = 3 if native else 4
    if len(quantized) != per * len(ws):
        what = "codes, codes_t and scales" if native else "forward values and factor, dgrad values and factor"
        raise ValueError(f"quantized: expected {what} of each of {len(ws)} weights, got {len(quantized)} tensors")
    groups = [quantized[per * i : per * i + per] for i in range(len(ws))]
    if native:
        return [Weight.from_cache(w, recipe, *g) for w, g in zip(ws, groups)]
    return [Weight.from_dequantized(w, recipe, forward=g[:2], dgrad=g[2:]) for w, g in zip(ws, groups)]


def gemm(
    kind: str,  # "fc1", "fc2", "fc2_dgrad" or "fc1_dgrad"
    a: Tensor,  # (M, K) rows grouped by expert: x | z | dy | g_h, compute dtype (fp32 z / g_h under a recipe)
    weight: Weight,  # W1 for fc1 / fc1_dgrad, W2 for fc2 / fc2_dgrad
    **launch_args,  # gemm_on's
) -> Optional[Tensor]:
    """One grouped-GEMM launch of the MLP, A quantized first under cfg.recipe (``act``), then
    ``gemm_on``. Returns the dprobs partials when asked, else None."""
    return gemm_on(kind, act(a, launch_args["cfg"].recipe, launch_args["splits"]), weight, **launch_args)


def gemm_on(
    kind: str,  # "fc1", "fc2", "fc2_dgrad" or "fc1_dgrad"
    a_op: ActOperand,  # A as ``act`` gives it: the tensor itself, or the recipe's codes / values
    weight: Weight,  # W1 for fc1 / fc1_dgrad, W2 for fc2 / fc2_dgrad
    *,
    splits: Tensor,  # (E,)
    out: Tensor,  # h (M, N1) | y (M, H) | g_h (M, N1) | dx (M, H)
    N: int,
    K: int,
    N1: int,
    cfg,  # MLPConfig
    probs: Optional[Tensor] = None,  # (M,)
    bias: Optional[Tensor] = None,  # fc1_bias (fc1) | fc2_bias (fc2)
    z: Optional[Tensor] = None,  # (M, F) stored by fc1 (FC2's input) and fc2_dgrad (dW2's)
    h: Optional[Tensor] = None,  # (M, N1) read by fc2_dgrad
    dprobs_partials: bool = False,  # fc2_dgrad: return the dprobs partials
    b_op: Optional[WeightOperand] = None,  # the weight's operand made already (``fc1_z``), else made here
    z_values: bool = False,  # fc1: z as mxfp8's values, FC2's operand (``fc1_z`` said the engine runs it)
) -> Optional[Tensor]:
    """A @ B with B(n, k) = W[e, n, k] (fc1, fc2) or W[e, k, n] (the dgrads), on A as given and the
    weight's operand under cfg.recipe. Returns the dprobs partials when asked
    (``launch.launch_dprobs_reduce`` sums them), else None. The kernel is ``engine_kernel``'s choice:
    a Gluon kernel where it takes the GEMM, else the Triton kernel."""
    params = tuple(cfg.activation_params) + (0.0,) * (3 - len(cfg.activation_params))
    if b_op is None:
        b_op = weight.forward() if kind in ("fc1", "fc2") else weight.dgrad()
    engine = engine_kernel(kind, a_op, b_op, weight, out=out, bias=bias, h=h, z=z, cfg=cfg)
    if z_values and engine != "fc1":
        raise ValueError("z_values: mxfp8's z values come from FC1 on the engine only (fc1_z)")
    # nvfp4's factors: their product (one fp32 rounding, on the device), taken once for either kernel,
    # the engine's acc_scale or the Triton kernel's ACC_SCALE (None without a factor)
    acc_scale = launch._product((a_op.factor, b_op.factor))
    if engine == "fc2_dgrad":
        return gluon.fc2_dgrad(
            a_op.a, _fc2_dgrad_w2(weight, b_op, cfg), splits, h, out, z=z, probs=probs, dprobs_partials=dprobs_partials,
            glu_interleave=cfg.glu_interleave, activation_id=cfg.activation.kernel_id, params=params,
            acc_scale=acc_scale,
        )  # fmt: skip
    if engine == "fc2_dgrad_fp8":
        return gluon.fc2_dgrad(
            a_op.a, b_op.b.transpose(1, 2), splits, h, out, z=z, probs=probs, dprobs_partials=dprobs_partials,
            glu_interleave=cfg.glu_interleave, activation_id=cfg.activation.kernel_id, params=params,
            dy_scale=a_op.scales, w2_scale=_tile_scales(b_op, N, K),
        )  # fmt: skip
    if engine == "fc1":
        if is_native(cfg.recipe):
            scales = dict(x_scale=a_op.scales, w1_scale=_tile_scales(b_op, N1, K))
        else:
            scales = dict(acc_scale=acc_scale, **({"z_mx": True} if z_values else {}))
        gluon.fc1(a_op.a, b_op.b, splits, out, z=z, bias=bias, probs=probs, glu_interleave=cfg.glu_interleave,
                  activation_id=cfg.activation.kernel_id, params=params, **scales)  # fmt: skip
        return None
    if engine == "grouped_gemm":
        gluon.grouped_gemm(a_op.a, b_op.b, splits, out, b_layout=_plain_layout(b_op, N, K), cooperative=True,
                           acc_scale=acc_scale)  # fmt: skip
        return None
    if engine == "grouped_gemm_fp8":
        gluon.grouped_gemm_fp8(a_op.a, a_op.scales, b_op.b, _tile_scales(b_op, N, K), splits, out,
                               out_dtype=out.dtype)  # fmt: skip
        return None
    emulated = cfg.recipe is not None and not is_native(cfg.recipe)
    return launch.launch_grouped_gemm(
        kind, a=a_op.a, b=b_op.b, b_strides=b_op.strides, splits=splits, out=out, N=N, K=K, N1=N1, cfg=cfg,
        emulated=emulated, probs=probs, bias=bias, scale_bias=kind == "fc2" and cfg.scale_fc2_bias, z=z, h=h,
        dprobs_partials=dprobs_partials, a_scales=a_op.scales, b_scales=b_op.scales,
        b_scale_strides=b_op.scale_strides, acc_factors=(acc_scale,),
    )  # fmt: skip


def engine_kernel(kind: str, a_op: ActOperand, b_op: WeightOperand, weight: Weight, *, out: Tensor,
                  bias: Optional[Tensor], h: Optional[Tensor], z: Optional[Tensor], cfg) -> str:
    """The Gluon kernel that runs this GEMM, "" for the Triton kernel: FC1 with its GLU epilogue
    ("fc1": fp8_block's codes, and bf16 where K ≤ FC1_ENGINE_MAX_K), FC2_DGRAD with its fused
    epilogue on bf16 ("fc2_dgrad") and on fp8_block's codes ("fc2_dgrad_fp8"), and fp8_block's FC2
    without a bias and FC1_DGRAD ("grouped_gemm_fp8"), and bf16's FC2 without a bias and FC1_DGRAD
    on large experts ("grouped_gemm", ``_engine_plain``), where ``_gluon_on`` and
    ``gluon.*_supports`` allow. An emulated recipe's bf16 values (``_bf16_values``) take the bf16
    choices, with its fp32 z and g_h, and nvfp4's factors as the kernels' ``acc_scale``. The Triton
    kernels give the same bits (tests/kernels/test_gluon_*.py)."""
    plain = _bf16_values(cfg)
    if not _gluon_on(a_op.a):
        return ""
    if kind == "fc1":
        return "fc1" if _engine_fc1(a_op, b_op, out, z, bias, cfg) else ""
    if plain:
        if kind == "fc2_dgrad":
            return "fc2_dgrad" if _engine_fc2_dgrad(a_op.a, _fc2_dgrad_w2(weight, b_op, cfg), h, out, z, cfg) else ""
        if kind in ("fc2", "fc1_dgrad") and bias is None and _engine_plain(a_op.a, b_op, out):
            return "grouped_gemm"
        return ""
    if kind == "fc2_dgrad":
        # W2's K-major codes (E, F, H) as the (E, H, F) weight they transpose
        why = gluon.fc2_dgrad_fp8_supports(a_op.a, b_op.b.transpose(1, 2), h, cfg.activation.kernel_id, cfg.glu,
                                           (out, z))  # fmt: skip
        return "" if why else "fc2_dgrad_fp8"
    if kind in ("fc2", "fc1_dgrad") and bias is None and not gluon.fp8_supports(a_op.a, b_op.b, out):
        return "grouped_gemm_fp8"
    return ""


def _bf16_values(cfg) -> bool:
    """Whether a GEMM's operands are bf16 values that the bf16 kernels take: no recipe, or an emulated
    recipe's dequantized values, mxfp8's as they are, nvfp4's with the product of their per-tensor
    factors multiplying the accumulator before any epilogue (the engine kernels' ``acc_scale``, the
    Triton kernels' ACC_SCALE: the same fp32 product). SPEC §3: a bf16 tensor-core product with fp32
    accumulation of those values, times the factors, is the recipe's GEMM."""
    return not is_native(cfg.recipe)


def _fc2_dgrad_w2(weight: Weight, b_op: WeightOperand, cfg) -> Tensor:
    """W2 as the engine's bf16 FC2_DGRAD reads it, (E, H, F): the weight itself (contiguous, or the
    transposed view of a contiguous (E, F, H)), or an emulated recipe's dgrad values, which the
    dequantizer stores contiguous in W2's shape."""
    return weight.w if cfg.recipe is None else b_op.b


# bf16 FC1 on the engine's ping-pong tiles up to this K (H): there its 128 × 128 tiles overlap each
# tile's GLU epilogue with the other consumer's mainloop and measured 1.02–1.15× the Triton kernel; at
# H = 7168 (deepseek-v3) the long K loop dominates and the Triton kernel's tiles were faster (0.94×).
# Where it takes the cooperative 128 × 256 tiles (``gluon.fc1_cooperative``) bf16 FC1 runs on the
# engine at any K: at deepseek-v3 they measured 1.13× the Triton kernel. fp8_block's FC1 measured
# 1.27–1.47× on the engine at every shape (docs/DECISIONS.md).
FC1_ENGINE_MAX_K = 4096


def _engine_fc1(a_op: ActOperand, b_op: WeightOperand, h: Tensor, z: Optional[Tensor], bias: Optional[Tensor],
                cfg) -> bool:
    """Whether FC1 runs on the engine (``gluon.fc1``): fp8_block's codes, or bf16 where it takes
    cooperative tiles or K ≤ FC1_ENGINE_MAX_K, a contiguous bias, and the operands
    ``gluon.fc1_supports`` takes."""
    if not is_native(cfg.recipe) and a_op.a.shape[1] > FC1_ENGINE_MAX_K:
        fp32_z = z is not None and z.dtype == torch.float32
        if not gluon.fc1_cooperative(a_op.a.shape[0], b_op.b.shape[0], False, fp32_z, cfg.glu_interleave):
            return False
    if bias is not None and not bias.is_contiguous():
        return False
    return not gluon.fc1_supports(a_op.a, b_op.b, h, z, cfg.activation.kernel_id, cfg.glu, cfg.glu_interleave)


def _gluon_on(t: Tensor) -> bool:
    """Whether the Gluon engine may run the GEMMs of tensors on t's device: CUDA, unless MOEMLP_GLUON=0
    (``gluon.*_supports`` then ask for an sm_90 GPU whose triton has Gluon's Hopper API, and the
    shapes). The Triton kernels it replaces give the same bits (tests/kernels/test_gluon_*.py)."""
    return t.device.type == "cuda" and os.environ.get("MOEMLP_GLUON", "1") != "0"


def _tile_scales(b_op: WeightOperand, N: int, K: int) -> Tensor:
    """fp8_block's 128×128 tile scales of B as the (E, ⌈N/128⌉, ⌈K/128⌉) view the engine reads:
    tile (n//128, k//128) of expert e where ``b_op.scale_strides`` put it (transposed for a dgrad)."""
    return torch.as_strided(b_op.scales, (b_op.scales.shape[0], _tiles(N), _tiles(K)), b_op.scale_strides)


def _plain_layout(b_op: WeightOperand, N: int, K: int) -> str:
    """B as the engine's plain GEMM reads it: "nk" (the contiguous (E, N, K) weight: FC2's W2), "kn"
    (the contiguous (E, K, N) weight read in place: FC1_DGRAD's W1), or "" (any other strides: a
    transposed-layout weight)."""
    b = b_op.b
    if b.dim() != 3 or not b.is_contiguous():
        return ""
    E = b.shape[0]
    if tuple(b.shape) == (E, N, K) and tuple(b_op.strides) == (N * K, K, 1):
        return "nk"
    if tuple(b.shape) == (E, K, N) and tuple(b_op.strides) == (K * N, 1, N):
        return "kn"
    return ""


def _engine_plain(a: Tensor, b_op: WeightOperand, out: Tensor) -> bool:
    """Whether bf16's FC2 (no bias) or FC1_DGRAD runs on the engine's plain GEMM, on cooperative
    128 × 256 tiles: where ``gluon.supports`` takes the operands (a weight in its own layout, not a
    transposed one); the Triton kernel elsewhere, which gives the same bits (one K-ordered chain of
    tensor-core products per element)."""
    if not _gluon_on(a) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        return False
    N, K = out.shape[1], a.shape[1]
    layout = _plain_layout(b_op, N, K)
    return bool(layout) and not gluon.supports(a, b_op.b, layout)


def _engine_fc2_dgrad(dy: Tensor, w2: Tensor, h: Tensor, g_h: Tensor, z: Optional[Tensor], cfg) -> bool:
    """Whether FC2_DGRAD runs on the warp-specialized Gluon engine (kernels/gluon/_fc2_dgrad.py): bf16
    dy and W2 (no recipe, or an emulated recipe's values: ``_bf16_values``), swiglu or
    clamped_swiglu, g_h and z contiguous bf16 or fp32 (a recipe's, through the staged epilogue),
    on an sm_90 GPU whose triton has Gluon's Hopper API, unless MOEMLP_GLUON=0. Elsewhere the Triton
    kernel runs, which gives the same g_h and z bits (its dprobs partials differ only in their
    summation order)."""
    if not _gluon_on(dy):
        return False
    for out in (g_h, z):  # written with h's row stride
        if out is not None and (out.dtype not in (torch.bfloat16, torch.float32) or not out.is_contiguous()):
            return False
    return not gluon.fc2_dgrad_supports(dy, w2, h, cfg.activation.kernel_id, cfg.glu)


class WgradBlocks:
    """The row-block layout that every weight-gradient operand of one backward shares under a recipe
    (the same splits and rows: one kernel launch, made on first use, once)."""

    def __init__(self, splits: Tensor, num_rows: int, recipe):
        self.splits, self.num_rows, self.recipe = splits, num_rows, recipe
        self._blocks = None

    def get(self) -> kq.RowBlocks:
        if self._blocks is None:
            self._blocks = kq.row_blocks(self.splits, self.num_rows, self.recipe.block, self.splits.device)
        return self._blocks


def wgrad(
    g: Tensor,  # (M, P) the gradient rows: g_h (dW1) | dy (dW2); fp32 g_h under a recipe
    x: Optional[Tensor],  # (M, Q): x (dW1) | z (dW2); None: the bias gradient alone
    splits: Tensor,  # (E,)
    recipe,
    *,
    dtype: torch.dtype,  # the compute dtype: sizes the bf16 tiles, and g is rounded to it for db
    dw_dtype: torch.dtype,
    bias: Optional[Tensor] = None,  # (E, P): the bias whose gradient to return (its shape and dtype); None: no db
    probs: Optional[Tensor] = None,  # (M,): db = Σ g·probs with scale_bias
    scale_bias: bool = False,
    blocks: Optional[WgradBlocks] = None,  # shared by the wgrads of one backward; None: computed here
    transposed: bool = False,  # dW stored as a contiguous (E, Q, P), returned as its (E, P, Q) view
    g_values: Optional[tuple[Tensor, Optional[Tensor]]] = None,  # g's dW operand made already (``both``)
    x_amax: Optional[Tensor] = None,  # takes_routed_amax: x's routed amax from the forward (``act``)
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """(dW, db): dW (E, P, Q) in dw_dtype, dW[e] = g[R_e]ᵀ @ x[R_e] (None without x), db = Σ_{R_e}
    g (· probs) in bias's dtype (None without bias). Without a recipe one launch computes both; under
    a recipe dW takes both operands quantized along the rows in blocks that restart at each expert's
    first row (g is the gradient: nvfp4's stochastic rounding applies to it), and db comes from g
    rounded to the compute dtype, unquantized, as the reference does.

    ``transposed`` (the gradient of a transposed-layout weight, _validate.weight_is_transposed):
    the same launches with the operands' roles swapped, dWᵀ[e] = x[R_e]ᵀ @ g[R_e] into a contiguous
    (E, Q, P) tensor, returned as its transposed view; db then takes a launch of its own."""
    if x_amax is not None and (x is None or not takes_routed_amax(recipe)):
        raise ValueError("x_amax: only with x, under nvfp4 without the Hadamard option (operands.takes_routed_amax)")
    if transposed and x is not None:
        if recipe is not None:
            # Under a recipe grouped_mlp copies weights to contiguous ones (the quantizers take them).
            raise ValueError("transposed: a recipe's weight gradients take contiguous weights")
        dw_t, _ = wgrad(x, g, splits, None, dtype=dtype, dw_dtype=dw_dtype)
        db = None
        if bias is not None:
            db = wgrad(g, None, splits, None, dtype=dtype, dw_dtype=dw_dtype, bias=bias, probs=probs,
                       scale_bias=scale_bias)[1]  # fmt: skip
        return dw_t.transpose(1, 2), db
    # the recipe's operands first (quantized along the rows), then the launches
    native = is_native(recipe)
    db = torch.empty_like(bias) if bias is not None else None
    g_v, x_v, factors = g, x, ()  # the dW launch's operands: the tensors, or an emulated recipe's values
    g_op = x_op = None
    if recipe is not None and x is not None:
        rows = (blocks or WgradBlocks(splits, g.shape[0], recipe)).get()
        if native:
            g_op = kq.quantize_wgrad(g, splits, recipe, is_grad=True, transposed=True, blocks=rows)
            x_op = kq.quantize_wgrad(x, splits, recipe, is_grad=False, transposed=True, blocks=rows)
        else:
            if g_values is None:
                g_v, g_factor = kq.dequantized_wgrad(
                    g, splits, recipe, is_grad=True, out_dtype=torch.bfloat16, tiny_blocks_exact=False, blocks=rows
                )
            elif (not one_read(recipe) or len(g_values) != 2 or g_values[0].shape != g.shape
                  or g_values[0].dtype != torch.bfloat16 or (g_values[1] is None) != (recipe.name != "nvfp4")):
                raise ValueError("g_values: the (bf16 values, factor) of operands.both(g, ...)")
            else:
                g_v, g_factor = g_values
            x_v, x_factor = kq.dequantized_wgrad(
                x, splits, recipe, is_grad=False, out_dtype=torch.bfloat16, tiny_blocks_exact=False, blocks=rows,
                amax=x_amax,
            )
            factors = (g_factor, x_factor)
    # bf16 values (no recipe, mxfp8's, nvfp4's) take the bf16 path's kernels: the engine with nvfp4's
    # factors' product as its acc_scale; CUTLASS only without a factor (torch._grouped_mm cannot apply
    # one), so nvfp4's dW that the engine does not take runs on the Triton kernel (the same product).
    acc_scale = launch._product(factors)
    plain = x is not None and not native
    engine = plain and wgrad_engine(g_v, x_v, splits, dw_dtype)
    cutlass = plain and acc_scale is None and not engine and _cutlass_wgrad_ok(g_v, x_v, dw_dtype)
    config = launch.default_config("wgrad", 0, 0, False, dtype.itemsize)
    # Without a recipe db is Σ g (· probs), in the Triton dW launch where one runs; under a recipe it
    # comes from g rounded to the compute dtype, unquantized, in a launch of its own.
    db_in_dw = recipe is None and not (engine or cutlass)
    dw = None
    if native and x is not None:
        dw = fp8_wgrad(g_op, x_op, splits, g.shape[0], dw_dtype)
    elif engine:
        dw = gluon.wgrad(g_v, x_v, splits, dw_dtype, acc_scale=acc_scale)
    elif cutlass:
        dw = _cutlass_wgrad(g_v, x_v, splits)
    elif x is not None:
        dw = _empty_dw(g, x, splits, dw_dtype)
        if recipe is not None:
            launch.launch_grouped_wgrad(g=g_v, x=x_v, splits=splits, dw=dw, db=None, config=config,
                                        acc_factors=(acc_scale,))  # fmt: skip
    if db_in_dw and (dw is not None or db is not None):
        launch.launch_grouped_wgrad(g=g, x=x, splits=splits, dw=dw, db=db, config=config, probs=probs,
                                    scale_b=scale_bias)  # fmt: skip
    elif db is not None:
        launch.launch_grouped_wgrad(g=g if recipe is None else g.to(dtype), x=None, splits=splits, dw=None, db=db,
                                    config=config, probs=probs, scale_b=scale_bias)  # fmt: skip
    return dw, db


def fp8_wgrad_engine(g_op, x_op, splits: Tensor, out_dtype: torch.dtype) -> bool:
    """Whether fp8_block's weight gradient on these ``quantize_wgrad`` operands runs
    on the Gluon engine (``gluon.fp8_wgrad``) rather than the Triton kernel, which gives the same
    bits: wherever ``_gluon_on`` and ``gluon.fp8_wgrad_supports`` allow (no device read). With its
    scales loaded by TMA it measured 1.27-2.3x the Triton kernel from 128 to 2048 rows an expert
    (docs/DECISIONS.md)."""
    if not _gluon_on(g_op.codes_t):
        return False
    return not gluon.fp8_wgrad_supports(g_op.codes_t, x_op.codes_t, out_dtype, splits.shape[0])


def fp8_wgrad(g_op, x_op, splits: Tensor, T: int, out_dtype: torch.dtype) -> Tensor:
    """fp8_block's dW (E, N, K) = dequant(G)[R_e]ᵀ @ dequant(X)[R_e] from the transposed codes of
    ``quantize_wgrad`` (T source rows), on the kernel ``fp8_wgrad_engine`` picks."""
    if fp8_wgrad_engine(g_op, x_op, splits, out_dtype):
        return gluon.fp8_wgrad(g_op.codes_t, g_op.scales, x_op.codes_t, x_op.scales, splits, T, out_dtype)
    return launch.fp8_grouped_wgrad(g_t=g_op.codes_t, g_scales=g_op.scales, x_t=x_op.codes_t, x_scales=x_op.scales,
                                    splits=splits, T=T, out_dtype=out_dtype)  # fmt: skip


# The bf16 weight gradients run on the engine (``gluon.wgrad``) where experts average at most this
# many rows (docs/DECISIONS.md, "bf16 weight gradients on the engine where experts are small").
WGRAD_ENGINE_ROWS = 512


def wgrad_engine(g: Tensor, x: Tensor, splits: Tensor, dw_dtype: torch.dtype) -> bool:
    """Whether the weight gradient on bf16 operands g (M, P) and x (M, Q) runs on the Gluon engine
    (``gluon.wgrad``, the Triton wgrad kernel's bits) rather than ``torch._grouped_mm`` or the Triton
    kernel: where ``_gluon_on`` and ``gluon.wgrad_supports`` allow and the experts average at most
    WGRAD_ENGINE_ROWS rows (host-known sizes, no device read)."""
    E = splits.shape[0]
    if not _gluon_on(g) or g.shape[0] > WGRAD_ENGINE_ROWS * E:
        return False
    return not gluon.wgrad_supports(g, x, dw_dtype, E)


def _empty_dw(g: Tensor, x: Tensor, splits: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty((splits.shape[0], g.shape[1], x.shape[1]), dtype=dtype, device=g.device)


def _cutlass_wgrad_ok(g: Tensor, x: Tensor, dw_dtype: torch.dtype) -> bool:
    """Whether the bf16 weight gradient runs on ``torch._grouped_mm`` (CUTLASS's warp-specialized
    varlen-K grouped GEMM): bf16 operands and dW on an sm_90+ GPU, outside the interpreter. It beat
    the Triton wgrad kernel by 28-48 % where experts have 128-256 rows and by 8-11 % at 1024
    (docs/DECISIONS.md, "bf16 weight gradients on torch._grouped_mm"); an fp32 dW (main_grad) stays on
    the Triton kernels, and so does nvfp4's dW where the engine does not take it (``wgrad``: CUTLASS
    applies no accumulator factor)."""
    return (
        not launch.INTERPRET
        and hasattr(torch, "_grouped_mm")
        and g.is_cuda
        and g.dtype == x.dtype == dw_dtype == torch.bfloat16
        and torch.cuda.get_device_capability(g.device)[0] >= 9
        and g.shape[1] % 8 == 0
        and x.shape[1] % 8 == 0
    )


def _cutlass_wgrad(g: Tensor, x: Tensor, splits: Tensor) -> Tensor:
    """dW (E, P, Q), dW[e] = g[R_e]ᵀ @ x[R_e]: one fp32-accumulated, once-rounded product per expert, no split-K
    (the same bits on every run); an expert with no rows gets exact zeros. The offsets are the
    kernels' clamped ones, computed on the device: negative splits count 0 rows and the running sum
    stops at M, so bad splits cannot make the GEMM read past g or x."""
    M = g.shape[0]
    offs = torch.cumsum(splits.clamp(min=0), 0).clamp(max=M).to(torch.int32)
    return torch._grouped_mm(g.t(), x, offs=offs)
