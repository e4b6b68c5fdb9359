"""Offload: a block's saved tensors go to host memory in forward and come back before
its backward.

NOTE [ Offloading saved tensors ]
    An offloaded block runs its forward under ``saved_tensors_hooks``: each tensor
    autograd saves is copied to host memory and the handle autograd keeps instead holds
    only the host copy, so the device copy is freed as soon as nothing else refers to it
    (a block's output, read by the next block, lives on until that block is done with
    it). When the backward of the next block in the chain starts, the copies go back to
    the device (prefetch), so they are there before the block's own backward needs them;
    a tensor not prefetched by then is fetched when autograd asks for it.

    On CUDA (``torch.cuda``'s stream semantics, as in torchtune's ``OffloadActivations``):
    * device to host: the side stream waits for the compute stream (the tensor is
      written), copies into pinned host memory without blocking, and the tensor is
      marked as used on the side stream (``record_stream``), so that the caching
      allocator does not hand its block to a new tensor before the copy has read it;
    * host to device: the destination is allocated on the compute stream, the side
      stream waits for the compute stream (the block may be reused memory), copies, and
      records an event the compute stream waits on before autograd reads the tensor.
    Elsewhere there is no second memory to move to. On a CPU the host is the device:
    the handle keeps the tensor itself (nothing is saved, but the hooks, the handles
    and the prefetch order run). On ``meta`` (``estimate`` predicting a GPU) and under
    :func:`simulated_host` the host copy is made where the memory tracker does not see
    it, so the step measures what a GPU's allocator would: the device level without
    the offloaded tensors, and their return in backward.

NOTE [ Compressed offload ]
    Opt-in (``plan(..., offload_dtype="bfloat16")``), and it changes numerics: each
    floating tensor wider than the dtype is rounded to it on the device, copied, and
    widened back when fetched. bfloat16 keeps 8 significant bits, so with
    round-to-nearest every element of every compressed saved tensor is within a
    relative ``2**-8`` of its value (``|x' - x| <= 2**-8 * |x|``, normal numbers; bf16
    has float32's exponent range, so nothing overflows). The gradients are computed
    from those perturbed activations: their error is not bounded by that figure in
    general (it goes through the backward of every op that read a compressed tensor);
    ``tests/test_offload.py`` checks the element bound exactly and, on the zoo's gpt2
    with every block compressed, a gradient error below ``2**-5`` of each gradient's
    largest element. Host memory and copy time are halved for float32; device memory is
    what uncompressed offload frees, plus, for one tensor at a time, its narrow copy in
    forward and again when fetched (not in the tape's windows, which are measured
    uncompressed). With host = device (a CPU) nothing is offloaded or compressed.

NOTE [ What is not offloaded ]
    Parameters and buffers (a ``weight.t()`` saved for a matmul's backward) stay: they
    are on the device anyway, so a host copy would free nothing. So do tensors under
    ``_MIN_BYTES`` (a copy costs more latency than it frees) and integer tensors small
    enough to be indices. A tensor saved twice (by two ops) is copied once.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from autoremat._core.decisions import Decision
from autoremat._core.errors import RematError
from autoremat._mechanism.compiled import refuse_under_compile
from autoremat._mechanism.wrap import (
    as_called,
    install_forward,
    refuse_under_func_transforms,
    snapshot_arguments,
    unwrap,
    wrap,
)

__all__ = ["BlockOffload", "OffloadGroup", "OffloadStats", "input_offloaded", "offload",
           "offload_forward", "offloading", "prefetch_hook", "simulated_host"]

_MIN_BYTES = 1024  # see NOTE [ What is not offloaded ]

# simulated_host() on: CPU copies the tracker does not see. A context variable, so that
# one thread (or task) simulating a host does not change another's runs.
_SIMULATED: ContextVar[bool] = ContextVar("autoremat_simulated_host", default=False)


@contextmanager
def simulated_host() -> Iterator[None]:
    """On a CPU, offloaded tensors go to a host memory the memory tracker does not
    count (real copies, made outside it), so a CPU step measures what a GPU step with a
    separate host would. For tests and for checking the peak model; see NOTE
    [ Offloading saved tensors ]."""
    token = _SIMULATED.set(True)
    try:
        yield
    finally:
        _SIMULATED.reset(token)


@dataclass
class OffloadStats:
    """What one block's last forward moved to host memory."""

    host_bytes: int = 0  # bytes of the host copies (``nbytes`` of each tensor)
    tensors: int = 0  # tensors copied
    kept: int = 0  # saved tensors left on the device (parameters, small ones)


