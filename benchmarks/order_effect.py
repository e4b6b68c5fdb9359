"""Does a step's time depend on the plan that ran before it? One process, three orders.

For a zoo model at the budget of ``selective_overhead.py``, time the ``optimal`` plan
against no checkpointing in rounds of three patterns, interleaved in one process:
``none, optimal``; ``none, full, Megatron, optimal`` (the fixed order of that
benchmark's runs A-D); and ``none, full, optimal``. If the ratios differ by more than the
noise, the plan run before a step changes its time, and a benchmark with a fixed order
charges that to some plans (``selective_overhead.py`` rotates the order instead).

Run:  python benchmarks/order_effect.py [--model gpt2] [--size gpt2-small] [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics

from selective_overhead import SIZES, _step_ms  # this script's folder is on sys.path

import autoremat

PATTERNS = {
    "none, optimal": ["none", "optimal"],
    "none, full, Megatron, optimal": ["none", "full", "Megatron", "optimal"],
    "none, full, optimal": ["none", "full", "optimal"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--size", default="gpt2-small", help=f"from {sorted(SIZES)}")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    model, inputs = autoremat.zoo.build(args.model, **SIZES[args.size][args.model])
    tape = autoremat.profile(model, inputs)
    budget = tape.step_peak_bytes - (2 * tape.block_saved_bytes) // 3
    plans = {"none": autoremat.plan(tape, strategy="none"),
             "full": autoremat.plan(tape, strategy="full"),
             "Megatron": autoremat.plan(tape, strategy="selective"),
             "optimal": autoremat.plan(tape, budget)}
    times: dict[str, dict[str, list[float]]] = {p: {} for p in PATTERNS}
    for r in range(args.rounds + 1):  # the first round warms up
        for pattern, order in PATTERNS.items():
            for label in order:
                autoremat.apply(model, plans[label])
                t = _step_ms(model, inputs)
                autoremat.remove(model)
                if r:
                    times[pattern].setdefault(label, []).append(t)
    print(f"{args.model}, size {args.size}: medians of {args.rounds} rounds per pattern\n")
    print("| order of each round | optimal vs none | ratio per round | full vs none |")
    print("|---|---|---|---|")
    for pattern, t in times.items():
        base = statistics.median(t["none"])
        per_round = statistics.median(o / n for o, n in zip(t["optimal"], t["none"], strict=True))
        full = f"x{statistics.median(t['full']) / base:.3f}" if "full" in t else "-"
        print(f"| {pattern} | x{statistics.median(t['optimal']) / base:.3f} | "
              f"x{per_round:.3f} | {full} |")


if __name__ == "__main__":
    main()
