"""Tests for autoremat._targets: TARGET specs and key=value options, one rule for every command."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
from torch import nn

from autoremat._core.errors import RematError
from autoremat._targets import load_target, parse_options


@pytest.mark.parametrize(("text", "expected"), [
    ("num_hidden_layers=32,hidden_size=4096", {"num_hidden_layers": 32, "hidden_size": 4096}),
    ("rope_theta=1e6, tie_word_embeddings=False ,act=silu",
     {"rope_theta": 1e6, "tie_word_embeddings": False, "act": "silu"}),
    ("dropout=0.0,sliding_window=null,x=-3", {"dropout": 0.0, "sliding_window": None, "x": -3}),
    ("", {}), (None, {}), ("a=1,,", {"a": 1}),
])
def test_parse_options(text: str | None, expected: dict[str, Any]) -> None:
    assert parse_options(text) == expected


@pytest.mark.parametrize("text", ["hidden_size", "=3", "hidden size=3", "a=1,b"])
def test_parse_options_errors_show_the_format(text: str) -> None:
    with pytest.raises(RematError, match="key=value pairs"):
        parse_options(text)


def test_an_option_given_twice_is_an_error() -> None:
    with pytest.raises(RematError, match="'n_layer' is given twice"):
        parse_options("n_layer=2,n_layer=3")


@pytest.fixture
def factories(monkeypatch: pytest.MonkeyPatch) -> str:
    module = types.ModuleType("_autoremat_test_factories")

    def good(width: int = 4) -> tuple[nn.Module, Any]:
        return nn.Linear(width, width), torch.ones(2, width)

    module.good = good  # type: ignore[attr-defined]
    module.bad = lambda: "not a pair"  # type: ignore[attr-defined]
    module.not_callable = 3  # type: ignore[attr-defined]
    module.triple = lambda: (nn.Linear(2, 2), torch.ones(2), 1)  # type: ignore[attr-defined]
    module.swapped = lambda: ("a model", nn.Linear(2, 2))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.__name__


def test_a_factory_gets_the_options_and_builds_on_the_device(factories: str) -> None:
    model, inputs = load_target(f"{factories}:good", {"width": 6}, device="meta")
    assert model.weight.shape == (6, 6) and model.weight.is_meta and inputs.is_meta


def test_a_zoo_target_gets_options_device_and_dtype() -> None:
    model, _ = load_target("mlp", {"batch_size": 2}, device="meta", dtype=torch.bfloat16)
    param = next(model.parameters())
    assert param.is_meta and param.dtype == torch.bfloat16


@pytest.mark.parametrize(("target", "message"), [
    ("gtp2", "unknown target 'gtp2'.*Did you mean 'gpt2'"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    ("{m}:goood", "has no callable 'goood'.*Did you mean 'good'"),
    # an attribute that is no function: named as what it is, and no "did you mean" itself
    ("{m}:not_callable", "has no callable 'not_callable' \\('not_callable' is of type int, not a "
                         "function\\)\\.$"),
    ("{m}:bad", "must return \\(model, inputs\\).*, got str"),
    ("{m}:triple", "must return \\(model, inputs\\).*, got a tuple of 3"),
    ("{m}:swapped", "got a tuple whose first item is a str, not an nn.Module"),
])
def test_target_errors_say_what_to_do(factories: str, target: str, message: str) -> None:
    with pytest.raises(RematError, match=message):
        load_target(target.format(m=factories))


def test_a_dtype_for_a_factory_is_refused_not_ignored(factories: str) -> None:
    with pytest.raises(RematError, match="dtype= applies to zoo models only"):
        load_target(f"{factories}:good", dtype=torch.float16)


def test_the_hf_bench_target_loads_from_the_zoo() -> None:
    pytest.importorskip("transformers")
    model, inputs = load_target("autoremat.zoo:hf_gpt2", parse_options("n_layer=1,seq_len=8"))
    assert type(model).__name__ == "GPT2LMHeadModel" and not model.config.use_cache
    assert tuple(inputs["input_ids"].shape) == (4, 8)
    with pytest.raises(RematError, match="unknown option"):
        load_target("autoremat.zoo:hf_gpt2", {"layers": 2})


@pytest.mark.parametrize(("text", "expected"), [
    ("widths=64,128", {"widths": (64, 128)}),
    ("widths=64,128,batch_size=8", {"widths": (64, 128), "batch_size": 8}),
    ("widths=(64, 128),batch_size=8", {"widths": (64, 128), "batch_size": 8}),
    ("kernel=[3],scale=0.5,1.5", {"kernel": (3,), "scale": (0.5, 1.5)}),
    ("act=gelu,n=2", {"act": "gelu", "n": 2}),
])
def test_parse_options_reads_tuples(text: str, expected: dict[str, Any]) -> None:
    assert parse_options(text) == expected


@pytest.mark.parametrize("text", ["act=gelu,2", "widths=64,x"])
def test_only_numbers_continue_a_tuple(text: str) -> None:
    with pytest.raises(RematError, match="key=value pairs"):
        parse_options(text)


def test_a_tuple_option_reaches_the_zoo() -> None:
    model, inputs = load_target("mlp", parse_options("widths=8,16,batch_size=2,d_in=8"))
    assert [block.fc.out_features for block in model.blocks] == [8, 16]
    assert tuple(inputs[0].shape) == (2, 8)


_FACTORY_FILE = '''
import torch
from torch import nn

def make(width=4, depth=2, offset=0):
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    return model, torch.ones(2, width) + offset
'''


@pytest.fixture
def factory_folder(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A folder holding ``autoremat_cwd_factory.py``, made the current folder; the module
    is forgotten afterwards so that each test imports it afresh."""
    (tmp_path / "autoremat_cwd_factory.py").write_text(_FACTORY_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "autoremat_cwd_factory", raising=False)
    yield tmp_path
    sys.modules.pop("autoremat_cwd_factory", None)


