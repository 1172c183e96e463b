"""Tests of liger_losses/chunked/token_objective.py: declared couplings and the driver's paths.

Which path runs and which errors are raised are exact checks. Losses and gradients of one simple
objective (the mean token log-prob, float64 inputs) are compared with a float64 PyTorch reference
on full logits within 1e-6 relative: the tile kernels keep the row statistics in float32
(tests/chunked/test_grpo.py measured 1e-7 - 9e-7 for the same kernels).
"""

import pytest
import torch

from liger_losses.chunked import token_objective
from liger_losses.chunked.config import engine_config
from liger_losses.chunked.options import HeadOptions
from liger_losses.chunked.rloo import RLOOObjective
from liger_losses.chunked.token_objective import (
    FunctionTokenObjective,
    TokenObjective,
    as_token_objective,
    fused_linear_token_objective,
    run_token_objective,
)
from tests.helpers import assert_close_rel

B, T, H, V = 3, 6, 8, 20
TOL = 1e-6


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    h = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[1, 4:] = -100
    return w, h, labels


class MeanLogp(TokenObjective):
    """``-sum(logp) / num_valid``: the loss of a token needs nothing but its own log-prob."""

    def __init__(self, num_valid: int, coupling: str = "token"):
        self.num_valid, self.coupling = num_valid, coupling

    def __call__(self, chunk):
        return -chunk.logps.sum() / self.num_valid, {"tokens": torch.tensor(float(chunk.logps.numel()))}


def _paths(monkeypatch) -> list:
    """Record which of the driver's paths runs."""
    taken = []
    for name in ("one_pass", "two_phases"):
        original = getattr(token_objective.TokenDriver, name)

        def spy(self, bounds, _name=name, _original=original):
            taken.append(_name)
            return _original(self, bounds)

        monkeypatch.setattr(token_objective.TokenDriver, name, spy)
    return taken


def test_as_token_objective_keeps_or_tightens_the_declared_coupling():
    """A declared objective runs with its coupling, or a tighter one asked for; a looser one is a
    ValueError (the loss would be wrong); a plain callable gets the caller's coupling."""
    obj = RLOOObjective(torch.zeros(2), torch.zeros(2), 0.2, 0.2)
    assert obj.coupling == "sequence" and as_token_objective(obj) is obj
    assert as_token_objective(obj, coupling="sequence") is obj
    tighter = as_token_objective(obj, coupling="batch")
    assert isinstance(tighter, FunctionTokenObjective) and tighter.coupling == "batch"
    with pytest.raises(ValueError, match="coupling"):
        as_token_objective(obj, coupling="token")
    plain = as_token_objective(lambda chunk: (chunk.logps.sum(), {}))
    assert isinstance(plain, TokenObjective) and plain.coupling == "token"
    assert as_token_objective(lambda chunk: None, coupling="batch").coupling == "batch"
    with pytest.raises(ValueError, match="coupling"):
        as_token_objective(lambda chunk: None, coupling="pair")
    with pytest.raises(TypeError, match="objective"):
        as_token_objective(3)


def test_run_token_objective_needs_a_declared_objective():
    """The validated entry takes a TokenObjective (whose coupling it reads), not a bare callable;
    an undeclared coupling value is a ValueError naming the objective's attribute."""
    w, h, labels = _case()
    with pytest.raises(TypeError, match="TokenObjective"):
        run_token_objective(w, h, labels, lambda chunk: (chunk.logps.sum(), {}), head=HeadOptions())
    bad = MeanLogp(1, coupling="pairs")
    with pytest.raises(ValueError, match="MeanLogp.coupling"):
        run_token_objective(w, h, labels, bad, head=HeadOptions())


@pytest.mark.parametrize("coupling,path", [("token", "one_pass"), ("sequence", "one_pass"),
                                           ("batch", "two_phases")])
def test_each_coupling_matches_the_reference(coupling, path, monkeypatch):
    """The declared coupling picks the path (chunks of 4 tokens for "token", whole sequences for
    "sequence", two phases for "batch"); each gives the float64 reference's loss and gradients
    within 1e-6, the same additive metric sums (exact: token counts) and each token's accuracy."""
    taken = _paths(monkeypatch)
    w, h, labels = _case(1)
    labels[0, :3] = (h[0, :3] @ w.T).argmax(-1)  # some tokens predicted right, for the accuracy check
    n = int((labels != -100).sum())
    wl, hl = w.clone().requires_grad_(), h.clone().requires_grad_()
    chunk_tokens = T if coupling == "sequence" else 4
    loss, sums, stats = fused_linear_token_objective(wl, hl, labels, MeanLogp(n, coupling),
                                                     chunk_tokens=chunk_tokens, impl="torch")
    loss.backward()
    assert taken == [path]
    assert float(sums["tokens"]) == n and stats.logps.shape == (n,)
    wr, hr = w.clone().requires_grad_(), h.clone().requires_grad_()
    logp = torch.log_softmax(hr @ wr.T, -1)
    valid = labels != -100
    # each kept token's accuracy, in batch order (exact: argmax of distinct float64 logits)
    assert torch.equal(stats.correct, (logp.argmax(-1) == labels)[valid])
    assert bool(stats.correct.any())
    want = -logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0][valid].sum() / n
    want.backward()
    assert_close_rel(loss, want, TOL, "loss")
    assert_close_rel(wl.grad, wr.grad, TOL, "grad_weight")
    assert_close_rel(hl.grad, hr.grad, TOL, "grad_hidden")


