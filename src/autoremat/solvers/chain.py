"""The memory model of a chain of blocks, and the exact DP that plans over it.

A plan cuts the chain into segments. Each segment is one kept block, or a run of
consecutive blocks checkpointed together (recomputed in backward from its first input).

NOTE [ The peak model ]
    The tape gives, per block, windows of the measured timeline (forward and backward,
    plain and checkpointed). Levels compose: the level at any point is the sum of the
    deltas of the windows before it. For a plan, with ``F_i`` the level when block ``i``
    starts its forward, a segment ``s = [i, j]`` contributes

    * forward:   ``F_i + fwd_s``           (the segment's forward transient)
    * holds:     ``F_{j+1} = F_i + hold_s`` (what it keeps until its backward)
    * backward:  ``F_i + hold_s + Z_j + bwd_s``, where ``Z_j`` = post.delta + the
      net leftovers (gradients, mostly) of all blocks after ``j``, which do not depend
      on the plan, and ``bwd_s`` is the segment's backward transient (recompute
      included) above the level at its start.

    plus the plan-independent ``pre``, ``post`` (``F_n + post.peak``) and ``tail``.
    A single kept or checkpointed block uses its measured windows, so the model is
    exact for "none" and "full". A multi-block segment is composed: its forward drops
    the inner boundaries ``x_k`` (no checkpoint holds them), its backward recomputes
    every block as in the plain run and then runs their plain backward windows.

NOTE [ Why a DP over (F, cost) frontiers ]
    Every constraint has the form ``F_i + c(segment) <= budget`` and the cost is a sum,
    so the only thing a prefix passes on is ``F``: the optimum is a shortest path over
    (block index, F) states. We keep, per block index, the Pareto frontier of (F, cost)
    and extend each point by every segment that starts there, vectorised with numpy.
    It is exact (no rounding of bytes), so it agrees with brute force, and a 200-block
    chain plans in well under a second. Ties in cost are broken towards the lower
    stored level, then the lower peak, then the earlier segment boundary: the same
    tape always gives the same plan. (A MILP via HiGHS would also be exact, but it
    needs a variable per segment and cannot beat this on chains.)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..costs import CostModel, cost_model_for, keep_set_cost, recompute_cost
from ..errors import internal_assert
from ..selective import is_keep_set, save_set_name, save_set_of
from ..tape import Tape, WindowMemory

__all__ = ["ChainSolution", "Option", "SegmentCost", "plan_costs", "predict_peak", "segment_cost",
           "selective_options", "solve"]

# An option for a segment: ("keep", ()) | ("recompute", ()) | ("selective", save_ops).
Option = tuple[str, tuple[str, ...]]
KEEP: Option = ("keep", ())
RECOMPUTE: Option = ("recompute", ())


@dataclass(frozen=True)
class SegmentCost:
    """What a segment does to memory and time; see NOTE [ The peak model ]."""

    fwd_peak: int  # forward transient above F_i
    hold: int  # bytes held from the end of its forward until its backward
    bwd_peak: int  # backward transient above the level at its start
    flops: int  # recompute FLOPs
    mode: str  # "K" kept or "C" checkpointed: what the next block sees as its neighbour
    cost: int = -1  # what the planner minimises (FLOP-equivalents, see costs.py); -1: flops

    @property
    def rank_cost(self) -> int:
        return self.flops if self.cost < 0 else self.cost


def _fwd(tape: Tape, k: int, key: str) -> WindowMemory:
    windows = tape.blocks[k].fwd
    return windows[key] if key in windows else windows[key[1] * 2]


def _bwd(tape: Tape, k: int, key: str) -> WindowMemory:
    windows = tape.blocks[k].bwd
    return windows[key] if key in windows else windows[key[1] * 2]


def _net(tape: Tape, k: int, mode: str) -> int:
    """Bytes block ``k`` leaves behind after its backward in a run of uniform ``mode``."""
    b = tape.blocks[k]
    key = mode * 2 if mode * 2 in b.fwd else "K" + mode
    return b.fwd[key].delta_bytes + b.bwd[key].delta_bytes


def _suffix_z(tape: Tape) -> dict[str, list[int]]:
    """``Z[mode][j]``: post.delta + net leftovers of the blocks after ``j``, when block
    ``j`` has ``mode``. See NOTE [ Who frees a boundary tensor ]."""
    n = len(tape.blocks)
    out = {}
    for mode in ("K", "C"):
        z = [0] * n
        acc = tape.post[mode].delta_bytes
        for j in range(n - 1, -1, -1):
            z[j] = acc
            acc += _net(tape, j, mode)
        out[mode] = z
    return out


def _fixed_peaks(tape: Tape, first: str) -> int:
    """Peaks that do not depend on the plan's middle: pre, and the tail."""
    tail_level = (tape.pre.delta_bytes + tape.post["K"].delta_bytes
                  + sum(_net(tape, k, "K") for k in range(len(tape.blocks))))
    return max(tape.pre.peak_bytes, tail_level + tape.tail[first].peak_bytes)


