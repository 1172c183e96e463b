"""Vision-language models in the RL trainers (``trl_integration/multimodal.py``, GRPO and RLOO).

0. A composite model's call beyond the text keywords (images, audio, token types) runs its base model, a text-only
   call its language model.
1. The image keywords our policy forward gets equal, key for key and tensor for tensor, what TRL 1.16's own
   ``_get_per_token_logps_and_entropies`` hands the model for the whole batch, for every image layout its code
   knows (Qwen-VL's patch grid, per-image pixels, Llava-NeXT's image sizes, Gemma-3's token types, LFM2-VL's and
   InternVL's tiles, Idefics' pixel mask, per-image position ids) and for a text batch (none).
2. On tiny Qwen2-VL (patch grid, M-RoPE) and Llava (per-image pixels, with its processor) models built offline, a
   GRPO and an RLOO step on a batch with one image per prompt: loss, every logged metric and every gradient, the
   vision tower's included, equal TRL's (rel <= 1e-4: the same fp32 math in another order), and the vision tower's
   gradient is not zero (the images reach the loss).
3. GRPO trained end to end on an image dataset (TRL generating from the processor's prompts with images): two
   steps log the loss, grad norm, reward and entropy TRL logs (rel <= 1e-4).
4. SFT on a conversational image dataset (TRL's vision collator, Llava), DPO on image preference pairs and KTO on
   unpaired image completions (with its KL completions) against a reference Llava of other weights: loss, logged
   metrics and every gradient equal TRL's (rel <= 1e-4), the vision tower's gradient not zero.
"""

import contextlib
import types

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

from liger_losses.patching import revert_liger_kernels  # noqa: E402
from liger_losses.patching.pad_free import varlen_call_count  # noqa: E402
from liger_losses.trl_integration.dpo import DPOTrainer  # noqa: E402
from liger_losses.trl_integration.grpo import GRPOTrainer  # noqa: E402
from liger_losses.trl_integration.kto import KTOTrainer  # noqa: E402
from liger_losses.trl_integration.multimodal import (  # noqa: E402
    multimodal_backbone_of,
    rl_multimodal_inputs,
    runs_base_model,
)
from liger_losses.trl_integration.rloo import RLOOTrainer  # noqa: E402
from liger_losses.trl_integration.sft import SFTTrainer  # noqa: E402

from .utils import (  # noqa: E402
    assert_metrics_match,
    build_tokenizer,
    dpo_config,
    first_batch,
    grads_of,
    rel,
    sft_config,
    trl_config,
)

TOL = 1e-4
B, T = 2, 7


def _layouts():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    ids = torch.zeros(B, T, dtype=torch.long)
    return {
        "qwen-vl grid": dict(pixel_values=r(8, 12), image_grid_thw=torch.tensor([[1, 2, 2], [1, 2, 2]]),
                             num_images=[1, 1], mm_token_type_ids=ids + 1),
        "per image": dict(pixel_values=r(2, 3, 4, 4), num_images=[1, 1]),
        "image sizes": dict(pixel_values=r(2, 5, 3, 4, 4), image_sizes=torch.tensor([[4, 4], [4, 4]]),
                            num_images=[1, 1]),
        "token types": dict(pixel_values=r(2, 3, 4, 4), token_type_ids=ids + 1, num_images=[1, 1]),
        "lfm2-vl tiles": dict(pixel_values=r(3, 16, 12), spatial_shapes=torch.tensor([[4, 4]] * 3),
                              pixel_attention_mask=torch.ones(3, 16, dtype=torch.bool), num_tiles=[2, 1],
                              num_images=[1, 1]),
        "internvl tiles": dict(pixel_values=r(3, 3, 4, 4), num_tiles=[2, 1], num_images=[1, 1]),
        "pixel mask": dict(pixel_values=r(2, 1, 3, 4, 4), pixel_attention_mask=torch.ones(2, 1, 4, 4),
                           num_images=[1, 1]),
        "position ids": dict(pixel_values=r(2, 6, 12), image_position_ids=torch.arange(12).view(2, 6),
                             num_images=[1, 1]),
        "text only": {},
    }


