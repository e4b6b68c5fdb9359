"""The cost of knowing: what ``profile`` and ``auto`` cost, in plain training steps.

For each model (the zoo's gpt2 and llama at their default sizes, and two Hugging Face
models built from their config classes with random weights, nothing downloaded: GPT-2
6 layers x 256 wide and a Llama of the same size, seq 256, batch 4) it times:

* ``plain step``: one forward + loss + backward (gradients set to None before it, no
  optimizer step), the median of ``--steps`` steps after ``--warmup`` warm-up steps;
* ``profile``: ``autoremat.profile(model, inputs)`` with its default options;
* ``profile(with_selective=False)``: the same without measuring selective windows;
* ``auto@60%``: ``autoremat.auto(model, inputs, budget="60%")`` on a fresh copy of the
  model (same seed), as a user would call it;

each as wall seconds and as a multiple of the plain step's median: the median over
``--rounds`` rounds (3; each the plain steps, then every call once), the multiple taken
within each round, since a shared CPU's load moves single calls by up to 2x between runs.
``--heldout`` instead times a "held-out style check": ``auto`` on five small Hugging Face
models (GPT-2, Llama, BERT, Qwen2, OPT) at three budgets each (90%, 60%, and 10% above the
smallest feasible budget, which a first ``auto(..., budget=1)`` finds from its
``BudgetError``), each call on a fresh model, and reports every call's time and the total.
The calls of the cost table run cold (the keep-sets an earlier call solved forgotten
first); those of the held-out check one after another in one process, as a user's sweep
would, unless ``--cold``.

Run:        OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/profile_cost.py --tag before
            OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/profile_cost.py --heldout \
                --tag before
Quick test: python benchmarks/profile_cost.py --size tiny --out /tmp/pc
A CPU stand-in for a GPU's short steps: ``--size launch`` (the ``gpu`` size's 12 layers,
64 wide, batch 2 x 64 tokens: ops of a few microseconds, as on a GPU).
Writes ``<out>/profile_cost[_<tag>].json`` and ``.md`` (``profile_cost_heldout[_<tag>]`` with
``--heldout``); device, torch version, date and thread count in both. Times are wall
clocks on whatever else the machine is running: on a shared CPU they move by 10-30%.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autoremat
from autoremat._bench.report import device_info
from autoremat._core.step import run_step
from autoremat._measure.timing import time_ms
from autoremat._plan import keepsets

Builder = Callable[[str, torch.device], tuple[nn.Module, Any]]


def _batch(vocab: int, seq: int, batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return {"input_ids": ids, "labels": ids.clone()}


# --- the models of the cost table ------------------------------------------------------

# zoo: its default sizes (6 layers x 128, batch 4 x 128 tokens, dropout 0.1), a tiny one
# and, for a GPU, GPT-2 small's shape at batch 8 (on an H200 the default sizes' steps take
# 14-29 ms, and a profile's Python, not its steps, is what such a table then shows)
_ZOO_SIZES: dict[str, dict[str, Any]] = {
    "default": {},
    "tiny": {"n_layer": 2, "n_embd": 32, "n_head": 2, "batch_size": 2, "seq_len": 32,
             "vocab_size": 64},
    "gpu": {"n_layer": 12, "n_embd": 768, "n_head": 12, "batch_size": 8, "seq_len": 1024},
    # the GPU size's 12 layers at a width a CPU steps through in tens of ms: each op takes
    # a few microseconds, so, as on a GPU, a profile's per-op Python is what it pays for
    "launch": {"n_layer": 12, "n_embd": 64, "n_head": 4, "batch_size": 2, "seq_len": 64,
               "vocab_size": 256},
}
# HF: (layers, width, heads, seq, batch, vocab)
_HF_SIZES = {"default": (6, 256, 4, 256, 4, 8192), "tiny": (2, 32, 2, 32, 2, 64),
             "gpu": (12, 768, 12, 1024, 8, 50257), "launch": (12, 64, 4, 64, 2, 256)}


def _zoo(name: str) -> Builder:
    def build(size: str, device: torch.device) -> tuple[nn.Module, Any]:
        return autoremat.zoo.build(name, device=device, **_ZOO_SIZES[size])
    return build


def _hf_gpt2(size: str, device: torch.device) -> tuple[nn.Module, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, width, heads, seq, batch, vocab = _HF_SIZES[size]
    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                        n_positions=seq, bos_token_id=0, eos_token_id=0, use_cache=False)
    # dropout 0.1 (GPT-2's defaults); transformers' typing of .to confuses mypy (as in
    # gpu_exact.py)
    model = GPT2LMHeadModel(config).to(device).train()  # type: ignore[arg-type]
    return model, _batch(vocab, seq, batch, device)


def _hf_llama(size: str, device: torch.device) -> tuple[nn.Module, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, width, heads, seq, batch, vocab = _HF_SIZES[size]
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=width,
                         intermediate_size=width * 8 // 3 // 8 * 8, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2), vocab_size=vocab,
                         max_position_embeddings=seq, attention_dropout=0.1, use_cache=False)
    model = LlamaForCausalLM(config).to(device).train()  # type: ignore[arg-type]
    return model, _batch(vocab, seq, batch, device)


MODELS: dict[str, Builder] = {"zoo-gpt2": _zoo("gpt2"), "zoo-llama": _zoo("llama"),
                              "hf-gpt2": _hf_gpt2, "hf-llama": _hf_llama}


# --- the five models of the held-out style check ----------------------------------------

# (layers, width, heads, seq, batch, vocab)
_HELDOUT_SIZES = {"default": (4, 128, 4, 128, 4, 2048), "tiny": (2, 32, 2, 32, 2, 64)}


def _heldout(kind: str) -> Builder:
    def build(size: str, device: torch.device) -> tuple[nn.Module, Any]:
        import transformers as tf

        layers, width, heads, seq, batch, vocab = _HELDOUT_SIZES[size]
        torch.manual_seed(0)
        ffn = width * 4
        if kind == "gpt2":
            model: nn.Module = tf.GPT2LMHeadModel(tf.GPT2Config(
                n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=seq,
                bos_token_id=0, eos_token_id=0, use_cache=False))
        elif kind == "llama":
            model = tf.LlamaForCausalLM(tf.LlamaConfig(
                num_hidden_layers=layers, hidden_size=width, intermediate_size=ffn,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                vocab_size=vocab, max_position_embeddings=seq, attention_dropout=0.1,
                use_cache=False))
        elif kind == "bert":
            model = tf.BertForMaskedLM(tf.BertConfig(
                num_hidden_layers=layers, hidden_size=width, intermediate_size=ffn,
                num_attention_heads=heads, vocab_size=vocab, max_position_embeddings=seq))
        elif kind == "qwen2":
            model = tf.Qwen2ForCausalLM(tf.Qwen2Config(
                num_hidden_layers=layers, hidden_size=width, intermediate_size=ffn,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                vocab_size=vocab, max_position_embeddings=seq, attention_dropout=0.1,
                use_cache=False))
        else:  # opt
            model = tf.OPTForCausalLM(tf.OPTConfig(
                num_hidden_layers=layers, hidden_size=width, ffn_dim=ffn,
                num_attention_heads=heads, vocab_size=vocab, max_position_embeddings=seq,
                word_embed_proj_dim=width, use_cache=False))
        return model.to(device).train(), _batch(vocab, seq, batch, device)
    return build


HELDOUT: dict[str, Builder] = {k: _heldout(k) for k in ("gpt2", "llama", "bert", "qwen2", "opt")}
MIN_SLACK = 1.10  # the third budget: 10% above the smallest feasible one


# --- measuring -------------------------------------------------------------------------


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def plain_step_s(model: nn.Module, inputs: Any, device: torch.device, steps: int,
                 warmup: int) -> list[float]:
    """Seconds of ``steps`` plain steps (forward, loss, backward) after ``warmup`` ones,
    gradients set to None before each (CUDA-synchronised on a GPU)."""
    def step() -> None:
        model.zero_grad(set_to_none=True)
        run_step(model, inputs, None)
    for _ in range(warmup):
        step()
    times = [time_ms(step, device) / 1e3 for _ in range(steps)]
    model.zero_grad(set_to_none=True)
    return times


def _cold() -> None:
    """Forget the keep-sets solved so far (NOTE [ Keep-sets solved once per process ]), so
    that the next call pays for its own, as the first call of a process does."""
    keepsets._solved.cache_clear()


def first_use_imports_s() -> float:
    """Seconds to import what the first keep-set a process solves imports (scipy's
    optimize and sparse, NOTE [ scipy on first use ]), before any row: the first profile
    of a process pays them once on top of its row, and the first row would otherwise
    carry them alone (on the H200, 2026-11-30: zoo-gpt2's "selective keep-sets" stage
    x6.9 plain steps against x0.8 for the next model). Reported on its own."""
    start = time.perf_counter()
    import scipy.optimize
    import scipy.sparse  # noqa: F401
    return time.perf_counter() - start


def ops_per_step(model: nn.Module, inputs: Any) -> int:
    """ATen ops one plain step runs (forward, loss, backward): each costs the instruments
    of a memory step their own work, and on CUDA one allocator probe."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            _Count.ops += 1
            return func(*args, **(kwargs or {}))

    model.zero_grad(set_to_none=True)
    with _Count():
        run_step(model, inputs, None)
    model.zero_grad(set_to_none=True)
    return _Count.ops


