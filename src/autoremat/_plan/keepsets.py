"""Keep-sets for selective recompute: which forward ops of a block to keep, found by a MILP.

NOTE [ Keep-sets by MILP ]
    In recompute, every forward op of a checkpointed block is dispatched again in order,
    and for each one the dispatch mode may hand back the output it KEPT from forward
    (memory from forward until backward), SKIP it (hand back a placeholder: allowed only
    if nothing backward needs depends on its value) or RUN it (compute). A keep-set says
    which ops are kept and which skipped; everything else runs.

    The model is over storages, not tensors or ops, because memory and values live in
    storages. A *node* is an op that creates storage (not a view, not in-place, not
    returning a Python value, ``out_bytes > 0``). The in-place ops that write a node's
    storage are its *writers*: they run exactly when their node runs, so a node and its
    writers form one group whose cost is the sum of theirs, and whose deps are the
    storages any of them reads. Views create nothing and run on whatever their base
    holds; ``OpRecord.inputs`` already resolves them to the creating op, so they impose
    nothing. Two binaries per node, ``keep`` and ``run``; a node neither kept nor run is
    *dead* and is skipped together with its writers.

    * A node whose storage autograd saved for backward (``saved`` and ``kept_bytes > 0``)
      must be available: kept or run. A block's output is not needed unless saved too:
      checkpoint hands backward the output forward made, so its recompute is dead.
    * A run node needs each dep available. Ops that must run whatever the keep-set
      (``value_out``: Python reads their result; random ops outside any group; in-place
      ops on storages from outside the block) need their inputs available as well, and
      so do ops whose output's shape depends on their inputs' values (``nonzero``,
      ``masked_select``: :func:`_shape_from_values`) and that are no node: a ``nonzero``
      that found nothing creates no storage, so it always runs, and on a skipped
      input's placeholder it found something (Longformer's global-attention indices,
      empty in forward, 4 in recompute: "saved tensors of other shapes").
    * Random nodes and nodes with a random writer (CPU dropout is ``empty_like`` then
      ``bernoulli_`` then ``div_``) always run: their draws are handled by the dispatch
      mode (NOTE [ Our own selective contexts, and random bits ] in ``selective.py``),
      not by keeping. So do nodes with a writer that returns a Python value. Nodes
      with writers are never kept (the kept copy would be stale), nor ops whose schema
      returns an alias of an argument.
    * Keeping costs the node's ``out_bytes`` against the cap.

    The objective is the cost of the groups that run, with ``costs.op_cost`` per op
    (``flops + flops_per_byte * out_bytes + flops_per_op``; a random op copies its kept
    draw back, so the plain byte rate). A keep-set's reported cost is that of every op
    it leaves to run, views and must-run ops included, as ``costs.keep_set_cost`` but
    without the dispatch modes' per-op overhead. Among keep-sets of least cost
    a second solve picks the one with the fewest kept bytes, so a larger cap never buys
    bytes that save nothing, and the sets returned form a Pareto front.

    Running every node is always feasible (all constraints hold, nothing is kept), so a
    failed solve is a bug, never an impossible budget: the cap-0 keep-set always exists.
    HiGHS takes 2-25 ms per solve of a model's block (two solves per cap; NOTE
    [ HiGHS's options ]).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from autoremat._core.errors import RematError, internal_assert
from autoremat._measure.allocations import quiet_fds
from autoremat._measure.ops import OpRecord
from autoremat._plan.costs import CostModel, op_cost

# NOTE [ scipy on first use ]
#     scipy's optimize and sparse take about a second to import, which every ``import
#     autoremat`` (the command line's ``--help`` included) would pay for what only
#     selective options need: they are imported where a keep-set is first solved.
if TYPE_CHECKING:
    from scipy.optimize import LinearConstraint
    from scipy.sparse import csc_array

__all__ = ["KeepSet", "keep_sets"]


@dataclass(frozen=True)
class KeepSet:
    """One way to recompute a block: what to keep from forward and what to skip."""

    keep: tuple[int, ...]  # op indices whose outputs stay saved from forward (sorted)
    skip: tuple[int, ...]  # op indices not run in recompute: dead nodes and their writers
    # (sorted); every other op runs
    kept_bytes: int  # sum of out_bytes of the kept ops
    cost: int  # FLOP-equivalents of the ops that run in recompute (costs.op_cost), without
    # the dispatch modes' overhead (flops_per_sac_op per op of the block, the same for every
    # set; costs.keep_set_cost adds it)


# Ops that return an argument's storage without declaring it in their schema.
_UNDECLARED_ALIASES = frozenset({"_unsafe_view"})


@functools.cache
def _is_alias(op: str) -> bool:
    """Whether ATen overload ``op`` (``"aten.view.default"``) returns a view or an alias of
    an argument; unknown names are not."""
    parts = op.split(".")
    if len(parts) != 3:
        return False
    namespace, name, overload = parts
    if name in _UNDECLARED_ALIASES:
        return True
    try:
        func = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    except (AttributeError, RuntimeError):
        return False
    return bool(func.is_view) or any(r.alias_info is not None for r in func._schema.returns)


@dataclass(frozen=True)
class _Graph:
    """A block's storage-level dataflow, parsed once; node arrays are in node order."""

    nodes: tuple[int, ...]  # op index of each node, ascending
    writers: tuple[tuple[int, ...], ...]  # op indices of each node's in-place writers
    deps: tuple[tuple[int, ...], ...]  # node positions each node's group reads
    group_cost: np.ndarray  # (N,) FLOP-equivalents of running each group
    keep_bytes: np.ndarray  # (N,) bytes held if kept
    keepable: np.ndarray  # (N,) bool
    must_run: np.ndarray  # (N,) bool: random, or with a random or value_out writer
    available: np.ndarray  # (N,) bool: needed by backward, returned, or read by a must-run op
    op_cost: tuple[float, ...]  # FLOP-equivalents of each op of the block


