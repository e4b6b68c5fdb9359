"""The loss head in the plan against per-block checkpointing with Hugging Face's own loss.

One process, one Hugging Face causal LM given ``labels``, seven rows, each measured by
its step peak (on CUDA the rise of ``torch.cuda.max_memory_allocated()`` over one step;
elsewhere the storage tracker, ``autoremat.track_memory()``), gradients set to ``None``
first, and its step time (median of interleaved rounds, CUDA-synchronised):

1. ``plain``: no checkpointing, the model's own head and loss;
2. ``hf-per-block``: ``gradient_checkpointing_enable(use_reentrant=False)``, HF's loss
   (the common baseline; every time ratio is against this row);
3. ``autoremat@hf-peak``: ``plan(tape, budget=<row 2's measured peak>, head="auto")``;
4. ``autoremat@0.75x-hf-peak``: the same at three quarters of row 2's peak (the GPU
   target's memory);
5. ``autoremat-full+chunked:4``: ``plan(tape, None, "full", head="chunked:4")`` (every
   block recomputed, as row 2, and the head over 4 chunks of tokens);
6. ``autoremat-full+chunked:32``: the same over 32 chunks;
7. ``autoremat-keep+chunked``: ``plan(tape, <the chunked head's largest step peak with
   every block kept>, head="chunked")``: the head chunked at a budget that needs no
   block recomputed (its time is judged against ``plain``'s);
8. ``autoremat@min``: ``plan(tape, smallest_feasible_bytes(tape), head="auto")``.

Every row's loss and gradients are compared with the plain step's from the same RNG
state (dropout on): ``|loss - plain loss|`` and, over every parameter, the largest
``max |grad - plain grad| / max |plain grad|``; on CUDA both steps run under
``torch.use_deterministic_algorithms(True)`` when ``CUBLAS_WORKSPACE_CONFIG`` is set
(this script sets ``:4096:8`` unless the environment has it; set it empty to opt out).
A chunked head changes the loss and gradients by summation order only, within
``autoremat.HEAD_RTOL``-style bounds (NOTE [ What a chunked head changes in numerics ]).

Sizes: ``gpt2`` (the CPU default: GPT-2 6 x 256, the real vocabulary of 50257, batch
4 x seq 256), ``tiny`` (a CI smoke run) and ``llama`` (the GPU default: Llama 16 x 2048,
vocab 32000, seq 2048, batch 4, bf16). Random initialisation, nothing downloaded.

Run:        python benchmarks/head.py                      # CPU, gpt2 size, a few minutes
On a GPU:   python benchmarks/head.py --device cuda        # llama size, bf16
Smoke run:  python benchmarks/head.py --size tiny          # seconds
Writes ``benchmarks/results/head_<device>.md`` and ``.json`` (``_<size>`` added for a
size other than the device's default); the device, torch version, date and thread count
are in both.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA initialises

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autoremat
from autoremat._bench.refs import hf_toggle
from autoremat._bench.report import device_info, device_slug
from autoremat._core.decisions import Choice
from autoremat._core.errors import RematError
from autoremat._core.head import HEAD_RTOL, backend_unavailable
from autoremat._core.step import preserved_state, run_step
from autoremat._measure.memory import track_allocator, track_memory
from autoremat._measure.timing import time_ms
from autoremat._mechanism.head import find_head, install_head, uninstall_head
from autoremat._plan.strategies import smallest_feasible_bytes

ROWS = ("plain", "hf-per-block", "autoremat@hf-peak", "autoremat@0.75x-hf-peak",
        "autoremat-keep+chunked", "autoremat-full+chunked:4", "autoremat-full+chunked:32",
        "autoremat@min")
BASELINE = "hf-per-block"
PEAK_TARGET = 0.75  # GPU target: autoremat's peak <= 0.75 x per-block checkpointing's ...
TIME_TARGET = 1.04  # ... at no more than +4% of its time
MIN_TARGET = 0.25  # CPU gpt2 target: the smallest feasible plan below 25% of plain
CHUNKED_TARGET = 1.02  # a chunked head with every block kept: at most plain's time x this
PEER_TARGET = 1.02  # at a peer's peak (and at the minimum): at most the fastest peer's x this
HF_PEAK_TARGET = 0.90  # at per-block checkpointing's peak: at most its time x this

SIZES: dict[str, dict[str, Any]] = {
    "gpt2": {"arch": "gpt2", "layers": 6, "hidden": 256, "heads": 4, "vocab": 50257,
             "seq": 256, "batch": 4},
    "tiny": {"arch": "gpt2", "layers": 2, "hidden": 64, "heads": 4, "vocab": 2000,
             "seq": 32, "batch": 2},
    "llama": {"arch": "llama", "layers": 16, "hidden": 2048, "intermediate": 5504,
              "heads": 16, "vocab": 32000, "seq": 2048, "batch": 4},
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build(size: dict[str, Any], device: torch.device, dtype: torch.dtype,
          attention: str = "sdpa") -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model of ``size`` (dropout 0.1, training mode) and one batch, labels = ids."""
    import transformers

    torch.manual_seed(0)
    if size["arch"] == "gpt2":
        config: Any = transformers.GPT2Config(
            n_layer=size["layers"], n_embd=size["hidden"], n_head=size["heads"],
            vocab_size=size["vocab"], n_positions=size["seq"], use_cache=False)
        cls: Any = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(
            hidden_size=size["hidden"], intermediate_size=size["intermediate"],
            num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
            num_key_value_heads=size["heads"], vocab_size=size["vocab"],
            max_position_embeddings=size["seq"], attention_dropout=0.1, use_cache=False)
        cls = transformers.LlamaForCausalLM
    config._attn_implementation = attention
    model = cls(config).to(device=device, dtype=dtype).train()
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), device=device)
    return model, {"input_ids": ids, "labels": ids.clone()}


