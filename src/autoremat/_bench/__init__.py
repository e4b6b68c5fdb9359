"""Layer 8, bench: side-by-side sweeps against PyTorch's own options."""
