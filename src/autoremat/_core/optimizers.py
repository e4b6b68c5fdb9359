"""Optimizer memory, measured with the real ``torch.optim`` class on ``meta`` parameters.

:func:`optimizer_memory` gives the state an optimizer keeps and the temporaries of its
steady-state ``step()``, for the names in :data:`OPTIMIZERS` (or a size given in bytes).
See NOTE [ Total peak ] in ``estimate.py`` for where both enter an iteration's peak.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoremat._core.errors import RematError, did_you_mean
from autoremat._core.memory import track_memory
from autoremat._core.step import unique_storage_bytes
from autoremat._core.units import parse_size

__all__ = [
    "OPTIMIZERS",
    "optimizer_memory",
]

# name -> (optimizer class name in torch.optim, extra constructor arguments)
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw": ("AdamW", {}),  # exp_avg and exp_avg_sq: 2x the trainable parameters
    "adam": ("Adam", {}),  # the same two states
    "sgd": ("SGD", {}),  # no state
    "sgd-momentum": ("SGD", {"momentum": 0.9}),  # one momentum buffer: 1x
    "rmsprop": ("RMSprop", {}),  # square_avg: 1x
    "adagrad": ("Adagrad", {}),  # sum: 1x
}  # (Adafactor reads parameter norms with .item() in step(), which meta cannot answer)


def _optimizer_class(optimizer: str | int | None) -> tuple[type[torch.optim.Optimizer] | None,
                                                         dict[str, Any]]:
    """Validate ``optimizer``; the ``torch.optim`` class and extra arguments for a name."""
    if optimizer is None or (isinstance(optimizer, int) and not isinstance(optimizer, bool)):
        return None, {}
    if not isinstance(optimizer, str):
        raise RematError(f"optimizer must be a name ({', '.join(OPTIMIZERS)}) or a number of "
                         f"bytes, got {optimizer!r}")
    key = optimizer.strip().lower()
    if key not in OPTIMIZERS:
        raise RematError(f"unknown optimizer {optimizer!r}.{did_you_mean(key, OPTIMIZERS)} "
                         f"Known: {', '.join(OPTIMIZERS)}; or give the state size in bytes")
    class_name, extra = OPTIMIZERS[key]
    cls = getattr(torch.optim, class_name, None)
    if cls is None:
        raise RematError(f"optimizer {optimizer!r} needs torch.optim.{class_name}, which this "
                         f"PyTorch ({torch.__version__}) lacks; give the state size in bytes")
    return cls, extra


def optimizer_memory(model: nn.Module, optimizer: str | int | None,
                     device: str | torch.device = "cuda") -> tuple[int, int]:
    """(state bytes, temporaries of a steady-state ``step()``) of ``optimizer`` for the
    trainable parameters of ``model`` (on ``meta``), measured with the real ``torch.optim``
    class: two steps, the second under :func:`autoremat.track_memory`. On ``"cuda"`` the
    optimizer runs its ``foreach`` implementation, as PyTorch does there by default.

    Example:
        >>> optimizer_memory(nn.Linear(4, 4, device="meta"), "adamw")
        (160, 80)
    """
    cls, extra = _optimizer_class(optimizer)
    if cls is None:
        return (0 if optimizer is None else parse_size(optimizer, what="optimizer state")), 0
    device_type = torch.device(device).type
    params = [p for p in model.parameters() if p.requires_grad]
    if not all(p.is_meta for p in params):
        raise RematError("optimizer_memory() runs on meta parameters; convert with to_meta()")
    grads = [p.grad for p in params]
    kwargs = {"lr": 1e-3, "foreach": device_type == "cuda", **extra}
    try:
        for p in params:
            p.grad = torch.empty_like(p)
        opt = cls(params, **kwargs)
        opt.step()  # the first step creates the state
        # scalar "step" counters stay on the CPU unless the target is the CPU
        on_device = [t for state in opt.state.values() for t in state.values()
                     if isinstance(t, torch.Tensor) and (t.is_meta or device_type == "cpu")]
        state_bytes = unique_storage_bytes(on_device)
        with track_memory() as mem:
            opt.step()
        return state_bytes, mem.peak_bytes
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
