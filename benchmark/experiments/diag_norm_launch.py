"""Experiment (GPU): programmatic dependent launch (PDL) for none, some or all of the norms' kernels
(``pdl`` slot, knob ``kernels``), and for in-place RoPE as patched models run it.

Question: at 4096 tokens the three launches' gaps, ramps and tails are a large part of the norms'
time above the HBM floor (RMSNorm 4096 x 4096: forward 19.9 us, backward 29.0, partial sum 2.8,
graph 55.6, floor 39.0). Does letting each kernel start while the previous one finishes help?

Verdict (H200, bf16): at H = 4096 PDL saves 0.7-1.2 us per forward + backward (RMSNorm 4096 0.0559 ->
0.0552 ms, LayerNorm 4096 0.0597 -> 0.0587, LayerNorm 8192 0.1019 -> 0.1007); the partial-sum kernel
then shows ~31 us in the profile: resident early, waiting for the backward. But the LayerNorm forward
at 8192 x 896 (4-row tiles, 2048 programs) loses 3.3 us, and RoPE at the Qwen2-0.5B shape 25%
(0.0175 -> 0.0219 ms; neutral at 8B). PDL is on where it was measured to help: the norm backward,
the partial sum, the norm forward with one-row tiles. (Several forward tiles per program with the
next load issued first: 0-1% slower, dropped.)

Status: open: why many small programs lose with PDL (the dependents launch only once every program
has started); next, trigger at the end of each program instead and re-measure.

The norms' forward + backward at 4096 and 8192 tokens (H = 4096, bf16) and at 8192 x 896, as
CUDA-graph time (median, L2 flushed as do_bench does) and each kernel's mean GPU time in the replay.

    python -m benchmark.experiments.diag_norm_launch [--profile]
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmark.common import graphed, hbm_floor_ms, time_ms
from benchmark.experiments.diag_l2_flush import kernel_times, providers
from liger_losses.kernels.pdl import PDL_CONFIG

VARIANTS = {  # name: the pdl slot's kernels
    "off": frozenset(),
    "fwd+bwd+sum": frozenset({"norm_fwd", "norm_bwd", "sum"}),
    "bwd+sum": frozenset({"norm_bwd", "sum"}),
    "sum": frozenset({"sum"}),
}
SHAPES = [(4096, 4096), (8192, 4096), (8192, 896)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", action="store_true", help="also each kernel's GPU time")
    args = ap.parse_args()
    os.environ["BENCH_GRAPH"] = "1"
    for kind in ("rms", "layer"):
        for N, H in SHAPES:
            floor = hbm_floor_ms(10 * N * H)
            for variant, kernels in VARIANTS.items():
                with PDL_CONFIG.override(kernels=kernels):
                    fn = providers(kind, N, H)["ours"]
                    fn()
                    ms = time_ms(fn, warmup=10, rep=60)
                    print(f"{kind} N={N} H={H} {variant:12s} {ms:.4f} ms  {ms / floor:.3f}x floor", flush=True)
                    if args.profile:
                        for key, us in kernel_times(graphed(fn)):
                            print(f"    {us:8.2f} us  {key}")
                    torch.cuda.synchronize()
    from benchmark.experiments.diag_rope import case_fns

    for shape in ("llama3-8b", "qwen2-0.5b"):
        for variant, kernels in (("off", frozenset()), ("rope", frozenset({"rope"}))):
            with PDL_CONFIG.override(kernels=kernels):
                fns, floor = case_fns(shape, 8192)
                clone_ms = time_ms(fns.pop("clone"), warmup=10, rep=60)
                fn = fns["ours-patched"]
                fn()
                ms = time_ms(fn, warmup=10, rep=60) - clone_ms
            print(f"rope {shape} 8192 ours-patched {variant:5s} net {ms:.4f} ms  {ms / floor:.3f}x floor", flush=True)


if __name__ == "__main__":
    main()
