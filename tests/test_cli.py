"""python -m moemlp bench / precision on the CPU: tables, CSV and PNG written, numbers sane."""

import csv

from moemlp.__main__ import main


def test_bench_cpu(tmp_path, capsys):
    assert main(["bench", "--device", "cpu", "--backend", "torch", "--out", str(tmp_path),
                 "--rep-ms", "20"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "bench.csv")))
    assert [r["shape"] for r in rows] == ["cpu-small"]
    r = rows[0]
    assert float(r["moemlp_fwdbwd_tflops"]) > 0 and float(r["torch_fwdbwd_tflops"]) > 0
    assert float(r["rel_diff_y"]) < 2e-2
    # The fused design keeps bf16 h (2·2F bytes) + fp32 probs per row; the composition ~2.5× more.
    F = int(r["F"])
    assert float(r["moemlp_saved_bytes_per_row"]) <= 2 * 2 * F + 4
    assert float(r["torch_saved_bytes_per_row"]) > 2 * float(r["moemlp_saved_bytes_per_row"])
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert "speedup_fwdbwd" in capsys.readouterr().out


def test_precision_cpu(tmp_path, capsys):
    assert main(["precision", "--device", "cpu", "--backend", "torch", "--out", str(tmp_path)]) == 0
    rows = {r["impl"].split(" ")[0]: r for r in csv.DictReader(open(tmp_path / "precision.csv"))}
    assert float(rows["moemlp"]["dprobs"]) <= 1e-5
    assert float(rows["torch"]["dprobs"]) > 1e-4
    assert rows["moemlp"]["dprobs_dtype"] == "float32"
    assert "contract: moemlp dprobs" in capsys.readouterr().out


def test_bench_recipes_cpu(tmp_path, capsys):
    assert main(["bench", "--recipes", "--device", "cpu", "--backend", "torch", "--out", str(tmp_path),
                 "--rep-ms", "20"]) == 0
    (r,) = list(csv.DictReader(open(tmp_path / "bench_recipes.csv")))
    assert r["shape"] == "cpu-small" and float(r["bf16_fwdbwd_ms"]) > 0
    for name, floor in (("fp8_block", 20.0), ("mxfp8", 20.0), ("nvfp4", 8.0)):
        assert float(r[f"{name}_fwdbwd_ms"]) > 0 and float(r[f"{name}_speedup_fwdbwd"]) > 0
        assert float(r[f"{name}_snr_db"]) >= floor, (name, r[f"{name}_snr_db"])
    assert "fp8_block_speedup_fwdbwd" in capsys.readouterr().out
