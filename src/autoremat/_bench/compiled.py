"""The ``torch.compile`` rows of ``autoremat bench``: a subprocess per budget, OS-measured.

:func:`compile_rows` runs, for each ``activation_memory_budget`` fraction, a fresh Python
process whose entry point is :func:`compile_worker` (started as ``python -c "from
autoremat._bench.compiled import compile_worker; ..."``, so that name must not move). The
worker compiles the target, times it against an eager plain step in the same process and
writes its figures as JSON; :func:`compile_rows` turns them into rows, led by one
``no checkpointing (OS)`` row that is their baseline.

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
from torch import nn

from autoremat._bench.measure import build_target, first_line, largest_grad, ratio_range
from autoremat._bench.rows import COMPILE, COMPILE_EAGER, BenchRow, Settings
from autoremat._core.errors import RematError
from autoremat._core.flops import FlopCounter
from autoremat._core.memory import os_peak_bytes, reset_os_peak, track_allocator
from autoremat._core.step import Loop, call_model, default_loss, preserved_state, run_step
from autoremat._core.timing import time_ms
from autoremat._core.units import parse_budget
from autoremat._measure.tape import write_atomic
from autoremat._verify import max_grad_diff

__all__ = ["compile_rows", "compile_worker"]


def compile_rows(target: str, settings: Settings, plain_peak: int,
                 progress: Callable[[int, str], None],
                 grow: Callable[[int], None]) -> list[BenchRow]:
    """The compile rows of ``target``, one subprocess per fraction (see the module note).

    Fractions are ``settings.compile_fractions``, by default 1.0 and one per budget
    (:func:`_fraction`). ``plain_peak`` is the in-process plain step's peak (the tracker's;
    the allocator's on CUDA), for the ratio in the baseline row's note. A failed subprocess gives an
    ``error`` row, not an exception. ``progress`` and ``grow`` as in the sweep.
    """
    s = settings
    fractions = s.compile_fractions
    if fractions is None:
        fractions = (1.0, *(_fraction(b, plain_peak) for b in s.budgets))
    fractions = tuple(dict.fromkeys(fractions))  # unique, in order
    grow(len(fractions))
    rows: list[BenchRow] = []
    eager_row_added = False
    source: Literal["os", "allocator"] = \
        "allocator" if torch.device(s.device).type == "cuda" else "os"
    measured = "allocator-measured" if source == "allocator" else "OS-measured"
    for fraction in fractions:
        progress(0, f"{target}: torch.compile, activation_memory_budget="
                    f"{fraction:g} (subprocess; compiling is slow on CPU)")
        label = f"{fraction:g}" + (" (no budget)" if fraction >= 1 else "")
        try:
            res = _run_compile_worker(target, dict(s.overrides), fraction, s.repeats,
                                      s.compile_timeout_s, s.device, s.loop)
        except RematError as exc:
            rows.append(BenchRow(COMPILE, label, "error", peak_source=source,
                                 note=first_line(exc)))
            progress(1, "")
            continue
        eager_ms = statistics.median(res["eager_ms"])
        if not eager_row_added:
            eager_row_added = True
            ratio = res["eager_peak_bytes"] / plain_peak
            baseline = (f"eager plain step in the first compile subprocess, baseline of the "
                        f"OS rows; OS / tracker peak for it: {ratio:.1%}"
                        if source == "os" else
                        f"eager plain step in the first compile subprocess, {measured}, "
                        f"baseline of the compile rows; its peak / the in-process plain "
                        f"step's: {ratio:.1%}")
            rows.append(BenchRow(
                COMPILE_EAGER, "-", "ok", peak_bytes=res["eager_peak_bytes"],
                peak_source=source, plain_peak_bytes=res["eager_peak_bytes"],
                recompute_pct=0.0, step_ms=eager_ms, time_ratio=1.0,
                time_spread=_spread(res["eager_ms"]),
                time_ratio_range=ratio_range(res["eager_ms"], eager_ms), cpu_ratio=1.0,
                max_grad_diff=0.0, grads_equal=True, relative_grad_diff=0.0,
                note=baseline))
        med = statistics.median(res["compiled_ms"])
        eager_cpu = statistics.median(res["eager_cpu_ms"])
        plain_flops = res["eager_step_flops"]
        extra = res["compiled_bwd_flops"] - res["eager_bwd_flops"]
        note = f"{measured}; compiled in {res['compile_s']:.0f} s"
        relative = 0.0 if res["grads_equal"] else res["max_grad_diff"] / res["max_abs_grad"]
        if not res["grads_equal"]:
            note += f"; max |Δgrad| is {relative:.1e} of the largest gradient"
            if relative > 1e-3 and fraction < 1:
                note += ", as when dropout is re-drawn in backward (pytorch#190758)"
            elif relative < 1e-5:
                note += " (float rounding of fused kernels)"
        rows.append(BenchRow(
            COMPILE, label, "ok", peak_bytes=res["compiled_peak_bytes"], peak_source=source,
            plain_peak_bytes=res["eager_peak_bytes"],
            recompute_pct=100 * extra / plain_flops if plain_flops else None,
            step_ms=med, time_ratio=med / eager_ms if eager_ms else None,
            time_spread=_spread(res["compiled_ms"]),
            time_ratio_range=ratio_range(res["compiled_ms"], eager_ms),
            cpu_ratio=statistics.median(res["compiled_cpu_ms"]) / eager_cpu
            if eager_cpu else None,
            max_grad_diff=0.0 if res["grads_equal"] else res["max_grad_diff"],
            grads_equal=res["grads_equal"], relative_grad_diff=relative, note=note))
        progress(1, "")
    return rows


def _spread(times: list[float]) -> float | None:
    med = statistics.median(times)
    return (max(times) - min(times)) / med if med else None


def _fraction(budget: str, plain_peak: int) -> float:
    """compile's ``activation_memory_budget`` matching a bench budget: '50%' -> 0.5,
    'min' -> 0.0 (recompute all it can), a size -> size / plain peak."""
    if budget == "min":
        return 0.0
    return round(min(1.0, parse_budget(budget, plain_peak) / plain_peak), 3)


def _run_compile_worker(target: str, overrides: dict[str, Any], fraction: float, repeats: int,
                        timeout_s: float, device: str = "cpu",
                        loop: Loop = "holds_output") -> dict[str, Any]:
    """The figures :func:`compile_worker` writes for one fraction, run in a fresh process.

    Raises :class:`RematError` when the process times out or fails (with its last line of
    stderr).
    """
    with tempfile.TemporaryDirectory(prefix="autoremat-bench-") as tmp:
        out = Path(tmp) / "result.json"
        spec = {"target": target, "overrides": overrides, "fraction": fraction,
                "repeats": repeats, "threads": torch.get_num_threads(), "out": str(out),
                "device": device, "loop": loop}
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


def compile_worker(spec_text: str) -> int:
    """Entry point of the compile subprocess; writes its figures as JSON to spec['out']."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    spec = json.loads(spec_text)
    torch.set_num_threads(int(spec["threads"]))
    functorch_config.activation_memory_budget = float(spec["fraction"])
    inductor_config.fallback_random = True  # same dropout masks as eager (module note)
    device = torch.device(spec.get("device", "cpu"))
    model, inputs = build_target(spec["target"], spec["overrides"], device)
    loop: Loop = spec.get("loop", "holds_output")
    rng = torch.get_rng_state()
    compiled: nn.Module = torch.compile(model)  # type: ignore[assignment]

    Grads = dict[str, torch.Tensor | None]

    def step(module: nn.Module) -> tuple[float, float, int, Grads]:
        with preserved_state(model):
            torch.set_rng_state(rng)
            since = reset_os_peak() if device.type == "cpu" else 0
            cpu = time.process_time()
            with track_allocator(device) as alloc:  # CUDA only; see the module note
                wall = time_ms(lambda: run_step(module, inputs, None, loop=loop), device)
            cpu = time.process_time() - cpu
            peak = alloc.peak_bytes if alloc.peak_bytes is not None else os_peak_bytes(since)
            grads = {n: (p.grad.detach().clone() if p.grad is not None else None)
                     for n, p in model.named_parameters()}
        return wall, cpu * 1e3, peak, grads

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
    equal, diff = max_grad_diff(grads["eager"], grads["compiled"])
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
        "grads_equal": equal, "max_grad_diff": diff,
        "max_abs_grad": largest_grad(grads["eager"]),
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