class _Entry:
    """One offloaded tensor: its host copy, and the device copy once fetched back."""

    __slots__ = ("__weakref__", "device", "dtype", "event", "fetched", "host")

    def __init__(self, host: torch.Tensor, device: torch.device,
                 dtype: torch.dtype | None = None) -> None:
        self.host = host
        self.device = device
        self.dtype = dtype  # the tensor's own dtype when the host copy is compressed
        self.fetched: torch.Tensor | None = None
        self.event: Any = None


_SIDE_STREAMS: dict[torch.device, Any] = {}  # one side stream per CUDA device


def _side(device: torch.device) -> Any:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _host_kind(device: torch.device) -> str:
    if device.type == "cuda":
        return "pinned"
    if device.type == "meta" or (_SIMULATED.get() and device.type == "cpu"):
        return "untracked"
    return "same"


def _to_host(t: torch.Tensor) -> torch.Tensor:
    kind = _host_kind(t.device)
    if kind == "same":
        return t
    if kind == "untracked":
        with _disable_current_modes():  # NOTE [ Offloading saved tensors ]: not counted
            return torch.empty_like(t) if t.device.type == "meta" else t.detach().clone()
    side = _side(t.device)
    side.wait_stream(torch.cuda.current_stream(t.device))
    with _disable_current_modes():  # host memory: not the device's, not counted
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, device="cpu",
                           pin_memory=True)
        with torch.cuda.stream(side):
            host.copy_(t, non_blocking=True)
    t.record_stream(side)
    return host


def _start_fetch(entry: _Entry) -> None:
    if entry.fetched is not None:
        return
    kind = _host_kind(entry.device)
    if kind == "same":
        entry.fetched = entry.host
    elif kind == "untracked":
        # A device copy the tracker sees (the allocation a GPU would make).
        entry.fetched = torch.empty_like(entry.host) if entry.device.type == "meta" \
            else entry.host.clone()
    else:
        main = torch.cuda.current_stream(entry.device)
        side = _side(entry.device)
        out = torch.empty(entry.host.size(), dtype=entry.host.dtype, device=entry.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out.copy_(entry.host, non_blocking=True)
            entry.event = torch.cuda.Event()
            entry.event.record(side)
        out.record_stream(side)
        entry.fetched = out


def _finish_fetch(entry: _Entry) -> torch.Tensor:
    _start_fetch(entry)
    if entry.event is not None:
        torch.cuda.current_stream(entry.device).wait_event(entry.event)
        entry.event = None
    out = entry.fetched
    entry.fetched = None  # autograd holds it while it needs it; a second unpack re-fetches
    assert out is not None
    return out if entry.dtype is None else out.to(entry.dtype)


@dataclass
class OffloadGroup:
    """The saved tensors of one call of an offloaded block."""

    frozen: set[int]  # storages (``_cdata``) of parameters and buffers: never offloaded
    # host copies of wider floating tensors in this dtype (NOTE [ Compressed offload ])
    dtype: torch.dtype | None = None
    stats: OffloadStats = field(default_factory=OffloadStats)
    _entries: list[weakref.ref[_Entry]] = field(default_factory=list)
    # a tensor saved twice is copied once: id -> (the tensor, its entry), both weak
    _by_tensor: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[_Entry]]] = field(
        default_factory=dict)

    def pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        if storage._cdata in self.frozen or storage.nbytes() < _MIN_BYTES \
                or t.layout != torch.strided:
            self.stats.kept += 1
            return t.detach()  # NOTE [ A pack hook keeps an alias ] (measure/ops.py)
        known = self._by_tensor.get(id(t))
        if known is not None and known[0]() is t:
            entry = known[1]()
            if entry is not None:
                return entry
        if self.dtype is not None and t.is_floating_point() and _host_kind(t.device) != "same" \
                and t.element_size() > self.dtype.itemsize:
            entry = _Entry(_to_host(t.to(self.dtype)), t.device, t.dtype)
        else:
            entry = _Entry(_to_host(t), t.device)
        self._entries.append(weakref.ref(entry))
        self._by_tensor[id(t)] = (weakref.ref(t), weakref.ref(entry))
        self.stats.host_bytes += entry.host.numel() * entry.host.element_size()
        self.stats.tensors += 1
        return entry

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        return _finish_fetch(packed)

    def prefetch(self) -> None:
        """Start bringing every tensor of the group back (no-op for those gone)."""
        for ref in self._entries:
            entry = ref()
            if entry is not None:
                _start_fetch(entry)


def _frozen_storages(root: nn.Module) -> set[int]:
    return {t.untyped_storage()._cdata for t in (*root.parameters(), *root.buffers())}


