"""Tests for autoremat.apply / remove: plans applied to real modules.

The central check, ``assert_same_step`` (in _steps.py, shared with test_auto.py), runs one
training step of the plain model and one of the planned model from the same RNG state and
BatchNorm statistics and asserts ``torch.equal`` on the loss and on every gradient
(independently of ``verify``). Models are small (conftest.MEDIUM) so that each test takes
a second or two; their tapes come from the session's ``zoo_tapes``.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoremat
from autoremat import Decision, Plan, Tape, zoo
from autoremat._core.decisions import Choice
from autoremat._core.errors import BudgetError, PlanMismatchError, RematError
from autoremat._core.saves import is_keep_set
from autoremat._guards import ShapeMismatchWarning
from autoremat._mechanism.wrap import is_wrapped
from autoremat._plan.costs import cost_model_for, keep_set_cost
from autoremat._plan.plan import plan_of_segments
from autoremat._plan.strategies import smallest_feasible_bytes

from _steps import (
    DenseChain,
    assert_same_step,
    call,
    recomputing,
    single_block_plans,
    snapshot,
    step,
)
from conftest import MEDIUM, hf_model


def build(name: str) -> tuple[nn.Module, Any]:
    """A fresh zoo model at MEDIUM sizes: the model ``tapes(name)`` was measured on."""
    return zoo.build(name, **MEDIUM[name])


@pytest.fixture(scope="module")
def tapes(zoo_tapes: Callable[..., Tape]) -> Callable[[str], Tape]:
    return lambda name: zoo_tapes(name, **MEDIUM[name])


def make_plan(tape: Tape, strategy: str) -> Plan:
    """``strategy``, or ``"optimal@B"`` for a budgeted optimal plan: B is a percentage,
    ``min`` (the smallest feasible budget) or ``mid`` (halfway from there to no plan)."""
    if "@" in strategy:
        name, budget = strategy.split("@")
        smallest = smallest_feasible_bytes(tape)
        value = {"min": smallest, "mid": (smallest + tape.step_peak_bytes) // 2}.get(budget,
                                                                                    budget)
        return autoremat.plan(tape, value, name)
    return autoremat.plan(tape, None, strategy)


# --- the key guarantee: same loss and gradients ------------------------------------------------


@pytest.mark.parametrize("name", list(MEDIUM))
@pytest.mark.parametrize("strategy", ["full", "every:2", "sqrt", "selective", "optimal@mid",
                                      "optimal@min"])
def test_planned_step_gives_identical_gradients(tapes: Callable[[str], Tape], name: str,
                                                strategy: str) -> None:
    model, inputs = build(name)  # dropout active (train mode); BatchNorm in resnet
    assert model.training
    try:
        plan = make_plan(tapes(name), strategy)
    except BudgetError as err:  # the refusal is the tested behaviour here
        assert err.min_feasible_bytes is not None and err.min_feasible_bytes > 0
        assert not strategy.startswith("optimal@min"), "the smallest budget must fit"
        return
    assert recomputing(plan)
    assert_same_step(model, inputs, plan)


def test_the_suite_covers_multi_block_segments_and_selective(
        tapes: Callable[[str], Tape]) -> None:
    sqrt = make_plan(tapes("mlp"), "sqrt")
    assert any(stop - start > 1 for start, stop, _ in sqrt.segments)
    selective = make_plan(tapes("gpt2"), "selective")
    assert {b.decision for b in selective.blocks} == {Decision.SELECTIVE}


# --- apply / remove mechanics ---------------------------------------------------------------


def _hook_counts(snapshot: dict[str, Any]) -> dict[str, dict[str, int]]:
    return {n: {a: len(ids) for a, ids in hooks.items()} for n, hooks in
            snapshot["hooks"].items()}


@pytest.mark.parametrize("strategy", ["full", "every:2", "sqrt", "selective"])
def test_remove_restores_the_module_exactly(tapes: Callable[[str], Tape], strategy: str) -> None:
    model, inputs = build("gpt2")
    plan = make_plan(tapes("gpt2"), strategy)
    before = snapshot(model)
    assert autoremat.apply(model, plan) is model
    assert autoremat.applied_plan(model) is plan
    during = snapshot(model)
    # while applied: same parameters (same objects), same state-dict keys
    assert during["state_dict"] == before["state_dict"]
    assert during["params"] == before["params"]
    assert during != before  # something was installed
    step(model, inputs)  # run it once: nothing it leaves behind may survive remove()
    autoremat.remove(model)
    assert snapshot(model) == before
    assert autoremat.applied_plan(model) is None
    for name, module in model.named_modules():
        assert "forward" not in vars(module), name
        assert not any(k.startswith("_autoremat") for k in vars(module)), name
        assert is_wrapped(module) is None
    assert autoremat.remove(model) is model  # a no-op now
    assert snapshot(model) == before


def test_remove_keeps_a_users_own_instance_forward(tapes: Callable[[str], Tape]) -> None:
    model, inputs = build("gpt2")
    block = model.blocks[0]
    original = block.forward
    calls = []

    def traced(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    block.forward = traced
    autoremat.apply(model, make_plan(tapes("gpt2"), "full"))
    step(model, inputs)
    assert len(calls) == 2  # forward, and the recompute in backward
    autoremat.remove(model)
    assert block.forward is traced


def test_apply_twice_is_apply_once(tapes: Callable[[str], Tape]) -> None:
    model, inputs = build("gpt2")
    for strategy in ("full", "sqrt", "every:2"):
        plan = make_plan(tapes("gpt2"), strategy)
        before = snapshot(model)
        autoremat.apply(model, plan)
        once = snapshot(model)
        autoremat.apply(model, plan)
        twice = snapshot(model)
        assert twice["attrs"] == once["attrs"]
        assert _hook_counts(twice) == _hook_counts(once)  # no hook installed twice
        wrapped = {n: is_wrapped(m) for n, m in model.named_modules()}
        assert_same_step(model, inputs, plan)
        # one remove undoes it all: nothing was wrapped twice
        autoremat.remove(model)
        assert snapshot(model) == before, strategy
        assert all(v in (None, Decision.RECOMPUTE) for v in wrapped.values())


def test_applying_another_plan_replaces_the_first(tapes: Callable[[str], Tape]) -> None:
    model, inputs = build("gpt2")
    full, every = make_plan(tapes("gpt2"), "full"), make_plan(tapes("gpt2"), "every:2")
    autoremat.apply(model, full)
    autoremat.apply(model, every)
    assert autoremat.applied_plan(model) is every
    assert [is_wrapped(b) for b in model.blocks] == [Decision.RECOMPUTE, None, Decision.RECOMPUTE,
                                                        None]
    assert_same_step(model, inputs, every)
    autoremat.remove(model)
    assert all(is_wrapped(b) is None for b in model.blocks)


def test_checkpointed_blocks_really_recompute(tapes: Callable[[str], Tape]) -> None:
    """Counts forward calls per block: kept blocks run once, recomputed ones twice."""
    model, inputs = build("gpt2")
    counts = [0] * len(model.blocks)
    for i, block in enumerate(model.blocks):
        block.attn.c_attn.register_forward_hook(
            lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    autoremat.apply(model, make_plan(tapes("gpt2"), "every:2"))
    step(model, inputs)
    assert counts == [2, 1, 2, 1]
    counts[:] = [0] * 4
    autoremat.apply(model, make_plan(tapes("gpt2"), "sqrt"))
    step(model, inputs)
    assert counts == [2, 2, 2, 2]


@pytest.mark.parametrize("strategy", ["full", "sqrt", "every:2", "optimal@min"])
def test_batchnorm_statistics_are_updated_once(tapes: Callable[[str], Tape],
                                               strategy: str) -> None:
    plain, inputs = build("resnet")
    planned, _ = build("resnet")  # same seed: identical weights and statistics
    plan = make_plan(tapes("resnet"), strategy)
    assert recomputing(plan)
    autoremat.apply(planned, plan)
    _, g_plain = step(plain, inputs)
    _, g_planned = step(planned, inputs)
    stats_plain, stats_planned = dict(plain.named_buffers()), dict(planned.named_buffers())
    assert stats_plain.keys() == stats_planned.keys()
    assert any(n.endswith("num_batches_tracked") for n in stats_plain)
    for n, b in stats_plain.items():
        assert torch.equal(b, stats_planned[n]), n
    assert int(stats_planned["stages.0.0.bn1.num_batches_tracked"]) == 1
    assert all(torch.equal(g_plain[n], g_planned[n]) for n in g_plain)


def test_plan_for_another_model_class_is_refused(tapes: Callable[[str], Tape]) -> None:
    model, _ = build("llama")
    with pytest.raises(PlanMismatchError) as info:
        autoremat.apply(model, make_plan(tapes("gpt2"), "full"))
    assert "made for a GPT, not a Llama" in str(info.value)
    assert autoremat.applied_plan(model) is None
    assert all(is_wrapped(m) is None for m in model.modules())


@pytest.mark.parametrize(("name", "message"), [
    ("blocks.9", "names block 'blocks.9', which GPT does not have"),
    ("blokcs.1", "Did you mean 'blocks.1'?"),
])
def test_plan_naming_a_missing_block_is_refused(tapes: Callable[[str], Tape], name: str,
                                                message: str) -> None:
    model, _ = build("gpt2")
    plan = make_plan(tapes("gpt2"), "full")
    bad = dataclasses.replace(plan, blocks=(*plan.blocks[:-1],
                                            dataclasses.replace(plan.blocks[-1], name=name)))
    with pytest.raises(PlanMismatchError) as info:
        autoremat.apply(model, bad)
    assert message in str(info.value)
    assert all(is_wrapped(m) is None for m in model.modules())  # nothing half-applied


def test_apply_needs_a_plan() -> None:
    model, _ = build("mlp")
    with pytest.raises(RematError, match="needs a Plan"):
        autoremat.apply(model, {"strategy": "full"})  # type: ignore[arg-type]


def test_other_input_shapes_warn_once_and_still_give_equal_gradients(
        tapes: Callable[[str], Tape]) -> None:
    model, inputs = build("gpt2")
    plan = make_plan(tapes("gpt2"), "sqrt")
    autoremat.apply(model, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShapeMismatchWarning)
        step(model, inputs)  # the shapes it was made for: silent
    longer = {k: v.repeat(1, 2) for k, v in inputs.items()}  # (2, 128) instead of (2, 64)
    with pytest.warns(ShapeMismatchWarning) as record:
        step(model, longer)
    assert len(record) == 1
    text = str(record[0].message)
    assert plan.inputs in text and "idx: (2, 128) int64" in text and "re-plan" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShapeMismatchWarning)
        step(model, longer)  # already warned for this shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShapeMismatchWarning)  # apply() again: warns again
        assert_same_step(model, longer, plan)


def test_a_scalar_keyword_does_not_make_every_later_batch_warn() -> None:
    # the Hugging Face Trainer passes num_items_in_batch, a 0-d tensor: a batch warned
    # about was kept with it, and every later batch, compared without it, warned again
    model, inputs = hf_model("llama", None, layers=2, seq_len=16)
    autoremat.auto(model, inputs, budget="95%", loop="loss_only")
    ids = inputs["input_ids"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for length in (48, 20, 32, 40):  # past the profiled 16 once, then within 48
            longer = ids.repeat(1, 3)[:, :length]
            model(input_ids=longer, labels=longer,
                  num_items_in_batch=torch.tensor(float(longer.numel()))).loss.backward()
    autoremat.remove(model)
    assert len([w for w in record if issubclass(w.category, ShapeMismatchWarning)]) == 1


class _Prefixed(nn.Module):
    """Called positionally; a keyword adds prefix tokens or repeats the batch."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width))
                                    for _ in range(3))

    def forward(self, ids: torch.Tensor, prefix: torch.Tensor | None = None,
                repeat: int = 1) -> torch.Tensor:
        if prefix is not None:
            ids = torch.cat([prefix, ids], 1)
        x = self.embed(ids).repeat(repeat, 1, 1)
        for block in self.blocks:
            x = x + block(x)
        return x.pow(2).mean()


