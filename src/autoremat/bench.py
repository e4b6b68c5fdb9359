"""``autoremat bench``: autoremat's plans side by side with PyTorch's own options.

For each model, one process measures, on the same batch and from the same RNG state:

==============================  ==========================================================
``no checkpointing``            the plain step; every ratio is relative to it
``autoremat optimal``           ``plan(tape, budget)`` for each ``--budgets`` entry, and
                                again at the measured peak of every eager reference below
``checkpoint per block``        each block's forward under ``torch.utils.checkpoint``
                                (non-reentrant), written the way a user would
``HF gradient_checkpointing``   ``model.gradient_checkpointing_enable(...)`` (transformers
                                models only)
``checkpoint_sequential``       ``torch.utils.checkpoint.checkpoint_sequential`` with
                                ``round(sqrt(n))`` segments, where the blocks form an
                                ``nn.Sequential`` (or a Sequential of Sequentials)
``SAC per block``               selective activation checkpointing per block, Megatron
                                style: save matmul/bmm/attention/conv outputs, recompute
                                the rest
``torch.compile``               ``activation_memory_budget`` at the budgets' fractions, in
                                a subprocess and measured by the OS (see the note)
==============================  ==========================================================

Each row: step peak (as in DESIGN.md), recompute FLOPs as a percentage of the plain
step, median step time and its ratio to the plain step with its spread, and max |grad
diff| against the plain step (0 means every gradient is ``torch.equal``).

NOTE [ Fair timing ]
    Steps of all variants of one model are interleaved round-robin (the order rotates
    each round) after one warm-up round, so a slow spell on a shared machine hits every
    variant alike. Spread is (max - min) / median of a variant's steps. FLOPs are exact
    and deterministic; times are not. The bench runs single-threaded by default: on a
    shared 2-core machine, OpenMP barriers made 2-thread step times swing by 2-5x
    (a descheduled thread stalls the other), one thread by ~10%. The CPU time of the
    process is recorded too (``cpu_ratio``): it leaves out time spent descheduled.
    Identical autoremat plans (two budgets that give the same plan) are measured once.

NOTE [ Measuring torch.compile ]
    A Python dispatch mode (the memory tracker, the FLOP counter) makes Dynamo run
    compiled frames eagerly, so a compiled step is measured from outside: a fresh
    process started with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then returns freed
    tensor memory at once), the resident high-water mark reset before each step
    (``reset_os_peak``), and an eager plain step measured the same way in the same
    process as its baseline. One process per budget: Dynamo caches compiled code per
    code object, so two budgets compiled in one process could silently share code.
    Recompute FLOPs of a compiled step are counted during its backward only (entered
    after the compiled forward ran, so Dynamo does not fall back); the compiled
    backward's matmuls are ATen calls the counter sees. Inductor's ``fallback_random``
    is on so dropout draws the same masks as eager: otherwise no gradient could match.
    With a budget below 1, compile currently re-draws dropout in backward (pytorch#190758)
    and its gradients differ; the table shows that difference rather than hiding it.
    Compile's fraction is of *its own* saved activations, not of the step peak, so
    "50%" for compile and for autoremat are not the same target.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

from . import zoo
from .apply import apply, remove
from .blocks import resolve_blocks
from .errors import BudgetError, RematError, internal_assert
from .flops import FlopCounter
from .memory import os_peak_bytes, reset_os_peak, track_memory
from .plan import Plan, plan, smallest_feasible_bytes
from .profile import profile
from .step import call_model, default_loss, preserved_state, run_step
from .tape import Tape, write_atomic
from .units import format_bytes

__all__ = ["SCHEMA_VERSION", "BenchRow", "ModelResult", "bench_main", "hf_gpt2", "run_bench"]

SCHEMA_VERSION = 1  # of results.json

NONE = "no checkpointing"
AUTO = "autoremat optimal"
BLOCK = "checkpoint per block"
HF = "HF gradient_checkpointing"
SEQ = "checkpoint_sequential"
SAC = "SAC per block"
COMPILE = "torch.compile"
COMPILE_EAGER = "no checkpointing (OS)"
METHODS = (NONE, AUTO, BLOCK, HF, SEQ, SAC, COMPILE, COMPILE_EAGER)

Status = Literal["ok", "infeasible", "n/a", "error"]


@dataclass(frozen=True)
class BenchRow:
    """One line of the benchmark. Figures are ``None`` when the row did not run."""

    method: str  # one of METHODS
    budget: str  # "75%", "min", "peak of <method>", or "-" for references without one
    status: Status  # ok | infeasible (budget below the smallest plan) | n/a | error
    peak_bytes: int | None = None  # measured step peak
    peak_source: Literal["tracker", "os"] = "tracker"  # storage accounting, or OS VmHWM
    plain_peak_bytes: int | None = None  # no-checkpointing peak, same measurement system
    budget_bytes: int | None = None  # autoremat: the budget in bytes
    predicted_peak_bytes: int | None = None  # autoremat: the plan's prediction
    recompute_pct: float | None = None  # extra FLOPs / plain step FLOPs, in percent
    step_ms: float | None = None  # median step time
    time_ratio: float | None = None  # step_ms / median plain step time (same process)
    time_spread: float | None = None  # (max - min) / median of this row's steps
    time_ratio_range: tuple[float, float] | None = None  # (min, max) step / plain median
    cpu_ratio: float | None = None  # the same ratio in CPU time of the process (less noisy)
    max_grad_diff: float | None = None  # max |grad - plain grad|; 0.0 when all torch.equal
    grads_equal: bool | None = None  # every gradient torch.equal to the plain step's
    relative_grad_diff: float | None = None  # max_grad_diff / the largest plain |gradient|
    max_buffer_diff: float | None = None  # max |buffer - plain buffer| after the step
    note: str = ""

    @property
    def grads_rounding_only(self) -> bool:
        """Gradients differ, but only as float rounding does (< 1e-5 of the largest)."""
        return self.grads_equal is False and (self.relative_grad_diff or 0.0) < 1e-5

    @property
    def peak_fraction(self) -> float | None:
        """Peak over the plain peak of the same measurement system."""
        if self.peak_bytes is None or not self.plain_peak_bytes:
            return None
        return self.peak_bytes / self.plain_peak_bytes


@dataclass(frozen=True)
class ModelResult:
    """All rows of one target, and the verdicts drawn from them."""

    target: str  # as given on the command line
    model: str  # class name
    inputs: str  # input signature
    n_blocks: int
    plain_peak_bytes: int
    plain_step_ms: float
    plain_flops: int
    min_feasible_bytes: int | None  # smallest peak autoremat can plan (None: no tape)
    rows: tuple[BenchRow, ...]
    headline: tuple[str, ...]


# --- one measured step ----------------------------------------------------------------


@dataclass(frozen=True)
class _Measure:
    peak_bytes: int
    flops: int
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


def _measure(model: nn.Module, inputs: Any, rng: torch.Tensor) -> _Measure:
    """Peak, FLOPs, gradients and buffers after one step from RNG state ``rng``."""
    with preserved_state(model):
        torch.set_rng_state(rng)
        # Both modes in one step: the FLOP counter holds no tensors, so it does not
        # change what the memory tracker sees.
        with track_memory() as mem, FlopCounter() as counter:
            run_step(model, inputs, None)
        grads = {n: (p.grad.detach().clone() if p.grad is not None else None)
                 for n, p in model.named_parameters()}
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return _Measure(mem.peak_bytes, counter.total, grads, buffers)


def _time_step(model: nn.Module, inputs: Any, rng: torch.Tensor) -> tuple[float, float]:
    """(wall ms, CPU ms of this process) of one plain, uninstrumented step."""
    with preserved_state(model):
        torch.set_rng_state(rng)
        wall, cpu = time.perf_counter(), time.process_time()
        run_step(model, inputs, None)
        return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def _max_diff(a: dict[str, torch.Tensor | None],
              b: dict[str, torch.Tensor | None]) -> tuple[bool, float]:
    """(all torch.equal, max |a - b|) over matching entries; a missing one is unequal."""
    equal, worst = True, 0.0
    for name, x in a.items():
        y = b.get(name)
        if x is None or y is None:
            if (x is None) != (y is None):
                equal, worst = False, math.inf
            continue
        if x.shape != y.shape:
            equal, worst = False, math.inf
            continue
        if torch.equal(x, y):
            continue
        equal = False
        worst = max(worst, float((x.double() - y.double()).abs().max()))
    return equal, worst


# --- the references, written the way a user would ------------------------------------

Toggle = tuple[Callable[[], None], Callable[[], None]]  # (install, uninstall)


def _per_block(modules: list[nn.Module], context_fn: Callable[..., Any] | None = None) -> Toggle:
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


def _megatron_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if getattr(op, "overloadpacket", None) in _SAVE_PACKETS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _sac_per_block(modules: list[nn.Module]) -> Toggle:
    return _per_block(modules, functools.partial(create_selective_checkpoint_contexts,
                                                 _megatron_policy))


def _hf_toggle(model: nn.Module) -> Toggle | None:
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


def _sequential_chain(model: nn.Module, names: list[str]) -> tuple[nn.Module, list[nn.Module]] \
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


def _sequential_toggle(container: nn.Module, chain: list[nn.Module], segments: int) -> Toggle:
    def install() -> None:
        def forward(x: Any) -> Any:
            return checkpoint_sequential(chain, segments, x, use_reentrant=False)

        container.forward = forward  # type: ignore[method-assign]

    def uninstall() -> None:
        container.__dict__.pop("forward", None)

    return install, uninstall


# --- the sweep for one model ----------------------------------------------------------


@dataclass
class _Variant:
    """One configuration of the model that is measured and timed."""

    method: str
    budget: str
    toggle: Toggle
    plan: Plan | None = None
    note: str = ""
    measure: _Measure | None = None
    error: str = ""  # why measuring it failed
    times_ms: list[float] = field(default_factory=list)  # wall
    cpu_ms: list[float] = field(default_factory=list)  # CPU time of this process

    @contextmanager
    def installed(self) -> Iterator[None]:
        install, uninstall = self.toggle
        install()
        try:
            yield
        finally:
            uninstall()


def _plan_toggle(model: nn.Module, chosen: Plan) -> Toggle:
    def install() -> None:
        apply(model, chosen)

    def uninstall() -> None:
        remove(model)

    return install, uninstall


def _plan_key(chosen: Plan) -> tuple[Any, ...]:
    return tuple((b.decision, b.segment, tuple(b.save_ops)) for b in chosen.blocks)


@dataclass(frozen=True)
class Settings:
    """What one ``bench`` run does."""

    budgets: tuple[str, ...] = ("75%", "50%", "30%", "min")
    repeats: int = 5  # timed rounds per model (after one warm-up round)
    compile: bool = True  # run the torch.compile rows (subprocesses)
    compile_fractions: tuple[float, ...] | None = None  # default: from the budgets, and 1.0
    overrides: tuple[tuple[str, Any], ...] = ()  # size options for every target
    threads: int = 1  # torch threads (0: leave torch's default); see NOTE [ Fair timing ]
    compile_timeout_s: float = 1800.0


class _Sweep:
    """Measures one target. ``progress(n, text)`` reports units of work done (and what is
    running), ``grow(n)`` announces more units."""

    def __init__(self, target: str, settings: Settings,
                 progress: Callable[[int, str], None], grow: Callable[[int], None]) -> None:
        self.target = target
        self.settings = settings
        self.progress = progress
        self.grow = grow
        self.model, self.inputs = _build(target, dict(settings.overrides))
        self.rng = torch.get_rng_state()  # every step starts from this RNG state
        self.tape: Tape | None = None
        self.tape_error = ""
        self.plain = _Variant(NONE, "-", (lambda: None, lambda: None))
        self.variants: list[_Variant] = [self.plain]  # what is measured and timed
        self.references: list[_Variant] = []
        # each row, and the variant that gives its figures (None: it did not run)
        self.rows: list[tuple[BenchRow, _Variant | None]] = [
            (BenchRow(NONE, "-", "ok"), self.plain)]
        self._by_plan: dict[tuple[Any, ...], _Variant] = {}

    def run(self) -> ModelResult:
        names = resolve_blocks(self.model, None)
        self.progress(0, f"{self.target}: profiling")
        try:
            self.tape = profile(self.model, self.inputs)
            names = [b.name for b in self.tape.blocks]
        except Exception as exc:  # reported in the table; the references still run
            self.tape_error = f"profile failed: {type(exc).__name__}: {_first_line(exc)}"
        self.progress(1, f"{self.target}: measuring")
        min_bytes = smallest_feasible_bytes(self.tape) if self.tape is not None else None
        for label in self.settings.budgets:
            self._add_plan(label, min_bytes if label == "min" and min_bytes else label)
        self._add_references(names)
        self._measure_all(self.variants)
        # autoremat at the peak each reference reached: the like-for-like comparison
        before = len(self.variants)
        for ref in self.references:
            if ref.measure is not None:
                self._add_plan(f"peak of {ref.method}", ref.measure.peak_bytes)
        self._measure_all(self.variants[before:])
        self._time_rounds([v for v in self.variants if v.measure is not None])

        plain = self.plain.measure
        internal_assert(plain is not None, "the plain step was not measured")
        assert plain is not None
        rows = sorted((self._row(template, v) for template, v in self.rows), key=_row_order)
        if self.settings.compile:
            rows.extend(self._compile_rows(plain.peak_bytes))
        return ModelResult(
            target=self.target, model=type(self.model).__name__,
            inputs=_signature(self.inputs), n_blocks=len(names),
            plain_peak_bytes=plain.peak_bytes,
            plain_step_ms=statistics.median(self.plain.times_ms), plain_flops=plain.flops,
            min_feasible_bytes=min_bytes, rows=tuple(rows), headline=tuple(headline(rows)),
        )

    def _add_plan(self, label: str, budget: int | str) -> None:
        """A row for ``plan(tape, budget)``; identical plans share one variant."""
        if self.tape is None:
            self.rows.append((BenchRow(AUTO, label, "error", note=self.tape_error), None))
            return
        try:
            chosen = plan(self.tape, budget, "optimal")
        except BudgetError as exc:
            self.rows.append((BenchRow(
                AUTO, label, "infeasible", budget_bytes=_budget_bytes(budget, self.tape),
                note=f"below the smallest feasible budget, "
                     f"{format_bytes(exc.min_feasible_bytes or 0)}"), None))
            return
        row = BenchRow(AUTO, label, "ok", budget_bytes=chosen.budget_bytes,
                       predicted_peak_bytes=chosen.predicted_peak_bytes)
        key = _plan_key(chosen)
        variant = self._by_plan.get(key)
        if variant is None:
            variant = _Variant(AUTO, label, _plan_toggle(self.model, chosen), plan=chosen,
                               note=_describe_plan(chosen))
            self._by_plan[key] = variant
            self.variants.append(variant)
        self.rows.append((row, variant))

    def _add_references(self, names: list[str]) -> None:
        modules = [self.model.get_submodule(n) for n in names]

        def add(method: str, toggle: Toggle | None, why_not: str = "", note: str = "") -> None:
            if toggle is None:
                self.rows.append((BenchRow(method, "-", "n/a", note=why_not), None))
                return
            variant = _Variant(method, "-", toggle, note=note)
            self.variants.append(variant)
            self.references.append(variant)
            self.rows.append((BenchRow(method, "-", "ok"), variant))

        add(BLOCK, _per_block(modules))
        add(HF, _hf_toggle(self.model), "not a transformers model")
        chain = _sequential_chain(self.model, names)
        if chain is None:
            add(SEQ, None, "blocks are not an nn.Sequential (called in a Python loop)")
        else:
            container, chained = chain
            segments = max(1, round(math.sqrt(len(chained))))
            add(SEQ, _sequential_toggle(container, chained, segments),
                note=f"{segments} segments of {len(chained)} blocks (the last one not "
                     f"checkpointed)")
        add(SAC, _sac_per_block(modules), note="saves mm/bmm/sdpa/conv outputs")

    def _measure_all(self, variants: list[_Variant]) -> None:
        self.grow(len(variants))
        for variant in variants:
            self._measure_one(variant)

    def _measure_one(self, variant: _Variant) -> None:
        self.progress(0, f"{self.target}: measuring {variant.method} {variant.budget}")
        try:
            with variant.installed():
                variant.measure = _measure(self.model, self.inputs, self.rng)
        except Exception as exc:  # a reference that breaks on this model is a result too
            if variant.method == NONE:
                raise
            variant.error = f"{type(exc).__name__}: {_first_line(exc)}"
        self.progress(1, "")

    def _time_rounds(self, variants: list[_Variant]) -> None:
        rounds = self.settings.repeats + 1
        self.grow(rounds * len(variants))
        for r in range(rounds):
            self.progress(0, f"{self.target}: timing round {r + 1}/{rounds}"
                             + (" (warm-up)" if r == 0 else ""))
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for variant in order:
                with variant.installed():
                    ms, cpu = _time_step(self.model, self.inputs, self.rng)
                if r:
                    variant.times_ms.append(ms)
                    variant.cpu_ms.append(cpu)
                self.progress(1, "")

    def _row(self, template: BenchRow, variant: _Variant | None) -> BenchRow:
        plain = self.plain
        if variant is not None and variant.error:
            return replace(template, status="error", note=_join(variant.note, variant.error))
        if variant is None or variant.measure is None:
            return template
        m, p = variant.measure, plain.measure
        assert p is not None
        equal, diff = _max_diff(p.grads, m.grads)
        _, buffer_diff = _max_diff(dict(p.buffers), dict(m.buffers))
        med, plain_ms = statistics.median(variant.times_ms), statistics.median(plain.times_ms)
        cpu, plain_cpu = statistics.median(variant.cpu_ms), statistics.median(plain.cpu_ms)
        note = variant.note
        if variant.method == AUTO and variant.budget != template.budget:
            note = f"same plan as {variant.budget}"
        if buffer_diff:
            note = _join(note, "BatchNorm running stats updated twice (buffers differ)")
        if template.budget_bytes is not None and m.peak_bytes > template.budget_bytes:
            note = _join(note, "OVER BUDGET")
        return BenchRow(
            template.method, template.budget, "ok", peak_bytes=m.peak_bytes,
            plain_peak_bytes=p.peak_bytes, budget_bytes=template.budget_bytes,
            predicted_peak_bytes=template.predicted_peak_bytes,
            recompute_pct=100 * (m.flops - p.flops) / p.flops if p.flops else None,
            step_ms=med, time_ratio=med / plain_ms if plain_ms else None,
            time_spread=(max(variant.times_ms) - min(variant.times_ms)) / med if med else None,
            time_ratio_range=_range(variant.times_ms, plain_ms),
            cpu_ratio=cpu / plain_cpu if plain_cpu else None,
            max_grad_diff=0.0 if equal else diff, grads_equal=equal,
            relative_grad_diff=0.0 if equal else diff / _largest(p.grads),
            max_buffer_diff=buffer_diff, note=note,
        )

    def _compile_rows(self, plain_peak: int) -> list[BenchRow]:
        s = self.settings
        fractions = s.compile_fractions
        if fractions is None:
            fractions = (1.0, *(_fraction(b, plain_peak) for b in s.budgets))
        fractions = tuple(dict.fromkeys(fractions))  # unique, in order
        self.grow(len(fractions))
        rows: list[BenchRow] = []
        eager_row_added = False
        for fraction in fractions:
            self.progress(0, f"{self.target}: torch.compile, activation_memory_budget="
                             f"{fraction:g} (subprocess; compiling is slow on CPU)")
            label = f"{fraction:g}" + (" (no budget)" if fraction >= 1 else "")
            try:
                res = _run_compile_worker(self.target, dict(s.overrides), fraction, s.repeats,
                                          s.compile_timeout_s)
            except RematError as exc:
                rows.append(BenchRow(COMPILE, label, "error", peak_source="os",
                                     note=_first_line(exc)))
                self.progress(1, "")
                continue
            eager_ms = statistics.median(res["eager_ms"])
            if not eager_row_added:
                eager_row_added = True
                rows.append(BenchRow(
                    COMPILE_EAGER, "-", "ok", peak_bytes=res["eager_peak_bytes"],
                    peak_source="os", plain_peak_bytes=res["eager_peak_bytes"],
                    recompute_pct=0.0, step_ms=eager_ms, time_ratio=1.0,
                    time_spread=_spread(res["eager_ms"]),
                    time_ratio_range=_range(res["eager_ms"], eager_ms), cpu_ratio=1.0,
                    max_grad_diff=0.0, grads_equal=True, relative_grad_diff=0.0,
                    note=f"eager plain step in the first compile subprocess, baseline of the "
                         f"OS rows; OS / tracker peak for it: "
                         f"{res['eager_peak_bytes'] / plain_peak:.1%}"))
            med = statistics.median(res["compiled_ms"])
            eager_cpu = statistics.median(res["eager_cpu_ms"])
            plain_flops = res["eager_step_flops"]
            extra = res["compiled_bwd_flops"] - res["eager_bwd_flops"]
            note = f"OS-measured; compiled in {res['compile_s']:.0f} s"
            relative = 0.0 if res["grads_equal"] else res["max_grad_diff"] / res["max_abs_grad"]
            if not res["grads_equal"]:
                note += f"; max |Δgrad| is {relative:.1e} of the largest gradient"
                if relative > 1e-3 and fraction < 1:
                    note += ", as when dropout is re-drawn in backward (pytorch#190758)"
                elif relative < 1e-5:
                    note += " (float rounding of fused kernels)"
            rows.append(BenchRow(
                COMPILE, label, "ok", peak_bytes=res["compiled_peak_bytes"], peak_source="os",
                plain_peak_bytes=res["eager_peak_bytes"],
                recompute_pct=100 * extra / plain_flops if plain_flops else None,
                step_ms=med, time_ratio=med / eager_ms if eager_ms else None,
                time_spread=_spread(res["compiled_ms"]),
                time_ratio_range=_range(res["compiled_ms"], eager_ms),
                cpu_ratio=statistics.median(res["compiled_cpu_ms"]) / eager_cpu
                if eager_cpu else None,
                max_grad_diff=0.0 if res["grads_equal"] else res["max_grad_diff"],
                grads_equal=res["grads_equal"], relative_grad_diff=relative, note=note))
            self.progress(1, "")
        return rows


def _largest(grads: dict[str, torch.Tensor | None]) -> float:
    """The largest |gradient| entry (1.0 when all are zero, to keep ratios finite)."""
    scale = max((float(g.abs().max()) for g in grads.values() if g is not None and g.numel()),
                default=0.0)
    return scale or 1.0


def _row_order(row: BenchRow) -> int:
    """none, autoremat at the budgets, autoremat at the references' peaks, references."""
    if row.method == NONE:
        return 0
    if row.method == AUTO:
        return 2 if row.budget.startswith("peak of") else 1
    return 3


