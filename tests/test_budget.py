"""Tests for autoremat._plan.budget: the step budget a device's ``max_memory`` leaves.

``plan(tape, max_memory=, optimizer=)`` and ``estimate(..., max_memory=, optimizer=)``
used to derive it twice: plan left out the batch, and estimate counted the CPU's step
counters, so the same ``max_memory`` gave two budgets.
"""

from __future__ import annotations

import json

import pytest

import autoremat
from autoremat import zoo
from autoremat._core.errors import BudgetError, SchemaError
from autoremat._core.step import unique_storage_bytes
from autoremat._core.units import format_bytes
from autoremat._estimate.estimate import estimate
from autoremat._plan.budget import IterationMemory, iteration_memory, step_budget_bytes
from autoremat._plan.strategies import smallest_feasible_bytes

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


def test_a_max_memory_no_plan_fits_says_the_max_memory_that_does() -> None:
    # the error spoke of the step budget alone, which the user never gave
    model, inputs = zoo.build("mlp", widths=WIDTHS, batch_size=512)
    tape = autoremat.profile(model, inputs, repeats=1, with_selective=False, timing=False)
    memory = iteration_memory(tape, "adamw")
    need = memory.peak_bytes(smallest_feasible_bytes(tape))
    autoremat.plan(tape, max_memory=need, optimizer="adamw")  # it fits
    with pytest.raises(BudgetError, match=rf"max_memory {format_bytes(need - 1)} leaves a "
                       rf"step budget of .*adamw optimizer state.* As max_memory: at least "
                       rf".* \({need} bytes\)") as info:
        autoremat.plan(tape, max_memory=need - 1, optimizer="adamw")
    assert info.value.min_feasible_bytes == smallest_feasible_bytes(tape)  # a step budget
    with pytest.raises(BudgetError) as info:  # budget= the tighter: told as before
        autoremat.plan(tape, budget=1, max_memory=need, optimizer="adamw")
    assert "max_memory" not in str(info.value)


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


# --- NOTE [ The margin kept for the CUDA allocator ] -----------------------------------


def _cuda_tape() -> autoremat.Tape:
    """A tape for a CUDA device, estimated on ``meta``: its blocks in CUDA's 512-byte
    blocks, as a tape measured there."""
    model, inputs = zoo.build("gpt2", device="meta", n_layer=4, n_embd=64, n_head=4,
                              seq_len=32, batch_size=2)
    tape = estimate(model, inputs, device="cuda", selective=False).tape
    assert tape is not None and tape.device == "cuda"
    return tape


def test_a_cuda_tape_is_planned_under_the_budget_less_the_margin() -> None:
    tape = _cuda_tape()
    peak, least = tape.step_peak_bytes, smallest_feasible_bytes(tape)
    for budget in (peak, (peak + least) // 2, least):
        kept = autoremat.plan(tape, budget)
        room = budget * 100 // 103  # floor(budget / 1.03)
        assert kept.budget_bytes == budget and kept.margin_bytes == budget - room > 0
        assert kept.predicted_peak_bytes <= room
        assert f"{format_bytes(kept.margin_bytes)} of it kept as margin" in str(kept)
        tight = autoremat.plan(tape, budget, margin=0)
        assert tight.margin_bytes == 0 and tight.predicted_peak_bytes <= budget
        assert tight.predicted_cost <= kept.predicted_cost
    # at the plain step's own peak, without the margin every block is kept; with it not
    assert autoremat.plan(tape, peak, margin=0).recompute_blocks == 0
    assert autoremat.plan(tape, peak).recompute_blocks > 0


def test_the_smallest_feasible_budget_holds_the_margin() -> None:
    tape = _cuda_tape()
    least, bare = smallest_feasible_bytes(tape), smallest_feasible_bytes(tape, margin=0)
    assert least == -(-bare * 103 // 100)  # ceil(peak * 1.03)
    assert autoremat.plan(tape, least).predicted_peak_bytes == bare
    with pytest.raises(BudgetError, match=r"less the margin kept \(plans predict at most "
                       r"the budget / 1\.03: plan.s margin=0\.03") as info:
        autoremat.plan(tape, least - 1)
    assert info.value.min_feasible_bytes == least
    assert f"({least} bytes)" in str(info.value)
    # a fixed strategy is refused on the same terms
    full = autoremat.plan(tape, None, "full").predicted_peak_bytes
    with pytest.raises(BudgetError, match="no 'full' plan fits") as info:
        autoremat.plan(tape, full, "full")
    assert info.value.min_feasible_bytes == least
    assert autoremat.plan(tape, full, "full", margin=0).predicted_peak_bytes == full


def test_a_cpu_tape_keeps_no_margin_unless_asked() -> None:
    model, inputs = zoo.build("mlp", device="meta", widths=WIDTHS, batch_size=512)
    tape = estimate(model, inputs, device="cpu", selective=False).tape
    assert tape is not None
    budget = tape.step_peak_bytes
    assert autoremat.plan(tape, budget).margin_bytes == 0
    assert smallest_feasible_bytes(tape) == smallest_feasible_bytes(tape, margin=0)
    asked = autoremat.plan(tape, budget, margin=0.25)
    assert asked.margin_bytes == budget - budget * 4 // 5
    assert asked.predicted_peak_bytes <= budget * 4 // 5
    assert autoremat.plan(tape, None, "full", margin=0.25).margin_bytes == 0  # no budget


@pytest.mark.parametrize("bad", [-0.01, 1, 1.5, "3%", True, float("nan")])
def test_a_margin_outside_0_to_1_is_refused(bad: object) -> None:
    tape = _cuda_tape()
    with pytest.raises(BudgetError, match=r"margin must be a number in \[0, 1\)"):
        autoremat.plan(tape, "50%", margin=bad)  # type: ignore[arg-type]
    model, inputs = zoo.build("mlp", widths=(16, 16), batch_size=4)
    with pytest.raises(BudgetError, match="margin must be"):  # before any work
        autoremat.auto(model, inputs, budget="50%", margin=bad)  # type: ignore[arg-type]


def test_auto_keeps_the_margin_it_is_given() -> None:
    model, inputs = zoo.build("mlp", widths=WIDTHS, batch_size=512)
    chosen = autoremat.auto(model, inputs, budget="95%", margin=0.1)
    assert chosen.budget_bytes is not None and chosen.margin_bytes > 0
    assert chosen.predicted_peak_bytes + chosen.margin_bytes <= chosen.budget_bytes
    autoremat.remove(model)


def test_a_plan_file_keeps_its_margin_and_refuses_one_edited_over_the_budget() -> None:
    tape = _cuda_tape()
    kept = autoremat.plan(tape, smallest_feasible_bytes(tape))
    again = autoremat.Plan.from_json(kept.to_json(), tape=tape)
    assert again == kept and again.margin_bytes > 0
    data = json.loads(kept.to_json())
    data["margin_bytes"] = data["budget_bytes"]
    with pytest.raises(SchemaError, match=r"plus plan\.margin_bytes"):
        autoremat.Plan.from_json(json.dumps(data))
    bare = json.loads(autoremat.plan(tape, None, "full").to_json())
    bare["margin_bytes"] = 1
    with pytest.raises(SchemaError, match="plan without a budget"):
        autoremat.Plan.from_json(json.dumps(bare))
