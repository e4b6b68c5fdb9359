"""``benchmarks/profile_cost.py`` at its tiny size: the reports' structure, and every cost a
positive number of seconds and of plain steps. ``slow``: each profiles real models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from autoremat._bench.report import device_info

from conftest import load_benchmark

cost = load_benchmark("profile_cost")
CALLS = ["profile", "profile(with_selective=False)", "auto@60%"]


@pytest.fixture(autouse=True)
def _threads() -> object:
    """main() sets torch's thread count (--threads 1): put it back for the other tests."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _header_ok(payload: dict, md: str) -> None:  # type: ignore[type-arg]
    name = device_info("cpu")["device_name"]
    assert payload["device"] == name and name in md
    assert payload["torch"] == torch.__version__ and payload["threads"] == 1
    assert payload["date"] and payload["schema_version"] == 1


@pytest.mark.slow
def test_cost_table_tiny(tmp_path: Path) -> None:
    md = cost.main(["--size", "tiny", "--models", "zoo-gpt2,hf-llama", "--steps", "2",
                    "--out", str(tmp_path), "--tag", "t"])
    assert md == tmp_path / "profile_cost_t.md"
    payload = json.loads((tmp_path / "profile_cost_t.json").read_text())
    text = md.read_text()
    _header_ok(payload, text)
    assert [r["model"] for r in payload["rows"]] == ["zoo-gpt2", "hf-llama"]
    for r in payload["rows"]:
        assert len(r["plain_step_all_s"]) == 2 and r["plain_step_s"] > 0
        assert r["blocks"] == 2  # the tiny models' two layers, found by profile
        assert list(r["calls"]) == CALLS
        for call in r["calls"].values():
            assert math.isfinite(call["plain_steps"]) and call["plain_steps"] > 0
            assert call["plain_steps"] == pytest.approx(call["seconds"] / r["plain_step_s"])
            assert call["rounds_plain_steps"] == [call["plain_steps"]]  # one round at tiny
        # a profile is many measured steps: it costs more than one plain step
        assert r["calls"]["profile"]["plain_steps"] > 1
        assert f"| {r['model']} |" in text
        # its stages, in the order it reported them, add up to the call less its checks
        stages = [st["stage"] for st in r["profile_stages"]]
        assert stages[0] == "warm-up step" and stages[-1].startswith("timing")
        assert "selective keep-sets" in stages and "loss head options" in stages
        spent = sum(st["seconds"] for st in r["profile_stages"])
        assert 0.5 * r["calls"]["profile"]["seconds"] < spent <= r["calls"]["profile"]["seconds"]
    # both measure two memory runs: their pairs are local (NOTE [ Pairs that cannot
    # differ ]; hf-llama's position ids took it two more until 2026-11-30)
    assert not any(line.startswith("| memory runs 3/4 |") for line in text.splitlines())
    assert text.index("| memory runs 2/4 |") < text.index("| selective keep-sets |")
    # what the first profile of a process pays once, apart; ops per step; no probe on CPU
    assert payload["first_use_imports_s"] >= 0 and "once per process" in text
    assert all(r["ops_per_step"] > 100 for r in payload["rows"])
    assert payload["probe_us"] is None and "allocator probe" not in text


@pytest.mark.slow
def test_heldout_tiny(tmp_path: Path) -> None:
    cost.main(["--heldout", "--size", "tiny", "--models", "opt", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "profile_cost_heldout.json").read_text())
    _header_ok(payload, (tmp_path / "profile_cost_heldout.md").read_text())
    rows = payload["rows"]
    assert [r["budget"] for r in rows] == ["90%", "60%", "1 B (finds the minimum)", "min x1.1"]
    smallest = rows[2]["min_feasible_bytes"]
    assert rows[2]["outcome"].startswith("BudgetError") and smallest > 1
    assert rows[3]["outcome"] == "ok" and rows[3]["budget_bytes"] == int(1.1 * smallest)
    assert rows[3]["predicted_peak_bytes"] <= rows[3]["budget_bytes"]
    assert all(r["seconds"] > 0 for r in rows)
    assert payload["total_s"] == pytest.approx(sum(r["seconds"] for r in rows))
    assert payload["cold"] is False and "as a user's sweep would" in \
        (tmp_path / "profile_cost_heldout.md").read_text()
    # --cold: every call forgets the keep-sets solved before it; its own file
    cost.main(["--heldout", "--cold", "--size", "tiny", "--models", "opt", "--out",
               str(tmp_path)])
    cold = json.loads((tmp_path / "profile_cost_heldout_cold.json").read_text())
    assert cold["cold"] is True and "--cold" in cold["command"]
    assert [r["outcome"] for r in cold["rows"]] == [r["outcome"] for r in rows]
    assert [r.get("predicted_peak_bytes") for r in cold["rows"]] == \
        [r.get("predicted_peak_bytes") for r in rows]  # the same plans, solved again


def test_cold_is_for_the_heldout_check(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cost.main(["--cold"])
    assert "--cold is for --heldout" in capsys.readouterr().err


def test_unknown_model_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cost.main(["--models", "gpt3"])
    assert "unknown model(s) ['gpt3']" in capsys.readouterr().err


@pytest.mark.slow
def test_cost_is_the_median_of_rounds(tmp_path: Path) -> None:
    cost.main(["--size", "tiny", "--models", "zoo-gpt2", "--steps", "2", "--rounds", "3",
               "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "profile_cost.json").read_text())
    (row,) = payload["rows"]
    assert payload["rounds"] == row["rounds"] == 3 and len(row["plain_step_all_s"]) == 6
    for call in row["calls"].values():
        ratios = call["rounds_plain_steps"]
        assert len(ratios) == 3 and call["plain_steps"] == sorted(ratios)[1]
    assert "medians of 3 round(s)" in (tmp_path / "profile_cost.md").read_text()
    with pytest.raises(SystemExit):
        cost.main(["--size", "tiny", "--rounds", "0", "--out", str(tmp_path)])