def _spread(times: list[float]) -> float | None:
    med = statistics.median(times)
    return (max(times) - min(times)) / med if med else None


def _range(times: list[float], reference_ms: float) -> tuple[float, float] | None:
    if not times or not reference_ms:
        return None
    return min(times) / reference_ms, max(times) / reference_ms


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def _budget_bytes(budget: int | str, tape: Any) -> int | None:
    from .units import parse_budget

    try:
        return parse_budget(budget, tape.step_peak_bytes)
    except BudgetError:
        return None


def _fraction(budget: str, plain_peak: int) -> float:
    """compile's ``activation_memory_budget`` matching a bench budget: '50%' -> 0.5,
    'min' -> 0.0 (recompute all it can), a size -> size / plain peak."""
    from .units import parse_budget

    if budget == "min":
        return 0.0
    return round(min(1.0, parse_budget(budget, plain_peak) / plain_peak), 3)


def _describe_plan(chosen: Plan) -> str:
    parts = []
    for start, stop, decision in chosen.segments:
        if decision == "keep":
            continue
        what = f"{start}" if stop == start + 1 else f"{start}-{stop - 1}"
        if decision == "selective":
            what += "(sel)"
        parts.append(what)
    if not parts:
        return "keeps every block"
    return "recomputes blocks " + ", ".join(parts)


