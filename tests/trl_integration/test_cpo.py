"""CPOTrainer(use_liger=True) (CPO, SimPO, AlphaPO) against TRL 1.16's own CPO path, tiny offline fp32 models.

Parity tests build TRL's trainer (use_liger=False) and ours on deep copies of the same weights and batch and
compare the loss, every metric TRL logs and every parameter gradient to a relative error <= 1e-4: both compute
the same fp32 math (log-softmax, sums, the CPO formula) in a different order, so they agree to ~1e-6; 1e-4 leaves
room for accumulation-order noise only (``logits/*`` come from a mean identity instead of the full logits).
"""

import copy

import pytest

from liger_losses.trl_integration.cpo import CPOTrainer, mean_logit_all_positions

from .utils import PAIRS, assert_metrics_match, build_tiny_model, build_tokenizer, grads_of, preference_dataset, rel

TOL = 1e-4


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def cpo_config(tmp_path, **overrides):
    from trl.experimental.cpo import CPOConfig

    kwargs = dict(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to="none", gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, seed=0,
        data_seed=0, dataloader_num_workers=0, max_length=32, disable_tqdm=True,
    )
    kwargs.update(overrides)
    return CPOConfig(**kwargs)


def _pair(tok, tmp_path, *, liger_kwargs=None, **cfg):
    """(TRL trainer, our trainer) on copies of one policy (seed 0)."""
    policy = build_tiny_model(tok, seed=0)
    out = []
    for use_liger in (False, True):
        kwargs = dict(liger_kwargs or {}) if use_liger else {}
        if use_liger:
            kwargs.setdefault("liger_patch_model", False)
        out.append(CPOTrainer(
            copy.deepcopy(policy), cpo_config(tmp_path / ("ours" if use_liger else "trl"), **cfg),
            train_dataset=preference_dataset(PAIRS), processing_class=tok, use_liger=use_liger, **kwargs,
        ))
    return out


def _batch(trainer):
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def _check_step0(theirs, ours, train_eval="train"):
    batch = _batch(theirs)
    theirs.model.train()
    ours.model.train()
    loss_t, m_t = theirs.get_batch_loss_metrics(theirs.model, batch, train_eval)
    loss_o, m_o = ours.get_batch_loss_metrics(ours.model, batch, train_eval)
    assert rel(loss_o.detach(), loss_t.detach()) <= TOL, (float(loss_o), float(loss_t))
    assert_metrics_match(m_o, m_t, TOL)
    loss_t.backward()
    loss_o.backward()
    g_t, g_o = grads_of(theirs.model), grads_of(ours.model)
    assert g_t.keys() == g_o.keys() and g_t
    for name, g in g_t.items():
        err = float((g_o[name] - g).norm() / g.norm().clamp_min(1e-30))
        assert err <= TOL, f"grad {name}: rel err {err:.2e}"
    return m_t


@pytest.mark.parametrize(
    "cfg",
    [
        dict(loss_type="sigmoid"),
        dict(loss_type="sigmoid", label_smoothing=0.1, cpo_alpha=0.5),
        dict(loss_type="hinge", beta=0.5),
        dict(loss_type="ipo"),
        dict(loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.5),
        dict(loss_type="alphapo", alpha=0.3, beta=2.0),
    ],
    ids=["sigmoid", "smoothed", "hinge", "ipo", "simpo", "alphapo"],
)
def test_step0_parity(tok, tmp_path, cfg):
    """Loss, every metric TRL logs (rewards, logps, logits, nll_loss) and every gradient equal TRL's
    (rel <= 1e-4), with small tiles (chunk 5 tokens, so tiles cut through sequences and pairs)."""
    theirs, ours = _pair(tok, tmp_path, liger_kwargs={"liger_chunk_tokens": 5}, **cfg)
    m_t = _check_step0(theirs, ours)
    assert {"rewards/chosen", "logits/chosen", "nll_loss"} <= set(m_t)


def test_eval_metrics_are_prefixed(tok, tmp_path):
    """In evaluation the metrics carry TRL's ``eval_`` prefix and equal TRL's (rel <= 1e-4)."""
    theirs, ours = _pair(tok, tmp_path)
    m_t = _check_step0(theirs, ours, train_eval="eval")
    assert all(k.startswith("eval_") for k in m_t)


