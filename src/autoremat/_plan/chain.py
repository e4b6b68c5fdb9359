"""The exact DP that plans a chain of blocks over the peak model (:mod:`autoremat._plan.peak`).

NOTE [ Why a DP over (F, cost) frontiers ]
    Every constraint has the form ``F_i + c(segment) <= budget`` and the cost is a sum,
    so the only thing a prefix passes on is ``F``: the optimum is a shortest path over
    (block index, F) states. We keep, per block index, the Pareto frontier of (F, cost)
    and extend each point by every segment that starts there, vectorised with numpy.
    It is exact (no rounding of bytes), so it agrees with brute force, and a 200-block
    chain plans in well under a second. What a plan releases when the forward returns
    (NOTE [ Released when the forward returns ] in ``peak.py``) lowers every backward
    level after it, by the releases of the blocks up to the one in backward; a block's
    release depends on its decision and its predecessor's, both known when its segment
    is chosen. So each row also carries ``E``, what the prefix releases beyond the least
    any plan does, and the frontier is over (F, cost, E) where releases differ (NOTE
    [ Releases in the DP ]). Ties in cost are broken towards the lower stored level,
    then the lower peak, then the earlier segment boundary: the same tape always gives
    the same plan. (A MILP via HiGHS would also be exact, but it
    needs a variable per segment and cannot beat this on chains.)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoremat._core.decisions import KEEP, RECOMPUTE, Choice, Decision
from autoremat._core.errors import BudgetError, internal_assert
from autoremat._core.units import format_bytes
from autoremat._measure.tape import Tape
from autoremat._plan.peak import (
    Later,
    SegmentCost,
    block_costs,
    block_entries,
    fixed_peaks,
    freed_later,
    held_by_segment,
    holds_later,
    input_held_lift,
    kept_output_bytes,
    kept_outputs,
    later_terms,
    least_release,
    maker_holds,
    post_window,
    predict_peak,
    release_hidden,
    released_post_peak,
    segment_cost,
    segment_release,
    segment_runs,
    shared_saves,
    suffix_z,
    uniform_release,
)

__all__ = ["ChainSolution", "ExtraOptions", "solve"]


@dataclass(frozen=True)
class ChainSolution:
    segments: tuple[tuple[int, int, Choice], ...]  # (start, stop, choice)
    cost: int  # the planner's objective (FLOP-equivalents, see costs.py)
    peak_bytes: int


def _allowed_stops(tape: Tape, max_len: int | None) -> list[list[int]]:
    """``stops[i]``: segment ends allowed from ``i`` (multi-block only across chained links)."""
    n = len(tape.blocks)
    out = []
    for i in range(n):
        stops = [i + 1]
        j = i + 1
        while j < n and tape.joins_previous(j) and (max_len is None or j + 1 - i <= max_len):
            stops.append(j + 1)
            j += 1
        out.append(stops)
    return out


ExtraOptions = Sequence[Sequence[Choice]]

# NOTE [ The order of decisions in the DP ]
#     States and moves are ordered by what a block is seen as, in this order, and ties
#     in cost and peak between plans that end differently go to the earlier one: the
#     same tape always gives the same plan. (The order is the one the DP had when it
#     keyed decisions by letter, C < K < O < P, so that plans stay what they were.)
_ORDER = (Decision.RECOMPUTE, Decision.KEEP, Decision.OFFLOAD, Decision.OFFLOAD_INPUT)
_RANK = {d: i for i, d in enumerate(_ORDER)}


@dataclass(frozen=True)
class _Moves:
    """The segments that may start at a block after a block seen as a given decision,
    and their figures as arrays, one entry per move, for the vectorised step of ``solve``."""

    steps: list[tuple[int, Choice]]  # (stop, choice) of each move
    stop: np.ndarray  # (moves,) the index the segment ends at
    seen: np.ndarray  # (moves,) _RANK of what its last block is seen as by the next
    fwd: np.ndarray  # (moves,) bytes: forward transient above F
    hold: np.ndarray  # (moves,) bytes: what it adds to F until its backward
    bwd: np.ndarray  # (moves,) bytes: backward peak above F (hold, suffix, transient)
    cost: np.ndarray  # (moves,) the objective's cost (FLOP-equivalents)
    first: np.ndarray  # (moves,) bytes: the fixed peak when it is the first segment
    rel: np.ndarray  # (moves,) bytes its blocks release when the forward returns, beyond
    # the least any decision releases (NOTE [ Releases in the DP ])
    over: np.ndarray  # (decisions, moves) bytes its blocks hold past the forward's return
    # that the uniform step of each decision (by _RANK) released there, their own
    # releases' shortfalls each at least 0 (NOTE [ Releases in the DP ])
    sets: np.ndarray  # (moves,) bits of the shared saves whose first block it does not
    # keep (NOTE [ Saves shared by calls of a layer ] in peak.py)
    holds: np.ndarray  # (moves,) bits of the shared saves a later block of which it keeps
    # NOTE [ Inputs the model frees later in the chain ] in peak.py, for the inputs of
    # blocks before the segment (their bits in the row):
    later_sets: np.ndarray  # (moves,) bits of those whose block the segment starts, holding
    later_done: np.ndarray  # (moves,) bits of those freed in a window of the segment
    later_on: np.ndarray  # (3, inputs, moves) bytes added to fwd, hold, bwd where held
    later_off: np.ndarray  # (3, inputs, moves) the same where not held


@dataclass(frozen=True)
class _Frontier:
    """The Pareto frontier of (F, objective) at one state, one row per plan of the prefix,
    with back-pointers to the row, move and state it was extended from."""

    F: np.ndarray  # (rows,) bytes held when the next segment starts
    cost: np.ndarray  # (rows,) cost of the prefix
    peak: np.ndarray  # (rows,) bytes: the prefix's peak so far
    E: np.ndarray  # (rows,) bytes the prefix releases when the forward returns, beyond
    # the least (it lowers the backward levels of these blocks and the post window)
    P: np.ndarray  # (rows,) bits of the shared saves the prefix holds no longer than the
    # forward but a later kept block would (its first block not kept, no later one yet)
    H: np.ndarray  # (rows, decisions) the prefix's moves' ``over``: what the levels of
    # the post window before the backward starts hold more, by the last block's decision
    Q: np.ndarray  # (rows,) bits of the inputs the prefix holds whose window it has not
    # reached (NOTE [ Inputs the model frees later in the chain ] in peak.py), and of
    # its last block keeping its output (NOTE [ The next block's backward under a
    # selective block that keeps its output ] there)
    prev: np.ndarray  # (rows,) row in the source state's frontier (-1 at the start)
    move: np.ndarray  # (rows,) index into the source's _Moves.steps (-1 at the start)
    from_index: np.ndarray  # (rows,) block index of the source state (-1 at the start)
    from_seen: np.ndarray  # (rows,) _RANK of the source state's decision (-1 at the start)
    from_status: np.ndarray  # (rows,) the source state's held status id (-1 at the start)


@dataclass(slots=True)
class _Part:
    """Rows bound for one target state from one source state: the per-row arrays of a
    :class:`_Frontier` (views into one extension) and the source's scalars."""

    F: np.ndarray
    cost: np.ndarray
    peak: np.ndarray
    E: np.ndarray
    P: np.ndarray
    H: np.ndarray
    Q: np.ndarray
    prev: np.ndarray
    move: np.ndarray
    from_index: int
    from_seen: int
    from_status: int


