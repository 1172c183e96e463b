"""Float64 references for the preference-loss tests: full logits, log-softmax, and TRL 1.16's own code.

``token_outputs64`` computes, in float64 from the whole ``[B, T, V]`` logits, what TRL's fused LM head
returns per token (``log_probs``, ``entropy``, ``mean_logits``, ``is_top1``), differentiable w.r.t.
the float64 copies of hidden/weight/bias. The ``trl_*`` functions run TRL 1.16's loss code itself
(``DPOTrainer._compute_loss``, ``KTOTrainer._compute_loss``, ``ORPOTrainer.odds_ratio_loss``,
``CPOTrainer.cpo_loss``) unbound, on a stand-in ``self`` and stand-in models that return those
per-token outputs, so the test reference is TRL's formula on plainly computed log-probs.
``assert_matches_trl_cpo`` checks a CPO/SimPO output against ``trl_cpo_reference`` (shared by their tests).
"""

from __future__ import annotations

import os
from collections import defaultdict
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from liger_losses.chunked.preference.cpo import TRL_METRIC_NAMES as CPO_METRIC_NAMES
from tests.helpers import TOL, rel_err

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # ORPO/CPO live in trl.experimental


def make_inputs(batch, seq, hid, vocab, *, prompt=2, dtype=torch.float32, ref_noise=0.3, bias=False,
                empty_rows=(), seed=0):
    """Random fp32 leaf tensors: weight [V,H], hidden [B,T,H], ref_hidden (hidden + noise), labels with
    the first ``prompt`` positions and a random tail of padding ignored (-100); rows in
    ``empty_rows`` fully ignored."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, hid, generator=g) / hid**0.5).to(dtype).requires_grad_()
    hidden = torch.randn(batch, seq, hid, generator=g).to(dtype).requires_grad_()
    ref_hidden = (hidden.detach() + ref_noise * torch.randn(batch, seq, hid, generator=g)).to(dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[:, :prompt] = -100
    for b in range(batch):
        pad = int(torch.randint(0, max(1, seq - prompt - 1), (1,), generator=g))
        if pad:
            labels[b, seq - pad:] = -100
    for b in empty_rows:
        labels[b] = -100
    b_ = (0.1 * torch.randn(vocab, generator=g)).to(dtype).requires_grad_() if bias else None
    return weight, hidden, ref_hidden, labels, b_


def leaf64(*tensors):
    """Float64 leaf copies (requires_grad where the original does)."""
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
        else:
            out.append(t.detach().double().requires_grad_(t.requires_grad))
    return out


def token_outputs64(weight, hidden, labels, bias=None, *, ignore_index=-100, token_weights=None):
    """Per-token outputs [B, T] of the full float64 logits (TRL's fused-head fields), 0 at ignored."""
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    logp = torch.log_softmax(logits, dim=-1)
    mask = labels != ignore_index
    safe = labels.clamp(min=0)
    tok = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * mask
    entropy = -(logp.exp() * logp).sum(-1)
    return SimpleNamespace(
        log_probs=tok,
        entropy=entropy.detach() * mask,
        mean_logits=logits.mean(-1).detach() * mask,
        is_top1=(logits.argmax(-1) == safe) & mask,
        logits=logits,
        mask=mask,
        aux_loss=None,
        log_sum_sq_probs=torch.logsumexp(2.0 * logp, dim=-1).detach() * mask,
    )


def _accelerator():
    return SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)


def _stand_in_model():
    """An empty nn.Module in training mode (TRL inspects ``self.model`` for PEFT and checkpointing)."""
    model = torch.nn.Module()
    model.is_gradient_checkpointing = False
    return model


def _last(metrics):
    return {k: float(v[-1]) for k, v in metrics["train"].items() if len(v)}


def completion_inputs(mask):
    """TRL's unshifted batch tensors for shifted valid-label mask [B, T]: completion_mask [B, T+1]."""
    B, T = mask.shape
    comp = torch.cat([torch.zeros(B, 1, dtype=torch.long), mask.long()], dim=1)
    return {
        "input_ids": torch.zeros(B, T + 1, dtype=torch.long),
        "attention_mask": torch.ones(B, T + 1, dtype=torch.long),
        "completion_mask": comp,
    }


