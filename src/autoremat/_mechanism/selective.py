"""Selective recompute inside a block: keep the outputs of some ops, recompute the rest.

NOTE [ Save-sets by op kind ]
    Following Korthikanti et al. (Megatron-LM, 2022), a block's compute-heavy ops
    (matmul, attention, conv) are worth saving and its memory-heavy, compute-light ops
    (norms, activations, dropout, elementwise) worth recomputing. A *save-set* names the
    op kinds whose outputs stay saved (``op_kind`` in ``ops.py``). Views are never saved:
    they follow their base. The planner considers every non-empty subset of the compute
    kinds a block has, and for blocks with dropout the empty set (``save_sets`` in
    ``_core/saves.py``, with the names of save-sets and keep-sets).
    Kinds are a rule of thumb: a kept matmul output is wasted if nothing backward needs
    is computed from it, and a cheap op's output can be worth keeping if it spares a
    chain of recompute. So the planner also considers *keep-sets*, op outputs chosen one
    by one from the tape's dataflow (``_plan/keepsets.py``, NOTE [ Dead ops ]).

NOTE [ Our own selective contexts, and random bits ]
    The mechanism is the one of PyTorch's selective activation checkpointing (SAC): a
    ``context_fn`` for non-reentrant ``torch.utils.checkpoint`` whose forward dispatch
    mode keeps the outputs of the ops to save, and whose recompute dispatch mode hands
    them back instead of re-running those ops. We write the two modes ourselves
    (``_KeepOutputs``, ``_ReuseOutputs``) for two reasons measured on CPU (see
    benchmarks/selective_overhead.md):

    * Random draws. On CPU, dropout is ``empty_like(x).bernoulli_(1 - p)`` followed by
      arithmetic, and ``bernoulli_`` was a third of a GPT-2 block's forward time at
      n_embd=512, seq 512. Replaying it under the restored RNG state, as SAC does, pays
      that again. We keep each Bernoulli draw instead, as one byte per element (the
      draw is exactly 0 or 1 in any dtype), and the recompute copies it back into the
      fresh tensor: the same values bit for bit, a quarter of the float mask's bytes,
      and no random numbers drawn. A kept draw consumes no random numbers in
      recompute, and neither does a kept or skipped op that draws inside its kernel
      (SDPA's ``dropout_p`` on GPU), so every *other* random op the recompute re-runs
      (``rand``, ``native_dropout`` on GPU, ...) is replayed from the RNG states
      noted just before it ran in forward (NOTE [ Replaying the forward's RNG ] in
      ``rng.py``), not from the stream left by what ran before it.
    * Per-op overhead. SAC builds a policy context and calls a Python policy for every
      op; ours looks the op up in a memo (``_op_info``). Measured here on 8x8 adds: a
      Python dispatch mode that does nothing costs ~4 us per op, ours ~4.4 us in each of
      forward and recompute. The cost model prices it (``costs.py``).

    Recompute hands back a fresh alias of a kept output each time, never the object
    forward kept: autograd gives what a dispatch mode returns the recompute's grad_fn,
    and on the kept object that grad_fn (and through it every tensor the recompute's
    graph saved upstream of it) would live as long as the region's kept outputs, to the
    end of the block's backward. Measured on the zoo's gpt2 (6 x 128, matmul kept): a
    block's backward peak 9.25 MB with the kept object handed back, 7.87 MB with an
    alias (each recomputed tensor then freed once the op that saved it has run).

    A kept output that is later changed in place (its version counter moved) is not
    handed back: the recompute re-runs that op instead, which is always correct. If the
    change happens inside the region's forward, the kept copy is dropped when the
    forward ends, so it costs no memory either (NOTE [ Writes through unsafe pieces ]).

NOTE [ Writes through unsafe pieces ]
    A version counter does not see every write to a kept output's memory. ``unsafe_split``
    and ``unsafe_chunk`` return pieces that share their input's storage but are not views
    to autograd: each piece has a version counter of its own. CPU ``nn.GRU`` runs
    ``addmm`` -> ``unsafe_split`` -> ``add_``/``sigmoid_``/``tanh_`` on the pieces, so a
    kept ``addmm`` output was changed in forward with its version unmoved; recompute
    handed back the changed values and wrote them a second time (gradients off by a
    quarter of their size on a 2 x GRU(16)). So forward also watches storages: every op
    that writes an argument (its schema says so) and writes the storage of a kept output
    makes that output *written*, treated as changed in place (``_note_writes``). This is
    the storage-level rule keep-sets follow too (a node with writers is not kept, NOTE
    [ Keep-sets by MILP ]). A write after the region's forward (the model changing a
    kept output the block returned) is seen by the version counter only: through an
    unsafe piece made outside the region it is not seen at all.

NOTE [ Dead ops ]
    Recompute re-runs a block's Python forward, so every op is dispatched again; but
    backward only needs the tensors autograd saved. An op whose output is neither saved
    nor read by an op that must run is *dead*: once the softmax output is kept, the
    ``bmm`` and mask that computed it are; so is a block's last projection, whose output
    only feeds the block's (kept) output. A keep-set (``_plan/keepsets.py``) names, by
    position in the block's op sequence, the outputs to keep and the dead ops; recompute
    returns uninitialised tensors of the right shape for dead ops (``_placeholder``) and
    hands kept outputs back. Which outputs autograd saves and which op reads which
    storage come from the tape (``OpRecord.kept_bytes`` and ``inputs``), so a keep-set
    only applies to the same op sequence: forward compares the ops it ran with the
    tape's (``op_signature``) and, if they differ, keeps nothing by position and skips
    nothing (recompute re-runs every op, with a warning). Recompute checks that it
    dispatches the ops forward did, position by position, and raises if not. If a kept
    output was changed in place since forward, recompute re-runs it and so skips nothing.
"""

