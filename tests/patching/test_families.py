"""Each supported family, patched, computes what the unpatched model computes (fp32, rel err 1e-5).

The reference is the same tiny random model before patching (a deep copy is patched), run first:
the RoPE patch is process-wide, so the reference must not run while it is active. fp32 bar 1e-5
(tests/helpers.TOL): every kernel computes in fp32 like Hugging Face, so only summation order
differs (observed errors ~1e-6).
"""

import copy
import importlib
import os

import pytest
import torch

from liger_losses.patching import apply_liger_kernels
from liger_losses.patching.causal_lm import is_liger_forward
from liger_losses.patching.families import (
    FAMILIES as SPECS,
)
from liger_losses.patching.families import (
    apply_liger_kernels_to_gemma2,
    apply_liger_kernels_to_llama,
)
from liger_losses.patching.rope import (
    liger_rotary_pos_emb,
    liger_rotary_pos_emb_inplace,
    liger_rotary_pos_emb_with_position_ids,
    liger_rotary_pos_emb_with_position_ids_inplace,
)
from tests.helpers import TOL, assert_close_rel
from tests.patching.tiny_models import (
    FAMILIES,
    MOE_FAMILIES,
    assert_loss_and_grads,
    eval_logits,
    loss_and_grads,
    reference_outputs,
    tiny_batch,
    tiny_model,
)

FP32 = TOL[torch.float32]


IMPLS = ("triton-interpreter", "torch-fallback")


@pytest.fixture(params=IMPLS)
def kernel_impl(request, monkeypatch):
    """Run the patched model's kernels through the Triton interpreter (TRITON_INTERPRET=1, set by
    tests/conftest.py on a machine without CUDA) or through their pure-PyTorch fallbacks (with the
    interpreter switched off, ``impl="auto"`` resolves to ``torch`` on the CPU)."""
    if request.param == "torch-fallback":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    elif not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter is off")
    from liger_losses.kernels.utils import resolve_impl

    want = "torch" if request.param == "torch-fallback" else "triton"
    assert resolve_impl("auto", torch.zeros(1)) == want
    return request.param


def _modules_swapped(model, spec):
    """No transformers RMSNorm (or swapped MLP) of the family is left, each layer's norms and dense
    MLPs are ours, RoPE is ours where the family's rotary is the kernel's, the forward is ours."""
    from liger_losses.patching.modules import mlp_class, norm_class

    modeling = importlib.import_module(spec.module)
    hf_norm = getattr(modeling, spec.rms_norm)
    assert not any(isinstance(m, hf_norm) for m in model.modules())
    norms = [m for m in model.modules() if isinstance(m, norm_class(spec.norm_kind))]
    assert len(norms) >= 2 * len(model.model.layers) + 1
    assert isinstance(model.model.norm, norm_class(spec.norm_kind))
    if spec.mlp is not None:
        assert not any(isinstance(m, getattr(modeling, spec.mlp)) for m in model.modules())
        assert any(isinstance(m, mlp_class(spec.mlp_kind)) for m in model.modules())
    ours = (
        liger_rotary_pos_emb,
        liger_rotary_pos_emb_with_position_ids,
        liger_rotary_pos_emb_inplace,
        liger_rotary_pos_emb_with_position_ids_inplace,
    )
    assert (getattr(modeling, "apply_rotary_pos_emb", None) in ours) == spec.rope
    assert is_liger_forward(model.forward)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_patched_family_matches_unpatched(model_type, kernel_impl):
    """Patched model: logits (no labels), loss (labels with -100; MoE: the router aux loss
    included) and the gradient of every parameter equal the unpatched model's within 1e-5
    relative error (fp32; gradients are held to the same 1e-5, tighter than the 1e-4 bar, observed
    ~1e-6), through the Triton interpreter and through the PyTorch fallbacks; the modules really are
    ours; with labels in training mode the lm_head is never called and logits are None."""
    ref = tiny_model(model_type)
    model = copy.deepcopy(ref)
    batch = tiny_batch(ref.config)
    ref_logits, ref_loss, ref_grads = reference_outputs(ref, batch)

    n_params = len(list(model.parameters()))
    assert apply_liger_kernels(model) is model
    assert len(list(model.parameters())) == n_params  # re-bound, nothing new
    _modules_swapped(model, SPECS[model_type])

    head_calls = []
    hook = model.lm_head.register_forward_hook(lambda *a: head_calls.append(1))
    out, grads = loss_and_grads(model, batch)
    hook.remove()
    assert out.logits is None and not head_calls
    assert set(grads) == set(ref_grads)
    assert_loss_and_grads(out, grads, ref_loss, ref_grads)

    assert_close_rel(eval_logits(model, batch), ref_logits, FP32, "logits")


