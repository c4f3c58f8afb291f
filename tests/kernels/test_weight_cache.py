"""Weights quantized once per optimizer step: ``moemlp.quantize_weights`` and ``grouped_mlp(...,
quantized_weights=)`` / ``GroupedMLP.forward(..., is_first_microbatch=)``, under fp8_block (the
tiles: codes, codes_t, scales) and under mxfp8 and nvfp4 (the dequantized bf16 values of both
orientations).

Checked here, for each recipe: y and every gradient are bit for bit those of quantizing in the call
(the same operands reach the same kernels), with recompute_fc1 and without a backward too; a forward
+ backward with the cache runs no weight pass (``quantize_weight`` for fp8_block, two without;
``dequantized_weight`` for mxfp8 / nvfp4, four without); GroupedMLP's True / False / False sequence
(the passes all in the True call, the bits of None); the Triton quantizer and the torch reference
fallback give the same tensors; the host checks (a weight changed in place, another recipe, another
weight, False with nothing cached) and those of a Weight built from cached values; the forward and
FC1 ops' fake implementations (opcheck) and ``torch.compile(fullgraph=True)``.

On a CPU-only machine the kernel cases run under TRITON_INTERPRET=1 in a child pytest
(tests/_triton_env.py); the checks that raise before any kernel runs also run in the parent.
"""

from __future__ import annotations

import pytest
import torch

import _triton_env
import moemlp
from _cases import GRAD_NAMES, make_problem, run
from moemlp import _quantized_weights as qwm
from moemlp.recipes import from_key, recipe

interpreted = pytest.mark.skipif(
    not _triton_env.RUN_CPU_CASES,
    reason="CPU cases: run under TRITON_INTERPRET=1 in the child of test_cpu_cases_under_interpreter",
)

FP8 = recipe("fp8_block")
RECIPES = ("fp8_block", "mxfp8", "nvfp4")
EMULATED = ("mxfp8", "nvfp4")


# The interpreted cases take minutes: fp8_block's and the emulated recipes' run in two children (every
# mxfp8 / nvfp4 case names its recipe), side by side under pytest -n (conftest.py starts the children
# first, the longest first, one test at a time).
_EMULATED_CASES = "mxfp8 or nvfp4"


@pytest.mark.interpreter_child(seconds=75)
@pytest.mark.skipif(not _triton_env.START_CHILD, reason="runs the CPU cases in a child on a CPU-only machine")
def test_cpu_cases_under_interpreter():
    _triton_env.run_file_interpreted(__file__, keyword=f"not ({_EMULATED_CASES})")


def _problem(case, device, recipe_name="fp8_block"):
    if recipe_name == "fp8_block":
        if case == 0:
            # GLU with capacity rows, an empty expert and biases: W1 (3, 64, 128), W2 (3, 128, 32) on the
            # GPU (one 128-tile); under the interpreter W1 (3, 32, 24), W2 (3, 24, 16), partial tiles,
            # a third of the time (a forward + backward 2.9 s instead of 8.7 s)
            H, F = (128, 32) if device == "cuda" else (24, 16)
            return make_problem([11, 0, 19], H, F, capacity=2, bias=True, seed=3, device=device)
        # unary activation in fp32, partial 128-tiles in every dim, no probs: W1 (3, 40, 72), W2 (3, 72, 40)
        # (under the interpreter W1 (3, 16, 24), W2 (3, 24, 16))
        H, F = (72, 40) if device == "cuda" else (24, 16)
        return make_problem([9, 1, 14], H, F, activation="gelu", dtype=torch.float32, probs_dtype=None, seed=5,
                            device=device)  # fmt: skip
    # mxfp8 / nvfp4 block 32 / 16 deep: H = 40 and F = 24 end in a partial block in both orientations;
    # under the interpreter H, F = 24, 16 (40% less time): partial 32-blocks in both orientations, and
    # nvfp4's 16-blocks partial along H = 24 (in both orientations of W2 (3, 24, 16))
    H, F = (40, 24) if device == "cuda" else (24, 16)
    if case == 0:
        # GLU with capacity rows, an empty expert and biases: W1 (3, 2F, H), W2 (3, H, F)
        p = make_problem([5, 0, 4], H, F, capacity=2, bias=True, seed=3, device=device)
    else:
        # unary activation in fp32 (its values dequantized onto bf16), no probs: W1 (3, F, H), W2 (3, H, F)
        p = make_problem([4, 1, 6], H, F, activation="gelu", dtype=torch.float32, probs_dtype=None, seed=5,
                         device=device)  # fmt: skip
    _wide_range_(p.fc1_weight, p.fc1_bias)
    _wide_range_(p.fc2_weight, p.fc2_bias)
    return p


