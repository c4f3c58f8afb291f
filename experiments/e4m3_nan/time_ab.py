"""fp8_block's quantizers with e4m3_code the bare hardware conversion (NaN -> 0x7F) against
main's compare and select: one tree's timings, run once per tree (PYTHONPATH picks it) and alternated by the driver.
Prints, per shape: the wgrad operand passes (x bf16, g_h fp32; codes_t, blocks computed once), the
rowwise passes (x, g_h), do_bench medians in µs; at qwen3 and gpt-oss the fp8_block step with cached
weights (ms, median of 3), and a digest of the codes and scales, which must match across trees.
    PYTHONPATH=<tree>/src:tests python3 experiments/e4m3_nan/time_ab.py TAG
"""

import hashlib
import sys

import torch
from triton.testing import do_bench

from moemlp import grouped_mlp, quantize_weights
from moemlp.bench.common import GPU_SHAPES, routed_problem, time_ms
from moemlp.kernels.quant import api as kq
from moemlp.recipes import recipe

tag = sys.argv[1]
dev = torch.device("cuda")
r = recipe("fp8_block")
digest = hashlib.sha1()


def passes(shape):
    x, splits, probs, w1, w2, dy = routed_problem(GPU_SHAPES[shape], dev)
    M, F = x.shape[0], w2.shape[-1]
    g_h = torch.randn(M, 2 * F, device=dev, generator=torch.Generator(device="cuda").manual_seed(0)) * 1e-3
    blocks = kq.row_blocks(splits, M, 128)
    us = {}
    for name, t in (("x", x), ("g_h", g_h)):
        q = kq.quantize_wgrad(t, splits, r, transposed=True, blocks=blocks)
        digest.update(q.codes_t.view(torch.uint8).cpu().numpy().tobytes())
        digest.update(q.scales.cpu().numpy().tobytes())
        us[f"wgrad_{name}"] = do_bench(lambda t=t: kq.quantize_wgrad(t, splits, r, transposed=True, blocks=blocks),
                                       rep=200) * 1e3  # fmt: skip
        q = kq.quantize(t, r)
        digest.update(q.codes.view(torch.uint8).cpu().numpy().tobytes())
        digest.update(q.scales.cpu().numpy().tobytes())
        us[f"rowwise_{name}"] = do_bench(lambda t=t: kq.quantize(t, r), rep=200) * 1e3
    print(tag, shape, " ".join(f"{k}={v:.1f}" for k, v in us.items()), flush=True)
    return x, splits, probs, w1, w2, dy


def step_ms(x, splits, probs, w1, w2, dy):
    leaves = [t.requires_grad_() for t in (x, probs, w1, w2)]
    qw = quantize_weights(w1, w2, "fp8_block")

    def step():
        y = grouped_mlp(x, splits, probs, w1, w2, recipe="fp8_block", quantized_weights=qw)
        return torch.autograd.grad(y, leaves, dy)

    return sorted(time_ms(step, dev, rep_ms=150).median for _ in range(3))[1]


for shape in ("qwen3-30b-a3b", "gpt-oss-120b"):
    problem = passes(shape)
    print(tag, shape, f"step={step_ms(*problem):.4f}", flush=True)
    del problem
    torch.cuda.empty_cache()
print(tag, "digest", digest.hexdigest(), flush=True)
