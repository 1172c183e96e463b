"""The first-step logits check (``trl_integration/logit_check.py``) on a model sharded over 2 gloo ranks.

A sharded model's forward is a collective and its head's weight is whole only inside the head's call, so the
check runs the model's forward on every rank, computes the formula in the head's pre-forward hook and takes the
largest difference over the ranks. Here a tiny Llama and the width-scaled one of
``tests/trl_integration/test_logit_check.py`` (its hidden states divided by 4 before the head, nothing in its
config says so) are sharded with FSDP2's ``fully_shard`` in the layouts of ``test_fsdp2_causal_lm`` (``root``: head
in the root's group; ``tail``: accelerate's ``[norm, lm_head]`` group; ``head``: the head alone in a group) and
with FSDP1 (``fsdp1``: each decoder layer a unit, the rest in the root's, ``use_orig_params=True`` as accelerate
sets it), and replicated under DDP (``ddp``: not sharded, but its ranks step together, so the verdict must be
theirs alike), and the check is called the way the trainers call it, inside the root's forward (``run_in_forward``),
with a different batch on each rank:

* the plain model checks equal on both ranks (fp32, the same GEMM: rel <= 1e-5), both ranks returning the same
  (largest) difference, and the training steps after the check give exactly the losses they give without it
  (the check's no-grad forward leaves no state behind in FSDP);
* the width-scaled model is refused with ``ValueError`` on both ranks (neither waits for the other), also where
  only rank 0's copy transforms its hidden states;
* a model with no wrapper, checked with ``distributed=True`` (as a trainer of several processes checks its
  reference), is refused on both ranks where only rank 0's copy transforms;
* a loss step run the trainers' way (``_liger_run``) gives the head the same gradient with the check as without
  (the check's forward calls a head that the trainer's call holds unsharded; FSDP2 reshards it on the way out,
  and the check gathers it again);
* a rank that fails to compute the formula makes every rank raise (the others see an infinite difference);
* the SFT trainer under accelerate's FSDP2 (``examples/accelerate/fsdp2.yaml``) refuses the width-scaled model at
  its first step on both ranks.
"""

from __future__ import annotations

import os

import pytest

from tests.distributed.ranks import run_on_ranks, skip_unless_gloo_fsdp2

LAYOUTS = ("root", "tail", "head", "fsdp1", "ddp")
STEPS = 3


def _shard(model, layout: str):
    """``model`` sharded (or, ``ddp``, replicated) in ``layout``; returns the module a trainer would hold (FSDP1,
    DDP: the wrapper)."""
    import functools

    import torch

    if layout == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if layout == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
        return FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=torch.device("cpu"),
                                        use_orig_params=True)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    if layout == "tail":
        fully_shard(model.model.embed_tokens)
        fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False)
    elif layout == "head":
        fully_shard(model.lm_head)
    fully_shard(model)
    return model


def _check(wrapped, ids, distributed=None):
    """The check as a trainer runs it: inside the root's forward. Returns the difference or the error's text."""
    from liger_losses.trl_integration.anatomy import innermost_module
    from liger_losses.trl_integration.base import run_in_forward
    from liger_losses.trl_integration.logit_check import check_model_logits

    def fn():
        try:
            return check_model_logits(wrapped, innermost_module(wrapped), {"input_ids": ids}, softcap=None,
                                      logit_scale=1.0, distributed=distributed)
        except ValueError as exc:
            return f"ValueError: {exc}"

    return run_in_forward(wrapped, fn)


def _train(wrapped, ids, *, check: bool):
    """(the check's result or None, the losses of STEPS SGD steps), the check run before the first."""
    import torch

    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    result, losses = None, []
    for step in range(STEPS):
        if check and step == 0:
            result = _check(wrapped, ids)
        loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return result, losses