def _wide_range_(w, bias=None):
    """Scale w (E, R, C) in place by 2^(-6·(r mod 4)) along its rows and 2^(-16·(c mod 2)) along its
    columns, and the bias (E, R) of its outputs by the same row factors. mxfp8 rounds a value to
    e4m3's 3 mantissa bits whatever its block's power-of-two scale, unless it lies some 2^15 below the
    block's amax (e4m3's subnormals): with plain random weights its forward operand (blocks along C)
    and dgrad operand (blocks along R) are the same values, and a cache that handed one GEMM the
    other's would go unseen. Spread over 2^-34 they differ, and the outputs of the small rows, whose
    bias is as small, show it."""
    R, C = w.shape[1:]
    rows = 2.0 ** (-6.0 * (torch.arange(R, device=w.device) % 4))
    cols = 2.0 ** (-16.0 * (torch.arange(C, device=w.device) % 2))
    with torch.no_grad():
        w.mul_(rows[:, None] * cols[None, :])
        if bias is not None:
            bias.mul_(rows)


def _leaves(p):
    for t in p.tensors():
        if t is not None:
            t.requires_grad_(True)
    return p


def check_bits(case, device, recipe_name="fp8_block", weight_pass_calls=None, extras=({}, {"recompute_fc1": True})):
    """``weight_pass_calls``: fp8_block's quantize_weight calls or mxfp8's / nvfp4's dequantized_weight
    calls (conftest.py's fixtures), counted on the same runs: every pass in each call without the
    cache, all of them once in quantize_weights, none in a call with the cache."""
    p = _leaves(_problem(case, device, recipe_name))
    r = recipe(recipe_name)
    kw = dict(backend="triton", recipe=r)
    W1, W2 = tuple(p.fc1_weight.shape), tuple(p.fc2_weight.shape)
    if r.native:  # fp8_block: once per weight and call, both layouts in one pass
        every_pass = sorted([(W1, True), (W2, True)])
    else:  # each weight in each orientation
        every_pass = sorted([(W1, -1), (W1, -2), (W2, -1), (W2, -2)])

    def passes():
        calls = sorted(weight_pass_calls)
        weight_pass_calls.clear()
        return calls

    if weight_pass_calls is not None:
        weight_pass_calls.clear()
    g_plain = None
    qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, r)
    if weight_pass_calls is not None:
        assert passes() == every_pass  # the same passes, once
    if not r.native:  # _wide_range_ at work: a cache that swapped the orientations would change the bits
        for op in (qw.fc1, qw.fc2):
            assert not torch.equal(op.forward_values, op.dgrad_values)
    for extra in extras:
        y0, g0 = run(p, **kw, **extra)
        if weight_pass_calls is not None and not extra:
            assert passes() == every_pass  # without the cache: per call
        elif weight_pass_calls is not None:
            passes()  # recompute_fc1 without the cache: test_weight_reuse.py counts those
        y1, g1 = run(p, **kw, **extra, quantized_weights=qw)
        if weight_pass_calls is not None:
            assert passes() == [], extra  # forward, dgrads and the recomputed FC1 read the cache
        assert torch.equal(y0, y1), f"y differs with quantized_weights {extra}"
        assert g0.keys() == g1.keys()
        for name in g0:
            assert torch.equal(g0[name], g1[name]), f"d{name} differs with quantized_weights {extra}"
        g_plain = g0 if g_plain is None else g_plain
        for name in g0:  # and the bits of the call without the cache nor recompute_fc1
            assert torch.equal(g_plain[name], g1[name]), f"d{name} differs from the plain call {extra}"
    with torch.no_grad():  # no backward: the forward alone reads the cache
        y2 = moemlp.grouped_mlp(p.x, p.splits, p.probs, p.fc1_weight, p.fc2_weight, p.fc1_bias, p.fc2_bias,
                                **p.kwargs, **kw, quantized_weights=qw)  # fmt: skip
    if weight_pass_calls is not None:
        assert passes() == []
    assert torch.equal(y0, y2)


