"""Timing a step or a region of it: CUDA events on a GPU, ``time.perf_counter`` elsewhere.

:func:`clock_for` picks a :class:`Clock` by device; :func:`time_ms` times one call with it;
:func:`~autoremat._core.step.device_of` finds the device of a model's step (its parameters,
else its inputs). ``profile`` (block boundaries), ``verify`` and ``bench`` (whole steps)
time through here, so every time autoremat reports is taken the same way.

NOTE [ CUDA-synchronised times ]
    CUDA kernels run asynchronously: ``perf_counter`` around a step measures how long the
    CPU took to *launch* its kernels, which can be a fraction of the time the GPU takes to
    run them. On CUDA a stamp is an event recorded on the current stream
    (``torch.cuda.Event(enable_timing=True)``); the GPU timestamps it when it reaches it in
    stream order, and the elapsed times are read after one ``synchronize`` at the end, so
    stamping costs no synchronisation inside the region. ``time_ms`` also synchronises
    before the start, so that a step does not absorb the tail of the work queued before
    it. Stamps made in backward hooks run on the autograd engine's device thread, whose
    current stream is the one forward used: still in stream order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch

__all__ = ["Clock", "CudaClock", "WallClock", "clock_for", "clock_kind", "time_ms"]

ClockKind = Literal["cuda", "wall"]


class Clock(Protocol):
    """Takes stamps inside a region; elapsed times between them are read after ``sync``."""

    def sync(self) -> None:
        """Wait until the device has finished the work queued so far."""

    def stamp(self) -> Any:
        """A mark of the current point of the region."""

    def elapsed_ms(self, start: Any, stop: Any) -> float:
        """Milliseconds from stamp ``start`` to stamp ``stop``; call after :meth:`sync`."""


class WallClock:
    """``time.perf_counter`` stamps; nothing to synchronise (CPU, meta)."""

    def sync(self) -> None:
        pass

    def stamp(self) -> float:
        return time.perf_counter()

    def elapsed_ms(self, start: float, stop: float) -> float:
        return (stop - start) * 1e3


class CudaClock:
    """CUDA events on ``device``'s current stream (NOTE [ CUDA-synchronised times ]).

    Making one touches no CUDA state; the first :meth:`stamp` or :meth:`sync` does.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def stamp(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed_ms(self, start: torch.cuda.Event, stop: torch.cuda.Event) -> float:
        return float(start.elapsed_time(stop))


def clock_kind(device: torch.device | str) -> ClockKind:
    """``"cuda"`` (events) for a CUDA device, ``"wall"`` (``perf_counter``) for any other.

    Example:
        >>> clock_kind("cuda:1"), clock_kind("cpu")
        ('cuda', 'wall')
    """
    return "cuda" if torch.device(device).type == "cuda" else "wall"


def clock_for(device: torch.device | str) -> Clock:
    """The clock that times work on ``device`` (see :func:`clock_kind`)."""
    device = torch.device(device)
    if clock_kind(device) == "cuda":
        return CudaClock(device)
    return WallClock()


def time_ms(fn: Callable[[], object], device: torch.device | str) -> float:
    """Milliseconds ``fn()`` takes on ``device``: device-synchronised on CUDA.

    Example:
        >>> time_ms(lambda: sum(range(1000)), "cpu") > 0
        True
    """
    clock = clock_for(device)
    clock.sync()
    start = clock.stamp()
    fn()
    stop = clock.stamp()
    clock.sync()
    return clock.elapsed_ms(start, stop)
