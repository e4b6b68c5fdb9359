"""One forward+backward on ``meta``, tracked storage by storage, each storage attributed to
the module whose forward (or the block whose backward) made it.

:func:`meta_step_peak` gives just the step peak, for re-measuring at another batch size;
:func:`autoremat.estimate` reads the same tracked run for its breakdowns: the
storages alive at the peak (:class:`LiveTensor`), what forward leaves for backward, and the
peak with the head and loss computed in :data:`LOSS_CHUNKS` slices
(:func:`chunked_loss_peak`).
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoremat._core.calls import call_modules, calls_for
from autoremat._core.step import (
    Loop,
    LossFn,
    Step,
    check_loop,
    clear_grads,
    flat_tensors,
    preserved_state,
)
from autoremat._estimate.fake import (
    _resolve_device,
    parse_dtype,
    refused_on_meta,
    step_as_on,
    to_meta,
)
from autoremat._measure.blocks import BlockSpec, resolve_blocks
from autoremat._measure.measured import BackwardStarts, Mark, measure_step
from autoremat._measure.memory import MemoryTracker, Rounding
from autoremat._measure.ops import op_kind
from autoremat._mechanism.wrap import checkpointed

__all__ = [
    "LOSS_CHUNKS",
    "LiveTensor",
    "StepPeak",
    "meta_step_peak",
]

LOSS_CHUNKS = 8  # slices of the head and loss assumed by the chunked-loss figures


@dataclass(frozen=True)
class LiveTensor:
    """A storage alive at the step's peak."""

    nbytes: int
    op: str  # the ATen op that created it, e.g. "aten.mm.default"
    where: str  # the module whose forward created it ("lm_head"), or "backward: <block>"
    kind: str  # "activation" (made in forward), "gradient" or "temporary" (backward)


@dataclass
class _Run:
    mem: MemoryTracker
    where: list[str]  # per record of mem.records
    backward_event: int
    head: tuple[int, int] | None  # events from the last block's forward end to its backward


@dataclass
class _MarkWalk:
    """Replays the marks of a tracked step in event order: the forward call stack, the
    phase, the block whose backward is running, and when each block ended."""

    marks: list[tuple[int, str]]
    next: int = 0
    phase: str = "forward"
    bwd_block: str = "head and loss"  # backward before the last block's is the head's
    modules: list[str] = field(default_factory=list)
    first_exit: dict[str, int] = field(default_factory=dict)
    first_bwd: dict[str, int] = field(default_factory=dict)

    def advance(self, until: int) -> None:
        """Apply the marks made before event ``until``."""
        while self.next < len(self.marks) and self.marks[self.next][0] < until:
            event, label = self.marks[self.next]
            kind, _, name = label.partition(":")
            if kind == "enter":
                self.modules.append(name)
            elif kind == "exit":
                if self.modules and self.modules[-1] == name:
                    self.modules.pop()
                self.first_exit.setdefault(name, event)
            elif kind == "bwd":
                self.bwd_block = name
                self.first_bwd.setdefault(name, event)
            elif label == "backward":
                self.phase = "backward"
            self.next += 1


