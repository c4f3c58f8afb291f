"""One small ragged grouped GEMM run in a child process under a time limit: on a triton the engine
has not run on, a compile error, a wrong result or a hang (an mbarrier waiting forever) becomes a
message instead of a stuck GPU test session or benchmark. The GPU tests and the benchmark ask this
first; nothing else needs it."""

from __future__ import annotations

import os
import subprocess
import sys

from ._compat import why_unavailable

# 655 routed rows over 5 experts (one empty, one of 5 rows), 45 capacity rows; N, K not tile multiples.
_CHILD = """
import torch
from moemlp.kernels.gluon import grouped_gemm
torch.manual_seed(0)
a = torch.randn(700, 200, device="cuda", dtype=torch.bfloat16)
b = torch.randn(5, 264, 200, device="cuda", dtype=torch.bfloat16)
splits = torch.tensor([300, 0, 5, 250, 100], device="cuda", dtype=torch.int32)
out = torch.full((700, 264), float("nan"), device="cuda", dtype=torch.bfloat16)
grouped_gemm(a, b, splits, out=out)
ref = torch._grouped_mm(a, b.transpose(-2, -1), offs=splits.cumsum(0).to(torch.int32))
torch.cuda.synchronize()
err = ((out[:655].float() - ref[:655].float()).abs().max() / ref[:655].float().abs().max()).item()
assert err < 1e-2, f"relative error {err:.3g} against torch._grouped_mm"
assert torch.count_nonzero(out[655:]) == 0, "capacity rows are not zero"
print("ok")
"""


def why_engine_fails(timeout_s: float = 180.0) -> str:
    """"" when the engine compiles, finishes and matches torch._grouped_mm on a small ragged case on
    the current device; otherwise what went wrong (the child's last lines of output)."""
    reason = why_unavailable()
    if reason:
        return reason
    try:
        run = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=timeout_s,
                             env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return f"a 700-row grouped GEMM did not finish in {timeout_s:.0f} s (the kernel hangs)"
    if run.returncode != 0 or "ok" not in run.stdout:
        tail = (run.stderr or run.stdout).strip().splitlines()
        return "the engine failed: " + " | ".join(tail[-8:])
    return ""