@pytest.mark.parametrize("trainer_cls", [trl.GRPOTrainer, trl.RLOOTrainer], ids=["grpo", "rloo"])
@pytest.mark.parametrize("layout", sorted(_layouts()))
def test_image_inputs_are_trls(trainer_cls, layout):
    """Our forward's image keywords are exactly those TRL's own policy forward passes (a recording model)."""
    fields = _layouts()[layout]
    seen = {}

    def model(**kwargs):
        seen.update(kwargs)
        return types.SimpleNamespace(log_probs=torch.zeros(B, T), entropy=torch.zeros(B, T), aux_loss=None)

    stub = types.SimpleNamespace(accelerator=types.SimpleNamespace(autocast=contextlib.nullcontext))
    forward = trainer_cls._get_per_token_logps_and_entropies
    getattr(forward, "__wrapped__", forward)(  # under TRL's profiling decorator
        stub, model, torch.zeros(B, T, dtype=torch.long), torch.ones(B, T, dtype=torch.long), 3,
        compute_entropy=True, **{k: fields.get(k) for k in (
            "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
            "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")})
    want = {k: v for k, v in seen.items() if k not in ("input_ids", "attention_mask", "labels", "fused_lm_head")}
    got = rl_multimodal_inputs(fields)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_composite_models_call_beyond_text_runs_its_base_model(tmp_path):
    """A composite model's call with images, audio features or token types runs its base model (its language model
    alone would take them through ``**kwargs`` and ignore them); a text-only call, or any call of a text model, the
    language model (which pad-free can pack)."""
    from .utils import build_tiny_model

    llava = transformers.LlavaForConditionalGeneration.from_pretrained(_llava(tmp_path)[0])
    text = dict(input_ids=torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 4), use_cache=False)
    assert not runs_base_model(llava, text)
    assert not runs_base_model(llava, dict(text, pixel_values=None))
    for extra in ("pixel_values", "input_features", "token_type_ids", "image_grid_thw"):
        assert runs_base_model(llava, dict(text, **{extra: torch.zeros(1)})), extra
    assert multimodal_backbone_of(llava) is llava.model
    assert not runs_base_model(build_tiny_model(build_tokenizer()), dict(text, pixel_values=torch.zeros(1)))


# --------------------------------------------------------------------------- tiny vision-language models


def _tokenizer(*image_tokens):
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(image_tokens)})
    return tok


def _qwen_vl(tmp_path, version: int):
    """A tiny Qwen2-VL (``version`` 2: 14-pixel patches) or Qwen3-VL (3: 16-pixel patches, interleaved M-RoPE, the
    vision block also feeding the first text layer: deepstack) -- 2 text layers of width 64, M-RoPE, a one-block
    vision tower merging 2 x 2 patches, images of 4 x 4 patches -- saved under ``tmp_path``, with our character
    tokenizer plus its three image tokens as the processing class (its processor needs torchvision). Returns (path,
    tokenizer, a batch maker)."""
    tok = _tokenizer("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
    image_pad, start, end = tok.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                rope_parameters=rope, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    if version == 2:
        patch, config_cls, model_cls = 14, transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
        vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, in_chans=3, patch_size=patch,
                      spatial_merge_size=2, temporal_patch_size=2, mlp_ratio=2)
    else:
        patch, config_cls, model_cls = 16, transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration
        rope["mrope_interleaved"] = True
        text["head_dim"] = 16
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=patch,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                      deepstack_visual_indexes=[0])
    config = config_cls(text_config=text, vision_config=vision, image_token_id=image_pad, vision_start_token_id=start,
                        vision_end_token_id=end)
    torch.manual_seed(0)
    path = tmp_path / f"tiny-qwen{version}-vl"
    model_cls(config).float().save_pretrained(path)

    def images(prompt, g):  # one 4 x 4-patch image per prompt: 2 x 2 merged tokens (unequal M-RoPE rows) in markers
        n = prompt.shape[0]
        prompt[:, 1], prompt[:, 2:6], prompt[:, 6] = start, image_pad, end
        return dict(pixel_values=torch.randn(n * 16, 3 * 2 * patch * patch, generator=g),
                    image_grid_thw=torch.tensor([[1, 4, 4]] * n), num_images=[1] * n)

    return str(path), tok, images


