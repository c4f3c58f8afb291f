"""The Triton grouped MLP under each recipe (SPEC §3) against the torch backend's emulation of the
same recipe (reference.py through the torch reference quantizers), and the probability contract.

What must agree, and how closely:

* The quantized operands are bit for bit the reference's (tests/kernels/test_quant.py and
  tests/test_dequantized_triton.py check the quantizers); the GEMMs then differ only in fp32
  accumulation order (fp8_block: the promoted 128-deep steps, tests/kernels/test_gemm_fp8.py and
  kernels/test_fp8_wgrad.py bound them).
* h (FC1's output, stored in x.dtype) therefore equals the reference's or is one bf16 ulp away.
* Everything after a second quantization (z for FC2, g_h for dx and dW1) could flip a code where an
  fp32 value sits on a rounding boundary of the recipe's element format; with order noise ~1e-7 of
  the value and ulps of 2^-4 (e4m3) or 2^-2 (e2m1) that is rare. Each output's relative RMS
  difference to the reference is bounded by ORDER_RTOL, three orders under the recipe's own error
  (fp8: ~3e-2, nvfp4: ~0.2 relative RMS against the unquantized float64 result).
* dprobs keep the contract under every recipe: fp32 in fp32 out, no conversion op, bitwise
  repeatable; and within 1e-5 of the reference's dprobs on the same stored h.

On a CPU-only machine the cases run under TRITON_INTERPRET=1 in a child pytest (tests/_triton_env.py).
"""

from __future__ import annotations

import pytest
import torch

import _triton_env
from _cases import ConversionRecorder
from moemlp import kernels as K
from moemlp import reference as R
from moemlp._config import MLPConfig
from moemlp.recipes import from_key
from test_triton_backend import GRADS, make

interpreted = pytest.mark.skipif(
    not _triton_env.RUN_CPU_CASES,
    reason="CPU cases: run under TRITON_INTERPRET=1 in the child of test_cpu_cases_under_interpreter",
)

RECIPES = [
    "fp8_block:pow2_scales=1",
    "fp8_block:pow2_scales=0",
    "mxfp8",
    "nvfp4:hadamard=0,stochastic_rounding=0",
    "nvfp4:hadamard=1,stochastic_rounding=1",
]

# Relative RMS difference to the torch emulation of the same recipe. Measured on the CPU cases below:
# 0 to 3e-7 where no code flipped (fp32 order noise); 2.5e-5 on dW1 under fp8_block
# with pow2_scales=False, where a block scale 448/amax follows every ulp of noise in its amax and one
# e4m3 code of g_h moved. A wrong scale, row or expert costs ≥ 1e-2. On Hopper the fp8_block partial
# sums keep ~14 bits (rel RMS 1.3e-4 per GEMM against an exact-fp32 emulation, H200).
#
# fp8_block on Hopper is looser for a reason of its own: the FP8 partial sums (rel RMS 1.3e-4 against
# the exact-fp32 emulation) move z and g_h across e4m3 rounding boundaries (code spacing 2^-3..2^-4
# of the value) with probability ~1.3e-4 / 0.09 ≈ 1.4e-3 per element, each a full code step, so the
# outputs after the second quantization differ by ~sqrt(1.4e-3)·0.09 ≈ 3.4e-3 relative RMS. The
# bound takes 3x that (1e-2), still 6x under the recipe's own error against float64 (23.7 dB: 6.5e-2).
# The emulated recipes run on bf16 tensor cores (exact products, fp32 sums): measured on the H200
# 1.6e-5..5.4e-4 (nvfp4's 2^-1 code steps make its rare flips larger).
ORDER_RTOL = {"cpu": 1e-3, "cuda": 2e-3, "cuda-fp8": 1e-2}
# dprobs = Σ g_z·a with g_z from the FC2-dgrad GEMM: fp32-level (SPEC §1's 1e-5) wherever the GEMM
# sums in fp32 (the CPU, the emulated recipes on bf16 tensor cores: 1.3e-7..5.6e-7 on the H200). Under
# fp8_block on Hopper g_z carries the FP8 tensor cores' 128-deep partial sums (~14 bits): dprobs was
# 1.27e-4 and 1.29e-4 from the exact-fp32 emulation on mixtral_like (H200), against a
# recipe error of ~3e-2 from float64. Bound: 4x the measurement.
DPROBS_RTOL = {False: 1e-5, True: 5e-4}
STOCHASTIC_DB = 1.0


