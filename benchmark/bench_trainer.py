"""Training-step throughput and peak memory of whole trainers over a matrix of models, tasks and batches:
TRL 1.16 vs TRL + liger-kernel vs ours (issue 18 item 1).

Each *case* is a model family, a task, full fine-tuning or LoRA, a batch and a weight dtype; each is run by
three *providers*:
  ``trl``        TRL's trainer as shipped (``use_liger_kernel=False``). TRL 1.16's DPO/GRPO already compute
                 the LM-head log-probs with their own chunked fused LM head; its SFT/ORPO hold whole logits.
  ``trl+liger``  the same with ``use_liger_kernel=True`` (TRL 1.16: deprecated; for SFT/DPO liger-kernel then
                 only swaps the policy's layer kernels). An error (e.g. liger-kernel missing) is the row's ``error``.
  ``ours``       ``liger_losses.trl_integration.<Task>Trainer(use_liger=True)``: chunked loss from the
                 backbone's hidden states + our layer kernels.
  ``ours-bf16-accum`` (only when named in ``--providers``) ``ours`` with the head's weight gradient
                 accumulated in the weight's dtype, the default before fp32 accumulation
                 (``engine_config(half_weight_accum_dtype=None)``): what that default costs in time and memory.
  ``ours-padded`` (only when named) ``ours`` with ``LIGER_LOSSES_PAD_FREE=0``: every backbone call padded, as
                 TRL's, to A/B the pad-free calls in one run.

Cases (``--list`` prints them; ``--cases`` picks some by name or glob over the full list; the name says family, task,
full/LoRA, sequences x tokens, and ``-L<n>`` where the depth is cut, ``-fp32w`` for fp32 weights). Default matrix:

  llama1b_sft_full_2x2048        Llama-3.2-1B, SFT, 4k tokens (host-bound step)
  llama1b_dpo_full_4x2048        Llama-3.2-1B, DPO with a reference model, 4 pairs = 16k tokens
  llama1b-fp32w_sft_full_4x2048  Llama-3.2-1B in fp32 weights, bf16=True (autocast), SFT, 8k tokens
  qwen1.5b_dpo_full_2x1024       Qwen2.5-1.5B (tied, 28 x 1536, GQA 12:2, V 151936), DPO, 4k tokens (host-bound)
  qwen1.5b_dpo_lora_8x1024       same model, DPO, LoRA r=16 all-linear (frozen head; reference = adapter off), 16k
  gemma2b_sft_full_8x2048        Gemma-2-2B (final logit softcap 30, V 256000, eager attention), SFT, 16k tokens
  llama8b-L8_orpo_full_4x2048    Llama-3-8B widths and head (H 4096, V 128256, untied), 8 of 32 layers, ORPO, 16k
  llama8b-L8_sft_lora_4x8192     same model, SFT, LoRA r=16, 4 x 8192 = 32k tokens (GPU-bound)
  gemma3-1b_sft_full_4x2048      Gemma-3-1B (gemma3_text: V 262144, 26 x 1152, MQA, sliding window 512), SFT, 8k
  qwen3moe-L4_dpo_full_2x1024    Qwen3-30B-A3B widths (128 experts, top 8, router aux loss), 4 of 48 layers, DPO, 4k
  qwen1.5b_grpo_full_16x1024     Qwen2.5-1.5B, GRPO optimization step on a pre-generated batch (16 sequences
                                 of 256 prompt + 768 completion tokens, 4 generations per prompt, beta=0);
                                 run only when ``liger_losses.trl_integration.GRPOTrainer`` is importable,
                                 else its rows say "skipped: ..." (no device time spent)

``--full`` adds: qwen1.5b_sft_full_2x4096 (issue 18's SFT row), llama1b_{dpo,sft}_full_8x2048 (the earlier
single-shape benchmark's cases, ``trainer_b8.csv``), llama1b_sft_lora_8x2048, gemma2b_dpo_lora_4x1024,
llama8b_sft_lora_2x4096 (the full 32-layer 8B), llama8b-L8_grpo_full_16x1024 (GRPO's step at the 8B
widths) and qwen1.5b_dpo_full_4x1024_sampled (completions of lengths drawn in [C/2, C]: the padded batch that
pad-free DPO skips; its tokens/s counts the nominal 2 x 4 x 1024 positions), gemma3-1b_grpo_full_16x1024 (pad-free
GRPO through sliding-window layers) and qwen1.5b_grpo_lora_16x1024_dropout (GRPO with LoRA r=16 and its
``lora_dropout=0.05`` drawn in training, pad-free) -- and 2 warm-up + 5 timed steps per run instead of 1 + 3.

Economy: each model is built (random init, seed 0) once per (family, depth, dtype) and its weights kept as a
pinned CPU copy (``benchmark.trainer_data.snapshot_weights``); every run loads that copy into a skeleton
built without initialisation (``model_from_snapshot``), DPO's reference model too. Rounds: round r runs
every case, and within a case every provider, before round r+1 (``--rounds``, default 3), so slow drift of
the machine falls on all providers alike. ``--budget-s`` (default 450; ``--quick``: 240 and 2 rounds, for
gpu.sh's default 300 s limit): a run is not started when the time used plus that run's expected wall time
(its own last run, else the case's slowest provider's) would pass the budget; its round is missing from the
row (``rounds`` says how many ran, ``note`` why) and a row with no round gets ``error = "skipped: ..."``. The
CSV is rewritten after every run (a command killed from outside keeps what ran) and the PNG at the end.

Training settings (all providers): bf16=True (autocast), gradient_checkpointing=True
(``use_reentrant=False``), ``optim="adamw_torch_fused"``, lr 1e-6 constant, gradient accumulation 1, no
eval/saving/logging, one process; LoRA: PEFT ``LoraConfig(r=16, lora_alpha=32, lora_dropout=0,
target_modules="all-linear")`` (the dropout case: ``lora_dropout=0.05``) passed as ``peft_config`` (TRL wraps the
model; adapters fp32 under autocast).
The transformers modeling modules are restored after every run (liger-kernel and our patching swap module
and class attributes).

Measurement (a ``TrainerCallback``): ``torch.cuda.synchronize(); time.perf_counter()`` at every
``on_step_end``; step i's time is end(i) - end(i-1) (collation, forward, backward, optimizer, TRL's metric
bookkeeping). A round's time is the median of its timed steps after the warm-up steps; ``ms`` is the median
over rounds, ``ms_min``/``ms_max`` the extreme rounds, ``tokens_per_s`` (``_min``/``_max``) the same as
throughput with ``tokens_per_step`` = the case's nominal tokens (2 x pairs x seq for DPO/ORPO, sequences x seq
otherwise; prompt tokens included; no padding in these datasets). ``peak_mib``: ``max_memory_allocated``
over the timed steps (absolute: weights, reference, optimizer state, activations), the highest round;
``resident_mib``: the least ``memory_allocated`` at a timed step's start (what stays between steps);
``step_peak_mib = peak_mib - resident_mib`` (the step's peak above its inputs). ``speed_vs_trl`` /
``speed_vs_trl_liger``: tokens/s over that provider's on the same case; ``step_peak_vs_trl`` likewise.
``wall_s``: seconds all of the row's runs took (build, trainer setup, steps), to plan GPU time; ``card``: the GPU.
``sm_clock_mhz``, ``power_w``, ``temp_c``: ``nvidia-smi``'s SM clock, power draw and temperature sampled
every 100 ms over the timed steps, the mean over rounds (:class:`GpuSampler`; empty without ``nvidia-smi``):
at the GPU's power cap a step that idles less runs the same kernels at a lower clock.

GPU time (one H200, estimated, not measured as a whole): from ``trainer_b8.csv`` / ``trainer_seq8192_b2.csv``
the 1B full step is ~24 us/token for TRL (392 ms at 16k SFT tokens, 918 ms at 32k DPO tokens), ~0.75x that
for ours, and host-bound steps do not shrink below ~150 ms; scaled by parameters x tokens the default cases'
steps average ~0.55 s (4k-token cases ~0.2 s, 16-32k cases 0.5-1.3 s). 1 warm-up + 3 timed steps x 3
providers x 3 rounds x 9 cases = 324 steps ~ 180 s, plus ~3-4 s per run for model load, trainer setup and
teardown (81 runs ~ 270 s; not measured on the GPU: the CPU smoke run spends ~1.2 s per run outside its
steps) and ~30 s of first-round Triton compilation: ~8 min with the start-up. The 450 s budget holds the
command under ~8.5 min whatever the overheads turn out to be; if they are larger it trims the last round's
last cases (their rows say "2 of 3 rounds"), so run it with a 600 s command limit and read ``wall_s`` to
plan the next run. Without GRPO (8 cases) ~7 min. ``--full``
(15 cases, 7 steps per run) is ~17 min: run it with ``--budget-s 540`` in pieces (``--cases``).

    python -m benchmark.bench_trainer                      # default matrix -> trainer_matrix.csv + .png (~8 min)
    python -m benchmark.bench_trainer --full --cases 'llama1b_*' --budget-s 540
    python -m benchmark.bench_trainer --tiny               # CPU smoke run: tiny models of each family, seq 64
    python -m benchmark.bench_trainer --cases qwen1.5b_dpo_lora_8x1024 --rounds 1 --profile   # + profile_*.txt

``--profile`` (torch.profiler over two timed steps; its summary starts with the GPU's idle gaps and the
host ops holding each, from a Chrome trace kept beside it gzipped), ``--cprofile`` (host profile), ``--syncs`` (the
stacks of one timed step's host-device synchronizations) and ``--memory-peak``
(allocator history: where the timed steps' peak is) write ``<kind>_<case>_<provider>_r<round>.txt`` next to
the CSV. Results go to $BENCH_OUT or $OUT when set, else benchmark/results/ (``--tiny``: a temporary folder
unless one of those is set), named ``--name`` (default ``trainer_matrix``; ``--tiny``: ``trainer_matrix_tiny``).
Through gpu.sh: ``BENCH_TIMEOUT=600 bash benchmark/gpu.sh bench:trainer``.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import csv
import fnmatch
import gc
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Optional
from unittest import mock

import torch

from benchmark import trainer_data as data
from benchmark.common import MIB, Row, print_table, results_dir, write_results
from liger_losses.chunked.config import engine_config

PROVIDERS = ("trl", "trl+liger", "ours")
# our trainers under other engine knobs, run when named in --providers (not in the default matrix)
OURS_VARIANTS = {"ours": {}, "ours-bf16-accum": dict(half_weight_accum_dtype=None), "ours-padded": {}}
# our trainers under other environment switches: "ours-padded" runs every backbone call padded, as TRL's
OURS_ENV = {"ours-padded": {"LIGER_LOSSES_PAD_FREE": "0"}}
TASKS = ("sft", "dpo", "orpo", "grpo")
PAIRED = ("dpo", "orpo")
GRPO_GENERATIONS = 4  # completions per prompt in the GRPO case (TRL's num_generations)


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One cell of the matrix: ``batch`` sequences (pairs for DPO/ORPO) of ``seq`` tokens each."""

    name: str
    family: str  # key of benchmark.trainer_data.SHAPES
    task: str  # one of TASKS
    batch: int
    seq: int
    lora: bool = False
    fp32_weights: bool = False  # fp32 weights (master weights) trained with bf16=True autocast
    layers: Optional[int] = None  # cut depth (None: the family's own)
    sampled_lengths: bool = False  # DPO: each completion's length drawn in [C/2, C] (padding, as real data has)
    lora_dropout: float = 0.0  # the adapters' dropout (GRPO keeps it in training: TRL's disable_dropout=False)

    @property
    def tokens_per_step(self) -> int:
        return (2 if self.task in PAIRED else 1) * self.batch * self.seq

    @property
    def weight_dtype(self) -> torch.dtype:
        return torch.float32 if self.fp32_weights else torch.bfloat16

    def tiny(self) -> "Case":
        """The CPU smoke version: the family's tiny shape, 2 layers, batch 2 (GRPO 4), seq 64."""
        return Case(self.name, self.family, self.task, 4 if self.task == "grpo" else 2, 64, self.lora,
                    self.fp32_weights, None, self.sampled_lengths, self.lora_dropout)


