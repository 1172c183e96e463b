"""Experiment (GPU): what PEFT's LoRA forward costs under autocast, and the fused adapter forward.

Question: under ``bf16=True`` autocast with fp32 adapters (PEFT's default), PEFT's ``lora.Linear``
copies its input to fp32 (which autocast copies back to bf16) and makes three passes over the
output per adapter. How much of a LoRA decoder layer's forward + backward is that, and what does
``liger_losses.patching.lora`` (the adapter as one ``addmm`` into the base output) save?

One Llama decoder layer at Llama-3-8B widths (H 4096, I 14336, 32/8 heads), LoRA r=16 alpha 32 on
all seven linears, bf16 weights, fp32 adapters, CUDA autocast bf16, tokens = batch x seq. Prints
``do_bench`` median ms of forward + backward and the peak above the inputs (MiB) for PEFT's forward
and the patched one, and the relative difference of output and adapter gradients between them.

H200 (torch 2.11, PEFT 0.21): 4 x 2048 tokens PEFT 21.75 ms / 2694 MiB, fused 18.74 / 2150; 4 x 8192
99.7 / 10770 against 83.5 / 8594; outputs and gradients equal to 1e-8 (the adapter's share rounds
away in bf16 at these weights). Status: answered; ``apply_liger_kernels(..., lora=True)`` is the
default.

    python -m benchmark.experiments.diag_lora_linear
"""

from __future__ import annotations

import copy

import torch

MIB = 2**20


def _layer():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=1024, num_hidden_layers=1, torch_dtype="bfloat16")
    cfg._attn_implementation = "sdpa"

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = LlamaDecoderLayer(cfg, 0)
            self.rotary = LlamaRotaryEmbedding(cfg)

        def forward(self, x):
            pos = torch.arange(x.shape[1], device=x.device)[None]
            return self.layer(x, position_embeddings=self.rotary(x, pos), attention_mask=None, position_ids=pos)

    torch.manual_seed(0)
    base = Wrap().cuda().bfloat16()
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, lora)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    return model


def main():
    import triton.testing

    from liger_losses.patching.lora import patch_lora_linears

    peft_model = _layer()
    ours = copy.deepcopy(peft_model)
    print("patched layers:", patch_lora_linears(ours))
    print("adapter dtypes:", sorted({str(p.dtype) for n, p in peft_model.named_parameters() if "lora" in n}))
    for batch, seq in ((4, 2048), (4, 8192)):
        x = torch.randn(batch, seq, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        results = {}
        for name, model in (("peft", peft_model), ("ours", ours)):
            def step(model=model):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(x)
                    out = out[0] if isinstance(out, tuple) else out
                out.float().square().mean().backward()
                return out

            step()
            model.zero_grad(set_to_none=True)
            x.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = step()
            peak = (torch.cuda.max_memory_allocated() - base) / MIB
            grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
            results[name] = (out.detach().float(), grads, x.grad.float().clone())
            model.zero_grad(set_to_none=True)
            x.grad = None
            ms = triton.testing.do_bench(step, warmup=5, rep=100, grad_to_none=[x])
            model.zero_grad(set_to_none=True)
            print(f"{batch}x{seq} {name}: {ms:.2f} ms fwd+bwd, peak {peak:.0f} MiB", flush=True)
        (o1, g1, x1), (o2, g2, x2) = results["peft"], results["ours"]
        rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
        worst = max(rel(g2[k], g1[k]) for k in g1)
        print(f"{batch}x{seq}: output rel diff {rel(o2, o1):.2e}, x grad {rel(x2, x1):.2e}, "
              f"worst parameter grad {worst:.2e}", flush=True)


if __name__ == "__main__":
    main()
