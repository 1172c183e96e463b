"""The first-step logits check (``trl_integration/logit_check.py``): a model whose forward transforms its logits in
a way its config does not show is refused at its first step instead of trained on another objective.

The transform here is MiniCPM's (remote code): the hidden states divided by a width ratio before the head,
written in the causal LM's forward. Tolerances: on the CPU in fp32 the model's logits and the formula are the
same GEMM, so a model the loss serves checks at <= 1e-5; with the divisor 4 the formula is 3x the model's logits
away (relative).
"""

import warnings

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from liger_losses.trl_integration import DPOTrainer, SFTTrainer
from liger_losses.trl_integration.logit_check import ENV_SWITCH, RTOL, check_model_logits

from .test_unpatched_families import tiny_model
from .utils import (
    build_tiny_model,
    dpo_config,
    first_batch,
    preference_dataset,
    record_backbone_autocast,
    sft_config,
    sft_dataset,
    step0,
)


class WidthScaledLlama(LlamaForCausalLM):
    """A Llama whose forward divides the hidden states by ``width_ratio`` before the head, as MiniCPM's remote
    code does (``hidden_size / dim_model_base``): nothing in its config or module tree says so."""

    width_ratio = 4.0

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k in ("position_ids", "use_cache", "inputs_embeds")}
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        logits = self.lm_head(hidden / self.width_ratio)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def width_scaled(tok):
    model = build_tiny_model(tok)
    scaled = WidthScaledLlama(model.config)
    scaled.load_state_dict(model.state_dict())
    return scaled


def ids_of(tok, n=12):
    return {"input_ids": torch.tensor([tok("a short probe sentence")["input_ids"][:n]])}


def test_a_model_the_loss_serves_checks_equal(tok):
    """A plain Llama: the model's logits equal the formula (rel <= 1e-5, fp32)."""
    model = build_tiny_model(tok)
    diff = check_model_logits(model, model, ids_of(tok), softcap=None, logit_scale=1.0)
    assert diff is not None and diff <= 1e-5


def test_a_config_logit_scale_is_part_of_the_formula(tok):
    """Cohere scales its logits by ``config.logit_scale`` (0.25 here): the check passes with that scale and
    refuses the formula without it."""
    model = tiny_model(tok, "cohere")
    assert check_model_logits(model, model, ids_of(tok), softcap=None, logit_scale=0.25) <= 1e-5
    with pytest.raises(ValueError, match=r"CohereForCausalLM's own forward computes logits that differ"):
        check_model_logits(model, model, ids_of(tok), softcap=None, logit_scale=1.0)


def capped_gemma2(tok):
    """A tiny fp32 Gemma-2 with ``final_logit_softcapping=5`` and head weights of std 0.5: logits well into the cap."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma2", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  final_logit_softcapping=5.0, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    torch.nn.init.normal_(model.lm_head.weight, std=0.5)
    return model


def test_a_config_softcap_is_part_of_the_formula(tok):
    """Gemma-2's final softcap (5 here): the check passes with it and refuses the formula without it."""
    model = capped_gemma2(tok)
    assert check_model_logits(model, model, ids_of(tok), softcap=5.0, logit_scale=1.0) <= 1e-5
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM's own forward computes logits that differ"):
        check_model_logits(model, model, ids_of(tok), softcap=None, logit_scale=1.0)


def test_a_transform_in_the_forward_code_is_refused_at_the_first_step(tok, tmp_path):
    """SFT on the width-scaled Llama: construction passes (config and module tree look like Llama's), the first
    step raises a ValueError naming the class, the difference and the way out."""
    trainer = SFTTrainer(width_scaled(tok), sft_config(tmp_path), train_dataset=sft_dataset(),
                         processing_class=tok, use_liger=True, liger_patch_model=False)
    with pytest.raises(ValueError, match=r"cannot serve model: WidthScaledLlama's own forward .* by 3 "
                                         r".*use_liger=False"):
        step0(trainer, first_batch(trainer))


def test_the_check_runs_once_and_the_switch_turns_it_off(tok, tmp_path, monkeypatch):
    """``LIGER_LOSSES_CHECK_LOGITS=0`` skips the check (the step trains); a model that passed is not checked again."""
    monkeypatch.setenv(ENV_SWITCH, "0")
    trainer = SFTTrainer(width_scaled(tok), sft_config(tmp_path), train_dataset=sft_dataset(),
                         processing_class=tok, use_liger=True, liger_patch_model=False)
    loss, _ = step0(trainer, first_batch(trainer))
    assert torch.isfinite(loss)
    monkeypatch.delenv(ENV_SWITCH)

    trainer = SFTTrainer(build_tiny_model(tok), sft_config(tmp_path), train_dataset=sft_dataset(),
                         processing_class=tok, use_liger=True, liger_patch_model=False)
    calls = []
    real_forward = trainer.model.forward
    trainer.model.forward = lambda *a, **k: calls.append(1) or real_forward(*a, **k)
    batch = first_batch(trainer)
    step0(trainer, batch)
    step0(trainer, batch)
    assert len(calls) == 1  # the check's forward; the loss runs the backbone alone


