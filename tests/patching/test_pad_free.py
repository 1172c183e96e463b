"""``patching/pad_free.py``: a backbone run on the attended tokens only, packed, against the padded call.

The padded call (transformers' SDPA with the padding mask) is the reference. On tiny models of every
family ``PAD_FREE_MODEL_TYPES`` lists, with transformers' layers and with ours patched in, the packed call's
hidden states at the attended positions, and every parameter's gradient of a loss on them, must equal the
padded call's: to 1e-10 in float64 (the same math; only the summation order differs), 1e-6 where Gemma's
own norms compute in float32, and 2e-5 for the MoE families, which run in float32 (transformers' grouped
expert GEMM has no float64). Masks cover left padding, right padding, a hole inside a row and an
all-padding row. Vision-language models' language models (Qwen2-VL / Qwen2.5-VL) are also called as their base
models call them: input embeddings and M-RoPE's three position rows, each packed. Sliding windows the packed row
reaches (families whose sliding layers pass their window) must equal the padded call's windowed mask to the same
tolerances, a hole inside the window keeping the padded call.
Refusals (``None``) keep the padded call: a model or input it cannot serve, no padding, a read position that is
padding. A model whose attention did not take the packing or its window, or hands it a keyword that transformers'
SDPA acts on and the packing does not serve, raises. Dropout and router noise in training are drawn on the packed
row: held to the padded call's distribution (per-element variance and mean over seeded calls), and a checkpointed
packed call to the uncheckpointed one under one seed. On CUDA (``-m gpu``) every family's packed call takes the
flash kernel, within 2e-2 in bf16, and its dropout is the flash kernel's.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from liger_losses.patching.apply import apply_liger_kernels  # noqa: E402
from liger_losses.patching.pad_free import (  # noqa: E402
    PAD_FREE_MODEL_TYPES,
    completion_read_mask,
    pack_batch,
    pad_free_reason,
    varlen_call_count,
)
from tests.helpers import rel_err  # noqa: E402

from .tiny_models import randomize_, tiny_config  # noqa: E402

FAMILIES = sorted(PAD_FREE_MODEL_TYPES)
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "dots1")
# language models of vision-language models (no causal-LM class of their own; our layer kernels do not patch them)
LANGUAGE_MODELS = ("qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text")
# served pad-free with transformers' layers only (our layer kernels do not patch them)
UNPATCHED = LANGUAGE_MODELS + ("cohere", "cohere2", "ernie4_5", "arcee", "apertus", "starcoder2", "helium", "phi",
                               "olmo", "exaone")


class _LanguageModel(torch.nn.Module):
    """A vision-language model's language model alone, as ``.model`` of a causal LM for these tests."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def gradient_checkpointing_enable(self, kwargs=None):
        self.model.gradient_checkpointing_enable(kwargs)


@pytest.fixture(autouse=True)
def _forced(monkeypatch):
    monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "1")  # on the CPU too (reference attention)


def _model(model_type, attn="sdpa", **overrides):
    """A tiny ``model_type`` in float64 (MoE: float32); a family with sliding layers gets a window of 32, which
    the batch's packed row (19 tokens) does not reach."""
    torch.manual_seed(0)
    if getattr(tiny_config(model_type), "sliding_window", None) is not None:
        overrides.setdefault("sliding_window", 32)
    config = tiny_config(model_type, **overrides)
    if model_type in LANGUAGE_MODELS:
        model = _LanguageModel(transformers.AutoModel.from_config(config, attn_implementation=attn))
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return randomize_(model).to(torch.float32 if model_type in MOE else torch.float64).train()


def _tolerance(model_type, patched):
    if model_type in MOE:
        return 2e-5
    # Gemma's, Cohere's and Helium's own norms compute in float32
    return 1e-6 if model_type.startswith(("gemma", "cohere", "helium")) and not patched else 1e-10


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
    probe = torch.randn(hidden.shape, generator=g, dtype=hidden.dtype).to(hidden.device)
    return (hidden * probe * mask[..., None]).sum()


