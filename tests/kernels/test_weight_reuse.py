"""fp8_block on the Triton backend quantizes each weight once per forward + backward.

The forward quantizes a weight whose dgrad the backward will run with both layouts
(``quantize_weight(w, r, transposed=True)``), reads the codes for its GEMM and returns the K-major
codes_t and the tile scales through ``moemlp::grouped_mlp_fwd``'s third output; the backward takes
them through ``moemlp::grouped_mlp_bwd`` (kernels/operands.py: ``saved_dgrad``, ``dgrad_weights``).

Checked here: the gradients are bit for bit those of quantizing again in the backward; a forward +
backward calls ``quantize_weight`` twice (once per weight); autograd keeps codes_t and scales but not
the forward's codes; the ops' fake implementations (``torch.library.opcheck``) and
``torch.compile(fullgraph=True)``; the shape checks of ``Weight.from_saved``.

On a CPU-only machine the kernel cases run under TRITON_INTERPRET=1 in a child pytest
(tests/_triton_env.py).
"""

from __future__ import annotations

import pytest
import torch

import _triton_env
import moemlp
from _cases import GRAD_NAMES, make_problem, run
from moemlp import kernels as K
from moemlp._config import MLPConfig
from moemlp.activations import ACTIVATIONS
from moemlp.kernels import operands as _operands
from moemlp.kernels.quant import api as kq
from moemlp.recipes import from_key
from test_triton_backend import GRADS, make

interpreted = pytest.mark.skipif(
    not _triton_env.RUN_CPU_CASES,
    reason="CPU cases: run under TRITON_INTERPRET=1 in the child of test_cpu_cases_under_interpreter",
)

FP8 = "fp8_block:pow2_scales=1"


@pytest.mark.interpreter_child(seconds=115)
@pytest.mark.skipif(not _triton_env.START_CHILD, reason="runs the CPU cases in a child on a CPU-only machine")
def test_cpu_cases_under_interpreter():
    _triton_env.run_file_interpreted(__file__)


def with_recipe(cfg, key):
    return MLPConfig(cfg.activation, cfg.activation_params, cfg.glu_interleave, cfg.scale_fc2_bias, from_key(key))


def _problems(device="cuda"):
    # GLU with partial 128-tiles in every dim (on the GPU W1 (4, 96, 160), W2 (4, 160, 48); under the
    # interpreter W1 (3, 48, 160), W2 (3, 160, 24), 40% of the time), an empty expert, capacity rows,
    # biases; and a unary activation in fp32 without probs, W1 (3, 40, 72) (interpreter: (3, 24, 40))
    # taking the masked-pointer mainloop.
    if device == "cuda":
        yield make((20, 0, 17, 23), 160, 48, M=70, scale_fc2_bias=True)
    else:
        yield make((20, 0, 9), 160, 24, M=34, scale_fc2_bias=True)
    if device == "cuda":
        yield make((9, 1, 14), 72, 40, M=30, activation="gelu", dtype=torch.float32, probs_dtype=None)
    else:  # H = 40 as well: rows of 40 e4m3 codes, not 16-byte aligned
        yield make((9, 1, 14), 40, 24, M=30, activation="gelu", dtype=torch.float32, probs_dtype=None)


@interpreted
@pytest.mark.parametrize("case", [0, 1])
def test_cpu_saved_gives_the_bits_of_quantizing_again(case):
    check_saved(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [0, 1])
def test_gpu_saved_gives_the_bits_of_quantizing_again(case):
    check_saved(case, "cuda")


