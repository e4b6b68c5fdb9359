"""Tests for autoremat.tape: the Tape's versioned JSON and its printed table."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import autoremat._measure.tape as tape_module
from autoremat import Decision, Tape
from autoremat._core.errors import RematError, SchemaError
from autoremat._core.files import SCHEMA_VERSION

from conftest import V1_TAPE


def _data(tape: Tape) -> dict[str, Any]:
    return json.loads(tape.to_json())


def _load(data: dict[str, Any]) -> Tape:
    return Tape.from_json(json.dumps(data))


def test_json_round_trip_is_exact(tiny_tape: Tape) -> None:
    text = tiny_tape.to_json()
    again = Tape.from_json(text)
    assert again == tiny_tape
    assert again.to_json() == text
    assert json.loads(text)["schema_version"] == SCHEMA_VERSION
    # frozen, typed data all the way down
    assert isinstance(again.blocks, tuple) and isinstance(again.notes, tuple)
    assert [b.name for b in again.blocks] == ["blocks.0", "blocks.1", "blocks.2"]


def test_writes_to_a_file_and_reads_it_back(tiny_tape: Tape, tmp_path: Path) -> None:
    path = tmp_path / "out" / "tape.json"  # the parent is created
    text = tiny_tape.to_json(path)
    assert path.read_text() == text
    assert Tape.from_json(path) == tiny_tape
    assert Tape.from_json(str(path)) == tiny_tape
    assert os.listdir(path.parent) == ["tape.json"]  # no temporary left behind


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    tiny_tape: Tape, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tape.json"
    path.write_text("old contents")

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(tape_module.os, "replace", broken_replace)
    with pytest.raises(RematError, match=r"cannot write to .*: disk on fire; choose another"):
        tiny_tape.to_json(path)
    assert path.read_text() == "old contents"
    assert os.listdir(tmp_path) == ["tape.json"]


def test_missing_file_is_a_schema_error(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="cannot read tape file"):
        Tape.from_json(tmp_path / "nope.json")


@pytest.mark.parametrize("version", [SCHEMA_VERSION + 1, 0, "1", None])
def test_wrong_schema_version_names_both_versions(tiny_tape: Tape, version: Any) -> None:
    data = _data(tiny_tape)
    data["schema_version"] = version
    with pytest.raises(SchemaError) as info:
        _load(data)
    assert f"schema_version {version!r}" in str(info.value)
    assert f"reads version {SCHEMA_VERSION}" in str(info.value)


def test_not_json_and_not_an_object_are_schema_errors() -> None:
    with pytest.raises(SchemaError, match="not valid JSON"):
        Tape.from_json('{"schema_version": 1,')
    with pytest.raises(SchemaError, match="must be a list"):
        Tape.from_json('{"schema_version": 1, "blocks": {}}')


def _drop(*path: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        node = data
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return edit


def _set(value: Any, *path: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "names"),
    [
        (_drop("step_peak_bytes"), ["tape", "step_peak_bytes"]),
        (_drop("grad_bytes"), ["tape", "grad_bytes"]),
        (_drop("blocks", 1, "saved_bytes"), ["tape.blocks[1]", "saved_bytes"]),
        (_drop("blocks", 0, "name"), ["tape.blocks[0]", "name"]),
        (_drop("pre", "peak_bytes"), ["tape.pre", "peak_bytes"]),
        (_drop("blocks", 2, "fwd", "keep>keep", "delta_bytes"),
         ["tape.blocks[2].fwd.keep>keep", "delta_bytes"]),
    ],
    ids=["step_peak_bytes", "grad_bytes", "block-saved_bytes", "block-name", "pre-peak",
         "window-delta"],
)
def test_missing_field_is_named(
    tiny_tape: Tape, edit: Callable[[dict[str, Any]], None], names: list[str]
) -> None:
    data = _data(tiny_tape)
    edit(data)
    with pytest.raises(SchemaError) as info:
        _load(data)
    message = str(info.value)
    assert all(name in message for name in names), message
    assert "missing field" in message


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (_set("lots", "step_peak_bytes"), "tape.step_peak_bytes"),
        (_set(True, "grad_bytes"), "tape.grad_bytes"),  # a bool is not an int
        (_set(1.5, "param_bytes"), "tape.param_bytes"),
        (_set("fast", "step_ms"), "tape.step_ms"),
        (_set(3, "model"), "tape.model"),
        (_set("fast", "blocks", 0, "fwd_ms"), "tape.blocks[0].fwd_ms"),
        (_set(2.0, "blocks", 1, "saved_bytes"), "tape.blocks[1].saved_bytes"),
        (_set(1, "blocks", 1, "chained"), "tape.blocks[1].chained"),
        (_set("1", "pre", "peak_bytes"), "tape.pre.peak_bytes"),
        (_set(0.5, "blocks", 0, "bwd", "keep>keep", "peak_bytes"),
         "tape.blocks[0].bwd.keep>keep.peak_bytes"),
        (_set(7, "post"), "tape.post"),
        (_set("yes", "blocks", 0, "ops", 0, "random"), "tape.blocks[0].ops[0].random"),
        (_set({}, "blocks", 0, "ops"), "tape.blocks[0].ops"),
        (_set([1, 2, 3], "blocks", 1, "bwd_recompute_split"),
         "tape.blocks[1].bwd_recompute_split must be two integers"),
        (_set(["1", 2], "blocks", 1, "bwd_recompute_split"),
         "tape.blocks[1].bwd_recompute_split must be a list of integers"),
        # containers
        (_set("big", "peak_breakdown"), "peak_breakdown"),
        (_set({"activations": "x"}, "peak_breakdown"), "peak_breakdown"),
        (_set([1], "blocks", 0, "saved_bytes_by_kind"), "saved_bytes_by_kind"),
        (_set(5, "notes"), "notes"),
        (_set("abc", "notes"), "notes"),
    ],
)
def test_wrong_type_field_is_named(
    tiny_tape: Tape, edit: Callable[[dict[str, Any]], None], where: str
) -> None:
    data = _data(tiny_tape)
    edit(data)
    with pytest.raises(SchemaError) as info:
        _load(data)
    assert where in str(info.value)


def test_unknown_field_is_named(tiny_tape: Tape) -> None:
    data = _data(tiny_tape)
    data["blocks"][0]["saved_mb"] = 1
    with pytest.raises(SchemaError, match=r"tape.blocks\[0\]: unknown field\(s\) \['saved_mb'\]"):
        _load(data)


def test_print_shows_every_block_and_the_peak(
    tiny_tape: Tape, capsys: pytest.CaptureFixture[str]
) -> None:
    print(tiny_tape)
    out = capsys.readouterr().out
    for block in tiny_tape.blocks:
        assert block.name in out
    assert "MLPChain" in out
    assert "step peak" in out


# --- files of schema version 1 (tests/data/README.md) ---------------------------------------

# what version 1 wrote for each decision a window is measured for
_LETTERS = {"K": Decision.KEEP, "C": Decision.RECOMPUTE, "O": Decision.OFFLOAD,
            "P": Decision.OFFLOAD_INPUT}


def test_a_version_1_tape_loads_with_its_letters_read_as_decisions() -> None:
    """Every window of a version-1 file ("KC": kept before, checkpointed here; O and P
    offloaded and input-offloaded) is under the decisions its letters name, with the
    figures the file holds; written again, it is version 2 with decisions by name."""
    raw = json.loads(V1_TAPE.read_text())
    assert raw["schema_version"] == 1
    tape = Tape.from_json(V1_TAPE)
    assert tape.schema_version == 2 and tape.offload
    assert tape.window_decisions == tuple(_LETTERS.values())
    for block, raw_block in zip(tape.blocks, raw["blocks"], strict=True):
        for key in ("fwd", "bwd"):
            windows = getattr(block, key)
            assert len(windows) == len(raw_block[key]) > 0
            for letters, window in raw_block[key].items():
                pair = (_LETTERS[letters[0]], _LETTERS[letters[1]])
                assert dataclasses.asdict(windows[pair]) == window
        assert block.fwd_end_release == {(_LETTERS[k[0]], _LETTERS[k[1]]): v
                                         for k, v in raw_block["fwd_end_release"].items()}
    for key in ("post", "tail"):
        assert {d: w.peak_bytes for d, w in getattr(tape, key).items()} == {
            _LETTERS[k]: w["peak_bytes"] for k, w in raw[key].items()}
    data = json.loads(tape.to_json())
    assert data["schema_version"] == 2
    assert sorted(data["post"]) == ["keep", "offload", "offload_input", "recompute"]
    assert "recompute>offload" in data["blocks"][1]["fwd"]
    assert all(len(k.split(">")) == 2 for b in data["blocks"] for k in b["fwd"])
    assert Tape.from_json(tape.to_json()) == tape


@pytest.mark.parametrize(("version", "key", "message"), [
    (1, "KX", "'X' names no decision a window is measured for (schema version 1 writes "
              "['K', 'C', 'O', 'P'])"),
    (1, "KCK", "window key 'KCK' is not the previous block's decision and this block's, "
               "as 'KC'"),
    (2, "keep>maybe", "'maybe' names no decision a window is measured for (schema version 2 "
                      "writes ['keep', 'recompute', 'offload', 'offload_input'])"),
    (2, "KK", "window key 'KK' is not the previous block's decision and this block's, as "
              "'keep>recompute'"),
    (2, "keep>selective", "'selective' names no decision a window is measured for"),
])
def test_a_window_key_that_names_no_decisions_is_refused(tiny_tape: Tape, version: int,
                                                          key: str, message: str) -> None:
    data = _data(tiny_tape) if version == 2 else json.loads(V1_TAPE.read_text())
    windows = data["blocks"][1]["fwd"]
    windows[key] = next(iter(windows.values()))
    with pytest.raises(SchemaError) as info:
        _load(data)
    assert "tape.blocks[1].fwd" in str(info.value) and message in str(info.value)
