"""benchmark/bench_trainer.py ``--merge``: matrix pieces written by separate runs join into one CSV
whose ratios are recomputed across the pieces (CPU only, no trainer runs).

Each piece is written by the benchmark's own CSV writer from hand-made rows, so the joined values
are known exactly: the ratios are checked to the 3 digits the benchmark rounds them to.
"""

import csv

import pytest

pytest.importorskip("trl")  # bench_trainer imports the trainers' modules

from benchmark.bench_trainer import add_ratios, main, rows_from_csv, write_partial  # noqa: E402
from benchmark.common import Row  # noqa: E402


def _row(case, provider, tokens_per_s, step_peak):
    extra = dict(tokens_per_s=tokens_per_s, tokens_per_s_min=tokens_per_s * 0.9, tokens_per_s_max=tokens_per_s * 1.1,
                 step_peak_mib=step_peak, speed_vs_trl="", speed_vs_trl_liger="", step_peak_vs_trl="", note="a, b")
    return Row("trainer", case, "step", provider, 1000.0, step_peak + 100.0, extra=extra)


def test_merge_joins_pieces_and_recomputes_ratios(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    write_partial("piece_a", [_row("c1", "trl", 100.0, 50.0), _row("c1", "ours", 120.0, 40.0)])
    # the second piece lacks trl+liger for its case, as the MoE piece does
    write_partial("piece_b", [_row("c2", "trl", 200.0, 80.0), _row("c2", "ours", 230.0, 80.0)])
    pieces = [str(tmp_path / "piece_a.csv"), str(tmp_path / "piece_b.csv")]
    assert main(["--merge", *pieces, "--name", "joined"]) == 0
    with open(tmp_path / "joined.csv", newline="") as f:
        got = {(d["case"], d["provider"]): d for d in csv.DictReader(f)}
    assert set(got) == {("c1", "trl"), ("c1", "ours"), ("c2", "trl"), ("c2", "ours")}
    assert float(got[("c1", "ours")]["speed_vs_trl"]) == 1.2
    assert float(got[("c2", "ours")]["speed_vs_trl"]) == 1.15
    assert float(got[("c1", "ours")]["step_peak_vs_trl"]) == 0.8
    assert got[("c2", "ours")]["speed_vs_trl_liger"] == ""
    assert got[("c1", "ours")]["note"] == "a, b"  # text columns stay text
    assert (tmp_path / "joined.png").exists()


def test_rows_from_csv_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    rows = [_row("c1", "trl", 100.0, 50.0), _row("c1", "ours", 125.0, 45.0)]
    add_ratios(rows)
    write_partial("one", rows)
    back = rows_from_csv([str(tmp_path / "one.csv")])
    assert [(r.case, r.provider) for r in back] == [("c1", "trl"), ("c1", "ours")]
    assert back[1].extra["tokens_per_s"] == 125.0 and back[1].extra["speed_vs_trl"] == 1.25
    assert back[0].error is None