# Case 0 for every recipe; case 1 (gelu, fp32, no probs) for fp8_block and nvfp4, whose emulated path
# is mxfp8's with a factor (mxfp8's case 1 8 s; the GPU runs all six).
CPU_BITS_CASES = [(0, "fp8_block"), (0, "mxfp8"), (0, "nvfp4"), (1, "fp8_block"), (1, "nvfp4")]


@interpreted
@pytest.mark.parametrize("case,recipe_name", [pytest.param(c, n, id=f"{c}-{n}") for c, n in CPU_BITS_CASES])
def test_cpu_quantized_weights_give_the_same_bits(case, recipe_name, request):
    # Case 0 also counts the weight passes of its runs (test_cpu_no_quantize_weight_call_... and
    # test_cpu_no_dequantized_weight_call_... counted them on runs of their own of the same problem,
    # 56 s under the interpreter on the 2-core CI machine), with and without recompute_fc1. Case 1
    # without recompute_fc1 under the interpreter: recompute_fc1 with a cache is case 0's, for every
    # recipe; the GPU runs both with both.
    fixture = "quantize_weight_calls" if recipe_name == "fp8_block" else "dequantized_weight_calls"
    if case == 0:
        check_bits(case, "cpu", recipe_name, request.getfixturevalue(fixture))
    else:
        check_bits(case, "cpu", recipe_name, extras=({},))


@pytest.mark.long(seconds=35)
@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("case", [0, 1])
def test_gpu_quantized_weights_give_the_same_bits(case, recipe_name):
    check_bits(case, "cuda", recipe_name)


def _same_bits(a, b):
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@interpreted
@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("case", [0, 1])
def test_cpu_triton_quantizer_and_torch_reference_agree(case, recipe_name):
    # quantize_weights falls back to the torch reference where Triton cannot run (fp8_block: plus a
    # transposing copy): the same tensors as the Triton quantizer's passes.
    p = _problem(case, "cpu", recipe_name)
    r = recipe(recipe_name)
    prepare = qwm._quantize if r.native else qwm._dequantize
    for w in (p.fc1_weight, p.fc2_weight):
        tri = prepare(w, r, use_triton=True).tensors()
        ref = prepare(w, r, use_triton=False).tensors()
        assert len(tri) == len(ref) == (3 if r.native else 4)
        for i, (a, b) in enumerate(zip(tri, ref)):
            assert b.is_contiguous() and _same_bits(a, b), (recipe_name, i)
    if recipe_name == "nvfp4":  # the factor of both orientations: 1/S_enc of the whole weight
        assert tri[1].shape == () and torch.equal(tri[1], tri[3])
    if recipe_name == "mxfp8":  # no factor: the ops' empty tensor
        assert tri[1].numel() == 0 and tri[3].numel() == 0