def _signature(inputs: Any) -> str:
    from .step import describe_inputs

    return describe_inputs(inputs)


def _build(target: str, overrides: dict[str, Any]) -> tuple[nn.Module, Any]:
    from .cli import load_target

    torch.manual_seed(0)  # factories that do not seed still build the same model each time
    model, inputs = load_target(target, overrides)
    model.train()
    return model, inputs


# --- torch.compile, in a subprocess ----------------------------------------------------


def _run_compile_worker(target: str, overrides: dict[str, Any], fraction: float, repeats: int,
                        timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="autoremat-bench-") as tmp:
        out = Path(tmp) / "result.json"
        spec = {"target": target, "overrides": overrides, "fraction": fraction,
                "repeats": repeats, "threads": torch.get_num_threads(), "out": str(out)}
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536",
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        code = "import sys; from autoremat.bench import _compile_worker; " \
               "sys.exit(_compile_worker(sys.argv[1]))"
        try:
            proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], env=env,
                                  capture_output=True, text=True, timeout=timeout_s,
                                  check=False)
        except subprocess.TimeoutExpired as exc:
            raise RematError(f"torch.compile subprocess timed out after {timeout_s:.0f} s; "
                             f"rerun with --no-compile or a smaller model") from exc
        if proc.returncode != 0 or not out.exists():
            tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:]
            raise RematError(f"torch.compile subprocess failed (exit {proc.returncode}): "
                             f"{tail[0] if tail else 'no output'}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def _compile_worker(spec_text: str) -> int:
    """Entry point of the compile subprocess; writes its figures as JSON to spec['out']."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    spec = json.loads(spec_text)
    torch.set_num_threads(int(spec["threads"]))
    functorch_config.activation_memory_budget = float(spec["fraction"])
    inductor_config.fallback_random = True  # same dropout masks as eager (module note)
    model, inputs = _build(spec["target"], spec["overrides"])
    rng = torch.get_rng_state()
    compiled: nn.Module = torch.compile(model)  # type: ignore[assignment]

    Grads = dict[str, torch.Tensor | None]

    def step(module: nn.Module) -> tuple[float, float, int, Grads]:
        with preserved_state(model):
            torch.set_rng_state(rng)
            since = reset_os_peak()
            wall, cpu = time.perf_counter(), time.process_time()
            run_step(module, inputs, None)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            peak = os_peak_bytes(since)
            grads = {n: (p.grad.detach().clone() if p.grad is not None else None)
                     for n, p in model.named_parameters()}
        return wall * 1e3, cpu * 1e3, peak, grads

    step(model)
    start = time.perf_counter()
    step(compiled)  # compiles forward and backward
    compile_s = time.perf_counter() - start
    figures: dict[str, dict[str, list[float]]] = {
        kind: {"ms": [], "cpu_ms": [], "peak": []} for kind in ("eager", "compiled")}
    grads: dict[str, Grads] = {}
    for r in range(int(spec["repeats"]) + 1):  # round 0 is a warm-up
        for kind in ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager"):
            ms, cpu, peak, grads[kind] = step(model if kind == "eager" else compiled)
            if r:
                for key, value in (("ms", ms), ("cpu_ms", cpu), ("peak", peak)):
                    figures[kind][key].append(value)
    equal, diff = _max_diff(grads["eager"], grads["compiled"])
    eager_fwd, eager_bwd = _step_flops(model, model, inputs, rng)
    _, compiled_bwd = _step_flops(model, compiled, inputs, rng)
    result = {
        "fraction": spec["fraction"], "compile_s": compile_s,
        "eager_ms": figures["eager"]["ms"], "compiled_ms": figures["compiled"]["ms"],
        "eager_cpu_ms": figures["eager"]["cpu_ms"],
        "compiled_cpu_ms": figures["compiled"]["cpu_ms"],
        # the median step: the OS figure is exact to a page but not free of noise
        "eager_peak_bytes": int(statistics.median(figures["eager"]["peak"])),
        "compiled_peak_bytes": int(statistics.median(figures["compiled"]["peak"])),
        "grads_equal": equal, "max_grad_diff": diff, "max_abs_grad": _largest(grads["eager"]),
        "eager_step_flops": eager_fwd + eager_bwd, "eager_bwd_flops": eager_bwd,
        "compiled_bwd_flops": compiled_bwd,
    }
    write_atomic(Path(spec["out"]), json.dumps(result))
    return 0


def _step_flops(model: nn.Module, module: nn.Module, inputs: Any,
                rng: torch.Tensor) -> tuple[int, int]:
    """(forward, backward) FLOPs. The forward runs without the counter when ``module`` is
    compiled (a dispatch mode would make Dynamo fall back to eager), so its figure is 0."""
    eager = module is model
    with preserved_state(model):
        torch.set_rng_state(rng)
        with (FlopCounter() if eager else _nothing()) as fwd:
            loss = default_loss(call_model(module, inputs))
        with FlopCounter() as bwd:
            loss.backward()
    return (fwd.total if isinstance(fwd, FlopCounter) else 0), bwd.total


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


# --- verdicts ---------------------------------------------------------------------------


def headline(rows: Sequence[BenchRow]) -> list[str]:
    """One sentence per reference: how autoremat's plans at an equal or lower peak compare.

    Peaks are compared within one measurement system: bytes for the eager references,
    fractions of the plain peak for the OS-measured compile rows. Among the autoremat
    plans at or below the reference's peak, the one with the fewest recompute FLOPs
    (exact) is compared on FLOPs and time; when another of them is clearly faster, it is
    named too. A time difference counts only when the min..max ranges do not overlap.
    """
    autos = [r for r in rows if r.method == AUTO and r.status == "ok"
             and r.peak_bytes is not None]
    out: list[str] = []
    for ref in rows:
        if ref.method in (NONE, AUTO, COMPILE_EAGER) or ref.status != "ok":
            continue
        assert ref.peak_bytes is not None
        name = ref.method + (f" at activation_memory_budget={ref.budget.split()[0]}"
                             if ref.method == COMPILE else "")
        if ref.peak_source == "os":
            frac = ref.peak_fraction or 0.0
            fits = [a for a in autos if (a.peak_fraction or 0.0) <= frac]
            where = f"{100 * frac:.0f}% of the plain peak, OS-measured"
        else:
            fits = [a for a in autos if a.peak_bytes is not None
                    and a.peak_bytes <= ref.peak_bytes]
            where = format_bytes(ref.peak_bytes)
        caveats = []
        if ref.grads_rounding_only:
            caveats.append(f"{ref.method}'s gradients differ by float rounding (max |diff| "
                           f"{ref.max_grad_diff:.2g})")
        elif ref.grads_equal is False:
            caveats.append(f"{ref.method}'s gradients differ from the plain step's (max "
                           f"|diff| {ref.max_grad_diff:.2g})")
        if ref.max_buffer_diff:
            caveats.append(f"{ref.method} updates BatchNorm running statistics twice")
        caveat = "".join(f"; {c}" for c in caveats)
        if not fits:
            least = min(autos, key=lambda a: a.peak_bytes or 0, default=None)
            if least is None:
                out.append(f"{name}: no autoremat plan to compare{caveat}.")
                continue
            below = (least.peak_bytes or 0) - ref.peak_bytes
            by = f"{below} B" if below < 1024 and ref.peak_source != "os" else \
                f"{100 * ((least.peak_fraction or 0) - (ref.peak_fraction or 0)):.0f} points"
            out.append(f"{name} wins on memory: it reaches {where}, {by} below autoremat's "
                       f"lowest plan ({format_bytes(least.peak_bytes or 0)}, "
                       f"[{least.budget}]){caveat}.")
            continue
        best = min(fits, key=lambda a: (a.recompute_pct or 0.0, a.time_ratio or 0.0))
        text = (f"vs {name} ({where}, {_flops_text(ref.recompute_pct)} FLOPs, "
                f"x{ref.time_ratio or 0:.2f} time): autoremat [{best.budget}] "
                f"{format_bytes(best.peak_bytes or 0)}, {_flops_text(best.recompute_pct)} "
                f"FLOPs, x{best.time_ratio or 0:.2f} time: {_flops_verdict(best, ref)}")
        if ref.method == COMPILE:
            text += " (compiled times include compile's own speed-up: not compared)"
        else:
            text += f", {_speed(best, ref)}"
            fastest = min(fits, key=lambda a: a.time_ratio or math.inf)
            if fastest is not best and _speed(fastest, ref) == "faster" \
                    and _speed(best, ref) != "faster":
                text += (f"; autoremat [{fastest.budget}] ({format_bytes(fastest.peak_bytes or 0)}"
                         f", x{fastest.time_ratio or 0:.2f}) is faster")
        out.append(text + caveat + ".")
    return out


def _flops_text(pct: float | None) -> str:
    return "?" if pct is None else f"+{pct:.1f}%"


def _flops_verdict(mine: BenchRow, ref: BenchRow) -> str:
    a, b = mine.recompute_pct or 0.0, ref.recompute_pct
    if b is None:
        return "reference FLOPs unknown"
    if a < b - 0.05:
        return "fewer recompute FLOPs"
    if a <= b + 0.05:
        return "same recompute FLOPs"
    return "more recompute FLOPs"


def _speed(mine: BenchRow, ref: BenchRow) -> str:
    """'faster', 'slower' or 'time within noise': min..max ranges must not overlap."""
    a, b = mine.time_ratio_range, ref.time_ratio_range
    if a is None or b is None:
        return "time not measured"
    if a[1] < b[0]:
        return "faster"
    if b[1] < a[0]:
        return "slower"
    return "time within noise"


# --- the whole run and its outputs ----------------------------------------------------


def run_bench(targets: Sequence[str], settings: Settings | None = None,
              console: Console | None = None,
              on_model: Callable[[list[ModelResult]], None] | None = None) -> list[ModelResult]:
    """Measure every target, showing a progress bar and each model's table on ``console``.

    Args:
        targets: zoo names or ``package.module:factory`` specs.
        settings: what to run; default :class:`Settings`.
        on_model: called with the results so far after each model (to save them early).

    Example:
        >>> from autoremat.bench import Settings, run_bench
        >>> results = run_bench(["mlp"], Settings(budgets=("50%",), repeats=1,
        ...                     compile=False, overrides=(("batch_size", 64),)))
        >>> results[0].rows[0].method
        'no checkpointing'
    """
    settings = settings or Settings()
    console = console or Console()
    results: list[ModelResult] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    threads = torch.get_num_threads()
    try:
        if settings.threads > 0:
            torch.set_num_threads(settings.threads)
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("bench", total=len(targets))

            def progress(n: int, text: str) -> None:
                if text:
                    bar.update(task, advance=n, description=text)
                else:
                    bar.update(task, advance=n)

            def grow(n: int) -> None:
                bar.update(task, total=(bar.tasks[0].total or 0) + n)

            for target in targets:
                result = _Sweep(target, settings, progress, grow).run()
                results.append(result)
                bar.console.print(_rich_table(result))
                if on_model is not None:
                    on_model(results)
    finally:
        torch.set_num_threads(threads)
    return results


def _cells(r: BenchRow) -> list[str]:
    ok = r.status == "ok"
    peak = "-" if r.peak_bytes is None else format_bytes(r.peak_bytes) + \
        (" (OS)" if r.peak_source == "os" else "")
    frac = f"{100 * r.peak_fraction:.0f}%" if r.peak_fraction is not None else "-"
    fits = "-"
    if r.budget_bytes is not None and ok and r.peak_bytes is not None:
        fits = "yes" if r.peak_bytes <= r.budget_bytes else "NO"
    elif r.status == "infeasible":
        fits = "infeasible"
    budget = r.budget
    if r.method == AUTO and r.budget_bytes is not None and not budget.startswith("peak"):
        budget += f" ({format_bytes(r.budget_bytes)})"
    return [
        r.method, budget, peak if ok else r.status, frac, fits,
        f"+{r.recompute_pct:.1f}%" if r.recompute_pct is not None else "-",
        f"{r.step_ms:.0f}" if r.step_ms is not None else "-",
        f"x{r.time_ratio:.2f}" if r.time_ratio is not None else "-",
        f"{100 * r.time_spread:.0f}%" if r.time_spread is not None else "-",
        f"x{r.cpu_ratio:.2f}" if r.cpu_ratio is not None else "-",
        ("0" if r.grads_equal else f"{r.max_grad_diff:.2g}") if r.max_grad_diff is not None
        else "-",
        r.note,
    ]


_HEADERS = ["method", "budget", "step peak", "% plain", "fits", "+FLOPs", "ms", "x plain",
            "spread", "x CPU", "max|Δgrad|", "note"]


def _rich_table(result: ModelResult) -> Table:
    table = Table(title=f"{result.target} ({result.model}, {result.n_blocks} blocks, inputs "
                        f"{result.inputs}): plain step {format_bytes(result.plain_peak_bytes)}, "
                        f"{result.plain_step_ms:.0f} ms", title_justify="left")
    for h in _HEADERS:
        table.add_column(h, justify="left" if h in ("method", "budget", "note") else "right",
                         overflow="fold")
    for r in result.rows:
        style = "bold" if r.method == AUTO and r.status == "ok" else None
        table.add_row(*_cells(r), style=style)
    return table


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from . import __version__

    return {
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "autoremat": __version__, "cpu": cpu,
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _markdown(results: list[ModelResult], command: str, machine: dict[str, Any],
              elapsed_s: float, complete: bool) -> str:
    lines = [
        "# autoremat bench results", "",
        f"Command: `{command}`  ",
        f"Sweep time: {elapsed_s / 60:.1f} min" + ("" if complete else " (INCOMPLETE: still "
                                                   "running or interrupted)") + "  ",
        f"Machine: {machine['cpu']} ({machine['cpu_count']} cores, {machine['torch_threads']} "
        f"torch threads), {machine['platform']}, Python {machine['python']}, torch "
        f"{machine['torch']}, autoremat {machine['autoremat']}; load average at the end "
        f"{', '.join(f'{x:.1f}' for x in machine.get('load_average_end') or [])}", "",
        "How to read the tables:", "",
        "- **step peak**: as in DESIGN.md (storage accounting), with **% plain** its share "
        "of the no-checkpointing peak. Rows marked (OS) are torch.compile runs measured by "
        "the OS high-water mark in a subprocess; their % is of an eager plain step measured "
        "the same way in that subprocess (row `no checkpointing (OS)`).",
        "- **+FLOPs**: recompute FLOPs over the plain step's, exact, from "
        "`torch.utils.flop_counter` formulas, which cover matmul, attention and "
        "convolution only. Recomputed norms, activations and dropout cost time but no "
        "counted FLOPs: a selective plan can show +0.0% and still be slower.",
        "- **ms / x plain / spread**: median wall time of the step, its ratio to the plain "
        "step's, and (max - min) / median, over steps interleaved round-robin with every "
        "other variant after a warm-up round. **x CPU**: the same ratio in CPU time of "
        "the process, which leaves out time spent descheduled on a shared machine.",
        "- **max|Δgrad|**: against the plain step from the same RNG state; 0 means every "
        "gradient is `torch.equal`.",
        "- **autoremat optimal, peak of X**: autoremat planned with X's measured peak as "
        "its budget: the like-for-like comparison. Identical plans are measured once.",
        "",
    ]
    for res in results:
        lines += [f"## {res.target}", "",
                  f"{res.model}, {res.n_blocks} blocks, inputs {res.inputs}; plain step "
                  f"{format_bytes(res.plain_peak_bytes)}, {res.plain_step_ms:.0f} ms, "
                  f"{res.plain_flops / 1e9:.2f} GFLOPs"
                  + (f"; smallest autoremat plan {format_bytes(res.min_feasible_bytes)}"
                     if res.min_feasible_bytes else ""), ""]
        lines.append("| " + " | ".join(h.replace("|", "\\|") for h in _HEADERS) + " |")
        lines.append("|" + "|".join("---" if h in ("method", "budget", "note") else "---:"
                                    for h in _HEADERS) + "|")
        for r in res.rows:
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in _cells(r)) + " |")
        lines += ["", *[f"- {h}" for h in res.headline], "",
                  f"![{res.target} Pareto plot]({_slug(res.target)}_pareto.png)", ""]
    return "\n".join(lines)


def _slug(target: str) -> str:
    """File-name stem: the zoo name, or the factory's name of ``package.module:factory``."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in target.rpartition(":")[2])


def write_results(results: list[ModelResult], out: Path, command: str,
                  machine: dict[str, Any], elapsed_s: float, settings: Settings, *,
                  complete: bool = True) -> list[Path]:
    """results.md, results.json (atomically) and one Pareto PNG per model in ``out``.

    ``complete=False`` marks a sweep still running (files are rewritten after each model).
    """
    from .plots import pareto_plot

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for res in results:
        path = out / f"{_slug(res.target)}_pareto.png"
        pareto_plot(res, path)
        written.append(path)
    payload = {
        "schema_version": SCHEMA_VERSION, "complete": complete, "command": command,
        "machine": machine, "elapsed_s": elapsed_s,
        "settings": {**asdict(settings), "overrides": dict(settings.overrides)},
        "models": [{**{k: v for k, v in asdict(res).items() if k != "rows"},
                    "rows": [asdict(r) for r in res.rows]} for res in results],
    }
    json_path, md_path = out / "results.json", out / "results.md"
    write_atomic(json_path, json.dumps(_finite(payload), indent=1, default=_json_default,
                                       allow_nan=False))
    write_atomic(md_path, _markdown(results, command, machine, elapsed_s, complete))
    return [md_path, json_path, *written]


def _finite(value: Any) -> Any:
    """JSON has no inf/nan: a non-finite figure (a gradient missing on one side) -> None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_default(value: Any) -> Any:
    raise TypeError(f"cannot write {type(value).__name__} to results.json")


# --- command line -------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autoremat bench",
        description="Compare autoremat's plans with PyTorch's own checkpointing options on "
                    "the same model, interleaved in one process; write a table, JSON and "
                    "a Pareto plot per model.")
    p.add_argument("targets", nargs="*", metavar="TARGET",
                   help=f"zoo name ({', '.join(zoo.names())}; default: all) or "
                        f"package.module:factory")
    p.add_argument("--budgets", default="75%,50%,30%,min",
                   help="comma-separated: percentages of the plain step peak, sizes "
                        "('40MiB') or 'min' (default: %(default)s)")
    p.add_argument("--out", default="bench-results", help="output directory (default: "
                                                          "%(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="3 timed rounds and no torch.compile rows (under 5 minutes for the "
                        "zoo on 2 CPU cores)")
    p.add_argument("--repeats", type=int, help="timed rounds after one warm-up (default: 5; "
                                               "3 with --quick)")
    p.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="run the torch.compile rows (default unless --quick)")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="skip the torch.compile rows")
    p.add_argument("--set", help="size options for every target, e.g. n_layer=2,batch_size=2")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for the measured steps (default 1: steadiest times on "
                        "a shared CPU; 0 keeps torch's default)")
    return p


def bench_main(argv: list[str]) -> int:
    """``autoremat bench ...``; returns the exit status."""
    from .cli import _parse_overrides

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # a log file: do not fold the table into 80 columns
    args = _parser().parse_args(argv)
    try:
        budgets = tuple(b.strip() for b in args.budgets.split(",") if b.strip())
        if not budgets:
            raise RematError("--budgets is empty; e.g. --budgets 75%,50%,30%,min")
        repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)
        if repeats < 1:
            raise RematError(f"--repeats must be at least 1, got {repeats}")
        settings = Settings(
            budgets=budgets, repeats=repeats,
            compile=(not args.quick) if args.compile is None else args.compile,
            overrides=tuple(_parse_overrides(args.set).items()), threads=args.threads,
        )
        if args.threads < 0:
            raise RematError(f"--threads must be 0 (torch's default) or more, got "
                             f"{args.threads}")
        targets = list(args.targets) or zoo.names()
        machine = _machine()
        machine["torch_threads"] = settings.threads or torch.get_num_threads()
        command = "autoremat bench " + shlex.join(argv)
        start = time.perf_counter()
        out = Path(args.out)

        def save(done: list[ModelResult]) -> Any:
            machine["load_average_end"] = list(os.getloadavg()) \
                if hasattr(os, "getloadavg") else None
            return write_results(done, out, command, machine, time.perf_counter() - start,
                                 settings, complete=len(done) == len(targets))

        results = run_bench(targets, settings, console, on_model=save)
        elapsed = time.perf_counter() - start
        paths = save(results)
    except RematError as exc:
        console.print(f"[red]error:[/] {exc}", highlight=False)
        return 2
    for res in results:
        console.print(f"[bold]{res.target}[/]")
        for line in res.headline:
            console.print(f"  - {line}", highlight=False, markup=False)
    if settings.compile:
        console.print("torch.compile rows are OS-measured (VmHWM in a subprocess, against an "
                      "eager plain step there): a dispatch mode cannot see inside compiled "
                      "code.", highlight=False)
    console.print(f"{len(targets)} model(s) in {elapsed / 60:.1f} min; wrote "
                  + ", ".join(str(p) for p in paths), highlight=False)
    return 0


# --- an extra target: a small Hugging Face model ------------------------------------------


def hf_gpt2(**overrides: Any) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A small randomly initialised ``transformers`` GPT-2 and a batch, for
    ``autoremat bench autoremat.bench:hf_gpt2`` (the HF gradient-checkpointing row).

    Sizes as the zoo's gpt2: 6 layers, width 128, 4 heads, vocabulary 1024, batch 4 x 128
    tokens, dropout 0.1. ``overrides``: ``n_layer``, ``n_embd``, ``n_head``,
    ``batch_size``, ``seq_len``. Nothing is downloaded.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    sizes = {"n_layer": 6, "n_embd": 128, "n_head": 4, "batch_size": 4, "seq_len": 128}
    unknown = set(overrides) - set(sizes)
    if unknown:
        raise RematError(f"hf_gpt2: unknown option(s) {sorted(unknown)}; valid: {list(sizes)}")
    sizes.update(overrides)
    # use_cache=False as in any training script: with a KV cache, a recomputed layer
    # appends its keys to the cache a second time and attends over both
    config = GPT2Config(n_layer=sizes["n_layer"], n_embd=sizes["n_embd"],
                        n_head=sizes["n_head"], vocab_size=1024, n_positions=1024,
                        bos_token_id=0, eos_token_id=0, use_cache=False)
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (sizes["batch_size"], sizes["seq_len"]))
    return model, {"input_ids": ids, "labels": ids.clone()}