DEFAULT_CASES = (
    Case("llama1b_sft_full_2x2048", "llama3.2-1b", "sft", 2, 2048),
    Case("llama1b_dpo_full_4x2048", "llama3.2-1b", "dpo", 4, 2048),
    Case("llama1b-fp32w_sft_full_4x2048", "llama3.2-1b", "sft", 4, 2048, fp32_weights=True),
    Case("qwen1.5b_dpo_full_2x1024", "qwen2.5-1.5b", "dpo", 2, 1024),
    Case("qwen1.5b_dpo_lora_8x1024", "qwen2.5-1.5b", "dpo", 8, 1024, lora=True),
    Case("gemma2b_sft_full_8x2048", "gemma2-2b", "sft", 8, 2048),
    Case("llama8b-L8_orpo_full_4x2048", "llama3-8b", "orpo", 4, 2048, layers=8),
    Case("llama8b-L8_sft_lora_4x8192", "llama3-8b", "sft", 4, 8192, lora=True, layers=8),
    Case("qwen1.5b_grpo_full_16x1024", "qwen2.5-1.5b", "grpo", 16, 1024),
    Case("gemma3-1b_sft_full_4x2048", "gemma3-1b", "sft", 4, 2048),
    Case("qwen3moe-L4_dpo_full_2x1024", "qwen3-moe-30b-a3b", "dpo", 2, 1024, layers=4),
)
FULL_EXTRA_CASES = (
    Case("qwen1.5b_sft_full_2x4096", "qwen2.5-1.5b", "sft", 2, 4096),
    Case("llama1b_dpo_full_8x2048", "llama3.2-1b", "dpo", 8, 2048),
    Case("llama1b_sft_full_8x2048", "llama3.2-1b", "sft", 8, 2048),
    Case("llama1b_sft_lora_8x2048", "llama3.2-1b", "sft", 8, 2048, lora=True),
    Case("gemma2b_dpo_lora_4x1024", "gemma2-2b", "dpo", 4, 1024, lora=True),
    Case("llama8b_sft_lora_2x4096", "llama3-8b", "sft", 2, 4096, lora=True),
    Case("llama8b-L8_grpo_full_16x1024", "llama3-8b", "grpo", 16, 1024, layers=8),
    # pad-free's DPO case: completions of sampled lengths, so a batch is padded to its longest row
    Case("qwen1.5b_dpo_full_4x1024_sampled", "qwen2.5-1.5b", "dpo", 4, 1024, sampled_lengths=True),
    # pad-free with a sliding window the packed row reaches (Gemma-3's 512), served by the flash kernel's window
    Case("gemma3-1b_grpo_full_16x1024", "gemma3-1b", "grpo", 16, 1024),
    # pad-free with LoRA's dropout drawn in training (GRPO keeps dropout on by default)
    Case("qwen1.5b_grpo_lora_16x1024_dropout", "qwen2.5-1.5b", "grpo", 16, 1024, lora=True, lora_dropout=0.05),
)
ALL_CASES = {c.name: c for c in DEFAULT_CASES + FULL_EXTRA_CASES}


