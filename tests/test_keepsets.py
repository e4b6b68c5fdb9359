"""Tests for autoremat.solvers.keepsets: keep-sets for selective recompute by MILP.

Everything runs on hand-built ``OpRecord`` tuples (no model, no profiling):

* tiny blocks whose optimum at each cap is computed by hand in the comments (in the
  manner of torch's ``sac_ilp`` tests): an MLP chain, an attention core whose first bmm
  dies once softmax is kept, CPU dropout, a ``.item()``, outputs and in-place writes;
* agreement with a brute-force enumeration of every keep subset on random blocks of up
  to 10 nodes, including the fewest kept bytes among the least-cost sets;
* the safety of every returned set (checked independently of the solver), and speed on
  a 300-op block.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import pytest

from autoremat._core.errors import RematError
from autoremat._measure.ops import OpRecord, op_kind
from autoremat._plan.costs import CostModel
from autoremat._plan.keepsets import KeepSet, keep_sets

# Whole-number rates, so every cost below is exact: op cost = flops + bytes + 10.
MODEL = CostModel(flops_per_byte=1.0, flops_per_random_byte=100.0, flops_per_op=10.0,
                  flops_per_sac_op=1000.0, flops_per_second=1e11)


def _op(op: str, *, out: int = 0, flops: int = 0, kept: int = 0, inputs: tuple[int, ...] = (),
        random: bool = False, view: bool = False, inplace: bool = False, target: int = -1,
        saved: bool = True, value_out: bool = False) -> OpRecord:
    return OpRecord(op=op, kind=op_kind(op), out_bytes=out, flops=flops, ms=0.0, random=random,
                    view=view, inplace=inplace, kept_bytes=kept, inputs=inputs, target=target,
                    saved=saved, value_out=value_out)


def _saved_bytes(ops: Sequence[OpRecord]) -> int:
    return sum(r.kept_bytes for r in ops if r.saved)


def _summary(sets: list[KeepSet]) -> list[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
    return [(s.keep, s.skip, s.kept_bytes, s.cost) for s in sets]


# --- an independent reference: the block's dataflow, the safety check, brute force -----


def _is_node(r: OpRecord) -> bool:
    return not (r.view or r.inplace or r.value_out) and r.out_bytes > 0


_VALUE_SHAPED = {"aten.nonzero.default", "aten.masked_select.default"}  # shapes from values


class _Ref:
    """The block's storage-level dataflow, computed the plain way for the checks below."""

    def __init__(self, ops: Sequence[OpRecord], model: CostModel) -> None:
        self.ops = ops
        self.nodes = [i for i, r in enumerate(ops) if _is_node(r)]
        self.node_set = set(self.nodes)
        self.writers = {j: [i for i, r in enumerate(ops) if r.inplace and r.target == j]
                        for j in self.nodes}
        in_groups = {w for ws in self.writers.values() for w in ws}
        self.must_run_ops = [i for i, r in enumerate(ops) if i not in in_groups
                             and not _is_node(r) and (r.value_out or r.random or r.inplace
                                                      or r.op in _VALUE_SHAPED)]
        self.deps = {j: {c for g in (j, *self.writers[j]) for c in ops[g].inputs
                         if c in self.node_set and c != j} for j in self.nodes}
        self.forced = {j for j in self.nodes if ops[j].random
                       or any(ops[w].random or ops[w].value_out for w in self.writers[j])}
        self.keepable = [j for j in self.nodes if not ops[j].random and not self.writers[j]]
        self.available = {j for j in self.nodes if ops[j].saved and ops[j].kept_bytes > 0}
        self.available |= {c for m in self.must_run_ops for c in ops[m].inputs
                           if c in self.node_set}
        self.op_cost = [r.flops + model.flops_per_byte * r.out_bytes + model.flops_per_op
                        for r in ops]

    def bytes_of(self, keep: Sequence[int]) -> int:
        return sum(self.ops[j].out_bytes for j in keep)

    def least_run(self, keep: set[int]) -> set[int]:
        """The nodes a recompute must run given ``keep``: needs propagated backwards."""
        run = (self.forced | self.available) - keep
        todo = list(run)
        while todo:
            for c in self.deps[todo.pop()] - keep - run:
                run.add(c)
                todo.append(c)
        return run

    def cost_of(self, keep: set[int], run: set[int]) -> float:
        dead = set(self.nodes) - keep - run
        dropped = keep | dead | {w for j in dead for w in self.writers[j]}
        return sum(c for i, c in enumerate(self.op_cost) if i not in dropped)

    def brute_force(self, cap: float) -> tuple[float, int]:
        """(least cost, then fewest kept bytes) over every keep subset within ``cap``."""
        best = (math.inf, 0)
        for n in range(len(self.keepable) + 1):
            for keep in itertools.combinations(self.keepable, n):
                if self.bytes_of(keep) <= cap:
                    k = set(keep)
                    best = min(best, (self.cost_of(k, self.least_run(k)), self.bytes_of(keep)))
        return best

    def check(self, s: KeepSet, cap: float) -> None:
        """``s`` is safe, within ``cap``, and its fields are consistent."""
        keep, skip = set(s.keep), set(s.skip)
        assert list(s.keep) == sorted(keep) and list(s.skip) == sorted(skip)
        assert not keep & skip
        assert keep <= set(self.keepable)
        assert s.kept_bytes == self.bytes_of(s.keep) <= cap
        dead = skip & set(self.nodes)
        assert skip == dead | {w for j in dead for w in self.writers[j]}
        run = set(self.nodes) - keep - dead
        assert self.forced <= run
        assert self.available <= keep | run  # needed by backward, returned or read always
        for j in run:
            for g in (j, *self.writers[j]):
                assert not set(self.ops[g].inputs) & skip, f"op {g} runs on a skipped input"
        for m in self.must_run_ops:
            assert not set(self.ops[m].inputs) & skip, f"op {m} must run on a skipped input"
        assert s.cost == int(self.cost_of(keep, run))


