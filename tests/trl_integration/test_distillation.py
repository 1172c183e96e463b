"""DistillationTrainer(use_liger=True) against TRL 1.16's own (chunked) on-policy distillation, tiny fp32 models.

TRL's DistillationTrainer always generates its completions on-policy. Parity tests therefore generate one batch
with TRL's trainer and hand that same batch to both trainers' ``compute_loss`` (deep copies of the same student and
teacher), comparing the loss, the logged ``entropy`` and every student gradient to a relative error <= 1e-4: both
compute the same fp32 generalized JSD tile by tile in a different order, so they agree to ~1e-6. Short runs use
greedy generation (``do_sample=False``) so both runs generate the same completions while their weights agree.
"""

import copy

import pytest

from liger_losses.trl_integration.distillation import DistillationTrainer

from .utils import (
    PAIRS,
    assert_grads_match,
    build_tiny_model,
    build_tokenizer,
    make_pair,
    preference_dataset,
    rel,
    step0,
    student_teacher,
    train_logs,
    trl_config,
)

TOL = 1e-4


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_tokenizer()
    tokenizer.padding_side = "left"
    return tokenizer


def distill_config(tmp_path, **overrides):
    import trl

    return trl_config(trl.DistillationConfig, tmp_path, **{
        "max_completion_length": 8, "generation_kwargs": {"do_sample": False}, **overrides})


def prompt_dataset(n=PAIRS):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": r["prompt"]} for r in preference_dataset(n).to_list()])


def _pair(tok, tmp_path, *, liger_kwargs=None, **cfg):
    """(TRL trainer, our trainer) on copies of one student (seed 0) and teacher (seed 1, wider: H=96)."""
    return make_pair(DistillationTrainer, student_teacher(tok), lambda run_dir: distill_config(run_dir, **cfg),
                     tmp_path, prompt_dataset, liger_kwargs=liger_kwargs, processing_class=tok)


def _generated_batch(trainer):
    raw = next(iter(trainer.get_train_dataloader()))
    trainer.model.eval()
    return trainer._generate_and_score_completions(raw)


@pytest.mark.parametrize(
    "cfg, chunk",
    [(dict(), 5), (dict(beta=0.0), None), (dict(beta=0.5, temperature=0.7), 3)],
    ids=["reverse_kl-chunk5", "forward_kl", "jsd-temp0.7-chunk3"],
)
def test_step0_parity(tok, tmp_path, cfg, chunk):
    """On one generated batch: loss, logged entropy and every student gradient equal TRL's (rel <= 1e-4) for
    reverse KL (TRL's default beta=1), forward KL and JSD at temperature 0.7, small and default tiles."""
    theirs, ours = _pair(tok, tmp_path, liger_kwargs={"liger_chunk_tokens": chunk}, **cfg)
    batch = _generated_batch(theirs)
    assert batch["completion_mask"].sum() > 0
    loss_t, m_t = step0(theirs, batch)
    loss_o, m_o = step0(ours, batch)
    assert float(loss_t) > 0
    assert rel(loss_o.detach(), loss_t.detach()) <= TOL, (float(loss_o), float(loss_t))
    assert set(m_t) <= set(m_o) and "entropy" in m_t
    assert rel(m_o["entropy"], m_t["entropy"]) <= TOL
    assert_grads_match(loss_t, loss_o, theirs, ours, TOL)


def test_short_run_tracks_trl(tok, tmp_path):
    """5 optimizer steps with greedy on-policy generation: each logged loss and entropy track TRL's run
    (rel <= 1e-3: fp32 sums in another order, amplified a little by Adam), and the logged names are TRL's."""
    theirs, ours = _pair(tok, tmp_path, max_steps=5)
    lo, lt = train_logs(theirs, ours, 5, loss_tol=1e-3)
    for a, b in zip(lo, lt):
        assert rel(a["entropy"], b["entropy"]) <= 1e-3


def test_use_liger_false_is_trl(tok, tmp_path):
    """use_liger=False is TRL's trainer: the same loss as trl.DistillationTrainer itself on one batch, bit for bit."""
    import trl

    student, teacher = build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=1)
    ours = DistillationTrainer(copy.deepcopy(student), copy.deepcopy(teacher), distill_config(tmp_path / "a"),
                               train_dataset=prompt_dataset(), processing_class=tok)
    plain = trl.DistillationTrainer(copy.deepcopy(student), copy.deepcopy(teacher), distill_config(tmp_path / "b"),
                                    train_dataset=prompt_dataset(), processing_class=tok)
    batch = _generated_batch(plain)
    assert float(step0(ours, batch)[0]) == float(step0(plain, batch)[0])


def test_scaled_student_is_rejected(tok, tmp_path):
    """A student whose logits are scaled (logit_scale) cannot be served: ValueError naming the logit scale."""
    student = build_tiny_model(tok)
    student.config.logit_scale = 0.5
    with pytest.raises(ValueError, match="logit scale"):
        DistillationTrainer(student, build_tiny_model(tok, seed=1), distill_config(tmp_path),
                            train_dataset=prompt_dataset(), processing_class=tok, use_liger=True)
