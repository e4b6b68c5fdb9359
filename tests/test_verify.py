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
import math
import os
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch._prims_common import alert_not_deterministic

import autoremat
from autoremat import Plan, Report, Tape, zoo
from autoremat._core.errors import BudgetError, DeterminismError, RematError
from autoremat._core.units import format_bytes
from autoremat._plan.strategies import smallest_feasible_bytes
from autoremat._verify import (
    NOISE_MULTIPLE,
    _check_cublas_workspace,
    judge_gradients,
    step_measure,
)

from _steps import verified
from conftest import MEDIUM

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
def case(request: pytest.FixtureRequest, zoo_tapes: Callable[..., Tape]) -> Iterator[Case]:
    # the tape is the session's (test_plan plans over the same one); the model is fresh
    model, inputs = zoo.build(request.param)
    yield Case(request.param, model, inputs, zoo_tapes(request.param), {})


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


@pytest.fixture(scope="module")
def small(zoo_tapes: Callable[..., Tape]) -> Callable[[str], tuple[nn.Module, Any, Tape]]:
    """``small(name)``: a fresh zoo model at MEDIUM sizes, its inputs, and the session's
    tape of it (test_apply plans over the same tapes)."""

    def get(name: str) -> tuple[nn.Module, Any, Tape]:
        model, inputs = zoo.build(name, **MEDIUM[name])
        return model, inputs, zoo_tapes(name, **MEDIUM[name])

    return get


