"""FC1 on the warp-specialized engine: h = x[R_e] @ W1[e]ᵀ with the GLU epilogue, bf16 or fp8_block.

    h    = x @ W1[e]ᵀ (+ b1)          fp32, rounded once to h's dtype (gate and up columns)
    z    = act(gate, up) · p          from the fp32 h, rounded once to z's dtype

The GLU kinds swiglu (0) and clamped_swiglu (1) from _glu.py, operation for operation as the Triton
kernel's epilogue (kernels/gemm/epilogue.py, FC1). With ACC_SCALE (bf16: nvfp4's values) the fp32
accumulator is first multiplied by the factor at ``acc_scale_ptr`` (``_engine._tile_loop``), as the
Triton kernel's ACC_SCALE multiplies it; with a bias both kernels' compilers contract that product
and the bias add into one fma (offline sm_90 compiles of both, tests/kernels/test_gluon_fc1.py).

A tile is 64 output columns f of z: its B block is W1's 64 gate rows of those columns and their 64 up
rows (``_engine._glu_rows``: h interleaves gate and up in blocks of G columns, G a multiple of 64),
loaded by two TMA copies into the halves of one 128-row stage (B_PARTS = 2), so each step is one
m64n128 chain whose first 64 accumulator columns are the gates and the rest their ups. The partitions
are the engine's TMA producer and two consumer warpgroups:

* bf16 (SCALED off), ping-pong (A_PARTS = 1): 128-row tiles of 64 output columns, each consumer's K
  loop one chain into its 128×128 accumulator (as the Triton kernel's, unpromoted), while the other
  consumer's epilogue runs beside it (one h tile a consumer, so the ring takes 5 stages);
* bf16, cooperative (A_PARTS = 2, BN = 256): 128-row tiles of 128 output columns, the two consumers
  on the tile's 64-row halves at once, one m64n256 chain a step (G a multiple of 128). Each B block
  then serves 128 rows and each A block 256 columns, a quarter less operand traffic per MMA, at the
  price of an epilogue that nothing overlaps but the previous tile's TMA stores (the plain GEMM's
  cooperative tiles, _engine.py);
* fp8_block (SCALED): e4m3 codes with their 1×128 and 128×128 scales (_engine._mainloop_scaled) on
  the two 64-row halves of 128-row tiles (cooperative), so that one consumer's promotion overlaps
  the other's wgmma; the two halves' weight scales come from two 128×128 tiles, one scale a column.

Epilogue, in registers: in the wgmma accumulator layout a thread holds column c and column c + 64 of
the same rows (the 64 is a register bit of the layout), so the tile splits into its gate and up
halves without moving data (reshape → permute → split), and the bias, the GLU and the probs are
applied where the products are. h's gate and up halves and z go to this warpgroup's bf16 / z-dtype
shared tiles and out by TMA stores, which the next tile's mainloop overlaps. bf16 tiles stage the
gate and up halves through one shared tile a consumer, the up half once the gate's store has read
it: on cooperative tiles their 64 × 128 tiles beside a 3-stage ring of 48 KiB stages leave no room
for a second, and on ping-pong tiles the 16 KiB saved a consumer buys the ring a 5th stage, which
the small experts' bytes wait on.
A tile whose rows cross its expert's end (unless the expert's end is row M, where TMA's clipping is
exact) is stored from the same shared tiles by masked 16-byte vectors instead: those rows belong to
the next expert's tiles.
Capacity rows (past Σsplits) get zeros in h and z from the capacity tiles, so every element is
written exactly once. No atomics: the same bits on every run.
"""

from __future__ import annotations

from ._compat import fence_async_shared, gl, gluon, store_wait, tma_store, warp_specialize
from ._engine import CONSUMER_REGS, PRODUCER_REGS, _glu_rows, _producer, _ring, _tile_loop
from ._glu import _glu_forward
from ._mx import mxfp8_values


@gluon.jit
def _masked_store(smem, ptr, m0, col0, ld, row_end, BM: gl.constexpr, W: gl.constexpr):
    """The rows of a [BM, W] shared tile before ``row_end`` to ptr[m0 + r, col0 + c] (row stride
    ``ld``), in 16-byte vectors along the row."""
    VEC: gl.constexpr = 128 // smem.dtype.primitive_bitwidth
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // W, W // VEC], [4, 1], [1, 0])
    tile = smem.load(layout)
    rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, W, layout=gl.SliceLayout(0, layout))
    # int64: M·N1 reaches 2^31 at 64k rows × 32k columns.
    offs = rows.to(gl.int64)[:, None] * ld + cols[None, :]
    gl.store(ptr + offs, tile, mask=(rows < row_end)[:, None])


