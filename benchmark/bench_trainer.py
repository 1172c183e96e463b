"""Training-step throughput and peak memory of whole trainers: TRL 1.16 vs TRL + liger-kernel vs ours (issue #4 item 5).

Model: a Llama-3.2-1B-shaped ``LlamaForCausalLM`` (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP
8192, vocab 128256, tied embeddings, llama3 RoPE), random init, bf16 weights, sdpa attention, built
locally (offline) -- see ``benchmark/trainer_data.py`` for the model, the numeric word-level tokenizer
and the synthetic datasets. Every configuration starts from a freshly built model (same seed, so the
same weights and data for every provider), and the patched ``transformers`` Llama module is restored
between configurations (liger-kernel and our patching both swap module/class attributes).

Cases (``case`` column): ``dpo_seq{S}`` -- DPO, 1 pair per step (chosen + rejected, each S tokens, the
first S/4 of which are the shared prompt), with a separate frozen reference model (the same weights);
``sft_seq{S}`` -- SFT, 1 sequence of S tokens per step, loss on every token. S = 2048 and 8192.

Providers:
  ``trl``        ``trl.DPOTrainer`` / ``trl.SFTTrainer`` as shipped (``use_liger_kernel=False``). Note: TRL
                 1.16 already computes the LM-head log-probs with its own chunked fused LM head.
  ``trl+liger``  the same with ``use_liger_kernel=True``: in TRL 1.16 this is deprecated (FutureWarning,
                 "removed in v2.0.0") and TRL forces ``fused_linear_cross_entropy=False``, so liger-kernel
                 only swaps the layer kernels (RMSNorm, RoPE, SwiGLU) of the policy model; an error
                 (e.g. liger-kernel not installed) is recorded in the row's ``error``.
  ``ours``       ``liger_losses.trl_integration.DPOTrainer`` / ``SFTTrainer`` with ``use_liger=True``
                 (chunked loss from the backbone's hidden states + our layer kernels).

Training settings (all providers): bf16=True (autocast; weights already bf16), gradient_checkpointing=True
with ``gradient_checkpointing_kwargs={"use_reentrant": False}`` (set explicitly so every transformers
version does the same; recorded in the ``grad_ckpt_kwargs`` column),
``optim="adamw_torch_fused"``, lr 1e-6 constant, per_device_train_batch_size=1 (``--batch``), gradient accumulation 1,
no eval, no saving, ``report_to="none"``, huge ``logging_steps``, ``dataloader_num_workers=0``, one process.

Measurement: a ``TrainerCallback`` records ``torch.cuda.synchronize(); time.perf_counter()`` at every
``on_step_end``; the time of step i is end(i) - end(i-1) (so it includes data collation, forward,
backward, optimizer step and TRL's per-step metric bookkeeping). ``ms`` is the median over the timed
steps after ``--warmup`` warm-up steps (default 2 warm-up + 5 timed; ``--quick``: seq 2048 only, 3
timed). ``peak_mib`` is ``torch.cuda.max_memory_allocated()`` over the timed steps (stats reset at the
end of the last warm-up step): absolute, i.e. weights + reference model + gradients + AdamW state +
activations. ``resident_mib`` is the least ``torch.cuda.memory_allocated()`` at the start of a timed
step (what stays allocated between steps: weights, reference model, AdamW state -- the step's
inputs; HF's ``zero_grad`` frees the gradients) and ``step_peak_mib = peak_mib - resident_mib`` the
peak of the step above its inputs (gradients + activations + the loss), the measure of the guide's
"max_memory_allocated above the inputs". ``tokens_per_step`` is ``input_ids.numel()`` of the collated batch -- prompt + completion
tokens including any padding; for DPO chosen + rejected (here no padding: 2 x S for DPO, S for SFT);
``tokens_per_s = tokens_per_step / (ms / 1000)``. ``train_loss`` (TRL's mean training loss over all
steps) is a sanity check that providers train the same thing.

    python -m benchmark.bench_trainer            # full: dpo/sft x seq 2048, 8192 x 3 providers (< 5 min on an H200)
    python -m benchmark.bench_trainer --quick    # seq 2048 only, 3 timed steps
    python -m benchmark.bench_trainer --tiny     # CPU smoke run: tiny Llama, seq 64, 1 warm-up + 1 timed step
    python -m benchmark.bench_trainer --quick --memory-peak   # + memory_peak_<case>_<provider>.txt: where
                                                              #   the timed steps' peak allocated memory is

Results: ``trainer.csv`` (``trainer_b<N>.csv`` with ``--batch N``; + PNG) via
``benchmark.common.write_results`` (in $BENCH_OUT or $OUT when set, else benchmark/results/; ``--tiny``
writes ``trainer_tiny.csv`` to a temporary folder unless one of those is set), and a table of ratios ours/trl and ours/trl+liger. ``--budget-s`` (default 270):
no configuration is started after that many seconds (its row gets a "skipped" error), so the CSV is
written within gpu.sh's 300 s limit. Run it through gpu.sh (which installs the carried wheels):
``bash benchmark/gpu.sh bench:trainer [quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import torch

from benchmark.common import MIB, Row, print_table, write_results
from benchmark.trainer_data import LLAMA_3_2_1B, TINY, build_model, build_tokenizer, dpo_dataset, sft_dataset

PROVIDERS = ("trl", "trl+liger", "ours")
# Not run by default: ours with the MLP's down projection fused (gated_down.FUSE_DOWN_PROJ = True).
EXTRA_PROVIDERS = ("ours-fused-mlp",)
TASKS = ("dpo", "sft")


# --------------------------------------------------------------------------- timing


def _make_timer_callback(warmup: int, cuda: bool, profile_path: str = "", cprofile_path: str = "",
                         memory_peak_path: str = ""):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time at the end of every optimizer step; peak memory over the steps after ``warmup``."""

        def __init__(self):
            self.ends: list[float] = []
            self.issued: list[float] = []  # host time when the step's work was issued (before the sync)
            self.peak_warmup_mib = float("nan")
            self.peak_timed_mib = float("nan")
            self.resident_mib = float("nan")  # least memory allocated at the start of a timed step
            self.ref_model = None  # --memory-peak: labels the reference model's parameters
            self.mem_recording = False

        def _now(self) -> float:
            self.issued.append(time.perf_counter())
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            self.prof = None
            self.cprof = None

        def on_step_begin(self, args, state, control, **kwargs):
            # what stays allocated between steps (weights, reference model, optimizer state; the
            # gradients are freed by zero_grad): the "inputs" of a step, under its peak
            if cuda and len(self.ends) >= warmup:
                now = torch.cuda.memory_allocated() / MIB
                self.resident_mib = now if self.resident_mib != self.resident_mib else min(self.resident_mib, now)
            # --cprofile: Python-level profile of all timed steps (where the host time goes)
            if cprofile_path and len(self.ends) == warmup and self.cprof is None:
                import cProfile

                self.cprof = cProfile.Profile()
                self.cprof.enable()
            # --profile: torch.profiler over the first two timed steps (host ops and GPU kernels)
            if profile_path and cuda and len(self.ends) == warmup and self.prof is None:
                acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                self.prof = torch.profiler.profile(activities=acts)
                self.prof.__enter__()
            # --memory-peak: allocator history (Python stacks) over all timed steps
            if memory_peak_path and cuda and len(self.ends) == warmup and not self.mem_recording:
                from benchmark.memory_peak import start_recording

                start_recording()
                self.mem_recording = True

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(self._now())
            if self.cprof is not None and state.global_step >= state.max_steps:
                self.cprof.disable()
                write_cprofile(self.cprof, cprofile_path, len(self.ends) - warmup)
                self.cprof = None
            if not cuda:
                return
            if len(self.ends) == warmup:
                self.peak_warmup_mib = torch.cuda.max_memory_allocated() / MIB
                torch.cuda.reset_peak_memory_stats()
            elif len(self.ends) > warmup:
                self.peak_timed_mib = torch.cuda.max_memory_allocated() / MIB
            if self.mem_recording and state.global_step >= state.max_steps:
                write_memory_peak(memory_peak_path, kwargs.get("model"), self.ref_model, kwargs.get("optimizer"))
                self.mem_recording = False
            if self.prof is not None and len(self.ends) == warmup + 2:
                self.prof.__exit__(None, None, None)
                write_profile(self.prof, profile_path, self.ends[-1] - self.ends[-3])
                self.prof = None

        def step_ms(self) -> list[float]:
            timed = self.ends[max(warmup - 1, 0):]
            return [(b - a) * 1e3 for a, b in zip(timed, timed[1:])]

        def issue_ms(self) -> list[float]:
            """Per timed step: host time from the previous step's end until this step's work was
            issued (before the closing sync); close to ``step_ms`` when the step is host-bound."""
            ends = self.ends[max(warmup - 1, 0):-1]
            issued = self.issued[max(warmup, 1):]
            return [(b - a) * 1e3 for a, b in zip(ends, issued)]

    return StepTimer()


