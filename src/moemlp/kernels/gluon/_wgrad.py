"""The weight gradients on the warp-specialized engine: dW[e] = G[R_e]ᵀ @ X[R_e], a reduction over
each expert's rows. Both kernels are persistent (one CTA per SM) over tiles (expert, rows of N,
columns of K), expert-major with GROUP_N n-tiles sharing each k-tile of X (the Triton kernels'
order); a tile's reduction is its expert's rows, none for an empty expert (which stores zeros). The
producer runs ahead into the next tiles' rows while the consumers finish a tile, which a plain grid
cannot overlap where small experts give K loops of 1-4 steps. Both the producer and the consumers
count their ring position up tile by tile (the tiles' step counts differ). Stores: registers →
shared memory → a TMA store of dW viewed as (E·N, K) when the tile lies in its expert's N rows (or
ends the tensor), else a masked store of the rows before the expert's end (``_engine._store_tile``).

``wgrad_kernel`` (bf16): G (T, N) and X (T, K) as they are, rows grouped by expert. Each step loads
BK rows of both from the expert's first row on; the last step of an expert whose row count is not a
multiple of BK also holds the next expert's first rows, which the consumer sets to zero in shared
memory before its wgmma (both operands: 0 · inf would be NaN). The chained fp32 accumulator, a
chain of k16 products over the expert's rows in order, zero rows past its end, is the Triton
kernel's (kernels/gemm/wgrad.py), so the two give the same bits. Consumers: ping-pong 128 × 128 tiles, one
warpgroup's epilogue (the bf16 tile's store) under the other's mainloop. ACC_SCALE (nvfp4's values):
the accumulator times the factor at ``acc_scale_ptr`` before its rounding, as the Triton kernel's
ACC_SCALE.

``fp8_wgrad_kernel`` (fp8_block): the operands are ``quantize_wgrad(t, splits, recipe,
transposed=True)``'s: Gᵀ (N, P) and Xᵀ (K, P) e4m3 codes in the expert-aligned padded layout (P =
(⌈T/128⌉ + E)·128 rows, expert e's rows in its own whole 128-row blocks, padding rows code 0) with
fp32 scales (P/128, N) and (P/128, K), as the Triton kernel (kernels/gemm/fp8_wgrad.py) takes them.
Its arithmetic, step for step: each of the expert's 128-row blocks is one 128-deep product from
zero, scaled by g_scale[b, n] · x_scale[b, k] and added to the fp32 total, so the two kernels give
the same bits. The producer loads each block's scales by TMA into the stage beside its codes (a
[1, 128] row of G's and one of X's), as DeepGEMM's 1D1D kernel does; the consumers read them from
shared memory in the accumulator's layout before the step's MMAs, so no global-memory latency sits
in a step. The two consumer warpgroups take the two 64-row halves of each tile (cooperative), so
that one's add overlaps the other's wgmma.
"""

from __future__ import annotations

