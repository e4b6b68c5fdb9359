"""``profile``: measure one training step block by block and return a :class:`Tape`.

NOTE [ Three kinds of run ]
    Per-op instrumentation slows a step, so no time is taken from an instrumented one:
    * memory: four steps under ``track_memory`` (plain; every block checkpointed on its
      own; and two that alternate kept and checkpointed blocks), with marks at block
      boundaries. Windows between marks give what the planner composes (see
      ``tape.py``), for each pair (previous block's decision, this block's): who
      holds a boundary tensor depends on both its producer and its consumer. Memory
      is exact and deterministic. Then the selective options, a few per step
      (NOTE [ Options measured together ]).
    * FLOPs: counted by block in the same steps (NOTE [ One pass for memory and FLOPs ]).
    * time: ``repeats`` steps with nothing but hooks at block boundaries; medians.
    Before them, one uninstrumented step finds the chain (and warms up: what a model
    makes lazily on its first step is not measured as the step's), and one forward
    without gradients finds the inputs held outside it.

NOTE [ One pass for memory and FLOPs ]
    FLOPs and op records need no step of their own: the FLOP counter (an ``OpRecorder``
    for the plain step, which also traces each block's ops and what autograd saves) is
    a dispatch mode entered under the memory tracker's, so every op passes through both
    (the tracker's first, then the counter's) and both see the same ops, labelled by the
    same marks. The counter creates no storage and keeps none alive (weak references,
    and saved-tensor hooks that hand back the tensor they get), so the memory figures are
    those of a step without it; the ``ms`` of its op records then include the tracker's
    overhead, which no plan reads. Recompute FLOPs are the backward FLOPs of the
    checkpointed step (or of a selective step) less the plain step's, per block. A
    compiled step is measured from the allocator, and its FLOPs and ops from eager steps
    of their own (NOTE [ Profiling a compiled step ]).

NOTE [ Options measured together ]
    A selective option's windows are a block's own: from its forward start to the next
    block's, and from its output's gradient to its input's, in a step where the blocks
    around it are checkpointed, whole or selective (each saves its own input, so no
    boundary depends on which option a neighbour runs). So one step measures an option
    on every block at once, a different option on each, and blocks that measure alike
    share their figures: same class, parameters, input and output bytes, the same ops
    (kinds, bytes, FLOPs, dataflow) and the same windows checkpointed (keyed as in a
    selective step: after a checkpointed block, or for the first block after the kept
    stem). Each class of alike blocks spreads its options over its members, so a stack
    of identical layers takes ceil(options / layers) steps instead of one per option
    (GPT-2's 11 options on 6 layers: 2). ``test_profile`` checks that the figures equal
    those of one step per option.
    Every run follows the training loop ``loop`` (NOTE [ Which loop a step models ] in
    ``step.py``), so with ``"holds_output"`` each window sees the model's output alive
    until backward has finished, and every prediction made from the tape includes it.
    All runs go through ``preserved_state``: BatchNorm statistics, gradients and RNG
    states are as they were when ``profile`` returns.

NOTE [ Profiling a compiled step ]
    With ``compile=``, each memory and timing run compiles every block's forward on its
    own (``compiled_forwards``: regional compilation, hooks at block boundaries left
    outside the compiled code) over the checkpoint wrapper of that run, which lowers
    each option as it runs compiled (NOTE [ Plans under torch.compile ]). Memory comes
    from the allocator's reports (``track_allocations``; a dispatch mode would make
    Dynamo run eagerly), after a first step that compiles. FLOPs and the op records
    behind keep-sets come from eager steps: the ops are the same, only fused.
    Whole-model compilation partitions the whole step at once, so its peak can differ
    from the regional one predicted: measured on CPU (gpt2 zoo, 4 layers) from 0.26%
    above to below the prediction with Inductor, up to 5.5% above with ``aot_eager``.
    Only the regional prediction is tested (equal to the allocator's peak).

NOTE [ Alternations shared by alike blocks ]
    The two steps that alternate kept and checkpointed blocks exist to measure each
    block after a neighbour of the other decision (keys (RECOMPUTE, KEEP) and (KEEP,
    RECOMPUTE)); the first
    measures them on every other block, the second on the rest. Blocks that measure
    alike in the kept and the checkpointed steps (``_alike``: same class, parameters,
    ops, input and output bytes, windows and releases) measure alike in these too, so
    the second step is skipped when every block after the first has an alike block
    after the first that the first alternation measured with each missing pair, and
    takes that block's figures (``_by_pairs``). Block 0 neither gives nor takes: its
    "previous block" is the stem, never a block of the chain. A stack of three or more
    identical layers saves a step; ``test_profile`` checks the figures against the
    second step's.

NOTE [ Pairs that cannot differ ]
    A block's windows depend on its predecessor's mode only through tensors that both
    can hold: a storage made in block ``i``'s forward and read by block ``i + 1`` (the
    boundary) is freed in the backward of its last holder, ``i`` when ``i`` is kept and
    saved it, else ``i + 1`` (kept: if it saved it; checkpointed: it holds its inputs),
    else in ``i + 1``'s forward. When no block holds what it hands on (and nothing is
    held across more than one boundary), every storage is freed where its own block's
    decision says, whatever the neighbour's, so (recompute, keep) equals (keep, keep)
    and (keep, recompute) equals (recompute, recompute): the alternating steps would
    measure nothing new. ``_pairs_local`` reads that from the kept and the checkpointed
    steps: per event, the window it falls in (``_placer``). A storage made in block
    ``i``'s forward must die in block ``i``'s windows, in ``i + 1``'s, or at or after
    the end (held by the caller); the bytes that die in ``i + 1``'s windows must be the
    same in both steps (what ``i + 1`` takes, none of it held by ``i`` kept: held by
    ``i``, it would die in ``i``'s backward in the kept step and in ``i + 1``'s in the
    checkpointed one); a storage made before the chain may die in no block's windows but
    block 0's, and the bytes block 0 frees in its backward must be the same in both
    steps (what block 0 holds either way, so no later block is ever its last holder);
    one made in a block's backward dies there, in the previous block's backward or
    never. Then the alternating steps are skipped and the pairs taken from the uniform
    steps (``_by_pairs(..., local=True)``); ``test_profile`` checks the figures against
    the alternating steps'. Eager steps without offload only.

NOTE [ Ops between blocks ]
    Memory windows run from one block's start to the next one's, so what the parent
    runs between two blocks (an encoder's final norm and the decoder's embedding, between
    the two stacks of a T5) falls in the window of the block before: levels compose
    either way. Op records and FLOPs must not take them in: a block's keep-set indexes
    the ops of its own forward, and a selective block that finds other ops than its
    tape's falls back to recomputing all of them. So each block's forward hook also marks
    ``post:i``, and the FLOP counter files the ops after it under ``<outside>``.

NOTE [ Boundaries held outside the chain ]
    A segment of several blocks keeps its first input and drops the inner boundaries
    (the peak model subtracts ``chain_bytes``), which frees them only when nothing else
    holds them. A U-Net's parent keeps each encoder block's output in a list of skips
    until the decoder reads it, and a parent that names every hidden state keeps them
    all; the segment then frees nothing there. ``_held_boundaries`` finds such inputs in
    one forward without gradients (nothing saved for backward, so only the model's own
    references keep a tensor): the input of block ``i`` is held when it is still alive
    once block ``i`` has returned. Those blocks get ``chain_bytes = 0``, so composed
    segments over them are predicted as holding what they hold.

NOTE [ Block boundaries in backward ]
    A forward post-hook registers a tensor hook on the block's output; it fires when
    that gradient is complete, which is when the block's backward starts. The block's
    backward ends when the gradient of its input is ready: the previous block's mark, or
    a hook on the first block's input (when it requires grad), or the end of backward.
"""

from __future__ import annotations

