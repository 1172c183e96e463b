"""Tests of liger_losses/kernels/launch.py (the low-overhead launcher).

On the CPU: the wrapper under the interpreter equals the plain kernel bit for bit; the key
function is a refinement of Triton's own argument specialization (checked against
``native_specialize_impl``, the function ``JITFunction`` uses); the fast path's bookkeeping
(hits, tails of constexprs, fallbacks) is exercised against a fake ``JITFunction.run`` that
emulates Triton's choice of compiled kernel and flags any launch through a kernel compiled for
other argument classes. On the GPU (``-m gpu``): real launches, fast vs slow bit for bit.
"""

import inspect
import itertools

import pytest
import torch

from liger_losses.kernels import launch as L
from liger_losses.kernels.utils import import_triton

triton, tl = import_triton()
pytestmark = pytest.mark.skipif(triton is None, reason="needs triton")

if triton is not None:

    @triton.jit
    def _axpb_kernel(x_ptr, y_ptr, a, b, n, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if SQUARE:
            x = x * x
        tl.store(y_ptr + offs, (x * a + b).to(y_ptr.dtype.element_ty), mask=mask)


def _toy(x_ptr, y_ptr, a, n, flag, BLOCK: "tl.constexpr", MODE: "tl.constexpr" = 0):
    """Body never runs: only the signature matters for the fake-launch tests."""
    pass


@pytest.fixture(autouse=True)
def _fresh_switch():
    """Each test starts from the environment's setting and leaves it so."""
    L.set_fast_launch(None)
    yield
    L.set_fast_launch(None)


# --------------------------------------------------------------------------- interpreter (CPU)


def _launch_axpb(k, x, y, a, b, square=False):
    n = x.numel()
    k[(triton.cdiv(n, 64),)](x, y, a, b, n, BLOCK=64, SQUARE=square, num_warps=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU only)")
def test_interpreter_wrapper_equals_plain_kernel():
    """Under TRITON_INTERPRET=1 the wrapper is the plain kernel: outputs equal bit for bit for
    fp32 and bf16 outputs, both constexpr values, an int n = 1 and a misaligned view; every
    launch counts as slow and the reason names the interpreter."""
    k = L.fast_kernel(_axpb_kernel)
    assert k.off_reason and "INTERPRET" in k.off_reason
    L.launch_stats(reset=True)
    cases = [
        (torch.randn(100), torch.float32, False),
        (torch.randn(101)[1:], torch.bfloat16, True),
        (torch.randn(1), torch.float32, True),
    ]
    for x, out_dtype, square in cases:
        y_ref = torch.empty(x.shape, dtype=out_dtype)
        y = torch.empty(x.shape, dtype=out_dtype)
        _launch_axpb(_axpb_kernel, x, y_ref, 1.5, -0.25, square)
        _launch_axpb(k, x, y, 1.5, -0.25, square)
        assert torch.equal(y, y_ref)
    stats = L.launch_stats()
    assert stats["fast"] == 0 and stats["slow"] == len(cases)
    assert k.slow_launches == len(cases)


def test_fast_kernel_rejects_non_kernels():
    """A plain function (no ``[grid]`` launch syntax) is a TypeError naming jit_fn; a bad
    ``set_fast_launch`` value is a TypeError."""
    with pytest.raises(TypeError, match="jit_fn"):
        L.fast_kernel(lambda x: x)
    with pytest.raises(TypeError, match="enabled"):
        L.set_fast_launch("yes")


def test_env_switch(monkeypatch):
    """LIGER_LOSSES_FAST_LAUNCH=0 switches the fast path off for existing and new wrappers (their
    reason names the variable); unsetting it switches it back on."""
    k = L.fast_kernel(_axpb_kernel)
    monkeypatch.setenv(L.ENV_SWITCH, "0")
    L.set_fast_launch(None)
    assert not L.fast_launch_enabled()
    assert L.ENV_SWITCH in k.off_reason
    assert L.ENV_SWITCH in L.fast_kernel(_axpb_kernel).off_reason
    monkeypatch.delenv(L.ENV_SWITCH)
    L.set_fast_launch(None)
    assert L.fast_launch_enabled()
    assert k.off_reason is None or L.ENV_SWITCH not in k.off_reason


@pytest.mark.parametrize("version", ["3.5.1", "3.7.0", "3.10.0", "4.0.0"])
def test_untested_triton_versions_keep_the_slow_path(fake, monkeypatch, version):
    """On any triton minor version outside TESTED_TRITON_VERSIONS the wrapper refuses the fast path
    (its reason names the version and the tested ones; LIGER_LOSSES_FAST_LAUNCH=force no longer
    overrides it) and every launch goes through the JITFunction."""
    k, ft = fake
    monkeypatch.setattr(triton, "__version__", version)
    monkeypatch.setenv(L.ENV_SWITCH, "force")
    L.set_fast_launch(None)
    assert k.off_reason is not None and "not tested" in k.off_reason
    assert version.rsplit(".", 1)[0] in k.off_reason and "3.6" in k.off_reason and "3.9" in k.off_reason
    x = torch.zeros(16)
    for _ in range(3):
        k[(1,)](x, x, 1.0, 16, None, BLOCK=16)
    assert k.fast_hits == 0 and k.slow_launches == 3 and not ft.wrong
    assert L.triton_minor_version(triton) == version.rsplit(".", 1)[0]


def test_pyproject_triton_range_spans_the_tested_versions(monkeypatch):
    """pyproject.toml's triton requirement is the span of the tested minor versions: of every X.Y.0
    and X.Y.5 from 3.0 to 4.2 it admits exactly those from the lowest tested minor up to the
    highest (the minors between them too: the kernels run there through ``JITFunction``), and
    the launcher's fast path is refused, naming the version, on every admitted minor that is not
    in TESTED_TRITON_VERSIONS. Exact comparisons of version sets (no tolerance)."""
    import pathlib
    import re

    from packaging.specifiers import SpecifierSet

    text = (pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    spec = SpecifierSet(re.search(r'"triton([^;"]+)', text).group(1))
    tested = sorted(tuple(int(p) for p in v.split(".")) for v in L.TESTED_TRITON_VERSIONS)
    lowest, highest = tested[0], tested[-1]
    admitted_minors = set()
    for major, minor, patch in itertools.product((3, 4), range(13), (0, 5)):
        if (major, minor) > (4, 2):
            continue
        admitted = f"{major}.{minor}.{patch}" in spec
        assert admitted == (lowest <= (major, minor) <= highest), (major, minor, patch)
        if admitted:
            admitted_minors.add(f"{major}.{minor}")
    assert set(L.TESTED_TRITON_VERSIONS) <= admitted_minors
    for version in sorted(admitted_minors):
        monkeypatch.setattr(triton, "__version__", f"{version}.0")
        reason = L._triton_unsupported_reason()
        if version in L.TESTED_TRITON_VERSIONS:
            assert reason is None or "not tested" not in reason, (version, reason)
        else:
            assert reason is not None and f"triton {version} not tested" in reason, (version, reason)


# --------------------------------------------------------------------------- key logic


def _key(*args):
    return L.make_key_fn(L.arg_kinds(args))(*args)


def test_key_distinguishes_specialization_classes():
    """Aligned vs misaligned pointer, dtype, int 1 / 16 / 17 / 2**33 / 2**33+1 / 2**63, bool vs
    int, float vs None give different keys; two arguments of the same classes give the same key."""
    x = torch.zeros(64)
    assert _key(x) != _key(x[1:])
    assert _key(x) == _key(x[4:]) == _key(torch.ones(3))
    assert _key(x) != _key(x.to(torch.bfloat16))
    ints = [1, 16, 17, 2**33, 2**33 + 1, 2**63]
    keys = [_key(v) for v in ints]
    assert len(set(keys)) == len(ints)
    assert _key(32) == _key(16) == _key(0) and _key(17) == _key(3) and _key(2**33) == _key(2**31)
    assert _key(True) != _key(1) and _key(1.0) != _key(1) and _key(None) != _key(1.0)
    assert _key(x, 5, 2.0) == _key(torch.ones(2), 7, -1.0)


def test_key_fn_other_kinds_do_not_alias():
    """A key function learned for (tensor, int) raises (an int where the tensor was) or gives a
    different key (a bool or float where the int was) when called with other kinds."""
    fn = L.make_key_fn(("t", "i"))
    x = torch.zeros(4)
    base = fn(x, 1)
    with pytest.raises(AttributeError):
        fn(3, 1)
    assert fn(x, True) != base
    assert fn(x, 1.0) != base
    with pytest.raises(ValueError, match="kinds"):
        L.make_key_fn(("t", "x"))


def _native_spec():
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:  # pragma: no cover - triton < 3.6 specializes in Python
        pytest.skip("triton has no native_specialize_impl")
    return lambda v: native_specialize_impl(BaseBackend, v, False, True, True)


def _battery():
    x = torch.zeros(64)
    values = [0, 1, -1, 2, 15, 16, 17, 32, -16, -17, 2**31 - 1, 2**31, 2**31 + 16, -(2**31),
              -(2**31) - 1, -(2**31) - 16, -(2**63), 2**33, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16,
              2**64 - 1, True, False, 0.0, 1.0, 16.0, None,
              x, x[1:], x[4:], x[2:], x.to(torch.bfloat16), x.to(torch.bfloat16)[8:],
              x.to(torch.bfloat16)[1:], x.to(torch.int64), torch.nn.Parameter(torch.zeros(3))]
    g = torch.Generator().manual_seed(1)
    values += [int(v) for v in torch.randint(-(2**40), 2**40, (40,), generator=g)]
    return values


def test_key_refines_triton_specialization():
    """For every pair of values in a battery (ints around 1, 16, the int32/int64/uint64 bounds,
    bools, floats, None, aligned/misaligned tensors of several dtypes, a Parameter): equal keys
    imply equal Triton specializations (type string and divisibility attribute), as computed by
    the installed triton's ``native_specialize_impl``. Exact check, no tolerance."""
    spec = _native_spec()
    by_key = {}
    for v in _battery():
        by_key.setdefault(_key(v), set()).add(spec(v))
    bad = {k: s for k, s in by_key.items() if len(s) > 1}
    assert not bad, bad
    assert len(by_key) >= 12  # the battery really spans many classes


# --------------------------------------------------------------------------- fast path, faked


class _FakeCompiled:
    """Stands for a CompiledKernel: ``run`` records each launch and flags one whose arguments do
    not belong to the specialization this kernel was 'compiled' for."""

    def __init__(self, spec, owner):
        self.spec, self.owner = spec, owner
        self.function, self.packed_metadata = id(self), ("packed", id(self))

    @property
    def run(self):
        return self._run

    def _run(self, g0, g1, g2, stream, function, packed, md, enter, exit_, *args):
        assert function == self.function and packed == self.packed_metadata
        self.owner.launches.append((self.spec, (g0, g1, g2), stream, args))
        if self.owner.spec_of(args, self.spec[1]) != self.spec:
            self.owner.wrong.append((self.spec, args))


class _FakeTriton:
    """Replaces ``JITFunction.run`` of a real ``JITFunction`` (built from ``_toy`` on the CPU):
    binds the arguments like Triton, specializes them with ``native_specialize_impl``, picks or
    'compiles' a kernel per (specialization, options) and launches it through ``kernel.run``
    with the bound arguments in parameter order, as triton 3.6/3.9 do."""

    def __init__(self, jf, spec):
        self.jf, self.spec1 = jf, spec
        self.kernels, self.launches, self.wrong, self.slow_calls = {}, [], [], 0
        self.sig = inspect.signature(jf.fn)

    def spec_of(self, values, options):
        parts = tuple(
            ("constexpr", v) if p.is_constexpr else self.spec1(v) for p, v in zip(self.jf.params, values)
        )
        return (parts, options)

    def run(self, *args, grid, warmup, **kwargs):
        self.slow_calls += 1
        names = set(self.sig.parameters)
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
        bound = self.sig.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
        bound.apply_defaults()
        values = tuple(bound.arguments.values())
        spec = self.spec_of(values, options)
        kernel = self.kernels.setdefault(spec, _FakeCompiled(spec, self))
        g = tuple(grid(dict(bound.arguments)) if callable(grid) else grid) + (1, 1)
        kernel.run(g[0], g[1], g[2], 777, kernel.function, kernel.packed_metadata, None, None, None, *values)
        return kernel


@pytest.fixture
def fake(monkeypatch):
    """(FastKernel, _FakeTriton) with the interpreter switched off for the wrapper and the driver's
    device/stream getters faked (device 0, stream 777)."""
    from triton.runtime.jit import JITFunction

    spec = _native_spec()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv(L.ENV_SWITCH, raising=False)
    monkeypatch.setattr(L, "_driver_functions", lambda: ((lambda: 0), (lambda dev: 777)))
    jf = JITFunction(_toy)
    ft = _FakeTriton(jf, spec)
    monkeypatch.setattr(jf, "run", ft.run)
    L.set_fast_launch(None)
    k = L.fast_kernel(jf)
    assert k.off_reason is None, k.off_reason
    return k, ft


def test_fast_path_uses_the_kernel_triton_would_pick(fake):
    """400 launches with random arguments drawn from several specialization classes (aligned /
    misaligned fp32/bf16 tensors, ints 1/16/17/2**33/random, float/bool/None, two constexpr
    values, two num_warps): most are fast hits; no launch, fast or slow, went through a kernel
    compiled for another specialization; fast launches pass the same arguments (constexprs
    appended in parameter order), grid and stream as Triton's own launch."""
    k, ft = fake
    g = torch.Generator().manual_seed(0)
    base = torch.zeros(64)
    tensors = [base, base[1:], base[4:], base.to(torch.bfloat16), base.to(torch.bfloat16)[1:]]
    ints = [1, 16, 17, 2**33, 48, 5]
    others = [0.5, True, None]
    for i in range(400):
        r = torch.randint(0, 1000, (6,), generator=g).tolist()
        x, y = tensors[r[0] % 5], tensors[(r[1] % 2) * 3]
        a, n, flag = float(r[2]), ints[r[3] % 6], others[r[4] % 3]
        kw = dict(BLOCK=64, num_warps=4) if r[5] % 2 else dict(BLOCK=128, num_warps=8)
        if r[5] % 4 == 0:
            kw["MODE"] = 1
        before = len(ft.launches)
        k[(r[0] % 7 + 1,)](x, y, a, n, flag, **kw)
        assert len(ft.launches) == before + 1
        spec, grid, stream, args = ft.launches[-1]
        assert grid == (r[0] % 7 + 1, 1, 1) and stream == 777
        assert len(args) == 7 and all(u is v for u, v in zip(args[:5], (x, y, a, n, flag)))
        assert args[5:] == (kw["BLOCK"], kw.get("MODE", 0))
    assert not ft.wrong
    assert k.fast_hits > 150 and k.slow_launches == ft.slow_calls
    assert k.fast_hits + k.slow_launches == 400
    assert k.slow_launches >= len(ft.kernels)


def test_fast_path_fallbacks(fake):
    """Slow path (never a wrong kernel) for: a float or bool where the int was learned, a
    runtime argument by keyword, a callable grid, an installed launch-enter hook and a pre-run
    hook; the fast path resumes afterwards. A fast launch that raises while the slow path works
    turns the fast path off for that kernel (with a reason)."""
    from triton import knobs

    k, ft = fake
    x = torch.zeros(32)
    launch = lambda *a, **kw: k[(1,)](*a, BLOCK=32, **kw)  # noqa: E731
    launch(x, x, 1.0, 16, None)
    launch(x, x, 1.0, 16, None)
    assert k.fast_hits == 1
    slow0 = k.slow_launches
    launch(x, x, 1.0, 16.0, None)          # float where an int was learned
    launch(x, x, 1.0, True, None)          # bool where an int was learned
    launch(x, x, 1.0, True, None)
    k[(1,)](x, x, 1.0, 16, flag=None, BLOCK=32)  # runtime arg by keyword
    k[(1,)](x, x, 1.0, 16, flag=None, BLOCK=32)
    k[lambda meta: (1,)](x, x, 1.0, 16, None, BLOCK=32)
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch(x, x, 1.0, 16, None)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    ft.jf.add_pre_run_hook(lambda *a, **kw: None)
    launch(x, x, 1.0, 16, None)
    ft.jf.pre_run_hooks.clear()
    assert k.slow_launches == slow0 + 8 and k.fast_hits == 1
    launch(x, x, 1.0, 16, None)
    assert k.fast_hits == 2 and not ft.wrong

    def boom(*a):
        raise RuntimeError("boom")

    for key, entry in list(k._cache.items()):
        k._cache[key] = (boom,) + entry[1:]
    launch(x, x, 1.0, 16, None)
    assert k.off_reason and "boom" in k.off_reason
    launch(x, x, 1.0, 16, None)
    assert k.fast_hits == 2 and not ft.wrong
    assert L.launch_stats()["off"][k.name] == k.off_reason


def test_constexpr_by_position_never_reuses_another_value(fake):
    """A constexpr passed by position (its value is not in the key) keeps the slow path: BLOCK=64
    then BLOCK=128 by position never launches the kernel compiled for the other value."""
    k, ft = fake
    x = torch.zeros(128)
    for block in (64, 64, 128, 128, 64):
        k[(1,)](x, x, 1.0, 16, None, block)
    assert k.fast_hits == 0 and not ft.wrong


def test_tensor_where_int_was_learned_takes_the_slow_path(fake):
    """A tensor in a position learned as an int gives its own key without any tensor arithmetic
    in the key (no ``&``/comparison on the tensor), and never a wrong kernel."""
    k, ft = fake
    x = torch.zeros(32)
    k[(1,)](x, x, 1.0, 16, None, BLOCK=32)
    k[(1,)](x, x, 1.0, 16, None, BLOCK=32)
    hits = k.fast_hits

    class NoArithmetic(torch.Tensor):
        def __and__(self, other):
            raise AssertionError("the key did arithmetic on a tensor")

        __le__ = __ge__ = __eq__ = __and__

    t = torch.tensor(16).as_subclass(NoArithmetic)
    key = L.make_key_fn(L.arg_kinds((x, x, 1.0, 16, None)))(x, x, 1.0, t, None)
    assert key != L.make_key_fn(L.arg_kinds((x, x, 1.0, 16, None)))(x, x, 1.0, 16, None)
    assert k.fast_hits == hits and not ft.wrong


def test_torch_compile_tracing_sees_the_jit_function(fake, monkeypatch):
    """While torch.compile traces (``torch.compiler.is_compiling()``), indexing the wrapper gives
    triton's own ``JITFunction`` launcher (what the compiler knows how to trace), not the wrapper's
    fast path; the launch still reaches the kernel."""
    k, ft = fake
    x = torch.zeros(32)
    monkeypatch.setattr(L, "is_compiling", lambda: True)
    before = k.slow_launches + k.fast_hits
    for _ in range(3):
        k[(1,)](x, x, 1.0, 16, None, BLOCK=32)
    assert k.slow_launches + k.fast_hits == before  # the wrapper was bypassed
    assert len(ft.launches) >= 3 and not ft.wrong


def test_fast_path_bad_input_still_raises(fake):
    """An argument Triton cannot specialize (a string) raises Triton's own TypeError through the
    wrapper, and does not turn the fast path off."""
    k, ft = fake
    x = torch.zeros(8)
    k[(1,)](x, x, 1.0, 3, None, BLOCK=8)
    with pytest.raises(TypeError):
        k[(1,)](x, x, 1.0, "3", None, BLOCK=8)
    assert k.off_reason is None


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_toy_fast_equals_slow():
    """Real launches of the toy kernel with changing inputs (fp32/bf16, aligned then misaligned
    views, n = 1 after other sizes, both constexprs, a second CUDA stream): outputs of the
    wrapper equal the plain kernel's bit for bit, and the fast path was taken."""
    L.set_fast_launch(None)
    k = L.fast_kernel(_axpb_kernel)
    assert k.off_reason is None, k.off_reason
    base = torch.randn(4097, device="cuda")
    xs = [base[:4096], base[1:], base[:1], base[4:4100 - 4], base.to(torch.bfloat16)[1:]]
    side = torch.cuda.Stream()
    for rep in range(3):
        for i, x in enumerate(xs):
            for square in (False, True):
                for stream in (torch.cuda.current_stream(), side):
                    with torch.cuda.stream(stream):
                        y_ref = torch.full_like(x, float("nan"))
                        y = torch.full_like(x, float("nan"))
                        _launch_axpb(_axpb_kernel, x, y_ref, 0.75 + i, 0.5, square)
                        _launch_axpb(k, x, y, 0.75 + i, 0.5, square)
                    stream.synchronize()
                    assert torch.equal(y, y_ref), (rep, i, square)
    assert k.fast_hits > 0 and k.off_reason is None


@pytest.mark.gpu
def test_gpu_rms_norm_forward_through_wrapper(monkeypatch):
    """RMSNorm's forward kernel, swapped for its wrapper at the module level and launched by the
    library's own ``_forward`` many times (bf16/fp32, several shapes, a misaligned view): outputs
    and rstd equal the unwrapped launches bit for bit; fast hits > 0."""
    from liger_losses.kernels import rms_norm as R

    plain = getattr(R._rms_norm_fwd_kernel, "jit_fn", R._rms_norm_fwd_kernel)  # unwrapped
    wrapped = L.fast_kernel(plain)
    monkeypatch.setattr(R, "_rms_norm_fwd_kernel", plain)  # references through JITFunction launches
    shapes = [(8, 256), (3, 1000), (1, 4096), (64, 4096)]
    for dtype in (torch.float32, torch.bfloat16):
        for rows, h in shapes:
            for view in (False, True):
                x = torch.randn(rows * h + (1 if view else 0), device="cuda", dtype=dtype)
                x = (x[1:] if view else x).view(rows, h)
                w = torch.randn(h, device="cuda", dtype=dtype)
                out_ref = torch.empty_like(x)
                rstd_ref = R._forward(x, w, 1e-6, 0.0, "llama", out_ref)
                for _ in range(3):
                    out = torch.empty_like(x)
                    monkeypatch.setattr(R, "_rms_norm_fwd_kernel", wrapped)
                    rstd = R._forward(x, w, 1e-6, 0.0, "llama", out)
                    monkeypatch.setattr(R, "_rms_norm_fwd_kernel", plain)
                    torch.cuda.synchronize()
                    assert torch.equal(out, out_ref) and torch.equal(rstd, rstd_ref)
    assert wrapped.fast_hits > 0 and wrapped.off_reason is None