def test_keywords_added_to_a_positional_call_are_checked() -> None:
    # a call with positional arguments and keywords was checked on the positional ones
    # alone: a keyword tensor, or a keyword that repeats the batch, grew the step past
    # its budget silently (2.8x on a held-out loop)
    torch.manual_seed(0)
    model, ids = _Prefixed(), torch.randint(0, 64, (4, 16))
    autoremat.auto(model, (ids,), budget="75%")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShapeMismatchWarning)
        model(ids, prefix=None).backward()  # turns nothing on: silent
    for kwargs, named in [({"prefix": torch.randint(0, 64, (4, 8))}, "prefix: (4, 8) int64"),
                          ({"repeat": 3}, None)]:
        with pytest.warns(ShapeMismatchWarning) as record:
            model(ids, **kwargs).backward()
        text = str(record[0].message)
        assert (f"now runs on (4, 16) int64, {named}" if named else
                "now runs with repeat=3, which the step profiled did not pass") in text, text
    autoremat.remove(model)


def test_a_batch_within_the_planned_one_is_silent(tapes: Callable[[str], Tape]) -> None:
    # NOTE [ Smaller batches are within the plan ]: the last, smaller batch, padding to
    # each batch's longest sequence; the warning that must still come: larger in any
    # dimension (another dtype or set of tensors: test_within_reads_the_planned_signature)
    model, inputs = build("gpt2")
    autoremat.apply(model, make_plan(tapes("gpt2"), "sqrt"))
    within = [{k: v[:1] for k, v in inputs.items()},  # (1, 64): a smaller batch
              {k: v[:, :40] for k, v in inputs.items()},  # (2, 40): shorter sequences
              {k: v[:1, :17] for k, v in inputs.items()}]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShapeMismatchWarning)
        for batch in within:
            step(model, batch)
    wider = {k: torch.cat([v, v]) for k, v in inputs.items()}  # (4, 64)
    with pytest.warns(ShapeMismatchWarning):
        step(model, wider)
    autoremat.remove(model)


