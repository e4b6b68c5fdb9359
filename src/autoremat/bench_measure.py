"""One step of a bench target, measured: what the sweep and the compile subprocess share.

:func:`build_target` builds a target from a fixed seed; :func:`measure_step` runs one
instrumented step from a given RNG state (peak, FLOPs, gradients, buffers) and
:func:`time_step` one bare step (wall and CPU ms); :func:`max_diff` and
:func:`largest_grad` compare gradients. :func:`ratio_range` and :func:`first_line` turn
figures and failures into table cells. Used by :mod:`autoremat.bench` and
:mod:`autoremat.bench_compile`, so that neither imports the other.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .flops import FlopCounter
from .memory import track_memory
from .step import Loop, preserved_state, run_step

__all__ = ["Measure", "build_target", "first_line", "largest_grad", "max_diff",
           "measure_step", "ratio_range", "time_step"]


def build_target(target: str, overrides: dict[str, Any]) -> tuple[nn.Module, Any]:
    """``(model, inputs)`` of a zoo name or ``package.module:factory``, seeded and in
    train mode, so that every process builds the same model."""
    from .cli import load_target

    torch.manual_seed(0)  # factories that do not seed still build the same model each time
    model, inputs = load_target(target, overrides)
    model.train()
    return model, inputs


@dataclass(frozen=True)
class Measure:
    """What one instrumented step gave: peak and FLOPs, gradients and buffers after it."""

    peak_bytes: int
    flops: int
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


def measure_step(model: nn.Module, inputs: Any, rng: torch.Tensor, *,
                 loop: Loop = "holds_output") -> Measure:
    """Peak, FLOPs, gradients and buffers after one step from RNG state ``rng``, in the
    training loop ``loop`` (see NOTE [ Which loop a step models ] in ``step.py``)."""
    with preserved_state(model):
        torch.set_rng_state(rng)
        # Both modes in one step: the FLOP counter holds no tensors, so it does not
        # change what the memory tracker sees.
        with track_memory() as mem, FlopCounter() as counter:
            run_step(model, inputs, None, loop=loop)
        grads = {n: (p.grad.detach().clone() if p.grad is not None else None)
                 for n, p in model.named_parameters()}
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return Measure(mem.peak_bytes, counter.total, grads, buffers)


def time_step(model: nn.Module, inputs: Any, rng: torch.Tensor, *,
              loop: Loop = "holds_output") -> tuple[float, float]:
    """(wall ms, CPU ms of this process) of one plain, uninstrumented step in ``loop``."""
    with preserved_state(model):
        torch.set_rng_state(rng)
        wall, cpu = time.perf_counter(), time.process_time()
        run_step(model, inputs, None, loop=loop)
        return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def max_diff(a: dict[str, torch.Tensor | None],
             b: dict[str, torch.Tensor | None]) -> tuple[bool, float]:
    """(all torch.equal, max |a - b|) over matching entries; a missing one is unequal."""
    equal, worst = True, 0.0
    for name, x in a.items():
        y = b.get(name)
        if x is None or y is None:
            if (x is None) != (y is None):
                equal, worst = False, math.inf
            continue
        if x.shape != y.shape:
            equal, worst = False, math.inf
            continue
        if torch.equal(x, y):
            continue
        equal = False
        worst = max(worst, float((x.double() - y.double()).abs().max()))
    return equal, worst


def largest_grad(grads: dict[str, torch.Tensor | None]) -> float:
    """The largest |gradient| entry (1.0 when all are zero, to keep ratios finite)."""
    scale = max((float(g.abs().max()) for g in grads.values() if g is not None and g.numel()),
                default=0.0)
    return scale or 1.0


def ratio_range(times: list[float], reference_ms: float) -> tuple[float, float] | None:
    """(min, max) of ``times`` over ``reference_ms``, or None when either is missing."""
    if not times or not reference_ms:
        return None
    return min(times) / reference_ms, max(times) / reference_ms


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (at most 200 characters), for a table note."""
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