def grpo_available() -> str:
    """"" when ``liger_losses.trl_integration.GRPOTrainer`` imports, else why not."""
    try:
        from liger_losses.trl_integration import GRPOTrainer  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: skip the case
        return f"{type(exc).__name__}: {exc}"[:160]
    return ""


def grpo_lengths(case: Case) -> tuple[int, int]:
    """(prompt, completion) tokens of a GRPO case's sequences: a quarter prompt, the rest completion."""
    return case.seq // 4, case.seq - case.seq // 4


# --------------------------------------------------------------------------- timing


def _make_timer_callback(warmup: int, cuda: bool, profile_path: str = "", cprofile_path: str = "",
                         memory_peak_path: str = "", syncs_path: str = ""):
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
            self.gpu = GpuSampler() if cuda else None  # SM clock / power over the timed steps
            self.gpu_means: dict = {}

        def _now(self) -> float:
            self.issued.append(time.perf_counter())
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            if self.gpu is not None and not self.gpu.running:
                self.gpu.start()
                if warmup == 0:
                    self.gpu.mark()
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
            # --syncs: every implicit host-device synchronization of the first timed step, by stack
            if syncs_path and cuda and len(self.ends) == warmup:
                self.syncs = SyncRecorder()
                self.syncs.start()
            # --memory-peak: allocator history (Python stacks) over all timed steps
            if memory_peak_path and cuda and len(self.ends) == warmup and not self.mem_recording:
                from benchmark.memory_peak import start_recording

                start_recording()
                self.mem_recording = True

        def on_step_end(self, args, state, control, **kwargs):
            if getattr(self, "syncs", None) is not None:
                self.syncs.stop(syncs_path)
                self.syncs = None
            self.ends.append(self._now())
            if self.cprof is not None and state.global_step >= state.max_steps:
                self.cprof.disable()
                write_cprofile(self.cprof, cprofile_path, len(self.ends) - warmup)
                self.cprof = None
            if not cuda:
                return
            if len(self.ends) == warmup:
                self.peak_warmup_mib = torch.cuda.max_memory_allocated() / MIB
                if self.gpu is not None:
                    self.gpu.mark()
                torch.cuda.reset_peak_memory_stats()
            elif len(self.ends) > warmup:
                self.peak_timed_mib = torch.cuda.max_memory_allocated() / MIB
            if self.mem_recording and state.global_step >= state.max_steps:
                write_memory_peak(memory_peak_path, kwargs.get("model"), self.ref_model, kwargs.get("optimizer"))
                self.mem_recording = False
            if self.gpu is not None and self.gpu.running and state.global_step >= state.max_steps:
                self.gpu_means = self.gpu.stop()
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


