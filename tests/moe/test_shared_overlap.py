"""Shared experts on a side stream (MoE's ``shared_expert_overlap``): the same bits as one stream.

The layer input has three consumers (router, routed experts, shared experts); autograd would add their
bf16 gradients in the order it runs them, which follows the order the forward issued them in, and
the side stream issues the shared experts first. ``_ForkTokens`` sums them in one fixed order instead;
the CPU tests check that order, the GPU test the whole layer with the stream on and off."""

import pytest
import torch

from moemlp.moe import MoE
from moemlp.moe.layer import _ForkTokens


def _branch_grads(n, generator):
    """Three bf16 gradients of very different magnitudes: their sum depends on the order of the adds."""
    return [(torch.randn(n, generator=generator) * scale).bfloat16() for scale in (1.0, 300.0, 1e-2)]


def _input_grad(fork: bool, issue_order, d_router, d_routed, d_shared):
    """dx of x read by three branches (identity ops here), the branches created in ``issue_order``."""
    x = torch.zeros_like(d_router, requires_grad=True)
    aliases = dict(zip(("router", "routed", "shared"), _ForkTokens.apply(x, None) if fork else (x, x, x)))
    outputs = {name: aliases[name] * 1 for name in issue_order}  # one autograd node per branch, in this order
    grads = dict(router=d_router, routed=d_routed, shared=d_shared)
    (dx,) = torch.autograd.grad([outputs[n] for n in issue_order], [x], [grads[n] for n in issue_order])
    return dx


def test_fork_sums_the_input_gradient_in_one_order_whatever_the_issue_order():
    d_router, d_routed, d_shared = _branch_grads(4096, torch.Generator().manual_seed(0))
    one_stream = ("router", "routed", "shared")  # the shared experts after the routed ones
    side_stream = ("shared", "router", "routed")  # the shared experts issued first
    # The case must show the order: plain autograd gives two different results here ...
    assert not torch.equal(_input_grad(False, one_stream, d_router, d_routed, d_shared),
                           _input_grad(False, side_stream, d_router, d_routed, d_shared))
    # ... and the fork one, (shared + routed) + router, the order plain autograd takes with the shared
    # experts issued last (it runs the last-created backward first).
    expected = (d_shared + d_routed) + d_router
    for order in (one_stream, side_stream, ("routed", "shared", "router")):
        assert torch.equal(_input_grad(True, order, d_router, d_routed, d_shared), expected), order
    assert torch.equal(_input_grad(False, one_stream, d_router, d_routed, d_shared), expected)


def test_fork_leaves_a_missing_branch_gradient_out():
    # A branch without a gradient adds nothing: no zeros materialised (0 + -0 would turn -0 into +0).
    d = torch.tensor([-0.0, 1.5, -2.0]).bfloat16()
    x = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    router, routed, shared = _ForkTokens.apply(x, None)
    (dx,) = torch.autograd.grad([routed * 1], [x], [d])
    assert torch.equal(dx, d) and torch.signbit(dx[0])


