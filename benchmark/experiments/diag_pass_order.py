"""Experiment (GPU): does walking the gradient pass from the row's end (knob ``pass2_reversed``) help?

Question: the tile kernels read each row two (cross-entropy) or three (JSD) times. Rows are 256 KB at
V=128256 in bf16 and several programs per SM are in flight, so a later pass mostly misses L2; but
the blocks a pass read last are the likeliest to be still there, so the next pass could start there.

Verdict (H200, 3 alternating rounds, reversed / front to back): CE tile on 2048 x 128256 0.4104 vs
0.4150 ms (0.989), JSD tile 1.7970 vs 1.9251 (0.933), fused CE at 8192 tokens 39.22 vs 40.50 ms
(0.968), fused JSD 62.79 vs 64.15 (0.979). Tile alone at V = 32000-151936: CE 0.961-0.991, JSD
0.928-0.950. CE is bitwise unchanged (the gradient is elementwise); JSD changes its sum's order only.

Status: done; reversed is the default of both tile kernels. ``fused_steps`` here is used by
``diag_tile_occupancy``.

Times, alternating the knob in one process (``--rounds`` rounds, ``do_bench`` medians):

- the CE logits tile kernel alone on a ``[2048, V]`` bf16 tile (gradient in place, as the engine);
- the JSD divergence tile kernel alone on ``[2048, V]`` student and teacher tiles;
- the fused-linear CE and JSD distillation at H=4096, 8192 tokens.

    python -m benchmark.experiments.diag_pass_order [--rounds 3] [--rows 2048] [--vocab 128256] [--no-losses]
"""

from __future__ import annotations

import argparse

import torch

H, V = 4096, 128256


def fused_steps(tokens: int) -> dict:
    """Forward + gradients of the fused-linear CE (``"ce"``) and JSD distillation (``"jsd"``) at
    H=4096, V=128256 on ``tokens`` tokens (``bench_distillation.make_inputs``)."""
    from benchmark.bench_distillation import make_inputs
    from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy
    from liger_losses.chunked.distillation import fused_linear_distillation_loss

    w, h, tw, th, y = make_inputs(tokens, H, V)
    return {
        "ce": lambda: torch.autograd.grad(fused_linear_cross_entropy(w, h, y), (w, h)),
        "jsd": lambda: torch.autograd.grad(
            fused_linear_distillation_loss(w, h, th, y, teacher_weight=tw).loss, (w, h)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--no-losses", action="store_true")
    ap.add_argument("--vocab", type=int, default=V, help="tile width (the fused losses keep 128256)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_pass_order: needs a CUDA GPU")
        return
    import triton.testing

    from benchmark.common import logits_tiles
    from liger_losses.kernels import divergence_tile as dt
    from liger_losses.kernels import logits_tile as lt
    from liger_losses.kernels.tuning import tuning

    tile, student, teacher, labels, scale = logits_tiles(args.rows, args.vocab)
    cases = {
        "logits_tile ce": lambda: lt.logits_tile(tile, labels, grad=True, grad_scale=scale, need_logits_sum=False),
        "divergence_tile jsd": lambda: dt.divergence_tile(student, teacher, grad_scale=scale, check_inputs=False),
    }
    if not args.no_losses:
        steps = fused_steps(8192)
        cases["fused CE 8192"] = steps["ce"]
        cases["fused JSD 8192"] = steps["jsd"]
    results: dict = {}
    for r in range(args.rounds):
        for name, fn in cases.items():
            for rev in ((True, False) if r % 2 == 0 else (False, True)):
                with tuning(logits_tile={"pass2_reversed": rev}, divergence_tile={"pass2_reversed": rev}):
                    fn()
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")
                results.setdefault((name, rev), []).append(ms)
                print(f"round {r} {name:22s} reversed={rev!s:5s} {ms:8.4f} ms", flush=True)
    print("medians over rounds (ms): name, reversed, front-to-back, ratio")
    for name in cases:
        a = sorted(results[(name, True)])[len(results[(name, True)]) // 2]
        b = sorted(results[(name, False)])[len(results[(name, False)]) // 2]
        print(f"  {name:22s} {a:8.4f} {b:8.4f} {a / b:6.3f}")


if __name__ == "__main__":
    main()
