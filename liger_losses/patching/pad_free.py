"""Run a Hugging Face backbone on the valid tokens of a padded batch only ("pad-free"), packed end to end.

``pack_batch(backbone, model_kwargs, read_mask) -> PackedBatch | None``: for ``model_kwargs`` with
``input_ids [B, T]`` (or ``inputs_embeds [B, T, H]``: a vision-language model's language model, called by its base
model) and a 2-D ``attention_mask [B, T]`` that has padding, the keywords that run ``backbone``
on the ``N`` attended tokens as one row ``[1, N]`` -- each row's tokens one causal sequence, at the
positions the padded call gives them (``position_ids [B, T]`` or M-RoPE's ``[k, B, T]``, default ``0 .. T-1``,
gathered) -- and
``PackedBatch.unpack(hidden [1, N, H]) -> [B, T, H]``, zeros at the padding. ``read_mask [B, T]`` (bool):
the positions whose hidden states the caller's loss reads; packing is refused (``None``: run the padded
call) unless every one is attended, so the loss sees exactly the hidden states of the padded call. Also
``None`` without padding, or where :func:`pad_free_reason` refuses the model.

Why: the padded call computes every layer on the padding too (GRPO's completions end at their sampled
lengths: ~20% of a batch is padding), and with a padding mask SDPA cannot take the flash kernel, so
grouped-query attention copies the key/value heads out for the masked kernel. Packed, the attention is
:func:`~liger_losses.kernels.varlen_attention.varlen_causal_attention` (flash varlen on the GPU).

How the attention gets there: transformers' decoder layers pass their keywords on to the attention
function; :func:`install` wraps transformers' ``"sdpa"`` attention so that a call carrying
``liger_cu_seqlens`` (the sequences' offsets) and ``liger_max_seqlen`` runs the varlen attention and every
other call is transformers' own, untouched. The packed row's ``attention_mask`` is an empty 4-D marker
``[1, 1, 0, 0]`` (or, where the model takes one, a mask map of ``None``): transformers hands a 4-D mask to the
layers as it is, so it builds no mask and reads nothing on the host, and the marker, which the route accepts,
fails on any attention that would apply it. ``unpack`` checks that every attention layer took the varlen path
(else it raises: a model that does not pass the keywords would have attended across sequences) and, where the
kernel serves a sliding window, that every sliding layer passed it.

``LIGER_LOSSES_PAD_FREE``: unset, on where torch's flash varlen kernel serves the step (CUDA sm80+, bf16/fp16
compute dtype, head size a multiple of 8 up to 256); ``0`` off; ``1`` on wherever the model qualifies (on the CPU
with the reference attention: how the tests run it). Refused also for dynamic/longrope RoPE (their frequencies
follow the call's largest position), bidirectional attention, and where the packed row would reach a sliding window
the model's layers do not hand their attention (:func:`serves_window`: served for Gemma-3, OLMo-3, Ministral,
EXAONE-4, SmolLM3, Qwen2/3, dots1 and Cohere-2, whose sliding layer types say which layers slide, and Mistral, Mixtral,
Phi-3, Ministral-3 and StarCoder2, whose every layer slides; not for Qwen2-MoE or OLMoE); and wherever a row with a
hole spans more positions than the window. The varlen kernel serves the window.

Dropout and router noise in training (attention dropout, PEFT's ``lora_dropout``, Seed-OSS's output dropout,
Mixtral's router jitter) are drawn on the packed row: other random numbers than the padded call draws, from the same
distribution for every attended token, since each is drawn per element (per attention weight, per activation) at a
scale the call's shape does not set, and the padded call's draws at the padding reach no attended token. So a seeded
run's masks are not TRL's padded ones (``LIGER_LOSSES_PAD_FREE=0`` gives those), as a packed SFT batch's are not a
padded one's. NEFTune's embedding noise, whose scale is ``alpha / sqrt(T * H)`` of the call's row length ``T``, keeps
the padded call.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.utils import autocast_dtype, env_switch
from ..kernels.varlen_attention import flash_supported, varlen_causal_attention

# model types whose decoder layers pass their keywords to transformers' attention function, whose attention is
# plain causal attention (no softcap, no attention sinks, no bias beyond RoPE) and whose other layers act on each
# token alone (MoE routing included): each one's packed call equals its padded one in tests/patching/test_pad_free.py.
# Not here: Gemma-2 and GPT-OSS (a softcap / sinks; transformers gives them no SDPA), Llama-4 (chunked attention,
# and an attention temperature that reads the call's cache positions), DeepSeek-V3 (MLA: value heads narrower than
# the query/key heads).
PAD_FREE_MODEL_TYPES = frozenset({
    "llama", "mistral", "ministral", "qwen2", "qwen3", "gemma", "gemma3_text", "phi3", "olmo2", "olmo3", "glm4",
    "granite", "smollm3", "exaone4", "mixtral", "qwen2_moe", "qwen3_moe",
    "ministral3", "seed_oss", "hunyuan_v1_dense", "olmoe", "glm4_moe", "dots1",
    "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text",  # the language models of Qwen2/2.5/3-VL (M-RoPE)
    "cohere", "cohere2", "ernie4_5", "arcee", "apertus", "starcoder2", "helium", "phi", "olmo", "exaone",
})
# Qwen3-VL's deepstack inputs: the image tokens' mask [B, T], packed like the tokens, and their features from the
# vision tower's layers (one [image tokens, H] tensor per decoder layer they join, in row-major token order, which
# the packed row keeps: passed as they are)
_PER_TOKEN_KEYS = frozenset({"visual_pos_masks"})
_PLAIN_KEYS = frozenset({"input_ids", "inputs_embeds", "attention_mask", "position_ids", "use_cache", "return_dict",
                         "cache", "deepstack_visual_embeds"}) | _PER_TOKEN_KEYS


# model types whose backbone takes a per-layer-type mask map and whose sliding layers hand the attention their
# ``sliding_window``: their packed row gets ``{"full_attention": None, "sliding_attention": None}``, so transformers
# builds no mask and a window the packed row reaches is served by the varlen kernel (Qwen2-MoE's sliding layers do
# not pass the window: not here)
_MASK_MAP_MODEL_TYPES = frozenset({"gemma3_text", "olmo3", "ministral", "exaone4", "smollm3", "qwen2", "qwen3",
                                   "dots1", "qwen2_vl_text", "qwen2_5_vl_text", "cohere2"})
# model types whose every decoder layer slides when the config has a window, each handing the attention the config's
# ``sliding_window`` (transformers builds them one windowed mask for all layers)
_ALL_SLIDING_MODEL_TYPES = frozenset({"mistral", "mixtral", "phi3", "ministral3", "starcoder2"})


def _packed_mask(device) -> torch.Tensor:
    """The packed row's ``attention_mask`` outside the mask-map families: an empty 4-D bool tensor, which
    transformers' mask functions return as it is (a 4-D mask is taken as prepared) and which fails to broadcast in any
    attention that would apply it to a row of ``N > 0`` tokens."""
    return torch.zeros((1, 1, 0, 0), dtype=torch.bool, device=device)


def _is_packed_mask(mask) -> bool:
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.numel() == 0


class _Route(threading.local):
    varlen_calls = 0  # attention calls that took the varlen path (unpack checks the count)
    windowed_calls = 0  # of which with a sliding window


_ROUTE = _Route()


def _routed(sdpa):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        cu_seqlens = kwargs.pop("liger_cu_seqlens", None)
        max_seqlen = kwargs.pop("liger_max_seqlen", None)
        expected_window = kwargs.pop("liger_window", None)
        if cu_seqlens is None:
            if _is_packed_mask(attention_mask):  # a packed row reached an attention without its offsets
                raise RuntimeError(f"{type(module).__name__}: the packed (pad-free) call reached an attention that did "
                                   "not get the packing (its layer dropped the keywords); set LIGER_LOSSES_PAD_FREE=0")
            return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
        # what transformers' SDPA function reads of its keywords (it ignores the rest, so the padded call does too):
        # the varlen attention serves dropout and scaling, not a position bias, a softcap or non-causal attention;
        # a sliding window, which the padded call's mask holds, is the varlen kernel's (pack_batch decides when)
        window, causal = kwargs.get("sliding_window"), kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        masked = attention_mask is not None and not _is_packed_mask(attention_mask)
        if (args or masked or query.shape[0] != 1 or kwargs.get("softcap") is not None
                or kwargs.get("position_bias") is not None or not causal):
            raise RuntimeError(f"{type(module).__name__}: the packed (pad-free) call reached an attention it cannot "
                               "serve (a mask, a position bias, a softcap or non-causal attention); "
                               "set LIGER_LOSSES_PAD_FREE=0")
        if window is not None and window != expected_window:  # the config read as no window, or another one
            raise RuntimeError(f"{type(module).__name__}: a sliding window of {window} where the model's config (which "
                               f"the padded call's mask follows) says {expected_window}; set LIGER_LOSSES_PAD_FREE=0")
        dtype = autocast_dtype(query, None)
        if dtype is not None:  # as SDPA runs under autocast: in the autocast dtype
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        _ROUTE.varlen_calls += 1
        _ROUTE.windowed_calls += window is not None
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, heads, D]
        out = varlen_causal_attention(q, k, v, cu_seqlens, max_seqlen, scale=kwargs.get("scaling"),
                                      dropout_p=kwargs.get("dropout", 0.0), window=window)
        return out.unsqueeze(0), None  # [1, N, Hq, D], as transformers' attention functions return

    attention.liger_sdpa = sdpa
    return attention


def install() -> None:
    """Route transformers' ``"sdpa"`` attention through the varlen attention for packed calls (idempotent)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if getattr(current, "liger_sdpa", None) is None:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _routed(current)


