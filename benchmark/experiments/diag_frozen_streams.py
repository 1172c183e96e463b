"""Experiment (GPU): the frozen-head path's token chunks on side streams (``EngineConfig.frozen_streams``).

Question: at 8192 x 4096 x 128256 the online-softmax path (``chunked/frozen_head.py``) ran 28.3 ms
against the tile path's 25.7 (GEMMs alone 24.5); its kernels sum to ~25.9 ms, the rest is idle
gaps between its ~400 kernels, and its block kernel is memory-bound beside compute-bound GEMMs.
Do two or three streams, each with its share of the same budget (so the same peak), fill the
gaps and overlap the block kernel with another chunk's GEMMs, and are the values unchanged?

Prints, per configuration (streams, budget, block columns), ``do_bench`` median ms and the peak
above the inputs (MiB), beside the tile path and the two GEMMs alone ([N, V] logits, then the
hidden gradient) in the same run; and whether the hidden gradient and the loss are bitwise equal
to the one-stream path's.

H200 (one run; the same configuration twice: 29.08 / 31.78 ms): GEMMs alone 24.35 ms, tile path
26.35 ms / 565 MiB; 1 stream, 512-token chunks 29.08-31.78 ms / 88 MiB; 1 stream, 256-token chunks
33.84 / 76; 2 streams of 256-token chunks 49.76 / 88; 2 streams of 384 tokens x 8192 columns 54.65
/ 88; 3 streams of 256 tokens 45.19 / 88; 2 streams of 342 tokens (32 MiB) 33.10 / 96. Every
stream count gave the one-stream values bitwise. Status: answered, no: concurrent chunks are
1.5-1.7x slower than the same chunks on one stream (their GEMMs share the SMs and L2, each
sized for the whole GPU); the knob was removed (this script runs on the commit that has it).

    python -m benchmark.experiments.diag_frozen_streams
"""

from __future__ import annotations

import torch

MIB = 2**20
CONFIGS = [  # (frozen_streams, frozen_budget_bytes MiB, frozen_block_columns)
    (1, 12, 16384),  # the chunks of the next row on one stream: its reference for bitwise equality
    (2, 24, 16384),
    (1, 24, 16384),
    (2, 24, 8192),
    (3, 24, 8192),
    (2, 32, 16384),
    (1, 24, 16384),
]


def main():
    import triton.testing

    from liger_losses.chunked.config import engine_config
    from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy
    from liger_losses.chunked.frozen_head import online_token_chunks

    torch.manual_seed(0)
    N, H, V = 8192, 4096, 128256
    w = (torch.randn(V, H, device="cuda") * 0.02).bfloat16()
    h = torch.randn(N, H, device="cuda").bfloat16().requires_grad_()
    y = torch.randint(0, V, (N,), device="cuda")

    def step():
        loss = fused_linear_cross_entropy(w, h, y)
        (g,) = torch.autograd.grad(loss, h)
        return loss.detach(), g

    def measure():
        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / MIB
        return triton.testing.do_bench(step, warmup=10, rep=200), peak, out

    logits = torch.empty(N, V, device="cuda", dtype=torch.bfloat16)
    grad = torch.empty(N, H, device="cuda", dtype=torch.bfloat16)

    def gemms():
        torch.mm(h.detach(), w.t(), out=logits)
        torch.mm(logits, w, out=grad)

    print(f"GEMMs alone: {triton.testing.do_bench(gemms, warmup=10, rep=200):.2f} ms", flush=True)
    del logits, grad
    with engine_config(frozen_head_online=False):
        ms, peak, _ = measure()
    print(f"tile path: {ms:.2f} ms, peak {peak:.0f} MiB", flush=True)
    refs = {}
    for streams, budget, cols in CONFIGS:
        with engine_config(frozen_streams=streams, frozen_budget_bytes=budget * MIB, frozen_block_columns=cols):
            ms, peak, (loss, g) = measure()
            n = online_token_chunks(V, H, 2, N, streams)[0][1]
        ref = refs.setdefault((n, cols), (loss, g))  # the first run of these chunks
        same = bool(torch.equal(loss, ref[0]) and torch.equal(g, ref[1]))
        print(f"streams {streams}, budget {budget} MiB, block {cols} cols, {n}-token chunks: {ms:.2f} ms, "
              f"peak {peak:.0f} MiB, bitwise equal to the first run of these chunks: {same}", flush=True)


if __name__ == "__main__":
    main()
