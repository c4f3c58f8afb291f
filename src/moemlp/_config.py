"""The resolved, validated configuration one grouped-MLP call runs with.

Backends (reference.py, kernels/) receive an ``MLPConfig`` and tensors that have already passed
validation (_validate.py); they do not validate again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .activations import ActivationSpec


@dataclass(frozen=True)
class MLPConfig:
    activation: ActivationSpec
    activation_params: tuple[float, ...]  # canonical order: activation.param_names
    glu_interleave: int  # gate/up block width g; for a GLU without interleave g = F (two halves)
    scale_fc2_bias: bool  # fc2 bias multiplied by probs
    recipe: Any = None  # a resolved recipe object (moemlp.recipes) or None

    @property
    def glu(self) -> bool:
        return self.activation.glu