def check_saved(case, device):
    t, cfg = list(_problems(device))[case]
    t = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in t.items()}
    cfg = with_recipe(cfg, FP8)
    args = (t["splits"], t["probs"], t["fc1_weight"], t["fc2_weight"], t["fc1_bias"], t["fc2_bias"])
    y0, h0 = K.grouped_mlp_fwd(t["x"], *args, cfg)  # no keep_dgrad: (y, h) as before
    y, h, saved = K.grouped_mlp_fwd(t["x"], *args, cfg, keep_dgrad=(True, True))
    assert torch.equal(y, y0) and torch.equal(h, h0)  # the forward reads the same codes
    # saved: codes_t and scales of W1, then of W2, as quantize_weight(transposed=True) stores them,
    # with the shapes and dtypes of the forward op's fake.
    like = _operands.saved_dgrad_like((t["fc1_weight"], t["fc2_weight"]), cfg.recipe, (True, True))
    assert [(s.shape, s.dtype) for s in saved] == [(s.shape, s.dtype) for s in like]
    for i, w in enumerate((t["fc1_weight"], t["fc2_weight"])):
        q = kq.quantize_weight(w, cfg.recipe, transposed=True)
        E, R, C = w.shape
        assert saved[2 * i].shape == (E, C, R) and saved[2 * i].dtype == torch.float8_e4m3fn
        assert saved[2 * i + 1].shape == (E, -(-R // 128), -(-C // 128)) and saved[2 * i + 1].dtype == torch.float32
        assert torch.equal(saved[2 * i].view(torch.uint8), q.codes_t.view(torch.uint8))
        assert torch.equal(saved[2 * i + 1], q.scales)
    has_probs = t["probs"] is not None
    has_bias = t["fc1_bias"] is not None
    for needs in [(True, has_probs, True, True, has_bias, has_bias), (False, has_probs, True, False, False, False)]:
        before = K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, needs)
        after = K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, needs, saved=saved)
        for name, a, b in zip(GRADS, before, after):
            assert (a is None) == (b is None), name
            assert a is None or torch.equal(a, b), f"{name} differs with the forward's quantization"
    # W2 alone kept (x needs no gradient): W1's pair is two empty tensors, and the backward runs.
    _, _, saved2 = K.grouped_mlp_fwd(t["x"], *args, cfg, keep_dgrad=(False, True))
    assert [s.numel() for s in saved2[:2]] == [0, 0]
    assert torch.equal(saved2[2].view(torch.uint8), saved[2].view(torch.uint8))
    needs = (False, has_probs, True, True, False, False)
    before = K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, needs)
    after = K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, needs, saved=saved2)
    for name, a, b in zip(GRADS, before, after):
        assert a is None or torch.equal(a, b), name
    assert K.grouped_mlp_fwd(t["x"], *args, cfg, keep_dgrad=(False, False))[2] == []


@interpreted
def test_cpu_emulated_recipes_keep_nothing(quantize_weight_calls):
    t, cfg = list(_problems("cpu"))[0]
    args = (t["splits"], t["probs"], t["fc1_weight"], t["fc2_weight"], t["fc1_bias"], t["fc2_bias"])
    assert K.grouped_mlp_fwd(t["x"], *args, with_recipe(cfg, "mxfp8"), keep_dgrad=(True, True))[2] == []
    assert K.grouped_mlp_fwd(t["x"], *args, cfg, keep_dgrad=(True, True))[2] == []  # no recipe
    assert quantize_weight_calls == []  # mxfp8 dequantizes its weights (dequantized_weight)


