"""Tests for autoremat.auto: profile, plan, apply and measure in one call.

Each test compares a step of the model ``auto`` planned with a step of the plain model
(``assert_same_step`` in _steps.py) or checks the model is left as it was.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoremat
from autoremat import zoo
from autoremat._core.errors import BudgetError
from autoremat._core.units import format_bytes
from autoremat._plan.strategies import smallest_feasible_bytes

from _steps import assert_same_step, recomputing, snapshot
from conftest import MEDIUM, hf_model

# --- the model, before and after ---------------------------------------------------------


def test_auto_profiles_plans_and_applies() -> None:
    model, inputs = zoo.build("mlp", **MEDIUM["mlp"])
    before = snapshot(model)
    plan = autoremat.auto(model, inputs, budget="70%")
    assert autoremat.applied_plan(model) is plan
    assert plan.budget_bytes is not None and plan.predicted_peak_bytes <= plan.budget_bytes
    assert recomputing(plan)
    assert_same_step(model, inputs, plan)
    again = autoremat.auto(model, inputs, budget="90%")  # re-plans the plain model
    assert autoremat.applied_plan(model) is again
    assert again.unplanned_peak_bytes == plan.unplanned_peak_bytes
    autoremat.remove(model)
    assert snapshot(model) == before


def test_auto_with_an_impossible_budget_leaves_the_model_alone() -> None:
    model, inputs = zoo.build("mlp", **MEDIUM["mlp"])
    before = snapshot(model)
    with pytest.raises(BudgetError) as info:
        autoremat.auto(model, inputs, budget=1000)
    assert info.value.min_feasible_bytes is not None and info.value.min_feasible_bytes > 1000
    assert autoremat.applied_plan(model) is None
    assert snapshot(model) == before


@pytest.mark.slow
def test_auto_with_the_head_kept_says_what_a_chunked_head_reaches() -> None:
    # every route to a plan tells the same truth about the head: plan() on a tape that
    # measured the head said how far it goes; auto() (and the callbacks through it), which
    # measures no head option when the head is kept, said only that it "often needs less"
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=4096, n_positions=128, bos_token_id=0,
        eos_token_id=0)).train()
    ids = torch.randint(0, 4096, (4, 128))
    inputs = {"input_ids": ids, "labels": ids}
    tape = autoremat.profile(model, inputs, timing=False, with_head=True)
    with pytest.raises(BudgetError) as floor:
        autoremat.plan(tape, 1000, head="auto")
    chunked_min = floor.value.min_feasible_bytes
    kept_min = smallest_feasible_bytes(tape)
    assert chunked_min is not None and chunked_min < kept_min
    between = (chunked_min + kept_min) // 2
    with pytest.raises(BudgetError) as fits:
        autoremat.auto(model, inputs, budget=between)
    text = str(fits.value)
    assert "was kept (head=None); computed in chunks of tokens (chunked:" in text
    assert "a plan fits this budget" in text and "head='auto'" in text
    assert autoremat.applied_plan(model) is None
    with pytest.raises(BudgetError) as below:
        autoremat.auto(model, inputs, budget=chunked_min // 2)
    assert f"the smallest feasible budget is {format_bytes(chunked_min)} ({chunked_min} " \
        "bytes)" in str(below.value)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "use_cache"), [
    ("gpt2", None), ("llama", None), ("gpt2", False), ("llama", False), ("bert", None),
])
def test_hugging_face_models_auto_at_half_the_peak(name: str, use_cache: bool | None) -> None:
    model, inputs = hf_model(name, use_cache)
    cache_on = bool(getattr(model.config, "use_cache", False))
    try:
        # a KV cache is written again by every recompute: apply turns it off, and says so
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = autoremat.auto(model, inputs, budget="50%")
    except BudgetError as err:  # acceptable, if it says why
        assert err.min_feasible_bytes is not None
        pytest.fail(f"HF {name}: 50% infeasible, smallest {err.min_feasible_bytes} bytes")
    assert [b.name for b in plan.blocks][:1] in (["transformer.h.0"], ["model.layers.0"],
                                                 ["bert.encoder.layer.0"])
    report = autoremat.verify(model, inputs, repeats=1)
    assert report.grads_equal, f"max |diff| {report.max_grad_diff}"
    assert plan.budget_bytes is not None and report.peak_bytes <= plan.budget_bytes
    assert report.ok
    assert abs(report.prediction_error) <= 0.05
    assert_same_step(model, inputs, plan)
    if cache_on:
        assert any("use_cache" in str(w.message) for w in caught)
        assert model.config.use_cache is False
        autoremat.remove(model)
        assert model.config.use_cache is True  # restored


# --- skip connections: outputs held outside the chain -------------------------------------------


class _SkipBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv, self.norm, self.drop = nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(4, c), \
            nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        h = self.drop(F.silu(self.norm(self.conv(x))))
        return h + x if skip is None else h + x + skip


class _UNetish(nn.Module):
    """Down blocks whose outputs a list holds until the matching up block (U-Net style)."""

    def __init__(self, c: int = 16, n: int = 4) -> None:
        super().__init__()
        self.inp, self.out = nn.Conv2d(3, c, 3, padding=1), nn.Conv2d(c, 3, 1)
        self.down = nn.ModuleList(_SkipBlock(c) for _ in range(n))
        self.up = nn.ModuleList(_SkipBlock(c) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, skips = self.inp(x), []
        for block in self.down:
            h = block(h)
            skips.append(h)
        for block in self.up:
            h = block(h, skip=skips.pop())
        return F.mse_loss(self.out(h), x)


@pytest.mark.slow
def test_skip_connections_held_in_a_list_fit_every_budget() -> None:
    """The down blocks' outputs wait in the parent's list: profile finds them held
    (NOTE [ Boundaries held outside the chain ]) and every plan, multi-block segments
    included, measures within its budget."""
    torch.manual_seed(0)
    model, x = _UNetish(), torch.randn(4, 3, 32, 32)
    names = [f"down.{i}" for i in range(4)] + [f"up.{i}" for i in range(4)]
    tape = autoremat.profile(model, x, loss_fn=lambda out: out, blocks=names, repeats=1)
    assert [b.name for b in tape.blocks if b.chained and b.chain_bytes == 0] == \
        names[1:4]  # down.1..3 take an input the list holds until an up block
    for budget in ("75%", "60%", "50%", smallest_feasible_bytes(tape)):
        chosen = autoremat.plan(tape, budget)
        autoremat.apply(model, chosen)
        report = autoremat.verify(model, x, loss_fn=lambda out: out, repeats=1)
        autoremat.remove(model)
        assert report.grads_equal
        assert chosen.budget_bytes is not None
        assert report.peak_bytes <= chosen.budget_bytes, (budget, chosen)


@pytest.mark.slow
def test_auto_measures_and_corrects_a_peak_model_that_under_predicts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` measures the plan it applies and re-plans when the step goes over. The
    tape is made to under-predict as the peak model did before it knew held boundaries:
    inner boundaries of a segment counted as freed although the parent's list holds them."""
    import dataclasses

    import autoremat._auto

    torch.manual_seed(0)
    model, x = _UNetish(), torch.randn(4, 3, 32, 32)
    names = [f"down.{i}" for i in range(4)] + [f"up.{i}" for i in range(4)]
    tape = autoremat.profile(model, x, loss_fn=lambda out: out, blocks=names, repeats=1)
    fooled = dataclasses.replace(tape, blocks=tuple(
        dataclasses.replace(b, chain_bytes=b.input_bytes) if b.chained and not b.chain_bytes
        else b for b in tape.blocks))
    monkeypatch.setattr(autoremat._auto, "profile", lambda *args, **kwargs: fooled)
    over = {}  # budget -> (plan, measured peak) for plans that measure over their budget
    for budget in ("75%", "60%", "50%", "45%"):
        first = autoremat.plan(fooled, budget)
        autoremat.apply(model, first)
        report = autoremat.verify(model, x, loss_fn=lambda out: out, repeats=1)
        autoremat.remove(model)
        assert first.budget_bytes is not None
        if report.peak_bytes > first.budget_bytes:
            over[budget] = (first, report.peak_bytes)
    assert over, "the doctored tape predicts exactly; this test needs one that under-predicts"

    corrected = 0
    for budget, (first, peak) in over.items():
        try:
            chosen = autoremat.auto(model, x, budget=budget, loss_fn=lambda out: out,
                                    blocks=names)
        except BudgetError as exc:  # near the floor, the correction may not exist
            target = first.budget_bytes - (peak - first.predicted_peak_bytes)
            assert target < smallest_feasible_bytes(fooled), (budget, str(exc))
            assert "to make up for it does not exist" in str(exc)
            continue
        corrected += 1
        assert chosen.budget_bytes == first.budget_bytes
        assert any("so that the measured step fits" in n for n in chosen.notes)
        assert "note: planned for" in str(chosen)
        report = autoremat.verify(model, x, loss_fn=lambda out: out, repeats=1)
        assert report.grads_equal and report.peak_bytes <= chosen.budget_bytes
        autoremat.remove(model)
    assert corrected, over