def _check_all(ops: Sequence[OpRecord], fractions: Sequence[float],
               model: CostModel = MODEL) -> list[KeepSet]:
    sets = keep_sets(ops, model, fractions)
    ref, total = _Ref(ops, model), _saved_bytes(ops)
    for s in sets:
        ref.check(s, max(fractions) * total)
    # a Pareto front: more bytes always buy a strictly lower cost
    assert [s.kept_bytes for s in sets] == sorted({s.kept_bytes for s in sets})
    assert [s.cost for s in sets] == sorted({s.cost for s in sets}, reverse=True)
    return sets


# --- tiny hand-made blocks ------------------------------------------------------------


def test_mlp_chain_keeps_the_matmul_first() -> None:
    # linear -> gelu -> linear. Op costs (flops + bytes + 10): 0: 10110, 1: 910, 2: 10,
    # 3: 5060. Saved bytes 100 + 100 = 200; the output (3) is alive but not saved: dead.
    ops = [
        _op("aten.addmm.default", out=100, flops=10_000, kept=100),  # gelu saves its input
        _op("aten.gelu.default", out=100, flops=800, kept=100, inputs=(0,)),
        _op("aten.t.default", view=True),  # the weight's transpose: always runs
        _op("aten.addmm.default", out=50, flops=5000, kept=50, inputs=(1,), saved=False),
    ]
    sets = _check_all(ops, (0.0, 0.2, 0.4, 0.8, 1.0))
    assert _summary(sets) == [
        ((), (3,), 0, 10110 + 910 + 10),  # caps 0 to 80: run both; the output is skipped
        ((0,), (3,), 100, 910 + 10),  # cap 160: the matmul saves more than gelu
        ((0, 1), (3,), 200, 10),  # cap 200: only the view runs
    ]


def test_kept_softmax_makes_the_bmm_before_it_dead() -> None:
    # bmm -> softmax -> bmm. Softmax saves its output; the scores are not saved; the last
    # bmm's output is (by the projection after it). Op costs: 0: 40410, 1: 2410, 2: 20210.
    # Saved bytes 400 + 200 = 600.
    ops = [
        _op("aten.bmm.default", out=400, flops=40_000),
        _op("aten._softmax.default", out=400, flops=2000, kept=400, inputs=(0,)),
        _op("aten.bmm.default", out=200, flops=20_000, kept=200, inputs=(1,)),
    ]
    sets = _check_all(ops, (0.0, 0.5, 0.7))
    assert _summary(sets) == [
        ((), (), 0, 40410 + 2410 + 20210),  # cap 0: run everything
        ((2,), (), 200, 40410 + 2410),  # cap 300: only the last bmm's output fits
        ((1,), (0,), 400, 20210),  # cap 420: keeping softmax beats keeping the first bmm
        # (also 400 bytes, but softmax still to run), and that bmm is then skipped
    ]


