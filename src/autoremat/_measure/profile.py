"""``profile``: measure one training step block by block and return a :class:`Tape`.

NOTE [ Three kinds of run ]
    Per-op instrumentation slows a step several-fold, so no figure mixes kinds:
    * memory: four steps under ``track_memory`` (plain; every block checkpointed on its
      own; and two that alternate kept and checkpointed blocks), with marks at block
      boundaries. Windows between marks give what the planner composes (see
      ``tape.py``), for each pair (previous block's mode, this block's mode): who
      holds a boundary tensor depends on both its producer and its consumer. Memory
      is exact and deterministic.
    * FLOPs: one step under a FLOP counter labelled by block.
    * time: ``repeats`` steps with nothing but hooks at block boundaries; medians.
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

from autoremat._core.allocations import track_allocations
from autoremat._core.blocks import (
    BlockSpec,
    discovery_notes,
    other_repeated_blocks,
    param_signature,
    resolve_blocks,
)
from autoremat._core.errors import (
    BlockError,
    RematError,
    check_flag,
    check_whole,
    did_you_mean,
    internal_assert,
)
from autoremat._core.memory import MemoryTracker, Rounding, counted_bytes, track_memory
from autoremat._core.ops import OpRecorder, OpStats, op_kind
from autoremat._core.step import (
    Loop,
    LossFn,
    call_model,
    check_inputs,
    check_loop,
    check_loss_fn,
    check_no_cache,
    default_loss,
    describe_inputs,
    flat_tensors,
    output_bytes,
    parse_device,
    preserved_state,
    run_step,
    training_config,
    unique_storage_bytes,
)
from autoremat._core.timing import clock_for, device_of
from autoremat._measure.costs import CostModel, cost_model_for, head_cost
from autoremat._measure.keepsets import keep_sets
from autoremat._measure.tape import (
    BlockProfile,
    HeadOption,
    HeadProfile,
    SelectiveProfile,
    Tape,
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


def _run_marked(model: nn.Module, inputs: Any, loss_fn: LossFn | None, names: list[str],
                on_mark: Callable[[str], None], *, loop: Loop,
                in_order: bool = True) -> _Probe:
    """One step with marks at the block boundaries. Every block must run once; with
    ``in_order``, in the order of ``names`` (``False``: the caller reads ``probe.order``)."""
    probe = _Probe(names, on_mark)
    with probe.installed(model):
        on_mark("start")
        run_step(model, inputs, loss_fn, between=lambda: on_mark("backward"), loop=loop)
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


def _memory_run(model: nn.Module, inputs: Any, loss_fn: LossFn | None,
                names: list[str], modes: str,
                contexts: _Contexts | None = None, *,
                rounding: Rounding | None, loop: Loop,
                backend: str | None = None) -> _MemoryRun:
    """One step measured, block ``i`` in mode ``modes[i]``: ``K`` kept, ``C``
    checkpointed (with its context from ``contexts``, if any), ``O`` offloaded, ``P``
    checkpointed with its input offloaded."""
    internal_assert(len(modes) == len(names), f"modes {modes!r} for {len(names)} blocks")
    for p in model.parameters():
        p.grad = None
    chosen = [n for n, m in zip(names, modes, strict=True) if m == "C"]
    offloaded = [n for n, m in zip(names, modes, strict=True) if m == "O"]
    inputs_offloaded = [n for n, m in zip(names, modes, strict=True) if m == "P"]
    with _step_as_run(model, names, chosen, contexts, backend, offloaded,
                      inputs_offloaded) as states:
        if backend is not None:  # compile first: compiling allocates too
            _run_marked(model, inputs, loss_fn, names, lambda label: None, loop=loop)
            for p in model.parameters():
                p.grad = None
        with (track_allocations(device_of(model, inputs)) if backend is not None
              else track_memory(rounding)) as mem:
            probe = _run_marked(model, inputs, loss_fn, names, mem.mark, loop=loop)
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


def _flops(model: nn.Module, inputs: Any, loss_fn: LossFn | None,
           names: list[str], *, loop: Loop) -> OpRecorder:
    counter = OpRecorder()

    def on_mark(label: str) -> None:
        kind, _, index = label.partition(":")
        if kind in ("fwd", "bwd") and index != "-1":
            counter.label = names[int(index)]
        else:
            counter.label = "<outside>"

    with counter, torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        _run_marked(model, inputs, loss_fn, names, on_mark, loop=loop)
    return counter


def _recompute_flops(model: nn.Module, inputs: Any, loss_fn: LossFn | None, names: list[str],
                     plain: OpRecorder,
                     contexts: dict[str, ContextFn] | None = None, *,
                     loop: Loop) -> list[int]:
    """Per block, the FLOPs its recompute runs with every block checkpointed (those in
    ``contexts`` selective with that context): backward FLOPs minus the plain step's.
    Measured, so checkpoint's early stop (no re-run after the last op backward needs)
    and skipped dead ops are included."""
    with checkpointed(model, names, contexts):
        counter = _flops(model, inputs, loss_fn, names, loop=loop)
    for p in model.parameters():
        p.grad = None
    return [counter.by_label.get((n, "bwd"), 0) - plain.by_label.get((n, "bwd"), 0)
            for n in names]


def _timings(model: nn.Module, inputs: Any, loss_fn: LossFn | None, names: list[str],
             repeats: int, *, loop: Loop) -> tuple[list[float], list[float], float]:
    """Per-block forward and backward medians and the step's, from stamps at the block
    boundaries: ``perf_counter`` on the CPU, CUDA events read after one synchronise at
    the end of each step on a GPU (NOTE [ CUDA-synchronised times ] in ``timing.py``)."""
    n = len(names)
    fwd: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    steps: list[float] = []
    clock = clock_for(device_of(model, inputs))
    for _ in range(repeats):
        stamps: dict[str, Any] = {}
        def stamp(label: str, stamps: dict[str, Any] = stamps) -> None:
            if label not in stamps:  # the first time a boundary is reached
                stamps[label] = clock.stamp()

        clock.sync()
        _run_marked(model, inputs, loss_fn, names, stamp, loop=loop)
        clock.sync()
        for i in range(n):
            nxt = stamps[f"fwd:{i + 1}"] if i + 1 < n else stamps["fwd_end"]
            fwd[i].append(clock.elapsed_ms(stamps[f"fwd:{i}"], nxt))
            end = stamps.get(f"bwd:{i - 1}", stamps["end"]) if i else \
                stamps.get("bwd:-1", stamps["end"])
            bwd[i].append(clock.elapsed_ms(stamps[f"bwd:{i}"], end))
        steps.append(clock.elapsed_ms(stamps["start"], stamps["end"]))
        for p in model.parameters():
            p.grad = None
    return ([statistics.median(x) for x in fwd], [statistics.median(x) for x in bwd],
            statistics.median(steps))


def _patterns(n: int, offload: bool) -> list[str]:
    """The memory runs of a profile, as the mode of each block: every block kept, every
    one checkpointed, then alternations so that each block is measured after a
    neighbour of each other mode (``_by_modes``); with ``offload``, the same for ``O``."""
    def alternate(even: str, odd: str) -> str:
        return "".join(even if i % 2 == 0 else odd for i in range(n))

    pairs = [("C", "K"), ("K", "C")]
    if offload:
        pairs += [(a, b) for new in "OP" for old in "KCO"[:"KCOP".index(new)]
                  for a, b in ((new, old), (old, new))]
    out = ["K" * n, "C" * n] + (["O" * n, "P" * n] if offload else [])
    if n > 1:
        out += [alternate(a, b) for a, b in pairs]
    return out


def _forward_window(run: _MemoryRun, event: int) -> int | None:
    """The block in whose forward window ``event`` falls (``bounds[k] < event <=
    bounds[k + 1]``), or ``None`` outside the blocks' forwards."""
    after = bisect.bisect_left(run.bounds, event)
    return after - 1 if 0 < after < len(run.bounds) else None


