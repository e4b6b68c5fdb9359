"""Offload to host memory against per-block checkpointing and save_on_cpu (issue 17).

One process, one HF Llama, seven rows, each measured by its step peak (on CUDA the rise
of ``torch.cuda.max_memory_allocated()`` over one step; elsewhere the storage tracker)
and its step time (median of interleaved rounds, CUDA-synchronised; ratio to plain):

1. ``plain``: no checkpointing;
2. ``hf-per-block``: ``gradient_checkpointing_enable(use_reentrant=False)``;
3. ``hf-per-block+save_on_cpu``: the same inside
   ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (synchronous copies; on a CPU
   without ``pin_memory``, where it keeps the tensors themselves: no separate host);
4. ``autoremat@save_on_cpu-peak``: ``plan(tape, budget=<row 3's peak>, offload=True)``;
5. ``autoremat-recompute@50%``: ``plan(tape, "50%")``;
6. ``autoremat-offload@50%``: ``plan(tape, "50%", offload=True)``;
7. ``autoremat-strategy-offload``: ``plan(tape, None, "offload")`` (every block).

Every row's gradients are compared with the plain step's (``torch.equal``), both steps
under ``torch.use_deterministic_algorithms(True)`` from the same RNG state, dropout on.
For the autoremat row with the lowest measured peak the report says where that peak
sits (the storage tracker's breakdown at its peak, the held output, the gradients).

Run (on a GPU):  python benchmarks/offload.py --device cuda
Smoke run here:  python benchmarks/offload.py --device cpu --size tiny [--simulate-host]
Writes ``benchmarks/results/offload_<device>.md`` and ``.json`` (``_tiny`` added for the
tiny size); the device is named in both. ``--simulate-host`` runs the CPU steps under
``simulated_host()`` (host copies the tracker does not count): its figures are simulated.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA initialises

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autoremat
from autoremat import Decision
from autoremat._bench.refs import hf_toggle
from autoremat._bench.report import device_info, device_slug
from autoremat._core.errors import RematError
from autoremat._core.step import preserved_state, run_step
from autoremat._measure.memory import MemoryTracker, track_allocator, track_memory
from autoremat._measure.timing import time_ms
from autoremat._mechanism.offload import simulated_host

ROWS = ("plain", "hf-per-block", "hf-per-block+save_on_cpu", "autoremat@save_on_cpu-peak",
        "autoremat-recompute@50%", "autoremat-offload@50%", "autoremat-strategy-offload")
TIME_SLACK = 1.05  # the issue's: at row 3's peak, no more than per-block's time +5%

# The model (Llama 16 x 2048, vocab 32000, seq 2048, batch 4, bf16) and a tiny
# one for the CPU smoke run.
SIZES: dict[str, dict[str, int]] = {
    "gpu": {"layers": 16, "hidden": 2048, "intermediate": 5504, "heads": 16,
            "vocab": 32000, "seq": 2048, "batch": 4},
    "tiny": {"layers": 4, "hidden": 64, "intermediate": 176, "heads": 4,
             "vocab": 256, "seq": 64, "batch": 2},
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build(size: dict[str, int], device: torch.device, dtype: torch.dtype,
          attention: str = "sdpa") -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The Llama of ``size`` (attention dropout 0.1, in training mode) and one batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=size["hidden"], intermediate_size=size["intermediate"],
                         num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                         num_key_value_heads=size["heads"], vocab_size=size["vocab"],
                         max_position_embeddings=size["seq"], attention_dropout=0.1,
                         use_cache=False)
    config._attn_implementation = attention
    # transformers' typing of .to confuses mypy (as in gpu_exact.py)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).train()  # type: ignore[call-arg]
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), device=device)
    return model, {"input_ids": ids, "labels": ids.clone()}


@dataclasses.dataclass
class Variant:
    """How one row runs: what to install on the model, and a context for the step."""

    name: str
    install: Callable[[], object]
    uninstall: Callable[[], object]
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    plan: autoremat.Plan | None = None


@dataclasses.dataclass
class Row:
    name: str
    status: str  # "ok", "FAILED: ...", "infeasible: ..." or "refused: ..."
    note: str = ""
    measured_peak_bytes: int | None = None
    time_ms: float | None = None  # median of the timed rounds
    time_ratio: float | None = None  # over the plain step's median
    times_ms: list[float] = dataclasses.field(default_factory=list)
    grads_equal: bool | None = None
    max_grad_diff: float | None = None
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    fits: bool | None = None  # measured <= budget
    host_bytes: int | None = None  # plan.predicted_host_bytes
    offloaded: int | None = None  # blocks with decision "offload"
    offload_input: int | None = None  # checkpointed blocks whose input waits on the host
    recomputed: int | None = None  # blocks that recompute anything (offload_input included)
    plan: str = ""


def _nothing() -> None:
    return None


def _plan_variant(name: str, model: nn.Module, plan: autoremat.Plan) -> Variant:
    return Variant(name, lambda: autoremat.apply(model, plan),
                   lambda: autoremat.remove(model), plan=plan)


def _step(model: nn.Module, inputs: Any, variant: Variant, seed: int,
          body: Callable[[], object]) -> Any:
    """``body`` (a step) with ``variant`` installed, from RNG seed ``seed``, leaving the
    model's gradients, buffers and RNG as they were."""
    with preserved_state(model):
        torch.manual_seed(seed)
        variant.install()
        try:
            with variant.context():
                return body()
        finally:
            variant.uninstall()