def _llama_text(tok):
    """The text config of the Llama-based tiny VLMs: 2 layers of width 64, GQA 4:2, our tokenizer's ids."""
    return dict(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)


def _llava(tmp_path, seed=0):
    """A tiny Llava (2 Llama layers of width 64; a one-layer CLIP tower on 28 x 28 images, 4 image tokens) saved
    under ``tmp_path``, with its ``LlavaProcessor`` (our character tokenizer plus ``<image>``) as the processing
    class."""
    tok = _tokenizer("<image>")
    image, text = tok.convert_tokens_to_ids("<image>"), _llama_text(tok)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
    config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=image,
                                      vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    path = tmp_path / f"tiny-llava-{seed}"
    transformers.LlavaForConditionalGeneration(config).float().save_pretrained(path)
    processor = transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size=28), tokenizer=tok,
        patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1)

    def images(prompt, g):  # one image per prompt: four image tokens
        n = prompt.shape[0]
        prompt[:, 1:5] = image
        return dict(pixel_values=torch.randn(n, 3, 28, 28, generator=g), num_images=[1] * n)

    return str(path), processor, images


def _smolvlm(tmp_path):
    """A tiny SmolVLM (2 Llama layers of width 64 as its ``text_model``; a one-layer vision tower on 56 x 56 images,
    pixel-shuffled by 2 into 4 image tokens), with our character tokenizer plus ``<image>`` as the processing class."""
    tok = _tokenizer("<image>")
    image, text = tok.convert_tokens_to_ids("<image>"), _llama_text(tok)
    vision = dict(model_type="smolvlm_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=56, patch_size=14)
    config = transformers.SmolVLMConfig(text_config=text, vision_config=vision, image_token_id=image, scale_factor=2)
    torch.manual_seed(0)
    path = tmp_path / "tiny-smolvlm"
    transformers.SmolVLMForConditionalGeneration(config).float().save_pretrained(path)

    def images(prompt, g):  # one image per prompt: four image tokens
        n = prompt.shape[0]
        prompt[:, 1:5] = image
        return dict(pixel_values=torch.randn(n, 1, 3, 56, 56, generator=g),
                    pixel_attention_mask=torch.ones(n, 1, 56, 56, dtype=torch.bool), num_images=[1] * n)

    return str(path), tok, images


MODELS = {"qwen2_vl": lambda tmp_path: _qwen_vl(tmp_path, 2), "qwen3_vl": lambda tmp_path: _qwen_vl(tmp_path, 3),
          "llava": _llava, "smolvlm": _smolvlm}


def _vl_batch(trainer, images, seed=0):
    """A batch of 4 prompts of 7 tokens with one image each (``images`` writes its tokens and gives its fields),
    completions of 5 tokens (one ending early, one prompt left-padded), random advantages, and old log-probs: TRL's
    own (with the images) moved by N(0, 0.3), per token for GRPO, summed per sequence for RLOO."""
    n = 4
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 40, (n, 7), generator=g)
    fields = images(prompt, g)
    prompt_mask = torch.ones(n, 7, dtype=torch.long)
    prompt_mask[2, 0] = 0
    completion = torch.randint(3, 40, (n, 5), generator=g)
    completion_mask = torch.ones(n, 5, dtype=torch.long)
    completion_mask[0, 3:] = 0
    ids = torch.cat([prompt, completion], 1)
    if "image_grid_thw" in fields:  # Qwen-VL's M-RoPE reads which tokens are image tokens
        fields["mm_token_type_ids"] = (ids == trainer.model.config.image_token_id).long()
    batch = dict(prompt_ids=prompt, prompt_mask=prompt_mask, completion_ids=completion,
                 completion_mask=completion_mask, advantages=torch.randn(n, generator=g),
                 num_items_in_batch=completion_mask.sum().float(), **fields)
    dev = trainer.accelerator.device  # drawn on the CPU, then moved: the same numbers on every device
    batch = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    fields = {k: batch[k] for k in fields}
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids.to(dev), torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), 5,
            **fields)[0]
    old = logps + 0.3 * torch.randn(logps.shape, generator=g).to(dev)
    completion_mask = batch["completion_mask"]
    if isinstance(trainer, trl.RLOOTrainer):
        batch["old_logps"] = (old * completion_mask).sum(1)
    else:
        batch["old_per_token_logps"] = old
    return batch


