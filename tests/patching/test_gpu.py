"""bf16 models on CUDA (run with ``pytest -m gpu``): patched vs an fp64 reference of the same weights.

Bars: the loss within 1e-2 relative error of the fp64 loss (tests/helpers.TOL bf16); every
parameter gradient within max(1e-2, 2 x the error of unpatched Hugging Face in bf16), since a
whole bf16 model carries its own rounding noise that no kernel can remove -- the claim is "no
worse than HF in bf16". Logits (no labels) are held to the same rule.
A memory test checks that the fused loss does not hold the [tokens, vocab] logits.
"""

import copy

import pytest
import torch

from liger_losses.patching import apply_liger_kernels
from tests.helpers import TOL, rel_err
from tests.patching.tiny_models import FAMILIES, loss_and_grads, tiny_batch, tiny_model

pytestmark = pytest.mark.gpu
BF16 = TOL[torch.bfloat16]
SIZES = dict(hidden_size=256, intermediate_size=512, vocab_size=1024, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, max_position_embeddings=256)


def _logits(model, batch):
    model.eval()
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    model.train()
    return out


@pytest.mark.parametrize("model_type", FAMILIES)
def test_bf16_patched_model_on_cuda(model_type):
    """Patched bf16 model on CUDA vs fp64 reference: loss <= 1e-2; logits and every gradient
    <= max(1e-2, 2 x HF-bf16 error)."""
    overrides = dict(SIZES)
    if model_type in ("phi3", "deepseek_v3"):
        overrides.pop("head_dim")  # derived (Phi-3: hidden / heads; DeepSeek-V3: qk_rope_head_dim)
    if model_type == "deepseek_v3":
        overrides["num_key_value_heads"] = overrides["num_attention_heads"]  # MLA: one k per head
    if model_type == "olmoe":
        # every expert chosen: at this random init OLMoE's bf16 top-2 routing flips near-ties, and transformers'
        # own bf16 gradients were 2-20% off fp64 (ours alike, CPU bf16, 3 seeds), a coin flip for the 2x bar;
        # with no discrete choice both are 2-5% off and the test measures our layers, not the flips
        overrides["num_experts_per_tok"] = 4
    # the fp64 reference runs on the CPU with eager experts: the MoE families' default grouped-GEMM experts
    # take fp32/bf16/fp16 only
    ref64 = tiny_model(model_type, dtype=torch.float64, device="cpu", **overrides)
    if hasattr(ref64, "set_experts_implementation") and getattr(ref64.config, "_experts_implementation", None):
        ref64.set_experts_implementation("eager")
    hf16 = copy.deepcopy(ref64).to("cuda", torch.bfloat16)
    model = copy.deepcopy(hf16)
    batch_cpu = tiny_batch(ref64.config, batch=2, seq=64, device="cpu")
    batch = {k: v.cuda() for k, v in batch_cpu.items()}

    ref_logits = _logits(ref64, batch_cpu).cuda()
    ref_out, ref_grads = loss_and_grads(ref64, batch_cpu)
    ref_grads = {name: g.cuda() for name, g in ref_grads.items()}
    hf_logits = _logits(hf16, batch)
    hf_out, hf_grads = loss_and_grads(hf16, batch)

    apply_liger_kernels(model)
    logits = _logits(model, batch)
    out, grads = loss_and_grads(model, batch)
    assert out.logits is None
    assert rel_err(out.loss, ref_out.loss.cuda()) <= BF16
    assert rel_err(logits, ref_logits) <= max(BF16, 2 * rel_err(hf_logits, ref_logits))
    for name, g in ref_grads.items():
        bar = max(BF16, 2 * rel_err(hf_grads[name], g))
        err = rel_err(grads[name], g)
        assert err <= bar, f"grad {name}: {err:.3e} > {bar:.3e}"


def test_fused_loss_does_not_hold_logits():
    """Llama bf16, 4096 tokens x vocab 32768: HF's loss step (logits + fp32 upcast, ~0.75 GiB)
    peaks well above the patched one, whose extra peak stays under half of HF's."""
    overrides = dict(SIZES, vocab_size=32768)
    hf = tiny_model("llama", dtype=torch.bfloat16, device="cuda", **overrides)
    model = copy.deepcopy(hf)
    apply_liger_kernels(model, rms_norm=False, rope=False, swiglu=False)
    batch = tiny_batch(hf.config, batch=4, seq=1024, device="cuda")

    def peak(m):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        m(**batch).loss.backward()
        torch.cuda.synchronize()
        m.zero_grad(set_to_none=True)
        return torch.cuda.max_memory_allocated() - base

    peak(hf), peak(model)  # warm-up (kernel compilation, allocator)
    hf_peak, our_peak = peak(hf), peak(model)
    logits_bytes = 4 * 1024 * 32768 * 2
    assert hf_peak > logits_bytes
    assert our_peak < hf_peak / 2, (our_peak, hf_peak)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text"])
def test_bf16_patched_model_under_torch_compile(model_type):
    """A patched bf16 model wrapped in ``torch.compile`` (what ``TrainingArguments(torch_compile=True)``
    does; Inductor) against an fp64 reference of the same weights, as the eager test above: loss
    within 1e-2, every gradient within max(1e-2, 2 x unpatched HF-bf16's error). Compiled, the
    layers are Inductor's code (``impl="auto"`` takes the PyTorch path while tracing) and the fused
    loss runs eagerly behind one graph break: two graphs, whose second call reuses them."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ref64 = tiny_model(model_type, dtype=torch.float64, device="cpu", **SIZES)
    hf16 = copy.deepcopy(ref64).to("cuda", torch.bfloat16)
    model = copy.deepcopy(hf16)
    batch_cpu = tiny_batch(ref64.config, batch=2, seq=64, device="cpu")
    batch = {k: v.cuda() for k, v in batch_cpu.items()}
    ref_out, ref_grads = loss_and_grads(ref64, batch_cpu)
    ref_grads = {name: g.cuda() for name, g in ref_grads.items()}
    _, hf_grads = loss_and_grads(hf16, batch)
    apply_liger_kernels(model)
    compiled = torch.compile(model)
    for _ in range(2):  # the second call runs the compiled graphs as they were built
        out, grads = loss_and_grads(compiled, batch)
    grads = {name.removeprefix("_orig_mod."): g for name, g in grads.items()}  # the wrapper's names
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert out.logits is None
    assert rel_err(out.loss, ref_out.loss.cuda()) <= BF16, (out.loss, ref_out.loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        bar = max(BF16, 2 * rel_err(hf_grads[name], g))
        err = rel_err(grads[name], g)
        assert err <= bar, f"grad {name}: {err:.3e} > {bar:.3e}"
    torch._dynamo.reset()