def probe_us(device: torch.device, reads: int = 2000) -> float | None:
    """Microseconds of one allocator probe around an op (``AllocatorProbe.before`` and
    ``after``: a peak reset and a read of the allocator's statistics), the median of 5
    batches of ``reads``; ``None`` off CUDA, where there is no probe."""
    if device.type != "cuda":
        return None
    from autoremat._measure.memory import AllocatorProbe

    probe = AllocatorProbe(device.index if device.index is not None
                           else torch.cuda.current_device())
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reads):
            probe.before(0)
            probe.after()
        times.append((time.perf_counter() - start) / reads * 1e6)
    probe.close()
    return statistics.median(times)


def cost_row(name: str, build: Builder, size: str, device: torch.device, steps: int,
             warmup: int, rounds: int = 1) -> dict[str, Any]:
    """One model's row: the plain step and what each call costs, in seconds and steps.

    Over ``rounds`` rounds, each the plain steps then every call: a call's cost is the
    median over the rounds of its seconds over that round's plain step (a shared CPU's
    load moves both alike within a round, and by 2x between runs)."""
    model, inputs = build(size, device)
    runs = [_round(model, inputs, build, size, device, steps, warmup if i == 0 else 1)
            for i in range(rounds)]
    plains = [r["plain"] for r in runs]
    calls = {k: {"seconds": statistics.median(r["calls"][k] for r in runs),
                 "plain_steps": statistics.median(r["calls"][k] / r["plain"] for r in runs),
                 "rounds_plain_steps": [r["calls"][k] / r["plain"] for r in runs]}
             for k in runs[0]["calls"]}
    stages = runs[0]["stages"]  # the names, in the order profile reported them
    return {"model": name, "class": type(model).__name__, "blocks": runs[0]["blocks"],
            "ops_per_step": ops_per_step(model, inputs),
            "auto_outcome": runs[0]["outcome"], "rounds": rounds,
            "plain_step_s": statistics.median(plains),
            "plain_step_all_s": [t for r in runs for t in r["times"]],
            "calls": calls,
            # where profile's time goes: each stage it reported (progress=) until the next,
            # the last until it returned (the tape built); the checks before the first
            # stage are left out. Medians over the rounds.
            "profile_stages": [
                {"stage": stage,
                 "seconds": statistics.median(r["stages"].get(stage, 0.0) for r in runs),
                 "plain_steps": statistics.median(r["stages"].get(stage, 0.0) / r["plain"]
                                                  for r in runs)}
                for stage in stages]}