def segment_cost(tape: Tape, start: int, stop: int, option: Option = RECOMPUTE,
                 prev: str = "K") -> SegmentCost:
    """Figures of blocks ``start..stop-1`` as one segment under ``option``, after a
    block of mode ``prev`` ("K" before the first block)."""
    blocks = tape.blocks
    internal_assert(0 <= start < stop <= len(blocks), f"bad segment {start}:{stop}")
    kind = option[0]
    if kind == "keep":
        internal_assert(stop == start + 1, "a kept segment is one block")
        fwd, bwd = _fwd(tape, start, prev + "K"), _bwd(tape, start, prev + "K")
        return SegmentCost(fwd.peak_bytes, fwd.delta_bytes, bwd.peak_bytes, 0, "K")
    model = cost_model_for(tape.device)
    if kind == "selective":
        internal_assert(stop == start + 1, "a selective segment is one block")
        return _selective_cost(tape, start, option[1], prev, model)
    internal_assert(kind == "recompute", f"unknown segment option {kind!r}")
    return _segment_runs(tape, start, stop, prev)[-1]


def _block_costs(tape: Tape) -> list[int]:
    model = cost_model_for(tape.device)
    return [recompute_cost(b.op_stats, b.fwd_flops, model) for b in tape.blocks]


def _segment_runs(tape: Tape, start: int, last_stop: int, prev: str,
                  block_costs: list[int] | None = None) -> list[SegmentCost]:
    """Costs of the checkpointed segments ``[start, stop)`` for every ``stop`` up to
    ``last_stop``, built incrementally (O(length) for all of them)."""
    blocks = tape.blocks
    block_costs = block_costs if block_costs is not None else _block_costs(tape)
    out: list[SegmentCost] = []
    f_level = f_peak = 0  # forward: every block as checkpointed; inner inputs released
    r_level = r_peak = 0  # backward: recompute all blocks as in the plain forward...
    back = 0  # ...then their plain backward: max over k of (deltas after k + peak of k)
    flops = cost = 0
    for k in range(start, last_stop):
        b = blocks[k]
        cost += block_costs[k]
        window = _fwd(tape, k, (prev if k == start else "C") + "C")
        f_peak = max(f_peak, f_level + window.peak_bytes)
        f_level += window.delta_bytes
        if k > start:
            f_level -= b.chain_bytes
        if k == start:  # a single block: its measured checkpointed windows
            fwd, bwd = _fwd(tape, k, prev + "C"), _bwd(tape, k, prev + "C")
            out.append(SegmentCost(fwd.peak_bytes, fwd.delta_bytes, bwd.peak_bytes,
                                   flops + b.recompute_flops, "C", cost))
        else:
            # Blocks start..k-1 are recomputed in full (later ones need their outputs);
            # the last one stops early as a checkpointed block does, so its measured
            # checkpointed backward window (recompute included) applies; then the plain
            # backward of the others.
            last = _bwd(tape, k, "CC")
            bwd_peak = max(r_peak, r_level + last.peak_bytes,
                           r_level + last.delta_bytes + back)
            out.append(SegmentCost(f_peak, f_level, bwd_peak, flops + b.recompute_flops,
                                   "C", cost))
        flops += b.fwd_flops
        r_peak = max(r_peak, r_level + b.keep_fwd.peak_bytes)
        r_level += b.keep_fwd.delta_bytes
        back = b.keep_bwd.peak_bytes if k == start else \
            max(b.keep_bwd.peak_bytes, back + b.keep_bwd.delta_bytes)
    return out


