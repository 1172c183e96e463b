"""Patching checks what it replaces before changing anything (issue 19, item 3).

A modeling module (or a model) that lacks a class or attribute the patch replaces, or has it with
another signature, gets ``FamilyMismatchError`` naming the family and the transformers version, and
nothing is patched: the module's attributes, the class forward and the model's modules are the
ones from before. No numbers are compared here.
"""

import types

import pytest
import transformers
from torch import nn

from liger_losses.patching import FamilyMismatchError, apply_liger_kernels
from liger_losses.patching.causal_lm import is_liger_forward
from liger_losses.patching.core import is_rope_patched, patch_family
from liger_losses.patching.specs import FAMILIES, FamilySpec
from tests.patching.tiny_models import tiny_model

FLAGS = dict(rms_norm=True, rope=True, mlp=True, cross_entropy=True)


def _fake_llama_module(name, **drop_or_replace):
    """A copy of transformers' llama modeling module under ``name``, with attributes removed
    (value None) or replaced."""
    import sys

    from transformers.models.llama import modeling_llama as ml

    fake = types.ModuleType(name)
    fake.__dict__.update({k: v for k, v in vars(ml).items() if not k.startswith("__")})
    for attr, value in drop_or_replace.items():
        if value is None:
            del fake.__dict__[attr]
        else:
            setattr(fake, attr, value)
    sys.modules[name] = fake
    return fake


def _spec(module_name):
    base = FAMILIES["llama"]
    return FamilySpec(model_type="llama", module=module_name, causal_lm=base.causal_lm,
                      rms_norm=base.rms_norm, norm_kind="llama", mlp=base.mlp, mlp_kind="swiglu")


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(LlamaRMSNorm=None), "LlamaRMSNorm is missing"),
        (dict(LlamaMLP=None), "LlamaMLP is missing"),
        (dict(apply_rotary_pos_emb=None), "apply_rotary_pos_emb is missing"),
        (dict(apply_rotary_pos_emb=lambda x, freqs: x), r"apply_rotary_pos_emb is not \(q, k, cos, sin"),
        (dict(LlamaForCausalLM=None), "LlamaForCausalLM is missing"),
    ],
    ids=["no-norm", "no-mlp", "no-rope", "rope-signature", "no-causal-lm"],
)
def test_module_mismatch_raises_and_patches_nothing(changes, message):
    """Class-level patching of a module missing a class, or with an apply_rotary_pos_emb of another
    signature: FamilyMismatchError naming 'llama', the transformers version and the mismatch; the
    module's attributes are all as before."""
    name = "tests_fake_modeling_" + "_".join(changes)
    fake = _fake_llama_module(name, **changes)
    before = dict(vars(fake))
    with pytest.raises(FamilyMismatchError, match=rf"'llama' with transformers {transformers.__version__}.*{message}"):
        patch_family(_spec(name), None, **FLAGS)
    assert dict(vars(fake)) == before
    if "LlamaForCausalLM" in vars(fake):
        assert not is_liger_forward(fake.LlamaForCausalLM.forward)


def test_forward_without_logits_to_keep_raises():
    """A *ForCausalLM whose forward takes no labels / logits_to_keep cannot get our forward."""
    from transformers.models.llama import modeling_llama as ml

    class OldCausalLM(ml.LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None):
            raise AssertionError("never called")

    name = "tests_fake_modeling_old_forward"
    _fake_llama_module(name, LlamaForCausalLM=OldCausalLM)
    with pytest.raises(FamilyMismatchError, match="forward takes no labels, logits_to_keep"):
        patch_family(_spec(name), None, **FLAGS)
    assert OldCausalLM.__dict__["forward"].__name__ == "forward"
    assert not is_liger_forward(OldCausalLM.forward)


def test_instance_mismatch_patches_half_nothing():
    """A model whose last MLP lost its gate_proj (as if transformers had renamed it): the instance
    check fails before any swap: every norm and MLP stays transformers', the forward and RoPE too."""
    from transformers.models.llama import modeling_llama as ml

    model = tiny_model("llama")
    del model.model.layers[1].mlp.gate_proj
    model.model.layers[1].mlp.fused_gate = nn.Linear(4, 4)
    with pytest.raises(FamilyMismatchError, match=r"layers\.1\.mlp \(LlamaMLP\) has no linear gate_proj"):
        apply_liger_kernels(model)
    assert all(type(m) is ml.LlamaRMSNorm for m in model.modules() if "RMSNorm" in type(m).__name__)
    assert type(model.model.layers[0].mlp) is ml.LlamaMLP
    assert not is_liger_forward(model.forward)
    assert not is_rope_patched("llama")


def test_norm_without_eps_raises():
    """A norm module without eps / variance_epsilon: named in the error, nothing swapped."""
    from transformers.models.llama import modeling_llama as ml

    model = tiny_model("llama")
    del model.model.norm.variance_epsilon
    with pytest.raises(FamilyMismatchError, match="model.norm .LlamaRMSNorm. has no eps"):
        apply_liger_kernels(model)
    assert type(model.model.layers[0].input_layernorm) is ml.LlamaRMSNorm


def test_moe_model_without_router_attributes_raises():
    """A MoE causal LM missing the router attributes transformers' forward reads."""
    model = tiny_model("qwen3_moe")
    del model.num_experts_per_tok
    with pytest.raises(FamilyMismatchError, match="'qwen3_moe'.*no num_experts_per_tok"):
        apply_liger_kernels(model)
    assert not is_liger_forward(model.forward)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_installed_transformers_has_every_family(model_type):
    """Every family's modeling module passes the module checks with the installed transformers
    (run on both version sets: the GPU image's 5.17 and the CPU's 5.2x)."""
    import importlib

    from liger_losses.patching.checks import check_module

    spec = FAMILIES[model_type]
    modeling = importlib.import_module(spec.module)
    check_module(spec, modeling, rope=spec.rope, mlp=spec.mlp is not None, cross_entropy=True,
                 originals=lambda name: getattr(modeling, name))