class GpuSampler:
    """``nvidia-smi`` sampling of the SM clock (MHz), the power draw (W) and the temperature (C) of this
    process's GPU every 100 ms, started before the first step (its process start in no timed step), the
    samples from :meth:`mark` (the end of the warm-up) to :meth:`stop` (the last step) returned as means.
    The machine's GPUs run at their power cap under a dense step, where the same cuBLAS kernel at the same
    shape runs a few percent slower when the GPU idles less: these columns say whether two providers' runs
    were clocked alike. No ``nvidia-smi`` (or an error): nothing sampled, the columns stay empty."""

    QUERY = "clocks.sm,power.draw,temperature.gpu"
    KEYS = ("sm_clock_mhz", "power_w", "temp_c")

    def __init__(self):
        self.proc = None
        self.out = None
        self.offset = 0

    @property
    def running(self) -> bool:
        return self.proc is not None

    def start(self) -> None:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return
        try:
            gpu = f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
        except Exception:  # noqa: BLE001 - older torch: the first visible GPU's index
            gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        line_buffered = [shutil.which("stdbuf"), "-oL"] if shutil.which("stdbuf") else []  # whole lines on file
        self.out = tempfile.TemporaryFile(mode="w+")
        try:
            cmd = [exe, f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits", "-lms", "100", "-i", gpu]
            self.proc = subprocess.Popen(line_buffered + cmd, stdout=self.out, stderr=subprocess.DEVNULL)
        except OSError:
            self.proc = None
            self.out.close()

    def mark(self) -> None:
        """Samples before this call (the warm-up) are left out of :meth:`stop`'s means."""
        if self.proc is not None:
            self.offset = os.fstat(self.out.fileno()).st_size

    def stop(self) -> dict:
        if self.proc is None:
            return {}
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        self.out.seek(self.offset)
        text = self.out.read()
        self.out.close()
        return parse_gpu_samples(text)


def parse_gpu_samples(text: str) -> dict:
    """Means of ``nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits``
    lines (``{"sm_clock_mhz", "power_w", "temp_c", "samples"}``); lines that do not parse (``[N/A]``, a
    truncated last line) are skipped; no valid line gives ``{}``."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(GpuSampler.KEYS):
            continue
        try:
            rows.append([float(p) for p in parts])
        except ValueError:
            continue
    if not rows:
        return {}
    means = {k: round(statistics.mean(r[i] for r in rows), 1) for i, k in enumerate(GpuSampler.KEYS)}
    return {**means, "samples": len(rows)}


class SyncRecorder:
    """``torch.cuda.set_sync_debug_mode("warn")`` between :meth:`start` and :meth:`stop`; each
    warning's Python stack (the last 8 frames) counted; :meth:`stop` writes them, most frequent
    first. A sync in the middle of a step drains the GPU's queue: the GPU then idles while the host
    issues the next kernels."""

    def __init__(self):
        self.stacks: dict = {}

    def start(self) -> None:
        import traceback

        self._old = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return self._old(message, category, filename, lineno, file, line)
            frames = traceback.format_list(traceback.extract_stack()[:-1][-8:])
            key = "".join(frames)
            self.stacks[key] = self.stacks.get(key, 0) + 1

        self._filters = warnings.filters[:]
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self, path: str) -> None:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = self._old
        warnings.filters[:] = self._filters
        lines = [f"{sum(self.stacks.values())} synchronizations in one step, {len(self.stacks)} stacks"]
        for key, n in sorted(self.stacks.items(), key=lambda kv: -kv[1]):
            lines += [f"--- {n}x", key]
        with open(path, "w") as f:
            f.write("\n".join(lines))
        print(lines[0], flush=True)


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
        "every op and kernel with device time (self device us, calls, self CPU us), to compare providers:",
    ]
    timed = sorted((e for e in events if getattr(e, attr) > 0), key=lambda e: -getattr(e, attr))
    lines += [f"{getattr(e, attr):12.1f} {e.count:7d} {e.self_cpu_time_total:12.1f}  {e.key}" for e in timed]
    trace = path[:-4] + ".json"
    try:  # the GPU's idle gaps and what the host ran meanwhile: where a GPU-bound step still waits
        prof.export_chrome_trace(trace)
        lines[1:1] = idle_gaps(trace)
        with open(trace, "rb") as f_in, gzip.open(trace + ".gz", "wb") as f_out:
            shutil.copyfileobj(f_in, f_out)
    except Exception:  # noqa: BLE001 - the summary above stands without it
        lines.insert(1, "idle-gap analysis failed:\n" + traceback.format_exc())
    finally:
        if os.path.exists(trace):
            os.remove(trace)
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print(lines[0], flush=True)
    print("\n".join(lines[1:4]), flush=True)


def idle_gaps(trace_path: str, *, min_us: float = 20.0, top: int = 25) -> list[str]:
    """From a Chrome trace of profiled steps: the GPU's idle time between kernels (gaps of at least
    ``min_us`` summed, and the ``top`` longest), each with the kernels around it and the outermost
    host ops that ran during it (what the GPU waited for: a sync, Python work, an allocation)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                      and "dur" in e), key=lambda e: e["ts"])
    gaps = []
    end = kernels[0]["ts"] + kernels[0]["dur"] if kernels else 0.0
    prev = kernels[0] if kernels else None
    for k in kernels[1:]:
        if k["ts"] - end >= min_us:
            gaps.append((k["ts"] - end, end, prev, k))
        if k["ts"] + k["dur"] > end:
            end, prev = k["ts"] + k["dur"], k
    total = sum(g[0] for g in gaps)
    span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) if kernels else 0.0
    out = [f"GPU idle in gaps >= {min_us:.0f} us: {total / 1e3:.1f} ms in {len(gaps)} gaps over a "
           f"{span / 1e3:.1f} ms span of kernels; the {top} longest (ms, kernel before -> after | the "
           "host ops holding the gap's start, innermost first | the longest host ops started in it):"]
    host = sorted((e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")
                   and "dur" in e), key=lambda e: e["ts"])
    starts = [o["ts"] for o in host]
    longest = max((o["dur"] for o in host), default=0.0)
    for dur, t0, before, after in sorted(gaps, key=lambda g: -g[0])[:top]:
        t1 = t0 + dur
        lo = bisect.bisect_left(starts, t0 - longest)
        near = host[lo:bisect.bisect_right(starts, t1)]
        holding = sorted((o for o in near if o["ts"] <= t0 < o["ts"] + o["dur"]), key=lambda o: o["dur"])
        started = sorted((o for o in near if t0 < o["ts"] <= t1), key=lambda o: -o["dur"])
        hold = " < ".join(dict.fromkeys(o["name"][:36] for o in holding[:4]))
        run = "; ".join(dict.fromkeys(o["name"][:36] for o in started[:4]))
        out.append(f"  {dur / 1e3:7.3f}  {before['name'][:32]} -> {after['name'][:32]} | {hold} | {run}")
    return out


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


# --------------------------------------------------------------------------- isolation between runs

MODELING_MODULES = {
    "llama": "transformers.models.llama.modeling_llama",
    "qwen2": "transformers.models.qwen2.modeling_qwen2",
    "gemma2": "transformers.models.gemma2.modeling_gemma2",
    "gemma3_text": "transformers.models.gemma3.modeling_gemma3",
    "qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe",
}


@contextlib.contextmanager
def restored_modeling_module(model_type: str):
    """Undo module- and class-level patches of the family's ``transformers`` modeling module made inside
    the block (liger-kernel's and ours; ours is reverted by ``revert_liger_kernels`` first)."""
    import importlib

    ml = importlib.import_module(MODELING_MODULES[model_type])
    mod_snapshot = dict(vars(ml))
    classes = {name: obj for name, obj in mod_snapshot.items()
               if isinstance(obj, type) and obj.__module__ == ml.__name__}
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


# --------------------------------------------------------------------------- trainers