def _needed(r: OpRecord) -> bool:
    """Whether backward reads a storage ``r`` created: autograd saved it (``saved``; for
    tapes that do not say, everything alive when backward started)."""
    return r.saved and r.kept_bytes > 0


@functools.cache
def _shape_from_values(op: str) -> bool:
    """Whether the op ``op`` names (``"aten.nonzero.default"``) makes an output whose
    shape depends on its inputs' values (PyTorch tags it ``dynamic_output_shape``);
    ``False`` for a name that resolves to no op here."""
    namespace, _, rest = op.partition(".")
    name, _, overload = rest.partition(".")
    try:
        func = getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")
    except (AttributeError, RuntimeError):
        return False
    return torch.Tag.dynamic_output_shape in getattr(func, "tags", ())


def _is_node(r: OpRecord) -> bool:
    return not (r.view or r.inplace or r.value_out) and r.out_bytes > 0


def _parse(ops: Sequence[OpRecord], model: CostModel) -> _Graph:
    for i, r in enumerate(ops):
        bad = [c for c in r.inputs if not 0 <= c < i]
        if bad:
            raise RematError(f"op {i} ({r.op}) lists inputs {bad}: inputs index the earlier ops "
                             f"of the block (0..{i - 1}); the tape is malformed, record it again")
        if r.inplace and not -1 <= r.target < i:
            raise RematError(f"op {i} ({r.op}) has target {r.target}: an in-place op's target "
                             f"is an earlier op (0..{i - 1}) or -1; record the tape again")
    nodes = tuple(i for i, r in enumerate(ops) if _is_node(r))
    pos = {op: k for k, op in enumerate(nodes)}
    writers: list[list[int]] = [[] for _ in nodes]
    reads_always: set[int] = set()  # nodes read by ops that run whatever the keep-set
    for i, r in enumerate(ops):
        if i in pos:
            continue
        if r.inplace and r.target in pos:
            writers[pos[r.target]].append(i)
        elif r.value_out or r.random or r.inplace or _shape_from_values(r.op):
            reads_always.update(c for c in r.inputs if c in pos)
    cost_of = tuple(op_cost(r, model) for r in ops)
    deps, group_cost, keep_bytes = [], [], []
    keepable, must_run, available = [], [], []
    for k, i in enumerate(nodes):
        r, group = ops[i], [i, *writers[k]]
        reads = {c for j in group for c in ops[j].inputs if c in pos and c != i}
        deps.append(tuple(sorted(pos[c] for c in reads)))
        group_cost.append(sum(cost_of[j] for j in group))
        keep_bytes.append(r.out_bytes)
        keepable.append(not (r.random or writers[k] or _is_alias(r.op)))
        must_run.append(r.random or any(ops[w].random or ops[w].value_out for w in writers[k]))
        available.append(i in reads_always or any(_needed(ops[j]) for j in group))
    return _Graph(nodes=nodes, writers=tuple(tuple(w) for w in writers), deps=tuple(deps),
                  group_cost=np.array(group_cost, dtype=float),
                  keep_bytes=np.array(keep_bytes, dtype=np.int64),
                  keepable=np.array(keepable, dtype=bool),
                  must_run=np.array(must_run, dtype=bool),
                  available=np.array(available, dtype=bool), op_cost=cost_of)