def write_cprofile(prof, path: str, steps: int) -> None:
    """Top host functions (by own time and by cumulative time) over the timed steps."""
    import io
    import pstats

    buf = io.StringIO()
    buf.write(f"cProfile over {steps} timed steps\n")
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(45)
    with open(path, "w") as f:
        f.write(buf.getvalue())


def write_profile(prof, path: str, wall_s: float) -> None:
    """Summary of a profiled pair of steps: wall time, GPU busy time, top host ops and kernels."""
    events = prof.key_averages()
    attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    gpu_us = sum(getattr(e, attr) for e in events)
    n_kernels = sum(e.count for e in events if getattr(e, attr) > 0)
    lines = [
        f"2 steps: wall {wall_s * 1e3:.1f} ms, GPU kernels {gpu_us / 1e3:.1f} ms ({n_kernels} launches), "
        f"GPU busy {gpu_us / 1e6 / wall_s:.0%}",
        events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70),
        events.table(sort_by=attr, row_limit=40, max_name_column_width=70),
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print(lines[0], flush=True)


def write_memory_peak(path: str, model, ref_model, optimizer) -> None:
    """Allocator snapshot at the end of the timed steps -> where their peak allocated memory is."""
    from benchmark.memory_peak import peak_breakdown, stop_recording, tensor_labels

    try:
        snapshot = torch.cuda.memory._snapshot()
    finally:
        stop_recording()
    try:  # a failed analysis must not cost the configuration its timing row
        labels = tensor_labels({"policy model": model, "reference model": ref_model},
                               getattr(optimizer, "optimizer", optimizer))
        text = peak_breakdown(snapshot, labels=labels, max_allocated=torch.cuda.max_memory_allocated())
    except Exception:  # noqa: BLE001
        text = "memory peak analysis failed:\n" + traceback.format_exc()
    del snapshot
    with open(path, "w") as f:
        f.write(text)
    print("\n".join(text.splitlines()[:14]) + f"\n... (memory peak breakdown in {path})", flush=True)


