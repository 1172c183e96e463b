"""The patched causal LM's fused cross-entropy under FSDP2 on 2 gloo ranks equals one process.

A tiny Llama (``tests.patching.tiny_models``) patched with every kernel (``apply_liger_kernels``: the
loss reads ``lm_head.weight`` inside the model's forward) is sharded with ``fully_shard`` -- each decoder
layer, then the root, ``reshard_after_forward=True`` -- in three layouts:

* ``root``: the embedding, final norm and LM head belong to the root's group;
* ``tail``: accelerate 1.15's layout (``fsdp2_prepare_model``): the untied embedding in its own group,
  ``[final norm, lm_head]`` (plus the embedding when tied) in one group with ``reshard_after_forward=False``
  -- the loss never calls ``lm_head``, so FSDP2 must finish that group from the root's post-forward;
* ``head``: the untied ``lm_head`` alone in a group with ``reshard_after_forward=True`` -- its module is never
  called either, so its weight would be read as a sharded ``DTensor`` (gathered, but its gradient never
  reduced over ranks); the loss runs through ``run_with_head_params``, which calls the head's FSDP2 hooks.

One more case runs the recomputing per-token log-probs (``fused_linear_token_logprobs``: the backward
recomputes the tiles from the weight) on the ``head`` layout, the way the TRL adapters run a loss (the
backbone and the loss as the root's forward, ``run_in_forward``): FSDP2 frees the resharded head after the
forward and must gather it again before that backward.

Each rank runs its own batch; the loss averaged over ranks and every gradient (``full_tensor()`` of the
sharded ``.grad``) must equal one process that runs both batches on an unsharded copy and averages
(FSDP2's gradient reduction is the mean over ranks). With ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` the reference is the same model with bf16 parameters, each rank's bf16 gradient
averaged in fp32, which is what FSDP2 computes. Tolerances: fp32 1e-5 and bf16 policy 1e-2 relative
(the suite's bars, ``tests.helpers.TOL``); measured: losses agree to <= 5e-8 and gradients exactly (the
same ops in the same order, the 2-rank mean exact in fp32). Each case runs two forward/backward passes,
so FSDP2's state after a first step (resharded head, the tail group finished by the root) is exercised too.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.distributed.ranks import run_on_ranks, skip_unless_gloo_fsdp2

TOL = {False: 1e-5, True: 1e-2}  # keyed by "bf16 mixed-precision policy"


@dataclasses.dataclass(frozen=True)
class Case:
    layout: str  # "root" | "tail" | "head" (see the module docstring)
    tied: bool
    bf16_policy: bool
    loss: str = "patched_ce"  # or "recomputed_logps"

    @property
    def name(self) -> str:
        return f"{self.loss}-{self.layout}-{'tied' if self.tied else 'untied'}-{'bf16' if self.bf16_policy else 'fp32'}"


CASES = [
    Case("root", tied=False, bf16_policy=False),
    Case("root", tied=True, bf16_policy=False),
    Case("root", tied=False, bf16_policy=True),
    Case("tail", tied=False, bf16_policy=True),
    Case("tail", tied=True, bf16_policy=True),
    Case("head", tied=False, bf16_policy=False),
    Case("head", tied=False, bf16_policy=True),
    Case("head", tied=False, bf16_policy=False, loss="recomputed_logps"),
]


def _shard(model, case: Case) -> None:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if case.bf16_policy \
        else MixedPrecisionPolicy()
    kw = dict(mp_policy=mp, reshard_after_forward=True)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    embed, head, norm = model.model.embed_tokens, model.lm_head, model.model.norm
    if case.layout == "tail":
        if not case.tied:
            fully_shard(embed, **kw)
        fully_shard([norm, embed, head] if case.tied else [norm, head], **{**kw, "reshard_after_forward": False})
    elif case.layout == "head":
        fully_shard(head, **kw)
    fully_shard(model, **kw)


def _loss(model, batch, kind: str):
    """The patched model's own loss, or the mean recomputed log-prob of the labels run as the root's forward."""
    if kind == "patched_ce":
        out = model(**batch)
        assert out.logits is None  # the fused path ran
        return out.loss
    from liger_losses.chunked.token_logprobs import fused_linear_token_logprobs
    from liger_losses.chunked.weights import run_with_head_params
    from liger_losses.trl_integration.base import run_in_forward

    labels = batch["labels"][:, 1:]

    def fn():
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        head = model.lm_head
        return run_with_head_params(head, lambda: fused_linear_token_logprobs(
            head.weight, hidden[:, :-1], labels, ignore_index=-100).sum() / (labels != -100).sum())

    return run_in_forward(model, fn)


def _reference(model, batches, bf16: bool, kind: str):
    """(mean loss, {name: mean gradient in fp32}) of one process running every rank's batch on a copy."""
    import copy

    import torch

    ref = copy.deepcopy(model)
    if bf16:  # the parameters only, as FSDP2's policy does (buffers such as RoPE's inv_freq stay fp32)
        for p in ref.parameters():
            p.data = p.data.to(torch.bfloat16)
    loss_sum, grads = 0.0, {}
    for batch in batches:
        ref.zero_grad(set_to_none=True)
        loss = _loss(ref, batch, kind)
        loss.backward()
        loss_sum += float(loss.detach())
        for n, p in ref.named_parameters():
            grads[n] = grads.get(n, 0) + p.grad.float()
    return loss_sum / len(batches), {n: g / len(batches) for n, g in grads.items()}


