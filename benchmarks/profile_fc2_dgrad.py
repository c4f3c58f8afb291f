"""FC2_DGRAD for Nsight Compute at one model shape: the engine's fused kernel, the Triton kernel and
the engine's plain bf16 GEMM on the same operands, each launched twice (the first compiles; ncu
skips it). The profile in docs/DECISIONS.md ("What holds the engine's FC2_DGRAD") came from

    PYTHONPATH=src ncu --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section WarpStateStats \
        -k regex:"fc2_dgrad_kernel|grouped_gemm_kernel" --launch-skip 3 --launch-count 3 \
        python3 benchmarks/profile_fc2_dgrad.py deepseek-v3-ep8
"""

import sys

import torch

from moemlp._config import MLPConfig
from moemlp.activations import ACTIVATIONS
from moemlp.bench.common import GPU_SHAPES, routed_problem
from moemlp.kernels import gluon, operands
from moemlp.kernels.gemm import launch

shape = GPU_SHAPES[sys.argv[1]]
dev = torch.device("cuda")
x, splits, probs, w1, w2, dy = routed_problem(shape, dev)
M, H, F = shape.rows, shape.hidden, shape.ffn
h = torch.randn(M, 2 * F, device=dev).to(torch.bfloat16)  # a stand-in for the forward's stored h
g_h = torch.empty_like(h)
z = torch.empty(M, F, device=dev, dtype=torch.bfloat16)
cfg = MLPConfig(ACTIVATIONS["swiglu"], (), F, False)
(W2,) = operands.weights((w2,), None)
for _ in range(2):
    gluon.fc2_dgrad(dy, w2, splits, h, g_h, z=z, probs=probs, dprobs_partials=True, glu_interleave=F,
                    activation_id=0, params=(0.0, 0.0, 0.0))
    launch.launch_grouped_gemm("fc2_dgrad", a=dy, b=W2.dgrad().b, b_strides=W2.dgrad().strides, splits=splits,
                               out=g_h, N=F, K=H, N1=2 * F, cfg=cfg, probs=probs, z=z, h=h, dprobs_partials=True)
    gluon.grouped_gemm(dy, w2, splits, b_layout="kn")
torch.cuda.synchronize()
print("done")
