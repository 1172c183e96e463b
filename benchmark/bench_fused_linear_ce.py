"""Fused linear cross-entropy, forward + backward ("full"), side by side (issue #3, CE rows).

Cases (bf16, all labels valid): H=4096, V=128256, 8192 tokens (the headline row); a sweep over
tokens 512..16384 at that shape; the small-model shape H=896, V=151936; and chunk-size rows for
ours (chunk_tokens 512/1024/2048/4096) so the default can be chosen.
Providers: ours (liger_losses), plain torch (logits = hidden @ W.T; F.cross_entropy(logits.float())
as HF does), liger-kernel 0.8.5, TRL 1.16 ChunkedLogProbFunction (-mean log-prob), Cut CE 25.1.1,
and ``gemms``: our chunks' three cuBLAS GEMMs alone (``common.gemms_only``), the practical floor
under the same clocks (no loss is computed; not in the accuracy table).
Floors: time 6*N*H*V / 790 TFLOP/s; memory (V*H + N*H) * 2 bytes (the two bf16 gradients).
Accuracy: relative error of loss / grad_hidden / grad_weight vs a float64 reference on 1024 tokens.

Run on the GPU: ``python -m benchmark.bench_fused_linear_ce [--quick]`` (results in $OUT or
benchmark/results/: fused_linear_ce*.csv/png). ``--frozen``: only the frozen-head rows (the weight
without a gradient, as under LoRA; ours = the online-softmax path, ``ours-tile`` = the tile path;
floors 4NHV and the hidden gradient) -> ``fused_linear_ce_frozen.csv``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmark.common import MIB, Row, gemm_floor_ms, loss_accuracy_rows, loss_rows, write_results

BENCH = "fused_linear_ce"


# ----------------------------------------------------------------------------- providers


def ours(chunk_tokens=None):
    from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy

    return lambda w, h, y: fused_linear_cross_entropy(w, h, y, chunk_tokens=chunk_tokens)


def ours_tile():
    """ours with the frozen-head path off: the tile sized for the weight gradient (the old default)."""
    from liger_losses.chunked.config import engine_config
    from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy

    def fn(w, h, y):
        with engine_config(frozen_head_online=False):
            return fused_linear_cross_entropy(w, h, y)

    return fn


def plain_torch():
    return lambda w, h, y: F.cross_entropy((h @ w.t()).float(), y)


def liger_kernel():
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    mod = LigerFusedLinearCrossEntropyLoss()
    return lambda w, h, y: mod(w, h, y)


def trl_chunked():
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    def fn(w, h, y):
        logps = ChunkedLogProbFunction.apply(h, w, None, y, 1.0, 32768, None, 1.0, ())[0]
        return -logps.mean()

    return fn


def gemms():
    from benchmark.common import gemms_only

    return lambda w, h, y: gemms_only(w, h)


def cut_ce():
    from cut_cross_entropy import linear_cross_entropy

    return lambda w, h, y: linear_cross_entropy(h, w, y)


PROVIDERS = {
    "ours": ours,
    "torch": plain_torch,
    "liger-kernel": liger_kernel,
    "trl": trl_chunked,
    "cut-ce": cut_ce,
    "gemms": gemms,
}


FROZEN_PROVIDERS = dict(PROVIDERS, **{"ours-tile": ours_tile})


def make_inputs(N, H, V, dtype=torch.bfloat16, seed=0, frozen=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).to(dtype).requires_grad_(not frozen)
    h = torch.randn(N, H, device="cuda", generator=g).to(dtype).requires_grad_()
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    return w, h, y


def bench_case(rows, case, N, H, V, providers, extra=None, quick=False, frozen=False):
    """Frozen (a LoRA user's head): only the hidden gradient; floors 4NHV and the [N, H] gradient."""
    flops, grad_bytes = (4.0, N * H * 2) if frozen else (6.0, (V * H + N * H) * 2)
    loss_rows(rows, BENCH, case, providers, make_inputs(N, H, V, frozen=frozen),
              floor_ms=gemm_floor_ms(flops * N * H * V), floor_mib=grad_bytes / MIB, extra=extra, quick=quick)
    torch.cuda.empty_cache()


def accuracy_rows(providers, N=1024, H=4096, V=128256):
    """rel errors of loss / grad_hidden / grad_weight vs float64, bf16 inputs, N tokens."""
    inputs = w, h, y = make_inputs(N, H, V, seed=1)
    wd = w.detach().double().requires_grad_()
    hd = h.detach().double().requires_grad_()
    ref = F.cross_entropy(hd @ wd.t(), y)
    ref_gw, ref_gh = torch.autograd.grad(ref, (wd, hd))
    del wd, hd
    torch.cuda.empty_cache()
    return loss_accuracy_rows(BENCH, f"H{H}_V{V}_N{N}", providers, inputs, (ref, ref_gw, ref_gh),
                              {"tokens": N, "H": H, "V": V})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer cases and repetitions")
    ap.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated subset")
    ap.add_argument("--frozen", action="store_true",
                    help="only the frozen-head rows (weight without grad) -> fused_linear_ce_frozen.csv")
    args = ap.parse_args()
    providers = {k: PROVIDERS[k] for k in args.providers.split(",")}
    if args.frozen:
        frozen: list[Row] = []
        names = [k for k in FROZEN_PROVIDERS if k in providers or k == "ours-tile"]
        for n in ((8192,) if args.quick else (2048, 8192, 16384)):
            bench_case(frozen, f"H4096_V128256_N{n}_frozen", n, 4096, 128256,
                       {k: FROZEN_PROVIDERS[k] for k in names}, {"tokens": n, "frozen": True}, args.quick, True)
        write_results(BENCH + "_frozen", frozen)
        return

    rows: list[Row] = []
    H, V = 4096, 128256
    bench_case(rows, f"H{H}_V{V}_N8192", 8192, H, V, providers, {"tokens": 8192}, args.quick)
    bench_case(rows, "H896_V151936_N8192", 8192, 896, 151936, providers, {"tokens": 8192}, args.quick)
    for ct in (512, 1024, 2048, 4096):
        bench_case(rows, f"H{H}_V{V}_N8192_chunk{ct}", 8192, H, V,
                   {f"ours-chunk{ct}": (lambda ct=ct: ours(ct))}, {"tokens": 8192, "chunk_tokens": ct},
                   args.quick)
    write_results(BENCH, rows)

    sweep: list[Row] = []
    tokens = (2048, 8192) if args.quick else (512, 1024, 2048, 4096, 8192, 16384)
    for n in tokens:
        bench_case(sweep, f"H{H}_V{V}_N{n}", n, H, V, providers, {"tokens": n}, args.quick)
    write_results(BENCH + "_sweep", sweep, plot_x="tokens")

    write_results(BENCH + "_accuracy", accuracy_rows({k: v for k, v in providers.items() if k != "gemms"}))


if __name__ == "__main__":
    main()