def make_config(case: Case, provider: str, *, steps: int, out_dir: str, tiny: bool, torch_compile: str = "",
                reentrant: bool = False):
    """The TRL config of one run; ``torch_compile`` (a backend name, e.g. "inductor"; "" for none) sets
    ``torch_compile=True`` for every provider: accelerate compiles the prepared model (ours then compiles
    its backbone under the same context, ``trl_integration/base.py``); ``reentrant``: activation checkpointing
    with ``use_reentrant=True`` (TRL's default is False)."""
    import trl

    kwargs = dict(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=case.batch, gradient_accumulation_steps=1,
        learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0, bf16=True, fp16=False,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant},
        optim="adamw_torch_fused", logging_steps=10**6, save_strategy="no", eval_strategy="no", report_to="none",
        dataloader_num_workers=0, disable_tqdm=True, seed=0, data_seed=0,
        use_liger_kernel=(provider == "trl+liger"),
    )
    if tiny:
        kwargs["use_cpu"] = True
    if torch_compile:
        kwargs.update(torch_compile=True, torch_compile_backend=torch_compile)
    if case.task == "sft":
        return trl.SFTConfig(max_length=case.seq, **kwargs)
    if case.task == "dpo":
        return trl.DPOConfig(max_length=case.seq, **kwargs)
    if case.task == "orpo":
        from trl.experimental.orpo import ORPOConfig

        # room for a BOS the ORPO tokenizer may prepend: nothing is truncated
        return ORPOConfig(max_length=case.seq + 8, **kwargs)
    _, completion = grpo_lengths(case)
    return trl.GRPOConfig(num_generations=GRPO_GENERATIONS, max_completion_length=completion, steps_per_generation=1,
                          num_iterations=1, beta=0.0, log_completions=False, **kwargs)


def _zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def _pregenerated(trainer_cls, batch: dict):
    """``trainer_cls`` whose generation step returns ``batch`` (a fresh dict of the same tensors) every time:
    the optimization step of GRPO alone, on the same completions for every provider."""

    class Pregenerated(trainer_cls):
        def _generate_and_score_completions(self, inputs):
            return dict(batch)

    Pregenerated.__name__ = f"Pregenerated{trainer_cls.__name__}"
    return Pregenerated


def make_dataset(case: Case, vocab: int, n: int):
    if case.task == "sft":
        return data.sft_dataset(n, case.seq, vocab, seed=1)
    if case.task == "grpo":
        return data.prompt_dataset(n, grpo_lengths(case)[0], vocab, seed=1)
    return data.dpo_dataset(n, case.seq, vocab, seed=1, sampled_lengths=case.sampled_lengths)


def make_trainer(case: Case, provider: str, model, ref_model, args, dataset, tokenizer, callback, *,
                 peft_config=None, grpo_inputs=None, chunk_tokens=None):
    common = dict(args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[callback])
    if peft_config is not None:
        common["peft_config"] = peft_config
    ours = provider in OURS_VARIANTS
    liger = dict(use_liger=True, liger_chunk_tokens=chunk_tokens) if ours else {}
    if case.task == "sft":
        import trl

        from liger_losses.trl_integration import SFTTrainer

        return (SFTTrainer if ours else trl.SFTTrainer)(model, **common, **liger)
    if case.task == "dpo":
        import trl

        from liger_losses.trl_integration import DPOTrainer

        return (DPOTrainer if ours else trl.DPOTrainer)(model, ref_model, **common, **liger)
    if case.task == "orpo":
        from trl.experimental.orpo import ORPOTrainer as TRLORPO

        from liger_losses.trl_integration import ORPOTrainer

        return (ORPOTrainer if ours else TRLORPO)(model, **common, **liger)
    import trl

    if ours:
        from liger_losses.trl_integration import GRPOTrainer as cls
    else:
        cls = trl.GRPOTrainer
    return _pregenerated(cls, grpo_inputs)(model, _zero_reward, **common, **liger)


# --------------------------------------------------------------------------- one run


@dataclass
class RunResult:
    """One provider's run of one case in one round."""

    step_ms: list = field(default_factory=list)
    issue_ms: list = field(default_factory=list)
    peak_mib: float = float("nan")
    peak_warmup_mib: float = float("nan")
    resident_mib: float = float("nan")
    train_loss: float = float("nan")
    launches: tuple = (0, 0)
    gpu: dict = field(default_factory=dict)  # GpuSampler's means over the timed steps
    wall_s: float = 0.0
    notes: list = field(default_factory=list)
    error: str = ""

    @property
    def ms(self) -> float:
        return statistics.median(self.step_ms) if self.step_ms else float("nan")


class WeightBank:
    """One pinned CPU copy of each (family, depth, dtype) model's weights, built on first use."""

    def __init__(self, *, tiny: bool):
        self.tiny = tiny
        self.snapshots: dict = {}

    def shape(self, case: Case) -> dict:
        return (data.TINY_SHAPES if self.tiny else data.SHAPES)[case.family]

    def model(self, case: Case, device: str):
        key = (case.family, case.layers, case.weight_dtype)
        shape = self.shape(case)
        if key not in self.snapshots:
            model = data.build_model(shape, device=device, dtype=case.weight_dtype, seed=0, layers=case.layers)
            self.snapshots[key] = data.snapshot_weights(model, pin=device == "cuda")
            return model
        return data.model_from_snapshot(shape, self.snapshots[key], device=device, dtype=case.weight_dtype,
                                        layers=case.layers)


