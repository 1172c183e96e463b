"""Diagnostic (GPU): time and peak memory of our fused-linear losses against the engine's default
tile budget (``engine.DEFAULT_BUDGET_BYTES``, which sets the tokens per chunk), at #3's shapes
(H=4096, V=128256, bf16).

Why: with 1024-token chunks the weight-gradient GEMM (``[V, n]^T @ [n, H]`` accumulated into the
``[V, H]`` buffer) has an inner dimension of 1024 and ran at 1.18x its FLOP floor on the H200 while
the logits GEMM ran at 1.03x (session-5 profile); larger chunks lengthen its main loop and halve
the accumulations, at ``n x V x 2`` bytes more memory per 1024 tokens (250 MiB here). #3's memory
bar is 1.5x the gradients (1066 MiB for cross-entropy at 8192 tokens).

    python benchmark/diag_chunk_budget.py [--budgets-mib 256 384 512] [--cases ce dpo distill dpo16k]

Prints one line per (case, budget): ms (do_bench median of forward + gradients), peak MiB above
the inputs, time/floor and peak/floor.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmark.bench_preference import BIG, full_step, make_batch  # noqa: E402
from benchmark.common import MIB, gemm_floor_ms, measure  # noqa: E402


def case_fn(name: str):
    """(step callable, floor_ms, floor_mib) of one case on fresh inputs."""
    from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy
    from liger_losses.chunked.distillation import fused_linear_distillation_loss
    from liger_losses.chunked.preference.dpo import fused_linear_dpo_loss

    H, V = BIG["H"], BIG["V"]
    pairs, seq = (1, 16384) if name == "dpo16k" else (4, 1024)
    weight, hidden, ref_hidden, labels = make_batch(pairs, seq, H, V, ref=name.startswith("dpo"))
    if name == "ce":
        labels = labels.clone()
        labels[:] = torch.randint(0, V, labels.shape, device=labels.device)  # all 8192 tokens valid
        fn = lambda: fused_linear_cross_entropy(weight, hidden, labels)  # noqa: E731
        flops = 6 * labels.numel() * H * V
    elif name.startswith("dpo"):
        fn = lambda: fused_linear_dpo_loss(weight, hidden, ref_hidden, labels).loss  # noqa: E731
        flops = 8 * int((labels != -100).sum()) * H * V
    else:
        teacher_hidden = hidden.detach() + 0.1 * torch.randn_like(hidden)
        teacher_weight = weight.detach() + 0.01 * torch.randn_like(weight)
        labels = labels.clone()
        labels[:] = torch.randint(0, V, labels.shape, device=labels.device)
        fn = lambda: fused_linear_distillation_loss(  # noqa: E731
            weight, hidden, teacher_hidden, labels, teacher_weight=teacher_weight).loss
        flops = 8 * labels.numel() * H * V
    floor_mib = (weight.numel() + hidden.numel()) * 2 / MIB
    return full_step(fn, weight, hidden), gemm_floor_ms(flops), floor_mib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets-mib", type=int, nargs="+", default=[256, 384, 512])
    ap.add_argument("--cases", nargs="+", default=["ce", "dpo", "distill", "dpo16k"],
                    choices=["ce", "dpo", "distill", "dpo16k"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_chunk_budget: needs a CUDA GPU")
        return
    import liger_losses.chunked.engine as engine

    default = engine.DEFAULT_BUDGET_BYTES
    for name in args.cases:
        for mib in args.budgets_mib:
            engine.DEFAULT_BUDGET_BYTES = mib * MIB
            step, floor_ms, floor_mib = case_fn(name)
            m = measure(step, warmup=5 if name == "dpo16k" else 10, rep=20 if name == "dpo16k" else 50)
            print(f"{name:8s} budget {mib:4d} MiB: {m.ms:8.3f} ms ({m.ms / floor_ms:.3f}x floor {floor_ms:.2f}), "
                  f"peak {m.peak_mib:7.1f} MiB ({m.peak_mib / floor_mib:.3f}x {floor_mib:.0f}) {m.error or ''}",
                  flush=True)
            del step
            torch.cuda.empty_cache()
    engine.DEFAULT_BUDGET_BYTES = default


if __name__ == "__main__":
    main()
