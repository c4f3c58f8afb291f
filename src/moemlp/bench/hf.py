"""`python -m moemlp bench --hf`: transformers models with experts_implementation="moemlp" against
transformers' own "grouped_mm", same model, same inputs, forward + backward.

Each model is one decoder layer of the real architecture (attention, router, experts at full size;
random weights, bf16, a 1024-token vocabulary so the LM head stays out of the way), built from its
config with no download. Three timings per backend, medians of ``median_ms``:

  moe_block              the layer's MoE block (router + experts, + shared expert where the model
                         has one) on random (1, tokens, H) hidden states: autograd.grad of the input
                         and every parameter
  moe_block_model_input  the same on the hidden states the model itself feeds the block
  model                  the one-layer model from embeddings to logits, autograd.grad of every parameter
  model_gpu              the same as GPU time, the host's launch time hidden behind a preloaded queue
                         (``bench.common.gpu_time_ms``): at 4096 tokens the one-layer model's host
                         time is about its GPU time, so ``model`` alone measures the launch path as
                         much as the kernels; a model of many layers keeps its host ahead

The two block inputs route differently: random hidden states spread the rows evenly over the
experts, while the randomly initialised model's own ones (dominated by attention outputs that are
much alike across tokens) send most rows to a few experts (qwen3-30b-a3b built on the CPU: the
busiest expert gets 8.6x the mean, 2196 of 32768 rows, the idlest 1; gpt-oss-120b: 3.2x, 408 of
16384, the idlest 27). ``routing_max_over_mean_*`` is that ratio for
each input; the model timing runs on the model's routing, so it compares with
moe_block_model_input, not with moe_block.

Expert FLOPs of the block, forward + backward: 18·tokens·top_k·H·F (a GLU expert MLP: forward
6·rows·H·F, backward twice that), on the rows the router actually sends (tokens·top_k).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .common import device_description, gpu_time_ms, median_ms, print_table, write_csv

__all__ = ["run_hf_bench", "HFModelShape", "GPU_MODELS", "CPU_MODELS"]


@dataclass(frozen=True)
class HFModelShape:
    name: str
    family: str  # "qwen3_moe" or "gpt_oss"
    hidden: int  # H
    ffn: int  # F, per expert
    experts: int  # E
    top_k: int
    heads: int
    kv_heads: int
    head_dim: int
    tokens: int

    def expert_flops(self) -> float:
        return 18.0 * self.tokens * self.top_k * self.hidden * self.ffn


GPU_MODELS = (
    # Qwen3-30B-A3B: H 2048, 128 experts of F 768, top-8; GQA 32 / 4 heads of 128
    HFModelShape("qwen3-30b-a3b", "qwen3_moe", 2048, 768, 128, 8, 32, 4, 128, 4096),
    # gpt-oss-120b: H 2880, 128 experts of F 2880, top-4, clamped SwiGLU, biases; 64 / 8 heads of 64
    HFModelShape("gpt-oss-120b", "gpt_oss", 2880, 2880, 128, 4, 64, 8, 64, 4096),
)
CPU_MODELS = (
    HFModelShape("qwen3-tiny", "qwen3_moe", 64, 32, 8, 2, 4, 2, 16, 64),
    HFModelShape("gpt-oss-tiny", "gpt_oss", 64, 32, 8, 2, 4, 2, 16, 64),
)
VOCAB = 1024


def build_model(shape: HFModelShape, device: torch.device, dtype=torch.bfloat16):
    """A one-decoder-layer model of ``shape`` with random weights (the family's own init), on device."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=shape.hidden, num_hidden_layers=1,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                  num_experts_per_tok=shape.top_k, max_position_embeddings=max(4096, shape.tokens),
                  tie_word_embeddings=False)
    if shape.family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, intermediate_size=3 * shape.ffn,
                                          moe_intermediate_size=shape.ffn, num_experts=shape.experts,
                                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        cls = transformers.Qwen3MoeForCausalLM
    elif shape.family == "gpt_oss":
        cfg = transformers.GptOssConfig(**common, intermediate_size=shape.ffn, num_local_experts=shape.experts,
                                        layer_types=["full_attention"])
        cls = transformers.GptOssForCausalLM
    else:
        raise ValueError(f"shape.family: expected 'qwen3_moe' or 'gpt_oss', got {shape.family!r}")
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg)
    return model.to(dtype)  # the constructor ran the family's own init (post_init)


def _grads_fn(module_fn, inputs, params, dy):
    def step():
        out = module_fn()
        return torch.autograd.grad(out, inputs + params, dy)

    return step


def _block_input_in_model(model, block, ids) -> torch.Tensor:
    """The hidden states the model's forward hands ``block``, detached."""
    seen = {}
    hook = block.register_forward_pre_hook(lambda module, args: seen.update(x=args[0].detach().clone()))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        hook.remove()
    return seen["x"]


