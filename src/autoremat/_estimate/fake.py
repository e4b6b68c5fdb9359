"""Fake (``meta``) copies of a model and its batch, run as the target device would run them.

:func:`to_meta` remakes a model and its batch on the ``meta`` device, where every op
computes shapes and allocates nothing, with floating tensors cast to the dtype being
estimated (:func:`parse_dtype`). :func:`sdpa_as_on` makes attention on ``meta`` run the
kernel the target device would pick (NOTE [ Attention on meta ]), and
:func:`register_hf_attention` lets Transformers models run on ``meta`` without building
masks (NOTE [ Hugging Face models on meta ]). :func:`autoremat.estimate` and
:func:`autoremat._estimate.tracked_step.meta_step_peak` run their step inside both.

Known limitations:
    * Code that bound ``scaled_dot_product_attention`` at import
      (``from torch.nn.functional import ...``) bypasses NOTE [ Attention on meta ] and
      is estimated with the math kernel (an overestimate).
    * Parameters that are views of one storage (rare) are counted once per parameter
      when a real model is converted to ``meta``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from autoremat._core.errors import RematError, did_you_mean
from autoremat._core.step import parse_device

__all__ = [
    "HF_META_ATTENTION",
    "parse_dtype",
    "register_hf_attention",
    "sdpa_as_on",
    "to_meta",
]

_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}  # fmt: skip


def parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """``"bf16"``, ``"float32"``, ... or a ``torch.dtype`` -> ``torch.dtype`` (``None`` stays).

    Example:
        >>> parse_dtype("bf16")
        torch.bfloat16
    """
    if value is None or isinstance(value, torch.dtype):
        return value
    key = str(value).strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise RematError(f"unknown dtype {value!r}.{did_you_mean(key, _DTYPES)} "
                         f"Use one of: {', '.join(_DTYPES)}")
    return _DTYPES[key]


# --- moving a model and its batch to meta ------------------------------------------------


def _meta_like(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return torch.empty_like(t, device="meta", dtype=cast)


def to_meta(model: nn.Module, inputs: Any,
            dtype: torch.dtype | None = None) -> tuple[nn.Module, Any]:
    """A ``meta`` copy of ``model`` and ``inputs``, floating tensors cast to ``dtype``.

    No parameter data is copied: the deep copy is seeded with ``meta`` stand-ins for every
    parameter and buffer (tied weights stay tied). A model already on ``meta`` with no
    dtype change is returned as it is. ``inputs`` are always remade on ``meta``.

    Example:
        >>> m, x = to_meta(nn.Linear(4, 2), torch.randn(3, 4), torch.bfloat16)
        >>> m.weight.device.type, m.weight.dtype, x.dtype
        ('meta', torch.bfloat16, torch.bfloat16)
    """
    tensors = [*model.parameters(), *model.buffers()]
    on_meta = all(t.is_meta for t in tensors)
    needs_cast = dtype is not None and any(
        t.is_floating_point() and t.dtype != dtype for t in tensors)
    if not on_meta or needs_cast:
        memo: dict[int, Any] = {}
        for p in model.parameters():
            memo[id(p)] = nn.Parameter(_meta_like(p, dtype), requires_grad=p.requires_grad)
        for b in model.buffers():
            memo[id(b)] = _meta_like(b, dtype)
        model = copy.deepcopy(model, memo)

    def convert(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            out = _meta_like(t, dtype)
            return out.requires_grad_(t.requires_grad) if out.is_floating_point() else out
        return t

    return model, tree_map(convert, inputs)


def _resolve_device(model: nn.Module, device: str | torch.device | None) -> str:
    """The device estimated for: ``device``, else the model's, else ``"cuda"`` (on ``meta``)."""
    if device is not None:
        return str(parse_device(device))
    first = next(iter([*model.parameters(), *model.buffers()]), None)
    if first is None or first.is_meta:
        return "cuda"
    return str(first.device)


# --- attention as the target device would run it (NOTE [ Attention on meta ]) --------------

# NOTE [ Attention on meta ]
#     ``F.scaled_dot_product_attention`` picks a kernel by device: on ``meta`` PyTorch
#     always falls back to the math path, which materialises the (B, heads, T, T) scores
#     that the fused kernels never store. A Llama step would be overestimated several-fold
#     at long sequences. While estimating, ``F.scaled_dot_product_attention`` is replaced
#     by a function that runs the kernel the target device would run: for ``cpu`` it asks
#     PyTorch's own CPU selector (``torch._fused_sdp_choice`` on tiny CPU stand-ins with
#     the same sizes, dtypes and strides that matter); for ``cuda`` it follows PyTorch's
#     CUDA priority
#     (flash for fp16/bf16 without a mask, else memory-efficient, else math), calling the
#     CUDA ops' meta kernels, which save the same output and log-sum-exp as on a GPU.
#     (A ``TorchFunctionMode`` would be tidier, but torch-function modes are not active
#     inside autograd's backward, where checkpointing recomputes the forward: the
#     recompute would take the math path and fail checkpoint's metadata check.)

_MATH, _FLASH, _EFFICIENT = 0, 1, 2
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")
_SDPA_DEFAULTS: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False,
                                  "scale": None, "enable_gqa": False}


def _cpu_stand_in(t: torch.Tensor) -> torch.Tensor:
    """A tiny CPU tensor with ``t``'s sizes, dtype and last-dim stride (zero strides else)."""
    if t.dim() == 0:
        return torch.empty((), dtype=t.dtype)
    last = t.shape[-1]
    step = 1 if t.stride(-1) == 1 else 2
    base = torch.empty(*([1] * (t.dim() - 1)), last * step, dtype=t.dtype)[..., ::step]
    out = base.expand(t.shape)
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() and t.requires_grad \
        else out


