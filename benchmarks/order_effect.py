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

import statistics

from selective_overhead import issue_plans, profiled_zoo_model, step_ms  # this folder: sys.path

import autoremat

# short names -> issue_plans' labels
_LABELS = {"none": "none", "full": "full (per block)", "Megatron": "selective (Megatron)",
           "optimal": "optimal @ budget"}
PATTERNS = {
    "none, optimal": ["none", "optimal"],
    "none, full, Megatron, optimal": ["none", "full", "Megatron", "optimal"],
    "none, full, optimal": ["none", "full", "optimal"],
}


def main() -> None:
    args, model, inputs, tape = profiled_zoo_model(__doc__, "gpt2-small", 6)
    plans = issue_plans(tape)[1]
    times: dict[str, dict[str, list[float]]] = {p: {} for p in PATTERNS}
    for r in range(args.rounds + 1):  # the first round warms up
        for pattern, order in PATTERNS.items():
            for label in order:
                autoremat.apply(model, plans[_LABELS[label]])
                elapsed = step_ms(model, inputs)
                autoremat.remove(model)
                if r:
                    times[pattern].setdefault(label, []).append(elapsed)
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
