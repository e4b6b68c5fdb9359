"""``estimate``: the peak memory of a training step, measured on fake (``meta``) tensors.

The same instrumented step :func:`autoremat.profile` runs, but on the ``meta`` device,
where every op computes shapes and allocates nothing. So the peak of a 7B-parameter
model's step can be measured on a laptop, for a device that is not there (``cuda`` at
``bf16``). To it we add what lives outside the step: parameters, buffers, the batch,
the optimizer's state (measured by running the real ``torch.optim`` class on ``meta``)
and the optimizer step's own temporaries.

NOTE [ Attention on meta ]
    ``F.scaled_dot_product_attention`` picks a kernel by device: on ``meta`` PyTorch
    always falls back to the math path, which materialises the (B, heads, T, T) scores
    that the fused kernels never store. A Llama step would be overestimated several-fold
    at long sequences. While estimating, ``F.scaled_dot_product_attention`` is replaced
    by a function that runs the kernel the target device would run: for ``cpu`` it asks
    PyTorch's own CPU selector (``torch._fused_sdp_choice`` on tiny CPU stand-ins with
    the same sizes, dtypes and strides that matter); for ``cuda`` it follows PyTorch's
    CUDA priority
    (flash for fp16/bf16 without a mask, else memory-efficient, else math), calling the
    CUDA ops' meta kernels, which save the same output and log-sum-exp as on a GPU.
    (A ``TorchFunctionMode`` would be tidier, but torch-function modes are not active
    inside autograd's backward, where checkpointing recomputes the forward: the
    recompute would take the math path and fail checkpoint's metadata check.)

NOTE [ Hugging Face models on meta ]
    Transformers builds attention masks by reading tensor values (it checks whether
    ``position_ids`` pack several sequences, whether a padding mask is all ones), which
    ``meta`` tensors cannot answer. For a model configured with ``"sdpa"`` and a batch
    without ``attention_mask``, the estimate runs it under ``"autoremat_sdpa"``:
    Transformers' own SDPA function registered under a name that has no mask builder, so
    SDPA gets no mask and ``is_causal`` (``True`` for decoders, ``False`` for BERT) --
    exactly what ``"sdpa"`` passes for an unpadded, unpacked batch. A batch with an
    ``attention_mask`` runs unchanged and may not run on ``meta``.

NOTE [ Total peak ]
    A training iteration has two peaks; the larger one is ``total_peak_bytes``::

        resting = parameters + buffers + optimizer state + batch
        forward/backward:  resting + step_peak_bytes        (step peak includes .grad)
        optimizer.step():  resting + grad_bytes + optimizer_step_bytes

    ``optimizer_step_bytes`` are the temporaries of a steady-state ``step()`` (the
    ``foreach`` AdamW used on CUDA holds one parameter-sized temporary).

Known limitations:
    * Code that bound ``scaled_dot_product_attention`` at import
      (``from torch.nn.functional import ...``) bypasses NOTE [ Attention on meta ] and
      is estimated with the math kernel (an overestimate).
    * Allocator effects are not modelled: CUDA's caching allocator rounds blocks up and
      fragments, and kernels' workspaces (cuBLAS, flash-attention backward's fp32
      accumulators) are invisible to storage accounting. Keep some headroom.
    * A model that reads tensor values in forward (``.item()``, data-dependent shapes)
      cannot run on ``meta``.
    * Parameters that are views of one storage (rare) are counted once per parameter
      when a real model is converted to ``meta``.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from .blocks import BlockSpec, resolve_blocks
from .errors import BudgetError, RematError, did_you_mean
from .memory import MemoryTracker, track_memory
from .profile import op_kind, profile
from .step import LossFn, describe_inputs, preserved_state, run_step, unique_storage_bytes
from .tape import Tape, dump_json
from .units import format_bytes, parse_budget, parse_size
from .wrap import checkpointed

__all__ = [
    "OPTIMIZERS",
    "Estimate",
    "LiveTensor",
    "StepPeak",
    "estimate",
    "measure_step",
    "optimizer_memory",
    "parse_dtype",
    "register_hf_attention",
    "sdpa_as_on",
    "to_meta",
]

ESTIMATE_SCHEMA_VERSION = 1
LOSS_CHUNKS = 8  # slices of the head and loss assumed by the chunked-loss figures

_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}  # fmt: skip

# name -> (optimizer class name in torch.optim, extra constructor arguments)
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw": ("AdamW", {}),  # exp_avg and exp_avg_sq: 2x the trainable parameters
    "adam": ("Adam", {}),  # the same two states
    "sgd": ("SGD", {}),  # no state
    "sgd-momentum": ("SGD", {"momentum": 0.9}),  # one momentum buffer: 1x
    "rmsprop": ("RMSprop", {}),  # square_avg: 1x
    "adagrad": ("Adagrad", {}),  # sum: 1x
}  # (Adafactor reads parameter norms with .item() in step(), which meta cannot answer)


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


# --- attention as the target device would run it (NOTE [ Attention on meta ]) --------------

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


# --- one tracked step with every storage attributed to a module -------------------------


@dataclass(frozen=True)
class LiveTensor:
    """A storage alive at the step's peak."""

    nbytes: int
    op: str  # the ATen op that created it, e.g. "aten.mm.default"
    where: str  # the module whose forward created it ("lm_head"), or "backward: <block>"
    kind: str  # "activation" (made in forward), "gradient" or "temporary" (backward)


