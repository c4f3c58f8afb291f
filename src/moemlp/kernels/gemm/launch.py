"""The host side of the grouped-GEMM family: the tile tables, and one launcher per kernel, each
taking its tensors by keyword. A launch's decisions (tiles, TMA or pointer loads, the FP8 fallback
tile, the size of the dprobs partials) read here in one place; the kernels they launch are device
code in their own files (grouped.py with epilogue.py, wgrad.py, dprobs.py, fp8_wgrad.py).

    launch_grouped_gemm(kind, ...)   FC1, FC2, FC2_DGRAD, FC1_DGRAD on the compute dtype, a recipe's
                                     bf16 values or fp8_block's codes
    launch_dprobs_reduce(...)        dprobs from FC2_DGRAD's partials, in a fixed order
    launch_grouped_wgrad(...)        dW and db on the compute dtype or bf16 values
    fp8_grouped_wgrad(...)           dW on fp8_block's K-major codes
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from .._cuda_context import bind_context
from .._launcher import cdiv, launch, next_power_of_2
from .common import INTERPRET, TensorDescriptor
from .dprobs import dprobs_reduce_kernel
from .epilogue import FC1, FC1_DGRAD, FC2, FC2_DGRAD
from .fp8_wgrad import fp8_wgrad_kernel
from .grouped import grouped_gemm_kernel
from .wgrad import grouped_wgrad_kernel

_EPILOGUES = {"fc1": FC1.value, "fc2": FC2.value, "fc2_dgrad": FC2_DGRAD.value, "fc1_dgrad": FC1_DGRAD.value}
BLOCK = 128  # fp8_block's row block of both fp8 wgrad operands: one K step of its reduction


# --- tile tables ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmConfig:
    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int
    GROUP_M: int = 8
    SUBTILE: int = 1  # epilogue column chunks, a power of two
    PROMOTE: bool | None = None  # fp32 adds of BK-deep products; None: when dprobs partials are stored
    USE_TMA: bool | None = None  # None: TMA where the operands allow it (16-byte aligned rows)


def default_config(
    kind: str, N: int, K: int, glu: bool, elem_bytes: int = 2, fp8: bool = False, emulated: bool = False
) -> GemmConfig:
    """Tile shapes for the H200, checked with ptxas (no spills); measurements in docs/DECISIONS.md,
    "bf16 tile configurations".
    ``fp8``: fp8_block's codes (BK = 128); ``emulated``: an mxfp8 / nvfp4 operand's bf16 values.

    Under the interpreter every program runs in numpy: 16-row tiles keep the CPU suite fast (16 is
    tl.dot's smallest side), with the same epilogue chunking as on the GPU so that code runs too."""
    if fp8:
        return fp8_config(kind, glu)
    if kind == "fc1" and glu:
        # Two 128×128 fp32 accumulators (gate, up) = one 128×256 tile, 128 registers per thread at
        # 8 warps; the epilogue in 4 chunks of 32 columns fits in the rest (254 registers, no
        # spills; 2 chunks spilled 55 local loads).
        # 3 stages beat 4 on mixtral (596 vs 565 TFLOP/s) and deepseek (616 vs 596), lost 2.5% on qwen3.
        gpu = GemmConfig(128, 128, 64, 8, 3, SUBTILE=4)
    elif kind == "fc1":
        gpu = GemmConfig(128, 128, 64, 8, 4, SUBTILE=2)
    elif kind == "fc2_dgrad":
        # The epilogue holds g_z, h gate/up, a, act' at once, and PROMOTE a second accumulator in
        # the loop: 8 chunks of 16 columns compile without spills (238 registers; 4 chunks: 11
        # local loads; 128×256 spills at any chunking). With PROMOTE: 8 chunks
        # 1-4% faster than 4; h loaded before the K loop (91 local loads) -6% to +5%, not kept.
        # BK = 128: each promoted product is 128 deep, as the Gluon engine's (gluon/_launch.py,
        # PROMOTE_DEPTH), so both give the same g_h and z bits; 3 stages of 64 KiB.
        gpu = GemmConfig(128, 128, 128, 8, 3, SUBTILE=8)
    elif kind == "wgrad":
        # Pointer loads: 128×256 at 3 stages beat 128×128 at 4 by 16-27% on all four model shapes.
        gpu = GemmConfig(128, 256, 64, 8, 3)
    else:
        # FC2 and FC1_DGRAD: plain epilogues; 128×256 is Hopper's usual best bf16 tile (202 regs).
        gpu = GemmConfig(128, 256, 64, 8, 3)
    if INTERPRET:
        # 32-deep steps for the emulated recipes: a 16-deep one holds half an mxfp8 block
        bk = 32 if emulated else 16
        return GemmConfig(16, 32 if gpu.SUBTILE > 1 else 16, bk, 4, 1, GROUP_M=4, SUBTILE=min(gpu.SUBTILE, 4))
    if elem_bytes == 4:
        # fp32 operands double every stage: 128×256 tiles at BK 64 and 3 stages would need 288 KiB of
        # shared memory (H200: 227 KiB per block, the launch fails). BK 32 and 2 stages:
        # (128 + 256)·32·4·2 = 96 KiB.
        return dataclasses.replace(gpu, BK=32, num_stages=min(gpu.num_stages, 2))
    return gpu


def fp8_config(kind: str, glu: bool) -> GemmConfig:
    """fp8_block (FP8 mode): BK = 128, one scale block per K step. The promotion keeps each step's
    product in registers next to the accumulator, so a tile holds twice the fp32 values of a bf16
    one: FC1 with a GLU takes 64 columns of gate and of up (128×128 fp32 in all, as the others).
    128×128, 8 warps, 4 stages was the best of the forward GEMM's sweep; 64×128 at 4 warps and 3/5
    stages were 1-6% slower (docs/DECISIONS.md, "fp8_block: an FP8 mode of the grouped-GEMM kernel")."""
    if kind == "fc1" and glu:
        gpu = GemmConfig(128, 64, 128, 8, 4, SUBTILE=2)
    elif kind == "fc1":
        gpu = GemmConfig(128, 128, 128, 8, 4, SUBTILE=2)
    elif kind == "fc2_dgrad":
        gpu = GemmConfig(128, 128, 128, 8, 4, SUBTILE=8)
    else:
        gpu = GemmConfig(128, 128, 128, 8, 4)
    if INTERPRET:
        return GemmConfig(16, 32 if gpu.SUBTILE > 1 else 16, 128, 4, 1, GROUP_M=4, SUBTILE=min(gpu.SUBTILE, 4))
    return gpu


def dprobs_parts(config: GemmConfig, N: int) -> int:
    """Rows of FC2_DGRAD's dprobs partials: one per N tile of F columns."""
    return cdiv(N, config.BN)


@dataclass(frozen=True)
class Fp8WgradConfig:
    BN: int  # output rows (G's columns) per tile
    BK: int  # output columns (X's columns) per tile
    num_warps: int
    num_stages: int
    GROUP_N: int = 8
    USE_TMA: bool | None = None  # None: TMA when the transposed codes allow it (16-byte aligned rows)


def default_fp8_wgrad_config() -> Fp8WgradConfig:
    """64×128 at 4 warps and 4 stages: the fastest of eight configs (benchmarks/bench_wgrad_quantizer.py
    --gemm; dW1 / dW2 of mixtral-8x7b 5.93 / 3.11 ms and of
    deepseek-v3-ep8 3.25 / 1.64 ms, 5-9 % faster than the earlier 128×128 at 8 warps, which was
    an unmeasured guess; moemlp's bf16 wgrad kernel took 6.15 / 3.09 and 3.49 / 1.71 ms). Each step ends in
    ``wgmma.wait_group 0`` (the promotion consumes the product at once), so no MMA overlaps the
    promotion within a CTA; at 64×128 (168 registers, 96 KiB of shared memory, offline sm_90) two
    CTAs fit per SM and one's promotion can overlap the other's MMA. 6 stages lost 30 % (one CTA per
    SM); 128×128 at 4 warps and 128×256 at 8 spill. Under the interpreter small tiles keep the CPU
    suite fast (16 is tl.dot's smallest side)."""
    if INTERPRET:
        return Fp8WgradConfig(16, 32, 4, 1, GROUP_N=2)
    return Fp8WgradConfig(64, 128, 4, 4)


# --- launch helpers --------------------------------------------------------------------------------

_NUM_SMS: dict[int, int] = {}


def _num_programs(device: torch.device, bound: int) -> int:
    if device.type != "cuda":
        return max(1, min(bound, 4))
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(bound, _NUM_SMS[index]))


