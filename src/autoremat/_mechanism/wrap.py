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

__all__ = ["RegionContexts", "checkpointed", "install_forward", "is_wrapped", "stashed_buffers",
           "unwrap", "wrap"]

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


class _RestoredBatchNormStats:
    """Puts ``layers``' statistics back as they were when entered. Re-entrant: each
    ``with`` copies them afresh (NOTE [ Contexts a backward may enter again ])."""

    def __init__(self, layers: list[_BatchNorm]) -> None:
        self.layers = layers
        self.saved: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def __enter__(self) -> None:
        self.saved.append([(buf, buf.detach().clone()) for m in self.layers
                           for buf in _statistics(m)])

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for buf, value in self.saved.pop():
                buf.copy_(value)


# NOTE [ Contexts a backward may enter again ]
#     ``checkpoint`` calls its ``context_fn`` once per forward and enters the recompute
#     context each time a backward needs the region's tensors: once per backward that
#     reaches it (``retain_graph=True`` then a second backward, two losses off one
#     forward) and again under ``create_graph=True`` (a gradient penalty). A
#     ``@contextmanager`` object can be entered once only (the second ``with`` fails
#     with "'_GeneratorContextManager' object has no attribute 'args'"), so every
#     context a region hands to checkpoint is an object whose ``__enter__`` starts
#     afresh: the RNG states are replayed from the forward's snapshot again, BatchNorm
#     statistics copied aside again, the selective mode's counters reset.


class _ForwardContext:
    """A region's forward: notes the RNG states (NOTE [ Replaying the forward's RNG ])
    and runs ``inner`` (the selective mode, or nothing)."""

    def __init__(self, inner: AbstractContextManager[Any]) -> None:
        self.inner = inner
        self.start: rng.RngSnapshot | None = None

    def __enter__(self) -> None:
        self.start = rng.snapshot()
        self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.inner.__exit__(*exc)


class _RecomputeContext:
    """A region's recompute, re-entrant (NOTE [ Contexts a backward may enter again ]):
    replays the forward's RNG states, puts BatchNorm statistics back, runs ``inner``."""

    def __init__(self, forward: _ForwardContext, layers: list[_BatchNorm],
                 inner: AbstractContextManager[Any]) -> None:
        self.forward = forward
        self.layers = layers
        self.inner = inner
        self.stacks: list[ExitStack] = []

    def __enter__(self) -> None:
        start = self.forward.start
        internal_assert(start is not None, "a checkpointed region is recomputed before its "
                                           "forward ran")
        assert start is not None  # (for the type checker)
        with ExitStack() as stack:
            stack.enter_context(_RestoredBatchNormStats(self.layers))
            stack.enter_context(rng.replaying(start))
            stack.enter_context(self.inner)
            self.stacks.append(stack.pop_all())

    def __exit__(self, *exc: Any) -> Any:
        return self.stacks.pop().__exit__(*exc)


@dataclass(frozen=True)
class RegionContexts:
    """The ``context_fn`` of one checkpointed region (a block or a segment): forward
    notes the RNG states, recompute replays them (NOTE [ Replaying the forward's RNG ])
    and puts BatchNorm statistics back; ``selective`` adds its modes inside both.

    An object rather than a closure, so that a deep copy of an applied model checkpoints
    the copy's modules and the model pickles (NOTE [ Copying and pickling an applied
    model ])."""

    modules: list[nn.Module]
    selective: ContextFn | None = None

    def __call__(self) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        layers = _tracking_batchnorms(self.modules)
        forward_ctx, recompute_ctx = self.selective() if self.selective else \
            (nullcontext(), nullcontext())
        forward = _ForwardContext(forward_ctx)
        return forward, _RecomputeContext(forward, layers, recompute_ctx)


# (the module's forward, a runner of a checkpoint of a function of no arguments) -> the
# forward to install: how offload.input_offloaded hands a checkpoint its input
InputRunner = Callable[[Callable[..., Any], Callable[[Callable[[], Any]], Any]],
                       Callable[..., Any]]


class _Original:
    """A module's own forward: the instance-level one that was there before us, else its
    class's, called on the module. It refers to the module, not to a bound method made
    when we wrapped it, so that a deep copy calls the copy's (NOTE [ Copying and
    pickling an applied model ])."""

    def __init__(self, module: nn.Module, user_forward: Callable[..., Any] | None) -> None:
        self.module = module
        self.user_forward = user_forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.user_forward is not None:
            return self.user_forward(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


class _Checkpointed:
    """The forward ``wrap`` installs: the module's own forward under a non-reentrant
    checkpoint (see ``wrap`` for the arguments)."""

    def __init__(self, original: Callable[..., Any], context_fn: RegionContexts,
                 compiled: Any, inputs: InputRunner | None) -> None:
        self.original = original
        self.context_fn = context_fn
        self.compiled = compiled
        self.boxed = inputs(original, self._checkpoint) if inputs is not None else None

    def _checkpoint(self, fn: Callable[[], Any]) -> Any:
        return checkpoint(fn, use_reentrant=False, context_fn=self.context_fn,
                          preserve_rng_state=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        original = self.original
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)  # nothing is saved without grad
        if self.boxed is not None:
            if is_compiling():
                refuse_under_compile("a checkpoint with an offloaded input",
                                     "it copies between streams from Python")
            return self.boxed(*args, **kwargs)
        if is_compiling():  # compile's own RNG handling and partitioner take over
            if self.compiled is None:
                return checkpoint(original, *args, use_reentrant=False, **kwargs)
            return checkpoint(original, *args, use_reentrant=False, context_fn=self.compiled,
                              **kwargs)
        return checkpoint(original, *args, use_reentrant=False, context_fn=self.context_fn,
                          preserve_rng_state=False, **kwargs)  # we replay it ourselves


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
    context_fn = RegionContexts([module], selective)
    install_forward(module, lambda original: _Checkpointed(original, context_fn, compiled,
                                                           inputs), tag)


def install_forward(module: nn.Module, make: Callable[[Callable[..., Any]], Callable[..., Any]],
                    tag: str) -> None:
    """Replace ``module``'s forward by ``make(its forward)`` (NOTE [ Patching forward
    instead of wrapping the module ]), replacing an earlier wrapper of ours; ``unwrap``
    undoes it."""
    if is_wrapped(module):
        unwrap(module)
    user_forward = module.__dict__.get("forward")
    module.forward = make(_Original(module, user_forward))  # type: ignore[method-assign]
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
