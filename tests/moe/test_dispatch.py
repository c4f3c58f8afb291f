"""Dispatch units (dispatch.py, _kernels.py) against plain torch.

Without a GPU the Triton gathers run under TRITON_INTERPRET=1 in a child process: triton reads the
variable when a kernel is decorated, and setting it in this process would switch every later
test's grouped MLP onto the interpreter too.
"""


import pytest
import torch

import _triton_env
from moemlp.moe import dispatch
from moemlp.moe.dispatch import permute, permute_probs, plan_dispatch, unpermute


def _random_routing(T, E, k, seed, skip_expert=None):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    if skip_expert is not None:
        scores[:, skip_expert] = -1.0
    return scores.topk(k, dim=-1).indices


# (T, E, k, expert with no rows): what each case exercises
PLAN_CASES = [
    pytest.param(33, 8, 2, None, id="basic"),
    pytest.param(50, 7, 3, 4, id="E-prime-empty-expert"),
    pytest.param(1, 4, 4, None, id="one-token-all-experts"),
    pytest.param(16, 1, 1, None, id="one-expert"),
    pytest.param(0, 5, 2, None, id="no-tokens"),
    pytest.param(64, 64, 1, None, id="E-large-top1"),
]


@pytest.mark.parametrize("T,E,k,empty", PLAN_CASES)
def test_plan_matches_plain_torch(T, E, k, empty):
    idx = _random_routing(T, E, k, seed=T + E, skip_expert=empty)
    plan = plan_dispatch(idx, E)
    flat = idx.reshape(-1)
    assert torch.equal(plan.splits, torch.bincount(flat, minlength=E))
    # Rows grouped by expert; within an expert, in (token, k) slot order (stable sort).
    slots = torch.arange(T * k)
    ref_perm = torch.cat([slots[flat == e] for e in range(E)])
    assert torch.equal(plan.perm, ref_perm)
    assert torch.equal(plan.src_token, ref_perm // k)
    assert torch.equal(plan.row_of.reshape(-1)[plan.perm], slots)  # inverse permutation
    if empty is not None:
        assert int(plan.splits[empty]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("T,E,k,empty", PLAN_CASES[:3])
def test_permute_unpermute_values_and_grads(T, E, k, empty, dtype):
    H = 10
    idx = _random_routing(T, E, k, seed=7, skip_expert=empty)
    plan = plan_dispatch(idx, E)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    x_perm = permute(x, plan)
    assert torch.equal(x_perm, x.detach()[plan.src_token])

    y_perm = torch.randn(T * k, H, generator=g).to(dtype).requires_grad_()
    y = unpermute(y_perm, plan)
    # Reference: for each token the k expert rows, summed in float64, rounded once.
    ref = y_perm.detach().double()[plan.row_of].sum(1)
    assert y.dtype == dtype
    if dtype == torch.bfloat16:
        # fp32 sum of k <= 3 bf16 values is exact (24-bit mantissa holds it); one rounding.
        assert torch.equal(y, ref.to(dtype))
    else:
        torch.testing.assert_close(y.double(), ref, rtol=0, atol=2 * k * torch.finfo(dtype).eps * 8)

    # Gradients: permute's is a sum over the k copies, unpermute's a copy per row.
    gp = torch.randn(T * k, H, generator=g).to(dtype)
    (dx,) = torch.autograd.grad(x_perm, x, gp)
    ref_dx = torch.zeros(T, H, dtype=torch.float64).index_add_(0, plan.src_token, gp.double())
    if dtype == torch.bfloat16:
        assert torch.equal(dx, ref_dx.to(dtype))
    else:
        torch.testing.assert_close(dx.double(), ref_dx, rtol=0, atol=2 * k * torch.finfo(dtype).eps * 8)
    gy = torch.randn(T, H, generator=g).to(dtype)
    (dy_perm,) = torch.autograd.grad(y, y_perm, gy)
    assert torch.equal(dy_perm, gy[plan.src_token])


def test_probs_travel_in_fp32_and_come_back_exactly():
    T, E, k = 21, 6, 2
    idx = _random_routing(T, E, k, seed=9)
    plan = plan_dispatch(idx, E)
    probs = torch.rand(T, k, dtype=torch.float32, requires_grad=True)
    p_perm = permute_probs(probs, plan)
    assert p_perm.dtype == torch.float32
    assert torch.equal(p_perm, probs.detach().reshape(-1)[plan.perm])  # bitwise: never rounded
    gp = torch.randn(T * k)
    (dprobs,) = torch.autograd.grad(p_perm, probs, gp)
    ref = torch.zeros(T * k).index_put_((plan.perm,), gp).view(T, k)
    assert torch.equal(dprobs, ref)


def test_local_forward_equals_per_expert_loop():
    """The one-device dispatch -> experts -> combine against a loop over experts with masks."""
    T, E, k, H = 40, 5, 2, 6
    idx = _random_routing(T, E, k, seed=10, skip_expert=3)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(T, k, generator=g, dtype=torch.float64, requires_grad=True)
    scale = torch.randn(E, H, generator=g, dtype=torch.float64)  # expert e: row ↦ p · tanh(row) · scale[e]

    def experts(x_tokens, splits, p_perm, x_index):  # gathers its rows from the tokens, as grouped_mlp
        e_of_row = torch.repeat_interleave(torch.arange(E), splits)
        return torch.tanh(x_tokens[x_index.index]) * scale[e_of_row] * p_perm[:, None]

    y, plan = dispatch.local_moe_forward(x, probs, idx, E, experts, triton=False)
    ref = torch.zeros(T, H, dtype=torch.float64)
    for e in range(E):
        for j in range(k):
            m = (idx[:, j] == e).double()[:, None]
            ref = ref + m * torch.tanh(x) * scale[e] * probs[:, j : j + 1]
    gy = torch.randn(T, H, generator=g, dtype=torch.float64)
    dx, dp = torch.autograd.grad(y, (x, probs), gy)
    rdx, rdp = torch.autograd.grad(ref, (x, probs), gy)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, rdx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dp, rdp, rtol=1e-12, atol=1e-12)


def test_sync_free_plan_ops():
    """The plan uses no bincount / nonzero / item (host reads on CUDA): checked on the meta device,
    where any op needing a value would fail."""
    idx = torch.empty(12, 2, dtype=torch.int64, device="meta")
    plan = plan_dispatch(idx, 4)
    assert plan.splits.shape == (4,) and plan.row_of.shape == (12, 2)


def check_triton_gathers_match_torch_bitwise(device):
    """Triton permute / unpermute (forward and backward) equal the torch path bit for bit: same
    gathers, same k order, same fp32 accumulation."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for H in (7, 1030):  # odd width; more than one 1024-column block
            T, E, k = 19, 5, 3
            idx = _random_routing(T, E, k, seed=12, skip_expert=1).to(device)
            plan = plan_dispatch(idx, E)
            g = torch.Generator().manual_seed(13)
            x = torch.randn(T, H, generator=g).to(device=device, dtype=dtype).requires_grad_()
            outs = []
            for use in (False, True):
                x_perm = permute(x, plan, use)
                y = unpermute(x_perm * 1.5, plan, use)
                (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
                outs.append((x_perm, y, dx))
            for name, a, b in zip(("x_perm", "y", "dx"), *outs):
                assert torch.equal(a, b), f"{name} {dtype} H={H}: Triton differs from torch"
    # Empty inputs launch nothing.
    empty = plan_dispatch(torch.empty(0, 2, dtype=torch.int64, device=device), 4)
    x0 = torch.empty(0, 8, device=device)
    assert permute(x0, empty, True).shape == (0, 8) and unpermute(x0, empty, True).shape == (0, 8)


@pytest.mark.interpreter_child(seconds=12)
def test_triton_gathers_match_torch_bitwise():
    if torch.cuda.is_available():
        check_triton_gathers_match_torch_bitwise("cuda")
        return
    _triton_env.run_check_interpreted(__file__, "check_triton_gathers_match_torch_bitwise", "cpu")


def test_use_triton_choice():
    assert dispatch.use_triton("torch", torch.device("cpu")) is False
    assert dispatch.use_triton("auto", torch.device("cpu")) is False
    with pytest.raises(ValueError, match="backend"):
        dispatch.use_triton("cuda", torch.device("cpu"))
