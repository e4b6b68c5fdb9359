"""Shared sizes and fixtures.

``SMALL`` and ``MEDIUM`` are the zoo at the two sizes most tests use (import them with
``from conftest import SMALL``); ``zoo_tapes`` profiles a zoo model once per session, so
that test files which plan over the same model share one tape instead of each profiling
it again; ``tiny_tape`` is the tape of a three-block MLP for the tests of the tape itself;
``hf_model`` builds the small Hugging Face models test_apply and test_auto run;
``synthetic_tape`` and ``random_tape`` build tapes by hand, without a model, for the
tests of the peak model and the solvers (test_peak, test_chain).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

# NOTE [ One thread for the tests ]
#     The suite runs with one intra-op thread unless OMP_NUM_THREADS says otherwise: on a
#     shared machine torch's default (one thread per core) oversubscribes the cores, and
#     a test of ten steps took 305 s with two threads against 19 s with one. Set in the
#     environment before torch is imported, so the processes the tests start (the CLI,
#     the distributed ranks, the compile workers, the OS peak probe) inherit it too, and
#     with set_num_threads in case torch was imported before this file. No test compares
#     figures across thread counts: each compares against a plain run in its own process.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# NOTE [ Inductor's C++ kernels in the tests ]
#     Inductor compiles its CPU kernels with g++, and on a clean machine (as CI's) it
#     first builds a precompiled header of its vector library: about a third of a cold
#     Inductor test's time (gpt2 of 4 blocks, whole: 57 s, 39 s without). The tests of
#     plans under Inductor check what its partitioner saves and recomputes, and
#     gradients against the compiled plain step, which is built the same way; none
#     depends on its kernels being vectorised, so the suite has them scalar unless the
#     environment says otherwise.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# Deterministic cuBLAS (the gpu tier compares gradients with torch.equal) needs this set
# before CUDA initialises; it changes nothing on the CPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from autoremat import Decision, Tape, profile, zoo
from autoremat._core.decisions import KEEP, RECOMPUTE
from autoremat._measure.tape import BlockProfile, WindowKey, WindowMemory
from autoremat._plan.peak import predict_peak

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The zoo at sizes where one step takes milliseconds: 2 transformer blocks, 4 MLP blocks,
# a two-stage ResNet.
SMALL: Mapping[str, Mapping[str, Any]] = {
    "gpt2": {"n_layer": 2, "batch_size": 2, "seq_len": 16},
    "llama": {"n_layer": 2, "batch_size": 2, "seq_len": 16},
    "mlp": {"widths": (64, 128, 32, 96), "batch_size": 16},
    "resnet": {"stage_channels": (8, 16), "stem_channels": 8, "batch_size": 4, "image_size": 16},
}

# The zoo with enough blocks for multi-block segments and alternating plans (gpt2 has
# four blocks, so every:2 recomputes blocks 0 and 2), at a step of tens of milliseconds.
MEDIUM: Mapping[str, Mapping[str, Any]] = {
    "gpt2": {"n_layer": 4, "batch_size": 2, "seq_len": 64},
    "llama": {"n_layer": 3, "batch_size": 2, "seq_len": 32},
    "mlp": {"widths": (96, 64, 128, 48, 96, 64), "batch_size": 64},
    "resnet": {"batch_size": 8, "image_size": 16},
}


class OpLog(TorchDispatchMode):
    """Notes the name of every op dispatched under it (``ops``), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as the module ``name`` (the scripts are not a
    package), so that tests can call its functions."""
    path = Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def as_options(sizes: Mapping[str, Any]) -> str:
    """``sizes`` as the command line's ``--set`` value, e.g. ``n_layer=2,batch_size=2``."""
    return ",".join(f"{key}={value}" for key, value in sizes.items())


