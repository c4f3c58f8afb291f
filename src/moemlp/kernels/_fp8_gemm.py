"""The native fp8_block grouped GEMM (SPEC §3) as a standalone op: e4m3 operands on Hopper's FP8
tensor cores, block scales applied by promoting each 128-deep partial sum into an fp32 accumulator
(DeepGEMM's scheme, as DeepSeek-V3 trains).

    out[R_e] = A[R_e] @ B[e]ᵀ (+ bias[e])       for every expert e, rows R_e grouped by expert

    A: (M, K) e4m3 codes, fp32 dequantization scales per row and 128-column block (M, ⌈K/128⌉)
       (``quantize(x, recipe, axis=-1)``: 1×128 blocks along the reduction dim)
    B: (E, N, K) e4m3 codes, fp32 dequantization scales per 128×128 tile (E, ⌈N/128⌉, ⌈K/128⌉)
       (``quantize_weight(w, recipe)``)

Per 128-deep K step (BK = 128 = one scale block of both operands):

    acc += dot(a_codes, b_codes) · (a_scale[:, None] · b_scale[None, :])

The products of two e4m3 codes are exact; the 128-deep partial sum is the tensor cores' (on
Hopper a limited-precision accumulation, ~14 bits per DeepSeek-V3 §3.3.2, which is why the chain is
cut every 128); the scaling and the add into ``acc`` are ordinary fp32 (round-to-nearest) CUDA-core
arithmetic. With ``pow2_scales`` (the recipe's default) the scale product is exact.

The kernel is the grouped-MLP family's (``_grouped_gemm._grouped_gemm_kernel`` in FP8 mode, FC2's
plain epilogue): expert offsets from device ``splits`` (clamped, no host read), a persistent launch
over m-tiles × n-tiles, capacity tiles writing zeros past Σsplits, TMA operand tiles where code rows
are 16-byte aligned (K % 16 == 0) else masked pointer loads, scales through pointer loads one K step
ahead. The grouped MLP's fp8_block GEMMs run through the same kernel with their own epilogues.
H200 figures: benchmarks/NOTES.md, "fp8_block GEMM".
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ._grouped_gemm import FC2, GemmConfig, default_config, launch_grouped_gemm

__all__ = ["fp8_block_grouped_gemm", "fp8_block_grouped_linear", "default_fp8_config"]

BLOCK = 128  # fp8_block's scale block along K, for both operands; the GEMM's BK


def default_fp8_config() -> GemmConfig:
    """The plain fp8_block GEMM's tile (``_grouped_gemm._fp8_config``)."""
    return default_config("fc2", 0, 0, False, fp8=True)


def _parts(q, name: str) -> tuple[Tensor, Tensor]:
    """codes and scales of a QuantizedTensor-like object or a (codes, scales) pair."""
    if isinstance(q, (tuple, list)) and len(q) == 2:
        codes, scales = q
    elif hasattr(q, "codes") and hasattr(q, "scales"):
        codes, scales = q.codes, q.scales
    else:
        raise TypeError(f"{name}: expected a QuantizedTensor (or a (codes, scales) pair), got {type(q).__name__}")
    for t, what in ((codes, "codes"), (scales, "scales")):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}.{what}: expected a torch.Tensor, got {type(t).__name__}")
    if codes.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}.codes: expected torch.float8_e4m3fn, got {codes.dtype}")
    if scales.dtype != torch.float32:
        raise TypeError(f"{name}.scales: expected fp32 dequantization scales, got {scales.dtype}")
    if getattr(q, "rows", None) is not None:
        raise ValueError(f"{name}: a weight-gradient operand (padded row layout) is not a forward/dgrad operand")
    return codes, scales


