"""Diagnostic (GPU): cross-entropy forward + backward with the first chunk issued before the host
sync (``engine.SPECULATIVE_FIRST_CHUNK``) and without, alternating, at the engine table's shape
(H=4096, V=128256, bf16, 8192 tokens; all valid, and a quarter ignored as prompt tokens).

    python benchmark/diag_speculative.py [--rounds 3]

Prints the median ms of each (``triton.testing.do_bench``, L2 flushed between calls) and the ratio
to the GEMM floor (6 N_valid H V FLOPs at 790 TFLOP/s).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmark.common import gemm_floor_ms, time_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_speculative: needs a CUDA GPU")
        return
    import liger_losses.chunked.engine as engine
    from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy

    H, V, N = 4096, 128256, args.tokens
    torch.manual_seed(0)
    w = (torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    h = torch.randn(N // 1024, 1024, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
    for ignored in (0, 256):
        labels = torch.randint(0, V, (N // 1024, 1024), device="cuda")
        labels[:, :ignored] = -100
        valid = int((labels != -100).sum())
        floor = gemm_floor_ms(6.0 * valid * H * V)

        def step():
            loss = fused_linear_cross_entropy(w, h, labels)
            return torch.autograd.grad(loss, (w, h))

        for r in range(args.rounds):
            for speculate in (True, False):
                engine.SPECULATIVE_FIRST_CHUNK = speculate
                ms = time_ms(step, warmup=5, rep=30)
                print(f"ignored/row={ignored} valid={valid} speculative={int(speculate)} round={r}: "
                      f"{ms:.2f} ms ({ms / floor:.3f}x floor {floor:.2f})", flush=True)
        engine.SPECULATIVE_FIRST_CHUNK = True


if __name__ == "__main__":
    main()