def _assert_within(got, want, tol, what=""):
    """The largest difference within ``tol`` of ``want``'s largest entry (at least 1)."""
    assert (got - want).abs().max() <= tol * max(1.0, want.abs().max()), what


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("variant", ["plain", "non-reentrant", "reentrant", "patched"])
def test_packed_call_equals_the_padded_call(model_type, variant):
    if variant == "patched" and model_type in UNPATCHED:
        pytest.skip("our layer kernels do not patch this family")
    model = _model(model_type)
    if variant.endswith("reentrant"):
        model.gradient_checkpointing_enable({"use_reentrant": variant == "reentrant"})
    if variant == "patched":
        apply_liger_kernels(model)
    tol = _tolerance(model_type, variant == "patched")
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
    _assert_within(hidden[mask], padded[mask], tol)
    got = _grads(model, _loss(hidden, mask))
    assert got.keys() == want.keys()
    for name in want:
        _assert_within(got[name], want[name], tol, name)


@pytest.mark.parametrize("model_type", LANGUAGE_MODELS)
def test_mrope_positions_packed(model_type):
    """A vision-language model's language model gets M-RoPE's three position rows ``[3, B, T]`` from its base model
    (temporal, height, width: unequal where image tokens sit), and Qwen3-VL's its deepstack inputs (the image
    tokens' mask ``[B, T]``, packed like the tokens, and their features added after the first layer, in token
    order). The packed call equals the padded one to 1e-10 in float64, hidden states and gradients."""
    model = _model(model_type)
    backbone, kwargs = model.model, _batch(model.config.vocab_size)
    mask = kwargs["attention_mask"].bool()
    steps = torch.arange(9)
    kwargs["position_ids"] = torch.stack([steps, steps // 2, steps % 3 + steps // 3])[:, None].expand(3, 4, 9)
    ids = kwargs.pop("input_ids")
    if model_type == "qwen3_vl_text":
        visual = torch.zeros(4, 9, dtype=torch.bool)
        visual[0, 4:6] = visual[2, 1:3] = True  # attended "image" tokens of two rows
        features = torch.randn(4, model.config.hidden_size, dtype=torch.float64)
        kwargs.update(visual_pos_masks=visual, deepstack_visual_embeds=[features])

    def embedded():  # as the base model calls it: the embeddings in, a graph of their own each call
        return dict(kwargs, inputs_embeds=backbone.get_input_embeddings()(ids))

    assert pad_free_reason(backbone, embedded()) == ""
    padded = backbone(**embedded()).last_hidden_state
    want = _grads(model, _loss(padded, mask))
    packed = pack_batch(backbone, embedded(), mask)
    assert packed.kwargs["position_ids"].shape == (3, 1, 19) and packed.kwargs["inputs_embeds"].shape[:2] == (1, 19)
    assert packed.kwargs["position_ids"][1, 0, :6].tolist() == [1, 2, 2, 3, 3, 4]  # row 0's tokens 3..8, halved
    if model_type == "qwen3_vl_text":
        assert packed.kwargs["visual_pos_masks"].shape == (1, 19) and int(packed.kwargs["visual_pos_masks"].sum()) == 4
    hidden = packed.unpack(backbone(**packed.kwargs).last_hidden_state)
    _assert_within(hidden[mask], padded[mask], 1e-10)
    got = _grads(model, _loss(hidden, mask))
    assert got.keys() == want.keys()
    for name in want:
        _assert_within(got[name], want[name], 1e-10, name)
    if model_type == "qwen3_vl_text":  # an image token at a padded position (its feature would lose its token)
        kwargs["visual_pos_masks"] = kwargs["visual_pos_masks"].clone()
        kwargs["visual_pos_masks"][3, 0] = True
        assert pack_batch(backbone, embedded(), mask) is None


def _no_hole(kwargs):
    kwargs["attention_mask"][2] = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0, 0])  # row 2 right-padded instead
    return kwargs


@pytest.mark.gpu
@pytest.mark.parametrize("model_type,window",
                         [(f, None) for f in FAMILIES] + [("gemma3_text", 4), ("qwen2", 4), ("phi3", 4)])
