"""SFT and DPO trainers (``use_liger=True``) under accelerate's FSDP2 on 2 gloo ranks.

Accelerate is driven as ``accelerate launch --config_file examples/accelerate/fsdp2.yaml`` drives it: the FSDP
environment its launcher derives from that file (``ACCELERATE_USE_FSDP=true``, ``FSDP_VERSION=2``,
``FSDP_AUTO_WRAP_POLICY=TRANSFORMER_BASED_WRAP``, ``FSDP_RESHARD_AFTER_FORWARD=true``, ...; computed by accelerate's
own ``prepare_multi_gpu_env``; the precision comes from each trainer config) plus the
``MASTER_ADDR``/``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` of each process (``tests.distributed.ranks``); accelerate
keeps FSDP for accelerator devices, so ``tests.distributed.accelerate_cpu`` lets its state take FSDP on CPU
processes as it does on GPUs. accelerate 1.15 then shards each decoder layer, the embedding, ``[final norm,
lm_head]`` as one group and the root; TRL shards DPO's reference model as one root group
(``trl.models.prepare_fsdp``).

Each trainer runs 3 optimizer steps on tiny Llamas (``liger_losses.demo``), global batch 4 (2 per rank), in
4 variants (:data:`VARIANTS`): ``fp32`` (untied head, a reference model for DPO); ``bf16-tied-ckpt`` (``bf16=True``:
accelerate's FSDP2 ``MixedPrecisionPolicy`` of bf16 parameters over fp32 ones, plus CPU autocast; the head tied to
the embedding; ``FSDP_ACTIVATION_CHECKPOINTING=true``); ``lora`` (DPO with a PEFT LoRA adapter and no reference
model: the reference is the policy with the adapter off); ``fp32-others`` (KTO with a reference model, ORPO, CPO,
GKD with a wider teacher; against TRL on 2 ranks only, every value TRL logs). Checked, for every step's loss,
grad_norm and every metric the trainer logs (SFT: entropy, mean_token_accuracy, num_tokens; DPO: rewards/*,
logps/*, logits/*, mean_token_accuracy, entropy):

* ours on 2 ranks equals ours in one process with batch 4 and no FSDP, and both ranks log the same values
  (``fp32`` and ``lora``);
* ours on 2 ranks equals TRL's own trainer (``use_liger=False``) on 2 ranks under the same FSDP2 setup (all).

Tolerances, relative per logged value (absolute where the value is below 1e-6): fp32 1e-4 -- the same fp32 math
in another order (per-rank sub-batches padded to their own length, the gradient summed over 2 ranks, our chunked
head against full logits) gives ~1e-6 on one step (tests/trl_integration's parity bar is the same 1e-4), and
Adam's first steps divide by sqrt(v), which magnifies that noise a little. bf16 3e-2 -- both trainers round the
head's logits and GEMM operands to bf16 (8 bits of mantissa, 4e-3 per rounding) in another order and tile
shape, over 3 steps. Absolute instead (:data:`BF16_ABSOLUTE`): logits/* are means of near-zero values (2e-3);
rewards/* are beta = 0.1 times a difference of two bf16 sequence log-probs near -12, whose bf16 spacing is
0.0625, so one rounding step on each side moves them by 0.1 * 2 * 0.0625 = 1.25e-2 (measured: <= 3e-3).
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from tests.distributed.ranks import run_on_ranks, skip_unless_gloo_fsdp2

STEPS = 3
GLOBAL_BATCH = 4

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FSDP2_CONFIG = os.path.join(REPO, "examples", "accelerate", "fsdp2.yaml")
# FSDP_TRANSFORMER_CLS_TO_WRAP: the config leaves it to the model's _no_split_modules, which is the same class
EXPECTED_FSDP2_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
}
NOT_METRICS = {"loss", "grad_norm", "learning_rate", "epoch", "step"}
# bf16: metrics compared absolutely (see the module docstring)
BF16_ABSOLUTE = {"logits/chosen": 2e-3, "logits/rejected": 2e-3, "rewards/chosen": 1.25e-2,
                 "rewards/rejected": 1.25e-2, "rewards/margins": 1.25e-2}
# what each trainer logs besides loss, grad_norm, learning_rate and epoch
METRICS = {
    "sft": ("entropy", "mean_token_accuracy", "num_tokens"),
    "dpo": ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected", "logits/chosen", "logits/rejected", "mean_token_accuracy", "entropy", "num_tokens"),
}


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    kinds: tuple
    bf16: bool = False
    tied: bool = False
    checkpointing: bool = False
    lora: bool = False
    single_process: bool = True  # also compared with one process (fp32 variants)

    @property
    def tol(self) -> float:
        return 3e-2 if self.bf16 else 1e-4


VARIANTS = [
    Variant("fp32", ("sft", "dpo")),
    Variant("bf16-tied-ckpt", ("sft", "dpo"), bf16=True, tied=True, checkpointing=True, single_process=False),
    Variant("lora", ("dpo",), lora=True),
    # the other trainers: against TRL's on 2 ranks only (their metrics are TRL's per-rank means, KTO's KL term a
    # per-rank batch statistic: neither equals one process with the global batch, for TRL either)
    Variant("fp32-others", ("kto", "orpo", "cpo", "gkd"), single_process=False),
]


def _model(tok, seed: int, tied: bool):
    from liger_losses.demo import build_tiny_model

    model = build_tiny_model(tok, seed=seed)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _trainer(kind: str, use_liger: bool, world: int, run_dir: str, variant: Variant, **overrides):
    """TRL's (``use_liger=False``) or our trainer of ``kind`` for ``variant``, global batch 4 over ``world``
    processes; ``overrides`` go to the trainer config."""
    from liger_losses.trl_integration import DPOTrainer, SFTTrainer
    from tests.trl_integration.utils import (
        PAIRS,
        build_tokenizer,
        dpo_config,
        lora_config,
        preference_dataset,
        sft_config,
        sft_dataset,
    )

    tok = build_tokenizer()
    cfg = dict(max_steps=STEPS, per_device_train_batch_size=GLOBAL_BATCH // world, learning_rate=3e-3,
               bf16=variant.bf16, **overrides)
    extra = {"use_liger": use_liger}
    if use_liger:
        extra.update(liger_patch_model=False, liger_chunk_tokens=5)  # tiles cut through sequences
    if variant.lora:
        extra["peft_config"] = lora_config()
    policy = _model(tok, 0, variant.tied)
    if kind == "sft":
        return SFTTrainer(policy, sft_config(run_dir, **cfg), train_dataset=sft_dataset(), processing_class=tok,
                          **extra)
    if kind in ("kto", "orpo", "cpo", "gkd"):
        return _more_trainer(kind, tok, policy, run_dir, cfg, extra)
    ref = None if variant.lora else _model(tok, 1, variant.tied)
    return DPOTrainer(policy, ref, dpo_config(run_dir, **cfg), train_dataset=preference_dataset(PAIRS),
                      processing_class=tok, **extra)


def _more_trainer(kind, tok, policy, run_dir, cfg, extra):
    """KTO (with a reference model), ORPO, CPO or GKD (a wider teacher) as the tests of tests/trl_integration
    build them."""
    from liger_losses.trl_integration import CPOTrainer, GKDTrainer, KTOTrainer, ORPOTrainer
    from tests.trl_integration.test_cpo import cpo_config
    from tests.trl_integration.test_gkd import chat_dataset, gkd_config
    from tests.trl_integration.test_kto import kto_config, unpaired_dataset
    from tests.trl_integration.test_orpo import orpo_config
    from tests.trl_integration.utils import PAIRS, build_tiny_model, preference_dataset

    if kind == "kto":
        return KTOTrainer(policy, _model(tok, 1, False), kto_config(run_dir, **cfg), train_dataset=unpaired_dataset(),
                          processing_class=tok, **extra)
    if kind == "gkd":
        teacher = build_tiny_model(tok, seed=1, hidden_size=96)
        return GKDTrainer(policy, teacher, gkd_config(run_dir, **cfg), train_dataset=chat_dataset(),
                          processing_class=tok, **extra)
    trainer_cls, config = (ORPOTrainer, orpo_config) if kind == "orpo" else (CPOTrainer, cpo_config)
    return trainer_cls(policy, config(run_dir, **cfg), train_dataset=preference_dataset(PAIRS), processing_class=tok,
                       **extra)


def _check_sharded(trainer, variant: Variant) -> None:
    """The model ``train()`` prepared is FSDP2's, the head in accelerate's ``[norm, (embed,) lm_head]`` group."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from liger_losses.trl_integration.base import unwrap_causal_lm

    assert isinstance(trainer.model_wrapped, FSDPModule), type(trainer.model_wrapped)
    causal_lm = unwrap_causal_lm(trainer.model_wrapped)
    assert isinstance(causal_lm.lm_head, FSDPModule)
    assert (causal_lm.lm_head.weight is causal_lm.model.embed_tokens.weight) == variant.tied
    ref = getattr(trainer, "ref_model", None)
    assert ref is None or isinstance(ref, FSDPModule)
    policy = trainer.accelerator.state.fsdp_plugin.mixed_precision_policy
    assert (policy is not None and policy.param_dtype == torch.bfloat16) == variant.bf16, policy


