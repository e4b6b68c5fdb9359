"""``benchmarks/gpu_suite.py``: the CPU dry run end to end (``slow``), and, quickly, how
the suite reads each benchmark's results, skips what no longer fits its time and stops a
step that runs past its own.

The readers are fed result files written from the benchmarks' own row classes (and, for
offload, its own ``targets`` wording), so a change of field names or verdict lines there
breaks these tests rather than the GPU run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autoremat._bench.report import device_info
from autoremat._bench.rows import (
    AUTO_COMPILE,
    COMPILE,
    COMPILE_BLOCK,
    COMPILE_EAGER,
    COMPILE_SAC,
    BenchRow,
)

from conftest import load_benchmark

suite = load_benchmark("gpu_suite")
exact = load_benchmark("gpu_exact")
offload = load_benchmark("offload")
head = load_benchmark("head")
STATUSES = {"PASS", "FAIL", "NOT RUN", "MEASURED"}
CPU = device_info("cpu")["device_name"]


def _ctx(tmp_path: Path, device: str = "cuda") -> object:
    return suite.Context(device, "gpu", tmp_path, "Test GPU")


@pytest.mark.slow
def test_cpu_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "suite"
    env = {**os.environ, "PYTHONPATH": str(Path(suite.ROOT) / "src")}
    subprocess.run([sys.executable, str(Path(suite.ROOT) / "benchmarks" / "gpu_suite.py"),
                    "--device", "cpu", "--size", "tiny", "--out", str(out)],
                   check=True, env=env, capture_output=True, timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    md = (out / "summary.md").read_text()
    assert summary["device"] == CPU and CPU in md and summary["dry_run"] is True
    assert "CPU dry run" in md
    claims = summary["claims"]
    assert {c["step"] for c in claims} == {s.name for s in suite.STEPS}  # every step
    assert all(c["status"] in STATUSES and c["claim"] and c["figure"] for c in claims)
    assert not [c for c in claims if c["figure"] == "unreadable target line"]
    for c in claims:
        assert f"| {c['step']} | {c['claim'].replace('|', '/')} |" in md
    tier = [c for c in claims if c["step"] == "gpu-tests"]
    assert [c["status"] for c in tier] == ["NOT RUN"] and "no CUDA" in tier[0]["figure"]
    ran = [s for s in summary["steps"] if "command" in s]
    assert ran and [s["step"] for s in ran] == [s.name for s in suite.STEPS][:len(ran)]
    for step in ran:  # each ran step: its logs and its own result files, naming the device
        folder = out / step["step"]
        files = [p for p in folder.rglob("*") if p.suffix in (".md", ".json", ".txt", ".xml")]
        assert (folder / f"{step['step']}.stdout.txt").exists()
        for path in files:
            assert CPU in path.read_text(), path
    # the steps that finish on any machine wrote their results and were judged from them
    by_step = {c["step"]: c for c in claims}
    assert by_step["exactness"]["status"] == "PASS"
    assert by_step["profile-cost"]["status"] == "MEASURED"
    assert list((out / "exactness").glob("zoo-gpt2/exact_*.json"))  # one folder a model
    assert (out / "profile-cost" / "profile_cost.json").exists()
    # the compiled bench finished within its cap and was judged from its results (it ran
    # out of its 150 s here once the plans were fitted by measurement)
    compiled = [c for c in claims if c["step"] == "bench-compile"]
    assert compiled and all("timed out" not in c["figure"] for c in compiled), compiled
    assert any(c["status"] in ("PASS", "FAIL", "MEASURED") for c in compiled), compiled
    check_compiled_bench(out / "bench-compile")


def check_compiled_bench(out: Path) -> None:
    """The compiled rows of ``autoremat bench gpt2 --compile`` end to end, as the dry
    run's bench-compile step runs it (2 layers, aot_eager, compile's budget 1; about 2
    minutes on two busy cores: each row compiles in a subprocess of its own). Checked
    here, on the dry run's own output, rather than by running the same bench again."""
    assert (out / "gpt2_pareto.png").stat().st_size > 0
    data = json.loads((out / "results.json").read_text())
    assert data["settings"]["compile_backend"] == "aot_eager"
    (model,) = data["models"]
    rows = [BenchRow(**{**r, "time_ratio_range": None}) for r in model["rows"]]
    by_method = {m: [r for r in rows if r.method == m and r.status == "ok"]
                 for m in (COMPILE, COMPILE_EAGER, COMPILE_BLOCK, COMPILE_SAC, AUTO_COMPILE)}
    assert all(by_method.values()), {m: len(r) for m, r in by_method.items()}
    for r in by_method[COMPILE_BLOCK] + by_method[COMPILE_SAC] + by_method[AUTO_COMPILE]:
        # aot_eager fuses nothing: gradients equal the eager plain step's
        assert r.grads_equal, r
        assert r.time_ratio is not None and r.peak_source == "os" and r.peak_bytes
        assert r.allocations_peak_bytes, r
    budgets = {r.budget for r in by_method[AUTO_COMPILE]}
    assert {f"peak of {COMPILE_BLOCK}", f"peak of {COMPILE_SAC}", "peak of torch.compile 1",
            "min"} <= budgets, budgets
    for r in by_method[AUTO_COMPILE]:
        # regional compile on CPU: the allocator's peak is the prediction, to the byte
        assert r.predicted_peak_bytes == r.allocations_peak_bytes, r
        assert r.budget_bytes is not None and r.allocations_peak_bytes <= r.budget_bytes, r
    assert any("torch.compile + checkpoint per block" in h for h in model["headline"])
    assert "| autoremat + torch.compile |" in (out / "results.md").read_text()


