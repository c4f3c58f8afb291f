"""A warp-specialized persistent grouped GEMM for sm_90 written in Gluon (triton.experimental.gluon):
the engine the MLP's fused epilogues will move onto. ``grouped_gemm(a, b, splits)`` computes
C[R_e] = A[R_e] @ B[e]ᵀ for rows grouped by expert; ``is_available()`` says whether this triton and
device can run it (``why_unavailable()`` says why not). ``fc2_dgrad`` is the MLP's FC2_DGRAD with its
fused epilogue (dSwiGLU·probs, z, dprobs partials), which the backward runs where
``fc2_dgrad_supports`` allows (kernels/operands.py). ``grouped_gemm_fp8`` is fp8_block's grouped GEMM
(e4m3 codes with 1×128 and 128×128 block scales) on the engine's cooperative tiles, which the MLP's
FC2 and FC1_DGRAD run under fp8_block where ``fp8_supports`` allows, as its FC2_DGRAD runs
``fc2_dgrad`` on the codes where ``fc2_dgrad_fp8_supports`` does. ``fp8_wgrad`` is fp8_block's
weight gradient, which the MLP runs wherever it is supported (``kernels.operands.fp8_wgrad``), and
``wgrad`` the bf16 one (the Triton wgrad kernel's bits). The MLP's bf16 FC2 (without a bias) and
FC1_DGRAD run ``grouped_gemm`` on its cooperative 128 × 256 tiles.
``fc1`` is FC1 with its GLU epilogue, bf16 or fp8_block (the Triton kernel's bits), which the MLP's
forward runs under fp8_block, and in bf16 where K ≤ ``operands.FC1_ENGINE_MAX_K`` or it takes its
cooperative tiles (``fc1_cooperative``), where ``fc1_supports`` allows. The bf16 launchers
(``grouped_gemm``, ``fc1``, ``fc2_dgrad``, ``wgrad``) take ``acc_scale``, a 0-d fp32 factor of the
fp32 accumulator applied before any epilogue (nvfp4's product of 1/S_enc), as the Triton kernels'
ACC_SCALE applies it."""

from ._compat import is_available, missing, why_unavailable
from ._launch import (
    fc1,
    fc1_cooperative,
    fc1_cooperative_why,
    fc1_supports,
    fc2_dgrad,
    fc2_dgrad_fp8_supports,
    fc2_dgrad_supports,
    fp8_supports,
    fp8_wgrad,
    fp8_wgrad_supports,
    grouped_gemm,
    grouped_gemm_fp8,
    supports,
    wgrad,
    wgrad_supports,
)

__all__ = ["grouped_gemm", "grouped_gemm_fp8", "supports", "fp8_supports", "fc2_dgrad",
           "fc2_dgrad_supports", "fc2_dgrad_fp8_supports", "fc1", "fc1_cooperative", "fc1_cooperative_why",
           "fc1_supports", "fp8_wgrad", "fp8_wgrad_supports", "wgrad", "wgrad_supports", "is_available", "missing",
           "why_unavailable"]
