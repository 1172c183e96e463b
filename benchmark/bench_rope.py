"""Speed and memory of rotary position embedding on q and k (HF layout: ``[B, T, H, D]`` projections
viewed as ``[B, H, T, D]`` by ``transpose(1, 2)``), bf16, forward / backward / full.

Providers: ``ours`` (liger_losses ``apply_rotary_pos_emb``), ``ours-inplace`` (the same with
``inplace=True``), ``ours-inplace-bwd`` (``inplace=True, inplace_backward=True``: the gradients are
rotated in their own buffers too, as liger-kernel does), ``ours-patched`` (that plus
``repeated_tables=True``: only the first half of each cos/sin row is read, as liger-kernel does;
what patched models run), ``hf-torch`` (transformers' llama
``apply_rotary_pos_emb``, or the same formula when transformers is missing) and ``liger``
(liger-kernel 0.8.5 ``LigerRopeFunction``, which rotates q/k in place; skipped when not importable).

Each timed call starts as a model's step does, from fresh projection outputs: ``q_lin =
q_src.clone()`` (and k), viewed as HF does, with gradients taken w.r.t. ``q_src``/``k_src``. (Taking
them w.r.t. a tensor that an in-place provider has just overwritten would return the upstream
gradient untouched and skip the rotation's backward: an earlier version of this benchmark had that flaw.)
The provider ``clone`` is that copy alone; ``net_ms`` is a row's time minus the clone's forward time
for the same case, i.e. the rotation's own cost, and ``net_over_floor`` its ratio to the floor.

Floors (HBM): forward and backward each read q, k (or their grads) and write as much, plus cos/sin:
2 (q + k) + 2 T D x 2 B; full is twice that. Memory floor: q + k bytes (the outputs, or the
gradients), for full the outputs plus the gradients; an in-place provider can go below it. Peaks
include the clone of q and k (q + k bytes) for every provider.

Usage (GPU): python -m benchmark.bench_rope [--quick]
"""

from __future__ import annotations

import argparse

import torch

from benchmark.common import MIB, Row, hbm_floor_ms, measure, print_table, randn, write_results
from liger_losses.kernels.rope import apply_rotary_pos_emb

DEVICE = "cuda"

SHAPES = {  # name: (q heads, kv heads, head_dim)
    "llama3-8b": (32, 8, 128),
    "qwen2-0.5b": (14, 2, 64),
}


def _hf():
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf

        return hf
    except Exception:  # noqa: BLE001

        def rotate_half(x):
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((-x2, x1), dim=-1)

        def hf(q, k, cos, sin, unsqueeze_dim=1):
            cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

        return hf


def providers():
    provs = {
        "clone": lambda q, k, c, s: (q, k),
        "ours": lambda q, k, c, s: apply_rotary_pos_emb(q, k, c, s, impl="triton"),
        "ours-inplace": lambda q, k, c, s: apply_rotary_pos_emb(q, k, c, s, inplace=True, impl="triton"),
        "ours-inplace-bwd": lambda q, k, c, s: apply_rotary_pos_emb(q, k, c, s, inplace=True, inplace_backward=True,
                                                                    impl="triton"),
        "ours-patched": lambda q, k, c, s: apply_rotary_pos_emb(q, k, c, s, inplace=True, inplace_backward=True,
                                                                repeated_tables=True, impl="triton"),
        "hf-torch": _hf(),
    }
    try:
        from liger_kernel.ops.rope import LigerRopeFunction

        provs["liger"] = lambda q, k, c, s: LigerRopeFunction.apply(q, k, c, s)
    except Exception as exc:  # noqa: BLE001
        print(f"(liger-kernel rope unavailable: {exc})")
    return provs


def cos_sin(seq, head_dim, device, dtype):
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


# Layout of the upstream gradients of q/k: contiguous [B, H, T, D] (default), or q's own layout
# ([B, T, H, D] memory seen transposed, what SDPA's flash/cuDNN backward returns for such a q;
# ``--grad-layout q``). The in-place rotation's backward pays a copy for a gradient whose layout
# differs from q's (autograd's view backward on the projection output); out of place does not.
GRAD_LAYOUT = {"q": False}


def bench_case(shape_name, tokens, modes, rows, rep, only=None):
    n_qh, n_kh, d = SHAPES[shape_name]
    dev, dt = DEVICE, torch.bfloat16
    bsz, seq = 1, tokens
    qk_bytes = bsz * seq * (n_qh + n_kh) * d * 2
    cs_bytes = 2 * seq * d * 2
    floors = {"forward": 2 * qk_bytes + cs_bytes, "backward": 2 * qk_bytes + cs_bytes}
    floors["full"] = floors["forward"] + floors["backward"]
    mem_floor = {"forward": qk_bytes / MIB, "backward": qk_bytes / MIB, "full": 2 * qk_bytes / MIB}
    case = f"{shape_name} T={tokens}"
    cos, sin = cos_sin(seq, d, dev, dt)
    clone_fwd = float("nan")
    for name, fn in providers().items():
        if only is not None and name not in (only, "clone"):
            continue
        measured = provider_measurements(name, fn, modes, rep, shape=(bsz, seq, n_qh, n_kh, d), cos=cos, sin=sin)
        for mode, m in measured:
            if name == "clone":
                clone_fwd = m.ms
            net = m.ms - clone_fwd if mode != "backward" else m.ms
            floor = hbm_floor_ms(floors[mode])
            rows.append(Row("rope", case, mode, name, m.ms, m.peak_mib, floor, mem_floor[mode],
                            extra={"tokens": tokens, "net_ms": round(net, 4),
                                   "net_over_floor": round(net / floor, 3)},
                            error=m.error))
        torch.cuda.empty_cache()