def test_compile_claims_read_from_bench_rows(tmp_path: Path) -> None:
    def ref(method: str, budget: str, status: str = "ok") -> BenchRow:
        return BenchRow(method, budget, status, peak_bytes=1000, time_ratio=1.0)  # type: ignore[arg-type]

    def mine(budget: str, peak: int, ratio: float) -> BenchRow:
        return BenchRow(AUTO_COMPILE, budget, "ok", peak_bytes=peak, budget_bytes=1000,
                        time_ratio=ratio, peak_source="allocator")
    interleaved = dataclasses.replace(mine("peak of torch.compile 0.8", 990, 1.5),
                                      versus_ratio=1.01)  # judged by the paired time
    rows = [ref(COMPILE, "1 (no budget)"), mine("peak of torch.compile 1", 990, 1.019),
            ref(COMPILE_BLOCK, "-"), mine(f"peak of {COMPILE_BLOCK}", 990, 1.03),  # slow
            ref(COMPILE, "0.5"), mine("peak of torch.compile 0.5", 1001, 0.9),  # over
            ref(COMPILE_SAC, "-", "error"), ref(COMPILE, "0.8"), interleaved,
            mine("min", 999, 1.4)]  # the smallest plan: at or below per-block's peak
    payload = {"complete": True, "models": [{"target": "gpt2",
                                             "rows": [dataclasses.asdict(r) for r in rows]}]}
    (tmp_path / "results_cuda.json").write_text(json.dumps(payload))
    claims = suite._bench_parse(_ctx(tmp_path), tmp_path, 0)
    assert [c.status for c in claims] == ["PASS", "FAIL", "FAIL", "NOT RUN", "PASS", "PASS"]
    assert "x1.019 vs the reference's x1.000" in claims[0].figure
    assert "reference error" in claims[3].figure
    assert "x1.010 the reference's, interleaved in one process" in claims[4].figure
    assert "smallest compiled plan" in claims[5].claim and claims[5].figure.startswith("0.0")
    rows[-1] = mine("min", 1001, 1.0)  # above per-block's peak
    payload["models"][0]["rows"] = [dataclasses.asdict(r) for r in rows]
    (tmp_path / "results_cuda.json").write_text(json.dumps(payload))
    assert suite._bench_parse(_ctx(tmp_path), tmp_path, 0)[-1].status == "FAIL"
    assert suite._bench_parse(_ctx(tmp_path), tmp_path / "nothing", 1)[0].status == "NOT RUN"
    # a reference whose peak rests on re-drawing dropout in backward is not judged
    rows[4] = dataclasses.replace(ref(COMPILE, "0.5"), relative_grad_diff=0.67)
    payload["models"][0]["rows"] = [dataclasses.asdict(r) for r in rows]
    (tmp_path / "results_cuda.json").write_text(json.dumps(payload))
    inexact = suite._bench_parse(_ctx(tmp_path), tmp_path, 0)[2]
    assert inexact.status == "MEASURED" and "off by 0.67 of the largest" in inexact.figure
    rows[4] = dataclasses.replace(ref(COMPILE, "0.5"), relative_grad_diff=4.9e-7)  # rounding
    payload["models"][0]["rows"] = [dataclasses.asdict(r) for r in rows]
    (tmp_path / "results_cuda.json").write_text(json.dumps(payload))
    assert suite._bench_parse(_ctx(tmp_path), tmp_path, 0)[2].status == "FAIL"  # over budget
    # one that fits and is as fast passes against an inexact reference too
    rows[4:6] = [dataclasses.replace(ref(COMPILE, "0.5"), relative_grad_diff=0.67),
                 mine("peak of torch.compile 0.5", 990, 1.0)]
    payload["models"][0]["rows"] = [dataclasses.asdict(r) for r in rows]
    (tmp_path / "results_cuda.json").write_text(json.dumps(payload))
    assert suite._bench_parse(_ctx(tmp_path), tmp_path, 0)[2].status == "PASS"


