"""Experiment (GPU): where a Gemma-3-1B-shaped step's time goes, eager and under ``torch.compile``.

Question: ``benchmark/results/compile.csv`` has the patched Gemma-3 step faster compiled than eager
(47.1 against 56.9 ms, 4 layers, 4 x 2048 tokens), while on Llama the eager step is the faster one.
Is the difference GPU work (Inductor's fused layers beating our kernels) or host time?

Per provider (ours eager, ours compiled, HF compiled): the wall time of 5 steps after 4 warm-up steps,
then a torch.profiler run of 2 steps; prints the kernels' device time per step (top 22 by self
device time; the profiler lists an aten op and its kernel both, so the top rows pair up) and the
device-timed events per step (aten ops and kernels both counted).

H200 (torch 2.11, triton 3.6): wall 49.5 / 47.8 / 45.3 ms per step; GPU kernels ~45 ms per step for
all three (the head's GEMMs and the loss tile 4.2-4.4 ms alike, our norms' backward 1.1 ms against
Inductor's fused pointwise kernels); 965 / 820 / 508 device-timed events per step. Status: answered: the
difference is host time (launches and Python per layer), not GPU work.

Usage: ``python -m benchmark.experiments.diag_compile_profile [family]`` (a key of
``benchmark.trainer_data.SHAPES``, default ``gemma3-1b``).
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmark import trainer_data as data
from benchmark.bench_compile import lm_batch, prepared, train_step


def main(family: str = "gemma3-1b") -> None:
    base = data.build_model(data.SHAPES[family], device="cuda", dtype=torch.bfloat16, seed=0, layers=4)
    base.train()
    inputs = lm_batch(base.config.vocab_size, 4, 2048)
    for provider in ("ours", "ours-compiled", "hf-compiled"):
        model, run = prepared(base, provider)
        step = train_step(model, run, inputs)
        for _ in range(4):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / 5 * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        timed = sum(e.count for e in events) / 2  # an aten op and its kernel each count
        print(f"=== {family} {provider}: wall {wall:.1f} ms/step, {timed:.0f} device-timed events/step")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:22]:
            print(f"  {e.self_device_time_total / 2e3:7.2f} ms {e.count / 2:6.0f}x  {e.key[:110]}")
        del model, run
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:2])
