"""GPU runs of the TRL trainer subclasses (DPO, SFT, CPO + SimPO, ORPO, KTO, Distillation, GKD, GRPO, RLOO).

Each trainer (parametrized, ids below) gets two tests on CUDA:

* ``test_step0_parity_cuda_fp32``: TRL's trainer (``use_liger=False``) and ours (``use_liger=True``,
  ``liger_patch_model=True``: the model's RMSNorm/RoPE/SwiGLU run our compiled Triton kernels) on deep copies of
  the same tiny fp32 model(s) and TRL's first batch: loss, every metric TRL logs and every parameter gradient
  agree to a relative error <= 1e-4 (TF32 off: fp32 matmuls in full precision; both sides compute the same
  fp32 math in another summation order, ~1e-6). Each case reuses the CPU parity test's pair builder and check
  (``tests/trl_integration/test_<trainer>.py``, ``utils.py``).
* ``test_short_run_cuda_bf16``: 3 optimizer steps of ``trainer.train()`` in bf16 mixed precision (fp32
  weights, ``bf16=True``: the Trainer's autocast), ours with the layers patched, and TRL's from the same weights
  and config: all 3 steps are logged, every logged loss is finite, and our logged metric names equal TRL's at
  every step.

The models are built on the CPU and moved by the trainer (``use_cpu=False``); batches go through the trainer's
``_prepare_inputs``. Layer patching patches RoPE module-wide, so every test reverts it in a ``finally``.

``LIGER_TEST_GPU_ON_CPU=1`` runs the same tests on the CPU instead (``use_cpu=True``, fp32, Triton kernels in the
interpreter, no ``gpu`` mark), to check the tests themselves on a machine without a GPU; there the short runs are
fp32 and unpatched (interpreted kernels over 3 training steps are too slow). ``LIGER_TEST_GPU_BF16=0|1``
overrides the short runs' bf16 choice (default: bf16 on CUDA only).
"""

import math
import os

import pytest
import torch

from liger_losses.kernels import varlen_attention
from liger_losses.kernels.rms_norm import LigerRMSNorm
from liger_losses.patching import revert_liger_kernels
from liger_losses.patching.pad_free import varlen_call_count
from tests.helpers import rel_err

from . import test_cpo as cpo_tests
from . import test_distillation as distillation_tests
from . import test_dpo as dpo_tests
from . import test_gkd as gkd_tests
from . import test_grpo as grpo_tests
from . import test_kto as kto_tests
from . import test_orpo as orpo_tests
from . import test_rloo as rloo_tests
from . import test_sft as sft_tests
from .utils import (
    assert_autocast_records_match,
    assert_grads_match,
    assert_metrics_match,
    build_tokenizer,
    check_batch_loss_metrics,
    check_compute_loss,
    first_batch,
    record_backbone_autocast,
    rel,
    sft_dataset,
    train_logs,
)

ON_CPU = os.environ.get("LIGER_TEST_GPU_ON_CPU") == "1"
USE_CPU = ON_CPU  # TrainingArguments.use_cpu: the trainer places the models
BF16 = os.environ.get("LIGER_TEST_GPU_BF16", "0" if ON_CPU else "1") == "1"
PATCH_IN_RUN = not ON_CPU  # short runs: patched layers on CUDA; unpatched in the (slow) CPU interpreter
if not ON_CPU:
    pytestmark = pytest.mark.gpu

TOL = 1e-4
STEPS = 3


@pytest.fixture(autouse=True)
def _full_fp32_matmuls():
    """fp32 matmuls in full precision (no TF32) for the duration of a test, restored afterwards.
    On a machine with several visible GPUs and no launcher the HF Trainer would wrap the model in
    DataParallel: skipped there (run with ``CUDA_VISIBLE_DEVICES=0``)."""
    if not ON_CPU and torch.cuda.is_available() and torch.cuda.device_count() > 1:
        pytest.skip("several GPUs visible: the Trainer would use DataParallel; set CUDA_VISIBLE_DEVICES=0")
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


# --------------------------------------------------------------------------- the cases

