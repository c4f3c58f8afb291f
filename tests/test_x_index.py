"""grouped_mlp(..., x_index=...) (SPEC §1, "Gathered input rows") against the same problem with x
gathered first (``x[x_index]`` + grouped_mlp without x_index): y and every gradient but dx are the
same bits; dx against a float64 scatter-add of the same row gradients, within the rounding of an
fp32 sum; the Triton kernels and the torch path give the same bits, and so do two runs. The MoE
layer, which now passes x and x_index, gives the bits of its former permute path.

The torch-backend cases run here; the Triton-backend cases run under TRITON_INTERPRET=1 in a child
pytest on a CPU-only machine (tests/_triton_env.py).
"""

from __future__ import annotations

import pytest
import torch

import _triton_env
import moemlp
from _cases import GRAD_NAMES, make_problem
from moemlp import _x_index

H, F = 16, 16  # one tile (under the interpreter H = 32 took 1.2x the time of the child)
# Capacity rows' indices: garbage that would read outside x, or overflow int32 arithmetic, if used.
GARBAGE = (-7, 10**6, 2**31 - 1, -(2**31))


def _make(splits, num_tokens, index_kind, capacity=0, dtype=torch.bfloat16, probs=True, index_dtype=torch.int64,
          seed=0, **kw):
    """(problem with M = Σsplits + capacity rows, x (T, H) leaf, x_index (M,))."""
    p = make_problem(splits, H, F, capacity=capacity, dtype=dtype, probs_dtype=torch.float32 if probs else None,
                     seed=seed, **kw)
    total = sum(splits)
    g = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(num_tokens, H, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    if index_kind == "random":  # with replacement: duplicates and, for T > M, unused tokens
        routed = torch.randint(0, max(num_tokens, 1), (total,), generator=g)
    elif index_kind == "dup":  # token 1 read 5 times, spread over experts, the rest random
        routed = torch.randint(0, num_tokens, (total,), generator=g)
        routed[torch.randperm(total, generator=g)[:5]] = 1
    elif index_kind == "distinct":  # each token at most once: dx rows are copies, or exactly 0
        routed = torch.randperm(num_tokens, generator=g)[:total]
    else:
        raise ValueError(index_kind)
    garbage = torch.tensor(GARBAGE * capacity, dtype=torch.int64)[:capacity]
    x_index = torch.cat((routed, garbage)).to(index_dtype)
    return p, x, x_index


# (splits, T, index kind, capacity, dtype, probs, extra): what each case exercises
CASES = [
    # duplicates: token 1 read 5 times across experts; T < M
    pytest.param([5, 3, 6], 6, "dup", 0, torch.bfloat16, True, {}, id="dup-T<M-bf16"),
    # T > M: most tokens never read, their dx rows exactly 0; fp32 operands and probs
    pytest.param([4, 5, 3], 40, "random", 0, torch.float32, True, {}, id="unused-tokens-T>M-fp32"),
    # capacity rows whose index is out of range or int32's extremes: never read, never an error
    pytest.param([4, 2, 3], 7, "random", 4, torch.bfloat16, True, {}, id="capacity-garbage-bf16"),
    # an expert with no rows, int32 indices, distinct tokens (dx rows copies of the row gradients)
    pytest.param([4, 0, 5], 12, "distinct", 2, torch.bfloat16, True, {"index_dtype": torch.int32},
                 id="empty-expert-int32-distinct"),
    # one expert, each token read about three times; FC1 recomputed in backward from the gathered rows
    pytest.param([9], 3, "random", 0, torch.float32, True, {"recompute_fc1": True}, id="one-expert-fp32-recompute"),
    # without probs (= 1), biases on
    pytest.param([3, 6], 5, "random", 1, torch.bfloat16, False, {"bias": True}, id="no-probs-bias-bf16"),
    # no tokens at all (T = 0): every row is capacity; y is 0 and dx is (0, H)
    pytest.param([0, 0], 0, "random", 3, torch.bfloat16, True, {}, id="T=0-all-capacity"),
]
# fp8_block quantizes the gathered rows as it would the pre-gathered ones (torch backend).
RECIPE_CASE = pytest.param([5, 0, 4], 6, "dup", 2, torch.bfloat16, True, {"recipe": "fp8_block"},
                           id="fp8_block-dup-capacity")


def _run(p, x, x_index, backend, **kw):
    """y and the gradients of (x, probs, weights, biases) for dy."""
    y = moemlp.grouped_mlp(x, p.splits, p.probs, p.fc1_weight, p.fc2_weight, p.fc1_bias, p.fc2_bias,
                           backend=backend, x_index=x_index, **{**p.kwargs, **kw})
    leaves = [x] + [t for t in p.tensors()[1:] if t is not None]
    return y, torch.autograd.grad(y, leaves, p.dy)


def _pregathered(x, x_index, total):
    """The expert input rows materialised: x[x_index] for routed rows, 0 for capacity rows."""
    rows = x.new_zeros(x_index.shape[0], x.shape[1])
    rows[:total] = x.detach()[x_index[:total].long()]
    return rows.requires_grad_()


def _check_dx(dx, x_index, total, d_rows):
    """dx against the float64 scatter-add of the row gradients: within one rounding to dx.dtype of an
    fp32 (fp64) recursive sum of n terms, |err| <= u_out·|ref| + (1 + u_out)·γ_{n-1}·Σ|terms|.
    A token read once gets its row's gradient exactly; a token never read, exactly 0."""
    T = dx.shape[0]
    idx = x_index[:total].long()
    terms = d_rows[:total].double()
    ref = torch.zeros(T, dx.shape[1], dtype=torch.float64).index_add_(0, idx, terms)
    abs_sum = torch.zeros_like(ref).index_add_(0, idx, terms.abs())
    n = torch.bincount(idx, minlength=T).double()[:, None]
    u_out = torch.finfo(dx.dtype).eps / 2
    u_acc = 2.0**-53 if dx.dtype == torch.float64 else 2.0**-24
    gamma = (n - 1).clamp(min=0) * u_acc / (1 - (n - 1).clamp(min=0) * u_acc)
    bound = u_out * ref.abs() + (1 + u_out) * gamma * abs_sum
    err = (dx.double() - ref).abs()
    assert (err <= bound).all(), f"dx off by {float((err - bound).max()):.3e} past the bound"
    once = n[:, 0] == 1
    read_once = once[idx]  # the rows whose token no other row reads
    assert torch.equal(dx[idx[read_once]], d_rows[:total][read_once])
    unused = n[:, 0] == 0
    assert torch.equal(dx[unused], torch.zeros_like(dx[unused]))


def check_case(splits, T, kind, capacity, dtype, probs, extra, backend):
    extra = dict(extra)
    index_dtype = extra.pop("index_dtype", torch.int64)
    recipe = extra.pop("recipe", None)
    p, x, x_index = _make(splits, T, kind, capacity, dtype, probs, index_dtype, **extra)
    total = sum(splits)
    y, grads = _run(p, x, x_index, backend, recipe=recipe)
    rows = _pregathered(x, x_index, total)
    y_ref, grads_ref = _run(p, rows, None, backend, recipe=recipe)
    assert torch.equal(y, y_ref), "y differs from the pre-gathered problem"
    assert torch.equal(y[total:], torch.zeros_like(y[total:]))
    names = [n for n, t in zip(GRAD_NAMES, p.tensors()) if t is not None]
    for name, a, b in zip(names[1:], grads[1:], grads_ref[1:]):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name} differs from the pre-gathered problem"
    dx, d_rows = grads[0], grads_ref[0]
    assert dx.shape == x.shape and dx.dtype == x.dtype
    _check_dx(dx, x_index, total, d_rows)
    if total:
        assert d_rows[:total].abs().sum() > 0, "row gradients all 0: the dx check would prove nothing"
    # two runs, the same bits; not under the interpreter (15 s of its child), which runs the programs
    # one after another in a fixed order: there a second run could differ only through state the first
    # left behind, and test_triton_backend.py's dprobs contract repeats a backward there
    if not _triton_env.INTERPRET:
        y2, grads2 = _run(p, x, x_index, backend, recipe=recipe)
        assert torch.equal(y, y2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    return x, x_index, p.splits, d_rows


@pytest.mark.skipif(_triton_env.INTERPRET, reason="torch backend: runs in the parent process")
@pytest.mark.parametrize("splits,T,kind,capacity,dtype,probs,extra", CASES + [RECIPE_CASE])
def test_torch_backend(splits, T, kind, capacity, dtype, probs, extra):
    check_case(splits, T, kind, capacity, dtype, probs, extra, "torch")


@pytest.mark.skipif(not _triton_env.RUN_CPU_CASES, reason="runs under TRITON_INTERPRET=1 in the child")
@pytest.mark.parametrize("splits,T,kind,capacity,dtype,probs,extra", CASES)
def test_triton_backend_interpreted(splits, T, kind, capacity, dtype, probs, extra):
    x, x_index, splits_t, d_rows = check_case(splits, T, kind, capacity, dtype, probs, extra, "triton")
    # The gather and its adjoint alone: the Triton kernels and the torch path, the same bits.
    order, offsets = _x_index.token_order(x_index, splits_t, x.shape[0])
    rows_tr = _x_index.gather_rows(x.detach(), x_index, splits_t, None, True)
    rows_pt = _x_index.gather_rows(x.detach(), x_index, splits_t, None, False)
    assert torch.equal(rows_tr, rows_pt)
    from moemlp.moe import _kernels

    dx_tr = _kernels.segment_sum_rows(d_rows, order, offsets)
    dx_pt = torch.ops.moemlp.segment_sum_rows_torch(d_rows, order, offsets)
    assert torch.equal(dx_tr, dx_pt)


@pytest.mark.skipif(not _triton_env.RUN_CPU_CASES, reason="runs under TRITON_INTERPRET=1 in the child")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_segment_sum_kernel_matches_torch_bitwise(dtype):
    """Long segments (a token read 37 times), H past one 1024-column block, fp32 values whose sum
    depends on the order: the kernel and the torch path make the same additions."""
    g = torch.Generator().manual_seed(3)
    M, T, Hw = 120, 9, 1030
    idx = torch.randint(0, T, (M,), generator=g)
    idx[:37] = 4
    scale = torch.logspace(-6, 6, M, dtype=torch.float64)[:, None]  # 12 decades: the sum's order shows
    src = (torch.randn(M, Hw, generator=g, dtype=torch.float64) * scale).to(dtype)
    splits = torch.tensor([M - 5])  # 5 capacity rows, left out of every sum
    order, offsets = _x_index.token_order(idx, splits, T)
    from moemlp.moe import _kernels

    out = _kernels.segment_sum_rows(src, order, offsets)
    assert torch.equal(out, torch.ops.moemlp.segment_sum_rows_torch(src, order, offsets))
    assert torch.equal(out, _kernels.segment_sum_rows(src, order, offsets))
    # Ascending rows within each token, summed one after another from 0 in fp32, rounded once: the
    # table lists token t's rows in column k; a loop over k (37 steps), every token at once.
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    routed = idx[: M - 5]
    by_token = torch.sort(routed, stable=True)
    counts = torch.bincount(routed, minlength=T)
    rank = torch.arange(M - 5) - (torch.cumsum(counts, 0) - counts)[by_token.values]
    table = torch.full((T, int(counts.max())), -1, dtype=torch.int64)
    table[by_token.values, rank] = by_token.indices
    ref = torch.zeros(T, Hw, dtype=acc_dtype)
    for k in range(table.shape[1]):
        has = table[:, k] >= 0
        ref[has] = ref[has] + src[table[has, k]].to(acc_dtype)
    assert torch.equal(out, ref.to(dtype))


@pytest.mark.skipif(not _triton_env.RUN_CPU_CASES, reason="runs under TRITON_INTERPRET=1 in the child")
def test_triton_path_clamps_out_of_range_indices():
    """What the GPU path does with indices it cannot check without a host read: clamps them into
    [0, T) (forward reads x[clamp(i)], backward adds into dx[clamp(i)]); capacity rows stay 0."""
    from moemlp.moe import _kernels

    T = 5
    x = torch.randn(T, H).to(torch.bfloat16)
    x_index = torch.tensor([0, -3, 7, 4, 2**31 - 1, -1])
    splits = torch.tensor([3, 2])  # row 5 is capacity
    rows = _kernels.gather_routed_rows(x, x_index, _x_index.routed_rows(splits, 6))
    clamped = x_index.clamp(0, T - 1)
    assert torch.equal(rows[:5], x[clamped[:5]])
    assert torch.equal(rows[5], torch.zeros(H, dtype=torch.bfloat16))
    order, offsets = _x_index.token_order(x_index, splits, T)
    d_rows = torch.randn(6, H).to(torch.bfloat16)
    dx = _kernels.segment_sum_rows(d_rows, order, offsets)
    ref = torch.zeros(T, H).index_add_(0, clamped[:5], d_rows[:5].float()).to(torch.bfloat16)
    assert torch.equal(dx, ref)  # at most two bf16 terms per token: exact in fp32
    empty = _kernels.gather_routed_rows(x[:0], x_index, _x_index.routed_rows(splits, 6))
    assert torch.equal(empty, torch.zeros(6, H, dtype=torch.bfloat16))  # T = 0: nothing to read


# --- inputs that are wrong --------------------------------------------------------------------


def _bad_call(x_index, backend="torch", **kw):
    p, x, _ = _make([3, 2], 4, "random", capacity=1)
    args = dict(splits=p.splits, probs=p.probs)
    args.update(kw)
    return moemlp.grouped_mlp(x, args["splits"], args["probs"], p.fc1_weight, p.fc2_weight, backend=backend,
                              x_index=x_index)


# (x_index, extra kwargs, error, message): what each case exercises
BAD = [
    pytest.param(torch.zeros(6), {}, TypeError, "x_index: expected dtype int32 or int64", id="float-dtype"),
    pytest.param(torch.zeros(5, dtype=torch.int64), {}, ValueError,
                 r"x_index and probs: expected the same length.* got x_index \(5,\) and probs \(6,\)",
                 id="length-not-probs"),
    pytest.param(torch.zeros(6, 1, dtype=torch.int64), {}, ValueError, "x_index: expected 1 dimensions",
                 id="2-D"),
    pytest.param(torch.zeros(6, dtype=torch.int64, device="meta"), {}, TypeError,
                 "x_index: expected a tensor on cpu", id="other-device"),
    pytest.param(torch.tensor([0, 1, 4, 2, 3, 0]), {}, ValueError, r"x_index: expected values in \[0, 4\).* 4 at row 2",
                 id="index-T-routed"),
    pytest.param(torch.tensor([0, 1, 2, 3, -1, 0]), {}, ValueError, r"x_index: .* -1 at row 4", id="negative-routed"),
    pytest.param(torch.zeros(4, dtype=torch.int64), {"probs": None}, ValueError,
                 "splits: the counts sum to 5, past the 4 rows of x_index", id="splits-past-M"),
    pytest.param([0, 1, 2, 3, 0, 1], {}, TypeError, "x_index: expected a torch.Tensor", id="list"),
]


@pytest.mark.parametrize("x_index,kw,error,message", BAD)
def test_bad_inputs(x_index, kw, error, message):
    backend = "triton" if _triton_env.RUN_CPU_CASES else "torch"  # the child checks the Triton entry
    with pytest.raises(error, match=message):
        _bad_call(x_index, backend, **kw)


@pytest.mark.skipif(_triton_env.INTERPRET, reason="torch backend: runs in the parent process")
def test_torch_path_checks_inside_its_op():
    """The torch path's op checks the indices itself: where grouped_mlp's entry does not (device
    tensors, or inside torch.compile), the torch backend still raises rather than reading past x."""
    x = torch.randn(4, H)
    with pytest.raises(ValueError, match=r"x_index: expected values in \[0, 4\)"):
        torch.ops.moemlp.gather_routed_rows_torch(x, torch.tensor([0, 9, -1]), torch.tensor([2]))
    rows = torch.ops.moemlp.gather_routed_rows_torch(x, torch.tensor([3, 1, -1]), torch.tensor([2]))
    assert torch.equal(rows, torch.cat((x[[3, 1]], torch.zeros(1, H))))  # the capacity row's -1 is not read


# --- torch.compile ------------------------------------------------------------------------------


def check_compiled(backend):
    torch._dynamo.reset()
    p, x, x_index = _make([5, 0, 4], 6, "dup", capacity=2, bias=True)
    leaves = [x] + [t for t in p.tensors()[1:] if t is not None]

    def fn(x, probs, w1, w2, b1, b2):
        return moemlp.grouped_mlp(x, p.splits, probs, w1, w2, b1, b2, backend=backend, x_index=x_index)

    y = fn(*leaves)
    grads = torch.autograd.grad(y, leaves, p.dy)
    yc = torch.compile(fn, fullgraph=True, backend="aot_eager")(*leaves)
    grads_c = torch.autograd.grad(yc, leaves, p.dy)
    for name, a, b in zip(("y",) + GRAD_NAMES, (y, *grads), (yc, *grads_c)):
        assert a.abs().sum() > 0, f"{name}: eager is all zeros, the check would prove nothing"
        assert torch.equal(a, b), f"{name}: compiled differs from eager"


@pytest.mark.skipif(_triton_env.INTERPRET, reason="torch backend: runs in the parent process")
def test_compile_torch_backend():
    check_compiled("torch")


@pytest.mark.skipif(not _triton_env.RUN_CPU_CASES, reason="runs under TRITON_INTERPRET=1 in the child")
def test_compile_triton_backend_interpreted():
    check_compiled("triton")


# --- the MoE layer: the same bits as its former permute path -----------------------------------


def _permute_path(moe, x):
    """The one-device MoE forward as it was before x_index: permute x, run the experts, combine."""
    from moemlp.moe.dispatch import local_combine, local_dispatch, use_triton

    tokens = x.reshape(-1, moe.hidden_size)
    probs, expert_idx = moe.router(tokens)
    x_perm, splits, probs_perm, state = local_dispatch(
        tokens, probs, expert_idx, moe.num_experts, use_triton(moe.backend, tokens.device)
    )
    return local_combine(moe.experts(x_perm, splits, probs_perm), state).view(x.shape)


def check_moe_bitwise(backend, dtype, top_k, seed):
    torch.manual_seed(seed)
    moe = moemlp.MoE(hidden_size=H, ffn_hidden_size=F, num_experts=5, top_k=top_k, aux_loss_coeff=1e-2,
                     z_loss_coeff=1e-3, backend=backend, dtype=dtype)
    with torch.no_grad():
        moe.router.weight.normal_(0.0, 0.3)
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(3, 7, H, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(3, 7, H, generator=g).to(dtype)
    leaves = [x, moe.router.weight, moe.experts.fc1_weight, moe.experts.fc2_weight]
    results = []
    for forward in (moe, lambda t: _permute_path(moe, t)):
        y = forward(x)
        losses = (moe.router.aux_loss.clone(), moe.router.z_loss.clone())
        results.append((y, *losses, *torch.autograd.grad(y, leaves, dy)))
    names = ("y", "aux_loss", "z_loss", "dx", "d router.weight", "d fc1_weight", "d fc2_weight")
    for name, a, b in zip(names, *results):
        assert a.abs().sum() > 0, f"{name}: all zeros, the check would prove nothing"
        assert torch.equal(a, b), f"{name}: the x_index path differs from the permute path"


# (dtype, top_k, seed): top_k = 3 makes the order of dx's sum matter (k order, not row order)
MOE_CASES = [
    pytest.param(torch.bfloat16, 2, 0, id="bf16-top2"),
    pytest.param(torch.float32, 3, 1, id="fp32-top3"),
    pytest.param(torch.bfloat16, 3, 2, id="bf16-top3"),
    pytest.param(torch.float32, 5, 3, id="fp32-top5=E"),
]


@pytest.mark.skipif(_triton_env.INTERPRET, reason="torch backend: runs in the parent process")
@pytest.mark.parametrize("dtype,top_k,seed", MOE_CASES)
def test_moe_same_bits_as_permute_path_torch(dtype, top_k, seed):
    check_moe_bitwise("torch", dtype, top_k, seed)


@pytest.mark.skipif(not _triton_env.RUN_CPU_CASES, reason="runs under TRITON_INTERPRET=1 in the child")
@pytest.mark.parametrize("dtype,top_k,seed", MOE_CASES[1:3])
def test_moe_same_bits_as_permute_path_triton(dtype, top_k, seed):
    check_moe_bitwise("triton", dtype, top_k, seed)


@pytest.mark.interpreter_child(seconds=57)
@pytest.mark.skipif(not _triton_env.START_CHILD, reason="runs the CPU cases in a child on a CPU-only machine")
def test_cpu_cases_under_interpreter():
    _triton_env.run_file_interpreted(__file__)
