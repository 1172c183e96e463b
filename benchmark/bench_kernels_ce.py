"""Cross-entropy on given logits, forward + backward ("full"), side by side (issue #2, CE kernel).

Cases: bf16 logits [N, V] for V = 32000, 128256 and N = 4096, 8192 (quick: one case).
Providers: ours (new gradient buffer), ours with inplace_backward=True (timed with the clone that
gives it a fresh non-leaf input each call; the ``clone-only`` row times that clone alone), ours with
the gradient pass front to back (``ours-pass2-forward``: tells whether the reversed pass, chosen for
the engine's tiles, costs the stand-alone kernel; within 1% at V = 128256), plain torch
(F.cross_entropy(logits.float()) as HF does), liger-kernel 0.8.5 LigerCrossEntropyLoss.
Floor: memory-bound, read the logits once and write the gradient once: 2 * N * V * 2 bytes at
4.3 TB/s; memory floor: the gradient, N * V * 2 bytes.

Run on the GPU: ``python -m benchmark.bench_kernels_ce [--quick] [--sweep]`` -- eagerly, as users
call it: liger-kernel reads values back to the host (its captures fail under ``BENCH_GRAPH=1``);
ours does not (it captures), so eager timing also shows what those host waits cost.
At V = 32000 both are bound by the device machine's host time, not the GPU.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmark.common import MIB, Row, hbm_floor_ms, measure, write_results

BENCH = "kernels_ce"


def ours(inplace=False):
    from liger_losses.kernels.cross_entropy import cross_entropy

    return lambda x, y: cross_entropy(x, y, inplace_backward=inplace)


def ours_pass2_forward():
    """Ours with the tile's gradient pass walking each row front to back
    (``logits_tile`` knob ``pass2_reversed=False``, the other order), to tell whether the reversed
    pass costs the stand-alone kernel."""
    from liger_losses.kernels.cross_entropy import cross_entropy
    from liger_losses.kernels.logits_tile import LOGITS_TILE_TUNING

    def loss(x, y):
        with LOGITS_TILE_TUNING.override(pass2_reversed=False):
            return cross_entropy(x, y)

    return loss


def plain_torch():
    return lambda x, y: F.cross_entropy(x.float(), y)


def liger_kernel():
    from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss

    mod = LigerCrossEntropyLoss()
    return lambda x, y: mod(x, y)


def clone_only():
    """Not a loss: the clone that the in-place rows pay per call (subtract it to compare kernels)."""
    return None


PROVIDERS = {
    "clone-only": clone_only,
    "ours": ours,
    "ours-inplace": lambda: ours(True),
    "ours-pass2-forward": ours_pass2_forward,
    "torch": plain_torch,
    "liger-kernel": liger_kernel,
}


def sweep() -> None:
    """Ours at a few (block_cap, num_warps, loop stages, pass2_reversed) settings of the
    ``logits_tile`` tuning slot, 8192 x 128256, full step (GPU-bound since cross_entropy stopped
    synchronising the host), alternating the settings over 3 rounds; liger-kernel as the reference."""
    from benchmark.common import print_table
    from liger_losses.kernels.logits_tile import LOGITS_TILE_TUNING

    N, V = 8192, 128256
    base = torch.randn(N, V, device="cuda", dtype=torch.bfloat16) * 2
    y = torch.randint(0, V, (N,), device="cuda")
    y[::10] = -100
    fn_loss = ours()
    d = LOGITS_TILE_TUNING.current
    settings = [(d.block_cap, d.num_warps, d.pass1_stages, d.pass2_reversed), (2048, 4, 3, False),
                (1024, 4, 3, True), (4096, 8, 3, True), (4096, 8, 2, True), (2048, 8, 3, True),
                (2048, 4, 4, True), (8192, 16, None, True), (32768, 32, None, True), (16384, 16, None, False)]
    times: dict = {s: [] for s in settings}
    errors: dict = {}
    for _ in range(3):
        for st in settings:
            block, warps, stages, rev = st
            knobs = dict(block_cap=block, num_warps=warps, pass1_stages=stages, pass2_stages=stages,
                         pass2_reversed=rev)

            def step():
                leaf = base.detach().requires_grad_()
                loss = fn_loss(leaf, y)
                return torch.autograd.grad(loss, (leaf,))

            with LOGITS_TILE_TUNING.override(**knobs):
                m = measure(step, warmup=5, rep=30)
            times[st].append(m.ms)
            if m.error:
                errors[st] = m.error[:60]
    floor = hbm_floor_ms(2 * N * V * 2)
    results = []
    for st in settings:
        ms = sorted(times[st])[1]
        results.append(dict(block=st[0], warps=st[1], stages=st[2], reversed=st[3], ms=round(ms, 4),
                            over_floor=round(ms / floor, 3), rounds=[round(t, 4) for t in times[st]],
                            error=errors.get(st, "")))
    try:  # liger-kernel in the same process, as the reference
        liger_loss = liger_kernel()

        def liger_step():
            leaf = base.detach().requires_grad_()
            return torch.autograd.grad(liger_loss(leaf, y), (leaf,))

        m = measure(liger_step, warmup=5, rep=30)
        results.append(dict(block="liger-kernel", warps="", stages="", reversed="", ms=round(m.ms, 4),
                            over_floor=round(m.ms / floor, 3), rounds="", error=(m.error or "")[:60]))
    except Exception as exc:  # noqa: BLE001
        print(f"(liger-kernel unavailable: {exc})")
    print_table(results, keys=list(results[0]))


def case_rows(N, V, *, quick):
    """One row per provider of ``PROVIDERS`` for an ``[N, V]`` bf16 logits tile; its tensors die on return."""
    rows = []
    base = torch.randn(N, V, device="cuda", dtype=torch.bfloat16) * 2
    y = torch.randint(0, V, (N,), device="cuda")
    y[::10] = -100
    floor_ms = hbm_floor_ms(2 * N * V * 2)
    floor_mib = N * V * 2 / MIB
    for name, make in PROVIDERS.items():
        try:
            fn_loss = make()
        except Exception as exc:  # noqa: BLE001
            rows.append(Row(BENCH, f"N{N}_V{V}", "full", name, float("nan"), float("nan"),
                            floor_ms, floor_mib, {"N": N, "V": V}, f"unavailable: {exc}"[:160]))
            continue
        inplace = name == "ours-inplace"

        def step(fn_loss=fn_loss, inplace=inplace, name=name):
            if name == "clone-only":
                return base.detach().requires_grad_().clone()
            # the in-place variant destroys its input: give it a fresh non-leaf each call
            leaf = base.detach().requires_grad_()
            x = leaf.clone() if inplace else leaf
            loss = fn_loss(x, y)
            (g,) = torch.autograd.grad(loss, (leaf,))
            return loss, g

        m = measure(step, warmup=5 if quick else 25, rep=20 if quick else 100)
        rows.append(Row(BENCH, f"N{N}_V{V}", "full", name, m.ms, m.peak_mib, floor_ms, floor_mib,
                        {"N": N, "V": V}, m.error))
        print(rows[-1].as_dict(), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="only sweep our kernel's block/warps knobs")
    args = ap.parse_args()
    if args.sweep:
        sweep()
        return
    cases = [(8192, 128256)] if args.quick else [(4096, 32000), (8192, 32000), (4096, 128256), (8192, 128256)]
    rows = []
    for N, V in cases:
        rows += case_rows(N, V, quick=args.quick)
        torch.cuda.empty_cache()
    write_results(BENCH, rows)


if __name__ == "__main__":
    main()
