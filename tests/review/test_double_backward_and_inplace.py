"""Review tests: double backward through every custom autograd.Function of the package, and
in-place writes into tensors the caller still owns.

(B) Double backward. ``torch.autograd.grad(loss, hidden, create_graph=True)`` (a gradient penalty)
runs each Function's backward with grad mode on. Backwards made of Triton kernels, of no-grad
code, or that return gradients computed in the forward (the chunked losses) return gradients
without a graph, so the second-order terms through them would be SILENTLY dropped. Every family
must either raise a RuntimeError naming double backward or give the right second-order result
(float64 autograd reference). Gradient checkpointing (reentrant and not) runs backward with grad
mode off and must keep working, as must a ``retain_graph=True`` second backward where it works.

(A) In-place writes. ``cross_entropy(..., inplace_backward=True)`` writes d loss / d logits into
the logits' buffer in the forward: it must not do so into a leaf (or a view of one), nor under
``torch.no_grad()`` (no backward will come), and another op that saved the logits must fail
loudly instead of reading gradients. Default options never write into the caller's inputs or
``grad_outputs``.

Shapes are tiny (Triton interpreter on 2 CPU cores); fp32 inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy
from liger_losses.chunked.distillation import fused_linear_distillation_loss
from liger_losses.chunked.preference.dpo import fused_linear_dpo_loss
from liger_losses.chunked.token_logprobs import fused_linear_token_logprobs
from liger_losses.kernels.cross_entropy import cross_entropy
from liger_losses.kernels.layer_norm import layer_norm
from liger_losses.kernels.rms_norm import rms_norm
from liger_losses.kernels.rope import apply_rotary_pos_emb
from tests.helpers import TOL, assert_close_rel

FP32 = TOL[torch.float32]
# Second-order results in fp32 against float64: sums of products of first-order quantities,
# a few ulps more rounding than the first-order bar.
SECOND_ORDER_TOL = 1e-4
V, H, N = 24, 8, 6  # vocab, hidden size, tokens
IGN = -100


# --------------------------------------------------------------------------- the families
# Each family: make() -> dict of fp32 tensors; loss(t, impl) -> 0-d loss through the Function under
# review; ref(t) -> the same loss in plain torch ops (default: loss(t, "torch"), run in float64);
# keys: the leaves that take gradients, the first one ("x") penalised. x enters through a linear
# layer (hidden = x @ A.T, or q/k projections for RoPE) as in a model, so d loss / d x keeps a graph
# through A even when the Function's gradient has none: dropping the Function's second-order
# terms is then silent, not a "does not require grad" error. The chunked losses keep their LM head
# frozen (a penalty on the inputs); every loss is non-quadratic in x.


def _labels(n=N, vocab=V):
    labels = torch.randint(0, vocab, (n,))
    labels[0] = IGN
    return labels


class Family:
    def __init__(self, make, loss, ref=None, keys=("x", "A", "weight")):
        self.make, self.loss, self.ref, self.keys = make, loss, ref, keys

    def reference(self, t):
        return self.ref(t) if self.ref is not None else self.loss(t, "torch")


def _hidden(t):
    return t["x"] @ t["A"].t()


def _norm_inputs():
    return {"x": torch.randn(4, 6), "A": torch.randn(H, 6), "weight": torch.randn(H),
            "bias": torch.randn(H), "c": torch.randn(4, H)}


def _rope_inputs():
    b, s, h, d = 1, 3, 2, 8
    return {"x": torch.randn(b, s, 6), "wq": torch.randn(h * d, 6), "wk": torch.randn(h * d, 6),
            "cos": torch.randn(1, s, d), "sin": torch.randn(1, s, d)}


def _rope_loss(inplace, inplace_backward=False):
    def loss(t, impl):
        b, s, _ = t["x"].shape
        q = (t["x"] @ t["wq"].t()).view(b, s, 2, -1).transpose(1, 2)  # HF layout: fresh views
        k = (t["x"] @ t["wk"].t()).view(b, s, 2, -1).transpose(1, 2)
        oq, ok = apply_rotary_pos_emb(q, k, t["cos"], t["sin"], impl=impl,
                                      inplace=inplace and impl != "torch",
                                      inplace_backward=inplace_backward and impl != "torch")
        return (oq ** 3).sum() + ok.sin().sum()
    return loss


def _head_inputs():
    return {"x": torch.randn(N, 6), "A": torch.randn(H, 6), "weight": torch.randn(V, H) * 0.5,
            "labels": _labels()}


def _weighted(out):
    return (out * torch.arange(1.0, out.shape[0] + 1, dtype=out.dtype)).sum()


def _kernel_ce(reduction):
    def loss(t, impl):
        out = cross_entropy(_hidden(t) @ t["weight"].t(), t["labels"], reduction=reduction, impl=impl)
        return _weighted(out) if reduction == "none" else out

    def ref(t):
        out = F.cross_entropy(_hidden(t) @ t["weight"].t(), t["labels"], reduction=reduction,
                              ignore_index=IGN)
        return _weighted(out) if reduction == "none" else out
    return loss, ref


def _fused_ce(reduction):
    def loss(t, impl):
        out = fused_linear_cross_entropy(t["weight"], _hidden(t), t["labels"], reduction=reduction, impl=impl)
        return _weighted(out) if reduction == "none" else out
    return loss, _kernel_ce(reduction)[1]


def _logprobs_loss(t, impl):
    return _weighted(fused_linear_token_logprobs(t["weight"], _hidden(t), t["labels"], impl=impl))


def _logprobs_ref(t):
    logp = torch.log_softmax(_hidden(t) @ t["weight"].t(), -1)
    valid = t["labels"] != IGN
    return _weighted(logp.gather(1, t["labels"].clamp_min(0)[:, None])[:, 0] * valid)


def _distill_inputs():
    return {**_head_inputs(), "teacher_hidden": torch.randn(N, H), "teacher_weight": torch.randn(V, H) * 0.5}


def _distill_loss(t, impl):
    return fused_linear_distillation_loss(
        t["weight"], _hidden(t), t["teacher_hidden"], t["labels"], teacher_weight=t["teacher_weight"],
        divergence="forward_kl", impl=impl).loss


def _distill_ref(t):
    """KL(teacher || student) summed over valid tokens / their count (batchmean)."""
    valid = t["labels"] != IGN
    ls = torch.log_softmax(_hidden(t) @ t["weight"].t(), -1)
    lt = torch.log_softmax(t["teacher_hidden"] @ t["teacher_weight"].t(), -1)
    return ((lt.exp() * (lt - ls)).sum(-1) * valid).sum() / valid.sum()


def _dpo_inputs():
    p, s = 2, 3
    labels = torch.randint(0, V, (2 * p, s))
    labels[:, 0] = IGN  # the prompt position
    return {"x": torch.randn(2 * p, s, 6), "A": torch.randn(H, 6), "weight": torch.randn(V, H) * 0.5,
            "labels": labels, "ref_chosen": torch.randn(p), "ref_rejected": torch.randn(p)}


def _dpo_loss(t, impl):
    return fused_linear_dpo_loss(
        t["weight"], _hidden(t), None, t["labels"], ref_chosen_logps=t["ref_chosen"],
        ref_rejected_logps=t["ref_rejected"], beta=0.5, impl=impl).loss


def _dpo_ref(t):
    """TRL's sigmoid DPO loss: -logsigmoid(beta ((c - rc) - (r - rr))), mean over pairs."""
    logp = torch.log_softmax(_hidden(t) @ t["weight"].t(), -1)
    valid = t["labels"] != IGN
    seq = (logp.gather(-1, t["labels"].clamp_min(0)[..., None])[..., 0] * valid).sum(-1)
    p = seq.shape[0] // 2
    margin = (seq[:p] - t["ref_chosen"]) - (seq[p:] - t["ref_rejected"])
    return -F.logsigmoid(0.5 * margin).mean()


