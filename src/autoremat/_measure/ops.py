"""Op kinds, and a per-op recorder used by ``profile`` for selective-recompute costing."""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from autoremat._measure.flops import FlopCounter
from autoremat._measure.memory import _storage_keys, _tensors_in

__all__ = ["IGNORED_OPS", "OpRecord", "OpRecorder", "OpStats", "hook_views", "is_random_op",
           "op_kind", "result_leaves"]

# Ops that checkpoint itself may dispatch a different number of times in forward and in
# recompute (as SAC_IGNORED_OPS in torch/utils/checkpoint.py): never traced, counted or
# kept, so op positions agree between the tape and a checkpointed block.
IGNORED_OPS = frozenset({torch.ops.aten.detach.default, torch.ops.prim.device.default})

_KINDS = (
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention")),
    ("bmm", ("aten.bmm", "aten.baddbmm")),  # activation x activation: attention cores
    ("matmul", ("aten.mm", "aten.addmm", "aten.matmul", "aten.linear", "aten._int_mm")),
    ("conv", ("convolution", "conv")),
    ("norm", ("layer_norm", "batch_norm", "group_norm", "rms_norm", "_native_batch_norm")),
    ("dropout", ("dropout", "bernoulli")),
    ("softmax", ("softmax",)),
    ("embedding", ("embedding",)),
    ("loss", ("nll_loss", "cross_entropy")),
    ("copy", ("clone", "_to_copy", "copy", "cat", "stack", "contiguous")),
)
_RANDOM = ("dropout", "bernoulli", "rand", "normal", "multinomial", "uniform_", "exponential")
# Ops that read only their argument's shape, dtype and device, never its values: no
# dataflow from it (an uninitialised stand-in serves as well; NOTE [ Dead ops ]).
_METADATA_ONLY = frozenset({"empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
                            "randn_like", "randint_like", "new_empty", "new_empty_strided",
                            "new_zeros", "new_ones", "new_full"})


def op_kind(op: str) -> str:
    """Coarse kind of an ATen op name: attention (fused kernels), bmm, matmul, conv, norm,
    dropout, softmax, embedding, loss, copy or pointwise.

    Example:
        >>> op_kind("aten.addmm.default"), op_kind("aten.bmm.default")
        ('matmul', 'bmm')
    """
    for kind, needles in _KINDS:
        if any(n in op for n in needles):
            return kind
    return "pointwise"


def is_random_op(op: str) -> bool:
    """Whether the op draws random numbers (its recompute needs the RNG state restored)."""
    return any(r in op for r in _RANDOM)


@dataclass(frozen=True)
class OpStats:
    """Forward ops of one kind inside one block."""

    count: int  # ops dispatched (views included)
    flops: int  # their FLOPs
    out_bytes: int  # bytes of the storages they create (views create none; random ops
    # count the bytes they draw, in place or not)
    ms: float  # their time, measured op by op (inflated a little by the measuring)


@dataclass(frozen=True)
class OpRecord:
    """One forward op inside a block, in dispatch order."""

    op: str  # ATen overload, e.g. "aten.addmm.default"
    kind: str  # op_kind(op)
    out_bytes: int  # bytes of the storages it created (random ops: also bytes drawn in place)
    flops: int  # its FLOPs
    ms: float  # its time, measured op by op (inflated a little by the measuring)
    random: bool  # draws random numbers (recomputing it needs the RNG state, or a kept draw)
    view: bool  # returns a view of an input: it creates no storage and follows its base
    inplace: bool  # writes into one of its arguments
    kept_bytes: int  # of out_bytes, those still alive when backward started (saved for
    # backward, or still referenced as an output): what autograd keeps of this op
    # Dataflow, by storage (NOTE [ Keep-sets by MILP ] in _plan/keepsets.py):
    inputs: tuple[int, ...] = ()  # indices of the ops of this block that created the
    # storages it reads (storages from outside the block are not listed)
    target: int = -1  # in-place ops: index of the op that created the storage written
    saved: bool = True  # autograd saved a storage it created for backward (True when
    # unknown, e.g. tapes from before this field: the safe assumption)
    value_out: bool = False  # it returns a non-tensor value (Python reads it, e.g. .item())


