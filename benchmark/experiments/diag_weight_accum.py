"""Experiment (GPU): what accumulating a bf16 head's weight gradient in fp32 costs, loss by loss.

Question: with ``EngineConfig.half_weight_accum_dtype=torch.float32`` (the default) the weight
gradient of a bf16 head that several chunks add to lives in an fp32 buffer, written by each chunk's
GEMM (``addmm(..., out_dtype=float32)``) and cast to bf16 at the backward. How much slower and
heavier is that than accumulating in bf16 (``half_weight_accum_dtype=None``), and than the GEMMs
alone (bf16 accumulation, nothing else)?

Per case (bf16 weights and hidden states, labels all valid, forward + backward with both
gradients): ``do_bench`` median over alternating rounds of the two settings and the GEMMs alone,
the peak above the inputs (gradients included), and each setting's weight-gradient error against
float64 on the first round's inputs (``||g - ref|| / ||ref||``; the reference is the same loss in
float64 on the same bf16 values). Cases: cross-entropy at the Llama-3-8B head (8192 and 16384
tokens), at the Llama-3.2-1B head (4096 tokens: the matrix's 2 x 2048 SFT), the Gemma-2-2B head
(softcap 30, V 256000, 16384 tokens), and SFT's own loss path (``fused_linear_sequence_objective``,
8 x 2048 at the Llama-1B head).

Writes ``weight_accum.csv`` (``$BENCH_OUT`` / ``$OUT`` / benchmark/results).

    python -m benchmark.experiments.diag_weight_accum [--rounds 3] [--cases ce_8192_h4096 ...]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics

import torch

from benchmark.common import gemms_only, peak_mib, results_dir, time_ms
from liger_losses.chunked.config import engine_config
from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy
from liger_losses.chunked.sequence import fused_linear_sequence_objective
from liger_losses.trl_integration.sft import _TokenMeanNLL

# name -> (loss, sequences, tokens per sequence, hidden, vocab, softcap)
CASES = {
    "ce_8192_h4096": ("ce", 1, 8192, 4096, 128256, None),
    "ce_16384_h4096": ("ce", 1, 16384, 4096, 128256, None),
    "ce_4096_h2048": ("ce", 1, 4096, 2048, 128256, None),
    "ce_16384_gemma2": ("ce", 1, 16384, 2304, 256000, 30.0),
    "sft_8x2048_h2048": ("sft", 8, 2048, 2048, 128256, None),
}
SETTINGS = {"fp32-accum": torch.float32, "bf16-accum": None}


def loss_of(kind, softcap):
    if kind == "ce":
        return lambda w, h, y: fused_linear_cross_entropy(w, h, y, softcap=softcap)

    def sft(w, h, y):
        loss, _, _ = fused_linear_sequence_objective(w, h, y, _TokenMeanNLL(None), group_size=1, separable=True,
                                                     ignore_index=-100, softcap=softcap)
        return loss
    return sft


def step(loss_fn, w, h, y, accum):
    def fn():
        with engine_config(half_weight_accum_dtype=accum):
            loss = loss_fn(w, h, y)
            return torch.autograd.grad(loss, (w, h))
    return fn


def gemm_step(w, h):
    def fn():
        return torch.autograd.grad(gemms_only(w, h), (w, h))
    return fn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    a = ap.parse_args(argv)
    rows = []
    for name in a.cases:
        kind, B, T, H, V, softcap = CASES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16).requires_grad_()
        h = torch.randn(B, T, H, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
        y = torch.randint(0, V, (B, T), device="cuda", generator=g)
        loss_fn = loss_of(kind, softcap)
        providers = {s: step(loss_fn, w, h, y, acc) for s, acc in SETTINGS.items()}
        providers["gemms"] = gemm_step(w, h)
        errors = {}
        w64 = w.detach().double().requires_grad_()
        ref = torch.autograd.grad(loss_fn(w64, h.detach().double(), y), w64)[0]
        for s, acc in SETTINGS.items():
            gw = providers[s]()[0]
            errors[s] = float((gw.double() - ref).norm() / ref.norm())
        del ref, w64
        torch.cuda.empty_cache()
        times = {p: [] for p in providers}
        peaks = {p: peak_mib(fn) for p, fn in providers.items()}
        for _ in range(a.rounds):
            for p, fn in providers.items():
                times[p].append(time_ms(fn, warmup=5, rep=30))
        base = statistics.median(times["bf16-accum"])
        floor = statistics.median(times["gemms"])
        for p in providers:
            ms = statistics.median(times[p])
            rows.append(dict(case=name, provider=p, ms=round(ms, 3), ms_min=round(min(times[p]), 3),
                             ms_max=round(max(times[p]), 3), vs_bf16_accum=round(ms / base, 4),
                             vs_gemms=round(ms / floor, 4), peak_mib=round(peaks[p], 1),
                             grad_weight_rel_err=f"{errors[p]:.3e}" if p in errors else "",
                             device=torch.cuda.get_device_name()))
            print(rows[-1], flush=True)
        del w, h, y, providers
        torch.cuda.empty_cache()
    path = os.path.join(results_dir(), "weight_accum.csv")
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
