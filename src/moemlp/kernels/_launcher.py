"""Launches of the package's Triton and Gluon kernels that skip ``JITFunction.run``'s per-call work
once a kernel has been compiled for a kind of argument list.

``kernel[grid](*args, **kw)`` binds the arguments to the signature, specializes every one, builds a
cache key, checks the kernel's globals and builds launch metadata before it calls the compiled
kernel's launcher; for the engine's kernels (15-56 arguments) that work takes longer than the
launcher itself, and a forward + backward at small experts (7 launches in bf16, 16 under fp8_block)
is bound by the host (docs/DECISIONS.md, "Launches past JITFunction.run").

``launch(kernel, grid, *args, **kw)`` keeps, per kernel, device and *class* of the arguments, the
compiled kernel that the first such launch (through ``kernel[grid]``) returned, and later calls its
launcher directly with the arguments in the signature's order. An argument's class holds everything
Triton specializes a kernel on, or more:

- a tensor: its dtype and whether its address is a multiple of 16 bytes;
- an int: whether it is 1, whether it is a multiple of 16, and whether i32 or u64 holds it (else i64);
- a float: nothing (Triton passes every float as fp32); a bool or None: its value;
- a host TMA descriptor: its base's dtype, its block shape, and its layout and padding where it has them;
- the keyword arguments (constexprs and launch options): their values.

Anything else, a grid that is not a tuple, a launch hook registered (a profiler's), a Triton without the
compiled kernel's ``run`` / ``function`` / ``packed_metadata``, or ``MOEMLP_FAST_LAUNCH=0`` takes
``kernel[grid]`` every time, as does the interpreter (``TRITON_INTERPRET=1``). A direct launch skips
JITFunction.run's check that the globals a kernel read are unchanged: the package's kernels read
module constants only.
"""

from __future__ import annotations

import inspect
import os

import torch

_ENABLED = os.environ.get("MOEMLP_FAST_LAUNCH", "1") != "0"
_I32 = range(-(2**31), 2**31)

# (kernel, device index, argument classes, keyword items) -> (compiled kernel, the signature's
# trailing values after the positional arguments)
_compiled: dict = {}
_runtime = None  # (JITFunction, knobs.runtime, get_current_device, get_current_stream), or False


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for a grid or a tile count on the host (b > 0). ``triton.cdiv`` is a constexpr
    function on triton 3.9, which unwraps its arguments on every call: ~40× the cost of this."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of 2 ≥ n (1 for n ≤ 1), on the host: ``triton.next_power_of_2`` is a constexpr
    function too."""
    return 1 << max(n - 1, 0).bit_length()


def _triton_runtime():
    global _runtime
    if _runtime is None:
        try:
            from triton import knobs
            from triton.runtime.driver import driver
            from triton.runtime.jit import JITFunction

            active = driver.active
            _runtime = (JITFunction, knobs.runtime, active.get_current_device, active.get_current_stream)
        except (ImportError, AttributeError, RuntimeError):
            _runtime = False
    return _runtime


def _int_class(a: int) -> int:
    """1 for 1, else 2 + (a multiple of 16) + 2·(fits i32) + 4·(needs u64)."""
    return 1 if a == 1 else 2 + (a % 16 == 0) + 2 * (a in _I32) + 4 * (a >= 2**63)


def _tensor_class(a) -> tuple:
    return (a.dtype, a.data_ptr() % 16 == 0)


# A layout's repr by the layout object, which is held here so that its id is not reused: Gluon's
# layouts are dataclasses with list fields (cga_layout) on some triton versions, so not hashable, and
# the engine's come from functools caches (a handful of objects).
_layout_reprs: dict[int, tuple[object, str]] = {}


def _layout_class(layout):
    if layout is None:
        return None
    hit = _layout_reprs.get(id(layout))
    if hit is None:
        if len(_layout_reprs) > 1024:  # layouts made per launch elsewhere: bounded, only slower
            _layout_reprs.clear()
        hit = _layout_reprs[id(layout)] = (layout, repr(layout))
    return hit[1]


def _descriptor_class(a) -> tuple:
    return (type(a), a.base.dtype, tuple(a.block_shape), _layout_class(getattr(a, "layout", None)),
            getattr(a, "padding", None))  # fmt: skip


_CLASSES = {
    int: _int_class,
    float: lambda a: float,
    bool: lambda a: (bool, a),
    type(None): lambda a: None,
    torch.Tensor: _tensor_class,
}


def _arg_class(a):
    """What of ``a`` Triton's specialization reads, or finer; TypeError for an argument this module
    does not know."""
    classer = _CLASSES.get(type(a))
    if classer is not None:
        return classer(a)
    if isinstance(a, torch.Tensor):
        return _tensor_class(a)
    if isinstance(getattr(a, "base", None), torch.Tensor) and hasattr(a, "block_shape"):  # a host TensorDescriptor
        _CLASSES[type(a)] = _descriptor_class
        return _descriptor_class(a)
    raise TypeError(type(a).__name__)


def _hooked(hook) -> bool:
    """Whether a launch hook is set: triton ≥ 3.5 keeps a HookChain (empty when none is registered),
    earlier ones None or the function."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel, grid: tuple, *args, **kw) -> None:
    """``kernel[grid](*args, **kw)``, through the compiled kernel's launcher once this kind of
    argument list has been launched on this device (see the module's docstring)."""
    rt = _triton_runtime() if _ENABLED else False
    if (not rt or not isinstance(kernel, rt[0]) or type(grid) is not tuple or _hooked(rt[1].launch_enter_hook)
            or _hooked(rt[1].launch_exit_hook)):
        kernel[grid](*args, **kw)
        return
    device = rt[2]()
    try:
        key = (kernel, device, tuple(map(_arg_class, args)), tuple(kw.items()))
        entry = _compiled.get(key)
    except TypeError:  # an argument of a kind not classed here, or an unhashable keyword value
        kernel[grid](*args, **kw)
        return
    if entry is None:
        compiled = kernel[grid](*args, **kw)
        _compiled[key] = _entry(kernel, compiled, args, kw)
        return
    compiled, tail = entry
    if compiled is None:
        kernel[grid](*args, **kw)
        return
    # No launch metadata and no enter / exit hooks: a launch with a hook set took kernel[grid] above.
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, rt[3](device), compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *tail)  # fmt: skip


def _entry(kernel, compiled, args: tuple, kw: dict):
    """(compiled, the values of the parameters after the positional ones, in the signature's order),
    or (None, None) where a later launch must go through ``kernel[grid]``: no compiled kernel came
    back, it lacks the launcher's attributes, or a keyword names a parameter before the last
    positional one (the launcher takes the values in the signature's order)."""
    if compiled is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        return None, None
    params = inspect.signature(kernel.fn).parameters
    names = list(params)
    if len(args) > len(names) or any(name in kw for name in names[: len(args)]):
        return None, None
    # A constexpr given by position would be keyed by its class, not its value.
    if any(p.is_constexpr for p in kernel.params[: len(args)]):
        return None, None
    tail = []
    for name in names[len(args):]:
        if name in kw:
            tail.append(kw[name])
        elif params[name].default is not inspect.Parameter.empty:
            tail.append(params[name].default)
        else:
            return None, None
    return compiled, tuple(tail)
