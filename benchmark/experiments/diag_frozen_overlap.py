"""Experiment (GPU): the frozen head's block kernel beside the next block's logits GEMM.

Question: the frozen-head path (``chunked/frozen_head.py``) issues per vocabulary block a logits
GEMM ``L_b``, the block kernel ``K_b`` and the accumulating GEMM ``A_b`` on one stream, so the block
kernel (1.8 ms a call at 8192 x 4096 x 128256) and the gaps between ~430 dependent launches add to
the GEMMs' time. With two block buffers (``EngineConfig.frozen_overlap``) the GEMMs run
``L0 L1 A0 L2 A1 ...`` and each ``K_b`` on a side stream beside ``L_{b+1}``. Does that bring the
call to the tile path's time at the online path's memory, and at which chunk and block sizes?

Prints per configuration the median over alternating rounds of ``do_bench`` (ms) and the peak
above the inputs (MiB), beside the tile path and the GEMMs alone; whether the overlapped call is
bitwise the one-buffer call at the same chunks; the idle gaps of one call per path.

    python -m benchmark.experiments.diag_frozen_overlap [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmark.experiments.diag_frozen_head import _idle_report, frozen_case

MIB = 2**20
N, H, V = 8192, 4096, 128256
CONFIGS = {  # name -> engine_config changes (None: the tile path)
    "shipped (1 buffer, 24 MiB, 16384 cols)": {},
    "overlap 24 MiB, 16384 cols": dict(frozen_overlap=True),
    "overlap 24 MiB, 8192 cols": dict(frozen_overlap=True, frozen_block_columns=8192),
    "1 buffer at the same chunks (8192 cols, 512 rows)": dict(frozen_block_columns=8192,
                                                              frozen_budget_bytes=512 * (8016 * 2 + H * 4)),
    "overlap 28 MiB, 12288 cols": dict(frozen_overlap=True, frozen_budget_bytes=28 * MIB,
                                       frozen_block_columns=12288),
    "overlap 30 MiB, 8192 cols": dict(frozen_overlap=True, frozen_budget_bytes=30 * MIB, frozen_block_columns=8192),
    "tile path": dict(frozen_head_online=False),
}


def main():
    import triton.testing

    from benchmark.common import gemms_only
    from liger_losses.chunked.config import engine_config
    from liger_losses.chunked.frozen_head import online_token_chunks, vocab_blocks

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    w, h, y, step = frozen_case(N, H, V)

    def measure():
        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = (torch.cuda.max_memory_allocated() - base) / MIB
        return triton.testing.do_bench(step, warmup=10, rep=150), peak

    for name, cfg in CONFIGS.items():
        with engine_config(**cfg):
            chunks, blocks = online_token_chunks(V, H, 2, N), vocab_blocks(V)
        print(f"{name}: {len(chunks)} chunks of <= {max(e - s for s, e in chunks)} rows, {len(blocks)} blocks of "
              f"<= {max(e - s for s, e in blocks)} cols", flush=True)
    with engine_config(frozen_overlap=True, frozen_block_columns=8192):
        g_overlap = step().clone()
    with engine_config(**CONFIGS["1 buffer at the same chunks (8192 cols, 512 rows)"]):
        g_plain = step().clone()
    print(f"overlap bitwise the one-buffer call at the same chunks: {torch.equal(g_overlap, g_plain)}", flush=True)

    times = {name: [] for name in [*CONFIGS, "gemms"]}
    peaks = {}
    for r in range(args.rounds):
        for name, cfg in CONFIGS.items():
            with engine_config(**cfg):
                ms, peak = measure()
            times[name].append(ms)
            peaks[name] = peak
        times["gemms"].append(triton.testing.do_bench(lambda: gemms_only(w, h), warmup=10, rep=150))
        print(f"round {r}: " + ", ".join(f"{k.split(' (')[0]} {v[-1]:.2f}" for k, v in times.items()), flush=True)
    gemm = statistics.median(times["gemms"])
    print(f"\nmedian over {args.rounds} rounds (min-max), peak above the inputs; GEMMs alone {gemm:.2f} ms")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:55s} {med:7.2f} ms ({min(ts):.2f}-{max(ts):.2f})  {med / gemm:.3f}x GEMMs  "
              f"{peaks.get(name, float('nan')):6.1f} MiB", flush=True)
    for label, cfg in (("shipped", {}), ("overlap 24 MiB 8192 cols", CONFIGS["overlap 24 MiB, 8192 cols"])):
        with engine_config(**cfg):
            _idle_report(step, label=label, top=4)


if __name__ == "__main__":
    main()
