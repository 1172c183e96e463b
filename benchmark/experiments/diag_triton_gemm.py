"""Experiment (GPU): can a Triton GEMM of our own match cuBLAS at the frozen head's chunk shapes?

Question: the frozen-head path's remaining cost over the tile path is its ~450 dependent launches
(GEMM, block kernel, GEMM per 16032-column block of each 512-token chunk) and the block kernel's
reads (``benchmark/NOTES.md``, open item 7). Putting the block statistics and exponentials in the
logits GEMM's epilogue removes a launch and two reads per block, but only pays if our GEMM runs as
fast as cuBLAS's there. This times, bf16 operands and fp32 accumulation:

- ``logits``: ``[512, 4096] x [16032, 4096]^T -> [512, 16032]`` bf16 (the head block row-major);
- ``grad``: ``[512, 16032] x [16032, 4096] -> [512, 4096]`` fp32;

``torch.mm`` (cuBLAS) against a plain Triton kernel (grouped tile order, pointer loads, software
pipelined by ``num_stages``; no TMA, no warp specialization) per tile configuration: ``do_bench``
median us and TFLOP/s. ``--check`` compares the kernel with ``torch.mm`` on small fp32 shapes (also
on the CPU under ``TRITON_INTERPRET=1``, where it passes).

``_chains`` times one block as the frozen path runs it (cuBLAS logits, the block kernel, the
accumulating GEMM) against a persistent TMA kernel (``logits_tma``; flattened tile loop, warp
specialization and a store in two halves as options) with the block's exponentials and per-tile
sums and maxima in its epilogue.

Result (H100, torch 2.11, triton 3.6): cuBLAS logits 97.0 us (694 TFLOP/s), + block kernel 112.7,
+ accumulating GEMM 210.2. TMA (128, 256, 64, 8 warps, 4 stages, flattened, split store): 98.0 us
(686 TFLOP/s), with the epilogue 102.2, the block 200.6 us; warp specialization and 256x128 tiles
no better, BK=128 worse (476). Pointer loads: logits 493-530 TFLOP/s, grad 277-593 against
cuBLAS's 670. In the frozen path's loop the TMA kernel loses what it saves
(``diag_fused_logits``).

    python -m benchmark.experiments.diag_triton_gemm [--check]
"""

from __future__ import annotations

import argparse

import torch

from liger_losses.kernels.utils import import_triton

triton, tl = import_triton()