def pad_free_reason(backbone: nn.Module, model_kwargs: Dict[str, Any]) -> str:
    """Why ``backbone`` on ``model_kwargs`` is not run packed ("" when it may be)."""
    mode = env_switch("LIGER_LOSSES_PAD_FREE", None)
    if mode is False:
        return "LIGER_LOSSES_PAD_FREE=0"
    config = getattr(backbone, "config", None)
    if getattr(config, "model_type", None) not in PAD_FREE_MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r} is not one of {sorted(PAD_FREE_MODEL_TYPES)}"
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attention implementation {getattr(config, '_attn_implementation', None)!r}, not 'sdpa'"
    compiled = [backbone, *getattr(backbone, "layers", ())]  # torch.compile's wrapper, or nn.Module.compile()
    if hasattr(backbone, "_orig_mod") or any(getattr(m, "_compiled_call_impl", None) is not None for m in compiled):
        return "a compiled backbone"
    if set(model_kwargs) - _PLAIN_KEYS:
        return f"model inputs other than {sorted(_PLAIN_KEYS)}: {sorted(set(model_kwargs) - _PLAIN_KEYS)}"
    ids, mask, positions = _tokens(model_kwargs), model_kwargs.get("attention_mask"), model_kwargs.get("position_ids")
    if not isinstance(ids, torch.Tensor) or not isinstance(mask, torch.Tensor) or mask.dim() != 2 \
            or mask.shape != ids.shape or model_kwargs.get("use_cache") or model_kwargs.get("cache") is not None:
        return "not input_ids [B, T] (or inputs_embeds [B, T, H]) with a 2-D attention_mask of its shape and no cache"
    if positions is not None and (positions.dim() > 3 or positions.shape[-1] != ids.shape[1]
                                  or (positions.dim() > 1 and positions.shape[-2] not in (1, ids.shape[0]))):
        return f"position_ids of shape {tuple(positions.shape)} for a batch of {tuple(ids.shape)}"
    for key in _PER_TOKEN_KEYS:
        value = model_kwargs.get(key)
        if value is not None and (not isinstance(value, torch.Tensor) or value.shape != ids.shape):
            return f"{key} that is not [B, T] = {tuple(ids.shape)}"
    window = sliding_window(config)
    if window is not None and window <= ids.shape[1] and not serves_window(config):
        return f"a sliding window ({window}) no longer than the batch ({ids.shape[1]} tokens)"
    if getattr(config, "use_bidirectional_attention", False) or getattr(config, "is_causal", True) is False:
        return "bidirectional attention"
    if (getattr(config, "model_type", None) in _MASK_MAP_MODEL_TYPES and serves_window(config)
            and not getattr(config, "use_sliding_window", True)):
        # SmolLM3: the model windows its sliding layer types, its layers pass no window without the flag
        return "sliding layers with use_sliding_window=False"
    embed = backbone.get_input_embeddings() if callable(getattr(backbone, "get_input_embeddings", None)) else None
    if getattr(embed, "training", False) and getattr(embed, "neftune_noise_alpha", None):
        return "NEFTune noise in training (its scale reads the call's sequence length: alpha / sqrt(T * H))"
    rope = getattr(getattr(backbone, "rotary_emb", None), "rope_type", "") or ""
    kinds = rope.values() if isinstance(rope, dict) else (rope,)  # Gemma-3, OLMo-3: one type per layer type
    if any("dynamic" in kind or "longrope" in kind for kind in kinds):  # frequencies follow the call's largest position
        return f"RoPE type {rope!r}"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    compute = autocast_dtype(ids, next(backbone.parameters()).dtype)  # the layers' dtype, as F.linear picks it
    if mode is None and not flash_supported(ids.device, compute, head_dim):
        return "not a step torch's flash varlen kernel serves (CUDA sm80+, bf16/fp16, head size a multiple of 8 " \
               "up to 256; LIGER_LOSSES_PAD_FREE=1 packs anyway, with the reference attention)"
    return ""