import bisect
import dataclasses
import statistics
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from autoremat._core.blocks import (
    BlockSpec,
    discovery_notes,
    other_repeated_blocks,
    param_signature,
    resolve_blocks,
)
from autoremat._core.conditions import autocast_state, float_dtypes, structure_of
from autoremat._core.decisions import Decision
from autoremat._core.errors import (
    BlockError,
    RematError,
    check_flag,
    check_whole,
    did_you_mean,
    internal_assert,
)
from autoremat._core.flops import FlopCounter
from autoremat._core.memory import MemoryTracker, Rounding, counted_bytes
from autoremat._core.ops import OpRecord, OpRecorder, OpStats, op_kind
from autoremat._core.step import (
    Loop,
    LossFn,
    Step,
    as_step,
    call_model,
    check_no_cache,
    default_loss,
    describe_inputs,
    describe_loss,
    flat_tensors,
    output_bytes,
    parse_device,
    preserved_state,
    training_config,
    unique_storage_bytes,
)
from autoremat._core.timing import Clock, clock_for
from autoremat._measure.costs import CostModel, cost_model_for, head_cost
from autoremat._measure.keepsets import KeepSet, keep_sets
from autoremat._measure.measured import measure_step
from autoremat._measure.tape import (
    WINDOW_DECISIONS,
    BlockProfile,
    HeadOption,
    HeadProfile,
    SelectiveProfile,
    Tape,
    WindowKey,
    WindowMemory,
)
from autoremat._mechanism.compiled import (
    compiled_context,
    compiled_forwards,
    keep_keys,
    uncompiled,
)
from autoremat._mechanism.head import HeadSite, find_head, head_installed
from autoremat._mechanism.offload import (
    BlockOffload,
    OffloadStats,
    measure_host_bandwidth,
    offloading,
)
from autoremat._mechanism.selective import op_signature, save_set_name, save_sets, selective_context
from autoremat._mechanism.wrap import ContextFn, checkpointed, stashed_buffers

__all__ = ["HEAD_CHUNKS", "profile"]

# The chunk counts of the loss head measured as options (NOTE [ Measuring the head ]).
HEAD_CHUNKS = (4, 32)


def _first_grad_tensor(obj: Any) -> torch.Tensor | None:
    for t in tree_flatten(obj)[0]:
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
            return t
    return None


