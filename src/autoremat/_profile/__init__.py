"""Layer 4, profile: one instrumented training step becomes a Tape."""
