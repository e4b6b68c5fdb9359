"""Smoke test of ``benchmarks/head.py`` (the loss head in the plan against HF per-block
checkpointing) at its tiny size on the CPU: the script runs end to end, its reports hold
every row, and the chunked rows never build the logits, peak below the plain step and
keep the plain step's gradients within fp32 rounding."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import load_benchmark

pytest.importorskip("transformers")
bench = load_benchmark("head")


@pytest.mark.slow
def test_head_bench_tiny_on_cpu(tmp_path: Path) -> None:
    md = bench.main(["--device", "cpu", "--size", "tiny", "--rounds", "1",
                     "--out", str(tmp_path)])
    report = json.loads(md.with_suffix(".json").read_text())
    text = md.read_text()
    assert md.name.startswith("head_cpu-") and md.name.endswith("_tiny.md")
    for key in ("device_name", "torch", "date", "threads"):
        assert report[key]
    names = [r["name"] for r in report["rows"]]
    peers = [n.removeprefix("peer:") for n in names if n.startswith("peer:")]
    assert "torch" in peers  # torch 2.13's linear_cross_entropy runs on the CPU
    assert [n for n in names if n in bench.ROWS] == list(bench.ROWS)
    assert set(names) - set(bench.ROWS) == {
        f"{kind}{peer}{end}" for peer in peers
        for kind, end in (("peer:", ""), (f"{bench.BASELINE}+", ""), ("autoremat@", "-peak"))}
    for name in names:
        assert f"| {name} |" in text
    rows = {r["name"]: r for r in report["rows"]}
    # at the tiny size 0.75x of per-block's peak may be below the smallest plan
    failed = {n: r["status"] for n, r in rows.items()
              if r["status"] != "ok" and not r["status"].startswith("infeasible")}
    assert not failed
    measured = {n: r for n, r in rows.items() if r["status"] == "ok"}
    assert set(bench.ROWS) - set(measured) <= {"autoremat@0.75x-hf-peak"}
    plain = rows["plain"]["measured_peak_bytes"]
    for name, r in measured.items():
        assert r["measured_peak_bytes"] > 0 and r["time_ms"] > 0, name
        assert math.isfinite(r["max_grad_rel_diff"]) and r["max_grad_rel_diff"] < 1e-3, name
        assert math.isfinite(r["loss_abs_diff"]), name
        if r["fits"] is not None:
            assert r["fits"], name
    for name in ("plain", "hf-per-block"):  # HF's own head: exact
        assert rows[name]["grads_equal"] and rows[name]["logits_none"] is False
    for name in ("autoremat-full+chunked:4", "autoremat-full+chunked:32"):
        r = rows[name]
        assert r["head"] == name.split("+")[1] and r["logits_none"] is True
        assert r["measured_peak_bytes"] < plain
        assert r["measured_peak_bytes"] < rows["hf-per-block"]["measured_peak_bytes"]
    low = rows["autoremat@min"]
    assert low["budget_bytes"] == report["facts"]["smallest_feasible_bytes"]
    assert low["measured_peak_bytes"] <= low["budget_bytes"] < plain
    assert report["facts"]["verify_min"]["ok"] is True
    # per peer, at its peak; at the minimum against per-block + the fastest peer; at
    # per-block's peak; the head chunked with blocks kept; the smallest plan; the GPU one
    assert len(report["targets"]) == len(peers) + 5
    assert all(("PASS" in t) != ("FAIL" in t) for t in report["targets"])
