"""Experiment (GPU, Hopper): the frozen-head path with the block kernel folded into its logits GEMM.

Question: does a logits GEMM of our own with the online softmax in its epilogue take the frozen
path (``liger_losses.chunked.frozen_head``) to the tile path's time, at its memory? Per 512-token
chunk, the first vocabulary block runs as shipped (cuBLAS logits, the block kernel, which fixes
the row's exponent reference at the block's maximum); every later block runs one persistent TMA
kernel (``diag_triton_gemm``'s fastest layout) whose epilogue writes ``exp(z - ref) dz/dx`` in
bf16 over the logits, the label's ``z``/``dz/dx`` into the state, and per (row, column tile) the
sums of the exponentials (and of ``exp * z``) and the maxima into a small partials buffer; then
cuBLAS accumulates as before. The reference stays fixed after the first block, so the
accumulator is never rescaled; a row whose later logits pass the reference by more than
``TAU_HI`` raises a flag (where the exponentials could overflow fp32; a shipped path would redo
that chunk with the block kernel). The partials are summed into the state before
``online_finish``.

This monkeypatches ``OnlinePass.chunk`` (plain cross-entropy, no bias, no label smoothing) and
times the loss and its hidden gradient at 8192 x 4096 x 128256 bf16 against the shipped path and
the tile path, alternating over rounds; and checks the gradient and loss against the shipped path.

Result (H100, torch 2.11, triton 3.6, 3 alternating rounds, median ms / peak MiB above the inputs):
shipped 28.05 / 92, fused 29.65 / 95 (spread 28.4-31.1), fused without the label's epilogue 30.02,
the fused kernel with no epilogue (wrong gradients, timing only) 27.79, the tile path 26.48 / 565.
Loss and gradient against float64: shipped 9.0e-7 / 1.66e-3, fused 3.1e-7 / 1.66e-3; no row
flagged. Profile per call: cuBLAS's logits GEMMs 92 us each (10.31 ms over 112), the fused kernel
106 us (11.85 ms): it loses 14 us a block where the block kernel it replaces took 14 (1.77 ms over
128). The partials' PyTorch sums (0.6 ms) would fold into ``online_finish`` in a shipped version;
the GEMM's speed is what decides, and it is not there: closed (``benchmark/NOTES.md``).

    python -m benchmark.experiments.diag_fused_logits [--rounds 5] [--check]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from liger_losses.kernels.utils import import_triton

triton, tl = import_triton()

TAU_HI = 64.0  # exp(64) * 2^17 columns stays below fp32's maximum (e^88.7)
CONFIG = (128, 256, 64, 8, 4)  # BM, BN, BK, num_warps, num_stages (flattened loop, split store)
LEVEL = 2  # the epilogue: 0 the logits alone (timing only), 1 + exponentials and partials, 2 + the label

if triton is not None:
    from liger_losses.kernels.utils import transform_logits as _transform

    @triton.jit
    def _fused_logits_kernel(a_desc, b_desc, p_desc, lab_ptr, v0, ref_ptr, zy_ptr, dy_ptr, part_ptr, flag_ptr,
                             M, N, K, logit_scale, inv_temp, softcap, tau_hi, NUM_SMS: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                             NEED_ZEXP: tl.constexpr, LEVEL: tl.constexpr):
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        for tile in tl.range(pid, tiles_m * tiles_n, NUM_SMS, flatten=True):
            pm = tile % tiles_m
            pn = tile // tiles_m
            off_m, off_n = pm * BM, pn * BN
            acc = tl.zeros((BM, BN), tl.float32)
            for k in range(0, K, BK):
                acc = tl.dot(a_desc.load([off_m, k]), b_desc.load([off_n, k]).T, acc)
            rows = off_m + tl.arange(0, BM)
            cols = tl.arange(0, BN)
            rmask = rows < M
            cmask = (off_n + cols) < N
            if LEVEL == 0:  # timing only: the logits, no epilogue
                g = acc
            else:
                if HAS_SOFTCAP:
                    z, t = _transform(acc, logit_scale, inv_temp, softcap, HAS_SOFTCAP)
                else:
                    z = acc * (logit_scale * inv_temp)
                ref = tl.load(ref_ptr + rows, mask=rmask, other=0.0)
                e = tl.where(cmask[None, :], tl.exp(z - ref[:, None]), 0.0)
                tl.store(part_ptr + (pn * 3) * M + rows, tl.sum(e, axis=1), mask=rmask)
                if NEED_ZEXP:
                    tl.store(part_ptr + (pn * 3 + 1) * M + rows,
                             tl.sum(e * tl.where(cmask[None, :], z, 0.0), axis=1), mask=rmask)
                zm = tl.max(tl.where(cmask[None, :], z, float("-inf")), axis=1)
                tl.store(part_ptr + (pn * 3 + 2) * M + rows, zm, mask=rmask)
                tl.store(flag_ptr + rows, tl.full((BM,), 1, tl.int32), mask=rmask & (zm > ref + tau_hi))
                if LEVEL >= 2:
                    local = tl.load(lab_ptr + rows, mask=rmask, other=-1).to(tl.int64) - v0 - off_n
                    here = rmask & (local >= 0) & (local < BN) & (off_n + local < N)
                    hit = cols[None, :] == local[:, None]
                    tl.store(zy_ptr + rows, tl.sum(tl.where(hit, z, 0.0), axis=1), mask=here)
                    if HAS_SOFTCAP:
                        d = (logit_scale * inv_temp) * (1.0 - t * t)
                        tl.store(dy_ptr + rows, tl.sum(tl.where(hit, d, 0.0), axis=1), mask=here)
                    else:
                        tl.store(dy_ptr + rows, tl.zeros((BM,), tl.float32) + logit_scale * inv_temp, mask=here)
                if HAS_SOFTCAP:
                    g = e * ((logit_scale * inv_temp) * (1.0 - t * t))
                else:
                    g = e * (logit_scale * inv_temp)
            lo, hi = tl.split(tl.permute(tl.reshape(g, (BM, 2, BN // 2)), (0, 2, 1)))
            p_desc.store([off_m, off_n], lo.to(p_desc.dtype))
            p_desc.store([off_m, off_n + BN // 2], hi.to(p_desc.dtype))


def fused_logits(h, w_block, tile, labels, v0, state, part, flag, transform, need_zexp):
    """``tile [n, Vb] = exp(z - state.ref) dz/dx`` of ``z = transform(h @ w_block.T)``, the label's
    ``z``/``dz/dx`` into ``state``, ``part [tiles_n, 3, n]`` the per-tile sums and maxima."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    BM, BN, BK, warps, stages = CONFIG
    M, K = h.shape
    N = w_block.shape[0]
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count if h.is_cuda else 3
    grid = (min(sms, triton.cdiv(M, BM) * triton.cdiv(N, BN)),)
    softcap = transform["softcap"]
    _fused_logits_kernel[grid](
        TensorDescriptor.from_tensor(h, [BM, BK]), TensorDescriptor.from_tensor(w_block, [BN, BK]),
        TensorDescriptor.from_tensor(tile, [BM, BN // 2]), labels, int(v0), state.ref, state.z_y, state.d_y,
        part, flag, M, N, K, float(transform["logit_scale"]), 1.0 / float(transform["temperature"]),
        float(softcap) if softcap is not None else 1.0, TAU_HI, NUM_SMS=grid[0], BM=BM, BN=BN, BK=BK,
        HAS_SOFTCAP=softcap is not None, NEED_ZEXP=bool(need_zexp), LEVEL=LEVEL, num_warps=warps,
        num_stages=stages)


def patched_chunk(flags):
    """An ``OnlinePass.chunk`` that runs every block after the first through :func:`fused_logits`
    (flags of rows past ``TAU_HI`` appended to ``flags``)."""
    from liger_losses.chunked.gemm import mm_into
    from liger_losses.kernels.online_block import online_block
    from liger_losses.kernels.online_finish import online_finish

    def chunk(self, h, labels, scale, out, out_rows, stats):
        n, H = h.shape[0], self.H
        w = self.weight
        assert self.eps == 0.0 and all(b is None for _, _, b in self.head_blocks)
        state, acc = self.state_buf.rows(n), self.acc_buf[: n * H].view(n, H)
        BN = CONFIG[1]
        if not hasattr(self, "part_buf"):
            cols = max(wb.shape[0] for _, wb, _ in self.head_blocks)
            self.part_buf = torch.empty((len(self.head_blocks) - 1) * triton.cdiv(cols, BN) * 3 * self.acc_buf.numel()
                                        // H, device=w.device)
        tiles = triton.cdiv(self.head_blocks[1][1].shape[0], BN)
        part = self.part_buf[: (len(self.head_blocks) - 1) * tiles * 3 * n].view(len(self.head_blocks) - 1, tiles, 3, n)
        flag = torch.zeros(n, dtype=torch.int32, device=w.device)
        with torch.autocast(device_type=w.device.type, enabled=False):
            if h.dtype != w.dtype:
                h = h.to(w.dtype)
            if not h.is_contiguous():
                h = h.contiguous()
            for b, (v0, w_block, _) in enumerate(self.head_blocks):
                tile = self.buf[: n * w_block.shape[0]].view(n, w_block.shape[0])
                if b == 0:
                    torch.mm(h, w_block.t(), out=tile)
                    online_block(tile, labels, v0, state, acc, first=True, need_zexp=self.need_entropy,
                                 impl=self.impl, **self.transform)
                else:
                    fused_logits(h, w_block, tile, labels, v0, state, part[b - 1], flag, self.transform,
                                 self.need_entropy)
                mm_into(acc, tile, w_block, accumulate=b > 0)
            state.sumexp.add_(part[:, :, 0].sum((0, 1)))
            if self.need_entropy:
                state.zexp.add_(part[:, :, 1].sum((0, 1)))
            # the fused kernel keeps no `zpre` (the maximum before the label): this path's token
            # accuracy is wrong on ties (loss and gradient, what it measures, are exact)
            torch.maximum(state.zmax, part[:, :, 2].amax((0, 1)), out=state.zmax)
            flags.append(flag)
            online_finish(state, acc, w, labels, mode=self.mode, scale=scale, out=out, out_rows=out_rows,
                          stats=stats, label_smoothing=self.eps, z_loss_weight=self.z_loss_weight,
                          dz_dx=self.dz_dx, w_mean=self.w_mean, impl=self.impl)

    return chunk


def _check():
    """The patched chunk against the shipped one on small fp32 shapes (CPU under TRITON_INTERPRET=1,
    or CUDA): several chunks and blocks, the label in every block, a softcap run."""
    from liger_losses.chunked import frozen_head
    from liger_losses.chunked.config import engine_config
    from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy

    global CONFIG
    CONFIG = (32, 64, 16, 4, 2)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    N, H, V = 300, 64, 1000
    w = (torch.randn(V, H, generator=g) * 0.3).to(dev)
    h = torch.randn(N, H, generator=g).to(dev).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g).to(dev)
    shipped = frozen_head.OnlinePass.chunk
    for softcap in (None, 5.0):
        out = {}
        for name in ("shipped", "fused"):
            flags = []
            frozen_head.OnlinePass.chunk = patched_chunk(flags) if name == "fused" else shipped
            try:
                with engine_config(frozen_block_columns=256, frozen_budget_bytes=128 * (256 * 4 + H * 4)):
                    loss = fused_linear_cross_entropy(w, h, y, softcap=softcap)
                    out[name] = (loss.detach(), torch.autograd.grad(loss, h)[0])
                assert name == "shipped" or len(flags) >= 3, "the patched chunk did not run"
            finally:
                frozen_head.OnlinePass.chunk = shipped
        (l0, g0), (l1, g1) = out["shipped"], out["fused"]
        err = float((g1 - g0).norm() / g0.norm())
        print(f"check softcap={softcap}: loss {float(l1):.6f} vs {float(l0):.6f}, grad rel err {err:.2e}")
        assert abs(float(l1) - float(l0)) < 1e-5 * abs(float(l0)) and err < 1e-5


def main():
    import triton.testing

    from benchmark.experiments.diag_frozen_head import frozen_case
    from liger_losses.chunked import frozen_head
    from liger_losses.chunked.config import engine_config
    from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if args.check or not torch.cuda.is_available():
        _check()
        return
    torch.manual_seed(0)
    N, H, V = args.tokens, 4096, 128256
    w, h, y, step = frozen_case(N, H, V)
    shipped = frozen_head.OnlinePass.chunk
    flags = []
    fused = patched_chunk(flags)

    def loss_and_grad():
        loss = fused_linear_cross_entropy(w, h, y)
        (g,) = torch.autograd.grad(loss, h)
        return loss.detach().float(), g.float()

    ref_loss, ref_grad = loss_and_grad()
    frozen_head.OnlinePass.chunk = fused
    loss, grad = loss_and_grad()
    frozen_head.OnlinePass.chunk = shipped
    print(f"fused vs shipped: loss {float(loss):.6f} vs {float(ref_loss):.6f}; grad rel err "
          f"{float((grad - ref_grad).norm() / ref_grad.norm()):.2e}; flagged rows {int(sum(f.sum() for f in flags))}",
          flush=True)
    h64 = h.detach().double()
    logits = h64 @ w.double().t()
    lse = torch.logsumexp(logits, 1)
    p = torch.softmax(logits, 1)
    p[torch.arange(N, device=h.device), y] -= 1
    g64 = (p @ w.double()) / N
    loss64 = (lse - logits.gather(1, y[:, None]).squeeze(1)).mean()
    del logits, p
    for name, (l, g) in {"shipped": (ref_loss, ref_grad), "fused": (loss, grad)}.items():
        print(f"{name} vs float64: loss {abs(float(l) - float(loss64)) / abs(float(loss64)):.2e}, grad "
              f"{float((g.double() - g64).norm() / g64.norm()):.2e}", flush=True)
    del g64

    import contextlib

    @contextlib.contextmanager
    def provider_on(provider):
        """``shipped``, ``tile`` (the tile path), ``fused`` / ``fused1`` / ``fused0`` (the epilogue
        at LEVEL 2 / 1 / 0; 0 and 1 compute wrong gradients: timing only)."""
        global LEVEL
        if provider.startswith("fused"):
            LEVEL = int(provider[5:] or 2)
            frozen_head.OnlinePass.chunk = fused
        try:
            with engine_config(frozen_head_online=provider != "tile"):
                yield
        finally:
            frozen_head.OnlinePass.chunk = shipped
            LEVEL = 2

    providers = ("shipped", "fused", "fused1", "fused0", "tile")
    times = {k: [] for k in providers}
    for _ in range(args.rounds):
        for provider in providers:
            with provider_on(provider):
                times[provider].append(triton.testing.do_bench(step, warmup=5, rep=60))
    for provider, ts in times.items():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with provider_on(provider):
            step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        print(f"{provider}: median {statistics.median(ts):.2f} ms (min {min(ts):.2f}, max {max(ts):.2f}) "
              f"peak {peak:.0f} MiB above the inputs", flush=True)
    for provider in ("shipped", "fused"):
        with provider_on(provider):
            step()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
        rows = sorted(((e.key, e.device_time_total / 3, e.count // 3) for e in prof.key_averages()
                       if e.device_time_total > 0), key=lambda r: -r[1])
        print(f"profile {provider}: kernel time {sum(r[1] for r in rows) / 1e3:.2f} ms a call", flush=True)
        for key, us, count in rows[:6]:
            print(f"  {us / 1e3:7.3f} ms {count:4d}x {key[:90]}", flush=True)


if __name__ == "__main__":
    main()
