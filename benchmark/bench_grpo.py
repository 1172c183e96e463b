"""Speed and peak memory of the GRPO loss from hidden states, on the GPU: ours against the peers.

Cases (H=4096, V=151936, bf16, completions only, each row's completion 60-90% of T so 10-40% is padding,
``loss_type="dapo"``, epsilon 0.2, on-policy: ``old_logps`` = the current log-probs, detached, so the ratio is 1
and TRL's normalizer is the batch's completion-token count):

* ``dapo_8x2048_beta0`` / ``dapo_8x2048_beta0.04`` (reference log-probs given, TRL's k3 KL) / ``dapo_16x4096_beta0``;
* ``grpo_seq_8x2048`` -- ``loss_type="grpo"`` with ``importance_sampling_level="sequence"`` (GSPO);
* with ``--sweep``: completion length 512..16384 at 8 completions, and group sizes 4..32 at 2048 tokens (beta 0).

Mode "full": the loss forward + the gradients of hidden and weight (``torch.autograd.grad``).

Providers:
  ``ours``          ``liger_losses.LigerFusedLinearGRPOLoss`` (the gradient written in the forward pass where the
                    loss allows it);
  ``ours_logprobs`` ``liger_losses.fused_linear_token_logprobs`` (log-probs recomputed in backward) + the loss in
                    plain PyTorch;
  ``torch``         full logits, fp32 log-softmax, the loss in plain PyTorch, autograd;
  ``trl_fused``     TRL 1.16's fused LM head (``trl.kernels.ChunkedLogProbFunction`` on the valid tokens) + the
                    loss in plain PyTorch, if TRL is installed;
  ``liger``         liger-kernel 0.8.5 ``LigerFusedLinearGRPOLoss`` (torch.compile'd chunks), if installed;
  ``gemms``         not a loss: the GEMMs of our chunks alone on the valid tokens (logits, hidden and weight
                    gradients), the practical floor.

Floor: ``6 N H V`` FLOPs over the valid tokens at 790 TFLOP/s; memory floor ``(V H + N_all H) * 2`` bytes.

    python -m benchmark.bench_grpo [--quick] [--sweep] [--cases dapo_8x2048_beta0,...]

Results: ``grpo.csv`` / ``grpo.png`` (and ``grpo_sweep.*``) via :func:`benchmark.common.write_results`.
"""

from __future__ import annotations

import argparse

import torch

from benchmark.common import MIB, Row, gemm_floor_ms, gemms_only, measure, write_results

H, V = 4096, 151936
EPS = 0.2


def make_batch(batch, seq, *, beta, dtype=torch.bfloat16, seed=0):
    """``(weight [V,H], hidden [B,T,H], labels [B,T], advantages [B], ref_logps [B,T] | None)``; row b keeps its
    first 60-90% of T as completion, the rest is padding (-100)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda")
    weight = (torch.randn(V, H, device=dev, generator=g) * H**-0.5).to(dtype).requires_grad_()
    hidden = torch.randn(batch, seq, H, device=dev, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (batch, seq), device=dev, generator=g)
    keep = (0.6 + 0.3 * torch.rand(batch, device=dev, generator=g)) * seq
    labels[torch.arange(seq, device=dev)[None, :] >= keep[:, None].long()] = -100
    advantages = torch.randn(batch, device=dev, generator=g)
    ref_logps = None
    if beta:
        ref_logps = -10.0 - torch.rand(batch, seq, device=dev, generator=g)  # a reference log-prob per token
    return weight, hidden, labels, advantages, ref_logps


# --------------------------------------------------------------------------- the loss in plain PyTorch (TRL's formula)


def grpo_formula(logps, labels, advantages, ref_logps, *, beta, level="token", loss_type="dapo"):
    """TRL 1.16's clipped surrogate on per-token log-probs ``[B, T]`` (on-policy), dapo or grpo normalization."""
    mask = (labels != -100).float()
    old = logps.detach()
    log_ratio = logps - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - EPS, 1 + EPS)
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta:
        delta = ref_logps - logps
        per_token = per_token + beta * (torch.exp(delta) - delta - 1)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def torch_logps(weight, hidden, labels):
    logp = (hidden @ weight.T).float().log_softmax(-1)
    return logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (labels != -100)


def trl_logps(weight, hidden, labels):
    from trl.kernels import ChunkedLogProbFunction

    mask = labels != -100
    tok = ChunkedLogProbFunction.apply(hidden[mask], weight, None, labels[mask], 1.0, 32768, None, 1.0, ())[0]
    return torch.zeros(labels.shape, device=hidden.device, dtype=torch.float32).masked_scatter(mask, tok.float())


# --------------------------------------------------------------------------- providers


