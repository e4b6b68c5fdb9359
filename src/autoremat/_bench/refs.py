"""The references ``autoremat bench`` measures autoremat against, written the way a user would.

Each is a :data:`Toggle`, an ``(install, uninstall)`` pair of functions that switch one
option on a model on and off: :func:`per_block` (each block under non-reentrant
``torch.utils.checkpoint``), :func:`sac_per_block` (the same with a Megatron-style
selective policy), :func:`hf_toggle` (transformers' own switch) and
:func:`sequential_toggle` (``checkpoint_sequential`` over the chain that
:func:`sequential_chain` finds). They use PyTorch directly, never autoremat's own
wrappers, so that a bug in autoremat cannot make a reference look better or worse.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

__all__ = ["Toggle", "hf_toggle", "per_block", "sac_per_block", "sequential_chain",
           "sequential_toggle"]

Toggle = tuple[Callable[[], None], Callable[[], None]]  # (install, uninstall)


def per_block(modules: list[nn.Module], context_fn: Callable[..., Any] | None = None) -> Toggle:
    """Each module's forward under non-reentrant ``torch.utils.checkpoint``.

    Independent of autoremat's ``wrap.py`` on purpose: this is the reference a user
    writes in five lines, BatchNorm statistics and all (see the buffer column).
    """
    previous: list[tuple[nn.Module, Any]] = []
    extra: dict[str, Any] = {} if context_fn is None else {"context_fn": context_fn}

    def install() -> None:
        for module in modules:
            previous.append((module, module.__dict__.get("forward")))
            inner = module.forward

            def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
                return checkpoint(_inner, *args, use_reentrant=False, **extra, **kwargs)

            module.forward = forward  # type: ignore[method-assign]

    def uninstall() -> None:
        for module, before in reversed(previous):
            if before is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = before  # type: ignore[method-assign]
        previous.clear()

    return install, uninstall


# Megatron-style selective checkpointing (Korthikanti et al. 2022, as in torchtitan's
# op-level SAC): keep what is expensive to compute, recompute what is cheap.
_SAVE_PACKETS = tuple(
    getattr(torch.ops.aten, name) for name in (
        "mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    ) if hasattr(torch.ops.aten, name)
)


# The same without bmm/baddbmm: the op kinds of autoremat's own Megatron policy
# (MEGATRON in _core/saves.py: matmul, attention, conv), which recomputes an attention core built
# from bmm and softmax. The compiled SAC row uses it.
_SAVE_PACKETS_NO_BMM = tuple(p for p in _SAVE_PACKETS
                             if p not in (torch.ops.aten.bmm, torch.ops.aten.baddbmm))


def _megatron_policy(save: tuple[Any, ...], ctx: Any, op: Any, *args: Any,
                     **kwargs: Any) -> CheckpointPolicy:
    if getattr(op, "overloadpacket", None) in save:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def sac_per_block(modules: list[nn.Module], *, save_bmm: bool = True) -> Toggle:
    """:func:`per_block` with the Megatron-style policy above: save what is expensive
    (``save_bmm=False``: not bmm/baddbmm outputs, as autoremat's ``MEGATRON``)."""
    policy = functools.partial(_megatron_policy,
                               _SAVE_PACKETS if save_bmm else _SAVE_PACKETS_NO_BMM)
    return per_block(modules, functools.partial(create_selective_checkpoint_contexts, policy))


def hf_toggle(model: nn.Module) -> Toggle | None:
    """transformers' own switch: ``gradient_checkpointing_enable`` (renamed
    ``activation_checkpointing_enable`` in transformers 5; the old name warns)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return None
    kwargs = {"use_reentrant": False}
    hf: Any = model  # a transformers PreTrainedModel; nn.Module's typing hides its methods
    if hasattr(hf, "activation_checkpointing_enable"):
        enable = functools.partial(hf.activation_checkpointing_enable,
                                   activation_checkpointing_kwargs=kwargs)
        disable = hf.activation_checkpointing_disable
    elif hasattr(hf, "gradient_checkpointing_enable"):
        enable = functools.partial(hf.gradient_checkpointing_enable,
                                   gradient_checkpointing_kwargs=kwargs)
        disable = hf.gradient_checkpointing_disable
    else:
        return None

    def install() -> None:
        enable()

    def uninstall() -> None:
        disable()

    return install, uninstall


def sequential_chain(model: nn.Module, names: list[str]) -> tuple[nn.Module, list[nn.Module]] \
        | None:
    """The ``nn.Sequential`` that runs exactly the chain ``names``, flattened one level
    (a ResNet's Sequential of stages), or ``None`` when the blocks are called otherwise."""
    modules = [model.get_submodule(n) for n in names]
    parents = {n.rpartition(".")[0] for n in names}
    candidates = list(parents) if len(parents) == 1 else \
        list({p.rpartition(".")[0] for p in parents})
    if len(candidates) != 1:
        return None
    container = model.get_submodule(candidates[0])
    if not isinstance(container, nn.Sequential):
        return None
    flat: list[nn.Module] = []
    for child in container:
        if len(parents) > 1 and isinstance(child, nn.Sequential):
            flat.extend(child)
        else:
            flat.append(child)
    if len(flat) != len(modules) or any(a is not b for a, b in zip(flat, modules, strict=True)):
        return None
    return container, flat


def sequential_toggle(container: nn.Module, chain: list[nn.Module], segments: int) -> Toggle:
    """``container``'s forward as ``checkpoint_sequential(chain, segments, x)``."""

    def install() -> None:
        def forward(x: Any) -> Any:
            return checkpoint_sequential(chain, segments, x, use_reentrant=False)

        container.forward = forward  # type: ignore[method-assign]

    def uninstall() -> None:
        container.__dict__.pop("forward", None)

    return install, uninstall
