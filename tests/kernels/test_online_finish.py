"""Tests of ``kernels/online_finish.py``: a chunk's statistics and hidden gradient from its online
softmax state.

The state and accumulator are built in float64 from random logits whose softmax-weighted row sums
are known exactly, so the PyTorch path (float64 state) is held to the closed forms at 1e-12
(summation order alone). The Triton kernel (the CPU interpreter, fp32 state) is held to the PyTorch
path run on the same fp32 state at 1e-6 (fp32 arithmetic: a log, a division and a sum of two
products per element); its bf16 output rows to one bf16 rounding (2^-7 relative, the interpreter
rounds toward zero). The argmax hits are compared exactly.
"""

import pytest
import torch

from liger_losses.kernels.online_block import OnlineState
from liger_losses.kernels.online_finish import online_finish
from liger_losses.kernels.utils import triton_runs_on
from tests.helpers import rel_err

N_ROWS, H, V = 7, 40, 90


def _problem(dtype=torch.float64, seed=0):
    """``(state, acc, weight, labels, z)`` of ``N_ROWS`` rows whose logits ``z [n, V]`` are known: the
    state as the block loop leaves it (a reference below the maximum by up to TAU) and
    ``acc = exp(z - ref) @ W`` (no softcap: ``d = 1``)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N_ROWS, V, generator=g, dtype=torch.float64) * 3
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N_ROWS,), generator=g)
    labels[2] = int(z[2].argmax())  # one argmax hit at least
    for row, (label, other) in ((4, (20, 10)), (5, (10, 20))):  # the maximum tied: a miss, then a hit
        z[row, [label, other]] = z[row].max() + 1.0
        labels[row] = label
    ref = z.max(1).values - torch.rand(N_ROWS, generator=g, dtype=torch.float64) * 10
    e = torch.exp(z - ref[:, None])
    state = OnlineState(ref=ref, sumexp=e.sum(1), zexp=(e * z).sum(1), zsum=z.sum(1), zmax=z.max(1).values,
                        z_y=z.gather(1, labels[:, None]).squeeze(1), d_y=torch.ones(N_ROWS, dtype=torch.float64),
                        zpre=torch.where(torch.arange(V) < labels[:, None], z, float("-inf")).max(1).values)
    acc = e @ w
    cast = OnlineState(*(getattr(state, k).to(dtype) for k in vars(state)))
    return cast, acc.to(dtype), w.to(dtype), labels, z


def _stats(n, dtype, entropy=True):
    out = {k: torch.full((n,), float("nan"), dtype=dtype) for k in ("loss", "lse", "logp")}
    out["correct"] = torch.zeros(n, dtype=torch.bool)
    if entropy:
        out["entropy"] = torch.full((n,), float("nan"), dtype=dtype)
    return out


def _closed_form(z, w, labels, scale, mode, eps, z_w):
    """Statistics and gradient rows from the logits in float64 (the module docstring's formulas)."""
    lse = torch.logsumexp(z, 1)
    p = torch.softmax(z, 1)
    logp = z.gather(1, labels[:, None]).squeeze(1) - lse
    w_y = w[labels]
    if mode == "ce":
        loss = (1 - eps) * (-logp) + z_w * lse**2 + eps * (lse - z.mean(1))
        g = scale[:, None] * ((1 + 2 * z_w * lse)[:, None] * (p @ w) - (1 - eps) * w_y - eps * w.mean(0))
    else:
        loss = logp
        g = scale[:, None] * (w_y - p @ w)
    entropy = lse - (p * z).sum(1)
    return dict(loss=loss, lse=lse, logp=logp, entropy=entropy), g


CASES = {
    "ce": dict(mode="ce", eps=0.0, z_w=0.0),
    "ce_smoothing_zloss": dict(mode="ce", eps=0.1, z_w=0.01),
    "logp": dict(mode="logp", eps=0.0, z_w=0.0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_path_matches_closed_form(name):
    """float64 state: every statistic and the gradient rows at 1e-12 of the closed forms."""
    case = CASES[name]
    state, acc, w, labels, z = _problem()
    scale = torch.rand(N_ROWS, dtype=torch.float64) + 0.5
    stats, out = _stats(N_ROWS, torch.float64), torch.empty(N_ROWS, H, dtype=torch.float64)
    online_finish(state, acc, w, labels, mode=case["mode"], scale=scale, out=out, out_rows=None, stats=stats,
                  label_smoothing=case["eps"], z_loss_weight=case["z_w"], dz_dx=1.0, w_mean=w.mean(0), impl="torch")
    want, g = _closed_form(z, w, labels, scale, **case)
    for k in ("loss", "lse", "logp", "entropy"):
        assert rel_err(stats[k], want[k]) <= 1e-12, k
    assert torch.equal(stats["correct"], z.argmax(1) == labels)  # the first maximal column
    assert bool(stats["correct"][2]) and bool(stats["correct"][5]) and not bool(stats["correct"][4])
    assert rel_err(out, g) <= 1e-12


def _both(case, *, scale, out_dtype, scatter, entropy):
    """The Triton (interpreter) and PyTorch results on the same fp32 state: ``[(stats, out)] * 2``."""
    state, acc, w, labels, _ = _problem(torch.float32, seed=1)
    results = []
    for impl in ("triton", "torch"):
        stats = _stats(N_ROWS, torch.float32, entropy)
        if scatter:  # rows written at positions of a larger output whose other rows stay untouched
            out_rows = torch.tensor([9, 0, 4, 12, 2, 7, 5])
            out = torch.full((13, H), 7.0, dtype=out_dtype)
        else:
            out_rows, out = None, torch.full((N_ROWS, H), 7.0, dtype=out_dtype)
        online_finish(state, acc, w.to(out_dtype), labels, mode=case["mode"], scale=scale, out=out,
                      out_rows=out_rows, stats=stats, label_smoothing=case["eps"], z_loss_weight=case["z_w"],
                      dz_dx=1.3, w_mean=w.mean(0), impl=impl)
        results.append((stats, out))
    return results


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("scale_kind", ["float", "one", "rows"])
@pytest.mark.parametrize("scatter", [False, True], ids=["rows", "scatter"])
def test_triton_matches_torch(name, scale_kind, scatter):
    """Interpreter vs PyTorch on the same fp32 state: statistics and gradient rows within 1e-6, the
    hits equal, the rows not written left as they were; the scale as a float, a one-entry tensor
    and one entry per row."""
    if not triton_runs_on(torch.device("cpu")):
        pytest.skip("Triton cannot run here")
    scale = {"float": 0.25, "one": torch.tensor([0.25]), "rows": torch.rand(N_ROWS) + 0.5}[scale_kind]
    (s1, o1), (s2, o2) = _both(CASES[name], scale=scale, out_dtype=torch.float32, scatter=scatter, entropy=True)
    for k in ("loss", "lse", "logp", "entropy"):
        assert rel_err(s1[k], s2[k]) <= 1e-6, k
    assert torch.equal(s1["correct"], s2["correct"])
    assert rel_err(o1, o2) <= 1e-6
    if scatter:
        untouched = torch.ones(13, dtype=torch.bool)
        untouched[[9, 0, 4, 12, 2, 7, 5]] = False
        assert (o1[untouched] == 7.0).all()


def test_triton_bf16_rows_without_entropy():
    """bf16 gradient rows (bf16 weight) within one bf16 rounding of the PyTorch path's; without
    ``entropy`` in ``stats`` nothing else changes."""
    if not triton_runs_on(torch.device("cpu")):
        pytest.skip("Triton cannot run here")
    (s1, o1), (s2, o2) = _both(CASES["ce"], scale=0.5, out_dtype=torch.bfloat16, scatter=False, entropy=False)
    assert "entropy" not in s1
    assert rel_err(o1, o2) <= 2**-7
    for k in ("loss", "lse", "logp"):
        assert rel_err(s1[k], s2[k]) <= 1e-6, k


def test_bad_arguments_raise():
    """Shapes, the mode and a smoothing without the weight's mean are checked before any launch."""
    state, acc, w, labels, _ = _problem(torch.float32)
    stats, out = _stats(N_ROWS, torch.float32), torch.empty(N_ROWS, H)
    kw = dict(scale=1.0, stats=stats, impl="torch")
    with pytest.raises(ValueError, match="mode"):
        online_finish(state, acc, w, labels, mode="kl", out=out, out_rows=None, **kw)
    with pytest.raises(ValueError, match="labels"):
        online_finish(state, acc, w, labels[:3], mode="ce", out=out, out_rows=None, **kw)
    with pytest.raises(ValueError, match="n=7 rows"):
        online_finish(state, acc, w, labels, mode="ce", out=out[:3], out_rows=None, **kw)
    with pytest.raises(ValueError, match="out_rows"):
        online_finish(state, acc, w, labels, mode="ce", out=out, out_rows=torch.arange(3), **kw)
    with pytest.raises(ValueError, match="w_mean"):
        online_finish(state, acc, w, labels, mode="ce", out=out, out_rows=None, label_smoothing=0.1, **kw)


@pytest.mark.parametrize("layout", ["strided", "expanded", "zero-dim"])
def test_scale_of_any_layout(layout):
    """A per-row scale that is a strided view, an expanded one-entry tensor or a 0-d tensor gives
    what its contiguous copy gives (Triton through the interpreter and PyTorch, 1e-6): the kernel
    reads a unit-stride copy."""
    if not triton_runs_on(torch.device("cpu")):
        pytest.skip("Triton cannot run here")
    base = torch.rand(2 * N_ROWS) + 0.5
    scale = {"strided": base[::2], "expanded": base[:1].expand(N_ROWS), "zero-dim": base[0]}[layout]
    state, acc, w, labels, _ = _problem(torch.float32, seed=2)
    outs = []
    for impl, s in (("triton", scale), ("torch", scale), ("torch", scale.contiguous())):
        stats, out = _stats(N_ROWS, torch.float32), torch.empty(N_ROWS, H)
        online_finish(state, acc, w, labels, mode="ce", scale=s, out=out, out_rows=None, stats=stats, impl=impl)
        outs.append(out)
    assert rel_err(outs[0], outs[2]) <= 1e-6
    assert torch.equal(outs[1], outs[2])


def test_scale_of_the_wrong_length_raises():
    """A per-row scale of another length than the rows: ValueError naming ``scale`` (the kernel
    would read past it)."""
    state, acc, w, labels, _ = _problem(torch.float32)
    for bad in (torch.ones(N_ROWS - 2), torch.ones(N_ROWS + 1), torch.ones(N_ROWS, 1)):
        for impl in ("torch", "triton"):
            with pytest.raises(ValueError, match="scale must be"):
                online_finish(state, acc, w, labels, mode="ce", scale=bad, out=torch.empty(N_ROWS, H),
                              out_rows=None, stats=_stats(N_ROWS, torch.float32), impl=impl)
