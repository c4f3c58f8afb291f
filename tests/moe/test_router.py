"""Router units against a plain-torch re-derivation of Megatron-Core's formulas (router.py)."""

import pytest
import torch
import torch.nn.functional as F

from moemlp.moe.router import Router


def plain_router(x, weight, k, score, normalize, bias=None, aux_coeff=0.0, z_coeff=0.0, dtype=torch.float64):
    """Megatron-Core's TopKRouter written out: returns (probs, idx, aux_loss, z_loss).

    Selection runs on fp32 logits (what the router computes); probs and losses are evaluated in
    ``dtype`` from the same fp32 inputs, so the comparison isolates the router's own rounding."""
    logits32 = F.linear(x.detach().float(), weight.detach().float())
    logits = F.linear(x.to(dtype), weight.to(dtype))
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    sel32 = logits32.softmax(-1) if score == "softmax" else logits32.sigmoid()
    if bias is not None:
        sel32 = sel32 + bias
    idx = torch.sort(sel32, dim=-1, descending=True, stable=True).indices[:, :k]
    probs = scores.gather(1, idx)
    if normalize:
        probs = probs / probs.sum(-1, keepdim=True)
    T, E = logits.shape
    counts = F.one_hot(idx, E).sum((0, 1)).to(dtype)
    s = scores if score == "softmax" else scores / scores.sum(-1, keepdim=True)
    aux = aux_coeff * E / (k * T * T) * (s.sum(0) * counts).sum()
    z = z_coeff * torch.logsumexp(logits, -1).square().mean()
    return probs, idx, aux, z


# (score, normalize_topk, E, k): what each case exercises
ROUTER_CASES = [
    pytest.param("softmax", True, 8, 2, id="softmax-renorm"),  # Mixtral / Qwen3
    pytest.param("softmax", False, 8, 2, id="softmax-raw"),  # pre-softmax top-k, no renorm
    pytest.param("sigmoid", True, 16, 4, id="sigmoid-renorm"),  # DeepSeek-V3
    pytest.param("sigmoid", False, 7, 3, id="sigmoid-raw-E-prime"),
    pytest.param("softmax", False, 5, 1, id="top1"),  # Switch
    pytest.param("softmax", True, 4, 4, id="k-equals-E"),  # every expert selected
    pytest.param("softmax", True, 1, 1, id="one-expert"),
]


def _router(H, E, k, score, normalize, **kw):
    torch.manual_seed(0)
    r = Router(H, E, k, score=score, normalize_topk=normalize, **kw)
    with torch.no_grad():
        r.weight.normal_(0.0, 0.5)  # spread the logits: no near-ties between fp32 and fp64 choices
    return r


