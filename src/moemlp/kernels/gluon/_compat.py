"""Every difference between the Gluon APIs of triton 3.6 (the GPU machines) and 3.9 (this checkout)
that the engine touches, in one place, detected by feature rather than by version string.

- TMA load, global → smem: 3.6 ``tma.async_copy_global_to_shared``; 3.8+ ``tma.async_load`` (3.9
  keeps the old name as a builtin that raises).
- TMA store, smem → global: 3.6 ``tma.async_copy_shared_to_global``; 3.8+ ``tma.async_store`` (the
  old name raises in 3.9).
- ``gl.warp_specialize``: both take ``(functions_and_args, worker_num_warps, worker_num_regs)``;
  3.6 requires the register list, 3.9 makes it optional (≤ 3.5 took six separate arguments).
- ``mbarrier.expect``: 3.6 ``(bar, bytes, pred)``; 3.9 ``(bar, bytes_per_cta, pred, *, from_cta)``.
- CTA-wide barrier: 3.6 ``gl.thread_barrier()``; 3.9 ``gl.barrier(*, cluster=False)``.
- ``tma.store_wait``: 3.6 ``(pendings)``; 3.9 ``(pendings, read_only=True)``.
- Offline compiles: both have ``gluon._runtime.GluonASTSource``, which sets ``ttg.num-warps`` on
  the module; a plain ``ASTSource`` leaves it out and a warp-specialized region fails to verify.

The engine calls only the names defined here for those operations, always with the arguments both
versions accept positionally (``expect(bar, nbytes)``, ``store_wait(n)``, ``warp_specialize`` with
the register list given). Importing this module never raises: ``MISSING`` says what a triton
without a usable Gluon lacks, and ``is_available()`` adds the device check.
"""

from __future__ import annotations

import inspect

MISSING: list[str] = []

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError as err:  # triton < 3.5 has no Hopper Gluon
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None
    TensorDescriptor = None
    MISSING.append(f"triton.experimental.gluon with the Hopper modules ({err})")

tma_load = tma_store = store_wait = expect_bytes = warp_specialize = cta_barrier = None
if gl is not None:
    # 3.8 renamed the TMA copies; 3.9 keeps the old names as builtins that raise, so the new name is
    # looked up first.
    tma_load = getattr(tma, "async_load", None) or getattr(tma, "async_copy_global_to_shared", None)
    tma_store = getattr(tma, "async_store", None) or getattr(tma, "async_copy_shared_to_global", None)
    store_wait = getattr(tma, "store_wait", None)
    expect_bytes = getattr(mbarrier, "expect", None)
    cta_barrier = getattr(gl, "barrier", None) or getattr(gl, "thread_barrier", None)
    warp_specialize = getattr(gl, "warp_specialize", None)
    for name, fn in (("tma load", tma_load), ("tma store", tma_store), ("tma.store_wait", store_wait),
                     ("mbarrier.expect", expect_bytes), ("a CTA barrier", cta_barrier),
                     ("gl.warp_specialize", warp_specialize)):
        if fn is None:
            MISSING.append(name)
    if warp_specialize is not None:
        # triton ≤ 3.5 took (default_args, default_fn, worker_args, worker_fns, warps, regs); the
        # engine is written against the list form that 3.6 through 3.9 share.
        params = list(inspect.signature(warp_specialize).parameters)
        if not params or params[0] != "functions_and_args":
            MISSING.append(f"gl.warp_specialize in its list form (this triton's takes {params[:3]})")


def missing() -> list[str]:
    """What this triton lacks for the engine (empty when it has everything)."""
    return list(MISSING)


def is_available(device=None) -> bool:
    """True when triton has Gluon's Hopper TMA / mbarrier / wgmma modules and the list-form
    warp_specialize, and ``device`` (default: the current CUDA device) is an sm_90 GPU."""
    return not why_unavailable(device)


def why_unavailable(device=None) -> str:
    """The reason the engine cannot run on ``device``, or "" when it can."""
    if MISSING:
        return "triton lacks " + "; ".join(MISSING)
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"the engine is written for sm_90 (wgmma + TMA); this device is sm_{major}{minor}"
    return ""
