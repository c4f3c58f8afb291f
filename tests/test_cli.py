"""python -m moemlp bench / precision on the CPU: tables, CSV and PNG written, numbers sane, and the
command line's own errors."""

import csv
import math
import re
import time

import pytest
import torch

from moemlp.__main__ import main


@pytest.mark.long(seconds=70)
def test_bench_cpu(tmp_path, capsys):
    assert main(["bench", "--device", "cpu", "--backend", "torch", "--shape", "cpu-small", "--peers", "lean,te",
                 "--out", str(tmp_path), "--rep-ms", "20"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "bench.csv")))
    assert [r["shape"] for r in rows] == ["cpu-small"]
    r = rows[0]
    assert r["backend"] == "torch"
    for impl in ("moemlp", "lean", "te"):
        assert float(r[f"{impl}_fwdbwd_tflops"]) > 0 and int(r[f"{impl}_fwdbwd_n"]) >= 5
        assert float(r[f"{impl}_fwdbwd_spread"]) >= 0
    assert float(r["rel_diff_y_lean"]) < 2e-2 and float(r["rel_diff_y_te"]) < 2e-2
    assert float(r["vs_lean_fwdbwd"]) == pytest.approx(float(r["lean_fwdbwd_ms"]) / float(r["moemlp_fwdbwd_ms"]))
    # GPU time (the host's launch time hidden) has no meaning off a GPU: NaN, never a number.
    assert math.isnan(float(r["moemlp_fwdbwd_gpu_ms"])) and math.isnan(float(r["vs_lean_fwdbwd_gpu"]))
    # The fused design keeps bf16 h (2·2F bytes) + fp32 probs per row; the TE-like composition ~2.5× more.
    F = int(r["F"])
    assert float(r["moemlp_saved_bytes_per_row"]) <= 2 * 2 * F + 4
    assert float(r["te_saved_bytes_per_row"]) > 2 * float(r["moemlp_saved_bytes_per_row"])
    assert float(r["lean_saved_bytes_per_row"]) > float(r["moemlp_saved_bytes_per_row"])
    assert (tmp_path / "bench.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "backend=torch (runs: torch)" in out and "vs_lean_fwdbwd" in out and "p90 − p10" in out


@pytest.mark.long(seconds=70)
def test_bench_compiled_peer_cpu(tmp_path):
    # The peer a torchtitan user runs: the lean composition under torch.compile, same numbers.
    assert main(["bench", "--device", "cpu", "--shape", "cpu-fine", "--peers", "compiled", "--out", str(tmp_path),
                 "--rep-ms", "10"]) == 0
    (r,) = list(csv.DictReader(open(tmp_path / "bench.csv")))
    assert float(r["rel_diff_y_compiled"]) < 2e-2 and float(r["compiled_fwdbwd_ms"]) > 0


@pytest.mark.long(seconds=60)
def test_bench_compiled_peer_compiles_every_shape(tmp_path, monkeypatch):
    # Each shape compiles two graphs (grad mode off for the sanity check, on for the timing). With the
    # limit at 2 the second shape fits only if it starts a fresh budget: a shared one would have
    # timed the eager composition under the "compiled" label (a 6-shape GPU run once did).
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    assert main(["bench", "--device", "cpu", "--shape", "cpu-fine", "--shape", "cpu-small", "--peers", "compiled",
                 "--out", str(tmp_path), "--rep-ms", "5"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "bench.csv")))
    assert [r["shape"] for r in rows] == ["cpu-fine", "cpu-small"]
    # Past the limit the bench stops with the shape's name rather than time an eager peer.
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    with pytest.raises(RuntimeError, match="cpu-fine: the compiled peer went past torch._dynamo's recompile limit"):
        main(["bench", "--device", "cpu", "--shape", "cpu-fine", "--peers", "compiled", "--out", str(tmp_path / "b"),
              "--rep-ms", "5"])


