"""The loss-aware causal-LM forward: HF loss semantics without logits (fp32, rel err 1e-5).

All tests use the tiny Llama (the forward is the same code for every family; test_families.py
runs it for each). References are the unpatched model's own loss (``ForCausalLMLoss``) or, where
HF has no such option, ``F.cross_entropy`` on its float logits. fp32 bar 1e-5 (tests/helpers.TOL).
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from liger_losses.patching import apply_liger_kernels, causal_lm_fused_loss
from tests.helpers import TOL, assert_close_rel
from tests.patching.tiny_models import loss_and_grads, tiny_batch, tiny_model

FP32 = TOL[torch.float32]


@pytest.fixture
def pair():
    """(unpatched llama, patched deep copy, batch) with fresh random weights and labels."""
    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    apply_liger_kernels(model, rms_norm=False, rope=False, swiglu=False)  # the head only
    return ref, model, tiny_batch(ref.config, batch=2, seq=8)


def _compare(out, grads, ref_out, ref_grads, what):
    assert out.logits is None
    assert_close_rel(out.loss, ref_out.loss, FP32, f"{what} loss")
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert_close_rel(grads[name], g, FP32, f"{what} grad {name}")


def test_num_items_in_batch(pair):
    """num_items_in_batch=N: loss = sum of token losses / N (HF's fixed_cross_entropy), for a
    tensor N larger than the count of valid tokens; loss and all grads match to 1e-5."""
    ref, model, batch = pair
    n = torch.tensor(23)
    ref_out, ref_grads = loss_and_grads(ref, batch, num_items_in_batch=n)
    out, grads = loss_and_grads(model, batch, num_items_in_batch=n)
    _compare(out, grads, ref_out, ref_grads, "num_items_in_batch")
    mean_out, _ = loss_and_grads(model, batch)
    valid = int((batch["labels"][:, 1:] != -100).sum())
    assert_close_rel(out.loss * 23 / valid, mean_out.loss, FP32, "sum/N vs mean")


def test_logits_to_keep_int(pair):
    """logits_to_keep=k with labels of the full sequence (shifted, then the last k kept) and with
    labels of the kept k positions (HF's own semantics) both equal HF's loss with the kept labels;
    grads too (1e-5)."""
    ref, model, batch = pair
    k = 5
    kept = dict(batch, labels=batch["labels"][:, -k:])
    ref_out, ref_grads = loss_and_grads(ref, kept, logits_to_keep=k)
    out, grads = loss_and_grads(model, kept, logits_to_keep=k)
    _compare(out, grads, ref_out, ref_grads, "kept labels")
    out, grads = loss_and_grads(model, batch, logits_to_keep=k)
    _compare(out, grads, ref_out, ref_grads, "full labels")


def test_logits_to_keep_index_tensor(pair):
    """A 1-D index tensor keeps those positions; the loss is the mean CE over them against the
    shifted labels at the same positions (reference: F.cross_entropy on HF's float logits)."""
    ref, model, batch = pair
    idx = torch.tensor([0, 2, 3, 6])
    with torch.no_grad():
        logits = ref(input_ids=batch["input_ids"], logits_to_keep=idx).logits.float()
        shifted = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:][:, idx]
        want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1))
        got = model(**batch, logits_to_keep=idx).loss
    assert_close_rel(got, want, FP32, "indexed loss")


def test_shift_labels_used_as_given(pair):
    """shift_labels (already shifted, e.g. for context parallelism) are used without shifting."""
    ref, model, batch = pair
    shift_labels = torch.randint(0, ref.config.vocab_size, batch["input_ids"].shape)
    shift_labels[1, :2] = -100
    with torch.no_grad():
        logits = ref(input_ids=batch["input_ids"]).logits.float()
        want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1))
        got = model(input_ids=batch["input_ids"], shift_labels=shift_labels).loss
    assert_close_rel(got, want, FP32, "shift_labels loss")


