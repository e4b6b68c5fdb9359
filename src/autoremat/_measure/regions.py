"""What each op of a checkpointed region made on the memory timeline.

An instrument for one memory step with every block checkpointed: a ``context_fn``
(``RegionTagger``) whose contexts, around the region's forward and its recompute, have
the storage tracker tell them the events each op made, and which note the event at which
the region's checkpoint frame was freed. ``_profile/derive.py`` derives selective options
from it (NOTE [ Selective windows from the checkpointed step ] there).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from autoremat._measure.memory import MemoryTracker, active_tracker
from autoremat._measure.ops import IGNORED_OPS, result_leaves

__all__ = ["OpEvents", "RegionCall", "RegionTagger"]


@dataclass
class OpEvents:
    """One op of a region as it ran: the timeline's events it made are
    ``first..stop - 1``."""

    func: Any
    first: int
    stop: int
    storages: int  # distinct storages of the tensors it returned
    drawn: int = 0  # a Bernoulli draw returned as a tensor: its elements (0: none)
    drawn_bool: bool = False  # the draw is bool already (kept as itself, not a copy)
    device: torch.device | None = None  # of the draw
    returns_first: bool = False  # it returned its first argument (in-place ops)
    all_tensors: bool = True  # it returned tensors only


@dataclass
class RegionCall:
    """What one checkpointed call of a block ran (its ops by position, as ``selective.py``
    numbers them), on the timeline of ``mem``."""

    forward: list[OpEvents] = field(default_factory=list)
    recompute: list[OpEvents] = field(default_factory=list)
    freed: int | None = None  # the last event before the frame was freed
    mem: MemoryTracker | None = None


class _Region:
    """Entered around a region's forward (or its recompute): while it is, the storage
    tracker tells it each op the region runs (``MemoryTracker.region``), and it notes the
    op's events in ``ops``, positions counted as ``selective.py`` counts them
    (``IGNORED_OPS`` aside). No dispatch mode of its own: the tracker's sees every op."""

    def __init__(self, call: RegionCall, ops: list[OpEvents]) -> None:
        self.call, self.ops = call, ops
        self.tracker: MemoryTracker | None = None
        self.previous: Any = None

    def __enter__(self) -> _Region:
        tracker = self.tracker = active_tracker()
        if tracker is not None:
            if self.call.mem is None:
                self.call.mem = tracker
            if self.ops is self.call.recompute:
                self.ops.clear()  # NOTE [ Contexts a backward may enter again ]
            self.previous, tracker.region = tracker.region, self._note
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.tracker is not None:
            self.tracker.region = self.previous

    def _note(self, func: Any, args: tuple[Any, ...], out: Any, first: int) -> None:
        if func in IGNORED_OPS or self.tracker is None:
            return
        if isinstance(out, torch.Tensor):  # most ops: one tensor, one storage
            storages, all_tensors = 1, True
        else:  # the tracker's handler pays this on every op
            leaves = result_leaves(out)
            tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
            storages = len({t.untyped_storage()._cdata for t in tensors})
            all_tensors = len(tensors) == len(leaves)
        position = OpEvents(func=func, first=first, stop=len(self.tracker.levels),
                            storages=storages, returns_first=bool(args) and out is args[0],
                            all_tensors=all_tensors)
        if "bernoulli" in func.__name__ and isinstance(out, torch.Tensor):
            position.drawn, position.drawn_bool = out.numel(), out.dtype == torch.bool
            position.device = out.device
        self.ops.append(position)


class RegionTagger:
    """A ``context_fn`` for the checkpointed memory step: tags every call of its block
    (``calls``, one per forward) and notes when the call's frame is freed."""

    def __init__(self) -> None:
        self.calls: list[RegionCall] = []

    def __call__(self) -> tuple[_Region, _Region]:
        tags = RegionCall()
        self.calls.append(tags)
        recompute = _Region(tags, tags.recompute)
        # the frame holds the recompute context (as it holds selective's _Kept)
        weakref.finalize(recompute, _note_freed, tags)
        return _Region(tags, tags.forward), recompute


def _note_freed(tags: RegionCall) -> None:
    if tags.mem is not None and not tags.mem._closed:
        tags.freed = len(tags.mem.levels) - 1