def step_logs(trainer) -> list:
    """``trainer.train()``, then the numbers of every step's log (the entries with a loss)."""
    trainer.train()
    return [{k: float(v) for k, v in h.items() if isinstance(v, (int, float))}
            for h in trainer.state.log_history if "loss" in h]


def _worker(rank: int, world: int, variant: Variant, runs, run_dir: str, env) -> dict:
    fsdp = env is not None
    if fsdp:
        from tests.distributed.accelerate_cpu import enable_fsdp_on_cpu

        os.environ.update(env)
        os.environ["FSDP_ACTIVATION_CHECKPOINTING"] = str(variant.checkpointing).lower()
        enable_fsdp_on_cpu()
    else:
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
    out = {}
    for kind, use_liger in runs:
        trainer = _trainer(kind, use_liger, world, os.path.join(run_dir, f"{kind}-{use_liger}-{rank}"), variant)
        out[(kind, use_liger)] = step_logs(trainer)
        if fsdp:
            _check_sharded(trainer, variant)
    return out


@pytest.fixture(scope="module")
def logs_of(tmp_path_factory):
    """``logs_of(variant) -> {"fsdp2": [rank 0's logs, rank 1's], "single": one process's or None}``, each
    ``{(kind, use_liger): [step logs]}``: one pair of processes runs the variant's FSDP2 trainings (ours and
    TRL's), one process ours without FSDP; computed once per variant."""
    skip_unless_gloo_fsdp2()
    pytest.importorskip("trl")
    from tests.distributed.accelerate_cpu import launcher_fsdp_env

    fsdp2_env = launcher_fsdp_env(FSDP2_CONFIG)
    assert EXPECTED_FSDP2_ENV.items() <= fsdp2_env.items(), fsdp2_env
    cache = {}

    def get(variant: Variant):
        if variant.lora:
            pytest.importorskip("peft")
        if variant.name not in cache:
            run_dir = str(tmp_path_factory.mktemp(f"fsdp2-{variant.name}"))
            runs = [(kind, use_liger) for kind in variant.kinds for use_liger in (True, False)]
            fsdp = run_on_ranks(_worker, variant, runs, run_dir, fsdp2_env, world=2, init_process_group=False,
                                timeout=600)
            single = None
            if variant.single_process:
                single = run_on_ranks(_worker, variant, [(k, True) for k in variant.kinds], run_dir, None,
                                      world=1, init_process_group=False, timeout=600)[0]
            cache[variant.name] = {"fsdp2": fsdp, "single": single}
        return cache[variant.name]

    return get


