"""What profile's instruments cost per op: the storage tracker, and the FLOP counter or op
recorder it runs each op through (NOTE [ One mode for two instruments ] in memory.py).

For each workload the script times, interleaved over ``--rounds`` rounds (medians):

* ``plain``: the workload with no dispatch mode;
* ``null mode``: under a ``TorchDispatchMode`` that only runs the op (what any Python mode
  costs: torch's own dispatch to Python);
* ``tracker``: under ``track_memory()``;
* ``tracker + FLOPs``: the tracker running each op through a ``FlopCounter`` (the
  checkpointed memory step of a profile);
* ``tracker + recorder``: through an ``OpRecorder`` labelling every op as one block's (the
  plain memory step, whose recorder also records each forward op);

and reports each as microseconds per op over the mode it adds to (:data:`OVER`: a mode
over none, the tracker over a mode, the counter and the recorder over the tracker), per
op counted by a mode that counts them. Workloads: ``small`` (1000 additions on 16 x 16
tensors and their backward: the instruments' cost with little else) and the zoo's models
at their default sizes (one training step each).

Run:        OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/tracker_overhead.py
Quick test: python benchmarks/tracker_overhead.py --rounds 2 --workloads small --out /tmp/to
Writes ``<out>/tracker_overhead_<device>.json`` and ``.md`` (``device_slug``; default out:
``benchmarks/results``). Times are wall clocks on whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autoremat
from autoremat._bench.report import device_info, device_slug
from autoremat._core.step import run_step
from autoremat._measure.flops import FlopCounter
from autoremat._measure.memory import _tracked
from autoremat._measure.ops import OpRecorder

MODES = ("plain", "null mode", "tracker", "tracker + FLOPs", "tracker + recorder")
# each mode's cost is reported over the mode it adds to
OVER = {"null mode": "plain", "tracker": "null mode", "tracker + FLOPs": "tracker",
        "tracker + recorder": "tracker"}


class _Null(TorchDispatchMode):
    """Runs each op, nothing else."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class _Counting(TorchDispatchMode):
    """Counts the ops a workload dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _under(mode: str) -> Iterator[None]:
    """The instruments of ``mode`` entered around a workload."""
    if mode == "plain":
        yield
    elif mode == "null mode":
        with _Null():
            yield
    elif mode == "tracker":
        with _tracked(None):
            yield
    else:
        counter = FlopCounter() if mode == "tracker + FLOPs" else OpRecorder()
        counter.label = "block"  # the recorder records the ops of a labelled block
        with _tracked(None, counter):
            yield


def _small_ops() -> Callable[[], None]:
    x = torch.randn(16, 16)
    w = torch.randn(16, 16, requires_grad=True)

    def run() -> None:
        y = x
        for _ in range(1000):
            y = torch.add(y, w)
        y.sum().backward()
        w.grad = None

    return run


def _zoo(name: str) -> Callable[[], None]:
    torch.manual_seed(0)
    model, inputs = autoremat.zoo.build(name)

    def run() -> None:
        run_step(model, inputs, None)
        for p in model.parameters():
            p.grad = None

    return run


def measure(name: str, run: Callable[[], None], rounds: int) -> dict[str, Any]:
    """One workload: its op count, and per mode the median seconds over ``rounds``
    interleaved rounds and the microseconds per op over the mode it adds to (``OVER``)."""
    counting = _Counting()
    with counting:
        run()
    for mode in MODES:  # a warm-up of each
        with _under(mode):
            run()
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            start = time.perf_counter()
            with _under(mode):
                run()
            seconds[mode].append(time.perf_counter() - start)
    medians = {mode: statistics.median(s) for mode, s in seconds.items()}
    over = {mode: (medians[mode] - medians[base]) / counting.ops * 1e6
            for mode, base in OVER.items()}
    return {"workload": name, "ops": counting.ops, "seconds": medians, "us_per_op": over}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--workloads", default="small,gpt2,llama",
                        help="comma-separated: small, and zoo model names")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w != "small" and w not in autoremat.zoo.names()]
    if not names or unknown:
        parser.error(f"--workloads: small or zoo models {autoremat.zoo.names()}, got "
                     f"{args.workloads!r}")
    rows = []
    for name in names:
        rows.append(measure(name, _small_ops() if name == "small" else _zoo(name),
                            args.rounds))
        print(f"  {name}: " + ", ".join(f"{m} +{v:.2f} us/op"
                                        for m, v in rows[-1]["us_per_op"].items()))
    info = str(device_info("cpu")["device_name"])
    payload = {"device": info, "torch": torch.__version__, "threads": torch.get_num_threads(),
               "python": platform.python_version(), "rounds": args.rounds,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"tracker_overhead_{device_slug('cpu')}"
    (args.out / f"{stem}.json").write_text(json.dumps(payload, indent=1) + "\n")
    lines = [f"# What profile's instruments cost per op ({info})", "",
             f"`python benchmarks/tracker_overhead.py --rounds {args.rounds} --workloads "
             f"{args.workloads}`; torch {torch.__version__}, {payload['threads']} thread(s), "
             f"{payload['date']}.", "",
             "Microseconds per op (medians of interleaved rounds; the ops counted by a mode "
             "that counts them): a mode that only runs each op over none, the tracker over "
             "that mode, the FLOP counter and the op recorder each over the tracker.", "",
             "| workload | ops | plain ms | null mode | tracker | + FLOPs | + recorder |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        over = r["us_per_op"]
        lines.append(f"| {r['workload']} | {r['ops']} | {r['seconds']['plain'] * 1e3:.1f} | "
                     + " | ".join(f"+{over[m]:.2f}" for m in MODES[1:]) + " |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / stem}.md and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
