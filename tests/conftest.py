"""Shared fixtures: a small profiled model whose tape the tape and profile tests reuse."""

from __future__ import annotations

import os

import pytest

# Deterministic cuBLAS (the gpu tier compares gradients with torch.equal) needs this set
# before CUDA initialises; it changes nothing on the CPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from autoremat import Tape, profile, zoo


@pytest.fixture(scope="session")
def tiny_tape() -> Tape:
    """The tape of a three-block MLP (milliseconds to profile)."""
    model, inputs = zoo.build("mlp", widths=(32, 16, 24), d_in=16, batch_size=8)
    return profile(model, inputs, repeats=1)
