"""Tile tables of the grouped GEMMs: one ``GemmConfig`` per launch kind ("fc1", "fc2", "fc2_dgrad",
"fc1_dgrad", "wgrad"), for the H200 (each checked with ptxas: no spills; measurements in
benchmarks/NOTES.md) and for the interpreter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import triton

from .common import INTERPRET


@dataclass(frozen=True)
class GemmConfig:
    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int
    GROUP_M: int = 8
    SUBTILE: int = 1  # epilogue column chunks, a power of two
    PROMOTE: bool | None = None  # fp32 adds of BK-deep products; None: when dprobs partials are stored
    USE_TMA: bool | None = None  # None: TMA where the operands allow it (16-byte aligned rows)


def default_config(kind: str, N: int, K: int, glu: bool, elem_bytes: int = 2, fp8: bool = False) -> GemmConfig:
    """Tile shapes for the H200, checked with ptxas (no spills); measurements in benchmarks/NOTES.md.

    Under the interpreter every program runs in numpy: 16-row tiles keep the CPU suite fast (16 is
    tl.dot's smallest side), with the same epilogue chunking as on the GPU so that code runs too."""
    if fp8:
        return fp8_config(kind, glu)
    if kind == "fc1" and glu:
        # Two 128×128 fp32 accumulators (gate, up) = one 128×256 tile, 128 registers per thread at
        # 8 warps; the epilogue in 4 chunks of 32 columns fits in the rest (254 registers, no
        # spills; 2 chunks spilled 55 local loads).
        # 3 stages beat 4 on mixtral (596 vs 565 TFLOP/s) and deepseek (616 vs 596), lost 2.5% on qwen3.
        gpu = GemmConfig(128, 128, 64, 8, 3, SUBTILE=4)
    elif kind == "fc1":
        gpu = GemmConfig(128, 128, 64, 8, 4, SUBTILE=2)
    elif kind == "fc2_dgrad":
        # The epilogue holds g_z, h gate/up, a, act' at once, and PROMOTE a second accumulator in
        # the loop: 8 chunks of 16 columns compile without spills (238 registers; 4 chunks: 11
        # local loads; 128×256 spills at any chunking). With PROMOTE: 8 chunks
        # 1-4% faster than 4; 3 stages 8-11% slower than 4; h loaded before the K loop (91 local
        # loads) -6% to +5%, not kept.
        gpu = GemmConfig(128, 128, 64, 8, 4, SUBTILE=8)
    elif kind == "wgrad":
        # Pointer loads: 128×256 at 3 stages beat 128×128 at 4 by 16-27% on all four model shapes.
        gpu = GemmConfig(128, 256, 64, 8, 3)
    else:
        # FC2 and FC1_DGRAD: plain epilogues; 128×256 is Hopper's usual best bf16 tile (202 regs).
        gpu = GemmConfig(128, 256, 64, 8, 3)
    if INTERPRET:
        return GemmConfig(16, 32 if gpu.SUBTILE > 1 else 16, 16, 4, 1, GROUP_M=4, SUBTILE=min(gpu.SUBTILE, 4))
    if elem_bytes == 4:
        # fp32 operands double every stage: 128×256 tiles at BK 64 and 3 stages would need 288 KiB of
        # shared memory (H200: 227 KiB per block, the launch fails). BK 32 and 2 stages:
        # (128 + 256)·32·4·2 = 96 KiB.
        return dataclasses.replace(gpu, BK=32, num_stages=min(gpu.num_stages, 2))
    return gpu


def fp8_config(kind: str, glu: bool) -> GemmConfig:
    """fp8_block (FP8 mode): BK = 128, one scale block per K step. The promotion keeps each step's
    product in registers next to the accumulator, so a tile holds twice the fp32 values of a bf16
    one: FC1 with a GLU takes 64 columns of gate and of up (128×128 fp32 in all, as the others).
    128×128, 8 warps, 4 stages was the best of the forward GEMM's sweep; 64×128 at 4 warps and 3/5
    stages were 1-6% slower (benchmarks/NOTES.md, "fp8_block GEMM")."""
    if kind == "fc1" and glu:
        gpu = GemmConfig(128, 64, 128, 8, 4, SUBTILE=2)
    elif kind == "fc1":
        gpu = GemmConfig(128, 128, 128, 8, 4, SUBTILE=2)
    elif kind == "fc2_dgrad":
        gpu = GemmConfig(128, 128, 128, 8, 4, SUBTILE=8)
    else:
        gpu = GemmConfig(128, 128, 128, 8, 4)
    if INTERPRET:
        return GemmConfig(16, 32 if gpu.SUBTILE > 1 else 16, 128, 4, 1, GROUP_M=4, SUBTILE=min(gpu.SUBTILE, 4))
    return gpu


def dprobs_parts(config: GemmConfig, N: int) -> int:
    """Rows of FC2_DGRAD's dprobs partials: one per N tile of F columns."""
    return triton.cdiv(N, config.BN)