def _routing_max_over_mean(block, hidden: torch.Tensor, experts: int) -> float:
    """Rows of the busiest expert over the mean rows per expert, for the block's routing of ``hidden``."""
    seen = {}
    hook = block.experts.register_forward_pre_hook(lambda module, args: seen.update(index=args[1].detach()))
    try:
        with torch.no_grad():
            block(hidden)
    finally:
        hook.remove()
    counts = torch.bincount(seen["index"].flatten().clamp(0, experts - 1), minlength=experts).float()
    return float(counts.max() / counts.mean())


def measure(shape: HFModelShape, device: torch.device, rep_ms: int, implementations=("moemlp", "grouped_mm")):
    """Rows of the table for one model shape: one per experts implementation."""
    model = build_model(shape, device)
    block = model.model.layers[0].mlp
    block_params = [p for p in block.parameters() if p.requires_grad]
    model_params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator(device="cpu").manual_seed(1)
    hidden = (torch.randn(1, shape.tokens, shape.hidden, generator=g) * 0.5).to(device, torch.bfloat16)
    hidden.requires_grad_(True)
    dy_block = torch.randn(1, shape.tokens, shape.hidden, generator=g).to(device, torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, shape.tokens), generator=g).to(device)
    dy_logits = torch.randn(1, shape.tokens, VOCAB, generator=g).to(device, torch.bfloat16)
    model.set_experts_implementation(implementations[-1])  # the block's input does not depend on it
    model_hidden = _block_input_in_model(model, block, ids).requires_grad_(True)
    skew = {name: _routing_max_over_mean(block, x, shape.experts)
            for name, x in (("random", hidden), ("model", model_hidden))}

    def block_fn(x):
        def block_out():
            out = block(x)
            return out[0] if isinstance(out, tuple) else out  # gpt-oss's block also returns router scores

        return block_out

    outputs, rows = {}, []
    for impl in implementations:
        model.set_experts_implementation(impl)
        with torch.no_grad():
            outputs[impl] = block_fn(hidden)().float()
        block_ms, block_model_input_ms = (
            median_ms(_grads_fn(block_fn(x), [x], block_params, dy_block), device, rep_ms=rep_ms)
            for x in (hidden, model_hidden)
        )
        model_step = _grads_fn(lambda: model(ids).logits, [], model_params, dy_logits)
        model_ms = median_ms(model_step, device, rep_ms=rep_ms)
        model_gpu_ms = gpu_time_ms(model_step, device)
        rows.append({"model": shape.name, "experts_impl": impl, "tokens": shape.tokens, "H": shape.hidden,
                     "F": shape.ffn, "E": shape.experts, "top_k": shape.top_k,
                     "moe_block_ms": block_ms, "moe_block_expert_tflops": shape.expert_flops() / block_ms / 1e9,
                     "moe_block_model_input_ms": block_model_input_ms, "model_ms": model_ms,
                     "model_gpu_ms": model_gpu_ms,
                     "routing_max_over_mean_random": skew["random"], "routing_max_over_mean_model": skew["model"]})
    base = rows[-1]
    ref = outputs[base["experts_impl"]]
    for row in rows:
        out = outputs[row["experts_impl"]]
        row["block_speedup_vs_" + base["experts_impl"]] = base["moe_block_ms"] / row["moe_block_ms"]
        row["block_model_input_speedup_vs_" + base["experts_impl"]] = (
            base["moe_block_model_input_ms"] / row["moe_block_model_input_ms"]
        )
        row["model_speedup_vs_" + base["experts_impl"]] = base["model_ms"] / row["model_ms"]
        row["model_gpu_speedup_vs_" + base["experts_impl"]] = base["model_gpu_ms"] / row["model_gpu_ms"]
        row["rel_diff_block_out"] = float((out - ref).norm() / ref.norm())
    return rows


def run_hf_bench(args) -> list[dict]:
    """Entry point of ``python -m moemlp bench --hf``; reads args.device, args.backend, args.out,
    args.rep_ms (each optional). Needs transformers (pip install 'moemlp[transformers]')."""
    from ..integrations import transformers as moemlp_hf

    device_arg = getattr(args, "device", None)
    device = torch.device(device_arg) if device_arg else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = getattr(args, "backend", "auto")
    out = getattr(args, "out", "results")
    rep_ms = getattr(args, "rep_ms", 200)
    moemlp_hf.register(backend=backend)
    import transformers

    print(f"transformers models, one decoder layer, on {device_description(device)}, "
          f"transformers {transformers.__version__}")
    rows = []
    for shape in GPU_MODELS if device.type == "cuda" else CPU_MODELS:
        rows.extend(measure(shape, device, rep_ms))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next model's weights (gpt-oss: 6 GB of experts) start clean
    speed_cols = [c for c in rows[0] if c.endswith("_speedup_vs_grouped_mm")]
    print_table(rows, ["model", "experts_impl", "tokens", "moe_block_ms", "moe_block_expert_tflops",
                       "moe_block_model_input_ms", "model_ms", "model_gpu_ms", *speed_cols,
                       "routing_max_over_mean_random", "routing_max_over_mean_model", "rel_diff_block_out"],
                "MoE block and one-layer model, forward + backward (bf16; expert FLOPs 18·tokens·k·H·F)")
    path = os.path.join(out, "hf_bench.csv")
    write_csv(path, rows)
    print(f"wrote {path}")
    return rows