def _dropout_block() -> list[OpRecord]:
    # linear -> CPU dropout (empty_like, bernoulli_, div_, mul) -> linear (returned).
    # Op costs: 0: 10110, 1: 110, 2: 110 (a copied draw: the plain byte rate), 3: 10,
    # 4: 110, 5: 5060. Kept: the mask (100) and the dropout output (100, for linear 5).
    return [
        _op("aten.addmm.default", out=100, flops=10_000),
        _op("aten.empty_like.default", out=100, kept=100),  # reads metadata only
        _op("aten.bernoulli_.float", out=100, random=True, inplace=True, target=1, inputs=(1,)),
        _op("aten.div_.Scalar", inplace=True, target=1, inputs=(1,)),
        _op("aten.mul.Tensor", out=100, kept=100, inputs=(0, 1)),
        _op("aten.addmm.default", out=50, flops=5000, kept=50, inputs=(4,), saved=False),
    ]


def test_dropout_group_always_runs_and_is_never_kept() -> None:
    sets = _check_all(_dropout_block(), (0.0, 0.5, 1.0))
    assert _summary(sets) == [
        ((), (5,), 0, 10110 + 230 + 110),  # cap 0: the mul runs, so the linear runs; the
        # output (not saved) is dead
        ((4,), (0, 5), 100, 230),  # cap 100: keep the mul (230 < keep linear: 340); the
        # linear is dead. Cap 200 keeps nothing more: the linear would save nothing.
    ]
    for s in sets:
        assert not {1, 2, 3} & set(s.keep + s.skip)


def test_random_node_and_write_to_a_block_input_always_run() -> None:
    # rand_like is a random node: never kept, always run. add_ writes a block input
    # (target -1): it always runs, so what it reads must be available.
    ops = [
        _op("aten.rand_like.default", out=100, random=True),  # cost 110
        _op("aten.mul.Tensor", out=100, flops=500, inputs=(0,)),  # cost 610
        _op("aten.add_.Tensor", inplace=True, inputs=(1,)),  # cost 10, target -1
        _op("aten.relu.default", out=100, flops=50, kept=100),  # cost 160
    ]
    sets = _check_all(ops, (0.0, 1.0))
    assert _summary(sets) == [
        ((), (), 0, 110 + 610 + 10 + 160),
        ((1,), (), 100, 110 + 10 + 160),  # cap 100: the mul (610) beats the relu (160)
    ]


def test_value_out_forces_its_input() -> None:
    # x * y -> sum -> .item() (Python reads it: it runs on real inputs), beside a kept op.
    # Op costs: 0: 210, 1: 114, 2: 10, 3: 1110, 4: 110. Kept bytes: 100 (op 3).
    ops = [
        _op("aten.mul.Tensor", out=100, flops=100),
        _op("aten.sum.default", out=4, flops=100, inputs=(0,)),
        _op("aten._local_scalar_dense.default", inputs=(1,), value_out=True),
        _op("aten.mul.Tensor", out=100, flops=1000, kept=100),
        _op("aten.relu.default", out=100, kept=100, inputs=(3,), saved=False),  # returned
    ]
    sets = _check_all(ops, (0.0, 0.1, 1.0, 1.04))
    assert _summary(sets) == [
        ((), (4,), 0, 210 + 114 + 10 + 1110),  # cap 0: the sum runs, so the mul before it
        ((1,), (0, 4), 4, 10 + 1110),  # cap 10: keep the sum; its input is dead
        ((3,), (4,), 100, 210 + 114 + 10),  # cap 100: op 3 saves more than the sum
        ((1, 3), (0, 4), 104, 10),  # cap 104: both
    ]
    for s in sets:
        assert 2 not in s.skip


def test_outputs_autograd_did_not_save_are_dead_with_their_writers() -> None:
    ops = [
        _op("aten.mm.default", out=1000, flops=10_000, kept=1000, saved=False),  # returned
        _op("aten.mm.default", out=1000, flops=10_000, kept=1000, saved=False),  # returned
        _op("aten.add_.Tensor", inplace=True, target=1, inputs=(0, 1)),  # cost 10
    ]
    # Alive when backward starts (the next block holds them), but backward does not read
    # them: nothing runs, whatever the cap.
    assert _summary(_check_all(ops, (0.0, 0.5, 1.0))) == [((), (0, 1, 2), 0, 0)]


