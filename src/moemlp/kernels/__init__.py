"""The Triton backend: the schedule of launches (mlp.py), recipe → GEMM operands (operands.py), the
grouped-GEMM kernels (gemm/) and the quantizers (quant/). This face only hands names on."""

from .mlp import grouped_fc1, grouped_mlp_bwd, grouped_mlp_fwd, is_available, supports_recipe, unavailable_reason
from .operands import saved_dgrad_like, takes_routed_amax

__all__ = [
    "is_available",
    "unavailable_reason",
    "supports_recipe",
    "grouped_mlp_fwd",
    "grouped_mlp_bwd",
    "grouped_fc1",
    "saved_dgrad_like",
    "takes_routed_amax",
]
