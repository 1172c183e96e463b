"""DPOTrainer(use_liger=True) against TRL 1.16's own DPO path, on tiny offline fp32 models.

Parity tests build TRL's trainer (use_liger=False) and ours on deep copies of the same weights and
the same batch, and compare the loss, every metric TRL logs and every parameter gradient to a
relative error <= 1e-4: both compute the same fp32 math (log-softmax, sums, the DPO formula) in a
different order, so they agree to ~1e-6; 1e-4 leaves room for accumulation-order noise only.
The reference model has other weights than the policy (its own seed), so rewards are not 0.
"""

import copy

import pytest
import torch

from liger_losses.patching.pad_free import varlen_call_count
from liger_losses.trl_integration import DPOTrainer

from .utils import (
    PAIRS,
    build_tiny_model,
    check_compute_loss,
    dpo_config,
    first_batch,
    lora_config,
    make_pair,
    preference_dataset,
    step0,
    train_logs,
    uneven_preference_dataset,
)

TOL = 1e-4


def _pair(tok, tmp_path, *, ref=True, liger_kwargs=None, peft_config=None, data=None, **cfg):
    """(TRL trainer, our trainer) on copies of one policy (seed 0) and reference (seed 1); ``data`` a dataset
    factory (default: the bundled pairs)."""
    models = [build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=1) if ref else None]
    return make_pair(DPOTrainer, models, lambda run_dir: dpo_config(run_dir, **cfg), tmp_path,
                     data or (lambda: preference_dataset(PAIRS)), liger_kwargs=liger_kwargs, processing_class=tok,
                     peft_config=peft_config)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(loss_type=["sigmoid"]),
        dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),  # MPO mix
        dict(loss_type=["ipo"], beta=0.5),
        dict(loss_type=["sigmoid"], ld_alpha=0.5),
        dict(loss_type=["sigmoid", "ipo"], use_weighting=True),
        dict(loss_type=["sigmoid"], use_weighting=True, ld_alpha=0.5),
    ],
    ids=["sigmoid", "mpo-weighted", "ipo", "ld_alpha", "wpo", "wpo-ld_alpha"],
)
def test_step0_parity_with_ref_model(tok, tmp_path, cfg):
    """Loss, every logged metric and every gradient equal TRL's (rel <= 1e-4); for "sigmoid" with
    5-token tiles, so tiles cut through sequences and pairs (two-phase engine path). The batch's chosen and
    rejected completions differ in length within pairs (``UNEVEN_PAIRS``), so LD-DPO's down-weighted tail, the
    length-normalised types' divisors and WPO's per-sequence means are all live."""
    chunk = 5 if cfg["loss_type"] == ["sigmoid"] and "ld_alpha" not in cfg else None
    theirs, ours = _pair(tok, tmp_path, liger_kwargs={"liger_chunk_tokens": chunk}, data=uneven_preference_dataset,
                         **cfg)
    batch = first_batch(theirs)
    chosen, rejected = batch["completion_mask"].sum(1).chunk(2)
    assert bool((chosen != rejected).all())
    m_t, _ = check_compute_loss(theirs, ours, TOL, batch)
    assert abs(m_t["rewards/margins"]) > 0  # a real test: policy != reference


@pytest.mark.parametrize("peft", [False, True], ids=["ref-model", "peft-lora"])
def test_step0_parity_pad_free(tok, tmp_path, monkeypatch, peft):
    """Forced pad-free (``LIGER_LOSSES_PAD_FREE=1``: policy and reference backbones on the attended tokens alone,
    packed; the CPU's reference attention) on TRL's padded batch: loss, metrics and gradients equal TRL's
    (rel <= 1e-4), and both forwards were packed."""
    monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "1")
    theirs, ours = _pair(tok, tmp_path, ref=not peft, peft_config=lora_config() if peft else None)
    batch = first_batch(theirs)
    assert not batch["attention_mask"].all()  # completions of different lengths: padding to drop
    calls = varlen_call_count()
    m_t, _ = check_compute_loss(theirs, ours, TOL, batch)
    assert varlen_call_count() - calls == 2 * ours.model.config.num_hidden_layers  # policy and reference
    assert abs(m_t["rewards/margins"]) > 0


@pytest.mark.parametrize("loss_type", ["ipo", "sigmoid_norm"])
@pytest.mark.parametrize("chunk", [None, 2], ids=["one-pass", "chunked"])
def test_length_normalised_types_divide_by_trls_completion_count(tok, tmp_path, loss_type, chunk):
    """``keep_end`` truncation to 3 tokens leaves completion tokens at position 0, which have no
    log-prob: TRL's ipo / sigmoid_norm still count them in the length they divide by (the completion
    mask before the label shift), and ours must too. Loss, metrics and gradients equal TRL's (rel <=
    1e-4); 2-token tiles also take the engine's chunked paths with those lengths."""
    theirs, ours = _pair(tok, tmp_path, liger_kwargs={"liger_chunk_tokens": chunk}, loss_type=[loss_type],
                         truncation_mode="keep_end", max_length=3)
    batch = next(iter(theirs.get_train_dataloader()))
    assert bool(batch["completion_mask"][:, 0].any())  # the case under test: a completion token at position 0
    check_compute_loss(theirs, ours, TOL)


