"""Tests of liger_losses/chunked/token_logprobs.py against a float64 reference (full logits).

Bar: fp32 1e-5 relative error on log-probs, entropy and the gradients of hidden, weight and bias
for a random upstream gradient (which the backward recomputes with as row scale).
"""

import pytest
import torch

from liger_losses.chunked.token_logprobs import fused_linear_token_logprobs
from tests.helpers import TOL, assert_close_rel, lm_head_inputs

FP32 = TOL[torch.float32]
B, T, H, V = 3, 5, 16, 70


def _inputs(seed=0):
    w, h, b, labels = lm_head_inputs(torch.Generator().manual_seed(seed), B, T, H, V)
    labels[0, :3] = -100
    return w, h, b, labels


def reference(w, h, b, labels, temperature=1.0, softcap=None, logit_scale=1.0):
    wd, hd, bd = [x.detach().double().requires_grad_() for x in (w, h, b)]
    z = (hd @ wd.T + bd) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lp = torch.log_softmax(z / temperature, -1)
    valid = labels != -100
    logps = lp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * valid
    ent = -(lp.exp() * lp).sum(-1) * valid
    return logps, ent.detach(), (wd, hd, bd)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7, "softcap": 5.0, "logit_scale": 1.3}])
def test_matches_fp64(impl, kw):
    """Log-probs (0 at ignored), entropy and gradients within 1e-5 of float64, chunk_tokens=4."""
    w, h, b, labels = _inputs()
    ref, ent_ref, (wd, hd, bd) = reference(w, h, b, labels, **kw)
    go = torch.randn_like(ref)
    (ref * go).sum().backward()
    logps, ent = fused_linear_token_logprobs(w, h, labels, bias=b, return_entropy=True,
                                             chunk_tokens=4, impl=impl, **kw)
    (logps * go).sum().backward()
    assert logps.shape == labels.shape and torch.all(logps[labels == -100] == 0)
    assert not ent.requires_grad
    assert_close_rel(logps, ref, FP32, "logps")
    assert_close_rel(ent, ent_ref, FP32, "entropy")
    assert_close_rel(h.grad, hd.grad, FP32, "grad_hidden")
    assert_close_rel(w.grad, wd.grad, FP32, "grad_weight")
    assert_close_rel(b.grad, bd.grad, FP32, "grad_bias")


def test_frozen_weight_only_hidden_grad():
    """Frozen weight and bias: only the hidden gradient is computed, within 1e-5."""
    w, h, b, labels = _inputs(1)
    ref, _, (_, hd, _) = reference(w, h, b, labels)
    ref.sum().backward()
    out = fused_linear_token_logprobs(w.detach(), h, labels, bias=b.detach())
    out.sum().backward()
    assert_close_rel(h.grad, hd.grad, FP32, "grad_hidden")


def test_all_ignored():
    """All labels ignored: zeros, zero gradient, no NaN."""
    w, h, b, labels = _inputs(2)
    labels[:] = -100
    out = fused_linear_token_logprobs(w, h, labels, bias=b)
    out.sum().backward()
    assert torch.all(out == 0) and torch.all(h.grad == 0) and torch.all(w.grad == 0)


def test_bad_inputs():
    """Bad temperature, shapes and labels raise errors naming the argument."""
    w, h, b, labels = _inputs(3)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_token_logprobs(w, h, labels, temperature=0.0)
    with pytest.raises(ValueError, match="labels"):
        fused_linear_token_logprobs(w, h, labels[:2])
    with pytest.raises(ValueError, match="labels"):
        fused_linear_token_logprobs(w, h, labels + V)
    with pytest.raises(ValueError, match="hidden"):
        fused_linear_token_logprobs(w, h[..., :4], labels)


@pytest.mark.parametrize("valid_count", [64, 40, 5, 0],
                         ids=["none-ignored", "chunk1-full", "chunk1-padded", "all-ignored"])
def test_speculative_first_chunk_equals_plain_path(valid_count):
    """The forward's first chunk issued before the labels' host sync (EngineConfig.speculative_first_chunk,
    16-token chunks over 64 tokens) gives the plain path's log-probs, entropy and recomputed
    gradients bitwise (within 1e-6 when the first chunk is padded: its GEMM's row count differs)."""
    from liger_losses.chunked.config import engine_config

    g = torch.Generator().manual_seed(7)
    w = torch.randn(V, H, generator=g).requires_grad_()
    h = torch.randn(4, 16, H, generator=g).requires_grad_()
    labels = torch.full((64,), -100, dtype=torch.long)
    labels[torch.randperm(64, generator=g)[:valid_count]] = torch.randint(0, V, (valid_count,), generator=g)
    labels = labels.view(4, 16)
    up = torch.randn(4, 16, generator=g)
    results = []
    for speculate in (True, False):
        with engine_config(speculative_first_chunk=speculate):
            logps, entropy = fused_linear_token_logprobs(w, h, labels, chunk_tokens=16, return_entropy=True)
            results.append((logps.detach(), entropy, *torch.autograd.grad((logps * up).sum(), (w, h))))
    for got, want in zip(*results):
        if 0 < valid_count < 16:
            assert_close_rel(got, want, 1e-6, "speculative vs plain")
        else:
            assert torch.equal(got, want)
