"""What the zoo models share: their output, their loss, their init, and their options."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.nn.functional as F
from torch import Tensor, nn

from autoremat._core.errors import RematError, did_you_mean


@dataclass(frozen=True)
class LMOutput:
    """What every zoo model returns: the logits, and the mean cross-entropy loss or ``None``."""

    # (B, T, vocab_size) for the language models, (B, n_classes) otherwise; None when a
    # plan computes the loss head in chunks (the full logits are never built)
    logits: Tensor | None
    loss: Tensor | None  # scalar, or None when no targets were given


def cross_entropy(logits: Tensor, targets: Tensor | None) -> Tensor | None:
    if targets is None:
        return None
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def init_normal(module: nn.Module) -> None:
    """GPT-2 / Llama init: N(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


_Config = TypeVar("_Config")


def split_overrides(
    model: str, config_cls: type[_Config], data_defaults: dict[str, int], overrides: dict[str, Any]
) -> tuple[_Config, dict[str, int]]:
    """Split ``overrides`` into a config of ``config_cls`` and the batch options; reject typos."""
    config_fields = [f.name for f in dataclasses.fields(config_cls)]  # type: ignore[arg-type]
    valid = [*config_fields, *data_defaults]
    unknown = [key for key in overrides if key not in valid]
    if unknown:
        key = unknown[0]
        raise RematError(
            f"{model}: unknown option {key!r}.{did_you_mean(key, valid)} "
            f"Valid options: {', '.join(valid)}"
        )
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}  # type: ignore[arg-type]
    for key, value in overrides.items():
        default = defaults.get(key, data_defaults.get(key))
        # a count or size (layers, heads, widths, the batch): a model with none of it has
        # no block to plan over, or no tensor at all
        _check_option(model, key, value, default,
                      positive=key in data_defaults or (isinstance(default, int)
                                                        and not isinstance(default, bool)
                                                        and default >= 1))
    config = config_cls(**{k: v for k, v in overrides.items() if k in config_fields})
    data = {k: overrides.get(k, default) for k, default in data_defaults.items()}
    return config, data


def _check_option(model: str, key: str, value: Any, default: Any, *, positive: bool) -> None:
    """Refuse an option whose type differs from its default's (``batch_size='abc'``), or a
    count or size below 1 (``positive``: ``n_layer=0``), before anything is built."""
    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if isinstance(default, bool):
        ok, kind = isinstance(value, bool), "true or false"
    elif whole(default):
        ok, kind = whole(value) and (value >= 1 or not positive), \
            "a whole number >= 1" if positive else "a whole number"
    elif isinstance(default, float):
        ok, kind = whole(value) or isinstance(value, float), "a number"
    elif isinstance(default, tuple):
        ok, kind = isinstance(value, (tuple, list)) and all(
            whole(v) and v >= 1 for v in value), "a tuple of whole numbers >= 1"
    else:
        ok, kind = True, ""
    if not ok:
        raise RematError(f"{model}: option {key}={value!r} must be {kind} (default "
                         f"{default!r})")
