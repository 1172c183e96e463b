"""Programmatic dependent launch (``liger_losses.kernels.pdl``): when it is used, and that kernels
launched with it give bitwise the same results as without, eagerly and replayed in a CUDA graph.

Bitwise (not a tolerance): PDL changes when a kernel may start, never what it computes; a missing
wait would show up as stale or partial inputs, i.e. different bits.
"""

import pytest
import torch

from liger_losses.kernels import pdl
from liger_losses.kernels.layer_norm import layer_norm
from liger_losses.kernels.rms_norm import rms_norm
from liger_losses.kernels.rope import apply_rotary_pos_emb


def test_pdl_only_on_cuda_and_when_enabled(monkeypatch):
    """Never on the CPU (or in the interpreter); off everywhere with the switch off, for kernels not
    in PDLConfig.kernels and while torch.compile traces; the launch options carry launch_pdl only
    when PDL is used."""
    assert not pdl.pdl_launch(torch.device("cpu"), "norm_fwd")
    with pdl.PDL_CONFIG.override(enabled=False):
        assert not pdl.pdl_launch(torch.device("cuda", 0), "norm_fwd")
    with pdl.PDL_CONFIG.override(enabled=True, kernels=frozenset()):
        assert not pdl.pdl_launch(torch.device("cuda", 0), "norm_fwd")
    monkeypatch.setattr(pdl, "triton_interpret", lambda: False)  # so that only tracing says no
    monkeypatch.setattr(pdl, "is_compiling", lambda: True)  # torch.compile tracing: never
    with pdl.PDL_CONFIG.override(enabled=True, kernels=frozenset({"norm_fwd"})):
        assert not pdl.pdl_launch(torch.device("cuda", 0), "norm_fwd")
    assert pdl.launch_options(True) == {"launch_pdl": True}
    assert pdl.launch_options(False) == {}


def _norm_and_rope_step(x, w, b, q_lin, k_lin, cos, sin, dy):
    """RMSNorm, LayerNorm and in-place RoPE forward + backward: outputs and every gradient."""
    y1 = rms_norm(x, w, impl="triton")
    y2 = layer_norm(x, w, b, impl="triton")
    q = (q_lin * 1).view(1, -1, 32, 128).transpose(1, 2)
    k = (k_lin * 1).view(1, -1, 8, 128).transpose(1, 2)
    oq, ok = apply_rotary_pos_emb(q, k, cos, sin, inplace=True, inplace_backward=True,
                                  repeated_tables=True, impl="triton")
    loss_terms = ((y1 * dy).sum(), (y2 * dy).sum(), (oq * oq).sum(), (ok * 2).sum())
    grads = torch.autograd.grad(sum(loss_terms), [x, w, b, q_lin, k_lin])
    return (y1, y2, oq.detach(), ok.detach(), *grads)


_EVERY = frozenset({"norm_fwd", "norm_bwd", "sum", "rope"})


@pytest.fixture
def pdl_everywhere():
    """PDL on for every kernel that can take it (RoPE too), for the test's duration."""
    with pdl.PDL_CONFIG.override(enabled=True, kernels=_EVERY):
        yield


@pytest.mark.gpu
def test_pdl_results_bitwise_equal_eager_and_graph(pdl_everywhere):
    """H200 (capability 9): RMSNorm, LayerNorm and in-place RoPE at 4096 x 4096 bf16, forward +
    backward, with PDL equal bitwise to without, eagerly and in a CUDA graph replay (each with its
    own inputs refilled before the replay)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a CUDA GPU of capability >= 9")
    assert all(pdl.pdl_launch(torch.device("cuda"), k) for k in _EVERY)
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(4096, 4096, device=dev, dtype=dt, requires_grad=True)
    w = (1 + 0.1 * torch.randn(4096, device=dev, dtype=dt)).requires_grad_()
    b = (0.1 * torch.randn(4096, device=dev, dtype=dt)).requires_grad_()
    dy = torch.randn(4096, 4096, device=dev, dtype=dt)
    q_lin = torch.randn(1, 4096, 32 * 128, device=dev, dtype=dt, requires_grad=True)
    k_lin = torch.randn(1, 4096, 8 * 128, device=dev, dtype=dt, requires_grad=True)
    pos = (torch.arange(4096, device=dev, dtype=torch.float32)[:, None]
           / (10000 ** (torch.arange(0, 128, 2, device=dev) / 128)))
    emb = torch.cat((pos, pos), dim=-1)[None]
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    args = (x, w, b, q_lin, k_lin, cos, sin, dy)

    with pdl.PDL_CONFIG.override(enabled=False):
        want = _norm_and_rope_step(*args)
    got = _norm_and_rope_step(*args)
    for i, (g, r) in enumerate(zip(got, want)):
        assert torch.equal(g, r), f"eager output {i} differs with PDL"

    static = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, w, b, q_lin, k_lin)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            _norm_and_rope_step(*static, cos, sin, dy)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = _norm_and_rope_step(*static, cos, sin, dy)
    for s, t in zip(static, (x, w, b, q_lin, k_lin)):
        with torch.no_grad():
            s.copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    for i, (g, r) in enumerate(zip(out, want)):
        assert torch.equal(g, r), f"graph output {i} differs with PDL"