def test_a_batch_within_one_already_warned_about_is_silent(
        tapes: Callable[[str], Tape]) -> None:
    # a loop padding each batch to its longest sequence, profiled on a short batch: told
    # at each new longest length, not at every length beyond the plan's
    model, inputs = build("gpt2")
    autoremat.apply(model, make_plan(tapes("gpt2"), "sqrt"))
    longest = {k: v.repeat(1, 2) for k, v in inputs.items()}  # (2, 128)
    with pytest.warns(ShapeMismatchWarning, match=r"idx: \(2, 100\)"):
        step(model, {k: v[:, :100] for k, v in longest.items()})  # (2, 100)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShapeMismatchWarning)
        step(model, {k: v[:, :80] for k, v in longest.items()})  # within (2, 100)
    with pytest.warns(ShapeMismatchWarning, match=r"idx: \(2, 128\)"):
        step(model, longest)  # beyond (2, 100): told again
    autoremat.remove(model)


def test_within_reads_the_planned_signature() -> None:
    within = importlib.import_module("autoremat._guards")._within
    planned = "input_ids: (4, 128) int64, labels: (4, 128) int64"
    ids = torch.zeros(2, 100, dtype=torch.long)
    assert within(planned, {"input_ids": ids, "labels": ids})
    assert within(planned, {"input_ids": ids, "labels": ids, "use_cache": False})
    assert not within(planned, {"input_ids": ids, "labels": ids, "use_cache": True})
    assert not within(planned, {"input_ids": ids})  # a tensor the plan had is missing
    assert not within(planned, {"input_ids": ids, "labels": ids, "mask": ids})
    assert not within(planned, {"input_ids": torch.zeros(2, 129, dtype=torch.long),
                                "labels": ids})
    assert within("(8, 16) float32", torch.zeros(3, 16))
    assert not within("(8, 16) float32", torch.zeros(3, 16, 1))
    assert not within("(8, 16) float32", torch.zeros(3, 16, dtype=torch.float64))
    assert within("(8, 16) float32, (8,) int64", (torch.zeros(8, 16), torch.zeros(5).long()))