def test_a_reference_whose_forward_disagrees_with_its_config_is_refused(tok, tmp_path):
    """DPO with a Cohere reference whose forward scales by 0.5 while its config says 0.25 (the attribute its
    forward reads was changed after it was built): the reference is named in the error at the first step."""
    policy, ref = tiny_model(tok, "cohere", seed=0), tiny_model(tok, "cohere", seed=1)
    ref.logit_scale = 0.5  # what CohereForCausalLM.forward multiplies by (read from its config at init)
    trainer = DPOTrainer(policy, ref, dpo_config(tmp_path), train_dataset=preference_dataset(8),
                         processing_class=tok, use_liger=True, liger_patch_model=False)
    with pytest.raises(ValueError, match=r"cannot serve ref_model / teacher_model: CohereForCausalLM"):
        step0(trainer, first_batch(trainer))


def test_a_reference_of_another_transform_is_refused_when_built(tok, tmp_path):
    """The DPO loss applies the policy's logit transform to the reference's tiles: a reference whose config asks
    for another (Cohere, logit scale 0.5 against 0.25) is refused when the trainer is built, unless its
    log-probs are precomputed with its own."""
    policy, ref = tiny_model(tok, "cohere", seed=0), tiny_model(tok, "cohere", seed=1)
    ref.config.logit_scale = ref.logit_scale = 0.5
    with pytest.raises(ValueError, match=r"ref_model.*logit transform .* differs from the policy's"):
        DPOTrainer(policy, ref, dpo_config(tmp_path), train_dataset=preference_dataset(8), processing_class=tok,
                   use_liger=True, liger_patch_model=False)
    DPOTrainer(policy, ref, dpo_config(tmp_path, precompute_ref_log_probs=True), train_dataset=preference_dataset(8),
               processing_class=tok, use_liger=True, liger_patch_model=False)


def test_the_check_leaves_the_random_streams_as_they_were(tok):
    """Dropout in the checked forward draws from a forked generator: the trainer's RNG state is unchanged."""
    model = build_tiny_model(tok)
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    model.train()
    before = torch.get_rng_state()
    check_model_logits(model, model, ids_of(tok), softcap=None, logit_scale=1.0)
    assert torch.equal(torch.get_rng_state(), before)


def test_missing_input_ids_are_not_checked(tok):
    """Inputs without ``input_ids``: None, no forward run."""
    model = build_tiny_model(tok)
    assert check_model_logits(model, model, {"inputs_embeds": torch.zeros(1, 4, 64)}, softcap=None,
                              logit_scale=1.0) is None