def _all_moves(tape: Tape, options: ExtraOptions | None,
               max_segment: int | None) -> list[dict[Decision, _Moves]]:
    """``moves[i][prev]``: the choices from block ``i`` after a block seen as ``prev``."""
    n = len(tape.blocks)
    z = suffix_z(tape)
    least = least_release(tape)
    uniform = np.zeros((len(_ORDER), n), dtype=np.int64)  # NOTE [ Releases in the DP ]
    # inner blocks' release_hidden, by the last decision: prefix sums
    inner = np.zeros((len(_ORDER), n + 1), dtype=np.int64)
    for d in tape.window_decisions:
        uniform[_RANK[d]] = uniform_release(tape, d)
        inner[_RANK[d], 1:] = np.cumsum([release_hidden(tape, k, (Decision.RECOMPUTE,) * 2, d)
                                         for k in range(n)])
    stops = _allowed_stops(tape, max_segment)
    costs_of_blocks = block_costs(tape)
    seen = tape.window_decisions  # what a block can be seen as by the next one
    fixed = {d: fixed_peaks(tape, d) for d in seen}
    shared = shared_saves(tape)[:_MAX_SHARED]
    later = freed_later(tape)[:_MAX_SHARED]
    kept = kept_outputs(tape)[:_MAX_SHARED - len(later)]
    moves: list[dict[Decision, _Moves]] = []
    for i in range(n):
        by_prev = {}
        for prev in seen if i else (Decision.KEEP,):
            here: list[tuple[int, Choice, SegmentCost]] = [
                (i + 1, KEEP, segment_cost(tape, i, i + 1, KEEP, prev))]
            runs = segment_runs(tape, i, stops[i][-1], prev, costs_of_blocks)
            here += [(i + 1 + k, RECOMPUTE, c) for k, c in enumerate(runs)]
            if options is not None:
                here += [(i + 1, opt, segment_cost(tape, i, i + 1, opt, prev))
                         for opt in options[i]]
            terms = _later_moves(tape, later, i, prev, here)
            if kept:  # their bits follow those of ``later``
                sets, done, on = _kept_moves(tape, kept, i, here)
                terms = (terms[0], terms[1] | (sets << len(later)),
                         terms[2] | (done << len(later)),
                         np.concatenate([terms[3], on], axis=1),
                         np.concatenate([terms[4], np.zeros_like(on)], axis=1))
            released = [segment_release(tape, i, m[0], m[1], prev, m[2].seen_as, least)
                        for m in here]
            bits = [_shared_bits(shared, i, m[0], m[1]) for m in here]
            segment_held = [held_by_segment(tape, i, m[0], m[1].decision) for m in here]
            by_prev[prev] = _Moves(
                steps=[(m[0], m[1]) for m in here],
                stop=np.array([m[0] for m in here]),
                seen=np.array([_RANK[m[2].seen_as] for m in here]),
                fwd=np.array([m[2].fwd_peak for m in here], dtype=np.int64) + terms[0][0],
                hold=np.array([m[2].hold for m in here], dtype=np.int64) + terms[0][1],
                bwd=np.array([m[2].hold + z[m[2].seen_as][m[0] - 1] + m[2].bwd_peak
                              for m in here], dtype=np.int64) + terms[0][2],
                cost=np.array([m[2].rank_cost for m in here], dtype=np.int64),
                first=np.array([fixed[m[2].seen_as] for m in here], dtype=np.int64),
                rel=np.array([sum(r) - sum(least[i:i + len(r)]) for r in released],
                             dtype=np.int64),
                over=np.array([np.maximum(uniform[:, i:i + len(r)] - r, 0).sum(1)
                               + inner[:, i + len(r)] - inner[:, i + 1]
                               + [release_hidden(tape, i, (prev, m[2].seen_as), d, held)
                                  for d in _ORDER]
                               for r, m, held in zip(released, here, segment_held,
                                                     strict=True)],
                              dtype=np.int64).T,
                sets=np.array([sets for sets, _ in bits], dtype=np.int64),
                holds=np.array([holds for _, holds in bits], dtype=np.int64),
                later_sets=terms[1], later_done=terms[2], later_on=terms[3],
                later_off=terms[4],
            )
        moves.append(by_prev)
    return moves