@pytest.mark.interpreter_child(seconds=100)
@pytest.mark.skipif(not _triton_env.START_CHILD, reason="runs the CPU cases in a child on a CPU-only machine")
def test_cpu_cases_under_interpreter():
    _triton_env.run_file_interpreted(__file__)


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def with_recipe(cfg, key):
    return MLPConfig(cfg.activation, cfg.activation_params, cfg.glu_interleave, cfg.scale_fc2_bias, from_key(key))


def compare(t, cfg, device):
    """Triton and torch backends on one problem; asserts the module docstring's agreement and
    returns the measured relative differences."""
    bias = t["fc1_bias"] is not None
    needs = (True, t["probs"] is not None, True, True, bias, bias)
    args = (t["splits"], t["probs"], t["fc1_weight"], t["fc2_weight"], t["fc1_bias"], t["fc2_bias"])
    y, h = K.grouped_mlp_fwd(t["x"], *args, cfg)
    y_r, h_r = R.grouped_mlp_fwd(t["x"], *args, cfg)
    assert h.dtype == h_r.dtype and y.dtype == y_r.dtype
    # h: the same quantized operands, fp32 sums in another order, one rounding to x.dtype. On the
    # CPU (numpy's fp32 matmul) that is at most one ulp of h; on Hopper the sums are the tensor cores'
    # (fp8_block: ~14-bit 128-deep partials; bf16: truncating fp32 adds), an error relative to
    # |x|·|w| that a cancelling h does not bound, so there the relative RMS is checked.
    if device == "cpu":
        ulp = torch.finfo(h.dtype).eps
        assert ((h.double() - h_r.double()).abs() <= ulp * h_r.double().abs() + 1e-30).all(), "h"
    else:
        assert _rel(h, h_r) <= ORDER_RTOL["cuda"], ("h", _rel(h, h_r))  # one GEMM, no flipped code
    grads = K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, needs)
    grads_r = R.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, needs)  # on the backend's own h
    rels = {"y": _rel(y, y_r)}
    for name, a, b in zip(GRADS, grads, grads_r):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        rels[name] = _rel(a, b)
    fp8_gpu = device == "cuda" and cfg.recipe.name == "fp8_block"
    limit = ORDER_RTOL["cuda-fp8" if fp8_gpu else device]
    stochastic = getattr(cfg.recipe, "stochastic_rounding", False)
    if stochastic:
        # Stochastic rounding draws each element's random bits from a hash of its index and value
        # bits: g_h (an fp32 epilogue output, order noise in its last bits) draws other numbers than
        # the reference's, so dW1 agrees in distribution only: its SNR against the unquantized
        # float64 gradient must match the reference's within STOCHASTIC_DB.
        cfg64 = MLPConfig(cfg.activation, cfg.activation_params, cfg.glu_interleave, cfg.scale_fc2_bias)
        f64 = [None if v is None else v.double() for v in args]
        exact = R.grouped_mlp_bwd(t["dy"].double(), t["x"].double(), h.double(), *f64, cfg64, needs)[2]
        ours_db, ref_db = _snr_db(grads[2], exact), _snr_db(grads_r[2], exact)
        assert abs(ours_db - ref_db) <= STOCHASTIC_DB, (ours_db, ref_db)
        rels.pop("dw1")
    bad = {k: v for k, v in rels.items() if v > (DPROBS_RTOL[fp8_gpu] if k == "dprobs" else limit)}
    assert not bad, (bad, rels)
    return rels, grads


def _snr_db(a, ref):
    a, ref = a.double(), ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (a - ref).pow(2).sum()))


@interpreted
@pytest.mark.parametrize("key", RECIPES)
def test_cpu_matches_torch_emulation(key):
    # fp8_block: H = 160, e4m3 code rows 16-byte aligned (TMA), FC1's reduction a full and a partial
    # 128-block. mxfp8 / nvfp4: their GEMMs read bf16 values, H = 56 (112-byte rows) ends in a partial
    # 32- / 16-block. F = 24: FC2's reduction is one partial 128- / 32-block, 1.5 16-blocks. An empty
    # expert, capacity rows, biases with fc2 bias scaled by probs; 20 rows: a full 16-row group and a
    # partial one for nvfp4's Hadamard rotation. (make((20, 0, 17, 23), 160, 48, M=70) for every recipe
    # took 126 s for the five under the interpreter.)
    H = 160 if key.startswith("fp8_block") else 56
    t, cfg = make((20, 0, 9), H, 24, M=34, scale_fc2_bias=True)
    rels, _ = compare(t, with_recipe(cfg, key), "cpu")
    print(key, {k: f"{v:.1e}" for k, v in rels.items()})


