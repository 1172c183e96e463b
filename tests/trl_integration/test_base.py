"""Unit tests of the shared adapter machinery (liger_losses/trl_integration/base.py).

Exact checks (no tolerance): these are control-flow helpers -- forward redirection, model anatomy,
ZeRO-3 gathering's no-op path, option rejection.
"""

import pytest
import torch
from torch import nn

from liger_losses.trl_integration import base

from .utils import build_tiny_model, build_tokenizer


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x)


class _Wrapper(nn.Module):
    """Stands in for DDP/FSDP1: holds `.module` and calls it from its own forward."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.module(*args, **kwargs)


def test_run_in_forward_goes_through_wrapper_hooks_and_restores():
    """fn runs inside the wrapper's forward (its pre-hook fires first), its result is returned, and
    the inner module's forward is the original again afterwards (also inside fn)."""
    inner = _Inner()
    wrapper = _Wrapper(inner)
    fired = []
    wrapper.register_forward_pre_hook(lambda m, a: fired.append("wrapper"))
    inner.register_forward_pre_hook(lambda m, a: fired.append("inner"))
    x = torch.randn(2, 3)

    def fn(t):
        fired.append("fn")
        assert "forward" not in inner.__dict__  # restored before fn runs: nested calls are normal
        return inner(t) * 2

    out = base.run_in_forward(wrapper, fn, x)
    assert torch.equal(out, inner.lin(x) * 2)
    assert fired[:3] == ["wrapper", "inner", "fn"]
    assert wrapper.calls == 1 and "forward" not in inner.__dict__
    assert torch.equal(inner(x), inner.lin(x))


def test_run_in_forward_restores_on_error():
    """An exception inside fn propagates and leaves the module's forward untouched."""
    inner = _Inner()

    def boom():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        base.run_in_forward(inner, boom)
    assert "forward" not in inner.__dict__


def test_liger_run_plain_module_runs_fn_as_its_forward():
    """A plain (unwrapped) module: _liger_run runs fn through its __call__ (as TRL's ``model(...)`` call does: the
    module's forward hooks fire) and restores its forward afterwards."""
    model = _Inner()
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append("pre-hook"))
    runner = base.LigerTrainerMixin()
    assert runner._liger_run(model, lambda a, b=0: a + b, 1, b=2) == 3
    assert calls == ["pre-hook"] and "forward" not in model.__dict__


def test_model_anatomy_of_tiny_llama():
    """backbone_of / lm_head_params / unwrap_causal_lm find LlamaModel, lm_head and the LM itself,
    also through a `.module` wrapper and a PEFT wrapper."""
    model = build_tiny_model(build_tokenizer())
    assert base.backbone_of(model) is model.model
    weight, bias = base.lm_head_params(model)
    assert weight is model.lm_head.weight and bias is None
    assert base.unwrap_causal_lm(_Wrapper(model)) is model
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    assert base.is_peft_model(wrapped)
    assert base.unwrap_causal_lm(wrapped) is wrapped.get_base_model()


def test_backbone_of_refuses_a_decoder_that_is_the_vocabulary_projection():
    """A model whose get_decoder() is its vocabulary Linear (ModernBertDecoderForCausalLM: a prediction
    head sits between the backbone and it) raises ValueError naming it, not a TypeError at the first
    step or a loss that skips the prediction head."""

    class OddLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Identity()
            self.decoder = nn.Linear(4, 8)

        def get_decoder(self):
            return self.decoder

        def get_output_embeddings(self):
            return self.decoder

    with pytest.raises(ValueError, match="OddLM.get_decoder"):
        base.backbone_of(OddLM())


def test_head_logit_options():
    """Softcap and logit scale are read from the config like TRL's fused head (1.0 / None by default)."""
    from types import SimpleNamespace

    assert base.head_logit_options(SimpleNamespace()) == {"softcap": None, "logit_scale": 1.0}
    assert base.head_logit_options(SimpleNamespace(final_logit_softcapping=30.0, logit_scale=0.5)) == {
        "softcap": 30.0, "logit_scale": 0.5}
    assert base.head_logit_options(SimpleNamespace(logits_scaling=4.0, model_type="granite"))["logit_scale"] == 0.25
    assert base.head_logit_options(SimpleNamespace(logits_soft_cap=30.0))["softcap"] == 30.0  # RecurrentGemma