# NOTE [ Releases in the DP ]
#     ``predict_peak`` counts what each block's input releases when the forward returns
#     by its decision (``release_of``): the first block of a segment as measured after its
#     predecessor's decision (a selective block as a checkpointed one, what it keeps
#     counted by its ``held_after``), the others at the least any decision releases
#     (block 0 too: any checkpoint may hold what the model made before it). A release
#     lowers the backward levels of its block and of every block after it in the chain
#     (``suffix_z``), and the post window. The DP counted the least for every block,
#     which could only over-predict: found on a held-out Phi-3 under autocast, whose
#     checkpointed blocks let go of their weights' bf16 copies when the forward returns
#     (autocast's cache) and kept ones hold them, the smallest feasible budget it
#     reported was 9% above what checkpointing every block predicts.
#     Each row now carries ``E``, the prefix's releases beyond the least; a move's
#     backward level is lowered by ``E`` and its own, the post window's by the whole
#     chain's. A row is dominated only by one of no larger ``F`` and cost and no smaller
#     ``E`` (``E`` compared by up to 16 levels, exact below that: a 200-block chain
#     whose every block releases plans in 1.2 s, 15 s with ``E`` compared exactly);
#     where every row's ``E`` is the same (no release differs, most steps) the frontier
#     is the (F, cost) one it always was. The brute-force test on random chains with
#     releases (``test_chain.py``) checks both objectives. The post window's levels
#     before the backward starts hold, on those of the uniform step of the last block's
#     decision, each block's shortfall on that step's release, at least 0
#     (``post_window``: a block that holds more is not offset by one that lets go of
#     more, which may happen after them); netted into ``E``, a plan's figures came out
#     under its prediction, dominated the plan's own rows and dropped the cheapest plan
#     for a pricier one (random chains whose first block releases, 2026-11-30). Each row
#     carries those sums, one per last decision (``H``, each move's ``over``); where
#     rows differ in them, a row dominates only one of no larger cost and no larger
#     level at any point of the rest: ``F``, ``F - E``, and ``F + H`` for each decision
#     (exact, without levels; a 200-block chain whose every block releases plans in
#     0.3 s, 0.2 s netted; a 24-layer GPT-2 under autocast in 0.1 s, 0.05 s). Shared
#     saves (NOTE [ Saves shared by calls of a layer ] in
#     ``peak.py``) are a release less from the first kept later block on: each row
#     carries the bits of those whose first block it did not keep and no later block has
#     held yet (``P``); what it counts held of them is in ``E`` and not in ``H`` (the
#     levels before the forward returns hold them in every plan); a row dominates only
#     rows of the same ``P``. Inputs the
#     model frees later in the chain (NOTE [ Inputs the model frees later in the chain ]
#     in ``peak.py``) change the figures of the segments up to their window by whether
#     the plan holds them (its segment starting at their block checkpoints it): each row
#     carries the bits of those it holds whose window it has not reached (``Q``), a
#     move's figures for those of blocks before it come in two (held or not, picked per
#     row), and a row dominates only rows of the same ``Q``. A selective block that
#     keeps its output sets a bit of ``Q`` too, which the next move reads and clears: its
#     backward is lifted where the bit is set (NOTE [ The next block's backward under a
#     selective block that keeps its output ] in ``peak.py``).


_MAX_SHARED = 62  # shared saves the DP follows (bits of an int64); predict_peak counts all


