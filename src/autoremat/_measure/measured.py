"""One training step run under the instruments a caller asks for: the routine that
profile, verify, auto, estimate and bench all measure a :class:`~autoremat.Step` with.

:func:`measure_step` runs the step once (after an unmeasured warm-up, when asked) under
any of: the storage tracker or the allocator's reports (``memory=``), the CUDA
allocator's peak (``allocator=True``), a FLOP counter (``counter=``), a clock
(``timed=True``); by default leaving no trace on the model or the RNGs. What it gives
back is a :class:`Measured`, with ``None`` for what was not asked for.

Example:
    >>> import autoremat
    >>> model, inputs = autoremat.zoo.build("mlp", widths=(64,) * 2, batch_size=8)
    >>> run = measure_step(autoremat.Step(model, inputs), memory="storages")
    >>> run.peak_bytes > 0, run.wall_ms is None
    (True, True)
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch

from autoremat._core.errors import internal_assert
from autoremat._core.step import Step, clear_grads, flat_tensors, preserved_state
from autoremat._measure.allocations import track_allocations
from autoremat._measure.flops import FlopCounter
from autoremat._measure.memory import MemoryTracker, Rounding, _tracked, track_allocator
from autoremat._measure.ops import OpRecorder
from autoremat._measure.timing import time_ms

__all__ = ["BackwardStarts", "Mark", "Measured", "Memory", "grad_tensors", "heap_frozen",
           "measure_step"]

Mark = Callable[[str], None]  # labels a point of the step (``"backward"``, ``"fwd:3"``)


def grad_tensors(obj: Any) -> list[torch.Tensor]:
    """The floating (or complex) tensors in ``obj`` that need a gradient, each once, in
    order."""
    found: dict[int, torch.Tensor] = {}
    for t in flat_tensors(obj):
        if t.requires_grad and (t.is_floating_point() or t.is_complex()):
            found.setdefault(id(t), t)
    return list(found.values())


# NOTE [ The heap frozen while steps are measured ]
#     Python's cyclic garbage collector now and then scans every object the process
#     holds (a collection of its oldest generation: in a process that imported
#     transformers and scipy, about a million objects). A measured step makes many
#     short-lived objects (the tracker's records and weak references, one or more per
#     op), which brings such a collection on; in a launch-bound step (a small model, or
#     a GPU's short steps) one took 4.7 plain steps of a profile's 18 (the zoo's llama,
#     12 layers x 64 wide, on this project's CPU, 2026-12-01), in about one profile of
#     three. So while steps are measured, the objects that were alive before are frozen
#     (``gc.freeze``: left out of every collection, as if permanent) and let go
#     afterwards (``gc.unfreeze``); what the steps make is still collected as usual, so
#     a reference cycle that holds a tensor the step made is freed as in a plain step.
#     Where the process froze objects itself, or turned the collector off, it is left
#     as it is (``gc.unfreeze`` would let go of its frozen objects too).
@contextmanager
def heap_frozen() -> Iterator[None]:
    """Freeze the objects alive now out of the garbage collector's scans for the
    ``with`` block, then let them go (NOTE [ The heap frozen while steps are measured
    ]); nothing where the process froze objects itself or turned the collector off.
    Nested blocks freeze once.

    Example:
        >>> import gc
        >>> with heap_frozen():
        ...     frozen = gc.get_freeze_count() > 0
        >>> frozen, gc.get_freeze_count()
        (True, 0)
    """
    global _freezes
    # (gc.get_freeze_count() walks every frozen object: read only where none are ours)
    if not _freezes and (not gc.isenabled() or gc.get_freeze_count()):
        yield
        return
    if not _freezes:
        gc.freeze()
    _freezes += 1
    try:
        yield
    finally:
        _freezes -= 1
        if not _freezes:
            gc.unfreeze()


_freezes = 0  # heap_frozen blocks open now (the first froze the heap, the last lets it go)


# NOTE [ Where a block's backward starts ]
#     A block's backward starts when the gradient of its output arrives: a hook on that
#     tensor marks it (``bwd:<i>``; a hook on a tensor an op made runs when backward
#     runs that op's node, its gradient complete). A block that returns several tensors
#     needing a gradient is marked at the first of its outputs the next block takes
#     whose hook runs, once per backward: RevNet's coupling blocks return (y1, y2) and
#     the next takes both; y1 is read inside the block too, so its gradient is complete
#     only after the block's own backward has used y2's, its recompute included. Marked
#     at y1 (the first output, as before 2026-11-30), a checkpointed block's recompute
#     fell in the next block's window, and segments of two blocks, which compose their
#     recompute in the last block's window (NOTE [ The peak model ] in _plan/peak.py),
#     measured up to 24 KiB over their predictions and budgets. Outputs the next block
#     does not take (the router logits an auxiliary loss reads, whose node can run
#     before the block's own backward) do not mark; where the next block takes none of
#     them (the last block, a block whose outputs the parent changes first), each output
#     does, the first to run. An output the model drops gets no gradient and marks
#     nothing: Flux's single-stream blocks return (text, image) tokens, the model drops
#     the last block's text tokens, so backward seemed never to run through that block,
#     and it left the chain ("frozen, with an input that needs no gradient"). A dropped
#     output's graph node is freed with it, and its hook with the node: at the end of
#     forward (:meth:`BackwardStarts.settle`) the outputs whose hooks are still alive are
#     the ones that mark.
# NOTE [ An output view changed in place ]
#     A block's output may be a view: nn.Linear on a (batch, tokens, width) input returns
#     one, and so do ``h.add_(x)`` on it, a slice, ``view_as``. When a later op writes the
#     view in place (an ``nn.ReLU(inplace=True)`` after the block, a next block that
#     starts with ``x.mul_(2)``), autograd rebases the view's history on its base
#     (CopySlices) and gives the view a new node: the hook registered on the view stays
#     on the old node, which leaves the graph, and never ran. The block seemed never
#     reached by backward, and profile refused a model the plain step trains ("no
#     gradient reached the output of block(s)", "backward runs through none of the blocks
#     found"). So a view output is watched on its base too, whose node stays in the
#     graph (the in-place op's backward runs before it, as for an output that is no
#     view); a label marks once per backward, at the first of its hooks to run: the
#     view's where it ran (its node runs before its base's), else the base's.
class BackwardStarts:
    """Marks where each watched block's backward starts (NOTE [ Where a block's backward
    starts ]): :meth:`watch` its output in its forward hook, :meth:`took` the next
    block's inputs in its forward pre-hook, :meth:`settle` at the end of forward."""

    def __init__(self, mark: Mark) -> None:
        self.mark = mark
        # per block with several outputs, until settle() chooses the ones that mark:
        # weak references to their gradient hooks and to the outputs, in output order
        self._pending: dict[str, list[weakref.ref[Callable[[torch.Tensor], None]]]] = {}
        self._outputs: dict[str, list[weakref.ref[torch.Tensor]]] = {}
        self._taken: dict[str, set[int]] = {}  # the outputs the next block took
        self._last = ""  # the block watched last
        self._marking: dict[str, set[int]] = {}
        self._marked: dict[str, int] = {}  # the backward (graph task) each label marked in

    def watch(self, label: str, output: Any) -> None:
        """Mark ``label`` when backward reaches ``output`` (a block's)."""
        outs = grad_tensors(output)
        hooks = [self._hook(label, None if len(outs) == 1 else k) for k in range(len(outs))]
        for k, (out, hook) in enumerate(zip(outs, hooks, strict=True)):
            out.register_hook(hook)  # held by the output's graph node only
            base = out._base if out._is_view() else None
            if base is not None and base.requires_grad:
                # NOTE [ An output view changed in place ]: should the view be written in
                # place later, its hook's node leaves the graph; its base's does not
                base.register_hook(self._hook(label, None if len(outs) == 1 else k))
        if len(outs) > 1:
            self._pending[label] = [weakref.ref(hook) for hook in hooks]
            # weakly: an output the model drops frees its Python object, whose id a
            # later tensor can take (NOTE [ The block before's output, by identity ] in
            # _profile/runs.py)
            self._outputs[label] = [weakref.ref(t) for t in outs]
        self._last = label

    def took(self, inputs: Any) -> None:
        """The next block's forward starts with ``inputs``: which outputs of the block
        watched last it takes."""
        outs = self._outputs.get(self._last)
        if outs is not None:
            given = {id(t): t for t in flat_tensors(inputs)}
            self._taken[self._last] = {k for k, ref in enumerate(outs)
                                       if (t := ref()) is not None and given.get(id(t)) is t}

    def _hook(self, label: str, k: int | None) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            task = torch._C._current_graph_task_id()
            if (k is None or k in self._marking.get(label, ())) \
                    and self._marked.get(label) != task:
                self._marked[label] = task  # once per backward: the view's, else its base's
                self.mark(label)
        return hook

    def settle(self) -> None:
        """At the end of forward: for each block with several outputs, those the next
        block took whose gradient hooks are alive (whose outputs the model kept) mark,
        the first to run; where it took none, every alive output does."""
        for label, hooks in self._pending.items():
            alive = [k for k, hook in enumerate(hooks) if hook() is not None]
            taken = [k for k in alive if k in self._taken.get(label, ())]
            self._marking[label] = set(taken or alive)
        self._pending.clear()
        self._outputs.clear()
        self._taken.clear()

    def settle_and(self, mark: Mark, label: str) -> Callable[[], None]:
        """A step's ``between``: :meth:`settle`, then ``mark(label)``."""
        def between() -> None:
            self.settle()
            mark(label)
        return between