def test_a_setting_the_profile_did_not_pass_is_named_as_such() -> None:
    # a keyword that is no tensor (output_attentions=True, a depth) may change what the
    # step holds either way: the warning names it, not "the shapes", which are within
    added = importlib.import_module("autoremat._guards")._added_settings
    planned = "input_ids: (4, 128) int64, labels: (4, 128) int64"
    ids = torch.zeros(2, 100, dtype=torch.long)
    assert added(planned, {"input_ids": ids, "labels": ids, "output_attentions": True,
                           "use_cache": False}) == ["output_attentions=True"]
    assert added(planned, {"input_ids": ids, "labels": ids}) == []
    assert added(planned, {"input_ids": ids, "labels": ids, "mask": ids}) == []  # a tensor
    wider = torch.zeros(8, 128, dtype=torch.long)  # larger: the shapes' warning, not this
    assert added(planned, {"input_ids": wider, "labels": wider, "depth": 3}) == []


# --- awkward models --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["full", "sqrt", "every:2", "optimal@min"])
def test_frozen_embeddings_first_block_input_without_grad(strategy: str) -> None:
    model, inputs = build("gpt2")
    model.wte.weight.requires_grad_(False)  # also the tied lm_head
    model.wpe.weight.requires_grad_(False)
    seen: list[bool] = []
    model.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].requires_grad))
    plan = make_plan(autoremat.profile(model, inputs, repeats=1), strategy)
    assert plan.blocks[0].decision is not Decision.KEEP
    assert_same_step(model, inputs, plan)
    assert seen and not any(seen)
    _, grads = step(model, inputs)
    assert grads["wte.weight"] is None and grads["wpe.weight"] is None
    assert grads["blocks.0.attn.c_attn.weight"] is not None


class KwBlock(nn.Module):
    """Takes keyword arguments only."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out)
        self.drop = nn.Dropout(0.2)

    def forward(self, *, x: torch.Tensor, scale: float, mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        h = self.drop(F.gelu(self.norm(self.fc(x)))) * scale  # (B, d_out)
        return h if mask is None else h * mask


class KwChain(nn.Module):
    def __init__(self, widths: tuple[int, ...] = (64, 96, 48, 128, 64, 80), d_in: int = 32
                 ) -> None:
        super().__init__()
        dims = (d_in, *widths)
        self.blocks = nn.ModuleList(KwBlock(a, b) for a, b in itertools.pairwise(dims))
        self.head = nn.Linear(dims[-1], 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x=x, scale=0.5 + i / 10, mask=None)
        return F.mse_loss(self.head(x).squeeze(-1), y)


class ArgBlock(nn.Module):
    """Positional non-tensor arguments, a dict argument, and a nested (tuple, dict) output."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, act: str, cfg: dict[str, float],
                eps: float = 1e-5, unused: None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        h = getattr(F, act)(self.fc(x) + cfg["bias_scale"] * bias)  # (B, d)
        h = self.drop(h) + eps
        return h, {"aux": h.pow(2).mean(), "tag": act}


class ArgChain(nn.Module):
    def __init__(self, d: int = 64, n: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ArgBlock(d) for _ in range(n))
        self.register_buffer("bias", torch.linspace(-1, 1, d))  # a tensor without grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        aux = x.new_zeros(())
        for i, block in enumerate(self.blocks):
            act = ("gelu", "relu", "silu")[i % 3]
            x, extra = block(x, self.bias, act, {"bias_scale": 0.1 * i}, 1e-3, None)
            aux = aux + extra["aux"]
        return x.sum() + aux


class SharedBlock(nn.Module):
    """Shares one Linear with every other block (tied weights across the chain)."""

    def __init__(self, shared: nn.Linear, d: int) -> None:
        super().__init__()
        self.shared = shared
        self.own = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.own(F.gelu(self.shared(x))))


