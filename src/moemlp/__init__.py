"""moemlp: the fused grouped MLP of a Mixture-of-Experts layer, with an exact fp32 probability path."""

from .functional import grouped_mlp
from .modules import GroupedMLP

__all__ = ["grouped_mlp", "GroupedMLP"]
__version__ = "0.1.0"
