"""Gated MLP forward + backward: the fused tail ``down_proj(act(gate) * up)`` vs unfused, liger, torch.

Speed, peak memory and accuracy of a whole gated MLP with and without the fused tail of
:mod:`liger_losses.kernels.gated_down`.

What is timed (one "full" step, bf16): ``gate = x @ Wg.T``, ``up = x @ Wu.T`` (``F.linear``, so
gate/up are owned intermediates and in-place backward is allowed), the tail below, and the gradients
of ``x [N, H]``, ``Wg [I, H]``, ``Wu [I, H]``, ``Wd [H, I]`` for an upstream ``d_out [N, H]``
(``torch.autograd.grad``: fresh gradients each run, nothing accumulates). Inputs, weights and
``d_out`` are made before the measurement, so peak memory is what one step allocates above them.

Providers (``act`` = silu by default; ``--act gelu_tanh`` / ``gelu`` for GeGLU):
    unfused     ``F.linear(swiglu(gate, up, inplace_backward=True), Wd)`` (liger_losses' patched-model
                path; ``geglu(..., approximate=...)`` for the GELUs): ``act(gate) * up`` [N, I] is
                stored whole for down_proj's backward
    fused-2^k   ``gated_down_proj(gate, up, Wd, activation=act, inplace_backward=True)`` with
                ``gated_down={"chunk_elems": 2^k, "forward_chunk_elems": 2^k}`` (k = 24, 25, 26; ``--chunk-elems``
                overrides): forward in token chunks, backward in intermediate-column blocks, never the whole product
    liger       liger-kernel 0.8.5 ``LigerSiLUMulFunction`` / ``LigerGELUMulFunction`` (tanh only)
                then ``F.linear``; skipped with a note when not importable
    torch       ``F.linear(F.silu(gate) * up, Wd)`` (eager, as in Hugging Face's MLPs)

Shapes (N tokens, H hidden, I intermediate): llama1b-16k (16384, 2048, 8192), llama1b-32k
(32768, 2048, 8192), llama8b-8k (8192, 4096, 14336), llama8b-16k (16384, 4096, 14336); ``--quick``
runs the first two.

Floors: time = the 9 GEMMs (3 forward, 6 backward, ``2 N H I`` FLOPs each) = ``18 N H I`` FLOPs at
790 TFLOP/s (the pointwise work is not counted). Memory = what a step must hold if it does not
recompute the projections: ``out`` and ``d_x`` (``2 N H``), the three weight gradients (``3 H I``)
and the saved ``gate`` and ``up`` (``2 N I``, reused for their gradients in place), bf16.
Reported per (shape, provider): ms (median of ``triton.testing.do_bench``), ms / floor, time ratio
vs ``unfused`` and vs ``liger``, peak MiB, peak ratio vs ``unfused`` and vs ``liger``.

Accuracy (first shape only): relative error ``||y - ref|| / ||ref||`` of ``out``, ``d_x``, ``d_Wg``,
``d_Wu``, ``d_Wd`` of every provider against a float64 reference computed (on the GPU) from the
same bf16 inputs: fused must be as exact as unfused.

Usage (GPU): ``python -m benchmark.bench_mlp_tail [--quick] [--act silu|gelu_tanh|gelu]
[--chunk-elems 2^24,2^25,2^26] [--shapes NAME,...] [--providers NAME,...]`` (results in $BENCH_OUT
or benchmark/results/: mlp_tail.csv/png, mlp_tail_accuracy.csv).
CPU smoke test: ``python -m benchmark.bench_mlp_tail --tiny`` (N=192, H=32, I=600, fp32, Triton
interpreter, one timed call with ``time.perf_counter``, no memory figures, nothing written).
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

if not torch.cuda.is_available():  # before liger_losses (hence triton's jit) is imported: CPU smoke runs
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from benchmark.common import (  # noqa: E402
    MIB,
    Row,
    gemm_floor_ms,
    measure,
    print_table,
    randn,
    write_results,
)

BENCH = "mlp_tail"

SHAPES = {  # name: (N tokens, H hidden, I intermediate)
    "llama1b-16k": (16384, 2048, 8192),
    "llama1b-32k": (32768, 2048, 8192),
    "llama8b-8k": (8192, 4096, 14336),
    "llama8b-16k": (16384, 4096, 14336),
}
QUICK_SHAPES = ("llama1b-16k", "llama1b-32k")
# Tiny: gated_down aligns chunks to 64 rows and blocks to 256 columns, so N=192, I=600 gives 3 token
# chunks and 3 column blocks at chunk_elems=2^10, 1 chunk and 2 blocks at 2^17.
TINY_SHAPE = ("tiny", (192, 32, 600))
CHUNK_ELEMS = (2**24, 2**25, 2**26)
TINY_CHUNK_ELEMS = (2**10, 2**17)
ACTS = ("silu", "gelu_tanh", "gelu")


# ----------------------------------------------------------------------------- providers


def chunk_label(v: int) -> str:
    k = int(round(math.log2(v))) if v > 0 else 0
    return f"2^{k}" if 2**k == v else str(v)


def parse_chunk_elems(text: str) -> tuple:
    """``"2^24,2**25,67108864"`` -> ``(16777216, 33554432, 67108864)``."""
    out = []
    for item in text.split(","):
        item = item.strip().replace("**", "^")
        base, _, exp = item.partition("^")
        out.append(int(base) ** int(exp) if exp else int(base))
    return tuple(out)


def _liger(act):
    if act == "gelu":
        print("(liger skipped: liger-kernel's GELU-mul is tanh-approximated only)")
        return None
    try:
        if act == "silu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return LigerSiLUMulFunction.apply
        from liger_kernel.ops.geglu import LigerGELUMulFunction

        return LigerGELUMulFunction.apply
    except Exception as exc:  # noqa: BLE001 - a missing peer must not stop the table
        print(f"(liger skipped: liger-kernel not importable: {type(exc).__name__}: {exc})")
        return None


def torch_act(act):
    if act == "silu":
        return F.silu
    return lambda g: F.gelu(g, approximate="tanh" if act == "gelu_tanh" else "none")


def providers(act: str, chunk_elems: tuple) -> dict:
    """name -> ``tail(gate, up, weight) -> out``; a fused provider's ``gated_down`` knobs are in its
    ``gated_down_knobs`` attribute, which :func:`make_step` applies around the forward and backward."""
    import liger_losses.kernels.gated_down as gd

    if act == "silu":
        from liger_losses.kernels.swiglu import swiglu

        def unfused(g, u, w):
            return F.linear(swiglu(g, u, inplace_backward=True, impl="triton"), w)
    else:
        from liger_losses.kernels.geglu import geglu

        approximate = "tanh" if act == "gelu_tanh" else "none"

        def unfused(g, u, w):
            return F.linear(geglu(g, u, approximate=approximate, inplace_backward=True, impl="triton"), w)

    def fused(chunk, forward_chunk):
        def tail(g, u, w):
            return gd.gated_down_proj(g, u, w, activation=act, inplace_backward=True, impl="triton")

        tail.gated_down_knobs = {"chunk_elems": chunk, "forward_chunk_elems": forward_chunk}
        return tail

    provs = {"unfused": unfused}
    for v in chunk_elems:
        provs[f"fused-{chunk_label(v)}"] = fused(v, v)
    # backward blocks at the default, forward in one chunk
    provs["fused-fwd-whole"] = fused(gd.GatedDownTuning().chunk_elems, 1 << 62)
    lig = _liger(act)
    if lig is not None:
        provs["liger"] = lambda g, u, w: F.linear(lig(g, u), w)
    fn = torch_act(act)
    provs["torch"] = lambda g, u, w: F.linear(fn(g) * u, w)
    return provs


# ----------------------------------------------------------------------------- one step


def make_inputs(N, H, I, *, device, dtype):
    """x [N, H], Wg [I, H], Wu [I, H], Wd [H, I] (leaves, requires_grad, scaled like a trained
    layer so activations are O(1)) and d_out [N, H]."""

    def leaf(*shape, scale=1.0):
        t = randn(*shape, device=device, dtype=torch.float32)
        return (t * scale).to(dtype).requires_grad_()

    x = leaf(N, H)
    wg = leaf(I, H, scale=H**-0.5)
    wu = leaf(I, H, scale=H**-0.5)
    wd = leaf(H, I, scale=I**-0.5)
    d_out = randn(N, H, device=device, dtype=torch.float32).to(dtype)
    return x, wg, wu, wd, d_out


MODES = ("full", "forward", "nograd", "ckpt")


def make_step(tail, x, wg, wu, wd, d_out, mode="full"):
    """One timed call of the whole MLP. ``full``: forward + backward, returns
    ``(out, (d_x, d_Wg, d_Wu, d_Wd))`` so that the measured peak includes the output and the
    gradients; ``forward``: the forward with autograd recording (what a training step's forward
    costs); ``nograd``: the forward under ``torch.no_grad`` (gradient checkpointing's first pass);
    ``ckpt``: ``nograd`` then ``full`` (one checkpointed layer's MLP in a training step).
    The tail's ``gated_down_knobs`` (if any) hold for the whole call: the backward reads them too."""
    step = _make_step(tail, x, wg, wu, wd, d_out, mode)
    knobs = getattr(tail, "gated_down_knobs", None)
    if not knobs:
        return step
    from liger_losses.kernels.gated_down import GATED_DOWN_TUNING

    def tuned():
        with GATED_DOWN_TUNING.override(**knobs):
            return step()

    return tuned


def _make_step(tail, x, wg, wu, wd, d_out, mode):

    def mlp():
        return tail(F.linear(x, wg), F.linear(x, wu), wd)

    def step():
        out = mlp()
        grads = torch.autograd.grad(out, (x, wg, wu, wd), d_out)
        return out.detach(), grads

    if mode == "full":
        return step
    if mode == "forward":
        return mlp

    def nograd():
        with torch.no_grad():
            return mlp()

    if mode == "nograd":
        return nograd

    def ckpt():
        nograd()
        return step()

    return ckpt


def floors(N, H, I):
    """(time floor ms, memory floor MiB), see the module docstring."""
    return gemm_floor_ms(18.0 * N * H * I), (2 * N * H + 3 * H * I + 2 * N * I) * 2 / MIB


def add_ratios(rows: list) -> None:
    """``time_vs_<p>`` / ``peak_vs_<p>`` for p in (unfused, liger), per case, into each row's extra."""
    by_case: dict = {}
    for r in rows:
        by_case.setdefault((r.case, r.mode), {})[r.provider] = r
    for r in rows:
        for base in ("unfused", "liger"):
            b = by_case[(r.case, r.mode)].get(base)
            for key, attr in (("time", "ms"), ("peak", "peak_mib")):
                num = getattr(r, attr)
                den = getattr(b, attr) if b is not None else float("nan")
                ok = num == num and den == den and den > 0
                r.extra[f"{key}_vs_{base}"] = round(num / den, 3) if ok else ""


SUMMARY_KEYS = ["case", "mode", "provider", "ms", "time_over_floor", "time_vs_unfused", "time_vs_liger", "peak_mib",
                "peak_over_floor", "peak_vs_unfused", "peak_vs_liger", "error"]
ACCURACY_KEYS = ["case", "provider", "err_out", "err_dx", "err_dWg", "err_dWu", "err_dWd", "error"]


def bench_case(rows, shape_name, shape, provs, act, *, rep, tiny=False, modes=("full",)):
    N, H, I = shape
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    floor_ms, floor_mib = floors(N, H, I)
    case = f"{act} {shape_name} N={N} H={H} I={I}"
    inputs = make_inputs(N, H, I, device=device, dtype=dtype)
    for mode, (name, tail) in ((m, p) for m in modes for p in provs.items()):
        step = make_step(tail, *inputs, mode=mode)
        if tiny:
            try:
                step()  # warm-up (interpreter set-up)
                t0 = time.perf_counter()
                step()
                ms, mib, err = (time.perf_counter() - t0) * 1e3, float("nan"), None
            except Exception as exc:  # noqa: BLE001
                ms, mib, err = float("nan"), float("nan"), f"{type(exc).__name__}: {str(exc)[:120]}"
        else:
            m = measure(step, warmup=25, rep=rep)
            ms, mib, err = m.ms, m.peak_mib, m.error
        extra = {"act": act, "tokens": N, "hidden": H, "intermediate": I}
        rows.append(Row(BENCH, case, mode, name, ms, mib, floor_ms, floor_mib, extra, err))
        print(f"{case} | {mode} | {name}: {ms:.3f} ms, {mib:.0f} MiB peak" + (f" [{err}]" if err else ""), flush=True)
    del inputs
    if not tiny:
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- accuracy


def accuracy_rows(shape_name, shape, provs, act, *, tiny=False) -> list:
    """Relative errors of out and the four gradients against float64 on the same inputs."""
    N, H, I = shape
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    case = f"{act} {shape_name} N={N} H={H} I={I}"
    inputs = make_inputs(N, H, I, device=device, dtype=dtype)
    x, wg, wu, wd, d_out = inputs
    leaves64 = [t.detach().double().requires_grad_() for t in (x, wg, wu, wd)]
    x64, wg64, wu64, wd64 = leaves64
    out64 = F.linear(torch_act(act)(F.linear(x64, wg64)) * F.linear(x64, wu64), wd64)
    ref = (out64.detach(), *torch.autograd.grad(out64, leaves64, d_out.double()))
    del out64, leaves64, x64, wg64, wu64, wd64

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    rows = []
    names = ("err_out", "err_dx", "err_dWg", "err_dWu", "err_dWd")
    for name, tail in provs.items():
        extra = {"act": act, "tokens": N, "hidden": H, "intermediate": I}
        err = None
        try:
            out, grads = make_step(tail, *inputs)()
            for key, got, want in zip(names, (out, *grads), ref):
                extra[key] = f"{rel(got, want):.3e}"
            del out, grads
        except Exception as exc:  # noqa: BLE001
            err = f"{type(exc).__name__}: {str(exc)[:120]}"
        rows.append(Row(BENCH + "_accuracy", case, "accuracy", name, float("nan"), float("nan"),
                        extra=extra, error=err))
    del ref, inputs
    if not tiny:
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_SHAPES)}; fewer repetitions")
    ap.add_argument("--act", default="silu", choices=ACTS, help="activation of the gate (default silu)")
    ap.add_argument("--chunk-elems", default=None,
                    help="comma-separated chunk_elems values for the fused providers, e.g. 2^24,2^25,2^26")
    ap.add_argument("--shapes", default=None, help=f"comma-separated subset of {', '.join(SHAPES)}")
    ap.add_argument("--providers", default=None,
                    help="comma-separated subset of unfused, fused-2^k, liger, torch")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the float64 accuracy table")
    ap.add_argument("--modes", default="full",
                    help=f"comma-separated subset of {', '.join(MODES)} (default full; the floors are full's)")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke test: N=192 H=32 I=600 fp32, Triton interpreter without CUDA, one timed call")
    args = ap.parse_args()

    tiny = args.tiny
    if not tiny and not torch.cuda.is_available():
        raise SystemExit("bench_mlp_tail needs a CUDA GPU (or --tiny for a CPU smoke test)")
    if args.chunk_elems:
        chunk_elems = parse_chunk_elems(args.chunk_elems)
    else:
        chunk_elems = TINY_CHUNK_ELEMS if tiny else CHUNK_ELEMS
    provs = providers(args.act, chunk_elems)
    if args.providers:
        wanted = args.providers.split(",")
        unknown = [p for p in wanted if p not in provs]
        if unknown:
            print(f"(unknown or unavailable providers ignored: {', '.join(unknown)})")
        provs = {k: v for k, v in provs.items() if k in wanted}

    if tiny:
        shapes = [TINY_SHAPE]
    else:
        names = args.shapes.split(",") if args.shapes else (QUICK_SHAPES if args.quick else tuple(SHAPES))
        shapes = [(n, SHAPES[n]) for n in names]
    rep = 200 if args.quick else 400  # ms of timed runs for do_bench: >= 10 runs of the 8B steps

    rows: list[Row] = []
    for shape_name, shape in shapes:
        bench_case(rows, shape_name, shape, provs, args.act, rep=rep, tiny=tiny, modes=args.modes.split(","))
    add_ratios(rows)
    if tiny:
        print_table([r.as_dict() for r in rows], keys=SUMMARY_KEYS)
    else:
        write_results(BENCH, rows)
        print("\nratios (time and peak) vs unfused and vs liger:")
        print_table([r.as_dict() for r in rows], keys=SUMMARY_KEYS)

    if not args.no_accuracy:
        acc = accuracy_rows(*shapes[0], provs, args.act, tiny=tiny)
        print("\naccuracy vs float64 (||y - ref|| / ||ref||):")
        if not tiny:
            write_results(BENCH + "_accuracy", acc)
        print_table([r.as_dict() for r in acc], keys=ACCURACY_KEYS)


if __name__ == "__main__":
    main()