class SharedChain(nn.Module):
    def __init__(self, d: int = 64, n: int = 5) -> None:
        super().__init__()
        shared = nn.Linear(d, d)
        self.blocks = nn.ModuleList(SharedBlock(shared, d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def _custom(name: str) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    if name == "kwargs":
        return KwChain(), (torch.randn(128, 32), torch.randn(128))
    if name == "args":
        return ArgChain(), (torch.randn(128, 64),)
    return SharedChain(), (torch.randn(128, 64),)


@pytest.mark.parametrize("name", ["kwargs", "args", "shared"])
@pytest.mark.parametrize("strategy", ["full", "sqrt", "every:2", "optimal@min"])
def test_custom_chains(name: str, strategy: str) -> None:
    model, inputs = _custom(name)
    tape = autoremat.profile(model, inputs, repeats=1)
    n = len(model.blocks)  # type: ignore[arg-type]
    assert [b.name for b in tape.blocks] == [f"blocks.{i}" for i in range(n)]
    # the first tensor argument (keyword, or positional among non-tensors) is the
    # previous block's output (from a nested output for "args"): multi-block segments OK
    assert [b.chained for b in tape.blocks] == [False] + [True] * (n - 1)
    plan = make_plan(tape, strategy)
    if strategy == "sqrt":
        assert any(stop - start > 1 for start, stop, _ in plan.segments)
    assert_same_step(model, inputs, plan)


@pytest.mark.parametrize("strategy", ["full", "every:2", "optimal@min"])
def test_a_block_recomputes_on_a_list_as_it_was_called_with(strategy: str) -> None:
    """NOTE [ Arguments as they were called ] in wrap.py: the model appends to the list
    it gave a block after the block returned; the recompute stacked the later features
    too, and torch's checkpoint raised (recomputed tensors of other shapes)."""
    torch.manual_seed(0)
    model, inputs = DenseChain(), (torch.randn(64, 32),)
    tape = autoremat.profile(model, inputs, repeats=1)
    plan = make_plan(tape, strategy)
    assert any(d.decision.recomputes for d in plan.blocks)
    assert_same_step(model, inputs, plan)


def test_a_checkpoint_does_not_hold_the_list_its_block_was_called_with() -> None:
    """NOTE [ Arguments as they were called ]: a checkpoint holding the caller's list kept
    every later layer's output alive to its layer's backward, where the plain step frees
    them when its forward returns: recomputing the first layer and keeping four measured
    four outputs over the prediction. No plan of single blocks measures over its own."""
    torch.manual_seed(0)
    model, inputs = DenseChain(), (torch.randn(64, 32),)
    tape = autoremat.profile(model, inputs, repeats=1, timing=False, with_selective=False)
    peaks = single_block_plans(model, inputs, tape)
    assert all(measured <= predicted for predicted, measured in peaks.values()), peaks


def test_tied_weights_stay_tied(tapes: Callable[[str], Tape]) -> None:
    model, inputs = build("gpt2")
    autoremat.apply(model, make_plan(tapes("gpt2"), "full"))
    assert model.lm_head.weight is model.wte.weight
    assert "lm_head.weight" in model.state_dict()
    _, grads = step(model, inputs)
    assert "lm_head.weight" not in grads  # one parameter, one gradient
    autoremat.remove(model)
    _, plain = step(model, inputs)
    assert torch.equal(grads["wte.weight"], plain["wte.weight"])
    shared, (x,) = _custom("shared")
    autoremat.apply(shared, make_plan(autoremat.profile(shared, x, repeats=1), "full"))
    assert all(b.shared is shared.blocks[0].shared for b in shared.blocks)


# --- eval / no_grad ----------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["full", "sqrt", "selective", "optimal@mid"])
def test_eval_and_no_grad_match_the_plain_model(tapes: Callable[[str], Tape],
                                                strategy: str) -> None:
    model, inputs = build("gpt2")
    plan = make_plan(tapes("gpt2"), strategy)

    def outputs() -> list[torch.Tensor]:
        out = []
        model.eval()
        with torch.no_grad():
            out += [call(model, inputs).logits]
        out += [call(model, inputs).logits.detach()]  # eval with grad enabled
        model.train()
        torch.manual_seed(1)
        with torch.no_grad():  # train mode without grad: dropout from the same seed
            out += [call(model, inputs).logits]
        return out

    plain = outputs()
    autoremat.apply(model, plan)
    planned = outputs()
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))
    model.eval()
    assert_same_step(model, inputs, plan)  # an eval-mode step with grads: also equal


# --- Hugging Face transformers -----------------------------------------------------------------


@pytest.mark.slow
def test_a_plan_that_recomputes_nothing_also_turns_the_kv_cache_off() -> None:
    # The plan was profiled without a cache; a loop holding the output would hold one.
    model, inputs = hf_model("gpt2", None)
    assert model.config.use_cache is True
    tape = autoremat.profile(model, inputs, repeats=1, with_selective=False)
    plan = autoremat.plan(tape, None, "none")
    assert plan.recompute_blocks == 0
    with pytest.warns(UserWarning, match="KV cache the plan's figures do not include"):
        autoremat.apply(model, plan)
    try:
        assert model.config.use_cache is False
        with autoremat.track_memory() as mem:
            out = model(**{k: v for k, v in inputs.items() if k != "use_cache"})
            out.loss.backward()
            assert getattr(out, "past_key_values", None) is None
        model.zero_grad(set_to_none=True)
        assert mem.peak_bytes <= plan.predicted_peak_bytes
        with warnings.catch_warnings():  # verify puts the plan back without a second one
            warnings.filterwarnings("error", message="autoremat: use_cache")
            assert autoremat.verify(model, inputs, repeats=1).ok
        assert model.config.use_cache is False
    finally:
        autoremat.remove(model)
    assert model.config.use_cache is True  # restored


@pytest.mark.parametrize(("name", "use_cache"), [
    ("gpt2", False),
    ("llama", False),
    ("bert", None),
])
def test_hugging_face_recompute_flops_are_predicted(name: str, use_cache: bool | None) -> None:
    model, inputs = hf_model(name, use_cache)
    tape = autoremat.profile(model, inputs, repeats=1, with_selective=False)
    plan = autoremat.plan(tape, None, "full")
    autoremat.apply(model, plan)
    report = autoremat.verify(model, inputs, repeats=1)
    assert report.grads_equal
    assert report.recompute_flops == pytest.approx(plan.predicted_recompute_flops, rel=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "mlp"])
