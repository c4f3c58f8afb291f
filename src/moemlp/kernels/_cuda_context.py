"""Makes the device's primary CUDA context current on the calling thread before a launch that encodes
host-side TMA descriptors.

Triton encodes a host ``TensorDescriptor`` (``cuTensorMapEncodeTiled``) before its launcher makes a
context current, and that driver call fails with "invalid device context" on a thread where none is.
A thread gets one from its first CUDA runtime call, from triton loading a kernel binary there, or
from a device switch; PyTorch's autograd worker thread for device 0 gets none of these when the
backward's first launch is a kernel that another thread already loaded (``recompute_fc1`` re-running
FC1 on the autograd thread after a forward on the main thread, say). The check is one thread-local
read after the first call on each thread.
"""

from __future__ import annotations

import ctypes
import threading

import torch

_bound = threading.local()
_libcuda = None


def _driver():
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    return _libcuda


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"moemlp: {what} failed with CUDA driver error {rc}")


def bind_context(device: torch.device) -> None:
    """Makes ``device``'s primary context current on this thread if no context is (a no-op after the
    first call on a thread for that device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if getattr(_bound, "index", None) == index:
        return
    lib = _driver()
    ctx = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        dev = ctypes.c_int()
        _check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
        # The primary context that the CUDA runtime (and so PyTorch) uses on this device.
        _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    _bound.index = index