@dataclass
class _Probe:
    """Hooks at block boundaries; calls ``on_mark(label)`` at each."""

    names: list[str]
    on_mark: Callable[[str], None]
    calls: list[int] = field(default_factory=list)
    input_bytes: list[int] = field(default_factory=list)
    output_bytes: list[int] = field(default_factory=list)
    chained: list[bool] = field(default_factory=list)
    chain_bytes: list[int] = field(default_factory=list)
    order: list[int] = field(default_factory=list)  # block indices in the order they ran
    _prev_outputs: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.names)
        self.calls = [0] * n
        self.input_bytes = [0] * n
        self.output_bytes = [0] * n
        self.chained = [False] * n
        self.chain_bytes = [0] * n

    @contextmanager
    def installed(self, model: nn.Module) -> Iterator[None]:
        with ExitStack() as stack:
            for i, name in enumerate(self.names):
                module = model.get_submodule(name)
                pre = module.register_forward_pre_hook(self._pre(i), with_kwargs=True)
                # first among the forward hooks, so that its gradient hook (the block's
                # backward starts) runs before an offloaded neighbour's prefetch, which
                # then falls in this block's window (NOTE [ Offloading saved tensors ])
                post = module.register_forward_hook(self._post(i), prepend=True)
                stack.callback(pre.remove)
                stack.callback(post.remove)
            yield

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            self.calls[i] += 1
            self.order.append(i)
            self.on_mark(f"fwd:{i}")
            tensors = flat_tensors((args, kwargs))
            self.input_bytes[i] = unique_storage_bytes(tensors)
            self.chained[i] = bool(tensors) and id(tensors[0]) in self._prev_outputs
            if self.chained[i]:
                self.chain_bytes[i] = tensors[0].untyped_storage().nbytes()
            if i == 0:
                first = _first_grad_tensor((args, kwargs))
                if first is not None:
                    first.register_hook(self._grad_mark("bwd:-1"))
        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            tensors = flat_tensors(output)
            self.output_bytes[i] = unique_storage_bytes(tensors)
            self._prev_outputs = [id(t) for t in tensors]
            out = _first_grad_tensor(tensors)
            if out is not None:
                out.register_hook(self._grad_mark(f"bwd:{i}"))
            self.on_mark(f"post:{i}")  # NOTE [ Ops between blocks ]
            if i == len(self.names) - 1:
                self.on_mark("fwd_end")
        return hook

    def _grad_mark(self, label: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self.on_mark(label)
        return hook


def _run_marked(step: Step, names: list[str], on_mark: Callable[[str], None], *,
                in_order: bool = True) -> _Probe:
    """One step with marks at the block boundaries. Every block must run once; with
    ``in_order``, in the order of ``names`` (``False``: the caller reads ``probe.order``)."""
    probe = _Probe(names, on_mark)
    with probe.installed(step.model):
        on_mark("start")
        step.run(between=lambda: on_mark("backward"))
        on_mark("end")
    for name, calls in zip(names, probe.calls, strict=False):
        if calls != 1:
            raise BlockError(f"block {name!r} ran {calls} times in one step; autoremat plans "
                             f"over blocks that run once each (pass blocks=[...] to choose)")
    if in_order and probe.order != sorted(probe.order):
        ran = [names[i] for i in probe.order]
        raise BlockError(f"the blocks ran in the order {ran}, not in the order given "
                         f"({names}); autoremat plans over a chain: list the blocks in the "
                         "order they run")
    return probe


def _discovered_chain(model: nn.Module, names: list[str], order: list[int],
                      marks: list[str]) -> tuple[list[str], list[str]]:
    """The blocks found by discovery that a plan can use, in the order they ran, and
    notes on what changed. Blocks that backward never runs through (frozen, with an input
    that needs no gradient: the lower layers of a partial fine-tune) save nothing for
    backward, so there is nothing to recompute in them: they leave the chain."""
    notes = []
    if order != sorted(order):
        # a discovered chain goes in the order it runs (NOTE [ Stacks beside the chain ])
        notes.append(f"the blocks found run in another order than they are defined; "
                     f"planned in the order they run: {names[order[0]]}, ..., "
                     f"{names[order[-1]]}")
    no_backward = [names[i] for i in order if f"bwd:{i}" not in marks]
    chain = [names[i] for i in order if f"bwd:{i}" in marks]
    if no_backward and not chain:
        raise BlockError(f"backward runs through none of the blocks found ({names[0]}, ..., "
                         f"{names[-1]}): {_why_no_backward(model, no_backward)}")
    if no_backward:
        notes.append(f"backward never runs through {len(no_backward)} of the blocks found "
                     f"({no_backward[0]}, ..., {no_backward[-1]}: frozen, with an input that "
                     f"needs no gradient), so nothing in them is saved for backward; planned "
                     f"over the {len(chain)} after them")
    return chain, notes


def _why_no_backward(model: nn.Module, names: list[str]) -> str:
    """Why no gradient reached the output of the blocks ``names``, and what to do."""
    frozen = all(not p.requires_grad for n in names
                 for p in model.get_submodule(n).parameters())
    if frozen:
        return ("they have no trainable parameter and take no input that needs a gradient, "
                "so backward never runs through them and there is nothing to recompute: "
                "leave them out of blocks=[...] (list the blocks after them)")
    return "autoremat plans over blocks whose output is part of the loss"


def _held_boundaries(model: nn.Module, inputs: Any, names: list[str]) -> list[bool]:
    """Per block, whether its first input tensor outlives the block's call: held by the
    model outside the chain (NOTE [ Boundaries held outside the chain ])."""
    refs: list[weakref.ref[torch.Tensor] | None] = [None] * len(names)
    held = [False] * len(names)

    def check(i: int) -> None:
        ref = refs[i]
        held[i] = ref is not None and ref() is not None

    def pre(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if i > 0:
                check(i - 1)
            tensors = flat_tensors((args, kwargs))
            refs[i] = weakref.ref(tensors[0]) if tensors else None
        return hook

    with ExitStack() as stack, torch.no_grad():
        for i, name in enumerate(names):
            handle = model.get_submodule(name).register_forward_pre_hook(pre(i),
                                                                         with_kwargs=True)
            stack.callback(handle.remove)
        output = call_model(model, inputs)
        check(len(names) - 1)
        del output
    return held


def _marks(mem: MemoryTracker) -> dict[str, int]:
    found: dict[str, int] = {}
    for event, label in mem.marks:
        found.setdefault(label, event)
    return found


def _window(mem: MemoryTracker, start: int, stop: int) -> WindowMemory:
    base = mem.levels[start]
    return WindowMemory(peak_bytes=mem.window_peak(start, stop) - base,
                        delta_bytes=mem.levels[stop] - base)


@dataclass
class _MemoryRun:
    mem: MemoryTracker
    probe: _Probe
    fwd: list[WindowMemory]
    bwd: list[WindowMemory]
    pre: WindowMemory
    post: WindowMemory
    tail: WindowMemory
    bounds: list[int]  # forward window starts, then fwd_end
    offloaded: dict[str, OffloadStats] = field(default_factory=dict)  # of the O blocks


@dataclass(frozen=True)
class _Contexts:
    """The ``context_fn`` of each selective block: eager, and under compile."""

    eager: dict[str, ContextFn] = field(default_factory=dict)
    compiled: dict[str, Any] = field(default_factory=dict)


@contextmanager
def _step_as_run(model: nn.Module, names: list[str], chosen: list[str],
                 contexts: _Contexts | None, backend: str | None,
                 offloaded: Sequence[str] = (),
                 inputs_offloaded: Sequence[str] = ()) -> Iterator[dict[str, BlockOffload]]:
    """The ``chosen`` blocks checkpointed (selective ones with their contexts), the
    ``offloaded`` ones offloaded, the ``inputs_offloaded`` ones checkpointed with their
    input offloaded (yields the states of these two) and, with a ``backend``, every
    block compiled on its own (NOTE [ Profiling a compiled step ])."""
    contexts = contexts or _Contexts()
    with checkpointed(model, chosen, contexts.eager, contexts.compiled), \
            offloading(model, names, list(offloaded), inputs_offloaded) as states, \
            ExitStack() as stack:
        if backend is not None:
            stack.enter_context(compiled_forwards(model, names, backend))
        yield states


def compile_backend(compile: bool | str) -> str | None:
    """The Dynamo backend ``compile=`` names (``True``: Inductor), or ``None``."""
    if compile is False:
        return None
    if compile is True:
        return "inductor"
    known = torch._dynamo.list_backends(exclude_tags=())
    if not isinstance(compile, str) or compile not in known:
        raise RematError(f"compile must be True, False or a torch.compile backend name "
                         f"such as 'inductor' or 'aot_eager', got {compile!r}"
                         + (did_you_mean(compile, known) if isinstance(compile, str) else ""))
    return compile


@contextmanager
def compile_settings(backend: str | None) -> Iterator[None]:
    """Room for every option's compiled code: each block and option is traced apart, and
    past Dynamo's recompile limit it would silently run eagerly and be measured so."""
    if backend is None:
        yield
        return
    with torch._dynamo.config.patch(recompile_limit=4096, accumulated_recompile_limit=65536):
        yield


def _memory_run(step: Step, names: list[str], decisions: _Pattern,
                contexts: _Contexts | None = None, *,
                rounding: Rounding | None, backend: str | None = None,
                counter: FlopCounter | None = None) -> _MemoryRun:
    """One step measured, block ``i`` under ``decisions[i]``: kept, recomputed (with its
    context from ``contexts``, if any), offloaded, or recomputed with its input
    offloaded. With a ``counter`` (eager only), the same step also counts FLOPs by block
    (NOTE [ One pass for memory and FLOPs ])."""
    internal_assert(len(decisions) == len(names),
                    f"{len(decisions)} decisions for {len(names)} blocks")
    internal_assert(counter is None or backend is None, "FLOPs are counted in eager steps only")
    model = step.model
    for p in model.parameters():
        p.grad = None

    def under(decision: Decision) -> list[str]:
        return [n for n, d in zip(names, decisions, strict=True) if d is decision]

    chosen, offloaded = under(Decision.RECOMPUTE), under(Decision.OFFLOAD)
    inputs_offloaded = under(Decision.OFFLOAD_INPUT)
    with _step_as_run(model, names, chosen, contexts, backend, offloaded,
                      inputs_offloaded) as states:
        # compiled: from the allocator's reports, after a step that compiles (compiling
        # allocates too)
        measured = measure_step(
            step, memory="storages" if backend is None else "allocations", rounding=rounding,
            counter=counter, isolated=False, warm_up=backend is not None,
            on_mark=None if counter is None else lambda label: _label(counter, names, label),
            run=lambda step, mark: _run_marked(step, names, mark))
    mem, probe = measured.memory, measured.ran
    internal_assert(mem is not None, "a memory run measures memory")
    assert mem is not None  # for mypy: internal_assert raised otherwise
    marks = _marks(mem)
    n = len(names)
    missing = [f"bwd:{i}" for i in range(n) if f"bwd:{i}" not in marks]
    if missing:
        skipped = [names[int(m[4:])] for m in missing]
        raise BlockError(f"no gradient reached the output of block(s) {skipped}: "
                         f"{_why_no_backward(model, skipped)}")
    bounds = [marks[f"fwd:{i}"] for i in range(n)] + [marks["fwd_end"]]
    fwd = [_window(mem, bounds[i], bounds[i + 1]) for i in range(n)]
    bwd_marks = [marks.get("bwd:-1", marks["end"])] + [marks[f"bwd:{i}"] for i in range(n)]
    # bwd_marks[i + 1] starts block i's backward; bwd_marks[i] ends it.
    bwd = [_window(mem, bwd_marks[i + 1], bwd_marks[i]) for i in range(n)]
    return _MemoryRun(
        mem=mem, probe=probe, fwd=fwd, bwd=bwd,
        pre=_window(mem, 0, bounds[0]),
        post=_window(mem, bounds[-1], bwd_marks[n]),
        tail=_window(mem, bwd_marks[0], len(mem.levels) - 1),
        bounds=bounds,
        offloaded={name: state.group.stats for name, state in states.items()
                   if state.group is not None},
    )


def _saved_by_block(run: _MemoryRun) -> list[dict[str, int]]:
    """Bytes created in each block's forward window that are alive when backward starts."""
    mem, bounds = run.mem, run.bounds
    backward_at = _marks(mem)["backward"]
    out: list[dict[str, int]] = [{} for _ in range(len(bounds) - 1)]
    for r in mem.records:
        if r.born > backward_at or (r.died is not None and r.died <= backward_at):
            continue
        for i in range(len(bounds) - 1):
            if bounds[i] < r.born <= bounds[i + 1]:
                kind = op_kind(r.op) if r.op != "allocation" else "compiled"
                out[i][kind] = out[i].get(kind, 0) + r.nbytes
                break
    return out


def _label(counter: FlopCounter, names: list[str], label: str) -> None:
    """File the ops after mark ``label`` under the block whose forward or backward it
    starts, and the rest under ``<outside>`` (NOTE [ Ops between blocks ])."""
    kind, _, index = label.partition(":")
    if kind in ("fwd", "bwd") and index != "-1":
        counter.label = names[int(index)]
    else:
        counter.label = "<outside>"


def _flops(step: Step, names: list[str]) -> OpRecorder:
    """One step under an :class:`OpRecorder`: FLOPs by block and the ops of each."""
    counter = OpRecorder()
    measure_step(step, counter=counter, isolated=False,
                 on_mark=lambda label: _label(counter, names, label),
                 run=lambda step, mark: _run_marked(step, names, mark))
    for p in step.model.parameters():
        p.grad = None
    return counter


def _recompute_flops(counter: FlopCounter, plain: FlopCounter, names: list[str]) -> list[int]:
    """Per block, the FLOPs its recompute ran in the step ``counter`` counted (blocks
    checkpointed, or selective): backward FLOPs minus the plain step's. Measured, so
    checkpoint's early stop (no re-run after the last op backward needs) and skipped
    dead ops are included."""
    return [counter.by_label.get((n, "bwd"), 0) - plain.by_label.get((n, "bwd"), 0)
            for n in names]


def _checkpointed_flops(step: Step, names: list[str], plain: FlopCounter,
                        contexts: dict[str, ContextFn] | None = None) -> list[int]:
    """:func:`_recompute_flops` of a step of its own with every block checkpointed (those
    in ``contexts`` selective): for compiled profiles, whose memory steps count no FLOPs."""
    counter = FlopCounter()
    with checkpointed(step.model, names, contexts):
        measure_step(step, counter=counter, isolated=False,
                     on_mark=lambda label: _label(counter, names, label),
                     run=lambda step, mark: _run_marked(step, names, mark))
    for p in step.model.parameters():
        p.grad = None
    return _recompute_flops(counter, plain, names)


@dataclass(frozen=True)
class _Times:
    """Medians of uninstrumented steps (0.0 where not measured)."""

    fwd_ms: list[float]  # per block
    bwd_ms: list[float]  # per block
    step_ms: float

    @staticmethod
    def unmeasured(n: int) -> _Times:
        return _Times([0.0] * n, [0.0] * n, 0.0)


class _Stamps:
    """Clock stamps at the block boundaries of one step, the first time each is reached;
    an ``on_mark`` for :func:`_run_marked`."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.at: dict[str, Any] = {}

    def __call__(self, label: str) -> None:
        if label not in self.at:
            self.at[label] = self.clock.stamp()

    def times(self, n: int) -> _Times:
        """The times of the step stamped (call after ``clock.sync()``)."""
        at, elapsed = self.at, self.clock.elapsed_ms
        fwd, bwd = [], []
        for i in range(n):
            nxt = at[f"fwd:{i + 1}"] if i + 1 < n else at["fwd_end"]
            fwd.append(elapsed(at[f"fwd:{i}"], nxt))
            end = at.get(f"bwd:{i - 1}", at["end"]) if i else at.get("bwd:-1", at["end"])
            bwd.append(elapsed(at[f"bwd:{i}"], end))
        return _Times(fwd, bwd, elapsed(at["start"], at["end"]))


_AGREE = 0.05  # two step times this close (relative) end the timing (NOTE [ Timing repeats ])


def _timings(step: Step, names: list[str], repeats: int, *,
             first: _Times | None = None) -> _Times:
    """Per-block forward and backward medians and the step's, from stamps at the block
    boundaries: ``perf_counter`` on the CPU, CUDA events read after one synchronise at
    the end of each step on a GPU (NOTE [ CUDA-synchronised times ] in ``timing.py``).
    ``first``: the times of the step that found the chain, one of the ``repeats``
    samples when there are three or more (NOTE [ Timing repeats ])."""
    # NOTE [ Timing repeats ]
    #     Times are medians of at most ``repeats`` uninstrumented steps. The step that
    #     found the chain is one of them when ``repeats >= 3``: it may run slow (the
    #     first step of a process allocates fresh memory; on a GPU, library handles),
    #     and a median of three or more leaves one slow sample out. Steps stop early
    #     once two in a row agree within 5%: their median is already what more steps of
    #     a quiet machine would give, and on a noisy one they do not agree. No plan
    #     reads times (they cost FLOPs and bytes), so this saves steps, not accuracy.
    n = len(names)
    samples = [first] if first is not None and repeats >= 3 else []
    clock = clock_for(step.device)
    while len(samples) < repeats:
        if len(samples) >= 2 and \
                abs(samples[-1].step_ms - samples[-2].step_ms) <= _AGREE * samples[-2].step_ms:
            break
        stamps = _Stamps(clock)
        clock.sync()
        _run_marked(step, names, stamps)
        clock.sync()
        samples.append(stamps.times(n))
        for p in step.model.parameters():
            p.grad = None
    return _Times([statistics.median(s.fwd_ms[i] for s in samples) for i in range(n)],
                  [statistics.median(s.bwd_ms[i] for s in samples) for i in range(n)],
                  statistics.median(s.step_ms for s in samples))


_Pattern = tuple[Decision, ...]  # one memory run: the decision of each block


def _patterns(n: int, offload: bool) -> list[_Pattern]:
    """The memory runs of a profile, as the decision of each block: every block kept,
    every one recomputed, then alternations so that each block is measured after a
    neighbour of each other decision (``_by_pairs``); with ``offload``, the same for
    offload and offload_input."""
    def alternate(even: Decision, odd: Decision) -> _Pattern:
        return tuple(even if i % 2 == 0 else odd for i in range(n))

    keep, recompute = Decision.KEEP, Decision.RECOMPUTE
    order = WINDOW_DECISIONS  # keep, recompute, offload, offload_input
    pairs = [(recompute, keep), (keep, recompute)]
    if offload:
        pairs += [(a, b) for new in order[2:] for old in order[:order.index(new)]
                  for a, b in ((new, old), (old, new))]
    whole = order if offload else order[:2]
    out = [(d,) * n for d in whole]
    if n > 1:
        out += [alternate(a, b) for a, b in pairs]
    return out


def _forward_window(run: _MemoryRun, event: int) -> int | None:
    """The block in whose forward window ``event`` falls (``bounds[k] < event <=
    bounds[k + 1]``), or ``None`` outside the blocks' forwards."""
    after = bisect.bisect_left(run.bounds, event)
    return after - 1 if 0 < after < len(run.bounds) else None


def _released_at_fwd_end(run: _MemoryRun, n: int, before_chain: bool = True) -> list[int]:
    """Per block, bytes made in the forward window of the block before it that die in
    the post window (from the end of the last block's forward to its backward): what
    the model held outside the chain and released when its forward returned
    (NOTE [ Released when the forward returns ] in _plan/peak.py). Block 0 gets what
    was made before the first block's forward (``before_chain=False``: not that)."""
    start, stop = run.bounds[-1], _marks(run.mem)[f"bwd:{n - 1}"]
    out = [0] * n
    for record in run.mem.records:
        if record.backward or record.died is None or not start < record.died <= stop:
            continue
        made_in = _forward_window(run, record.born)
        if made_in is not None and made_in < n - 1:
            out[made_in + 1] += record.nbytes
        elif before_chain and made_in is None and record.born <= run.bounds[0]:
            out[0] += record.nbytes  # made before the first block (position ids)
    return out


def _freed_in_forward(run: _MemoryRun, n: int) -> list[int]:
    """Per block, bytes of forward-made tensors born before its forward window that die
    in it (its input, when nothing keeps it for backward)."""
    out = [0] * n
    for record in run.mem.records:
        if record.backward or record.died is None:
            continue
        freed_in = _forward_window(run, record.died)
        if freed_in is not None and record.born <= run.bounds[freed_in]:
            out[freed_in] += record.nbytes
    return out


_T = TypeVar("_T")


def _by_pairs(runs: dict[_Pattern, _MemoryRun], i: int,
              value: Callable[[_Pattern, _MemoryRun, int], _T],
              alike: Sequence[int] = (), local: bool = False) -> dict[WindowKey, _T]:
    """``value(pattern, run, i)`` keyed by block ``i``'s (previous decision, own
    decision), from the first run made with each pair (its windows and what else that
    run measured); with ``alike`` (``_alike``), a pair no run made for block ``i > 0``
    from the first block ``j > 0`` alike to it that has one: ``value(pattern, run, j)``
    (NOTE [ Alternations shared by alike blocks ]); with ``local`` (``_pairs_local``),
    (recompute, keep) and (keep, recompute) of a block ``i > 0`` no run made as its
    (keep, keep) and (recompute, recompute) (NOTE [ Pairs that cannot differ ])."""
    out: dict[WindowKey, _T] = {}
    others = [j for j in range(1, len(alike)) if j != i and alike[j] == alike[i]] if i else []
    for j in [i, *others]:
        for pattern, run in runs.items():
            key = (pattern[j - 1] if j > 0 else Decision.KEEP, pattern[j])
            if key not in out:
                out[key] = value(pattern, run, j)
    if local and i > 0:
        keep, recompute = Decision.KEEP, Decision.RECOMPUTE
        for pair, same in (((recompute, keep), (keep, keep)),
                           ((keep, recompute), (recompute, recompute))):
            if pair not in out and same in out:
                out[pair] = out[same]
    return dict(sorted(out.items()))


_Place = tuple[str, int]  # a window of a step: ("F" | "B", block), "pre", "post", "tail", "never"


def _placer(run: _MemoryRun, n: int) -> Callable[[int | None], _Place]:
    """The window event ``k`` of ``run`` falls in (``None``: never freed)."""
    marks = _marks(run.mem)
    # bwd[i + 1] < k <= bwd[i]: block i's backward (NOTE [ Block boundaries in backward ])
    bwd = [marks.get("bwd:-1", marks["end"])] + [marks[f"bwd:{i}"] for i in range(n)]
    ascending = bwd[::-1]

    def place(event: int | None) -> _Place:
        if event is None:
            return ("never", 0)
        block = _forward_window(run, event)
        if block is not None:
            return ("F", block)
        if event <= run.bounds[0]:
            return ("pre", 0)
        if event <= bwd[n]:
            return ("post", 0)
        if event > bwd[0]:
            return ("tail", 0)
        return ("B", n - bisect.bisect_left(ascending, event))
    return place


def _pairs_local(runs: dict[_Pattern, _MemoryRun], n: int) -> bool:
    """Whether no block's windows can depend on its predecessor's mode, read from the
    kept and the checkpointed steps (NOTE [ Pairs that cannot differ ])."""
    handed_on: list[list[list[int]]] = []  # per step, per block: bytes block i + 1 frees
    freed_by_first: list[list[int]] = []  # per step: bytes from before the chain block 0 frees
    for run in (runs[(Decision.KEEP,) * n], runs[(Decision.RECOMPUTE,) * n]):
        place = _placer(run, n)
        handed: list[list[int]] = [[] for _ in range(n)]
        first: list[int] = []
        for record in run.mem.records:
            (born, i), died = place(record.born), place(record.died)
            if died[0] in ("tail", "never"):
                continue  # held by the caller until the end, whatever the modes
            if born == "pre":
                if died[0] in "FB" and died[1] > 0:
                    return False
                if died == ("B", 0):
                    first.append(record.nbytes)
            elif born == "F":
                if died in (("F", i), ("B", i)) or (i == n - 1 and died[0] == "post"):
                    continue
                if i + 1 < n and died in (("F", i + 1), ("B", i + 1)):
                    handed[i].append(record.nbytes)
                    continue
                return False
            elif born == "B":
                if died not in (("B", i), ("B", i - 1)):
                    return False
            elif born == "post" and died[0] in "FB" and died[1] < n - 1:
                return False
        handed_on.append([sorted(h) for h in handed])
        freed_by_first.append(sorted(first))
    return handed_on[0] == handed_on[1] and freed_by_first[0] == freed_by_first[1]


def _pairs_missing(runs: dict[_Pattern, _MemoryRun], n: int, alike: Sequence[int],
                   measured: int) -> bool:
    """Whether some block ``i > 0`` has a pair of the ``measured`` whole-block
    decisions that neither it nor an alike block ``j > 0`` was measured with."""
    for i in range(1, n):
        have = _by_pairs(runs, i, lambda _, run, k: None, alike)
        if len(have) < measured ** 2:
            return True
    return False


def _selective_runs(names: list[str], base: _BaseRuns, setup: _Setup,
                    stage: Callable[[str], None] = lambda _: None,
                    ) -> list[dict[str, SelectiveProfile]]:
    """Each block's selective options (save-sets of op kinds, keep-sets by position),
    measured in steps where every other block is checkpointed or selective, several
    blocks' options in one step (NOTE [ Options measured together ]); block ``i`` takes
    the figures measured on block ``alike[i]``. Recompute FLOPs are measured, as for
    whole blocks: checkpoint's early stop skips the ops after the last one backward
    needs."""
    step, plain = setup.step, base.counter
    ops = [plain.block_ops(name) for name in names]
    options = _selective_options(names, [plain.block_stats(name) for name in names], ops,
                                 setup.cost_model)
    alike = base.alike
    members: dict[int, list[int]] = {}
    for i, like in enumerate(alike):
        members.setdefault(like, []).append(i)
        internal_assert(options[i].keys() == options[like].keys(),
                        f"blocks {names[like]} and {names[i]} have the same ops but not the "
                        "same selective options")
    pending = {like: sorted(options[like]) for like in members}
    measured: dict[tuple[int, str], tuple[WindowMemory, WindowMemory, int]] = {}
    steps = max((len(keys) for keys in pending.values()), default=0)
    while any(pending.values()):
        stage(f"selective options {steps - max(len(k) for k in pending.values()) + 1}/{steps}")
        chosen: dict[int, str] = {}  # block -> the option it runs in this step
        for like, keys in pending.items():
            for i in members[like]:
                if keys:
                    chosen[i] = keys.pop(0)
        contexts = _Contexts({names[i]: options[i][key][0] for i, key in chosen.items()},
                             {names[i]: options[i][key][1] for i, key in chosen.items()})
        counter = FlopCounter() if setup.backend is None else None
        run = _memory_run(step, names, (Decision.RECOMPUTE,) * len(names), contexts,
                          rounding=setup.rounding, backend=setup.backend, counter=counter)
        flops = _recompute_flops(counter, plain, names) if counter is not None else \
            _checkpointed_flops(step, names, plain, contexts.eager)
        for i, key in chosen.items():
            measured[alike[i], key] = (run.fwd[i], run.bwd[i], flops[i])
    out: list[dict[str, SelectiveProfile]] = [{} for _ in names]
    for i, block_options in enumerate(options):
        for key in sorted(block_options):
            fwd, bwd, flops_i = measured[alike[i], key]
            out[i][key] = dataclasses.replace(block_options[key][2], fwd=fwd, bwd=bwd,
                                              recompute_flops=flops_i)
    return out


_Option = tuple[ContextFn, Any, SelectiveProfile]  # eager context, compiled one, figures


def _selective_options(names: list[str], op_stats: list[dict[str, OpStats]],
                       block_ops: list[tuple[OpRecord, ...]],
                       cost_model: CostModel) -> list[dict[str, _Option]]:
    """Per block, its selective options keyed as the tape keys them: save-sets of op
    kinds (NOTE [ Save-sets by op kind ]) and keep-sets by position, ``#1``, ``#2``, ...
    (NOTE [ Dead ops ]), each with its contexts and static figures. Blocks with the same
    ops share their keep-sets (one MILP per distinct block)."""
    options: list[dict[str, _Option]] = [{} for _ in names]
    for i, stats in enumerate(op_stats):
        for save in save_sets(k for k, s in stats.items() if s.count):
            redo = [s for k, s in stats.items() if k not in save]
            options[i][save_set_name(save)] = (
                selective_context(save), compiled_context(save),
                _partial(sum(s.out_bytes for s in redo), sum(s.count for s in redo)))
    solved: dict[tuple[OpRecord, ...], list[KeepSet]] = {}
    for i, ops in enumerate(block_ops):
        untimed = tuple(dataclasses.replace(o, ms=0.0) for o in ops)  # keep_sets reads no ms
        if untimed not in solved:
            solved[untimed] = keep_sets(ops, cost_model)
        signature = op_signature(ops)
        for k, found in enumerate(solved[untimed]):
            rerun = [o for j, o in enumerate(ops)
                     if j not in found.keep and j not in found.skip]
            options[i][f"#{k + 1}"] = (
                selective_context(keep_ops=found.keep, skip_ops=found.skip,
                                  signature=signature),
                compiled_context(keep=keep_keys(ops, found.keep)),
                _partial(sum(o.out_bytes for o in rerun), len(rerun),
                         found.keep, found.skip))
    return options


def _alike(model: nn.Module, names: list[str], runs: dict[_Pattern, _MemoryRun],
           ops: list[tuple[OpRecord, ...]]) -> list[int]:
    """Per block, the first block that measures as it does (itself if none): the same
    class, parameters, input and output bytes and ops (``ms`` aside), and the same
    figures in the kept and the checkpointed step (``runs``: those two at least).
    NOTE [ Options measured together ], NOTE [ Alternations shared by alike blocks ]."""
    n = len(names)
    kept, ckpt = runs[(Decision.KEEP,) * n], runs[(Decision.RECOMPUTE,) * n]
    # what the model made before the chain and releases when the forward returns is
    # filed under block 0 but is not made by it: HF GPT-2's position ids made its first
    # layer unlike the others, and its 11 selective options took 11 steps instead of 2
    released = [_released_at_fwd_end(run, n, before_chain=False) for run in (kept, ckpt)]
    first: dict[tuple[Any, ...], int] = {}
    out = []
    for i, name in enumerate(names):
        module = model.get_submodule(name)
        signature = (
            type(module), param_signature(module),
            kept.probe.input_bytes[i], kept.probe.output_bytes[i],
            tuple(dataclasses.replace(o, ms=0.0) for o in ops[i]),
            # block 0 checkpointed comes after the kept stem (KEEP, RECOMPUTE), any other
            # after a checkpointed block (RECOMPUTE, RECOMPUTE), as in a selective step
            kept.fwd[i], kept.bwd[i], ckpt.fwd[i], ckpt.bwd[i],
            released[0][i], released[1][i],
        )
        out.append(first.setdefault(signature, i))
    return out


def _partial(recompute_bytes: int, recompute_ops: int, keep: tuple[int, ...] = (),
             skip: tuple[int, ...] = ()) -> SelectiveProfile:
    """A selective option's static figures; the measured ones are filled in later."""
    empty = WindowMemory(peak_bytes=0, delta_bytes=0)
    return SelectiveProfile(fwd=empty, bwd=empty, recompute_flops=0,
                            recompute_bytes=recompute_bytes, recompute_ops=recompute_ops,
                            keep_ops=keep, skip_ops=skip)


@dataclass(frozen=True)
class _Setup:
    """What ``profile``'s arguments come to once checked, before any step runs."""

    step: Step  # the step the runs measure (of a compiled model's inner module)
    backend: str | None  # torch.compile backend of the steps; None: eager
    ran_on: torch.device  # where the steps run
    target: str  # the device the tape is for (tape.device)
    cost_model: CostModel  # the target's rates
    rounding: Rounding | None
    offload: bool
    host_bandwidth: float | None
    names: list[str]  # the blocks given or found, in the order defined


def _why_no_chain(model: nn.Module) -> str:
    """Why discovery may have found no chain: a container holding one module more than
    once (weights shared by reuse; such a block would run more than once per step), or
    a list of layers holding a single one."""
    for name, module in model.named_modules():
        kids = [k for k in module._modules.values() if k is not None]
        if len({id(k) for k in kids}) < len(kids):
            return (f" ({name or 'the model'!r} holds one module more than once: a block "
                    "reused at several positions runs more than once per step, and "
                    "autoremat plans blocks that run once)")
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) == 1:
            return (f" ({name or 'the model'!r} holds a single block, and a plan chooses "
                    "among two or more: build the model with more layers)")
    return ""


def _checked_setup(step: Step, blocks: BlockSpec, *, repeats: int, with_selective: bool,
                   timing: bool, rounding: Rounding | None,
                   device: str | torch.device | None, compile: bool | str, offload: bool,
                   host_bandwidth: float | None, with_head: bool = True) -> _Setup:
    """``profile``'s arguments checked (a mistake fails here, before any work; the step's
    own values were checked when it was made)."""
    backend = compile_backend(compile)
    if offload and backend is not None:
        raise RematError("profile(offload=True, compile=...) is not supported: offloaded "
                         "blocks run saved-tensor hooks that torch.compile does not trace. "
                         "Profile with one of them")
    if host_bandwidth is not None and not offload:
        raise RematError("host_bandwidth= only matters with offload=True; pass both, or "
                         "neither")
    if host_bandwidth is not None and (not isinstance(host_bandwidth, (int, float))
                                       or isinstance(host_bandwidth, bool)
                                       or not host_bandwidth > 0):
        raise RematError(f"host_bandwidth must be a positive number of bytes per second "
                         f"(e.g. 25e9), got {host_bandwidth!r}")
    step = dataclasses.replace(step, model=uncompiled(step.model))
    model = step.model
    check_whole("repeats", repeats, 1, "the uninstrumented steps timed")
    for flag, value in (("with_selective", with_selective), ("timing", timing),
                        ("offload", offload), ("with_head", with_head)):
        check_flag(flag, value)
    if not torch.is_grad_enabled():
        raise RematError("profile() was called with gradients disabled (under "
                         "torch.no_grad() or torch.inference_mode()): it measures a training "
                         "step, whose backward needs them; call it outside that block")
    ran_on = step.device
    on_meta = [t for t in flat_tensors(step.inputs) if t.device.type == "meta"]
    if on_meta and ran_on.type != "meta":
        raise RematError(f"the inputs are on meta and the model on {ran_on}: profile() runs "
                         "a real step, which needs real inputs (build them on the model's "
                         "device); to predict on meta tensors use autoremat.estimate(model, "
                         "inputs)")
    if device is None and ran_on.type == "meta":
        raise RematError("profile() of a model on meta needs device=, the device the tape is "
                         "for (its recompute costs and tape.device), e.g. device='cuda'; or "
                         "use autoremat.estimate(), which gives it")
    target = str(ran_on if device is None else parse_device(device))
    # a device without rates fails before any work
    cost_model = cost_model_for(target, compiled=backend is not None)
    if rounding is None and ran_on.type == "meta":
        rounding = "cuda" if torch.device(target).type == "cuda" else "exact"
    names = resolve_blocks(model, blocks)
    if names == [""]:
        raise BlockError(f"found no chain of blocks in {type(model).__name__}"
                         f"{_why_no_chain(model)}: give blocks=[...] with the names of the "
                         "layers to plan over")
    scripted = [n for n in names if isinstance(model.get_submodule(n), torch.jit.ScriptModule)]
    if scripted:
        raise BlockError(f"block {scripted[0]!r} is a TorchScript module (torch.jit.script), "
                         "which autoremat can neither measure nor checkpoint (it takes no "
                         "hooks): plan the eager model, or leave the blocks unscripted")
    return _Setup(step=step, backend=backend, ran_on=ran_on, target=target,
                  cost_model=cost_model, rounding=rounding, offload=offload,
                  host_bandwidth=host_bandwidth, names=names)


@dataclass(frozen=True)
class _Chain:
    """The blocks planned over, from a first step that measures nothing else."""

    names: list[str]  # in the order they run
    held_inputs: list[bool]  # NOTE [ Boundaries held outside the chain ]
    output_bytes: int  # the model's output, less the loss (tape.output_bytes)
    notes: list[str]  # what changed from the blocks found, and inputs held
    times: _Times | None  # of that first step, when timed and the chain is what it stamped
    loss: str = ""  # the loss it took, in words (conditions.describe_loss)
    autocast: str = ""  # the autocast its blocks ran under (conditions.autocast_state)


def _chain(setup: _Setup, *, in_order: bool, timed: bool) -> _Chain:
    """One uninstrumented step (it also warms up: lazy state is not measured later) that
    finds the chain and the output's size, timed when ``timed``, and one forward without
    gradients that finds the inputs held outside it. ``in_order``: the blocks were
    given, and must run in that order."""
    held: list[int] = []
    step = setup.step
    model, inputs = step.model, step.inputs
    losses: list[tuple[str, str]] = []

    def measure_output(output: Any) -> torch.Tensor:
        check_no_cache(model, output)
        loss = (step.loss_fn or default_loss)(output)
        held.append(output_bytes(output, loss))
        losses.append(describe_loss(output, step.loss_fn, inputs))
        return loss

    seen: list[str] = []
    names = setup.names
    clock = clock_for(setup.ran_on)
    stamps = _Stamps(clock)

    autocast: list[str] = []  # as the first block to run sees it (NOTE [ The conditions a
    # step is measured under ]: a forward may enter autocast itself)

    def mark(label: str) -> None:
        if label.startswith("fwd:") and not autocast:
            autocast.append(autocast_state())
        seen.append(label)
        if timed:
            stamps(label)

    clock.sync()
    warm = _run_marked(dataclasses.replace(step, loss_fn=measure_output), names, mark,
                       in_order=in_order)
    clock.sync()
    notes: list[str] = []
    if not in_order:
        names, notes = _discovered_chain(model, names, warm.order, seen)
    # its times are one sample of the timing (NOTE [ Timing repeats ]) if the chain is
    # the blocks it stamped, in the same order
    stamped = names == setup.names and all(f"bwd:{i}" in stamps.at for i in range(len(names)))
    times = stamps.times(len(names)) if timed and stamped else None
    for p in model.parameters():
        p.grad = None
    held_inputs = _held_boundaries(model, inputs, names)
    if any(held_inputs[1:]):
        inner = [name for name, h in zip(names[1:], held_inputs[1:], strict=True) if h]
        notes.append(
            f"the inputs of {len(inner)} block(s) ({inner[0]}, ...) stay referenced by "
            f"the model outside the chain (skip connections, kept hidden states): a "
            f"segment of several blocks does not free them, and plans count them held")
    loss, kind = losses[0]
    if kind:  # NOTE [ The conditions a step is measured under ]
        why = (f"{type(model).__name__} returns logits and was profiled without loss_fn: "
               f"the step measured takes {loss}, which holds less than the cross-entropy a "
               "training loop takes (its softmax and gradient over the vocabulary); "
               "profile with loss_fn=<the loop's loss>, or give the model labels"
               if kind == "logits" else
               f"{type(model).__name__} returns a batch of outputs, not a loss, and was "
               f"profiled without loss_fn: the step measured takes {loss}, which holds "
               "nothing of the loss a training loop takes (cross-entropy, MSE, ...), so a "
               "plan made from it can go over its budget by what that loss holds; profile "
               "with loss_fn=<the loop's loss>")
        notes.append(why)
        warnings.warn(f"autoremat: {why}", UserWarning, stacklevel=3)
    return _Chain(names=names, held_inputs=held_inputs, output_bytes=held[0], notes=notes,
                  times=times, loss=loss, autocast=autocast[0] if autocast else "")


@dataclass(frozen=True)
class _BaseRuns:
    """The memory steps of whole-block decisions, and the FLOPs and ops counted in them."""

    runs: dict[_Pattern, _MemoryRun]  # by the decision of each block (_patterns)
    counter: OpRecorder  # the plain step's FLOPs by block, and its ops
    recompute_flops: list[int]  # per block, checkpointed on its own
    grad_bytes: int  # all gradients after the plain step
    block_grad_bytes: list[int]  # per block
    host_bandwidth: float  # bytes per second to host memory (0.0 without offload)
    alike: list[int]  # per block, the first block that measures alike (_alike)
    local: bool = False  # pairs read from the uniform steps (NOTE [ Pairs that cannot ... ])

    @property
    def plain(self) -> _MemoryRun:
        return self.runs[(Decision.KEEP,) * len(self.recompute_flops)]


def _base_runs(names: list[str], setup: _Setup,
               stage: Callable[[str], None] = lambda _: None) -> _BaseRuns:
    """One memory step per pattern of whole-block decisions (``_patterns``); eager, the plain
    one also records FLOPs and ops, and the checkpointed one recompute FLOPs
    (NOTE [ One pass for memory and FLOPs ]); compiled, two eager steps count them."""
    n, backend = len(names), setup.backend
    step, model = setup.step, setup.step.model
    eager = backend is None
    counter = OpRecorder()
    ckpt_counter = FlopCounter() if eager else None
    runs: dict[_Pattern, _MemoryRun] = {}
    bandwidth = 0.0
    alike: list[int] = []
    local = False
    patterns = _patterns(n, setup.offload)
    kept, ckpt = (Decision.KEEP,) * n, (Decision.RECOMPUTE,) * n
    for pattern in patterns:
        if len(runs) == 2:  # kept and checkpointed: which blocks measure alike
            if not eager:  # NOTE [ Profiling a compiled step ]: FLOPs and ops from eager
                counter = _flops(step, names)
            alike = _alike(model, names, runs, [counter.block_ops(name) for name in names])
            local = eager and not setup.offload and _pairs_local(runs, n)
            if local:
                break  # NOTE [ Pairs that cannot differ ]
        if len(runs) >= 3 and not setup.offload and \
                not _pairs_missing(runs, n, alike, 2):
            break  # NOTE [ Alternations shared by alike blocks ]
        stage(f"memory runs {len(runs) + 1}/{len(patterns)}")
        runs[pattern] = _memory_run(step, names, pattern, rounding=setup.rounding,
                                    backend=backend,
                                    counter={kept: counter, ckpt: ckpt_counter}.get(pattern)
                                    if eager else None)
        if pattern == kept:  # the gradients the plain step left
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            grad_bytes = unique_storage_bytes(grads)
            block_grad_bytes = [
                unique_storage_bytes([p.grad for p in model.get_submodule(name).parameters()
                                      if p.grad is not None]) for name in names]
            if setup.offload:
                bandwidth = float(setup.host_bandwidth) \
                    if setup.host_bandwidth is not None else measure_host_bandwidth(setup.ran_on)
    for p in model.parameters():
        p.grad = None
    if len(alike) != n:  # a chain of one block
        if not eager:
            counter = _flops(step, names)
        alike = _alike(model, names, runs, [counter.block_ops(name) for name in names])
    recompute_flops = _recompute_flops(ckpt_counter, counter, names) \
        if ckpt_counter is not None else \
        _checkpointed_flops(step, names, counter)
    return _BaseRuns(runs=runs, counter=counter, recompute_flops=recompute_flops,
                     grad_bytes=grad_bytes, block_grad_bytes=block_grad_bytes,
                     host_bandwidth=bandwidth, alike=alike, local=local)


def _mode_notes(model: nn.Module, names: list[str], *, discovered: bool) -> list[str]:
    """Notes on what the tape holds for: the model's mode, and the blocks left out."""
    notes: list[str] = []
    if not model.training:
        # an eval() tape plans a train() step over its budget (dropout's masks are missing)
        eval_note = (f"{type(model).__name__} was profiled in eval() mode (dropout off, "
                     "BatchNorm on running statistics): its figures and plans hold for "
                     "that mode; profile it in the mode you train in (model.train())")
        notes.append(eval_note)
        warnings.warn(f"autoremat: {eval_note}", UserWarning, stacklevel=3)
    if discovered:
        notes.extend(discovery_notes(model))
        others = other_repeated_blocks(model, names)
        if others:
            notes.append(f"planning over the repeated blocks found; also smaller "
                         f"repeated, not planned over: {', '.join(others)} (pass "
                         "blocks=[...] with all of them, in the order they run)")
    return notes


def _tape(setup: _Setup, chain: _Chain, base: _BaseRuns,
          selective: list[dict[str, SelectiveProfile]], times: _Times, *,
          notes: list[str], head: HeadProfile | None = None) -> Tape:
    """The tape, from what the steps measured."""
    names, runs, plain, counter = chain.names, base.runs, base.plain, base.counter
    model, inputs = setup.step.model, setup.step.inputs
    n, ran_on, rounding = len(names), setup.ran_on, setup.rounding
    measured = WINDOW_DECISIONS if setup.offload else WINDOW_DECISIONS[:2]
    released = {pattern: _released_at_fwd_end(run, n) for pattern, run in runs.items()}
    frees = _freed_in_forward(plain, n)
    saved = _saved_by_block(plain)
    offload_stats, input_stats = ([runs[(d,) * n].offloaded.get(name, OffloadStats())
                                   if setup.offload else OffloadStats() for name in names]
                                  for d in (Decision.OFFLOAD, Decision.OFFLOAD_INPUT))
    block_list = []
    for i, name in enumerate(names):
        module = model.get_submodule(name)
        block_list.append(BlockProfile(
            name=name, fwd_ms=times.fwd_ms[i], bwd_ms=times.bwd_ms[i],
            fwd_flops=counter.by_label.get((name, "fwd"), 0),
            bwd_flops=counter.by_label.get((name, "bwd"), 0),
            recompute_flops=base.recompute_flops[i],
            saved_bytes=sum(saved[i].values()),
            saved_bytes_by_kind=dict(sorted(saved[i].items())),
            input_bytes=plain.probe.input_bytes[i], output_bytes=plain.probe.output_bytes[i],
            param_bytes=unique_storage_bytes(list(module.parameters())),
            param_signature=param_signature(module),
            grad_bytes=base.block_grad_bytes[i],
            fwd=_by_pairs(runs, i, lambda _, run, k: run.fwd[k], base.alike, base.local),
            bwd=_by_pairs(runs, i, lambda _, run, k: run.bwd[k], base.alike, base.local),
            op_stats=counter.block_stats(name), ops=counter.block_ops(name),
            selective=selective[i],
            chained=i > 0 and plain.probe.chained[i],
            offload_bytes=offload_stats[i].host_bytes,
            offload_tensors=offload_stats[i].tensors,
            offload_input_bytes=input_stats[i].host_bytes,
            chain_bytes=counted_bytes(plain.probe.chain_bytes[i], ran_on, rounding)
            if i > 0 and not chain.held_inputs[i] else 0,  # NOTE [ Boundaries held ... ]
            fwd_end_release={key: v for key, v in _by_pairs(
                runs, i, lambda pattern, _, k: released[pattern][k], base.alike,
                base.local).items() if v},
            fwd_frees=frees[i],
            stash_bytes=sum(counted_bytes(buf.untyped_storage().nbytes(), ran_on, rounding)
                            for buf in stashed_buffers([module])),
        ))
    params = list(model.parameters())
    return Tape(
        model=type(model).__name__, inputs=describe_inputs(inputs),
        device=setup.target, training=model.training,
        blocks=tuple(block_list),
        step_peak_bytes=plain.mem.peak_bytes, peak_breakdown=plain.mem.breakdown,
        ckpt_step_peak_bytes=runs[(Decision.RECOMPUTE,) * n].mem.peak_bytes,
        param_bytes=unique_storage_bytes(params),
        trainable_param_bytes=unique_storage_bytes([p for p in params if p.requires_grad]),
        trainable_param_tensors=sum(p.requires_grad for p in params),
        input_bytes=unique_storage_bytes(inputs),
        buffer_bytes=unique_storage_bytes(list(model.buffers())),
        grad_bytes=base.grad_bytes,
        pre=plain.pre, post={d: runs[(d,) * n].post for d in measured},
        tail={d: runs[(d,) * n].tail for d in measured},
        offload=setup.offload, host_bandwidth=base.host_bandwidth,
        step_fwd_flops=counter.phase_total("fwd"), step_bwd_flops=counter.phase_total("bwd"),
        step_ms=times.step_ms, loop=setup.step.loop, output_bytes=chain.output_bytes,
        compiled=setup.backend or "", head=head, notes=tuple(notes),
        autocast=chain.autocast, dtypes=float_dtypes(model), loss=chain.loss,
        structure=structure_of(model, names),
    )


# NOTE [ Measuring the head ]
#     Each head option is one more memory step, every block kept, with the head chunked
#     (``head_installed``): its ``post`` and ``tail`` windows are the head's. The block
#     windows do not depend on the head (they are relative to their start), and neither
#     does what a block's decision changes in ``post`` and ``tail`` (what the model releases
#     when the forward returns: a level that differs by a constant from there on), so a
#     plan with checkpointed blocks uses the option's windows moved by the difference
#     the decisions make with the model's own head (``peak.with_head``), its peak by at
#     least nothing: never below what it measures. Two chunk counts are measured
#     (:data:`HEAD_CHUNKS`): few chunks cost least, many hold least; the transient of a
#     chunk is proportional to its rows, so more options would add little.
def _head_options(names: list[str], site: HeadSite,
                  setup: _Setup) -> tuple[HeadProfile | None, str]:
    """The head options of ``site``, measured (NOTE [ Measuring the head ]); or ``None``
    and why, when the chunked head never ran in the step."""
    model = setup.step.model
    step = dataclasses.replace(setup.step, loss_fn=None)  # the chunked head takes the loss
    weight = model.get_submodule(site.name).weight
    weight_bytes = cast(torch.Tensor, weight).untyped_storage().nbytes()
    options = {}
    for chunks in HEAD_CHUNKS:
        with head_installed(model, site, chunks) as install:
            run = _memory_run(step, names, (Decision.KEEP,) * len(names), rounding=setup.rounding)
        if install is None or install.calls != 1:
            calls = 0 if install is None else install.calls
            return None, (f"the loss head {site} took {calls} losses in one step, not one "
                          f"(was it called without labels?): it stays as the model "
                          f"computes it")
        options[f"chunked:{chunks}"] = HeadOption(
            chunks=chunks, post=run.post, tail=run.tail, step_peak_bytes=run.mem.peak_bytes,
            cost=head_cost(chunks, weight_bytes, setup.cost_model))
    for p in model.parameters():
        p.grad = None
    return HeadProfile(kind=site.kind, name=site.name, vocab=site.vocab,
                       weight_bytes=weight_bytes, options=options), ""


def _head(names: list[str], setup: _Setup, with_head: bool,
          stage: Callable[[str], None]) -> tuple[HeadProfile | None, str]:
    """The loss head's options, where the model has a head autoremat can chunk (NOTE
    [ Which heads can be chunked ]); else ``None`` and why ("" when it has no head)."""
    step = setup.step
    site, why = find_head(step.model, step.inputs, step.loss_fn) if with_head else (None, "")
    if site is not None and autocast_state():
        return None, (f"a profile under autocast ({autocast_state()}) measures no loss-head "
                      "options (the chunked head runs in the parameters' dtype): the head "
                      "stays as the model computes it")
    if site is not None and setup.backend is not None:
        return None, ("a compiled profile measures no loss-head options (the head is "
                      "outside the compiled blocks): the head stays as the model computes "
                      "it; plan it from an eager profile")
    if site is None:
        return None, why
    stage("loss head options")
    return _head_options(names, site, setup)


def profile(model: nn.Module | Step, inputs: Any = None, loss_fn: LossFn | None = None,
            blocks: BlockSpec = None, *, repeats: int = 3,
            with_selective: bool = True, timing: bool = True,
            rounding: Rounding | None = None, loop: Loop | None = None,
            device: str | torch.device | None = None, compile: bool | str = False,
            offload: bool = False, host_bandwidth: float | None = None,
            with_head: bool = True,
            progress: Callable[[str], None] | None = None) -> Tape:
    """Measure one training step of ``model`` block by block.

    Args:
        model: the model, in the mode you train it in (dropout and BatchNorm active); or
            an :class:`autoremat.Step`, which carries ``inputs``, ``loss_fn`` and
            ``loop`` (then leave those out and pass the rest by keyword:
            ``profile(step, blocks=...)``; the tape is the same).
        inputs: a tensor, a tuple of positional args, or a dict of keyword args.
        loss_fn: ``loss_fn(output) -> scalar``; default ``output.loss`` when present,
            else the sum of the first floating tensor in the output.
        blocks: ``None`` to find the chain of repeated layers, a list of qualified
            module names, or a predicate ``(name, module) -> bool``.
        repeats: uninstrumented steps timed, at most (medians are reported): the
            first step, which finds the blocks, counts as one when ``repeats >= 3``, and
            timing stops once two steps in a row agree within 5%
            (NOTE [ Timing repeats ]).
        with_selective: also measure selective-recompute options (one more memory step
            per distinct save-set), so that plans can use them.
        timing: time uninstrumented steps; ``False`` (or a model on ``meta``) reports
            all times as 0.0 and says so in ``tape.notes``. On CUDA, times are taken
            with CUDA events (see ``timing.py``).
        rounding: how storage bytes are counted, as in :func:`autoremat.track_memory`:
            by default by device (the CUDA caching allocator's blocks on a GPU);
            ``"cuda"`` predicts a GPU's bytes from a step on ``meta``.
        loop: the training loop to measure (recorded as ``tape.loop``; plans made from
            the tape hold for it). ``"holds_output"`` (default, also for ``None``): the
            output stays
            referenced until backward has finished (``out = model(**batch);
            out.loss.backward()``); a budget that holds for it also holds for a loop
            that releases the output earlier. ``"loss_only"``: only the loss survives
            the forward (``loss = model(**batch).loss``, or ``del out`` before
            backward); tighter, but a loop that holds the output goes over it by up to
            ``tape.output_bytes``.
        device: the device the tape is for (``tape.device``), whose rates cost
            recompute in plans made from it (``costs.py``). Default: the device the
            model runs on. A model on ``meta`` runs nowhere, so it must be given
            (:func:`autoremat.estimate` does); there ``rounding`` defaults to the given
            device's. On a real device, giving another one costs its plans as if they
            ran there (e.g. ``"cuda"`` for an accelerator autoremat has no rates for).
        compile: measure the step as it runs under ``torch.compile`` (``True``: Inductor;
            or a backend name such as ``"aot_eager"``): memory from the allocator's
            reports and times with every block compiled on its own, each option lowered
            as it runs compiled (NOTE [ Profiling a compiled step ]). Plans made from
            the tape (``tape.compiled``) hold for the compiled step, checkpoint blocks
            one by one (no multi-block segments) and run under both whole-model and
            regional compilation. Slow on CPU: every option is compiled.
        offload: also measure each block with its saved tensors offloaded to host
            memory (five more memory steps), so that plans can offload
            (``plan(..., offload=True)``; NOTE [ Offloading saved tensors ]). On a CPU
            the host is the device: offloading frees nothing there, and plans keep
            those blocks instead.
        host_bandwidth: bytes per second of copies between the device and host memory,
            which cost offload in plans. Default: measured on a GPU (pinned memory);
            must be given for a model on ``meta``.
        with_head: also measure the loss head computed over chunks of tokens (one more
            memory step per option, :data:`HEAD_CHUNKS`), where the model has a head
            autoremat can chunk: a Hugging Face ``*ForCausalLM`` given ``labels``, or an
            :class:`autoremat.LMHead` (NOTE [ Which heads can be chunked ]). Plans may
            then chunk it (``tape.head``); the tape's notes say why a head is not.
        progress: called with the name of each stage as it starts (``"memory runs
            2/4"``), for a progress display; default: nothing.

    Returns:
        A frozen :class:`~autoremat.Tape`. The model's buffers, gradients and the
        RNG states are left as they were.

    Example:
        >>> import autoremat
        >>> model, inputs = autoremat.zoo.build("mlp", widths=(128,) * 4, batch_size=256)
        >>> tape = autoremat.profile(model, inputs)
        >>> [block.name for block in tape.blocks]
        ['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3']

    Known limitations:
        * A block that runs more than once per step (shared weights) is rejected.
        * Times on a busy machine are noisy; planning uses FLOPs and bytes, not times.
    """
    step = as_step(model, inputs, loss_fn, loop, caller="profile", keyword="blocks")
    setup = _checked_setup(step, blocks, repeats=repeats, with_selective=with_selective,
                           timing=timing, rounding=rounding, device=device, compile=compile,
                           offload=offload, host_bandwidth=host_bandwidth,
                           with_head=with_head)
    step = setup.step
    stage = progress or (lambda _: None)
    with preserved_state(step.model, step.inputs), training_config(step.model) as cache_notes, \
            compile_settings(setup.backend):
        timed = timing and setup.ran_on.type != "meta"
        stage("warm-up step")
        chain = _chain(setup, in_order=blocks is not None,
                       timed=timed and setup.backend is None)  # compiled: timed compiled
        base = _base_runs(chain.names, setup, stage)
        selective = _selective_runs(chain.names, base, setup, stage) \
            if with_selective else [{} for _ in chain.names]
        notes = _mode_notes(step.model, chain.names, discovered=blocks is None)
        head, why = _head(chain.names, setup, with_head, stage)
        if why:
            notes.append(why)
        if timed:
            stage(f"timing {repeats} steps")
            with _step_as_run(step.model, chain.names, [], None, setup.backend):
                times = _timings(step, chain.names, repeats, first=chain.times)
        else:
            times = _Times.unmeasured(len(chain.names))
            notes.append("times not measured (" + ("meta tensors" if setup.ran_on.type ==
                                                   "meta" else "timing=False") + ")")
    return _tape(setup, chain, base, selective, times, head=head,
                 notes=notes + chain.notes + cache_notes + base.plain.mem.notes)