_CHUNKED_KEYS = ("x", "A")
FAMILIES = {
    "rms_norm": Family(_norm_inputs, lambda t, impl: (
        rms_norm(_hidden(t), t["weight"], impl=impl) * t["c"]).sum()),
    "layer_norm": Family(_norm_inputs, lambda t, impl: (
        layer_norm(_hidden(t), t["weight"], t["bias"], impl=impl) * t["c"]).sum(),
        keys=("x", "A", "weight", "bias")),
    "rope": Family(_rope_inputs, _rope_loss(inplace=False), keys=("x", "wq", "wk")),
    "rope_inplace": Family(_rope_inputs, _rope_loss(inplace=True), keys=("x", "wq", "wk")),
    "rope_inplace_backward": Family(_rope_inputs, _rope_loss(inplace=True, inplace_backward=True),
                                    keys=("x", "wq", "wk")),
    "cross_entropy_mean": Family(_head_inputs, *_kernel_ce("mean")),
    "cross_entropy_none": Family(_head_inputs, *_kernel_ce("none")),
    "fused_ce_mean": Family(_head_inputs, *_fused_ce("mean"), keys=_CHUNKED_KEYS),
    "fused_ce_none": Family(_head_inputs, *_fused_ce("none"), keys=_CHUNKED_KEYS),
    "token_logprobs": Family(_head_inputs, _logprobs_loss, _logprobs_ref, keys=_CHUNKED_KEYS),
    "distillation": Family(_distill_inputs, _distill_loss, _distill_ref, keys=_CHUNKED_KEYS),
    "dpo_sequence_objective": Family(_dpo_inputs, _dpo_loss, _dpo_ref, keys=_CHUNKED_KEYS),
}


