"""Diagnostic (GPU): RMSNorm backward at a trainer's shape, ours across the backward knobs beside
liger-kernel 0.8.5, as CUDA-graph GPU time with the L2 cleared before each replay.

Why: in the session-5 trainer profile (Llama-3.2-1B shape, SFT, batch 8 x 2048: 16384 x 2048 bf16)
our backward kernel took 0.168 ms per call against liger-kernel's 0.139, ~3.5x the HBM floor for
both. Backward time = (forward + backward) - forward, each captured in a CUDA graph and timed by
``triton.testing.do_bench`` (which clears the L2 between replays: cold inputs, as in a trainer).
The session-5 run of this script timed eager ``autograd.grad`` calls instead: 0.13-0.5 ms for
kernels of ~0.05 ms, i.e. host-bound and void (logged in benchmark/NOTES.md).

    python benchmark/diag_norm_backward.py [--shape 16384x2048 4096x4096]

Prints, per shape: backward ms and its ratio to the HBM floor (read x and dy, write dx: 6NH bytes)
for liger and ours at each (programs per SM, tile elements, prefetch) setting, with the relative
difference of our gradients to the default setting's.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmark.common import hbm_floor_ms, time_ms  # noqa: E402
from liger_losses.kernels import rms_norm as rms_mod  # noqa: E402


def backward_ms(module, x, dy, ref=None):
    """(backward ms, grads, error vs ``ref``): error = max relative difference of dx and dw to
    ``ref``'s. GPU time of graph replays, L2 cleared before each: full minus forward."""
    params = [p for p in module.parameters() if p.requires_grad]

    def forward():
        return module(x)

    def full():
        return torch.autograd.grad(module(x), [x, *params], dy)

    grads = full()
    err = 0.0
    if ref is not None:
        err = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(grads, ref))
    os.environ["BENCH_GRAPH"] = "1"
    ms = time_ms(full, warmup=10, rep=50) - time_ms(forward, warmup=10, rep=50)
    return ms, grads, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", nargs="+", default=["16384x2048", "4096x4096"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_norm_backward: needs a CUDA GPU")
        return
    knobs = ("BWD_PROGRAMS_PER_SM", "BWD_TILE_ELEMS", "BWD_PREFETCH", "BWD_MIN_ROWS_PER_PROGRAM")
    defaults = {k: getattr(rms_mod, k) for k in knobs}
    print("defaults:", defaults)
    for shape in args.shape:
        N, H = (int(v) for v in shape.split("x"))
        x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
        dy = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
        floor = hbm_floor_ms(6 * N * H)
        try:
            from liger_kernel.transformers.rms_norm import LigerRMSNorm as TheirRMSNorm

            ms = backward_ms(TheirRMSNorm(H, eps=1e-6).cuda().to(torch.bfloat16), x, dy)[0]
            print(f"{shape} liger-kernel: {ms:.4f} ms ({ms / floor:.2f}x floor {floor:.4f})", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"{shape} liger-kernel: {type(exc).__name__}: {exc}")
        ours = rms_mod.LigerRMSNorm(H, eps=1e-6).cuda().to(torch.bfloat16)
        ms, ref, _ = backward_ms(ours, x, dy)
        print(f"{shape} ours (defaults): {ms:.4f} ms ({ms / floor:.2f}x)", flush=True)
        for pps, tile, prefetch in itertools.product((1, 2, 4), (4096, 8192, 16384), (True, False)):
            rms_mod.BWD_PROGRAMS_PER_SM, rms_mod.BWD_TILE_ELEMS, rms_mod.BWD_PREFETCH = pps, tile, prefetch
            try:
                ms, _, err = backward_ms(ours, x, dy, ref)
                print(f"{shape} ours pps={pps} tile={tile} prefetch={int(prefetch)}: {ms:.4f} ms "
                      f"({ms / floor:.2f}x) grads vs defaults {err:.1e}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"{shape} ours pps={pps} tile={tile} prefetch={int(prefetch)}: {type(exc).__name__}: {exc}")
            finally:
                for k, v in defaults.items():
                    setattr(rms_mod, k, v)


if __name__ == "__main__":
    main()