def _step(trainer, batch):
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    trainer._metrics["train"].clear()
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


def _assert_grads_match(loss_t, loss_o, theirs, ours):
    """Every parameter's gradient equal to TRL's to ``TOL`` relative (Frobenius) error, where a gradient that is zero
    in exact arithmetic (an attention key projection's bias: a shift of every score of a query, which its softmax
    cancels; CLIP's keys have one) is held to ``TOL`` of the largest gradient instead: it is rounding noise in both."""
    loss_t.backward()
    loss_o.backward()
    g_t, g_o = grads_of(theirs.model), grads_of(ours.model)
    assert g_t.keys() == g_o.keys() and g_t
    scale = max(float(g.norm()) for g in g_t.values())
    for name, g in g_t.items():
        floor = scale if name.endswith("k_proj.bias") else 1e-30
        err = float((g_o[name] - g).norm()) / max(float(g.norm()), floor)
        assert err <= TOL, f"grad {name}: rel err {err:.2e}"


def _assert_step_parity(theirs, ours, batch):
    """One loss step of each trainer on ``batch``: the loss, every metric TRL logs and every gradient equal TRL's, and
    the vision tower's gradient is not zero (the images reached the loss). Returns TRL's metrics."""
    loss_t, m_t = _step(theirs, batch)
    loss_o, m_o = _step(ours, batch)
    assert rel(loss_o, loss_t) <= TOL, (float(loss_o), float(loss_t))
    assert_metrics_match(m_o, m_t, TOL)
    _assert_grads_match(loss_t, loss_o, theirs, ours)
    causal_lm = ours.model.get_base_model() if hasattr(ours.model, "get_base_model") else ours.model
    base = causal_lm.model
    tower = getattr(base, "visual", None) or getattr(base, "vision_model", None) or base.vision_tower
    vision = next(p for p in tower.parameters() if p.dim() > 1 and p.requires_grad).grad  # a LoRA factor under PEFT
    assert vision is not None and vision.abs().sum() > 0
    return m_t


