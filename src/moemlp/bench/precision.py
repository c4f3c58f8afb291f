"""`python -m moemlp precision`: the probability contract at a glance.

Relative error against a float64 evaluation of SPEC §1 on the same rounded operands, for moemlp
(fp32 probs in, fp32 dprobs out) and for the unfused torch composition in the compute dtype (probs
rounded to bf16, dprobs back through bf16), as TransformerEngine runs on Hopper.
"""

from __future__ import annotations

import os

import torch

from ..functional import _resolve_backend, grouped_mlp
from .common import device_description, print_table, routed_problem, write_csv
from .peers import torch_composition

_NAMES = ("y", "dprobs", "dx", "dfc1_weight", "dfc2_weight")


def _dprobs_float64(x, splits, probs, w1, w2, dy, backend):
    """SPEC §1's dprobs = Σ_f g_z·a in float64 on the operands it is defined on: dy, fc2_weight and
    the pre-activation h that moemlp's forward stored (in the compute dtype)."""
    from .._config import MLPConfig
    from ..activations import ACTIVATIONS
    from ..reference import ExpertLayout, activate

    _, h, _ = torch.ops.moemlp.grouped_mlp_fwd(x, splits, probs, w1, w2, None, None, "swiglu", [],
                                               w2.shape[-1], False, "", backend, [False, False], [])
    lay = ExpertLayout(splits, x.shape[0], x.device)
    T = lay.total
    g_z = lay.unpad(torch.bmm(lay.pad(dy[:T].double()), w2.double()))
    cfg = MLPConfig(ACTIVATIONS["swiglu"], (), w2.shape[-1], False)
    return lay.full((g_z * activate(h[:T].double(), cfg)).sum(-1), torch.float64)


def _errors(fn, x, splits, probs, w1, w2, dy, ref) -> dict:
    leaves = [t.detach().clone().requires_grad_() for t in (x, probs, w1, w2)]
    y = fn(leaves[0], splits, leaves[1], leaves[2], leaves[3])
    dx, dprobs, dw1, dw2 = torch.autograd.grad(y, leaves, dy)
    out = {}
    for name, t in zip(_NAMES, (y, dprobs, dx, dw1, dw2)):
        r = ref[name]
        t = t.detach().double()
        out[name] = float(torch.linalg.vector_norm(t - r) / torch.linalg.vector_norm(r))
    out["dprobs_dtype"] = str(dprobs.dtype).replace("torch.", "")
    return out


def run_precision(shape, device: torch.device, backend: str, out_dir: str) -> list[dict]:
    x, splits, probs, w1, w2, dy = routed_problem(shape, device)
    # float64 evaluation of the same rounded operands (the torch backend in float64)
    leaves64 = [t.detach().double().requires_grad_() for t in (x, probs, w1, w2)]
    y64 = grouped_mlp(leaves64[0], splits, leaves64[1], leaves64[2], leaves64[3], backend="torch")
    g64 = torch.autograd.grad(y64, leaves64, dy.double())
    ref = dict(zip(_NAMES, (y64.detach(), g64[1], g64[0], g64[2], g64[3])))
    del y64, g64, leaves64
    resolved = "torch" if backend == "torch" else _resolve_backend(backend, x, None)
    ref["dprobs"] = _dprobs_float64(x, splits, probs, w1, w2, dy, resolved)

    rows = [
        {"impl": f"moemlp ({backend})",
         **_errors(lambda *a: grouped_mlp(*a, backend=backend), x, splits, probs, w1, w2, dy, ref)},
        {"impl": "torch composition (bf16 probs)",
         **_errors(torch_composition, x, splits, probs, w1, w2, dy, ref)},
    ]
    os.makedirs(out_dir, exist_ok=True)
    write_csv(os.path.join(out_dir, "precision.csv"), rows)
    _plot(rows, os.path.join(out_dir, "precision.png"), shape.name)
    print(f"precision on {device_description(device)}, shape {shape.name} (M={shape.rows}, "
          f"H={shape.hidden}, F={shape.ffn}, E={shape.experts}), bf16 operands, fp32 probs")
    print_table(rows, ["impl", *_NAMES, "dprobs_dtype"],
                "relative error ‖out − ref‖/‖ref‖ against float64 on the same rounded operands")
    ours = rows[0]["dprobs"]
    print(f"\ncontract: moemlp dprobs rel. error {ours:.2e} (limit 1e-5): "
          f"{'OK' if ours <= 1e-5 else 'VIOLATED'}; composition {rows[1]['dprobs']:.2e}")
    return rows


def _plot(rows, path, title) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(_NAMES))
    for i, r in enumerate(rows):
        ax.bar([j + (i - 0.5) * 0.4 for j in xs], [r[n] for n in _NAMES], 0.4, label=r["impl"])
    ax.axhline(1e-5, color="k", lw=0.8, ls="--", label="dprobs contract 1e-5")
    ax.set_yscale("log")
    ax.set_xticks(list(xs), _NAMES)
    ax.set_ylabel("relative error vs float64")
    ax.set_title(f"precision, {title}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