def test_step0_parity_precomputed_ref_logps(tok, tmp_path):
    """precompute_ref_log_probs=True: our precomputed columns equal TRL's (rel <= 1e-4) and the
    step-0 loss/metrics/grads computed from them match too."""
    theirs, ours = _pair(tok, tmp_path, precompute_ref_log_probs=True)
    for col in ("ref_chosen_logps", "ref_rejected_logps"):
        a = torch.tensor(theirs.train_dataset[col])
        b = torch.tensor(ours.train_dataset[col])
        assert float((a - b).norm() / a.norm()) <= TOL
    batch = first_batch(theirs)
    assert "ref_chosen_logps" in batch
    check_compute_loss(theirs, ours, TOL, batch)


def test_compute_ref_log_probs_matches_trl(tok, tmp_path):
    """Our compute_ref_log_probs (chunked log-probs of the reference backbone) equals TRL's fused
    head on one batch, rel <= 1e-4."""
    theirs, ours = _pair(tok, tmp_path)
    batch = first_batch(theirs)
    for a, b in zip(theirs.compute_ref_log_probs(theirs.ref_model, batch),
                    ours.compute_ref_log_probs(ours.ref_model, batch)):
        assert float((a - b).norm() / a.norm()) <= TOL


def test_step0_parity_peft_lora(tok, tmp_path):
    """PEFT LoRA (random non-zero B so the adapter changes the policy); the reference is the policy
    with the adapter disabled. Loss, metrics and LoRA gradients match TRL's (rel <= 1e-4)."""
    theirs, ours = _pair(tok, tmp_path, ref=False, peft_config=lora_config())
    assert ours.ref_model is None
    m_t, _ = check_compute_loss(theirs, ours, TOL)
    assert abs(m_t["rewards/margins"]) > 0


def _train_and_compare(theirs, ours, steps, tol):
    lo, lt = train_logs(theirs, ours, steps, same_names=False, loss_tol=tol)
    for a, b in zip(lo, lt):
        for key in ("rewards/margins", "logps/chosen", "mean_token_accuracy", "entropy"):
            assert abs(a[key] - b[key]) <= tol * max(1.0, abs(b[key])), (key, a[key], b[key])


def test_short_run_tracks_trl(tok, tmp_path):
    """3 optimizer steps (Adam, lr 1e-3) with our loss: each step's logged loss and metrics track
    TRL's run from the same weights and data order (rel <= 1e-4: identical fp32 math, only the
    summation order differs, and 3 Adam steps barely amplify that)."""
    theirs, ours = _pair(tok, tmp_path, max_steps=3)
    _train_and_compare(theirs, ours, 3, 1e-4)


@pytest.mark.slow
def test_patched_model_short_run_tracks_trl(tok, tmp_path):
    """3 steps with the layers patched too (liger_patch_model=True: RMSNorm, RoPE, SwiGLU kernels in
    the Triton interpreter): loss and metrics track TRL's unpatched run (rel <= 1e-3: the kernels
    reorder fp32 sums inside every layer). Slow: ~1-2 min of interpreted kernels."""
    from liger_losses.kernels.rms_norm import LigerRMSNorm
    from liger_losses.patching import revert_liger_kernels

    try:
        theirs, ours = _pair(tok, tmp_path, liger_kwargs={"liger_patch_model": True}, max_steps=3)
        assert isinstance(ours.model.model.norm, LigerRMSNorm)
        assert not isinstance(theirs.model.model.norm, LigerRMSNorm)
        _train_and_compare(theirs, ours, 3, 1e-3)
    finally:
        revert_liger_kernels()  # RoPE is patched module-wide: leave other tests unpatched


def test_use_liger_false_is_trl(tok, tmp_path):
    """use_liger=False is TRL's trainer: same loss as trl.DPOTrainer itself, bit for bit."""
    import trl

    policy, reference = build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=1)
    ours = DPOTrainer(copy.deepcopy(policy), copy.deepcopy(reference), args=dpo_config(tmp_path / "a"),
                      train_dataset=preference_dataset(PAIRS), processing_class=tok)
    plain = trl.DPOTrainer(copy.deepcopy(policy), copy.deepcopy(reference), args=dpo_config(tmp_path / "b"),
                           train_dataset=preference_dataset(PAIRS), processing_class=tok)
    batch = first_batch(plain)
    assert float(step0(ours, batch)[0]) == float(step0(plain, batch)[0])


