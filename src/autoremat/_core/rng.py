"""Random-number state for recompute: the draws of a recompute are the forward's draws.

NOTE [ Replaying the forward's RNG ]
    A recomputed dropout must draw the mask the forward drew, or the gradients are
    silently wrong. ``torch.utils.checkpoint`` restores the CPU state and the states of
    the devices of the tensors passed *positionally* to the checkpointed function. Two of
    autoremat's paths fall outside that:

    * a multi-block segment (``segments.py``) opens checkpoint's frame from a hook,
      with no function arguments at all, so no device state was stashed: on CUDA every
      block after the first of a segment re-drew its dropout masks;
    * inside a selective block (``selective.py``) recompute does not re-run every op:
      kept outputs are handed back, dead ops are skipped, and Bernoulli draws are copied
      back from bits. An op that draws *inside* its kernel (SDPA's ``dropout_p``, fused
      dropout) and is kept or skipped consumes no random numbers in recompute, so
      every random op after it would see a shifted stream.

    So autoremat owns the RNG replay itself, one rule for every path:

    * :func:`snapshot` reads the state of every generator a block can draw from (the
      CPU's and each initialised CUDA device's, :func:`generators`) when a checkpointed
      region's forward starts, and :func:`replaying` sets them back for its recompute
      and restores what they held afterwards (also when recompute stops early or
      raises);
    * the selective modes also snapshot the generators just before each random op whose
      draw recompute will run again, and restore that snapshot just before re-running
      it, so a replayed op draws exactly what it drew in forward whatever ran, or did
      not run, before it.

    A snapshot costs one ``get_state`` per generator: 16 bytes of seed and offset for a
    CUDA generator, about 5 KB for the CPU's Mersenne Twister. Snapshots are host memory
    and never on the device.

    A ``torch.Generator`` a module of the region holds as an attribute
    (``self.gen = torch.Generator()``, drawn with ``torch.rand(..., generator=self.gen)``)
    is replayed too (:func:`generator_slots`): left out, its recompute drew the next
    numbers of its stream, and gradients were silently wrong.

Known limitations:
    * Generators held elsewhere (a global, a closure) and those of XPU/MPS devices are
      not replayed; ``generators`` and ``generator_slots`` are the places to add them.
    * CUDA states are read on the host; under CUDA graph capture ``get_state`` is not
      allowed, and autoremat does not support capture.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["RngSnapshot", "generator_slots", "generators", "replaying", "snapshot"]


def generators() -> list[torch.Generator]:
    """The generators a block's random ops can draw from: the default CPU generator and,
    once CUDA is initialised, the default generator of every CUDA device.

    CUDA is never initialised here (a CPU-only run must not create a CUDA context).
    """
    found = [torch.default_generator]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        found.extend(torch.cuda.default_generators)
    return found


def generator_slots(modules: Iterable[nn.Module]) -> list[tuple[nn.Module, str]]:
    """Where ``modules`` and their submodules hold a generator as an attribute: (module,
    attribute name) pairs, read again at each forward.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> layer.gen = torch.Generator()
        >>> generator_slots([layer]) == [(layer, "gen")]
        True
    """
    return [(m, name) for module in modules for m in module.modules()
            for name, value in vars(m).items() if isinstance(value, torch.Generator)]


@dataclass(frozen=True)
class RngSnapshot:
    """The states of some generators at one moment."""

    states: tuple[tuple[torch.Generator, torch.Tensor], ...]

    def restore(self) -> None:
        """Set every generator back to its state in the snapshot."""
        for gen, state in self.states:
            gen.set_state(state)


def snapshot(gens: list[torch.Generator] | None = None) -> RngSnapshot:
    """The current state of ``gens`` (default: :func:`generators`)."""
    return RngSnapshot(tuple((g, g.get_state()) for g in (gens or generators())))


@contextmanager
def replaying(start: RngSnapshot) -> Iterator[None]:
    """Run the block with the generators at ``start`` and leave them as they were
    before it: a recompute must neither draw other numbers than the forward did nor
    move the stream the rest of backward draws from.

    Example:
        >>> import torch
        >>> start = snapshot()
        >>> first = torch.rand(3)
        >>> with replaying(start):
        ...     again = torch.rand(3)
        >>> torch.equal(first, again)
        True
    """
    before = snapshot([g for g, _ in start.states])
    try:
        start.restore()
        yield
    finally:
        before.restore()