@interpreted
@pytest.mark.parametrize("key", ["fp8_block:pow2_scales=1", "mxfp8"])
def test_cpu_odd_sizes_unary_activation_fp32(key):
    # H = 72: fp8 codes take the masked-pointer mainloop; gelu (no GLU); fp32 compute and no probs
    t, cfg = make((9, 1, 0, 14), 72, 40, M=30, activation="gelu", dtype=torch.float32, probs_dtype=None)
    compare(t, with_recipe(cfg, key), "cpu")


@interpreted
def test_cpu_interleaved_glu_fp16():
    # interleave 32 of F = 64; H = 48, a partial 128-block (H = 128 took 1.5x the time)
    t, cfg = make((13, 9, 17), 48, 64, interleave=32, dtype=torch.float16, probs_dtype=torch.float16)
    compare(t, with_recipe(cfg, "fp8_block:pow2_scales=1"), "cpu")


@interpreted
@pytest.mark.parametrize("key", ["fp8_block:pow2_scales=1", "nvfp4:hadamard=0,stochastic_rounding=0"])
def test_cpu_dprobs_contract(key):
    """fp32 probs: dprobs fp32, written by the reducing kernel (no conversion op), bitwise repeatable."""
    # partial tiles and blocks (H, F = 128, 48 took 71 s for the two recipes)
    t, cfg = make((15, 4, 0, 21), 48, 24, M=44)
    cfg = with_recipe(cfg, key)
    args = (t["splits"], t["probs"], t["fc1_weight"], t["fc2_weight"], t["fc1_bias"], t["fc2_bias"])
    _, h = K.grouped_mlp_fwd(t["x"], *args, cfg)
    needs = (True,) * 6
    with ConversionRecorder(t["probs"].shape) as rec:
        first = K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, needs)
    assert first[1].dtype == torch.float32 and rec.conversions == [], rec.conversions
    second = K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, needs)
    for name, a, b in zip(GRADS, first, second):
        assert torch.equal(a, b), f"{name} differs between two identical backward calls"


@interpreted
@pytest.mark.parametrize("key", ["fp8_block", "mxfp8"])
def test_cpu_backward_builds_the_wgrad_row_blocks_once(key, monkeypatch):
    # The four wgrad operands of a backward share one row-block layout (same splits and rows): one
    # computation of its ~12 torch ops instead of four, host launch time that the small shapes pay
    # (qwen3 ran host-bound on the H200).
    from moemlp.kernels.quant import api as kq

    calls = []
    real = kq._row_blocks
    monkeypatch.setattr(kq, "_row_blocks", lambda *a: calls.append(a[1:3]) or real(*a))
    # A count on the host: the smallest problem with an empty expert and capacity rows (on
    # make((15, 4, 0, 21), 128, 48, M=44) the two cases took 34 s under the interpreter)
    t, cfg = make((5, 2, 0, 7), 32, 16, M=16)
    cfg = with_recipe(cfg, key)
    args = (t["splits"], t["probs"], t["fc1_weight"], t["fc2_weight"], t["fc1_bias"], t["fc2_bias"])
    _, h = K.grouped_mlp_fwd(t["x"], *args, cfg)
    calls.clear()
    K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, (True,) * 6)
    assert calls == [(16, cfg.recipe.block)], calls


def _one_read_against_two(t, cfg, needs, monkeypatch):
    """grouped_mlp_bwd under a one_read recipe with dy's and g_h's operands from one pass each
    (``operands.both``) and with the separate passes: returns (both's calls, the dequantized_wgrad calls of each, the
    two backwards' gradients)."""
    from moemlp.kernels import operands
    from moemlp.kernels.quant import api as kq

    args = (t["splits"], t["probs"], t["fc1_weight"], t["fc2_weight"], t["fc1_bias"], t["fc2_bias"])
    _, h = K.grouped_mlp_fwd(t["x"], *args, cfg)
    calls = {"both": 0, "wgrad": 0}

    def counted(name, fn):
        return lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or fn(*a, **k)

    monkeypatch.setattr(kq, "dequantized_both", counted("both", kq.dequantized_both))
    monkeypatch.setattr(kq, "dequantized_wgrad", counted("wgrad", kq.dequantized_wgrad))
    one = K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, needs)
    counts = dict(calls)
    monkeypatch.setattr(operands, "one_read", lambda recipe: False)
    calls.update(both=0, wgrad=0)
    two = K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, needs)
    return counts, dict(calls), one, two