@pytest.fixture(scope="module")
def gpt2(small: Callable[[str], tuple[nn.Module, Any, Tape]]) -> tuple[nn.Module, Any, Tape]:
    return small("gpt2")


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
    """Scales by a count of its calls kept in a dict, which its recompute sees one higher:
    the same ops on other values, which no check can see (autoremat refuses blocks that
    draw from Python's ``random``, and recomputes a Python number attribute the forward
    changed as the forward found it, the examples before)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.state = {"calls": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state["calls"] += 1
        return torch.tanh(self.fc(x) * (1 + 0.1 * self.state["calls"]))


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


def test_verify_leaves_model_grads_buffers_and_rng_as_they_were(
        small: Callable[[str], tuple[nn.Module, Any, Tape]]) -> None:
    model, inputs, tape = small("resnet")
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
    ({"repeats": 0}, "repeats must be a whole number >= 1 (the steps timed), got 0"),
])
def test_verify_errors(gpt2: tuple[nn.Module, Any, Tape], kwargs: dict[str, Any],
                       message: str) -> None:
    model, inputs, tape = gpt2
    if "repeats" in kwargs:
        kwargs = dict(kwargs, plan=autoremat.plan(tape, None, "full"))
    with pytest.raises(RematError) as info:
        autoremat.verify(model, inputs, **kwargs)
    assert message in str(info.value)


def test_step_measure_leaves_no_trace(
        small: Callable[[str], tuple[nn.Module, Any, Tape]]) -> None:
    model, inputs, tape = small("mlp")
    params = dict(model.named_parameters())
    m = step_measure(autoremat.Step(model, inputs))
    assert m.peak_bytes == tape.step_peak_bytes
    assert m.flops == tape.step_flops
    assert m.grads.keys() == params.keys()
    assert all(g is not None and g.shape == params[n].shape for n, g in m.grads.items())
    assert all(p.grad is None for p in model.parameters())
    again = step_measure(autoremat.Step(model, inputs), rng=torch.get_rng_state())
    assert all(torch.equal(m.grads[n], again.grads[n]) for n in params)


# --- judging gradients: deterministic mode and the noise floor -------------------------------
# NOTE [ Judging gradients ] in _verify.py. CPU kernels are deterministic, so the floor is
# exercised with models that bring their own nondeterminism: _Noisy adds fresh noise to
# its backward from a private generator (as atomic adds do on CUDA, nothing resets it),
# and a redrawing block seeds its dropout mask from numpy's global RNG (which verify
# restores between steps, and a recompute does not replay), so a recomputed block draws
# a different mask (a wrong plan on purpose).

_NOISE = 1e-6  # absolute noise _Noisy adds to each gradient entry (gradients are ~1e-2)


class _AddNoise(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        ctx.gen = gen
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        noise = torch.randn(grad.shape, generator=ctx.gen, dtype=grad.dtype) * _NOISE
        return grad + noise, None


class _Block(nn.Module):
    """Linear + tanh; ``noisy``: gradient noise in backward; ``redraw``: a dropout mask
    seeded from numpy's global RNG (another draw on recompute: numpy's RNG is not replayed,
    and verify restores it between steps)."""

    def __init__(self, noisy: bool, redraw: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.gen = torch.Generator().manual_seed(1234) if noisy else None
        self.redraw = redraw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        if self.redraw:
            masks = torch.Generator().manual_seed(int(np.random.randint(0, 2**31 - 1)))
            h = h * (torch.rand(h.shape, generator=masks) > 0.5) * 2.0
        if self.gen is not None:
            h = _AddNoise.apply(h, self.gen)
        return h


class _Chain(nn.Module):
    def __init__(self, noisy: bool = False, redraw: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(noisy, redraw) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).sum()


def _chain_case(noisy: bool = False, redraw: bool = False,
                strategy: str = "full") -> tuple[nn.Module, torch.Tensor, Plan]:
    torch.manual_seed(0)
    model, x = _Chain(noisy, redraw), torch.randn(8, 16)
    return model, x, autoremat.plan(autoremat.profile(model, x, repeats=1), None, strategy)


def _grads(*values: float | None) -> dict[str, torch.Tensor | None]:
    return {f"p{i}": None if v is None else torch.tensor([1.0, v])
            for i, v in enumerate(values)}


@pytest.mark.parametrize(("plain", "planned", "floor", "verdict", "diff"), [
    (_grads(2.0), _grads(2.0), 0.0, "equal", 0.0),
    (_grads(2.0), _grads(2.0), 0.5, "equal", 0.0),  # equal needs no floor
    (_grads(2.0), _grads(2.5), 0.0, "differ", 0.5),  # a floor of 0: exact equality only
    (_grads(2.0), _grads(2.5), 0.125, "within noise", 0.5),  # 0.5 == 4 x 0.125: allowed
    (_grads(2.0), _grads(2.5), 0.124, "differ", 0.5),  # just over 4 floors
    (_grads(2.0, 3.0), _grads(2.0, 3.25), 0.0625, "within noise", 0.25),
    (_grads(None, 3.0), _grads(None, 3.0), 0.0, "equal", 0.0),  # no gradient on both sides
    (_grads(None), _grads(2.0), 1.0, "differ", math.inf),  # one side lacks a gradient
    (_grads(2.0), _grads(math.nan), 1.0, "differ", math.nan),  # NaN: no floor accepts it
])
def test_judge_gradients(plain: dict[str, torch.Tensor | None],
                         planned: dict[str, torch.Tensor | None], floor: float, verdict: str,
                         diff: float) -> None:
    judged = judge_gradients(plain, planned, floor)
    assert judged.verdict == verdict
    assert judged.grads_equal == (verdict == "equal")
    assert judged.noise_floor == floor
    if math.isnan(diff):
        assert math.isnan(judged.max_grad_diff)
    else:
        assert judged.max_grad_diff == diff


def test_judge_gradients_of_another_shape_differ() -> None:
    judged = judge_gradients({"w": torch.zeros(2)}, {"w": torch.zeros(3)}, 1.0)
    assert judged.verdict == "differ" and judged.max_grad_diff == math.inf


@pytest.mark.parametrize("floor", [-1e-9, math.nan, math.inf])
def test_judge_gradients_refuses_a_floor_that_is_not_a_finite_number(floor: float) -> None:
    with pytest.raises(RematError, match="noise_floor must be a finite number"):
        judge_gradients(_grads(2.0), _grads(2.0), floor)


def test_report_verdict_follows_its_fields() -> None:
    report = Report(ok=True, grads_equal=False, max_grad_diff=3e-8, peak_bytes=1,
                    plain_peak_bytes=1, predicted_peak_bytes=1, budget_bytes=None,
                    recompute_flops=0, plain_flops=1, step_ms=1.0, plain_step_ms=1.0,
                    time_spread=0.0, noise_floor=1e-8, noise_measured=True)
    assert report.grads_verdict == "within noise"
    assert not report.deterministic and report.peak_source == "tracker"
    text = str(report)
    assert "gradients within noise, max |diff| 3e-08, noise floor 1e-08" in text
    assert f"(allowed: {NOISE_MULTIPLE:g}x)" in text
    assert dataclasses.replace(report, noise_floor=0.0).grads_verdict == "differ"


def test_a_correct_plan_is_within_the_noise_floor() -> None:
    """A model that is nondeterministic on its own: the plan differs from the plain step as
    much as the plain step differs from itself, and is judged ok for that."""
    model, x, plan = _chain_case(noisy=True)
    report = autoremat.verify(model, x, plan, repeats=1, measure_noise=True)
    assert report.noise_measured and report.noise_floor > 0
    assert not report.grads_equal and report.max_grad_diff > 0
    assert report.max_grad_diff <= NOISE_MULTIPLE * report.noise_floor
    assert report.grads_verdict == "within noise" and report.ok
    assert "gradients within noise" in str(report)
    # the CPU's default measures the floor once the gradients differ, and takes it: this
    # noise is within rounding of the largest gradient (64 epsilons)
    default = autoremat.verify(model, x, plan, repeats=1)
    assert default.noise_measured and default.grads_verdict == "within noise" and default.ok


_ORDER = random.Random(0)  # a generator of its own: nothing puts it back between steps


class _ReorderedLinear(nn.Linear):
    """A linear layer that sums in another order from call to call, as a grouped matmul
    with two threads does on the CPU (Qwen3-MoE's experts): run-to-run rounding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the bias added in two parts split anew on each call: the rounding differs
        first = self.bias * _ORDER.random()
        return (x @ self.weight.T + first) + (self.bias - first)


def test_a_plain_step_that_rounds_differently_each_run_is_its_own_floor_on_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the gradients are not torch.equal, the CPU's default runs the plain step
    once more: a floor of rounding judges the plan (a plan that keeps every block failed
    on a held-out Qwen3-MoE before); a floor beyond rounding (the noisy chain above) or
    none leaves torch.equal the judge."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(_ReorderedLinear(32, 32), nn.Tanh())
                            for _ in range(4)))
    x = torch.randn(64, 32)
    tape = autoremat.profile(model, x, repeats=1)
    for strategy in ("none", "full"):
        report = autoremat.verify(model, x, autoremat.plan(tape, None, strategy), repeats=1)
        assert report.noise_measured and report.noise_floor > 0, strategy
        assert report.grads_verdict in ("equal", "within noise") and report.ok, strategy
    chain, y, plan = _chain_case(redraw=True)  # a wrong plan, on a deterministic model
    report = autoremat.verify(chain, y, plan, repeats=1)
    assert report.noise_measured and report.noise_floor == 0.0 and not report.ok
    monkeypatch.setattr(sys.modules[__name__], "_NOISE", 1e-2)  # noise beyond rounding
    chain, y, plan = _chain_case(noisy=True)
    report = autoremat.verify(chain, y, plan, repeats=1)
    assert not report.noise_measured and report.grads_verdict == "differ" and not report.ok


