"""Layer 1: Triton kernels with autograd Functions, nn.Modules and pure-PyTorch fallbacks."""