def test_packed_call_flash_cuda_bf16(model_type, window, monkeypatch):
    """On CUDA in bf16, pad-free by default: the packed call takes the flash varlen kernel (never the reference
    attention; with ``window``, a sliding window the packed row reaches, served by the kernel) and its hidden
    states and parameter gradients are within 2e-2 of the padded call's (two bf16 attention kernels and bf16
    layers in another summation order)."""
    if not torch.cuda.is_available():
        pytest.skip("the flash varlen attention needs CUDA")
    from liger_losses.kernels import varlen_attention

    monkeypatch.delenv("LIGER_LOSSES_PAD_FREE")

    def no_reference(*args, **kwargs):
        raise AssertionError("the packed call took the reference attention, not the flash kernel")

    monkeypatch.setattr(varlen_attention, "reference_varlen_attention", no_reference)
    overrides = {} if window is None else dict(WINDOWED[model_type], sliding_window=window)
    model = _model(model_type, **overrides).to("cuda", torch.bfloat16)
    kwargs = _batch(model.config.vocab_size) if window is None else _no_hole(_batch(model.config.vocab_size))
    kwargs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in kwargs.items()}
    mask = kwargs["attention_mask"].bool()
    padded = model.model(**kwargs).last_hidden_state
    want = _grads(model, _loss(padded.float(), mask))
    packed = pack_batch(model.model, kwargs, mask)
    assert packed is not None and (window is None) == (packed.sliding_layers is None)
    hidden = packed.unpack(model.model(**packed.kwargs).last_hidden_state)
    got = _grads(model, _loss(hidden.float(), mask))
    assert rel_err(hidden[mask], padded[mask]) <= 2e-2
    assert got.keys() == want.keys()
    for name in want:
        assert rel_err(got[name], want[name]) <= 2e-2, name


