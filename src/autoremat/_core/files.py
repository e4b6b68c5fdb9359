"""JSON and file helpers every stage shares.

The schema version of the files autoremat writes, JSON written atomically
(``os.replace``), a path checked writable before the work that fills it, and
loading that builds frozen dataclasses and names the field that is wrong. The
Tape and Plan files are built on them (``_measure/tape.py``,
``_plan/plan.py``).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from autoremat._core.errors import RematError, SchemaError
from autoremat._core.step import LOOPS

__all__ = [
    "SCHEMA_VERSION", "build_dataclass", "check_loop_field", "check_writable", "dump_json",
    "int_tuples", "load_json", "write_atomic",
]


# 2: decisions written by name (window keys "keep>recompute", post and tail by
# decision); 1: by letter ("KC", K/C/O/P), still read (NOTE [ Decisions in files ])
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)


def dump_json(data: dict[str, Any], path: str | os.PathLike[str] | None = None) -> str:
    """JSON text of a report (sorted keys); with ``path``, also written atomically."""
    text = json.dumps(data, indent=1, sort_keys=True)
    if path is not None:
        try:
            write_atomic(Path(path), text)
        except OSError as exc:
            raise RematError(f"cannot write to {str(path)!r}: {exc.strerror or exc}; choose "
                             "another path") from exc
    return text


def check_writable(path: str | os.PathLike[str], *, directory: bool = False) -> Path:
    """Make sure ``path`` (a file, or with ``directory`` a folder) can be written, creating
    the folders it needs; :class:`~autoremat.RematError` otherwise. Commands call it
    before their work, so that a bad ``--out`` does not cost a whole profile."""
    path = Path(path)
    folder = path if directory else path.parent
    if not directory and path.is_dir():
        raise RematError(f"cannot write to {str(path)!r}: it is a directory; give a file name")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RematError(f"cannot write to {str(path)!r}: creating {str(folder)!r} failed "
                         f"({exc.strerror}); choose another path") from exc
    if not os.access(folder, os.W_OK | os.X_OK):
        raise RematError(f"cannot write to {str(path)!r}: {str(folder)!r} is not writable; "
                         f"choose another path")
    return path


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; a report is for everyone to read
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_json(text_or_path: str | os.PathLike[str], *, what: str) -> dict[str, Any]:
    if isinstance(text_or_path, (bytes, bytearray)):
        text_or_path = text_or_path.decode("utf-8", errors="replace")
    if not isinstance(text_or_path, (str, os.PathLike)):
        raise SchemaError(f"a {what} loads from JSON text or a file path, got "
                          f"{type(text_or_path).__name__}"
                          + (" (for a dict: json.dumps(it) first)"
                             if isinstance(text_or_path, dict) else ""))
    text = str(text_or_path)
    if not text.strip():
        raise SchemaError(f"the {what} JSON text is empty (nor is it a file name): pass the "
                          f"text {what}.to_json() returned, or the path of a file it wrote")
    if not text.lstrip().startswith(("{", "[")):
        try:
            text = Path(text).read_text()
        except OSError as exc:
            raise SchemaError(f"cannot read {what} file {str(text_or_path)!r}: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SchemaError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise SchemaError(f"{what} JSON must be an object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        older = ", ".join(map(str, READABLE_VERSIONS[:-1]))
        raise SchemaError(f"{what} has schema_version {version!r}; this autoremat reads "
                          f"version {SCHEMA_VERSION} (and the earlier {older}). Re-create "
                          f"it with this version.")
    return data


def build_dataclass(cls: type, data: Any, where: str) -> Any:
    """Build a flat dataclass from a dict, naming the field that is missing or wrong."""
    if not isinstance(data, dict):
        raise SchemaError(f"{where} must be an object, got {type(data).__name__}")
    kwargs = {}
    for f in fields(cls):
        if f.name not in data:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue
            raise SchemaError(f"{where}: missing field {f.name!r}")
        kwargs[f.name] = data[f.name]
    unknown = set(data) - {f.name for f in fields(cls)}
    if unknown:
        raise SchemaError(f"{where}: unknown field(s) {sorted(unknown)}")
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise SchemaError(f"{where}: {exc}") from exc


_TYPES: dict[str, type | tuple[type, ...]] = {
    "int": int, "float": (int, float), "str": str, "bool": bool}


def _check_types(obj: Any, where: str) -> None:
    for f in fields(obj):
        value = getattr(obj, f.name)
        if str(f.type) == "dict[str, int]":
            if not isinstance(value, dict) or not all(
                    isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                    for k, v in value.items()):
                raise SchemaError(f"{where}.{f.name} must be an object of integers, "
                                  f"got {value!r}")
            continue
        expected = _TYPES.get(str(f.type))
        if expected is not None and (not isinstance(value, expected) or
                                     (expected is int and isinstance(value, bool))):
            raise SchemaError(f"{where}.{f.name} must be {f.type}, got {value!r}")


def int_tuples(data: Any, keys: tuple[str, ...], where: str) -> Any:
    """``data`` with its JSON lists of integers under ``keys`` as tuples."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for key in keys:
        if key in data:
            raw = data[key]
            if not isinstance(raw, list) or not all(
                    isinstance(i, int) and not isinstance(i, bool) for i in raw):
                raise SchemaError(f"{where}.{key} must be a list of integers, got {raw!r}")
            data[key] = tuple(raw)
    return data


def check_loop_field(value: Any, where: str) -> None:
    """A loaded ``loop`` must name one of :data:`~autoremat._core.step.LOOPS`."""
    if value not in LOOPS:
        raise SchemaError(f"{where} must be one of {list(LOOPS)}, got {value!r}")
