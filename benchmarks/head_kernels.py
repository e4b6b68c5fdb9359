"""The loss head alone: autoremat's chunked head against the fastest peers, forward + backward.

One process, one head shape, every row the same call: hidden states ``h`` (N x C, grad),
the output projection ``W`` (V x C, grad), labels (every 7th ignored), the mean
cross-entropy of ``h @ W.T`` (the logits upcast to float32 where the dtype is 16-bit,
as Hugging Face's causal-LM loss does), then ``backward()``. Rows:

1. ``plain``: ``F.cross_entropy(F.linear(h, W).float(), y)``, what a model computes
   unplanned;
2. ``torch:<policy>:<rows>``: torch's ``F.linear_cross_entropy`` with
   ``LinearCrossEntropyOptions(batch_chunk_size=<rows>, acc_policy=<policy>)``, over
   several chunk sizes (its own ``aspect_ratio`` rule's among them) and every policy,
   where the installed torch has it (2.13 does): the reference is the fastest of them;
3. ``autoremat:chunked:<k>``: ``autoremat.linear_cross_entropy(..., chunks=k)`` at the
   chunk counts a profile measures and a few more;
4. ``liger`` / ``cce``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` and
   cut-cross-entropy's ``linear_cross_entropy`` (gradient filtering off), where
   installed and the device is CUDA.

Each row: the median of interleaved timed rounds (CUDA-synchronised), the peak over
the call (the storage tracker, ``autoremat.track_memory()``, on a CPU; the rise of
``torch.cuda.max_memory_allocated()`` on CUDA), and its loss and gradients against the
plain row's and against float64 (max |x - ref| / max |ref|).

Sizes: ``gpt2`` (the CPU default: HF GPT-2 6 x 256 at batch 4 x 256 with the vocabulary
of 50257, float32), ``gpt2-small`` (GPT-2 small at batch 8 x 1024, bf16) and ``llama``
(the GPU default: Llama 16 x 2048's head at batch 4 x 2048, vocabulary 32000, bf16),
``tiny`` (a smoke run).

Run:        python benchmarks/head_kernels.py                 # CPU, a few minutes
On a GPU:   python benchmarks/head_kernels.py --device cuda
Writes ``benchmarks/results/head_kernels_<device>[_<size>].md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from autoremat._bench.report import device_info, device_slug
from autoremat._core.files import dump_json
from autoremat._core.head import linear_cross_entropy as autoremat_head
from autoremat._measure.memory import track_allocator, track_memory
from autoremat._measure.timing import time_ms

SIZES: dict[str, dict[str, Any]] = {
    "gpt2": {"tokens": 4 * 256, "hidden": 256, "vocab": 50257, "dtype": "fp32"},
    "gpt2-small": {"tokens": 8 * 1024, "hidden": 768, "vocab": 50257, "dtype": "bf16"},
    "llama": {"tokens": 4 * 2048, "hidden": 2048, "vocab": 32000, "dtype": "bf16"},
    "tiny": {"tokens": 256, "hidden": 64, "vocab": 3000, "dtype": "fp32"},
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
OWN_CHUNKS = (2, 4, 8, 16, 32)  # autoremat's own counts timed (a profile measures 4, 32)
TORCH_SPLITS = (2, 4, 8, 16)  # torch's chunk sizes timed: N / these, and its own rule
TIME_SLACK = 1.00  # the target: autoremat's fastest at most the reference's time x this


@dataclasses.dataclass
class Row:
    name: str
    status: str = "ok"
    time_ms: float | None = None
    times_ms: list[float] = dataclasses.field(default_factory=list)
    peak_bytes: int | None = None
    loss_rel_plain: float | None = None
    grad_rel_plain: float | None = None  # max over (h, W) of max |g - plain| / max |plain|
    grad_rel_f64: float | None = None  # the same against float64
    note: str = ""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / scale if scale > 0 else float("inf")


def _candidates(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
                ) -> tuple[dict[str, Callable[[], torch.Tensor]], dict[str, str]]:
    """Every row's call (a function returning the loss), and rows that cannot run, why."""
    upcast = h.dtype in (torch.bfloat16, torch.float16)
    n, c, v = h.shape[0], h.shape[1], w.shape[0]
    calls: dict[str, Callable[[], torch.Tensor]] = {}
    missing: dict[str, str] = {}

    def plain() -> torch.Tensor:
        logits = F.linear(h, w)
        return F.cross_entropy(logits.float() if upcast else logits, y)
    calls["plain"] = plain

    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options is None or not hasattr(F, "linear_cross_entropy"):
        missing["torch"] = f"torch {torch.__version__} has no F.linear_cross_entropy options"
    else:
        rule = options(chunking_method="aspect_ratio")._adjust(n, c, v, h.dtype, h.device)
        sizes = sorted({max(1, n // k) for k in TORCH_SPLITS} | {rule.batch_chunk_size})
        for policy in ("accurate", "balanced", "compact"):
            for rows in sizes:
                opts = options(chunking_method=None, batch_chunk_size=rows, acc_policy=policy)
                calls[f"torch:{policy}:{rows}"] = (
                    lambda opts=opts: F.linear_cross_entropy(h, w, y, options=opts))

    for k in OWN_CHUNKS:
        calls[f"autoremat:chunked:{k}"] = (
            lambda k=k: autoremat_head(h, w, y, chunks=k, upcast=upcast))

    cuda = h.device.type == "cuda"
    try:
        liger = importlib.import_module("liger_kernel.transformers")
    except ImportError:
        missing["liger"] = "liger-kernel is not installed"
    else:
        if cuda:
            loss = liger.LigerFusedLinearCrossEntropyLoss()
            calls["liger"] = lambda: loss(w, h, y)
        else:
            missing["liger"] = "Liger's kernels run on CUDA only"
    try:
        cce = importlib.import_module("cut_cross_entropy")
    except ImportError:
        missing["cce"] = "cut-cross-entropy is not installed"
    else:
        if cuda:
            calls["cce"] = lambda: cce.linear_cross_entropy(h, w, y, filter_eps=None)
        else:
            missing["cce"] = "cut-cross-entropy's kernels run on CUDA only"
    return calls, missing


def _peak(call: Callable[[], torch.Tensor], device: torch.device) -> int:
    if device.type == "cuda":
        with track_allocator(device) as alloc:
            call().backward()
        return int(alloc.peak_bytes or 0)
    with track_memory() as mem:
        call().backward()
    return mem.peak_bytes


def run(args: argparse.Namespace) -> tuple[list[Row], dict[str, Any]]:
    device = torch.device(args.device)
    size = SIZES[args.size]
    dtype = DTYPES[args.dtype or size["dtype"]]
    torch.manual_seed(0)
    n, c, v = size["tokens"], size["hidden"], size["vocab"]
    h = torch.randn(n, c, device=device).to(dtype).requires_grad_()
    w = (torch.randn(v, c, device=device) * 0.02).to(dtype).requires_grad_()
    y = torch.randint(0, v, (n,), device=device)
    y[::7] = -100
    calls, missing = _candidates(h, w, y)
    rows = {name: Row(name) for name in calls}
    rows.update({name: Row(name, status=f"not run: {why}") for name, why in missing.items()})

    h64, w64 = (t.detach().double().requires_grad_() for t in (h, w))
    F.cross_entropy(F.linear(h64, w64), y).backward()
    truth = (h64.grad, w64.grad)
    del h64, w64
    results: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for name, call in calls.items():
        h.grad = w.grad = None
        loss = call()
        loss.backward()
        assert h.grad is not None and w.grad is not None
        results[name] = (loss.detach(), h.grad, w.grad)
    plain = results["plain"]
    for name, (loss, gh, gw) in results.items():
        r = rows[name]
        r.loss_rel_plain = _rel(loss, plain[0])
        r.grad_rel_plain = max(_rel(gh, plain[1]), _rel(gw, plain[2]))
        r.grad_rel_f64 = max(_rel(gh, truth[0]), _rel(gw, truth[1]))
    del results, plain
    for name, call in calls.items():
        h.grad = w.grad = None
        gc.collect()
        rows[name].peak_bytes = _peak(call, device)

    def step(call: Callable[[], torch.Tensor]) -> float:
        h.grad = w.grad = None
        return time_ms(lambda: call().backward(), device)
    for _ in range(args.rounds + 1):  # a warm-up round, then the timed ones
        for name, call in calls.items():
            rows[name].times_ms.append(step(call))
    for name in calls:
        r = rows[name]
        r.times_ms = r.times_ms[1:]
        r.time_ms = statistics.median(r.times_ms)
    facts = {"tokens": n, "hidden": c, "vocab": v, "dtype": str(dtype).replace("torch.", ""),
             "logits_bytes": n * v * torch.finfo(torch.float32).bits // 8}
    return list(rows.values()), facts


def verdicts(rows: Sequence[Row]) -> list[str]:
    """The targets, from the measurements: autoremat's fastest chunked head at most the
    fastest of torch's chunked options (x ``TIME_SLACK``), and no slower than plain."""
    done = [r for r in rows if r.time_ms is not None]
    own = min((r for r in done if r.name.startswith("autoremat")), key=lambda r: r.time_ms or 0,
              default=None)
    ref = min((r for r in done if r.name.startswith("torch:")), key=lambda r: r.time_ms or 0,
              default=None)
    peers = [r for r in done if r.name in ("liger", "cce")]
    plain = next((r for r in done if r.name == "plain"), None)
    lines = []
    if own is None or own.time_ms is None:
        return ["- no autoremat row ran"]
    if ref is not None and ref.time_ms is not None:
        ok = own.time_ms <= TIME_SLACK * ref.time_ms
        lines.append(f"- autoremat's fastest ({own.name}, {own.time_ms:.1f} ms) no slower than "
                     f"torch's fastest chunked option ({ref.name}, {ref.time_ms:.1f} ms): "
                     f"x{own.time_ms / ref.time_ms:.3f}, {'PASS' if ok else 'FAIL'}")
    for peer in peers:
        if peer.time_ms is not None:
            lines.append(f"- against {peer.name} ({peer.time_ms:.1f} ms): "
                         f"x{own.time_ms / peer.time_ms:.3f}")
    if plain is not None and plain.time_ms is not None:
        lines.append(f"- against the plain head ({plain.time_ms:.1f} ms): "
                     f"x{own.time_ms / plain.time_ms:.3f}")
    return lines


def _markdown(rows: Sequence[Row], facts: dict[str, Any], meta: dict[str, Any]) -> str:
    def val(x: float | None, fmt: str) -> str:
        return "" if x is None else format(x, fmt)
    plain = next((r for r in rows if r.name == "plain"), None)
    base = plain.time_ms if plain is not None and plain.time_ms else None
    lines = [f"# The loss head alone ({meta['device_name']})", "",
             f"`{meta['command']}`; torch {meta['torch']}, {meta['date']}, "
             f"{meta['threads']} thread(s); N {facts['tokens']} tokens x C {facts['hidden']} "
             f"-> V {facts['vocab']}, {facts['dtype']}, every 7th label ignored; forward + "
             f"backward of the mean cross-entropy; {meta['rounds']} timed rounds after a "
             f"warm-up, interleaved, medians. Peak: {meta['peak_how']} over the call.", "",
             "| row | status | time ms | x plain | peak MiB | loss vs plain | grads vs plain "
             "| grads vs float64 |", "|" + "---|" * 8]
    for r in sorted(rows, key=lambda r: (r.time_ms is None, r.time_ms or 0.0)):
        ratio = "" if r.time_ms is None or base is None else f"{r.time_ms / base:.3f}"
        peak = "" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:,.1f}"
        lines.append(f"| {r.name} | {r.status} | {val(r.time_ms, '.1f')} | {ratio} | {peak} | "
                     f"{val(r.loss_rel_plain, '.2g')} | {val(r.grad_rel_plain, '.2g')} | "
                     f"{val(r.grad_rel_f64, '.2g')} |")
    lines += ["", "Targets:", "", *verdicts(rows)]
    return "\n".join(lines) + "\n"



def main(argv: Sequence[str] | None = None) -> Path:
    """Run the benchmark; returns the path of the Markdown report."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="default: gpt2 on a CPU, llama on CUDA")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: the size's (fp32 for gpt2 and tiny, else bf16)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    default_size = "llama" if device.type == "cuda" else "gpt2"
    args.size = args.size or default_size
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    rows, facts = run(args)
    info = device_info(device)
    command = "python benchmarks/head_kernels.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if k != "out" and v is not None)
    meta = {"device": str(device), "device_name": info["device_name"],
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command, "rounds": args.rounds,
            "peak_how": ("the rise of torch.cuda.max_memory_allocated()"
                         if device.type == "cuda" else "the storage tracker"),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    stem = f"head_kernels_{device_slug(device)}" + ("" if args.size == default_size
                                              else f"_{args.size}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = out / f"{stem}.md"
    md.write_text(_markdown(rows, facts, meta))
    payload = {"schema_version": 1, **meta, "size": args.size, "facts": facts,
               "targets": verdicts(rows), "rows": [dataclasses.asdict(r) for r in rows]}
    dump_json(payload, out / f"{stem}.json")  # written atomically
    print(md.read_text())
    return md


if __name__ == "__main__":
    main()
