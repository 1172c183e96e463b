"""Experiment (GPU): launch shapes of the two logits-tile kernels, timed alone and in their losses.

Question: each row of a tile is read two (CE) or three (JSD) times. With many programs per SM the
rows in flight (132 SMs x programs x 256 KB at V=128256) far exceed the 50 MB L2, so every pass
streams from HBM. Would fewer programs per SM (more warps, or a register cap that makes the compiler
use more registers instead of spilling) keep more of a row in L2 between passes, or only put fewer
bytes in flight?

Verdict (H200, 2048 x 128256 bf16 tiles, 2 rounds): fewer bytes in flight wins out. JSD divergence
tile: default (4096 / 8 warps) 1.8045 ms; an 80-register cap (3 programs per SM) 1.065x, 96 registers
(2 per SM) 1.245x, 8192 / 16 warps 1.326x, 2048 / 8 1.040x, 2048 / 4 0.994x. CE tile: default (2048 /
4 warps, 3 stages) 0.4082 ms, every alternative 0.996-1.131x. In the fused losses the fastest
alternatives measured 0.966x (JSD, 2048 / 4) and 0.988x (CE, 4096 / 8), inside the runs' spread.

Status: done; the defaults stay. ``maxnreg`` (off by default) remains a knob for this sweep.

Sweeps (block, warps, maxnreg, stages) for

- the JSD divergence tile on ``[2048, V]`` student and teacher bf16 tiles (gradient in place), and
- the CE logits tile on a ``[2048, V]`` bf16 tile (gradient in place),

alternating the configurations over ``--rounds`` (``do_bench`` medians), then times the fused JSD
distillation and CE at 8192 tokens (H=4096) with the default and with each kernel's fastest
configuration.

    python -m benchmark.experiments.diag_tile_occupancy [--rounds 2]
"""

from __future__ import annotations

import argparse

import torch

H, V = 4096, 128256

# (block_cap, num_warps, maxnreg, stages) per kernel; stages: loop_stages (divergence_tile slot) or
# pass1_stages = pass2_stages (logits_tile slot). None entries keep the slot's default (maxnreg: off).
DIVERGENCE = [
    (None, None, None, None),  # default: 4096 / 8 warps, compiler's registers (64, 8-byte spill)
    (4096, 8, 80, None),       # no spill, 3 programs per SM
    (4096, 8, 128, None),      # 96 registers, 2 programs per SM
    (2048, 8, None, None),
    (2048, 4, None, None),
    (8192, 16, 128, None),     # 1-2 programs per SM
    (4096, 8, 80, 2),
]
LOGITS = [
    (None, None, None, None),  # default: 2048 / 4 warps, 3 / 3 stages
    (4096, 8, None, None),
    (8192, 16, None, None),
    (8192, 8, 255, None),
    (2048, 4, None, 2),
    (1024, 4, None, None),
]


def _knobs(cfg, stages_names) -> dict:
    """The knob changes of one (block, warps, maxnreg, stages) configuration."""
    block, warps, maxnreg, stages = cfg
    knobs = {"maxnreg": maxnreg}
    if block is not None:
        knobs["block_cap"] = block
    if warps is not None:
        knobs["num_warps"] = warps
    if stages is not None:
        knobs.update((k, stages) for k in stages_names)
    return knobs


def sweep(name, slot, stages_names, configs, fn, rounds):
    import triton.testing

    res: dict = {}
    for r in range(rounds):
        for cfg in (configs if r % 2 == 0 else configs[::-1]):
            try:
                with slot.override(**_knobs(cfg, stages_names)):
                    fn()
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench(fn, warmup=10, rep=200, return_mode="median")
            except Exception as exc:  # noqa: BLE001 - a configuration that does not compile
                print(f"  {name} {cfg}: {type(exc).__name__}: {str(exc)[:100]}")
                ms = float("inf")
            res.setdefault(cfg, []).append(ms)
    print(f"{name} (block, warps, maxnreg, stages): median ms over {rounds} rounds")
    base = min(res[configs[0]])
    for cfg in configs:
        ms = min(res[cfg])
        print(f"  {str(cfg):28s} {ms:8.4f}  {ms / base:6.3f}x default", flush=True)
    return min(configs, key=lambda c: min(res[c]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", type=int, default=2048)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_tile_occupancy: needs a CUDA GPU")
        return
    import triton.testing

    from benchmark.common import logits_tiles
    from benchmark.experiments.diag_pass_order import fused_steps
    from liger_losses.kernels import divergence_tile as dt
    from liger_losses.kernels import logits_tile as lt

    tile, student, teacher, labels, scale = logits_tiles(args.rows, V)
    best_div = sweep("divergence_tile jsd", dt.DIVERGENCE_TILE_TUNING, ("loop_stages",), DIVERGENCE,
                     lambda: dt.divergence_tile(student, teacher, grad_scale=scale, check_inputs=False),
                     args.rounds)
    best_ce = sweep("logits_tile ce", lt.LOGITS_TILE_TUNING, ("pass1_stages", "pass2_stages"), LOGITS,
                    lambda: lt.logits_tile(tile, labels, grad=True, grad_scale=scale, need_logits_sum=False),
                    args.rounds)
    steps = fused_steps(8192)
    jsd, ce = steps["jsd"], steps["ce"]
    for name, slot, names, best, fn in (
            ("fused JSD 8192", dt.DIVERGENCE_TILE_TUNING, ("loop_stages",), best_div, jsd),
            ("fused CE 8192", lt.LOGITS_TILE_TUNING, ("pass1_stages", "pass2_stages"), best_ce, ce)):
        if best == (None, None, None, None):
            print(f"{name}: the default is fastest alone")
            continue
        res: dict = {}
        for r in range(2 * args.rounds):
            for cfg in ((None, None, None, None), best) if r % 2 == 0 else (best, (None, None, None, None)):
                with slot.override(**_knobs(cfg, names)):
                    fn()
                    torch.cuda.synchronize()
                    res.setdefault(cfg, []).append(
                        triton.testing.do_bench(fn, warmup=5, rep=300, return_mode="median"))
        d, b = sorted(res[(None, None, None, None)]), sorted(res[best])
        print(f"{name}: default {d[len(d) // 2]:.3f} ms, {best} {b[len(b) // 2]:.3f} ms "
              f"({b[len(b) // 2] / d[len(d) // 2]:.3f}x)  all: {d} / {b}", flush=True)


if __name__ == "__main__":
    main()