def _later_moves(tape: Tape, later: list[Later], i: int, prev: Decision,
                 here: list[tuple[int, Choice, SegmentCost]],
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The moves' figures for the inputs the model frees later in the chain (NOTE
    [ Inputs the model frees later in the chain ] in peak.py, ``later``: ``(block,
    window, bytes, maker)``): what the moves add to (fwd, hold, bwd above F) for those
    whose block is in the segment, which the move decides, as a (3, moves) array; the
    bits of those whose block the segment starts and holds (or, ``maker``, whose block
    the segment is the one before, and keeps on its own), and of those freed in a window
    of the segment; and for the others, before the segment, what it adds where the row
    holds them and where it does not, as (3, inputs, moves) arrays."""
    m = len(here)
    own = np.zeros((3, m), dtype=np.int64)
    on = np.zeros((3, len(later), m), dtype=np.int64)
    off = np.zeros((3, len(later), m), dtype=np.int64)
    sets = np.zeros(m, dtype=np.int64)
    done = np.zeros(m, dtype=np.int64)
    for c, (stop, choice, cost) in enumerate(here):
        for e, entry in enumerate(later):
            block, window, _, maker = entry
            if maker and i == block - 1 and stop == block:
                # block i - 1 on its own, which saves them kept; no terms of its own
                if maker_holds(choice.decision):
                    sets[c] |= 1 << e
                continue
            if block >= stop or window < i:
                continue
            if window < stop:
                done[c] |= 1 << e
            args = (tape, entry, i, stop, choice, prev, cost.seen_as)
            held = holds_later(tape, block, i, stop, choice.decision)
            # the move decides whether it holds it, or it holds it whatever block i - 1
            # did (one that saves it kept: by the row's bit, else)
            if block > i or (block == i and (held or not maker)):
                if held and window >= stop:
                    sets[c] |= 1 << e
                f, h, b = later_terms(*args, held)
                own[:, c] += (f, h, h + b)
            else:
                for out, held in ((on, True), (off, False)):
                    f, h, b = later_terms(*args, held)
                    out[:, e, c] = (f, h, h + b)
    return own, sets, done, on, off


def _kept_moves(tape: Tape, kept: list[tuple[int, int]], i: int,
                here: list[tuple[int, Choice, SegmentCost]],
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The moves' figures for the inputs a selective block before may keep
    (``kept``: ``(block, bytes)``, NOTE [ The next block's backward under a selective
    block that keeps its output ] in peak.py), as ``_later_moves`` gives them: the bits
    of those whose block the move, selective, keeps the output of the block before; of
    those whose block it starts; and what it adds to (fwd, hold, bwd above F) where the
    row holds them, as a (3, inputs, moves) array (nothing where it does not)."""
    m = len(here)
    on = np.zeros((3, len(kept), m), dtype=np.int64)
    sets = np.zeros(m, dtype=np.int64)
    done = np.zeros(m, dtype=np.int64)
    for c, (stop, choice, _) in enumerate(here):
        for e, (block, size) in enumerate(kept):
            if i == block - 1 and stop == block and kept_output_bytes(tape, i, choice):
                sets[c] |= 1 << e
            elif i == block:
                done[c] |= 1 << e
                on[2, e, c] = input_held_lift(tape, block, stop, choice, size)
    return sets, done, on


def _shared_bits(shared: list[tuple[int, tuple[int, ...], int]], start: int, stop: int,
                 choice: Choice) -> tuple[int, int]:
    """Of the shared saves ``(first, savers, bytes)``, the bits of those whose first
    block the segment ``[start, stop)`` under ``choice`` does not keep, and of those a
    later block of which it keeps (NOTE [ Releases in the DP ])."""
    kept = choice.decision is Decision.KEEP
    sets = sum(1 << e for e, (first, _, _) in enumerate(shared)
               if not kept and start <= first < stop)
    holds = sum(1 << e for e, (_, savers, _) in enumerate(shared) if kept and start in savers)
    return sets, holds


# NOTE [ Held past release in the DP ]
#     ``held_past_release`` (``peak.py``) charges a tensor that block ``first`` takes and
#     block ``window``'s forward window frees to a plan that recomputes a block from
#     ``first`` to ``window - 2``, unless blocks ``window - 1`` and ``window`` are each
#     checkpointed alone: it depends on the whole plan, and was added only to the plans
#     the DP found (``_best_final``). Pruning by the prefix's peak without it dropped the
#     plan that avoids it for one that pays it: a BudgetError named a smallest budget
#     1 KiB (the tensor) above a plan that met it, and refused a budget that plan met.
#     The charge adds to the whole step's peak, so a state must know it before it
#     compares rows by (F, cost): the DP starts from one state per set of such tensors
#     it pays for (up to :data:`_HELD_IN_STATE` of them, the largest), their bytes added
#     to every level it checks against the budget, and follows in each state what its
#     prefix decided of the others (not taken by a recomputed block yet; taken, and
#     whether block ``window - 1`` was checkpointed alone, at ``window``; settled free):
#     a move that would charge one it does not pay for is not taken. Every plan is in the
#     start that pays for exactly what it is charged, where its figures are exact; in the
#     others it pays for more, or is not found. The tensors past the cap are added to
#     the plans found, as before; a tape without them (most) has one start, and the DP
#     is what it was. The shared saves a row holds (``P``, ``C``: NOTE [ Releases in the
#     DP ]) are followed per row within each state, apart from this. A 200-block chain
#     plans about 2x slower with one such tensor, 8x with three (2 ** 3 starts).
#     ``test_held_past_release_matches_brute_force``, and with shared saves
#     ``test_held_past_release_and_shared_saves_match_brute_force``.


_HELD_IN_STATE = 3  # held-past-release tensors the DP's states follow; predict_peak counts all
_UNTAKEN, _TAKEN, _TAKEN_ALONE, _FREE, _PAID = range(5)  # what a state knows of one

_State = tuple[int, Decision, int]  # (block index, what the block before is seen as,
# held status id: NOTE [ Held past release in the DP ])


