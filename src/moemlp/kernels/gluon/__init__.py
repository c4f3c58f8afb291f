"""A warp-specialized persistent grouped GEMM for sm_90 written in Gluon (triton.experimental.gluon):
the engine the MLP's fused epilogues will move onto. ``grouped_gemm(a, b, splits)`` computes
C[R_e] = A[R_e] @ B[e]ᵀ for rows grouped by expert; ``is_available()`` says whether this triton and
device can run it (``why_unavailable()`` says why not). Nothing here is wired into the MLP yet."""

from ._compat import is_available, missing, why_unavailable
from ._launch import grouped_gemm, supports

__all__ = ["grouped_gemm", "supports", "is_available", "missing", "why_unavailable"]
