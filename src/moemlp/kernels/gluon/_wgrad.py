"""fp8_block's weight gradients on the warp-specialized engine: dW[e] = G[R_e]ᵀ @ X[R_e].

The operands are ``quantize_wgrad(t, splits, recipe, transposed=True)``'s: Gᵀ (N, P) and Xᵀ (K, P)
e4m3 codes in the expert-aligned padded layout (P = (⌈T/128⌉ + E)·128 rows, expert e's rows in its
own whole 128-row blocks, padding rows code 0) with fp32 scales (P/128, N) and (P/128, K), as the
Triton kernel (kernels/gemm/fp8_wgrad.py) takes them. Its arithmetic, step for step: each of the
expert's 128-row blocks is one 128-deep product from zero, scaled by g_scale[b, n] · x_scale[b, k]
and added to the fp32 total (``_engine._mainloop_scaled`` with a scale a row and a scale a column),
so the two kernels give the same bits.

Tiles: (expert, 128 rows of N, 128 columns of K), expert-major, GROUP_N n-tiles sharing each Xᵀ
k-tile (the Triton kernel's order); each tile's reduction is its expert's block count, 0 for an empty
expert (which stores zeros). Persistent, one CTA per SM: the producer runs ahead into the next tile's
blocks while the consumers finish a tile, which a plain grid cannot overlap, where small experts give
tiles of 1-4 steps. The two consumer warpgroups take the two 64-row halves of each tile
(cooperative), so that one's promotion overlaps the other's wgmma. Both the producer and the
consumers count their ring position up tile by tile (the tiles' step counts differ).

Stores: registers → shared memory → a TMA store of dW viewed as (E·N, K) when the half-tile lies in
its expert's N rows (or ends the tensor), else a masked store of the rows before the expert's end
(``_engine._store_tile``).
"""

from __future__ import annotations

from ._compat import expect_bytes, gl, gluon, mbarrier, store_wait, tma_load, warp_specialize
from ._engine import _expert_table, _mainloop_scaled, _ring, _store_tile

# 3 × 168 registers at launch, moved by setmaxnreg: the consumers hold a scale a column of X besides the
# total and the product in flight, and spilled at the engine's 232; the producer's loop needs few
# (its expert table is one field, E_BLOCK / 32 values a lane).
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)


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
def _producer(g_desc, x_desc, splits_ptr, E, T, N, K, a_ring, b_ring, ready, empty, BM: gl.constexpr,
              BN: gl.constexpr, STAGES: gl.constexpr, GROUP_N: gl.constexpr, E_BLOCK: gl.constexpr):
    num_n = gl.cdiv(N, 2 * BM)
    num_k = gl.cdiv(K, BN)
    idx, _, _, block_ends, _, _ = _expert_table(splits_ptr, E, T, 1, 128, E_BLOCK, 1)
    stage_bytes: gl.constexpr = 2 * g_desc.block_type.nbytes + x_desc.block_type.nbytes
    it = 0
    for t in range(gl.program_id(0), E * num_n * num_k, gl.num_programs(0)):
        e, tn, tk = _coords(t, num_n, num_k, GROUP_N)
        count, first = _blocks(idx, block_ends, e)
        for i in range(count):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            expect_bytes(ready.index(s), stage_bytes)
            r = (first + i) * 128
            for part in gl.static_range(2):
                tma_load(g_desc, [tn * 2 * BM + part * BM, r], ready.index(s), a_ring.index(s * 2 + part))
            tma_load(x_desc, [tk * BN, r], ready.index(s), b_ring.index(s))
            it += 1


@gluon.jit
def _consumer(g_desc, x_desc, c_desc, c_ptr, g_scale_ptr, stride_gsb, stride_gsn, x_scale_ptr, stride_xsb, stride_xsk,
              splits_ptr, E, T, N, K, a_ring, b_ring, c_tiles, ready, empty, WG: gl.constexpr, BM: gl.constexpr,
              BN: gl.constexpr, STAGES: gl.constexpr, GROUP_N: gl.constexpr, E_BLOCK: gl.constexpr):
    num_n = gl.cdiv(N, 2 * BM)
    num_k = gl.cdiv(K, BN)
    idx, _, _, block_ends, _, _ = _expert_table(splits_ptr, E, T, 1, 128, E_BLOCK, 4)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 32])
    it = 0
    for t in range(gl.program_id(0), E * num_n * num_k, gl.num_programs(0)):
        e, tn, tk = _coords(t, num_n, num_k, GROUP_N)
        count, first = _blocks(idx, block_ends, e)
        n0 = tn * 2 * BM + WG * BM  # this warpgroup's first row of dW[e]
        rows = n0 + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
        cols = tk * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
        g_s_ptrs = g_scale_ptr + first.to(gl.int64) * stride_gsb + rows * stride_gsn
        x_s_base = x_scale_ptr + first.to(gl.int64) * stride_xsb
        acc, it = _mainloop_scaled(a_ring, b_ring, ready, empty, it, count, acc_layout, BM, BN, STAGES, 2, WG,
                                   g_s_ptrs, rows < N, stride_gsb, x_s_base, stride_xsb, True,
                                   gl.minimum(cols, K - 1) * stride_xsk)
        row0 = e * N
        _store_tile(acc, c_desc, c_ptr, c_tiles.index(WG), row0 + n0, tk * BN, row0 + N, E * N, K, BM, BN)
    store_wait(0)


@gluon.jit
def fp8_wgrad_kernel(
    g_desc,  # Gᵀ (N, P) e4m3 codes, K-major along the padded rows; block [BM, 128]
    x_desc,  # Xᵀ (K, P) e4m3 codes; block [BN, 128]
    c_desc,  # dW viewed as (E·N, K), bf16 or fp32; block [BM, BN]
    c_ptr,  # the same tensor, for the masked store of a half-tile past its expert's N rows
    g_scale_ptr,  # (P/128, N) fp32: block b, column n at b·stride_gsb + n·stride_gsn
    stride_gsb,
    stride_gsn,
    x_scale_ptr,  # (P/128, K) fp32
    stride_xsb,
    stride_xsk,
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
    c_tiles = gl.allocate_shared_memory(c_desc.dtype, [2, BM, BN], c_desc.layout)
    warp_specialize([
        (_consumer, (g_desc, x_desc, c_desc, c_ptr, g_scale_ptr, stride_gsb, stride_gsn, x_scale_ptr, stride_xsb,
                     stride_xsk, splits_ptr, E, T, N, K, a_ring, b_ring, c_tiles, ready, empty, 0, BM, BN, STAGES,
                     GROUP_N, E_BLOCK)),
        (_consumer, (g_desc, x_desc, c_desc, c_ptr, g_scale_ptr, stride_gsb, stride_gsn, x_scale_ptr, stride_xsb,
                     stride_xsk, splits_ptr, E, T, N, K, a_ring, b_ring, c_tiles, ready, empty, 1, BM, BN, STAGES,
                     GROUP_N, E_BLOCK)),
        (_producer, (g_desc, x_desc, splits_ptr, E, T, N, K, a_ring, b_ring, ready, empty, BM, BN, STAGES, GROUP_N,
                     E_BLOCK)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