from ._compat import (
    cta_barrier,
    expect_bytes,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    store_wait,
    tma_load,
    warp_specialize,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from ._engine import CONSUMER_REGS, PRODUCER_REGS, _expert_table, _ring, _store_tile


@gluon.jit
def _coords(t, num_n, num_k, GROUP_N: gl.constexpr):
    """Tile t → (expert, n-tile, k-tile): expert-major, GROUP_N n-tiles sharing each k-tile."""
    per_expert = num_n * num_k
    e = t // per_expert
    r = t % per_expert
    in_group = GROUP_N * num_k
    first_n = (r // in_group) * GROUP_N
    group_size = gl.minimum(num_n - first_n, GROUP_N)
    tn = first_n + (r % in_group) % group_size
    tk = (r % in_group) // group_size
    return e, tn, tk


@gluon.jit
def _blocks(idx, block_ends, e):
    """Expert e's 128-row blocks of the padded layout, (count, first), from the running block count
    alone: the only table field kept live across the tile loop (more spilled the consumers)."""
    end = gl.sum(gl.where(idx == e, block_ends, 0), 0)
    first = gl.sum(gl.where(idx == e - 1, block_ends, 0), 0)
    return end - first, first


@gluon.jit
def _producer(g_desc, x_desc, gs_desc, xs_desc, splits_ptr, E, T, N, K, a_ring, b_ring, as_ring, bs_ring, ready,
              empty, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, GROUP_N: gl.constexpr,
              E_BLOCK: gl.constexpr):
    """Each stage: a 128-row block's two BM-row halves of Gᵀ and its BN rows of Xᵀ, and the block's
    scales of the tile's 2·BM rows of G and BN columns of X (one [1, ·] TMA box each)."""
    num_n = gl.cdiv(N, 2 * BM)
    num_k = gl.cdiv(K, BN)
    idx, _, _, block_ends, _, _ = _expert_table(splits_ptr, E, T, 1, 128, E_BLOCK, 1)
    stage_bytes: gl.constexpr = (2 * g_desc.block_type.nbytes + x_desc.block_type.nbytes + gs_desc.block_type.nbytes
                                 + xs_desc.block_type.nbytes)
    it = 0
    for t in range(gl.program_id(0), E * num_n * num_k, gl.num_programs(0)):
        e, tn, tk = _coords(t, num_n, num_k, GROUP_N)
        count, first = _blocks(idx, block_ends, e)
        for i in range(count):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            expect_bytes(ready.index(s), stage_bytes)
            b = first + i
            for part in gl.static_range(2):
                tma_load(g_desc, [tn * 2 * BM + part * BM, b * 128], ready.index(s), a_ring.index(s * 2 + part))
            tma_load(x_desc, [tk * BN, b * 128], ready.index(s), b_ring.index(s))
            tma_load(gs_desc, [b, tn * 2 * BM], ready.index(s), as_ring.index(s))
            tma_load(xs_desc, [b, tk * BN], ready.index(s), bs_ring.index(s))
            it += 1


@gluon.jit
def _stage_scales(as_ring, bs_ring, s, WG: gl.constexpr, BM: gl.constexpr, acc_layout: gl.constexpr):
    """Stage s's scales in the accumulator's layout: this consumer's BM rows of G's as a [BM, 1]
    column, the tile's BN columns of X's as a [1, BN] row. Rows past N and columns past K are TMA's
    zeros, which scale products of zero codes that are never stored."""
    a_s = as_ring.index(s).slice(WG * BM, BM, dim=1).permute((1, 0)).load(acc_layout)
    b_s = bs_ring.index(s).load(acc_layout)
    return a_s, b_s


@gluon.jit
def _mainloop(a_ring, b_ring, as_ring, bs_ring, ready, empty, it, count, acc_layout: gl.constexpr, BM: gl.constexpr,
              BN: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr):
    """A tile's reduction over its expert's ``count`` 128-row blocks: each block one 128-deep product
    from zero (4 e4m3 wgmma m64n128k32), waited for, then added to the fp32 total as
    ``total += part · (g_s · x_s)``, the Triton kernel's arithmetic in its order. The block's scales
    are read from its stage before its MMAs are issued, so the add waits on nothing but the product.
    One product in flight, as DeepGEMM's mainloop: the other consumer's MMAs fill the tensor cores
    during this one's add (two in flight, each added under the next one's MMAs, measured 0.72-0.92×
    this: docs/DECISIONS.md)."""
    total = gl.zeros([BM, BN], gl.float32, acc_layout)
    part = gl.zeros([BM, BN], gl.float32, acc_layout)
    for _ in range(count):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        a_s, b_s = _stage_scales(as_ring, bs_ring, s, WG, BM, acc_layout)
        pending = warpgroup_mma(a_ring.index(s * 2 + WG), b_ring.index(s).permute((1, 0)), part, use_acc=False,
                                is_async=True)
        part = warpgroup_mma_wait(0, deps=(pending,))
        mbarrier.arrive(empty.index(s))
        total += part * (a_s * b_s)
        it += 1
    return total, it


@gluon.jit
def _consumer(c_desc, c_ptr, splits_ptr, E, T, N, K, a_ring, b_ring, as_ring, bs_ring, c_tiles, ready, empty,
              WG: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, GROUP_N: gl.constexpr,
              E_BLOCK: gl.constexpr):
    num_n = gl.cdiv(N, 2 * BM)
    num_k = gl.cdiv(K, BN)
    idx, _, _, block_ends, _, _ = _expert_table(splits_ptr, E, T, 1, 128, E_BLOCK, 4)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 32])
    it = 0
    for t in range(gl.program_id(0), E * num_n * num_k, gl.num_programs(0)):
        e, tn, tk = _coords(t, num_n, num_k, GROUP_N)
        count, first = _blocks(idx, block_ends, e)
        acc, it = _mainloop(a_ring, b_ring, as_ring, bs_ring, ready, empty, it, count, acc_layout, BM, BN, STAGES, WG)
        row0 = e * N
        n0 = tn * 2 * BM + WG * BM  # this warpgroup's first row of dW[e]
        _store_tile(acc, c_desc, c_ptr, c_tiles.index(WG), row0 + n0, tk * BN, row0 + N, E * N, K, BM, BN)
    store_wait(0)


