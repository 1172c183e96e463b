"""Experiment (GPU): a cross-entropy tile that reads each logit once, the row held by one Triton program
spread over a thread-block cluster (``num_ctas``) with its reductions on chip.

Question: with ``num_ctas = k`` on Hopper, Triton spreads a program's tensors over ``k`` CTAs of a
cluster and does ``tl.max`` / ``tl.sum`` across them through distributed shared memory. A row of
V = 128256 bf16 logits as one ``[131072]`` block over 8 CTAs is 32 KB per SM: loaded once, reduced on
chip, the gradient written from registers -- one read and one write, against the row kernel's two
reads (the 1.3x-of-the-floor bar for cross-entropy on given logits needs that).

Verdict (H200): Triton 3.9 compiles it offline (``mapa``, ``ld.shared::cluster``, cluster barriers and
vectorised loads in the PTX), but the GPU image's Triton 3.6 rejects every formulation in
``TritonGPUPlanCTAPass``: 1-D reductions ("parent layout must have at least rank >= 2"), ``[1, C]`` and
``[R, C]`` tiles built with ``expand_dims`` or ``reshape``, and the 1-D row reshaped for the reductions
("Result has an invalid layout ... CGALayout"; those variants are in git history, commit ec64ea5).
Only ``num_ctas = 1`` compiles (a whole row per CTA: 9.09 ms at 8192 x 128256, registers spill). The
alternative without clusters -- a row split over programs that meet through L2 -- was slower in every
variant (1.93-2.80x the floor against the row kernel's 1.47x) and was removed.

Status: open, blocked on a GPU image with Triton >= 3.9; the first thing to run there, then a cluster
path in ``logits_tile`` gated on the Triton version.

Times, alternating over ``--rounds`` (``do_bench`` medians): the row kernel (``logits_tile``, gradient
into a separate buffer) and the cluster kernel at several (num_ctas, warps), each checked against the
row kernel (max |gradient difference|, loss relative error).

    python -m benchmark.experiments.diag_ce_cluster [--n 8192] [--vocab 128256] [--rounds 3]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from benchmark.common import hbm_floor_ms


@triton.jit
def _row_ce_kernel(X, stride_x, G, stride_g, LABELS, LOSS, V, ignore_index, scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    label = tl.load(LABELS + row).to(tl.int64)
    valid = label != ignore_index
    # the mask is the row length only, so that the loads vectorise (ignored rows are read too)
    x = tl.load(X + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    m = tl.where(valid, m, 0.0)
    p = tl.exp(x - m)
    d = tl.sum(p, 0)
    d = tl.where(valid, d, 1.0)
    lse = m + tl.log(d)
    x_y = tl.sum(tl.where(cols == label, x, 0.0), 0)
    tl.store(LOSS + row, tl.where(valid, lse - x_y, 0.0))
    coef = tl.where(valid, scale, 0.0)
    g = p * (coef / d)
    g = tl.where(cols == label, g - coef, g)
    g = tl.where(valid, g, 0.0)
    tl.store(G + row * stride_g + cols, g.to(G.dtype.element_ty), mask=cols < V)


def cluster_ce(x, labels, g, ctas, warps, scale):
    n, V = x.shape
    loss = torch.empty(n, device=x.device, dtype=torch.float32)
    _row_ce_kernel[(n,)](x, x.stride(0), g, g.stride(0), labels, loss, V, -100, scale,
                         BLOCK=triton.next_power_of_2(V), num_warps=warps, num_ctas=ctas)
    return loss


def compare_vocab(N, V, *, rounds):
    """Time the row kernel and each cluster launch on an ``[N, V]`` bf16 tile; print the table."""
    from liger_losses.kernels.logits_tile import logits_tile

    x = torch.randn(N, V, device="cuda", dtype=torch.bfloat16) * 2
    y = torch.randint(0, V, (N,), device="cuda")
    y[::10] = -100
    g = torch.empty_like(x)
    g_ref = torch.empty_like(x)
    ref = logits_tile(x, y, grad_scale=1.0 / N, out=g_ref, need_logits_sum=False)
    configs = {"row kernel": lambda: logits_tile(x, y, grad_scale=1.0 / N, out=g, need_logits_sum=False)}
    for ctas, warps in ((8, 8), (8, 16), (8, 32), (4, 16), (4, 32), (2, 32)):
        name = f"cluster {ctas} CTAs x {warps} warps"
        try:
            loss = cluster_ce(x, y, g, ctas, warps, 1.0 / N)
            torch.cuda.synchronize()
            gerr = (g.float() - g_ref.float()).abs().max().item()
            lerr = ((loss - ref.loss).norm() / ref.loss.norm()).item()
            print(f"{name}: max|dg| {gerr:.2e}, loss rel {lerr:.1e}", flush=True)
            configs[name] = (lambda c=ctas, w=warps: cluster_ce(x, y, g, c, w, 1.0 / N))
        except Exception as exc:  # noqa: BLE001
            print(f"{name}: failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    times = {k: [] for k in configs}
    for _ in range(rounds):
        for k, fn in configs.items():
            times[k].append(triton.testing.do_bench(fn, warmup=10, rep=100))
    floor = hbm_floor_ms(2 * N * V * 2)
    print(f"--- N={N} V={V}, floor {floor:.4f} ms")
    for k, ts in times.items():
        ms = sorted(ts)[len(ts) // 2]
        print(f"{k:28s} {ms:.4f} ms  {ms / floor:.3f}x floor  rounds {[round(t, 4) for t in ts]}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--vocab", type=int, nargs="+", default=[128256])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for V in args.vocab:
        compare_vocab(args.n, V, rounds=args.rounds)
        torch.cuda.empty_cache()  # the tiles died with compare_vocab


if __name__ == "__main__":
    main()