def _released_at_fwd_end(run: _MemoryRun, n: int) -> list[int]:
    """Per block, bytes made in the forward window of the block before it that die in
    the post window (from the end of the last block's forward to its backward): what
    the model held outside the chain and released when its forward returned
    (NOTE [ Released when the forward returns ] in plan/peak.py). Block 0 gets 0."""
    start, stop = run.bounds[-1], _marks(run.mem)[f"bwd:{n - 1}"]
    out = [0] * n
    for record in run.mem.records:
        if record.backward or record.died is None or not start < record.died <= stop:
            continue
        made_in = _forward_window(run, record.born)
        if made_in is not None and made_in < n - 1:
            out[made_in + 1] += record.nbytes
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


def _by_modes(runs: dict[str, _MemoryRun], i: int,
              value: Callable[[str, _MemoryRun, int], _T]) -> dict[str, _T]:
    """``value(modes, run, i)`` keyed by block ``i``'s (previous mode, own mode), from
    the first run made with each pair (its windows and what else that run measured)."""
    out: dict[str, _T] = {}
    for modes, run in runs.items():
        key = (modes[i - 1] if i > 0 else "K") + modes[i]
        if key not in out:
            out[key] = value(modes, run, i)
    return dict(sorted(out.items()))


def _selective_runs(model: nn.Module, inputs: Any, loss_fn: LossFn | None, names: list[str],
                    op_stats: list[dict[str, OpStats]], plain: OpRecorder,
                    cost_model: CostModel,
                    rounding: Rounding | None, *,
                    loop: Loop, backend: str | None,
                    progress: Callable[[str], None]) -> list[dict[str, SelectiveProfile]]:
    """Per save-set of op kinds, and per keep-set index, one memory step and one FLOP
    step: blocks that have that option run selective, the others fully checkpointed (so
    every block's neighbours are checkpointed). Recompute FLOPs are measured, as for whole
    blocks: checkpoint's early stop skips the ops after the last one backward needs."""
    out: list[dict[str, SelectiveProfile]] = [{} for _ in names]
    options: dict[str, dict[str, tuple[ContextFn, Any, SelectiveProfile]]] = {}
    for i, stats in enumerate(op_stats):  # save-sets of op kinds (NOTE [ Save-sets by op kind ])
        for save in save_sets(k for k, s in stats.items() if s.count):
            redo = [s for k, s in stats.items() if k not in save]
            options.setdefault(save_set_name(save), {})[names[i]] = (
                selective_context(save), compiled_context(save),
                _partial(sum(s.out_bytes for s in redo), sum(s.count for s in redo)))
    progress("choosing keep-sets")
    for name in names:  # keep-sets by position (NOTE [ Dead ops ])
        ops = plain.block_ops(name)
        signature = op_signature(ops)
        for k, found in enumerate(keep_sets(ops, cost_model)):
            rerun = [o for j, o in enumerate(ops)
                     if j not in found.keep and j not in found.skip]
            options.setdefault(f"#{k + 1}", {})[name] = (
                selective_context(keep_ops=found.keep, skip_ops=found.skip,
                                  signature=signature),
                compiled_context(keep=keep_keys(ops, found.keep)),
                _partial(sum(o.out_bytes for o in rerun), len(rerun),
                         found.keep, found.skip))
    for k, key in enumerate(sorted(options), 1):
        progress(f"selective options {k}/{len(options)}")
        users = options[key]
        contexts = _Contexts({n: ctx for n, (ctx, _, _) in users.items()},
                             {n: ctx for n, (_, ctx, _) in users.items()})
        run = _memory_run(model, inputs, loss_fn, names, "C" * len(names), contexts,
                          rounding=rounding, loop=loop, backend=backend)
        flops = _recompute_flops(model, inputs, loss_fn, names, plain, contexts.eager,
                                 loop=loop)
        for i, name in enumerate(names):
            if name in users:
                out[i][key] = dataclasses.replace(users[name][2], fwd=run.fwd[i],
                                                  bwd=run.bwd[i], recompute_flops=flops[i])
    return out