def test_seed_oss_dropout_is_kept():
    """Seed-OSS drops out its attention and MLP outputs in training (``residual_dropout``, default 0.1):
    the patched MLP draws its output's dropout as transformers' does, so under one seed the patched model's
    loss and gradients equal the unpatched model's (1e-5, fp32), and without the dropout they would not."""
    ref = tiny_model("seed_oss", attention_dropout=0.3, residual_dropout=0.3)
    model = copy.deepcopy(ref)
    batch = tiny_batch(ref.config)
    torch.manual_seed(5)
    ref_out, ref_grads = loss_and_grads(ref, batch)
    apply_liger_kernels(model)
    assert all(m.residual_dropout == 0.3 for m in model.modules() if type(m).__name__ == "LigerSwiGLUMLP")
    torch.manual_seed(5)
    out, grads = loss_and_grads(model, batch)
    assert_loss_and_grads(out, grads, ref_out.loss, ref_grads)
    torch.manual_seed(6)  # another draw: another loss (the dropout is live)
    assert not torch.allclose(loss_and_grads(model, batch)[0].loss, out.loss)


def test_qwen3_qk_norms_swapped():
    """Qwen3's per-head q_norm/k_norm are RMSNorms too and must be swapped (they hold weights)."""
    from liger_losses.kernels.rms_norm import LigerRMSNorm

    model = apply_liger_kernels(tiny_model("qwen3"))
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_norm, LigerRMSNorm) and isinstance(attn.k_norm, LigerRMSNorm)
    assert attn.q_norm.weight.shape == (model.config.head_dim,)


def test_gemma2_softcap_is_applied():
    """Gemma-2's final_logit_softcapping (1.0 here, logits ~N(0, 1)) changes the loss by far more
    than the tolerance, and the patched loss matches HF's capped loss to 1e-5 (fp32)."""
    ref = tiny_model("gemma2")
    model = copy.deepcopy(ref)
    batch = tiny_batch(ref.config)
    with torch.no_grad():
        ref_loss = ref(**batch).loss
        ref.config.final_logit_softcapping = None
        uncapped = ref(**batch).loss
    assert abs(float(uncapped - ref_loss)) > 1e-2 * float(ref_loss)
    apply_liger_kernels_to_gemma2(model)
    with torch.no_grad():
        loss = model(**batch).loss
    assert_close_rel(loss, ref_loss, FP32, "capped loss")


def test_flags_leave_parts_unpatched():
    """With every flag False nothing is swapped: HF classes remain, the forward is HF's, RoPE is
    HF's; with only rms_norm=True only the norms change."""
    from transformers.models.llama import modeling_llama as ml

    from liger_losses.kernels.rms_norm import LigerRMSNorm

    original_rope = ml.apply_rotary_pos_emb
    model = tiny_model("llama")
    apply_liger_kernels(model, rms_norm=False, rope=False, swiglu=False, cross_entropy=False)
    assert isinstance(model.model.norm, ml.LlamaRMSNorm)
    assert isinstance(model.model.layers[0].mlp, ml.LlamaMLP)
    assert ml.apply_rotary_pos_emb is original_rope
    assert not is_liger_forward(model.forward)
    apply_liger_kernels(model, rope=False, swiglu=False, cross_entropy=False)
    assert isinstance(model.model.norm, LigerRMSNorm)
    assert isinstance(model.model.layers[0].mlp, ml.LlamaMLP)


