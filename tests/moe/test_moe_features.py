"""Shared experts, group-limited routing, routed scaling and capacity (token dropping) in MoE, against a
plain-torch model written the way the models' own code writes it (transformers' DeepseekV3TopkRouter /
DeepseekV3MoE and Qwen2MoeSparseMoeBlock; Megatron-Core's capacity semantics as its documentation
states them), evaluated in float64. Every gradient is compared, the router's and the gate's included.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import _triton_env
from moemlp.moe import MoE
from moemlp.moe.dispatch import plan_dispatch, plan_dispatch_with_capacity
from moemlp.moe.router import Router


def plain_select(x, weight, top_k, *, score, bias=None, n_group=None, topk_group=None, mask_value=float("-inf")):
    """Expert choice as DeepSeek-V3's gate makes it, on fp32 logits (what the layer's router computes).

    ``mask_value``: -inf as DeepSeek-V3's inference code and Megatron-Core; transformers writes 0.0."""
    logits = F.linear(x.detach().float(), weight.detach().float())
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    scores_for_choice = scores if bias is None else scores + bias.unsqueeze(0)
    if n_group is not None:
        E = weight.shape[0]
        group_scores = scores_for_choice.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
        scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), mask_value)
    return torch.topk(scores_for_choice, k=top_k, dim=-1)[1]


