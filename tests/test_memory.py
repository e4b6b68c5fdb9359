"""Tests for autoremat.memory: storage-level step-memory accounting.

The synthetic steps below are small enough that their peak can be derived by hand from
what autograd saves and what backward allocates; each test spells the arithmetic out.
The last test cross-checks the accounting against the operating system's high-water mark
on the zoo models (in a subprocess, see ``_os_peak_probe.py``).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from autoremat import zoo
from autoremat._core.errors import RematError
from autoremat._core.step import run_step
from autoremat._measure import memory as memory_module
from autoremat._measure.memory import (
    CUDA_MIN_BLOCK_BYTES,
    CUDA_SMALL_BYTES,
    AllocatorPeak,
    MemoryTracker,
    allocator_config_note,
    counted_bytes,
    cuda_block_bytes,
    track_allocator,
    track_memory,
)

from conftest import SMALL

F32 = 4  # bytes per float32 element
B, D, K = 64, 16, 3  # batch, width, number of Linear+ReLU layers in the chain
S = B * D * F32  # one (B, D) activation: 4096 bytes
P = D * D * F32  # one (D, D) weight or its gradient: 1024 bytes
SCALAR = F32  # a 0-d float32 tensor (the loss, and the ones_like gradient backward seeds)

# --- the two synthetic steps --------------------------------------------------------


def _chain_inputs(device: str) -> tuple[list[nn.Linear], torch.Tensor]:
    torch.manual_seed(0)
    layers = [nn.Linear(D, D, bias=False, device=device) for _ in range(K)]
    x = torch.randn(B, D, device=device)  # (B, D), does not require grad
    return layers, x


def _chain_step(layers: list[nn.Linear], x: torch.Tensor) -> None:
    """``relu(W_K ... relu(W_1 x))``, summed, backward. No Python name holds an activation,
    so each is freed as soon as autograd is done with it."""

    def forward(h: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            h = torch.relu(layer(h))  # aten.t (a view of W) + aten.mm, then aten.relu
        return h

    forward(x).sum().backward()


# NOTE [ The chain's peak by hand ]
#     Forward, layer i: ``mm`` makes h_i (+S); ``relu`` makes a_i (+S); nobody saved h_i
#     (mm saves its *inputs* a_{i-1} and W_i.t(), relu saves its *output* a_i), so h_i
#     is freed (-S). ``W_i.t()`` is a view of a parameter: not an allocation. After the
#     forward a_1..a_K are alive (K*S); sum() makes the loss and backward() seeds it with
#     ones_like: K*S + 8.
#     Backward, layer K: threshold_backward makes g_h_K (+S) and releases a_K (-S). Then
#     MmBackward_K makes W_K.grad (+P, kept: it is stolen by AccumulateGrad because
#     mm's mat2 backward returns it column-major, which is W's layout after .t()) and
#     the gradient of a_{K-1} (+S). Alive now: a_1..a_{K-1}, g_h_K, g_a_{K-1}, one
#     weight gradient and the two scalars:
#         (K - 1)*S + S + S + P + 8 = (K + 1)*S + P + 8.
#     Each later layer i repeats the pattern with one activation fewer and one weight
#     gradient more, i.e. a change of P - S < 0 (S = 4 P here), and layer 1 computes no
#     input gradient at all (x does not require grad). So the first peak is that moment:
CHAIN_PEAK = (K + 1) * S + P + 2 * SCALAR  # 4*4096 + 1024 + 8 = 17416 bytes
#     Its breakdown: activations a_1..a_{K-1} plus the two scalars (created outside
#     autograd's engine); gradients W_K.grad (alive at exit); temporaries g_h_K, g_a_{K-1}.
CHAIN_BREAKDOWN = {"activations": (K - 1) * S + 2 * SCALAR, "gradients": P, "temporaries": 2 * S}
CHAIN_LEFT = K * P  # the weight gradients are all that is left after the step


def _view_inputs(device: str) -> tuple[nn.Parameter, torch.Tensor]:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(D, D, device=device))  # (D, D)
    x = torch.randn(B, D, device=device)  # (B, D)
    return w, x


def _view_step(w: nn.Parameter, x: torch.Tensor) -> None:
    y = torch.mm(x, w.t())  # w.t() is a view of the parameter: 0; y: +S
    y.relu_()  # in place: no new storage (relu_ saves its result, i.e. y itself)
    half = y[:, : D // 2]  # slicing: a view of y, 0
    half.sum().backward()


# NOTE [ The view step's peak by hand ]
#     Forward: y = S; the loss and the ones_like seed: +8.
#     Backward: SliceBackward scatters the (B, D/2) gradient into a zero-filled (B, D)
#     tensor (slice_backward, +S); ReluBackward makes the gradient of y before relu_
#     (threshold_backward, +S). Alive at that moment: y, both gradients, the scalars:
VIEW_PEAK = 3 * S + 2 * SCALAR  # 3*4096 + 8 = 12296 bytes
#     after which the slice gradient is freed and MmBackward makes w.grad (+P < S).
VIEW_LEFT = P  # w.grad


def _run_on(device: str, make: Callable[[str], tuple], step: Callable[..., None]) -> MemoryTracker:
    """Build the step's tensors on ``device`` ("fake": CPU tensors under FakeTensorMode) and
    track one call of it."""
    if device == "fake":
        with FakeTensorMode():
            args = make("cpu")
            assert isinstance(args[1], torch._subclasses.fake_tensor.FakeTensor)
            with track_memory() as mem:
                step(*args)
        return mem
    args = make(device)
    with track_memory() as mem:
        step(*args)
    return mem


# --- hand-computed peaks ------------------------------------------------------------


def test_linear_relu_chain_peak_is_exact() -> None:
    mem = _run_on("cpu", _chain_inputs, _chain_step)
    assert mem.peak_bytes == CHAIN_PEAK == 17416
    assert mem.breakdown == CHAIN_BREAKDOWN
    assert mem.current_bytes == CHAIN_LEFT
    # the forward alone: K activations plus one transient h_i before it is freed
    fwd_end = mem.ops.index("aten.sum.default")
    assert mem.window_peak(0, fwd_end - 1) == (K + 1) * S
    assert mem.levels[fwd_end - 1] == K * S


def test_views_slices_and_in_place_ops_peak_is_exact() -> None:
    mem = _run_on("cpu", _view_inputs, _view_step)
    assert mem.peak_bytes == VIEW_PEAK == 12296
    assert mem.current_bytes == VIEW_LEFT
    # every record is a real allocation: no t(), slice or relu_ was counted
    assert [r.op for r in mem.records] == [
        "aten.mm.default",  # y
        "aten.sum.default",  # loss
        "aten.ones_like.default",  # backward's seed
        "aten.slice_backward.default",
        "aten.threshold_backward.default",
        "aten.mm.default",  # w.grad
    ]
    assert [r.nbytes for r in mem.records] == [S, SCALAR, SCALAR, S, S, P]
    assert [r.backward for r in mem.records] == [False, False, False, True, True, True]


@pytest.mark.parametrize("device", ["meta", "fake"])
@pytest.mark.parametrize(
    ("make", "step", "peak", "left"),
    [
        (_chain_inputs, _chain_step, CHAIN_PEAK, CHAIN_LEFT),
        (_view_inputs, _view_step, VIEW_PEAK, VIEW_LEFT),
    ],
    ids=["chain", "views"],
)
def test_meta_and_fake_tensors_give_the_cpu_figure(
    device: str, make: Callable[[str], tuple], step: Callable[..., None], peak: int, left: int
) -> None:
    cpu = _run_on("cpu", make, step)
    other = _run_on(device, make, step)
    assert other.peak_bytes == cpu.peak_bytes == peak
    assert other.current_bytes == cpu.current_bytes == left
    assert other.levels == cpu.levels
    assert other.breakdown == cpu.breakdown


@pytest.mark.parametrize("name", zoo.names())
def test_zoo_step_on_meta_gives_the_cpu_figure(name: str) -> None:
    peaks = []
    for device in ("cpu", "meta"):
        model, inputs = zoo.build(name, device=device, **SMALL[name])
        with track_memory() as mem:
            run_step(model, inputs, None)
        assert sum(mem.breakdown.values()) == mem.peak_bytes
        peaks.append(mem.peak_bytes)
    assert peaks[0] == peaks[1] > 0


# --- what counts and what does not ---------------------------------------------------


def test_views_and_in_place_ops_on_a_preexisting_tensor_are_not_counted() -> None:
    base = torch.randn(64, 64)
    with track_memory() as mem:
        views = [
            base.t(),
            base[1:, ::2],
            base.view(-1),
            base.unsqueeze(0),
            base.detach(),
            base.as_strided((8,), (2,)),
            *base.split(16),
        ]
        base.add_(1.0)
        views[0].mul_(2.0)  # in place through a view
        base[0].zero_()
    assert mem.peak_bytes == 0
    assert mem.records == []
    assert mem.current_bytes == 0
    del views


def test_a_storage_shared_by_many_views_counts_once() -> None:
    with track_memory() as mem:
        buf = torch.empty(1000)  # 4000 bytes
        parts = buf.split(100)  # 10 views
        grid = buf.view(10, 100).t()
        for part in parts:
            part.fill_(1.0)
        grid.mul_(3.0)
        first = buf[:10].clone()  # a real copy: 40 bytes
    assert [r.nbytes for r in mem.records] == [4000, 40]
    assert mem.peak_bytes == mem.current_bytes == 4040
    del buf, parts, grid, first


def test_resize_of_a_tracked_storage_is_counted() -> None:
    with track_memory() as mem:
        t = torch.empty(10)  # 40 bytes
        t.resize_(100)  # grows the same storage to 400 bytes
    assert mem.peak_bytes == mem.current_bytes == 400
    assert len(mem.records) == 1 and mem.records[0].nbytes == 400
    del t


def test_current_bytes_returns_to_zero_when_everything_is_freed() -> None:
    layers, x = _chain_inputs("cpu")
    with track_memory() as mem:
        _chain_step(layers, x)
        assert mem.current_bytes == CHAIN_LEFT  # the weight gradients
        for layer in layers:
            layer.weight.grad = None
        scratch = torch.ones(1000)
        del scratch
    assert mem.peak_bytes == CHAIN_PEAK
    assert mem.current_bytes == 0
    assert mem.levels[-1] == 0
    assert all(r.died is not None for r in mem.records)


@pytest.mark.parametrize("name", zoo.names())
def test_breakdown_sums_to_peak_and_timeline_is_consistent(name: str) -> None:
    model, inputs = zoo.build(name, **SMALL[name])
    with track_memory() as mem:
        run_step(model, inputs, None)
    assert sum(mem.breakdown.values()) == mem.peak_bytes > 0
    assert max(mem.levels) == mem.peak_bytes == mem.levels[mem.peak_event]
    assert len(mem.levels) == len(mem.ops)
    # levels replay exactly from the records
    replay = [0] * len(mem.levels)
    for r in mem.records:
        end = r.died if r.died is not None else len(mem.levels)
        for k in range(r.born, end):
            replay[k] += r.nbytes
    assert replay == mem.levels
    # what the step leaves behind is exactly the parameters' gradients
    grads = {p.grad.untyped_storage()._cdata: p.grad.untyped_storage().nbytes()
             for p in model.parameters() if p.grad is not None}
    assert mem.current_bytes == sum(grads.values())


def test_track_memory_pops_its_mode_when_the_block_raises() -> None:
    depth = len(_get_current_dispatch_mode_stack())
    with pytest.raises(RuntimeError, match="boom"), track_memory() as mem:
        kept = torch.ones(10)  # 40 bytes, tracked
        assert len(_get_current_dispatch_mode_stack()) == depth + 1
        raise RuntimeError("boom")
    assert len(_get_current_dispatch_mode_stack()) == depth
    events = len(mem.levels)
    outside = torch.ones(1000)  # after the region: must not be seen
    del kept  # a free after the region is not logged either
    assert len(mem.levels) == events
    assert mem.peak_bytes == 40
    assert [r.nbytes for r in mem.records] == [40]
    del outside


# --- the CUDA caching allocator's rounding (NOTE [ CUDA allocator rounding ]) ------------

BLOCK = CUDA_MIN_BLOCK_BYTES  # 512: the smallest block the CUDA caching allocator hands out


@pytest.mark.parametrize(("nbytes", "block"), [
    (0, 0),  # an empty storage allocates nothing
    (1, BLOCK), (100, BLOCK), (511, BLOCK), (512, BLOCK),
    (513, 2 * BLOCK), (4096, 4096), (4097, 4096 + BLOCK), (10**6, 1954 * BLOCK),
])
def test_cuda_block_bytes(nbytes: int, block: int) -> None:
    assert cuda_block_bytes(nbytes) == block


def _three_buffers() -> list[torch.Tensor]:
    """Storages of 100, 513 and 4096 bytes (uint8: one byte an element), kept alive."""
    return [torch.empty(n, dtype=torch.uint8) for n in (100, 513, 4096)]


def test_forced_cuda_rounding_on_cpu_tensors_gives_allocator_blocks() -> None:
    with track_memory(rounding="cuda") as mem:
        kept = _three_buffers()
    # by hand: max(512, ceil(n / 512) * 512) for n = 100, 513, 4096
    assert [r.nbytes for r in mem.records] == [512, 1024, 4096]
    assert mem.peak_bytes == mem.current_bytes == 512 + 1024 + 4096 == 5632
    assert mem.rounding == "cuda"
    for rounding in (None, "exact"):  # on the CPU the default is the exact bytes
        with track_memory(rounding=rounding) as exact:
            again = _three_buffers()
        assert [r.nbytes for r in exact.records] == [100, 513, 4096]
        assert exact.peak_bytes == 100 + 513 + 4096 == 4709
        del again
    del kept


def test_forced_cuda_rounding_of_the_chain_step_by_hand() -> None:
    # NOTE [ The chain's peak by hand ] with each storage in CUDA blocks: S = 4096 and
    # P = 1024 are whole blocks already; each 4-byte scalar takes a 512-byte block.
    layers, x = _chain_inputs("cpu")
    with track_memory(rounding="cuda") as mem:
        _chain_step(layers, x)
    assert mem.peak_bytes == (K + 1) * S + P + 2 * BLOCK == 18432
    assert mem.current_bytes == CHAIN_LEFT


def test_resize_under_cuda_rounding_grows_by_blocks() -> None:
    with track_memory(rounding="cuda") as mem:
        t = torch.empty(100, dtype=torch.uint8)  # one 512-byte block
        t.resize_(600)  # 600 bytes: two blocks
    assert mem.peak_bytes == mem.current_bytes == 2 * BLOCK
    assert [r.nbytes for r in mem.records] == [2 * BLOCK]
    del t


@pytest.mark.parametrize(("nbytes", "device", "rounding", "counted"), [
    (100, "cpu", None, 100), (100, "meta", None, 100), (100, "cuda", None, 512),
    (100, "cuda:1", None, 512), (100, "cpu", "cuda", 512), (100, "meta", "cuda", 512),
    (100, "cuda", "exact", 100), (0, "cuda", None, 0),
])
def test_counted_bytes_by_device(nbytes: int, device: str, rounding: str | None,
                                 counted: int) -> None:
    assert counted_bytes(nbytes, device, rounding) == counted  # type: ignore[arg-type]


def test_a_misspelt_rounding_is_refused() -> None:
    with pytest.raises(RematError, match="Did you mean 'cuda'"), track_memory("cdua"):  # type: ignore[arg-type]
        pass


@pytest.mark.parametrize(("environ", "named"), [
    ({}, None),
    ({"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}, None),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, None),
    ({"PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:4"}, "roundup_power2_divisions:4"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,garbage_collection_threshold:0.6"},
     "max_split_size_mb:128"),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "expandable_segments:True"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "backend:native"}, None),
    ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, "backend:cudaMallocAsync"),
])
def test_allocator_settings_that_change_blocks_are_named(environ: dict[str, str],
                                                         named: str | None) -> None:
    note = allocator_config_note(environ)
    if named is None:
        assert note is None
    else:
        assert note is not None and named in note and "max_memory_allocated" in note


def test_cuda_rounding_warns_when_the_allocator_settings_are_not_modelled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions:4")
    with pytest.warns(RuntimeWarning, match="roundup_power2_divisions"), \
            track_memory("cuda") as mem:
        kept = torch.empty(100)
    assert len(mem.notes) == 1 and "roundup_power2_divisions" in mem.notes[0]
    with track_memory() as exact:  # nothing CUDA-rounded on the CPU: nothing to say
        again = torch.empty(100)
    assert exact.notes == []
    del kept, again


def test_track_allocator_measures_nothing_off_cuda() -> None:
    with track_allocator("cpu") as alloc:
        kept = torch.empty(1000)
    assert alloc.peak_bytes is None and alloc.device == torch.device("cpu")
    del kept


# --- memory a kernel holds inside an op (NOTE [ Memory a kernel allocates inside an op ])


class InsideProbe:
    """Stands in on the CPU for the CUDA allocator's probe: every matmul "held"
    ``nbytes`` inside itself. It reads the op from the tracker's frame (a test's view)."""

    def __init__(self, nbytes: int = 3 * CUDA_MIN_BLOCK_BYTES,
                 ops: tuple[str, ...] = ("mm", "addmm", "bmm")) -> None:
        self.nbytes, self.ops = nbytes, ops
        self.seen: list[str] = []

    def before(self, tracked: int) -> None:
        pass

    def settle(self, tracked: int) -> None:
        pass

    def after(self) -> tuple[int, int]:
        func = sys._getframe(1).f_locals["func"]
        self.seen.append(func.__name__)
        return (self.nbytes if func._overloadpacket.__name__ in self.ops else 0), 0

    def close(self) -> None:
        pass


def inside_probe(monkeypatch: pytest.MonkeyPatch, nbytes: int = 3 * CUDA_MIN_BLOCK_BYTES,
                 ops: tuple[str, ...] = ("mm", "addmm", "bmm")) -> InsideProbe:
    """Every tracker made from now on reads ``InsideProbe`` (also for test_profile)."""
    probe = InsideProbe(nbytes, ops)
    monkeypatch.setattr(memory_module, "allocator_probe", lambda: probe)
    return probe


def _two_matmul_step() -> None:
    torch.manual_seed(0)
    w1 = torch.randn(64, 128, requires_grad=True)
    w2 = torch.randn(128, 32, requires_grad=True)
    ((torch.randn(16, 64) @ w1).relu() @ w2).sum().backward()


def test_memory_held_inside_an_op_is_a_transient_at_its_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with track_memory() as plain:
        _two_matmul_step()
    probe = inside_probe(monkeypatch)
    with track_memory() as mem:
        _two_matmul_step()
    inside = [r for r in mem.records if r.transient]
    assert inside and len(inside) == sum(n.split(".")[0] in probe.ops for n in probe.seen)
    for r in inside:  # up at the op's last event, down at the next
        assert r.died == r.born + 1 and r.nbytes == probe.nbytes and r.op.startswith("aten.mm")
        assert mem.levels[r.born] - mem.levels[r.born - 1] == probe.nbytes
        assert mem.ops[r.born + 1] == "free"
    assert {r.backward for r in inside} == {False, True}  # forward's and backward's matmuls
    # without the transients' events, the timeline is the one without the probe
    spikes = {e for r in inside for e in (r.born, r.born + 1)}
    assert [lv for e, lv in enumerate(mem.levels) if e not in spikes] == plain.levels
    def storages(m: MemoryTracker) -> list[tuple[int, str, bool]]:
        return [(r.nbytes, r.op, r.backward) for r in m.records if not r.transient]

    assert storages(mem) == storages(plain)
    assert mem.peak_bytes == max(plain.peak_bytes, max(
        mem.levels[r.born - 1] + r.nbytes for r in inside))
    assert sum(mem.breakdown.values()) == mem.peak_bytes


def test_views_are_not_probed_and_the_timeline_is_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Memory a kernel allocates inside an op ]: an ATen view allocates nothing, so
    # the probe is not read around it; every other op is, and the timeline is the same
    class Counting(InsideProbe):
        def __init__(self) -> None:
            super().__init__()
            self.before_calls = 0

        def before(self, tracked: int) -> None:
            self.before_calls += 1

    def step() -> None:
        torch.manual_seed(0)
        w = torch.randn(64, 32, requires_grad=True)
        x = torch.randn(8, 16, 64)
        (x.view(128, 64) @ w).t().relu()[:5].sum().backward()  # view, t and a slice

    with track_memory() as plain:
        step()
    probe = Counting()
    monkeypatch.setattr(memory_module, "allocator_probe", lambda: probe)
    with track_memory() as mem:
        step()
    probed = {name.split(".")[0] for name in probe.seen}  # "mm.default": "mm"
    assert probe.before_calls == len(probe.seen) > 0
    assert not probed & {"view", "t", "slice", "transpose", "expand", "detach"}, probed
    assert {"mm", "relu"} <= probed
    inside = {e for r in mem.records if r.transient for e in (r.born, r.born + 1)}
    assert [lv for e, lv in enumerate(mem.levels) if e not in inside] == plain.levels


class WholeBlockProbe(InsideProbe):
    """Stands in for the allocator handing out large blocks whole: the level rises
    ``extra`` more than the new storages' bytes when an op makes one over 1 MiB."""

    def __init__(self, extra: int) -> None:
        super().__init__(0, ())
        self.extra = extra

    def after(self) -> tuple[int, int]:
        frame = sys._getframe(1).f_locals
        out = [t for t in ([frame["out"]] if isinstance(frame["out"], torch.Tensor) else [])]
        made = sum(t.untyped_storage().nbytes() for t in out)
        large = made > CUDA_SMALL_BYTES and frame["func"]._overloadpacket.__name__ != "view"
        return 0, made + (self.extra if large else 0)