def test_dead_node_skips_its_writers_too() -> None:
    # 0 is written in place (never kept), read only by 2; keeping 2 leaves 0 and its
    # writer dead. Op costs: 0: 1110, 1: 10, 2: 160.
    ops = [
        _op("aten.mul.Tensor", out=100, flops=1000),
        _op("aten.mul_.Scalar", inplace=True, target=0, inputs=(0,)),
        _op("aten.relu.default", out=100, flops=50, kept=100, inputs=(0,)),
    ]
    assert _summary(_check_all(ops, (0.0, 1.0))) == [
        ((), (), 0, 1110 + 10 + 160),
        ((2,), (0, 1), 100, 0),
    ]


def test_a_node_written_through_unsafe_chunk_pieces_is_never_kept() -> None:
    # addmm -> unsafe_chunk -> sigmoid_ and tanh_ on the pieces, as recorded (CPU nn.GRU's
    # gates): the pieces are no views (no version counter shared with the addmm output),
    # but they write its storage, so the writes are the addmm's writers and a kept copy
    # would be stale (NOTE [ Writes through unsafe pieces ] in selective.py)
    ops = [
        _op("aten.t.default", view=True),
        _op("aten.addmm.default", out=256, flops=4096, kept=256),
        _op("aten.unsafe_split.Tensor", inputs=(1,)),
        _op("aten.sigmoid_.default", inplace=True, target=1, inputs=(1,)),
        _op("aten.tanh_.default", inplace=True, target=1, inputs=(1,)),
        _op("aten.mul.Tensor", out=128, flops=32, inputs=(1,), saved=False),
        _op("aten.add.Tensor", out=128, flops=32, kept=128, inputs=(5,), saved=False),
    ]
    sets = _check_all(ops, (0.0, 0.5, 1.0, 2.0))
    assert sets and all(1 not in s.keep for s in sets), _summary(sets)
    assert all(not {1, 3, 4} & set(s.skip) for s in sets)  # backward reads the addmm


def test_a_writer_python_reads_makes_its_node_run() -> None:
    # An in-place op whose result Python reads must run, so its storage's creator runs
    # (and is not kept: it is written in place), although backward needs neither.
    ops = [
        _op("aten.mul.Tensor", out=100, flops=1000),  # cost 1110
        _op("aten.add_.Tensor", inplace=True, target=0, inputs=(0,), value_out=True),  # 10
    ]
    assert _summary(_check_all(ops, (0.0, 1.0))) == [((), (), 0, 1120)]


def test_an_op_whose_shape_comes_from_values_reads_its_inputs_as_they_were() -> None:
    # Longformer: a nonzero that found nothing creates no storage (no node), so it runs
    # in every recompute; on placeholders for the comparisons it reads, it found 4 and
    # the block's saved tensors changed shape. Its inputs run, as for Python's reads.
    ops = [
        _op("aten.lt.Tensor", out=4, flops=4, saved=False),
        _op("aten.eq.Scalar", out=4, flops=4, inputs=(0,), saved=False),
        _op("aten.nonzero.default", out=0, inputs=(1,), kept=0),  # index backward reads
        _op("aten.mm.default", out=400, flops=8000, kept=400),
    ]
    sets = _check_all(ops, (0.0, 1.0))
    assert sets and all(not {0, 1} & set(s.skip) for s in sets), _summary(sets)
    # the same ops without the value-shaped read: the comparisons are dead
    plain = [*ops[:2], _op("aten.view.default", view=True, inputs=(1,)), ops[3]]
    assert all({0, 1} <= set(s.skip) for s in keep_sets(plain, MODEL, (0.0, 1.0)))


def test_no_nodes_and_bad_arguments() -> None:
    assert keep_sets([_op("aten.t.default", view=True)], MODEL) == []
    with pytest.raises(RematError, match=r"fractions must be finite and >= 0, got -0\.1"):
        keep_sets([_op("aten.relu.default", out=4)], MODEL, (0.1, -0.1))
    with pytest.raises(RematError, match=r"op 1 \(aten.relu.default\) lists inputs \[1\]"):
        keep_sets([_op("aten.relu.default", out=4), _op("aten.relu.default", out=4,
                                                         inputs=(1,))], MODEL)
    with pytest.raises(RematError, match="has target 3"):
        keep_sets([_op("aten.relu.default", out=4),
                   _op("aten.add_.Tensor", inplace=True, target=3)], MODEL)