@dataclass(frozen=True)
class _Model:
    """A block's MILP without its cap, built once for all its caps (the cap is the upper
    bound of the last row, the memory row): ``x = [keep, run]`` over nodes. HiGHS is
    given the same matrices as when each solve built its own, so it takes the same path;
    the 14 solves of the zoo's llama and gpt2 blocks spent 50-64 ms outside HiGHS's own
    run, building them and in scipy, and 28-38 ms once they were built once."""

    a: csc_array  # the rows of NOTE [ Keep-sets by MILP ], the memory row last
    lo: np.ndarray  # their lower bounds
    hi: np.ndarray  # their upper bounds; ``hi[-1]`` is replaced by the cap
    with_cost: csc_array  # ``a`` and below it the cost row of the second solve
    lower: np.ndarray  # the variables' bounds
    upper: np.ndarray
    cost: np.ndarray  # the first solve's objective: the groups that run, scaled
    weight: np.ndarray  # the second solve's: the bytes kept, scaled

    @staticmethod
    def of(g: _Graph) -> _Model:
        from scipy.sparse import coo_array, csc_array, vstack  # NOTE [ scipy on first use ]

        n = len(g.nodes)
        keep, run = np.arange(n), np.arange(n, 2 * n)  # variable indices: x = [keep, run]
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        lo: list[float] = []
        hi: list[float] = []

        def row(coefs: list[tuple[int, float]], lower: float, upper: float) -> None:
            r = len(lo)
            for col, v in coefs:
                rows.append(r)
                cols.append(col)
                vals.append(v)
            lo.append(lower)
            hi.append(upper)

        for j in range(n):
            # [Constraint] a node is kept or run, never both
            row([(keep[j], 1.0), (run[j], 1.0)], 0.0, 1.0)
            if g.available[j]:
                # [Constraint] needed by backward, returned, or read by an op that always
                # runs: available in recompute (kept or run)
                row([(keep[j], 1.0), (run[j], 1.0)], 1.0, 2.0)
            for c in g.deps[j]:
                # [Constraint] a run node's inputs are available: keep_c + run_c >= run_j
                row([(keep[c], 1.0), (run[c], 1.0), (run[j], -1.0)], 0.0, 2.0)
        # [Constraint] memory: the kept bytes fit the cap (its bound set per solve)
        row([(keep[j], float(g.keep_bytes[j])) for j in range(n) if g.keep_bytes[j]],
            -np.inf, 0.0)
        lower = np.zeros(2 * n)
        upper = np.ones(2 * n)
        upper[keep] = g.keepable  # [Constraint] random, written in place, or an alias: not kept
        lower[run] = g.must_run  # [Constraint] random, or a random/value_out writer: always run
        scale = max(float(g.group_cost.max()), 1.0)  # objective in [0, n]: HiGHS tolerances
        cost = np.concatenate([np.zeros(n), g.group_cost / scale])
        a = csc_array(coo_array((vals, (rows, cols)), shape=(len(lo), 2 * n)))
        weight = np.concatenate([g.keep_bytes / max(float(g.keep_bytes.max()), 1.0),
                                 np.zeros(n)])
        return _Model(a=a, lo=np.array(lo), hi=np.array(hi),
                      with_cost=vstack([a, csc_array(cost[None, :])], format="csc"),
                      lower=lower, upper=upper, cost=cost, weight=weight)


def _solve(g: _Graph, m: _Model, cap: int, n_ops: int) -> tuple[np.ndarray, np.ndarray]:
    """The least-cost keep-set within ``cap`` bytes and, among those, the fewest kept bytes:
    ``(keep, run)`` as bool arrays over nodes."""
    from scipy.optimize import LinearConstraint  # NOTE [ scipy on first use ]

    n = len(g.nodes)  # x = [keep, run]
    hi = m.hi.copy()
    hi[-1] = cap
    x1 = _milp(m.cost, m.lower, m.upper, LinearConstraint(m.a, m.lo, hi), cap, n_ops)
    # Second solve: the fewest kept bytes among the least-cost keep-sets.
    best = float(m.cost @ x1)
    # [Constraint] cost no more than the least cost found
    with_cost = LinearConstraint(m.with_cost, np.append(m.lo, -np.inf),
                                 np.append(hi, best + 1e-9 * max(best, 1.0)))
    x2 = _milp(m.weight, m.lower, m.upper, with_cost, cap, n_ops, float(m.weight @ x1))
    x = x2 if g.group_cost @ x2[n:] <= g.group_cost @ x1[n:] * (1 + 1e-12) else x1
    return x[:n], x[n:]


