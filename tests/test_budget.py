"""Tests for autoremat._plan.budget: the step budget a device's ``max_memory`` leaves.

``plan(tape, max_memory=, optimizer=)`` and ``estimate(..., max_memory=, optimizer=)``
used to derive it twice: plan left out the batch, and estimate counted the CPU's step
counters, so the same ``max_memory`` gave two budgets.
"""

from __future__ import annotations

import pytest

import autoremat
from autoremat import zoo
from autoremat._core.errors import BudgetError
from autoremat._core.step import unique_storage_bytes
from autoremat._estimate.estimate import estimate
from autoremat._plan.budget import IterationMemory, iteration_memory, step_budget_bytes

WIDTHS = (64, 256, 256, 64)  # a batch of 512 x 64 fp32 = 128 KiB, counted in no step peak


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd", None])
def test_plan_and_estimate_leave_one_budget(device: str, optimizer: str | None) -> None:
    model, inputs = zoo.build("mlp", device="meta", widths=WIDTHS, batch_size=512)
    est = estimate(model, inputs, device=device, optimizer=optimizer, selective=False)
    assert est.tape is not None and est.input_bytes > 0
    limit = est.total_peak_bytes  # the plain step just fits
    by_estimate = estimate(model, inputs, device=device, optimizer=optimizer, selective=False,
                           max_memory=limit).budget_bytes
    by_plan = autoremat.plan(est.tape, max_memory=limit, optimizer=optimizer).budget_bytes
    assert by_plan == by_estimate == est.with_plan(max_memory=limit).budget_bytes
    # the rule: what parameters, buffers, optimizer state and the batch leave
    assert by_plan == limit - (est.param_bytes + est.buffer_bytes + est.optimizer_bytes
                               + est.input_bytes)
    assert by_plan == est.step_peak_bytes  # the limit was the plain iteration's peak


def test_a_real_cpu_tape_and_a_cpu_estimate_leave_one_budget() -> None:
    model, inputs = zoo.build("mlp", widths=WIDTHS, batch_size=512)
    tape = autoremat.profile(model, inputs, repeats=1, with_selective=False, timing=False)
    est = estimate(model, inputs, device="cpu", optimizer="adamw", selective=False)
    assert tape.input_bytes == est.input_bytes == unique_storage_bytes(inputs)
    limit = est.total_peak_bytes + 4096
    planned = est.with_plan(max_memory=limit)
    assert autoremat.plan(tape, max_memory=limit, optimizer="adamw").budget_bytes == \
        planned.budget_bytes
    # the iteration with the plan fits the device
    assert planned.plan_total_peak_bytes is not None and planned.plan_total_peak_bytes <= limit


def _memory(**changes: int) -> IterationMemory:
    figures = {"param_bytes": 1000, "buffer_bytes": 100, "optimizer_bytes": 2000,
               "input_bytes": 300, "grad_bytes": 1000, "optimizer_step_bytes": 500}
    return IterationMemory(**{**figures, **changes})


def test_the_rule_by_hand() -> None:
    memory = _memory()
    assert memory.resting_bytes == 3400  # parameters, buffers, optimizer state, batch
    assert step_budget_bytes(10_000, memory) == 6600
    assert step_budget_bytes("10000", memory) == 6600
    # the optimizer step (gradients and its temporaries) is a peak of its own
    assert memory.peak_bytes(6600) == 10_000 and memory.peak_bytes(0) == 3400 + 1500
    assert step_budget_bytes(3400 + 1500, memory) == 1500  # just room for optimizer.step()
    with pytest.raises(BudgetError, match="whatever is recomputed") as info:
        step_budget_bytes(3400 + 1499, memory)
    assert info.value.min_feasible_bytes == 3400 + 1500
    with pytest.raises(BudgetError, match="does not even hold the parameters"):
        step_budget_bytes(3000, _memory(grad_bytes=0, optimizer_step_bytes=0))


def test_a_tape_without_the_batch_size_cannot_take_max_memory() -> None:
    model, inputs = zoo.build("mlp", device="meta", widths=(16, 16), batch_size=2)
    tape = estimate(model, inputs, device="cpu", selective=False).tape
    assert tape is not None
    old = autoremat.Tape.from_json(tape.to_json().replace(
        f'"input_bytes": {tape.input_bytes}', '"input_bytes": -1'))
    with pytest.raises(BudgetError, match="profile again"):
        iteration_memory(old, None)
    # a step budget still works
    assert autoremat.plan(old, budget="100%").budget_bytes == tape.step_peak_bytes