class HeadWeightLlama(LlamaForCausalLM):
    """A Llama whose forward computes its logits from ``lm_head.weight`` without calling the head module."""

    def forward(self, input_ids=None, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        return CausalLMOutputWithPast(logits=torch.nn.functional.linear(hidden, self.lm_head.weight))


def test_a_sharded_model_is_checked_inside_its_heads_call(tok, monkeypatch):
    """A model whose head's weight is whole only inside the head module's call (FSDP / DTensor sharding, told here
    by ``is_sharded``): the formula is computed in the head's pre-forward hook, so a plain model checks equal (rel
    <= 1e-5, fp32) and the width-scaled one is refused; a sharded model whose forward never calls its head module
    cannot be checked (None), while the same model unsharded is checked after its forward."""
    from liger_losses.trl_integration import logit_check

    direct = HeadWeightLlama(build_tiny_model(tok).config)
    direct.load_state_dict(build_tiny_model(tok).state_dict())
    assert check_model_logits(direct, direct, ids_of(tok), softcap=None, logit_scale=1.0) <= 1e-5
    monkeypatch.setattr(logit_check, "is_sharded", lambda wrapped, causal_lm: True)
    model = build_tiny_model(tok)
    assert check_model_logits(model, model, ids_of(tok), softcap=None, logit_scale=1.0) <= 1e-5
    scaled = width_scaled(tok)
    with pytest.raises(ValueError, match=r"WidthScaledLlama's own forward computes logits that differ"):
        check_model_logits(scaled, scaled, ids_of(tok), softcap=None, logit_scale=1.0)
    assert check_model_logits(direct, direct, ids_of(tok), softcap=None, logit_scale=1.0) is None


def test_a_head_the_loss_refuses_raises_its_own_error(tok):
    """A head with a parameter besides weight and bias (a learned logit scale): ``lm_head_params``' ValueError,
    computed inside the model's forward, reaches the caller as it is (not a could-not-check warning)."""
    model = build_tiny_model(tok)
    model.lm_head.register_parameter("logit_scale", torch.nn.Parameter(torch.ones(1)))
    with pytest.raises(ValueError, match="logit_scale"):
        check_model_logits(model, model, ids_of(tok), softcap=None, logit_scale=1.0)


class LastTokenLlama(LlamaForCausalLM):
    """A Llama whose forward returns the last position's logits only."""

    def forward(self, input_ids=None, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        return CausalLMOutputWithPast(logits=self.lm_head(hidden[:, -1:]))


def test_logits_of_another_shape_are_refused(tok):
    """A forward whose logits do not cover every position: a ValueError naming both shapes."""
    model = LastTokenLlama(build_tiny_model(tok).config)
    n = ids_of(tok)["input_ids"].shape[1]
    with pytest.raises(ValueError, match=rf"logits of shape \(1, 1, {len(tok)}\) where its backbone and LM head give "
                                         rf"\(1, {n}, {len(tok)}\)"):
        check_model_logits(model, model, ids_of(tok), softcap=None, logit_scale=1.0)


def test_zero3_partitioned_models_are_not_checked(tok):
    """A ZeRO-3 parameter (``ds_id``): None, no forward run (DeepSpeed's prefetcher would replay the extra forward's
    module order in later steps and fetch the head while the loss gathers it)."""
    model = build_tiny_model(tok)
    model.lm_head.weight.ds_id = 0
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    assert check_model_logits(model, model, ids_of(tok), softcap=None, logit_scale=1.0) is None
    assert not calls


def test_a_forward_that_fails_on_plain_input_ids_warns(tok):
    """A model whose own forward needs more than ``input_ids``: a warning saying the check could not run."""
    model = build_tiny_model(tok)

    def needs_more(*args, **kwargs):
        raise TypeError("pixel_values is required")

    model.forward = needs_more
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert check_model_logits(model, model, ids_of(tok), softcap=None, logit_scale=1.0) is None
    assert any("could not check" in str(w.message) and "pixel_values" in str(w.message) for w in record)


def test_rtol_is_above_bf16_rounding(tok):
    """The bar's headroom: the same model in bf16 checks far below ``RTOL`` (the logits rounded to bf16)."""
    model = build_tiny_model(tok).to(torch.bfloat16)
    diff = check_model_logits(model, model, ids_of(tok), softcap=None, logit_scale=1.0)
    assert diff <= RTOL / 4, diff


def test_the_check_runs_in_the_steps_autocast(tok, tmp_path):
    """With ``bf16=True`` (CPU autocast) the check's forward runs under the step's autocast, with grad off: the
    backbone sees bf16 autocast in both calls, and the check passes on the bf16 logits."""
    trainer = SFTTrainer(build_tiny_model(tok), sft_config(tmp_path, bf16=True, max_steps=1),
                         train_dataset=sft_dataset(), processing_class=tok, use_liger=True, liger_patch_model=False)
    seen = record_backbone_autocast(trainer)
    trainer.train()
    assert seen == {("policy", False, True, torch.bfloat16), ("policy", True, True, torch.bfloat16)}, seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_cuda_logits_check_far_below_the_bar(tok, dtype):
    """On the GPU, fp32 weights under the step's autocast and half-precision weights alike: the model's logits
    (cuBLAS, rounded to ``dtype``) sit below ``RTOL / 4`` from the fp32 formula, softcap included (Gemma-2's,
    computed in the model's dtype)."""
    ids = {k: v.cuda() for k, v in ids_of(tok).items()}
    model = build_tiny_model(tok).cuda()
    with torch.autocast("cuda", dtype=dtype):
        assert check_model_logits(model, model, ids, softcap=None, logit_scale=1.0) <= RTOL / 4
    model = model.to(dtype)
    assert check_model_logits(model, model, ids, softcap=None, logit_scale=1.0) <= RTOL / 4
    gemma = capped_gemma2(tok).cuda().to(dtype)
    assert check_model_logits(gemma, gemma, ids, softcap=5.0, logit_scale=1.0) <= RTOL / 4
    with pytest.raises(ValueError, match="differ"):
        check_model_logits(gemma, gemma, ids, softcap=None, logit_scale=1.0)