def _tokens(model_kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
    """``input_ids [B, T]``, else a ``[B, T]`` view of ``inputs_embeds [B, T, H]`` (its shape and device are what is
    read), else None."""
    ids, embeds = model_kwargs.get("input_ids"), model_kwargs.get("inputs_embeds")
    if ids is not None or not isinstance(embeds, torch.Tensor) or embeds.dim() != 3:
        return ids
    return embeds[..., 0]


def sliding_window(config) -> Optional[int]:
    """The attention window of ``config`` (None: full attention): a mask-map family windows exactly its layers of
    type ``"sliding_attention"`` (none: no window); elsewhere ``sliding_window`` (0 read as none), whatever
    ``use_sliding_window`` says: Mistral, Mixtral, Phi-3, Ministral-3 and OLMoE never read that flag, their layers
    hand the attention the config's window (Qwen2-MoE's config zeroes its window itself)."""
    window = getattr(config, "sliding_window", None) or None
    if getattr(config, "model_type", None) in _MASK_MAP_MODEL_TYPES:
        return window if _sliding_layers(config) else None
    return window


def _sliding_layers(config) -> int:
    """The layers that slide: those of type ``"sliding_attention"`` in a mask-map family; every layer of a family in
    ``_ALL_SLIDING_MODEL_TYPES`` with a window; elsewhere 0 (not served)."""
    model_type = getattr(config, "model_type", None)
    if model_type in _MASK_MAP_MODEL_TYPES:
        return sum(kind == "sliding_attention" for kind in (getattr(config, "layer_types", None) or ()))
    if model_type in _ALL_SLIDING_MODEL_TYPES and getattr(config, "sliding_window", None):
        return int(config.num_hidden_layers)
    return 0


def serves_window(config) -> bool:
    """Whether a packed call of ``config``'s model serves its sliding window in the varlen kernel (its sliding layers
    known and each handing the attention its window), so that a packed row may reach the window."""
    return _sliding_layers(config) > 0


@dataclasses.dataclass
class PackedBatch:
    """The packed call's keywords and what ``unpack`` needs: the flat indices of the attended tokens
    ``order [N]`` in the padded batch ``shape (B, T)``, the attention layers that must take the varlen path."""

    kwargs: Dict[str, Any]
    order: torch.Tensor
    shape: Tuple[int, int]
    layers: int
    calls_before: Tuple[int, int]  # the route's (varlen, windowed) counts before the call
    sliding_layers: Optional[int] = None  # where the varlen kernel serves the window: the layers that must take it

    def unpack(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [1, N, H]`` of the packed call -> ``[B, T, H]``, zeros at the padding (differentiable)."""
        calls = _ROUTE.varlen_calls - self.calls_before[0]
        if calls != self.layers:
            raise RuntimeError(f"the packed (pad-free) call ran {calls} varlen attention calls for {self.layers} "
                               "layers: the model did not pass the packing to every attention; set "
                               "LIGER_LOSSES_PAD_FREE=0")
        windowed = _ROUTE.windowed_calls - self.calls_before[1]
        if self.sliding_layers is not None and windowed != self.sliding_layers:
            raise RuntimeError(f"the packed (pad-free) call ran {windowed} windowed attention calls for "
                               f"{self.sliding_layers} sliding layers: set LIGER_LOSSES_PAD_FREE=0")
        batch, length = self.shape
        full = hidden.new_zeros(batch * length, hidden.shape[-1]).index_copy(0, self.order, hidden[0])
        return full.view(batch, length, hidden.shape[-1])


def pack_batch(backbone: nn.Module, model_kwargs: Dict[str, Any],
               read_mask: Optional[torch.Tensor]) -> Optional[PackedBatch]:
    """See the module docstring (``read_mask`` None: nothing known of what the loss reads, so ``None``)."""
    if read_mask is None or pad_free_reason(backbone, model_kwargs):
        return None
    ids, mask = _tokens(model_kwargs), model_kwargs["attention_mask"]
    if read_mask.shape != mask.shape:
        raise ValueError(f"read_mask must be [B, T] = {tuple(mask.shape)}, got {tuple(read_mask.shape)}")
    keep, read_mask = mask.bool(), read_mask.to(mask.device)
    batch, length = ids.shape
    counts = keep.sum(1, dtype=torch.int32)
    config = backbone.config
    window = sliding_window(config)
    # the padded call's window counts positions, a hole's included: a row with a hole whose span exceeds the window
    # reaches back over fewer of its tokens than the packed row would (a span never exceeds the row's length)
    holed_rows = counts.new_zeros(())
    if window is not None and window < length:
        steps = torch.arange(length, device=keep.device, dtype=torch.int32)
        spans = (torch.where(keep, steps, -1).amax(1) - torch.where(keep, steps, length).amin(1) + 1).clamp(min=0)
        holed_rows = ((spans > counts) & (spans > window)).sum(dtype=torch.int32)
    # what must be attended besides the positions read: Qwen3-VL's image tokens (one deepstack feature each)
    unattended = read_mask.bool()
    for key in _PER_TOKEN_KEYS:
        if model_kwargs.get(key) is not None:
            unattended = unattended | model_kwargs[key].to(keep.device).bool()
    total, longest, unattended_reads, holed_rows = torch.stack(  # one host read
        [counts.sum(dtype=torch.int32), counts.max(), (unattended & ~keep).sum(dtype=torch.int32),
         holed_rows]).tolist()
    if total in (0, keep.numel()) or unattended_reads or holed_rows:
        return None
    # a window the packed row reaches: served by the varlen kernel where every sliding layer hands it the window
    windowed = window is not None and window <= total
    if windowed and not serves_window(config):
        return None
    install()
    order = torch.sort((~keep).flatten().to(torch.uint8), stable=True).indices[:total]  # attended, row-major
    positions = model_kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=ids.device)
    rows = positions.shape[:-2] if positions.dim() == 3 else ()  # M-RoPE's [k, B, T]: each of the k rows packed
    positions = positions.expand(*rows, batch, length).reshape(*rows, -1)[..., order].unsqueeze(-2)
    mask_map = getattr(config, "model_type", None) in _MASK_MAP_MODEL_TYPES
    packed_mask = {"full_attention": None, "sliding_attention": None} if mask_map else _packed_mask(ids.device)
    inputs = {"input_ids": ids.flatten()[order][None]} if model_kwargs.get("input_ids") is not None else {
        "inputs_embeds": model_kwargs["inputs_embeds"].flatten(0, 1)[order][None]}
    for key in _PER_TOKEN_KEYS:
        if model_kwargs.get(key) is not None:
            inputs[key] = model_kwargs[key].flatten()[order][None]
    kwargs = dict(model_kwargs, **inputs, position_ids=positions,
                  attention_mask=packed_mask, liger_max_seqlen=int(longest), liger_window=window,
                  liger_cu_seqlens=F.pad(counts.cumsum(0, dtype=torch.int32), (1, 0)))
    return PackedBatch(kwargs, order, (batch, length), int(config.num_hidden_layers),
                       (_ROUTE.varlen_calls, _ROUTE.windowed_calls), _sliding_layers(config) if windowed else None)


def completion_read_mask(attention_mask: torch.Tensor, start: int, labels: torch.Tensor,
                         ignore_index: int) -> torch.Tensor:
    """``[B, T]`` bool: the positions ``start .. start + C - 1`` whose hidden states predict the labels ``[B, C]``
    that are not ``ignore_index`` (what an RL loss on the completion reads)."""
    read = torch.zeros(attention_mask.shape, dtype=torch.bool, device=attention_mask.device)
    read[:, start:start + labels.size(1)] = labels.to(read.device) != ignore_index
    return read


def varlen_call_count() -> int:
    """How many attention calls (this thread) took the varlen path so far: tests and benchmarks check packing."""
    return _ROUTE.varlen_calls


def label_read_mask(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``[B, T]`` bool from the shifted labels ``[B, T-1]`` of a causal LM loss: the positions whose hidden states
    predict a label that is not ``ignore_index`` (what a token-level loss on ``hidden[:, :-1]`` reads)."""
    return F.pad(labels != ignore_index, (0, 1))