def check_no_dequantized_weight_call(device, recipe_name, calls):
    p = _leaves(_problem(0, device, recipe_name))
    W1, W2 = tuple(p.fc1_weight.shape), tuple(p.fc2_weight.shape)
    every_pass = sorted([(W1, -1), (W1, -2), (W2, -1), (W2, -2)])  # each weight in each orientation
    kw = dict(backend="triton", recipe=recipe_name)
    _, g0 = run(p, **kw)
    assert sorted(calls) == every_pass  # without the cache: per GEMM, in every call

    calls.clear()
    qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, recipe_name)
    assert sorted(calls) == every_pass  # the same passes, once
    for extra in ({}, {"recompute_fc1": True}):
        calls.clear()
        _, g1 = run(p, **kw, **extra, quantized_weights=qw)
        assert calls == [], extra  # forward, dgrads and the recomputed FC1 read the cache
        for name in g0:
            assert torch.equal(g0[name], g1[name]), name


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", EMULATED)
def test_gpu_no_dequantized_weight_call_with_quantized_weights(recipe_name, dequantized_weight_calls):
    check_no_dequantized_weight_call("cuda", recipe_name, dequantized_weight_calls)


def check_module(device, recipe_name="fp8_block", weight_pass_calls=None):
    """GroupedMLP with True, False, False against None: the same bits, every weight pass in the True
    call (``weight_pass_calls``: fp8_block's quantize_weight calls, or mxfp8's / nvfp4's
    dequantized_weight calls), a stale cache caught."""
    # fp8_block on the GPU: one 128-tile; else partial tiles and partial 32- and 16-blocks (under the
    # interpreter H, F = 24, 16: a third of the time of 128, 32, 60% of 40, 24)
    if device == "cuda":
        H, F = (128, 32) if recipe_name == "fp8_block" else (40, 24)
    else:
        H, F = 24, 16
    p = make_problem([11, 0, 19], H, F, capacity=2, bias=True, seed=7, device=device)
    m = moemlp.GroupedMLP(num_experts=3, hidden_size=H, ffn_hidden_size=F, bias=True, recipe=recipe_name,
                          backend="triton", device=device, dtype=torch.bfloat16)  # fmt: skip
    if recipe_name != "fp8_block":
        _wide_range_(m.fc1_weight, m.fc1_bias)
        _wide_range_(m.fc2_weight, m.fc2_bias)
    params = [m.fc1_weight, m.fc2_weight, m.fc1_bias, m.fc2_bias]

    def step(flag):
        x = p.x.detach().requires_grad_(True)
        y = m(x, p.splits, p.probs, is_first_microbatch=flag)
        return y, torch.autograd.grad(y, [x, *params], p.dy)

    y_ref, g_ref = step(None)
    calls = []
    for flag in (True, False, False):
        if weight_pass_calls is not None:
            weight_pass_calls.clear()
        y, g = step(flag)
        if weight_pass_calls is not None:
            calls.append(len(weight_pass_calls))
        assert torch.equal(y, y_ref), flag
        for name, a, b in zip(("x", *GRAD_NAMES[2:]), g, g_ref):
            assert torch.equal(a, b), f"d{name} differs with is_first_microbatch={flag}"
    assert isinstance(m.quantized_weights, moemlp.QuantizedWeights)
    assert m.quantized_weights.recipe_key == recipe(recipe_name).key
    assert not any("quantized" in k for k in m.state_dict())  # derived from the weights: not saved
    if weight_pass_calls is not None:
        # fp8_block: one pass per weight (both layouts); mxfp8 / nvfp4: one per weight and orientation
        assert calls == [2 if recipe_name == "fp8_block" else 4, 0, 0]
    # An optimizer step without a True call since: the cache is stale.
    with torch.no_grad():
        m.fc2_weight.sub_(1e-3 * m.fc2_weight)
    with pytest.raises(ValueError, match="fc2_weight changed since it was quantized"):
        step(False)
    # Quantized again: the bits of quantizing in the call (forwards only: the backward with a cache is
    # the checks' above, and under the interpreter a forward + backward of this problem takes 6-9 s).
    x = p.x.detach()
    assert torch.equal(m(x, p.splits, p.probs, is_first_microbatch=True), m(x, p.splits, p.probs))


@interpreted
def test_cpu_module_is_first_microbatch(quantize_weight_calls):
    check_module("cpu", "fp8_block", quantize_weight_calls)