def _tokenizer(name):
    """The bundled character tokenizer; left padding for the on-policy distillation (as its CPU tests)."""
    tok = build_tokenizer()
    if name == "distillation":
        tok.padding_side = "left"
    return tok


def _kw_pair(module):
    """``module._pair`` (keyword ``liger_kwargs``) as ``pair(tok, tmp_path, liger_kwargs, **cfg)``."""
    return lambda tok, tmp_path, liger_kwargs, **cfg: module._pair(tok, tmp_path, liger_kwargs=liger_kwargs, **cfg)


def _sft_pair(tok, tmp_path, liger_kwargs, **cfg):
    """SFT on prompt/completion pairs (completion-only loss), as test_sft's parity tests."""
    return sft_tests._pair(tok, tmp_path, sft_dataset(), liger_kwargs=liger_kwargs, **cfg)


# name -> (pair(tok, tmp_path, liger_kwargs, **cfg) -> (TRL's trainer, ours), the case's own config)
CASES = {
    "dpo": (_kw_pair(dpo_tests), {}),
    "dpo-wpo": (_kw_pair(dpo_tests), dict(use_weighting=True)),
    "sft": (_sft_pair, {}),
    "sft-dft": (_sft_pair, dict(loss_type="dft")),
    "cpo": (_kw_pair(cpo_tests), dict(loss_type="sigmoid")),
    "simpo": (_kw_pair(cpo_tests), dict(loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.5)),
    "orpo": (_kw_pair(orpo_tests), {}),
    "kto": (_kw_pair(kto_tests), {}),
    "distillation": (_kw_pair(distillation_tests), {}),
    "gkd": (_kw_pair(gkd_tests), {}),
    "grpo": (_kw_pair(grpo_tests), dict(loss_type="dapo")),
    "rloo": (_kw_pair(rloo_tests), dict(epsilon_high=0.28)),
}


def _pair(name, tmp_path, *, patch, **cfg):
    """(TRL's trainer, ours) of case ``name`` on ``USE_CPU``'s device, ours patched when ``patch``."""
    build, case_cfg = CASES[name]
    return build(_tokenizer(name), tmp_path, {"liger_patch_model": patch}, use_cpu=USE_CPU, **case_cfg, **cfg)


# the trainers' second model: a reference (DPO, KTO) or a teacher (GKD, distillation)
COMPANION = {"dpo": "ref_model", "dpo-wpo": "ref_model", "kto": "ref_model", "gkd": "teacher_model",
             "distillation": "teacher_model"}


def _check_placed(name, theirs, ours, patched):
    """Both trainers' models (policy/student and reference/teacher) live on the run's device (the trainer moved
    them); ours is patched iff ``patched``, TRL's never."""
    attrs = ["model"] + ([COMPANION[name]] if name in COMPANION else [])
    for trainer in (theirs, ours):
        for attr in attrs:
            device = next(getattr(trainer, attr).parameters()).device
            assert (device.type == "cuda") == (not ON_CPU), (attr, device)
    assert isinstance(ours.model.model.norm, LigerRMSNorm) == patched
    assert not isinstance(theirs.model.model.norm, LigerRMSNorm)


def _step0_check(name, theirs, ours):
    """The case's CPU step-0 check (loss, every metric TRL logs, every gradient; rel <= TOL); TRL's metrics."""
    if name in ("sft", "sft-dft"):  # TRL's SFT compute_loss writes into its inputs: test_sft's check hands each a copy
        sft_tests._check(theirs, ours)
        return None
    if name in ("cpo", "simpo", "orpo"):  # TRL logs get_batch_loss_metrics' metrics
        return check_batch_loss_metrics(theirs, ours, TOL)
    if name == "distillation":  # on-policy: one batch generated by TRL's trainer, handed to both
        batch = distillation_tests._generated_batch(theirs)
        assert batch["completion_mask"].sum() > 0
        m_t, _ = check_compute_loss(theirs, ours, TOL, batch)
        assert "entropy" in m_t
        return m_t
    if name in ("grpo", "rloo"):
        return _rl_step0_check(theirs, ours, "old_per_token_logps" if name == "grpo" else "old_logps")
    m_t, _ = check_compute_loss(theirs, ours, TOL)
    return m_t


