"""A warp-specialized persistent grouped GEMM for sm_90 written in Gluon (triton.experimental.gluon):
the engine the MLP's fused epilogues will move onto. ``grouped_gemm(a, b, splits)`` computes
C[R_e] = A[R_e] @ B[e]ᵀ for rows grouped by expert; ``is_available()`` says whether this triton and
device can run it (``why_unavailable()`` says why not). ``fc2_dgrad`` is the MLP's FC2_DGRAD with its
fused epilogue (dSwiGLU·probs, z, dprobs partials), which the backward runs where
``fc2_dgrad_supports`` allows (kernels/operands.py)."""

from ._compat import is_available, missing, why_unavailable
from ._launch import fc2_dgrad, fc2_dgrad_supports, grouped_gemm, supports

__all__ = ["grouped_gemm", "supports", "fc2_dgrad", "fc2_dgrad_supports", "is_available", "missing", "why_unavailable"]