@interpreted
def test_cpu_one_quantize_weight_per_weight_and_step(quantize_weight_calls):
    # partial tiles: W1 (3, 32, 24), W2 (3, 24, 16) (H, F = 128, 32 took three times as long)
    p = make_problem([11, 0, 19], 24, 16, capacity=2, bias=True, seed=3)
    W1, W2 = tuple(p.fc1_weight.shape), tuple(p.fc2_weight.shape)
    cfg = MLPConfig(ACTIVATIONS["swiglu"], (), 16, False, from_key("fp8_block"))
    tensors = (p.splits, p.probs, p.fc1_weight, p.fc2_weight, p.fc1_bias, p.fc2_bias)
    detached = [t.detach() if t is not None else None for t in tensors]

    # Quantizing in the backward again (the backend functions without keep_dgrad / saved): four calls,
    # so the counter sees every call on this path.
    _, h = K.grouped_mlp_fwd(p.x.detach(), *detached, cfg)
    before = K.grouped_mlp_bwd(p.dy, p.x.detach(), h, *detached, cfg, (True,) * 6)
    assert sorted(quantize_weight_calls) == sorted([(W1, False), (W2, False), (W1, True), (W2, True)])

    # grouped_mlp: each weight once, with both layouts; the same gradients.
    quantize_weight_calls.clear()
    _, g = run(p, backend="triton", recipe="fp8_block")
    assert sorted(quantize_weight_calls) == sorted([(W1, True), (W2, True)])
    for name, ref in zip(GRAD_NAMES, before):
        assert torch.equal(g[name], ref), name

    # x needs no gradient: no FC1_DGRAD, W1 quantized for the forward alone.
    quantize_weight_calls.clear()
    x = p.x.detach()
    y = moemlp.grouped_mlp(
        x, p.splits, p.probs, p.fc1_weight, p.fc2_weight, p.fc1_bias, p.fc2_bias, backend="triton", recipe="fp8_block"
    )
    torch.autograd.grad(y, [p.fc1_weight, p.fc2_weight], p.dy)
    assert sorted(quantize_weight_calls) == sorted([(W1, False), (W2, True)])

    # Only db2 (no FC2_DGRAD): nothing kept.
    quantize_weight_calls.clear()
    w1, w2, b1 = (t.detach() for t in (p.fc1_weight, p.fc2_weight, p.fc1_bias))
    y = moemlp.grouped_mlp(x, p.splits, p.probs.detach(), w1, w2, b1, p.fc2_bias, backend="triton", recipe="fp8_block")
    torch.autograd.grad(y, [p.fc2_bias], p.dy)
    assert sorted(quantize_weight_calls) == sorted([(W1, False), (W2, False)])

    # No backward (no_grad): nothing kept, although the inputs require gradients.
    quantize_weight_calls.clear()
    with torch.no_grad():
        moemlp.grouped_mlp(p.x, p.splits, p.probs, p.fc1_weight, p.fc2_weight, backend="triton", recipe="fp8_block")
    assert sorted(quantize_weight_calls) == sorted([(W1, False), (W2, False)])

    # recompute_fc1: the backward's FC1 quantizes W1's forward codes again (a third call), and the
    # gradients stay the same bits.
    quantize_weight_calls.clear()
    _, g_rec = run(p, backend="triton", recipe="fp8_block", recompute_fc1=True)
    assert sorted(quantize_weight_calls) == sorted([(W1, True), (W2, True), (W1, False)])
    for name in g:
        assert torch.equal(g[name], g_rec[name]), name


@interpreted
def test_cpu_autograd_keeps_codes_t_and_scales_not_codes():
    p = make_problem([11, 0, 19], 128, 32, capacity=2, seed=3)  # W1 (3, 64, 128), W2 (3, 128, 32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        moemlp.grouped_mlp(p.x, p.splits, p.probs, p.fc1_weight, p.fc2_weight, backend="triton", recipe="fp8_block")
    fp8 = sorted(tuple(t.shape) for t in saved if t.dtype == torch.float8_e4m3fn)
    assert fp8 == sorted([(3, 128, 64), (3, 32, 128)])  # codes_t of W1 and W2 only, no (E, R, C) codes
    scales = sorted(tuple(t.shape) for t in saved if t.dtype == torch.float32 and t.dim() == 3)
    assert scales == sorted([(3, 1, 1), (3, 1, 1)])


def _small():
    # opcheck runs the op some ten times: W1 (3, 32, 16), W2 (3, 16, 16), one tile, one empty expert,
    # capacity rows (W1 (3, 48, 40) took 1.6x the time)
    return make((6, 0, 5), 16, 16, M=13, scale_fc2_bias=True)


def _op_args(t, key, backend="triton"):
    inputs = (t["x"], t["splits"], t["probs"], t["fc1_weight"], t["fc2_weight"], t["fc1_bias"], t["fc2_bias"])
    return inputs, ("swiglu", [], t["fc2_weight"].shape[2], True, key, backend)


@interpreted
def test_cpu_opcheck_forward_op():
    # The fake returns the real list structure: four tensors, a not-kept pair empty, or [].
    t, _ = _small()
    inputs, opts = _op_args(t, FP8)
    fwd = torch.ops.moemlp.grouped_mlp_fwd
    for keep in ([True, True], [False, True], [False, False]):
        torch.library.opcheck(fwd, inputs + opts + (keep, []))
    torch.library.opcheck(fwd, inputs + _op_args(t, "mxfp8")[1] + ([True, True], []))
    torch.library.opcheck(fwd, inputs + _op_args(t, FP8, "torch")[1] + ([True, True], []))


