"""Experiment (GPU): RMSNorm / LayerNorm forward and backward at given shapes, ours across the tiling
knobs beside liger-kernel 0.8.5, as CUDA-graph GPU time with the L2 cleared before each replay.

Question: which backward tiling (programs per SM, tile elements, prefetch) and forward tile are
fastest at a given width? It was written when a Llama-3.2-1B SFT step's profile (16384 x 2048 bf16)
showed our RMSNorm backward at 0.168 ms per call against liger-kernel's 0.139.

Verdict (H200, bf16): at 16384 x 2048 the H=4096 tiling ran RMSNorm's backward at 0.157 ms (3.35x the
HBM floor; liger 0.137); 4096-element tiles with two programs per SM: 0.060 ms (1.29x), gradients
bitwise equal -- now the mid-width rule for 1024 < H <= 2048 (knob ``bwd_mid_h``). LayerNorm at that shape:
0.2016 -> 0.0626 ms (4.31x -> 1.34x; liger 0.1635) with the same rule. At 4096 and 8192 x 4096, no
forward warps (2-16), backward warps (4-32) or forward tile (2048-16384) beats the defaults by more
than 2%.

Status: done; re-run when a new width class or GPU is tuned.

Forward = the forward's graph; backward = (forward + backward) - forward, each captured in a CUDA
graph and timed by ``triton.testing.do_bench`` (which clears the L2 between replays: cold inputs, as
in a trainer). Eager timing of these ~50 us autograd calls measures the host instead.

    python -m benchmark.experiments.diag_norm_backward [--kind rms|layer] [--shape 16384x2048 4096x4096]

Prints, per shape: forward and backward ms with their ratios to the HBM floor (forward reads x and
writes y: 4NH bytes; backward reads x and dy and writes dx: 6NH), for liger-kernel, ours with the
defaults, then ours over (programs per SM, backward tile elements, prefetch) -- the generic
backward knobs, with the mid-width rule switched off so that they apply -- and over the forward's
tile elements; each with the relative difference of its gradients to the defaults'.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import os

import torch

from benchmark.common import hbm_floor_ms, time_ms


def fwd_bwd_ms(module, x, dy, ref=None):
    """(forward ms, backward ms, grads, error vs ``ref``): error = the largest relative difference of
    the gradients (x, then the parameters) to ``ref``'s."""
    params = [p for p in module.parameters() if p.requires_grad]

    def forward():
        return module(x)

    def full():
        return torch.autograd.grad(module(x), [x, *params], dy)

    grads = full()
    err = 0.0
    if ref is not None:
        err = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(grads, ref))
    os.environ["BENCH_GRAPH"] = "1"
    fwd = time_ms(forward, warmup=10, rep=50)
    return fwd, time_ms(full, warmup=10, rep=50) - fwd, grads, err


def make_modules(kind: str, H: int):
    """(the kernel's tuning slot, ours, liger-kernel's or an error string) in bf16 on CUDA."""
    mod = importlib.import_module(f"liger_losses.kernels.{'rms_norm' if kind == 'rms' else 'layer_norm'}")
    if kind == "rms":
        ours = mod.LigerRMSNorm(H, eps=1e-6)
    else:
        ours = mod.LigerLayerNorm(H, eps=1e-6)
    ours = ours.cuda().to(torch.bfloat16)
    try:
        if kind == "rms":
            from liger_kernel.transformers.rms_norm import LigerRMSNorm as Theirs
        else:
            from liger_kernel.transformers.layer_norm import LigerLayerNorm as Theirs
        theirs = Theirs(H, eps=1e-6).cuda().to(torch.bfloat16)
    except Exception as exc:  # noqa: BLE001
        theirs = f"{type(exc).__name__}: {exc}"
    slot = mod.RMS_NORM_TUNING if kind == "rms" else mod.LAYER_NORM_TUNING
    return slot, ours, theirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kind", choices=("rms", "layer"), default="rms")
    ap.add_argument("--shape", nargs="+", default=["16384x2048", "4096x4096"])
    ap.add_argument("--sets", nargs="+", default=["bwd", "fwd", "warps"], choices=("bwd", "fwd", "warps"),
                    help="which sweeps: the backward tiling, the forward tile, the warps of either")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_norm_backward: needs a CUDA GPU")
        return
    knobs = ("bwd_programs_per_sm", "bwd_tile_elems", "bwd_prefetch", "bwd_min_rows_per_program", "bwd_mid_h",
             "fwd_tile_elems", "fwd_num_warps", "bwd_num_warps")
    for shape in args.shape:
        N, H = (int(v) for v in shape.split("x"))
        slot, ours, theirs = make_modules(args.kind, H)
        defaults = {k: v for k, v in dataclasses.asdict(slot.current).items() if k in knobs}
        print(f"{args.kind} defaults: {defaults}")
        x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
        dy = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
        f_floor, b_floor = hbm_floor_ms(4 * N * H), hbm_floor_ms(6 * N * H)

        def show(label, fwd, bwd, err=None):
            tail = "" if err is None else f" grads vs defaults {err:.1e}"
            print(f"{shape} {label}: forward {fwd:.4f} ms ({fwd / f_floor:.2f}x), backward {bwd:.4f} ms "
                  f"({bwd / b_floor:.2f}x){tail}", flush=True)

        if isinstance(theirs, str):
            print(f"{shape} liger-kernel: {theirs}")
        else:
            fwd, bwd, _, _ = fwd_bwd_ms(theirs, x, dy)
            show("liger-kernel", fwd, bwd)
        fwd, bwd, ref, _ = fwd_bwd_ms(ours, x, dy)
        show("ours (defaults)", fwd, bwd)
        settings = []
        if "bwd" in args.sets:
            settings += [dict(bwd_mid_h=0, bwd_programs_per_sm=pps, bwd_tile_elems=tile, bwd_prefetch=prefetch)
                         for pps, tile, prefetch in itertools.product((1, 2, 4), (4096, 8192, 16384), (True, False))]
        if "fwd" in args.sets:
            settings += [dict(fwd_tile_elems=tile) for tile in (2048, 8192, 16384)
                         if tile != defaults["fwd_tile_elems"]]
        if "warps" in args.sets:
            settings += [dict(fwd_num_warps=warps) for warps in (2, 4, 8, 16)]
            settings += [dict(fwd_tile_elems=8192, fwd_num_warps=warps) for warps in (4, 8, 16)]
            settings += [dict(bwd_num_warps=warps) for warps in (4, 8, 16, 32)]
        for setting in settings:
            label = "ours " + " ".join(f"{k}={int(v)}" for k, v in setting.items())
            try:
                with slot.override(**setting):
                    fwd, bwd, _, err = fwd_bwd_ms(ours, x, dy, ref)
                show(label, fwd, bwd, err)
            except Exception as exc:  # noqa: BLE001
                print(f"{shape} {label}: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
