"""The README demo (`python -m liger_losses.demo`) runs end to end for a couple of steps.

Checks structure, not learning (2 steps can't show it): the report prints, start/end metrics and
the evaluation before/after exist and are finite, the memory comparison ran, and the CLI parses.
"""

import io
import math

import pytest

from liger_losses import demo


def test_demo_runs_two_steps(monkeypatch):
    """run(steps=2) trains with DPOTrainer(use_liger=True) and prints the report. Run as a user runs
    it on a CPU: TRITON_INTERPRET unset, so our kernels take their PyTorch fallback (the profiler
    over interpreted kernels would be slow and memory-hungry)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = io.StringIO()
    result = demo.run(steps=2, batch_size=4, quiet=False, out=out)
    text = out.getvalue()
    assert "Report after 2 steps" in text and "rewards/accuracies" in text and "Peak memory" in text
    assert math.isfinite(result["train_end"]["loss"])
    assert result["eval_before"]["eval_rewards/accuracies"] == 0.0  # policy == reference before training
    assert math.isfinite(result["eval_after"]["eval_loss"])
    assert set(result["memory"]) >= {"trl", "liger", "what"}


def test_demo_cli_rejects_bad_steps():
    """--steps 0 is a usage error (exit code 2), before any work."""
    with pytest.raises(SystemExit) as exc:
        demo.main(["--steps", "0"])
    assert exc.value.code == 2


def test_bundled_data_is_well_formed():
    """The bundled preference file has prompt/chosen/rejected strings, chosen != rejected, and only
    characters the demo tokenizer knows."""
    data = demo.preference_dataset()
    assert len(data) >= 100
    for row in data:
        assert row["chosen"] != row["rejected"]
        assert set(row["prompt"] + row["chosen"] + row["rejected"]) <= set(demo.VOCAB_CHARS)


@pytest.mark.gpu
def test_demo_runs_on_cuda():
    """The demo on CUDA (bf16, compiled kernels, memory measured with max_memory_allocated)."""
    out = io.StringIO()
    result = demo.run(steps=2, batch_size=4, device="cuda", out=out)
    assert result["memory"]["liger"] is not None and result["memory"]["trl"] is not None
    assert math.isfinite(result["train_end"]["loss"])
