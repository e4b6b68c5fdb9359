"""Where the CUDA caching allocator's step peak and the storage tracker's part, op by op.

For each model and dtype (``gpu_exact.py``'s builders and sizes) and for the plain step
and full recompute, one warmed-up step is measured three ways:

* ``allocator``: the rise of ``torch.cuda.max_memory_allocated()`` (the truth);
* ``tracked``: the storage tracker as ``profile`` runs it, which on CUDA reads the
  allocator's peak inside each op (NOTE [ Memory a kernel allocates inside an op ] in
  ``src/autoremat/_measure/memory.py``);
* ``storages only``: the tracker without that probe (what it counted before).

and once more op by op: around every op the allocator's peak is reset, and after it

* ``inside`` = peak in the op - level at its end: memory the kernel held and freed;
* ``slack`` = the level's rise - the blocks of the storages the op made (512-byte
  rounding): bytes the allocator handed out beyond the tracker's count (a large block
  not split, a workspace made once).

The ops with the most of each are listed. Results: ``allocator_gap_<device>.md`` and
``.json`` in ``--out``.

Run (on a GPU):  PYTHONPATH=src python benchmarks/allocator_gap.py --out /tmp/gap
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))

import gpu_exact

import autoremat
from autoremat._bench.report import device_info
from autoremat._core.step import flat_tensors, preserved_state, run_step
from autoremat._measure import memory
from autoremat._measure.memory import cuda_block_bytes, track_allocator, track_memory


@dataclasses.dataclass
class OpFigures:
    calls: int = 0
    inside_max: int = 0
    inside_sum: int = 0
    slack_max: int = 0
    slack_sum: int = 0


class _PerOp(TorchDispatchMode):
    """The allocator around every op (see the module docstring)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.ops: dict[str, OpFigures] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in flat_tensors((args, kwargs))}
        torch.cuda.reset_peak_memory_stats(self.index)
        before = torch.cuda.memory_allocated(self.index)
        out = func(*args, **kwargs)
        stats = torch.cuda.memory_stats_as_nested_dict(self.index)["allocated_bytes"]["all"]
        after, peak = int(stats["current"]), int(stats["peak"])
        made = {}
        for t in flat_tensors(out):
            storage = t.untyped_storage()
            if storage.data_ptr() not in inputs and storage.nbytes() and t.is_cuda:
                made[storage.data_ptr()] = cuda_block_bytes(storage.nbytes())
        phase = "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"
        figures = self.ops.setdefault(f"{func} ({phase})", OpFigures())
        inside, slack = max(0, peak - after), (after - before) - sum(made.values())
        figures.calls += 1
        figures.inside_max = max(figures.inside_max, inside)
        figures.inside_sum += inside
        figures.slack_max = max(figures.slack_max, slack)
        figures.slack_sum += slack
        return out


@contextmanager
def _no_probe() -> Iterator[None]:
    saved = memory.allocator_probe
    memory.allocator_probe = lambda: None  # type: ignore[assignment]
    try:
        yield
    finally:
        memory.allocator_probe = saved  # type: ignore[assignment]


def _measure(model: torch.nn.Module, inputs: Any, index: int) -> dict[str, Any]:
    with preserved_state(model):
        run_step(model, inputs, None)  # warm-up: one-time workspaces
    with preserved_state(model), track_allocator(f"cuda:{index}") as alloc:
        run_step(model, inputs, None)
    with preserved_state(model), track_memory() as tracked:
        run_step(model, inputs, None)
    with _no_probe(), preserved_state(model), track_memory() as plain:
        run_step(model, inputs, None)
    per_op = _PerOp(index)
    with preserved_state(model), per_op:
        run_step(model, inputs, None)
    ops = per_op.ops
    inside = sorted(ops.items(), key=lambda kv: -kv[1].inside_max)[:8]
    slack = sorted(ops.items(), key=lambda kv: -kv[1].slack_sum)[:8]
    return {"allocator": alloc.peak_bytes, "tracked": tracked.peak_bytes,
            "storages_only": plain.peak_bytes,
            "transients": sum(r.transient for r in tracked.records),
            "inside_sum": sum(f.inside_sum for f in ops.values()),
            "slack_sum": sum(f.slack_sum for f in ops.values()),
            "top_inside": [(k, dataclasses.asdict(v)) for k, v in inside if v.inside_max],
            "top_slack": [(k, dataclasses.asdict(v)) for k, v in slack if v.slack_sum]}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--models", default="zoo-gpt2,zoo-llama,hf-llama")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--size", choices=sorted(gpu_exact.SIZES), default="gpu")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rows = []
    for name in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            model, inputs = gpu_exact.MODELS[name](gpu_exact.SIZES[args.size], device,
                                                   dtypes[dtype_name])
            tape = autoremat.profile(model, inputs, repeats=1, timing=False)
            for spec in ("none", "full"):
                plan = autoremat.plan(tape, None, spec)
                autoremat.apply(model, plan)
                try:
                    row = _measure(model, inputs, device.index)
                finally:
                    autoremat.remove(model)
                row.update(model=name, dtype=dtype_name, plan=spec,
                           predicted=plan.predicted_peak_bytes)
                rows.append(row)
                print(f"{name} {dtype_name} {spec}: allocator {row['allocator']:,} predicted "
                      f"{row['predicted']:,} tracked {row['tracked']:,} storages only "
                      f"{row['storages_only']:,}", flush=True)
            del model, inputs, tape
    device_name = device_info(device)["device_name"]
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# The allocator against the tracker, op by op ({device_name})", "",
             f"torch {torch.__version__}; `python benchmarks/allocator_gap.py --models "
             f"{args.models} --dtypes {args.dtypes} --size {args.size}`", "",
             "| model | dtype | plan | allocator | predicted | tracked | storages only | "
             "pred. error | inside (sum) | slack (sum) |", "|---" * 10 + "|"]
    for r in rows:
        error = (r["predicted"] - r["allocator"]) / r["allocator"]
        lines.append(f"| {r['model']} | {r['dtype']} | {r['plan']} | {r['allocator']:,} | "
                     f"{r['predicted']:,} | {r['tracked']:,} | {r['storages_only']:,} | "
                     f"{100 * error:+.3f}% | {r['inside_sum']:,} | {r['slack_sum']:,} |")
    for r in rows:
        lines += ["", f"## {r['model']} {r['dtype']} {r['plan']}", "", "Most inside an op:"]
        lines += [f"- {k}: max {v['inside_max']:,} over {v['calls']} calls"
                  for k, v in r["top_inside"]]
        lines += ["", "Most slack:"]
        lines += [f"- {k}: {v['slack_sum']:,} in all, max {v['slack_max']:,}, "
                  f"{v['calls']} calls" for k, v in r["top_slack"]]
    (out / f"allocator_gap_{slug}.md").write_text("\n".join(lines) + "\n")
    (out / f"allocator_gap_{slug}.json").write_text(json.dumps(
        {"device": device_name, "torch": torch.__version__, "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
