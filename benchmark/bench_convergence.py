"""Numerics over a training run: loss, entropy and grad-norm curves of our trainers' default path (fp32
weight-gradient accumulation) against bf16 accumulation and against TRL's own trainer, on a learnable SFT and
DPO task (issue 18 item 3).

Question: does accumulating the LM head's weight gradient in the weight's dtype (bf16) across token chunks
bias a run (the reported symptom: entropy drifting lower) compared with accumulating it in fp32 (our default
since that answer: ``EngineConfig.half_weight_accum_dtype``), and does either differ from TRL's trainer by
more than run-to-run noise?

Task (``benchmark.trainer_data``): a hidden bigram rule over ``k = 1024`` active ids of a 128256-token
vocabulary (``next = rule[current]`` with probability 0.9, else a random active id). SFT: sequences walking
the rule (loss on every token; best reachable loss ~ 0.1 * ln 1024 + H(0.1) ~ 1.0 nats, entropy alike).
DPO: a rule-walking prompt (1/4 of the tokens), chosen = its continuation by the rule, rejected = random
active ids; a random-init policy learns to prefer the rule (reference = the initial weights).

Model: Llama-family, hidden 512, 4 layers, 8 heads / 4 KV heads, MLP 1536, vocab 128256, tied embeddings
(the head is most of the parameters, as in small real models), bf16 weights, ``bf16=True``, AdamW (fused),
lr 1e-3 (SFT) / 1e-4 (DPO, beta 0.1) with 10 warm-up steps then constant, grad clipping 1.0, 200 steps of
8 x 512 tokens (SFT) / 4 pairs x 512 (DPO), no gradient checkpointing. Our paths use
``liger_chunk_tokens=512`` (``--chunk-tokens``): 8 chunks per step, as many as the engine's default tile
makes at 16k tokens on a Llama-3-sized head, so the bf16 accumulation has as many roundings as in a real
step (the engine's own default would put this small step in one or two chunks and hide the effect).

Paths (``path`` column):
  ``ours``             ``liger_losses.trl_integration.<SFT|DPO>Trainer(use_liger=True)`` as shipped
                       (weight gradient accumulated in fp32 over the chunks, cast to bf16 once).
  ``ours-bf16-accum``  the same trainer under ``engine_config(half_weight_accum_dtype=None)``: the weight
                       gradient accumulated in the weight's dtype, bf16, rounded after every chunk (the
                       default before this benchmark's answer).
  ``trl``              ``trl.SFTTrainer`` / ``trl.DPOTrainer`` as shipped.
  ``ours-seed1``       ``ours`` with another data order (``data_seed=1``): the run-to-run noise to judge the
                       other differences against (``--no-noise-run`` drops it).

Outputs (``$BENCH_OUT`` / ``$OUT`` / benchmark/results/): ``convergence_curves.csv`` (task, path, step and
every metric TRL logs per step: loss, entropy, grad_norm, mean_token_accuracy / rewards/*),
``convergence_summary.csv`` (per task and path: the means of loss, entropy and grad_norm over the last
``--window`` steps (default 50) and their step-to-step standard deviation, each path's difference from
``ours`` beside the noise ``ours-seed1 - ours``, and a ``spread:...`` row per task: max - min of the means
over the compared paths beside ``|noise|``) and ``convergence.png`` (curves, smoothed over 10 steps). ``--tiny``: a CPU
smoke run (a 2-layer model of width 64, vocabulary 600, 12 steps of 2 x 64 tokens) writing ``convergence_tiny_*`` to a
temporary folder unless one of those variables is set.

GPU time (one H200, estimated): the step is host-bound (~4k tokens, ~80M parameters; the head GEMMs are
~3 ms): ~40-60 ms per step with per-step logging, 200 steps ~ 10-12 s per run plus ~5 s setup; 8 runs
~ 2-2.5 min.

    python -m benchmark.bench_convergence            # SFT + DPO x 4 paths, 200 steps each (~2.5 min)
    python -m benchmark.bench_convergence --tasks sft --steps 400
    python -m benchmark.bench_convergence --tiny     # CPU smoke run
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch

from benchmark import trainer_data as data
from benchmark.common import print_table, results_dir
from liger_losses.chunked.config import engine_config

PATHS = ("ours", "ours-bf16-accum", "trl", "ours-seed1")
# the engine knobs of our paths (every other path runs under the defaults)
ENGINE = {"ours-bf16-accum": dict(half_weight_accum_dtype=None)}
# ``--paths`` also takes ``<path>-seed1`` for any path (that path with data_seed=1): a second sample of
# each path, to tell a path's difference from run-to-run noise on both sides
SEED1 = "-seed1"
TASKS = ("sft", "dpo")
CURVE_KEYS = ("loss", "entropy", "grad_norm")

MODEL = dict(
    data.LLAMA_3_2_1B, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)


def _curve_callback():
    from transformers import TrainerCallback

    class Curves(TrainerCallback):
        """Every logged metric of every step (``logging_steps=1``)."""

        def __init__(self):
            self.rows: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.rows.append({"step": state.global_step, **{k: v for k, v in logs.items()
                                                                 if isinstance(v, (int, float))}})

    return Curves()


def batch_size(task: str, tiny: bool) -> int:
    """Sequences (SFT) or pairs (DPO) per step."""
    return 2 if tiny else (8 if task == "sft" else 4)


def make_dataset(task: str, *, steps: int, seq: int, tiny: bool, rule):
    n_rows = steps * batch_size(task, tiny)
    return (data.rule_sft_dataset if task == "sft" else data.rule_dpo_dataset)(n_rows, seq, rule, seed=1)


def make_args(task: str, path: str, *, steps: int, out_dir: str, tiny: bool):
    import trl

    kwargs = dict(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=batch_size(task, tiny),
        gradient_accumulation_steps=1, learning_rate=1e-3 if task == "sft" else 1e-4,
        lr_scheduler_type="constant_with_warmup", warmup_steps=min(10, steps // 4), max_grad_norm=1.0,
        bf16=True, optim="adamw_torch_fused", logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to="none", dataloader_num_workers=0, disable_tqdm=True, seed=0,
        data_seed=1 if path.endswith(SEED1) else 0, use_cpu=tiny,
    )
    if task == "sft":
        return trl.SFTConfig(max_length=4096, **kwargs)
    return trl.DPOConfig(max_length=4096, beta=0.1, **kwargs)


def run_path(task: str, path: str, dataset, *, steps: int, chunk_tokens, tiny: bool, shape) -> list[dict]:
    import trl
    from transformers.trainer_callback import PrinterCallback

    device = "cpu" if tiny else "cuda"
    label, path = path, path.removesuffix(SEED1)  # the behaviour of the base path, the name with its seed
    tokenizer = data.build_tokenizer(shape["vocab_size"])
    model = data.build_model(shape, device=device, dtype=torch.bfloat16, seed=0)
    ref_model = None
    if task == "dpo":
        ref_model = data.build_model(shape, device=device, dtype=torch.bfloat16, seed=0).eval().requires_grad_(False)
    curves = _curve_callback()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir:
        args = make_args(task, label, steps=steps, out_dir=out_dir, tiny=tiny)
        common = dict(args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[curves])
        liger = dict(use_liger=True, liger_chunk_tokens=chunk_tokens)
        from liger_losses.trl_integration import DPOTrainer, SFTTrainer

        if task == "sft":
            if path == "trl":
                trainer = trl.SFTTrainer(model, **common)
            else:
                trainer = SFTTrainer(model, **common, **liger)
        elif path == "trl":
            trainer = trl.DPOTrainer(model, ref_model, **common)
        else:
            trainer = DPOTrainer(model, ref_model, **common, **liger)
        trainer.remove_callback(PrinterCallback)  # the per-step log lines; the curves are the CSV
        with engine_config(**ENGINE.get(path, {})):
            trainer.train()
    del trainer, model, ref_model
    if not tiny:
        torch.cuda.empty_cache()
    rows = [{"task": task, "path": label, **r} for r in curves.rows]
    last = rows[-1] if rows else {}
    print(f"[{task} {label}] {len(rows)} steps in {time.perf_counter() - t0:.1f} s; last: "
          + ", ".join(f"{k} {last.get(k, float('nan')):.4g}" for k in CURVE_KEYS), flush=True)
    return rows


def summarize(curves: list[dict], window: int) -> list[dict]:
    """Per (task, path): means over the last ``window`` steps; differences from ``ours`` and the noise."""
    out = []
    for task in dict.fromkeys(r["task"] for r in curves):
        means = {}
        for path in dict.fromkeys(r["path"] for r in curves if r["task"] == task):
            rows = [r for r in curves if r["task"] == task and r["path"] == path][-window:]
            full = rows and all(k in r for r in rows for k in CURVE_KEYS)
            means[path] = {k: statistics.mean(r[k] for r in rows) if full else float("nan") for k in CURVE_KEYS}
            means[path].update({f"{k}_std": statistics.pstdev(r[k] for r in rows) if full else float("nan")
                                for k in CURVE_KEYS})
            means[path]["steps"] = max((r["step"] for r in rows), default=0)
        base = means.get("ours")
        noise = means.get("ours-seed1")
        for path, m in means.items():
            d = {"task": task, "path": path, "last_step": m["steps"], "window": window}
            for k in CURVE_KEYS:
                d[f"{k}_mean"] = round(m[k], 5)
                d[f"{k}_std"] = round(m[f"{k}_std"], 5)  # step-to-step spread inside the window
                d[f"{k}_minus_ours"] = round(m[k] - base[k], 5) if base else ""
                d[f"noise_{k}"] = round(noise[k] - base[k], 5) if base and noise else ""
            out.append(d)
        compared = [p for p in means if p != "ours-seed1"]
        if len(compared) > 1:  # the spread between the paths, beside the noise
            d = {"task": task, "path": "spread:" + "/".join(compared), "last_step": "", "window": window}
            for k in CURVE_KEYS:
                vals = [means[p][k] for p in compared]
                d[f"{k}_mean"] = round(max(vals) - min(vals), 5)
                d[f"noise_{k}"] = round(abs(noise[k] - base[k]), 5) if base and noise else ""
            out.append(d)
    return out


def write_csv(name: str, rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    path = os.path.join(results_dir(), f"{name}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return path


def plot_curves(name: str, curves: list[dict], smooth: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in curves))
    fig, axes = plt.subplots(len(tasks), len(CURVE_KEYS), figsize=(14, 3.8 * len(tasks)), squeeze=False)
    for i, task in enumerate(tasks):
        for j, key in enumerate(CURVE_KEYS):
            ax = axes[i][j]
            for path in dict.fromkeys(r["path"] for r in curves):
                pts = [(r["step"], r[key]) for r in curves if r["task"] == task and r["path"] == path and key in r]
                if not pts:
                    continue
                ys = [y for _, y in pts]
                sm = [statistics.mean(ys[max(0, t - smooth + 1):t + 1]) for t in range(len(ys))]
                ax.plot([x for x, _ in pts], sm, label=path, lw=1.2)
            ax.set_title(f"{task}: {key} (mean of {smooth} steps)", fontsize=9)
            ax.set_xlabel("step")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(results_dir(), f"{name}.png"), dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, 12 steps of 2 x 64 tokens")
    ap.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    ap.add_argument("--paths", nargs="+", choices=PATHS + tuple(p + SEED1 for p in PATHS[:3]), default=None,
                    help="default: all (see --no-noise-run); <path>-seed1: that path with data_seed=1")
    ap.add_argument("--no-noise-run", action="store_true", help="drop the ours-seed1 run")
    ap.add_argument("--quick", action="store_true", help="the same without the noise run (6 runs, ~1.7 min)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 200; --tiny 12)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 512; --tiny 64)")
    ap.add_argument("--chunk-tokens", type=int, default=None,
                    help="liger_chunk_tokens of our paths (default 512; --tiny 32; 0: the engine's default)")
    ap.add_argument("--window", type=int, default=None, help="final window of the summary (default steps // 4)")
    a = ap.parse_args(argv)
    tiny = a.tiny
    steps = a.steps or (12 if tiny else 200)
    seq = a.seq or (64 if tiny else 512)
    chunk = a.chunk_tokens if a.chunk_tokens is not None else (32 if tiny else 512)
    chunk = chunk or None
    window = a.window or max(1, steps // 4)
    paths = a.paths or [p for p in PATHS if not ((a.no_noise_run or a.quick) and p == "ours-seed1")]
    if steps < 2 or seq < 8:
        raise ValueError(f"--steps must be >= 2 and --seq >= 8, got {steps} and {seq}")
    if tiny:
        shape = dict(data.TINY)
        rule = data.BigramRule(shape["vocab_size"], k=64, noise=0.1)
        if not (os.environ.get("BENCH_OUT") or os.environ.get("OUT")):
            os.environ["BENCH_OUT"] = tempfile.mkdtemp(prefix="bench_convergence_tiny_")
    else:
        if not torch.cuda.is_available():
            print("bench_convergence: no CUDA device (use --tiny for a CPU smoke run)")
            return 0
        shape = MODEL
        rule = data.BigramRule(shape["vocab_size"], k=1024, noise=0.1)
    import datasets

    datasets.disable_progress_bars()
    print(f"bench_convergence: tasks {a.tasks}, paths {paths}, {steps} steps, seq {seq}, chunk_tokens {chunk}, "
          f"window {window}", flush=True)
    curves, errors = [], []
    for task in a.tasks:
        dataset = make_dataset(task, steps=steps, seq=seq, tiny=tiny, rule=rule)  # one for every path
        for path in paths:
            try:
                curves += run_path(task, path, dataset, steps=steps, chunk_tokens=chunk, tiny=tiny, shape=shape)
            except Exception as exc:  # noqa: BLE001 - one failing path must not lose the others' curves
                traceback.print_exc()
                errors.append(f"{task} {path}: {type(exc).__name__}: {exc}"[:300])
    prefix = "convergence_tiny" if tiny else "convergence"
    if not curves:
        print("bench_convergence: no run finished;", errors)
        return 1
    curves_path = write_csv(f"{prefix}_curves", curves)
    summary = summarize(curves, window)
    write_csv(f"{prefix}_summary", summary)
    try:
        plot_curves(prefix, curves)
    except Exception as exc:  # noqa: BLE001 - the plot is a convenience
        print(f"(plot skipped: {exc})")
    print()
    keys = ["task", "path", "last_step"] + [f"{k}_{s}" for k in CURVE_KEYS for s in ("mean", "std", "minus_ours")] + \
        [f"noise_{k}" for k in CURVE_KEYS]
    print_table(summary, keys=keys)
    for e in errors:
        print("ERROR", e)
    nonfinite = [r for r in curves if any(not math.isfinite(r.get(k, 0.0)) for k in CURVE_KEYS)]
    if nonfinite:
        print(f"WARNING: {len(nonfinite)} logged steps with a non-finite loss/entropy/grad_norm")
    print(f"results: {curves_path} (+ {prefix}_summary.csv, {prefix}.png)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
