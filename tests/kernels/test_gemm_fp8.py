"""The FP8 mode of the grouped GEMM (kernels/gemm/grouped.py, FC2's plain epilogue without probs)
against its torch emulation and against float64 on the unquantized inputs.

Emulation: the torch reference quantizers (moemlp.recipes) give codes and scales; dequantize them in
fp32 (``QuantizedTensor.dequantize``), multiply per expert in float64. The kernel computes the same
sum with fp32 arithmetic in another order, so the two differ by accumulation-order noise only, with
this first-order bound per output element (u = 2^-24, |A|, |B| the dequantized operands):

    |out - emu| ≤ (128 + ⌈K/128⌉ + 4)·u·(|A| @ |B|ᵀ + |bias|)

    - a product of two e4m3 codes (4 significant bits each) is exact in fp32;
    - the 128-deep partial sum in fp32, any order: ≤ 127·u of the sum of |terms| (Higham's γ_127);
    - a_scale·b_scale and the multiply of the partial by it: 2 roundings (0 with pow2 scales);
    - the ⌈K/128⌉ adds of the promoted partials into the accumulator: ≤ (⌈K/128⌉ − 1)·u;
    - the emulation's fp32 dequantization code·scale of each operand: 2 roundings (0 with pow2);
    - the bias add: 1 rounding.

On K = 300 that is 135·u = 8e-6 of the absolute sum: fp32 noise, far under the recipe's own
error (e4m3 keeps 3 mantissa bits: ~2^-5 per operand). Measured on the cases below:
at most 0.97·u, i.e. about one fp32 rounding (the bound is a worst case, not a fit).

Under the interpreter the 128-deep dot is a numpy fp32 matmul of the exactly widened codes, so the
bound holds as written; on Hopper the partial sum is the tensor cores' limited-precision
accumulation and the GPU tests use a looser bound, reasoned below.

Accuracy of the recipe: SNR against float64 on the unquantized inputs ≥ 27 dB, the per-GEMM floor
of tests/test_recipes.py (one GEMM of two e4m3-quantized Gaussian operands: 28.5 dB measured).

Without a GPU the kernel cases run under TRITON_INTERPRET=1 in a child pytest of this file
(tests/_triton_env.py says why).
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

import _triton_env
from moemlp.recipes import recipe

interpreted = pytest.mark.skipif(
    not _triton_env.RUN_CPU_CASES,
    reason="CPU cases: run under TRITON_INTERPRET=1 in the child of test_cpu_cases_under_interpreter",
)

U = 2.0**-24
SNR_FLOOR_DB = 27.0


@pytest.mark.interpreter_child(seconds=40)
@pytest.mark.skipif(not _triton_env.START_CHILD, reason="runs the CPU cases in a child on a CPU-only machine")
def test_cpu_cases_under_interpreter():
    _triton_env.run_file_interpreted(__file__, timeout=300)


def fp8_gemm(a, b, splits, out_dtype, bias=None, config=None):
    """out (M, N) = dequant(A)[R_e] @ dequant(B[e])ᵀ (+ bias[e]) through the launcher: a a QuantizedTensor
    of (M, K) or a (codes, scales) pair (1×128 blocks along K), b one of (E, N, K) 128×128 tiles."""
    from moemlp.kernels import gemm

    codes, scales = a if isinstance(a, tuple) else (a.codes, a.scales)
    E, N, K = b.codes.shape
    nb, kb = b.scales.shape[1:]
    out = torch.empty((codes.shape[0], N), dtype=out_dtype, device=codes.device)
    gemm.launch_grouped_gemm(
        "fc2", a=codes, b=b.codes, b_strides=(N * K, K, 1), splits=splits, out=out, N=N, K=K, N1=N,
        cfg=None, config=config or gemm.default_config("fc2", 0, 0, False, fp8=True), bias=bias, a_scales=scales,
        b_scales=b.scales, b_scale_strides=(nb * kb, kb, 1),
    )  # fmt: skip
    return out


# --- references ------------------------------------------------------------------------------------


def emulate(qa, qb, splits, M, bias=None):
    """float64 (M, N): per expert, fp32-dequantized codes·scales multiplied in float64; capacity rows
    0; also |A| @ |B|ᵀ (+ |bias|), the magnitude the accumulation-order bound scales with."""
    A, B = qa.dequantize().double(), qb.dequantize().double()
    N = B.shape[1]
    out = torch.zeros(M, N, dtype=torch.float64, device=A.device)
    mag = torch.zeros_like(out)
    start = 0
    for e, s in enumerate(splits):
        rows = slice(start, start + s)
        out[rows] = A[rows] @ B[e].T
        mag[rows] = A[rows].abs() @ B[e].T.abs()
        if bias is not None:
            out[rows] += bias[e].double()
            mag[rows] += bias[e].double().abs()
        start += s
    return out, mag


def exact_f64(x, w, splits, M, bias=None):
    """float64 of the unquantized inputs, capacity rows 0."""
    out = torch.zeros(M, w.shape[1], dtype=torch.float64, device=x.device)
    start = 0
    for e, s in enumerate(splits):
        out[start : start + s] = x[start : start + s].double() @ w[e].double().T
        if bias is not None:
            out[start : start + s] += bias[e].double()
        start += s
    return out


def snr_db(a, ref):
    ref = ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (a.double() - ref).pow(2).sum()))


def order_bound(K: int) -> float:
    """The first-order accumulation-order bound of the module docstring, relative to |A|@|B|ᵀ."""
    return (128 + math.ceil(K / 128) + 4) * U


def problem(splits, M, K, N, seed=0, device="cpu", bias=False):
    g = torch.Generator().manual_seed(seed)
    E = len(splits)
    # a random magnitude per row and per expert: block scales differ across blocks and tiles
    x = torch.randn(M, K, generator=g) * 2.0 ** torch.randint(-6, 7, (M, 1), generator=g)
    w = torch.randn(E, N, K, generator=g) * K**-0.5 * 2.0 ** torch.randint(-3, 4, (E, 1, 1), generator=g)
    b = torch.randn(E, N, generator=g) if bias else None
    to = dict(device=device)
    return x.to(**to), w.to(**to), (b.to(**to) if b is not None else None)


# --- the interpreter cases ----------------------------------------------------------------------------

# (id, splits, M, K, N, out dtype, bias, pow2_scales, transposed a-scale layout, splits dtype).
# Operand tiles come through TMA when K % 16 == 0 (K = 304, 128, 48 below), else through masked
# pointer loads (K = 300, 273, 200): both mainloops run.
CASES = [
    # K and N not multiples of 128 (a 44-deep last K block, a 72-wide last tile column); E = 5 prime;
    # an empty expert; an expert of 3 rows (less than a tile); 18 capacity rows; per-expert bias
    ("odd_sizes", [37, 0, 50, 3, 20], 128, 300, 200, torch.float32, True, True, False, torch.int64),
    # the same through TMA: the copy engine zero-fills the 48-deep K tail and B's rows past N
    ("odd_sizes_tma", [37, 0, 50, 3, 20], 128, 304, 200, torch.float32, True, True, False, torch.int64),
    # every row in one expert; bf16 output (round-to-nearest-even in the store)
    ("one_expert_bf16", [64], 64, 128, 96, torch.bfloat16, False, True, False, torch.int64),
    # non-power-of-two scales (the scale products round); DeepGEMM's transposed a-scale layout;
    # a leading empty expert; int32 splits; 10 capacity rows
    ("non_pow2_scales", [0, 40, 30], 80, 273, 130, torch.float32, True, False, True, torch.int32),
    # K shorter than one block (one partial K step); E = 7 prime with two empty experts
    ("short_k", [5, 9, 0, 17, 1, 0, 12], 50, 48, 33, torch.float32, False, True, False, torch.int64),
    # no row belongs to an expert: every row is capacity and stays 0 (bias not added)
    ("all_capacity", [0, 0], 20, 200, 40, torch.bfloat16, True, True, False, torch.int64),
]


def run_case(case, device):
    from moemlp.kernels import gemm

    _, splits, M, K, N, out_dtype, has_bias, pow2, scales_t, splits_dtype = case
    r = recipe("fp8_block", pow2_scales=pow2)
    x, w, bias = problem(splits, M, K, N, device=device, bias=has_bias)
    qa, qb = r.quantize(x, -1), r.quantize_weight(w)
    a = qa
    if scales_t:
        a = (qa.codes, qa.scales.t().contiguous().t())  # (M, KB) values, column-major storage
    sp = torch.tensor(splits, dtype=splits_dtype, device=device)
    out = fp8_gemm(a, qb, sp, out_dtype, bias=bias)
    if K % 16 == 0:
        # TMA ran (aligned rows); the pointer mainloop must give the same bits: same tiles, same order
        cfg = dataclasses.replace(gemm.default_config("fc2", 0, 0, False, fp8=True), USE_TMA=False)
        assert torch.equal(fp8_gemm(a, qb, sp, out_dtype, bias=bias, config=cfg), out)
    emu, mag = emulate(qa, qb, splits, M, bias)
    assert out.dtype == out_dtype and out.shape == (M, N)
    bound = order_bound(K) * mag
    if out_dtype != torch.float32:
        bound = bound + 2.0**-8 * emu.abs()  # the store's one rounding: half an ulp is ≤ 2^-9 relative
    err = (out.double() - emu).abs()
    assert (err <= bound).all(), (float((err / bound.clamp(min=1e-300)).max()), float(err.max()))
    T = sum(splits)
    assert (out[T:] == 0).all(), "capacity rows"
    if T and K >= 128:
        # Gaussian operands: the recipe's accuracy against the unquantized inputs
        snr = snr_db(out[:T], exact_f64(x, w, splits, M, bias)[:T])
        assert snr >= SNR_FLOOR_DB, snr
    return out, emu


@interpreted
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cpu_matches_emulation(case):
    run_case(case, "cpu")


@interpreted
def test_cpu_triton_quantized_operands_give_the_same_bits_and_meet_snr():
    # The Triton quantizers are bit-exact with the torch ones, so the GEMM on their operands gives the
    # same bits as on torch-quantized ones; and its accuracy against the unquantized float64 product
    # must meet the per-GEMM floor.
    from moemlp.kernels import quant

    splits, M, K, N = [30, 0, 45, 25], 112, 256, 160
    x, w, _ = problem(splits, M, K, N, seed=1)
    x = torch.randn_like(x)  # plain Gaussian rows, as test_recipes' SNR problem
    r = recipe("fp8_block")
    sp = torch.tensor(splits)
    out = fp8_gemm(quant.quantize(x, r, axis=-1), quant.quantize_weight(w, r), sp, torch.float32)
    ref = fp8_gemm(r.quantize(x, -1), r.quantize_weight(w), sp, torch.float32)
    assert torch.equal(out, ref)
    snr = snr_db(out[:100], exact_f64(x, w, splits, M)[:100])
    assert snr >= SNR_FLOOR_DB, snr
    assert (out[100:] == 0).all()


def check_nan_stays_in_its_row(device):
    # SPEC §2: a NaN in x propagates to its own output row only (its code is e4m3's NaN 0x7F, its
    # block's scale ignores it); rows of other experts and other rows of its tile stay exact.
    splits, M, K, N = [20, 12], 40, 200, 48
    x, w, _ = problem(splits, M, K, N, seed=2, device=device)
    x[5, 150] = float("nan")
    r = recipe("fp8_block")
    qa, qb = r.quantize(x, -1), r.quantize_weight(w)
    assert qa.codes[5, 150].view(torch.uint8) == 0x7F
    out = fp8_gemm(qa, qb, torch.tensor(splits, device=device), torch.float32)
    if device != "cpu":
        # The triton 3.9 interpreter widens e4m3 dot operands through its own fp16 conversion, which
        # reads 0x7F as 480, so only the GPU can check the NaN row itself.
        assert out[5].isnan().all()
    others = torch.ones(M, dtype=torch.bool, device=device)
    others[5] = False
    emu, mag = emulate(qa, qb, splits, M)
    bound = order_bound(K) if device == "cpu" else GPU_ORDER_BOUND
    assert ((out[others].double() - emu[others]).abs() <= bound * mag[others]).all()


@interpreted
def test_cpu_nan_stays_in_its_row():
    check_nan_stays_in_its_row("cpu")


@pytest.mark.gpu
def test_gpu_nan_stays_in_its_row():
    check_nan_stays_in_its_row("cuda")


@interpreted
def test_cpu_bad_splits_are_clamped():
    # device splits are never read on the host: negative → 0 rows, a sum past M truncated at M
    M, K, N = 48, 130, 40
    x, w, _ = problem([M, 0, 0], M, K, N, seed=3)
    r = recipe("fp8_block")
    qa, qb = r.quantize(x, -1), r.quantize_weight(w)
    out = fp8_gemm(qa, qb, torch.tensor([30, -7, 100]), torch.float32)
    emu, mag = emulate(qa, qb, [30, 0, 18], M)
    assert ((out.double() - emu).abs() <= order_bound(K) * mag).all()


# --- Hopper, offline ----------------------------------------------------------------------------------


# (id, EPILOGUE, GLU (two accumulators), config kind): every FP8 default of gemm.fp8_config
SM90_CASES = [
    ("plain", 1, False, "fc2"),
    ("fc1_glu", 0, True, "fc1"),
    ("fc2_dgrad", 2, True, "fc2_dgrad"),
]


@pytest.mark.skipif(not _triton_env.START_CHILD, reason="offline sm_90 compile: the CPU-only parent process")
@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("case", SM90_CASES, ids=[c[0] for c in SM90_CASES])
def test_compiles_for_hopper_without_spills(case, use_tma):
    # The FP8 GPU defaults compiled for sm_90 by this machine's triton (no GPU needed): FP8 wgmma in
    # the mainloop and no local-memory spills (triton 3.9).
    import _sm90
    from moemlp.kernels import gemm
    from moemlp.kernels.gemm import grouped

    name, epilogue, glu, kind = case
    if gemm.INTERPRET:
        pytest.skip("the interpreter's configs")
    cfg = gemm.fp8_config(kind, glu)
    if not use_tma:
        if glu and epilogue == 0:
            pytest.skip("FC1 with a GLU spills on the pointer fallback (99 local loads): odd K only")
        # the launcher's fallback tile for code rows that TMA cannot take (K % 16 != 0)
        cfg = dataclasses.replace(cfg, BM=64, BN=64, num_warps=8, num_stages=4)
    dot_k = 32  # e4m3 wgmma steps are 32 deep
    store_partial = epilogue == 2
    const = dict(
        EPILOGUE=epilogue,
        ACT=3 if glu else 0,
        GLU=glu,
        HAS_PROBS=True,
        HAS_BIAS=epilogue != 2,
        SCALE_BIAS=False,
        STORE_Z=epilogue != 1,
        STORE_PARTIAL=store_partial,
        BM=cfg.BM,
        BN=cfg.BN,
        BK=cfg.BK,
        GROUP_M=cfg.GROUP_M,
        E_BLOCK=16,
        INTERPRETED=False,
        DOT_PRECISION="tf32",
        USE_TMA=use_tma,
        B_KMAJOR=True,
        SUBTILE=cfg.SUBTILE,
        PROMOTE=store_partial,
        FP8=True,
        ACC_SCALE=False,
        B_SCALE_SCALAR=True,  # what the launcher picks for BN | 128 (and GLU blocks a multiple of BN)
        PAIRED=False,
    )
    ptr = {
        "a_ptr": "*fp8e4nv",
        "b_ptr": "*fp8e4nv",
        "out_ptr": "*fp32" if epilogue == 2 else "*bf16",
        "z_ptr": "*fp32",
        "h_ptr": "*bf16",
        "splits_ptr": "*i64",
        "probs_ptr": "*fp32",
    }
    desc = {"a_desc": f"tensordesc<fp8e4nv[{cfg.BM}, 128]>", "b_desc": f"tensordesc<fp8e4nv[1, {cfg.BN}, 128]>"}
    ptx, sass, usage = _sm90.compile_sm90(
        grouped.grouped_gemm_kernel, const, ptr, desc if use_tma else None, cfg.num_warps, cfg.num_stages
    )
    # (64×64 at 8 warps splits N over the two warpgroups: m64n32)
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k{dot_k}\.f32\.e4m3\.e4m3", ptx)
    assert "LDL" not in sass, "local-memory loads: the accumulator spilled"
    assert re.search(r"STACK:0\b", usage), usage


# --- the GPU ----------------------------------------------------------------------------------------

# On Hopper the 128-deep partial is the FP8 tensor cores' own accumulation, which keeps about 14
# bits (DeepSeek-V3 §3.3.2; the reason for promoting every 128): a chain of four 32-deep wgmma
# steps, each aligned to ~2^-13 of the running magnitude, errs by ≤ 4·2^-13 = 2^-11 of Σ|terms|
# per block; the bound below takes 2× that. Not yet measured: the first GPU run records
# max(err / (|A|@|B|ᵀ)) and the relative RMS difference here, and tightens the bound.
GPU_ORDER_BOUND = 2.0**-10
GPU_CASES = [
    # (id, splits, capacity rows, K, N): mixtral-like FC1 slice; gpt-oss-like odd sizes with E prime
    ("mixtral_like", [700, 0, 512, 1300, 33, 900, 400, 251], 64, 4096, 3584),
    ("odd_sizes", [300, 0, 257, 129, 1, 500, 220, 0, 90, 311, 64, 17, 128], 100, 2880 + 40, 2880 + 72),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_matches_emulation(case):
    from moemlp.kernels import quant
    from moemlp.kernels.gemm import GemmConfig

    _, splits, cap, K, N = case
    M = sum(splits) + cap
    x, w, bias = problem(splits, M, K, N, device="cuda", bias=True)
    r = recipe("fp8_block")
    qa, qb = r.quantize(x, -1), r.quantize_weight(w)
    sp = torch.tensor(splits, device="cuda")
    emu, mag = emulate(qa, qb, splits, M, bias)
    # the default (TMA), the pointer mainloop, and a smaller tile
    configs = (
        None,
        GemmConfig(128, 128, 128, 8, 4, USE_TMA=False),
        GemmConfig(64, 128, 128, 4, 4),
    )
    for cfg in configs:
        out = fp8_gemm(qa, qb, sp, torch.float32, bias=bias, config=cfg)
        err = (out.double() - emu).abs()
        ratio = float((err / mag.clamp(min=1e-300)).max())
        rel_rms = float(err.pow(2).sum().sqrt() / emu.pow(2).sum().sqrt())
        print(f"{case[0]} {cfg}: max err/(|A||B|) = {ratio:.3e}, relative RMS vs emulation = {rel_rms:.3e}")
        assert ratio <= GPU_ORDER_BOUND, ratio
    out = fp8_gemm(qa, qb, sp, torch.float32, bias=bias)
    assert (out[sum(splits) :] == 0).all()
    # the recipe's accuracy, on the same GEMM without bias (Gaussian rows)
    xg = torch.randn_like(x)
    lin = fp8_gemm(quant.quantize(xg, r, axis=-1), quant.quantize_weight(w, r), sp, torch.float32)
    T = sum(splits)
    assert snr_db(lin[:T], exact_f64(xg, w, splits, M)[:T]) >= SNR_FLOOR_DB
    # bf16 output: the same accumulator, one rounding
    out_bf16 = fp8_gemm(qa, qb, sp, torch.bfloat16, bias=bias)
    assert torch.equal(out_bf16, out.bfloat16())
    # deterministic: no atomics, fixed order
    assert torch.equal(fp8_gemm(qa, qb, sp, torch.float32, bias=bias), out)