def plain_mlp(x, w_gate, w_up, w_down):
    """DeepseekV3MLP / Qwen2MoeMLP: down(silu(gate(x)) * up(x))."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def plain_moe(x, p, cfg):
    """The layer written out in float64. ``p``: router (E, H), fc1 (E, 2F, H), fc2 (E, H, F), and
    optionally bias (E,), shared_fc1 (1, 2Fs, H), shared_fc2 (1, H, Fs), shared_gate (1, H).
    Returns (y (T, H), aux + z loss)."""
    T, H = x.shape
    E, k = p["router"].shape[0], cfg["top_k"]
    idx = plain_select(x, p["router"], k, score=cfg["score"], bias=p.get("bias"),
                       n_group=cfg.get("num_groups"), topk_group=cfg.get("topk_groups"))
    logits = F.linear(x, p["router"].to(x.dtype))
    scores = logits.softmax(-1) if cfg["score"] == "softmax" else logits.sigmoid()
    topk_weights = scores.gather(1, idx)
    if cfg.get("normalize_topk", True):
        eps = 1e-20 if cfg["score"] == "sigmoid" else 0
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + eps)
    topk_weights = topk_weights * cfg.get("routed_scaling_factor", 1.0)

    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True)
    routing_probs = torch.zeros(T, E, dtype=x.dtype).scatter(1, idx, topk_weights)
    factor = cfg.get("capacity_factor")
    if factor is not None:
        # Megatron-Core: capacity = ceil(T·k / E · factor); "probs" keeps each expert's `capacity`
        # highest-probability tokens, "position" its first `capacity` tokens; dropped: prob 0.
        capacity = min(math.ceil((T * k / E) * factor), T)
        if cfg.get("drop_policy", "probs") == "probs":
            top = torch.topk(routing_probs.detach().float(), k=capacity, dim=0).indices
            capacity_mask = torch.zeros(T, E, dtype=torch.bool).scatter(0, top, True)
        else:
            capacity_mask = routing_map.long().cumsum(0) <= capacity
        routing_probs = routing_probs * (routing_map & capacity_mask)

    y = torch.zeros(T, H, dtype=x.dtype)
    Fe = p["fc2"].shape[-1]
    for e in range(E):  # every expert on every token, weighted by its (maybe 0) probability
        out = plain_mlp(x, p["fc1"][e, :Fe], p["fc1"][e, Fe:], p["fc2"][e])
        y = y + out * routing_probs[:, e : e + 1]
    if "shared_fc1" in p:
        Fs = p["shared_fc2"].shape[-1]
        shared = plain_mlp(x, p["shared_fc1"][0, :Fs], p["shared_fc1"][0, Fs:], p["shared_fc2"][0])
        if "shared_gate" in p:  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared_expert(x)
            shared = torch.sigmoid(F.linear(x, p["shared_gate"].to(x.dtype))) * shared
        y = y + shared

    counts = F.one_hot(idx, E).sum((0, 1)).to(x.dtype)
    s = scores if cfg["score"] == "softmax" else scores / scores.sum(-1, keepdim=True)
    aux = cfg.get("aux_loss_coeff", 0.0) * E / (k * max(T, 1) ** 2) * (s.sum(0) * counts).sum()
    return y, aux


LAYER_ARGS = ("top_k", "score", "normalize_topk", "num_groups", "topk_groups", "routed_scaling_factor",
              "num_shared_experts", "shared_expert_ffn_hidden_size", "shared_expert_gate", "capacity_factor",
              "drop_policy", "pad_to_capacity", "aux_loss_coeff", "expert_bias")

# (E, F, T, layer options): what each case exercises
FEATURE_CASES = [
    pytest.param(16, 12, 40, dict(top_k=4, score="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=2.5,
                                  expert_bias=True, num_shared_experts=2), id="deepseek-v3-groups-bias-2-shared"),
    pytest.param(8, 12, 30, dict(top_k=2, score="softmax", normalize_topk=False, num_shared_experts=1,
                                 shared_expert_ffn_hidden_size=40, shared_expert_gate=True),
                 id="qwen2-moe-gated-shared"),
    pytest.param(12, 8, 36, dict(top_k=3, score="softmax", num_groups=3, topk_groups=1), id="groups-softmax-one-group"),
    pytest.param(6, 10, 33, dict(top_k=2, score="softmax", capacity_factor=0.5), id="capacity-probs-drops"),
    pytest.param(6, 10, 33, dict(top_k=2, score="softmax", capacity_factor=0.75, drop_policy="position"),
                 id="capacity-position"),
    pytest.param(6, 10, 33, dict(top_k=2, score="sigmoid", capacity_factor=0.3, pad_to_capacity=True),
                 id="pad-fewer-rows-than-slots"),  # E·C + 1 < T·k: dropped slots share the zero row
    pytest.param(7, 10, 25, dict(top_k=3, score="softmax", capacity_factor=1.1, drop_policy="position",
                                 pad_to_capacity=True), id="pad-more-rows-than-slots"),  # and still drops
    pytest.param(16, 8, 48, dict(top_k=4, score="sigmoid", num_groups=8, topk_groups=3, routed_scaling_factor=1.5,
                                 expert_bias=True, num_shared_experts=1, shared_expert_gate=True, capacity_factor=0.8,
                                 aux_loss_coeff=0.03), id="everything"),
]


def _build(H, E, F_, cfg, seed=0):
    torch.manual_seed(seed)
    kw = {k: v for k, v in cfg.items() if k in LAYER_ARGS}
    moe = MoE(hidden_size=H, ffn_hidden_size=F_, num_experts=E, dtype=torch.float64, backend="torch", **kw)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        moe.router.weight.copy_(torch.randn(E, H, generator=g) * 0.4)  # spread logits: no near-ties
        if moe.router.expert_bias is not None:
            moe.router.expert_bias.copy_(torch.randn(E, generator=g) * 0.05)
        if moe.shared_expert_gate is not None:
            moe.shared_expert_gate.weight.copy_(torch.randn(1, H, generator=g) * 0.3)
    return moe


def _params(moe):
    p = {"router": moe.router.weight, "fc1": moe.experts.fc1_weight, "fc2": moe.experts.fc2_weight}
    if moe.shared_experts is not None:
        p["shared_fc1"], p["shared_fc2"] = moe.shared_experts.fc1_weight, moe.shared_experts.fc2_weight
    if moe.shared_expert_gate is not None:
        p["shared_gate"] = moe.shared_expert_gate.weight
    return p


@pytest.mark.parametrize("E,F_,T,cfg", FEATURE_CASES)
def test_features_match_plain_model_float64(E, F_, T, cfg):
    H = 16
    moe = _build(H, E, F_, cfg)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(T, H, generator=g, dtype=torch.float64)
    params = _params(moe)
    y = moe(x)
    grads = torch.autograd.grad(y, [x] + list(params.values()), dy)

    x_ref = x.detach().clone().requires_grad_()
    ref_params = {n: t.detach().clone().requires_grad_() for n, t in params.items()}
    if moe.router.expert_bias is not None:
        ref_params["bias"] = moe.router.expert_bias.clone()
    y_ref, aux = plain_moe(x_ref, ref_params, cfg)
    leaves = [x_ref] + [ref_params[n] for n in params]
    ref_grads = torch.autograd.grad((y_ref * dy).sum() + aux, leaves)

    # The router and the shared gate are fp32 by design: probabilities carry fp32 rounding
    # (~1e-7 relative), their weight gradients are fp32 sums; the experts run in float64.
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    for name, a, b in zip(["x"] + list(params), grads, ref_grads):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"d{n}: {m}")
    if "capacity_factor" in cfg:
        # set-up: the case drops something (else it tests nothing of the dropping)
        C = math.ceil(T * cfg["top_k"] / E * cfg["capacity_factor"])
        counts = torch.bincount(moe.router(x.detach())[1].reshape(-1), minlength=E)
        assert int(counts.max()) > C


def test_group_limited_selection_stays_in_the_best_groups():
    # Many tokens; every selected expert lies in one of the token's topk_groups best groups, and
    # the choice equals transformers' formulation wherever the masked value (0.0 there) cannot win.
    H, E, k, G, TG, T = 24, 32, 6, 8, 3, 500
    r = Router(H, E, k, score="sigmoid", num_groups=G, topk_groups=TG, expert_bias=True)
    with torch.no_grad():
        r.weight.normal_(0.0, 0.5)
        r.expert_bias.normal_(0.0, 0.05)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    probs, idx = r(x)
    ref = plain_select(x, r.weight, k, score="sigmoid", bias=r.expert_bias, n_group=G, topk_group=TG,
                       mask_value=0.0)
    assert torch.equal(idx.sort(-1).values, ref.sort(-1).values)
    groups_used = torch.zeros(T, G, dtype=torch.bool).scatter_(1, idx // (E // G), True).sum(-1)
    assert int(groups_used.max()) <= TG


def test_capacity_plan_layout():
    # Kept rows first, grouped by expert in token order; each expert <= C; dropped rows past Σsplits;
    # with enough capacity the plan is plan_dispatch's.
    T, E, k = 37, 5, 2
    g = torch.Generator().manual_seed(4)
    probs = torch.rand(T, E, generator=g)
    p, idx = probs.topk(k, dim=-1)
    base = plan_dispatch(idx, E)
    roomy = plan_dispatch_with_capacity(idx, p, E, capacity=T)
    for a, b in zip(base, roomy):
        assert torch.equal(a, b)
    for policy in ("probs", "position"):
        C = 6
        plan = plan_dispatch_with_capacity(idx, p, E, C, policy)
        assert torch.equal(plan.splits, torch.bincount(idx.reshape(-1), minlength=E).clamp(max=C))
        kept = int(plan.splits.sum())
        rows_expert = idx.reshape(-1)[plan.perm]
        assert torch.equal(rows_expert[:kept], torch.repeat_interleave(torch.arange(E), plan.splits))
        for e in range(E):  # which slots the expert keeps
            slots = (idx.reshape(-1) == e).nonzero().view(-1)
            if policy == "probs":
                want = slots[torch.sort(p.reshape(-1)[slots], descending=True, stable=True).indices[:C]]
            else:
                want = slots[:C]
            lo = int(plan.splits[:e].sum())
            assert torch.equal(plan.perm[lo : lo + int(plan.splits[e])], want.sort().values)
        padded = plan_dispatch_with_capacity(idx, p, E, C, policy, pad_to_capacity=True)
        assert padded.src_token.numel() == E * C + 1
        assert torch.equal(padded.perm[:kept], plan.perm[:kept])
        dropped = plan.row_of.reshape(-1) >= kept
        assert torch.equal(padded.row_of.reshape(-1)[dropped], torch.full((int(dropped.sum()),), E * C))


def test_roomy_capacity_and_padding_give_the_dropless_bits():
    H, E, F_, T = 16, 6, 10, 25
    cfg = dict(top_k=2, score="softmax")
    plain = _build(H, E, F_, cfg)
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(T, H, dtype=torch.float64)
    want = [plain(x)]
    want += torch.autograd.grad(want[0], [x] + list(plain.parameters()), dy)
    for extra in (dict(capacity_factor=float(E)), dict(capacity_factor=float(E), pad_to_capacity=True)):
        moe = _build(H, E, F_, dict(cfg, **extra))
        got = [moe(x)]
        got += torch.autograd.grad(got[0], [x] + list(moe.parameters()), dy)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("T", [0, 1])
@pytest.mark.parametrize("extra", [dict(capacity_factor=1.0), dict(capacity_factor=1.0, pad_to_capacity=True),
                                   dict(num_shared_experts=1, shared_expert_gate=True)], ids=["drop", "pad", "shared"])
def test_no_tokens_and_one_token(T, extra):
    # T = 0: an empty output and gradient; T = 1 with capacity ceil(2/8) = 1: nothing dropped.
    cfg = dict(top_k=2, score="softmax", **extra)
    moe = _build(8, 8, 8, cfg)
    x = torch.randn(T, 8, dtype=torch.float64, requires_grad=True)
    y = moe(x)
    p = _params(moe)
    (dx,) = torch.autograd.grad(y.sum(), [x])
    ref, _ = plain_moe(x.detach(), {n: t.detach() for n, t in p.items()}, cfg)
    assert y.shape == (T, 8) and dx.shape == (T, 8)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


def test_shared_gate_probs_stay_fp32_in_a_bf16_layer():
    # The gate's sigmoid reaches grouped_mlp as fp32 probs: a bf16 layer's shared output equals the
    # one-expert grouped_mlp call with the fp32 gate, bit for bit; the gate weight stays fp32 under casts.
    from moemlp import grouped_mlp

    moe = MoE(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, num_shared_experts=1,
              shared_expert_gate=True, backend="torch").to(torch.bfloat16)
    assert moe.shared_expert_gate.weight.dtype == torch.float32
    assert moe.shared_experts.fc1_weight.dtype == torch.bfloat16
    x = torch.randn(9, 16).bfloat16()
    gate = torch.sigmoid(x.float() @ moe.shared_expert_gate.weight.t()).view(-1)
    shared = grouped_mlp(x, torch.tensor([9]), gate, moe.shared_experts.fc1_weight, moe.shared_experts.fc2_weight,
                         backend="torch")
    assert torch.equal(moe._shared_forward(x, None), shared)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(num_groups=4), ValueError, "num_groups, topk_groups: give both"),
        (dict(num_groups=3, topk_groups=1), ValueError, "num_groups: must divide num_experts"),
        (dict(num_groups=8, topk_groups=1), ValueError, "num_groups: each group needs >= 2 experts"),
        (dict(num_groups=4, topk_groups=5), ValueError, "topk_groups: must be <= num_groups"),
        (dict(num_groups=4, topk_groups=1, top_k=3), ValueError, "top_k: must be <= topk_groups"),
        (dict(num_groups=2.0, topk_groups=1), TypeError, "num_groups: expected an int"),
        (dict(routed_scaling_factor=0.0), ValueError, "routed_scaling_factor"),
        (dict(routed_scaling_factor="2"), TypeError, "routed_scaling_factor"),
        (dict(num_shared_experts=-1), ValueError, "num_shared_experts"),
        (dict(num_shared_experts=True), TypeError, "num_shared_experts"),
        (dict(shared_expert_gate=True), ValueError, "num_shared_experts: .*need"),
        (dict(num_shared_experts=1, shared_expert_ffn_hidden_size=0), ValueError, "shared_expert_ffn_hidden_size"),
        (dict(num_shared_experts=1, shared_expert_gate=1), TypeError, "shared_expert_gate"),
        (dict(num_shared_experts=1, shared_expert_overlap=1), TypeError, "shared_expert_overlap"),
        (dict(capacity_factor=0.0), ValueError, "capacity_factor"),
        (dict(capacity_factor=float("inf")), ValueError, "capacity_factor"),
        (dict(capacity_factor="1"), TypeError, "capacity_factor"),
        (dict(capacity_factor=1.0, drop_policy="random"), ValueError, "drop_policy"),
        (dict(pad_to_capacity=True), ValueError, "pad_to_capacity: needs a capacity_factor"),
        (dict(capacity_factor=1.0, pad_to_capacity=1), TypeError, "pad_to_capacity"),
    ],
    ids=["groups-half", "groups-not-dividing", "group-of-one", "topk-groups>groups", "k>reachable",
         "groups-float", "scaling-0", "scaling-str", "shared-neg", "shared-bool", "gate-without-shared",
         "shared-F-0", "gate-int", "overlap-int", "capacity-0", "capacity-inf", "capacity-str", "policy", "pad-alone",
         "pad-int"],
)
def test_new_arguments_are_checked_at_construction(kwargs, exc, match):
    args = dict(hidden_size=8, ffn_hidden_size=8, num_experts=8, top_k=2)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        MoE(**args)


def test_torch_compile_fullgraph_with_the_features():
    # Capacity planning, group-limited routing and the shared experts trace into one graph with no
    # break (a host read such as .item() or .tolist() would break it) and give the eager bits.
    moe = _build(16, 8, 8, dict(top_k=2, score="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=2.0,
                                num_shared_experts=1, shared_expert_gate=True, capacity_factor=0.6,
                                pad_to_capacity=True))
    x = torch.randn(20, 16, dtype=torch.float64, requires_grad=True)
    params = [x] + list(moe.parameters())
    y = moe(x)
    yc = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(y, yc)
    dy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, params, dy), torch.autograd.grad(yc, params, dy)):
        assert torch.equal(a, b)


def check_triton_features_match_torch(device):
    """The features on the Triton path (dispatch gathers with a padded capacity plan, the shared
    experts' one-expert grouped MLP with the gate as probs) against the torch path, fp32."""
    kw = dict(hidden_size=16, ffn_hidden_size=32, num_experts=6, top_k=2, score="sigmoid", num_groups=3,
              topk_groups=2, routed_scaling_factor=2.0, num_shared_experts=2, shared_expert_ffn_hidden_size=16,
              shared_expert_gate=True, capacity_factor=0.5, pad_to_capacity=True, device=device)
    torch.manual_seed(0)
    a = MoE(**kw, backend="torch")
    b = MoE(**kw, backend="triton")
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 9, 16, device=device)
    dy = torch.randn(3, 9, 16, device=device)
    outs = []
    for m in (a, b):
        xx = x.clone().requires_grad_()
        y = m(xx)
        outs.append([y] + list(torch.autograd.grad(y, [xx] + list(m.parameters()), dy)))
    names = ["y", "dx"] + [n for n, _ in a.named_parameters()]
    for name, u, v in zip(names, *outs):
        torch.testing.assert_close(v, u, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.long(seconds=120)
@pytest.mark.interpreter_child(seconds=12)
def test_triton_features_match_torch():
    if torch.cuda.is_available():
        check_triton_features_match_torch("cuda")
        return
    _triton_env.run_check_interpreted(__file__, "check_triton_features_match_torch", "cpu")
