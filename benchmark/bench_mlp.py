"""Speed and memory of the gated MLP activations: SwiGLU ``silu(gate) * up`` and GeGLU
``gelu_tanh(gate) * up`` on ``[tokens, intermediate]`` bf16 tensors (the part between the MLP's
projections), forward / backward / full (forward + backward).

Providers: ``ours`` (liger_losses, fresh gradient tensors), ``ours-inplace`` (``inplace_backward=True``,
the path the MLP modules take: gradients written into gate's/up's buffers), ``hf-torch`` (eager
PyTorch as in transformers' MLPs) and ``liger`` (liger-kernel 0.8.5 ``LigerSiLUMulFunction`` /
``LigerGELUMulFunction``, skipped when not importable).

Floors (HBM, bf16): forward reads gate, up and writes out (3 N I x 2 B); backward reads d_out,
gate, up and writes d_gate, d_up (5 N I x 2 B); full = 8 N I x 2 B. Memory floor: the output
(forward, full); backward's floor is 0 with in-place gradients.

Usage (GPU): python -m benchmark.bench_mlp [--quick]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmark.common import MIB, Row, hbm_floor_ms, measure, randn, write_results
from liger_losses.kernels.geglu import geglu
from liger_losses.kernels.swiglu import swiglu

DEVICE = "cuda"

SHAPES = {  # name: intermediate size
    "llama3-8b": 14336,
    "qwen2-0.5b": 4864,
}


def _liger(op):
    try:
        if op == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return LigerSiLUMulFunction.apply
        from liger_kernel.ops.geglu import LigerGELUMulFunction

        return LigerGELUMulFunction.apply
    except Exception as exc:  # noqa: BLE001
        print(f"(liger-kernel {op} unavailable: {exc})")
        return None


def providers(op):
    if op == "swiglu":
        provs = {
            "ours": lambda a, b: swiglu(a, b, impl="triton"),
            "ours-inplace": lambda a, b: swiglu(a, b, inplace_backward=True, impl="triton"),
            "hf-torch": lambda a, b: F.silu(a) * b,
        }
    else:
        provs = {
            "ours": lambda a, b: geglu(a, b, approximate="tanh", impl="triton"),
            "ours-inplace": lambda a, b: geglu(a, b, approximate="tanh", inplace_backward=True, impl="triton"),
            "hf-torch": lambda a, b: F.gelu(a, approximate="tanh") * b,
        }
    lig = _liger(op)
    if lig is not None:
        provs["liger"] = lig
    return provs


def bench_case(op, shape_name, tokens, modes, rows, rep):
    inter = SHAPES[shape_name]
    elems = tokens * inter
    nbytes = elems * 2
    floors = {"forward": 3 * nbytes, "backward": 5 * nbytes, "full": 8 * nbytes}
    mem_floor = {"forward": nbytes / MIB, "backward": float("nan"), "full": nbytes / MIB}
    case = f"{op} {shape_name} N={tokens}"
    for name, fn in providers(op).items():
        rows += provider_rows(op, case, name, fn, tokens, inter, modes, rep, floors=floors, mem_floor=mem_floor)
        torch.cuda.empty_cache()


def provider_rows(op, case, name, fn, tokens, inter, modes, rep, *, floors, mem_floor):
    """One row per mode for provider ``fn`` on fresh ``[tokens, inter]`` inputs; they die on return."""
    dev, dt = DEVICE, torch.bfloat16
    rows = []
    a_leaf = randn(tokens, inter, device=dev, dtype=dt, requires_grad=True)
    b_leaf = randn(tokens, inter, device=dev, dtype=dt, requires_grad=True)
    # Non-leaf inputs, as projection outputs are in a model (in-place providers need that).
    a, b = a_leaf.clone(), b_leaf.clone()
    grad = randn(tokens, inter, device=dev, dtype=dt)
    for mode in modes:
        if mode == "forward":
            def run():
                with torch.no_grad():
                    return fn(a, b)
        elif mode == "backward":
            if name in ("ours-inplace",):
                rows.append(Row("mlp", case, mode, name, float("nan"), float("nan"),
                                hbm_floor_ms(floors[mode]), mem_floor[mode],
                                extra={"op": op, "tokens": tokens},
                                error="n/a: in-place backward cannot be replayed; see full"))
                continue
            out = fn(a, b)

            def run(out=out):
                return torch.autograd.grad(out, (a, b), grad, retain_graph=True)
        else:
            def run():
                out = fn(a, b)
                return torch.autograd.grad(out, (a, b), grad)
        m = measure(run, rep=rep, graph=mode != "backward")
        rows.append(Row("mlp", case, mode, name, m.ms, m.peak_mib,
                        hbm_floor_ms(floors[mode]), mem_floor[mode],
                        extra={"op": op, "tokens": tokens}, error=m.error))
    return rows


def sweep(ops, rep, tokens=16384):
    """Forward and backward of ours (fresh-gradient path) per kernel setting; prints a table."""
    import importlib

    from benchmark.common import print_table
    from liger_losses.kernels.tuning import tuning

    inter = SHAPES["llama3-8b"]
    nbytes = tokens * inter * 2
    out = []
    # inputs made before any CUDA-graph capture (BENCH_GRAPH=1)
    a = randn(tokens, inter, device=DEVICE, dtype=torch.bfloat16, requires_grad=True).clone()
    b = randn(tokens, inter, device=DEVICE, dtype=torch.bfloat16, requires_grad=True).clone()
    grad = randn(tokens, inter, device=DEVICE, dtype=torch.bfloat16)
    for op in ops:
        importlib.import_module(f"liger_losses.kernels.{op}")  # registers the op's tuning slot
        fn = providers(op)["ours"]
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                with tuning(**{op: {"block_size": block, "num_warps": warps}}):
                    out += setting_rows(op, fn, a, b, grad, block, warps, rep, nbytes)
    print_table(out, keys=list(out[0]))


def setting_rows(op, fn, a, b, grad, block, warps, rep, nbytes):
    """Forward and backward of ``fn`` at one kernel setting; the kept forward output dies on return."""
    out = []
    kept = fn(a, b)
    for mode, run, floor in (
        ("forward", lambda: fn(a.detach(), b.detach()), 3 * nbytes),
        ("backward", lambda: torch.autograd.grad(kept, (a, b), grad, retain_graph=True), 5 * nbytes),
    ):
        m = measure(run, rep=rep)
        out.append(dict(op=op, block=block, warps=warps, mode=mode, ms=round(m.ms, 4),
                        over_floor=round(m.ms / hbm_floor_ms(floor), 3), error=m.error or ""))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one 8B size + the small model, fewer reps")
    parser.add_argument("--ops", default="swiglu,geglu")
    parser.add_argument("--sweep", action="store_true",
                        help="time our kernels at several block_size x num_warps settings (8B shape, 16384 tokens)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mlp needs a CUDA GPU")
    modes = ("forward", "full", "backward")  # full first: see bench_norm.mode_fns
    rep = 30 if args.quick else 100
    sizes = [8192] if args.quick else [4096, 8192, 16384, 32768]
    if args.sweep:
        sweep(args.ops.split(","), rep)
        return
    rows: list[Row] = []
    for op in args.ops.split(","):
        for tokens in sizes:
            bench_case(op, "llama3-8b", tokens, modes, rows, rep)
        bench_case(op, "qwen2-0.5b", 8192, modes, rows, rep)
    write_results("mlp", rows)


if __name__ == "__main__":
    main()
