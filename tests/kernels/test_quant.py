"""The Triton quantizers (kernels/quant/) against the torch reference (moemlp.recipes): codes
and scales bit for bit, rowwise, columnwise, 128×128 tiles and expert-segmented wgrad operands.

Without a GPU the kernels run under TRITON_INTERPRET=1 in a child process: triton reads the
variable when a kernel is first decorated, and setting it in this process would switch every later
test's kernels onto the interpreter too.
"""

from __future__ import annotations

import pytest
import torch

import _triton_env
from moemlp.recipes import from_key, recipe

RECIPES = [
    "fp8_block:pow2_scales=1",
    "fp8_block:pow2_scales=0",
    "mxfp8",
    "nvfp4:hadamard=0,stochastic_rounding=0",
]
WGRAD_RECIPES = RECIPES + [
    "nvfp4:hadamard=1,stochastic_rounding=0",
    "nvfp4:hadamard=0,stochastic_rounding=1",
    "nvfp4:hadamard=1,stochastic_rounding=1",
]

# Under the interpreter nvfp4's Hadamard / stochastic-rounding variants of the wgrad operands run from one
# source dtype each, the two dtypes between them: the dtype changes only the load, which plain nvfp4 and
# every other recipe check from both, and the rotation and the rounding run after it on fp32 values.
# The GPU runs every pair. (test_dequantized.py's wgrad test takes the same pairs.)
INTERPRETED_WGRAD_DTYPE = {
    "nvfp4:hadamard=1,stochastic_rounding=0": torch.bfloat16,
    "nvfp4:hadamard=0,stochastic_rounding=1": torch.float32,
    "nvfp4:hadamard=1,stochastic_rounding=1": torch.bfloat16,
}

# Exact ties of each format, placed in blocks whose scale is 1: e4m3 midpoints (normal and
# subnormal) next to 448 (fp8_block, mxfp8: scale 1), e2m1 midpoints next to 6 (nvfp4 with S_enc 1
# from an element 2688 in a block of its own).
E4M3_TIES = [448.0, 1.0625, 1.1875, -2.125, 2.0**-10, 3 * 2.0**-10, -5 * 2.0**-10, 0.0146484375, 464.0, -0.0]
E2M1_TIES = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0, 0.1, -0.0, 0.0, 2.0, 4.0]


