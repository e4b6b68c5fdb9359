"""Bad input is refused at the public entry point, before any work, with a RematError that
names the value (issue 16, first part): a table of (call, exception, message fragment).

The calls that profile are guarded: ``profile`` is replaced by a function that fails the
test, so a case passes only if the argument is rejected before a step runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import autoremat
from autoremat import zoo
from autoremat._cli import main
from autoremat._core.errors import BlockError, BudgetError, RematError, SchemaError
from autoremat._core.units import parse_budget, parse_size
from autoremat._plan.plan import UnsealedPlanWarning, keep_set_seal


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("profiled before the arguments were checked")


@pytest.fixture
def no_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    import autoremat._auto
    import autoremat._cli

    monkeypatch.setattr(autoremat._auto, "profile", _refuse)
    monkeypatch.setattr(autoremat._cli, "profile", _refuse)
    monkeypatch.setattr(autoremat._cli, "load_target", _refuse)


def _assert_one_line_error(argv: list[str], fragment: str,
                           capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI exits 2 with one line that holds ``fragment``, and no traceback."""
    assert main(argv) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert fragment in text
    assert "Traceback" not in text
    assert len([line for line in text.splitlines() if line.strip()]) == 1, text


def _mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    return zoo.build("mlp", widths=(8, 8, 8), d_in=8, batch_size=2)


_AUTO_CASES: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"budget": "abc"}, BudgetError, "cannot read budget 'abc'"),
    ({"budget": float("nan")}, BudgetError, "finite number of bytes"),
    ({"budget": float("inf")}, BudgetError, "finite number of bytes"),
    ({"budget": "1e400"}, BudgetError, "too large"),
    ({"budget": "nan%"}, BudgetError, "percentage above 0%"),
    ({"budget": "0%"}, BudgetError, "percentage above 0%"),
    ({"budget": -5}, BudgetError, "must not be negative"),
    ({"budget": True}, BudgetError, "got True"),
    ({"budget": [1]}, BudgetError, "got [1]"),
    ({"strategy": "optimall"}, RematError, "Did you mean 'optimal'"),
    ({"strategy": "every:0"}, RematError, "every:K' needs a whole number K >= 1"),
    ({"strategy": "every:two"}, RematError, "got 'every:two'"),
    ({"strategy": "sqrt:2"}, RematError, "takes no argument"),
    ({"strategy": 3}, RematError, "strategy must be a string"),
    ({"max_memory": "lots"}, BudgetError, "cannot read max_memory 'lots'"),
    ({"optimizer": "adamw"}, BudgetError, "only matters with max_memory"),
    ({"max_memory": "8GiB", "optimizer": "adamx"}, BudgetError, "adamx"),
]


@pytest.mark.parametrize(("kwargs", "error", "fragment"), _AUTO_CASES)
def test_auto_checks_its_arguments_before_profiling(
        no_profile: None, kwargs: dict[str, Any], error: type[Exception], fragment: str) -> None:
    model, inputs = _mlp()
    with pytest.raises(error) as info:
        autoremat.auto(model, inputs, **{"budget": "50%", **kwargs})
    assert fragment in str(info.value)


@pytest.mark.parametrize(("value", "fragment"), [
    (float("nan"), "finite"), (float("-inf"), "finite"), ("1e400GiB", "too large"),
    ("inf", "cannot read size 'inf'"), ("12 parsecs", "cannot read size"),
])
def test_sizes_are_finite_numbers(value: Any, fragment: str) -> None:
    with pytest.raises(BudgetError, match=fragment):
        parse_size(value)


def test_a_percentage_must_be_finite() -> None:
    with pytest.raises(BudgetError, match="percentage above 0%"):
        parse_budget("inf%", 100)


_CLI_CASES: list[tuple[list[str], str]] = [
    (["plan", "mlp", "--budget", "abc"], "cannot read budget 'abc'"),
    (["plan", "mlp", "--budget", "1e400"], "too large"),
    (["plan", "mlp", "--strategy", "fulll"], "Did you mean 'full'"),
    (["plan", "mlp", "--strategy", "every:0"], "needs a whole number K >= 1"),
    (["plan", "mlp", "--max-memory", "lots"], "cannot read max_memory 'lots'"),
    (["plan", "mlp", "--budget", "50%", "--head", "chunky"], "head must be None, 'keep'"),
    (["plan", "mlp", "--budget", "50%", "--head", "chunked:0"], "N >= 1"),
    (["plan", "mlp", "--optimizer", "adamw"], "only matters with max_memory"),
    (["plan", "mlp", "--budget", "1GiB", "--deterministic"], "add --verify"),
    (["bench", "mlp", "--budgets", "abc"], "cannot read budget 'abc'"),
    (["bench", "mlp", "--budgets", "50%,nope"], "cannot read budget 'nope'"),
    (["bench", "mlp", "--budgets", ","], "--budgets is empty"),
    (["bench", "mlp", "--repeats", "0"], "--repeats must be at least 1"),
    (["plan", "mlp"], "--strategy optimal needs --budget (e.g. --budget 50%, or 6GiB) or "
                      "--max-memory"),
    (["plan", "mlp", "--out", "p.json"], "needs --budget"),
    (["demo", "--repeats", "0"], "--repeats must be at least 1"),
    (["demo", "--repeats", "-2"], "--repeats must be at least 1"),
]


