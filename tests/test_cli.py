"""The ``autoremat`` command line: demo, profile and plan (doctor and bench have their own)."""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

import autoremat
from autoremat._cli import main
from autoremat._cli.progress import Stage, stages
from autoremat._targets import TARGET_HELP
from autoremat._verify import Report

from conftest import SMALL, as_options

_SMALL_GPT2 = as_options(SMALL["gpt2"])  # two blocks: the tests below count on it


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["profile", "gtp2"], "unknown target 'gtp2'"),
        (["profile", "gpt2", "--set", "n_layer"], "cannot read option 'n_layer'"),
        (["profile", "gpt2", "--set", _SMALL_GPT2, "--ops", "block.1"],
         "no block 'block.1' in GPT. Did you mean 'blocks.1'?"),
        # these two profile the default-size mlp before the budget is read (~3 s each)
        pytest.param(["plan", "mlp", "--budget", "lots"], "lots", marks=pytest.mark.slow),
        pytest.param(["plan", "mlp", "--strategy", "optimall", "--budget", "50%"], "optimall",
                     marks=pytest.mark.slow),
        (["plan", "no_such_module:factory", "--budget", "50%"], "cannot import 'no_such_module'"),
        (["plan", "mlp", "--deterministic"], "--deterministic only changes how --verify"),
        (["profile", "gpt2", "--set", _SMALL_GPT2, "--blocks", "blocks.0,"],
         "--blocks takes module names"),
        (["plan", "mlp", "--budget", "60"], "write --budget 60%"),  # before any work
        (["plan", "mlp", "--budget", "50%", "--margin", "1.5"],
         "margin must be a number in [0, 1)"),  # before any work
    ],
)
def test_errors_name_the_problem(argv: list[str], message: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    out = capsys.readouterr().out.replace("\n", " ")
    assert "error:" in out and message in out, out


def test_profile_lists_a_blocks_ops_and_writes_the_tape(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "tape.json"
    assert main(["profile", "gpt2", "--set", _SMALL_GPT2, "--ops", "blocks.1",
                 "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    tape = autoremat.Tape.from_json(out_file)
    block = tape.blocks[1]
    assert f"blocks.1: {len(block.ops)} forward ops" in out
    assert "bernoulli_.float" in out and "random,in-place" in out
    assert "not saved" in out  # the block's output: alive, but autograd did not save it
    assert tape.model == "GPT" and len(tape.blocks) == 2
    assert tape.loop == "holds_output" and "loop holds_output" in out  # the default loop


@pytest.mark.slow
def test_plan_verifies_and_writes_the_plan(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "plan.json"
    assert main(["plan", "gpt2", "--set", "n_layer=3", "--budget", "60%", "--verify",
                 "--deterministic", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "verify: OK" in out and "deterministic algorithms" in out
    plan = autoremat.Plan.from_json(out_file)
    assert plan.strategy == "optimal" and plan.budget_bytes is not None
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert "Plan (optimal) for GPT" in out
    assert json.loads(out_file.read_text())["schema_version"] == plan.schema_version


def test_blocks_option_reaches_the_tape(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    tape_file = tmp_path / "tape.json"
    assert main(["profile", "gpt2", "--set", _SMALL_GPT2, "--blocks", "blocks.1",
                 "--out", str(tape_file)]) == 0
    assert [b.name for b in autoremat.Tape.from_json(tape_file).blocks] == ["blocks.1"]
    capsys.readouterr()


def test_loop_option_reaches_the_plan(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    plan_file = tmp_path / "plan.json"
    assert main(["plan", "gpt2", "--set", _SMALL_GPT2, "--strategy", "full",
                 "--loop", "loss_only", "--out", str(plan_file)]) == 0
    assert autoremat.Plan.from_json(plan_file).loop == "loss_only"
    assert "loop loss_only" in capsys.readouterr().out


def test_margin_option_reaches_the_plan(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    plan_file = tmp_path / "plan.json"
    assert main(["plan", "gpt2", "--set", _SMALL_GPT2, "--budget", "120%", "--margin", "0.1",
                 "--out", str(plan_file)]) == 0
    chosen = autoremat.Plan.from_json(plan_file)
    assert chosen.budget_bytes is not None and chosen.margin_bytes > 0
    assert chosen.predicted_peak_bytes <= chosen.budget_bytes - chosen.margin_bytes
    assert "kept as margin" in capsys.readouterr().out


def test_max_memory_without_optimizer_is_noted_in_the_commands_words(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The library's warning named its keyword (``optimizer='adamw'``), which the command
    line does not take."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["plan", "gpt2", "--set", _SMALL_GPT2, "--max-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "--max-memory without --optimizer counts no optimizer state" in out
    assert "pass --optimizer adamw" in out and "optimizer='adamw'" not in out


def test_an_unknown_loop_option_lists_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "mlp", "--loop", "hold_output"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'hold_output'" in err and "'holds_output'" in err


@pytest.mark.slow
def test_demo_measures_every_plan_with_exact_gradients(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--model", "mlp", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "mlp: plans, measured" in out
    assert "DIFFER" not in out and out.count("equal") >= 4


# --- help, progress, noise, solver output -----------------------------------------------------


@pytest.mark.parametrize("argv", [[], ["profile"], ["plan"], ["doctor"], ["estimate"],
                                  ["bench"]])
def test_every_help_that_takes_a_target_states_the_factory_contract(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse folds the epilog
    assert " ".join(TARGET_HELP.split()) in out
    assert out.startswith(f"usage: autoremat {argv[0]}" if argv else "usage: autoremat")


def test_a_factory_in_the_current_folder_is_found(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "autoremat_cli_mymodel.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def make(width=8):\n"
        "    return nn.Sequential(nn.Linear(width, width), nn.Linear(width, width)), "
        "torch.ones(2, width)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "autoremat_cli_mymodel", raising=False)
    assert main(["plan", "autoremat_cli_mymodel:make", "--strategy", "full",
                 "--set", "width=4"]) == 0
    out = capsys.readouterr().out
    assert "Plan (full) for Sequential" in out


def test_profile_reports_its_stages_in_order() -> None:
    model, inputs = autoremat.zoo.build("mlp", widths=(8, 8, 8), d_in=8, batch_size=2)
    stages: list[str] = []
    autoremat.profile(model, inputs, repeats=2, progress=stages.append)
    memory = [s for s in stages if s.startswith("memory runs")]
    assert stages[0] == "warm-up step" and stages[-1] == "timing 2 steps"
    n = int(memory[0].split("/")[1])  # at most: alike blocks can make the last ones needless
    assert 2 <= len(memory) <= n
    assert memory == [f"memory runs {k}/{n}" for k in range(1, len(memory) + 1)]
    assert stages[stages.index("selective keep-sets") + 1] == "selective options derived"
    selective = [s for s in stages if s.startswith("selective options")]
    assert selective[0] == "selective options derived"  # then any measured, k/steps
    measured = selective[1:]
    assert measured == [f"selective options {k}/{len(measured)}"
                        for k in range(1, len(measured) + 1)]


def test_doctor_reports_its_stages() -> None:
    model, inputs = autoremat.zoo.build("mlp", device="meta", widths=(8, 8), d_in=8,
                                        batch_size=2)
    stages: list[str] = []
    autoremat.doctor(model, inputs, memory="1GiB", progress=stages.append)
    assert stages[0] == "warm-up step" and "tracked steps: what is live at the peak" in stages


def test_the_status_line_names_the_stage_and_the_time() -> None:
    stage = Stage("profiling mlp")
    stage("memory runs 3/6")
    assert re.fullmatch(r"profiling mlp: memory runs 3/6 · \d+\.\d s", str(stage)), str(stage)
    with stages("quiet") as inside:  # not a terminal: no spinner, the callback still works
        inside("a stage")
        assert inside.stage == "a stage"


def _report(ratio: float, spread: float, plain_spread: float, pairs: int) -> Report:
    return Report(ok=True, grads_equal=True, max_grad_diff=0.0, peak_bytes=1,
                  plain_peak_bytes=1, predicted_peak_bytes=1, budget_bytes=None,
                  recompute_flops=16, plain_flops=100, step_ms=100.0 * ratio,
                  plain_step_ms=100.0, time_spread=spread, plain_time_spread=plain_spread,
                  timed_pairs=pairs)


@pytest.mark.parametrize(("report", "text", "noise"), [
    (_report(0.74, 0.31, 0.05, 3), "x0.74 ±0.31 (within noise)", True),
    (_report(0.74, 0.05, 0.20, 3), "x0.74 ±0.20", False),
    (_report(1.53, 0.10, 0.08, 3), "x1.53 ±0.10", False),
    (_report(0.68, 0.0, 0.0, 1), "x0.68 (1 timed run: noise not measured)", True),
])
def test_a_time_ratio_is_printed_with_its_noise(report: Report, text: str,
                                                noise: bool) -> None:
    assert report.time_text == text and report.time_within_noise is noise
    assert f"time {text})" in str(report)


def test_verify_measures_the_spread_of_both_kinds_of_runs() -> None:
    model, inputs = autoremat.zoo.build("mlp", widths=(16,) * 3, d_in=16, batch_size=4)
    tape = autoremat.profile(model, inputs, repeats=1, timing=False)
    autoremat.apply(model, autoremat.plan(tape, None, "full"))
    report = autoremat.verify(model, inputs, repeats=3)
    assert report.timed_pairs == 3
    assert report.plain_time_spread > 0 and report.time_spread > 0  # perf_counter never ties
    assert report.time_noise == max(report.plain_time_spread, report.time_spread)


def test_the_keep_set_solver_prints_nothing(monkeypatch: pytest.MonkeyPatch,
                                            capfd: pytest.CaptureFixture[str]) -> None:
    """HiGHS's C++ can write its trace to fd 1 during a solve; nothing of it may reach the
    user. The stand-in below writes to both fds as HiGHS does, then solves for real."""
    import scipy.optimize

    import autoremat._plan.keepsets as keepsets
    from autoremat._plan.costs import cost_model_for

    real = scipy.optimize.milp  # read where it is used (NOTE [ scipy on first use ])
    calls: list[int] = []

    def noisy_milp(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
        os.write(2, b"HiGHS on stderr\n")
        assert kwargs["options"].get("disp") is False
        return real(*args, **kwargs)

    monkeypatch.setattr(scipy.optimize, "milp", noisy_milp)
    model, inputs = autoremat.zoo.build("gpt2", n_layer=2, batch_size=1, seq_len=8)
    tape = autoremat.profile(model, inputs, repeats=1, timing=False, with_selective=False)
    capfd.readouterr()
    keepsets._solved.cache_clear()  # solved for real (NOTE [ Keep-sets solved once ... ])
    found = keepsets.keep_sets(tape.blocks[0].ops, cost_model_for("cpu"))
    out, err = capfd.readouterr()
    assert found and calls and out == "" and err == ""