def run_one(case: Case, provider: str, bank: WeightBank, *, rnd: int, warmup: int, timed: int, tiny: bool,
            diag: dict) -> RunResult:
    """One provider's run of ``case``: fresh model from the bank, a trainer, warmup + timed steps."""
    cuda = not tiny
    device = "cpu" if tiny else "cuda"
    steps = warmup + timed
    res = RunResult()
    model = ref_model = trainer = timer = None
    t_start = time.perf_counter()
    tag = f"{case.name}_{provider.replace('+', '_')}_r{rnd}"
    out_path = {kind: (os.path.join(results_dir(), f"{kind}_{tag}.txt") if diag.get(kind) else "")
                for kind in ("profile", "cprofile", "memory_peak", "syncs")}
    if not cuda:
        out_path["memory_peak"] = out_path["profile"] = out_path["syncs"] = ""
    model_type = bank.shape(case)["model_type"]
    with (restored_modeling_module(model_type), tempfile.TemporaryDirectory() as out_dir,
          warnings.catch_warnings(record=True) as caught):
        warnings.simplefilter("always")
        try:
            vocab = bank.shape(case)["vocab_size"]
            tokenizer = data.build_tokenizer(vocab)
            dataset = make_dataset(case, vocab, steps * case.batch)
            model = bank.model(case, device)
            peft_config = None
            if case.lora:
                from peft import LoraConfig

                peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=case.lora_dropout,
                                         target_modules="all-linear", task_type="CAUSAL_LM")
            elif case.task == "dpo":  # full fine-tuning: a separate frozen reference (LoRA: the adapter off)
                ref_model = bank.model(case, device).eval().requires_grad_(False)
            grpo_inputs = None
            if case.task == "grpo":
                prompt, completion = grpo_lengths(case)
                grpo_inputs = data.grpo_batch(case.batch, prompt, completion, vocab, device=device, seed=2)
            args = make_config(case, provider, steps=steps, out_dir=out_dir, tiny=tiny,
                               torch_compile=diag.get("torch_compile", ""), reentrant=diag.get("reentrant", False))
            timer = _make_timer_callback(warmup, cuda, out_path["profile"], out_path["cprofile"],
                                         out_path["memory_peak"], out_path["syncs"])
            timer.ref_model = ref_model
            torch.manual_seed(0)  # the LoRA adapters' init: the same for every provider
            trainer = make_trainer(case, provider, model, ref_model, args, dataset, tokenizer, timer,
                                   peft_config=peft_config, grpo_inputs=grpo_inputs,
                                   chunk_tokens=diag.get("chunk_tokens"))
            from liger_losses.kernels.launch import launch_stats
            from liger_losses.patching.pad_free import varlen_call_count

            launch_stats(reset=True)
            packed_before = varlen_call_count()
            env = mock.patch.dict(os.environ, OURS_ENV.get(provider, {}))
            with engine_config(**OURS_VARIANTS.get(provider, {})), env:
                out = trainer.train()
            if varlen_call_count() > packed_before:  # pad-free: attention calls on packed rows over the run
                res.notes.append(f"pad-free: {varlen_call_count() - packed_before} packed attention calls")
            # Triton launches of our kernels over the whole run: compiled-launcher hits vs JITFunction.run
            stats = launch_stats(reset=True)
            res.launches = (stats["fast"], stats["slow"])
            if stats["off"]:
                res.notes.append(f"fast launch off: {stats['off']}"[:200])
            res.train_loss = float(out.training_loss)
            res.step_ms = timer.step_ms()
            res.issue_ms = timer.issue_ms()
            if len(res.step_ms) != timed:
                raise RuntimeError(f"expected {timed} timed steps, got {len(res.step_ms)} "
                                   f"(step ends: {len(timer.ends)})")
            res.peak_mib, res.peak_warmup_mib = timer.peak_timed_mib, timer.peak_warmup_mib
            res.resident_mib = timer.resident_mib
            res.gpu = dict(timer.gpu_means)
        except Exception as exc:  # noqa: BLE001 - a provider failing must not stop the matrix
            res.error = f"{type(exc).__name__}: {str(exc)[:300]}".replace("\n", " ")
            res.step_ms = []
            traceback.print_exc()
        finally:
            res.notes += sorted({str(w.message).split(".")[0][:100] for w in caught
                                 if "liger" in str(w.message).lower()})
            if diag.get("cprofile"):
                res.notes.insert(0, "timed under cProfile (slower than a plain run)")
            if out_path["memory_peak"]:
                res.notes.insert(0, "timed under memory-history recording (slower than a plain run)")
                with contextlib.suppress(Exception):  # never leave the recording on after an error
                    from benchmark.memory_peak import stop_recording

                    stop_recording()
            if out_path["syncs"]:
                res.notes.insert(0, "timed with one step under the CUDA sync debug mode")
                torch.cuda.set_sync_debug_mode(0)  # never left on after an error in the recorded step
            if timer is not None and timer.gpu is not None and timer.gpu.running:
                timer.gpu.stop()  # a run that failed mid-way leaves no sampler behind
            del trainer, model, ref_model
            free_memory(cuda)
    res.wall_s = time.perf_counter() - t_start
    print(f"[r{rnd} {case.name} {provider}] {res.ms:.1f} ms/step, {case.tokens_per_step / res.ms * 1e3:.0f} tok/s, "
          f"peak {res.peak_mib:.0f} MiB (step {res.peak_mib - res.resident_mib:.0f}), loss {res.train_loss:.4f}, "
          f"wall {res.wall_s:.1f} s" + (f", ERROR {res.error}" if res.error else ""), flush=True)
    return res


# --------------------------------------------------------------------------- the matrix


def case_row(case: Case, provider: str, runs: list, *, rounds: int, skip_reason: str) -> Row:
    """One CSV row: the median over rounds and the extreme rounds, the highest peaks."""
    ok = [r for r in runs if not r.error]
    tokens = case.tokens_per_step
    round_ms = [r.ms for r in ok]
    ms = statistics.median(round_ms) if ok else float("nan")
    nan = float("nan")

    def tps(v):
        return round(tokens / v * 1e3, 1) if v == v and v > 0 else nan

    step_peaks = [r.peak_mib - r.resident_mib for r in ok]
    notes = []
    if len(runs) < rounds:
        notes.append(f"{len(runs)} of {rounds} rounds ({skip_reason})")
    for r in runs:
        notes += [n for n in r.notes if n not in notes]
    errors = [r.error for r in runs if r.error]
    error = errors[0] if errors else ("" if runs else f"skipped: {skip_reason}")
    extra = dict(
        family=case.family, task=case.task, tuning="lora" if case.lora else "full",
        weights="fp32" if case.fp32_weights else "bf16", layers=case.layers or "", batch=case.batch, seq=case.seq,
        tokens_per_step=tokens, tokens_per_s=tps(ms), tokens_per_s_min=tps(max(round_ms)) if ok else nan,
        tokens_per_s_max=tps(min(round_ms)) if ok else nan, ms_min=round(min(round_ms), 2) if ok else nan,
        ms_max=round(max(round_ms), 2) if ok else nan, rounds=len(ok),
        step_peak_mib=round(max(step_peaks), 1) if ok else nan,
        resident_mib=round(min(r.resident_mib for r in ok), 1) if ok else nan,
        peak_warmup_mib=round(max(r.peak_warmup_mib for r in ok), 1) if ok else nan,
        train_loss=round(statistics.mean(r.train_loss for r in ok), 5) if ok else nan,
        speed_vs_trl="", speed_vs_trl_liger="", step_peak_vs_trl="",
        round_ms=" ".join(f"{v:.1f}" for v in round_ms),
        step_ms_all=" | ".join(" ".join(f"{t:.1f}" for t in r.step_ms) for r in ok),
        issue_ms_all=" | ".join(" ".join(f"{t:.1f}" for t in r.issue_ms) for r in ok),
        launches_fast=sum(r.launches[0] for r in runs), launches_slow=sum(r.launches[1] for r in runs),
        **{k: _mean_of(r.gpu.get(k) for r in ok) for k in GpuSampler.KEYS},
        wall_s=round(sum(r.wall_s for r in runs), 1), card=_card(), note=" | ".join(notes)[:400],
    )
    return Row(bench="trainer_matrix", case=case.name, mode="step", provider=provider, ms=ms,
               peak_mib=max((r.peak_mib for r in ok), default=nan), extra=extra, error=error or None)