def _assert_logs_match(got, want, keys, variant: Variant, what):
    assert len(got) == len(want) == STEPS, (what, len(got), len(want))
    for step, (a, b) in enumerate(zip(got, want)):
        for key in keys:
            assert key in a and key in b, (what, step, key, sorted(a), sorted(b))
            if variant.bf16 and key in BF16_ABSOLUTE:
                err, tol = abs(a[key] - b[key]), BF16_ABSOLUTE[key]
            else:
                err = abs(a[key] - b[key]) if abs(b[key]) < 1e-6 else abs(a[key] - b[key]) / abs(b[key])
                tol = variant.tol
            assert err <= tol, (what, step, key, a[key], b[key], err)


ALL = [pytest.param(v, k, id=f"{v.name}-{k}") for v in VARIANTS for k in v.kinds]


@pytest.mark.parametrize("variant, kind", [p for p in ALL if p.values[0].single_process])
def test_two_ranks_equal_one_process(logs_of, variant, kind):
    """Ours on 2 FSDP2 ranks: every step's loss, grad_norm and metrics equal one process with the same global
    batch (fp32: rel 1e-4), and both ranks log the same values."""
    got = logs_of(variant)
    keys = ("loss", "grad_norm") + METRICS[kind]
    rank0, rank1 = got["fsdp2"]
    _assert_logs_match(rank0[(kind, True)], got["single"][(kind, True)], keys, variant, f"{kind}: 2 ranks vs 1")
    _assert_logs_match(rank1[(kind, True)], rank0[(kind, True)], keys, variant, f"{kind}: rank 1 vs rank 0")


@pytest.mark.parametrize("variant, kind", ALL)
def test_two_ranks_equal_trl_under_fsdp2(logs_of, variant, kind):
    """Ours and TRL's trainer, both on 2 FSDP2 ranks: every step's loss, grad_norm and metrics agree (fp32 rel
    1e-4, bf16 3e-2 and the absolute bars of BF16_ABSOLUTE; see the module docstring)."""
    rank0 = logs_of(variant)["fsdp2"][0]
    keys = ("loss", "grad_norm") + METRICS.get(kind, tuple(sorted(set(rank0[(kind, False)][0]) - NOT_METRICS)))
    _assert_logs_match(rank0[(kind, True)], rank0[(kind, False)], keys, variant, f"{kind}: ours vs TRL, 2 ranks")
