"""moemlp.integrations.transformers: tiny models of each mapped family (random weights built from
their configs, no download) run with experts_implementation="moemlp" against the same model's own
"eager" experts, logits and every parameter's gradient; a few training steps; the backend's edge
cases (dense (tokens, E) weights, expert-parallel sentinel slots, unmappable gates, dtypes).

References and tolerances:
- float64: the model in float64, eager vs moemlp (float64 experts get float64 routing weights):
  only the order of operations differs, unit roundoff 1.1e-16 times the tiny network's gain, so
  every output and gradient within 1e-12 relative (a wrong gate, layout or bias scaling shows at
  1e-3 or more).
- float32 / bfloat16: error against the float64 eager model, within 2x the error of the model's own
  eager path in the same dtype (quack's idiom), plus one unit roundoff of the dtype for tensors the
  eager path happens to reproduce almost exactly.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

transformers = pytest.importorskip("transformers", minversion="5.7.0")
mh = pytest.importorskip("moemlp.integrations.transformers")

from transformers.activations import ACT2FN  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, use_experts_implementation  # noqa: E402

from moemlp import grouped_mlp  # noqa: E402

VOCAB, HIDDEN, SEQ, BATCH = 64, 32, 12, 2

_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def _init_scaled(model, experts_std: float, bias_std: float = 0.0) -> None:
    """Weights large enough that the expert block matters next to the residual (the default 0.02
    leaves it ~1e-3 of the logits) and, for gpt-oss, that the clamps at ±7 engage."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            if ".experts." in name:
                std = bias_std if name.endswith("_bias") else experts_std
            else:
                std = 0.1
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * std)


# id -> (config class, config kwargs, model class, experts weight std, experts bias std)
FAMILIES = {
    # Qwen3-MoE: SwiGLU, [gate | up] halves, (tokens, k) softmax top-k weights
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=64, moe_intermediate_size=16, head_dim=8,
                                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                         decoder_sparse_step=1, mlp_only_layers=[]),
                  "Qwen3MoeForCausalLM", 0.3, 0.0),
    # Qwen2-MoE: SwiGLU experts beside a gated shared expert, top-k weights not renormalized
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=64, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]),
                  "Qwen2MoeForCausalLM", 0.3, 0.0),
    # Mixtral: SwiGLU, 4 experts, top-2
    "mixtral": ("MixtralConfig", dict(intermediate_size=16, head_dim=8, num_local_experts=4,
                                      num_experts_per_tok=2),
                "MixtralForCausalLM", 0.3, 0.0),
    # OLMoE: SwiGLU, 8 experts, top-2
    "olmoe": ("OlmoeConfig", dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2),
              "OlmoeForCausalLM", 0.3, 0.0),
    # DeepSeek-V3: sigmoid group-limited routing with scaling factor 2.5, shared expert, MLA attention
    "deepseek_v3": ("DeepseekV3Config", dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
                                             num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                             first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                             num_key_value_heads=4),  # MLA: as many kv heads as heads
                    "DeepseekV3ForCausalLM", 0.3, 0.0),
    # gpt-oss: clamped SwiGLU (limit 7, alpha 1.702, up + 1), gate/up interleaved column by column,
    # transposed (E, H, 2F) / (E, F, H) weights, both biases
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=16, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                     layer_types=["sliding_attention", "full_attention"], sliding_window=8),
                "GptOssForCausalLM", 1.5, 0.5),
}


def _model(family: str, dtype: torch.dtype):
    cfg_name, kw, model_name, w_std, b_std = FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(**{**_COMMON, **kw})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(cfg)
    _init_scaled(model, w_std, b_std)
    return model.to(dtype)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    mh.register()


def _batch():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, labels


def _logits_and_grads(model, implementation: str):
    """Logits (float64) and {name: grad (float64)} of a cross-entropy loss."""
    model.set_experts_implementation(implementation)
    model.zero_grad(set_to_none=True)
    ids, labels = (t.to(model.device) for t in _batch())
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).double().cpu()
             for n, p in model.named_parameters()}
    return logits.detach().double().cpu(), grads


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach(), ref.detach()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


_FP64 = {}


def _fp64_eager(family: str):
    if family not in _FP64:
        _FP64[family] = _logits_and_grads(_model(family, torch.float64), "eager")
    return _FP64[family]