def _rl_batch(theirs, old_key, padded=False):
    """One batch generated by TRL's trainer, its old log-probs moved by N(0, 1) and its advantages drawn from
    N(0, 1) (on the CPU, then moved: the same numbers on every device) so that clipping acts; ``padded``: a
    left-padded prompt and two completions ending early (padding for the pad-free path to drop)."""
    torch.manual_seed(0)
    theirs.model.train()
    batch = theirs._prepare_inputs(next(iter(theirs.get_train_dataloader())))
    assert batch["completion_mask"].sum() > 0
    if padded:
        grpo_tests.pad_rl_batch(batch)
    g = torch.Generator().manual_seed(0)
    old, adv = batch[old_key], batch["advantages"]
    batch[old_key] = old + torch.randn(old.shape, generator=g).to(old.device)
    # advantages of their own: a tiny model's completions of one prompt may all score alike (advantage 0 everywhere)
    batch["advantages"] = torch.randn(adv.shape, generator=g).to(adv.device, adv.dtype)
    return batch


def _rl_step0_check(theirs, ours, old_key, padded=False):
    """GRPO / RLOO: both trainers' ``compute_loss`` on :func:`_rl_batch` as in the CPU parity tests."""
    batch = _rl_batch(theirs, old_key, padded)
    loss_t, m_t = grpo_tests._step0(theirs, batch)
    loss_o, m_o = grpo_tests._step0(ours, batch)
    assert rel(loss_o, loss_t) <= TOL, (float(loss_o), float(loss_t))
    assert_metrics_match(m_o, m_t, TOL)
    assert_grads_match(loss_t, loss_o, theirs, ours, TOL)
    assert m_t["clip_ratio/region_mean"] > 0  # a real test of the clipping
    return m_t


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("name", list(CASES))
def test_step0_parity_cuda_fp32(name, tmp_path):
    """Step 0 in fp32 with TF32 off, ours with patched layers (compiled kernels on CUDA): loss, every metric TRL
    logs and every gradient equal TRL's to a relative error <= 1e-4 (metrics that are 0 compare absolutely)."""
    try:
        theirs, ours = _pair(name, tmp_path, patch=True)
        _check_placed(name, theirs, ours, patched=True)
        m_t = _step0_check(name, theirs, ours)
        if name in ("dpo", "kto"):
            assert abs(m_t["rewards/margins"]) > 0  # a real test: policy != reference
    finally:
        revert_liger_kernels()  # RoPE is patched module-wide: leave later tests unpatched


def test_grpo_fp32_head_under_bf16_cuda(tmp_path):
    """GRPO's ``cast_lm_head_to_fp32=True`` on a bf16 model under ``bf16=True`` on CUDA (our fp32 tiles and GEMMs, TF32
    off): TRL's numbers as in the CPU test (``test_grpo.check_fp32_head_parity``: loss 1e-4, grads 1e-2, the bf16
    head more than 10x further)."""
    grpo_tests.check_fp32_head_parity(build_tokenizer(), tmp_path, use_cpu=USE_CPU)


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_rl_step0_parity_pad_free_cuda_fp32(name, tmp_path, monkeypatch):
    """GRPO / RLOO in fp32 on CUDA, pad-free forced (``LIGER_LOSSES_PAD_FREE=1``: packed, the reference attention
    in fp32) with patched layers, on a batch with padding: TRL's numbers to 1e-4 as in the fp32 parity test, and
    every layer's attention took the packing."""
    monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "1")
    try:
        theirs, ours = _pair(name, tmp_path, patch=True)
        calls = varlen_call_count()
        _rl_step0_check(theirs, ours, "old_per_token_logps" if name == "grpo" else "old_logps", padded=True)
        assert varlen_call_count() - calls == ours.model.config.num_hidden_layers
    finally:
        revert_liger_kernels()


