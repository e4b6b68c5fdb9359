"""The mechanism under ``apply``: checkpoint one module's forward in place.

NOTE [ Patching forward instead of wrapping the module ]
    Replacing ``blocks[3]`` with a wrapper module would rename every parameter
    (``blocks.3.inner.weight``) and break the user's state dicts, optimizers and hooks.
    We set an instance attribute ``forward`` instead: ``nn.Module.__call__`` still runs
    the module's hooks and then our forward, which runs the original one under
    ``torch.utils.checkpoint`` (non-reentrant: kwargs, non-tensor args and frozen inputs
    all work, RNG state is restored on recompute). ``unwrap`` deletes the attribute, so
    the module is exactly as before.

NOTE [ BatchNorm under recompute ]
    Recomputing a BatchNorm in training mode would update its running statistics a
    second time. Recompute saves the block's BatchNorm statistics (a few KiB) and puts
    them back when it ends. (Setting ``track_running_stats = False`` instead looks
    simpler, but the layer then saves a different number of tensors and checkpoint's
    recompute check fails.) Other modules that change their own buffers in forward are
    not handled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from autoremat._core import rng
from autoremat._core.errors import RematError, internal_assert
from autoremat._mechanism.compiled import is_compiling, refuse_under_compile

__all__ = ["checkpointed", "install_forward", "is_wrapped", "stashed_buffers", "unwrap", "wrap"]

_MARK = "_autoremat_wrap"

ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]
PolicyFactory = Callable[[], ContextFn | None]


@dataclass(frozen=True)
class _WrapState:
    user_forward: Any  # an instance-level forward that was there before us, or None
    tag: str  # what the wrapper does, e.g. "recompute" or "selective"


def _tracking_batchnorms(modules: list[nn.Module]) -> list[_BatchNorm]:
    return [m for module in modules for m in module.modules()
            if isinstance(m, _BatchNorm) and m.track_running_stats]


def _statistics(layer: _BatchNorm) -> list[torch.Tensor]:
    return [buf for buf in (layer.running_mean, layer.running_var, layer.num_batches_tracked)
            if buf is not None]


def stashed_buffers(modules: list[nn.Module]) -> list[torch.Tensor]:
    """The buffers a recompute of ``modules`` copies aside and puts back (NOTE
    [ BatchNorm under recompute ]); the profile counts their copies."""
    return [buf for layer in _tracking_batchnorms(modules) for buf in _statistics(layer)]


@contextmanager
def _restored_batchnorm_stats(layers: list[_BatchNorm]) -> Iterator[None]:
    saved = [[(buf, buf.detach().clone()) for buf in _statistics(m)] for m in layers]
    try:
        yield
    finally:
        with torch.no_grad():
            for pairs in saved:
                for buf, value in pairs:
                    buf.copy_(value)


def _context_fn(modules: list[nn.Module], selective: ContextFn | None) -> ContextFn:
    """The ``context_fn`` of one checkpointed region (a block or a segment): forward
    notes the RNG states, recompute replays them (NOTE [ Replaying the forward's RNG ])
    and puts BatchNorm statistics back; ``selective`` adds its modes inside both."""
    def make() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        layers = _tracking_batchnorms(modules)
        forward_ctx, recompute_ctx = selective() if selective else (nullcontext(), nullcontext())
        start: list[rng.RngSnapshot] = []

        @contextmanager
        def forward() -> Iterator[None]:
            start.append(rng.snapshot())
            with forward_ctx:
                yield

        @contextmanager
        def recompute() -> Iterator[None]:
            internal_assert(bool(start), "a checkpointed region is recomputed before its "
                                         "forward ran")
            with ExitStack() as stack:
                stack.enter_context(_restored_batchnorm_stats(layers))
                stack.enter_context(rng.replaying(start[0]))
                stack.enter_context(recompute_ctx)
                yield

        return forward(), recompute()

    return make


# (the module's forward, a runner of a checkpoint of a function of no arguments) -> the
# forward to install: how offload.input_offloaded hands a checkpoint its input
InputRunner = Callable[[Callable[..., Any], Callable[[Callable[[], Any]], Any]],
                       Callable[..., Any]]


def wrap(module: nn.Module, *, tag: str = "recompute", selective: ContextFn | None = None,
         compiled: Any = None, inputs: InputRunner | None = None) -> None:
    """Make ``module`` recompute its forward during backward. Idempotent; re-wrapping
    replaces the previous wrapper.

    Args:
        module: any ``nn.Module``; its parameters, hooks and state dict are untouched.
        tag: a label kept for inspection (``is_wrapped`` returns it).
        selective: a ``context_fn`` for ``torch.utils.checkpoint`` (autoremat's
            ``selective.selective_context``, or PyTorch's
            ``create_selective_checkpoint_contexts``), to save some op outputs instead
            of recomputing everything.
        compiled: the ``context_fn`` used instead while Dynamo traces the module
            (``compiled.compiled_context``; ``None``: a plain recompute). NOTE [ Plans
            under torch.compile ].
        inputs: how the checkpoint gets the module's arguments (``None``: as
            arguments); ``offload.input_offloaded`` offloads the input (NOTE
            [ Offloading a checkpoint's input ]). Not under compile.
    """
    context_fn = _context_fn([module], selective)

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(fn: Callable[[], Any]) -> Any:
            return checkpoint(fn, use_reentrant=False, context_fn=context_fn,
                              preserve_rng_state=False)
        boxed = inputs(original, call) if inputs is not None else None

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return original(*args, **kwargs)  # nothing is saved without grad
            if boxed is not None:
                if is_compiling():
                    refuse_under_compile("a checkpoint with an offloaded input",
                                         "it copies between streams from Python")
                return boxed(*args, **kwargs)
            if is_compiling():  # compile's own RNG handling and partitioner take over
                if compiled is None:
                    return checkpoint(original, *args, use_reentrant=False, **kwargs)
                return checkpoint(original, *args, use_reentrant=False, context_fn=compiled,
                                  **kwargs)
            return checkpoint(original, *args, use_reentrant=False, context_fn=context_fn,
                              preserve_rng_state=False, **kwargs)  # we replay it ourselves
        return forward

    install_forward(module, make, tag)


def install_forward(module: nn.Module, make: Callable[[Callable[..., Any]], Callable[..., Any]],
                    tag: str) -> None:
    """Replace ``module``'s forward by ``make(its forward)`` (NOTE [ Patching forward
    instead of wrapping the module ]), replacing an earlier wrapper of ours; ``unwrap``
    undoes it."""
    if is_wrapped(module):
        unwrap(module)
    user_forward = module.__dict__.get("forward")
    module.forward = make(module.forward)  # type: ignore[method-assign]
    setattr(module, _MARK, _WrapState(user_forward=user_forward, tag=tag))


def unwrap(module: nn.Module) -> bool:
    """Undo :func:`wrap`; returns whether there was anything to undo."""
    state = module.__dict__.get(_MARK)
    if state is None:
        return False
    del module.__dict__[_MARK]
    if state.user_forward is not None:
        module.forward = state.user_forward  # type: ignore[method-assign]
    else:
        del module.__dict__["forward"]
    return True


def is_wrapped(module: nn.Module) -> str | None:
    """The tag of the wrapper on ``module``, or ``None``."""
    state = module.__dict__.get(_MARK)
    return state.tag if state is not None else None


@contextmanager
def checkpointed(model: nn.Module, names: list[str],
                 selective: dict[str, ContextFn] | None = None,
                 compiled: dict[str, Any] | None = None) -> Iterator[None]:
    """Temporarily checkpoint the named submodules (each on its own); those named in
    ``selective`` with that selective ``context_fn``, and under compile with the one in
    ``compiled`` (``wrap``'s argument)."""
    selective = selective or {}
    compiled = compiled or {}
    modules = [model.get_submodule(n) for n in names]
    previous = [module.__dict__.get(_MARK) for module in modules]
    if any(p is not None for p in previous):
        raise RematError("the model already has autoremat wrappers; call "
                         "autoremat.remove(model) before profiling it")
    try:
        for name, module in zip(names, modules, strict=True):
            wrap(module, tag="selective" if name in selective else "recompute",
                 selective=selective.get(name), compiled=compiled.get(name))
        yield
    finally:
        for module in modules:
            unwrap(module)