@gluon.jit
def _zero_rows(ptr, m0, col0, ld, M, BM: gl.constexpr, W: gl.constexpr):
    """Zeros to ptr[m0 + r, col0 + c] for the rows before M, in 16-byte vectors along the row."""
    VEC: gl.constexpr = 128 // ptr.dtype.element_ty.primitive_bitwidth
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // W, W // VEC], [4, 1], [1, 0])
    rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, W, layout=gl.SliceLayout(0, layout))
    offs = rows.to(gl.int64)[:, None] * ld + cols[None, :]
    gl.store(ptr + offs, gl.zeros([BM, W], ptr.dtype.element_ty, layout), mask=(rows < M)[:, None])


@gluon.jit
def _store_h_z(h_desc, z_desc, h_ptr, z_ptr, gate_smem, up_smem, z_smem, m0, n0, gate0, row_end, M, N, N1,
               BM: gl.constexpr, G: gl.constexpr, STORE_Z: gl.constexpr):
    """A tile's two h-shaped halves (gate and up columns, G apart; FC1's h, FC2_DGRAD's g_h) and z,
    written to the shared tiles, out to global memory: TMA stores, or masked ones where the tile
    crosses its expert's end (unless that end is row M, where TMA's clipping is exact)."""
    TILE_N: gl.constexpr = h_desc.block_type.shape[1]
    if (m0 + BM <= row_end) | (row_end == M):
        fence_async_shared()
        tma_store(h_desc, [m0, gate0], gate_smem)
        tma_store(h_desc, [m0, gate0 + G], up_smem)
        if STORE_Z:
            tma_store(z_desc, [m0, n0], z_smem)
    else:
        _masked_store(gate_smem, h_ptr, m0, gate0, N1, row_end, BM, TILE_N)
        _masked_store(up_smem, h_ptr, m0, gate0 + G, N1, row_end, BM, TILE_N)
        if STORE_Z:
            _masked_store(z_smem, z_ptr, m0, n0, N, row_end, BM, TILE_N)


@gluon.jit
def _store_block(desc, ptr, smem, m0, col0, ld, row_end, full, BM: gl.constexpr, W: gl.constexpr):
    """One [BM, W] shared tile to ptr[m0 + r, col0 + c]: a TMA store when ``full`` (every row the
    tile's expert's, or the expert ends at row M), else masked 16-byte vectors of the rows before
    ``row_end``."""
    if full:
        fence_async_shared()
        tma_store(desc, [m0, col0], smem)
    else:
        _masked_store(smem, ptr, m0, col0, ld, row_end, BM, W)


@gluon.jit
def _halves(acc, BM: gl.constexpr, TILE_N: gl.constexpr):
    """The accumulator's gate columns (j < TILE_N) and up columns (TILE_N + j): in the wgmma layout
    both sit in the same thread's registers, so the split moves no data."""
    return gl.split(acc.reshape([BM, 2, TILE_N]).permute((0, 2, 1)))


@gluon.jit
def _fc1_epilogue(acc, e, m0, n0, row_end, count, WG: gl.constexpr, args):
    """The engine's epilogue unit (_engine._tile_loop) for FC1. ``args`` = (h_desc, z_desc, h_tiles,
    z_tiles, h_ptr, z_ptr, bias_ptr, probs_ptr, M, N, N1, p0, p1, p2, BM, BN, G, ACT, HAS_BIAS,
    HAS_PROBS, STORE_Z, SCALED, A_PARTS, MX_Z); the constexprs are read by index into constexpr names (unpacking
    would make them runtime values)."""
    BM: gl.constexpr = args[14]
    BN: gl.constexpr = args[15]
    G: gl.constexpr = args[16]
    ACT: gl.constexpr = args[17]
    HAS_BIAS: gl.constexpr = args[18]
    HAS_PROBS: gl.constexpr = args[19]
    STORE_Z: gl.constexpr = args[20]
    ONE_H_TILE: gl.constexpr = not args[21]  # bf16: one h tile a consumer, the gate then the up half
    MX_Z: gl.constexpr = args[23]
    TILE_N: gl.constexpr = BN // 2
    h_desc = args[0]
    z_desc = args[1]
    gate, up = _halves(acc, BM, TILE_N)
    layout: gl.constexpr = gate.type.layout
    gate0 = _glu_rows(n0, G)  # h's column of the tile's first gate; the tile lies in one G block
    if HAS_BIAS:
        cols = gl.arange(0, TILE_N, layout=gl.SliceLayout(0, layout))
        bias_row = args[6] + e.to(gl.int64) * args[10] + gate0
        gate = gate + gl.load(bias_row + cols).to(gl.float32)[None, :]
        up = up + gl.load(bias_row + G + cols).to(gl.float32)[None, :]
    z_smem = args[3].index(WG)
    store_wait(0)  # this warpgroup's previous TMA stores have finished reading its shared tiles
    if ONE_H_TILE:
        h_smem = args[2].index(WG)
        full = (m0 + BM <= row_end) | (row_end == args[8])
        h_smem.store(gate.to(h_desc.dtype))
        _store_block(h_desc, args[4], h_smem, m0, gate0, args[10], row_end, full, BM, TILE_N)
    else:
        gate_smem = args[2].index(2 * WG)
        up_smem = args[2].index(2 * WG + 1)
        gate_smem.store(gate.to(h_desc.dtype))
        up_smem.store(up.to(h_desc.dtype))
    if STORE_Z:
        z = _glu_forward(gate, up, ACT, args[11], args[12], args[13])  # from the fp32 h
        if HAS_PROBS:
            rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
            p = gl.load(args[7] + rows, mask=rows < row_end, other=0.0).to(gl.float32)
            z = z * p[:, None]  # fp32 × fp32: an fp32 probs is never rounded
        if MX_Z:
            z = mxfp8_values(z, BM, TILE_N)  # FC2's operand, from the fp32 z
        z_smem.store(z.to(z_desc.dtype))
    if ONE_H_TILE:
        if STORE_Z:
            _store_block(z_desc, args[5], z_smem, m0, n0, args[9], row_end, full, BM, TILE_N)
            store_wait(1)  # the gate's store has read h_smem (z's may still be reading z_smem)
        else:
            store_wait(0)
        h_smem.store(up.to(h_desc.dtype))
        _store_block(h_desc, args[4], h_smem, m0, gate0 + G, args[10], row_end, full, BM, TILE_N)
    else:
        _store_h_z(h_desc, z_desc, args[4], args[5], gate_smem, up_smem, z_smem, m0, n0, gate0, row_end, args[8],
                   args[9], args[10], BM, G, STORE_Z)