class _Held:
    """The held-past-release tensors the DP's states follow and their statuses, by id
    (NOTE [ Held past release in the DP ]); a status is one code per tensor."""

    def __init__(self, tape: Tape) -> None:
        entries = [(first, window, size)
                   for first, (window,), size in block_entries(tape.held_past_release)
                   if size > 0 and first <= window - 2]
        entries.sort(key=lambda e: (-e[2], e[0], e[1]))
        self.entries = entries[:_HELD_IN_STATE]
        self.statuses: list[tuple[int, ...]] = []
        self.index: dict[tuple[int, ...], int] = {}
        for paid in itertools.product((_UNTAKEN, _PAID), repeat=len(self.entries)):
            self._id(paid)  # the starts: 0 pays for none
        self.width = 5 ** len(self.entries)  # more ids than statuses
        self._moved: dict[tuple[int, int, int], tuple[np.ndarray, int]] = {}

    def starts(self) -> range:
        """The status ids the DP starts from."""
        return range(2 ** len(self.entries))

    def ids(self) -> range:
        """Every status id met so far, in the order they were met."""
        return range(len(self.statuses))

    def charged(self, status: int) -> int:
        """The bytes a state of ``status`` pays for, added to every level it checks."""
        return sum(size for (_, _, size), code in zip(self.entries, self.statuses[status],
                                                      strict=True) if code == _PAID)

    def settled(self, status: int) -> bool:
        """Whether a plan that ends in ``status`` is charged no tensor it does not pay
        for (none is left taken: one freed past the chain's end)."""
        return _TAKEN not in self.statuses[status] and \
            _TAKEN_ALONE not in self.statuses[status]

    def moved(self, status: int, i: int,
              steps: list[tuple[int, Choice]]) -> tuple[np.ndarray, int]:
        """Per move from block ``i`` (``(stop, choice)``), the status id it leads to (-1:
        it would be charged a tensor ``status`` does not pay for), and the bytes paid."""
        if not self.entries:
            return np.zeros(len(steps), dtype=np.int64), 0
        key = (status, i, id(steps))
        found = self._moved.get(key)
        if found is None:
            after = [self._next(self.statuses[status], i, stop, choice)
                     for stop, choice in steps]
            found = (np.array([-1 if a is None else self._id(a) for a in after],
                              dtype=np.int64), self.charged(status))
            self._moved[key] = found
        return found

    def _id(self, status: tuple[int, ...]) -> int:
        found = self.index.get(status)
        if found is None:
            found = self.index[status] = len(self.statuses)
            self.statuses.append(status)
        return found

    def _next(self, status: tuple[int, ...], start: int, stop: int,
              choice: Choice) -> tuple[int, ...] | None:
        """``status`` after segment ``[start, stop)`` under ``choice``, as
        ``held_past_release`` counts each tensor once the plan is whole; ``None`` where
        that charges one it does not pay for."""
        recomputes = choice.decision.recomputes
        alone = choice.decision is Decision.RECOMPUTE and stop == start + 1
        out = []
        for (first, window, _), code in zip(self.entries, status, strict=True):
            if code >= _FREE:
                out.append(code)
                continue
            taken = code != _UNTAKEN or (recomputes and start <= window - 2
                                         and stop - 1 >= first)
            if not taken:  # free once every block up to window - 2 is decided
                out.append(_FREE if stop >= window - 1 else _UNTAKEN)
            elif stop < window:
                out.append(_TAKEN)
            elif stop == window:  # did it end with block window - 1 checkpointed alone?
                out.append(_TAKEN_ALONE if alone else _TAKEN)
            elif alone and start == window and code == _TAKEN_ALONE:
                out.append(_FREE)  # blocks window - 1 and window each checkpointed alone
            else:
                return None
        return tuple(out)


def _start(tape: Tape) -> _Frontier:
    """The one state before the first block: the stem's level and peak, seen as kept."""
    none = np.array([-1])
    return _Frontier(F=np.array([tape.pre.delta_bytes], dtype=np.int64),
                     cost=np.array([0], dtype=np.int64),
                     peak=np.array([tape.pre.peak_bytes], dtype=np.int64),
                     E=np.array([0], dtype=np.int64),
                     P=np.array([0], dtype=np.int64),
                     H=np.zeros((1, len(_ORDER)), dtype=np.int64),
                     Q=np.array([0], dtype=np.int64), prev=none, move=none,
                     from_index=none, from_seen=none, from_status=none)


def _extend(cur: _Frontier, moves: _Moves, i: int, prev: Decision, budget: float,
            incoming: dict[_State, list[_Part]], held: _Held, status: int,
            shared_bytes: Sequence[int] = ()) -> None:
    """Every row of ``cur`` (state ``(i, prev, status)``) by every move that fits
    ``budget`` (with what the plan holds past its release, as far as the target state
    knows it: NOTE [ Held past release in the DP ]); the rows that fit go to
    ``incoming``, grouped by target state. ``shared_bytes``: the bytes of each shared
    save the rows' bits name."""
    F = cur.F[:, None]  # (rows, 1) against (moves,)
    # NOTE [ Saves shared by calls of a layer ] in peak.py: a kept later block of a save
    # whose first block the prefix did not keep holds it from the forward's end on
    hit = cur.P[:, None] & moves.holds  # (rows, moves)
    charge = np.zeros(hit.shape, dtype=np.int64)
    if hit.any():
        for e, size in enumerate(shared_bytes):
            charge += ((hit >> e) & 1) * size
    released = cur.E[:, None] + moves.rel - charge  # NOTE [ Releases in the DP ]
    # NOTE [ Inputs the model frees later in the chain ] in peak.py: by whether the row
    # holds each input of a block before the segment
    extra = np.zeros((3, *hit.shape), dtype=np.int64)
    for e in range(moves.later_on.shape[1]):
        if moves.later_on[:, e].any() or moves.later_off[:, e].any():
            bit = ((cur.Q >> e) & 1)[None, :, None]
            extra += np.where(bit == 1, moves.later_on[:, e][:, None, :],
                              moves.later_off[:, e][:, None, :])
    peak = np.maximum(np.maximum(cur.peak[:, None], F + moves.fwd + extra[0]),
                      F + moves.bwd + extra[2] - released)
    if i == 0:
        peak = np.maximum(peak, moves.first)
    next_status, charged = held.moved(status, i, moves.steps)
    rows, cols = np.nonzero((peak + charged <= budget) & (next_status >= 0))
    if rows.size == 0:
        return
    # (stop, seen, status), ordered
    targets = (moves.stop[cols] * 256 + moves.seen[cols]) * held.width + next_status[cols]
    order = np.argsort(targets, kind="stable")
    rows, cols, targets = rows[order], cols[order], targets[order]
    F_new = cur.F[rows] + moves.hold[cols] + extra[1][rows, cols]
    cost_new = cur.cost[rows] + moves.cost[cols]
    peak_new = peak[rows, cols]
    E_new = released[rows, cols]
    H_new = cur.H[rows] + moves.over[:, cols].T
    P_new = (cur.P[rows] & ~moves.holds[cols]) | moves.sets[cols]
    Q_new = (cur.Q[rows] & ~moves.later_done[cols]) | moves.later_sets[cols]
    edges = [0, *(np.flatnonzero(np.diff(targets)) + 1).tolist(), len(targets)]
    for a, b in itertools.pairwise(edges):  # one group per target state (views)
        c0 = cols[a]
        stop, as_seen = int(moves.stop[c0]), _ORDER[int(moves.seen[c0])]
        incoming.setdefault((stop, as_seen, int(next_status[c0])), []).append(_Part(
            F=F_new[a:b], cost=cost_new[a:b], peak=peak_new[a:b], E=E_new[a:b],
            P=P_new[a:b], H=H_new[a:b], Q=Q_new[a:b], prev=rows[a:b], move=cols[a:b],
            from_index=i, from_seen=_RANK[prev], from_status=status))


