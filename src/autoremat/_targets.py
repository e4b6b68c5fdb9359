"""What the command line (and bench, and doctor) runs: a TARGET and its ``key=value`` options.

A TARGET is a zoo name (``gpt2``, ``llama``, ...), ``module:factory`` or
``path/to/file.py:factory``, where ``factory(**options)`` returns ``(model, inputs)``
(:data:`TARGET_HELP` says it for the command line). Options come as
``"n_layer=2,dropout=0.0,bias=false,widths=64,128"``. One copy of both rules, used by
every command.

NOTE [ Importing a factory from the current folder ]
    ``autoremat plan mymodel:make``, run from the folder that holds ``mymodel.py``,
    must find it, as ``python -m mymodel`` would: the console script's ``sys.path[0]``
    is the folder of the ``autoremat`` executable, not the current one. The current
    folder (or, for ``path/to/file.py:factory``, the file's folder, as ``python
    path/to/file.py`` would) goes first on ``sys.path`` while the module is imported
    and the factory runs (it may import its neighbours lazily), and is taken off again
    after, also when either raises. The module stays in ``sys.modules``: the model's
    classes live there, and pickling or ``dataclasses`` look them up by module name.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from autoremat import zoo
from autoremat._core.errors import RematError, did_you_mean

__all__ = ["TARGET_HELP", "check_not_negative", "load_target", "parse_options"]

TARGET_HELP = (
    "TARGET is a zoo model (" + ", ".join(zoo.names()) + ") or a factory of your own: "
    "module:function (imported from the current folder, as python -m would) or "
    "path/to/file.py:function. The function returns (model, inputs), where inputs is a "
    "tensor, a tuple of positional arguments or a dict of keyword arguments of "
    "model(...), and the model's output has a .loss or a floating tensor whose sum is the "
    "loss. Each --set key=value reaches it as a keyword argument (e.g. --set "
    "batch_size=8,widths=64,128; a list of numbers becomes a tuple)."
)

# NOTE [ Negative sizes ]
# ``batch_size=-1`` would otherwise reach ``torch.randn`` deep in a factory (or a
# Transformers config) and end in a traceback. An option named like a size or a count
# (``*size``, ``*_len``, ``*layers``, ``*heads``, ``*width``, ``*dim``, ``n_*``,
# ``num_*``) is refused when negative, for any target; every number a zoo model takes
# (sizes, counts, rates) is >= 0, so there any negative number is. A factory's options
# named otherwise (``offset=-3``) reach it as given: only the factory knows them.
_SIZE_SUFFIXES = ("size", "_len", "length", "layers", "layer", "heads", "head", "width",
                  "widths", "dim", "dims")
_SIZE_PREFIXES = ("n_", "num_")


def parse_blocks(text: str | None) -> list[str] | None:
    """``--blocks``: ``"encoder.layer.0,encoder.layer.1"`` -> the module names, in the
    order the model runs them (``None``: none given, the chain is found).

        >>> parse_blocks("layers.0, layers.1"), parse_blocks(None)
        (['layers.0', 'layers.1'], None)
    """
    if text is None:
        return None
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise RematError(f"--blocks takes module names separated by commas, in the order "
                         f"the model runs them (e.g. --blocks layers.0,layers.1), got {text!r}")
    return names


def parse_options(text: str | None) -> dict[str, Any]:
    """``"num_hidden_layers=32,hidden_size=4096,tie_word_embeddings=false"`` -> a dict.

    Values become ``int``, ``float``, ``bool`` (``true``/``false``), ``None``
    (``none``/``null``) or stay strings; keys must be Python identifiers. A value
    followed by bare numbers (``widths=64,128``) or written in brackets
    (``widths=(64,128)``, ``widths=[64]``) is a tuple.

    Example:
        >>> parse_options("n_layer=2,dropout=0.0,bias=false,act=gelu,cap=none")
        {'n_layer': 2, 'dropout': 0.0, 'bias': False, 'act': 'gelu', 'cap': None}
        >>> parse_options("widths=64,128,batch_size=8,kernel=(3,)")
        {'widths': (64, 128), 'batch_size': 8, 'kernel': (3,)}
    """
    out: dict[str, Any] = {}
    last: str | None = None  # the key a bare number continues
    for item in _split_top_level(text or ""):
        if not item.strip():
            continue
        key, sep, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep and last is not None and _is_number(item.strip()):
            previous = out[last]
            out[last] = (*(previous if isinstance(previous, tuple) else (previous,)),
                         _value(item.strip()))
            continue
        if not sep or not key.isidentifier():
            raise RematError(f"cannot read option {item.strip()!r}: write key=value pairs "
                             f"separated by commas, e.g. n_layer=12,batch_size=8 (a tuple: "
                             f"widths=64,128)")
        if key in out:
            raise RematError(f"option {key!r} is given twice ({out[key]!r} and {raw!r}); "
                             "give it once")
        if raw and raw[0] in "([" and raw[-1] in ")]":
            out[key] = tuple(_value(v.strip()) for v in raw[1:-1].split(",") if v.strip())
            last = None
        else:
            out[key] = _value(raw)
            last = key if _is_number(raw) else None
    return out


def _split_top_level(text: str) -> list[str]:
    """Split at the commas outside brackets: ``"a=(1,2),b=3"`` -> ``["a=(1,2)", "b=3"]``."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(char, 0)
        if char == "," and depth <= 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def _is_number(raw: str) -> bool:
    return isinstance(_value(raw), (int, float)) and not isinstance(_value(raw), bool)