# NOTE [ HiGHS's options ]
#     ``mip_rel_gap=0``: solved to optimality (HiGHS's absolute gap, 1e-6 of the objective
#     scaled to [0, n], still holds: random blocks of 20-120 nodes solved twice with
#     different heuristics differed in cost by 1e-8 relative, never on a model's block).
#     ``mip_heuristic_run_feasibility_jump=False``: that primal heuristic runs before every
#     root LP and found nothing the LP's rounding did not on these small problems; off, the
#     14 solves of the zoo llama's block took 117 ms instead of 164 (200-node random
#     blocks: 113-129 ms instead of 137-175). It changes HiGHS's path, not what it proves:
#     on every model's block profiled in the benchmarks (zoo, HF, held-out) the sets were
#     the same, save two tiny ones that picked another set of the same cost and bytes.
#     scipy's ``milp`` documents five options and passes the others to HiGHS verbatim
#     with a warning, which is expected here and not shown; a HiGHS without the option
#     ignores it (scipy warns that too).
#     ``objective_bound`` in the second solve: the first solve's keep-set is a solution of
#     the second, so no optimum of it has more kept bytes; with that bound (plus 1e-6 of
#     it) HiGHS prunes what cannot beat it, and still finds the optimum. A solve that finds
#     nothing under the bound (it should not) is run again without it. The zoo llama's 14
#     solves: 78 ms with it, 116 without (gpt2: 39 and 50), the same sets on every model's
#     block benchmarked, ties aside. The first solve's analogue, the keep-set of the cap
#     before (which fits a larger cap), made no difference and is not used.
_HIGHS_OPTIONS = {"mip_rel_gap": 0.0, "disp": False, "mip_heuristic_run_feasibility_jump": False}


def _milp(c: np.ndarray, lower: np.ndarray, upper: np.ndarray,
          constraints: LinearConstraint, cap: int, n_ops: int,
          bound: float | None = None) -> np.ndarray:
    """One HiGHS solve (NOTE [ HiGHS's options ]); ``bound``: the objective of a feasible
    solution, which no optimum exceeds."""
    from scipy.optimize import Bounds, milp  # NOTE [ scipy on first use ]

    options: dict[str, object] = dict(_HIGHS_OPTIONS)
    if bound is not None:
        options["objective_bound"] = bound + 1e-6 * max(abs(bound), 1.0)
    # HiGHS prints nothing with disp=False, except its internal trace, which its C++ writes
    # to stdout on some blocks ("HighsMipSolverData::transformNewIntegerFeasibleSolution
    # tmpSolver.run();"): the user would read it among the results, so both fds are shut
    with quiet_fds(1, 2), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Unrecognized options detected")
        res = milp(c, integrality=np.ones_like(c), bounds=Bounds(lower, upper),
                   constraints=constraints, options=options)
    if bound is not None and (not res.success or res.x is None):
        return _milp(c, lower, upper, constraints, cap, n_ops)  # without the bound
    if not res.success or res.x is None:
        raise RematError(
            f"HiGHS found no keep-set for a block of {n_ops} ops within {cap} bytes "
            f"(status {res.status}: {res.message}). Running every op is always feasible, so "
            f"this is a bug in autoremat: please report it with the block's tape.")
    return np.asarray(res.x > 0.5)


def _keep_set(g: _Graph, keep: np.ndarray, run: np.ndarray, cap: int) -> KeepSet:
    kept = tuple(g.nodes[k] for k in np.flatnonzero(keep))
    skip = sorted(i for k in np.flatnonzero(~keep & ~run) for i in (g.nodes[k], *g.writers[k]))
    kept_bytes = int(g.keep_bytes[keep].sum())
    internal_assert(kept_bytes <= cap, f"keep-set holds {kept_bytes} bytes over its cap {cap}")
    for j in np.flatnonzero(run):
        internal_assert(all(keep[c] or run[c] for c in g.deps[j]),
                        f"node {g.nodes[j]} runs on a skipped input")
    internal_assert(bool(np.all(keep | run | ~g.available)), "a needed node is skipped")
    dropped = set(kept) | set(skip)
    cost = sum(c for i, c in enumerate(g.op_cost) if i not in dropped)
    return KeepSet(keep=kept, skip=tuple(skip), kept_bytes=kept_bytes, cost=int(cost))