def measure_peak(model: nn.Module, inputs: Any, variant: Variant, device: torch.device,
                 seed: int) -> tuple[int, MemoryTracker]:
    """The step peak (allocator on CUDA, tracker elsewhere) and the tracker's view."""
    def body() -> tuple[int, MemoryTracker]:
        with track_allocator(device) as alloc, track_memory() as mem:
            run_step(model, inputs, None)
        return (alloc.peak_bytes if alloc.peak_bytes is not None else mem.peak_bytes), mem
    result: tuple[int, MemoryTracker] = _step(model, inputs, variant, seed, body)
    return result


def step_grads(model: nn.Module, inputs: Any, variant: Variant,
               seed: int) -> dict[str, torch.Tensor | None]:
    """The gradients of one step under ``torch.use_deterministic_algorithms(True)``."""
    def body() -> dict[str, torch.Tensor | None]:
        run_step(model, inputs, None)
        return {n: None if p.grad is None else p.grad.detach().clone()
                for n, p in model.named_parameters()}
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        grads: dict[str, torch.Tensor | None] = _step(model, inputs, variant, seed, body)
        return grads
    finally:
        torch.use_deterministic_algorithms(before)


def compare(mine: dict[str, torch.Tensor | None],
            ref: dict[str, torch.Tensor | None]) -> tuple[bool, float]:
    """(every gradient ``torch.equal``, the largest absolute difference)."""
    equal, worst = True, 0.0
    for name, g in ref.items():
        other = mine[name]
        if g is None or other is None:
            equal = equal and g is None and other is None
            continue
        if not torch.equal(g, other):
            equal = False
            worst = max(worst, float((g.float() - other.float()).abs().max()))
    return equal, worst


def _save_on_cpu(pin: bool) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    return lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)


def _counts(plan: autoremat.Plan) -> tuple[int, int, int]:
    offloaded = sum(b.decision is Decision.OFFLOAD for b in plan.blocks)
    inputs = sum(b.decision is Decision.OFFLOAD_INPUT for b in plan.blocks)
    return offloaded, inputs, plan.recompute_blocks


def _head_key(plan: autoremat.Plan) -> Decision:
    """The tape's key for the loss head's window: what the last block is seen as."""
    return plan.blocks[-1].decision.seen_as


def where_peak_sits(row: Row, mem: MemoryTracker, tape: autoremat.Tape,
                    plan: autoremat.Plan) -> list[str]:
    """Lines on what is live at the peak of ``row``'s step (the tracker's view)."""
    def mib(n: int) -> str:
        return f"{n / 2**20:,.1f} MiB"
    bd = mem.breakdown
    in_backward = any(r.backward for r in mem.live_at(mem.peak_event))
    post = tape.post.get(_head_key(plan)) or tape.post[Decision.KEEP]
    held = max(tape.output_bytes, 0)
    rest = bd["activations"] - held
    return [
        f"Where the remaining peak sits, for `{row.name}` (measured "
        f"{mib(row.measured_peak_bytes or 0)}; the storage tracker's own peak "
        f"{mib(mem.peak_bytes)}, reached in {'backward' if in_backward else 'forward'} "
        f"at op `{mem.ops[mem.peak_event]}`):",
        "",
        f"- gradients already written: {mib(bd['gradients'])} (all of them at the end: "
        f"{mib(tape.grad_bytes)});",
        f"- created in forward and still alive: {mib(bd['activations'])}, of which the "
        f"model's output held through backward (logits, `tape.output_bytes`) "
        f"{mib(held)} and the rest ({mib(rest)}) block boundaries, checkpoint inputs and "
        f"what kept blocks save;",
        f"- backward temporaries (incoming gradients, recomputed or fetched tensors, "
        f"scratch): {mib(bd['temporaries'])};",
        f"- the loss head's own window (head and loss forward and backward, "
        f"`tape.post`): up to {mib(post.peak_bytes)} above its start.",
    ]