def _round(model: nn.Module, inputs: Any, build: Builder, size: str, device: torch.device,
           steps: int, warmup: int) -> dict[str, Any]:
    """One round of :func:`cost_row`: the plain steps, then each call once, cold."""
    times = plain_step_s(model, inputs, device, steps, warmup)
    calls: dict[str, float] = {}
    tapes: list[autoremat.Tape] = []
    marks: list[tuple[str, float]] = []  # each stage of the profile and its start
    _cold()
    calls["profile"] = _seconds(lambda: tapes.append(autoremat.profile(
        model, inputs, progress=lambda s: marks.append((s, time.perf_counter())))))
    returned = time.perf_counter()  # the last stage ends when profile returns
    ends = [t for _, t in marks[1:]] + [returned] if marks else []
    calls["profile(with_selective=False)"] = _seconds(
        lambda: autoremat.profile(model, inputs, with_selective=False))
    fresh, fresh_inputs = build(size, device)
    _cold()
    outcome = "ok"
    start = time.perf_counter()
    try:
        autoremat.auto(fresh, fresh_inputs, budget="60%")
    except autoremat.BudgetError as exc:  # still a full profile's cost: reported as such
        outcome = f"BudgetError (min {exc.min_feasible_bytes} B)"
    calls["auto@60%"] = time.perf_counter() - start
    return {"plain": statistics.median(times), "times": times, "calls": calls,
            "blocks": len(tapes[0].blocks), "outcome": outcome,
            "stages": {stage: end - begin
                       for (stage, begin), end in zip(marks, ends, strict=True)}}


