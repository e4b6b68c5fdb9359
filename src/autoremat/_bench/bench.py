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
``torch.compile``               ``activation_memory_budget`` at ``--compile-fractions``,
                                in a subprocess and measured by the OS (NOTE [ Measuring
                                torch.compile ] in ``compiled.py``); beside it, compiled:
                                checkpoint per block, SAC per block, and autoremat's
                                plans from a compiled profile at their peaks
==============================  ==========================================================

Each row: step peak (as in docs/design.md), recompute FLOPs as a percentage of the plain
step, median step time and its ratio to the plain step with its spread, and max |grad
diff| against the plain step (0 means every gradient is ``torch.equal``).

This module is the sweep (the command line is ``_cli/bench.py``); the rest of the bench
lives beside it: ``rows.py`` (the row, result and settings dataclasses and the method
names), ``measure.py`` (one measured or timed step), ``refs.py`` (the references),
``compiled.py`` (the torch.compile subprocess), ``report.py`` (verdicts, tables and
result files) and ``plots.py``.

NOTE [ Fair timing ]
    Steps of all variants of one model are interleaved round-robin (the order rotates
    each round) after one warm-up round, so a slow spell on a shared machine hits every
    variant alike. Spread is (max - min) / median of a variant's steps. FLOPs are exact
    and deterministic; times are not. The bench runs single-threaded by default: on a
    shared 2-core machine, OpenMP barriers made 2-thread step times swing by 2-5x
    (a descheduled thread stalls the other), one thread by ~10%. The CPU time of the
    process is recorded too (``cpu_ratio``): it leaves out time spent descheduled.
    Identical autoremat plans (two budgets that give the same plan) are measured once.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from torch import nn

from autoremat._apply import apply, remove
from autoremat._bench.compiled import compile_rows
from autoremat._bench.measure import (
    BenchMeasure,
    bench_measure,
    build_target,
    describe_plan,
    first_line,
    largest_grad,
    ratio_range,
    time_step,
)
from autoremat._bench.refs import (
    Toggle,
    hf_toggle,
    per_block,
    sac_per_block,
    sequential_chain,
    sequential_toggle,
)
from autoremat._bench.report import (
    headline,
    rich_table,
)
from autoremat._bench.rows import AUTO, BLOCK, HF, NONE, SAC, SEQ, BenchRow, ModelResult, Settings
from autoremat._core.errors import BudgetError, internal_assert
from autoremat._core.step import Step, describe_inputs
from autoremat._core.units import format_bytes, parse_budget
from autoremat._measure.blocks import resolve_blocks
from autoremat._measure.tape import Tape
from autoremat._plan.plan import Plan, plan_key
from autoremat._plan.strategies import plan, smallest_feasible_bytes
from autoremat._profile.profile import profile
from autoremat._verify import NOISE_MULTIPLE, max_grad_diff

__all__ = ["run_bench"]

# |tracker - allocator| / allocator peak above which a CUDA row says both (the GPU tests'
# bar for the tracker, NOTE [ CUDA allocator rounding ] in memory.py)
TRACKER_TOLERANCE = 0.005



# --- the sweep for one model ----------------------------------------------------------


@dataclass
class _Variant:
    """One configuration of the model that is measured and timed."""

    method: str
    budget: str
    toggle: Toggle
    plan: Plan | None = None
    note: str = ""
    measure: BenchMeasure | None = None
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
        apply(model, chosen, check_ranks=False)

    def uninstall() -> None:
        remove(model)

    return install, uninstall