def _experts_inputs_reach_clamp(model) -> float:
    """Fraction of layer-0 gate pre-activations of gpt-oss past the clamp limit."""
    seen = {}
    experts = model.model.layers[0].mlp.experts
    hook = experts.register_forward_pre_hook(lambda m, args: seen.update(x=args[0].detach()))
    with torch.no_grad():
        model(_batch()[0])
    hook.remove()
    h = seen["x"] @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    return float((h[:, ::2] > experts.limit).double().mean())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float64_matches_eager(family, monkeypatch):
    """moemlp on the float64 model reproduces the eager experts: logits and every gradient."""
    model = _model(family, torch.float64)
    ref_logits, ref_grads = _fp64_eager(family)
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["activation"])
        return grouped_mlp(*args, **kwargs)

    monkeypatch.setattr(mh, "grouped_mlp", counted)
    logits, grads = _logits_and_grads(model, "moemlp")
    assert len(calls) == 2  # one grouped_mlp per MoE layer: the experts ran on moemlp
    assert _rel(logits, ref_logits) <= 1e-12
    for name, g in grads.items():
        assert _rel(g, ref_grads[name]) <= 1e-12, name
    # the mapping was the family's own (not a coincidence of a benign probe)
    m = mh.resolve_experts(model.model.layers[0].mlp.experts)
    if family == "gpt_oss":
        assert (m.activation, m.glu_interleave, m.transposed, m.has_bias) == ("clamped_swiglu", 1, True, True)
        assert dict(m.activation_params) == {"limit": 7.0, "alpha": 1.702, "offset": 1.0}
        assert _experts_inputs_reach_clamp(model) > 0.05  # the clamp branch is exercised
    else:
        assert (m.activation, m.glu_interleave, m.transposed, m.has_bias) == ("swiglu", None, False, False)


_LOW = [(f, d) for d in (torch.float32, torch.bfloat16) for f in FAMILIES]


@pytest.mark.parametrize("family,dtype", _LOW, ids=[f"{f}-{str(d)[6:]}" for f, d in _LOW])
def test_low_precision_within_2x_of_eager(family, dtype):
    """In fp32 / bf16 moemlp's error against the float64 eager model is within 2x the eager path's."""
    ref_logits, ref_grads = _fp64_eager(family)
    model = _model(family, dtype)
    eager_logits, eager_grads = _logits_and_grads(model, "eager")
    logits, grads = _logits_and_grads(model, "moemlp")
    assert logits.dtype == torch.float64  # compared in float64
    unit = torch.finfo(dtype).eps / 2
    assert _rel(logits, ref_logits) <= 2 * _rel(eager_logits, ref_logits) + unit
    # One by one: the gradients moemlp computes (the experts') or feeds (the router's, through dprobs).
    moe = [n for n in grads if re.search(r"\.experts\.|\.mlp\.(gate|router)\.", n)]
    assert len(moe) >= 6  # two layers, each with expert weights and a router
    for name in moe:
        assert _rel(grads[name], ref_grads[name]) <= 2 * _rel(eager_grads[name], ref_grads[name]) + unit, name
    # Together: every other gradient carries only the rounding noise that reaches it through the
    # network, and on this 32-wide model one small tensor's error is a single noisy draw (Qwen2's
    # (1, 32) shared_expert_gate: 2.3x eager's error in layer 0 and 1.4x in layer 1 on an AVX2 CPU).
    rest = [n for n in grads if n not in moe]

    def flat(gs):
        return torch.cat([gs[n].flatten() for n in rest])

    assert _rel(flat(grads), flat(ref_grads)) <= 2 * _rel(flat(eager_grads), flat(ref_grads)) + unit


