"""Fake (``meta``) copies of a model and its batch, run as the target device would run them.

:func:`to_meta` remakes a model and its batch on the ``meta`` device, where every op
computes shapes and allocates nothing, with floating tensors cast to the dtype being
estimated (:func:`parse_dtype`). :func:`sdpa_as_on` makes attention on ``meta`` run the
kernel the target device would pick (NOTE [ Attention on meta ]), and
:func:`kernels_on_meta` runs mixture-of-experts matmuls on ``meta`` (NOTE [ Grouped
matmuls on meta ]) and gives a few ops the strides the device kernels give (NOTE [ Strides
on meta ]), and Transformers models run on ``meta`` with the masks their batch
asks for (NOTE [ Hugging Face models on meta ]). :func:`autoremat.estimate` and
:func:`autoremat._estimate.tracked_step.meta_step_peak` run their step inside
:func:`step_as_on`, which holds all of these and turns the KV cache off as ``profile``
does; :func:`meta_refusal` says why a step could not run on ``meta`` and what to do.

Known limitations:
    * Code that bound ``scaled_dot_product_attention`` at import
      (``from torch.nn.functional import ...``) bypasses NOTE [ Attention on meta ] and
      is estimated with the math kernel (an overestimate).
    * Parameters that are views of one storage (rare) are counted once per parameter
      when a real model is converted to ``meta``.
    * A Transformers attention mask whose values decide the step (padding or not) must
      come with the batch on a real device; a mask on ``meta`` is refused when the
      choice is needed (NOTE [ Hugging Face models on meta ]).
    * Experts routed by a loop over the experts hit (``experts_implementation="eager"``)
      have shapes that depend on the routing and are refused (NOTE [ Grouped matmuls on
      meta ]).
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import math
import os
import sys
import textwrap
import traceback
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch._prims_common import suggest_memory_format
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map

from autoremat._core.errors import RematError, did_you_mean
from autoremat._core.step import flat_tensors, map_tensors, parse_device, training_config

__all__ = [
    "kernels_on_meta",
    "meta_refusal",
    "parse_dtype",
    "refused_on_meta",
    "sdpa_as_on",
    "step_as_on",
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
    if value is None:
        return value
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise RematError(f"dtype must be a floating dtype (the floating parameters, "
                             f"buffers and inputs are cast to it; integer inputs such as "
                             f"token ids keep theirs), got {value}. Use one of: "
                             f"{', '.join(_DTYPES)}")
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


def _attribute_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """The tensors ``model``'s modules keep as plain attributes, alone or in a list,
    tuple or dict (not parameters, buffers or submodules)."""
    for module in model.modules():
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers", "_modules"):
                continue
            found = value.values() if isinstance(value, dict) else \
                value if isinstance(value, (list, tuple)) else (value,)
            yield from (t for t in found if isinstance(t, torch.Tensor))


def to_meta(model: nn.Module, inputs: Any,
            dtype: torch.dtype | None = None) -> tuple[nn.Module, Any]:
    """A ``meta`` copy of ``model`` and ``inputs``, floating tensors cast to ``dtype``.

    No parameter data is copied: the deep copy is seeded with ``meta`` stand-ins for every
    parameter and buffer (tied weights stay tied), and for the tensors a module keeps as
    plain attributes (alone, or in a list, tuple or dict): state a forward left there,
    which may be part of an autograd graph that deep copy refuses (RecurrentGemma's
    ``recurrent_states`` after a training step). A model already on ``meta`` with no
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
        for t in _attribute_tensors(model):
            memo.setdefault(id(t), _meta_like(t, dtype))
        model = copy.deepcopy(model, memo)

    def convert(t: torch.Tensor) -> torch.Tensor:
        out = _meta_like(t, dtype)
        return out.requires_grad_(t.requires_grad) if out.is_floating_point() else out

    return model, map_tensors(convert, inputs)


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
#     (flash for fp16/bf16 without a mask and one head size, else memory-efficient where
#     q and k share one, else math), calling the
#     CUDA ops' meta kernels, which save the same output and log-sum-exp as on a GPU. A
#     boolean mask reaches a fused kernel as PyTorch's SDPA passes it: converted to an
#     additive mask in the query's dtype, a tensor the kernel's backward keeps.
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
    # PyTorch's CUDA order is flash, memory-efficient, math (sdp_utils.cpp, sm80+). Flash
    # takes one head size for q, k and v; memory-efficient one for q and k and its own for
    # v (check_head_dim_size_mem_efficient): multi-head latent attention (DeepSeek-V3: q/k
    # 192, v 128) was estimated with the math kernel's (B, heads, T, T) scores, 2.1x an
    # H200's profile at 4096 tokens, where a fused kernel ran (cuDNN's, saving the same
    # output and log-sum-exp rows as memory-efficient's).
    same_qk = q.shape[-1] == k.shape[-1]
    same_dim = same_qk and k.shape[-1] == v.shape[-1]
    four_d = q.dim() == k.dim() == v.dim() == 4
    gqa = four_d and q.shape[1] != k.shape[1]
    if (four_d and same_dim and q.dtype in (torch.float16, torch.bfloat16)
            and a["attn_mask"] is None and q.shape[-1] <= 256):
        return _FLASH
    if four_d and same_qk and not gqa and q.dtype in (torch.float16, torch.bfloat16,
                                                       torch.float32):
        return _EFFICIENT
    return _MATH