@pytest.mark.parametrize(
    "cfg, option",
    [
        (dict(loss_type=["sigmoid", "sft"], ld_alpha=0.5), "ld_alpha"),
    ],
)
def test_unsupported_options_raise_at_construction(tok, tmp_path, cfg, option):
    """Options TRL serves but we cannot: ValueError at construction naming the option."""
    with pytest.raises(ValueError, match=option):
        DPOTrainer(build_tiny_model(tok), build_tiny_model(tok, seed=1), args=dpo_config(tmp_path, **cfg),
                   train_dataset=preference_dataset(PAIRS), processing_class=tok, use_liger=True)


@pytest.mark.parametrize("kwargs, exc", [({"liger_chunk_tokens": 0}, ValueError), ({"use_liger": "yes"}, TypeError)])
def test_bad_liger_options(tok, tmp_path, kwargs, exc):
    """Bad values of our own keywords raise before any work (ValueError/TypeError naming them)."""
    name = next(iter(kwargs))
    with pytest.raises(exc, match=name):
        DPOTrainer(build_tiny_model(tok), build_tiny_model(tok, seed=1), args=dpo_config(tmp_path),
                   train_dataset=preference_dataset(PAIRS), processing_class=tok,
                   **{"use_liger": True, **kwargs})


@pytest.mark.gpu
def test_step0_parity_cuda_fp32(tok, tmp_path):
    """On CUDA (compiled Triton kernels, TRL's Triton fused head): fp32 loss/metrics/grads match
    TRL's (rel <= 1e-4; TF32 is off by default for fp32 matmuls)."""
    theirs, ours = _pair(tok, tmp_path, use_cpu=False, liger_kwargs={"liger_patch_model": True})
    try:
        assert next(ours.model.parameters()).is_cuda
        check_compute_loss(theirs, ours, TOL)
    finally:
        from liger_losses.patching import revert_liger_kernels

        revert_liger_kernels()



def _peft_head_config(kind):
    peft = pytest.importorskip("peft")
    extra = (dict(modules_to_save=["lm_head"]) if kind == "modules_to_save"
             else dict(trainable_token_indices={"lm_head": [3, 5, 8, 13]}))
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                           task_type="CAUSAL_LM", **extra)


def _move_trained_head(trainer, kind):
    """Move what PEFT trains of the head (the copy, or the token rows' delta) as training steps would."""
    head = trainer.model.get_output_embeddings()
    trained = (head.modules_to_save["default"].weight if kind == "modules_to_save"
               else head.token_adapter.trainable_tokens_delta["default"])
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        trained.add_(torch.randn(trained.shape, generator=gen) * 0.5)


def test_peft_reference_reads_the_untrained_head(tok, tmp_path):
    """A PEFT policy that trains its LM head (``modules_to_save=["lm_head"]``) and no ref_model: the reference
    (adapters off) scores with the original head, as TRL's forward does. With the trained copy moved away from
    it, loss, metrics and gradients equal TRL's (rel <= 1e-4); a reference read through the trained copy gives
    the policy's own head on that side (a margin off by O(1))."""
    theirs, ours = _pair(tok, tmp_path, ref=False, peft_config=_peft_head_config("modules_to_save"))
    for trainer in (theirs, ours):
        _move_trained_head(trainer, "modules_to_save")
    m_t, _ = check_compute_loss(theirs, ours, TOL)
    assert abs(m_t["rewards/margins"]) > 0


def test_peft_trainable_head_tokens_are_served_and_the_reference_reads_the_base_head(tok, tmp_path):
    """Trainable token rows of the LM head (PEFT's ``trainable_token_indices``; tied-embedding models get them on
    the head too) are accepted (the wrapper's weight is the merged one its forward uses), and the reference
    reads the base head, not the moved rows. TRL 1.16's own DPO step fails on this head (it reads
    ``lm_head.bias``), so the check is on the heads the loss receives."""
    ours = _pair(tok, tmp_path, ref=False, peft_config=_peft_head_config("trainable_tokens"))[1]
    _move_trained_head(ours, "trainable_tokens")
    head = ours.model.get_output_embeddings()
    batch = first_batch(ours)
    model_kwargs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    _, ref_weight, _, _ = ours._liger_reference_hidden(ours.model, model_kwargs)
    assert torch.equal(ref_weight, head.original_module.weight)
    policy_weight = ours._liger_head(ours.model)[0]
    assert not torch.equal(policy_weight[[3, 5, 8, 13]], ref_weight[[3, 5, 8, 13]])
    assert torch.equal(policy_weight[:3], ref_weight[:3])
