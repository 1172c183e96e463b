"""Experiment (GPU): how the L2 state left by ``do_bench``'s cache flush moves the norms' times.

Question: ``triton.testing.do_bench`` clears the L2 before each timed call with ``cache.zero_()`` on a
256 MB buffer. That leaves the L2 (50 MB on the H200) full of *dirty* lines, so the first ~50 MB
that the timed kernels touch also pay a write-back of the flush buffer. At 4096 x 4096 bf16 the
norms move 168 MB, so up to ~30% extra traffic falls on the timed call; at 32768 tokens ~4%. Is that
why the norms (and the ``copy`` reference) sit higher above the HBM floor at 4096 tokens than at 32768?

Verdict (H200, fwd + bwd, H=4096): partly, ~4-5 us of a 39 us floor. 4096 tokens, ``zero`` ->
``clean``: RMSNorm 1.424x -> 1.309x, LayerNorm 1.507x -> 1.400x, ``copy`` 1.237x -> 1.150x; at 32768
tokens RMSNorm 1.121x -> 1.103x. Per kernel (``--profile``, RMSNorm 4096 x 4096): forward 19.9 us
(PyTorch's copy of the same bytes 18.1), backward 29.0 (PyTorch's add, read two write one, 26.5),
partial sum of the weight gradient 2.8, graph 55.8. With kernels at the copies' speed and no third
launch a norm would be ~1.26x: the 1.3x bar at 4096 tokens leaves ~2 us for the row reductions.

Status: done. The official numbers keep do_bench's flush; ``BENCH_FLUSH`` (``benchmark.common.flush_mode``)
gives any benchmark the other states. ``kernel_times`` here is used by ``diag_norm_launch`` and ``diag_rope``.

Times, as CUDA-graph replays (GPU time alone), forward + backward of RMSNorm / LayerNorm at
H = 4096 bf16 for ours, liger-kernel (when importable) and the ``copy`` reference of
``bench_norm.py``, under three L2 states before each timed call:

* ``zero``: do_bench's own flush (``cache.zero_()``): no input in L2, L2 full of dirty lines;
* ``clean``: ``cache.zero_()`` then a read of the whole buffer (``cache.sum()``): no input in L2,
  L2 full of clean lines (the flush's write-back happens outside the timed call);
* ``none``: no flush (back-to-back calls; the working set, >= 128 MiB, exceeds the L2);

and with ``--profile``, each kernel's mean GPU time within the graph (torch.profiler, ``zero``).

    python -m benchmark.experiments.diag_l2_flush [--tokens 4096 8192 16384 32768] [--kind rms layer] [--profile]
"""

from __future__ import annotations

import argparse

import torch

from benchmark.bench_norm import copy_fns
from benchmark.common import FLUSHES, graphed, hbm_floor_ms, l2_state
from benchmark.experiments.diag_norm_backward import make_modules


def graph_ms(replay, mode: str) -> float:
    import triton.testing

    with l2_state(mode):
        return float(triton.testing.do_bench(replay, warmup=10, rep=60, return_mode="median"))


def kernel_times(replay, n: int = 30) -> list[tuple[str, float]]:
    """Mean GPU µs per kernel of one replay (do_bench-style zero flush before each)."""
    from torch.profiler import ProfilerActivity, profile

    cache = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            cache.zero_()
            replay()
        torch.cuda.synchronize()
    out = []
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA and "fill" not in evt.key.lower():
            total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
            out.append((evt.key[:60], total / n))
    return sorted(out, key=lambda kv: -kv[1])


def providers(kind: str, N: int, H: int):
    mod, ours, theirs = make_modules(kind, H)
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    fns = {}

    def full_of(module):
        params = [p for p in module.parameters() if p.requires_grad]
        return lambda: torch.autograd.grad(module(x), [x, *params], dy)

    fns["ours"] = full_of(ours)
    if kind == "rms":
        inplace = mod.LigerRMSNorm(H, eps=1e-6, inplace_backward=True).cuda().to(torch.bfloat16)
        dy2 = dy.clone()

        def inplace_full():
            out = inplace(x)
            return torch.autograd.grad(out, [x, inplace.weight], dy2)

        fns["ours_inplace"] = inplace_full
    if not isinstance(theirs, str):
        fns["liger"] = full_of(theirs)
    fns["copy"] = copy_fns(x, dy)["full"]
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--kind", nargs="+", default=["rms", "layer"], choices=("rms", "layer"))
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    H = args.hidden
    print("kind,tokens,provider," + ",".join(f"{m}_ms,{m}_x_floor" for m in FLUSHES))
    for kind in args.kind:
        for N in args.tokens:
            floor = hbm_floor_ms(10 * N * H)
            for name, fn in providers(kind, N, H).items():
                try:
                    replay = graphed(fn)
                except Exception:  # noqa: BLE001 - first captures of a process may fail once
                    torch.cuda.synchronize()
                    replay = graphed(fn)
                times = [graph_ms(replay, m) for m in FLUSHES]
                cells = ",".join(f"{t:.4f},{t / floor:.3f}" for t in times)
                print(f"{kind},{N},{name},{cells}", flush=True)
                if args.profile and N <= 8192:
                    for key, us in kernel_times(replay):
                        print(f"    {us:8.2f} us  {key}")
                del replay
                torch.cuda.synchronize()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
