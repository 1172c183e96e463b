"""Experiment (GPU): the frozen-head cross-entropy's chunk and block sizes, and where its time goes.

Question: the online-softmax path (``chunked/frozen_head.py``) holds the peak near the hidden
gradient, but at 8192 x 4096 x 128256 it ran 28.7 ms against the tile path's 26.3 (GEMMs alone
25.0). Which of token chunk (``frozen_budget_bytes``), vocabulary block (``frozen_block_columns``)
and the block kernel's launch (``online_block`` knobs) decide that, and is the rest host time?

Prints, per configuration, ``do_bench`` median ms and the peak above the inputs (MiB); the GPU time
of one call by kernel (profiler) against its wall time; and the block loop of one chunk run eagerly
against the same loop replayed from a CUDA graph (the host's share of the loop), at the default
chunk and at a small one.

Status: open (sizes the defaults in ``chunked/config.py``).

    python -m benchmark.experiments.diag_frozen_head
"""

from __future__ import annotations

import time

import torch

MIB = 2**20
CONFIGS = [  # (frozen_budget_bytes MiB, frozen_block_columns, online_block knobs)
    (24, 16384, {"num_warps": 4}),
    (24, 16384, {"num_warps": 8}),
    (24, 16384, {"num_warps": 8, "block_cap": 4096}),
    (32, 16384, {"num_warps": 4}),
    (32, 16384, {"num_warps": 8}),
    (24, 8192, {"num_warps": 8}),
]


def block_loop_probe(w, h, y, n, cols):
    """ms of one chunk's block loop (``n`` rows, ``cols``-column blocks): eager vs a CUDA graph."""
    import triton.testing

    from benchmark.common import graphed
    from liger_losses.chunked.gemm import mm_into
    from liger_losses.kernels.online_block import OnlineState, online_block

    V, H = w.shape
    blocks = [(v0, w[v0:min(v0 + cols, V)]) for v0 in range(0, V, cols)]
    hs, ys = h[:n].detach().clone(), y[:n].clone()
    buf = torch.empty(n * cols, dtype=w.dtype, device=w.device)
    acc = torch.empty(n, H, dtype=torch.float32, device=w.device)
    state = OnlineState.empty(n, w.device)

    def loop():
        state.ref.fill_(float("-inf"))
        state.zmax.fill_(float("-inf"))
        for b, (v0, wb) in enumerate(blocks):
            tile = buf[: n * wb.shape[0]].view(n, wb.shape[0])
            torch.mm(hs, wb.t(), out=tile)
            online_block(tile, ys, v0, state, acc, first=b == 0)
            mm_into(acc, tile, wb, accumulate=b > 0)

    eager = triton.testing.do_bench(loop, warmup=10, rep=100)
    replay = triton.testing.do_bench(graphed(loop), warmup=10, rep=100)
    return eager, replay, len(blocks)


def _idle_report(step, label="default", top=8):
    """Where the GPU idles within one call: the gaps between consecutive kernels (profiler trace
    of one call after a warm one), their sum, and the largest with the kernels around them."""
    step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    if not kernels:
        print(f"{label}: no kernel events")
        return
    gaps, end = [], kernels[0][1]
    for i in range(1, len(kernels)):
        start = kernels[i][0]
        if start > end:
            gaps.append((start - end, kernels[i - 1][2][:40], kernels[i][2][:40]))
        end = max(end, kernels[i][1])
    span = (end - kernels[0][0]) / 1000
    idle = sum(g for g, _, _ in gaps) / 1000
    print(f"{label}: {len(kernels)} kernels over {span:.2f} ms, idle {idle:.2f} ms in {len(gaps)} gaps; largest:")
    for g, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {g:8.1f} us  after {before!r}  before {after!r}")


def frozen_case(N, H, V):
    """The benchmark's frozen-head case on CUDA: ``w [V, H]`` (``0.02 * randn``), ``h [N, H]``
    (``randn``, requiring grad) bf16, labels ``y [N]``, and ``step()``: the loss and its hidden
    gradient."""
    from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy

    w = (torch.randn(V, H, device="cuda") * 0.02).bfloat16()
    h = torch.randn(N, H, device="cuda").bfloat16().requires_grad_()
    y = torch.randint(0, V, (N,), device="cuda")

    def step():
        (g,) = torch.autograd.grad(fused_linear_cross_entropy(w, h, y), h)
        return g

    return w, h, y, step


def main():
    import triton.testing

    from liger_losses.chunked.config import engine_config
    from liger_losses.chunked.frozen_head import online_token_chunks
    from liger_losses.kernels.tuning import tuning

    torch.manual_seed(0)
    N, H, V = 8192, 4096, 128256
    w, h, y, step = frozen_case(N, H, V)

    def measure():
        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = (torch.cuda.max_memory_allocated() - base) / MIB
        return triton.testing.do_bench(step, warmup=10, rep=200), peak

    with engine_config(frozen_head_online=False):
        ms, peak = measure()
    print(f"tile path: {ms:.2f} ms, peak {peak:.0f} MiB", flush=True)
    for budget, cols, knobs in CONFIGS:
        with engine_config(frozen_budget_bytes=budget * MIB, frozen_block_columns=cols), tuning(online_block=knobs):
            ms, peak = measure()
            n = online_token_chunks(V, H, 2, N)[0][1]
        print(f"budget {budget} MiB, block {cols} cols, {n}-token chunks, {knobs}: {ms:.2f} ms, peak {peak:.0f} MiB",
              flush=True)

    for label, cfg in (("default", {}), ("no early first chunk", {"speculative_first_chunk": False})):
        with engine_config(**cfg):
            ms, peak = measure()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()  # the host returns once every launch is issued (its one wait: the labels' scan)
            issued = (time.perf_counter() - t0) * 1000
            torch.cuda.synchronize()
        print(f"{label}: {ms:.2f} ms, peak {peak:.0f} MiB, host {issued:.2f} ms to issue one call", flush=True)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 3 / 1000
    print(f"default: GPU busy {busy:.2f} ms per call (kernels' self time, 3 calls)")
    print(events.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
    _idle_report(step)
    with engine_config(frozen_head_online=False):
        _idle_report(step, label="tile path")

    n_default = online_token_chunks(V, H, 2, N)[0][1]
    for n in (n_default, 128):
        eager, replay, nb = block_loop_probe(w, h, y, n, 16384)
        print(f"block loop, {n} rows x {nb} blocks of 16384: eager {eager:.3f} ms, CUDA graph {replay:.3f} ms "
              f"({(eager - replay) / nb * 1000:.1f} us host per block beyond the GPU's)", flush=True)


if __name__ == "__main__":
    main()
