"""Checkpoint a run of consecutive blocks as one segment (Chen et al.'s sqrt(n) scheme).

NOTE [ Segments without a wrapper module ]
    The blocks of a segment are called one by one by their parent's ``forward`` (a
    ``for`` loop over a ``ModuleList``), so there is no single function to hand to
    ``torch.utils.checkpoint``. Instead a forward pre-hook on the first block opens
    PyTorch's non-reentrant checkpoint frame (``_checkpoint_without_reentrant_generator``,
    the generator behind ``checkpoint``) and a forward hook on the last block closes it.
    In between every tensor saved for backward is replaced by a handle, exactly as in
    ``checkpoint``; inner block outputs are therefore not kept.

    For recompute, the frame replays the segment: the first block with the arguments it
    got, each next block with the arguments it got except the tensors the block before
    returned, which are the replayed outputs (the profile checks that blocks are
    "chained", taking the block before's output as their first tensor, before the
    planner groups them). Every such tensor, not only the first, is left out of what
    the segment records: Flux's single-stream blocks take (image, text) tokens, views
    of one storage the block before returned, and the recorded text tokens held that
    storage through the forward, where the peak model drops it (18 KiB over each
    segment's prediction under a LoRA). RNG states are replayed as for
    one block (NOTE [ Replaying the forward's RNG ]): checkpoint itself would stash no
    device state here, since the frame gets no function arguments to find devices in.
    Anything the parent computes between two grouped blocks that autograd must save
    would break the replay, and PyTorch's check of the number and shapes of recomputed
    tensors raises an error rather than returning wrong grads.

NOTE [ Hooks on a segment's blocks ]
    The replay calls each block's ``forward``, not the module, so a block's own forward
    hooks do not run in it (they would run twice: a hook that keeps activations for a
    probing loss would keep the recompute's too). A hook that replaces a block's output
    (``out * 0.9``), or changes it in place, hands the next block a tensor the replay
    does not make: registered after profile, the recompute fed the next block the
    unhooked output and gradients came out wrong with nothing said (6.7e-4 on a held-out
    MLP, 2026-11-30). So the runner's forward hook runs first among the block's, seeing
    the output as ``forward`` returned it, and a next block that does not take that
    tensor, at the version it had, is refused; the profile's probe sees blocks alike
    (first among the forward hooks) and marks them unchained, so a hook registered before
    profiling is planned around. The arguments are recorded by the runner's pre-hook,
    after the pre-hooks registered before ``apply``; one registered after it that changes
    the tensors the forward gets is refused when the block returns (the forward hook
    compares them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as _cp
from torch.utils._pytree import tree_map

from autoremat._core.errors import PlanMismatchError, RematError
from autoremat._core.step import flat_tensors
from autoremat._mechanism.compiled import is_compiling, refuse_under_compile
from autoremat._mechanism.engines import is_fsdp
from autoremat._mechanism.wrap import (
    RegionContexts,
    as_called,
    refuse_changed_input,
    refuse_kv_cache,
    refuse_under_func_transforms,
)

__all__ = ["SegmentRunner", "refuse_under_fsdp"]

@dataclass(frozen=True)
class _Slot:
    """Stands, in an inner block's recorded arguments, for the tensor the block before
    returned at position ``index`` of its flat output."""

    index: int


def _fill_slots(tree: Any, outputs: list[torch.Tensor]) -> Any:
    return tree_map(lambda x: outputs[x.index] if isinstance(x, _Slot) else x, tree)


@dataclass
class _Call:
    module: nn.Module
    args: Any
    kwargs: Any


def refuse_under_fsdp(names: list[str], modules: list[nn.Module]) -> None:
    """Raise a :class:`RematError` when a block of a multi-block segment is sharded by
    ``fully_shard`` (NOTE [ Plans under DDP and FSDP2 ] in ``engines.py``)."""
    sharded = [name for name, module in zip(names, modules, strict=True) if is_fsdp(module)]
    if sharded:
        raise RematError(
            f"this plan checkpoints {names[0]}..{names[-1]} as one segment of {len(names)} "
            f"blocks, and {sharded[0]!r} is sharded by FSDP2 (fully_shard): a segment's "
            "recompute would run blocks whose parameters FSDP has freed. Plan with "
            "autoremat.plan(tape, ..., shards=<world size>), which checkpoints blocks one "
            "by one, and broadcast that plan")


SEGMENT_ADVICE = (
    "A segment is recomputed as one run from its first block to its last, so its blocks "
    "must run once each, in order. Profile the step with the arguments the loop passes "
    "(autoremat.auto(model, inputs, ...) with the same keywords), or plan a step whose "
    "blocks it changes with strategy='full' or 'every:K', whose blocks stand alone")


@dataclass
class SegmentRunner:
    """Hooks that make ``modules`` (consecutive blocks) one checkpointed segment.

    The hooks are bound methods of the runner and the runner holds its modules, so a
    deep copy of the model copies the runner with it and the copy's hooks run the copy's
    blocks; pickling leaves out the state of a forward in progress (NOTE [ Copying and
    pickling an applied model ] in ``wrap.py``)."""

    modules: list[nn.Module]
    names: list[str]
    _handles: list[Any] = field(default_factory=list)
    _gen: Any = None
    _calls: list[_Call] = field(default_factory=list)
    _prev_out: list[Any] = field(default_factory=list)
    _prev_versions: list[int] = field(default_factory=list)
    _given: list[int] = field(default_factory=list)  # ids of the tensors the block got
    _replaying: bool = False
    _inputs: list[torch.Tensor] = field(default_factory=list)  # the first block's, and
    _versions: list[int] = field(default_factory=list)  # their versions when it started

    def __post_init__(self) -> None:
        # one for the runner's life: it warns once (NOTE [ What a recompute cannot see ])
        self._contexts = RegionContexts(self.modules, label=self._label)
        self._contexts.layout()  # what a copy made before its first forward must carry

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_gen=None, _calls=[], _prev_out=[], _prev_versions=[], _given=[],
                     _replaying=False, _inputs=[], _versions=[])  # one step's
        return state

    def install(self) -> None:
        for i, module in enumerate(self.modules):
            self._handles.append(module.register_forward_pre_hook(
                functools.partial(self._pre_hook, i), with_kwargs=True))
            # first among the forward hooks: it sees the output as the block's forward
            # returns it, which is what the replay makes (NOTE [ Hooks on a segment's
            # blocks ])
            self._handles.append(module.register_forward_hook(
                functools.partial(self._post_hook, i), prepend=True, with_kwargs=True,
                always_call=True))

    def uninstall(self) -> None:
        self.abort()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def waiting_for(self) -> str | None:
        """The block an open frame waits for (``None``: no frame open): set between the
        segment's first block and its last in a forward with gradients."""
        return None if self._gen is None else self.names[len(self._calls)]

    def abort(self) -> None:
        """Close an open frame (the forward raised, or ended, between the first and last
        block)."""
        gen, self._gen = self._gen, None
        self._calls, self._prev_out, self._inputs, self._versions = [], [], [], []
        self._prev_versions, self._given = [], []
        if gen is not None:
            gen.close()

    def _pre_hook(self, i: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        if is_compiling():
            refuse_under_compile(f"the segment {self.names[0]}..{self.names[-1]}")
        if i == 0:
            refuse_under_fsdp(self.names, self.modules)
        if self._replaying or not torch.is_grad_enabled():
            return
        if i == 0:
            if self._gen is not None:
                self.abort()
                raise PlanMismatchError(
                    f"segment {self.names[0]}..{self.names[-1]} started again before its "
                    f"last block, {self.names[-1]!r}, ran: this forward runs the blocks in "
                    f"another order, or skips some, than the step the plan was profiled "
                    f"on (an argument that changes which blocks run?). {SEGMENT_ADVICE}")
            refuse_under_func_transforms(self._label)
            refuse_kv_cache(self._label, args, kwargs)
            calls = [_Call(module, *as_called(args, kwargs))]  # NOTE [ Arguments as
            # they were called ] in wrap.py (the next blocks' are recorded by tree_map)
            self._calls = calls  # this step's calls; the frame replays exactly these
            self._inputs = flat_tensors((args, kwargs))
            self._versions = [t._version for t in self._inputs]
            self._given = [id(t) for t in self._inputs]
            # The input tensors go to the frame only so that it infers the device
            # type (autocast is replayed for it); the replay ignores them. RNG is
            # ours: NOTE [ Replaying the forward's RNG ] (rng.py).
            self._gen = _cp._checkpoint_without_reentrant_generator(
                functools.partial(self._replay, calls), False, self._contexts, "default",
                False, True, *self._inputs,
            )
            next(self._gen)
            return
        if self._gen is None or len(self._calls) != i:
            self.abort()
            raise PlanMismatchError(
                f"block {self.names[i]!r} ran outside its segment's order "
                f"({self.names[0]}..{self.names[-1]}); the plan assumed the blocks run "
                f"once each, in order: re-plan with autoremat.plan")
        try:
            refuse_kv_cache(repr(self.names[i]), args, kwargs)
        except RematError:
            self.abort()
            raise
        self._calls.append(self._record(module, args, kwargs, i))

    def _record(self, module: nn.Module, args: Any, kwargs: Any, i: int) -> _Call:
        flat = flat_tensors((args, kwargs))
        self._given = [id(t) for t in flat]
        ids = [id(t) for t in self._prev_out]
        if not flat or id(flat[0]) not in ids \
                or flat[0]._version != self._prev_versions[ids.index(id(flat[0]))]:
            self.abort()
            raise PlanMismatchError(
                f"block {self.names[i]!r} does not take the previous block's output as its "
                f"first tensor argument (as the block's forward returned it: a forward "
                f"hook of {self.names[i - 1]!r} that replaces or changes its output, or a "
                f"pre-hook of {self.names[i]!r} that replaces its input, makes another "
                f"tensor), so it cannot share a checkpoint segment with "
                f"{self.names[i - 1]!r}. Register such hooks first, then profile and plan "
                f"(the profile marks such blocks unchained)")
        recorded = tree_map(lambda x: _Slot(ids.index(id(x))) if isinstance(x, torch.Tensor)
                            and id(x) in ids else x, (args, kwargs))
        return _Call(module, recorded[0], recorded[1])

    def _post_hook(self, i: int, module: nn.Module, args: Any, kwargs: Any,
                   output: Any) -> None:
        if self._replaying or self._gen is None:
            return
        # (a prefix: a forward may append to a list it was given)
        if [id(t) for t in flat_tensors((args, kwargs))][:len(self._given)] != self._given:
            self.abort()
            raise PlanMismatchError(
                f"the forward of {self.names[i]!r} got other tensors than the block was "
                f"called with (a forward pre-hook registered after apply() that replaces "
                f"them, or a full backward hook registered after profile, which wraps "
                f"them), which the segment {self.names[0]}..{self.names[-1]} would not "
                f"replay in its recompute (gradients would be wrong). Register the hooks "
                f"first, then profile and plan the step with them (autoremat.auto)")
        self._prev_out = flat_tensors(output)
        self._prev_versions = [t._version for t in self._prev_out]
        if i == len(self.modules) - 1:
            gen, self._gen = self._gen, None
            self._prev_out = []
            next(gen, None)
            inputs, versions = self._inputs, self._versions
            self._inputs, self._versions = [], []
            refuse_changed_input(self._label, inputs, versions)

    @property
    def _label(self) -> str:
        return f"{self.names[0]}..{self.names[-1]} (a segment)"

    def _replay(self, calls: list[_Call], *_: Any) -> None:
        self._replaying = True
        try:
            out: Any = None
            for k, call in enumerate(calls):
                args, kwargs = call.args, call.kwargs
                if k > 0:
                    args, kwargs = _fill_slots((args, kwargs), flat_tensors(out))
                out = call.module.forward(*args, **kwargs)
        finally:
            self._replaying = False
