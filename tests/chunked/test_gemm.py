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
    assert weight_accum(None, BF16) == WeightAccum(BF16, FP32, BF16)
    assert weight_accum(None, FP16) == WeightAccum(FP16, FP32, FP16)
    assert weight_accum(None, FP32) == WeightAccum(FP32, FP32, FP32)
    assert weight_accum(BF16, BF16) == WeightAccum(BF16, BF16, BF16)
    assert weight_accum(FP32, BF16) == WeightAccum(FP32, FP32, BF16)
    with engine_config(half_weight_accum_dtype=None):
        assert weight_accum(None, BF16) == WeightAccum(BF16, BF16, BF16)
    with engine_config(half_weight_accum_dtype=FP64):
        assert weight_accum(None, BF16) == WeightAccum(BF16, FP64, BF16)
    # the planners' wide tile follows the buffer against the weight, explicit or not
    assert weight_accum(None, BF16).widens and weight_accum(FP32, BF16).widens
    assert not weight_accum(BF16, BF16).widens and not weight_accum(FP32, FP32).widens
    assert not weight_accum(None, FP32).widens and weight_accum(FP64, FP32).widens
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


def test_explicit_fp32_plans_the_default_tiles(monkeypatch):
    """An explicit ``accum_dtype=torch.float32`` on a bf16 head holds the same fp32 buffer as the
    default, so it plans the same wide tiles: the same chunks (counted as weight-gradient GEMMs),
    and over several chunks the same gradient bitwise."""
    from liger_losses.chunked import gemm

    V, H, N = 64, 8, 160  # wide tiles: V * H * 2 bytes = 8 tokens a chunk of 64 two-byte columns
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(V, H, generator=g) * 0.5).to(BF16)
    h = torch.randn(N, H, generator=g).to(BF16)
    labels = torch.randint(0, V, (N,), generator=g)
    calls = []
    real = gemm.mm_into

    def counting(out, a, b, accumulate):
        calls.append(out.dtype)
        return real(out, a, b, accumulate)

    def grad(accum_dtype):
        calls.clear()
        wl = w.clone().requires_grad_()
        with engine_config(default_budget_bytes=1):
            fused_linear_cross_entropy(wl, h, labels, accum_dtype=accum_dtype, impl="torch").backward()
        return wl.grad, list(calls)

    monkeypatch.setattr(gemm, "mm_into", counting)
    default, default_calls = grad(None)
    explicit, explicit_calls = grad(FP32)
    _, bf16_calls = grad(BF16)
    assert default_calls == explicit_calls == [FP32] * (N // 8)
    assert bf16_calls == [BF16] * (N // 4)  # half-weight tiles without the wide accumulator
    assert torch.equal(default, explicit)


def test_recomputed_backward_keeps_the_forward_accumulator():
    """Per-token losses that recompute their tiles in the backward (``reduction="none"``, token
    log-probs) accumulate in the dtype the forward's engine config gave, whatever is in force when
    ``backward()`` runs: forward under ``half_weight_accum_dtype=None`` -> the bf16 path's gradient
    bitwise; forward under the default -> the fp32 path's."""
    from liger_losses import fused_linear_token_logprobs

    w, h, _, labels, _ = _loss_inputs(2)

    def grad(fn, forward_config, backward_config):
        wl = w.clone().requires_grad_()
        with engine_config(**forward_config):
            out = fn(wl, h, labels, chunk_tokens=24, impl="torch")
        with engine_config(**backward_config):
            out.float().sum().backward()
        return wl.grad

    per_token = [lambda *a, **k: fused_linear_cross_entropy(*a, reduction="none", **k),
                 fused_linear_token_logprobs]
    off, fp64 = dict(half_weight_accum_dtype=None), dict(half_weight_accum_dtype=FP64)
    for fn in per_token:
        bf16 = grad(fn, off, off)
        default = grad(fn, {}, {})
        assert not torch.equal(bf16, default)  # 4 chunks: the two accumulators differ here
        assert torch.equal(grad(fn, off, fp64), bf16)
        assert torch.equal(grad(fn, {}, off), default)


def test_out_of_memory_is_not_remembered_as_no_out_dtype(monkeypatch):
    """An out-of-memory error inside the ``out_dtype`` GEMM propagates and leaves the fast path on
    (an OOM says nothing about whether torch has ``out_dtype``; remembering it as unsupported would
    give every later chunk the fallback's extra ``[V, H]`` temporary)."""
    from liger_losses.chunked import gemm

    out = torch.zeros(4, 3, dtype=FP32)
    a, b = torch.ones(4, 2, dtype=BF16), torch.ones(2, 3, dtype=BF16)
    key = ("cpu", BF16, FP32)
    monkeypatch.setitem(gemm._OUT_DTYPE_MM, key, True)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    with monkeypatch.context() as m:
        m.setattr(torch, "addmm", oom)
        with pytest.raises(torch.OutOfMemoryError):
            gemm.mm_into(out, a, b, accumulate=True)
    assert gemm._OUT_DTYPE_MM[key] is True
    gemm.mm_into(out, a, b, accumulate=True)
    assert torch.equal(out, torch.full((4, 3), 2.0))


@pytest.mark.parametrize("accumulate", [False, True])
def test_mm_into_without_out_dtype_matches_in_row_blocks(monkeypatch, accumulate):
    """Where torch has no ``out_dtype`` (before 2.8) the wide accumulator is written from bf16
    products in row blocks (a temporary of 1/8 of the weight, not all of it): the same values as one
    product, bitwise (each output row is the same dot products either way)."""
    from liger_losses.chunked import gemm

    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(21, 6, generator=g).to(BF16), torch.randn(6, 5, generator=g).to(BF16)
    start = torch.randn(21, 5, generator=g)
    monkeypatch.setitem(gemm._OUT_DTYPE_MM, ("cpu", BF16, FP32), False)
    out = start.clone()
    gemm.mm_into(out, a, b, accumulate)
    prod = torch.mm(a, b).float()
    assert torch.equal(out, start + prod if accumulate else prod)