@dataclass
class BlockOffload:
    """The group of an offloaded block's latest forward (read by the prefetch trigger)."""

    group: OffloadGroup | None = None
    dtype: torch.dtype | None = None  # compressed host copies (NOTE [ Compressed offload ])

    def __getstate__(self) -> dict[str, Any]:
        # a copy of the model starts without the last step's host copies (they hold weak
        # references, and belong to the original's graph)
        return {"group": None, "dtype": self.dtype}


class _Root:
    """A weak reference to the model an offloaded block belongs to (its parameters are
    never offloaded); a copy or a pickle refers to the copy's model (NOTE [ Copying and
    pickling an applied model ] in ``wrap.py``)."""

    def __init__(self, root: nn.Module) -> None:
        self.ref = weakref.ref(root)

    def frozen(self) -> set[int]:
        owner = self.ref()
        return _frozen_storages(owner) if owner is not None else set()

    def __getstate__(self) -> nn.Module | None:
        return self.ref()

    def __setstate__(self, root: nn.Module | None) -> None:
        self.ref = weakref.ref(root) if root is not None else (lambda: None)  # type: ignore[assignment]


class _OffloadedForward:
    """``original`` run with its saved tensors offloaded (NOTE [ Offloading saved
    tensors ]); ``state.group`` is the latest call's group."""

    def __init__(self, original: Callable[..., Any], root: nn.Module,
                 state: BlockOffload, name: str = "") -> None:
        self.original = original
        self.root = _Root(root)
        self.state = state
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        if torch.compiler.is_compiling():
            refuse_under_compile("an offloaded block", "its saved-tensor hooks copy "
                                 "between streams from Python")
        refuse_under_func_transforms(repr(self.name))
        group = OffloadGroup(self.root.frozen(), self.state.dtype)
        self.state.group = group
        with torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack):
            return self.original(*args, **kwargs)


def offload_forward(original: Callable[..., Any], root: nn.Module,
                    state: BlockOffload) -> Callable[..., Any]:
    """``original`` run with its saved tensors offloaded (NOTE [ Offloading saved
    tensors ]); ``state.group`` is the latest call's group."""
    return _OffloadedForward(original, root, state)


@dataclass(frozen=True)
class _Prefetch:
    """The forward hook :func:`prefetch_hook` returns."""

    state: BlockOffload

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        group = self.state.group
        for t in torch.utils._pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad and \
                    (t.is_floating_point() or t.is_complex()):
                if group is not None:
                    t.register_hook(functools.partial(_prefetch, group))
                return


def _prefetch(group: OffloadGroup, grad: torch.Tensor) -> None:
    group.prefetch()


def prefetch_hook(state: BlockOffload) -> Callable[..., None]:
    """A forward hook for the block after an offloaded one: when that block's backward
    starts (the gradient of its output is ready), the offloaded block's tensors start
    coming back."""
    return _Prefetch(state)


def offload(module: nn.Module, root: nn.Module, after: nn.Module | None, *,
            input_only: bool = False,
            dtype: torch.dtype | None = None, name: str = "") -> tuple[BlockOffload, Any]:
    """Offload ``module``'s saved tensors (``is_wrapped``: offload), or with ``input_only``
    checkpoint it and offload its input (offload_input); ``unwrap``
    undoes either. What was offloaded is prefetched when the backward of ``after`` (the
    next block, if any) starts; ``name`` (the module's) is for error messages. Returns
    the block's state and the prefetch hook's handle (to remove with the wrapper;
    ``None`` without ``after``). With ``dtype``, floating tensors wider than it are
    stored in it (NOTE [ Compressed offload ])."""
    state = BlockOffload(dtype=dtype)
    if input_only:
        wrap(module, Decision.OFFLOAD_INPUT,
             inputs=functools.partial(_InputOffloaded, root=root, state=state), name=name)
    else:
        install_forward(module, lambda original: _OffloadedForward(
            original, root, state, name or type(module).__name__), Decision.OFFLOAD)
    handle = after.register_forward_hook(prefetch_hook(state)) if after is not None else None
    return state, handle


@contextmanager
def offloading(model: nn.Module, names: list[str], saved: list[str],
               inputs: Sequence[str] = ()) -> Iterator[dict[str, BlockOffload]]:
    """Temporarily offload the saved tensors of the ``saved`` blocks of the chain
    ``names``, and checkpoint the ``inputs`` blocks with their input offloaded; yields
    their states (what each one's last forward offloaded)."""
    handles = []
    modules = []
    states = {}
    try:
        for name in [*saved, *inputs]:
            i = names.index(name)
            module = model.get_submodule(name)
            after = model.get_submodule(names[i + 1]) if i + 1 < len(names) else None
            modules.append(module)
            states[name], handle = offload(module, model, after, input_only=name in inputs,
                                           name=name)
            handles.append(handle)
        yield states
    finally:
        for handle in handles:
            if handle is not None:
                handle.remove()
        for module in modules:
            unwrap(module)


