"""The grouped GEMM's epilogues: what each of the MLP's four GEMMs does with its fp32 accumulator
before the one rounding of each stored output.

    FC1        h = acc (+ b1) → h;  z = act(h)·p → z                       (z: the forward only)
    FC2        y = acc + b2 (· p with scale_fc2_bias) → y
    FC2_DGRAD  g_z = acc (fp32): dprobs partial Σ_f g_z·a;  g_h = g_z·p·act'(h) → g_h;  round(z) for dW2
    FC1_DGRAD  dx = acc → dx

The kernel hands the epilogue four bundles instead of a flat argument list:
    tile        (row_mask, row_start, is_real, e, p): the m-tile's rows, whether they belong to an
                expert (capacity tiles store zeros), that expert, and the rows' fp32 probs
    outs        (bias_ptr, out_ptr, z_ptr, h_ptr): the tensors of the table above
    dims        (N, N1, G): output columns, h's columns, the GLU block width
    act_params  (p0, p1, p2): the activation's fp32 parameters
"""

from __future__ import annotations

import triton
import triton.language as tl

from .activations import glu_backward, glu_forward, unary_backward, unary_forward
from .common import rounded

FC1: tl.constexpr = tl.constexpr(0)
FC2: tl.constexpr = tl.constexpr(1)
FC2_DGRAD: tl.constexpr = tl.constexpr(2)
FC1_DGRAD: tl.constexpr = tl.constexpr(3)


