"""The optimizers autoremat knows by name, and their memory.

:data:`OPTIMIZERS` is the one table of them: the ``torch.optim`` class, the states it keeps
per parameter, whether it keeps a step counter per tensor and takes ``fused=True``.
:func:`resolve_optimizer` reads an ``optimizer=`` argument by it for every entry point
(``plan``, ``estimate``, ``doctor``), and :func:`optimizer_memory` measures state and the
temporaries of a steady-state ``step()`` with the real class on ``meta`` parameters.
See NOTE [ Total peak ] in ``estimate.py`` for where both enter an iteration's peak.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast

import torch
from torch import nn

from autoremat._core.errors import BudgetError, RematError, did_you_mean, whole
from autoremat._core.step import unique_storage_bytes
from autoremat._core.units import parse_size
from autoremat._measure.memory import track_memory

__all__ = [
    "OPTIMIZERS",
    "OptimizerSpec",
    "optimizer_memory",
    "resolve_optimizer",
    "takes_fused",
]


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer known by name: its ``torch.optim`` class and the memory it keeps.

    ``states`` and ``step_counter`` give the state from a tape alone (``plan``);
    ``tests/test_optimizers.py`` checks them against :func:`optimizer_memory`, which runs
    the class itself.
    """

    torch_class: str  # the class name in torch.optim
    states: int  # parameter-sized states per trainable parameter, in its dtype
    step_counter: bool  # keeps a scalar "step" tensor per parameter tensor
    fused: bool  # the class takes fused=True (an in-place update, no step temporaries)
    kwargs: Mapping[str, Any] = field(default_factory=dict)  # extra constructor arguments

    def state_bytes(self, trainable_bytes: int) -> int:
        """The parameter-sized states for ``trainable_bytes`` of trainable parameters."""
        return self.states * trainable_bytes

    def counter_bytes(self, tensors: int, device: str | torch.device) -> int:
        """The step counters of ``tensors`` trainable parameter tensors on ``device``:
        PyTorch keeps them on the CPU (unless ``capturable``), so they are on the device
        only when it is the CPU; a float32 scalar each (float64 under a float64 default)."""
        if not self.step_counter or torch.device(device).type != "cpu":
            return 0
        return tensors * (8 if torch.get_default_dtype() == torch.float64 else 4)


OPTIMIZERS: Mapping[str, OptimizerSpec] = MappingProxyType({
    "adamw": OptimizerSpec("AdamW", states=2, step_counter=True, fused=True),  # exp_avg(_sq)
    "adam": OptimizerSpec("Adam", states=2, step_counter=True, fused=True),  # the same two
    "sgd": OptimizerSpec("SGD", states=0, step_counter=False, fused=True),  # no state
    "sgd-momentum": OptimizerSpec("SGD", states=1, step_counter=False, fused=True,
                                  kwargs={"momentum": 0.9}),  # one momentum buffer
    "rmsprop": OptimizerSpec("RMSprop", states=1, step_counter=True, fused=False),  # square_avg
    # Adagrad's fused=True is CPU-only, so doctor does not offer it
    "adagrad": OptimizerSpec("Adagrad", states=1, step_counter=True, fused=False),  # sum
})  # (Adafactor reads parameter norms with .item() in step(), which meta cannot answer;
#     Lion is not in torch.optim: give its state in bytes, one state per parameter)


def resolve_optimizer(optimizer: str | int | None) -> OptimizerSpec | int | None:
    """An ``optimizer=`` argument, read one way for every entry point: ``None`` (no
    optimizer state; ``"none"`` too, as the command line takes it), the spec of a name in
    :data:`OPTIMIZERS` (any case), or the state size in bytes (an int or a size string
    such as ``"12GiB"``).

    Raises:
        BudgetError: an unknown name (with the closest known one), or another type.

    Example:
        >>> resolve_optimizer("AdamW").torch_class, resolve_optimizer("1KiB")
        ('AdamW', 1024)
    """
    known = ", ".join(OPTIMIZERS)
    if optimizer is None:
        return None
    if whole(optimizer) is None and not isinstance(optimizer, str):
        raise BudgetError(f"optimizer must be a name ({known}) or a number of bytes, got "
                          f"{optimizer!r}")
    if not isinstance(optimizer, str):  # numpy's integers too
        return parse_size(cast(int, whole(optimizer)), what="optimizer state")
    key = optimizer.strip().lower()
    if key in OPTIMIZERS:
        return OPTIMIZERS[key]
    if key == "none":  # as the command line's --optimizer none
        return None
    try:
        return parse_size(optimizer, what="optimizer state")
    except BudgetError:
        pass
    raise BudgetError(f"unknown optimizer {optimizer!r}.{did_you_mean(key, OPTIMIZERS)} "
                      f"Known: {known}; or give the state size in bytes")


def takes_fused(optimizer: str | int | None) -> bool:
    """Whether ``optimizer`` names a known optimizer whose class takes ``fused=True``."""
    spec = OPTIMIZERS.get(optimizer.strip().lower()) if isinstance(optimizer, str) else None
    return spec is not None and spec.fused


def _optimizer_class(optimizer: str | int | None) -> tuple[type[torch.optim.Optimizer] | None,
                                                         dict[str, Any]]:
    """Validate ``optimizer``; the ``torch.optim`` class and extra arguments for a name."""
    spec = resolve_optimizer(optimizer)
    if not isinstance(spec, OptimizerSpec):
        return None, {}
    cls = getattr(torch.optim, spec.torch_class, None)
    if cls is None:
        raise RematError(f"optimizer {optimizer!r} needs torch.optim.{spec.torch_class}, which "
                         f"this PyTorch ({torch.__version__}) lacks; give the state size in bytes")
    return cls, dict(spec.kwargs)


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
        given = resolve_optimizer(optimizer)
        return (given if isinstance(given, int) else 0), 0
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