# Under the interpreter GroupedMLP's True / False / False runs under fp8_block only (the emulated
# recipes took 20-35 s each): the module hands its recipe to quantize_weights and the ops as they are;
# the emulated recipes' caches, their weight passes and bits are test_cpu_quantized_weights_give_the_
# same_bits', and GroupedMLP's mxfp8 cache under torch.compile test_compile.py's; the GPU runs every
# recipe here.


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", RECIPES)
def test_gpu_module_is_first_microbatch(recipe_name):
    check_module("cuda", recipe_name)


# --- the host checks: they raise before any kernel runs (parent and child) --------------------------

# The host checks that quantize weights run in the parent process only: in the interpreter child they
# would repeat the same checks on the Triton quantizer's tensors (the torch reference's bits,
# test_cpu_triton_quantizer_and_torch_reference_agree) in 23 s of numpy quantizer launches.
in_parent = pytest.mark.skipif(_triton_env.INTERPRET, reason="host checks: run in the parent process")


def _small_problem():
    return make_problem([5, 0, 4], 128, 32, bias=True, seed=1)  # W1 (3, 64, 128), W2 (3, 128, 32)


@in_parent
@pytest.mark.parametrize("recipe_name", RECIPES)
def test_stale_weights_raise(recipe_name):
    p = _small_problem()
    qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, recipe_name)
    args = (p.x, p.splits, p.probs, p.fc1_weight, p.fc2_weight)
    with torch.no_grad():
        p.fc1_weight.add_(1)
    with pytest.raises(ValueError, match=r"fc1_weight changed since it was quantized \(optimizer step\?\)"):
        moemlp.grouped_mlp(*args, recipe=recipe_name, quantized_weights=qw)
    # Another tensor with the same values (a copy, a reallocated parameter) is not the one quantized.
    qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, recipe_name)
    with pytest.raises(ValueError, match="fc2_weight changed since it was quantized"):
        moemlp.grouped_mlp(*args[:4], p.fc2_weight.detach().clone(), recipe=recipe_name, quantized_weights=qw)
    # An optimizer step (foreach, as torch picks on CUDA by default) bumps the version counter.
    p.fc2_weight.grad = torch.ones_like(p.fc2_weight)
    torch.optim.SGD([p.fc2_weight], lr=0.1, foreach=True).step()
    with pytest.raises(ValueError, match="fc2_weight changed since it was quantized"):
        moemlp.grouped_mlp(*args, recipe=recipe_name, quantized_weights=qw)


def test_recipe_must_match():
    p = _small_problem()
    qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, "fp8_block")
    args = (p.x, p.splits, p.probs, p.fc1_weight, p.fc2_weight)
    for other in (recipe("fp8_block", pow2_scales=False), "mxfp8", None):
        with pytest.raises(ValueError, match="quantized_weights: quantized under recipe 'fp8_block:pow2_scales=1'"):
            moemlp.grouped_mlp(*args, recipe=other, quantized_weights=qw)
    with pytest.raises(TypeError, match="quantized_weights: expected None or a QuantizedWeights"):
        moemlp.grouped_mlp(*args, recipe=FP8, quantized_weights=qw.tensors())
    with pytest.raises(ValueError, match=r"made from a fc1_weight of shape \(3, 64, 128\)"):
        w1 = p.fc1_weight[:2]
        moemlp.grouped_mlp(p.x, p.splits[:2], p.probs, w1, p.fc2_weight[:2], recipe=FP8, quantized_weights=qw)


