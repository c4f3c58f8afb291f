"""FC1 on the warp-specialized engine: h = x[R_e] @ W1[e]ᵀ with the GLU epilogue, bf16 or fp8_block.

    h    = x @ W1[e]ᵀ (+ b1)          fp32, rounded once to h's dtype (gate and up columns)
    z    = act(gate, up) · p          from the fp32 h, rounded once to z's dtype

The GLU kinds swiglu (0) and clamped_swiglu (1) from _glu.py, operation for operation as the Triton
kernel's epilogue (kernels/gemm/epilogue.py, FC1).

A tile is 64 output columns f of z: its B block is W1's 64 gate rows of those columns and their 64 up
rows (``_engine._glu_rows``: h interleaves gate and up in blocks of G columns, G a multiple of 64),
loaded by two TMA copies into the halves of one 128-row stage (B_PARTS = 2), so each step is one
m64n128 chain whose first 64 accumulator columns are the gates and the rest their ups. The partitions
are the engine's TMA producer and two consumer warpgroups:

* bf16 (SCALED off): 128-row tiles in ping-pong, each consumer's K loop one chain into its 128×128
  accumulator (as the Triton kernel's, unpromoted), while the other consumer's epilogue (h and z
  stored: 1.5× the bytes the tile's MMAs read of x) runs beside it;
* fp8_block (SCALED): e4m3 codes with their 1×128 and 128×128 scales (_engine._mainloop_scaled) on
  the two 64-row halves of 128-row tiles (cooperative), so that one consumer's promotion overlaps
  the other's wgmma; the two halves' weight scales come from two 128×128 tiles, one scale a column.

Epilogue: the accumulator goes to the warpgroup's fp32 shared tile and is read back in chunks of CW
columns of gate and of up at once, in a blocked layout (8 consecutive columns a thread), so h's and
z's stores are row-contiguous vectors. Rows past the expert's end belong to the next expert's tiles
and are masked; capacity rows (past Σsplits) get zeros in h and z from the capacity tiles, so every
element is written exactly once. No atomics: the same bits on every run.
"""

from __future__ import annotations

from ._compat import gl, gluon, warp_specialize
from ._engine import CONSUMER_REGS, PRODUCER_REGS, _glu_rows, _producer, _ring, _tile_loop
from ._glu import _glu_forward


