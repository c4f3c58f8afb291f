"""SPEC §1's probability contract on the Triton backend: dprobs written by the reducing kernel in
probs.dtype and returned as it is (no conversion op anywhere in backward), bitwise deterministic.

On a CPU-only machine this file runs in a child pytest under TRITON_INTERPRET=1 (tests/_triton_env.py);
on a GPU it runs directly.
"""

import pytest
import torch

import _triton_env
import moemlp
from _cases import ConversionRecorder, make_problem, run

_TRITON_HERE = _triton_env.RUN_CPU_CASES or torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not _TRITON_HERE, reason="needs the interpreter child or a GPU")


@pytest.mark.interpreter_child(seconds=16)
@pytest.mark.skipif(not _triton_env.START_CHILD, reason="starts the interpreter child on a CPU-only machine")
def test_contract_under_interpreter():
    _triton_env.run_file_interpreted(__file__)


def _problem(probs_dtype=torch.float32):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    p = make_problem([13, 0, 21], 32, 16, capacity=3, probs_dtype=probs_dtype, seed=40, device=dev)
    return p


@needs_triton
def test_no_conversion_of_dprobs_in_triton_backward():
    p = _problem()
    M = p.x.shape[0]
    y = moemlp.grouped_mlp(p.x, p.splits, p.probs, p.fc1_weight, p.fc2_weight, backend="triton")
    with ConversionRecorder((M,)) as rec:
        (dprobs,) = torch.autograd.grad(y, [p.probs], p.dy)
    assert dprobs.dtype == torch.float32 and rec.conversions == [], rec.conversions
    # Inside the backend: the kernels write dprobs; no torch op converts a (M,) tensor to fp32.
    from moemlp import kernels
    from moemlp._config import MLPConfig
    from moemlp.activations import ACTIVATIONS

    cfg = MLPConfig(ACTIVATIONS["swiglu"], (), 16, False)
    x, w1, w2, probs = (t.detach() for t in (p.x, p.fc1_weight, p.fc2_weight, p.probs))
    _, h = kernels.grouped_mlp_fwd(x, p.splits, probs, w1, w2, None, None, cfg)
    with ConversionRecorder((M,)) as rec:
        _, dprobs2, *_ = kernels.grouped_mlp_bwd(p.dy, x, h, p.splits, probs, w1, w2, None, None, cfg,
                                                 (False, True, False, False, False, False))
    assert rec.conversions == [], rec.conversions
    assert torch.equal(dprobs2, dprobs)


# On the GPU only: the interpreter runs the programs one after another in a fixed order, where two
# runs could differ only through state the first left behind, and test_triton_backend.py's dprobs
# contract repeats the same kernels' backward there with each probs dtype (these took 14 s of the child).
@pytest.mark.skipif(not torch.cuda.is_available(), reason="repeatability: the GPU's (see the comment)")
@pytest.mark.parametrize("probs_dtype", [torch.float32, torch.bfloat16], ids=["p32", "pbf16"])
def test_triton_backward_bitwise_repeatable(probs_dtype):
    p = _problem(probs_dtype)
    _, g1 = run(p, backend="triton")
    _, g2 = run(p, backend="triton")
    assert g1["probs"].dtype == probs_dtype
    for name in g1:
        assert torch.equal(g1[name], g2[name]), name