def _selective_cost(tape: Tape, i: int, save: tuple[str, ...], prev: str,
                    model: CostModel) -> SegmentCost:
    """A selective block, measured between checkpointed neighbours; after a kept block
    we add the difference that neighbour makes to the same block fully checkpointed."""
    block = tape.blocks[i]
    name = save_set_name(save)
    internal_assert(name in block.selective, f"no selective profile {name!r} for {block.name}")
    sel = block.selective[name]
    fwd_peak, hold = sel.fwd.peak_bytes, sel.fwd.delta_bytes
    bwd_peak = sel.bwd.peak_bytes
    if i > 0 and prev != "C":
        f_here, f_ref = _fwd(tape, i, prev + "C"), _fwd(tape, i, "CC")
        b_here, b_ref = _bwd(tape, i, prev + "C"), _bwd(tape, i, "CC")
        fwd_peak += f_here.peak_bytes - f_ref.peak_bytes
        hold += f_here.delta_bytes - f_ref.delta_bytes
        bwd_peak += b_here.peak_bytes - b_ref.peak_bytes
    if is_keep_set(name):
        cost = keep_set_cost(block.ops, sel.keep_ops, sel.skip_ops, model)
    else:
        cost = recompute_cost(block.op_stats, block.fwd_flops, model, saved=save)
    return SegmentCost(fwd_peak, hold, bwd_peak, sel.recompute_flops, "C", cost)


def selective_options(tape: Tape) -> list[list[Option]]:
    """Per block, the selective options its tape measured."""
    return [[("selective", save_set_of(name)) for name in sorted(b.selective)]
            for b in tape.blocks]


def plan_costs(tape: Tape, segments: Sequence[tuple[int, int, Option]]) -> list[SegmentCost]:
    """Costs of consecutive segments, each seeing its predecessor's mode."""
    out: list[SegmentCost] = []
    prev = "K"
    for start, stop, option in segments:
        cost = segment_cost(tape, start, stop, option, prev)
        out.append(cost)
        prev = cost.mode
    return out


def predict_peak(tape: Tape, segments: Sequence[tuple[int, int, Option]]) -> int:
    """Predicted step peak of a plan given as consecutive ``(start, stop, option)``."""
    costs = plan_costs(tape, segments)
    z = _suffix_z(tape)
    level = tape.pre.delta_bytes
    peak = _fixed_peaks(tape, costs[0].mode)
    for (_start, stop, _), cost in zip(segments, costs, strict=False):
        bwd = level + cost.hold + z[cost.mode][stop - 1] + cost.bwd_peak
        peak = max(peak, level + cost.fwd_peak, bwd)
        level += cost.hold
    return max(peak, level + tape.post[costs[-1].mode].peak_bytes)


@dataclass(frozen=True)
class ChainSolution:
    segments: tuple[tuple[int, int, Option], ...]  # (start, stop, option)
    cost: int  # the planner's objective (FLOP-equivalents, see costs.py)
    peak_bytes: int


def _allowed_stops(tape: Tape, max_len: int | None) -> list[list[int]]:
    """``stops[i]``: segment ends allowed from ``i`` (multi-block only across chained links)."""
    n = len(tape.blocks)
    out = []
    for i in range(n):
        stops = [i + 1]
        j = i + 1
        while j < n and tape.blocks[j].chained and (max_len is None or j + 1 - i <= max_len):
            stops.append(j + 1)
            j += 1
        out.append(stops)
    return out


ExtraOptions = Sequence[Sequence[Option]]