from __future__ import annotations

import functools
import warnings
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from autoremat._core import rng
from autoremat._core.errors import RematError
from autoremat._core.saves import SAVEABLE_KINDS, op_signature
from autoremat._measure.ops import IGNORED_OPS, is_random_op, op_kind
from autoremat._mechanism.wrap import ContextFn

__all__ = ["selective_context"]


class _Kept:
    """What one checkpointed call of a region keeps, shared by its two dispatch modes."""

    def __init__(self, save: frozenset[str], keep: frozenset[int] = frozenset(),
                 skip: frozenset[int] = frozenset(), signature: str = "",
                 label: str = "") -> None:
        self.save = save
        self.label = label  # the region's name, in warnings
        self.keep = keep  # op positions whose outputs stay saved (a keep-set)
        self.skip = skip  # op positions recompute need not run (NOTE [ Dead ops ])
        self.signature = signature  # op_signature of the region the positions are for
        # op -> one entry per call of it in forward order: None (recompute it), the
        # Bernoulli draw as bool, or (outputs, their version counters)
        self.entries: dict[Any, list[Any]] = defaultdict(list)
        # (op, call index) -> RNG states just before that call of a drawing op in forward
        self.draws: dict[tuple[Any, int], rng.RngSnapshot] = {}
        self.funcs: list[Any] = []  # forward's ops by position
        self.placeholders: dict[int, tuple[Any, list[Any]]] = {}  # skip position -> (tree
        # spec, per output (shape, stride, dtype, device))
        self.kept_at: dict[int, Any] = {}  # keep position -> its entry
        # storage (``_cdata``) of a kept output -> the entries holding it, and the ids of
        # the entries whose storage forward wrote in place (NOTE [ Writes through unsafe
        # pieces ])
        self.storages: dict[int, list[Any]] = defaultdict(list)
        self.written: set[int] = set()
        # positions of forward's casts of parameters, which autocast caches (NOTE
        # [ Weight casts autocast caches ])
        self.casts: set[int] = set()