def providers(weight, hidden, labels, advantages, ref_logps, *, beta, level, loss_type):
    import liger_losses as ll

    formula = dict(beta=beta, level=level, loss_type=loss_type)
    ours = ll.LigerFusedLinearGRPOLoss(loss_type=loss_type, beta=beta, epsilon_low=EPS, epsilon_high=EPS,
                                       importance_sampling_level=level)
    out = {
        "ours": lambda: ours(weight, hidden, None, labels, advantages=advantages, ref_logps=ref_logps).loss,
        "ours_logprobs": lambda: grpo_formula(ll.fused_linear_token_logprobs(weight, hidden, labels), labels,
                                              advantages, ref_logps, **formula),
        "torch": lambda: grpo_formula(torch_logps(weight, hidden, labels), labels, advantages, ref_logps, **formula),
        "trl_fused": lambda: grpo_formula(trl_logps(weight, hidden, labels), labels, advantages, ref_logps,
                                          **formula),
        "gemms": lambda: gemms_only(weight, hidden, valid=labels != -100),
    }
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss as LigerGRPO

        mod = LigerGRPO(beta=beta, use_ref_model=False, epsilon_low=EPS, epsilon_high=EPS, loss_type=loss_type,
                        importance_sampling_level=level)
        mask = (labels != -100).long()
        out["liger"] = lambda: mod(hidden, weight, labels.clamp(min=0), mask, advantages,
                                   ref_per_token_logps=ref_logps)[0]
    except Exception as exc:  # noqa: BLE001 - a missing peer must not stop the table
        print(f"(liger-kernel GRPO unavailable: {exc})")
    return out


def run_case(bench, case, batch, seq, *, beta=0.0, level="token", loss_type="dapo", warmup=25, rep=100,
             skip=()):
    rows = case_rows(bench, case, batch, seq, beta=beta, level=level, loss_type=loss_type, warmup=warmup,
                     rep=rep, skip=skip)
    torch.cuda.empty_cache()  # the case's tensors died with case_rows: release them before the next case
    return rows


def case_rows(bench, case, batch, seq, *, beta, level, loss_type, warmup, rep, skip):
    """One row per provider of ``providers`` for one batch shape (see ``run_case``)."""
    weight, hidden, labels, advantages, ref_logps = make_batch(batch, seq, beta=beta)
    n_valid = int((labels != -100).sum())
    floor_ms = gemm_floor_ms(6 * n_valid * H * V)
    floor_mib = (V * H + labels.numel() * H) * 2 / MIB
    rows = []
    for name, fn in providers(weight, hidden, labels, advantages, ref_logps, beta=beta, level=level,
                              loss_type=loss_type).items():
        if name in skip:
            continue

        def step(fn=fn):
            return torch.autograd.grad(fn(), [hidden, weight])

        m = measure(step, warmup=warmup, rep=rep)
        rows.append(Row(bench, case, "full", name, m.ms, m.peak_mib, floor_ms, floor_mib,
                        extra={"batch": batch, "seq_len": seq, "beta": beta, "level": level,
                               "loss_type": loss_type, "tokens": n_valid},
                        error=m.error))
        print(f"{case:>22} {name:>14}: {m.ms:9.3f} ms {m.peak_mib:10.1f} MiB {m.error or ''}", flush=True)
    return rows


MAIN_CASES = [
    ("dapo_8x2048_beta0", 8, 2048, dict(beta=0.0)),
    ("dapo_8x2048_beta0.04", 8, 2048, dict(beta=0.04)),
    ("dapo_16x4096_beta0", 16, 4096, dict(beta=0.0)),
    ("grpo_seq_8x2048", 8, 2048, dict(loss_type="grpo", level="sequence")),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--sweep", action="store_true", help="also the completion-length and group-size sweeps")
    ap.add_argument("--cases", default=None, help="comma-separated subset of the main cases")
    ap.add_argument("--providers", default=None, help="comma-separated subset of the providers")
    args = ap.parse_args()
    warmup, rep = (5, 20) if args.quick else (25, 100)
    all_providers = ("ours", "ours_logprobs", "torch", "trl_fused", "liger", "gemms")
    keep = set(args.providers.split(",")) if args.providers else set(all_providers)
    skip = tuple(p for p in all_providers if p not in keep)
    cases = [c for c in MAIN_CASES if not args.cases or c[0] in args.cases.split(",")]
    rows = []
    for case, batch, seq, opts in cases:
        big = batch * seq > 8 * 2048
        rows += run_case("grpo", case, batch, seq, warmup=warmup, rep=rep, **opts,
                         skip=skip + (("torch",) if big else ()))  # the full fp32 logits of 64k tokens: 37 GiB
    write_results("grpo", rows)
    if not args.sweep:
        return
    sweep = []
    for seq in (512, 1024, 2048, 4096, 8192, 16384):
        sweep += run_case("grpo_sweep", f"dapo_8x{seq}", 8, seq, warmup=warmup, rep=rep,
                          skip=skip + ("torch", "liger"))
    for group in (4, 16, 32):
        sweep += run_case("grpo_sweep", f"dapo_{group}x2048", group, 2048, warmup=warmup, rep=rep,
                          skip=skip + ("torch", "liger"))
    write_results("grpo_sweep", sweep, plot_x="seq_len")


if __name__ == "__main__":
    main()
