"""The instrumented steps of a profile.

One step with marks at the block boundaries, measured for memory (and FLOPs
in the same pass), for FLOPs alone, or timed; the first step, which finds the
chain; and what the memory timeline of a step gives per block (windows,
bytes saved, released, freed). Which steps a profile runs is ``options.py``'s;
the Tape is built in ``profile.py`` (NOTE [ Three kinds of run ] there).

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

NOTE [ What the next block takes of an output ]
    The op recorder is told, when a block's forward starts, which tensors it takes of
    the output of the block before (``_Probe.on_output``; ``OpRecorder.outputs``), and
    the profile records the ops that made their storages (``BlockProfile.output_ops``,
    NOTE [ A selective block that keeps its output ] in _plan/peak.py). What matters
    there is the storage: a selective option that keeps it holds it to the block's
    backward, past the backward of whatever else saved it. So a tensor counts as taken
    when it shares a storage with the output (the same storage object, still alive), not
    only when it is the output tensor itself, unchanged: an entry of a ModuleList that is
    no block of the chain (an in-place ReLU, which also saves the storage, or a view)
    hands the next block the output as another version or as another tensor. Told only
    the unchanged output tensors, the recorder noted none, and a selective attention
    block without a residual before such a ReLU was predicted one output (2 KiB) under
    its measured peak (~40 fuzzed models). One the next block does not save is counted
    as let go of in its forward (``output_unsaved``: held from the forward on), also
    where an op between them saved it (exact on the cases tried).

NOTE [ Boundaries held outside the chain ]
    A segment of several blocks keeps its first input and drops the inner boundaries
    (the peak model subtracts ``chain_bytes``), which frees them only when nothing else
    holds them. A U-Net's parent keeps each encoder block's output in a list of skips
    until the decoder reads it, and a parent that names every hidden state keeps them
    all; the segment then frees nothing there. The input of block ``i`` is held when it
    is still alive once block ``i`` has returned: at the next module call after it (the
    next block, or a norm or head between or after them), or when the forward returns.
    The last block's input was checked at the forward's return only: SegFormer's
    encoder names every stage's output in a list its decode head reads, gone by then,
    and a segment ending at its last stage was predicted 6,144 B under the step's peak,
    which is in that head. Those blocks get
    ``chain_bytes = 0``, so composed segments over them are predicted as holding what
    they hold. Autograd's saved tensors would keep every such input alive (the Python
    object of a tensor autograd saved lives as long as the saved tensor), so the check
    runs in the warm-up step with every saved tensor packed as a detached alias
    (``_HeldInputs``: the same storage, another object): then only the model's own
    references keep an input's object. Where that step cannot tell (a compiled step; a
    chain with blocks found between its blocks that it leaves out), one forward without
    gradients does (``_held_boundaries``), where nothing is saved at all.

NOTE [ Tensors blocks take that die later in the chain ]
    A block's windows are measured after its predecessor's decision, not after those of
    the blocks before it. A tensor passed to several blocks besides their input (an
    encoder's attention mask, a vision tower's sequence lengths) that no op saves is
    freed where the model lets go of it: when a sub-model returns, in the window of the
    block that ran last. A checkpoint of a block it was passed to holds it until that
    block's backward. When that block is the one whose window frees it, or the one just
    before, the windows measured under those decisions see the difference; further back,
    the window of a kept block frees it as measured in the plain step, and the plan held
    it. BART with a padded batch (its encoder's mask, 4 x 1 x 128 x 128, freed when the
    encoder returns after its third layer) measured 64 KiB over the prediction of a plan
    that recomputes the first encoder layer alone (256 KiB with eager attention);
    Qwen2-VL's vision tower (its attention's 12 bytes of lengths, freed after its
    merger's layers), 12 bytes over. The warm-up step follows, by storage, every tensor a
    block of the chain takes besides its input: one autograd saves while it is followed
    is held by the plain step too, and one that is still alive when the last block of
    the chain returns is freed when the forward returns (NOTE [ Released when the forward
    returns ] in _plan/peak.py). The others, freed in the window of a block two or more
    after the first block taking them, are ``tape.held_past_release`` (by the first
    block taking them and that window's block), counted held through the step in a plan
    that recomputes a block from the first taking them to two before that window, unless
    the window's block and the one before it are each checkpointed alone (the step with
    every block checkpointed measured those windows holding it). Exact where the plan
    recomputes such a block that takes them (the tower of
    ``test_a_tensor_blocks_take_that_dies_later_in_the_chain_is_counted_held``: every
    pattern measured to the byte); an over-count by their bytes where it recomputes only
    blocks in that range that do not take them. Where the warm-up step cannot tell (a
    compiled step), none is counted. The optimal planner follows the three largest in
    its states (NOTE [ Held past release in the DP ] in _plan/chain.py) and adds the
    others to each plan it finds as that plan holds them (``_best_final``).

NOTE [ Tensors blocks take that the model frees when it returns ]
    A block's output that later blocks take besides their input, held by the model until
    its forward returns (DPT's neck keeps every feature map in a list until it returns,
    and a later fusion layer takes one as its residual), is counted released when the
    forward returns under the decision of the block after the one that made it (NOTE
    [ Released when the forward returns ] in _plan/peak.py: what the window before a
    block made and the post window freed), whatever the blocks taking it do. A
    checkpoint of a block taking it holds it until that block's backward, through the
    head's backward: a plan recomputing DPT's last fusion layer alone measured its
    residual (128 KiB) over its prediction. The warm-up step records them
    (``tape.freed_at_return``: the block after the one that returned each, the blocks
    taking it, its bytes; none saved by autograd, alive when the chain's last block
    returns), and a plan that checkpoints a block taking one counts held through the
    step what it counts released of it (``held_at_return`` in _plan/peak.py): exact where
    the step peaks after the forward, over by its bytes where it peaks before. Tensors
    made before the chain are the first block's release, counted as NOTE [ What the model
    made before the chain ] says. One the parent makes between blocks is counted with
    the release of the first block taking it, as made in the window just before it: a
    T5 whose encoder and decoder are one chain passes its encoder's output (its final
    norm's, the parent's) to every decoder layer, and under autocast nothing saves it
    (the cross-attention saves its bf16 cast); plans recomputing a later decoder layer
    measured it (2%) over their predictions. One made in an earlier window is counted
    against the wrong block's release (by at most that release: over or under).

NOTE [ Tensors a block saves that a later block takes ]
    A tensor a block's forward saves for its backward and a block two or more after it
    takes besides its input (a U-Net's skip, the output of a down block's convolutions,
    which its downsampling convolution saves, taken by the up block) lives until the
    first's backward when it is kept. A checkpoint of the later block holds it until that
    block's backward; so where the first is checkpointed too, as in the step that
    measured the checkpointed windows, it is freed there, and the levels the peak model
    composes for a checkpointed block between them (from that step's windows of the
    blocks after it) count it freed. A plan keeping the first and checkpointing a block
    after it, up to the last taking it, holds it past that: a 1-d U-Net whose blocks were
    named measured a skip (512 KiB) over plans recomputing an up block. The warm-up step
    records them (``tape.saved_by_maker``: the block saving each, the blocks taking it,
    its bytes), and the levels composed for checkpointed blocks between a kept saver
    and its takers count them held (``_saved_by_maker`` in _plan/peak.py). Whether the
    saver is kept is the plan's, which the solver's states do not hold: the solver
    searches without them, and its final plans are predicted with them
    (``_best_final`` in _plan/chain.py), as what a recompute holds past its release is;
    it may so drop a plan a little dearer that holds fewer. A tensor saved before it is
    passed is held by the plain step too, so it is not one of those the two notes above
    count.

NOTE [ Saves shared by calls through a cache ]
    A layer called at several blocks of the chain under autocast (a ModuleList holding
    one layer twice, ALBERT's) casts its weights in its first call; its later calls find
    the casts in autocast's cache, which holds them until the forward returns, and save
    them too. Kept, the first call holds them to its backward, the last of them; not
    kept, a kept later call holds them to its own. The profile's steps put calls an even
    number of blocks apart under one decision, so no window sees the mix, and the
    alternating steps that do (calls an odd number apart) see it in the release and the
    backward window they measured. The warm-up step records, by storage, what a block
    saves that an earlier block saved first and still holds, without taking it (not a
    parameter or buffer): ``tape.shared_saves`` (the first, the later blocks, its bytes).
    ``_as_if_unshared`` in profile.py puts every run's figures as if no later block held
    them (released when the forward returns where the first is not kept), and the peak
    model counts what a plan holds past that (NOTE [ Saves shared by calls of a layer ]
    in _plan/peak.py). Where the warm-up step cannot tell (a compiled step), none is
    counted.

NOTE [ Casts a block makes that a later block saves ]
    Where the first call of a shared layer does not save its weights' casts (its input
    needs no gradient, so the weight's gradient needs the input only), a later call
    that does (its input needs one) saves the cast the first call made, found in
    autocast's cache: the first call's decision does not hold it, the later call's does.
    The warm-up step records it as a shared save of the first block holding the
    parameter that ran (by the cast's autograd node, ``ToCopyBackward0`` of the
    parameter's gradient accumulator), so that a plan recomputing the first call and
    keeping the later one counts it held: fuzzed models with an input that needs no
    gradient measured one bf16 weight over such plans (16 models, up to 1.6 KiB, an
    ``optimal`` plan over its budget). Recorded apart (``tape.cast_saves``), it is put
    in every step as if the first call saved it (``_as_if_unshared`` in profile.py): in
    a step keeping the first call, it is counted held through the backward window of
    the first kept later call (which freed it) and freed in the first call's, and where
    no later call is kept, not freed when the forward returns but in the first call's
    backward too; it was left as measured there,
    and a plan recomputing the first call and keeping the later ones took the later
    call's window from such a step, which freed it, with the release of the step that
    did not keep it, which freed it again: one bf16 weight under (8 of 9,742 fuzzed
    models after the fix above, up to 1.1 KiB; ``optimal`` over its budget in 5 of
    1,832). Plans keeping the first call, the plain step's included, are over-predicted
    by it (held to the first call's backward, where the step frees it in a later call's).

NOTE [ Casts a later call takes from the cache and does not save ]
    A later call of a shared layer also takes from autocast's cache casts it does not
    save (a Linear's bias: ``addmm`` saves its input and weight only). The plain
    forward's window of that call makes none; a segment's recompute, run under a cache
    emptied since (NOTE [ Backward inside autocast ] in _mechanism/wrap.py), casts them
    again, and the cache holds them to the recompute's end: fuzzed [later call, gated
    block] segments measured the bias's cast (16-56 B) over their predictions (4 of
    1,200 models). Nothing saves them, so the saved-tensor hooks do not see them: where
    blocks share a parameter and autocast is on, the warm-up step walks the autograd
    nodes each block's forward made (from its output, through the nodes no earlier walk
    met) and notes the edges to the cast of a shared parameter (``ToCopyBackward0`` of
    its gradient accumulator) an earlier block made, less those the block saves:
    ``tape.cached_casts`` (the block that made it, the later blocks taking it, its
    bytes: the parameter's elements at autocast's dtype). A segment's recompute holds
    them from their block on (``segment_runs`` in _plan/peak.py), through the last
    block's checkpointed window: over by them where that window peaks in its
    backward. The walk costs one visit per autograd node, in that step only, and only
    where a parameter is shared.

NOTE [ Block boundaries in backward ]
    A forward post-hook registers a tensor hook on the block's output; it fires when
    that gradient is complete, which is when the block's backward starts. The block's
    backward ends when the gradient of its input is ready: the previous block's mark, or
    a hook on the first block's input (when it requires grad), or the end of backward.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import statistics
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import nn

from autoremat._core.calls import calls_beyond
from autoremat._core.conditions import autocast_devices, autocast_state
from autoremat._core.decisions import Decision
from autoremat._core.errors import BlockError, RematError, internal_assert
from autoremat._core.step import (
    Step,
    call_model,
    check_no_cache,
    clear_grads,
    default_loss,
    describe_loss,
    flat_tensors,
    output_bytes,
    scalar_in_output,
    unique_storage_bytes,
)
from autoremat._measure.flops import FlopCounter
from autoremat._measure.measured import BackwardStarts, grad_tensors, measure_step
from autoremat._measure.memory import (
    MemoryTracker,
    Rounding,
    StorageRecord,
    _tensors_in,
    live_record,
)
from autoremat._measure.ops import OpRecorder, hook_views, op_kind
from autoremat._measure.tape import WindowMemory
from autoremat._measure.timing import Clock, clock_for
from autoremat._mechanism.compiled import compiled_forwards
from autoremat._mechanism.offload import BlockOffload, OffloadStats, offloading
from autoremat._mechanism.wrap import ContextFn, checkpointed, watch_buffers
from autoremat._plan.costs import CostModel

__all__ = ["compile_settings", "refuse_hf_checkpointing"]


def _storage_key(t: torch.Tensor) -> int | None:
    """The storage ``t`` views (its address), or ``None`` for one without a storage of
    its own (sparse, nested)."""
    return t.untyped_storage()._cdata if t.layout is torch.strided else None


def _first_grad_tensor(obj: Any) -> torch.Tensor | None:
    tensors = grad_tensors(obj)
    return tensors[0] if tensors else None


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
    # per chained block, the tracker's record of its first input's storage (None: not
    # made in the step)
    chain_records: list[StorageRecord | None] = field(default_factory=list)
    # per block, the ids of the tracker's records of its input tensors' storages (those
    # made in the step; NOTE [ An input later blocks take too ] in _profile/profile.py)
    input_records: list[set[int]] = field(default_factory=list)
    order: list[int] = field(default_factory=list)  # block indices in the order they ran
    in_backward: list[int] = field(default_factory=list)  # calls made while backward ran
    grad_off: list[bool] = field(default_factory=list)  # a call ran with gradients off
    # a call ran with gradients off inside torch.utils.checkpoint (a reentrant checkpoint
    # the model makes itself), not in a no_grad of the model's own (a reversible layer)
    in_checkpoint: list[bool] = field(default_factory=list)
    # a call in backward ran inside torch.utils.checkpoint (its recompute)
    rerun_in_checkpoint: list[bool] = field(default_factory=list)
    changes_input: list[bool] = field(default_factory=list)  # its forward wrote an input
    passed: list[bool] = field(default_factory=list)  # it returned what it was given
    watch: bool = False  # note the buffers each block's forward changes (watch_buffers)
    # told in forward what the next block takes of each block's output, by storage
    # (NOTE [ What the next block takes of an output ]), and of the last block's output
    # when it returns: the op recorder's OpRecorder.outputs
    on_output: Callable[[int, list[torch.Tensor]], None] | None = None
    # told each block's module and positional arguments as its forward starts: the op
    # recorder's views to skip (NOTE [ A block with a full backward hook ] in ops.py)
    on_args: Callable[[nn.Module, tuple[Any, ...]], None] | None = None
    # the block before's outputs: id -> (weak reference, version)
    _prev_outputs: dict[int, tuple[weakref.ref[torch.Tensor], int]] = field(
        default_factory=dict)
    # the storages of the block before's output, by key, as weak references (NOTE [ What
    # the next block takes of an output ])
    _prev_storages: dict[int, Any] = field(default_factory=dict)
    _watched: dict[int, Callable[[], None]] = field(default_factory=dict)
    _inputs: dict[int, list[tuple[torch.Tensor, int]]] = field(default_factory=dict)
    starts: BackwardStarts = field(init=False)  # NOTE [ Where a block's backward starts ]
    # per block that ran with gradients this step, its calls running again without them
    # now (NOTE [ A block run again without gradients ]); absent: none with gradients yet
    _reruns: dict[int, int] = field(default_factory=dict)
    forwards: int = 0  # the model's forwards with gradients in this step, before backward

    def __post_init__(self) -> None:
        n = len(self.names)
        self.calls = [0] * n
        self.input_bytes = [0] * n
        self.output_bytes = [0] * n
        self.chained = [False] * n
        self.chain_bytes = [0] * n
        self.chain_records = [None] * n
        self.input_records = [set() for _ in range(n)]
        self.in_backward = [0] * n
        self.grad_off = [False] * n
        self.in_checkpoint = [False] * n
        self.rerun_in_checkpoint = [False] * n
        self.changes_input = [False] * n
        self.passed = [False] * n
        # returned only its input or views of it (NOTE [ After a block that returns its
        # input ])
        self.aliases = [False] * n
        self.starts = BackwardStarts(self.on_mark)

    @contextmanager
    def installed(self, model: nn.Module) -> Iterator[None]:
        with ExitStack() as stack:
            stack.callback(model.register_forward_pre_hook(self._forward).remove)
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

    def _forward(self, model: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self.forwards += 1

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if _rerun_without_grad(self._reruns, i):
                return  # NOTE [ A block run again without gradients ]
            self.calls[i] += 1
            if torch._C._current_graph_task_id() != -1:  # a recompute in backward
                self.in_backward[i] += 1
                self.rerun_in_checkpoint[i] |= _in_torch_checkpoint()
                return
            if not torch.is_grad_enabled():
                self.grad_off[i] = True
                self.in_checkpoint[i] |= _in_torch_checkpoint()
            self._reruns[i] = 0 if torch.is_grad_enabled() else -1
            self.order.append(i)
            if self.on_args is not None:
                self.on_args(module, args)
            if self.watch:  # NOTE [ Buffers a forward changes ] in _mechanism/wrap.py
                self._watched[i] = watch_buffers(module)
            self.on_mark(f"fwd:{i}")
            tensors = flat_tensors((args, kwargs))
            self.starts.took(tensors)  # NOTE [ Where a block's backward starts ]
            if self.on_output is not None and self.order[:-1]:
                # what this block takes of the output of the block before, by storage
                # (NOTE [ What the next block takes of an output ])
                self.on_output(self.order[-2], [t for t in tensors if self._takes_output(t)])
            self._inputs[i] = [(t, t._version) for t in tensors]
            self.input_bytes[i] = unique_storage_bytes(tensors)
            # the block before's output, unchanged: an op in place between them (an
            # in-place activation) saves for backward what a segment cannot replay
            # (not after a block that returned its input: NOTE [ After a block that
            # returns its input ])
            self.chained[i] = bool(tensors) and self._is_prev_output(tensors[0]) \
                and not (len(self.order) > 1 and self.aliases[self.order[-2]])
            if self.chained[i]:
                self.chain_bytes[i] = tensors[0].untyped_storage().nbytes()
                self.chain_records[i] = live_record(tensors[0].untyped_storage())
            self.input_records[i] = {id(r) for t in tensors
                                     if (r := live_record(t.untyped_storage())) is not None}
            if i == 0:
                first = _first_grad_tensor((args, kwargs))
                if first is not None:
                    first.register_hook(self._grad_mark("bwd:-1"))
        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _rerun_returned(self._reruns, i):
                return
            watched = self._watched.pop(i, None)
            if watched is not None:
                watched()
            inputs = self._inputs.pop(i, ())
            self.changes_input[i] |= any(t._version != version for t, version in inputs)
            tensors = flat_tensors(output)
            if torch._C._current_graph_task_id() == -1:  # (not a recompute's call)
                given = {id(t) for t, _ in inputs}
                self.passed[i] = bool(tensors) and all(id(t) in given for t in tensors)
                storages = {_storage_key(t) for t, _ in inputs} - {None}
                self.aliases[i] = bool(tensors) and all(
                    _storage_key(t) in storages for t in tensors)
                if self.aliases[i] and not self.passed[i]:  # a view of its input: no
                    self.chained[i] = False  # segment ends with it either
                    self.chain_bytes[i] = 0
            self.output_bytes[i] = unique_storage_bytes(tensors)
            self._prev_outputs = {id(t): (weakref.ref(t), t._version) for t in tensors}
            if self.on_output is not None:
                self._prev_storages = {(st := t.untyped_storage())._cdata: weakref.ref(st)
                                       for t in _tensors_in(tensors)}
            self.starts.watch(f"bwd:{i}", tensors)
            self.on_mark(f"post:{i}")  # NOTE [ Ops between blocks ]
            if i == len(self.names) - 1:
                if self.on_output is not None and torch._C._current_graph_task_id() == -1:
                    # the last block: no block takes its output, but what the model and
                    # the loss do after the chain (a head) may save it; told under the
                    # label after the chain (NOTE [ A selective block that keeps its
                    # output ] in _plan/peak.py)
                    self.on_output(i, tensors)
                self.on_mark("fwd_end")
        return hook

    # NOTE [ After a block that returns its input ]
    #     A block that returns what it was given (an ``nn.Identity`` in the chain: timm's
    #     RegNet's ``final_conv``, HRNet's fuse layers) hands the next block the input of
    #     the block before. A segment over the three was composed as if that tensor were
    #     made inside it: timm's RegNet found by its attributes (NOTE [ Layers held as
    #     attributes ] in _measure/blocks.py), a segment from a stage through its
    #     ``final_conv`` to its head, measured one stage output (11,776 B) over its
    #     prediction (a held-out check, 2026-12-02). The block after one that returned
    #     its input is not chained to it, so no segment runs across it; the block itself
    #     is planned as measured (kept, or checkpointed alone, at no cost). One that
    #     returns a view of its input (an einops ``Rearrange`` layer in LookViT's patch
    #     stem, ``nn.Flatten``, a transpose) computes and saves nothing either, and the
    #     segments around it were composed as if the viewed tensor were made inside them:
    #     a segment from the layer before through it, or from the layer after it, measured
    #     that tensor over its prediction (16 KiB in LookViT, where the next layer norm
    #     saved the view; a ``Sequential`` of linear layers, a transpose and residual
    #     MLPs, likewise; a held-out check, 2026-12-02). Such a block is chained to
    #     neither neighbour, and discovery leaves it out of the chain (``_discovered_
    #     chain``): it runs between the blocks, whose segments around a view made there
    #     measure their predictions.

    def _is_prev_output(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is an output of the block before, unchanged since.

        NOTE [ The block before's output, by identity ]
            The outputs were recorded by ``id``: one the model dropped between the blocks
            (timm's Visformer runs a patch embedding and adds a position embedding
            between its stages) freed its Python object, whose id a tensor made after it
            took, so the next stage's first block was marked chained in some profiles
            and not in others, and a plan joining the stages in one segment failed in
            its forward ("does not take the previous block's output"; a held-out check,
            2026-12-02). A weak reference to each output tells the same tensor from one
            at its address."""
        ref, version = self._prev_outputs.get(id(tensor), (None, -1))
        return ref is not None and ref() is tensor and tensor._version == version

    def _takes_output(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (an argument of a block) shares a storage with the output of
        the block before, still the same one (NOTE [ What the next block takes of an
        output ])."""
        for t in _tensors_in(tensor):
            st = t.untyped_storage()
            ref = self._prev_storages.get(st._cdata)
            if ref is not None and ref() is st:
                return True
        return False

    def _grad_mark(self, label: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self.on_mark(label)
        return hook


# NOTE [ A block run again without gradients ]
#     A loss that runs the model again under ``torch.no_grad()`` (a KL term against the
#     model's own output, DPO's reference forward of a PEFT model with its adapters
#     turned off) calls every block a second time in the step. Such a call saves nothing
#     for backward, and a plan's guards and checkpoints let it run as it is; its memory
#     is the loss's, in the windows after the forward. The profile's hooks do not count
#     or mark it: counted, it made every block "run twice in one step", and profile
#     refused the model as one that changes how often it runs its blocks (a held-out
#     DPO loop, 2026-11-30). A block first called without gradients (one the model runs
#     so itself) is counted as ever.
def _rerun_without_grad(reruns: dict[int, int], i: int) -> bool:
    """Whether this call of block ``i`` runs it again without gradients after a call
    with them in this step's forward, noted in ``reruns`` until it returns."""
    if torch.is_grad_enabled() or reruns.get(i, -1) < 0 \
            or torch._C._current_graph_task_id() != -1:
        return False
    reruns[i] += 1
    return True


def _rerun_returned(reruns: dict[int, int], i: int) -> bool:
    """Whether block ``i`` returned from a call :func:`_rerun_without_grad` noted."""
    if reruns.get(i, 0) > 0:
        reruns[i] -= 1
        return True
    return False


class RepeatedCalls(BlockError):
    """Blocks ran more than once in one forward: ``sequence`` is the blocks' names in
    the order their forward calls ran (NOTE [ A block that runs several times ])."""

    def __init__(self, message: str, sequence: list[str]) -> None:
        super().__init__(message)
        self.sequence = sequence


# NOTE [ Two forwards in one step ]
#     A loss that runs the model again with gradients (``loss_fn=lambda z1: (z1 *
#     model(v2)).sum()``, a siamese loss's second view) calls every block twice in one
#     step, each forward starting the blocks' calls anew: profile took it for a model
#     that changes how often it runs its blocks, naming calls the user never wrote
#     (``'blocks.0@0' ran 2 times``; a held-out check, 2026-11-30). The probe counts the
#     model's forwards with gradients before backward and refuses two or more, saying
#     what to profile instead; a wrapper whose forward runs the model on each view is one
#     forward, planned call by call. A rerun without gradients is no forward of the step
#     (NOTE [ A block run again without gradients ]).


# NOTE [ Blocks skipped at random ]
#     A model that skips blocks at random in training (stochastic depth by the whole
#     batch: ``if self.training and torch.rand(()) < p: return x``) skips other blocks in
#     each step a profile measures: windows of steps that ran different blocks do not
#     compose, and the tape misled (held-out, 2026-11-30: "no gradient reached the output
#     of block(s)", blocks called frozen, or a plan whose later steps went 1.31-1.54x
#     over its budget without a warning). Hugging Face's LayerDrop is turned off while
#     measuring (NOTE [ Random layer skipping ] in _core/step.py); for any other, each
#     step of a profile notes which blocks returned what they were given unchanged
#     (``_Probe.passed``), and a block that did so in one step and not in another is
#     refused, saying what to do. A block that always returns its input is planned as
#     measured.
SKIPS_SEEN: ContextVar[dict[str, bool] | None] = ContextVar("autoremat_skips_seen",
                                                            default=None)


def _check_skips(names: list[str], probe: _Probe) -> None:
    """Refuse blocks that returned their input unchanged in one step of this profile
    (``SKIPS_SEEN``, set by ``profile``) and not in another (NOTE [ Blocks skipped at
    random ])."""
    seen = SKIPS_SEEN.get()
    if seen is None:
        return
    for name, calls, passed in zip(names, probe.calls, probe.passed, strict=True):
        if calls and seen.setdefault(name, passed) != passed:
            raise BlockError(
                f"block {name!r} returned its input unchanged in one step of the profile "
                f"and computed in another: the model skips blocks at random in training "
                f"(stochastic depth, layer drop), and steps that run different blocks "
                f"cannot be planned as one. Turn the skipping off while profiling (its "
                f"drop probability to 0) and back on after: the plan then holds for the "
                f"step where every block runs, the largest (Hugging Face's LayerDrop is "
                f"turned off by autoremat itself)")


def _run_marked(step: Step, names: list[str], on_mark: Callable[[str], None], *,
                in_order: bool = True, watch: bool = False, missing_ok: bool = False,
                on_output: Callable[[int, list[torch.Tensor]], None] | None = None,
                on_args: Callable[[nn.Module, tuple[Any, ...]], None] | None = None,
                ) -> _Probe:
    """One step with marks at the block boundaries. Every block must run once; with
    ``in_order``, in the order of ``names`` (``False``: the caller reads ``probe.order``).
    ``watch``: note the buffers each block's forward changes (``watch_buffers``).
    ``missing_ok``: blocks that did not run at all are left to the caller (found blocks
    of a stack the step does not run: a vision tower given no image), as long as some
    ran. ``on_output(i, tensors)``: told what the next block takes of block ``i``'s
    output, in forward. ``on_args(module, args)``: told each block's positional
    arguments as its forward starts."""
    probe = _Probe(names, on_mark, watch=watch, on_output=on_output, on_args=on_args)
    with probe.installed(step.model):
        on_mark("start")
        step.run(between=probe.starts.settle_and(on_mark, "backward"))
        on_mark("end")
    _check_skips(names, probe)
    again = [name for name, n in zip(names, probe.in_backward, strict=True) if n]
    if again:
        shown = f"{again[:3]}{' ...' if len(again) > 3 else ''}"
        if not any(probe.rerun_in_checkpoint):
            raise BlockError(
                f"block(s) {shown} ran again in backward, not inside torch.utils.checkpoint: "
                f"the model recomputes them itself in its backward (reversible layers that "
                f"remake their inputs from their outputs, or checkpointing of its own, as "
                f"DeepSpeed's or Megatron's), and autoremat's plan would recompute inside its "
                f"recompute. Turn that off if the model has a switch for it, or plan over "
                f"other layers with blocks=[...]")
        raise BlockError(
            f"block(s) {shown} ran again in backward: "
            f"the model checkpoints them itself ({_OWN_CHECKPOINTING}), and autoremat's plan "
            f"would checkpoint inside its checkpoints. Turn the model's own checkpointing off "
            f"and let the plan decide what to recompute")
    missing_ok = missing_ok and any(probe.calls)
    if probe.forwards > 1:  # NOTE [ Two forwards in one step ]
        raise BlockError(
            f"{type(step.model).__name__}'s forward ran {probe.forwards} times with gradients "
            f"in one step (a loss_fn that runs the model again, on a second view: a "
            f"siamese or contrastive loss): a plan is made for one forward per backward. "
            f"Run the views in one forward: a module whose forward calls the model on each "
            f"(autoremat plans its blocks call by call), or one batch (torch.cat), and "
            f"profile that")
    if (all(probe.calls) or missing_ok) and max(probe.calls) > 1:
        # NOTE [ A block that runs several times ] in _core/calls.py: profile plans it
        # call by call
        repeated = next(n for n, c in zip(names, probe.calls, strict=True) if c > 1)
        raise RepeatedCalls(
            f"block {repeated!r} ran {max(probe.calls)} times in one step, more often than "
            f"in the step that found the chain: the model changes how often it runs its "
            f"blocks from step to step, which a plan cannot follow",
            [names[i] for i in probe.order])
    beyond = calls_beyond(step.model)
    if beyond:
        layer, times, found = beyond[0]
        raise BlockError(
            f"{layer!r} ran {times} times in one step, and {found} times in the step that "
            f"found the chain: the model changes how often it runs its layers from step to "
            f"step (a random number of loops?), which a plan made call by call cannot "
            f"follow. Fix the number of loops while training, or pass blocks=[...] naming "
            f"modules that run once per step")
    for name, calls in zip(names, probe.calls, strict=False):
        if calls == 0 and missing_ok:
            continue
        if calls == 0:
            container = step.model.get_submodule(name)
            if isinstance(container, (nn.ModuleList, nn.ModuleDict)):
                inside = [f"{name}.{k}" for k in container._modules][:2]
                raise BlockError(
                    f"block {name!r} is a {type(container).__name__}, a container the "
                    f"model does not call: name the layers in it, blocks={[*inside, '...']}")
            ran = [n for n, c in zip(names, probe.calls, strict=False) if c]
            raise BlockError(
                f"block {name!r} never ran as a module call in one step (its hooks did not "
                f"fire): the model skipped it, or calls its forward method directly "
                f"(layer.forward(...), as SqueezeBERT's encoder does), which bypasses "
                f"nn.Module.__call__. autoremat measures and checkpoints a block through "
                f"its call: pass blocks=[...] naming modules the model calls (the parts of "
                f"each layer that it calls, for instance)"
                + (". If the model skips layers at random in training (a layer drop or "
                   "stochastic depth of its own, in the loop over them), set its "
                   "probability to 0 while profiling: the plan holds for the step where "
                   "none is skipped, and a skipped layer holds nothing"
                   if ran and step.model.training else ""))
        if calls != 1:
            raise BlockError(f"block {name!r} ran {calls} times in one step, and some block "
                             f"given did not run at all (blocks that run several times are "
                             f"planned call by call where every block runs): pass blocks=[...] "
                             f"naming blocks the step runs")
    if in_order and probe.order != sorted(probe.order):
        ran = [names[i] for i in probe.order]
        raise BlockError(f"the blocks ran in the order {ran}, not in the order given "
                         f"({names}); autoremat plans over a chain: list the blocks in the "
                         "order they run")
    return probe


# what a model's own checkpointing looks like to the probe, and how to turn it off
_OWN_CHECKPOINTING = ("torch.utils.checkpoint in its forward, or Hugging Face's "
                      "gradient checkpointing: model.gradient_checkpointing_disable()")


def refuse_hf_checkpointing(model: nn.Module, caller: str,
                            then: str = "let the plan decide what to recompute", *,
                            would: str = "would measure and plan on top of it") -> None:
    """Refuse a model with Hugging Face gradient checkpointing on: ``caller`` would measure
    a model that already recomputes every layer, and plan on top of it (NOTE [ One
    checkpointing at a time ] in ``autoremat/hf.py``). Read from the modules' flag:
    Transformers 5 recomputes a layer without calling it again, so the probe's check of
    blocks run again in backward (``_run_marked``) does not see it."""
    on = [name for name, m in model.named_modules()
          if getattr(m, "gradient_checkpointing", False) is True]
    if on:
        raise BlockError(
            f"the model already has Hugging Face gradient checkpointing on ({len(on)} "
            f"modules, e.g. {on[0] or type(model).__name__!r}): it recomputes every layer "
            f"itself, and {caller} {would} (NOTE [ One "
            "checkpointing at a time ] in autoremat/hf.py). Call "
            "model.gradient_checkpointing_disable() (activation_checkpointing_disable() in "
            f"Transformers 5) and {then}")


def _without_views(probe: _Probe, order: list[int], how: str, notes: list[str]) -> list[int]:
    """``order`` without the blocks that return a view of their input, with a note
    saying which (``how``: "found", "named"), where some others remain (NOTE [ After a
    block that returns its input ] in ``_Probe``)."""
    views = [i for i in order if probe.aliases[i] and not probe.passed[i]]
    if not views or len(views) == len(order):
        return order
    notes.append(f"{len(views)} of the blocks {how} return a view of their input "
                 f"({_span([probe.names[i] for i in views])}: a reshape or permute as a "
                 f"layer of its own, nn.Flatten), which computes and saves nothing: they "
                 f"run between the blocks, planned over the {len(order) - len(views)} "
                 f"others")
    return [i for i in order if i not in views]


def _discovered_chain(model: nn.Module, probe: _Probe,
                      marks: list[str]) -> tuple[list[str], list[str]]:
    """The blocks found by discovery that a plan can use, in the order they ran, and
    notes on what changed. Blocks that backward never runs through (frozen, with an input
    that needs no gradient: the lower layers of a partial fine-tune) save nothing for
    backward, so there is nothing to recompute in them: they leave the chain. So do
    blocks whose forward changes their input in place (an in-place activation as a layer
    of its own: torchvision's VGG and AlexNet, ``nn.Sequential(..., nn.ReLU(inplace=True),
    ...)``): a checkpoint keeps a block's input for its recompute, and they cannot be
    checkpointed (named in ``blocks=``, they are refused where a plan checkpoints them);
    they run between the blocks, as a stem does. Until 2026-11-29 (sixteenth session)
    ``profile`` refused such a model."""
    names, order = probe.names, probe.order
    notes = _run_order_note(probe, "found")
    writers = [names[i] for i in order if probe.changes_input[i]]
    if writers and len(writers) < len(order):
        notes.append(f"{len(writers)} of the blocks found change their input in place "
                     f"({_span(writers)}: an in-place activation, for instance), which a "
                     f"checkpoint keeps for its recompute: they run between the blocks, "
                     f"planned over the {len(order) - len(writers)} others")
        order = [i for i in order if not probe.changes_input[i]]
    order = _without_views(probe, order, "found", notes)
    idle = [name for name, calls in zip(names, probe.calls, strict=True) if not calls]
    if idle:
        notes.append(f"{len(idle)} of the blocks found did not run in the step profiled "
                     f"({_span(idle)}: a stack its inputs do not reach, such "
                     f"as a vision tower given no image); planned over the "
                     f"{len(names) - len(idle)} that ran")
    no_backward = [names[i] for i in order if f"bwd:{i}" not in marks]
    chain = [names[i] for i in order if f"bwd:{i}" in marks]
    if no_backward and not chain:
        raise BlockError(f"backward runs through none of the blocks found ({names[0]}, ..., "
                         f"{names[-1]}): {_why_no_backward(model, no_backward, probe)}")
    if no_backward:
        off = {names[i] for i in order if probe.grad_off[i]}
        why = ("run without gradients (under torch.no_grad())" if off >= set(no_backward)
               else "frozen, with an input that needs no gradient" if not off
               else "frozen, or run without gradients")
        notes.append(f"backward never runs through {len(no_backward)} of the blocks found "
                     f"({_span(no_backward)}: {why}), so nothing in them "
                     f"is saved for backward; planned over the {len(chain)} others")
    return chain, notes


def _span(names: list[str]) -> str:
    """``names`` in a note: both of two, else the first and the last."""
    return ", ".join(names) if len(names) <= 2 else f"{names[0]}, ..., {names[-1]}"


def _run_order_note(probe: _Probe, which: str) -> list[str]:
    """A note that the blocks ``which`` ("found", or "the predicate chose") run in
    another order than they are defined, and are planned in the order they run (NOTE
    [ Stacks beside the chain ]); none where they run as defined."""
    names, order = probe.names, probe.order
    if order == sorted(order):
        return []
    return [f"the blocks {which} run in another order than they are defined; planned in "
            f"the order they run: {names[order[0]]}, ..., {names[order[-1]]}"]


_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


def _in_torch_checkpoint() -> bool:
    """Whether torch.utils.checkpoint is running on this thread's stack (a block called
    from a reentrant checkpoint's forward)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_CHECKPOINT_FILE):
            return True
        frame = frame.f_back
    return False


def _why_no_backward(model: nn.Module, names: list[str], probe: _Probe) -> str:
    """Why no gradient reached the output of the blocks ``names`` (as ``probe`` saw them
    run), and what to do."""
    ran = [probe.names.index(n) for n in names]
    if all(probe.output_bytes[i] == 0 for i in ran):
        return ("they return no tensor (None, or only other values): autoremat plans over "
                "blocks whose output carries the computation, since checkpointing a block "
                "saves its inputs and recomputes what it returns. Pass blocks=[...] naming "
                "modules that return their result")
    if all(probe.grad_off[i] for i in ran) and torch.is_grad_enabled():
        if not any(probe.in_checkpoint[i] for i in ran):
            return ("they ran with gradients off while the step had them on, and not "
                    "inside torch.utils.checkpoint: the model runs them under "
                    "torch.no_grad() itself and computes their gradients its own way "
                    "(reversible layers, as Reformer's and RevNet-style models', recompute "
                    "their inputs from their outputs in backward), so there is nothing "
                    "for a plan to recompute. Plan over other layers, with blocks=[...], "
                    "or train such a model as it is")
        return (f"they ran with gradients off while the step had them on, inside a "
                f"reentrant torch.utils.checkpoint: the model checkpoints them itself "
                f"({_OWN_CHECKPOINTING}). Turn that off and let autoremat's plan decide "
                f"what to recompute")
    frozen = all(not p.requires_grad for n in names
                 for p in model.get_submodule(n).parameters())
    if frozen:
        return ("they have no trainable parameter and take no input that needs a gradient, "
                "so backward never runs through them and there is nothing to recompute: "
                "leave them out of blocks=[...] (list the blocks after them)")
    return "autoremat plans over blocks whose output is part of the loss"


@dataclass
class _Side:
    """A tensor passed to blocks besides their first input (NOTE [ Tensors blocks take
    that die later in the chain ]), by its storage."""

    refs: list[weakref.ref[torch.Tensor]]  # the objects passed (a view dies alone)
    nbytes: int
    takers: set[int] = field(default_factory=set)  # the blocks it was passed to
    beside_first: set[int] = field(default_factory=set)  # the takers whose first input
    # is not of its storage
    passed_on: bool = False  # the block that returned it had taken it (a residual
    # stream's first block returns its input as the residual)
    saved: bool = False  # autograd saved its storage while it was followed
    died: int | None = None  # the event at which every object passed was gone
    made_by: int | None = None  # the block that returned it, if one did
    saved_in: int | None = None  # the block whose forward saved it before it was passed


class _HeldInputs:
    """Which blocks' inputs outlive their call, seen in a step with gradients (NOTE
    [ Boundaries held outside the chain ]), and the tensors blocks take besides their
    input that die later in the chain (NOTE [ Tensors blocks take that die later in the
    chain ]): install it around the step and call :meth:`returned` once the model's
    forward has returned."""

    _END = -1  # "next" of the block that ran last

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self._refs: dict[int, weakref.ref[torch.Tensor] | None] = {}
        self._alive: dict[int, bool] = {}
        self._next: dict[int, int] = {}  # block -> the block that started after it
        self._last: int | None = None
        self._returned: int | None = None  # a block returned, no module called since
        self._inside = 0  # blocks running now
        self._sides: list[_Side] = []  # every one seen
        self._live: dict[int, _Side] = {}  # storage key -> the one followed now
        self._events = 0  # blocks started and returned so far
        self._returns: dict[int, int] = {}  # block -> the event of its return
        self._outs: dict[int, list[weakref.ref[torch.Tensor]]] = {}  # block -> its output
        self._ins: dict[int, set[int]] = {}  # block -> the storages of its inputs
        # storage -> what autograd holds of it (alive while saved), and the block whose
        # forward saved it (None: outside the blocks)
        self._packed: dict[int, tuple[weakref.ref[torch.Tensor], int | None]] = {}
        # storage -> (the block that saved it first, the later blocks that saved it too
        # without taking it, its size): NOTE [ Saves shared by calls through a cache ]
        self._shared: dict[int, tuple[int, set[int], int]] = {}
        self._casts: set[int] = set()  # of those, casts the first did not save (NOTE
        # [ Casts a block makes that a later block saves ])
        self._resting: set[int] = set()  # the storages of parameters and buffers
        self._saving: set[int] = set()  # the blocks whose forward saved anything
        # and those that saved a nested tensor (NOTE [ Nested tensors saved ])
        self.nested: set[int] = set()
        # the blocks whose first input's storage autograd saved (before it was passed, or
        # while it was alive after), and each block's first input storage (NOTE [ A
        # segment's last input its recompute lets go ] in _plan/peak.py)
        self._input_saved: set[int] = set()
        self._in_first: dict[int, int] = {}  # storage key -> the block it was passed to
        # parameter (by id) -> the blocks holding it; the blocks in the order they started
        # (NOTE [ Casts a block makes that a later block saves ])
        self._holding: dict[int, list[int]] = {}
        self._started: list[int] = []
        # NOTE [ Casts a later call takes from the cache and does not save ]: parameters
        # (by id) blocks share; autograd nodes seen so far (by id), and of those, the
        # casts of shared parameters, by the block whose walk met them first; the casts
        # saved, as (node id, block); what later blocks took unsaved: (first, later,
        # parameter id) -> bytes
        self._shared_params: dict[int, torch.Tensor] = {}
        self._nodes: set[int] = set()
        self._cast_nodes: dict[int, tuple[int, int]] = {}
        self._saved_casts: set[tuple[int, int]] = set()
        self._cached: dict[tuple[int, int, int], int] = {}

    def _see_deaths(self) -> None:
        for key, side in list(self._live.items()):
            if all(ref() is None for ref in side.refs):
                side.died = self._events
                del self._live[key]

    def _take_sides(self, i: int, tensors: list[torch.Tensor]) -> None:
        for t in tensors[1:]:
            if isinstance(t, nn.Parameter) or t.layout is not torch.strided:
                continue  # (a sparse tensor has no storage to follow)
            storage = t.untyped_storage()
            side = self._live.get(storage._cdata)
            if side is None:
                side = self._live[storage._cdata] = _Side([], storage.nbytes())
                side.made_by = next((k for k, outs in reversed(self._outs.items())
                                     if any(_same_storage(ref(), storage) for ref in outs)),
                                    None)
                side.passed_on = side.made_by is not None and \
                    storage._cdata in self._ins.get(side.made_by, ())
                packed = self._packed.get(storage._cdata)
                if packed is not None and packed[0]() is not None:  # saved before it was
                    side.saved, side.saved_in = True, packed[1]  # passed: held as saved
                self._sides.append(side)
            if all(ref() is not t for ref in side.refs):
                side.refs.append(weakref.ref(t))
            side.takers.add(i)
            if not _same_storage(tensors[0], storage):
                side.beside_first.add(i)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._inside and self._last is not None:
            self._saving.add(self._last)
            if t.is_nested and t.layout is torch.strided:
                self.nested.add(self._last)
        if t.layout is not torch.strided:  # a sparse tensor has no storage of its own:
            return _detached(t)  # not a boundary the chain's checks follow
        key = t.untyped_storage()._cdata
        taker = self._in_first.get(key)
        if taker is not None and _same_storage(_ref_value(self._refs.get(taker)),
                                               t.untyped_storage()):
            self._input_saved.add(taker)
        side = self._live.get(key)
        if side is not None and any(ref() is not None for ref in side.refs):
            side.saved = True  # (all gone: a new storage at a freed one's address, which
            # deaths are checked for only at block events: a BART's dropped cross-attention
            # mask and its head's bf16 weight cast, in some processes and not others)
        alias = _detached(t)
        if self._shared_params and self._inside and self._last is not None:
            node = _cast_node(t)  # NOTE [ Casts a later call takes from the cache ... ]
            if node is not None:
                self._saved_casts.add((id(node), self._last))
        if key not in self._packed or self._packed[key][0]() is None:
            self._packed[key] = (weakref.ref(alias), self._last if self._inside else None)
            self._cast_before(key, t)
        else:
            self._saved_again(key, t)
        return alias

    def _cast_before(self, key: int, t: torch.Tensor) -> None:
        """A block saves, first, autocast's cast of a parameter an earlier block holds,
        which cast it and did not save it (NOTE [ Casts a block makes that a later block
        saves ])."""
        here = self._last if self._inside else None
        node = _cast_node(t)
        if here is None or node is None:
            return
        leaf = getattr(node.next_functions[0][0], "variable", None) \
            if node.next_functions else None
        holders = self._holding.get(id(leaf), ()) if leaf is not None else ()
        first = next((b for b in self._started if b in holders), None)
        if first is not None and first != here:
            self._shared.setdefault(key, (first, set(), t.untyped_storage().nbytes()))[1] \
                .add(here)
            self._casts.add(key)

    def _saved_again(self, key: int, t: torch.Tensor) -> None:
        """A block saves a storage an earlier block saved and still holds, that it did
        not take (NOTE [ Saves shared by calls through a cache ])."""
        first, here = self._packed[key][1], self._last if self._inside else None
        if first is None or here is None or here == first or key in self._resting \
                or key in self._ins.get(here, ()):
            return
        entry = self._shared.get(key)
        if entry is None:
            entry = self._shared[key] = (first, set(), t.untyped_storage().nbytes())
        if entry[0] == first or first in entry[1]:  # (or a later saver of a cast)
            entry[1].add(here)

    def _input_alive(self, i: int) -> bool:
        ref = self._refs.get(i)
        return ref is not None and ref() is not None

    def _check_last(self, following: int) -> None:
        last = self._last
        if last is not None:
            self._alive[last] = self._alive.get(last, False) or self._input_alive(last)
            self._next[last] = following

    @contextmanager
    def installed(self, model: nn.Module) -> Iterator[None]:
        def pre(i: int) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
                self._check_last(i)
                tensors = flat_tensors((args, kwargs))
                self._refs[i] = weakref.ref(tensors[0]) if tensors else None
                if tensors and tensors[0].layout is torch.strided:
                    key = tensors[0].untyped_storage()._cdata
                    self._in_first[key] = i
                    packed = self._packed.get(key)
                    if packed is not None and packed[0]() is not None:
                        self._input_saved.add(i)  # saved before (by the block before)
                self._ins[i] = {t.untyped_storage()._cdata for t in tensors
                                if not isinstance(t, nn.Parameter)
                                and t.layout is torch.strided}
                self._alive.pop(i, None)
                if i not in self._started:
                    self._started.append(i)
                self._last = i
                self._inside += 1
                self._events += 1
                self._see_deaths()
                self._take_sides(i, tensors)
            return hook

        def post(i: int) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                self._inside -= 1
                self._returned = i
                self._events += 1
                self._returns[i] = self._events
                # each output and the tensor it views, if it is a view: the model may
                # let go of the output and pass on a view of it (LookViT transposes the
                # attention scores its lookup layer returns for a later layer), which
                # holds that tensor, not the output
                outs = flat_tensors(output)
                self._outs[i] = [weakref.ref(t) for t in outs] + \
                    [weakref.ref(t._base) for t in outs if t._base is not None]
                self._see_deaths()
                if self._shared_params:
                    self._walk_casts(i, output)
            return hook

        def any_call(module: nn.Module, args: Any) -> None:
            # the first module called after a block returned: its input is held if its
            # caller still names it (NOTE [ Boundaries held outside the chain ])
            returned = self._returned
            if returned is not None and not self._inside:
                self._returned = None
                self._alive[returned] = self._input_alive(returned)

        self._resting = {t.untyped_storage()._cdata
                         for t in [*model.parameters(), *model.buffers()]}
        for i, name in enumerate(self.names):
            for param in model.get_submodule(name).parameters():
                self._holding.setdefault(id(param), []).append(i)
                if len(self._holding[id(param)]) == 2 and param.is_floating_point():
                    self._shared_params[id(param)] = param
        with ExitStack() as stack:
            for i, name in enumerate(self.names):
                module = model.get_submodule(name)
                stack.callback(module.register_forward_pre_hook(pre(i), with_kwargs=True).remove)
                stack.callback(module.register_forward_hook(post(i)).remove)
            stack.callback(nn.modules.module.register_module_forward_pre_hook(any_call).remove)
            # autograd keeps what it saves as a detached alias: the same storage, not the
            # input's Python object, whose life then shows the model's references alone
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, _same))
            yield

    def returned(self) -> None:
        """The model's forward has returned: check the block that ran last."""
        self._check_last(self._END)
        self._last = None
        self._events += 1
        self._see_deaths()
        self._nodes.clear()  # (ids of nodes the backward frees may be reused)
        self._cast_nodes.clear()

    def _walk_casts(self, i: int, output: Any) -> None:
        """Block ``i`` returned ``output``: walk the autograd nodes its forward made (the
        ones no earlier walk met), noting the casts of shared parameters they met first,
        and those an earlier block made that they take, under autocast (NOTE [ Casts a
        later call takes from the cache and does not save ])."""
        device = next(iter(self._shared_params.values())).device.type
        if device not in autocast_devices():  # (a meta step has no autocast)
            return
        itemsize = torch.get_autocast_dtype(device).itemsize
        stack = [t.grad_fn for t in flat_tensors(output) if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if id(node) in self._nodes:
                continue
            self._nodes.add(id(node))
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                if type(nxt).__name__ == "ToCopyBackward0" and nxt.next_functions:
                    leaf = getattr(nxt.next_functions[0][0], "variable", None)
                    param = self._shared_params.get(id(leaf))
                    if param is not None and i in self._holding[id(param)]:
                        made = self._cast_nodes.setdefault(id(nxt), (i, id(param)))
                        if made[0] != i and (id(nxt), i) not in self._saved_casts:
                            self._cached[(made[0], i, id(param))] = \
                                param.numel() * itemsize
                stack.append(nxt)

    def _ids(self, chain: list[str], *, returned: bool = False) -> list[int] | None:
        """The blocks of ``chain`` (some of the blocks installed over, in the order they
        ran) by their index here; ``None`` where one is not installed over, or, with
        ``returned``, did not return."""
        index = {name: i for i, name in enumerate(self.names)}
        ids = [index.get(name, -1) for name in chain]
        if -1 in ids or (returned and any(i not in self._returns for i in ids)):
            return None
        return ids

    def held_past_release(self, chain: list[str]) -> tuple[tuple[int, int, int], ...]:
        """The tensors blocks of ``chain`` (in the order they ran) take besides their input
        that a checkpoint of one of them may hold past where the plain step frees them,
        which the peak model does not see (NOTE [ Tensors blocks take that die later in
        the chain ]), as (the first chain block taking it, the chain block in whose
        forward window the plain step frees it, its storage's size); none where the step
        cannot tell."""
        ids = self._ids(chain, returned=True)
        if ids is None:
            return ()
        returns = [self._returns[i] for i in ids]
        position = {block: p for p, block in enumerate(ids)}
        sizes = []
        for side in self._sides:
            takers = [position[b] for b in side.takers if b in position]
            if side.saved or side.died is None or not takers:
                continue
            # the window it dies in: the last chain block that returned before it died
            window = max((p for p, r in enumerate(returns) if r < side.died), default=-1)
            if window < len(ids) - 1 and window - min(takers) >= 2:
                sizes.append((min(takers), window, side.nbytes))
        return tuple(sizes)

    def freed_at_return(self, chain: list[str]) -> tuple[tuple[int, tuple[int, ...], int], ...]:
        """The tensors a block of ``chain`` returned that later blocks take besides their
        input, that nothing saves and the model frees when its forward returns, which a
        checkpoint of a block taking them holds until that block's backward (NOTE
        [ Tensors blocks take that the model frees when it returns ]), as (the chain block
        after the one that returned it, whose release when the forward returns counts
        it; the chain blocks taking it; its storage's size); none where the step cannot
        tell."""
        ids = self._ids(chain, returned=True)
        if ids is None:
            return ()
        last = self._returns[ids[-1]]
        position = {block: p for p, block in enumerate(ids)}
        out = []
        for side in self._sides:
            takers = tuple(sorted(position[b] for b in side.takers if b in position))
            if side.saved or side.died is None or side.died <= last or not takers:
                continue
            made = -1 if side.made_by is None else position.get(side.made_by, -1)
            if 0 <= made < len(ids) - 1:
                out.append((made + 1, takers, side.nbytes))
            elif made < 0:  # the parent made it, between blocks (in the window before
                # them) or before the chain (NOTE [ Tensors made before the chain that
                # later blocks take ] in _plan/peak.py)
                out.append((takers[0], takers, side.nbytes))
        return tuple(out)

    def chain_sides(self, chain: list[str]) -> tuple[tuple[int, ...], ...]:
        """Per block of ``chain`` (in the order they ran), the sizes of the tensors it
        takes besides its input that the block before returned, that no other block takes
        and that the model let go of by the time the next block started or the forward
        returned (NOTE [ Boundaries held outside the chain ]): inner boundaries of a
        segment, which it drops as it drops the input; none where the step cannot tell."""
        ids = self._ids(chain, returned=True)
        if ids is None:
            return ()
        position = {block: p for p, block in enumerate(ids)}
        out: list[tuple[int, ...]] = [()] * len(ids)
        for side in self._sides:
            takers = {position[b] for b in side.takers if b in position}
            made = None if side.made_by is None else position.get(side.made_by)
            if made is None or takers != {made + 1} or side.died is None \
                    or ids[made + 1] not in side.beside_first or side.passed_on:
                continue  # (counted as the first input; a segment's input, held)
            if side.died <= self._returns[ids[made + 1]] + 1:  # gone at the next event
                out[made + 1] += (side.nbytes,)
        return tuple(out)

    def saved_by_maker(self, chain: list[str]) -> tuple[tuple[int, tuple[int, ...], int], ...]:
        """The tensors a block of ``chain`` saves in its forward that blocks two or more
        after it take besides their input (NOTE [ Tensors a block saves that a later
        block takes ]), as (that block; the blocks taking it; its storage's size)."""
        ids = self._ids(chain)
        if ids is None:
            return ()
        position = {block: p for p, block in enumerate(ids)}
        out = []
        for side in self._sides:
            saver = -1 if side.saved_in is None else position.get(side.saved_in, -1)
            takers = tuple(sorted(position[b] for b in side.takers
                                  if b in position and position[b] >= saver + 2))
            if saver >= 0 and takers:
                out.append((saver, takers, side.nbytes))
        return tuple(out)

    def shared_saves(self, chain: list[str], casts: bool = False,
                     ) -> tuple[tuple[int, tuple[int, ...], int], ...]:
        """The storages a block of ``chain`` saves in its forward that later blocks save
        too without taking them (NOTE [ Saves shared by calls through a cache ]), as (the
        block that saved it first; the later blocks saving it; its storage's size);
        ``casts``: instead the casts a block made and did not save that later blocks save
        (NOTE [ Casts a block makes that a later block saves ]), the block that made it
        first."""
        ids = self._ids(chain)
        if ids is None:
            return ()
        position = {block: p for p, block in enumerate(ids)}
        out = []
        for key, (first, later, size) in self._shared.items():
            if (key in self._casts) != casts:
                continue
            p = position.get(first, -1)
            savers = tuple(sorted(position[b] for b in later
                                  if b in position and position[b] > p))
            if p >= 0 and savers:
                out.append((p, savers, size))
        return tuple(out)

    def cached_casts(self, chain: list[str]) -> tuple[tuple[int, tuple[int, ...], int], ...]:
        """The casts of a shared layer's parameters a block of ``chain`` made under
        autocast that later blocks took from autocast's cache and did not save (NOTE
        [ Casts a later call takes from the cache and does not save ]), as (the block that
        made it; the later blocks taking it; its bytes)."""
        ids = self._ids(chain)
        if ids is None or not self._cached:
            return ()
        position = {block: p for p, block in enumerate(ids)}
        later: dict[tuple[int, int], set[int]] = {}
        sizes: dict[tuple[int, int], int] = {}
        for (first, taker, param), size in self._cached.items():
            if first in position and taker in position and position[taker] > position[first]:
                later.setdefault((position[first], param), set()).add(position[taker])
                sizes[(position[first], param)] = size
        return tuple((first, tuple(sorted(takers)), sizes[(first, param)])
                     for (first, param), takers in sorted(later.items()))

    def saves_nothing(self, chain: list[str]) -> tuple[bool, ...]:
        """Per block of ``chain`` (in the order they ran), whether its forward saved
        nothing for backward, so that a checkpoint of it alone holds none of its inputs
        (NOTE [ A block that lets its input go ] in _plan/peak.py); none where the step
        cannot tell."""
        ids = self._ids(chain, returned=True)
        if ids is None:
            return ()
        return tuple(i not in self._saving for i in ids)

    def input_saved(self, chain: list[str]) -> tuple[bool, ...]:
        """Per block of ``chain`` (in the order they ran), whether autograd saved the
        storage of its first input in the forward (the block before saved its output, or
        the block, or a later one, saved its input); none where the step cannot tell."""
        ids = self._ids(chain, returned=True)
        if ids is None:
            return ()
        return tuple(i in self._input_saved for i in ids)

    def held(self, chain: list[str]) -> list[bool] | None:
        """Per block of ``chain`` (some of the blocks installed over, in the order they
        ran), whether its input was held; ``None`` where the step cannot tell: a block
        ran between two of the chain's, or after its last, or a block did not run."""
        ids = self._ids(chain)
        if ids is None:
            return None
        following = [*ids[1:], self._END]
        if any(self._next.get(i) != f for i, f in zip(ids, following, strict=True)):
            return None
        return [self._alive[i] for i in ids]


def _ref_value(ref: weakref.ref[torch.Tensor] | None) -> torch.Tensor | None:
    return None if ref is None else ref()


def _same_storage(t: torch.Tensor | None, storage: torch.UntypedStorage) -> bool:
    return t is not None and t.untyped_storage()._cdata == storage._cdata


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _fails_for_the_hooks(step: Step, names: list[str], exc: RuntimeError) -> bool:
    """Whether ``step``, which raised ``exc`` with saved-tensor hooks on, runs without
    them and fails with them again, alike (not a failure that comes and goes, such as
    running out of memory once). A failure of the retries is noted on ``exc``, which is
    the error raised then."""
    def note(text: str) -> None:
        add_note = getattr(exc, "add_note", None)  # Python 3.11+
        if add_note is not None:
            add_note(text)
        else:
            warnings.warn(text, RuntimeWarning, stacklevel=5)

    try:
        try:
            _run_marked(step, names, lambda _: None, in_order=False)
        except Exception as again:  # noted on the error raised, not dropped
            note(f"autoremat: without saved-tensor hooks the step failed too: {again!r}")
            return False
        try:
            with torch.autograd.graph.saved_tensors_hooks(_detached, _same):
                _run_marked(step, names, lambda _: None, in_order=False)
        except RuntimeError as again:
            if type(again) is type(exc) and str(again) == str(exc):
                return True
            note(f"autoremat: the step ran without saved-tensor hooks, and with them again "
                 f"failed otherwise: {again!r}")
            return False
        note("autoremat: the step ran when tried again, with saved-tensor hooks and without")
        return False
    finally:
        clear_grads(step.model, step.inputs)


def _held_boundaries(model: nn.Module, inputs: Any, names: list[str]) -> list[bool]:
    """Per block, whether its first input tensor outlives the block's call: held by the
    model outside the chain, seen in one forward without gradients (NOTE [ Boundaries
    held outside the chain ])."""
    seen = _HeldInputs(names)
    with seen.installed(model), torch.no_grad():
        output = call_model(model, inputs)
        seen.returned()
        del output
    held = seen.held(names)
    internal_assert(held is not None, f"the blocks {names} did not each run once, in order, "
                                      "in a forward without gradients")
    assert held is not None  # for mypy: internal_assert raised otherwise
    return held


def _check_backward_order(names: list[str], ends: list[int]) -> None:
    """Raise :class:`BlockError` where the backward reached a block's output after that
    of the block before it (``ends``: the event where it reached the chain's input, then
    each block's output).

    NOTE [ Blocks whose backwards do not run in reverse ]
        A block's backward window runs from where the backward reaches its output to
        where it reaches the block before's; the chain's blocks run one after another,
        so the backward reaches their outputs in reverse. Blocks side by side on
        branches (HRNet's transitions and fuse layers, found as its chain; a block
        returning an input another block took) can have theirs reached in another
        order, and the windows came out backwards: ``profile`` raised a bare
        "ValueError: max() arg is an empty sequence" (a held-out check of timm's HRNet,
        2026-12-02). Such blocks do not make a chain; the error names two of them."""
    for i in range(len(names)):
        if ends[i + 1] > ends[i]:
            before = (f"that of block {names[i - 1]!r}, which runs before it in the forward"
                      if i else "the chain's input")
            raise BlockError(
                f"the backward reached the output of block {names[i]!r} after {before}: "
                f"these blocks do not run one after another (branches side by side, or a "
                f"block that returns a tensor made before the block before it ran), so "
                f"the step cannot be told apart block by block. Give blocks=[...] (on the "
                f"command line, --blocks NAME,NAME,...) naming layers that each take the "
                f"previous one's output, such as the stages around the branches")


def first_marks(mem: MemoryTracker) -> dict[str, int]:
    found: dict[str, int] = {}
    for event, label in mem.marks:
        found.setdefault(label, event)
    return found


def _window(mem: MemoryTracker, start: int, stop: int) -> WindowMemory:
    base = mem.levels[start]
    return WindowMemory(peak_bytes=mem.window_peak(start, stop) - base,
                        delta_bytes=mem.levels[stop] - base)


@dataclass
class MemoryRun:
    mem: MemoryTracker
    probe: _Probe
    fwd: list[WindowMemory]
    bwd: list[WindowMemory]
    pre: WindowMemory
    post: WindowMemory
    post_fwd_peak: int  # post's peak before the backward starts (above post's start)
    # of that, the peaks before the model lets go of the first tensor it made before the
    # chain's end and from there on (NOTE [ Where the forward returns ] in _plan/peak.py);
    # None where it let go of none before the backward
    post_ret_peaks: tuple[int, int] | None
    tail: WindowMemory
    bounds: list[int]  # forward window starts, then fwd_end
    backward: int  # the event that started the step's backward (inside post)
    # backward marks: ends[i + 1] starts block i's backward, ends[i] ends it (ends[0]: the
    # first block's input gradient, else the step's end); NOTE [ Block boundaries in
    # backward ]
    ends: list[int] = field(default_factory=list)
    offloaded: dict[str, OffloadStats] = field(default_factory=dict)  # of the O blocks


@dataclass(frozen=True)
class Contexts:
    """The ``context_fn`` of each selective block: eager, and under compile."""

    eager: dict[str, ContextFn] = field(default_factory=dict)
    compiled: dict[str, Any] = field(default_factory=dict)


@contextmanager
def step_as_run(model: nn.Module, names: list[str], chosen: list[str],
                 contexts: Contexts | None, backend: str | None,
                 offloaded: Sequence[str] = (),
                 inputs_offloaded: Sequence[str] = ()) -> Iterator[dict[str, BlockOffload]]:
    """The ``chosen`` blocks checkpointed (selective ones with their contexts), the
    ``offloaded`` ones offloaded, the ``inputs_offloaded`` ones checkpointed with their
    input offloaded (yields the states of these two) and, with a ``backend``, every
    block compiled on its own (NOTE [ Profiling a compiled step ])."""
    contexts = contexts or Contexts()
    with checkpointed(model, chosen, contexts.eager, contexts.compiled), \
            offloading(model, names, list(offloaded), inputs_offloaded) as states, \
            ExitStack() as stack:
        if backend is not None:
            stack.enter_context(compiled_forwards(model, names, backend))
        yield states


@contextmanager
def compile_settings(backend: str | None) -> Iterator[None]:
    """Room for every option's compiled code: each block and option is traced apart, and
    past Dynamo's recompile limit it would silently run eagerly and be measured so."""
    if backend is None:
        yield
        return
    with torch._dynamo.config.patch(recompile_limit=4096, accumulated_recompile_limit=65536):
        yield


def memory_run(step: Step, names: list[str], decisions: Pattern,
                contexts: Contexts | None = None, *,
                rounding: Rounding | None, backend: str | None = None,
                counter: FlopCounter | None = None) -> MemoryRun:
    """One step measured, block ``i`` under ``decisions[i]``: kept, recomputed (with its
    context from ``contexts``, if any), offloaded, or recomputed with its input
    offloaded. With a ``counter`` (eager only), the same step also counts FLOPs by block
    (NOTE [ One pass for memory and FLOPs ])."""
    internal_assert(len(decisions) == len(names),
                    f"{len(decisions)} decisions for {len(names)} blocks")
    internal_assert(counter is None or backend is None, "FLOPs are counted in eager steps only")
    model = step.model
    clear_grads(model, step.inputs)

    def under(decision: Decision) -> list[str]:
        return [n for n, d in zip(names, decisions, strict=True) if d is decision]

    chosen, offloaded = under(Decision.RECOMPUTE), under(Decision.OFFLOAD)
    inputs_offloaded = under(Decision.OFFLOAD_INPUT)
    with step_as_run(model, names, chosen, contexts, backend, offloaded,
                      inputs_offloaded) as states:
        # compiled: from the allocator's reports, after a step that compiles (compiling
        # allocates too)
        measured = measure_step(
            step, memory="storages" if backend is None else "allocations", rounding=rounding,
            counter=counter, isolated=False, warm_up=backend is not None,
            on_mark=None if counter is None else lambda label: _label(counter, names, label),
            run=lambda step, mark: _run_marked(step, names, mark,
                                               on_output=_outputs_to(counter, names),
                                               on_args=_views_to(counter)))
    mem, probe = measured.memory, measured.ran
    internal_assert(mem is not None, "a memory run measures memory")
    assert mem is not None  # for mypy: internal_assert raised otherwise
    marks = first_marks(mem)
    n = len(names)
    missing = [f"bwd:{i}" for i in range(n) if f"bwd:{i}" not in marks]
    if missing:
        skipped = [names[int(m[4:])] for m in missing]
        raise BlockError(f"no gradient reached the output of block(s) {skipped}: "
                         f"{_why_no_backward(model, skipped, probe)}")
    bounds = [marks[f"fwd:{i}"] for i in range(n)] + [marks["fwd_end"]]
    fwd = [_window(mem, bounds[i], bounds[i + 1]) for i in range(n)]
    ends = [marks.get("bwd:-1", marks["end"])] + [marks[f"bwd:{i}"] for i in range(n)]
    _check_backward_order(names, ends)
    bwd = [_window(mem, ends[i + 1], ends[i]) for i in range(n)]
    return MemoryRun(
        mem=mem, probe=probe, fwd=fwd, bwd=bwd,
        pre=_window(mem, 0, bounds[0]),
        post=_window(mem, bounds[-1], ends[n]),
        post_fwd_peak=_window(mem, bounds[-1], marks["backward"]).peak_bytes,
        post_ret_peaks=_return_peaks(mem, bounds[-1], marks["backward"]),
        tail=_window(mem, ends[0], len(mem.levels) - 1),
        bounds=bounds, backward=marks["backward"], ends=ends,
        offloaded={name: state.group.stats for name, state in states.items()
                   if state.group is not None},
    )


def _return_peaks(mem: MemoryTracker, start: int, backward: int) -> tuple[int, int] | None:
    """The post window's peaks (above its ``start``, the chain's end) before the step
    lets go of the first storage made before ``start`` and from there to the backward's
    start (event ``backward``); ``None`` where it lets go of none before the backward."""
    freed = [r.died for r in mem.records if r.died is not None and not r.transient
             and r.born < start < r.died <= backward]
    if not freed:
        return None
    first, base = min(freed), mem.levels[start]
    return mem.window_peak(start, first - 1) - base, mem.window_peak(first, backward) - base


def saved_by_block(run: MemoryRun) -> list[dict[str, int]]:
    """Bytes created in each block's forward window that are alive when backward starts."""
    mem, bounds, backward_at = run.mem, run.bounds, run.backward
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


def _outputs_to(counter: FlopCounter | None, names: list[str],
                ) -> Callable[[int, list[torch.Tensor]], None] | None:
    """A step's ``on_output`` where ``counter`` records ops (``OpRecorder.outputs``,
    by block name), else ``None``."""
    if not isinstance(counter, OpRecorder):
        return None
    recorder = counter
    return lambda i, tensors: recorder.outputs(names[i], tensors)


def _views_to(counter: FlopCounter | None,
              ) -> Callable[[nn.Module, tuple[Any, ...]], None] | None:
    """A step's ``on_args`` where ``counter`` records ops: how many views of a block's
    arguments torch makes before its forward, which it skips (NOTE [ A block with a full
    backward hook ] in ops.py), else ``None``."""
    if not isinstance(counter, OpRecorder):
        return None
    recorder = counter

    def told(module: nn.Module, args: tuple[Any, ...]) -> None:
        recorder.hook_views = hook_views(module, args)
    return told


def _label(counter: FlopCounter, names: list[str], label: str) -> None:
    """File the ops after mark ``label`` under the block whose forward or backward it
    starts, and the rest under ``<outside>`` (NOTE [ Ops between blocks ])."""
    kind, _, index = label.partition(":")
    if kind in ("fwd", "bwd") and index != "-1":
        counter.label = names[int(index)]
    else:
        counter.label = "<outside>"


def recorded_step(step: Step, names: list[str]) -> OpRecorder:
    """One step under an :class:`OpRecorder`: FLOPs by block and the ops of each."""
    counter = OpRecorder()
    measure_step(step, counter=counter, isolated=False,
                 on_mark=lambda label: _label(counter, names, label),
                 run=lambda step, mark: _run_marked(step, names, mark,
                                                    on_output=_outputs_to(counter, names),
                                               on_args=_views_to(counter)))
    clear_grads(step.model, step.inputs)
    return counter


def recompute_flops_by_block(counter: FlopCounter, plain: FlopCounter,
                             names: list[str]) -> list[int]:
    """Per block, the FLOPs its recompute ran in the step ``counter`` counted (blocks
    checkpointed, or selective): backward FLOPs minus the plain step's. Measured, so
    checkpoint's early stop (no re-run after the last op backward needs) and skipped
    dead ops are included."""
    return [counter.by_label.get((n, "bwd"), 0) - plain.by_label.get((n, "bwd"), 0)
            for n in names]


def checkpointed_flops(step: Step, names: list[str], plain: FlopCounter,
                        contexts: dict[str, ContextFn] | None = None) -> list[int]:
    """:func:`recompute_flops_by_block` of a step of its own with every block checkpointed (those
    in ``contexts`` selective): for compiled profiles, whose memory steps count no FLOPs."""
    counter = FlopCounter()
    with checkpointed(step.model, names, contexts):
        measure_step(step, counter=counter, isolated=False,
                     on_mark=lambda label: _label(counter, names, label),
                     run=lambda step, mark: _run_marked(step, names, mark))
    clear_grads(step.model, step.inputs)
    return recompute_flops_by_block(counter, plain, names)


@dataclass(frozen=True)
class BlockTimes:
    """Medians of uninstrumented steps (0.0 where not measured)."""

    fwd_ms: list[float]  # per block
    bwd_ms: list[float]  # per block
    step_ms: float

    @staticmethod
    def unmeasured(n: int) -> BlockTimes:
        return BlockTimes([0.0] * n, [0.0] * n, 0.0)


class _Stamps:
    """Clock stamps at the block boundaries of one step, the first time each is reached;
    an ``on_mark`` for :func:`_run_marked`."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.at: dict[str, Any] = {}

    def __call__(self, label: str) -> None:
        if label not in self.at:
            self.at[label] = self.clock.stamp()

    def times(self, n: int) -> BlockTimes:
        """The times of the step stamped (call after ``clock.sync()``)."""
        at, elapsed = self.at, self.clock.elapsed_ms
        fwd, bwd = [], []
        for i in range(n):
            nxt = at[f"fwd:{i + 1}"] if i + 1 < n else at["fwd_end"]
            fwd.append(elapsed(at[f"fwd:{i}"], nxt))
            end = at.get(f"bwd:{i - 1}", at["end"]) if i else at.get("bwd:-1", at["end"])
            bwd.append(elapsed(at[f"bwd:{i}"], end))
        return BlockTimes(fwd, bwd, elapsed(at["start"], at["end"]))


_AGREE = 0.10  # two step times this close (relative) end the timing (NOTE [ Timing repeats ])


def timings(step: Step, names: list[str], repeats: int, *,
             first: BlockTimes | None = None) -> BlockTimes:
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
    #     once two in a row agree within 10%: their median is then within 5% of each,
    #     and a third step would move it by no more. On a noisy machine they do not
    #     agree. 5% was tried first: on this project's 2-core CI machine, consecutive
    #     80 ms steps of the zoo's llama differed by 3-7%, so most profiles timed a
    #     third step for a figure no plan reads. No plan reads times (they cost FLOPs
    #     and bytes), so this saves steps, not accuracy.
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
        clear_grads(step.model, step.inputs)
    return BlockTimes([statistics.median(s.fwd_ms[i] for s in samples) for i in range(n)],
                  [statistics.median(s.bwd_ms[i] for s in samples) for i in range(n)],
                  statistics.median(s.step_ms for s in samples))


Pattern = tuple[Decision, ...]  # one memory run: the decision of each block


def forward_window(run: MemoryRun, event: int) -> int | None:
    """The block in whose forward window ``event`` falls (``bounds[k] < event <=
    bounds[k + 1]``), or ``None`` outside the blocks' forwards."""
    after = bisect.bisect_left(run.bounds, event)
    return after - 1 if 0 < after < len(run.bounds) else None


def released_at_fwd_end(run: MemoryRun, n: int, before_chain: bool = True) -> list[int]:
    """Per block, bytes made in the forward window of the block before it that die in
    the post window (from the end of the last block's forward to its backward): what
    the model held outside the chain and released when its forward returned
    (NOTE [ Released when the forward returns ] in _plan/peak.py). Block 0 gets what
    was made before the first block's forward (``before_chain=False``: not that)."""
    out = [0] * n
    for block, _, record in _released(run, n, first_marks(run.mem)[f"bwd:{n - 1}"],
                                      before_chain):
        out[block] += record.nbytes
    return out


def inputs_released_at_fwd_end(run: MemoryRun, n: int) -> list[int]:
    """Of ``released_at_fwd_end``, per block, the bytes of its own first input's storage
    (the block before's output, which the model held past the block; 0 where it was
    not released then; -1 where the step has no record of it): NOTE [ What a segment's
    recompute lets go when it ends ] in _plan/peak.py."""
    records = {id(r): i for i, r in enumerate(run.probe.chain_records) if r is not None}
    seen = set(records.values())
    out = [0 if i in seen else -1 for i in range(n)]
    for block, _, record in _released(run, n, first_marks(run.mem)[f"bwd:{n - 1}"]):
        if records.get(id(record)) == block:
            out[block] += record.nbytes
    return out


def _released(run: MemoryRun, n: int, stop: int,
               before_chain: bool = True) -> Iterator[tuple[int, int, StorageRecord]]:
    """What ``released_at_fwd_end`` counts that dies by event ``stop``: (the block whose
    release counts it, the event it dies at, its record)."""
    start = run.bounds[-1]
    for record in run.mem.records:
        if record.backward or record.died is None or not start < record.died <= stop:
            continue
        made_in = forward_window(run, record.born)
        if made_in is not None and made_in < n - 1:
            yield made_in + 1, record.died, record
        elif before_chain and made_in is None and record.born <= run.bounds[0]:
            yield 0, record.died, record  # made before the first block (position ids)


def held_peak(mem: MemoryTracker, start: int, stop: int,
              frees: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The highest level over events ``start..stop`` with each of ``frees`` (``(event,
    bytes)``, events in that range) held from its event on, and the bytes held at
    ``stop``."""
    added = [0] * (stop - start + 1)  # bytes held on from each event on
    for event, size in frees:
        added[event - start] += size
    held = peak = 0
    for offset, level in enumerate(mem.levels[start : stop + 1]):
        held += added[offset]
        peak = max(peak, level + held)
    return peak, held


def post_fwd_held_peak(run: MemoryRun, n: int) -> int:
    """The post window's peak before the backward starts (above the window's start) with
    what ``released_at_fwd_end`` counts held from where it dies on: the most a plan that
    holds some of it raises those levels (NOTE [ Released when the forward returns ] in
    _plan/peak.py)."""
    start, stop = run.bounds[-1], run.backward
    frees = [(died, record.nbytes) for _, died, record in _released(run, n, stop)]
    peak, _ = held_peak(run.mem, start, stop, frees)
    return peak - run.mem.levels[start]


def post_fwd_held_peaks(run: MemoryRun, n: int) -> dict[int, int]:
    """``post_fwd_held_peak`` with one block's release held, by block (those that
    release something there): the most a plan that holds some of that block's release
    raises those levels (NOTE [ A release that holds one tensor and lets go of another ]
    in _plan/peak.py)."""
    start, stop = run.bounds[-1], run.backward
    frees: dict[int, list[tuple[int, int]]] = {}
    for block, died, record in _released(run, n, stop):
        frees.setdefault(block, []).append((died, record.nbytes))
    return {block: held_peak(run.mem, start, stop, held)[0] - run.mem.levels[start]
            for block, held in frees.items()}


def post_bwd_peak(run: MemoryRun, n: int) -> int:
    """The post window's peak from where the backward starts (above the window's start):
    where all a plan releases more or less when the forward returns has moved the level
    (NOTE [ Released when the forward returns ] in _plan/peak.py)."""
    return run.mem.window_peak(run.backward, run.ends[n]) - run.mem.levels[run.bounds[-1]]


def inputs_freed_later(run: MemoryRun, n: int, gap: int = 2, *,
                       taken_between: bool = True) -> dict[tuple[int, int], int]:
    """Bytes made in the forward window of the block before block ``i`` (before the
    first block, for ``i == 0``) that die in the forward window of a block
    ``w >= i + gap``, by ``(i, w)``: block ``i``'s input the model held outside the chain
    and let go of later in the chain (NOTE [ Inputs the model frees later in the chain ]
    in _plan/peak.py). ``taken_between=False``: not those a block between ``i`` and
    ``w`` takes too (NOTE [ An input later blocks take too ] in _profile/profile.py)."""
    out: dict[tuple[int, int], int] = {}
    for record in run.mem.records:
        if record.backward or record.died is None:
            continue
        freed_in = forward_window(run, record.died)
        if freed_in is None:
            continue
        made_in = forward_window(run, record.born)
        if made_in is not None:
            i = made_in + 1
        elif record.born <= run.bounds[0]:
            i = 0  # made before the first block
        else:
            continue
        if freed_in >= i + gap and (taken_between or not any(
                id(record) in run.probe.input_records[j] for j in range(i + 1, freed_in))):
            out[i, freed_in] = out.get((i, freed_in), 0) + record.nbytes
    return out


def _freed_in_forward(run: MemoryRun, n: int) -> list[list[tuple[int, int]]]:
    """Per block, ``(event, bytes)`` of the forward-made tensors born before its forward
    window that die in it."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for record in run.mem.records:
        if record.backward or record.died is None:
            continue
        freed_in = forward_window(run, record.died)
        if freed_in is not None and record.born <= run.bounds[freed_in]:
            out[freed_in].append((record.died, record.nbytes))
    return out


