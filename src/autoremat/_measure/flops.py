"""FLOP counting that also covers the CPU attention kernels.

NOTE [ Grouped-query attention FLOPs ]
    With grouped-query attention (``enable_gqa``; Llama, Mistral and Qwen configs with
    fewer key/value heads than query heads) the attention kernels take key and value
    with fewer heads. Before torch 2.13 ``sdpa_flop_count`` asserted equal heads and
    raised inside every profile of such a model (seen on an H200 with torch 2.11, HF
    Llama). Each query head attends over its group's keys, so the FLOPs are those of
    key and value broadcast to the query's heads: the formulas get those shapes
    (:func:`_broadcast_kv`), which is also what torch 2.13's own formula counts.

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
    return int(_fc.sdpa_flop_count(query, key, value))  # over shapes (_over_shapes)


def _cpu_flash_bwd(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any
) -> int:
    return int(_fc.sdpa_backward_flop_count(grad_out, query, key, value))


# attention ops: (position of the query among the arguments, the heads' dimension);
# key and value follow the query
_ATTENTION: dict[str, tuple[int, int]] = {
    **{name: (0, 1) for name in (
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")},
    **{f"{name}_backward": (1, 1) for name in (
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")},
    # (batch, sequence, heads, head size)
    "_flash_attention_forward": (0, 2), "_efficient_attention_forward": (0, 2),
    "_flash_attention_backward": (1, 2), "_efficient_attention_backward": (1, 2),
}


def _broadcast_kv(formula: Callable[..., int], at: int, dim: int) -> Callable[..., int]:
    """``formula`` given key and value with the query's heads where they have fewer
    (NOTE [ Grouped-query attention FLOPs ]); shapes, not tensors, are passed on."""
    def counted(*args: Any, **kwargs: Any) -> int:
        query, key, value = args[at:at + 3] if len(args) >= at + 3 else (None, None, None)
        if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and \
                isinstance(value, torch.Tensor) and query.dim() == key.dim() > dim:
            heads, kv_heads = query.shape[dim], key.shape[dim]
            if kv_heads != heads and kv_heads > 0 and heads % kv_heads == 0:
                def wide(t: torch.Tensor) -> torch.Size:
                    return torch.Size((*t.shape[:dim], heads, *t.shape[dim + 1:]))

                args = (*args[:at + 1], wide(key), wide(value), *args[at + 3:])
        return formula(*args, **kwargs)

    return counted


def flop_formulas() -> dict[Any, Callable[..., int]]:
    """PyTorch's FLOP formulas (keyed by op packet) plus the CPU attention kernels, the
    attention ones counting grouped-query attention (NOTE [ Grouped-query attention
    FLOPs ])."""
    formulas: dict[Any, Callable[..., int]] = {}
    for packet, formula in _fc.flop_registry.items():
        formulas[packet] = _over_shapes(formula.__wrapped__) \
            if getattr(formula, "__code__", None) is _SHAPE_WRAPPED else formula
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_fwd),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_bwd),
    ):
        packet = getattr(aten, name, None)
        if packet is not None and packet not in formulas:
            formulas[packet] = _over_shapes(formula)
    for name, (at, dim) in _ATTENTION.items():
        packet = getattr(aten, name, None)
        if packet is not None and packet in formulas:
            formulas[packet] = _broadcast_kv(formulas[packet], at, dim)
    return formulas


# NOTE [ Shapes for the formulas ]
#     PyTorch registers each formula over shapes behind ``shape_wrapper``, which turns
#     the op's arguments and result into shapes with ``tree_map``: on the zoo's llama that
#     was a third of a plain step per profile, paid in every op a FLOP counter sees. The
#     formulas it wraps are called with shapes made by ``_shapes``, which maps what ATen
#     ops take and return (tensors in tuples, lists and dicts) to the same values.
_SHAPE_WRAPPED = _fc.shape_wrapper(lambda: 0).__code__  # the code of shape_wrapper's wrapper


def _shapes(obj: Any) -> Any:
    """``tree_map(get_shape, obj)`` for an op's arguments or result (NOTE [ Shapes for
    the formulas ]): tensors become their shapes, inside tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return obj.shape
    if type(obj) is tuple or type(obj) is list:
        return type(obj)(_shapes(item) for item in obj)
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):  # an op's named result
        return tuple(_shapes(item) for item in obj)
    if isinstance(obj, dict):
        return {key: _shapes(value) for key, value in obj.items()}
    return obj


def _over_shapes(formula: Callable[..., int]) -> Callable[..., int]:
    """A formula over shapes, given the op's tensors (NOTE [ Shapes for the formulas ])."""
    def counted(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        # (a dtype among the positional arguments, ``addmm.dtype_out``'s ``out_dtype``
        # on CUDA, would take the formula's ``out_shape``: it raised in the head's step)
        shapes = [_shapes(a) for a in args if not isinstance(a, torch.dtype)]
        return formula(*shapes, out_shape=_shapes(out_val), **_shapes(kwargs))

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
        return self.dispatch(func, types, args, kwargs)

    def dispatch(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        """Run one op and count it: the handler, which the memory tracker calls in place of
        the op (NOTE [ One mode for two instruments ] in ``memory.py``). Called directly,
        it skips the wrapper torch puts around every mode's ``__torch_dispatch__``
        (``torch._disable_dynamo``), which the outer mode's call has already passed."""
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

    def reset(self) -> None:
        """Count from zero again (a step measured again: NOTE [ A step that builds the
        model's state ] in ``step.py``)."""
        self.by_label = {}
        self.total = 0

    def phase_total(self, phase: str) -> int:
        """FLOPs of one phase (``"fwd"`` or ``"bwd"``) over all labels."""
        return sum(v for (_, p), v in self.by_label.items() if p == phase)