@pytest.mark.parametrize(("extra", "counted"), [(256 * 1024, True), (CUDA_SMALL_BYTES, True),
                                                (CUDA_SMALL_BYTES + 512, False)])
def test_a_large_block_handed_out_whole_is_counted_to_its_storage(
        monkeypatch: pytest.MonkeyPatch, extra: int, counted: bool) -> None:
    # NOTE [ Blocks the allocator does not split ]: up to 1 MiB more than the storage is
    # its block's remainder, counted with it and given back with it; more is not a block's
    def step() -> None:
        x = torch.randn(1024, 512)  # 2 MiB
        y = x * 2  # 2 MiB: large
        z = y[:8] + 1  # small
        del x, y, z

    with track_memory() as plain:
        step()
    monkeypatch.setattr(memory_module, "allocator_probe", lambda: WholeBlockProbe(extra))
    with track_memory() as mem:
        step()
    grown = [(a, b) for a, b in zip(plain.records, mem.records, strict=True)
             if a.nbytes != b.nbytes]
    if counted:
        # randn and mul each made one large storage: each counts its whole block
        assert [b.nbytes - a.nbytes for a, b in grown] == [extra, extra]
        assert mem.peak_bytes == plain.peak_bytes + 2 * extra
    else:
        assert not grown and mem.levels == plain.levels
    assert mem.current_bytes == 0  # the remainders went back with their storages


