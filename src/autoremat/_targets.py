"""What the command line (and bench, and doctor) runs: a TARGET and its ``key=value`` options.

A TARGET is a zoo name (``gpt2``, ``llama``, ...) or ``package.module:factory``, where
``factory(**options)`` returns ``(model, inputs)``. Options come as
``"n_layer=2,dropout=0.0,bias=false"``. One copy of both rules, used by every command.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from autoremat import zoo
from autoremat._core.errors import RematError, did_you_mean

__all__ = ["load_target", "parse_options"]


def parse_options(text: str | None) -> dict[str, Any]:
    """``"num_hidden_layers=32,hidden_size=4096,tie_word_embeddings=false"`` -> a dict.

    Values become ``int``, ``float``, ``bool`` (``true``/``false``), ``None``
    (``none``/``null``) or stay strings; keys must be Python identifiers.

    Example:
        >>> parse_options("n_layer=2,dropout=0.0,bias=false,act=gelu,cap=none")
        {'n_layer': 2, 'dropout': 0.0, 'bias': False, 'act': 'gelu', 'cap': None}
    """
    out: dict[str, Any] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key.isidentifier():
            raise RematError(f"cannot read option {item.strip()!r}: write key=value pairs "
                             f"separated by commas, e.g. n_layer=12,batch_size=8")
        if key in out:
            raise RematError(f"option {key!r} is given twice ({out[key]!r} and {raw!r}); "
                             "give it once")
        out[key] = _value(raw)
    return out


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


def load_target(target: str, options: Mapping[str, Any] | None = None, *,
                device: str | torch.device | None = None,
                dtype: torch.dtype | None = None) -> tuple[nn.Module, Any]:
    """``(model, inputs)`` for a zoo name or a ``package.module:factory`` spec.

    Args:
        target: a zoo name or ``package.module:factory``.
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
        if target not in zoo.ZOO:
            raise RematError(f"unknown target {target!r}: use a zoo name "
                             f"({', '.join(zoo.names())}) or package.module:factory."
                             + did_you_mean(target, zoo.ZOO))
        placement: dict[str, Any] = {k: v for k, v in (("device", device), ("dtype", dtype))
                                     if v is not None}
        return zoo.build(target, **placement, **opts)
    if dtype is not None:
        raise RematError(f"dtype= applies to zoo models only; make the factory of {target!r} "
                         "take a dtype option and pass it with the options instead")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RematError(f"cannot import {module_name!r} for target {target!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        public = [n for n in dir(module) if not n.startswith("_")]
        raise RematError(f"{module_name!r} has no callable {attr!r}." + did_you_mean(attr, public))
    if device is None:
        result = factory(**opts)
    else:
        with torch.device(device):
            result = factory(**opts)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise RematError(f"{target} must return (model, inputs), got {type(result).__name__}")
    return result
