"""SFT and DPO trainers (``use_liger=True``) under accelerate's DeepSpeed ZeRO-3 and ZeRO-2 on 2 gloo ranks.

Accelerate is driven as ``accelerate launch --config_file examples/accelerate/zero3.yaml`` (or ``zero2.yaml``)
drives it: the ``ACCELERATE_*`` environment its launcher derives from the file (``ACCELERATE_USE_DEEPSPEED``,
``ACCELERATE_DEEPSPEED_ZERO_STAGE``, ...; ``tests.distributed.accelerate_cpu.launcher_deepspeed_env``), the
precision set to fp32 for the comparisons, plus each process's ranks. DeepSpeed runs on its CPU accelerator
(``DS_ACCELERATOR=cpu``), and ``accelerate_cpu.enable_deepspeed_on_cpu`` lets accelerate pick gloo there. TRL
prepares DPO's reference model for ZeRO-3 itself (``trl.models.prepare_deepspeed``). Skipped where ``deepspeed``
is not importable.

Each trainer runs 3 steps on the fp32 tiny Llamas of ``test_fsdp2_trainers`` (global batch 4, 2 per rank); every
step's loss, grad_norm and metric must equal ours in one process (no DeepSpeed) and TRL's trainer under the same
DeepSpeed setup, to relative 1e-4 (the reasons are those of ``test_fsdp2_trainers``: the same fp32 math in another
order, ~1e-6 a step). Under ZeRO-3 the policy's head is partitioned; the loss reads it inside the engine's forward,
where DeepSpeed gathers it (and again for the backward).

With activation checkpointing (TRL's default form) under ZeRO-1 and ZeRO-2, ours runs the policy's layers in the
lean (reentrant) form (``trl_integration/checkpointing.py``), whose backward fires each parameter's gradient hook --
where those stages reduce the gradient -- once, as torch's form does: every step equals TRL's (torch's form) under
the same setup, to the same 1e-4, on both ranks.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.distributed.ranks import run_on_ranks, skip_unless_gloo_fsdp2
from tests.distributed.test_fsdp2_trainers import METRICS, REPO, VARIANTS, _assert_logs_match, _trainer, step_logs

FP32 = VARIANTS[0]
CONFIGS = {3: "zero3.yaml", 2: "zero2.yaml"}


def _partition_every_parameter() -> None:
    """ZeRO-3 keeps parameters below ``stage3_param_persistence_threshold`` whole (transformers sets it to 10 x the
    hidden size), which would keep the tiny models' head whole; 0 partitions it, as a real model's head is."""
    from accelerate.utils import DeepSpeedPlugin

    original = DeepSpeedPlugin.__post_init__

    def post_init(self):
        original(self)
        self.deepspeed_config.setdefault("zero_optimization", {})["stage3_param_persistence_threshold"] = 0

    DeepSpeedPlugin.__post_init__ = post_init


def _worker(rank: int, world: int, stage: int, runs, run_dir: str, env) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    distributed = env is not None
    if distributed:
        from tests.distributed.accelerate_cpu import enable_deepspeed_on_cpu

        os.environ.update(env)
        enable_deepspeed_on_cpu()
        _partition_every_parameter()
    else:
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
    out = {}
    for kind, use_liger in runs:
        overrides = {"use_cpu": False} if distributed else {}
        trainer = _trainer(kind, use_liger, world, os.path.join(run_dir, f"{stage}-{kind}-{use_liger}-{rank}"), FP32,
                           **overrides)
        out[(kind, use_liger)] = step_logs(trainer)
        if distributed:
            from deepspeed import DeepSpeedEngine

            assert isinstance(trainer.model_wrapped, DeepSpeedEngine), type(trainer.model_wrapped)
            assert trainer.accelerator.state.deepspeed_plugin.zero_stage == stage
            if stage == 3:  # the head is partitioned between steps
                assert trainer.model_wrapped.module.lm_head.weight.numel() == 0
    return out


@pytest.fixture(scope="module")
def logs_of(tmp_path_factory):
    """``logs_of(stage) -> {"deepspeed": [rank 0's logs, rank 1's], "single": one process's}``."""
    skip_unless_gloo_fsdp2()
    pytest.importorskip("trl")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not importable")
    from tests.distributed.accelerate_cpu import launcher_deepspeed_env

    run_dir = str(tmp_path_factory.mktemp("deepspeed"))
    single = run_on_ranks(_worker, 0, [(k, True) for k in FP32.kinds], run_dir, None, world=1,
                          init_process_group=False, timeout=600)[0]
    cache = {}

    def get(stage: int):
        if stage not in cache:
            env = launcher_deepspeed_env(os.path.join(REPO, "examples", "accelerate", CONFIGS[stage]))
            assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == str(stage)
            env["ACCELERATE_MIXED_PRECISION"] = "no"  # fp32, for the comparisons
            runs = [(kind, use_liger) for kind in FP32.kinds for use_liger in (True, False)]
            cache[stage] = {"deepspeed": run_on_ranks(_worker, stage, runs, run_dir, env, world=2,
                                                      init_process_group=False, timeout=600), "single": single}
        return cache[stage]

    return get


@pytest.mark.parametrize("stage", [3, 2])
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_deepspeed_two_ranks_equal_one_process_and_trl(logs_of, stage, kind):
    """Ours on 2 DeepSpeed ranks: every step's loss, grad_norm and metrics equal one process with the same global
    batch and TRL's trainer under the same DeepSpeed setup (rel 1e-4); both ranks log the same values."""
    got = logs_of(stage)
    keys = ("loss", "grad_norm") + METRICS[kind]
    rank0, rank1 = got["deepspeed"]
    _assert_logs_match(rank0[(kind, True)], got["single"][(kind, True)], keys, FP32, f"ZeRO-{stage} {kind}: vs 1")
    _assert_logs_match(rank0[(kind, True)], rank0[(kind, False)], keys, FP32, f"ZeRO-{stage} {kind}: vs TRL")
    _assert_logs_match(rank1[(kind, True)], rank0[(kind, True)], keys, FP32, f"ZeRO-{stage} {kind}: rank 1")


def _checkpointing_worker(rank: int, world: int, env) -> dict:
    """Ours and TRL's SFT and DPO with activation checkpointing under the DeepSpeed setup of ``env``; ours' count of
    layer calls taken in the lean form."""
    from liger_losses.trl_integration import checkpointing as ck
    from tests.distributed.accelerate_cpu import enable_deepspeed_on_cpu

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(env)
    enable_deepspeed_on_cpu()
    lean = [0]
    decide = ck.reentrant_is_equivalent

    def counted(layer, function, args):
        out = decide(layer, function, args)
        lean[0] += out
        return out

    ck.reentrant_is_equivalent = counted
    out = {}
    run_dir = env["RUN_DIR"]
    for kind in FP32.kinds:
        for use_liger in (True, False):
            trainer = _trainer(kind, use_liger, world, os.path.join(run_dir, f"ckpt-{kind}-{use_liger}-{rank}"), FP32,
                               use_cpu=False, gradient_checkpointing=True,
                               gradient_accumulation_steps=int(env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"]))
            out[(kind, use_liger)] = step_logs(trainer)
            out[(kind, use_liger, "engine")] = (trainer.model_wrapped.zero_optimization_stage(),
                                                trainer.model_wrapped.gradient_accumulation_steps())
        out[(kind, "lean")] = lean[0]
        lean[0] = 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage, accumulation", [(1, 1), (2, 1), (2, 2)])
def test_lean_checkpointing_under_zero_1_and_2_equals_trl(tmp_path, stage, accumulation):
    """ZeRO-1 / ZeRO-2 with checkpointing (ZeRO-2 also accumulating gradients over 2 micro-batches, which its hooks
    keep in its partitions between them): ours takes the lean form in the policy's layers and every step's loss,
    grad_norm and metrics equal TRL's (rel 1e-4), on both ranks."""
    skip_unless_gloo_fsdp2()
    pytest.importorskip("trl")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not importable")
    from tests.distributed.accelerate_cpu import launcher_deepspeed_env

    env = launcher_deepspeed_env(os.path.join(REPO, "examples", "accelerate", "zero2.yaml"))
    env.update(ACCELERATE_MIXED_PRECISION="no", ACCELERATE_DEEPSPEED_ZERO_STAGE=str(stage), RUN_DIR=str(tmp_path),
               ACCELERATE_GRADIENT_ACCUMULATION_STEPS=str(accumulation))
    ranks = run_on_ranks(_checkpointing_worker, env, world=2, init_process_group=False, timeout=600)
    for rank, got in enumerate(ranks):
        for kind in FP32.kinds:
            assert got[(kind, True, "engine")] == got[(kind, False, "engine")] == (stage, accumulation)
            assert got[(kind, "lean")] > 0, (rank, kind)
            keys = ("loss", "grad_norm") + METRICS[kind]
            what = f"ZeRO-{stage} {kind} with checkpointing, rank {rank}: ours vs TRL"
            _assert_logs_match(got[(kind, True)], got[(kind, False)], keys, FP32, what)