def test_exactness_claims_read_from_gpu_exact_rows(tmp_path: Path) -> None:
    good = exact.Row("zoo-gpt2", "fp32", "full", "ok", True, True, 0.0, 100, 90, 90, 0.0)
    bad = exact.Row("zoo-gpt2", "fp32", "sqrt", "FAILED: gradients differ", False, True, 1e-3,
                    100, 99, 98, 0.0102)
    gone = exact.Row("zoo-gpt2", "fp32", "optimal@30%", "infeasible: below the minimum")
    payload = {"rows": [dataclasses.asdict(r) for r in (good, bad, gone)]}
    (tmp_path / "zoo-gpt2").mkdir()  # the suite runs gpu_exact.py once per model
    (tmp_path / "zoo-gpt2" / "exact_cuda-test-gpu.json").write_text(json.dumps(payload))
    claims = suite._exact_parse(_ctx(tmp_path), tmp_path, 0)
    assert [c.status for c in claims] == ["FAIL", "PASS", "PASS", "FAIL", "NOT RUN"]
    assert claims[0].figure == "1 of 2 plans (1 infeasible)"
    assert "worst |error| 1.020%" in claims[3].figure
    assert "hf-llama" in claims[4].figure and "zoo-gpt2" not in claims[4].figure  # no results


def test_offload_claims_follow_offload_targets(tmp_path: Path) -> None:
    def row(name: str, peak: int, ratio: float, **kw: object) -> object:
        return offload.Row(name, "ok", measured_peak_bytes=peak, time_ms=ratio,
                           time_ratio=ratio, grads_equal=True, **kw)
    rows = [row("plain", 100, 1.0), row("hf-per-block", 40, 1.3),
            row("hf-per-block+save_on_cpu", 30, 2.0),
            row("autoremat@save_on_cpu-peak", 29, 1.5, fits=True, offloaded=2),  # slower
            row("autoremat-recompute@50%", 50, 1.2, fits=True),
            row("autoremat-offload@50%", 50, 1.1, fits=True, offloaded=1),
            row("autoremat-strategy-offload", 20, 1.4, fits=False)]  # over its budget
    payload = {"rows": [dataclasses.asdict(r) for r in rows],
               "targets": offload.targets(rows)}
    (tmp_path / "offload_cuda-test-gpu.json").write_text(json.dumps(payload))
    claims = suite._offload_parse(_ctx(tmp_path), tmp_path, 0)
    assert len(claims) == len(payload["targets"])
    assert [c.status for c in claims] == ["PASS", "FAIL", "PASS", "PASS", "FAIL"]
    assert claims[1].figure == "x1.500 vs per-block x1.300"
    assert claims[4].figure == "3 of 4 rows"


