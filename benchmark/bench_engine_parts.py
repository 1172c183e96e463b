"""Where the chunked cross-entropy spends its time: each stage of one chunk timed alone.

For one chunk of ``n`` tokens at H=4096, V=128256 (bf16) this times the logits GEMM
(``hidden @ W.T``), the logits-tile kernel (statistics + gradient in place), the grad-hidden GEMM
(``G @ W``), the grad-weight GEMM accumulated into a bf16 ``[V, H]`` buffer (``W_grad += G.T @ h``)
and, for comparison, the same GEMM without accumulation. Floors: FLOPs / 790 TFLOP/s for GEMMs,
bytes / 4.3 TB/s for the tile kernel (read the tile twice, write it once).

    python -m benchmark.bench_engine_parts [--quick]
"""

from __future__ import annotations

import argparse

import torch

from benchmark.common import Row, gemm_floor_ms, hbm_floor_ms, time_ms, write_results


def chunk_rows(n: int, w: torch.Tensor, gw: torch.Tensor) -> list[Row]:
    """Time each stage of one chunk of ``n`` tokens against the weight ``w`` [V, H] and the
    grad-weight buffer ``gw`` [V, H]; the chunk's tensors are freed when this returns."""
    from liger_losses.kernels.logits_tile import logits_tile

    V, H = w.shape
    dev, dt = w.device, w.dtype
    rows = []
    h = torch.randn(n, H, device=dev, dtype=dt)
    y = torch.randint(0, V, (n,), device=dev)
    tile = h @ w.t()
    gh = torch.empty(n, H, device=dev, dtype=dt)
    base = tile.clone()

    def tile_kernel():
        tile.copy_(base)  # timed separately below and subtracted
        logits_tile(tile, y, mode="ce", grad=True, grad_scale=1.0 / n)

    def copy_only():
        tile.copy_(base)

    gemm = 2.0 * n * H * V
    stages = {
        "logits_gemm": (lambda: torch.mm(h, w.t(), out=tile), gemm_floor_ms(gemm)),
        "grad_hidden_gemm": (lambda: torch.mm(tile, w, out=gh), gemm_floor_ms(gemm)),
        "grad_weight_gemm_accum": (lambda: gw.addmm_(tile.t(), h), gemm_floor_ms(gemm)),
        "grad_weight_gemm_fresh": (lambda: torch.mm(tile.t(), h, out=gw), gemm_floor_ms(gemm)),
    }
    for name, (fn, floor) in stages.items():
        ms = time_ms(fn)
        rows.append(Row("engine_parts", f"n={n}", name, "ours", ms, float("nan"), floor_ms=floor,
                        extra={"tokens": n, "tflops": round(gemm / ms / 1e9, 1)}))
    ms_copy = time_ms(copy_only)
    ms_tile = time_ms(tile_kernel) - ms_copy
    rows.append(Row("engine_parts", f"n={n}", "tile_kernel", "ours", ms_tile, float("nan"),
                    floor_ms=hbm_floor_ms(3 * n * V * 2), extra={"tokens": n}))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()

    H, V = 4096, 128256
    dev, dt = "cuda", torch.bfloat16
    w = torch.randn(V, H, device=dev, dtype=dt) * 0.02
    gw = torch.zeros(V, H, device=dev, dtype=dt)
    rows = []
    for n in ([1024, 2048] if args.quick else [512, 1024, 2048, 4096]):
        rows += chunk_rows(n, w, gw)
        torch.cuda.empty_cache()
    write_results("engine_parts", rows)

if __name__ == "__main__":
    main()