@pytest.mark.parametrize("score,normalize,E,k", ROUTER_CASES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_router_forward_and_grads(score, normalize, E, k, x_dtype):
    H, T = 24, 37
    r = _router(H, E, k, score, normalize, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(x_dtype).requires_grad_()
    probs, idx = r(x)
    assert probs.dtype == torch.float32 and idx.dtype == torch.int64
    ref_probs, ref_idx, ref_aux, ref_z = plain_router(
        x.detach(), r.weight.detach(), k, score, normalize, aux_coeff=0.1, z_coeff=0.01
    )
    assert torch.equal(idx, ref_idx)
    # fp32 router vs float64: a few fp32 roundings of softmax / normalisation
    torch.testing.assert_close(probs.double(), ref_probs, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(r.aux_loss.double(), ref_aux, rtol=2e-6, atol=1e-9)
    torch.testing.assert_close(r.z_loss.double(), ref_z, rtol=2e-6, atol=1e-9)

    # Gradients of (probs · c) with the aux losses attached must equal those of
    # (probs · c) + aux + z written out: the losses reach x and the weight through backward.
    c = torch.randn(T, k, generator=torch.Generator().manual_seed(2))
    gx, gw = torch.autograd.grad((probs * c).sum(), (x, r.weight))
    x64 = x.detach().double().requires_grad_()
    w64 = r.weight.detach().double().requires_grad_()
    p64, _, aux64, z64 = plain_router(x64, w64, k, score, normalize, aux_coeff=0.1, z_coeff=0.01)
    gx64, gw64 = torch.autograd.grad((p64 * c.double()).sum() + aux64 + z64, (x64, w64))
    torch.testing.assert_close(gw.double(), gw64, rtol=1e-5, atol=1e-6)
    if x_dtype == torch.float32:
        torch.testing.assert_close(gx.double(), gx64, rtol=1e-5, atol=1e-6)
    else:  # dx leaves the router in bf16: one bf16 rounding of an fp32-exact value
        assert gx.dtype == torch.bfloat16
        torch.testing.assert_close(gx.double(), gx64.bfloat16().double(), rtol=8e-3, atol=1e-5)


def test_loss_scale_scales_only_the_aux_gradient():
    H, E, k, T = 16, 6, 2, 20
    r = _router(H, E, k, "softmax", True, aux_loss_coeff=0.3, z_loss_coeff=0.2)
    r.loss_scale = 0.25  # e.g. 1 / num_microbatches
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    probs, _ = r(x)
    c = torch.randn(T, k, generator=torch.Generator().manual_seed(4))
    (gw,) = torch.autograd.grad((probs * c).sum(), (r.weight,))
    w64 = r.weight.detach().double().requires_grad_()
    p64, _, aux64, z64 = plain_router(x, w64, k, "softmax", True, aux_coeff=0.3, z_coeff=0.2)
    (gw64,) = torch.autograd.grad((p64 * c.double()).sum() + 0.25 * (aux64 + z64), (w64,))
    torch.testing.assert_close(gw.double(), gw64, rtol=1e-5, atol=1e-7)


def test_no_aux_losses_by_default():
    r = _router(8, 4, 2, "softmax", True)
    x = torch.randn(10, 8)
    probs, _ = r(x)
    assert r.aux_loss is None and r.z_loss is None
    c = torch.randn(10, 2)
    (gw,) = torch.autograd.grad((probs * c).sum(), (r.weight,))
    w64 = r.weight.detach().double().requires_grad_()
    p64, _, _, _ = plain_router(x, w64, 2, "softmax", True)
    (gw64,) = torch.autograd.grad((p64 * c.double()).sum(), (w64,))
    torch.testing.assert_close(gw.double(), gw64, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_expert_bias_selects_but_does_not_weight(score):
    H, E, k, T = 12, 6, 2, 30
    r = _router(H, E, k, score, True, expert_bias=True)
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0, 0.0, 0.0])  # expert 3 always chosen
    r.expert_bias.copy_(bias)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    probs, idx = r(x)
    ref_probs, ref_idx, _, _ = plain_router(x, r.weight.detach(), k, score, True, bias=bias)
    assert torch.equal(idx, ref_idx)
    assert bool((idx[:, 0] == 3).all())
    torch.testing.assert_close(probs.double(), ref_probs, rtol=2e-6, atol=1e-7)
    # The bias changes the probabilities only through the selection: not a parameter, no grad.
    assert "expert_bias" not in dict(r.named_parameters())
    counts = F.one_hot(ref_idx, E).sum((0, 1)).float()
    assert torch.equal(r.tokens_per_expert, counts)

    with pytest.raises(TypeError, match="group"):
        r.update_expert_bias(0.01, group="dp")
    # Update: bias += rate · sign(mean − counts), counts reset.
    r.update_expert_bias(0.01)
    torch.testing.assert_close(r.expert_bias, bias + 0.01 * torch.sign(counts.mean() - counts))
    assert torch.equal(r.tokens_per_expert, torch.zeros(E))
    # Evaluation forwards do not count.
    r.eval()
    r(x)
    assert torch.equal(r.tokens_per_expert, torch.zeros(E))


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(top_k=9), ValueError, "top_k"),  # top_k > E
        (dict(top_k=0), ValueError, "top_k"),
        (dict(num_experts=2.0), TypeError, "num_experts"),
        (dict(score="relu"), ValueError, "score"),
        (dict(aux_loss_coeff=-1.0), ValueError, "aux_loss_coeff"),
        (dict(z_loss_coeff="1"), TypeError, "z_loss_coeff"),
        (dict(normalize_topk=1), TypeError, "normalize_topk"),
    ],
    ids=["k>E", "k=0", "E-float", "score", "aux-neg", "z-str", "normalize-int"],
)
def test_router_rejects_bad_arguments(kwargs, exc, match):
    args = dict(hidden_size=8, num_experts=8, top_k=2)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        Router(args.pop("hidden_size"), args.pop("num_experts"), args.pop("top_k"), **args)


def test_router_rejects_bad_x():
    r = Router(8, 4, 2)
    with pytest.raises(ValueError, match=r"x: expected shape \(T, 8\)"):
        r(torch.randn(3, 9))
    with pytest.raises(TypeError, match="x: expected a floating-point"):
        r(torch.ones(3, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="expert_bias=False"):
        r.update_expert_bias()


def test_group_limited_routing_takes_no_tokens():
    # An empty batch (0 tokens) through group-limited routing: the (T, G, E/G) view of 0 elements.
    r = Router(8, 8, 2, num_groups=4, topk_groups=2)
    probs, idx = r(torch.randn(0, 8))
    assert probs.shape == (0, 2) and idx.shape == (0, 2)
