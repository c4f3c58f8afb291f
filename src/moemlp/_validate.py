"""Input validation of SPEC §2, run by every public entry point before anything is launched.

Shapes and values raise ValueError, dtypes and devices TypeError; every message names the
argument, what was expected and what came.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

_COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_PROBS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SPLITS_DTYPES = (torch.int32, torch.int64)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _tensor(name: str, t, ndim: int) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    return t


def _same_device(name: str, t: Tensor, device: torch.device) -> None:
    if t.device != device:
        raise TypeError(f"{name}: expected a tensor on {device} (the device of x), got {t.device}")


def _same_dtype(name: str, t: Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (the dtype of x), got {t.dtype}")


def _shape(name: str, t: Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{name}: expected shape {expected} ({what}), got {tuple(t.shape)}")


def validate_inputs(
    x,
    splits,
    probs,
    fc1_weight,
    fc2_weight,
    fc1_bias,
    fc2_bias,
    *,
    glu: bool,
    glu_interleave: Optional[int],
    scale_fc2_bias,
    activation: str = "",
    x_index=None,
) -> tuple[int, int, int, int]:
    """Check every tensor argument; return (M, H, F, g) where g is the GLU block width and M the
    number of expert-input rows: x's rows, or x_index's length when given (x is then (T, H), any T).

    The values of ``splits`` and ``x_index`` are checked separately (validate_split_values,
    validate_index_values): that needs a host read, which the Triton path never does on the GPU.
    """
    x = _tensor("x", x, 2)
    if x.dtype not in _COMPUTE_DTYPES:
        raise TypeError(f"x: expected dtype bfloat16, float16, float32 or float64, got {x.dtype}")
    M, H = x.shape
    if H < 1:
        raise ValueError(f"x: expected a hidden size H >= 1 (shape (M, H)), got shape {tuple(x.shape)}")
    device = x.device
    if x_index is not None:
        x_index = _tensor("x_index", x_index, 1)
        if x_index.dtype not in _INDEX_DTYPES:
            raise TypeError(
                f"x_index: expected dtype int32 or int64 (a row of x per expert-input row), got {x_index.dtype}"
            )
        _same_device("x_index", x_index, device)
        M = x_index.shape[0]

    fc1_weight = _tensor("fc1_weight", fc1_weight, 3)
    fc2_weight = _tensor("fc2_weight", fc2_weight, 3)
    for name, w in (("fc1_weight", fc1_weight), ("fc2_weight", fc2_weight)):
        _same_device(name, w, device)
        _same_dtype(name, w, x.dtype)
    E, N1, H1 = fc1_weight.shape
    if E < 1:
        raise ValueError(f"fc1_weight: expected at least one expert, got shape {tuple(fc1_weight.shape)}")
    if H1 != H:
        if fc2_weight.shape[1] == H1:  # the weights agree on H: x is the odd one out
            raise ValueError(
                f"x: expected shape (M, {H1}) with H = {H1} from fc1_weight and fc2_weight, got {tuple(x.shape)}"
            )
        raise ValueError(
            f"fc1_weight: expected shape (E, N1, {H}) with H = x.shape[1] = {H}, got {tuple(fc1_weight.shape)}"
        )
    act = f"activation {activation!r}" if activation else "the activation"
    F2 = fc2_weight.shape[-1]
    if glu:
        if N1 == F2:
            raise ValueError(
                f"fc1_weight: {act} is a GLU, so N1 = 2F = {2 * F2} for F = fc2_weight.shape[-1] = {F2} "
                f"(gate and up), got N1 = {N1}: the shape of a unary activation's weights"
            )
        if N1 % 2:
            raise ValueError(
                f"fc1_weight: a GLU activation needs an even N1 = 2F, got N1 = {N1} (shape {tuple(fc1_weight.shape)})"
            )
        F = N1 // 2
    else:
        if N1 == 2 * F2:
            raise ValueError(
                f"fc1_weight: {act} is not a GLU, so N1 = F = fc2_weight.shape[-1] = {F2}, got N1 = {N1} = 2F: "
                f"the shape of GLU weights (gate and up); use a GLU activation or fc1_weight of shape (E, {F2}, H)"
            )
        F = N1
    if F < 1:
        raise ValueError(f"fc1_weight: expected N1 >= {2 if glu else 1}, got shape {tuple(fc1_weight.shape)}")
    _shape("fc2_weight", fc2_weight, (E, H, F), f"E = {E}, H = {H}, F = {F} from fc1_weight and x")

    if fc1_bias is not None:
        fc1_bias = _tensor("fc1_bias", fc1_bias, 2)
        _same_device("fc1_bias", fc1_bias, device)
        _same_dtype("fc1_bias", fc1_bias, x.dtype)
        _shape("fc1_bias", fc1_bias, (E, N1), "(E, N1) of fc1_weight")
    if fc2_bias is not None:
        fc2_bias = _tensor("fc2_bias", fc2_bias, 2)
        _same_device("fc2_bias", fc2_bias, device)
        _same_dtype("fc2_bias", fc2_bias, x.dtype)
        _shape("fc2_bias", fc2_bias, (E, H), "(E, H) of fc2_weight")
    if not isinstance(scale_fc2_bias, bool):
        raise TypeError(f"scale_fc2_bias: expected a bool, got {type(scale_fc2_bias).__name__}")

    if probs is not None:
        probs = _tensor("probs", probs, 1)
        if probs.dtype not in _PROBS_DTYPES and not (
            probs.dtype == torch.float64 and x.dtype == torch.float64
        ):
            raise TypeError(
                f"probs: expected dtype float32, bfloat16 or float16 (float64 only with float64 x), got {probs.dtype}"
            )
        _same_device("probs", probs, device)
        if probs.shape[0] != M:
            if x_index is not None:  # x_index sets M here; the two disagree
                raise ValueError(
                    f"x_index and probs: expected the same length, one per expert-input row (the rows splits "
                    f"counts), got x_index ({M},) and probs {tuple(probs.shape)}"
                )
            raise ValueError(f"probs: expected shape ({M},) (one per row of x), got {tuple(probs.shape)}")

    splits = _tensor("splits", splits, 1)
    if splits.dtype not in _SPLITS_DTYPES:
        raise TypeError(f"splits: expected dtype int32 or int64 (rows per expert), got {splits.dtype}")
    if splits.shape[0] != E:
        raise ValueError(
            f"splits: expected shape ({E},) (one count per expert of fc1_weight), got {tuple(splits.shape)}"
        )

    if glu_interleave is None:
        g = F
    else:
        if isinstance(glu_interleave, bool) or not isinstance(glu_interleave, int):
            raise TypeError(f"glu_interleave: expected an int or None, got {type(glu_interleave).__name__}")
        if not glu:
            raise ValueError("glu_interleave: only applies to GLU activations; pass None for a unary activation")
        if glu_interleave < 1 or F % glu_interleave:
            raise ValueError(
                f"glu_interleave: expected a positive divisor of F = {F}, got {glu_interleave}"
            )
        g = glu_interleave
    return M, H, F, g


def weight_is_transposed(w: Tensor) -> bool:
    """Whether the expert weight ``w`` (E, R, C) is the transposed view of a contiguous (E, C, R)
    tensor: the layout of transformers' ``is_transposed`` experts (gpt-oss), which both backends
    read in place (and return the gradient of in the same layout) instead of copying it."""
    return w.dim() == 3 and not w.is_contiguous() and w.transpose(1, 2).is_contiguous()


def validate_split_values(splits: Tensor, num_rows: int, rows_of: str = "x") -> None:
    """Counts >= 0 and Σ <= M. Reads splits on the host: free for CPU splits; a synchronisation
    for GPU splits, done only where the backend reads them on the host anyway (torch).
    ``rows_of``: what holds the M rows, for the message ("x", or "x_index" when rows are gathered)."""
    s = splits.detach().to("cpu", torch.int64)
    if bool((s < 0).any()):
        raise ValueError(f"splits: expected counts >= 0, got {s.tolist()}")
    total = int(s.sum())
    if total > num_rows:
        raise ValueError(f"splits: the counts sum to {total}, past the {num_rows} rows of {rows_of}")


def validate_index_values(x_index: Tensor, num_routed: int, num_tokens: int) -> None:
    """x_index[:num_routed] in [0, T), T = x's rows; the capacity rows' indices are not read. A host
    read of the routed indices, done where it costs no synchronisation (CPU) or where the backend
    reads splits on the host anyway (torch); the Triton path clamps device indices instead."""
    idx = x_index.detach()[:num_routed].to("cpu", torch.int64)
    bad = ((idx < 0) | (idx >= num_tokens)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(
            f"x_index: expected values in [0, {num_tokens}) (rows of x) for the {num_routed} routed rows "
            f"(Σsplits), got {int(idx[i])} at row {i} ({bad.shape[0]} out of range)"
        )
