"""The torch backend against float64 and against PyTorch's own composition (SPEC §1)."""

import pytest
import torch

import moemlp
from _cases import ConversionRecorder, make_problem, rel_err, run, run_composition
from moemlp import reference
from moemlp.activations import ACTIVATIONS

GLU_ACTS = [n for n, s in ACTIVATIONS.items() if s.glu]
UNARY_ACTS = [n for n, s in ACTIVATIONS.items() if not s.glu]
# Small limits / betas so the clamps and saturations are hit by N(0, 1)-ish pre-activations.
PARAMS = {"clamped_swiglu": {"limit": 0.75, "alpha": 1.702, "offset": 1.0},
          "situglu": {"beta1": 0.8, "beta2": 1.5}}


# --- float64 gradcheck over activation × interleave × bias × scaled bias ------------------------

_GRADCHECK_CASES = []
for act in GLU_ACTS + UNARY_ACTS:
    for inter in ((None, 2) if ACTIVATIONS[act].glu else (None,)):
        for bias, scale in ((False, False), (True, False), (True, True)):
            _GRADCHECK_CASES.append(pytest.param(act, inter, bias, scale,
                                                 id=f"{act}-g{inter}-bias{int(bias)}-scale{int(scale)}"))


@pytest.mark.parametrize("activation,interleave,bias,scale", _GRADCHECK_CASES)
def test_gradcheck_float64(activation, interleave, bias, scale):
    # splits [3, 0, 4] + 2 capacity rows: an empty expert and padding in every case.
    p = make_problem([3, 0, 4], 6, 4, capacity=2, activation=activation, bias=bias,
                     dtype=torch.float64, probs_dtype=torch.float64, seed=1,
                     activation_params=PARAMS.get(activation), glu_interleave=interleave,
                     scale_fc2_bias=scale)
    names = ("x", "probs", "fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias")
    tensors = [t for t in p.tensors() if t is not None]

    def f(*ts):
        d = dict(zip([n for n, t in zip(names, p.tensors()) if t is not None], ts))
        return moemlp.grouped_mlp(d["x"], p.splits, d["probs"], d["fc1_weight"], d["fc2_weight"],
                                  d.get("fc1_bias"), d.get("fc2_bias"), backend="torch", **p.kwargs)

    assert torch.autograd.gradcheck(f, tensors, atol=1e-7, rtol=1e-5)


# --- low-precision accuracy: within 2× PyTorch's own same-dtype composition ----------------------

# The 1e-6 floor is fp32 rounding of O(1) values: for fp32 compute the composition itself sits
# there, and 2× a number that small is within accumulation-order noise.
_FLOOR = 1e-6


def _check_against_composition(p, dtype, probs_dtype):
    lo = p.cast(dtype, probs_dtype)
    y, grads = run(lo, backend="torch")
    y_c, grads_c = run_composition(lo)
    y64, grads64 = run(p.cast(torch.float64, torch.float64), backend="torch")
    errs = {"y": (rel_err(y, y64), rel_err(y_c, y64))}
    for name in grads64:
        errs[name] = (rel_err(grads[name], grads64[name]), rel_err(grads_c[name], grads64[name]))
    for name, (ours, theirs) in errs.items():
        assert ours <= 2 * theirs + _FLOOR, f"{name}: ours {ours:.3e} vs composition {theirs:.3e}"
    assert y.dtype == dtype and grads["x"].dtype == dtype
    if "probs" in grads:
        assert grads["probs"].dtype == probs_dtype
    return errs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("probs_dtype", [torch.float32, torch.bfloat16], ids=["p32", "pbf16"])
@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu", "srelu"])
def test_low_precision_vs_composition(dtype, probs_dtype, activation):
    p = make_problem([40, 0, 23, 65], 64, 48, capacity=5, activation=activation, bias=True,
                     dtype=torch.float64, probs_dtype=torch.float64, seed=2,
                     scale_fc2_bias=True, activation_params=PARAMS.get(activation))
    # Round the float64 draw to the compute dtype first: every evaluation sees the same operands.
    p = p.cast(dtype, probs_dtype).cast(torch.float64, torch.float64)
    _check_against_composition(p, dtype, probs_dtype)


# --- edge cases -----------------------------------------------------------------------------

EDGE_CASES = [
    # (splits, capacity, H, F): what it exercises
    pytest.param([5, 0, 7], 0, 16, 8, id="empty-expert"),  # an expert with no rows
    pytest.param([12], 0, 16, 8, id="one-expert"),  # E = 1
    pytest.param([3, 1, 4, 1, 5, 9, 2], 0, 16, 8, id="E-prime"),  # E = 7
    pytest.param([4, 6], 9, 16, 8, id="capacity-rows"),  # 9 padding rows past Σsplits
    pytest.param([5, 6], 0, 7, 5, id="odd-H-F"),  # H = 7, F = 5
    pytest.param([1, 2], 0, 16, 8, id="fewer-rows-than-a-block"),  # M = 3
    pytest.param([0, 0, 11, 0], 2, 16, 8, id="all-rows-one-expert"),  # one expert takes all
]


