"""One training step of a user's model: call it, take the loss, run backward.

Shared by profile, verify, estimate and bench so every figure comes from the same step.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .errors import RematError

__all__ = [
    "call_model",
    "default_loss",
    "describe_inputs",
    "flat_tensors",
    "preserved_state",
    "run_step",
    "training_config",
    "unique_storage_bytes",
]

LossFn = Callable[[Any], torch.Tensor]


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(x)``, ``model(*args)`` or ``model(**kwargs)`` by the type of ``inputs``."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def flat_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in a nested structure, in order; dataclass outputs are opened too."""
    if hasattr(obj, "__dataclass_fields__"):
        obj = list(vars(obj).values())
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` when present (and not None), else the sum of the first floating
    tensor in the output."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    for item in flat_tensors(output):
        if item.is_floating_point():
            return item.sum()
    raise RematError(f"cannot find a loss in the model output of type {type(output).__name__}: "
                     f"pass loss_fn=lambda out: ... returning a scalar tensor")


def run_step(model: nn.Module, inputs: Any, loss_fn: LossFn | None,
             between: Callable[[], None] | None = None) -> torch.Tensor:
    """Forward, loss, backward. ``between`` runs after the loss and before backward."""
    output = call_model(model, inputs)
    loss = (loss_fn or default_loss)(output)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise RematError(f"loss_fn must return a scalar tensor, got "
                         f"{type(loss).__name__} {getattr(loss, 'shape', '')}")
    if not loss.requires_grad:
        raise RematError("the loss does not require grad: no parameter of the model is "
                         "trainable, or the output was detached")
    del output
    if between is not None:
        between()
    loss.backward()
    return loss.detach()


def describe_inputs(inputs: Any) -> str:
    """``"idx: (4, 128) int64, targets: (4, 128) int64"``-style signature of the inputs."""
    def one(t: Any) -> str:
        if isinstance(t, torch.Tensor):
            return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        return type(t).__name__
    if isinstance(inputs, dict):
        return ", ".join(f"{k}: {one(v)}" for k, v in inputs.items())
    if isinstance(inputs, (tuple, list)):
        return ", ".join(one(v) for v in inputs)
    return one(inputs)


def unique_storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages among the tensors in a (nested) structure."""
    seen: dict[int, int] = {}
    for t in tree_flatten(tensors)[0]:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


@contextmanager
def training_config(model: nn.Module) -> Iterator[list[str]]:
    """Turn off a Hugging Face KV cache while training (restored on exit).

    With ``config.use_cache`` on, every layer appends to the cache in forward, and a
    recompute appends again: wrong memory and a broken recompute. Hugging Face turns it
    off when gradient checkpointing is enabled; we do the same, and say so.
    """
    config = getattr(model, "config", None)
    notes: list[str] = []
    if model.training and getattr(config, "use_cache", False):
        config.use_cache = False  # type: ignore[union-attr]
        notes.append("config.use_cache was turned off while training (a KV cache is "
                     "useless in training and breaks recomputation)")
        try:
            yield notes
        finally:
            config.use_cache = True  # type: ignore[union-attr]
        return
    yield notes


@contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Run measurement steps without leaving a trace on the model or the RNGs.

    Saves and restores: buffers (BatchNorm statistics), parameters' ``.grad``, the
    Python, CPU and CUDA random states. Gradients are ``None`` inside.
    """
    buffers = [(b, b.detach().clone()) for b in model.buffers() if b.device.type != "meta"]
    grads = [(p, p.grad) for p in model.parameters()]
    py_state = random.getstate()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else []):
        try:
            for p, _ in grads:
                p.grad = None
            yield
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            for p, g in grads:
                p.grad = g
            random.setstate(py_state)
