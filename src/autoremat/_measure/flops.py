"""FLOP counting that also covers the CPU attention kernels.

NOTE [ CPU attention FLOPs ]
    ``torch.utils.flop_counter`` has formulas for the CUDA attention kernels but not for
    ``_scaled_dot_product_flash_attention_for_cpu`` and its backward, and counts them as
    0 without a word. We count with a private copy of PyTorch's registry plus formulas
    for those two, so nothing global is changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
from torch.utils import flop_counter as _fc
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FlopCounter", "flop_formulas"]

aten = torch.ops.aten
_RNG_HOPS = (run_with_rng_state, run_and_save_rng_state)  # NOTE [ Random ops in a ... ]


def _cpu_flash_fwd(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return int(_fc.sdpa_flop_count(query.shape, key.shape, value.shape))


def _cpu_flash_bwd(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any
) -> int:
    return int(_fc.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape))


def flop_formulas() -> dict[Any, Callable[..., int]]:
    """PyTorch's FLOP formulas (keyed by op packet) plus the CPU attention kernels."""
    formulas: dict[Any, Callable[..., int]] = {}
    for packet, formula in _fc.flop_registry.items():
        formulas[packet] = formula
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_fwd),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_bwd),
    ):
        packet = getattr(aten, name, None)
        if packet is not None and packet not in formulas:
            formulas[packet] = _raw(formula)
    return formulas


def _raw(formula: Callable[..., int]) -> Callable[..., int]:
    def counted(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return formula(*args, **kwargs)

    return counted


class FlopCounter(TorchDispatchMode):
    """Counts FLOPs of every op, attributed to a label the caller sets (e.g. a block).

    Attributes:
        by_label: ``{(label, phase): flops}`` where phase is ``"fwd"`` or ``"bwd"``
            (ops run by autograd's engine, including recomputation).
        total: all FLOPs counted.
    """

    # NOTE [ Random ops in a compiled backward ]
    #     A compiled backward that recomputes a checkpointed region replays its random
    #     ops through the higher-order ops run_with_rng_state / run_and_save_rng_state
    #     (AOT Autograd's functionalized RNG). They reach a dispatch mode only when it says
    #     it supports higher-order ops; they wrap one random op (dropout's mask, rand),
    #     which has no FLOPs, so they run uncounted. Any other higher-order op could hide
    #     counted work and still fails loudly (NotImplemented).
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self._formulas = flop_formulas()
        self.label = "<outside>"
        self.by_label: dict[tuple[str, str], int] = {}
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            if func not in _RNG_HOPS:
                return NotImplemented
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        formula = self._formulas.get(func._overloadpacket)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
            phase = "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"
            key = (self.label, phase)
            self.by_label[key] = self.by_label.get(key, 0) + flops
            self.total += flops
        return out

    def phase_total(self, phase: str) -> int:
        """FLOPs of one phase (``"fwd"`` or ``"bwd"``) over all labels."""
        return sum(v for (_, p), v in self.by_label.items() if p == phase)
