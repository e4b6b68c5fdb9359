"""Tests for autoremat.plan: budgets, strategies, the Plan object, on real zoo tapes.

The zoo models are profiled once per module at their default sizes (the acceptance
sizes of the planner issue); the cheap API checks use a small GPT-2 tape.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import autoremat
from autoremat import Decision, Plan, Tape, zoo
from autoremat._core.errors import BudgetError, RematError, SchemaError
from autoremat._plan.budget import optimizer_state_bytes
from autoremat._plan.plan import BlockDecision
from autoremat._plan.strategies import smallest_feasible_bytes

from conftest import V1_OPTIMAL_PLAN, V1_PLAN, V1_TAPE

BUDGETS = ["75%", "50%", "30%", "min"]
BASELINES = ["full", "every:2", "every:3", "sqrt"]


@pytest.fixture(scope="module", params=zoo.names())
def zoo_tape(request: pytest.FixtureRequest, zoo_tapes: Callable[..., Tape]) -> Tape:
    return zoo_tapes(request.param)  # the default sizes; test_verify measures the same tapes


@pytest.fixture(scope="module")
def small() -> tuple[torch.nn.Module, Any, Tape]:
    model, inputs = zoo.build("gpt2", n_layer=4, batch_size=2, seq_len=128)
    return model, inputs, autoremat.profile(model, inputs, repeats=1)


@pytest.fixture(scope="module")
def small_tape(small: tuple[torch.nn.Module, Any, Tape]) -> Tape:
    return small[2]


def _budget_bytes(tape: Tape, budget: str) -> int:
    if budget == "min":
        return smallest_feasible_bytes(tape)
    return int(tape.step_peak_bytes * float(budget[:-1]) / 100)


def _recomputed(p: Plan) -> list[int]:
    return [i for i, b in enumerate(p.blocks) if b.decision is not Decision.KEEP]


# --- budgets on the zoo --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("budget", BUDGETS)
def test_optimal_fits_or_names_the_smallest_feasible_budget(zoo_tape: Tape, budget: str) -> None:
    smallest = smallest_feasible_bytes(zoo_tape)
    assert 0 < smallest <= zoo_tape.step_peak_bytes
    limit = _budget_bytes(zoo_tape, budget)
    arg: int | str = smallest if budget == "min" else budget
    try:
        p = autoremat.plan(zoo_tape, arg)
    except BudgetError as err:
        assert budget != "min", "the smallest feasible budget must be feasible"
        assert err.min_feasible_bytes == smallest > limit
        assert err.strategy == "optimal"
        assert f"{smallest} bytes" in str(err)
        return
    assert p.budget_bytes == limit
    assert p.predicted_peak_bytes <= limit
    assert p.strategy == "optimal" and len(p.blocks) == len(zoo_tape.blocks)
    assert p.model == zoo_tape.model and p.inputs == zoo_tape.inputs
    if budget == "min":
        assert p.predicted_peak_bytes == smallest
        with pytest.raises(BudgetError) as info:
            autoremat.plan(zoo_tape, smallest - 1)
        assert info.value.min_feasible_bytes == smallest


@pytest.mark.slow
def test_some_budget_besides_the_minimum_is_feasible(zoo_tape: Tape) -> None:
    # 75% is feasible on every zoo model (resnet's minimum is ~65% of its peak)
    p = autoremat.plan(zoo_tape, "75%")
    assert p.predicted_peak_bytes <= 0.75 * zoo_tape.step_peak_bytes
    full = autoremat.plan(zoo_tape, None, "full")
    assert any(b.decision is not Decision.KEEP for b in p.blocks)
    assert 0 < p.predicted_cost < full.predicted_cost
    assert p.predicted_recompute_flops <= full.predicted_recompute_flops


@pytest.mark.slow
@pytest.mark.parametrize("budget", BUDGETS)
def test_optimal_is_no_worse_than_any_baseline_that_fits(zoo_tape: Tape, budget: str) -> None:
    limit = _budget_bytes(zoo_tape, budget)
    fitting = [p for p in (autoremat.plan(zoo_tape, None, s) for s in BASELINES)
               if p.predicted_peak_bytes <= limit]
    try:
        best = autoremat.plan(zoo_tape, limit)
    except BudgetError:
        assert not fitting, "a baseline fits a budget the optimal planner calls infeasible"
        return
    for other in fitting:
        assert best.predicted_cost <= other.predicted_cost, other.strategy
        assert best.predicted_recompute_flops <= other.predicted_recompute_flops, (
            f"{other.strategy} recomputes {other.predicted_recompute_flops} FLOPs at "
            f"{other.predicted_peak_bytes} <= {limit} bytes; optimal "
            f"{best.predicted_recompute_flops}"
        )


@pytest.mark.slow
def test_baseline_over_budget_raises_with_the_smallest_feasible(zoo_tape: Tape) -> None:
    smallest = smallest_feasible_bytes(zoo_tape)
    for strategy in BASELINES:
        predicted = autoremat.plan(zoo_tape, None, strategy).predicted_peak_bytes
        assert predicted >= smallest, strategy  # nothing beats the optimum's minimum
        if predicted > smallest:
            with pytest.raises(BudgetError) as info:
                autoremat.plan(zoo_tape, smallest, strategy)
            assert info.value.min_feasible_bytes == smallest
            assert info.value.strategy == "optimal"
            assert repr(strategy) in str(info.value)
        else:
            autoremat.plan(zoo_tape, smallest, strategy)


# --- strategies --------------------------------------------------------------------------


def _sqrt_segments(tape: Tape) -> list[tuple[int, int]]:
    n, size = len(tape.blocks), max(1, round(math.sqrt(len(tape.blocks))))
    out, start = [], 0
    while start < n:
        stop = start + 1
        while stop < min(start + size, n) and tape.blocks[stop].chained:
            stop += 1
        out.append((start, stop))
        start = stop
    return out


@pytest.mark.slow
def test_strategies_make_the_expected_decisions(zoo_tape: Tape) -> None:
    n = len(zoo_tape.blocks)
    none = autoremat.plan(zoo_tape, None, "none")
    assert _recomputed(none) == [] and none.predicted_recompute_flops == 0
    assert none.predicted_peak_bytes == zoo_tape.step_peak_bytes  # exact for the plain step
    full = autoremat.plan(zoo_tape, None, "full")
    assert full.segments == [(i, i + 1, Decision.RECOMPUTE) for i in range(n)]
    assert full.predicted_peak_bytes == zoo_tape.ckpt_step_peak_bytes  # exact too
    assert full.predicted_recompute_flops == sum(b.fwd_flops for b in zoo_tape.blocks)
    for k in (1, 2, 3):
        every = autoremat.plan(zoo_tape, None, f"every:{k}")
        assert _recomputed(every) == list(range(0, n, k))
        assert all(stop == start + 1 for start, stop, _ in every.segments)
        assert every.predicted_recompute_flops == sum(
            b.fwd_flops for b in zoo_tape.blocks[::k])
    sqrt = autoremat.plan(zoo_tape, None, "sqrt")
    assert [(s, e) for s, e, _ in sqrt.segments] == _sqrt_segments(zoo_tape)
    assert {d for _, _, d in sqrt.segments} == {Decision.RECOMPUTE}
    assert len({b.segment for b in sqrt.blocks}) == len(sqrt.segments)


def test_sqrt_groups_a_four_block_chain_in_pairs(small_tape: Tape) -> None:
    # 4 chained blocks: round(sqrt(4)) = 2 per segment; block 0 is not chained to anything
    assert [b.chained for b in small_tape.blocks] == [False, True, True, True]
    assert autoremat.plan(small_tape, None, "sqrt").segments == [
        (0, 2, Decision.RECOMPUTE), (2, 4, Decision.RECOMPUTE)]


# --- budget parsing ----------------------------------------------------------------------


@pytest.mark.parametrize(("budget", "expected"), [
    ("6GiB", 6 * 2**30), ("500MB", 500 * 10**6), (123_456_789, 123_456_789),
    ("1.5 GiB", int(1.5 * 2**30)), (" 2g ", 2 * 2**30), (2e9, 2 * 10**9),
])
def test_budget_sizes(small_tape: Tape, budget: Any, expected: int) -> None:
    assert autoremat.plan(small_tape, budget).budget_bytes == expected


@pytest.mark.parametrize("percent", ["100%", "90%", "40%", " 40.5 % "])
def test_budget_percentages_are_of_the_unplanned_peak(small_tape: Tape, percent: str) -> None:
    value = float(percent.strip()[:-1])
    expected = int(small_tape.step_peak_bytes * value / 100)
    try:
        p = autoremat.plan(small_tape, percent)
    except BudgetError as err:
        assert err.min_feasible_bytes is not None and err.min_feasible_bytes > expected
        return
    assert p.budget_bytes == expected and p.predicted_peak_bytes <= expected


@pytest.mark.parametrize(("budget", "message"), [
    ("six GiB", "cannot read budget 'six GiB'"),
    ("6XB", "units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '6GiB', '500MB')"),
    ("", "cannot read budget ''"),
    ("6 GiB of RAM", "cannot read budget '6 GiB of RAM'"),
    ("abc%", "cannot read budget 'abc%': expected a number before '%'"),
    ("%", "expected a number before '%'"),
    ("0%", "must be a percentage above 0%, e.g. '50%'"),
    ("-5%", "budget '-5%' must be a percentage above 0%"),
    (-1, "budget must not be negative, got -1"),
    (True, "got True"),
    ([1], "size string like '6GiB', got [1]"),
])
def test_bad_budgets_say_what_to_write(small_tape: Tape, budget: Any, message: str) -> None:
    with pytest.raises(BudgetError) as info:
        autoremat.plan(small_tape, budget)
    assert message in str(info.value)
    assert info.value.min_feasible_bytes is None  # malformed, not infeasible


# --- max_memory and optimizer state --------------------------------------------------------


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_max_memory_subtracts_parameters_buffers_and_adamw_state(
        small: tuple[torch.nn.Module, Any, Tape]) -> None:
    model, inputs, tape = small
    params = _nbytes(model.parameters())  # parameters() skips the tied lm_head weight
    buffers = _nbytes(model.buffers())
    trainable = _nbytes(p for p in model.parameters() if p.requires_grad)
    assert (tape.param_bytes, tape.buffer_bytes, tape.trainable_param_bytes) == \
        (params, buffers, trainable)
    # The batch is on the device before the step too (NOTE [ From max_memory to a step
    # budget ] in budget.py), and on the CPU so are AdamW's step counters, 4 bytes a tensor.
    batch = _nbytes(inputs.values())  # idx and targets
    assert tape.input_bytes == batch > 0
    counters = 4 * sum(p.requires_grad for p in model.parameters())
    fixed = params + buffers + 2 * trainable + counters + batch
    device = fixed + tape.step_peak_bytes
    p = autoremat.plan(tape, max_memory=device, optimizer="adamw")
    assert p.budget_bytes == tape.step_peak_bytes
    assert autoremat.plan(tape, max_memory=device, optimizer="AdamW").budget_bytes == \
        tape.step_peak_bytes
    # sgd keeps no state, sgd-momentum one buffer per parameter; bytes are taken as given
    assert autoremat.plan(tape, max_memory=device, optimizer="sgd").budget_bytes == \
        device - params - buffers - batch
    assert autoremat.plan(tape, max_memory=device, optimizer="sgd-momentum").budget_bytes == \
        device - params - buffers - batch - trainable
    assert autoremat.plan(tape, max_memory=device, optimizer=12345).budget_bytes == \
        device - params - buffers - batch - 12345
    with pytest.warns(UserWarning, match="max_memory= without optimizer= counts no "
                                         "optimizer state"):  # said, not silent
        assert autoremat.plan(tape, max_memory=device).budget_bytes == \
            device - params - buffers - batch
    assert autoremat.plan(tape, max_memory=device, optimizer="none").budget_bytes == \
        device - params - buffers - batch
    assert optimizer_state_bytes(tape, "adam") == 2 * trainable
    # with a budget too, the tighter one wins
    assert autoremat.plan(tape, "90%", max_memory=device, optimizer="adamw").budget_bytes == \
        int(0.9 * tape.step_peak_bytes)
    assert autoremat.plan(tape, 10**12, max_memory=device, optimizer="adamw").budget_bytes == \
        tape.step_peak_bytes
    # max_memory as a size string
    text = f"{device / 2**20:.6f}MiB"
    assert abs(autoremat.plan(tape, max_memory=text, optimizer="adamw").budget_bytes
               - tape.step_peak_bytes) <= 2


def test_frozen_parameters_carry_no_optimizer_state() -> None:
    model, inputs = zoo.build("gpt2", n_layer=2, batch_size=2, seq_len=64)
    model.wpe.weight.requires_grad_(False)  # frozen positions: no AdamW state for them
    tape = autoremat.profile(model, inputs, repeats=1)
    trainable = _nbytes(p for p in model.parameters() if p.requires_grad)
    assert tape.trainable_param_bytes == trainable < tape.param_bytes
    counters = 4 * sum(p.requires_grad for p in model.parameters())  # AdamW's, on the CPU
    device = (tape.param_bytes + tape.buffer_bytes + 2 * trainable + counters
              + tape.input_bytes + tape.step_peak_bytes)
    assert autoremat.plan(tape, max_memory=device, optimizer="adamw").budget_bytes == \
        tape.step_peak_bytes


@pytest.mark.parametrize("shards", [1, 2])
def test_a_max_memory_refused_says_the_least_one_in_the_same_units(small_tape: Tape,
                                                                    shards: int) -> None:
    """Below what the iteration holds whatever is recomputed, min_feasible_bytes was that
    lower bound as a max_memory, and below the smallest plan it was a step budget: a
    retry with one was refused with the other, back and forth (a held-out check).
    min_feasible_bytes is always a step budget, min_feasible_max_memory the max_memory
    that holds it, which a retry with it fits."""
    from autoremat._plan.strategies import smallest_feasible_bytes
    least = smallest_feasible_bytes(dataclasses.replace(small_tape, blocks=tuple(
        dataclasses.replace(b, chained=shards == 1 and b.chained) for b in small_tape.blocks)))
    found = []
    for max_memory in (1000, None):
        with pytest.raises(BudgetError) as info:
            autoremat.plan(small_tape, max_memory=max_memory or found[0] - 1,
                           optimizer="adamw", shards=shards)
        assert info.value.min_feasible_bytes == least
        found.append(info.value.min_feasible_max_memory)
    assert found[0] == found[1] is not None
    plan = autoremat.plan(small_tape, max_memory=found[0], optimizer="adamw", shards=shards)
    assert plan.budget_bytes == least


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_memory": 1000, "optimizer": "adamw"},
     "does not even hold the parameters, buffers and optimizer state"),
    ({"optimizer": "adamw"}, "optimizer= only matters with max_memory="),
    ({"max_memory": "64GiB", "optimizer": "adamww"}, "Did you mean 'adamw'?"),
    ({"max_memory": "lots"}, "cannot read max_memory 'lots'"),
])
def test_max_memory_errors(small_tape: Tape, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(BudgetError) as info:
        autoremat.plan(small_tape, **kwargs)
    assert message in str(info.value)


# --- strategy names --------------------------------------------------------------------------


@pytest.mark.parametrize(("strategy", "message"), [
    ("optimial", "unknown strategy 'optimial'"),
    ("optimial", "Did you mean 'optimal'?"),
    ("ful", "Did you mean 'full'?"),
    ("sqr", "Did you mean 'sqrt'?"),
    ("evry:2", "Did you mean 'every'?"),
    ("checkpoint-everything", "choose from ['optimal', 'none', 'full', 'every:K', 'sqrt'"),
    ("every", "needs a whole number K >= 1"),
    ("every:0", "needs a whole number K >= 1, got 'every:0'"),
    ("every:x", "got 'every:x'"),
    ("sqrt:3", "strategy 'sqrt' takes no argument, got 'sqrt:3'"),
    (3, "strategy must be a string"),
])
def test_unknown_strategies_are_named(small_tape: Tape, strategy: Any, message: str) -> None:
    with pytest.raises(RematError) as info:
        autoremat.plan(small_tape, None, strategy)
    assert not isinstance(info.value, BudgetError)
    assert message in str(info.value)


def test_plan_needs_a_tape() -> None:
    model, _ = zoo.build("mlp", widths=(8, 8), batch_size=2)
    with pytest.raises(RematError, match="needs a Tape"):
        autoremat.plan(model, "50%")  # type: ignore[arg-type]


# --- the Plan object -------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["optimal", "none", "full", "every:2", "sqrt"])
def test_json_round_trip(small_tape: Tape, strategy: str, tmp_path: Any) -> None:
    p = autoremat.plan(small_tape, "95%" if strategy == "optimal" else None, strategy)
    text = p.to_json()
    assert json.loads(text)["schema_version"] == p.schema_version == 2
    assert Plan.from_json(text) == p
    path = tmp_path / "sub" / "plan.json"
    assert p.to_json(path) == text and path.read_text() == text
    assert Plan.from_json(path) == p
    assert Plan.from_json(str(path)) == p
    assert list(tmp_path.joinpath("sub").iterdir()) == [path]  # no temporary left behind


def _mutated(p: Plan, change: Any) -> str:
    data = json.loads(p.to_json())
    change(data)
    return json.dumps(data)


_MALFORMED = [
    ("missing", lambda d: d.pop("strategy"), "plan: missing field 'strategy'"),
    ("unknown", lambda d: d.__setitem__("colour", 1), "unknown field(s) ['colour']"),
    ("version", lambda d: d.__setitem__("schema_version", 99), "schema_version 99"),
    ("peak", lambda d: d.__setitem__("predicted_peak_bytes", "12"),
     "plan.predicted_peak_bytes must be an integer"),
    ("flops", lambda d: d.__setitem__("predicted_recompute_flops", 1.5),
     "plan.predicted_recompute_flops"),
    ("blocks", lambda d: d.__setitem__("blocks", {}), "plan.blocks must be a list"),
    ("decision", lambda d: d["blocks"][1].__setitem__("decision", "maybe"),
     "plan.blocks[1].decision must be one of ['keep', 'recompute', 'selective', 'offload', "
     "'offload_input'], got 'maybe'"),
    ("block-missing", lambda d: d["blocks"][0].pop("segment"),
     "plan.blocks[0]: missing field 'segment'"),
    ("block-type", lambda d: d["blocks"].__setitem__(2, 5), "plan.blocks[2] must be an object"),
]
_MALFORMED_UNCHECKED = [  # fields Plan.from_json does not validate yet (see the report)
    ("segment", lambda d: d["blocks"][0].__setitem__("segment", "a"), "plan.blocks[0].segment"),
    ("name", lambda d: d["blocks"][0].__setitem__("name", 7), "plan.blocks[0].name"),
    ("save_ops", lambda d: d["blocks"][0].__setitem__("save_ops", "matmul"),
     "plan.blocks[0].save_ops"),
    ("budget", lambda d: d.__setitem__("budget_bytes", "50%"), "plan.budget_bytes"),
    ("model", lambda d: d.__setitem__("model", 3), "plan.model"),
    ("bool", lambda d: d.__setitem__("predicted_peak_bytes", True),
     "plan.predicted_peak_bytes"),
    ("notes", lambda d: d.__setitem__("notes", 5), "plan.notes"),
    ("head_site", lambda d: d.__setitem__("head_site", "lm_head"), "plan.head_site"),
    ("head_site kind", lambda d: d.__setitem__("head_site", "tpu:lm_head"), "plan.head_site"),
    ("head_site type", lambda d: d.__setitem__("head_site", 3), "plan.head_site"),
]


@pytest.mark.parametrize(("case", "change", "message"), [
    *_MALFORMED,
    *_MALFORMED_UNCHECKED,
])
def test_malformed_plan_json_names_the_field(small_tape: Tape, case: str, change: Any,
                                             message: str) -> None:
    p = autoremat.plan(small_tape, None, "every:2")
    with pytest.raises(SchemaError) as info:
        Plan.from_json(_mutated(p, change))
    assert message in str(info.value)


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "plan is not valid JSON"),
    ("[1, 2]", "plan JSON must be an object, got list"),  # JSON, but not an object
    ("/nonexistent/plan.json", "cannot read plan file '/nonexistent/plan.json'"),
])
def test_unreadable_plan_json(text: str, message: str) -> None:
    with pytest.raises(SchemaError) as info:
        Plan.from_json(text)
    assert message in str(info.value)


def test_plan_is_frozen(small_tape: Tape) -> None:
    p = autoremat.plan(small_tape, None, "full")
    with pytest.raises(AttributeError):
        p.strategy = "none"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        p.blocks[0].decision = Decision.KEEP  # type: ignore[misc]


def _names_listed(text: str, names: list[str]) -> list[str]:
    return [n for n in names if not re.search(rf"(?<![\w.]){re.escape(n)}(?![\w.])", text)]


@pytest.mark.parametrize("strategy", [
    "none", "full", "every:2",
    "sqrt",
])
def test_print_lists_every_block(strategy: str, capsys: pytest.CaptureFixture[str],
                                 zoo_tapes: Callable[..., Tape]) -> None:
    tape = zoo_tapes("mlp", widths=(96, 64) * 4 + (32,), batch_size=64)  # profiled once
    p = autoremat.plan(tape, None, strategy)
    if strategy == "sqrt":  # 9 blocks: three segments of three
        assert [(s, e) for s, e, _ in p.segments] == [(0, 3), (3, 6), (6, 9)]
    print(p)
    out = capsys.readouterr().out
    assert f"Plan ({strategy}) for MLPChain" in out
    assert "predicted peak" in out and "recompute" in out and "% of the step" in out
    assert _names_listed(out, [b.name for b in p.blocks]) == []


def test_print_shows_budget_and_decisions(small_tape: Tape) -> None:
    p = autoremat.plan(small_tape, None, "every:2")
    text = str(p)
    assert "budget none" in text
    rows = {line.split()[0]: line.split()[1] for line in text.splitlines()
            if line.startswith("blocks.")}
    assert rows == {"blocks.0": "recompute", "blocks.1": "keep", "blocks.2": "recompute",
                    "blocks.3": "keep"}
    assert f"{100 * p.recompute_overhead:.1f}% of the step" in text


# --- determinism -----------------------------------------------------------------------------


@pytest.mark.slow
def test_same_tape_gives_equal_plans(zoo_tape: Tape) -> None:
    for budget in ("75%", "50%", smallest_feasible_bytes(zoo_tape)):
        try:
            first = autoremat.plan(zoo_tape, budget)
        except BudgetError:
            continue
        assert autoremat.plan(zoo_tape, budget) == first
        assert autoremat.plan(Tape.from_json(zoo_tape.to_json()), budget) == first


@pytest.mark.slow
def test_two_profiles_of_the_same_model_give_the_same_plan(small_tape: Tape) -> None:
    # A second profile of an identically built model: times differ, the plan must not.
    model, inputs = zoo.build("gpt2", n_layer=4, batch_size=2, seq_len=128)
    again = autoremat.profile(model, inputs, repeats=1)
    for budget in ("90%", "70%", "50%", smallest_feasible_bytes(small_tape)):
        try:
            a = autoremat.plan(small_tape, budget)
        except BudgetError as err:
            with pytest.raises(BudgetError) as info:
                autoremat.plan(again, budget)
            assert info.value.min_feasible_bytes == err.min_feasible_bytes
            continue
        assert autoremat.plan(again, budget) == a


# --- files of schema version 1 (tests/data/README.md) ---------------------------------------

_V1_DECISIONS = [Decision.RECOMPUTE, Decision.RECOMPUTE, Decision.SELECTIVE, Decision.SELECTIVE,
                 Decision.OFFLOAD_INPUT, Decision.OFFLOAD, Decision.KEEP]


def test_a_version_1_plan_loads_and_its_figures_hold_on_its_version_1_tape() -> None:
    """A plan file of version 1 (an offloaded input as "recompute" with ``offload_input:
    true``) loads with its seal checked, every decision as a Decision; with its tape,
    also of version 1, the plan's predictions are derived again from the decisions and
    equal the ones the file states (so the peak model reads the old windows as before)."""
    raw = json.loads(V1_PLAN.read_text())
    assert raw["schema_version"] == 1 and raw["blocks"][4]["offload_input"] is True
    tape = Tape.from_json(V1_TAPE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sealed: no UnsealedPlanWarning
        p = Plan.from_json(V1_PLAN, tape=tape)
    assert [b.decision for b in p.blocks] == _V1_DECISIONS
    assert [b.offload_input for b in p.blocks] == [False] * 4 + [True, False, False]
    assert p.blocks[2].keep_seal and p.blocks[3].save_ops == ()
    assert p.segments[0] == (0, 2, Decision.RECOMPUTE) and p.offload_blocks == 2
    assert p.schema_version == 2
    # written again as version 2: the decision by name, no flag
    data = json.loads(p.to_json())
    assert data["schema_version"] == 2
    assert data["blocks"][4]["decision"] == "offload_input"
    assert all("offload_input" not in b for b in data["blocks"])
    assert Plan.from_json(p.to_json(), tape=tape) == p


def test_planning_a_version_1_tape_gives_the_plan_made_when_it_was_written() -> None:
    """The optimal plan of the version-1 tape, made by the autoremat that wrote both
    files, is the plan this one makes from the same tape and budget."""
    tape = Tape.from_json(V1_TAPE)
    then = Plan.from_json(V1_OPTIMAL_PLAN, tape=tape)
    assert then.budget_bytes is not None
    assert autoremat.plan(tape, then.budget_bytes, offload=True) == then
    assert autoremat.plan(tape, None, "sqrt").segments != then.segments  # a real choice


def test_a_block_decision_is_read_by_name_at_the_boundary() -> None:
    block = BlockDecision("blocks.0", "recompute", 0)  # type: ignore[arg-type]
    assert block.decision is Decision.RECOMPUTE and block.decision == "recompute"
    with pytest.raises(RematError, match=r"decision of block 'blocks.0' must be one of "
                                         r"\['keep', .*'offload_input'\] .*, got 'recompte'. "
                                         r"Did you mean 'recompute'\?"):
        BlockDecision("blocks.0", "recompte", 0)  # type: ignore[arg-type]