def provider_measurements(name, fn, modes, rep, *, shape, cos, sin):
    """``(mode, Measurement)`` per mode for provider ``fn`` on fresh q/k sources of ``shape``
    ``(batch, seq, q_heads, kv_heads, head_dim)``; the sources and gradients die on return."""
    bsz, seq, n_qh, n_kh, d = shape
    dev, dt = DEVICE, torch.bfloat16
    measured = []
    # Sources of the projection outputs [B, T, H*D]; every call clones them (a fresh non-leaf,
    # as a linear layer's output is) and views the clone as HF does.
    q_src = randn(bsz, seq, n_qh * d, device=dev, dtype=dt, requires_grad=True)
    k_src = randn(bsz, seq, n_kh * d, device=dev, dtype=dt, requires_grad=True)

    def views():
        q_lin, k_lin = q_src.clone(), k_src.clone()
        return (q_lin.view(bsz, seq, n_qh, d).transpose(1, 2),
                k_lin.view(bsz, seq, n_kh, d).transpose(1, 2))

    if GRAD_LAYOUT["q"]:  # upstream gradients laid out like q/k (as SDPA's dq from empty_like(q))
        gq = randn(bsz, seq, n_qh, d, device=dev, dtype=dt).transpose(1, 2)
        gk = randn(bsz, seq, n_kh, d, device=dev, dtype=dt).transpose(1, 2)
    else:  # contiguous [B, H, T, D] upstream gradients
        gq = randn(bsz, n_qh, seq, d, device=dev, dtype=dt)
        gk = randn(bsz, n_kh, seq, d, device=dev, dtype=dt)
    for mode in modes if name != "clone" else ("forward",):
        if mode == "forward":
            def run():
                with torch.no_grad():
                    return fn(*views(), cos, sin)
        elif mode == "backward":
            oq, ok = fn(*views(), cos, sin)

            def run(oq=oq, ok=ok):
                return torch.autograd.grad((oq, ok), (q_src, k_src), (gq, gk), retain_graph=True)
        else:
            def run():
                oq, ok = fn(*views(), cos, sin)
                return torch.autograd.grad((oq, ok), (q_src, k_src), (gq, gk))
        measured.append((mode, measure(run, rep=rep, graph=mode != "backward")))
    return measured


def sweep(rep: int) -> None:
    """Our forward + backward (out of place, and in place with the gradients rotated in their
    buffers) over the kernel's knobs (slot ``rope``: ``loads_first``, ``num_warps``, and
    ``tile_elements`` of the tiled order), net of the projection clone, beside liger-kernel's, at
    the 8B and the Qwen2-0.5B shapes."""
    from liger_losses.kernels.rope import ROPE_TUNING

    settings = [dict(loads_first=False, tile_elements=1024, num_warps=4)]
    settings += [dict(loads_first=True, num_warps=warps) for warps in (1, 2, 4, 8)]
    results = []
    cases = [("llama3-8b", 8192), ("llama3-8b", 8192), ("llama3-8b", 32768), ("qwen2-0.5b", 8192)]
    for shape, tokens in cases:  # the first case warms up the graph captures
        for setting in settings:
            for prov in ("ours", "ours-inplace-bwd"):
                rows: list[Row] = []
                with ROPE_TUNING.override(**setting):
                    bench_case(shape, tokens, ("full",), rows, rep, only=prov)
                r = rows[-1]
                results.append(dict(shape=shape, tokens=tokens, provider=prov,
                                    setting=" ".join(f"{k}={int(v)}" for k, v in setting.items()),
                                    net_ms=r.extra["net_ms"], net_over_floor=r.extra["net_over_floor"],
                                    error=(r.error or "")[:60]))
        for prov in ("ours", "ours-inplace-bwd", "liger"):
            rows = []
            bench_case(shape, tokens, ("full",), rows, rep, only=prov)
            if rows:
                r = rows[-1]
                results.append(dict(shape=shape, tokens=tokens, provider=prov, setting="defaults",
                                    net_ms=r.extra["net_ms"], net_over_floor=r.extra["net_over_floor"],
                                    error=(r.error or "")[:60]))
    print_table(results, keys=list(results[0]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one 8B size + the small model, fewer reps")
    parser.add_argument("--sweep", action="store_true", help="only sweep our kernel's tile/warps knobs")
    parser.add_argument("--grad-layout", choices=("contiguous", "q"), default="contiguous",
                        help="layout of the upstream q/k gradients (see GRAD_LAYOUT); 'q' writes rope_qgrad.csv")
    args = parser.parse_args()
    GRAD_LAYOUT["q"] = args.grad_layout == "q"
    if not torch.cuda.is_available():
        raise SystemExit("bench_rope needs a CUDA GPU")
    if args.sweep:
        sweep(30)
        return
    modes = ("forward", "full", "backward")  # full first: see bench_norm.mode_fns
    rep = 30 if args.quick else 100
    sizes = [8192] if args.quick else [4096, 8192, 16384, 32768]
    rows: list[Row] = []
    for tokens in sizes:
        bench_case("llama3-8b", tokens, modes, rows, rep)
    bench_case("qwen2-0.5b", 8192, modes, rows, rep)
    write_results("rope_qgrad" if GRAD_LAYOUT["q"] else "rope", rows)


if __name__ == "__main__":
    main()
