"""ORPOTrainer(use_liger=True) against TRL 1.16's own ORPO path, on tiny offline fp32 models.

Parity tests build TRL's trainer (use_liger=False) and ours on deep copies of the same weights and batch and
compare the loss, every metric TRL logs and every parameter gradient to a relative error <= 1e-4: both compute
the same fp32 math (log-softmax, sums, the odds ratio, the NLL over prompt + completion tokens) in a different
order, so they agree to ~1e-6; 1e-4 leaves room for accumulation-order noise only.
"""

import copy

import pytest

from liger_losses.trl_integration.orpo import ORPOTrainer

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


def orpo_config(tmp_path, **overrides):
    from trl.experimental.orpo import ORPOConfig

    return trl_config(ORPOConfig, tmp_path, **{"max_length": 32, **overrides})


def _pair(tok, tmp_path, **kwargs):
    """(TRL trainer, our trainer) on copies of one policy (seed 0)."""
    return policy_pair(ORPOTrainer, orpo_config, tok, tmp_path, **kwargs)


@pytest.mark.parametrize("beta, chunk", [(0.1, 5), (1.0, None)], ids=["beta0.1-chunk5", "beta1-default-chunk"])
def test_step0_parity(tok, tmp_path, beta, chunk):
    """Loss, every metric TRL logs (rewards, logps, logits, nll_loss, log_odds_*) and every gradient equal
    TRL's (rel <= 1e-4); chunk 5 tokens makes tiles cut through sequences and pairs."""
    theirs, ours = _pair(tok, tmp_path, liger_kwargs={"liger_chunk_tokens": chunk}, beta=beta)
    m_t = check_batch_loss_metrics(theirs, ours, TOL)
    assert {"log_odds_ratio", "log_odds_chosen", "nll_loss", "logits/rejected"} <= set(m_t)


def test_eval_metrics_are_prefixed(tok, tmp_path):
    """In evaluation the metrics carry TRL's ``eval_`` prefix and equal TRL's (rel <= 1e-4)."""
    theirs, ours = _pair(tok, tmp_path)
    m_t = check_batch_loss_metrics(theirs, ours, TOL, train_eval="eval")
    assert all(k.startswith("eval_") for k in m_t)


def test_short_run_tracks_trl(tok, tmp_path):
    """5 optimizer steps with our loss: each logged loss (and log_odds_ratio) tracks TRL's run (rel <= 1e-3:
    fp32 sums in another order, amplified a little by Adam), the logged names are TRL's, and the loss falls."""
    theirs, ours = _pair(tok, tmp_path, max_steps=5)
    lo, lt = train_logs(theirs, ours, 5, loss_tol=1e-3)
    for a, b in zip(lo, lt):
        assert rel(a["log_odds_ratio"], b["log_odds_ratio"]) <= 1e-3
    assert lt[-1]["loss"] < lt[0]["loss"]


def test_use_liger_false_is_trl(tok, tmp_path):
    """use_liger=False is TRL's trainer: the same loss as trl's ORPOTrainer itself, bit for bit."""
    from trl.experimental.orpo import ORPOTrainer as TRLORPOTrainer

    policy = build_tiny_model(tok, seed=0)
    ours = ORPOTrainer(copy.deepcopy(policy), orpo_config(tmp_path / "a"), train_dataset=preference_dataset(PAIRS),
                       processing_class=tok)
    plain = TRLORPOTrainer(copy.deepcopy(policy), orpo_config(tmp_path / "b"),
                           train_dataset=preference_dataset(PAIRS), processing_class=tok)
    batch = first_batch(plain)
    assert float(ours.compute_loss(ours.model, batch)) == float(plain.compute_loss(plain.model, batch))


def test_bad_options_raise(tok, tmp_path):
    """A bad value of our keyword, or a negative beta, raises ValueError at construction naming it."""
    with pytest.raises(ValueError, match="liger_chunk_tokens"):
        ORPOTrainer(build_tiny_model(tok), orpo_config(tmp_path), train_dataset=preference_dataset(PAIRS),
                    processing_class=tok, use_liger=True, liger_chunk_tokens=-3)
    with pytest.raises(ValueError, match="beta"):
        ORPOTrainer(build_tiny_model(tok), orpo_config(tmp_path, beta=-0.5), train_dataset=preference_dataset(PAIRS),
                    processing_class=tok, use_liger=True)