@dataclass
class _Run:
    mem: MemoryTracker
    where: list[str]  # per record of mem.records
    backward_event: int
    head: tuple[int, int] | None  # events from the last block's forward end to its backward


@dataclass
class _MarkWalk:
    """Replays the marks of a tracked step in event order: the forward call stack, the
    phase, the block whose backward is running, and when each block ended."""

    marks: list[tuple[int, str]]
    next: int = 0
    phase: str = "forward"
    bwd_block: str = "head and loss"  # backward before the last block's is the head's
    modules: list[str] = field(default_factory=list)
    first_exit: dict[str, int] = field(default_factory=dict)
    first_bwd: dict[str, int] = field(default_factory=dict)

    def advance(self, until: int) -> None:
        """Apply the marks made before event ``until``."""
        while self.next < len(self.marks) and self.marks[self.next][0] < until:
            event, label = self.marks[self.next]
            kind, _, name = label.partition(":")
            if kind == "enter":
                self.modules.append(name)
            elif kind == "exit":
                if self.modules and self.modules[-1] == name:
                    self.modules.pop()
                self.first_exit.setdefault(name, event)
            elif kind == "bwd":
                self.bwd_block = name
                self.first_bwd.setdefault(name, event)
            elif label == "backward":
                self.phase = "backward"
            self.next += 1


def _tracked_step(model: nn.Module, inputs: Any, loss_fn: LossFn | None, names: list[str],
                  *, checkpoint_all: bool) -> _Run:
    root = type(model).__name__
    block_set = set(names)
    with ExitStack() as stack, track_memory() as mem:
        for qualname, module in model.named_modules():
            def pre(module: nn.Module, args: Any, qualname: str = qualname) -> None:
                mem.mark(f"enter:{qualname}")

            def post(module: nn.Module, args: Any, output: Any, qualname: str = qualname) -> None:
                mem.mark(f"exit:{qualname}")
                if qualname in block_set and torch.is_grad_enabled():
                    out = next((t for t in _tensors(output) if t.requires_grad), None)
                    if out is not None:
                        out.register_hook(lambda g, n=qualname: mem.mark(f"bwd:{n}"))

            stack.callback(module.register_forward_pre_hook(pre).remove)
            stack.callback(module.register_forward_hook(post).remove)
        if checkpoint_all:
            stack.enter_context(checkpointed(model, names))
        run_step(model, inputs, loss_fn, between=lambda: mem.mark("backward"))
    for p in model.parameters():
        p.grad = None  # inside preserved_state: the caller's gradients come back after

    walk = _MarkWalk(list(mem.marks))  # in event order already; never sort them
    where: list[str] = []
    for record in mem.records:
        walk.advance(record.born)
        if walk.phase == "forward":
            where.append((walk.modules[-1] or root) if walk.modules else "(outside the model)")
        else:
            # No "recompute" label: checkpoint stops recomputing early, so the forward hooks
            # that would close a recomputed module never run.
            where.append(f"backward: {walk.bwd_block}")
    walk.advance(len(mem.levels) + 1)
    backward_event = next(e for e, label in walk.marks if label == "backward")
    last = names[-1]
    head = (walk.first_exit[last], walk.first_bwd[last]) \
        if last in walk.first_exit and last in walk.first_bwd else None
    return _Run(mem=mem, where=where, backward_event=backward_event, head=head)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if hasattr(obj, "__dataclass_fields__") or hasattr(obj, "to_tuple"):
        obj = list(vars(obj).values()) if hasattr(obj, "__dataclass_fields__") else \
            list(obj.to_tuple())
    found: list[torch.Tensor] = []
    tree_map(lambda t: found.append(t) if isinstance(t, torch.Tensor) else None, obj)
    return found