def freed_in_forward(run: MemoryRun, n: int) -> list[int]:
    """Per block, bytes of forward-made tensors born before its forward window that die
    in it (its input, when nothing keeps it for backward)."""
    return [sum(size for _, size in frees) for frees in _freed_in_forward(run, n)]


def held_forward_windows(run: MemoryRun, n: int) -> list[WindowMemory | None]:
    """Per block, its forward window with the tensors born before it that die in it held
    on to its end (NOTE [ A block that lets its input go ] in _plan/peak.py); ``None``
    where none die."""
    out: list[WindowMemory | None] = []
    for k, frees in enumerate(_freed_in_forward(run, n)):
        if not frees:
            out.append(None)
            continue
        start, stop = run.bounds[k], run.bounds[k + 1]
        peak, held = held_peak(run.mem, start, stop, frees)
        base = run.mem.levels[start]
        out.append(WindowMemory(peak_bytes=peak - base,
                                delta_bytes=run.mem.levels[stop] + held - base))
    return out


def _cast_node(t: torch.Tensor) -> Any:
    """The ``ToCopyBackward0`` node of the cast ``t`` is or views (a matmul saves the
    ``.t()`` of its weight's cast), or ``None``."""
    node = t.grad_fn
    for _ in range(3):
        if node is None or type(node).__name__ == "ToCopyBackward0" \
                or len(node.next_functions) != 1:
            break
        node = node.next_functions[0][0]
    if node is None or type(node).__name__ != "ToCopyBackward0" or not node.next_functions:
        return None
    return node


