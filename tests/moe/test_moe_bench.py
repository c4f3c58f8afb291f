"""python -m moemlp bench --moe on the CPU: one-process and 2-process (gloo) rows with the phase shares,
the lean torch layer beside the one-process rows and the all-to-all columns, CSV written; the lean
layer's y and gradients against the MoE's; the --ep argument's parsing."""

import argparse
import csv
import math

import pytest
import torch

from moemlp.bench.moe import DEFAULT_EP, LEAN_TOLERANCE, _check_lean, run_moe_bench
from moemlp.bench.peers import LeanMoE
from moemlp.moe import MoE


@pytest.mark.long(seconds=190)
def test_moe_bench_cpu(tmp_path, capsys):
    rows = run_moe_bench(argparse.Namespace(device="cpu", backend="torch", out=str(tmp_path), ep=[1, 2]))
    assert [r["ep"] for r in rows] == [1, 1, 2]
    written = list(csv.DictReader(open(tmp_path / "moe_bench.csv")))
    assert len(written) == 3
    for r in written:
        assert float(r["layer_ms"]) > 0 and float(r["tokens_per_s"]) > 0 and float(r["tflops"]) > 0
        phases = ("dispatch", "experts", "combine") + (("shared",) if r["shared_pct"] else ())
        shares = [float(r[f"{p}_pct"]) for p in phases]
        assert all(s > 0 for s in shares) and sum(shares) == pytest.approx(100.0)
        # Every routed row of this rank is processed by some expert: T·k rows in total over ranks.
        assert int(r["expert_rows"]) > 0
    one, features, two = written
    # The DeepSeek-V3 layer features: a shared expert's share of the phases, the same routed rows.
    assert features["shape"] == "cpu-small+shared+groups" and float(features["shared_pct"]) > 0
    assert int(features["expert_rows"]) == 256 * 2 and one["shared_pct"] == ""
    assert int(one["expert_rows"]) == 256 * 2  # one process: all T·k rows are local
    assert int(one["E"]) == 4 and int(two["E"]) == 8  # 4 experts per rank at every world size
    assert one["a2a_ms"] == ""  # no all-to-all on one process
    # The layer's exchange sends every routed row of rank 0 once: T·k rows of H bf16 values.
    assert float(two["a2a_MB"]) == pytest.approx(256 * 2 * 256 * 2 / 1e6)
    for key in ("a2a_ms", "a2a_busbw_GBps", "dist_a2a_ms", "dist_busbw_GBps", "a2a_pct"):
        assert float(two[key]) > 0, key
    assert two["backend"] == "gloo"
    # The lean torch layer beside both one-process rows, checked against the layer's y before timing.
    for r in (one, features):
        lean_ms, speedup, err = float(r["lean_layer_ms"]), float(r["speedup"]), float(r["lean_max_err"])
        assert lean_ms > 0 and math.isfinite(speedup) and speedup > 0
        assert speedup == pytest.approx(lean_ms / float(r["layer_ms"]))
        assert 0 <= err <= LEAN_TOLERANCE
    assert two["lean_layer_ms"] == two["speedup"] == two["lean_max_err"] == ""  # no peer with EP
    # GPU time (queue preloaded) is one-device only and NaN off a GPU: never a host time in its place.
    for r in (one, features):
        for key in ("layer_gpu_ms", "lean_layer_gpu_ms", "speedup_gpu", "dispatch_gpu_pct", "experts_gpu_pct"):
            assert math.isnan(float(r[key])), key
    assert two["layer_gpu_ms"] == two["dispatch_gpu_pct"] == ""
    out = capsys.readouterr().out
    assert "dist_busbw_GBps" in out
    # The layer's table comes last, with the peer and the phases.
    last_table = out[out.rindex("MoE layer forward + backward"):]
    for column in ("layer_ms", "lean_layer_ms", "speedup", "dispatch_pct", "experts_pct", "combine_pct",
                   "shared_pct", "lean_max_err"):
        assert column in last_table, column


# The two one-device layers of bench --moe at a tiny shape: without and with DeepSeek-V3's features.
LEAN_CASES = {
    "plain": {},
    "shared+groups+scaling": dict(num_shared_experts=1, num_groups=2, topk_groups=1, routed_scaling_factor=2.5),
}


@pytest.mark.parametrize("features", LEAN_CASES.values(), ids=LEAN_CASES.keys())
def test_lean_moe_matches_moe(features):
    """LeanMoE.from_moe computes the MoE's function: y within the bench's tolerance, and every
    gradient (x, router, expert and shared weights) within bf16 error of the MoE's."""
    torch.manual_seed(0)
    moe = MoE(hidden_size=64, ffn_hidden_size=32, num_experts=8, top_k=2, score="sigmoid", expert_bias=True,
              aux_loss_coeff=1e-4, backend="torch", dtype=torch.bfloat16, **features)
    lean = LeanMoE.from_moe(moe)
    x = torch.randn(48, 64).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(48, 64).to(torch.bfloat16)
    assert _check_lean(moe, lean, x.detach()) <= LEAN_TOLERANCE
    moe_params = [x, moe.router.weight, moe.experts.fc1_weight, moe.experts.fc2_weight]
    lean_params = [x, lean.router.weight, lean.fc1_weight, lean.fc2_weight]
    if moe.shared_experts is not None:
        moe_params += [moe.shared_experts.fc1_weight, moe.shared_experts.fc2_weight]
        lean_params += [lean.shared_fc1_weight, lean.shared_fc2_weight]
    for got, want, name in zip(torch.autograd.grad(lean(x), lean_params, dy),
                               torch.autograd.grad(moe(x), moe_params, dy),
                               ("x", "router", "fc1", "fc2", "shared fc1", "shared fc2")):
        got, want = got.double(), want.double()
        # bf16 intermediates on the lean side (h, silu·up, probs): a few ulps of the largest gradient.
        assert (got - want).abs().max() <= LEAN_TOLERANCE * want.abs().max(), name


def test_lean_check_fails_loudly():
    """A peer that computes another function (one expert's weight changed) stops the bench."""
    torch.manual_seed(0)
    moe = MoE(hidden_size=64, ffn_hidden_size=32, num_experts=4, top_k=2, backend="torch", dtype=torch.bfloat16)
    lean = LeanMoE.from_moe(moe)
    with torch.no_grad():
        lean.fc2_weight[1] *= 2
    with pytest.raises(RuntimeError, match="no longer computes the same function"):
        _check_lean(moe, lean, torch.randn(32, 64).to(torch.bfloat16))


def test_ep_argument(capsys, monkeypatch, tmp_path):
    """The CLI's --ep: parsed by ep_sizes, DEFAULT_EP when left out, bad lists refused."""
    from moemlp import __main__ as cli
    from moemlp.bench import moe as moe_bench

    seen = []
    monkeypatch.setattr(moe_bench, "run_moe_bench", lambda args: seen.append(args.ep))
    argv = ["bench", "--moe", "--device", "cpu", "--out", str(tmp_path)]
    for extra, want in (([], DEFAULT_EP), (["--ep", "1,2,4,8"], [1, 2, 4, 8]), (["--ep", "2,2,1"], [2, 1])):
        assert cli.main(argv + extra) == 0
        assert seen.pop() == want
    assert DEFAULT_EP == [1, 2]
    for bad in ("", "0", "1,x", "-2"):
        with pytest.raises(SystemExit):
            cli.main(argv + ["--ep", bad])
        assert "expected comma-separated positive ints" in capsys.readouterr().err