def test_lm_head_that_is_more_than_a_linear_is_refused():
    """The fused losses compute ``hidden @ weight.T + bias``: an LM head whose forward does more raises
    ValueError naming it instead of being silently replaced by that. An active LoRA adapter on lm_head
    raises; the same adapter disabled (a PEFT reference or teacher scope), merged, or a
    ``modules_to_save`` copy of the head do not; a head module with a parameter of its own (a learned
    logit scale) raises."""
    peft = pytest.importorskip("peft")
    tok = build_tokenizer()
    lora = peft.get_peft_model(build_tiny_model(tok),
                               peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM"))
    inner = base.unwrap_causal_lm(lora)
    with pytest.raises(ValueError, match="active PEFT adapter"):
        base.lm_head_params(inner)
    with lora.disable_adapter():
        weight, _ = base.lm_head_params(inner)
    assert weight is inner.lm_head.base_layer.weight
    lora.merge_adapter()
    base.lm_head_params(inner)
    saved = peft.get_peft_model(build_tiny_model(tok), peft.LoraConfig(
        r=2, target_modules=["q_proj"], modules_to_save=["lm_head"], task_type="CAUSAL_LM"))
    base.lm_head_params(base.unwrap_causal_lm(saved))

    class ScaledHead(nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.weight = linear.weight
            self.logit_scale = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return (x @ self.weight.T) * self.logit_scale

    model = build_tiny_model(tok)
    model.lm_head = ScaledHead(model.lm_head)
    with pytest.raises(ValueError, match="logit_scale"):
        base.lm_head_params(model)


def test_gathered_params_noop_without_zero3():
    """Plain parameters: a null context (deepspeed is never imported)."""
    p = nn.Parameter(torch.ones(2))
    assert not base.is_zero3_param(p)
    with base.gathered_params(p, None):
        assert p.sum() == 2


def test_reject_names_option():
    """reject() raises ValueError naming the option and its value."""
    with pytest.raises(ValueError, match=r"use_weighting=True"):
        base.reject("use_weighting", True, "not implemented")


def test_build_loss_rejects_unknown_non_default_option():
    """An option the loss class doesn't take is fine at its default, a ValueError otherwise."""

    class Loss:
        def __init__(self, beta=0.1):
            self.beta = beta

    assert base.build_loss(Loss, {"beta": ("beta", 0.2), "x": ("x", 0)}, {"x": 0}, "Cfg").beta == 0.2
    with pytest.raises(ValueError, match="Cfg.x"):
        base.build_loss(Loss, {"x": ("x", 1)}, {"x": 0}, "Cfg")


def test_compiled_module_is_unwrapped_and_recognised():
    """``torch.compile(model)`` (an ``OptimizedModule``, not traced until called): ``compiled_module`` names
    it, ``unwrap_causal_lm`` and ``backbone_of`` see through it to the very model and decoder; a plain
    model is not a compiled one."""
    model = build_tiny_model(build_tokenizer(), seed=0)
    compiled = torch.compile(model, backend="aot_eager")
    assert base.compiled_module(compiled) is compiled
    assert base.compiled_module(model) is None
    assert base.unwrap_causal_lm(compiled) is model
    assert base.backbone_of(base.unwrap_causal_lm(compiled)) is model.model


def test_liger_run_of_a_compiled_model_keeps_the_hooks_and_traces_nothing():
    """A compiled model (``torch.compile``, ``aot_eager``): with hooks on the inner model (accelerate
    compiles DDP / FSDP1 wrappers last) they fire around fn; with hooks on the compile wrapper itself
    (FSDP2 shards the wrapper) those fire. Either way fn runs eagerly (nothing is traced: Dynamo
    builds no graph) and the swapped forward is restored."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    runner = base.LigerTrainerMixin()
    for hooked in ("inner", "wrapper"):
        torch._dynamo.reset()
        counters.clear()
        model = _Inner()
        compiled = torch.compile(model, backend="aot_eager")
        calls = []
        (model if hooked == "inner" else compiled).register_forward_pre_hook(lambda m, a: calls.append(hooked))
        forward_before = compiled.__dict__.get("forward")
        assert runner._liger_run(compiled, lambda a: a * 2, 3) == 6
        assert calls == [hooked]
        assert counters["stats"]["unique_graphs"] == 0
        assert "forward" not in model.__dict__ and compiled.__dict__.get("forward") is forward_before


def test_backbone_of_a_compiled_model_is_compiled_alike_once():
    """``_liger_backbone``: the decoder of a compiled model, compiled under the same Dynamo context
    (backend and options of whoever compiled the model), made once and reused; a plain model's is
    the decoder itself."""
    model = build_tiny_model(build_tokenizer(), seed=0)
    compiled = torch.compile(model, backend="aot_eager")
    runner = base.LigerTrainerMixin()
    backbone = runner._liger_backbone(compiled)
    assert base.compiled_module(backbone) is backbone and backbone._orig_mod is model.model
    assert backbone.dynamo_ctx is compiled.dynamo_ctx
    assert runner._liger_backbone(compiled) is backbone
    assert runner._liger_backbone(model) is model.model


class _TwoProcessGather:
    """Stands in for an accelerator of 2 processes: the other process's row is this one's plus 1."""

    def gather_for_metrics(self, row):
        return torch.cat([row, row + 1])


def test_gather_metric_tensor_reduces_each_value_as_asked():
    """Means and sums over 2 processes, one reduction for all or one per value (float64 math on exact values:
    exact); the per-value pattern's mask is made once per device, not copied from the host at every step."""
    values = [torch.tensor(1.0), torch.tensor(4.0), torch.tensor(10.0)]
    acc = _TwoProcessGather()
    assert base.gather_metric_tensor(acc, values, "mean").tolist() == [1.5, 4.5, 10.5]
    assert base.gather_metric_tensor(acc, values, "sum").tolist() == [3.0, 9.0, 21.0]
    mixed = ["sum", "mean", "sum"]
    assert base.gather_metric_tensor(acc, values, mixed).tolist() == [3.0, 4.5, 21.0]
    mask = base._sum_mask((True, False, True), torch.device("cpu"))
    assert base._sum_mask((True, False, True), torch.device("cpu")) is mask
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        base.gather_metric_tensor(acc, values, ["sum", "max", "sum"])
