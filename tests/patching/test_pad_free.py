"""``patching/pad_free.py``: a backbone run on the attended tokens only, packed, against the padded call.

The padded call (transformers' SDPA with the padding mask) is the reference. On tiny float64 models of
every packed family the packed call's hidden states at the attended positions, and every parameter's
gradient of a loss on them, must equal the padded call's to 1e-10 (the same math; only the
attention's summation order differs). Masks cover left padding, right padding, a hole inside a row
and an all-padding row. Refusals (``None``) keep the padded call: a model or input it cannot serve,
no padding, a read position that is padding. A model whose attention did not take the packing raises.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from liger_losses.patching.pad_free import (  # noqa: E402
    completion_read_mask,
    pack_batch,
    pad_free_reason,
    varlen_call_count,
)

from .tiny_models import randomize_, tiny_config  # noqa: E402

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(autouse=True)
def _forced(monkeypatch):
    monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "1")  # on the CPU too (reference attention)


def _model(model_type, attn="sdpa", **overrides):
    torch.manual_seed(0)
    config = tiny_config(model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return randomize_(model).double().train()


def _batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (4, 9), generator=g)
    mask = torch.ones(4, 9, dtype=torch.long)
    mask[0, :3] = 0     # left padding
    mask[1, 6:] = 0     # right padding
    mask[2, 3:5] = 0    # a hole
    mask[3, :] = 0      # nothing attended
    return dict(input_ids=ids, attention_mask=mask, use_cache=False)


def _loss(hidden, mask, seed=1):
    g = torch.Generator().manual_seed(seed)
    probe = torch.randn(hidden.shape, generator=g, dtype=hidden.dtype)
    return (hidden * probe * mask[..., None]).sum()


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("checkpointing", [None, False, True], ids=["plain", "non-reentrant", "reentrant"])
def test_packed_call_equals_the_padded_call(model_type, checkpointing):
    model = _model(model_type)
    if checkpointing is not None:
        model.gradient_checkpointing_enable({"use_reentrant": checkpointing})
    backbone, kwargs = model.model, _batch(model.config.vocab_size)
    mask = kwargs["attention_mask"].bool()
    assert pad_free_reason(backbone, kwargs) == ""
    padded = backbone(**kwargs).last_hidden_state
    want = _grads(model, _loss(padded, mask))

    calls = varlen_call_count()
    packed = pack_batch(backbone, kwargs, mask)
    assert packed.kwargs["input_ids"].shape == (1, int(mask.sum()))
    assert packed.kwargs["liger_cu_seqlens"].tolist() == [0, 6, 12, 19, 19]
    assert packed.kwargs["liger_max_seqlen"] == 7
    assert packed.kwargs["position_ids"][0, :6].tolist() == [3, 4, 5, 6, 7, 8]  # the padded call's positions
    hidden = packed.unpack(backbone(**packed.kwargs).last_hidden_state)
    assert varlen_call_count() - calls == model.config.num_hidden_layers
    assert hidden.shape == padded.shape and not hidden[~mask].any()
    assert (hidden[mask] - padded[mask]).abs().max() <= 1e-10
    got = _grads(model, _loss(hidden, mask))
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] - want[name]).abs().max() <= 1e-10 * max(1.0, want[name].abs().max()), name


def test_explicit_position_ids_are_gathered():
    model = _model("llama")
    kwargs = _batch(model.config.vocab_size)
    kwargs["position_ids"] = (kwargs["attention_mask"].cumsum(1) - 1).clamp(min=0)  # positions from 0 per row
    mask = kwargs["attention_mask"].bool()
    padded = model.model(**kwargs).last_hidden_state
    packed = pack_batch(model.model, kwargs, mask)
    assert packed.kwargs["position_ids"][0, :6].tolist() == list(range(6))
    hidden = packed.unpack(model.model(**packed.kwargs).last_hidden_state)
    assert (hidden[mask] - padded[mask]).abs().max() <= 1e-10


def test_refusals_keep_the_padded_call(monkeypatch):
    model = _model("llama")
    kwargs = _batch(model.config.vocab_size)
    mask = kwargs["attention_mask"].bool()
    full = dict(kwargs, attention_mask=torch.ones_like(kwargs["attention_mask"]))
    assert pack_batch(model.model, full, full["attention_mask"].bool()) is None  # no padding
    read = mask.clone()
    read[1, 7] = True  # the loss reads a padded position's hidden state
    assert pack_batch(model.model, kwargs, read) is None
    assert "model inputs other than" in pad_free_reason(model.model, dict(kwargs, token_type_ids=mask.long()))
    assert "no cache" in pad_free_reason(model.model, dict(kwargs, use_cache=True))
    assert "'eager'" in pad_free_reason(_model("llama", attn="eager").model, kwargs)
    assert "sliding" in pad_free_reason(_model("mistral", sliding_window=4).model, kwargs)
    assert "model type 'gemma'" in pad_free_reason(_model("gemma").model, kwargs)
    assert "dropout in training" in pad_free_reason(_model("llama", attention_dropout=0.1).model, kwargs)
    assert pad_free_reason(_model("llama", attention_dropout=0.1).model.eval(), kwargs) == ""
    dropping = _model("llama")
    mlp = dropping.model.layers[0].mlp
    mlp.up_proj = torch.nn.Sequential(torch.nn.Dropout(0.05), mlp.up_proj)
    assert "dropout in training" in pad_free_reason(dropping.model, kwargs)  # e.g. PEFT's lora_dropout
    dynamic = _model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert "RoPE type 'dynamic'" in pad_free_reason(dynamic.model, kwargs)
    # a window longer than the padded rows but reached by the packed row (19 tokens): transformers would build
    # the packed row a windowed [N, N] mask, so the padded call runs
    windowed = _model("mistral", sliding_window=12)
    assert pad_free_reason(windowed.model, kwargs) == ""
    assert pack_batch(windowed.model, kwargs, mask) is None
    assert pack_batch(_model("mistral", sliding_window=20).model, kwargs, mask) is not None
    compiled = _model("llama")
    compiled.model.layers[0].compile()
    assert "compiled" in pad_free_reason(compiled.model, kwargs)
    with pytest.raises(ValueError, match="read_mask must be"):
        pack_batch(model.model, kwargs, mask[:, :5])
    monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "0")
    assert pad_free_reason(model.model, kwargs) == "LIGER_LOSSES_PAD_FREE=0"
    monkeypatch.delenv("LIGER_LOSSES_PAD_FREE")
    assert "flash varlen kernel" in pad_free_reason(model.model, kwargs)  # unset: where flash serves the step


def test_an_attention_that_missed_the_packing_raises():
    model = _model("llama")
    kwargs = _batch(model.config.vocab_size)
    attention = model.model.layers[1].self_attn
    forward = attention.forward

    def dropping(*args, **kw):  # a layer that does not pass its keywords on
        kw = {k: v for k, v in kw.items() if not k.startswith("liger_")}
        return forward(*args, **kw)

    attention.forward = dropping
    packed = pack_batch(model.model, kwargs, kwargs["attention_mask"].bool())
    hidden = model.model(**packed.kwargs).last_hidden_state
    with pytest.raises(RuntimeError, match="1 varlen attention calls for 2 layers"):
        packed.unpack(hidden)


def test_unpacked_calls_are_transformers_sdpa():
    """With the route installed, a call without the packing keywords is transformers' SDPA, bit for bit."""
    model = _model("qwen2")
    kwargs = _batch(model.config.vocab_size)
    before = model.model(**kwargs).last_hidden_state
    pack_batch(model.model, kwargs, kwargs["attention_mask"].bool())  # installs the route
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "liger_sdpa", None) is not None
    assert torch.equal(model.model(**kwargs).last_hidden_state, before)


def test_completion_read_mask():
    labels = torch.tensor([[5, 6, -100], [-100, 7, 8]])
    read = completion_read_mask(torch.ones(2, 6), 2, labels, -100)
    assert read.tolist() == [[False, False, True, True, False, False], [False, False, False, True, True, False]]
