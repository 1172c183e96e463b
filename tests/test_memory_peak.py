"""benchmark/memory_peak.py: replay of a synthetic ``torch.cuda.memory._snapshot()`` dict (CPU only).

The snapshot is built by hand in the format the module documents (segments with blocks, one device
trace with alloc / free_requested / free_completed / other actions, frames innermost first), so the
peak index, the bytes alive at the peak and their grouping are known exactly: every check is an exact
equality on integer byte counts (no tolerance: nothing is computed in floating point but the time).
"""

import copy
import math

from benchmark.memory_peak import (
    BASELINE_KEY,
    analyze,
    attribution,
    category,
    package_path,
    peak_breakdown,
)

M = 2**20
BASE = 0x7F00_0000_0000
P, S, B0, OLD = BASE, BASE + 4 * M, BASE + 12 * M, BASE + 14 * M  # allocated before recording
A = {f"a{i}": BASE + (20 + 8 * (i - 1)) * M for i in range(1, 9)}  # allocated inside the window

SITE = "/x/site-packages/"
LLAMA = SITE + "transformers/models/llama/modeling_llama.py"
CKPT = SITE + "torch/utils/checkpoint.py"


def fr(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


FWD = [fr(SITE + "torch/nn/functional.py", 10, "linear"), fr(LLAMA, 300, "forward"),
       fr(SITE + "torch/nn/modules/module.py", 1700, "_call_impl"), fr(CKPT, 480, "checkpoint"),
       fr(SITE + "trl/trainer/dpo_trainer.py", 900, "compute_loss")]
LOSS = [fr(SITE + "torch/nn/functional.py", 20, "matmul"), fr("/x/liger_losses/chunked/engine.py", 120, "_chunk_loop"),
        fr(SITE + "trl/trainer/dpo_trainer.py", 910, "compute_loss")]
OPTIM = [fr(SITE + "torch/optim/adamw.py", 400, "_multi_tensor_adamw"),
         fr(SITE + "torch/optim/optimizer.py", 90, "step"),
         fr(SITE + "accelerate/optimizer.py", 170, "step"),
         fr(SITE + "transformers/trainer.py", 1940, "_inner_training_loop")]
RECOMPUTE = [fr(LLAMA, 250, "forward"), fr(CKPT, 1660, "recompute_fn"), fr(CKPT, 1170, "unpack_hook")]
ZERO_GRAD = [fr(SITE + "torch/nn/modules/module.py", 2900, "zero_grad"),
             fr(SITE + "transformers/trainer.py", 1954, "_inner_training_loop")]
MAIN = [fr("/work/main/benchmark/bench_trainer.py", 360, "run_one")]


def ev(action, addr, size, frames=()):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}


