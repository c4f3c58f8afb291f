"""The one-pass Triton quantize-dequantize (kernels/quant/: ``dequantized``, ``dequantized_weight``,
``dequantized_wgrad``) against the torch reference: ``values.float() * factor`` must equal
``recipe.qdq`` / ``qdq_weight`` / ``qdq_wgrad`` bit for bit (same NaN positions, same fp32 bits
elsewhere, so -0.0 counts), with ``values`` in the dtype that ``exact_dtype`` names.

Every kernel case runs with deterministic algorithms on, so ``torch.empty`` hands out NaN-filled
memory: an output element the kernel forgets to write (a masked tail, a row past Σsplits) fails.

On a CPU-only machine the kernel cases run on small shapes under TRITON_INTERPRET=1 in a child
pytest of this file (tests/_triton_env.py says why); on a GPU the same cases run on CUDA, at larger
shapes, plus CUDA-graph capture. The dtype checks need no kernel and run everywhere.
"""

from __future__ import annotations

import pytest
import torch
from test_quant import INTERPRETED_WGRAD_DTYPE, RECIPES, WGRAD_RECIPES, _data, _ties

import _triton_env
from moemlp.recipes import from_key, recipe

interpreted = pytest.mark.skipif(
    not _triton_env.RUN_CPU_CASES,
    reason="CPU cases: run under TRITON_INTERPRET=1 in the child of test_cpu_cases_under_interpreter",
)
DEVICES = [pytest.param("cpu", marks=interpreted, id="interp"), pytest.param("cuda", marks=pytest.mark.gpu, id="gpu")]
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16"),
]

# 1.75·2^-117 = 448·2^-125, fp32 0x05600000: the largest block amax at which mxfp8 (exponent 2) and
# fp8_block with power-of-two scales (scale 2^125) can write a value below bf16's grid (2^-133).
BF16_EXACT_ABOVE = 1.75 * 2.0**-117


@pytest.mark.interpreter_child(seconds=65)
@pytest.mark.skipif(not _triton_env.START_CHILD, reason="runs the CPU cases in a child on a CPU-only machine")
def test_cpu_cases_under_interpreter():
    _triton_env.run_file_interpreted(__file__)


