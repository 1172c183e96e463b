"""Offline inputs of the trainer benchmark: a numeric word-level tokenizer, synthetic DPO/SFT datasets, a random Llama.

Nothing is downloaded. The tokenizer (:func:`build_tokenizer`) is a ``tokenizers`` WordLevel model over
the words ``w3 .. w{V-1}`` (id ``i`` for word ``w{i}``) plus ``<pad>`` (0), ``<s>`` (1), ``</s>`` (2),
split on whitespace, no BOS/EOS added by the tokenizer itself, so a text of ``n`` words is exactly ``n``
token ids and sequence lengths are exact.

* :func:`dpo_dataset` -- ``n`` rows of ``{"prompt", "chosen", "rejected"}`` text (the format TRL 1.16's
  ``DPOTrainer`` tokenizes: it has no pre-tokenized input path). The prompt is ``seq // 4`` words;
  chosen and rejected are ``seq - seq // 4 - 1`` words each, to which TRL appends ``</s>``, so each of
  ``prompt+chosen`` and ``prompt+rejected`` is exactly ``seq`` tokens (one pair = ``2 * seq`` tokens).
* :func:`sft_dataset` -- ``n`` rows of pre-tokenized ``{"input_ids": [seq ints]}`` (TRL 1.16's
  ``SFTTrainer`` takes an ``input_ids`` column as already processed: no EOS added, labels = input_ids).
* :func:`build_model` -- a randomly initialised ``LlamaForCausalLM`` built directly on ``device`` in
  ``dtype`` (weights never materialised in fp32 on the CPU), sdpa attention. ``LLAMA_3_2_1B`` is the
  Llama-3.2-1B shape (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192, vocab 128256, tied
  embeddings, llama3 RoPE); ``TINY`` a CPU-sized one for the ``--tiny`` smoke run.

Token ids are drawn uniformly from ``[3, V)`` with a seeded ``torch.Generator``.
"""

from __future__ import annotations

import contextlib

import torch

SPECIALS = ("<pad>", "<s>", "</s>")

LLAMA_3_2_1B = dict(
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

TINY = dict(
    LLAMA_3_2_1B, vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)


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


def _ids(gen: torch.Generator, n: int, vocab_size: int) -> list[int]:
    return torch.randint(len(SPECIALS), vocab_size, (n,), generator=gen).tolist()


def _text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def dpo_dataset(n: int, seq: int, vocab_size: int, *, seed: int = 0):
    """``n`` preference rows; prompt ``seq // 4`` tokens, chosen/rejected ``seq - seq // 4`` tokens with EOS."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    prompt_len = seq // 4
    completion_words = seq - prompt_len - 1  # TRL appends "</s>"
    rows = []
    for _ in range(n):
        rows.append({
            "prompt": _text(_ids(gen, prompt_len, vocab_size)),
            "chosen": " " + _text(_ids(gen, completion_words, vocab_size)),
            "rejected": " " + _text(_ids(gen, completion_words, vocab_size)),
        })
    return Dataset.from_list(rows)


def sft_dataset(n: int, seq: int, vocab_size: int, *, seed: int = 0):
    """``n`` pre-tokenized rows of exactly ``seq`` ids (loss on every token)."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    return Dataset.from_list([{"input_ids": _ids(gen, seq, vocab_size)} for _ in range(n)])


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(shape: dict, *, device: str, dtype: torch.dtype, seed: int = 0):
    """Random ``LlamaForCausalLM`` of ``shape`` on ``device`` in ``dtype`` (sdpa attention), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **shape, attn_implementation="sdpa", pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False
    )
    torch.manual_seed(seed)
    with _default_dtype(dtype), torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(device=device, dtype=dtype)