def test_bad_arguments():
    """Unsupported model_type -> ValueError listing the supported ones; a model of another family
    given to a per-family function -> ValueError; non-bool flag -> TypeError; not a module ->
    TypeError."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    with pytest.raises(ValueError, match="llama.*gemma2.*phi3.*gpt2"):
        apply_liger_kernels(gpt2)
    qwen2 = tiny_model("qwen2")
    with pytest.raises(ValueError, match="'llama'.*'qwen2'"):
        apply_liger_kernels_to_llama(qwen2)
    with pytest.raises(TypeError, match="rope must be a bool"):
        apply_liger_kernels(qwen2, rope="yes")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        apply_liger_kernels("llama")


def test_unsupported_activation_leaves_mlp_with_warning():
    """A Llama config with hidden_act='gelu' cannot use the SwiGLU kernel: MLPs stay HF's (with a
    warning), everything else is patched."""
    from transformers.models.llama import modeling_llama as ml

    model = tiny_model("llama", hidden_act="gelu")
    with pytest.warns(UserWarning, match="MLPs left unpatched"):
        apply_liger_kernels(model)
    assert isinstance(model.model.layers[0].mlp, ml.LlamaMLP)
    assert not isinstance(model.model.norm, ml.LlamaRMSNorm)


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace-rope", "out-of-place-rope"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2"])
def test_patched_family_matches_unpatched_with_inplace_rope(model_type, inplace):
    """With the in-place RoPE (``patching.rope.RoPEPatchConfig.inplace``, the default, which also rotates
    the attention's q/k gradients in their own buffers: ``inplace_backward``) and with it switched off,
    the patched model's loss and every parameter gradient equal the unpatched model's within 1e-5
    (fp32)."""
    import liger_losses.patching.rope as prope

    ref = tiny_model(model_type)
    model = copy.deepcopy(ref)
    batch = tiny_batch(ref.config)
    _, ref_loss, ref_grads = reference_outputs(ref, batch)
    apply_liger_kernels(model)
    with prope.ROPE_PATCH.override(inplace=inplace, inplace_backward=True):
        out, grads = loss_and_grads(model, batch)
    assert_loss_and_grads(out, grads, ref_loss, ref_grads)


@pytest.mark.parametrize("model_type", ["llama", "phi3", "gemma"])
def test_patched_family_matches_unpatched_with_fused_mlp_tail(model_type, monkeypatch):
    """With the fused MLP tail on (``kernels.mlp.MLPTuning.fuse_down_proj``: the down projection
    computed in blocks, the product never saved) for the three MLP kinds (SwiGLU, Phi-3's packed
    gate_up, GeGLU), the patched model's loss, logits and every parameter gradient equal the
    unpatched model's within 1e-5 (fp32); small buffers force several chunks and blocks."""
    import liger_losses.kernels.gated_down as gd
    from liger_losses.kernels.tuning import tuning

    ref = tiny_model(model_type)
    model = copy.deepcopy(ref)
    batch = tiny_batch(ref.config)
    ref_logits, ref_loss, ref_grads = reference_outputs(ref, batch)
    apply_liger_kernels(model)
    used = []
    monkeypatch.setattr(gd.GatedDownFunction, "apply", _counting(gd.GatedDownFunction.apply, used))
    with tuning(mlp={"fuse_down_proj": True}, gated_down={"chunk_elems": 512, "forward_chunk_elems": 512}):
        out, grads = loss_and_grads(model, batch)
        assert used, "the fused tail was not used"
        assert_loss_and_grads(out, grads, ref_loss, ref_grads)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert_close_rel(logits, ref_logits, FP32, "logits")


def _counting(fn, calls):
    def wrapped(*args):
        calls.append(1)
        return fn(*args)

    return wrapped


@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_moe_router_aux_loss_as_transformers_adds_it(model_type):
    """MoE families: the patched training forward returns transformers' aux_loss and router logits
    and adds router_aux_loss_coef * aux_loss to the loss exactly as transformers does (fp32, 1e-5),
    with num_items_in_batch too; the aux term is far above the tolerance (coef 0.1, aux ~2);
    output_router_logits=False leaves it out (aux_loss None), as transformers does."""
    ref = tiny_model(model_type)
    model = apply_liger_kernels(copy.deepcopy(ref))
    batch = tiny_batch(ref.config)
    for kwargs in ({}, {"num_items_in_batch": 7}, {"output_router_logits": False}):
        ref_out, ref_grads = loss_and_grads(ref, batch, **kwargs)
        out, grads = loss_and_grads(model, batch, **kwargs)
        assert out.logits is None
        assert_loss_and_grads(out, grads, ref_out.loss, ref_grads)
        if kwargs.get("output_router_logits") is False:
            assert out.aux_loss is None and ref_out.aux_loss is None
            continue
        assert_close_rel(out.aux_loss, ref_out.aux_loss, FP32, "aux_loss")
        assert len(out.router_logits) == len(ref_out.router_logits) >= 1
        assert float(ref.config.router_aux_loss_coef * ref_out.aux_loss.detach()) > 1e-2 * float(ref_out.loss.detach())


def test_granite_logits_scaling_is_applied():
    """Granite divides its logits by logits_scaling (4 here): the scale changes the loss by far
    more than the tolerance and the patched loss matches transformers' to 1e-5 (fp32)."""
    ref = tiny_model("granite")
    model = apply_liger_kernels(copy.deepcopy(ref))
    batch = tiny_batch(ref.config)
    with torch.no_grad():
        ref_loss = ref(**batch).loss
        ref.config.logits_scaling = 1.0
        unscaled = ref(**batch).loss
        loss = model(**batch).loss
    assert abs(float(unscaled - ref_loss)) > 1e-2 * float(ref_loss)
    assert_close_rel(loss, ref_loss, FP32, "scaled loss")
