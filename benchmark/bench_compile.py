"""A patched model under ``torch.compile``: one forward + backward step, eager and compiled.

What a user gets from ``torch.compile(model)`` on a patched model (the trainers' ``torch_compile=True``
compiles the backbone the same way and runs their loss eagerly; not measured here): while Dynamo
traces, the layers' ``impl="auto"`` takes the PyTorch path, so Inductor generates and fuses them
(``kernels.utils.resolve_impl``), and the fused loss runs eagerly behind one graph break
(``kernels.utils.eager_under_compile``), so the ``[tokens, vocab]`` logits still never
exist. Compared side by side in one process:

    hf              Hugging Face's model, eager (logits materialized, HF's loss)
    hf-compiled     the same under ``torch.compile`` (Inductor, default mode)
    ours            ``apply_liger_kernels(model)``, eager (our Triton layers and fused loss)
    ours-compiled   the patched model under ``torch.compile``
    liger           liger-kernel 0.8.5 ``_apply_liger_kernel_to_instance``, eager (skipped if absent)
    liger-compiled  that under ``torch.compile``

One step = ``model(**batch).loss.backward()`` after ``zero_grad(set_to_none=True)``, bf16 weights,
random init (``benchmark.trainer_data``), sdpa attention, no gradient checkpointing; time = median of
``triton.testing.do_bench`` (wall time of the eager call, host work included), memory = peak above
the model and batch (MiB: activations, gradients, the loss). The first compiled call (tracing and code
generation) is reported as ``compile_s``. Layers are cut to ``--layers`` (default 4) so that compiling
fits the device budget; per-layer costs are what the ratios compare.

Usage (GPU): ``python -m benchmark.bench_compile [--cases llama1b,qwen3-1.7b] [--layers 4]
[--batch 4] [--seq 2048]`` -> ``compile.csv`` / ``compile.png`` in $BENCH_OUT or benchmark/results/.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch._dynamo

from benchmark import trainer_data as data
from benchmark.common import Row, measure, write_results

PROVIDERS = ("hf", "hf-compiled", "ours", "ours-compiled", "liger", "liger-compiled")
# case name -> family key of benchmark.trainer_data.SHAPES
CASES = {"llama1b": "llama3.2-1b", "qwen1.5b": "qwen2.5-1.5b", "gemma3-1b": "gemma3-1b"}


def prepared(base, provider: str):
    """``(model, run)``: a copy of ``base`` patched as ``provider`` says, and what to call (the model, or
    its ``torch.compile`` wrapper for a ``-compiled`` provider). Dynamo's caches are reset first."""
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    if provider.startswith("ours"):
        from liger_losses.patching import apply_liger_kernels

        apply_liger_kernels(model)
    elif provider.startswith("liger"):
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    return model, (torch.compile(model) if provider.endswith("-compiled") else model)


def train_step(model, run, inputs: dict):
    """The step to time: fresh gradients, ``run(**inputs).loss.backward()``, the loss returned."""
    def step():
        model.zero_grad(set_to_none=True)
        loss = run(**inputs).loss
        loss.backward()
        return loss

    return step


def lm_batch(vocab: int, batch: int, seq: int) -> dict:
    """A seeded CUDA batch of ``[batch, seq]`` token ids in ``[3, vocab)``, labels = the ids."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, seq), generator=gen).cuda()
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())


def run_provider(name: str, provider: str, base, inputs: dict, *, layers: int) -> Row:
    try:
        model, run = prepared(base, provider)
    except ImportError as exc:
        return Row("compile", name, "full", provider, float("nan"), float("nan"), error=f"skipped: {exc}")
    step = train_step(model, run, inputs)
    start = time.perf_counter()
    try:
        first_loss = float(step())
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001 - a provider failing to compile must not stop the table
        return Row("compile", name, "full", provider, float("nan"), float("nan"),
                   error=f"{type(exc).__name__}: {str(exc)[:160]}")
    m = measure(step, warmup=5, rep=30, graph=False)
    tokens = inputs["input_ids"].numel()
    row = Row("compile", name, "full", provider, m.ms, m.peak_mib, error=m.error,
              extra=dict(layers=layers, tokens=tokens, loss=round(first_loss, 5), compile_s=round(compile_s, 1)))
    print(row.as_dict(), flush=True)
    return row


def run_case(name: str, *, layers: int, batch: int, seq: int, providers) -> list[Row]:
    shape = data.SHAPES[CASES[name]]
    base = data.build_model(shape, device="cuda", dtype=torch.bfloat16, seed=0, layers=layers)
    base.train()
    inputs = lm_batch(base.config.vocab_size, batch, seq)
    rows = [run_provider(name, provider, base, inputs, layers=layers) for provider in providers]
    hf_compiled_ms = next((r.ms for r in rows if r.provider == "hf-compiled"), float("nan"))
    for r in rows:
        r.extra["vs_hf_compiled"] = round(hf_compiled_ms / r.ms, 3) if r.ms == r.ms else ""
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="llama1b,qwen1.5b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--providers", default=",".join(PROVIDERS))
    args = p.parse_args(argv)
    rows = []
    for name in args.cases.split(","):
        rows += run_case(name, layers=args.layers, batch=args.batch, seq=args.seq,
                         providers=args.providers.split(","))
    write_results("compile", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
