"""Exact step-memory measurement by storage-level accounting.

``track_memory()`` watches every ATen op through a ``TorchDispatchMode``. Each tensor
storage an op *creates* is counted once, however many views share it, and is uncounted
when the storage is freed (a weak reference to the storage fires). Storages that existed
before the region (parameters, the batch) are never counted, and neither is a storage
first met through a view of one of them.

NOTE [ Why storages and not tensors ]
    Autograd saves views (``t()`` of a weight, slices of a fused qkv projection). Counting
    tensor sizes would count one buffer many times, and counting the ``t()`` inside
    ``nn.Linear`` as an allocation overstates an MLP step by ~40%. A storage is the unit
    the allocator hands out, so its bytes are what the device really holds.

NOTE [ Frees ]
    PyTorch keeps one Python object per live storage (PyObject preservation), so a
    ``weakref`` to it fires exactly when the C++ storage is released, including when
    autograd drops saved tensors during backward. The callback only appends to the log;
    every analysis is done afterwards from that log.

NOTE [ CUDA allocator rounding ]
    On CUDA the truth is the caching allocator: a step's peak is the rise of
    ``torch.cuda.max_memory_allocated()``, which counts *blocks*, and a request of n > 0
    bytes gets a block of ``max(512, ceil(n / 512) * 512)`` bytes (``round_size`` with
    ``kMinBlockSize = 512`` in ``c10/cuda/CUDACachingAllocator.cpp``; a 0-byte storage
    gets none). Counting ``nbytes``, predictions were 0.3% low on an H100 and plans
    measured 12-23 MB over their budgets, so storages on a CUDA device are counted in
    blocks (``rounding=None`` picks by each storage's device), and ``rounding="cuda"``
    forces it for any device, so that a step run on ``meta`` predicts a CUDA device's
    bytes (``estimate(device="cuda")``).
    Not modelled, each making the allocator's figure larger than the tracker's:
    * a block taken from the large pool (requests over 1 MiB) is split only when more
      than 1 MiB would remain, so a request served from a slightly larger cached block
      (or a fresh segment: requests of 1-10 MiB get 20 MiB segments, larger ones are
      rounded to 2 MiB) holds the whole block, up to 1 MiB more; this depends on what is
      cached, i.e. on the steps before;
    * ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) with
      ``roundup_power2_divisions`` (rounds to power-of-two divisions instead),
      ``max_split_size_mb`` (blocks above it are never split) or ``expandable_segments``
      (splits differently; not verified): the tracker then says so in ``notes`` and
      warns, see :func:`allocator_config_note`;
    * the cuBLAS workspace, allocated once per handle and stream on the first matmul:
      run one step before measuring so that it is not in the rise;
    * on ``meta`` (``estimate``), memory a CUDA kernel allocates and frees inside one
      op: on a CUDA device the tracker reads it from the allocator (NOTE [ Memory a
      kernel allocates inside an op ]).

Known limitations:
    * Scratch memory a kernel allocates and frees inside one op (e.g. a matmul's packing
      buffer) is invisible; on CPU the OS cross-check in the tests bounds it.
    * On CUDA, the allocator effects listed in NOTE [ CUDA allocator rounding ].
    * Inside ``torch.compile``d frames a Python dispatch mode makes Dynamo fall back to
      eager, so a compiled step must be measured from outside (``os_peak_bytes``).
"""

from __future__ import annotations

import os
import re
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from autoremat._core.errors import RematError, did_you_mean
from autoremat._core.step import sparse_parts
from autoremat._measure.flops import FlopCounter

__all__ = [
    "CUDA_MIN_BLOCK_BYTES",
    "CUDA_SMALL_BYTES",
    "AllocatorPeak",
    "AllocatorProbe",
    "MemoryTracker",
    "Rounding",
    "StorageRecord",
    "active_tracker",
    "allocator_config_note",
    "allocator_probe",
    "counted_bytes",
    "cuda_block_bytes",
    "os_peak_bytes",
    "reset_os_peak",
    "track_allocator",
    "track_memory",
]

