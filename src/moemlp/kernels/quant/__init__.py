"""Triton quantizers of SPEC §3's recipes: formats.py (element and scale arithmetic), kernels.py (the
quantizer kernels), api.py (their launchers, the names below)."""

from .api import (
    RowBlocks,
    dequantized,
    dequantized_weight,
    dequantized_wgrad,
    exact_dtype,
    quantize,
    quantize_weight,
    quantize_wgrad,
    row_blocks,
    supports,
)

__all__ = [
    "quantize",
    "quantize_weight",
    "quantize_wgrad",
    "row_blocks",
    "RowBlocks",
    "supports",
    "dequantized",
    "dequantized_weight",
    "dequantized_wgrad",
    "exact_dtype",
]
