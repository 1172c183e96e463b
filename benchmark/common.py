"""Shared benchmark plumbing: timing, peak memory above the inputs, floors, CSV and PNG output.

Every benchmark script builds a list of ``Case``s, each with several ``providers`` (ours, plain
PyTorch, liger-kernel, ...), calls :func:`measure` for each and hands the rows to
:func:`write_results`. Times are medians of ``triton.testing.do_bench`` (ms); memory is
``torch.cuda.max_memory_allocated`` minus what was allocated before the call (MiB), i.e. the peak
above the inputs. Floors: ``bytes / 4.3 TB/s`` for memory-bound kernels, ``FLOPs / 790 TFLOP/s``
for GEMM-bound losses (both measured on the H200 this project benchmarks on).
"""

from __future__ import annotations

import contextlib
import csv
import gc
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import torch

HBM_BYTES_PER_S = 4.3e12
BF16_FLOPS_PER_S = 790e12
MIB = 1024.0**2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def results_dir() -> str:
    """Where results go: $OUT on the device machine when set, else benchmark/results/."""
    out = os.environ.get("BENCH_OUT") or os.environ.get("OUT")
    path = out if out else os.path.join(ROOT, "benchmark", "results")
    os.makedirs(path, exist_ok=True)
    return path


def hbm_floor_ms(nbytes: float) -> float:
    return nbytes / HBM_BYTES_PER_S * 1e3


def gemm_floor_ms(flops: float) -> float:
    return flops / BF16_FLOPS_PER_S * 1e3


@dataclass
class Measurement:
    ms: float
    peak_mib: float
    error: Optional[str] = None


def _cleanup():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def graph_mode() -> bool:
    """True when ``BENCH_GRAPH=1``: time GPU work only (see :func:`time_ms`)."""
    return os.environ.get("BENCH_GRAPH", "") not in ("", "0")


FLUSHES = ("zero", "clean", "none")


def flush_mode() -> str:
    """The L2 state before each timed call (``BENCH_FLUSH``, default ``zero``):

    * ``zero``: do_bench's own flush, ``cache.zero_()`` on 256 MB: no input in the L2, but the L2
      full of the flush's dirty lines, whose write-back then falls on the timed call;
    * ``clean``: ``cache.zero_()`` then a read of the buffer: no input in the L2, clean lines only
      (the write-back happens before the timed call);
    * ``none``: no flush (back-to-back calls)."""
    mode = os.environ.get("BENCH_FLUSH", "zero") or "zero"
    if mode not in FLUSHES:
        raise ValueError(f"BENCH_FLUSH must be one of {FLUSHES}, got {mode!r}")
    return mode


@contextlib.contextmanager
def l2_state(mode: str):
    """Within the block, ``triton.testing.do_bench`` leaves the L2 as ``mode`` says before each
    timed call (see :func:`flush_mode`)."""
    import triton.runtime

    driver = triton.runtime.driver.active
    original = driver.clear_cache

    def clean(cache):
        cache.zero_()
        cache.sum()

    driver.clear_cache = {"zero": original, "clean": clean, "none": lambda cache: None}[mode]
    try:
        yield
    finally:
        driver.clear_cache = original


_GEN: dict = {}


