"""The fused head under DeepSpeed ZeRO-3, on 2 gloo ranks: gathered for the loss, its gradient reduced by DeepSpeed.

ZeRO-3 gathers a module's parameters in its forward hook, and the fused losses read ``lm_head.weight`` without
calling the head. What makes it work: inside the engine's forward, DeepSpeed gathers a partitioned parameter that
is read as a module attribute and registers it with the running module, which gathers it again when the backward
reaches that module's outputs; the loss runs inside the forward (the patched causal LM by construction, the TRL
adapters through ``_liger_run``), returns the head's full-shaped gradient for the parameter itself, and autograd's
accumulator -- where ZeRO-3 hooks its reduction -- gets it. A head read outside any forward (a reference model's,
under no_grad) is gathered by ``trl_integration.base.gathered_params``, which gathers only what is partitioned
(DeepSpeed refuses nested gathers of one parameter).

Two ways, each on 2 gloo ranks with every rank on its own batch, against one process that runs both batches
unsharded and averages (ZeRO's reduction is the mean over ranks), to relative 1e-5 (fp32; measured ~1e-7):

* the stand-in (``tests.distributed.zero3_standin``, always run), which reproduces those mechanisms (partitioned
  rows, in-forward gathering and the backward's re-gather, ``GatheredParameters``, the reducing hook on the
  gradient accumulator). Cases: the patched causal LM (one-pass), the adapters' way (``run_in_forward`` with the
  recomputing ``fused_linear_token_logprobs``: its backward reads the weight again), and a no-grad reference read
  through ``gathered_params``. Checked too: the hook fires once per backward with the full ``[V, H]`` gradient,
  how many gathers ran, and that the head is partitioned again after.
* real DeepSpeed (``deepspeed.initialize`` with ZeRO stage 3 on the CPU accelerator, ``DS_ACCELERATOR=cpu``;
  skipped where ``deepspeed`` is not importable): the patched causal LM with untied and tied heads and the
  adapters' recomputing way; each parameter's full gradient is read back with ``deepspeed.utils.safe_get_full_grad``.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.distributed.ranks import run_on_ranks

TOL = 1e-5


def _model_and_batches(world: int, tied: bool):
    import torch

    from liger_losses.patching import apply_liger_kernels
    from tests.patching.tiny_models import tiny_batch, tiny_model

    torch.manual_seed(0)
    model = tiny_model("llama", tie_word_embeddings=tied)
    apply_liger_kernels(model)
    torch.manual_seed(1)
    return model, [tiny_batch(model.config, batch=2, seq=8) for _ in range(world)]


def _loss(model, batch, kind: str):
    """The patched model's loss (``model(**batch)``: the loss reads the head inside the forward), or the adapters'
    way (``"recomputed_logps"``): backbone and loss run as the model's forward (``run_in_forward``), the head read
    there and passed through ``gathered_params``, the loss the mean of the recomputing per-token log-probs."""
    if kind == "patched_ce":
        out = model(**batch)
        assert out.logits is None  # the fused path ran
        return out.loss
    from liger_losses.chunked.token_logprobs import fused_linear_token_logprobs
    from liger_losses.trl_integration.base import gathered_params, innermost_module, run_in_forward

    labels = batch["labels"][:, 1:]
    inner = innermost_module(model)

    def fn():
        hidden = inner.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        weight = inner.lm_head.weight
        with gathered_params(weight):
            logps = fused_linear_token_logprobs(weight, hidden[:, :-1], labels, ignore_index=-100)
        return logps.sum() / (labels != -100).sum()

    return run_in_forward(model, fn)


def _no_grad_logps(model, batch):
    """A reference model's way: the head read outside any forward, under no_grad, gathered by ``gathered_params``."""
    import torch

    from liger_losses.chunked.token_logprobs import fused_linear_token_logprobs
    from liger_losses.trl_integration.base import gathered_params

    labels = batch["labels"][:, 1:]
    with torch.no_grad():
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        weight = model.lm_head.weight
        with gathered_params(weight):
            return fused_linear_token_logprobs(weight, hidden[:, :-1], labels, ignore_index=-100)


