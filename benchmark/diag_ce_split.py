"""Diagnostic (GPU): the split logits tile (``kernels/logits_tile_split.py``, one read per logit)
against the one-program-per-row tile (two reads) and liger-kernel's cross-entropy.

1. Sweep: the tile alone on ``[N, V]`` bf16 logits (statistics + gradient into a separate buffer),
   over (SEG, WARPS) of the split kernel and the row kernel (SEG = 0), alternating the
   configurations over ``--rounds`` rounds (``do_bench`` medians, ms), each checked against the
   row kernel (max |gradient difference|, loss relative error).
2. ``cross_entropy`` forward + backward at the same shape: ours (split default / row kernel) vs
   liger-kernel's ``LigerCrossEntropyLoss``.

Floor: one read of the logits and one write of the gradient, ``2 * N * V * 2`` bytes at 4.3 TB/s.

    python benchmark/diag_ce_split.py [--n 8192] [--vocab 128256 32000 151936] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmark.common import hbm_floor_ms  # noqa: E402

# (SEG, WARPS, OCCUPANCY); SEG 0: the one-program-per-row kernel
CONFIGS = [(0, None, 1.0), (4096, 4, 1.0), (2048, 2, 1.0), (2048, 4, 1.0), (4096, 8, 1.0), (8192, 8, 1.0),
           (8192, 16, 1.0), (16384, 16, 1.0), (1024, 1, 1.0), (1024, 2, 1.0), (2048, 1, 1.0)]


def _set(seg, warps, occupancy=1.0):
    from liger_losses.kernels import logits_tile_split as ls

    ls.SEG = seg
    if warps:
        ls.WARPS = warps
    ls.OCCUPANCY = occupancy


def sweep(N, V, rounds, configs):
    import triton

    from liger_losses.kernels import logits_tile_split as ls
    from liger_losses.kernels.logits_tile import logits_tile

    defaults = ls.SEG, ls.WARPS, ls.OCCUPANCY
    x = torch.randn(N, V, device="cuda", dtype=torch.bfloat16) * 2
    y = torch.randint(0, V, (N,), device="cuda")
    y[::10] = -100
    g = torch.empty_like(x)
    g_ref = torch.empty_like(x)
    _set(0, None)
    ref = logits_tile(x, y, grad_scale=1.0 / N, out=g_ref, need_logits_sum=False)
    times = {c: [] for c in configs}
    for _ in range(rounds):
        for c in configs:
            _set(*c)
            fn = lambda: logits_tile(x, y, grad_scale=1.0 / N, out=g, need_logits_sum=False)  # noqa: E731
            times[c].append(triton.testing.do_bench(fn, warmup=10, rep=100))
    floor = hbm_floor_ms(2 * N * V * 2)
    print(f"--- tile alone, N={N} V={V}, floor {floor:.4f} ms")
    for c in configs:
        _set(*c)
        g.fill_(float("nan"))
        st = logits_tile(x, y, grad_scale=1.0 / N, out=g, need_logits_sum=False)
        torch.cuda.synchronize()
        gerr = (g.float() - g_ref.float()).abs().max().item()
        lerr = ((st.loss - ref.loss).norm() / ref.loss.norm()).item()
        ms = sorted(times[c])[len(times[c]) // 2]
        name = "row kernel" if c[0] == 0 else f"split {c[0]}/{c[1]} occupancy {c[2]}"
        print(f"{name:28s} {ms:.4f} ms  {ms / floor:.3f}x floor  rounds {[round(t, 4) for t in times[c]]}"
              f"  max|dg| {gerr:.2e}  loss rel {lerr:.1e}", flush=True)
    ls.SEG, ls.WARPS, ls.OCCUPANCY = defaults
    del x, g, g_ref


def full(N, V, profile=False):
    import triton

    from liger_losses.kernels import logits_tile_split as ls
    from liger_losses.kernels.cross_entropy import cross_entropy

    base = torch.randn(N, V, device="cuda", dtype=torch.bfloat16) * 2
    y = torch.randint(0, V, (N,), device="cuda")
    y[::10] = -100
    floor = hbm_floor_ms(2 * N * V * 2)
    providers = {"ours (split)": (lambda a, b: cross_entropy(a, b), ls.SEG),
                 "ours (row kernel)": (lambda a, b: cross_entropy(a, b), 0)}
    try:
        from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss

        providers["liger-kernel"] = (LigerCrossEntropyLoss(), ls.SEG)
    except Exception as exc:  # noqa: BLE001
        print(f"(liger-kernel unavailable: {exc})")
    default = ls.SEG
    print(f"--- cross_entropy forward + backward, N={N} V={V}, floor {floor:.4f} ms")
    for name, (fn, seg) in providers.items():
        ls.SEG = seg

        def step(fn=fn):
            leaf = base.detach().requires_grad_()
            return torch.autograd.grad(fn(leaf, y), (leaf,))

        ms = triton.testing.do_bench(step, warmup=10, rep=200)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        print(f"{name:20s} {ms:.4f} ms  {ms / floor:.3f}x floor  peak {peak:.0f} MiB", flush=True)
        if profile:
            from benchmark.diag_profile_loss import kernel_table

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                step()
            end.record()
            torch.cuda.synchronize()
            table, total = kernel_table(prof, 3, 8)
            print(f"    back-to-back {start.elapsed_time(end) / 10:.4f} ms per step; kernels {total:.4f} ms per step:")
            for kname, calls, kms in table:
                print(f"      {kms:8.4f} ms  x{calls:<3} {kname}")
    ls.SEG = default


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--vocab", type=int, nargs="+", default=[128256])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--profile", action="store_true", help="kernel table of each full step")
    args = ap.parse_args()
    for V in args.vocab:
        if not args.no_sweep:
            sweep(args.n, V, args.rounds, CONFIGS if V == args.vocab[0] else CONFIGS[:2])
        full(args.n, V, args.profile)


if __name__ == "__main__":
    main()
