"""Layer 2: the chunked fused-linear engine and the losses built on it."""
