"""Block-scaled recipes (SPEC §3): torch reference quantizers and the recipe objects.

    r = recipe("fp8_block", pow2_scales=True)     # or "mxfp8", "nvfp4" (hadamard, stochastic_rounding)
    q = r.quantize(x, axis=-1)                     # QuantizedTensor: .codes, .scales, .dequantize()
    qw = r.quantize_weight(w)                      # fp8_block: 128×128 tiles over the last two dims

A recipe object is a frozen dataclass (equal when its options are), with ``key``, a string that
``from_key`` turns back into an equal recipe (it crosses the torch.library op boundary), and the
quantize-dequantize methods the torch backend calls (docs/ARCHITECTURE.md, "Recipe contract").
"""

from __future__ import annotations

from typing import Optional, Union

from ._base import QuantizedTensor, Recipe
from .fp8_block import FP8BlockRecipe
from .mxfp8 import MXFP8Recipe
from .nvfp4 import NVFP4Recipe

__all__ = [
    "recipe",
    "resolve_recipe",
    "from_key",
    "RECIPES",
    "Recipe",
    "QuantizedTensor",
    "FP8BlockRecipe",
    "MXFP8Recipe",
    "NVFP4Recipe",
]

RECIPES = {cls.name: cls for cls in (FP8BlockRecipe, MXFP8Recipe, NVFP4Recipe)}


def recipe(name: str, **options) -> Recipe:
    """The recipe ``name`` with boolean ``options`` (fp8_block: pow2_scales=True; nvfp4:
    hadamard=False, stochastic_rounding=False; mxfp8: none)."""
    if not isinstance(name, str):
        raise TypeError(f"recipe: expected a recipe name (str) or a recipe object, got {type(name).__name__}")
    cls = RECIPES.get(name)
    if cls is None:
        raise ValueError(f"recipe: unknown recipe {name!r}; expected one of {sorted(RECIPES)} or None")
    fields = tuple(cls.__dataclass_fields__)
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(f"recipe: {name!r} takes options {list(fields) or 'none'}, got unknown {unknown}")
    for k, v in options.items():
        if not isinstance(v, bool):
            raise TypeError(f"recipe: option {k!r} of {name!r} expects a bool, got {type(v).__name__}")
    return cls(**options)


def resolve_recipe(r: Union[None, str, Recipe]) -> Optional[Recipe]:
    """None -> None; a name -> ``recipe(name)`` with default options; a recipe object -> itself."""
    if r is None:
        return r
    if isinstance(r, Recipe):
        if type(r) not in RECIPES.values():
            raise TypeError(
                f"recipe: expected one of moemlp's recipe objects ({', '.join(c.__name__ for c in RECIPES.values())}), "
                f"got {type(r).__name__}"
            )
        return r
    if isinstance(r, str):
        return recipe(r)
    raise TypeError(f"recipe: expected None, a recipe name or a recipe object, got {type(r).__name__}")


def from_key(key: str) -> Recipe:
    """The inverse of ``Recipe.key``: 'mxfp8', 'fp8_block:pow2_scales=1', 'nvfp4:hadamard=0,…'."""
    if not isinstance(key, str):
        raise TypeError(f"recipe: expected a recipe key (str), got {type(key).__name__}")
    name, _, opts = key.partition(":")
    options = {}
    for item in filter(None, opts.split(",")):
        k, sep, v = item.partition("=")
        if not sep or v not in ("0", "1"):
            raise ValueError(f"recipe: malformed recipe key {key!r}")
        options[k] = v == "1"
    return recipe(name, **options)
