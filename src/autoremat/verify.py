"""``verify``: run the step with and without the plan and compare what matters."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .apply import applied_plan, apply, remove
from .errors import RematError
from .flops import FlopCounter
from .memory import track_memory
from .plan import Plan
from .step import LossFn, preserved_state, run_step, training_config
from .tables import render_table
from .units import format_bytes

__all__ = ["Report", "measure_step", "verify"]


@dataclass(frozen=True)
class Report:
    """What :func:`verify` measured. ``ok``: gradients equal and peak within budget."""

    ok: bool
    grads_equal: bool  # every gradient torch.equal to the plain model's
    max_grad_diff: float  # max |grad - plain grad| over all parameters
    peak_bytes: int  # measured step peak with the plan
    plain_peak_bytes: int  # measured step peak without it
    predicted_peak_bytes: int  # the plan's prediction
    budget_bytes: int | None  # the plan's budget
    recompute_flops: int  # extra FLOPs of the planned step (flop counter)
    plain_flops: int  # FLOPs of the plain step
    step_ms: float  # median planned step time (interleaved with plain)
    plain_step_ms: float  # median plain step time
    time_spread: float  # (max - min) / median of the planned step times

    @property
    def recompute_overhead(self) -> float:
        return self.recompute_flops / self.plain_flops if self.plain_flops else 0.0

    @property
    def time_ratio(self) -> float:
        return self.step_ms / self.plain_step_ms if self.plain_step_ms else float("nan")

    @property
    def prediction_error(self) -> float:
        """(predicted - measured) / measured peak."""
        return (self.predicted_peak_bytes - self.peak_bytes) / max(self.peak_bytes, 1)

    def __str__(self) -> str:
        budget = format_bytes(self.budget_bytes) if self.budget_bytes is not None else "none"
        rows = [
            ["step peak", format_bytes(self.plain_peak_bytes), format_bytes(self.peak_bytes)],
            ["predicted peak", "", format_bytes(self.predicted_peak_bytes)],
            ["FLOPs", f"{self.plain_flops / 1e9:.3f} G",
             f"{(self.plain_flops + self.recompute_flops) / 1e9:.3f} G"],
            ["step time (median)", f"{self.plain_step_ms:.1f} ms", f"{self.step_ms:.1f} ms"],
        ]
        verdict = "OK" if self.ok else "FAILED"
        return (f"verify: {verdict} (budget {budget}; gradients "
                f"{'equal' if self.grads_equal else 'DIFFER'}, max |diff| "
                f"{self.max_grad_diff:.3g}; recompute +{100 * self.recompute_overhead:.1f}% "
                f"FLOPs, time x{self.time_ratio:.2f})\n"
                + render_table(["", "plain", "planned"], rows))


@dataclass(frozen=True)
class StepMeasure:
    peak_bytes: int
    flops: int
    grads: dict[str, torch.Tensor | None]


@contextmanager
def _same_start(model: nn.Module, rng: torch.Tensor) -> Iterator[None]:
    with preserved_state(model):
        torch.set_rng_state(rng)
        yield


def measure_step(model: nn.Module, inputs: Any, loss_fn: LossFn | None,
                 rng: torch.Tensor | None = None) -> StepMeasure:
    """One step: measured peak, FLOPs and gradients (clones), leaving no trace."""
    rng = torch.get_rng_state() if rng is None else rng
    with _same_start(model, rng):
        with track_memory() as mem:
            run_step(model, inputs, loss_fn)
        grads = {n: (p.grad.detach().clone() if p.grad is not None else None)
                 for n, p in model.named_parameters()}
    with _same_start(model, rng), FlopCounter() as counter:
        run_step(model, inputs, loss_fn)
    return StepMeasure(mem.peak_bytes, counter.total, grads)


def _time_step(model: nn.Module, inputs: Any, loss_fn: LossFn | None,
               rng: torch.Tensor) -> float:
    with _same_start(model, rng):
        start = time.perf_counter()
        run_step(model, inputs, loss_fn)
        return (time.perf_counter() - start) * 1e3


def verify(model: nn.Module, inputs: Any, plan: Plan | None = None, *,
           loss_fn: LossFn | None = None, repeats: int = 3) -> Report:
    """Run one step with and one without the plan and compare them.

    Both steps start from the same RNG state and BatchNorm statistics, so dropout draws
    the same masks; gradients are compared with ``torch.equal``. Times are medians of
    ``repeats`` interleaved plain/planned steps after one warm-up each.

    Args:
        plan: the plan to check; default the plan applied to ``model``.

    Returns:
        A :class:`Report`. ``report.ok`` is true only when every gradient is equal and
        the measured peak is within the plan's budget (when it has one). The model is
        left with the plan applied, its gradients, buffers and the RNG as before.

    Example:
        >>> import autoremat
        >>> model, inputs = autoremat.zoo.build("mlp")
        >>> plan = autoremat.auto(model, inputs, budget="90%")
        >>> autoremat.verify(model, inputs).grads_equal
        True
    """
    before = applied_plan(model)
    plan = plan or before
    if plan is None:
        raise RematError("verify() needs a plan: pass plan=..., or apply one first "
                         "(autoremat.apply / autoremat.auto)")
    if repeats < 1:
        raise RematError(f"repeats must be at least 1, got {repeats}")
    rng = torch.get_rng_state()
    stack = ExitStack()
    remove(model)
    try:
        stack.enter_context(training_config(model))  # both steps without a KV cache
        plain = measure_step(model, inputs, loss_fn, rng)
        apply(model, plan)
        planned = measure_step(model, inputs, loss_fn, rng)
        plain_ms, planned_ms = [], []
        for r in range(repeats + 1):
            remove(model)
            t_plain = _time_step(model, inputs, loss_fn, rng)
            apply(model, plan)
            t_planned = _time_step(model, inputs, loss_fn, rng)
            if r:  # the first pair is a warm-up
                plain_ms.append(t_plain)
                planned_ms.append(t_planned)
    finally:
        remove(model)
        stack.close()
        if before is not None:
            apply(model, before)
        torch.set_rng_state(rng)
    equal, max_diff = True, 0.0
    for name, g in plain.grads.items():
        h = planned.grads[name]
        if g is None or h is None:
            equal = equal and g is None and h is None
            continue
        equal = equal and torch.equal(g, h)
        if g.numel():
            max_diff = max(max_diff, float((g.float() - h.float()).abs().max()))
    within = plan.budget_bytes is None or planned.peak_bytes <= plan.budget_bytes
    med = statistics.median(planned_ms)
    return Report(
        ok=equal and within, grads_equal=equal, max_grad_diff=max_diff,
        peak_bytes=planned.peak_bytes, plain_peak_bytes=plain.peak_bytes,
        predicted_peak_bytes=plan.predicted_peak_bytes, budget_bytes=plan.budget_bytes,
        recompute_flops=planned.flops - plain.flops, plain_flops=plain.flops,
        step_ms=med, plain_step_ms=statistics.median(plain_ms),
        time_spread=(max(planned_ms) - min(planned_ms)) / med if med else 0.0,
    )