def randn(*shape, device="cuda", **kwargs) -> torch.Tensor:
    """``torch.randn`` from a private generator, seeded once (0): a CUDA-graph capture registers
    the default generator, and a failed capture leaves it unusable ("Offset increment outside
    graph capture"); inputs drawn from this one are unaffected."""
    device = torch.device(device)
    if device not in _GEN:
        _GEN[device] = torch.Generator(device=device).manual_seed(0)
    return torch.randn(*shape, device=device, generator=_GEN[device], **kwargs)


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured once in a CUDA graph (after warm-up on a side stream); returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    # "thread_local": the backward runs on autograd's device thread, and the default "global" mode
    # fails a capture when another thread makes a capture-unsafe call meanwhile.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def time_ms(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn`` in ms (CUDA events, L2 flushed between runs by do_bench; other L2
    states with ``BENCH_FLUSH``, see :func:`flush_mode`).

    Eager by default: wall time of the call, so per-call host work (Python, launches) counts
    whenever it exceeds the GPU work. With ``BENCH_GRAPH=1`` the call is captured once in a CUDA
    graph and the graph's replay is timed: the GPU time of the kernels alone, which is what a
    step costs when the host runs ahead of the GPU (as in training a large model).
    """
    import triton.testing

    if graph_mode():
        try:
            fn = graphed(fn)
        except Exception as exc:  # noqa: BLE001 - seen on the first captures of a process; retry once
            print(f"(graph capture failed, retrying once: {type(exc).__name__}: {str(exc)[:80]})")
            torch.cuda.synchronize()
            fn = graphed(fn)
    with l2_state(flush_mode()):
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def peak_mib(fn: Callable[[], object]) -> float:
    """Peak memory allocated by one call of ``fn`` above what was allocated before it (MiB)."""
    _cleanup()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    _cleanup()
    return peak / MIB


GRAPH_SKIP = "not timed with BENCH_GRAPH=1 (a backward of a graph built outside the capture); see full - forward"


def measure(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100, graph: bool = True) -> Measurement:
    """Time and peak memory of ``fn``; an exception (e.g. out of memory) becomes ``error``.

    ``graph=False`` marks a callable that cannot be captured in a CUDA graph (a backward through
    a forward graph recorded outside the capture runs on the forward's streams, which fails the
    capture): with ``BENCH_GRAPH=1`` its time is left out (memory is still measured)."""
    try:
        fn()  # compile / autotune outside the measurement
        torch.cuda.synchronize()
        mem = peak_mib(fn)
        if graph_mode() and not graph:
            return Measurement(float("nan"), mem, GRAPH_SKIP)
        ms = time_ms(fn, warmup=warmup, rep=rep)
        return Measurement(ms, mem)
    except Exception as exc:  # noqa: BLE001 - a provider failing must not stop the table
        _cleanup()
        return Measurement(float("nan"), float("nan"), f"{type(exc).__name__}: {str(exc)[:120]}")


@dataclass
class Row:
    """One line of a results table."""

    bench: str
    case: str
    mode: str  # forward | backward | full
    provider: str
    ms: float
    peak_mib: float
    floor_ms: float = float("nan")
    floor_mib: float = float("nan")
    extra: dict = field(default_factory=dict)
    error: Optional[str] = None

    def as_dict(self) -> dict:
        d = {
            "bench": self.bench,
            "case": self.case,
            "mode": self.mode,
            "provider": self.provider,
            "ms": round(self.ms, 4),
            "peak_mib": round(self.peak_mib, 1),
            "floor_ms": round(self.floor_ms, 4),
            "time_over_floor": (round(self.ms / self.floor_ms, 3)
                                if self.floor_ms == self.floor_ms and self.floor_ms > 0 else ""),
            "floor_mib": round(self.floor_mib, 1),
            "peak_over_floor": (round(self.peak_mib / self.floor_mib, 3)
                                if self.floor_mib == self.floor_mib and self.floor_mib > 0 else ""),
            "error": self.error or "",
        }
        d.update(self.extra)
        return d


def write_results(name: str, rows: list[Row], *, plot_x: Optional[str] = None) -> str:
    """Write ``<name>.csv`` (and ``<name>.png`` if matplotlib is present); print a table."""
    path = results_dir()
    if graph_mode():
        name = f"{name}_graph"
    dicts = [r.as_dict() for r in rows]
    keys: list[str] = []
    for d in dicts:
        for k in d:
            if k not in keys:
                keys.append(k)
    csv_path = os.path.join(path, f"{name}.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(dicts)
    print_table(dicts, keys=["case", "mode", "provider", "ms", "floor_ms", "time_over_floor", "peak_mib", "floor_mib",
                             "peak_over_floor", "error"])
    try:
        plot(name, rows, x=plot_x)
    except Exception as exc:  # noqa: BLE001 - plotting is a convenience
        print(f"(plot skipped: {exc})")
    return csv_path


def print_table(dicts: list[dict], keys: list[str]) -> None:
    keys = [k for k in keys if any(k in d for d in dicts)]
    widths = {k: max(len(k), *(len(str(d.get(k, ""))) for d in dicts)) for k in keys}
    print(" | ".join(k.ljust(widths[k]) for k in keys))
    for d in dicts:
        print(" | ".join(str(d.get(k, "")).ljust(widths[k]) for k in keys))
    sys.stdout.flush()


def plot(name: str, rows: list[Row], *, x: Optional[str] = None, directory: Optional[str] = None) -> None:
    """Bar chart (or line chart over ``extra[x]``) of time and memory per provider and mode, written
    to ``<directory>/<name>.png`` (default :func:`results_dir`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r.mode for r in rows})
    providers = list(dict.fromkeys(r.provider for r in rows))
    fig, axes = plt.subplots(len(modes), 2, figsize=(13, 3.6 * len(modes)), squeeze=False)
    for i, mode in enumerate(modes):
        sub = [r for r in rows if r.mode == mode]
        for j, (metric, label) in enumerate((("ms", "time (ms)"), ("peak_mib", "peak memory (MiB)"))):
            ax = axes[i][j]
            if x is not None:
                for p in providers:
                    pts = sorted((r.extra[x], getattr(r, metric)) for r in sub if r.provider == p and x in r.extra)
                    if pts:
                        ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=p)
                ax.set_xlabel(x)
            else:
                cases = list(dict.fromkeys(r.case for r in sub))
                width = 0.8 / max(1, len(providers))
                for k, p in enumerate(providers):
                    vals = [next((getattr(r, metric) for r in sub if r.case == c and r.provider == p), float("nan"))
                            for c in cases]
                    ax.bar([c + k * width for c in range(len(cases))], vals, width=width, label=p)
                ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))])
                ax.set_xticklabels(cases, rotation=20, ha="right", fontsize=7)
            ax.set_title(f"{name} — {mode} — {label}", fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(directory or results_dir(), f"{name}.png"), dpi=110)
    plt.close(fig)


