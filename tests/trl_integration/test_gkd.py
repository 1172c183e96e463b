"""GKDTrainer(use_liger=True) against TRL 1.16's own GKD path (trl.experimental.gkd), tiny offline fp32 models.

Generation is off (``lmbda=0``, ``seq_kd=False``) so both trainers see the dataset's batches and runs are
deterministic. Parity tests build TRL's trainer (use_liger=False) and ours on deep copies of the same student and
teacher and compare the loss and every student gradient to a relative error <= 1e-4: both compute the same fp32
generalized JSD in a different order (TRL from full log-softmaxes, ours tile by tile), so they agree to ~1e-6;
1e-4 leaves room for accumulation-order noise only. The teacher has other weights (its own seed), so the
divergence is not 0.
"""

import copy

import pytest

from liger_losses.trl_integration.gkd import GKDTrainer

from .utils import (
    PAIRS,
    assert_grads_match,
    build_tiny_model,
    first_batch,
    make_pair,
    preference_dataset,
    rel,
    student_teacher,
    train_logs,
    trl_config,
)

TOL = 1e-4


def gkd_config(tmp_path, **overrides):
    from trl.experimental.gkd import GKDConfig

    return trl_config(GKDConfig, tmp_path, **{"max_length": 32, "lmbda": 0.0, "seq_kd": False, **overrides})


def chat_dataset(n=PAIRS):
    """Conversations (user prompt, assistant chosen answer) of the bundled preference set."""
    from datasets import Dataset

    return Dataset.from_list([
        {"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["chosen"]}]}
        for r in preference_dataset(n).to_list()
    ])


def _pair(tok, tmp_path, *, liger_kwargs=None, **cfg):
    """(TRL trainer, our trainer) on copies of one student (seed 0) and teacher (seed 1, wider: H=96)."""
    return make_pair(GKDTrainer, student_teacher(tok), lambda run_dir: gkd_config(run_dir, **cfg), tmp_path,
                     chat_dataset, liger_kwargs=liger_kwargs, processing_class=tok)


@pytest.mark.parametrize(
    "beta, num_items, chunk",
    [(0.5, None, 5), (0.0, None, None), (1.0, 13, 7), (0.3, None, None)],
    ids=["jsd-chunk5", "forward_kl", "reverse_kl-num_items", "jsd0.3"],
)
def test_step0_parity(tok, tmp_path, beta, num_items, chunk):
    """Loss and every student gradient equal TRL's (rel <= 1e-4) for beta 0 (forward KL), 1 (reverse KL) and
    in between (JSD), with and without num_items_in_batch, small tiles (chunk 5/7 tokens) and default ones."""
    theirs, ours = _pair(tok, tmp_path, liger_kwargs={"liger_chunk_tokens": chunk}, beta=beta)
    batch = first_batch(theirs)
    theirs.model.train()
    ours.model.train()
    loss_t = theirs.compute_loss(theirs.model, batch, num_items_in_batch=num_items)
    loss_o = ours.compute_loss(ours.model, batch, num_items_in_batch=num_items)
    assert float(loss_t) > 0
    assert rel(loss_o.detach(), loss_t.detach()) <= TOL, (float(loss_o), float(loss_t))
    assert_grads_match(loss_t, loss_o, theirs, ours, TOL)
    assert all(t.grad is None for t in ours.teacher_model.parameters())


def test_short_run_tracks_trl(tok, tmp_path):
    """5 optimizer steps (lmbda=0: no generation): each logged loss tracks TRL's run (rel <= 1e-3: fp32 sums in
    another order, amplified a little by Adam), the logged names are TRL's, and the loss falls."""
    theirs, ours = _pair(tok, tmp_path, max_steps=5)
    _, lt = train_logs(theirs, ours, 5, loss_tol=1e-3)
    assert lt[-1]["loss"] < lt[0]["loss"]


def test_use_liger_false_is_trl(tok, tmp_path):
    """use_liger=False is TRL's trainer: the same loss as trl's GKDTrainer itself, bit for bit."""
    from trl.experimental.gkd import GKDTrainer as TRLGKDTrainer

    student, teacher = build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=1)
    ours = GKDTrainer(copy.deepcopy(student), copy.deepcopy(teacher), gkd_config(tmp_path / "a"),
                      train_dataset=chat_dataset(), processing_class=tok)
    plain = TRLGKDTrainer(copy.deepcopy(student), copy.deepcopy(teacher), gkd_config(tmp_path / "b"),
                          train_dataset=chat_dataset(), processing_class=tok)
    batch = first_batch(plain)
    assert float(ours.compute_loss(ours.model, batch)) == float(plain.compute_loss(plain.model, batch))


def test_softcapped_teacher_is_rejected(tok, tmp_path):
    """A teacher whose logits are softcapped cannot be served: ValueError naming final_logit_softcapping."""
    teacher = build_tiny_model(tok, seed=1)
    teacher.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        GKDTrainer(build_tiny_model(tok), teacher, gkd_config(tmp_path), train_dataset=chat_dataset(),
                   processing_class=tok, use_liger=True)


def test_shared_head_transform(tok):
    """Student and teacher with the same logit softcap: the transform is handed to the loss (softcap 30,
    scale 1) instead of being rejected; a mismatch names the option (covered above)."""
    from liger_losses.trl_integration.gkd import shared_head_transform

    student, teacher = build_tiny_model(tok), build_tiny_model(tok, seed=1)
    assert shared_head_transform(student, teacher) == {"softcap": None, "logit_scale": 1.0}
    student.config.final_logit_softcapping = 30.0
    teacher.config.final_logit_softcapping = 30.0
    assert shared_head_transform(student, teacher) == {"softcap": 30.0, "logit_scale": 1.0}
