"""Speed and peak memory of the preference losses (DPO, SimPO, ORPO) from hidden states, on the GPU.

Rows of issue #3: H=4096, V=128256, bf16; DPO with a reference (4 pairs x 1024 tokens and 1 pair x
16384 tokens), SimPO and ORPO on the 4 x 1024 batch, the first 25% of every sequence is prompt
(label -100); a sequence-length sweep 512..16384 for DPO (1 pair); the small-model head H=896,
V=151936. Mode "full": loss forward + gradients of hidden and weight (``torch.autograd.grad``).

Providers: ``ours`` (liger_losses chunked engine); ``torch`` (full logits, log_softmax in fp32, TRL's
formula, autograd); ``liger`` (liger-kernel 0.8.5 ``liger_kernel.chunked_loss`` modules, if
installed); ``trl_fused`` (TRL 1.16's fused LM-head kernel ``trl.kernels.ChunkedLogProbFunction`` on the
valid tokens, then TRL's formula), if installed.

Floors: GEMM FLOPs of valid tokens only, ``6 N H V`` for the policy + ``2 N H V`` per reference forward,
at 790 TFLOP/s; memory floor ``(V H + N_all H) * 2`` bytes (the bf16 gradients of weight and hidden).

    python -m benchmark.bench_preference [--quick]
"""

from __future__ import annotations

import argparse
import inspect

import torch
import torch.nn.functional as F

from benchmark.common import MIB, Row, gemm_floor_ms, measure, write_results
from liger_losses.chunked.preference import (
    fused_linear_dpo_loss,
    fused_linear_orpo_loss,
    fused_linear_simpo_loss,
)

BIG = dict(H=4096, V=128256)
SMALL = dict(H=896, V=151936)
BETA_DPO, BETA_SIMPO, GAMMA_SIMPO, BETA_ORPO = 0.1, 2.0, 0.5, 0.1


# --------------------------------------------------------------------------- inputs


def make_batch(pairs, seq, H, V, *, ref, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda")
    weight = (torch.randn(V, H, device=dev, generator=g) * H**-0.5).to(dtype).requires_grad_()
    hidden = torch.randn(2 * pairs, seq, H, device=dev, generator=g).to(dtype).requires_grad_()
    ref_hidden = None
    if ref:
        ref_hidden = (hidden.detach().float() + 0.1 * torch.randn(hidden.shape, device=dev, generator=g)).to(dtype)
    labels = torch.randint(0, V, (2 * pairs, seq), device=dev, generator=g)
    labels[:, : seq // 4] = -100  # first 25% is prompt
    return weight, hidden, ref_hidden, labels


def full_step(loss_fn, weight, hidden):
    """Forward + gradients of hidden and weight (no .grad accumulation between calls)."""

    def fn():
        loss = loss_fn()
        return torch.autograd.grad(loss, [hidden, weight])

    return fn


# --------------------------------------------------------------------------- plain torch (TRL formula)


def torch_seq_logps(weight, hidden, labels):
    logits = hidden @ weight.T
    logp = logits.float().log_softmax(-1)
    mask = labels != -100
    tok = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    return tok.sum(1), mask.sum(1)


def dpo_formula(seq_logps, weight, hidden, ref_hidden, labels):
    """DPO loss from ``seq_logps(weight, hidden, labels) -> (logps, n)`` (the reference without grad)."""
    logps, _ = seq_logps(weight, hidden, labels)
    with torch.no_grad():
        ref, _ = seq_logps(weight, ref_hidden, labels)
    c, r = logps.chunk(2)
    rc, rr = ref.chunk(2)
    return -F.logsigmoid(BETA_DPO * ((c - rc) - (r - rr))).mean()


def torch_dpo(weight, hidden, ref_hidden, labels):
    return dpo_formula(torch_seq_logps, weight, hidden, ref_hidden, labels)


def simpo_formula(logps, n):
    avg = logps / n.clamp(min=1)
    c, r = avg.chunk(2)
    return -F.logsigmoid(BETA_SIMPO * (c - r - GAMMA_SIMPO / BETA_SIMPO)).mean()


def orpo_formula(logps, n):
    avg = logps / n.clamp(min=1)
    c, r = avg.chunk(2)
    log_odds = (c - r) - (torch.log(-torch.expm1(c)) - torch.log(-torch.expm1(r)))
    nll = -logps.chunk(2)[0].sum() / n.chunk(2)[0].sum()
    return nll - BETA_ORPO * F.logsigmoid(log_odds).mean()


def torch_simpo(weight, hidden, labels):
    return simpo_formula(*torch_seq_logps(weight, hidden, labels))


def torch_orpo(weight, hidden, labels):
    return orpo_formula(*torch_seq_logps(weight, hidden, labels))


# --------------------------------------------------------------------------- TRL fused LM head


def trl_seq_logps(weight, hidden, labels):
    from trl.kernels import ChunkedLogProbFunction

    mask = labels != -100
    seq = mask.nonzero()[:, 0]
    tok = ChunkedLogProbFunction.apply(hidden[mask], weight, None, labels[mask], 1.0, 32768, None, 1.0, ())[0]
    logps = torch.zeros(labels.shape[0], device=hidden.device, dtype=torch.float32).index_add(0, seq, tok.float())
    return logps, mask.sum(1)


def trl_dpo(weight, hidden, ref_hidden, labels):
    return dpo_formula(trl_seq_logps, weight, hidden, ref_hidden, labels)


# --------------------------------------------------------------------------- liger-kernel


def liger_module(name, **options):
    """liger_kernel.chunked_loss.<name>(**options filtered to what its __init__ accepts)."""
    import liger_kernel.chunked_loss as lk

    cls = getattr(lk, name)
    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in options.items() if k in accepted})


