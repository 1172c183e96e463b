"""The README demo: DPO training of a tiny model with ``DPOTrainer(use_liger=True)``, offline, in minutes on a CPU.

``python -m liger_losses.demo [--steps 80] [--device auto|cpu|cuda] [--batch-size 8] [--lr 1e-3] [--seed 0]``

1. Builds a character-level tokenizer (``tokenizers`` WordLevel, wrapped in
   ``PreTrainedTokenizerFast``) and a tiny randomly initialised Llama (2 layers, hidden 64) from
   configs -- no download -- and loads the bundled preference set ``liger_losses/data/
   preference_demo.jsonl`` (sums, next letters, reversals: chosen right, rejected wrong).
2. Measures, on one batch and the same weights, the peak tensor memory of one training step's
   forward+backward with our loss (``use_liger=True``) and with TRL's default DPO path (on CUDA:
   ``torch.cuda.max_memory_allocated``; on the CPU: the peak of the tensor allocations recorded by
   ``torch.profiler``'s memory timeline), plus the logits bytes each path holds at once.
3. Trains ``--steps`` steps (TRL's progress bar), evaluating on a held-out tenth before and after.
4. Prints a short report: metrics at the start vs the end (reward accuracy and margins rise), the
   evaluation before vs after, and the memory table.

The helpers :func:`build_tokenizer`, :func:`build_tiny_model` and :func:`preference_dataset` are
also used by the tests (``tests/trl_integration``). Works with ``TRITON_INTERPRET`` unset on a CPU
(our kernels fall back to PyTorch there).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import string
import sys
import tempfile
import time
from typing import Optional

import torch

VOCAB_CHARS = string.digits + string.ascii_lowercase + "+-=>|:; "
SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")


# --------------------------------------------------------------------------- tokenizer, model, data


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast``: ids 0..2 = ``<pad>``, ``</s>``, ``<unk>``, then
    one id per character of ``VOCAB_CHARS``. No BOS; the prompt's ids are a prefix of prompt+answer's."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + list(VOCAB_CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    # chat template (for conversational data): "role: content" lines, assistant turns in generation markers
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
        "{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    return tok


def build_tiny_model(tokenizer, *, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                     dtype: torch.dtype = torch.float32):
    """A randomly initialised ``LlamaForCausalLM`` (4 heads, 2 KV heads, MLP 2x hidden), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    with _seeded(seed):
        model = LlamaForCausalLM(config)
    return model.to(dtype)


@contextlib.contextmanager
def _seeded(seed: int):
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def preference_dataset(n: Optional[int] = None):
    """The bundled preference set as a ``datasets.Dataset`` (prompt/chosen/rejected strings)."""
    from datasets import Dataset

    from .data import load_jsonl

    rows = load_jsonl("preference_demo.jsonl")
    return Dataset.from_list(rows if n is None else rows[:n])


# --------------------------------------------------------------------------- memory


def _peak_cpu_bytes(fn) -> Optional[int]:
    """Peak of live tensor bytes created inside ``fn()``, from torch.profiler's memory timeline
    (a private API: None when unavailable)."""
    try:
        from torch.profiler import ProfilerActivity, profile
        from torch.profiler._memory_profiler import Action

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:
            fn()
        cur = peak = 0
        for _, action, _, size in prof._memory_profile().timeline:
            if action == Action.CREATE:
                cur += size
            elif action == Action.DESTROY:
                cur -= size
            peak = max(peak, cur)
        return peak
    except Exception:
        return None