def test_precision_cpu_every_shape_given(tmp_path, capsys):
    assert main(["precision", "--device", "cpu", "--backend", "torch", "--shape", "cpu-small", "--shape", "cpu-fine",
                 "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "precision.csv")))
    assert sorted({r["shape"] for r in rows}) == ["cpu-fine", "cpu-small"]  # both, not the first alone
    for shape in ("cpu-small", "cpu-fine"):
        ours = next(r for r in rows if r["shape"] == shape and r["impl"] == "moemlp (torch)")
        lean = next(r for r in rows if r["shape"] == shape and r["impl"].startswith("lean"))
        assert float(ours["dprobs|h"]) <= 1e-6  # SPEC §1's bound
        assert float(ours["dprobs e2e"]) < 1e-4
        assert float(lean["dprobs e2e"]) > 1e-4  # bf16 probs and products: ~1e-3
        assert 0 <= float(ours["h mismatch"]) < 1e-2
        assert ours["dprobs dtype"] == "float32"
    assert "contract (SPEC §1)" in capsys.readouterr().out


def test_bench_recipes_cpu(tmp_path, capsys):
    assert main(["bench", "--recipes", "--device", "cpu", "--backend", "torch", "--shape", "cpu-small",
                 "--out", str(tmp_path), "--rep-ms", "20"]) == 0
    (r,) = list(csv.DictReader(open(tmp_path / "bench_recipes.csv")))
    assert r["shape"] == "cpu-small" and float(r["bf16_fwdbwd_ms"]) > 0
    for name, floor in (("fp8_block", 20.0), ("mxfp8", 20.0), ("nvfp4", 8.0)):
        assert float(r[f"{name}_fwdbwd_ms"]) > 0 and float(r[f"{name}_speedup_fwdbwd"]) > 0
        assert float(r[f"{name}_snr_db"]) >= floor, (name, r[f"{name}_snr_db"])
    assert "fp8_block_speedup_fwdbwd" in capsys.readouterr().out
    assert math.isnan(float(r["bf16_fwdbwd_gpu_ms"]))  # no GPU time off a GPU


@pytest.mark.gpu
def test_bench_recipes_gpu(tmp_path, capsys):
    """bench --recipes on the GPU: every variant, the weight-cached ones too, with a GPU time beside its
    wall time and the speedup of each over bf16's GPU time."""
    assert main(["bench", "--recipes", "--shape", "cpu-small", "--out", str(tmp_path), "--rep-ms", "10"]) == 0
    (r,) = list(csv.DictReader(open(tmp_path / "bench_recipes.csv")))
    bf16_gpu = float(r["bf16_fwdbwd_gpu_ms"])
    assert 0 < bf16_gpu
    for label in ("fp8_block", "mxfp8", "nvfp4", "fp8_block_wcache", "mxfp8_wcache", "nvfp4_wcache"):
        gpu = float(r[f"{label}_fwdbwd_gpu_ms"])
        assert 0 < gpu and float(r[f"{label}_fwdbwd_ms"]) > 0, label
        assert float(r[f"{label}_speedup_fwdbwd_gpu"]) == pytest.approx(bf16_gpu / gpu, rel=1e-9), label
    assert "fp8_block_speedup_fwdbwd_gpu" in capsys.readouterr().out


def test_unknown_shape_lists_the_choices(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--shape", "mixtral"])
    err = capsys.readouterr().err
    assert "mixtral-8x7b" in err and "cpu-small" in err


def test_own_shape_and_skewed_routing(tmp_path):
    """--shape H,F,E,TOP_K,TOKENS[:SKEW]: the bench runs the user's shape, and a skew routes expert e
    with weight (e + 1)^-SKEW (rows fall with the expert's index); 0 keeps the uniform draw."""
    from moemlp.bench.common import CPU_SHAPES, Shape, parse_shape, routed_problem

    s = parse_shape("64,32,8,2,4096:1.5")
    assert s == Shape("h64-f32-e8-k2-t4096-skew1.5", 64, 32, 8, 2, 4096, 1.5)
    splits = routed_problem(s, "cpu")[1]
    assert int(splits.sum()) == 8192
    assert splits.tolist() == sorted(splits.tolist(), reverse=True) and splits[0] > 3 * splits[-1]
    even = routed_problem(parse_shape("64,32,8,2,4096"), "cpu")[1]
    assert int(even.max() - even.min()) < 0.1 * 1024
    # the named shapes keep their routing (the README's figures): the uniform draw unchanged
    assert routed_problem(CPU_SHAPES["cpu-small"], "cpu")[1].tolist() == [53, 54, 58, 68, 71, 73, 67, 68]
    assert main(["bench", "--device", "cpu", "--backend", "torch", "--shape", "128,64,16,1,64:0.5", "--peers",
                 "lean", "--out", str(tmp_path), "--rep-ms", "5"]) == 0  # fmt: skip
    (r,) = list(csv.DictReader(open(tmp_path / "bench.csv")))
    assert (r["shape"], r["H"], r["F"], r["E"], r["top_k"], r["tokens"]) == ("h128-f64-e16-k1-t64-skew0.5", "128",
                                                                              "64", "16", "1", "64")


@pytest.mark.parametrize(
    "spec, words",
    [
        ("1,2,3", "5 integers"),
        ("8,8,4,2,x", "integer sizes"),
        ("8,0,4,2,8", "F must be at least 1"),
        ("8,8,4,5,8", r"TOP_K \(5\) cannot exceed E \(4\)"),
        ("8,8,4,2,8:x", "SKEW must be a number"),
        ("8,8,4,2,8:-1", r"SKEW must lie in \[0, 16\]"),
        ("8,8,4,2,8:nan", r"SKEW must lie in \[0, 16\]"),
    ],
)
def test_own_shape_errors(spec, words, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--device", "cpu", "--shape", spec])
    assert re.search(words, capsys.readouterr().err)


@pytest.mark.parametrize("flag", ["--moe", "--hf"])
def test_shape_refused_where_the_bench_has_its_own(flag, capsys):
    with pytest.raises(SystemExit):
        main(["bench", flag, "--device", "cpu", "--shape", "cpu-small"])
    assert f"{flag} runs its own model shapes" in capsys.readouterr().err


def test_gpu_shape_on_cpu_is_refused_at_once():
    with pytest.raises(SystemExit, match="cpu-small"):
        main(["bench", "--device", "cpu", "--shape", "mixtral-8x7b"])
    with pytest.raises(SystemExit, match="TFLOP"):
        main(["precision", "--device", "cpu", "--shape", "deepseek-v3-ep8"])


def test_unknown_peer_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--peers", "lean,cublas"])
    assert "cublas" in capsys.readouterr().err


@pytest.mark.parametrize("recipes", [[], ["--recipes"]], ids=["bf16", "fp8_block"])
def test_bench_parts_needs_the_triton_backend(tmp_path, monkeypatch, recipes):
    # On a CPU outside the interpreter the Triton launches cannot run: a clear refusal, not a crash.
    from moemlp import kernels

    monkeypatch.setattr(kernels, "is_available", lambda device: False)
    monkeypatch.setattr(kernels, "unavailable_reason", lambda device: "no GPU and TRITON_INTERPRET unset")
    with pytest.raises(SystemExit, match="bench --parts times the Triton backend's launches.*no GPU"):
        main(["bench", "--parts", *recipes, "--device", "cpu", "--shape", "cpu-fine", "--out", str(tmp_path)])


def test_parts_min_bytes():
    """The parts table's memory bound counts each operand once, each output once and every expert's
    weights: at gpt-oss's shape FC1's weights are 4.25 of its 4.62 GB."""
    from moemlp.bench.parts import GEMMS, min_bytes

    M, H, F, E = 16384, 2880, 2880, 128
    assert min_bytes("fc1", M, H, F, E) == 2 * (M * H + E * 2 * F * H + M * 2 * F + M * F) + 4 * M
    assert min_bytes("fc1", M, H, F, E) == 4_624_285_696
    assert min_bytes("fc2_dgrad", M, H, F, E) == 2 * (M * H + E * H * F + 4 * M * F + M * F) + 8 * M
    assert min_bytes("fc2_dgrad", M, H, F, E, probs=False) == 2 * (M * H + E * H * F + 5 * M * F)
    assert min_bytes("fc1_wgrad", 8, 4, 2, 3, elem=4) == 4 * (8 * 4 + 8 * 4 + 3 * 4 * 4)
    assert [min_bytes(g, 1, 1, 1, 1) > 0 for g in GEMMS] == [True] * 6
    with pytest.raises(ValueError, match="unknown GEMM 'fc3'"):
        min_bytes("fc3", M, H, F, E)


@pytest.mark.gpu
def test_bench_parts_gpu(tmp_path, capsys):
    assert main(["bench", "--parts", "--shape", "cpu-small", "--out", str(tmp_path), "--rep-ms", "20"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "parts.csv")))
    assert [r["gemm"] for r in rows] == ["fc1", "fc2", "fc2_dgrad", "fc1_dgrad", "fc1_wgrad", "fc2_wgrad"]
    for r in rows:
        assert 0 < float(r["moemlp_pct_mm"]) < 1000 and float(r["mm_tflops"]) > 0
        assert r["bound"] in ("mm", "memory") and 0 < float(r["moemlp_pct_bound"]) < 1000
        assert float(r["copy_gbps"]) > 100 and float(r["min_gb"]) > 0
    assert "% of a dense torch.mm" in capsys.readouterr().out


@pytest.mark.gpu
def test_bench_parts_fp8_gpu(tmp_path, capsys):
    """fp8_block's step part by part: every part in schedule order, each GEMM on the kernel the MLP
    runs it on (on an H200 every one on the Gluon engine: 64 rows an expert), sane numbers."""
    from moemlp.bench.parts import FP8_PARTS
    from moemlp.kernels.gluon import why_unavailable

    args = ["bench", "--parts", "--recipes", "--shape", "cpu-small", "--out", str(tmp_path), "--rep-ms", "10"]
    assert main(args) == 0
    rows = list(csv.DictReader(open(tmp_path / "parts_fp8.csv")))
    assert [(r["part"], r["kind"]) for r in rows] == list(FP8_PARTS)
    kernels = {r["part"]: r["kernel"] for r in rows if r["kind"] == "gemm"}
    if why_unavailable():
        assert set(kernels.values()) == {"triton"}, kernels
    else:
        assert kernels["fc1"] == "gluon fc1", kernels
        assert kernels["fc2"] == kernels["fc1_dgrad"] == "gluon grouped_gemm_fp8", kernels
        assert kernels["fc2_dgrad"] == "gluon fc2_dgrad_fp8", kernels
        assert kernels["fc1_wgrad"] == kernels["fc2_wgrad"] == "gluon fp8_wgrad", kernels
    for r in rows:
        assert float(r["ms"]) > 0 and float(r["pct_of_step"]) > 0
        if r["kind"] == "gemm":
            assert 0 < float(r["pct_mm"]) < 1000 and float(r["tflops"]) > 0
        else:
            assert float(r["gbps"]) > 0
    assert sum(float(r["pct_of_step"]) for r in rows if r["kind"] != "weights") == pytest.approx(100.0)
    assert "part by part" in capsys.readouterr().out


def test_bracketed_ms_times_the_reference_on_both_sides(monkeypatch):
    """bracketed_ms: the reference timed, then the function, then the reference again; the
    reference's time is the mean of its two medians (a reference that slowed from 1 to 3 ms reads 2)."""
    from moemlp.bench import common

    calls = []

    def fake_time_ms(fn, device, *, warmup_ms=25, rep_ms=100):
        calls.append(fn)
        t = {"fn": 5.0, "ref": 1.0 if calls.count(ref) == 1 else 3.0}[fn.__name__]
        return common.Timing(t, t, t, 1)

    def fn():
        pass

    def ref():
        pass

    monkeypatch.setattr(common, "time_ms", fake_time_ms)
    assert common.bracketed_ms(fn, ref, torch.device("cpu"), rep_ms=7) == (5.0, 2.0)
    assert calls == [ref, fn, ref]


def test_gpu_time_is_nan_off_a_gpu():
    from moemlp.bench.common import gpu_time_ms

    assert math.isnan(gpu_time_ms(lambda: None, torch.device("cpu")))


@pytest.mark.gpu
def test_gpu_time_hides_the_host_and_keeps_the_kernels():
    """gpu_time_ms: a host-bound call (many tiny kernels, a slow host between them) measures far
    below its wall time, while a call of one long kernel measures that kernel's time."""
    from moemlp.bench.common import _sleep_cycles_per_ms, event_ms, gpu_time_ms

    device = torch.device("cuda")
    x = torch.zeros(16, device=device)

    def host_bound():
        for _ in range(50):
            x.add_(1.0)
            time.sleep(2e-4)  # 10 ms of host time around 50 kernels of a few µs

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host_bound()
    end.record()
    end.synchronize()
    wall = start.elapsed_time(end)
    gpu = gpu_time_ms(host_bound, device, iters=5, warmup=1)
    assert wall > 10.0 and gpu < 0.2 * wall, (wall, gpu)

    # A kernel of about 5 ms, against its own event time measured beside it: the cycles-per-ms
    # calibration is cached per process, and on a GPU that other test processes share (time-sliced)
    # it can be off by a third, so the nominal 5 ms is not the reference. For the same reason each
    # side is the least of 5 measurements taken in turn with the other's: another process's kernels
    # can only lengthen a sample, and it lengthened one side's median to 1.4x the other's.
    cycles = int(5.0 * _sleep_cycles_per_ms(device))
    sleep = lambda: torch.cuda._sleep(cycles)  # noqa: E731
    longs, alones = [], []
    for _ in range(5):
        longs.append(gpu_time_ms(sleep, device, iters=3, warmup=1))
        alones.append(event_ms(sleep))
    long, alone = min(longs), min(alones)
    assert alone > 1.0 and 0.9 < long / alone < 1.1, (longs, alones)


# --- arguments refused before anything runs -----------------------------------------------------


@pytest.mark.parametrize("argv,words", [
    (["bench", "--device", "foo"], ["--device", "cpu or cuda", "'foo'"]),
    (["precision", "--device", "meta"], ["--device", "cpu or cuda", "'meta'"]),
    (["bench", "--rep-ms", "0"], ["--rep-ms", "positive integer, got 0"]),
    (["bench", "--rep-ms", "-5"], ["--rep-ms", "positive integer, got -5"]),
    (["bench", "--moe", "--hf"], ["--moe and --hf are separate benches"]),
    (["bench", "--moe", "--recipes"], ["--moe and --recipes are separate benches"]),
    (["bench", "--hf", "--parts"], ["--hf and --parts are separate benches"]),
    (["bench", "--ep", "1,2"], ["--ep applies to --moe only"]),
    (["bench", "--recipes", "--peers", "lean"], ["--peers applies to the plain bench only, not --recipes"]),
    (["bench", "--moe", "--rep-ms", "50"], ["--rep-ms does not apply to --moe"]),
    (["bench", "--rec"], ["unrecognized arguments: --rec"]),  # no abbreviations (dev.py reads the flags)
], ids=["device-foo", "device-meta", "rep-ms-0", "rep-ms-negative", "moe-hf", "moe-recipes", "hf-parts",
        "ep-alone", "peers-recipes", "rep-ms-moe", "abbreviation"])
def test_bad_arguments_refused_at_once(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where torch sees no GPU")
def test_cuda_device_without_a_gpu_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["precision", "--device", "cuda", "--shape", "cpu-small"])
    assert "sees no CUDA device" in capsys.readouterr().err


def test_out_checked_before_the_run(tmp_path, capsys, monkeypatch):
    from moemlp.bench import mlp

    monkeypatch.setattr(mlp, "run_bench", lambda *a: pytest.fail("the bench ran before --out was checked"))
    afile = tmp_path / "afile"
    afile.write_text("")
    for out, words in ((str(afile), "exists and is not a folder"), ("", "expected a folder"),
                       (str(afile / "sub"), "cannot make the folder")):
        with pytest.raises(SystemExit):
            main(["bench", "--device", "cpu", "--shape", "cpu-small", "--out", out])
        assert words in capsys.readouterr().err


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit):
        main(["precision", "--device", "cpu", "--backend", "triton", "--shape", "cpu-small"])
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


@pytest.mark.parametrize("flag,precision_follows", [(None, True), ("--hf", False), ("--parts", False),
                                                    ("--moe", False), ("--recipes", False)])
def test_dev_bench_runs_precision_after_the_plain_bench_only(flag, precision_follows, monkeypatch):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "dev.py"
    spec = importlib.util.spec_from_file_location("moemlp_dev", path)
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    ran = []
    monkeypatch.setattr(dev, "setup", lambda: None)
    monkeypatch.setattr(dev, "_run", lambda cmd, **kw: ran.append([str(c) for c in cmd]) or 0)
    argv = ["bench", *([flag] if flag else []), "--rep-ms", "10", "--out", "o"]
    if flag == "--moe":
        argv = ["bench", "--moe", "--out", "o"]
    assert dev.main(argv) == 0
    assert [c[3] for c in ran] == (["bench", "precision"] if precision_follows else ["bench"])
    if precision_follows:
        assert ran[1][4:] == ["--out", "o"]


def test_hf_bench_without_transformers_is_refused(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    with pytest.raises(SystemExit) as info:
        main(["bench", "--hf", "--device", "cpu"])
    assert info.value.code == 2
    assert "--hf needs the transformers package" in capsys.readouterr().err