@pytest.mark.parametrize(("argv", "fragment"), _CLI_CASES)
def test_cli_rejects_bad_input_in_one_line_before_any_work(
        no_profile: None, argv: list[str], fragment: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    _assert_one_line_error(argv, fragment, capsys)


@pytest.mark.parametrize("argv", [["doctor", "mlp", "--batch", "0"],
                                  ["doctor", "mlp", "--batch", "-1"],
                                  ["doctor", "mlp", "--seq", "abc"]])
def test_doctor_refuses_a_batch_or_length_below_one(argv: list[str],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "expected a whole number >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"top": -1}, "top must be a whole number >= 0"),
    ({"top": 2.5}, "top must be a whole number >= 0"),
    ({"throughput_flops": 0.0}, "throughput_flops must be a positive number"),
    ({"throughput_flops": float("nan")}, "throughput_flops must be a positive number"),
    ({"dtype": torch.int8}, r"dtype must be a floating dtype .*got torch\.int8"),
    ({"dtype": "int8"}, "unknown dtype 'int8'"),
])
def test_estimate_checks_its_arguments(kwargs: dict[str, Any], fragment: str) -> None:
    model, inputs = _mlp()
    with pytest.raises(RematError, match=fragment):
        autoremat.estimate(model, inputs, device="cpu", **kwargs)


def test_bench_writes_tables_without_matplotlib(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Any) -> None:
    """Without matplotlib the bench still writes results.md and results.json, and says
    how to get the plots (the hint keeps its '[plot]')."""
    import autoremat._bench.report as report
    from autoremat._bench.plots import PLOT_HINT
    from autoremat._bench.rows import ModelResult, Settings

    monkeypatch.setattr(report, "can_plot", lambda: False)
    result = ModelResult(target="mlp", model="MLPChain", inputs="-", n_blocks=0,
                         plain_peak_bytes=0, plain_step_ms=0.0, plain_flops=0,
                         min_feasible_bytes=None, rows=(), headline=())
    settings = Settings(budgets=("50%",), repeats=1, compile=False)
    paths = report.write_results([result], tmp_path, "autoremat bench mlp",
                                 report.machine_info(), 1.0, settings)
    assert sorted(p.name for p in paths) == ["results.json", "results.md"]
    assert all(p.exists() for p in paths)
    assert "pip install 'autoremat[plot]'" in PLOT_HINT



@pytest.fixture(scope="module")
def selective_plan(zoo_tapes: Callable[..., autoremat.Tape]) -> autoremat.Plan:
    tape = zoo_tapes("gpt2", n_layer=2, batch_size=2, seq_len=16)  # profiled once, shared
    base = autoremat.plan(tape, None, "full")
    first = dataclasses.replace(base.blocks[0], decision=autoremat.Decision.SELECTIVE,
                                keep_ops=(3, 5),
                                skip_ops=(2,), op_signature="abc",
                                keep_seal=keep_set_seal("abc", (3, 5), (2,)))
    return dataclasses.replace(base, blocks=(first, *base.blocks[1:]))


@pytest.mark.parametrize(("change", "fragment"), [
    (lambda b: b.update(keep_ops=[5, 3]), "distinct op positions >= 0 in increasing order"),
    (lambda b: b.update(keep_ops=[3, 3]), "distinct op positions >= 0 in increasing order"),
    (lambda b: b.update(skip_ops=[-1]), "distinct op positions >= 0 in increasing order"),
    (lambda b: b.update(skip_ops=[3]), "ops [3] are both kept and skipped"),
    (lambda b: b.update(op_signature=""), "op_signature is empty"),
    (lambda b: b.update(decision="keep"), "keep_ops is set on a 'keep' block"),
    (lambda b: b.update(segment=1), "segment must be 0 (segments number"),
    (lambda b: b.update(keep_ops=[3]), "is not the one the planner sealed"),
    (lambda b: b.update(skip_ops=[2, 4]), "it was edited"),
    (lambda b: b.pop("keep_seal"), "Plan again instead of editing"),
])
def test_an_edited_plan_file_is_refused(change: Any, fragment: str,
                                        selective_plan: autoremat.Plan) -> None:
    data = json.loads(selective_plan.to_json())
    assert autoremat.Plan.from_json(json.dumps(data)).blocks[0].keep_ops == (3, 5)
    change(data["blocks"][0])
    with pytest.raises(SchemaError, match=re.escape(fragment)):
        autoremat.Plan.from_json(json.dumps(data))


