"""Diagnostic (GPU): registers, spills and time of the cross-entropy tile kernel per (block, warps),
beside liger-kernel 0.8.5's kernel, on 8192 x 128256 bf16 logits (forward + backward, eager do_bench).

Why a row's second pass hits or misses L2 depends on how many rows run at once per SM, which the
kernel's register count decides; this prints it. Output of the session-3 runs:
``benchmark/results/session3/logs/ce_registers.log``.

    python benchmark/diag_ce_registers.py [--configs 4096x8 32768x32 4096x8x3x3 ...]

A config is BLOCKxWARPS[xPASS1_STAGESxPASS2_STAGES] (logits_tile's module knobs; stages 0: default).
``--kernel divergence``: the distillation tile kernel instead, configs BLOCKxWARPS[xSTAGES[xLANE]]
(divergence_tile's BLOCK_CAP / NUM_WARPS / LOOP_STAGES / LANE_SUMS 0|1), CUDA-graph timed.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from liger_losses.kernels import logits_tile as lt  # noqa: E402
from liger_losses.kernels.cross_entropy import cross_entropy  # noqa: E402


def compiled_kernels(kernel) -> list:
    """The CompiledKernels triton holds for a kernel (a launch.FastKernel is unwrapped), whichever
    launch path compiled them."""
    jit_fn = getattr(kernel, "jit_fn", kernel)
    return [ck for caches in jit_fn.device_caches.values() for ck in caches[0].values()]


def divergence(configs: list) -> None:
    """The distillation tile kernel (JSD, beta 0.5, gradient written into the student tile) on
    8192 x 128256 bf16 student / teacher logits per BLOCKxWARPS[xSTAGES[xLANE_SUMS]] config,
    CUDA-graph timed (GPU time) minus the copy that restores the student tile before each call."""
    from benchmark.common import measure
    from liger_losses.kernels import divergence_tile as dt

    os.environ["BENCH_GRAPH"] = "1"
    N, V = 8192, 128256
    base = torch.randn(N, V, device="cuda", dtype=torch.bfloat16) * 2
    teacher = torch.randn(N, V, device="cuda", dtype=torch.bfloat16) * 2
    work = base.clone()
    scale = torch.full((N,), 1.0 / N, device="cuda")
    copy_ms = measure(lambda: work.copy_(base), warmup=5, rep=50).ms
    print(f"student restore copy {copy_ms:.3f} ms (subtracted); memory floor of the kernel "
          f"{N * V * 2 * 5 / 4.3e12 * 1e3:.3f} ms (read student and teacher twice, write the gradient)")

    def step():
        work.copy_(base)
        return dt.divergence_tile(work, teacher, divergence="jsd", beta=0.5, grad_scale=scale, check_inputs=False)

    defaults = dt.BLOCK_CAP, dt.NUM_WARPS, dt.LOOP_STAGES, dt.LANE_SUMS
    for cfg in configs:
        block, warps, stages, lane = ([int(v) for v in cfg.split("x")] + [0, 0])[:4]
        dt.BLOCK_CAP, dt.NUM_WARPS, dt.LOOP_STAGES, dt.LANE_SUMS = block, warps, stages or None, bool(lane)
        before = {id(ck) for ck in compiled_kernels(dt._divergence_tile_kernel)}
        ms = measure(step, warmup=5, rep=50).ms - copy_ms
        for ck in compiled_kernels(dt._divergence_tile_kernel):
            if id(ck) not in before:
                print(f"divergence {cfg}: regs {ck.n_regs} spills {ck.n_spills} smem {ck.metadata.shared}")
        print(f"  {ms:.3f} ms", flush=True)
    dt.BLOCK_CAP, dt.NUM_WARPS, dt.LOOP_STAGES, dt.LANE_SUMS = defaults


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=["4096x8", "2048x4", "1024x4", "32768x32"])
    ap.add_argument("--kernel", choices=("ce", "divergence"), default="ce",
                    help="divergence: the distillation tile kernel (JSD, gradient written), CUDA-graph timed")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_ce_registers: needs a CUDA GPU")
        return
    if args.kernel == "divergence":
        divergence(args.configs)
        return
    N, V = 8192, 128256
    x = torch.randn(N, V, device="cuda", dtype=torch.bfloat16) * 2
    y = torch.randint(0, V, (N,), device="cuda")
    y[::10] = -100

    def step(loss_fn):
        leaf = x.detach().requires_grad_()
        return torch.autograd.grad(loss_fn(leaf, y), (leaf,))

    def timed(fn):  # eager: the labels check of this path syncs, which a CUDA graph cannot hold
        return triton.testing.do_bench(fn, warmup=5, rep=50)

    for cfg in args.configs:
        # BLOCKxWARPS[xSTAGES1[xSTAGES2]]: stages 0 = Triton's default loop (None)
        block, warps, s1, s2 = ([int(v) for v in cfg.split("x")] + [0, 0])[:4]
        lt.BLOCK_CAP, lt.NUM_WARPS = block, warps
        lt.PASS1_STAGES, lt.PASS2_STAGES = s1 or None, s2 or None
        before = {id(ck) for ck in compiled_kernels(lt._logits_tile_kernel)}
        step(cross_entropy)
        step(cross_entropy)
        for ck in compiled_kernels(lt._logits_tile_kernel):
            if id(ck) not in before:
                print(f"ours {cfg}: regs {ck.n_regs} spills {ck.n_spills} "
                      f"smem {ck.metadata.shared}", flush=True)
        print(f"  {timed(lambda: step(cross_entropy)):.3f} ms", flush=True)
    try:
        from liger_kernel.ops import cross_entropy as lce
        from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss
    except Exception as exc:  # noqa: BLE001
        print(f"(liger-kernel unavailable: {exc})")
        return
    mod = LigerCrossEntropyLoss()
    step(mod)
    for ck in compiled_kernels(lce.liger_cross_entropy_kernel):
        print(f"liger: regs {ck.n_regs} spills {ck.n_spills} warps {ck.metadata.num_warps}")
    print(f"  {timed(lambda: step(mod)):.3f} ms")


if __name__ == "__main__":
    main()
