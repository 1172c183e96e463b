"""GPU: every public fused-linear loss synchronizes the host as often with many chunks as with one.

The syncs a loss needs (token counts and compaction before the chunk loop, the metrics after it)
do not depend on the number of chunks; a sync inside the loop (a tensor made from host data, an
``.item()``) drains the stream once per chunk and leaves the GPU idle while the host issues the next
chunk -- on the H200 that cost DPO ~10 ms of a 47 ms step (benchmark/NOTES.md, "One host sync
per loss"). Counted with ``torch.cuda.set_sync_debug_mode`` for forward + backward at 24-token
chunks (several per pair) against 4096-token chunks (one), after a warm-up call. Small shapes,
fp32: exact counts, not speed.
"""

import pytest
import torch

from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy
from liger_losses.chunked.distillation import fused_linear_distillation_loss
from liger_losses.chunked.preference.cpo import fused_linear_cpo_loss, fused_linear_simpo_loss
from liger_losses.chunked.preference.dpo import fused_linear_dpo_loss
from liger_losses.chunked.preference.kto import fused_linear_kto_loss
from liger_losses.chunked.preference.orpo import fused_linear_orpo_loss
from liger_losses.chunked.token_logprobs import fused_linear_token_logprobs
from tests.helpers import count_host_syncs

pytestmark = pytest.mark.gpu

B, T, H, V = 8, 32, 64, 1000

LOSSES = {
    "cross_entropy": lambda w, h, r, y, c: fused_linear_cross_entropy(w, h, y, chunk_tokens=c),
    "token_logprobs": lambda w, h, r, y, c: fused_linear_token_logprobs(w, h, y, chunk_tokens=c).sum(),
    "dpo": lambda w, h, r, y, c: fused_linear_dpo_loss(w, h, r, y, chunk_tokens=c).loss,
    "dpo_reference_free": lambda w, h, r, y, c: fused_linear_dpo_loss(w, h, None, y, reference_free=True,
                                                                      chunk_tokens=c).loss,
    "simpo": lambda w, h, r, y, c: fused_linear_simpo_loss(w, h, y, chunk_tokens=c).loss,
    "cpo": lambda w, h, r, y, c: fused_linear_cpo_loss(w, h, y, chunk_tokens=c).loss,
    "orpo": lambda w, h, r, y, c: fused_linear_orpo_loss(w, h, y, chunk_tokens=c).loss,
    "kto": lambda w, h, r, y, c: fused_linear_kto_loss(
        w, h, r, y, preference_labels=torch.arange(B, device=y.device) % 2 == 0,
        kl_hidden=h.roll(1, 0), kl_ref_hidden=r.roll(1, 0), kl_labels=y, chunk_tokens=c).loss,
    "distillation": lambda w, h, r, y, c: fused_linear_distillation_loss(
        w, h, r, y, teacher_weight=w.detach(), chunk_tokens=c).loss,
}


def make_step(name):
    """``step(chunk_tokens) -> run``: forward + gradients of weight and hidden of loss ``name`` on
    fixed CUDA inputs (the first 8 tokens of every sequence ignored)."""
    dev = "cuda"
    torch.manual_seed(0)
    w = (torch.randn(V, H, device=dev) * 0.1).requires_grad_()
    h = torch.randn(B, T, H, device=dev).requires_grad_()
    ref_h = torch.randn(B, T, H, device=dev)
    labels = torch.randint(0, V, (B, T), device=dev)
    labels[:, :8] = -100
    loss_fn = LOSSES[name]

    def step(chunk_tokens):
        def run():
            loss = loss_fn(w, h, ref_h, labels, chunk_tokens)
            torch.autograd.grad(loss, (w, h))

        return run

    return step


@pytest.mark.parametrize("name", list(LOSSES))
def test_host_syncs_do_not_grow_with_chunks(name):
    step = make_step(name)

    step(4096)()  # warm-up: compilation and caches
    many, one = count_host_syncs(step(24)), count_host_syncs(step(4096))
    # <=: cross-entropy at 24-token chunks issues its first chunk before the sync, which then
    # waits on a CUDA event (not reported by the sync debug mode) instead of a .tolist()
    assert many <= one, f"{name}: {many} host syncs with 24-token chunks, {one} with one chunk"


