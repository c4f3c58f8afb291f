"""FC2_DGRAD on the warp-specialized engine: g_z = dy[R_e] @ W2[e] with its fused epilogue.

    g_z  = dy @ W2[e]                       fp32, each CHAIN·64-deep product promoted
    part = Σ_f g_z · a                      the tile's dprobs partial, from fp32 g_z and fp32 a
    g_h  = g_z · p · (da/dgate, da/dup)     one rounding to bf16 (gate and up columns of h)
    z    = a · p                            one rounding to bf16, dW2's operand

Under fp8_block (SCALED) dy and W2 are e4m3 codes with their 1×128 and 128×128 scales, g_z the sum
of the scaled 128-deep products (_engine._mainloop_scaled), and g_h and z are stored in fp32, the
unrounded values the recipe quantizes for dx, dW1 and dW2 (kernels/mlp.py). On bf16 values with
ACC_SCALE (nvfp4's) g_z is the promoted total times the factor at ``acc_scale_ptr``, multiplied before
any epilogue form reads it: in ``_engine._tile_loop`` for the staged and the register epilogue, in
``_handoff_consumer`` before the handoff to the epilogue warpgroup.

a = act(gate, up) from the stored h upcast to fp32; the GLU kinds swiglu (0) and clamped_swiglu (1),
written operation for operation as kernels/gemm/activations.py writes them.

The partitions are the engine's (_engine.py): the 1-warp TMA producer unchanged, two consumer
warpgroups on 64-row tiles (A_PARTS = 1) in ping-pong, or on the two 64-row halves of 128-row tiles
(A_PARTS = 2, cooperative). A consumer's promoted mainloop waits on every product before adding it,
so its own tensor-core work idles for the add. Ping-pong hides one warpgroup's epilogue (read h,
write g_h and z: ~2.5× the bytes of the tile's fp32 g_z) behind the other's mainloop, but only one
warpgroup issues wgmma at a time; cooperative has both issue at once, each filling the other's
waits, and reads each B block once for 128 rows, with the epilogue exposed. Cooperative is faster
on large experts, ping-pong where experts are small and half of a 128-row tile would be empty
(_launch.DGRAD_COOPERATIVE_ROWS). The Triton kernel runs that epilogue after each tile's mainloop
with nothing overlapping it.

Epilogue, staged (ping-pong tiles, fp8_block, G not a multiple of 128): the accumulator goes to a
per-warpgroup fp32 shared tile, and is read back in column chunks of CW in a blocked layout (8
consecutive columns a thread), so h loads and the g_h / z stores are row-contiguous vectors rather
than wgmma's 2-column fragments. In the accumulator's layout (REGS: by default on bf16's cooperative
tiles, whose epilogue nothing overlaps, where G is a multiple of 128; ``register_epilogue`` of
``_launch.fc2_dgrad``): the
tile's h gate and up columns arrive by TMA into bf16 shared tiles, are read in g_z's layout a column
quarter at a time (a thread holds columns c, c + 32, c + 64, c + 96 of the same rows, so the splits
move no data and the promoted mainloop's registers suffice), and g_h (over h's tiles) and z leave
by TMA stores (``_regs_epilogue``); g_z never leaves the registers. Either way, rows past the expert's
end belong to the next expert's tiles and are masked; capacity rows (past Σsplits) get zeros in
g_h, z and the partials, written by the capacity tiles after the real ones, so every element of
the outputs is written exactly once. No atomics: the same bits on every run.
"""

from __future__ import annotations

from ._compat import (
    expect_bytes,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    store_wait,
    tma_load,
    warp_specialize,
)
from ._engine import (
    CONSUMER_REGS,
    EPI_CONSUMER_REGS,
    EPI_REGS,
    PRODUCER_REGS,
    _expert_table,
    _glu_rows,
    _mainloop_promoted_single,
    _producer,
    _ring,
    _tile_coords,
    _tile_loop,
)
from ._fc1 import _store_h_z
from ._glu import _glu_backward


