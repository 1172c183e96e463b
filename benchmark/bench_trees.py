"""The same loss cases timed on two (or more) checkouts of the library, alternating, to show a refactor changed no
speed: old tree vs new tree, side by side in one run.

Each round runs every tree once, in turn, in a fresh subprocess whose ``PYTHONPATH`` starts with that tree, so each
imports its own ``liger_losses``; only public API is called (``fused_linear_cross_entropy``, the preference losses,
``fused_linear_distillation_loss``), which both sides must share. A subprocess times each case as the loss forward
plus the gradients of hidden and weight (``torch.autograd.grad``), median of ``triton.testing.do_bench``, and peak
memory above the inputs; the parent reports, per case and tree, the median over rounds and the spread
(min..max), and the ratio of each tree's median to the first tree's.

Cases (bf16, H=4096, V=128256 as the loss tables of README.md): ``ce_8192`` (cross-entropy, 8192 tokens),
``dpo_4x1024`` (4 pairs x 1024 tokens, 25% prompt, with a reference), ``simpo_4x1024``, ``orpo_4x1024``,
``jsd_8192`` (distillation from a teacher of the same width), ``dpo_1x16384``; ``ce_8192_frozen``: cross-entropy with
a frozen head (the hidden gradient only, as under LoRA: the frozen-head path).

    python -m benchmark.bench_trees --tree old=/path/to/old/checkout --tree new=. [--rounds 3] [--quick]

Results: ``trees.csv`` via :func:`benchmark.common.write_results` (one row per case and tree, ``ms`` the median
over rounds, ``extra``: ``ms_min``, ``ms_max``, ``ratio`` to the first tree).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

DEVICE = os.environ.get("BENCH_TREES_DEVICE", "cuda")  # "cpu" only to smoke-test the script's plumbing
CASES = ("ce_8192", "dpo_4x1024", "simpo_4x1024", "orpo_4x1024", "jsd_8192", "dpo_1x16384", "ce_8192_frozen")
H, V = 4096, 128256


def _inputs(case):
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(0)
    dev, dt = torch.device(DEVICE), torch.bfloat16
    rows, seq = {"ce_8192": (1, 8192), "ce_8192_frozen": (1, 8192), "jsd_8192": (1, 8192),
                 "dpo_1x16384": (2, 16384)}.get(case, (8, 1024))
    weight = (torch.randn(V, H, device=dev, generator=g) * H**-0.5).to(dt).requires_grad_(not case.endswith("frozen"))
    hidden = torch.randn(rows, seq, H, device=dev, generator=g).to(dt).requires_grad_()
    labels = torch.randint(0, V, (rows, seq), device=dev, generator=g)
    if case.startswith(("dpo", "simpo", "orpo")):
        labels[:, : seq // 4] = -100
    other = (hidden.detach().float() + 0.1 * torch.randn(hidden.shape, device=dev, generator=g)).to(dt)
    return weight, hidden, labels, other


def _loss_fn(case, weight, hidden, labels, other):
    import liger_losses as ll
    from liger_losses.chunked.preference import fused_linear_dpo_loss, fused_linear_orpo_loss, fused_linear_simpo_loss

    if case in ("ce_8192", "ce_8192_frozen"):
        return lambda: ll.fused_linear_cross_entropy(weight, hidden, labels)
    if case.startswith("dpo"):
        return lambda: fused_linear_dpo_loss(weight, hidden, other, labels, beta=0.1).loss
    if case == "simpo_4x1024":
        return lambda: fused_linear_simpo_loss(weight, hidden, labels, beta=2.0, gamma=0.5).loss
    if case == "orpo_4x1024":
        return lambda: fused_linear_orpo_loss(weight, hidden, labels, beta=0.1).loss
    if case == "jsd_8192":
        teacher = (weight.detach().float() + 0.01 * torch_randn_like(weight)).to(weight.dtype)
        return lambda: ll.fused_linear_distillation_loss(weight, hidden, other, labels, teacher_weight=teacher,
                                                         divergence="jsd", beta=0.5).loss
    raise ValueError(case)


def torch_randn_like(t):
    import torch

    return torch.randn(t.shape, device=t.device, generator=torch.Generator(device=t.device).manual_seed(1))


def child(cases, quick):
    """Time ``cases`` with the ``liger_losses`` this process imports; print one JSON line per case."""
    import torch

    import liger_losses

    warmup, rep = (5, 20) if quick else (25, 100)
    for case in cases:
        ms, peak = time_case(case, warmup=warmup, rep=rep)
        print(json.dumps({"case": case, "ms": ms, "peak_mib": peak, "package": liger_losses.__file__}), flush=True)
        torch.cuda.empty_cache()  # the case's tensors died with time_case


def time_case(case, *, warmup, rep):
    """``(median ms, peak MiB above the inputs)`` of one forward + backward of ``case``."""
    import torch
    import triton.testing

    weight, hidden, labels, other = _inputs(case)
    loss = _loss_fn(case, weight, hidden, labels, other)

    inputs = [t for t in (hidden, weight) if t.requires_grad]

    def step():
        return torch.autograd.grad(loss(), inputs)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = triton.testing.do_bench(step, warmup=warmup, rep=rep, return_mode="median")
    return ms, peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH of a checkout (repeat; first = base)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions per timing")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cases = args.cases.split(",")
    if args.child:
        child(cases, args.quick)
        return
    trees = [t.split("=", 1) for t in args.tree]
    times = {(name, c): [] for name, _ in trees for c in cases}
    peaks = {}
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for r in range(args.rounds):
        for name, path in trees:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(path), here,
                                                               os.environ.get("PYTHONPATH", "")]))
            # run as a script, not with -m: -m puts the working directory first on sys.path, ahead of the tree
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--tree", "x=.", "--cases", args.cases]
            if args.quick:
                cmd.append("--quick")
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=here)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"tree {name} failed in round {r}")
            for line in out.stdout.splitlines():
                if line.startswith("{"):
                    rec = json.loads(line)
                    times[(name, rec["case"])].append(rec["ms"])
                    peaks[(name, rec["case"])] = rec["peak_mib"]
                    print(f"round {r} {name:>6} {rec['case']:>14}: {rec['ms']:9.3f} ms {rec['peak_mib']:8.1f} MiB "
                          f"({rec['package']})", flush=True)
    from benchmark.common import Row, write_results

    rows = []
    base_name = trees[0][0]
    print(f"\n{'case':>14} " + " ".join(f"{n:>22}" for n, _ in trees))
    for c in cases:
        base = statistics.median(times[(base_name, c)])
        cells = []
        for name, _ in trees:
            t = times[(name, c)]
            med = statistics.median(t)
            cells.append(f"{med:8.3f} ({med / base:5.3f}x)")
            rows.append(Row("trees", c, "full", name, med, peaks[(name, c)],
                            extra={"ms_min": min(t), "ms_max": max(t), "ratio": med / base, "rounds": len(t)}))
        print(f"{c:>14} " + " ".join(f"{x:>22}" for x in cells))
    write_results("trees", rows)


if __name__ == "__main__":
    main()