def _live_at_peak(run: _Run, top: int) -> tuple[LiveTensor, ...]:
    peak = run.mem.peak_event
    live = []
    for record, where in zip(run.mem.records, run.where, strict=True):
        if record.born <= peak and (record.died is None or record.died > peak):
            kind = ("activation" if not record.backward
                    else "gradient" if record.died is None else "temporary")
            live.append(LiveTensor(record.nbytes, record.op, where, kind))
    live.sort(key=lambda t: -t.nbytes)
    return tuple(live[:top])


def _saved(run: _Run) -> list[tuple[str, str, int]]:
    """(where, op kind, bytes) of storages made in forward and alive when backward starts."""
    out = []
    for record, where in zip(run.mem.records, run.where, strict=True):
        if (record.born <= run.backward_event and not record.backward
                and (record.died is None or record.died > run.backward_event)):
            out.append((where, op_kind(record.op), record.nbytes))
    return out


def chunked_loss_peak(run: _Run, chunks: int) -> int | None:
    """The step peak if the head and loss (logits and their gradient) ran in ``chunks``
    slices; ``None`` when the step has no head window. Gradients of the head's weights
    do not shrink; everything else made in the window is assumed to scale with the slice."""
    if run.head is None:
        return None
    start, stop = run.head
    levels = run.mem.levels
    window_peak_event = max(range(start, stop + 1), key=lambda e: levels[e])
    grads = sum(r.nbytes for r in run.mem.records
                if start < r.born <= window_peak_event and r.backward and r.died is None)
    head_rise = levels[window_peak_event] - levels[start]
    chunked = levels[start] + grads + (head_rise - grads) // chunks
    outside = max([*levels[:start + 1], *levels[stop:]])
    return max(outside, chunked)


@dataclass(frozen=True)
class StepPeak:
    """One forward+backward measured on ``meta`` (see :func:`measure_step`)."""

    peak_bytes: int  # the step peak
    grads_at_peak_bytes: int  # gradients alive at that peak
    chunked_loss_peak_bytes: int | None  # the peak with the head and loss in 8 chunks


def measure_step(model: nn.Module, inputs: Any, *, loss_fn: LossFn | None = None,
                 blocks: BlockSpec = None, device: str | torch.device | None = None,
                 dtype: torch.dtype | str | None = None,
                 checkpoint_all: bool = False) -> StepPeak:
    """Just the step peak on ``meta`` (two passes cheaper than :func:`estimate`), with every
    block checkpointed or none; for re-measuring at another batch size.

    Example:
        >>> import autoremat
        >>> model, inputs = autoremat.zoo.build("mlp", device="meta", batch_size=8)
        >>> measure_step(model, inputs).peak_bytes > 0
        True
    """
    target = torch.device(_resolve_device(model, device)).type
    model, inputs = to_meta(model, inputs, parse_dtype(dtype))
    names = resolve_blocks(model, blocks)
    with preserved_state(model), sdpa_as_on(target), _hf_attention_without_masks(model, inputs):
        run = _tracked_step(model, inputs, loss_fn, names, checkpoint_all=checkpoint_all)
    return StepPeak(peak_bytes=run.mem.peak_bytes,
                    grads_at_peak_bytes=run.mem.breakdown["gradients"],
                    chunked_loss_peak_bytes=chunked_loss_peak(run, LOSS_CHUNKS))


# --- the optimizer, measured on meta -----------------------------------------------------


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


