"""Offline inputs of the trainer benchmarks: a numeric word-level tokenizer, synthetic datasets, random models.

Nothing is downloaded. The tokenizer (:func:`build_tokenizer`) is a ``tokenizers`` WordLevel model over
the words ``w3 .. w{V-1}`` (id ``i`` for word ``w{i}``) plus ``<pad>`` (0), ``<s>`` (1), ``</s>`` (2),
split on whitespace, no BOS/EOS added by the tokenizer itself, so a text of ``n`` words is exactly ``n``
token ids and sequence lengths are exact.

Speed datasets (token ids uniform in ``[3, V)``, seeded ``torch.Generator``; nothing to learn):

* :func:`dpo_dataset` -- ``n`` rows of ``{"prompt", "chosen", "rejected"}`` text (the format TRL 1.16's
  ``DPOTrainer`` and ORPO trainer tokenize). The prompt is ``seq // 4`` words; chosen and rejected are
  ``seq - seq // 4 - 1`` words each, to which TRL appends ``</s>``, so each of ``prompt+chosen`` and
  ``prompt+rejected`` is exactly ``seq`` tokens (one pair = ``2 * seq`` tokens).
* :func:`sft_dataset` -- ``n`` rows of pre-tokenized ``{"input_ids": [seq ints]}`` (TRL 1.16's
  ``SFTTrainer`` takes an ``input_ids`` column as already processed: no EOS added, labels = input_ids).
* :func:`grpo_batch` -- one pre-generated GRPO batch (prompt and completion ids and masks ``[B, P]`` /
  ``[B, C]``, advantages ``[B]``), the output TRL's generation step would hand its loss.

Learnable datasets (the convergence benchmark): a hidden rule ``next = rule[current]`` (a random
permutation of ``k`` "active" token ids drawn from the vocabulary) followed with probability ``1 - noise``,
otherwise a uniformly random active token. A model learns the bigram table in a few hundred steps; the
noise keeps the best reachable loss and entropy away from 0 (about ``noise * ln k`` nats).

* :func:`rule_sft_dataset` -- ``n`` pre-tokenized rows of ``seq`` ids following the rule.
* :func:`rule_dpo_dataset` -- ``n`` preference rows: a rule-following prompt; chosen continues it by the
  rule, rejected is uniformly random active tokens.

Models: :func:`build_model` builds a randomly initialised causal LM of a ``shape`` (a dict of config fields
plus ``model_type``: ``llama``, ``qwen2`` or ``gemma2``) on ``device`` in ``dtype``, sdpa attention (Gemma-2: eager);
``num_hidden_layers`` may be cut (``layers=``). :func:`snapshot_weights` / :func:`model_from_snapshot` keep
one CPU copy of a model's weights and load it into a fresh skeleton (built without initialisation), so every
provider and round trains the very same weights without re-initialising them.

Shapes: ``LLAMA_3_2_1B`` (hidden 2048, 16 layers, 32 heads / 8 KV, MLP 8192, V 128256, tied, llama3 RoPE),
``QWEN2_5_1_5B`` (hidden 1536, 28 layers, 12 heads / 2 KV, head 128, MLP 8960, V 151936, tied, q/k/v bias),
``GEMMA_2_2B`` (hidden 2304, 26 layers, 8 heads / 4 KV, head 256, GeGLU MLP 9216, V 256000, tied, final
logit softcap 30, sliding window 4096 on alternate layers, attention logit softcapping off; transformers
5 gives Gemma-2 no sdpa path, so it runs HF's eager attention -- what a user gets by default -- for every
provider alike), ``LLAMA_3_8B`` (hidden 4096, 32 layers, 32 heads /
8 KV, MLP 14336, V 128256, untied). ``TINY_SHAPES`` holds a CPU-sized shape of each family.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

SPECIALS = ("<pad>", "<s>", "</s>")

LLAMA_3_2_1B = dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    },
)

QWEN2_5_1_5B = dict(
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    head_dim=128,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)

GEMMA_2_2B = dict(
    model_type="gemma2",
    vocab_size=256000,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    final_logit_softcapping=30.0,
    attn_logit_softcapping=None,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

LLAMA_3_8B = dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)

GEMMA_3_1B = dict(
    model_type="gemma3_text",
    vocab_size=262144,
    hidden_size=1152,
    intermediate_size=6912,
    num_hidden_layers=26,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    query_pre_attn_scalar=256,
    sliding_window=512,
)

# Qwen3-30B-A3B's widths (128 experts of 768, top 8, H 2048, GQA 32:4); cases cut its 48 layers
QWEN3_MOE_30B_A3B = dict(
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    output_router_logits=True,
    router_aux_loss_coef=0.001,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)

SHAPES = {"llama3.2-1b": LLAMA_3_2_1B, "qwen2.5-1.5b": QWEN2_5_1_5B, "gemma2-2b": GEMMA_2_2B, "llama3-8b": LLAMA_3_8B,
          "gemma3-1b": GEMMA_3_1B, "qwen3-moe-30b-a3b": QWEN3_MOE_30B_A3B}

TINY = dict(
    LLAMA_3_2_1B, vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)
TINY_SHAPES = {
    "llama3.2-1b": TINY,
    "qwen2.5-1.5b": dict(QWEN2_5_1_5B, vocab_size=640, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=512),
    "gemma2-2b": dict(GEMMA_2_2B, vocab_size=700, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                      sliding_window=32, max_position_embeddings=512),
    "llama3-8b": dict(LLAMA_3_8B, vocab_size=600, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512),
    "gemma3-1b": dict(GEMMA_3_1B, vocab_size=700, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                      sliding_window=32, max_position_embeddings=512),
    "qwen3-moe-30b-a3b": dict(QWEN3_MOE_30B_A3B, vocab_size=640, hidden_size=64, intermediate_size=128,
                              moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512),
}


# --------------------------------------------------------------------------- tokenizer


def build_tokenizer(vocab_size: int):
    """``PreTrainedTokenizerFast`` of ``vocab_size`` ids: specials 0..2, then word ``w{i}`` -> id ``i``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tok.model_max_length = 1 << 20
    return tok