@pytest.mark.parametrize("variant", ["plain", "lora-checkpointed", "pad-free"])
@pytest.mark.parametrize("trainer_name", ["grpo", "rloo"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_vision_language_step_parity(tmp_path, monkeypatch, trainer_name, family, variant):
    """``lora-checkpointed``: PEFT LoRA on every linear layer (the vision tower's too) and transformers' activation
    checkpointing, as users train these models. ``pad-free`` (forced, the CPU's reference attention; checkpointed
    too): the language model runs on the attended tokens alone, packed, inside the base model's call (one varlen call
    per text layer; the vision tower unpacked); the padded batch's numbers all the same."""
    from datasets import Dataset

    if variant == "pad-free":  # with transformers' activation checkpointing, as users train
        monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "1")

    path, processing_class, images = MODELS[family](tmp_path)
    ours_cls, config_cls = (GRPOTrainer, trl.GRPOConfig) if trainer_name == "grpo" else (RLOOTrainer, trl.RLOOConfig)
    extra = dict(num_iterations=2, loss_type="dapo", beta=0.0) if trainer_name == "grpo" else dict(epsilon_high=0.28)
    peft_config = None
    if variant == "lora-checkpointed":
        peft = pytest.importorskip("peft")
        peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    extra["gradient_checkpointing"] = variant != "plain"
    data = Dataset.from_list([{"prompt": p} for p in ("abc", "hello", "xyz", "the cat")])
    theirs, ours = (
        ours_cls(path, _reward, trl_config(config_cls, tmp_path / str(use), per_device_train_batch_size=4,
                                           num_generations=2, max_completion_length=8, max_steps=1, **extra),
                 train_dataset=data, processing_class=processing_class, use_liger=use, peft_config=peft_config,
                 **({"liger_patch_model": False} if use else {}))
        for use in (False, True))
    assert ours.use_liger
    batch = _vl_batch(theirs, images)
    calls = varlen_call_count()
    _assert_step_parity(theirs, ours, batch)
    layers = ours.model.config.get_text_config().num_hidden_layers
    assert varlen_call_count() - calls == (layers if variant == "pad-free" else 0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_vision_language_pad_free_against_padded(tmp_path, monkeypatch, family, device):
    """Our GRPO step on a padded vision-language batch, pad-free (on CUDA by default: bf16 autocast, the flash varlen
    kernel, the reference attention forbidden; on the CPU forced, fp32, the reference attention) against the same
    trainer's padded step (``LIGER_LOSSES_PAD_FREE=0``): one packed call per text layer, and the loss and every
    gradient within 2e-2 relative on CUDA (two bf16 attention kernels, bf16 GEMMs), 1e-5 on the CPU (fp32)."""
    from datasets import Dataset

    from liger_losses.kernels import varlen_attention
    from tests.helpers import rel_err

    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("CUDA")

        def no_reference(*args, **kwargs):
            raise AssertionError("the packed step took the reference attention, not the flash kernel")

        monkeypatch.setattr(varlen_attention, "reference_varlen_attention", no_reference)
        monkeypatch.delenv("LIGER_LOSSES_PAD_FREE", raising=False)
    path, processing_class, images = MODELS[family](tmp_path)
    data = Dataset.from_list([{"prompt": p} for p in ("abc", "hello", "xyz", "the cat")])
    ours = GRPOTrainer(path, _reward, trl_config(trl.GRPOConfig, tmp_path / "run", per_device_train_batch_size=4,
                                                 num_generations=2, max_completion_length=8, max_steps=1,
                                                 loss_type="dapo", beta=0.0, bf16=device == "cuda",
                                                 use_cpu=device == "cpu"),
                       train_dataset=data, processing_class=processing_class, use_liger=True, liger_patch_model=False)
    batch = _vl_batch(ours, images)
    results = []
    for mode in ("packed", "0"):
        if mode == "0":
            monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "0")
        elif device == "cpu":
            monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "1")
        ours.model.zero_grad()
        calls = varlen_call_count()
        with ours.accelerator.autocast():  # as under train(): the prepared policy's forward runs in it
            loss, _ = _step(ours, batch)
        loss.backward()
        layers = ours.model.config.get_text_config().num_hidden_layers
        assert varlen_call_count() - calls == (layers if mode == "packed" else 0), mode
        results.append((loss.detach().float(), {n: p.grad.float().clone() for n, p in ours.model.named_parameters()
                                                if p.grad is not None}))
    (packed, g_packed), (padded, g_padded) = results
    tol = 2e-2 if device == "cuda" else 1e-5
    assert rel_err(packed, padded) <= tol, (float(packed), float(padded))
    assert g_packed.keys() == g_padded.keys() and g_packed
    for name in g_padded:
        if not name.endswith("k_proj.bias"):  # zero in exact arithmetic: rounding noise on both sides
            assert rel_err(g_packed[name], g_padded[name]) <= tol, name


# Llava's processor renders a message's image parts as its image token (expanded to the image's four tokens), an
# assistant turn ending in the end-of-sequence token
CHAT_TEMPLATE = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
                 "{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")


