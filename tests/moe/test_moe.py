"""The MoE layer against a naive composition in plain torch: fp32 router, then for each expert the
rows that chose it, its MLP, times the probability, summed per token."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import _triton_env
from moemlp.moe import MoE


def naive_moe(x, router_weight, fc1_weight, fc2_weight, k, *, score="softmax", normalize=True,
              activation="swiglu", expert_bias=None, aux_coeff=0.0, z_coeff=0.0, dtype=torch.float64):
    """Returns (y, aux + z). Routing decisions come from fp32 logits, as the layer's router makes
    them; everything else is evaluated in ``dtype`` (float64: the reference; bfloat16: what plain
    PyTorch bf16 code would compute, the baseline for bf16 tolerances)."""
    T, H = x.shape
    E = router_weight.shape[0]
    logits32 = F.linear(x.detach().float(), router_weight.detach().float())
    sel = logits32.softmax(-1) if score == "softmax" else logits32.sigmoid()
    if expert_bias is not None:
        sel = sel + expert_bias
    idx = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :k]
    logits = F.linear(x.to(torch.float64), router_weight.to(torch.float64))
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    probs = scores.gather(1, idx)
    if normalize:
        probs = probs / probs.sum(-1, keepdim=True)
    counts = F.one_hot(idx, E).sum((0, 1)).double()
    s = scores if score == "softmax" else scores / scores.sum(-1, keepdim=True)
    aux = aux_coeff * E / (k * T * T) * (s.sum(0) * counts).sum()
    aux = aux + z_coeff * torch.logsumexp(logits, -1).square().mean()

    xd, w1, w2, p = x.to(dtype), fc1_weight.to(dtype), fc2_weight.to(dtype), probs.to(dtype)
    y = torch.zeros(T, H, dtype=dtype)
    for e in range(E):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = xd[tok] @ w1[e].t()
        if activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            a = F.silu(gate) * up
        else:  # gelu (tanh approximation)
            a = F.gelu(h, approximate="tanh")
        y = y.index_add(0, tok, (a * p[tok, slot][:, None]) @ w2[e].t())
    return y, aux


def make_layer(H, F_, E, k, dtype, seed=0, **kw):
    torch.manual_seed(seed)
    moe = MoE(hidden_size=H, ffn_hidden_size=F_, num_experts=E, top_k=k, dtype=dtype, backend="torch", **kw)
    with torch.no_grad():
        moe.router.weight.normal_(0.0, 0.3)  # spread logits: no near-ties in the selection
    return moe


# (H, F, E, k, score, normalize, activation, extra kwargs, input shape): what each case exercises
LAYER_CASES = [
    pytest.param(16, 24, 8, 2, "softmax", True, "swiglu", {}, (3, 7, 16), id="mixtral-like-BSH"),
    pytest.param(12, 20, 6, 3, "sigmoid", True, "swiglu", dict(aux_loss_coeff=0.05, z_loss_coeff=0.01),
                 (25, 12), id="deepseek-like-aux-z"),
    pytest.param(10, 8, 5, 1, "softmax", False, "gelu", {}, (4, 10), id="E-prime-top1-empty-experts"),
    pytest.param(8, 16, 1, 1, "softmax", False, "swiglu", {}, (9, 8), id="one-expert"),
    pytest.param(8, 12, 4, 4, "softmax", True, "swiglu", dict(aux_loss_coeff=0.1), (6, 8), id="k-equals-E"),
]


def _grads(moe, x, dy, extra=None):
    y = moe(x)
    loss = (y.double() * dy.double()).sum() if extra is None else extra(y)
    params = (x, moe.router.weight, moe.experts.fc1_weight, moe.experts.fc2_weight)
    return (y,) + torch.autograd.grad(loss, params)


@pytest.mark.parametrize("H,F_,E,k,score,normalize,act,kw,shape", LAYER_CASES)
def test_layer_matches_naive_float64(H, F_, E, k, score, normalize, act, kw, shape):
    moe = make_layer(H, F_, E, k, torch.float64, score=score, normalize_topk=normalize, activation=act, **kw)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    y, dx, dwr, dw1, dw2 = _grads(moe, x, dy)
    assert y.shape == x.shape and y.dtype == x.dtype

    xr = x.detach().reshape(-1, H).requires_grad_()
    wr = moe.router.weight.detach().clone().requires_grad_()
    w1 = moe.experts.fc1_weight.detach().clone().requires_grad_()
    w2 = moe.experts.fc2_weight.detach().clone().requires_grad_()
    ref, aux = naive_moe(xr, wr, w1, w2, k, score=score, normalize=normalize, activation=act,
                         aux_coeff=kw.get("aux_loss_coeff", 0.0), z_coeff=kw.get("z_loss_coeff", 0.0))
    rdx, rdwr, rdw1, rdw2 = torch.autograd.grad((ref * dy.reshape(-1, H)).sum() + aux, (xr, wr, w1, w2))
    # The router is fp32 by design: probabilities carry fp32 rounding (~1e-7 relative), and the
    # router gradient is accumulated in fp32; the experts run in float64.
    torch.testing.assert_close(y.reshape(-1, H), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx.reshape(-1, H), rdx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dwr.double(), rdwr.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw1, rdw1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw2, rdw2, rtol=1e-5, atol=1e-6)


def _rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize(
    "device,backend",
    [
        pytest.param("cpu", "torch", id="cpu-torch"),
        pytest.param("cuda", "auto", id="cuda-triton", marks=pytest.mark.gpu),
    ],
)
def test_layer_bf16_within_twice_plain_torch_bf16_error(device, backend):
    """bf16 layer vs the float64 naive composition: at most 2× the error of the same composition
    written in plain PyTorch bf16 (quack's tolerance idiom), for y and every gradient."""
    H, F_, E, k, T = 32, 48, 8, 2, 64
    torch.manual_seed(0)
    moe = MoE(hidden_size=H, ffn_hidden_size=F_, num_experts=E, top_k=k, dtype=torch.bfloat16, backend=backend,
              device=device)
    with torch.no_grad():
        moe.router.weight.normal_(0.0, 0.3)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=g).bfloat16().to(device).requires_grad_()
    dy = torch.randn(T, H, generator=g).bfloat16().to(device)
    ours = [t.cpu() for t in _grads(moe, x, dy)]
    x, dy = x.detach().cpu(), dy.cpu()

    def naive(dtype):
        xr = x.to(dtype).requires_grad_()
        wr = moe.router.weight.detach().cpu().requires_grad_()
        w1 = moe.experts.fc1_weight.detach().cpu().to(dtype).requires_grad_()
        w2 = moe.experts.fc2_weight.detach().cpu().to(dtype).requires_grad_()
        y, _ = naive_moe(xr, wr, w1, w2, k, dtype=dtype)
        return (y,) + torch.autograd.grad((y * dy.to(dtype)).sum(), (xr, wr, w1, w2))

    exact = naive(torch.float64)
    plain_bf16 = naive(torch.bfloat16)
    for name, o, r, b in zip(("y", "dx", "drouter", "dfc1", "dfc2"), ours, exact, plain_bf16):
        err, base = _rel_err(o, r), _rel_err(b, r)
        assert err <= 2 * base, f"{name}: relative error {err:.2e} > 2 × plain bf16 {base:.2e}"