@pytest.mark.long(seconds=40)
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_gpu_bf16_within_2x_of_eager_and_sync_free(family):
    """On CUDA (Triton kernels and gathers), bf16: the 2x rule against the CPU float64 eager model
    for logits and every gradient; and the backend's forward + backward issue no host sync."""
    ref_logits, ref_grads = _fp64_eager(family)
    model = _model(family, torch.bfloat16).cuda()
    eager_logits, eager_grads = _logits_and_grads(model, "eager")
    logits, grads = _logits_and_grads(model, "moemlp")
    unit = torch.finfo(torch.bfloat16).eps / 2
    assert _rel(logits, ref_logits) <= 2 * _rel(eager_logits, ref_logits) + unit
    for name, g in grads.items():
        assert _rel(g, ref_grads[name]) <= 2 * _rel(eager_grads[name], ref_grads[name]) + unit, name
    experts = model.model.layers[0].mlp.experts
    index, weights = _routing(256, 2, experts.gate_up_proj.shape[0])
    index, weights = index.cuda(), weights.float().cuda().requires_grad_(True)
    x = torch.randn(256, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    leaves = [x, weights, *experts.parameters()]
    y = mh.experts_forward(experts, x, index, weights)  # resolves the module, compiles the kernels
    torch.autograd.grad(y, leaves, torch.ones_like(y))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = mh.experts_forward(experts, x, index, weights)
        torch.autograd.grad(y, leaves, torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _train(family: str, dtype: torch.dtype, implementation: str, steps: int = 6) -> list[float]:
    model = _model(family, dtype)
    model.set_experts_implementation(implementation)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids, labels = _batch()
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class _ExpertWeightTensors(TorchDispatchMode):
    """Every tensor an op makes with the shape of an experts weight (or of its transpose) that is
    not a view of one of the op's inputs: a copy of a weight, or a weight's gradient, as
    (op, shape); and the weight arguments moemlp's forward op receives."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.made, self.fwd_weights = shapes, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.moemlp.grouped_mlp_fwd.default:
            self.fwd_weights.append((args[3], args[4]))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in inputs:
                continue
            if tuple(t.shape) in self.shapes:
                self.made.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_training_step_copies_no_experts_weight(family):
    """A training step (forward, loss.backward()) makes one experts-weight-sized tensor per weight:
    its gradient, which moemlp's backward op writes in the weight's own layout, so that .grad takes
    it as is. No weight is copied in the forward: moemlp's op gets views of the parameters, also of
    gpt-oss's transposed (E, H, 2F) / (E, F, H) weights, which used to be transposed into contiguous
    copies on every call (6.4 GB at gpt-oss-120b) and whose gradients .grad then copied back."""
    model = _model(family, torch.bfloat16)
    model.set_experts_implementation("moemlp")
    weights = [w for layer in model.model.layers for w in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj)]
    shapes = {s for w in weights for s in (tuple(w.shape), tuple(w.transpose(1, 2).shape))}
    ids, labels = _batch()
    with _ExpertWeightTensors(shapes) as seen:
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))
        loss.backward()
    params = {w.untyped_storage().data_ptr() for w in weights}
    assert len(seen.fwd_weights) == len(model.model.layers)
    for fc1, fc2 in seen.fwd_weights:
        assert {fc1.untyped_storage().data_ptr(), fc2.untyped_storage().data_ptr()} <= params
    assert [op for op, _ in seen.made] == ["moemlp.grouped_mlp_bwd.default"] * len(weights), seen.made
    for w in weights:
        assert w.grad.stride() == w.stride()


@pytest.mark.long(seconds=50)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_training_loss_falls(family):
    """A few AdamW steps through the moemlp backend: the loss falls, and the fp32 trajectory stays
    within 2x of the eager fp32 trajectory's distance from the float64 one."""
    ref = _train(family, torch.float64, "eager")
    eager = _train(family, torch.float32, "eager")
    ours = _train(family, torch.float32, "moemlp")
    assert ours[-1] < 0.8 * ours[0]
    dist_eager = max(abs(a - r) / r for a, r in zip(eager, ref))
    dist_ours = max(abs(a - r) / r for a, r in zip(ours, ref))
    assert dist_ours <= 2 * dist_eager + torch.finfo(torch.float32).eps


# --- the backend called directly on one experts module ---------------------------------------------


def _experts(family: str, dtype=torch.float64):
    return _model(family, dtype).model.layers[0].mlp.experts


def _routing(tokens: int, k: int, num_experts: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    index = torch.rand(tokens, num_experts, generator=g).topk(k, dim=1).indices
    weights = torch.rand(tokens, k, generator=g, dtype=torch.float64)
    return index, weights


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_dense_weights_form(family):
    """(tokens, E) weights, as DeepSeek-style routers pass them in transformers 5.0-5.6, give the
    same outputs and gradients as the (tokens, k) weights they hold."""
    experts = _experts(family)
    E = experts.gate_up_proj.shape[0]
    x = torch.randn(10, HIDDEN, dtype=torch.float64, requires_grad=True)
    index, weights = _routing(10, 2, E)
    dense = torch.zeros(10, E, dtype=torch.float64).scatter(1, index, weights).requires_grad_(True)
    sparse = dense.detach().gather(1, index).requires_grad_(True)
    y_dense = mh.experts_forward(experts, x, index, dense)
    y_sparse = mh.experts_forward(experts, x, index, sparse)
    torch.testing.assert_close(y_dense, y_sparse, rtol=0, atol=0)
    dy = torch.randn_like(y_dense)
    (g_dense,) = torch.autograd.grad(y_dense, dense, dy)
    (g_sparse,) = torch.autograd.grad(y_sparse, sparse, dy)
    torch.testing.assert_close(g_dense.gather(1, index), g_sparse, rtol=0, atol=0)
    unselected = torch.ones_like(dense, dtype=torch.bool).scatter(1, index, False)
    assert bool((g_dense[unselected] == 0).all())  # experts a token did not pick get no gradient


def test_sentinel_slots_add_nothing():
    """Slots whose index is >= E (transformers' expert-parallel sentinels) contribute exactly what a
    zero-weight slot does, and their weights get no gradient. The reference's zero-weight slots go to
    an expert that no other slot uses, so both runs give every other expert the same rows: a CPU BLAS
    may round a row differently in a matrix of another row count (7e-15 in float64 on an AVX2 CPU),
    and what is tested here is the sentinel, not the BLAS."""
    experts = _experts("gpt_oss")  # biases: a sentinel row must not add b2 either
    E = experts.gate_up_proj.shape[0]
    x = torch.randn(9, HIDDEN, dtype=torch.float64)
    index, weights = _routing(9, 2, E - 1)  # every slot on experts 0 .. E-2
    sentinel = index.clone()
    sentinel[::3, 1] = E  # every third token's second slot lives on another rank
    spare = index.clone()
    spare[::3, 1] = E - 1  # the same slots on the otherwise unused expert, with weight 0
    zeroed = weights.clone()
    zeroed[::3, 1] = 0.0
    w = weights.clone().requires_grad_(True)
    y = mh.experts_forward(experts, x, sentinel, w)
    torch.testing.assert_close(y, mh.experts_forward(experts, x, spare, zeroed), rtol=0, atol=0)
    (gw,) = torch.autograd.grad(y, w, torch.randn_like(y))
    assert bool((gw[::3, 1] == 0).all())


def test_negative_slots_add_nothing():
    """A negative index names no expert: it contributes what an expert-parallel sentinel (>= E) does,
    nothing, instead of being sorted into expert 0's rows; with dense (tokens, E) weights too."""
    experts = _experts("gpt_oss")
    E = experts.gate_up_proj.shape[0]
    x = torch.randn(9, HIDDEN, dtype=torch.float64)
    index, weights = _routing(9, 2, E - 1)
    negative, sentinel = index.clone(), index.clone()
    negative[::3, 1], sentinel[::3, 1] = -1, E
    want = mh.experts_forward(experts, x, sentinel, weights)
    torch.testing.assert_close(mh.experts_forward(experts, x, negative, weights), want, rtol=0, atol=0)
    dense = torch.zeros(9, E, dtype=torch.float64).scatter(1, index, weights)
    torch.testing.assert_close(mh.experts_forward(experts, x, negative, dense),
                               mh.experts_forward(experts, x, sentinel, dense), rtol=0, atol=0)  # fmt: skip


def test_matches_transformers_grouped_mm_and_batched_mm():
    """The registered function against transformers' own non-eager backends on gpt-oss experts:
    batched_mm in float64 (op order only, as the float64 model tests), grouped_mm in fp32 (torch's
    grouped GEMM has no float64 kernel) by the 2x rule against the float64 batched_mm."""
    experts = _experts("gpt_oss")
    x = torch.randn(11, HIDDEN, dtype=torch.float64)
    index, weights = _routing(11, 2, experts.gate_up_proj.shape[0])
    ref = ALL_EXPERTS_FUNCTIONS["batched_mm"](experts, x, index, weights)
    assert _rel(mh.experts_forward(experts, x, index, weights), ref) <= 1e-12
    experts32 = experts.float()
    x32, w32 = x.float(), weights.float()
    ours = mh.experts_forward(experts32, x32, index, w32).double()
    theirs = ALL_EXPERTS_FUNCTIONS["grouped_mm"](experts32, x32, index, w32).double()
    assert _rel(ours, ref) <= 2 * _rel(theirs, ref) + torch.finfo(torch.float32).eps / 2


def test_dtypes_follow_the_experts():
    """bf16 experts with fp32 hidden states compute in bf16 (the experts' dtype, as grouped_mm does)
    and return fp32; bf16 routing weights are used exactly (upcast to fp32)."""
    experts = _experts("qwen3_moe", torch.bfloat16)
    x = torch.randn(8, HIDDEN)
    index, weights = _routing(8, 2, 8)
    w = weights.to(torch.bfloat16)
    y = mh.experts_forward(experts, x, index, w)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, mh.experts_forward(experts, x.bfloat16(), index, w.float()).float(), rtol=0, atol=0)


@use_experts_implementation(has_gate=False)
class _UnaryExperts(torch.nn.Module):
    """A gate-less experts module (NemotronH's layout): up_proj (E, F, H), down_proj (E, H, F)."""

    def __init__(self, config):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.num_experts = 5
        self.up_proj = torch.nn.Parameter(torch.randn(5, 16, HIDDEN, generator=g, dtype=torch.float64) * 0.3)
        self.down_proj = torch.nn.Parameter(torch.randn(5, HIDDEN, 16, generator=g, dtype=torch.float64) * 0.3)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states, top_k_index, top_k_weights):
        raise AssertionError("the test selects a registered backend")


@pytest.mark.parametrize("act,expected", [("relu2", "srelu"), ("gelu_pytorch_tanh", "gelu")])
def test_unary_experts(act, expected):
    config = transformers.PretrainedConfig(hidden_act=act)
    experts = _UnaryExperts(config)
    assert mh.resolve_experts(experts).activation == expected
    x = torch.randn(7, HIDDEN, dtype=torch.float64, requires_grad=True)
    index, weights = _routing(7, 2, 5)
    y = mh.experts_forward(experts, x, index, weights)
    ref = ALL_EXPERTS_FUNCTIONS["batched_mm"](experts, x, index, weights)
    assert _rel(y, ref) <= 1e-12
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, experts.up_proj, experts.down_proj], dy)
    want = torch.autograd.grad(ref, [x, experts.up_proj, experts.down_proj], dy)
    for a, b in zip(got, want):
        assert _rel(a, b) <= 1e-12


