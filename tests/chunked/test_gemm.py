"""The head's weight-gradient accumulator (``chunked/gemm.py``: ``weight_accum``, ``HeadGrads``).

A bf16 / fp16 head whose gradient more than one chunk adds to is accumulated in fp32 by default
(``EngineConfig.half_weight_accum_dtype``); one chunk writes it in the weight's dtype. The losses'
results are compared bitwise where the same GEMMs run (the default against the explicit
``accum_dtype`` it stands for), and against float64 where the point is the rounding.
"""

import pytest
import torch

from liger_losses import (
    fused_linear_cross_entropy,
    fused_linear_distillation_loss,
    fused_linear_dpo_loss,
    fused_linear_grpo_loss,
)
from liger_losses.chunked.config import EngineConfig, engine_config
from liger_losses.chunked.gemm import HeadGrads, WeightAccum, weight_accum
from liger_losses.chunked.tokens import hidden_rows_at
from tests.helpers import rel_err

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


def test_weight_accum_resolution():
    """An explicit ``accum_dtype`` is used for one chunk and many; None keeps the weight's dtype for
    one chunk and widens a half-precision weight to the engine's choice for several."""
    assert weight_accum(None, BF16) == WeightAccum(BF16, FP32)
    assert weight_accum(None, FP16) == WeightAccum(FP16, FP32)
    assert weight_accum(None, FP32) == WeightAccum(FP32, FP32)
    assert weight_accum(BF16, BF16) == WeightAccum(BF16, BF16)
    assert weight_accum(FP32, BF16) == WeightAccum(FP32, FP32)
    with engine_config(half_weight_accum_dtype=None):
        assert weight_accum(None, BF16) == WeightAccum(BF16, BF16)
    with engine_config(half_weight_accum_dtype=FP64):
        assert weight_accum(None, BF16) == WeightAccum(BF16, FP64)
    with pytest.raises(ValueError, match="half_weight_accum_dtype"):
        EngineConfig(half_weight_accum_dtype=BF16)


@pytest.mark.parametrize("chunks", [1, 3])
def test_head_grads_buffer_dtype(chunks):
    """The weight-gradient buffer is made by the first add: bf16 when that add covers every token,
    fp32 when later adds follow; no add gives bf16 zeros."""
    g = torch.Generator().manual_seed(0)
    N, V, H = 12, 10, 8
    hidden = torch.randn(N, H, generator=g).to(BF16)
    weight = torch.randn(V, H, generator=g).to(BF16)
    rows = hidden_rows_at(hidden, torch.arange(N))
    grads = HeadGrads(rows, V, H, dtype=BF16, accum=weight_accum(None, BF16), device="cpu",
                      hidden=False, weight=True, bias=False)
    assert grads.weight is None
    step = N // chunks
    for ts in range(0, N, step):
        tile = torch.randn(step, V, generator=g).to(BF16)
        grads.add(tile, hidden[ts:ts + step], weight, ts, ts + step)
    _, gw, _ = grads.finish()
    assert gw.dtype == (BF16 if chunks == 1 else FP32)
    empty = HeadGrads(rows, V, H, dtype=BF16, accum=weight_accum(None, BF16), device="cpu",
                      hidden=False, weight=True, bias=False)
    _, gw0, _ = empty.finish()
    assert gw0.dtype == BF16 and not gw0.any()


def _loss_inputs(seed, B=4, T=24, H=16, V=40):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(V, H, generator=g) * 0.5).to(BF16)
    h = torch.randn(B, T, H, generator=g).to(BF16)
    h_ref = (h.float() + 0.1 * torch.randn(B, T, H, generator=g)).to(BF16)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, :3] = -100
    adv = torch.randn(B, generator=g)
    return w, h, h_ref, labels, adv


def _weight_grad(loss_name, accum_dtype, chunk_tokens):
    w, h, h_ref, labels, adv = _loss_inputs(1)
    w = w.clone().requires_grad_()
    h = h.clone().requires_grad_()
    kw = dict(chunk_tokens=chunk_tokens, accum_dtype=accum_dtype, impl="torch")
    if loss_name == "ce":
        loss = fused_linear_cross_entropy(w, h, labels, **kw)
    elif loss_name == "dpo":
        loss = fused_linear_dpo_loss(w, h, h_ref, labels, **kw).loss
    elif loss_name == "grpo":
        loss = fused_linear_grpo_loss(w, h, None, labels, advantages=adv, **kw).loss
    else:
        loss = fused_linear_distillation_loss(w, h, h_ref, labels, teacher_weight=w.detach(), **kw).loss
    loss.backward()
    return w.grad


@pytest.mark.parametrize("loss_name", ["ce", "dpo", "grpo", "distillation"])
def test_default_is_fp32_accumulation_over_chunks(loss_name):
    """Over several chunks the default weight gradient of a bf16 head is the fp32-accumulated one
    (bitwise: the same GEMMs into the same fp32 buffer, cast once) and, with the engine's choice
    off, the bf16-accumulated one; in one chunk (the whole batch) the default is the bf16 path's,
    which rounds once. The gradient comes back in the weight's dtype either way."""
    default = _weight_grad(loss_name, None, 24)
    fp32 = _weight_grad(loss_name, FP32, 24)
    assert default.dtype == BF16
    assert torch.equal(default, fp32)
    with engine_config(half_weight_accum_dtype=None):
        off = _weight_grad(loss_name, None, 24)
    assert torch.equal(off, _weight_grad(loss_name, BF16, 24))
    assert torch.equal(_weight_grad(loss_name, None, 4096), _weight_grad(loss_name, BF16, 4096))


def test_fp32_accumulation_error_does_not_grow_with_chunks():
    """Cross-entropy over 64 chunks of 8 tokens with a bf16 head, against the float64 gradient: the
    default stays within 1.25x the error of one chunk over all tokens (whose floor is the bf16 tile
    and operands: 2.3-2.4e-3 on these seeds, against 2.7e-3 over 64 chunks), while accumulating in
    bf16 is at least 2.5x the default's (8.8-8.9e-3 measured: each chunk rounds the running sum)."""
    g = torch.Generator().manual_seed(3)
    N, H, V = 512, 32, 64
    w = (torch.randn(V, H, generator=g) * 0.3).to(BF16)
    h = torch.randn(N, H, generator=g).to(BF16)
    labels = torch.randint(0, V, (N,), generator=g)

    def grad(accum_dtype, chunk_tokens=8, dtype=BF16):
        wl = w.to(dtype).clone().requires_grad_()
        fused_linear_cross_entropy(wl, h.to(dtype), labels, chunk_tokens=chunk_tokens, accum_dtype=accum_dtype,
                                   reduction="sum", impl="torch").backward()
        return wl.grad

    ref = grad(None, dtype=FP64)
    err_default = rel_err(grad(None), ref)
    err_one_chunk = rel_err(grad(None, chunk_tokens=N), ref)
    err_bf16 = rel_err(grad(BF16), ref)
    assert err_default <= 1.25 * err_one_chunk, (err_default, err_one_chunk)
    assert err_bf16 >= 2.5 * err_default, (err_bf16, err_default)