@gluon.jit
def _pair_offsets(local, n0c, row_ok, N, N1, CW: gl.constexpr):
    """Offsets (in a tile of h) and mask of h's 2·CW columns holding gate and up of the CW columns
    from n0c, interleaved column by column (G = 1), in a layout of 16 contiguous bf16 a thread."""
    flat: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 8 // CW, CW // 8], [4, 1], [1, 0])
    rows2 = gl.convert_layout(local, gl.SliceLayout(1, flat))
    ok2 = gl.convert_layout(row_ok, gl.SliceLayout(1, flat))
    c2 = gl.arange(0, 2 * CW, layout=gl.SliceLayout(0, flat))
    h_off = rows2[:, None] * N1 + (2 * n0c + c2)[None, :]
    # the column test on the contiguous index, so the mask is constant over each 16-element vector
    pair_mask = ok2[:, None] & (2 * n0c + c2 < 2 * N)[None, :]
    return h_off, pair_mask


@gluon.jit
def _load_pairs(h_tile, local, n0c, row_ok, N, N1, BM: gl.constexpr, CW: gl.constexpr):
    """Gate and up of the CW columns from n0c where h interleaves them column by column (G = 1): one
    row-contiguous load of 2·CW columns of h (16 bf16 a thread) split in registers, instead of two
    stride-2 gathers of 2-byte elements. Returns gate, up (fp32, the epilogue's layout) and the
    offsets and mask of the 2·CW columns for ``_store_pairs``."""
    epi: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // CW, CW // 8], [4, 1], [1, 0])
    h_off, pair_mask = _pair_offsets(local, n0c, row_ok, N, N1, CW)
    hv = gl.load(h_tile + h_off, mask=pair_mask, other=0.0).to(gl.float32)
    gate, up = gl.split(gl.reshape(hv, [BM, CW, 2]))
    return gl.convert_layout(gate, epi), gl.convert_layout(up, epi), h_off, pair_mask


@gluon.jit
def _store_pairs(gh_tile, h_off, pair_mask, g_gate, g_up, BM: gl.constexpr, CW: gl.constexpr):
    flat: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 8 // CW, CW // 8], [4, 1], [1, 0])
    both = gl.convert_layout(gl.reshape(gl.join(g_gate, g_up), [BM, 2 * CW]), flat)
    gl.store(gh_tile + h_off, both.to(gh_tile.dtype.element_ty), mask=pair_mask)


