"""Layer 0, the base: errors, units, the training step, RNG, timing, memory tracking, op records."""
