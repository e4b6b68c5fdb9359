"""How long ``autoremat.plan(tape, budget, "optimal")`` takes on a 200-block chain.

The goal of the planner issue is under one second. The tape is synthetic (no model is
run): 200 chained blocks of varied sizes and costs, with windows shaped like a real
step's (a kept block saves its activations, a checkpointed one holds its output and
recomputes the rest in backward). Times are the median of 5 calls per budget.

Run: ``python benchmarks/plan_speed.py`` (writes ``benchmarks/plan_speed.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import random
import statistics
import time
from pathlib import Path

import torch

import autoremat
from autoremat import Decision
from autoremat._core.decisions import KEEP, RECOMPUTE
from autoremat._core.units import format_bytes
from autoremat._measure.tape import BlockProfile, Tape, WindowMemory
from autoremat._plan.peak import predict_peak
from autoremat._plan.strategies import smallest_feasible_bytes

MiB = 1 << 20
K, C = Decision.KEEP, Decision.RECOMPUTE  # window keys: (previous block's, this block's)


def _w(peak: int, delta: int) -> WindowMemory:
    return WindowMemory(peak_bytes=max(peak, delta, 0), delta_bytes=delta)


def chain_tape(n: int = 200, seed: int = 0, *, uniform: bool = False) -> Tape:
    """``n`` chained blocks; sizes in MiB and costs in FLOPs vary block to block
    (``uniform``: every block draws the same, as in a stack of identical layers)."""
    rng = random.Random(seed)
    blocks = []
    prev_out = 4 * MiB
    for i in range(n):
        if uniform:
            rng = random.Random(seed)
        out = rng.randint(1, 16) * MiB  # output (the next block's input)
        saved = out + rng.randint(0, 64) * MiB  # activations kept for backward
        tf, tb = rng.randint(0, 16) * MiB, rng.randint(0, 16) * MiB  # transients
        grads = rng.randint(0, 8) * MiB  # parameter gradients its backward creates
        fwd = {(K, K): _w(saved + tf, saved), (C, K): _w(saved + tf, saved),
               (K, C): _w(saved + tf, out), (C, C): _w(saved + tf, out)}
        bwd = {(K, K): _w(tb + grads, grads - saved), (C, K): _w(tb + grads, grads - saved),
               (K, C): _w(saved - out + tb + grads, grads - out),
               (C, C): _w(saved - out + tb + grads, grads - out)}
        if i == 0:  # the first block follows the stem, as a kept one
            fwd = {k: v for k, v in fwd.items() if k[0] is K}
            bwd = {k: v for k, v in bwd.items() if k[0] is K}
        flops = rng.randint(1, 100) * 10**9
        blocks.append(BlockProfile(
            name=f"blocks.{i}", fwd_ms=1.0, bwd_ms=2.0, fwd_flops=flops, bwd_flops=2 * flops,
            saved_bytes=saved, saved_bytes_by_kind={"matmul": saved}, input_bytes=prev_out,
            output_bytes=out, param_bytes=0, grad_bytes=grads, fwd=fwd, bwd=bwd,
            chained=i > 0, chain_bytes=prev_out if i > 0 else 0,
        ))
        prev_out = out
    zero = _w(0, 0)
    tape = Tape(
        model="SyntheticChain", inputs="x: (1,) float32", device="cpu", blocks=tuple(blocks),
        step_peak_bytes=1, peak_breakdown={}, ckpt_step_peak_bytes=1, param_bytes=0,
        trainable_param_bytes=0, buffer_bytes=0, grad_bytes=0, pre=_w(4 * MiB, 4 * MiB),
        post={K: _w(64 * MiB, 8 * MiB), C: _w(64 * MiB, 8 * MiB)},
        tail={K: zero, C: zero},
        step_fwd_flops=sum(b.fwd_flops for b in blocks),
        step_bwd_flops=sum(b.bwd_flops for b in blocks), step_ms=1.0,
    )
    keep = [(i, i + 1, KEEP) for i in range(n)]
    full = [(i, i + 1, RECOMPUTE) for i in range(n)]
    return dataclasses.replace(tape, step_peak_bytes=predict_peak(tape, keep),
                               ckpt_step_peak_bytes=predict_peak(tape, full))


def time_plan(tape: Tape, budget: int | str, repeats: int) -> tuple[float, autoremat.Plan]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = autoremat.plan(tape, budget, "optimal")
        times.append(time.perf_counter() - start)
    assert result is not None
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("plan_speed.md"))
    args = parser.parse_args()

    rows = []
    for kind, tape in (("varied", chain_tape(args.blocks)),
                       ("identical", chain_tape(args.blocks, uniform=True))):
        smallest = smallest_feasible_bytes(tape)
        budgets: list[tuple[str, int | str]] = [
            ("75%", "75%"), ("50%", "50%"), ("smallest feasible", smallest),
        ]
        for label, budget in budgets:
            try:
                seconds, p = time_plan(tape, budget, args.repeats)
            except autoremat.BudgetError:
                rows.append(f"| {kind} | {label} | infeasible | | | |")
                continue
            rows.append(f"| {kind} | {label} ({format_bytes(p.budget_bytes or 0)}) | "
                        f"{format_bytes(tape.step_peak_bytes)} | "
                        f"{format_bytes(p.predicted_peak_bytes)} | "
                        f"{100 * p.recompute_overhead:.1f}% | {seconds:.3f} s |")
            print(f"{args.blocks} {kind} blocks, budget {label}: plan() median "
                  f"{seconds:.3f} s (predicted peak {format_bytes(p.predicted_peak_bytes)}, "
                  f"{len(p.segments)} segments)", flush=True)
    text = "\n".join([
        "# plan() speed on a synthetic chain",
        "",
        f"`python benchmarks/plan_speed.py`: {args.blocks} chained blocks, of varied sizes "
        f"and costs or all identical. Median of {args.repeats} calls of "
        f"`autoremat.plan(tape, budget, \"optimal\")`. Goal: under 1 s.",
        "",
        f"Machine: {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} torch threads, Python {platform.python_version()}, "
        f"torch {torch.__version__}. Shared machine: times are noisy.",
        "",
        "| blocks | budget | unplanned peak | predicted peak | recompute FLOPs "
        "(% of step) | plan() median |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ])
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
