"""The registry of zoo models and :func:`build`, the one way to make one."""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from autoremat._core.errors import RematError, did_you_mean
from autoremat.zoo._gpt2 import build_gpt2
from autoremat.zoo._llama import build_llama
from autoremat.zoo._mlp import build_mlp
from autoremat.zoo._resnet import build_resnet


@dataclass(frozen=True)
class ZooEntry:
    """A named model: ``build(**size_overrides)`` returns ``(model, inputs)`` on the current
    default device in float32, without seeding; prefer the module-level :func:`build`."""

    name: str
    description: str
    build: Callable[..., tuple[nn.Module, Any]]


_ENTRIES = (
    ZooEntry("gpt2", "GPT-2-style decoder (nanoGPT-like), pre-LN model.blocks", build_gpt2),
    ZooEntry("llama", "Llama-style decoder (RMSNorm, RoPE, SwiGLU), model.layers", build_llama),
    ZooEntry("mlp", "deep MLP of uneven-width Linear blocks in model.blocks", build_mlp),
    ZooEntry("resnet", "small BatchNorm ResNet for 32x32 images, model.stages", build_resnet),
)
ZOO: Mapping[str, ZooEntry] = types.MappingProxyType({e.name: e for e in _ENTRIES})


def names() -> list[str]:
    """The names of the built-in models, e.g. ``['gpt2', 'llama', 'mlp', 'resnet']``."""
    return list(ZOO)


def build(
    name: str,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> tuple[nn.Module, Any]:
    """Build a zoo model in train mode and a sample batch for it.

    Args:
        name: one of :func:`names`.
        seed: passed to ``torch.manual_seed`` before anything is created, so two calls with
            the same arguments give identical weights and data.
        device: where model and inputs live; ``"meta"`` allocates no memory at all.
        dtype: floating-point dtype of parameters, buffers and float inputs. Integer inputs
            (token ids, labels) stay ``torch.long``.
        **overrides: fields of the model's config (e.g. ``n_layer=12``) and batch options:
            ``batch_size`` for all, ``seq_len`` for gpt2/llama, ``image_size`` for resnet.

    Returns:
        ``(model, inputs)``: call ``model(*inputs)`` when ``inputs`` is a tuple and
        ``model(**inputs)`` when it is a dict. The output is an :class:`LMOutput` whose
        ``loss`` is set, since the sample batch includes targets.

    Raises:
        RematError: unknown name or option, or inconsistent sizes.

    Example:
        >>> model, (x, y) = build("mlp", widths=(64, 32), batch_size=8)
        >>> model(x, y).logits.shape
        torch.Size([8, 10])

    Known limitations:
        ``build`` calls ``torch.manual_seed(seed)`` and does not restore the global RNG, so
        the first training step after it (dropout masks) is reproducible too. On ``meta``
        the init functions do nothing; a meta model moved with ``to_empty`` needs its
        weights (and llama's rotary tables) recomputed.
    """
    if name not in ZOO:
        raise RematError(
            f"unknown zoo model {name!r}.{did_you_mean(name, ZOO)} Available: {', '.join(names())}"
        )
    torch.manual_seed(seed)
    with torch.device(device):
        model, inputs = ZOO[name].build(**overrides)
    model.to(dtype=dtype)  # casts floating-point parameters and buffers only
    model.train()
    return model, _cast_floats(inputs, dtype)


def _cast_floats(inputs: Any, dtype: torch.dtype) -> Any:
    """Cast the floating-point tensors of a tuple or dict of inputs to ``dtype``."""

    def cast(value: Any) -> Any:
        if isinstance(value, Tensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    if isinstance(inputs, dict):
        return {key: cast(value) for key, value in inputs.items()}
    return tuple(cast(value) for value in inputs)
