"""The first-step logits check (``trl_integration/logit_check.py``) on a model FSDP2 shards over 2 gloo ranks.

A sharded model's forward is a collective and its head's weight is whole only inside the head's call, so the
check runs the model's forward on every rank, computes the formula in the head's pre-forward hook and takes the
largest difference over the ranks. Here a tiny Llama and the width-scaled one of
``tests/trl_integration/test_logit_check.py`` (its hidden states divided by 4 before the head, nothing in its
config says so) are sharded with ``fully_shard`` in the layouts of ``test_fsdp2_causal_lm`` (``root``: head in the
root's group; ``tail``: accelerate's ``[norm, lm_head]`` group; ``head``: the head alone in a group), and the
check is called the way the trainers call it, inside the root's forward (``run_in_forward``), with a different
batch on each rank:

* the plain model checks equal on both ranks (fp32, the same GEMM: rel <= 1e-5), both ranks returning the same
  (largest) difference, and a training step after it still gives finite gradients on every parameter;
* the width-scaled model is refused with ``ValueError`` on both ranks (neither waits for the other);
* the SFT trainer under accelerate's FSDP2 (``examples/accelerate/fsdp2.yaml``) refuses the width-scaled model at
  its first step on both ranks.
"""

from __future__ import annotations

import os

import pytest

from tests.distributed.ranks import run_on_ranks, skip_unless_gloo_fsdp2

LAYOUTS = ("root", "tail", "head")


def _shard(model, layout: str) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    if layout == "tail":
        fully_shard(model.model.embed_tokens)
        fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False)
    elif layout == "head":
        fully_shard(model.lm_head)
    fully_shard(model)


def _check(model, ids):
    """The check as a trainer runs it: inside the root's forward. Returns the difference or the error's text."""
    from liger_losses.trl_integration.base import run_in_forward
    from liger_losses.trl_integration.logit_check import check_model_logits

    def fn():
        try:
            return check_model_logits(model, model, {"input_ids": ids}, softcap=None, logit_scale=1.0)
        except ValueError as exc:
            return f"ValueError: {exc}"

    return run_in_forward(model, fn)


def _worker(rank: int, world: int) -> dict:
    import torch

    from tests.trl_integration.test_logit_check import width_scaled
    from tests.trl_integration.utils import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(rank)
    ids = torch.randint(3, len(tok), (2, 16))
    out = {}
    for layout in LAYOUTS:
        plain = build_tiny_model(tok)
        _shard(plain, layout)
        out[("plain", layout)] = _check(plain, ids)
        loss = plain(input_ids=ids, labels=ids).loss  # the model still trains after the check's forward
        loss.backward()
        out[("grads", layout)] = all(p.grad is not None and bool(torch.isfinite(p.grad.full_tensor()).all())
                                     for p in plain.parameters())
        scaled = width_scaled(tok)
        _shard(scaled, layout)
        out[("scaled", layout)] = _check(scaled, ids)
    return out


@pytest.fixture(scope="module")
def results():
    skip_unless_gloo_fsdp2()
    return run_on_ranks(_worker)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_sharded_model_the_loss_serves_checks_equal_on_every_rank(results, layout):
    """Plain Llama, sharded: both ranks return the same difference, <= 1e-5 (fp32), and the model trains after."""
    diffs = [r[("plain", layout)] for r in results]
    assert all(isinstance(d, float) for d in diffs), diffs
    assert diffs[0] == diffs[1] and diffs[0] <= 1e-5, diffs
    assert all(r[("grads", layout)] for r in results)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_sharded_hidden_transform_is_refused_on_every_rank(results, layout):
    """Width-scaled Llama, sharded: a ValueError on both ranks, naming the class."""
    for r in results:
        got = r[("scaled", layout)]
        assert isinstance(got, str) and "WidthScaledLlama's own forward computes logits that differ" in got, got


def _trainer_worker(rank: int, world: int, run_dir: str, env: dict) -> str:
    from liger_losses.trl_integration import SFTTrainer
    from tests.distributed.accelerate_cpu import enable_fsdp_on_cpu
    from tests.trl_integration.test_logit_check import width_scaled
    from tests.trl_integration.utils import build_tokenizer, sft_config, sft_dataset

    os.environ.update(env)
    enable_fsdp_on_cpu()
    tok = build_tokenizer()
    trainer = SFTTrainer(width_scaled(tok), sft_config(os.path.join(run_dir, str(rank)), max_steps=1,
                                                       per_device_train_batch_size=2),
                         train_dataset=sft_dataset(), processing_class=tok, use_liger=True, liger_patch_model=False)
    try:
        trainer.train()
    except ValueError as exc:
        return str(exc)
    return "trained"


@pytest.mark.slow
def test_the_sft_trainer_under_fsdp2_refuses_a_hidden_transform_on_every_rank(tmp_path):
    """accelerate's FSDP2 setup, width-scaled Llama: the first step raises on both ranks (none hangs)."""
    skip_unless_gloo_fsdp2()
    pytest.importorskip("trl")
    from tests.distributed.accelerate_cpu import launcher_fsdp_env
    from tests.distributed.test_fsdp2_trainers import FSDP2_CONFIG

    env = launcher_fsdp_env(FSDP2_CONFIG)
    got = run_on_ranks(_trainer_worker, str(tmp_path), env, world=2, init_process_group=False, timeout=600)
    for message in got:
        assert "cannot serve model: WidthScaledLlama's own forward" in message, message
