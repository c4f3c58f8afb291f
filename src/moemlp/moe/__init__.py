"""The MoE layer: fp32 router, dispatch/combine on the device, expert parallelism.

Module map: router.py (Router), dispatch.py (sort, permute/unpermute, the one-device forward),
_kernels.py (Triton gathers), ep.py (all-to-all and the expert-parallel forward), layer.py (MoE).
"""

from .layer import MoE

__all__ = ["MoE"]
