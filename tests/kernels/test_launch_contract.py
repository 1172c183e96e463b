"""The contract that keeps ``liger_losses.kernels.launch``'s fast path on by default.

The fast launcher keys its cache of compiled kernels on its own re-implementation of Triton's
argument specialization. The contract: for every argument specialization, the compiled kernel the
fast path launches is the one ``JITFunction``'s own cache holds for those arguments. It is checked
on the GPU (under ``TRITON_INTERPRET=1`` there are no compiled kernels and the fast path is off)
for a grid of specializations: tensor dtypes and 16-byte alignment, ints equal to 1 / divisible by
16 / neither / beyond int32 / beyond int64 (u64) / negative, bools, two constexpr values, two warp
counts. Identity of kernel objects (not a tolerance): a wrong entry is a different kernel.

The test runs on whatever Triton is installed, with that minor version admitted for the test's
duration: a pass on a version outside ``launch.TESTED_TRITON_VERSIONS`` is what it takes to add it
there (and, above the highest tested minor, to widen ``pyproject.toml``'s triton range).
"""

import itertools
import random

import pytest
import torch

from liger_losses.kernels import launch as L
from liger_losses.kernels.utils import import_triton

triton, tl = import_triton()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(triton is None, reason="needs triton")]

if triton is not None:

    @triton.jit
    def _contract_kernel(x_ptr, out_ptr, n, a, s, flag, BLOCK: tl.constexpr, MODE: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        y = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * s + a
        if flag:
            y = -y
        if MODE == 1:
            y = y * y
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


_X = [(torch.float32, 0), (torch.float32, 1), (torch.bfloat16, 0), (torch.bfloat16, 1), (torch.float16, 0)]
_OUT = [(torch.float32, 0), (torch.bfloat16, 0), (torch.float32, 1)]
_N = [1, 16, 17]
_A = [1, 16, 3, 2**40, 2**63 + 5, -7]
_FLAG = [False, True]
_MODE = [0, 1]
_WARPS = [1, 4]


def _specs(count: int, seed: int = 0):
    """``count`` specializations drawn from the grid, every value of every axis among them."""
    grid = list(itertools.product(range(len(_X)), range(len(_OUT)), _N, _A, _FLAG, _MODE, _WARPS))
    rng = random.Random(seed)
    picked = rng.sample(grid, count)
    for axis, values in enumerate((range(len(_X)), range(len(_OUT)), _N, _A, _FLAG, _MODE, _WARPS)):
        for v in values:  # each value at least once
            if not any(p[axis] == v for p in picked):
                picked.append(next(g for g in grid if g[axis] == v))
    return picked


def _tensor(dtype, offset, numel=64):
    base = torch.randn(numel + 8, device="cuda").to(dtype)
    return base[offset:offset + numel]


@pytest.fixture
def admitted(monkeypatch):
    """The running triton minor version admitted by the fence, the fast path on."""
    version = L.triton_minor_version(triton)
    monkeypatch.setattr(L, "TESTED_TRITON_VERSIONS", tuple({*L.TESTED_TRITON_VERSIONS, version}))
    monkeypatch.delenv(L.ENV_SWITCH, raising=False)
    L.set_fast_launch(None)
    yield
    L.set_fast_launch(None)


def test_fast_path_maps_each_key_to_jit_functions_own_kernel(admitted):
    """~60 specializations, each launched twice in a shuffled order through the wrapper and then
    through the ``JITFunction``: the kernel the wrapper launched is the very object Triton picked;
    arguments the wrapper gave one key all got one kernel from Triton; every cached entry is a
    value of ``JITFunction.device_caches[device][0]`` (Triton's kernel cache); outputs are equal
    bit for bit; and most second launches were fast hits."""
    jit_fn = _contract_kernel
    wrapper = L.fast_kernel(jit_fn)
    assert wrapper.off_reason is None, wrapper.off_reason
    specs = _specs(60)
    order = specs + specs
    random.Random(1).shuffle(order)
    by_key = {}
    for xi, oi, n, a, flag, mode, warps in order:
        x = _tensor(*_X[xi])
        # zeroed: the kernel writes only the first n of the 64 elements, the rest must compare equal too
        out_fast, out_ref = _tensor(*_OUT[oi]).zero_(), _tensor(*_OUT[oi]).zero_()
        args = (x, out_fast, n, a, 0.5, flag)
        kwargs = dict(BLOCK=64, MODE=mode, num_warps=warps)
        got = wrapper[(1,)](*args, **kwargs)
        want = jit_fn[(1,)](x, out_ref, n, a, 0.5, flag, **kwargs)
        torch.cuda.synchronize()
        assert got is want, f"the fast path launched another kernel for {(xi, oi, n, a, flag, mode, warps)}"
        assert torch.equal(out_fast, out_ref)
        key = (wrapper._keyfn(*args), tuple(kwargs.items()))
        assert by_key.setdefault(key, want) is want, f"one key, two Triton kernels: {key}"
    kernel_cache = jit_fn.device_caches[torch.cuda.current_device()][0]
    cached = {id(k) for k in kernel_cache.values()}
    entries = list(wrapper._cache.values())
    assert entries and all(id(entry[-1]) in cached for entry in entries)
    assert wrapper.fast_hits >= len(specs) // 2 and wrapper.off_reason is None