def test_only_recomputed_blocks_share_a_segment(selective_plan: autoremat.Plan) -> None:
    data = json.loads(selective_plan.to_json())
    data["blocks"][1]["segment"] = data["blocks"][0]["segment"]
    with pytest.raises(SchemaError, match="only recomputed blocks whose input stays"):
        autoremat.Plan.from_json(json.dumps(data))
    data["blocks"][0].update(decision="recompute", keep_ops=[], skip_ops=[])
    with pytest.raises(SchemaError, match="edited after autoremat wrote it"):
        autoremat.Plan.from_json(json.dumps(data))  # a well-formed edit: refused by its seal
    del data["seal"]  # as a file saved before plans were sealed: loads, unchecked
    with pytest.warns(UnsealedPlanWarning, match="no seal"):
        assert autoremat.Plan.from_json(json.dumps(data)).blocks[1].segment == 0


def test_an_offloaded_block_is_refused_against_a_tape_measured_without_offload(
        zoo_tapes: Callable[..., autoremat.Tape]) -> None:
    """A plan file edited to offload a block, checked against a tape profiled without
    ``offload=True``: the peak model raised an internal error (found by the property
    test of edited plan files); the plan is refused for what it asks."""
    tape = zoo_tapes("gpt2", n_layer=2, batch_size=2, seq_len=16)
    data = json.loads(autoremat.plan(tape, None, "full").to_json())
    data["blocks"][1].update(decision="offload", segment=1)
    del data["seal"]
    with pytest.warns(UnsealedPlanWarning), \
            pytest.raises(SchemaError, match=re.escape("plan.blocks[1] (blocks.1) is 'offload'"
                                                       ", which this tape did not measure")):
        autoremat.Plan.from_json(json.dumps(data), tape=tape)


class _IntegerOutput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return (x > 0).sum()


def _frozen_mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    model, inputs = _mlp()
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("head"))
    return model, inputs


def _no_grad_profile() -> Any:
    model, inputs = _mlp()
    with torch.no_grad():
        return autoremat.profile(model, inputs)


def _tape() -> autoremat.Tape:
    model, inputs = _mlp()
    return autoremat.profile(model, inputs, repeats=1, timing=False)


_API_CASES: list[tuple[Any, type[Exception], str]] = [
    (lambda: autoremat.profile(*_mlp(), blocks=42), BlockError, "got int 42"),
    (lambda: autoremat.profile(*_mlp(), blocks=[0, 1]), BlockError, "a list of module names"),
    (lambda: autoremat.profile(*_mlp(), blocks="blocks.0"), BlockError,
     "write blocks=['blocks.0']"),
    (lambda: autoremat.profile(*_mlp(), blocks=["blocks.9"]), BlockError,
     "no submodule named 'blocks.9'"),
    (lambda: autoremat.profile(*_mlp(), blocks=["blocks", "blocks.0"]), BlockError,
     "is inside block 'blocks'"),
    (lambda: autoremat.profile(*_mlp(), repeats="3"), RematError,
     "repeats must be a whole number >= 1"),
    (lambda: autoremat.profile(*_mlp(), repeats=True), RematError, "got True"),
    (lambda: autoremat.profile(*_mlp(), loop="eval"), RematError, "unknown loop 'eval'"),
    (lambda: autoremat.profile(*_mlp(), host_bandwidth=1e9), RematError,
     "only matters with offload=True"),
    (lambda: autoremat.profile(*_mlp(), offload=True, host_bandwidth=-1), RematError,
     "host_bandwidth must be a positive number"),
    (lambda: autoremat.profile(*_mlp(), offload=True, compile=True), RematError,
     "not supported"),
    (lambda: autoremat.profile(_mlp()[0], None), RematError, "inputs hold no tensor"),
    (lambda: autoremat.profile(_mlp()[0], [1, 2]), RematError, "inputs hold no tensor"),
    (lambda: autoremat.profile("model", torch.ones(2)), RematError,
     "needs an nn.Module, got str"),
    (_no_grad_profile, RematError, "under torch.no_grad() or torch.inference_mode()"),
    (lambda: autoremat.profile(_IntegerOutput(), torch.ones(2, 4), blocks=["blocks.0"]),
     RematError, "torch.int64, which carry no gradient"),
    (lambda: autoremat.profile(*_frozen_mlp()), BlockError,
     "backward runs through none of the blocks found"),
    (lambda: autoremat.profile(*_frozen_mlp(), blocks=["blocks.0", "blocks.1"]), BlockError,
     "have no trainable parameter and take no input that needs a gradient"),
    (lambda: autoremat.plan(None, "50%"), RematError, "needs a Tape"),
    (lambda: autoremat.plan(_tape(), "50%", offload_dtype="int8"), RematError,
     "offload_dtype must be one of"),
    (lambda: autoremat.plan(_tape(), "50%", shards=0), BudgetError,
     "shards must be a whole number >= 1"),
    (lambda: autoremat.plan(_tape(), 1), BudgetError, "smallest feasible budget"),
    (lambda: autoremat.apply(_mlp()[0], "plan"), RematError, "needs a Plan"),
    (lambda: autoremat.verify(*_mlp(), None), RematError, "verify() needs a plan"),
    (lambda: autoremat.estimate(*_mlp(), device="gpu0"), RematError,
     "cannot read device 'gpu0'"),
    (lambda: autoremat.estimate(*_mlp(), device="cpu", shards=-2), BudgetError,
     "shards must be a whole number >= 1"),
    (lambda: autoremat.profile(*_mlp(), loss_fn=3), RematError,
     "loss_fn must be a function of the model's output"),
    (lambda: autoremat.profile(*_mlp(), loss_fn=lambda out: out.logits), RematError,
     "loss_fn must return a scalar tensor"),
    (lambda: autoremat.profile(*_mlp(), device="tpu9"), RematError,
     "cannot read device 'tpu9'"),
    (lambda: autoremat.remove("model"), RematError, "remove() needs an nn.Module"),
    (lambda: autoremat.profile(*_mlp(), timing="no"), RematError,
     "timing must be True or False, got 'no'"),
    (lambda: autoremat.profile(*_mlp(), with_selective=2), RematError,
     "with_selective must be True or False"),
    (lambda: autoremat.estimate(*_mlp(), device="cpu", offload="yes"), RematError,
     "offload must be True or False"),
    (lambda: autoremat.verify(*_mlp(), autoremat.plan(_tape(), None, "full"),
                              deterministic="yes"), RematError,
     "deterministic must be True or False"),
    (lambda: autoremat.apply(_mlp()[0], autoremat.plan(_tape(), None, "full"),
                             check_ranks="no"), RematError,
     "check_ranks must be True or False"),
    (lambda: autoremat.auto(*_mlp()), BudgetError, "would plan to keep every block"),
    (lambda: autoremat.Plan.from_json("{"), SchemaError, "plan is not valid JSON"),
    (lambda: autoremat.Tape.from_json("{}"), SchemaError, "schema_version None"),
]