def solve(tape: Tape, budget_bytes: int | None, *, objective: str = "cost",
          options: ExtraOptions | None = None,
          max_segment: int | None = None) -> ChainSolution:
    """Exact DP over segmentations: the best plan whose predicted peak fits ``budget_bytes``.

    Args:
        objective: ``"cost"`` (least recompute FLOPs under the budget) or ``"peak"``
            (the smallest predicted peak, ignoring cost; used to report the least
            feasible budget).
        options: per block, extra single-block options (selective save-sets, see
            ``selective_options``).
        max_segment: cap on blocks per multi-block segment (None = no cap).

    Raises:
        BudgetError: nothing fits ``budget_bytes``; it states the smallest budget that
            does (with the same options), as ``min_feasible_bytes``.
    """
    n = len(tape.blocks)
    budget = np.inf if budget_bytes is None else float(budget_bytes)
    keep_all = tuple((i, i + 1, KEEP) for i in range(n))
    kept_peak = predict_peak(tape, keep_all)
    if objective == "cost" and kept_peak <= budget:
        # costs nothing: the best plan whenever it fits, which the DP below, counting
        # what a plan releases when the forward returns at the least any plan does
        # (NOTE [ Released when the forward returns ]), may not see
        return ChainSolution(keep_all, 0, kept_peak)
    seen = tape.window_decisions
    moves = _all_moves(tape, options, max_segment)
    shared_bytes = [size for _, _, size in shared_saves(tape)[:_MAX_SHARED]]

    # A state is (index, what the block before it is seen as); each holds a Pareto
    # frontier. NOTE [ Who frees a boundary tensor ]: a block's output is freed in the
    # backward of the last block that holds it, the producer (kept, saving its output)
    # or the consumer. So the leftovers after block j's backward depend on block j's own
    # decision (known when the segment is chosen), and the head's on the last block's.
    # A state also holds what the plan's prefix decides of the tensors held past their
    # release it follows (NOTE [ Held past release in the DP ]): status 0 where none.
    held = _Held(tape)
    frontier: dict[_State, _Frontier] = {(0, Decision.KEEP, status): _start(tape)
                                         for status in held.starts()}
    incoming: dict[_State, list[_Part]] = {}
    for i in range(n):
        for prev in seen:
            for status in held.ids():
                cur = frontier.get((i, prev, status))
                if cur is not None:
                    _extend(cur, moves[i][prev], i, prev, budget, incoming, held, status,
                            shared_bytes)
        for decision in seen:
            for status in held.ids():
                parts = incoming.pop((i + 1, decision, status), None)
                if parts:
                    frontier[(i + 1, decision, status)] = _prune(parts, objective)

    finals = []
    for last in seen:
        for status in held.ids():
            f = frontier.get((n, last, status))
            if f is None or not held.settled(status):
                continue
            peak = np.maximum(f.peak, f.F + _post_peaks(tape, last, f.E,
                                                        f.H[:, _RANK[last]])) + \
                held.charged(status)
            for found in np.nonzero(peak <= budget)[0]:
                finals.append((int(f.cost[found]), int(peak[found]), _RANK[last], status,
                               int(found)))
    best = _best_final(tape, frontier, moves, finals, budget, objective)
    if objective == "peak" and kept_peak <= budget and (
            best is None or kept_peak <= best.peak_bytes):
        # what keeping every block releases, the DP may not see (as above): it reached
        # no smaller peak (a LeViT's BudgetError named a smallest budget 4 KiB above
        # what keeping every block predicts)
        return ChainSolution(keep_all, 0, kept_peak)
    if best is None:
        internal_assert(budget_bytes is not None, "no plan of the chain without a budget")
        least = solve(tape, None, objective="peak", options=options, max_segment=max_segment)
        if least.peak_bytes <= budget:
            # the search keeps rows by the peak of their prefix without what a plan holds
            # beyond its windows, which is added to the plans it finds (_best_final): it
            # may drop the one that fits, which the least-peak search finds. A budget at
            # the smallest feasible one gets that plan, not a BudgetError naming it
            return least
        raise BudgetError(
            f"no plan fits the budget of {format_bytes(budget_bytes or 0)}. The smallest "
            f"feasible budget is {format_bytes(least.peak_bytes)} ({least.peak_bytes} bytes), "
            "reached by strategy 'optimal'; use a budget of at least that, a smaller batch, "
            "or also offload/shard", min_feasible_bytes=least.peak_bytes, strategy="optimal")
    return best


