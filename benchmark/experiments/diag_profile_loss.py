"""Experiment (GPU): where a fused-linear loss's forward + backward spends GPU time, kernel by kernel,
and where the GPU idles -- ours beside TRL's fused LM head (or any provider of
``bench_preference.providers_for``; for ``--loss ce`` / ``distill`` only ``ours``: liger_losses'
cross-entropy / generalized JSD with a teacher head of the same shape).

Question: when a loss is slower than its GEMMs, is it the GEMMs, the tile kernels, or host waits?

Verdict (H200, H=4096, V=128256): the host waits. DPO's kernels took 36.1 ms of a 46.6 ms step because
the per-chunk pair permutation was built on the host and copied from pageable memory, which waits
for the stream to drain; built on the device: 42.4 ms (SimPO 35.7 -> 32.5, ORPO 40.5 -> 31.3, the
H=896 DPO 22.1 -> 14.5). Cross-entropy with a quarter of the tokens ignored: GPU idle per step 1.74 ->
1.42 ms with the backward's scale on the device, then 1.54 -> 0.60 ms with the first chunk issued
before the host sync (``engine.SPECULATIVE_FIRST_CHUNK``). DPO 1 x 16384: kernels 187.8 -> 168.4 ms
with the pair back-propagated in phase 1. After those, the GEMMs alone are at 1.03-1.08x the floor
and the divergence tile (7.6 ms of a 45 ms JSD step) was the next lever.

Status: a re-usable tool; run it before and after a change to the engine's host work
(``tests/chunked/test_host_syncs.py`` guards the sync count on the GPU).

Runs ``--steps`` full steps (loss + gradients of hidden and weight) under ``torch.profiler`` after a
warm-up and prints, per provider, the kernels ranked by total GPU time (per step) and the step's
total kernel time. ``--gaps`` also records the host and prints the GPU's largest idle gaps between
kernels with the host operations that overlapped them, and the CUDA runtime calls that synchronize
or allocate.

    python -m benchmark.experiments.diag_profile_loss [--loss dpo] [--shape small|big]
        [--providers ours trl_fused] [--gaps]
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from benchmark.bench_preference import BIG, SMALL, full_step, make_batch, providers_for


def kernel_table(prof, steps: int, top: int) -> tuple[list, float]:
    """[(name, calls per step, ms per step)] of the CUDA kernels, largest first, and their total."""
    rows: dict = {}
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = evt.name[:90]
        calls, us = rows.get(name, (0, 0.0))
        rows[name] = (calls + 1, us + evt.time_range.elapsed_us())
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])
    total = sum(us for _, us in rows.values()) / steps / 1000
    return [(n, c / steps, us / steps / 1000) for n, (c, us) in ranked[:top]], total


def idle_gaps(kernels: list, host_ops: list, *, min_us: float, top: int) -> tuple[float, list]:
    """Gaps of the GPU between kernels. ``kernels``: [(start_us, end_us, name)]; ``host_ops``:
    [(start_us, end_us, name)] of the host (aten ops and CUDA runtime calls, same clock).
    Returns (total idle us between the first kernel's start and the last one's end, the ``top``
    largest gaps >= ``min_us`` as (gap_us, next kernel, host ops overlapping the gap, most overlap
    first))."""
    kernels = sorted(kernels)
    gaps, idle, busy_until = [], 0.0, None
    for start, end, name in kernels:
        if busy_until is not None and start > busy_until:
            gap = start - busy_until
            idle += gap
            if gap >= min_us:
                gaps.append((gap, busy_until, start, name))
        busy_until = end if busy_until is None else max(busy_until, end)
    out = []
    for gap, g0, g1, name in sorted(gaps, reverse=True)[:top]:
        overlap: dict = {}
        for h0, h1, hname in host_ops:
            o = min(h1, g1) - max(h0, g0)
            if o > 0:
                overlap[hname] = overlap.get(hname, 0.0) + o
        ops = sorted(overlap.items(), key=lambda kv: -kv[1])[:4]
        out.append((gap, name, ops))
    return idle, out


def print_gaps(prof, steps: int) -> None:
    """What the host did while the GPU waited: the largest idle gaps and the host-side calls that
    synchronize or allocate (time per step)."""
    kernels, host = [], []
    api: dict = {}
    for evt in prof.events():
        t0, t1 = evt.time_range.start, evt.time_range.end
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((t0, t1, evt.name[:60]))
        elif evt.name.startswith(("aten::", "cuda", "liger", "autograd")) or "Backward" in evt.name:
            host.append((t0, t1, evt.name[:50]))
            if evt.name.startswith("cuda") and not evt.name.startswith("cudaLaunch"):
                n, us = api.get(evt.name, (0, 0.0))
                api[evt.name] = (n + 1, us + (t1 - t0))
    idle, gaps = idle_gaps(kernels, host, min_us=50.0, top=8)
    print(f"  GPU idle between kernels: {idle / steps / 1000:.2f} ms per step; largest gaps:")
    for gap, name, ops in gaps:
        where = ", ".join(f"{n} {us / 1000:.2f}" for n, us in ops)
        print(f"    {gap / 1000:7.3f} ms before {name} | host: {where}")
    print("  CUDA runtime calls other than launches (per step): " + ", ".join(
        f"{n} {c / steps:.0f}x {us / steps / 1000:.2f} ms"
        for n, (c, us) in sorted(api.items(), key=lambda kv: -kv[1][1])[:6]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loss", default="dpo", choices=("dpo", "simpo", "orpo", "ce", "distill"))
    ap.add_argument("--shape", default="small", choices=("small", "big"))
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--providers", nargs="+", default=["ours", "trl_fused"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--host-scale", action="store_true",
                    help="engine_config(device_scale=False): the backward reads the upstream scale on the host "
                         "(one sync) instead of scaling on the device (the default)")
    ap.add_argument("--gaps", action="store_true",
                    help="also record the host (CPU activity) and print the GPU's idle gaps and what the host did then")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_profile_loss: needs a CUDA GPU")
        return
    scope = contextlib.ExitStack()  # holds --host-scale's engine_config for the whole script
    if args.host_scale:
        from liger_losses.chunked.config import engine_config

        scope.enter_context(engine_config(device_scale=False))
    shape = SMALL if args.shape == "small" else BIG
    weight, hidden, ref_hidden, labels = make_batch(args.pairs, args.seq, **shape, ref=args.loss == "dpo")
    if args.loss in ("ce", "distill"):
        from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy
        from liger_losses.chunked.distillation import fused_linear_distillation_loss

        teacher_hidden = hidden.detach() + 0.1 * torch.randn_like(hidden)
        teacher_weight = weight.detach() + 0.01 * torch.randn_like(weight)
        provs = {
            "ours": (lambda: fused_linear_cross_entropy(weight, hidden, labels)) if args.loss == "ce" else
            (lambda: fused_linear_distillation_loss(weight, hidden, teacher_hidden, labels,
                                                    teacher_weight=teacher_weight).loss),
        }
    else:
        provs = providers_for(args.loss, weight, hidden, ref_hidden, labels)
    for name in args.providers:
        step = full_step(provs[name], weight, hidden)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CUDA]
        if args.gaps:
            activities.append(torch.profiler.ProfilerActivity.CPU)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        table, total = kernel_table(prof, args.steps, args.top)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            step()
        end.record()
        torch.cuda.synchronize()
        wall = start.elapsed_time(end) / args.steps
        print(f"== {name}: {args.loss} {2 * args.pairs}x{args.seq} {args.shape} "
              f"(H={shape['H']}, V={shape['V']}): kernels {total:.2f} ms per step, "
              f"stream time {wall:.2f} ms (the difference: GPU idle)")
        for kname, calls, ms in table:
            print(f"  {ms:8.3f} ms {calls:6.1f}x  {kname}")
        if args.gaps:
            print_gaps(prof, args.steps)


if __name__ == "__main__":
    main()
