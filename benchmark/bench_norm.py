"""Benchmark of RMSNorm and LayerNorm: ours vs the Hugging Face / PyTorch module vs liger-kernel.

Cases (bf16): H=4096 with 4096, 8192, 16384, 32768 tokens (Llama-3-8B), and H=896 with 8192 tokens
(Qwen2-0.5B, several rows per program). Modes: ``forward`` (input requires grad, so the graph and
saved tensors are built as in training), ``backward`` (``torch.autograd.grad`` of a kept output:
grad hidden + grad weight [+ grad bias]), ``full`` (both). Providers:

* ``ours``: liger_losses ``LigerRMSNorm`` / ``LigerLayerNorm`` (default: out-of-place backward);
* ``ours_inplace`` (RMSNorm only): ``inplace_backward=True`` (grad written into grad_out's buffer,
  as liger-kernel's default);
* ``hf``: ``LlamaRMSNorm`` (transformers) / ``torch.nn.LayerNorm``;
* ``liger``: ``liger_kernel.transformers.rms_norm.LigerRMSNorm`` /
  ``liger_kernel.transformers.layer_norm.LigerLayerNorm`` (skipped if not importable);
* ``copy``: not a norm -- PyTorch copies moving the floor's bytes (forward ``x.clone()``, backward
  ``x + dy``), the bandwidth a plain elementwise kernel reaches at that size (what the HBM floor
  ignores: launch latency, ramp-up and tail).

Floors: bytes moved / 4.3 TB/s with N tokens, H hidden, 2-byte elements: forward reads x, writes y
(4NH); backward reads x, dy and writes dx (6NH); full = 10NH. Memory floor (peak above inputs):
the output (forward), grad hidden (backward), both (full).

``--sweep`` times our forward + backward for a few backward settings (programs per SM, tile size,
the partial-sum reduction's tile), so the defaults in
liger_losses/kernels/{rms_norm,layer_norm,norm_common}.py can be set from one GPU run.

Usage: python -m benchmark.bench_norm [--quick] [--sweep] [--which rms|layer|both]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmark.common import MIB, Row, hbm_floor_ms, measure, print_table, randn, write_results
from liger_losses.kernels import layer_norm as ln_mod
from liger_losses.kernels import rms_norm as rms_mod
from liger_losses.kernels.tuning import tuning

DTYPE = torch.bfloat16
DEVICE = "cuda"
CASES = [(4096, 4096), (8192, 4096), (16384, 4096), (32768, 4096), (8192, 896)]
QUICK_CASES = [(4096, 4096), (16384, 4096), (8192, 896)]
SWEEP_CASES = [(4096, 4096), (4096, 4096), (8192, 4096), (32768, 4096)]  # first: warm-up (captures may fail)


def _copy_params(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Copy same-named, same-shaped parameters (liger's modules have their own constructors)."""
    theirs = dict(dst.named_parameters())
    with torch.no_grad():
        for name, p in src.named_parameters():
            if name in theirs and theirs[name].shape == p.shape:
                theirs[name].copy_(p)


def providers(kind: str, H: int) -> dict:
    """name -> module (bf16, CUDA) or an error string when the provider is not available."""
    out: dict = {}
    if kind == "rms":
        ours = rms_mod.LigerRMSNorm(H, eps=1e-6)
        with torch.no_grad():
            ours.weight.uniform_(0.5, 1.5)
        out["ours"] = ours
        out["ours_inplace"] = rms_mod.LigerRMSNorm(H, eps=1e-6, inplace_backward=True)
        try:
            from transformers.models.llama.modeling_llama import LlamaRMSNorm

            out["hf"] = LlamaRMSNorm(H, eps=1e-6)
        except Exception as exc:  # noqa: BLE001
            out["hf"] = f"transformers not importable: {exc}"
        try:
            from liger_kernel.transformers.rms_norm import LigerRMSNorm as TheirRMSNorm

            out["liger"] = TheirRMSNorm(H, eps=1e-6)
        except Exception as exc:  # noqa: BLE001
            out["liger"] = f"liger_kernel not importable: {exc}"
    else:
        ours = ln_mod.LigerLayerNorm(H, eps=1e-6)
        with torch.no_grad():
            ours.weight.uniform_(0.5, 1.5)
            ours.bias.normal_()
        out["ours"] = ours
        out["hf"] = torch.nn.LayerNorm(H, eps=1e-6)
        try:
            from liger_kernel.transformers.layer_norm import LigerLayerNorm as TheirLayerNorm

            out["liger"] = TheirLayerNorm(H, eps=1e-6)
        except Exception as exc:  # noqa: BLE001
            out["liger"] = f"liger_kernel not importable: {exc}"
    for name, mod in out.items():
        if isinstance(mod, torch.nn.Module):
            if mod is not ours:
                _copy_params(ours, mod)
            mod.to(DEVICE, DTYPE)
    return out


def mode_fns(module, x, dy):
    """The three timed callables for one module; each returns what it allocates. ``full`` comes
    before ``backward``, whose kept forward output is made at its first call: a graph built outside
    a capture and still alive (holding the leaves' AccumulateGrad nodes, made on the default
    stream) broke the first ``full`` capture of a process (cudaErrorStreamCaptureInvalidated)."""
    params = [p for p in module.parameters() if p.requires_grad]
    kept = []

    def forward():
        return module(x)

    def backward():
        if not kept:
            kept.append(module(x))
        return torch.autograd.grad(kept[0], [x, *params], dy, retain_graph=True)

    def full():
        return torch.autograd.grad(module(x), [x, *params], dy)

    return {"forward": forward, "full": full, "backward": backward}


