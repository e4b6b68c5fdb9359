"""Smoke test of ``benchmarks/offload.py`` (issue 17's benchmark) at its tiny size on the
CPU: the script runs end to end and its reports hold every row. The figures themselves
are for a GPU; here only the simulated host (``--simulate-host``) frees anything."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest


def _script() -> ModuleType:
    path = Path(__file__).parents[1] / "benchmarks" / "offload.py"
    spec = importlib.util.spec_from_file_location("offload_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["offload_bench"] = module
    spec.loader.exec_module(module)
    return module


bench = _script()


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