@pytest.fixture
def nan_empty():
    """torch.empty returns NaN-filled memory while deterministic algorithms are on."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn_only)


def _contract(values, factor, out_dtype, device):
    assert values.dtype == out_dtype and values.device.type == device
    if factor is None:
        return values.float()
    assert factor.dtype == torch.float32 and factor.shape == () and factor.device.type == device
    return values.float() * factor


def _bitwise(got, ref, what):
    got = got.cpu()
    assert got.shape == ref.shape and ref.dtype == torch.float32, (what, got.shape, ref.shape)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan), what + ": NaN positions"
    bad = (got.view(torch.int32) != ref.view(torch.int32)) & ~nan
    assert not bad.any(), f"{what}: {int(bad.sum())} differ, e.g. {got[bad][:4].tolist()} vs {ref[bad][:4].tolist()}"


def _special(dtype, device):
    """Rows (and, read columnwise, blocks mixing them) that are all zero, all NaN, hold ±Inf, hold NaN
    among finite values, are multiples of the source dtype's smallest subnormal (tiny block amax:
    bf16 2^-133, fp16 2^-24, fp32 2^-149), or sit near its largest finite value.

    Not bf16 subnormals under the interpreter: triton 3.9's interpreter converts bf16 <-> fp32 with
    its own bit routine (interpreter._convert_float), which turns bf16 subnormals into wrong values
    in both directions (2^-133 loads as 0, 3·2^-133 as 2^-127); the GPU converts them exactly. The
    reference-only test_bf16_and_fp16_sources_dequantize_onto_bf16 covers them on CPU."""
    g = torch.Generator().manual_seed(7)
    fi = torch.finfo(dtype)
    x = torch.zeros(6, 64, dtype=torch.float64)
    x[1] = float("nan")
    x[2] = torch.randn(64, generator=g, dtype=torch.float64)
    x[2, 3], x[2, 40] = float("inf"), float("-inf")
    x[3] = torch.randn(64, generator=g, dtype=torch.float64)
    x[3, 5] = x[3, 50] = float("nan")
    if dtype != torch.bfloat16 or device != "cpu":
        x[4] = torch.randint(-9, 10, (64,), generator=g).double() * fi.smallest_normal * fi.eps  # smallest subnormal
    x[5] = torch.rand(64, generator=g, dtype=torch.float64) * fi.max
    return x.to(dtype)


def _inputs(dtype, device):
    shapes = [(37, 70), (3, 40, 33), (1, 1)] + ([(1000, 1030), (4, 384, 640)] if device == "cuda" else [])
    return [_data(s, dtype, seed) for seed, s in enumerate(shapes)] + [_ties(dtype), _special(dtype, device)]


@pytest.mark.long(seconds=40)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("key", RECIPES)
def test_dequantized_matches_qdq(device, dtype, key, nan_empty):
    """Rowwise and columnwise blocks of odd sizes, batched, a single element, format ties, NaN/Inf/
    zero blocks, tiny and huge blocks; in the exact dtype, and in fp32 (nvfp4 also fp16)."""
    from moemlp.kernels.quant import api as kq

    r = from_key(key)
    out_dtypes = {kq.exact_dtype(r, dtype), torch.float32}
    if r.name == "nvfp4":
        out_dtypes.add(torch.float16)
    for i, x in enumerate(_inputs(dtype, device)):
        for axis in (-1, -2):
            ref = r.qdq(x, axis)
            for out_dtype in sorted(out_dtypes, key=str) if i == 0 else [kq.exact_dtype(r, dtype)]:
                values, factor = kq.dequantized(x.to(device), r, axis, out_dtype=out_dtype)
                got = _contract(values, factor, out_dtype, device)
                _bitwise(got, ref, f"{key} {dtype} {tuple(x.shape)} axis {axis} -> {out_dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("key", RECIPES)
def test_dequantized_weight_matches_qdq_weight(device, dtype, key, nan_empty):
    """(E, A, B) expert weights, blocks along B (forward) and A (dgrad); fp8_block: 128×128 tiles
    with partial tiles in both dims, whatever the dim; one S_enc over all experts for nvfp4."""
    from moemlp.kernels.quant import api as kq

    r = from_key(key)
    out_dtype = kq.exact_dtype(r, dtype)
    shapes = [(2, 130, 70), (3, 20, 33)] + ([(8, 512, 384)] if device == "cuda" else [])
    for seed, shape in enumerate(shapes):
        w = _data(shape, dtype, 30 + seed)
        for dim in (-1, -2):
            values, factor = kq.dequantized_weight(w.to(device), r, dim, out_dtype=out_dtype)
            got = _contract(values, factor, out_dtype, device)
            _bitwise(got, r.qdq_weight(w, dim), f"{key} {dtype} {shape} dim {dim}")


# (splits, capacity rows past Σsplits, K), one comment each:
WGRAD_CASES = [
    ([40, 0, 7, 50], 5, 24),  # uneven experts, one with no rows, partial blocks, capacity rows
    ([16, 16], 0, 48),  # full nvfp4 Hadamard groups, no capacity
    ([3], 2, 20),  # one expert with fewer rows than any block
    ([130, 1], 3, 10),  # fp8_block: an expert over two 128-row blocks, then a single row
    ([0, 0], 6, 8),  # no expert has a row: every row is capacity and comes back 0
    ([0], 0, 8),  # no rows at all
]


# Under the interpreter the nvfp4 wgrad variants took 36 s of the child's 78 in both source dtypes: each
# runs from one source dtype there (test_quant.py's INTERPRETED_WGRAD_DTYPE says why), 14 s less; the
# GPU runs every pair.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [DTYPES[0], DTYPES[1]])
@pytest.mark.parametrize("key", WGRAD_RECIPES)
def test_dequantized_wgrad_matches_qdq_wgrad(device, dtype, key, nan_empty):
    """Both operands of qdq_wgrad(grad, act, splits): grad with is_grad=True (stochastic rounding when
    on), act with is_grad=False; Hadamard-rotated values where on; rows past Σsplits are 0."""
    from moemlp.kernels.quant import api as kq

    if device == "cpu" and INTERPRETED_WGRAD_DTYPE.get(key, dtype) != dtype:
        pytest.skip("under the interpreter nvfp4's Hadamard / stochastic-rounding variants run from one source dtype")
    r = from_key(key)
    out_dtype = kq.exact_dtype(r, dtype)
    cases = WGRAD_CASES + ([([1000, 0, 37, 2048, 500], 64, 512)] if device == "cuda" else [])
    for seed, (splits, capacity, K) in enumerate(cases):
        T = sum(splits) + capacity
        grad = _data((T, K), dtype, 40 + seed) if T else torch.zeros(0, K, dtype=dtype)
        act = _data((T, K + 8), dtype, 50 + seed) if T else torch.zeros(0, K + 8, dtype=dtype)
        if r.name == "nvfp4":  # _data's ±Inf give S_enc 1: one operand of each case finite, at its amax's S_enc
            finite = grad if seed % 2 == 0 else act
            finite.masked_fill_(finite.isinf(), 0.0)
        s = torch.tensor(splits, dtype=torch.int32)
        ref_g, ref_a = r.qdq_wgrad(grad, act, s)
        for t, is_grad, ref in ((grad, True, ref_g), (act, False, ref_a)):
            values, factor = kq.dequantized_wgrad(t.to(device), s.to(device), r, is_grad=is_grad, out_dtype=out_dtype)
            got = _contract(values, factor, out_dtype, device)
            what = f"{key} {dtype} splits {splits}+{capacity} {'grad' if is_grad else 'act'}"
            _bitwise(got, ref, what)
            assert not got[sum(splits) :].cpu().view(torch.int32).any(), what + ": rows past Σsplits not +0"


# K not a multiple of the 64-column tile or of the 32-wide block: a tile's last block is partial
BOTH_CASES = WGRAD_CASES + [([40, 0, 7, 50], 5, 70), ([3, 29], 2, 100)]


# mxfp8 (one values pass), and nvfp4 without the Hadamard option (one amax pass for both tensor
# amaxes, one values pass), also with stochastic rounding on the wgrad operand (is_grad)
BOTH_RECIPES = ["mxfp8", "nvfp4", "nvfp4:stochastic_rounding=1"]
# Under the interpreter each nvfp4 variant took 13-19 s a source dtype (two passes of two
# quantizations each, twice, for is_grad True and False); there each runs from one, the GPU all three.
INTERPRETED_BOTH_DTYPE = {"nvfp4": torch.float32, "nvfp4:stochastic_rounding=1": torch.bfloat16}


def _nvfp4_rows_of_routed_amax(t, routed):
    """nvfp4's rowwise qdq of all of t's rows with the S_enc of its first ``routed`` rows."""
    from moemlp.recipes import nvfp4 as N
    from moemlp.recipes._base import to_blocks

    xb, back = to_blocks(t, 1, N.BLOCK)
    return back(N.quantize_blocks(xb, N.tensor_scale(t[:routed]))[2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("key", BOTH_RECIPES)
def test_dequantized_both_is_the_two_passes(device, dtype, key, nan_empty):
    """The one-read passes: ``rows`` is qdq(t, -1) and ``wgrad`` the operand of qdq_wgrad (the
    gradient's where is_grad), bit for bit, rows past Σsplits included (there ``rows`` quantizes t's
    rows, ``wgrad`` is +0). Under nvfp4 both take the tensor amax of the rows below Σsplits, as the
    reference MLP quantizes only those rows (``rows`` is qdq(t[:Σsplits], -1) there, and a capacity
    row holding t's amax moves nothing); and both equal the separate passes' values and factors in
    the MLP's form, an fp32 source onto bf16 (tiny_blocks_exact=False)."""
    from moemlp.kernels.quant import api as kq

    if device == "cpu" and dtype != INTERPRETED_BOTH_DTYPE.get(key, dtype):
        pytest.skip("under the interpreter each nvfp4 variant's one-read passes run from one source dtype")
    r = from_key(key)
    nvfp4 = r.name == "nvfp4"
    cases = BOTH_CASES + ([([1000, 0, 37, 2048, 500], 64, 512)] if device == "cuda" else [])
    special = _special(dtype, device)  # NaN, ±Inf, tiny and huge rows: 6 rows, two experts
    for seed, (splits, capacity, K) in enumerate(cases + [([4, 1], 1, 64)]):
        T = sum(splits) + capacity
        t = special if K == 64 else (_data((T, K), dtype, 60 + seed) if T else torch.zeros(0, K, dtype=dtype))
        if nvfp4 and K != 64:
            # finite (an Inf amax gives S_enc 1), and a row past Σsplits holds t's amax, 3× the routed
            # rows': the rows' S_enc and the wgrad operand's differ by other than a power of two
            t = torch.where(t.isinf(), torch.zeros_like(t), t)
            if capacity and sum(splits):
                t[sum(splits), 0] = 3 * t[: sum(splits)].float().nan_to_num(0.0).abs().max()
        s = torch.tensor(splits, dtype=torch.int32)
        for is_grad in (True, False) if nvfp4 else (False,):
            what = f"{key} {dtype} splits {splits}+{capacity} K {K} {'grad' if is_grad else 'act'}"
            out_dtype = kq.exact_dtype(r, dtype)
            rows, rows_f, wg, wg_f = kq.dequantized_both(t.to(device), s.to(device), r, is_grad, out_dtype=out_dtype)
            assert (rows_f is None) == (wg_f is None) == (not nvfp4), what
            ref_g, ref_a = r.qdq_wgrad(t, t, s)
            ref_rows = _nvfp4_rows_of_routed_amax(t, sum(splits)) if nvfp4 else r.qdq(t, -1)
            _bitwise(_contract(rows, rows_f, out_dtype, device), ref_rows, what + " rows")
            if nvfp4:
                _bitwise(_contract(rows[: sum(splits)], rows_f, out_dtype, device), r.qdq(t[: sum(splits)], -1),
                         what + " routed rows")  # fmt: skip
                assert torch.equal(rows_f.view(torch.int32), wg_f.view(torch.int32)), what + " factors"
            _bitwise(_contract(wg, wg_f, out_dtype, device), ref_g if is_grad else ref_a, what + " wgrad")
            assert not wg[sum(splits) :].cpu().view(torch.int16 if out_dtype != torch.float32 else torch.int32).any()
            # the MLP's call: bf16 values whatever the source, as the separate kernels give them
            got = kq.dequantized_both(t.to(device), s.to(device), r, is_grad, out_dtype=torch.bfloat16,
                                      tiny_blocks_exact=False)  # fmt: skip
            routed_amax = kq.tensor_amaxes(t.to(device), s.to(device))[1] if nvfp4 else None
            one = kq.dequantized(t.to(device), r, -1, out_dtype=torch.bfloat16, tiny_blocks_exact=False,
                                 amax=routed_amax)  # fmt: skip
            two = kq.dequantized_wgrad(t.to(device), s.to(device), r, is_grad, out_dtype=torch.bfloat16,
                                       tiny_blocks_exact=False)  # fmt: skip
            for (v, f), (want_v, want_f), name in ((got[:2], one, "rows"), (got[2:], two, "wgrad")):
                assert v.dtype == torch.bfloat16 and torch.equal(v.view(torch.int16), want_v.view(torch.int16)), (
                    f"{what} {name}: bf16 bits differ from the separate pass's"
                )
                assert (f is None and want_f is None) or torch.equal(f.view(torch.int32), want_f.view(torch.int32)), (
                    f"{what} {name}: the factor differs from the separate pass's"
                )


def test_dequantized_both_refuses_other_recipes():
    from moemlp.kernels.quant import api as kq

    t, s = torch.zeros(4, 64, dtype=torch.bfloat16), torch.tensor([4])
    for key in ("nvfp4:hadamard=1", "fp8_block"):
        with pytest.raises(ValueError, match="mxfp8, or nvfp4 without the Hadamard option"):
            kq.dequantized_both(t, s, from_key(key))
    with pytest.raises(ValueError, match=r"2\^-133"):
        kq.dequantized_both(t.float(), s, recipe("mxfp8"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key", ["mxfp8", "fp8_block:pow2_scales=1"])
def test_bf16_exact_above_the_amax_boundary(device, key, nan_empty):
    """fp32 source, fp32 values: a block with amax one fp32 ulp above 1.75·2^-117 dequantizes onto
    bf16's grid whatever its elements; at 1.75·2^-117 an element 2^-134 comes back as 2^-134, which
    bf16 cannot hold (that is why exact_dtype is fp32 for fp32 sources)."""
    from moemlp.kernels.quant import api as kq

    r = from_key(key)
    B = r.block
    at = torch.tensor(BF16_EXACT_ABOVE, dtype=torch.float32)
    assert at.view(torch.int32).item() == 0x05600000
    above = torch.nextafter(at, torch.tensor(1.0))
    g = torch.Generator().manual_seed(3)
    x = torch.rand(2, B, generator=g) * at  # below-amax elements, fp32 bits all over the place
    x[0, 0], x[1, 0] = above, at
    x[1, 1] = 2.0**-134  # one e4m3 subnormal step 2^-9 at the 2^-125 dequantization scale
    values, _ = kq.dequantized(x.to(device), r, -1, out_dtype=torch.float32)
    values = values.cpu()
    _bitwise(values, r.qdq(x, -1), key)
    assert torch.equal(values[0].bfloat16().float(), values[0]), "above the boundary: bf16 holds the block"
    assert values[1, 1].item() == 2.0**-134 and values[1, 1].bfloat16().float().item() != 2.0**-134


def _random_bits(dtype, shape, seed, tiny):
    """Every bit pattern of a 16-bit float (subnormals, ±Inf, NaN included), or with ``tiny`` only
    those of the four lowest binades and below (bf16 < 2^-122, fp16 < 2^-10): blocks of tiny amax."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 1 << 16, shape, generator=g)
    if tiny:
        bits &= 0x81FF if dtype == torch.bfloat16 else 0x8FFF
    return bits.to(torch.int16).view(dtype)


@pytest.mark.parametrize("key", ["mxfp8", "fp8_block:pow2_scales=1"])
@pytest.mark.parametrize("dtype", [DTYPES[1], DTYPES[2]])
def test_bf16_and_fp16_sources_dequantize_onto_bf16(key, dtype):
    """The claim behind exact_dtype, on the torch reference (no kernel): from a bf16 or fp16 source,
    every value code·2^-k of mxfp8 and of power-of-two fp8_block is a bf16 number, whatever the
    block amax; the rows of tiny values are where an fp32 source would fall off bf16's grid."""
    r = from_key(key)
    for seed, tiny in enumerate((False, True)):
        x = _random_bits(dtype, (64, 256), seed, tiny)
        for axis in (-1, -2):
            values = r.qdq(x, axis)
            finite = torch.isfinite(values)
            assert torch.equal(values[finite].bfloat16().float(), values[finite]), (key, dtype, tiny, axis)
            if tiny and dtype == torch.bfloat16:  # the grid's last step is used: values below 2^-126
                assert ((values != 0) & (values.abs() < 2.0**-126)).any()


def test_exact_dtype():
    """bf16 where it holds every value (module comment in kernels/quant/), else fp32."""
    from moemlp.kernels.quant import api as kq

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    for name, opts, src, want in [
        ("nvfp4", {}, fp32, bf16),
        ("nvfp4", {"hadamard": True, "stochastic_rounding": True}, bf16, bf16),
        ("mxfp8", {}, bf16, bf16),
        ("mxfp8", {}, fp16, bf16),
        ("mxfp8", {}, fp32, fp32),  # blocks of amax ≤ 1.75·2^-117 fall below bf16's grid
        ("fp8_block", {"pow2_scales": True}, bf16, bf16),
        ("fp8_block", {"pow2_scales": True}, fp32, fp32),
        ("fp8_block", {"pow2_scales": False}, bf16, fp32),  # code·(1/scale): up to 28 bits
    ]:
        assert kq.exact_dtype(recipe(name, **opts), src) == want, (name, opts, src)
    assert kq.exact_dtype(recipe("mxfp8")) == bf16  # a bf16 source unless told


def test_out_dtype_that_would_round_is_refused():
    """ValueError before any launch, for each entry point, instead of rounding silently."""
    from moemlp.kernels.quant import api as kq

    x32, x16 = torch.zeros(4, 256), torch.zeros(4, 256, dtype=torch.bfloat16)
    w, s = torch.zeros(2, 128, 64, dtype=torch.bfloat16), torch.tensor([4])
    no_pow2 = recipe("fp8_block", pow2_scales=False)
    with pytest.raises(ValueError, match="28 significant bits"):
        kq.dequantized(x16, no_pow2)
    with pytest.raises(ValueError, match="28 significant bits"):
        kq.dequantized_weight(w, no_pow2)
    with pytest.raises(ValueError, match="28 significant bits"):
        kq.dequantized_wgrad(x16, s, no_pow2, out_dtype=torch.bfloat16)
    for r in (recipe("mxfp8"), recipe("fp8_block")):
        with pytest.raises(ValueError, match=r"2\^-133.*out_dtype=torch.float32"):
            kq.dequantized(x32, r)
        with pytest.raises(ValueError, match=r"2\^-133"):
            kq.dequantized_wgrad(x32, s, r)
        with pytest.raises(ValueError, match="fp16's range"):
            kq.dequantized_weight(w, r, out_dtype=torch.float16)
    for bad in (torch.int8, torch.float64, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match="out_dtype"):
            kq.dequantized(x16, recipe("nvfp4"), out_dtype=bad)
    with pytest.raises(ValueError, match="axis"):
        kq.dequantized(torch.zeros(2, 4, 6), recipe("nvfp4"), axis=0)
    with pytest.raises(ValueError, match="dim"):
        kq.dequantized_weight(w, recipe("fp8_block"), dim=0)
    with pytest.raises(ValueError, match="contiguous"):
        kq.dequantized(x16[:, ::2], recipe("mxfp8"))


@pytest.mark.gpu
def test_dequantized_capturable_in_cuda_graph():
    """No host read: the launches capture into a CUDA graph, and a replay on new data in the same
    buffers gives the eager result."""
    from moemlp.kernels.quant import api as kq

    x = _data((256, 320), torch.bfloat16, 60).cuda()
    w = _data((4, 256, 192), torch.bfloat16, 61).cuda()
    splits = torch.tensor([100, 0, 120, 30], device="cuda")
    calls = {
        "nvfp4": lambda r: (kq.dequantized(x, r, -2), kq.dequantized_wgrad(x, splits, r, is_grad=True)),
        "mxfp8": lambda r: (kq.dequantized(x, r, -1), kq.dequantized_weight(w, r, -2)),
        "fp8_block": lambda r: (kq.dequantized_weight(w, r), kq.dequantized_wgrad(x, splits, r)),
    }
    for name, call in calls.items():
        r = recipe(name, **({"hadamard": True, "stochastic_rounding": True} if name == "nvfp4" else {}))
        call(r)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call(r)
        x.copy_(_data((256, 320), torch.bfloat16, 62).cuda())
        w.copy_(_data((4, 256, 192), torch.bfloat16, 63).cuda())
        graph.replay()
        for (v, f), (v_ref, f_ref) in zip(captured, call(r)):
            torch.testing.assert_close(v, v_ref, rtol=0, atol=0, equal_nan=True)
            assert (f is None) == (f_ref is None) and (f is None or torch.equal(f, f_ref)), name
