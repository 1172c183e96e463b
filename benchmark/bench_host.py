"""Host (CPU) time per call of the layer kernels and cross-entropy on given logits: ours vs
liger-kernel vs eager PyTorch.

When a training step is short (a 1B model at 2048 tokens) the GPU waits for the host, and what a
kernel costs is the Python + launch time of its call, not its GPU time. This script measures that
directly: ``n`` back-to-back calls on tiny CUDA tensors (GPU work ~nothing), wall time divided by
``n``, for ``forward`` (input requires grad, graph built) and ``full`` (forward + backward).
With ``--cprofile`` it also prints the hottest Python functions of our calls.

Columns: ``us_per_call`` (median of 5 repeats of ``n`` calls). No floors: the floor is 0.

Usage (GPU): python -m benchmark.bench_host [--quick] [--cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

from benchmark.common import Row, write_results
from liger_losses.kernels.cross_entropy import cross_entropy
from liger_losses.kernels.geglu import geglu
from liger_losses.kernels.layer_norm import LigerLayerNorm
from liger_losses.kernels.rms_norm import LigerRMSNorm
from liger_losses.kernels.rope import apply_rotary_pos_emb
from liger_losses.kernels.swiglu import swiglu

DEV = os.environ.get("BENCH_DEVICE", "cuda")  # "cpu" (+ TRITON_INTERPRET=1) for a smoke run
DT = torch.bfloat16


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _liger():
    out = {}
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss
        from liger_kernel.transformers.layer_norm import LigerLayerNorm as TheirLN
        from liger_kernel.transformers.rms_norm import LigerRMSNorm as TheirRMS

        out = dict(rms=TheirRMS, ln=TheirLN, rope=LigerRopeFunction.apply,
                   swiglu=LigerSiLUMulFunction.apply, geglu=LigerGELUMulFunction.apply,
                   ce=LigerCrossEntropyLoss())
    except Exception as exc:  # noqa: BLE001
        print(f"(liger-kernel unavailable: {exc})")
    return out


def cases():
    """name -> {provider: (make_inputs, fn)}; fn(*inputs) returns the output (a tensor or a tuple)."""
    H, I, B, T, NQ, NK, D = 256, 512, 1, 16, 4, 2, 64
    lig = _liger()

    def x_in():
        return (torch.randn(T, H, device=DEV, dtype=DT, requires_grad=True),)

    def gate_up():
        a = torch.randn(T, I, device=DEV, dtype=DT, requires_grad=True)
        b = torch.randn(T, I, device=DEV, dtype=DT, requires_grad=True)
        return a.clone(), b.clone()

    def qk():
        q = torch.randn(B, T, NQ * D, device=DEV, dtype=DT, requires_grad=True)
        k = torch.randn(B, T, NK * D, device=DEV, dtype=DT, requires_grad=True)
        q = (q * 1).view(B, T, NQ, D).transpose(1, 2)
        k = (k * 1).view(B, T, NK, D).transpose(1, 2)
        cos = torch.randn(B, T, D, device=DEV, dtype=DT)
        return q, k, cos, cos.clone()

    def logits_in():
        x = torch.randn(T, 1024, device=DEV, dtype=DT, requires_grad=True)
        return x * 1, torch.randint(0, 1024, (T,), device=DEV)

    rms_ours = LigerRMSNorm(H).to(DEV, DT)
    rms_ours_ip = LigerRMSNorm(H, inplace_backward=True).to(DEV, DT)
    ln_ours = LigerLayerNorm(H).to(DEV, DT)
    ln_torch = torch.nn.LayerNorm(H).to(DEV, DT)
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_rope

        rms_hf = LlamaRMSNorm(H).to(DEV, DT)
    except Exception:  # noqa: BLE001
        rms_hf = hf_rope = None
    out = {
        "rms_norm": {"ours": (x_in, rms_ours), "ours_inplace": (x_in, rms_ours_ip)},
        "layer_norm": {"ours": (x_in, ln_ours), "torch": (x_in, ln_torch)},
        "rope": {"ours": (qk, lambda q, k, c, s: apply_rotary_pos_emb(q, k, c, s)),
                 "ours_inplace": (qk, lambda q, k, c, s: apply_rotary_pos_emb(q, k, c, s, inplace=True)),
                 "ours_inplace_bwd": (qk, lambda q, k, c, s: apply_rotary_pos_emb(q, k, c, s, inplace=True,
                                                                                 inplace_backward=True))},
        "cross_entropy": {"ours": (logits_in, lambda x, y: cross_entropy(x, y)),
                          "torch": (logits_in, lambda x, y: F.cross_entropy(x.float(), y))},
        "swiglu": {"ours_inplace": (gate_up, lambda a, b: swiglu(a, b, inplace_backward=True)),
                   "torch": (gate_up, lambda a, b: F.silu(a) * b)},
        "geglu": {"ours_inplace": (gate_up, lambda a, b: geglu(a, b, approximate="tanh", inplace_backward=True)),
                  "torch": (gate_up, lambda a, b: F.gelu(a, approximate="tanh") * b)},
    }
    if rms_hf is not None:
        out["rms_norm"]["hf"] = (x_in, rms_hf)
        out["rope"]["hf"] = (qk, lambda q, k, c, s: hf_rope(q, k, c, s))
    if lig:
        out["rms_norm"]["liger"] = (x_in, lig["rms"](H).to(DEV, DT))
        out["layer_norm"]["liger"] = (x_in, lig["ln"](H).to(DEV, DT))
        out["rope"]["liger"] = (qk, lambda q, k, c, s: lig["rope"](q.contiguous(), k.contiguous(), c, s))
        out["swiglu"]["liger"] = (gate_up, lig["swiglu"])
        out["geglu"]["liger"] = (gate_up, lig["geglu"])
        out["cross_entropy"]["liger"] = (logits_in, lig["ce"])
    return out


def _loss(out):
    if isinstance(out, tuple):
        return sum(o.float().sum() for o in out)
    return out.float().sum()


def per_call_us(make, fn, mode: str, n: int) -> float:
    inputs = [make() for _ in range(n)]  # fresh inputs per call (in-place kernels consume them)

    def one(i):
        out = fn(*inputs[i])
        if mode == "full":
            _loss(out).backward()

    for i in range(min(n, 20)):
        one(i)
    _sync()
    times = []
    for _ in range(5):
        inputs[:] = [make() for _ in range(n)]
        _sync()
        t0 = time.perf_counter()
        for i in range(n):
            one(i)
        _sync()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cprofile", action="store_true", help="print the hottest functions of our full calls")
    a = ap.parse_args()
    n = 100 if a.quick else 300
    rows = []
    # baseline: the loss + backward alone (what "full" adds besides the kernel)
    for kernel, provs in cases().items():
        for prov, (make, fn) in provs.items():
            for mode in ("forward", "full"):
                try:
                    us = per_call_us(make, fn, mode, n)
                    err = None
                except Exception as exc:  # noqa: BLE001
                    us, err = float("nan"), f"{type(exc).__name__}: {str(exc)[:100]}"
                rows.append(Row("host", kernel, mode, prov, us / 1e3, float("nan"),
                                extra={"us_per_call": round(us, 1)}, error=err))
                print(f"{kernel:10s} {mode:8s} {prov:14s} {us:8.1f} us/call" + (f"  {err}" if err else ""), flush=True)
    write_results("host", rows)
    if a.cprofile:
        for kernel, provs in cases().items():
            for prov, (make, fn) in provs.items():
                if not prov.startswith("ours"):
                    continue
                inputs = [make() for _ in range(200)]
                pr = cProfile.Profile()
                pr.enable()
                for inp in inputs:
                    _loss(fn(*inp)).backward()
                _sync()
                pr.disable()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
                print(f"===== cProfile {kernel} {prov} (200 forward+backward calls)")
                print(s.getvalue()[:3500])


if __name__ == "__main__":
    main()