# --- the result --------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """What one training step will need, measured on fake tensors. ``print(est)`` shows a
    breakdown; all memory figures are bytes on the estimated device."""

    model: str  # class name
    inputs: str  # shapes and dtypes of the batch (after the dtype cast)
    device: str  # the device estimated, e.g. "cuda"
    dtype: str | None  # the dtype floating parameters and inputs were cast to, if any
    step_peak_bytes: int  # forward+backward peak, no checkpointing (includes .grad)
    ckpt_step_peak_bytes: int  # the same with every block checkpointed
    peak_breakdown: dict[str, int]  # activations / gradients / temporaries at the step peak
    ckpt_peak_breakdown: dict[str, int]  # the same, every block checkpointed
    param_count: int  # number of parameters (unique)
    param_bytes: int  # all parameters
    trainable_param_bytes: int
    buffer_bytes: int
    input_bytes: int  # the batch
    grad_bytes: int  # one gradient per trainable parameter, in its dtype
    optimizer: str | None  # name, "<n> bytes" or None
    optimizer_bytes: int  # optimizer state
    optimizer_step_bytes: int  # temporaries of optimizer.step() (steady state)
    activation_bytes: int  # made in forward, alive when backward starts
    activations_by_block: dict[str, int]  # per block, plus "(outside blocks)"
    activations_by_kind: dict[str, int]  # by the kind of op that made them
    largest_tensors: tuple[LiveTensor, ...]  # the biggest storages alive at the step peak
    head_chunked_step_peak_bytes: int | None  # step peak with the loss in 8 chunks
    ckpt_head_chunked_step_peak_bytes: int | None  # the same, every block checkpointed
    step_fwd_flops: int
    step_bwd_flops: int
    ckpt_recompute_flops: int  # extra forward FLOPs with every block checkpointed
    budget_bytes: int | None = None  # the step budget a plan was asked for
    strategy: str | None = None
    plan_peak_bytes: int | None = None  # the plan's predicted step peak
    plan_recompute_flops: int | None = None
    throughput_flops: float | None = None  # FLOP/s the user said the device sustains
    notes: tuple[str, ...] = ()
    tape: Tape | None = field(default=None, repr=False, compare=False)
    plan: Any = field(default=None, repr=False, compare=False)

    # -- derived figures -------------------------------------------------------------
    @property
    def step_flops(self) -> int:
        return self.step_fwd_flops + self.step_bwd_flops

    @property
    def resting_bytes(self) -> int:
        """Held for the whole iteration: parameters, buffers, optimizer state, the batch."""
        return self.param_bytes + self.buffer_bytes + self.optimizer_bytes + self.input_bytes

    def total_for(self, step_peak: int) -> int:
        """Device peak of an iteration whose forward+backward peaks at ``step_peak``."""
        return self.resting_bytes + max(step_peak, self.grad_bytes + self.optimizer_step_bytes)

    @property
    def total_peak_bytes(self) -> int:
        """Device peak of one iteration without checkpointing (see NOTE [ Total peak ])."""
        return self.total_for(self.step_peak_bytes)

    @property
    def ckpt_total_peak_bytes(self) -> int:
        return self.total_for(self.ckpt_step_peak_bytes)

    @property
    def plan_total_peak_bytes(self) -> int | None:
        return None if self.plan_peak_bytes is None else self.total_for(self.plan_peak_bytes)

    @property
    def recompute_overhead(self) -> float | None:
        """The plan's extra FLOPs over the plain step's (0.25 = 25% more)."""
        if self.plan_recompute_flops is None or not self.step_flops:
            return None
        return self.plan_recompute_flops / self.step_flops

    @property
    def ckpt_recompute_overhead(self) -> float:
        return self.ckpt_recompute_flops / self.step_flops if self.step_flops else 0.0

    @property
    def step_seconds(self) -> float | None:
        """Step time at ``throughput_flops`` (FLOPs / throughput), when it was given."""
        return None if not self.throughput_flops else self.step_flops / self.throughput_flops

    @property
    def plan_step_seconds(self) -> float | None:
        if not self.throughput_flops or self.plan_recompute_flops is None:
            return None
        return (self.step_flops + self.plan_recompute_flops) / self.throughput_flops

    def with_plan(self, budget: int | str | None = None, strategy: str = "optimal", *,
                  max_memory: int | str | None = None) -> Estimate:
        """This estimate plus the plan the planner makes from its tape for ``budget`` (the
        step's) or ``max_memory`` (the whole device). See :func:`estimate`."""
        if self.tape is None:
            raise RematError("this estimate has no tape to plan from (it was loaded from JSON)")
        if (budget is None) == (max_memory is None):
            raise BudgetError("give exactly one of budget= (the step's own budget) or "
                              "max_memory= (the whole device, parameters included)")
        return _with_plan(self, self.tape, budget, max_memory, strategy)

    # -- output ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)
                                if f.name not in ("tape", "plan")}
        data["largest_tensors"] = [asdict(t) for t in self.largest_tensors]
        data["tape"] = self.tape.to_dict() if self.tape is not None else None
        for name in ("step_flops", "resting_bytes", "total_peak_bytes",
                     "ckpt_total_peak_bytes", "plan_total_peak_bytes", "recompute_overhead",
                     "ckpt_recompute_overhead", "step_seconds", "plan_step_seconds"):
            data[name] = getattr(self, name)
        data["plan"] = dataclasses.asdict(self.plan) if dataclasses.is_dataclass(self.plan) \
            and not isinstance(self.plan, type) else None
        data["schema_version"] = ESTIMATE_SCHEMA_VERSION
        return data

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """The JSON text (``schema_version`` included); with ``path``, written atomically."""
        return dump_json(self.to_dict(), path)

    def __str__(self) -> str:
        return _render(self)