@gluon.jit
def _epilogue(g_smem, h_ptr, gh_ptr, z_ptr, probs_ptr, part_ptr, m0, n0, row_end, M, N, N1, p0, p1, p2,
              BM: gl.constexpr, BN: gl.constexpr, CW: gl.constexpr, G: gl.constexpr, ACT: gl.constexpr,
              HAS_PROBS: gl.constexpr, STORE_Z: gl.constexpr, STORE_PARTIAL: gl.constexpr):
    epi: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // CW, CW // 8], [4, 1], [1, 0])
    local = gl.arange(0, BM, layout=gl.SliceLayout(1, epi))
    rows = m0 + local
    row_ok = rows < row_end
    # A 64-bit base per tile plus int32 offsets (BM·N1 < 2^31): int64 offset tensors would take two
    # registers an element.
    h_tile = h_ptr + m0.to(gl.int64) * N1
    gh_tile = gh_ptr + m0.to(gl.int64) * N1
    z_tile = z_ptr + m0.to(gl.int64) * N
    if HAS_PROBS:
        p = gl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(gl.float32)  # fp32 probs never rounded
    part = gl.zeros([BM], gl.float32, gl.SliceLayout(1, epi))
    for c in gl.static_range(BN // CW):
        g_z = g_smem.slice(c * CW, CW, dim=1).load(epi)
        cols = n0 + c * CW + gl.arange(0, CW, layout=gl.SliceLayout(0, epi))
        mask = row_ok[:, None] & (cols < N)[None, :]
        if G == 1:
            gate, up, h_off, pair_mask = _load_pairs(h_tile, local, n0 + c * CW, row_ok, N, N1, BM, CW)
        else:
            n_h = (cols // G) * (2 * G) + cols % G  # gate column of f in h; up column = + G
            h_off = local[:, None] * N1 + n_h[None, :]
            gate = gl.load(h_tile + h_off, mask=mask, other=0.0).to(gl.float32)
            up = gl.load(h_tile + h_off + G, mask=mask, other=0.0).to(gl.float32)
        a, d_gate, d_up = _glu_backward(gate, up, ACT, p0, p1, p2)
        part += gl.sum(gl.where(mask, g_z * a, 0.0), axis=1)
        g_a = g_z
        if HAS_PROBS:
            g_a = g_z * p[:, None]
        if G == 1:
            _store_pairs(gh_tile, h_off, pair_mask, g_a * d_gate, g_a * d_up, BM, CW)
        else:
            gl.store(gh_tile + h_off, (g_a * d_gate).to(gh_ptr.dtype.element_ty), mask=mask)
            gl.store(gh_tile + h_off + G, (g_a * d_up).to(gh_ptr.dtype.element_ty), mask=mask)
        if STORE_Z:
            z = a
            if HAS_PROBS:
                z = a * p[:, None]
            gl.store(z_tile + (local[:, None] * N + cols[None, :]), z.to(z_ptr.dtype.element_ty), mask=mask)
    if STORE_PARTIAL:
        gl.store(part_ptr + (n0 // BN).to(gl.int64) * M + rows, part, mask=row_ok)


@gluon.jit
def _zeros(gh_ptr, z_ptr, part_ptr, m0, n0, M, N, N1, BM: gl.constexpr, BN: gl.constexpr, CW: gl.constexpr,
           G: gl.constexpr, STORE_Z: gl.constexpr, STORE_PARTIAL: gl.constexpr):
    """A capacity tile: rows from Σsplits on belong to no expert; their g_h, z and partials are 0."""
    epi: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // CW, CW // 8], [4, 1], [1, 0])
    flat: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 8 // CW, CW // 8], [4, 1], [1, 0])  # _pair_offsets'
    local = gl.arange(0, BM, layout=gl.SliceLayout(1, epi))
    rows = m0 + local
    row_ok = rows < M
    gh_tile = gh_ptr + m0.to(gl.int64) * N1
    z_tile = z_ptr + m0.to(gl.int64) * N
    zero = gl.zeros([BM, CW], gh_ptr.dtype.element_ty, epi)
    for c in gl.static_range(BN // CW):
        cols = n0 + c * CW + gl.arange(0, CW, layout=gl.SliceLayout(0, epi))
        mask = row_ok[:, None] & (cols < N)[None, :]
        if G == 1:
            h_off, pair_mask = _pair_offsets(local, n0 + c * CW, row_ok, N, N1, CW)
            gl.store(gh_tile + h_off, gl.zeros([BM, 2 * CW], gh_ptr.dtype.element_ty, flat), mask=pair_mask)
        else:
            n_h = (cols // G) * (2 * G) + cols % G
            h_off = local[:, None] * N1 + n_h[None, :]
            gl.store(gh_tile + h_off, zero, mask=mask)
            gl.store(gh_tile + h_off + G, zero, mask=mask)
        if STORE_Z:
            gl.store(z_tile + (local[:, None] * N + cols[None, :]), zero.to(z_ptr.dtype.element_ty), mask=mask)
    if STORE_PARTIAL:
        gl.store(part_ptr + (n0 // BN).to(gl.int64) * M + rows, gl.zeros([BM], gl.float32, gl.SliceLayout(1, epi)),
                 mask=row_ok)


@gluon.jit
def _regs_part(g_z, gate_smem, up_smem, z_smem, p_rows, args):
    """One column quarter of ``_regs_epilogue``: h's gate and up of these columns read in g_z's layout,
    g_h written over them and z to its tile; returns the quarter's Σ g_z·a per row."""
    ACT: gl.constexpr = args[16]
    HAS_PROBS: gl.constexpr = args[17]
    STORE_Z: gl.constexpr = args[18]
    layout: gl.constexpr = g_z.type.layout
    gate = gate_smem.load(layout).to(gl.float32)
    up = up_smem.load(layout).to(gl.float32)
    a, d_gate, d_up = _glu_backward(gate, up, ACT, args[9], args[10], args[11])
    g_a = g_z
    if HAS_PROBS:
        p = gl.convert_layout(p_rows, gl.SliceLayout(1, layout))
        g_a = g_z * p[:, None]
    gate_smem.store((g_a * d_gate).to(gate_smem.dtype))
    up_smem.store((g_a * d_up).to(up_smem.dtype))
    if STORE_Z:
        z = a
        if HAS_PROBS:
            z = a * p[:, None]
        z_smem.store(z.to(z_smem.dtype))
    return gl.sum(g_z * a, axis=1)


@gluon.jit
def _regs_epilogue(g_z, m0, n0, row_end, count, WG: gl.constexpr, args):
    """The epilogue in the accumulator's own layout (REGS: bf16, G a multiple of BN). The tile's h
    columns (its BN gates, then its BN ups) arrive by two TMA loads into this warpgroup's bf16 tiles,
    are read in g_z's layout, and the same tiles take g_h's gate and up halves, which leave by TMA
    stores with z (masked 16-byte stores where the tile crosses its expert's end, as FC1's). No fp32
    staging: g_z never leaves the registers."""
    BM: gl.constexpr = args[12]
    BN: gl.constexpr = args[13]
    G: gl.constexpr = args[15]
    HAS_PROBS: gl.constexpr = args[17]
    STORE_Z: gl.constexpr = args[18]
    STORE_PARTIAL: gl.constexpr = args[19]
    h_desc = args[21]
    gh_desc = args[22]
    z_desc = args[23]
    gate_smem = args[24].index(2 * WG)
    up_smem = args[24].index(2 * WG + 1)
    z_smem = args[25].index(WG)
    bar = args[26].index(WG)
    M = args[6]
    layout: gl.constexpr = g_z.type.layout
    gate0 = _glu_rows(n0, G)  # h's column of the tile's first gate: the tile lies in one G block
    store_wait(0)  # this warpgroup's previous stores have finished reading its tiles
    fence_async_shared()  # and its generic reads of them (the masked stores) precede the TMA writes
    expect_bytes(bar, 2 * BM * BN * 2)
    tma_load(h_desc, [m0, gate0], bar, gate_smem)
    tma_load(h_desc, [m0, gate0 + G], bar, up_smem)
    rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    row_ok = rows < row_end
    p = gl.load(args[4] + rows, mask=row_ok & HAS_PROBS, other=1.0).to(gl.float32)  # unused without probs
    mbarrier.wait(bar, count & 1)
    # Four column quarters at a time keep the promoted mainloop's registers enough: a thread holds
    # columns c, c + 32, c + 64 and c + 96 (register bits of the layout), so the splits move no data.
    Q: gl.constexpr = BN // 4
    g_lo, g_hi = gl.split(g_z.reshape([BM, 2, 2 * Q]).permute((0, 2, 1)))
    q0, q1 = gl.split(g_lo.reshape([BM, 2, Q]).permute((0, 2, 1)))
    q2, q3 = gl.split(g_hi.reshape([BM, 2, Q]).permute((0, 2, 1)))
    part = _regs_part(q0, gate_smem.slice(0, Q, dim=1), up_smem.slice(0, Q, dim=1), z_smem.slice(0, Q, dim=1), p,
                      args)
    part += _regs_part(q1, gate_smem.slice(Q, Q, dim=1), up_smem.slice(Q, Q, dim=1), z_smem.slice(Q, Q, dim=1), p,
                       args)
    part += _regs_part(q2, gate_smem.slice(2 * Q, Q, dim=1), up_smem.slice(2 * Q, Q, dim=1),
                       z_smem.slice(2 * Q, Q, dim=1), p, args)
    part += _regs_part(q3, gate_smem.slice(3 * Q, Q, dim=1), up_smem.slice(3 * Q, Q, dim=1),
                       z_smem.slice(3 * Q, Q, dim=1), p, args)
    if STORE_PARTIAL:
        # Rows past the expert's end hold the next expert's h and are not stored; F is a multiple of BN.
        gl.store(args[5] + (n0 // BN).to(gl.int64) * M + rows, gl.convert_layout(part, rows.type.layout),
                 mask=row_ok)
    _store_h_z(gh_desc, z_desc, args[2], args[3], gate_smem, up_smem, z_smem, m0, n0, gate0, row_end, M, args[7],
               args[8], BM, G, STORE_Z)


@gluon.jit
def _dgrad_epilogue(acc, e, m0, n0, row_end, count, WG: gl.constexpr, args):
    """The engine's epilogue unit (_engine._tile_loop) for FC2_DGRAD: the tile's fp32 g_z to this
    warpgroup's shared tile, then ``_epilogue``. ``args`` = (g_tiles, h_ptr, gh_ptr, z_ptr, probs_ptr,
    part_ptr, M, N, N1, p0, p1, p2, BM, BN, CW, G, ACT, HAS_PROBS, STORE_Z, STORE_PARTIAL, REGS,
    h_desc, gh_desc, z_desc, hg_tiles, z_tiles, h_bars); the constexprs are read by index into
    constexpr names (unpacking would make them runtime values). REGS: ``_regs_epilogue``."""
    BM: gl.constexpr = args[12]
    BN: gl.constexpr = args[13]
    CW: gl.constexpr = args[14]
    G: gl.constexpr = args[15]
    ACT: gl.constexpr = args[16]
    HAS_PROBS: gl.constexpr = args[17]
    STORE_Z: gl.constexpr = args[18]
    STORE_PARTIAL: gl.constexpr = args[19]
    REGS: gl.constexpr = args[20]
    if REGS:
        _regs_epilogue(acc, m0, n0, row_end, count, WG, args)
    else:
        g_smem = args[0].index(WG)
        g_smem.store(acc)
        _epilogue(g_smem, args[1], args[2], args[3], args[4], args[5], m0, n0, row_end, args[6], args[7], args[8],
                  args[9], args[10], args[11], BM, BN, CW, G, ACT, HAS_PROBS, STORE_Z, STORE_PARTIAL)


@gluon.jit
def _dgrad_capacity(m0, n0, WG: gl.constexpr, args):
    BM: gl.constexpr = args[12]
    BN: gl.constexpr = args[13]
    CW: gl.constexpr = args[14]
    G: gl.constexpr = args[15]
    STORE_Z: gl.constexpr = args[18]
    STORE_PARTIAL: gl.constexpr = args[19]
    _zeros(args[2], args[3], args[5], m0, n0, args[6], args[7], args[8], BM, BN, CW, G, STORE_Z, STORE_PARTIAL)


@gluon.jit
def _consumer(a_desc, b_desc, h_desc, gh_desc, z_desc, h_ptr, gh_ptr, z_ptr, probs_ptr, part_ptr, acc_scale_ptr,
              a_scale_ptr, stride_asm, stride_ask, b_scale_ptr, stride_bse, stride_bsn, stride_bsk, splits_ptr, E, M,
              N, K, N1, p0, p1, p2, a_ring, b_ring, g_tiles, hg_tiles, z_tiles, h_bars, ready, empty, turn,
              WG: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
              BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, E_BLOCK: gl.constexpr,
              B_KMAJOR: gl.constexpr, CW: gl.constexpr, G: gl.constexpr, CHAIN: gl.constexpr, ACT: gl.constexpr,
              HAS_PROBS: gl.constexpr, STORE_Z: gl.constexpr, STORE_PARTIAL: gl.constexpr, A_PARTS: gl.constexpr,
              SCALED: gl.constexpr, REGS: gl.constexpr, ACC_SCALE: gl.constexpr):
    # g_z times the accumulator factor (ACC_SCALE) in _tile_loop, before either epilogue form reads it.
    _tile_loop(_dgrad_epilogue, _dgrad_capacity,
               (g_tiles, h_ptr, gh_ptr, z_ptr, probs_ptr, part_ptr, M, N, N1, p0, p1, p2, BM, BN, CW, G, ACT,
                HAS_PROBS, STORE_Z, STORE_PARTIAL, REGS, h_desc, gh_desc, z_desc, hg_tiles, z_tiles, h_bars),
               a_ring, b_ring, ready, empty, turn, splits_ptr, E, M, N, K, WG, BM, BN, BK, STAGES, GROUP_M, E_BLOCK,
               B_KMAJOR, CHAIN, A_PARTS, SCALED,
               (a_scale_ptr, stride_asm, stride_ask, b_scale_ptr, stride_bse, stride_bsn, stride_bsk),
               1, 1, ACC_SCALE, acc_scale_ptr)  # fmt: skip


@gluon.jit
def _handoff_consumer(splits_ptr, acc_scale_ptr, E, M, N, K, a_ring, b_ring, g_tiles, g_full, g_empty, ready, empty,
                      WG: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                      E_BLOCK: gl.constexpr, B_KMAJOR: gl.constexpr, CHAIN: gl.constexpr, ACC_SCALE: gl.constexpr):
    """EPI_WG: consumer warpgroup WG of the cooperative tiles. It runs only mainloops: each real
    tile's fp32 g_z (its 64 rows; ACC_SCALE: times the factor, as _tile_loop scales it) goes to its
    shared tile once the epilogue warpgroup has read the previous one (``g_empty``), and ``g_full``
    (both consumers) hands it over. It needs no tile's coordinates, only how many real tiles this CTA
    takes: they come first in its tile order."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    n_tiles = gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    real_tiles = _expert_table(splits_ptr, E, M, n_tiles, 2 * BM, E_BLOCK, 4)[4]
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    g_smem = g_tiles.index(WG)
    if ACC_SCALE:
        factor = gl.load(acc_scale_ptr)
    for j in range(gl.cdiv(gl.maximum(real_tiles - pid, 0), nprog)):
        acc, it = _mainloop_promoted_single(a_ring, b_ring, ready, empty, j * k_steps, k_steps, acc_layout, BM,
                                            BN, STAGES, B_KMAJOR, CHAIN, 2, WG)
        if ACC_SCALE:
            acc = acc * factor
        mbarrier.wait(g_empty, (j & 1) ^ 1)  # a fresh mbarrier passes parity 1: the first tile waits for nothing
        g_smem.store(acc)
        mbarrier.arrive(g_full)  # (an arrive is one thread's, after the warpgroup's barrier)


@gluon.jit
def _epilogue_partition(h_ptr, gh_ptr, z_ptr, probs_ptr, part_ptr, splits_ptr, E, M, N, N1, p0, p1, p2, g_tiles,
                        g_full, g_empty, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr,
                        E_BLOCK: gl.constexpr, CW: gl.constexpr, G: gl.constexpr, ACT: gl.constexpr,
                        HAS_PROBS: gl.constexpr, STORE_Z: gl.constexpr, STORE_PARTIAL: gl.constexpr):
    """EPI_WG: the epilogue warpgroup, which issues no MMA. It walks the CTA's tiles as the consumers
    do; for a real tile it waits for both halves of g_z (``g_full``), runs the staged ``_epilogue`` on
    each, and hands the tiles back (``g_empty``), so a tile's epilogue runs while the consumers'
    wgmma work on the next tile. Capacity tiles get their zeros here, with no mainloop."""
    TILE_M: gl.constexpr = 2 * BM
    n_tiles = gl.cdiv(N, BN)
    idx, starts, ends, tile_ends, real_tiles, routed = _expert_table(splits_ptr, E, M, n_tiles, TILE_M, E_BLOCK, 4)
    cap_tiles = gl.cdiv(M - routed, TILE_M) * n_tiles
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    for j in range(gl.cdiv(gl.maximum(real_tiles + cap_tiles - pid, 0), nprog)):
        t = pid + j * nprog
        if t < real_tiles:
            e, m0, n0, row_end = _tile_coords(t, idx, starts, ends, tile_ends, n_tiles, TILE_M, BN, GROUP_M)
            mbarrier.wait(g_full, j & 1)
            for half in gl.static_range(2):
                _epilogue(g_tiles.index(half), h_ptr, gh_ptr, z_ptr, probs_ptr, part_ptr, m0 + half * BM, n0,
                          row_end, M, N, N1, p0, p1, p2, BM, BN, CW, G, ACT, HAS_PROBS, STORE_Z, STORE_PARTIAL)
            mbarrier.arrive(g_empty)
        else:
            cap = t - real_tiles
            m0 = routed + (cap // n_tiles) * TILE_M
            for half in gl.static_range(2):
                _zeros(gh_ptr, z_ptr, part_ptr, m0 + half * BM, (cap % n_tiles) * BN, M, N, N1, BM, BN, CW, G,
                       STORE_Z, STORE_PARTIAL)


@gluon.jit
def fc2_dgrad_kernel(
    a_desc,  # dy (M, H) bf16, or its e4m3 codes (SCALED), rows grouped by expert; block [BM, BK]
    # W2: B_KMAJOR (E·F, H) (a transposed-layout weight, or W2's K-major codes), block [BN, BK];
    # else (E·H, F), block [BK, BN]
    b_desc,
    h_desc,  # REGS: h (M, N1) bf16, block [BM, BN]; else unused
    gh_desc,  # REGS: g_h (M, N1) bf16, block [BM, BN]; else unused
    z_desc,  # REGS: z (M, F) bf16, block [BM, BN] (STORE_Z); else unused
    h_ptr,  # (M, N1) bf16, the forward's stored h
    gh_ptr,  # (M, N1) bf16 or fp32 (under a recipe), written
    z_ptr,  # (M, F) bf16 or fp32, written (STORE_Z)
    probs_ptr,  # (M,) fp32 / bf16 / fp16 (HAS_PROBS)
    part_ptr,  # (cdiv(F, BN), M) fp32 dprobs partials, written (STORE_PARTIAL)
    acc_scale_ptr,  # ACC_SCALE: 0-d fp32 factor of the accumulator (nvfp4's 1/S_enc product); else None
    # SCALED: (M, ⌈H/128⌉) fp32 1×128 scales of dy's codes, row m's of K block kb at m·stride_asm + kb·stride_ask
    a_scale_ptr,
    stride_asm,
    stride_ask,
    # SCALED: W2's 128×128 tile scales, tile (f//128, h//128) of e at e·stride_bse + ·stride_bsn + ·stride_bsk
    b_scale_ptr,
    stride_bse,
    stride_bsn,
    stride_bsk,
    splits_ptr,  # (E,) int32 / int64
    E,
    M,
    N,  # F
    K,  # H
    N1,  # 2F
    p0,
    p1,
    p2,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    E_BLOCK: gl.constexpr,
    B_KMAJOR: gl.constexpr,
    CW: gl.constexpr,  # epilogue column chunk
    G: gl.constexpr,  # GLU interleave: gate / up blocks of G columns
    CHAIN: gl.constexpr,  # K steps per promoted product
    ACT: gl.constexpr,
    HAS_PROBS: gl.constexpr,
    STORE_Z: gl.constexpr,
    STORE_PARTIAL: gl.constexpr,
    A_PARTS: gl.constexpr,  # 1: ping-pong BM-row tiles; 2: cooperative 2·BM-row tiles (_engine._tile_loop)
    SCALED: gl.constexpr,  # fp8_block: e4m3 operands, each 128-deep product scaled into g_z (_mainloop_scaled)
    REGS: gl.constexpr,  # the epilogue in the accumulator's layout (_regs_epilogue): bf16, G a multiple of BN
    # an epilogue-only warpgroup beside the two consumers of cooperative tiles (bf16, staged epilogue):
    # launched with 16 warps and EPI_MAXNREG (_handoff_consumer, _epilogue_partition)
    EPI_WG: gl.constexpr,
    ACC_SCALE: gl.constexpr,  # bf16: g_z = the accumulator times *acc_scale_ptr, before every epilogue form reads it
):
    gl.static_assert(not (REGS and SCALED), "the register epilogue is bf16's")
    gl.static_assert(not (ACC_SCALE and SCALED), "an accumulator factor on bf16 values only")
    a_ring, b_ring, ready, empty, turn = _ring(a_desc, b_desc, BM, BN, BK, STAGES, B_KMAJOR, A_PARTS)
    if EPI_WG:
        gl.static_assert(A_PARTS == 2 and not SCALED and not REGS, "the epilogue warpgroup: cooperative bf16, staged")
        g_layout_e: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.float32)
        g_tiles_e = gl.allocate_shared_memory(gl.float32, [2, BM, BN], g_layout_e)
        g_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        g_full = g_bars.index(0)
        g_empty = g_bars.index(1)
        mbarrier.init(g_full, count=2)  # both consumers' halves
        mbarrier.init(g_empty, count=1)
        warp_specialize([
            (_handoff_consumer, (splits_ptr, acc_scale_ptr, E, M, N, K, a_ring, b_ring, g_tiles_e, g_full, g_empty,
                                 ready, empty, 0, BM, BN, BK, STAGES, E_BLOCK, B_KMAJOR, CHAIN, ACC_SCALE)),
            (_handoff_consumer, (splits_ptr, acc_scale_ptr, E, M, N, K, a_ring, b_ring, g_tiles_e, g_full, g_empty,
                                 ready, empty, 1, BM, BN, BK, STAGES, E_BLOCK, B_KMAJOR, CHAIN, ACC_SCALE)),
            (_epilogue_partition, (h_ptr, gh_ptr, z_ptr, probs_ptr, part_ptr, splits_ptr, E, M, N, N1, p0, p1, p2,
                                   g_tiles_e, g_full, g_empty, BM, BN, GROUP_M, E_BLOCK, CW, G, ACT, HAS_PROBS,
                                   STORE_Z, STORE_PARTIAL)),
            (_producer, (a_desc, b_desc, splits_ptr, E, M, N, K, a_ring, b_ring, ready, empty, BM, BN, BK, STAGES,
                         GROUP_M, E_BLOCK, B_KMAJOR, A_PARTS, 1, 1, N)),
        ], [4, 4, 1], [EPI_CONSUMER_REGS, EPI_REGS, PRODUCER_REGS])
    else:
        if REGS:
            gl.static_assert(G % BN == 0, "a tile's gates in one G block")
            # Each consumer's h gate and up tiles (2·WG, 2·WG + 1; g_h's after), and its z tile (WG).
            hg_tiles = gl.allocate_shared_memory(h_desc.dtype, [4, BM, BN], h_desc.layout)
            z_tiles = gl.allocate_shared_memory(z_desc.dtype, [2, BM, BN], z_desc.layout)
            g_tiles = z_tiles  # unused
            h_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for w in gl.static_range(2):
                mbarrier.init(h_bars.index(w), count=1)
        else:
            g_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.float32)
            g_tiles = gl.allocate_shared_memory(gl.float32, [2, BM, BN], g_layout)
            hg_tiles = g_tiles  # unused, as are the two below
            z_tiles = g_tiles
            h_bars = g_tiles

        # The argument tuples are written out in the call: a tuple bound to a name first would turn
        # its constexprs into runtime values.
        warp_specialize([
            (_consumer, (a_desc, b_desc, h_desc, gh_desc, z_desc, h_ptr, gh_ptr, z_ptr, probs_ptr, part_ptr,
                         acc_scale_ptr, a_scale_ptr, stride_asm, stride_ask, b_scale_ptr, stride_bse, stride_bsn,
                         stride_bsk, splits_ptr, E, M, N, K, N1, p0, p1, p2, a_ring, b_ring, g_tiles, hg_tiles,
                         z_tiles, h_bars, ready, empty, turn, 0, BM, BN, BK, STAGES, GROUP_M, E_BLOCK, B_KMAJOR, CW,
                         G, CHAIN, ACT, HAS_PROBS, STORE_Z, STORE_PARTIAL, A_PARTS, SCALED, REGS, ACC_SCALE)),
            (_consumer, (a_desc, b_desc, h_desc, gh_desc, z_desc, h_ptr, gh_ptr, z_ptr, probs_ptr, part_ptr,
                         acc_scale_ptr, a_scale_ptr, stride_asm, stride_ask, b_scale_ptr, stride_bse, stride_bsn,
                         stride_bsk, splits_ptr, E, M, N, K, N1, p0, p1, p2, a_ring, b_ring, g_tiles, hg_tiles,
                         z_tiles, h_bars, ready, empty, turn, 1, BM, BN, BK, STAGES, GROUP_M, E_BLOCK, B_KMAJOR, CW,
                         G, CHAIN, ACT, HAS_PROBS, STORE_Z, STORE_PARTIAL, A_PARTS, SCALED, REGS, ACC_SCALE)),
            (_producer, (a_desc, b_desc, splits_ptr, E, M, N, K, a_ring, b_ring, ready, empty, BM, BN, BK, STAGES,
                         GROUP_M, E_BLOCK, B_KMAJOR, A_PARTS, 1, 1, N)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
