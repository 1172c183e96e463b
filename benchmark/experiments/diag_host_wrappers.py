"""Experiment (CPU): the host time of the layer wrappers' Python alone, kernel launches stubbed.

Question: in a host-bound training step (a 1B model at ~4k tokens on the H200 machine's CPU) what
does the Python around each layer kernel cost -- input checks, views, the autograd Function --
and what did the checked-signature shortcut (``kernels/utils.py`` ``CheckedSignatures``), the flat
gated launch and RoPE's launch on its carriers' geometry save? ``bench_host.py`` times the same
calls on the GPU, launches included, but that machine's CPU varies +-30% between runs; here the
launch is a no-op so only the wrappers' own host work is left, and two trees can be compared by
alternating runs of this script from each (``PYTHONPATH=<tree>``).

Cases (fresh inputs per call, [1, 8, 64] activations, CPU tensors, Triton path forced): RMSNorm
(the ``LigerRMSNorm`` module), SwiGLU as the MLP calls it (``inplace_backward=True``), in-place
RoPE with in-place backward as the patched attention calls it, each against the eager ops it
replaces. Prints the median per-call time of the forward, and of forward + backward.

This CPU (2 cores, shared), 5 alternating runs each, median, old tree (commit 4151bd0) -> new:
RMSNorm forward 36.5 -> 27.9 us, forward + backward 109.4 -> 97.1; SwiGLU 35.1 -> 26.3, 123.5 ->
87.7; RoPE 63.5 -> 46.5, 196.3 -> 168.6. Status: answered; the shortcut is in place.

    python -m benchmark.experiments.diag_host_wrappers
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def _force_triton_path_without_launches() -> None:
    """Make every wrapper take its Triton path on CPU tensors, with each launch a no-op."""
    import liger_losses.kernels.gated  # noqa: F401 - modules whose triton_runs_on is patched below
    import liger_losses.kernels.launch as launch
    import liger_losses.kernels.norm_common  # noqa: F401
    import liger_losses.kernels.rms_norm  # noqa: F401
    import liger_losses.kernels.rope  # noqa: F401
    import liger_losses.kernels.utils  # noqa: F401

    for name, module in list(sys.modules.items()):
        if name.startswith("liger_losses") and hasattr(module, "triton_runs_on"):
            module.triton_runs_on = lambda device: True
    launch.FastKernel.__getitem__ = lambda self, grid: (lambda *args, **kwargs: None)


def cases():
    from liger_losses.kernels.rms_norm import LigerRMSNorm
    from liger_losses.kernels.rope import apply_rotary_pos_emb
    from liger_losses.kernels.swiglu import swiglu

    T, H, inter, heads, head_dim = 8, 64, 128, 4, 16
    norm = LigerRMSNorm(H)
    cos, sin = torch.randn(1, T, head_dim), torch.randn(1, T, head_dim)

    def hidden():
        return torch.randn(1, T, H, requires_grad=True)

    def gate_up():
        return torch.randn(1, T, inter, requires_grad=True) * 1, torch.randn(1, T, inter, requires_grad=True) * 1

    def qk():  # HF's proj(h).view(B, T, heads, D).transpose(1, 2)
        q = (torch.randn(1, T, heads * head_dim, requires_grad=True) * 1).view(1, T, heads, head_dim).transpose(1, 2)
        k = (torch.randn(1, T, 2 * head_dim, requires_grad=True) * 1).view(1, T, 2, head_dim).transpose(1, 2)
        return q, k

    def hf_norm(x):
        v = x.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return norm.weight * v.to(x.dtype)

    def rotate_half(t):
        return torch.cat((-t[..., t.shape[-1] // 2:], t[..., : t.shape[-1] // 2]), -1)

    def hf_rope(q, k):
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s

    return {
        "rms_norm ours": (hidden, norm),
        "rms_norm hf": (hidden, hf_norm),
        "swiglu ours": (gate_up, lambda a: swiglu(*a, inplace_backward=True)),
        "swiglu torch": (gate_up, lambda a: F.silu(a[0]) * a[1]),
        "rope ours": (qk, lambda a: apply_rotary_pos_emb(*a, cos, sin, inplace=True, inplace_backward=True)),
        "rope hf": (qk, lambda a: hf_rope(*a)),
    }


def per_call_us(make, fn, full: bool, n: int = 300, repeats: int = 6) -> float:
    times = []
    for _ in range(repeats):
        inputs = [make() for _ in range(n)]
        start = time.perf_counter()
        for x in inputs:
            out = fn(x)
            if full:
                outs = out if isinstance(out, tuple) else (out,)
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        times.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(times[1:])  # the first repeat warms up


def main() -> None:
    _force_triton_path_without_launches()
    gc.disable()  # collections of the kept inputs' graphs would land in random calls
    for name, (make, fn) in cases().items():
        print(f"{name:15s} forward {per_call_us(make, fn, False):7.1f} us   "
              f"forward + backward {per_call_us(make, fn, True):7.1f} us", flush=True)


if __name__ == "__main__":
    main()