def _exact(n: int) -> str:
    return f"{format_bytes(n):>11}  ({n:,} B)"


def _flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def _breakdown(parts: dict[str, int]) -> str:
    return ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items() if v)


def _render(est: Estimate) -> str:
    dtype = f" at {est.dtype}" if est.dtype else ""
    opt = est.optimizer or "none"
    lines = [
        f"Estimate for {est.model} on {est.device}{dtype}; batch {est.inputs}",
        f"  parameters        {_exact(est.param_bytes)}  {est.param_count:,} parameters",
        f"  gradients         {_exact(est.grad_bytes)}",
        f"  optimizer state   {_exact(est.optimizer_bytes)}  {opt}",
        f"  buffers           {_exact(est.buffer_bytes)}",
        f"  batch             {_exact(est.input_bytes)}",
        f"  step peak         {format_bytes(est.step_peak_bytes):>11}  forward+backward, "
        f"no checkpointing ({_breakdown(est.peak_breakdown)})",
        f"  all checkpointed  {format_bytes(est.ckpt_step_peak_bytes):>11}  every block "
        f"recomputed, +{100 * est.ckpt_recompute_overhead:.1f}% FLOPs",
        f"  optimizer step    {format_bytes(est.optimizer_step_bytes):>11}  temporaries of "
        f"step(), with the gradients alive",
        f"  total peak        {format_bytes(est.total_peak_bytes):>11}  no checkpointing; "
        f"{format_bytes(est.ckpt_total_peak_bytes)} with every block checkpointed",
    ]
    if est.plan_peak_bytes is not None and est.plan_total_peak_bytes is not None:
        overhead = est.recompute_overhead or 0.0
        lines.append(f"  with the plan     {format_bytes(est.plan_total_peak_bytes):>11}  "
                     f"step peak {format_bytes(est.plan_peak_bytes)} (budget "
                     f"{format_bytes(est.budget_bytes or 0)}, {est.strategy}), recompute "
                     f"+{100 * overhead:.1f}% FLOPs")
    lines.append(f"Saved for backward: {format_bytes(est.activation_bytes)}")
    lines.append("  by op kind: " + ", ".join(
        f"{k} {format_bytes(v)}" for k, v in est.activations_by_kind.items()))
    lines.extend(_block_lines(est.activations_by_block))
    lines.append("Largest tensors alive at the step peak:")
    for t in est.largest_tensors:
        lines.append(f"  {format_bytes(t.nbytes):>11}  {t.kind:<10}  {t.op:<40}  {t.where}")
    timing = f"; {est.step_seconds:.3f} s at {_flops(est.throughput_flops or 0)}/s" \
        if est.step_seconds is not None else ""
    lines.append(f"FLOPs: forward {_flops(est.step_fwd_flops)}, backward "
                 f"{_flops(est.step_bwd_flops)}, step {_flops(est.step_flops)}{timing}")
    if est.plan_step_seconds is not None:
        lines.append(f"  with the plan: {est.plan_step_seconds:.3f} s")
    lines.extend(f"Note: {n}" for n in est.notes)
    return "\n".join(lines)