def _partial(recompute_bytes: int, recompute_ops: int, keep: tuple[int, ...] = (),
             skip: tuple[int, ...] = ()) -> SelectiveProfile:
    """A selective option's static figures; the measured ones are filled in later."""
    empty = WindowMemory(peak_bytes=0, delta_bytes=0)
    return SelectiveProfile(fwd=empty, bwd=empty, recompute_flops=0,
                            recompute_bytes=recompute_bytes, recompute_ops=recompute_ops,
                            keep_ops=keep, skip_ops=skip)


# NOTE [ Measuring the head ]
#     Each head option is one more memory step, every block kept, with the head chunked
#     (``head_installed``): its ``post`` and ``tail`` windows are the head's. The block
#     windows do not depend on the head (they are relative to their start), and neither
#     does what a block's mode changes in ``post`` and ``tail`` (what the model releases
#     when the forward returns: a level that differs by a constant from there on), so a
#     plan with checkpointed blocks uses the option's windows moved by the difference
#     the modes make with the model's own head (``peak.with_head``), its peak by at
#     least nothing: never below what it measures. Two chunk counts are measured
#     (:data:`HEAD_CHUNKS`): few chunks cost least, many hold least; the transient of a
#     chunk is proportional to its rows, so more options would add little.
def _head_options(model: nn.Module, inputs: Any, names: list[str], site: HeadSite,
                  cost_model: CostModel, *, rounding: Rounding | None, loop: Loop,
                  ) -> tuple[HeadProfile | None, str]:
    """The head options of ``site``, measured (NOTE [ Measuring the head ]); or ``None``
    and why, when the chunked head never ran in the step."""
    weight = model.get_submodule(site.name).weight
    weight_bytes = cast(torch.Tensor, weight).untyped_storage().nbytes()
    options = {}
    for chunks in HEAD_CHUNKS:
        with head_installed(model, site, chunks) as install:
            run = _memory_run(model, inputs, None, names, "K" * len(names),
                              rounding=rounding, loop=loop)
        if install is None or install.calls != 1:
            calls = 0 if install is None else install.calls
            return None, (f"the loss head {site} took {calls} losses in one step, not one "
                          f"(was it called without labels?): it stays as the model "
                          f"computes it")
        options[f"chunked:{chunks}"] = HeadOption(
            chunks=chunks, post=run.post, tail=run.tail, step_peak_bytes=run.mem.peak_bytes,
            cost=head_cost(chunks, weight_bytes, cost_model))
    for p in model.parameters():
        p.grad = None
    return HeadProfile(kind=site.kind, name=site.name, vocab=site.vocab,
                       weight_bytes=weight_bytes, options=options), ""