@pytest.mark.parametrize("overlap", [True, False])
def test_cpu_layer_ignores_the_option(overlap):
    # On the CPU there is one stream: either setting gives the bits of a layer built without the option.
    kw = dict(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, num_shared_experts=1,
              shared_expert_gate=True, dtype=torch.bfloat16, backend="torch")
    torch.manual_seed(0)
    default = MoE(**kw)
    layer = MoE(**kw, shared_expert_overlap=overlap)
    layer.load_state_dict(default.state_dict())
    assert default.shared_expert_overlap is False  # opt-in: slower on the H200's deepseek-v3-like layer
    x = torch.randn(40, 32, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    assert layer._side_stream(x.clone().requires_grad_()) is None
    outs = []
    for m in (default, layer):
        xx = x.detach().clone().requires_grad_()
        y = m(xx)
        outs.append([y] + list(torch.autograd.grad(y, [xx] + list(m.parameters()), dy)))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


# --- GPU -------------------------------------------------------------------------------------------

GPU_CASES = [
    # the shared experts' input gradient meets the router's and the routed experts' in _ForkTokens
    pytest.param(dict(num_shared_experts=2), "grad", id="shared"),
    # the gate adds a fourth contribution to dx: the case whose bits the removed attempt changed
    pytest.param(dict(num_shared_experts=2, shared_expert_gate=True), "grad", id="shared-gate"),
    # DeepSeek-V3's routing with the aux loss; .backward() into .grad (AccumulateGrad on the side stream)
    pytest.param(dict(num_shared_experts=1, score="sigmoid", num_groups=4, topk_groups=2, expert_bias=True,
                      routed_scaling_factor=2.5, aux_loss_coeff=1e-2), "backward", id="deepseek-backward"),
    # fp32 main_grad written in the side stream's backward, read after backward() on the main stream
    pytest.param(dict(num_shared_experts=2, shared_expert_gate=True, accumulate_into_main_grad=True),
                 "backward", id="shared-gate-main-grad"),
    # recompute_fc1: the side stream's backward runs FC1 again from the layer input it kept
    pytest.param(dict(num_shared_experts=2, shared_expert_gate=True, recompute_fc1=True), "grad",
                 id="shared-gate-recompute"),
]


def _run(m, x, dy, mode):
    """y and every gradient (x's, each parameter's, each main_grad) of one forward + backward."""
    params = list(m.parameters())
    if mode == "grad":
        xx = x.clone().requires_grad_()
        y = m(xx)
        return [y] + list(torch.autograd.grad(y, [xx] + params, dy))
    for p in params:
        p.grad = None
        if hasattr(p, "main_grad"):
            p.main_grad.zero_()
    xx = x.clone().requires_grad_()
    y = m(xx)
    y.backward(dy)
    return [y, xx.grad] + [p.grad for p in params] + [p.main_grad.clone() for p in params if hasattr(p, "main_grad")]


@pytest.mark.long(seconds=45)
@pytest.mark.gpu
@pytest.mark.parametrize("kw,mode", GPU_CASES)
def test_shared_expert_overlap_gives_the_one_stream_bits(kw, mode):
    # Big enough that the side stream's GEMMs run beside the routed path's kernels; five iterations,
    # each against the one-stream layer, to catch a race (a tensor freed or read too early).
    H, F_, E, k, T = 1024, 512, 16, 4, 4096
    torch.manual_seed(0)
    layers = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        layers[overlap] = MoE(hidden_size=H, ffn_hidden_size=F_, num_experts=E, top_k=k, device="cuda",
                              dtype=torch.bfloat16, shared_expert_overlap=overlap, **kw)
    layers[True].load_state_dict(layers[False].state_dict())
    if kw.get("accumulate_into_main_grad"):
        for m in layers.values():
            for mlp in (m.experts, m.shared_experts):
                for w in (mlp.fc1_weight, mlp.fc2_weight):
                    w.main_grad = torch.zeros_like(w, dtype=torch.float32)
    x = torch.randn(2, T // 2, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    probe = torch.empty(1, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert layers[True]._side_stream(probe) is not None and layers[False]._side_stream(probe) is None
    reference = _run(layers[False], x, dy, mode)
    with torch.no_grad():
        reference_no_grad = layers[False](x)
    for _ in range(5):
        overlapped = _run(layers[True], x, dy, mode)
        assert len(overlapped) == len(reference)
        for i, (a, b) in enumerate(zip(reference, overlapped)):
            assert (a is None) == (b is None), i
            assert a is None or torch.equal(a, b), i
        with torch.no_grad():
            assert torch.equal(layers[True](x), reference_no_grad)
        # x without a gradient under autograd: one stream (no join point for the backward), same bits
        y = layers[True](x)
        assert torch.equal(y, reference[0])
