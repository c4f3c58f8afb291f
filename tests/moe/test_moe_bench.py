"""python -m moemlp bench --moe on the CPU: one-process and 2-process (gloo) rows with the phase shares
and the all-to-all columns, CSV written; the --ep argument's parsing."""

import argparse
import csv

import pytest

from moemlp.bench.moe import DEFAULT_EP, ep_sizes, run_moe_bench


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
    out = capsys.readouterr().out
    assert "tokens_per_s" in out and "dist_busbw_GBps" in out


def test_ep_argument(capsys):
    """The --ep line as src/moemlp/__main__.py adds it to the bench parser."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--ep", type=ep_sizes, default=DEFAULT_EP, metavar="N,N,...",
                        help="with --moe: expert-parallel world sizes, comma-separated (default 1,2); "
                             "sizes above the GPU count are skipped")
    assert parser.parse_args([]).ep == [1, 2]
    assert parser.parse_args(["--ep", "1,2,4,8"]).ep == [1, 2, 4, 8]
    assert parser.parse_args(["--ep", "2,2,1"]).ep == [2, 1]
    for bad in ("", "0", "1,x", "-2"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--ep", bad])
        assert "expected comma-separated positive ints" in capsys.readouterr().err