_ROW_COLUMNS = ("bench", "case", "mode", "provider", "ms", "peak_mib", "floor_ms", "time_over_floor",
                "floor_mib", "peak_over_floor", "error")


def rows_from_csv(path: str) -> list[Row]:
    """The rows of a CSV written by :func:`write_results` (extra columns back into ``extra``)."""

    def num(v):
        try:
            return float(v)
        except (TypeError, ValueError):
            return float("nan")

    rows = []
    with open(path, newline="") as f:
        for d in csv.DictReader(f):
            extra = {k: v for k, v in d.items() if k not in _ROW_COLUMNS}
            for k, v in extra.items():
                extra[k] = num(v) if v not in ("", None) and num(v) == num(v) else v
            rows.append(Row(d["bench"], d["case"], d["mode"], d["provider"], num(d["ms"]), num(d["peak_mib"]),
                            num(d.get("floor_ms")), num(d.get("floor_mib")), extra, d.get("error") or None))
    return rows


# --------------------------------------------------------------------------- fused-linear loss benchmarks


def loss_step(loss_fn: Callable, inputs: tuple) -> Callable[[], tuple]:
    """Forward + backward of ``loss_fn(*inputs)``; gradients of ``inputs[0]`` (the weight) and
    ``inputs[1]`` (the hidden states). Returns ``(loss, grad_weight, grad_hidden)`` so that the
    measured peak includes the gradients."""

    def fn():
        loss = loss_fn(*inputs)
        wanted = [x for x in inputs[:2] if x.requires_grad]  # a frozen weight (LoRA's head) has none
        grads = iter(torch.autograd.grad(loss, wanted))
        gw, gh = (next(grads) if x.requires_grad else None for x in inputs[:2])
        return loss, gw, gh

    return fn


