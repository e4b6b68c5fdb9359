"""Tests for autoremat.verify: the guarantees of a plan, measured, on every zoo model.

The matrix runs each zoo model at its default size (dropout active, BatchNorm in the
ResNet) at budgets 75%, 50%, 30% and the smallest feasible, for the optimal plan and for
full / sqrt / every:2, and checks what the planner issue promises:

* every gradient ``torch.equal`` to the plain model's;
* the measured step peak within the budget;
* the predicted peak within 5% of the measured one;
* the predicted recompute FLOPs within 2% of the flop counter's extra FLOPs.

Identical plans (e.g. ``full`` at every budget it fits) are verified once per model.
Set ``AUTOREMAT_VERIFY_TABLE=path.md`` to write the measured table there.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autoremat
from autoremat import Plan, Report, Tape, zoo
from autoremat.errors import BudgetError, RematError
from autoremat.plan import smallest_feasible_bytes
from autoremat.units import format_bytes
from autoremat.verify import measure_step

BUDGETS = ["75%", "50%", "30%", "min"]
STRATEGIES = ["optimal", "full", "sqrt", "every:2"]


_ROWS: list[dict[str, Any]] = []


@dataclasses.dataclass
class Case:
    name: str
    model: nn.Module
    inputs: Any
    tape: Tape
    reports: dict[Any, Report]

    def verify(self, plan: Plan) -> Report:
        key = tuple((b.name, b.decision, b.segment, b.save_ops, b.keep_ops, b.skip_ops)
                    for b in plan.blocks)
        if key not in self.reports:
            autoremat.apply(self.model, plan)
            try:
                self.reports[key] = autoremat.verify(self.model, self.inputs, repeats=1)
            finally:
                autoremat.remove(self.model)
        return self.reports[key]


@pytest.fixture(scope="module", params=zoo.names())
def case(request: pytest.FixtureRequest) -> Iterator[Case]:
    model, inputs = zoo.build(request.param)
    yield Case(request.param, model, inputs, autoremat.profile(model, inputs, repeats=1), {})


@pytest.fixture(scope="module", autouse=True)
def _write_table() -> Iterator[None]:
    yield
    path = os.environ.get("AUTOREMAT_VERIFY_TABLE")
    if not path or not _ROWS:
        return
    lines = ["| model | budget | strategy | measured peak | predicted peak | error | "
             "recompute FLOPs (% of step) | grads equal | step time / plain |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in _ROWS:
        lines.append(f"| {r['model']} | {r['budget']} | {r['strategy']} | "
                     f"{format_bytes(r['measured'])} | {format_bytes(r['predicted'])} | "
                     f"{r['error']:+.2f}% | {r['flops']:.1f}% | {r['grads_equal']} | "
                     f"{r['time']:.2f} |")
    Path(path).write_text("\n".join(lines) + "\n")


def _limit(tape: Tape, budget: str) -> int:
    if budget == "min":
        return smallest_feasible_bytes(tape)
    return int(tape.step_peak_bytes * float(budget[:-1]) / 100)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("budget", BUDGETS)
def test_plan_guarantees_hold_when_measured(case: Case, budget: str, strategy: str,
                                            request: pytest.FixtureRequest) -> None:
    limit = _limit(case.tape, budget)
    try:
        plan = autoremat.plan(case.tape, limit, strategy)
    except BudgetError as err:
        assert err.min_feasible_bytes == smallest_feasible_bytes(case.tape)
        assert not (strategy == "optimal" and budget == "min")
        if strategy == "optimal":
            assert err.min_feasible_bytes > limit
        return  # the refusal above is the tested behaviour for this budget
    report = case.verify(plan)
    _ROWS.append({
        "model": case.name, "budget": budget, "strategy": strategy,
        "measured": report.peak_bytes, "predicted": plan.predicted_peak_bytes,
        "error": 100 * report.prediction_error, "flops": 100 * report.recompute_overhead,
        "grads_equal": report.grads_equal, "time": report.time_ratio,
    })
    assert report.grads_equal, f"max |grad diff| {report.max_grad_diff}"
    assert report.max_grad_diff == 0.0
    assert report.plain_peak_bytes == case.tape.step_peak_bytes  # deterministic accounting
    assert report.peak_bytes <= limit, (
        f"measured {report.peak_bytes} > budget {limit} (predicted {plan.predicted_peak_bytes})")
    assert report.recompute_flops == pytest.approx(plan.predicted_recompute_flops, rel=0.02)
    assert abs(report.prediction_error) <= 0.05, (
        f"predicted {plan.predicted_peak_bytes}, measured {report.peak_bytes}")


@pytest.mark.slow
def test_some_budget_below_the_unplanned_peak_is_verified(case: Case) -> None:
    plan = autoremat.plan(case.tape, "75%")  # feasible on every zoo model
    report = case.verify(plan)
    assert report.ok and report.peak_bytes <= 0.75 * report.plain_peak_bytes


# --- verify's own contract, on small models ---------------------------------------------------


def _small(name: str = "gpt2") -> tuple[nn.Module, Any, Tape]:
    sizes: dict[str, dict[str, Any]] = {
        "gpt2": {"n_layer": 4, "batch_size": 2, "seq_len": 64},
        "resnet": {"batch_size": 8, "image_size": 16},
        "mlp": {"widths": (96, 64, 128, 48), "batch_size": 64},
    }
    model, inputs = zoo.build(name, **sizes[name])
    return model, inputs, autoremat.profile(model, inputs, repeats=1)


@pytest.fixture(scope="module")
def gpt2() -> tuple[nn.Module, Any, Tape]:
    return _small("gpt2")


def test_report_of_a_full_plan(gpt2: tuple[nn.Module, Any, Tape]) -> None:
    model, inputs, tape = gpt2
    plan = autoremat.plan(tape, "90%", "full")
    autoremat.apply(model, plan)
    try:
        report = autoremat.verify(model, inputs)
    finally:
        autoremat.remove(model)
    assert report.ok and report.grads_equal and report.max_grad_diff == 0.0
    assert report.budget_bytes == plan.budget_bytes
    assert report.predicted_peak_bytes == plan.predicted_peak_bytes
    assert report.plain_peak_bytes == tape.step_peak_bytes
    assert report.peak_bytes == tape.ckpt_step_peak_bytes < report.plain_peak_bytes
    assert report.plain_flops == tape.step_flops
    assert report.recompute_flops == sum(b.fwd_flops for b in tape.blocks)
    assert report.recompute_overhead == pytest.approx(report.recompute_flops / tape.step_flops)
    assert report.step_ms > 0 and report.plain_step_ms > 0 and report.time_ratio > 0
    assert report.time_spread >= 0
    text = str(report)
    assert text.startswith("verify: OK") and "gradients equal" in text
    assert format_bytes(report.peak_bytes) in text


def test_a_plan_that_keeps_everything_changes_nothing(gpt2: tuple[nn.Module, Any, Tape]) -> None:
    model, inputs, tape = gpt2
    report = autoremat.verify(model, inputs, autoremat.plan(tape, None, "none"), repeats=1)
    assert report.ok and report.grads_equal
    assert report.recompute_flops == 0 and report.peak_bytes == report.plain_peak_bytes
    assert report.budget_bytes is None


def test_over_budget_is_not_ok(gpt2: tuple[nn.Module, Any, Tape]) -> None:
    model, inputs, tape = gpt2
    plan = dataclasses.replace(autoremat.plan(tape, None, "full"), budget_bytes=1)
    report = autoremat.verify(model, inputs, plan, repeats=1)
    assert report.grads_equal and not report.ok
    assert report.peak_bytes > report.budget_bytes == 1
    assert str(report).startswith("verify: FAILED")


class _Jitter(nn.Module):
    """Scales by Python's ``random``, which checkpoint does not restore on recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) * (1 + random.random()))


