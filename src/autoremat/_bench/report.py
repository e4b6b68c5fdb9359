"""What ``autoremat bench`` says about its rows: verdicts, tables and result files.

:func:`headline` draws one sentence per reference from a model's rows (how autoremat's
plans at an equal or lower peak compare); :func:`rich_table` shows a model's rows on the
console; :func:`write_results` writes ``results.md``, ``results.json`` (versioned by
:data:`SCHEMA_VERSION`, written atomically) and one Pareto plot per model, with the
machine description of :func:`machine_info` and :func:`device_info`; on a device other
than the CPU the file names carry it (``results_cuda.json``). Everything here reads
finished rows and measures nothing.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from autoremat._bench.plots import can_plot, pareto_plot
from autoremat._bench.rows import (
    AUTO,
    AUTO_COMPILE,
    COMPILE,
    COMPILE_EAGER,
    COMPILED_REFERENCES,
    NONE,
    BenchRow,
    ModelResult,
    Settings,
)
from autoremat._core.files import write_atomic
from autoremat._core.units import format_bytes
from autoremat._core.version import __version__

__all__ = ["SCHEMA_VERSION", "device_info", "device_slug", "headline", "machine_info",
           "rich_table", "write_results"]

SCHEMA_VERSION = 1  # of results.json


# --- verdicts ---------------------------------------------------------------------------


def headline(rows: Sequence[BenchRow]) -> list[str]:
    """One sentence per reference: how autoremat's plans at an equal or lower peak compare.

    Peaks are compared within one measurement system: bytes for the eager references,
    fractions of the plain peak for the OS-measured compile rows. Among the autoremat
    plans at or below the reference's peak, the one with the fewest recompute FLOPs
    (exact) is compared on FLOPs and time; when another of them is clearly faster, it is
    named too. A time difference counts only when the min..max ranges do not overlap.
    Compiled references are compared with autoremat's compiled plans (``autoremat +
    torch.compile``) where there are any, times included; else with the eager plans,
    times not compared.
    """
    def ok(method: str) -> list[BenchRow]:
        return [r for r in rows if r.method == method and r.status == "ok"
                and r.peak_bytes is not None]

    eager_autos, compiled_autos = ok(AUTO), ok(AUTO_COMPILE)
    out: list[str] = []
    for ref in rows:
        if ref.method in (NONE, AUTO, AUTO_COMPILE, COMPILE_EAGER) or ref.status != "ok":
            continue
        assert ref.peak_bytes is not None
        compiled_ref = ref.method in COMPILED_REFERENCES
        autos = compiled_autos if compiled_ref and compiled_autos else eager_autos
        same_kind = compiled_ref == (autos is compiled_autos)  # times comparable
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
        if not same_kind:
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


# --- tables and files -------------------------------------------------------------------


def _cells(r: BenchRow) -> list[str]:
    ok = r.status == "ok"
    peak = "-" if r.peak_bytes is None else format_bytes(r.peak_bytes) + \
        (" (OS)" if r.peak_source == "os" else "")
    frac = f"{100 * r.peak_fraction:.0f}%" if r.peak_fraction is not None else "-"
    fits = "-"
    # compiled rows on CPU: the allocator's figure, the bytes budgets are in
    measured = r.allocations_peak_bytes if r.allocations_peak_bytes is not None \
        else r.peak_bytes
    if r.budget_bytes is not None and ok and measured is not None:
        fits = "yes" if measured <= r.budget_bytes else "NO"
    elif r.status == "infeasible":
        fits = "infeasible"
    budget = r.budget
    if r.method in (AUTO, AUTO_COMPILE) and r.budget_bytes is not None \
            and not budget.startswith("peak"):
        budget += f" ({format_bytes(r.budget_bytes)})"
    predicted = "-" if r.predicted_peak_bytes is None else format_bytes(r.predicted_peak_bytes)
    return [
        r.method, budget, peak if ok else r.status, predicted, frac, fits,
        f"+{r.recompute_pct:.1f}%" if r.recompute_pct is not None else "-",
        f"{r.step_ms:.0f}" if r.step_ms is not None else "-",
        f"x{r.time_ratio:.2f}" if r.time_ratio is not None else "-",
        f"{100 * r.time_spread:.0f}%" if r.time_spread is not None else "-",
        f"x{r.cpu_ratio:.2f}" if r.cpu_ratio is not None else "-",
        ("0" if r.grads_equal else f"{r.max_grad_diff:.2g}") if r.max_grad_diff is not None
        else "-",
        r.note,
    ]


_HEADERS = ["method", "budget", "step peak", "predicted", "% plain", "fits", "+FLOPs", "ms",
            "x plain", "spread", "x CPU", "max|Δgrad|", "note"]


def rich_table(result: ModelResult) -> Table:
    """One model's rows as a console table; autoremat's plans that ran in bold."""
    table = Table(title=f"{result.target} ({result.model}, {result.n_blocks} blocks, inputs "
                        f"{result.inputs}): plain step {format_bytes(result.plain_peak_bytes)}, "
                        f"{result.plain_step_ms:.0f} ms", title_justify="left")
    for h in _HEADERS:
        table.add_column(h, justify="left" if h in ("method", "budget", "note") else "right",
                         overflow="fold")
    for r in result.rows:
        style = "bold" if r.method in (AUTO, AUTO_COMPILE) and r.status == "ok" else None
        table.add_row(*_cells(r), style=style)
    return table


def machine_info() -> dict[str, Any]:
    """Platform, versions, CPU model and count, torch threads and load average, for the
    header of the result files."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "autoremat": __version__, "cpu": cpu,
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def device_info(device: torch.device | str) -> dict[str, Any]:
    """``device`` (as given) and ``device_name``: the GPU's name on CUDA
    (``torch.cuda.get_device_name``), the CPU's model elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = str(machine_info()["cpu"])
    return {"device": str(device), "device_name": name}


def device_slug(device: torch.device | str) -> str:
    """``device``'s type and name as a file-name part: ``"cuda-nvidia-h200"``,
    ``"cpu-intel-r-xeon-r-processor-2-50ghz"`` (the benchmarks' result files)."""
    device = torch.device(device)
    name = device_info(device)["device_name"]
    return re.sub(r"[^a-z0-9]+", "-", f"{device.type}-{name}".lower()).strip("-")


def _suffix(device: str) -> str:
    """File-name suffix for results measured on ``device``: none on the CPU (the committed
    results keep their names), ``_cuda`` / ``_cuda1`` otherwise."""
    return "" if device == "cpu" else "_" + "".join(c for c in device if c.isalnum())


def _markdown(results: list[ModelResult], command: str, machine: dict[str, Any],
              elapsed_s: float, complete: bool, device: str = "cpu") -> str:
    on_cuda = torch.device(device).type == "cuda"
    lines = [
        "# autoremat bench results", "",
        f"Command: `{command}`  ",
        f"Sweep time: {elapsed_s / 60:.1f} min" + ("" if complete else " (INCOMPLETE: still "
                                                   "running or interrupted)") + "  ",
        f"Machine: {machine['cpu']} ({machine['cpu_count']} cores, {machine['torch_threads']} "
        f"torch threads), {machine['platform']}, Python {machine['python']}, torch "
        f"{machine['torch']}, autoremat {machine['autoremat']}; load average at the end "
        f"{', '.join(f'{x:.1f}' for x in machine.get('load_average_end') or [])}", "",
        *([f"Device: {device} ({machine.get('device_name', '?')}). Step peaks are the rise of "
           "`torch.cuda.max_memory_allocated()` over the step (peak statistics reset "
           "before it); the storage tracker's figure is in the JSON (`tracker_peak_bytes`) "
           "and in a row's note when it is off by more than 0.5%. Times are "
           "CUDA-synchronised (events). Gradients are compared with `torch.equal`; CUDA "
           "kernels are not deterministic, so a row within 4x the plain step's own "
           "run-to-run difference says so in its note.", ""] if on_cuda else []),
        "How to read the tables:", "",
        "- **step peak**: as in docs/design.md (storage accounting), with **% plain** its share "
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
        "its budget: the like-for-like comparison. Identical plans are measured once. "
        "**predicted**: the plan's predicted peak.",
        "- **Compiled rows** (`--compile`), each in its own subprocess against an eager "
        "plain step there, all with one backend (`--compile-backend`): `torch.compile` at "
        "each `activation_memory_budget`, `torch.compile + checkpoint per block` "
        "(non-reentrant) and `torch.compile + SAC per block` (Megatron policy: save "
        "mm/addmm/attention/conv outputs) with the whole model compiled, and `autoremat + "
        "torch.compile`: plans from a compiled profile (`profile(..., compile=backend)`) "
        "fitted to each of those rows' measured peaks, below the lowest and to the least "
        "any plan measures, by measuring the model compiled whole (`auto(..., "
        "compile=...)`'s fit), and run with the whole model compiled; their **predicted** "
        "is the peak the fit measured. On CPU their note also gives the peak from the "
        "allocator's own reports (JSON `allocations_peak_bytes`), the figure the fit "
        "measures; autoremat's compiled budgets and their **fits** use it.",
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
                  f"![{res.target} Pareto plot]({_plot_name(res.target, device)})", ""]
    return "\n".join(lines)


def _slug(target: str) -> str:
    """File-name stem: the zoo name, or the factory's name of ``package.module:factory``."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in target.rpartition(":")[2])


def _plot_name(target: str, device: str) -> str:
    return f"{_slug(target)}_pareto{_suffix(device)}.png"


def write_results(results: list[ModelResult], out: Path, command: str,
                  machine: dict[str, Any], elapsed_s: float, settings: Settings, *,
                  complete: bool = True) -> list[Path]:
    """results.md, results.json (atomically) and one Pareto PNG per model in ``out``; with
    ``settings.device`` other than the CPU the names carry it (``results_cuda.md``,
    ``gpt2_pareto_cuda.png``), so that CPU and GPU results live side by side.

    ``complete=False`` marks a sweep still running (files are rewritten after each model).
    Without matplotlib the plots are skipped (the caller says so, :data:`PLOT_HINT`); the
    tables and the JSON are written all the same.
    """
    out.mkdir(parents=True, exist_ok=True)
    suffix = _suffix(settings.device)
    written = []
    for res in results if can_plot() else []:
        path = out / _plot_name(res.target, settings.device)
        pareto_plot(res, path)
        written.append(path)
    payload = {
        "schema_version": SCHEMA_VERSION, "complete": complete, "command": command,
        "machine": machine, "elapsed_s": elapsed_s,
        "settings": {**asdict(settings), "overrides": dict(settings.overrides)},
        "models": [{**{k: v for k, v in asdict(res).items() if k != "rows"},
                    "rows": [asdict(r) for r in res.rows]} for res in results],
    }
    json_path, md_path = out / f"results{suffix}.json", out / f"results{suffix}.md"
    write_atomic(json_path, json.dumps(_finite(payload), indent=1, default=_json_default,
                                       allow_nan=False))
    write_atomic(md_path, _markdown(results, command, machine, elapsed_s, complete,
                                    settings.device))
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
