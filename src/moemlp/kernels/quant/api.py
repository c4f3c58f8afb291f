"""Triton quantizers for the recipes of SPEC §3: the same codes and scales as the torch reference
(moemlp.recipes), bit for bit.

The arithmetic is formats.py's, the kernels kernels.py's; this module launches them.

Launchers:
    quantize(x, recipe, axis)     x (…, M, K) contiguous; axis -1: 1×B blocks along K (rowwise),
                                  axis -2: B×1 blocks along M (columnwise)
    quantize_weight(w, recipe)    fp8_block: 128×128 tiles of the last two dims; others: axis -1
    quantize_wgrad(t, splits, recipe, is_grad)
                                  (T, K) operand of a weight-gradient GEMM: blocks along rows that
                                  restart at each expert's first row (nvfp4: Hadamard rotation and
                                  stochastic rounding as the recipe says)
Each returns a moemlp.recipes.QuantizedTensor laid out as the torch quantizer's (wgrad: see there).

The same kernels, with DEQUANT set, quantize and dequantize in one pass for the emulated recipes
(mxfp8, nvfp4, and fp8_block's weight-gradient GEMMs), writing code·block_scale in the input's layout:
    dequantized(x, recipe, axis, out_dtype)               -> (values, factor)   ≙ recipe.qdq(x, axis)
    dequantized_weight(w, recipe, dim, out_dtype)         -> (values, factor)   ≙ recipe.qdq_weight(w, dim)
    dequantized_wgrad(t, splits, recipe, is_grad, out_dtype)
                                                          -> (values, factor)   ≙ an operand of qdq_wgrad
    exact_dtype(recipe, src_dtype)                        the out_dtype that holds the values exactly
``factor`` is nvfp4's 0-d fp32 1/S_enc (None otherwise): ``values.float() * factor`` is the reference
bit for bit. The section above ``exact_dtype`` gives the exactness argument per recipe.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .._launcher import cdiv, launch, next_power_of_2
from ..gemm.launch import _num_programs
from .kernels import _amax_kernel, _quantize_kernel, _row_blocks_kernel, _weight_tiles_kernel, _wgrad_kernel

__all__ = [
    "quantize",
    "quantize_weight",
    "quantize_wgrad",
    "row_blocks",
    "RowBlocks",
    "supports",
    "dequantized",
    "dequantized_weight",
    "dequantized_wgrad",
    "dequantized_both",
    "exact_dtype",
]

_FP8_BLOCK, _MXFP8, _NVFP4 = 0, 1, 2  # the kernels' RECIPE constexpr, a recipe's kernel_id
_ROWWISE, _COLWISE = 1, 0


def supports(recipe) -> bool:
    """Whether the quantizer kernels implement ``recipe`` (it declares a ``kernel_id``)."""
    return getattr(recipe, "kernel_id", None) in (_FP8_BLOCK, _MXFP8, _NVFP4)


def recipe_id(recipe) -> int:
    """The kernels' RECIPE constexpr of a recipe (its ``kernel_id``): 0 fp8_block, 1 mxfp8, 2 nvfp4."""
    if not supports(recipe):
        raise ValueError(f"recipe: expected a moemlp recipe object, got {type(recipe).__name__}")
    return recipe.kernel_id


def _check(x: Tensor, name: str) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: expected bf16, fp16 or fp32, got {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"{name}: expected at least 2 dims, got shape {tuple(x.shape)}")
    # the kernel indexes rows with the shape's own strides; copying a view here would hide a pass
    if not x.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


_AMAX_BLOCK = 4096  # elements a program of _amax_kernel