def _data(shape, dtype, seed):
    """Normal values at a random magnitude per row (1e-30 … 1e30), with zero rows, NaN, ±Inf and
    fp32 subnormals sprinkled in; rounded to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    exps = torch.randint(-30, 31, shape[:-1] + (1,), generator=g).double()
    if dtype != torch.float32:
        exps = exps.clamp(-3, 3)  # stay inside bf16/fp16 range
    x = (x * 10.0**exps).to(dtype)
    flat = x.view(-1)
    n = flat.numel()
    if n == 0:
        return x
    for v, k in ((float("nan"), 2), (float("inf"), 1), (float("-inf"), 1), (0.0, 5)):
        flat[torch.randint(0, n, (k,), generator=g)] = v
    # NaNs with the sign bit set, written as bits (a float fill drops the sign in bf16 and fp16)
    ints, neg_nan = {torch.float32: (torch.int32, -0x400000), torch.bfloat16: (torch.int16, -0x40),
                     torch.float16: (torch.int16, -0x200)}[dtype]  # fmt: skip
    flat.view(ints)[torch.randint(0, n, (2,), generator=g)] = neg_nan
    if dtype == torch.float32:
        flat[torch.randint(0, n, (3,), generator=g)] = 1e-40
    return x


def _ties(dtype):
    x = torch.zeros(4, 48, dtype=torch.float32)
    x[0, : len(E4M3_TIES)] = torch.tensor(E4M3_TIES)
    x[1, :16] = torch.tensor(E2M1_TIES)
    x[1, 40] = 2688.0
    x[2, 32:48] = torch.tensor(E2M1_TIES) * 2.0**-3
    return x.to(dtype)


def _u8(t):
    return t if t.dtype == torch.float32 else t.view(torch.uint8)


def _same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(_u8(a).cpu(), _u8(b).cpu()), what


def check_quantizers_match_torch(device: str, big: bool = False, keys=RECIPES) -> None:
    from moemlp.kernels.quant import api as kq

    shapes = [(37, 70), (3, 40, 33), (1, 1), (130, 129), (0, 40), (2, 0, 16)]  # empty ones: an EP rank's zero tokens
    if big:
        shapes += [(1000, 1030), (4, 384, 640)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    for key in keys:
        r = from_key(key)
        for dtype in dtypes:
            inputs = [_data(s, dtype, seed) for seed, s in enumerate(shapes)] + [_ties(dtype)]
            for x in inputs:
                xd = x.to(device)
                for axis in (-1, -2):
                    what = f"{key} {dtype} {tuple(x.shape)} axis {axis}"
                    a, b = kq.quantize(xd, r, axis), r.quantize(x, axis)
                    _same(a.codes, b.codes, what + " codes")
                    _same(a.scales, b.scales, what + " scales")
                    if b.tensor_scale is not None:
                        _same(a.tensor_scale, b.tensor_scale, what + " S_enc")
                    deq = a.dequantize().cpu()
                    assert torch.equal(deq.nan_to_num(7.0), b.dequantize().nan_to_num(7.0)), what
                a, b = kq.quantize_weight(xd, r), r.quantize_weight(x)
                what = f"{key} {dtype} {tuple(x.shape)} weight"
                _same(a.codes, b.codes, what + " codes")
                _same(a.scales, b.scales, what + " scales")
                if r.name == "fp8_block":  # the dgrad's K-major copy, stored by the same tile kernel
                    at = kq.quantize_weight(xd, r, transposed=True)
                    _same(at.codes, b.codes, what + " codes (transposed launch)")
                    _same(at.scales, b.scales, what + " scales (transposed launch)")
                    _same(at.codes_t, b.codes.transpose(-2, -1).contiguous(), what + " codes_t")
                    assert at.codes_t.is_contiguous(), what


def check_wgrad_matches_torch(device: str, big: bool = False, keys=WGRAD_RECIPES) -> None:
    from moemlp.kernels.quant import api as kq

    cases = [([40, 0, 7, 150], 5, 24), ([16, 16], 0, 48), ([3], 2, 20), ([0, 0], 0, 24)]  # the last: no rows at all
    if big:
        cases += [([1000, 0, 37, 2048, 500], 64, 512)]
    for key in keys:
        r = from_key(key)
        for seed, (splits, capacity, K) in enumerate(cases):
            T = sum(splits) + capacity
            for dtype in (torch.float32, torch.bfloat16):
                if device == "cpu" and INTERPRETED_WGRAD_DTYPE.get(key, dtype) != dtype:
                    continue
                grad = _data((T, K), dtype, 10 + seed)
                act = _data((T, K + 8), dtype, 20 + seed)
                s = torch.tensor(splits, dtype=torch.int32)
                for t, is_grad in ((grad, True), (act, False)):
                    what = f"{key} {dtype} splits {splits} {'grad' if is_grad else 'act'}"
                    a = kq.quantize_wgrad(t.to(device), s.to(device), r, is_grad=is_grad)
                    b = r.quantize_wgrad(t, s, is_grad=is_grad)
                    _same(a.codes, b.codes, what + " codes")
                    _same(a.scales, b.scales, what + " scales")
                    assert torch.equal(a.rows.cpu(), b.rows), what + " rows"
                    if b.tensor_scale is not None:
                        _same(a.tensor_scale, b.tensor_scale, what + " S_enc")
                    deq = a.dequantize().cpu().nan_to_num(7.0)
                    assert torch.equal(deq, b.dequantize().nan_to_num(7.0)), what
                    # one row-block layout shared by a backward's operands gives the same bits
                    blocks = kq.row_blocks(s.to(device), T, r.block)
                    ab = kq.quantize_wgrad(t.to(device), s.to(device), r, is_grad=is_grad, blocks=blocks)
                    _same(ab.codes, b.codes, what + " codes (shared row blocks)")
                    _same(ab.scales, b.scales, what + " scales (shared row blocks)")
                    if r.name != "nvfp4":  # the fp8 wgrad GEMM's K-major operand, from the same tiles
                        at = kq.quantize_wgrad(
                            t.to(device), s.to(device), r, is_grad=is_grad, transposed=True, blocks=blocks
                        )
                        _same(at.codes, b.codes, what + " codes (transposed launch)")
                        _same(at.codes_t, b.codes.t().contiguous(), what + " codes_t")
                ref_g, ref_a = r.qdq_wgrad(grad, act, s)  # the contract's call is these two, dequantized
                assert torch.equal(ref_g.nan_to_num(7.0), r.quantize_wgrad(grad, s, True).dequantize().nan_to_num(7.0))


def _run_interpreted(check: str) -> None:
    _triton_env.run_check_interpreted(__file__, check, "cpu", timeout=300)


@pytest.mark.interpreter_child(seconds=36)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests below cover it")
def test_quantizers_match_torch_interpreted():
    _run_interpreted("check_quantizers_match_torch")


@pytest.mark.interpreter_child(seconds=46)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests below cover it")
def test_wgrad_quantizer_matches_torch_interpreted():
    _run_interpreted("check_wgrad_matches_torch")


# One case per recipe, so that the device sweep can spread them over processes (each recipe and
# dtype compiles its own kernels; together they ran past a 150 s limit on a cold H200).
@pytest.mark.long(seconds=70)
@pytest.mark.gpu
@pytest.mark.parametrize("key", RECIPES)
def test_quantizers_match_torch_gpu(key):
    check_quantizers_match_torch("cuda", big=True, keys=[key])


@pytest.mark.long(seconds=70)
@pytest.mark.gpu
@pytest.mark.parametrize("key", WGRAD_RECIPES)
def test_wgrad_quantizer_matches_torch_gpu(key):
    check_wgrad_matches_torch("cuda", big=True, keys=[key])


@pytest.mark.long(seconds=40)
@pytest.mark.gpu
def test_wgrad_quantizer_at_a_model_shape_gpu():
    """The wgrad operand passes as a backward launches them (transposed codes, shared row blocks) at
    qwen3-30b-a3b's x, 32768 x 2048 bf16 over 128 experts: the tile grid of a real step, which the
    small cases above do not reach: a miscompiled variant passed those and got a quarter of these
    codes wrong (docs/DECISIONS.md, "Rejected: e4m3 codes with the NaN sign OR-ed in")."""
    from moemlp.bench.common import GPU_SHAPES, routed_problem
    from moemlp.kernels.quant import api as kq

    x, splits = routed_problem(GPU_SHAPES["qwen3-30b-a3b"], "cuda")[:2]
    for key in ("fp8_block", "mxfp8"):
        r = from_key(key)
        blocks = kq.row_blocks(splits, x.shape[0], r.block)
        a = kq.quantize_wgrad(x, splits, r, transposed=True, blocks=blocks)
        b = r.quantize_wgrad(x.cpu(), splits.cpu())
        _same(a.codes_t, b.codes.t().contiguous(), f"{key} codes_t")
        _same(a.scales, b.scales, f"{key} scales")


@pytest.mark.long(seconds=60)
@pytest.mark.gpu
def test_weight_quantizer_at_a_model_shape_gpu():
    """fp8_block's weight tile kernel with the dgrad's K-major copy (``transposed=True``) at
    qwen3-30b-a3b's two weights, fp32 and bf16 masters: the grid of a real step, past the small
    cases above, where a variant without the select before the store wrote wrong transposed codes
    (docs/DECISIONS.md, "the bare conversion")."""
    from moemlp.bench.common import GPU_SHAPES, routed_problem
    from moemlp.kernels.quant import api as kq

    w1, w2 = routed_problem(GPU_SHAPES["qwen3-30b-a3b"], "cuda", dtype=torch.float32)[3:5]
    r = from_key("fp8_block")
    for name, w in (("fc1", w1), ("fc2", w2)):
        for dtype in (torch.float32, torch.bfloat16):
            wd = w.to(dtype)
            a, b = kq.quantize_weight(wd, r, transposed=True), r.quantize_weight(wd.cpu())
            what = f"{name} {tuple(w.shape)} {dtype}"
            _same(a.codes, b.codes, what + " codes")
            _same(a.scales, b.scales, what + " scales")
            _same(a.codes_t, b.codes.transpose(-2, -1).contiguous(), what + " codes_t")
            del a, b, wd


def test_launcher_rejects_bad_inputs():
    from moemlp.kernels.quant import api as kq

    with pytest.raises(ValueError, match="transposed"):
        kq.quantize_weight(torch.zeros(2, 4, 6), recipe("mxfp8"), transposed=True)
    with pytest.raises(ValueError, match="transposed"):
        kq.quantize_wgrad(torch.zeros(4, 6), torch.tensor([4]), recipe("nvfp4"), transposed=True)
    r = recipe("mxfp8")
    s = torch.tensor([3, 5])

    def blocks(T, B):  # a CPU RowBlocks without a kernel launch (row_blocks needs the GPU or the interpreter)
        return kq.RowBlocks(*_row_blocks_oracle([3, 5], T, B), B)

    with pytest.raises(ValueError, match="blocks: made for 8 rows in 128-row blocks"):
        kq.quantize_wgrad(torch.zeros(8, 6), s, r, blocks=blocks(8, 128))
    with pytest.raises(ValueError, match="blocks: made for 9 rows"):
        kq.dequantized_wgrad(torch.zeros(8, 6), s, r, out_dtype=torch.float32, blocks=blocks(9, 32))
    with pytest.raises(TypeError, match="blocks: expected a RowBlocks"):
        kq.quantize_wgrad(torch.zeros(8, 6), s, r, blocks=tuple(blocks(8, 32))[:4])
    with pytest.raises(TypeError, match="x"):
        kq.quantize(torch.zeros(4, 4, dtype=torch.float64), r)
    with pytest.raises(ValueError, match="contiguous"):
        kq.quantize(torch.zeros(4, 6)[:, ::2], r)
    with pytest.raises(ValueError, match="axis"):
        kq.quantize(torch.zeros(2, 4, 6), r, axis=0)


def _row_blocks_oracle(splits, T: int, B: int):
    """The row-block table of ``kq.row_blocks`` in torch ops on CPU int64, written from its docstring
    (the formulation the kernel replaced): (start, count, rows, NB)."""
    s = torch.tensor(splits, dtype=torch.int64).clamp(0, T)
    E = s.numel()
    nb = -(-T // B) + E
    cum = torch.cumsum(s, 0)
    ends, starts = cum.clamp(max=T), (cum - s).clamp(max=T)
    s = ends - starts
    blocks = (s + B - 1) // B
    first = torch.cumsum(blocks, 0) - blocks
    p = torch.arange(nb)
    e = torch.searchsorted(first + blocks, p, right=True)
    ec = e.clamp(max=E - 1)
    start = starts[ec] + (p - first[ec]) * B
    valid = e < E
    count = torch.where(valid, (ends[ec] - start).clamp(0, B), 0)
    start = torch.where(valid, start, s.sum() + (p - blocks.sum()) * B)
    t = torch.arange(T)
    et = torch.searchsorted(ends, t, right=True)
    etc = et.clamp(max=E - 1)
    rows = torch.where(et < E, first[etc] * B + t - starts[etc], -1)
    return start, count.to(torch.int32), rows, nb


ROW_BLOCK_CASES = [
    ([700, 700], 1000, 128),  # a sum past T: the gluon fp8_wgrad GPU case
    ([-5, 400, 900, 3], 1000, 128),  # negative, then past T
    ([40, 0, 7, 150], 202, 128),  # capacity rows past Σsplits
    ([0, 0], 0, 128),  # no rows at all
    ([3], 5, 32),
    ([256] * 128, 32768, 128),  # qwen3's shape
    ([17, 0, 33] * 100, 5000, 16),  # 300 experts (a 512-wide table, 8 indices a program)
    ([16] * 64, 1000, 32),  # the narrowest table on one warp (64 wide, 8 indices a program)
    ([5, 0, 9] * 200, 3000, 32),  # 600 experts: a 1024-wide table, back on four warps (4 indices)
]
# The interpreter runs a program in ~3 ms: the cases above with thousands of rows took ~50 s of its
# ~70 there, so it takes the others and the 300- and 600-expert tables over fewer rows instead.
INTERPRETED_ROW_BLOCK_CASES = [c for c in ROW_BLOCK_CASES if c[1] <= 1000] + [
    ([17, 0, 33] * 100, 600, 16),
    ([5, 0, 9] * 200, 600, 32),
]


def check_row_blocks(device: str) -> None:
    from moemlp.kernels.quant import api as kq

    g = torch.Generator().manual_seed(0)
    cases = (ROW_BLOCK_CASES if device == "cuda" else INTERPRETED_ROW_BLOCK_CASES) + [
        (torch.randint(-3, 60, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist(), T, B)
        for T, B in ((500, 128), (700, 32), (999, 16))
    ]
    for splits, T, B in cases:
        for dtype in (torch.int32, torch.int64):
            got = kq.row_blocks(torch.tensor(splits, dtype=dtype, device=device), T, B)
            want = _row_blocks_oracle(splits, T, B)
            assert got.nb == want[3] and got.block == B, (splits, T, B)
            for name, a, b in zip(("start", "count", "rows"), tuple(got)[:3], want[:3]):
                assert a.dtype == b.dtype and torch.equal(a.cpu(), b), (name, splits[:8], T, B, dtype)


@pytest.mark.interpreter_child(seconds=8)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below covers it")
def test_row_blocks_match_the_torch_formulation_interpreted():
    _run_interpreted("check_row_blocks")


@pytest.mark.gpu
def test_row_blocks_match_the_torch_formulation_gpu():
    check_row_blocks("cuda")


def check_tensor_amaxes(device: str) -> None:
    """kq.tensor_amaxes: the amax of all of x and of its rows below Σsplits (clamped as row_blocks
    clamps them), NaN ignored, equal to torch's and to the amax nvfp4's wgrad pass takes of the same
    rows; a given amax gives dequantized and dequantized_wgrad the bits of their own amax pass."""
    from moemlp.kernels.quant import api as kq

    r = from_key("nvfp4:hadamard=0,stochastic_rounding=0")
    g = torch.Generator().manual_seed(3)
    cases = [
        ([3, 5], 10),  # capacity rows past Σsplits, holding the largest values
        ([-5, 20, 9], 20),  # negative, then a sum past T
        ([0, 0], 12),  # nothing routed: the routed amax is 0
        ([], 6),  # no experts
        ([4], 0),  # no rows
    ]
    for splits, T in cases:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(T, 48, generator=g).to(dtype)
            s = torch.tensor(splits, dtype=torch.int64)
            rows = min(int(s.clamp(min=0, max=T).sum()), T)
            x[rows:] *= 100.0  # the rows past Σsplits hold the largest magnitudes
            if rows:
                x[rows - 1, 7] = float("nan")  # ignored
            a = x.float().abs().nan_to_num(0.0)
            want_all = a.max() if T else torch.tensor(0.0)
            want_routed = a[:rows].max() if rows else torch.tensor(0.0)
            xd, sd = x.to(device), s.to(device)
            got_all, got_routed = kq.tensor_amaxes(xd, sd)
            what = (splits, T, dtype)
            assert got_all.shape == got_routed.shape == () and got_all.dtype == torch.float32, what
            assert torch.equal(got_all.cpu(), want_all) and torch.equal(got_routed.cpu(), want_routed), what
            assert torch.equal(kq.tensor_amax(xd).cpu(), want_all), what
            assert torch.equal(kq.routed_amax(xd, sd).cpu(), want_routed), what
            # the wgrad pass's own amax of the same rows: what the backward would compute
            pass_amax = kq._wgrad_launch(xd, sd, r, False, None)[3]
            assert torch.equal(pass_amax.cpu(), want_routed), what
            for given in (False, True):
                v, f = kq.dequantized_wgrad(xd, sd, r, out_dtype=torch.float32, amax=got_routed if given else None)
                vq, fq = kq.dequantized(xd, r, out_dtype=torch.float32, amax=got_all if given else None)
                if not given:
                    base = (v, f, vq, fq)
                    continue
                for name, a_, b_ in zip(("wgrad values", "wgrad factor", "values", "factor"), (v, f, vq, fq), base):
                    assert torch.equal(a_.cpu().nan_to_num(7.0), b_.cpu().nan_to_num(7.0)), (name, *what)


@pytest.mark.interpreter_child(seconds=6)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below covers it")
def test_tensor_amaxes_interpreted():
    _run_interpreted("check_tensor_amaxes")


@pytest.mark.gpu
def test_tensor_amaxes_gpu():
    check_tensor_amaxes("cuda")


def test_given_amax_rejected_where_not_read():
    from moemlp.kernels import operands
    from moemlp.kernels.quant import api as kq

    x, s = torch.zeros(8, 32), torch.tensor([3, 5])
    nv = from_key("nvfp4:hadamard=0,stochastic_rounding=0")
    blocks = kq.RowBlocks(*_row_blocks_oracle([3, 5], 8, 16), 16)
    with pytest.raises(ValueError, match="amax: only nvfp4"):
        kq.dequantized(x, recipe("mxfp8"), out_dtype=torch.float32, amax=torch.tensor(1.0))
    with pytest.raises(ValueError, match="amax: expected a 0-d float32 tensor"):
        kq.dequantized(x, nv, amax=torch.ones(1))
    with pytest.raises(ValueError, match="amax: expected a 0-d float32 tensor"):
        kq.dequantized(x, nv, amax=torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="amax: only nvfp4"):
        kq.dequantized_wgrad(x, s, from_key("nvfp4:hadamard=1,stochastic_rounding=0"), out_dtype=torch.float32,
                             blocks=blocks, amax=torch.tensor(1.0))  # fmt: skip
    with pytest.raises(ValueError, match="x_amax"):
        operands.wgrad(x, x, s, recipe("mxfp8"), dtype=torch.bfloat16, dw_dtype=torch.float32,
                       x_amax=torch.tensor(1.0))  # fmt: skip
    with pytest.raises(ValueError, match="x_amax"):
        operands.wgrad(x, None, s, nv, dtype=torch.bfloat16, dw_dtype=torch.float32, x_amax=torch.tensor(1.0))


@pytest.mark.parametrize(
    "splits, clamped",
    [
        pytest.param([700, 700], [700, 300], id="sum-past-T"),  # the gluon fp8_wgrad GPU case
        pytest.param([-5, 400, 900, 3], [0, 400, 600, 0], id="negative-then-past-T"),
    ],
)
def test_row_blocks_clamp_splits_as_the_kernels_do(splits, clamped):
    """Splits that are negative or sum past T give the blocks of the splits the GEMM kernels clamp
    them to: no block reads a source row past T (the quantizer's loads are masked by the block's
    count alone) and the blocks the kernels read are the ones written (the oracle of the kernel's
    table, checked against it above)."""
    T = 1000
    got = _row_blocks_oracle(splits, T, 128)
    want = _row_blocks_oracle(clamped, T, 128)
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)
    start, count = got[0], got[1].to(torch.int64)
    used = count > 0  # an unused block (count 0) holds the rows past Σsplits that a dequantizing pass zeroes
    assert int((start + count)[used].max()) <= T and int(count.sum()) == sum(clamped)


@pytest.mark.parametrize("rid,uses_hw", [(0, True), (1, True), (2, False)])
def test_e4m3_rounding_on_hopper_is_the_hardware_conversion_but_for_nvfp4(rid, uses_hw):
    # Offline sm_90 compile (no GPU): fp8_block's and mxfp8's element codes round with
    # cvt.rn.satfinite.e4m3x2.f32 (half the instructions of the integer path), nvfp4's
    # block scales keep the integer path (kernels/quant/, e4m3_code_integer).
    import _sm90
    from moemlp.kernels.quant import formats, kernels

    if not getattr(formats.HW_E4M3, "value", formats.HW_E4M3):
        pytest.skip("the interpreter's integer path")
    const = dict(RECIPE=rid, AXIS=1, BM=32, BK=128, NB=128 // (128, 32, 16)[rid], POW2=True, VMAX=3.0e38,
                 DEQUANT=False, STORE_T=False)  # fmt: skip
    ptr = {"x_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*fp32" if rid == 0 else "*u8", "amax_ptr": "*fp32",
           "codes_t_ptr": "*u8"}  # fmt: skip
    ptx, _, _ = _sm90.compile_sm90(kernels._quantize_kernel, const, ptr, None, 4, 1)
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == uses_hw


@pytest.mark.parametrize("rid", [1, 2], ids=["mxfp8", "nvfp4"])
def test_columnwise_dequantize_tile_keeps_its_values_in_registers(rid):
    # Offline sm_90 compile (no GPU): the columnwise dequantize pass (the weights' dgrad operands of
    # an emulated step) at its recipe's tile, api.COL_TILE[block], with no spill to local memory.
    import re

    import _sm90
    from moemlp.kernels.quant import api, formats, kernels

    if not getattr(formats.HW_E4M3, "value", formats.HW_E4M3):
        pytest.skip("the interpreter's integer path")
    block = (128, 32, 16)[rid]
    bk, warps = api.COL_TILE[block]
    const = dict(RECIPE=rid, AXIS=0, BM=block // 2 if rid == 2 else block, BK=bk, NB=1, POW2=True, VMAX=3.0e38,
                 DEQUANT=True, STORE_T=False)  # fmt: skip
    ptr = {"x_ptr": "*bf16", "codes_ptr": "*bf16", "scales_ptr": "*fp32", "amax_ptr": "*fp32", "codes_t_ptr": "*bf16"}
    _, sass, usage = _sm90.compile_sm90(kernels._quantize_kernel, const, ptr, None, warps, 1)
    assert not re.search(r"\b(STL|LDL)\b", sass), f"registers spill to local memory ({usage.strip()})"


def test_fp8_block_scale_divisions_have_no_slow_path_call():
    # Offline sm_90 compile (no GPU): fp8_block's two scale divisions (448/amax, 1/scale) are written
    # out (formats.div_448, rcp_rn), not div.rn.f32, whose slow-path call took the quantizers to
    # 101-128 registers on triton 3.6; the bits are checked on every fp32 by the GPU test below.
    import re

    import _sm90
    from moemlp.kernels.quant import api, formats, kernels

    if not getattr(formats.HW_E4M3, "value", formats.HW_E4M3):
        pytest.skip("the interpreter's division")
    ptrs = {"x_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*fp32", "amax_ptr": "*fp32", "codes_t_ptr": "*u8",
            "row_start_ptr": "*i64", "row_count_ptr": "*i32", "rows_ptr": "*bf16"}  # fmt: skip
    rowwise = dict(RECIPE=0, AXIS=1, BM=32, BK=128, NB=1, POW2=False, VMAX=3.0e38, DEQUANT=False, STORE_T=False)
    wgrad = dict(RECIPE=0, B=128, BK=32, POW2=False, VMAX=3.0e38, HADAMARD=False, STOCHASTIC=False, AMAX_ONLY=False,
                 DEQUANT=False, STORE_T=True, STORE_ROWS=False, ROWS=False)  # fmt: skip
    # the default wgrad tile (api.WGRAD_TILE[128]) is wider: few enough registers that four CTAs of
    # its warps share an SM's 65536
    bk, warps = api.WGRAD_TILE[128]
    cases = [(kernels._quantize_kernel, rowwise, 4, 72), (kernels._wgrad_kernel, wgrad, 4, 72),
             (kernels._wgrad_kernel, {**wgrad, "BK": bk}, warps, 65536 // (4 * 32 * warps))]
    for kernel, const, num_warps, max_regs in cases:
        names = set(kernel.arg_names)
        ptx, sass, usage = _sm90.compile_sm90(kernel, const, {k: v for k, v in ptrs.items() if k in names}, None,
                                              num_warps, 1)  # fmt: skip
        assert "div.rn.f32" not in ptx and "CALL.REL" not in sass
        assert not re.search(r"\b(STL|LDL)\b", sass), "registers spill to local memory"
        assert int(re.search(r"REG:(\d+)", usage).group(1)) <= max_regs, usage


@pytest.mark.gpu
def test_fp8_block_scale_divisions_are_ieee_on_every_fp32_gpu():
    # formats.div_448 (448/amax) and rcp_rn (1/scale) against tl.div_rn, bit for bit: div_448 on
    # every non-negative fp32 bit pattern (0, subnormals, Inf, NaNs: NaN for NaN), rcp_rn on every
    # positive normal one (its domain: fp8_block's scales).
    import triton
    import triton.language as tl

    from moemlp.kernels.quant import formats

    @triton.jit
    def divisions(bad_ptr, first_ptr, N: tl.constexpr):
        pid = tl.program_id(0)
        bits = (pid.to(tl.int64) * N + tl.arange(0, N)).to(tl.int32)
        v = bits.to(tl.float32, bitcast=True)
        got = formats.div_448(v)
        want = tl.div_rn(448.0 + tl.zeros_like(v), v)
        bad = (got.to(tl.int32, bitcast=True) != want.to(tl.int32, bitcast=True)) & ~((got != got) & (want != want))
        normal = (bits >= 0x00800000) & (bits < 0x7F800000)
        got = formats.rcp_rn(tl.where(normal, v, 1.0))
        want = tl.div_rn(1.0 + tl.zeros_like(v), tl.where(normal, v, 1.0))
        bad |= normal & (got.to(tl.int32, bitcast=True) != want.to(tl.int32, bitcast=True))
        tl.store(bad_ptr + pid, tl.sum(bad.to(tl.int32), axis=0))
        tl.store(first_ptr + pid, tl.min(tl.where(bad, bits, 0x7FFFFFFF), axis=0))

    N = 8192
    grid = 2**31 // N
    bad = torch.empty(grid, dtype=torch.int32, device="cuda")
    first = torch.empty(grid, dtype=torch.int32, device="cuda")
    divisions[(grid,)](bad, first, N=N)
    examples = [f"{int(b):#010x}" for b in first[bad > 0][:8].tolist()]
    assert int(bad.sum()) == 0, f"{int(bad.sum())} bit patterns differ, the first ones at {examples}"
