"""Tiny random Hugging Face causal LMs and batches for tests (offline: built from configs).

``tiny_config(model_type, **overrides)``: 2 layers, hidden 64, 4 heads / 2 KV heads of 16,
intermediate 128, vocab 128, eager attention; Phi-3 uses partial rotary (factor 0.5) and Gemma-2
a final-logit softcap of 1.0 so that both code paths matter at this scale.
``tiny_model(model_type, *, dtype=torch.float32, device="cpu", **overrides)``: that model with
every weight drawn afresh (matrices N(0, 0.1^2); norm weights = their init value + N(0, 0.1^2), so
Gemma's ``1 + w`` and Llama's ``w`` are both exercised), in training mode.
``tiny_batch(config, *, batch=2, seq=8, device="cpu")``: ``dict(input_ids, attention_mask,
labels)`` with ``input_ids`` ``[batch, seq]`` int64 in ``[3, vocab)``, ``labels`` a copy of them
with the first 3 positions of row 0 and the last position of row 1 set to -100, attention mask of
ones. Other helpers may import these.
"""

from __future__ import annotations

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

_PER_FAMILY = {
    "gemma2": dict(final_logit_softcapping=1.0, query_pre_attn_scalar=16),
    "phi3": dict(partial_rotary_factor=0.5),
}


def tiny_config(model_type: str, **overrides):
    """A tiny config of ``model_type`` (see the module docstring)."""
    from transformers import AutoConfig

    kwargs = dict(_COMMON)
    kwargs.update(_PER_FAMILY.get(model_type, {}))
    kwargs.update(overrides)
    if model_type == "phi3":
        kwargs.pop("head_dim", None)  # Phi-3 derives it from hidden_size / heads
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = "eager"
    return config


@torch.no_grad()
def randomize_(model: torch.nn.Module, *, std: float = 0.1) -> torch.nn.Module:
    """Redraw every parameter in place: matrices N(0, std^2), vectors init + N(0, std^2)."""
    for p in model.parameters():
        if p.dim() >= 2:
            p.normal_(0.0, std)
        else:
            p.add_(torch.randn_like(p) * std)
    return model


def tiny_model(model_type: str, *, dtype=torch.float32, device="cpu", **overrides):
    """A tiny random ``*ForCausalLM`` of ``model_type`` in training mode."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize_(model)
    return model.to(device=device, dtype=dtype).train()


def tiny_batch(config, *, batch: int = 2, seq: int = 8, device="cpu"):
    """Inputs and labels (some -100) for ``config``'s vocabulary (see the module docstring)."""
    input_ids = torch.randint(3, config.vocab_size, (batch, seq), device=device)
    labels = input_ids.clone()
    labels[0, :3] = -100
    if batch > 1:
        labels[1, -1] = -100
    attention_mask = torch.ones_like(input_ids)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def loss_and_grads(model, batch, **kwargs):
    """Run ``model(**batch, **kwargs)`` in its current mode, backward the loss.

    Returns ``(outputs, {name: grad.clone()})`` and zeroes the grads afterwards.
    """
    model.zero_grad(set_to_none=True)
    outputs = model(**batch, **kwargs)
    outputs.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return outputs, grads