@interpreted
def test_cpu_opcheck_backward_op():
    t, _ = _small()
    inputs, opts = _op_args(t, FP8)
    _, h, saved = torch.ops.moemlp.grouped_mlp_fwd(*inputs, *opts, [True, True], [])
    args = (t["dy"], t["x"], h, *inputs[1:], *opts, [True] * 6, False, saved)
    # test_schema compares every input before and after with allclose, which the CPU does not
    # implement for float8_e4m3fn (torch 2.13); that saved is not mutated is checked on its bytes.
    before = [s.view(torch.uint8).clone() if s.dtype == torch.float8_e4m3fn else s.clone() for s in saved]
    torch.library.opcheck(
        torch.ops.moemlp.grouped_mlp_bwd, args,
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )  # fmt: skip
    grads = torch.ops.moemlp.grouped_mlp_bwd(*args)
    after = [s.view(torch.uint8) if s.dtype == torch.float8_e4m3fn else s for s in saved]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    again = torch.ops.moemlp.grouped_mlp_bwd(*args[:-1], [])  # quantizing again: the same bits
    for name, a, b in zip(GRADS, grads, again):
        assert torch.equal(a, b), name


@interpreted
def test_cpu_torch_compile_fullgraph():
    p = make_problem([9, 0, 14], 16, 16, capacity=2, bias=True, seed=12)  # one tile (128, 32: 2.5x the time)

    def f(x, probs, w1, w2, b1, b2):
        return moemlp.grouped_mlp(x, p.splits, probs, w1, w2, b1, b2, backend="triton", recipe="fp8_block")

    args = p.tensors()
    y = f(*args)
    yc = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(y, yc)
    for a, b in zip(torch.autograd.grad(y, args, p.dy), torch.autograd.grad(yc, args, p.dy)):
        assert torch.equal(a, b)


# --- no kernel launched: the checks of a Weight built from saved tensors ----------------------------


def test_weight_from_saved_checks_shapes_dtypes_and_recipe():
    r = from_key("fp8_block")
    w = torch.zeros(2, 200, 72, dtype=torch.bfloat16)  # (E, R, C): codes_t (2, 72, 200), scales (2, 2, 1)
    codes_t = torch.zeros(2, 72, 200, dtype=torch.float8_e4m3fn)
    scales = torch.ones(2, 2, 1)
    weight = _operands.Weight.from_saved(w, r, codes_t, scales)
    op = weight.dgrad()  # no quantizer pass: the saved tensors themselves
    assert op.b is codes_t and op.scales is scales
    assert _operands.saved_dgrad_like((w,), r, (True,))[0].shape == codes_t.shape
    with pytest.raises(ValueError, match=r"codes_t: expected shape \(2, 72, 200\)"):
        _operands.Weight.from_saved(w, r, codes_t.transpose(1, 2).contiguous(), scales)
    with pytest.raises(ValueError, match=r"scales: expected shape \(2, 2, 1\)"):
        _operands.Weight.from_saved(w, r, codes_t, torch.ones(2, 1, 2))
    with pytest.raises(TypeError, match="codes_t: expected torch.float8_e4m3fn"):
        _operands.Weight.from_saved(w, r, codes_t.view(torch.uint8), scales)
    with pytest.raises(ValueError, match="codes_t: expected a contiguous"):
        _operands.Weight.from_saved(w, r, torch.zeros(2, 200, 72, dtype=torch.float8_e4m3fn).transpose(1, 2), scales)
    with pytest.raises(ValueError, match="fp8_block only"):
        _operands.Weight.from_saved(w, from_key("mxfp8"), codes_t, scales)
    with pytest.raises(ValueError, match="saved: expected codes_t and scales of each of 2 weights"):
        _operands.dgrad_weights((w, w), r, [codes_t, scales])
    assert _operands.saved_dgrad_like((w, w), from_key("mxfp8"), (True, True)) == []
    assert _operands.saved_dgrad_like((w, w), r, (False, False)) == []
