"""The quantizer kernels: ``_quantize_kernel`` (1-D blocks rowwise or columnwise),
``_weight_tiles_kernel`` (fp8_block's 128×128 weight tiles), ``_amax_kernel`` (nvfp4's per-tensor
amax), ``_row_blocks_kernel`` (the wgrad operands' expert-aligned row-block table) and
``_wgrad_kernel`` (a weight-gradient operand in those row blocks, nvfp4's Hadamard rotation and
stochastic rounding). With DEQUANT each writes code·block_scale in the input's layout instead of
codes and scales. Launched by api.py; the arithmetic is formats.py's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .formats import (
    abs_or_zero,
    block_scale_values,
    e2m1_code,
    e2m1_code_stochastic,
    e2m1_value,
    e2m1_value_rn,
    e4m3_code,
    e4m3_signed_value,
    e4m3_value,
    e8m0_dequant_multiplier,
    e8m0_exponent,
    e8m0_quant_multiplier,
    fp8_block_columns,
    fp8_block_scale,
    hash_uniform,
    nvfp4_block_scale,
    nvfp4_tensor_scale,
    rcp_rn,
)


@triton.jit
def _per_block_max(v, BM: tl.constexpr, NB: tl.constexpr, B: tl.constexpr):
    """(BM, NB·B) → (BM, NB): the max of each row's NB consecutive blocks of B."""
    return tl.max(tl.reshape(v, (BM, NB, B)), axis=2)


@triton.jit
def _per_block_spread(v, BM: tl.constexpr, NB: tl.constexpr, B: tl.constexpr):
    """(BM, NB) → (BM, NB·B): each block's value over its B elements."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], (BM, NB, B)), (BM, NB * B))


@triton.jit
def _nvfp4_row_blocks(x, s_enc, BM: tl.constexpr, NB: tl.constexpr, B: tl.constexpr):
    """(BM, NB·B) fp32 → nvfp4's 1×B row blocks at S_enc ``s_enc``: (the (BM, NB) e4m3 scale codes,
    0x7F (the NaN mark) for a block holding a NaN; x divided by its block's scale, for e2m1)."""
    block_amax = _per_block_max(abs_or_zero(x), BM, NB, B)
    has_nan = _per_block_max((x != x).to(tl.int32), BM, NB, B)
    s_code, inv = nvfp4_block_scale(block_amax, s_enc)  # (BM, NB)
    y = x * _per_block_spread(inv, BM, NB, B)
    return tl.where(has_nan > 0, 0x7F, s_code), y


@triton.jit
def _nvfp4_row_values(x, s_enc, BM: tl.constexpr, NB: tl.constexpr, B: tl.constexpr):
    """(BM, NB·B) fp32 → nvfp4's values code·s along each row's 1×B blocks, S_enc ``s_enc``, as
    ``dequantized`` writes them: code·s is exact (≤ 6 significant bits, 2^-10 … 2688), and a block
    holding a NaN, whose scale code is the NaN mark, comes out NaN."""
    s_code, y = _nvfp4_row_blocks(x, s_enc, BM, NB, B)
    s = block_scale_values(s_code, 2)  # RECIPE 2: nvfp4
    return e2m1_value_rn(y) * _per_block_spread(s, BM, NB, B)