# the trainers whose backbone calls go pad-free, and the number of packed calls in one step (policy, reference, KL)
PAD_FREE_CALLS = {"grpo": 1, "rloo": 1, "dpo": 2, "kto": 4, "sft": 1}


@pytest.mark.parametrize("name", list(PAD_FREE_CALLS))
def test_pad_free_flash_cuda_bf16(name, tmp_path, monkeypatch):
    """Under ``bf16=True`` (fp32 weights, autocast) on CUDA: pad-free by default (packed, flash varlen attention
    in bf16) against the same trainer's padded step (``LIGER_LOSSES_PAD_FREE=0``) on one batch with padding
    (GRPO / RLOO: a left-padded prompt and early-ending completions; DPO / KTO / SFT: completions of different
    lengths): loss and every gradient within 2e-2 relative (two bf16 attention kernels, bf16 GEMMs)."""
    if ON_CPU:
        pytest.skip("the flash varlen attention needs CUDA")
    monkeypatch.delenv("LIGER_LOSSES_PAD_FREE", raising=False)

    def no_reference(*args, **kwargs):
        raise AssertionError("the packed step took the reference attention, not the flash kernel")

    monkeypatch.setattr(varlen_attention, "reference_varlen_attention", no_reference)
    try:
        theirs, ours = _pair(name, tmp_path, patch=True, bf16=True)
        if name in ("grpo", "rloo"):
            batch = _rl_batch(theirs, "old_per_token_logps" if name == "grpo" else "old_logps", padded=True)
        else:
            batch = first_batch(theirs)
            assert not batch["attention_mask"].all()
        results = []
        for mode in ("auto", "0"):
            if mode == "0":
                monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "0")
            calls = varlen_call_count()
            ours.model.zero_grad()
            with ours.accelerator.autocast():  # as under train(), whose prepared policy runs its forward in it
                loss, _ = grpo_tests._step0(ours, dict(batch))
            loss.backward()
            taken = varlen_call_count() - calls
            layers = ours.model.config.num_hidden_layers
            assert taken == (PAD_FREE_CALLS[name] * layers if mode == "auto" else 0), (mode, taken)
            results.append((loss.detach(), {n: p.grad.clone() for n, p in ours.model.named_parameters()
                                            if p.grad is not None}))
        (packed, g_packed), (padded, g_padded) = results
        assert rel(packed, padded) <= 2e-2, (float(packed), float(padded))
        assert g_packed.keys() == g_padded.keys()
        for n in g_padded:
            assert rel_err(g_packed[n], g_padded[n]) <= 2e-2, n
    finally:
        revert_liger_kernels()


def _names(logs):
    return [sorted(h) for h in logs]


@pytest.mark.parametrize("name", list(CASES))
def test_short_run_cuda_bf16(name, tmp_path):
    """3 optimizer steps of trainer.train() (bf16 mixed precision on CUDA, ours with patched layers) for ours and
    TRL's from the same weights: both log 3 steps, every logged loss is finite, every backbone call runs under the
    autocast TRL's runs under, and our logged metric names equal TRL's at every step (no tolerance: set
    equalities)."""
    try:
        theirs, ours = _pair(name, tmp_path, patch=PATCH_IN_RUN, max_steps=STEPS, bf16=BF16)
        _check_placed(name, theirs, ours, patched=PATCH_IN_RUN)
        for trainer in (theirs, ours):
            assert trainer.accelerator.mixed_precision == ("bf16" if BF16 else "no")
        device_type = "cpu" if ON_CPU else "cuda"
        seen_t, seen_o = record_backbone_autocast(theirs, device_type), record_backbone_autocast(ours, device_type)
        lo, lt = train_logs(theirs, ours, STEPS, same_names=False)
        # every backbone call (policy, reference, teacher) under the autocast TRL's runs under: a set equality
        assert_autocast_records_match(seen_o, seen_t)
        assert ours.state.global_step == theirs.state.global_step == STEPS
        for logs in (lo, lt):
            assert all(math.isfinite(h["loss"]) for h in logs), [h["loss"] for h in logs]
        assert _names(lo) == _names(lt), (_names(lo), _names(lt))
    finally:
        revert_liger_kernels()
