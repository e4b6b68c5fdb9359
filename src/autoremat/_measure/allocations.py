"""A memory timeline from the allocator's own reports, for steps ``track_memory`` cannot see.

NOTE [ Measuring a compiled step from the allocator ]
    ``track_memory`` is a Python dispatch mode, and with one active Dynamo runs compiled
    frames eagerly: it would measure the eager step. Code Inductor generates allocates
    through the same allocators as eager (``empty_strided`` in its wrapper), and both
    the CPU allocator and the CUDA caching allocator report every allocation and free to
    the profiler when ``torch.profiler.profile(profile_memory=True)`` runs. That is no
    dispatch mode, so compiled code stays compiled. :func:`track_allocations` turns
    those reports into the same :class:`~autoremat._measure.memory.MemoryTracker` timeline
    (levels, marks, storages born and freed), so every window, peak and saved-bytes
    figure ``profile`` takes from a tracked step it can take from a compiled one.

    Marks are profiler events (a ``record_function`` named ``autoremat.mark.<k>``) put
    on the same clock as the allocations and sorted with them. Figures are the
    allocator's: on CPU bytes as requested, on CUDA the caching allocator's blocks. Two
    differences from ``track_memory``: memory allocated before the region and freed
    inside it is not seen (PyTorch warns once that such a free is not reported), and a
    storage is not tied to the op that made it, so records name the op ``"allocation"``.
    A record counts as made in backward when it is born after the mark ``"backward"``
    (the training step's, ``step.run_step``), which the breakdown needs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

from autoremat._measure.memory import MemoryTracker, StorageRecord

__all__ = ["AllocationTracker", "quiet_fds", "track_allocations"]

_PREFIX = "autoremat.mark."


@dataclass
class AllocationTracker(MemoryTracker):
    """A :class:`MemoryTracker` filled from allocator reports when its region exits."""

    device: str = "cpu"
    _labels: list[str] = field(default_factory=list)

    def mark(self, label: str) -> None:
        """Label the current point of the timeline (a profiler event, ordered by time)."""
        self._labels.append(label)
        with record_function(f"{_PREFIX}{len(self._labels) - 1}"):
            pass


def _events(prof: Any) -> list[Any]:
    out: list[Any] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        out.append(event)
        stack.extend(event.children)
    return out


def _same_device(reported: Any, device: torch.device) -> bool:
    got = torch.device(reported)
    if got.type != device.type:
        return False
    return device.index is None or got.index in (None, device.index)


@contextmanager
def track_allocations(device: torch.device | str = "cpu") -> Iterator[AllocationTracker]:
    """Track ``device``'s allocations in a region, compiled code included.

    Yields an :class:`AllocationTracker`, filled in when the region exits (levels are
    bytes above the level at entry). See NOTE [ Measuring a compiled step from the
    allocator ].

    Example:
        >>> import torch
        >>> with track_allocations("cpu") as mem:
        ...     x = torch.ones(1024)
        ...     mem.mark("made")
        ...     del x
        >>> mem.peak_bytes, mem.current_bytes, mem.marks[0][1]
        (4096, 0, 'made')
    """
    target = torch.device(device)
    tracker = AllocationTracker(device=str(target))
    prof = torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_fds(2):
        prof.start()
    try:
        yield tracker
    finally:
        with quiet_fds(2):
            prof.stop()
    _fill(tracker, _events(prof), target)


@contextmanager
def quiet_fds(*fds: int) -> Iterator[None]:
    """Silence the process's file descriptors ``fds`` (default: 2, stderr) inside the block,
    for native code that prints on its own: Kineto logs a line each time the profiler
    starts or stops ("USDT: ... profiler_start", dozens per profile), and HiGHS can print
    its internal trace to stdout from C++ during a keep-set solve (``keepsets.py``).
    Nothing of the user's runs inside; Python exceptions are not affected.

    Example:
        >>> with quiet_fds(1, 2):
        ...     _ = os.write(1, b"native noise")  # goes nowhere
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [(fd, os.dup(fd)) for fd in (fds or (2,))]
    try:
        with open(os.devnull, "w") as null:
            for fd, _ in saved:
                os.dup2(null.fileno(), fd)
        yield
    finally:
        for fd, copy in saved:
            os.dup2(copy, fd)
            os.close(copy)


def _fill(tracker: AllocationTracker, events: list[Any], device: torch.device) -> None:
    timeline: list[tuple[int, int, Any]] = []  # (time, order, payload)
    for order, event in enumerate(events):
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if _same_device(fields.device, device) and fields.alloc_size:
                timeline.append((event.start_time_ns, order, fields))
        elif event.name.startswith(_PREFIX):
            timeline.append((event.start_time_ns, order, int(event.name[len(_PREFIX):])))
    timeline.sort(key=lambda item: (item[0], item[1]))
    live: dict[int, StorageRecord] = {}
    backward_at: int | None = None
    for _, _, payload in timeline:
        if isinstance(payload, int):
            label = tracker._labels[payload]
            tracker.marks.append((len(tracker.levels) - 1, label))
            if label == "backward" and backward_at is None:
                backward_at = len(tracker.levels) - 1
            continue
        size = int(payload.alloc_size)
        tracker._record(size, "allocation" if size > 0 else "free")
        event = len(tracker.levels) - 1
        if size > 0:
            record = StorageRecord(size, "allocation", event, backward_at is not None)
            tracker.records.append(record)
            live[payload.ptr] = record
        else:
            record_or_none = live.pop(payload.ptr, None)
            if record_or_none is not None:
                record_or_none.died = event
    tracker._closed = True
