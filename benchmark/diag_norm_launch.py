"""Diagnostic (GPU): the norms' forward + backward at 4096 and 8192 tokens (H = 4096, bf16) with
programmatic dependent launch on or off (``pdl.ENABLED``), as CUDA-graph time (median, L2 flushed as do_bench does) and
each kernel's mean GPU time in the replay.

Why: at 4096 tokens the three launches' gaps, ramps and tails are a large part of the time above the
HBM floor (session 9: forward 19.9 us, backward 29.0, partial-sum 2.8, graph 55.6, floor 39.0).
Session 9, H200: PDL saves 0.7-1.2 us per forward + backward (RMSNorm 4096: 0.0559 -> 0.0552 ms,
LayerNorm 4096: 0.0597 -> 0.0587, LayerNorm 8192: 0.1019 -> 0.1007); the partial-sum kernel then
shows ~31 us in the profile: it is resident early, waiting for the backward. (Several forward tiles
per program with the next load issued first: 0-1% slower, dropped.)

    python benchmark/diag_norm_launch.py [--tokens 4096 8192]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmark.common import _graphed, hbm_floor_ms, time_ms  # noqa: E402
from benchmark.diag_l2_flush import kernel_times, providers  # noqa: E402
from liger_losses.kernels import pdl  # noqa: E402

VARIANTS = {"base": False, "pdl": True}  # name: pdl.ENABLED


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    args = ap.parse_args()
    os.environ["BENCH_GRAPH"] = "1"
    H = 4096
    saved = pdl.ENABLED
    for kind in ("rms", "layer"):
        for N in args.tokens:
            floor = hbm_floor_ms(10 * N * H)
            for variant, on in VARIANTS.items():
                pdl.ENABLED = on
                fn = providers(kind, N, H)["ours"]
                fn()
                ms = time_ms(fn, warmup=10, rep=60)
                print(f"{kind} N={N} {variant:16s} {ms:.4f} ms  {ms / floor:.3f}x floor", flush=True)
                for key, us in kernel_times(_graphed(fn)):
                    print(f"    {us:8.2f} us  {key}")
                torch.cuda.synchronize()
    pdl.ENABLED = saved


if __name__ == "__main__":
    main()