def _value(raw: str) -> Any:
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


def check_not_negative(options: Mapping[str, Any], *, every_number: bool = False) -> None:
    """Refuse a negative size or count among ``options`` (NOTE [ Negative sizes ]);
    ``every_number``: refuse any negative number (a zoo model's options)."""
    for key, value in options.items():
        values = value if isinstance(value, tuple) else (value,)
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        sized = every_number or key.endswith(_SIZE_SUFFIXES) or key.startswith(_SIZE_PREFIXES)
        if sized and any(v < 0 for v in numbers):
            what = "a zoo model's options are sizes, counts and rates" if every_number else \
                f"{key!r} names a size or a count"
            raise RematError(f"option {key}={value!r} is negative, and {what}: give a number "
                             f">= 0 (sizes such as batch_size >= 1)")


@contextmanager
def _first_on_path(target: str) -> Iterator[None]:
    """The folder a ``module:factory`` or ``file.py:factory`` target imports from (the
    file's, else the current one) first on ``sys.path`` inside the block, as it was
    after (NOTE [ Importing a factory from the current folder ])."""
    spec = target.rpartition(":")[0]  # rpartition: a Windows path has a colon
    folder = str(Path(spec).resolve().parent) if spec.endswith(".py") else os.getcwd()
    if folder in sys.path or (folder == os.getcwd() and "" in sys.path):
        yield
        return
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        if folder in sys.path:
            sys.path.remove(folder)


def _import(spec: str, target: str) -> ModuleType:
    """The module of ``module`` or ``path/to/file.py``; call under :func:`_first_on_path`."""
    if not spec.endswith(".py"):
        try:
            return importlib.import_module(spec)
        except ImportError as exc:
            raise RematError(f"cannot import {spec!r} for target {target!r} (looked in the "
                             f"current folder {os.getcwd()} and the installed packages): "
                             f"{exc}") from exc
        except Exception as exc:
            raise _raised_in_user_code(exc, f"importing {spec!r} for target {target!r}",
                                       "fix the module") from exc
    path = Path(spec).resolve()
    if not path.is_file():
        raise RematError(f"no file {spec!r} for target {target!r} (from {os.getcwd()}); give "
                         "the path of the .py file that defines the factory")
    name = path.stem if path.stem.isidentifier() else "_autoremat_target"
    if name in sys.modules:
        if getattr(sys.modules[name], "__file__", None) == str(path):
            return sys.modules[name]
        name = f"_autoremat_target_{name}"  # never replace another module of that name
    loader = importlib.util.spec_from_file_location(name, path)
    if loader is None or loader.loader is None:
        raise RematError(f"cannot load {spec!r} for target {target!r} as a Python module")
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module  # dataclasses and pickle look classes up by module name
    try:
        loader.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise _raised_in_user_code(exc, f"importing {spec!r} for target {target!r}",
                                   "fix the file") from exc
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _raised_in_user_code(exc: Exception, doing: str, fix: str) -> RematError:
    """A user's module or factory raised: one line that says where (the CLI shows no
    traceback for a user's mistake; the original stays as ``__cause__``)."""
    where = ""
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f" at {exc.filename}:{exc.lineno}"
    else:
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            where = f" at {frames[-1].filename}:{frames[-1].lineno}"
    return RematError(f"{doing} raised {type(exc).__name__}: {exc}{where}; {fix} and run "
                      "again")