def _images(count):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (28, 28, 3), dtype=np.uint8)) for _ in range(count)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_vision_language_training_parity(tmp_path, device, monkeypatch):
    """On the CPU with transformers' layers; on CUDA (fp32, TF32 off) with ours patched into Llava's language model,
    our Triton kernels against transformers' layers in TRL's run."""
    from datasets import Dataset

    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("CUDA")
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)

    path, processor, _ = _llava(tmp_path)
    processor.chat_template = CHAT_TEMPLATE
    data = Dataset.from_list([
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
         "image": image} for text, image in zip(("abc", "hello", "xyz", "the cat"), _images(4))])

    def reward(completions, **kwargs):
        return [len(str(c)) / 10 for c in completions]

    logs = []
    for use in (False, True):
        torch.manual_seed(0)
        trainer = GRPOTrainer(path, reward, trl_config(trl.GRPOConfig, tmp_path / f"run{use}",
                                                       per_device_train_batch_size=4, num_generations=2,
                                                       max_completion_length=8, max_steps=2, loss_type="dapo",
                                                       use_cpu=device == "cpu"),
                              train_dataset=data, processing_class=processor, use_liger=use,
                              **({"liger_patch_model": device == "cuda"} if use else {}))
        try:
            trainer.train()
        finally:
            revert_liger_kernels()
        logs.append([h for h in trainer.state.log_history if "loss" in h])
    theirs, ours = logs
    assert len(theirs) == len(ours) == 2
    for t, o in zip(theirs, ours):
        for key in ("loss", "grad_norm", "reward", "entropy"):
            err = abs(o[key] - t[key]) if abs(t[key]) < 1e-4 else abs(o[key] - t[key]) / abs(t[key])
            assert err <= TOL, (key, o[key], t[key])


# packed language-model calls of one forced pad-free step: SFT's policy; DPO's policy and reference; KTO's policy,
# reference and both models' KL completions
VL_PACKED_CALLS = {"sft": 1, "dpo": 2, "kto": 4}


def _pad_free(monkeypatch, on: bool):
    """Force pad-free (the CPU's reference attention) when ``on``; the varlen call count before the step."""
    if on:
        monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "1")
    return varlen_call_count()


def _assert_packed(ours, trainer_name, on: bool, calls_before: int) -> None:
    layers = ours.model.config.get_text_config().num_hidden_layers
    assert varlen_call_count() - calls_before == (VL_PACKED_CALLS[trainer_name] * layers if on else 0)


@pytest.mark.parametrize("pad_free", [False, True], ids=["padded", "pad-free"])
def test_vision_language_sft_parity(tmp_path, monkeypatch, pad_free):
    """Llava SFT on image + text conversations: the step equals TRL's; forced pad-free, with the language model's
    call packed (answers of different lengths pad the batch)."""
    from datasets import Dataset

    path, processor, _ = _llava(tmp_path)
    processor.chat_template = CHAT_TEMPLATE
    pairs = (("abc", "de"), ("hello", "world"), ("xyz", "q"), ("the cat", "sat"))
    data = Dataset.from_list([
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]},
                      {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
         "images": [image]} for (prompt, answer), image in zip(pairs, _images(4))])
    theirs, ours = (SFTTrainer(path, sft_config(tmp_path / f"run{use}", max_length=None), train_dataset=data,
                               processing_class=processor, use_liger=use,
                               **({"liger_patch_model": False} if use else {}))
                    for use in (False, True))
    batch = first_batch(theirs)
    assert batch["pixel_values"].shape[0] == 4 and not batch["attention_mask"].all()
    calls = _pad_free(monkeypatch, pad_free)
    _assert_step_parity(theirs, ours, batch)
    _assert_packed(ours, "sft", pad_free, calls)


@pytest.mark.parametrize("pad_free", [False, True], ids=["padded", "pad-free"])
def test_vision_language_dpo_parity(tmp_path, monkeypatch, pad_free):
    """Llava DPO with a reference model: the step equals TRL's; forced pad-free, both models' language-model calls
    packed."""
    from datasets import Dataset

    path, processor, _ = _llava(tmp_path)
    ref_path = _llava(tmp_path, seed=1)[0]
    processor.chat_template = CHAT_TEMPLATE
    triples = (("abc", "de", "xy"), ("hello", "world", "w"), ("xyz", "q", "rr"), ("the cat", "sat", "ran"))
    data = Dataset.from_list([
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}],
         "chosen": [{"role": "assistant", "content": [{"type": "text", "text": chosen}]}],
         "rejected": [{"role": "assistant", "content": [{"type": "text", "text": rejected}]}],
         "images": [image]} for (prompt, chosen, rejected), image in zip(triples, _images(4))])
    theirs, ours = (DPOTrainer(path, transformers.LlavaForConditionalGeneration.from_pretrained(ref_path),
                               dpo_config(tmp_path / f"run{use}", max_length=None), train_dataset=data,
                               processing_class=processor, use_liger=use,
                               **({"liger_patch_model": False} if use else {}))
                    for use in (False, True))
    batch = first_batch(theirs)
    assert batch["pixel_values"].shape[0] == 8  # the prompt's image for the chosen and the rejected rows
    calls = _pad_free(monkeypatch, pad_free)
    metrics = _assert_step_parity(theirs, ours, batch)
    assert metrics["rewards/margins"] != 0  # the reference differs: a live preference loss
    _assert_packed(ours, "dpo", pad_free, calls)