def test_mean_logit_identity_matches_full_logits():
    """mean_logit_all_positions equals the mean of the full fp32 logits (rel <= 1e-5: fp32 sums), with bias,
    logit_scale, and with a softcap (chunked path, chunk smaller than the rows)."""
    import torch

    h, w, b = torch.randn(3, 5, 16), torch.randn(40, 16), torch.randn(40)
    z = (h @ w.T + b) * 0.7
    assert rel(mean_logit_all_positions(h, w, b, logit_scale=0.7), z.mean()) <= 1e-5
    capped = 2.0 * torch.tanh(z / 2.0)
    got = mean_logit_all_positions(h, w, b, softcap=2.0, logit_scale=0.7, chunk_rows=4)
    assert rel(got, capped.mean()) <= 1e-5


def _short_run(theirs, ours, steps):
    theirs.train()
    ours.train()
    lt = [h for h in theirs.state.log_history if "loss" in h]
    lo = [h for h in ours.state.log_history if "loss" in h]
    assert len(lt) == len(lo) == steps
    assert set(lt[0]) == set(lo[0])
    for a, b in zip(lo, lt):
        assert rel(a["loss"], b["loss"]) <= 1e-3, (a["loss"], b["loss"])
    assert lt[-1]["loss"] < lt[0]["loss"]  # it trains


def test_short_run_tracks_trl(tok, tmp_path):
    """10 optimizer steps of SimPO with our loss: each logged loss tracks TRL's run (rel <= 1e-3: fp32 sums in
    another order, amplified a little by Adam over steps), the logged names are TRL's, and the loss falls."""
    theirs, ours = _pair(tok, tmp_path, max_steps=10, loss_type="simpo", cpo_alpha=0.0, beta=2.0)
    _short_run(theirs, ours, 10)


@pytest.mark.slow
def test_patched_short_run_tracks_trl(tok, tmp_path):
    """As test_short_run_tracks_trl (CPO sigmoid) with the model's layers patched (liger_patch_model=True:
    RMSNorm/RoPE/SwiGLU kernels; slow in the Triton interpreter): loss rel <= 1e-3 per step."""
    from liger_losses.kernels.rms_norm import LigerRMSNorm

    theirs, ours = _pair(tok, tmp_path, liger_kwargs={"liger_patch_model": True}, max_steps=10)
    assert isinstance(ours.model.model.norm, LigerRMSNorm)
    _short_run(theirs, ours, 10)


def test_use_liger_false_is_trl(tok, tmp_path):
    """use_liger=False is TRL's trainer: the same loss as trl's CPOTrainer itself, bit for bit."""
    from trl.experimental.cpo import CPOTrainer as TRLCPOTrainer

    policy = build_tiny_model(tok, seed=0)
    ours = CPOTrainer(copy.deepcopy(policy), cpo_config(tmp_path / "a"), train_dataset=preference_dataset(PAIRS),
                      processing_class=tok)
    plain = TRLCPOTrainer(copy.deepcopy(policy), cpo_config(tmp_path / "b"), train_dataset=preference_dataset(PAIRS),
                          processing_class=tok)
    batch = _batch(plain)
    assert float(ours.compute_loss(ours.model, batch)) == float(plain.compute_loss(plain.model, batch))


def test_bad_options_raise(tok, tmp_path):
    """A bad value of our keyword, or a CPO option our loss rejects (negative cpo_alpha), raises at construction,
    naming it."""
    with pytest.raises(ValueError, match="liger_chunk_tokens"):
        CPOTrainer(build_tiny_model(tok), cpo_config(tmp_path), train_dataset=preference_dataset(PAIRS),
                   processing_class=tok, use_liger=True, liger_chunk_tokens=0)
    with pytest.raises(ValueError, match="cpo_alpha"):
        CPOTrainer(build_tiny_model(tok), cpo_config(tmp_path, cpo_alpha=-1.0),
                   train_dataset=preference_dataset(PAIRS), processing_class=tok, use_liger=True)
