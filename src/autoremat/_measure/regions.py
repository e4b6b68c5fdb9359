"""What each op of a checkpointed region made on the memory timeline.

An instrument for one memory step with every block checkpointed: a ``context_fn``
(``RegionTagger``) whose modes, inside the region's forward and its recompute, note the
events of the storage tracker below them that each op made, and the event at which the
region's checkpoint frame was freed. ``_profile/derive.py`` derives selective options
from it (NOTE [ Selective windows from the checkpointed step ] there).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autoremat._measure.memory import MemoryTracker, active_tracker
from autoremat._measure.ops import IGNORED_OPS

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


class _TagMode(TorchDispatchMode):
    """Notes, for each op of the region (``IGNORED_OPS`` aside, as ``selective.py``
    counts positions), the events the memory tracker below it made."""

    def __init__(self, tags: RegionCall, ops: list[OpEvents]) -> None:
        super().__init__()
        self.tags, self.ops = tags, ops

    def __enter__(self) -> _TagMode:
        if self.ops is self.tags.recompute:
            self.ops.clear()  # NOTE [ Contexts a backward may enter again ]
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        tags = self.tags
        if tags.mem is None:
            tags.mem = active_tracker()
        first = len(tags.mem.levels) if tags.mem is not None else 0
        out = func(*args, **(kwargs or {}))
        if func in IGNORED_OPS or tags.mem is None:
            return out
        leaves = tree_flatten(out)[0]
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        position = OpEvents(func=func, first=first, stop=len(tags.mem.levels),
                            storages=len({t.untyped_storage()._cdata for t in tensors}),
                            returns_first=bool(args) and out is args[0],
                            all_tensors=all(isinstance(t, torch.Tensor) for t in leaves))
        if "bernoulli" in func.__name__ and isinstance(out, torch.Tensor):
            position.drawn, position.drawn_bool = out.numel(), out.dtype == torch.bool
            position.device = out.device
        self.ops.append(position)
        return out


class RegionTagger:
    """A ``context_fn`` for the checkpointed memory step: tags every call of its block
    (``calls``, one per forward) and notes when the call's frame is freed."""

    def __init__(self) -> None:
        self.calls: list[RegionCall] = []

    def __call__(self) -> tuple[_TagMode, _TagMode]:
        tags = RegionCall()
        self.calls.append(tags)
        recompute = _TagMode(tags, tags.recompute)
        # the frame holds the recompute context (as it holds selective's _Kept)
        weakref.finalize(recompute, _note_freed, tags)
        return _TagMode(tags, tags.forward), recompute


def _note_freed(tags: RegionCall) -> None:
    if tags.mem is not None and not tags.mem._closed:
        tags.freed = len(tags.mem.levels) - 1