@pytest.mark.parametrize("pad_free", [False, True], ids=["padded", "pad-free"])
def test_vision_language_kto_parity(tmp_path, monkeypatch, pad_free):
    """Llava KTO with a reference model and KL completions: the step equals TRL's; forced pad-free, every
    language-model call packed."""
    from datasets import Dataset

    path, processor, _ = _llava(tmp_path)
    ref_path = _llava(tmp_path, seed=1)[0]
    processor.chat_template = CHAT_TEMPLATE
    rows = (("abc", "de", True), ("hello", "world", False), ("xyz", "q", True), ("the cat", "sat", False))
    data = Dataset.from_list([
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}],
         "completion": [{"role": "assistant", "content": [{"type": "text", "text": completion}]}], "label": label,
         "images": [image]} for (prompt, completion, label), image in zip(rows, _images(4))])
    theirs, ours = (KTOTrainer(path, transformers.LlavaForConditionalGeneration.from_pretrained(ref_path),
                               trl_config(trl.KTOConfig, tmp_path / f"run{use}", max_length=None), train_dataset=data,
                               processing_class=processor, use_liger=use,
                               **({"liger_patch_model": False} if use else {}))
                    for use in (False, True))
    batch = first_batch(theirs)
    assert "KL_input_ids" in batch and batch["pixel_values"].shape[0] == 4  # the KL completions reuse the images
    calls = _pad_free(monkeypatch, pad_free)
    metrics = _assert_step_parity(theirs, ours, batch)
    assert metrics["rewards/chosen"] != 0  # the reference differs: live rewards (the KL estimate clamps at 0 here)
    _assert_packed(ours, "kto", pad_free, calls)


def test_vision_language_distillation_parity(tmp_path):
    """On-policy distillation of a tiny Llava student from a Llava teacher (seed 1) on image + text prompts: one batch
    generated by TRL's trainer (greedy), handed to both: the loss, the logged entropy and every student gradient
    equal TRL's (rel <= 1e-4), the images reaching both backbones (the student's vision tower gets a gradient)."""
    from datasets import Dataset

    from liger_losses.trl_integration.distillation import DistillationTrainer

    path, processor, _ = _llava(tmp_path)
    teacher_path = _llava(tmp_path, seed=1)[0]
    processor.chat_template = CHAT_TEMPLATE
    processor.tokenizer.padding_side = "left"
    data = Dataset.from_list([
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
         "image": image} for text, image in zip(("abc", "hello", "xyz", "the cat"), _images(4))])
    theirs, ours = (
        DistillationTrainer(path, transformers.LlavaForConditionalGeneration.from_pretrained(teacher_path),
                            trl_config(trl.DistillationConfig, tmp_path / f"run{use}", max_completion_length=8,
                                       generation_kwargs={"do_sample": False}),
                            train_dataset=data, processing_class=processor, use_liger=use,
                            **({"liger_patch_model": False} if use else {}))
        for use in (False, True))
    raw = next(iter(theirs.get_train_dataloader()))
    theirs.model.eval()
    batch = theirs._generate_and_score_completions(raw)
    assert batch["pixel_values"].shape[0] == 4 and batch["completion_mask"].sum() > 0
    metrics = _assert_step_parity(theirs, ours, batch)
    assert metrics["entropy"] > 0
