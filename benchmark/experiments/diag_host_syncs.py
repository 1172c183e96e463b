"""Experiment (GPU): where each host-device synchronization of a fused loss's forward + backward
comes from.

Question: ``tests/chunked/test_grpo.py::test_gpu_bf16_and_host_syncs`` expects one host sync (the
labels' scan) per GRPO call; which Python lines make the others?

Runs each case once to warm up, then once under ``torch.cuda.set_sync_debug_mode("warn")`` and prints
the Python stack (library frames only) of every synchronization warning.

Status: diagnostic; run when a host-sync test fails.

    python -m benchmark.experiments.diag_host_syncs
"""

from __future__ import annotations

import traceback
import warnings

import torch

CASES = {
    "grpo-dapo": dict(loss_type="dapo"),
    "grpo-dapo-entropy-bonus": dict(loss_type="dapo", entropy_coef=0.1),
    "grpo-gspo": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "grpo-grpo": dict(loss_type="grpo"),
    "grpo-bnpo": dict(loss_type="bnpo"),
}


def _inputs(B=4, T=8, H=32, V=96, seed=22):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g).cuda().requires_grad_()
    h = torch.randn(B, T, H, generator=g).cuda().requires_grad_()
    b = torch.randn(V, generator=g).cuda()
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[1, 4:] = -100
    labels = labels.cuda()
    adv = torch.randn(B, generator=g).cuda()
    return w, h, b, labels, adv


def sync_stacks(fn) -> list[str]:
    stacks = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "liger_losses" in f.filename]
            stacks.append(str(message).splitlines()[0] + "\n" + "".join(traceback.format_list(frames[-6:])))

    torch.cuda.synchronize()
    old = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old
    return stacks


def main():
    from liger_losses.chunked.grpo import fused_linear_grpo_loss

    for name, options in CASES.items():
        w, h, b, labels, adv = _inputs()

        def step():
            out = fused_linear_grpo_loss(w, h, None, labels, bias=b, advantages=adv, **options)
            out.loss.backward()

        step()
        stacks = sync_stacks(step)
        print(f"=== {name}: {len(stacks)} host syncs")
        for s in stacks:
            print(s)


if __name__ == "__main__":
    main()