WINDOWED = {  # families whose packed call serves a sliding window (window 4: rows of 6 and 7 tokens reach it)
    "gemma3_text": {}, "olmo3": {}, "ministral": {}, "exaone4": {}, "mistral": {}, "mixtral": {}, "phi3": {},
    "ministral3": {},
    "smollm3": dict(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "dots1": dict(sliding_window=4, max_window_layers=1),  # layer 1 slides
    "cohere2": dict(layer_types=["sliding_attention", "full_attention"]), "starcoder2": {},
}


@pytest.mark.parametrize("model_type", sorted(WINDOWED))
def test_sliding_window_served_packed(model_type):
    """A window the packed row reaches, in a family whose sliding layers hand the attention their window (a
    mask-map family's sliding layer types, or every layer of Mistral, Mixtral, Phi-3, Ministral-3): the packed row
    gets no mask and the varlen kernel serves the window (every sliding layer's call windowed); equal to the padded
    call (its windowed mask) as in the test above. A row with a hole is refused: the padded window counts the hole's
    positions."""
    overrides = dict(WINDOWED[model_type])
    overrides.setdefault("sliding_window", 4)
    model = _model(model_type, **overrides)
    layers = model.config.num_hidden_layers
    sliding = sum(kind == "sliding_attention" for kind in (getattr(model.config, "layer_types", None) or ()))
    backbone, kwargs = model.model, _no_hole(_batch(model.config.vocab_size))
    mask = kwargs["attention_mask"].bool()
    assert pad_free_reason(backbone, kwargs) == ""
    padded = backbone(**kwargs).last_hidden_state
    want = _grads(model, _loss(padded, mask))
    packed = pack_batch(backbone, kwargs, mask)
    if isinstance(packed.kwargs["attention_mask"], dict):  # a mask map: some layers slide
        assert 0 < sliding < layers and packed.sliding_layers == sliding
    else:  # every layer slides; the packed row's mask is the empty 4-D marker
        assert packed.kwargs["attention_mask"].shape == (1, 1, 0, 0) and packed.sliding_layers == layers
    hidden = packed.unpack(backbone(**packed.kwargs).last_hidden_state)
    tol = _tolerance(model_type, False)
    _assert_within(hidden[mask], padded[mask], tol)
    got = _grads(model, _loss(hidden, mask))
    for name in want:
        _assert_within(got[name], want[name], tol, name)
    holed = _batch(model.config.vocab_size)  # row 2 has a hole
    assert pack_batch(backbone, holed, holed["attention_mask"].bool()) is None
    # one row of 7 tokens spread over 9 positions, a window of 8: the packed row (7) does not reach it, the padded
    # row's last query does (its window starts after position 0)
    wide = _model(model_type, **dict(overrides, sliding_window=8))
    single = {k: v[2:3] if torch.is_tensor(v) else v for k, v in holed.items()}
    assert pad_free_reason(wide.model, single) == ""
    assert pack_batch(wide.model, single, single["attention_mask"].bool()) is None
    # a window of 9 covers the row's whole span: its hole changes nothing, so it packs, equal to the padded call
    wider = _model(model_type, **dict(overrides, sliding_window=9))
    keep = single["attention_mask"].bool()
    packed = pack_batch(wider.model, single, keep)
    hidden = packed.unpack(wider.model(**packed.kwargs).last_hidden_state)
    assert (hidden[keep] - wider.model(**single).last_hidden_state[keep]).abs().max() <= tol


def test_sliding_configs_that_packing_reads_as_the_model_does():
    """Qwen2 with a window but no layer of type "sliding_attention" (``max_window_layers`` >= the layers) windows no
    layer: it packs whatever the window. SmolLM3 with sliding layer types but ``use_sliding_window=False`` windows
    them in its mask and its layers pass no window: refused. A layer passing another window than the config's (which
    the padded call's mask follows) raises."""
    kwargs = _no_hole(_batch(128))
    unwindowed = _model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    assert "sliding_attention" not in unwindowed.config.layer_types
    assert pad_free_reason(unwindowed.model, kwargs) == ""
    assert pack_batch(unwindowed.model, kwargs, kwargs["attention_mask"].bool()).sliding_layers is None
    odd = _model("smollm3", use_sliding_window=False, sliding_window=4,
                 layer_types=["sliding_attention", "full_attention"])
    assert "use_sliding_window=False" in pad_free_reason(odd.model, kwargs)
    model = _model("ministral", sliding_window=4)
    model.config.sliding_window = 3  # changed after the layers read it
    packed = pack_batch(model.model, kwargs, kwargs["attention_mask"].bool())
    with pytest.raises(RuntimeError, match="a sliding window of 4 where the model's config"):
        model.model(**packed.kwargs)


@pytest.mark.parametrize("model_type", ["mistral", "phi3", "ministral3", "olmoe"])
def test_a_window_is_read_as_the_layers_apply_it(model_type):
    """Mistral, Phi-3, Ministral-3 and OLMoE never read ``use_sliding_window``: their layers hand the attention the
    config's window whatever it says, so packing reads the window from ``sliding_window`` alone. A row with a hole
    inside the window keeps the padded call; Mistral-style families without one pack, equal to the padded call (its
    windowed mask); OLMoE, whose padded call windows nothing while its layers pass the window, keeps the padded call
    wherever the packed row reaches it. Read as no window (the flag honoured), the packed calls were 0.8-1.8 off."""
    model = _model(model_type, sliding_window=4, use_sliding_window=False)
    holed = _batch(model.config.vocab_size)
    assert pack_batch(model.model, holed, holed["attention_mask"].bool()) is None
    kwargs = _no_hole(holed)
    mask = kwargs["attention_mask"].bool()
    packed = pack_batch(model.model, kwargs, mask)
    if model_type == "olmoe":
        assert packed is None
        return
    padded = model.model(**kwargs).last_hidden_state
    hidden = packed.unpack(model.model(**packed.kwargs).last_hidden_state)
    _assert_within(hidden[mask], padded[mask], _tolerance(model_type, False))


def test_a_layer_window_the_config_does_not_have_raises():
    """A layer handing the attention a window where the config reads none (the padded call's mask has none): the
    packed call raises rather than window it."""
    model = _model("llama")
    kwargs = _no_hole(_batch(model.config.vocab_size))
    attention = model.model.layers[0].self_attn
    forward = attention.forward
    attention.forward = lambda *args, **kw: forward(*args, sliding_window=4, **kw)
    packed = pack_batch(model.model, kwargs, kwargs["attention_mask"].bool())
    with pytest.raises(RuntimeError, match="a sliding window of 4 where the model's config"):
        model.model(**packed.kwargs)


def test_a_sliding_layer_that_drops_its_window_raises():
    """Where the varlen kernel serves the window, a sliding layer whose call carries no window would attend past it:
    the packed call raises."""
    model = _model("ministral", sliding_window=4)
    kwargs = _no_hole(_batch(model.config.vocab_size))
    sliding = next(layer.self_attn for layer, kind in zip(model.model.layers, model.config.layer_types)
                   if kind == "sliding_attention")
    sliding.sliding_window = None
    packed = pack_batch(model.model, kwargs, kwargs["attention_mask"].bool())
    hidden = model.model(**packed.kwargs).last_hidden_state
    with pytest.raises(RuntimeError, match="0 windowed attention calls for 1 sliding layers"):
        packed.unpack(hidden)


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
    assert "no cache" in pad_free_reason(model.model, dict(kwargs, cache=object()))
    # a base model's call of its language model: a mask it built (Gemma-3's bidirectional image blocks) or positions
    # of another shape keep the padded call
    assert "2-D attention_mask" in pad_free_reason(model.model, dict(kwargs, attention_mask={"full_attention": None}))
    assert "position_ids of shape" in pad_free_reason(model.model, dict(kwargs, position_ids=torch.zeros(4, 5)))
    assert "'eager'" in pad_free_reason(_model("llama", attn="eager").model, kwargs)
    unserved = dict(use_sliding_window=True, max_window_layers=2)  # Qwen2-MoE: its sliding layers pass no window
    assert "sliding" in pad_free_reason(_model("qwen2_moe", sliding_window=4, **unserved).model, kwargs)
    assert "model type 'llama4_text'" in pad_free_reason(_model("llama4_text").model, kwargs)
    neftune = _model("llama")
    neftune.model.embed_tokens.neftune_noise_alpha = 5.0  # as transformers' activate_neftune sets it
    assert "NEFTune" in pad_free_reason(neftune.model, kwargs)  # its noise scales with the row's length
    assert pad_free_reason(neftune.model.eval(), kwargs) == ""
    for family in ("gemma", "gemma3_text"):
        assert "bidirectional" in pad_free_reason(_model(family, use_bidirectional_attention=True).model, kwargs)
    non_causal = _model("llama")
    non_causal.config.is_causal = False  # transformers passes it to the attention: refused before the call
    assert "bidirectional" in pad_free_reason(non_causal.model, kwargs)
    dynamic = _model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert "RoPE type 'dynamic'" in pad_free_reason(dynamic.model, kwargs)
    per_layer = _model("gemma3_text", rope_parameters={  # one RoPE per layer type, the global one dynamic
        "full_attention": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    assert "'dynamic'" in pad_free_reason(per_layer.model, kwargs)
    # a window longer than the padded rows but reached by the packed row (19 tokens), in a family whose layers do
    # not hand the attention the window: the padded call runs
    windowed = _model("qwen2_moe", sliding_window=12, **unserved)
    assert pad_free_reason(windowed.model, kwargs) == ""
    assert pack_batch(windowed.model, kwargs, mask) is None
    assert pack_batch(_model("qwen2_moe", sliding_window=20, **unserved).model, kwargs, mask) is not None
    compiled = _model("llama")
    compiled.model.layers[0].compile()
    assert "compiled" in pad_free_reason(compiled.model, kwargs)
    with pytest.raises(ValueError, match="read_mask must be"):
        pack_batch(model.model, kwargs, mask[:, :5])
    monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "0")
    assert pad_free_reason(model.model, kwargs) == "LIGER_LOSSES_PAD_FREE=0"
    monkeypatch.delenv("LIGER_LOSSES_PAD_FREE")
    assert "flash varlen kernel" in pad_free_reason(model.model, kwargs)  # unset: where flash serves the step


# Dropout and router noise in training, served packed: attention dropout, an ``nn.Dropout`` on a projection's
# input (PEFT's ``lora_dropout``), Seed-OSS's output dropout, Mixtral's router jitter.
DROPPING = {
    "attention": ("llama", dict(attention_dropout=0.3)),
    "lora": ("llama", {}),
    "seed_oss": ("seed_oss", dict(attention_dropout=0.2, residual_dropout=0.2)),
    "jitter": ("mixtral", dict(router_jitter_noise=0.3)),
}


def _dropping(case):
    model_type, overrides = DROPPING[case]
    model = _model(model_type, **overrides)
    if case == "lora":
        for layer in model.model.layers:
            layer.mlp.up_proj = torch.nn.Sequential(torch.nn.Dropout(0.3), layer.mlp.up_proj)
    return model


def _dropping_on(case, device, monkeypatch):
    """(the model of ``case``, the test batch) on ``device``: on CUDA in bf16, pad-free by default and the packed
    attention the flash kernel's (the reference attention made to fail)."""
    model = _dropping(case)
    kwargs = _batch(model.config.vocab_size)
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("the flash varlen attention needs CUDA")
        from liger_losses.kernels import varlen_attention

        monkeypatch.delenv("LIGER_LOSSES_PAD_FREE")
        monkeypatch.setattr(varlen_attention, "reference_varlen_attention", None)
        model = model.to("cuda", torch.bfloat16)
        kwargs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in kwargs.items()}
    return model, kwargs


def _draws(backbone, kwargs, mask, packed, count):
    """The attended positions' hidden states ``[count, tokens, H]`` of ``count`` seeded calls."""
    out = []
    for seed in range(count):
        torch.manual_seed(100 + seed)
        with torch.no_grad():
            if packed:
                batch = pack_batch(backbone, kwargs, mask)
                hidden = batch.unpack(backbone(**batch.kwargs).last_hidden_state)
            else:
                hidden = backbone(**kwargs).last_hidden_state
        out.append(hidden[mask].double())
    return torch.stack(out)


@pytest.mark.parametrize("case,device", [(c, "cpu") for c in sorted(DROPPING)]
                         + [pytest.param(c, "cuda", marks=pytest.mark.gpu) for c in ("attention", "lora")])
def test_dropout_in_training_is_drawn_packed_from_the_padded_calls_distribution(case, device, monkeypatch):
    """Dropout and router noise in training are served packed. The draws are other random numbers than the padded
    call's, so the test is of the distribution: over 48 seeded calls of each, the per-element variance of the attended
    hidden states must be the padded call's (summed over elements: within 15%; with no dropout drawn it would be 0)
    and their means must differ by no more than the draws' noise (the squared distance of the two sample means
    against its expectation ``sum (var_a + var_b) / 48``: below 2.5, about 1 when the distributions agree; a packed row
    whose sequences leaked into each other, or kept dropout's rescaling off, is far beyond). On CUDA in bf16 the packed
    call's attention dropout is the flash kernel's (pad-free by default), the padded call's SDPA's."""
    model, kwargs = _dropping_on(case, device, monkeypatch)
    backbone = model.model
    mask = kwargs["attention_mask"].bool()
    assert pad_free_reason(backbone, kwargs) == ""
    count = 48
    calls = varlen_call_count()
    packed = _draws(backbone, kwargs, mask, True, count)
    assert varlen_call_count() - calls == count * model.config.num_hidden_layers
    padded = _draws(backbone, kwargs, mask, False, count)
    var_packed, var_padded = packed.var(0).sum(), padded.var(0).sum()
    assert var_padded > 0
    assert abs(float(var_packed / var_padded) - 1.0) <= 0.15, (float(var_packed), float(var_padded))
    distance = (packed.mean(0) - padded.mean(0)).pow(2).sum()
    noise = (packed.var(0) + padded.var(0)).sum() / count
    assert float(distance / noise) <= 2.5, float(distance / noise)


@pytest.mark.parametrize("case,device", [(c, "cpu") for c in sorted(DROPPING)]
                         + [pytest.param("attention", "cuda", marks=pytest.mark.gpu)])
def test_a_checkpointed_packed_call_replays_its_dropout(case, device, monkeypatch):
    """Under one seed a packed call with dropout under transformers' checkpointing (torch's non-reentrant form, whose
    recompute restores the RNG state) equals the packed call without it, hidden states and every gradient (1e-10
    in float64, 2e-5 for Mixtral in float32; on CUDA in bf16 through the flash kernel, whose dropout is drawn from
    the generator's philox offset, 2e-2: the same masks, bf16 rounding in the backward's accumulation order): the
    backward's recompute draws the forward's masks."""
    model, kwargs = _dropping_on(case, device, monkeypatch)
    tol = 2e-2 if device == "cuda" else _tolerance(DROPPING[case][0], False)
    backbone = model.model
    mask = kwargs["attention_mask"].bool()
    results = []
    for checkpointed in (False, True):
        if checkpointed:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        torch.manual_seed(7)
        batch = pack_batch(backbone, kwargs, mask)
        hidden = batch.unpack(backbone(**batch.kwargs).last_hidden_state)
        results.append((hidden.detach(), _grads(model, _loss(hidden, mask))))
    (plain, want), (hidden, got) = results
    _assert_within(hidden[mask].double(), plain[mask].double(), tol)
    assert got.keys() == want.keys()
    for name in want:
        _assert_within(got[name].double(), want[name].double(), tol, name)
    torch.manual_seed(8)  # and the draws are live: another seed, other hidden states
    batch = pack_batch(backbone, kwargs, mask)
    other = batch.unpack(backbone(**batch.kwargs).last_hidden_state)
    assert (other[mask] - plain[mask]).abs().max() > 1e-3


def test_an_attention_that_missed_the_packing_raises():
    model = _model("llama")
    kwargs = _batch(model.config.vocab_size)
    attention = model.model.layers[1].self_attn
    attention.forward = _dropping_packing(attention.forward)
    packed = pack_batch(model.model, kwargs, kwargs["attention_mask"].bool())
    with pytest.raises(RuntimeError, match="reached an attention that did not get the packing"):
        model.model(**packed.kwargs)  # the packed row's mask marker, without the offsets
    mapped = _model("qwen2")  # a mask map of None: the call runs, and unpack counts the layer that missed the packing
    mapped.model.layers[1].self_attn.forward = _dropping_packing(mapped.model.layers[1].self_attn.forward)
    packed = pack_batch(mapped.model, kwargs, kwargs["attention_mask"].bool())
    hidden = mapped.model(**packed.kwargs).last_hidden_state
    with pytest.raises(RuntimeError, match="1 varlen attention calls for 2 layers"):
        packed.unpack(hidden)


def _dropping_packing(forward):
    """``forward`` of an attention whose layer does not pass the packing keywords on."""
    def dropping(*args, **kw):
        return forward(*args, **{k: v for k, v in kw.items() if not k.startswith("liger_")})
    return dropping


@pytest.mark.parametrize("model_type", ["llama", "mistral", "phi3", "qwen2_moe"])
def test_the_packed_row_mask_is_the_marker_and_fails_where_applied(model_type):
    """Outside the mask-map families the packed row's ``attention_mask`` is the empty 4-D marker, which
    transformers hands the layers as it is (no mask built, no host read: a built mask would raise in the route,
    and the packed call runs). An attention that would apply the marker instead (transformers' SDPA or eager
    function, reached by a call without the packing keywords) fails to broadcast it: never a silently unmasked row."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    model = _model(model_type)
    kwargs = _batch(model.config.vocab_size)
    packed = pack_batch(model.model, kwargs, kwargs["attention_mask"].bool())
    marker = packed.kwargs["attention_mask"]
    assert marker.shape == (1, 1, 0, 0) and marker.dtype == torch.bool
    packed.unpack(model.model(**packed.kwargs).last_hidden_state)
    attention = model.model.layers[0].self_attn
    q = torch.randn(1, model.config.num_attention_heads, 5, attention.head_dim, dtype=torch.float64)
    k = v = torch.randn(1, model.config.num_key_value_heads, 5, attention.head_dim, dtype=torch.float64)
    for function in (sdpa_attention_forward, eager_attention_forward):
        with pytest.raises(RuntimeError):
            function(attention, q, k, v, marker, scaling=attention.scaling, dropout=0.0)


@pytest.mark.parametrize("keywords", [dict(position_bias=1.0), dict(softcap=30.0), dict(is_causal=False)],
                         ids=["position-bias", "softcap", "non-causal"])
def test_an_attention_the_packing_cannot_serve_raises(keywords):
    """A layer handing transformers' SDPA function a keyword it acts on and the varlen attention does not serve
    raises in the packed call (never attention of another form); keywords SDPA itself ignores are ignored too."""
    model = _model("llama")
    kwargs = _batch(model.config.vocab_size)
    attention = model.model.layers[0].self_attn
    forward = attention.forward

    def with_keywords(*args, **kw):
        return forward(*args, **keywords, **kw)

    attention.forward = with_keywords
    packed = pack_batch(model.model, kwargs, kwargs["attention_mask"].bool())
    with pytest.raises(RuntimeError, match="cannot serve"):
        model.model(**packed.kwargs)
    attention.forward = lambda *args, **kw: forward(*args, s_aux=None, **kw)  # SDPA ignores it: so does the packing
    packed = pack_batch(model.model, kwargs, kwargs["attention_mask"].bool())
    packed.unpack(model.model(**packed.kwargs).last_hidden_state)


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