@dataclass(frozen=True)
class _OpInfo:
    """What the recorder reads from an op overload, read once per overload: formatting
    its name and walking its schema on every call cost as much as the op on small
    tensors."""

    name: str  # str(func), e.g. "aten.addmm.default"
    kind: str  # op_kind(name)
    random: bool  # is_random_op(name)
    view: bool  # func.is_view
    inplace: bool  # the schema is mutable
    metadata_only: bool  # func._opname in _METADATA_ONLY
    writes: tuple[tuple[int, str], ...]  # (position, name) of the arguments it writes

    @staticmethod
    def of(func: Any) -> _OpInfo:
        name = str(func)
        schema = func._schema
        writes = tuple((i, arg.name) for i, arg in enumerate(schema.arguments)
                       if schema.is_mutable and arg.alias_info is not None
                       and arg.alias_info.is_write)
        return _OpInfo(name=name, kind=op_kind(name), random=is_random_op(name),
                       view=bool(func.is_view), inplace=bool(schema.is_mutable),
                       metadata_only=func._opname in _METADATA_ONLY, writes=writes)


class _Traced(NamedTuple):
    """A forward op as the recorder saw it, before backward says what autograd kept."""

    info: _OpInfo
    out_bytes: int
    flops: int
    ms: float
    inputs: tuple[int, ...]
    target: int
    value_out: bool


def result_leaves(obj: Any, found: list[Any] | None = None) -> list[Any]:
    """The leaves of an op's result (tensors, numbers, ``None``), in order:
    ``tree_flatten(out)[0]`` for what ATen ops return (tuples and lists of them)."""
    found = [] if found is None else found
    if isinstance(obj, (tuple, list)):
        for item in obj:
            result_leaves(item, found)
    else:
        found.append(obj)
    return found


def _dense_leaves(out: Any) -> list[Any]:
    """:func:`result_leaves` with each sparse tensor as the dense tensors holding it
    (``sparse_parts``: a sparse tensor has no storage of its own)."""
    return [part for leaf in result_leaves(out)
            for part in (_tensors_in(leaf) if isinstance(leaf, torch.Tensor) else (leaf,))]


# NOTE [ A pack hook keeps an alias ]
#     Without hooks, autograd keeps an op's saved output without its grad_fn, so that the
#     output and its node do not refer to each other. A pack hook that returns the tensor
#     itself makes that cycle (tensor -> grad_fn -> saved tensor): a graph the forward
#     builds and drops (a vision tower's pooling head whose output the model never reads,
#     as PaliGemma's SigLIP) is then freed by Python's cycle collector, not when dropped,
#     and the recorded step held 13 KiB more than the user's own. The hook keeps a detached
#     alias: the same storage and version counter, no grad_fn.


# NOTE [ A block with a full backward hook ]
#     A module with a full backward hook (``register_full_backward_hook``) or a backward
#     pre-hook has torch wrap its positional tensor arguments in views
#     (``BackwardHookFunction``) after its forward pre-hooks and before its ``forward``.
#     Those views were recorded as the block's first ops; a selective block's region
#     wraps ``forward`` and never sees them, so its keep-set did not match its ops
#     ("ran a different sequence of ops"), and it was recomputed whole (a held-out MLP:
#     gradients equal, the step slower than its figure). The recorded step tells the
#     recorder, from a pre-hook on each block, how many such views come
#     (:func:`hook_views`), and it skips them.


def hook_views(module: nn.Module, args: tuple[Any, ...]) -> int:
    """How many views torch makes of ``module``'s positional arguments before its
    ``forward`` runs (NOTE [ A block with a full backward hook ]): one per tensor among
    them where it has full backward hooks or backward pre-hooks (its own or global) and
    one of them needs a gradient, with gradients on; else none."""
    from torch.nn.modules import module as _module

    hooked = bool(module._backward_pre_hooks or _module._global_backward_pre_hooks)
    if not hooked and (module._backward_hooks or _module._global_backward_hooks):
        hooked = bool(module._get_backward_hooks()[0])  # the full ones
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not hooked or not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return 0
    return len(tensors)


