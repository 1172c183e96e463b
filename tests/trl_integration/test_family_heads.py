"""The fused loss on families whose logits are not a plain ``lm_head(last_hidden_state)``: served where the
transform is known, refused by name where it is not.

The reference is the model's own forward, not TRL's trainer: TRL 1.16's fused LM head reads the same config
attributes we read, so it misses the same transforms. ``model(**batch).logits`` of an untouched copy, scored
as the token-mean NLL of the shifted labels, against our SFT trainer's loss on the same batch; the loss and
every parameter gradient to a relative error <= 1e-4 (fp32 on the CPU: the same math in another order gives
~1e-6; a missed transform gives O(1)). Gradients below 1e-6 of the largest are skipped (exactly zero in exact
arithmetic, e.g. a key projection's bias under softmax: their rounding noise has no relative size).
"""

import copy
from types import SimpleNamespace

import pytest
import torch

from liger_losses.trl_integration import SFTTrainer
from liger_losses.trl_integration.anatomy import head_logit_options

from .utils import first_batch, grads_of, rel, sft_config, sft_dataset, step0

TOL = 1e-4


def _config(tok, model_type: str):
    """Tiny configs (width 64, 2 layers) with the family's logit transform set away from its identity."""
    V = len(tok)
    common = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    llama_like = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
    kwargs = {
        # xLSTM: logits capped by output_logit_soft_cap (30 by default)
        "xlstm": dict(vocab_size=V, hidden_size=64, embedding_dim=64, num_heads=4, num_blocks=2,
                      output_logit_soft_cap=5.0, qk_dim_factor=0.5, v_dim_factor=1.0),
        # Inkling: hidden states divided by logits_mup_width_multiplier (24 by default), logits cut to the
        # unpadded vocabulary
        "inkling_text": dict(llama_like, vocab_size=V + 8, unpadded_vocab_size=V, logits_mup_width_multiplier=4.0,
                             moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                             sliding_window_size=16, rel_extent=16),
        # Llama-4: base_model_prefix "language_model", the decoder at .model (its forward adds no router loss)
        "llama4_text": dict(llama_like, intermediate_size_mlp=128, num_local_experts=2, router_aux_loss_coef=0.0),
        # Granite-MoE: the router loss over num_local_experts (TRL 1.16 reads num_experts), logits / logits_scaling
        "granitemoe": dict(llama_like, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                           router_aux_loss_coef=0.05, logits_scaling=4.0),
        # MPT: config.logit_scale exists, MptForCausalLM never applies it
        "mpt": dict(vocab_size=V, d_model=64, n_heads=4, n_layers=2, logit_scale=0.25),
        # refused: a prediction transform (dense, GELU, LayerNorm) between the encoder and the decoder Linear
        "bert": dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     is_decoder=True),
        # refused: a learned per-vocabulary logit scale inside the head (an nn.Linear subclass)
        "dory": llama_like,
        # refused: logits from the n-gram predicting streams
        "prophetnet": dict(vocab_size=V, hidden_size=64, decoder_ffn_dim=128, num_decoder_layers=2,
                           num_decoder_attention_heads=4, encoder_ffn_dim=128, num_encoder_layers=2,
                           num_encoder_attention_heads=4),
    }[model_type]
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **kwargs, **common)


def tiny_model(tok, model_type: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(tok, model_type)).float()
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, 0.5)  # logits of order 1-5: a missed cap or scale shows
    return model


def _trainer(tok, tmp_path, model):
    return SFTTrainer(model, sft_config(tmp_path), train_dataset=sft_dataset(), processing_class=tok, use_liger=True,
                      liger_patch_model=False)