@triton.jit
def epilogue_chunks(
    acc,  # (BM, BW) fp32 accumulator: h's gate part (FC1), y (FC2), g_z (FC2_DGRAD) or dx (FC1_DGRAD)
    acc_up,  # (BM, BW) fp32: h's up part (FC1 with a GLU); acc itself otherwise (unused)
    col0,  # first output column of the chunk (over F for FC1/FC2_DGRAD, over H otherwise)
    tile,
    outs,
    dims,
    act_params,
    BM: tl.constexpr,
    BW: tl.constexpr,
    CHUNKS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    ACT: tl.constexpr,
    GLU: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_BIAS: tl.constexpr,
    STORE_Z: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """The epilogue of a (BM, BW) tile in CHUNKS column chunks, halving recursively; returns the
    dprobs partial summed over the chunks in column order (a fixed order)."""
    if CHUNKS == 1:
        part = _epilogue(
            acc, acc_up, col0, tile, outs, dims, act_params,
            BM, BW, EPILOGUE, ACT, GLU, HAS_PROBS, HAS_BIAS, SCALE_BIAS, STORE_Z, INTERPRETED,
        )  # fmt: skip
    else:
        acc0, acc1 = _halves(acc, BM, BW)
        up0, up1 = _halves(acc_up, BM, BW)
        part = epilogue_chunks(
            acc0, up0, col0, tile, outs, dims, act_params,
            BM, BW // 2, CHUNKS // 2, EPILOGUE, ACT, GLU, HAS_PROBS, HAS_BIAS, SCALE_BIAS, STORE_Z, INTERPRETED,
        )  # fmt: skip
        part += epilogue_chunks(
            acc1, up1, col0 + BW // 2, tile, outs, dims, act_params,
            BM, BW // 2, CHUNKS // 2, EPILOGUE, ACT, GLU, HAS_PROBS, HAS_BIAS, SCALE_BIAS, STORE_Z, INTERPRETED,
        )  # fmt: skip
    return part


@triton.jit
def _halves(x, BM: tl.constexpr, BN: tl.constexpr):
    """(BM, BN) → its column halves [0, BN/2) and [BN/2, BN)."""
    return x.reshape(BM, 2, BN // 2).permute(0, 2, 1).split()


@triton.jit
def _epilogue(
    acc,  # (BM, BNS) fp32, as epilogue_chunks'
    acc_up,
    col0,
    tile,
    outs,
    dims,
    act_params,
    BM: tl.constexpr,
    BNS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    ACT: tl.constexpr,
    GLU: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_BIAS: tl.constexpr,
    STORE_Z: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Stores one column chunk of a tile's outputs; returns the chunk's dprobs partial (FC2_DGRAD)."""
    row_mask, row_start, is_real, e, p = tile
    bias_ptr, out_ptr, z_ptr, h_ptr = outs
    N, N1, G = dims
    p0, p1, p2 = act_params
    offs_n = col0 + tl.arange(0, BNS)
    n_mask = offs_n < N
    if GLU:
        n_h = (offs_n // G) * (2 * G) + offs_n % G  # gate column of f in h; up column = + G
    else:
        n_h = offs_n
    mask = row_mask[:, None] & n_mask[None, :]
    # Addresses: a 64-bit base per tile plus int32 offsets (BM·N1 < 2^31): (BM, BN) int64
    # pointer tensors would cost two registers per element.
    local = tl.arange(0, BM)[:, None]
    row_base = row_start.to(tl.int64)
    part = tl.zeros((BM,), dtype=tl.float32)
    if EPILOGUE == FC1:
        h_gate = acc
        if HAS_BIAS:
            bias_row = bias_ptr + e.to(tl.int64) * N1
            h_gate += tl.load(bias_row + n_h, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GLU:
            h_up = acc_up
            if HAS_BIAS:
                h_up += tl.load(bias_row + n_h + G, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        h_out = out_ptr + row_base * N1 + (local * N1 + n_h[None, :])
        tl.store(h_out, rounded(tl.where(is_real, h_gate, 0.0), out_ptr.dtype.element_ty, INTERPRETED), mask=mask)
        if GLU:
            tl.store(
                h_out + G, rounded(tl.where(is_real, h_up, 0.0), out_ptr.dtype.element_ty, INTERPRETED), mask=mask
            )
        if STORE_Z:  # off for recompute_fc1's h-only launch (grouped_fc1): z_ptr is None there
            if GLU:
                act = glu_forward(h_gate, h_up, ACT, p0, p1, p2)  # from the fp32 accumulator
            else:
                act = unary_forward(h_gate, ACT)
            z = act
            if HAS_PROBS:
                z = act * p[:, None]  # fp32 × fp32: an fp32 probs is never rounded
            z_out = z_ptr + row_base * N + (local * N + offs_n[None, :])
            tl.store(z_out, rounded(tl.where(is_real, z, 0.0), z_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    elif EPILOGUE == FC2:
        y = acc
        if HAS_BIAS:
            bias = tl.load(bias_ptr + e.to(tl.int64) * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            if SCALE_BIAS:
                y += bias[None, :] * p[:, None]
            else:
                y += bias[None, :]
        y_out = out_ptr + row_base * N + (local * N + offs_n[None, :])
        tl.store(y_out, rounded(tl.where(is_real, y, 0.0), out_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    elif EPILOGUE == FC2_DGRAD:
        g_z = acc  # fp32, never rounded before use
        h_in = h_ptr + row_base * N1 + (local * N1 + n_h[None, :])
        h_gate = tl.load(h_in, mask=mask, other=0.0).to(tl.float32)
        if GLU:
            h_up = tl.load(h_in + G, mask=mask, other=0.0).to(tl.float32)
            act, d_gate, d_up = glu_backward(h_gate, h_up, ACT, p0, p1, p2)
        else:
            act, d_gate = unary_backward(h_gate, ACT)
        part = tl.sum(tl.where(mask, g_z * act, 0.0), axis=1)  # fp32 from fp32 g_z and a
        g_a = g_z
        if HAS_PROBS:
            g_a = g_z * p[:, None]
        g_out = out_ptr + row_base * N1 + (local * N1 + n_h[None, :])
        g_gate = g_a * d_gate
        tl.store(g_out, rounded(tl.where(is_real, g_gate, 0.0), out_ptr.dtype.element_ty, INTERPRETED), mask=mask)
        if GLU:
            g_up = g_a * d_up
            tl.store(g_out + G, rounded(tl.where(is_real, g_up, 0.0), out_ptr.dtype.element_ty, INTERPRETED), mask=mask)
        if STORE_Z:
            z = act
            if HAS_PROBS:
                z = act * p[:, None]
            z_out = z_ptr + row_base * N + (local * N + offs_n[None, :])
            tl.store(z_out, rounded(tl.where(is_real, z, 0.0), z_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    else:
        tl.static_assert(EPILOGUE == FC1_DGRAD)
        dx_out = out_ptr + row_base * N + (local * N + offs_n[None, :])
        tl.store(dx_out, rounded(tl.where(is_real, acc, 0.0), out_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    return part
