"""`python -m moemlp precision`: the probability contract, measured at the model shapes.

For each shape (bf16 operands, fp32 probs, SwiGLU), each implementation's outputs against float64:

- ``y``, ``dx``, ``dW1``, ``dW2``: against the float64 evaluation of SPEC §1 on the same rounded
  inputs (nothing rounded inside);
- ``dprobs|h``: the backward alone (SPEC §1, "measure it"): Σ_f g_z·a in float64 from the h that this
  implementation's forward stored; SPEC's bound for fp32 probs is 1e-6;
- ``dprobs e2e``: end to end: the same sum from the exact product x·W1ᵀ rounded once to bf16. It also
  holds the forward's h roundings, which differ from the exact ones wherever the fp32 accumulation
  lands near a bf16 tie;
- ``h mismatch``: the fraction of the stored h's elements whose bf16 rounding differs from the
  exactly rounded product: how accurate the forward's accumulation is.

Implementations: moemlp on the chosen backend; on a GPU also moemlp's torch backend (fp32 cuBLAS
GEMMs) when the chosen one is Triton; the lean ``_grouped_mm`` composition users write (probs
rounded to bf16, dprobs back through bf16).
"""

from __future__ import annotations

import os

import torch

from .._config import MLPConfig
from ..activations import ACTIVATIONS
from ..functional import _resolve_backend, grouped_mlp
from ..reference import ExpertLayout, activate
from .common import device_description, print_table, routed_problem, write_csv
from .peers import lean_composition

_GRADS = ("dx", "dprobs", "dW1", "dW2")
_COLUMNS = ("y", "dx", "dW1", "dW2", "dprobs|h", "dprobs e2e", "h mismatch")
DPROBS_BOUND = 1e-6  # SPEC §1: fp32 probs, bf16 operands, against float64 on the stored h


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return float(torch.linalg.vector_norm(a - ref) / torch.linalg.vector_norm(ref))


class _Float64:
    """The float64 quantities every implementation is measured against, for one problem."""

    def __init__(self, x, splits, probs, w1, w2, dy):
        leaves = [t.detach().double().requires_grad_() for t in (x, probs, w1, w2)]
        y = grouped_mlp(leaves[0], splits, leaves[1], leaves[2], leaves[3], backend="torch")
        dx, _, dw1, dw2 = torch.autograd.grad(y, leaves, dy.double())
        self.ref = {"y": y.detach(), "dx": dx, "dW1": dw1, "dW2": dw2}
        del y, leaves
        self.lay = ExpertLayout(splits, x.shape[0], x.device)
        self.cfg = MLPConfig(ACTIVATIONS["swiglu"], (), w2.shape[-1], False)
        T = self.lay.total
        # g_z = dy · W2 per expert, float64: the factor every dprobs below shares.
        self.g_z = self.lay.unpad(torch.bmm(self.lay.pad(dy[:T].double()), w2.double()))
        h_exact = self.lay.unpad(torch.bmm(self.lay.pad(x[:T].double()), w1.double().transpose(1, 2)))
        self.h_rounded = h_exact.to(x.dtype)  # the exact product rounded once
        del h_exact
        self.dprobs_e2e = self.dprobs_from(self.h_rounded)

    def dprobs_from(self, h: torch.Tensor) -> torch.Tensor:
        """Σ_f g_z·act(h) in float64 for the routed rows, 0 on capacity rows."""
        T = self.lay.total
        return self.lay.full((self.g_z * activate(h[:T].double(), self.cfg)).sum(-1), torch.float64)

    def h_mismatch(self, h: torch.Tensor) -> float:
        T = self.lay.total
        return float((h[:T] != self.h_rounded).double().mean())


def _stored_h_moemlp(x, splits, probs, w1, w2, backend: str) -> torch.Tensor:
    _, h, _ = torch.ops.moemlp.grouped_mlp_fwd(x, splits, probs, w1, w2, None, None, "swiglu", [],
                                               w2.shape[-1], False, "", backend, [False, False], [])
    return h


def _stored_h_lean(x, splits, w1) -> torch.Tensor:
    if hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16 and (
        not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] >= 9
    ):
        return torch._grouped_mm(x, w1.transpose(-2, -1), offs=torch.cumsum(splits, 0).to(torch.int32))
    from .peers import _grouped_linear

    return _grouped_linear(x, w1, splits, None)


