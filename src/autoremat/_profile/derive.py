"""Selective options derived from the checkpointed step instead of measured one step each.

NOTE [ Selective windows from the checkpointed step ]
    A selective block (``selective.py``) runs the ops a checkpointed one runs, in the
    same order, in forward and in recompute. What differs, storage by storage:
    * each output it keeps (the ops of its save-set's kinds, or a keep-set's positions)
      lives from forward to the end of the region, when the checkpoint's frame is freed
      in the block's backward (its ``_Kept`` goes with it), and never shorter than the
      recomputed copy it stands in for;
    * recompute makes no copy of a kept output (it hands back an alias of the kept one,
      NOTE [ Our own selective contexts, and random bits ]);
    * each Bernoulli draw is kept as one byte per element, from the draw to the frame's
      end;
    * a dead op's stand-in is an empty tensor of the bytes the op would have made.
    Nothing else changes: the same storages are made and freed at the same points. So
    the checkpointed memory step runs with a tagging context in every block
    (``RegionTagger`` in ``_measure/regions.py``: which of the timeline's events each op
    position made, in forward and in recompute, and the event at which the region's
    frame was freed), and an option's windows are that step's levels with those
    lifetimes changed (``derive``). Its recompute FLOPs are the checkpointed block's less
    those of the kept and skipped ops recompute ran (checkpoint's early stop is the same:
    the same tensors are saved). Checked on 15 models (the zoo's four, HF GPT-2, Llama,
    BERT, T5, OPT, Qwen2, Mistral, GPT-NeoX, Phi, ViT, an odd net with in-place ops and
    ``rand_like``) and on the zoo's gpt2 on meta for CUDA: every derived option equal to a
    step that runs it.
    Where a block's tags do not show what the option would do (a kept output changed in
    place later, a keep-set position that cannot be kept or a skipped op that cannot be
    stood in for, so that the mechanism turns keeping or skipping off; a recompute that
    ran other ops; a frame not freed within the step), ``derive`` gives ``None`` and the
    option is measured in a step of its own (NOTE [ Options measured together ]).
    ``test_profile`` checks every derived option against a step that measures it with
    the other blocks checkpointed. On CUDA a kept output and its recompute's copy are
    compared by their storages' sizes, not their blocks: a block handed out whole (NOTE
    [ Blocks the allocator does not split ]) depends on what the allocator had cached,
    and comparing blocks sent every option with a large kept output to a step of its own
    (on an H200 on 2026-11-28: 4 such steps for the zoo's gpt2, 7 for its llama, x46 plain
    steps of profiling; a stand-in for the allocator reproduces it on the CPU).

NOTE [ Kept outputs that outlive the forward ]
    A kept output that outlives the block's forward in the checkpointed step is returned
    by the block (or held outside it). Two cases, by where that step frees it:
    * in a later block's backward (the next block holds it as its input): keeping it
      moves its free from the end of that block's backward to the end of this one's, out
      of this block's windows. Such an option is measured, as before, in a step where
      the other blocks run options of their own (and the planner counts the block's own
      output held through its backward: NOTE [ A selective block that keeps its output ]
      in ``_plan/peak.py``).
    * before the backward starts: the model dropped it (MPT's blocks return their
      attention weights, which the model's loop holds until the next block returns; the
      last block's until the forward returns). Kept, it lives until this block's
      backward instead: above every window in between, which the other blocks' windows
      measured freed. Its bytes are the option's ``held_after``, which the planner adds
      to what the block holds from its forward on (over by them only in the window that
      freed it); the block's own windows are derived as for any kept output (they hold it
      from the backward's start to the frame's end). Found on a held-out MPT: a
      smallest-feasible plan keeping block 0's softmax measured one attention matrix
      (256 KiB) over its prediction.

NOTE [ Kept outputs freed in the backward before the block's ]
    A third case: the checkpointed step frees a kept storage after the backward started
    and by the time the block's own backward begins. An op between blocks that saved
    the block's output (ViT-5 scales each layer's output by a parameter outside the
    layer, ``attn(x) * ls1 + x``: the ``mul`` saves it until its own backward, which
    runs just before the layer's), or later blocks that took it (the simple ViT with
    value residual: the first attention's values, a view of its projection's output,
    taken by every later attention and freed in the second's backward). Kept, it lives
    to the end of the block's backward instead: the option's windows, measured in a step
    of its own, start with it held, but the planner's levels come from steps that freed
    it before. ``held_after`` records each such storage (``SelectiveProfile``'s
    ``bwd_freed_*``): how many later blocks' backward windows start after its free, and
    how far the peak of the window that freed it rises with it held from the free on
    (in the checkpointed step). The planner adds its bytes to the block's own backward
    peak (``_selective_cost``, which the solver reads) and to the backward peaks of the
    segments holding those later blocks, the lift to the one that freed it
    (``_with_freed_in_backward`` in ``_plan/peak.py``, in the plan's own prediction,
    which the solver checks each plan against). The output the next block takes is
    counted apart (NOTE [ A selective block that keeps its output ] there); a storage
    freed before the chain's backward began (in the head's) is counted held from the
    forward on (over, never under). Found on held-out vit-pytorch models: ViT-5's
    `matmul` option on an attention, one output (35,328 B, 1.8%) under its step in every
    plan choosing it (the default `selective` plan among them), and the value residual's
    first attention under by its projection's output.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from autoremat._core.saves import is_keep_set, save_set_of
from autoremat._measure.memory import MemoryTracker, Rounding, StorageRecord, counted_bytes
from autoremat._measure.ops import OpRecord
from autoremat._measure.regions import RegionCall
from autoremat._measure.tape import SelectiveProfile, WindowMemory
from autoremat._mechanism.selective import _op_info, can_stand_in

__all__ = ["HeldAfter", "derive", "held_after"]


@dataclass(frozen=True)
class _Timeline:
    """A step's timeline as ``derive`` reads it: its levels, and its storages by the
    event that made them (those a kernel held inside an op apart)."""

    levels: np.ndarray
    born: dict[int, StorageRecord]
    inside: dict[int, StorageRecord]
    checked: dict[int, bool]  # id(tags) -> _ran_as_forward, each block's read once


_last: tuple[weakref.ref[MemoryTracker], _Timeline] | None = None


def _timeline(mem: MemoryTracker) -> _Timeline:
    """``mem``'s timeline, made once for the step every block's options are derived
    from (a profile derives each block's own: NOTE [ Alike blocks derive their own
    options ] in ``options.py``)."""
    global _last
    if _last is not None and _last[0]() is mem and len(_last[1].levels) == len(mem.levels):
        return _last[1]
    born: dict[int, StorageRecord] = {}
    inside: dict[int, StorageRecord] = {}
    for record in mem.records:
        (inside if record.transient else born)[record.born] = record
    found = _Timeline(np.asarray(mem.levels, dtype=np.int64), born, inside, {})
    _last = (weakref.ref(mem), found)
    return found


def _ran_as_forward(tags: RegionCall, ops: tuple[OpRecord, ...], timeline: _Timeline) -> bool:
    """Whether the block's tagged forward ran the plain step's ops (``ops``) and its
    recompute a prefix of them: read once per block (its options all ask)."""
    found = timeline.checked.get(id(tags))
    if found is None:
        forward, recompute = tags.forward, tags.recompute
        found = timeline.checked[id(tags)] = not (
            len(forward) != len(ops)
            or any(str(op.func) != record.op for op, record in zip(forward, ops, strict=True))
            or len(recompute) > len(forward)
            or any(r.func is not f.func for r, f in zip(recompute, forward, strict=False)))
    return found


def _kept_positions(key: str, option: SelectiveProfile, tags: RegionCall) -> set[int] | None:
    """The positions whose outputs option ``key`` keeps, or ``None`` where the mechanism
    would turn keeping off (a keep-set position that cannot be kept)."""
    if not is_keep_set(key):
        save = set(save_set_of(key))
        return {p for p, op in enumerate(tags.forward)
                if not _op_info(op.func)[1] and _op_info(op.func)[0] in save}
    if any(p >= len(tags.forward) or _op_info(tags.forward[p].func)[0] is None
           for p in option.keep_ops):
        return None
    return set(option.keep_ops)


@dataclass(frozen=True)
class HeldAfter:
    """What an option keeps that the checkpointed step freed after the block's forward
    and before the backward (NOTE [ Kept outputs that outlive the forward ])."""

    bytes: int  # all of it
    ops: tuple[int, ...]  # the op positions that made it
    at_return: tuple[tuple[int, int], ...]  # freed after the chain: (event - chain end, bytes)
    # freed in the backward by the block's own backward window's start: (op position,
    # bytes, the event that freed it; NOTE [ Kept outputs freed in the backward before
    # the block's ])
    in_backward: tuple[tuple[int, int, int], ...] = ()


def held_after(tags: RegionCall, key: str, option: SelectiveProfile, *,
               fwd_end: int, backward: int, chain_end: int, bwd_start: int) -> HeldAfter:
    """The storages option ``key`` keeps that the checkpointed step (``tags``) freed
    after the block's forward ended (event ``fwd_end``) and before the backward started
    (event ``backward``), and of those the ones freed after the chain's forward ended
    (event ``chain_end``; NOTE [ Where the forward returns ] in _plan/peak.py); and
    those it freed in the backward up to the block's backward window's start (event
    ``bwd_start``)."""
    kept = _kept_positions(key, option, tags)
    if tags.mem is None or kept is None:
        return HeldAfter(0, (), ())
    born = _timeline(tags.mem).born
    total, ops, at_return, in_backward = 0, [], [], []
    for p in sorted(kept):
        if p < len(tags.forward):
            for e in range(tags.forward[p].first, tags.forward[p].stop):
                record = born.get(e)
                if record is None or record.died is None or record.died <= fwd_end:
                    continue
                if record.died < backward:
                    total += record.nbytes
                    ops.append(p)
                    if record.died > chain_end:
                        at_return.append((record.died - chain_end, record.nbytes))
                elif record.died <= bwd_start:
                    in_backward.append((p, record.nbytes, record.died))
    return HeldAfter(total, tuple(sorted(set(ops))), tuple(at_return), tuple(in_backward))


def derive(tags: RegionCall, ops: tuple[OpRecord, ...], key: str, option: SelectiveProfile, *,
           windows: tuple[tuple[int, int], tuple[int, int]], backward: int,
           recompute_flops: int, rounding: Rounding | None,
           ) -> tuple[WindowMemory, WindowMemory, int] | None:
    """Option ``key`` of a block as the checkpointed step tagged it (``tags``; ``ops``:
    the block's op records from the plain step; ``windows``: the block's forward and
    backward windows in that step, as first and last events; ``backward``: the event
    that started the step's backward; ``recompute_flops``: the checkpointed block's): its
    forward and backward windows and recompute FLOPs, or ``None`` where they must be
    measured (NOTE [ Selective windows from the checkpointed step ])."""
    mem, forward, recompute = tags.mem, tags.forward, tags.recompute
    if mem is None or tags.freed is None:
        return None
    timeline = _timeline(mem)
    if not _ran_as_forward(tags, ops, timeline):
        return None
    kept = _kept_positions(key, option, tags)
    skipped = set(option.skip_ops)
    if kept is None or any(
            not can_stand_in(forward[p].func, returns_first=forward[p].returns_first,
                             all_tensors=forward[p].all_tensors)
            for p in skipped if p < len(forward)):
        return None
    if any(r.inplace and r.target in kept for r in ops):
        return None  # changed in place after it was kept: neither kept nor skipping
    if sum(r.flops for r in ops[:len(recompute)]) != recompute_flops:
        return None  # recompute ran something else than forward's ops
    born = timeline.born  # storages, by the event that made them
    # what a kernel held inside an op (CUDA; NOTE [ Memory a kernel allocates inside an
    # op ] in memory.py): gone from recompute with the op
    inside = timeline.inside
    freed = tags.freed + 1  # the first event after the frame was freed
    never = len(mem.levels)
    changes: list[tuple[int, int, int]] = []  # +bytes over events [start, stop)
    for p in sorted(kept):
        made = [born[e] for e in range(forward[p].first, forward[p].stop) if e in born]
        if len(made) != forward[p].storages:
            return None  # it returned a storage it did not make: not modelled
        again = [born[e] for e in range(recompute[p].first, recompute[p].stop)
                 if e in born] if p < len(recompute) else []
        # the same storages, of the same sizes: their blocks may differ by what the
        # allocator handed out whole (NOTE [ Blocks the allocator does not split ]),
        # which depends on what it had cached when each was made
        if again and [r.nbytes - r.remainder for r in again] != \
                [r.nbytes - r.remainder for r in made]:
            return None
        for k, record in enumerate(made):
            died = never if record.died is None else record.died
            if windows[0][1] < died and not died < backward:
                return None  # freed in a later block's backward: NOTE [ Kept outputs ... ]
            copy = again[k] if again else None
            # no copy: recompute stopped before this op (checkpoint's early stop)
            copy_died = 0 if copy is None else never if copy.died is None else copy.died
            changes.append((died, max(died, copy_died, freed), record.nbytes))
            if copy is not None:
                changes.append((copy.born, copy_died, -copy.nbytes))
    gone = (kept | skipped) & set(range(len(recompute)))  # ops recompute no longer runs
    for p in sorted(gone):
        for e in range(recompute[p].first, recompute[p].stop):
            if e in inside:
                changes.append((e, e + 1, -inside[e].nbytes))
    for position in forward:
        if position.drawn:
            if position.drawn_bool:
                return None  # kept as the draw itself: not modelled
            assert position.device is not None  # for mypy: set with drawn
            changes.append((position.stop - 1, freed,
                            counted_bytes(position.drawn, position.device, rounding)))
    levels = timeline.levels
    out = []
    for start, stop in windows:
        level = levels[start:stop + 1].copy()
        for a, z, nbytes in changes:
            lo, hi = max(a, start), min(z, stop + 1)
            if lo < hi:
                level[lo - start:hi - start] += nbytes
        out.append(WindowMemory(peak_bytes=int(level.max() - level[0]),
                                delta_bytes=int(level[-1] - level[0])))
    return out[0], out[1], recompute_flops - sum(ops[p].flops for p in gone)