CONFIGS = [  # (BM, BN, BK, num_warps, num_stages)
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 5),
    (64, 256, 64, 4, 4),
    (256, 128, 64, 8, 3),
]


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm, s_cn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP * tiles_n
    first_m = (pid // per_group) * GROUP
    rows = tl.minimum(tiles_m - first_m, GROUP)
    pm = first_m + (pid % per_group) % rows
    pn = (pid % per_group) // rows
    offs_m = pm * BM + tl.arange(0, BM)
    offs_n = pn * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    a = a_ptr + offs_m[:, None] * s_am + offs_k[None, :] * s_ak
    b = b_ptr + offs_k[:, None] * s_bk + offs_n[None, :] * s_bn
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        a_tile = tl.load(a, mask=(offs_m[:, None] < M) & (k + offs_k[None, :] < K), other=0.0)
        b_tile = tl.load(b, mask=(k + offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a_tile, b_tile, acc)
        a += BK * s_ak
        b += BK * s_bk
    c = c_ptr + offs_m[:, None] * s_cm + offs_n[None, :] * s_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _logits_tma_kernel(a_desc, b_desc, c_desc, ref_ptr, part_ptr, M, N, K, NUM_SMS: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EPILOGUE: tl.constexpr,
                       FLAT: tl.constexpr, WS: tl.constexpr, SPLIT: tl.constexpr):
    """Persistent ``c [M, N] = a [M, K] @ b [N, K]^T`` over TMA descriptors; the ``M`` tiles of one
    column of tiles run side by side (the head block's rows read once). ``EPILOGUE``: ``c`` gets
    ``exp(z - ref[row])`` and ``part [tiles_n, 2, M]`` the tile's row sums of it and row maxima of z
    (what the block kernel would otherwise read back)."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(pid, tiles_m * tiles_n, NUM_SMS, flatten=FLAT, warp_specialize=WS):
        pm = tile % tiles_m
        pn = tile // tiles_m
        off_m, off_n = pm * BM, pn * BN
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([off_m, k])
            b = b_desc.load([off_n, k])
            acc = tl.dot(a, b.T, acc)
        if EPILOGUE:
            rows = off_m + tl.arange(0, BM)
            cols = off_n + tl.arange(0, BN)
            ref = tl.load(ref_ptr + rows, mask=rows < M, other=0.0)
            inside = cols[None, :] < N
            e = tl.where(inside, tl.exp(acc - ref[:, None]), 0.0)
            tl.store(part_ptr + (pn * 2) * M + rows, tl.sum(e, axis=1), mask=rows < M)
            tl.store(part_ptr + (pn * 2 + 1) * M + rows, tl.max(tl.where(inside, acc, float("-inf")), axis=1),
                     mask=rows < M)
            out = e
        else:
            out = acc
        if SPLIT:  # the store in two halves: half the epilogue's shared memory, a pipeline stage more
            lo, hi = tl.split(tl.permute(tl.reshape(out, (BM, 2, BN // 2)), (0, 2, 1)))
            c_desc.store([off_m, off_n], lo.to(c_desc.dtype))
            c_desc.store([off_m, off_n + BN // 2], hi.to(c_desc.dtype))
        else:
            c_desc.store([off_m, off_n], out.to(c_desc.dtype))


def logits_tma(h, w, out, config, ref=None, part=None):
    """``out = h @ w.T`` (``h [M, K]``, ``w [N, K]``, both row-major) by the persistent TMA kernel;
    with ``ref [M]`` and ``part [tiles_n, 2, M]`` (fp32) the epilogue's exponentials and partials."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    BM, BN, BK, warps, stages, *rest = config
    flat, ws, split = (list(rest) + [False] * 3)[:3]
    M, K = h.shape
    N = w.shape[0]
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count if h.is_cuda else 4
    grid = (min(sms, triton.cdiv(M, BM) * triton.cdiv(N, BN)),)
    a_desc = TensorDescriptor.from_tensor(h, [BM, BK])
    b_desc = TensorDescriptor.from_tensor(w, [BN, BK])
    c_desc = TensorDescriptor.from_tensor(out, [BM, BN // 2 if split else BN])
    epi = ref is not None
    _logits_tma_kernel[grid](a_desc, b_desc, c_desc, ref if epi else out, part if epi else out, M, N, K,
                             NUM_SMS=grid[0], BM=BM, BN=BN, BK=BK, EPILOGUE=epi, FLAT=flat, WS=ws,
                             SPLIT=split, num_warps=warps,
                             num_stages=stages)
    return out


def matmul(a, b, out, config):
    """``out = a @ b`` (``a [M, K]``, ``b [K, N]``, any strides) with one tile configuration."""
    BM, BN, BK, warps, stages = config
    M, K = a.shape
    N = b.shape[1]
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    _matmul_kernel[grid](a, b, out, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                         out.stride(0), out.stride(1), BM=BM, BN=BN, BK=BK, GROUP=8, num_warps=warps,
                         num_stages=stages)
    return out


def _check(device):
    g = torch.Generator().manual_seed(0)
    for M, N, K in ((70, 90, 130), (128, 256, 64)):
        a = torch.randn(M, K, generator=g).to(device)
        w = torch.randn(N, K, generator=g).to(device)
        for config in ((32, 32, 32, 4, 2), (64, 32, 16, 4, 2)):
            out = matmul(a, w.t(), torch.empty(M, N, device=device), config)
            err = float((out - a @ w.t()).norm() / (a @ w.t()).norm())
            print(f"check {M}x{N}x{K} {config}: rel err {err:.2e}")
            assert err < (1e-5 if device == "cpu" else 2e-3)  # tf32 on a GPU
    for M, N, K in ((70, 92, 132), (128, 256, 64)):  # TMA: row strides of 16-byte multiples
        a = torch.randn(M, K, generator=g).to(device)
        w = torch.randn(N, K, generator=g).to(device)
        for config in ((32, 32, 32, 4, 2), (64, 64, 16, 4, 2, True, False, True)):
            out = logits_tma(a, w, torch.empty(M, N, device=device), config)
            err = float((out - a @ w.t()).norm() / (a @ w.t()).norm())
            print(f"check tma {M}x{N}x{K} {config}: rel err {err:.2e}")
            assert err < (1e-5 if device == "cpu" else 2e-3)
            ref = (a @ w.t()).amax(1)
            part = torch.empty(triton.cdiv(N, config[1]), 2, M, device=device)
            out = logits_tma(a, w, torch.empty(M, N, device=device), config, ref, part)
            want = torch.exp(a @ w.t() - ref[:, None])
            err = float((out - want).norm() / want.norm())
            err_sum = float((part[:, 0].sum(0) - want.sum(1)).abs().max() / want.sum(1).abs().max())
            err_max = float((part[:, 1].amax(0) - ref).abs().max())
            print(f"check tma epilogue {M}x{N}x{K} {config}: rel err {err:.2e} sums {err_sum:.2e} max {err_max:.2e}")
            tol = 1e-5 if device == "cpu" else 6e-2  # tf32 logits of size ~10 on a GPU
            assert err < tol and err_sum < tol and err_max < (1e-3 if device == "cpu" else 0.2)


TMA_CONFIGS = [  # (BM, BN, BK, num_warps, num_stages, flatten, warp_specialize, split store)
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4, False, False, True),
    (128, 256, 64, 8, 3, True, False, False),
    (128, 256, 64, 8, 4, True, False, True),
    (128, 256, 64, 8, 3, False, True, False),
    (128, 256, 64, 8, 4, False, True, True),
    (128, 256, 64, 8, 4, True, True, True),
    (256, 128, 64, 8, 3, False, False, False),
    (256, 128, 64, 8, 4, False, False, True),
    (256, 128, 64, 8, 4, True, True, True),
    (128, 256, 128, 8, 2, False, False, True),
]


def _chains(h, w, logits, acc, flops):
    """One vocabulary block of the frozen path as it runs (cuBLAS logits, the block kernel, the
    accumulating GEMM) against the TMA kernel with its epilogue in place of the first two."""
    import triton.testing

    from liger_losses.chunked.gemm import mm_into
    from liger_losses.kernels.online_block import OnlineState, online_block

    n, cols = logits.shape
    labels = torch.randint(0, cols, (n,), device="cuda")
    state = OnlineState.empty(n, "cuda")
    torch.mm(h, w.t(), out=logits)
    online_block(logits, labels, 0, state, None, first=True)
    ref = state.ref.clone()

    def ms(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=200)

    def cublas_block():
        torch.mm(h, w.t(), out=logits)
        online_block(logits, labels, 0, state, acc, first=False)

    def cublas_chain():
        cublas_block()
        mm_into(acc, logits, w, accumulate=True)

    t_mm = ms(lambda: torch.mm(h, w.t(), out=logits))
    t_blk = ms(cublas_block)
    t_chain = ms(cublas_chain)
    print(f"chain: cuBLAS logits {t_mm * 1e3:.1f} us ({flops / t_mm / 1e9:.0f} TFLOP/s); + block kernel "
          f"{t_blk * 1e3:.1f} us; + accumulating GEMM {t_chain * 1e3:.1f} us", flush=True)
    for config in TMA_CONFIGS:
        try:
            part = torch.empty(triton.cdiv(cols, config[1]), 2, n, device="cuda")
            t_plain = ms(lambda: logits_tma(h, w, logits, config))
            t_epi = ms(lambda: logits_tma(h, w, logits, config, ref, part))

            def fused_chain():
                logits_tma(h, w, logits, config, ref, part)
                mm_into(acc, logits, w, accumulate=True)

            t_fchain = ms(fused_chain)
            print(f"chain: tma {config} plain {t_plain * 1e3:.1f} us ({flops / t_plain / 1e9:.0f} TFLOP/s), "
                  f"epilogue {t_epi * 1e3:.1f} us (vs cuBLAS + block {t_blk * 1e3:.1f}); "
                  f"+ accumulating GEMM {t_fchain * 1e3:.1f} us (vs {t_chain * 1e3:.1f})", flush=True)
        except Exception as exc:
            print(f"chain: tma {config} failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if args.check or not torch.cuda.is_available():
        _check("cuda" if torch.cuda.is_available() else "cpu")
        if not torch.cuda.is_available():
            return
    import triton.testing

    from liger_losses.chunked.gemm import mm_into

    n, H, cols = 512, 4096, 16032
    h = torch.randn(n, H, device="cuda").bfloat16()
    w = (torch.randn(cols, H, device="cuda") * 0.02).bfloat16()
    p = torch.rand(n, cols, device="cuda").bfloat16()
    logits = torch.empty(n, cols, device="cuda", dtype=torch.bfloat16)
    acc = torch.empty(n, H, device="cuda")
    flops = 2 * n * H * cols
    cases = {
        "logits": (lambda: torch.mm(h, w.t(), out=logits), lambda c: matmul(h, w.t(), logits, c)),
        "grad": (lambda: mm_into(acc, p, w, accumulate=False) or acc, lambda c: matmul(p, w, acc, c)),
    }
    _chains(h, w, logits, acc, flops)
    for name, (cublas, ours) in cases.items():
        ms = triton.testing.do_bench(cublas, warmup=25, rep=200)
        print(f"{name}: cuBLAS {ms * 1000:.1f} us, {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        want = cublas().float().clone()
        for config in CONFIGS:
            try:
                got = ours(config).float()
                err = float((got - want).norm() / want.norm())
                ms = triton.testing.do_bench(lambda: ours(config), warmup=25, rep=200)
                print(f"{name}: triton {config} {ms * 1000:.1f} us, {flops / ms / 1e9:.0f} TFLOP/s, "
                      f"rel err {err:.1e}", flush=True)
            except Exception as exc:  # a configuration that does not fit the SM's shared memory
                print(f"{name}: triton {config} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)


if __name__ == "__main__":
    main()
