"""Experiment (GPU): does a bf16 GEMM's speed depend on its operands' values under the power cap?

Question: under sustained load the H200 sits at its 692 W cap, where the SM clock follows the power
drawn, and the tensor cores' power depends on how many operand bits toggle. If so, a benchmark's
input distribution moves its GEMM times (and a step whose GEMMs see many zeros runs faster).

Verdict (H200, ``[32768, 8192] @ [8192, 2048]``, 3 s per kind, two rounds in opposite orders): yes.
N(0, 1) operands 1.6207 ms, 678 TFLOP/s (1.165x the 790 floor, 1463-1470 MHz at the cap);
N(0, 1) x 0.02 676; half the columns of A zero 743 (1.064x); 90% of A zero 782 (1.011x); all zeros
or all ones 825 (0.958x, 456-465 W: under the cap). Random operands -- the benchmarks' -- sustain
~680 TFLOP/s; 790 is a low-entropy or short-burst rate.

Status: done; the practical floor of DESIGN.md ("~680 TFLOP/s, not 790") rests on it.

Times one GEMM shape (default the MLP's down projection at 16 x 2048 tokens of a Llama-3.2-1B-shaped
model) for several operand kinds, each for ``--seconds`` of back-to-back calls after the same
warm-up, alternating kinds over ``--rounds``:

    randn        N(0, 1) in bf16
    randn*0.02   the same, scaled (the exponent range changes, the mantissas do not)
    half-zero    N(0, 1) with every other column of A zero
    sparse-90    N(0, 1) with 90% of A's entries zero
    zeros        all zeros
    ones         all ones (constant operands: no toggling)

Prints ms per GEMM, TFLOP/s and the mean SM clock / power from ``nvidia-smi`` during each kind.

    python -m benchmark.experiments.diag_gemm_power [--m 32768 --k 8192 --n 2048] [--seconds 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmark.common import Smi


def operands(kind: str, m: int, k: int, n: int, g: torch.Generator):
    a = torch.randn(m, k, device="cuda", generator=g)
    b = torch.randn(k, n, device="cuda", generator=g)
    if kind == "randn*0.02":
        a, b = a * 0.02, b * 0.02
    elif kind == "half-zero":
        a[:, ::2] = 0
    elif kind == "sparse-90":
        a = a * (torch.rand(m, k, device="cuda", generator=g) < 0.1)
    elif kind == "zeros":
        a.zero_()
        b.zero_()
    elif kind == "ones":
        a.fill_(1.0)
        b.fill_(1.0)
    return a.bfloat16(), b.bfloat16()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=32768)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kinds", default="randn,randn*0.02,half-zero,sparse-90,zeros,ones")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_gemm_power: needs a CUDA GPU")
        return
    m, k, n = args.m, args.k, args.n
    flops = 2.0 * m * k * n
    g = torch.Generator(device="cuda").manual_seed(0)
    kinds = args.kinds.split(",")
    data = {kind: operands(kind, m, k, n, g) for kind in kinds}
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    smi = Smi(os.path.join(os.environ.get("OUT", "."), "smi_gemm_power.csv"))
    a0, b0 = data[kinds[0]]
    for _ in range(200):  # the same warm-up for every kind: reach the power cap first
        torch.mm(a0, b0, out=out)
    torch.cuda.synchronize()
    results: dict = {}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(args.rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            a, b = data[kind]
            smi.mark(f"{kind} r{r}")
            t_end = time.time() + args.seconds
            calls, total = 0, 0.0
            while time.time() < t_end:
                start.record()
                for _ in range(20):
                    torch.mm(a, b, out=out)
                end.record()
                end.synchronize()
                total += start.elapsed_time(end)
                calls += 20
            ms = total / calls
            results.setdefault(kind, []).append(ms)
            print(f"round {r} {kind:12s} {ms:8.4f} ms  {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
    print(f"[{m}, {k}] @ [{k}, {n}] bf16: mean over rounds")
    base = sum(results[kinds[0]]) / len(results[kinds[0]])
    for kind in kinds:
        ms = sum(results[kind]) / len(results[kind])
        print(f"  {kind:12s} {ms:8.4f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  {ms / base:6.3f}x {kinds[0]}")
    smi.summary()


if __name__ == "__main__":
    main()