@triton.jit
def _spread(v, AXIS: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr, BK: tl.constexpr):
    """A per-block value over the tile: rowwise tiles hold NB blocks per row, (BM, NB) → (BM, BK);
    columnwise (1, BK) values broadcast as they are."""
    if AXIS == 1:
        return _per_block_spread(v, BM, NB, BK // NB)
    else:
        return v


@triton.jit
def _quantize_kernel(
    x_ptr,  # (BATCH, M, K) bf16 / fp16 / fp32, contiguous
    codes_ptr,  # uint8: (BATCH, M, K); nvfp4 packed along the block axis: (BATCH, M, ⌈K/2⌉) or (BATCH, ⌈M/2⌉, K)
    #             DEQUANT: the values code·block_scale, (BATCH, M, K) in the output dtype
    scales_ptr,  # (BATCH, M, ⌈K/B⌉) rowwise, (BATCH, ⌈M/B⌉, K) columnwise
    #              DEQUANT: nvfp4: fp32 scalar, 1/S_enc (written by program (0, 0, 0)); others unused
    amax_ptr,  # nvfp4: fp32 scalar, the NaN-ignoring amax of the whole tensor
    M,
    K,
    codes_t_ptr,  # STORE_T: uint8 (BATCH, K, M), the codes transposed over the last two dims
    RECIPE: tl.constexpr,  # 0 fp8_block, 1 mxfp8, 2 nvfp4
    AXIS: tl.constexpr,  # 1 rowwise (blocks along K), 0 columnwise (along M)
    BM: tl.constexpr,  # tile rows; = the block for AXIS 0 (nvfp4: half of it, even/odd rows apart)
    BK: tl.constexpr,  # tile cols; = NB blocks for AXIS 1
    NB: tl.constexpr,  # AXIS 1: blocks per tile row (a 128-wide tile: 1 fp8_block, 4 mxfp8, 8 nvfp4)
    POW2: tl.constexpr,
    VMAX: tl.constexpr,
    DEQUANT: tl.constexpr,  # write code·block_scale in x's layout instead of codes and scales
    STORE_T: tl.constexpr,  # also store the codes transposed (fp8_block, mxfp8)
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)  # int64 offsets: E·A·B passes 2^31 for large weights
    x_ptr += batch * M * K
    if RECIPE == 2 and AXIS == 0:
        # two interleaved tiles, even and odd rows, so codes pack in pairs along the block axis
        rm = pid_m * (2 * BM) + 2 * tl.arange(0, BM)
        rk = pid_k * BK + tl.arange(0, BK)
        r_step = 1
        k_step = 0
        m0 = (rm < M)[:, None] & (rk < K)[None, :]
        m1 = ((rm + r_step) < M)[:, None] & ((rk + k_step) < K)[None, :]
        off = rm.to(tl.int64)[:, None] * K + rk[None, :]
        x0 = tl.load(x_ptr + off, mask=m0, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + off + r_step * K + k_step, mask=m1, other=0.0).to(tl.float32)
        a = tl.maximum(abs_or_zero(x0), abs_or_zero(x1))
        nan = ((x0 != x0) | (x1 != x1)).to(tl.int32)
        s_enc = nvfp4_tensor_scale(tl.load(amax_ptr))
        block_amax = tl.max(a, axis=0)[None, :]
        has_nan = tl.max(nan, axis=0)[None, :]
        s_code, inv = nvfp4_block_scale(block_amax, s_enc)
        c0 = e2m1_code(x0 * inv)
        c1 = e2m1_code(x1 * inv)
        s_code = tl.where(has_nan > 0, 0x7F, s_code)
        if DEQUANT:
            # code·s is exact (≤ 6 significant bits, 2^-10 … 2688); the NaN mark (s_code 0x7F, set
            # above for a block with a NaN) makes its block NaN
            s = block_scale_values(s_code, RECIPE)
            out_ty = codes_ptr.dtype.element_ty
            v_ptr = codes_ptr + batch * M * K + off
            tl.store(v_ptr, (e2m1_value_rn(x0 * inv) * s).to(out_ty), mask=m0)
            tl.store(v_ptr + r_step * K + k_step, (e2m1_value_rn(x1 * inv) * s).to(out_ty), mask=m1)
            s_dec = tl.div_rn(1.0 + tl.zeros_like(s_enc), s_enc)  # the reference's 1/S_enc
            tl.store(scales_ptr, s_dec, mask=(pid_m == 0) & (pid_k == 0) & (batch == 0))
        else:
            packed = c0 | (c1 << 4)
            c_off = batch * ((M + 1) // 2) * K + (rm // 2).to(tl.int64)[:, None] * K + rk[None, :]
            tl.store(codes_ptr + c_off, packed.to(tl.uint8), mask=(rm < M)[:, None] & (rk < K)[None, :])
            s_off = batch * tl.cdiv(M, 2 * BM) * K + pid_m.to(tl.int64) * K + rk[None, :]
            tl.store(scales_ptr + s_off, s_code.to(tl.uint8), mask=(rk < K)[None, :])
    elif RECIPE == 2:
        # rowwise: NB blocks of 16 side by side in a contiguous (BM, BK) tile; codes pack in pairs
        rm = pid_m * BM + tl.arange(0, BM)
        rk = pid_k * BK + tl.arange(0, BK)
        mask = (rm < M)[:, None] & (rk < K)[None, :]
        off = rm.to(tl.int64)[:, None] * K + rk[None, :]
        x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
        s_enc = nvfp4_tensor_scale(tl.load(amax_ptr))
        if DEQUANT:
            values = _nvfp4_row_values(x, s_enc, BM, NB, BK // NB)
            tl.store(codes_ptr + batch * M * K + off, values.to(codes_ptr.dtype.element_ty), mask=mask)
            s_dec = tl.div_rn(1.0 + tl.zeros_like(s_enc), s_enc)  # the reference's 1/S_enc
            tl.store(scales_ptr, s_dec, mask=(pid_m == 0) & (pid_k == 0) & (batch == 0))
        else:
            s_code, y = _nvfp4_row_blocks(x, s_enc, BM, NB, BK // NB)  # (BM, NB) codes, (BM, BK)
            c = e2m1_code(y)
            c0, c1 = tl.split(tl.reshape(c, (BM, BK // 2, 2)))  # elements 2j and 2j + 1
            kp = (K + 1) // 2
            rj = pid_k * (BK // 2) + tl.arange(0, BK // 2)
            c_off = batch * M * kp + rm.to(tl.int64)[:, None] * kp + rj[None, :]
            tl.store(codes_ptr + c_off, (c0 | (c1 << 4)).to(tl.uint8), mask=(rm < M)[:, None] & (2 * rj < K)[None, :])
            nb = tl.cdiv(K, BK // NB)
            rb = pid_k * NB + tl.arange(0, NB)
            s_off = batch * M * nb + rm.to(tl.int64)[:, None] * nb + rb[None, :]
            tl.store(scales_ptr + s_off, s_code.to(tl.uint8), mask=(rm < M)[:, None] & (rb < nb)[None, :])
    else:
        rm = pid_m * BM + tl.arange(0, BM)
        rk = pid_k * BK + tl.arange(0, BK)
        mask = (rm < M)[:, None] & (rk < K)[None, :]
        off = rm.to(tl.int64)[:, None] * K + rk[None, :]
        x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
        a = abs_or_zero(x)
        if AXIS == 1:
            amax = _per_block_max(a, BM, NB, BK // NB)  # (BM, NB)
        else:
            amax = tl.max(a, axis=0)[None, :]
        if RECIPE == 0:
            scale = fp8_block_scale(amax, POW2, VMAX)
            codes = e4m3_code(x * _spread(scale, AXIS, BM, NB, BK))
            scale_out = rcp_rn(scale)  # the dequantization scale
            dequant = scale_out
        else:
            e = e8m0_exponent(amax)
            codes = e4m3_code(x * _spread(e8m0_quant_multiplier(e), AXIS, BM, NB, BK))
            scale_out = e.to(tl.uint8)
            dequant = e8m0_dequant_multiplier(e)
        if DEQUANT:
            # one fp32 product, as the reference's code · scale (exact for power-of-two scales)
            values = e4m3_signed_value(codes) * _spread(dequant, AXIS, BM, NB, BK)
            tl.store(codes_ptr + batch * M * K + off, values.to(codes_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(codes_ptr + batch * M * K + off, codes.to(tl.uint8), mask=mask)
            if STORE_T:
                off_t = rk.to(tl.int64)[:, None] * M + rm[None, :]
                mask_t = (rk < K)[:, None] & (rm < M)[None, :]
                tl.store(codes_t_ptr + batch * M * K + off_t, tl.trans(codes.to(tl.uint8)), mask=mask_t)
            if AXIS == 1:
                nb = tl.cdiv(K, BK // NB)
                rb = pid_k * NB + tl.arange(0, NB)
                s_off = batch * M * nb + rm.to(tl.int64)[:, None] * nb + rb[None, :]
                tl.store(scales_ptr + s_off, scale_out, mask=(rm < M)[:, None] & (rb < nb)[None, :])
            else:
                s_off = batch * tl.cdiv(M, BM) * K + pid_m.to(tl.int64) * K + rk[None, :]
                tl.store(scales_ptr + s_off, scale_out, mask=(rk < K)[None, :])


@triton.jit
def _weight_tile(
    x, codes_ptr, codes_t_ptr, scales_ptr, b, pm, pk, M, K,
    POW2: tl.constexpr, VMAX: tl.constexpr, DEQUANT: tl.constexpr, STORE_T: tl.constexpr,
):  # fmt: skip
    """Tile (pm, pk) of weight b: x (128, 128) as loaded (zeros past M and K) -> its codes, codes_t
    and the tile's 1/scale, or with DEQUANT the values code·(1/scale)."""
    rm = pm * 128 + tl.arange(0, 128)
    rk = pk * 128 + tl.arange(0, 128)
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    xf = x.to(tl.float32)
    amax = tl.max(tl.max(abs_or_zero(xf), axis=1), axis=0) + tl.zeros((1, 1), tl.float32)
    scale = fp8_block_scale(amax, POW2, VMAX)
    codes = e4m3_code(xf * scale)
    scale_inv = rcp_rn(scale)  # the dequantization scale
    base = b.to(tl.int64) * M * K
    off = rm.to(tl.int64)[:, None] * K + rk[None, :]
    if DEQUANT:
        # one fp32 product, as the reference's code · scale (exact for power-of-two scales)
        values = e4m3_signed_value(codes) * scale_inv
        tl.store(codes_ptr + base + off, values.to(codes_ptr.dtype.element_ty), mask=mask)
    else:
        c8 = codes.to(tl.uint8)
        tl.store(codes_ptr + base + off, c8, mask=mask)
        if STORE_T:
            off_t = rk.to(tl.int64)[:, None] * M + rm[None, :]
            tl.store(codes_t_ptr + base + off_t, tl.trans(c8), mask=(rk < K)[:, None] & (rm < M)[None, :])
        nbk = tl.cdiv(K, 128)
        s_off = (b.to(tl.int64) * tl.cdiv(M, 128) + pm) * nbk + pk + tl.zeros((1, 1), tl.int64)
        tl.store(scales_ptr + s_off, scale_inv)


@triton.jit
def _weight_tiles_kernel(
    x_ptr,  # (BATCH, M, K) bf16 / fp16 / fp32, contiguous
    codes_ptr,  # uint8 (BATCH, M, K); DEQUANT: the values code·(1/scale), (BATCH, M, K) in the output dtype
    codes_t_ptr,  # STORE_T: uint8 (BATCH, K, M), the codes transposed over the last two dims
    scales_ptr,  # fp32 (BATCH, ⌈M/128⌉, ⌈K/128⌉): 1/scale of each tile; unused with DEQUANT
    M,
    K,
    BATCH,
    POW2: tl.constexpr,
    VMAX: tl.constexpr,
    DEQUANT: tl.constexpr,
    STORE_T: tl.constexpr,
):
    """fp8_block's 128×128 tiles over the last two dims, persistent: program p takes tiles p, p + P,
    … (row-major over batch, tile row, tile column) and loads its next tile before it quantizes this
    one, so each program keeps a load in flight while its stores drain, which one tile per program
    cannot (docs/DECISIONS.md)."""
    nbm = tl.cdiv(M, 128)
    nbk = tl.cdiv(K, 128)
    total = nbm * nbk * BATCH
    step = tl.num_programs(0)
    ar = tl.arange(0, 128)
    t = tl.program_id(0)
    b = t // (nbm * nbk)
    pm = (t % (nbm * nbk)) // nbk
    pk = t % nbk
    rm = pm * 128 + ar
    rk = pk * 128 + ar
    x = tl.load(x_ptr + b.to(tl.int64) * M * K + rm.to(tl.int64)[:, None] * K + rk[None, :],
                mask=((rm < M) & (ar * 0 + t < total))[:, None] & (rk < K)[None, :], other=0.0)  # fmt: skip
    while t < total:
        tn = t + step
        bn = tn // (nbm * nbk)
        pmn = (tn % (nbm * nbk)) // nbk
        pkn = tn % nbk
        rmn = pmn * 128 + ar
        rkn = pkn * 128 + ar
        xn = tl.load(x_ptr + bn.to(tl.int64) * M * K + rmn.to(tl.int64)[:, None] * K + rkn[None, :],
                     mask=((rmn < M) & (ar * 0 + tn < total))[:, None] & (rkn < K)[None, :], other=0.0)  # fmt: skip
        _weight_tile(x, codes_ptr, codes_t_ptr, scales_ptr, b, pm, pk, M, K, POW2, VMAX, DEQUANT, STORE_T)
        x = xn
        t = tn
        b = bn
        pm = pmn
        pk = pkn


@triton.jit
def _row_blocks_kernel(
    splits_ptr,  # (E,) int32 / int64 rows per expert
    start_ptr,  # (NB,) int64: first source row of each block (unused blocks: the rows past Σsplits)
    count_ptr,  # (NB,) int32: rows of each block
    rows_ptr,  # (T,) int64: padded row of each source row, -1 past Σsplits
    E,
    T,
    NB,
    B: tl.constexpr,  # rows a block
    EB: tl.constexpr,  # E rounded up to a power of two
    CHUNK: tl.constexpr,  # blocks and source rows a program
):
    """The wgrad operands' expert-aligned row blocks (api.row_blocks), every program computing the
    expert table from splits (clamped: negative -> 0, a running sum past T truncated at T) and then
    CHUNK blocks and CHUNK source rows; an index's expert is the number of experts that end at or
    before it (a sorted search as a (CHUNK, EB) comparison), and its expert's fields are picked by a
    one-hot sum, so nothing is gathered from memory."""
    j = tl.arange(0, EB)
    real = j < E
    s = tl.load(splits_ptr + j, mask=real, other=0).to(tl.int64)
    s = tl.minimum(tl.maximum(s, 0), T)
    cum = tl.cumsum(s, 0)
    ends = tl.minimum(cum, T)
    starts = tl.minimum(cum - s, T)
    n = ends - starts
    blocks = (n + B - 1) // B
    block_ends = tl.cumsum(blocks, 0)
    first_block = block_ends - blocks
    used = tl.sum(blocks, 0)
    routed = tl.sum(n, 0)
    i = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    p = i.to(tl.int64)
    # block p: its expert, its first source row and its count
    e = tl.sum(((block_ends[None, :] <= p[:, None]) & real[None, :]).to(tl.int32), axis=1)
    pick = j[None, :] == e[:, None]
    start = tl.sum(tl.where(pick, (starts - first_block * B)[None, :], 0), axis=1) + p * B
    end = tl.sum(tl.where(pick, ends[None, :], 0), axis=1)
    valid = e < E
    count = tl.where(valid, tl.minimum(tl.maximum(end - start, 0), B), 0)
    start = tl.where(valid, start, routed + (p - used) * B)
    tl.store(start_ptr + i, start, mask=i < NB)
    tl.store(count_ptr + i, count.to(tl.int32), mask=i < NB)
    # source row p: its padded row
    et = tl.sum(((ends[None, :] <= p[:, None]) & real[None, :]).to(tl.int32), axis=1)
    pick_t = j[None, :] == et[:, None]
    row = tl.sum(tl.where(pick_t, (first_block * B - starts)[None, :], 0), axis=1) + p
    tl.store(rows_ptr + i, tl.where(et < E, row, -1), mask=i < T)


@triton.jit
def _amax_kernel(
    x_ptr,  # (N,) any float dtype, contiguous: a (T, K) tensor's elements
    partial_ptr,  # (cdiv(N, BLOCK),) fp32: per-program NaN-ignoring amax; reduced by the launcher
    N,
    routed_ptr,  # ROUTED: (cdiv(N, BLOCK),) fp32, the same over the rows below Σsplits
    splits_ptr,  # ROUTED: (E,) int32 / int64 rows per expert
    E,
    T,
    K,
    BLOCK: tl.constexpr,
    EB: tl.constexpr,  # ROUTED: E rounded up to a power of two
    ROUTED: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    a = abs_or_zero(tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32))
    tl.store(partial_ptr + pid, tl.max(a, axis=0))
    if ROUTED:
        # the rows a weight-gradient operand takes, with splits clamped as _row_blocks_kernel clamps
        # them (negative -> 0, the running sum truncated at T)
        j = tl.arange(0, EB)
        s = tl.load(splits_ptr + j, mask=j < E, other=0).to(tl.int64)
        rows = tl.minimum(tl.sum(tl.minimum(tl.maximum(s, 0), T), 0), T)
        tl.store(routed_ptr + pid, tl.max(tl.where(offs < rows * K, a, 0.0), axis=0))


@triton.jit
def _butterfly(v, H: tl.constexpr, BK: tl.constexpr):
    """One stage of width H of the fast Walsh-Hadamard transform along the 16 rows of v (16, BK):
    rows i and i+H of each group of 2H become (a + b, a - b)."""
    w = tl.permute(tl.reshape(v, (16 // (2 * H), 2, H * BK)), (0, 2, 1))
    a, b = tl.split(w)
    w = tl.permute(tl.join(a + b, a - b), (0, 2, 1))
    return tl.reshape(w, (16, BK))


@triton.jit
def hadamard16_rows(x, BK: tl.constexpr):
    """x (16, BK) fp32 -> Qᵀx, Q = diag(signs)·H16/4: signs, stages of width 1, 2, 4, 8, then ·1/4,
    the order of recipes.nvfp4.hadamard16, so the rounding is the same."""
    i = tl.arange(0, 16)
    sign = tl.where(((55272 >> i) & 1) == 1, -1.0, 1.0)  # negative at TE's wgrad sign positions
    v = x * sign[:, None]
    v = _butterfly(v, 1, BK)
    v = _butterfly(v, 2, BK)
    v = _butterfly(v, 4, BK)
    v = _butterfly(v, 8, BK)
    return v * 0.25


@triton.jit
def _wgrad_kernel(
    x_ptr,  # (T, K) bf16 / fp16 / fp32 operand of a weight-gradient GEMM, rows grouped by expert
    row_start_ptr,  # (NB,) int64 first source row of each row block (unused blocks: the rows they zero)
    row_count_ptr,  # (NB,) int32 its rows (0..B; fewer for an expert's last block, 0 for unused blocks)
    codes_ptr,  # uint8 (NB·B, K); nvfp4 packed along rows: (NB·B/2, K)
    #             DEQUANT: the values code·block_scale in the source layout (T, K), output dtype
    scales_ptr,  # (NB, K): fp32 1/scale, uint8 e8m0, uint8 e4m3; DEQUANT: nvfp4 fp32 scalar 1/S_enc
    amax_ptr,  # nvfp4: fp32 scalar (AMAX_ONLY: (NB, nK) partials written instead)
    T,
    K,
    codes_t_ptr,  # STORE_T: uint8 (K, NB·B), the padded codes transposed
    rows_ptr,  # ROWS: (T, K) the same rows dequantized along K instead, in 1×B blocks, output dtype
    rows_amax_ptr,  # nvfp4 ROWS: fp32 scalar, the rows' tensor amax (the routed rows', as amax_ptr's)
    rows_factor_ptr,  # nvfp4 ROWS DEQUANT: fp32 scalar, the rows' 1/S_enc (written by program (0, 0))
    RECIPE: tl.constexpr,
    B: tl.constexpr,  # rows per block: 128, 32, 16
    BK: tl.constexpr,
    POW2: tl.constexpr,
    VMAX: tl.constexpr,
    HADAMARD: tl.constexpr,  # nvfp4: rotate complete 16-row blocks
    STOCHASTIC: tl.constexpr,  # nvfp4: stochastic rounding (gradient operand)
    AMAX_ONLY: tl.constexpr,  # nvfp4 first pass: the amax of the (rotated) operand
    DEQUANT: tl.constexpr,  # write code·block_scale back to the source rows instead of codes and scales
    STORE_T: tl.constexpr,  # store the codes transposed (fp8_block, mxfp8)
    STORE_ROWS: tl.constexpr,  # store the codes in rows (P, K); off with STORE_T: the wgrad GEMM reads only codes_t
    ROWS: tl.constexpr,  # mxfp8, nvfp4 DEQUANT: also write the rows' values quantized along K (``rows_ptr``)
):
    pid_b = tl.program_id(0)
    pid_k = tl.program_id(1)
    start = tl.load(row_start_ptr + pid_b)
    count = tl.load(row_count_ptr + pid_b)
    r = tl.arange(0, B)
    rk = pid_k * BK + tl.arange(0, BK)
    mask = (r < count)[:, None] & (rk < K)[None, :]
    src = (start + r)[:, None] * K + rk[None, :]  # int64: T·K passes 2^31 for long batches
    # DEQUANT: a used block writes its rows; an unused one (count 0, x all zero, values +0) zeroes
    # rows [start, start + B) past Σsplits, so every row of the output is written exactly once
    out_mask = tl.where(count > 0, r < count, start + r < T)[:, None] & (rk < K)[None, :]
    if ROWS:
        # every row this program writes, those past Σsplits too: their 1×B blocks along K are the
        # rowwise pass's (``dequantized``), while the row blocks see zeros there.
        x_rows = tl.load(x_ptr + src, mask=out_mask, other=0.0).to(tl.float32)
        x = tl.where(mask, x_rows, 0.0)
        if RECIPE == 1:
            e_r = e8m0_exponent(_per_block_max(abs_or_zero(x_rows), B, BK // B, B))  # (B, BK // B)
            codes_r = e4m3_code(x_rows * _per_block_spread(e8m0_quant_multiplier(e_r), B, BK // B, B))
            values_r = e4m3_signed_value(codes_r) * _per_block_spread(e8m0_dequant_multiplier(e_r), B, BK // B, B)
            tl.store(rows_ptr + src, values_r.to(rows_ptr.dtype.element_ty), mask=out_mask)
        else:
            # nvfp4's rowwise values as ``_quantize_kernel`` forms them, with the S_enc of rows_amax
            s_enc_r = nvfp4_tensor_scale(tl.load(rows_amax_ptr))
            values_r = _nvfp4_row_values(x_rows, s_enc_r, B, BK // B, B)
            tl.store(rows_ptr + src, values_r.to(rows_ptr.dtype.element_ty), mask=out_mask)
            s_dec_r = tl.div_rn(1.0 + tl.zeros_like(s_enc_r), s_enc_r)  # the reference's 1/S_enc
            tl.store(rows_factor_ptr, s_dec_r, mask=(pid_b == 0) & (pid_k == 0))
    else:
        x = tl.load(x_ptr + src, mask=mask, other=0.0).to(tl.float32)
    if HADAMARD:
        x = tl.where(count == 16, hadamard16_rows(x, BK), x)
    if AMAX_ONLY:
        tl.store(amax_ptr + pid_b * tl.num_programs(1) + pid_k, tl.max(tl.max(abs_or_zero(x), axis=1), axis=0))
    elif RECIPE == 2:
        s_enc = nvfp4_tensor_scale(tl.load(amax_ptr))
        block_amax = tl.max(abs_or_zero(x), axis=0)[None, :]
        has_nan = tl.max((x != x).to(tl.int32), axis=0)[None, :]
        s_code, inv = nvfp4_block_scale(block_amax, s_enc)
        if STOCHASTIC:
            u = hash_uniform(src, x.to(tl.int32, bitcast=True))
            codes = e2m1_code_stochastic(x * inv, u)
        else:
            codes = e2m1_code(x * inv)
        s_code = tl.where(has_nan > 0, 0x7F, s_code)
        if DEQUANT:
            s = tl.where(has_nan > 0, float("nan"), e4m3_value(s_code))
            v = e2m1_value(codes) if STOCHASTIC else e2m1_value_rn(x * inv)  # the same value, no code
            tl.store(codes_ptr + src, (v * s).to(codes_ptr.dtype.element_ty), mask=out_mask)
            s_dec = tl.div_rn(1.0 + tl.zeros_like(s_enc), s_enc)  # the reference's 1/S_enc
            tl.store(scales_ptr, s_dec, mask=(pid_b == 0) & (pid_k == 0))
        else:
            c0, c1 = tl.split(tl.permute(tl.reshape(codes, (B // 2, 2, BK)), (0, 2, 1)))  # even, odd rows
            rp = pid_b.to(tl.int64) * (B // 2) + tl.arange(0, B // 2)
            tl.store(codes_ptr + rp[:, None] * K + rk[None, :], (c0 | (c1 << 4)).to(tl.uint8), mask=(rk < K)[None, :])
            tl.store(scales_ptr + pid_b.to(tl.int64) * K + rk[None, :], s_code.to(tl.uint8), mask=(rk < K)[None, :])
    else:
        if RECIPE == 0:
            codes, dequant = fp8_block_columns(x, POW2, VMAX)
            scale_out = dequant[None, :]
            dequant = scale_out
        else:
            e = e8m0_exponent(tl.max(abs_or_zero(x), axis=0)[None, :])
            codes = e4m3_code(x * e8m0_quant_multiplier(e))
            scale_out = e.to(tl.uint8)
            dequant = e8m0_dequant_multiplier(e)
        if DEQUANT:
            values = e4m3_signed_value(codes) * dequant
            tl.store(codes_ptr + src, values.to(codes_ptr.dtype.element_ty), mask=out_mask)
        else:
            rp = pid_b.to(tl.int64) * B + r
            if STORE_ROWS:
                tl.store(codes_ptr + rp[:, None] * K + rk[None, :], codes.to(tl.uint8), mask=(rk < K)[None, :])
            if STORE_T:
                P = tl.num_programs(0).to(tl.int64) * B
                tl.store(codes_t_ptr + rk.to(tl.int64)[:, None] * P + rp[None, :], tl.trans(codes.to(tl.uint8)),
                         mask=(rk < K)[:, None])
            tl.store(scales_ptr + pid_b.to(tl.int64) * K + rk[None, :], scale_out, mask=(rk < K)[None, :])
