"""The ``autoremat`` command line: demo, profile, plan, doctor (alias estimate), bench.

Every subcommand but demo takes a TARGET: a zoo name (``gpt2``, ``llama``, ``mlp``,
``resnet``), ``module:factory`` or ``path/to/file.py:factory`` where ``factory(**options)``
returns ``(model, inputs)`` (``_targets.TARGET_HELP``, printed in every ``--help``).

Every argument is checked before any work: a command that will be refused is refused in
one line before it builds or profiles anything (``tests/test_validation.py``).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import nn

from autoremat import zoo
from autoremat._apply import apply, remove
from autoremat._cli.bench import bench_main
from autoremat._cli.doctor import doctor_main
from autoremat._cli.extras import require_for_target
from autoremat._cli.progress import stages
from autoremat._core.errors import BudgetError, RematError, did_you_mean
from autoremat._core.files import check_writable
from autoremat._core.step import LOOPS
from autoremat._core.units import format_bytes
from autoremat._core.version import __version__
from autoremat._measure.blocks import discover_blocks
from autoremat._measure.tape import ops_table
from autoremat._plan.strategies import check_head, check_plan_args, plan, smallest_feasible_bytes
from autoremat._profile.profile import profile
from autoremat._targets import TARGET_HELP, load_target, parse_blocks, parse_options
from autoremat._verify import Report, verify

__all__ = ["main"]

# the strategies that decide nothing without a budget (the others fix their own plan)
_NEED_A_BUDGET = ("optimal",)


def _check_ops_block(model: nn.Module, block: str) -> None:
    """``--ops BLOCK`` names a block of the model's chain: checked once the model is built,
    before the profile (the tape's own check comes after it, minutes later)."""
    names = [n for n in discover_blocks(model) if n]
    if names and block not in names:
        raise RematError(f"--ops {block}: no block {block!r} in {type(model).__name__}."
                         + did_you_mean(block, names)
                         + f" Blocks: {', '.join(names[:8])}" + (", ..." if len(names) > 8
                                                                 else ""))


def _cmd_profile(args: argparse.Namespace, console: Console) -> int:
    if args.out:
        check_writable(args.out)
    require_for_target(args.target)
    model, inputs = load_target(args.target, parse_options(args.set))
    if args.ops:
        _check_ops_block(model, args.ops)
    with stages(f"profiling {args.target}") as stage:
        tape = profile(model, inputs, blocks=parse_blocks(args.blocks), loop=args.loop,
                       progress=stage)
    console.print(str(tape), highlight=False, soft_wrap=True)
    if args.ops:
        console.print(ops_table(tape, args.ops), highlight=False, soft_wrap=True)
    if args.out:
        tape.to_json(args.out)
        console.print(f"tape written to {args.out}")
    return 0


def _cmd_plan(args: argparse.Namespace, console: Console) -> int:
    if args.deterministic and not args.verify:
        raise RematError("--deterministic only changes how --verify compares gradients: "
                         "add --verify, or leave --deterministic out")
    name, _ = check_plan_args(args.budget, args.strategy, args.max_memory, args.optimizer,
                              margin=args.margin)
    check_head(args.head)
    if args.budget is not None and args.budget.strip().isdigit() and int(args.budget) <= 100:
        raise RematError(f"--budget {args.budget} is {args.budget} bytes, which no step "
                         f"fits; for a share of the plain peak write --budget {args.budget}%, "
                         f"else give bytes with a unit (e.g. 6GiB)")
    if name in _NEED_A_BUDGET and args.budget is None and args.max_memory is None:
        raise RematError(f"--strategy {args.strategy} needs --budget (e.g. --budget 50%, or "
                         "6GiB) or --max-memory (e.g. 24GiB): without one it keeps every "
                         "block and saves nothing; or pick a strategy that needs no budget: "
                         "--strategy full, sqrt or every:K")
    if args.out:
        check_writable(args.out)
    require_for_target(args.target)
    model, inputs = load_target(args.target, parse_options(args.set))
    with stages(f"planning {args.target}") as stage:
        tape = profile(model, inputs, blocks=parse_blocks(args.blocks), loop=args.loop,
                       progress=stage)
        stage("solving the plan")
        with warnings.catch_warnings():  # said below in the command's own words
            warnings.filterwarnings("ignore", message="autoremat: max_memory= without optimizer=")
            chosen = plan(tape, args.budget, args.strategy, max_memory=args.max_memory,
                          optimizer=args.optimizer, head=args.head, margin=args.margin)
    if args.max_memory is not None and args.optimizer is None:
        console.print("note: --max-memory without --optimizer counts no optimizer state "
                      "(AdamW holds two more copies of the trainable parameters); pass "
                      "--optimizer adamw (or the one the loop steps; none where it holds "
                      "none)", highlight=False, soft_wrap=True)
    console.print(str(chosen), highlight=False, soft_wrap=True)
    if args.verify:
        apply(model, chosen, check_ranks=False)
        with stages("verifying") as stage:
            stage("plain and planned steps, interleaved")
            report = verify(model, inputs, deterministic=args.deterministic)
        console.print(str(report), highlight=False, soft_wrap=True)
        if not report.ok:
            return 1
    if args.out:
        chosen.to_json(args.out)
        console.print(f"plan written to {args.out}")
    return 0


def _cmd_demo(args: argparse.Namespace, console: Console) -> int:
    if args.repeats < 1:
        raise RematError(f"--repeats must be at least 1 (timed steps per plan), got "
                         f"{args.repeats}")
    console.print(f"[bold]autoremat demo[/]: {zoo.ZOO[args.model].description}")
    model, inputs = zoo.build(args.model)
    with stages(f"profiling the {args.model} step block by block") as stage:
        tape = profile(model, inputs, progress=stage)
    console.print(str(tape), highlight=False, soft_wrap=True)
    least = smallest_feasible_bytes(tape)
    rows: list[tuple[str, str, Any]] = [("none", "none", None),
                                        ("every block", "full", None)]
    rows += [(f"optimal {b}", "optimal", b) for b in ("75%", "50%", "30%")]
    rows.append(("optimal min", "optimal", least))
    table = Table(title=f"{args.model}: plans, measured (step peak as in docs/design.md)")
    for col in ("plan", "budget", "predicted", "measured", "+FLOPs", "time", "grads"):
        table.add_column(col, justify="left" if col in ("plan",) else "right", no_wrap=True)
    columns = (SpinnerColumn(), TextColumn("{task.description}"),
               TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("measuring plans", total=len(rows))
        for label, strategy, budget in rows:
            progress.update(task, description=f"measuring plans: {label}")
            try:
                chosen = plan(tape, budget, strategy)
            except BudgetError as exc:
                table.add_row(label, str(budget), "-", "does not fit", "-", "-", "-")
                console.print(f"[yellow]{label}: {exc}[/]")
                progress.advance(task)
                continue
            apply(model, chosen, check_ranks=False)
            report = verify(model, inputs, repeats=args.repeats)
            remove(model)
            budget_text = format_bytes(chosen.budget_bytes) if chosen.budget_bytes else "-"
            table.add_row(label, budget_text, format_bytes(chosen.predicted_peak_bytes),
                          format_bytes(report.peak_bytes),
                          f"{100 * report.recompute_overhead:.1f}%", _time_cell(report),
                          "equal" if report.grads_equal else "DIFFER")
            progress.advance(task)
    console.print(table)
    console.print("time: median of interleaved steps against no checkpointing on this "
                  "machine, ± the larger relative spread (max - min) / median of the two "
                  "kinds of runs; 'noise' where the difference from x1.00 is within it. "
                  "+FLOPs: recompute, counted exactly.")
    return 0


def _time_cell(report: Report) -> str:
    """A demo table's time: the ratio, its noise, and whether it is only noise."""
    if report.timed_pairs < 2:
        return f"x{report.time_ratio:.2f} (1 run)"
    return (f"x{report.time_ratio:.2f} ±{report.time_noise:.2f}"
            + (" noise" if report.time_within_noise else ""))


def _cmd_delegate(name: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        if name == "bench":
            return bench_main(argv)
        return doctor_main(argv, prog=f"autoremat {name}")
    return run


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoremat", epilog=TARGET_HELP,
        description="Plan activation checkpointing for a PyTorch training step under a "
                    "memory budget. 'autoremat COMMAND --help' for each command's options.")
    parser.add_argument("--version", action="version", version=f"autoremat {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="profile a built-in model and compare plans")
    demo.add_argument("--model", default="gpt2", choices=zoo.names())
    demo.add_argument("--repeats", type=int, default=3, help="timed steps per plan (>= 1)")

    for name, helptext in (("profile", "measure a step block by block"),
                           ("plan", "plan checkpointing under a budget")):
        p = sub.add_parser(name, help=helptext, description=helptext, epilog=TARGET_HELP)
        p.add_argument("target", help="zoo name, module:factory or path/to/file.py:factory")
        p.add_argument("--set", help="options of the target, e.g. n_layer=12,batch_size=8 "
                                     "(a tuple: widths=64,128)")
        p.add_argument("--out", help="write the tape/plan JSON here")
        p.add_argument("--blocks", metavar="NAME,NAME,...",
                       help="the layers to plan over, in the order the model runs them "
                            "(default: the chain autoremat finds)")
        p.add_argument("--loop", choices=LOOPS, default="holds_output",
                       help="the training loop the figures hold for: holds_output (default; "
                            "out = model(...); out.loss.backward()) or loss_only (only the "
                            "loss is kept through backward)")
        if name == "profile":
            p.add_argument("--ops", metavar="BLOCK",
                           help="also list the forward ops of this block (e.g. blocks.0)")
        if name == "plan":
            p.add_argument("--budget", help="bytes, '6GiB', '500MB' or '40%%' of the plain "
                                            "peak (the default strategy needs it, or "
                                            "--max-memory)")
            p.add_argument("--strategy", default="optimal",
                           help="optimal (default; needs --budget or --max-memory) | full | "
                                "every:K | sqrt | selective | none")
            p.add_argument("--max-memory", help="absolute device limit, e.g. 24GiB")
            p.add_argument("--optimizer", help="optimizer state for --max-memory, e.g. adamw")
            p.add_argument("--head", help="the loss head of a causal LM given labels: keep "
                                          "(default), auto (chunk it where cheaper), chunked, "
                                          "chunked:N")
            p.add_argument("--margin", type=float, default=None,
                           help="share of the budget kept for what the CUDA allocator adds "
                                "beyond the prediction (default 0.03 on CUDA, 0 on CPU; 0: "
                                "none)")
            p.add_argument("--verify", action="store_true",
                           help="apply the plan and measure it against the plain step")
            p.add_argument("--deterministic", action="store_true",
                           help="with --verify: both steps under deterministic algorithms, "
                                "gradients compared with torch.equal (on CUDA, start with "
                                "CUBLAS_WORKSPACE_CONFIG=:4096:8)")
    sub.add_parser("doctor", help="will it fit? estimate on fake tensors and prescribe "
                                  "(takes a TARGET)", add_help=False)
    sub.add_parser("estimate", help="alias of doctor", add_help=False)
    sub.add_parser("bench", help="side-by-side benchmark against PyTorch's options "
                                 "(takes TARGETs)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autoremat`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)  # a log file: do not fold the tables into 80 columns
    try:
        if argv and argv[0] in ("doctor", "estimate", "bench"):
            return _cmd_delegate(argv[0])(argv[1:])
        args = _parser().parse_args(argv)
        handler = {"demo": _cmd_demo, "profile": _cmd_profile, "plan": _cmd_plan}[args.command]
        return handler(args, console)
    except RematError as exc:
        console.print("[red]error:[/] ", end="")
        console.print(str(exc), highlight=False, markup=False, soft_wrap=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