def _tracked_step(step: Step, names: list[str], *, checkpoint_all: bool,
                  rounding: Rounding | None, after_one: bool = False) -> _Run:
    """The step measured op by op; with ``after_one``, after one unmeasured step whose
    gradients it holds (NOTE [ Steps that accumulate ])."""
    model = step.model
    root = type(model).__name__
    block_set = set(names)

    def run(step: Step, mark: Mark) -> None:
        """The step, marking where each module's forward starts and ends and where each
        block's backward starts."""
        starts = BackwardStarts(mark)  # NOTE [ Where a block's backward starts ]
        with ExitStack() as stack:
            stack.enter_context(calls_for(model, names))  # NOTE [ A block that runs
            # several times ] in _core/calls.py
            for qualname, module in [*model.named_modules(),
                                      *call_modules(model, names).items()]:
                def pre(module: nn.Module, args: Any, kwargs: Any,
                        qualname: str = qualname) -> None:
                    mark(f"enter:{qualname}")
                    if qualname in block_set and torch._C._current_graph_task_id() == -1:
                        starts.took((args, kwargs))  # NOTE [ Where a block's backward starts ]

                def post(module: nn.Module, args: Any, output: Any,
                         qualname: str = qualname) -> None:
                    mark(f"exit:{qualname}")
                    if qualname in block_set and torch.is_grad_enabled():
                        starts.watch(f"bwd:{qualname}", _tensors(output))

                stack.callback(module.register_forward_pre_hook(pre, with_kwargs=True).remove)
                stack.callback(module.register_forward_hook(post).remove)
            if checkpoint_all:
                stack.enter_context(checkpointed(model, names))
            step.run(between=starts.settle_and(mark, "backward"))

    if after_one:
        with checkpointed(model, names) if checkpoint_all else nullcontext():
            step.run()
    mem = measure_step(step, memory="storages", rounding=rounding, isolated=False,
                       run=run).memory
    assert mem is not None  # for mypy: asked for
    # inside preserved_state: the caller's gradients come back after
    clear_grads(model, step.inputs)

    walk = _MarkWalk(list(mem.marks))  # in event order already; never sort them
    where: list[str] = []
    for record in mem.records:
        walk.advance(record.born)
        if walk.phase == "forward":
            where.append((walk.modules[-1] or root) if walk.modules else "(outside the model)")
        else:
            # No "recompute" label: checkpoint stops recomputing early, so the forward hooks
            # that would close a recomputed module never run.
            where.append(f"backward: {walk.bwd_block}")
    walk.advance(len(mem.levels) + 1)
    backward_event = next(e for e, label in walk.marks if label == "backward")
    last = names[-1]
    head = (walk.first_exit[last], walk.first_bwd[last]) \
        if last in walk.first_exit and last in walk.first_bwd else None
    return _Run(mem=mem, where=where, backward_event=backward_event, head=head)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if hasattr(obj, "to_tuple") and not dataclasses.is_dataclass(obj):
        obj = list(obj.to_tuple())
    return flat_tensors(obj)


def _live_at_peak(run: _Run, top: int) -> tuple[LiveTensor, ...]:
    peak = run.mem.peak_event
    live = []
    for record, where in zip(run.mem.records, run.where, strict=True):
        if record.born <= peak and (record.died is None or record.died > peak):
            kind = ("activation" if not record.backward
                    else "gradient" if record.died is None else "temporary")
            live.append(LiveTensor(record.nbytes, record.op, where, kind))
    live.sort(key=lambda t: -t.nbytes)
    return tuple(live[:top])


def _saved(run: _Run) -> list[tuple[str, str, int]]:
    """(where, op kind, bytes) of storages made in forward and alive when backward starts."""
    out = []
    for record, where in zip(run.mem.records, run.where, strict=True):
        if (record.born <= run.backward_event and not record.backward
                and (record.died is None or record.died > run.backward_event)):
            out.append((where, op_kind(record.op), record.nbytes))
    return out


def chunked_loss_peak(run: _Run, chunks: int) -> int | None:
    """The step peak if the head and loss (logits and their gradient) ran in ``chunks``
    slices; ``None`` when the step has no head window. Gradients of the head's weights
    do not shrink; everything else made in the window is assumed to scale with the slice."""
    if run.head is None:
        return None
    start, stop = run.head
    levels = run.mem.levels
    window_peak_event = max(range(start, stop + 1), key=lambda e: levels[e])
    grads = sum(r.nbytes for r in run.mem.records
                if start < r.born <= window_peak_event and r.backward and r.died is None)
    head_rise = levels[window_peak_event] - levels[start]
    chunked = levels[start] + grads + (head_rise - grads) // chunks
    outside = max([*levels[:start + 1], *levels[stop:]])
    return max(outside, chunked)


