"""Experiment (GPU): the frozen head's block kernel (``kernels/online_block.py``) alone and in its loop.

Question: the block kernel is the frozen-head path's largest cost after its GEMMs (about 2 ms of
~29 at 8192 x 4096 x 128256 on an H100), one program per row reading its block twice (the
maximum, then the exponentials) and writing it once. Which warps per row and column step
(``online_block`` knobs) run it fastest, alone and in the chunk's loop, and does a kernel of
another checkout (a one-pass variant) beat it?

Run it once per checkout to compare kernels (``PYTHONPATH=<tree>``). Prints, per launch
configuration (``num_warps``, ``block_cap``), on a ``[rows, 16032]`` bf16 block of logits
(std 1.3, as the benchmark's ``0.02 * randn`` head on ``randn`` hidden states):

- ``cold``: ``do_bench`` median of one launch (the L2 flushed before each);
- ``warm``: 20 launches over the same block (it stays in L2) replayed from a CUDA graph, per launch
  (eager, back to back, they measure the host's wrapper instead: 35-50 us a launch on an H100 host);
- ``loop``: one chunk's block loop (logits GEMM, block kernel, accumulating GEMM; 8 blocks of
  16384 columns of V=128256) eager, ms;

and with ``--e2e`` the fused-linear cross-entropy with a frozen head (8192 tokens), alternating
five launch configurations (and the early first chunk on and off) over ``--rounds`` rounds, median (min..max) ms.

Verdict (H100 80GB HBM3, torch 2.11, triton 3.6, 512 rows): every configuration of 4-16 warps at
2048-4096 columns a step is within 1 us (cold 19.6-20.7 us, warm 11.4-11.9 us; the loop 1.67-1.71
ms); 8192-16384 columns a step are slower (cold 21.5-26.6 us). A one-pass kernel (the steps a row
has written rescaled when its reference moves; checkout 3519ea6) measured 22.6 us cold against the
two-pass kernel's 22.6 in one run. End to end (3 rounds): 4 warps 28.48 ms (28.47..28.63), 8 warps
28.39 (28.29..28.83), 8192 / 16384 columns 29.35 / 29.47; the early first chunk off 28.90
(28.62..29.92). Status: done; the defaults (4 warps, 2048 columns) stay.

    python -m benchmark.experiments.diag_online_block [--rows 512] [--e2e] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch

H, V, COLS = 4096, 128256, 16032
CONFIGS = [{"num_warps": w, "block_cap": c} for w in (4, 8, 16, 32) for c in (2048, 4096, 8192, 16384)
           if w * 32 * 4 <= c]  # at least 4 columns a thread


def _warm_us(fn, calls=20):
    import triton.testing

    from benchmark.common import graphed

    def many():
        for _ in range(calls):
            fn()

    return triton.testing.do_bench(graphed(many), warmup=5, rep=100) / calls * 1000


def main():
    import triton.testing

    from benchmark.experiments.diag_frozen_head import block_loop_probe
    from liger_losses.kernels.online_block import OnlineState, online_block
    from liger_losses.kernels.tuning import tuning

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n = args.rows
    torch.manual_seed(0)
    x = (torch.randn(n, COLS, device="cuda") * 1.3).bfloat16()
    labels = torch.randint(0, COLS, (n,), device="cuda")
    acc = torch.zeros(n, H, device="cuda")
    w = (torch.randn(V, H, device="cuda") * 0.02).bfloat16()
    h = torch.randn(n, H, device="cuda").bfloat16()
    y = torch.randint(0, V, (n,), device="cuda")
    for knobs in CONFIGS:
        with tuning(online_block=knobs):
            state = OnlineState.empty(n, "cuda")
            online_block(x, labels, 0, state, acc, first=True)

            def launch():
                online_block(x, labels, 0, state, acc, first=False)

            cold = triton.testing.do_bench(launch, warmup=20, rep=200) * 1000
            warm = _warm_us(launch)
            loop, _, nb = block_loop_probe(w, h, y, n, 16384)
        print(f"{knobs}: cold {cold:.1f} us, warm {warm:.1f} us per launch; loop of {nb} blocks {loop:.3f} ms",
              flush=True)
    if args.e2e:
        _end_to_end(args.rounds)


def _end_to_end(rounds):
    import triton.testing

    from benchmark.experiments.diag_frozen_head import frozen_case
    from liger_losses.chunked.config import engine_config
    from liger_losses.kernels.tuning import tuning

    step = frozen_case(8192, H, V)[3]

    cases = {f"{k}, early first chunk {early}": (k, early) for k, early in (
        (dict(num_warps=4, block_cap=2048), True), (dict(num_warps=4, block_cap=2048), False),
        (dict(num_warps=8, block_cap=2048), True), (dict(num_warps=8, block_cap=8192), True),
        (dict(num_warps=16, block_cap=16384), True))}
    times = {k: [] for k in cases}
    for _ in range(rounds):
        for label, (knobs, early) in cases.items():
            with tuning(online_block=knobs), engine_config(speculative_first_chunk=early):
                times[label].append(triton.testing.do_bench(step, warmup=10, rep=200))
    for label, ts in times.items():
        print(f"frozen CE 8192 tokens, {label}: {statistics.median(ts):.2f} ms ({min(ts):.2f}..{max(ts):.2f})")


if __name__ == "__main__":
    main()