# --------------------------------------------------------------------------- speed datasets


def _ids(gen: torch.Generator, n: int, vocab_size: int) -> list[int]:
    return torch.randint(len(SPECIALS), vocab_size, (n,), generator=gen).tolist()


def _text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def dpo_dataset(n: int, seq: int, vocab_size: int, *, seed: int = 0, sampled_lengths: bool = False):
    """``n`` preference rows; prompt ``seq // 4`` tokens, chosen/rejected ``seq - seq // 4`` tokens with EOS
    (``sampled_lengths``: each completion's words drawn in ``[C/2, C]``, so batches carry padding)."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    prompt_len = seq // 4
    completion_words = seq - prompt_len - 1  # TRL appends "</s>"

    def words() -> int:
        if not sampled_lengths:
            return completion_words
        return int(torch.randint(completion_words // 2, completion_words + 1, (1,), generator=gen))

    rows = []
    for _ in range(n):
        rows.append({
            "prompt": _text(_ids(gen, prompt_len, vocab_size)),
            "chosen": " " + _text(_ids(gen, words(), vocab_size)),
            "rejected": " " + _text(_ids(gen, words(), vocab_size)),
        })
    return Dataset.from_list(rows)


def sft_dataset(n: int, seq: int, vocab_size: int, *, seed: int = 0):
    """``n`` pre-tokenized rows of exactly ``seq`` ids (loss on every token)."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    return Dataset.from_list([{"input_ids": _ids(gen, seq, vocab_size)} for _ in range(n)])