def test_a_module_target_imports_from_the_current_folder(factory_folder: Any) -> None:
    path_before = list(sys.path)
    assert str(factory_folder) not in sys.path
    model, inputs = load_target("autoremat_cwd_factory:make", {"width": 3, "depth": 3})
    assert len(model) == 3 and tuple(inputs.shape) == (2, 3)
    assert sys.path == path_before  # the folder was on the path for the import only


def test_a_file_target_imports_from_its_path(factory_folder: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(factory_folder.parent)
    path_before = list(sys.path)
    model, _ = load_target(f"{factory_folder.name}/autoremat_cwd_factory.py:make",
                           {"depth": 1})
    assert len(model) == 1 and sys.path == path_before
    with pytest.raises(RematError, match=r"no file 'nowhere/m\.py'"):
        load_target("nowhere/m.py:make")


@pytest.mark.parametrize(("options", "message"), [
    ({"wdth": 3}, r"cannot be called with wdth .*its parameters are \(width=4, depth=2, "
                  r"offset=0\)"),
    ({"batch_size": -1}, "option batch_size=-1 is negative"),
    ({"depth": 2, "n_layers": -2}, "option n_layers=-2 is negative"),
])
def test_a_factory_refuses_options_it_cannot_take(factory_folder: Any,
                                                  options: dict[str, Any],
                                                  message: str) -> None:
    with pytest.raises(RematError, match=message):
        load_target("autoremat_cwd_factory:make", options)


def test_a_negative_number_that_is_not_a_size_reaches_the_factory(factory_folder: Any) -> None:
    _, inputs = load_target("autoremat_cwd_factory:make", {"offset": -3})
    assert float(inputs[0, 0]) == -2.0


@pytest.mark.parametrize("options", [{"batch_size": -1}, {"widths": (8, -8)},
                                     {"dropout": -0.1}])
def test_a_zoo_model_refuses_negative_numbers(options: dict[str, Any]) -> None:
    with pytest.raises(RematError, match="is negative"):
        load_target("mlp", options)


def test_a_file_target_named_like_a_loaded_module_does_not_replace_it(tmp_path: Any) -> None:
    (tmp_path / "json.py").write_text(_FACTORY_FILE)
    import json

    model, _ = load_target(f"{tmp_path / 'json.py'}:make", {"depth": 3})
    assert len(model) == 3 and sys.modules["json"] is json
    sys.modules.pop("_autoremat_target_json", None)
