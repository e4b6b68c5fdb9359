"""Tests for autoremat._plan.costs: which device's rates a tape's plans are costed with."""

from __future__ import annotations

import pytest

import autoremat
from autoremat import zoo
from autoremat._core.errors import RematError
from autoremat._estimate.estimate import estimate
from autoremat._plan.costs import _MODELS, cost_model_for, recompute_cost


@pytest.mark.parametrize(("device", "rates"), [
    ("cpu", "cpu"), ("cuda", "cuda"), ("cuda:1", "cuda"),
])
def test_cost_model_of_a_known_device(device: str, rates: str) -> None:
    assert cost_model_for(device) == _MODELS[rates]


@pytest.mark.parametrize("device", ["meta", "tpu", "", "cpux"])
def test_cost_model_of_an_unknown_device_is_an_error(device: str) -> None:
    # It used to be the CUDA rates, whatever the device: a CPU estimate planned with GPU costs.
    with pytest.raises(RematError, match=f"no recompute cost rates for device {device!r}"):
        cost_model_for(device)


@pytest.mark.slow
def test_an_estimate_for_the_cpu_plans_with_the_cpu_rates() -> None:
    model, inputs = zoo.build("mlp", device="meta")
    est = estimate(model, inputs, device="cpu")
    tape = est.tape
    assert tape is not None
    assert tape.device == "cpu"  # the device it is for, not "meta" where it ran
    full = autoremat.plan(tape, strategy="full")  # every block recomputed on its own
    cpu = cost_model_for("cpu")
    assert full.predicted_cost == sum(recompute_cost(b.op_stats, b.fwd_flops, cpu)
                                      for b in tape.blocks)
    cuda = cost_model_for("cuda")
    assert full.predicted_cost != sum(recompute_cost(b.op_stats, b.fwd_flops, cuda)
                                      for b in tape.blocks)
    assert autoremat.Tape.from_json(tape.to_json()).device == "cpu"


def test_profile_on_meta_is_told_the_device_it_is_for() -> None:
    model, inputs = zoo.build("mlp", device="meta", widths=(16, 16, 16), batch_size=2)
    with pytest.raises(RematError, match="device="):
        autoremat.profile(model, inputs, repeats=1)
    tape = autoremat.profile(model, inputs, repeats=1, device="cuda")
    assert tape.device == "cuda"
