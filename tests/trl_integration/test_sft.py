"""SFTTrainer(use_liger=True) against TRL 1.16's own SFT path, on tiny offline fp32 models.

Parity: TRL's trainer (use_liger=False) and ours on deep copies of the same weights and batch; the
loss, ``mean_token_accuracy``, ``entropy``, ``num_tokens`` and every parameter gradient agree to a
relative error <= 1e-4 (the same fp32 math in another summation order gives ~1e-6).
"""

import pytest
import torch

from liger_losses.patching.pad_free import varlen_call_count
from liger_losses.trl_integration import SFTTrainer

from .utils import (
    assert_grads_match,
    assert_metrics_match,
    build_tiny_model,
    first_batch,
    make_pair,
    rel,
    sft_config,
    sft_dataset,
    train_logs,
)

TOL = 1e-4


def _pair(tok, tmp_path, data, liger_kwargs=None, **cfg):
    return make_pair(SFTTrainer, [build_tiny_model(tok, seed=0)], lambda run_dir: sft_config(run_dir, **cfg),
                     tmp_path, lambda: data, liger_kwargs=liger_kwargs, processing_class=tok)


def _check(theirs, ours, num_items_in_batch=None):
    batch = first_batch(theirs)
    theirs._metrics["train"].clear()
    ours._metrics["train"].clear()
    loss_t = theirs.compute_loss(theirs.model, dict(batch), num_items_in_batch=num_items_in_batch)
    loss_o = ours.compute_loss(ours.model, dict(batch), num_items_in_batch=num_items_in_batch)
    m_t = {k: v[-1] for k, v in theirs._metrics["train"].items()}
    m_o = {k: v[-1] for k, v in ours._metrics["train"].items()}
    assert rel(loss_o.detach(), loss_t.detach()) <= TOL, (float(loss_o), float(loss_t))
    assert_metrics_match(m_o, m_t, TOL)
    assert_grads_match(loss_t, loss_o, theirs, ours, TOL)
    return batch


def test_completion_only_parity(tok, tmp_path):
    """Prompt/completion data (completion-only loss, TRL's default for it): prompt tokens are -100
    in the labels and excluded by both; loss, metrics, grads match with 3-token tiles."""
    theirs, ours = _pair(tok, tmp_path, sft_dataset(), liger_kwargs={"liger_chunk_tokens": 3})
    batch = _check(theirs, ours)
    assert (batch["labels"] == -100).sum() > (batch["attention_mask"] == 0).sum()  # prompts masked


def test_full_sequence_parity(tok, tmp_path):
    """Plain-text language modelling (every non-pad token scored), loss/metrics/grads match."""
    from datasets import Dataset

    data = Dataset.from_list([{"text": r["prompt"] + r["completion"]} for r in sft_dataset().to_list()])
    _check(*_pair(tok, tmp_path, data))


def test_assistant_only_parity(tok, tmp_path):
    """Conversational data with assistant_only_loss=True (the chat template's generation markers
    give the mask), loss/metrics/grads match."""
    from datasets import Dataset

    data = Dataset.from_list([{"messages": r["prompt"] + r["completion"]}
                              for r in sft_dataset(conversational=True).to_list()])
    _check(*_pair(tok, tmp_path, data, assistant_only_loss=True))


@pytest.mark.parametrize("data", ["completion-only", "full-sequence", "label-smoothing"])
def test_pad_free_parity(tok, tmp_path, monkeypatch, data):
    """Forced pad-free (``LIGER_LOSSES_PAD_FREE=1``: the backbone on the attended tokens alone, packed; the CPU's
    reference attention) on TRL's padded batch: loss, metrics and grads equal TRL's (rel <= 1e-4), packed."""
    from datasets import Dataset

    monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "1")
    rows = sft_dataset()
    if data == "full-sequence":
        rows = Dataset.from_list([{"text": r["prompt"] + r["completion"]} for r in rows.to_list()])
    cfg = {"label_smoothing_factor": 0.1} if data == "label-smoothing" else {}
    theirs, ours = _pair(tok, tmp_path, rows, **cfg)
    calls = varlen_call_count()
    batch = _check(theirs, ours)
    assert not batch["attention_mask"].all()
    assert varlen_call_count() - calls == ours.model.config.num_hidden_layers


