"""SFT and DPO trainers (``use_liger=True``) under accelerate's FSDP2 on 2 gloo ranks.

Accelerate is driven as ``accelerate launch --use_fsdp --fsdp_version 2`` drives it: the environment its
launcher sets (``ACCELERATE_USE_FSDP=true``, ``FSDP_VERSION=2``, ``FSDP_AUTO_WRAP_POLICY=TRANSFORMER_BASED_WRAP``
over ``LlamaDecoderLayer``, ``FSDP_RESHARD_AFTER_FORWARD=true``, ``FSDP_STATE_DICT_TYPE=SHARDED_STATE_DICT``) plus
the ``MASTER_ADDR``/``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` of each process (``tests.distributed.ranks``); accelerate
keeps FSDP for accelerator devices, so ``tests.distributed.accelerate_cpu`` lets its state take FSDP on CPU
processes as it does on GPUs. accelerate
1.15 then shards each decoder layer, the embedding, ``[final norm, lm_head]`` as one group and the root; TRL
shards DPO's reference model as one root group (``trl.models.prepare_fsdp``).

Each trainer runs 3 optimizer steps on tiny fp32 Llamas (``liger_losses.demo``), global batch 4 (2 per rank):
* ours on 2 ranks equals ours in one process with batch 4 and no FSDP -- every logged value of every step
  (loss, grad_norm and the trainer's metrics: SFT's entropy / mean_token_accuracy / num_tokens, DPO's
  rewards / logps / logits);
* ours on 2 ranks equals TRL's own trainer (``use_liger=False``) on 2 ranks under the same FSDP2 setup.
Tolerance: relative 1e-4 per logged value (absolute where the value is below 1e-6). The same fp32 math runs
in another order -- per-rank sub-batches padded to their own length, the gradient summed over 2 ranks, our
chunked head against full logits -- which gives ~1e-6 on one step (tests/trl_integration's parity bar is the
same 1e-4); Adam's first steps divide by sqrt(v), which magnifies that noise a little on later steps.
"""

from __future__ import annotations

import os

import pytest

from tests.distributed.ranks import run_on_ranks, skip_unless_gloo_fsdp2

TOL = 1e-4
STEPS = 3
GLOBAL_BATCH = 4

FSDP2_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
}
# how the Trainer's logs name what each trainer logs (besides loss, grad_norm, learning_rate, epoch)
METRICS = {
    "sft": ("entropy", "mean_token_accuracy", "num_tokens"),
    "dpo": ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected", "logits/chosen", "logits/rejected"),
}


def _trainer(kind: str, use_liger: bool, world: int, run_dir: str):
    from liger_losses.trl_integration import DPOTrainer, SFTTrainer
    from tests.trl_integration.utils import (
        PAIRS,
        build_tiny_model,
        build_tokenizer,
        dpo_config,
        preference_dataset,
        sft_config,
        sft_dataset,
    )

    tok = build_tokenizer()
    cfg = dict(max_steps=STEPS, per_device_train_batch_size=GLOBAL_BATCH // world, learning_rate=3e-3)
    extra = {"use_liger": use_liger}
    if use_liger:
        extra.update(liger_patch_model=False, liger_chunk_tokens=5)  # tiles cut through sequences
    if kind == "sft":
        return SFTTrainer(build_tiny_model(tok, seed=0), sft_config(run_dir, **cfg), train_dataset=sft_dataset(),
                          processing_class=tok, **extra)
    return DPOTrainer(build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=1), dpo_config(run_dir, **cfg),
                      train_dataset=preference_dataset(PAIRS), processing_class=tok, **extra)


def _logs(trainer) -> list:
    trainer.train()
    return [{k: float(v) for k, v in h.items() if isinstance(v, (int, float))}
            for h in trainer.state.log_history if "loss" in h]


def _worker(rank: int, world: int, runs, run_dir: str, fsdp: bool) -> dict:
    if fsdp:
        from tests.distributed.accelerate_cpu import enable_fsdp_on_cpu

        os.environ.update(FSDP2_ENV)
        enable_fsdp_on_cpu()
    else:
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
    out = {}
    for kind, use_liger in runs:
        trainer = _trainer(kind, use_liger, world, os.path.join(run_dir, f"{kind}-{use_liger}-{rank}"))
        out[(kind, use_liger)] = _logs(trainer)
        if fsdp:  # the model train() prepared is FSDP2's, its head in accelerate's [norm, lm_head] group
            from torch.distributed.fsdp import FSDPModule

            assert isinstance(trainer.model_wrapped, FSDPModule), type(trainer.model_wrapped)
            assert isinstance(trainer.model_wrapped.lm_head, FSDPModule)
            ref = getattr(trainer, "ref_model", None)
            assert ref is None or isinstance(ref, FSDPModule)
    return out


RUNS = [("sft", True), ("sft", False), ("dpo", True), ("dpo", False)]


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """``{"fsdp2": [rank 0's logs, rank 1's], "single": logs of one process}``, each ``{(kind, use_liger): [step
    logs]}``; one pair of processes runs the four FSDP2 trainings, one process the single-process ones."""
    skip_unless_gloo_fsdp2()
    pytest.importorskip("trl")
    run_dir = str(tmp_path_factory.mktemp("fsdp2_trainers"))
    fsdp = run_on_ranks(_worker, RUNS, run_dir, True, world=2, init_process_group=False, timeout=600)
    single = run_on_ranks(_worker, [r for r in RUNS if r[1]], run_dir, False, world=1, init_process_group=False,
                          timeout=600)[0]
    return {"fsdp2": fsdp, "single": single}


def _assert_logs_match(got, want, keys, what):
    assert len(got) == len(want) == STEPS, (what, len(got), len(want))
    for step, (a, b) in enumerate(zip(got, want)):
        for key in keys:
            assert key in a and key in b, (what, step, key, sorted(a), sorted(b))
            err = abs(a[key] - b[key]) if abs(b[key]) < 1e-6 else abs(a[key] - b[key]) / abs(b[key])
            assert err <= TOL, (what, step, key, a[key], b[key], err)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_two_ranks_equal_one_process(logs, kind):
    """Ours on 2 FSDP2 ranks: every step's loss, grad_norm and metrics equal one process with the same global
    batch (rel 1e-4), and both ranks log the same values."""
    keys = ("loss", "grad_norm") + METRICS[kind]
    rank0, rank1 = logs["fsdp2"]
    _assert_logs_match(rank0[(kind, True)], logs["single"][(kind, True)], keys, f"{kind}: 2 ranks vs 1 process")
    _assert_logs_match(rank1[(kind, True)], rank0[(kind, True)], keys, f"{kind}: rank 1 vs rank 0")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_two_ranks_equal_trl_under_fsdp2(logs, kind):
    """Ours and TRL's trainer, both on 2 FSDP2 ranks: every step's loss, grad_norm and metrics agree (rel 1e-4)."""
    keys = ("loss", "grad_norm") + METRICS[kind]
    rank0 = logs["fsdp2"][0]
    _assert_logs_match(rank0[(kind, True)], rank0[(kind, False)], keys, f"{kind}: ours vs TRL on 2 ranks")