@gluon.jit
def _fc1_capacity(m0, n0, WG: gl.constexpr, args):
    """A capacity tile: rows from Σsplits on belong to no expert; their h and z are 0, stored from
    registers (no shared tile: its addresses would stay live through the mainloop)."""
    BM: gl.constexpr = args[14]
    BN: gl.constexpr = args[15]
    G: gl.constexpr = args[16]
    STORE_Z: gl.constexpr = args[20]
    TILE_N: gl.constexpr = BN // 2
    M = args[8]
    gate0 = _glu_rows(n0, G)
    _zero_rows(args[4], m0, gate0, args[10], M, BM, TILE_N)
    _zero_rows(args[4], m0, gate0 + G, args[10], M, BM, TILE_N)
    if STORE_Z:
        _zero_rows(args[5], m0, n0, args[9], M, BM, TILE_N)


@gluon.jit
def _consumer(a_desc, b_desc, h_desc, z_desc, h_ptr, z_ptr, bias_ptr, probs_ptr, acc_scale_ptr, a_scale_ptr,
              stride_asm, stride_ask, b_scale_ptr, stride_bse, stride_bsn, stride_bsk, splits_ptr, E, M, N, K, N1, p0,
              p1, p2, a_ring, b_ring, h_tiles, z_tiles, ready, empty, turn, WG: gl.constexpr, BM: gl.constexpr,
              BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
              E_BLOCK: gl.constexpr, G: gl.constexpr, ACT: gl.constexpr, HAS_BIAS: gl.constexpr,
              HAS_PROBS: gl.constexpr, STORE_Z: gl.constexpr, SCALED: gl.constexpr, A_PARTS: gl.constexpr,
              ACC_SCALE: gl.constexpr, MX_Z: gl.constexpr):
    # fp8_block: cooperative tiles (A_PARTS = 2) and the scaled mainloop (PROMOTE is not read there);
    # bf16: ping-pong or cooperative tiles, one unpromoted chain a tile (PROMOTE = 0), times the
    # accumulator factor (ACC_SCALE) before the epilogue.
    _tile_loop(_fc1_epilogue, _fc1_capacity,
               (h_desc, z_desc, h_tiles, z_tiles, h_ptr, z_ptr, bias_ptr, probs_ptr, M, N, N1, p0, p1, p2, BM, BN,
                G, ACT, HAS_BIAS, HAS_PROBS, STORE_Z, SCALED, A_PARTS, MX_Z),
               a_ring, b_ring, ready, empty, turn, splits_ptr, E, M, N, K, WG, BM, BN, BK, STAGES, GROUP_M, E_BLOCK,
               True, SCALED, A_PARTS, SCALED,
               (a_scale_ptr, stride_asm, stride_ask, b_scale_ptr, stride_bse, stride_bsn, stride_bsk),
               2, G, ACC_SCALE, acc_scale_ptr)  # fmt: skip