@gluon.jit
def fp8_wgrad_kernel(
    g_desc,  # Gᵀ (N, P) e4m3 codes, K-major along the padded rows; block [BM, 128]
    x_desc,  # Xᵀ (K, P) e4m3 codes; block [BN, 128]
    gs_desc,  # G's scales (P/128, N) fp32, contiguous; block [1, 2·BM]
    xs_desc,  # X's scales (P/128, K) fp32, contiguous; block [1, BN]
    c_desc,  # dW viewed as (E·N, K), bf16 or fp32; block [BM, BN]
    c_ptr,  # the same tensor, for the masked store of a half-tile past its expert's N rows
    splits_ptr,  # (E,) int32 / int64 rows per expert, clamped to T
    E,
    T,  # source rows
    N,
    K,
    BM: gl.constexpr,  # a consumer's rows of N: tiles are 2·BM rows
    BN: gl.constexpr,  # columns of K a tile
    STAGES: gl.constexpr,
    GROUP_N: gl.constexpr,
    E_BLOCK: gl.constexpr,
):
    a_ring, b_ring, ready, empty, turn = _ring(g_desc, x_desc, BM, BN, 128, STAGES, True, 2)
    as_ring = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 2 * BM], gs_desc.layout)
    bs_ring = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BN], xs_desc.layout)
    c_tiles = gl.allocate_shared_memory(c_desc.dtype, [2, BM, BN], c_desc.layout)
    warp_specialize([
        (_consumer, (c_desc, c_ptr, splits_ptr, E, T, N, K, a_ring, b_ring, as_ring, bs_ring, c_tiles, ready, empty,
                     0, BM, BN, STAGES, GROUP_N, E_BLOCK)),
        (_consumer, (c_desc, c_ptr, splits_ptr, E, T, N, K, a_ring, b_ring, as_ring, bs_ring, c_tiles, ready, empty,
                     1, BM, BN, STAGES, GROUP_N, E_BLOCK)),
        (_producer, (g_desc, x_desc, gs_desc, xs_desc, splits_ptr, E, T, N, K, a_ring, b_ring, as_ring, bs_ring,
                     ready, empty, BM, BN, STAGES, GROUP_N, E_BLOCK)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def _rows(idx, ends, e):
    """Expert e's rows [start, end) from the running row count alone (the table field kept live)."""
    end = gl.sum(gl.where(idx == e, ends, 0), 0)
    start = gl.sum(gl.where(idx == e - 1, ends, 0), 0)
    return start, end


@gluon.jit
def _bf16_producer(g_desc, x_desc, splits_ptr, E, T, N, K, a_ring, b_ring, ready, empty, BM: gl.constexpr,
                   BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, GROUP_N: gl.constexpr,
                   E_BLOCK: gl.constexpr):
    num_n = gl.cdiv(N, BM)
    num_k = gl.cdiv(K, BN)
    idx, _, ends, _, _, _ = _expert_table(splits_ptr, E, T, 1, BK, E_BLOCK, 1)
    stage_bytes: gl.constexpr = g_desc.block_type.nbytes + x_desc.block_type.nbytes
    it = 0
    for t in range(gl.program_id(0), E * num_n * num_k, gl.num_programs(0)):
        e, tn, tk = _coords(t, num_n, num_k, GROUP_N)
        start, end = _rows(idx, ends, e)
        for r in range(start, end, BK):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            expect_bytes(ready.index(s), stage_bytes)
            tma_load(g_desc, [r, tn * BM], ready.index(s), a_ring.index(s))
            tma_load(x_desc, [r, tk * BN], ready.index(s), b_ring.index(s))
            it += 1


@gluon.jit
def _zero_rows_from(stage, valid, ROWS: gl.constexpr, COLS: gl.constexpr):
    """Rows ``valid`` on of a [ROWS, COLS] bf16 stage set to zero: the next expert's rows that the
    expert's last TMA block also holds."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // COLS, COLS // 8], [4, 1], [1, 0])
    tile = stage.load(layout)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    stage.store(gl.where(gl.expand_dims(rows < valid, 1), tile, gl.zeros_like(tile)))


@gluon.jit
def _mainloop_rows(a_ring, b_ring, ready, empty, it, start, end, acc_layout: gl.constexpr, BM: gl.constexpr,
                   BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """One tile's reduction over the rows [start, end), BK a step: async wgmma on Gᵀ (the stage's
    [BK, BM] block through a transposed view) and X, one group in flight, the chained accumulator.
    A last step past ``end`` first zeroes its rows from ``end`` on in both operands, then makes the
    writes visible to the tensor cores (proxy fence, then the warpgroup's barrier: wgmma reads every
    warp's rows). Returns the accumulator with the last wgmma pending and its stage held."""
    acc = gl.zeros([BM, BN], gl.float32, acc_layout)
    for r in range(start, end, BK):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        if end - r < BK:
            _zero_rows_from(a_ring.index(s), end - r, BK, BM)
            _zero_rows_from(b_ring.index(s), end - r, BK, BN)
            fence_async_shared()
            cta_barrier()
        acc = warpgroup_mma(a_ring.index(s).permute((1, 0)), b_ring.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=r > start)
        it += 1
    return acc, it


@gluon.jit
def _bf16_consumer(c_desc, c_ptr, acc_scale_ptr, splits_ptr, E, T, N, K, a_ring, b_ring, c_tiles, ready, empty, turn,
                   WG: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                   GROUP_N: gl.constexpr, E_BLOCK: gl.constexpr, ACC_SCALE: gl.constexpr):
    """Ping-pong: this CTA's j-th tile is warpgroup j % 2's, the mainloops taken in turn (the engine's
    ``turn`` pair); the ring position counts the other warpgroup's steps too. ACC_SCALE: each tile's
    accumulator times the fp32 scalar at ``acc_scale_ptr`` before it is rounded and stored, as the
    Triton kernel scales dW (an empty expert's zeros included)."""
    num_n = gl.cdiv(N, BM)
    num_k = gl.cdiv(K, BN)
    idx, _, ends, _, _, _ = _expert_table(splits_ptr, E, T, 1, BK, E_BLOCK, 4)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    my_tiles = gl.cdiv(gl.maximum(E * num_n * num_k - pid, 0), nprog)
    if ACC_SCALE:
        factor = gl.load(acc_scale_ptr)  # one scalar for the launch, loaded once
    it = 0
    if WG == 1:  # the first tile is warpgroup 0's
        e0, _, _ = _coords(pid, num_n, num_k, GROUP_N)
        start0, end0 = _rows(idx, ends, e0)
        it = gl.cdiv(end0 - start0, BK)
    turns = 0
    for j in range(WG, my_tiles, 2):
        e, tn, tk = _coords(pid + j * nprog, num_n, num_k, GROUP_N)
        start, end = _rows(idx, ends, e)
        mbarrier.wait(turn.index(WG), (turns & 1) ^ (1 - WG))
        turns += 1
        acc, it = _mainloop_rows(a_ring, b_ring, ready, empty, it, start, end, acc_layout, BM, BN, BK, STAGES)
        mbarrier.arrive(turn.index(1 - WG))  # every stage of this tile waited on: the other's turn
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=end > start)
        # the other warpgroup's next tile, whose steps the ring has between this tile and my next
        if j + 1 < my_tiles:
            e1, _, _ = _coords(pid + (j + 1) * nprog, num_n, num_k, GROUP_N)
            start1, end1 = _rows(idx, ends, e1)
            it += gl.cdiv(end1 - start1, BK)
        if ACC_SCALE:
            acc = acc * factor
        row0 = e * N
        _store_tile(acc, c_desc, c_ptr, c_tiles.index(WG), row0 + tn * BM, tk * BN, row0 + N, E * N, K, BM, BN)
    store_wait(0)


@gluon.jit
def wgrad_kernel(
    g_desc,  # G (T, N) bf16, rows grouped by expert; block [BK, BM]
    x_desc,  # X (T, K) bf16; block [BK, BN]
    c_desc,  # dW viewed as (E·N, K), bf16 or fp32; block [BM, BN]
    c_ptr,  # the same tensor, for the masked store of a tile past its expert's N rows
    acc_scale_ptr,  # ACC_SCALE: 0-d fp32 factor of dW's accumulator (nvfp4's 1/S_enc product); else None
    splits_ptr,  # (E,) int32 / int64 rows per expert, clamped to T
    E,
    T,  # rows of G and X
    N,
    K,
    BM: gl.constexpr,  # rows of N a tile (one warpgroup's)
    BN: gl.constexpr,  # columns of K a tile
    BK: gl.constexpr,  # rows a step
    STAGES: gl.constexpr,
    GROUP_N: gl.constexpr,
    E_BLOCK: gl.constexpr,
    ACC_SCALE: gl.constexpr,
):
    a_ring, b_ring, ready, empty, turn = _ring(g_desc, x_desc, BM, BN, BK, STAGES, False, 1)
    c_tiles = gl.allocate_shared_memory(c_desc.dtype, [2, BM, BN], c_desc.layout)
    warp_specialize([
        (_bf16_consumer, (c_desc, c_ptr, acc_scale_ptr, splits_ptr, E, T, N, K, a_ring, b_ring, c_tiles, ready, empty,
                          turn, 0, BM, BN, BK, STAGES, GROUP_N, E_BLOCK, ACC_SCALE)),
        (_bf16_consumer, (c_desc, c_ptr, acc_scale_ptr, splits_ptr, E, T, N, K, a_ring, b_ring, c_tiles, ready, empty,
                          turn, 1, BM, BN, BK, STAGES, GROUP_N, E_BLOCK, ACC_SCALE)),
        (_bf16_producer, (g_desc, x_desc, splits_ptr, E, T, N, K, a_ring, b_ring, ready, empty, BM, BN, BK, STAGES,
                          GROUP_N, E_BLOCK)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
