"""Triton quantizers of SPEC §3's recipes: formats.py (element and scale arithmetic), kernels.py (the
quantizer kernels), api.py (their launchers, the names below)."""

from . import api as _api
from .api import *  # noqa: F403  the launchers, named once in api.__all__

__all__ = list(_api.__all__)