def _sdpa_on_meta(device_type: str, func: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
    a = {**_SDPA_DEFAULTS, **dict(zip(_SDPA_ARGS, args, strict=False)), **kwargs}
    q, k, v = a["query"], a["key"], a["value"]
    choose = _cuda_choice if device_type == "cuda" else _cpu_choice
    choice = choose(q, k, v, a)
    if choice == _MATH:
        return func(*args, **kwargs)  # PyTorch's own math path, mask conversion included
    a["attn_mask"] = _additive_mask(a["attn_mask"], q.dtype)
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


def _additive_mask(mask: Any, dtype: torch.dtype) -> Any:
    """A boolean mask as the fused kernels get it from PyTorch's SDPA: 0 where attending,
    -inf elsewhere, in the query's dtype (``convert_boolean_attn_mask`` in ATen's
    attention.cpp); a (B, 1, T, T) mask so becomes a float tensor that lives through
    the kernel's backward. Other masks are passed on as they are."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.scalar_tensor(-math.inf, dtype=dtype,
                                                       device=mask.device))


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


# NOTE [ Group norm on meta ]
#     ATen's ``group_norm`` hands ``native_group_norm`` a CPU input in its suggested
#     memory format (``input.contiguous(input.suggest_memory_format())``: a channels-last
#     input as it is), and any other device's input contiguous (``group_norm`` in ATen's
#     group_norm.cpp): on ``meta`` the CUDA path, a copy of a channels-last input. The
#     CPU kernel then writes its output, and backward its gradients, in that format,
#     and the ops after it copy or not by those strides. diffusers' VAE normalises the
#     residual sum of its attention, which comes out channels-last (the attention's
#     output ``transpose(-1, -2).reshape(b, c, h, w)``): its step was estimated 3.3% under
#     its CPU step (512 KiB at a batch of two 32 x 32 images). While estimating for the CPU,
#     :func:`group_norm_as_on` runs ``F.group_norm`` on ``meta`` as the CPU does; for
#     CUDA, ``meta`` already copies as CUDA does.


class _GroupNormOnCpu(torch.autograd.Function):
    """``native_group_norm`` with the CPU's backward: autograd's formula hands
    ``native_group_norm_backward`` a CPU gradient and input in the input's suggested
    memory format, any other device's contiguous (``derivatives.yaml``), so on ``meta``
    it copied a channels-last pair the CPU does not (NOTE [ Group norm on meta ]). The
    same ops, and the same tensors saved, as autograd's own."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, groups: int, eps: float) -> torch.Tensor:
        n, c = x.shape[:2]
        hxw = math.prod(x.shape[2:])
        out, mean, rstd = torch.native_group_norm(x, weight, bias, n, c, hxw, groups, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.sizes = (n, c, hxw, groups)
        ctx.mask = [x.requires_grad, weight is not None and weight.requires_grad,
                    bias is not None and bias.requires_grad]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean, rstd = ctx.saved_tensors
        layout = suggest_memory_format(x)
        grads = torch.ops.aten.native_group_norm_backward(
            grad.contiguous(memory_format=layout), x.contiguous(memory_format=layout), mean,
            rstd, weight, *ctx.sizes, ctx.mask)
        return (*grads, None, None)


@contextmanager
def group_norm_as_on(device: str | torch.device) -> Iterator[None]:
    """Inside, ``F.group_norm`` on ``meta`` tensors takes the input in the layout
    ``device`` would (NOTE [ Group norm on meta ]); nothing changes for a device other
    than the CPU. Process-wide while inside, as :func:`sdpa_as_on`."""
    if torch.device(device).type != "cpu":
        yield
        return
    original = F.group_norm

    def group_norm(input: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
        if not (isinstance(input, torch.Tensor) and input.is_meta and input.dim() >= 2):
            return original(input, num_groups, weight, bias, eps)
        x = input.contiguous(memory_format=suggest_memory_format(input))
        gamma = weight.contiguous() if weight is not None else None
        beta = bias.contiguous() if bias is not None else None
        return cast(torch.Tensor, _GroupNormOnCpu.apply(x, gamma, beta, num_groups, eps))

    F.group_norm = group_norm  # type: ignore[assignment]
    try:
        yield
    finally:
        F.group_norm = original


# NOTE [ Dropout on meta ]
#     ``F.dropout`` (out of place, training, 0 < p < 1) runs ATen's fused kernel,
#     ``native_dropout``, only for CUDA (and XPU and lazy) tensors
#     (``is_fused_kernel_acceptable`` in ATen's Dropout.cpp): it returns the output and a
#     bool mask, one byte per element, which backward keeps. On ``meta`` (as on the CPU)
#     it runs the composite: a mask in the input's dtype, filled by ``bernoulli_``, and
#     a product. So a CUDA estimate of a model with dropout counted 2-4 times the mask
#     bytes: the zoo's mlp at batch 128 (dropout after each layer) was estimated at
#     10,549,248 bytes, its step on an H200 measured 8,832,000 by the allocator. While
#     estimating for CUDA, :func:`dropout_as_on` answers such a call on ``meta`` with
#     ``native_dropout``. In-place dropout and the feature dropouts (``dropout2d``, ...)
#     are composite on CUDA too, and left alone.


@contextmanager
def dropout_as_on(device: str | torch.device) -> Iterator[None]:
    """Inside, ``F.dropout`` on ``meta`` tensors runs what ``device`` would run (NOTE
    [ Dropout on meta ]); nothing changes for a device other than CUDA. Process-wide
    while inside, like :func:`sdpa_as_on`, and put back on exit."""
    if torch.device(device).type != "cuda":
        yield
        return
    original = F.dropout

    def dropout(input: Any, p: float = 0.5, training: bool = True,
                inplace: bool = False) -> Any:
        if isinstance(input, torch.Tensor) and input.is_meta and training and \
                not inplace and 0 < p < 1 and input.numel() > 0:
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    F.dropout = dropout  # type: ignore[assignment]
    try:
        yield
    finally:
        F.dropout = original


# --- grouped matmuls (mixture-of-experts layers) on meta ---------------------------------

# NOTE [ Grouped matmuls on meta ]
#     Mixture-of-experts layers in Transformers (Mixtral, Qwen2-MoE, OLMoE, ... with
#     ``experts_implementation="grouped_mm"``, the default) run their experts with
#     ``torch._grouped_mm``: the (token, expert) pairs sorted by expert, one matmul over
#     groups whose sizes (``offs``) come from the routing. The output is (pairs, out)
#     whatever the routing, so the step's memory does not depend on it, and a step on
#     ``meta`` can be exact. But the op's meta kernel copies the CUDA kernel's checks (it
#     refuses anything but bfloat16), and on a CPU build of PyTorch it leaves out the row
#     padding the real kernels give their output (rows padded to 16 bytes,
#     ``create_grouped_gemm_output_tensor`` in ATen's ``GroupedMMUtils.h``, CPU and CUDA
#     alike). While estimating, :func:`kernels_on_meta` answers ``_grouped_mm`` on
#     ``meta`` with the output those kernels make, in forward and in backward. Whether the
#     target's kernel supports the dtype is not checked. Routing that reads values
#     (``experts_implementation="eager"``: a loop over the experts hit, ``nonzero``)
#     cannot run on ``meta``; ``estimate`` says so and how to go on.


def _grouped_mm_output(mat_a: torch.Tensor, mat_b: torch.Tensor,
                       offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The output of ``aten._grouped_mm`` as the CPU and CUDA kernels allocate it."""
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if a_2d and b_2d and offs is not None:  # (K, M) x (M, N), groups along M: the
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]  # weights' gradient
    elif a_2d:  # (M, K) x (E, K, N): the experts' forward
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b_2d:
        size = [mat_a.size(1), mat_b.size(1)]
    else:  # (E, M, K) x (E, K, N): a batched matmul
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    dtype = out_dtype or mat_a.dtype
    align = max(1, 16 // dtype.itemsize)
    padded = -(-size[-1] // align) * align  # each row starts on 16 bytes
    stride = [size[1] * padded, padded, 1] if len(size) == 3 else [padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


# NOTE [ Strides on meta ]
#     A few ops' meta kernels give their output other strides than the CPU and CUDA
#     kernels do. The bytes are the same, but an op after it that needs a contiguous
#     tensor then copies on ``meta`` where the device does not, or the reverse: Swin's
#     step was estimated 0.8% over its CPU step, because ``native_layer_norm_backward``'s
#     gradient followed its (transposed) ``grad_output``'s strides on ``meta``, and the
#     ``.contiguous()`` after it copied. The device kernels make these outputs contiguous
#     (``empty_like(X.contiguous())`` for layer norm on CPU and CUDA; the structured meta
#     function of ``_log_softmax_backward_data``, shared by both): :data:`_CONTIGUOUS`
#     names them, and on ``meta`` their first output comes out contiguous too. A sweep
#     of the op outputs of about 45 Transformers architectures' steps against meta
#     kernels run on inputs of the same strides found these two (and convolution on
#     channels-last inputs, left alone: the CUDA kernels' choice there depends on cuDNN,
#     and no estimate differed).
#     Batch norm's CPU and CUDA kernels write their output in the input's suggested
#     memory format (contiguous, or channels-last for such a 4-d input) where its meta
#     kernel keeps the input's strides: PatchTST normalises a transposed (B, C, T) view,
#     and its blocks' linear layers then copied their input on ``meta`` only (24 KiB a
#     block, the step's estimate 13% under its CPU step). :data:`_SUGGESTED` names them.
#     A 2-d convolution on the CPU writes its output channels-last where its input or its
#     weight is channels-last (oneDNN's and the slow kernel's rule, every dtype; measured
#     over 360 cases of dtype, batch, groups, kernel size and transposition), where its
#     meta kernel writes it contiguous. diffusers' VAE convolves the channels-last output
#     of its attention; on ``meta`` the group norm after that copied where the CPU does
#     not (the step's estimate 3.3% under its CPU step, with NOTE [ Group norm on meta ]).
#     While estimating for the CPU the output follows that rule. Not done: 3-d
#     convolutions (the CPU writes channels-last only where oneDNN runs, which depends on
#     sizes and threads), and CUDA, where cuDNN's rule looks alike but no device has
#     measured it.
_CONTIGUOUS = frozenset({torch.ops.aten.native_layer_norm_backward.default,  # grad_input
                        torch.ops.aten._log_softmax_backward_data.default})
_SUGGESTED = frozenset({torch.ops.aten.native_batch_norm,  # output, by the input's format
                        torch.ops.aten._native_batch_norm_legit,
                        torch.ops.aten._native_batch_norm_legit_no_training})

# NOTE [ Losses that keep their unreduced storage ]
#     ``mse_loss``, ``smooth_l1_loss``, ``soft_margin_loss`` and ``binary_cross_entropy``
#     reduced to a mean or a sum return a 0-d loss whose storage is as large as the
#     unreduced loss: the kernels make the output in the inputs' shape and ``resize_`` it
#     to 0-d, which keeps the storage (a CPU or CUDA storage only ever grows). That storage
#     lives as long as the loss, through the whole backward: for a diffusion model, the
#     size of its prediction. Their meta kernels give the 0-d loss 4 bytes; a plain
#     PyTorch DiT's step was estimated 8,188 bytes under its CPU step. On ``meta`` these
#     ops' 0-d outputs get the storage the device kernels leave them (measured on the CPU;
#     ``mse_loss`` and ``smooth_l1_loss`` share one structured kernel with CUDA).
_KEEPS_UNREDUCED = frozenset({torch.ops.aten.mse_loss.default,
                              torch.ops.aten.smooth_l1_loss.default,
                              torch.ops.aten.soft_margin_loss.default,
                              torch.ops.aten.binary_cross_entropy.default})


# NOTE [ CTC on meta ]
#     ``F.ctc_loss`` given its lengths as tensors (Wav2Vec2's, HuBERT's, every CTC head in
#     Transformers) runs ``aten._ctc_loss.Tensor``, which has no meta kernel: its
#     ``log_alpha`` output is ``(batch, time, 2 * longest target + 1)``, which depends on
#     the lengths' values. Where the values mode knows them (they come from the batch's
#     labels, NOTE [ Following the batch's values ]), the op runs as its overload taking
#     the lengths as lists, which has one. Its backward has no meta kernel either; both
#     devices' kernels return the gradient contiguous in the log-probabilities' shape (their
#     ``log_beta``, as large as ``log_alpha``, is freed inside the kernel, where the storage
#     tracker does not see it on either side).


def _cpu_conv_layout(args: tuple[Any, ...]) -> torch.memory_format | None:
    """The layout the CPU writes a 2-d convolution's output in, where it is channels-last
    (NOTE [ Strides on meta ]); else ``None``."""
    x, weight = args[0], args[1]
    if x.dim() != 4:
        return None
    if torch.channels_last in (suggest_memory_format(x), suggest_memory_format(weight)):
        return torch.channels_last
    return None


class _KernelsOnMeta(TorchDispatchMode):
    """``aten._grouped_mm`` on ``meta`` (NOTE [ Grouped matmuls on meta ]), the outputs
    :data:`_CONTIGUOUS` and :data:`_SUGGESTED` name and, for the CPU (``cpu``), 2-d
    convolutions' (NOTE [ Strides on meta ]), and the losses of NOTE [ Losses that keep
    their unreduced storage ], as the device kernels make them; every other op goes on
    unchanged."""

    def __init__(self, cpu: bool = False) -> None:
        super().__init__()
        self.cpu = cpu

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if (func is torch.ops.aten._grouped_mm.default and args[0].is_meta
                and kwargs.get("bias") is None and (len(args) < 4 or args[3] is None)
                and (args[0].dim() == 3 or args[1].dim() == 3
                     or kwargs.get("offs", args[2] if len(args) > 2 else None) is not None)):
            return _grouped_mm_output(*args, **kwargs)
        if func is torch.ops.aten._ctc_loss_backward.Tensor and args[1].is_meta:
            # NOTE [ CTC on meta ]: the gradient of the log-probabilities, contiguous
            return torch.empty(args[1].shape, dtype=args[1].dtype, device=args[1].device)
        out = func(*args, **kwargs)  # what it cannot answer, PyTorch's checks refuse
        if func in _KEEPS_UNREDUCED and out.is_meta and out.dim() == 0:
            # NOTE [ Losses that keep their unreduced storage ]
            kept = torch.empty(torch.broadcast_shapes(args[0].shape, args[1].shape),
                               dtype=out.dtype, device=out.device)
            return kept.resize_(())
        layout: torch.memory_format | None = None
        if func in _CONTIGUOUS:  # NOTE [ Strides on meta ]
            layout = torch.contiguous_format
        elif func.overloadpacket in _SUGGESTED:
            layout = suggest_memory_format(args[0])
        elif self.cpu and func is torch.ops.aten.convolution.default:
            layout = _cpu_conv_layout(args)
        if layout is None:
            return out
        made = out[0] if isinstance(out, tuple) else out
        if not (isinstance(made, torch.Tensor) and made.is_meta
                and not made.is_contiguous(memory_format=layout)):
            return out
        made = torch.empty_like(made, memory_format=layout)
        return (made, *out[1:]) if isinstance(out, tuple) else made


@contextmanager
def kernels_on_meta(device: str | torch.device | None = None) -> Iterator[None]:
    """Inside, ``torch._grouped_mm`` on ``meta`` tensors (any floating dtype) makes the
    output the CPU and CUDA kernels make (NOTE [ Grouped matmuls on meta ]), and so do
    the ops of NOTE [ Strides on meta ] (those of one device only, where ``device`` is
    it) and NOTE [ Losses that keep their unreduced storage ]."""
    with _KernelsOnMeta(cpu=device is not None and torch.device(device).type == "cpu"):
        yield


# --- Transformers models on meta -----------------------------------------------------------

# NOTE [ Hugging Face models on meta ]
#     Transformers builds attention masks by reading tensor values, which ``meta`` tensors
#     do not have: it checks whether ``position_ids`` pack several sequences (when the
#     batch has no ``attention_mask``), and for ``"sdpa"`` whether a padding mask is all
#     ones, in which case it builds no mask and SDPA runs with ``is_causal`` instead.
#     While estimating, a Transformers model runs as configured (the same attention
#     functions, the same ``config._attn_implementation``: model code that compares it
#     with ``"sdpa"``, as Falcon's attention does, takes the same branch as on a device),
#     with two of Transformers' functions standing in for the step:
#     * ``find_packed_sequence_indices`` runs on the real values of a batch's own
#       ``position_ids`` (followed as the masks' are, below, also through the ``expand``
#       of one row to the batch's rows) and answers "not packed" for
#       those the model makes on ``meta`` (a range per row): a packed batch (several
#       sequences per row, no mask, as TRL's padding-free collator gives) gets the mask
#       that keeps them apart, as on a device (a Llama of 2 layers at 2 x 256 tokens, two
#       sequences per row, was 15.7% under its CPU step when taken as unpacked);
#     * ``"sdpa"``'s mask builder is Transformers' ``sdpa_mask`` with its one
#       value-dependent choice (skip the mask, or build it) made by Transformers' own
#       test on the real values of the mask (:class:`_MaskBuilder`). Those are followed
#       (:class:`_Values`) from the caller's batch, the one the meta copy was made
#       from, or from the ``torch.ones`` a model makes when a stack has no mask (BART's
#       decoder), through the copies and casts on the way to the builder. Without a mask
#       the choice reads nothing: an unpadded batch gets no mask and ``is_causal`` as on
#       a device, a sliding window shorter than the sequence its window's mask (a float
#       copy of it kept by SDPA, repeated keys instead of ``enable_gqa``: a Mistral of 4
#       layers with a window of 32 at 128 tokens was 12% under its CPU step when the
#       window was left out). A mask without known values (a batch given on ``meta``, a
#       mask the model computed) leaves nothing to choose by; when the choice is needed,
#       the estimate stops and says to pass the batch's real ``attention_mask``, or none
#       when nothing is padded. Eager attention's builder reads no values.
#     Both are process-wide while the step runs (as :func:`sdpa_as_on`). Until
#     2026-11-29 the model ran under another attention name with no mask builder
#     instead, which broke model code that compares the name with ``"sdpa"`` (Falcon's
#     estimate raised a ``TypeError`` from its eager branch).


class _Lazy:
    """The values of a meta tensor as a CPU tensor, made when first read: ``make`` run on
    the values of ``needs`` (others of this class), outside every mode, or ``None`` where
    they turn out not to be known (NOTE [ Following the batch's values ]). Once made, what
    they were made from is let go."""

    __slots__ = ("done", "make", "needs", "real")

    def __init__(self, make: Callable[..., Any] | None = None, needs: tuple[_Lazy, ...] = (),
                 real: torch.Tensor | None = None) -> None:
        self.make, self.needs, self.real, self.done = make, needs, real, make is None

    def get(self) -> torch.Tensor | None:
        stack: list[_Lazy] = [self]  # (a loop, not recursion: a chain of many ops)
        with _disable_current_modes():  # CPU work of ours, not the step's
            while stack:
                top = stack[-1]
                if top.done:
                    stack.pop()
                    continue
                pending = [need for need in top.needs if not need.done]
                if pending:
                    stack.extend(pending)
                    continue
                reals = [need.real for need in top.needs]
                make = cast("Callable[..., Any]", top.make)
                top.real = None if any(r is None for r in reals) else make(*reals)
                top.make, top.needs, top.done = None, (), True
                stack.pop()
        return self.real


class _Values(TorchDispatchMode):
    """The real values of the batch's tensors on ``meta`` and of tensors made of known
    values, followed through the ops the model runs on them, and made only where read
    (NOTE [ Following the batch's values ]). Every other tensor has no known values. Ops
    that need values (``.item()``, ``nonzero``, a boolean mask's index, a copy to the
    CPU) get them where they are known."""

    _ONES = (torch.ops.aten.ones.default, torch.ops.aten.new_ones.default)

    def __init__(self, inputs: Any, given: Any) -> None:
        super().__init__()
        # id(meta tensor) -> (a weak reference to it, its values), dropped when it dies
        self.values: dict[int, tuple[weakref.ref[torch.Tensor], _Lazy]] = {}
        for _, meta, real in _batch_pairs(inputs, given):
            self._set(meta, _Lazy(functools.partial(_batch_values, real, meta.dtype)))

    def _set(self, meta: torch.Tensor, values: _Lazy | torch.Tensor) -> None:
        key, entries = id(meta), self.values

        def gone(ref: weakref.ref[torch.Tensor]) -> None:
            if entries.get(key, (None,))[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(meta, gone),
                        values if isinstance(values, _Lazy) else _Lazy(real=values))

    def _lazy(self, meta: torch.Tensor) -> _Lazy | None:
        ref, lazy = self.values.get(id(meta), (None, None))
        return lazy if ref is not None and ref() is meta else None

    def value(self, meta: torch.Tensor) -> torch.Tensor | None:
        """The values of ``meta`` as a CPU tensor of its dtype, or ``None`` when
        unknown."""
        lazy = self._lazy(meta)
        return None if lazy is None else lazy.get()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in _CONSTANT_FACTORIES:
            return self._constant(func, args, kwargs)
        if not any(id(a) in self.values for a in args) and not any(
                isinstance(a, (tuple, list)) and any(id(b) in self.values for b in a)
                for a in args):
            return func(*args, **kwargs)  # (most ops: none of its arguments has known values)
        metas = [t for t in flat_tensors((args, kwargs)) if t.is_meta]
        lazies = [self._lazy(t) for t in metas]
        known = all(lazy is not None for lazy in lazies)
        if func is torch.ops.aten.index.Tensor and _bool_index(args[1]):
            return self._index(func, args, known)
        if func is torch.ops.aten.masked_select.default and not known \
                and (mask := self.value(args[1])) is not None:
            return self._masked_select(args, mask)
        if func is torch.ops.aten._ctc_loss.Tensor and all(
                self.value(t) is not None for t in args[2:4]):  # NOTE [ CTC on meta ]
            lengths = [cast(torch.Tensor, self.value(t)).tolist() for t in args[2:4]]
            return torch.ops.aten._ctc_loss.default(*args[:2], *lengths, *args[4:], **kwargs)
        needs = _needs_values(func, args, kwargs)
        if needs and not known:
            return func(*args, **kwargs)  # what it cannot answer, PyTorch's checks refuse
        ran = None if not known or torch.Tag.nondeterministic_seeded in func.tags else _Lazy(
            functools.partial(_run_on_cpu, func, *_slots((args, kwargs), metas)),
            cast("tuple[_Lazy, ...]", tuple(lazies)))  # (draws: not ours to make)
        if needs:  # the output, made from the values: a scalar, or meta tensors of the
            # values' shapes (a copy to another device is the values, on the CPU)
            real_out = None if ran is None else ran.get()
            if real_out is None:
                return func(*args, **kwargs)
            out = real_out if _copies_out(func, args, kwargs) else \
                map_tensors(_on_meta_empty, real_out)
        else:
            out = func(*args, **kwargs)
        written = [a for a, info in zip(args, func._schema.arguments, strict=False)
                   if info.alias_info is not None and info.alias_info.is_write
                   and isinstance(a, torch.Tensor)]
        # a view changed in place changes its base: the base's values as they were
        bases = [(t, t._base, self._lazy(t._base)) for t in written if t._base is not None]
        for t in written:  # what it knew of it, its base and their views is stale
            self._forget(t)
        if ran is None:
            return out
        several = isinstance(out, (tuple, list))
        for i, t in enumerate(out if several else (out,)):
            # (an output changed in place is the argument: its new values; where it is a
            # view, its base and the base's other views stay forgotten)
            if isinstance(t, torch.Tensor) and t.is_meta:
                self._set(t, _Lazy(functools.partial(_output, i if several else None,
                                                     t.shape), (ran,)))
        for view, base, was in bases:  # (Longformer's global_attention_mask[:, 0] = 1)
            now = self._lazy(view)
            if was is not None and now is not None and base.storage_offset() == 0:
                self._set(base, _Lazy(functools.partial(
                    _written_through, view.shape, view.stride(), int(view.storage_offset()),
                    base.stride()), (was, now)))
        return out

    def _constant(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A tensor made full of one value (``torch.ones``, ``zeros_like``, ``arange``):
        its values are known whatever its arguments' are."""
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.is_meta and (
                not out.is_floating_point() or out.dim() == 0 or func in self._ONES):
            # (floating-point ones only when a mask could be made of them: not a
            # gradient's zeros in backward)
            metas = [t for t in flat_tensors(args) if t.is_meta]
            self._set(out, _Lazy(functools.partial(_constant_on_cpu, func,
                                                   _slots(args, metas), kwargs)))
        return out

    def _index(self, func: Any, args: tuple[Any, ...], known: bool) -> Any:
        """``x[mask]`` with a boolean mask of known values: the mask's positions as long
        indices (their count is the output's length), on meta."""
        indices = []
        for index in args[1]:
            real = None if index is None else self.value(index)
            if index is None or index.dtype not in (torch.bool, torch.uint8):
                indices.append(index)
            elif real is None:
                return func(*args)  # (an unknown mask: PyTorch refuses it on meta)
            else:
                with _disable_current_modes():
                    positions = real.nonzero().unbind(1)
                indices.extend(_on_meta_empty(i) for i in positions)
        out = func(args[0], indices)
        if known:
            metas = [t for t in (args[0], *args[1]) if t is not None and t.is_meta]
            ran = _Lazy(functools.partial(_run_on_cpu, func, _slots(args, metas), {}),
                        tuple(cast(_Lazy, self._lazy(t)) for t in metas))
            self._set(out, _Lazy(functools.partial(_output, None, out.shape), (ran,)))
        return out

    @staticmethod
    def _masked_select(args: tuple[Any, ...], mask: torch.Tensor) -> torch.Tensor:
        """``x.masked_select(mask)`` with the mask's values known: as many elements as the
        mask, broadcast to ``x``'s shape, selects."""
        x = args[0]
        with _disable_current_modes():
            count = int(mask.expand(torch.broadcast_shapes(x.shape, mask.shape)).sum())
        return torch.empty(count, dtype=x.dtype, device=x.device)

    def _forget(self, changed: torch.Tensor) -> None:
        root = changed._base if changed._base is not None else changed
        for key, (ref, _) in list(self.values.items()):
            t = ref()
            if t is None or t is root or t._base is root:
                del self.values[key]


def _batch_values(real: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return real.detach().to("cpu", dtype)


class _Slot:
    """Where a meta tensor was in an op's arguments: the arguments kept to run the op
    again on values hold these, not the meta tensors, which would stay alive (and
    counted) as long as the values."""

    __slots__ = ("dtype", "index", "shape")

    def __init__(self, index: int, t: torch.Tensor) -> None:
        self.index, self.shape, self.dtype = index, t.shape, t.dtype


def _slots(args: Any, metas: list[torch.Tensor]) -> Any:
    """``args`` (an op's: tensors, lists of them, scalars) with each of ``metas`` a
    :class:`_Slot` of its index."""
    at = {id(t): i for i, t in enumerate(metas)}
    return map_tensors(lambda t: _Slot(at[id(t)], t) if id(t) in at else t, args)


def _filled(args: Any, fill: Callable[[_Slot], Any]) -> Any:
    """``args`` with each :class:`_Slot` in it ``fill(slot)``."""
    return tree_map(lambda x: fill(x) if isinstance(x, _Slot) else x, args)


def _run_on_cpu(func: Any, args: Any, kwargs: dict[str, Any], *reals: torch.Tensor) -> Any:
    """``func`` run again on the CPU, ``args`` and ``kwargs`` holding slots (:class:`_Slot`)
    of the values ``reals`` (copies of them where ``func`` changes its arguments: the values
    are others' too)."""
    writes = func._schema.is_mutable

    def fill(slot: _Slot) -> torch.Tensor:
        return reals[slot.index].clone() if writes else reals[slot.index]

    kwargs = {k: "cpu" if k == "device" else v for k, v in kwargs.items()}
    return func(*_filled(args, fill), **_filled(kwargs, fill))


def _output(index: int | None, shape: torch.Size, out: Any) -> torch.Tensor | None:
    """An op's output ``index`` (``None``: its only one) of those ``_run_on_cpu`` made,
    where it has the meta output's shape."""
    real = out if index is None else out[index]
    return real if isinstance(real, torch.Tensor) and real.shape == shape else None


def _written_through(shape: torch.Size, stride: tuple[int, ...], offset: int,
                     base_stride: tuple[int, ...], was: torch.Tensor,
                     now: torch.Tensor) -> torch.Tensor | None:
    """A base's values after its view (``shape``, ``stride``, ``offset``) took ``now``:
    where the values ``was`` are laid out as the base, else not known."""
    if was.stride() != base_stride or was.storage_offset() != 0:
        return None
    changed = was.clone()
    changed.as_strided(shape, stride, offset).copy_(now)
    return changed


def _constant_on_cpu(func: Any, args: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    """A constant factory run on the CPU, its meta arguments (slots, :class:`_Slot`)
    empty tensors there of their shapes and dtypes: it reads none of their values."""
    real_args = _filled(args, lambda slot: torch.empty(slot.shape, dtype=slot.dtype))
    return cast(torch.Tensor, func(*real_args, **{**kwargs, "device": "cpu"}))


# NOTE [ Following the batch's values ]
#     On meta a tensor has a shape and no values, but the batch the meta copy was made
#     from has values, and so has a tensor made of known values (``arange``, ``torch.full``
#     or ``zeros_like`` of integers or booleans, a 0-d constant, ``torch.ones`` of any
#     dtype: not a gradient's floating-point zeros in backward, which no model reads).
#     Their values are followed through every op the model runs on them whose tensor
#     arguments all have known values: the op is run again on those values on the CPU
#     (outside every mode, so that nothing of it is counted) and its result is the
#     output's values. They are made only when read (:class:`_Lazy`): most are never
#     read, and a batch may be larger than this machine's step (a model's own casts and
#     masks of pixel values would be work and memory of that size). So every tensor of
#     the batch is followed, whatever its size: ids, labels, masks, image grids, and the
#     data itself (Idefics3 drops the padding images of a batch, all zeros, by their
#     pixels' values; until 2026-11-29, sixteenth session, only tensors up to 2**22
#     elements were, made as they ran, and a batch of six 512 x 512 images was refused).
#     What a value is made from holds the values it reads, not meta tensors
#     (:class:`_Slot`): a meta tensor kept alive is counted. Where an op needs values,
#     they are read from there:
#       * ``.item()``, ``bool()`` and ``.tolist()`` (a copy to the CPU) of a known tensor
#         give its values: Wav2Vec2's check of its labels against the vocabulary, its CTC
#         loss's label lengths, Qwen2-VL's ``image_grid_thw.tolist()``;
#       * ops whose output's shape depends on values (``nonzero``, ``masked_select``,
#         ``unique``, ``repeat_interleave``) make meta outputs of the shapes they have on
#         the values, and so does ``x[mask]`` or ``x.masked_select(mask)`` where only the
#         mask's values are known (the positions a mask selects, on the model's unknown
#         activations).
#     Mask builders and packed-sequence tests read the same values (Transformers' sdpa
#     mask, NOTE [ Hugging Face models on meta ]). Copies and casts are the common case; a
#     Decision Transformer stacks its mask three times (states, actions, returns) and
#     reshapes it. An op changing a tensor in place forgets the values of the tensor, of
#     its base and of their views, and gives the tensor its new ones where every argument
#     is known, and a view's base too where its values were known (Longformer marks its
#     global tokens with ``global_attention_mask[:, 0] = 1``, and writes them into a slice
#     of the mask Transformers built): a value is never stale, only unknown. A read of a
#     value that is not known (an activation's) is refused as before, naming the model's
#     line, unless it is a check (NOTE [ Checks of values on meta ]).
_CONSTANT_FACTORIES = frozenset(getattr(torch.ops.aten, name) for name in (
    "ones", "zeros", "full", "arange", "scalar_tensor", "ones_like", "zeros_like",
    "full_like", "new_ones", "new_zeros", "new_full", "eye", "linspace"))


def _batch_pairs(inputs: Any, given: Any) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """The batch's meta tensors with the real ones they were made from (and their keys
    in a mapping, else ""): a meta copy has the structure of the batch it was made from."""
    if isinstance(inputs, Mapping) and isinstance(given, Mapping):
        pairs: Iterator[tuple[str, Any, Any]] = (
            (str(key), meta, given.get(key)) for key, meta in inputs.items())
    else:
        metas, reals = flat_tensors(inputs), flat_tensors(given)
        if len(metas) != len(reals):
            return
        pairs = (("", meta, real) for meta, real in zip(metas, reals, strict=True))
    for key, meta, real in pairs:
        if isinstance(meta, torch.Tensor) and meta.is_meta and isinstance(real, torch.Tensor) \
                and not real.is_meta and real.shape == meta.shape:
            yield key, meta, real


def _bool_index(indices: Any) -> bool:
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _needs_values(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` cannot run on meta without values: it reads them
    (``_local_scalar_dense``), its output's shape depends on them, or it copies out of
    meta."""
    tags = func.tags
    return torch.Tag.data_dependent_output in tags or _copies_out(func, args, kwargs) or (
        torch.Tag.dynamic_output_shape in tags and func is not torch.ops.aten.index.Tensor)


def _copies_out(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    device = kwargs.get("device")
    return func is torch.ops.aten._to_copy.default and device is not None \
        and torch.device(device).type != "meta" and args[0].is_meta


def _on_meta_empty(real: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``real``'s shape, strides and dtype."""
    return _meta_like(real, None)


_MASK_API = ("AttentionMaskInterface", "sdpa_mask", "prepare_padding_mask",
             "_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


def _mask_utils() -> Any:
    """Transformers' ``masking_utils`` when it has what :class:`_MaskBuilder` calls, else
    ``None`` (an older or newer Transformers: masked batches then run unchanged)."""
    try:
        from transformers import masking_utils
    except ImportError:
        return None
    return masking_utils if all(hasattr(masking_utils, n) for n in _MASK_API) else None


class _MaskBuilder:
    """Transformers' ``sdpa_mask`` whose choice to skip the mask reads the real values
    of the mask's meta copy (NOTE [ Hugging Face models on meta ])."""

    def __init__(self, utils: Any, values: _Values, model: str) -> None:
        self.utils, self.values, self.model = utils, values, model
        self.sdpa_mask = utils.sdpa_mask  # Transformers' own (it is patched with this)

    def __call__(self, **kwargs: Any) -> Any:
        mask = kwargs.get("attention_mask")
        causal = kwargs.get("allow_is_causal_skip", True)
        bidirectional = kwargs.get("allow_is_bidirectional_skip", False)
        if isinstance(mask, torch.Tensor) and mask.is_meta and (causal or bidirectional):
            if self._skips(mask, kwargs, causal, bidirectional):
                return None
            kwargs = {**kwargs, "allow_is_causal_skip": False,
                      "allow_is_bidirectional_skip": False}
        return self.sdpa_mask(**kwargs)

    def _skips(self, mask: torch.Tensor, kwargs: dict[str, Any], causal: bool,
               bidirectional: bool) -> bool:
        real = self.values.value(mask)
        if real is None:
            raise RematError(
                f"{self.model} reads the values of an attention mask of shape "
                f"{tuple(mask.shape)} (to skip building a mask when no token is padded), "
                f"and on meta it has none: the batch's attention_mask is on meta, or the "
                f"model computed the mask. Pass the batch with a real attention_mask (on "
                f"the CPU; estimate makes the meta copy), leave attention_mask out if no "
                f"token is padded, or measure the step with autoremat.profile on a real "
                f"device")
        q_length, kv_length = kwargs["q_length"], kwargs["kv_length"]
        q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
        local = kwargs.get("local_size")
        with _disable_current_modes():  # CPU work of ours, not the step's
            padding = self.utils.prepare_padding_mask(real.to(torch.bool), kv_length,
                                                      kv_offset)
            return bool(
                (causal and self.utils._ignore_causal_mask_sdpa(
                    padding, q_length, kv_length, q_offset, kv_offset, local))
                or (bidirectional and self.utils._ignore_bidirectional_mask_sdpa(
                    padding, kv_length, local)))


def _is_transformers_model(model: nn.Module) -> bool:
    """Whether a module of ``model`` has a Transformers config (one that names its
    attention implementation)."""
    return any(hasattr(getattr(module, "config", None), "_attn_implementation")
               for module in model.modules())


@contextmanager
def _packed_on_meta(utils: Any, values: _Values) -> Iterator[None]:
    """Transformers' test for packed sequences, which reads the values of ``position_ids``,
    run on the real values of ``position_ids`` on ``meta`` where they are known (the
    batch's own), its answer made on ``meta``; "not packed" where they are not (the
    model's own, a range per row). NOTE [ Hugging Face models on meta ]. Process-wide
    while inside, like :func:`sdpa_as_on`."""
    original = getattr(utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if not position_ids.is_meta:
            return original(position_ids)
        real = values.value(position_ids)
        if real is None:
            return None
        with _disable_current_modes():  # CPU work of ours, not the step's
            found = original(real)
        return None if found is None else torch.empty_like(found, device="meta")

    utils.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        utils.find_packed_sequence_indices = original


@contextmanager
def _hf_attention_on_meta(model: nn.Module, values: _Values) -> Iterator[None]:
    """Build a Transformers model's attention masks on meta as on a device, ``"sdpa"``'s
    choice to skip a mask read from the real masks ``values`` follows from the caller's
    batch (NOTE [ Hugging Face models on meta ])."""
    utils: Any = _mask_utils()
    if utils is None or not _is_transformers_model(model):
        yield
        return
    mapping = utils.AttentionMaskInterface._global_mapping
    original = mapping.get("sdpa")
    with ExitStack() as stack:
        stack.enter_context(_packed_on_meta(utils, values))
        builder = _MaskBuilder(utils, values, type(model).__name__)
        mapping["sdpa"] = builder
        utils.sdpa_mask = builder  # eager's masks call it by name (masking_utils.eager_mask)
        try:
            yield
        finally:
            utils.sdpa_mask = builder.sdpa_mask
            if original is None:
                mapping.pop("sdpa", None)
            else:
                mapping["sdpa"] = original


class _MadeOnMeta(TorchFunctionMode):
    """``torch.tensor(data, device=x.device)`` on meta makes a tensor without data, and
    without an op a dispatch mode sees: its values are made on the CPU beside it (NOTE
    [ Following the batch's values ]; Qwen2-VL's vision tower makes its merge sizes so,
    and reads them with ``.tolist()``). Not on in a checkpoint's recompute in backward
    (a function mode), where the tensor is made without values."""

    _MAKERS = (torch.tensor, torch.as_tensor)

    def __init__(self, values: _Values) -> None:
        super().__init__()
        self.values = values

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func not in self._MAKERS or device is None or torch.device(device).type != "meta" \
                or flat_tensors((args, kwargs)):
            return func(*args, **kwargs)
        made = func(*args, **kwargs)  # as without this mode: no op is dispatched (one
        # here and none in a checkpoint's recompute, where this mode is not on, would
        # be other ops than the forward's to a selective block)
        with _disable_current_modes():  # (not made meta by _CpuFactoriesOnMeta)
            self.values._set(made, func(*args, **{**kwargs, "device": "cpu"}))
        return made


@contextmanager
def _no_padding_check(model: nn.Module) -> Iterator[None]:
    """Transformers' check for padding without an attention mask
    (``warn_if_padding_and_no_attention_mask``, which many encoders call: Longformer,
    BigBird, Funnel, ConvBERT, RemBERT, ...) reads the first and last token ids, which
    meta tensors do not have: it is skipped on meta. It only warns, and the model's
    real steps warn as before."""
    if not _is_transformers_model(model):
        yield
        return
    from transformers import PreTrainedModel

    original = PreTrainedModel.warn_if_padding_and_no_attention_mask

    def check(self: Any, input_ids: Any, attention_mask: Any) -> None:
        if isinstance(input_ids, torch.Tensor) and input_ids.is_meta:
            return None
        return original(self, input_ids, attention_mask)  # type: ignore[no-any-return]

    PreTrainedModel.warn_if_padding_and_no_attention_mask = check  # type: ignore[method-assign]
    try:
        yield
    finally:
        PreTrainedModel.warn_if_padding_and_no_attention_mask = original  # type: ignore[method-assign]


@contextmanager
def refused_on_meta(model: nn.Module, given: Any) -> Iterator[None]:
    """Inside, a step of ``model`` (on meta, made from the batch ``given``) that fails for
    meta's sake ("Cannot copy out of meta tensor", "... with Meta tensors") is refused with
    :func:`meta_refusal`; any other error passes as it came."""
    try:
        yield
    except (RuntimeError, NotImplementedError) as exc:
        if "meta" not in str(exc).lower():
            raise
        raise meta_refusal(model, exc, given) from exc


def meta_refusal(model: nn.Module, exc: BaseException, given: Any = None) -> RematError:
    """The error to raise when ``model``'s step failed on ``meta`` with ``exc``: why, and
    what to do (for a mixture of experts routed by a loop over the experts hit, how to
    estimate it anyway; NOTE [ Grouped matmuls on meta ]; a batch ``given`` on meta, whose
    values no forward can read: NOTE [ Following the batch's values ])."""
    batch_on_meta = any(t.is_meta for t in flat_tensors(given))
    what = type(model).__name__
    eager = sorted({type(m).__name__ for m in model.modules()  # Transformers' experts
                    if getattr(getattr(m, "config", None), "_experts_implementation", None)
                    == "eager" and hasattr(m, "num_experts") and hasattr(m, "has_gate")})
    if eager:
        return RematError(
            f"{what} cannot run on fake (meta) tensors: its mixture-of-experts layers "
            f"({', '.join(eager)}) run with experts_implementation='eager', a loop over the "
            f"experts the router picked, whose shapes depend on the routing ({exc}). "
            f"Estimate the model with model.set_experts_implementation('grouped_mm') "
            f"(Transformers' default, whose memory does not depend on the routing), or "
            f"measure the eager experts with autoremat.profile on a real device")
    if any(frame.filename.endswith("masking_utils.py")
           for frame in traceback.extract_tb(exc.__traceback__)):
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        return RematError(
            f"{what} cannot run on fake (meta) tensors: Transformers read tensor values "
            f"while building its attention mask for attn_implementation={impl!r} (without "
            f"an attention_mask in the batch, it checks whether position_ids pack several "
            f"sequences: {exc}). Estimate it with attn_implementation='sdpa' (whose masks "
            f"estimate runs on meta), or with the batch's attention_mask given on the CPU, "
            f"or measure it with autoremat.profile on a real device")
    if "is not on the expected device" in str(exc) or "on the same device" in str(exc):
        return RematError(
            f"{what} cannot run on fake (meta) tensors: {exc}. A tensor on a real device "
            f"meets the model's meta tensors{_where_read(exc)}, where the estimate cannot "
            f"move it to meta: outside torch's operators (whose real arguments it moves to "
            f"meta), such as a check of devices in Python or an extension's kernel called "
            f"directly. Make the tensor on the "
            f"input's device (device=x.device), or measure the model with autoremat.profile "
            f"on a real device")
    batch = (" Its batch was given on meta, so none of its values is known either: give "
             "the batch on the CPU (the estimate follows what the forward reads of it: "
             "labels, masks, image grids; a factory for autoremat doctor runs under "
             "torch.device('meta'), so make its batch with device='cpu')."
             if batch_on_meta else "")
    return RematError(
        f"{what} cannot run on fake (meta) tensors: {exc}. Its forward reads tensor values "
        f"(.item(), a Python if on a tensor, shapes that depend on values such as "
        f"nonzero's){_where_read(exc)}, which fake tensors do not have: measure it with "
        f"autoremat.profile on a real device, or make the forward independent of the "
        f"values.{batch}")


_LIBRARIES = (os.sep + "torch" + os.sep, os.sep + "autoremat" + os.sep)


def _models_own(filename: str) -> bool:
    """Whether code in ``filename`` is the model's own: outside torch and autoremat."""
    return not any(part in filename for part in _LIBRARIES)


def _where_read(exc: BaseException) -> str:
    """`` at <file>:<line>: <code>``: the model's own line (the last frame outside torch
    and autoremat) where ``exc`` came from, or "" where there is none."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if _models_own(frame.filename):
            code = f": {frame.line.strip()}" if frame.line else ""
            return f" at {os.path.basename(frame.filename)}:{frame.lineno}{code}"
    return ""


@contextmanager
def step_as_on(device: str | torch.device, model: nn.Module, inputs: Any,
               given: Any = None) -> Iterator[list[str]]:
    """Inside, a training step of the ``meta`` ``model`` on ``inputs`` runs as it would on
    ``device``: the KV cache turned off as ``profile`` does (``training_config``), SDPA
    as the device runs it (NOTE [ Attention on meta ]), dropout likewise (NOTE [ Dropout
    on meta ]), grouped matmuls and a few ops' strides (NOTE [ Grouped matmuls on meta ],
    NOTE [ Strides on meta ]) and Transformers' attention masks (NOTE [ Hugging Face models on
    meta ], reading the real masks of ``given``, the batch ``inputs`` was made from).
    Yields notes for the estimate. Everything is put back on exit."""
    with ExitStack() as stack:
        notes = stack.enter_context(training_config(model))
        stack.enter_context(sdpa_as_on(device))
        stack.enter_context(dropout_as_on(device))
        stack.enter_context(group_norm_as_on(device))
        stack.enter_context(kernels_on_meta(device))
        values = stack.enter_context(_Values(inputs, given))
        stack.enter_context(_MadeOnMeta(values))
        stack.enter_context(_hf_attention_on_meta(model, values))
        stack.enter_context(_no_padding_check(model))
        stack.enter_context(_CpuFactoriesOnMeta(values))
        yield notes


# NOTE [ Tensors a forward makes on the CPU ]
#     A forward may make a tensor without naming a device (``torch.arange(T)`` for
#     positions, ``torch.tensor(scale)``, a mask from ``torch.ones``): on a real device
#     that is the CPU, and the model moves it (``.to(x.device)``) or torch treats a 0-d
#     one as a scalar. On meta it stays a CPU tensor beside meta ones, and the step fails
#     ("Tensor on device cpu is not on the expected device meta"). While an estimate runs,
#     torch's factory functions called without a device, or for the CPU, make meta
#     tensors: the same shapes and dtypes, which is all the estimate reads. A forward that
#     reads such a tensor's values still cannot run on meta, and says so.
_FACTORIES = frozenset({"arange", "scalar_tensor", "ones", "zeros", "empty", "full", "rand",
                        "randn", "randint", "linspace", "eye", "empty_strided"})


# NOTE [ Checks of values on meta ]
#     A forward may check a condition on values and raise if it fails:
#     ``torch._check_tensor_all_with`` (Transformers' ``torch_compilable_check``, which
#     LLaVA and PaliGemma call to check that the image tokens match the image features).
#     It reads the condition through ``aten._is_all_true`` and ``.item()``, which meta
#     tensors cannot answer. While an estimate runs the condition is taken to hold: a
#     check only raises or passes, and the inputs are the user's, which the model checks
#     again on a real step. So is a boolean tensor read in a check written in Python
#     (:func:`_value_that_passes`): an ``assert`` statement (ProphetNet's ``assert
#     torch.all(shifted_input_ids >= 0).item()``, I-BERT's), and an ``if`` whose body
#     only raises, warns or logs (Wav2Vec2's CTC loss: ``if labels is not None and
#     labels.max() >= self.config.vocab_size: raise ValueError(...)``). The model's own
#     line is found on the Python stack and parsed; the read takes the value that lets the
#     check pass: true in an assert, false in an ``if`` that raises, the other way under
#     a ``not``. Where the read's line holds parts under an odd and an even number of
#     ``not``s, the value cannot be told, and a read anywhere else (``if mask.any():
#     y = y * 2``) decides what runs: the estimate refuses both, naming the line.


# NOTE [ Real tensors from outside the step ]
#     A loss often reads tensors the batch does not hold: ``loss_fn=lambda out:
#     F.cross_entropy(out.flatten(0, 1), labels.flatten())`` with the labels of a loop's
#     own (torchtitan's, a plain PyTorch loop's), a class-weight tensor, a mask. The
#     estimate moves the model and its inputs to meta, not what a loss_fn closes over, and
#     such an op met a real tensor beside meta ones ("Tensor on device meta is not on the
#     expected device cpu"). Where an op fails on that, its real tensors go to meta and it
#     runs again: their shapes and dtypes are all it reads, and they were made before the
#     step, as on the device, so they are not the step's memory (the copies are made
#     below the storage tracker, which does not count them). An op that runs with a real
#     tensor beside meta ones (a CPU index, a 0-d CPU scalar) is left as it is.


def _real_beside_meta(args: Any, kwargs: Any) -> bool:
    tensors = flat_tensors((args, kwargs))
    return any(t.is_meta for t in tensors) and any(not t.is_meta for t in tensors)


def _device_mismatch(exc: RuntimeError) -> bool:
    text = str(exc)
    return "is not on the expected device" in text or "on the same device" in text


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_meta else tensor.to("meta")


def _value_that_passes() -> bool | None:
    """The value a boolean tensor read on the model's own line running now (the innermost
    frame outside torch and autoremat) takes for the check it is in to pass: None where
    the line is in no check (NOTE [ Checks of values on meta ])."""
    frame = sys._getframe(1)
    while frame is not None and not _models_own(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return None
    line = frame.f_lineno
    spans = [check for check in _checks(frame.f_code) if check[0] <= line <= check[1]]
    if not spans:
        return None
    _, _, passes, leaves = min(spans, key=lambda check: check[1] - check[0])
    negated = {odd for first, last, odd in leaves if first <= line <= last}
    return passes != negated.pop() if len(negated) == 1 else None


_Check = tuple[int, int, bool, tuple[tuple[int, int, bool], ...]]
_NOTICES = ("warnings", "logger", "logging", "log")  # who warns or logs


@functools.lru_cache(maxsize=256)
def _checks(code: types.CodeType) -> tuple[_Check, ...]:
    """The checks in ``code``'s function (none where its source cannot be read): for each
    ``assert`` statement and each ``if`` whose body only raises, warns or logs, its test's
    first and last line, whether the test passes when true (an assert) or false, and the
    line spans of the test's parts joined by ``and``/``or``, each with whether it is under
    an odd number of ``not``s."""
    try:
        lines, start = inspect.getsourcelines(code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return ()
    offset = max(start, 1) - 1

    def leaves(node: ast.expr, odd: bool = False) -> Iterator[tuple[int, int, bool]]:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield from leaves(node.operand, not odd)
        elif isinstance(node, ast.BoolOp):
            for value in node.values:
                yield from leaves(value, odd)
        else:
            yield node.lineno + offset, (node.end_lineno or node.lineno) + offset, odd

    def check(test: ast.expr, passes: bool) -> _Check:
        return (test.lineno + offset, (test.end_lineno or test.lineno) + offset, passes,
                tuple(leaves(test)))

    return tuple(check(node.test, isinstance(node, ast.Assert)) for node in ast.walk(tree)
                 if isinstance(node, ast.Assert)
                 or (isinstance(node, ast.If) and not node.orelse and _only_raises(node.body)))


def _only_raises(body: list[ast.stmt]) -> bool:
    """Whether ``body`` ends in ``raise`` or a warning, and does nothing else but warn,
    log and name its message."""
    return bool(body) and (isinstance(body[-1], ast.Raise) or _notice(body[-1])) \
        and all(_notice(stmt) or isinstance(stmt, ast.Assign) for stmt in body[:-1])


def _notice(stmt: ast.stmt) -> bool:
    """Whether ``stmt`` is a call that warns or logs: ``warnings.warn(...)``,
    ``logger.warning_once(...)``, ``logging.info(...)``, ``warn(...)``."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return False
    *owners, name = ast.unparse(stmt.value.func).lower().split(".")
    return name.startswith("warn") or any(owner in _NOTICES for owner in owners)


class _CpuFactoriesOnMeta(TorchDispatchMode):
    """Factory ops for the CPU make meta tensors, and a tensor ``torch.tensor`` made on
    the CPU is moved to meta (NOTE [ Tensors a forward makes on the CPU ]); a check of
    values passes where ``values`` does not know them (NOTE [ Checks of values on meta ]).
    A dispatch mode, so that it also holds in a checkpoint's recompute in backward."""

    def __init__(self, values: _Values) -> None:
        super().__init__()
        self.values = values

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        name = func.overloadpacket.__name__
        if name in _FACTORIES and (kwargs.get("device") is None
                                   or torch.device(kwargs["device"]).type == "cpu"):
            kwargs["device"] = torch.device("meta")
        unknown = name in ("_is_all_true", "_local_scalar_dense") and args[0].is_meta \
            and self.values.value(args[0]) is None  # NOTE [ Checks of values on meta ]
        if unknown and name == "_is_all_true":
            return torch.ones((), dtype=torch.bool)
        if unknown and args[0].dtype == torch.bool:
            passes = _value_that_passes()
            if passes is not None:
                return passes
        try:
            out = func(*args, **kwargs)
        except RuntimeError as exc:
            real = _real_beside_meta(args, kwargs)
            if not real or not _device_mismatch(exc):
                raise
            # NOTE [ Real tensors from outside the step ]: the op checked devices before
            # anything ran, so it runs again with them on meta
            args, kwargs = map_tensors(_on_meta, (args, kwargs))
            out = func(*args, **kwargs)
        if name == "lift_fresh" and isinstance(out, torch.Tensor) \
                and out.device.type == "cpu":
            meta = out.to("meta")
            self.values._set(meta, out)  # NOTE [ Following the batch's values ]
            return meta
        return out
