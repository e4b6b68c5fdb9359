"""Layer 2, measure: one instrumented training step becomes a Tape."""
