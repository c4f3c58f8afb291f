"""mxfp8 and nvfp4 dequantized in the grouped GEMM's load path (kernels/_grouped_gemm.py: A_DQ, B_DQ).

The kernel reads the quantizer's codes and block-scale codes and forms code·block_scale in bf16 as it
loads each tile; a ``quantize.dequantized*`` pass stores the same bf16 values first. The values are
the same bits either way (both exact products, SPEC §3), so with the same tile config the GEMM
results must be the same bits too. Checked here:

* one launch, both ways, for each recipe, both weight orientations (the forward's K-major B and the
  dgrad's N-major B, nvfp4 packed along K in each), K with a partial block, an empty expert, and a
  NaN in A (its row is NaN both ways);
* the whole MLP forward + backward with the load path on and off (``_operands.LOAD_PATH_*``): y and
  every gradient the same bits;
* the launcher's checks.

On a CPU-only machine the kernel cases run under TRITON_INTERPRET=1 in a child pytest
(tests/_triton_env.py).
"""

from __future__ import annotations

import pytest
import torch

import _triton_env
from moemlp import kernels as K
from moemlp._config import MLPConfig
from moemlp.kernels import _grouped_gemm as gg
from moemlp.kernels import _operands
from moemlp.kernels import quantize as kq
from moemlp.recipes import from_key
from test_triton_backend import GRADS, make

interpreted = pytest.mark.skipif(
    not _triton_env.RUN_CPU_CASES,
    reason="CPU cases: run under TRITON_INTERPRET=1 in the child of test_cpu_cases_under_interpreter",
)

RECIPES = ["mxfp8", "nvfp4:hadamard=0,stochastic_rounding=0", "nvfp4:hadamard=1,stochastic_rounding=1"]


@pytest.mark.skipif(not _triton_env.START_CHILD, reason="runs the CPU cases in a child on a CPU-only machine")
def test_cpu_cases_under_interpreter():
    _triton_env.run_file_interpreted(__file__)


@pytest.fixture
def load_path():
    """Set _operands.LOAD_PATH_ACT / LOAD_PATH_WEIGHT for a block, restored after the test."""
    saved = _operands.LOAD_PATH_ACT, _operands.LOAD_PATH_WEIGHT

    def set_(on: bool):
        _operands.LOAD_PATH_ACT = _operands.LOAD_PATH_WEIGHT = on

    yield set_
    _operands.LOAD_PATH_ACT, _operands.LOAD_PATH_WEIGHT = saved


def _launch(a, weight, orientation, recipe, splits, N, K, config):
    ao = _operands.act(a, recipe)
    bo = weight.forward() if orientation == "forward" else weight.dgrad()
    out = torch.full((a.shape[0], N), 7.0, dtype=torch.float32, device=a.device)
    kwargs = _operands.gemm_kwargs(ao, bo)
    gg.launch_grouped_gemm(
        gg.FC2.value, ao.a, bo.b, bo.strides, splits, None, None, out, None, None, None,
        N=N, K=K, N1=N, cfg=None, scale_bias=False, store_z=False, store_partial=False, config=config, **kwargs,
    )  # fmt: skip
    return out, kwargs


def check_one_launch(key, orientation, Kdim, device, config):
    torch.manual_seed(Kdim)
    r = from_key(key)
    E, N, M = 3, 40, 50
    splits = torch.tensor([20, 0, 25], device=device)  # 5 capacity rows at the end
    a = torch.randn(M, Kdim, device=device)  # fp32, as z and g_h reach FC2 and FC1_DGRAD
    a[3, 5] = float("nan")
    shape = (E, N, Kdim) if orientation == "forward" else (E, Kdim, N)
    w = _operands.Weight(torch.randn(shape, device=device).bfloat16(), r)
    _operands.LOAD_PATH_ACT = _operands.LOAD_PATH_WEIGHT = False
    ref, ref_kwargs = _launch(a, w, orientation, r, splits, N, Kdim, config)
    _operands.LOAD_PATH_ACT = _operands.LOAD_PATH_WEIGHT = True
    out, kwargs = _launch(a, w, orientation, r, splits, N, Kdim, config)
    assert "dequant" not in ref_kwargs and kwargs["dequant"] == (kq.recipe_id(r),) * 2
    assert ref[:45].abs().nan_to_num().max() > 1.0  # a real product, not zeros
    assert ref[3].isnan().all() and not ref[[0, 1, 2, 4]].isnan().any()  # row 3's NaN block, only it
    assert (ref[45:] == 0).all()  # capacity rows written with zeros
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)


def _configs(device):
    if device == "cpu":
        return [gg.GemmConfig(16, 16, 32, 4, 1, GROUP_M=4)]
    return [gg.GemmConfig(128, 256, 64, 8, 3), gg.GemmConfig(64, 64, 32, 4, 2)]


@interpreted
@pytest.mark.parametrize("key", RECIPES[:2])
@pytest.mark.parametrize("orientation", ["forward", "dgrad"])
@pytest.mark.parametrize("Kdim", [80, 33])
def test_cpu_one_launch_is_the_bits_of_the_dequantize_pass(key, orientation, Kdim, load_path):
    for config in _configs("cpu"):
        check_one_launch(key, orientation, Kdim, "cpu", config)


