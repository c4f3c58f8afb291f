"""A persistent, warp-specialized grouped GEMM for sm_90 in Gluon: C[R_e] = A[R_e] @ B[e]ᵀ.

One CTA per SM, 3 partitions (12 warps: 4 + 4 + 1, padded to warpgroups):

* producer (1 warp, 40 registers): walks this CTA's tiles and issues TMA loads of A[m0:m0+BM, k0:k0+BK]
  and B[e][n0:n0+BN, k0:k0+BK] into a STAGES-deep shared-memory ring; ``ready[s]`` (TMA byte count)
  and ``empty[s]`` (released by the consumer) mbarriers per stage.
* two consumer warpgroups, ping-pong (the default partition is warpgroup 0, the first worker
  warpgroup 1): this CTA's j-th tile belongs to warpgroup j % 2, which runs its whole K loop with
  async wgmma (one group in flight) into a 128×128 fp32 accumulator (128 registers a thread) and
  then its epilogue, while the other warpgroup's mainloop keeps the tensor cores busy. Ping-pong
  rather than cooperative (2 × 64 rows of one 128×256 tile): the MLP epilogues this engine is for
  (SwiGLU · probs, dSwiGLU with dprobs row sums) cost as much as a few k-steps, and only ping-pong
  hides them behind the other warpgroup's MMAs; cooperative would stall both warpgroups on them.
  A ``turn`` mbarrier pair orders the two mainloops (warpgroup w starts tile j only after the other
  finished issuing tile j-1), as CUTLASS's ordered math barrier does: that keeps each consumer at
  most one ring phase ahead of the stages it waits on, so parity waits cannot alias.
* or two consumer warpgroups cooperative (A_PARTS = 2): every tile is 2·BM rows, each stage holds
  two BM-row A blocks beside one B block, and warpgroup w takes the w-th A block of every stage,
  both issuing wgmma at once (each stage's ``empty`` counts both releases). A promoted mainloop
  adds each product to its total while the next product's wgmma run (two in flight); both
  warpgroups issuing at once keeps the tensor cores fed around those adds and the stage waits,
  which ping-pong, one warpgroup issuing at a time, does less well. The plain GEMM with a bf16 C
  takes cooperative 128 × 256 tiles (m64n256 wgmma, 128 accumulator registers a
  consumer, as ping-pong's 128 × 128): each B block then serves 128 rows and each A block 256
  columns, a quarter less operand traffic per MMA than 128 × 128 tiles, at the price of an epilogue
  that nothing overlaps (CUTLASS's cooperative schedule, which torch._grouped_mm runs there).

Tiles: (expert, m-tile, n-tile), m-tiles never straddle experts. The expert table is computed in
every partition from ``splits`` on the device (clamped: negative → 0 rows, a running sum past M
stops at M), never read on the host. Within an expert, m-tiles are visited in groups of GROUP_M with
the n-tiles inside a group (the triton-tutorial swizzle): 132 concurrent tiles then touch ≤ GROUP_M
A row-blocks and ~132 / GROUP_M B column-blocks, so each B[e] column-block is read from HBM
cdiv(m-tiles, GROUP_M) times instead of once per m-tile (mixtral FC1: B[e] is 235 MB, 16 m-tiles).

Stores: a tile whose rows all belong to its expert (or that ends at row M) goes registers → smem →
TMA store. The last m-tile of an expert that ends before M is stored from the same smem tile by a
masked register store (16-byte vectors), because a TMA store clips only at the tensor's edge and
would overwrite the next expert's first rows. Masked store, not per-expert descriptors built on the
device: ``make_tensor_descriptor`` in a kernel needs a global scratch allocator
(``triton.set_allocator``, process-wide state the lead's launchers do not own) plus a tensormap
fence per descriptor, and the boundary tile is at most one of every m-tile column per expert.
Rows past Σsplits (capacity) belong to no expert: "capacity tiles" after the real ones store zeros
there with TMA (they are the tensor's tail, so clipping at M is exactly right). Every row of C is
written by exactly one tile; no atomics, so results are bitwise repeatable.

Loads need no masking: A rows past the expert's end are the next expert's (their products land in
rows that are not stored), rows or columns past the tensor's edge are zero-filled by TMA.
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
    tma_store,
    warp_specialize,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# 12 warps (4 + 4 + 1, padded to whole warpgroups) share 65,536 registers: ≤ 168 each at launch.
# setmaxnreg then moves them: consumers 232 (128 accumulator registers + the epilogue's bf16 copy
# and addresses), producer 40 (a TMA issue loop of scalars). 232 + 232 + 40 = 3 × 168.
MAXNREG = 168
CONSUMER_REGS = gl.constexpr(232)
PRODUCER_REGS = gl.constexpr(40)
NUM_WARPS = 4
# FC2_DGRAD with an epilogue-only warpgroup (_fc2_dgrad.EPI_WG): 16 warps (4 + 4 + 4 + 1, padded)
# at 128 registers each at launch; consumers 152 (a promoted total and one product in flight, 2 × 64),
# the epilogue warpgroup 168 (a 64-column chunk of the staged epilogue: at 136 it spilled inside
# its tile loop), the producer 40: 152 + 152 + 168 + 40 = 4 × 128.
EPI_MAXNREG = 128
EPI_CONSUMER_REGS = gl.constexpr(152)
EPI_REGS = gl.constexpr(168)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _expert_table(splits_ptr, E, M, n_tiles, BM: gl.constexpr, E_BLOCK: gl.constexpr, WARPS: gl.constexpr):
    """Per-expert rows [starts, ends), the inclusive running count of tiles ``tile_ends``, and the
    number of real tiles and of routed rows. Every partition computes it for itself: worker
    partitions take no distributed tensors."""
    # The whole table sits in every warp of the partition (E_BLOCK / 32 entries a lane), so a per-tile
    # lookup reduces within a warp: shuffles, no shared memory.
    layout: gl.constexpr = gl.BlockedLayout([E_BLOCK // 32], [32], [WARPS], [0])
    idx = gl.arange(0, E_BLOCK, layout=layout)
    # int64: 1024 experts × splits up to 2^31 would overflow an int32 running sum before clamping.
    rows = gl.load(splits_ptr + idx, mask=idx < E, other=0).to(gl.int64)
    rows = gl.minimum(gl.maximum(rows, 0), M)
    cum = gl.associative_scan(rows, 0, _add)
    ends = gl.minimum(cum, M).to(gl.int32)
    starts = gl.minimum(cum - rows, M).to(gl.int32)
    m_tiles = (ends - starts + BM - 1) // BM
    tile_ends = gl.associative_scan(m_tiles * n_tiles, 0, _add)
    real_tiles = gl.sum(m_tiles, 0) * n_tiles
    routed = gl.max(ends, 0)
    return idx, starts, ends, tile_ends, real_tiles, routed


@gluon.jit
def _tile_coords(t, idx, starts, ends, tile_ends, n_tiles, BM: gl.constexpr, BN: gl.constexpr,
                 GROUP_M: gl.constexpr):
    """Real tile t → (expert, first row, first column, the expert's end row)."""
    e = gl.sum((tile_ends <= t).to(gl.int32), 0)
    this = idx == e
    tile_start = gl.sum(gl.where(this, tile_ends, 0), 0)
    row_start = gl.sum(gl.where(this, starts, 0), 0)
    row_end = gl.sum(gl.where(this, ends, 0), 0)
    m_tiles = (row_end - row_start + BM - 1) // BM
    tile_start = tile_start - m_tiles * n_tiles
    local = t - tile_start
    per_group = GROUP_M * n_tiles
    first_m = (local // per_group) * GROUP_M
    group_m = gl.minimum(m_tiles - first_m, GROUP_M)
    in_group = local % per_group
    m0 = row_start + (first_m + in_group % group_m) * BM
    n0 = (in_group // group_m) * BN
    return e, m0, n0, row_end


@gluon.jit
def _glu_rows(n0, G: gl.constexpr):
    """FC1 with a GLU: the row of W1 (column of h) that holds the gate of output column n0, where h
    interleaves gate and up in blocks of G columns (gate block, then its up block); the up is G on."""
    return (n0 // G) * (2 * G) + n0 % G


@gluon.jit
def _producer(a_desc, b_desc, splits_ptr, E, M, N, K, a_ring, b_ring, ready, empty,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              GROUP_M: gl.constexpr, E_BLOCK: gl.constexpr, B_KMAJOR: gl.constexpr, A_PARTS: gl.constexpr,
              B_PARTS: gl.constexpr, G: gl.constexpr, N1):
    """BM: a consumer's rows. A_PARTS = 2 (cooperative): a tile is 2·BM rows, its A block loaded as
    two BM-row parts (ring slots 2s and 2s + 1), one for each consumer, both beside one B block.
    B_PARTS = 2 (FC1 with a GLU, B K-major (E·N1, K)): a tile is BN / 2 output columns, its B block
    the BN / 2 gate rows of W1 then their BN / 2 up rows (``_glu_rows``), two loads into the halves
    of the stage; N counts output columns (F), N1 the rows of each W1[e]."""
    TILE_M: gl.constexpr = BM * A_PARTS
    TILE_N: gl.constexpr = BN // B_PARTS
    n_tiles = gl.cdiv(N, TILE_N)
    k_steps = gl.cdiv(K, BK)
    idx, starts, ends, tile_ends, real_tiles, routed = _expert_table(splits_ptr, E, M, n_tiles, TILE_M, E_BLOCK, 1)
    stage_bytes: gl.constexpr = A_PARTS * a_desc.block_type.nbytes + B_PARTS * b_desc.block_type.nbytes
    it = 0
    for t in range(gl.program_id(0), real_tiles, gl.num_programs(0)):
        e, m0, n0, row_end = _tile_coords(t, idx, starts, ends, tile_ends, n_tiles, TILE_M, TILE_N, GROUP_M)
        for kk in range(k_steps):
            s = it % STAGES
            # A fresh mbarrier passes a wait on parity 1, so the first lap finds every stage empty.
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            expect_bytes(ready.index(s), stage_bytes)
            for part in gl.static_range(A_PARTS):
                tma_load(a_desc, [m0 + part * BM, kk * BK], ready.index(s), a_ring.index(s * A_PARTS + part))
            if B_PARTS == 2:
                gl.static_assert(B_KMAJOR, "the GLU's gate and up blocks are rows of a K-major W1")
                gate = e * N1 + _glu_rows(n0, G)
                tma_load(b_desc, [gate, kk * BK], ready.index(s), b_ring.index(s).slice(0, TILE_N))
                tma_load(b_desc, [gate + G, kk * BK], ready.index(s), b_ring.index(s).slice(TILE_N, TILE_N))
            elif B_KMAJOR:  # B (E·N, K): the [BN, BK] block of expert e
                tma_load(b_desc, [e * N + n0, kk * BK], ready.index(s), b_ring.index(s))
            else:  # B (E·K, N): the [BK, BN] block; the launcher asks K % BK == 0 (no straddling)
                tma_load(b_desc, [e * K + kk * BK, n0], ready.index(s), b_ring.index(s))
            it += 1


@gluon.jit
def _b_operand(b_ring, s, B_KMAJOR: gl.constexpr):
    """Stage s of the B ring as wgmma's [BK, BN] operand: a K-major [BN, BK] block transposed in the
    view, or an N-major [BK, BN] block as it is."""
    if B_KMAJOR:
        b = b_ring.index(s).permute((1, 0))
    else:
        b = b_ring.index(s)
    return b


@gluon.jit
def _mainloop(a_ring, b_ring, ready, empty, it, k_steps, acc_layout: gl.constexpr, BM: gl.constexpr,
              BN: gl.constexpr, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr, A_PARTS: gl.constexpr,
              PART: gl.constexpr):
    """The K loop of one tile from ring position ``it``: async wgmma with one group in flight, each
    stage handed back to the producer as soon as the wgmma after it has been issued and the one
    reading it has finished. Returns the fp32 accumulator with every MMA still pending but the
    last waited for by the caller (``warpgroup_mma_wait(0)``) and that last stage still held.
    A operand: ring slot s · A_PARTS + PART (this consumer's rows of a cooperative tile)."""
    acc = gl.zeros([BM, BN], gl.float32, acc_layout)
    for kk in range(k_steps):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        acc = warpgroup_mma(a_ring.index(s * A_PARTS + PART), _b_operand(b_ring, s, B_KMAJOR), acc, is_async=True)
        # One wgmma group in flight: the one before it has read its stage, which goes back.
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=kk > 0)
        it += 1
    return acc, it


@gluon.jit
def _promoted_chain(a_ring, b_ring, ready, empty, it, start, part, prev, total, STAGES: gl.constexpr,
                    B_KMAJOR: gl.constexpr, CHAIN: gl.constexpr, A_PARTS: gl.constexpr, PART: gl.constexpr):
    """Issues one CHAIN-step product into ``part`` (its first wgmma from zero) while ``prev``, the
    product issued before it, finishes: once the first step is issued, the wait for all but one
    group completes ``prev``, whose last stage goes back and which is added to ``total`` while this
    product's MMAs run. Later steps wait for the step before them and hand back its stage. Returns
    (part, still pending; total; ring position). ``start``: the tile's first ring position (the
    tile's first product has no ``prev``: it adds the zeros it was given and releases nothing)."""
    for i in gl.static_range(CHAIN):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        part = warpgroup_mma(a_ring.index(s * A_PARTS + PART), _b_operand(b_ring, s, B_KMAJOR), part,
                             use_acc=i > 0, is_async=True)
        if i == 0:
            part, prev = warpgroup_mma_wait(1, deps=(part, prev))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=it > start)
            total += prev
            # The add before the next wgmma, which overwrites ``prev``'s registers (``_scaled_step``).
            total = warpgroup_mma_wait(1, deps=(total,))
        else:
            part = warpgroup_mma_wait(1, deps=(part,))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
        it += 1
    return part, total, it


@gluon.jit
def _mainloop_promoted(a_ring, b_ring, ready, empty, it, k_steps, acc_layout: gl.constexpr, BM: gl.constexpr,
                       BN: gl.constexpr, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr, CHAIN: gl.constexpr,
                       A_PARTS: gl.constexpr, PART: gl.constexpr):
    """The K loop with each CHAIN·BK-deep product promoted: the first wgmma of every CHAIN steps starts
    from zero (``use_acc`` off), the next CHAIN - 1 chain onto it, and the product is added to the
    fp32 total with a round-to-nearest add. Hopper's tensor cores add into their accumulator with
    truncation, so one K-deep chain errs like K·2^-24 with a bias; promoted, each chain is CHAIN·BK
    deep (docs/DECISIONS.md, "FC2_DGRAD promotes each 64-deep product", "… products 128 deep").
    Two products in flight, in two accumulators taken in turn (``_promoted_chain``): each product is
    added while the next one's MMAs run, so neither this warpgroup's tensor-core work nor, in a
    cooperative tile, the other's (both reach a product's end on the same stage) waits for the add.
    The products are added in K order, one at a time, as with one in flight: the same total bit for
    bit. Registers: the total and two products, 3 × 64 at BM = 64, within the consumers' 232. A
    operand: ring slot s · A_PARTS + PART (this consumer's rows of a cooperative tile). Returns
    (total, ring position) with every stage released (by this consumer: a cooperative stage's
    ``empty`` counts both)."""
    total = gl.zeros([BM, BN], gl.float32, acc_layout)
    even = gl.zeros([BM, BN], gl.float32, acc_layout)
    odd = gl.zeros([BM, BN], gl.float32, acc_layout)
    start = it
    chains = k_steps // CHAIN
    # Pairs of chains unrolled, so that the two accumulators keep their registers: each wait sits in
    # straight-line code after its wgmma (a wait in one arm of a runtime branch with a product still
    # in flight after it made ptxas serialize every wgmma).
    for _ in range(chains // 2):
        even, total, it = _promoted_chain(a_ring, b_ring, ready, empty, it, start, even, odd, total, STAGES,
                                          B_KMAJOR, CHAIN, A_PARTS, PART)
        odd, total, it = _promoted_chain(a_ring, b_ring, ready, empty, it, start, odd, even, total, STAGES,
                                         B_KMAJOR, CHAIN, A_PARTS, PART)
    # An odd chain count: one more into ``even``; either way the branch ends with nothing in flight.
    if chains % 2 == 1:
        even, total, it = _promoted_chain(a_ring, b_ring, ready, empty, it, start, even, odd, total, STAGES,
                                          B_KMAJOR, CHAIN, A_PARTS, PART)
        last = warpgroup_mma_wait(0, deps=(even,))
    else:
        last = warpgroup_mma_wait(0, deps=(odd,))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=it > start)
    total += last
    return _promoted_tail(a_ring, b_ring, ready, empty, it, k_steps, last, total, STAGES, B_KMAJOR, CHAIN, A_PARTS,
                          PART)


@gluon.jit
def _promoted_tail(a_ring, b_ring, ready, empty, it, k_steps, part, total, STAGES: gl.constexpr,
                   B_KMAJOR: gl.constexpr, CHAIN: gl.constexpr, A_PARTS: gl.constexpr, PART: gl.constexpr):
    """The last k_steps % CHAIN steps of a promoted K loop, each its own product added to ``total``
    (what a CHAIN·BK-deep step of a kernel whose K ends mid-step computes: the missing products are
    exact zeros). ``part``: a free accumulator (its registers are overwritten). Returns (total, it)."""
    for _ in range(k_steps % CHAIN):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        pending = warpgroup_mma(a_ring.index(s * A_PARTS + PART), _b_operand(b_ring, s, B_KMAJOR), part,
                                use_acc=False, is_async=True)
        part = warpgroup_mma_wait(0, deps=(pending,))
        mbarrier.arrive(empty.index(s))
        total += part
        it += 1
    return total, it


@gluon.jit
def _mainloop_promoted_single(a_ring, b_ring, ready, empty, it, k_steps, acc_layout: gl.constexpr,
                              BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr,
                              CHAIN: gl.constexpr, A_PARTS: gl.constexpr, PART: gl.constexpr):
    """``_mainloop_promoted`` with one product in flight: each CHAIN-step product is waited for and
    added to the total before the next one is issued. The same products added in the same order, so
    the same total bit for bit, in 2 × 64 registers at BM = 64 instead of 3 × 64: what a consumer
    fits in beside a third, epilogue-only warpgroup (FC2_DGRAD's ``EPI_WG``). On cooperative tiles
    the other consumer's wgmma fill this one's waits (two in flight measured level there)."""
    total = gl.zeros([BM, BN], gl.float32, acc_layout)
    part = gl.zeros([BM, BN], gl.float32, acc_layout)
    # Whole chains, unrolled: each wait sits in straight-line code after its wgmma (a wait in one arm
    # of a runtime branch made ptxas serialize every wgmma).
    for _ in range(k_steps // CHAIN):
        for i in gl.static_range(CHAIN):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            part = warpgroup_mma(a_ring.index(s * A_PARTS + PART), _b_operand(b_ring, s, B_KMAJOR), part,
                                 use_acc=i > 0, is_async=True)
            if i < CHAIN - 1:
                part = warpgroup_mma_wait(1, deps=(part,))
            else:
                part = warpgroup_mma_wait(0, deps=(part,))
            if i > 0:  # the chain's previous step has read its stage
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
            it += 1
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))  # the chain's last stage
        total += part
    return _promoted_tail(a_ring, b_ring, ready, empty, it, k_steps, part, total, STAGES, B_KMAJOR, CHAIN, A_PARTS,
                          PART)


# What ``b_s_ptr`` / ``b_s_off`` of the scaled mainloop address: one B scale a tile (FC2_DGRAD,
# the plain GEMMs), or one a half (FC1: the gate half's tile at b_s_ptr, the up half's b_s_off on).
B_TILE = gl.constexpr(0)
B_HALVES = gl.constexpr(1)


@gluon.jit
def _b_scales(b_s_ptr, kk, stride_bsk, B_SCALES: gl.constexpr, b_s_off, BN: gl.constexpr, acc_layout: gl.constexpr):
    """K block kk's B scales (``B_TILE`` …): a scalar, or FC1's halves, two scalar loads and a select
    by column: each register's column is fixed, so the select folds and the two scalars are all that
    stays live."""
    base = b_s_ptr + kk * stride_bsk
    if B_SCALES == B_HALVES:
        cols = gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
        b_s = gl.where(cols < BN // 2, gl.load(base), gl.load(base + b_s_off))
    else:
        b_s = gl.load(base)
    return b_s


@gluon.jit
def _add_scaled(total, part, a_s, b_s, B_SCALES: gl.constexpr):
    """total + part · (a_s · b_s): the row scales times the tile's B scale, or times each half's."""
    if B_SCALES == B_TILE:
        total += part * gl.expand_dims(a_s * b_s, 1)
    else:
        total += part * (gl.expand_dims(a_s, 1) * gl.expand_dims(b_s, 0))
    return total


@gluon.jit
def _scaled_step(a_ring, b_ring, ready, empty, it, start, kk, part, prev, prev_a, prev_b, total,
                 acc_layout: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, A_PARTS: gl.constexpr,
                 PART: gl.constexpr, a_s_ptrs, row_ok, stride_ask, b_s_ptr, stride_bsk, B_SCALES: gl.constexpr,
                 b_s_off):
    """Issues K step kk's product into ``part`` (from zero) while ``prev``, the step before it,
    finishes: the wait for all but one group completes ``prev``, whose stage goes back and which is
    added to ``total`` scaled by its scales ``prev_a``, ``prev_b`` while this step's MMAs run. This
    step's scales are loaded after that add (their registers and the previous ones are not live at
    once) and used at the next step. Returns (part, still pending; its scales; total; ring position)."""
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    part = warpgroup_mma(a_ring.index(s * A_PARTS + PART), b_ring.index(s).permute((1, 0)), part, use_acc=False,
                         is_async=True)
    part, prev = warpgroup_mma_wait(1, deps=(part, prev))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=it > start)
    total = _add_scaled(total, prev, prev_a, prev_b, B_SCALES)
    # A wait that passes at once (one group is in flight), taking the total: the add is then
    # computed before the next wgmma is issued. Left free, the compiler moved it past that wgmma,
    # which overwrites ``prev``'s registers, and kept ``prev`` in a copy: ptxas then serialized every
    # wgmma (non-wgmma instructions reading an accumulator in flight).
    total = warpgroup_mma_wait(1, deps=(total,))
    a_s = gl.load(a_s_ptrs + kk * stride_ask, mask=row_ok, other=0.0)
    b_s = _b_scales(b_s_ptr, kk, stride_bsk, B_SCALES, b_s_off, BN, acc_layout)
    return part, prev, a_s, b_s, total, it + 1


@gluon.jit
def _mainloop_scaled(a_ring, b_ring, ready, empty, it, k_steps, acc_layout: gl.constexpr, BM: gl.constexpr,
                     BN: gl.constexpr, STAGES: gl.constexpr, A_PARTS: gl.constexpr, PART: gl.constexpr, a_s_ptrs,
                     row_ok, stride_ask, b_s_ptr, stride_bsk, B_SCALES: gl.constexpr, b_s_off):
    """The FP8 blockwise K loop (SPEC §3, fp8_block), BK = 128 = one scale block: each step's product
    is a fresh chain of m64n128k32 e4m3 wgmma, added to the fp32 total scaled by its rows' A scales
    times its B scale, ``total += part · (a_s · b_s)`` as the Triton kernel writes it
    (kernels/gemm/grouped.py, ``_fp8_product``); with B scales by half, each product is
    scaled by a_s · b_s element by element, the same fp32 products as a scalar b_s gives. B is
    K-major (fp8 wgmma reads no transposed operand). ``a_s_ptrs``: this consumer's rows' scale
    pointers at K block 0; ``b_s_ptr``, ``b_s_off``: the B scales at K block 0 as ``B_SCALES`` says
    (``_b_scales``).

    Two products in flight (``_scaled_step``), in two accumulators taken in turn, each added while
    the next one's MMAs run, in K order: the total of one in flight, bit for bit. (The weight
    gradients' scale a column is read from shared memory instead: ``_wgrad._mainloop``.)"""
    total = gl.zeros([BM, BN], gl.float32, acc_layout)
    even = gl.zeros([BM, BN], gl.float32, acc_layout)
    odd = gl.zeros([BM, BN], gl.float32, acc_layout)
    # The scales of the product in flight; the tile's first step adds zeros scaled by zeros.
    a_s = gl.where(row_ok, 0.0, 0.0)
    b_s = _b_scales(b_s_ptr, 0, stride_bsk, B_SCALES, b_s_off, BN, acc_layout) * 0.0
    start = it
    for c in range(k_steps // 2):
        even, odd, a_s, b_s, total, it = _scaled_step(a_ring, b_ring, ready, empty, it, start, 2 * c, even, odd,
                                                      a_s, b_s, total, acc_layout, BN, STAGES, A_PARTS, PART,
                                                      a_s_ptrs, row_ok, stride_ask, b_s_ptr, stride_bsk,
                                                      B_SCALES, b_s_off)
        odd, even, a_s, b_s, total, it = _scaled_step(a_ring, b_ring, ready, empty, it, start, 2 * c + 1, odd,
                                                      even, a_s, b_s, total, acc_layout, BN, STAGES, A_PARTS,
                                                      PART, a_s_ptrs, row_ok, stride_ask, b_s_ptr, stride_bsk,
                                                      B_SCALES, b_s_off)
    # An odd step count: one more into ``even``; either way the branch ends with nothing in flight.
    if k_steps % 2 == 1:
        even, odd, a_s, b_s, total, it = _scaled_step(a_ring, b_ring, ready, empty, it, start, k_steps - 1,
                                                      even, odd, a_s, b_s, total, acc_layout, BN, STAGES,
                                                      A_PARTS, PART, a_s_ptrs, row_ok, stride_ask, b_s_ptr,
                                                      stride_bsk, B_SCALES, b_s_off)
        last = warpgroup_mma_wait(0, deps=(even,))
    else:
        last = warpgroup_mma_wait(0, deps=(odd,))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=it > start)
    total = _add_scaled(total, last, a_s, b_s, B_SCALES)
    return total, it


@gluon.jit
def _store_tile(acc, c_desc, c_ptr, c_smem, m0, n0, row_end, M, N, BM: gl.constexpr, BN: gl.constexpr):
    """The plain epilogue: round once to bf16, stage in shared memory, then a TMA store when every
    row of the tile is the expert's (or the tile ends at row M), else a masked 16-byte-vector store
    of the rows before ``row_end``. The fused MLP epilogues replace this unit."""
    # 16-byte vectors along N for the masked boundary store: 16 lanes cover 128 bf16 columns.
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BN, BN // 8], [4, 1], [1, 0])
    store_wait(0)  # the previous TMA store from c_smem has finished reading it
    c_smem.store(acc.to(c_desc.dtype))
    if (m0 + BM <= row_end) | (row_end == M):
        fence_async_shared()
        tma_store(c_desc, [m0, n0], c_smem)
    else:
        tile = c_smem.load(store_layout)
        rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, store_layout))
        cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, store_layout))
        # int64: M·N reaches 2^31 at 16k rows × 128k columns.
        offs = rows.to(gl.int64)[:, None] * N + cols[None, :]
        mask = (rows < row_end)[:, None] & (cols < N)[None, :]
        gl.store(c_ptr + offs, tile, mask=mask)