@pytest.mark.parametrize("name", ["cross_entropy", "dpo", "simpo"])
def test_one_host_sync_per_step(name):
    """Cross-entropy and the pair losses synchronize exactly once per forward + backward: the labels'
    range check, the valid-token count and the per-sequence counts are read back together
    (tokens.scan_labels), compaction uses the known count (``nonzero_static``), and the backward
    scales on the device (EngineConfig.device_scale)."""
    run = make_step(name)(None)
    run()  # warm-up: compilation and caches
    assert count_host_syncs(run) == 1


@pytest.mark.parametrize("name", ["cross_entropy", "dpo", "simpo", "token_logprobs"])
def test_no_host_sync_with_labels_scanned_ahead(name):
    """With the labels' scan queued before the loss (``tokens.scan_labels_ahead``, what the trainers do
    before the backbone's forward), the loss waits on that scan's event only: no synchronization the
    debug mode reports, so the forward's kernels queued before it keep running."""
    from liger_losses.chunked.tokens import scan_labels_ahead

    torch.manual_seed(0)
    w = (torch.randn(V, H, device="cuda") * 0.1).requires_grad_()
    h = torch.randn(B, T, H, device="cuda").requires_grad_()
    ref_h = torch.randn(B, T, H, device="cuda")

    def run():
        labels = torch.randint(0, V, (B, T), device="cuda")
        labels[:, :8] = -100
        scan_labels_ahead(labels, -100, V)
        torch.autograd.grad(LOSSES[name](w, h, ref_h, labels, None), (w, h))

    run()  # warm-up: compilation and caches
    assert count_host_syncs(run) == 0


def test_speculative_first_chunk_on_the_gpu():
    """Cross-entropy with its first chunk issued before the host sync (24-token chunks, 8 of 32
    tokens per row ignored): no sync reported (the wait is on a CUDA event after a non-blocking copy
    of the counts to pinned memory), and the loss and gradients equal the plain path's bitwise."""
    from liger_losses.chunked.config import engine_config

    step = make_step("cross_entropy")
    torch.manual_seed(1)
    w = (torch.randn(V, H, device="cuda") * 0.1).requires_grad_()
    h = torch.randn(B, T, H, device="cuda").requires_grad_()
    labels = torch.randint(0, V, (B, T), device="cuda")
    labels[:, :8] = -100

    def run():
        loss = fused_linear_cross_entropy(w, h, labels, chunk_tokens=24)
        return (loss.detach(), *torch.autograd.grad(loss, (w, h)))

    step(24)()  # warm-up
    assert count_host_syncs(step(24)) == 0
    fast = run()
    with engine_config(speculative_first_chunk=False):
        plain = run()
    for a, b in zip(fast, plain):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_speculative_first_chunk_on_a_non_current_gpu():
    """Inputs on cuda:1 while cuda:0 is current (device_map model parallelism): the wait on the
    counts' copy covers the copy (the event is recorded on the labels' device's stream); loss and
    gradients equal the plain path's bitwise, 20 times, so that a stale pinned read would show."""
    from liger_losses.chunked.config import engine_config

    dev = torch.device("cuda", 1)
    torch.cuda.set_device(0)
    torch.manual_seed(1)
    w = (torch.randn(V, H, device=dev) * 0.1).requires_grad_()
    h = torch.randn(8, 512, H, device=dev).requires_grad_()
    labels = torch.randint(0, V, (8, 512), device=dev)
    labels[:, :100] = -100

    def run():
        loss = fused_linear_cross_entropy(w, h, labels, chunk_tokens=256)
        return (loss.detach(), *torch.autograd.grad(loss, (w, h)))

    for _ in range(20):
        out = []
        for speculate in (True, False):
            with engine_config(speculative_first_chunk=speculate):
                out.append(run())
        for a, b in zip(*out):
            assert torch.equal(a, b)