def test_frozen_lower_blocks_leave_a_discovered_chain() -> None:
    """A partial fine-tune (lower blocks frozen) plans over the blocks backward runs
    through, and says which it left out."""
    model, inputs = zoo.build("mlp", widths=(16,) * 4, d_in=16, batch_size=8)
    for param in model.blocks[:2].parameters():
        param.requires_grad_(False)
    tape = autoremat.profile(model, inputs, repeats=1, timing=False)
    assert [b.name for b in tape.blocks] == ["blocks.2", "blocks.3"]
    assert any("backward never runs through 2 of the blocks found (blocks.0, blocks.1: "
               "frozen" in n for n in tape.notes)


_CLI_BUILD_CASES: list[tuple[list[str], str]] = [
    (["plan", "mlp", "--budget", "50%", "--set", "batch_size=abc"],
     "option batch_size='abc' must be a whole"),
    (["plan", "mlp", "--budget", "50%", "--set", "batch_size=0"], "must be a whole number >= 1"),
    (["plan", "mlp", "--budget", "50%", "--set", "widths=abc"], "must be a tuple of whole numbers"),
    (["profile", "gpt2", "--set", "bias=3"], "option bias=3 must be true or false"),
    (["profile", "gpt2", "--set", "dropout=high"], "option dropout='high' must be a number"),
    (["profile", "mlp", "--set", "nope=3"], "unknown option 'nope'"),
    (["profile", "mlp", "--set", "batch_size"], "write key=value pairs"),
    (["profile", "mlp", "--set", "batch_size=2,batch_size=3"], "is given twice"),
    (["profile", "nosuchmodel"], "unknown target 'nosuchmodel'"),
    (["profile", "nosuchpackage_xyz:make"], "cannot import 'nosuchpackage_xyz'"),
    (["profile", "mlp", "--out", "/proc/no/such/tape.json"], "cannot write to"),
    (["plan", "mlp", "--budget", "50%", "--out", "/proc/no/plan.json"], "cannot write to"),
    (["bench", "mlp", "--budgets", "50%", "--out", "/proc/no/dir"], "cannot write to"),
    (["profile", "mlp", "--set", "batch_size=-1"], "option batch_size=-1 is negative"),
    (["plan", "mlp", "--strategy", "full", "--set", "widths=8,-8"], "is negative"),
    (["profile", "mlp", "--set", "widths=8,8,d_in=8,batch_size=2", "--ops", "blocks.99"],
     "--ops blocks.99: no block 'blocks.99' in MLPChain."),
    (["profile", "mlp", "--set", "widths=(8,8),d_in=8,batch_size=2", "--ops", "block.1"],
     "Did you mean 'blocks.1'?"),
]