# --------------------------------------------------------------------------- isolation between configurations


@contextlib.contextmanager
def restored_llama_module():
    """Undo module- and class-level patches of ``transformers``' Llama module made inside the block."""
    import transformers.models.llama.modeling_llama as ml

    mod_snapshot = dict(vars(ml))
    classes = {name: obj for name, obj in mod_snapshot.items() if isinstance(obj, type) and obj.__module__ == ml.__name__}
    cls_snapshot = {name: dict(vars(cls)) for name, cls in classes.items()}
    try:
        yield
    finally:
        try:  # our own revert first (it knows what it patched)
            from liger_losses.patching.core import revert_liger_kernels

            revert_liger_kernels()
        except Exception:  # noqa: BLE001 - best effort; the snapshot restore below is authoritative
            pass
        for name in list(vars(ml)):
            if name not in mod_snapshot:
                delattr(ml, name)
        for name, value in mod_snapshot.items():
            if vars(ml).get(name, object()) is not value:
                setattr(ml, name, value)
        for name, cls in classes.items():
            snap = cls_snapshot[name]
            for attr in list(vars(cls)):
                if attr not in snap:
                    with contextlib.suppress(Exception):
                        delattr(cls, attr)
            for attr, value in snap.items():
                if vars(cls).get(attr, object()) is not value and attr not in ("__dict__", "__weakref__"):
                    with contextlib.suppress(Exception):
                        setattr(cls, attr, value)