def synthetic_snapshot():
    """Baseline: P 4 MiB and S 8 MiB (requested 8 MiB - 100 B) alive throughout, B0 2 MiB freed at
    event 3. Running total above the baseline: 3, 6, 4, 4, 9, 10, 12, 12.5 (peak, event 8), 7.5, ..."""
    trace = [
        ev("segment_alloc", BASE + 20 * M, 64 * M),  # 0: ignored
        ev("alloc", A["a1"], 3 * M, FWD),  # 1
        ev("alloc", A["a2"], 3 * M, FWD),  # 2
        ev("free_requested", B0, 2 * M, MAIN),  # 3: allocated before recording
        ev("free_completed", B0, 2 * M, MAIN),  # 4
        ev("alloc", A["a3"], 5 * M, LOSS),  # 5
        ev("alloc", A["a4"], 1 * M, []),  # 6: autograd thread (no Python frame), freed by zero_grad
        ev("alloc", A["a5"], 2 * M, OPTIM),  # 7
        ev("alloc", A["a6"], M // 2, RECOMPUTE),  # 8: the peak
        ev("free_requested", A["a3"], 5 * M, LOSS),  # 9
        ev("free_completed", A["a3"], 5 * M, LOSS),  # 10
        ev("alloc", A["a7"], 1 * M, FWD),  # 11
        ev("free_requested", A["a4"], 1 * M, ZERO_GRAD),  # 12
        ev("free_completed", A["a4"], 1 * M, ZERO_GRAD),  # 13
        ev("alloc", A["a8"], 4 * M, LOSS),  # 14: 11.5 < 12.5
        ev("free_completed", A["a8"], 4 * M, LOSS),  # 15: free_requested not recorded
        ev("free_requested", A["a1"], 3 * M, FWD),  # 16
        ev("free_completed", A["a1"], 3 * M, FWD),  # 17
        {"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "frames": []},  # 18
    ]
    for i, e in enumerate(trace):
        e["time_us"] = 1_000 + 10 * i

    def blk(addr, size, state="active_allocated", requested=None):
        return {"address": addr, "size": size, "requested_size": requested or size, "state": state, "frames": []}

    segments = [
        {"device": 0, "address": BASE, "total_size": 20 * M, "stream": 0, "segment_type": "large",
         "blocks": [blk(P, 4 * M), blk(S, 8 * M, requested=8 * M - 100), blk(B0, 2 * M, "inactive"),
                    blk(OLD, 6 * M, "inactive")]},
        {"device": 0, "address": BASE + 20 * M, "total_size": 64 * M, "stream": 0, "segment_type": "large",
         "blocks": [blk(A["a1"], 8 * M, "inactive"), blk(A["a2"], 8 * M, requested=3 * M),
                    blk(A["a3"], 8 * M, "inactive"), blk(A["a4"], 8 * M, "inactive"),
                    blk(A["a5"], 8 * M, requested=2 * M), blk(A["a6"], 8 * M, requested=M // 2),
                    blk(A["a7"], 8 * M, requested=M), blk(A["a8"], 8 * M, "inactive")]},
        {"device": 1, "address": BASE, "total_size": 2 * M, "stream": 0, "segment_type": "large",
         "blocks": [blk(BASE, 2 * M)]},  # another device: ignored
    ]
    return {"segments": segments, "device_traces": [trace, []]}


EXPECTED_GROUPS = [  # (category, key, bytes, blocks), largest first
    ("allocated before recording", BASELINE_KEY, 12 * M - 100, 2),
    ("checkpointed forward", "transformers/models/llama/modeling_llama.py:300 forward", 6 * M, 2),
    ("liger_losses", "liger_losses/chunked/engine.py:120 _chunk_loop", 5 * M, 1),
    ("optimizer state", "accelerate/optimizer.py:170 step", 2 * M, 1),
    ("parameter/gradient", "freed at transformers/trainer.py:1954 _inner_training_loop", 1 * M, 1),
    ("checkpoint recompute", "transformers/models/llama/modeling_llama.py:250 forward", M // 2, 1),
]


def _groups(report):
    return [(g.category, g.key, g.nbytes, g.count) for g in report.groups]


def test_peak_index_total_and_groups_exact():
    """The peak is event 8 (the 0.5 MiB recompute alloc) at 12 MiB - 100 B of baseline + 14.5 MiB
    traced; frees of pre-recording blocks, frees without free_requested and blocks still alive in
    ``segments`` are neither lost nor double counted; groups come out in the exact expected order."""
    r = analyze(synthetic_snapshot())
    assert r.device == 0 and r.n_events == 19
    assert r.peak_index == 8
    assert math.isclose(r.peak_time_ms, 0.08)
    assert r.total_bytes == 26 * M + M // 2 - 100
    assert r.rounded_bytes == 26 * M + M // 2  # S counts with its real block size
    assert r.baseline_bytes == 12 * M - 100
    assert _groups(r) == EXPECTED_GROUPS
    assert r.peak_key == "transformers/models/llama/modeling_llama.py:250 forward"
    assert r.peak_category == "checkpoint recompute" and r.peak_size == M // 2
    assert r.peak_stack[0] == r.peak_key and len(r.peak_stack) == 3
    assert r.anomalies == 0 and r.ooms == 0
    assert sum(c.nbytes for c in r.categories) == r.total_bytes


def test_labels_name_blocks_alive_until_the_snapshot():
    """Labels (address -> (category, key)) name a pre-recording block (P) and a traced block alive
    until the snapshot (a5); a label on a block freed before the snapshot (a4) is not used."""
    labels = {P: ("parameter/gradient", "<policy model parameters>"),
              A["a5"]: ("optimizer state", "<optimizer state: exp_avg>"),
              A["a4"]: ("optimizer state", "<stale>")}
    r = analyze(synthetic_snapshot(), labels=labels)
    assert r.total_bytes == 26 * M + M // 2 - 100
    assert _groups(r) == [
        ("allocated before recording", BASELINE_KEY, 8 * M - 100, 1),
        ("checkpointed forward", "transformers/models/llama/modeling_llama.py:300 forward", 6 * M, 2),
        ("liger_losses", "liger_losses/chunked/engine.py:120 _chunk_loop", 5 * M, 1),
        ("parameter/gradient", "<policy model parameters>", 4 * M, 1),
        ("optimizer state", "<optimizer state: exp_avg>", 2 * M, 1),
        ("parameter/gradient", "freed at transformers/trainer.py:1954 _inner_training_loop", 1 * M, 1),
        ("checkpoint recompute", "transformers/models/llama/modeling_llama.py:250 forward", M // 2, 1),
    ]
    assert [(c.category, c.nbytes) for c in r.categories] == [  # ties broken by name
        ("allocated before recording", 8 * M - 100), ("checkpointed forward", 6 * M), ("liger_losses", 5 * M),
        ("parameter/gradient", 5 * M), ("optimizer state", 2 * M), ("checkpoint recompute", M // 2)]


def test_older_format_without_block_addresses_or_times():
    """Blocks without "address" (older snapshots: addresses follow from the segment's address and
    the block sizes) and entries without "time_us" give the same peak and groups; time is nan."""
    snap = synthetic_snapshot()
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            del b["address"]
            del b["requested_size"]
    for e in snap["device_traces"][0]:
        del e["time_us"]
    r = analyze(snap)
    assert r.peak_index == 8 and math.isnan(r.peak_time_ms)
    assert r.total_bytes == 26 * M + M // 2  # S's requested size is unknown: its block size counts
    assert _groups(r)[0] == ("allocated before recording", BASELINE_KEY, 12 * M, 2)
    assert _groups(r)[1:] == EXPECTED_GROUPS[1:]


def test_text_report():
    """peak_breakdown prints the totals, the peak event and the groups in order, truncated to ``top``
    with a remainder line, and max_memory_allocated next to the replayed total."""
    text = peak_breakdown(synthetic_snapshot(), top=3, max_allocated=27 * M)
    assert "26.500 MiB" in text and "27.000 MiB" in text
    assert "at event 8 of 19, 0.1 ms after the first event" in text
    assert "by an allocation of 0.500 MiB at transformers/models/llama/modeling_llama.py:250 forward" in text
    top = text.split("top 3 of 6 groups")[1].splitlines()[2:]
    assert [line.split(" | ")[-1] for line in top[:3]] == [g[1] for g in EXPECTED_GROUPS[:3]]
    assert "(3 more groups)" in top[3]


def test_no_trace_gives_a_message():
    """No device trace (recording off, empty dict, other device) -> a one-line explanation, no crash."""
    for snap in ({}, {"segments": [], "device_traces": []}, {"segments": [], "device_traces": [[], []]}):
        assert analyze(snap) is None
        assert peak_breakdown(snap).startswith("no allocation trace in the snapshot")
    assert analyze(synthetic_snapshot(), device=1) is None
    assert analyze(synthetic_snapshot(), device=5) is None


def test_peak_at_start_when_the_window_only_frees():
    """A window that only frees peaks before its first event (index -1): the baseline alone."""
    snap = synthetic_snapshot()
    snap["device_traces"][0] = [ev("free_requested", B0, 2 * M, MAIN), ev("free_completed", B0, 2 * M, MAIN)]
    snap["segments"] = copy.deepcopy(snap["segments"][:1])
    r = analyze(snap)
    assert r.peak_index == -1 and r.total_bytes == 14 * M - 100 and r.baseline_bytes == 14 * M - 100
    assert "at the start of the recording" in peak_breakdown(snap)


def test_frame_helpers():
    """Package-relative paths, innermost non-torch attribution with fallbacks, and categories."""
    assert package_path("/work/main/liger_losses/chunked/engine.py") == "liger_losses/chunked/engine.py"
    assert package_path(LLAMA) == "transformers/models/llama/modeling_llama.py"
    assert package_path("/work/main/benchmark/bench_trainer.py") == "benchmark/bench_trainer.py"
    assert package_path("/a/b/c/d.py") == "c/d.py"
    assert attribution(FWD) == "transformers/models/llama/modeling_llama.py:300 forward"
    assert attribution(FWD[:1]) == "torch/nn/functional.py:10 linear"  # only torch frames
    cpp = [fr("??", 0, "torch::autograd::AccumulateGrad::apply")]
    assert attribution(cpp) == "[C++] torch::autograd::AccumulateGrad::apply" and attribution([]) == ""
    assert category(cpp) == "parameter/gradient"
    assert category([]) == "autograd engine (no Python frame)"
    assert category(MAIN) == "other"
    assert category(OPTIM) == "optimizer state" and category(LOSS) == "liger_losses"


def test_torch_frames_by_the_path_inside_the_install():
    """Only torch's own files count as torch's: an install under a directory named ``torch`` (the GPU
    image's ``/opt/torch/.venv``) leaves transformers' and TRL's frames attributable."""
    venv = "/opt/torch/.venv/lib/python3.12/site-packages/"
    frames = [fr(venv + "torch/nn/functional.py", 10, "linear"), fr(venv + "trl/trainer/sft_trainer.py", 1693,
                                                                     "training_step")]
    assert attribution(frames) == "trl/trainer/sft_trainer.py:1693 training_step"
    assert attribution(frames[:1]) == "torch/nn/functional.py:10 linear"
    assert attribution([fr("/src/pytorch/torch/autograd/graph.py", 5, "f"), fr("/work/x/run.py", 1, "g")]) == \
        "x/run.py:1 g"
    egg = "/usr/lib/python3/site-packages/torch-2.1-py3.11.egg/torch/nn/functional.py"
    assert attribution([fr(egg, 3, "linear"), fr("/work/x/run.py", 1, "g")]) == "x/run.py:1 g"
    # a directory named torch above our checkout or above an environment's standard library
    ours = "/opt/torch/work/liger_losses/chunked/engine.py"
    stdlib = "/home/u/miniconda3/envs/torch/lib/python3.11/threading.py"
    assert attribution([fr(ours, 7, "run")]) == "liger_losses/chunked/engine.py:7 run"
    assert attribution([fr(stdlib, 9, "run"), fr(ours, 7, "run")]) == "python3.11/threading.py:9 run"