def target_rounding(device_type: str) -> Rounding | None:
    """How a step on ``meta`` counts bytes for a ``device_type`` target: the CUDA caching
    allocator's blocks for ``"cuda"`` (NOTE [ CUDA allocator rounding ] in ``memory.py``),
    exact bytes for any other."""
    return "cuda" if device_type == "cuda" else None


@dataclass(frozen=True)
class StepPeak:
    """One forward+backward measured on ``meta`` (see :func:`meta_step_peak`)."""

    peak_bytes: int  # the step peak
    grads_at_peak_bytes: int  # gradients alive at that peak
    chunked_loss_peak_bytes: int | None  # the peak with the head and loss in 8 chunks
    # with ``accumulating``: the peak of a step run while every gradient is held (the
    # second micro-batch of an accumulation on), above those gradients, and so with the
    # head and loss in chunks; None: not measured (NOTE [ Steps that accumulate ])
    accumulating_peak_bytes: int | None = None
    accumulating_chunked_peak_bytes: int | None = None


def meta_step_peak(model: nn.Module, inputs: Any, *, loss_fn: LossFn | None = None,
                   blocks: BlockSpec = None, device: str | torch.device | None = None,
                   dtype: torch.dtype | str | None = None,
                   checkpoint_all: bool = False, loop: Loop = "holds_output",
                   accumulating: bool = False) -> StepPeak:
    """Just the step peak on ``meta`` (two passes cheaper than
    :func:`autoremat.estimate`), with every block checkpointed or none; for
    re-measuring at another batch size. For a ``cuda`` target storages are counted in
    the CUDA caching allocator's blocks, as :func:`~autoremat.estimate` does.

    Args:
        loop: the training loop, as for :func:`autoremat.estimate` (default
            ``"holds_output"``: the output lives until backward has finished).
        accumulating: also measure a step run with every gradient held, as the second
            micro-batch of a gradient accumulation runs (NOTE [ Steps that accumulate ]).

    Example:
        >>> import autoremat
        >>> model, inputs = autoremat.zoo.build("mlp", device="meta", batch_size=8)
        >>> meta_step_peak(model, inputs).peak_bytes > 0
        True
    """
    check_loop(loop)
    target = torch.device(_resolve_device(model, device)).type
    given = inputs
    model, inputs = to_meta(model, inputs, parse_dtype(dtype))
    names = resolve_blocks(model, blocks)
    step = Step(model, inputs, loss_fn, loop)
    with refused_on_meta(model, given), preserved_state(model), \
            step_as_on(target, model, inputs, given):
        run = _tracked_step(step, names, checkpoint_all=checkpoint_all,
                            rounding=target_rounding(target))
        later = _tracked_step(step, names, checkpoint_all=checkpoint_all,
                              rounding=target_rounding(target), after_one=True) \
            if accumulating else None
    return StepPeak(peak_bytes=run.mem.peak_bytes,
                    grads_at_peak_bytes=run.mem.breakdown["gradients"],
                    chunked_loss_peak_bytes=chunked_loss_peak(run, LOSS_CHUNKS),
                    accumulating_peak_bytes=None if later is None else later.mem.peak_bytes,
                    accumulating_chunked_peak_bytes=None if later is None
                    else chunked_loss_peak(later, LOSS_CHUNKS))


# NOTE [ Steps that accumulate ]
#     With gradient accumulation, every micro-batch after the first runs its step while
#     the gradients of the ones before are held, and each new gradient is made as a
#     tensor of its own, added into ``.grad`` and freed. Its peak, above the held
#     gradients, is not the first step's peak less its gradients: the first step's peak
#     falls late in backward, where most gradients are made (and kept), the later
#     steps' where the head's backward runs (the logits, their gradient and the output
#     projection's new gradient). The doctor's micro-batch remedy took the first for the
#     second and said "fits" 3.8% under the iteration's peak (a held-out OLMo, batch 4
#     in four micro-batches of 1: 27.39 MB measured, 26.35 MB said). So such a step is
#     measured as it runs: once unmeasured, to make the gradients, then with them held.
