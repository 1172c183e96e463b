"""How the package behaves while ``torch.compile`` traces (``kernels/utils.py``): the chunked losses
run eagerly behind one graph break (``eager_under_compile``), the layers' ``impl="auto"`` takes the
PyTorch path (``resolve_impl``). ``aot_eager`` traces without generating code, so these run on the
CPU; values are compared exactly (the same ops run). A compiled patched model is
tests/patching/test_causal_lm.py's (CPU) and tests/patching/test_gpu.py's (Inductor, GPU)."""

import inspect

import pytest
import torch

import liger_losses
from liger_losses.kernels.utils import eager_under_compile, is_compiling, resolve_impl


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_eager_under_compile_runs_the_function_outside_the_graph():
    """The wrapped function sees ``is_compiling() == False`` and may read the host (``.item()``)
    under a compiled caller; value and gradient equal eager's exactly; one graph on each side."""
    from torch._dynamo.utils import counters

    seen = []

    @eager_under_compile
    def host_reading_loss(x):
        seen.append(is_compiling())
        return x.square().sum() / x.abs().max().item()

    def step(x):
        return host_reading_loss(torch.sin(x)) * 2

    x = torch.randn(7, requires_grad=True)
    want = step(x)
    want.backward()
    want_grad, x.grad = x.grad, None
    counters.clear()
    got = torch.compile(step, backend="aot_eager")(x)
    got.backward()
    assert seen == [False, False]
    assert torch.equal(got, want) and torch.equal(x.grad, want_grad)
    assert counters["stats"]["unique_graphs"] == 2
    assert host_reading_loss.__name__ == "host_reading_loss"  # functools.wraps


def test_auto_takes_the_torch_path_while_compiling():
    """``resolve_impl("auto")`` is "torch" inside a traced function (Inductor generates the layer),
    and whatever it is outside; "torch"/"triton" are left as asked."""
    x = torch.zeros(2)
    outside = resolve_impl("auto", x)
    inside = {}

    def probe(t):
        inside["auto"] = resolve_impl("auto", t)
        inside["torch"] = resolve_impl("torch", t)
        return t + 1

    torch.compile(probe, backend="aot_eager")(x)
    assert inside == {"auto": "torch", "torch": "torch"}
    assert resolve_impl("auto", x) == outside


def _public_losses():
    names = [n for n in liger_losses.__all__ if n.startswith("fused_linear_") or n == "cross_entropy"]
    return [getattr(liger_losses, n) for n in names]


@pytest.mark.parametrize("fn", _public_losses(), ids=lambda f: f.__name__)
def test_every_public_loss_runs_eagerly_under_compile(fn):
    """Each public loss function carries the wrapper (its chunk loops and host reads would split a
    compiled graph at every read, and its tuned tile launches are not Inductor's to recompile);
    the wrapper keeps the signature users read."""
    assert getattr(fn, "runs_eagerly_under_compile", False), fn.__name__
    assert "weight" in inspect.signature(fn).parameters or fn.__name__ == "cross_entropy"


def _loss_modules():
    return [getattr(liger_losses, n) for n in liger_losses.__all__ if n.startswith("LigerFusedLinear")]


@pytest.mark.parametrize("cls", _loss_modules(), ids=lambda c: c.__name__)
def test_every_loss_module_runs_eagerly_under_compile(cls):
    """The loss modules reach their runners through ``ChunkedLossModule.run``, which carries the
    wrapper too (``LigerCrossEntropyLoss`` calls the wrapped ``cross_entropy``)."""
    from liger_losses.chunked.module import ChunkedLossModule

    assert issubclass(cls, ChunkedLossModule)
    assert getattr(cls.run, "runs_eagerly_under_compile", False), cls.__name__


def test_a_compiled_caller_of_a_loss_module_is_two_graphs():
    """A loss module inside a compiled function: the module's chunk loop runs eagerly (one graph
    before, one after), its value equal to eager's exactly."""
    from torch._dynamo.utils import counters

    loss_fn = liger_losses.LigerFusedLinearCrossEntropyLoss()
    weight = torch.randn(32, 8)
    labels = torch.randint(0, 32, (12,))

    def step(h):
        return loss_fn(weight, torch.sin(h), labels) * 2

    h = torch.randn(12, 8)
    want = step(h)
    counters.clear()
    got = torch.compile(step, backend="aot_eager")(h)
    assert torch.equal(got, want)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
