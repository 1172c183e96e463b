"""``patching/lora.py``: PEFT LoRA linears with the adapter added by one GEMM.

Under CPU bf16 autocast (and without autocast in one dtype) the fused forward and PEFT's compute
the same sum with different roundings (once vs three times), so both are held to a float64
evaluation of the same model: the fused forward's relative error (output, input gradient, every
adapter gradient) must be no worse than 1.25x PEFT's own plus 1e-3 of the dtype's unit roundoff (a
different rounding of the same numbers, not a different sum). Everywhere the fused forward does
not apply (mixed dtypes without autocast, adapters disabled or merged, mixed-adapter batches,
DoRA, adapter biases) the output and gradients must equal PEFT's exactly: the call is PEFT's own
forward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from liger_losses.patching import apply_liger_kernels
from liger_losses.patching.lora import lora_linear_forward, patch_lora_linears
from tests.helpers import rel_err
from tests.patching.tiny_models import tiny_batch, tiny_model

peft = pytest.importorskip("peft")

BF16_EPS = 2.0**-8


class TwoLinears(nn.Module):
    """x -> o(silu(q(x))): two adapted linears, the second with a base bias (a smooth activation: a
    ReLU kink flips a gradient entry whole wherever two roundings straddle zero)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(64, 96, bias=False)
        self.o = nn.Linear(96, 64)

    def forward(self, x):
        return self.o(torch.nn.functional.silu(self.q(x)))


def _peft_model(dtype=torch.bfloat16, seed=0, **lora_kwargs):
    torch.manual_seed(seed)
    base = TwoLinears().to(dtype)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q", "o"], **lora_kwargs)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model


def _run(model, x, *, autocast: bool, **call_kwargs):
    """Output and gradients (input first, then every parameter that has one, by name)."""
    x = x.detach().clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x, **call_kwargs)
    (out.double() ** 2).sum().backward()
    grads = {"x": x.grad.detach().clone()}
    grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    return out.detach(), grads