# How the step's memory is measured: "storages", the storage tracker (any device, meta
# included; NOTE [ What "peak" means ] in the design); "allocations", the allocator's own
# reports, which see compiled code that a dispatch mode would make run eagerly
# (NOTE [ Measuring a compiled step from the allocator ] in allocations.py).
Memory = Literal["storages", "allocations"]


@dataclass(frozen=True)
class Measured:
    """What one step measured by :func:`measure_step` gave; ``None`` where not asked."""

    ran: Any  # what the run returned: the loss (detached), or the caller's run's result
    memory: MemoryTracker | None  # levels, marks and records of the step's storages
    allocator_peak_bytes: int | None  # rise of max_memory_allocated (CUDA only)
    wall_ms: float | None  # the step's time, CUDA-synchronised on a GPU
    cpu_ms: float | None  # CPU time of this process over the step
    grads: dict[str, torch.Tensor | None] | None  # clones, by parameter name
    buffers: dict[str, torch.Tensor] | None  # clones after the step, by buffer name

    @property
    def peak_bytes(self) -> int:
        """The step peak of ``memory`` (bytes above the level before the step)."""
        internal_assert(self.memory is not None, "a step measured without memory= has no peak")
        assert self.memory is not None  # for mypy: internal_assert raised otherwise
        return self.memory.peak_bytes