def loss_rows(rows: list, bench: str, case: str, providers: dict, inputs: tuple, *, floor_ms: float,
              floor_mib: float, extra: Optional[dict] = None, quick: bool = False) -> None:
    """Append one ``full`` row per provider (name -> maker of ``loss_fn(*inputs)``) to ``rows``: a
    maker that raises gives an ``unavailable`` row (a missing peer must not stop the table)."""
    for name, make in providers.items():
        try:
            loss_fn = make()
        except Exception as exc:  # noqa: BLE001
            rows.append(Row(bench, case, "full", name, float("nan"), float("nan"), floor_ms, floor_mib,
                            dict(extra or {}), f"unavailable: {type(exc).__name__}: {exc}"[:160]))
            continue
        m = measure(loss_step(loss_fn, inputs), warmup=5 if quick else 25, rep=20 if quick else 100)
        rows.append(Row(bench, case, "full", name, m.ms, m.peak_mib, floor_ms, floor_mib, dict(extra or {}),
                        m.error))
        print(rows[-1].as_dict(), flush=True)


def loss_accuracy_rows(bench: str, case: str, providers: dict, inputs: tuple, ref: tuple,
                       extra: dict) -> list:
    """Per provider, relative errors ``||out - ref|| / ||ref||`` of the loss, grad_hidden and
    grad_weight against ``ref`` = ``(loss, grad_weight, grad_hidden)`` in float64."""
    ref_loss, ref_gw, ref_gh = ref

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    rows = []
    for name, make in providers.items():
        row_extra = dict(extra)
        try:
            loss, gw, gh = loss_step(make(), inputs)()
            row_extra.update(err_loss=rel(loss.detach(), ref_loss.detach()), err_grad_hidden=rel(gh, ref_gh),
                             err_grad_weight=rel(gw, ref_gw))
            err = None
        except Exception as exc:  # noqa: BLE001
            err = f"{type(exc).__name__}: {str(exc)[:120]}"
        rows.append(Row(bench + "_accuracy", case, "accuracy", name, float("nan"), float("nan"),
                        extra=row_extra, error=err))
        print(rows[-1].as_dict(), flush=True)
    return rows


# --------------------------------------------------------------------------- practical GEMM floor


class _GemmsOnly(torch.autograd.Function):
    """The GEMMs of a one-pass chunked loss and nothing else (no softmax, no loss): per chunk of
    rows, the logits ``h @ W.T``, the hidden gradient ``logits @ W`` and the weight gradient
    ``logits.T @ h`` (accumulated with ``beta=1`` after the first chunk), plus one logits GEMM of
    the reference / teacher rows when given. The gradients are returned by the backward."""

    @staticmethod
    def forward(ctx, weight, hidden, index, extra_hidden, extra_weight, chunks):
        w = weight.detach()
        flat = hidden.detach().reshape(-1, w.shape[1])
        rows = flat if index is None else flat.index_select(0, index)
        frozen = not weight.requires_grad
        grad_w = None if frozen else torch.empty_like(w)
        grad_rows = torch.empty_like(rows)
        extra = None
        if extra_hidden is not None:
            extra = extra_hidden.detach().reshape(-1, w.shape[1])
            extra = extra if index is None else extra.index_select(0, index)
        for i, (s, e) in enumerate(chunks):
            if extra is not None:
                torch.mm(extra[s:e], extra_weight.t())  # the reference / teacher logits, dropped
            logits = rows[s:e] @ w.t()
            torch.mm(logits, w, out=grad_rows[s:e])
            if not frozen:  # a frozen head has no weight-gradient GEMM
                grad_w.addmm_(logits.t(), rows[s:e], beta=float(i > 0))
            del logits
        if index is None:
            grad_h = grad_rows.view_as(hidden)
        else:
            grad_h = torch.zeros_like(flat).index_copy_(0, index, grad_rows).view_as(hidden)
        ctx.grads = grad_w, grad_h
        return hidden.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        grad_w, grad_h = ctx.grads
        return grad_w, grad_h, None, None, None, None