class _JitterChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Jitter() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).sum()


def test_different_gradients_are_reported() -> None:
    """verify must be able to fail: a block that is not deterministic under recompute."""
    torch.manual_seed(0)
    model, x = _JitterChain(), torch.randn(8, 16)
    plan = autoremat.plan(autoremat.profile(model, x, repeats=1), None, "full")
    report = autoremat.verify(model, x, plan, repeats=1)
    assert not report.grads_equal and not report.ok
    assert report.max_grad_diff > 0
    assert "DIFFER" in str(report)


def test_verify_leaves_model_grads_buffers_and_rng_as_they_were() -> None:
    model, inputs, tape = _small("resnet")
    plan = autoremat.plan(tape, None, "sqrt")
    marker = torch.full_like(model.fc.weight, 7.0)
    model.fc.weight.grad = marker
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    state = torch.get_rng_state()
    report = autoremat.verify(model, inputs, plan, repeats=1)
    assert report.grads_equal
    assert model.fc.weight.grad is marker
    assert all(p.grad is None for n, p in model.named_parameters() if n != "fc.weight")
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), state)
    assert autoremat.applied_plan(model) is None  # it was not applied before
    assert all("forward" not in vars(m) for m in model.modules())
    assert model.training


def test_verify_keeps_the_applied_plan(gpt2: tuple[nn.Module, Any, Tape]) -> None:
    model, inputs, tape = gpt2
    applied = autoremat.plan(tape, None, "every:2")
    other = autoremat.plan(tape, None, "full")
    autoremat.apply(model, applied)
    try:
        by_default = autoremat.verify(model, inputs, repeats=1)  # the applied plan
        explicit = autoremat.verify(model, inputs, other, repeats=1)
        assert autoremat.applied_plan(model) is applied
    finally:
        autoremat.remove(model)
    assert by_default.recompute_flops == applied.predicted_recompute_flops
    assert explicit.recompute_flops == other.predicted_recompute_flops
    assert by_default.recompute_flops < explicit.recompute_flops


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "verify() needs a plan: pass plan=..., or apply one first"),
    ({"repeats": 0}, "repeats must be at least 1, got 0"),
])
def test_verify_errors(gpt2: tuple[nn.Module, Any, Tape], kwargs: dict[str, Any],
                       message: str) -> None:
    model, inputs, tape = gpt2
    if "repeats" in kwargs:
        kwargs = dict(kwargs, plan=autoremat.plan(tape, None, "full"))
    with pytest.raises(RematError) as info:
        autoremat.verify(model, inputs, **kwargs)
    assert message in str(info.value)


def test_measure_step_leaves_no_trace() -> None:
    model, inputs, tape = _small("mlp")
    params = dict(model.named_parameters())
    m = measure_step(model, inputs, None)
    assert m.peak_bytes == tape.step_peak_bytes
    assert m.flops == tape.step_flops
    assert m.grads.keys() == params.keys()
    assert all(g is not None and g.shape == params[n].shape for n, g in m.grads.items())
    assert all(p.grad is None for p in model.parameters())
    again = measure_step(model, inputs, None, rng=torch.get_rng_state())
    assert all(torch.equal(m.grads[n], again.grads[n]) for n in params)
