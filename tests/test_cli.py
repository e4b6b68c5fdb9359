"""The ``autoremat`` command line: demo, profile and plan (doctor and bench have their own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import autoremat
from autoremat._cli import main

from conftest import SMALL, as_options

_SMALL_GPT2 = as_options(SMALL["gpt2"])  # two blocks: the tests below count on it


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["profile", "gtp2"], "unknown target 'gtp2'"),
        (["profile", "gpt2", "--set", "n_layer"], "cannot read option 'n_layer'"),
        (["profile", "gpt2", "--set", _SMALL_GPT2, "--ops", "block.1"],
         "no block 'block.1' in the tape of GPT. Did you mean 'blocks.1'?"),
        # these two profile the default-size mlp before the budget is read (~3 s each)
        pytest.param(["plan", "mlp", "--budget", "lots"], "lots", marks=pytest.mark.slow),
        pytest.param(["plan", "mlp", "--strategy", "optimall", "--budget", "50%"], "optimall",
                     marks=pytest.mark.slow),
        (["plan", "no_such_module:factory"], "cannot import 'no_such_module'"),
        (["plan", "mlp", "--deterministic"], "--deterministic only changes how --verify"),
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


def test_loop_option_reaches_the_plan(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    plan_file = tmp_path / "plan.json"
    assert main(["plan", "gpt2", "--set", _SMALL_GPT2, "--strategy", "full",
                 "--loop", "loss_only", "--out", str(plan_file)]) == 0
    assert autoremat.Plan.from_json(plan_file).loop == "loss_only"
    assert "loop loss_only" in capsys.readouterr().out


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
