"""The launcher of the Gluon grouped GEMM: validates, allocates, builds the TMA descriptors and the
persistent grid (one CTA per SM). Reads nothing on the host from ``splits``."""

from __future__ import annotations

import functools

import torch

from ._compat import why_unavailable

# 128×128×64 tiles, 4 stages: (128 + 128)·64·2 B = 32 KiB a stage, 128 KiB of ring + 2 × 32 KiB of
# epilogue tiles = 192 KiB of the 227 KiB an sm_90 CTA may use; a 5th stage would not fit.
BM, BN, BK = 128, 128, 64
STAGES = 4
GROUP_M = 8
# The expert table is held in registers by every partition, E_BLOCK / 32 values a lane per field
# (starts, ends, tile ends): 256 experts keep that at 24 registers in the 40-register producer.
MAX_EXPERTS = 256


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check(a: torch.Tensor, b: torch.Tensor, splits: torch.Tensor, out: torch.Tensor | None) -> None:
    for name, t in (("a", a), ("b", b), ("splits", splits)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"grouped_gemm: {name} must be a torch.Tensor, got {type(t).__name__}")
    if a.dim() != 2:
        raise ValueError(f"grouped_gemm: a must be (M, K), got shape {tuple(a.shape)}")
    if b.dim() != 3:
        raise ValueError(f"grouped_gemm: b must be (E, N, K), got shape {tuple(b.shape)}")
    if splits.dim() != 1:
        raise ValueError(f"grouped_gemm: splits must be (E,), got shape {tuple(splits.shape)}")
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise TypeError(f"grouped_gemm: a and b must be bfloat16, got {a.dtype} and {b.dtype}")
    if splits.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"grouped_gemm: splits must be int32 or int64, got {splits.dtype}")
    if a.device.type != "cuda" or b.device != a.device or splits.device != a.device:
        raise TypeError(
            f"grouped_gemm: a, b and splits must be on one CUDA device, got {a.device}, {b.device}, {splits.device}"
        )
    M, K = a.shape
    E, N, Kb = b.shape
    if Kb != K:
        raise ValueError(f"grouped_gemm: b's last dimension must be a's K = {K}, got {Kb}")
    if splits.shape[0] != E:
        raise ValueError(f"grouped_gemm: splits must have one entry per expert (E = {E}), got {splits.shape[0]}")
    if E > MAX_EXPERTS:
        raise ValueError(f"grouped_gemm: at most {MAX_EXPERTS} experts (the table is held in registers), got {E}")
    # TMA: every row stride a multiple of 16 bytes, i.e. of 8 bf16 elements.
    if K % 8 or N % 8:
        raise ValueError(f"grouped_gemm: K and N must be multiples of 8 for TMA (16-byte rows), got K={K}, N={N}")
    for name, t in (("a", a), ("b", b), ("splits", splits)):
        if not t.is_contiguous():
            raise ValueError(f"grouped_gemm: {name} must be contiguous (call .contiguous() first)")
    for name, t in (("a", a), ("b", b)):
        if t.data_ptr() % 16:
            raise ValueError(f"grouped_gemm: {name} must start on a 16-byte boundary for TMA")
    if out is not None:
        if out.shape != (M, N) or out.dtype != torch.bfloat16 or out.device != a.device:
            raise ValueError(
                f"grouped_gemm: out must be ({M}, {N}) bfloat16 on {a.device}, "
                f"got {tuple(out.shape)} {out.dtype} on {out.device}"
            )
        if not out.is_contiguous() or out.data_ptr() % 16:
            raise ValueError("grouped_gemm: out must be contiguous and start on a 16-byte boundary")


def grouped_gemm(
    a: torch.Tensor, b: torch.Tensor, splits: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """C[R_e] = A[R_e] @ B[e]ᵀ for every expert e, R_e the rows between offsets[e-1] and offsets[e]
    (offsets = cumsum(splits), computed on the device). a (M, K) bf16 with rows grouped by expert;
    b (E, N, K) bf16; splits (E,) int32/int64 on a's device. Returns C (M, N) bf16 (written into
    ``out`` when given), fp32 accumulation, rounded once. Rows past Σsplits get 0. Splits are clamped
    on the device (negative → 0 rows, a running sum past M stops at M), never read on the host."""
    _check(a, b, splits, out)
    reason = why_unavailable(a.device)
    if reason:
        raise RuntimeError(f"grouped_gemm: the Gluon engine cannot run here: {reason}")
    from ._compat import TensorDescriptor, gl
    from ._engine import MAXNREG, NUM_WARPS, grouped_gemm_kernel

    M, K = a.shape
    E, N, _ = b.shape
    if out is None:
        out = torch.empty((M, N), dtype=torch.bfloat16, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0 or E == 0:
        return out.zero_()
    a_layout = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    b_layout = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    c_layout = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.bfloat16)
    a_desc = TensorDescriptor.from_tensor(a, [BM, BK], a_layout)
    b_desc = TensorDescriptor.from_tensor(b.view(E * N, K), [BN, BK], b_layout)
    c_desc = TensorDescriptor.from_tensor(out, [BM, BN], c_layout)
    e_block = max(32, 1 << (E - 1).bit_length())
    # Static bound on the tile count (M rows over E experts make at most cdiv(M, BM) + E m-tiles,
    # capacity included), so the grid needs no device read.
    tile_bound = (-(-M // BM) + E) * -(-N // BN)
    device_index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    grid = (min(_num_sms(device_index), tile_bound),)
    with torch.cuda.device(a.device):
        grouped_gemm_kernel[grid](
            a_desc, b_desc, c_desc, out, splits, E, M, N, K,
            BM=BM, BN=BN, BK=BK, STAGES=STAGES, GROUP_M=GROUP_M, E_BLOCK=e_block,
            num_warps=NUM_WARPS, maxnreg=MAXNREG,
        )
    return out