@gluon.jit
def fc1_kernel(
    a_desc,  # x (M, H) bf16 or its e4m3 codes (SCALED), rows grouped by expert; block [BM, BK]
    b_desc,  # W1 (E·N1, H) bf16 or its e4m3 codes, K-major; block [BN / 2, BK] (a gate or an up half of a stage)
    h_desc,  # h (M, N1) bf16, written; block [BM, BN / 2]
    z_desc,  # z (M, F) bf16 or fp32, written (STORE_Z; else h's, unused); block [BM, BN / 2]
    h_ptr,  # h's and z's storage, for the masked stores of tiles that cross an expert's end
    z_ptr,
    bias_ptr,  # (E, N1) fc1_bias (HAS_BIAS)
    probs_ptr,  # (M,) fp32 / bf16 / fp16 (HAS_PROBS)
    acc_scale_ptr,  # ACC_SCALE: 0-d fp32 factor of the accumulator (nvfp4's 1/S_enc product); else None
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
    BN: gl.constexpr,  # gate and up columns of a tile: BN / 2 output columns (128 or, bf16 cooperative, 256)
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    E_BLOCK: gl.constexpr,
    G: gl.constexpr,  # GLU interleave: gate / up blocks of G columns, a multiple of BN / 2
    ACT: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_PROBS: gl.constexpr,
    STORE_Z: gl.constexpr,
    SCALED: gl.constexpr,  # fp8_block's codes and scales
    A_PARTS: gl.constexpr,  # 2: cooperative 2·BM-row tiles (fp8_block, or bf16); 1: ping-pong BM-row tiles (bf16)
    ACC_SCALE: gl.constexpr,  # bf16: h's fp32 accumulator times *acc_scale_ptr before the bias and the GLU
    MX_Z: gl.constexpr = False,  # bf16 z: mxfp8's values of the fp32 z (1×32 blocks along F), FC2's operand
):
    gl.static_assert((A_PARTS == 2) | (not SCALED), "fp8_block on cooperative tiles")
    gl.static_assert(not (ACC_SCALE and SCALED), "an accumulator factor on bf16 values only")
    gl.static_assert(not MX_Z or (STORE_Z and not SCALED), "mxfp8's z values from a bf16 FC1 that stores z")
    gl.static_assert(h_desc.block_type.shape[1] == BN // 2, "h's and z's blocks: a tile's output columns")
    a_ring, b_ring, ready, empty, turn = _ring(a_desc, b_desc, BM, BN, BK, STAGES, True, A_PARTS)
    # Each consumer's shared tiles: h's gate and up halves (fp8_block: 2·WG, 2·WG + 1; bf16: one tile, WG,
    # for both in turn), and z (WG).
    if not SCALED:
        h_tiles = gl.allocate_shared_memory(h_desc.dtype, [2, BM, BN // 2], h_desc.layout)
    else:
        h_tiles = gl.allocate_shared_memory(h_desc.dtype, [4, BM, BN // 2], h_desc.layout)
    if STORE_Z:
        z_tiles = gl.allocate_shared_memory(z_desc.dtype, [2, BM, BN // 2], z_desc.layout)
    else:
        z_tiles = h_tiles  # never written: STORE_Z is off
    # The argument tuples are written out in the call: a tuple bound to a name first would turn its
    # constexprs into runtime values.
    warp_specialize([
        (_consumer, (a_desc, b_desc, h_desc, z_desc, h_ptr, z_ptr, bias_ptr, probs_ptr, acc_scale_ptr, a_scale_ptr,
                     stride_asm, stride_ask, b_scale_ptr, stride_bse, stride_bsn, stride_bsk, splits_ptr, E, M, N, K,
                     N1, p0, p1, p2, a_ring, b_ring, h_tiles, z_tiles, ready, empty, turn, 0, BM, BN, BK, STAGES,
                     GROUP_M, E_BLOCK, G, ACT, HAS_BIAS, HAS_PROBS, STORE_Z, SCALED, A_PARTS, ACC_SCALE, MX_Z)),
        (_consumer, (a_desc, b_desc, h_desc, z_desc, h_ptr, z_ptr, bias_ptr, probs_ptr, acc_scale_ptr, a_scale_ptr,
                     stride_asm, stride_ask, b_scale_ptr, stride_bse, stride_bsn, stride_bsk, splits_ptr, E, M, N, K,
                     N1, p0, p1, p2, a_ring, b_ring, h_tiles, z_tiles, ready, empty, turn, 1, BM, BN, BK, STAGES,
                     GROUP_M, E_BLOCK, G, ACT, HAS_BIAS, HAS_PROBS, STORE_Z, SCALED, A_PARTS, ACC_SCALE, MX_Z)),
        (_producer, (a_desc, b_desc, splits_ptr, E, M, N, K, a_ring, b_ring, ready, empty, BM, BN, BK, STAGES,
                     GROUP_M, E_BLOCK, True, A_PARTS, 2, G, N1)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
