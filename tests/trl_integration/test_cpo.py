"""CPOTrainer(use_liger=True) (CPO, SimPO, AlphaPO) against TRL 1.16's own CPO path, tiny offline fp32 models.

Parity tests build TRL's trainer (use_liger=False) and ours on deep copies of the same weights and batch and
compare the loss, every metric TRL logs and every parameter gradient to a relative error <= 1e-4: both compute
the same fp32 math (log-softmax, sums, the CPO formula) in a different order, so they agree to ~1e-6; 1e-4 leaves
room for accumulation-order noise only (``logits/*`` come from a mean identity instead of the full logits).
"""

import copy

import pytest

from liger_losses.trl_integration.cpo import CPOTrainer, mean_logit_all_positions

from .utils import (
    PAIRS,
    build_tiny_model,
    check_batch_loss_metrics,
    first_batch,
    policy_pair,
    preference_dataset,
    rel,
    train_logs,
    trl_config,
)

TOL = 1e-4


def cpo_config(tmp_path, **overrides):
    from trl.experimental.cpo import CPOConfig

    return trl_config(CPOConfig, tmp_path, **{"max_length": 32, **overrides})


def _pair(tok, tmp_path, **kwargs):
    """(TRL trainer, our trainer) on copies of one policy (seed 0)."""
    return policy_pair(CPOTrainer, cpo_config, tok, tmp_path, **kwargs)


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
    m_t = check_batch_loss_metrics(theirs, ours, TOL)
    assert {"rewards/chosen", "logits/chosen", "nll_loss"} <= set(m_t)


def test_eval_metrics_are_prefixed(tok, tmp_path):
    """In evaluation the metrics carry TRL's ``eval_`` prefix and equal TRL's (rel <= 1e-4)."""
    theirs, ours = _pair(tok, tmp_path)
    m_t = check_batch_loss_metrics(theirs, ours, TOL, train_eval="eval")
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
    _, lt = train_logs(theirs, ours, steps, loss_tol=1e-3)
    assert lt[-1]["loss"] < lt[0]["loss"]  # it trains


def test_short_run_tracks_trl(tok, tmp_path):
    """5 optimizer steps of SimPO with our loss: each logged loss tracks TRL's run (rel <= 1e-3: fp32 sums in
    another order, amplified a little by Adam over steps), the logged names are TRL's, and the loss falls."""
    theirs, ours = _pair(tok, tmp_path, max_steps=5, loss_type="simpo", cpo_alpha=0.0, beta=2.0)
    _short_run(theirs, ours, 5)


@pytest.mark.slow
def test_patched_short_run_tracks_trl(tok, tmp_path):
    """As test_short_run_tracks_trl (CPO sigmoid) with the model's layers patched (liger_patch_model=True:
    RMSNorm/RoPE/SwiGLU kernels; slow in the Triton interpreter, so 4 steps): loss rel <= 1e-3 per step."""
    from liger_losses.kernels.rms_norm import LigerRMSNorm

    theirs, ours = _pair(tok, tmp_path, liger_kwargs={"liger_patch_model": True}, max_steps=4)
    assert isinstance(ours.model.model.norm, LigerRMSNorm)
    _short_run(theirs, ours, 4)


def test_use_liger_false_is_trl(tok, tmp_path):
    """use_liger=False is TRL's trainer: the same loss as trl's CPOTrainer itself, bit for bit."""
    from trl.experimental.cpo import CPOTrainer as TRLCPOTrainer

    policy = build_tiny_model(tok, seed=0)
    ours = CPOTrainer(copy.deepcopy(policy), cpo_config(tmp_path / "a"), train_dataset=preference_dataset(PAIRS),
                      processing_class=tok)
    plain = TRLCPOTrainer(copy.deepcopy(policy), cpo_config(tmp_path / "b"), train_dataset=preference_dataset(PAIRS),
                          processing_class=tok)
    batch = first_batch(plain)
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
