"""The grouped-GEMM family: config.py (tile tables), grouped.py (the forward / dgrad mainloop and
tile scheduler) with epilogue.py, wgrad.py, fp8_wgrad.py, dprobs.py, activations.py (the kernels'
activation formulas), common.py (the expert table, rounding and launch helpers)."""

from .common import INTERPRET
from .config import GemmConfig, default_config, dprobs_parts, fp8_config
from .dprobs import launch_dprobs_reduce
from .epilogue import FC1, FC1_DGRAD, FC2, FC2_DGRAD
from .fp8_wgrad import Fp8WgradConfig, default_fp8_wgrad_config, fp8_grouped_wgrad
from .grouped import launch_grouped_gemm
from .wgrad import launch_grouped_wgrad

__all__ = [
    "INTERPRET",
    "FC1",
    "FC2",
    "FC2_DGRAD",
    "FC1_DGRAD",
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
