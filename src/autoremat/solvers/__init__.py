"""Solvers: pure functions from a Tape (and a budget) to segment decisions."""
