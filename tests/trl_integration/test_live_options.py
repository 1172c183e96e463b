"""Tests of liger_losses/trl_integration/live_options.py: the loss follows options set on the trainer mid-run.

TRL's DPO, KTO, CPO and ORPO trainers read ``self.beta`` (and their other loss options) at every step, so a callback
that sets them changes TRL's objective. Each case sets the same new values on TRL's trainer and ours after
construction; the next step's loss, every metric TRL logs and every gradient must equal TRL's (rel <= 1e-4, the
trainers' parity bar), and the case is live: that loss differs from the step before the change by more than 10x the
bar (ORPO's, whose beta scales only its small odds-ratio term, moved 8e-3).
"""

import pytest
import torch

from liger_losses.trl_integration.live_options import ConfigView, LiveLoss

from . import test_cpo, test_dpo, test_kto, test_orpo
from .utils import check_batch_loss_metrics, check_compute_loss, first_batch, rel, step0

TOL = 1e-4


def test_config_view_reads_overrides_first():
    """A view answers the overridden fields and falls through to the config for the rest; LiveLoss rebuilds only
    when a value it reads changed (lists compare by value)."""

    class Args:
        beta, loss_type, other = 0.1, ["sigmoid"], 7

    view = ConfigView(Args(), {"beta": 0.5})
    assert view.beta == 0.5 and view.loss_type == ["sigmoid"] and view.other == 7
    with pytest.raises(AttributeError):
        view.missing

    class Trainer:
        args = Args()
        beta = 0.1
        loss_types = ["sigmoid"]
        liger_loss = None

    built = []
    trainer = Trainer()
    live = LiveLoss(trainer, {"beta": "beta", "loss_type": "loss_types", "other": None},
                    lambda cfg: built.append((cfg.beta, cfg.loss_type, cfg.other)) or len(built))
    trainer.loss_types = ["sigmoid"]  # a new list of the same value
    live.refresh(trainer)
    assert built == []
    trainer.beta = 0.3
    live.refresh(trainer)
    live.refresh(trainer)
    assert built == [(0.3, ["sigmoid"], 7)] and trainer.liger_loss == 1
    trainer.args.other = 8  # a field TRL reads from the config
    live.refresh(trainer)
    assert built[-1] == (0.3, ["sigmoid"], 8)



CASES = {
    "dpo": (test_dpo, dict(beta=0.7, loss_types=["sigmoid", "ipo"], loss_weights=[1.0, 0.5])),
    "kto": (test_kto, dict(beta=0.7, desirable_weight=1.5)),
    "cpo": (test_cpo, dict(beta=0.7, label_smoothing=0.1)),
    "orpo": (test_orpo, dict(beta=0.7)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_options_set_on_the_trainer_change_the_loss_as_trls(tok, tmp_path, name):
    """Options set on both trainers after construction (DPO: beta and a second weighted loss type; KTO: beta and
    the desirable weight; CPO: beta and label smoothing; ORPO: beta): the next step equals TRL's and moved."""
    module, values = CASES[name]
    theirs, ours = module._pair(tok, tmp_path)
    paired = name in ("cpo", "orpo")  # TRL's CPO / ORPO step is get_batch_loss_metrics
    batch = first_batch(theirs)

    def loss_of(trainer):
        if paired:
            trainer.model.train()
            return trainer.get_batch_loss_metrics(trainer.model, batch)[0].detach()
        return step0(trainer, dict(batch))[0].detach()

    before = loss_of(ours)
    loss_of(theirs)  # both trainers one step on: TRL's token counter (num_tokens) counts it
    for trainer in (theirs, ours):
        trainer.model.zero_grad()
        if not paired:
            trainer._metrics["train"].clear()
        for attr, value in values.items():
            setattr(trainer, attr, value)
    if paired:
        check_batch_loss_metrics(theirs, ours, TOL)
    else:
        check_compute_loss(theirs, ours, TOL, batch)
    ours.model.zero_grad()
    after = loss_of(ours)
    assert rel(after, before) > 10 * TOL, (float(after), float(before))
    assert torch.isfinite(after)
