#!/usr/bin/env python3
"""Train a tiny Mixture-of-Experts character language model on this repository's own text.

    python examples/train_tiny_moe.py                       # CPU: torch backend, ~1 minute
    python examples/train_tiny_moe.py --backend both        # GPU: torch and Triton, curves compared

The corpus is the repository's Markdown and Python files (it ships with the code). The model: token
and position embeddings, two pre-norm blocks of causal self-attention + ``moemlp.moe.MoE`` (8
experts, top-2, SwiGLU, fp32 router with Megatron-Core's load-balancing aux loss, which reaches the
router through ``loss.backward()`` on its own), a tied output layer.

The layer's options for current MoE families are flags: ``--shared-experts 2 --shared-ffn 64
--shared-gate`` (DeepSeek-V3 / Qwen2-MoE shared experts), ``--score sigmoid --num-groups 4
--topk-groups 2 --routed-scaling-factor 2.5`` (DeepSeek-V3's group-limited routing),
``--capacity-factor 1.0 --drop-policy position --pad-to-capacity`` (Megatron-Core token dropping).

``--backend both`` trains twice from the same initial weights on the same batches, once with the
torch reference backend and once with the Triton kernels, and reports how far the two loss curves
are apart. On a CPU the Triton run needs TRITON_INTERPRET=1, which this script sets itself (before
moemlp is imported) when asked for a Triton run without a GPU; the interpreter is slow, so use
few steps there (e.g. ``--backend both --steps 20``).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--backend", default="torch", choices=["torch", "triton", "auto", "both"])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="model dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", default=None, help="write the loss curve(s) here")
    m = p.add_argument_group("MoE options (moemlp.moe.MoE arguments)")
    m.add_argument("--score", default="softmax", choices=["softmax", "sigmoid"])
    m.add_argument("--shared-experts", type=int, default=0, help="num_shared_experts")
    m.add_argument("--shared-ffn", type=int, default=None, help="shared_expert_ffn_hidden_size")
    m.add_argument("--shared-gate", action="store_true", help="shared_expert_gate (Qwen2-MoE)")
    m.add_argument("--num-groups", type=int, default=None, help="num_groups (DeepSeek-V3 n_group)")
    m.add_argument("--topk-groups", type=int, default=None, help="topk_groups (DeepSeek-V3 topk_group)")
    m.add_argument("--routed-scaling-factor", type=float, default=1.0)
    m.add_argument("--capacity-factor", type=float, default=None, help="drop tokens past this capacity")
    m.add_argument("--drop-policy", default="probs", choices=["probs", "position"])
    m.add_argument("--pad-to-capacity", action="store_true")
    return p.parse_args(argv)


def moe_options(a) -> dict:
    """The MoE keyword arguments the flags ask for."""
    return dict(score=a.score, num_shared_experts=a.shared_experts, shared_expert_ffn_hidden_size=a.shared_ffn,
                shared_expert_gate=a.shared_gate, num_groups=a.num_groups, topk_groups=a.topk_groups,
                routed_scaling_factor=a.routed_scaling_factor, capacity_factor=a.capacity_factor,
                drop_policy=a.drop_policy, pad_to_capacity=a.pad_to_capacity)


args = parse_args() if __name__ == "__main__" else None
if args is not None and args.backend in ("triton", "both"):
    import torch as _torch

    if not _torch.cuda.is_available() and (args.device in (None, "cpu")):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the Triton kernels are defined

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(ROOT / "src"))
from moemlp.moe import MoE  # noqa: E402


def load_corpus() -> str:
    files = sorted(ROOT.glob("*.md")) + sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "src").rglob("*.py"))
    text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    if len(text) < 10_000:
        raise SystemExit(f"corpus too small ({len(text)} characters from {len(files)} files)")
    return text


class Block(nn.Module):
    def __init__(self, d: int, heads: int, backend: str, device, dtype, moe_kwargs: dict):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d, device=device, dtype=dtype)
        self.qkv = nn.Linear(d, 3 * d, bias=False, device=device, dtype=dtype)
        self.proj = nn.Linear(d, d, bias=False, device=device, dtype=dtype)
        self.ln2 = nn.LayerNorm(d, device=device, dtype=dtype)
        self.moe = MoE(hidden_size=d, ffn_hidden_size=2 * d, num_experts=8, top_k=2, aux_loss_coeff=1e-2,
                       z_loss_coeff=1e-3, backend=backend, device=device, dtype=dtype, **moe_kwargs)

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, D))
        return x + self.moe(self.ln2(x))


class TinyMoELM(nn.Module):
    def __init__(self, vocab: int, seq: int, backend: str, device, dtype, moe_kwargs: dict, d: int = 64,
                 layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d, device=device, dtype=dtype)
        self.pos = nn.Parameter(torch.zeros(seq, d, device=device, dtype=dtype))
        self.blocks = nn.ModuleList(Block(d, 4, backend, device, dtype, moe_kwargs) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, device=device, dtype=dtype)
        nn.init.normal_(self.tok.weight, std=0.02)  # tied output: N(0, 1) rows would give huge logits

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.ln_f(x) @ self.tok.weight.t()  # tied output layer


def train(backend: str, data: torch.Tensor, vocab: int, a, device, dtype) -> list[float]:
    torch.manual_seed(a.seed)
    model = TinyMoELM(vocab, a.seq, backend, device, dtype, moe_options(a))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    batches = torch.Generator().manual_seed(a.seed + 1)  # the same batches for every backend
    losses = []
    t0 = time.perf_counter()
    for step in range(a.steps):
        start = torch.randint(0, data.numel() - a.seq - 1, (a.batch,), generator=batches)
        window = torch.stack([data[s : s + a.seq + 1] for s in start.tolist()]).to(device)
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # the routers' aux and z losses are attached: they backpropagate too
        opt.step()
        losses.append(loss.item())
        if step % max(1, a.steps // 10) == 0 or step == a.steps - 1:
            aux = sum(float(b.moe.router.aux_loss) for b in model.blocks)
            print(f"[{backend:6s}] step {step:4d}  loss {losses[-1]:.4f}  aux {aux:.4f}  "
                  f"{time.perf_counter() - t0:6.1f} s", flush=True)
    return losses


def main(a) -> int:
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    text = load_corpus()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.int64)
    print(f"corpus: {len(text):,} characters, vocabulary {len(chars)}; device {device}, dtype {dtype}")
    backends = ["torch", "triton"] if a.backend == "both" else [a.backend]
    curves = {b: train(b, data, len(chars), a, device, dtype) for b in backends}

    ok = True
    for b, c in curves.items():
        head, tail = sum(c[:10]) / min(10, len(c)), sum(c[-10:]) / min(10, len(c))
        fell = tail < head - 0.5 and all(math.isfinite(v) for v in c)
        print(f"{b}: mean loss first 10 steps {head:.3f} -> last 10 steps {tail:.3f} "
              f"({'falls' if fell else 'DOES NOT FALL'}); uniform guess would be {math.log(len(chars)):.3f}")
        ok &= fell
    if len(curves) == 2:
        t, r = curves["torch"], curves["triton"]
        diffs = [abs(u - v) for u, v in zip(t, r)]
        rel_end = abs(sum(t[-10:]) - sum(r[-10:])) / sum(t[-10:])
        print(f"torch vs triton: max |Δloss| {max(diffs):.4f} (step {diffs.index(max(diffs))}), "
              f"first step {diffs[0]:.2e}, mean of last 10 steps differs by {100 * rel_end:.2f} %")
        ok &= rel_end < 0.02  # same model, same batches: curves within 2 % at the end
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step"] + list(curves))
            for i, row in enumerate(zip(*curves.values())):
                w.writerow([i] + [f"{v:.6f}" for v in row])
        print(f"wrote {a.csv}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(args))
