"""The Tape: what one instrumented training step measured, block by block.

A Tape is plain, frozen data. It prints as a table, and round-trips through versioned
JSON without the model, so a plan can be made, diffed and reviewed anywhere.

Memory figures are bytes of live tensor storages above the level before the step
(see "What peak means" in docs/design.md). Per block, two runs are summarised: ``keep``
(the plain step) and ``ckpt`` (every block checkpointed on its own). For each, the
forward window of block ``i`` runs from its forward start to the next block's start,
and its backward window from the moment the gradient of its output is ready to the
moment the gradient of its input is ready. Every run follows one training loop,
``tape.loop`` (NOTE [ Which loop a step models ] in ``step.py``): with
``"holds_output"`` the model's output is alive through backward, in every window.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from autoremat._core.conditions import conditions_line
from autoremat._core.decisions import HEAD_BACKENDS, Choice, Decision, is_head_key
from autoremat._core.errors import RematError, SchemaError, did_you_mean
from autoremat._core.files import (
    SCHEMA_VERSION,
    _check_types,
    build_dataclass,
    check_loop_field,
    dump_json,
    int_tuples,
    load_json,
)
from autoremat._core.head import HEAD_KINDS
from autoremat._core.step import Loop
from autoremat._core.tables import render_table
from autoremat._core.units import format_bytes, format_flops
from autoremat._measure.ops import OpRecord, OpStats

__all__ = [
    "WINDOW_DECISIONS", "BlockProfile", "HeadOption", "HeadProfile", "SelectiveProfile", "Tape",
    "WindowKey", "WindowMemory", "ops_table", "tape_table",
]


# A block's memory windows are keyed by the previous block's decision and its own: who
# holds a boundary tensor depends on both its producer and its consumer.
WindowKey = tuple[Decision, Decision]


@dataclass(frozen=True)
class WindowMemory:
    """Memory over one window of the step, relative to the level at its start."""

    peak_bytes: int  # highest level in the window minus the level at its start
    delta_bytes: int  # level at the window's end minus the level at its start


@dataclass(frozen=True)
class SelectiveProfile:
    """A block under selective recompute with one save-set (see ``selective.py``),
    measured in a step where the blocks around it are checkpointed."""

    fwd: WindowMemory
    bwd: WindowMemory  # recompute of the unsaved ops included
    recompute_flops: int  # FLOPs re-run in backward (measured: early stop included)
    recompute_bytes: int  # bytes those ops create
    recompute_ops: int  # how many ops are re-run
    keep_ops: tuple[int, ...] = ()  # a keep-set: op positions whose outputs stay saved
    skip_ops: tuple[int, ...] = ()  # and the dead ops recompute skips (selective.py)
    # bytes it keeps that the checkpointed step frees after the block's forward and before
    # the backward starts (a returned tensor the model drops): kept, they stay until the
    # block's backward, above every window between (NOTE [ Kept outputs that outlive
    # the forward ] in _profile/derive.py)
    held_after: int = 0
    held_after_ops: tuple[int, ...] = ()  # the op positions that made them
    # of those, the storages the checkpointed step freed after the chain's forward (where
    # the model lets go of what it holds): the event in ``tape.post_ckpt_levels`` where it
    # freed each, and its bytes (NOTE [ Where the forward returns ] in _plan/peak.py)
    kept_frees_at: tuple[int, ...] = ()
    kept_frees_bytes: tuple[int, ...] = ()
    # storages it keeps that the checkpointed step freed after the backward started and
    # by the start of the block's own backward window (a between-blocks op's backward
    # that saved the block's output; a later block that took it): the op position that
    # made each, its bytes, how many later blocks' backward windows start after its
    # free (-1: freed before the chain's backward), and how far the peak of the window
    # that freed it rises with it held from there (NOTE [ Kept outputs freed in the
    # backward before the block's ] in _profile/derive.py)
    bwd_freed_ops: tuple[int, ...] = ()
    bwd_freed_bytes: tuple[int, ...] = ()
    bwd_freed_span: tuple[int, ...] = ()
    bwd_freed_lift: tuple[int, ...] = ()

    @property
    def held_at_return(self) -> int:
        """Of ``held_after``, the bytes the checkpointed step freed after the chain's
        forward: the levels before that count them already."""
        return sum(self.kept_frees_bytes)


@dataclass(frozen=True)
class BlockProfile:
    """One block of the chain. Times are medians of uninstrumented steps."""

    name: str  # qualified module name, e.g. "blocks.3"
    fwd_ms: float  # forward time of the block
    bwd_ms: float  # backward time (grad of output ready -> grad of input ready)
    fwd_flops: int  # forward FLOPs
    bwd_flops: int  # backward FLOPs
    saved_bytes: int  # bytes created in the block's forward still alive when backward starts
    saved_bytes_by_kind: dict[str, int]  # the same, by the kind of op that created them
    input_bytes: int  # unique storages of the tensors passed in
    output_bytes: int  # unique storages of the tensors returned
    param_bytes: int  # parameters owned by the block
    grad_bytes: int  # gradients of the block's trainable parameters
    # Memory windows keyed by (previous block's decision, this block's decision), among
    # Tape.window_decisions: (KEEP, KEEP) is the plain step, (RECOMPUTE, RECOMPUTE) every
    # block checkpointed, (KEEP, RECOMPUTE) and (RECOMPUTE, KEEP) come from steps that
    # alternate. The first block's previous decision is always KEEP (the stem).
    fwd: dict[WindowKey, WindowMemory]  # forward window
    bwd: dict[WindowKey, WindowMemory]  # backward window (recompute included)
    chained: bool  # its first tensor input is an output of the previous block, unchanged
    chain_bytes: int  # bytes of that input when chained (freed early inside a segment)
    # FLOPs a checkpointed recompute of this block runs (measured: recompute stops
    # after the last op whose output backward needs, so it can be below fwd_flops).
    recompute_flops: int = -1  # -1: not measured; use fwd_flops
    # Forward ops by kind (count, FLOPs, bytes created, ms), for costing recompute.
    op_stats: dict[str, OpStats] = field(default_factory=dict)
    # Its forward ops in order (kind, bytes, FLOPs, ms, random/view/in-place, kept).
    ops: tuple[OpRecord, ...] = ()
    # Selective recompute options keyed by save-set name, e.g. "matmul" or "bmm+matmul".
    selective: dict[str, SelectiveProfile] = field(default_factory=dict)
    # Offloaded (Decision.OFFLOAD, tapes with ``offload``): bytes and number of the saved tensors
    # it copies to host memory (NOTE [ Offloading saved tensors ] in offload.py).
    offload_bytes: int = 0
    offload_tensors: int = 0
    # Checkpointed with its input offloaded (Decision.OFFLOAD_INPUT): bytes of that
    # input's host copy.
    offload_input_bytes: int = 0
    # Fingerprint of its parameters' names, shapes and dtypes (blocks.param_signature);
    # "": not recorded (tapes made before it was)
    param_signature: str = ""
    # Bytes of its input (made by the block before) that the model held outside the
    # chain and released when the forward returned, keyed like ``fwd`` (keys with none
    # left out): NOTE [ Released when the forward returns ] in _plan/peak.py.
    fwd_end_release: dict[WindowKey, int] = field(default_factory=dict)
    # Bytes of tensors made before its forward that die in its forward in the plain
    # step (its input, when neither it nor the block before keeps it): a segment's
    # recompute keeps them (NOTE [ The peak model ] in _plan/peak.py). -1: not measured.
    fwd_frees: int = -1
    # Its forward window with the tensors made before it that die in it held on (keyed
    # like ``fwd``, keys where none die left out): what the first block of a segment of
    # several, whose input the segment holds, does (NOTE [ A block that lets its input
    # go ] in _plan/peak.py). Empty in tapes made before 2026-12-01.
    fwd_held: dict[WindowKey, WindowMemory] = field(default_factory=dict)
    # Its forward saves nothing for backward (a scale, a pool), so a checkpoint of it
    # alone holds none of its inputs, and a segment of several starting with it holds
    # them all (NOTE [ A block that lets its input go ] in _plan/peak.py). False in tapes
    # made before 2026-11-30.
    lets_input_go: bool = False
    # Where autograd saved none of its first input (the block before's output) in the
    # forward: its backward window's peak in the step with every block checkpointed
    # with that input gone from where its recompute ends (above the window's start),
    # as a segment of several ending at it lets its recompute's copy go there, where
    # its checkpoint alone holds the input on. -1: saved, or not measured (tapes made
    # before 2026-12-01). NOTE [ A segment's last input its recompute lets go ] in
    # _plan/peak.py.
    bwd_input_gone_peak: int = -1
    # Its backward window in the step with every block checkpointed, split where its
    # recompute ends: the peak until then and the peak from there on (above the
    # window's start; with the input gone from there where autograd saved none of it,
    # and what it frees of the tensors made before the chain held on). A segment ending
    # at it lets go, when the recompute ends, of what only the forward held of the
    # blocks before it (NOTE [ What a segment's recompute lets go when it ends ] in
    # _plan/peak.py). (-1, -1): not measured (tapes made before 2026-12-01, or the step
    # did not tag the block).
    bwd_recompute_split: tuple[int, int] = (-1, -1)
    # Whether autograd saved its first input's storage in the forward (the block before
    # saved its output, or a block saved it as its input): where neither did and it
    # saves nothing, a segment ending at it never recomputes that input (NOTE [ A
    # segment's last block that saves nothing ] in _plan/peak.py). True in tapes made
    # before 2026-12-01, and where the step could not tell.
    input_saved: bool = True
    # Of ``fwd_end_release`` with both blocks kept, the bytes of its first input (the
    # model held it past the block and let it go when the forward returned): the rest
    # is what the block before made that only the forward held (autocast's casts of
    # weights no op saved), which a segment's recompute lets go when it ends (NOTE
    # [ What a segment's recompute lets go when it ends ] in _plan/peak.py). -1: not
    # measured (tapes made before 2026-12-01).
    input_released: int = -1
    # Bytes a recompute of it copies aside and puts back (BatchNorm statistics,
    # NOTE [ BatchNorm under recompute ] in _mechanism/wrap.py): in a segment of several
    # blocks, all of them are copied when its recompute starts.
    stash_bytes: int = 0
    # The indices of its forward ops (``ops``) that made the storages of its output the
    # next block takes (NOTE [ A selective block that keeps its output ] in
    # _plan/peak.py); None: not recorded (tapes made before 2026-11-30)
    output_ops: tuple[int, ...] | None = None
    # Of those, the ones whose storages the next block, kept, does not save (it lets go
    # of them in its forward)
    output_unsaved: tuple[int, ...] = ()
    # Bytes its checkpointed backward holds when its recompute starts, above the
    # window's start: the backward ops that need no saved tensor run first (a bias's
    # gradient, the contiguous copy of a transposed gradient in a token mixer) and hold
    # their outputs through the recompute, in a segment through the recompute of the
    # blocks before it too (NOTE [ The peak model ] in _plan/peak.py). 0: not measured.
    recompute_after: int = 0
    # The peak of its recompute in the step with every block checkpointed (its first op
    # to its last: it stops at the last tensor the block saves), above the level where
    # that recompute starts: a segment's recompute stops there too where the blocks after
    # it in the segment save nothing (NOTE [ A segment's last block that saves nothing ]
    # in _plan/peak.py); 0 where its recompute made no tensor (NOTE [ A recompute of
    # views ] in _profile/profile.py). -1: not measured (tapes made before 2026-12-01, or
    # the step did not tag the block).
    recompute_peak: int = -1
    # As the second part of ``bwd_recompute_split`` (the peak from where its recompute
    # ends), with what the window frees of its input's storage held on too, where the
    # plain step holds that input past the block's backward window (the block before
    # saves it as its output: an in-place ReLU, a sigmoid), as a segment ending at it
    # does. -1: the plain step does not hold it, the step with every block checkpointed
    # does not free it in that window, or not measured (tapes made before 2026-12-01).
    # NOTE [ A segment's last block whose input the block before holds ] in
    # _plan/peak.py.
    bwd_recompute_then_held: int = -1
    # What its backward window's peak rises by where the block before holds the
    # storages of its input that the window frees (a selective block before it that
    # keeps its output: NOTE [ A selective block that keeps its output ] in
    # _plan/peak.py), keyed like ``bwd`` (keys with none left out). Empty in tapes made
    # before 2026-12-01.
    bwd_input_held: dict[WindowKey, int] = field(default_factory=dict)
    # The bytes of the tensors the model made before the chain (a mask, position ids)
    # that its backward window frees, and how far that window's peak rises where they
    # are held on to its end, keyed like ``bwd`` (keys with none left out): what a
    # segment of several blocks holds to its end (NOTE [ A segment holds what its blocks
    # take ] in _plan/peak.py). Empty in tapes made before 2026-12-01.
    bwd_made_before_freed: dict[WindowKey, int] = field(default_factory=dict)
    bwd_made_before_held: dict[WindowKey, int] = field(default_factory=dict)
    # The post window's peak before the backward starts (above its start) in the step
    # with every block under its key's second decision, with what this block released
    # when the forward returned (``fwd_end_release``) held from where it died on, keyed
    # by the block's key in that step (keys where it released nothing left out): the
    # most a plan holding some of this block's release raises those levels (NOTE [ A
    # release that holds one tensor and lets go of another ] in _plan/peak.py). Empty
    # in tapes made before 2026-12-01.
    post_held_peak: dict[WindowKey, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.recompute_flops < 0:
            object.__setattr__(self, "recompute_flops", self.fwd_flops)

    @property
    def keep_fwd(self) -> WindowMemory:
        return self.fwd[Decision.KEEP, Decision.KEEP]

    @property
    def keep_bwd(self) -> WindowMemory:
        return self.bwd[Decision.KEEP, Decision.KEEP]


@dataclass(frozen=True)
class HeadOption:
    """The step with its loss head computed over ``chunks`` chunks of tokens (NOTE [ A
    chunked head ] in ``_core/head.py``), measured with every block kept."""

    chunks: int  # chunks of tokens (1 for a kernel that chunks by itself)
    post: WindowMemory  # as ``Tape.post[Decision.KEEP]``, with this head
    tail: WindowMemory  # as ``Tape.tail[Decision.KEEP]``, with this head
    step_peak_bytes: int  # the step with every block kept and this head
    # what chunking costs the planner over the plain head, in FLOP-equivalents: measured
    # (NOTE [ What a head option costs ] in _profile/options.py), or costs.head_cost;
    # negative where the chunked head is the faster
    cost: int
    backend: str = ""  # whose kernel: "" autoremat's own (NOTE [ Head backends ])


@dataclass(frozen=True)
class HeadProfile:
    """The model's loss head and the options measured for it (NOTE [ Which heads can be
    chunked ] in ``_mechanism/head.py``)."""

    kind: str  # "hf": a Hugging Face causal LM's lm_head and loss; "ce": an output layer
    # whose cross_entropy the model's forward takes; "module": an LMHead
    name: str  # qualified name of that module
    vocab: int  # its output features
    weight_bytes: int  # its weight, which the chunked head's gradient accumulates into
    # by decision name ("chunked:4", "torch:4", "liger"); "keep" (the head as the model
    # computes it) is the tape's own post and tail
    options: dict[str, HeadOption] = field(default_factory=dict)


@dataclass(frozen=True)
class Tape:
    """One measured training step. ``print(tape)`` shows a table.

    The step is: ``pre`` (before the first block), the blocks, ``post`` (after the last
    block's forward until its backward starts: head and loss forward and backward),
    the blocks' backward, and ``tail`` (after the first block's backward).
    """

    model: str  # class name of the model
    inputs: str  # signature of the inputs: shapes and dtypes
    device: str
    blocks: tuple[BlockProfile, ...]
    step_peak_bytes: int  # measured peak of the plain step
    peak_breakdown: dict[str, int]  # activations / gradients / temporaries at that peak
    ckpt_step_peak_bytes: int  # measured peak with every block checkpointed
    param_bytes: int  # all parameters
    trainable_param_bytes: int  # parameters that get gradients
    buffer_bytes: int  # buffers (BatchNorm statistics, rotary tables, ...)
    grad_bytes: int  # gradient bytes alive after the step
    pre: WindowMemory  # before the first block's forward
    post: dict[Decision, WindowMemory]  # head and loss, by the last block's decision
    tail: dict[Decision, WindowMemory]  # after the first block's backward, by its decision
    step_fwd_flops: int
    step_bwd_flops: int
    step_ms: float  # median plain step (forward + backward)
    # The training loop every run followed (step.Loop). Tapes saved before this field
    # existed were measured with the output released before backward: "loss_only".
    loop: Loop = "loss_only"
    output_bytes: int = -1  # the output's storages other than the loss's; -1: not measured
    # The batch (unique storages of the inputs) and the number of trainable parameter
    # tensors, which max_memory= needs (NOTE [ From max_memory to a step budget ] in
    # _plan/budget.py); -1: saved before they were recorded.
    input_bytes: int = -1
    trainable_param_tensors: int = -1
    # The torch.compile backend the step was measured under ("": eager); see
    # NOTE [ Profiling a compiled step ] in _profile/runs.py.
    compiled: str = ""
    # Whether the blocks were also measured offloaded (window_decisions), and the
    # bytes per second of copies between device and host (0.0: the host is the device).
    offload: bool = False
    host_bandwidth: float = 0.0
    # The model's mode when profiled (model.training): an eval() tape says so in notes.
    training: bool = True
    # Its loss head and the head options measured (None: none found, or none measured;
    # notes say why).
    head: HeadProfile | None = None
    # What else the step ran under (NOTE [ The conditions a step is measured under ] in
    # _core/conditions.py): the autocast regions ("cpu:bfloat16"; "": none), the floating
    # dtypes of the parameters ("float32"), the loss it took, and how many modules each
    # parent of a block holds ("blocks=4"), the users' forward hooks on its blocks
    # ("blocks.0=train.tap;..."). dtypes "": saved before these were recorded.
    autocast: str = ""
    dtypes: str = ""
    loss: str = ""
    structure: str = ""
    hooks: str = ""
    cached: bool = False  # under parametrize.cached(), on a parametrized model
    # The post window's peak before the backward starts (above the window's start), by
    # the last block's decision: what a plan releases when the forward returns lowers
    # only what comes after (NOTE [ Released when the forward returns ] in
    # _plan/peak.py). Empty: a tape saved before it was recorded (the whole window's
    # peak is taken).
    post_fwd_peak: dict[Decision, int] = field(default_factory=dict)
    # That peak with what the blocks released when the forward returned held from where
    # it died on: the most a plan holding some of it raises it (autocast's weight casts
    # die when its cache is emptied after the loss, past that peak). Empty: a tape saved
    # before it was recorded (2026-12-01; held bytes raise it by all of them).
    post_fwd_held_peak: dict[Decision, int] = field(default_factory=dict)
    # The post window's peak from where the backward starts (above the window's start):
    # the levels a plan's releases move by all of them. Empty: a tape saved before it
    # was recorded (2026-12-01; the whole window's peak is moved).
    post_bwd_peak: dict[Decision, int] = field(default_factory=dict)
    # The post window's peak before the backward starts, split where the step first lets
    # go of a tensor made before the chain's end: the peak before (what a plan holds of
    # the model's release does not raise it) and from there on (above the window's
    # start; NOTE [ Where the forward returns ] in _plan/peak.py). Empty: a step that
    # lets go of none before the backward, a tape saved before 2026-12-02;
    # ``post_fwd_peak`` is taken for both.
    post_ret_peak: dict[Decision, int] = field(default_factory=dict)
    post_returned_peak: dict[Decision, int] = field(default_factory=dict)
    # The checkpointed step's levels from the chain's end to the backward's start (above
    # the first), where a selective option keeps something that step freed there (its
    # ``kept_frees``); empty otherwise (NOTE [ Where the forward returns ] in
    # _plan/peak.py).
    post_ckpt_levels: tuple[int, ...] = ()
    # Of the first block's fwd_end_release under each decision (as every block was in
    # the step that measured it), the bytes made before the chain that are released only
    # where every block is under that decision: shared inputs another block may hold
    # (NOTE [ What the model made before the chain ] in _plan/peak.py). Empty: none, or a
    # tape saved before it was recorded.
    first_release_shared: dict[Decision, int] = field(default_factory=dict)
    # Bytes of tensors blocks take besides their input (an attention mask, sequence
    # lengths) that the plain step frees in the window of a block two or more after the
    # first block taking them, which a checkpoint of that block holds until its backward,
    # by "first:window" ("0:4": taken first by block 0, freed in block 4's forward
    # window); plans count them held (NOTE [ Tensors blocks take that die later in the
    # chain ] in _profile/runs.py). Empty: none, or a tape saved before it was recorded.
    held_past_release: dict[str, int] = field(default_factory=dict)
    # Bytes of block i's input that the model holds outside the chain (a U-Net's list of
    # skips) and the plain step frees in the forward window of a block w >= i + 1, where
    # a checkpoint of block i holds them until its backward, by "i:w" ("1:3"): NOTE
    # [ Inputs the model frees later in the chain ] in _plan/peak.py. Empty: none, or a
    # tape saved before it was recorded.
    freed_later: dict[str, int] = field(default_factory=dict)
    # Bytes of block i's input that block i - 1 saves kept (a ReLU's output), that the
    # model holds outside the chain and that a step with block i - 1 recomputed and block
    # i kept (block i saves none of them) frees in the forward window of a block
    # w >= i + 1, by "i:w"; held where block i - 1 is kept or a checkpoint of block i
    # holds them: NOTE [ Inputs the model frees later in the chain ] in _plan/peak.py.
    # Empty: none, or a tape saved before it was recorded (2026-11-30).
    maker_freed_later: dict[str, int] = field(default_factory=dict)
    # Bytes of tensors blocks take besides their input that the model frees when its
    # forward returns, which a checkpoint of a block taking them holds until its
    # backward, by "after:takers" ("9:15": block 8 returned it, so block 9's release
    # counts it, and block 15 takes it); plans that checkpoint a taker count them held
    # where their windows do not (NOTE [ Tensors blocks take that the model frees when
    # it returns ] in _profile/runs.py). Empty: none, or a tape saved before it was
    # recorded.
    freed_at_return: dict[str, int] = field(default_factory=dict)
    # Bytes of tensors a block saves in its forward that blocks two or more after it take
    # besides their input, by "saver:takers" ("2:6"); a plan that keeps the saver and
    # checkpoints a taker counts them held (NOTE [ Tensors a block saves that a later
    # block takes ] in _profile/runs.py). Empty: none, or a tape saved before it was
    # recorded.
    saved_by_maker: dict[str, int] = field(default_factory=dict)
    # Bytes of storages a block saves in its forward that later blocks save too without
    # taking them (the bf16 casts of a layer called several times under autocast, which
    # its later calls find in autocast's cache), by "first:savers" ("0:2": block 0 saved
    # it first, block 2 too); a plan that does not keep the first and keeps a later one
    # counts them held until the backward of the first kept (NOTE [ Saves shared by
    # calls through a cache ] in _profile/runs.py). Empty: none, or a tape saved before
    # it was recorded.
    shared_saves: dict[str, int] = field(default_factory=dict)
    # Bytes of casts a block made under autocast and did not save (its input needs no
    # gradient) that later blocks save, found in autocast's cache, by "first:savers";
    # the windows count them as if the first block saved them, and plans as
    # ``shared_saves`` (NOTE [ Casts a block makes that a later block saves ] in
    # _profile/runs.py). Empty: none, or a tape saved before it was recorded
    # (2026-11-30; such casts were in ``shared_saves``).
    cast_saves: dict[str, int] = field(default_factory=dict)
    # Bytes of casts of a shared layer's parameters a block made under autocast that
    # later blocks take from autocast's cache without saving them (a Linear's bias), by
    # "first:takers"; a segment's recompute of a later taker makes them again and holds
    # them to its end (NOTE [ Casts a later call takes from the cache and does not save ]
    # in _profile/runs.py). Empty: none, or a tape saved before it was recorded
    # (2026-12-01).
    cached_casts: dict[str, int] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def window_decisions(self) -> tuple[Decision, ...]:
        """The whole-block decisions the windows were measured for (what keys them):
        keep and recompute; with ``offload``, offload and offload_input too. (A selective
        block has windows of its own, ``BlockProfile.selective``.)"""
        return WINDOW_DECISIONS if self.offload else WINDOW_DECISIONS[:2]

    @property
    def resting_bytes(self) -> int:
        """Parameters and buffers: held before and after the step."""
        return self.param_bytes + self.buffer_bytes

    def joins_previous(self, i: int) -> bool:
        """Whether block ``i`` may share a checkpoint segment with block ``i - 1``: it is
        chained to it, and the step is not compiled (NOTE [ Plans under torch.compile ])."""
        return self.blocks[i].chained and not self.compiled

    @property
    def block_saved_bytes(self) -> int:
        """What the blocks keep for backward in the plain step."""
        return sum(b.saved_bytes for b in self.blocks)

    @property
    def step_flops(self) -> int:
        return self.step_fwd_flops + self.step_bwd_flops

    # -- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON fields, decisions by name (NOTE [ Decisions in files ])."""
        data = asdict(self)
        for block in data["blocks"]:
            for key in ("fwd", "bwd", "fwd_end_release", "fwd_held", "bwd_input_held",
                        "bwd_made_before_freed", "bwd_made_before_held", "post_held_peak"):
                block[key] = {_pair_name(k): v for k, v in block[key].items()}
        for key in ("post", "tail", "post_fwd_peak", "post_fwd_held_peak", "post_bwd_peak",
                    "post_ret_peak", "post_returned_peak", "first_release_shared"):
            data[key] = {d.value: v for d, v in data[key].items()}
        return data

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """Return the JSON text; with ``path``, also write it there atomically."""
        return dump_json(self.to_dict(), path)

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike[str]) -> Tape:
        """Load a tape from JSON text or a file; says which field is wrong if any."""
        data = load_json(text_or_path, what="tape")
        return _tape_from_dict(data)

    def __str__(self) -> str:
        return tape_table(self)


