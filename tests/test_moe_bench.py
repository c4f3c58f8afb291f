"""python -m moemlp bench --moe on the CPU: one-process and 2-process (gloo) rows, CSV written."""

import argparse
import csv

import pytest

from moemlp.bench.moe import run_moe_bench


def test_moe_bench_cpu(tmp_path, capsys):
    rows = run_moe_bench(argparse.Namespace(device="cpu", backend="torch", out=str(tmp_path)))
    assert [r["ep"] for r in rows] == [1, 2]
    written = list(csv.DictReader(open(tmp_path / "moe_bench.csv")))
    assert len(written) == 2
    for r in written:
        assert float(r["layer_ms"]) > 0 and float(r["tokens_per_s"]) > 0
        shares = [float(r[f"{p}_pct"]) for p in ("dispatch", "experts", "combine")]
        assert all(s > 0 for s in shares) and sum(shares) == pytest.approx(100.0)
        # Every routed row of this rank is processed by some expert: T·k rows in total over ranks.
        assert int(r["expert_rows"]) > 0
    assert int(written[0]["expert_rows"]) == 256 * 2  # one process: all T·k rows are local
    assert "tokens_per_s" in capsys.readouterr().out