@gluon.jit
def _store_zeros(c_desc, c_smem, m0, n0, acc_layout: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """A capacity tile: rows from Σsplits on are the tensor's tail, so TMA's clipping at M is exact."""
    store_wait(0)
    c_smem.store(gl.zeros([BM, BN], c_desc.dtype, acc_layout))
    fence_async_shared()
    tma_store(c_desc, [m0, n0], c_smem)


@gluon.jit
def _tile_loop(epilogue, capacity, args, a_ring, b_ring, ready, empty, turn, splits_ptr, E, M, N, K,
               WG: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
               GROUP_M: gl.constexpr, E_BLOCK: gl.constexpr, B_KMAJOR: gl.constexpr, PROMOTE: gl.constexpr,
               A_PARTS: gl.constexpr, SCALED: gl.constexpr, scale_args, B_PARTS: gl.constexpr, G: gl.constexpr,
               ACC_SCALE: gl.constexpr = False, acc_scale_ptr=None):
    """One consumer warpgroup's tiles, every kernel on the engine. Ping-pong (A_PARTS = 1): this CTA's
    j-th tile is warpgroup j % 2's, BM rows, the mainloops taken in turn. Cooperative (A_PARTS = 2):
    every tile is 2·BM rows, and warpgroup WG takes rows WG·BM on of each, both issuing wgmma at once
    on the same B stages. A real tile runs the mainloop (promoted when
    PROMOTE > 0) and hands its fp32 accumulator to the epilogue unit, ``epilogue(acc, e, m0, n0,
    row_end, count, WG, args)`` with e the tile's expert, m0 this warpgroup's first row and count the
    number of real tiles this warpgroup took before (a barrier's phase); a capacity tile
    (rows from Σsplits on) calls ``capacity(m0, n0, WG, args)``. ``args`` is the unit's own tuple: the
    kernel's outputs, sizes and constexprs. SCALED: the FP8 blockwise mainloop (``_mainloop_scaled``),
    ``scale_args`` = (a_scale_ptr, stride_asm, stride_ask, b_scale_ptr, stride_bse, stride_bsn,
    stride_bsk). B_PARTS = 2: FC1's GLU tiles (``_producer``), BN / 2 output columns each, the
    accumulator's first BN / 2 columns the gates and the rest their ups; n0 counts output columns.
    ACC_SCALE: the fp32 scalar at ``acc_scale_ptr`` multiplies each real tile's accumulator before
    the epilogue sees it, ``acc * f`` in fp32 (nvfp4's per-tensor factors) as the Triton kernels'
    ACC_SCALE does, the same bits (where FC1 adds a bias next, both compile the two into one fma:
    _fc1.py); capacity tiles store zeros either way."""
    TILE_M: gl.constexpr = BM * A_PARTS
    TILE_N: gl.constexpr = BN // B_PARTS
    COOP: gl.constexpr = A_PARTS == 2
    n_tiles = gl.cdiv(N, TILE_N)
    k_steps = gl.cdiv(K, BK)
    idx, starts, ends, tile_ends, real_tiles, routed = _expert_table(splits_ptr, E, M, n_tiles, TILE_M, E_BLOCK, 4)
    cap_tiles = gl.cdiv(M - routed, TILE_M) * n_tiles
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    my_tiles = gl.cdiv(gl.maximum(real_tiles + cap_tiles - pid, 0), nprog)
    if SCALED:
        gl.static_assert(BN == 128, "one B scale a tile: 128 columns, 128-aligned")
        gl.static_assert(BK == 128, "one K step a scale block")
        MMA_K: gl.constexpr = 32
    else:
        MMA_K: gl.constexpr = 16
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, MMA_K])
    if COOP:
        first: gl.constexpr = 0
        step: gl.constexpr = 1
        row0: gl.constexpr = WG * BM
        part: gl.constexpr = WG
    else:
        first: gl.constexpr = WG
        step: gl.constexpr = 2
        row0: gl.constexpr = 0
        part: gl.constexpr = 0
    if ACC_SCALE:
        # One scalar for the whole launch: loaded once, not in every tile's epilogue path.
        factor = gl.load(acc_scale_ptr)
    turns = 0
    for j in range(first, my_tiles, step):
        t = pid + j * nprog
        if t < real_tiles:
            e, m0, n0, row_end = _tile_coords(t, idx, starts, ends, tile_ends, n_tiles, TILE_M, TILE_N, GROUP_M)
            if not COOP:
                # My turn for the mainloop: warpgroup 0 waits on parity 1 first (passes at once).
                mbarrier.wait(turn.index(WG), (turns & 1) ^ (1 - WG))
                turns += 1
            # The ring position: real tiles precede capacity tiles, and each took k_steps stages.
            if SCALED:
                rows = m0 + row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
                a_s_ptrs = scale_args[0] + rows.to(gl.int64) * scale_args[1]
                b_s_ptr = scale_args[3] + e.to(gl.int64) * scale_args[4]
                if B_PARTS == 2:  # each half's 128-row weight tile: the gates', then the ups', G rows on
                    gate = _glu_rows(n0, G)
                    b_s_ptr = b_s_ptr + (gate // 128) * scale_args[5]
                    b_s_off = ((gate + G) // 128 - gate // 128) * scale_args[5]
                    b_scales: gl.constexpr = B_HALVES
                else:
                    b_s_ptr = b_s_ptr + (n0 // BN) * scale_args[5]
                    b_s_off = 0
                    b_scales: gl.constexpr = B_TILE
                acc, it = _mainloop_scaled(a_ring, b_ring, ready, empty, j * k_steps, k_steps, acc_layout, BM, BN,
                                           STAGES, A_PARTS, part, a_s_ptrs, rows < M, scale_args[2], b_s_ptr,
                                           scale_args[6], b_scales, b_s_off)
                if not COOP:
                    mbarrier.arrive(turn.index(1 - WG))
            elif PROMOTE > 0:
                acc, it = _mainloop_promoted(a_ring, b_ring, ready, empty, j * k_steps, k_steps, acc_layout,
                                             BM, BN, STAGES, B_KMAJOR, PROMOTE, A_PARTS, part)
                if not COOP:
                    mbarrier.arrive(turn.index(1 - WG))
            else:
                acc, it = _mainloop(a_ring, b_ring, ready, empty, j * k_steps, k_steps, acc_layout, BM, BN, STAGES,
                                    B_KMAJOR, A_PARTS, part)
                if not COOP:
                    # Every stage of this tile has been waited on: the other warpgroup may start its mainloop.
                    mbarrier.arrive(turn.index(1 - WG))
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
            if ACC_SCALE:
                acc = acc * factor
            epilogue(acc, e, m0 + row0, n0, row_end, (j - first) // step, WG, args)
        else:
            cap = t - real_tiles
            capacity(routed + (cap // n_tiles) * TILE_M + row0, (cap % n_tiles) * TILE_N, WG, args)
    store_wait(0)  # the last TMA stores have left this warpgroup's shared tile


@gluon.jit
def _plain_epilogue(acc, e, m0, n0, row_end, count, WG: gl.constexpr, args):
    """The plain GEMM's unit: the tile rounded to C's dtype and stored. ``args`` = (c_desc, c_ptr,
    c_tiles, M, N, BM, BN); its constexprs are read by index into constexpr names (unpacking a tuple
    would turn them into runtime values)."""
    BM: gl.constexpr = args[5]
    BN: gl.constexpr = args[6]
    _store_tile(acc, args[0], args[1], args[2].index(WG), m0, n0, row_end, args[3], args[4], BM, BN)


@gluon.jit
def _plain_capacity(m0, n0, WG: gl.constexpr, args):
    BM: gl.constexpr = args[5]
    BN: gl.constexpr = args[6]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    _store_zeros(args[0], args[2].index(WG), m0, n0, acc_layout, BM, BN)


@gluon.jit
def _consumer(a_desc, b_desc, c_desc, c_ptr, acc_scale_ptr, splits_ptr, E, M, N, K, a_ring, b_ring, c_tiles, ready,
              empty, turn, WG: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, GROUP_M: gl.constexpr, E_BLOCK: gl.constexpr, B_KMAJOR: gl.constexpr,
              PROMOTE: gl.constexpr, A_PARTS: gl.constexpr, ACC_SCALE: gl.constexpr):
    _tile_loop(_plain_epilogue, _plain_capacity, (c_desc, c_ptr, c_tiles, M, N, BM, BN), a_ring, b_ring, ready,
               empty, turn, splits_ptr, E, M, N, K, WG, BM, BN, BK, STAGES, GROUP_M, E_BLOCK, B_KMAJOR, PROMOTE,
               A_PARTS, False, (0,), 1, 1, ACC_SCALE, acc_scale_ptr)


@gluon.jit
def _ring(a_desc, b_desc, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
          B_KMAJOR: gl.constexpr, A_PARTS: gl.constexpr):
    """The operand ring and its barriers, every kernel on the engine: A and B stages (A_PARTS A
    blocks a stage), ``ready`` (TMA bytes landed) and ``empty`` (stage released: by each of the
    A_PARTS consumers reading it) per stage, and the two consumers' ``turn`` pair."""
    # A's stage blocks are its descriptor's: [BM, BK], or [BK, BM] for an M-major A (the weight
    # gradients' G rows), read by wgmma through a transposed view.
    a_block: gl.constexpr = a_desc.block_type.shape
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES * A_PARTS, a_block[0], a_block[1]], a_desc.layout)
    if B_KMAJOR:
        b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    else:
        b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BK, BN], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=A_PARTS)
    for w in gl.static_range(2):
        mbarrier.init(turn.index(w), count=1)
    return a_ring, b_ring, ready, empty, turn


@gluon.jit
def grouped_gemm_kernel(
    a_desc,  # (M, K) bf16, rows grouped by expert; block [BM, BK]
    b_desc,  # B_KMAJOR: (E·N, K) bf16, B (E, N, K) stacked along rows, block [BN, BK]; else (E·K, N), block [BK, BN]
    c_desc,  # (M, N) bf16 or fp32; block [BM, BN]
    c_ptr,  # (M, N), the same tensor as c_desc, for the masked store of expert-boundary tiles
    acc_scale_ptr,  # ACC_SCALE: 0-d fp32 factor of the accumulator (nvfp4's 1/S_enc product); else None
    splits_ptr,  # (E,) int32 or int64 rows per expert, on the device
    E,
    M,
    N,
    K,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    E_BLOCK: gl.constexpr,
    B_KMAJOR: gl.constexpr,  # B (E, N, K) (True) or (E, K, N) (False)
    PROMOTE: gl.constexpr,  # > 0: each PROMOTE·BK-deep product added to the fp32 total by itself (BM = 64: registers)
    A_PARTS: gl.constexpr,  # 1: ping-pong BM-row tiles; 2: cooperative 2·BM-row tiles (_tile_loop)
    ACC_SCALE: gl.constexpr,  # the accumulator times *acc_scale_ptr before it is rounded and stored
):
    a_ring, b_ring, ready, empty, turn = _ring(a_desc, b_desc, BM, BN, BK, STAGES, B_KMAJOR, A_PARTS)
    c_tiles = gl.allocate_shared_memory(c_desc.dtype, [2, BM, BN], c_desc.layout)

    # The argument tuples are written out in the call: a tuple bound to a name first would turn its
    # constexprs into runtime values. Both consumers run _consumer, warpgroup 0 as the default partition.
    warp_specialize([
        (_consumer, (a_desc, b_desc, c_desc, c_ptr, acc_scale_ptr, splits_ptr, E, M, N, K, a_ring, b_ring, c_tiles,
                     ready, empty, turn, 0, BM, BN, BK, STAGES, GROUP_M, E_BLOCK, B_KMAJOR, PROMOTE, A_PARTS,
                     ACC_SCALE)),
        (_consumer, (a_desc, b_desc, c_desc, c_ptr, acc_scale_ptr, splits_ptr, E, M, N, K, a_ring, b_ring, c_tiles,
                     ready, empty, turn, 1, BM, BN, BK, STAGES, GROUP_M, E_BLOCK, B_KMAJOR, PROMOTE, A_PARTS,
                     ACC_SCALE)),
        (_producer, (a_desc, b_desc, splits_ptr, E, M, N, K, a_ring, b_ring, ready, empty, BM, BN, BK, STAGES,
                     GROUP_M, E_BLOCK, B_KMAJOR, A_PARTS, 1, 1, N)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def _fp8_consumer(a_desc, b_desc, c_desc, c_ptr, a_scale_ptr, stride_asm, stride_ask, b_scale_ptr, stride_bse,
                  stride_bsn, stride_bsk, splits_ptr, E, M, N, K, a_ring, b_ring, c_tiles, ready, empty, turn,
                  WG: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                  GROUP_M: gl.constexpr, E_BLOCK: gl.constexpr):
    _tile_loop(_plain_epilogue, _plain_capacity, (c_desc, c_ptr, c_tiles, M, N, BM, BN), a_ring, b_ring, ready,
               empty, turn, splits_ptr, E, M, N, K, WG, BM, BN, BK, STAGES, GROUP_M, E_BLOCK, True, 1, 2, True,
               (a_scale_ptr, stride_asm, stride_ask, b_scale_ptr, stride_bse, stride_bsn, stride_bsk), 1, 1)


@gluon.jit
def grouped_gemm_fp8_kernel(
    a_desc,  # (M, K) e4m3 codes, rows grouped by expert; block [BM, BK]
    b_desc,  # (E·N, K) e4m3 codes, B (E, N, K) stacked along rows (K-major); block [BN, BK]
    c_desc,  # (M, N) bf16 or fp32; block [BM, BN]
    c_ptr,  # (M, N), the same tensor as c_desc, for the masked store of expert-boundary tiles
    a_scale_ptr,  # (M, ⌈K/128⌉) fp32: row m's scale of K block kb at m·stride_asm + kb·stride_ask
    stride_asm,
    stride_ask,
    b_scale_ptr,  # (E, ⌈N/128⌉, ⌈K/128⌉) fp32: the 128×128 block scales of B
    stride_bse,
    stride_bsn,
    stride_bsk,
    splits_ptr,  # (E,) int32 or int64 rows per expert, on the device
    E,
    M,
    N,
    K,
    BM: gl.constexpr,  # a consumer's rows: tiles are 2·BM rows (cooperative)
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    E_BLOCK: gl.constexpr,
):
    """C[R_e] = dequant(A)[R_e] @ dequant(B[e])ᵀ for fp8_block's codes and scales, on cooperative
    128-row tiles: each consumer's promotion waits on its product, and the other consumer's wgmma
    keep the tensor cores busy meanwhile."""
    a_ring, b_ring, ready, empty, turn = _ring(a_desc, b_desc, BM, BN, BK, STAGES, True, 2)
    c_tiles = gl.allocate_shared_memory(c_desc.dtype, [2, BM, BN], c_desc.layout)
    warp_specialize([
        (_fp8_consumer, (a_desc, b_desc, c_desc, c_ptr, a_scale_ptr, stride_asm, stride_ask, b_scale_ptr, stride_bse,
                         stride_bsn, stride_bsk, splits_ptr, E, M, N, K, a_ring, b_ring, c_tiles, ready, empty, turn,
                         0, BM, BN, BK, STAGES, GROUP_M, E_BLOCK)),
        (_fp8_consumer, (a_desc, b_desc, c_desc, c_ptr, a_scale_ptr, stride_asm, stride_ask, b_scale_ptr, stride_bse,
                         stride_bsn, stride_bsk, splits_ptr, E, M, N, K, a_ring, b_ring, c_tiles, ready, empty, turn,
                         1, BM, BN, BK, STAGES, GROUP_M, E_BLOCK)),
        (_producer, (a_desc, b_desc, splits_ptr, E, M, N, K, a_ring, b_ring, ready, empty, BM, BN, BK, STAGES,
                     GROUP_M, E_BLOCK, True, 2, 1, 1, N)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