def _peak_cuda_bytes(fn, device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def step_peak_bytes(trainer, batch) -> Optional[int]:
    """Peak tensor memory of ``trainer.compute_loss`` + backward on ``batch`` (grads cleared after)."""
    model = trainer.model
    model.train()

    def step():
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        model.zero_grad(set_to_none=True)

    device = next(model.parameters()).device
    if device.type == "cuda":
        return _peak_cuda_bytes(step, device)
    return _peak_cpu_bytes(step)


def _fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"


# --------------------------------------------------------------------------- the demo


def make_config(output_dir: str, *, steps: int, batch_size: int, lr: float, seed: int, use_cuda: bool,
                logging_steps: int = 5, quiet: bool = False, **overrides):
    """The DPOConfig of the demo (fp32 on the CPU, bf16 on CUDA; no checkpointing, no saving)."""
    import trl

    kwargs = dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=2 * batch_size,
        learning_rate=lr,
        lr_scheduler_type="constant",
        beta=0.1,
        logging_steps=logging_steps,
        save_strategy="no",
        report_to="none",
        gradient_checkpointing=False,
        bf16=use_cuda,
        fp16=False,
        use_cpu=not use_cuda,
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        max_length=64,
        disable_tqdm=quiet,
    )
    kwargs.update(overrides)
    return trl.DPOConfig(**kwargs)


class _History:
    """A TrainerCallback that keeps every log dict."""

    def __new__(cls):
        from transformers import TrainerCallback

        class History(TrainerCallback):
            def __init__(self):
                self.logs = []

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs:
                    self.logs.append(dict(logs, step=state.global_step))

        return History()


REPORT_KEYS = ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected",
               "logps/chosen", "logps/rejected", "mean_token_accuracy", "entropy")


def run(steps: int = 80, device: str = "auto", batch_size: int = 8, lr: float = 1e-3, seed: int = 0,
        quiet: bool = False, measure_memory: bool = True, out=sys.stdout) -> dict:
    """Run the demo; returns {"train_start", "train_end", "eval_before", "eval_after", "memory"}."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from .trl_integration import DPOTrainer

    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda given but no CUDA device is available")
    tokenizer = build_tokenizer()
    data = preference_dataset().shuffle(seed=seed)
    n_eval = max(2 * batch_size, len(data) // 10)
    train_data = data.select(range(n_eval, len(data)))
    eval_data = data.select(range(n_eval))
    model = build_tiny_model(tokenizer, seed=seed)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=out, flush=True))
    where = "cuda" if use_cuda else "cpu"
    say(f"liger-losses demo: DPO on {len(train_data)} preference pairs, tiny Llama "
        f"({sum(p.numel() for p in model.parameters()) / 1e3:.0f}k parameters, vocab {len(tokenizer)}), "
        f"{steps} steps on {where}")

    with tempfile.TemporaryDirectory() as tmp:
        memory = {}
        if measure_memory:
            memory = _compare_memory(model, tokenizer, train_data, tmp, batch_size=batch_size, lr=lr,
                                     seed=seed, use_cuda=use_cuda)
        history = _History()
        args = make_config(tmp, steps=steps, batch_size=batch_size, lr=lr, seed=seed, use_cuda=use_cuda,
                           quiet=quiet, logging_steps=min(5, max(1, steps // 10)))
        trainer = DPOTrainer(model, copy.deepcopy(model), args=args, train_dataset=train_data,
                             eval_dataset=eval_data, processing_class=tokenizer, callbacks=[history],
                             use_liger=True)
        t0 = time.time()
        eval_before = trainer.evaluate()
        trainer.train()
        eval_after = trainer.evaluate()
        elapsed = time.time() - t0

    train_logs = [log for log in history.logs if "rewards/accuracies" in log and "eval_loss" not in log
                  and not any(k.startswith("eval_") for k in log)]
    result = {
        "train_start": train_logs[0] if train_logs else {},
        "train_end": train_logs[-1] if train_logs else {},
        "eval_before": eval_before,
        "eval_after": eval_after,
        "memory": memory,
        "seconds": elapsed,
    }
    if not quiet:
        print(format_report(result, steps=steps), file=out, flush=True)
    return result


def _compare_memory(model, tokenizer, train_data, tmp, *, batch_size, lr, seed, use_cuda) -> dict:
    """Peak step memory of our path vs TRL's default path on the same batch and weights."""
    from .kernels.utils import triton_interpret
    from .trl_integration import DPOTrainer

    results = {}
    if not use_cuda and triton_interpret():
        return {"trl": None, "liger": None, "completion_tokens": 0, "vocab": len(tokenizer),
                "llama3_logits_bytes": 0,
                "what": "skipped: TRITON_INTERPRET=1 (interpreted kernels under the profiler are slow and "
                        "memory-hungry); unset it to measure"}
    batch = None
    for name, use_liger in (("trl", False), ("liger", True)):
        args = make_config(tmp, steps=1, batch_size=batch_size, lr=lr, seed=seed, use_cuda=use_cuda, quiet=True)
        trainer = DPOTrainer(copy.deepcopy(model), copy.deepcopy(model), args=args, train_dataset=train_data,
                             processing_class=tokenizer, use_liger=use_liger)
        if batch is None:
            batch = next(iter(trainer.get_train_dataloader()))
        batch_dev = trainer._prepare_inputs(batch)
        results[name] = step_peak_bytes(trainer, batch_dev)
    n_tokens = int(batch["completion_mask"][:, 1:].sum())
    results["completion_tokens"] = n_tokens
    results["vocab"] = len(tokenizer)
    results["what"] = ("torch.cuda.max_memory_allocated over one compute_loss + backward" if use_cuda else
                       "peak of tensor allocations in torch.profiler's memory timeline over one "
                       "compute_loss + backward (CPU)")
    # analytic: the fp32 logits of the batch's scored tokens at a Llama-3-8B head (V = 128256)
    results["llama3_logits_bytes"] = n_tokens * 128256 * 4
    return results