def _amax_partials(x: Tensor, splits: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """_amax_kernel's per-program fp32 partial amaxes of x (NaN ignored), from one read: (all of x,
    the rows below Σsplits), the second the first's own buffer without ``splits``. Zeros where x is
    empty, so the launchers' torch.amax of them is 0; no host read."""
    n = x.numel()
    partial = torch.zeros(max(cdiv(n, _AMAX_BLOCK), 1), dtype=torch.float32, device=x.device)
    if splits is None:  # the routed slots unread (ROUTED off)
        routed, rows_args, eb = partial, (partial, 0, 0, 0), 1
    else:
        routed = torch.zeros_like(partial)
        rows_args, eb = (splits.contiguous(), splits.numel(), *x.shape), max(16, next_power_of_2(splits.numel()))
    if n:
        launch(_amax_kernel, (cdiv(n, _AMAX_BLOCK),), x.reshape(-1), partial, n, routed, *rows_args,
               BLOCK=_AMAX_BLOCK, EB=eb, ROUTED=splits is not None)  # fmt: skip
    return partial, routed


def tensor_amax(x: Tensor) -> Tensor:
    """fp32 0-d NaN-ignoring amax of all of x (two passes: per-program partials, then torch.amax,
    a fixed-order reduction; no host read)."""
    return _amax_partials(x)[0].amax()


def tensor_amaxes(x: Tensor, splits: Tensor) -> tuple[Tensor, Tensor]:
    """(amax of all of x, amax of its rows below Σsplits), fp32 0-d each, NaN ignored, from one read
    of the (T, K) tensor x. The second is the tensor amax that nvfp4's weight-gradient operand of x
    takes (``dequantized_wgrad(x, splits, ...)``, without the Hadamard option), the same bits: a
    forward can hand it to the backward, whose pass over x then skips its amax read (``amax=``).
    Splits are clamped as ``row_blocks`` clamps them; no host read."""
    _check_wgrad(x, splits)
    partial, routed = _amax_partials(x, splits)
    return partial.amax(), routed.amax()


def routed_amax(x: Tensor, splits: Tensor) -> Tensor:
    """``tensor_amaxes(x, splits)[1]`` alone, the same bits: the tensor amax of x's rows below
    Σsplits, nvfp4's for every operand of the MLP (capacity rows belong to no expert), without the
    reduction of the all-rows partials."""
    _check_wgrad(x, splits)
    return _amax_partials(x, splits)[1].amax()


def _vmax(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _block_axis(x: Tensor, axis: int, name: str = "axis") -> bool:
    """True for blocks along the last dim (rowwise), False for the second to last (columnwise)."""
    if isinstance(axis, bool) or not isinstance(axis, int) or axis not in (-1, -2, x.ndim - 1, x.ndim - 2):
        raise ValueError(f"{name}: the Triton quantizer blocks along dim -1 or -2, got {axis}")
    return axis % x.ndim == x.ndim - 1


# Tiles of _quantize_kernel for 1-D blocks: rowwise (rows, columns, warps), columnwise (columns,
# warps); the columns of a rowwise tile are a multiple of every recipe's block (128: 1 fp8_block,
# 4 mxfp8, 8 nvfp4 blocks side by side): nvfp4's former 32×(8+8) interleaved tiles reached 263 GB/s,
# mxfp8's 32×32 ~1.5 TB/s; benchmarks/bench_quantizer_tiles.py sweeps.
ROW_TILE = (32, 128, 4)
# _wgrad_kernel: rows per block -> (columns per program, warps), the fastest tiles of
# benchmarks/bench_wgrad_quantizer.py, which checks that every tile gives the same bits (the
# measurements: docs/DECISIONS.md, "Quantizer tiles" and "nvfp4's wgrad operand quantizer"):
# fp8_block's 128-row blocks 64 columns at 4 warps: once formats.div_448 / rcp_rn took the slow-path
# division out, it fits in under 100 registers, four CTAs an SM, and each thread keeps twice 32 × 4's
# bytes in flight (the narrow tile had won while the division held every tile above 120 registers);
# mxfp8's 32-row blocks 64 columns at 2 warps;
# nvfp4's 16-row blocks 64 columns at 1 warp: a block's scale (two IEEE divisions, the e4m3 code) is
# computed by every thread that holds one of its rows, 16 of them at 128 × 8 (once an element), 4 at
# 64 × 1, which halves the values pass's instructions. Settable for that bench.
WGRAD_TILE = {128: (64, 4), 32: (64, 2), 16: (64, 1)}
# _quantize_kernel's columnwise tiles, by rows per block -> (columns per program, warps): mxfp8's
# 32-row blocks 128 columns at 4 warps (each thread twice 64 × 4's bytes in flight); nvfp4's two
# interleaved 8-row half-tiles, and fp8_block's 128-row blocks, stay at 64 columns: nvfp4's pass
# was 41 % slower at 128 (benchmarks/bench_quantizer_tiles.py --axes col; docs/DECISIONS.md,
# "mxfp8's columnwise weight passes"). Settable for that bench.
COL_TILE = {128: (64, 4), 32: (128, 4), 16: (64, 4)}


def _block_grid(x: Tensor, rid: int, block: int, rowwise: bool) -> tuple[tuple[int, int, int], int, int, int, int]:
    """(grid, BM, BK, NB, num_warps) of _quantize_kernel for 1-D blocks. Rowwise: ROW_TILE, NB
    blocks side by side. Columnwise: one block of rows per tile, COL_TILE[block]'s columns (nvfp4: two
    interleaved half-tiles, even and odd rows, so codes pack along the block axis)."""
    M, K = x.shape[-2:]
    batch = x.numel() // max(M * K, 1)
    if rowwise:
        bm, bk, warps = ROW_TILE
        nb = max(1, bk // block)
        return (cdiv(M, bm), cdiv(K, nb * block), batch), bm, nb * block, nb, warps
    bk, warps = COL_TILE[block]
    if rid == _NVFP4:
        return (cdiv(M, block), cdiv(K, bk), batch), block // 2, bk, 1, warps
    return (cdiv(M, block), cdiv(K, bk), batch), block, bk, 1, warps


def quantize(x: Tensor, recipe, axis: int = -1):
    """Blocks along the last dim (axis -1) or the second to last (axis -2) of a contiguous x."""
    from ...recipes import QuantizedTensor

    _check(x, "x")
    rowwise = _block_axis(x, axis)
    axis = axis % x.ndim
    rid = recipe_id(recipe)
    block = recipe.block
    M, K = x.shape[-2:]
    lead = tuple(x.shape[:-2])
    nb = cdiv(K if rowwise else M, block)
    scale_dtype = torch.float32 if rid == _FP8_BLOCK else torch.uint8
    scales = torch.empty(lead + ((M, nb) if rowwise else (nb, K)), dtype=scale_dtype, device=x.device)
    amax = x  # a placeholder: only nvfp4's kernels read the tensor amax
    if rid == _NVFP4:
        amax = tensor_amax(x)
        codes = torch.empty(
            lead + ((M, (K + 1) // 2) if rowwise else ((M + 1) // 2, K)), dtype=torch.uint8, device=x.device
        )
    else:
        codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    grid, bm, bk, nblk, warps = _block_grid(x, rid, block, rowwise)
    if x.numel():
        launch(_quantize_kernel, grid,
            x, codes, scales, amax, M, K, codes, STORE_T=False,
            RECIPE=rid, AXIS=_ROWWISE if rowwise else _COLWISE, BM=bm, BK=bk, NB=nblk,
            POW2=bool(getattr(recipe, "pow2_scales", False)), VMAX=_vmax(x.dtype), DEQUANT=False, num_warps=warps,
        )  # fmt: skip
    if rid == _NVFP4:
        return QuantizedTensor.of(
            recipe, codes, scales.view(torch.float8_e4m3fn), x.shape, axis, (block,),
            tensor_scale=nvfp4_scale_from_amax(amax),
        )  # fmt: skip
    if rid == _MXFP8:
        return QuantizedTensor.of(
            recipe, codes.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu), x.shape, axis, (block,)
        )
    return QuantizedTensor.of(recipe, codes.view(torch.float8_e4m3fn), scales, x.shape, axis, (block,))


def nvfp4_scale_from_amax(amax: Tensor) -> Tensor:
    from ...recipes.nvfp4 import tensor_scale_from_amax

    return tensor_scale_from_amax(amax)


# _weight_tiles_kernel: 8 warps, one program per SM, the fastest of the warp counts and programs per
# SM measured on the model weights (docs/DECISIONS.md, "fp8_block's weight tiles on a persistent kernel").
_TILE_WARPS = 8


def _weight_tiles(
    w: Tensor, out: Tensor, codes_t: Tensor | None, scales: Tensor | None, pow2: bool, dequant: bool
) -> None:
    """Launch _weight_tiles_kernel on w (…, M, K): codes (or with ``dequant`` values) into ``out``."""
    M, K = w.shape[-2:]
    if not w.numel():
        return
    batch = w.numel() // (M * K)
    tiles = cdiv(M, 128) * cdiv(K, 128) * batch
    launch(_weight_tiles_kernel, (_num_programs(w.device, tiles),),
        w, out, out if codes_t is None else codes_t, out if scales is None else scales, M, K, batch,
        POW2=pow2, VMAX=_vmax(w.dtype), DEQUANT=dequant, STORE_T=codes_t is not None, num_warps=_TILE_WARPS,
    )  # fmt: skip


def quantize_weight(w: Tensor, recipe, transposed: bool = False):
    """fp8_block: 128×128 tiles over the last two dims; mxfp8, nvfp4: blocks along the last dim.
    ``transposed`` (fp8_block): also the codes transposed over the last two dims (``codes_t``), the
    K-major B of the dgrad GEMM, stored from the tile instead of by a separate transpose (a torch
    copy of mixtral's W1 codes ran at 323 GB/s, 5.8 ms)."""
    from ...recipes import QuantizedTensor

    if recipe_id(recipe) != _FP8_BLOCK:
        if transposed:
            raise ValueError("transposed: only fp8_block's 128x128 tiles serve both orientations")
        return quantize(w, recipe, axis=-1)
    _check(w, "w")
    M, K = w.shape[-2:]
    lead = tuple(w.shape[:-2])
    codes = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    codes_t = torch.empty(lead + (K, M), dtype=torch.uint8, device=w.device) if transposed else None
    scales = torch.empty(lead + (cdiv(M, 128), cdiv(K, 128)), dtype=torch.float32, device=w.device)
    _weight_tiles(w, codes, codes_t, scales, bool(recipe.pow2_scales), dequant=False)
    return QuantizedTensor.of(
        recipe, codes.view(torch.float8_e4m3fn), scales, w.shape, -1, (128, 128),
        codes_t=codes_t.view(torch.float8_e4m3fn) if transposed else None,
    )  # fmt: skip


class RowBlocks(NamedTuple):
    """The expert-aligned row blocks of T-row weight-gradient operands (``row_blocks``): the same
    for every operand of one backward with the same splits, rows and recipe block, so a backward
    computes it once and passes it to each ``quantize_wgrad`` / ``dequantized_wgrad``."""

    start: Tensor  # (NB,) int64 first source row of each block (unused blocks: the rows they zero)
    count: Tensor  # (NB,) int32 rows of each block
    rows: Tensor  # (T,) int64 padded row of each source row, -1 past Σsplits
    nb: int  # NB = ⌈T/B⌉ + E
    block: int  # B


def row_blocks(splits: Tensor, num_rows: int, block: int, device=None) -> RowBlocks:
    """The row-block layout of (num_rows, ·) wgrad operands quantized in ``block``-row blocks with
    ``splits`` (one kernel on the device, no host read)."""
    device = splits.device if device is None else device
    return RowBlocks(*_row_blocks(splits, num_rows, block, device), block)


def _row_blocks(splits: Tensor, num_rows: int, block: int, device) -> tuple[Tensor, Tensor, Tensor, int]:
    """The expert-aligned row blocks of a (T, K) wgrad operand, computed on the device (no host
    read): block p covers padded rows [p·B, p·B + B) and source rows [start, start + count);
    NB = ⌈T/B⌉ + E blocks is the worst case. Splits are clamped to T as the GEMM kernels clamp them.
    Returns (start int64, count int32, rows int64, NB)
    where rows[t] is source row t's padded row, -1 past Σsplits (recipes' ExpertRows layout).

    The U = Σ⌈s_e/B⌉ used blocks come first; unused block p ≥ U has count 0 and start Σsplits + (p − U)·B:
    the rows past Σsplits that the dequantizing pass zeroes. They reach T: U ≤ ⌊Σs/B⌋ + E, so
    (NB − U)·B ≥ (⌈T/B⌉ − ⌊Σs/B⌋)·B ≥ T − Σs."""
    # Splits clamped as the GEMM kernels clamp them (negative → 0 rows, a running sum past T truncated
    # at T), so that no block reads a source row past T and the kernels' blocks are the ones written.
    # One launch (_row_blocks_kernel) where the same table as torch ops took ~25, each a host call.
    splits = splits.to(device=device).contiguous()
    num_experts = splits.numel()
    nb = cdiv(num_rows, block) + num_experts
    start = torch.empty((nb,), dtype=torch.int64, device=device)
    count = torch.empty((nb,), dtype=torch.int32, device=device)
    rows = torch.empty((num_rows,), dtype=torch.int64, device=device)
    eb = max(16, next_power_of_2(num_experts))
    # A (chunk, eb) comparison a program, ≤ 32 values a thread on four warps. From 64 to 512 experts
    # the sums along the experts would cross warps through shared memory (~80 barriers a program at
    # 128), so one warp takes at most 8 indices and the grid grows instead; past 512 one warp's
    # registers spill (docs/DECISIONS.md, "_row_blocks_kernel on one warp").
    chunk = max(1, min(256, 4096 // eb))
    warps, chunk = (1, min(chunk, 8)) if 64 <= eb <= 512 else (4, chunk)
    if max(nb, num_rows):
        launch(_row_blocks_kernel, (cdiv(max(nb, num_rows), chunk),),
            splits, start, count, rows, num_experts, num_rows, nb, B=block, EB=eb, CHUNK=chunk, num_warps=warps
        )
    return start, count, rows, nb


def _wgrad_launch(
    t: Tensor, splits: Tensor, recipe, is_grad: bool, out: Tensor | None, transposed: bool = False, blocks=None,
    rows_out: Tensor | None = None, amax: Tensor | None = None,
):
    """Both passes of a wgrad operand: nvfp4's amax pass, then the codes and scales (``out`` None) or
    the values written into ``out`` (T, K); with ``rows_out`` (mxfp8, nvfp4 without the Hadamard
    option; ``out`` given) the same passes write there t's values quantized along K, as
    ``dequantized(t, recipe)`` (nvfp4: with the same tensor amax, that of the rows below Σsplits,
    ``tensor_amaxes``' second, for which ``dequantized`` takes ``amax=``). Returns (codes,
    scales, rows, amax, factor, codes_t, rows_factor), the unused ones None (amax: nvfp4's tensor
    amax): factor is nvfp4's 1/S_enc for ``out``, rows_factor for ``rows_out``; codes_t the (K, P)
    transposed codes.
    ``blocks``: the ``row_blocks`` of these splits, rows and block, computed once by the caller.
    ``amax``: nvfp4 without the Hadamard option and without ``rows_out``: the amax of t's rows below
    Σsplits computed already (``tensor_amaxes``' second), which replaces the amax pass."""
    rid = recipe_id(recipe)
    B = recipe.block
    T, K = t.shape
    if blocks is None:
        blocks = row_blocks(splits, T, B, t.device)
    elif not isinstance(blocks, RowBlocks):
        raise TypeError(f"blocks: expected a RowBlocks from row_blocks(), got {type(blocks).__name__}")
    elif blocks.block != B or blocks.rows.shape[0] != T or blocks.nb != cdiv(T, B) + splits.shape[0]:
        raise ValueError(
            f"blocks: made for {blocks.rows.shape[0]} rows in {blocks.block}-row blocks ({blocks.nb} blocks); this "
            f"operand has {T} rows, {recipe.name}'s {B}-row blocks and {splits.shape[0]} experts"
        )
    elif blocks.start.device != t.device:
        raise TypeError(f"blocks: expected tensors on {t.device}, got {blocks.start.device}")
    start, count, rows, nb, _ = blocks
    bk, warps = WGRAD_TILE[B]
    hadamard = rid == _NVFP4 and recipe.hadamard
    if rows_out is not None and (rid == _FP8_BLOCK or hadamard or out is None or bk % B):
        raise ValueError(
            f"rows_out: mxfp8's or nvfp4's values without the Hadamard option only, on tiles whose {bk} columns "
            f"hold whole {B}-wide blocks"
        )
    grid = (nb, cdiv(K, bk))
    stochastic = rid == _NVFP4 and recipe.stochastic_rounding and is_grad
    pow2 = bool(getattr(recipe, "pow2_scales", False))
    common = dict(RECIPE=rid, B=B, BK=bk, POW2=pow2, VMAX=_vmax(t.dtype), HADAMARD=hadamard, STOCHASTIC=stochastic,
                  num_warps=warps)
    codes = scales = factor = codes_t = rows_factor = None
    if out is None:
        scales = torch.empty((nb, K), dtype=torch.float32 if rid == _FP8_BLOCK else torch.uint8, device=t.device)
        if transposed:  # the codes are only stored transposed; ``codes`` is codes_t's transposed view
            codes_t = torch.empty((K, nb * B), dtype=torch.uint8, device=t.device)
            codes = codes_t.t()
        else:
            codes = torch.empty((nb * B // (2 if rid == _NVFP4 else 1), K), dtype=torch.uint8, device=t.device)
    elif rid == _NVFP4:
        factor = torch.empty((), dtype=torch.float32, device=t.device)
        if rows_out is not None:
            rows_factor = torch.empty((), dtype=torch.float32, device=t.device)
    given = amax is not None
    _check_amax(amax, rid == _NVFP4 and not hadamard and rows_out is None, t.device)
    # nvfp4's tensor amax (0 where nothing is launched); the other recipes' kernels never read it, so
    # t stands in for the pointer rather than a tensor filled on the device every call.
    if not given:
        amax = torch.zeros((), dtype=torch.float32, device=t.device) if rid == _NVFP4 else t
    # nvfp4 with rows_out: the rows' values take the same tensor amax, that of the rows below Σsplits,
    # as the reference quantizes only those rows (capacity rows belong to no expert, SPEC §1), so
    # nothing in a capacity row moves a routed row's values
    rows_amax = amax
    # With no rows (T = 0) the launch still runs: every block is padding, so it writes code 0 and an
    # empty block's scale, as the reference does (the outputs are never left uninitialized).
    if K > 0 and nb > 0:
        if rid == _NVFP4 and not given:
            partial = torch.empty(grid, dtype=torch.float32, device=t.device)
            launch(_wgrad_kernel, grid,
                t, start, count, partial, partial, partial, T, K, partial, partial, partial, partial,
                AMAX_ONLY=True, DEQUANT=False, STORE_T=False, STORE_ROWS=False, ROWS=False, **common,
            )  # fmt: skip
            amax = rows_amax = partial.amax()
        if out is None:
            launch(_wgrad_kernel, grid,
                t, start, count, codes, scales, amax, T, K, codes_t if transposed else codes, codes, amax, amax,
                AMAX_ONLY=False, DEQUANT=False, STORE_T=transposed, STORE_ROWS=not transposed, ROWS=False, **common,
            )  # fmt: skip
        else:
            s_dec = factor if factor is not None else out
            launch(_wgrad_kernel, grid,
                t, start, count, out, s_dec, amax, T, K, out, out if rows_out is None else rows_out, rows_amax,
                s_dec if rows_factor is None else rows_factor,
                AMAX_ONLY=False, DEQUANT=True, STORE_T=False, STORE_ROWS=False, ROWS=rows_out is not None, **common,
            )  # fmt: skip
    elif factor is not None:
        factor.fill_(1.0)  # no columns: amax 0, S_enc 1
        if rows_factor is not None:
            rows_factor.fill_(1.0)
    return codes, scales, rows, amax if rid == _NVFP4 else None, factor, codes_t, rows_factor


def quantize_wgrad(
    t: Tensor, splits: Tensor, recipe, is_grad: bool = False, transposed: bool = False, blocks: RowBlocks | None = None
):
    """A (T, K) weight-gradient operand, blocks along rows restarting at each expert's first row, in
    the expert-aligned padded layout of ``recipe.quantize_wgrad`` (same codes, scales and rows).
    ``transposed``: the codes stored as (K, P) ``codes_t`` only (fp8_block and mxfp8), for the fp8
    wgrad GEMM's K-major operands; ``codes`` is then its transposed view. ``blocks``: ``row_blocks(splits,
    T, recipe.block)``, when the caller quantizes several operands with the same splits."""
    from ...recipes import QuantizedTensor

    _check_wgrad(t, splits)
    rid = recipe_id(recipe)
    if transposed and rid == _NVFP4:
        raise ValueError("transposed: nvfp4 codes are packed in pairs along the rows; no transposed copy")
    B = recipe.block
    codes, scales, rows, amax, _, codes_t, _ = _wgrad_launch(t, splits, recipe, is_grad, None, transposed, blocks)
    codes_t = codes_t.view(torch.float8_e4m3fn) if codes_t is not None else None
    shape = (codes.shape[0] * (2 if rid == _NVFP4 else 1), t.shape[1])
    if rid == _NVFP4:
        return QuantizedTensor.of(
            recipe, codes, scales.view(torch.float8_e4m3fn), shape, 0, (B,),
            tensor_scale=nvfp4_scale_from_amax(amax), rows=rows,
        )  # fmt: skip
    if rid == _MXFP8:
        scales = scales.view(torch.float8_e8m0fnu)
    codes = codes.view(torch.float8_e4m3fn)
    return QuantizedTensor.of(recipe, codes, scales, shape, 0, (B,), rows=rows, codes_t=codes_t)


def _check_amax(amax: Tensor | None, allowed: bool, device) -> None:
    """A given tensor amax: only where nvfp4 reads one, and a 0-d fp32 tensor on the operand's device."""
    if amax is None:
        return
    if not allowed:
        raise ValueError("amax: only nvfp4 (without the Hadamard option, for a weight-gradient operand) takes a "
                         "tensor amax computed already")  # fmt: skip
    if not isinstance(amax, Tensor) or amax.shape != () or amax.dtype != torch.float32 or amax.device != device:
        got = f"{tuple(amax.shape)} {amax.dtype} on {amax.device}" if isinstance(amax, Tensor) else type(amax).__name__
        raise ValueError(f"amax: expected a 0-d float32 tensor on {device}, got {got}")


def _check_wgrad(t: Tensor, splits: Tensor) -> None:
    _check(t, "t")
    if t.ndim != 2:
        raise ValueError(f"t: expected a (T, K) operand, got shape {tuple(t.shape)}")
    if splits.device != t.device:
        raise TypeError(f"splits: expected a tensor on {t.device}, got {splits.device}")


# --- quantize-dequantize to exact values (the emulated recipes' GEMM operands) ---------------------------
#
# mxfp8 and nvfp4 have no tensor-core instruction on Hopper, and fp8_block's weight-gradient GEMMs run
# unscaled: each operand becomes its dequantized values code·block_scale, written once by the same
# kernels in x's own layout, and a bf16 grouped GEMM multiplies them exactly (fp32 accumulation).
# nvfp4's per-tensor 1/S_enc is not folded in: it comes back as ``factor`` for the GEMM to apply to
# its fp32 accumulator; the reference dequantizes (code·s)·(1/S_enc) left to right, so
# ``values.float() * factor`` is that reference bit for bit.
#
# Which dtype holds the values exactly (``exact_dtype``):
#   nvfp4       e2m1 × e4m3: ≤ 6 significant bits in [2^-10, 2688]: bf16 and fp16, any source.
#   mxfp8, fp8_block (pow2_scales=True)
#               code × 2^(−k): 4 significant bits, lowest bit 2^(−9−k). bf16's grid ends at 2^-133
#               (its smallest subnormal), so bf16 holds every value of a block whose scale 2^k is at
#               most 2^124: block amax > 448·2^-125 = 1.75·2^-117 ≈ 1.0532429e-35 (fp32 0x05600000;
#               for both recipes, measured: at that amax mxfp8's exponent is 2 and fp8_block's scale
#               2^125, one fp32 ulp above it 3 and 2^124), or amax 0 / Inf (NaN is ignored).
#               Below it a code finer than 2^-133 appears (2^-134 = 2^-9·2^-125, exact in fp32).
#               A bf16 or fp16 source never gets there: its elements are multiples of 2^-133, and a
#               power-of-two scale either keeps a value on a grid at least that coarse or leaves it
#               as the source element itself. So bf16 for bf16/fp16 sources, fp32 for fp32 ones
#               (exact in fp32: 2^-136 ≥ fp32's 2^-149). fp16 is too narrow (448·2^k passes 65504).
#   fp8_block (pow2_scales=False)
#               code × fp32(1/scale): up to 4 + 24 significant bits, rounded once in fp32 as the
#               reference rounds it: fp32 only.

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def exact_dtype(recipe, src_dtype: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The narrowest of bf16 / fp32 that holds every dequantized value of ``recipe`` exactly for a
    source of ``src_dtype`` (the table above): bf16 for nvfp4; bf16 for mxfp8 and fp8_block with
    power-of-two scales from a bf16/fp16 source, fp32 from an fp32 one; fp32 for fp8_block with
    pow2_scales=False."""
    rid = recipe_id(recipe)
    if rid == _NVFP4:
        return torch.bfloat16
    if rid == _FP8_BLOCK and not recipe.pow2_scales:
        return torch.float32
    return torch.bfloat16 if src_dtype in (torch.bfloat16, torch.float16) else torch.float32


def _check_out_dtype(recipe, src_dtype: torch.dtype, out_dtype, tiny_blocks_exact: bool = True) -> None:
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    rid = recipe_id(recipe)
    if out_dtype == torch.float32 or (rid == _NVFP4 and out_dtype == torch.float16):
        return
    if out_dtype == torch.bfloat16 and exact_dtype(recipe, src_dtype) == torch.bfloat16:
        return
    if out_dtype == torch.bfloat16 and not tiny_blocks_exact and not (rid == _FP8_BLOCK and not recipe.pow2_scales):
        return  # the caller accepts the tiny-block rounding below (see ``dequantized``)
    if rid == _FP8_BLOCK and not recipe.pow2_scales:
        why = "code·(1/scale) has up to 28 significant bits without power-of-two scales"
    elif out_dtype == torch.float16:
        why = "the values reach 448·2^k, far outside fp16's range"
    else:
        why = (
            f"from a {src_dtype} source, a block with amax ≤ 1.75·2^-117 (≈1.05e-35) has values on a grid "
            "finer than bf16's smallest subnormal 2^-133"
        )
    raise ValueError(
        f"out_dtype: {out_dtype} cannot hold {recipe.key}'s dequantized values exactly ({why}); "
        f"use out_dtype={exact_dtype(recipe, src_dtype)} (exact_dtype(recipe, src_dtype))"
    )


def _factor(rid: int, device) -> Tensor | None:
    """nvfp4: the 0-d fp32 that the kernel fills with 1/S_enc; None for the other recipes."""
    return torch.empty((), dtype=torch.float32, device=device) if rid == _NVFP4 else None


def dequantized(
    x: Tensor, recipe, axis: int = -1, out_dtype: torch.dtype = torch.bfloat16, tiny_blocks_exact: bool = True,
    amax: Tensor | None = None,
):
    """(values, factor): x quantized with 1-D blocks along ``axis`` (-1 or -2) and dequantized to
    code·block_scale in ``out_dtype``, x's shape; ``factor`` the 0-d fp32 1/S_enc (nvfp4) or None.
    ``values.float() * factor`` (or ``values.float()``) is ``recipe.qdq(x, axis)`` bit for bit.
    One pass over x (nvfp4: after the tensor amax pass); no host read.

    ``tiny_blocks_exact=False`` lets an fp32 source dequantize onto bf16 under mxfp8 and pow2
    fp8_block: exact for every block whose amax is above 1.75·2^-117 (≈1.05e-35); in a block at or
    below it, values finer than bf16's smallest subnormal round to its 2^-133 grid (absolute error
    ≤ 2^-134). The Triton grouped MLP takes that for z and g_h (fp32 epilogue outputs) rather than
    run its emulated GEMMs on fp32 operands.

    ``amax``: nvfp4 only, x's tensor amax computed already (``tensor_amaxes``' first), which
    replaces the amax pass."""
    _check(x, "x")
    rowwise = _block_axis(x, axis)
    rid = recipe_id(recipe)
    _check_out_dtype(recipe, x.dtype, out_dtype, tiny_blocks_exact)
    _check_amax(amax, rid == _NVFP4, x.device)
    M, K = x.shape[-2:]
    values = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    factor = _factor(rid, x.device)
    if rid == _NVFP4 and amax is None:
        amax = tensor_amax(x)
    elif rid != _NVFP4:
        amax = x  # a placeholder, read by nvfp4 only
    grid, bm, bk, nblk, warps = _block_grid(x, rid, recipe.block, rowwise)
    if x.numel():
        launch(_quantize_kernel, grid,
            x, values, factor if factor is not None else values, amax, M, K, values, STORE_T=False,
            RECIPE=rid, AXIS=_ROWWISE if rowwise else _COLWISE, BM=bm, BK=bk, NB=nblk,
            POW2=bool(getattr(recipe, "pow2_scales", False)), VMAX=_vmax(x.dtype), DEQUANT=True, num_warps=warps,
        )  # fmt: skip
    elif factor is not None:
        factor.fill_(1.0)  # no elements: amax 0, S_enc 1
    return values, factor


def dequantized_weight(
    w: Tensor, recipe, dim: int = -1, out_dtype: torch.dtype = torch.bfloat16, tiny_blocks_exact: bool = True
):
    """(values, factor) of expert weights (…, A, B): fp8_block 128×128 tiles over the last two dims
    (``dim`` checked, then ignored: one quantization serves both orientations); the others 1-D blocks
    along ``dim`` (-1 or -2), nvfp4 with one S_enc for the whole tensor. Matches
    ``recipe.qdq_weight(w, dim)`` as ``dequantized`` matches ``qdq``; ``tiny_blocks_exact`` as there."""
    _check(w, "w")
    _block_axis(w, dim, "dim")
    if recipe_id(recipe) != _FP8_BLOCK:
        return dequantized(w, recipe, axis=dim, out_dtype=out_dtype, tiny_blocks_exact=tiny_blocks_exact)
    _check_out_dtype(recipe, w.dtype, out_dtype, tiny_blocks_exact)
    values = torch.empty(w.shape, dtype=out_dtype, device=w.device)
    _weight_tiles(w, values, None, None, bool(recipe.pow2_scales), dequant=True)
    return values, None


def dequantized_wgrad(
    t: Tensor,
    splits: Tensor,
    recipe,
    is_grad: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    tiny_blocks_exact: bool = True,
    blocks: RowBlocks | None = None,
    amax: Tensor | None = None,
):
    """(values, factor) of a (T, K) weight-gradient operand: blocks along rows restarting at each
    expert's first row (nvfp4: Hadamard rotation and, for ``is_grad``, stochastic rounding as the
    recipe says), dequantized back into t's row layout; rows past Σsplits are 0. Matches the
    corresponding operand of ``recipe.qdq_wgrad(grad, act, splits)`` (grad: is_grad=True).
    ``tiny_blocks_exact``: as in ``dequantized``; ``blocks``: as in ``quantize_wgrad``; ``amax``:
    nvfp4 without the Hadamard option, ``tensor_amaxes(t, splits)[1]`` computed already (by a
    forward), which replaces this pass's amax read of t."""
    _check_wgrad(t, splits)
    _check_out_dtype(recipe, t.dtype, out_dtype, tiny_blocks_exact)
    values = torch.empty(t.shape, dtype=out_dtype, device=t.device)
    _, _, _, _, factor, _, _ = _wgrad_launch(t, splits, recipe, is_grad, values, blocks=blocks, amax=amax)
    return values, factor


def dequantized_both(
    t: Tensor,
    splits: Tensor,
    recipe,
    is_grad: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    tiny_blocks_exact: bool = True,
    blocks: RowBlocks | None = None,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """(rows, rows_factor, wgrad, wgrad_factor) of a (T, K) operand read by a GEMM along K and by a
    weight gradient along its rows: ``dequantized(t, recipe, amax=a)``'s (values, factor) and
    ``dequantized_wgrad(t, splits, recipe, is_grad)``'s, bit for bit, the factors nvfp4's 1/S_enc
    (None under mxfp8), where ``a`` is the amax of t's rows below Σsplits (``tensor_amaxes``' second):
    under nvfp4 both operands take that one tensor amax, as the reference quantizes only the routed
    rows, so the two factors are equal and the capacity rows move neither. Under mxfp8 one pass reads
    t once (the two passes read it twice); under nvfp4 one amax pass and one values pass that writes
    both (the separate passes read t four times). ``tiny_blocks_exact``
    and ``blocks`` as there. mxfp8 and nvfp4 without the Hadamard option only: with it the wgrad
    amax is taken after the rotation, and fp8_block's 128-wide blocks give up the narrow tiles that
    keep the loads in flight (docs/DECISIONS.md)."""
    _check_wgrad(t, splits)
    rid = recipe_id(recipe)
    if rid == _FP8_BLOCK or (rid == _NVFP4 and recipe.hadamard):
        raise ValueError(
            f"recipe: dequantized_both takes mxfp8, or nvfp4 without the Hadamard option, got "
            f"{getattr(recipe, 'key', recipe)!r}"
        )
    _check_out_dtype(recipe, t.dtype, out_dtype, tiny_blocks_exact)
    rows = torch.empty(t.shape, dtype=out_dtype, device=t.device)
    wgrad = torch.empty(t.shape, dtype=out_dtype, device=t.device)
    _, _, _, _, factor, _, rows_factor = _wgrad_launch(t, splits, recipe, is_grad, wgrad, blocks=blocks, rows_out=rows)
    return rows, rows_factor, wgrad, factor