def copy_fns(x, dy):
    """The ``copy`` reference: PyTorch elementwise kernels moving each mode's floor bytes."""
    xd = x.detach()

    def forward():
        return xd.clone()

    def backward():
        return torch.add(xd, dy)

    def full():
        return forward(), backward()

    return {"forward": forward, "backward": backward, "full": full}


def floors(N: int, H: int) -> dict:
    e = torch.finfo(DTYPE).bits // 8
    nh = N * H * e
    return {
        "forward": (hbm_floor_ms(2 * nh), nh / MIB),
        "backward": (hbm_floor_ms(3 * nh), nh / MIB),
        "full": (hbm_floor_ms(5 * nh), 2 * nh / MIB),
    }


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def bench(kind: str, cases, rep: int) -> list[Row]:
    rows: list[Row] = []
    name = "rms_norm" if kind == "rms" else "layer_norm"
    for N, H in cases:
        case = f"{name} N={N} H={H}"
        torch.manual_seed(0)
        x = randn(N, H, device=DEVICE, dtype=DTYPE).requires_grad_()
        dy = randn(N, H, device=DEVICE, dtype=DTYPE)
        mods = providers(kind, H)
        mods["copy"] = None
        hf_out = mods["hf"](x).detach() if isinstance(mods["hf"], torch.nn.Module) else None
        fl = floors(N, H)
        for prov, mod in mods.items():
            if isinstance(mod, str):
                for mode in ("forward", "backward", "full"):
                    rows.append(Row(name, case, mode, prov, float("nan"), float("nan"),
                                    fl[mode][0], fl[mode][1], error=mod))
                print(f"[{case}] {prov}: skipped ({mod})")
                continue
            extra = {"tokens": N, "hidden": H}
            if mod is None:
                for mode, fn in copy_fns(x, dy).items():
                    m = measure(fn, rep=rep, graph=True)
                    rows.append(Row(name, case, mode, prov, m.ms, m.peak_mib, fl[mode][0], fl[mode][1],
                                    extra=dict(extra), error=m.error))
                continue
            if hf_out is not None:
                with torch.no_grad():
                    extra["rel_err_vs_hf"] = round(rel_err(mod(x).float(), hf_out.float()), 6)
            # in-place providers overwrite dy: give each its own copy
            fns = mode_fns(mod, x, dy.clone())
            for mode, fn in fns.items():
                m = measure(fn, rep=rep, graph=mode != "backward")
                rows.append(Row(name, case, mode, prov, m.ms, m.peak_mib, fl[mode][0], fl[mode][1],
                                extra=dict(extra), error=m.error))
            del fns
            torch.cuda.empty_cache()
    return rows


def sweep(rep: int) -> None:
    """Time our forward + backward at a few knob settings: backward programs per SM x backward tile
    size x the partial-sum reduction's tile (slot ``norm_sum``, knob ``block_cols``; 256 columns x
    32 rows was the setting before 64-column tiles over all rows measured 3 us faster at 4096 tokens)."""
    results = []
    for kind, slot in (("rms", "rms_norm"), ("layer", "layer_norm")):
        for N, H in SWEEP_CASES:
            x = randn(N, H, device=DEVICE, dtype=DTYPE).requires_grad_()
            dy = randn(N, H, device=DEVICE, dtype=DTYPE)
            module = providers(kind, H)["ours"]
            fns = mode_fns(module, x, dy)
            fl = floors(N, H)
            for pps, tile, sum_cfg in itertools.product((1, 2), (8192, 16384), ((256, 8192), (32, 8192), (64, 8192))):
                block_cols, tile_elems = sum_cfg
                if block_cols == 256:
                    tile_elems = 256 * 32  # the former 32-row tiles
                norm = {"bwd_programs_per_sm": pps, "bwd_tile_elems": tile, "bwd_min_rows_per_program": 4}
                with tuning(**{slot: norm}, norm_sum={"block_cols": block_cols, "tile_elems": tile_elems}):
                    m = measure(fns["full"], rep=rep)
                results.append(dict(kind=kind, N=N, H=H, mode="full", programs_per_sm=pps, tile=tile,
                                    sum_cols=sum_cfg[0], ms=round(m.ms, 4),
                                    over_floor=round(m.ms / fl["full"][0], 3),
                                    peak_mib=round(m.peak_mib, 1), error=(m.error or "")[:60]))
    print_table(results, keys=list(results[0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="three cases, fewer repetitions")
    ap.add_argument("--sweep", action="store_true", help="only sweep our kernels' tuning knobs")
    ap.add_argument("--which", choices=("rms", "layer", "both"), default="both")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_norm: needs a CUDA GPU; nothing to do on this machine.")
        return
    cases = QUICK_CASES if args.quick else CASES
    rep = 30 if args.quick else 100
    if args.sweep:  # the sweep alone (one GPU call each)
        sweep(rep)
        return
    kinds = ("rms", "layer") if args.which == "both" else (args.which,)
    rows: list[Row] = []
    for kind in kinds:
        rows += bench(kind, cases, rep)
    write_results("norm", rows)


if __name__ == "__main__":
    main()
