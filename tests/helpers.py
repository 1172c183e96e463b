"""Small helpers the tests share: relative error against a float64 reference, tolerances."""

import torch

# Relative-error bars (issue #2): fp32 1e-5, bf16 1e-2, measured as ||out - ref|| / ||ref||.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float64: 1e-10}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are zero)."""
    out = out.detach().double()
    ref = ref.detach().double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "output has NaN/inf"
    denom = ref.norm()
    num = (out - ref).norm()
    if denom == 0:
        return float(num)
    return float(num / denom)


def assert_close_rel(out, ref, tol, what=""):
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def lm_head_inputs(g: torch.Generator, B: int, T: int, H: int, V: int, dtype=torch.float32):
    """Random ``(weight [V, H], hidden [B, T, H], bias [V], labels [B, T])`` of an LM head, drawn in
    that order from ``g`` (the caller masks labels and may draw more from ``g``); the float tensors
    are leaves in ``dtype`` that require grad."""
    weight = torch.randn(V, H, generator=g).to(dtype).requires_grad_()
    hidden = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=g)
    return weight, hidden, bias, labels


def count_host_syncs(fn) -> int:
    """How many host-device synchronizations PyTorch reports (``torch.cuda.set_sync_debug_mode``)
    while ``fn()`` runs on a CUDA device: ``.item()``/``.tolist()``, ``nonzero``, masked indexing,
    copies from host memory (which drain the stream) and the like."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # "called a synchronizing CUDA operation" per sync; the first use of the debug mode in a process
    # also warns that it "is a prototype feature", which is no sync
    return sum("called a synchronizing" in str(c.message) for c in caught)


def count_speculative_passes(monkeypatch) -> list:
    """A list that grows by one each time a call takes the early-first-chunk path of the per-token
    passes (``EngineConfig.speculative_first_chunk``: one ``token_passes.PendingLabelScan`` per call)."""
    import liger_losses.chunked.token_passes as token_passes

    calls = []

    class Counted(token_passes.PendingLabelScan):
        def __init__(self, *args, **kwargs):
            calls.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(token_passes, "PendingLabelScan", Counted)
    return calls
