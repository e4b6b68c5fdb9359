"""Measure each zoo model's step peak twice: by the OS and by storage accounting.

Run by ``tests/test_memory.py`` in a fresh interpreter started with
``MALLOC_MMAP_THRESHOLD_=65536`` (glibc reads it at start-up: without it freed blocks stay
resident and ``VmHWM`` stops tracking tensor memory). Prints one JSON object:
``{model: {"tracked_bytes": ..., "os_bytes": ..., "rss_bytes": ...}}``.

For each model at its default size: two warm-up steps, then one plain step whose peak
resident set above the level at its start is read from ``VmHWM`` (after resetting it via
``/proc/self/clear_refs``), then one step under ``track_memory``. Gradients are ``None``
before every step. ``resnet`` runs twice: with PyTorch's default convolution backend
(oneDNN) and, as ``resnet-no-onednn``, with oneDNN off (see NOTE [ oneDNN convolution
scratch ] in test_memory.py).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
from typing import Any

import torch
from torch import nn

from autoremat import zoo
from autoremat._core.step import run_step
from autoremat._measure.memory import os_peak_bytes, reset_os_peak, track_memory


def _no_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _release_free_heap() -> None:
    # NOTE [ Free heap pages absorb allocations ]
    #     glibc serves a request from free chunks of its heap before it mmaps, whatever
    #     MALLOC_MMAP_THRESHOLD_ says. Chunks freed earlier in the process (a previous
    #     model, the interpreter's own garbage) are still resident, so tensors placed in
    #     them do not raise the RSS and the OS figure reads low: measured 0.75-3.7% low
    #     for mlp when it ran after gpt2 and llama. malloc_trim(0) hands those pages back
    #     to the kernel, so every tensor page the step touches is a new resident page.
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure(name: str) -> dict[str, Any]:
    model, inputs = zoo.build(name)
    for _ in range(2):
        run_step(model, inputs, None)
        _no_grads(model)
    _release_free_heap()
    rss = reset_os_peak()
    run_step(model, inputs, None)
    os_bytes = os_peak_bytes(rss)
    _no_grads(model)
    with track_memory() as mem:
        run_step(model, inputs, None)
    _no_grads(model)
    return {"tracked_bytes": mem.peak_bytes, "os_bytes": os_bytes, "rss_bytes": rss}


def main() -> int:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        print("start this probe with MALLOC_MMAP_THRESHOLD_=65536", file=sys.stderr)
        return 2
    results = {name: measure(name) for name in zoo.names()}
    torch.backends.mkldnn.enabled = False  # (flags() would also touch TF32 and warn)
    results["resnet-no-onednn"] = measure("resnet")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