# Caps as fractions of a block's saved bytes: dense around a third, where budgets that
# halve or third the activations land (a coarser grid cost 10% more recompute FLOPs on
# GPT-2 small's shape at a budget of one third of the blocks' activations;
# benchmarks/selective_overhead.md).
CAPS = (0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.45)


def keep_sets(ops: Sequence[OpRecord], model: CostModel,
              fractions: Sequence[float] = CAPS) -> list[KeepSet]:
    """Pareto-good keep-sets of one block for selective recompute, one per memory cap.

    For each fraction ``f`` the cap is ``f`` times the bytes the block's forward leaves
    for backward (the sum of ``kept_bytes`` over ``ops``); the keep-set is the one of
    least recompute cost within the cap, and among those the one that keeps the fewest
    bytes. See NOTE [ Keep-sets by MILP ].

    Args:
        ops: the block's forward ops in dispatch order, as recorded on its tape.
        model: the rates that turn ops into FLOP-equivalents (``costs.cost_model_for``).
        fractions: caps as fractions of the block's kept bytes, each finite and >= 0.

    Returns:
        The distinct keep-sets, by ``kept_bytes`` ascending (so cost descending); ``[]``
        if the block creates no storage (nothing to keep or skip). A block with the same
        ops (times aside) under the same rates and fractions is solved once per process
        (NOTE [ Keep-sets solved once per process ]): a later call gets a new list of the
        same sets.

    Raises:
        RematError: a fraction is negative or not finite, or the tape is malformed.

    Example:
        >>> from autoremat._plan.costs import CostModel
        >>> mm = OpRecord(op="aten.mm.default", kind="matmul", out_bytes=400, flops=8000,
        ...               ms=0.0, random=False, view=False, inplace=False, kept_bytes=400,
        ...               inputs=(), target=-1, value_out=False)
        >>> relu = OpRecord(op="aten.relu.default", kind="pointwise", out_bytes=400, flops=100,
        ...                 ms=0.0, random=False, view=False, inplace=False, kept_bytes=400,
        ...                 inputs=(0,), target=-1, value_out=False)
        >>> sets = keep_sets([mm, relu], CostModel(0, 0, 0, 0, 1e11), fractions=(0.0, 0.5))
        >>> [(s.keep, s.kept_bytes, s.cost) for s in sets]
        [((), 0, 8100), ((0,), 400, 100)]

    Known limitations:
        The costs are the linear model of ``costs.py``, not measured times, and leave
        out the dispatch modes' own overhead (``flops_per_sac_op`` per op of the block,
        the same for every keep-set: the caller adds it). Views always run, also on a
        skipped base (they read no values).
    """
    for f in fractions:
        if not (math.isfinite(f) and f >= 0):
            raise RematError(f"keep_sets: fractions must be finite and >= 0, got {f!r}; pass "
                             f"fractions of the block's kept bytes, e.g. (0.1, 0.2, 0.3)")
    # NOTE [ Keep-sets solved once per process ]
    #     The sets depend on nothing but the ops (their times aside), the rates and the
    #     fractions, and HiGHS takes 2-25 ms a solve, two solves a cap: on the zoo's
    #     llama the 14 solves are 1 of the 9 plain steps a profile costs. A profile of
    #     the same shapes again (``auto`` after ``profile``, ``auto`` at several budgets,
    #     a fresh copy of the model) gets the sets solved the first time. The answer is
    #     the same; a malformed tape still raises, since a failed parse is not kept.
    untimed = tuple(dataclasses.replace(r, ms=0.0) if r.ms else r for r in ops)
    return list(_solved(untimed, model, tuple(float(f) for f in fractions)))


@functools.lru_cache(maxsize=64)  # NOTE [ Keep-sets solved once per process ]
def _solved(ops: tuple[OpRecord, ...], model: CostModel,
            fractions: tuple[float, ...]) -> tuple[KeepSet, ...]:
    g = _parse(ops, model)
    if not g.nodes:
        return ()
    total = sum(r.kept_bytes for r in ops if _needed(r))
    found: dict[tuple[tuple[int, ...], tuple[int, ...]], KeepSet] = {}
    m = _Model.of(g)
    for f in fractions:
        cap = math.floor(f * total)  # kept bytes are whole: the same sets as f * total
        s = _keep_set(g, *_solve(g, m, cap, len(ops)), cap)
        found.setdefault((s.keep, s.skip), s)
    return tuple(sorted(found.values(), key=lambda s: (s.kept_bytes, -s.cost, s.keep, s.skip)))
