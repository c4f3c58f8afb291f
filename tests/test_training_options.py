"""recompute_fc1 and accumulate_into_main_grad (Megatron-Core-style training integration)."""

import pytest
import torch

import _triton_env
import moemlp
from _cases import make_problem, run

# The torch-backend tests run in the parent process only, not again in the interpreter child that
# runs this file for its Triton cases (2.6 s there).
in_parent = pytest.mark.skipif(_triton_env.INTERPRET, reason="torch backend: runs in the parent process")


@in_parent
@pytest.mark.parametrize("backend", ["torch"])
def test_recompute_fc1_same_bits_and_keeps_no_h(backend):
    p = make_problem([21, 0, 17], 32, 16, capacity=3, bias=True, seed=20)
    y0, g0 = run(p, backend=backend)
    y1, g1 = run(p, backend=backend, recompute_fc1=True)
    assert torch.equal(y0, y1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        moemlp.grouped_mlp(p.x, p.splits, p.probs, p.fc1_weight, p.fc2_weight, backend=backend,
                           recompute_fc1=True)
    assert not any(tuple(t.shape) == (p.x.shape[0], 32) and t is not p.x for t in saved)


@in_parent
def test_accumulate_into_main_grad():
    p = make_problem([21, 0, 17], 32, 16, seed=21)
    _, g_ref = run(p, backend="torch")  # weight grads in bf16 through .grad
    w1, w2 = (torch.nn.Parameter(t.detach().clone()) for t in (p.fc1_weight, p.fc2_weight))
    w1.main_grad, w2.main_grad = torch.zeros(w1.shape), torch.zeros(w2.shape)
    w2.grad_added_to_main_grad = False
    for step in (1, 2):
        y = moemlp.grouped_mlp(p.x, p.splits, p.probs, w1, w2, backend="torch", accumulate_into_main_grad=True)
        y.backward(p.dy)
        if step == 1:
            first = (w1.main_grad.clone(), w2.main_grad.clone())
    assert w1.grad is None  # no flag: autograd gets no gradient
    assert w2.grad_added_to_main_grad and torch.equal(w2.grad, torch.zeros_like(w2))
    for w, once, name in ((w1, first[0], "fc1_weight"), (w2, first[1], "fc2_weight")):
        # The fp32 wgrad is the unrounded accumulator: rounding it gives the bf16 gradient exactly,
        # and it carries bits bf16 does not.
        assert torch.equal(once.to(torch.bfloat16), g_ref[name]), name
        assert not torch.equal(once.to(torch.bfloat16).float(), once), name
        assert torch.equal(w.main_grad, 2 * once), name  # accumulated, not overwritten
    assert p.probs.grad.dtype == torch.float32


@in_parent
def test_accumulate_into_main_grad_needs_main_grad():
    p = make_problem([3, 4], 16, 8, seed=22)
    with pytest.raises(ValueError, match="fc1_weight.main_grad"):
        moemlp.grouped_mlp(p.x, p.splits, p.probs, p.fc1_weight, p.fc2_weight, accumulate_into_main_grad=True)
    w1 = p.fc1_weight.detach().requires_grad_()
    w1.main_grad = torch.zeros(w1.shape, dtype=torch.bfloat16)
    w2 = p.fc2_weight.detach().requires_grad_()
    w2.main_grad = torch.zeros(w2.shape)
    with pytest.raises(TypeError, match="float32"):
        moemlp.grouped_mlp(p.x, p.splits, p.probs, w1, w2, accumulate_into_main_grad=True)

    w1.main_grad = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"fc1_weight.main_grad: expected shape"):
        moemlp.grouped_mlp(p.x, p.splits, p.probs, w1, w2, accumulate_into_main_grad=True)