def solve(tape: Tape, budget_bytes: int | None, *, objective: str = "cost",
          options: ExtraOptions | None = None,
          max_segment: int | None = None) -> ChainSolution | None:
    """Exact DP over segmentations. Returns ``None`` when nothing fits ``budget_bytes``.

    Args:
        objective: ``"cost"`` (least recompute FLOPs under the budget) or ``"peak"``
            (the smallest predicted peak, ignoring cost; used to report the least
            feasible budget).
        options: per block, extra single-block options (selective save-sets, see
            ``selective_options``).
        max_segment: cap on blocks per multi-block segment (None = no cap).
    """
    n = len(tape.blocks)
    budget = np.inf if budget_bytes is None else float(budget_bytes)
    z = _suffix_z(tape)
    stops = _allowed_stops(tape, max_segment)
    block_costs = _block_costs(tape)
    fixed = {mode: _fixed_peaks(tape, mode) for mode in ("K", "C")}
    # moves[i][prev]: the options from block i after a block of mode prev, as a list of
    # (stop, option) and arrays of their figures for the vectorised step below.
    moves: list[dict[str, tuple[list[tuple[int, Option]], dict[str, np.ndarray]]]] = []
    for i in range(n):
        by_prev = {}
        for prev in ("K", "C") if i else ("K",):
            here: list[tuple[int, Option, SegmentCost]] = [
                (i + 1, KEEP, segment_cost(tape, i, i + 1, KEEP, prev))]
            runs = _segment_runs(tape, i, stops[i][-1], prev, block_costs)
            here += [(i + 1 + k, RECOMPUTE, c) for k, c in enumerate(runs)]
            if options is not None:
                here += [(i + 1, opt, segment_cost(tape, i, i + 1, opt, prev))
                         for opt in options[i]]
            figures = {
                "stop": np.array([m[0] for m in here]),
                "mode": np.array([ord(m[2].mode) for m in here]),
                "fwd": np.array([m[2].fwd_peak for m in here], dtype=np.int64),
                "hold": np.array([m[2].hold for m in here], dtype=np.int64),
                "bwd": np.array([m[2].hold + z[m[2].mode][m[0] - 1] + m[2].bwd_peak
                                 for m in here], dtype=np.int64),
                "cost": np.array([m[2].rank_cost for m in here], dtype=np.int64),
                "first": np.array([fixed[m[2].mode] for m in here], dtype=np.int64),
            }
            by_prev[prev] = ([(m[0], m[1]) for m in here], figures)
        moves.append(by_prev)

    # A state is (index, mode of the block before it); each holds a Pareto frontier.
    # NOTE [ Who frees a boundary tensor ]: a block's output is freed in the backward of
    # the last block that holds it, the producer (kept, saving its output) or the
    # consumer. So the leftovers after block j's backward depend on block j's own mode
    # (known when the segment is chosen), and the head's on the last block's mode.
    frontier: dict[tuple[int, str], dict[str, np.ndarray]] = {
        (0, "K"): {"F": np.array([tape.pre.delta_bytes], dtype=np.int64),
                   "cost": np.array([0], dtype=np.int64),
                   "peak": np.array([tape.pre.peak_bytes], dtype=np.int64),
                   "prev": np.array([-1]), "move": np.array([-1]), "from": np.array([-1]),
                   "from_mode": np.array([-1])},
    }
    # per target state, parts: row arrays (_ROW_ARRAYS) plus the source state's scalars
    incoming: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for i in range(n):
        for prev in ("K", "C"):
            cur = frontier.get((i, prev))
            if cur is None:
                continue
            fig = moves[i][prev][1]
            F = cur["F"][:, None]  # (rows, 1) against (moves,)
            peak = np.maximum(np.maximum(cur["peak"][:, None], F + fig["fwd"]), F + fig["bwd"])
            if i == 0:
                peak = np.maximum(peak, fig["first"])
            rows, cols = np.nonzero(peak <= budget)
            if rows.size == 0:
                continue
            targets = fig["stop"][cols] * 2 + (fig["mode"][cols] == ord("C"))
            order = np.argsort(targets, kind="stable")
            rows, cols, targets = rows[order], cols[order], targets[order]
            F_new = cur["F"][rows] + fig["hold"][cols]
            cost_new = cur["cost"][rows] + fig["cost"][cols]
            peak_new = peak[rows, cols]
            edges = [0, *(np.flatnonzero(np.diff(targets)) + 1).tolist(), len(targets)]
            for a, b in itertools.pairwise(edges):  # one group per target state (views)
                c0 = cols[a]
                stop, mode = int(fig["stop"][c0]), chr(int(fig["mode"][c0]))
                incoming.setdefault((stop, mode), []).append({
                    "F": F_new[a:b], "cost": cost_new[a:b], "peak": peak_new[a:b],
                    "prev": rows[a:b], "move": cols[a:b], "from": i, "from_mode": ord(prev),
                })
        for mode in ("K", "C"):
            parts = incoming.pop((i + 1, mode), None)
            if parts:
                frontier[(i + 1, mode)] = _prune(parts, objective)

    finals = []
    for last in ("K", "C"):
        f = frontier.get((n, last))
        if f is None:
            continue
        peak = np.maximum(f["peak"], f["F"] + tape.post[last].peak_bytes)
        for found in np.nonzero(peak <= budget)[0]:
            cost, top = int(f["cost"][found]), int(peak[found])
            key = (cost, top) if objective == "cost" else (top, cost)
            finals.append((key, last, int(found), cost, top))
    if not finals:
        return None
    _, last, chosen, result_cost, result_peak = min(finals)
    segments: list[tuple[int, int, Option]] = []
    state, row = (n, last), chosen
    while state[0] > 0:
        f = frontier[state]
        start, move = int(f["from"][row]), int(f["move"][row])
        prev_mode = chr(int(f["from_mode"][row]))
        stop, opt = moves[start][prev_mode][0][move]
        internal_assert(stop == state[0], "back-pointer mismatch")
        segments.append((start, stop, opt))
        row = int(f["prev"][row])
        state = (start, prev_mode)
    segments.reverse()
    return ChainSolution(tuple(segments), result_cost, result_peak)