def _measure(impl: str, fn, h: torch.Tensor, problem, f64: _Float64) -> dict:
    x, splits, probs, w1, w2, dy = problem
    leaves = [t.detach().clone().requires_grad_() for t in (x, probs, w1, w2)]
    y = fn(leaves[0], splits, leaves[1], leaves[2], leaves[3])
    dx, dprobs, dw1, dw2 = torch.autograd.grad(y, leaves, dy)
    out = {"impl": impl, "y": _rel(y, f64.ref["y"]), "dx": _rel(dx, f64.ref["dx"]),
           "dW1": _rel(dw1, f64.ref["dW1"]), "dW2": _rel(dw2, f64.ref["dW2"]),
           "dprobs|h": _rel(dprobs, f64.dprobs_from(h)), "dprobs e2e": _rel(dprobs, f64.dprobs_e2e),
           "h mismatch": f64.h_mismatch(h), "dprobs dtype": str(dprobs.dtype).replace("torch.", "")}
    return out


def precision_shape(shape, device: torch.device, backend: str) -> list[dict]:
    problem = routed_problem(shape, device)
    x, splits, probs, w1, w2, _ = problem
    f64 = _Float64(*problem)
    ran = _resolve_backend(backend, x, None)
    backends = [ran] + (["torch"] if (device.type == "cuda" and ran != "torch") else [])
    rows = []
    for be in backends:
        h = _stored_h_moemlp(x, splits, probs, w1, w2, be)
        rows.append(_measure(f"moemlp ({be})", lambda *a, be=be: grouped_mlp(*a, backend=be), h, problem, f64))
    rows.append(_measure("lean composition (bf16 probs)", lean_composition, _stored_h_lean(x, splits, w1),
                         problem, f64))
    return [{"shape": shape.name, **r} for r in rows]


def run_precision(shapes, device: torch.device, backend: str, out_dir: str) -> list[dict]:
    print(f"precision on {device_description(device)}; bf16 operands, fp32 probs, SwiGLU; relative error "
          f"‖out − ref‖/‖ref‖ against float64 (see `python -m moemlp precision --help` and the module doc)",
          flush=True)
    rows = []
    for i, shape in enumerate(shapes, 1):
        print(f"[{i}/{len(shapes)}] {shape.name}: M={shape.rows} H={shape.hidden} F={shape.ffn} "
              f"E={shape.experts} ...", flush=True)
        rows += precision_shape(shape, device, backend)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(out_dir, exist_ok=True)
    write_csv(os.path.join(out_dir, "precision.csv"), rows)
    _plot(rows, os.path.join(out_dir, "precision.png"))
    print()
    print_table(rows, ["shape", "impl", *_COLUMNS, "dprobs dtype"],
                "dprobs|h: backward alone, on the stored h; e2e: from the exact product rounded once; "
                "h mismatch: fraction of h elements rounded differently from the exact product")
    ours = [r for r in rows if r["impl"].startswith("moemlp")]
    worst = max(r["dprobs|h"] for r in ours)
    print(f"\ncontract (SPEC §1): moemlp dprobs against float64 on the stored h, worst {worst:.2e} "
          f"(bound {DPROBS_BOUND:.0e}): {'OK' if worst <= DPROBS_BOUND else 'VIOLATED'}")
    return rows


def _plot(rows, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, col in zip(axes, ("dprobs|h", "dprobs e2e")):
        width = 0.8 / len(impls)
        for j, impl in enumerate(impls):
            vals = [next((r[col] for r in rows if r["shape"] == s and r["impl"] == impl), float("nan"))
                    for s in shapes]
            ax.bar([i + (j - (len(impls) - 1) / 2) * width for i in range(len(shapes))], vals, width, label=impl)
        if col == "dprobs|h":
            ax.axhline(DPROBS_BOUND, color="k", lw=0.8, ls="--", label="SPEC bound 1e-6")
        ax.set_yscale("log")
        ax.set_xticks(list(range(len(shapes))), shapes, rotation=15, ha="right")
        ax.set_title(f"{col}: relative error vs float64", fontsize=9)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
