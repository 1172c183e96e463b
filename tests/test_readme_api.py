"""The README's "API at a glance" code block, statement by statement, as a new user would run it.

Every test runs one statement of that block (README.md, the python block after
"## The API at a glance") spelled exactly as there (same names, argument order and keywords) on
tiny fp32 CPU inputs (the Triton kernels run in the interpreter, TRITON_INTERPRET=1 from
tests/conftest.py) and checks what the README promises: the return type (``LossOutput`` with
``.loss``/``.metrics`` for the losses, a plain tensor for cross-entropy without extras), a finite
loss, finite non-zero gradients into ``hidden`` and ``weight``, and, where a short formula exists,
the value against plain PyTorch in float64 (relative error ``||out - ref|| / ||ref||`` <= 1e-5, the
project's fp32 bar, tests/helpers.TOL). The README's undefined names (``n``, ``ref_hidden``,
``desirable``, ``my_objective``, ``config``, ``model``, ...) are given the meaning the
surrounding text implies.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

import liger_losses as ll
from liger_losses import LossOutput
from tests.helpers import TOL, rel_err

FP32 = TOL[torch.float32]  # 1e-5

# tiny shapes: P pairs -> B = 2P sequences of T tokens, hidden H, vocab V
P, T, H, V = 2, 6, 16, 32
B = 2 * P


@pytest.fixture(autouse=True)
def _revert_module_patches():
    """apply_liger_kernels patches RoPE module-wide; leave later tests with plain transformers."""
    yield
    ll.revert_liger_kernels()


# --------------------------------------------------------------------------- inputs and references


def make_inputs(batch=B, seq=T, hidden_size=H, vocab=V, prompt=2):
    """weight [V, H] and hidden [B, T, H] fp32 leaves (requiring grad), labels [B, T] with the first
    ``prompt`` positions of every row and the last of row 1 ignored (-100)."""
    weight = (torch.randn(vocab, hidden_size) * 0.3).requires_grad_()
    hidden = torch.randn(batch, seq, hidden_size).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq))
    labels[:, :prompt] = -100
    if batch > 1:
        labels[1, -1] = -100
    return weight, hidden, labels


def token_logps64(weight, hidden, labels, ignore_index=-100):
    """float64 ``log softmax(hidden @ weight.T)[label]`` per token, 0 at ignored positions."""
    logits = hidden.detach().double() @ weight.detach().double().T
    logp = logits.log_softmax(-1)
    valid = labels != ignore_index
    safe = labels.clamp_min(0)
    return logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * valid, valid


def seq_logps64(weight, hidden, labels):
    """float64 per-sequence summed log-probs ``[B]`` and valid-token counts ``[B]``."""
    tok, valid = token_logps64(weight, hidden, labels)
    return tok.sum(-1), valid.sum(-1).double()


def assert_grads_ok(*tensors):
    """Each leaf has a finite, non-zero gradient."""
    for t in tensors:
        assert t.grad is not None, "no gradient"
        assert torch.isfinite(t.grad).all(), "gradient has NaN/inf"
        assert t.grad.abs().sum() > 0, "gradient is all zeros"


def assert_loss_output(out):
    """A LossOutput NamedTuple: finite 0-d loss with a graph, metrics of detached finite tensors."""
    assert isinstance(out, LossOutput), type(out)
    assert out.loss is out[0] and out.metrics is out[1]
    assert out.loss.dim() == 0 and torch.isfinite(out.loss) and out.loss.requires_grad
    assert isinstance(out.metrics, dict) and out.metrics
    for name, value in out.metrics.items():
        assert isinstance(value, torch.Tensor), name
        assert not value.requires_grad, f"metric {name} is not detached"
        assert torch.isfinite(value).all(), f"metric {name} is not finite"


# --------------------------------------------------------------------------- cross-entropy


def test_fused_linear_cross_entropy_function():
    """`loss = ll.fused_linear_cross_entropy(weight, hidden, labels, ignore_index=-100)`: a plain 0-d
    tensor (no LossOutput without extras) equal to F.cross_entropy on float64 logits, and its
    gradients w.r.t. hidden and weight equal float64 autograd's; rel err <= 1e-5 (fp32 bar)."""
    weight, hidden, labels = make_inputs()
    loss = ll.fused_linear_cross_entropy(weight, hidden, labels, ignore_index=-100)
    assert type(loss) is torch.Tensor and loss.dim() == 0
    loss.backward()
    assert_grads_ok(hidden, weight)

    w64 = weight.detach().double().requires_grad_()
    h64 = hidden.detach().double().requires_grad_()
    ref = F.cross_entropy((h64 @ w64.T).reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    ref.backward()
    assert rel_err(loss, ref) <= FP32
    assert rel_err(hidden.grad, h64.grad) <= FP32
    assert rel_err(weight.grad, w64.grad) <= FP32


def test_fused_linear_cross_entropy_module_num_items_in_batch():
    """`loss_fn = ll.LigerFusedLinearCrossEntropyLoss(label_smoothing=0.1, z_loss_weight=1e-4)` then
    `loss = loss_fn(weight, hidden, labels, num_items_in_batch=n)`: a plain tensor equal to the float64
    sum over valid tokens of (0.9 nll + 0.1 mean_v(-log p_v) + 1e-4 lse^2) divided by n (n larger
    than the valid count, as under gradient accumulation); rel err <= 1e-5."""
    weight, hidden, labels = make_inputs()
    n = int((labels != -100).sum()) + 7
    loss_fn = ll.LigerFusedLinearCrossEntropyLoss(label_smoothing=0.1, z_loss_weight=1e-4)
    loss = loss_fn(weight, hidden, labels, num_items_in_batch=n)
    assert type(loss) is torch.Tensor and loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert_grads_ok(hidden, weight)

    logits = hidden.detach().double() @ weight.detach().double().T
    logp = logits.log_softmax(-1)
    lse = logits.logsumexp(-1)
    valid = labels != -100
    nll = -logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    per_tok = 0.9 * nll + 0.1 * (-logp).mean(-1) + 1e-4 * lse**2
    ref = (per_tok * valid).sum() / n
    assert rel_err(loss, ref) <= FP32


def test_cross_entropy_returns_loss_output_when_extras_asked():
    """Prose under the block: "cross-entropy returns a plain tensor unless extras are asked for":
    with return_token_accuracy=True (function and module) it is a LossOutput whose loss equals the
    plain call's (rel err <= 1e-5) and whose token_accuracy is the float64 argmax hit rate."""
    weight, hidden, labels = make_inputs()
    plain = ll.fused_linear_cross_entropy(weight, hidden, labels, ignore_index=-100)
    out = ll.fused_linear_cross_entropy(weight, hidden, labels, ignore_index=-100, return_token_accuracy=True)
    assert_loss_output(out)
    assert rel_err(out.loss, plain) <= FP32
    logits = hidden.detach().double() @ weight.detach().double().T
    valid = labels != -100
    acc = (logits.argmax(-1) == labels)[valid].double().mean()
    assert rel_err(out.metrics["token_accuracy"], acc) <= FP32
    mod_out = ll.LigerFusedLinearCrossEntropyLoss(return_token_accuracy=True)(weight, hidden, labels)
    assert_loss_output(mod_out)
    assert rel_err(mod_out.loss, plain) <= FP32


def test_chunked_functions_take_options_keyword_only():
    """Prose: "Options are keyword-only and the argument order is the same everywhere:
    weight, hidden, [ref_hidden | teacher_hidden], labels". Holds for the functional losses: their
    positional parameters are exactly those tensors (the module constructors, by contrast, take
    their leading options positionally, e.g. LigerFusedLinearDPOLoss(beta, loss_type, ...))."""
    expected = {
        ll.fused_linear_cross_entropy: ["weight", "hidden", "labels"],
        ll.fused_linear_token_logprobs: ["weight", "hidden", "labels"],
        ll.fused_linear_sequence_objective: ["weight", "hidden", "labels", "objective"],
        ll.fused_linear_dpo_loss: ["weight", "hidden", "ref_hidden", "labels"],
        ll.fused_linear_kto_loss: ["weight", "hidden", "ref_hidden", "labels"],
        ll.fused_linear_simpo_loss: ["weight", "hidden", "labels"],
        ll.fused_linear_orpo_loss: ["weight", "hidden", "labels"],
        ll.fused_linear_cpo_loss: ["weight", "hidden", "labels"],
        ll.fused_linear_distillation_loss: ["weight", "hidden", "teacher_hidden", "labels"],
    }
    for fn, names in expected.items():
        params = inspect.signature(fn).parameters.values()
        positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        assert positional == names, (fn.__name__, positional)


# --------------------------------------------------------------------------- preference losses


def dpo_reference(weight, hidden, ref_hidden, labels, beta):
    """float64 TRL sigmoid DPO: loss and (chosen, rejected) rewards."""
    pol, _ = seq_logps64(weight, hidden, labels)
    ref, _ = seq_logps64(weight, ref_hidden, labels)
    c, r = (pol - ref).chunk(2)
    loss = -F.logsigmoid(beta * (c - r)).mean()
    return loss, beta * c, beta * r, pol


def test_dpo_module_with_ref_hidden_and_metrics():
    """`dpo = ll.LigerFusedLinearDPOLoss(beta=0.1, loss_type="sigmoid")`,
    `loss, metrics = dpo(weight, hidden, ref_hidden, labels)`: a LossOutput whose loss equals float64
    TRL sigmoid DPO (ref log-probs from ref_hidden through the same head) and whose metrics (TRL's
    rewards/logps means, detached) equal the float64 ones; rel err <= 1e-5. Gradients reach hidden
    and weight, never ref_hidden."""
    weight, hidden, labels = make_inputs()
    ref_hidden = torch.randn(B, T, H)
    dpo = ll.LigerFusedLinearDPOLoss(beta=0.1, loss_type="sigmoid")
    out = dpo(weight, hidden, ref_hidden, labels)
    assert_loss_output(out)
    loss, metrics = out
    loss.backward()
    assert_grads_ok(hidden, weight)

    ref_loss, c_rew, r_rew, pol = dpo_reference(weight, hidden, ref_hidden, labels, 0.1)
    assert rel_err(loss, ref_loss) <= FP32
    for key in ("chosen_rewards", "rejected_rewards", "reward_margins", "reward_accuracies",
                "chosen_logps", "rejected_logps", "chosen_logits_mean", "rejected_logits_mean"):
        assert key in metrics, sorted(metrics)
    assert rel_err(metrics["chosen_rewards"], c_rew.mean()) <= FP32
    assert rel_err(metrics["rejected_rewards"], r_rew.mean()) <= FP32
    assert rel_err(metrics["reward_margins"], (c_rew - r_rew).mean()) <= FP32
    assert float(metrics["reward_accuracies"]) == float((c_rew > r_rew).double().mean())
    assert rel_err(metrics["chosen_logps"], pol[:P].mean()) <= FP32
    assert rel_err(metrics["rejected_logps"], pol[P:].mean()) <= FP32
    # every key maps to the name TRL logs
    assert set(metrics) <= set(ll.LigerFusedLinearDPOLoss.TRL_METRIC_NAMES)


def test_dpo_module_precomputed_ref_logps():
    """README comment `ref_chosen_logps=/ref_rejected_logps=`: with ref_hidden=None and precomputed
    reference log-probs [P] the DPO loss equals the ref_hidden call's (and float64 DPO); rel err <= 1e-5."""
    weight, hidden, labels = make_inputs()
    ref_hidden = torch.randn(B, T, H)
    ref_seq, _ = seq_logps64(weight, ref_hidden, labels)
    dpo = ll.LigerFusedLinearDPOLoss(beta=0.1, loss_type="sigmoid")
    out = dpo(weight, hidden, None, labels,
              ref_chosen_logps=ref_seq[:P].float(), ref_rejected_logps=ref_seq[P:].float())
    assert_loss_output(out)
    out.loss.backward()
    assert_grads_ok(hidden, weight)
    ref_loss, *_ = dpo_reference(weight, hidden, ref_hidden, labels, 0.1)
    assert rel_err(out.loss, ref_loss) <= FP32
    with_hidden = dpo(weight, hidden, ref_hidden, labels).loss
    assert rel_err(out.loss, with_hidden) <= FP32


def test_dpo_ref_hidden_none_is_reference_free_only_with_flag():
    """README comment `ref_hidden=None: ref-free`: reference-free DPO needs `reference_free=True`
    at construction (reference log-probs 0: loss = float64 -logsigmoid(beta (c - r)), rel err <= 1e-5);
    a bare `dpo(weight, hidden, None, labels)` raises a ValueError naming the options."""
    weight, hidden, labels = make_inputs()
    with pytest.raises(ValueError, match="reference_free"):
        ll.LigerFusedLinearDPOLoss(beta=0.1, loss_type="sigmoid")(weight, hidden, None, labels)
    out = ll.LigerFusedLinearDPOLoss(beta=0.1, loss_type="sigmoid", reference_free=True)(
        weight, hidden, None, labels)
    assert_loss_output(out)
    pol, _ = seq_logps64(weight, hidden, labels)
    ref = -F.logsigmoid(0.1 * (pol[:P] - pol[P:])).mean()
    assert rel_err(out.loss, ref) <= FP32


def test_dpo_every_trl_loss_type():
    """README comment `# every TRL 1.16 loss_type`: every loss_type TRL 1.16's DPOConfig documents
    builds and gives a finite loss with finite gradients into hidden (smoke; parity with TRL lives in
    tests/chunked/preference). exo_pair gets label_smoothing=1e-3: TRL 1.16 also rejects it at 0."""
    trl_types = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
                 "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
    weight, hidden, labels = make_inputs()
    ref_hidden = torch.randn(B, T, H)
    for loss_type in trl_types:
        hidden.grad = None
        smoothing = 1e-3 if loss_type == "exo_pair" else 0.0  # TRL too rejects exo_pair without smoothing
        dpo = ll.LigerFusedLinearDPOLoss(beta=0.1, loss_type=loss_type, label_smoothing=smoothing)
        loss, metrics = dpo(weight, hidden, ref_hidden, labels)
        loss.backward()
        assert torch.isfinite(loss), loss_type
        assert torch.isfinite(hidden.grad).all(), loss_type


def test_simpo_module():
    """`loss, metrics = ll.LigerFusedLinearSimPOLoss(beta=2.0, gamma=0.5)(weight, hidden, labels)`:
    a LossOutput equal to float64 SimPO, mean_pairs(-logsigmoid(beta (a_c - a_r) - gamma)) with
    a = mean per-token log-prob; rel err <= 1e-5; gradients reach hidden and weight."""
    weight, hidden, labels = make_inputs()
    out = ll.LigerFusedLinearSimPOLoss(beta=2.0, gamma=0.5)(weight, hidden, labels)
    assert_loss_output(out)
    loss, metrics = out
    loss.backward()
    assert_grads_ok(hidden, weight)
    s, n = seq_logps64(weight, hidden, labels)
    a = s / n
    ref = -F.logsigmoid(2.0 * (a[:P] - a[P:]) - 0.5).mean()
    assert rel_err(loss, ref) <= FP32


def test_orpo_module():
    """`loss, metrics = ll.LigerFusedLinearORPOLoss(beta=0.1)(weight, hidden, labels)`: a LossOutput
    equal to float64 ORPO, NLL over the chosen tokens - beta * mean logsigmoid(log odds ratio);
    rel err <= 1e-5; gradients reach hidden and weight."""
    weight, hidden, labels = make_inputs()
    out = ll.LigerFusedLinearORPOLoss(beta=0.1)(weight, hidden, labels)
    assert_loss_output(out)
    loss, metrics = out
    loss.backward()
    assert_grads_ok(hidden, weight)
    s, n = seq_logps64(weight, hidden, labels)
    a = s / n
    ac, ar = a[:P], a[P:]
    log_odds = (ac - ar) - (torch.log1p(-ac.exp()) - torch.log1p(-ar.exp()))
    nll = -s[:P].sum() / n[:P].sum()
    ref = nll - 0.1 * F.logsigmoid(log_odds).mean()
    assert rel_err(loss, ref) <= FP32
    assert rel_err(metrics["nll_loss"], nll) <= FP32


def test_kto_module_with_kl_completions():
    """`loss, metrics = ll.LigerFusedLinearKTOLoss(beta=0.1)(weight, hidden, ref_hidden, labels,
    preference_labels=desirable, kl_hidden=kl_hidden, kl_ref_hidden=kl_ref_hidden, kl_labels=kl_labels)`:
    a LossOutput equal to float64 TRL KTO (r = logp - ref_logp, kl = clamp(mean KL-sequence
    log-ratio, 0), desirable 1 - sigmoid(beta (r - kl)), undesirable 1 - sigmoid(beta (kl - r)),
    mean); metrics["kl"] equals that kl; rel err <= 1e-5; gradients reach hidden and weight."""
    weight, hidden, labels = make_inputs()
    ref_hidden = torch.randn(B, T, H)
    desirable = torch.tensor([True, False, True, False])
    kl_hidden, kl_ref_hidden = torch.randn(B, T, H), torch.randn(B, T, H)
    kl_labels = torch.randint(0, V, (B, T))
    kl_labels[:, :2] = -100
    # make the KL estimate positive so that the clamp does not hide it
    kl_ref_hidden = kl_ref_hidden * 0.2
    out = ll.LigerFusedLinearKTOLoss(beta=0.1)(        # KL term from mismatched completions
        weight, hidden, ref_hidden, labels, preference_labels=desirable,
        kl_hidden=kl_hidden, kl_ref_hidden=kl_ref_hidden, kl_labels=kl_labels)
    assert_loss_output(out)
    loss, metrics = out
    loss.backward()
    assert_grads_ok(hidden, weight)

    pol, _ = seq_logps64(weight, hidden, labels)
    ref, _ = seq_logps64(weight, ref_hidden, labels)
    kl_pol, _ = seq_logps64(weight, kl_hidden, kl_labels)
    kl_ref, _ = seq_logps64(weight, kl_ref_hidden, kl_labels)
    kl = (kl_pol - kl_ref).mean().clamp(min=0)
    r = pol - ref
    per_seq = torch.where(desirable, 1 - torch.sigmoid(0.1 * (r - kl)), 1 - torch.sigmoid(0.1 * (kl - r)))
    assert rel_err(loss, per_seq.mean()) <= FP32
    assert "kl" in metrics
    assert rel_err(metrics["kl"], kl) <= FP32


# --------------------------------------------------------------------------- distillation


def _dapo64(weight, hidden, labels, advantages, ref_logps, *, beta, eps_low, eps_high):
    """TRL 1.16's dapo loss in float64 autograd on (weight, hidden) copies, on-policy (old = current log-probs,
    detached), k3 KL with its bias correction (TRL's default); returns (loss, grad_weight, grad_hidden)."""
    w = weight.detach().double().requires_grad_()
    h = hidden.detach().double().requires_grad_()
    logp = (h @ w.T).log_softmax(-1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    mask = (labels != -100).double()
    coef_1 = torch.exp(logp - logp.detach())
    coef_2 = coef_1.clamp(1 - eps_low, 1 + eps_high)
    adv = advantages.double().unsqueeze(1)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    delta = ref_logps.double() - logp
    per_token = per_token + beta * (torch.exp(delta) - delta - 1) * coef_1
    loss = (per_token * mask).sum() / mask.sum()
    gw, gh = torch.autograd.grad(loss, (w, h))
    return loss.detach(), gw, gh


def test_grpo_module_dapo_with_ref_logps():
    """`grpo = ll.LigerFusedLinearGRPOLoss(loss_type="dapo", beta=0.04, epsilon_low=0.2, epsilon_high=0.28)`
    and `loss, metrics = grpo(weight, hidden, None, labels, advantages=advantages, ref_logps=ref_logps)`: a
    LossOutput whose loss and hidden/weight gradients equal TRL's dapo formula in float64 (rel <= 1e-5)."""
    weight, hidden, labels = make_inputs()
    advantages = torch.randn(B)
    ref_logps = -3.0 - torch.rand(B, T)
    grpo = ll.LigerFusedLinearGRPOLoss(loss_type="dapo", beta=0.04, epsilon_low=0.2, epsilon_high=0.28)
    out = grpo(weight, hidden, None, labels, advantages=advantages, ref_logps=ref_logps)
    assert_loss_output(out)
    out.loss.backward()
    ref, gw, gh = _dapo64(weight, hidden, labels, advantages, ref_logps, beta=0.04, eps_low=0.2, eps_high=0.28)
    assert rel_err(out.loss, ref) <= FP32
    assert rel_err(weight.grad, gw) <= FP32 and rel_err(hidden.grad, gh) <= FP32


def test_rloo_function():
    """`ll.fused_linear_rloo_loss(weight, hidden, labels, advantages=advantages, old_logps=old_logps).loss`: a
    finite loss of a LossOutput with finite, non-zero gradients into hidden and weight."""
    weight, hidden, labels = make_inputs()
    old_logps, _ = seq_logps64(weight, hidden, labels)  # RLOO's ratio is of whole sequences: [B]
    out = ll.fused_linear_rloo_loss(weight, hidden, labels, advantages=torch.randn(B), old_logps=old_logps.float())
    assert_loss_output(out)
    out.loss.backward()
    assert_grads_ok(hidden, weight)


def test_distillation_module_teacher_weight():
    """`distill = ll.LigerFusedLinearDistillationLoss(divergence="jsd", beta=0.5, temperature=1.0)`,
    `loss, metrics = distill(weight, hidden, teacher_hidden, labels, teacher_weight=teacher_weight)`
    with a wider teacher (Ht = 24 != H): a LossOutput equal to the float64 generalized JSD
    (beta=0.5: 0.5 KL(p_t||m) + 0.5 KL(p_s||m), m the mixture) averaged over valid tokens; rel err
    <= 1e-5; gradients reach hidden and weight, never the teacher."""
    weight, hidden, labels = make_inputs()
    teacher_hidden = torch.randn(B, T, 24)
    teacher_weight = torch.randn(V, 24) * 0.3
    distill = ll.LigerFusedLinearDistillationLoss(divergence="jsd", beta=0.5, temperature=1.0)
    out = distill(weight, hidden, teacher_hidden, labels, teacher_weight=teacher_weight)
    assert_loss_output(out)
    loss, metrics = out
    loss.backward()
    assert_grads_ok(hidden, weight)

    valid = labels != -100
    ls = (hidden.detach().double() @ weight.detach().double().T)[valid].log_softmax(-1)
    lt = (teacher_hidden.double() @ teacher_weight.double().T)[valid].log_softmax(-1)
    lm = torch.logsumexp(torch.stack([ls, lt]) + torch.tensor(0.5, dtype=torch.float64).log(), 0)
    kl_t = (lt.exp() * (lt - lm)).sum(-1)
    kl_s = (ls.exp() * (ls - lm)).sum(-1)
    ref = (0.5 * kl_t + 0.5 * kl_s).mean()
    assert rel_err(loss, ref) <= FP32


# --------------------------------------------------------------------------- custom-loss primitives


def test_fused_linear_token_logprobs():
    """`logps = ll.fused_linear_token_logprobs(weight, hidden, labels)`: a [B, T] float32 tensor equal
    to float64 log_softmax(hidden @ weight.T)[label], 0 at ignored positions; rel err <= 1e-5;
    differentiable (a backward of a weighted sum reaches hidden and weight)."""
    weight, hidden, labels = make_inputs()
    logps = ll.fused_linear_token_logprobs(weight, hidden, labels)
    assert type(logps) is torch.Tensor and logps.shape == labels.shape and logps.dtype == torch.float32
    ref, valid = token_logps64(weight, hidden, labels)
    assert rel_err(logps, ref) <= FP32
    assert (logps[~valid] == 0).all()
    (logps * torch.randn_like(logps)).sum().backward()
    assert_grads_ok(hidden, weight)


def test_fused_linear_token_logprobs_entropy():
    """README comment "(and entropy)": return_entropy=True gives (logps, entropy), entropy [B, T]
    equal to the float64 softmax entropy at valid positions, 0 at ignored ones, and detached (only
    the log-probs are differentiable); rel err <= 1e-5."""
    weight, hidden, labels = make_inputs()
    logps, entropy = ll.fused_linear_token_logprobs(weight, hidden, labels, return_entropy=True)
    assert entropy.shape == labels.shape and not entropy.requires_grad and logps.requires_grad
    logp = (hidden.detach().double() @ weight.detach().double().T).log_softmax(-1)
    valid = labels != -100
    ref = -(logp.exp() * logp).sum(-1) * valid
    assert rel_err(entropy, ref) <= FP32


def test_fused_linear_sequence_objective_custom_dpo():
    """`loss, unit_metrics, stats = ll.fused_linear_sequence_objective(weight, hidden, labels,
    my_objective, group_size=2, ref_hidden=ref_hidden)` with ``my_objective`` a 4-line sigmoid DPO on
    SequenceStats (``objective(stats) -> (losses [U], {name: [U]})``): loss equals float64 DPO and
    the built-in DPO loss (rel err <= 1e-5), unit_metrics come back per pair, stats per sequence
    (logps [B], ref_logps [B]); gradients reach hidden and weight."""
    weight, hidden, labels = make_inputs()
    ref_hidden = torch.randn(B, T, H)

    def my_objective(stats):
        chosen, rejected = stats.logps.chunk(2)
        ref_chosen, ref_rejected = stats.ref_logps.chunk(2)
        margin = (chosen - ref_chosen) - (rejected - ref_rejected)
        return -F.logsigmoid(0.1 * margin), {"margin": margin.detach()}

    loss, unit_metrics, stats = ll.fused_linear_sequence_objective(
        weight, hidden, labels, my_objective, group_size=2, ref_hidden=ref_hidden)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert_grads_ok(hidden, weight)
    assert isinstance(stats, ll.SequenceStats)
    assert unit_metrics["margin"].shape == (P,)
    assert stats.logps.shape == (B,) and stats.ref_logps.shape == (B,)

    ref_loss, c_rew, r_rew, pol = dpo_reference(weight, hidden, ref_hidden, labels, 0.1)
    assert rel_err(loss, ref_loss) <= FP32
    assert rel_err(unit_metrics["margin"], (c_rew - r_rew) / 0.1) <= FP32
    assert rel_err(stats.logps, pol) <= FP32
    builtin = ll.LigerFusedLinearDPOLoss(beta=0.1)(weight, hidden, ref_hidden, labels).loss
    assert rel_err(loss, builtin) <= FP32


# --------------------------------------------------------------------------- kernels


def test_rms_norm():
    """`y = ll.rms_norm(x, w, eps=1e-6)`: equals float64 x * rsqrt(mean(x^2) + eps) * w, and its
    gradients w.r.t. x and w equal float64 autograd's; rel err <= 1e-5."""
    x = torch.randn(3, 5, 32, requires_grad=True)
    w = (1 + 0.1 * torch.randn(32)).requires_grad_()
    y = ll.rms_norm(x, w, eps=1e-6)
    assert y.shape == x.shape and y.dtype == torch.float32
    g = torch.randn_like(y)
    y.backward(g)
    assert_grads_ok(x, w)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    ref.backward(g.double())
    assert rel_err(y, ref) <= FP32
    assert rel_err(x.grad, x64.grad) <= FP32
    assert rel_err(w.grad, w64.grad) <= FP32


def test_norm_and_mlp_module_aliases_exist():
    """The README's `also ...` names are exported: LigerRMSNorm, LigerGemmaRMSNorm, LigerLayerNorm,
    LigerGEGLUMLP, LigerPhi3SwiGLUMLP are nn.Module classes; `impl` is accepted by every kernel
    function of the block (the prose says every kernel takes impl="auto"|"triton"|"torch")."""
    for name in ("LigerRMSNorm", "LigerGemmaRMSNorm", "LigerLayerNorm", "LigerGEGLUMLP", "LigerPhi3SwiGLUMLP"):
        assert issubclass(getattr(ll, name), torch.nn.Module), name
    for fn in (ll.rms_norm, ll.apply_rotary_pos_emb, ll.gated_down_proj, ll.cross_entropy,
               ll.fused_linear_cross_entropy, ll.fused_linear_token_logprobs, ll.fused_linear_sequence_objective):
        assert "impl" in inspect.signature(fn).parameters, fn.__name__


def _rope_reference(x, cos, sin):
    """float64 HF rotate-half RoPE on the first R = cos.shape[-1] dims of x [B, Hx, T, D]."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([xr * c + rotated * s, xp], dim=-1)


def _cos_sin(rot, seq):
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[None].float(), emb.sin()[None].float()  # [1, T, R]


@pytest.mark.parametrize("rot", [8, 4], ids=["full", "partial"])
def test_apply_rotary_pos_emb_gqa(rot):
    """`q, k = ll.apply_rotary_pos_emb(q, k, cos, sin)` with GQA (4 query, 2 key heads), q/k the
    non-contiguous HF layout [B, H, T, D], cos/sin [1, T, R] (R = D, or R = D/2: partial rotary):
    equals float64 rotate-half RoPE on the first R dims (rest passes through), and gradients into q
    and k equal float64 autograd's; rel err <= 1e-5. Full rotary also matches transformers' llama
    apply_rotary_pos_emb."""
    D, seq = 8, 5
    q = torch.randn(2, seq, 4, D).transpose(1, 2).requires_grad_()
    k = torch.randn(2, seq, 2, D).transpose(1, 2).requires_grad_()
    q_in, k_in = q, k
    cos, sin = _cos_sin(rot, seq)
    q, k = ll.apply_rotary_pos_emb(q, k, cos, sin)     # HF rotate-half layout, GQA, partial rotary
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    torch.autograd.backward([q, k], [gq, gk])
    assert_grads_ok(q_in, k_in)
    q64 = q_in.detach().double().requires_grad_()
    k64 = k_in.detach().double().requires_grad_()
    rq, rk = _rope_reference(q64, cos.double(), sin.double()), _rope_reference(k64, cos.double(), sin.double())
    torch.autograd.backward([rq, rk], [gq.double(), gk.double()])
    assert rel_err(q, rq) <= FP32 and rel_err(k, rk) <= FP32
    assert rel_err(q_in.grad, q64.grad) <= FP32 and rel_err(k_in.grad, k64.grad) <= FP32
    if rot == D:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_rope

        hq, hk = hf_rope(q_in.detach(), k_in.detach(), cos, sin)
        assert rel_err(q, hq) <= FP32 and rel_err(k, hk) <= FP32


def _tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64, hidden_act="silu")


def test_swiglu_mlp_from_llama_config():
    """`mlp = ll.LigerSwiGLUMLP(config)` with a tiny transformers LlamaConfig: same parameter names and
    shapes as LlamaMLP (its state dict loads), same output and input gradient as LlamaMLP with those
    weights (fp32 vs fp32 HF; rel err <= 1e-5); gradients reach every projection."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = _tiny_llama_config()
    mlp = ll.LigerSwiGLUMLP(config)                    # also LigerGEGLUMLP, LigerPhi3SwiGLUMLP
    hf = LlamaMLP(config)
    mlp.load_state_dict(hf.state_dict())
    x = torch.randn(2, 3, 32, requires_grad=True)
    x_hf = x.detach().clone().requires_grad_()
    out = mlp(x)
    ref = hf(x_hf)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert rel_err(out, ref) <= FP32
    assert rel_err(x.grad, x_hf.grad) <= FP32
    assert_grads_ok(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    assert rel_err(mlp.down_proj.weight.grad, hf.down_proj.weight.grad) <= FP32


def test_gated_down_proj():
    """`out = ll.gated_down_proj(gate, up, down_weight)`: equals float64 F.linear(silu(gate) * up,
    down_weight), gradients w.r.t. gate, up and down_weight equal float64 autograd's; rel err <= 1e-5."""
    gate = torch.randn(2, 3, 48, requires_grad=True)
    up = torch.randn(2, 3, 48, requires_grad=True)
    down_weight = (torch.randn(32, 48) * 0.2).requires_grad_()
    out = ll.gated_down_proj(gate, up, down_weight)    # down_proj(silu(gate) * up), the product never saved
    g = torch.randn_like(out)
    out.backward(g)
    assert_grads_ok(gate, up, down_weight)
    g64, u64, w64 = (t.detach().double().requires_grad_() for t in (gate, up, down_weight))
    ref = F.linear(F.silu(g64) * u64, w64)
    ref.backward(g.double())
    assert rel_err(out, ref) <= FP32
    for got, want in ((gate, g64), (up, u64), (down_weight, w64)):
        assert rel_err(got.grad, want.grad) <= FP32


def test_cross_entropy_label_smoothing_softcap():
    """`loss = ll.cross_entropy(logits, labels, label_smoothing=0.1, softcap=30.0)`: a plain 0-d tensor
    equal to float64 mean over valid tokens of 0.9 nll + 0.1 mean_v(-log p_v) on z = 30 tanh(x/30);
    its logits gradient equals float64 autograd's; rel err <= 1e-5."""
    logits = (torch.randn(10, V) * 20).requires_grad_()
    labels = torch.randint(0, V, (10,))
    labels[3] = -100
    loss = ll.cross_entropy(logits, labels, label_smoothing=0.1, softcap=30.0)
    assert type(loss) is torch.Tensor and loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert_grads_ok(logits)
    x64 = logits.detach().double().requires_grad_()
    z = 30.0 * torch.tanh(x64 / 30.0)
    ref = F.cross_entropy(z, labels, ignore_index=-100, label_smoothing=0.1)
    ref.backward()
    assert rel_err(loss, ref) <= FP32
    assert rel_err(logits.grad, x64.grad) <= FP32


# --------------------------------------------------------------------------- patching and TRL


def _tiny_llama():
    from tests.patching.tiny_models import tiny_batch, tiny_model

    model = tiny_model("llama")
    return model, tiny_batch(model.config)


def test_apply_liger_kernels_tiny_llama():
    """`model = ll.apply_liger_kernels(model)` on a tiny random Llama: returns the model (patched in
    place: RMSNorm and MLP swapped), and the loss and lm_head/embedding gradients of a forward with
    labels equal the unpatched model's (fp32 vs fp32 HF; rel err <= 1e-5)."""
    model, batch = _tiny_llama()
    plain = copy.deepcopy(model)
    patched = ll.apply_liger_kernels(model)
    assert patched is model
    assert isinstance(model.model.norm, ll.LigerRMSNorm)
    assert isinstance(model.model.layers[0].mlp, ll.LigerSwiGLUMLP)
    out = model(**batch)
    ref = plain(**batch)
    out.loss.backward()
    ref.loss.backward()
    assert torch.isfinite(out.loss)
    assert rel_err(out.loss, ref.loss) <= FP32
    assert rel_err(model.lm_head.weight.grad, plain.lm_head.weight.grad) <= FP32
    assert rel_err(model.model.embed_tokens.weight.grad, plain.model.embed_tokens.weight.grad) <= FP32


def test_auto_liger_model_from_pretrained(tmp_path):
    """`ll.AutoLigerModelForCausalLM.from_pretrained(path)` on a saved tiny Llama: a patched model
    (LigerRMSNorm, LigerSwiGLUMLP) with the saved weights (same lm_head)."""
    model, _ = _tiny_llama()
    model.save_pretrained(tmp_path)
    loaded = ll.AutoLigerModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded.model.norm, ll.LigerRMSNorm)
    assert isinstance(loaded.model.layers[0].mlp, ll.LigerSwiGLUMLP)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_trl_dpo_trainer_import_and_construct(tmp_path):
    """`from liger_losses.trl_integration import DPOTrainer` and
    `trainer = DPOTrainer(model, ref_model, args=dpo_config, train_dataset=ds, processing_class=tok,
    use_liger=True)` with the bundled tiny tokenizer/model/data: a trl.DPOTrainer subclass with
    use_liger set, whose model's layers are swapped for ours (liger_patch_model defaults to True, which
    the README does not say) and whose compute_loss on the first batch is finite with finite, non-zero
    lm_head gradients; the other trainers the comment names are importable too."""
    import trl
    from transformers import Trainer

    from liger_losses.demo import build_tiny_model, build_tokenizer, preference_dataset
    from liger_losses.trl_integration import (
        CPOTrainer,
        DistillationTrainer,
        DPOTrainer,  # also SFT, CPO (SimPO), ORPO, KTO, GKD, Distillation
        GKDTrainer,
        KTOTrainer,
        ORPOTrainer,
        SFTTrainer,
    )

    for cls in (CPOTrainer, DistillationTrainer, GKDTrainer, KTOTrainer, ORPOTrainer, SFTTrainer):
        assert issubclass(cls, Trainer), cls

    tok = build_tokenizer()
    model, ref_model = build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=1)
    dpo_config = trl.DPOConfig(output_dir=str(tmp_path), max_length=32, per_device_train_batch_size=2,
                               report_to="none", use_cpu=True, save_strategy="no")
    ds = preference_dataset(4)
    trainer = DPOTrainer(model, ref_model, args=dpo_config, train_dataset=ds, processing_class=tok,
                         use_liger=True)
    assert isinstance(trainer, trl.DPOTrainer)
    assert trainer.use_liger is True
    assert isinstance(trainer.model.model.norm, ll.LigerRMSNorm)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert_grads_ok(trainer.model.lm_head.weight)


# --------------------------------------------------------------------------- the block verbatim


def _readme_block() -> str:
    """The python code block after "## The API at a glance" in README.md, verbatim."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## The API at a glance", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_block_runs_verbatim(tmp_path):
    """The README block itself, read from README.md and exec'd top to bottom, runs without error once
    its free names are bound (tiny fp32 tensors; ``labels [B, T]`` serves every statement, so
    ``logits`` is ``[B, T, V]``; a tiny Llama, the bundled tokenizer/data, a custom
    DPO objective); afterwards every name it binds has the documented type: LossOutput for the losses,
    a plain tensor for CE, a 3-tuple's parts for the sequence objective, a DPOTrainer."""
    import trl

    from liger_losses.demo import build_tiny_model, build_tokenizer, preference_dataset

    block = _readme_block()
    assert "ll.fused_linear_cross_entropy(weight, hidden, labels, ignore_index=-100)" in block
    weight, hidden, labels = make_inputs()

    def my_objective(stats):
        chosen, rejected = stats.logps.chunk(2)
        ref_chosen, ref_rejected = stats.ref_logps.chunk(2)
        return -F.logsigmoid(0.1 * ((chosen - ref_chosen) - (rejected - ref_rejected))), {}

    cos, sin = _cos_sin(8, 5)
    tok = build_tokenizer()
    kl_labels = torch.randint(0, V, (B, T))
    kl_labels[:, :2] = -100
    ns = dict(
        weight=weight, hidden=hidden, labels=labels, n=20, ref_hidden=torch.randn(B, T, H),
        desirable=torch.tensor([True, False, True, False]), kl_hidden=torch.randn(B, T, H),
        kl_ref_hidden=torch.randn(B, T, H), kl_labels=kl_labels, teacher_hidden=torch.randn(B, T, 24),
        teacher_weight=torch.randn(V, 24) * 0.3, my_objective=my_objective,
        x=torch.randn(3, 32), w=torch.ones(32), q=torch.randn(2, 4, 5, 8), k=torch.randn(2, 2, 5, 8),
        cos=cos, sin=sin, config=_tiny_llama_config(), gate=torch.randn(3, 48), up=torch.randn(3, 48),
        down_weight=torch.randn(32, 48), logits=torch.randn(B, T, V), model=build_tiny_model(tok, seed=0),
        ref_model=build_tiny_model(tok, seed=1), tok=tok, ds=preference_dataset(4),
        advantages=torch.randn(B), ref_logps=-3.0 - torch.rand(B, T), old_logps=-10.0 - torch.rand(B),
        dpo_config=trl.DPOConfig(output_dir=str(tmp_path), max_length=32, per_device_train_batch_size=2,
                                 report_to="none", use_cpu=True, save_strategy="no"),
    )
    exec(compile(block, "README.md:api-at-a-glance", "exec"), ns)

    assert type(ns["loss"]) is torch.Tensor and torch.isfinite(ns["loss"])  # the last `loss` is CE on logits
    assert isinstance(ns["metrics"], dict) and "kl" not in ns["metrics"]  # the last metrics: distillation
    assert ns["logps"].shape == labels.shape
    assert isinstance(ns["stats"], ll.SequenceStats) and isinstance(ns["unit_metrics"], dict)
    assert ns["y"].shape == ns["x"].shape and ns["out"].shape == (3, 32)
    assert ns["q"].shape == (2, 4, 5, 8) and ns["k"].shape == (2, 2, 5, 8)
    assert isinstance(ns["mlp"], ll.LigerSwiGLUMLP)
    assert isinstance(ns["model"].model.norm, ll.LigerRMSNorm)
    assert isinstance(ns["trainer"], trl.DPOTrainer) and ns["trainer"].use_liger is True
