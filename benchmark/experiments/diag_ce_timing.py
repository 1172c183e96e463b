"""Experiment (GPU): what the fused-linear cross-entropy's measured time is made of, against the GEMMs
it cannot avoid.

Question: the loss benchmarks put ours at ~1.19x the nominal FLOP floor (790 TFLOP/s); how much of
that is the loss's own work, and how fast do cuBLAS's GEMMs run by themselves under the same load?

Verdict (H200, 8192 tokens, H=4096, V=128256, bf16): sustained, the card sits at its 692 W software
power cap (throttle reason ``0x4``) with the SM clock at ~1450-1600 MHz instead of 1980. Ours 38.85 ms
(1.189x); our chunks' three GEMMs alone 38.84-39.96 ms (1.19-1.22x); the same GEMMs on all tokens at
once 37.91 ms (1.160x); ours under the profiler on a cool GPU (1906 MHz): kernels 36.57 ms (1.119x).
So the practical floor is the GEMMs alone timed in the same run, not 790 TFLOP/s (see also
``diag_gemm_power``), and at the cap only less work (bytes, FLOPs) shortens a step, not overlap.

Status: done. The ``gemms`` provider (``benchmark.common.gemms_only``) is in every loss benchmark.

At H=4096, V=128256, bf16 and ``--tokens`` valid tokens, times in one process:

- ``ours``: ``fused_linear_cross_entropy`` forward + gradients of hidden and weight;
- ``gemms``: the same three cuBLAS GEMMs per chunk as ours (logits, hidden gradient, weight
  gradient accumulated with ``beta=1`` after the first chunk), nothing else;
- ``gemms-whole``: the three GEMMs on all tokens at once (plain PyTorch's GEMMs);

each with ``do_bench`` at ``rep`` 100 ms (what the benchmarks use: ~3 samples of a 40 ms call) and
1000 ms, and a back-to-back loop of ``--loop`` calls timed by two events (no L2 flush). For ours it
then profiles ``--steps`` calls and prints the kernel time per call and the idle time between
kernels. ``nvidia-smi`` samples SM clock, power and throttle reasons every 100 ms in the
background (``$OUT/smi_ce_timing.csv``); the mean SM clock and power of each phase are printed.

    python -m benchmark.experiments.diag_ce_timing [--tokens 8192] [--loop 20] [--steps 3]
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmark.common import Smi, gemm_floor_ms, gemms_only

H, V = 4096, 128256


def ours_step(weight, hidden, labels):
    from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy

    def fn():
        loss = fused_linear_cross_entropy(weight, hidden, labels)
        return torch.autograd.grad(loss, (weight, hidden))

    return fn


def gemms_step(weight, hidden, chunk_tokens=None):
    """Our chunks' GEMMs alone (``common.gemms_only``), or in chunks of ``chunk_tokens``."""

    def fn():
        return torch.autograd.grad(gemms_only(weight, hidden, chunk_tokens=chunk_tokens), (weight, hidden))

    return fn


def loop_ms(fn, n):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--loop", type=int, default=20)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_ce_timing: needs a CUDA GPU")
        return
    import triton.testing

    from benchmark.experiments.diag_profile_loss import kernel_table, print_gaps

    n = args.tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    hidden = torch.randn(n, H, device="cuda", generator=g).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (n,), device="cuda", generator=g)
    floor = gemm_floor_ms(6 * n * H * V)
    print(f"CE {n} tokens, H={H}, V={V}: GEMM floor {floor:.2f} ms")
    smi = Smi(os.path.join(os.environ.get("OUT", "."), "smi_ce_timing.csv"))
    cases = {"ours": ours_step(weight, hidden, labels), "gemms": gemms_step(weight, hidden),
             "gemms-whole": gemms_step(weight, hidden, n)}
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        smi.mark(name)
        t100 = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        t1000 = triton.testing.do_bench(fn, warmup=25, rep=1000, return_mode="median")
        tl = loop_ms(fn, args.loop)
        print(f"{name:12s} do_bench rep100 {t100:7.2f} ms ({t100 / floor:.3f}x)  rep1000 {t1000:7.2f} "
              f"({t1000 / floor:.3f}x)  loop {tl:7.2f} ({tl / floor:.3f}x)", flush=True)
    smi.mark("profile")
    fn = cases["ours"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            fn()
        torch.cuda.synchronize()
    table, total = kernel_table(prof, args.steps, 10)
    print(f"ours profiled: kernels {total:.2f} ms per call ({total / floor:.3f}x)")
    for name, calls, ms in table:
        print(f"  {ms:8.3f} ms {calls:5.1f}x  {name}")
    print_gaps(prof, args.steps)
    smi.summary()


if __name__ == "__main__":
    main()