# (needs, both's passes, dequantized_wgrad's passes with both) for dx, dprobs, dW1, dW2, db1, db2:
# both for dy where dW2 is wanted, for g_h where dx and dW1 are
ONE_READ_NEEDS = [
    ((True,) * 6, 2, 2),  # x's and z's row blocks stay passes of their own
    ((True, True, False, True, True, True), 1, 1),  # no dW1: g_h's one consumer reads it once anyway
    ((False, True, True, False, True, False), 0, 2),  # no dW2: dy's one consumer likewise
]


def _assert_same_bits(one, two):
    for name, a, b in zip(GRADS, one, two):
        if a is None:
            assert b is None, name
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: {int((a != b).sum())} elements differ"


# the one_read recipes: mxfp8, and nvfp4 without the Hadamard option (stochastic rounding on dy's and
# g_h's wgrad operands is a hash of position and value: one pass and two draw alike)
ONE_READ_RECIPES = ["mxfp8", "nvfp4:stochastic_rounding=1"]


@interpreted
@pytest.mark.parametrize("key", ONE_READ_RECIPES)
@pytest.mark.parametrize("needs,n_both,n_wgrad", ONE_READ_NEEDS)
def test_cpu_one_read_gives_the_two_passes_bits(needs, n_both, n_wgrad, key, monkeypatch):
    # an empty expert, capacity rows, H = 56 and F = 24 ending in partial 32-blocks, biases
    t, cfg = make((5, 0, 9), 56, 24, M=18, scale_fc2_bias=True)
    counts, two_counts, one, two = _one_read_against_two(t, with_recipe(cfg, key), needs, monkeypatch)
    assert counts == {"both": n_both, "wgrad": n_wgrad}, counts
    assert two_counts["both"] == 0
    _assert_same_bits(one, two)


def test_z_values_need_fc1_on_the_engine():
    # Off the engine (here: tensors on the CPU) FC1 stores the fp32 z; asking for its values anyway
    # is an error before any launch, not an fp32 z read as values.
    from moemlp.kernels import operands

    t, cfg = make((5, 0, 9), 64, 64, M=16)
    cfg = with_recipe(cfg, "mxfp8")
    w = t["fc1_weight"]
    w1 = operands.Weight(w, cfg.recipe)
    b1 = operands.WeightOperand(w, (w.shape[1] * w.shape[2], w.shape[2], 1))  # as the values would come
    h = torch.empty(16, 128, dtype=t["x"].dtype)
    z, values = operands.fc1_z(operands.ActOperand(t["x"]), b1, w1, h, None, 64, cfg)
    assert not values and z.dtype == torch.float32 and z.shape == (16, 64)
    with pytest.raises(ValueError, match="engine only"):
        operands.gemm_on("fc1", operands.ActOperand(t["x"]), w1, b_op=b1, splits=t["splits"], out=h, N=64, K=64,
                         N1=128, cfg=cfg, z=torch.empty(16, 64, dtype=torch.bfloat16), z_values=True)  # fmt: skip


EMULATED = ["mxfp8", "nvfp4:hadamard=0,stochastic_rounding=0"]


def _factors(key):
    """Two operands' per-tensor factors under ``key``: nvfp4's 1/S_enc (0-d fp32, whose product is not
    a power of two), none for mxfp8."""
    if key == "mxfp8":
        return None, None
    return torch.tensor(3.0), torch.tensor(0.1)