def _block_lines(by_block: dict[str, int]) -> list[str]:
    blocks = {k: v for k, v in by_block.items() if k != "(outside blocks)"}
    outside = by_block.get("(outside blocks)", 0)
    sizes = set(blocks.values())
    if len(blocks) > 6 and len(sizes) == 1:
        out = [f"  by block: {len(blocks)} blocks x {format_bytes(sizes.pop())}"]
    elif len(blocks) > 6:
        names = list(blocks)
        shown = [*names[:3], *names[-2:]]
        out = ["  by block: " + ", ".join(f"{n} {format_bytes(blocks[n])}" for n in shown[:3])
               + f", ... ({len(names) - 5} more) ..., "
               + ", ".join(f"{n} {format_bytes(blocks[n])}" for n in shown[3:])]
    else:
        out = ["  by block: " + ", ".join(f"{n} {format_bytes(v)}" for n, v in blocks.items())]
    out[0] += f"; outside blocks {format_bytes(outside)}"
    return out


# --- the entry point ---------------------------------------------------------------------


def _resolve_device(model: nn.Module, device: str | torch.device | None) -> str:
    if device is not None:
        try:
            return str(torch.device(device))
        except RuntimeError as exc:
            raise RematError(f"cannot read device {device!r}: {exc}") from None
    first = next(iter([*model.parameters(), *model.buffers()]), None)
    if first is None or first.is_meta:
        return "cuda"
    return str(first.device)


def _plan_module() -> Any:
    try:
        return importlib.import_module("autoremat.plan")  # the module, not autoremat.plan()
    except ImportError as exc:
        raise RematError("estimate(budget=...) needs the planner (autoremat.plan), which this "
                         f"installation lacks ({exc}); call estimate() without a budget") from exc


def estimate(
    model: nn.Module,
    inputs: Any,
    budget: int | str | None = None,
    strategy: str = "optimal",
    *,
    loss_fn: LossFn | None = None,
    blocks: BlockSpec = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    optimizer: str | int | None = None,
    throughput_flops: float | None = None,
    max_memory: int | str | None = None,
    selective: bool = True,
    top: int = 8,
) -> Estimate:
    """Predict the memory of one training step without running it for real.

    Args:
        model: the model, in train mode; on ``meta`` (built under ``torch.device("meta")``)
            or on a real device, in which case a ``meta`` copy is made (no data copied).
        inputs: a tensor, a tuple of positional args or a dict of keyword args, on any
            device; they are remade on ``meta``.
        budget: with ``strategy``, ask the planner for a plan under this step budget
            (bytes, ``"6GiB"``, ``"50%"`` of the unplanned step peak).
        max_memory: instead of ``budget``, the device's whole memory: the step budget is
            what parameters, buffers, optimizer state and the batch leave of it.
        loss_fn, blocks: as for :func:`autoremat.profile`.
        device: the device to estimate for (``"cuda"``, ``"cpu"``); it need not exist.
            Default: the model's device, or ``"cuda"`` for a model on ``meta``.
        dtype: cast floating parameters, buffers and inputs to this (``"bf16"``).
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd-momentum"``, ``"rmsprop"``,
            ``"adagrad"`` (measured with the real class on ``meta``), a number of bytes,
            or ``None`` for no optimizer state.
        throughput_flops: sustained FLOP/s of the device, to turn FLOPs into seconds.
        selective: also measure selective-recompute options, so that plans made from
            this estimate can use them (one more pass per save-set; cheap on meta).
        top: how many of the largest live tensors to report.

    Returns:
        A frozen :class:`Estimate`.

    Raises:
        BudgetError: the budget cannot be met (``min_feasible_bytes`` says what can).
        RematError: the model cannot run on ``meta``, or an option is wrong.

    Example:
        >>> import autoremat
        >>> model, inputs = autoremat.zoo.build("gpt2", device="meta", n_layer=2)
        >>> est = estimate(model, inputs, device="cuda", dtype="bf16", optimizer="adamw")
        >>> est.optimizer_bytes == 2 * est.trainable_param_bytes  # two bf16 states
        True
        >>> est.step_peak_bytes > 0
        True
    """
    if not isinstance(model, nn.Module):
        raise RematError(f"estimate() needs an nn.Module, got {type(model).__name__}")
    if budget is not None and max_memory is not None:
        raise BudgetError("give either budget= (the step's own budget) or max_memory= (the "
                          "whole device, parameters and optimizer included), not both")
    target = _resolve_device(model, device)
    target_type = torch.device(target).type
    cast = parse_dtype(dtype)
    _optimizer_class(optimizer)  # a misspelt name fails before any work
    model, inputs = to_meta(model, inputs, cast)
    names = resolve_blocks(model, blocks)
    try:
        with preserved_state(model), sdpa_as_on(target_type), \
                _hf_attention_without_masks(model, inputs) as hf_notes:
            tape = profile(model, inputs, loss_fn, names, repeats=1,
                           with_selective=selective)
            plain = _tracked_step(model, inputs, loss_fn, names, checkpoint_all=False)
            ckpt = _tracked_step(model, inputs, loss_fn, names, checkpoint_all=True)
    except (RuntimeError, NotImplementedError) as exc:
        if "meta" not in str(exc):
            raise
        raise RematError(f"{type(model).__name__} cannot run on fake (meta) tensors: {exc}. "
                         f"estimate needs a forward that does not read tensor values "
                         f"(.item(), data-dependent shapes)") from exc
    opt_name = optimizer if isinstance(optimizer, str) or optimizer is None else \
        f"{optimizer} bytes"
    opt_bytes, opt_step_bytes = optimizer_memory(model, optimizer, target_type)

    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    saved = _saved(plain)
    by_kind: dict[str, int] = {}
    for _, kind, nbytes in saved:
        by_kind[kind] = by_kind.get(kind, 0) + nbytes
    activation_bytes = sum(n for _, _, n in saved)
    by_block = {b.name: b.saved_bytes for b in tape.blocks}
    by_block["(outside blocks)"] = max(0, activation_bytes - sum(by_block.values()))
    notes = [f"attention runs the kernel {target_type} would pick "
             f"(see NOTE [ Attention on meta ]); times are not measured on meta", *hf_notes]

    est = Estimate(
        model=type(model).__name__, inputs=describe_inputs(inputs), device=target,
        dtype=str(cast).removeprefix("torch.") if cast is not None else None,
        step_peak_bytes=tape.step_peak_bytes, ckpt_step_peak_bytes=tape.ckpt_step_peak_bytes,
        peak_breakdown=dict(tape.peak_breakdown), ckpt_peak_breakdown=ckpt.mem.breakdown,
        param_count=sum(p.numel() for p in params),
        param_bytes=unique_storage_bytes(params),
        trainable_param_bytes=unique_storage_bytes(trainable),
        buffer_bytes=unique_storage_bytes(list(model.buffers())),
        input_bytes=unique_storage_bytes(inputs), grad_bytes=unique_storage_bytes(trainable),
        optimizer=opt_name, optimizer_bytes=opt_bytes, optimizer_step_bytes=opt_step_bytes,
        activation_bytes=activation_bytes, activations_by_block=by_block,
        activations_by_kind=dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        largest_tensors=_live_at_peak(plain, top),
        head_chunked_step_peak_bytes=chunked_loss_peak(plain, LOSS_CHUNKS),
        ckpt_head_chunked_step_peak_bytes=chunked_loss_peak(ckpt, LOSS_CHUNKS),
        step_fwd_flops=tape.step_fwd_flops, step_bwd_flops=tape.step_bwd_flops,
        ckpt_recompute_flops=sum(b.fwd_flops for b in tape.blocks),
        throughput_flops=throughput_flops, notes=tuple(notes), tape=tape,
    )
    if budget is None and max_memory is None:
        return est
    return est.with_plan(budget, strategy, max_memory=max_memory)


