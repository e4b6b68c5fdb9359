"""One step of a bench target, measured: what the sweep and the compile subprocess share.

:func:`build_target` builds a target from a fixed seed on the device
:func:`resolve_device` accepts; :func:`bench_measure` runs one instrumented step from a
given RNG state (peak, FLOPs, gradients, buffers; on CUDA also the allocator's peak) and
:func:`time_step` one bare step (wall ms, CUDA-synchronised on a GPU, and CPU ms of the
process); :func:`largest_grad` sizes gradients (``verify.max_grad_diff`` compares
them). :func:`ratio_range` and :func:`first_line` turn
figures and failures into table cells. Used by :mod:`autoremat._bench.bench` and
:mod:`autoremat._bench.compiled`, so that neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoremat._core.decisions import Decision
from autoremat._core.errors import RematError
from autoremat._core.step import Step, map_tensors
from autoremat._measure.flops import FlopCounter
from autoremat._measure.measured import measure_step
from autoremat._plan.plan import Plan
from autoremat._targets import load_target

__all__ = ["DTYPES", "BenchMeasure", "bench_measure", "build_target", "describe_plan", "first_line",
           "largest_grad", "ratio_range", "resolve_device", "time_step"]


def resolve_device(text: str) -> torch.device:
    """The device ``bench --device`` names: ``cpu`` or an available CUDA device.

    Raises:
        RematError: a malformed name, another kind of device, or CUDA not available.
    """
    try:
        device = torch.device(text)
    except RuntimeError as exc:
        raise RematError(f"--device {text!r} is not a device name: use cpu, cuda or "
                         f"cuda:N") from exc
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise RematError(f"--device {text}: bench measures on cpu or cuda, not "
                         f"{device.type}")
    if not torch.cuda.is_available():
        raise RematError(f"--device {text}: no CUDA device is available "
                         f"(torch.cuda.is_available() is False; this PyTorch "
                         f"{torch.__version__} was built "
                         + (f"with CUDA {torch.version.cuda}" if torch.version.cuda
                            else "without CUDA") + "); run with --device cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise RematError(f"--device {text}: this machine has {count} CUDA device(s), "
                         f"cuda:0 to cuda:{count - 1}")
    return device


DTYPES = ("float32", "bfloat16", "float16")  # bench --dtype


def build_target(target: str, overrides: dict[str, Any], device: torch.device | str = "cpu",
                 dtype: str = "float32") -> tuple[nn.Module, Any]:
    """``(model, inputs)`` of a zoo name or ``package.module:factory``, seeded and in
    train mode, so that every process builds the same model; built on the CPU, then
    moved (model and every input tensor) to ``device``. ``dtype`` (one of
    :data:`DTYPES`) other than float32 applies to zoo models only."""
    if dtype not in DTYPES:
        raise RematError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    torch.manual_seed(0)  # factories that do not seed still build the same model each time
    model, inputs = load_target(target, overrides, dtype=None if dtype == "float32"
                                else getattr(torch, dtype))
    model.train()
    device = torch.device(device)
    if device.type != "cpu":
        model.to(device)
        inputs = map_tensors(lambda t: t.to(device), inputs)
    return model, inputs


@dataclass(frozen=True)
class BenchMeasure:
    """What one instrumented step gave: peak and FLOPs, gradients and buffers after it."""

    peak_bytes: int  # the storage tracker's (CUDA storages in allocator blocks)
    flops: int
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    allocator_peak_bytes: int | None = None  # rise of max_memory_allocated (CUDA only)


def bench_measure(step: Step, rng: torch.Tensor) -> BenchMeasure:
    """Peak, FLOPs, gradients and buffers after one step from RNG state ``rng``, in the
    step's training loop (see NOTE [ Which loop a step models ] in ``step.py``); on CUDA
    also the rise of ``torch.cuda.max_memory_allocated()`` over the same step (peak
    statistics reset just before it)."""
    # All three in one step: neither the FLOP counter nor the tracker holds tensors, so
    # none changes what the others see.
    counter = FlopCounter()
    run = measure_step(step, memory="storages", allocator=True, counter=counter, rng=rng,
                       grads=True, buffers=True)
    assert run.grads is not None and run.buffers is not None  # for mypy: asked for
    return BenchMeasure(run.peak_bytes, counter.total, run.grads, run.buffers,
                        run.allocator_peak_bytes)


def time_step(step: Step, rng: torch.Tensor) -> tuple[float, float]:
    """(wall ms, CPU ms of this process) of one plain, uninstrumented step from RNG state
    ``rng``; the wall time is CUDA-synchronised on a GPU (``timing.py``)."""
    run = measure_step(step, timed=True, rng=rng)
    assert run.wall_ms is not None and run.cpu_ms is not None  # for mypy: asked for
    return run.wall_ms, run.cpu_ms


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


def describe_plan(chosen: Plan) -> str:
    """A plan in a few words for a table note: ``recomputes blocks 0, 2-3, 5(sel)``."""
    parts = []
    for start, stop, decision in chosen.segments:
        if decision is Decision.KEEP:
            continue
        what = f"{start}" if stop == start + 1 else f"{start}-{stop - 1}"
        if decision is Decision.SELECTIVE:
            what += "(sel)"
        parts.append(what)
    budget = (f" under compile's activation_memory_budget={chosen.compile_memory_budget:g}, "
              f"random draws saved" if chosen.compile_memory_budget is not None else "")
    if not parts:
        return "keeps every block" + budget
    return "recomputes blocks " + ", ".join(parts) + budget
