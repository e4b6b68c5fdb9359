"""Issue 4's benchmark: selective recompute at "one third of the blocks' activations".

For the GPT-2-style and Llama-style zoo models (dropout on) the budget is
``unplanned step peak - 2/3 x the blocks' saved bytes``. We plan ``optimal`` at that
budget, apply it, and measure, in one process with interleaved runs: the step peak
(track_memory), the step time against no checkpointing, and the same for per-block full
checkpointing as the reference. Times are interleaved: each round runs every plan once,
in an order rotated from round to round; we report the ratio of median step times and
the median of per-round ratios (each plan against the same round's no-checkpointing step).

Three sizes per model: the zoo defaults (n_embd=128, seq 128: blocks of a few ms, where
per-op dispatch overhead dominates), "medium" (12 layers, n_embd=512, seq 512, batch 2:
blocks of ~100 ms) and "gpt2-small" (GPT-2 small's 12 layers of width 768 with 12 heads,
seq 512, batch 2: blocks of ~200 ms).

Run:  python benchmarks/selective_overhead.py [--repeats 7] [--sizes default,medium,gpt2-small]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

import autoremat
from autoremat._core.step import preserved_state, run_step
from autoremat._core.units import format_bytes
from autoremat._measure.memory import track_memory


def step_ms(model: torch.nn.Module, inputs: object) -> float:
    """One training step's wall time in ms; the model's state is restored after it."""
    with preserved_state(model):
        start = time.perf_counter()
        run_step(model, inputs, None)
        return (time.perf_counter() - start) * 1e3


def _peak(model: torch.nn.Module, inputs: object) -> int:
    with preserved_state(model), track_memory() as mem:
        run_step(model, inputs, None)
    return mem.peak_bytes


SIZES: dict[str, dict[str, dict[str, int]]] = {
    "default": {"gpt2": {}, "llama": {}},
    "medium": {
        "gpt2": {"n_layer": 12, "n_embd": 512, "n_head": 8, "seq_len": 512, "batch_size": 2},
        "llama": {"n_layer": 12, "n_embd": 512, "n_head": 8, "n_kv_head": 4,
                  "ffn_hidden": 1368, "seq_len": 512, "batch_size": 2},
    },
    # GPT-2 small's shape (12 layers, n_embd 768, 12 heads of 64) at seq 512
    "gpt2-small": {
        "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12, "seq_len": 512, "batch_size": 2},
        "llama": {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_kv_head": 4,
                  "ffn_hidden": 2048, "seq_len": 512, "batch_size": 2},
    },
}


def profiled_zoo_model(doc: str, size: str, rounds: int) -> tuple[
        argparse.Namespace, torch.nn.Module, object, autoremat.Tape]:
    """Parse ``--model``/``--size``/``--rounds`` (defaults ``gpt2``, ``size``, ``rounds``),
    build that zoo model at that size and profile it: the setup of the other scripts here."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--size", default=size, help=f"from {sorted(SIZES)}")
    parser.add_argument("--rounds", type=int, default=rounds)
    args = parser.parse_args()
    model, inputs = autoremat.zoo.build(args.model, **SIZES[args.size][args.model])
    return args, model, inputs, autoremat.profile(model, inputs)


def issue_plans(tape: autoremat.Tape) -> tuple[int, dict[str, autoremat.Plan]]:
    """Issue 4's budget for ``tape`` and the plans compared at it, by label."""
    budget = tape.step_peak_bytes - (2 * tape.block_saved_bytes) // 3
    return budget, {
        "none": autoremat.plan(tape, strategy="none"),
        "full (per block)": autoremat.plan(tape, strategy="full"),
        "selective (Megatron)": autoremat.plan(tape, strategy="selective"),
        "optimal @ budget": autoremat.plan(tape, budget),
    }


def bench(name: str, repeats: int, sizes: dict[str, int], fixed_order: bool = False) -> list[str]:
    model, inputs = autoremat.zoo.build(name, **sizes)
    tape = autoremat.profile(model, inputs)
    budget, plans = issue_plans(tape)
    peaks, times = {}, {k: [] for k in plans}
    for label, p in plans.items():
        autoremat.apply(model, p)
        peaks[label] = _peak(model, inputs)
        autoremat.remove(model)
    labels = list(plans)
    for r in range(repeats + 1):  # the first round warms up
        # Rotate the order each round so every plan follows every other equally often: a
        # step's time depends on the plan run before it (benchmarks/order_effect.py).
        shift = 0 if fixed_order else r % len(labels)
        for label in labels[shift:] + labels[:shift]:
            autoremat.apply(model, plans[label])
            t = step_ms(model, inputs)
            autoremat.remove(model)
            if r:
                times[label].append(t)
    base = statistics.median(times["none"])
    # Per round, each plan's time over the same round's no-checkpointing time: slow drift
    # of the machine's speed (a shared VM) cancels in the ratio.
    ratios = {k: statistics.median(t / n for t, n in zip(v, times["none"], strict=True))
              for k, v in times.items()}
    size_text = ", ".join(f"{k}={v}" for k, v in sizes.items()) or "defaults"
    lines = [f"### {name} ({size_text}): budget {format_bytes(budget)} "
             f"(peak {format_bytes(tape.step_peak_bytes)} - 2/3 x blocks' saved "
             f"{format_bytes(tape.block_saved_bytes)})", "",
             "| plan | decisions | predicted peak | measured peak | fits | recompute FLOPs | "
             "median step | time vs none | ratio per round | spread |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, p in plans.items():
        med = statistics.median(times[label])
        spread = (max(times[label]) - min(times[label])) / med
        decisions = "".join("p" if b.op_signature else b.decision[0] for b in p.blocks)
        lines.append(f"| {label} | `{decisions}` | {format_bytes(p.predicted_peak_bytes)} | "
                     f"{format_bytes(peaks[label])} | "
                     f"{'yes' if peaks[label] <= budget else 'no'} | "
                     f"{100 * p.recompute_overhead:.1f}% | {med:.1f} ms | "
                     f"x{med / base:.3f} | x{ratios[label]:.3f} | {100 * spread:.0f}% |")
    lines.append("")
    lines.append("decisions: k = keep, r = recompute, s = selective with a save-set of op "
                 "kinds, p = selective with a keep-set of ops (one letter per block)")
    lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--sizes", default="default,medium", help=f"from {sorted(SIZES)}")
    parser.add_argument("--set", default="", help="extra zoo size options, e.g. n_embd=256")
    parser.add_argument("--out", default="benchmarks/selective_overhead.md")
    parser.add_argument("--fixed-order", action="store_true",
                        help="run the plans in the same order every round (runs A-D did)")
    args = parser.parse_args()
    lines = ["# Selective recompute at one third of the blocks' activations", "",
             f"Command: `python benchmarks/selective_overhead.py --repeats {args.repeats} "
             f"--sizes {args.sizes}" + (f" --set {args.set}" if args.set else "")
             + (" --fixed-order" if args.fixed_order else "") + "`  ",
             f"Machine: {platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} threads, torch {torch.__version__}", ""]
    extra = {k: int(v) for k, v in (item.split("=") for item in args.set.split(",") if item)}
    for size in args.sizes.split(","):
        for name in args.models.split(","):
            lines += bench(name, args.repeats, {**SIZES[size][name], **extra},
                           args.fixed_order)
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