def _plain_run(step: Step, mark: Mark) -> torch.Tensor:
    """The step, marking where backward starts."""
    return step.run(between=lambda: mark("backward"))


def measure_step(step: Step, *, memory: Memory | None = None,
                 rounding: Rounding | None = None, allocator: bool = False,
                 counter: FlopCounter | None = None, on_mark: Mark | None = None,
                 run: Callable[[Step, Mark], Any] = _plain_run, timed: bool = False,
                 isolated: bool = True, rng: torch.Tensor | None = None,
                 warm_up: bool = False, grads: bool = False,
                 buffers: bool = False) -> Measured:
    """Run ``step`` once under the instruments asked for.

    Args:
        memory: ``"storages"`` (the storage tracker, counting bytes by ``rounding``) or
            ``"allocations"`` (the allocator's reports); ``None``: not measured.
        allocator: also measure the rise of ``torch.cuda.max_memory_allocated()`` (CUDA
            only, ``None`` elsewhere): the truth on a GPU.
        counter: a FLOP counter to count the step in (an :class:`OpRecorder` also sees
            what autograd saves); the caller reads it afterwards.
        on_mark: also told every mark the run makes (after ``memory`` records it).
        run: runs the step, given the step and ``mark``; default: ``step.run()``, marking
            ``"backward"`` (a caller's run installs its own hooks, e.g. block marks).
        timed: time the step (wall and CPU); only without other instruments, which would
            slow it down.
        isolated: run inside :func:`~autoremat._core.step.preserved_state` (gradients
            ``None`` before the step; buffers, gradients and RNGs as before, afterwards);
            ``False``: the caller holds that state, gradients included. An isolated
            step that gave a buffer or attribute of the model another object holding
            tensors (a cache made in the first forward) is measured again from the same
            state, with it kept (NOTE [ A step that builds the model's state ] in
            ``step.py``).
        rng: the CPU RNG state the step starts from (default: the current one); with
            ``warm_up``, both steps do.
        warm_up: run the step once, unmeasured, first (compiling allocates too).
        grads, buffers: return clones of the gradients and buffers after the step.

    Returns:
        A :class:`Measured`.
    """
    internal_assert(not timed or (memory is None and not allocator and counter is None),
                    "a timed step runs without instruments")
    model = step.model

    def once() -> Measured:
        return _measured_once(step, memory, rounding, allocator, counter, on_mark, run,
                              timed, grads, buffers)

    with heap_frozen(), preserved_state(model, step.inputs) if isolated else nullcontext() \
            as kept:
        if rng is not None:
            torch.set_rng_state(rng)
        if warm_up:
            run(step, lambda label: None)
            clear_grads(model, step.inputs)
            if rng is not None:  # the measured step starts from it too
                torch.set_rng_state(rng)
        measured = once()
        if kept is not None and not warm_up and kept.built():
            # NOTE [ A step that builds the model's state ] (step.py): it measured the
            # first step; the figures are of the steps after it
            internal_assert(on_mark is None and not isinstance(counter, OpRecorder),
                            "a step measured twice tells its marks and records once")
            kept.rewind()
            clear_grads(model, step.inputs)
            if rng is not None:
                torch.set_rng_state(rng)
            if counter is not None:
                counter.reset()
            measured = once()
    return measured


