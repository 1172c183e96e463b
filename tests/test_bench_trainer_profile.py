"""``bench_trainer``'s GPU diagnostics read on the CPU: ``--profile``'s idle-gap analysis (from a Chrome
trace, the GPU's gaps between kernels and the host ops that held them) and the SM clock / power sampler's
parser (exact: integer timestamps and samples chosen to have exact means)."""

import json

import pytest

pytest.importorskip("trl")  # bench_trainer imports the trainers' modules

from benchmark.bench_trainer import idle_gaps, parse_gpu_samples  # noqa: E402


def test_idle_gaps_name_the_host_ops_holding_each_gap(tmp_path):
    events = [
        dict(cat="kernel", name="gemm_a", ts=0, dur=100),
        dict(cat="kernel", name="gemm_b", ts=80, dur=70),  # overlaps gemm_a: no gap between them
        dict(cat="kernel", name="add", ts=400, dur=10),
        dict(cat="kernel", name="adam", ts=430, dur=5),
        dict(cat="kernel", name="norm", ts=440, dur=5),  # a 5 us gap: below min_us
        dict(cat="user_annotation", name="step", ts=-10, dur=1000),
        dict(cat="cpu_op", name="aten::item", ts=140, dur=200),
        dict(cat="cuda_runtime", name="cudaMemcpyAsync", ts=145, dur=190),
        dict(cat="cpu_op", name="aten::add", ts=380, dur=30),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    lines = idle_gaps(str(path), min_us=20.0)
    assert lines[0].startswith("GPU idle in gaps >= 20 us: 0.3 ms in 2 gaps over a 0.4 ms span")
    # the longest gap first: 150 -> 400 us, held by the sync inside aten::item, aten::add issued in it
    assert lines[1].split() == ["0.250", "gemm_b", "->", "add", "|", "cudaMemcpyAsync", "<", "aten::item",
                                "<", "step", "|", "aten::add"]
    assert lines[2].split()[:4] == ["0.020", "add", "->", "adam"]
    assert len(lines) == 3


def test_gpu_samples_parse_to_means_skipping_bad_lines():
    """``nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits``
    lines: the means of the lines that parse; ``[N/A]`` and a truncated last line are skipped."""
    text = "1980, 690.50, 61\n1755, 699.50, 63\n[N/A], 650.0, 60\n1800, 70"
    assert parse_gpu_samples(text) == dict(sm_clock_mhz=1867.5, power_w=695.0, temp_c=62.0, samples=2)
    assert parse_gpu_samples("") == {}