def test_zoo_keep_sets_are_exact_predicted_and_skip_dead_ops(name: str) -> None:
    # Keep-sets by position (NOTE [ Dead ops ]): every one the tape offers, on every block.
    model, inputs = zoo.build(name, n_layer=3) if name != "mlp" else zoo.build(name)
    tape = autoremat.profile(model, inputs, repeats=1)
    names = sorted(set.intersection(*({n for n in b.selective if is_keep_set(n)}
                                      for b in tape.blocks)))
    if name != "mlp":  # transformer blocks: a front of keep-sets, each with dead ops
        assert len(names) >= 2
        assert all(tape.blocks[1].selective[n].skip_ops for n in names)
    assert names
    block = tape.blocks[1]
    holds = [block.selective[n].fwd.delta_bytes for n in names]
    costs = [keep_set_cost(block.ops, block.selective[n].keep_ops, block.selective[n].skip_ops,
                           cost_model_for(tape.device)) for n in names]
    assert holds == sorted(holds) and costs == sorted(costs, reverse=True)  # more kept, less run
    for key in names:
        options = [(i, i + 1, Choice.selective_from_key(key)) for i in range(len(tape.blocks))]
        plan = plan_of_segments(tape, options, f"selective:{key}")
        assert "keep the outputs of" in str(plan)
        assert Plan.from_json(plan.to_json()) == plan
        autoremat.apply(model, plan)
        report = autoremat.verify(model, inputs, repeats=1)
        autoremat.remove(model)
        assert report.grads_equal, (key, report.max_grad_diff)
        assert report.peak_bytes == report.predicted_peak_bytes, key
        assert report.recompute_flops == plan.predicted_recompute_flops, key


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_hugging_face_every_selective_option_is_exact_and_predicted(name: str) -> None:
    # Each save-set the tape measured, applied to every block: HF attention code (SDPA with
    # dropout, rotary embeddings, in-place residual adds) under the selective dispatch modes.
    model, inputs = hf_model(name, False if name != "bert" else None)
    tape = autoremat.profile(model, inputs, repeats=1)
    names = set.intersection(*(set(b.selective) for b in tape.blocks))
    assert names, "every block should have selective options"
    assert any(is_keep_set(n) for n in names), "and keep-sets by position"
    for save_name in sorted(names):
        options = [(i, i + 1, Choice.selective_from_key(save_name))
                   for i in range(len(tape.blocks))]
        plan = plan_of_segments(tape, options, f"selective:{save_name}")
        autoremat.apply(model, plan)
        report = autoremat.verify(model, inputs, repeats=1)
        autoremat.remove(model)
        assert report.grads_equal, (save_name, report.max_grad_diff)
        assert abs(report.prediction_error) <= 0.05, (save_name, report.prediction_error)
        assert report.recompute_flops == pytest.approx(plan.predicted_recompute_flops,
                                                       rel=0.02, abs=1), save_name




def test_a_plan_for_a_narrower_model_of_the_same_class_is_refused() -> None:
    """Issue 16: same class and block names, other widths: the plan's figures describe
    another model, and it measured 5.8x over its budget before this check."""
    small, inputs = autoremat.zoo.build("gpt2", n_layer=2, n_embd=64, batch_size=2, seq_len=16)
    wide, _ = autoremat.zoo.build("gpt2", n_layer=2, n_embd=128, batch_size=2, seq_len=16)
    chosen = autoremat.plan(autoremat.profile(small, inputs, with_selective=False,
                                              timing=False), strategy="full")
    assert all(b.params for b in chosen.blocks)
    with pytest.raises(autoremat.PlanMismatchError, match=r"'blocks\.0' has parameters of "
                       r"other names, shapes or dtypes.*Profile and plan this model"):
        autoremat.apply(wide, chosen)
    assert autoremat.applied_plan(wide) is None
    with pytest.raises(autoremat.PlanMismatchError, match="cast model"):
        autoremat.apply(small.to(torch.float64), chosen)
    autoremat.apply(small.to(torch.float32), chosen)  # the model it was made for
    assert autoremat.applied_plan(small) is chosen


# NOTE [ The modules as the forward found them ] (wrap.py): what a recompute reads of its
# modules is what their forward found, whatever the loop changed between the two.

_FOUND_PLANS = ["full", "sqrt", "optimal@min"]


def _planned_run(model: nn.Module, plan: Plan, run: Callable[[], Any]) -> tuple[Any, int]:
    """``run()`` with ``plan`` applied to ``model`` (removed after, whatever happens): its
    result and the peak ``track_memory`` measured."""
    autoremat.apply(model, plan)
    try:
        with autoremat.track_memory() as mem:
            return run(), mem.peak_bytes
    finally:
        autoremat.remove(model)