def test_a_wrong_plan_fails_against_the_noise_floor() -> None:
    model, x, plan = _chain_case(noisy=True, redraw=True)
    report = autoremat.verify(model, x, plan, repeats=1, measure_noise=True)
    assert report.noise_measured and report.noise_floor > 0  # a floor to hide in...
    assert report.max_grad_diff > 100 * NOISE_MULTIPLE * report.noise_floor  # ...but no
    assert report.grads_verdict == "differ" and not report.ok
    assert "gradients DIFFER" in str(report) and "noise floor" in str(report)


def test_a_wrong_plan_fails_with_a_zero_floor() -> None:
    """Python's random is restored between steps, so the plain step reproduces itself
    exactly: the floor is 0 and only torch.equal would pass."""
    model, x, plan = _chain_case(redraw=True)
    report = autoremat.verify(model, x, plan, repeats=1, measure_noise=True)
    assert report.noise_measured and report.noise_floor == 0.0
    assert report.max_grad_diff > 0 and report.grads_verdict == "differ" and not report.ok


def test_a_wrong_plan_fails_under_deterministic_algorithms() -> None:
    model, x, plan = _chain_case(redraw=True)
    report = autoremat.verify(model, x, plan, repeats=1, deterministic=True)
    assert report.deterministic and not report.noise_measured and report.noise_floor == 0.0
    assert not report.grads_equal and report.grads_verdict == "differ" and not report.ok
    assert "deterministic algorithms" in str(report)
    assert not torch.are_deterministic_algorithms_enabled()


def test_deterministic_verify_of_a_correct_plan(gpt2: tuple[nn.Module, Any, Tape]) -> None:
    model, inputs, tape = gpt2
    plan = autoremat.plan(tape, "90%", "full")
    report = autoremat.verify(model, inputs, plan, repeats=1, deterministic=True)
    assert report.ok and report.deterministic and report.grads_equal
    assert report.grads_verdict == "equal" and report.max_grad_diff == 0.0
    assert report.peak_bytes == tape.ckpt_step_peak_bytes  # determinism changes no bytes
    assert not torch.are_deterministic_algorithms_enabled()