class OpRecorder(FlopCounter):
    """FLOPs by label and phase, plus per-kind stats and a per-op trace of each label's
    forward."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: dict[str, dict[str, list[float]]] = {}
        # label -> per forward op: what it did (its record is made when backward starts)
        # and the storages it created, as (weak reference, bytes)
        self._trace: dict[str, list[tuple[_Traced, list[tuple[Any, int]]]]] = {}
        self._kept: dict[str, tuple[OpRecord, ...]] | None = None  # set when backward starts
        self._creators: dict[str, dict[int, int]] = {}  # label -> storage -> creating op
        # label -> the storages autograd saved, by key: a weak reference to each, so
        # that a later storage at its address is not taken for it (NOTE [ A storage's
        # key outlives the storage ])
        self._packed: dict[str, dict[int, Any]] = {}
        self._info: dict[Any, _OpInfo] = {}  # op overload -> what its schema says
        # label -> the block taking its output, and the storages of it that block takes
        # with the ops that made them; and of those ops, the ones the taker's forward did
        # not save (_close_forward)
        self._taken: dict[str, tuple[str, dict[int, int]]] = {}
        # label -> its output's storages the next block takes, by key, as weak references
        # (NOTE [ A storage's key outlives the storage ])
        self._taken_refs: dict[str, dict[int, Any]] = {}
        self._unsaved: dict[str, tuple[int, ...]] = {}
        # views torch makes of the block about to run's arguments before its forward,
        # not the block's ops (NOTE [ A block with a full backward hook ])
        self.hook_views = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """A saved-tensors pack hook: note which storages autograd saves in each block's
        forward, and keep a detached alias of the tensor (``saved_tensors_hooks(rec.pack,
        rec.unpack)``; NOTE [ A pack hook keeps an alias ])."""
        if self._kept is None:  # (under "<outside>" too: a head saving the chain's output)
            saved = self._packed.setdefault(self.label, {})
            for t in _tensors_in(tensor):  # (sparse: its parts)
                storage = t.untyped_storage()
                saved[storage._cdata] = weakref.ref(storage)
        return tensor.detach()

    @staticmethod
    def _holds(saved: dict[int, Any], storage: Any) -> bool:
        """Whether ``saved`` (a label's saved storages) holds ``storage`` itself, not a
        storage at its address before it (NOTE [ A storage's key outlives the
        storage ])."""
        ref = saved.get(storage._cdata)
        return ref is not None and ref() is storage

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


    def dispatch(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward and self._kept is None:
            self._close_forward()  # backward started: what is alive now was kept
        label = self.label
        if self.hook_views and not in_backward and func.is_view:
            self.hook_views -= 1  # NOTE [ A block with a full backward hook ]
            return super().dispatch(func, types, args, kwargs)
        if (in_backward or self._kept is not None or label == "<outside>"
                or func in IGNORED_OPS):
            # FLOPs only: forward stats cover the forward before backward, not ops that
            # run after it under a block's label
            return super().dispatch(func, types, args, kwargs)
        before = self.total
        info = self._info.get(func)
        if info is None:
            info = self._info[func] = _OpInfo.of(func)
        inputs = _storage_keys(args, kwargs or {})
        creators = self._creators.get(label)
        if creators is None:
            creators = self._creators[label] = {}
        trace = self._trace.get(label)
        if trace is None:
            trace = self._trace[label] = []
        index = len(trace)
        read = () if info.metadata_only else \
            tuple(sorted({creators[c] for c in inputs if c in creators}))
        target = -1
        for i, arg_name in info.writes:
            value = args[i] if i < len(args) else (kwargs or {}).get(arg_name)
            if isinstance(value, torch.Tensor):
                target = creators.get(value.untyped_storage()._cdata, -1)
                break
        start = time.perf_counter()
        out = super().dispatch(func, types, args, kwargs)
        elapsed = (time.perf_counter() - start) * 1e3
        created = 0
        random = info.random
        refs = []
        value_out = False  # it returns a non-tensor value
        for t in ((out,) if isinstance(out, torch.Tensor) and out.layout is torch.strided
                  else _dense_leaves(out)):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key not in inputs:
                    nbytes = st.nbytes()
                    created += nbytes
                    inputs.add(key)
                    creators[key] = index
                    refs.append((weakref.ref(st), nbytes))
                elif random:  # an in-place draw (CPU dropout's bernoulli_): its bytes cost
                    created += t.nbytes
            elif t is not None:
                value_out = True
        flops = self.total - before
        row = self.stats.setdefault(label, {}).setdefault(info.kind, [0, 0, 0, 0.0])
        row[0] += 1
        row[1] += flops
        row[2] += created
        row[3] += elapsed
        # the record is made when backward starts, with what autograd kept (_close_forward)
        trace.append((_Traced(info, created, flops, round(elapsed, 4), read, target,
                              value_out), refs))
        return out

    def outputs(self, label: str, tensors: Sequence[torch.Tensor]) -> None:
        """The next block takes ``tensors`` of ``label``'s output: note the ops of its
        forward that made their storages (:meth:`block_output_ops`)."""
        if self._kept is not None:
            return  # a recompute in backward
        creators = self._creators.get(label, {})
        storages = {st._cdata: st for st in (t.untyped_storage()  # (sparse: its parts)
                                             for t in _tensors_in(list(tensors)))}
        made = {key: creators[key] for key in storages if key in creators}
        self._taken[label] = (self.label, made)  # (the next block's forward runs now)
        self._taken_refs[label] = {key: weakref.ref(storages[key]) for key in made}

    def block_output_ops(self, label: str) -> tuple[int, ...] | None:
        """The indices of ``label``'s forward ops that made the storages of its output
        that the next block takes, as made or through views and in-place writes between
        them (NOTE [ What the next block takes of an output ] in _profile/runs.py; none:
        one whose output storages the next does not take; for the last block, those the
        step after the chain saves for backward); ``None`` where that was not noted."""
        taken = self._taken.get(label)
        return None if taken is None else tuple(sorted(set(taken[1].values())))

    def block_unsaved_output_ops(self, label: str) -> tuple[int, ...]:
        """Of :meth:`block_output_ops`, those whose storages the next block's forward did
        not save for backward (it lets go of them in its forward)."""
        if self._kept is None:
            self._close_forward()
        return self._unsaved.get(label, ())

    def _close_forward(self) -> dict[str, tuple[OpRecord, ...]]:
        def closed(label: str, op: _Traced, refs: list[tuple[Any, int]]) -> OpRecord:
            alive = [(ref(), n) for ref, n in refs if ref() is not None]
            packed = self._packed.get(label, {})
            info = op.info
            return OpRecord(op=info.name, kind=info.kind, out_bytes=op.out_bytes,
                            flops=op.flops, ms=op.ms, random=info.random, view=info.view,
                            inplace=info.inplace, kept_bytes=sum(n for _, n in alive),
                            inputs=op.inputs, target=op.target,
                            saved=any(self._holds(packed, st) for st, _ in alive),
                            value_out=op.value_out)

        self._kept = {label: tuple(closed(label, op, refs) for op, refs in rows)
                      for label, rows in self._trace.items()}
        for label, (taker, made) in self._taken.items():
            refs, packed = self._taken_refs[label], self._packed.get(taker, {})
            saved = {key for key in made
                     if (storage := refs[key]()) is not None and self._holds(packed, storage)}
            if taker == "<outside>":
                # the last block's output: only what the step after the chain saves
                # matters (it frees it in its backward, which a kept copy outlives); what
                # it does not save is freed before the backward, or held by the loop,
                # whatever the block does (held_after counts the first)
                for key in [k for k in made if k not in saved]:
                    del made[key]
            self._unsaved[label] = tuple(sorted(
                {op for key, op in made.items() if key not in saved}
                - {op for key, op in made.items() if key in saved}))
        self._trace.clear()
        self._creators.clear()
        self._packed.clear()
        return self._kept

    # NOTE [ A storage's key outlives the storage ]
    #     Storages are keyed by their address (``_cdata``), which the allocator hands to
    #     the next storage once one is freed. What autograd saved is noted by key as the
    #     forward goes, so the key of a block's output that the step freed before its
    #     backward can be that of a later tensor something saved: fuzz seed 240932's
    #     last block's output, freed after the skip added to it, had the address of the
    #     head's output, which the loss saves, and was taken as saved after the chain
    #     (its `selective` options were counted holding it through the backward: 2,560 B
    #     over in every plan choosing one). So the saved storages are kept as weak
    #     references, and a storage counts as saved only where the one saved at its
    #     key is that storage itself, alive when backward starts (a saved storage lives
    #     until backward uses it); an op's own ``saved`` flag is read so too.
    def block_stats(self, label: str) -> dict[str, OpStats]:
        rows = self.stats.get(label, {})
        return {k: OpStats(int(r[0]), int(r[1]), int(r[2]), round(float(r[3]), 4))
                for k, r in sorted(rows.items())}

    def block_ops(self, label: str) -> tuple[OpRecord, ...]:
        """The forward ops of ``label`` in order; ``kept`` is decided when backward
        starts (if no backward ran, by what is alive now)."""
        kept = self._kept if self._kept is not None else self._close_forward()
        return kept.get(label, ())