@dataclasses.dataclass
class Variant:
    name: str
    install: Callable[[], object]
    uninstall: Callable[[], object]
    plan: autoremat.Plan | None = None


@dataclasses.dataclass
class Row:
    name: str
    status: str = "ok"  # "ok", "FAILED: ...", "infeasible: ..." or "refused: ..."
    note: str = ""
    head: str = ""  # "hf" (the model's own), "keep" or "chunked:N"
    measured_peak_bytes: int | None = None
    peak_ratio: float | None = None  # over the hf-per-block row's measured peak
    time_ms: float | None = None  # median of the timed rounds
    time_ratio: float | None = None  # over the hf-per-block row's median
    times_ms: list[float] = dataclasses.field(default_factory=list)
    logits_none: bool | None = None  # out.logits is None in the step
    loss_abs_diff: float | None = None  # |loss - plain loss|
    max_grad_rel_diff: float | None = None  # max over parameters of max|diff|/max|plain|
    grads_equal: bool | None = None  # every gradient torch.equal to plain's
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    fits: bool | None = None  # measured <= budget
    recomputed: int | None = None  # blocks that recompute anything
    plan: str = ""


def _nothing() -> None:
    return None


# the peers' kernels, by backend, and the head option each runs as (NOTE [ Head backends ])
PEERS = {"torch": "torch:4", "liger": "liger", "cce": "cce"}


def _peer(model: nn.Module, site: Any, backend: str,
          hf: tuple[Callable[[], object], Callable[[], object]] | None = None) -> Variant:
    """The model's head computed by ``backend``'s kernel (what a user of that library
    runs: no autoremat plan), with HF's per-block checkpointing where ``hf`` is given."""
    chunks = Choice.head_from_key(PEERS[backend]).chunks
    installed: list[Any] = []

    def install() -> None:
        if hf is not None:
            hf[0]()
        installed.append(install_head(model, site, chunks, backend))

    def uninstall() -> None:
        uninstall_head(installed.pop())
        if hf is not None:
            hf[1]()
    name = f"peer:{backend}" if hf is None else f"{BASELINE}+{backend}"
    return Variant(name, install, uninstall)


def _step(model: nn.Module, variant: Variant, seed: int, body: Callable[[], Any]) -> Any:
    """``body`` with ``variant`` installed, from RNG seed ``seed``, gradients ``None``
    first, leaving the model's gradients, buffers and RNG as they were."""
    with preserved_state(model):
        torch.manual_seed(seed)
        variant.install()
        try:
            return body()
        finally:
            variant.uninstall()


def measure_peak(model: nn.Module, inputs: Any, variant: Variant, device: torch.device,
                 seed: int) -> int:
    """One step's peak: the allocator's rise on CUDA, the storage tracker elsewhere."""
    def body() -> int:
        if device.type == "cuda":
            with track_allocator(device) as alloc:
                run_step(model, inputs, None)
            assert alloc.peak_bytes is not None
            return alloc.peak_bytes
        with track_memory() as mem:
            run_step(model, inputs, None)
        return mem.peak_bytes
    peak: int = _step(model, variant, seed, body)
    return peak


