"""Layer 3: one-line patching of Hugging Face causal LMs with liger_losses kernels."""
