"""Smoke test of ``benchmarks/offload.py`` (issue 17's benchmark) at its tiny size on the
CPU: the script runs end to end and its reports hold every row. The figures themselves
are for a GPU; here only the simulated host (``--simulate-host``) frees anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import load_benchmark

bench = load_benchmark("offload")


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--simulate-host"]], ids=["cpu", "simulated-host"])
def test_offload_bench_tiny_on_cpu(tmp_path: Path, extra: list[str]) -> None:
    md = bench.main(["--device", "cpu", "--size", "tiny", "--rounds", "1",
                     "--out", str(tmp_path), *extra])
    report = json.loads(md.with_suffix(".json").read_text())
    text = md.read_text()
    assert md.exists() and md.with_suffix(".json").exists()
    assert ("simulated" in md.name) == bool(extra)
    assert [r["name"] for r in report["rows"]] == list(bench.ROWS)
    for name in bench.ROWS:
        assert f"| {name} |" in text
    rows = {r["name"]: r for r in report["rows"]}
    failed = {n: r["status"] for n, r in rows.items() if r["status"] != "ok"}
    assert not failed  # every row measured, gradients torch.equal, within budget
    assert all(r["grads_equal"] is True for r in rows.values())
    assert "Where the remaining peak sits" in text
    every = rows["autoremat-strategy-offload"]
    assert every["offloaded"] == len(every["plan"].split(", "))  # every block
    if extra:  # a separate (simulated) host: offloading frees memory, as predicted
        assert every["measured_peak_bytes"] == every["predicted_peak_bytes"]
        assert every["measured_peak_bytes"] < rows["plain"]["measured_peak_bytes"]
    else:  # the host is the device: nothing freed
        assert every["measured_peak_bytes"] == rows["plain"]["measured_peak_bytes"]