@pytest.mark.gpu
@pytest.mark.parametrize("key", RECIPES[:2])
@pytest.mark.parametrize("orientation", ["forward", "dgrad"])
@pytest.mark.parametrize("Kdim", [80, 33, 1024])
def test_gpu_one_launch_is_the_bits_of_the_dequantize_pass(key, orientation, Kdim, load_path):
    for config in _configs("cuda"):
        check_one_launch(key, orientation, Kdim, "cuda", config)


def _with_recipe(cfg, key):
    return MLPConfig(cfg.activation, cfg.activation_params, cfg.glu_interleave, cfg.scale_fc2_bias, from_key(key))


def check_mlp(key, device, load_path):
    # GLU with partial tiles, an empty expert, capacity rows and biases (W1 (4, 96, 160), W2 (4, 160, 48))
    t, cfg = make((20, 0, 17, 23), 160, 48, M=70, scale_fc2_bias=True)
    t = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in t.items()}
    cfg = _with_recipe(cfg, key)
    args = (t["splits"], t["probs"], t["fc1_weight"], t["fc2_weight"], t["fc1_bias"], t["fc2_bias"])
    results = []
    for on in (False, True):
        load_path(on)
        y, h = K.grouped_mlp_fwd(t["x"], *args, cfg)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(device, y.dtype)
        grads = K.grouped_mlp_bwd(dy, t["x"], h, *args, cfg, needs=(True,) * 6)
        results.append((y, h) + tuple(grads))
    names = ("y", "h") + GRADS
    for name, off, on in zip(names, *results):
        if off is None:
            assert on is None, name
            continue
        assert off.abs().max() > 0, name
        torch.testing.assert_close(on, off, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


@interpreted
@pytest.mark.parametrize("key", RECIPES)
def test_cpu_mlp_is_the_bits_of_the_dequantize_pass(key, load_path):
    check_mlp(key, "cpu", load_path)


@pytest.mark.gpu
@pytest.mark.parametrize("key", RECIPES)
def test_gpu_mlp_is_the_bits_of_the_dequantize_pass(key, load_path):
    check_mlp(key, "cuda", load_path)


def test_launcher_wants_the_scales_of_a_decoded_operand():
    a = torch.zeros(4, 32, dtype=torch.uint8)
    b = torch.zeros(1, 8, 32, dtype=torch.uint8)
    out = torch.zeros(4, 8)
    splits = torch.tensor([4])
    common = dict(N=8, K=32, N1=8, cfg=None, scale_bias=False, store_z=False, store_partial=False)
    with pytest.raises(ValueError, match="needs its block scales"):
        gg.launch_grouped_gemm(gg.FC2.value, a, b, (256, 32, 1), splits, None, None, out, None, None, None,
                               config=gg.GemmConfig(16, 16, 32, 4, 1), dequant=(1, 1), **common)  # fmt: skip
    with pytest.raises(ValueError, match="whole scale blocks"):
        gg.launch_grouped_gemm(gg.FC2.value, a, b, (256, 32, 1), splits, None, None, out, None, None, None,
                               config=gg.GemmConfig(16, 16, 16, 4, 1), dequant=(1, 0),
                               a_scales=torch.zeros(4, 1, dtype=torch.uint8), **common)  # fmt: skip


@pytest.mark.parametrize("dq", [1, 2])
@pytest.mark.parametrize("epilogue,glu,kind,kmajor", [(0, True, "fc1", True), (3, False, "fc1_dgrad", False)])
def test_compiles_for_hopper(dq, epilogue, glu, kind, kmajor):
    # Offline sm_90 compile (no GPU needed) of the load-path mainloop at the bf16 configs, both weight
    # orientations: the decoded operands feed bf16 wgmma. No spill assertion: FC1 with a GLU spills
    # (77 local loads mxfp8, 134 nvfp4; triton 3.9, 2026-11-30), one reason the path is off.
    import re

    import _sm90

    if gg.INTERPRET:
        pytest.skip("the interpreter's configs")
    cfg = gg.default_config(kind, 4096, 4096, glu, 2)
    const = dict(
        EPILOGUE=epilogue, ACT=3 if glu else 0, GLU=glu, HAS_PROBS=True, HAS_BIAS=False, SCALE_BIAS=False,
        STORE_Z=epilogue == 0, STORE_PARTIAL=False, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M,
        E_BLOCK=16, INTERPRETED=False, DOT_PRECISION="tf32", USE_TMA=False, B_KMAJOR=kmajor, SUBTILE=cfg.SUBTILE,
        PROMOTE=False, FP8=False, ACC_SCALE=dq == 2, B_SCALE_SCALAR=False, QUANT_G=False, QUANT_Z=False, POW2=False,
        A_DQ=dq, B_DQ=dq,
    )  # fmt: skip
    ptr = {"a_ptr": "*u8", "b_ptr": "*u8", "a_scale_ptr": "*u8", "b_scale_ptr": "*u8", "out_ptr": "*bf16",
           "z_ptr": "*fp32", "h_ptr": "*bf16", "splits_ptr": "*i64", "bias_ptr": "*bf16"}  # fmt: skip
    ptx, _, _ = _sm90.compile_sm90(gg._grouped_gemm_kernel, const, ptr, None, cfg.num_warps, cfg.num_stages)
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16", ptx)