def _with_plan(est: Estimate, tape: Tape, budget: int | str | None,
               max_memory: int | str | None, strategy: str) -> Estimate:
    if max_memory is not None:
        limit = parse_size(max_memory, what="max_memory")
        fixed = est.resting_bytes + est.grad_bytes + est.optimizer_step_bytes
        if fixed > limit:
            raise BudgetError(
                f"max_memory {format_bytes(limit)} is below what the step needs whatever is "
                f"recomputed: parameters, buffers, batch and optimizer state "
                f"({format_bytes(est.resting_bytes)}) plus gradients and the optimizer "
                f"step's temporaries ({format_bytes(est.grad_bytes + est.optimizer_step_bytes)})"
                f". Shard the optimizer state or use a smaller optimizer",
                min_feasible_bytes=fixed)
        budget = limit - est.resting_bytes
    if budget is None:
        raise RematError("internal error (please report it): no budget to plan for")
    budget_bytes = parse_budget(budget, tape.step_peak_bytes)
    plan = _plan_module().plan(tape, budget=budget_bytes, strategy=strategy)
    return dataclasses.replace(est, budget_bytes=budget_bytes, strategy=strategy, plan=plan,
                               plan_peak_bytes=int(plan.predicted_peak_bytes),
                               plan_recompute_flops=int(plan.predicted_recompute_flops))