def fp8_block_grouped_gemm(
    a,
    b,
    splits: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Tensor | None = None,
    config: GemmConfig | None = None,
) -> Tensor:
    """out (M, N) in ``out_dtype``: out[R_e] = dequant(A)[R_e] @ dequant(B[e])ᵀ (+ bias[e]); rows past
    Σsplits are 0.

    a: QuantizedTensor (or (codes, scales)) of an (M, K) operand, 1×128 blocks along K: codes
       float8_e4m3fn (M, K) contiguous, scales fp32 (M, ⌈K/128⌉), row-major or its transpose's view
       (``s.t().contiguous().t()``, DeepGEMM's layout: one coalesced load per K step).
    b: QuantizedTensor (or pair) of (E, N, K) weights in 128×128 tiles: codes (E, N, K) contiguous,
       scales fp32 (E, ⌈N/128⌉, ⌈K/128⌉) contiguous.
    splits: (E,) int32/int64 on the operands' device; never read on the host (bad values are clamped
       in the kernel: see _grouped_gemm).
    bias: (E, N) or None, any float dtype, added in fp32.
    """
    a_codes, a_scales = _parts(a, "a")
    b_codes, b_scales = _parts(b, "b")
    if a_codes.ndim != 2:
        raise ValueError(f"a.codes: expected (M, K), got shape {tuple(a_codes.shape)}")
    if b_codes.ndim != 3:
        raise ValueError(f"b.codes: expected (E, N, K), got shape {tuple(b_codes.shape)}")
    M, K = a_codes.shape
    E, N, Kb = b_codes.shape
    if Kb != K:
        raise ValueError(f"b.codes: expected K = {K} (a's columns) in (E, N, K), got shape {tuple(b_codes.shape)}")
    if K == 0:
        raise ValueError("a.codes: K = 0 columns; an fp8_block GEMM needs at least one scale block")
    kb, nb = triton.cdiv(K, BLOCK), triton.cdiv(N, BLOCK)
    if tuple(a_scales.shape) != (M, kb):
        raise ValueError(f"a.scales: expected (M, ceil(K/128)) = {(M, kb)} (1x128 blocks), got {tuple(a_scales.shape)}")
    if tuple(b_scales.shape) != (E, nb, kb):
        raise ValueError(
            f"b.scales: expected (E, ceil(N/128), ceil(K/128)) = {(E, nb, kb)} (128x128 tiles), "
            f"got {tuple(b_scales.shape)}"
        )
    # the kernel indexes codes with the shapes' own strides; copying a view here would hide a pass
    for t, what in ((a_codes, "a.codes"), (b_codes, "b.codes"), (b_scales, "b.scales")):
        if not t.is_contiguous():
            raise ValueError(f"{what}: expected a contiguous tensor")
    if not isinstance(splits, Tensor) or splits.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"splits: expected an int32/int64 tensor, got {getattr(splits, 'dtype', type(splits))}")
    if tuple(splits.shape) != (E,):
        raise ValueError(f"splits: expected shape ({E},) (b's experts), got {tuple(splits.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"out_dtype: expected bf16, fp16 or fp32, got {out_dtype}")
    if bias is not None:
        if not isinstance(bias, Tensor) or not bias.is_floating_point():
            raise TypeError("bias: expected a floating-point tensor or None")
        if tuple(bias.shape) != (E, N):
            raise ValueError(f"bias: expected shape {(E, N)}, got {tuple(bias.shape)}")
        if not bias.is_contiguous():
            raise ValueError("bias: expected a contiguous tensor")
    device = a_codes.device
    for t, what in ((a_scales, "a.scales"), (b_codes, "b.codes"), (b_scales, "b.scales"), (splits, "splits")) + (
        ((bias, "bias"),) if bias is not None else ()
    ):
        if t.device != device:
            raise TypeError(f"{what}: expected a tensor on {device} (a.codes'), got {t.device}")

    config = config or default_fp8_config()
    if config.BK != BLOCK:
        raise ValueError(f"config: fp8_block needs BK = {BLOCK} (one scale block per K step), got {config.BK}")
    out = torch.empty((M, N), dtype=out_dtype, device=device)
    if M == 0 or N == 0:
        return out
    if E == 0:
        return out.zero_()  # no expert: every row is capacity
    launch_grouped_gemm(
        FC2.value, a_codes, b_codes, (N * K, K, 1), splits, None, bias, out, None, None, None,
        N=N, K=K, N1=N, cfg=None, scale_bias=False, store_z=False, store_partial=False, config=config,
        a_scales=a_scales, b_scales=b_scales, b_scale_strides=(nb * kb, kb, 1),
    )  # fmt: skip
    return out


def fp8_block_grouped_linear(
    x: Tensor,
    w: Tensor,
    splits: Tensor,
    recipe=None,
    bias: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: GemmConfig | None = None,
) -> Tensor:
    """out[R_e] = x[R_e] @ w[e]ᵀ (+ bias[e]) under fp8_block: x quantized 1×128 along K, w in 128×128
    tiles, both with the Triton quantizers (bit-exact with moemlp.recipes), then the fp8 GEMM.

    x (M, K) bf16/fp16/fp32 contiguous, w (E, N, K) contiguous, splits (E,) on x's device;
    ``recipe`` an FP8BlockRecipe (default: ``recipe("fp8_block")``); output in x.dtype by default.
    """
    from ..recipes import FP8BlockRecipe
    from ..recipes import recipe as make_recipe
    from . import quantize as kq

    r = make_recipe("fp8_block") if recipe is None else recipe
    if not isinstance(r, FP8BlockRecipe):
        raise TypeError(f"recipe: expected an fp8_block recipe, got {type(r).__name__}")
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"x, w: expected (M, K) and (E, N, K), got {tuple(x.shape)} and {tuple(w.shape)}")
    qx = kq.quantize(x, r, axis=-1)
    qw = kq.quantize_weight(w, r)
    return fp8_block_grouped_gemm(qx, qw, splits, out_dtype or x.dtype, bias=bias, config=config)
