"""Tests for autoremat._measure.optimizers: one table of optimizers for plan, estimate and doctor.

``plan(max_memory=, optimizer=)`` prices optimizer state from a tape alone, with the
table's states per parameter; ``estimate`` measures the real ``torch.optim`` class on
``meta``. Both must accept the same names and agree on the bytes.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

import pytest
import torch
from torch import nn

import autoremat
from autoremat import zoo
from autoremat._core.errors import RematError
from autoremat._estimate.estimate import Estimate, estimate
from autoremat._measure.optimizers import OPTIMIZERS, optimizer_memory
from autoremat._plan.budget import optimizer_state_bytes

# Every known name, spellings of them, names nobody knows, and sizes in bytes.
CANDIDATES: list[Any] = [*OPTIMIZERS, "AdamW", " sgd ", "lion", "adamww", "sgd_momentum",
                         "adafactor", "", 12345, 0, "1MiB", True, 1.5]


@cache
def _tiny() -> tuple[nn.Module, Any, Estimate]:
    model, inputs = zoo.build("mlp", device="meta", widths=(16, 16, 16), batch_size=2)
    return model, inputs, estimate(model, inputs, device="cpu", selective=False)


def _outcome(call: Any) -> tuple[str, str]:
    try:
        call()
    except RematError as exc:
        return type(exc).__name__, str(exc)
    return "accepted", ""


@pytest.mark.parametrize("name", CANDIDATES, ids=repr)
def test_plan_and_estimate_accept_the_same_optimizers(name: Any) -> None:
    model, inputs, est = _tiny()
    assert est.tape is not None
    by_plan = _outcome(lambda: autoremat.plan(est.tape, max_memory="1TiB", optimizer=name))
    by_estimate = _outcome(lambda: estimate(model, inputs, device="cpu", optimizer=name,
                                            selective=False))
    assert by_plan == by_estimate  # both accept it, or both refuse it with one message


def _meta_model(dtype: torch.dtype) -> nn.Module:
    # tensors of several sizes and a frozen one: a figure per tensor would show
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 3))
    model[1].bias.requires_grad_(False)
    return model.to("meta", dtype)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_states_per_parameter_agree_with_the_real_class(name: str, dtype: torch.dtype,
                                                        device: str) -> None:
    model = _meta_model(dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    measured, _ = optimizer_memory(model, name, device)
    spec = OPTIMIZERS[name]
    assert spec.state_bytes(trainable_bytes) + spec.counter_bytes(len(trainable), device) \
        == measured
    # on CUDA the scalar step counters stay on the CPU: the state is the states alone
    if device == "cuda":
        tape = type("TapeLike", (), {"trainable_param_bytes": trainable_bytes})()
        assert optimizer_state_bytes(tape, name) == measured  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_names_a_class_that_takes_its_arguments(name: str) -> None:
    spec = OPTIMIZERS[name]
    cls = getattr(torch.optim, spec.torch_class)
    takes = inspect.signature(cls).parameters
    assert set(spec.kwargs) <= set(takes)
    if spec.fused:  # doctor's fused-optimizer remedy constructs it with fused=True
        assert "fused" in takes