def test_pad_free_under_lora_dropout(tok, tmp_path, monkeypatch):
    """LoRA with dropout 0.1, pad-free forced: the packed call runs (its dropout masks are other draws than TRL's
    padded call's), and over 24 seeds its loss has TRL's distribution: the means within 4 standard errors of their
    difference, which is ~1% of the loss here; the losses vary from seed to seed (dropout drawn). The per-element
    distribution is held in ``tests/patching/test_pad_free.py``."""
    from .utils import lora_config

    monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "1")
    config = lora_config()
    config.lora_dropout = 0.1
    theirs, ours = make_pair(SFTTrainer, [build_tiny_model(tok, seed=0)], lambda run_dir: sft_config(run_dir),
                             tmp_path, sft_dataset, processing_class=tok, peft_config=config)
    batch = first_batch(theirs)
    losses = {"theirs": [], "ours": []}
    calls = varlen_call_count()
    with torch.no_grad():
        for seed in range(24):
            for name, trainer in (("theirs", theirs), ("ours", ours)):
                torch.manual_seed(seed)
                losses[name].append(float(trainer.compute_loss(trainer.model, dict(batch))))
    assert varlen_call_count() - calls == 24 * ours.model.config.num_hidden_layers
    t, o = torch.tensor(losses["theirs"]), torch.tensor(losses["ours"])
    assert t.std() > 0 and o.std() > 0
    error = ((t.var() + o.var()) / len(t)).sqrt()
    assert (o.mean() - t.mean()).abs() <= 4 * error, (float(o.mean()), float(t.mean()), float(error))


def test_pad_free_refused_under_neftune(tok, tmp_path, monkeypatch):
    """NEFTune (``neftune_noise_alpha=5``) scales its embedding noise by the call's row length, so pad-free (forced)
    keeps the padded call: no packed attention, and each run seeded alike (the Trainer does not reseed at ``train()``,
    and TRL's run draws noise), two training steps log TRL's losses (rel <= 1e-4)."""
    monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "1")
    theirs, ours = _pair(tok, tmp_path, sft_dataset(), neftune_noise_alpha=5.0, max_steps=2)
    calls = varlen_call_count()
    losses = []
    for trainer in (theirs, ours):
        torch.manual_seed(0)
        trainer.train()
        losses.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert varlen_call_count() == calls
    assert len(losses[0]) == len(losses[1]) == 2
    for a, b in zip(*losses):
        assert rel(b, a) <= TOL, (b, a)


def test_num_items_in_batch_parity(tok, tmp_path):
    """With the Trainer's num_items_in_batch (gradient accumulation count) the loss is sum / count,
    as TRL's; loss, metrics, grads match."""
    _check(*_pair(tok, tmp_path, sft_dataset()), num_items_in_batch=torch.tensor(57))


def test_label_smoothing_parity(tok, tmp_path):
    """label_smoothing_factor=0.1 (TRL: HF LabelSmoother on full logits; ours: chunked CE with label
    smoothing, the entropy from the same tiles): loss, metrics, grads match."""
    _check(*_pair(tok, tmp_path, sft_dataset(), label_smoothing_factor=0.1))


def test_token_accuracy_on_tied_logits_parity(tok, tmp_path):
    """Half the head's rows identical (tokens added with one shared initial row) and the others
    small, so the shared logit is the row maximum on about half the tokens and ties exactly there;
    TRL's ``argmax`` counts only the first tied row. ``mean_token_accuracy`` matches TRL's (a label
    on a later tied row is a miss), as do the loss and every gradient."""
    theirs, ours = _pair(tok, tmp_path, sft_dataset())
    for trainer in (theirs, ours):
        with torch.no_grad():
            head = trainer.model.get_output_embeddings().weight
            head[0::2] *= 0.01
            head[1::2] = head[1].clone()
    batch = _check(theirs, ours)
    with torch.no_grad():  # the case is live: labels on tied maximal rows that are not the first
        logits = theirs.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        z, y = logits[:, :-1], batch["labels"][:, 1:]
        tied_late = (y > 1) & (y % 2 == 1) & (z.gather(-1, y.clamp(min=0)[..., None])[..., 0] == z.amax(-1))
        assert int(tied_late.sum()) >= 1