def profile(model: nn.Module, inputs: Any, loss_fn: LossFn | None = None,
            blocks: BlockSpec = None, *, repeats: int = 3,
            with_selective: bool = True, timing: bool = True,
            rounding: Rounding | None = None, loop: Loop = "holds_output",
            device: str | torch.device | None = None, compile: bool | str = False,
            offload: bool = False, host_bandwidth: float | None = None,
            with_head: bool = True,
            progress: Callable[[str], None] | None = None) -> Tape:
    """Measure one training step of ``model`` block by block.

    Args:
        model: the model, in the mode you train it in (dropout and BatchNorm active).
        inputs: a tensor, a tuple of positional args, or a dict of keyword args.
        loss_fn: ``loss_fn(output) -> scalar``; default ``output.loss`` when present,
            else the sum of the first floating tensor in the output.
        blocks: ``None`` to find the chain of repeated layers, a list of qualified
            module names, or a predicate ``(name, module) -> bool``.
        repeats: uninstrumented steps timed (medians are reported).
        with_selective: also measure selective-recompute options (one more memory step
            per distinct save-set), so that plans can use them.
        timing: time uninstrumented steps; ``False`` (or a model on ``meta``) reports
            all times as 0.0 and says so in ``tape.notes``. On CUDA, times are taken
            with CUDA events (see ``timing.py``).
        rounding: how storage bytes are counted, as in :func:`autoremat.track_memory`:
            by default by device (the CUDA caching allocator's blocks on a GPU);
            ``"cuda"`` predicts a GPU's bytes from a step on ``meta``.
        loop: the training loop to measure (recorded as ``tape.loop``; plans made from
            the tape hold for it). ``"holds_output"`` (default): the output stays
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
            2/6"``), for a progress display; default: nothing.

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
    if not isinstance(model, nn.Module):
        raise RematError(f"profile() needs an nn.Module, got {type(model).__name__}")
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
    model = uncompiled(model)
    check_whole("repeats", repeats, 1, "the uninstrumented steps timed")
    for flag, value in (("with_selective", with_selective), ("timing", timing),
                        ("offload", offload), ("with_head", with_head)):
        check_flag(flag, value)
    check_inputs(inputs)
    check_loss_fn(loss_fn)
    if not torch.is_grad_enabled():
        raise RematError("profile() was called with gradients disabled (under "
                         "torch.no_grad() or torch.inference_mode()): it measures a training "
                         "step, whose backward needs them; call it outside that block")
    check_loop(loop)
    ran_on = device_of(model, inputs)
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
        raise BlockError(f"found no chain of blocks in {type(model).__name__}: give "
                         f"blocks=[...] with the names of the layers to plan over")
    stage = progress or (lambda _: None)
    with preserved_state(model), training_config(model) as cache_notes, \
            compile_settings(backend):
        held: list[int] = []

        def measure_output(output: Any) -> torch.Tensor:
            check_no_cache(model, output)
            loss = (loss_fn or default_loss)(output)
            held.append(output_bytes(output, loss))
            return loss

        seen: list[str] = []
        stage("warm-up step")
        warm = _run_marked(model, inputs, measure_output, names, seen.append,
                           loop=loop, in_order=blocks is not None)  # and the output's size
        order_notes: list[str] = []
        if blocks is None:
            names, order_notes = _discovered_chain(model, names, warm.order, seen)
        for p in model.parameters():
            p.grad = None
        n = len(names)
        held_inputs = _held_boundaries(model, inputs, names)
        if any(held_inputs[1:]):
            inner = [name for name, h in zip(names[1:], held_inputs[1:], strict=True) if h]
            order_notes.append(
                f"the inputs of {len(inner)} block(s) ({inner[0]}, ...) stay referenced by "
                f"the model outside the chain (skip connections, kept hidden states): a "
                f"segment of several blocks does not free them, and plans count them held")
        patterns = _patterns(n, offload)
        stage(f"memory runs 1/{len(patterns)}")
        plain = _memory_run(model, inputs, loss_fn, names, "K" * n, rounding=rounding,
                            loop=loop, backend=backend)
        grads = {id(p): p.grad for p in model.parameters() if p.grad is not None}
        grad_bytes = unique_storage_bytes(list(grads.values()))
        block_grad_bytes = [
            unique_storage_bytes([p.grad for p in model.get_submodule(n).parameters()
                                  if p.grad is not None]) for n in names
        ]
        modes_measured = "KCOP" if offload else "KC"
        bandwidth = 0.0
        if offload:
            bandwidth = float(host_bandwidth) if host_bandwidth is not None else \
                measure_host_bandwidth(ran_on)
        runs = {"K" * n: plain}
        for k, modes in enumerate(patterns[1:], 2):
            stage(f"memory runs {k}/{len(patterns)}")
            runs[modes] = _memory_run(model, inputs, loss_fn, names, modes,
                                      rounding=rounding, loop=loop, backend=backend)
        for p in model.parameters():
            p.grad = None
        stage("counting FLOPs")
        counter = _flops(model, inputs, loss_fn, names, loop=loop)
        for p in model.parameters():
            p.grad = None
        recompute_flops = _recompute_flops(model, inputs, loss_fn, names, counter, loop=loop)
        op_stats = [counter.block_stats(name) for name in names]
        params = list(model.parameters())
        selective = _selective_runs(model, inputs, loss_fn, names, op_stats, counter,
                                    cost_model, rounding, loop=loop, backend=backend,
                                    progress=stage) if with_selective else [{} for _ in names]
        on_meta = ran_on.type == "meta"
        notes: list[str] = []
        site, why = find_head(model, inputs, loss_fn) if with_head else (None, "")
        head = None
        if site is not None and backend is not None:
            site, why = None, ("a chunked loss head does not run under torch.compile: "
                               "the head stays as the model computes it")
        if site is not None:
            stage("loss head options")
            head, why = _head_options(model, inputs, names, site, cost_model,
                                      rounding=rounding, loop=loop)
        if why:
            notes.append(why)
        if not model.training:
            # issue 16: an eval() tape planned a train() step 35% over its budget
            eval_note = (f"{type(model).__name__} was profiled in eval() mode (dropout off, "
                         "BatchNorm on running statistics): its figures and plans hold for "
                         "that mode; profile it in the mode you train in (model.train())")
            notes.append(eval_note)
            warnings.warn(f"autoremat: {eval_note}", UserWarning, stacklevel=2)
        if blocks is None:
            notes.extend(discovery_notes(model))
            others = other_repeated_blocks(model, names)
            if others:
                notes.append(f"planning over the repeated blocks found; also smaller "
                             f"repeated, not planned over: {', '.join(others)} (pass "
                             "blocks=[...] with all of them, in the order they run)")
        if timing and not on_meta:
            stage(f"timing {repeats} steps")
            with _step_as_run(model, names, [], None, backend):
                fwd_ms, bwd_ms, step_ms = _timings(model, inputs, loss_fn, names, repeats,
                                                   loop=loop)
        else:
            fwd_ms, bwd_ms, step_ms = [0.0] * n, [0.0] * n, 0.0
            notes.append("times not measured (" + ("meta tensors" if on_meta else
                                                   "timing=False") + ")")

    released = {modes: _released_at_fwd_end(run, n) for modes, run in runs.items()}
    frees = _freed_in_forward(plain, n)
    saved = _saved_by_block(plain)
    offload_stats, input_stats = ([runs[m * n].offloaded.get(name, OffloadStats()) if offload
                                   else OffloadStats() for name in names] for m in "OP")
    block_list = []
    for i, name in enumerate(names):
        module = model.get_submodule(name)
        block_list.append(BlockProfile(
            name=name, fwd_ms=fwd_ms[i], bwd_ms=bwd_ms[i],
            fwd_flops=counter.by_label.get((name, "fwd"), 0),
            bwd_flops=counter.by_label.get((name, "bwd"), 0),
            recompute_flops=recompute_flops[i],
            saved_bytes=sum(saved[i].values()),
            saved_bytes_by_kind=dict(sorted(saved[i].items())),
            input_bytes=plain.probe.input_bytes[i], output_bytes=plain.probe.output_bytes[i],
            param_bytes=unique_storage_bytes(list(module.parameters())),
            param_signature=param_signature(module),
            grad_bytes=block_grad_bytes[i],
            fwd=_by_modes(runs, i, lambda _, run, k: run.fwd[k]),
            bwd=_by_modes(runs, i, lambda _, run, k: run.bwd[k]),
            op_stats=op_stats[i], ops=counter.block_ops(name), selective=selective[i],
            chained=i > 0 and plain.probe.chained[i],
            offload_bytes=offload_stats[i].host_bytes,
            offload_tensors=offload_stats[i].tensors,
            offload_input_bytes=input_stats[i].host_bytes,
            chain_bytes=counted_bytes(plain.probe.chain_bytes[i], ran_on, rounding)
            if i > 0 and not held_inputs[i] else 0,  # NOTE [ Boundaries held outside the chain ]
            fwd_end_release={key: v for key, v in _by_modes(
                runs, i, lambda modes, _, k: released[modes][k]).items() if v},
            fwd_frees=frees[i],
            stash_bytes=sum(counted_bytes(buf.untyped_storage().nbytes(), ran_on, rounding)
                            for buf in stashed_buffers([module])),
        ))
    return Tape(
        model=type(model).__name__, inputs=describe_inputs(inputs),
        device=target, training=model.training,
        blocks=tuple(block_list),
        step_peak_bytes=plain.mem.peak_bytes, peak_breakdown=plain.mem.breakdown,
        ckpt_step_peak_bytes=runs["C" * n].mem.peak_bytes,
        param_bytes=unique_storage_bytes(params),
        trainable_param_bytes=unique_storage_bytes([p for p in params if p.requires_grad]),
        trainable_param_tensors=sum(p.requires_grad for p in params),
        input_bytes=unique_storage_bytes(inputs),
        buffer_bytes=unique_storage_bytes(list(model.buffers())),
        grad_bytes=grad_bytes,
        pre=plain.pre, post={m: runs[m * n].post for m in modes_measured},
        tail={m: runs[m * n].tail for m in modes_measured},
        offload=offload, host_bandwidth=bandwidth,
        step_fwd_flops=counter.phase_total("fwd"), step_bwd_flops=counter.phase_total("bwd"),
        step_ms=step_ms, loop=loop, output_bytes=held[0], compiled=backend or "", head=head,
        notes=tuple(notes + order_notes + cache_notes + plain.mem.notes),
    )
