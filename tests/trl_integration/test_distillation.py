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

from .utils import PAIRS, build_tiny_model, build_tokenizer, grads_of, preference_dataset, rel

TOL = 1e-4


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_tokenizer()
    tokenizer.padding_side = "left"
    return tokenizer


def distill_config(tmp_path, **overrides):
    import trl

    kwargs = dict(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to="none", gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, seed=0,
        data_seed=0, dataloader_num_workers=0, disable_tqdm=True, max_completion_length=8,
        generation_kwargs={"do_sample": False},
    )
    kwargs.update(overrides)
    return trl.DistillationConfig(**kwargs)


def prompt_dataset(n=PAIRS):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": r["prompt"]} for r in preference_dataset(n).to_list()])


def _pair(tok, tmp_path, *, liger_kwargs=None, **cfg):
    """(TRL trainer, our trainer) on copies of one student (seed 0) and teacher (seed 1, wider: H=96)."""
    student = build_tiny_model(tok, seed=0)
    teacher = build_tiny_model(tok, seed=1, hidden_size=96)
    out = []
    for use_liger in (False, True):
        kwargs = dict(liger_kwargs or {}) if use_liger else {}
        if use_liger:
            kwargs.setdefault("liger_patch_model", False)
        out.append(DistillationTrainer(
            copy.deepcopy(student), copy.deepcopy(teacher),
            distill_config(tmp_path / ("ours" if use_liger else "trl"), **cfg),
            train_dataset=prompt_dataset(), processing_class=tok, use_liger=use_liger, **kwargs,
        ))
    return out


def _generated_batch(trainer):
    raw = next(iter(trainer.get_train_dataloader()))
    trainer.model.eval()
    return trainer._generate_and_score_completions(raw)


def _step0(trainer, batch):
    trainer._metrics["train"].clear()
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


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
    loss_t, m_t = _step0(theirs, batch)
    loss_o, m_o = _step0(ours, batch)
    assert float(loss_t) > 0
    assert rel(loss_o.detach(), loss_t.detach()) <= TOL, (float(loss_o), float(loss_t))
    assert set(m_t) <= set(m_o) and "entropy" in m_t
    assert rel(m_o["entropy"], m_t["entropy"]) <= TOL
    loss_t.backward()
    loss_o.backward()
    g_t, g_o = grads_of(theirs.model), grads_of(ours.model)
    assert g_t.keys() == g_o.keys() and g_t
    for name, g in g_t.items():
        err = float((g_o[name] - g).norm() / g.norm().clamp_min(1e-30))
        assert err <= TOL, f"grad {name}: rel err {err:.2e}"


def test_short_run_tracks_trl(tok, tmp_path):
    """10 optimizer steps with greedy on-policy generation: each logged loss and entropy track TRL's run
    (rel <= 1e-3: fp32 sums in another order, amplified a little by Adam), and the logged names are TRL's."""
    theirs, ours = _pair(tok, tmp_path, max_steps=10)
    theirs.train()
    ours.train()
    lt = [h for h in theirs.state.log_history if "loss" in h]
    lo = [h for h in ours.state.log_history if "loss" in h]
    assert len(lt) == len(lo) == 10
    assert set(lt[0]) == set(lo[0])
    for a, b in zip(lo, lt):
        assert rel(a["loss"], b["loss"]) <= 1e-3, (a["loss"], b["loss"])
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
    assert float(_step0(ours, batch)[0]) == float(_step0(plain, batch)[0])


def test_scaled_student_is_rejected(tok, tmp_path):
    """A student whose logits are scaled (logit_scale) cannot be served: ValueError naming the logit scale."""
    student = build_tiny_model(tok)
    student.config.logit_scale = 0.5
    with pytest.raises(ValueError, match="logit scale"):
        DistillationTrainer(student, build_tiny_model(tok, seed=1), distill_config(tmp_path),
                            train_dataset=prompt_dataset(), processing_class=tok, use_liger=True)