def test_head_claims_follow_head_targets(tmp_path: Path) -> None:
    # head.py writes its timed targets as "<claim>: x<ratio>, PASS" and the others as
    # "<claim>: PASS (detail)"; both are read (the timed ones were "unreadable" until
    # 2026-11-29, every one a FAIL in the summary whatever it measured)
    def row(name: str, peak: int, ms: float, **kw: object) -> object:
        return head.Row(name, measured_peak_bytes=peak, time_ms=ms, **kw)
    rows = [row("plain", 100, 10.0), row("hf-per-block", 60, 14.0),
            row("peer:torch", 50, 9.5),
            row("autoremat@torch-peak", 50, 9.6, budget_bytes=50, fits=True),  # x1.011
            row("autoremat@min", 20, 15.0, predicted_peak_bytes=20),  # above hf+torch
            row("hf-per-block+torch", 40, 12.0),
            row("autoremat@hf-peak", 60, 12.0, budget_bytes=60, fits=True),  # x0.857
            row("autoremat-keep+chunked", 80, 10.5, recomputed=0, head="chunked:4")]
    payload = {"rows": [dataclasses.asdict(r) for r in rows],
               "targets": head.targets(rows, gpu=True)}
    (tmp_path / "head_cuda-test-gpu.json").write_text(json.dumps(payload))
    claims = suite._head_parse(_ctx(tmp_path), tmp_path, 0)
    assert len(claims) == len(payload["targets"])
    assert "unreadable target line" not in [c.figure for c in claims]
    def claim(start: str) -> tuple[str, str]:
        (found,) = [c for c in claims if c.claim.startswith(start)]
        return found.status, found.figure
    assert claim("autoremat@torch-peak") == ("PASS", "x1.011")
    assert claim("autoremat@min no slower") == ("FAIL", "x1.250")
    assert claim("autoremat@hf-peak") == ("PASS", "x0.857")
    assert claim("a chunked head") == ("FAIL", "x1.050")
    assert claim("smallest feasible plan")[0] == "PASS"


def test_steps_that_do_not_fit_are_not_run(tmp_path: Path) -> None:
    claims, steps = suite.run_suite(suite.Context("cpu", "tiny", tmp_path, CPU), minutes=0.05,
                                    log=lambda _: None)
    assert [s["step"] for s in steps] == [s.name for s in suite.STEPS]
    assert all(s["outcome"].startswith("skipped") and "command" not in s for s in steps)
    assert {c.status for c in claims} == {"NOT RUN"} and len(claims) == len(suite.STEPS)
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_a_step_past_its_time_is_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sleeper = suite.Step(
        "sleeper", "sleeps", lambda ctx, folder: [sys.executable, "-c",
                                                 "import time; time.sleep(60)"],
        lambda ctx, folder, rc: [suite.Claim("sleeper", "sleeps", f"exit {rc}", "NOT RUN")],
        {"tiny": 1.0}, {"tiny": 0.0})
    monkeypatch.setattr(suite, "STEPS", (sleeper,))
    claims, steps = suite.run_suite(suite.Context("cpu", "tiny", tmp_path, CPU), minutes=1,
                                    log=lambda _: None)
    assert steps[0]["returncode"] is None and steps[0]["seconds"] < 30
    assert steps[0]["outcome"].startswith("timed out")
    assert claims[-1].claim == "sleeper finished within its time"
    assert claims[-1].status == "NOT RUN"
    assert CPU in (tmp_path / "sleeper" / "sleeper.stdout.txt").read_text()


def test_unreadable_results_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def parse(ctx: object, folder: Path, rc: int) -> list:  # type: ignore[type-arg]
        return json.loads((folder / "cut.json").read_text())  # a result file cut short
    step = suite.Step("cut", "writes half a file", lambda ctx, folder: [
        sys.executable, "-c", f"open({str(tmp_path / 'cut' / 'cut.json')!r}, 'w').write('{{')"],
        parse, {"tiny": 60.0}, {"tiny": 0.0})
    monkeypatch.setattr(suite, "STEPS", (step,))
    claims, steps = suite.run_suite(suite.Context("cpu", "tiny", tmp_path, CPU), minutes=2,
                                    log=lambda _: None)
    assert steps[0]["returncode"] == 0
    assert [c.status for c in claims] == ["FAIL"]
    assert claims[0].figure.startswith("could not read its results: JSONDecodeError")


