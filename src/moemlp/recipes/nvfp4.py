"""nvfp4: e2m1 codes, one e4m3 scale per 1×16 block, times one fp32 factor per tensor.

    S_enc = min(448·6 / amax_tensor, FLT_MAX)       (1 when amax_tensor is 0 or S_enc is 0)
    s     = e4m3(block_amax · (S_enc · (1/6)))
    inv   = min(1 / (float(s) · (1/S_enc)), FLT_MAX)
    code  = e2m1(x · inv);   dequantize: code · float(s) · (1/S_enc)

amax_tensor is the amax of the whole tensor handed to the quantizer (``quantize``, ``qdq``,
``qdq_weight``: all of it, all experts of a weight together; ``qdq_wgrad``: each operand's rows
that belong to an expert, after the Hadamard transform when that is on), NaN ignored.

NaN: e2m1 has no NaN; the saturating conversion gives +6. So that a NaN still propagates (SPEC §2),
the block holding it gets the e4m3 NaN as its scale (0x7F) and dequantizes to NaN; every other
block, and every code, is what TE writes.

Options, both for the weight-gradient GEMMs only (``qdq_wgrad``), as TransformerEngine's NVFP4
recipe applies them:
- ``hadamard``: a 16×16 random Hadamard transform Q = diag(signs)·H16/4 (Sylvester H16, TE's wgrad
  sign vector) applied along the reduction dim (rows) to both operands, per 16-row group of one
  expert: g' = Qᵀg, a' = Qᵀa, so g'ᵀa' = gᵀa while outliers are spread over the group before
  quantization. A group with fewer than 16 rows (an expert's tail) is left untransformed. The
  transform is a fixed-order butterfly in fp32 (signs, then stages of width 1, 2, 4, 8, then ·1/4),
  so the Triton quantizer can reproduce it bit for bit. The returned operands are in the rotated
  basis: only their per-expert product is meaningful.
- ``stochastic_rounding``: the gradient operand's e2m1 codes are rounded up with probability equal
  to the distance from the grid value below (``_formats.e2m1_round_stochastic``); the uniform draw
  is a 32-bit hash of the element's position in the (T, K) operand and its fp32 bits, so a
  quantization is deterministic while the draws change as the values do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import _formats as F
from ._base import (
    ExpertRows,
    QuantizedTensor,
    Recipe,
    check_float,
    norm_axis,
    scales_from_axis,
    scales_to_axis,
    to_blocks,
)

BLOCK = 16

# TransformerEngine's sign vector for the wgrad Hadamard transform (D in Q = D·H16/4).
HADAMARD_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def tensor_scale(x: Tensor) -> Tensor:
    """S_enc (fp32 0-d) from the NaN-ignoring amax of all of x (amax 0 for an empty x, as the Triton
    quantizers' zero-initialized amax gives)."""
    if x.numel() == 0:
        return F.nvfp4_tensor_scale(torch.zeros((), dtype=torch.float32, device=x.device))
    return F.nvfp4_tensor_scale(F.abs_max(x.float().reshape(-1), dim=0)[0])


def tensor_scale_from_amax(amax: Tensor) -> Tensor:
    """S_enc (fp32 0-d) from a tensor's NaN-ignoring amax (fp32 0-d)."""
    return F.nvfp4_tensor_scale(amax)


def quantize_blocks(xb: Tensor, s_enc: Tensor, u: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """xb (…, nb, 16) fp32 -> (codes uint8 like xb, s float8_e4m3fn (…, nb, 1) with NaN blocks
    marked, and the dequantized values fp32 like xb). ``u``: uniforms for stochastic rounding."""
    s, inv = F.nvfp4_block_scales(F.abs_max(xb, dim=-1), s_enc)
    y = xb * inv
    codes = F.e2m1_encode(y) if u is None else F.e2m1_round_stochastic(y, u)
    has_nan = torch.isnan(xb).any(dim=-1, keepdim=True)
    s = torch.where(has_nan, torch.full_like(s, float("nan")), s)
    values = dequantize_blocks(codes, s, s_enc)
    return codes, s, values


def dequantize_blocks(codes: Tensor, s: Tensor, s_enc: Tensor) -> Tensor:
    """code · float(s) · (1/S_enc), left to right in fp32 (code · s is exact)."""
    s_dec = F.f32(1.0, s_enc) / s_enc
    return F.e2m1_decode(codes) * s.float() * s_dec


def pack(codes: Tensor) -> Tensor:
    """(…, n) uint8 codes -> (…, ceil(n/2)): element 2i low nibble, 2i+1 high nibble."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: Tensor, n: int) -> Tensor:
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    return codes[..., :n]


def hadamard16(t: Tensor) -> Tensor:
    """(…, 16) fp32 -> t·Q, Q = diag(HADAMARD_SIGNS)·H16/4, as a fixed-order butterfly."""
    signs = torch.tensor(HADAMARD_SIGNS, dtype=torch.float32, device=t.device)
    v = (t * signs).reshape(*t.shape[:-1], 2, 2, 2, 2)
    for d in (-1, -2, -3, -4):  # stage widths 1, 2, 4, 8
        a, b = v.unbind(d)
        v = torch.stack((a + b, a - b), dim=d)
    return v.reshape(t.shape) * F.f32(0.25, t)


def _dequantize(q: QuantizedTensor) -> Tensor:
    codes = unpack(q.codes.movedim(q.axis, -1), q.shape[q.axis])
    cb, back = to_blocks(codes.movedim(-1, q.axis), q.axis, BLOCK)
    s = scales_from_axis(q.scales, q.axis)[..., None]
    return back(dequantize_blocks(cb.to(torch.uint8), s, q.tensor_scale))


@dataclass(frozen=True)
class NVFP4Recipe(Recipe):
    """e2m1 with e4m3 scales per 1×16 block and an fp32 per-tensor factor."""

    hadamard: bool = False
    stochastic_rounding: bool = False
    name = "nvfp4"
    block = BLOCK
    kernel_id = 2

    def _dequantizer(self, block):
        return _dequantize

    def quantize(self, x: Tensor, axis: int = -1) -> QuantizedTensor:
        """1×16 blocks along ``axis``; codes packed two per uint8 along ``axis``."""
        check_float(x, "x")
        return self._quantize(x, norm_axis(axis, x.ndim))

    def _quantize(self, x: Tensor, axis: int, u: Tensor | None = None) -> QuantizedTensor:
        s_enc = tensor_scale(x)
        xb, back = to_blocks(x, axis, BLOCK)
        if u is not None:
            u = to_blocks(u, axis, BLOCK)[0]
        codes, s, _ = quantize_blocks(xb, s_enc, u)
        codes = back(codes).movedim(axis, -1)
        return QuantizedTensor(
            codes=pack(codes).movedim(-1, axis),
            scales=scales_to_axis(s[..., 0], axis),
            shape=tuple(x.shape),
            axis=axis,
            block=(BLOCK,),
            _dequantize=_dequantize,
            tensor_scale=s_enc,
        )

    def quantize_weight(self, w: Tensor, axis: int = -1) -> QuantizedTensor:
        """Weights: 1×16 blocks along ``axis``, one S_enc for the whole tensor (all experts)."""
        return self.quantize(w, axis)

    def qdq(self, t: Tensor, dim: int) -> Tensor:
        xb, back = to_blocks(t, norm_axis(dim, t.ndim), BLOCK)
        return back(quantize_blocks(xb, tensor_scale(t))[2])

    def qdq_weight(self, w: Tensor, dim: int) -> Tensor:
        return self.qdq(w, dim)

    def _quantize_padded(self, p: Tensor, lay: ExpertRows, is_grad: bool) -> QuantizedTensor:
        if self.hadamard:
            rows = lay.hadamard_rows()
            p = p.float()
            groups = p.reshape(-1, 16, p.shape[1]).transpose(1, 2)  # (P/16, K, 16)
            p = torch.where(rows[:, None], hadamard16(groups).transpose(1, 2).reshape(p.shape), p)
        u = None
        if is_grad and self.stochastic_rounding:
            p = p.float()
            u = F.hash_uniform(0, lay.index(p.shape[1]), F._bits(p))
        return self._quantize(p, 0, u)