# How a storage's bytes are counted: "exact" (its nbytes) or "cuda" (the block the CUDA
# caching allocator hands out for it); see NOTE [ CUDA allocator rounding ].
Rounding = Literal["exact", "cuda"]

CUDA_MIN_BLOCK_BYTES = 512  # kMinBlockSize of c10/cuda/CUDACachingAllocator.cpp
CUDA_SMALL_BYTES = 1 << 20  # kSmallSize: larger requests come from the large pool

# PYTORCH_CUDA_ALLOC_CONF settings that change the blocks the allocator hands out
# ("backend:cudaMallocAsync" replaces the caching allocator with CUDA's own: no 512-byte
# blocks, and peak statistics of its own making)
_UNMODELLED_SETTINGS = ("roundup_power2_divisions", "max_split_size_mb", "expandable_segments",
                        "backend")


def cuda_block_bytes(nbytes: int) -> int:
    """Bytes the CUDA caching allocator counts for a storage of ``nbytes`` (default
    settings): ``max(512, ceil(n / 512) * 512)``, and 0 for an empty storage.

    Example:
        >>> cuda_block_bytes(100), cuda_block_bytes(513), cuda_block_bytes(4096)
        (512, 1024, 4096)
    """
    if nbytes <= 0:
        return 0
    blocks = -(-nbytes // CUDA_MIN_BLOCK_BYTES)  # ceil
    return max(CUDA_MIN_BLOCK_BYTES, blocks * CUDA_MIN_BLOCK_BYTES)


def counted_bytes(nbytes: int, device: torch.device | str, rounding: Rounding | None) -> int:
    """The bytes :func:`track_memory` counts for a storage of ``nbytes`` on ``device``
    with ``rounding`` (``None``: CUDA blocks on a CUDA device, exact elsewhere).

    Example:
        >>> counted_bytes(100, "cpu", None), counted_bytes(100, "meta", "cuda")
        (100, 512)
    """
    if rounding is None:
        rounding = "cuda" if torch.device(device).type == "cuda" else "exact"
    return cuda_block_bytes(nbytes) if rounding == "cuda" else nbytes


def allocator_config_note(environ: Mapping[str, str] | None = None) -> str | None:
    """A sentence saying that CUDA bytes are not modelled exactly, when
    ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) sets what changes the
    allocator's blocks (NOTE [ CUDA allocator rounding ]); ``None`` otherwise.

    Example:
        >>> allocator_config_note({}) is None
        True
        >>> "max_split_size_mb" in allocator_config_note(
        ...     {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})
        True
    """
    environ = os.environ if environ is None else environ
    found = []
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for item in environ.get(var, "").split(","):
            key, _, value = item.partition(":")
            key = key.strip()
            if key not in _UNMODELLED_SETTINGS:
                continue
            if key == "expandable_segments" and value.strip().lower() != "true":
                continue
            if key == "backend" and value.strip() != "cudaMallocAsync":
                continue  # "native": the caching allocator modelled here
            found.append(f"{var}={key}:{value.strip()}")
    if not found:
        return None
    return (f"{', '.join(found)} changes how the CUDA caching allocator rounds or splits "
            "blocks; the tracker models the default (512-byte blocks), so its CUDA figures "
            "may differ from torch.cuda.max_memory_allocated()")


@dataclass(slots=True)
class StorageRecord:
    """One storage created inside the tracked region."""

    nbytes: int  # bytes it occupies: nbytes, or its CUDA block (rounding); resizes update it
    op: str  # the ATen op that created it, e.g. "aten.mm.default"
    born: int  # event index at which it was counted
    backward: bool  # created while autograd's engine was running (backward/recompute)
    died: int | None = None  # event index at which it was freed; None = alive at exit
    # memory a kernel allocated and freed inside the op (the CUDA allocator's peak in
    # the op above its end level; NOTE [ Memory a kernel allocates inside an op ]): born
    # at the op's last event, dead at the next; no storage of the step
    transient: bool = False
    # of nbytes, the remainder of a large block handed out whole (CUDA; NOTE [ Blocks the
    # allocator does not split ])
    remainder: int = 0


@dataclass
class MemoryTracker:
    """What ``track_memory`` measured. Levels are bytes above the level at entry.

    Attributes:
        peak_bytes: the highest level reached.
        current_bytes: the level now (at exit: what the region left allocated).
        records: every storage the region created, in creation order.
        levels: the level after each event (event ``k`` is ``levels[k]``; ``levels[0]``
            is the entry level 0).
        ops: the op name for each event ("free" for a release).
        marks: ``(event_index, label)`` pairs added with :meth:`mark`.
        rounding: how storages were counted (``None``: by each storage's device).
        notes: what the figures do not model (e.g. the allocator's settings).
    """

    peak_bytes: int = 0
    current_bytes: int = 0
    records: list[StorageRecord] = field(default_factory=list)
    levels: list[int] = field(default_factory=lambda: [0])
    ops: list[str] = field(default_factory=lambda: ["enter"])
    marks: list[tuple[int, str]] = field(default_factory=list)
    rounding: Rounding | None = None
    notes: list[str] = field(default_factory=list)
    # told (op, args, output, its first event) after each op, while a checkpointed region
    # whose ops are tagged runs (``regions.py``); None: nothing listens
    region: Callable[[Any, tuple[Any, ...], Any, int], None] | None = field(
        default=None, repr=False, compare=False)
    _peak_event: int = 0
    _closed: bool = False
    # re-entrant: a storage's free callback can run inside a locked region of the same
    # thread, where an allocation there starts Python's garbage collector and it frees a
    # storage held in a cycle (an exception's traceback); a plain Lock deadlocked there
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def mark(self, label: str) -> None:
        """Label the current point of the timeline (e.g. ``"fwd:blocks.3"``)."""
        with self._lock:
            self.marks.append((len(self.levels) - 1, label))

    @property
    def peak_event(self) -> int:
        """Event index of the (first) peak."""
        return self._peak_event

    def live_at(self, event: int) -> list[StorageRecord]:
        """Records alive just after ``event``."""
        return [
            r for r in self.records if r.born <= event and (r.died is None or r.died > event)
        ]

    @property
    def breakdown(self) -> dict[str, int]:
        """Bytes live at the peak, by kind.

        ``activations``: created in forward (mostly what autograd saved for backward);
        ``gradients``: created in backward and still alive at exit (``.grad`` buffers);
        ``temporaries``: created in backward and freed before exit (incoming gradients,
        recomputed activations, scratch).
        """
        out = {"activations": 0, "gradients": 0, "temporaries": 0}
        for r in self.live_at(self._peak_event):
            if not r.backward:
                out["activations"] += r.nbytes
            elif r.died is None:
                out["gradients"] += r.nbytes
            else:
                out["temporaries"] += r.nbytes
        return out

    def window_peak(self, start: int, stop: int) -> int:
        """Highest level over events ``start..stop`` (inclusive)."""
        return max(self.levels[start : stop + 1])

    def timeline(self) -> list[tuple[int, int]]:
        """``(event_index, level_bytes)`` pairs, for plotting."""
        return list(enumerate(self.levels))

    # -- called by the dispatch mode and the finalizers -------------------------------
    def _transient(self, nbytes: int, op: str, backward: bool) -> None:
        """``nbytes`` an op allocated and freed inside itself: up and down again."""
        with self._lock:
            born = len(self.levels)
            self.records.append(StorageRecord(nbytes=nbytes, op=op, born=born,
                                              backward=backward, died=born + 1,
                                              transient=True))
            self._record(nbytes, op)
            self._record(-nbytes, "free")

    def _record(self, delta: int, op: str) -> None:
        self.current_bytes += delta
        self.levels.append(self.current_bytes)
        self.ops.append(op)
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self._peak_event = len(self.levels) - 1


# what ATen ops take besides tensors and containers: skipped by type, without the
# isinstance checks against torch.Tensor (whose metaclass makes them dear) that the
# tracker would pay for every number of a shape on every op
_ATOMS: frozenset[type] = frozenset({int, float, bool, str, complex, type(None), torch.dtype,
                                     torch.device, torch.layout, torch.memory_format,
                                     torch.SymInt, torch.SymFloat, torch.SymBool})


def _tensors_in(obj: Any, found: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results, in order: ``tree_flatten``'s tensors
    for what ATen ops take and return (tensors inside tuples, lists and dicts), at a
    fraction of its cost, which the tracker pays on every op."""
    found = [] if found is None else found
    kind = type(obj)
    if kind in _ATOMS:
        return found
    if kind is tuple or kind is list or isinstance(obj, (tuple, list)):
        for item in obj:
            if type(item) in _ATOMS:
                continue
            if isinstance(item, torch.Tensor) and item.layout is torch.strided:
                found.append(item)  # the common case, without a call
            elif isinstance(item, (tuple, list, dict, torch.Tensor)):
                _tensors_in(item, found)
    elif isinstance(obj, torch.Tensor):
        if obj.layout is torch.strided:
            found.append(obj)
        else:
            found.extend(sparse_parts(obj))
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors_in(item, found)
    return found


def _storage_keys(args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
    """The keys (``_cdata``) of the storages of the tensors in an op's arguments."""
    return {t.untyped_storage()._cdata for t in _tensors_in(args, _tensors_in(kwargs))
            } if kwargs else {t.untyped_storage()._cdata for t in _tensors_in(args)}


_NO_KEYS: frozenset[int] = frozenset()


class _StorageAccountant(TorchDispatchMode):
    """Counts the storages ops create; see the module notes."""

    def __init__(self, tracker: MemoryTracker, through: FlopCounter | None = None,
                 probe: AllocatorProbe | None = None) -> None:
        super().__init__()
        self.tracker = tracker
        self.through = through  # runs each op for us (NOTE [ One mode for two instruments ])
        self.probe = probe  # the allocator's peak inside each op (CUDA)
        self._noted_cuda = False  # allocator settings checked (first CUDA-rounded storage)
        # key (StorageImpl address) -> record, for storages alive now.
        self._live: dict[int, StorageRecord] = {}
        # Storages from before the region seen through a view; never counted.
        self._foreign: dict[int, weakref.ref[Any]] = {}
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._names: dict[Any, str] = {}  # op -> str(op), which is slow to format
        self._viewing: dict[Any, bool] = {}  # op -> an ATen view (_allocates_nothing)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        first = len(self.tracker.levels)
        probe = self.probe
        if probe is not None and self._allocates_nothing(func):
            probe = None  # NOTE [ Memory a kernel allocates inside an op ]: nothing to read
        if probe is not None:
            probe.before(self.tracker.current_bytes)
        out = func(*args, **kwargs) if self.through is None else \
            self.through.dispatch(func, types, args, kwargs)
        if probe is not None:  # the allocator around the op, counted once its storages are
            hidden, rise = probe.after()
            level, made = self.tracker.current_bytes, len(self.tracker.records)
        in_backward = torch._C._current_graph_task_id() != -1
        name = self._names.get(func)
        if name is None:
            name = self._names[func] = str(func)
        input_keys: set[int] | None = None  # the inputs' storages, read once one is needed
        outputs = (out,) if isinstance(out, torch.Tensor) and out.layout is torch.strided \
            else _tensors_in(out)
        for t in outputs:
            storage = t.untyped_storage()
            key = storage._cdata
            if input_keys is None and key not in self._live and key not in self._foreign:
                input_keys = _storage_keys(args, kwargs)
            self._see(storage, t.is_cuda, name, input_keys or _NO_KEYS, in_backward)
        if probe is not None:
            counted = self.tracker.current_bytes - level  # the blocks of the storages it made
            if rise > counted > 0 and self.tracker.rounding != "exact":
                self._whole_blocks(rise - counted, made, name)
            if hidden > 0:
                self.tracker._transient(hidden, name, in_backward)
            probe.settle(self.tracker.current_bytes)
        region = self.tracker.region
        if region is not None:  # the events this op made: first .. levels now
            region(func, args, out, first)
        return out

    def _allocates_nothing(self, func: Any) -> bool:
        """Whether ``func`` is an ATen view (its schema says its result aliases an
        argument it does not write): it launches no kernel and allocates nothing, so the
        probe is not read around it (read once per overload)."""
        found = self._viewing.get(func)
        if found is None:
            found = self._viewing[func] = bool(
                getattr(func, "is_view", False) and getattr(func, "namespace", "") == "aten")
        return found

    def _see(self, storage: torch.UntypedStorage, is_cuda: bool, op: str,
             input_keys: set[int] | frozenset[int], backward: bool) -> None:
        key = storage._cdata
        tracker = self.tracker
        with tracker._lock:
            live = self._live.get(key)
            if live is not None:
                # resize_ / set_ on an output
                grown = self._bytes(storage, is_cuda) + live.remainder - live.nbytes
                if grown:
                    live.nbytes += grown
                    tracker._record(grown, op)
                return
            if key in self._foreign:
                return
            if key in input_keys:
                # First met as both input and output (a view or an in-place op on a
                # storage from before the region): not an allocation.
                self._foreign[key] = weakref.ref(storage, self._forget_foreign(key))
                return
            record = StorageRecord(
                nbytes=self._bytes(storage, is_cuda), op=op, born=len(tracker.levels),
                backward=backward
            )
            self._live[key] = record
            tracker.records.append(record)
            tracker._record(record.nbytes, op)
            self._refs[key] = weakref.ref(storage, self._on_free(key))

    def _whole_blocks(self, extra: int, made: int, op: str) -> None:
        """The allocator's level rose ``extra`` bytes more over the op than the blocks of
        the storages it made (records ``made`` on): a large block handed out whole
        (NOTE [ Blocks the allocator does not split ]), counted to the largest of them."""
        tracker = self.tracker
        with tracker._lock:
            large = [r for r in tracker.records[made:]
                     if r.nbytes > CUDA_SMALL_BYTES and r.died is None and not r.transient]
            if not large or extra > CUDA_SMALL_BYTES * len(large):
                return  # not a block's remainder: memory the op keeps (a workspace made once)
            record = max(large, key=lambda r: r.nbytes)
            record.nbytes += extra
            record.remainder += extra
            tracker._record(extra, op)

    def _bytes(self, storage: torch.UntypedStorage, is_cuda: bool) -> int:
        """What ``storage`` occupies (``is_cuda``: it is on a CUDA device; the storage's own
        property is slow to read): see NOTE [ CUDA allocator rounding ]."""
        if self.tracker.rounding != "cuda" and not is_cuda:
            return storage.nbytes()  # exact: counted_bytes's own figure, without its checks
        rounding = self.tracker.rounding or \
            ("cuda" if storage.device.type == "cuda" else "exact")
        if rounding == "cuda" and not self._noted_cuda:  # the first CUDA-rounded storage
            self._noted_cuda = True
            note = allocator_config_note()
            if note is not None:
                self.tracker.notes.append(note)
                warnings.warn(note, RuntimeWarning, stacklevel=2)
        return counted_bytes(storage.nbytes(), storage.device, rounding)

    def _on_free(self, key: int):  # type: ignore[no-untyped-def]
        def callback(_ref: object) -> None:
            tracker = self.tracker
            with tracker._lock:
                record = self._live.pop(key, None)
                self._refs.pop(key, None)
                if record is None or tracker._closed:
                    return
                record.died = len(tracker.levels)
                tracker._record(-record.nbytes, "free")

        return callback

    def _forget_foreign(self, key: int):  # type: ignore[no-untyped-def]
        def callback(_ref: object) -> None:
            self._foreign.pop(key, None)

        return callback


def active_tracker() -> MemoryTracker | None:
    """The tracker of the innermost ``track_memory`` whose mode is on the dispatch mode
    stack here (also in backward, which runs with the forward's modes), or ``None``: for
    a dispatch mode below it that reads the timeline's event count as it runs."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, _StorageAccountant):
            return mode.tracker
    return None


def live_record(storage: torch.UntypedStorage) -> StorageRecord | None:
    """The record of ``storage`` in the innermost ``track_memory`` on the dispatch mode
    stack here, where it made the storage and the storage is alive; ``None`` otherwise."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, _StorageAccountant):
            return mode._live.get(storage._cdata)
    return None


@contextmanager
def track_memory(rounding: Rounding | None = None) -> Iterator[MemoryTracker]:
    """Measure the peak of live tensor-storage bytes inside the ``with`` block.

    Works on any device, including ``meta`` and fake tensors, because it only reads
    storage sizes. The figures are bytes above the level at entry: storages that existed
    before (parameters, the batch) are never counted.

    Args:
        rounding: how a storage's bytes are counted. ``None`` (default): by its device,
            the CUDA caching allocator's blocks for a storage on a CUDA device and its
            exact ``nbytes`` elsewhere (CPU, ``meta``); ``"cuda"``: the CUDA blocks for
            every storage, to predict a CUDA device's bytes from a step on ``meta``;
            ``"exact"``: ``nbytes`` for every storage. See NOTE [ CUDA allocator
            rounding ].

    Returns:
        A :class:`MemoryTracker`; ``peak_bytes`` and ``breakdown`` are final once the
        block exits.

    Example:
        >>> import torch, autoremat
        >>> w = torch.randn(64, 64, requires_grad=True)
        >>> with autoremat.track_memory() as mem:
        ...     (torch.randn(8, 64) @ w).relu().sum().backward()
        >>> mem.peak_bytes > 0
        True
    """
    with _tracked(rounding) as tracker:
        yield tracker


@contextmanager
def _tracked(rounding: Rounding | None = None,
             through: FlopCounter | None = None) -> Iterator[MemoryTracker]:
    """:func:`track_memory`, with ``through`` (a mode not entered) running each op for
    the tracker (NOTE [ One mode for two instruments ])."""
    # NOTE [ One mode for two instruments ]
    #     A Python dispatch mode costs about 30% of a small model's step by itself (the
    #     zoo's gpt2 and llama on CPU: a mode that does nothing, x1.28 and x1.35 a plain
    #     step; the tracker x1.39 and x1.59). A FLOP counter entered as a mode of its
    #     own, outside the tracker, pays it again; called by the tracker in place of the
    #     op (``through``), it sees the same ops in the same order, the tracker's first
    #     and then its own, as when it is entered outside: the tracker's handler runs
    #     first in both, and the counter creates no storage.
    # The first dispatch mode of a process imports torch._dynamo lazily; that import keeps
    # caller frames (and their tensors) alive in a reference cycle. Import it first.
    import torch._dynamo  # noqa: F401

    if rounding is not None and rounding not in get_args(Rounding):
        raise RematError(f"rounding must be None, 'exact' or 'cuda', got {rounding!r}."
                         + did_you_mean(str(rounding), get_args(Rounding)))
    tracker = MemoryTracker(rounding=rounding)
    probe = allocator_probe()
    mode = _StorageAccountant(tracker, through, probe)
    try:
        with mode:
            yield tracker
    finally:
        with tracker._lock:
            tracker._closed = True
        if probe is not None:
            probe.close()


# --- the CUDA caching allocator's view -------------------------------------------------


@dataclass
class AllocatorPeak:
    """What :func:`track_allocator` measured."""

    device: torch.device
    peak_bytes: int | None = None  # rise of max_memory_allocated; None off CUDA
    # the highest peak a probe read before it reset the statistics inside the block
    # (NOTE [ Memory a kernel allocates inside an op ])
    _folded: int = field(default=0, repr=False)


_OPEN_PEAKS: list[AllocatorPeak] = []  # track_allocator blocks open now, outermost first
_PEAKS_LOCK = threading.Lock()


def _fold_peak(index: int, peak: int) -> None:
    """A peak read on CUDA device ``index`` just before its statistics are reset: every
    open :func:`track_allocator` on that device keeps the highest."""
    with _PEAKS_LOCK:
        for open_peak in _OPEN_PEAKS:
            if open_peak.device.index == index and peak > open_peak._folded:
                open_peak._folded = peak


# NOTE [ Blocks the allocator does not split ]
#     The caching allocator serves a request over 1 MiB from a cached block, or a fresh
#     segment, and splits off the rest only when more than 1 MiB would remain: otherwise
#     the request holds the whole block, and the allocator counts it, up to 1 MiB more
#     than the 512-byte rounding the tracker counts (NOTE [ CUDA allocator rounding ]).
#     Which block a request meets depends on what is cached, i.e. on the steps before.
#     On an H200 this remainder made plans' peaks 0-14 MiB (0-6%) above their
#     predictions once the memory inside ops was counted (benchmarks/allocator_gap.py:
#     ``mm``, ``mul``, ``add`` and dropout outputs of 1-50 MiB, at most 1 MiB each).
#     On CUDA the probe gives each op's rise of the allocator's level; where it exceeds
#     the blocks of the storages the op made by no more than 1 MiB per large one, the
#     rest is counted to the largest of them, which gives it back when it is freed. The
#     tracker then counts, in the steps it measures, the blocks the allocator handed
#     out; a rise larger than that is memory the op keeps past itself (a workspace made
#     once) and is not counted. Plans built from those steps carry their remainders;
#     a plan's own step can meet other blocks, which gpu_exact.py measures.


# NOTE [ Memory a kernel allocates inside an op ]
#     Some CUDA kernels allocate working memory from the caching allocator and free it
#     before the op returns: flash and memory-efficient attention's backward (fp32
#     accumulators for dq), cuBLASLt's workspace, cuDNN's. The allocator counts it, a
#     storage tracker cannot see it: on an H200 (gpu_exact.py, zoo gpt2 in bf16) the
#     tracker's peaks were 9-16% below the allocator's and plans planned at their
#     budgets went over them. So on CUDA the tracker reads the allocator around every op
#     (:class:`AllocatorProbe`): statistics reset before the op, and after it the peak
#     above the level the op ends at is what the op held inside itself. The tracker
#     adds it as a transient record (up at the op's last event, down at the next), so
#     that every window, option and plan built from the timeline counts it where the op
#     runs, in forward and in recompute alike.
#     Resetting the peak statistics would spoil a ``track_allocator`` around the
#     tracker (verify measures both at once): the probe hands each peak it drops to the
#     open ``track_allocator`` blocks first (``_fold_peak``), which take the highest.
#     Code outside autoremat that reads ``max_memory_allocated`` across a tracked step
#     sees only what happened since the step's last op.
#     ATen views (``func.is_view``: ``t``, ``view``, ``expand``, ``slice``, ``detach``, ...,
#     half the ops of the zoo's gpt2 and llama steps) launch no kernel and allocate nothing: the
#     probe is not read around them, which spares two calls into the allocator (a reset,
#     and its statistics as a nested dict) per view. Between two probed ops only storages
#     are freed, which the tracker counts, so the level the next op starts from is the
#     same as with the views probed.


class AllocatorProbe:
    """The CUDA caching allocator around each op, on device ``index`` (NOTE [ Memory a
    kernel allocates inside an op ] and NOTE [ Blocks the allocator does not split ]).

    ``before(tracked)`` runs just before an op, given the tracker's level then;
    ``after()`` just after it returns the bytes the op held above its end level and the
    rise of the allocator's level over the op; ``settle(tracked)`` gives the tracker's
    level once it has counted the op. One read of the allocator per op: between ops
    only storages are freed, which the tracker counts, so the level an op starts from is
    the last one read less what the tracker saw freed since (a storage it never counted
    makes that too high, and the next read corrects it)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._level = self._start = self._fold_and_reset()  # the allocator's, last read
        self._tracked = 0  # the tracker's level when the allocator's was last read

    def _read(self) -> tuple[int, int]:
        stats = torch.cuda.memory_stats_as_nested_dict(self.index)["allocated_bytes"]["all"]
        current, peak = int(stats["current"]), int(stats["peak"])
        _fold_peak(self.index, peak)
        return current, peak

    def _fold_and_reset(self) -> int:
        current, _ = self._read()
        torch.cuda.reset_peak_memory_stats(self.index)
        return current

    def before(self, tracked: int) -> None:
        self._start = self._level - (self._tracked - tracked)
        # the peak since the last read is at most the level then, already kept
        torch.cuda.reset_peak_memory_stats(self.index)

    def after(self) -> tuple[int, int]:
        current, peak = self._read()
        self._level = current
        return max(0, peak - current), current - self._start

    def settle(self, tracked: int) -> None:
        self._tracked = tracked

    def close(self) -> None:
        self._fold_and_reset()


def allocator_probe() -> AllocatorProbe | None:
    """A probe of the current CUDA device where this process has initialised CUDA,
    else ``None`` (nothing on the device to read)."""
    if not torch.cuda.is_initialized():
        return None
    return AllocatorProbe(torch.cuda.current_device())


@contextmanager
def track_allocator(device: torch.device | str) -> Iterator[AllocatorPeak]:
    """On a CUDA ``device``, the rise of ``torch.cuda.max_memory_allocated()`` over the
    ``with`` block above the bytes allocated at entry (peak statistics are reset first;
    the device is synchronised at both ends). Elsewhere ``peak_bytes`` stays ``None``.

    Example:
        >>> with track_allocator("cpu") as alloc:
        ...     pass
        >>> alloc.peak_bytes is None
        True
    """
    result = AllocatorPeak(torch.device(device))
    if result.device.type != "cuda":
        yield result
        return
    if result.device.index is None:
        result.device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(result.device)
    torch.cuda.reset_peak_memory_stats(result.device)
    base = torch.cuda.memory_allocated(result.device)
    with _PEAKS_LOCK:
        _OPEN_PEAKS.append(result)
    try:
        yield result
    finally:
        with _PEAKS_LOCK:
            _OPEN_PEAKS.remove(result)
    torch.cuda.synchronize(result.device)
    peak = max(torch.cuda.max_memory_allocated(result.device), result._folded)
    result.peak_bytes = peak - base


# --- the operating system's view (CPU only) ------------------------------------------

_STATUS_RE = re.compile(r"^(VmHWM|VmRSS):\s+(\d+)\s+kB", re.MULTILINE)


def _status() -> dict[str, int]:
    path = Path("/proc/self/status")
    if not path.exists():
        raise RematError("the OS high-water mark needs Linux's /proc/self/status")
    found = dict(_STATUS_RE.findall(path.read_text()))
    return {k: int(v) * 1024 for k, v in found.items()}


def reset_os_peak() -> int:
    """Reset the process's resident high-water mark (Linux) and return the RSS now.

    Collects garbage, returns freed heap to the OS (``malloc_trim``), then writes ``5`` to
    ``/proc/self/clear_refs``. Start the process with
    ``MALLOC_MMAP_THRESHOLD_=65536`` or glibc keeps freed blocks resident and the
    figure stops tracking tensor memory.
    """
    _malloc_trim()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as exc:
        raise RematError(f"cannot reset the OS high-water mark: {exc}") from exc
    return _status()["VmRSS"]


def _malloc_trim() -> None:
    """Return freed heap memory to the OS (glibc), so that RSS reflects live memory."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def os_peak_bytes(since_rss: int) -> int:
    """Resident high-water mark above ``since_rss`` (from :func:`reset_os_peak`)."""
    return _status()["VmHWM"] - since_rss
