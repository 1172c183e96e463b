"""Experiment (GPU): the frozen-head cross-entropy's chunk and block sizes, and where its time goes.

Question: the online-softmax path (``chunked/frozen_head.py``) holds the peak at ~1.25x the hidden
gradient, but at 8192 x 4096 x 128256 it first ran 29.5 ms against the tile path's 26.1 (GEMMs alone
24.9). Which of token chunk (``frozen_budget_bytes``), vocabulary block (``frozen_block_columns``)
and the block kernel's launch (``online_block`` knobs) decide that, and what do the kernels add?

Prints, per configuration, ``do_bench`` median ms and the peak above the inputs (MiB); then a
profiler table of the default configuration's GPU time by kernel.

Status: open (sizes the defaults in ``chunked/config.py``).

    python -m benchmark.experiments.diag_frozen_head
"""

from __future__ import annotations

import torch

MIB = 2**20
CONFIGS = [  # (frozen_budget_bytes MiB, frozen_block_columns, online_block knobs)
    (24, 8192, {}),
    (24, 8192, {"num_warps": 8, "block_cap": 4096}),
    (24, 4096, {}),
    (32, 16384, {}),
    (40, 8192, {}),
    (48, 16384, {}),
    (64, 16384, {}),
]


def main():
    import triton.testing

    from liger_losses.chunked.config import engine_config
    from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy
    from liger_losses.kernels.tuning import tuning

    torch.manual_seed(0)
    N, H, V = 8192, 4096, 128256
    w = (torch.randn(V, H, device="cuda") * 0.02).bfloat16()
    h = torch.randn(N, H, device="cuda").bfloat16().requires_grad_()
    y = torch.randint(0, V, (N,), device="cuda")

    def step():
        (g,) = torch.autograd.grad(fused_linear_cross_entropy(w, h, y), h)
        return g

    def measure():
        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = (torch.cuda.max_memory_allocated() - base) / MIB
        return triton.testing.do_bench(step, warmup=10, rep=200), peak

    with engine_config(frozen_head_online=False):
        ms, peak = measure()
    print(f"tile path: {ms:.2f} ms, peak {peak:.0f} MiB", flush=True)
    for budget, cols, knobs in CONFIGS:
        with engine_config(frozen_budget_bytes=budget * MIB, frozen_block_columns=cols), tuning(online_block=knobs):
            ms, peak = measure()
        print(f"budget {budget} MiB, block {cols} cols, {knobs}: {ms:.2f} ms, peak {peak:.0f} MiB", flush=True)

    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))


if __name__ == "__main__":
    main()