def check_triton_layer_matches_torch(device):
    """The whole layer on the Triton path (dispatch gathers + grouped-MLP kernels) against the torch
    path, fp32: the same arithmetic, fp32 sums in another order (GEMM tiles)."""
    torch.manual_seed(0)
    shape = dict(hidden_size=16, ffn_hidden_size=32, num_experts=5, top_k=2, aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
    a = MoE(**shape, backend="torch", device=device)
    b = MoE(**shape, backend="triton", device=device)
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 9, 16, device=device)
    dy = torch.randn(3, 9, 16, device=device)
    outs = []
    for m in (a, b):
        xx = x.clone().requires_grad_()
        y = m(xx)
        outs.append([y] + list(torch.autograd.grad(y, [xx] + list(m.parameters()), dy)))
    for name, u, v in zip(["y", "dx", "drouter", "dfc1", "dfc2"], *outs):
        torch.testing.assert_close(v, u, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.long(seconds=80)
@pytest.mark.interpreter_child(seconds=12)
def test_triton_layer_matches_torch():
    if torch.cuda.is_available():
        check_triton_layer_matches_torch("cuda")
        return
    _triton_env.run_check_interpreted(__file__, "check_triton_layer_matches_torch", "cpu")


def test_expert_bias_changes_selection_only():
    H, F_, E, k, T = 8, 8, 4, 2, 20
    moe = make_layer(H, F_, E, k, torch.float64, expert_bias=True, score="sigmoid")
    bias = torch.tensor([0.0, 3.0, 0.0, 0.0])
    moe.router.expert_bias.copy_(bias)
    x = torch.randn(T, H, dtype=torch.float64)
    y = moe(x)
    ref, _ = naive_moe(x, moe.router.weight.detach(), moe.experts.fc1_weight.detach(),
                       moe.experts.fc2_weight.detach(), k, score="sigmoid", expert_bias=bias)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    assert moe.router.tokens_per_expert[1].item() == T  # every token chose expert 1


def test_layer_is_deterministic():
    moe = make_layer(16, 16, 6, 2, torch.float32)
    x = torch.randn(40, 16, requires_grad=True)
    dy = torch.randn(40, 16)
    a = _grads(moe, x, dy)
    b = _grads(moe, x, dy)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_recompute_fc1_gives_the_same_gradients():
    H, F_, E, k, T = 16, 24, 6, 2, 30
    x = torch.randn(T, H, requires_grad=True)
    dy = torch.randn(T, H)
    plain = _grads(make_layer(H, F_, E, k, torch.float32), x, dy)
    recomputed = _grads(make_layer(H, F_, E, k, torch.float32, recompute_fc1=True), x, dy)
    for a, b in zip(plain, recomputed):  # FC1 rerun on the same rows: the same bits
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe_name", ["fp8_block", "mxfp8"])
def test_is_first_microbatch_reaches_the_experts(recipe_name):
    """Under a recipe the layer hands is_first_microbatch to its GroupedMLP: True keeps the quantized
    weights, False reuses them with the same results, a changed weight is caught."""
    H, F_, E, k, T = 16, 24, 6, 2, 30
    moe = make_layer(H, F_, E, k, torch.bfloat16, recipe=recipe_name)
    x = torch.randn(T, H).bfloat16()
    y_none = moe(x)
    assert moe.experts.quantized_weights is None
    y_first = moe(x, is_first_microbatch=True)
    kept = moe.experts.quantized_weights
    assert kept is not None
    y_later = moe(x, is_first_microbatch=False)
    assert moe.experts.quantized_weights is kept
    assert torch.equal(y_none, y_first) and torch.equal(y_none, y_later)
    with torch.no_grad():
        moe.experts.fc1_weight.add_(1.0)  # an optimizer step without a new True
    with pytest.raises(ValueError, match="fc1_weight changed"):
        moe(x, is_first_microbatch=False)
    with pytest.raises(TypeError, match="is_first_microbatch"):
        moe(x, is_first_microbatch=1)


def test_accumulate_into_main_grad():
    """Expert weight gradients land in fp32 .main_grad (added to what is there), not in .grad."""
    H, F_, E, k, T = 16, 24, 6, 2, 30
    x = torch.randn(T, H)
    dy = torch.randn(T, H)
    ref = make_layer(H, F_, E, k, torch.bfloat16)
    ref(x.bfloat16()).backward(dy.bfloat16())
    moe = make_layer(H, F_, E, k, torch.bfloat16, accumulate_into_main_grad=True)
    w1, w2 = moe.experts.fc1_weight, moe.experts.fc2_weight
    w1.main_grad = torch.ones(w1.shape, dtype=torch.float32)
    w2.main_grad = torch.zeros(w2.shape, dtype=torch.float32)
    moe(x.bfloat16()).backward(dy.bfloat16())
    assert w1.grad is None and w2.grad is None
    assert moe.router.weight.grad is not None
    torch.testing.assert_close(moe.router.weight.grad, ref.router.weight.grad, rtol=0, atol=0)
    # fp32 wgrad vs the bf16 one rounded once: within one bf16 rounding (2^-8 relative).
    torch.testing.assert_close(w1.main_grad - 1, ref.experts.fc1_weight.grad.float(), rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(w2.main_grad, ref.experts.fc2_weight.grad.float(), rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(w2.main_grad.bfloat16(), ref.experts.fc2_weight.grad, rtol=0, atol=0)


@pytest.mark.parametrize("missing", ["experts.fc1_weight", "experts.fc2_weight", "shared_experts.fc1_weight",
                                     "shared_experts.fc2_weight"])
def test_main_grad_missing_names_the_module(missing):
    """With accumulate_into_main_grad, a weight without a main_grad is an error that names its
    module's path: the routed experts' and the shared experts' weights have the same names."""
    moe = make_layer(8, 12, 4, 2, torch.bfloat16, accumulate_into_main_grad=True, num_shared_experts=1)
    for owner in (moe.experts, moe.shared_experts):
        for w in (owner.fc1_weight, owner.fc2_weight):
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    module, weight = missing.split(".")
    del getattr(getattr(moe, module), weight).main_grad
    with pytest.raises(ValueError, match=rf"^{missing}: accumulate_into_main_grad needs a tensor {missing}\.main_grad"):
        moe(torch.randn(5, 8, dtype=torch.bfloat16))
    getattr(getattr(moe, module), weight).main_grad = torch.zeros(3, dtype=torch.float32)
    with pytest.raises(ValueError, match=rf"^{missing}\.main_grad: expected shape"):
        moe(torch.randn(5, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(top_k=9), ValueError, "top_k"),  # top_k > num_experts
        (dict(hidden_size=0), ValueError, "hidden_size"),
        (dict(ffn_hidden_size=1.5), TypeError, "ffn_hidden_size"),
        (dict(score="tanh"), ValueError, "score"),
        (dict(backend="cuda"), ValueError, "backend"),
        (dict(activation="relu"), ValueError, "activation"),
        (dict(ep_group=object()), ValueError, "ep_group"),  # torch.distributed not initialized
        (dict(recompute_fc1=1), TypeError, "recompute_fc1"),
    ],
    ids=["k>E", "H=0", "F-float", "score", "backend", "activation", "ep-no-dist", "recompute-int"],
)
def test_layer_rejects_bad_arguments(kwargs, exc, match):
    args = dict(hidden_size=8, ffn_hidden_size=8, num_experts=8, top_k=2)
    args.update(kwargs)
    if "ep_group" in kwargs:
        assert not dist.is_initialized()
    with pytest.raises(exc, match=match):
        MoE(hidden_size=args.pop("hidden_size"), ffn_hidden_size=args.pop("ffn_hidden_size"),
            num_experts=args.pop("num_experts"), top_k=args.pop("top_k"), **args)


def test_layer_rejects_bad_x():
    moe = MoE(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2, backend="torch")
    with pytest.raises(ValueError, match=r"x: expected shape \(T, 8\) or \(B, S, 8\)"):
        moe(torch.randn(3, 9))
    with pytest.raises(ValueError, match="x: expected shape"):
        moe(torch.randn(8))
    with pytest.raises(TypeError, match="x: expected dtype torch.float32"):
        moe(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        moe([[0.0] * 8])


@pytest.mark.gpu
def test_cuda_graph_capture_of_forward_backward():
    """One-GPU layer forward + backward captured in one CUDA graph: sync-free (no .item(), no
    nonzero, no bincount). Replays on new inputs equal eager runs bit for bit."""
    torch.manual_seed(0)
    H, F_, E, k, T = 256, 512, 8, 2, 512
    moe = MoE(hidden_size=H, ffn_hidden_size=F_, num_experts=E, top_k=k, aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
              device="cuda", dtype=torch.bfloat16)
    params = [p for p in moe.parameters()]
    static_x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step():
        y = moe(static_x)
        y.backward(static_dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile the Triton kernels, warm the allocator
            for p in params + [static_x]:
                p.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for p in params + [static_x]:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()

    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        new_x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        new_dy = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        static_x.data.copy_(new_x)
        static_dy.copy_(new_dy)
        graph.replay()
        captured = [static_y.clone(), static_x.grad.clone()] + [p.grad.clone() for p in params]

        x = new_x.clone().requires_grad_()
        y = moe(x)
        grads = torch.autograd.grad(y, [x] + params, new_dy)
        eager = [y] + list(grads)
        for name, c, e in zip(["y", "dx"] + [n for n, _ in moe.named_parameters()], captured, eager):
            assert torch.equal(c, e), f"{name}: graph replay differs from eager, max {(c - e).abs().max()}"


def test_torch_compile_fullgraph_of_the_layer():
    # One process, torch backend: router, sort, permute, the grouped-MLP custom op and the k-ordered
    # combine trace into one graph with no break, and give the eager bits.
    torch.manual_seed(0)
    moe = MoE(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
              backend="torch")
    x = torch.randn(10, 32, requires_grad=True)
    params = [x, moe.router.weight, moe.experts.fc1_weight, moe.experts.fc2_weight]

    def f(x):
        return moe(x)

    y = f(x)
    yc = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(y, yc)
    dy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, params, dy), torch.autograd.grad(yc, params, dy)):
        assert torch.equal(a, b)


# --- the router stays fp32 under the usual ways of converting a model -----------------------------


@pytest.mark.parametrize("cast", [
    pytest.param(lambda m: m.to(torch.bfloat16), id="to-bf16"),
    pytest.param(lambda m: m.half(), id="half"),
    pytest.param(lambda m: m.bfloat16(), id="bfloat16"),
    pytest.param(lambda m: m.to("cpu", torch.bfloat16), id="to-device-and-dtype"),
])
def test_model_casts_keep_the_router_fp32(cast):
    # .to(dtype), .half(), .bfloat16() used to round the gate weight to bf16 and then fail in the
    # router's fp32 matmul. The experts follow the cast; the router's weight keeps its fp32 bits.
    moe = make_layer(64, 32, 8, 2, torch.float32, aux_loss_coeff=1e-2)
    w0 = moe.router.weight.detach().clone()
    cast(moe)
    dtype = moe.experts.fc1_weight.dtype
    assert dtype in (torch.bfloat16, torch.float16)
    assert moe.router.weight.dtype == torch.float32 and torch.equal(moe.router.weight, w0)
    x = torch.randn(6, 64, dtype=dtype, requires_grad=True)
    ref = make_layer(64, 32, 8, 2, dtype)
    with torch.no_grad():
        ref.router.weight.copy_(w0)
        ref.experts.fc1_weight.copy_(moe.experts.fc1_weight)
        ref.experts.fc2_weight.copy_(moe.experts.fc2_weight)
    y = moe(x)
    assert y.dtype == dtype and torch.equal(y, ref(x))  # same routing as a layer built in that dtype
    y.float().square().sum().backward()
    assert moe.router.weight.grad.dtype == torch.float32 and moe.router.weight.grad.abs().sum() > 0


def test_router_weight_swapped_to_bf16_is_refused():
    # What FSDP's mixed-precision parameter cast does: a bf16 tensor in the fp32 weight's place.
    moe = make_layer(16, 8, 4, 2, torch.float32)
    moe.router.weight.data = moe.router.weight.data.bfloat16()
    with pytest.raises(TypeError, match=r"router.weight.*fp32.*MixedPrecisionPolicy"):
        moe(torch.randn(3, 16))


def test_router_logits_fp32_under_autocast():
    # autocast would run the gate's matmul in bf16; the router turns it off for the logits.
    moe = make_layer(64, 32, 8, 2, torch.float32)
    x = torch.randn(32, 64)
    probs, idx = moe.router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probs_ac, idx_ac = moe.router(x)
    assert probs_ac.dtype == torch.float32
    assert torch.equal(idx, idx_ac) and torch.equal(probs, probs_ac)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_runs_on_the_meta_device(dtype):
    # Shape inference on meta tensors (a model built under device="meta"): the router's autocast-off
    # context must not ask autocast about the meta device, which it does not know.
    moe = MoE(hidden_size=64, ffn_hidden_size=32, num_experts=4, top_k=2, device="meta", dtype=dtype,
              num_shared_experts=1, shared_expert_gate=True)
    x = torch.randn(8, 64, device="meta", dtype=dtype, requires_grad=True)
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = moe(x)
        assert y.shape == (8, 64) and y.dtype == dtype and y.device.type == "meta"
        y.sum().backward()
        assert x.grad.shape == (8, 64) and moe.router.weight.grad.dtype == torch.float32
        x.grad = None



def test_meta_layer_reset_after_to_empty_leaves_nothing_uninitialized():
    # FSDP2's deferred init: build on meta, to_empty, then reset_parameters on every module that has
    # one. The router's balancing buffers are state, not parameters, and must come back zeroed.
    moe = MoE(hidden_size=64, ffn_hidden_size=32, num_experts=4, top_k=2, device="meta", expert_bias=True,
              num_shared_experts=1)
    moe.to_empty(device="cpu")
    moe.router.expert_bias.fill_(float("nan"))
    moe.router.tokens_per_expert.fill_(7.0)
    for module in moe.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert torch.equal(moe.router.expert_bias, torch.zeros(4))
    assert torch.equal(moe.router.tokens_per_expert, torch.zeros(4))
    for name, p in moe.named_parameters():
        assert torch.isfinite(p).all() and p.abs().max() < 1, name
    y = moe(torch.randn(8, 64))
    assert torch.isfinite(y).all()


_FSDP_SCRIPT = r'''
import os, socket, torch, torch.distributed as dist
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
import moemlp
torch.manual_seed(0)
x = torch.randn(6, 64, dtype=torch.bfloat16)
whole = moemlp.MoE(hidden_size=64, ffn_hidden_size=32, num_experts=8, top_k=2, backend="torch")
fully_shard(whole, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
try:
    whole(x)
    print("whole: no error")
except TypeError as e:
    print("whole: TypeError", "MixedPrecisionPolicy(param_dtype=torch.float32)" in str(e))
split = moemlp.MoE(hidden_size=64, ffn_hidden_size=32, num_experts=8, top_k=2, backend="torch")
fully_shard(split.router, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
fully_shard(split, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
y = split(x)
y.float().square().sum().backward()
print("split:", y.dtype, split.router.weight.grad.dtype, bool(split.router.weight.grad.abs().sum() > 0))
dist.destroy_process_group()
'''


def test_fsdp_mixed_precision_router():
    # FSDP2's MixedPrecisionPolicy(param_dtype=bf16) over the whole layer would hand the router a bf16
    # weight: refused with the fix in the message. With the router sharded under its own fp32 policy,
    # the layer runs in bf16 and the router's gradient is fp32. One gloo process, in a child.
    run = subprocess.run([sys.executable, "-c", _FSDP_SCRIPT], capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "whole: TypeError True" in run.stdout, run.stdout
    assert "split: torch.bfloat16 torch.float32 True" in run.stdout, run.stdout