def _trainer_path_head_grad(model, ids):
    """One loss step the way the trainers run it (``_liger_run``: the loss as the root's and, for an FSDP2 head of its
    own group, the head's forward, where the first step's check runs); the head's gradient, whole."""
    from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy
    from liger_losses.trl_integration.base import LigerTrainerMixin

    class Trainer(LigerTrainerMixin):
        pass

    trainer = Trainer()
    trainer.model = model

    def run():
        hidden = trainer._liger_backbone_hidden(model, {"input_ids": ids, "use_cache": False})[:, :-1]
        weight, bias = trainer._liger_head(model)
        return fused_linear_cross_entropy(weight, hidden, ids[:, 1:], bias=bias)

    trainer._liger_run(model, run).backward()
    grad = model.lm_head.weight.grad
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _worker(rank: int, world: int) -> dict:
    import torch

    from tests.trl_integration.test_logit_check import width_scaled
    from tests.trl_integration.utils import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(rank)
    ids = torch.randint(3, len(tok), (2, 16))
    out = {}
    for layout in LAYOUTS:
        out[("plain", layout)], out[("losses", layout)] = _train(_shard(build_tiny_model(tok), layout), ids,
                                                                 check=True)
        out[("unchecked", layout)] = _train(_shard(build_tiny_model(tok), layout), ids, check=False)[1]
        out[("scaled", layout)] = _check(_shard(width_scaled(tok), layout), ids)
        mixed = width_scaled(tok)
        mixed.width_ratio = 4.0 if rank == 0 else 1.0  # only rank 0's forward transforms
        out[("mixed", layout)] = _check(_shard(mixed, layout), ids)
    for layout in ("root", "tail", "head"):
        grads = []
        for check in ("1", "0"):
            os.environ["LIGER_LOSSES_CHECK_LOGITS"] = check
            grads.append(_trainer_path_head_grad(_shard(build_tiny_model(tok), layout), ids))
        os.environ.pop("LIGER_LOSSES_CHECK_LOGITS")
        out[("head grad", layout)] = bool(torch.equal(grads[0], grads[1]))
    out[("one rank fails", "ddp")] = _one_rank_fails(rank, tok, ids)
    mixed = width_scaled(tok)  # unwrapped, as TRL prepares a reference model under DDP
    mixed.width_ratio = 4.0 if rank == 0 else 1.0
    out[("mixed", "unwrapped")] = _check(mixed, ids)
    out[("mixed", "unwrapped, distributed")] = _check(mixed, ids, distributed=True)
    return out


def _one_rank_fails(rank: int, tok, ids) -> str:
    """The formula fails on rank 0 only (as an out-of-memory on its fp32 logits would), DDP: each rank's error."""
    import torch

    from liger_losses.trl_integration import logit_check
    from tests.trl_integration.utils import build_tiny_model

    real = logit_check.formula_logits

    def failing(*args, **kwargs):
        if rank == 0:
            raise RuntimeError("out of memory (injected on rank 0)")
        return real(*args, **kwargs)

    logit_check.formula_logits = failing
    try:
        got = _check(torch.nn.parallel.DistributedDataParallel(build_tiny_model(tok)), ids)
    except RuntimeError as exc:
        got = f"RuntimeError: {exc}"
    finally:
        logit_check.formula_logits = real
    return got


@pytest.fixture(scope="module")
def results():
    skip_unless_gloo_fsdp2()
    return run_on_ranks(_worker)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_sharded_model_the_loss_serves_checks_equal_on_every_rank(results, layout):
    """Plain Llama, sharded: both ranks return the same difference, <= 1e-5 (fp32), and the training steps after
    the check give exactly the losses of the same steps without it."""
    diffs = [r[("plain", layout)] for r in results]
    assert all(isinstance(d, float) for d in diffs), diffs
    assert diffs[0] == diffs[1] and diffs[0] <= 1e-5, diffs
    for r in results:  # the check's forward changes nothing the training computes after it
        assert r[("losses", layout)] == r[("unchecked", layout)], layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_sharded_hidden_transform_is_refused_on_every_rank(results, layout):
    """Width-scaled Llama, sharded: a ValueError on both ranks, naming the class; also where only rank 0's forward
    transforms (rank 1 alone would pass): the verdict is the ranks' largest difference."""
    for r in results:
        for case in ("scaled", "mixed"):
            got = r[(case, layout)]
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


def test_an_unwrapped_model_of_a_distributed_trainer_agrees_over_ranks(results):
    """A model with no distributed wrapper (TRL's reference under DDP) whose transform only rank 0's copy has:
    checked alone, only rank 0 raises (its wrappers say nothing of the other ranks); with ``distributed=True`` (what
    a trainer of several processes passes) both ranks raise."""
    alone = [r[("mixed", "unwrapped")] for r in results]
    assert isinstance(alone[0], str) and "differ" in alone[0] and isinstance(alone[1], float), alone
    for r in results:
        got = r[("mixed", "unwrapped, distributed")]
        assert isinstance(got, str) and "WidthScaledLlama's own forward computes logits that differ" in got, got


@pytest.mark.parametrize("layout", ("root", "tail", "head"))
def test_the_check_leaves_the_trainers_head_gradient_as_it_was(results, layout):
    """A loss step run the trainers' way (the head of its own FSDP2 group held unsharded by the trainer's call of it,
    which the check's forward calls again): the head's gradient with the check equals it without, exactly."""
    assert all(r[("head grad", layout)] for r in results)


def test_a_rank_that_fails_to_check_fails_every_rank(results):
    """The formula fails on rank 0 only: rank 0 raises its own error, rank 1 a RuntimeError saying another rank
    failed -- neither waits for the other."""
    rank0, rank1 = (r[("one rank fails", "ddp")] for r in results)
    assert rank0.startswith("RuntimeError: out of memory (injected on rank 0)"), rank0
    assert rank1.startswith("RuntimeError: use_liger=True's logits check of LlamaForCausalLM failed on another rank"), \
        rank1
    assert "which raised the error" in rank1, rank1