def _run_case(rank: int, world: int, case: Case) -> dict:
    import copy

    import torch
    import torch.distributed as dist

    from liger_losses.patching import apply_liger_kernels
    from tests.helpers import rel_err
    from tests.patching.tiny_models import tiny_batch, tiny_model

    torch.manual_seed(0)
    model = tiny_model("llama", tie_word_embeddings=case.tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == case.tied
    apply_liger_kernels(model)
    torch.manual_seed(1)
    batches = [tiny_batch(model.config, batch=2, seq=8) for _ in range(world)]
    ref_loss, ref_grads = _reference(model, batches, case.bf16_policy, case.loss)

    sharded = copy.deepcopy(model)
    _shard(sharded, case)
    errors = []
    for _ in range(2):
        sharded.zero_grad(set_to_none=True)
        out = _loss(sharded, batches[rank], case.loss)
        out.backward()
        loss = out.detach().float().clone()
        dist.all_reduce(loss)
        grad_err = max(rel_err(p.grad.full_tensor(), ref_grads[n]) for n, p in sharded.named_parameters())
        errors.append((abs(float(loss) / world - ref_loss) / abs(ref_loss), grad_err))
    return {"errors": errors, "names": sorted(n for n, _ in sharded.named_parameters()) == sorted(ref_grads)}


def _worker(rank: int, world: int, cases) -> dict:
    return {case.name: _run_case(rank, world, case) for case in cases}


@pytest.fixture(scope="module")
def results():
    """Every case's errors per rank, from one pair of spawned processes (process start dominates the time)."""
    skip_unless_gloo_fsdp2()
    return run_on_ranks(_worker, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fsdp2_causal_lm_matches_one_process(results, case):
    """Loss (mean over ranks) and every gradient equal one process on the same global batch, on both ranks
    and both steps (TOL: fp32 1e-5, bf16 policy 1e-2 relative; see the module docstring)."""
    tol = TOL[case.bf16_policy]
    for rank, per_rank in enumerate(results):
        got = per_rank[case.name]
        assert got["names"], (rank, "parameter names differ")
        for step, (loss_err, grad_err) in enumerate(got["errors"]):
            assert loss_err <= tol, (rank, step, "loss", loss_err)
            assert grad_err <= tol, (rank, step, "grad", grad_err)