def _gpt2_grads(model: nn.Module, inputs: Any, between: Callable[[nn.Module], Any],
                params: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Gradients of one step of ``model`` (of the tensors ``params`` when given, through
    ``torch.func.functional_call``) with ``between(model)`` run between the forward and
    the backward."""
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    if params is None:
        loss = call(model, inputs).loss
    else:
        loss = torch.func.functional_call(model, params, (), inputs).loss
    between(model)
    loss.backward()
    return [t.grad for t in (params.values() if params is not None else model.parameters())]


@pytest.mark.parametrize("strategy", _FOUND_PLANS)
def test_a_recompute_reads_the_parameters_functional_call_passed(
        strategy: str, tapes: Callable[[str], Tape]) -> None:
    # the tensors passed for the call, not the module's own, which functional_call has
    # put back by the backward (a hypernetwork's weights, MAML's fast weights): their
    # gradients differed from the plain model's by up to 70% with no warning
    model, inputs = build("gpt2")
    torch.manual_seed(1)
    other = {n: p.detach() + 0.1 * torch.randn_like(p) for n, p in model.named_parameters()}

    def passed() -> dict[str, torch.Tensor]:
        return {n: t.clone().requires_grad_() for n, t in other.items()}
    plain = _gpt2_grads(model, inputs, lambda m: None, passed())
    plan = make_plan(tapes("gpt2"), strategy)
    assert recomputing(plan)
    planned, _ = _planned_run(model, plan,
                              lambda: _gpt2_grads(model, inputs, lambda m: None, passed()))
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))
    assert all(p.grad is None for p in model.parameters())  # the module's own got none


@pytest.mark.parametrize("strategy", _FOUND_PLANS)
@pytest.mark.parametrize("change", ["dropout p", "eval"])
def test_a_recompute_reads_the_attributes_its_forward_found(
        strategy: str, change: str, tapes: Callable[[str], Tape]) -> None:
    # a schedule that sets dropout's p (or a model put in eval mode) between a forward
    # and its backward changed the recompute's draws, silently
    def between(model: nn.Module) -> None:
        if change == "eval":
            model.eval()
            return
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.5
    model, inputs = build("gpt2")
    plain = _gpt2_grads(model, inputs, between)
    model.train()
    plan = make_plan(tapes("gpt2"), strategy)
    autoremat.apply(model, plan)
    try:
        model.apply(lambda m: setattr(m, "p", 0.1) if isinstance(m, nn.Dropout) else None)
        planned = _gpt2_grads(model, inputs, between)
        dropout = next(m for m in model.modules() if isinstance(m, nn.Dropout))
        assert dropout.p == (0.5 if change == "dropout p" else 0.1)  # as the loop set it
        assert model.training is (change != "eval")
    finally:
        autoremat.remove(model)
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))


@pytest.mark.parametrize("strategy", _FOUND_PLANS)
def test_a_parameter_changed_in_place_before_the_recompute_is_refused_by_name(
        strategy: str, tapes: Callable[[str], Tape]) -> None:
    # an optimizer step between a forward and its backward through it (a GAN stepping
    # its discriminator first): plain PyTorch raises for the weights it saved, and a
    # recompute would compute with the new values
    model, inputs = build("gpt2")
    plan = make_plan(tapes("gpt2"), strategy)
    autoremat.apply(model, plan)
    recomputed = next(b.name for b in plan.blocks if b.decision is not Decision.KEEP)
    weight = model.get_submodule(recomputed).attn.c_attn.weight
    try:
        loss = call(model, inputs).loss
        with torch.no_grad():
            weight.add_(1.0)
        with pytest.raises(RematError, match=r"parameter 'attn\.c_attn\.weight' was changed "
                                             r"in place after its forward"):
            loss.backward()
    finally:
        autoremat.remove(model)


def test_a_plan_is_found_and_removed_from_a_model_holding_its_blocks() -> None:
    # NOTE [ A plan found from its blocks ]: PEFT's merge_and_unload() returns the base
    # model from inside the PeftModel a plan was applied to; its blocks stayed wrapped,
    # applied_plan said None and remove did nothing
    class Outer(nn.Module):  # holds the model, as a PeftModel does
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.base_model = inner

        def forward(self, **kwargs: Any) -> Any:
            return self.base_model(**kwargs)

    model, inputs = build("gpt2")
    before = snapshot(model)
    outer = Outer(model)
    tape = autoremat.profile(outer, inputs, timing=False, with_selective=False)
    plan = autoremat.plan(tape, strategy="full")
    autoremat.apply(outer, plan)
    assert autoremat.applied_plan(model) is plan
    autoremat.remove(model)  # the base model alone
    assert snapshot(model) == before
    assert all(is_wrapped(m) is None for m in model.modules())
    assert autoremat.applied_plan(model) is None and autoremat.applied_plan(outer) is None
    autoremat.remove(outer)  # (undone already: nothing to do)
    assert snapshot(model) == before


@pytest.mark.parametrize("strategy", ["optimal@mid", "selective", "full"])
def test_a_backward_inside_the_autocast_region_is_the_profiled_step(strategy: str) -> None:
    # NOTE [ Backward inside autocast ] (wrap.py): autocast's cached weight casts were
    # held through the backward and found by the recompute, which then ran no cast: a
    # selective plan was refused, the others measured up to 27% over their predictions
    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm, self.up = nn.LayerNorm(width), nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(F.gelu(self.up(self.norm(x))))

    torch.manual_seed(0)
    model = nn.Sequential(*(Block(64) for _ in range(4)), nn.Linear(64, 10))
    x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y)

    def grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_fn(model(x)).backward()  # inside the region
        return [p.grad for p in model.parameters()]
    plain = grads()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tape = autoremat.profile(model, x, loss_fn=loss_fn, timing=False)
    plan = make_plan(tape, strategy)
    assert recomputing(plan)
    planned, peak = _planned_run(model, plan, grads)
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))
    assert peak <= plan.predicted_peak_bytes


class _AuxBlock(nn.Module):
    """Keeps an auxiliary loss on itself in forward, as fairseq's and DeepSpeed's MoE
    layers keep their load-balancing loss."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(width, 4), nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).softmax(-1)
        self.aux_loss = (probs.mean(0) ** 2).sum()
        return x + self.down(F.gelu(self.up(x)))


@pytest.mark.parametrize("strategy", ["sqrt", "full", "optimal@min"])
def test_what_a_recompute_assigns_to_its_modules_is_put_back(strategy: str) -> None:
    # NOTE [ The modules as the forward found them ] (wrap.py): the recompute of a
    # segment's inner blocks set their aux_loss again, whose graph held the recompute's
    # tensors until the next forward (16% over budget on a held-out MoE)
    torch.manual_seed(0)
    model = nn.Sequential(*(_AuxBlock(64) for _ in range(6)))
    x = torch.randn(256, 64)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean() + 0.01 * sum(b.aux_loss for b in model)  # type: ignore[misc]

    def run() -> tuple[list[torch.Tensor], list[Any]]:
        model.zero_grad(set_to_none=True)
        loss_fn(model(x)).backward()
        return [p.grad for p in model.parameters()], [b.aux_loss for b in model]
    plain, _ = run()
    tape = autoremat.profile(model, x, loss_fn=loss_fn, timing=False)
    plan = make_plan(tape, strategy)
    assert recomputing(plan)
    (planned, kept), peak = _planned_run(model, plan, run)
    assert peak <= plan.predicted_peak_bytes
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))
    assert all(aux is not None and aux.grad_fn is not None for aux in kept)
    if strategy == "sqrt":  # segments of several blocks
        assert len({b.segment for b in plan.blocks}) < len(plan.blocks)