def _leaves(name, t, dtype=torch.float32):
    """Copies of ``t`` in ``dtype`` (floats), the family's keys as fresh leaves requiring grad."""
    keys = FAMILIES[name].keys
    out = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in t.items()}
    for k in keys:
        out[k] = out[k].detach().clone().requires_grad_()
    return out, keys


def _penalty_grads(loss_fn, t, keys):
    """Gradients of the penalty ``||d loss / d x||^2`` (x = t[keys[0]]) w.r.t. ``t[keys]``."""
    (g,) = torch.autograd.grad(loss_fn(t), t[keys[0]], create_graph=True)
    penalty = (g ** 2).sum()
    got = torch.autograd.grad(penalty, [t[k] for k in keys], allow_unused=True)
    return [torch.zeros_like(t[k]) if d is None else d for k, d in zip(keys, got)]  # None: no dependence


DOUBLE_BACKWARD_MSG = "double backward"
# Before the review's fix, create_graph=True through these Functions either silently dropped the
# second-order terms (x got none) or failed with an unrelated error (mm(): functions with out=...).


@pytest.mark.parametrize("name", FAMILIES)
def test_second_order_never_silently_wrong(name):
    """A gradient penalty ``||d loss / d x||^2`` (create_graph=True) through each Function either
    raises a RuntimeError naming double backward, or gives every gradient within 1e-4 of float64
    autograd through plain torch ops (fp32 second-order sums). Today most silently drop the
    Function's second-order terms (x's gradient is missing: relative error 1), two fail with an
    unrelated error."""
    fam = FAMILIES[name]
    base = fam.make()
    t64, keys = _leaves(name, base, torch.float64)
    ref = _penalty_grads(fam.reference, t64, keys)
    t32, _ = _leaves(name, base)
    try:
        got = _penalty_grads(lambda t: fam.loss(t, "auto"), t32, keys)
    except RuntimeError as err:
        assert DOUBLE_BACKWARD_MSG in str(err), err
        return
    for k, g, r in zip(keys, got, ref):
        assert_close_rel(g, r, SECOND_ORDER_TOL, f"{name}: grad {k}")


@pytest.mark.parametrize("name", FAMILIES)
def test_double_backward_raises_clear_error(name):
    """``torch.autograd.grad(loss, x, create_graph=True)`` raises a RuntimeError that names double
    backward and says what to do instead (no silently graph-less gradient)."""
    fam = FAMILIES[name]
    t, keys = _leaves(name, fam.make())
    loss = fam.loss(t, "auto")
    msg = r"double backward \(create_graph=True\) through .* is not supported.*; (use|compute)"
    with pytest.raises(RuntimeError, match=msg):
        torch.autograd.grad(loss, t[keys[0]], create_graph=True)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_first_order_matches_reference(name):
    """Sanity of the references above (and of the paths after the fix): loss and every first-order
    gradient (no create_graph) within 1e-5 of float64."""
    fam = FAMILIES[name]
    base = fam.make()
    t64, keys = _leaves(name, base, torch.float64)
    ref_loss = fam.reference(t64)
    ref = torch.autograd.grad(ref_loss, [t64[k] for k in keys])
    t32, _ = _leaves(name, base)
    loss = fam.loss(t32, "auto")
    got = torch.autograd.grad(loss, [t32[k] for k in keys])
    assert_close_rel(loss, ref_loss, FP32, f"{name}: loss")
    for k, g, r in zip(keys, got, ref):
        assert_close_rel(g, r, FP32, f"{name}: grad {k}")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_gradient_checkpointing_still_works(name, reentrant):
    """The loss recomputed under ``torch.utils.checkpoint`` (reentrant: forward under no_grad, then
    an inner backward with grad mode off; non-reentrant: saved tensors recomputed during backward):
    every gradient equals the un-checkpointed one within 1e-6 (same kernels, same order). The
    double-backward check must not fire here."""
    fam = FAMILIES[name]
    base = fam.make()
    t, keys = _leaves(name, base)
    plain = torch.autograd.grad(fam.loss(t, "auto"), [t[k] for k in keys])
    t2, _ = _leaves(name, base)
    args = [t2[k] for k in keys]

    def run(*leaves):
        return fam.loss({**t2, **dict(zip(keys, leaves))}, "auto")

    checkpoint(run, *args, use_reentrant=reentrant).backward()
    for k, g, a in zip(keys, plain, args):
        assert_close_rel(a.grad, g, 1e-6, f"{name}: grad {k}")