@pytest.mark.parametrize(("argv", "fragment"), _CLI_BUILD_CASES)
def test_cli_refuses_bad_targets_and_paths_before_profiling(
        monkeypatch: pytest.MonkeyPatch, argv: list[str], fragment: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    import autoremat._cli
    import autoremat._cli.bench as bench_cli

    monkeypatch.setattr(autoremat._cli, "profile", _refuse)
    monkeypatch.setattr(bench_cli, "run_bench", _refuse)
    _assert_one_line_error(argv, fragment, capsys)


def test_cli_out_that_is_a_directory(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "mlp", "--out", str(tmp_path)]) == 2
    assert "it is a directory; give a file name" in capsys.readouterr().out


def _mlp_plan(train: bool = True) -> tuple[torch.nn.Module, torch.Tensor, autoremat.Plan]:
    model, inputs = zoo.build("mlp", widths=(16,) * 3, d_in=16, batch_size=4)
    model.train(train)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eval() profile's own warning
        tape = autoremat.profile(model, inputs, repeats=1, timing=False)
    model.train()
    return model, inputs, autoremat.plan(tape, None, "full")


def test_a_plan_records_its_device_and_mode() -> None:
    _, _, plan = _mlp_plan()
    assert (plan.device, plan.training) == ("cpu", True)
    again = autoremat.Plan.from_json(plan.to_json())
    assert (again.device, again.training) == ("cpu", True)
    data = json.loads(plan.to_json())
    del data["device"], data["training"], data["seal"]  # a plan file saved before these fields
    assert autoremat.Plan.from_json(json.dumps(data)).device == ""
    for key, value, fragment in (("training", "yes", "plan.training must be true or false"),
                                 ("device", 3, "plan.device must be a string")):
        with pytest.raises(SchemaError, match=fragment):
            autoremat.Plan.from_json(json.dumps({**data, key: value}))