def test_alongside_steps_run_at_the_same_time_and_the_others_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def stamped(name: str, alongside: bool) -> object:
        code = ("import time, pathlib; a = time.time(); time.sleep(1.5); "
                f"pathlib.Path({str(tmp_path / name)!r}, 'span').write_text("
                "f'{a} {time.time()}')")
        return suite.Step(name, name, lambda ctx, folder: [sys.executable, "-c", code],
                          lambda ctx, folder, rc: [suite.Claim(name, name, f"exit {rc}",
                                                               "MEASURED")],
                          {"tiny": 60.0}, {"tiny": 0.0}, alongside=alongside)

    monkeypatch.setattr(suite, "STEPS", (stamped("a", True), stamped("b", True),
                                         stamped("c", False)))
    claims, steps = suite.run_suite(suite.Context("cpu", "tiny", tmp_path, CPU), minutes=2,
                                    log=lambda _: None)
    span = {s: [float(x) for x in (tmp_path / s / "span").read_text().split()]
            for s in "abc"}
    assert span["a"][0] < span["b"][1] and span["b"][0] < span["a"][1]  # overlapping
    assert span["c"][0] >= max(span["a"][1], span["b"][1])  # after both
    assert [s["step"] for s in steps] == [c.step for c in claims] == ["a", "b", "c"]
    assert all(s["returncode"] == 0 for s in steps)


def test_allocator_gap_rows_are_measured_and_not_run_without_cuda(tmp_path: Path) -> None:
    row = {"model": "zoo-gpt2", "dtype": "bf16", "plan": "full", "allocator": 200 << 20,
           "predicted": 198 << 20, "tracked": 198 << 20, "storages_only": 180 << 20}
    (tmp_path / "allocator_gap_test-gpu.json").write_text(json.dumps(
        {"device": "Test GPU", "rows": [row, {**row, "plan": "none"}]}))
    claims = suite._gap_parse(_ctx(tmp_path), tmp_path, 0)
    assert [c.status for c in claims] == ["MEASURED", "MEASURED"]
    assert claims[0].claim.startswith("zoo-gpt2 bf16 full") and "-1.00%" in claims[0].figure
    off = suite._gap_parse(_ctx(tmp_path, "cpu"), tmp_path, 0)
    assert [c.status for c in off] == ["NOT RUN"] and "no CUDA" in off[0].figure


def test_the_gpu_tier_collects_without_the_optional_integrations(tmp_path: Path) -> None:
    # the GPU machine has torch, transformers, scipy, rich, matplotlib and pytest only; on
    # 2026-11-30 the tier ran every test file there and ended "0 passed, 2 errors" at
    # collection (accelerate, lightning). Its command, run here with those hidden, collects.
    argv = suite._pytest_command(_ctx(tmp_path), tmp_path)
    assert "--collect-only" not in argv and str(Path(suite.ROOT) / "tests") not in argv
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text(
        "import sys\nfor m in ('hypothesis', 'accelerate', 'lightning', 'trl', 'peft', "
        "'datasets', 'diffusers'):\n    sys.modules[m] = None\n")
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "PYTHONPATH": os.pathsep.join([str(hidden), str(Path(suite.ROOT) / "src")])}
    done = subprocess.run([*argv, "--collect-only"], env=env, capture_output=True, text=True,
                          cwd=suite.ROOT, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "test_every_plan_is_exact_and_fits_on_cuda" in done.stdout


def test_pack_writes_the_whole_folder_to_one_archive(tmp_path: Path) -> None:
    import tarfile

    out, pack = tmp_path / "suite", tmp_path / "suite.tar.gz"
    suite.main(["--device", "cpu", "--minutes", "0.05", "--out", str(out), "--pack", str(pack)])
    with tarfile.open(pack) as tar:
        names = set(tar.getnames())
    assert {"suite/summary.md", "suite/summary.json"} <= names
