"""Layer 3: TRL trainers that take `use_liger=True`."""