# NOTE [ Decisions in files ]
#     In memory a decision is a Decision (``_core/decisions.py``); names and letters
#     exist only here, where JSON is read and written. Version 2 writes a decision by
#     its name: a block's window key as "keep>recompute" (the previous block's decision,
#     then its own), ``post`` and ``tail`` keys as "keep", a plan's block as
#     ``"decision": "offload_input"``. Version 1 wrote letters: K kept, C checkpointed
#     (recompute), O offloaded, P checkpointed with its input offloaded ("KC"), and a
#     plan's input-offloaded block as "recompute" with ``offload_input: true``; it is
#     still read, and written again as version 2.

WINDOW_DECISIONS = (Decision.KEEP, Decision.RECOMPUTE, Decision.OFFLOAD, Decision.OFFLOAD_INPUT)


def _pair_name(key: WindowKey) -> str:
    return f"{key[0].value}>{key[1].value}"


def _window_decision(name: str, version: int, where: str) -> Decision:
    """The decision a version-``version`` file writes as ``name`` (a letter in version 1)."""
    letters = dict(zip("KCOP", WINDOW_DECISIONS, strict=True))  # version 1
    if version == 1 and name in letters:
        return letters[name]
    if version >= 2 and name in [d.value for d in WINDOW_DECISIONS]:
        return Decision(name)
    have = list(letters) if version == 1 else [d.value for d in WINDOW_DECISIONS]
    raise SchemaError(f"{where}: {name!r} names no decision a window is measured for "
                      f"(schema version {version} writes {have})")