@pytest.mark.parametrize(("change", "fragment"), [
    ({"device": "cuda"}, "this plan was made for cuda; the model now runs on cpu"),
    ({"training": False}, "profiled with the model in eval() mode and the model now trains"),
])
def test_a_plan_for_another_device_or_mode_warns_at_a_training_forward(
        change: dict[str, Any], fragment: str) -> None:
    model, inputs, plan = _mlp_plan()
    autoremat.apply(model, dataclasses.replace(plan, **change))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(*inputs)  # evaluation: nothing is recomputed, nothing to warn about
    with pytest.warns(autoremat.PlanMismatchWarning, match=re.escape(fragment)):
        model(*inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(*inputs)  # once per kind


def test_a_plan_for_another_autocast_warns_at_a_training_forward() -> None:
    model, inputs, plan = _mlp_plan()
    autoremat.apply(model, dataclasses.replace(plan, autocast="cpu:bfloat16"))
    with pytest.warns(autoremat.StepMismatchWarning, match=re.escape(
            "profiled under autocast cpu:bfloat16, and the model now runs without autocast")):
        model(*inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(*inputs)  # once per kind


@pytest.mark.parametrize(("change", "fragment"), [
    ({"structure": "blocks=2"}, "made for a MLPChain of blocks=2 (the modules each parent"),
    ({"dtypes": "bfloat16"}, "whose parameters are bfloat16; this one's are float32"),
    ({"dtypes": "float32,float64"}, "parameters are float32,float64; this one's are float32"),
])
def test_a_plan_of_another_structure_or_dtype_is_refused_at_apply(
        change: dict[str, Any], fragment: str) -> None:
    model, _, plan = _mlp_plan()
    with pytest.raises(autoremat.PlanMismatchError, match=re.escape(fragment)):
        autoremat.apply(model, dataclasses.replace(plan, **change))
    assert autoremat.applied_plan(model) is None


def test_an_eval_profile_is_recorded_in_its_plan() -> None:
    _, _, plan = _mlp_plan(train=False)
    assert plan.training is False


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="notes need Python 3.11")
def test_the_models_own_error_says_which_call_raised() -> None:
    """A model that raises (here: inputs of the wrong width) keeps its own exception,
    with a note that it was raised in a step autoremat ran."""
    model, _ = _mlp()
    with pytest.raises(RuntimeError) as info:
        autoremat.profile(model, torch.ones(2, 5))
    assert any("raised by the forward of MLPChain on inputs (2, 5) float32" in note
               for note in getattr(info.value, "__notes__", []))


@pytest.mark.parametrize(("argv", "missing", "fragment"), [
    (["doctor", "mlp", "--plot", "m.png"], "matplotlib",
     "--plot needs matplotlib, which is not installed here: pip install 'autoremat[plot]'"),
    (["estimate", "--hf", "llama"], "transformers",
     "--hf llama needs transformers, which is not installed here: pip install "
     "'autoremat[hf]'"),
    (["doctor", "autoremat.zoo:hf_gpt2"], "transformers", "pip install 'autoremat[hf]'"),
    (["profile", "autoremat.zoo:hf_gpt2"], "transformers", "pip install 'autoremat[hf]'"),
    (["bench", "autoremat.zoo:hf_gpt2"], "transformers", "pip install 'autoremat[hf]'"),
])
def test_a_missing_extra_is_named_before_any_work(
        monkeypatch: pytest.MonkeyPatch, argv: list[str], missing: str, fragment: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    import autoremat._cli
    import autoremat._cli.bench as bench_cli
    import autoremat._cli.doctor as doctor_cli
    import autoremat._cli.extras as extras

    for module, name in ((autoremat._cli, "load_target"), (doctor_cli, "load_target"),
                         (doctor_cli, "build_hf_model"), (doctor_cli, "doctor"),
                         (bench_cli, "run_bench")):
        monkeypatch.setattr(module, name, _refuse)
    monkeypatch.setattr(extras, "installed", lambda module: module != missing)
    _assert_one_line_error(argv, fragment, capsys)


@pytest.mark.parametrize(("argv", "fragment"), [
    (["doctor", "--hf", "llama", "--seq", "16", "--config",
      "hidden_size=4095,num_attention_heads=32"],
     "Transformers refused the config: Class validation error"),
    (["doctor", "--hf", "llama", "--seq", "16", "--config",
      "hidden_size=64,intermediate_size=64,num_attention_heads=0,num_hidden_layers=1"],
     "Transformers refused the config: integer division or modulo by zero. Fix the values"),
    (["doctor", "--hf", "llama", "--config", "num_hidden_layers=-1"],
     "option num_hidden_layers=-1 is negative"),
    (["estimate", "mlp", "--memory", "lots"], "autoremat estimate: error: cannot read memory"),
    (["doctor", "mlp", "--optimizer", "12 parsecs"], "cannot read optimizer state"),
])
def test_doctor_refuses_a_bad_config_in_one_line(
        monkeypatch: pytest.MonkeyPatch, argv: list[str], fragment: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    import autoremat._cli.doctor as doctor_cli

    monkeypatch.setattr(doctor_cli, "doctor", _refuse)
    _assert_one_line_error(argv, fragment, capsys)


_FACTORY = '''
import torch
from torch import nn

def make(width=8, depth=2):
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]), torch.ones(2, width)
'''


@pytest.mark.parametrize(("argv", "fragment"), [
    (["plan", "autoremat_cli_factory:make", "--strategy", "full", "--set", "widht=3"],
     "autoremat_cli_factory:make cannot be called with widht (got an unexpected keyword "
     "argument 'widht'); its parameters are (width=8, depth=2)"),
    (["profile", "autoremat_cli_factory.py:make", "--set", "depth=2,batch_size=-1"],
     "option batch_size=-1 is negative"),
    (["doctor", "autoremat_cli_factory:make", "--config", "widths=8,8"],
     "cannot be called with widths"),
    (["profile", "autoremat_cli_factory:maek"], "has no callable 'maek'. Did you mean 'make'?"),
])
def test_a_factory_in_the_current_folder_refuses_options_in_one_line(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, argv: list[str], fragment: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    import autoremat._cli

    (tmp_path / "autoremat_cli_factory.py").write_text(_FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "autoremat_cli_factory", raising=False)
    monkeypatch.setattr(autoremat._cli, "profile", _refuse)
    _assert_one_line_error(argv, fragment, capsys)


def test_doctor_passes_on_an_error_that_is_not_about_the_config(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what Transformers raises about a config becomes one line; a bug stays a bug."""
    import autoremat._cli.doctor as doctor_cli

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise AttributeError("'LlamaConfig' object has no attribute 'rope_type'")

    monkeypatch.setattr(doctor_cli, "build_hf_model", broken)
    monkeypatch.setattr(doctor_cli, "require", lambda *args: None)
    with pytest.raises(AttributeError, match="rope_type"):
        main(["doctor", "--hf", "llama"])


@pytest.mark.parametrize("where", ["/site-packages/transformers/models/x/modeling_x.py",
                                   "/home/user/mymodel.py"])
def test_doctor_names_the_config_when_the_built_model_fails_in_its_step(
        where: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A model --hf built from its config that fails in Transformers' code during the
    step (DeepSeek-V2's default config leaves num_experts_per_tok unset: topk(k=None))
    is one line about --config, naming the line; the same error from other code stays
    raw."""
    import autoremat._cli.doctor as doctor_cli

    code = compile("def forward():\n    raise TypeError(\"topk(): argument 'k' must be int, "
                   "not NoneType\")\n", where.replace("/", os.sep), "exec")
    scope: dict[str, Any] = {}
    exec(code, scope)

    def fails(*args: Any, **kwargs: Any) -> Any:
        scope["forward"]()

    monkeypatch.setattr(doctor_cli, "doctor", fails)
    argv = ["doctor", "--hf", "llama", "--config", "num_hidden_layers=1,hidden_size=64,"
            "intermediate_size=128,num_attention_heads=4,vocab_size=128", "--seq", "8"]
    if "transformers" not in where:
        with pytest.raises(TypeError, match="topk"):
            main(argv)
        return
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("autoremat doctor: error: --hf llama")
    assert "the model failed on this config at modeling_x.py:2: topk(): argument 'k'" in err
    assert err.endswith("Fix the values in --config")


def test_estimate_of_a_model_that_reads_values_says_what_to_do() -> None:
    """On meta a forward that branches on a value cannot run: the refusal names the model
    and the way on (measure it on a real device), not only what went wrong."""

    class Gated(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
                if x.sum() > 0:  # reads a value
                    x = x.relu()
            return x

    with pytest.raises(RematError) as info:
        autoremat.estimate(Gated(), torch.randn(2, 4), device="cpu", selective=False)
    message = str(info.value)
    assert message.startswith("Gated cannot run on fake (meta) tensors")
    assert "autoremat.profile on a real device" in message


def test_a_plan_that_decides_a_block_twice_is_refused() -> None:
    model, _, plan = _mlp_plan()
    data = json.loads(plan.to_json())
    data["blocks"].insert(1, dict(data["blocks"][0], segment=1))
    for b in data["blocks"][2:]:
        b["segment"] += 1
    del data["seal"]  # even unsealed: no plan decides a block twice
    with pytest.raises(SchemaError, match=r"names block .* again"):
        autoremat.Plan.from_json(json.dumps(data))
    twice = dataclasses.replace(plan, blocks=(plan.blocks[0], *plan.blocks))
    with pytest.raises(autoremat.PlanMismatchError, match="twice"):
        autoremat.apply(model, twice)
    assert autoremat.applied_plan(model) is None


def test_a_prediction_above_the_budget_is_refused_unsealed() -> None:
    _, _, plan = _mlp_plan()
    data = json.loads(plan.to_json())
    del data["seal"]
    data["budget_bytes"] = data["predicted_peak_bytes"] - 1
    with pytest.raises(SchemaError, match=r"is above plan\.budget_bytes"):
        autoremat.Plan.from_json(json.dumps(data))


# --- issue 26's misuse sweep (benchmarks/misuse_sweep.py): each failed before its fix ---------


class _Named(torch.nn.Module):
    """Its layers in a ModuleDict keyed by name (parts, which discovery does not search;
    one keyed by position is, test_blocks.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleDict({key: torch.nn.Linear(4, 4)
                                           for key in ("embed", "mix", "proj", "out")})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks.values():
            x = b(x)
        return x


def _scripted() -> torch.nn.Module:
    model, _ = _mlp()
    model.blocks[1] = torch.jit.script(model.blocks[1])
    return model


def _plan_json() -> str:
    return autoremat.plan(_tape(), None, "full").to_json()


_SWEEP_CASES: list[tuple[Any, type[Exception], str]] = [
    (lambda: autoremat.apply(_mlp()[0], autoremat.plan(_tape(), None, "full"),
                             rank_timeout_s=0), RematError,
     "rank_timeout_s (how long a rank waits for the others) must be a number of seconds > 0"),
    (lambda: autoremat.profile(zoo.build("mlp", widths=(8,), d_in=8, batch_size=2)[0],
                               torch.ones(2, 8)), BlockError, "holds a single block"),
    (lambda: autoremat.profile(_Named(), torch.ones(2, 4)), BlockError,
     "(the Linear layers in the ModuleDict 'blocks' are not searched: its keys name parts, "
     "not positions in a chain, as '0', '1', ... or 'layer0', 'layer1', ... would): give "
     "blocks=['blocks.embed', 'blocks.mix', 'blocks.proj', ...]"),
    (lambda: autoremat.profile(_scripted(), _mlp()[1], blocks=["blocks.0", "blocks.1"]),
     BlockError, "block 'blocks.1' is a TorchScript module"),
    (lambda: autoremat.profile(_mlp()[0], tuple(t.to("meta") for t in _mlp()[1])), RematError,
     "the inputs are on meta and the model on cpu"),
    (lambda: autoremat.Plan.from_json(""), SchemaError, "the plan JSON text is empty"),
    (lambda: autoremat.Plan.from_json("  "), SchemaError, "the plan JSON text is empty"),
    (lambda: autoremat.Plan.from_json(json.loads(_plan_json())), SchemaError,
     "got dict (for a dict: json.dumps(it) first)"),
    (lambda: autoremat.Plan.from_json("[]"), SchemaError, "plan JSON must be an object"),
    (lambda: autoremat.plan(_tape(), None, "full").to_json("/proc/no/such/plan.json"),
     RematError, "cannot write to '/proc/no/such/plan.json'"),
    (lambda: autoremat.plan(_tape(), "0.5"), BudgetError,  # a string too (was "0 B")
     "budget '0.5' is less than one byte: a number is a count of bytes; for a share of the "
     "unplanned peak write '50%'"),
    (lambda: autoremat.plan(_tape(), 0.5), BudgetError,
     "budget 0.5 is less than one byte: a number is a count of bytes; for a share of the "
     "unplanned peak write '50%'"),
    (lambda: autoremat.doctor(*_mlp(), memory=0, device="cpu"), BudgetError,
     "memory must be the device's memory in bytes (> 0), got 0"),
    (lambda: autoremat.applied_plan("model"), RematError,
     "applied_plan() needs an nn.Module, got str"),
]


@pytest.mark.parametrize(("call", "error", "fragment"), _API_CASES + _SWEEP_CASES)
def test_api_misuse_is_a_clear_error(call: Any, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value)


@pytest.mark.parametrize("strategy", ["full", "sqrt"])
@pytest.mark.parametrize("caller", ["profile", "estimate"])
def test_profile_and_estimate_refuse_an_applied_model_before_any_work(
        caller: str, strategy: str) -> None:
    """estimate ran the planned model's forward on meta (warning of a plan made for cpu
    running on meta) before refusing "before profiling it"; a plan of segments alone
    (hooks, no wrapper) went unseen."""
    model, inputs = _mlp()
    autoremat.apply(model, autoremat.plan(_tape(), None, strategy))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(RematError, match=rf"^{caller}\(\) measures the plain step, "
                               r"and MLPChain has a plan applied: call autoremat.remove"):
                getattr(autoremat, caller)(model, inputs)
    finally:
        autoremat.remove(model)


def test_optimizer_none_by_name_is_no_optimizer_state() -> None:
    # "none", as the command line's --optimizer takes it, means what None means
    tape = _tape()
    plans = [autoremat.plan(tape, max_memory=f"{tape.step_peak_bytes * 20}B", optimizer=o)
             for o in (None, "none", "None")]
    assert len({p.budget_bytes for p in plans}) == 1
    adamw = autoremat.plan(tape, max_memory=f"{tape.step_peak_bytes * 20}B", optimizer="adamw")
    assert adamw.budget_bytes < plans[0].budget_bytes  # a state that does count


def test_a_plan_loads_from_bytes() -> None:
    text = _plan_json()
    assert autoremat.Plan.from_json(text.encode()) == autoremat.Plan.from_json(text)


def test_a_negative_count_in_a_plan_file_is_refused_unsealed() -> None:
    data = json.loads(_plan_json())
    del data["seal"]
    data["predicted_recompute_flops"] = -1
    with pytest.raises(SchemaError, match=r"plan\.predicted_recompute_flops must be >= 0"):
        autoremat.Plan.from_json(json.dumps(data))


def test_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"autoremat {autoremat.__version__}"


def test_python_dash_m_autoremat_runs_the_command(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import runpy

    monkeypatch.setattr(sys, "argv", ["autoremat", "--version"])
    with pytest.raises(SystemExit) as info:
        runpy.run_module("autoremat", run_name="__main__")
    assert info.value.code == 0
    assert "autoremat" in capsys.readouterr().out


@pytest.mark.parametrize(("source", "argv", "fragment"), [
    ("def make(:\n    pass\n", ["profile", "autoremat_broken:make"],
     "importing 'autoremat_broken' for target 'autoremat_broken:make' raised SyntaxError"),
    ("import torch\n\ndef make(width=8):\n    raise ValueError('my factory is broken')\n",
     ["profile", "autoremat_broken:make", "--set", "width=4"],
     "autoremat_broken:make(width=4) raised ValueError: my factory is broken at "),
    ("raise KeyError('at import')\n", ["plan", "autoremat_broken.py:make", "--strategy", "full"],
     "importing 'autoremat_broken.py' for target 'autoremat_broken.py:make' raised KeyError"),
])
def test_a_factory_that_raises_is_one_line_naming_where(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, source: str, argv: list[str],
        fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    import autoremat._cli

    (tmp_path / "autoremat_broken.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "autoremat_broken", raising=False)
    monkeypatch.setattr(autoremat._cli, "profile", _refuse)
    _assert_one_line_error(argv, fragment, capsys)


def test_numpy_integers_are_integers() -> None:
    # issue 36: a budget, a count or an optimizer's bytes computed with numpy
    np = pytest.importorskip("numpy")
    model, inputs = autoremat.zoo.build("mlp", widths=(16,) * 3, batch_size=4)
    tape = autoremat.profile(model, inputs, timing=False, repeats=np.int64(2))
    plan = autoremat.plan(tape, np.int64(tape.step_peak_bytes))
    assert plan.budget_bytes == tape.step_peak_bytes and type(plan.budget_bytes) is int
    assert autoremat.plan(tape, max_memory=np.int64(10**9),
                          optimizer=np.int32(1000)).budget_bytes is not None
    for flag in (np.bool_(True), True):  # a bool is no count of bytes
        with pytest.raises(autoremat.BudgetError, match="must be bytes"):
            autoremat.plan(tape, flag)
