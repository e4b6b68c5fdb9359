"""``benchmarks/tracker_overhead.py`` on its small workload: the report's structure and an
op count read by a mode that counts ops (no timing is judged here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoremat._bench.report import device_info

from conftest import load_benchmark

overhead = load_benchmark("tracker_overhead")


def test_small_workload_report(tmp_path: Path) -> None:
    assert overhead.main(["--rounds", "1", "--workloads", "small", "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("tracker_overhead_*.json")
    payload = json.loads(json_path.read_text())
    name = str(device_info("cpu")["device_name"])
    assert payload["device"] == name and payload["rounds"] == 1
    (row,) = payload["rows"]
    assert row["workload"] == "small" and row["ops"] > 2000  # 1000 adds and their backward
    assert set(row["seconds"]) == set(overhead.MODES)
    assert all(s > 0 for s in row["seconds"].values())
    assert set(row["us_per_op"]) == set(overhead.OVER)
    md = json_path.with_suffix(".md").read_text()
    assert name in md and "| small | " in md


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        overhead.main(["--rounds", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        overhead.main(["--workloads", "gpt3", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())
