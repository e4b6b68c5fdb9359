"""Layer 7, bench: side-by-side sweeps against PyTorch's own options."""