@pytest.mark.parametrize("case", ["chunked", "num-items", "label-smoothing", "pad-free"])
def test_dft_parity(tok, tmp_path, monkeypatch, case):
    """``loss_type="dft"`` (each token's NLL weighted by its detached probability) on the per-token engine:
    loss, ``mean_token_accuracy``, ``entropy`` and grads equal TRL's (rel <= 1e-4) with 3-token tiles, with the
    Trainer's ``num_items_in_batch``, with ``label_smoothing_factor=0.1`` (TRL smooths the NLL alone, so DFT
    ignores it) and forced pad-free (packed: one varlen call per layer)."""
    cfg = {"label_smoothing_factor": 0.1} if case == "label-smoothing" else {}
    liger = {"liger_chunk_tokens": 3} if case == "chunked" else None
    if case == "pad-free":
        monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "1")
    theirs, ours = _pair(tok, tmp_path, sft_dataset(), liger_kwargs=liger, loss_type="dft", **cfg)
    calls = varlen_call_count()
    _check(theirs, ours, num_items_in_batch=torch.tensor(57) if case == "num-items" else None)
    assert varlen_call_count() - calls == (ours.model.config.num_hidden_layers if case == "pad-free" else 0)


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_batch_without_scored_tokens(tok, tmp_path, loss_type):
    """Every label ignored (a micro-batch of prompts only): loss 0 and zero metrics, as TRL's clamped divisor gives,
    for both loss types (no crash on the statistics an empty pass leaves)."""
    theirs, ours = _pair(tok, tmp_path, sft_dataset(), loss_type=loss_type)
    batch = first_batch(theirs)
    batch["labels"] = torch.full_like(batch["labels"], -100)
    for trainer in (theirs, ours):
        trainer._metrics["train"].clear()
    with torch.no_grad():
        losses = [float(t.compute_loss(t.model, dict(batch))) for t in (theirs, ours)]
    assert losses == [0.0, 0.0]
    m_t = {k: v[-1] for k, v in theirs._metrics["train"].items()}
    m_o = {k: v[-1] for k, v in ours._metrics["train"].items()}
    assert_metrics_match(m_o, m_t, TOL)
    assert m_o["entropy"] == 0.0 and m_o["mean_token_accuracy"] == 0.0


def test_dft_is_not_nll(tok, tmp_path):
    """The case is live: on the same batch DFT's loss differs from the NLL's by more than 10x the parity
    tolerance (each token's weight p_y < 1)."""
    _, dft = _pair(tok, tmp_path / "dft", sft_dataset(), loss_type="dft")
    _, nll = _pair(tok, tmp_path / "nll", sft_dataset())
    batch = first_batch(nll)
    with torch.no_grad():
        a = float(dft.compute_loss(dft.model, dict(batch)))
        b = float(nll.compute_loss(nll.model, dict(batch)))
    assert abs(a - b) > 10 * TOL * abs(b), (a, b)


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_short_run_tracks_trl(tok, tmp_path, loss_type):
    """4 Adam steps: each logged loss, token accuracy and entropy track TRL's run (rel <= 1e-4)."""
    theirs, ours = _pair(tok, tmp_path, sft_dataset(), max_steps=4, learning_rate=3e-3, loss_type=loss_type)
    lo, lt = train_logs(theirs, ours, 4, same_names=False)
    for a, b in zip(lo, lt):
        for key in ("loss", "mean_token_accuracy", "entropy"):
            assert abs(a[key] - b[key]) <= TOL * max(1.0, abs(b[key])), (key, a[key], b[key])


@pytest.mark.parametrize(
    "cfg, kwargs, option",
    [
        ({}, {"compute_loss_func": lambda outputs, labels, num_items_in_batch=None: outputs.loss},
         "compute_loss_func"),
    ],
)
def test_unsupported_options_raise(tok, tmp_path, cfg, kwargs, option):
    """Options TRL serves but use_liger=True cannot: ValueError at construction naming the option."""
    with pytest.raises(ValueError, match=option):
        SFTTrainer(build_tiny_model(tok), args=sft_config(tmp_path, **cfg), train_dataset=sft_dataset(),
                   processing_class=tok, use_liger=True, **kwargs)