def test_autocast_as_accurate_as_peft():
    """bf16 weights, fp32 adapters (PEFT's default), CPU bf16 autocast: the fused forward's output
    and gradients are within the module docstring's bar of a float64 run of the same model."""
    ref_model = _peft_model()
    ours = copy.deepcopy(ref_model)
    assert patch_lora_linears(ours) == 2
    assert {p.dtype for n, p in ref_model.named_parameters() if "lora" in n} == {torch.float32}
    x = torch.randn(3, 10, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    exact = copy.deepcopy(ref_model).double()
    want_out, want = _run(exact, x.double(), autocast=False)
    peft_out, peft_grads = _run(ref_model, x, autocast=True)
    our_out, our_grads = _run(ours, x, autocast=True)
    assert our_out.dtype == peft_out.dtype == torch.bfloat16
    pairs = [("output", our_out, peft_out, want_out)] + [(k, our_grads[k], peft_grads[k], want[k]) for k in want]
    for name, got, theirs, ref in pairs:
        bar = 1.25 * rel_err(theirs, ref) + 1e-3 * BF16_EPS
        assert rel_err(got, ref) <= bar, name


def test_fused_path_is_taken_where_it_applies(monkeypatch):
    """The fused forward really runs under autocast and, without autocast, when input, base and
    adapters share a dtype (PEFT's forward is not called); a bf16 model with fp32 adapters
    without autocast calls PEFT's forward."""
    cls = type(_peft_model().base_model.model.q)
    calls = []
    original = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    model = _peft_model()
    patch_lora_linears(model)
    x = torch.randn(2, 5, 64).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    assert calls == []
    model(x)
    assert len(calls) == 2
    calls.clear()
    fp32 = _peft_model(dtype=torch.float32)
    patch_lora_linears(fp32)
    fp32(x.float())
    assert calls == []


def test_mixed_dtypes_without_autocast_are_peft_exactly():
    """A bf16 model with fp32 adapters and no autocast runs PEFT's forward (its fp32 adapter math
    and type promotion): output and gradients bitwise equal."""
    ref_model = _peft_model(dtype=torch.bfloat16)
    ours = copy.deepcopy(ref_model)
    patch_lora_linears(ours)
    x = torch.randn(2, 7, 64).bfloat16()
    out_a, g_a = _run(ref_model, x, autocast=False)
    out_b, g_b = _run(ours, x, autocast=False)
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(g_a[k], g_b[k]) for k in g_a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16_adapters"])
def test_one_dtype_without_autocast_as_accurate_as_peft(dtype):
    """No autocast, input, base and adapters in one dtype (fp32 training; bf16 adapters on a bf16
    model): the fused forward is held to float64 as under autocast, with that dtype's roundoff."""
    ref_model = _peft_model(dtype=dtype)
    ref_model.to(dtype)  # PEFT made the adapters fp32; this run keeps them in the model's dtype
    ours = copy.deepcopy(ref_model)
    patch_lora_linears(ours)
    x = torch.randn(3, 10, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    want_out, want = _run(copy.deepcopy(ref_model).double(), x.double(), autocast=False)
    peft_out, peft_grads = _run(ref_model, x, autocast=False)
    our_out, our_grads = _run(ours, x, autocast=False)
    eps = torch.finfo(dtype).eps
    pairs = [("output", our_out, peft_out, want_out)] + [(k, our_grads[k], peft_grads[k], want[k]) for k in want]
    for name, got, theirs, ref in pairs:
        assert got.dtype == theirs.dtype, name
        assert rel_err(got, ref) <= 1.25 * rel_err(theirs, ref) + 1e-3 * eps, name


@pytest.mark.parametrize("case", ["disabled", "merged", "dora", "lora_bias", "mixed_batch"])
def test_unfusable_cases_are_peft_exactly(case):
    """Under autocast, adapters disabled or merged, DoRA, adapter biases and mixed-adapter batches
    (``adapter_names``) run PEFT's own forward: output and gradients bitwise equal."""
    kwargs = dict(use_dora=True) if case == "dora" else dict(lora_bias=True) if case == "lora_bias" else {}
    ref_model = _peft_model(**kwargs)
    ours = copy.deepcopy(ref_model)
    patch_lora_linears(ours)
    x = torch.randn(2, 6, 64).bfloat16()
    call = {}
    if case == "mixed_batch":  # PEFT serves these in eval mode only
        call = dict(adapter_names=["default", "__base__"])
        ref_model.eval()
        ours.eval()
    for m in (ref_model, ours):
        if case == "merged":
            m.merge_adapter()
    if case == "disabled":
        with ref_model.disable_adapter():
            want = _run(ref_model, x, autocast=True)
        with ours.disable_adapter():
            got = _run(ours, x, autocast=True)
    else:
        want = _run(ref_model, x, autocast=True, **call)
        got = _run(ours, x, autocast=True, **call)
    assert torch.equal(want[0], got[0])
    assert want[1].keys() == got[1].keys()
    assert all(torch.equal(want[1][k], got[1][k]) for k in want[1])


def test_dropout_draws_peft_mask():
    """With lora_dropout 0.5 in training mode and the same seed, the fused forward drops the
    same entries as PEFT (its input is cast and dropped as PEFT's is): the outputs differ only by
    rounding (relative 2e-2, against ~0.3 for a different mask)."""
    ref_model = _peft_model(lora_dropout=0.5)
    ours = copy.deepcopy(ref_model)
    patch_lora_linears(ours)
    x = torch.randn(4, 16, 64).bfloat16()
    torch.manual_seed(5)
    want, _ = _run(ref_model, x, autocast=True)
    torch.manual_seed(5)
    got, _ = _run(ours, x, autocast=True)
    torch.manual_seed(6)
    other, _ = _run(ref_model, x, autocast=True)
    assert rel_err(got, want) <= 2e-2 < rel_err(other, want)


def _fused_flags(model):
    cls = peft.tuners.lora.layer.Linear
    return [getattr(mod.__dict__.get("forward"), "func", None) is lora_linear_forward
            for mod in model.modules() if isinstance(mod, cls)]


def test_apply_liger_kernels_patches_lora_linears():
    """``apply_liger_kernels`` binds the fused forward to every LoRA linear of a PEFT causal LM
    (``all-linear``: attention and MLP projections), not with ``lora=False``; patching twice binds
    it once; a non-bool ``lora`` is a TypeError. Under bf16 autocast the patched model's loss is
    PEFT's to within 5% of what the adapters change it by (adapters large enough to move it)."""
    base = tiny_model("llama", dtype=torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 1.0)
    plain = copy.deepcopy(model)
    off = copy.deepcopy(model)
    apply_liger_kernels(off, lora=False)
    assert not any(_fused_flags(off))
    apply_liger_kernels(model)
    apply_liger_kernels(model)
    flags = _fused_flags(model)
    assert len(flags) == 2 * 7 and all(flags)
    with pytest.raises(TypeError, match="lora must be a bool"):
        apply_liger_kernels(model, lora="yes")
    batch = tiny_batch(base.config)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain(**batch).loss.float()
        got = model(**batch).loss.float()
        with plain.disable_adapter():
            without = plain(**batch).loss.float()
    effect = (want - without).abs()
    assert effect > 0.05
    assert (got - want).abs() <= 0.05 * effect


def test_several_adapters_scales_and_shapes():
    """Two adapters active at once (one of them on a single layer), a changed scale
    (``set_scale``), rsLoRA, and 4-D and zero-row inputs: output and gradients within the module
    docstring's bar of float64 under autocast, as PEFT's (0-row outputs are empty in both)."""
    torch.manual_seed(0)
    base = TwoLinears().bfloat16()
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q", "o"], use_rslora=True))
    model.add_adapter("second", peft.LoraConfig(r=4, lora_alpha=4, target_modules=["o"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    model.base_model.set_adapter(["default", "second"])
    model.base_model.model.o.set_scale("second", 3.0)
    for n, p in model.named_parameters():  # set_adapter freezes the rest; train every adapter
        if "lora_" in n:
            p.requires_grad_(True)
    ours = copy.deepcopy(model)
    assert patch_lora_linears(ours) == 2
    exact = copy.deepcopy(model).double()
    for shape in ((2, 3, 5, 64), (0, 64)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)).bfloat16()
        want_out, want = _run(exact, x.double(), autocast=False)
        peft_out, peft_grads = _run(model, x, autocast=True)
        our_out, our_grads = _run(ours, x, autocast=True)
        assert our_out.shape == peft_out.shape == want_out.shape
        if not x.numel():
            continue
        assert {k for k in want} == set(our_grads) == set(peft_grads)
        assert any("second" in k for k in our_grads)
        pairs = [("output", our_out, peft_out, want_out)] + [(k, our_grads[k], peft_grads[k], want[k]) for k in want]
        for name, got, theirs, ref in pairs:
            assert rel_err(got, ref) <= 1.25 * rel_err(theirs, ref) + 1e-3 * BF16_EPS, (shape, name)


@pytest.mark.parametrize("case", ["hook_on_lora_B", "pre_hook_on_lora_A", "global_hook", "fp64_adapters",
                                  "fp32_base_output", "extra_kwarg"])
def test_what_must_not_be_fused_is_peft_exactly(case):
    """Hooks on the adapter linears (ZeRO-3 gathers there), a global module hook, adapters autocast
    does not take (fp64), a base layer whose output leaves autocast's dtype, an unknown keyword:
    under autocast the output (dtype included) and gradients equal PEFT's bitwise, and the hooks
    fire as often as under PEFT."""
    ref_model = _peft_model()
    if case == "fp64_adapters":
        for n, p in ref_model.named_parameters():
            if "lora_" in n:
                p.data = p.data.double()
    if case == "fp32_base_output":
        for m in (ref_model.base_model.model.q, ref_model.base_model.model.o):
            inner = m.base_layer

            def fp32_forward(x, inner=inner):
                with torch.autocast("cpu", enabled=False):
                    bias = None if inner.bias is None else inner.bias.float()
                    return torch.nn.functional.linear(x.float(), inner.weight.float(), bias)

            inner.forward = fp32_forward
    ours = copy.deepcopy(ref_model)
    patch_lora_linears(ours)
    calls = {}
    from torch.nn.modules.module import register_module_forward_pre_hook

    handles = []
    for tag, m in (("peft", ref_model), ("ours", ours)):
        calls[tag] = []
        for lin in (m.base_model.model.q, m.base_model.model.o):
            if case == "hook_on_lora_B":
                lin.lora_B["default"].register_forward_hook(lambda *a, t=tag: calls[t].append(1))
            if case == "pre_hook_on_lora_A":
                lin.lora_A["default"].register_forward_pre_hook(lambda *a, t=tag: calls[t].append(1))
    x = torch.randn(2, 6, 64).bfloat16()
    kwargs = {}
    if case == "global_hook":
        handles.append(register_module_forward_pre_hook(lambda *a: None))
    try:
        if case == "extra_kwarg":
            layer_ref, layer_ours = ref_model.base_model.model.q, ours.base_model.model.q
            with torch.autocast("cpu", dtype=torch.bfloat16):
                with pytest.raises(TypeError):
                    layer_ref(x, unexpected=1)
                with pytest.raises(TypeError):
                    layer_ours(x, unexpected=1)
            return
        want = _run(ref_model, x, autocast=True, **kwargs)
        got = _run(ours, x, autocast=True, **kwargs)
    finally:
        for h in handles:
            h.remove()
    assert want[0].dtype == got[0].dtype
    assert torch.equal(want[0], got[0])
    assert all(torch.equal(want[1][k], got[1][k]) for k in want[1])
    assert len(calls["peft"]) == len(calls["ours"])


def test_replaced_forward_is_kept_and_patched_model_pickles(tmp_path):
    """A LoRA linear whose instance forward was replaced before (X-LoRA does this) keeps it; a
    patched model survives ``torch.save`` / ``torch.load`` with the fused forward bound to the
    loaded modules (same output under autocast)."""
    model = _peft_model()
    q = model.base_model.model.q
    seen = []
    original = q.forward

    def wrapper(x, *a, **k):
        seen.append(1)
        return original(x, *a, **k)

    q.forward = wrapper
    assert patch_lora_linears(model) == 1  # only o
    assert q.forward is wrapper
    model(torch.randn(1, 2, 64).bfloat16())
    assert seen == [1]

    ours = _peft_model()
    patch_lora_linears(ours)
    path = tmp_path / "m.pt"
    torch.save(ours, path)
    loaded = torch.load(path, weights_only=False)
    assert all(_fused_flags(loaded))
    assert all(mod.forward.args[0] is mod for mod in loaded.modules()
               if isinstance(mod, peft.tuners.lora.layer.Linear))
    x = torch.randn(2, 4, 64).bfloat16()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(ours(x), loaded(x))


@pytest.mark.gpu
def test_gpu_autocast_accuracy_and_peak():
    """CUDA bf16 autocast, a LoRA linear pair at 4096 -> 14336 -> 4096 over 4096 tokens: the
    fused forward's output and gradients within the module docstring's bar of float64, and its
    forward + backward peak above the inputs no higher than PEFT's (it saves no input copies)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")

    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(4096, 14336, bias=False)
            self.o = nn.Linear(14336, 4096, bias=False)

        def forward(self, x):
            return self.o(torch.nn.functional.silu(self.q(x)))

    torch.manual_seed(0)
    base = Wide().cuda().bfloat16()
    ref_model = peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q", "o"]))
    with torch.no_grad():
        for n, p in ref_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    ours = copy.deepcopy(ref_model)
    patch_lora_linears(ours)
    x = torch.randn(4096, 4096, device="cuda").bfloat16()

    def run(model, xin, autocast):
        xin = xin.detach().clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(xin)
        (out.float() ** 2).mean().backward()
        peak = torch.cuda.max_memory_allocated() - start
        grads = {"x": xin.grad.double()}
        grads.update({n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None})
        return out.detach().double(), grads, peak

    want_out, want, _ = run(copy.deepcopy(ref_model).double(), x.double(), False)
    peft_out, peft_grads, peft_peak = run(ref_model, x, True)
    our_out, our_grads, our_peak = run(ours, x, True)
    pairs = [("output", our_out, peft_out, want_out)] + [(k, our_grads[k], peft_grads[k], want[k]) for k in want]
    for name, got, theirs, ref in pairs:
        assert rel_err(got, ref) <= 1.25 * rel_err(theirs, ref) + 1e-3 * BF16_EPS, name
    assert our_peak <= peft_peak
