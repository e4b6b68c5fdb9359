"""The peak model never predicts below the measured step: regression cases found by
measuring ``plan()`` + ``apply()`` on the zoo (NOTE [ The peak model ] in
``_plan/peak.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import autoremat
from autoremat import Tape, zoo
from autoremat._core.decisions import KEEP, RECOMPUTE, Choice
from autoremat._plan.plan import plan_of_segments
from autoremat._plan.strategies import smallest_feasible_bytes
from autoremat._verify import step_measure

from conftest import SMALL


def _measured(name: str, plan: autoremat.Plan) -> int:
    model, inputs = zoo.build(name, **SMALL[name])  # the model the tape was measured on
    autoremat.apply(model, plan)
    return step_measure(autoremat.Step(model, inputs)).peak_bytes


@pytest.mark.parametrize("name", ["resnet", "gpt2"])
def test_a_selective_block_before_kept_ones_is_predicted_from_above(
        name: str, zoo_tapes: Callable[..., Tape]) -> None:
    # NOTE [ A selective block that keeps its output ]: on the ResNet a keep-set that
    # keeps the block's final ReLU, before kept blocks, measured one activation over
    # its prediction
    tape = zoo_tapes(name, **SMALL[name])
    n = len(tape.blocks)
    checked = 0
    for i, block in enumerate(tape.blocks):
        for key in sorted(block.selective):
            choice = Choice.selective_from_key(key)
            segments = [(k, k + 1, choice if k == i else KEEP) for k in range(n)]
            plan = plan_of_segments(tape, segments, "test")
            assert _measured(name, plan) <= plan.predicted_peak_bytes, (block.name, key)
            checked += 1
    assert checked >= n


def test_the_smallest_feasible_resnet_plan_fits_its_prediction(
        zoo_tapes: Callable[..., Tape]) -> None:
    # its BudgetError named a smallest feasible budget whose plan measured what the plan
    # that checkpoints the same blocks does, one activation over it
    tape = zoo_tapes("resnet", **SMALL["resnet"])
    least = smallest_feasible_bytes(tape)
    plan = autoremat.plan(tape, least)
    assert plan.predicted_peak_bytes <= least
    assert _measured("resnet", plan) <= least


def test_what_the_model_makes_before_the_first_block_is_counted_held() -> None:
    # NOTE [ Released when the forward returns ]: a Hugging Face Llama given no
    # position_ids makes them before its first layer and passes them to every layer; a
    # checkpoint of any layer holds them until its backward, where the plain step frees
    # them when the forward returns (measured 512 bytes over every plan that recomputed
    # block 0, at 64 tokens)
    from conftest import hf_model

    model, inputs = hf_model("llama", None, layers=4, seq_len=64)
    assert "position_ids" not in inputs
    tape = autoremat.profile(model, inputs, timing=False)
    kept = (autoremat.Decision.KEEP, autoremat.Decision.KEEP)
    assert tape.blocks[0].fwd_end_release.get(kept, 0) > 0
    for pattern in ("kkkk", "rkkk", "krkk", "kkkr", "rkrk", "rrrr"):
        segments = [(i, i + 1, RECOMPUTE if c == "r" else KEEP)
                    for i, c in enumerate(pattern)]
        plan = plan_of_segments(tape, segments, "test")
        autoremat.apply(model, plan)
        measured = step_measure(autoremat.Step(model, inputs)).peak_bytes
        autoremat.remove(model)
        assert measured <= plan.predicted_peak_bytes, pattern
        assert plan.predicted_peak_bytes - measured <= 1024, pattern  # and no more
    assert [b.decision for b in autoremat.plan(tape, "100%").blocks] == ["keep"] * 4
