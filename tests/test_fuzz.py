"""The fuzzer (``benchmarks/fuzz.py``): a few of its random models, whose plans measure
at or under their predictions with the plain model's gradients. Its long runs found the
defects the twentieth to twenty-second sessions fixed (CHANGELOG)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import load_benchmark


def test_the_fuzzer_runs_and_its_first_models_hold_their_predictions(tmp_path: Path) -> None:
    fuzz = load_benchmark("fuzz")
    log = tmp_path / "fuzz.jsonl"
    fuzz.run(0, 3, str(log))
    found = fuzz.summary(str(log))
    assert found["models"] == 3 and found["plans"] > 30
    assert not found["refused"]
    assert dict(found["under"]) == {} and found["over_budget"] == []
    assert found["grads_differ"] == []
    assert sum(found["exact"].values()) > found["plans"] // 2


def test_the_fuzzer_builds_on_the_device_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    # FUZZ_DEVICE=cuda runs it on a GPU; meta shows the models and batches go there
    fuzz = load_benchmark("fuzz")
    monkeypatch.setenv("FUZZ_DEVICE", "meta")
    for seed in range(4):
        model, x, loss_fn = fuzz.build(fuzz.make_spec(seed))
        assert {p.device.type for p in model.parameters()} == {"meta"}
        assert x.device.type == "meta" and loss_fn(model(x)).device.type == "meta"
