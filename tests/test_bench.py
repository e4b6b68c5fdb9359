"""Tests of ``autoremat bench``: a smoke run end to end, and the pieces that decide rows."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from autoremat import Decision, Plan, RematError, zoo
from autoremat._bench.measure import build_target
from autoremat._bench.refs import sequential_chain
from autoremat._bench.report import (
    SCHEMA_VERSION,
    device_info,
    headline,
    machine_info,
    write_results,
)
from autoremat._bench.rows import (
    AUTO,
    AUTO_COMPILE,
    BLOCK,
    COMPILE,
    COMPILE_BLOCK,
    COMPILE_EAGER,
    COMPILE_SAC,
    NONE,
    SAC,
    SEQ,
    BenchRow,
    ModelResult,
    Settings,
)
from autoremat._cli.bench import bench_main
from autoremat._measure.blocks import resolve_blocks
from autoremat._plan.plan import plan_key

# Small enough for a few seconds a step on a busy 2-core machine, large enough that
# activations dominate the step so that "50%" is a feasible budget. Larger than
# conftest.SMALL["gpt2"] on purpose: at SMALL no plan lowers the step's peak at all.
_TINY_GPT2 = "n_layer=3,seq_len=64,batch_size=2"


@pytest.mark.slow
def test_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    status = bench_main(["gpt2", "--quick", "--no-compile", "--repeats", "1",
                         "--budgets", "50%,min", "--set", _TINY_GPT2, "--out", str(out)])
    assert status == 0
    for name in ("results.md", "results.json", "gpt2_pareto.png"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "results.json").read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert "autoremat bench gpt2" in data["command"]
    (model,) = data["models"]
    rows = [BenchRow(**{**r, "time_ratio_range": None}) for r in model["rows"]]
    methods = {r.method for r in rows if r.status == "ok"}
    assert {NONE, AUTO, BLOCK, SAC} <= methods
    assert COMPILE not in methods
    assert any(r.method == SEQ and r.status == "n/a" for r in rows)  # a ModuleList loop
    budgeted = [r for r in rows if r.method == AUTO and r.status == "ok"]
    assert budgeted, "no autoremat plan ran"
    for r in rows:
        if r.status == "ok" and r.method in (AUTO, BLOCK):
            assert r.grads_equal and r.max_grad_diff == 0.0, r
        if r.method == AUTO and r.status == "ok":
            assert r.budget_bytes is not None and r.peak_bytes is not None
            assert r.peak_bytes <= r.budget_bytes, r
    # autoremat was also planned at the peak of each eager reference
    assert any(r.budget == f"peak of {BLOCK}" for r in budgeted)
    assert model["headline"], "no verdicts"
    assert "| method |" in (out / "results.md").read_text()


# The compiled rows end to end: tests/test_gpu_suite.py::check_compiled_bench, on the
# CPU dry run's own bench-compile output (the same bench, run once).


@pytest.mark.parametrize(("argv", "message"), [
    (["gpt2", "--compile-backend", "aot_eagr"], "Did you mean 'aot_eager'?"),
    (["gpt2", "--compile-fractions", "0.5,2"], "--compile-fractions takes numbers from 0 to 1"),
    (["gpt2", "--budgets", ","], "--budgets is empty"),
    (["gpt2", "--repeats", "0"], "--repeats must be at least 1"),
    (["gtp2", "--no-compile"], "Did you mean 'gpt2'?"),
    # --set holds for every target: a later one that lacks it is named before any runs
    (["gpt2", "mlp", "--set", "n_layer=2", "--no-compile"], "mlp: unknown option 'n_layer'"),
])
def test_bench_errors(argv: list[str], message: str, tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().out


@pytest.mark.parametrize("target", ["nosuch", "autoremat_no_such_module:make"])
def test_a_bench_of_an_unknown_target_writes_nothing(target: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """It made its output folder first (an empty ./bench-results), then refused."""
    out = tmp_path / "results"
    assert bench_main([target, "--quick", "--out", str(out)]) == 2
    assert target.partition(":")[0] in capsys.readouterr().out and not out.exists()


@pytest.mark.parametrize(("name", "expected"), [
    ("mlp", 12),  # model.blocks is an nn.Sequential
    ("resnet", 6),  # model.stages: a Sequential of Sequentials, flattened
    ("gpt2", None),  # a ModuleList called in a Python loop
    ("llama", None),
])
def testsequential_chain(name: str, expected: int | None) -> None:
    model, _ = zoo.build(name, device="meta")
    found = sequential_chain(model, resolve_blocks(model, None))
    if expected is None:
        assert found is None
    else:
        assert found is not None and len(found[1]) == expected


def _row(method: str, budget: str, peak: int, pct: float, ratio: float = 1.2) -> BenchRow:
    return BenchRow(method, budget, "ok", peak_bytes=peak, plain_peak_bytes=100,
                    recompute_pct=pct, time_ratio=ratio,
                    time_ratio_range=(ratio - 0.05, ratio + 0.05), grads_equal=True,
                    max_grad_diff=0.0)


def test_headline_compares_compiled_references_with_compiled_plans() -> None:
    """A compiled reference is judged against autoremat's compiled plans, times included,
    in fractions of the plain peak of its own measurement (OS on CPU)."""
    def os_row(method: str, budget: str, peak: int, pct: float, ratio: float) -> BenchRow:
        return replace(_row(method, budget, peak, pct, ratio), peak_source="os")

    rows = [
        _row(NONE, "-", 100, 0.0, 1.0),
        _row(AUTO, "min", 30, 40.0, 1.6),
        os_row(COMPILE_BLOCK, "-", 60, 30.0, 1.5),
        os_row(AUTO_COMPILE, "peak of X", 55, 10.0, 1.1),
    ]
    (block,) = headline(rows)
    assert f"vs {COMPILE_BLOCK}" in block and "[peak of X]" in block
    assert "fewer recompute FLOPs, faster" in block and "not compared" not in block
    # without compiled plans, the eager ones stand in, their times not compared
    (alone,) = headline(rows[:3])
    assert "[min]" in alone and "not compared" in alone


def test_headline_verdicts() -> None:
    rows = [
        _row(NONE, "-", 100, 0.0, 1.0),
        _row(AUTO, "50%", 50, 10.0, 1.1),
        _row(AUTO, "min", 30, 40.0, 1.6),
        _row(BLOCK, "-", 40, 33.0, 1.4),  # only "min" is at or below it: more FLOPs, slower
        _row(SAC, "-", 60, 20.0, 1.12),  # "50%" is below it: fewer FLOPs, time within noise
        _row(SEQ, "-", 20, 50.0),  # lower than any autoremat plan
    ]
    block, sac, seq = headline(rows)
    assert "[min]" in block and "more recompute FLOPs, slower" in block
    assert "[50%]" in sac and "fewer recompute FLOPs, time within noise" in sac
    assert seq.startswith(f"{SEQ} wins on memory") and "[min]" in seq


# --- bench --device ---------------------------------------------------------------------------

_NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize(("argv", "message"), [
    (["gpt2", "--device", "tpu"], "--device 'tpu' is not a device name"),
    (["gpt2", "--device", "mps"], "bench measures on cpu or cuda, not mps"),
    pytest.param(["gpt2", "--device", "cuda"], "--device cuda: no CUDA device is available",
                 marks=pytest.mark.skipif(not _NO_CUDA, reason="CUDA is available here")),
])
def test_bench_device_errors(argv: list[str], message: str, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().out
    assert not list(tmp_path.iterdir())  # refused before anything was measured or written


def test_build_target_moves_model_and_inputs_to_the_device() -> None:
    model, (x, y) = build_target("mlp", {"widths": (8, 4), "batch_size": 2}, "meta")
    assert all(p.is_meta for p in model.parameters())
    assert x.is_meta and y.is_meta and model.training


@pytest.mark.parametrize(("device", "suffix"), [("cpu", ""), ("cuda", "_cuda"),
                                                ("cuda:1", "_cuda1")])
def test_result_files_are_named_after_the_device(device: str, suffix: str,
                                                 tmp_path: Path) -> None:
    rows = (BenchRow(NONE, "-", "ok", peak_bytes=100, plain_peak_bytes=100, step_ms=10.0,
                     time_ratio=1.0, recompute_pct=0.0, grads_equal=True, max_grad_diff=0.0,
                     peak_source="allocator", tracker_peak_bytes=99),
            BenchRow(AUTO, "50%", "ok", peak_bytes=50, plain_peak_bytes=100, budget_bytes=50,
                     step_ms=12.0, time_ratio=1.2, recompute_pct=30.0, grads_equal=False,
                     max_grad_diff=1e-8, relative_grad_diff=1e-7, peak_source="allocator",
                     tracker_peak_bytes=50))
    result = ModelResult(target="gpt2", model="GPT", inputs="(2, 8) int64", n_blocks=2,
                         plain_peak_bytes=100, plain_step_ms=10.0, plain_flops=1000,
                         min_feasible_bytes=40, rows=rows, headline=())
    machine = {**machine_info(), "device": device, "device_name": "Some GPU"}
    written = write_results([result], tmp_path, "autoremat bench gpt2", machine, 1.0,
                            Settings(device=device))
    names = {p.name for p in written}
    assert names == {f"results{suffix}.md", f"results{suffix}.json", f"gpt2_pareto{suffix}.png"}
    data = json.loads((tmp_path / f"results{suffix}.json").read_text())
    assert data["settings"]["device"] == device
    assert data["machine"]["device_name"] == "Some GPU"
    assert data["models"][0]["rows"][0]["tracker_peak_bytes"] == 99
    text = (tmp_path / f"results{suffix}.md").read_text()
    assert f"(gpt2_pareto{suffix}.png)" in text
    assert ("max_memory_allocated" in text) == (device != "cpu")


def test_device_info_on_the_cpu() -> None:
    info = device_info("cpu")
    assert info["device"] == "cpu" and info["device_name"] == machine_info()["cpu"]


def test_plans_differing_only_in_a_keep_set_are_measured_apart(tiny_tape) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    from autoremat import plan

    base = plan(tiny_tape, None, "full")
    first = dataclasses.replace(base.blocks[0], decision=Decision.SELECTIVE,
                                keep_ops=(1, 2))
    other = dataclasses.replace(first, keep_ops=(1,), skip_ops=(0,))
    one = dataclasses.replace(base, blocks=(first, *base.blocks[1:]))
    two = dataclasses.replace(base, blocks=(other, *base.blocks[1:]))
    assert plan_key(one) != plan_key(two)
    assert plan_key(one) == plan_key(dataclasses.replace(one, strategy="optimal"))


def test_compile_rows_plan_autoremat_at_each_compiled_reference(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_rows without subprocesses: canned worker figures, an eager tape standing in
    for the compiled one. autoremat is fitted at each compiled reference's allocator peak
    (CPU), below the lowest and at the smallest budget, by measuring the model compiled
    whole (aot_eager, in this process); a failed reference gives an error row and no plan;
    identical plans run once."""
    import autoremat._bench.compiled as compiled
    from autoremat import profile

    model, inputs = build_target("gpt2", {"n_layer": 3, "seq_len": 64, "batch_size": 2})
    names = resolve_blocks(model, None)
    tape = profile(model, inputs, timing=False, with_selective=False)
    plain = tape.step_peak_bytes
    peaks = {"fraction": plain, "block": int(0.8 * plain)}
    ran: list[dict[str, Any]] = []

    def worker(target: str, overrides: dict[str, Any], variant: dict[str, Any],
               *args: Any) -> dict[str, Any]:
        ran.append(variant)
        if variant["kind"] == "sac":
            raise RematError("torch.compile subprocess failed (exit 1): boom")
        if variant["kind"] == "plan":
            peak = Plan.from_json(variant["plan"]).compiled_peak_bytes
        else:
            peak = peaks[variant["kind"]]
        return {"eager_ms": [10.0], "compiled_ms": [12.0], "eager_cpu_ms": [10.0],
                "compiled_cpu_ms": [12.0], "compile_s": 1.0, "eager_peak_bytes": plain + 4096,
                "compiled_peak_bytes": peak + 4096, "eager_alloc_peak_bytes": plain,
                "compiled_alloc_peak_bytes": peak, "grads_equal": True, "max_grad_diff": 0.0,
                "max_abs_grad": 1.0, "eager_step_flops": 100, "eager_bwd_flops": 60,
                "compiled_bwd_flops": 70}

    monkeypatch.setattr(compiled, "_run_compile_worker", worker)
    monkeypatch.setattr(compiled, "profile", lambda *a, **k: tape)
    settings = Settings(compile_fractions=(1.0,), compile_backend="aot_eager")
    rows = compiled.compile_rows("gpt2", settings, model, inputs, names, plain,
                                 lambda n, text: None, lambda n: None)
    assert [r.method for r in rows[:4]] == [COMPILE_EAGER, COMPILE, COMPILE_BLOCK, COMPILE_SAC]
    assert rows[3].status == "error" and "boom" in rows[3].note
    autos = {r.budget: r for r in rows if r.method == AUTO_COMPILE}
    assert set(autos) == {"peak of torch.compile 1", f"peak of {COMPILE_BLOCK}",
                          "below the references", "min"}
    assert autos[f"peak of {COMPILE_BLOCK}"].budget_bytes == peaks["block"]
    assert autos["below the references"].budget_bytes == int(0.9 * peaks["block"])
    for r in autos.values():
        if r.status == "ok":
            assert r.predicted_peak_bytes is not None and r.budget_bytes is not None
            assert r.allocations_peak_bytes == r.predicted_peak_bytes <= r.budget_bytes
            assert "OVER BUDGET" not in r.note
    plans = [v for v in ran if v["kind"] == "plan"]
    assert len(plans) == len({v["plan"] for v in plans}), "a plan ran twice"
    shared = sum("same plan as" in r.note for r in autos.values())
    assert len(plans) + shared == sum(r.status == "ok" for r in autos.values())