def test_eval_mode_returns_logits_and_skip_logits_overrides(pair):
    """Eval mode with labels: the original forward runs, logits are returned and the loss is HF's.
    skip_logits=True forces the fused path (logits None, same loss to 1e-5); skip_logits=False in
    training returns logits."""
    ref, model, batch = pair
    ref.eval()
    model.eval()
    with torch.no_grad():
        ref_out = ref(**batch)
        out = model(**batch)
        fused = model(**batch, skip_logits=True)
    assert_close_rel(out.logits, ref_out.logits, FP32, "eval logits")
    assert_close_rel(out.loss, ref_out.loss, FP32, "eval loss")
    assert fused.logits is None
    assert_close_rel(fused.loss, ref_out.loss, FP32, "fused eval loss")
    model.train()
    with torch.no_grad():
        both = model(**batch, skip_logits=False)
    assert both.logits is not None
    assert_close_rel(both.loss, ref_out.loss, FP32, "train skip_logits=False loss")


def test_return_dict_false_and_errors(pair):
    """return_dict=False gives a tuple whose first item is the loss; skip_logits=True without
    labels and labels of a wrong length raise ValueError naming the argument."""
    _, model, batch = pair
    with torch.no_grad():
        out = model(**batch, return_dict=False)
        dict_out = model(**batch)
    assert isinstance(out, tuple)
    assert_close_rel(out[0], dict_out.loss, 0.0, "tuple loss")
    with pytest.raises(ValueError, match="skip_logits=True needs labels"):
        model(input_ids=batch["input_ids"], skip_logits=True)
    with pytest.raises(ValueError, match=r"labels must have shape \[2, 8\]"):
        model(input_ids=batch["input_ids"], labels=batch["labels"][:, :5])
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        model(input_ids=batch["input_ids"], labels=batch["labels"].float())


def test_fused_loss_with_head_bias():
    """causal_lm_fused_loss uses lm_head.bias when the head has one (matches CE on
    hidden @ W.T + b to 1e-5, fp32)."""
    model = tiny_model("llama")
    model.lm_head = torch.nn.Linear(64, 128, bias=True)
    hidden = torch.randn(2, 6, 64)
    labels = torch.randint(0, 128, (2, 6))
    logits = model.lm_head(hidden)[:, :-1]
    want = F.cross_entropy(logits.reshape(-1, 128), labels[:, 1:].reshape(-1))
    got = causal_lm_fused_loss(model, hidden, labels)
    assert_close_rel(got, want, FP32, "loss with bias")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_patched_model_traces_under_torch_compile(model_type, monkeypatch):
    """A patched model wrapped in ``torch.compile`` (``aot_eager``: Dynamo and AOTAutograd trace it,
    no code generation, so no compiler is needed on the CPU) gives the eager loss and gradients
    exactly, in two graphs: the backbone's (the layers trace their PyTorch paths while compiling,
    as on a GPU) and the output's, split by one graph break, the fused loss, which runs eagerly
    (``kernels.utils.eager_under_compile``). The compiled kernels on a GPU are
    tests/patching/test_gpu.py's."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = tiny_model(model_type, hidden_size=64, intermediate_size=128, vocab_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    apply_liger_kernels(model)
    batch = tiny_batch(model.config, batch=2, seq=16)
    out, grads = loss_and_grads(model, batch)
    c_out, c_grads = loss_and_grads(torch.compile(model, backend="aot_eager"), batch)
    c_grads = {name.removeprefix("_orig_mod."): g for name, g in c_grads.items()}
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    # the disabled loss; in the first trace also the making of its disabled wrapper, when
    # liger_losses was imported before torch._dynamo (eager_under_compile's docstring)
    reasons = {reason.splitlines()[0] for reason in counters["graph_break"]}
    assert "Skip calling `torch.compiler.disable()`d function" in reasons, reasons
    assert reasons <= {"Skip calling `torch.compiler.disable()`d function",
                       "Attempted to call function marked as skipped"}, reasons
    assert torch.equal(c_out.loss, out.loss)
    assert c_grads.keys() == grads.keys()
    for name, g in grads.items():
        assert torch.equal(c_grads[name], g), name
    torch._dynamo.reset()
