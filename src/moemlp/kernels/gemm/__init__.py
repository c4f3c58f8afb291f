"""The grouped-GEMM family. launch.py is the host side (tile tables and every launcher, the names
below); the kernels are device code: grouped.py (the forward / dgrad mainloop and tile scheduler)
with epilogue.py, wgrad.py, fp8_wgrad.py, dprobs.py, activations.py (the kernels' activation
formulas), common.py (the expert table and the one rounding of stored outputs)."""

from .common import INTERPRET
from .launch import (
    Fp8WgradConfig,
    GemmConfig,
    default_config,
    default_fp8_wgrad_config,
    dprobs_parts,
    fp8_config,
    fp8_grouped_wgrad,
    launch_dprobs_reduce,
    launch_grouped_gemm,
    launch_grouped_wgrad,
)

__all__ = [
    "INTERPRET",
    "GemmConfig",
    "default_config",
    "fp8_config",
    "dprobs_parts",
    "launch_grouped_gemm",
    "launch_grouped_wgrad",
    "launch_dprobs_reduce",
    "Fp8WgradConfig",
    "default_fp8_wgrad_config",
    "fp8_grouped_wgrad",
]