def heldout_call(name: str, size: str, device: torch.device, budget: int | str,
                 label: str, cold: bool = False) -> dict[str, Any]:
    """``auto`` on a fresh ``HELDOUT[name]`` at ``budget``, timed; a ``BudgetError`` is an
    outcome (it names the smallest feasible budget), not a failure. ``cold``: without the
    keep-sets earlier calls solved."""
    model, inputs = HELDOUT[name](size, device)
    if cold:
        _cold()
    row: dict[str, Any] = {"model": name, "budget": label}
    start = time.perf_counter()
    try:
        plan = autoremat.auto(model, inputs, budget=budget)
    except autoremat.BudgetError as exc:
        row.update(seconds=time.perf_counter() - start, min_feasible_bytes=exc.min_feasible_bytes,
                   outcome=f"BudgetError (min {exc.min_feasible_bytes} B)")
        return row
    row.update(seconds=time.perf_counter() - start, outcome="ok",
               predicted_peak_bytes=plan.predicted_peak_bytes, budget_bytes=plan.budget_bytes,
               recompute_blocks=plan.recompute_blocks)
    return row


def heldout_rows(size: str, device: torch.device, models: Sequence[str],
                 cold: bool = False) -> list[dict[str, Any]]:
    """Every ``auto`` call of the held-out style check, timed (see the module docstring)."""
    rows: list[dict[str, Any]] = []
    for name in models:
        mine = [heldout_call(name, size, device, "90%", "90%", cold),
                heldout_call(name, size, device, "60%", "60%", cold),
                heldout_call(name, size, device, 1, "1 B (finds the minimum)", cold)]
        smallest = mine[-1].get("min_feasible_bytes")
        if smallest:
            mine.append(heldout_call(name, size, device, int(MIN_SLACK * smallest),
                                     f"min x{MIN_SLACK:g}", cold))
        rows += mine
        print(f"  {name}: " + ", ".join(f"{r['budget']} {r['seconds']:.1f} s" for r in mine),
              flush=True)
    return rows


# --- reports ---------------------------------------------------------------------------


