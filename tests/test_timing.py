"""Tests for autoremat.timing: which clock times which device, and the CPU clock itself.

The CUDA clock is only *selected* here (making one touches no CUDA state); it runs in
``tests/test_gpu.py``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

import autoremat
from autoremat import zoo
from autoremat._core.step import device_of
from autoremat._measure.timing import CudaClock, WallClock, clock_for, clock_kind, time_ms


@pytest.mark.parametrize(("device", "kind"), [
    ("cpu", "wall"), ("meta", "wall"), ("cuda", "cuda"), ("cuda:0", "cuda"),
    ("cuda:3", "cuda"), (torch.device("cuda", 1), "cuda"), (torch.device("cpu"), "wall"),
])
def test_clock_kind_by_device_type(device: Any, kind: str) -> None:
    assert clock_kind(device) == kind


def test_clock_for_a_cuda_device_is_the_event_clock_without_touching_cuda() -> None:
    clock = clock_for("cuda:1")
    assert isinstance(clock, CudaClock) and clock.device == torch.device("cuda", 1)
    assert isinstance(clock_for("cpu"), WallClock)
    assert isinstance(clock_for(torch.device("meta")), WallClock)


def test_wall_clock_measures_a_sleep() -> None:
    ms = time_ms(lambda: time.sleep(0.02), "cpu")
    assert 20.0 <= ms < 2000.0  # the sleep and no less; generous above on a busy machine


def test_wall_clock_stamps_are_ordered_milliseconds() -> None:
    clock = clock_for("cpu")
    a = clock.stamp()
    time.sleep(0.01)
    b = clock.stamp()
    clock.sync()
    assert clock.elapsed_ms(a, b) >= 10.0
    assert clock.elapsed_ms(a, a) == 0.0


def test_device_of_reads_parameters_then_buffers_then_inputs() -> None:
    assert device_of(nn.Linear(2, 2)) == torch.device("cpu")
    assert device_of(nn.Linear(2, 2, device="meta"), torch.zeros(1)) == torch.device("meta")
    with_buffer = nn.BatchNorm1d(2, affine=False, device="meta")  # buffers only
    assert device_of(with_buffer).type == "meta"
    empty = nn.ReLU()  # no parameters or buffers: the inputs decide
    assert device_of(empty, {"x": torch.zeros(1, device="meta")}).type == "meta"
    assert device_of(empty, (3, torch.zeros(1))).type == "cpu"
    assert device_of(empty) == torch.device("cpu")


def test_profile_times_blocks_on_the_cpu_clock() -> None:
    model, inputs = zoo.build("mlp", widths=(64, 32, 48), batch_size=16)
    tape = autoremat.profile(model, inputs, repeats=2, with_selective=False)
    assert all(b.fwd_ms > 0 and b.bwd_ms > 0 for b in tape.blocks)
    # The blocks' windows are disjoint parts of each step, stamped by the same clock; the
    # median of two runs is their mean, which is linear, so the sum holds for medians too.
    assert sum(b.fwd_ms + b.bwd_ms for b in tape.blocks) <= tape.step_ms * (1 + 1e-9)