@pytest.mark.parametrize("factor,path", [(3, "one_pass"), (2, "two_phases")])
def test_sequence_coupling_reads_unit_budget_factor(factor, path, monkeypatch):
    """A sequence longer than one tile budget stays one pass while it fits ``unit_budget_factor``
    default budgets (EngineConfig): a budget of 2 float64 rows of V and sequences of 6 tokens take
    one pass at factor 3 (6 rows) and two phases at factor 2 (4 rows)."""
    taken = _paths(monkeypatch)
    w, h, labels = _case(2)
    n = int((labels != -100).sum())
    with engine_config(default_budget_bytes=2 * V * 8, weight_budget_fraction=0.0, unit_budget_factor=factor):
        fused_linear_token_objective(w, h, labels, MeanLogp(n, "sequence"), impl="torch")
    assert taken == [path]


class MeanLogpMetricsOnce(MeanLogp):
    """:class:`MeanLogp` declaring ``metrics_once``; records each call's token count, ``metrics``
    flag and whether its log-probs require grad."""

    metrics_once = True

    def __init__(self, num_valid: int, coupling: str = "token"):
        super().__init__(num_valid, coupling)
        self.calls = []

    def __call__(self, chunk):
        self.calls.append((chunk.logps.numel(), chunk.metrics, chunk.logps.requires_grad))
        loss = -chunk.logps.sum() / self.num_valid
        if not chunk.metrics:
            return loss, {}
        return loss, {"tokens": torch.tensor(float(chunk.logps.numel())), "logp_sum": chunk.logps.detach().sum()}


@pytest.mark.parametrize("coupling", ["token", "sequence"])
def test_metrics_once_takes_gradients_per_chunk_and_metrics_from_all_tokens(coupling):
    """With ``metrics_once`` the one-pass driver calls the objective per chunk with
    ``metrics=False`` and grad-requiring log-probs, then once on every token without grad; the
    loss, the metric sums and the gradients equal those of the same objective without it (the
    gradients bitwise: the per-chunk graphs are the same; loss and sums to 1e-12 in float64: the
    same terms added in another order). Under no grad only the call on every token runs."""
    w, h, labels = _case(3)
    n = int((labels != -100).sum())
    chunk_tokens = T if coupling == "sequence" else 4
    results = []
    for obj in (MeanLogp(n, coupling), MeanLogpMetricsOnce(n, coupling)):
        wl, hl = w.clone().requires_grad_(), h.clone().requires_grad_()
        loss, sums, _ = fused_linear_token_objective(wl, hl, labels, obj, chunk_tokens=chunk_tokens, impl="torch")
        if isinstance(obj, MeanLogpMetricsOnce):
            sums = {k: v for k, v in sums.items() if k != "logp_sum"}
            chunks = obj.calls[:-1]
            assert len(chunks) > 1 and all(not m and g for _, m, g in chunks)
            assert obj.calls[-1] == (n, True, False) and sum(c for c, _, _ in chunks) == n
        loss.backward()
        results.append((loss.detach(), sums, wl.grad, hl.grad))
    (l0, s0, gw0, gh0), (l1, s1, gw1, gh1) = results
    assert_close_rel(l1, l0, 1e-12, "loss")
    assert s1.keys() == s0.keys() and float(s1["tokens"]) == float(s0["tokens"]) == n
    assert torch.equal(gw1, gw0) and torch.equal(gh1, gh0)
    obj = MeanLogpMetricsOnce(n, coupling)
    with torch.no_grad():
        loss, sums, _ = fused_linear_token_objective(w, h, labels, obj, chunk_tokens=chunk_tokens, impl="torch")
    assert obj.calls == [(n, True, False)]
    assert_close_rel(loss, l0, 1e-12, "no-grad loss")
    assert_close_rel(sums["logp_sum"], -l0 * n, 1e-12, "logp_sum")


def test_loss_and_sums_are_counted_by_the_metrics_flag_not_by_the_returned_dict():
    """The driver adds a call's loss and sums when it asked for them (``chunk.metrics``), whatever
    the objective returns: a plain callable returning ``{}`` (or None) keeps its loss value, and a
    ``metrics_once`` objective that returns sums from its gradient-only calls too is counted once
    (float64, within 1e-12 of ``-sum(logps)``; the token count exact)."""
    w, h, labels = _case(4)
    n = int((labels != -100).sum())
    for empty in ({}, None):
        loss, sums, stats = fused_linear_token_objective(w, h, labels, lambda c, e=empty: (-c.logps.sum(), e),
                                                         chunk_tokens=4, impl="torch")
        assert sums == {}
        assert_close_rel(loss, -stats.logps.sum(), 1e-12, f"loss with {empty!r} sums")

    class AlwaysSums(TokenObjective):
        metrics_once = True

        def __call__(self, chunk):
            return -chunk.logps.sum(), {"tokens": torch.tensor(float(chunk.logps.numel()))}

    loss, sums, stats = fused_linear_token_objective(w, h, labels, AlwaysSums(), chunk_tokens=3, impl="torch")
    assert float(sums["tokens"]) == n
    assert_close_rel(loss, -stats.logps.sum(), 1e-12, "metrics_once loss")