def _reference(model, batches, kind: str):
    import copy

    ref = copy.deepcopy(model)
    total, grads = 0.0, {}
    for batch in batches:
        ref.zero_grad(set_to_none=True)
        loss = _loss(ref, batch, kind)
        loss.backward()
        total += float(loss.detach())
        for n, p in ref.named_parameters():
            grads[n] = grads.get(n, 0) + p.grad / len(batches)
    return total / len(batches), grads


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _standin_worker(rank: int, world: int, kinds) -> dict:
    import copy

    import torch.distributed as dist

    import liger_losses.trl_integration.base  # noqa: F401 - imports trl/transformers before the stand-in
    from tests.distributed import zero3_standin

    out = {}
    for kind in kinds:
        model, batches = _model_and_batches(world, tied=False)
        zero3_standin.install()  # after transformers/trl are imported: they probe for a real deepspeed
        sharded = copy.deepcopy(model)
        head = sharded.lm_head.weight
        zero3_standin.partition(head, sharded.lm_head, sharded, rank, world)
        if kind == "no_grad_logps":
            logps = _rel(_no_grad_logps(sharded, batches[rank]), _no_grad_logps(model, batches[rank]))
            out[kind] = {"logps": logps, "calls": dict(head.ds_calls), "after": (head.ds_status.name, head.numel())}
            continue
        ref_loss, ref_grads = _reference(model, batches, kind)
        loss = _loss(sharded, batches[rank], kind)
        after_forward = (head.ds_status.name, head.numel())
        loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        for n, p in sharded.named_parameters():  # the replicated parameters: averaged as DDP would
            if p is not head:
                dist.all_reduce(p.grad)
        rows = head.ds_shape[0] // world
        out[kind] = {
            "loss": abs(float(mean_loss) / world - ref_loss) / abs(ref_loss),
            "head_rows": _rel(head.ds_grad_rows, ref_grads["lm_head.weight"][rank * rows:(rank + 1) * rows]),
            "others": max(_rel(p.grad / world, ref_grads[n]) for n, p in sharded.named_parameters() if p is not head),
            "calls": dict(head.ds_calls),
            "after_forward": after_forward,
            "after_backward": (head.ds_status.name, head.numel(), head.grad is None),
        }
    return out


@pytest.fixture(scope="module")
def standin():
    from tests.distributed.ranks import skip_unless_gloo_fsdp2

    skip_unless_gloo_fsdp2()
    return run_on_ranks(_standin_worker, ["patched_ce", "recomputed_logps", "no_grad_logps"])


@pytest.mark.parametrize("kind", ["patched_ce", "recomputed_logps"])
def test_standin_zero3_head_gathered_and_reduced(standin, kind):
    """Loss, the head's reduced gradient rows and the other gradients equal one process (rel 1e-5) on both ranks;
    the hook fired once with the full gradient and removed it; the head was gathered twice (read in the forward,
    again for the backward) and is partitioned after the forward and after the backward."""
    for rank, results in enumerate(standin):
        got = results[kind]
        assert got["loss"] <= TOL, (rank, got)
        assert got["head_rows"] <= TOL, (rank, got)
        assert got["others"] <= TOL, (rank, got)
        assert got["calls"] == {"gather": 2, "grad_hook": 1}, (rank, got)
        assert got["after_forward"] == ("NOT_AVAILABLE", 0), (rank, got)
        assert got["after_backward"] == ("NOT_AVAILABLE", 0, True), (rank, got)


def test_standin_zero3_head_read_outside_forward(standin):
    """A partitioned head read outside any forward under no_grad (a reference model's), gathered by
    ``gathered_params``: the log-probs equal the unsharded model's (rel 1e-5); one gather, and the head is
    partitioned after."""
    for rank, results in enumerate(standin):
        got = results["no_grad_logps"]
        assert got["logps"] <= TOL, (rank, got)
        assert got["calls"] == {"gather": 1, "grad_hook": 0}, (rank, got)
        assert got["after"] == ("NOT_AVAILABLE", 0), (rank, got)


# --------------------------------------------------------------------------- real DeepSpeed on the CPU


def _deepspeed_worker(rank: int, world: int, cases) -> dict:
    import copy
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for kind, tied in cases:
        model, batches = _model_and_batches(world, tied=tied)
        ref_loss, ref_grads = _reference(model, batches, kind)
        module = copy.deepcopy(model)
        config = {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                  "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.0),
                                          config=config)
        partitioned = engine.module.lm_head.weight.numel() == 0
        loss = _loss(engine, batches[rank], kind)  # through the engine's forward, as a training step runs it
        engine.backward(loss)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        errs = {n: _rel(safe_get_full_grad(p), ref_grads[n]) for n, p in engine.module.named_parameters()}
        out[f"{kind}-{'tied' if tied else 'untied'}"] = {
            "loss": abs(float(mean_loss) / world - ref_loss) / abs(ref_loss), "grad": max(errs.values()),
            "partitioned": partitioned, "names": sorted(errs) == sorted(ref_grads)}
        engine.destroy()
    return out


DS_CASES = [("patched_ce", False), ("patched_ce", True), ("recomputed_logps", False)]


@pytest.fixture(scope="module")
def deepspeed_results():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not importable")
    return run_on_ranks(_deepspeed_worker, DS_CASES, init_process_group=False, timeout=600)


@pytest.mark.parametrize("case", [f"{k}-{'tied' if t else 'untied'}" for k, t in DS_CASES])
def test_deepspeed_zero3_matches_one_process(deepspeed_results, case):
    """Real ZeRO-3 on 2 CPU ranks: the head is partitioned, and the loss and every parameter's full gradient
    equal one process (rel 1e-5)."""
    for rank, results in enumerate(deepspeed_results):
        got = results[case]
        assert got["partitioned"] and got["names"], (rank, got)
        assert got["loss"] <= TOL and got["grad"] <= TOL, (rank, got)
