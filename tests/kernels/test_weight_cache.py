"""fp8_block weights quantized once per optimizer step: ``moemlp.quantize_weights`` and
``grouped_mlp(..., quantized_weights=)`` / ``GroupedMLP.forward(..., is_first_microbatch=)``.

Checked here: y and every gradient are bit for bit those of quantizing in the call (the same codes
reach the same kernels), with recompute_fc1 and without a backward too; a forward + backward with
the cached tiles calls ``quantize_weight`` zero times (two without); GroupedMLP's True / False /
False sequence (2, 0, 0 calls, the bits of None); the Triton quantizer and the torch reference
fallback give the same codes; the host checks (a weight changed in place, another recipe, mxfp8,
False with nothing cached); the forward and FC1 ops' fake implementations (opcheck) and
``torch.compile(fullgraph=True)``.

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


@pytest.mark.skipif(not _triton_env.START_CHILD, reason="runs the CPU cases in a child on a CPU-only machine")
def test_cpu_cases_under_interpreter():
    _triton_env.run_file_interpreted(__file__)


def _problem(case, device):
    if case == 0:
        # GLU with capacity rows, an empty expert and biases: W1 (3, 64, 128), W2 (3, 128, 32)
        return make_problem([11, 0, 19], 128, 32, capacity=2, bias=True, seed=3, device=device)
    # unary activation in fp32, partial 128-tiles in every dim, no probs: W1 (3, 40, 72), W2 (3, 72, 40)
    return make_problem([9, 1, 14], 72, 40, activation="gelu", dtype=torch.float32, probs_dtype=None, seed=5,
                        device=device)  # fmt: skip


def _leaves(p):
    for t in p.tensors():
        if t is not None:
            t.requires_grad_(True)
    return p


def check_bits(case, device):
    p = _leaves(_problem(case, device))
    kw = dict(backend="triton", recipe=FP8)
    qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, FP8)
    for extra in ({}, {"recompute_fc1": True}):
        y0, g0 = run(p, **kw, **extra)
        y1, g1 = run(p, **kw, **extra, quantized_weights=qw)
        assert torch.equal(y0, y1), f"y differs with quantized_weights {extra}"
        assert g0.keys() == g1.keys()
        for name in g0:
            assert torch.equal(g0[name], g1[name]), f"d{name} differs with quantized_weights {extra}"
    with torch.no_grad():  # no backward: the forward alone reads the cache
        y2 = moemlp.grouped_mlp(p.x, p.splits, p.probs, p.fc1_weight, p.fc2_weight, p.fc1_bias, p.fc2_bias,
                                **p.kwargs, **kw, quantized_weights=qw)  # fmt: skip
    assert torch.equal(y0, y2)


@interpreted
@pytest.mark.parametrize("case", [0, 1])
def test_cpu_quantized_weights_give_the_same_bits(case):
    check_bits(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [0, 1])
def test_gpu_quantized_weights_give_the_same_bits(case):
    check_bits(case, "cuda")


@interpreted
@pytest.mark.parametrize("case", [0, 1])
def test_cpu_triton_quantizer_and_torch_reference_agree(case):
    # quantize_weights falls back to the torch reference (plus a transposing copy) where Triton
    # cannot run: the same codes, codes_t and scales as the Triton quantizer's one pass.
    p = _problem(case, "cpu")
    for w in (p.fc1_weight, p.fc2_weight):
        tri = qwm._quantize(w, FP8, use_triton=True)
        ref = qwm._quantize(w, FP8, use_triton=False)
        for name, a, b in zip(("codes", "codes_t", "scales"), tri, ref):
            assert a.dtype == b.dtype and a.shape == b.shape and b.is_contiguous(), name
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), name  # fmt: skip


@interpreted
def test_cpu_no_quantize_weight_call_with_quantized_weights(quantize_weight_calls):
    p = _leaves(_problem(0, "cpu"))
    W1, W2 = tuple(p.fc1_weight.shape), tuple(p.fc2_weight.shape)
    kw = dict(backend="triton", recipe=FP8)
    _, g0 = run(p, **kw)
    assert sorted(quantize_weight_calls) == [(W1, True), (W2, True)]  # today: once per weight and call

    quantize_weight_calls.clear()
    qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, FP8)
    assert sorted(quantize_weight_calls) == [(W1, True), (W2, True)]  # both layouts, one pass each
    for extra in ({}, {"recompute_fc1": True}):
        quantize_weight_calls.clear()
        _, g1 = run(p, **kw, **extra, quantized_weights=qw)
        assert quantize_weight_calls == [], extra  # forward, dgrads and the recomputed FC1 read the cache
        for name in g0:
            assert torch.equal(g0[name], g1[name]), name


def check_module(device, quantize_weight_calls=None):
    p = make_problem([11, 0, 19], 128, 32, capacity=2, bias=True, seed=7, device=device)
    m = moemlp.GroupedMLP(num_experts=3, hidden_size=128, ffn_hidden_size=32, bias=True, recipe="fp8_block", backend="triton", device=device,
                          dtype=torch.bfloat16)  # fmt: skip
    params = [m.fc1_weight, m.fc2_weight, m.fc1_bias, m.fc2_bias]

    def step(flag):
        x = p.x.detach().requires_grad_(True)
        y = m(x, p.splits, p.probs, is_first_microbatch=flag)
        return y, torch.autograd.grad(y, [x, *params], p.dy)

    y_ref, g_ref = step(None)
    calls = []
    for flag in (True, False, False):
        if quantize_weight_calls is not None:
            quantize_weight_calls.clear()
        y, g = step(flag)
        if quantize_weight_calls is not None:
            calls.append(len(quantize_weight_calls))
        assert torch.equal(y, y_ref), flag
        for name, a, b in zip(("x", *GRAD_NAMES[2:]), g, g_ref):
            assert torch.equal(a, b), f"d{name} differs with is_first_microbatch={flag}"
    assert isinstance(m.quantized_weights, moemlp.QuantizedWeights)
    assert not any("quantized" in k for k in m.state_dict())  # derived from the weights: not saved
    if quantize_weight_calls is not None:
        assert calls == [2, 0, 0]
    # An optimizer step without a True call since: the cache is stale.
    with torch.no_grad():
        m.fc2_weight.sub_(1e-3 * m.fc2_weight)
    with pytest.raises(ValueError, match="fc2_weight changed since it was quantized"):
        step(False)
    step(True)  # quantized again: runs


@interpreted
def test_cpu_module_is_first_microbatch(quantize_weight_calls):
    check_module("cpu", quantize_weight_calls)


@pytest.mark.gpu
def test_gpu_module_is_first_microbatch():
    check_module("cuda")


# --- the host checks: they raise before any kernel runs (parent and child) --------------------------


def _small_problem():
    return make_problem([5, 0, 4], 128, 32, bias=True, seed=1)  # W1 (3, 64, 128), W2 (3, 128, 32)


def test_stale_weights_raise():
    p = _small_problem()
    qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, FP8)
    args = (p.x, p.splits, p.probs, p.fc1_weight, p.fc2_weight)
    with torch.no_grad():
        p.fc1_weight.add_(1)
    with pytest.raises(ValueError, match=r"fc1_weight changed since it was quantized \(optimizer step\?\)"):
        moemlp.grouped_mlp(*args, recipe=FP8, quantized_weights=qw)
    # Another tensor with the same values (a copy, a reallocated parameter) is not the one quantized.
    qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, FP8)
    with pytest.raises(ValueError, match="fc2_weight changed since it was quantized"):
        moemlp.grouped_mlp(*args[:4], p.fc2_weight.detach().clone(), recipe=FP8, quantized_weights=qw)
    # An optimizer step (foreach, as torch picks on CUDA by default) bumps the version counter.
    p.fc2_weight.grad = torch.ones_like(p.fc2_weight)
    torch.optim.SGD([p.fc2_weight], lr=0.1, foreach=True).step()
    with pytest.raises(ValueError, match="fc2_weight changed since it was quantized"):
        moemlp.grouped_mlp(*args, recipe=FP8, quantized_weights=qw)


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


def test_quantize_weights_checks_its_inputs():
    p = _small_problem()
    w1, w2 = p.fc1_weight, p.fc2_weight
    for name in ("mxfp8", "nvfp4"):
        with pytest.raises(ValueError, match="quantize_weights supports fp8_block only.*share no quantization"):
            moemlp.quantize_weights(w1, w2, name)
    with pytest.raises(ValueError, match="needs the fp8_block recipe"):
        moemlp.quantize_weights(w1, w2, None)
    with pytest.raises(ValueError, match="fc1_weight: expected 3 dimensions"):
        moemlp.quantize_weights(w1[0], w2, FP8)
    with pytest.raises(ValueError, match=r"fc2_weight: expected shape \(E, H, F\) = \(3, 128, F\)"):
        moemlp.quantize_weights(w1, w2[:, :64], FP8)
    with pytest.raises(ValueError, match="N1 = 64 equal to F or 2F"):
        moemlp.quantize_weights(w1, w2[..., :16], FP8)
    with pytest.raises(TypeError, match="fc2_weight: expected dtype torch.bfloat16"):
        moemlp.quantize_weights(w1, w2.float(), FP8)
    with pytest.raises(TypeError, match="fc1_weight: expected dtype bfloat16, float16 or float32"):
        moemlp.quantize_weights(w1.double(), w2.double(), FP8)
    with pytest.raises(TypeError, match="fc1_weight: expected a torch.Tensor"):
        moemlp.quantize_weights(None, w2, FP8)


def test_module_is_first_microbatch_checks():
    p = _small_problem()
    m = moemlp.GroupedMLP(num_experts=3, hidden_size=128, ffn_hidden_size=32, recipe="fp8_block", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="is_first_microbatch=False: no weights quantized yet"):
        m(p.x, p.splits, p.probs, is_first_microbatch=False)
    with pytest.raises(TypeError, match="is_first_microbatch: expected None or a bool"):
        m(p.x, p.splits, p.probs, is_first_microbatch=1)


def test_module_ignores_is_first_microbatch_without_fp8_block():
    # No recipe, or an emulated one: nothing to cache, the flag is accepted and ignored (torch backend).
    p = _small_problem()
    for r in (None, "mxfp8"):
        m = moemlp.GroupedMLP(num_experts=3, hidden_size=128, ffn_hidden_size=32, recipe=r, backend="torch", dtype=torch.bfloat16)
        y = m(p.x, p.splits, p.probs)
        for flag in (True, False):
            assert torch.equal(m(p.x, p.splits, p.probs, is_first_microbatch=flag), y), (r, flag)
        assert m.quantized_weights is None


def test_torch_backend_checks_and_ignores_quantized_weights():
    # The reference quantizes the same unchanged weights itself: the same bits; the checks still run.
    p = _small_problem()
    qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, FP8)
    y0, g0 = run(p, backend="torch", recipe=FP8)
    y1, g1 = run(p, backend="torch", recipe=FP8, quantized_weights=qw)
    assert torch.equal(y0, y1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
    with pytest.raises(ValueError, match="quantized under recipe"):
        run(p, backend="torch", recipe="mxfp8", quantized_weights=qw)


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


@interpreted
def test_cpu_opcheck_ops_with_quantized_weights():
    # W1 (3, 48, 40), W2 (3, 40, 24): partial tiles, one empty expert
    p = make_problem([6, 0, 5], 40, 24, capacity=2, bias=True, seed=2)
    qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, FP8)
    inputs = (p.x.detach(), p.splits, p.probs.detach(), *(t.detach() for t in p.tensors()[2:]))
    opts = ("swiglu", [], 24, True, FP8.key, "triton")
    fwd = torch.ops.moemlp.grouped_mlp_fwd
    for keep in ([True, True], [False, False]):
        y, h, saved = fwd(*inputs, *opts, keep, qw.tensors())
        assert saved == []  # the cached codes_t / scales go to the backward around the op
        y0, h0, _ = fwd(*inputs, *opts, keep, [])
        assert torch.equal(y, y0) and torch.equal(h, h0)
        # test_schema compares inputs with allclose, which the CPU lacks for float8_e4m3fn (torch 2.13)
        torch.library.opcheck(
            fwd, inputs + opts + (keep, qw.tensors()),
            test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
        )  # fmt: skip
    fc1_args = (inputs[0], inputs[1], inputs[3], inputs[5], *opts)
    h1 = torch.ops.moemlp.grouped_fc1(*fc1_args, qw.tensors()[:3])
    assert torch.equal(h1, torch.ops.moemlp.grouped_fc1(*fc1_args, []))
    torch.library.opcheck(
        torch.ops.moemlp.grouped_fc1, fc1_args + (qw.tensors()[:3],),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )  # fmt: skip


@interpreted
def test_cpu_torch_compile_fullgraph_with_quantized_weights(quantize_weight_calls):
    p = make_problem([9, 0, 14], 128, 32, capacity=2, bias=True, seed=12)
    qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, FP8)

    def f(x, probs, w1, w2, b1, b2, qw):
        return moemlp.grouped_mlp(x, p.splits, probs, w1, w2, b1, b2, backend="triton", recipe=FP8,
                                  quantized_weights=qw)  # fmt: skip

    args = p.tensors()
    y = f(*args, None)
    quantize_weight_calls.clear()
    yc = torch.compile(f, fullgraph=True, backend="aot_eager")(*args, qw)
    gc = torch.autograd.grad(yc, args, p.dy)
    assert quantize_weight_calls == []
    assert torch.equal(y, yc)
    for a, b in zip(torch.autograd.grad(y, args, p.dy), gc):
        assert torch.equal(a, b)