@in_parent
def test_emulated_recipe_must_match():
    # mxfp8 and nvfp4 dequantize onto the same bf16 shapes: only the recipe key tells their caches apart.
    p = _small_problem()
    args = (p.x, p.splits, p.probs, p.fc1_weight, p.fc2_weight)
    qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, "mxfp8")
    for other in ("nvfp4", "fp8_block", None):
        with pytest.raises(ValueError, match="quantized_weights: quantized under recipe 'mxfp8'"):
            moemlp.grouped_mlp(*args, recipe=other, quantized_weights=qw)
    qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, "nvfp4")
    for other in ("mxfp8", recipe("nvfp4", hadamard=True)):  # any other option: another recipe
        with pytest.raises(ValueError, match="quantized_weights: quantized under recipe 'nvfp4:hadamard=0"):
            moemlp.grouped_mlp(*args, recipe=other, quantized_weights=qw)
    # The weights' dtype is part of what was quantized (an fp32 weight dequantizes to other values).
    w1, w2 = p.fc1_weight.detach().float(), p.fc2_weight.detach().float()
    with pytest.raises(ValueError, match=r"made from a fc1_weight of shape \(3, 64, 128\), torch.bfloat16 on cpu, "
                                         r"got shape \(3, 64, 128\), torch.float32"):  # fmt: skip
        moemlp.grouped_mlp(p.x.float(), p.splits, p.probs, w1, w2, recipe="nvfp4", quantized_weights=qw)


def test_quantize_weights_checks_its_inputs():
    p = _small_problem()
    w1, w2 = p.fc1_weight, p.fc2_weight
    with pytest.raises(ValueError, match=r"needs the recipe the calls use \('fp8_block', 'mxfp8' or 'nvfp4'\)"):
        moemlp.quantize_weights(w1, w2, None)
    with pytest.raises(ValueError, match="recipe: unknown recipe .int8."):
        moemlp.quantize_weights(w1, w2, "int8")
    with pytest.raises(ValueError, match="fc1_weight: expected 3 dimensions"):
        moemlp.quantize_weights(w1[0], w2, FP8)
    with pytest.raises(ValueError, match=r"fc2_weight: expected shape \(E, H, F\) = \(3, 128, F\)"):
        moemlp.quantize_weights(w1, w2[:, :64], FP8)
    with pytest.raises(ValueError, match="N1 = 64 equal to F or 2F"):
        moemlp.quantize_weights(w1, w2[..., :16], "mxfp8")
    with pytest.raises(TypeError, match="fc2_weight: expected dtype torch.bfloat16"):
        moemlp.quantize_weights(w1, w2.float(), FP8)
    for name in RECIPES:
        with pytest.raises(TypeError, match=f"fc1_weight: expected dtype bfloat16, float16 or float32 for {name}"):
            moemlp.quantize_weights(w1.double(), w2.double(), name)
    with pytest.raises(TypeError, match="fc1_weight: expected a torch.Tensor"):
        moemlp.quantize_weights(None, w2, "nvfp4")


def test_module_is_first_microbatch_checks():
    p = _small_problem()
    for r in RECIPES:
        m = moemlp.GroupedMLP(num_experts=3, hidden_size=128, ffn_hidden_size=32, recipe=r, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="is_first_microbatch=False: no weights quantized yet"):
            m(p.x, p.splits, p.probs, is_first_microbatch=False)
        with pytest.raises(TypeError, match="is_first_microbatch: expected None or a bool"):
            m(p.x, p.splits, p.probs, is_first_microbatch=1)


def test_module_ignores_is_first_microbatch_without_a_recipe():
    # Nothing to cache: the flag is accepted and ignored (torch backend).
    p = _small_problem()
    m = moemlp.GroupedMLP(num_experts=3, hidden_size=128, ffn_hidden_size=32, backend="torch", dtype=torch.bfloat16)
    y = m(p.x, p.splits, p.probs)
    for flag in (True, False):
        assert torch.equal(m(p.x, p.splits, p.probs, is_first_microbatch=flag), y), flag
    assert m.quantized_weights is None