def test_a_block_is_solved_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Keep-sets solved once per process ]: the same ops (times aside), rates and
    # fractions get the sets solved the first time, in a new list; anything else differing
    # is solved again, and a malformed tape raises every time
    from autoremat._plan import keepsets

    keepsets._solved.cache_clear()
    solves: list[int] = []
    milp = keepsets._milp
    def counted(*args: Any) -> Any:
        solves.append(1)
        return milp(*args)

    monkeypatch.setattr(keepsets, "_milp", counted)
    ops = [_op("aten.addmm.default", out=100, flops=10_007, kept=100),
           _op("aten.gelu.default", out=100, flops=803, kept=100, inputs=(0,)),
           _op("aten.addmm.default", out=50, flops=5_009, kept=0, inputs=(1,))]
    first = keep_sets(ops, MODEL, (0.5, 1.0))
    assert len(solves) == 4 and first
    timed = [dataclasses.replace(r, ms=1.5 + i) for i, r in enumerate(ops)]
    again = keep_sets(timed, MODEL, [0.5, 1.0])
    assert again == first and again is not first and len(solves) == 4
    again.clear()
    assert keep_sets(ops, MODEL, (0.5, 1.0)) == first  # the caller's list was its own
    keep_sets(ops, dataclasses.replace(MODEL, flops_per_op=11.0), (0.5, 1.0))
    keep_sets(ops, MODEL, (0.5,))
    keep_sets([*ops[:2], dataclasses.replace(ops[2], flops=5_010)], MODEL, (0.5, 1.0))
    assert len(solves) == 4 + 4 + 2 + 4
    bad = [*ops, _op("aten.relu.default", out=4, inputs=(5,))]
    for _ in range(2):
        with pytest.raises(RematError, match=r"op 3 \(aten.relu.default\) lists inputs \[5\]"):
            keep_sets(bad, MODEL, (0.5, 1.0))


