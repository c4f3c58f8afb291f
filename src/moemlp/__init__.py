"""moemlp: the fused grouped MLP of a Mixture-of-Experts layer, with an exact fp32 probability path."""

from ._quantized_weights import QuantizedWeights, quantize_weights
from .functional import grouped_mlp
from .modules import GroupedMLP
from .moe import MoE
from .recipes import recipe

__all__ = ["grouped_mlp", "quantize_weights", "QuantizedWeights", "GroupedMLP", "MoE", "recipe"]
__version__ = "0.1.0"
