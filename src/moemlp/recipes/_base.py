"""What the three recipes share: the quantized-tensor object, blocking along an axis, and the
expert-segmented row blocks of the weight-gradient operands.

Blocks that do not divide a dimension: the last, partial block is a block of its own; its amax
is over its real elements only (the quantizers pad with zeros, which never raise an amax, and cut
the padding off again). The same holds for the 128×128 weight tiles of fp8_block in both dims and
for the row blocks of each expert in ``qdq_wgrad``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .._validate import validate_split_values

__all__ = ["QuantizedTensor", "Recipe"]

_SRC_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A block-quantized tensor.

    codes:  float8_e4m3fn of the source shape (fp8_block, mxfp8), or uint8 holding two e2m1 codes
            (nvfp4: element 2i in the low nibble, 2i+1 in the high nibble, paired along ``axis``,
            so that dim is ceil(n/2) long).
    scales: the dequantization scale of each block, blocks along ``axis`` (that dim has
            ceil(n/block) entries): fp32 (fp8_block: 1/scale), float8_e8m0fnu (mxfp8: 2^(e-127)),
            float8_e4m3fn (nvfp4: the block scale s). fp8_block weights: one per 128×128 tile of
            the last two dims.
    tensor_scale: nvfp4 only, the fp32 0-d encode factor S_enc; values are codes·s·(1/S_enc).
    rows:   weight-gradient operands only (``quantize_wgrad``): codes and scales then describe the
            expert-aligned padded (P, K) layout (``shape``), blocks along dim 0, and rows[t] is
            the padded row of source row t (-1 past Σsplits); ``dequantize`` returns (T, K).
    codes_t: the same codes stored transposed over the last two dims (contiguous), when the Triton
            quantizer was asked for them (``transposed=True``; fp8_block and mxfp8): the K-major
            operand of a GEMM that reduces over the rows (Hopper's e4m3 wgmma reads both operands
            K-major), written from the tile the quantizer holds instead of by a separate transpose.
    """

    codes: Tensor
    scales: Tensor
    shape: tuple[int, ...]
    axis: int  # non-negative; for a 128×128 tile quantization, -1 (both last dims)
    block: tuple[int, ...]  # (128, 128) for fp8_block weights, else (B,)
    _dequantize: Callable[[QuantizedTensor], Tensor]
    tensor_scale: Optional[Tensor] = None
    rows: Optional[Tensor] = None
    codes_t: Optional[Tensor] = None

    @classmethod
    def of(
        cls,
        recipe: Recipe,
        codes: Tensor,
        scales: Tensor,
        shape: tuple[int, ...],
        axis: int,
        block: tuple[int, ...],
        tensor_scale: Optional[Tensor] = None,
        rows: Optional[Tensor] = None,
        codes_t: Optional[Tensor] = None,
    ) -> QuantizedTensor:
        """A QuantizedTensor of ``recipe``'s codes and scales made elsewhere (the Triton quantizers),
        laid out as that recipe's own quantizer lays them out (fields above); it dequantizes as the
        recipe does for ``block``."""
        return cls(
            codes=codes, scales=scales, shape=tuple(shape), axis=axis, block=tuple(block),
            _dequantize=recipe._dequantizer(tuple(block)), tensor_scale=tensor_scale, rows=rows, codes_t=codes_t,
        )  # fmt: skip

    def dequantize(self) -> Tensor:
        """fp32 tensor of the source shape."""
        values = self._dequantize(self)
        if self.rows is None:
            return values
        out = values.new_zeros(self.rows.shape[0], values.shape[1])
        valid = self.rows >= 0
        out[valid] = values[self.rows[valid]]
        return out


# --- blocking helpers -----------------------------------------------------------------------------