def _check_signature(factory: Callable[..., Any], target: str, opts: Mapping[str, Any]) -> None:
    """Refuse options the factory does not take, naming the ones it does, before calling it."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or a C callable: nothing to read
        return
    try:
        signature.bind(**opts)
    except TypeError as exc:
        params = ", ".join(str(p) for p in signature.parameters.values()) or "no parameters"
        given = ", ".join(opts) or "no options"
        raise RematError(f"{target} cannot be called with {given} ({exc}); its parameters "
                         f"are ({params}): pass those with --set key=value") from None


def _factory(target: str) -> Callable[..., Any]:
    """The factory ``module:factory`` (or ``file.py:factory``) names, its module imported
    (the caller puts its folder first on ``sys.path``)."""
    spec, _, attr = target.rpartition(":")
    module = _import(spec, target)
    factory = getattr(module, attr, None)
    if not callable(factory):
        public = [n for n in dir(module) if not n.startswith("_")
                  and callable(getattr(module, n, None))]
        what = "" if factory is None else \
            f" ({attr!r} is of type {type(factory).__name__}, not a function)"
        raise RematError(f"{spec!r} has no callable {attr!r}{what}."
                         + did_you_mean(attr, public))
    return factory  # type: ignore[no-any-return]


def check_target(target: str) -> None:
    """Raise a :class:`RematError` where ``target`` names no zoo model and no factory
    (a command checks its targets before it writes anything; nothing is built)."""
    if ":" not in target:
        if target not in zoo.ZOO:
            raise RematError(f"unknown target {target!r}: use a zoo name "
                             f"({', '.join(zoo.names())}), module:factory or "
                             f"path/to/file.py:factory." + did_you_mean(target, zoo.ZOO))
        return
    with _first_on_path(target):
        _factory(target)


def load_target(target: str, options: Mapping[str, Any] | None = None, *,
                device: str | torch.device | None = None,
                dtype: torch.dtype | None = None) -> tuple[nn.Module, Any]:
    """``(model, inputs)`` for a zoo name, ``module:factory`` or ``file.py:factory``.

    Args:
        target: a zoo name, ``package.module:factory`` (imported with the current folder
            first on ``sys.path``) or ``path/to/file.py:factory``.
        options: keyword arguments of the zoo model or the factory.
        device: build there (a zoo model directly; a factory under ``torch.device``,
            which places the tensors it creates without a device of their own).
        dtype: floating dtype of a zoo model and its inputs.

    Example:
        >>> model, inputs = load_target("gpt2", {"n_layer": 2, "seq_len": 16})
        >>> type(model).__name__, len(model.blocks), tuple(inputs["idx"].shape)
        ('GPT', 2, (4, 16))
    """
    opts = dict(options or {})
    if ":" not in target:
        check_target(target)
        check_not_negative(opts, every_number=True)
        placement: dict[str, Any] = {k: v for k, v in (("device", device), ("dtype", dtype))
                                     if v is not None}
        return zoo.build(target, **placement, **opts)
    if dtype is not None:
        raise RematError(f"dtype= applies to zoo models only; make the factory of {target!r} "
                         "take a dtype option and pass it with the options instead")
    check_not_negative(opts)
    with _first_on_path(target):
        factory = _factory(target)
        _check_signature(factory, target, opts)
        try:
            if device is None:
                result = factory(**opts)
            else:
                with torch.device(device):
                    result = factory(**opts)
        except Exception as exc:
            given = ", ".join(f"{k}={v!r}" for k, v in opts.items())
            raise _raised_in_user_code(exc, f"{target}({given})",
                                       "fix the factory or its --set options") from exc
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        got = type(result).__name__ if not isinstance(result, tuple) else (
            f"a tuple of {len(result)}" if len(result) != 2 else
            f"a tuple whose first item is a {type(result[0]).__name__}, not an nn.Module")
        raise RematError(f"{target} must return (model, inputs): an nn.Module and the batch "
                         f"it is called on, got {got}")
    return result
