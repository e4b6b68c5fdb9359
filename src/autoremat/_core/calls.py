"""Blocks that run several times in one forward, planned call by call.

NOTE [ A block that runs several times ]
    Some models run one layer's weights as several layers: ALBERT's single layer group
    runs as every layer, looped ("recurrent-depth") language models run their middle
    layers once per loop. Each call saves its own activations, so each is a block of the
    chain, with its own decision. Every stage of autoremat (profile's hooks, the
    mechanisms of apply, estimate) works on a module per block, run once per step; so
    each call gets a module of its own, a :class:`_Call`, which holds the layer (its
    parameters are the layer's) and runs the layer's forward:

    * the layer's forward is replaced, for the model's instance only, by a
      :class:`_Dispatch`, which sends the ``j``-th call of a forward to its ``j``-th
      ``_Call`` (through ``nn.Module.__call__``, so that the hooks and wrappers autoremat
      put on it run); a call past the last one planned runs the layer's own forward;
    * the count starts again at each forward of the root model (a forward pre-hook);
      a recompute in backward runs a ``_Call``'s forward itself, not the dispatch, and
      does not count;
    * the ``_Call`` s are reached by name as ``<layer>@<j>`` (``"encoder.layer.0@3"``, the
      fourth call): each is an attribute of the layer's parent in its instance
      dictionary, so ``get_submodule`` finds it while the parent's modules (what it
      iterates, ``state_dict``, ``named_modules``, ``len`` of a ``ModuleList``) do not
      change.

    ``profile`` finds the calls in its first step and measures the unrolled chain;
    ``apply`` installs the calls a plan names and ``remove`` takes them off again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from autoremat._core.errors import BlockError

__all__ = ["CALL", "call_modules", "call_of", "calls_beyond", "calls_for", "held_at",
           "install_calls", "remove_calls", "unrolled"]

CALL = "@"  # between a layer's name and the index of one of its calls


def call_of(name: str) -> tuple[str, int | None]:
    """The layer's name and the call's index of a block name (``None``: the layer
    itself, run once)."""
    layer, sep, index = name.rpartition(CALL)
    if not sep or not index.isdigit():
        return name, None
    return layer, int(index)


def unrolled(sequence: Sequence[str]) -> list[str]:
    """Block names for the calls ``sequence`` lists in the order they ran: a layer that
    ran more than once becomes ``<layer>@<j>`` for its ``j``-th call.

    Example:
        >>> unrolled(["a", "b", "c", "b", "c", "d"])
        ['a', 'b@0', 'c@0', 'b@1', 'c@1', 'd']
    """
    counts = Counter(sequence)
    seen: dict[str, int] = {}
    out = []
    for name in sequence:
        if counts[name] == 1:
            out.append(name)
            continue
        out.append(f"{name}{CALL}{seen.get(name, 0)}")
        seen[name] = seen.get(name, 0) + 1
    return out


class _Call(nn.Module):
    """One call of a layer run several times per forward (NOTE [ A block that runs
    several times ]): its parameters are the layer's, its forward the layer's own, its
    mode the layer's."""

    def __init__(self, layer: nn.Module, index: int, dispatch: _Dispatch) -> None:
        super().__init__()
        self.layer = layer
        self.index = index
        self._dispatch = dispatch

    @property  # type: ignore[override]
    def training(self) -> bool:
        return bool(self.layer.training)

    @training.setter
    def training(self, mode: bool) -> None:
        pass  # the layer's (train() goes on to the layer, its child)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._dispatch.run(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"call {self.index}"


class _Dispatch:
    """The layer's forward while its calls are installed: the ``j``-th call of a forward
    runs its ``j``-th :class:`_Call`."""

    def __init__(self, layer: nn.Module, own: Any) -> None:
        self.layer = layer
        self.own = own  # the instance's own forward attribute, if it had one
        self.calls: list[_Call] = []
        self.count = 0

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The layer's forward as it was before the calls were installed."""
        if self.own is not None:
            return self.own(*args, **kwargs)
        return type(self.layer).forward(self.layer, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        j = self.count
        self.count += 1
        if j < len(self.calls):
            return self.calls[j](*args, **kwargs)
        return self.run(*args, **kwargs)


class _Restart:
    """The root model's forward pre-hook: every layer's count of calls starts again."""

    def __init__(self, dispatches: list[_Dispatch]) -> None:
        self.dispatches = dispatches

    def __call__(self, *_: Any) -> None:
        for dispatch in self.dispatches:
            dispatch.count = 0


def _parent(model: nn.Module, layer_name: str) -> tuple[nn.Module, str]:
    parent, _, key = layer_name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), key


