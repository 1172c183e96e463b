"""Host time per Triton kernel launch: the plain ``JITFunction`` launch vs ``fast_kernel``.

Two kernels on tiny CUDA tensors (GPU work ~nothing, so wall time / launches = host time):
``toy`` (y = x * a + b: 2 tensors, 2 floats, 1 int, 2 constexprs) and ``args14`` (6 tensors,
6 ints, 2 floats, 2 constexprs). Per provider: ``n`` back-to-back launches timed with
``time.perf_counter`` after a warm-up, one ``synchronize`` at the end; median of ``--repeats``.

Providers: ``jit`` (``kernel[grid](...)``, the slow path), ``fast`` (``fast_kernel(kernel)[grid]
(...)``), ``launcher`` (the compiled kernel's launcher called directly with prepared arguments:
the floor the fast path can approach). Correctness: the outputs of ``jit`` and ``fast`` launches
must be equal bit for bit (exits non-zero otherwise).

Columns: ``us_per_launch``; ``ms`` holds the same in milliseconds. CSV: ``launch.csv``.

Usage (GPU): python -m benchmark.bench_launch [--n 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

from benchmark.common import Row, write_results
from liger_losses.kernels.launch import fast_kernel, launch_stats


@triton.jit
def _toy_kernel(x_ptr, y_ptr, a, b, n, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SQUARE:
        x = x * x
    tl.store(y_ptr + offs, (x * a + b).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _args14_kernel(p0, p1, p2, p3, p4, out_ptr, n, s0, s1, s2, s3, s4, alpha, beta,
                   BLOCK: tl.constexpr, MODE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.load(p0 + offs * s0, mask=mask, other=0.0).to(tl.float32)
    acc += tl.load(p1 + offs * s1, mask=mask, other=0.0).to(tl.float32)
    acc += tl.load(p2 + offs * s2, mask=mask, other=0.0).to(tl.float32)
    acc += tl.load(p3 + offs * s3, mask=mask, other=0.0).to(tl.float32)
    acc += tl.load(p4 + offs * s4, mask=mask, other=0.0).to(tl.float32)
    if MODE == 1:
        acc = acc * alpha
    tl.store(out_ptr + offs, (acc + beta).to(out_ptr.dtype.element_ty), mask=mask)


def _cases():
    """(name, jit kernel, grid, args, kwargs, output tensor)"""
    x = torch.randn(1024, device="cuda")
    y = torch.empty_like(x)
    toy = ("toy", _toy_kernel, (4,), (x, y, 1.5, 0.25, 1024),
           dict(BLOCK=256, SQUARE=False, num_warps=4), y)
    ps = [torch.randn(1024, device="cuda", dtype=torch.bfloat16) for _ in range(5)]
    out = torch.empty(1024, device="cuda", dtype=torch.bfloat16)
    args14 = ("args14", _args14_kernel, (4,), (*ps, out, 1024, 1, 1, 1, 1, 1, 0.5, 2.0),
              dict(BLOCK=256, MODE=1, num_warps=4), out)
    return [toy, args14]


def _time_us(launch, n: int, repeats: int) -> float:
    for _ in range(50):
        launch()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            launch()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


def _launcher_floor(kernel, grid, args, kwargs):
    """A closure calling the compiled launcher directly with prepared arguments (no key, no
    lookup): what JITFunction.run ends with, minus everything before it."""
    compiled = kernel[grid](*args, **kwargs)
    params = kernel.params
    tail = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in params[len(args):])
    full = (*args, *tail)
    from triton.runtime import driver

    dev = driver.active.get_current_device()
    stream = driver.active.get_current_stream(dev)
    run, fn, packed = compiled.run, compiled.function, compiled.packed_metadata
    g = tuple(grid) + (1, 1)

    def launch():
        run(g[0], g[1], g[2], stream, fn, packed, None, None, None, *full)

    return launch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_launch needs a CUDA GPU")
        return 0
    print(f"triton {triton.__version__}, torch {torch.__version__}, python {sys.version.split()[0]}")
    rows, ok = [], True
    for name, kernel, grid, args, kwargs, out in _cases():
        fast = fast_kernel(kernel)
        kernel[grid](*args, **kwargs)
        ref = out.clone()
        out.fill_(float("nan"))
        for _ in range(3):
            fast[grid](*args, **kwargs)
        torch.cuda.synchronize()
        same = torch.equal(out, ref)
        ok &= same
        providers = {
            "jit": lambda: kernel[grid](*args, **kwargs),
            "fast": lambda: fast[grid](*args, **kwargs),
            "launcher": _launcher_floor(kernel, grid, args, kwargs),
        }
        for prov, fn in providers.items():
            us = _time_us(fn, opts.n, opts.repeats)
            rows.append(Row(bench="launch", case=name, mode="host", provider=prov, ms=us / 1e3,
                            peak_mib=float("nan"),
                            extra=dict(us_per_launch=round(us, 2), equal_to_jit=same,
                                       fast_state=repr(fast))))
        print(f"{name}: equal to jit launch: {same}; {fast!r}")
    write_results("launch", rows)
    print("launch_stats:", launch_stats())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