def test_highs_gets_its_options_and_the_caller_no_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ HiGHS's options ]: the heuristic switched off reaches HiGHS, and scipy's
    # warning that it passes the option on verbatim is not the caller's
    import warnings

    import scipy.optimize

    from autoremat._plan import keepsets

    keepsets._solved.cache_clear()
    seen: list[dict[str, object]] = []
    milp = scipy.optimize.milp  # read where it is used (NOTE [ scipy on first use ])

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(dict(kwargs["options"]))  # type: ignore[call-overload]
        return milp(*args, **kwargs)

    monkeypatch.setattr(scipy.optimize, "milp", spy)
    ops = [_op("aten.addmm.default", out=100, flops=10_011, kept=100),
           _op("aten.gelu.default", out=100, flops=811, kept=100, inputs=(0,))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = keep_sets(ops, MODEL, (0.5,))
    assert found and len(seen) == 2 and all(
        o["mip_heuristic_run_feasibility_jump"] is False and o["mip_rel_gap"] == 0.0
        for o in seen)
    # the second solve is bounded by the first's kept bytes (scaled to the largest node's)
    assert "objective_bound" not in seen[0]
    assert seen[1]["objective_bound"] == pytest.approx(found[0].kept_bytes / 100, rel=1e-5)


def test_a_bounded_solve_that_finds_nothing_is_run_again_without_the_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import scipy.optimize
    from scipy.optimize import OptimizeResult

    from autoremat._plan import keepsets

    ops = [_op("aten.addmm.default", out=100, flops=10_013, kept=100),
           _op("aten.gelu.default", out=100, flops=813, kept=100, inputs=(0,))]
    keepsets._solved.cache_clear()
    expected = keep_sets(ops, MODEL, (0.5, 1.0))
    milp = scipy.optimize.milp
    bounded: list[float] = []

    def refusing(*args: Any, **kwargs: Any) -> Any:
        if "objective_bound" in kwargs["options"]:
            bounded.append(kwargs["options"]["objective_bound"])
            return OptimizeResult(success=False, status=4, x=None,
                                  message="objective bound reached")
        return milp(*args, **kwargs)

    monkeypatch.setattr(scipy.optimize, "milp", refusing)
    keepsets._solved.cache_clear()
    assert keep_sets(ops, MODEL, (0.5, 1.0)) == expected and len(bounded) == 2


def test_alias_ops_are_never_kept() -> None:
    # An op whose schema returns an alias, should it ever create storage, is not kept.
    ops = [_op("aten.alias.default", out=100, flops=10_000, kept=100)]
    assert _summary(keep_sets(ops, MODEL, (1.0,))) == [((), (), 0, 10_110)]


# --- agreement with brute force on random blocks --------------------------------------


def _random_block(rng: random.Random, n_nodes: int) -> list[OpRecord]:
    """A block with ``n_nodes`` nodes, plus views, in-place writers (some random, some on
    block inputs), random nodes, ``.item()`` calls and outputs."""
    ops: list[OpRecord] = []
    nodes: list[int] = []

    def some(k: int) -> tuple[int, ...]:
        return tuple(sorted(rng.sample(nodes, min(k, len(nodes)))))

    while len(nodes) < n_nodes:
        roll = rng.random()
        if roll < 0.55 or not nodes:
            rand = rng.random() < 0.1
            out = rng.choice((100, 200, 300, 500, 800))
            ops.append(_op("aten.rand_like.default" if rand else "aten.mul.Tensor", out=out,
                           flops=rng.randrange(0, 5000), random=rand,
                           kept=out if rng.random() < 0.4 else 0,
                           inputs=() if rand else some(rng.randint(0, 2)),
                           saved=rng.random() >= 0.15))
            nodes.append(len(ops) - 1)
        elif roll < 0.65:
            ops.append(_op("aten.view.default", view=True, inputs=some(1)))
        elif roll < 0.9:
            target = rng.choice(nodes) if rng.random() < 0.85 else -1
            own = (target,) if target >= 0 else ()
            extra = some(1) if rng.random() < 0.5 else ()
            rand = rng.random() < 0.2
            ops.append(_op("aten.bernoulli_.float" if rand else "aten.add_.Tensor",
                           out=100 if rand else 0, random=rand, inplace=True, target=target,
                           inputs=tuple(sorted(set(own + extra)))))
        else:
            ops.append(_op("aten._local_scalar_dense.default", value_out=True, inputs=some(1)))
    return ops


@pytest.mark.parametrize("seed", range(4))
def test_agrees_with_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    model = CostModel(flops_per_byte=2.0, flops_per_random_byte=50.0, flops_per_op=7.0,
                      flops_per_sac_op=0.0, flops_per_second=1e11)
    fractions = (0.0, 0.1, 0.25, 0.5, 1.0)
    for _ in range(15):
        ops = _random_block(rng, rng.randint(1, 10))
        ref, total = _Ref(ops, model), _saved_bytes(ops)
        for f in fractions:
            cap = f * total
            (s,) = keep_sets(ops, model, (f,))
            ref.check(s, cap)
            assert (s.cost, s.kept_bytes) == ref.brute_force(cap), (ops, f)
        _check_all(ops, fractions, model)


# --- speed ----------------------------------------------------------------------------


def test_a_300_op_block_solves_quickly() -> None:
    rng = random.Random(7)
    ops = _random_block(rng, 200)
    assert len(ops) >= 300
    keep_sets(ops, MODEL, (0.1,))  # warm up imports and the alias cache
    start = time.perf_counter()
    sets = _check_all(ops, (0.1, 0.2, 0.3, 0.45))
    elapsed = time.perf_counter() - start
    assert sets
    assert elapsed < 2.0, f"{elapsed:.2f} s for 4 caps of a {len(ops)}-op block"


def test_import_autoremat_leaves_scipy_for_the_first_keep_set() -> None:
    """scipy's optimize is imported where a keep-set is first solved, not by ``import
    autoremat`` (NOTE [ scipy on first use ]): about a second of every start, the command
    line's included. A fresh process, since this one has solved keep-sets already."""
    code = ("import sys, autoremat; print('scipy.optimize' in sys.modules); "
            "from autoremat._plan.costs import CostModel; "
            "from autoremat._measure.ops import OpRecord; "
            "from autoremat._plan.keepsets import keep_sets; "
            "mm = OpRecord(op='aten.mm.default', kind='matmul', out_bytes=400, flops=8000, "
            "ms=0.0, random=False, view=False, inplace=False, kept_bytes=400); "
            "print(len(keep_sets([mm], CostModel(0, 0, 0, 0, 1e11), fractions=(0.5,))), "
            "'scipy.optimize' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out == ["False", "1", "True"], out