def _cpu_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: dict[str, Any]) -> int:
    mask = a["attn_mask"]
    with _disable_current_modes(), torch.device("cpu"):
        return int(torch._fused_sdp_choice(
            _cpu_stand_in(q), _cpu_stand_in(k), _cpu_stand_in(v),
            attn_mask=_cpu_stand_in(mask) if isinstance(mask, torch.Tensor) else None,
            dropout_p=a["dropout_p"], is_causal=a["is_causal"], scale=a["scale"],
            enable_gqa=a["enable_gqa"]))


def _cuda_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: dict[str, Any]) -> int:
    # PyTorch's CUDA order is flash, memory-efficient, math (sdp_utils.cpp, sm80+).
    same_dim = q.shape[-1] == k.shape[-1] == v.shape[-1]
    four_d = q.dim() == k.dim() == v.dim() == 4
    gqa = four_d and q.shape[1] != k.shape[1]
    if (four_d and same_dim and q.dtype in (torch.float16, torch.bfloat16)
            and a["attn_mask"] is None and q.shape[-1] <= 256):
        return _FLASH
    if four_d and same_dim and not gqa and q.dtype in (torch.float16, torch.bfloat16,
                                                        torch.float32):
        return _EFFICIENT
    return _MATH


def _sdpa_on_meta(device_type: str, func: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
    a = {**_SDPA_DEFAULTS, **dict(zip(_SDPA_ARGS, args, strict=False)), **kwargs}
    q, k, v = a["query"], a["key"], a["value"]
    choose = _cuda_choice if device_type == "cuda" else _cpu_choice
    choice = choose(q, k, v, a)
    aten = torch.ops.aten
    if choice == _FLASH and device_type == "cuda":
        return aten._scaled_dot_product_flash_attention(
            q, k, v, a["dropout_p"], a["is_causal"], scale=a["scale"])[0]
    if choice == _FLASH:
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, a["dropout_p"], a["is_causal"], attn_mask=a["attn_mask"],
            scale=a["scale"])[0]
    if choice == _EFFICIENT:
        mask = a["attn_mask"]
        if isinstance(mask, torch.Tensor):
            mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        needs_lse = any(t.requires_grad for t in (q, k, v)) and torch.is_grad_enabled()
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, needs_lse, a["dropout_p"], a["is_causal"], scale=a["scale"])[0]
    return func(*args, **kwargs)


@contextmanager
def sdpa_as_on(device: str | torch.device) -> Iterator[None]:
    """Inside, ``F.scaled_dot_product_attention`` on ``meta`` tensors runs the kernel that
    ``device`` (``"cpu"`` or ``"cuda"``) would pick; see NOTE [ Attention on meta ].

    Other calls go to PyTorch unchanged. The attribute is put back on exit, also when the
    block raises. It is process-wide while inside: not for use from several threads.
    """
    device_type = torch.device(device).type
    original = F.scaled_dot_product_attention

    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
        query = args[0] if args else kwargs.get("query")
        if isinstance(query, torch.Tensor) and query.is_meta:
            return _sdpa_on_meta(device_type, original, args, kwargs)
        return original(*args, **kwargs)

    F.scaled_dot_product_attention = scaled_dot_product_attention  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


# NOTE [ Hugging Face models on meta ]
#     Transformers builds attention masks by reading tensor values (it checks whether
#     ``position_ids`` pack several sequences, whether a padding mask is all ones), which
#     ``meta`` tensors cannot answer. For a model configured with ``"sdpa"`` and a batch
#     without ``attention_mask``, the estimate runs it under ``"autoremat_sdpa"``:
#     Transformers' own SDPA function registered under a name that has no mask builder, so
#     SDPA gets no mask and ``is_causal`` (``True`` for decoders, ``False`` for BERT) --
#     exactly what ``"sdpa"`` passes for an unpadded, unpacked batch. A batch with an
#     ``attention_mask`` runs unchanged and may not run on ``meta``.

HF_META_ATTENTION = "autoremat_sdpa"


def register_hf_attention() -> str | None:
    """Register :data:`HF_META_ATTENTION` with Transformers (NOTE [ Hugging Face models on
    meta ]) and return it; ``None`` when Transformers (or its attention registry) is absent."""
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:
        return None
    AttentionInterface.register(HF_META_ATTENTION, sdpa_attention_forward)
    return HF_META_ATTENTION


@contextmanager
def _hf_attention_without_masks(model: nn.Module, inputs: Any) -> Iterator[list[str]]:
    """Run a Transformers model whose config says ``"sdpa"`` under
    :data:`HF_META_ATTENTION` (no mask builder) when the batch has no ``attention_mask``;
    yields notes for the estimate."""
    config = getattr(model, "config", None)
    notes: list[str] = []
    if config is not None and getattr(config, "use_cache", False) and model.training:
        notes.append("the model's config has use_cache=True: with checkpointing, every "
                     "recompute appends to the KV cache; train with use_cache=False, as "
                     "Transformers does under gradient checkpointing")
    masked = isinstance(inputs, dict) and inputs.get("attention_mask") is not None
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa" or masked:
        yield notes
        return
    name = register_hf_attention()
    if name is None:
        yield notes
        return
    config._attn_implementation = name
    try:
        yield notes
    finally:
        config._attn_implementation = "sdpa"