def _header(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    return {"schema_version": 1, "device": device_info(device)["device_name"],
            "device_type": device.type, "torch": torch.__version__,
            "autoremat": autoremat.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "threads": torch.get_num_threads(), "size": args.size,
            "load_average": _load(), "load_average_at_start": args.load_at_start}


def _load() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _probe_steps(payload: dict[str, Any], row: dict[str, Any]) -> float:
    """What one probe per op of a step costs, in the row's plain steps."""
    return float(row["ops_per_step"] * payload["probe_us"] / 1e6 / row["plain_step_s"])


def cost_markdown(payload: dict[str, Any]) -> str:
    calls = list(payload["rows"][0]["calls"]) if payload["rows"] else []
    lines = [f"# The cost of knowing ({payload['device']})", "",
             f"`{payload['command']}`; torch {payload['torch']}, {payload['threads']} "
             f"thread(s), {payload['date']}, load average (1, 5, 15 min) at the start "
             f"{payload['load_average_at_start']}, at the end {payload['load_average']}.", "",
             "Each call in wall seconds and (in brackets) as a multiple of the model's plain "
             "step (forward + loss + backward, median of "
             f"{payload['steps']} after {payload['warmup']} warm-up), the medians of "
             f"{payload.get('rounds', 1)} round(s), each the plain steps then every call "
             "(the multiple taken within each round). `auto@60%` runs on a "
             "fresh copy of the model. Each call is cold: the keep-sets an earlier call "
             "solved are forgotten first (NOTE [ Keep-sets solved once per process ]).", "",
             "| model | plain step s | " + " | ".join(calls) + " |",
             "|---|---:|" + "---:|" * len(calls)]
    for r in payload["rows"]:
        cells = [f"{r['calls'][c]['seconds']:.2f} (x{r['calls'][c]['plain_steps']:.1f})"
                 for c in calls]
        lines.append(f"| {r['model']} | {r['plain_step_s']:.3f} | " + " | ".join(cells) + " |")
    lines += [f"- {r['model']}: auto@60% raised {r['auto_outcome']}" for r in payload["rows"]
              if r["auto_outcome"] != "ok"]
    if payload.get("first_use_imports_s") is not None:
        first = payload["rows"][0] if payload["rows"] else None
        steps = f" (x{payload['first_use_imports_s'] / first['plain_step_s']:.1f} " \
            f"{first['model']} plain steps)" if first else ""
        lines += ["", f"Not in the rows: the first profile of a process also imports scipy's "
                  f"optimize and sparse (NOTE [ scipy on first use ]), timed before the "
                  f"rows: {payload['first_use_imports_s']:.2f} s{steps}, once per process."]
    lines += ["", "Ops per plain step (ATen, forward + loss + backward): " + ", ".join(
        f"{r['model']} {r['ops_per_step']:,}" for r in payload["rows"] if "ops_per_step" in r)
        + "."]
    if payload.get("probe_us") is not None:
        lines += ["", f"One allocator probe around an op (a peak reset and a read of the "
                  f"allocator's statistics, NOTE [ Memory a kernel allocates inside an op ]):"
                  f" {payload['probe_us']:.1f} us; per memory step, in plain steps: "
                  + ", ".join(f"{r['model']} x{_probe_steps(payload, r):.2f}"
                              for r in payload["rows"] if "ops_per_step" in r) + "."]
    lines += ["", "Where `profile`'s time goes: each stage it reports (`progress=`), in plain "
              "steps, until the next stage starts (stages one model lacks are blank).", ""]
    names: list[str] = []  # every row's stages, each row's in its order
    for r in payload["rows"]:
        at = 0
        for st in r.get("profile_stages", ()):
            if st["stage"] not in names:
                names.insert(at, st["stage"])
            at = names.index(st["stage"]) + 1
    lines += ["| stage | " + " | ".join(r["model"] for r in payload["rows"]) + " |",
              "|---|" + "---:|" * len(payload["rows"])]
    for name in names:
        cells = [next((f"{st['plain_steps']:.2f}" for st in r.get("profile_stages", ())
                       if st["stage"] == name), "") for r in payload["rows"]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"Total wall time {payload['seconds']:.0f} s."]
    return "\n".join(lines) + "\n"


def heldout_markdown(payload: dict[str, Any]) -> str:
    lines = [f"# Held-out style check: auto on five HF models, three budgets "
             f"({payload['device']})", "",
             f"`{payload['command']}`; torch {payload['torch']}, {payload['threads']} "
             f"thread(s), {payload['date']}, load average (1, 5, 15 min) at the start "
             f"{payload['load_average_at_start']}, at the end {payload['load_average']}.", "",
             "Every call is `autoremat.auto(model, inputs, budget)` on a freshly built model; "
             "`1 B` fails with the `BudgetError` that names the smallest feasible budget, "
             f"and the third budget is {MIN_SLACK:g} x that. " + (
                 "Every call is cold: the keep-sets earlier calls solved are forgotten first "
                 "(`--cold`), as in a process of its own." if payload.get("cold") else
                 "The calls run one after another in one process, as a user's sweep would: "
                 "a call gets the keep-sets an earlier call on the same shapes solved (NOTE "
                 "[ Keep-sets solved once per process ]); `--cold` forgets them first."), "",
             "| model | budget | seconds | outcome | predicted peak | recomputed blocks |",
             "|---|---|---:|---|---:|---:|"]
    for r in payload["rows"]:
        lines.append(f"| {r['model']} | {r['budget']} | {r['seconds']:.2f} | {r['outcome']} | "
                     f"{r.get('predicted_peak_bytes') or ''} | {r.get('recompute_blocks', '')} |")
    lines += ["", f"**Total wall time: {payload['total_s']:.1f} s** "
                  f"(the sum of the calls; the whole run took {payload['seconds']:.1f} s "
                  f"with model building)."]
    return "\n".join(lines) + "\n"


def _write(out: Path, stem: str, payload: dict[str, Any], markdown: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{stem}.json.tmp"
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, out / f"{stem}.json")
    md = out / f"{stem}.md"
    md.write_text(markdown)
    return md


def main(argv: Sequence[str] | None = None) -> Path:
    """Run the benchmark; returns the path of the Markdown report."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", choices=("default", "tiny", "gpu", "launch"),
                        default="default",
                        help="gpu: GPT-2 small's shape at batch 8 x 1024; launch: its 12 "
                             "layers 64 wide, a CPU stand-in for a GPU's short steps (neither "
                             "for --heldout)")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated; default: all of {list(MODELS)} "
                             f"(with --heldout: {list(HELDOUT)})")
    parser.add_argument("--heldout", action="store_true",
                        help="time the held-out style check instead (auto, 5 HF models, "
                             "3 budgets)")
    parser.add_argument("--cold", action="store_true",
                        help="--heldout: every call without the keep-sets earlier calls "
                             "solved (as in a process of its own)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed plain steps (default 7; 3 at --size tiny)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of plain steps then every call; a call's cost is the "
                             "median of its rounds (default 3; 1 at --size tiny)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads (default 1; 0 keeps torch's default)")
    parser.add_argument("--tag", default="", help="added to the file names, e.g. 'before'")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    if args.cold and not args.heldout:
        parser.error("--cold is for --heldout (every call of the cost table runs cold)")
    if args.heldout and args.size not in _HELDOUT_SIZES:
        parser.error(f"--heldout runs at --size {' or '.join(_HELDOUT_SIZES)}, not "
                     f"{args.size!r}")
    args.load_at_start = _load()
    table = HELDOUT if args.heldout else MODELS
    models = args.models.split(",") if args.models else list(table)
    unknown = [m for m in models if m not in table]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(table)}")
    steps = args.steps or (3 if args.size == "tiny" else 7)
    rounds = args.rounds if args.rounds is not None else (1 if args.size == "tiny" else 3)
    if rounds < 1:
        parser.error(f"--rounds must be at least 1, got {rounds}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    command = "python benchmarks/profile_cost.py" + (" --heldout" if args.heldout else "") \
        + (" --cold" if args.cold else "") \
        + f" --size {args.size} --models {','.join(models)} --threads {args.threads}" \
        + ("" if args.heldout else f" --steps {steps} --warmup {args.warmup} --rounds {rounds}")
    start = time.perf_counter()
    suffix = f"_{args.tag}" if args.tag else ""
    if args.heldout:
        rows = heldout_rows(args.size, device, models, args.cold)
        payload = {**_header(args, device), "command": command, "rows": rows,
                   "cold": args.cold,
                   "total_s": sum(r["seconds"] for r in rows),
                   "seconds": time.perf_counter() - start}
        stem = "profile_cost_heldout" + ("_cold" if args.cold else "") + suffix
        md = _write(Path(args.out), stem, payload, heldout_markdown(payload))
    else:
        imports_s = first_use_imports_s()
        probe = probe_us(device)
        rows = []
        for name in models:
            rows.append(cost_row(name, MODELS[name], args.size, device, steps, args.warmup,
                                 rounds))
            r = rows[-1]
            print(f"  {name}: plain {r['plain_step_s']:.3f} s; " + ", ".join(
                f"{k} {v['seconds']:.1f} s (x{v['plain_steps']:.1f})"
                for k, v in r["calls"].items()), flush=True)
        payload = {**_header(args, device), "command": command, "steps": steps,
                   "warmup": args.warmup, "rounds": rounds, "rows": rows,
                   "first_use_imports_s": imports_s, "probe_us": probe,
                   "seconds": time.perf_counter() - start}
        md = _write(Path(args.out), f"profile_cost{suffix}", payload, cost_markdown(payload))
    print(md.read_text())
    return md


if __name__ == "__main__":
    main()