@in_parent
@pytest.mark.parametrize("recipe_name", RECIPES)
def test_torch_backend_checks_and_ignores_quantized_weights(recipe_name):
    # The reference quantizes the same unchanged weights itself: the same bits; the checks still run.
    p = _small_problem()
    qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, recipe_name)
    y0, g0 = run(p, backend="torch", recipe=recipe_name)
    y1, g1 = run(p, backend="torch", recipe=recipe_name, quantized_weights=qw)
    assert torch.equal(y0, y1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
    other = "nvfp4" if recipe_name == "mxfp8" else "mxfp8"
    with pytest.raises(ValueError, match="quantized under recipe"):
        run(p, backend="torch", recipe=other, quantized_weights=qw)


def test_weight_from_dequantized_checks_its_operands():
    # What the ops receive is a list of tensors: each cached operand is checked against the weight.
    from moemlp.kernels import operands

    mx, nv = from_key("mxfp8"), from_key("nvfp4")
    w = torch.zeros(2, 48, 40, dtype=torch.bfloat16)
    values, no_factor, factor = torch.zeros(2, 48, 40, dtype=torch.bfloat16), torch.empty(0), torch.ones(())
    weight = operands.Weight.from_dequantized(w, nv, forward=(values, factor), dgrad=(values, factor))
    op = weight.dgrad()  # no dequantizing pass: the cached tensors themselves
    assert op.b is values and op.factor is factor and op.strides == (48 * 40, 1, 40)
    op = operands.Weight.from_dequantized(w, mx, forward=(values, no_factor)).forward()
    assert op.b is values and op.factor is None and op.strides == (48 * 40, 40, 1)
    with pytest.raises(ValueError, match=r"values: expected shape \(2, 48, 40\)"):
        operands.Weight.from_dequantized(w, mx, forward=(values.transpose(1, 2).contiguous(), no_factor))
    with pytest.raises(TypeError, match="values: expected torch.bfloat16"):
        operands.Weight.from_dequantized(w, mx, dgrad=(values.float(), no_factor))
    with pytest.raises(ValueError, match="values: expected a contiguous"):
        t = torch.zeros(2, 40, 48, dtype=torch.bfloat16).transpose(1, 2)
        operands.Weight.from_dequantized(w, mx, dgrad=(t, no_factor))
    with pytest.raises(ValueError, match="factor: nvfp4.* expects a 0-d float32 1/S_enc on cpu, got none"):
        operands.Weight.from_dequantized(w, nv, forward=(values, no_factor))
    with pytest.raises(ValueError, match="factor: mxfp8 has no per-tensor factor"):
        operands.Weight.from_dequantized(w, mx, forward=(values, factor))
    with pytest.raises(ValueError, match="dequantized values under mxfp8 or nvfp4 only"):
        operands.Weight.from_dequantized(w, FP8, forward=(values, no_factor))
    # the flat lists: four tensors per weight for a forward, two for a backward
    with pytest.raises(ValueError, match="quantized: expected forward values and factor, dgrad values and factor "
                                         "of each of 2 weights, got 6 tensors"):  # fmt: skip
        operands.cached_weights((w, w), mx, [values, no_factor, values] * 2)
    with pytest.raises(ValueError, match="saved: expected the dgrad values and factor of each of 2 weights"):
        operands.dgrad_weights((w, w), nv, [values, factor])


# --- the custom ops and torch.compile ------------------------------------------------------------


# Each opcheck runs the op some four times (the backward's three opchecks 14 s under the interpreter):
# fp8_block (codes_t, scales) and nvfp4 (dequantized values with their 0-d factor) here; mxfp8's empty
# factor reaches the same ops' fakes and kernels in test_cpu_torch_compile_fullgraph_with_quantized_weights
# (aot_eager: the fakes trace, the kernels run, the bits are eager's), 41 s less.
@interpreted
@pytest.mark.parametrize("recipe_name", ["fp8_block", "nvfp4"])
def test_cpu_opcheck_ops_with_quantized_weights(recipe_name):
    # W1 (3, 32, 16), W2 (3, 16, 16): one tile and block, one empty expert, capacity rows (the
    # opchecks' fakes do not depend on the shape; W1 (3, 48, 40) took 1.6x the time)
    p = make_problem([6, 0, 5], 16, 16, capacity=2, bias=True, seed=2)
    r = recipe(recipe_name)
    qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, r)
    cached = qw.tensors()
    inputs = (p.x.detach(), p.splits, p.probs.detach(), *(t.detach() for t in p.tensors()[2:]))
    opts = ("swiglu", [], 16, True, r.key, "triton")
    # test_schema compares inputs with allclose, which the CPU lacks for float8_e4m3fn (torch 2.13)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if not r.native:
        utils += ("test_schema",)
    fwd = torch.ops.moemlp.grouped_mlp_fwd
    for keep in ([True, True], [False, False]):
        y, h, saved = fwd(*inputs, *opts, keep, cached)
        # the cached dgrad operands go to the backward around the op; nvfp4's x amax is the op's own
        assert [t.shape for t in saved] == ([()] if keep[0] and recipe_name == "nvfp4" else [])
        y0, h0, _ = fwd(*inputs, *opts, keep, [])
        assert torch.equal(y, y0) and torch.equal(h, h0)
        if keep[0]:  # with a cache the op keeps nothing whatever keep says: one opcheck (5 s)
            torch.library.opcheck(fwd, inputs + opts + (keep, cached), test_utils=utils)
    fc1_args = (inputs[0], inputs[1], inputs[3], inputs[5], *opts)
    h1 = torch.ops.moemlp.grouped_fc1(*fc1_args, qwm.cached_fc1(cached))
    assert torch.equal(h1, torch.ops.moemlp.grouped_fc1(*fc1_args, []))
    torch.library.opcheck(torch.ops.moemlp.grouped_fc1, fc1_args + (qwm.cached_fc1(cached),), test_utils=utils)
    # the backward with the cached dgrad operands as its saved: the bits of dequantizing in it
    bwd = torch.ops.moemlp.grouped_mlp_bwd
    dy = p.dy.detach()
    args = (dy, inputs[0], h, *inputs[1:], *opts, [True] * 6, False, qwm.cached_dgrad(cached))
    for name, a, b in zip(GRAD_NAMES, bwd(*args), bwd(*args[:-1], [])):
        assert torch.equal(a, b), name
    torch.library.opcheck(bwd, args, test_utils=utils)