class _StateReader(nn.Module):
    """Reads a state its parent sets before the call and clears it (a read is followed by
    the next set), as block-recurrent-transformer-pytorch's state containers do."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.next_state: tuple[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.next_state is not None, "set the state first"
        (state,), self.next_state = self.next_state, None
        return x + self.down(F.gelu(self.up(x + state)))


class _Recurrent(nn.Module):
    def __init__(self, width: int = 32, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_StateReader(width) for _ in range(n))
        self.states = nn.Parameter(torch.randn(n, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, state in zip(self.layers, self.states, strict=True):
            layer.next_state = (state,)
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("strategy", ["sqrt", "full", "selective"])
def test_a_state_the_forward_consumes_is_there_for_its_recompute(strategy: str) -> None:
    # NOTE [ The modules as the forward found them ] (wrap.py): the recompute found the
    # state cleared and raised (only numbers and strings were put back as found)
    torch.manual_seed(0)
    model = _Recurrent()
    x = torch.randn(64, 32)

    def run() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        return [p.grad for p in model.parameters()]
    plain = run()
    tape = autoremat.profile(model, x, loss_fn=lambda out: out.pow(2).mean(), timing=False)
    plan = make_plan(tape, strategy)
    assert recomputing(plan)
    planned, peak = _planned_run(model, plan, run)
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))
    assert peak <= plan.predicted_peak_bytes
    assert all(layer.next_state is None for layer in model.layers)  # as the forward left it


class _Clamped(nn.Module):
    """Clamps its own weight in forward (a constrained layer), as nn.Embedding(max_norm=)
    renormalizes its rows: its recompute does again."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.weight.clamp_(-0.1, 0.1)
        return x + F.gelu(self.lin(x))


@pytest.mark.parametrize("strategy", ["full", "sqrt"])
def test_a_parameter_the_forward_changes_itself_is_recomputed_exactly(strategy: str) -> None:
    # NOTE [ The modules as the forward found them ]: versions are noted as the forward
    # leaves them (from its start, the first version refused the forward's own change)
    torch.manual_seed(0)
    model = nn.Sequential(*(_Clamped(32) for _ in range(4)))
    x = torch.randn(64, 32)

    def grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        return [p.grad for p in model.parameters()]
    plain = grads()
    tape = autoremat.profile(model, x, timing=False, with_selective=False)
    planned, _ = _planned_run(model, make_plan(tape, strategy), grads)
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))


class _Unversioned(nn.Module):
    """Updates a running range in place without moving its version (as torch.ao's fused
    fake-quantize does), then computes with it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("top", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.top):
            self.top.mul_(0.9).add_(0.1 * x.abs().max())
        return x + F.gelu(self.lin(x)) / self.top


def test_a_buffer_changed_without_its_version_is_recomputed_as_found() -> None:
    # NOTE [ Buffers a forward changes ]: the profile's first step compares the buffers'
    # values too; a QAT model's observers were updated twice per step and its gradients
    # drifted from the plain model's from the second step, silently
    torch.manual_seed(0)
    model = nn.Sequential(*(_Unversioned(64) for _ in range(4)))
    plain_model = copy.deepcopy(model)
    x = torch.randn(256, 64)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean()

    def steps(m: nn.Module) -> list[torch.Tensor]:
        out = []
        for _ in range(3):
            m.zero_grad(set_to_none=True)
            loss_fn(m(x)).backward()
            out += [p.grad.clone() for p in m.parameters()] + [b.clone() for b in m.buffers()]
        return out
    plan = autoremat.auto(model, x, budget="75%", loss_fn=loss_fn)
    assert recomputing(plan)
    assert all(torch.equal(a, b) for a, b in zip(steps(plain_model), steps(model), strict=True))
    autoremat.remove(model)