def test_no_probe_without_cuda() -> None:
    # on a machine that never initialised CUDA the tracker reads no allocator
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is initialised in this process")
    assert memory_module.allocator_probe() is None


class FakeAllocator:
    """The CUDA caching allocator's counters as ``torch.cuda`` reads them, on the CPU."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, level: int = 1000) -> None:
        self.current = self.peak = level
        for name, fn in (("synchronize", lambda *a: None), ("current_device", lambda: 0),
                         ("reset_peak_memory_stats", self._reset),
                         ("memory_allocated", lambda *a: self.current),
                         ("max_memory_allocated", lambda *a: self.peak),
                         ("memory_stats_as_nested_dict", lambda *a: {"allocated_bytes": {
                             "all": {"current": self.current, "peak": self.peak}}})):
            monkeypatch.setattr(torch.cuda, name, fn)

    def _reset(self, *args: Any) -> None:
        self.peak = self.current

    def alloc(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)

    def free(self, n: int) -> None:
        self.current -= n


def test_the_probe_reads_each_op_and_keeps_the_peaks_it_resets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Memory a kernel allocates inside an op ]: the probe resets the peak around
    # every op; a track_allocator around it still gets the step's peak
    fake = FakeAllocator(monkeypatch)
    with track_allocator("cuda") as alloc:
        probe = memory_module.AllocatorProbe(0)
        probe.before(0)
        fake.alloc(4096)  # the op's output ...
        fake.alloc(70_000)  # ... and its working memory, freed before it returns
        fake.free(70_000)
        assert probe.after() == (70_000, 4096)  # held inside, the level's rise
        probe.settle(4096)  # the tracker counted the output
        probe.before(4096)
        fake.alloc(2048)  # an op's output, freed after it: the tracker saw it go
        assert probe.after() == (0, 2048)
        probe.settle(4096 + 2048)
        fake.free(2048)
        probe.before(4096)
        fake.alloc(512)
        assert probe.after() == (0, 512)
        probe.settle(4096 + 512)
        fake.free(1000)  # a storage the tracker never counted, freed between ops
        probe.before(4096 + 512)
        fake.alloc(512)
        assert probe.after() == (0, 512 - 1000)  # one op's rise too low; the read corrects
        probe.settle(4096 + 1024)
        probe.before(4096 + 1024)
        fake.alloc(512)
        assert probe.after() == (0, 512)
        probe.close()
    assert alloc.peak_bytes == 4096 + 70_000  # above the level at entry
    assert alloc.device == torch.device("cuda", 0) and not memory_module._OPEN_PEAKS


def test_a_peak_dropped_by_a_probe_reaches_every_open_allocator_block_of_its_device(
        ) -> None:
    outer = AllocatorPeak(torch.device("cuda", 0))
    inner = AllocatorPeak(torch.device("cuda", 0))
    other = AllocatorPeak(torch.device("cuda", 1))
    monkey = [outer, inner, other]
    saved = list(memory_module._OPEN_PEAKS)
    memory_module._OPEN_PEAKS[:] = monkey
    try:
        memory_module._fold_peak(0, 5000)
        memory_module._fold_peak(0, 3000)  # lower: the highest is kept
        memory_module._fold_peak(1, 700)
    finally:
        memory_module._OPEN_PEAKS[:] = saved
    assert (outer._folded, inner._folded, other._folded) == (5000, 5000, 700)


# --- the operating system's view -----------------------------------------------------

_PROBE = Path(__file__).with_name("_os_peak_probe.py")
OS_TOLERANCE = 0.03  # |OS - tracked| / tracked
# NOTE [ oneDNN convolution scratch ]
#     With oneDNN (mkldnn) convolutions, ``aten.convolution_backward`` allocates about
#     1 MiB of buffers inside the op, below the dispatcher, where no storage accounting
#     can see them (memory.py, "Known limitations"). On the resnet at its default size
#     that puts the OS figure 2.7-3.8% above the tracked one (independent of the thread
#     count); with oneDNN off the two agree within ~1%, and the tracked figure is the
#     same byte for byte. So resnet is checked at 3% with oneDNN off, and with oneDNN on
#     against this stated bound for kernel scratch:
ONEDNN_SCRATCH_TOLERANCE = 0.05


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_tracked_peak_agrees_with_the_os_high_water_mark() -> None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    done = subprocess.run(
        [sys.executable, str(_PROBE)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)

    print("\nstep peak: storage accounting vs OS VmHWM (MALLOC_MMAP_THRESHOLD_=65536)")
    print(f"{'model':<16}{'tracked B':>12}{'OS B':>12}{'diff':>9}")
    for key, r in results.items():
        diff = (r["os_bytes"] - r["tracked_bytes"]) / r["tracked_bytes"]
        print(f"{key:<16}{r['tracked_bytes']:>12}{r['os_bytes']:>12}{100 * diff:>8.2f}%")

    assert set(results) == {*zoo.names(), "resnet-no-onednn"}
    for key, r in results.items():
        assert r["tracked_bytes"] > 10 * 2**20, key  # default sizes: tens of MiB
        rel = (r["os_bytes"] - r["tracked_bytes"]) / r["tracked_bytes"]
        if key == "resnet":
            assert 0 < rel <= ONEDNN_SCRATCH_TOLERANCE, (key, r)
        else:
            assert abs(rel) <= OS_TOLERANCE, (key, r)
    # the accounting does not depend on the convolution backend
    assert results["resnet"]["tracked_bytes"] == results["resnet-no-onednn"]["tracked_bytes"]


def test_a_counter_run_through_the_tracker_sees_what_it_sees_as_a_mode_of_its_own() -> None:
    # NOTE [ One mode for two instruments ]: measure_step calls the counter from the
    # tracker's handler; the timeline, the FLOPs and the op records are those of the two
    # entered as modes one inside the other
    import autoremat
    from autoremat._core.step import Step
    from autoremat._measure.measured import measure_step
    from autoremat._measure.ops import OpRecorder

    model, inputs = autoremat.zoo.build("gpt2", n_layer=2, n_embd=32, n_head=2, batch_size=2,
                                        seq_len=16, vocab_size=64)
    step = Step(model, inputs)
    through = OpRecorder()
    one = measure_step(step, memory="storages", counter=through)
    nested = OpRecorder()  # entered as a mode outside the tracker, as before
    with nested, torch.autograd.graph.saved_tensors_hooks(nested.pack, nested.unpack):
        two = measure_step(step, memory="storages")
    assert one.memory is not None and two.memory is not None and through.total > 0
    assert (one.memory.levels, one.memory.ops) == (two.memory.levels, two.memory.ops)
    assert (through.by_label, through.total) == (nested.by_label, nested.total)
    assert [dataclasses.replace(o, ms=0.0) for o in through.block_ops("<outside>")] == \
        [dataclasses.replace(o, ms=0.0) for o in nested.block_ops("<outside>")]


def test_a_storage_the_collector_frees_inside_the_trackers_lock_is_counted() -> None:
    # an allocation inside the tracker's locked region can start Python's garbage
    # collector, which frees a storage held in a cycle and runs its free callback there,
    # on the same thread: with a plain Lock that deadlocked (a held-out x-transformers
    # step hung in profile)
    from autoremat._measure.memory import track_memory

    done: list[int] = []

    def step() -> None:
        with track_memory() as mem:
            held: list[Any] = [torch.ones(1024)]
            held.append(held)  # a cycle: only the collector frees it
            del held
            with mem._lock:  # as inside the tracker, where the collector may start
                gc.collect()
        done.append(mem.current_bytes)

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the tracker deadlocked on its own lock"
    assert done == [0]  # the storage made and freed, counted both times