def _card() -> str:
    """The GPU the row ran on (``torch.cuda.get_device_name()``; "cpu" without CUDA): pieces of one matrix
    merged from several calls may come from different cards, and only a case's own rows compare."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _mean_of(values) -> object:
    """The mean of the numbers among ``values`` rounded to 0.1, or "" when there is none."""
    numbers = [v for v in values if isinstance(v, (int, float)) and v == v]
    return round(statistics.mean(numbers), 1) if numbers else ""


def _ratio(a, b):
    """a / b rounded to 3 digits, or "" unless both are numbers (not NaN) and b > 0."""
    numbers = all(isinstance(v, (int, float)) and v == v for v in (a, b))
    return round(a / b, 3) if numbers and b > 0 else ""


def add_ratios(rows: list[Row]) -> None:
    by = {(r.case, r.provider): r for r in rows}
    for r in rows:
        for base, key in (("trl", "speed_vs_trl"), ("trl+liger", "speed_vs_trl_liger")):
            b = by.get((r.case, base))
            if b is not None and not r.error and not b.error:
                r.extra[key] = _ratio(r.extra["tokens_per_s"], b.extra["tokens_per_s"])
        b = by.get((r.case, "trl"))
        if b is not None and not r.error and not b.error:
            r.extra["step_peak_vs_trl"] = _ratio(r.extra["step_peak_mib"], b.extra["step_peak_mib"])


def plot_matrix(name: str, rows: list[Row]) -> None:
    """Two panels per case: tokens/s relative to TRL (bars = median round, whiskers = extreme rounds) and
    the step peak above the resident memory (MiB)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r.case for r in rows))
    providers = list(dict.fromkeys(r.provider for r in rows))
    by = {(r.case, r.provider): r for r in rows}
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 1.3 * len(cases)), 8.5))
    width = 0.8 / max(1, len(providers))
    nan = float("nan")
    for k, p in enumerate(providers):
        xs = [c + k * width for c in range(len(cases))]
        rel, lo, hi, mem = [], [], [], []
        for c in cases:
            r, base = by.get((c, p)), by.get((c, "trl"))
            ok = r is not None and base is not None and not r.error and not base.error
            b = base.extra["tokens_per_s"] if ok else nan
            med = r.extra["tokens_per_s"] / b if ok else nan
            rel.append(med)
            lo.append(med - r.extra["tokens_per_s_min"] / b if ok else 0.0)
            hi.append(r.extra["tokens_per_s_max"] / b - med if ok else 0.0)
            mem.append(r.extra["step_peak_mib"] if r is not None and not r.error else nan)
        axes[0].bar(xs, rel, width=width, label=p, yerr=[lo, hi], capsize=2)
        axes[1].bar(xs, mem, width=width, label=p)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set_ylabel("tokens/s relative to trl")
    axes[1].set_ylabel("step peak above resident (MiB)")
    for ax in axes:
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))])
        ax.set_xticklabels(cases, rotation=25, ha="right", fontsize=7)
        ax.legend(fontsize=7)
    axes[0].set_title(f"{name}: training-step throughput (median of rounds, whiskers: extreme rounds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(results_dir(), f"{name}.png"), dpi=100)
    plt.close(fig)


def write_partial(name: str, rows: list[Row]) -> None:
    """The CSV alone (no table, no plot) of the rows so far."""
    dicts = [r.as_dict() for r in rows]
    keys = list(dict.fromkeys(k for d in dicts for k in d))
    with open(os.path.join(results_dir(), f"{name}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(dicts)


def rows_from_csv(paths: list[str]) -> list[Row]:
    """The rows of matrix CSVs written by pieces of one matrix (``--cases`` runs under other names),
    in file order; numbers back to floats so the plot and ratios can use them."""
    core = {"bench", "case", "mode", "provider", "ms", "peak_mib", "floor_ms", "floor_mib", "error",
            "time_over_floor", "peak_over_floor"}
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            for d in csv.DictReader(f):
                extra = {}
                for k, v in d.items():
                    if k in core:
                        continue
                    try:
                        extra[k] = float(v) if v not in ("", None) else ""
                    except ValueError:
                        extra[k] = v
                rows.append(Row(d["bench"], d["case"], d["mode"], d["provider"], float(d["ms"] or "nan"),
                                float(d["peak_mib"] or "nan"), extra=extra, error=d["error"] or None))
    return rows


def pick_cases(patterns: Optional[list], full: bool) -> list[Case]:
    pool = list(DEFAULT_CASES + FULL_EXTRA_CASES) if (full or patterns) else list(DEFAULT_CASES)
    if not patterns:
        return pool
    chosen = [c for c in pool if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]
    if not chosen:
        raise ValueError(f"--cases {patterns} matches none of: {', '.join(ALL_CASES)}")
    return chosen


def run_matrix(cases: list[Case], providers: list[str], *, rounds: int, warmup: int, timed: int, tiny: bool,
               budget_s: float, diag: dict, name: str) -> list[Row]:
    """Every round runs every case and provider; after each run the CSV holds the runs so far (a command
    killed from outside still leaves its results; the final write adds the PNG)."""
    bank = WeightBank(tiny=tiny)
    runs = {(c.name, p): [] for c in cases for p in providers}
    skipped: dict = {}
    grpo_missing = grpo_available()
    t0 = time.perf_counter()
    for rnd in range(rounds):
        for case in cases:
            if case.task == "grpo" and grpo_missing:
                for p in providers:
                    skipped[(case.name, p)] = f"GRPOTrainer not importable ({grpo_missing})"
                continue
            for p in providers:
                done = runs[(case.name, p)]
                elapsed = time.perf_counter() - t0
                # this run's cost: its own last wall time, else the longest of the case's other providers'
                others = [r.wall_s for q in providers for r in runs[(case.name, q)][-1:]]
                expected = done[-1].wall_s if done else max(others, default=0.0)
                if elapsed + expected > budget_s:
                    skipped[(case.name, p)] = f"time budget {budget_s:.0f} s: {elapsed:.0f} s used"
                    continue
                done.append(run_one(case, p, bank, rnd=rnd, warmup=warmup, timed=timed, tiny=tiny, diag=diag))
                partial = [case_row(c, q, runs[(c.name, q)], rounds=rounds,
                                    skip_reason=skipped.get((c.name, q), "not run yet"))
                           for c in cases for q in providers]
                add_ratios(partial)
                write_partial(name, partial)
    print(f"bench_trainer: {sum(map(len, runs.values()))} runs in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = [case_row(c, p, runs[(c.name, p)], rounds=rounds, skip_reason=skipped.get((c.name, p), ""))
            for c in cases for p in providers]
    add_ratios(rows)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny models of each family, seq 64, 2 rounds")
    ap.add_argument("--full", action="store_true", help=f"every case ({len(ALL_CASES)}), 2 warm-up + 5 timed steps")
    ap.add_argument("--cases", nargs="+", default=None, help="case names or globs (from the full list)")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--providers", nargs="+", choices=PROVIDERS + tuple(OURS_VARIANTS)[1:], default=list(PROVIDERS))
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3; --tiny 2)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per run (default 1; --full 2)")
    ap.add_argument("--reentrant-checkpoint", action="store_true",
                    help="every provider with gradient_checkpointing_kwargs={'use_reentrant': True}")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run (default 3; --full 5; --tiny 1)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no run that would end past this many seconds (by its last wall time); default 450 "
                         "(--quick 240)")
    ap.add_argument("--quick", action="store_true",
                    help="2 rounds and a 240 s budget (fits gpu.sh's default 300 s limit)")
    ap.add_argument("--name", default=None, help="results name (default trainer_matrix; --tiny trainer_matrix_tiny)")
    ap.add_argument("--ours-chunk-tokens", type=int, default=None,
                    help="liger_chunk_tokens of our trainers (default: the engine's tile budget)")
    ap.add_argument("--torch-compile", default="", metavar="BACKEND",
                    help="every provider with torch_compile=True and this backend (inductor; aot_eager for --tiny); "
                         "the first step (compilation) is a warm-up step: give --warmup 2 or more")
    ap.add_argument("--profile", action="store_true", help="torch.profiler summary of two timed steps per run")
    ap.add_argument("--cprofile", action="store_true", help="cProfile of the timed steps per run")
    ap.add_argument("--syncs", action="store_true",
                    help="the Python stacks of every host-device synchronization of one timed step per run")
    ap.add_argument("--merge", nargs="+", default=None, metavar="CSV",
                    help="no runs: join these matrix CSVs (pieces of one matrix) into --name's CSV and PNG")
    ap.add_argument("--memory-peak", action="store_true",
                    help="allocator history over the timed steps: where their peak is, by source line (slower)")
    a = ap.parse_args(argv)
    if a.merge:
        rows = rows_from_csv(a.merge)
        add_ratios(rows)
        write_results(a.name or "trainer_matrix", rows)
        plot_matrix(a.name or "trainer_matrix", rows)
        return 0
    if a.profile and a.cprofile:
        # cProfile would time the torch profiler's own event processing, not the step's host work
        raise SystemExit("bench_trainer: use --profile or --cprofile, not both in one run")
    cases = pick_cases(a.cases, a.full)
    if a.list:
        for c in cases:
            print(f"{c.name:34s} {c.family:13s} {c.task:5s} {'lora' if c.lora else 'full'} "
                  f"{'fp32' if c.fp32_weights else 'bf16'} weights, {c.tokens_per_step} tokens/step")
        return 0
    rounds = a.rounds if a.rounds is not None else (2 if a.tiny or a.quick else 3)
    budget_s = a.budget_s if a.budget_s is not None else (240.0 if a.quick else 450.0)
    warmup = a.warmup if a.warmup is not None else (2 if a.full else 1)
    timed = a.steps if a.steps is not None else (1 if a.tiny else (5 if a.full else 3))
    if rounds < 1 or warmup < 1 or timed < 1:
        raise ValueError(f"--rounds, --warmup and --steps must be >= 1, got {rounds}, {warmup}, {timed}")
    if a.tiny:
        cases = [c.tiny() for c in cases]
        if not (os.environ.get("BENCH_OUT") or os.environ.get("OUT")):  # keep smoke results out of the repo
            os.environ["BENCH_OUT"] = tempfile.mkdtemp(prefix="bench_trainer_tiny_")
    elif not torch.cuda.is_available():
        print("bench_trainer: no CUDA device (use --tiny for a CPU smoke run)")
        return 0
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
    print(f"bench_trainer: {versions}; {len(cases)} cases x {len(a.providers)} providers x {rounds} rounds, "
          f"{warmup} warm-up + {timed} timed steps, budget {budget_s:.0f} s", flush=True)
    diag = dict(profile=a.profile, cprofile=a.cprofile, memory_peak=a.memory_peak, syncs=a.syncs,
                chunk_tokens=a.ours_chunk_tokens, torch_compile=a.torch_compile, reentrant=a.reentrant_checkpoint)
    name = a.name or ("trainer_matrix_tiny" if a.tiny else "trainer_matrix")
    rows = run_matrix(cases, a.providers, rounds=rounds, warmup=warmup, timed=timed, tiny=a.tiny,
                      budget_s=budget_s, diag=diag, name=name)
    path = write_results(name, rows)
    try:
        plot_matrix(name, rows)
    except Exception as exc:  # noqa: BLE001 - the plot is a convenience; the CSV is written
        print(f"(matrix plot skipped: {exc})")
    print()
    keys = ["case", "provider", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "rounds", "peak_mib",
            "step_peak_mib", "speed_vs_trl", "speed_vs_trl_liger", "step_peak_vs_trl", "train_loss", "sm_clock_mhz",
            "power_w", "wall_s", "card", "error"]
    print_table([{**r.extra, "case": r.case, "provider": r.provider, "peak_mib": round(r.peak_mib, 1),
                  "error": (r.error or "")[:60]} for r in rows], keys=keys)
    ours = [r.extra["speed_vs_trl"] for r in rows if r.provider == "ours" and r.extra["speed_vs_trl"] != ""]
    if ours:
        print(f"\nours / trl tokens/s: median {statistics.median(ours):.3f}, min {min(ours):.3f} "
              f"over {len(ours)} cases")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