@gluon.jit
def _epilogue(g_smem, e, h_ptr, z_ptr, bias_ptr, probs_ptr, m0, n0, row_end, N, N1, p0, p1, p2,
              BM: gl.constexpr, BN: gl.constexpr, CW: gl.constexpr, G: gl.constexpr, ACT: gl.constexpr,
              HAS_BIAS: gl.constexpr, HAS_PROBS: gl.constexpr, STORE_Z: gl.constexpr):
    TILE_N: gl.constexpr = BN // 2
    epi: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // CW, CW // 8], [4, 1], [1, 0])
    local = gl.arange(0, BM, layout=gl.SliceLayout(1, epi))
    rows = m0 + local
    row_ok = rows < row_end
    # A 64-bit base per tile plus int32 offsets (BM·N1 < 2^31).
    h_tile = h_ptr + m0.to(gl.int64) * N1
    z_tile = z_ptr + m0.to(gl.int64) * N
    gate0 = _glu_rows(n0, G)  # h's column of the tile's first gate; the tile lies in one G block
    if HAS_PROBS:
        p = gl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(gl.float32)  # fp32 probs never rounded
    for c in gl.static_range(TILE_N // CW):
        gate = g_smem.slice(c * CW, CW, dim=1).load(epi)
        up = g_smem.slice(TILE_N + c * CW, CW, dim=1).load(epi)
        span = c * CW + gl.arange(0, CW, layout=gl.SliceLayout(0, epi))
        col_ok = n0 + span < N
        hc = gate0 + span
        if HAS_BIAS:
            bias_row = bias_ptr + e.to(gl.int64) * N1
            gate = gate + gl.load(bias_row + hc, mask=col_ok, other=0.0).to(gl.float32)[None, :]
            up = up + gl.load(bias_row + hc + G, mask=col_ok, other=0.0).to(gl.float32)[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        h_off = local[:, None] * N1 + hc[None, :]
        gl.store(h_tile + h_off, gate.to(h_ptr.dtype.element_ty), mask=mask)
        gl.store(h_tile + h_off + G, up.to(h_ptr.dtype.element_ty), mask=mask)
        if STORE_Z:
            z = _glu_forward(gate, up, ACT, p0, p1, p2)  # from the fp32 h
            if HAS_PROBS:
                z = z * p[:, None]  # fp32 × fp32: an fp32 probs is never rounded
            gl.store(z_tile + (local[:, None] * N + (n0 + span)[None, :]), z.to(z_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _zeros(h_ptr, z_ptr, m0, n0, M, N, N1, BM: gl.constexpr, BN: gl.constexpr, CW: gl.constexpr,
           G: gl.constexpr, STORE_Z: gl.constexpr):
    """A capacity tile: rows from Σsplits on belong to no expert; their h and z are 0."""
    TILE_N: gl.constexpr = BN // 2
    epi: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // CW, CW // 8], [4, 1], [1, 0])
    local = gl.arange(0, BM, layout=gl.SliceLayout(1, epi))
    row_ok = m0 + local < M
    h_tile = h_ptr + m0.to(gl.int64) * N1
    z_tile = z_ptr + m0.to(gl.int64) * N
    gate0 = _glu_rows(n0, G)
    zero = gl.zeros([BM, CW], gl.float32, epi)
    for c in gl.static_range(TILE_N // CW):
        span = c * CW + gl.arange(0, CW, layout=gl.SliceLayout(0, epi))
        mask = row_ok[:, None] & (n0 + span < N)[None, :]
        h_off = local[:, None] * N1 + (gate0 + span)[None, :]
        gl.store(h_tile + h_off, zero.to(h_ptr.dtype.element_ty), mask=mask)
        gl.store(h_tile + h_off + G, zero.to(h_ptr.dtype.element_ty), mask=mask)
        if STORE_Z:
            gl.store(z_tile + (local[:, None] * N + (n0 + span)[None, :]), zero.to(z_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _fc1_epilogue(acc, e, m0, n0, row_end, WG: gl.constexpr, args):
    """The engine's epilogue unit (_engine._tile_loop) for FC1: the tile's fp32 accumulator (gates,
    then ups) to this warpgroup's shared tile, then ``_epilogue``. ``args`` = (g_tiles, h_ptr, z_ptr,
    bias_ptr, probs_ptr, M, N, N1, p0, p1, p2, BM, BN, CW, G, ACT, HAS_BIAS, HAS_PROBS, STORE_Z); the
    constexprs are read by index into constexpr names (unpacking would make them runtime values)."""
    BM: gl.constexpr = args[11]
    BN: gl.constexpr = args[12]
    CW: gl.constexpr = args[13]
    G: gl.constexpr = args[14]
    ACT: gl.constexpr = args[15]
    HAS_BIAS: gl.constexpr = args[16]
    HAS_PROBS: gl.constexpr = args[17]
    STORE_Z: gl.constexpr = args[18]
    g_smem = args[0].index(WG)
    g_smem.store(acc)
    _epilogue(g_smem, e, args[1], args[2], args[3], args[4], m0, n0, row_end, args[6], args[7], args[8], args[9],
              args[10], BM, BN, CW, G, ACT, HAS_BIAS, HAS_PROBS, STORE_Z)


@gluon.jit
def _fc1_capacity(m0, n0, WG: gl.constexpr, args):
    BM: gl.constexpr = args[11]
    BN: gl.constexpr = args[12]
    CW: gl.constexpr = args[13]
    G: gl.constexpr = args[14]
    STORE_Z: gl.constexpr = args[18]
    _zeros(args[1], args[2], m0, n0, args[5], args[6], args[7], BM, BN, CW, G, STORE_Z)


@gluon.jit
def _consumer(a_desc, b_desc, h_ptr, z_ptr, bias_ptr, probs_ptr, a_scale_ptr, stride_asm, stride_ask, b_scale_ptr,
              stride_bse, stride_bsn, stride_bsk, splits_ptr, E, M, N, K, N1, p0, p1, p2, a_ring, b_ring, g_tiles,
              ready, empty, turn, WG: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, GROUP_M: gl.constexpr, E_BLOCK: gl.constexpr, CW: gl.constexpr,
              G: gl.constexpr, ACT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_PROBS: gl.constexpr,
              STORE_Z: gl.constexpr, SCALED: gl.constexpr, A_PARTS: gl.constexpr):
    # fp8_block: cooperative tiles (A_PARTS = 2) and the scaled mainloop, whose promotion the engine
    # counts as PROMOTE = 1; bf16: ping-pong (A_PARTS = 1), one unpromoted chain a tile.
    PROMOTE: gl.constexpr = A_PARTS - 1
    _tile_loop(_fc1_epilogue, _fc1_capacity,
               (g_tiles, h_ptr, z_ptr, bias_ptr, probs_ptr, M, N, N1, p0, p1, p2, BM, BN, CW, G, ACT, HAS_BIAS,
                HAS_PROBS, STORE_Z),
               a_ring, b_ring, ready, empty, turn, splits_ptr, E, M, N, K, WG, BM, BN, BK, STAGES, GROUP_M, E_BLOCK,
               True, PROMOTE, A_PARTS, SCALED,
               (a_scale_ptr, stride_asm, stride_ask, b_scale_ptr, stride_bse, stride_bsn, stride_bsk),
               2, G)  # fmt: skip


@gluon.jit
def fc1_kernel(
    a_desc,  # x (M, H) bf16 or its e4m3 codes (SCALED), rows grouped by expert; block [BM, BK]
    b_desc,  # W1 (E·N1, H) bf16 or its e4m3 codes, K-major; block [BN / 2, BK] (a gate or an up half of a stage)
    h_ptr,  # (M, N1) bf16, written
    z_ptr,  # (M, F) bf16 or fp32, written (STORE_Z)
    bias_ptr,  # (E, N1) fc1_bias (HAS_BIAS)
    probs_ptr,  # (M,) fp32 / bf16 / fp16 (HAS_PROBS)
    # SCALED: (M, ⌈H/128⌉) fp32 1×128 scales of x's codes, row m's of K block kb at m·stride_asm + kb·stride_ask
    a_scale_ptr,
    stride_asm,
    stride_ask,
    # SCALED: W1's 128×128 tile scales, tile (n//128, k//128) of e at e·stride_bse + ·stride_bsn + ·stride_bsk
    b_scale_ptr,
    stride_bse,
    stride_bsn,
    stride_bsk,
    splits_ptr,  # (E,) int32 / int64
    E,
    M,
    N,  # F: z's columns
    K,  # H
    N1,  # 2F: h's columns, W1[e]'s rows
    p0,
    p1,
    p2,
    BM: gl.constexpr,  # a consumer's rows: a tile's (ping-pong), half a tile's (cooperative)
    BN: gl.constexpr,  # gate and up columns of a tile: BN / 2 output columns
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    E_BLOCK: gl.constexpr,
    CW: gl.constexpr,  # epilogue column chunk (of gate and of up)
    G: gl.constexpr,  # GLU interleave: gate / up blocks of G columns, a multiple of BN / 2
    ACT: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_PROBS: gl.constexpr,
    STORE_Z: gl.constexpr,
    SCALED: gl.constexpr,  # fp8_block's codes and scales
    A_PARTS: gl.constexpr,  # 2: cooperative 2·BM-row tiles (SCALED); 1: ping-pong BM-row tiles (bf16)
):
    gl.static_assert(A_PARTS == 1 + SCALED, "fp8_block on cooperative tiles, bf16 in ping-pong")
    a_ring, b_ring, ready, empty, turn = _ring(a_desc, b_desc, BM, BN, BK, STAGES, True, A_PARTS)
    g_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.float32)
    g_tiles = gl.allocate_shared_memory(gl.float32, [2, BM, BN], g_layout)
    # The argument tuples are written out in the call: a tuple bound to a name first would turn its
    # constexprs into runtime values.
    warp_specialize([
        (_consumer, (a_desc, b_desc, h_ptr, z_ptr, bias_ptr, probs_ptr, a_scale_ptr, stride_asm, stride_ask,
                     b_scale_ptr, stride_bse, stride_bsn, stride_bsk, splits_ptr, E, M, N, K, N1, p0, p1, p2, a_ring,
                     b_ring, g_tiles, ready, empty, turn, 0, BM, BN, BK, STAGES, GROUP_M, E_BLOCK, CW, G, ACT,
                     HAS_BIAS, HAS_PROBS, STORE_Z, SCALED, A_PARTS)),
        (_consumer, (a_desc, b_desc, h_ptr, z_ptr, bias_ptr, probs_ptr, a_scale_ptr, stride_asm, stride_ask,
                     b_scale_ptr, stride_bse, stride_bsn, stride_bsk, splits_ptr, E, M, N, K, N1, p0, p1, p2, a_ring,
                     b_ring, g_tiles, ready, empty, turn, 1, BM, BN, BK, STAGES, GROUP_M, E_BLOCK, CW, G, ACT,
                     HAS_BIAS, HAS_PROBS, STORE_Z, SCALED, A_PARTS)),
        (_producer, (a_desc, b_desc, splits_ptr, E, M, N, K, a_ring, b_ring, ready, empty, BM, BN, BK, STAGES,
                     GROUP_M, E_BLOCK, True, A_PARTS, 2, G, N1)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
