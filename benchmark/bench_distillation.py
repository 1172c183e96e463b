"""Fused linear JSD distillation, forward + backward ("full"), side by side (issue #3, distillation row).

Case: student and teacher heads of the same shape, H=4096, V=128256, bf16, 8192 tokens (all valid), generalized
JSD beta=0.5, temperature 1; gradients of the student's hidden states and LM head (the teacher is frozen).
Providers: ours (liger_losses ``fused_linear_distillation_loss``); plain torch (full logits, TRL's generalized
JSD formula in fp32, autograd); liger-kernel 0.8.5 ``liger_kernel.chunked_loss.LigerFusedLinearJSDLoss``
(hard-loss weight 0, soft 1); TRL 1.16 ``trl.kernels.chunked_divergence.ChunkedDivergenceFunction`` (mean of the
per-token divergence). Extra rows for ours: forward / reverse KL and chunk sizes 512..4096.
Floors: time (6 N H V student + 2 N H V teacher) / 790 TFLOP/s; memory (V H + N H) * 2 bytes.
Accuracy: relative error of loss / grad_hidden / grad_weight vs a float64 reference on 1024 tokens.

Run on the GPU: ``python -m benchmark.bench_distillation [--quick]`` (results in $OUT or benchmark/results/:
distillation*.csv/png).
"""

from __future__ import annotations

import argparse
import inspect
import math

import torch

from benchmark.common import MIB, Row, gemm_floor_ms, loss_accuracy_rows, loss_rows, write_results

BENCH = "distillation"
BETA = 0.5
TEMPERATURE = 1.0


# ----------------------------------------------------------------------------- providers
# each provider maker returns loss_fn(w, h, tw, th, y) -> 0-d loss differentiable w.r.t. (w, h)


def ours(chunk_tokens=None, divergence="jsd"):
    from liger_losses.chunked.distillation import fused_linear_distillation_loss

    def fn(w, h, tw, th, y):
        return fused_linear_distillation_loss(w, h, th, y, teacher_weight=tw, divergence=divergence, beta=BETA,
                                              temperature=TEMPERATURE, chunk_tokens=chunk_tokens).loss

    return fn


def generalized_jsd(student_logits, teacher_logits, beta, temperature):
    """TRL's generalized JSD (GKDTrainer.generalized_jsd_loss, reduction batchmean over tokens), plain torch."""
    ls = torch.log_softmax(student_logits / temperature, -1)
    lt = torch.log_softmax(teacher_logits / temperature, -1)
    if beta == 0:
        per = (lt.exp() * (lt - ls)).sum(-1)
    elif beta == 1:
        per = (ls.exp() * (ls - lt)).sum(-1)
    else:
        lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
        per = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
    return per.mean()


def plain_torch():
    def fn(w, h, tw, th, y):
        with torch.no_grad():
            t = (th @ tw.t()).float()
        return generalized_jsd((h @ w.t()).float(), t, BETA, TEMPERATURE)

    return fn


def liger_kernel():
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    params = inspect.signature(LigerFusedLinearJSDLoss.__init__).parameters
    opts = {"weight_hard_loss": 0.0, "weight_soft_loss": 1.0, "beta": BETA, "temperature": TEMPERATURE}
    mod = LigerFusedLinearJSDLoss(**{k: v for k, v in opts.items() if k in params})
    # forward(student_input [N, H], student_weight, teacher_input [N, Ht], teacher_weight, true_labels [N], ...)
    n_pos = len(inspect.signature(mod.forward).parameters)

    def fn(w, h, tw, th, y):
        args = [h, w, th, tw, y] + [None] * max(0, min(2, n_pos - 5))  # student_bias, teacher_bias
        return mod(*args)

    return fn


def trl_chunked():
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    def fn(w, h, tw, th, y):
        div, _entropy = ChunkedDivergenceFunction.apply(h, w, None, th, tw, None, BETA, TEMPERATURE)
        return div.mean()

    return fn


def gemms():
    from benchmark.common import gemms_only

    return lambda w, h, tw, th, y: gemms_only(w, h, extra_hidden=th, extra_weight=tw)


PROVIDERS = {
    "ours": ours,
    "torch": plain_torch,
    "liger-kernel": liger_kernel,
    "trl": trl_chunked,
    "gemms": gemms,  # the student's three GEMMs and the teacher's logits GEMM alone (practical floor)
}


def make_inputs(N, H, V, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).to(dtype).requires_grad_()
    h = torch.randn(N, H, device="cuda", generator=g).to(dtype).requires_grad_()
    tw = (torch.randn(V, H, device="cuda", generator=g) * 0.02).to(dtype)
    th = torch.randn(N, H, device="cuda", generator=g).to(dtype)
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    return w, h, tw, th, y


def bench_case(rows, case, N, H, V, providers, extra=None, quick=False):
    loss_rows(rows, BENCH, case, providers, make_inputs(N, H, V), floor_ms=gemm_floor_ms((6.0 + 2.0) * N * H * V),
              floor_mib=(V * H + N * H) * 2 / MIB, extra=extra, quick=quick)
    torch.cuda.empty_cache()


def accuracy_rows(providers, N=1024, H=4096, V=128256):
    """Relative errors of loss / grad_hidden / grad_weight vs float64 (bf16 inputs, N tokens)."""
    inputs = w, h, tw, th, y = make_inputs(N, H, V, seed=1)
    wd = w.detach().double().requires_grad_()
    hd = h.detach().double().requires_grad_()
    with torch.no_grad():
        t = th.double() @ tw.double().t()
    ref = generalized_jsd(hd @ wd.t(), t, BETA, TEMPERATURE)
    ref_gw, ref_gh = torch.autograd.grad(ref, (wd, hd))
    del wd, hd, t
    torch.cuda.empty_cache()
    return loss_accuracy_rows(BENCH, f"H{H}_V{V}_N{N}", providers, inputs, (ref, ref_gw, ref_gh),
                              {"tokens": N, "H": H, "V": V})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer cases and repetitions")
    ap.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated subset")
    args = ap.parse_args()
    providers = {k: PROVIDERS[k] for k in args.providers.split(",")}

    rows: list[Row] = []
    N, H, V = 8192, 4096, 128256
    case = f"H{H}_V{V}_N{N}"
    bench_case(rows, case, N, H, V, providers, {"tokens": N}, args.quick)
    if "ours" in providers:
        for div in ("forward_kl", "reverse_kl"):
            bench_case(rows, f"{case}_{div}", N, H, V, {f"ours-{div}": (lambda d=div: ours(divergence=d))},
                       {"tokens": N, "divergence": div}, args.quick)
        for ct in ((1024, 2048) if args.quick else (512, 1024, 2048, 4096)):
            bench_case(rows, f"{case}_chunk{ct}", N, H, V, {f"ours-chunk{ct}": (lambda ct=ct: ours(ct))},
                       {"tokens": N, "chunk_tokens": ct}, args.quick)
    write_results(BENCH, rows)
    write_results(BENCH + "_accuracy", accuracy_rows({k: v for k, v in providers.items() if k != "gemms"}))


if __name__ == "__main__":
    main()