def to_blocks(t: Tensor, axis: int, block: int) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """t (…, n along axis, …) -> (…, nb, block) fp32 with axis moved last and zero-padded, plus
    the inverse map from (…, nb, block) back to t's shape."""
    t = t.float().movedim(axis, -1)
    n = t.shape[-1]
    nb = -(-n // block)
    pad = nb * block - n
    if pad:
        t = torch.nn.functional.pad(t, (0, pad))
    lead = t.shape[:-1]

    def back(b: Tensor) -> Tensor:
        return b.reshape(*lead, nb * block)[..., :n].movedim(-1, axis)

    return t.reshape(*lead, nb, block), back


def scales_to_axis(s: Tensor, axis: int) -> Tensor:
    """(…, nb) with the blocked axis last -> that dim moved back to ``axis``."""
    return s.movedim(-1, axis)


def scales_from_axis(s: Tensor, axis: int) -> Tensor:
    return s.movedim(axis, -1)


def check_float(t: Tensor, name: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _SRC_DTYPES:
        raise TypeError(f"{name}: expected bf16, fp16, fp32 or fp64, got {t.dtype}")


def norm_axis(axis: int, ndim: int, name: str = "axis") -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"{name}: expected an int, got {type(axis).__name__}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}: expected a dim in [{-ndim}, {ndim}), got {axis}")
    return axis % ndim


def value_for_inf(dtype: torch.dtype) -> float:
    """The scale fp8_block uses when 448/amax overflows: the source dtype's largest finite value
    (TE's ``TypeInfo<IType>::max_finite_value``); fp32's for fp64 sources, quantized in fp32."""
    return torch.finfo(dtype if dtype != torch.float64 else torch.float32).max


class ExpertRows:
    """Rows of a (T, K) operand regrouped so that each expert's rows start on a block boundary.

    Expert e's rows land at padded_start[e] = Σ_{e'<e} ceil(s_e'/B)·B; the padded buffer has
    P = (ceil(T/B) + E)·B rows, room for the worst case, so nothing is read on the host (the Triton
    quantizer uses the same layout). Rows past Σsplits belong to no expert: they are dropped (and
    come back as zeros).
    """

    def __init__(self, splits: Tensor, num_rows: int, block: int, device: torch.device):
        splits = splits.to(device=device, dtype=torch.int64)
        num_experts = splits.numel()
        padded = (splits + block - 1) // block * block
        offsets = torch.cumsum(splits, 0)
        padded_start = torch.cumsum(padded, 0) - padded
        rows = torch.arange(num_rows, device=device)
        expert = torch.searchsorted(offsets, rows, right=True)  # == E past Σsplits
        self.valid = expert < num_experts
        e = expert.clamp(max=max(num_experts - 1, 0))
        pos = rows - (offsets - splits)[e] if num_experts else rows
        self.pos = pos  # row within its expert
        self.dest = (padded_start[e] + pos) if num_experts else rows
        self.full_until = (splits // 16 * 16)[e] if num_experts else rows  # for 16-row Hadamard groups
        self.padded_rows = (-(-num_rows // block) + num_experts) * block
        self.num_rows = num_rows
        self.row_map = torch.where(self.valid, self.dest, torch.full_like(self.dest, -1))

    def scatter(self, t: Tensor) -> Tensor:
        """(T, K) -> (P, K) in t's dtype, expert blocks aligned, zeros elsewhere."""
        out = torch.zeros(self.padded_rows, t.shape[1], dtype=t.dtype, device=t.device)
        out[self.dest[self.valid]] = t[self.valid]
        return out

    def index(self, num_cols: int) -> Tensor:
        """(P, K) int64: the flat index row·K + col of each padded element in the (T, K) source
        (what stochastic rounding hashes); padding gets indices past T·K."""
        src = torch.full((self.padded_rows,), -1, dtype=torch.int64, device=self.dest.device)
        src[self.dest[self.valid]] = torch.nonzero(self.valid).flatten()
        cols = torch.arange(num_cols, device=src.device)
        return src[:, None] * num_cols + cols[None, :]

    def hadamard_rows(self) -> Tensor:
        """(P,) bool: padded rows in a complete 16-row group of their expert."""
        mask = torch.zeros(self.padded_rows, dtype=torch.bool, device=self.dest.device)
        mask[self.dest[self.valid]] = (self.pos < self.full_until)[self.valid]
        return mask


class Recipe:
    """Base of the recipe objects: frozen dataclasses whose fields are their options.

    A subclass gives ``name``, ``block`` (the 1-D block length along a GEMM's reduction dim),
    ``kernel_id`` (the Triton kernels' RECIPE constexpr), ``native`` (whether Hopper's tensor cores
    run its element format: else the kernels emulate it exactly on bf16 values), ``quantize(x, axis)``,
    ``quantize_weight(w)`` and ``_dequantizer(block)``.
    """

    name: str = ""
    block: int = 0
    kernel_id: Optional[int] = None
    native: bool = False

    def __post_init__(self) -> None:
        # The options are bools (``key`` writes them as 0 / 1): a recipe object built directly gets
        # the check ``moemlp.recipe(name, **options)`` makes.
        for k, v in self.options().items():
            if not isinstance(v, bool):
                raise TypeError(f"recipe: option {k!r} of {self.name!r} expects a bool, got {type(v).__name__}")

    def _dequantizer(self, block: tuple[int, ...]) -> Callable[[QuantizedTensor], Tensor]:
        """The dequantization of this recipe's QuantizedTensors with ``block``."""
        raise NotImplementedError

    # -- identity across the custom-op boundary --
    @property
    def key(self) -> str:
        opts = ",".join(f"{k}={int(v)}" for k, v in self.options().items())
        return f"{self.name}:{opts}" if opts else self.name

    def options(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}  # type: ignore[attr-defined]

    # -- the recipe contract of docs/ARCHITECTURE.md --
    def qdq(self, t: Tensor, dim: int) -> Tensor:
        """Quantize-dequantize an activation/gradient operand, blocks along ``dim``; fp32."""
        return self.quantize(t, axis=dim).dequantize()

    def qdq_weight(self, w: Tensor, dim: int) -> Tensor:
        """Expert weights (E, A, B), blocks along ``dim`` (fp8_block: 128×128 tiles instead)."""
        return self.quantize(w, axis=dim).dequantize()

    def qdq_wgrad(self, grad: Tensor, act: Tensor, splits: Tensor) -> tuple[Tensor, Tensor]:
        """Both operands of the weight-gradient GEMM grad^T @ act, each (T, ·), quantized along rows
        with blocks restarting at each expert's first row; fp32, rows past Σsplits zero."""
        if grad.shape[0] != act.shape[0]:
            raise ValueError(f"qdq_wgrad: grad and act need the same rows, got {grad.shape[0]} and {act.shape[0]}")
        g = self.quantize_wgrad(grad, splits, is_grad=True)
        a = self.quantize_wgrad(act, splits, is_grad=False)
        return g.dequantize(), a.dequantize()

    def quantize_wgrad(self, t: Tensor, splits: Tensor, is_grad: bool = False) -> QuantizedTensor:
        """A (T, K) weight-gradient operand in the expert-aligned padded layout (QuantizedTensor.rows),
        blocks of ``block`` rows that restart at each expert's first row."""
        check_float(t, "t")
        if t.ndim != 2:
            raise ValueError(f"t: expected a (T, K) operand, got shape {tuple(t.shape)}")
        if not isinstance(splits, Tensor) or splits.dtype not in (torch.int32, torch.int64) or splits.ndim != 1:
            raise TypeError(
                f"splits: expected a 1-D int32 or int64 tensor of rows per expert, got "
                f"{splits.dtype if isinstance(splits, Tensor) else type(splits).__name__}"
                f"{f' of shape {tuple(splits.shape)}' if isinstance(splits, Tensor) else ''}"
            )
        if splits.device.type == "cpu":  # a free host read; device splits are the caller's to check
            validate_split_values(splits, t.shape[0], rows_of="t")
        lay = ExpertRows(splits, t.shape[0], self.block, t.device)
        q = self._quantize_padded(lay.scatter(t), lay, is_grad)
        return dataclasses.replace(q, rows=lay.row_map)

    def _quantize_padded(self, p: Tensor, lay: ExpertRows, is_grad: bool) -> QuantizedTensor:
        return self.quantize(p, axis=0)
