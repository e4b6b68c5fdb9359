"""Tests for autoremat.tape: the Tape's versioned JSON and its printed table."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import autoremat._measure.tape as tape_module
from autoremat import Tape
from autoremat._core.errors import RematError, SchemaError
from autoremat._measure.tape import SCHEMA_VERSION


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
        (_drop("blocks", 2, "fwd", "KK", "delta_bytes"), ["tape.blocks[2].fwd.KK", "delta_bytes"]),
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
        (_set(0.5, "blocks", 0, "bwd", "KK", "peak_bytes"), "tape.blocks[0].bwd.KK.peak_bytes"),
        (_set(7, "post"), "tape.post"),
        (_set("yes", "blocks", 0, "ops", 0, "random"), "tape.blocks[0].ops[0].random"),
        (_set({}, "blocks", 0, "ops"), "tape.blocks[0].ops"),
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