def _best_final(tape: Tape, frontier: dict[_State, _Frontier],
                moves: list[dict[Decision, _Moves]],
                finals: list[tuple[int, int, int, int, int]], budget: float,
                objective: str) -> ChainSolution | None:
    """The best of the DP's final rows ``(cost, peak, rank of the last decision, held
    status, row)`` whose plan's own prediction fits ``budget``: what it holds past its
    release (NOTE [ Tensors blocks take that die later in the chain ]) beyond the
    tensors the states follow (NOTE [ Held past release in the DP ]) depends on the
    whole plan, so each row's plan is predicted as backtracked, in the order of the
    objective, until no later row can be better (``None``: none fits). Until 2026-11-29
    (sixteenth session) every row was charged all of it, and the smallest feasible
    budget was that much above the least."""
    def key(cost: int, peak: int) -> tuple[int, int]:
        return (cost, peak) if objective == "cost" else (peak, cost)

    finals.sort(key=lambda final: (*key(final[0], final[1]), final[2], final[3], final[4]))
    best: ChainSolution | None = None
    for cost, peak, rank, status, row in finals:
        if best is not None and key(cost, peak) >= key(best.cost, best.peak_bytes):
            break  # (a row's plan predicts no less than its figures in the start that
            # pays for what it is charged, which sort no later: no later row is better)
        segments = _backtrack(frontier, moves, (len(tape.blocks), _ORDER[rank], status), row)
        # (the solver's levels leave out the tensors kept blocks save for blocks after
        # the next, NOTE [ Tensors a block saves that a later block takes ] in
        # _profile/runs.py, and net what its blocks hold on and let go of when the
        # forward returns, released_post_peak: the plan's own prediction counts both)
        top = predict_peak(tape, segments)
        if top <= budget and (best is None or key(cost, top) < key(best.cost, best.peak_bytes)):
            best = ChainSolution(segments, cost, top)
    return best


def _post_peaks(tape: Tape, last: Decision, E: np.ndarray, H: np.ndarray) -> np.ndarray:
    """The post window's peak above ``F_n`` for rows that release ``E`` beyond the least
    when the forward returns (``post_window`` with the plan's releases, NOTE [ Releases
    in the DP ]) and hold ``H`` more in the levels before the backward starts than the
    uniform step of ``last`` did (the sum of their blocks' shortfalls, each at least 0,
    as ``post_window`` counts them)."""
    extra = post_window(tape, last).delta_bytes - tape.post[last].delta_bytes  # at least
    return released_post_peak(tape, last, extra - E, H)


def _backtrack(frontier: dict[_State, _Frontier],
               moves: list[dict[Decision, _Moves]], state: _State,
               row: int) -> tuple[tuple[int, int, Choice], ...]:
    """The segments of the plan that ends at ``row`` of ``state``, by its back-pointers."""
    segments: list[tuple[int, int, Choice]] = []
    while state[0] > 0:
        f = frontier[state]
        start, move = int(f.from_index[row]), int(f.move[row])
        prev_seen, status = _ORDER[int(f.from_seen[row])], int(f.from_status[row])
        stop, choice = moves[start][prev_seen].steps[move]
        internal_assert(stop == state[0], "back-pointer mismatch")
        segments.append((start, stop, choice))
        row = int(f.prev[row])
        state = (start, prev_seen, status)
    segments.reverse()
    return tuple(segments)


def _prune(parts: list[_Part], objective: str) -> _Frontier:
    """Pareto frontier of (F, objective) over the candidate rows; deterministic order."""
    sizes = [len(p.F) for p in parts]
    F = np.concatenate([p.F for p in parts])
    cost = np.concatenate([p.cost for p in parts])
    peak = np.concatenate([p.peak for p in parts])
    E = np.concatenate([p.E for p in parts])
    P = np.concatenate([p.P for p in parts])
    H = np.concatenate([p.H for p in parts])
    Q = np.concatenate([p.Q for p in parts])
    primary = cost if objective == "cost" else peak
    secondary = peak if objective == "cost" else cost
    # Candidates arrive in a deterministic order (by source index), and the sort is
    # stable, so remaining ties go to the earliest segment boundary.
    order = np.lexsort((-E, secondary, primary, F))
    if P.min() == P.max() and Q.min() == Q.max():
        sel = _pareto(order, primary, E, F, H)
    else:  # NOTE [ Saves shared by calls of a layer ] in peak.py: a row dominates only
        # rows that may come to hold as much of the shared saves past the forward, and
        # the same inputs the model frees later in the chain (NOTE [ Inputs the model
        # frees later in the chain ])
        group = np.unique(np.stack([P, Q]), axis=1, return_inverse=True)[1].reshape(-1)
        picked = np.concatenate([_pareto(order[group[order] == g], primary, E, F, H)
                                 for g in range(int(group.max()) + 1)])
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))
        sel = picked[np.argsort(rank[picked], kind="stable")]
    # one source state per part: expand its scalars to its rows, then select
    return _Frontier(
        F=F[sel], cost=cost[sel], peak=peak[sel], E=E[sel], P=P[sel], H=H[sel], Q=Q[sel],
        prev=np.concatenate([p.prev for p in parts])[sel],
        move=np.concatenate([p.move for p in parts])[sel],
        from_index=np.repeat(np.array([p.from_index for p in parts]), sizes)[sel],
        from_seen=np.repeat(np.array([p.from_seen for p in parts]), sizes)[sel],
        from_status=np.repeat(np.array([p.from_status for p in parts]), sizes)[sel])


