"""torch.compile(fullgraph=True) computes what eager computes: y and every gradient, for
``grouped_mlp``, ``GroupedMLP`` and ``MoE``, on both backends, bf16 and fp32, without a recipe, with
fp8_block, and with the weights quantized once (``quantized_weights`` / ``is_first_microbatch``)
under fp8_block and under mxfp8 (dequantized values of both orientations).

Why: on torch 2.11 a compiled ``MoE`` gave exactly zero gradients to x, the router and both expert
weights, silently. The combine's autograd.Function returned ``acc.to(acc.dtype)``, a no-op alias,
and that version of dynamo drops the gradient of such an output (moemlp.moe.dispatch._cast).

- ``aot_eager`` runs the traced graph op by op: the bits must be eager's (torch.equal).
- ``inductor`` (GPU) fuses the ops around the custom ops and may round them differently; the custom
  ops themselves are opaque, so grouped_mlp / GroupedMLP stay bitwise; for MoE, inductor re-fuses the
  fp32 router (softmax, normalisation) and the combine's fp32 sum, so y and the gradients may move
  by a rounding of the bf16 / fp32 outputs, bounded below. A dropped gradient is off by 100%.

On a CPU-only machine the Triton-backend cases run under TRITON_INTERPRET=1 in a child pytest
(tests/_triton_env.py).
"""

from __future__ import annotations

import pytest
import torch

import _triton_env
import moemlp
from _cases import make_problem, rel_err

CUDA = torch.cuda.is_available()

ENTRIES = ("grouped_mlp", "GroupedMLP", "MoE")
RECIPES = (None, "fp8_block", "fp8_block+cached", "mxfp8+cached")  # cached: weights quantized once, then reused


