"""SPEC §2: every bad input raises ValueError / TypeError naming the argument, before any compute."""

import pytest
import torch

import moemlp

E, H, F, M = 3, 16, 8, 12


def _good(**over):
    args = dict(
        x=torch.randn(M, H, dtype=torch.bfloat16),
        splits=torch.tensor([4, 0, 6]),
        probs=torch.rand(M),
        fc1_weight=torch.randn(E, 2 * F, H, dtype=torch.bfloat16),
        fc2_weight=torch.randn(E, H, F, dtype=torch.bfloat16),
        fc1_bias=None,
        fc2_bias=None,
    )
    kwargs = {}
    for k, v in over.items():
        (args if k in args else kwargs)[k] = v
    return args, kwargs


BAD = [
    # (override, exception, words the message must contain)
    pytest.param(dict(x=torch.randn(M, H, 1)), ValueError, ["x", "2 dimensions"], id="x-3d"),
    pytest.param(dict(x=torch.randn(M, H).to(torch.int32)), TypeError, ["x", "int32"], id="x-int"),
    pytest.param(dict(x=[[1.0]]), TypeError, ["x", "Tensor"], id="x-list"),
    pytest.param(dict(fc1_weight=torch.randn(E, 2 * F, H + 1, dtype=torch.bfloat16)), ValueError,
                 ["fc1_weight", "H"], id="fc1-H-mismatch"),
    pytest.param(dict(fc1_weight=torch.randn(E, 2 * F + 1, H, dtype=torch.bfloat16)), ValueError,
                 ["fc1_weight", "even"], id="N1-odd-glu"),
    pytest.param(dict(fc2_weight=torch.randn(E, H, F + 1, dtype=torch.bfloat16)), ValueError,
                 ["fc2_weight", "F = 8"], id="F-mismatch"),
    pytest.param(dict(fc2_weight=torch.randn(E + 1, H, F, dtype=torch.bfloat16)), ValueError,
                 ["fc2_weight", "E = 3"], id="E-mismatch"),
    pytest.param(dict(fc2_weight=torch.randn(E, H, F)), TypeError, ["fc2_weight", "float32"],
                 id="weight-dtype"),
    pytest.param(dict(probs=torch.rand(M + 1)), ValueError, ["probs", f"({M},)"], id="probs-length"),
    pytest.param(dict(probs=torch.rand(M).to(torch.float64)), TypeError, ["probs", "float64"],
                 id="probs-fp64-with-bf16"),
    pytest.param(dict(probs=torch.ones(M, dtype=torch.int64)), TypeError, ["probs"], id="probs-int"),
    pytest.param(dict(splits=torch.tensor([4, -1, 6])), ValueError, ["splits", ">= 0"],
                 id="splits-negative"),
    pytest.param(dict(splits=torch.tensor([4, 5, 6])), ValueError, ["splits", "15", "12"],
                 id="splits-past-M"),
    pytest.param(dict(splits=torch.tensor([4.0, 0.0, 6.0])), TypeError, ["splits", "int"],
                 id="splits-float"),
    pytest.param(dict(splits=torch.tensor([4, 6])), ValueError, ["splits", "(3,)"],
                 id="splits-length"),
    pytest.param(dict(fc1_bias=torch.randn(E, F, dtype=torch.bfloat16)), ValueError,
                 ["fc1_bias", "(3, 16)"], id="fc1-bias-shape"),
    pytest.param(dict(fc2_bias=torch.randn(E, H)), TypeError, ["fc2_bias", "float32"],
                 id="fc2-bias-dtype"),
    pytest.param(dict(activation="relu3"), ValueError, ["activation", "relu3", "swiglu"],
                 id="unknown-activation"),
    pytest.param(dict(activation="clamped_swiglu", activation_params={"limit": -1.0}), ValueError,
                 ["activation_params", "limit"], id="limit-negative"),
    pytest.param(dict(activation="situglu", activation_params={"beta1": float("inf")}), ValueError,
                 ["activation_params", "beta1"], id="beta-inf"),
    pytest.param(dict(activation="swiglu", activation_params={"limit": 1.0}), ValueError,
                 ["activation_params", "limit"], id="param-not-taken"),
    pytest.param(dict(glu_interleave=3), ValueError, ["glu_interleave", "F = 8"],
                 id="interleave-not-dividing"),
    pytest.param(dict(glu_interleave=0), ValueError, ["glu_interleave"], id="interleave-zero"),
    pytest.param(dict(activation="srelu", glu_interleave=2,
                      fc1_weight=torch.randn(E, F, H, dtype=torch.bfloat16)), ValueError,
                 ["glu_interleave", "GLU"], id="interleave-unary"),
    # x is the odd one out when both weights agree on H: the message names x, not fc1_weight.
    pytest.param(dict(x=torch.randn(M, H + 2, dtype=torch.bfloat16)), ValueError,
                 ["x", f"(M, {H})", "fc1_weight and fc2_weight"], id="x-H-mismatch"),
    # A unary activation with GLU-shaped weights: says the activation is not a GLU.
    pytest.param(dict(activation="gelu"), ValueError, ["fc1_weight", "'gelu' is not a GLU", "2F"],
                 id="unary-with-glu-weights"),
    # A GLU activation with unary-shaped weights: says it needs gate and up.
    pytest.param(dict(fc1_weight=torch.randn(E, F, H, dtype=torch.bfloat16)), ValueError,
                 ["fc1_weight", "'swiglu' is a GLU", f"N1 = 2F = {2 * F}"], id="glu-with-unary-weights"),
    pytest.param(dict(activation="clamped_swiglu", activation_params=[7.0]), TypeError,
                 ["activation_params", "mapping", "list"], id="params-list"),
    pytest.param(dict(activation="clamped_swiglu", activation_params="limit"), TypeError,
                 ["activation_params", "mapping", "str"], id="params-str"),
    # H = 0 passed every shape check, and the Triton backward left db1 uninitialized
    pytest.param(dict(x=torch.randn(M, 0, dtype=torch.bfloat16),
                      fc1_weight=torch.randn(E, 2 * F, 0, dtype=torch.bfloat16),
                      fc2_weight=torch.randn(E, 0, F, dtype=torch.bfloat16)), ValueError, ["x", "H >= 1", "(12, 0)"],
                 id="hidden-zero"),
    pytest.param(dict(backend="cuda"), ValueError, ["backend", "cuda"], id="unknown-backend"),
    pytest.param(dict(recipe="int4"), ValueError, ["recipe", "int4"], id="unknown-recipe"),
    pytest.param(dict(scale_fc2_bias="yes"), TypeError, ["scale_fc2_bias"], id="scale-not-bool"),
]


