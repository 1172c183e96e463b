"""Experiment (GPU): per-kernel GPU times of RoPE forward + backward for each provider of
``bench_rope.py`` (ours out of place, in place, in place with the gradient rotated in its buffer,
that plus ``repeated_tables=True`` as patched models run it) against liger-kernel 0.8.5.

Question: why did in-place RoPE trail liger-kernel by 1-2% (8B) to 5% (Qwen2-0.5B) at equal memory?

Verdict (H200, bf16, q-layout gradients): two differences. Ours read both halves of each cos/sin row
(transformers' tables repeat the first half; liger-kernel reads one: 3% of the bytes at Qwen's head
size), and computed per-head addresses from a runtime head stride (64 registers against
liger-kernel's 32). With ``repeated_tables=True`` and a constexpr head stride when q, k and the
outputs share it (56 registers): 8B 0.0862 ms net vs liger 0.0872 at 8192 tokens, equal at
16384-32768; Qwen2-0.5B 0.0170 vs 0.0167. Computing in bf16 as liger-kernel does (42 registers): no
faster; 8 warps at 8B (36 registers): 2-5% slower.

Status: done; patched models use ``repeated_tables=True`` (every family and rope type checked to
repeat, ``tests/patching/test_rope.py``). ``case_fns`` here is used by ``diag_norm_launch``.

Setup as ``bench_rope.py --grad-layout q`` (batch 1, bf16, fresh projection outputs cloned from
sources each call, upstream gradients laid out like q/k): CUDA-graph replay time (median, L2 flushed
as do_bench does) minus the clone's, and the mean GPU time of each kernel in the replay.

    python -m benchmark.experiments.diag_rope [--tokens 8192] [--shape llama3-8b qwen2-0.5b] [--warps 0]
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmark.bench_rope import SHAPES, cos_sin, providers
from benchmark.common import graphed, hbm_floor_ms, time_ms
from benchmark.experiments.diag_l2_flush import kernel_times


def case_fns(shape: str, tokens: int):
    n_qh, n_kh, d = SHAPES[shape]
    dt = torch.bfloat16
    cos, sin = cos_sin(tokens, d, "cuda", dt)
    q_src = torch.randn(1, tokens, n_qh * d, device="cuda", dtype=dt, requires_grad=True)
    k_src = torch.randn(1, tokens, n_kh * d, device="cuda", dtype=dt, requires_grad=True)
    gq = torch.randn(1, tokens, n_qh, d, device="cuda", dtype=dt).transpose(1, 2)
    gk = torch.randn(1, tokens, n_kh, d, device="cuda", dtype=dt).transpose(1, 2)

    def views():
        q_lin, k_lin = q_src.clone(), k_src.clone()
        return q_lin.view(1, tokens, n_qh, d).transpose(1, 2), k_lin.view(1, tokens, n_kh, d).transpose(1, 2)

    out = {}
    for name, fn in providers().items():
        if name == "clone":
            out[name] = lambda: views()
            continue
        if name == "hf-torch":
            continue

        def full(fn=fn):
            q, k = views()
            oq, ok = fn(q, k, cos, sin)
            return torch.autograd.grad((oq, ok), (q_src, k_src), (gq, gk))

        out[name] = full
    qk = tokens * (n_qh + n_kh) * d * 2
    floor = hbm_floor_ms(2 * (2 * qk + 2 * tokens * d * 2))
    return out, floor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--shape", nargs="+", default=list(SHAPES))
    ap.add_argument("--warps", type=int, default=0, help="the rope slot's num_warps (0: the default rule)")
    args = ap.parse_args()
    from liger_losses.kernels.rope import ROPE_TUNING

    os.environ["BENCH_GRAPH"] = "1"
    with ROPE_TUNING.override(num_warps=args.warps):
        run_shapes(args)


def run_shapes(args) -> None:
    """Each shape's providers: full and net-of-clone ms, and the RoPE kernels' GPU times."""
    for shape in args.shape:
        fns, floor = case_fns(shape, args.tokens)
        clone_ms = time_ms(fns.pop("clone"), warmup=10, rep=60)
        for name, fn in fns.items():
            fn()
            ms = time_ms(fn, warmup=10, rep=60)
            print(f"{shape} T={args.tokens} warps={args.warps} {name:18s} full {ms:.4f} ms  "
                  f"net {ms - clone_ms:.4f} ms  net/floor {(ms - clone_ms) / floor:.3f}", flush=True)
            for key, us in kernel_times(graphed(fn)):
                if "rope" in key:
                    print(f"    {us:8.2f} us  {key}")


if __name__ == "__main__":
    main()
