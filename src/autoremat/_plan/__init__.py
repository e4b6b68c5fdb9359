"""Layer 3, plan: pure functions from a Tape and a budget to a Plan."""