def hf_model(name: str, use_cache: bool | None, layers: int = 3,
             seq_len: int = 64) -> tuple[nn.Module, dict[str, Any]]:
    """A ``layers``-layer Hugging Face ``name`` ("gpt2", "llama" or "bert") with dropout, in
    train mode, and a batch of 4 x ``seq_len`` tokens; ``use_cache`` goes into the inputs
    unless None. Skips the test when transformers is not installed."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=layers, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
            attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1, bos_token_id=0, eos_token_id=0))
    elif name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
            attention_dropout=0.1))
    else:
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128,
            vocab_size=256, max_position_embeddings=64, attention_probs_dropout_prob=0.1,
            hidden_dropout_prob=0.1))
    model.train()
    ids = torch.randint(0, 256, (4, seq_len))
    inputs: dict[str, Any] = {"input_ids": ids, "labels": ids.clone()}
    if use_cache is not None:
        inputs["use_cache"] = use_cache
    return model, inputs


@pytest.fixture(scope="session")
def zoo_tapes() -> Callable[..., Tape]:
    """``zoo_tapes(name, **sizes)``: the tape of ``zoo.build(name, **sizes)`` (seed 0),
    profiled with ``repeats=1`` the first time it is asked for and shared after that.

    A tape is frozen, so sharing it is safe; a test that runs the model builds its own
    with the same arguments, which gives the model the tape was measured on (``build``
    is seeded and ``profile`` leaves the model as it found it).
    """
    cache: dict[tuple[str, str], Tape] = {}

    def get(name: str, **sizes: Any) -> Tape:
        key = (name, repr(sorted(sizes.items())))
        if key not in cache:
            model, inputs = zoo.build(name, **sizes)
            cache[key] = profile(model, inputs, repeats=1)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_tape() -> Tape:
    """The tape of a three-block MLP (milliseconds to profile)."""
    model, inputs = zoo.build("mlp", widths=(32, 16, 24), d_in=16, batch_size=8)
    return profile(model, inputs, repeats=1)


def plans_with_options(tape: Tape, options: Sequence[Sequence[Any]]) -> Iterator[list[Any]]:
    """Every plan of ``tape``: segments of one block kept or under one of its
    ``options`` (choices), and checkpointed runs across chained links."""
    n = len(tape.blocks)

    def from_(i: int) -> Iterator[list[Any]]:
        if i == n:
            yield []
            return
        for choice in [KEEP, *options[i]]:
            for rest in from_(i + 1):
                yield [(i, i + 1, choice), *rest]
        stop = i + 1
        while True:
            for rest in from_(stop):
                yield [(i, stop, RECOMPUTE), *rest]
            if stop < n and tape.blocks[stop].chained:
                stop += 1
            else:
                break

    return from_(0)


# --- synthetic tapes: built from BlockProfile / WindowMemory directly, no model ----------


def window(peak: int, delta: int) -> WindowMemory:
    """A window that rises ``peak`` bytes above its start and ends ``delta`` above it
    (the peak is at least the end and at least 0, as a measured one is)."""
    return WindowMemory(peak_bytes=max(peak, delta, 0), delta_bytes=delta)


# files written by earlier versions, which this one must read (tests/data/README.md)
V1_TAPE = Path(__file__).parent / "data" / "tape_v1.json"
V1_PLAN = Path(__file__).parent / "data" / "plan_v1.json"
V1_OPTIMAL_PLAN = Path(__file__).parent / "data" / "plan_optimal_v1.json"

# the whole-block decisions a tape's windows are keyed by, for short keys: fwd[K, C]
K, C = Decision.KEEP, Decision.RECOMPUTE
PAIRS = ((K, K), (C, K), (K, C), (C, C))


def synthetic_block(i: int, *, fwd: dict[WindowKey, WindowMemory],
                    bwd: dict[WindowKey, WindowMemory], flops: int, chained: bool,
                    chain_bytes: int, output_bytes: int = 0) -> BlockProfile:
    """Block ``i`` of a synthetic chain, its windows keyed by (previous decision, own
    decision); the first block keeps only the keys after K (nothing comes before it)."""
    if i == 0:  # the first block's previous decision is always K
        fwd = {k: v for k, v in fwd.items() if k[0] is K}
        bwd = {k: v for k, v in bwd.items() if k[0] is K}
    return BlockProfile(
        name=f"blocks.{i}", fwd_ms=1.0, bwd_ms=2.0, fwd_flops=flops, bwd_flops=2 * flops,
        saved_bytes=fwd[K, K].delta_bytes, saved_bytes_by_kind={"matmul": fwd[K, K].delta_bytes},
        input_bytes=chain_bytes, output_bytes=output_bytes, param_bytes=0, grad_bytes=0,
        fwd=fwd, bwd=bwd, chained=chained and i > 0, chain_bytes=chain_bytes if i > 0 else 0,
    )


def synthetic_tape(blocks: Sequence[BlockProfile], *, pre: WindowMemory | None = None,
                   post: dict[Decision, WindowMemory] | None = None,
                   tail: dict[Decision, WindowMemory] | None = None) -> Tape:
    """A tape of ``blocks`` (zero windows where none is given); its step peaks are what
    the peak model predicts for keeping and for checkpointing every block."""
    zero = {K: window(0, 0), C: window(0, 0)}
    tape = Tape(
        model="Synthetic", inputs="x: (1,) float32", device="cpu", blocks=tuple(blocks),
        step_peak_bytes=1, peak_breakdown={}, ckpt_step_peak_bytes=1, param_bytes=0,
        trainable_param_bytes=0, buffer_bytes=0, grad_bytes=0, pre=pre or window(0, 0),
        post=post or zero, tail=tail or zero,
        step_fwd_flops=sum(b.fwd_flops for b in blocks) + 1,
        step_bwd_flops=sum(b.bwd_flops for b in blocks) + 1, step_ms=1.0,
    )
    n = len(blocks)
    unplanned = predict_peak(tape, [(i, i + 1, KEEP) for i in range(n)])
    full = predict_peak(tape, [(i, i + 1, RECOMPUTE) for i in range(n)])
    return dataclasses.replace(tape, step_peak_bytes=unplanned, ckpt_step_peak_bytes=full)


def random_tape(n: int, seed: int, *, chained_p: float = 0.7, identical: bool = False,
                scale: int = 1, releases: bool = False, first_releases: bool = False) -> Tape:
    """A chain of ``n`` blocks with random, physically plausible windows.

    Block ``i`` saves ``a`` bytes for backward (its output ``o`` among them) and needs a
    transient ``tf`` in forward and ``tb`` in backward; checkpointed, it holds only ``o``
    and its backward recomputes the rest. Who holds a boundary tensor depends on the
    neighbour's decision, so the windows after a checkpointed block differ by a little.
    Small integers (times ``scale``) make equal peaks, hence ties, common. With
    ``releases``, blocks after the first release part of their input when the forward
    returns, by their decision and their predecessor's (``fwd_end_release``; NOTE
    [ Released when the forward returns ] in ``_plan/peak.py``); with ``first_releases``
    the first block too.
    """
    rng = random.Random(seed)
    draw: dict[str, int] = {}

    def r(lo: int, hi: int) -> int:
        return rng.randint(lo, hi) * scale

    blocks, prev_out = [], r(1, 8)
    for i in range(n):
        if not identical or not draw:
            o = r(1, 8)
            draw = {"o": o, "a": o + r(0, 30), "tf": r(0, 10), "tb": r(0, 10), "g": r(0, 4),
                    "x": r(0, 3), "flops": rng.randint(1, 50) * 1000}
        o, a, tf, tb, g, x = (draw[k] for k in ("o", "a", "tf", "tb", "g", "x"))
        fwd = {
            (K, K): window(a + tf, a), (C, K): window(a + tf + x, a + x),
            (K, C): window(a + tf, o), (C, C): window(a + tf + x, o + x),
        }
        bwd = {
            (K, K): window(tb + g, g - a), (C, K): window(tb + g + x, g - a - x),
            (K, C): window(a - o + tb + g, g - o), (C, C): window(a - o + tb + g + x, g - o - x),
        }
        chained = identical or rng.random() < chained_p
        block = synthetic_block(i, fwd=fwd, bwd=bwd, flops=draw["flops"],
                                chained=chained, chain_bytes=prev_out, output_bytes=o)
        if releases and (i > 0 or first_releases):
            block = dataclasses.replace(block, fwd_end_release={
                key: r(0, 4) for key in PAIRS if rng.random() < 0.7})
        blocks.append(block)
        prev_out = o
    post = {K: window(r(0, 20), r(0, 5)), C: window(r(0, 20), r(0, 5))}
    tail = {K: window(r(0, 10), -r(0, 3)), C: window(r(0, 10), -r(0, 3))}
    return synthetic_tape(blocks, pre=window(r(0, 6), r(0, 3)), post=post, tail=tail)