def _build(entry: str, backend: str, dtype, recipe_mode, device):
    """(fn, leaves, dy, warm): ``fn(*leaves)`` runs the entry; ``warm()`` runs whatever must happen
    eagerly first (quantizing the weights once, as is_first_microbatch=True does)."""
    recipe = None if recipe_mode is None else recipe_mode.split("+")[0]
    cached = recipe_mode is not None and recipe_mode.endswith("+cached")
    # GPU: fp8_block blocks 128 deep, H = 128 is one block. CPU: what is checked (compiled == eager, bit
    # for bit) does not depend on the shape, and under the interpreter H, F = 128, 32 cost 2-3x the time
    # of 32, 16 (partial blocks of every recipe); fp8_block's full blocks are tests/kernels' cases.
    H, F = (128, 32) if device == "cuda" else (32, 16)
    if entry == "grouped_mlp":
        p = make_problem([9, 0, 14], H, F, capacity=2, bias=True, seed=12, dtype=dtype, device=device)
        qw = moemlp.quantize_weights(p.fc1_weight, p.fc2_weight, recipe) if cached else None
        leaves = [t for t in p.tensors()]

        def fn(x, probs, w1, w2, b1, b2):
            return moemlp.grouped_mlp(x, p.splits, probs, w1, w2, b1, b2, recipe=recipe, backend=backend,
                                      quantized_weights=qw)

        return fn, leaves, p.dy, lambda: None
    torch.manual_seed(21)
    if entry == "GroupedMLP":
        m = moemlp.GroupedMLP(num_experts=3, hidden_size=H, ffn_hidden_size=F, bias=True, recipe=recipe,
                              backend=backend, device=device, dtype=dtype)
        p = make_problem([9, 0, 14], H, F, capacity=2, seed=13, dtype=dtype, device=device)
        flag = False if cached else None

        def fn(x, probs, *params):  # the module reads its own parameters; they are leaves for grad
            return m(x, p.splits, probs, is_first_microbatch=flag)

        warm = (lambda: m(p.x, p.splits, p.probs, is_first_microbatch=True)) if cached else (lambda: None)
        return fn, [p.x, p.probs, *m.parameters()], p.dy, warm
    moe = moemlp.MoE(hidden_size=H, ffn_hidden_size=F, num_experts=4, top_k=2, aux_loss_coeff=1e-2,
                     z_loss_coeff=1e-3, recipe=recipe, backend=backend, device=device, dtype=dtype)
    with torch.no_grad():
        moe.router.weight.normal_(0.0, 0.3)  # spread logits: no near-ties for a re-fused softmax to flip
    g = torch.Generator().manual_seed(14)
    x = torch.randn(24, H, generator=g).to(device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(24, H, generator=g).to(device=device, dtype=dtype)
    flag = False if cached else None

    def fn(x, *params):  # the module reads its own parameters; they are leaves for grad
        return moe(x, is_first_microbatch=flag)

    warm = (lambda: moe(x, is_first_microbatch=True)) if cached else (lambda: None)
    return fn, [x, *moe.parameters()], dy, warm


def _check(entry, backend, dtype, recipe_mode, device, compiler):
    torch._dynamo.reset()
    fn, leaves, dy, warm = _build(entry, backend, dtype, recipe_mode, device)
    warm()
    y = fn(*leaves)
    grads = torch.autograd.grad(y, leaves, dy)
    yc = torch.compile(fn, fullgraph=True, backend=compiler)(*leaves)
    grads_c = torch.autograd.grad(yc, leaves, dy)
    names = ["y"] + [f"grad {i}" for i in range(len(leaves))]
    for name, a, b in zip(names, (y, *grads), (yc, *grads_c)):
        assert b.dtype == a.dtype and b.shape == a.shape, name
        assert a.abs().sum() > 0, f"{name}: eager is all zeros, the check would prove nothing"
        if compiler == "aot_eager" or entry != "MoE":
            assert torch.equal(a, b), f"{name}: compiled differs from eager, rel {rel_err(b, a):.3e}"
        else:
            # inductor re-rounds the fused fp32 router and combine: a few ulps of the output dtype
            # on some elements, far below the 1.0 of a dropped gradient.
            bound = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
            assert rel_err(b, a) <= bound, f"{name}: compiled vs eager rel {rel_err(b, a):.3e} > {bound}"


CPU_CASES = [
    pytest.param(entry, dtype, recipe_mode, id=f"{entry}-{str(dtype)[6:]}-{recipe_mode}")
    for entry in ENTRIES
    for dtype in (torch.bfloat16, torch.float32)
    for recipe_mode in RECIPES
]


@pytest.mark.skipif(_triton_env.INTERPRET, reason="torch backend: runs in the parent process")
@pytest.mark.parametrize("entry,dtype,recipe_mode", CPU_CASES)
def test_cpu_torch_backend(entry, dtype, recipe_mode):
    _check(entry, "torch", dtype, recipe_mode, "cpu", "aot_eager")


# Under the interpreter each kernel runs in numpy, 12-29 s a case on the 2-core CI machine: the whole
# entry x recipe-mode matrix (15 cases) took 296 s. INTERPRETED_SUBSET runs each entry plain and with
# a cache, each recipe mode and each dtype at least once; the full matrix runs on the GPU (GPU_CASES,
# inductor) and on the torch backend here (CPU_CASES). What the subset leaves out is run elsewhere
# under the interpreter too:
# - grouped_mlp-bfloat16-fp8_block: the same problem and compile as test_weight_reuse.py's
#   test_cpu_torch_compile_fullgraph;
# - grouped_mlp-bfloat16-{fp8_block,mxfp8}+cached: test_weight_cache.py's
#   test_cpu_torch_compile_fullgraph_with_quantized_weights (every recipe, the cache a graph input,
#   no weight pass inside the compiled graph);
# - GroupedMLP-bfloat16-fp8_block, MoE-bfloat16-{fp8_block,mxfp8+cached}: the recipe reaches the
#   kernels through the same GroupedMLP as in the GroupedMLP cases kept;
# - GroupedMLP-bfloat16-None, {grouped_mlp,GroupedMLP}-float32-None: inside MoE's cases, whose experts
#   are a GroupedMLP calling grouped_mlp.
INTERPRETED_SUBSET = {
    ("grouped_mlp", torch.bfloat16, None),
    ("GroupedMLP", torch.bfloat16, "fp8_block+cached"),  # is_first_microbatch=False: codes_t, scales
    ("GroupedMLP", torch.bfloat16, "mxfp8+cached"),  # is_first_microbatch=False: dequantized values
    ("MoE", torch.bfloat16, None),
    ("MoE", torch.float32, None),  # the combine's fp32 -> fp32 cast: torch 2.11's dropped gradients
    ("MoE", torch.bfloat16, "fp8_block+cached"),  # MoE's is_first_microbatch down to its experts
}
TRITON_CPU_CASES = [
    pytest.param(entry, dtype, recipe_mode, id=f"{entry}-{str(dtype)[6:]}-{recipe_mode}")
    for entry in ENTRIES
    for dtype in (torch.bfloat16, torch.float32)
    for recipe_mode in RECIPES
    if (entry, dtype, recipe_mode) in INTERPRETED_SUBSET
]
assert len(TRITON_CPU_CASES) == len(INTERPRETED_SUBSET)


@pytest.mark.skipif(not _triton_env.RUN_CPU_CASES, reason="runs under TRITON_INTERPRET=1 in the child")
@pytest.mark.parametrize("entry,dtype,recipe_mode", TRITON_CPU_CASES)
def test_cpu_triton_backend_interpreted(entry, dtype, recipe_mode):
    _check(entry, "triton", dtype, recipe_mode, "cpu", "aot_eager")


@pytest.mark.interpreter_child(seconds=70)
@pytest.mark.skipif(not _triton_env.START_CHILD, reason="runs the CPU cases in a child on a CPU-only machine")
def test_cpu_cases_under_interpreter():
    _triton_env.run_file_interpreted(__file__)


GPU_CASES = [
    pytest.param(entry, backend, dtype, recipe_mode, id=f"{entry}-{backend}-{str(dtype)[6:]}-{recipe_mode}")
    for entry in ENTRIES
    for backend in ("torch", "triton")
    for dtype in (torch.bfloat16, torch.float32)
    for recipe_mode in RECIPES
    # Each MoE case compiles the whole layer with inductor: bf16 carries every recipe mode, fp32
    # the plain path (the recipes' fp32 handling is the grouped_mlp cases').
    if not (entry == "MoE" and dtype == torch.float32 and recipe_mode is not None)
]


@pytest.mark.long(seconds=45)
@pytest.mark.gpu
@pytest.mark.parametrize("entry,backend,dtype,recipe_mode", GPU_CASES)
def test_gpu_inductor(entry, backend, dtype, recipe_mode):
    _check(entry, backend, dtype, recipe_mode, "cuda", "inductor")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_aot_eager_moe(backend):
    _check("MoE", backend, torch.bfloat16, None, "cuda", "aot_eager")