def test_unmappable_gate_raises_or_falls_back():
    """Exact-erf GELU has no moemlp activation (moemlp's geglu is the tanh form): an error naming the
    module, or with fallback= the named transformers backend, with a warning."""
    cfg_name, kw, _, _, _ = FAMILIES["qwen3_moe"]
    cfg = getattr(transformers, cfg_name)(**_COMMON, **{**kw, "hidden_act": "gelu"})
    model = transformers.Qwen3MoeForCausalLM(cfg)  # fp32: grouped_mm has no float64 CPU kernel
    experts = model.model.layers[0].mlp.experts
    with pytest.raises(ValueError, match="Qwen3MoeExperts.*matches no moemlp activation"):
        mh.resolve_experts(experts)
    x = torch.randn(6, HIDDEN)
    index, weights = _routing(6, 2, 8)
    weights = weights.float()
    with pytest.raises(ValueError, match="Qwen3MoeExperts"):
        mh.experts_forward(experts, x, index, weights)
    fn = mh.register("moemlp_or_grouped_mm", fallback="grouped_mm")
    with pytest.warns(UserWarning, match="grouped_mm"):
        y = fn(experts, x, index, weights)
    torch.testing.assert_close(y, ALL_EXPERTS_FUNCTIONS["grouped_mm"](experts, x, index, weights), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per module class
        fn(experts, x, index, weights)


def test_unmappable_gate_falls_back_to_eager():
    """fallback="eager": a module moemlp cannot map runs its own forward (what transformers'
    experts_implementation="eager" runs), bit for bit, with one warning per class."""
    cfg_name, kw, _, _, _ = FAMILIES["qwen3_moe"]
    cfg = getattr(transformers, cfg_name)(**_COMMON, **{**kw, "hidden_act": "gelu"})
    experts = transformers.Qwen3MoeForCausalLM(cfg).model.layers[0].mlp.experts
    x = torch.randn(6, HIDDEN)
    index, weights = _routing(6, 2, 8)
    weights = weights.float()
    experts.config._experts_implementation = "eager"
    want = experts(x, index, weights)
    fn = mh.register("moemlp_or_eager", fallback="eager")
    with pytest.warns(UserWarning, match="Qwen3MoeExperts.*'eager'"):
        y = fn(experts, x, index, weights)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    experts.config._experts_implementation = "moemlp_or_eager"  # transformers' own dispatch to it
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per module class
        torch.testing.assert_close(experts(x, index, weights), want, rtol=0, atol=0)


def test_eager_fallback_needs_a_wrapped_forward():
    """A custom experts module whose forward transformers did not wrap has no forward of its own to
    fall back to: the error says so, beside why it could not be mapped."""
    fn = mh.register("moemlp_or_eager_custom", fallback="eager")
    index, weights = _routing(5, 2, 4)
    with pytest.raises(ValueError, match="_ClippedExperts: its _apply_gate matches no.*fallback='eager' finds no "
                                         "forward of its own in _ClippedExperts"):
        fn(_ClippedExperts(10.0), torch.randn(5, HIDDEN, dtype=torch.float64), index, weights)


def test_register_validates():
    with pytest.raises(ValueError, match="name"):
        mh.register("grouped_mm")
    with pytest.raises(TypeError, match="name"):
        mh.register("")
    with pytest.raises(ValueError, match="backend"):
        mh.register("moemlp_x", backend="cuda")
    with pytest.raises(ValueError, match="fallback"):
        mh.register("moemlp_x", fallback="moemlp_x")
    with pytest.raises(ValueError, match="recipe"):
        mh.register("moemlp_x", recipe="fp4")
    assert "moemlp" in ALL_EXPERTS_FUNCTIONS
    with pytest.raises(ValueError, match="fallback") as info:  # another moemlp registration is no fallback
        mh.register("moemlp_x", fallback="moemlp")
    known = str(info.value).split(", got")[0]
    assert "'grouped_mm'" in known and "'eager'" in known and "moemlp" not in known


def test_routing_inputs_validated():
    experts = _experts("qwen3_moe")
    x = torch.randn(6, HIDDEN, dtype=torch.float64)
    index, weights = _routing(6, 2, 8)
    with pytest.raises(ValueError, match="top_k_weights"):
        mh.experts_forward(experts, x, index, weights[:, :1])
    with pytest.raises(TypeError, match="top_k_index"):
        mh.experts_forward(experts, x, index.double(), weights)
    with pytest.raises(ValueError, match="hidden_states"):
        mh.experts_forward(experts, x[:, :-1], index, weights)
    with pytest.raises(ValueError, match="top_k_index: expected at least one slot"):
        mh.experts_forward(experts, x, index[:, :0], weights[:, :0])


@pytest.mark.long(seconds=50)
def test_hf_bench_smoke(tmp_path):
    """``python -m moemlp bench --hf`` on its CPU configs: both backends timed, and the MoE block's
    bf16 outputs agree with grouped_mm's within bf16 rounding of a two-GEMM block (2e-2, the bound
    bench/mlp.py checks before timing)."""
    import argparse

    from moemlp.bench.hf import CPU_MODELS, run_hf_bench

    rows = run_hf_bench(argparse.Namespace(device="cpu", backend="auto", out=str(tmp_path), rep_ms=1))
    assert [(r["model"], r["experts_impl"]) for r in rows] == [
        (m.name, impl) for m in CPU_MODELS for impl in ("moemlp", "grouped_mm")
    ]
    for r in rows:
        assert r["moe_block_ms"] > 0 and r["model_ms"] > 0
        assert r["rel_diff_block_out"] < 2e-2
        assert r["model_gpu_ms"] != r["model_gpu_ms"]  # NaN off a GPU: GPU time is not measured there
    assert (tmp_path / "hf_bench.csv").exists()


def test_mapping_cache_lets_modules_go():
    """The per-module mapping cache holds modules weakly, also when their mapping failed."""
    import gc
    import weakref

    experts = _UnaryExperts(transformers.PretrainedConfig(hidden_act="gelu"))  # erf GELU: no mapping
    with pytest.raises(ValueError, match="_UnaryExperts"):
        mh.resolve_experts(experts)
    alive = weakref.ref(experts)
    del experts
    gc.collect()
    assert alive() is None


def test_prepare_and_compile_fullgraph():
    """prepare() maps every experts module up front; the backend then traces under
    torch.compile(fullgraph=True) (dynamo; the grouped MLP is a custom op) and gives the eager
    call's outputs. Without prepare the trace stops with an error that says to call it."""
    model = _model("gpt_oss", torch.float32)
    fresh = model.model.layers[1].mlp.experts
    x = torch.randn(10, HIDDEN)
    index, weights = _routing(10, 2, 4)
    weights = weights.float()
    traced = torch.compile(lambda e, *a: mh.experts_forward(e, *a), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="prepare"):
        traced(fresh, x, index, weights)
    mappings = mh.prepare(model)
    assert sorted(mappings) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert {m.activation for m in mappings.values()} == {"clamped_swiglu"}
    torch.testing.assert_close(traced(fresh, x, index, weights), mh.experts_forward(fresh, x, index, weights),
                               rtol=0, atol=0)


def test_prepare_strict():
    cfg_name, kw, _, _, _ = FAMILIES["olmoe"]
    model = transformers.OlmoeForCausalLM(getattr(transformers, cfg_name)(**{**_COMMON, **kw, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match=r"model\.model\.layers\.0\.mlp\.experts: OlmoeExperts"):
        mh.prepare(model)
    assert mh.prepare(model, strict=False) == {}


# A superset of the config fields the installed experts classes read, at tiny sizes.
_GENERIC_EXPERTS_CONFIG = dict(
    num_local_experts=4, n_routed_experts=4, num_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    hidden_size=HIDDEN, intermediate_size=16, moe_intermediate_size=16, expert_intermediate_size=16,
    moe_ffn_hidden_size=16, moe_latent_size=None, mlp_bias=False, hidden_act="silu", mlp_hidden_act="relu2",
    hidden_activation="gelu_pytorch_tanh", swiglu_limit=7.0, swiglu_alpha=1.702, mlp_gate_softcap=4.0,
    mlp_up_softcap=25.0, moe_hidden_size=HIDDEN, post_norm_eps=1e-6,
    swiglu_limits=[7.0], swiglu_limits_shared=[7.0], limit_after_act=False, rms_norm_eps=1e-6,
    expert_ffn_hidden_size=16,
)


def _installed_experts_classes():
    import importlib
    import inspect
    import os
    import pkgutil

    import transformers.models as models

    for info in sorted(pkgutil.iter_modules(models.__path__), key=lambda m: m.name):
        path = os.path.join(models.__path__[0], info.name, f"modeling_{info.name}.py")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            if "use_experts_implementation" not in f.read():
                continue
        module = importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
        for name, cls in vars(module).items():
            if inspect.isclass(cls) and cls.__module__ == module.__name__ and "Experts" in name \
                    and hasattr(cls, "_apply_gate"):
                yield cls


def test_every_installed_experts_class_matches_batched_mm():
    """Every experts class of the installed transformers (56 in 5.17), built at tiny size with
    random float64 weights: moemlp gives transformers' batched_mm outputs and gradients (input and
    every parameter) to float64 op-order rounding (1e-12), or raises the ValueError naming the class.
    A gate that computes in fp32 inside (Inkling2's) makes the reference itself carry fp32
    rounding (relative 2^-24 per element): 1e-6 for those. Classes with an experts option moemlp
    does not implement (5.24: has_post_expert_norm) must be the ones that raise."""
    mismatched, unmapped, refused, built = [], [], [], 0
    for cls in _installed_experts_classes():
        config = transformers.PretrainedConfig(**_GENERIC_EXPERTS_CONFIG)
        try:
            experts = cls(config).double()
        except TypeError as e:  # 5.25: BailingHybridExperts also takes its layer's index
            if "layer_idx" not in str(e):
                raise
            experts = cls(config, layer_idx=0).double()
        built += 1
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in experts.parameters():  # std 1: the gpt-oss style clamps at 7 engage
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        x = torch.randn(9, HIDDEN, generator=g, dtype=torch.float64, requires_grad=True)
        index, weights = _routing(9, 2, 4)
        if getattr(experts, "has_post_expert_norm", False):
            refused.append(cls.__name__)
        try:
            mapping = mh.resolve_experts(experts)
        except ValueError as e:
            assert cls.__name__ in str(e)
            unmapped.append(cls.__name__)
            continue
        with torch.no_grad():
            h = torch.randn(4, experts.down_proj.shape[2 if not mapping.transposed else 1] * (
                2 if mapping.fc1_name == "gate_up_proj" else 1), generator=g, dtype=torch.float64)
            a = experts._apply_gate(h) if mapping.fc1_name == "gate_up_proj" else experts.act_fn(h)
        tol = 1e-6 if bool((a.float().double() == a).all()) else 1e-12  # fp32 inside the gate
        y = mh.experts_forward(experts, x, index, weights)
        ref = ALL_EXPERTS_FUNCTIONS["batched_mm"](experts, x, index, weights)
        leaves = [x, *experts.parameters()]
        dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
        # allow_unused: a parameter neither path reads (5.25's LongcatFlash keeps its norms there)
        # gets None from both; one path reading it and the other not is a mismatch.
        got = torch.autograd.grad(y, leaves, dy, allow_unused=True)
        want = torch.autograd.grad(ref, leaves, dy, allow_unused=True)
        errs = [_rel(y, ref)] + [float("inf") if (a is None) != (b is None) else _rel(a, b)
                                 for a, b in zip(got, want) if a is not None or b is not None]
        if max(errs) > tol:
            mismatched.append((cls.__name__, max(errs)))
    assert built >= 20  # the discovery found the interface's classes (27 in 5.7, 56 in 5.17)
    assert mismatched == []
    # With hidden_act="silu" every installed gate has a moemlp activation, but the SiLU gates clamped
    # after the activation, min(silu(g), L) · clamp(u, ±L) (5.25's Step3p7 and BailingHybrid; moemlp
    # clamps before it), which must be refused, not mapped.
    assert [c for c in unmapped if c not in _CLAMPED_AFTER_ACT] == refused


_CLAMPED_AFTER_ACT = ("Step3p7Experts", "BailingHybridExperts")


def test_unmapped_experts_option_raises(monkeypatch):
    """An option of use_experts_implementation that moemlp does not implement, set on a module,
    is refused by name (as has_post_expert_norm=True is in transformers 5.24)."""
    experts = _experts("qwen3_moe")
    monkeypatch.setitem(mh._OTHER_FLAGS, "has_post_expert_norm", False)
    experts.has_post_expert_norm = True
    with pytest.raises(ValueError, match="Qwen3MoeExperts: has_post_expert_norm=True"):
        mh.resolve_experts(experts)
    experts.has_post_expert_norm = False
    assert mh.resolve_experts(experts).activation == "swiglu"


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_recipe_reaches_grouped_mlp(family):
    """register(recipe=...) runs the experts under that recipe: the same bits as dispatching by
    hand and calling grouped_mlp with the mapping and the recipe (and not the bf16 result)."""
    from moemlp.moe.dispatch import permute, permute_probs, plan_dispatch, unpermute

    fn = mh.register("moemlp_fp8_block", recipe="fp8_block")
    experts = _experts(family, torch.bfloat16)
    m = mh.resolve_experts(experts)
    E = experts.gate_up_proj.shape[0]
    x = torch.randn(40, HIDDEN, dtype=torch.bfloat16)
    index, weights = _routing(40, 2, E)
    weights = weights.float()
    y = fn(experts, x, index, weights)

    w1, w2 = experts.gate_up_proj, experts.down_proj
    if m.transposed:
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    b1 = experts.gate_up_proj_bias if m.has_bias else None
    b2 = experts.down_proj_bias if m.has_bias else None
    plan = plan_dispatch(index, E)
    rows = grouped_mlp(permute(x, plan), plan.splits, permute_probs(weights, plan), w1, w2, b1, b2,
                       activation=m.activation, activation_params=dict(m.activation_params),
                       glu_interleave=m.glu_interleave, scale_fc2_bias=True, recipe="fp8_block")
    torch.testing.assert_close(y, unpermute(rows, plan), rtol=0, atol=0)
    assert not torch.equal(y, mh.experts_forward(experts, x, index, weights))


class _ClippedExperts(torch.nn.Module):
    """A custom experts module (trust_remote_code style) with a clamped SwiGLU gate whose limit sits
    under an attribute name the mapping does not read."""

    def __init__(self, clip: float):
        super().__init__()
        g = torch.Generator().manual_seed(6)
        self.num_experts, self.clip = 4, clip
        self.is_transposed, self.has_bias = False, False
        self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 32, HIDDEN, generator=g, dtype=torch.float64))
        self.down_proj = torch.nn.Parameter(torch.randn(4, HIDDEN, 16, generator=g, dtype=torch.float64))
        self.act_fn = torch.nn.SiLU()

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate.clamp(max=self.clip)) * up.clamp(-self.clip, self.clip)