def _measured_once(step: Step, memory: Memory | None, rounding: Rounding | None,
                   allocator: bool, counter: FlopCounter | None, on_mark: Mark | None,
                   run: Callable[[Step, Mark], Any], timed: bool, grads: bool,
                   buffers: bool) -> Measured:
    """One run of ``step`` under the instruments asked for (:func:`measure_step`)."""
    model, device = step.model, step.device
    with ExitStack() as stack:
        peak = stack.enter_context(track_allocator(device)) if allocator else None
        # with the storage tracker, the counter runs each op for it: one dispatch mode
        # for both (NOTE [ One mode for two instruments ] in memory.py)
        through = counter if memory == "storages" else None
        if counter is not None:
            if through is None:
                stack.enter_context(counter)
            if isinstance(counter, OpRecorder):  # it notes what autograd saves
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(
                    counter.pack, counter.unpack))
        mem = (None if memory is None
               else stack.enter_context(_tracked(rounding, through))
               if memory == "storages"
               else stack.enter_context(track_allocations(device)))

        def mark(label: str) -> None:
            if mem is not None:
                mem.mark(label)
            if on_mark is not None:
                on_mark(label)

        wall_ms = cpu_ms = None
        if timed:
            result: list[Any] = []
            cpu = time.process_time()
            wall_ms = time_ms(lambda: result.append(run(step, mark)), device)
            cpu_ms = (time.process_time() - cpu) * 1e3
            ran = result[0]
        else:
            ran = run(step, mark)
    kept_grads = {n: (p.grad.detach().clone() if p.grad is not None else None)
                  for n, p in model.named_parameters()} if grads else None
    kept_buffers = {n: b.detach().clone()
                    for n, b in model.named_buffers()} if buffers else None
    return Measured(ran=ran, memory=mem, allocator_peak_bytes=None if peak is None
                    else peak.peak_bytes, wall_ms=wall_ms, cpu_ms=cpu_ms, grads=kept_grads,
                    buffers=kept_buffers)
