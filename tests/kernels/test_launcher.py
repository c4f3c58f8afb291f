"""Launches past JITFunction.run (kernels/_launcher.py).

A launch through a compiled kernel found by the arguments' classes is only right if equal classes
mean equal Triton specializations. The CPU cases check that for every kind of argument the package
passes, against Triton's own specialization of the same values; the GPU cases check, for every
launch of bf16 and fp8_block forward + backward steps, that the compiled kernel the launcher keeps is
the one JITFunction.run picks for those arguments, that every such launch takes the direct path, and
that a step launched directly gives the bits of the same step launched through JITFunction.run."""

from __future__ import annotations

import itertools

import pytest
import torch

from moemlp import grouped_mlp
from moemlp.bench.common import Shape, routed_problem
from moemlp.kernels import _launcher


def _triton_spec(arg):
    """Triton's specialization of ``arg`` as a kernel's binder makes it: (type, specialization)."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        pytest.skip("this triton has no native_specialize_impl")
    return tuple(native_specialize_impl(BaseBackend, arg, False, True, True))


def _same_class_same_spec(values):
    classes = [(_launcher._arg_class(v), _triton_spec(v)) for v in values]
    for (ca, sa), (cb, sb) in itertools.combinations(classes, 2):
        if ca == cb:
            assert sa == sb, f"one class {ca} for Triton specializations {sa} and {sb}"


INTS = [0, 1, 2, 15, 16, 17, 32, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**40, 2**63 - 1, 2**63, 2**64 - 16,
        -1, -16, -(2**31), -(2**31) - 1, -(2**40)]  # fmt: skip


def test_int_classes_refine_triton():
    # 1, multiples of 16 and the i32 / i64 / u64 boundaries, both signs
    _same_class_same_spec(INTS)


def test_tensor_classes_refine_triton():
    # dtypes, and addresses on and off a 16-byte boundary (views at odd offsets)
    base = {dt: torch.zeros(64, dtype=dt) for dt in (torch.bfloat16, torch.float32, torch.int32, torch.uint8)}
    views = [t[k:] for t in base.values() for k in (0, 1, 3, 4, 8, 16)]
    _same_class_same_spec(views)


def test_scalar_classes_refine_triton():
    # floats (any value), bools, None beside the ints
    _same_class_same_spec([0.0, 1.0, -2.5, 1e30, True, False, None, 0, 1])


def test_descriptor_classes_refine_triton():
    # Gluon host descriptors: block shapes, layouts and dtypes
    from moemlp.kernels.gluon import _compat, _launch

    if _compat.TensorDescriptor is None:
        pytest.skip("this triton has no Gluon TensorDescriptor")
    a = torch.zeros(256, 256, dtype=torch.bfloat16)
    f = torch.zeros(256, 256, dtype=torch.float32)
    descs = [
        _compat.TensorDescriptor.from_tensor(t, list(block), _launch._smem_layout(block, t.dtype == torch.float32))
        for t in (a, f, a[64:])
        for block in ((128, 64), (64, 128), (64, 64))
    ]
    _same_class_same_spec(descs)


def test_unknown_arguments_are_not_classed():
    # a kind of argument not listed takes JITFunction.run (launch catches the TypeError)
    with pytest.raises(TypeError):
        _launcher._arg_class(object())
    with pytest.raises(TypeError):
        _launcher._arg_class("a string")


SHAPE = Shape("launcher", 512, 256, 8, 2, 512)


def _step(recipe):
    x, splits, probs, w1, w2, dy = routed_problem(SHAPE, "cuda")
    leaves = [t.requires_grad_() for t in (x, probs, w1, w2)]
    y = grouped_mlp(x, splits, probs, w1, w2, recipe=recipe)
    return (y.detach(), *torch.autograd.grad(y, leaves, dy))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [None, "fp8_block"], ids=["bf16", "fp8_block"])
def test_direct_launches_are_the_jit_path(recipe, monkeypatch):
    if not _launcher._ENABLED:
        pytest.skip("MOEMLP_FAST_LAUNCH=0")
    _launcher._compiled.clear()
    first = _step(recipe)  # every kernel compiled and keyed through JITFunction.run
    recorded = []
    launch = _launcher.launch

    def record(kernel, grid, *args, **kw):
        recorded.append((kernel, grid, args, kw))
        return launch(kernel, grid, *args, **kw)

    for module in ("moemlp.kernels.gluon._launch", "moemlp.kernels.gemm.launch", "moemlp.kernels.quant.api"):
        monkeypatch.setattr(f"{module}.launch", record)
    again = _step(recipe)  # every launch direct
    for a, b in zip(again, first):
        assert torch.equal(a, b)
    assert len(recorded) >= 6
    device = torch.cuda.current_device()
    for kernel, grid, args, kw in recorded:
        key = (kernel, device, tuple(map(_launcher._arg_class, args)), tuple(kw.items()))
        compiled, _ = _launcher._compiled[key]
        name = kernel.fn.__name__
        assert compiled is not None, f"{name} is launched through JITFunction.run every time"
        assert compiled is kernel.run(*args, grid=grid, warmup=True, **kw), name