# Families whose graph may be back-propagated twice today (retain_graph=True): the one-pass chunked
# losses release their forward-computed gradients by design (they raise), the others must keep working.
_RETAINABLE = ["rms_norm", "layer_norm", "rope", "rope_inplace", "cross_entropy_mean",
               "cross_entropy_none", "fused_ce_none", "token_logprobs"]


@pytest.mark.parametrize("name", _RETAINABLE)
def test_retain_graph_second_backward_still_works(name):
    """``backward(retain_graph=True)`` then a second ``backward()`` (create_graph=False), the
    second one inside ``torch.enable_grad()`` (the engine, not the caller's mode, decides): the
    gradients accumulate to exactly twice the first ones."""
    fam = FAMILIES[name]
    t, keys = _leaves(name, fam.make())
    loss = fam.loss(t, "auto")
    loss.backward(retain_graph=True)
    first = [t[k].grad.clone() for k in keys]
    with torch.enable_grad():
        loss.backward()
    for k, g in zip(keys, first):
        assert torch.allclose(t[k].grad, 2 * g, rtol=1e-6, atol=0), k


# --------------------------------------------------------------------------- (A) in-place writes

# Before the review's fix cross_entropy(inplace_backward=True) wrote the gradient into logits the
# caller owns (a leaf, a view of one, or under no_grad) or that another op had saved.


@pytest.mark.parametrize("kind", ["leaf", "view_of_leaf"])
def test_ce_inplace_backward_leaves_leaf_logits_intact(kind):
    """logits that are a leaf (or a view of one) with inplace_backward=True: the leaf's values are
    unchanged by the forward, its .grad does not alias its data, and the gradient is within 1e-5 of
    float64. (Today the forward overwrites the leaf with d loss / d logits and .grad IS the leaf's
    buffer.)"""
    leaf = torch.randn(N, V, requires_grad=True)
    snap = leaf.detach().clone()
    labels = _labels()
    logits = leaf if kind == "leaf" else leaf.view(N, V)
    cross_entropy(logits, labels, inplace_backward=True).backward()
    assert torch.equal(leaf.detach(), snap)
    assert leaf.grad.data_ptr() != leaf.data_ptr()
    ref = snap.double().requires_grad_()
    F.cross_entropy(ref, labels, ignore_index=IGN).backward()
    assert_close_rel(leaf.grad, ref.grad, FP32, "grad logits")


def test_ce_inplace_backward_under_no_grad_leaves_logits_intact():
    """Evaluation under ``torch.no_grad()`` of logits that require grad (an intermediate of an
    earlier graph) with inplace_backward=True: no backward can follow, so the logits keep their
    values (today the gradient is computed and written over them)."""
    hidden = torch.randn(N, H, requires_grad=True)
    logits = hidden @ torch.randn(V, H).t()
    snap = logits.detach().clone()
    labels = _labels()
    with torch.no_grad():
        loss = cross_entropy(logits, labels, inplace_backward=True)
    assert torch.equal(logits.detach(), snap)
    assert_close_rel(loss, F.cross_entropy(snap.double(), labels, ignore_index=IGN), FP32, "loss")


def test_ce_inplace_backward_logits_saved_by_other_op_is_loud():
    """logits = tanh(raw) (TanhBackward saves its output, the logits) with inplace_backward=True:
    the backward either raises autograd's RuntimeError about an in-place modification or gives
    raw's gradient within 1e-5 of float64. (Today the Triton write bumps no version counter and
    the tanh backward silently reads gradients: relative error ~0.2.)"""
    raw = torch.randn(N, V, requires_grad=True)
    labels = _labels()
    try:
        cross_entropy(torch.tanh(raw), labels, inplace_backward=True).backward()
    except RuntimeError as err:
        assert "modified by an inplace operation" in str(err), err
        return
    ref = raw.detach().double().requires_grad_()
    F.cross_entropy(torch.tanh(ref), labels, ignore_index=IGN).backward()
    assert_close_rel(raw.grad, ref.grad, FP32, "grad raw")