def _e_block(E: int) -> int:
    return max(16, next_power_of_2(E))


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """The copy engine wants 16-byte aligned bases and row strides: true for contiguous tensors
    whose rows are multiples of 8 bf16 elements, unless a caller passes an offset view."""
    if TensorDescriptor is None:
        return False
    for t in tensors:
        if t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:-1]):
            return False
    return True


def _descriptor(t: torch.Tensor, block: list[int]):
    """A host TMA descriptor of ``t``, with a CUDA context current on this thread for its encoding
    (kernels/_cuda_context.py)."""
    if t.device.type == "cuda":
        bind_context(t.device)
    return TensorDescriptor.from_tensor(t, block)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 compute: exact fp32 products ("ieee"), as the reference; bf16/fp16 ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def _product(factors) -> torch.Tensor | None:
    """The product of the given 0-d factors, None ones left out (fp32, on the device: one rounding per
    product); None when there is none."""
    out = None
    for f in factors:
        if f is not None:
            out = f if out is None else out * f
    return out


# --- launchers ---------------------------------------------------------------------------------------


def launch_grouped_gemm(
    kind: str,  # "fc1", "fc2", "fc2_dgrad" or "fc1_dgrad": the epilogue, and the tile table's row
    *,
    a: torch.Tensor,  # (M, K) contiguous, rows grouped by expert: compute dtype, bf16 values, or e4m3 codes (FP8)
    b: torch.Tensor,  # (E, ·, ·) weights, their bf16 values or e4m3 codes, read through b_strides
    b_strides: tuple[int, int, int],  # element (n, k) of expert e at e·[0] + n·[1] + k·[2]; [2] == 1: K-major
    splits: torch.Tensor,  # (E,) int32/int64 on the device
    out: torch.Tensor,  # (M, N1) h | (M, H) y | (M, N1) g_h | (M, H) dx
    N: int,  # output columns: F for FC1 / FC2_DGRAD, H for FC2 / FC1_DGRAD
    K: int,
    N1: int,
    cfg,  # MLPConfig: activation and its parameters, GLU interleave; None: a plain GEMM (fc2 without probs)
    config: GemmConfig | None = None,  # None: default_config's
    emulated: bool = False,  # a and b hold an mxfp8 / nvfp4 recipe's bf16 values (the tile table's BK)
    probs: torch.Tensor | None = None,  # (M,) fp32/bf16/fp16
    bias: torch.Tensor | None = None,  # (E, N1) fc1_bias (FC1) | (E, H) fc2_bias (FC2)
    scale_bias: bool = False,  # FC2: the bias times probs (scale_fc2_bias)
    z: torch.Tensor | None = None,  # (M, F): round(act(h)·p), stored by FC1 and FC2_DGRAD when given
    h: torch.Tensor | None = None,  # (M, N1): the stored pre-activation FC2_DGRAD reads
    dprobs_partials: bool = False,  # FC2_DGRAD: return the (parts, M) fp32 dprobs partials
    a_scales: torch.Tensor | None = None,  # FP8: (M, ⌈K/128⌉) fp32 dequant scales of a's codes, any strides
    b_scales: torch.Tensor | None = None,  # FP8: fp32 dequant scales of b's 128×128 tiles ...
    b_scale_strides: tuple[int, int, int] | None = None,  # ... tile (n//128, k//128) of e at e·[0] + ·[1] + ·[2]
    acc_factors: tuple = (),  # 0-d fp32 factors (or None) whose product multiplies the accumulator: nvfp4's 1/S_enc
) -> torch.Tensor | None:
    """One grouped-GEMM launch; returns the dprobs partials when asked, else None. FP8 when a_scales
    is given (e4m3 codes of a and b with their block scales)."""
    epilogue = _EPILOGUES[kind]
    acc_scale = _product(acc_factors)
    M = a.shape[0]
    E = splits.shape[0]
    fp8 = a_scales is not None
    glu = cfg is not None and cfg.glu
    config = config or default_config(kind, N, K, glu, a.element_size(), fp8=fp8, emulated=emulated)
    glu_gather = glu and epilogue == FC1.value
    b_kmajor = b_strides[2] == 1
    # Gate and up column by column (gpt-oss): the tile's BN pairs as one B load of 2·BN rows, which
    # TMA can box; two loads of every other row it cannot. Compiled for sm_90 at FC1's tile (128×128,
    # 8 warps, 3 stages): paired on TMA m64n256 wgmma, 242-253 registers, no spills, either weight
    # layout. On pointer loads the paired tile spills (77 local loads) where the two gathers spill
    # more (126) for an N-major weight, and 2 where they spill none for a K-major one.
    pairs = glu_gather and cfg.glu_interleave == 1 and not fp8
    use_tma = _tma_ok(a, b) and (
        not glu_gather
        or pairs
        or N % cfg.glu_interleave == 0
        and (cfg.glu_interleave == N or cfg.glu_interleave % config.BN == 0)
    )
    if config.USE_TMA is not None:
        if config.USE_TMA and not use_tma:
            raise ValueError("config: USE_TMA needs 16-byte aligned operand rows (and GLU blocks a multiple of BN)")
        use_tma = config.USE_TMA
    elif fp8 and not use_tma and not INTERPRET:
        # Code rows not 16-byte aligned (K % 16 != 0): the masked-pointer mainloop holds (BM, 128)
        # pointer tensors besides the accumulator and the promoted product; at 128×128 every FP8
        # epilogue spilled (ptxas sm_90: 173-217 local loads), at 64×64 and 8 warps FC2 and
        # FC2_DGRAD do not (FC1 with a GLU still spills 99). A fallback for odd shapes.
        config = dataclasses.replace(config, BM=64, BN=64, num_warps=8, num_stages=4)
    # sized from the config this launch runs (the fallback above changes BN)
    partial = None
    if dprobs_partials:
        partial = torch.empty((dprobs_parts(config, N), M), dtype=torch.float32, device=a.device)
    if M == 0 or N == 0:
        return partial
    # cfg None: a plain GEMM (FC2's epilogue without probs: out = acc (+ bias)), no activation
    params = tuple(cfg.activation_params) + (0.0,) * (3 - len(cfg.activation_params)) if cfg else (0.0,) * 3
    dummy = a  # never dereferenced: the constexpr flags switch its loads and stores off
    paired = pairs and (use_tma or not b_kmajor)
    bound = (cdiv(M, config.BM) + E + 1) * cdiv(N, config.BN)
    programs = _num_programs(a.device, bound)
    a_desc = b_desc = None
    if use_tma:
        a_desc = _descriptor(a, [config.BM, config.BK])
        b_rows = 2 * config.BN if paired else config.BN  # paired: gate and up rows of BN columns
        b_block = [1, b_rows, config.BK] if b_kmajor else [1, config.BK, b_rows]
        b_desc = _descriptor(b, b_block)
    launch(grouped_gemm_kernel, (programs,),
        a, b, a_desc, b_desc, splits,
        probs if probs is not None else dummy,
        bias if bias is not None else dummy,
        out,
        z if z is not None else dummy,
        h if h is not None else dummy,
        partial if partial is not None else dummy,
        a_scales if a_scales is not None else dummy,
        b_scales if b_scales is not None else dummy,
        acc_scale if acc_scale is not None else dummy,
        M, N, K, E,
        *b_strides,
        a_scales.stride(0) if fp8 else 0,
        a_scales.stride(1) if fp8 else 0,
        *(b_scale_strides if b_scales is not None else (0, 0, 0)),
        N1,
        cfg.glu_interleave if glu else 1,
        float(params[0]), float(params[1]), float(params[2]),
        1.0,
        programs,
        EPILOGUE=epilogue,
        ACT=cfg.activation.kernel_id if cfg else 0,
        GLU=glu,
        HAS_PROBS=probs is not None,
        HAS_BIAS=bias is not None,
        SCALE_BIAS=scale_bias and probs is not None,
        STORE_Z=z is not None,
        STORE_PARTIAL=partial is not None,
        BM=config.BM,
        BN=config.BN,
        BK=config.BK,
        GROUP_M=config.GROUP_M,
        E_BLOCK=_e_block(E),
        INTERPRETED=INTERPRET,
        DOT_PRECISION=_dot_precision(a.dtype),
        USE_TMA=use_tma,
        B_KMAJOR=b_kmajor,
        SUBTILE=config.SUBTILE,
        # g_z feeds dprobs, which SPEC §1 holds to fp32-accumulation accuracy (see _accumulate).
        PROMOTE=partial is not None if config.PROMOTE is None else config.PROMOTE,
        FP8=fp8,
        ACC_SCALE=acc_scale is not None,
        B_SCALE_SCALAR=fp8 and 128 % config.BN == 0 and (not glu_gather or cfg.glu_interleave % config.BN == 0),
        PAIRED=paired,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    return partial


def launch_dprobs_reduce(
    *,
    partial: torch.Tensor,  # (parts, M) fp32 from the FC2_DGRAD launch
    dy: torch.Tensor,  # (M, H) compute dtype
    fc2_bias: torch.Tensor | None,  # (E, H), read with bias_term
    splits: torch.Tensor,  # (E,) int32/int64 on the device
    dprobs: torch.Tensor,  # (M,) probs.dtype, written
    bias_term: bool,  # scale_fc2_bias: + Σ_j dy·fc2_bias[e]
) -> None:
    M = dprobs.shape[0]
    num_parts = partial.shape[0]
    if M == 0:
        return
    H = dy.shape[1]
    E = splits.shape[0]
    experts_block = _e_block(E)
    if INTERPRET:
        block_r = 16
    elif bias_term:
        # The expert of each row comes from a (rows × experts) comparison: ≤ 16k elements keeps it
        # at 128 registers per thread at 4 warps, also for 1024 experts.
        block_r = max(16, min(128, 16384 // experts_block))
    else:
        block_r = 128
    launch(dprobs_reduce_kernel, (cdiv(M, block_r),),
        partial,
        dy,
        fc2_bias if fc2_bias is not None else dy,
        splits,
        dprobs,
        M,
        H,
        E,
        num_parts,
        BIAS_TERM=bias_term,
        BLOCK_R=block_r,
        BLOCK_H=16 if INTERPRET else 64,
        E_BLOCK=experts_block,
        INTERPRETED=INTERPRET,
        num_warps=4,
    )


def launch_grouped_wgrad(
    *,
    g: torch.Tensor,  # (M, P) rows grouped by expert: g_h | dy (or their bf16 values under a recipe)
    x: torch.Tensor | None,  # (M, Q): x | round(z); None with dw
    splits: torch.Tensor,  # (E,) int32/int64 on the device
    dw: torch.Tensor | None,  # (E, P, Q) written: dW[e] = g[R_e]ᵀ @ x[R_e]
    db: torch.Tensor | None,  # (E, P) written: Σ_rows g (· probs with scale_b)
    config: GemmConfig,
    probs: torch.Tensor | None = None,  # (M,) fp32/bf16/fp16, read with scale_b
    scale_b: bool = False,
    acc_factors: tuple = (),  # 0-d fp32 factors (or None) whose product multiplies dW (not db): nvfp4's 1/S_enc
) -> None:
    acc_scale = _product(acc_factors)
    M, P = g.shape
    E = splits.shape[0]
    Q = x.shape[1] if x is not None else 1
    do_w = dw is not None
    grid = (E * cdiv(P, config.BM) * (cdiv(Q, config.BN) if do_w else 1),)
    use_tma = do_w and M > 0 and _tma_ok(g, x)
    g_desc = _descriptor(g, [config.BK, config.BM]) if use_tma else None
    x_desc = _descriptor(x, [config.BK, config.BN]) if use_tma else None
    launch(grouped_wgrad_kernel, grid,
        g,
        x if x is not None else g,
        g_desc,
        x_desc,
        splits,
        probs if probs is not None else g,
        dw if dw is not None else g,
        db if db is not None else g,
        acc_scale if acc_scale is not None else g,
        M,
        P,
        Q,
        E,
        DO_W=do_w,
        DO_B=db is not None,
        SCALE_B=scale_b and probs is not None,
        BP=config.BM,
        BQ=config.BN,
        BK=config.BK,
        GROUP_P=config.GROUP_M,
        E_BLOCK=_e_block(E),
        INTERPRETED=INTERPRET,
        DOT_PRECISION=_dot_precision(g.dtype),
        USE_TMA=use_tma,
        ACC_SCALE=acc_scale is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def fp8_grouped_wgrad(
    *,
    g_t: Tensor,  # (N, P) e4m3 codes of Gᵀ (or their uint8 bits), contiguous
    g_scales: Tensor,  # (P/128, N) fp32
    x_t: Tensor,  # (K, P) e4m3 codes of Xᵀ
    x_scales: Tensor,  # (P/128, K) fp32
    splits: Tensor,  # (E,) int32/int64 on the device, the splits the operands were quantized with
    T: int,  # source rows of both operands
    out_dtype: torch.dtype = torch.float32,
    config: Fp8WgradConfig | None = None,
) -> Tensor:
    """dW (E, N, K) in ``out_dtype``: dW[e] = dequant(G)[R_e]ᵀ @ dequant(X)[R_e], zeros for an expert
    with no rows, from the transposed codes Gᵀ (N, P) and Xᵀ (K, P) (float8_e4m3fn or their uint8
    bits) with their fp32 scales (P/128, N) and (P/128, K), P = (⌈T/128⌉ + E)·128, T the source
    rows: ``quantize_wgrad(t, splits, recipe, transposed=True)``'s codes_t and scales."""
    for t, what in ((g_t, "g_t"), (x_t, "x_t"), (g_scales, "g_scales"), (x_scales, "x_scales")):
        if not isinstance(t, Tensor) or t.ndim != 2 or not t.is_contiguous():
            raise ValueError(f"{what}: expected a contiguous 2-D tensor")
    for t, what in ((g_t, "g_t"), (x_t, "x_t")):
        if t.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise TypeError(f"{what}: expected float8_e4m3fn codes (or their uint8 bits), got {t.dtype}")
    N, P = g_t.shape
    K = x_t.shape[0]
    if x_t.shape[1] != P or P % BLOCK:
        raise ValueError(f"x_t: expected (K, {P}) with P a multiple of 128, got {tuple(x_t.shape)}")
    for t, C, what in ((g_scales, N, "g_scales"), (x_scales, K, "x_scales")):
        if tuple(t.shape) != (P // BLOCK, C) or t.dtype != torch.float32:
            raise ValueError(f"{what}: expected ({P // BLOCK}, {C}) float32, got {tuple(t.shape)} {t.dtype}")
    if not isinstance(splits, Tensor) or splits.dtype not in (torch.int32, torch.int64) or splits.ndim != 1:
        raise TypeError("splits: expected an (E,) int32/int64 tensor")
    if P != (cdiv(T, BLOCK) + splits.shape[0]) * BLOCK:
        raise ValueError(f"T: expected the rows with P = (ceil(T/128) + E)·128 = {P}, got T = {T}")
    g_t, x_t = g_t.view(torch.float8_e4m3fn), x_t.view(torch.float8_e4m3fn)
    return _launch_fp8_wgrad(g_t, g_scales, x_t, x_scales, splits, T, out_dtype, config)


def _launch_fp8_wgrad(g_t, g_scales, x_t, x_scales, splits, T, out_dtype, config) -> Tensor:
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"out_dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    device = g_t.device
    for t, what in ((g_scales, "g scales"), (x_t, "x codes"), (x_scales, "x scales"), (splits, "splits")):
        if t.device != device:
            raise TypeError(f"{what}: expected a tensor on {device} (g's codes'), got {t.device}")
    config = config or default_fp8_wgrad_config()
    (N, P), K, E = g_t.shape, x_t.shape[0], splits.shape[0]
    out = torch.empty((E, N, K), dtype=out_dtype, device=device)
    if out.numel() == 0:
        return out
    use_tma = _tma_ok(g_t, x_t) if config.USE_TMA is None else config.USE_TMA
    if use_tma and not _tma_ok(g_t, x_t):
        raise ValueError("config: USE_TMA needs triton's TensorDescriptor and 16-byte aligned code rows")
    g_desc = _descriptor(g_t, [config.BN, BLOCK]) if use_tma else None
    x_desc = _descriptor(x_t, [config.BK, BLOCK]) if use_tma else None
    grid = (E * cdiv(N, config.BN) * cdiv(K, config.BK),)
    launch(fp8_wgrad_kernel, grid,
        g_t, g_scales, x_t, x_scales, g_desc, x_desc, splits, out,
        T, P, N, K, E,
        g_scales.stride(0), g_scales.stride(1), x_scales.stride(0), x_scales.stride(1),
        BN=config.BN,
        BK=config.BK,
        BR=BLOCK,
        GROUP_N=config.GROUP_N,
        E_BLOCK=_e_block(E),
        INTERPRETED=INTERPRET,
        USE_TMA=use_tma,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    return out