def _pareto(order: np.ndarray, primary: np.ndarray, E: np.ndarray,
            F: np.ndarray, H: np.ndarray) -> np.ndarray:
    """The rows of ``order`` (by F ascending, then objective, then release descending)
    on the Pareto frontier of (F, objective), and of release and what the post window
    holds more (``H``) where those differ; thinned past :data:`_MAX_FRONTIER` rows."""
    ranked = primary[order]
    if (H[order] != H[order[:1]]).any():  # NOTE [ Releases in the DP ]
        sel = _pareto_with_holds(order, ranked, F[order], E[order], H[order])
    elif E[order].min() == E[order].max():
        # By F ascending, keep a row only if it beats every row of smaller (or equal) F.
        best_before = np.concatenate(([np.inf], np.minimum.accumulate(ranked)[:-1]))
        sel = order[ranked < best_before]
    else:  # NOTE [ Releases in the DP ]: also kept where it releases more
        sel = _pareto_with_releases(order, ranked, E[order])
    if len(sel) > _MAX_FRONTIER:
        sel = _thin(sel, F, primary)
    return sel


def _pareto_with_releases(order: np.ndarray, ranked: np.ndarray,
                          released: np.ndarray) -> np.ndarray:
    """The rows of ``order`` (by F ascending, then objective, then release descending)
    that no earlier row dominates: one of no larger objective (``ranked``) and no smaller
    release (``released``); in the order given. Releases are compared by level, at most
    :data:`_RELEASE_LEVELS` of them (exact where they take no more values; else
    quantiles, and a row may fall to one that releases a little less: the plan found
    still fits, as under NOTE [ Large frontiers ])."""
    level = _release_levels(released)
    keep = np.zeros(len(order), dtype=bool)
    for floor in range(int(level.max()), -1, -1):
        pool = np.flatnonzero(level >= floor)  # rows that release at least this level
        ranks = ranked[pool]
        best_before = np.concatenate(([np.inf], np.minimum.accumulate(ranks)[:-1]))
        best = pool[ranks < best_before]
        keep[best[level[best] == floor]] = True
    return order[keep]


def _release_levels(released: np.ndarray) -> np.ndarray:
    """The level of each release, among at most :data:`_RELEASE_LEVELS` (quantiles of
    the values where they take more)."""
    levels = np.unique(released)
    if len(levels) > _RELEASE_LEVELS:
        levels = levels[np.linspace(0, len(levels) - 1, _RELEASE_LEVELS).round().astype(int)]
    return np.searchsorted(levels, released, side="right") - 1


def _pareto_with_holds(order: np.ndarray, ranked: np.ndarray, F: np.ndarray,
                       released: np.ndarray, holds: np.ndarray) -> np.ndarray:
    """The rows of ``order`` (by F ascending, then objective, then release descending)
    that no earlier row dominates, in the order given: one of no larger objective
    (``ranked``) and no larger level at any point of the rest of the plan: ``F`` in the
    forward, ``F`` less its release in the backward, ``F`` and what it holds in the post
    window before the backward starts (``holds``, one per last decision) there, the
    same later moves added to both (NOTE [ Releases in the DP ])."""
    after = F - released
    varies = (holds != holds[:1]).any(axis=0)
    before = F[:, None] + holds[:, varies]
    kept = np.zeros(0, dtype=np.int64)
    for lo in range(0, len(order), _CHUNK):
        # (dominance is transitive: a row dominated by an earlier one is dominated by
        # one kept, or by one in its chunk)
        here = np.arange(lo, min(lo + _CHUNK, len(order)))
        by = np.concatenate([kept, here])
        worse = (ranked[by, None] <= ranked[None, here]) & \
            (after[by, None] <= after[None, here]) & (by[:, None] < here[None, :])
        for column in before.T:
            worse &= column[by, None] <= column[None, here]
        kept = np.concatenate([kept, here[~worse.any(axis=0)]])
    return order[kept]


_CHUNK = 256  # rows compared at once by _pareto_with_holds


_RELEASE_LEVELS = 16  # NOTE [ Releases in the DP ]
_MAX_FRONTIER = 128  # see NOTE [ Large frontiers ]


def _thin(sel: np.ndarray, F: np.ndarray, primary: np.ndarray) -> np.ndarray:
    """Keep the cheapest point of each of ``_MAX_FRONTIER`` equal slices of the F range,
    and the smallest-F point (so the tightest plan stays reachable).

    NOTE [ Large frontiers ]
        The frontier is exact while it has at most 128 points per state, which covers
        the brute-force tests and small models. Past that, within a
        slice of 1/128 of the F range we keep only the cheapest point: the plan found
        still fits (every check uses exact bytes) but may cost slightly more than the
        optimum. Identical blocks never get there.
    """
    values = F[sel]  # ascending
    lo, hi = int(values[0]), int(values[-1])
    width = max(1, -(-(hi - lo) // _MAX_FRONTIER))
    bucket = (values - lo) // width
    # the cheapest in each (the last, where the objective falls as F grows; not so
    # where rows differ in what they release: NOTE [ Releases in the DP ])
    by_cost = np.lexsort((primary[sel], bucket))
    first = by_cost[np.append(True, bucket[by_cost][1:] != bucket[by_cost][:-1])]
    keep = np.zeros(len(sel), dtype=bool)
    keep[first] = True
    keep[0] = True
    return sel[keep]
