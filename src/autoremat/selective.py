"""Selective recompute inside a block: save the outputs of some op kinds, recompute the rest.

NOTE [ Save-sets by op kind ]
    Following Korthikanti et al. (Megatron-LM, 2022), a block's compute-heavy ops
    (matmul, attention, conv) are worth saving and its memory-heavy, compute-light ops
    (norms, activations, dropout, elementwise) worth recomputing. A *save-set* names the
    op kinds whose outputs stay saved (``op_kind`` in ``ops.py``). Views are never saved:
    they follow their base. The planner considers every non-empty subset of the compute
    kinds a block has, and for blocks with dropout the empty set (``save_sets``).

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
      and no random numbers drawn. Because a kept draw consumes no random numbers in
      recompute, any *other* random op in the region (``rand``, ``native_dropout`` on
      GPU, ...) would see a shifted RNG stream; so if the region has one, we drop the
      kept draws when its forward ends and replay every random op under the RNG state
      checkpoint restores, exactly as SAC does.
    * Per-op overhead. SAC builds a policy context and calls a Python policy for every
      op; ours looks the op up in a memo (``_op_info``). Measured here on 8x8 adds: a
      Python dispatch mode that does nothing costs ~4 us per op, ours ~4.4 us in each of
      forward and recompute. The cost model prices it (``costs.py``).

    A kept output that is later changed in place (its version counter moved) is not
    handed back: the recompute re-runs that op instead, which is always correct. If the
    change happens inside the region's forward, the kept copy is dropped when the
    forward ends, so it costs no memory either.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .errors import RematError
from .ops import is_random_op, op_kind
from .wrap import ContextFn

__all__ = ["MEGATRON", "SAVEABLE_KINDS", "save_set_name", "save_set_of", "save_sets",
           "selective_context"]

SAVEABLE_KINDS = ("attention", "bmm", "conv", "matmul")  # compute-heavy: worth keeping
# strategy="selective": Megatron-LM's policy. Save what has weights (linear, conv) and
# fused attention kernels; recompute the attention core built from bmm/softmax/dropout.
MEGATRON = ("attention", "conv", "matmul")


# Ops that checkpoint itself may dispatch a different number of times in forward and in
# recompute (as SAC_IGNORED_OPS in torch/utils/checkpoint.py): never counted or kept.
_IGNORED = frozenset({torch.ops.aten.detach.default, torch.ops.prim.device.default})


class _Kept:
    """What one checkpointed call of a region keeps, shared by its two dispatch modes."""

    def __init__(self, save: frozenset[str]) -> None:
        self.save = save
        # op -> one entry per call of it in forward order: None (recompute it), the
        # Bernoulli draw as bool, or (outputs, their version counters)
        self.entries: dict[Any, list[Any]] = defaultdict(list)
        self.replay_rng = False  # the region has a random op other than Bernoulli


def _is_bernoulli(func: Any) -> bool:
    return "bernoulli" in func.__name__


@functools.cache
def _op_info(func: Any) -> tuple[str | None, bool]:
    """``(kind if its outputs may be kept else None, is random)`` for an op overload;
    memoised: the modes see every op of a region, and naming an op is slow."""
    name = str(func)
    random = is_random_op(name)
    keepable = not (random or func.is_view
                    or any(r.alias_info is not None for r in func._schema.returns))
    return (op_kind(name) if keepable else None), random


class _KeepOutputs(TorchDispatchMode):
    """Forward: keep the outputs of the save-set's ops and every Bernoulli draw."""

    def __init__(self, kept: _Kept) -> None:
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func in _IGNORED:
            return out
        kept = self.kept
        kind, random = _op_info(func)
        entry: Any = None
        if random:
            if _is_bernoulli(func) and isinstance(out, torch.Tensor):
                entry = out.to(torch.bool)  # a copy: later in-place ops do not reach it
            else:
                kept.replay_rng = True
        elif kind in kept.save:
            detached = tree_map(_detach, out)
            entry = (detached, [t._version if isinstance(t, torch.Tensor) else 0
                                for t in tree_flatten(detached)[0]])
        kept.entries[func].append(entry)
        return out

    def __exit__(self, *exc: Any) -> None:
        for func, entries in self.kept.entries.items():
            if _is_bernoulli(func):
                if self.kept.replay_rng:  # NOTE [ Our own selective contexts, and random bits ]
                    entries[:] = [None] * len(entries)
            else:  # changed in place later in the region: recomputed anyway, free it now
                entries[:] = [None if e is None or _changed(e) else e for e in entries]
        super().__exit__(*exc)


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

    def __enter__(self) -> _ReuseOutputs:
        self.calls.clear()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _IGNORED:
            return func(*args, **kwargs)
        entries = self.kept.entries.get(func)
        index = self.calls[func]
        self.calls[func] += 1
        entry = entries[index] if entries is not None and index < len(entries) else None
        if entry is None:
            return func(*args, **kwargs)
        if isinstance(entry, torch.Tensor):  # a Bernoulli draw
            return _restore_draw(func, entry, args)
        if _changed(entry):
            return func(*args, **kwargs)  # changed in place since: recompute it
        return entry[0]


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


def selective_context(save_ops: Iterable[str]) -> ContextFn:
    """A ``context_fn`` for ``torch.utils.checkpoint`` saving the outputs of ``save_ops``.

    Random Bernoulli draws are kept as one byte per element rather than replayed; see
    NOTE [ Our own selective contexts, and random bits ].

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

    def contexts() -> tuple[_KeepOutputs, _ReuseOutputs]:
        kept = _Kept(save)
        return _KeepOutputs(kept), _ReuseOutputs(kept)

    return contexts


def save_sets(kinds_present: Iterable[str]) -> list[tuple[str, ...]]:
    """The save-sets worth measuring for a block with these op kinds, largest first.

    Every non-empty subset of the saveable kinds present, and, if the block draws random
    numbers (``dropout``), the empty save-set: recompute every op but copy the kept
    draws back, which costs less than whole-block recompute where drawing is slow (CPU).

    Example:
        >>> save_sets(["matmul", "bmm", "softmax", "dropout"])
        [('bmm', 'matmul'), ('bmm',), ('matmul',), ()]
    """
    kinds = set(kinds_present)
    present = sorted(kinds & set(SAVEABLE_KINDS))
    out: list[tuple[str, ...]] = []
    for size in range(len(present), 0, -1):
        out.extend(itertools.combinations(present, size))
    if "dropout" in kinds:
        out.append(())
    return out


def save_set_name(save: Iterable[str]) -> str:
    """The key of a save-set in a tape: kinds joined by ``+`` ("" for the empty set)."""
    return "+".join(sorted(save))


def save_set_of(name: str) -> tuple[str, ...]:
    """The save-set a tape key names; the inverse of :func:`save_set_name`."""
    return tuple(name.split("+")) if name else ()
