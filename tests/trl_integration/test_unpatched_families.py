"""The trainers on a model family without layer kernels: a warning, transformers' layers, the fused loss.

``liger_patch_model=True`` (the default) asks for our layer kernels; a family ``apply_liger_kernels`` does
not know (or whose transformers classes no longer look as its patch expects) keeps transformers' layers
and still trains with the fused loss, as liger-kernel's and TRL's own ``use_liger_kernel`` do. The families
here each stress a part of the head the fused loss must read from the model: Phi (a bias on the LM head,
partial rotary), Cohere (``logit_scale`` after the head, tied embeddings), GPT-NeoX (the head named
``embed_out``, parallel residual) and Starcoder2 (biased linears, LayerNorm). Parity with TRL's own trainer
on deep copies of the same weights: loss, metrics and every gradient to a relative error <= 1e-4 (fp32 on
the CPU; the same math in another summation order gives ~1e-6).
"""

import warnings

import pytest
import torch

import liger_losses.patching as patching
from liger_losses.patching import FamilyMismatchError
from liger_losses.trl_integration import DPOTrainer, SFTTrainer
from liger_losses.trl_integration.base import patch_model_layers

from .utils import (
    build_tiny_model,
    check_compute_loss,
    dpo_config,
    make_pair,
    preference_dataset,
    sft_config,
    sft_dataset,
)

TOL = 1e-4
UNPATCHED = "layers stay transformers'"

FAMILIES = {
    "phi": dict(partial_rotary_factor=0.5),
    "cohere": dict(logit_scale=0.25, tie_word_embeddings=True),
    "gpt_neox": dict(rotary_pct=0.5),
    "starcoder2": dict(num_key_value_heads=2),
}


def tiny_model(tok, model_type: str, seed: int = 0):
    """A random fp32 ``model_type`` causal LM of width 64, 2 layers, 4 heads, the tokenizer's vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None, **FAMILIES[model_type],
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:  # zero-initialised: give the fused loss a bias to honour
        torch.nn.init.normal_(head.bias, std=0.5)
    return model


def _warned(record) -> list:
    return [w for w in record if issubclass(w.category, UserWarning) and UNPATCHED in str(w.message)]


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_sft_on_an_unpatched_family_warns_and_matches_trl(tok, tmp_path, model_type):
    """SFT with the default ``liger_patch_model=True``: one warning naming the model type, no error; loss,
    ``entropy``, ``mean_token_accuracy`` and every gradient equal TRL's (rel <= 1e-4)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        theirs, ours = make_pair(
            SFTTrainer, [tiny_model(tok, model_type)], lambda run_dir: sft_config(run_dir), tmp_path,
            lambda: sft_dataset(), liger_kwargs={"liger_patch_model": True, "liger_chunk_tokens": 5},
            processing_class=tok,
        )
    warned = _warned(record)
    assert len(warned) == 1 and repr(model_type) in str(warned[0].message), [str(w.message) for w in record]
    assert "liger_losses" not in warned[0].filename  # attributed to the code that built the trainer
    check_compute_loss(theirs, ours, TOL)


def test_dpo_on_an_unpatched_family_warns_for_each_model_and_matches_trl(tok, tmp_path):
    """DPO with a reference model of an unpatched family: a warning per model (policy, reference), then the
    loss, every logged metric and every gradient equal TRL's (rel <= 1e-4)."""
    models = [tiny_model(tok, "phi", seed=0), tiny_model(tok, "phi", seed=1)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        theirs, ours = make_pair(DPOTrainer, models, lambda run_dir: dpo_config(run_dir), tmp_path,
                                 lambda: preference_dataset(8), liger_kwargs={"liger_patch_model": True},
                                 processing_class=tok)
    assert len(_warned(record)) == 2
    m_t, _ = check_compute_loss(theirs, ours, TOL)
    assert abs(m_t["rewards/margins"]) > 0  # policy != reference


def test_family_mismatch_keeps_the_layers_with_a_warning(tok, monkeypatch):
    """A known family whose installed transformers no longer matches its patch (``FamilyMismatchError``, raised
    before anything is patched) warns and leaves the model as it is, instead of failing the trainer."""
    def mismatch(model, **_):
        raise FamilyMismatchError("LlamaRMSNorm.forward's signature changed")

    monkeypatch.setattr(patching, "apply_liger_kernels", mismatch)
    model = build_tiny_model(tok)
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.warns(UserWarning, match="signature changed"):
        assert patch_model_layers(model) is False
    assert {n: type(m) for n, m in model.named_modules()} == before


def test_a_known_family_is_patched_without_warning(tok):
    """A supported family is patched (``True``) and nothing is warned."""
    model = build_tiny_model(tok)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert patch_model_layers(model) is True
    assert not _warned(record)


def test_apply_liger_kernels_itself_still_refuses_an_unknown_family(tok):
    """The explicit patching call keeps its error: a user who asks for the kernels by name is told there are
    none for the model type."""
    with pytest.raises(ValueError, match="model_type must be one of .*got 'phi'"):
        patching.apply_liger_kernels(tiny_model(tok, "phi"))
