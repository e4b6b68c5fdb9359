"""``autoremat bench``: compare autoremat's plans with PyTorch's own options.

Argument parsing, result files and printing; the sweep is :func:`run_bench`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import time
from typing import Any

import torch
from rich.console import Console

from autoremat import zoo
from autoremat._bench.bench import run_bench
from autoremat._bench.measure import DTYPES, resolve_device
from autoremat._bench.plots import PLOT_HINT, can_plot
from autoremat._bench.report import device_info, machine_info, write_results
from autoremat._bench.rows import ModelResult, Settings
from autoremat._cli.extras import require_for_target
from autoremat._core.errors import RematError
from autoremat._core.files import check_writable
from autoremat._core.units import parse_budget
from autoremat._profile.profile import compile_backend
from autoremat._targets import TARGET_HELP, check_target, parse_options

__all__ = ["bench_main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autoremat bench", epilog=TARGET_HELP,
        description="Compare autoremat's plans with PyTorch's own checkpointing options on "
                    "the same model, interleaved in one process; write a table, JSON and "
                    "a Pareto plot per model.")
    p.add_argument("targets", nargs="*", metavar="TARGET",
                   help=f"zoo name ({', '.join(zoo.names())}; default: all), "
                        f"module:factory or path/to/file.py:factory")
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
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compiled rows, e.g. aot_eager (no "
                        "fusion, compiles fast; default: %(default)s)")
    p.add_argument("--compile-fractions", default="1,0.8,0.5,0.2",
                   help="comma-separated values of compile's activation_memory_budget, one "
                        "row each (default: %(default)s); 'budgets' takes them from "
                        "--budgets (and 1)")
    p.add_argument("--set", help="size options for every target, e.g. n_layer=2,batch_size=2 "
                                 "(a tuple: widths=64,128)")
    p.add_argument("--device", default="cpu",
                   help="where models and inputs run: cpu or cuda[:N] (default: %(default)s); "
                        "on CUDA peaks are the rise of torch.cuda.max_memory_allocated() and "
                        "times are CUDA-synchronised; result files are named after it")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="floating dtype of zoo models and their inputs (default: "
                        "%(default)s; gradients are compared exactly only in float32)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for the measured steps (default 1: steadiest times on "
                        "a shared CPU; 0 keeps torch's default)")
    return p


def _fractions(text: str) -> tuple[float, ...] | None:
    """``--compile-fractions``: values in [0, 1], or ``budgets`` (None: from --budgets)."""
    if text.strip() == "budgets":
        return None
    values = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            value = float(item)
        except ValueError:
            value = -1.0
        if not 0.0 <= value <= 1.0:
            raise RematError(f"--compile-fractions takes numbers from 0 to 1 (compile's "
                             f"activation_memory_budget) or 'budgets', got {item!r} in "
                             f"{text!r}")
        values.append(value)
    if not values:
        raise RematError("--compile-fractions is empty; e.g. --compile-fractions 1,0.5")
    return tuple(values)


def bench_main(argv: list[str]) -> int:
    """``autoremat bench ...``; returns the exit status."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # a log file: do not fold the table into 80 columns
    args = _parser().parse_args(argv)
    try:
        budgets = tuple(b.strip() for b in args.budgets.split(",") if b.strip())
        if not budgets:
            raise RematError("--budgets is empty; e.g. --budgets 75%,50%,30%,min")
        for budget in budgets:
            if budget != "min":
                parse_budget(budget, 1)  # the syntax, before any model is built
        repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)
        if repeats < 1:
            raise RematError(f"--repeats must be at least 1, got {repeats}")
        device = resolve_device(args.device)
        backend = compile_backend(args.compile_backend) or "inductor"  # a name: never None
        settings = Settings(
            budgets=budgets, repeats=repeats,
            compile=(not args.quick) if args.compile is None else args.compile,
            overrides=tuple(parse_options(args.set).items()), threads=args.threads,
            device=str(device), dtype=args.dtype, compile_backend=backend,
            compile_fractions=_fractions(args.compile_fractions),
        )
        if args.threads < 0:
            raise RematError(f"--threads must be 0 (torch's default) or more, got "
                             f"{args.threads}")
        targets = list(args.targets) or zoo.names()
        for target in targets:
            check_target(target)  # before the output folder is made
            require_for_target(target)
            if target in zoo.names():  # --set holds for each: checked before any runs
                zoo.build(target, device="meta", **dict(settings.overrides))
        machine = machine_info()
        machine["torch_threads"] = settings.threads or torch.get_num_threads()
        machine.update(device_info(device))
        command = "autoremat bench " + shlex.join(argv)
        start = time.perf_counter()
        out = check_writable(args.out, directory=True)

        def save(done: list[ModelResult]) -> Any:
            machine["load_average_end"] = list(os.getloadavg()) \
                if hasattr(os, "getloadavg") else None
            return write_results(done, out, command, machine, time.perf_counter() - start,
                                 settings, complete=len(done) == len(targets))

        results = run_bench(targets, settings, console, on_model=save)
        elapsed = time.perf_counter() - start
        paths = save(results)
    except RematError as exc:
        console.print("[red]error:[/] ", end="")
        console.print(str(exc), highlight=False, markup=False, soft_wrap=True)
        return 2
    for res in results:
        console.print(f"[bold]{res.target}[/]")
        for line in res.headline:
            console.print(f"  - {line}", highlight=False, markup=False)
    if settings.compile:
        how = "allocator-measured (max_memory_allocated" if device.type == "cuda" else \
            "OS-measured (VmHWM"
        console.print(f"compiled rows are {how} in a subprocess, against an eager plain "
                      "step there): a dispatch mode cannot see inside compiled code"
                      + ("; on CPU autoremat's compiled budgets are in the allocator's "
                         "bytes (from its reports to the profiler)." if device.type != "cuda"
                         else "."), highlight=False)
    console.print(f"{len(targets)} model(s) in {elapsed / 60:.1f} min; wrote "
                  + ", ".join(str(p) for p in paths), highlight=False, markup=False)
    if not can_plot():
        console.print(f"no plots: {PLOT_HINT}", highlight=False, markup=False)
    return 0