def run(args: argparse.Namespace) -> tuple[list[Row], list[str], dict[str, Any]]:
    device = torch.device(args.device)
    size = SIZES[args.size]
    model, inputs = build(size, device, DTYPES[args.dtype], args.attention)
    seed = 1234
    on_cuda = device.type == "cuda"
    start = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {text}", flush=True)

    hf = hf_toggle(model)
    if hf is None:
        raise RematError("transformers' model has no gradient_checkpointing_enable")
    variants: dict[str, Variant] = {
        "plain": Variant("plain", _nothing, _nothing),
        "hf-per-block": Variant("hf-per-block", *hf),
        "hf-per-block+save_on_cpu": Variant("hf-per-block+save_on_cpu", *hf,
                                            context=_save_on_cpu(on_cuda)),
    }
    rows: dict[str, Row] = {name: Row(name, "ok") for name in ROWS}
    if not on_cuda:
        rows["hf-per-block+save_on_cpu"].note = (
            "no separate host: save_on_cpu(pin_memory=False), which keeps the CPU tensors "
            "themselves (nothing copied, nothing freed)")

    # Reference peaks first: row 3's peak is row 4's budget.
    peaks: dict[str, tuple[int, MemoryTracker]] = {}
    for name in list(variants):
        _step(model, inputs, variants[name], seed, lambda: run_step(model, inputs, None))
        peaks[name] = measure_peak(model, inputs, variants[name], device, seed)
    log("reference peaks " + ", ".join(f"{k} {v[0]:,}" for k, v in peaks.items()))

    tape = autoremat.profile(model, inputs, offload=True, repeats=args.profile_repeats)
    log(f"profiled: host bandwidth {tape.host_bandwidth:.3g} B/s, plain peak "
        f"{tape.step_peak_bytes:,}")
    budget = peaks["hf-per-block+save_on_cpu"][0]
    specs: dict[str, Callable[[], autoremat.Plan]] = {
        "autoremat@save_on_cpu-peak": lambda: autoremat.plan(tape, budget, offload=True),
        "autoremat-recompute@50%": lambda: autoremat.plan(tape, "50%"),
        "autoremat-offload@50%": lambda: autoremat.plan(tape, "50%", offload=True),
        "autoremat-strategy-offload": lambda: autoremat.plan(tape, None, "offload"),
    }
    for name, make in specs.items():
        try:
            plan = make()
        except RematError as exc:
            kind = "infeasible" if isinstance(exc, autoremat.BudgetError) else "refused"
            rows[name].status = f"{kind}: {str(exc).splitlines()[0][:300]}"
            continue
        variants[name] = _plan_variant(name, model, plan)
        r = rows[name]
        r.budget_bytes, r.predicted_peak_bytes = plan.budget_bytes, plan.predicted_peak_bytes
        r.host_bytes = plan.predicted_host_bytes
        r.offloaded, r.offload_input, r.recomputed = _counts(plan)
        r.plan = ", ".join(f"{b.name}:{b.decision}" for b in plan.blocks)
        r.note = "; ".join(plan.notes)[:300]
        _step(model, inputs, variants[name], seed, lambda: run_step(model, inputs, None))
        peaks[name] = measure_peak(model, inputs, variants[name], device, seed)
    log("autoremat peaks " + ", ".join(f"{k} {peaks[k][0]:,}" for k in specs if k in peaks))

    # Times: a warm-up round, then ``rounds`` interleaved rounds, one step per row each.
    for _ in range(args.rounds + 1):
        for name, variant in variants.items():
            rows[name].times_ms.append(_step(
                model, inputs, variant, seed,
                lambda: time_ms(lambda: run_step(model, inputs, None), device)))
    plain_ms = statistics.median(rows["plain"].times_ms[1:])
    for name in variants:
        r = rows[name]
        r.times_ms = r.times_ms[1:]
        r.time_ms = statistics.median(r.times_ms)
        r.time_ratio = r.time_ms / plain_ms
    log("timed " + ", ".join(f"{k} x{rows[k].time_ratio:.2f}" for k in variants))

    # Gradients against the plain step's, deterministic algorithms, same seed.
    try:
        ref: dict[str, torch.Tensor | None] | None = step_grads(
            model, inputs, variants["plain"], seed)
    except RuntimeError as exc:  # e.g. an attention kernel with no deterministic backward
        ref, why = None, str(exc).splitlines()[0][:200]
    for name, variant in variants.items():
        r = rows[name]
        r.measured_peak_bytes = peaks[name][0]
        if r.budget_bytes is not None:
            r.fits = r.measured_peak_bytes <= r.budget_bytes
        if ref is None:
            r.status = f"FAILED: the plain deterministic step raised {why}"
            continue
        try:
            r.grads_equal, r.max_grad_diff = compare(
                step_grads(model, inputs, variant, seed), ref)
        except RuntimeError as exc:  # an op with no deterministic implementation
            r.status = f"FAILED: deterministic step raised {str(exc).splitlines()[0][:200]}"
            continue
        problems = [what for what, bad in (("gradients differ", not r.grads_equal),
                                           ("over budget", r.fits is False)) if bad]
        if problems:
            r.status = "FAILED: " + ", ".join(problems)
        gc.collect()
    log("gradients checked")

    mine = [rows[k] for k in specs if rows[k].measured_peak_bytes is not None]
    where: list[str] = []
    if mine:
        best = min(mine, key=lambda r: r.measured_peak_bytes or 0)
        best_plan = variants[best.name].plan
        assert best_plan is not None  # an autoremat row
        where = where_peak_sits(best, peaks[best.name][1], tape, best_plan)
    facts = {"host_bandwidth": tape.host_bandwidth, "plain_peak_tape": tape.step_peak_bytes,
             "output_bytes": tape.output_bytes, "grad_bytes": tape.grad_bytes,
             "param_bytes": tape.param_bytes, "tape_notes": list(tape.notes),
             "seconds": time.perf_counter() - start}
    return [rows[k] for k in ROWS], where, facts