def trl_dpo(policy, ref, mask, *, beta=0.1, loss_type=("sigmoid",), loss_weights=None, label_smoothing=0.0,
            f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5, discopop_tau=0.05, ld_alpha=None,
            use_weighting=False):
    """TRL 1.16 ``DPOTrainer._compute_loss`` on the given per-token outputs -> (loss, {trl name: value})."""
    from trl.trainer.dpo_trainer import DPOTrainer

    loss_type = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    me = SimpleNamespace(
        model=_stand_in_model(),
        ref_model=lambda **kw: ref,
        accelerator=_accelerator(),
        aux_loss_enabled=False,
        precompute_ref_logps=False,
        ld_alpha=ld_alpha,
        loss_types=loss_type,
        loss_weights=list(loss_weights) if loss_weights is not None else [1.0] * len(loss_type),
        beta=beta,
        f_divergence_type=f_divergence_type,
        f_alpha_divergence_coef=f_alpha_divergence_coef,
        label_smoothing=label_smoothing,
        use_weighting=use_weighting,
        args=SimpleNamespace(discopop_tau=discopop_tau, gradient_checkpointing_kwargs=None),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    loss = DPOTrainer._compute_loss(me, lambda **kw: policy, completion_inputs(mask), False)
    return loss, _last(me._metrics)


def trl_kto(policy, mask, preference_labels, ref_logps, kl_logps, ref_kl_logps, *, beta=0.1, loss_type="kto",
            desirable_weight=1.0, undesirable_weight=1.0):
    """TRL 1.16 ``KTOTrainer._compute_loss`` (precomputed-reference path) -> (loss, {trl name: value})."""
    from trl.trainer.kto_trainer import KTOTrainer

    calculate_kl = loss_type != "apo_zero_unpaired"
    me = SimpleNamespace(
        model=_stand_in_model(),
        accelerator=_accelerator(),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        calculate_KL=calculate_kl,
        loss_type=loss_type,
        beta=beta,
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        _compute_kl_logps=lambda model, batch: kl_logps.detach() if calculate_kl else None,
    )
    batch = completion_inputs(mask)
    batch["label"] = preference_labels
    batch["ref_logps"] = ref_logps
    if calculate_kl:
        batch["ref_KL_logps"] = ref_kl_logps
    loss = KTOTrainer._compute_loss(me, lambda **kw: policy, batch, False)
    return loss, _last(me._metrics)


def trl_batch_logps(logits, labels, average):
    """TRL's ``get_batch_logps`` (ORPO/CPO) on our already-shifted layout: pad one position so its
    internal shift lines ``logits[:, t]`` up with ``labels[:, t]``."""
    from trl.experimental.cpo import CPOTrainer

    B, T, V = logits.shape
    logits_ext = torch.cat([logits, logits.new_zeros(B, 1, V)], dim=1)
    labels_ext = torch.cat([torch.full((B, 1), -100, dtype=labels.dtype), labels], dim=1)
    return CPOTrainer.get_batch_logps(logits_ext, labels_ext, average_log_prob=average)


def chosen_nll(logits, labels):
    """TRL's ORPO/CPO NLL term: ``nn.CrossEntropyLoss()`` over the chosen half (ignore -100)."""
    half = logits.shape[0] // 2
    V = logits.shape[-1]
    return F.cross_entropy(logits[:half].reshape(-1, V), labels[:half].reshape(-1), ignore_index=-100)


def trl_orpo(chosen_avg, rejected_avg, *, beta=0.1):
    from trl.experimental.orpo import ORPOTrainer

    me = SimpleNamespace(beta=beta, accelerator=_accelerator())
    return ORPOTrainer.odds_ratio_loss(me, chosen_avg, rejected_avg)


def trl_cpo(chosen_logps, rejected_logps, *, beta=0.1, loss_type="sigmoid", label_smoothing=0.0,
            simpo_gamma=0.5, alpha=0.0):
    from trl.experimental.cpo import CPOTrainer

    me = SimpleNamespace(
        beta=beta, loss_type=loss_type, label_smoothing=label_smoothing, simpo_gamma=simpo_gamma, alpha=alpha,
        accelerator=_accelerator(),
    )
    return CPOTrainer.cpo_loss(me, chosen_logps, rejected_logps)


def valid_token_mean(values, mask):
    """Mean of ``values`` over ``mask`` (0 if empty)."""
    n = mask.sum()
    return float((values * mask).sum() / n) if n > 0 else 0.0


def grads(loss, *tensors):
    """Gradients of ``loss`` w.r.t. the tensors that require grad (None elsewhere)."""
    req = [t for t in tensors if t is not None and t.requires_grad]
    got = iter(torch.autograd.grad(loss, req))
    return [next(got) if (t is not None and t.requires_grad) else None for t in tensors]


def assert_metrics_match(ours, trl_metrics, names, *, tol=1e-5, skip=("num_tokens",)):
    """Every TRL-logged metric (but ``skip``) has our counterpart (via ``names``: ours -> TRL's)
    and agrees to ``tol`` relative (absolute below magnitude 1)."""
    inverse = {v: k for k, v in names.items()}
    for trl_name, ref in trl_metrics.items():
        if trl_name in skip:
            continue
        assert trl_name in inverse, f"no key of ours maps to TRL's {trl_name!r}"
        key = inverse[trl_name]
        assert key in ours, f"metric {key!r} (TRL {trl_name!r}) missing; have {sorted(ours)}"
        got = float(ours[key])
        assert abs(got - ref) <= tol * max(1.0, abs(ref)), f"{key}: {got} vs TRL {ref}"
    for key, v in ours.items():
        assert v.dim() == 0 and not v.requires_grad, f"metric {key} must be a detached 0-d tensor"


def trl_cpo_reference(w64, h64, b64, labels, *, beta=0.1, loss_type="sigmoid", label_smoothing=0.0,
                      simpo_gamma=0.5, alpha=0.0, cpo_alpha=1.0):
    """(loss, {trl name: value}) following TRL 1.16's CPO ``get_batch_loss_metrics`` in float64
    (``logits/*`` over valid tokens: our documented difference)."""
    logits = h64 @ w64.T
    if b64 is not None:
        logits = logits + b64
    logps = trl_batch_logps(logits, labels, average=loss_type in ("ipo", "simpo"))
    half = logps.shape[0] // 2
    losses, c_rew, r_rew = trl_cpo(logps[:half], logps[half:], beta=beta, loss_type=loss_type,
                                   label_smoothing=label_smoothing, simpo_gamma=simpo_gamma, alpha=alpha)
    nll = chosen_nll(logits, labels) if cpo_alpha != 0 else torch.tensor(0.0, dtype=torch.float64)
    loss = losses.mean() + cpo_alpha * nll
    mask = labels != -100
    mean_logits = logits.detach().mean(-1)
    logps = logps.detach()
    metrics = {
        "rewards/chosen": float(c_rew.mean()),
        "rewards/rejected": float(r_rew.mean()),
        "rewards/accuracies": float((c_rew > r_rew).float().mean()),
        "rewards/margins": float((c_rew - r_rew).mean()),
        "logps/rejected": float(logps[half:].mean()),
        "logps/chosen": float(logps[:half].mean()),
        "logits/rejected": valid_token_mean(mean_logits[half:], mask[half:]),
        "logits/chosen": valid_token_mean(mean_logits[:half], mask[:half]),
        "nll_loss": float(nll.detach()),
    }
    return loss, metrics


def assert_matches_trl_cpo(out, w, h, b, labels, trl_options):
    """CPO/SimPO ``out`` (from ``w, h, b``; ``b`` may be None) vs ``trl_cpo_reference(**trl_options)`` on
    float64 copies: loss, grads of hidden/weight/bias within the fp32 bar (1e-5), metrics via
    ``assert_metrics_match`` with the CPO metric names."""
    w64, h64, b64 = leaf64(w, h, b)
    loss64, m64 = trl_cpo_reference(w64, h64, b64, labels, **trl_options)
    assert rel_err(out.loss, loss64) <= TOL[torch.float32], (float(out.loss.detach()), float(loss64.detach()))
    for name, got, want in zip(("hidden", "weight", "bias"), grads(out.loss, h, w, b), grads(loss64, h64, w64, b64)):
        if want is not None:
            assert rel_err(got, want) <= TOL[torch.float32], name
    assert_metrics_match(out.metrics, m64, CPO_METRIC_NAMES)
