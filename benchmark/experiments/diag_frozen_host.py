"""Experiment (GPU): is the frozen head's block loop host-bound?

Question: the frozen-head path (``chunked/frozen_head.py``) issues three launches per vocabulary
block and one per chunk (~450 a call at 8192 x 4096 x 128256). Its GPU idles ~2.3-3.6 ms a call in
~450 gaps, and the same loop at 8192-column blocks (~800 launches) measured 30-45 ms against 28.5.
How long does the host take to issue one chunk, against the GPU's time for it, at each block size?
And where in one block does the host time go?

Prints per configuration: the call's ``do_bench`` median (ms), the chunks, the host time to issue
one chunk (median over the chunks of 5 calls, from ``perf_counter`` around ``OnlinePass.chunk``)
and the GPU time per chunk (the call's time over its chunks); then the host time of each piece of
one block (logits GEMM, block kernel, accumulating GEMM), each timed over 200 issues on a busy GPU.

    python -m benchmark.experiments.diag_frozen_host
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmark.experiments.diag_frozen_head import frozen_case

N, H, V = 8192, 4096, 128256
CONFIGS = {
    "16384 cols (shipped)": {},
    "8192 cols": dict(frozen_block_columns=8192),
    "32768 cols": dict(frozen_block_columns=32768),
}


def _busy(ms: float) -> None:
    """Queue ``ms`` of GPU work (so that host timings below never wait on a full launch queue)."""
    torch.cuda._sleep(int(ms * 1.5e6))


def main():
    import triton.testing

    from liger_losses.chunked import frozen_head
    from liger_losses.chunked.config import engine_config
    from liger_losses.chunked.gemm import mm_into
    from liger_losses.kernels.online_block import OnlineState, online_block

    torch.manual_seed(0)
    w, h, y, step = frozen_case(N, H, V)
    chunk_host: list[float] = []
    original = frozen_head.OnlinePass.chunk

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        original(self, *args, **kwargs)
        chunk_host.append((time.perf_counter() - t0) * 1e3)

    for name, cfg in CONFIGS.items():
        with engine_config(**cfg):
            ms = triton.testing.do_bench(step, warmup=10, rep=150)
            chunks = len(frozen_head.online_token_chunks(V, H, 2, N))
            frozen_head.OnlinePass.chunk = timed
            try:
                chunk_host.clear()
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            finally:
                frozen_head.OnlinePass.chunk = original
        print(f"{name}: {ms:.2f} ms a call, {chunks} chunks; host {statistics.median(chunk_host):.3f} ms to issue a "
              f"chunk (min {min(chunk_host):.3f}, max {max(chunk_host):.3f}) against the GPU's {ms / chunks:.3f}",
              flush=True)

    n, cols = 512, 16032
    hs, ys = h[:n].detach(), y[:n]
    wb = w[:cols]
    tile = torch.empty(n, cols, dtype=w.dtype, device="cuda")
    acc = torch.zeros(n, H, dtype=torch.float32, device="cuda")
    state = OnlineState.empty(n, w.device)
    online_block(tile, ys, 0, state, acc, first=True)
    pieces = {
        "logits GEMM (torch.mm out=)": lambda: torch.mm(hs, wb.t(), out=tile),
        "block kernel (online_block)": lambda: online_block(tile, ys, 0, state, acc, first=False),
        "accumulating GEMM (mm_into)": lambda: mm_into(acc, tile, wb, accumulate=True),
    }
    for name, fn in pieces.items():
        fn()
        torch.cuda.synchronize()
        _busy(400)
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        host = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
        print(f"host per issue, {name}: {host:.1f} us", flush=True)


if __name__ == "__main__":
    main()