@dataclasses.dataclass
class StepResult:
    loss: float
    logits_none: bool
    grads: dict[str, torch.Tensor | None]


def grad_step(model: nn.Module, inputs: dict[str, Any], variant: Variant, seed: int,
              deterministic: bool) -> StepResult:
    """One step as a training loop writes it (``out = model(**batch);
    out.loss.backward()``), its loss, whether ``out.logits`` was None, its gradients."""
    def body() -> StepResult:
        out = model(**inputs)
        out.loss.backward()
        return StepResult(float(out.loss.detach().float()), out.logits is None,
                          {n: None if p.grad is None else p.grad.detach().clone()
                           for n, p in model.named_parameters()})
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic or before)
    try:
        result: StepResult = _step(model, variant, seed, body)
        return result
    finally:
        torch.use_deterministic_algorithms(before)


def compare(mine: dict[str, torch.Tensor | None],
            ref: dict[str, torch.Tensor | None]) -> tuple[bool, float]:
    """(every gradient ``torch.equal``, the largest max |diff| / max |plain| over the
    parameters; inf where one has a gradient and the other none)."""
    equal, worst = True, 0.0
    for name, g in ref.items():
        other = mine[name]
        if g is None or other is None:
            if (g is None) != (other is None):
                equal, worst = False, float("inf")
            continue
        if torch.equal(g, other):
            continue
        equal = False
        diff = float((g.float() - other.float()).abs().max())
        scale = float(g.float().abs().max())
        worst = max(worst, diff / scale if scale > 0 else float("inf"))
    return equal, worst


