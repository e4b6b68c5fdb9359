"""Layer 5, estimate and doctor: the step measured on fake tensors, for runs too big to run."""