def _window_key(name: str, version: int, where: str) -> WindowKey:
    """A block's window key as a version-``version`` file writes it: "keep>recompute"
    (version 2) or "KC" (version 1)."""
    parts = name.split(">") if version >= 2 else list(name)
    if len(parts) != 2:
        form = "'keep>recompute'" if version >= 2 else "'KC'"
        raise SchemaError(f"{where}: window key {name!r} is not the previous block's decision "
                          f"and this block's, as {form}")
    return (_window_decision(parts[0], version, f"{where}.{name}"),
            _window_decision(parts[1], version, f"{where}.{name}"))


def _window(data: Any, where: str) -> WindowMemory:
    window = build_dataclass(WindowMemory, data, where)
    _check_types(window, where)
    return window  # type: ignore[no-any-return]


def _op_record(data: Any, where: str) -> OpRecord:
    record = build_dataclass(OpRecord, int_tuples(data, ("inputs",), where), where)
    _check_types(record, where)
    return record  # type: ignore[no-any-return]


def _mapping(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise SchemaError(f"{where} must be an object")
    return data


def _windows(data: Any, where: str, version: int) -> dict[WindowKey, WindowMemory]:
    """A block's windows, keyed by decision pairs."""
    if not isinstance(data, dict) or not data:
        raise SchemaError(f"{where} must be a non-empty object of windows")
    return {_window_key(str(k), version, where): _window(v, f"{where}.{k}")
            for k, v in data.items()}


def _by_decision(data: Any, where: str, version: int) -> dict[Decision, WindowMemory]:
    """``post`` or ``tail``: windows keyed by one decision."""
    if not isinstance(data, dict) or not data:
        raise SchemaError(f"{where} must be a non-empty object of windows")
    return {_window_decision(str(k), version, where): _window(v, f"{where}.{k}")
            for k, v in data.items()}


def _peaks_by_decision(data: Any, where: str, version: int,
                       signed: bool = False) -> dict[Decision, int]:
    """``post_fwd_peak``, ``first_release_shared`` and the like: bytes keyed by one
    decision (empty in older files); ``signed``: below 0 too (``post_bwd_peak``,
    ``post_returned_peak``: above a start they may end below)."""
    out = {}
    for k, v in _mapping(data, where).items():
        if not isinstance(v, int) or isinstance(v, bool) or (v < 0 and not signed):
            kind = "integers" if signed else "integers >= 0"
            raise SchemaError(f"{where} must be an object of {kind}, got {data!r}")
        out[_window_decision(str(k), version, where)] = v
    return out


def _releases(data: Any, where: str, version: int) -> dict[WindowKey, int]:
    """``fwd_end_release``, ``bwd_input_held``, ``bwd_made_before_*``: bytes keyed like a
    block's windows."""
    out = {}
    for k, v in _mapping(data, where).items():
        if not isinstance(v, int) or isinstance(v, bool):
            raise SchemaError(f"{where} must be an object of integers, got {data!r}")
        out[_window_key(str(k), version, where)] = v
    return out


def _tape_from_dict(data: dict[str, Any]) -> Tape:
    version = data["schema_version"]  # load_json checked it
    raw_blocks = data.get("blocks")
    if not isinstance(raw_blocks, list):
        raise SchemaError("tape.blocks must be a list")
    blocks = []
    for i, raw in enumerate(raw_blocks):
        where = f"tape.blocks[{i}]"
        if not isinstance(raw, dict):
            raise SchemaError(f"{where} must be an object")
        raw = dict(raw)
        for key in ("fwd", "bwd"):
            raw[key] = _windows(raw.get(key), f"{where}.{key}", version)
        if raw.get("fwd_held"):  # absent or empty: none die, or an older tape
            raw["fwd_held"] = _windows(raw["fwd_held"], f"{where}.fwd_held", version)
        for key in ("fwd_end_release", "bwd_input_held", "bwd_made_before_freed",
                    "bwd_made_before_held", "post_held_peak"):
            if key in raw:
                raw[key] = _releases(raw[key], f"{where}.{key}", version)
        raw["op_stats"] = {
            str(k): build_dataclass(OpStats, v, f"{where}.op_stats.{k}")
            for k, v in _mapping(raw.get("op_stats", {}), f"{where}.op_stats").items()
        }
        raw_ops = raw.get("ops", [])
        if not isinstance(raw_ops, list):
            raise SchemaError(f"{where}.ops must be a list")
        raw["ops"] = tuple(_op_record(v, f"{where}.ops[{j}]") for j, v in enumerate(raw_ops))
        selective = {}
        for k, v in _mapping(raw.get("selective", {}), f"{where}.selective").items():
            v = dict(_mapping(v, f"{where}.selective.{k}"))
            for key in ("fwd", "bwd"):
                v[key] = _window(v.get(key), f"{where}.selective.{k}.{key}")
            where_k = f"{where}.selective.{k}"
            selective[str(k)] = build_dataclass(
                SelectiveProfile, int_tuples(v, ("keep_ops", "skip_ops", "held_after_ops",
                                                 "kept_frees_at", "kept_frees_bytes",
                                                 "bwd_freed_ops", "bwd_freed_bytes",
                                                 "bwd_freed_span", "bwd_freed_lift"),
                                             where_k), where_k)
        raw["selective"] = selective
        raw = int_tuples(raw, ("output_unsaved", "bwd_recompute_split"), where)
        if len(raw.get("bwd_recompute_split", (-1, -1))) != 2:
            raise SchemaError(f"{where}.bwd_recompute_split must be two integers, got "
                              f"{list(raw['bwd_recompute_split'])!r}")
        if raw.get("output_ops") is not None:
            raw = int_tuples(raw, ("output_ops",), where)
        block = build_dataclass(BlockProfile, raw, where)
        _check_types(block, where)
        blocks.append(block)
    data = dict(data)
    data["blocks"] = tuple(blocks)
    notes = data.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise SchemaError(f"tape.notes must be a list of strings, got {notes!r}")
    data["notes"] = tuple(notes)
    data["schema_version"] = SCHEMA_VERSION  # read; it is written as this version
    data["pre"] = _window(data.get("pre"), "tape.pre")
    data = int_tuples(data, ("post_ckpt_levels",), "tape")
    for key in ("post", "tail"):
        data[key] = _by_decision(data.get(key), f"tape.{key}", version)
    for key in ("post_fwd_peak", "post_fwd_held_peak", "post_bwd_peak", "post_ret_peak",
                "post_returned_peak", "first_release_shared"):
        data[key] = _peaks_by_decision(data.get(key, {}), f"tape.{key}", version,
                                       signed=key in ("post_bwd_peak", "post_returned_peak"))
    if data.get("head") is not None:
        data["head"] = _head(data["head"])
    tape = build_dataclass(Tape, data, "tape")
    _check_types(tape, "tape")
    check_loop_field(tape.loop, "tape.loop")
    for decision in tape.window_decisions:  # every window the peak model reads
        for key in ("post", "tail"):
            if decision not in getattr(tape, key):
                raise SchemaError(f"tape.{key} has no window for decision "
                                  f"{decision.value!r} (it has "
                                  f"{sorted(d.value for d in getattr(tape, key))}); "
                                  f"profile again")
        for i, b in enumerate(tape.blocks):
            # the first block follows the stem, as a kept block
            pair = (Decision.KEEP if i == 0 else decision, decision)
            if pair not in b.fwd or pair not in b.bwd:
                raise SchemaError(f"tape.blocks[{i}] has no {_pair_name(pair)!r} window "
                                  f"(fwd {sorted(map(_pair_name, b.fwd))}, bwd "
                                  f"{sorted(map(_pair_name, b.bwd))}); profile again")
    return tape  # type: ignore[no-any-return]


def _head(data: Any) -> HeadProfile:
    raw = dict(_mapping(data, "tape.head"))
    options = {}
    for k, v in _mapping(raw.get("options", {}), "tape.head.options").items():
        where = f"tape.head.options.{k}"
        v = dict(_mapping(v, where))
        for key in ("post", "tail"):
            v[key] = _window(v.get(key), f"{where}.{key}")
        option = build_dataclass(HeadOption, v, where)
        _check_types(option, where)
        if option.chunks < 1 or option.backend not in HEAD_BACKENDS or not is_head_key(k) \
                or Choice.head_from_key(k) != Choice(Decision.CHUNKED, chunks=option.chunks,
                                                     backend=option.backend):
            raise SchemaError(f"{where}: a head option is 'chunked:N' or 'torch:N' with "
                              f"chunks N >= 1, 'liger' or 'cce', got {k!r} with chunks "
                              f"{option.chunks!r} and backend {option.backend!r}")
        options[str(k)] = option
    raw["options"] = options
    head = build_dataclass(HeadProfile, raw, "tape.head")
    _check_types(head, "tape.head")
    if head.kind not in HEAD_KINDS:
        raise SchemaError(f"tape.head.kind must be 'hf', 'ce' or 'module', got {head.kind!r}")
    return head  # type: ignore[no-any-return]


def fmt(n: int) -> str:
    return format_bytes(n)


def tape_table(tape: Tape) -> str:
    rows = []
    for b in tape.blocks:
        kinds = sorted(b.saved_bytes_by_kind.items(), key=lambda kv: -kv[1])[:3]
        top = ", ".join(f"{k} {100 * v / max(b.saved_bytes, 1):.0f}%" for k, v in kinds if v)
        rows.append([
            b.name, f"{b.fwd_ms:.2f}", f"{b.bwd_ms:.2f}", format_flops(b.fwd_flops),
            format_bytes(b.saved_bytes), format_bytes(b.input_bytes),
            format_bytes(b.param_bytes), top,
        ])
    table = render_table(
        ["block", "fwd ms", "bwd ms", "fwd FLOPs", "saved", "input", "params", "saved by op kind"],
        rows,
    )
    bd = ", ".join(f"{k} {format_bytes(v)}" for k, v in tape.peak_breakdown.items())
    head = (f"Tape of {tape.model} on {tape.device}"
            + (f" compiled ({tape.compiled})" if tape.compiled else "")
            + f", inputs {tape.inputs}\n"
            f"step peak {format_bytes(tape.step_peak_bytes)} ({bd}); "
            f"all blocks checkpointed: {format_bytes(tape.ckpt_step_peak_bytes)}; "
            f"loop {tape.loop}{_held(tape)}\n"
            f"parameters {format_bytes(tape.param_bytes)}, buffers "
            f"{format_bytes(tape.buffer_bytes)}, gradients {format_bytes(tape.grad_bytes)}; "
            f"step {tape.step_ms:.1f} ms, {format_flops(tape.step_flops, 'FLOPs')}\n"
            + conditions_line(tape.loss, tape.autocast, tape.dtypes))
    notes = "".join(f"\nnote: {n}" for n in tape.notes)
    return head + _head_line(tape) + table + notes


def _head_line(tape: Tape) -> str:
    if tape.head is None or not tape.head.options:
        return ""
    options = "; ".join(f"{name}: {format_bytes(o.step_peak_bytes)}"
                        for name, o in tape.head.options.items())
    return (f"loss head {tape.head.name} (vocabulary {tape.head.vocab}): step peak with every "
            f"block kept {format_bytes(tape.step_peak_bytes)} as computed; {options}\n")


def _held(tape: Tape) -> str:
    if tape.output_bytes < 0:
        return ""
    what = "held through backward" if tape.loop == "holds_output" else "released before it"
    return f" (output {format_bytes(tape.output_bytes)}, {what})"


def ops_table(tape: Tape, block: str) -> str:
    """The forward ops of one block of ``tape``, in order, with what backward keeps."""
    names = [b.name for b in tape.blocks]
    if block not in names:
        raise RematError(f"no block {block!r} in the tape of {tape.model}."
                         + did_you_mean(block, names) + f" Blocks: {', '.join(names[:8])}"
                         + (", ..." if len(names) > 8 else ""))
    profile = tape.blocks[names.index(block)]
    if not profile.ops:
        raise RematError(f"the tape has no per-op trace for {block!r} (made by an older "
                         "autoremat); profile the model again")
    rows = []
    for i, r in enumerate(profile.ops):
        flags = ",".join(f for f, on in (("random", r.random), ("view", r.view),
                                         ("in-place", r.inplace),
                                         ("not saved", r.kept_bytes > 0 and not r.saved))
                         if on)
        reads = ",".join(map(str, r.inputs)) + (f" (writes {r.target})" if r.target >= 0 else "")
        rows.append([i, r.op.removeprefix("aten."), r.kind, format_bytes(r.out_bytes),
                     format_bytes(r.kept_bytes) if r.kept_bytes else "-", format_flops(r.flops),
                     f"{r.ms:.3f}", reads or "-", flags])
    kept = sum(r.kept_bytes for r in profile.ops)
    return (f"{block}: {len(profile.ops)} forward ops; backward keeps "
            f"{format_bytes(kept)} of them (\"kept\": alive when backward starts; \"reads\": "
            "the ops whose outputs it reads)\n"
            + render_table(["#", "op", "kind", "creates", "kept", "FLOPs", "ms", "reads",
                            "flags"], rows))
