"""The held-out check (``benchmarks/heldout.py``): a model's plans measured against their
predictions, as the thirty-second session ran it on x-transformers and vit-pytorch."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from _steps import ResidualMlp
from conftest import load_benchmark


def test_a_model_with_a_view_layer_is_checked_plan_by_plan(tmp_path: Path) -> None:
    heldout = load_benchmark("heldout")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), ResidualMlp(32), nn.Flatten(), nn.Linear(512, 64),
                          ResidualMlp(64), ResidualMlp(64))
    rec = heldout.check("flatten", model, torch.randn(8, 16, 32),
                        lambda y: y.pow(2).mean(), max_segment=3, mixed=2)
    assert rec["blocks"] == ["0", "1", "3", "4", "5"]  # the view layer runs between them
    found = heldout.verdict(rec)
    assert found["plans"] >= 15 and found["exact"] >= 1, found
    assert found["under"] == found["over_budget"] == found["differ"] == found["raised"] == 0
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps(rec) + "\n" + json.dumps({"name": "refused", "bf16": False,
                                                        "plans": [], "exc": ["BlockError",
                                                                             "no chain"]}))
    totals = heldout.summary(str(log))
    assert totals["models"] == 2 and totals["refused"] == {"refused": "no chain"}
    assert totals["plans"] == found["plans"] and totals["found"] == {}


def test_the_x_transformers_models_need_the_library_or_a_known_configuration() -> None:
    heldout = load_benchmark("heldout")
    if importlib.util.find_spec("x_transformers") is None:
        with pytest.raises(SystemExit, match="pip install x-transformers"):
            heldout.x_transformers("base")
    else:
        with pytest.raises(SystemExit, match="no x-transformers configuration 'nope'"):
            heldout.x_transformers("nope")
