"""Experiment (GPU): the SFT trainer's loss path -- the sequence objective against plain cross-entropy.

Question: ``trl_integration.SFTTrainer(use_liger=True)`` scores tokens through
``fused_linear_sequence_objective`` (one unit per sequence, objective ``-logps * B / N``), which
chunks whole sequences (up to ``unit_budget_factor`` tile budgets each) and does more host work
per chunk than ``fused_linear_cross_entropy`` (1014 against 633 dispatched ops for 8 chunks on
the CPU). Would the cross-entropy path (token chunks of one tile budget, the same loss, accuracy
and entropy) make host-bound SFT steps faster?

Per shape (bf16, 100 prompt tokens per sequence masked, labels shifted): ``do_bench`` of forward +
backward, the peak above the inputs, the wall time of one synchronous call, the values, and the
relative difference of the two paths' gradients.

H200 (torch 2.11, triton 3.6), two runs: Llama-3.2-1B head, 2 x 2048: sequence path 10.37 / 9.91 ms
at 1061 MiB, cross-entropy 10.49 / 10.26 at 275; Gemma-3-1B head (V 262144), 4 x 2048: 26.28 / 25.71
at 1018 against 29.55 / 28.36 at 300; 8 x 2048 at the Llama head 41.63 / 40.85 at 1109 against 43.04
/ 42.71 at 327. One synchronous call's wall time goes either way (4.1 / 9.6 / 9.8 against 4.3 /
10.0 / 10.8 ms in one run, 2.9 / 6.9 / 7.1 against 4.2 / 6.7 / 6.3 in the other). Values equal to
4e-7, gradients 4.4e-3 apart (bf16 rounding of each). Status: answered: the sequence path stays
(faster on the GPU, not heavier on the host; its larger tiles sit below the step's peak, which is
in the layers' backward).

    python -m benchmark.experiments.diag_sft_loss_path
"""

from __future__ import annotations

import statistics
import time

import torch

from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy
from liger_losses.chunked.sequence import fused_linear_sequence_objective
from liger_losses.trl_integration.sft import _TokenMeanNLL

MIB = 2**20
SHAPES = {"llama1b 2x2048": (2, 2048, 2048, 128256), "gemma3 4x2048": (4, 2048, 1152, 262144),
          "llama1b 8x2048": (8, 2048, 2048, 128256)}  # batch, seq, hidden, vocab


def sequence_path(weight, hidden, labels):
    """What SFTTrainer runs: (loss, valid tokens, correct, entropy sum)."""
    loss, _, stats = fused_linear_sequence_objective(
        weight, hidden, labels, _TokenMeanNLL(None), group_size=1, separable=True, ignore_index=-100,
        need_entropy=True)
    return loss, stats.num_tokens.sum(), stats.correct.sum(), stats.entropy_sum.sum()


def cross_entropy_path(weight, hidden, labels):
    out = fused_linear_cross_entropy(weight, hidden, labels, ignore_index=-100, return_token_accuracy=True,
                                     return_entropy=True)
    valid = (labels != -100).sum()
    return out.loss, valid, out.metrics["token_accuracy"] * valid, out.metrics["entropy"] * valid


def measure(fn, weight, hidden0, labels) -> dict:
    import triton

    hidden = hidden0.clone().requires_grad_()

    def step():
        weight.grad = hidden.grad = None
        out = fn(weight, hidden[:, :-1], labels[:, 1:])
        out[0].backward()
        return out

    values = [float(v.detach()) for v in step()]
    grads = (weight.grad.float().clone(), hidden.grad.float().clone())
    ms = triton.testing.do_bench(step, warmup=5, rep=200)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / MIB
    walls = []
    for _ in range(10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        walls.append((time.perf_counter() - start) * 1e3)
    return dict(ms=ms, peak=peak, wall=statistics.median(walls), values=values, grads=grads)


def main() -> None:
    for name, (B, T, H, V) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        weight = (torch.randn(V, H, device="cuda", generator=gen) * 0.02).bfloat16().requires_grad_()
        hidden = torch.randn(B, T, H, device="cuda", generator=gen).bfloat16()
        labels = torch.randint(0, V, (B, T), device="cuda", generator=gen)
        labels[:, :100] = -100
        res = {}
        for path, fn in (("sequence", sequence_path), ("cross-entropy", cross_entropy_path)):
            r = res[path] = measure(fn, weight, hidden, labels)
            print(f"{name} {path}: {r['ms']:.2f} ms, peak {r['peak']:.0f} MiB above the inputs, one call "
                  f"{r['wall']:.2f} ms, values {r['values']}", flush=True)
        pairs = zip(res["cross-entropy"]["grads"], res["sequence"]["grads"])
        rel = [float((a - b).norm() / b.norm()) for a, b in pairs]
        print(f"{name}: gradients apart by {rel[0]:.2e} (weight), {rel[1]:.2e} (hidden)", flush=True)


if __name__ == "__main__":
    main()