@pytest.mark.parametrize("splits,capacity,H,F", EDGE_CASES)
def test_edge_cases(splits, capacity, H, F):
    p = make_problem(splits, H, F, capacity=capacity, bias=True, dtype=torch.float64,
                     probs_dtype=torch.float64, seed=3)
    p = p.cast(torch.bfloat16, torch.float32).cast(torch.float64, torch.float64)
    _check_against_composition(p, torch.bfloat16, torch.float32)
    y, grads = run(p.cast(torch.bfloat16, torch.float32), backend="torch")
    T = sum(splits)
    # Capacity rows: outputs and gradients exactly 0.
    assert torch.equal(y[T:], torch.zeros_like(y[T:]))
    assert torch.equal(grads["x"][T:], torch.zeros_like(grads["x"][T:]))
    assert torch.equal(grads["probs"][T:], torch.zeros_like(grads["probs"][T:]))
    # Experts with no rows: weight and bias gradients exactly 0.
    for e, n in enumerate(splits):
        if n == 0:
            for name in ("fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias"):
                assert torch.equal(grads[name][e], torch.zeros_like(grads[name][e])), name


def test_interleave_is_a_column_permutation():
    # glu_interleave=g must equal the halves layout after permuting fc1's rows the same way.
    p = make_problem([6, 5], 16, 8, dtype=torch.float64, probs_dtype=torch.float64, seed=4)
    g, F = 2, 8
    perm = torch.arange(2 * F).reshape(2, F // g, g).transpose(0, 1).reshape(-1)  # halves -> blocks
    y_halves = moemlp.grouped_mlp(p.x, p.splits, p.probs, p.fc1_weight, p.fc2_weight, backend="torch")
    y_inter = moemlp.grouped_mlp(p.x, p.splits, p.probs, p.fc1_weight[:, perm], p.fc2_weight,
                                 glu_interleave=g, backend="torch")
    torch.testing.assert_close(y_inter, y_halves, rtol=0, atol=1e-12)


def test_probs_none_equals_ones():
    p = make_problem([6, 5], 16, 8, dtype=torch.float64, probs_dtype=torch.float64, seed=5)
    ones = torch.ones_like(p.probs)
    y1 = moemlp.grouped_mlp(p.x, p.splits, ones, p.fc1_weight, p.fc2_weight, backend="torch")
    y0 = moemlp.grouped_mlp(p.x, p.splits, None, p.fc1_weight, p.fc2_weight, backend="torch")
    assert torch.equal(y0, y1)


# --- the probability contract -------------------------------------------------------------------


@pytest.mark.parametrize("probs_dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["p32", "pbf16", "pfp16"])
def test_dprobs_dtype(probs_dtype):
    p = make_problem([7, 9], 16, 8, probs_dtype=probs_dtype, seed=6)
    _, grads = run(p, backend="torch")
    assert grads["probs"].dtype == probs_dtype


def _dprobs_float64(p, h):
    """Σ_f g_z·a in float64 on the same rounded operands: dy, fc2_weight and the stored h."""
    from moemlp._config import MLPConfig

    spec = ACTIVATIONS[p.kwargs["activation"]]
    F = p.fc2_weight.shape[-1]
    cfg = MLPConfig(spec, (), F, False)
    out = torch.zeros(p.x.shape[0], dtype=torch.float64)
    start = 0
    for e, n in enumerate(p.splits.tolist()):
        rows = slice(start, start + n)
        g_z = p.dy[rows].double() @ p.fc2_weight[e].double()
        a = reference.activate(h[rows].double(), cfg)
        out[rows] = (g_z * a).sum(-1)
        start += n
    return out


@pytest.mark.parametrize("seed", [7, 8])
def test_dprobs_fp32_exact_to_1e5(seed):
    # Fresh inputs per seed; bf16 operands, fp32 probs: fp32-accumulation level against float64.
    p = make_problem([37, 0, 64, 29], 128, 96, seed=seed)
    from moemlp._config import MLPConfig

    cfg = MLPConfig(ACTIVATIONS["swiglu"], (), 96, False)
    _, h = reference.grouped_mlp_fwd(p.x.detach(), p.splits, p.probs.detach(), p.fc1_weight.detach(),
                                     p.fc2_weight.detach(), None, None, cfg)
    _, grads = run(p, backend="torch")
    err = rel_err(grads["probs"], _dprobs_float64(p, h))
    assert err <= 1e-5, err
    # The unfused bf16 composition, for contrast, sits at bf16 level (the reason moemlp exists).
    _, grads_c = run_composition(p)
    assert rel_err(grads_c["probs"], _dprobs_float64(p, h)) > 10 * err


def test_no_conversion_of_dprobs_in_backward():
    p = make_problem([13, 0, 21], 32, 16, capacity=3, seed=9)
    M = p.x.shape[0]
    y = moemlp.grouped_mlp(p.x, p.splits, p.probs, p.fc1_weight, p.fc2_weight, backend="torch")
    # The whole autograd backward: the op's dprobs is returned as it is.
    with ConversionRecorder((M,)) as rec:
        (dprobs,) = torch.autograd.grad(y, [p.probs], p.dy)
    assert dprobs.dtype == torch.float32
    assert rec.conversions == [], rec.conversions
    assert "grouped_mlp_bwd" in rec.ops
    # Inside the backend function too (the custom op is opaque to the mode above).
    from moemlp._config import MLPConfig

    cfg = MLPConfig(ACTIVATIONS["swiglu"], (), 16, False)
    x, w1, w2, probs = (t.detach() for t in (p.x, p.fc1_weight, p.fc2_weight, p.probs))
    _, h = reference.grouped_mlp_fwd(x, p.splits, probs, w1, w2, None, None, cfg)
    with ConversionRecorder((M,)) as rec:
        _, dprobs2, *_ = reference.grouped_mlp_bwd(p.dy, x, h, p.splits, probs, w1, w2, None, None,
                                                   cfg, (False, True, False, False, False, False))
    assert rec.conversions == [], rec.conversions
    assert torch.equal(dprobs2, dprobs)
    # The recorder does see a conversion when there is one (the test can fail).
    with ConversionRecorder((M,)) as rec:
        torch.zeros(M, dtype=torch.bfloat16).to(torch.float32)
    assert rec.conversions


def test_backward_is_bitwise_deterministic():
    p = make_problem([50, 0, 31, 77], 64, 32, bias=True, seed=10, scale_fc2_bias=True)
    _, g1 = run(p, backend="torch")
    _, g2 = run(p, backend="torch")
    for name in g1:
        assert torch.equal(g1[name], g2[name]), name


# --- memory kept for backward -----------------------------------------------------------------


def test_saved_tensors_are_x_h_probs_weights():
    p = make_problem([13, 0, 21], 32, 16, capacity=3, seed=11)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        moemlp.grouped_mlp(p.x, p.splits, p.probs, p.fc1_weight, p.fc2_weight, backend="torch")
    shapes = sorted(tuple(t.shape) for t in saved)
    M = p.x.shape[0]
    expected = sorted([(M, 32), (M, 32), (3,), (M,), (3, 32, 32), (3, 32, 16)])  # x, h, splits, probs, W1, W2
    assert shapes == expected
    h = [t for t in saved if tuple(t.shape) == (M, 32) and t is not p.x]
    assert len(h) == 1 and h[0].dtype == torch.bfloat16  # h kept in the compute dtype


# --- torch.compile --------------------------------------------------------------------------------


def test_torch_compile_fullgraph_same_numbers():
    p = make_problem([9, 0, 14], 32, 16, capacity=2, bias=True, seed=12)

    def f(x, probs, w1, w2, b1, b2):
        return moemlp.grouped_mlp(x, p.splits, probs, w1, w2, b1, b2, backend="torch")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    args = p.tensors()
    y = f(*args)
    yc = compiled(*args)
    assert torch.equal(y, yc)
    g = torch.autograd.grad(y, args, p.dy)
    gc = torch.autograd.grad(yc, args, p.dy)
    for a, b in zip(g, gc):
        assert torch.equal(a, b)


def test_bias_gradients_asked_without_biases_are_none():
    # The backend contract: a bias gradient asked for with no bias is None, not a crash.
    from moemlp._config import MLPConfig

    p = make_problem([5, 6], 16, 8, seed=13)
    cfg = MLPConfig(ACTIVATIONS["swiglu"], (), 8, False)
    x, w1, w2, probs = (t.detach() for t in (p.x, p.fc1_weight, p.fc2_weight, p.probs))
    _, h = reference.grouped_mlp_fwd(x, p.splits, probs, w1, w2, None, None, cfg)
    grads = reference.grouped_mlp_bwd(p.dy, x, h, p.splits, probs, w1, w2, None, None, cfg, (True,) * 6)
    assert grads[4] is None and grads[5] is None
    assert grads[3] is not None and torch.isfinite(grads[3].float()).all()