@interpreted
@pytest.mark.parametrize("recipe_name", RECIPES)
def test_cpu_torch_compile_fullgraph_with_quantized_weights(recipe_name, request):
    # no weight pass inside the compiled forward + backward: fp8_block's quantize_weight calls,
    # mxfp8's / nvfp4's dequantized_weight calls
    fixture = "quantize_weight_calls" if recipe_name == "fp8_block" else "dequantized_weight_calls"
    weight_pass_calls = request.getfixturevalue(fixture)
    # one tile and block of every recipe: what is traced does not depend on the shape (fp8_block's
    # H, F = 128, 32 took 2.5x the time, the emulated recipes' 40, 24 1.6x)
    p = make_problem([9, 0, 14], 16, 16, capacity=2, bias=True, seed=12)
    qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, recipe_name)

    def f(x, probs, w1, w2, b1, b2, qw):
        return moemlp.grouped_mlp(x, p.splits, probs, w1, w2, b1, b2, backend="triton", recipe=recipe_name,
                                  quantized_weights=qw)  # fmt: skip

    args = p.tensors()
    y = f(*args, None)
    weight_pass_calls.clear()
    yc = torch.compile(f, fullgraph=True, backend="aot_eager")(*args, qw)
    gc = torch.autograd.grad(yc, args, p.dy)
    assert weight_pass_calls == []
    assert torch.equal(y, yc)
    for a, b in zip(torch.autograd.grad(y, args, p.dy), gc):
        assert torch.equal(a, b)


@pytest.mark.interpreter_child(seconds=95)
@pytest.mark.skipif(not _triton_env.START_CHILD, reason="runs the CPU cases in a child on a CPU-only machine")
def test_cpu_emulated_cases_under_interpreter():
    _triton_env.run_file_interpreted(__file__, keyword=_EMULATED_CASES)