def test_ce_inplace_backward_still_in_place_for_intermediates():
    """The memory saving stays: logits = hidden @ W.T (an intermediate nobody saved) with
    inplace_backward=True hold d loss / d logits after the forward (within 1e-5 of float64), and
    hidden's gradient is within 1e-5 of float64."""
    hidden = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H)
    labels = _labels()
    logits = hidden @ w.t()
    snap = logits.detach().clone()
    cross_entropy(logits, labels, inplace_backward=True).backward()
    ref_logits = snap.double().requires_grad_()
    F.cross_entropy(ref_logits, labels, ignore_index=IGN).backward()
    assert_close_rel(logits.detach(), ref_logits.grad, FP32, "logits buffer holds the gradient")
    assert_close_rel(hidden.grad, ref_logits.grad @ w.double(), FP32, "grad hidden")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_default_options_leave_inputs_and_grad_outputs_intact(name):
    """With default options (no inplace / inplace_backward requested, except the rope_inplace*
    families, whose q/k are fresh projections) a forward + backward leaves every input tensor the
    caller holds (leaves, labels, teacher / reference tensors, cos/sin) and the caller's
    ``grad_outputs`` bit-identical."""
    fam = FAMILIES[name]
    t, keys = _leaves(name, fam.make())
    snaps = {k: v.detach().clone() for k, v in t.items()}
    loss = fam.loss(t, "auto")
    g_out = torch.full_like(loss, 0.75)
    g_snap = g_out.clone()
    torch.autograd.grad(loss, [t[k] for k in keys], grad_outputs=g_out)
    assert torch.equal(g_out, g_snap)
    for k, v in t.items():
        assert torch.equal(v.detach(), snaps[k]), k


@pytest.mark.parametrize("fn", ["rms_norm", "layer_norm", "rope", "rope_inplace"])
def test_kernels_leave_caller_grad_outputs_intact(fn):
    """Tensor-valued outputs back-propagated with a caller's ``grad_outputs`` (contiguous, the
    output's dtype, so an in-place backward could take it) under default options: the caller's
    gradient tensors are bit-identical afterwards."""
    x = torch.randn(4, H, requires_grad=True)
    if fn == "rms_norm":
        outs = (rms_norm(x, torch.randn(H)),)
    elif fn == "layer_norm":
        outs = (layer_norm(x, torch.randn(H), torch.randn(H)),)
    else:
        t, _ = _leaves("rope", _rope_inputs())
        q = (t["x"] @ t["wq"].t()).view(1, 3, 2, -1).transpose(1, 2)
        k = (t["x"] @ t["wk"].t()).view(1, 3, 2, -1).transpose(1, 2)
        outs = apply_rotary_pos_emb(q, k, t["cos"], t["sin"], inplace=fn == "rope_inplace")
        x = t["x"]
    gs = [torch.randn_like(o).contiguous() for o in outs]
    snaps = [g.clone() for g in gs]
    torch.autograd.grad(outs, x, grad_outputs=gs)
    for g, s in zip(gs, snaps):
        assert torch.equal(g, s)


# (before the fix the in-place rotation wrote into the leaf before autograd's mark_dirty check raised)
@pytest.mark.parametrize("kind", ["view_of_leaf", "leaf"])
def test_rope_inplace_on_leaf_raises_before_writing(kind):
    """inplace=True with q/k that are leaves requiring grad, or views of them covering the whole
    leaf (``leaf.transpose(1, 2)``, lifted to the leaf as the in-place carrier): a RuntimeError
    naming the leaf, as torch's own in-place ops give, and the leaf's values are unchanged -- the
    check comes before the write, as in torch. (Today the kernel rotates the leaf first and
    autograd's ``mark_dirty`` check raises afterwards.)"""
    ql = torch.randn(1, 3, 2, 8, requires_grad=True)
    kl = torch.randn(1, 3, 2, 8, requires_grad=True)
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    snaps = (ql.detach().clone(), kl.detach().clone())
    q, k = (ql.transpose(1, 2), kl.transpose(1, 2)) if kind == "view_of_leaf" else (ql, kl)
    with pytest.raises(RuntimeError, match="leaf"):
        apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1 if kind == "view_of_leaf" else 2, inplace=True)
    assert torch.equal(ql.detach(), snaps[0]) and torch.equal(kl.detach(), snaps[1])
