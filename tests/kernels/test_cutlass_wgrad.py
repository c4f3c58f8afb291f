"""The bf16 weight gradients without a recipe on an sm_90 GPU: torch._grouped_mm (CUTLASS) at float64
accuracy beside the Triton wgrad kernel, exact zeros for an expert with no rows, clamped device
splits, the same bits twice; and operands.wgrad's choice between it and the Gluon engine
(gluon.wgrad, the Triton kernel's bits, where experts are small), the bias gradient still from the
Triton kernel."""

from __future__ import annotations

import pytest
import torch

from moemlp.kernels import gluon, operands
from moemlp.kernels.gemm import launch

# (splits, M, P, Q): one comment per case says what it exercises.
CASES = [
    pytest.param([300, 0, 77, 128], 505, 256, 128, id="empty-expert"),
    pytest.param([5, 200, 3], 208, 128, 64, id="experts-of-a-few-rows"),
    pytest.param([100, 50, 60], 300, 136, 72, id="capacity"),  # rows 210..299 belong to no expert
    pytest.param([700, 700], 1000, 64, 64, id="splits-past-M"),  # the running sum is clamped at M
    pytest.param([-5, 40, 30], 70, 64, 64, id="negative-split"),  # counts 0 rows
    pytest.param([256] * 16, 4096, 1536, 2048, id="qwen3-like"),
]


def _reference(g, x, splits, M):
    rows = splits.to(torch.int64).clamp(0, M)
    cum = rows.cumsum(0)
    ends, starts = cum.clamp(max=M), (cum - rows).clamp(max=M)
    out = torch.zeros(splits.numel(), g.shape[1], x.shape[1], dtype=torch.float64, device=g.device)
    for e in range(splits.numel()):
        s, t = int(starts[e]), int(ends[e])
        out[e] = g[s:t].double().T @ x[s:t].double()
    return out, (ends - starts).tolist()


def _starts(rows):
    out, at = [], 0
    for n in rows:
        out.append(at)
        at += n
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("splits_list, M, P, Q", CASES)
def test_bf16_wgrad_on_grouped_mm(splits_list, M, P, Q):
    if torch.cuda.get_device_capability()[0] < 9 or not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm needs sm_90")
    torch.manual_seed(0)
    dev = "cuda"
    g = torch.randn(M, P, device=dev, dtype=torch.bfloat16)
    x = torch.randn(M, Q, device=dev, dtype=torch.bfloat16)
    splits = torch.tensor(splits_list, device=dev, dtype=torch.int64)
    bias = torch.zeros(len(splits_list), P, device=dev, dtype=torch.bfloat16)
    assert operands._cutlass_wgrad_ok(g, x, torch.bfloat16)
    # CUTLASS gives no fp32 dW: main_grad's runs on the engine or the Triton kernel, the same bits
    assert not operands._cutlass_wgrad_ok(g, x, torch.float32)
    dw32, _ = operands.wgrad(g, x, splits, None, dtype=torch.bfloat16, dw_dtype=torch.float32)
    triton_dw32 = torch.empty_like(dw32)
    launch.launch_grouped_wgrad(g=g, x=x, splits=splits, dw=triton_dw32, db=None,
                                config=launch.default_config("wgrad", 0, 0, False, 2))  # fmt: skip
    assert torch.equal(dw32, triton_dw32)

    dw = operands._cutlass_wgrad(g, x, splits)
    ref, rows = _reference(g, x, splits, M)
    assert dw.shape == ref.shape and dw.dtype == torch.bfloat16
    for e, n in enumerate(rows):
        if n == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e])), f"expert {e} has no rows: dW must be exactly 0"

    # The Triton kernel it replaces, on the same operands: within 2× its error against float64
    # plus one bf16 ulp of the largest value.
    triton_dw = torch.empty_like(dw)
    triton_db = torch.empty_like(bias)
    launch.launch_grouped_wgrad(g=g, x=x, splits=splits, dw=triton_dw, db=triton_db,
                                config=launch.default_config("wgrad", 0, 0, False, 2))  # fmt: skip
    err = (dw.double() - ref).abs().max().item()
    triton_err = (triton_dw.double() - ref).abs().max().item()
    assert err <= 2 * triton_err + ref.abs().max().item() * 2.0**-8, (err, triton_err)

    # operands.wgrad: the engine where experts are small (its bits are the Triton kernel's), else CUTLASS
    dispatched, db = operands.wgrad(g, x, splits, None, dtype=torch.bfloat16, dw_dtype=torch.bfloat16, bias=bias)
    engine = operands.wgrad_engine(g, x, splits, torch.bfloat16)
    assert engine == (M <= operands.WGRAD_ENGINE_ROWS * len(splits_list) and not gluon.why_unavailable())
    assert torch.equal(dispatched, triton_dw if engine else dw)
    db_ref = torch.stack([g[s : s + n].double().sum(0) for s, n in zip(_starts(rows), rows)])
    db_err = (db.double() - db_ref).abs().max().item()
    assert db_err <= 2 * (triton_db.double() - db_ref).abs().max().item() + db_ref.abs().max().item() * 2.0**-8

    assert torch.equal(operands._cutlass_wgrad(g, x, splits), dw), "two runs on the same inputs differ"