@pytest.mark.parametrize("clip", [7.0, 10.0, 100.0, 5000.0])
def test_clamp_under_an_unknown_name_is_refused(clip):
    """A clamp the mapping cannot name is never taken for the unclamped gate, wherever it sits: the
    probe reaches magnitudes of 1e4 (it reached 8 only, and a clamp at 10 passed for swiglu)."""
    with pytest.raises(ValueError, match="_ClippedExperts: its _apply_gate matches no moemlp activation"):
        mh.resolve_experts(_ClippedExperts(clip))


def test_gate_changes_after_the_first_forward_are_seen():
    """The mapping cache is keyed on what the gate is made of: an _apply_gate set on the instance
    after a forward, and an act_fn replaced twice between forwards (the second object may take the
    first one's id), are mapped again, not run with the old mapping."""
    import types

    def erf_gelu_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate) * up

    x = torch.randn(6, HIDDEN, dtype=torch.float64)
    index, weights = _routing(6, 2, 8)
    experts = _experts("qwen3_moe")
    mh.experts_forward(experts, x, index, weights)  # mapped: swiglu
    experts._apply_gate = types.MethodType(erf_gelu_gate, experts)
    with pytest.raises(ValueError, match="Qwen3MoeExperts: its _apply_gate matches no moemlp activation"):
        mh.experts_forward(experts, x, index, weights)

    experts = _experts("qwen3_moe")
    mh.experts_forward(experts, x, index, weights)
    experts.act_fn = torch.nn.Tanh()
    experts.act_fn = torch.nn.GELU()  # erf GELU: no moemlp activation
    with pytest.raises(ValueError, match="Qwen3MoeExperts: its _apply_gate matches no moemlp activation"):
        mh.experts_forward(experts, x, index, weights)

    # An override that matches is mapped, and the cache does not keep its module alive.
    import gc
    import weakref

    def silu_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    experts = _experts("qwen3_moe")
    experts._apply_gate = types.MethodType(silu_gate, experts)
    y = mh.experts_forward(experts, x, index, weights)
    assert _rel(y, ALL_EXPERTS_FUNCTIONS["batched_mm"](experts, x, index, weights)) <= 1e-12
    alive = weakref.ref(experts)
    del experts
    gc.collect()
    assert alive() is None