@pytest.mark.parametrize("key", EMULATED)
def test_emulated_values_take_the_bf16_kernels(key, monkeypatch):
    """Both emulated recipes' dequantized bf16 values go where bf16 tensors go (the Gluon engine's
    FC1, FC2_DGRAD with fp32 g_h and z, and its plain GEMM for FC2 and FC1_DGRAD); nvfp4's carry their
    per-tensor 1/S_enc, whose product reaches the engine's launchers as ``acc_scale`` (the Triton
    kernels' ACC_SCALE), mxfp8's none. The kernels' own checks are stubbed to yes and the launchers
    record their calls, so this is the routing alone (on the CPU; the GPU test below runs it)."""
    from moemlp.kernels import gluon, operands
    from moemlp.kernels.gemm import launch

    monkeypatch.setattr(operands, "_gluon_on", lambda t: True)
    for name in ("fc1_supports", "fc2_dgrad_supports", "supports"):
        monkeypatch.setattr(gluon, name, lambda *a, **k: "")
    calls = []
    for name in ("fc1", "fc2_dgrad", "grouped_gemm"):
        monkeypatch.setattr(gluon, name, lambda *a, name=name, **k: calls.append((name, k.get("acc_scale"))))
    monkeypatch.setattr(launch, "launch_grouped_gemm",
                        lambda *a, **k: calls.append(("triton", launch._product(k["acc_factors"]))))  # fmt: skip
    _, cfg = make((3, 2), 64, 64)
    cfg = with_recipe(cfg, key)
    E, H, F, M = 2, 64, 64, 5
    a_factor, b_factor = _factors(key)
    expected_scale = None if a_factor is None else a_factor * b_factor

    def values(*shape, dtype=torch.bfloat16):
        return torch.zeros(*shape, dtype=dtype)

    def weight(w):
        # the forward's and the dgrad's dequantized values and factor (the ops' empty tensor for none)
        f = torch.empty(0) if b_factor is None else b_factor
        return operands.Weight.from_dequantized(w, cfg.recipe, forward=(values(*w.shape), f),
                                                dgrad=(values(*w.shape), f))  # fmt: skip

    w1, w2 = weight(values(E, 2 * F, H)), weight(values(E, H, F))
    x_op, z_op, dy_op, gh_op = (operands.ActOperand(values(M, k), factor=a_factor) for k in (H, F, H, 2 * F))
    fp32 = torch.float32
    cases = [
        # (kind, A, weight, out, z, h, N, reduction, expected)
        ("fc1", x_op, w1, values(M, 2 * F), values(M, F, dtype=fp32), None, F, H, "fc1"),
        ("fc2", z_op, w2, values(M, H), None, None, H, F, "grouped_gemm"),
        ("fc2_dgrad", dy_op, w2, values(M, 2 * F, dtype=fp32), values(M, F, dtype=fp32), values(M, 2 * F), F, H,
         "fc2_dgrad"),
        ("fc1_dgrad", gh_op, w1, values(M, H), None, None, H, 2 * F, "grouped_gemm"),
    ]  # fmt: skip
    for kind, a_op, w, out, z, h, N, red, expected in cases:
        calls.clear()
        operands.gemm_on(kind, a_op, w, splits=torch.tensor([3, 2]), out=out, N=N, K=red, N1=2 * F, cfg=cfg, z=z, h=h)
        assert [c[0] for c in calls] == [expected], (kind, calls)
        scale = calls[0][1]
        if expected_scale is None:
            assert scale is None, (kind, scale)
        else:
            assert scale is not None and scale.shape == () and torch.equal(scale, expected_scale), (kind, scale)