def targets(rows: Sequence[Row]) -> list[str]:
    """The issue's done-when, one verdict per line (``n/a`` where a row is missing)."""
    by = {r.name: r for r in rows}

    def ok(cond: bool | None) -> str:
        return "n/a" if cond is None else ("yes" if cond else "NO")

    ref, blk = by["hf-per-block+save_on_cpu"], by["hf-per-block"]
    at, rec, off = (by["autoremat@save_on_cpu-peak"], by["autoremat-recompute@50%"],
                    by["autoremat-offload@50%"])
    at_peak = None if at.measured_peak_bytes is None or ref.measured_peak_bytes is None \
        else at.measured_peak_bytes <= ref.measured_peak_bytes
    at_time = None if at.time_ms is None or blk.time_ms is None \
        else at.time_ms <= TIME_SLACK * blk.time_ms
    faster = None if off.time_ms is None or rec.time_ms is None or not off.offloaded \
        else off.time_ms < rec.time_ms
    mine = [r for r in rows if r.name.startswith("autoremat") and r.measured_peak_bytes]
    grads = None if not mine else all(r.grads_equal for r in mine)
    fits = None if not mine else all(r.fits is not False for r in mine)
    return [
        f"- autoremat at save_on_cpu's peak, measured peak <= it: {ok(at_peak)}",
        f"- ... and time <= per-block checkpointing's x{TIME_SLACK}: {ok(at_time)}",
        f"- at 50%, an offload+recompute plan faster than recompute-only: {ok(faster)}"
        + ("" if off.offloaded else " (the 50% offload plan offloads nothing)"),
        f"- every autoremat row's gradients torch.equal to plain: {ok(grads)}",
        f"- every autoremat row's measured peak <= its budget: {ok(fits)}",
    ]