def test_fallback_under_compile_fullgraph():
    """With register(fallback=...), a model compiled with fullgraph=True: unmappable modules that
    prepare(strict=False) left out run on the fallback inside the trace (no warning there, which
    dynamo cannot trace); a module met first inside the trace raises the error that says to call
    prepare, instead of running on the fallback unseen."""
    fn = mh.register("moemlp_or_grouped_mm_compiled", fallback="grouped_mm")
    cfg_name, kw, _, _, _ = FAMILIES["qwen3_moe"]
    config = getattr(transformers, cfg_name)(**_COMMON, **{**kw, "hidden_act": "gelu"})
    unmappable = transformers.Qwen3MoeForCausalLM(config)
    experts = unmappable.model.layers[0].mlp.experts
    assert mh.prepare(unmappable, strict=False) == {}
    x = torch.randn(6, HIDDEN)
    index, weights = _routing(6, 2, 8)
    weights = weights.float()
    traced = torch.compile(lambda *a: fn(*a), backend="eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = traced(experts, x, index, weights)
    torch.testing.assert_close(y, ALL_EXPERTS_FUNCTIONS["grouped_mm"](experts, x, index, weights), rtol=0, atol=0)

    torch._dynamo.reset()
    mappable = _model("qwen3_moe", torch.float32).model.layers[1].mlp.experts
    with pytest.raises(Exception, match="prepare"):
        traced(mappable, x, index, weights)


def test_eager_fallback_under_compile():
    """fallback="eager" under torch.compile runs the module's own forward in the trace, breaking the
    graph where that code does (transformers' eager experts loop over the experts hit, a
    data-dependent count: fullgraph=True refuses it as it refuses experts_implementation="eager")."""
    fn = mh.register("moemlp_or_eager_compiled", fallback="eager")
    cfg_name, kw, _, _, _ = FAMILIES["qwen3_moe"]
    config = getattr(transformers, cfg_name)(**_COMMON, **{**kw, "hidden_act": "gelu"})
    experts = transformers.Qwen3MoeForCausalLM(config).model.layers[0].mlp.experts
    assert mh.prepare(experts, strict=False) == {}
    x = torch.randn(6, HIDDEN)
    index, weights = _routing(6, 2, 8)
    weights = weights.float()
    y = torch.compile(lambda *a: fn(*a), backend="eager")(experts, x, index, weights)
    experts.config._experts_implementation = "eager"
    torch.testing.assert_close(y, experts(x, index, weights), rtol=0, atol=0)


def test_quantized_expert_weights_refused():
    """FP8 expert weights (a quantized checkpoint's) are refused by name, not cast to."""
    experts = _experts("qwen3_moe", torch.bfloat16)
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach().to(torch.float8_e4m3fn),
                                              requires_grad=False)
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts\.gate_up_proj: torch\.float8_e4m3fn weights"):
        mh.resolve_experts(experts)
