"""Import before anything imports moemlp.kernels: turns the Triton interpreter on for CPU-only runs.

``@triton.jit`` reads TRITON_INTERPRET when the decorator runs (triton 3.9: triton/runtime/jit.py
checks ``knobs.runtime.interpret`` at decoration), i.e. when moemlp.kernels is first imported, so
the variable has to be set before that import, not in a fixture. A GPU run leaves it alone.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