class _Sweep:
    """Measures one target. ``progress(n, text)`` reports units of work done (and what is
    running), ``grow(n)`` announces more units."""

    def __init__(self, target: str, settings: Settings,
                 progress: Callable[[int, str], None], grow: Callable[[int], None]) -> None:
        self.target = target
        self.settings = settings
        self.progress = progress
        self.grow = grow
        self.model, self.inputs = build_target(target, dict(settings.overrides),
                                               settings.device, settings.dtype)
        self.step = Step(self.model, self.inputs, loop=settings.loop)
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
        self.noise_floor = 0.0  # max |Δgrad| of the plain step against itself (CUDA)

    def run(self) -> ModelResult:
        names = resolve_blocks(self.model, None)
        self.progress(0, f"{self.target}: profiling")
        try:
            self.tape = profile(self.step)
            names = [b.name for b in self.tape.blocks]
        except Exception as exc:  # reported in the table; the references still run
            self.tape_error = f"profile failed: {type(exc).__name__}: {first_line(exc)}"
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
                self._add_plan(f"peak of {ref.method}", _peak(ref.measure))
        self._measure_all(self.variants[before:])
        if self.plain.measure is not None and self.plain.measure.allocator_peak_bytes is not None:
            # CUDA kernels differ from themselves (NOTE [ Judging gradients ] in _verify.py)
            again = bench_measure(self.step, self.rng)
            _, self.noise_floor = max_grad_diff(self.plain.measure.grads, again.grads)
        self._time_rounds([v for v in self.variants if v.measure is not None])

        plain = self.plain.measure
        internal_assert(plain is not None, "the plain step was not measured")
        assert plain is not None
        rows = sorted((self._row(template, v) for template, v in self.rows), key=_row_order)
        if self.settings.compile:
            rows.extend(compile_rows(self.target, self.settings, self.model, self.inputs,
                                     names, _peak(plain), self.progress, self.grow))
        return ModelResult(
            target=self.target, model=type(self.model).__name__,
            inputs=_signature(self.inputs), n_blocks=len(names),
            plain_peak_bytes=_peak(plain),
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
            if exc.min_feasible_bytes is None:  # not "too small": the budget is malformed
                raise
            self.rows.append((BenchRow(
                AUTO, label, "infeasible",
                budget_bytes=parse_budget(budget, self.tape.step_peak_bytes),
                note=f"below the smallest feasible budget, "
                     f"{format_bytes(exc.min_feasible_bytes or 0)}"), None))
            return
        row = BenchRow(AUTO, label, "ok", budget_bytes=chosen.budget_bytes,
                       predicted_peak_bytes=chosen.predicted_peak_bytes)
        key = plan_key(chosen)
        variant = self._by_plan.get(key)
        if variant is None:
            variant = _Variant(AUTO, label, _plan_toggle(self.model, chosen), plan=chosen,
                               note=describe_plan(chosen))
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

        add(BLOCK, per_block(modules))
        add(HF, hf_toggle(self.model), "not a transformers model")
        chain = sequential_chain(self.model, names)
        if chain is None:
            add(SEQ, None, "blocks are not an nn.Sequential (called in a Python loop)")
        else:
            container, chained = chain
            segments = max(1, round(math.sqrt(len(chained))))
            add(SEQ, sequential_toggle(container, chained, segments),
                note=f"{segments} segments of {len(chained)} blocks (the last one not "
                     f"checkpointed)")
        add(SAC, sac_per_block(modules), note="saves mm/bmm/sdpa/conv outputs")

    def _measure_all(self, variants: list[_Variant]) -> None:
        self.grow(len(variants))
        for variant in variants:
            self._measure_one(variant)

    def _measure_one(self, variant: _Variant) -> None:
        self.progress(0, f"{self.target}: measuring {variant.method} {variant.budget}")
        try:
            with variant.installed():
                variant.measure = bench_measure(self.step, self.rng)
        except Exception as exc:  # a reference that breaks on this model is a result too
            if variant.method == NONE:
                raise
            variant.error = f"{type(exc).__name__}: {first_line(exc)}"
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
                    ms, cpu = time_step(self.step, self.rng)
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
        equal, diff = max_grad_diff(p.grads, m.grads)
        _, buffer_diff = max_grad_diff(dict(p.buffers), dict(m.buffers))
        med, plain_ms = statistics.median(variant.times_ms), statistics.median(plain.times_ms)
        cpu, plain_cpu = statistics.median(variant.cpu_ms), statistics.median(plain.cpu_ms)
        note = variant.note
        if variant.method == AUTO and variant.budget != template.budget:
            note = f"same plan as {variant.budget}"
        if buffer_diff:
            note = _join(note, "BatchNorm running stats updated twice (buffers differ)")
        if not equal and math.isfinite(self.noise_floor) \
                and 0 < diff <= NOISE_MULTIPLE * self.noise_floor:
            note = _join(note, f"gradients within the plain step's own noise (floor "
                               f"{self.noise_floor:.2g})")
        peak = _peak(m)
        if template.budget_bytes is not None and peak > template.budget_bytes:
            note = _join(note, "OVER BUDGET")
        on_allocator = m.allocator_peak_bytes is not None
        if on_allocator and abs(m.peak_bytes - peak) > TRACKER_TOLERANCE * peak:
            note = _join(note, f"tracker {format_bytes(m.peak_bytes)}, "
                               f"{100 * (m.peak_bytes - peak) / peak:+.1f}% of the allocator")
        return BenchRow(
            template.method, template.budget, "ok", peak_bytes=peak,
            peak_source="allocator" if on_allocator else "tracker",
            tracker_peak_bytes=m.peak_bytes if on_allocator else None,
            plain_peak_bytes=_peak(p), budget_bytes=template.budget_bytes,
            predicted_peak_bytes=template.predicted_peak_bytes,
            recompute_pct=100 * (m.flops - p.flops) / p.flops if p.flops else None,
            step_ms=med, time_ratio=med / plain_ms if plain_ms else None,
            time_spread=(max(variant.times_ms) - min(variant.times_ms)) / med if med else None,
            time_ratio_range=ratio_range(variant.times_ms, plain_ms),
            cpu_ratio=cpu / plain_cpu if plain_cpu else None,
            max_grad_diff=0.0 if equal else diff, grads_equal=equal,
            relative_grad_diff=0.0 if equal else diff / largest_grad(p.grads),
            max_buffer_diff=buffer_diff, note=note,
        )


def _peak(m: BenchMeasure) -> int:
    """The step's peak: the allocator's on CUDA (docs/design.md, "GPU and compile"), else the
    tracker's."""
    return m.allocator_peak_bytes if m.allocator_peak_bytes is not None else m.peak_bytes


def _row_order(row: BenchRow) -> int:
    """none, autoremat at the budgets, autoremat at the references' peaks, references."""
    if row.method == NONE:
        return 0
    if row.method == AUTO:
        return 2 if row.budget.startswith("peak of") else 1
    return 3


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def _signature(inputs: Any) -> str:
    return describe_inputs(inputs)


# --- the whole run --------------------------------------------------------------------


def run_bench(targets: Sequence[str], settings: Settings | None = None,
              console: Console | None = None,
              on_model: Callable[[list[ModelResult]], None] | None = None) -> list[ModelResult]:
    """Measure every target, showing a progress bar and each model's table on ``console``.

    Args:
        targets: zoo names or ``package.module:factory`` specs.
        settings: what to run; default :class:`Settings`.
        on_model: called with the results so far after each model (to save them early).

    Example:
        >>> from rich.console import Console
        >>> from autoremat._bench.bench import Settings, run_bench
        >>> settings = Settings(budgets=("75%",), repeats=1, compile=False,
        ...                     overrides=(("widths", (128,) * 4), ("batch_size", 256)))
        >>> results = run_bench(["mlp"], settings, console=Console(quiet=True))  # no table
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
                bar.console.print(rich_table(result))
                if on_model is not None:
                    on_model(results)
    finally:
        torch.set_num_threads(threads)
    return results