@pytest.mark.parametrize("override,exc,words", BAD)
def test_bad_input_raises(override, exc, words):
    args, kwargs = _good(**override)
    with pytest.raises(exc) as info:
        moemlp.grouped_mlp(**args, backend=kwargs.pop("backend", "torch"), **kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_good_input_passes():
    args, kwargs = _good()
    y = moemlp.grouped_mlp(**args, backend="torch")
    assert y.shape == (M, H) and torch.isfinite(y).all()


def test_fp64_on_triton_backend_is_refused():
    args, _ = _good()
    args = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in args.items()}
    with pytest.raises(ValueError, match="backend"):
        moemlp.grouped_mlp(**args, backend="triton")


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args, _ = _good()
    with pytest.raises(ValueError, match="backend: 'triton' cannot run"):
        moemlp.grouped_mlp(**args, backend="triton")


def test_nan_stays_in_its_row():
    # NaN in one row of x propagates to that row's output only, and to no other row.
    args, _ = _good()
    args["x"][2, 3] = float("nan")
    y = moemlp.grouped_mlp(**args, backend="torch")
    assert torch.isnan(y[2]).all()
    assert torch.isfinite(y[torch.arange(M) != 2]).all()


def test_module_validates_at_construction():
    with pytest.raises(ValueError, match="activation"):
        moemlp.GroupedMLP(num_experts=4, hidden_size=16, ffn_hidden_size=8, activation="nope")
    with pytest.raises(ValueError, match="glu_interleave"):
        moemlp.GroupedMLP(num_experts=4, hidden_size=16, ffn_hidden_size=8, glu_interleave=3)
    with pytest.raises(ValueError, match="num_experts"):
        moemlp.GroupedMLP(num_experts=0, hidden_size=16, ffn_hidden_size=8)


def test_module_sizes_are_keyword_only():
    # GroupedMLP(64, 32, 4) once built 64 experts of H=32, F=4 without a word; the sizes of both
    # modules are keyword-only now, so a positional call is refused.
    with pytest.raises(TypeError):
        moemlp.GroupedMLP(64, 32, 4)
    with pytest.raises(TypeError):
        moemlp.MoE(64, 32, 8, 2)
    m = moemlp.MoE(hidden_size=64, ffn_hidden_size=32, num_experts=8, top_k=2)
    assert m.experts.fc1_weight.shape == (8, 64, 64) and m.router.weight.shape == (8, 64)


@pytest.mark.parametrize("kw,exc,word", [
    pytest.param(dict(backend="trition"), ValueError, "trition", id="backend-typo"),
    pytest.param(dict(backend=None), TypeError, "backend", id="backend-not-str"),
    pytest.param(dict(bias=1), TypeError, "bias", id="bias-not-bool"),
    pytest.param(dict(recompute_fc1="no"), TypeError, "recompute_fc1", id="recompute-not-bool"),
    pytest.param(dict(dtype=torch.int32), TypeError, "dtype", id="dtype-int"),
    pytest.param(dict(dtype=torch.float8_e4m3fn), TypeError, "dtype", id="dtype-fp8"),
    pytest.param(dict(activation="clamped_swiglu", activation_params=[7.0]), TypeError, "activation_params",
                 id="params-list"),
])
def test_module_options_fail_at_construction(kw, exc, word):
    with pytest.raises(exc, match=word):
        moemlp.GroupedMLP(num_experts=4, hidden_size=16, ffn_hidden_size=8, **kw)


def test_missing_triton_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    args, _ = _good()
    with pytest.raises(ValueError, match=r"pip install 'moemlp\[triton\]'"):
        moemlp.grouped_mlp(**args, backend="triton")