def prompt_dataset(n: int, prompt_len: int, vocab_size: int, *, seed: int = 0):
    """``n`` rows of ``{"prompt": text of prompt_len words}`` (what ``trl.GRPOTrainer`` samples from)."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    return Dataset.from_list([{"prompt": _text(_ids(gen, prompt_len, vocab_size))} for _ in range(n)])


def grpo_batch(batch: int, prompt_len: int, completion_len: int, vocab_size: int, *, device, seed: int = 0) -> dict:
    """One generated-and-scored GRPO batch as TRL 1.16's ``_generate_and_score_completions`` returns it.

    ``prompt_ids``/``prompt_mask`` ``[B, P]`` (no padding), ``completion_ids``/``completion_mask`` ``[B, C]``
    (each completion ends at a random length in ``[C/2, C]``, EOS then padding, like sampled ones),
    ``advantages [B]`` (standard normal), ``num_items_in_batch`` (the completion tokens, 0-d)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(len(SPECIALS), vocab_size, (batch, prompt_len), generator=gen)
    completion_ids = torch.randint(len(SPECIALS), vocab_size, (batch, completion_len), generator=gen)
    lengths = torch.randint(completion_len // 2, completion_len + 1, (batch,), generator=gen)
    pos = torch.arange(completion_len).unsqueeze(0)
    completion_mask = (pos < lengths.unsqueeze(1)).long()
    completion_ids = torch.where(pos == (lengths.unsqueeze(1) - 1), 2, completion_ids)  # EOS
    completion_ids = completion_ids.masked_fill(completion_mask == 0, 0)
    out = {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": torch.randn(batch, generator=gen),
        "num_items_in_batch": completion_mask.sum().float(),
    }
    return {k: v.to(device) for k, v in out.items()}


# --------------------------------------------------------------------------- learnable datasets


class BigramRule:
    """``next = table[current]`` over ``k`` active ids drawn from ``[3, V)``, followed w.p. ``1 - noise``."""

    def __init__(self, vocab_size: int, *, k: int = 1024, noise: float = 0.1, seed: int = 1234):
        if not 2 <= k <= vocab_size - len(SPECIALS):
            raise ValueError(f"k must be in [2, vocab_size - 3], got k={k}, vocab_size={vocab_size}")
        if not 0.0 <= noise < 1.0:
            raise ValueError(f"noise must be in [0, 1), got {noise}")
        gen = torch.Generator().manual_seed(seed)
        self.active = torch.randperm(vocab_size - len(SPECIALS), generator=gen)[:k] + len(SPECIALS)
        self.table = self.active[torch.randperm(k, generator=gen)]  # position i -> successor of active[i]
        self.index = {int(t): i for i, t in enumerate(self.active.tolist())}
        self.noise = noise

    def walk(self, gen: torch.Generator, start: Optional[int], n: int) -> list[int]:
        """``n`` ids continuing after ``start`` (None: a random active id first)."""
        k = self.active.numel()
        draws = torch.rand(n, generator=gen).tolist()
        randoms = self.active[torch.randint(0, k, (n,), generator=gen)].tolist()
        out, cur = [], start
        for i in range(n):
            nxt = randoms[i] if cur is None or draws[i] < self.noise else int(self.table[self.index[cur]])
            out.append(nxt)
            cur = nxt
        return out

    def random(self, gen: torch.Generator, n: int) -> list[int]:
        return self.active[torch.randint(0, self.active.numel(), (n,), generator=gen)].tolist()


def rule_sft_dataset(n: int, seq: int, rule: BigramRule, *, seed: int = 0):
    """``n`` pre-tokenized rows of ``seq`` ids walking ``rule``."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    return Dataset.from_list([{"input_ids": rule.walk(gen, None, seq)} for _ in range(n)])


def rule_dpo_dataset(n: int, seq: int, rule: BigramRule, *, seed: int = 0):
    """``n`` rows: prompt ``seq // 4`` rule-walking words; chosen continues by the rule, rejected is random
    active ids (each ``seq - seq // 4 - 1`` words, TRL appends EOS)."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    prompt_len, completion_words = seq // 4, seq - seq // 4 - 1
    rows = []
    for _ in range(n):
        prompt = rule.walk(gen, None, prompt_len)
        rows.append({
            "prompt": _text(prompt),
            "chosen": " " + _text(rule.walk(gen, prompt[-1], completion_words)),
            "rejected": " " + _text(rule.random(gen, completion_words)),
        })
    return Dataset.from_list(rows)


# --------------------------------------------------------------------------- models


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _config(shape: dict, layers: Optional[int]):
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3MoeConfig

    fields = {k: v for k, v in shape.items() if k != "model_type"}
    if layers is not None:
        fields["num_hidden_layers"] = int(layers)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "gemma2": Gemma2Config, "gemma3_text": Gemma3TextConfig,
           "qwen3_moe": Qwen3MoeConfig}[shape["model_type"]]
    # Gemma-2 declares no sdpa support in transformers 5 (its attention softcap), so it runs HF's eager
    # attention, as a user gets by default; the other families run sdpa
    attn = "eager" if shape["model_type"] == "gemma2" else "sdpa"
    return cls(**fields, attn_implementation=attn, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)


def _model_class(model_type: str):
    from transformers import (
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        LlamaForCausalLM,
        Qwen2ForCausalLM,
        Qwen3MoeForCausalLM,
    )

    return {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "gemma2": Gemma2ForCausalLM,
            "gemma3_text": Gemma3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM}[model_type]


def build_model(shape: dict, *, device: str, dtype: torch.dtype, seed: int = 0, layers: Optional[int] = None):
    """Random causal LM of ``shape`` (``layers`` overrides the depth) on ``device`` in ``dtype``, seeded."""
    config = _config(shape, layers)
    torch.manual_seed(seed)
    with _default_dtype(dtype), torch.device(device):
        model = _model_class(shape["model_type"])(config)
    return model.to(device=device, dtype=dtype)


def snapshot_weights(model, *, pin: bool = False) -> dict:
    """A CPU copy of ``model.state_dict()`` (pinned when ``pin``, for fast reloads)."""
    out = {}
    for name, tensor in model.state_dict().items():
        out[name] = torch.empty_like(tensor, device="cpu", pin_memory=pin).copy_(tensor.detach())
    return out


def model_from_snapshot(shape: dict, snapshot: dict, *, device: str, dtype: torch.dtype,
                        layers: Optional[int] = None):
    """A model of ``shape`` holding ``snapshot``'s weights: built without initialising its parameters
    (``transformers``' ``no_init_weights`` where it exists), then ``load_state_dict(strict=True)``.
    Non-persistent buffers (RoPE frequencies) are computed by the constructor as usual."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: initialise, then overwrite (slower, same result)
        no_init_weights = contextlib.nullcontext
    config = _config(shape, layers)
    with no_init_weights(), _default_dtype(dtype), torch.device(device):
        model = _model_class(shape["model_type"])(config)
    model = model.to(device=device, dtype=dtype)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.load_state_dict(snapshot, strict=True)
    return model