@in_parent
@pytest.mark.parametrize("recipe", [None, "fp8_block"])
def test_accumulate_into_main_grad_of_non_contiguous_weights(recipe):
    # The op runs on contiguous copies of such weights (a slice; the transposed layout under a
    # recipe); the gradient must still land in the caller's own main_grad.
    p = make_problem([5, 0, 6], 32, 16, seed=23)
    E, N1, H = p.fc1_weight.shape
    big1 = torch.zeros(E, N1, 2 * H, dtype=p.fc1_weight.dtype)
    big1[:, :, :H] = p.fc1_weight.detach()
    w1 = big1[:, :, :H].requires_grad_()  # a slice: not contiguous
    w2 = p.fc2_weight.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    assert not w1.is_contiguous() and not w2.is_contiguous()
    w1.main_grad, w2.main_grad = torch.zeros(w1.shape), torch.zeros(w2.shape)
    y = moemlp.grouped_mlp(p.x, p.splits, p.probs, w1, w2, backend="torch", recipe=recipe,
                           accumulate_into_main_grad=True)
    y.backward(p.dy)
    q1, q2 = (t.detach().clone().requires_grad_() for t in (p.fc1_weight, p.fc2_weight))
    q1.main_grad, q2.main_grad = torch.zeros(q1.shape), torch.zeros(q2.shape)
    moemlp.grouped_mlp(p.x, p.splits, p.probs, q1, q2, backend="torch", recipe=recipe,
                       accumulate_into_main_grad=True).backward(p.dy)
    assert torch.equal(w1.main_grad, q1.main_grad) and torch.equal(w2.main_grad, q2.main_grad)
    assert w1.main_grad.abs().sum() > 0 and w2.main_grad.abs().sum() > 0


@in_parent
def test_accumulate_into_main_grad_skips_frozen_weights_and_no_grad():
    p = make_problem([3, 4], 16, 8, seed=24)
    w1 = p.fc1_weight.detach().requires_grad_()
    w1.main_grad = torch.zeros(w1.shape)
    w2 = p.fc2_weight.detach()  # frozen: no main_grad needed
    y = moemlp.grouped_mlp(p.x, p.splits, p.probs, w1, w2, backend="torch", accumulate_into_main_grad=True)
    y.backward(p.dy)
    assert w1.main_grad.abs().sum() > 0 and w2.grad is None and not hasattr(w2, "main_grad")
    bare1, bare2 = p.fc1_weight.detach().requires_grad_(), p.fc2_weight.detach().requires_grad_()
    for ctx in (torch.no_grad, torch.inference_mode):  # no backward: nothing needs a main_grad
        with ctx():
            y0 = moemlp.grouped_mlp(p.x, p.splits, p.probs, bare1, bare2, backend="torch",
                                    accumulate_into_main_grad=True)
        assert torch.equal(y0, y.detach())


# --- the Triton backend: CPU interpreter in a child process (tests/_triton_env.py), or the GPU ----

_TRITON_HERE = _triton_env.RUN_CPU_CASES or torch.cuda.is_available()


@pytest.mark.interpreter_child(seconds=25)
@pytest.mark.skipif(not _triton_env.START_CHILD, reason="starts the interpreter child on a CPU-only machine")
def test_triton_cases_under_interpreter():
    _triton_env.run_file_interpreted(__file__)


def _on_device(p):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q = p.cast(p.x.dtype)
    q.x, q.probs, q.fc1_weight, q.fc2_weight = (t.detach().to(dev).requires_grad_() for t in
                                                (p.x, p.probs, p.fc1_weight, p.fc2_weight))
    q.splits, q.dy = p.splits.to(dev), p.dy.to(dev)
    return q


@pytest.mark.skipif(not _TRITON_HERE, reason="needs the interpreter child or a GPU")
def test_triton_recompute_fc1_same_bits():
    p = _on_device(make_problem([21, 0, 17], 32, 16, capacity=3, seed=23))
    y0, g0 = run(p, backend="triton")
    y1, g1 = run(p, backend="triton", recompute_fc1=True)
    assert torch.equal(y0, y1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


@pytest.mark.skipif(not _TRITON_HERE, reason="needs the interpreter child or a GPU")
def test_triton_main_grad_is_the_fp32_accumulator():
    p = _on_device(make_problem([21, 0, 17], 32, 16, seed=24))
    _, g_ref = run(p, backend="triton")
    w1, w2 = (torch.nn.Parameter(t.detach().clone()) for t in (p.fc1_weight, p.fc2_weight))
    for w in (w1, w2):
        w.main_grad = torch.zeros(w.shape, device=w.device)
    y = moemlp.grouped_mlp(p.x, p.splits, p.probs, w1, w2, backend="triton", accumulate_into_main_grad=True)
    y.backward(p.dy)
    for w, name in ((w1, "fc1_weight"), (w2, "fc2_weight")):
        assert torch.equal(w.main_grad.to(torch.bfloat16), g_ref[name]), name
        assert not torch.equal(w.main_grad.to(torch.bfloat16).float(), w.main_grad), name