def _is_bernoulli(func: Any) -> bool:
    return "bernoulli" in func.__name__


@functools.cache
def _op_info(func: Any) -> tuple[str | None, bool, bool]:
    """``(kind if its outputs may be kept else None, is random, draws)`` for an op
    overload; memoised: the modes see every op of a region, and naming an op is slow.

    *Random* ops (dropout, ``rand``...) are never kept; an op *draws* if it is random or
    PyTorch tags it ``nondeterministic_seeded`` (fused attention kernels, which draw
    their dropout inside and return the RNG seed and offset backward uses: those may be
    kept, outputs and seed together)."""
    name = str(func)
    random = is_random_op(name)
    keepable = not (random or func.is_view
                    or any(r.alias_info is not None for r in func._schema.returns))
    draws = random or torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
    return (op_kind(name) if keepable else None), random, draws


@functools.cache
def _writes(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments an op overload's schema says it writes (in-place
    and ``out=`` ops); memoised as ``_op_info``. NOTE [ Writes through unsafe pieces ]."""
    return tuple((i, arg.name) for i, arg in enumerate(func._schema.arguments)
                 if arg.alias_info is not None and arg.alias_info.is_write)


class _KeepOutputs(TorchDispatchMode):
    """Forward: keep the outputs of the save-set's ops and every Bernoulli draw."""

    def __init__(self, kept: _Kept) -> None:
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kind, random, draws = _op_info(func)
        # RNG states for a draw recompute may run again (NOTE [ Replaying the forward's
        # RNG ]); a Bernoulli draw (always a tensor) is kept as bits and never re-run
        again = draws and func not in IGNORED_OPS and not _is_bernoulli(func)
        states = rng.snapshot() if again else None
        out = func(*args, **(kwargs or {}))
        if func in IGNORED_OPS:
            return out
        kept = self.kept
        if kept.storages:
            writes = _writes(func)
            if writes:
                _note_writes(kept, writes, args, kwargs or {})
        position = len(kept.funcs)
        kept.funcs.append(func)
        entry: Any = None
        if _cached_cast(func, args):  # never kept: NOTE [ Weight casts autocast caches ]
            kept.casts.add(position)
        elif random:
            if _is_bernoulli(func) and isinstance(out, torch.Tensor):
                entry = out.to(torch.bool)  # a copy: later in-place ops do not reach it
        elif kind in kept.save or (position in kept.keep and kind is not None):
            detached = tree_map(_detach, out)
            leaves = tree_flatten(detached)[0]
            entry = (detached, [t._version if isinstance(t, torch.Tensor) else 0
                                for t in leaves])
            for t in leaves:
                if isinstance(t, torch.Tensor):
                    kept.storages[t.untyped_storage()._cdata].append(entry)
            if position in kept.keep:
                kept.kept_at[position] = entry
        elif position in kept.keep:  # not keepable after all: re-run it, on real inputs
            kept.skip = frozenset()
        if position in kept.skip:
            _note_skipped(kept, position, func, args, out)
        if states is not None and not isinstance(entry, torch.Tensor):  # may be re-run
            kept.draws[func, len(kept.entries[func])] = states
        kept.entries[func].append(entry)
        return out

    def __exit__(self, *exc: Any) -> None:
        kept = self.kept
        if (kept.keep or kept.skip) and op_signature(map(str, kept.funcs)) != kept.signature:
            _fall_back(kept)  # NOTE [ Dead ops ]
        written = kept.written

        def stale(e: Any) -> bool:
            return id(e) in written or _changed(e)

        for func, entries in kept.entries.items():
            if not _is_bernoulli(func):  # changed in place later in the region: recomputed
                # anyway, free it now
                entries[:] = [None if e is None or stale(e) else e for e in entries]
        changed = [p for p, e in kept.kept_at.items() if stale(e)]
        if changed:  # recompute re-runs these, so their inputs must be real; free the copies
            kept.skip = frozenset()
            for position in changed:
                del kept.kept_at[position]
        kept.storages.clear()  # forward is over: no more writes to watch
        written.clear()
        super().__exit__(*exc)