def free_memory(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- one configuration


def make_config(task: str, provider: str, *, seq: int, steps: int, out_dir: str, tiny: bool, batch: int = 1):
    import trl

    kwargs = dict(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        warmup_steps=0,
        bf16=True,
        fp16=False,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        optim="adamw_torch_fused",
        logging_steps=10**6,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        max_length=seq,
        use_liger_kernel=(provider == "trl+liger"),
    )
    if tiny:
        kwargs["use_cpu"] = True
    return (trl.DPOConfig if task == "dpo" else trl.SFTConfig)(**kwargs)


OURS_CHUNK_TOKENS = None  # --ours-chunk-tokens: liger_chunk_tokens of our trainers (None: the engine's budget)


def make_trainer(task: str, provider: str, model, ref_model, args, dataset, tokenizer, callback):
    common = dict(args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[callback])
    if provider.startswith("ours"):
        from liger_losses.trl_integration.dpo import DPOTrainer as OursDPO
        from liger_losses.trl_integration.sft import SFTTrainer as OursSFT

        if task == "dpo":
            return OursDPO(model, ref_model, use_liger=True, liger_chunk_tokens=OURS_CHUNK_TOKENS, **common)
        return OursSFT(model, use_liger=True, liger_chunk_tokens=OURS_CHUNK_TOKENS, **common)
    import trl

    if task == "dpo":
        return trl.DPOTrainer(model, ref_model, **common)
    return trl.SFTTrainer(model, **common)


def run_one(task: str, provider: str, *, seq: int, warmup: int, timed: int, tiny: bool, profile: bool = False,
            cprofile: bool = False, batch: int = 1, memory_peak: bool = False) -> Row:
    case = f"{task}_seq{seq}" + (f"_b{batch}" if batch > 1 else "")
    cuda = not tiny
    device = "cpu" if tiny else "cuda"
    shape = TINY if tiny else LLAMA_3_2_1B
    vocab = shape["vocab_size"]
    steps = warmup + timed
    extra = dict(seq=seq, tokens_per_s=float("nan"), tokens_per_step=float("nan"), train_loss=float("nan"),
                 grad_ckpt=True, grad_ckpt_kwargs="", peak_warmup_mib=float("nan"), resident_mib=float("nan"),
                 step_peak_mib=float("nan"), step_ms_all="", issue_ms_all="",
                 launches_fast=0, launches_slow=0, note="")
    row = Row(bench="trainer", case=case, mode="step", provider=provider, ms=float("nan"), peak_mib=float("nan"),
              extra=extra)
    model = ref_model = trainer = None
    t_start = time.perf_counter()
    with restored_llama_module(), tempfile.TemporaryDirectory() as out_dir, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            tokenizer = build_tokenizer(vocab)
            dataset = (dpo_dataset if task == "dpo" else sft_dataset)(steps * batch, seq, vocab, seed=1)
            model = build_model(shape, device=device, dtype=torch.bfloat16, seed=0)
            if task == "dpo":
                ref_model = build_model(shape, device=device, dtype=torch.bfloat16, seed=0).eval()
                ref_model.requires_grad_(False)
            args = make_config(task, provider, seq=seq, steps=steps, out_dir=out_dir, tiny=tiny, batch=batch)
            extra["grad_ckpt_kwargs"] = str(args.gradient_checkpointing_kwargs)
            def out_path(kind: str, wanted: bool) -> str:  # "" when not wanted
                from benchmark.common import results_dir

                return os.path.join(results_dir(), f"{kind}_{case}_{provider.replace('+', '_')}.txt") if wanted else ""

            timer = _make_timer_callback(warmup, cuda, out_path("profile", profile), out_path("cprofile", cprofile),
                                         out_path("memory_peak", memory_peak and cuda))
            timer.ref_model = ref_model
            trainer = make_trainer(task, provider, model, ref_model, args, dataset, tokenizer, timer)
            batch = next(iter(trainer.get_train_dataloader()))
            extra["tokens_per_step"] = int(batch["input_ids"].numel())
            del batch
            from liger_losses.kernels.launch import launch_stats

            launch_stats(reset=True)
            import liger_losses.kernels.gated_down as gated_down

            fuse = gated_down.FUSE_DOWN_PROJ
            gated_down.FUSE_DOWN_PROJ = provider == "ours-fused-mlp" or (fuse and provider == "ours")
            try:
                out = trainer.train()
            finally:
                gated_down.FUSE_DOWN_PROJ = fuse
            # Triton launches of our kernels over the whole run: compiled-launcher hits vs
            # JITFunction.run (first launch per specialization, or a fallback; "off" says why)
            stats = launch_stats(reset=True)
            extra["launches_fast"], extra["launches_slow"] = stats["fast"], stats["slow"]
            if stats["off"]:
                extra["note"] = f"fast launch off: {stats['off']}"[:200]
            extra["train_loss"] = round(float(out.training_loss), 5)
            step_ms = timer.step_ms()
            if len(step_ms) != timed:
                raise RuntimeError(f"expected {timed} timed steps, got {len(step_ms)} (step ends: {len(timer.ends)})")
            row.ms = statistics.median(step_ms)
            row.peak_mib = timer.peak_timed_mib
            extra["peak_warmup_mib"] = round(timer.peak_warmup_mib, 1)
            extra["resident_mib"] = round(timer.resident_mib, 1)
            extra["step_peak_mib"] = round(timer.peak_timed_mib - timer.resident_mib, 1)
            extra["step_ms_all"] = " ".join(f"{t:.1f}" for t in step_ms)
            extra["issue_ms_all"] = " ".join(f"{t:.1f}" for t in timer.issue_ms())
            extra["tokens_per_s"] = round(extra["tokens_per_step"] / (row.ms / 1e3), 1)
        except Exception as exc:  # noqa: BLE001 - a provider failing must not stop the table
            row.error = f"{type(exc).__name__}: {str(exc)[:300]}".replace("\n", " ")
            traceback.print_exc()
        finally:
            notes = sorted({str(w.message).split(".")[0][:120] for w in caught if "liger" in str(w.message).lower()})
            if cprofile:
                notes.insert(0, "timed under cProfile (slower than a plain run)")
            if memory_peak and cuda:
                notes.insert(0, "timed under memory-history recording (slower than a plain run)")
                with contextlib.suppress(Exception):  # never leave the recording on after an error
                    from benchmark.memory_peak import stop_recording

                    stop_recording()
            if extra["note"]:
                notes.insert(0, extra["note"])
            extra["note"] = " | ".join(notes)[:400]
            del trainer, model, ref_model
            free_memory(cuda)
    print(f"[{case} {provider}] {row.ms:.1f} ms/step, {extra['tokens_per_s']} tok/s, peak {row.peak_mib:.0f} MiB, "
          f"loss {extra['train_loss']}, wall {time.perf_counter() - t_start:.1f} s"
          + (f", ERROR {row.error}" if row.error else ""), flush=True)
    return row


# --------------------------------------------------------------------------- main


def merge_rounds(rows: list[Row]) -> list[Row]:
    """One row per (case, provider): median step time over every round's timed steps, the
    highest peak memory; an error in any round is kept."""
    merged: dict = {}
    for r in rows:
        key = (r.case, r.provider)
        if key not in merged:
            merged[key] = r
            continue
        m = merged[key]
        if r.error or m.error:
            m.error = m.error or r.error
            continue
        m.extra["step_ms_all"] = f"{m.extra['step_ms_all']} {r.extra['step_ms_all']}".strip()
        m.extra["issue_ms_all"] = f"{m.extra.get('issue_ms_all', '')} {r.extra.get('issue_ms_all', '')}".strip()
        for k in ("launches_fast", "launches_slow"):
            m.extra[k] = m.extra.get(k, 0) + r.extra.get(k, 0)
        m.peak_mib = max(m.peak_mib, r.peak_mib)
        m.extra["step_peak_mib"] = max(m.extra.get("step_peak_mib", float("nan")), r.extra.get("step_peak_mib", float("nan")))
    for m in merged.values():
        steps = [float(t) for t in str(m.extra.get("step_ms_all", "")).split()]
        if steps and not m.error:
            m.ms = statistics.median(steps)
            m.extra["tokens_per_s"] = round(m.extra["tokens_per_step"] / (m.ms / 1e3), 1)
    return list(merged.values())


def _ratio(a, b):
    """a / b rounded to 3 digits, or "" unless both are numbers (not NaN) and b > 0."""
    numbers = all(isinstance(v, (int, float)) and v == v for v in (a, b))
    return round(a / b, 3) if numbers and b > 0 else ""


def ratio_table(rows: list[Row]) -> list[dict]:
    out = []
    for case in dict.fromkeys(r.case for r in rows):
        by = {r.provider: r for r in rows if r.case == case}
        d = {"case": case}
        for p in PROVIDERS:
            r = by.get(p)
            d[f"{p} tok/s"] = "" if r is None or r.error else r.extra["tokens_per_s"]
            d[f"{p} MiB"] = "" if r is None or r.error or r.peak_mib != r.peak_mib else round(r.peak_mib)
        ours = by.get("ours")
        for base in ("trl", "trl+liger"):
            b = by.get(base)
            ok = ours is not None and b is not None and not ours.error and not b.error
            d[f"speed ours/{base}"] = round(ours.extra["tokens_per_s"] / b.extra["tokens_per_s"], 3) if ok else ""
            d[f"mem ours/{base}"] = _ratio(ours.peak_mib, b.peak_mib) if ok else ""
            d[f"step mem ours/{base}"] = _ratio(ours.extra.get("step_peak_mib"), b.extra.get("step_peak_mib")) if ok else ""
        out.append(d)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="seq 2048 only, 3 timed steps")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny Llama, seq 64, 1 warm-up + 1 timed step")
    ap.add_argument("--seqs", type=int, nargs="+", default=None, help="sequence lengths (default 2048 8192)")
    ap.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    ap.add_argument("--providers", nargs="+", choices=PROVIDERS + EXTRA_PROVIDERS, default=list(PROVIDERS))
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 2; --tiny 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 5; --quick 3; --tiny 1)")
    ap.add_argument("--budget-s", type=float, default=270.0,
                    help="start no new configuration after this many seconds (its row says so); default 270 so "
                         "the CSV is written inside gpu.sh's 300 s limit")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every provider this many times, alternating (the host's speed drifts between "
                         "runs); a row's ms is the median over all rounds' timed steps")
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler summary of two timed steps per configuration (profile_<case>_<provider>.txt)")
    ap.add_argument("--batch", type=int, default=1,
                    help="per_device_train_batch_size (default 1; 8 is the TrainingArguments default); cases "
                         "with batch > 1 are named <task>_seq<S>_b<batch>")
    ap.add_argument("--ours-mlp-chunk-elems", type=int, default=None,
                    help="gated_down.CHUNK_ELEMS and FORWARD_CHUNK_ELEMS for ours (the fused MLP tail's buffers)")
    ap.add_argument("--ours-chunk-tokens", type=int, default=None,
                    help="liger_chunk_tokens for our trainers (default: the engine's tile budget)")
    ap.add_argument("--cprofile", action="store_true",
                    help="cProfile of the timed steps per configuration (cprofile_<case>_<provider>.txt)")
    ap.add_argument("--memory-peak", action="store_true",
                    help="record the CUDA allocator history over the timed steps and write where their peak "
                         "allocated memory is, by source line (memory_peak_<case>_<provider>.txt); slows the steps")
    a = ap.parse_args(argv)
    global OURS_CHUNK_TOKENS
    OURS_CHUNK_TOKENS = a.ours_chunk_tokens
    if a.ours_mlp_chunk_elems:
        import liger_losses.kernels.gated_down as gated_down

        gated_down.CHUNK_ELEMS = gated_down.FORWARD_CHUNK_ELEMS = a.ours_mlp_chunk_elems

    if a.tiny:
        seqs, warmup, timed = [64], 1, 1
        if not (os.environ.get("BENCH_OUT") or os.environ.get("OUT")):  # keep smoke results out of the repo
            os.environ["BENCH_OUT"] = tempfile.mkdtemp(prefix="bench_trainer_tiny_")
    else:
        if not torch.cuda.is_available():
            print("bench_trainer: no CUDA device (use --tiny for a CPU smoke run)")
            return 0
        seqs, warmup, timed = ([2048] if a.quick else [2048, 8192]), 2, (3 if a.quick else 5)
    seqs = a.seqs or seqs
    warmup = a.warmup if a.warmup is not None else warmup
    timed = a.steps if a.steps is not None else timed
    if warmup < 1 or timed < 1:
        raise ValueError(f"--warmup and --steps must be >= 1, got {warmup} and {timed}")
    if a.memory_peak and (a.tiny or not torch.cuda.is_available()):
        print("bench_trainer: --memory-peak needs CUDA (allocator history); ignored on this CPU run", flush=True)

    import datasets
    import transformers
    import trl

    datasets.disable_progress_bars()

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}"
    try:
        import importlib.metadata as md

        versions += f", liger-kernel {md.version('liger-kernel')}"
    except Exception:  # noqa: BLE001
        versions += ", liger-kernel not installed"
    print(f"bench_trainer: {versions}; seqs {seqs}, {warmup} warm-up + {timed} timed steps", flush=True)

    t0 = time.perf_counter()
    rows = []
    for seq in seqs:  # short sequences first: they matter most if the budget runs out
        for task, _round, provider in itertools.product(a.tasks, range(a.rounds), a.providers):
            elapsed = time.perf_counter() - t0
            if elapsed > a.budget_s:
                rows.append(Row(bench="trainer", case=f"{task}_seq{seq}" + (f"_b{a.batch}" if a.batch > 1 else ""),
                                mode="step", provider=provider,
                                ms=float("nan"), peak_mib=float("nan"),
                                extra=dict(seq=seq, tokens_per_s=float("nan"), tokens_per_step=float("nan"),
                                           train_loss=float("nan"), note=""),
                                error=f"skipped: time budget {a.budget_s:.0f} s used ({elapsed:.0f} s)"))
                continue
            rows.append(run_one(task, provider, seq=seq, warmup=warmup, timed=timed, tiny=a.tiny,
                                profile=a.profile, cprofile=a.cprofile, batch=a.batch,
                                memory_peak=a.memory_peak))
    print(f"bench_trainer: all configurations in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = merge_rounds(rows)

    name = "trainer_tiny" if a.tiny else ("trainer" if a.batch == 1 else f"trainer_b{a.batch}")
    write_results(name, rows)
    print()
    print_table([{"case": r.case, "provider": r.provider, "ms": round(r.ms, 1), "tokens_per_step": r.extra["tokens_per_step"],
                  "tokens_per_s": r.extra["tokens_per_s"], "peak_mib": round(r.peak_mib, 1),
                  "resident_mib": r.extra.get("resident_mib"), "step_peak_mib": r.extra.get("step_peak_mib"),
                  "train_loss": r.extra["train_loss"], "launches fast/slow": f"{r.extra['launches_fast']}/{r.extra['launches_slow']}",
                  "note": r.extra["note"][:60]} for r in rows],
                keys=["case", "provider", "ms", "tokens_per_step", "tokens_per_s", "peak_mib", "resident_mib",
                      "step_peak_mib", "train_loss",
                      "launches fast/slow", "note"])
    print()
    ratios = ratio_table(rows)
    print_table(ratios, keys=list(ratios[0]) if ratios else [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