def test_the_floor_of_a_deterministic_model_on_cpu_is_zero(
        gpt2: tuple[nn.Module, Any, Tape]) -> None:
    model, inputs, tape = gpt2
    report = autoremat.verify(model, inputs, autoremat.plan(tape, None, "full"), repeats=1,
                              measure_noise=True)
    assert report.noise_measured and report.noise_floor == 0.0
    assert report.ok and report.grads_equal


class _NoDeterministicKernel(nn.Module):
    """Calls torch's own alert, as an op without a deterministic kernel does."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alert_not_deterministic("my_scatter_kernel")
        for block in self.blocks:
            x = block(x)
        return x.sum()


@pytest.mark.parametrize("previous", [(False, False), (True, True)])
def test_an_op_without_a_deterministic_kernel_is_a_determinism_error(
        previous: tuple[bool, bool]) -> None:
    torch.manual_seed(0)
    model, x = _NoDeterministicKernel(), torch.randn(2, 4)
    plan = autoremat.plan(autoremat.profile(model, x, repeats=1), None, "full")
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    try:
        with pytest.raises(DeterminismError) as info:
            autoremat.verify(model, x, plan, repeats=1, deterministic=True)
        # the setting the caller had comes back, warn_only included
        assert (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) == previous
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    message = str(info.value)
    assert "my_scatter_kernel has no deterministic implementation" in message
    assert "deterministic=False" in message and "noise floor" in message
    assert isinstance(info.value.__cause__, RuntimeError)  # torch's error, chained
    assert autoremat.applied_plan(model) is None


@pytest.mark.parametrize(("device", "environ", "fails"), [
    ("cuda", {}, True),
    ("cuda:0", {"CUBLAS_WORKSPACE_CONFIG": ":4096:2"}, True),
    ("cuda", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, False),
    ("cuda", {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, False),
    ("cpu", {}, False),  # no cuBLAS on the CPU
])
def test_deterministic_cuda_needs_the_cublas_workspace_setting(
        device: str, environ: dict[str, str], fails: bool) -> None:
    if not fails:
        _check_cublas_workspace(device, environ)  # no error
        return
    with pytest.raises(DeterminismError) as info:
        _check_cublas_workspace(device, environ)
    message = str(info.value)
    assert "CUBLAS_WORKSPACE_CONFIG=:4096:8" in message
    assert "before" in message or "start the process" in message
    assert "deterministic=False" in message


def test_deterministic_and_measure_noise_exclude_each_other(
        gpt2: tuple[nn.Module, Any, Tape]) -> None:
    model, inputs, tape = gpt2
    with pytest.raises(RematError, match="pass one"):
        autoremat.verify(model, inputs, autoremat.plan(tape, None, "full"),
                         deterministic=True, measure_noise=True)


class _NanGrad(nn.Module):
    """A linear layer whose weight's gradient is NaN: sqrt(0 * y) has the derivative
    0 * inf (as timm's LambdaNet's lambda convolutions give under bf16 on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y + torch.sqrt(y * 0)


def test_gradients_nan_in_the_plain_step_are_equal_where_the_plan_gives_them_too() -> None:
    # NOTE [ Gradients that are NaN in the plain step ]: every plan was judged "differ",
    # max |diff| NaN, though it gave the plain step's gradients bit for bit
    torch.manual_seed(0)
    model, x = nn.Sequential(*(_NanGrad() for _ in range(3))), torch.randn(4, 8)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.square().mean()

    tape = autoremat.profile(model, x, loss, timing=False)
    with pytest.warns(UserWarning, match=r"plain step's gradients are not finite \(NaN or "
                                         r"inf\) in 0\.lin\.weight"):
        report = verified(model, x, autoremat.plan(tape, strategy="full"), loss_fn=loss,
                          repeats=1)
    assert report.ok and report.grads_equal and report.max_grad_diff == 0.0
    nan = float("nan")
    one_side = judge_gradients({"w": torch.tensor([1.0, nan])}, {"w": torch.tensor([1.0, 2.0])})
    assert one_side.verdict == "differ" and math.isnan(one_side.max_grad_diff)
    both = judge_gradients({"w": torch.tensor([1.0, nan])}, {"w": torch.tensor([1.0, nan])})
    assert both.verdict == "equal" and both.max_grad_diff == 0.0
    elsewhere = judge_gradients({"w": torch.tensor([1.0, nan])}, {"w": torch.tensor([1.5, nan])})
    assert elsewhere.verdict == "differ" and elsewhere.max_grad_diff == 0.5