def test_auto_judges_the_allocators_figure_where_there_is_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the allocator is the truth: where it reports more than the storages (its
    rounding, a block handed out whole), auto re-plans for a budget smaller by the
    overrun. Stood in on the CPU by an allocator figure 3% over the tracked one, at a
    budget the first plan meets exactly by its prediction."""
    import dataclasses
    from typing import Any

    import autoremat._auto
    from autoremat._measure.measured import measure_step

    seen: list[tuple[int, int]] = []

    def allocator_over(step: Any, **kwargs: Any) -> Any:
        found = measure_step(step, **kwargs)
        if not kwargs.get("allocator"):
            return found
        alloc = int(found.peak_bytes * 1.03)
        seen.append((found.peak_bytes, alloc))
        return dataclasses.replace(found, allocator_peak_bytes=alloc)

    model, inputs = zoo.build("gpt2", n_layer=6, batch_size=2, seq_len=64)
    tight = autoremat.plan(autoremat.profile(model, inputs, timing=False), "85%")
    monkeypatch.setattr(autoremat._auto, "measure_step", allocator_over)
    chosen = autoremat.auto(model, inputs, budget=tight.predicted_peak_bytes)
    assert len(seen) >= 2, "one overrun, then a plan for less"
    assert chosen.budget_bytes is not None
    assert seen[-1][1] <= chosen.budget_bytes < seen[0][1]
    assert any("so that the measured step fits" in n for n in chosen.notes)