def _prune(parts: list[dict[str, Any]], objective: str) -> dict[str, np.ndarray]:
    """Pareto frontier of (F, objective) over the candidate rows; deterministic order."""
    sizes = [len(p["F"]) for p in parts]
    cat = {k: np.concatenate([p[k] for p in parts]) for k in _ROW_ARRAYS}
    for k in ("from", "from_mode"):  # one source state per part: expand to its rows
        cat[k] = np.repeat(np.array([p[k] for p in parts]), sizes)
    primary = cat["cost"] if objective == "cost" else cat["peak"]
    secondary = cat["peak"] if objective == "cost" else cat["cost"]
    # Candidates arrive in a deterministic order (by source index), and the sort is
    # stable, so remaining ties go to the earliest segment boundary.
    order = np.lexsort((secondary, primary, cat["F"]))
    ranked = primary[order]
    # By F ascending, keep a row only if it beats every row of smaller (or equal) F.
    best_before = np.concatenate(([np.inf], np.minimum.accumulate(ranked)[:-1]))
    sel = order[ranked < best_before]
    if len(sel) > _MAX_FRONTIER:
        sel = _thin(sel, cat["F"], primary)
    return {k: v[sel] for k, v in cat.items()}


_MAX_FRONTIER = 128  # see NOTE [ Large frontiers ]
_ROW_ARRAYS = ("F", "cost", "peak", "prev", "move")  # per-row arrays of a frontier part


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
    values = F[sel]  # ascending, with primary strictly decreasing
    lo, hi = int(values[0]), int(values[-1])
    width = max(1, -(-(hi - lo) // _MAX_FRONTIER))
    bucket = (values - lo) // width
    last_of_bucket = np.append(bucket[1:] != bucket[:-1], True)  # the cheapest in each
    keep = last_of_bucket.copy()
    keep[0] = True
    return sel[keep]