def gemms_only(weight, hidden, *, valid=None, extra_hidden=None, extra_weight=None, chunk_tokens=None):
    """The practical floor of a chunked loss that calls cuBLAS: its GEMMs alone (see
    :class:`_GemmsOnly`), on the rows where ``valid`` (``[...]`` bool, default all), in the chunks
    our engine would use for this head (``chunked.planning.token_chunks``; ``chunk_tokens`` fixes their
    size). Timed in the same run as the losses, it carries the same clocks: under the H200's power cap the GEMMs alone
    run well below the nominal 790 TFLOP/s of the floor."""
    from liger_losses.chunked.gemm import itemsize
    from liger_losses.chunked.planning import token_chunks

    index = None
    n = hidden.numel() // hidden.shape[-1]
    if valid is not None:
        index = valid.reshape(-1).nonzero().squeeze(1)
        n = int(index.numel())
    chunks = token_chunks(weight.shape[0], weight.shape[1], itemsize(weight.dtype), n, chunk_tokens)
    return _GemmsOnly.apply(weight, hidden, index, extra_hidden,
                            extra_weight if extra_weight is not None else weight, chunks)


class TileInputs(NamedTuple):
    tile: torch.Tensor
    student: torch.Tensor
    teacher: torch.Tensor
    labels: torch.Tensor
    scale: torch.Tensor


def logits_tiles(rows: int, vocab: int, *, seed: int = 0) -> TileInputs:
    """Inputs of the tile-kernel diagnostics on the GPU: bf16 ``[rows, vocab]`` logits-like tiles
    (N(0, 4)) ``tile``, ``student``, ``teacher``; ``labels [rows]``; fp32 ``scale [rows] = 1/rows``."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def logits():
        return (torch.randn(rows, vocab, device="cuda", generator=g) * 2).bfloat16()

    return TileInputs(logits(), logits(), logits(), torch.randint(0, vocab, (rows,), device="cuda", generator=g),
                      torch.full((rows,), 1.0 / rows, device="cuda"))


class Smi:
    """``nvidia-smi`` sampling (SM clock, power, temperature, throttle reasons) every 100 ms in the
    background into ``path``; ``mark(name)`` opens a phase, ``summary()`` stops and prints each
    phase's mean SM clock and power."""

    def __init__(self, path):
        self.path, self.marks = path, []
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi",
                 "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                 "--format=csv,noheader,nounits", "-lms", "100"], stdout=open(path, "w"), stderr=subprocess.DEVNULL)
        except OSError:
            self.proc = None

    def mark(self, name):
        self.marks.append((time.time(), name))

    def summary(self):
        if self.proc is None:
            return
        self.proc.terminate()
        self.proc.wait()
        rows = []
        for r in csv.reader(open(self.path)):
            try:
                t = time.mktime(time.strptime(r[0].strip().split(".")[0], "%Y/%m/%d %H:%M:%S"))
                rows.append((t, float(r[1]), float(r[2]), r[4].strip()))
            except (ValueError, IndexError):
                continue
        ends = [t for t, _ in self.marks[1:]] + [time.time()]
        for (t0, name), t1 in zip(self.marks, ends):
            sel = [r for r in rows if t0 - 0.5 <= r[0] <= t1 + 0.5]
            if sel:
                clk = sum(r[1] for r in sel) / len(sel)
                pw = sum(r[2] for r in sel) / len(sel)
                reasons = sorted({r[3] for r in sel})
                print(f"  smi {name:24s}: SM clock {clk:6.0f} MHz, power {pw:5.0f} W, throttle {reasons} "
                      f"({len(sel)} samples)")


def main() -> None:
    """``python -m benchmark.common --replot CSV [--x COLUMN]``: redraw a results PNG from its CSV
    (next to it), e.g. after editing the plot; needs matplotlib only (no GPU)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--replot", required=True, metavar="CSV", help="a CSV written by write_results")
    ap.add_argument("--x", default=None, help="plot over this extra column (a line chart) instead of bars")
    args = ap.parse_args()
    name = os.path.splitext(os.path.basename(args.replot))[0]
    plot(name, rows_from_csv(args.replot), x=args.x, directory=os.path.dirname(os.path.abspath(args.replot)))


if __name__ == "__main__":
    main()