def _note_writes(kept: _Kept, writes: tuple[tuple[int, str], ...], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
    """Mark the kept outputs whose storage an op writes as written, whether or not the
    tensor it writes is a view of them (NOTE [ Writes through unsafe pieces ])."""
    for i, name in writes:
        value = args[i] if i < len(args) else kwargs.get(name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                for entry in kept.storages.get(t.untyped_storage()._cdata, ()):
                    kept.written.add(id(entry))


def _note_skipped(kept: _Kept, position: int, func: Any, args: tuple[Any, ...],
                  out: Any) -> None:
    """Record what recompute returns in place of skipped op ``position``; an op that
    cannot be stood in for (a random one, a value Python reads, an in-place op that does
    not return its first argument) turns skipping off for this call."""
    leaves, spec = tree_flatten(out)
    if not can_stand_in(func, returns_first=bool(args) and out is args[0],
                        all_tensors=all(isinstance(t, torch.Tensor) for t in leaves)):
        kept.skip = frozenset()
        return
    if func._schema.is_mutable:
        return  # recompute returns its target (_placeholder)
    kept.placeholders[position] = (spec, [(t.shape, t.stride(), t.dtype, t.device)
                                          for t in leaves])


def can_stand_in(func: Any, *, returns_first: bool, all_tensors: bool) -> bool:
    """Whether recompute can skip a call of ``func`` (NOTE [ Dead ops ]) that returned
    its first argument (``returns_first``) or only tensors (``all_tensors``): an in-place
    op that returns the first argument it writes (recompute returns that), or one that
    returns tensors only (recompute returns empty ones alike); never a random one (a
    skipped op that only draws inside needs no stand-in draw, but ``random`` ops draw
    into what they return)."""
    if _op_info(func)[1]:
        return False
    if func._schema.is_mutable:
        first = func._schema.arguments[0].alias_info if func._schema.arguments else None
        return first is not None and first.is_write and returns_first
    return all_tensors


def _fall_back(kept: _Kept) -> None:
    """The region ran other ops than the keep-set was planned for: keep no outputs by
    position and skip nothing, so recompute re-runs every op (always correct)."""
    which = f"selective block {kept.label!r}" if kept.label else "a selective block"
    warnings.warn(
        f"autoremat: {which} ran a different sequence of ops than when it was "
        f"profiled, so its keep-set does not apply; this call recomputes every op of "
        f"the block (correct, but slower). Profile with the inputs you train on, or plan "
        f"the block with strategy='full'", UserWarning, stacklevel=3)
    dropped = {id(e) for e in kept.kept_at.values()}
    for func, entries in kept.entries.items():
        if not _is_bernoulli(func):
            keep_kind = _op_info(func)[0] in kept.save
            entries[:] = [None if id(e) in dropped and not keep_kind else e for e in entries]
    kept.keep, kept.skip = frozenset(), frozenset()
    kept.kept_at.clear()
    kept.placeholders.clear()


def _changed(entry: tuple[Any, list[int]]) -> bool:
    out, versions = entry
    return any(isinstance(t, torch.Tensor) and t._version != v
               for t, v in zip(tree_flatten(out)[0], versions, strict=True))


class _ReuseOutputs(TorchDispatchMode):
    """Recompute: hand back what forward kept, re-run everything else."""

    def __init__(self, kept: _Kept) -> None:
        super().__init__()
        self.kept = kept
        self.calls: dict[Any, int] = defaultdict(int)
        self.position = 0
        self.skip: frozenset[int] = frozenset()

    def __enter__(self) -> _ReuseOutputs:
        self.calls.clear()
        self.position = 0
        kept = self.kept
        # a kept output changed in place since forward is re-run, so nothing may be skipped
        self.skip = frozenset() if any(_changed(e) for e in kept.kept_at.values()) \
            else kept.skip
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in IGNORED_OPS:
            return func(*args, **kwargs)
        funcs = self.kept.funcs
        positional = self.kept.keep or self.kept.skip  # (save-sets by kind match by op)
        if _cached_cast(func, args):  # NOTE [ Weight casts autocast caches ]: re-run
            if self.position in self.kept.casts:
                self.position += 1  # forward's cast there
                self.calls[func] += 1
            return func(*args, **kwargs)
        while self.position in self.kept.casts:  # forward's cast, cached now
            self.calls[funcs[self.position]] += 1
            self.position += 1
        position = self.position
        self.position += 1
        if positional and (position >= len(funcs) or funcs[position] is not func):
            ran = funcs[position] if position < len(funcs) else "nothing"
            raise RematError(
                f"selective recompute ran {func} as op {position} of the block, where its "
                f"forward ran {ran}: the block's ops depend on something other than its "
                "inputs (data-dependent control flow?); plan it with strategy='full'")
        if position in self.skip:
            self.calls[func] += 1
            return _placeholder(func, args, self.kept.placeholders.get(position))
        entries = self.kept.entries.get(func)
        index = self.calls[func]
        self.calls[func] += 1
        entry = entries[index] if entries is not None and index < len(entries) else None
        if isinstance(entry, torch.Tensor):  # a Bernoulli draw
            return _restore_draw(func, entry, args)
        if entry is not None and not _changed(entry):
            return tree_map(_detach, entry[0])  # a fresh alias: NOTE [ Our own ... ]
        # recompute it (also a kept output changed in place since forward), drawing what
        # it drew in forward: NOTE [ Replaying the forward's RNG ]
        states = self.kept.draws.get((func, index))
        if states is not None:
            states.restore()
        return func(*args, **kwargs)


# NOTE [ Weight casts autocast caches ]
#     Under autocast, the first use of a parameter in a forward casts it (``_to_copy``)
#     and autocast caches the cast (for leaves that need a gradient) until the outermost
#     autocast region exits; later uses in the same forward find it cached and dispatch
#     nothing. A block that uses a parameter an earlier block used (a layer shared by two
#     blocks) ran no cast in forward, and its recompute, under a cache emptied since,
#     ran one: a keep-set, matched by position, refused it ("selective recompute ran
#     aten._to_copy.default as op 1 of the block, where its forward ran
#     aten.view.default"), and profile failed on every such model under autocast (128 of
#     6,803 fuzzed models, 2026-11-30). So such casts are never kept (forward notes where
#     it ran them) and always re-run: a recompute's cast that forward did not run takes
#     no position, and a forward's cast that the recompute finds cached (a backward run
#     inside the autocast region, after another block's recompute cast it) is passed
#     over.


def _cached_cast(func: Any, args: tuple[Any, ...]) -> bool:
    """Whether ``func`` is a cast autocast may cache: a copy of a leaf that needs a
    gradient (NOTE [ Weight casts autocast caches ])."""
    return func is torch.ops.aten._to_copy.default and bool(args) \
        and isinstance(args[0], torch.Tensor) and args[0].is_leaf and args[0].requires_grad


def _placeholder(func: Any, args: tuple[Any, ...],
                 meta: tuple[Any, list[Any]] | None) -> Any:
    """What a skipped op returns: its in-place target untouched, or empty tensors shaped
    like its forward outputs (NOTE [ Dead ops ])."""
    if meta is None:  # an in-place op on a dead storage: it returns its target
        return args[0]
    spec, leaves = meta
    return tree_unflatten([torch.empty_strided(shape, stride, dtype=dtype, device=device)
                           for shape, stride, dtype, device in leaves], spec)


def _detach(t: Any) -> Any:
    """Detach below autograd so the copy shares the version counter (as SAC's helper)."""
    if not isinstance(t, torch.Tensor):
        return t
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


def _restore_draw(func: Any, bits: torch.Tensor, args: tuple[Any, ...]) -> torch.Tensor:
    target = args[0] if func._schema.is_mutable else None
    shape = tuple(target.shape if target is not None else bits.shape)
    if shape != tuple(bits.shape):
        raise RematError(
            f"selective recompute of {func} expected a draw of shape {tuple(bits.shape)} "
            f"but the recompute asked for {shape}: the checkpointed region ran differently "
            "in backward than in forward (data-dependent control flow?); use "
            "strategy='full' for this block"
        )
    if target is not None:  # bernoulli_: fill the fresh tensor in place, as the draw did
        return target.copy_(bits)
    return bits.to(args[0].dtype)


def selective_context(save_ops: Iterable[str] = (), *, keep_ops: Iterable[int] = (),
                      skip_ops: Iterable[int] = (), signature: str = "",
                      label: str = "") -> ContextFn:
    """A ``context_fn`` for ``torch.utils.checkpoint`` saving the outputs of ``save_ops``.

    Random Bernoulli draws are kept as one byte per element rather than replayed; see
    NOTE [ Our own selective contexts, and random bits ].

    Args:
        save_ops: op kinds whose outputs stay saved (a subset of ``SAVEABLE_KINDS``).
        keep_ops: op positions in the region (its ops in dispatch order, checkpoint's own
            ``detach`` not counted) whose outputs stay saved: a keep-set from the tape.
        skip_ops: op positions recompute need not run; NOTE [ Dead ops ].
        signature: ``op_signature`` of the ops the positions refer to. Required with
            ``keep_ops`` or ``skip_ops``: a call that runs other ops falls back to
            recomputing every op, with a warning.
        label: the region's name in that warning.

    Example:
        >>> import torch
        >>> from torch.utils.checkpoint import checkpoint
        >>> lin = torch.nn.Linear(8, 8)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = checkpoint(lambda t: torch.dropout(lin(t).relu(), 0.5, True), x,
        ...                use_reentrant=False, context_fn=selective_context(["matmul"]))
        >>> y.sum().backward()
        >>> x.grad.shape
        torch.Size([4, 8])
    """
    save = frozenset(save_ops)
    unknown = save - set(SAVEABLE_KINDS)
    if unknown:
        raise RematError(f"cannot save op kinds {sorted(unknown)}; selective plans save a "
                         f"subset of {list(SAVEABLE_KINDS)}")
    keep, skip = frozenset(keep_ops), frozenset(skip_ops)
    if (keep or skip) and not signature:
        raise RematError("selective_context(keep_ops=..., skip_ops=...) needs the signature "
                         "of the ops they index (op_signature(tape_block.ops))")
    if keep & skip:
        raise RematError(f"op positions {sorted(keep & skip)} are both kept and skipped; "
                         "a kept output is handed back, so it cannot be skipped too")

    return _SelectiveContexts(save, keep, skip, signature, label)


@dataclass(frozen=True)
class _SelectiveContexts:
    """The ``context_fn`` :func:`selective_context` returns: fresh modes sharing one
    ``_Kept`` per checkpointed call. An object, not a closure, so that an applied model
    deep-copies and pickles (NOTE [ Copying and pickling an applied model ] in
    ``wrap.py``); the recompute mode starts afresh each time it is entered (NOTE
    [ Contexts a backward may enter again ])."""

    save: frozenset[str]
    keep: frozenset[int]
    skip: frozenset[int]
    signature: str
    label: str = ""

    def __call__(self) -> tuple[_KeepOutputs, _ReuseOutputs]:
        kept = _Kept(self.save, self.keep, self.skip, self.signature, self.label)
        return _KeepOutputs(kept), _ReuseOutputs(kept)
