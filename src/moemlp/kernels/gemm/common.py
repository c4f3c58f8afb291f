"""What the grouped-GEMM kernels share: the expert table read from device ``splits``, the one
rounding of each stored output.

Expert offsets are computed inside every kernel from ``splits`` (never read on the host): splits are
clamped (negative → 0 rows, a sum past M truncated at M), so bad device splits cannot make a kernel
read or write out of bounds.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton < 3.4 has no host-side descriptors
    TensorDescriptor = None

# Under TRITON_INTERPRET=1, tl.dot on bf16 operands returns garbage (numpy has no bf16 matmul; on
# triton 3.9 a 16×16 product was off by up to 2.7e10), so dot operands are upcast to fp32 there. The
# GPU path never takes this branch.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def rounded(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 x rounded to nearest even in dtype, the one rounding of each stored output.

    The triton 3.9 interpreter truncates fp32 → bf16 (508 of 1024 random values one ulp off torch's
    RTNE), which would double the rounding error the CPU suite measures; under the interpreter the
    bf16 rounding is done on the bits instead. The GPU path converts directly."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        bits = tl.where(x != x, 0x7FC0, bits)  # NaN stays a (quiet) NaN
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def expert_table(splits_ptr, E, M, E_BLOCK: tl.constexpr, BM: tl.constexpr):
    """Per-expert row ranges [starts, ends) and m-tile counts, clamped so that bad splits stay in
    bounds: each split to [0, M], the running end to M."""
    idx = tl.arange(0, E_BLOCK)
    # int64: 1024 experts × splits of up to 2^31 rows would overflow an int32 running sum.
    s = tl.load(splits_ptr + idx, mask=idx < E, other=0).to(tl.int64)
    s = tl.minimum(tl.maximum(s, 0), M)
    cum = tl.cumsum(s, 0)
    ends = tl.minimum(cum, M).to(tl.int32)
    starts = tl.minimum(cum - s, M).to(tl.int32)
    tiles = (ends - starts + BM - 1) // BM
    tile_cum = tl.cumsum(tiles, 0)  # inclusive; past E it stays at the total
    return idx, starts, ends, tiles, tile_cum


@triton.jit
def pick(idx, vec, e):
    """vec[e] as a scalar (vectors of the expert table live in registers)."""
    return tl.sum(tl.where(idx == e, vec, 0))