def measure_host_bandwidth(device: torch.device, nbytes: int = 64 << 20,
                           repeats: int = 3) -> float:
    """Bytes per second of a copy to host memory and back on ``device`` (the slower of
    the two directions, median of ``repeats``); ``0.0`` where the host is the device
    (nothing is copied). On CUDA, pinned memory and CUDA events; on a CPU under
    :func:`simulated_host`, a memory copy (what offload then runs)."""
    kind = _host_kind(device)
    if kind == "same":
        return 0.0
    if device.type == "meta":
        raise RematError("no host bandwidth can be measured on meta; give host_bandwidth= "
                         "(bytes per second, e.g. 25e9 for PCIe 4.0 x16)")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times: dict[str, list[float]] = {"d2h": [], "h2d": []}
    if kind == "pinned":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        for _ in range(repeats + 1):  # the first is a warm-up
            for way, (dst, frm) in {"d2h": (host, src), "h2d": (src, host)}.items():
                start, stop = torch.cuda.Event(enable_timing=True), \
                    torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(frm, non_blocking=True)
                stop.record()
                stop.synchronize()
                times[way].append(start.elapsed_time(stop) / 1e3)
    else:
        import time
        for _ in range(repeats + 1):
            for way in times:
                begin = time.perf_counter()
                src.clone()
                times[way].append(time.perf_counter() - begin)
    slowest = max(sorted(t[1:])[len(t[1:]) // 2] for t in times.values())
    return nbytes / slowest if slowest > 0 else 0.0


def _first_float(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | str | None:
    """Where the first floating-point tensor argument is: a position, a keyword, or
    ``None``."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return i
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return k
    return None


def input_offloaded(original: Callable[..., Any], root: nn.Module, state: BlockOffload,
                    call: Callable[[Callable[[], Any]], Any]) -> Callable[..., Any]:
    """``original`` run by ``call`` (a checkpoint of a function of no arguments), with
    its first floating-point tensor argument (the chain's hidden state; others, such as
    masks and rotary tables, are shared by every block and stay) offloaded once the
    forward is done, and fetched back for the recompute.

    NOTE [ Offloading a checkpoint's input ]
        Non-reentrant checkpoint keeps the arguments of its function for the recompute
        (in a closure). We give it a function of no arguments that reads them from a
        box: after the forward, the box's copy of the input is replaced by a handle to
        a host copy, so nothing holds the device tensor any more; the recompute reads
        the handle back (prefetched when the next block's backward starts, as for an
        offloaded block) as a leaf with the input's ``requires_grad``, which is all a
        recompute needs: checkpoint takes gradients from the forward's graph and only
        values from the recompute.
    """
    return _InputOffloaded(original, call, root=root, state=state)


class _InputOffloaded:
    """The forward :func:`input_offloaded` returns."""

    def __init__(self, original: Callable[..., Any], call: Callable[[Callable[[], Any]], Any],
                 *, root: nn.Module, state: BlockOffload) -> None:
        self.original = original
        self.call = call
        self.root = _Root(root)
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        where = _first_float(args, kwargs)
        box: dict[str, Any] = {"args": list(args), "kwargs": dict(kwargs)}
        # NOTE [ Arguments as they were called ] in wrap.py: the recompute's lists and
        # dicts as they were at the call, not as the caller may have changed them since
        called = snapshot_arguments(args, kwargs)
        original = self.original

        def run() -> Any:
            a, k = list(box["args"]), dict(box["kwargs"])
            if box.get("recompute"):
                a, k = as_called(a, k)
            if where is not None:
                holder: Any = a if isinstance(where, int) else k
                if isinstance(holder[where], _PackedInput):
                    holder[where] = holder[where].fetch()
            return original(*a, **k)

        out = self.call(run)
        if called is not None:
            box["args"], box["kwargs"] = list(called[0]), dict(called[1])
            box["recompute"] = True
        if where is not None:
            group = OffloadGroup(self.root.frozen(), self.state.dtype)
            self.state.group = group
            holder = box["args"] if isinstance(where, int) else box["kwargs"]
            holder[where] = _PackedInput(group.pack(holder[where]),
                                         holder[where].requires_grad, group)
        return out


@dataclass(frozen=True)
class _PackedInput:
    """A checkpoint's input while it is offloaded."""

    packed: Any  # what OffloadGroup.pack returned
    requires_grad: bool
    group: OffloadGroup

    def fetch(self) -> torch.Tensor:
        t = self.group.unpack(self.packed)
        if t.requires_grad != self.requires_grad:
            t = t.detach().requires_grad_(self.requires_grad)
        return t