@pytest.mark.parametrize("engine", [True, False], ids=["engine", "no-engine"])
@pytest.mark.parametrize("key", EMULATED)
def test_emulated_weight_gradients_take_cutlass_only_without_a_factor(key, engine, monkeypatch):
    """The emulated recipes' weight gradients: on the engine's bf16 wgrad where it takes them, nvfp4's
    with its two factors' product as ``acc_scale``; elsewhere mxfp8's on CUTLASS (torch._grouped_mm)
    and nvfp4's on the Triton kernel with the same product (CUTLASS cannot apply a factor). The
    quantizer and the kernels' checks are stubbed and the launches recorded: the routing alone."""
    from types import SimpleNamespace

    from moemlp.kernels import gluon, operands
    from moemlp.kernels.gemm import launch
    from moemlp.kernels.quant import api as kq

    _, cfg = make((3, 2), 64, 64)
    recipe = with_recipe(cfg, key).recipe
    M, P, Q = 5, 128, 64
    g_factor, x_factor = _factors(key)
    monkeypatch.setattr(kq, "dequantized_wgrad", lambda t, splits, r, is_grad, **k: (
        torch.zeros(t.shape, dtype=torch.bfloat16), g_factor if is_grad else x_factor))  # fmt: skip
    monkeypatch.setattr(operands, "wgrad_engine", lambda *a: engine)
    monkeypatch.setattr(operands, "_cutlass_wgrad_ok", lambda *a: True)
    calls = []
    monkeypatch.setattr(gluon, "wgrad", lambda g, x, splits, dtype, acc_scale=None: calls.append(("engine", acc_scale)))
    monkeypatch.setattr(operands, "_cutlass_wgrad", lambda *a: calls.append(("cutlass", None)))
    monkeypatch.setattr(launch, "launch_grouped_wgrad",
                        lambda **k: calls.append(("triton", launch._product(k["acc_factors"]))))  # fmt: skip
    splits = torch.tensor([3, 2])
    operands.wgrad(torch.zeros(M, P), torch.zeros(M, Q, dtype=torch.bfloat16), splits, recipe, dtype=torch.bfloat16,
                   dw_dtype=torch.bfloat16, blocks=SimpleNamespace(get=lambda: None))  # fmt: skip
    factored = g_factor is not None
    expected = "engine" if engine else "triton" if factored else "cutlass"
    assert [c[0] for c in calls] == [expected], calls
    if factored:
        assert torch.equal(calls[0][1], g_factor * x_factor), calls
    else:
        assert calls[0][1] is None, calls


def test_every_recipe_is_supported():
    for key in RECIPES:
        assert K.supports_recipe(from_key(key))
    assert K.supports_recipe(None)
    assert not K.supports_recipe(object())


# ------------------------------------------------------------------------------------------------
# GPU: realistic shapes (TMA everywhere, Hopper's FP8 tensor cores for fp8_block).

GPU_CASES = [
    # mixtral-like: 8 large experts, one empty; bias; fp32 probs
    ("mixtral_like", (8, 1024, 1408, 6000, (3,), 64, {})),
    # qwen3-like: many small experts (wgrad K loops of a few 128-blocks)
    ("qwen3_like", (48, 1024, 384, 6000, (), 17, dict(bias=False))),
]


@pytest.mark.gpu
@pytest.mark.parametrize("key", RECIPES)
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_matches_torch_emulation(case, key):
    from test_triton_backend import gpu_problem

    _, (E, H, F, rows, empty, cap, kw) = case
    t, cfg = gpu_problem(E, H, F, rows, empty, cap, **kw)
    rels, grads = compare(t, with_recipe(cfg, key), "cuda")
    print(case[0], key, {k: f"{v:.1e}" for k, v in rels.items()})
    rcfg = with_recipe(cfg, key)
    args = (t["splits"], t["probs"], t["fc1_weight"], t["fc2_weight"], t["fc1_bias"], t["fc2_bias"])
    h = K.grouped_mlp_fwd(t["x"], *args, rcfg)[1]
    again = K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, rcfg, (True,) * 6)
    for name, a, b in zip(GRADS, grads, again):
        if a is not None:
            assert torch.equal(a, b), f"{name}: not bitwise repeatable"


def _x_amax_handed_on(t, cfg, monkeypatch):
    """A forward that keeps its dgrad operands, then the backward with its saved and without: returns
    (saved, the dequantized_wgrad calls given an amax in each backward, the two backwards' gradients)."""
    from moemlp.kernels.quant import api as kq

    args = (t["splits"], t["probs"], t["fc1_weight"], t["fc2_weight"], t["fc1_bias"], t["fc2_bias"])
    _, h, saved = K.grouped_mlp_fwd(t["x"], *args, cfg, keep_dgrad=(True, True))
    given = []
    real = kq.dequantized_wgrad
    monkeypatch.setattr(
        kq, "dequantized_wgrad", lambda *a, **k: given.append(k.get("amax") is not None) or real(*a, **k)
    )
    one = K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, (True,) * 6, saved=saved)
    n_one, given[:] = sum(given), []
    two = K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, (True,) * 6)
    return saved, (n_one, sum(given)), one, two


