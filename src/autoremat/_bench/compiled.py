"""The compiled rows of ``autoremat bench --compile``: a subprocess per row, OS-measured.

:func:`compile_rows` runs, for each row, a fresh Python process whose entry point is
:func:`compile_worker` (started as ``python -c "from autoremat._bench.compiled import
compile_worker; ..."``, so that name must not move). The worker compiles one variant of
the target, times it against an eager plain step in the same process and writes its
figures as JSON; :func:`compile_rows` turns them into rows, led by one ``no checkpointing
(OS)`` row that is their baseline. The variants, all compiled with one backend
(``Settings.compile_backend``, ``--compile-backend``):

* ``torch.compile`` at each ``activation_memory_budget`` of ``Settings.compile_fractions``;
* ``torch.compile + checkpoint per block``: every block under non-reentrant
  ``torch.utils.checkpoint``, and ``torch.compile + SAC per block``: the same with the
  Megatron policy (save mm/addmm/attention/conv outputs, recompute the rest: the op
  kinds of autoremat's ``MEGATRON``), both with the whole model compiled, as a user
  would write them (``refs.py``);
* ``autoremat + torch.compile``: plans fitted to the peaks those rows measured.

NOTE [ autoremat's compiled rows ]
    autoremat profiles the step compiled (``profile(..., compile=backend)``, in the bench's
    own process) and fits a plan for each budget by measuring the model compiled whole,
    as users compile it (``fit_compiled``, NOTE [ Compiled plans are fitted by
    measurement ] in _auto.py; one measurement per distinct plan over all budgets). The
    worker then applies that plan and compiles the whole model (``torch.compile``), the
    step the fit measured. The budgets are the peaks the compiled references measured,
    one below the lowest of them (``_BELOW``) and the least any plan measured ("min");
    identical plans run once. Budgets are in the bytes plans are made in: on CUDA the
    allocator's (``max_memory_allocated``, the rows' peaks); on CPU the OS figure also
    holds what the allocator does not see (pages, the process's own growth: 5-7% more
    on a 2-layer gpt2), so the worker also measures each step from the allocator's
    reports (``track_allocations``, ``allocations_peak_bytes``), and budgets and the
    "fits" column use that figure, the one the fit measures. The "predicted" column of
    these rows is the peak the fit measured (``plan.compiled_peak_bytes``). Each variant
    builds its own copy of the target (same seed, same weights) so that the eager plain
    step it is compared with keeps running the untouched model. Inductor's
    ``fallback_random`` is on for the fit as in the worker.

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
    With ``--device cuda`` the worker runs on the GPU and measures each step by the rise
    of ``torch.cuda.max_memory_allocated()`` (which sees inside compiled code) and
    CUDA-synchronised times; its rows say ``peak_source="allocator"``, and the baseline
    row keeps its name, ``no checkpointing (OS)``, with a note saying how it was measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch import nn

from autoremat._apply import apply, compile_model, remove
from autoremat._auto import fit_compiled
from autoremat._bench.measure import (
    build_target,
    describe_plan,
    first_line,
    largest_grad,
    ratio_range,
)
from autoremat._bench.refs import per_block, sac_per_block
from autoremat._bench.rows import (
    AUTO_COMPILE,
    COMPILE,
    COMPILE_BLOCK,
    COMPILE_EAGER,
    COMPILE_SAC,
    COMPILED_REFERENCES,
    BenchRow,
    Settings,
)
from autoremat._core.errors import BudgetError, RematError
from autoremat._core.files import write_atomic
from autoremat._core.step import (
    Loop,
    Step,
    as_step,
    call_model,
    default_loss,
    preserved_state,
    run_step,
)
from autoremat._core.units import format_bytes, parse_budget
from autoremat._measure.allocations import track_allocations
from autoremat._measure.flops import FlopCounter
from autoremat._measure.memory import os_peak_bytes, reset_os_peak, track_allocator
from autoremat._measure.tape import Tape
from autoremat._measure.timing import time_ms
from autoremat._plan.plan import Plan, plan_key
from autoremat._profile.profile import profile
from autoremat._profile.runs import compile_settings
from autoremat._verify import max_grad_diff

__all__ = ["compile_rows", "compile_worker"]


def compile_rows(target: str, settings: Settings, model: nn.Module, inputs: Any,
                 names: list[str], plain_peak: int, progress: Callable[[int, str], None],
                 grow: Callable[[int], None]) -> list[BenchRow]:
    """The compiled rows of ``target``, one subprocess per row (see the module note).

    References first: ``activation_memory_budget`` at each of
    ``settings.compile_fractions`` (``None``: 1.0 and one per budget, :func:`_fraction`),
    then every block of ``names`` under ``torch.utils.checkpoint`` and under the Megatron
    SAC policy, each with the whole model compiled. Then autoremat: ``model`` profiled
    compiled in this process, its plans fitted to each reference's measured peak, below
    the lowest of them and to the least any plan measures, by measuring the model
    compiled whole, then each run with the whole model compiled (NOTE [ autoremat's
    compiled rows ]). All compile with
    ``settings.compile_backend``. ``plain_peak`` is the in-process plain step's peak (the
    tracker's; the allocator's on CUDA), for the ratio in the baseline row's note. A failed
    subprocess gives an ``error`` row, not an exception. ``progress`` and ``grow`` as in
    the sweep.
    """
    s = settings
    fractions = s.compile_fractions
    if fractions is None:
        fractions = (1.0, *(_fraction(b, plain_peak) for b in s.budgets))
    fractions = tuple(dict.fromkeys(fractions))  # unique, in order
    references: list[tuple[str, str, dict[str, Any]]] = [
        (COMPILE, f"{f:g}" + (" (no budget)" if f >= 1 else ""),
         {"kind": "fraction", "fraction": f}) for f in fractions]
    references += [(COMPILE_BLOCK, "-", {"kind": "block", "blocks": names}),
                   (COMPILE_SAC, "-", {"kind": "sac", "blocks": names})]
    grow(len(references) + 1)
    runner = _Runner(target, s, plain_peak, progress)
    ran = [(runner.row(method, label, variant), variant)
           for method, label, variant in references]
    rows = runner.rows
    progress(0, f"{target}: profiling compiled ({s.compile_backend}) for autoremat's plans")
    step = as_step(model, inputs, None, s.loop, caller="bench", keyword="budget")
    with inductor_config.patch(fallback_random=True):  # as the worker compiles
        try:
            tape: Tape | None = profile(step, compile=s.compile_backend, timing=False)
            failed = ""
        except Exception as exc:  # reported in the table; the reference rows stand
            tape, failed = None, f"compiled profile failed: {type(exc).__name__}: {first_line(exc)}"
        progress(1, "")
        measured = [(r, variant) for r, variant in ran if r.method in COMPILED_REFERENCES
                    and r.status == "ok" and r.peak_bytes is not None]
        budgets: list[tuple[str, int | None, dict[str, Any] | None]] = [
            (f"peak of {r.method}" + (f" {r.budget.split()[0]}" if r.budget != "-" else ""),
             _budget_peak(r), variant) for r, variant in measured]
        if measured:
            lowest = min(_budget_peak(r) or 0 for r, _ in measured)
            budgets.append(("below the references", int(_BELOW * lowest), None))
        budgets.append(("min", 0, None))
        peaks: dict[Any, tuple[int, float]] = {}  # measured once for every budget
        by_plan: dict[tuple[Any, ...], tuple[str, BenchRow]] = {}
        for label, budget, versus in budgets:
            if tape is None or budget is None:
                rows.append(BenchRow(AUTO_COMPILE, label, "error", note=failed))
                continue
            grow(1)
            progress(0, f"{target}: autoremat + torch.compile at {label}: plans measured "
                        f"compiled whole")
            try:
                chosen = _fitted(step, tape, budget, s.compile_backend, peaks)
            except BudgetError as exc:
                rows.append(BenchRow(
                    AUTO_COMPILE, label, "infeasible", budget_bytes=budget,
                    note=f"every plan measured over it compiled whole; the smallest "
                         f"{format_bytes(exc.min_feasible_bytes or 0)}"))
                progress(1, "")
                continue
            finally:
                remove(model)
            progress(1, "")
            key = (plan_key(chosen), json.dumps(versus, sort_keys=True))
            if key in by_plan:  # the same plan against the same reference: timed once
                first, row = by_plan[key]
                rows.append(dataclasses.replace(
                    row, budget=label, budget_bytes=chosen.budget_bytes,
                    predicted_peak_bytes=chosen.compiled_peak_bytes,
                    note=f"same plan as {first}" + _over(_budget_peak(row),
                                                         chosen.budget_bytes)))
                continue
            grow(1)
            spec: dict[str, Any] = {"kind": "plan", "plan": chosen.to_json()}
            if versus is not None:  # timed against it, interleaved (NOTE [ Measuring ... ])
                spec["versus"] = versus
            row = runner.row(AUTO_COMPILE, label, spec,
                             plan_note=describe_plan(chosen) + "; the model compiled whole",
                             budget_bytes=chosen.budget_bytes,
                             predicted_peak_bytes=chosen.compiled_peak_bytes)
            by_plan[key] = (label, row)
    return rows


def _fitted(step: Step, tape: Tape, budget: int, backend: str,
            peaks: dict[Any, tuple[int, float]]) -> Plan:
    """autoremat's compiled plan for ``budget`` (0: its smallest), measured compiled
    whole (NOTE [ Compiled plans are fitted by measurement ] in _auto.py)."""
    if budget == 0:
        try:
            return fit_compiled(step, tape, 0, backend, peaks=peaks)
        except BudgetError as exc:
            budget = exc.min_feasible_bytes or 0
    return fit_compiled(step, tape, budget, backend, peaks=peaks)


# "below the references": autoremat planned for this fraction of the lowest peak any
# compiled reference measured
_BELOW = 0.9


def _budget_peak(row: BenchRow) -> int | None:
    """The peak a budget is compared with: on CPU the allocator's reports, the bytes
    plans are made in; else the row's peak (NOTE [ autoremat's compiled rows ])."""
    return row.allocations_peak_bytes if row.allocations_peak_bytes is not None \
        else row.peak_bytes


def _over(peak: int | None, budget: int | None) -> str:
    return "; OVER BUDGET" if peak is not None and budget is not None and peak > budget else ""


class _Runner:
    """Runs compile subprocesses and turns their figures into rows (kept in ``rows``);
    the first one that runs also gives the ``no checkpointing (OS)`` baseline row."""

    def __init__(self, target: str, settings: Settings, plain_peak: int,
                 progress: Callable[[int, str], None]) -> None:
        self.target, self.settings, self.plain_peak = target, settings, plain_peak
        self.progress = progress
        self.rows: list[BenchRow] = []
        self.source: Literal["os", "allocator"] = \
            "allocator" if torch.device(settings.device).type == "cuda" else "os"
        self.measured = "allocator-measured" if self.source == "allocator" else "OS-measured"
        self._baseline_added = False

    def row(self, method: str, label: str, variant: dict[str, Any], *, plan_note: str = "",
            budget_bytes: int | None = None,
            predicted_peak_bytes: int | None = None) -> BenchRow:
        s = self.settings
        what = f"activation_memory_budget={label.split()[0]}" if method == COMPILE else label
        self.progress(0, f"{self.target}: {method} {what} ({s.compile_backend}, subprocess; "
                         f"compiling is slow on CPU)")
        try:
            res = _run_compile_worker(self.target, dict(s.overrides), variant, s.repeats,
                                      s.compile_timeout_s, s.device, s.loop, s.compile_backend,
                                      s.dtype)
        except RematError as exc:
            row = BenchRow(method, label, "error", peak_source=self.source,
                           budget_bytes=budget_bytes,
                           predicted_peak_bytes=predicted_peak_bytes,
                           note=_join(plan_note, first_line(exc)))
            self.rows.append(row)
            self.progress(1, "")
            return row
        eager_ms = statistics.median(res["eager_ms"])
        if not self._baseline_added:
            self._baseline_added = True
            self.rows.append(self._baseline(res, eager_ms))
        med = statistics.median(res["compiled_ms"])
        eager_cpu = statistics.median(res["eager_cpu_ms"])
        plain_flops = res["eager_step_flops"]
        extra = res["compiled_bwd_flops"] - res["eager_bwd_flops"]
        note = _join(plan_note, f"{self.measured}; {s.compile_backend}, compiled in "
                                f"{res['compile_s']:.0f} s")
        if res.get("compiled_alloc_peak_bytes") is not None:
            note += f"; allocator's reports {format_bytes(res['compiled_alloc_peak_bytes'])}"
        relative = 0.0 if res["grads_equal"] else res["max_grad_diff"] / res["max_abs_grad"]
        if not res["grads_equal"]:
            note += f"; max |Δgrad| is {relative:.1e} of the largest gradient"
            if relative > 1e-3 and method == COMPILE and variant["fraction"] < 1:
                note += ", as when dropout is re-drawn in backward (pytorch#190758)"
            elif relative < 1e-5:
                note += " (float rounding of fused kernels)"
        peak = res["compiled_peak_bytes"]
        row = BenchRow(
            method, label, "ok", peak_bytes=peak, peak_source=self.source,
            plain_peak_bytes=res["eager_peak_bytes"], budget_bytes=budget_bytes,
            predicted_peak_bytes=predicted_peak_bytes,
            recompute_pct=100 * extra / plain_flops if plain_flops else None,
            step_ms=med, time_ratio=med / eager_ms if eager_ms else None,
            time_spread=_spread(res["compiled_ms"]),
            time_ratio_range=ratio_range(res["compiled_ms"], eager_ms),
            cpu_ratio=statistics.median(res["compiled_cpu_ms"]) / eager_cpu
            if eager_cpu else None,
            max_grad_diff=0.0 if res["grads_equal"] else res["max_grad_diff"],
            grads_equal=res["grads_equal"], relative_grad_diff=relative,
            allocations_peak_bytes=res.get("compiled_alloc_peak_bytes"), note=note,
            versus_ratio=med / statistics.median(res["versus_ms"]) if res.get("versus_ms")
            else None)
        if row.versus_ratio is not None:
            note += (f"; x{row.versus_ratio:.3f} the time of the reference whose peak is "
                     f"its budget, interleaved with it in this process")
        row = dataclasses.replace(row, note=note + _over(_budget_peak(row), budget_bytes))
        self.rows.append(row)
        self.progress(1, "")
        return row

    def _baseline(self, res: dict[str, Any], eager_ms: float) -> BenchRow:
        ratio = res["eager_peak_bytes"] / self.plain_peak
        note = (f"eager plain step in the first compile subprocess, baseline of the OS "
                f"rows; OS / tracker peak for it: {ratio:.1%}" if self.source == "os" else
                f"eager plain step in the first compile subprocess, {self.measured}, "
                f"baseline of the compile rows; its peak / the in-process plain step's: "
                f"{ratio:.1%}")
        return BenchRow(
            COMPILE_EAGER, "-", "ok", peak_bytes=res["eager_peak_bytes"],
            peak_source=self.source, plain_peak_bytes=res["eager_peak_bytes"],
            recompute_pct=0.0, step_ms=eager_ms, time_ratio=1.0,
            time_spread=_spread(res["eager_ms"]),
            time_ratio_range=ratio_range(res["eager_ms"], eager_ms), cpu_ratio=1.0,
            max_grad_diff=0.0, grads_equal=True, relative_grad_diff=0.0,
            allocations_peak_bytes=res.get("eager_alloc_peak_bytes"), note=note)


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def _spread(times: list[float]) -> float | None:
    med = statistics.median(times)
    return (max(times) - min(times)) / med if med else None


def _fraction(budget: str, plain_peak: int) -> float:
    """compile's ``activation_memory_budget`` matching a bench budget: '50%' -> 0.5,
    'min' -> 0.0 (recompute all it can), a size -> size / plain peak."""
    if budget == "min":
        return 0.0
    return round(min(1.0, parse_budget(budget, plain_peak) / plain_peak), 3)


def _run_compile_worker(target: str, overrides: dict[str, Any], variant: dict[str, Any],
                        repeats: int, timeout_s: float, device: str = "cpu",
                        loop: Loop = "holds_output", backend: str = "inductor",
                        dtype: str = "float32") -> dict[str, Any]:
    """The figures :func:`compile_worker` writes for one variant, run in a fresh process.

    Raises :class:`RematError` when the process times out or fails (with its last line of
    stderr).
    """
    with tempfile.TemporaryDirectory(prefix="autoremat-bench-") as tmp:
        out = Path(tmp) / "result.json"
        spec = {"target": target, "overrides": overrides, "variant": variant,
                "repeats": repeats, "threads": torch.get_num_threads(), "out": str(out),
                "device": device, "loop": loop, "backend": backend, "dtype": dtype}
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536",
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        code = "import sys; from autoremat._bench.compiled import compile_worker; " \
               "sys.exit(compile_worker(sys.argv[1]))"
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


def _compiled_variant(variant: dict[str, Any], spec: dict[str, Any], model: nn.Module,
                      backend: str, device: torch.device) -> tuple[nn.Module, nn.Module]:
    """``(runner, owner)``: what a compiled step calls, and the module whose parameters
    get its gradients. Compile's budget compiles ``model`` itself; the others set up a
    second copy of the target (same seed, same weights), so that the eager plain step
    keeps running ``model`` untouched: a toggled forward would make Dynamo recompile."""
    if variant["kind"] == "fraction":
        return torch.compile(model, backend=backend), model  # type: ignore[return-value]
    owner, _ = build_target(spec["target"], spec["overrides"], device,
                            spec.get("dtype", "float32"))
    if variant["kind"] == "plan":  # NOTE [ autoremat's compiled rows ]
        chosen = Plan.from_json(variant["plan"])
        apply(owner, chosen)
        return compile_model(owner, backend=backend), owner
    modules = [owner.get_submodule(n) for n in variant["blocks"]]
    install, _ = per_block(modules) if variant["kind"] == "block" else \
        sac_per_block(modules, save_bmm=False)
    install()
    return torch.compile(owner, backend=backend), owner  # type: ignore[return-value]


def compile_worker(spec_text: str) -> int:
    """Entry point of the compile subprocess; writes its figures as JSON to spec['out'].

    ``spec["variant"]`` says what is compiled: ``{"kind": "fraction", "fraction": f}``
    (compile's ``activation_memory_budget``), ``{"kind": "block" | "sac", "blocks":
    [...]}`` (the references of ``refs.py`` on those blocks) or ``{"kind": "plan",
    "plan": <plan JSON>}`` (an autoremat plan); an older spec's ``"fraction"`` alone
    means the first.
    """
    spec = json.loads(spec_text)
    variant = spec.get("variant") or {"kind": "fraction", "fraction": spec["fraction"]}
    backend = spec.get("backend", "inductor")
    torch.set_num_threads(int(spec["threads"]))
    functorch_config.activation_memory_budget = float(variant.get("fraction", 1.0))
    inductor_config.fallback_random = True  # same dropout masks as eager (module note)
    device = torch.device(spec.get("device", "cpu"))
    model, inputs = build_target(spec["target"], spec["overrides"], device,
                                 spec.get("dtype", "float32"))
    loop: Loop = spec.get("loop", "holds_output")
    rng = torch.get_rng_state()
    with compile_settings(backend):
        compiled, owner = _compiled_variant(variant, spec, model, backend, device)
        versus = None
        if "versus" in variant:  # a reference on a copy of its own, compiled under its
            #                      own budget at its first step (which compiles)
            ref = variant["versus"]
            copy, _ = build_target(spec["target"], spec["overrides"], device,
                                   spec.get("dtype", "float32"))
            with functorch_config.patch(activation_memory_budget=float(
                    ref.get("fraction", 1.0))):
                runner, ref_owner = _compiled_variant(ref, spec, copy, backend, device)
                with preserved_state(ref_owner):
                    run_step(runner, inputs, None, loop=loop)
            versus = (runner, ref_owner)
        result = _measure_pair(model, compiled, owner, inputs, rng, loop, device,
                               int(spec["repeats"]), versus)
    write_atomic(Path(spec["out"]), json.dumps({"variant": variant, **result}))
    return 0


Grads = dict[str, torch.Tensor | None]


def _measure_pair(model: nn.Module, compiled: nn.Module, owner: nn.Module, inputs: Any,
                  rng: torch.Tensor, loop: Loop, device: torch.device,
                  repeats: int, versus: tuple[nn.Module, nn.Module] | None = None
                  ) -> dict[str, Any]:
    """The eager plain step of ``model`` and the compiled step (``compiled``, gradients on
    ``owner``), interleaved: times, peaks, gradients and FLOPs (the module note). With
    ``versus`` (a compiled reference and its owner), its steps are timed in the same
    rounds (``versus_ms``): step times of two processes differ with the machine's load
    more than the rows do."""

    def step(module: nn.Module, params: nn.Module) -> tuple[float, float, int, Grads]:
        with preserved_state(params):
            torch.set_rng_state(rng)
            since = reset_os_peak() if device.type == "cpu" else 0
            cpu = time.process_time()
            with track_allocator(device) as alloc:  # CUDA only; see the module note
                wall = time_ms(lambda: run_step(module, inputs, None, loop=loop), device)
            cpu = time.process_time() - cpu
            peak = alloc.peak_bytes if alloc.peak_bytes is not None else os_peak_bytes(since)
            grads = {n: (p.grad.detach().clone() if p.grad is not None else None)
                     for n, p in params.named_parameters()}
        return wall, cpu * 1e3, peak, grads

    step(model, model)
    start = time.perf_counter()
    step(compiled, owner)  # compiles forward and backward
    compile_s = time.perf_counter() - start
    runs = {"eager": (model, model), "compiled": (compiled, owner)}
    if versus is not None:
        runs["versus"] = versus
    kinds = list(runs)
    figures: dict[str, dict[str, list[float]]] = {
        kind: {"ms": [], "cpu_ms": [], "peak": []} for kind in kinds}
    grads: dict[str, Grads] = {}
    for r in range(repeats + 1):  # round 0 is a warm-up
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:  # rotated each round
            ms, cpu, peak, grads[kind] = step(*runs[kind])
            if r:
                for key, value in (("ms", ms), ("cpu_ms", cpu), ("peak", peak)):
                    figures[kind][key].append(value)
    equal, diff = max_grad_diff(grads["eager"], grads["compiled"])
    eager_fwd, eager_bwd = _step_flops(model, model, inputs, rng, count_forward=True)
    _, compiled_bwd = _step_flops(owner, compiled, inputs, rng, count_forward=False)
    on_cpu = device.type == "cpu"
    return {
        "compile_s": compile_s,
        "eager_ms": figures["eager"]["ms"], "compiled_ms": figures["compiled"]["ms"],
        "eager_cpu_ms": figures["eager"]["cpu_ms"],
        "compiled_cpu_ms": figures["compiled"]["cpu_ms"],
        # the median step: the OS figure is exact to a page but not free of noise
        "eager_peak_bytes": int(statistics.median(figures["eager"]["peak"])),
        "compiled_peak_bytes": int(statistics.median(figures["compiled"]["peak"])),
        # on CPU, the allocator's own figure beside the OS one (NOTE [ autoremat's ... ])
        "eager_alloc_peak_bytes":
            _allocations_peak(model, model, inputs, rng, loop, device) if on_cpu else None,
        "compiled_alloc_peak_bytes":
            _allocations_peak(compiled, owner, inputs, rng, loop, device) if on_cpu else None,
        "grads_equal": equal, "max_grad_diff": diff,
        "max_abs_grad": largest_grad(grads["eager"]),
        "eager_step_flops": eager_fwd + eager_bwd, "eager_bwd_flops": eager_bwd,
        "compiled_bwd_flops": compiled_bwd,
        "versus_ms": figures["versus"]["ms"] if versus is not None else None,
    }


def _allocations_peak(module: nn.Module, params: nn.Module, inputs: Any, rng: torch.Tensor,
                      loop: Loop, device: torch.device) -> int:
    """The step peak from the allocator's reports (``track_allocations``: no dispatch
    mode, so compiled code stays compiled), gradients ``None`` before the step."""
    with preserved_state(params):
        torch.set_rng_state(rng)
        with track_allocations(device) as mem:
            run_step(module, inputs, None, loop=loop)
    return mem.peak_bytes


def _step_flops(owner: nn.Module, module: nn.Module, inputs: Any, rng: torch.Tensor, *,
                count_forward: bool) -> tuple[int, int]:
    """(forward, backward) FLOPs of a step of ``module`` (gradients on ``owner``). Without
    ``count_forward`` (compiled code) the forward runs without the counter, since a
    dispatch mode would make Dynamo fall back to eager, and its figure is 0."""
    with preserved_state(owner):
        torch.set_rng_state(rng)
        with (FlopCounter() if count_forward else _nothing()) as fwd:
            loss = default_loss(call_model(module, inputs))
        with FlopCounter() as bwd:
            loss.backward()
    return (fwd.total if isinstance(fwd, FlopCounter) else 0), bwd.total


@contextmanager
def _nothing() -> Iterator[None]:
    yield None