def _own_loss(model, batch):
    """The token-mean NLL of the shifted labels from ``model``'s own logits, plus ``router_aux_loss_coef`` times
    its own load-balancing loss when its config asks for router logits."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
    aux = bool(getattr(model.config, "output_router_logits", False))
    out = model(**inputs, use_cache=False, **({"output_router_logits": True} if aux else {}))
    labels = batch["labels"]
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].float().reshape(-1, out.logits.shape[-1]),
                                             labels[:, 1:].reshape(-1), ignore_index=-100)
    return loss + model.config.router_aux_loss_coef * out.aux_loss if aux else loss


def assert_equals_own_logits(ours, pristine):
    """Our trainer's SFT loss on its first batch and every gradient equal ``pristine``'s own forward's (rel <=
    1e-4, gradients below 1e-6 of the largest skipped: see the module docstring)."""
    batch = first_batch(ours)
    loss, _ = step0(ours, dict(batch))
    loss.backward()
    from liger_losses.patching import revert_liger_kernels

    revert_liger_kernels()  # the reference runs transformers' own RoPE, whatever the trainer patched
    pristine.train()
    truth = _own_loss(pristine, batch)
    truth.backward()
    assert rel(loss.detach(), truth.detach()) <= TOL, (float(loss), float(truth))
    g_truth, g_ours = grads_of(pristine), grads_of(ours.model)
    largest = max(float(g.norm()) for g in g_truth.values())
    for name, g in g_truth.items():
        if float(g.norm()) >= 1e-6 * largest:
            assert float((g_ours[name] - g).norm()) <= TOL * float(g.norm()), name


@pytest.mark.parametrize("model_type", ["xlstm", "inkling_text", "llama4_text", "granitemoe", "mpt"])
def test_loss_and_gradients_equal_the_models_own_logits(tok, tmp_path, model_type):
    """Our SFT loss and every gradient equal the model's own forward's (rel <= 1e-4); Granite-MoE's include its
    router load-balancing loss."""
    model = tiny_model(tok, model_type)
    pristine = copy.deepcopy(model)
    assert_equals_own_logits(_trainer(tok, tmp_path, model), pristine)


@pytest.mark.parametrize("model_type, match", [
    ("bert", r"BertLMHeadModel\.cls .*parameters around its LM head"),
    ("dory", r"parameters besides weight and bias \(logit_scale\)"),
    ("prophetnet", r"n-gram predicting streams"),
])
def test_a_head_path_the_loss_cannot_follow_is_refused_at_construction(tok, tmp_path, model_type, match):
    """A model whose logits go through layers the fused loss would skip raises ValueError naming them when the
    trainer is built, instead of training another objective."""
    with pytest.raises(ValueError, match=match):
        _trainer(tok, tmp_path, tiny_model(tok, model_type))


def test_head_logit_options_reads_each_familys_attributes():
    """The softcap and scale names per family; attributes a family's forward ignores are not read."""
    def opts(**attrs):
        return head_logit_options(SimpleNamespace(**attrs))

    assert opts(model_type="xlstm", output_logit_soft_cap=30.0) == {"softcap": 30.0, "logit_scale": 1.0}
    assert opts(model_type="inkling_text", logits_mup_width_multiplier=24.0) == {"softcap": None,
                                                                                 "logit_scale": 1 / 24.0}
    assert opts(model_type="mpt", logit_scale=0.25) == {"softcap": None, "logit_scale": 1.0}
    # Gemma3ForConditionalGeneration (model_type "gemma3") applies no softcap; Gemma3ForCausalLM ("gemma3_text") does
    text = SimpleNamespace(model_type="gemma3_text", final_logit_softcapping=30.0)
    wrapper = SimpleNamespace(model_type="gemma3", get_text_config=lambda: text)
    assert head_logit_options(wrapper)["softcap"] is None
    assert head_logit_options(text)["softcap"] == 30.0


def test_a_router_loss_without_expert_counts_is_refused_at_construction(tok, tmp_path):
    """TRL's rule turns the router loss on for any config with ``output_router_logits``; when the model names no
    expert count or top-k, the trainer says so when built, not with an AttributeError inside the first step."""
    from .utils import build_tiny_model

    model = build_tiny_model(tok)
    model.config.output_router_logits = False
    model.config.router_aux_loss_coef = 0.1
    with pytest.raises(ValueError, match="needs its expert count"):
        _trainer(tok, tmp_path, model)


def test_a_sharded_head_the_loss_would_have_to_cut_is_refused_at_construction(tok, tmp_path):
    """Inkling's vocabulary cut on a DeepSpeed ZeRO-3 partitioned head (a parameter with ``ds_id``, its rows in
    ``ds_shape``, empty here as a partitioned one is): refused when the trainer is built, naming the reason."""
    model = tiny_model(tok, "inkling_text")
    weight = model.get_output_embeddings().weight
    weight.ds_id, weight.ds_shape = 0, weight.shape
    with pytest.raises(ValueError, match="cannot slice a sharded head"):
        _trainer(tok, tmp_path, model)


def test_gemma3_conditional_generation_is_patched_and_equals_its_own_logits(tok, tmp_path):
    """Gemma-3 4B and up load as ``Gemma3ForConditionalGeneration`` (model_type "gemma3"): with the default
    ``liger_patch_model=True`` its text model's layers are ours, no warning, and a text-only SFT step equals the
    model's own logits (rel <= 1e-4), which carry no softcap though its text config has one (1.0 here)."""
    import warnings

    from tests.patching.tiny_models import tiny_composite

    model = tiny_composite("gemma3", vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    pristine = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ours = SFTTrainer(model, sft_config(tmp_path), train_dataset=sft_dataset(), processing_class=tok,
                          use_liger=True)
    assert not [w for w in record if "layers stay transformers'" in str(w.message)]
    text_model = ours.model.model.language_model
    assert {type(m).__name__ for m in text_model.modules() if "Norm" in type(m).__name__} == {"LigerGemmaRMSNorm"}
    assert_equals_own_logits(ours, pristine)


def test_a_reference_model_the_loss_cannot_follow_is_named_in_the_error(tok, tmp_path):
    """The construction check covers the reference model too, and its error says which model it is."""
    from liger_losses.trl_integration import DPOTrainer

    from .utils import build_tiny_model, dpo_config, preference_dataset

    with pytest.raises(ValueError, match=r"cannot serve ref_model / teacher_model: BertLMHeadModel\.cls"):
        DPOTrainer(build_tiny_model(tok), tiny_model(tok, "bert"), args=dpo_config(tmp_path),
                   train_dataset=preference_dataset(8), processing_class=tok, use_liger=True, liger_patch_model=False)
