"""Held-out models against the peak model: each profiled as discovery finds it, its plans
applied and measured.

For any model (a library's, with the loss its loop takes): one step first (what a first
forward builds, built), ``profile`` with default block discovery, then every plan of one
segment of up to ``max_segment`` blocks (the rest kept, then the rest recomputed), each
block recomputed alone, ``mixed`` random plans of several segments (single blocks kept,
recomputed or selective between them), and ``optimal`` at the smallest feasible budget
and halfway to the plain peak, ``sqrt``, ``every:2``, ``selective`` and ``full``, judged
by ``verify`` (gradients against the plain model's). A plan measured above its
prediction, one over its budget, gradients that differ and a profile that fails are what
it looks for. The thirty-second session ran it on x-transformers and vit-pytorch
(CHANGELOG; its fixes came from there).

    PYTHONPATH=src python benchmarks/heldout.py x-transformers LOG [CONFIG[:bf16] ...]
    PYTHONPATH=src python benchmarks/heldout.py builders FILE LOG [NAME[:bf16] ...]
    python benchmarks/heldout.py summary LOG

``x-transformers`` builds its decoders, encoders and wrappers in the configurations of
:data:`X_CONFIGS` (the library installed: ``pip install x-transformers``); ``builders``
imports ``FILE``, a Python file whose ``BUILDERS`` maps a name to a function returning
``(model, inputs, loss_fn)``, and checks each. Set ``PYTHONHASHSEED`` for the same random
plans from run to run. ``run`` appends one JSON line per model to LOG.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import random
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import autoremat
from autoremat._core.decisions import KEEP, RECOMPUTE
from autoremat._core.step import run_step
from autoremat._plan.strategies import smallest_feasible_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fuzz import _label, _mixed_segments, strategy_entry

from _steps import segments_peaks

STRATEGIES = (("sqrt", "sqrt"), ("every:2", "every:2"), ("selective", "selective"),
              ("full", "full"))


def check(name: str, model: torch.nn.Module, inputs: Any, loss_fn: Callable | None = None,
          *, bf16: bool = False, max_segment: int = 4, mixed: int = 8) -> dict[str, Any]:
    """``name``'s record: its blocks and plain peak, and each plan's predicted and
    measured peaks (``"exc"`` where profile or a plan raised)."""
    rec: dict[str, Any] = {"name": name, "bf16": bf16, "plans": []}
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    start = time.time()
    with ctx:
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                tape = autoremat.profile(model, inputs, loss_fn=loss_fn)
            rec["warnings"] = [str(w.message)[:200] for w in seen]
        except Exception as e:  # recorded: a failure is what the check looks for
            rec["exc"] = [type(e).__name__, str(e)[:600]]
            return rec
        run_step(model, inputs, loss_fn)  # what a first step builds, built
        model.zero_grad(set_to_none=True)
        n = len(tape.blocks)
        rec["blocks"] = [b.name for b in tape.blocks]
        rec["step_peak"] = tape.step_peak_bytes

        def measure(kind: str, segments: list[tuple]) -> None:
            entry: dict[str, Any] = {"kind": kind,
                                     "segs": [(a, b, _label(c)) for a, b, c in segments]}
            try:
                entry["pred"], entry["meas"] = segments_peaks(model, inputs, tape, segments,
                                                              loss_fn)
            except Exception as e:
                entry["exc"] = [type(e).__name__, str(e)[:300]]
            rec["plans"].append(entry)

        for a in range(n):
            for b in range(a + 2, min(n, a + max_segment) + 1):
                if all(tape.blocks[j].chained for j in range(a + 1, b)):
                    for rest in (KEEP, RECOMPUTE):
                        measure(f"seg/{'K' if rest is KEEP else 'R'}",
                                [(i, i + 1, rest) for i in range(a)] + [(a, b, RECOMPUTE)]
                                + [(i, i + 1, rest) for i in range(b, n)])
        for i in range(n):
            measure("one", [(j, j + 1, RECOMPUTE if j == i else KEEP) for j in range(n)])
        draw = random.Random(zlib.crc32(name.encode()))
        for _ in range(mixed if n >= 3 else 0):
            measure("mixed", _mixed_segments(tape, draw))
        jobs: list[tuple[str, int | None, str]] = []
        try:
            least = smallest_feasible_bytes(tape)
            jobs += [("optimal@min", least, "optimal"),
                     ("optimal@mid", (least + tape.step_peak_bytes) // 2, "optimal")]
        except Exception as e:
            rec["plans"].append({"kind": "smallest", "exc": [type(e).__name__, str(e)[:300]]})
        jobs += [(label, None, strategy) for label, strategy in STRATEGIES]
        for label, budget, strategy in jobs:
            rec["plans"].append(strategy_entry(model, inputs, loss_fn, tape, label, budget,
                                               strategy))
    rec["seconds"] = time.time() - start
    return rec


def verdict(rec: dict[str, Any]) -> dict[str, Any]:
    """What a record found: plans to the byte, over and under their predictions (the
    worst of each as a fraction), over their budgets, with gradients that differ, and
    the plans that raised (a budget too small is no failure)."""
    plans = [p for p in rec["plans"] if "pred" in p and "meas" in p]
    under = [p for p in plans if p["meas"] > p["pred"]]
    over = [p for p in plans if p["meas"] < p["pred"]]
    return {
        "plans": len(plans), "exact": len(plans) - len(under) - len(over),
        "over": len(over), "worst_over": max(((p["pred"] - p["meas"]) / p["meas"]
                                              for p in over), default=0.0),
        "under": len(under), "worst_under": max(((p["meas"] - p["pred"]) / p["pred"]
                                                 for p in under), default=0.0),
        "over_budget": sum(1 for p in plans if p.get("budget") and p["meas"] > p["budget"]),
        "differ": sum(1 for p in plans if p.get("grads_equal") is False),
        "raised": sum(1 for p in rec["plans"] if "exc" in p and p["exc"][0] != "BudgetError"),
        "profile": None if "exc" not in rec else rec["exc"][0],
    }


# x-transformers' attention-layer options by configuration (decoders unless "enc_")
X_CONFIGS: dict[str, dict[str, Any]] = {
    "base": {}, "rotary_flash_glu": {"rotary_pos_emb": True, "attn_flash": True,
                                     "ff_glu": True},
    "macaron_sandwich": {"macaron": True, "sandwich_norm": True},
    "residual_attn": {"residual_attn": True}, "value_residual": {"add_value_residual": True},
    "hyper": {"num_residual_streams": 4}, "rms_gate": {"use_rmsnorm": True,
                                                       "gate_residual": True},
    "shift_alibi": {"shift_tokens": 1, "alibi_pos_bias": True, "alibi_num_heads": 2},
    "layerdrop": {"layer_dropout": 0.2}, "dropout": {"attn_dropout": 0.1, "ff_dropout": 0.1},
    "postnorm": {"pre_norm": False}, "enc_base": {},
}


def x_transformers(config: str) -> tuple[torch.nn.Module, Any, Callable]:
    """An x-transformers model of :data:`X_CONFIGS` (256 tokens, 64 positions, width 64,
    four layers, batch 2), its token ids and a cross-entropy loss."""
    try:
        from x_transformers import Decoder, Encoder, TransformerWrapper
    except ImportError as e:
        raise SystemExit(f"x-transformers is not installed ({e}): pip install "
                         "x-transformers") from e
    if config not in X_CONFIGS:
        raise SystemExit(f"no x-transformers configuration {config!r}: one of "
                         f"{sorted(X_CONFIGS)}")
    torch.manual_seed(0)
    layers = Encoder if config.startswith("enc_") else Decoder
    model = TransformerWrapper(num_tokens=256, max_seq_len=64, attn_layers=layers(
        dim=64, depth=4, heads=4, **X_CONFIGS[config]))
    ids, targets = torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64))
    return model, ids, lambda out: F.cross_entropy(out.reshape(-1, 256), targets.reshape(-1))


def _builders(path: str) -> dict[str, Callable[[], tuple[Any, Any, Any]]]:
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = getattr(module, "BUILDERS", None)
    if not isinstance(found, dict):
        raise SystemExit(f"{path} has no BUILDERS dict (name -> function returning "
                         "(model, inputs, loss_fn))")
    return found


def summary(log: str) -> dict[str, Any]:
    """Totals over LOG's records, and each model's verdict where it found something."""
    totals: dict[str, Any] = {"models": 0, "refused": {}, "plans": 0, "exact": 0,
                              "over": 0, "under": 0, "over_budget": 0, "differ": 0,
                              "raised": 0, "found": {}}
    for line in Path(log).read_text().splitlines():
        rec = json.loads(line)
        found = verdict(rec)
        totals["models"] += 1
        if found["profile"] is not None:
            totals["refused"][rec["name"]] = rec["exc"][1][:120]
            continue
        for key in ("plans", "exact", "over", "under", "over_budget", "differ", "raised"):
            totals[key] += found[key]
        if found["under"] or found["over_budget"] or found["differ"] or found["raised"]:
            totals["found"][rec["name"] + (" bf16" if rec["bf16"] else "")] = found
    return totals


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["summary"] and len(args) == 2:
        print(json.dumps(summary(args[1]), indent=1))
        return
    if args[:1] == ["x-transformers"] and len(args) >= 2:
        log, names = args[1], args[2:] or list(X_CONFIGS)
        build: Callable[[str], tuple[Any, Any, Any]] = x_transformers
    elif args[:1] == ["builders"] and len(args) >= 3:
        builders = _builders(args[1])
        log, names = args[2], args[3:] or list(builders)
        build = lambda key: builders[key]()  # noqa: E731
    else:
        raise SystemExit(__doc__)
    for name in names:
        key, _, dtype = name.partition(":")
        model, inputs, loss_fn = build(key)
        rec = check(key, model, inputs, loss_fn, bf16=dtype == "bf16")
        with open(log, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(name, verdict(rec), flush=True)


if __name__ == "__main__":
    main()