def call_modules(model: nn.Module, names: Sequence[str]) -> dict[str, nn.Module]:
    """The module of each ``<layer>@<j>`` in ``names`` whose layer ``model`` has: its
    installed :class:`_Call`, else one made to be read (its parameters, its mode), not
    installed."""
    out: dict[str, nn.Module] = {}
    for name in names:
        layer_name, index = call_of(name)
        if index is None:
            continue
        try:
            out[name] = model.get_submodule(name)
        except AttributeError:
            try:
                layer = model.get_submodule(layer_name)
            except AttributeError:
                continue
            out[name] = _Call(layer, index, _Dispatch(layer, None))
    return out


def held_at(parent: nn.Module, key: str, module: nn.Module) -> bool:
    """Whether ``parent`` holds the block ``module`` under ``key`` (a call's key: whether
    it holds the call's layer, and the call is still installed)."""
    layer_key, index = call_of(key)
    if index is None:
        return parent._modules.get(key) is module
    return isinstance(module, _Call) and parent._modules.get(layer_key) is module.layer \
        and parent.__dict__.get(key) is module


def install_calls(model: nn.Module, names: Sequence[str]) -> None:
    """Give each ``<layer>@<j>`` in ``names`` its :class:`_Call` (NOTE [ A block that runs
    several times ]); nothing for names without calls. Calls already installed are
    taken off first."""
    remove_calls(model)
    wanted: dict[str, int] = {}
    for name in names:
        layer_name, index = call_of(name)
        if index is not None:
            wanted[layer_name] = max(wanted.get(layer_name, 0), index + 1)
    if not wanted:
        return
    dispatches = []
    for layer_name, count in wanted.items():
        try:
            layer = model.get_submodule(layer_name)
        except AttributeError as exc:
            raise BlockError(f"no submodule named {layer_name!r} in {type(model).__name__} "
                             f"for the calls of block {layer_name}{CALL}0") from exc
        dispatch = _Dispatch(layer, layer.__dict__.get("forward"))
        layer.__dict__["forward"] = dispatch
        parent, key = _parent(model, layer_name)
        for j in range(count):
            call = _Call(layer, j, dispatch)
            dispatch.calls.append(call)
            parent.__dict__[f"{key}{CALL}{j}"] = call
        dispatches.append(dispatch)
    restart = _Restart(dispatches)
    handle = model.register_forward_pre_hook(restart)
    model.__dict__["_autoremat_calls"] = (list(wanted), handle)


def calls_beyond(model: nn.Module) -> list[tuple[str, int, int]]:
    """The layers whose calls in the last forward of ``model`` outnumbered the calls
    installed, as ``(layer, calls, installed)``: the calls after those installed ran as
    the layer's own forward, outside the plan."""
    installed = model.__dict__.get("_autoremat_calls")
    if installed is None:
        return []
    out = []
    for layer_name in installed[0]:
        dispatch = model.get_submodule(layer_name).__dict__.get("forward")
        if isinstance(dispatch, _Dispatch) and dispatch.count > len(dispatch.calls):
            out.append((layer_name, dispatch.count, len(dispatch.calls)))
    return out


def remove_calls(model: nn.Module) -> None:
    """Take off the calls :func:`install_calls` installed (nothing if none)."""
    installed = model.__dict__.pop("_autoremat_calls", None)
    if installed is None:
        return
    layers, handle = installed
    handle.remove()
    for layer_name in layers:
        layer = model.get_submodule(layer_name)
        dispatch = layer.__dict__.pop("forward")
        if dispatch.own is not None:
            layer.__dict__["forward"] = dispatch.own
        parent, key = _parent(model, layer_name)
        for j in range(len(dispatch.calls)):
            parent.__dict__.pop(f"{key}{CALL}{j}", None)


def _installed(model: nn.Module, name: str) -> bool:
    try:
        return isinstance(model.get_submodule(name), _Call)
    except AttributeError:
        return False


@contextmanager
def calls_for(model: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """The calls ``names`` name installed for the duration (nothing done where they name
    none, or where they are all installed already)."""
    if all(call_of(n)[1] is None or _installed(model, n) for n in names):
        yield
        return
    install_calls(model, names)
    try:
        yield
    finally:
        remove_calls(model)