def first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


# --------------------------------------------------------------------------- cases


def providers_for(loss, weight, hidden, ref_hidden, labels):
    """{provider: zero-arg loss function} for one loss on one batch; ``gemms`` is not a loss but the
    practical floor (the GEMMs of our chunks alone, reference forward included, on the valid rows)."""
    from benchmark.common import gemms_only

    def gemms():
        return gemms_only(weight, hidden, valid=labels != -100, extra_hidden=ref_hidden)

    if loss == "dpo":
        out = {
            "ours": lambda: fused_linear_dpo_loss(weight, hidden, ref_hidden, labels, beta=BETA_DPO).loss,
            "torch": lambda: torch_dpo(weight, hidden, ref_hidden, labels),
            "trl_fused": lambda: trl_dpo(weight, hidden, ref_hidden, labels),
            "gemms": gemms,
        }
        try:
            mod = liger_module("LigerFusedLinearDPOLoss", beta=BETA_DPO, use_ref_model=True, compute_nll_loss=False)
            out["liger"] = lambda: first(mod(weight, hidden, labels, ref_input=ref_hidden, ref_weight=weight))
        except Exception as exc:  # noqa: BLE001
            print(f"(liger DPO unavailable: {exc})")
        return out
    if loss == "simpo":
        out = {
            "ours": lambda: fused_linear_simpo_loss(weight, hidden, labels, beta=BETA_SIMPO, gamma=GAMMA_SIMPO).loss,
            "torch": lambda: torch_simpo(weight, hidden, labels),
            "trl_fused": lambda: simpo_formula(*trl_seq_logps(weight, hidden, labels)),
            "gemms": gemms,
        }
        try:
            mod = liger_module("LigerFusedLinearSimPOLoss", beta=BETA_SIMPO, gamma=GAMMA_SIMPO, compute_nll_loss=False)
            out["liger"] = lambda: first(mod(weight, hidden, labels))
        except Exception as exc:  # noqa: BLE001
            print(f"(liger SimPO unavailable: {exc})")
        return out
    if loss == "orpo":
        out = {
            "ours": lambda: fused_linear_orpo_loss(weight, hidden, labels, beta=BETA_ORPO).loss,
            "torch": lambda: torch_orpo(weight, hidden, labels),
            "trl_fused": lambda: orpo_formula(*trl_seq_logps(weight, hidden, labels)),
            "gemms": gemms,
        }
        try:
            mod = liger_module("LigerFusedLinearORPOLoss", beta=BETA_ORPO, compute_nll_loss=True)
            out["liger"] = lambda: first(mod(weight, hidden, labels))
        except Exception as exc:  # noqa: BLE001
            print(f"(liger ORPO unavailable: {exc})")
        return out
    raise ValueError(loss)


def run_case(bench, case, loss, pairs, seq, H, V, *, warmup, rep, extra=None, skip=()):
    ref = loss == "dpo"
    weight, hidden, ref_hidden, labels = make_batch(pairs, seq, H, V, ref=ref)
    n_valid = int((labels != -100).sum())
    n_all = labels.numel()
    flops = 6 * n_valid * H * V + (2 * n_valid * H * V if ref else 0)
    floor_mib = (V * H + n_all * H) * 2 / MIB
    rows = []
    for name, fn in providers_for(loss, weight, hidden, ref_hidden, labels).items():
        if name in skip:
            continue
        m = measure(full_step(fn, weight, hidden), warmup=warmup, rep=rep)
        rows.append(Row(bench, case, "full", name, m.ms, m.peak_mib, gemm_floor_ms(flops), floor_mib,
                        extra={"loss": loss, "pairs": pairs, "seq_len": seq, "H": H, "V": V, "tokens": n_valid,
                               **(extra or {})},
                        error=m.error))
        print(f"{case:>24} {name:>10}: {m.ms:9.3f} ms {m.peak_mib:10.1f} MiB {m.error or ''}", flush=True)
    del weight, hidden, ref_hidden, labels
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer cases and repetitions")
    ap.add_argument("--cases", default=None,
                    help="comma-separated subset of the main cases (e.g. dpo_4x1024_small); skips the sweep")
    args = ap.parse_args()
    warmup, rep = (5, 20) if args.quick else (25, 100)

    rows = []
    main_cases = [
        ("dpo_4x1024", "dpo", 4, 1024, BIG),
        ("simpo_4x1024", "simpo", 4, 1024, BIG),
        ("orpo_4x1024", "orpo", 4, 1024, BIG),
        ("dpo_1x16384", "dpo", 1, 16384, BIG),
        ("dpo_4x1024_small", "dpo", 4, 1024, SMALL),
    ]
    if args.quick:
        main_cases = main_cases[:3] + main_cases[4:]
    if args.cases:
        wanted = args.cases.split(",")
        main_cases = [c for c in main_cases if c[0] in wanted]
    for case, loss, pairs, seq, shape in main_cases:
        rows += run_case("preference", case, loss, pairs, seq, shape["H"], shape["V"], warmup=warmup, rep=rep)
    write_results("preference", rows)
    if args.cases:
        return

    sweep_rows = []
    lengths = [512, 2048, 8192] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    for seq in lengths:
        sweep_rows += run_case("preference_sweep", f"dpo_1x{seq}", "dpo", 1, seq, BIG["H"], BIG["V"],
                               warmup=warmup, rep=rep)
    write_results("preference_sweep", sweep_rows, plot_x="seq_len")


if __name__ == "__main__":
    main()
