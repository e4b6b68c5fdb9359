"""What each selective option costs: one option on every block, timed in one process.

For a zoo model, profile it, then build one plan per option the tape measured for its
blocks (save-sets of op kinds and keep-sets by position) with that option on every
block, plus no checkpointing and whole-block checkpointing. Time them in interleaved
rounds (medians) and print, per option, what a block holds from forward to backward, the
extra time per block over no checkpointing, and the planner's cost (costs.py), as a
Markdown table.

Run:  python benchmarks/selective_options.py [--model gpt2] [--size medium] [--rounds 4]
"""

from __future__ import annotations

import statistics

from selective_overhead import profiled_zoo_model, step_ms  # this folder is on sys.path

import autoremat
from autoremat import Choice, Decision
from autoremat._core.decisions import KEEP, RECOMPUTE
from autoremat._core.units import format_bytes
from autoremat._plan.peak import segment_cost
from autoremat._plan.plan import plan_of_segments


def main() -> None:
    args, model, inputs, tape = profiled_zoo_model(__doc__, "medium", 4)
    n, probe = len(tape.blocks), tape.blocks[1 if len(tape.blocks) > 1 else 0]
    plans = {"none": autoremat.plan(tape, strategy="none"),
             "full": autoremat.plan(tape, strategy="full")}
    for key in sorted(probe.selective):
        option = Choice.selective_from_key(key)
        plans[key or "(empty)"] = plan_of_segments(
            tape, [(i, i + 1, option) for i in range(n)], f"selective:{key}")
    times: dict[str, list[float]] = {k: [] for k in plans}
    for r in range(args.rounds + 1):  # round-robin; the first round warms up
        for label, p in plans.items():
            autoremat.apply(model, p)
            elapsed = step_ms(model, inputs)
            autoremat.remove(model)
            if r:
                times[label].append(elapsed)
    base = statistics.median(times["none"])
    print(f"{args.model}, size {args.size}: a plain block keeps "
          f"{format_bytes(probe.saved_bytes)}; medians of {args.rounds} interleaved rounds\n")
    print("| option | held per block | extra time per block | planner's cost (G FLOP-eq) |")
    print("|---|---|---|---|")
    for label, samples in times.items():
        extra = (statistics.median(samples) - base) / n
        if label in ("none", "full"):
            option = KEEP if label == "none" else RECOMPUTE
            held = "-"
        else:
            key = "" if label == "(empty)" else label
            option = Choice.selective_from_key(key)
            held = format_bytes(probe.selective[key].fwd.delta_bytes)
        cost = segment_cost(tape, 1, 2, option, Decision.RECOMPUTE).rank_cost if n > 2 else 0
        print(f"| {label} | {held} | {extra:.1f} ms | {cost / 1e9:.2f} |")


if __name__ == "__main__":
    main()