def format_report(result: dict, *, steps: int) -> str:
    start, end = result["train_start"], result["train_end"]
    lines = ["", "=" * 72, f"Report after {steps} steps ({result['seconds']:.0f} s)", "-" * 72,
             f"{'metric (train, logging window)':34s} {'start':>12s} {'end':>12s}"]
    for key in REPORT_KEYS:
        if key in start or key in end:
            lines.append(f"{key:34s} {start.get(key, float('nan')):12.4f} {end.get(key, float('nan')):12.4f}")
    lines.append("-" * 72)
    lines.append(f"{'held-out evaluation':34s} {'before':>12s} {'after':>12s}")
    for key in ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins"):
        b, a = result["eval_before"].get(key), result["eval_after"].get(key)
        if b is not None and a is not None:
            lines.append(f"{key:34s} {b:12.4f} {a:12.4f}")
    mem = result.get("memory") or {}
    if mem:
        lines.append("-" * 72)
        lines.append(f"Peak memory, one training step on the same batch ({mem['what']}):")
        lines.append(f"  TRL default DPO path : {_fmt_bytes(mem.get('trl'))}")
        lines.append(f"  liger-losses path    : {_fmt_bytes(mem.get('liger'))}")
        if mem.get("completion_tokens"):
                lines.append(f"  (tiny vocab of {mem['vocab']}: the logits are a small share of either; at a "
                         f"128k-vocab head the fp32 logits of these {mem['completion_tokens']} tokens would be "
                         f"{_fmt_bytes(mem['llama3_logits_bytes'])} -- the tensor our chunked loss never holds "
                         "whole; see benchmark/ for measured GPU numbers)")
    lines.append("=" * 72)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m liger_losses.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=80, help="training steps (default 80)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: CUDA when available, else CPU")
    parser.add_argument("--batch-size", type=int, default=8, help="preference pairs per step (default 8)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory comparison")
    ns = parser.parse_args(argv)
    if ns.steps < 1:
        parser.error("--steps must be >= 1")
    run(steps=ns.steps, device=ns.device, batch_size=ns.batch_size, lr=ns.lr, seed=ns.seed,
        measure_memory=not ns.no_memory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
