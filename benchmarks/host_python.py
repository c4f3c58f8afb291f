"""The Python time of one grouped-MLP forward + backward on the Triton backend, without a GPU: the
validation, the custom ops, autograd and the kernel layers, with every kernel launch replaced by
nothing (``kernels/_launcher.launch``), under TRITON_INTERPRET=1 on CPU tensors.

    PYTHONPATH=src python3 benchmarks/host_python.py [--shape qwen3-30b-a3b] [--recipes bf16,fp8_block_wcache]

It takes the Triton kernels' launchers (the engine's need CUDA) and CPU allocations, so it tells a
change of the shared Python apart on any machine; the host time a GPU step takes is
``profile_host.py``'s. Medians of 5 windows of 50 steps, µs a step.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["TRITON_INTERPRET"] = "1"  # before moemlp.kernels is imported: the Triton backend on CPU tensors


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--recipes", default="bf16,fp8_block_wcache")
    p.add_argument("--tokens", type=int, default=512, help="tokens of the problem (its tensors are allocated, not read)")
    args = p.parse_args()

    from moemlp.bench.kernels import mlp_step
    from moemlp.kernels.gemm import launch as gemm_launch
    from moemlp.kernels.gluon import _launch as gluon_launch
    from moemlp.kernels.quant import api as quant_api

    for module in (gluon_launch, gemm_launch, quant_api):
        module.launch = lambda kernel, grid, *args, **kw: None
    print(f"{'recipe':18s} {'µs a step':>10s}")
    for name in args.recipes.split(","):
        cached = name == "fp8_block_wcache"
        recipe = None if name == "bf16" else "fp8_block" if cached else name
        step = mlp_step(args.shape, recipe, cached, device="cpu", tokens=args.tokens, backend="triton")
        for _ in range(5):
            step()
        windows = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(50):
                step()
            windows.append((time.perf_counter() - t0) / 50 * 1e6)
        print(f"{name:18s} {sorted(windows)[2]:10.1f}", flush=True)


if __name__ == "__main__":
    main()