def held_input_lifts(run: MemoryRun, n: int) -> list[int]:
    """Per block, what its backward window's peak rises by where the storages the block
    before made in its forward and this block's backward frees (its input, saved by
    it) are held on to the window's end, as a selective block before it that keeps its
    output holds them (NOTE [ A selective block that keeps its output ] in
    _plan/peak.py); 0 for the first block, and where none die there."""
    mem, ends = run.mem, run.ends
    frees: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for record in mem.records:
        if record.backward or record.transient or record.died is None:
            continue
        k = forward_window(run, record.born)  # the window it was born in
        if k is None or k >= n - 1:
            continue
        start, stop = ends[k + 2], ends[k + 1]  # block k + 1's backward window
        if start <= record.died <= stop:
            frees[k + 1].append((record.died, record.nbytes))
    return _backward_lifts(run, frees)


def _backward_lifts(run: MemoryRun, frees: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
    """Per block, how far its backward window's peak rises where its ``frees``
    (``(event, bytes)``) are held on to the window's end; 0 where it has none."""
    out = []
    for k, died in enumerate(frees):
        if not died:
            out.append(0)
            continue
        start, stop = run.ends[k + 1], run.ends[k]
        lifted, _ = held_peak(run.mem, start, stop, died)
        out.append(max(0, lifted - run.mem.window_peak(start, stop)))
    return out


def made_before_freed(run: MemoryRun, n: int) -> list[list[tuple[int, int]]]:
    """Per block, ``(event, bytes)`` of the storages the model made before the chain (a
    mask, position ids) that its backward window frees."""
    mem, ends, first = run.mem, run.ends, run.bounds[0]
    frees: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for record in mem.records:
        if record.backward or record.transient or record.died is None \
                or record.born > first:
            continue
        for k in range(n):  # block k's backward window: events ends[k + 1] .. ends[k]
            if ends[k + 1] < record.died <= ends[k]:
                frees[k].append((record.died, record.nbytes))
                break
    return frees


def made_before_frees(run: MemoryRun, frees: Sequence[Sequence[tuple[int, int]]],
                      ) -> tuple[list[int], list[int]]:
    """Per block, the bytes of the storages the model made before the chain that its
    backward window frees (``frees``: ``made_before_freed`` of ``run``), and how far the
    window's peak rises where those are held on to its end: what a segment the block is
    inside holds to its own end (NOTE [ A segment holds what its blocks take ] in
    _plan/peak.py)."""
    return [sum(size for _, size in died) for died in frees], _backward_lifts(run, frees)


@dataclass(frozen=True)
class Setup:
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


@dataclass(frozen=True)
class Chain:
    """The blocks planned over, from a first step that measures nothing else."""

    names: list[str]  # in the order they run
    held_inputs: list[bool]  # NOTE [ Boundaries held outside the chain ]
    output_bytes: int  # the model's output, less the loss (tape.output_bytes)
    notes: list[str]  # what changed from the blocks found, and inputs held
    times: BlockTimes | None  # of that first step, when timed and the chain is what it stamped
    loss: str = ""  # the loss it took, in words (conditions.describe_loss)
    autocast: str = ""  # the autocast its blocks ran under (conditions.autocast_state)
    held_past_release: tuple[tuple[int, int, int], ...] = ()  # (first taker, window,
    # bytes): NOTE [ Tensors blocks take that die later in the chain ]
    freed_at_return: tuple[tuple[int, tuple[int, ...], int], ...] = ()  # (the block
    # after the one that returned it, takers, bytes): NOTE [ Tensors blocks take that
    # the model frees when it returns ]
    saved_by_maker: tuple[tuple[int, tuple[int, ...], int], ...] = ()  # (the block saving
    # it, takers, bytes): NOTE [ Tensors a block saves that a later block takes ]
    chain_sides: tuple[tuple[int, ...], ...] = ()  # per block, the storages it takes
    # besides its input that a segment drops with it (_HeldInputs.chain_sides)
    shared_saves: tuple[tuple[int, tuple[int, ...], int], ...] = ()  # (the block saving
    # it first, the later blocks saving it, bytes): NOTE [ Saves shared by calls through
    # a cache ]
    cast_saves: tuple[tuple[int, tuple[int, ...], int], ...] = ()  # (the block making
    # it, the later blocks saving it, bytes): NOTE [ Casts a block makes that a later
    # block saves ]
    saves_nothing: tuple[bool, ...] = ()  # per block, whether its forward saved nothing
    # (_HeldInputs.saves_nothing; empty: not seen)
    input_saved: tuple[bool, ...] = ()  # per block, whether autograd saved its first
    # input's storage (_HeldInputs.input_saved; empty: not seen)
    cached_casts: tuple[tuple[int, tuple[int, ...], int], ...] = ()  # (the block making
    # it, the later blocks taking it unsaved, bytes): NOTE [ Casts a later call takes
    # from the cache and does not save ]


def find_chain(setup: Setup, *, given: str | None, timed: bool) -> Chain:
    """One uninstrumented step (it also warms up: lazy state is not measured later) that
    finds the chain, the output's size and the inputs held outside the chain (NOTE
    [ Boundaries held outside the chain ]; where it cannot tell, one forward without
    gradients does), timed when ``timed``. ``given``: ``"list"``, the blocks were listed
    and must run in that order; ``"predicate"``, a predicate chose them, and they are
    planned in the order they run (a predicate gives none); ``None``, discovery found
    them (``_discovered_chain``)."""
    held: list[int] = []
    step = setup.step
    model, inputs = step.model, step.inputs
    # the loss taken, in words; what a loop likely takes instead; how a scalar the
    # output holds beside it is read (a loss the model returned?)
    losses: list[tuple[str, str, str | None]] = []

    held_inputs_seen = _HeldInputs(setup.names)  # NOTE [ Boundaries held outside ... ]
    eager = setup.backend is None

    def measure_output(output: Any) -> torch.Tensor:
        held_inputs_seen.returned()  # (nothing to check where it was not installed)
        check_no_cache(model, output)
        loss = (step.loss_fn or default_loss)(output)
        held.append(output_bytes(output, loss))
        losses.append((*describe_loss(output, step.loss_fn, inputs),
                       scalar_in_output(output)))
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
    try:
        with held_inputs_seen.installed(model) if eager else ExitStack():
            warm = _run_marked(dataclasses.replace(step, loss_fn=measure_output), names, mark,
                               in_order=given == "list", watch=True, missing_ok=given is None)
    except RuntimeError as exc:
        if eager and _fails_for_the_hooks(step, names, exc):
            raise RematError(
                f"{type(model).__name__}'s step fails under saved-tensor hooks ({exc}), and "
                "runs without them: the model turns them off in its forward "
                "(torch.autograd.graph.disable_saved_tensors_hooks), or rejects them. "
                "Checkpointing keeps what it saves through such hooks "
                "(torch.utils.checkpoint, non-reentrant), and autoremat measures through "
                "them: let the blocks run with them (leave the hooks on in the forward) to "
                "profile and plan this model") from exc
        raise
    clock.sync()
    # NOTE [ Nested tensors saved ]
    #     torch.utils.checkpoint records the shape of every tensor a checkpointed region
    #     saves, which a nested tensor of the strided layout (``torch.nested.
    #     nested_tensor``: vit-pytorch's NaViT) does not have ("NestedTensorImpl doesn't
    #     support sizes", raised from the first step that checkpoints it; a held-out
    #     check, 2026-12-02). Blocks that save one are named and refused before.
    if eager and held_inputs_seen.nested:
        nested = [setup.names[i] for i in sorted(held_inputs_seen.nested)]
        raise BlockError(
            f"block(s) {_span(nested)} save nested tensors (torch.nested, strided layout) "
            f"for backward, which torch.utils.checkpoint cannot hold (it records each saved "
            f"tensor's shape, which such a tensor does not have), so autoremat cannot "
            f"recompute them. Pass blocks=[...] naming layers that save none (the "
            f"checkpoint holds nested tensors of the jagged layout, "
            f"torch.nested.nested_tensor(..., layout=torch.jagged))")
    notes: list[str] = []
    if given is None:
        names, notes = _discovered_chain(model, warm, seen)
    else:
        if given == "predicate":
            order, notes = list(warm.order), _run_order_note(warm, "the predicate chose")
        else:
            order = list(range(len(names)))
        # as discovery does: such a layer left in the chain made the segment after it
        # measure the viewed tensor over its prediction (16 KiB in a test model)
        kept = _without_views(warm, order, "named" if given == "list" else "chosen", notes)
        if len(kept) < len(order):
            warnings.warn(f"autoremat: {notes[-1]}", UserWarning, stacklevel=3)
        names = [names[i] for i in kept]
    # its times are one sample of the timing (NOTE [ Timing repeats ]) if the chain is
    # the blocks it stamped, in the same order
    stamped = names == setup.names and all(f"bwd:{i}" in stamps.at for i in range(len(names)))
    times = stamps.times(len(names)) if timed and stamped else None
    clear_grads(model, inputs)
    held_inputs = held_inputs_seen.held(names) if eager else None
    if held_inputs is None:
        held_inputs = _held_boundaries(model, inputs, names)
    if any(held_inputs[1:]):
        inner = [name for name, h in zip(names[1:], held_inputs[1:], strict=True) if h]
        notes.append(
            f"the inputs of {len(inner)} block(s) ({inner[0]}, ...) stay referenced by "
            f"the model outside the chain (skip connections, kept hidden states): a "
            f"segment of several blocks does not free them, and plans count them held")
    loss, kind, scalar = losses[0]
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
        if scalar is not None:
            why += (f". Its output holds a scalar that needs a gradient, {scalar}: if "
                    f"that is the loss the model computed, profile with loss_fn=lambda out: "
                    f"{scalar}")
        notes.append(why)
        warnings.warn(f"autoremat: {why}", UserWarning, stacklevel=3)
    return Chain(names=names, held_inputs=held_inputs, output_bytes=held[0], notes=notes,
                  times=times, loss=loss, autocast=autocast[0] if autocast else "",
                  held_past_release=held_inputs_seen.held_past_release(names) if eager else (),
                  freed_at_return=held_inputs_seen.freed_at_return(names) if eager else (),
                  saved_by_maker=held_inputs_seen.saved_by_maker(names) if eager else (),
                  chain_sides=held_inputs_seen.chain_sides(names) if eager else (),
                  shared_saves=held_inputs_seen.shared_saves(names) if eager else (),
                  cast_saves=held_inputs_seen.shared_saves(names, casts=True)
                  if eager else (),
                  saves_nothing=held_inputs_seen.saves_nothing(names) if eager else (),
                  input_saved=held_inputs_seen.input_saved(names) if eager else (),
                  cached_casts=held_inputs_seen.cached_casts(names) if eager else ())