@interpreted
def test_cpu_nvfp4_forward_hands_x_amax_to_the_backward(monkeypatch):
    # nvfp4 without the Hadamard option: the forward's amax pass over x also takes the amax of the
    # rows below Σsplits, and dW1's operand of x takes it instead of a pass of its own, the same bits.
    # An empty expert and capacity rows (whose values must not reach that amax).
    from moemlp.kernels.quant import api as kq

    t, cfg = make((5, 0, 9), 56, 24, M=18, scale_fc2_bias=True)
    t["x"][14:] *= 64.0  # the capacity rows hold x's largest values
    saved, given, one, two = _x_amax_handed_on(t, with_recipe(cfg, NVFP4), monkeypatch)
    assert len(saved) == 1 and saved[0].shape == () and saved[0].dtype == torch.float32
    assert torch.equal(saved[0], kq.tensor_amaxes(t["x"], t["splits"])[1])
    assert saved[0] < t["x"].float().abs().max()
    assert given == (1, 0), given
    _assert_same_bits(one, two)
    # with the Hadamard option dW1's amax is the rotated rows': nothing is handed on
    saved, given, _, _ = _x_amax_handed_on(t, with_recipe(cfg, "nvfp4:hadamard=1,stochastic_rounding=0"), monkeypatch)
    assert saved == [] and given == (0, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("key", ONE_READ_RECIPES + ["nvfp4"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_one_read_gives_the_two_passes_bits(case, key, monkeypatch):
    """At the GPU cases (the engine's, CUTLASS's and the Triton kernel's weight gradients, which are
    deterministic): every gradient of the step with one pass each for dy and g_h (nvfp4: one amax
    pass and one values pass) equals the separate passes' bit for bit."""
    from test_triton_backend import gpu_problem

    _, (E, H, F, rows, empty, cap, kw) = case
    t, cfg = gpu_problem(E, H, F, rows, empty, cap, **kw)
    counts, _, one, two = _one_read_against_two(t, with_recipe(cfg, key), (True,) * 6, monkeypatch)
    assert counts == {"both": 2, "wgrad": 2}, counts
    _assert_same_bits(one, two)


NVFP4 = "nvfp4:hadamard=0,stochastic_rounding=0"  # deterministic: two runs quantize alike
# The kernels each case's step runs on the GPU under an emulated recipe, besides the quantizers: FC1
# and FC2_DGRAD on the engine, FC1_DGRAD (and FC2 without a bias) on its plain GEMM, the weight
# gradients on the engine's bf16 wgrad where experts average at most operands.WGRAD_ENGINE_ROWS rows
# (qwen3_like: ~125), else (mixtral_like: ~750) on CUTLASS under mxfp8 and on the Triton kernel under
# nvfp4, whose factor CUTLASS cannot apply (no engine launch recorded for it).
EMULATED_KERNELS = {
    ("mixtral_like", "mxfp8"): {"fc1", "fc2_dgrad", "grouped_gemm", "cutlass_wgrad"},
    ("qwen3_like", "mxfp8"): {"fc1", "fc2_dgrad", "grouped_gemm", "wgrad"},
    ("mixtral_like", NVFP4): {"fc1", "fc2_dgrad", "grouped_gemm"},
    ("qwen3_like", NVFP4): {"fc1", "fc2_dgrad", "grouped_gemm", "wgrad"},
}


@pytest.mark.gpu
@pytest.mark.parametrize("key", ["mxfp8", NVFP4])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_emulated_on_the_bf16_kernels(case, key, monkeypatch):
    """An emulated recipe's step on the kernels the bf16 path runs (the Gluon engine, CUTLASS where no
    factor is due) against the same step on the Triton kernels (MOEMLP_GLUON=0 and no CUTLASS): h, y
    and dx bit for bit (the engine gives the Triton kernels' bits: one K-ordered chain a tile,
    FC2_DGRAD's 128-deep promotion, nvfp4's factor product multiplied as ACC_SCALE multiplies it),
    the weight gradients and dprobs within their summation-order bounds (module docstring). Every
    engine launch under nvfp4 is given the factor (``acc_scale``), none under mxfp8."""
    from moemlp.kernels import gluon, operands
    from test_triton_backend import gpu_problem

    name, (E, H, F, rows, empty, cap, kw) = case
    t, cfg = gpu_problem(E, H, F, rows, empty, cap, **kw)
    cfg = with_recipe(cfg, key)
    args = (t["splits"], t["probs"], t["fc1_weight"], t["fc2_weight"], t["fc1_bias"], t["fc2_bias"])
    ran, z_mx = set(), set()

    def recorded(fn_name, fn):
        def call(*a, **k):
            ran.add((fn_name, k.get("acc_scale") is not None))
            if fn_name == "fc1":
                z_mx.add(bool(k.get("z_mx")))
            return fn(*a, **k)

        return call

    for fn_name in ("fc1", "fc2_dgrad", "grouped_gemm", "wgrad"):
        monkeypatch.setattr(gluon, fn_name, recorded(fn_name, getattr(gluon, fn_name)))
    monkeypatch.setattr(operands, "_cutlass_wgrad", recorded("cutlass_wgrad", operands._cutlass_wgrad))

    def step():
        y, h = K.grouped_mlp_fwd(t["x"], *args, cfg)
        return (y, h) + tuple(K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, (True,) * 6))

    ours = step()
    factored = key == NVFP4
    assert ran == {(k, factored) for k in EMULATED_KERNELS[name, key]}, ran
    # mxfp8's FC1 writes FC2's operand, z's values, in its epilogue (no fp32 z, no pass over it)
    assert z_mx == {key == "mxfp8"}, z_mx
    monkeypatch.setenv("MOEMLP_GLUON", "0")
    monkeypatch.setattr(operands, "_cutlass_wgrad_ok", lambda *a: False)
    ran.clear()
    triton = step()
    assert ran == set(), ran
    for what, a, b in zip(("y", "h") + GRADS, ours, triton):
        if a is None:
            assert b is None, what
        elif what in ("y", "h", "dx", "db1", "db2"):
            assert torch.equal(a, b), f"{what}: {int((a != b).sum())} elements differ from the Triton kernels'"
        else:
            limit = DPROBS_RTOL[False] if what == "dprobs" else ORDER_RTOL["cuda"]
            assert _rel(a, b) <= limit, (what, _rel(a, b))


def _step(t, cfg):
    """Forward, the recomputed h (``recompute_fc1``) and the backward with every gradient."""
    args = (t["splits"], t["probs"], t["fc1_weight"], t["fc2_weight"], t["fc1_bias"], t["fc2_bias"])
    y, h = K.grouped_mlp_fwd(t["x"], *args, cfg)
    h_again = K.grouped_fc1(t["x"], t["splits"], t["fc1_weight"], t["fc1_bias"], cfg)
    return (y, h, h_again) + tuple(K.grouped_mlp_bwd(t["dy"], t["x"], h, *args, cfg, (True,) * 6))


@interpreted
@pytest.mark.parametrize("key", [NVFP4, "nvfp4:hadamard=1,stochastic_rounding=1"])
def test_cpu_capacity_rows_move_no_routed_result(key):
    # Capacity rows belong to no expert (SPEC §1): whatever x and dy hold there, every routed row's
    # outputs and every weight gradient keep their bits. nvfp4's per-tensor amax is the one place a
    # capacity row could reach them; the reference quantizes only the rows below Σsplits, so the
    # Triton path must take those rows' amax for the rowwise operands of x (forward and recomputed
    # FC1) and of dy (FC2_DGRAD), as it does for the weight gradients'. Here the capacity rows hold
    # x's and dy's largest values (an amax over all rows would change S_enc, hence every code).
    t, cfg = make((9, 0, 8), 56, 24, M=22, scale_fc2_bias=True)
    cfg = with_recipe(cfg, key)
    T = 17
    quiet = dict(t, x=t["x"].clone(), dy=t["dy"].clone())
    quiet["x"][T:], quiet["dy"][T:] = 0.0, 0.0
    loud = dict(t, x=t["x"].clone(), dy=t["dy"].clone())
    loud["x"][T:] *= 1000.0
    loud["dy"][T:] *= 1000.0
    names = ("y", "h", "h recomputed") + GRADS
    for name, a, b in zip(names, _step(quiet, cfg), _step(loud, cfg)):
        if name in ("dw1", "dw2", "db1", "db2"):
            assert torch.equal(a, b), name
        else:  # per row: the routed rows equal, the capacity rows 0 on both (h keeps FC1's rows)
            assert torch.equal(a[:T], b[:T]), name
            if name not in ("h", "h recomputed"):
                assert not a[T:].any() and not b[T:].any(), name
    compare(loud, cfg, "cpu")  # and the Triton path agrees with the reference there