def run(args: argparse.Namespace) -> tuple[list[Row], dict[str, Any]]:
    device = torch.device(args.device)
    size = SIZES[args.size]
    dtype = DTYPES[args.dtype]
    model, inputs = build(size, device, dtype, args.attention)
    seed = 1234
    on_cuda = device.type == "cuda"
    deterministic = on_cuda and bool(os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    start = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {text}", flush=True)

    hf = hf_toggle(model)
    if hf is None:
        raise RematError("transformers' model has no gradient_checkpointing_enable")
    variants: dict[str, Variant] = {"plain": Variant("plain", _nothing, _nothing),
                                    BASELINE: Variant(BASELINE, *hf)}
    site = find_head(model, inputs, None)[0]
    peers = [k for k in PEERS if site is not None
             and not backend_unavailable(k, device, bias=model.get_submodule(
                 site.name).bias is not None)]
    for peer in peers:  # the kernel alone, and with HF's checkpointing
        variants[f"peer:{peer}"] = _peer(model, site, peer)
        variants[f"{BASELINE}+{peer}"] = _peer(model, site, peer, hf)
    order = [*ROWS[:2], *variants.keys() - set(ROWS), *ROWS[2:],
             *(f"autoremat@{peer}-peak" for peer in peers)]
    rows: dict[str, Row] = {name: Row(name) for name in dict.fromkeys(order)}
    rows["plain"].head = rows[BASELINE].head = "hf"
    for peer in peers:
        rows[f"peer:{peer}"].head = rows[f"{BASELINE}+{peer}"].head = PEERS[peer]

    # Reference peaks first: row 2's peak is row 3's budget. One unmeasured step each
    # first, so that one-time allocations (cuBLAS's workspace) are not in the peak.
    peaks: dict[str, int] = {}
    for name, variant in variants.items():
        _step(model, variant, seed, lambda: run_step(model, inputs, None))
        peaks[name] = measure_peak(model, inputs, variant, device, seed)
    log("reference peaks " + ", ".join(f"{k} {v:,}" for k, v in peaks.items()))

    kernels = ["autoremat", *peers]  # the planner may take any of them
    tape = autoremat.profile(model, inputs, repeats=args.profile_repeats, with_head=kernels)
    head_options = sorted(tape.head.options) if tape.head is not None else []
    log(f"profiled: plain peak {tape.step_peak_bytes:,}, head options {head_options}")
    smallest = smallest_feasible_bytes(tape, head="auto")  # over every head choice
    hf_peak = peaks[BASELINE]
    specs: dict[str, Callable[[], autoremat.Plan]] = {
        "autoremat@hf-peak": lambda: autoremat.plan(tape, hf_peak, head="auto"),
        "autoremat@0.75x-hf-peak": lambda: autoremat.plan(
            tape, int(PEAK_TARGET * hf_peak), head="auto"),
        "autoremat-keep+chunked": lambda: autoremat.plan(
            tape, max((o.step_peak_bytes for o in tape.head.options.values()), default=None)
            if tape.head is not None else None, head="chunked"),
        "autoremat-full+chunked:4": lambda: autoremat.plan(tape, None, "full",
                                                           head="chunked:4"),
        "autoremat-full+chunked:32": lambda: autoremat.plan(tape, None, "full",
                                                            head="chunked:32"),
        "autoremat@min": lambda: autoremat.plan(tape, smallest, head="auto"),
        **{f"autoremat@{peer}-peak": functools.partial(
            lambda key: autoremat.plan(tape, peaks[key], head="auto"), f"peer:{peer}")
           for peer in peers},
    }
    plans: dict[str, autoremat.Plan] = {}
    for name, make in specs.items():
        r = rows[name]
        try:
            plan = make()
        except RematError as exc:
            kind = "infeasible" if isinstance(exc, autoremat.BudgetError) else "refused"
            r.status = f"{kind}: {str(exc).splitlines()[0][:300]}"
            continue
        plans[name] = plan
        variants[name] = Variant(name, functools.partial(autoremat.apply, model, plan),
                                 functools.partial(autoremat.remove, model), plan=plan)
        r.head = plan.head.head_key
        r.budget_bytes, r.predicted_peak_bytes = plan.budget_bytes, plan.predicted_peak_bytes
        r.recomputed = plan.recompute_blocks
        r.plan = ", ".join(f"{b.name}:{b.decision}" for b in plan.blocks)
        r.note = "; ".join(plan.notes)[:400]
        _step(model, variants[name], seed, lambda: run_step(model, inputs, None))
        peaks[name] = measure_peak(model, inputs, variants[name], device, seed)
    log("autoremat peaks " + ", ".join(f"{k} {peaks[k]:,}" for k in specs if k in peaks))

    # Times: a warm-up round, then ``rounds`` interleaved rounds, one step per row each.
    for _ in range(args.rounds + 1):
        for name, variant in variants.items():
            rows[name].times_ms.append(_step(
                model, variant, seed,
                lambda: time_ms(lambda: run_step(model, inputs, None), device)))
    for name in variants:
        r = rows[name]
        r.times_ms = r.times_ms[1:]
        r.time_ms = statistics.median(r.times_ms)
    base_ms = rows[BASELINE].time_ms or float("nan")
    for name in variants:
        rows[name].time_ratio = (rows[name].time_ms or 0.0) / base_ms
    log("timed " + ", ".join(f"{k} x{rows[k].time_ratio:.3f}" for k in variants))

    # Loss and gradients against the plain step's, same seed (dropout on).
    why = ""
    try:
        ref: StepResult | None = grad_step(model, inputs, variants["plain"], seed,
                                           deterministic)
    except RuntimeError as exc:  # e.g. an attention kernel with no deterministic backward
        ref, why = None, str(exc).splitlines()[0][:200]
    for name, variant in variants.items():
        r = rows[name]
        r.measured_peak_bytes = peaks[name]
        r.peak_ratio = peaks[name] / hf_peak
        if r.budget_bytes is not None:
            r.fits = r.measured_peak_bytes <= r.budget_bytes
        if ref is None:
            r.status = f"FAILED: the plain step raised {why}"
            continue
        try:
            mine = grad_step(model, inputs, variant, seed, deterministic)
        except RuntimeError as exc:
            r.status = f"FAILED: the step raised {str(exc).splitlines()[0][:200]}"
            continue
        r.logits_none = mine.logits_none
        r.loss_abs_diff = abs(mine.loss - ref.loss)
        r.grads_equal, r.max_grad_rel_diff = compare(mine.grads, ref.grads)
        chunked = r.head not in ("", "hf", "keep")  # any kernel that skips the logits
        # a kept head: torch.equal (on CUDA without deterministic algorithms, kernels
        # differ from themselves: not judged); a chunked one: within HEAD_RTOL
        bound = HEAD_RTOL.get(dtype, 0.0) if chunked else 0.0
        judged = chunked or deterministic or not on_cuda
        problems = [what for what, bad in (
            ("over budget", r.fits is False),
            ("logits built by a chunked head", chunked and not r.logits_none),
            (f"gradients differ by {r.max_grad_rel_diff:.2g} of max |grad| (bound {bound:.2g})",
             judged and r.max_grad_rel_diff > bound)) if bad]
        if problems:
            r.status = "FAILED: " + ", ".join(problems)
        del mine
        gc.collect()
    log("gradients checked")

    # verify's own judgement of the smallest plan (its head bound, its peak).
    verdict: dict[str, Any] = {}
    if "autoremat@min" in plans:
        try:
            report = autoremat.verify(model, inputs, plans["autoremat@min"], repeats=1,
                                      deterministic=deterministic)
            verdict = {"ok": report.ok, "head_rel_diff": report.head_rel_diff,
                       "head_bound": report.head_bound, "peak_bytes": report.peak_bytes}
        except (RematError, RuntimeError) as exc:  # e.g. no deterministic SDPA backward
            verdict = {"ok": None, "head_rel_diff": None, "head_bound": None,
                       "peak_bytes": None, "error": str(exc).splitlines()[0][:300]}
        finally:
            autoremat.remove(model)
        log(f"verify(autoremat@min): {verdict}")
    facts = {"plain_peak_tape": tape.step_peak_bytes, "smallest_feasible_bytes": smallest,
             "head_options": {k: {"chunks": o.chunks, "step_peak_bytes": o.step_peak_bytes,
                                  "cost": o.cost}
                              for k, o in (tape.head.options.items() if tape.head else [])},
             "output_bytes": tape.output_bytes, "grad_bytes": tape.grad_bytes,
             "param_bytes": tape.param_bytes, "tape_notes": list(tape.notes),
             "verify_min": verdict, "deterministic": deterministic,
             "head_rtol": HEAD_RTOL.get(dtype), "seconds": time.perf_counter() - start}
    return list(rows.values()), facts


def targets(rows: Sequence[Row], gpu: bool) -> list[str]:
    """The targets, each PASS or FAIL from the measurements (n/a where a row is missing).
    The GPU target is judged on every size; it is the target of the ``llama`` run."""
    by = {r.name: r for r in rows}
    plain, base, low = by["plain"], by[BASELINE], by["autoremat@min"]

    def verdict(cond: bool | None) -> str:
        return "n/a" if cond is None else ("PASS" if cond else "FAIL")
    lines = []
    peers = [r for r in rows if r.name.startswith("peer:") or r.name.startswith(f"{BASELINE}+")]
    for r in rows:  # NOTE [ Head backends ]: at each peer's peak, the best a user could run
        if not (r.name.startswith("autoremat@") and r.name.endswith("-peak")
                and r.name[10:-5] in PEERS):
            continue
        at = [p for p in peers if p.measured_peak_bytes is not None and r.budget_bytes
              and p.measured_peak_bytes <= r.budget_bytes and p.time_ms]
        best = min(at, key=lambda p: p.time_ms or 0.0, default=None)
        if r.time_ms is None or best is None or best.time_ms is None:
            lines.append(f"- {r.name}: fits and no slower than the fastest peer at that "
                         f"memory +{100 * (PEER_TARGET - 1):.0f}%: n/a ({r.status})")
            continue
        ratio = r.time_ms / best.time_ms
        lines.append(f"- {r.name}: fits ({r.fits}) and no slower than the fastest peer at "
                     f"that memory ({best.name}) +{100 * (PEER_TARGET - 1):.0f}%: "
                     f"x{ratio:.3f}, {verdict(bool(r.fits) and ratio <= PEER_TARGET)}")
    with_hf = [p for p in peers if p.name.startswith(f"{BASELINE}+") and p.time_ms]
    fastest = min(with_hf, key=lambda p: p.time_ms or 0.0, default=None)
    if fastest is not None and fastest.time_ms and low.time_ms:
        ratio = low.time_ms / fastest.time_ms
        lines.append(f"- autoremat@min no slower than {fastest.name} "
                     f"+{100 * (PEER_TARGET - 1):.0f}%: x{ratio:.3f}, "
                     f"{verdict(ratio <= PEER_TARGET)}")
    at_hf = by["autoremat@hf-peak"]
    if at_hf.time_ms and base.time_ms:
        ratio = at_hf.time_ms / base.time_ms
        lines.append(f"- autoremat@hf-peak at least {100 * (1 - HF_PEAK_TARGET):.0f}% faster "
                     f"than per-block checkpointing: x{ratio:.3f}, "
                     f"{verdict(ratio <= HF_PEAK_TARGET)}")
    kept = by["autoremat-keep+chunked"]
    if kept.time_ms and plain.time_ms and kept.recomputed == 0:
        ratio = kept.time_ms / plain.time_ms
        lines.append(f"- a chunked head ({kept.head}) with every block kept at most "
                     f"x{CHUNKED_TARGET} of the plain step's time: x{ratio:.3f}, "
                     f"{verdict(ratio <= CHUNKED_TARGET)}")
    else:
        lines.append(f"- a chunked head with every block kept at most x{CHUNKED_TARGET} of "
                     f"the plain step's time: n/a ({kept.status}, recomputed "
                     f"{kept.recomputed})")
    if plain.measured_peak_bytes and low.measured_peak_bytes and low.predicted_peak_bytes:
        pred = low.predicted_peak_bytes / plain.measured_peak_bytes
        meas = low.measured_peak_bytes / plain.measured_peak_bytes
        lines.append(f"- smallest feasible plan below {100 * MIN_TARGET:.0f}% of the plain "
                     f"peak: predicted {100 * pred:.1f}%, measured {100 * meas:.1f}%: "
                     f"{verdict(meas < MIN_TARGET and pred < MIN_TARGET)}")
    else:
        lines.append(f"- smallest feasible plan below {100 * MIN_TARGET:.0f}% of the plain "
                     f"peak: n/a")
    mine = [r for r in rows if r.name.startswith("autoremat") and r.status == "ok"
            and r.peak_ratio is not None and r.time_ratio is not None]
    good = [r for r in mine if r.peak_ratio is not None and r.time_ratio is not None
            and r.peak_ratio <= PEAK_TARGET and r.time_ratio <= TIME_TARGET]
    best = min(mine, key=lambda r: (r.time_ratio or 0.0)
               if (r.peak_ratio or 1.0) <= PEAK_TARGET else float("inf"), default=None)
    detail = ", ".join(f"{r.name} {r.peak_ratio:.3f}x peak / x{r.time_ratio:.3f} time"
                       for r in mine)
    if base.measured_peak_bytes is None or not mine:
        lines.append("- autoremat's peak <= 0.75x per-block checkpointing's at <= +4% "
                     "time: n/a")
    else:
        which = good[0].name if good else (best.name + " is the fastest at <= 0.75x"
                                           if best and (best.peak_ratio or 1) <= PEAK_TARGET
                                           else "no row reaches 0.75x")
        where = "" if gpu else " (the GPU target; here on a CPU)"
        lines.append(f"- autoremat's peak <= {PEAK_TARGET}x per-block checkpointing's at "
                     f"<= +{100 * (TIME_TARGET - 1):.0f}% time{where}: "
                     f"{verdict(bool(good))} ({which}; rows: {detail})")
    return lines


def _markdown(rows: Sequence[Row], facts: dict[str, Any], meta: dict[str, Any],
              args: argparse.Namespace) -> str:
    def mib(n: int | None) -> str:
        return "" if n is None else f"{n / 2**20:,.2f}"

    def val(v: object, fmt: str = "") -> str:
        return "" if v is None else format(v, fmt)
    plain = next(r for r in rows if r.name == "plain").measured_peak_bytes or 1
    size = SIZES[args.size]
    how = ("rise of torch.cuda.max_memory_allocated()" if args.device.startswith("cuda")
           else "storage tracker (autoremat.track_memory())")
    arch = "GPT-2" if size["arch"] == "gpt2" else "Llama"
    lines = [f"# The loss head in the plan ({meta['device_name']})", "",
             f"`{meta['command']}`; torch {meta['torch']}, transformers "
             f"{meta['transformers']}, {meta['date']}, {meta['threads']} thread(s); HF "
             f"{arch} {size['layers']} x {size['hidden']} (vocab {size['vocab']}, seq "
             f"{size['seq']}, batch {size['batch']}), {args.dtype}, {args.attention} "
             f"attention, dropout 0.1, labels = input ids; {args.rounds} timed rounds "
             f"after a warm-up, interleaved, medians; run took {facts['seconds']:.0f} s.", "",
             f"Peaks: {how} over forward + backward, gradients None first, the output held through "
             f"backward. Ratios are to `{BASELINE}` (HF per-block checkpointing, HF's loss). "
             f"Gradients: max over parameters of max |grad - plain| / max |plain|"
             f"{' (deterministic algorithms)' if facts['deterministic'] else ''}.", ""]
    lines += ["| row | status | head | peak MiB | % plain | x per-block peak | time ms | "
              "x per-block time | logits None | loss abs diff | max grad rel diff | "
              "budget MiB | predicted MiB | <= budget | recomputed |", "|" + "---|" * 15]
    for r in rows:
        pct = "" if r.measured_peak_bytes is None else f"{100 * r.measured_peak_bytes / plain:.1f}"
        lines.append(
            f"| {r.name} | {r.status.split(':')[0]} | {r.head} | {mib(r.measured_peak_bytes)} "
            f"| {pct} | {val(r.peak_ratio, '.3f')} | {val(r.time_ms, '.1f')} | "
            f"{val(r.time_ratio, '.3f')} | {val(r.logits_none)} | {val(r.loss_abs_diff, '.3g')}"
            f" | {val(r.max_grad_rel_diff, '.3g')} | {mib(r.budget_bytes)} | "
            f"{mib(r.predicted_peak_bytes)} | {val(r.fits)} | {val(r.recomputed)} |")
    opts = ", ".join(f"{k}: step peak (blocks kept) {mib(o['step_peak_bytes'])} MiB"
                     for k, o in facts["head_options"].items())
    lines += ["", f"Plain peak (tape) {mib(facts['plain_peak_tape'])} MiB; smallest "
              f"feasible budget {mib(facts['smallest_feasible_bytes'])} MiB; the model's "
              f"output (logits) {mib(facts['output_bytes'])} MiB, gradients "
              f"{mib(facts['grad_bytes'])} MiB; head options: {opts or 'none'}."]
    v = facts["verify_min"]
    if v:
        lines += ["", f"`autoremat.verify` of `autoremat@min`: ok={v['ok']}, head_rel_diff="
                  f"{v['head_rel_diff']}, head_bound={v['head_bound']}, peak "
                  f"{mib(v['peak_bytes'])} MiB" + (f"; raised: {v['error']}"
                                                   if v.get("error") else ".")]
    notes = [f"- {r.name}: {r.status}" for r in rows if r.status != "ok"]
    notes += [f"- {r.name}: plan {r.plan}" + (f"; {r.note}" if r.note else "")
              for r in rows if r.plan]
    notes += [f"- profile: {n}" for n in facts["tape_notes"]]
    if notes:
        lines += ["", "Notes:", "", *notes]
    lines += ["", "Targets:", "", *targets(rows, args.device.startswith("cuda"))]
    return "\n".join(lines) + "\n"



def main(argv: Sequence[str] | None = None) -> Path:
    """Run the benchmark; returns the path of the Markdown report."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="default: gpt2 on a CPU, llama on CUDA")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: bf16 on CUDA, fp32 on a CPU")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds (default 5; 2 at the tiny size)")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                        help="eager: if the SDPA kernel refuses deterministic algorithms")
    parser.add_argument("--profile-repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    default_size = "llama" if device.type == "cuda" else "gpt2"
    args.size = args.size or default_size
    tiny = args.size == "tiny"
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    args.rounds = args.rounds or (2 if tiny else 5)
    args.profile_repeats = args.profile_repeats or (1 if tiny else 3)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    rows, facts = run(args)
    import transformers

    info = device_info(device)
    command = "python benchmarks/head.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")
    meta = {"device": str(device), "device_name": info["device_name"],
            "torch": torch.__version__, "transformers": transformers.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "threads": torch.get_num_threads(), "command": command,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    stem = f"head_{device_slug(device)}" + ("" if args.size == default_size else f"_{args.size}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = out / f"{stem}.md"
    md.write_text(_markdown(rows, facts, meta, args))
    payload = {"schema_version": 1, **meta, "size": args.size, "shape": SIZES[args.size],
               "dtype": args.dtype, "facts": facts,
               "targets": targets(rows, device.type == "cuda"),
               "rows": [dataclasses.asdict(r) for r in rows]}
    tmp = out / f".{stem}.json.tmp"
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, out / f"{stem}.json")
    print(md.read_text())
    return md


if __name__ == "__main__":
    main()
