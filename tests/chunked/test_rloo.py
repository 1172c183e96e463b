"""Tests of liger_losses/chunked/rloo.py against a float64 reference and TRL 1.16's own RLOO loss code.

Bar: float64 inputs, loss and the gradients of hidden, weight and bias within 1e-6 relative of the
float64 reference on full logits (the issue's bar; a float64 head runs in float64 end to end, so the
ratio of a sequence's *summed* log-probs carries no float32 error: ~1e-15 measured here); metrics
within 1e-6. chunk_tokens=4 cuts sequences (two phases), chunk_tokens=T keeps them whole (one pass).
"""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from liger_losses.chunked.rloo import RLOO_TRL_METRIC_NAMES, fused_linear_rloo_loss
from tests.chunked.grpo_reference import reference_logps
from tests.helpers import assert_close_rel

B, T, H, V = 4, 6, 8, 20
TOL = 1e-6


def _case(seed=0, pad_row=None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    h = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[1, 4:] = -100
    if pad_row is not None:
        labels[pad_row] = -100
    adv = torch.randn(B, generator=g, dtype=torch.float64) + 1.0  # mostly positive: a loss without cancellation
    with torch.no_grad():
        lp, _, _ = reference_logps(w, h, b, labels)
    old = lp.sum(-1) + torch.randn(B, generator=g, dtype=torch.float64)
    return w, h, b, labels, adv, old


def _reference(w, h, b, labels, adv, old, eps=0.2, eps_high=0.28, temperature=1.0):
    wd, hd, bd = [x.detach().clone().requires_grad_() for x in (w, h, b)]
    lp, ent, mask = reference_logps(wd, hd, bd, labels, temperature)
    r = torch.exp(lp.sum(-1) - old)
    loss = (-torch.min(r * adv, r.clamp(1 - eps, 1 + eps_high) * adv)).mean()
    loss.backward()
    low = ((r < 1 - eps) & (adv < 0)).double()
    high = ((r > 1 + eps_high) & (adv > 0)).double()
    metrics = {"entropy": float((ent * mask).sum() / mask.sum()), "clip_ratio_low_mean": float(low.mean()),
               "clip_ratio_low_min": float(low.min()), "clip_ratio_high_mean": float(high.mean()),
               "clip_ratio_high_max": float(high.max()),
               "clip_ratio_region_mean": float(((low + high) > 0).double().mean())}
    return loss.detach(), metrics, (wd.grad, hd.grad, bd.grad), (lp, ent, mask)


def _fused(w, h, b, labels, adv, old, **kw):
    wl, hl, bl = [x.detach().clone().requires_grad_() for x in (w, h, b)]
    out = fused_linear_rloo_loss(wl, hl, labels, bias=bl, advantages=adv, old_logps=old, epsilon_high=0.28,
                                 impl="torch", **kw)
    out.loss.backward()
    return out, (wl.grad, hl.grad, bl.grad)


@pytest.mark.parametrize("chunk_tokens,pad_row", [(4, None), (T, None), (4, 2)])
def test_matches_float64_reference(chunk_tokens, pad_row):
    """Loss, gradients and metrics within 1e-6; sequences cut by chunks or whole; a fully padded one."""
    w, h, b, labels, adv, old = _case(0, pad_row)
    loss, metrics, grads, _ = _reference(w, h, b, labels, adv, old)
    out, got = _fused(w, h, b, labels, adv, old, chunk_tokens=chunk_tokens)
    assert_close_rel(out.loss, loss, TOL, "loss")
    for name, a, c in zip(("grad_weight", "grad_hidden", "grad_bias"), got, grads):
        assert_close_rel(a, c, TOL, name)
    for k, v in metrics.items():
        assert abs(float(out.metrics[k]) - v) <= 1e-6, (k, float(out.metrics[k]), v)
    assert metrics["clip_ratio_region_mean"] > 0  # the clipping is exercised


def test_parity_with_trl():
    """TRL 1.16's RLOOTrainer._compute_loss on the same float64 per-token log-probs: loss, gradients
    and every metric it logs within 1e-6."""
    rloo = pytest.importorskip("trl.trainer.rloo_trainer")
    w, h, b, labels, adv, old = _case(1, pad_row=3)
    wd, hd, bd = [x.detach().clone().requires_grad_() for x in (w, h, b)]
    lp, ent, mask = reference_logps(wd, hd, bd, labels)
    acc = SimpleNamespace(gather=lambda x: x, reduce=lambda x, reduction="sum": x, gather_for_metrics=lambda x: x)
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, ent, None), aux_loss_enabled=False,
        epsilon_low=0.2, epsilon_high=0.28, model=SimpleNamespace(training=True), accelerator=acc,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "old_logps": old, "advantages": adv}
    trl_loss = rloo.RLOOTrainer._compute_loss(stand_in, None, inputs)
    trl_loss.backward()
    out, got = _fused(w, h, b, labels, adv, old, chunk_tokens=4)
    assert_close_rel(out.loss, trl_loss, TOL, "loss")
    for name, a, c in zip(("grad_weight", "grad_hidden", "grad_bias"), got, (wd.grad, hd.grad, bd.grad)):
        assert_close_rel(a, c, TOL, name)
    ours = {RLOO_TRL_METRIC_NAMES[k]: float(v) for k, v in out.metrics.items()}
    for k, v in stand_in._metrics["train"].items():
        assert abs(ours[k] - v[-1]) <= 1e-6 or (math.isnan(v[-1]) and math.isnan(ours[k])), (k, ours[k], v[-1])


def test_bad_inputs():
    """Wrong shapes and bad epsilons raise errors naming the argument."""
    w, h, b, labels, adv, old = _case(2)
    with pytest.raises(ValueError, match="advantages"):
        fused_linear_rloo_loss(w, h, labels, advantages=adv[:2], old_logps=old)
    with pytest.raises(ValueError, match="old_logps"):
        fused_linear_rloo_loss(w, h, labels, advantages=adv, old_logps=old[:, None])
    with pytest.raises(ValueError, match="epsilon_low"):
        fused_linear_rloo_loss(w, h, labels, advantages=adv, old_logps=old, epsilon_low=-1.0)