def _markdown(rows: Sequence[Row], where: list[str], facts: dict[str, Any], device: str,
              command: str, args: argparse.Namespace) -> str:
    def mib(n: int | None) -> str:
        return "" if n is None else f"{n / 2**20:,.2f}"

    def val(v: object) -> str:
        return "" if v is None else str(v)
    plain = next(r for r in rows if r.name == "plain").measured_peak_bytes or 1
    size = SIZES[args.size]
    lines = [f"# Offload to host memory ({device})", "",
             f"`{command}`, torch {torch.__version__}, HF Llama {size['layers']} x "
             f"{size['hidden']} (vocab {size['vocab']}, seq {size['seq']}, batch "
             f"{size['batch']}), {args.dtype}, {args.attention} attention, dropout 0.1; "
             f"{args.rounds} timed rounds after a warm-up, medians; "
             f"run took {facts['seconds']:.0f} s.", ""]
    if args.device.startswith("cpu"):
        lines += ["**CPU smoke run: these figures say nothing about a GPU.** "
                  + ("Steps ran under `simulated_host()`: offloaded tensors go to a host "
                     "memory the tracker does not count, so offload peaks are simulated "
                     "(what a GPU's allocator would see), times are not."
                     if args.simulate_host else
                     "There is no separate host: offload frees nothing and the planner "
                     "gains nothing by offloading (host bandwidth 0, offloaded windows equal kept "
                     "ones); `strategy=\"offload\"` runs the hooks but frees nothing."), ""]
    lines += [f"Host bandwidth measured by profile: {facts['host_bandwidth']:.3g} B/s.", "",
              "| row | status | peak MiB | % plain | time x plain | budget MiB | predicted "
              "MiB | <= budget | host MiB (pred.) | offloaded | offload_input | recomputed | "
              "grads equal |", "|" + "---|" * 13]
    for r in rows:
        pct = "" if r.measured_peak_bytes is None else f"{100 * r.measured_peak_bytes / plain:.1f}"
        ratio = "" if r.time_ratio is None else f"{r.time_ratio:.3f}"
        lines.append(f"| {r.name} | {r.status.split(':')[0]} | {mib(r.measured_peak_bytes)} | "
                     f"{pct} | {ratio} | {mib(r.budget_bytes)} | {mib(r.predicted_peak_bytes)}"
                     f" | {val(r.fits)} | {mib(r.host_bytes)} | {val(r.offloaded)} | "
                     f"{val(r.offload_input)} | {val(r.recomputed)} | {val(r.grads_equal)} |")
    notes = [f"- {r.name}: {r.status}" for r in rows if r.status != "ok"]
    notes += [f"- {r.name}: {r.note}" for r in rows if r.note]
    notes += [f"- profile: {n}" for n in facts["tape_notes"]]
    if notes:
        lines += ["", "Notes:", "", *notes]
    smoke = " (a CPU run: these exercise the script, they judge nothing)" \
        if args.device.startswith("cpu") else ""
    lines += ["", f"Targets (issue 17){smoke}:", "", *targets(rows)]
    if where:
        lines += ["", *where]
    return "\n".join(lines) + "\n"



@contextlib.contextmanager
def _host(simulate: bool) -> Iterator[None]:
    if simulate:
        with simulated_host():
            yield
    else:
        yield


def main(argv: Sequence[str] | None = None) -> Path:
    """Run the benchmark; returns the path of the Markdown report."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", choices=sorted(SIZES), default="gpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: bf16 for --size gpu, fp32 for tiny")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds (default 5 on gpu size, 3 on tiny)")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                        help="eager: if the SDPA kernel refuses deterministic algorithms")
    parser.add_argument("--profile-repeats", type=int, default=None)
    parser.add_argument("--simulate-host", action="store_true",
                        help="CPU only: offload to a host the tracker does not count")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    tiny = args.size == "tiny"
    args.dtype = args.dtype or ("fp32" if tiny else "bf16")
    args.rounds = args.rounds or (3 if tiny else 5)
    args.profile_repeats = args.profile_repeats or (1 if tiny else 3)
    device = torch.device(args.device)
    if args.simulate_host and device.type != "cpu":
        parser.error("--simulate-host is for --device cpu (a GPU has its own host)")
    if device.type == "cpu":
        torch.set_num_threads(1)
    with _host(args.simulate_host):
        rows, where, facts = run(args)
    name = device_info(device)["device_name"]
    stem = f"offload_{device_slug(device)}" + ("" if args.size == "gpu" else f"_{args.size}") \
        + ("_simulated" if args.simulate_host else "")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/offload.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if k not in ("out", "simulate_host")) + (" --simulate-host" if args.simulate_host else "")
    md = out / f"{stem}.md"
    md.write_text(_markdown(rows, where, facts, name, command, args))
    payload = {"schema_version": 1, "device": name, "torch": torch.__version__,
               "command": command, "simulated_host": args.simulate_host, "facts": facts,
               "targets": targets(rows), "where_peak_sits": where,
               "rows": [dataclasses.asdict(r) for r in rows]}
    tmp = out / f".{stem}.json.tmp"
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, out / f"{stem}.json")
    print(md.read_text())
    return md


if __name__ == "__main__":
    main()
