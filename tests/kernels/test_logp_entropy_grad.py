"""Tests of liger_losses/kernels/logp_entropy_grad.py against autograd in float64.

Bar: the tile written in place equals d (a * logp + c * entropy) / d logits of float64 autograd
within 1e-5 relative (float32 arithmetic in the kernel), for both impls (Triton through the
interpreter on the CPU), with and without softcap / temperature / logit_scale, and zero rows at
ignored or out-of-range labels.
"""

import pytest
import torch

from liger_losses.kernels.logits_tile import logits_tile
from liger_losses.kernels.logp_entropy_grad import logp_entropy_grad_
from tests.helpers import assert_close_rel

N, V = 7, 50


def _reference(x, labels, a, c, temperature=1.0, softcap=None, logit_scale=1.0):
    xd = x.detach().double().requires_grad_()
    y = xd * logit_scale
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    lp = torch.log_softmax(y / temperature, -1)
    valid = (labels >= 0) & (labels < V)
    logp = lp.gather(1, labels.clamp(0, V - 1)[:, None]).squeeze(1)
    ent = -(lp.exp() * lp).sum(1)
    obj = ((a.double() * logp + (0 if c is None else c.double()) * ent) * valid).sum()
    obj.backward()
    return xd.grad


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7, "softcap": 5.0, "logit_scale": 1.3}])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_matches_autograd(impl, kw, with_entropy):
    """The in-place gradient equals float64 autograd's within 1e-5; ignored rows are zero."""
    g = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(N, V, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[2] = -100
    labels[5] = V + 3  # out of range: treated as ignored
    a = torch.randn(N, generator=g)
    c = torch.randn(N, generator=g) if with_entropy else None
    want = _reference(x, labels, a, c, **kw)
    st = logits_tile(x.clone(), labels, mode="logp", grad=False, need_entropy=True, impl="torch", **kw)
    tile = x.clone()
    logp_entropy_grad_(tile, labels, st.lse, a, entropy=st.entropy if with_entropy else None,
                       grad_entropy=c, impl=impl, **kw)
    assert_close_rel(tile, want, 1e-5, "gradient")
    assert torch.all(tile[2] == 0) and torch.all(tile[5] == 0)


def test_bad_inputs():
    """Wrong shapes and a missing entropy raise ValueError naming the argument."""
    x = torch.randn(N, V)
    labels = torch.zeros(N, dtype=torch.long)
    lse, a = torch.zeros(N), torch.zeros(N)
    with pytest.raises(ValueError, match="grad_logp"):
        logp_entropy_grad_(x, labels, lse, a[:3])
    with pytest.raises(ValueError, match="entropy"):
        logp_entropy_grad_(x, labels, lse, a, grad_entropy=a)
    with pytest.raises(ValueError, match="temperature"):
        logp_entropy_grad_(x, labels, lse, a, temperature=0.0)
