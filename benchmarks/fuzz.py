"""Random models against the peak model: each profiled, its plans applied and measured.

Draws small chains of blocks (residual and plain MLPs, attention, a token mixer,
Conv+BatchNorm/GroupNorm, pools, scales, gated units, in-place ReLUs, frozen blocks,
dropout, a layer shared by blocks, skips held in a list, bf16 autocast), profiles each
and measures, against its prediction, every plan of one multi-block segment, the
single-block combinations of short chains, six random plans of several segments
(single blocks kept, recomputed or selective between them), and ``optimal`` (at the
smallest feasible budget and halfway to the plain peak), ``sqrt``, ``every:2`` and
``selective`` verified (gradients against the plain model's). A plan measured above
its prediction, one over its budget, or gradients that differ are the defects it looks
for; over-predictions are counted. Found 13 defects in three rounds (2026-11-29/30; CHANGELOG).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/fuzz.py run START COUNT LOG [SECONDS]
    python benchmarks/fuzz.py summary LOG

``FUZZ_MAX_BLOCKS=N`` draws chains of 3 to N blocks (default 6: the seeds' models of
the logged rounds; longer chains draw other models from the same seeds).
``FUZZ_MASK=1`` gives 60% of the models a causal mask made before the chain, which
their attention blocks before the first pool take (added to the scores; ``sdpa`` as a
boolean mask).
``FUZZ_DEVICE=cuda`` builds and runs the models on the GPU (a spec's autocast is CUDA's
there): predictions against the tracker's figures with CUDA's rounding and the allocator
probe, as ``profile`` measures there. Not run on a GPU yet (2026-11-30).

``run`` appends one JSON line per model (its spec, seed = model index, and each plan's
predicted and measured peaks) to LOG; ``summary`` counts them. A model's plans and its
spec are enough to rebuild it: ``build(make_spec(seed))``.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import os
import random
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import autoremat
from autoremat._core.decisions import KEEP, RECOMPUTE, Choice
from autoremat._core.errors import BlockError, BudgetError
from autoremat._plan.strategies import smallest_feasible_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _steps import segments_peaks, verified

KINDS = ["mlp", "linear", "linrelu", "attn", "sdpa", "mixer", "convbn", "convgn", "lnlin",
         "pool", "scale", "gated", "frozen", "shared"]


class Block(nn.Module):
    def __init__(self, kind: str, C: int, L: int, drop: bool, shared: nn.Module | None,
                 heads: int) -> None:
        super().__init__()
        self.kind, self.heads = kind, heads
        if kind in ("mlp", "frozen"):
            self.up, self.down = nn.Linear(C, 2 * C), nn.Linear(2 * C, C)
        elif kind == "linear":
            self.lin = nn.Linear(C, C)
        elif kind == "linrelu":
            self.lin, self.act = nn.Linear(C, C), nn.ReLU(inplace=True)
        elif kind in ("attn", "sdpa"):
            self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        elif kind == "mixer":
            self.mix = nn.Linear(L, L)
        elif kind == "convbn":
            self.conv, self.norm = nn.Conv1d(C, C, 3, padding=1), nn.BatchNorm1d(C)
        elif kind == "convgn":
            self.conv, self.norm = nn.Conv1d(C, C, 3, padding=1), nn.GroupNorm(4, C)
        elif kind == "lnlin":
            self.norm, self.lin = nn.LayerNorm(C), nn.Linear(C, C)
        elif kind == "gated":
            self.a, self.b = nn.Linear(C, C), nn.Linear(C, C)
        elif kind == "shared":
            self.lin = shared
        self.drop = nn.Dropout(0.1) if drop else None
        if kind == "frozen":
            self.requires_grad_(False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        k = self.kind
        if k in ("mlp", "frozen"):
            h = torch.relu(self.up(x))
            if self.drop is not None:
                h = self.drop(h)
            return x + self.down(h)
        if k == "linear":
            y = self.lin(x)
        elif k == "linrelu":
            y = self.act(self.lin(x))
        elif k == "attn":
            q, kk, v = self.qkv(x).chunk(3, -1)
            scores = q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
            att = torch.softmax(scores if mask is None else scores + mask, -1)
            y = x + self.proj(att @ v)
        elif k == "sdpa":
            B, L, C = x.shape
            q, kk, v = (t.reshape(B, L, self.heads, C // self.heads).transpose(1, 2)
                        for t in self.qkv(x).chunk(3, -1))
            o = F.scaled_dot_product_attention(
                q, kk, v, attn_mask=None if mask is None else mask == 0)
            y = x + self.proj(o.transpose(1, 2).reshape(B, L, C))
        elif k == "mixer":
            y = x + self.mix(x.transpose(1, 2)).transpose(1, 2)
        elif k in ("convbn", "convgn"):
            y = torch.relu(self.norm(self.conv(x.transpose(1, 2)))).transpose(1, 2)
        elif k == "lnlin":
            y = self.lin(self.norm(x))
        elif k == "pool":
            B, L, C = x.shape
            y = x.view(B, L // 2, 2, C).mean(2)
        elif k == "scale":
            y = x * 0.5
        elif k == "gated":
            y = self.a(x) * torch.sigmoid(self.b(x))
        elif k == "shared":
            y = x + self.lin(x)
        else:
            raise AssertionError(k)
        if self.drop is not None:
            y = self.drop(y)
        return y


class Fuzz(nn.Module):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        C, L = spec["C"], spec["L"]
        stem = spec["stem"]
        self.stem = (nn.Embedding(spec["vocab"], C) if stem == "emb" else
                     nn.Linear(C, C) if stem == "lin" else nn.Identity())
        shared = nn.Linear(C, C) if "shared" in spec["kinds"] else None
        blocks = []
        for kind, drop in zip(spec["kinds"], spec["drops"], strict=True):
            blocks.append(Block(kind, C, L, drop, shared, spec["heads"]))
            if kind == "pool":
                L //= 2
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(C, spec["classes"])
        self.push = {i for i, _ in spec["skips"]}
        self.pop = {j for _, j in spec["skips"]}
        # a causal mask made before the chain, given to the attention blocks before the
        # first pool (FUZZ_MASK)
        pooled = [i for i, k in enumerate(spec["kinds"]) if k == "pool"]
        self.masked = {i for i, k in enumerate(spec["kinds"])
                       if spec.get("mask") and k in ("attn", "sdpa")
                       and (not pooled or i < pooled[0])}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        mask = None
        if self.masked:
            i = torch.arange(x.shape[1], device=x.device)
            mask = (i[None, :] > i[:, None]).float().mul(-1e4)
        skips: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            if i in self.push:
                skips.append(x)
            x = block(x, mask) if i in self.masked else block(x)
            if i in self.pop:
                x = x + skips.pop()
        return self.head(x)


def make_spec(seed: int) -> dict:
    r = random.Random(seed)
    C = r.choice([8, 12, 16, 20, 24, 28, 32])
    B = r.randint(2, 4)
    L = r.choice([4, 6, 8, 10, 12, 16])
    n = r.randint(3, int(os.environ.get("FUZZ_MAX_BLOCKS", "6")))
    kinds, cur = [], L
    for _ in range(n):
        choices = [k for k in KINDS if not (k == "pool" and (cur % 2 or cur < 4))]
        k = r.choice(choices)
        if k == "shared" and kinds.count("shared") >= 2:
            k = "mlp"
        if k == "pool":
            cur //= 2
        kinds.append(k)
    if kinds.count("shared") == 1 and r.random() < 0.7:  # a shared layer from two blocks
        others = [i for i, k in enumerate(kinds) if k != "shared"]
        kinds[r.choice(others)] = "shared"
        # recheck pools' lengths
        cur, ok = L, True
        for k in kinds:
            if k == "pool":
                if cur % 2 or cur < 4:
                    ok = False
                cur //= 2
        if not ok:
            kinds = [("mlp" if k == "pool" else k) for k in kinds]
    drops = [r.random() < 0.15 for _ in kinds]
    # skips: push block i's input, pop after block j (no pool in i..j); non-crossing
    skips: list[tuple[int, int]] = []
    if r.random() < 0.4:
        for _ in range(r.randint(1, 2)):
            i = r.randrange(n)
            j = r.randrange(i, n)
            if any(kinds[t] == "pool" for t in range(i, j + 1)):
                continue
            if any(i == a or j == b for a, b in skips):
                continue
            if all((j < a or i > b) or (a < i and j < b) or (i < a and b < j) for a, b in skips):
                skips.append((i, j))
    # drawn apart, so that the seeds' other fields stay those of the logged rounds
    mask = os.environ.get("FUZZ_MASK") == "1" and random.Random(seed + 104_729).random() < 0.6
    return {"seed": seed, "C": C, "B": B, "L": L, "kinds": kinds, "drops": drops,
            "mask": mask,
            "skips": skips, "stem": r.choice(["emb", "lin", "id"]), "vocab": 11,
            "heads": r.choice([1, 2, 4]), "classes": 5,
            "autocast": r.random() < 0.25, "loss": r.choice(["pow", "ce"]),
            "selective": r.random() < 0.4}


def device() -> torch.device:
    """Where the models run: ``FUZZ_DEVICE`` (default cpu)."""
    return torch.device(os.environ.get("FUZZ_DEVICE", "cpu"))


def build(spec: dict, on: torch.device | None = None):
    on = device() if on is None else on
    torch.manual_seed(spec["seed"])
    model = Fuzz(spec).train().to(on)
    B, L, C = spec["B"], spec["L"], spec["C"]
    if spec["stem"] == "emb":
        x = torch.randint(0, spec["vocab"], (B, L)).to(on)
    else:
        x = torch.randn(B, L, C).to(on)
    Lf = L // (2 ** spec["kinds"].count("pool"))
    labels = torch.randint(0, spec["classes"], (B * Lf,)).to(on)
    if spec["loss"] == "pow":
        def loss_fn(out):
            return out.float().pow(2).mean()
    else:
        def loss_fn(out):
            return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), labels)
    return model, x, loss_fn


MIXED_PLANS = 6  # random multi-segment plans measured per model


def _label(choice: Choice) -> str:
    """A segment's choice as the log writes it: "keep", "recompute", "selective:matmul"."""
    if choice.decision.value == "selective":
        return f"selective:{choice.selective_key}"
    return choice.decision.value


def _mixed_segments(tape: autoremat.Tape, draw: random.Random) -> list[tuple]:
    """A random plan: the chain cut into segments (several blocks only where chained,
    recomputed), each single block kept, recomputed or one of its selective options."""
    n, segments, a = len(tape.blocks), [], 0
    while a < n:
        b = a + 1
        while (b < n and tape.blocks[b].chained and draw.random() < 0.45):
            b += 1
        if b - a > 1:
            segments.append((a, b, RECOMPUTE))
        else:
            options = [KEEP, RECOMPUTE] + [Choice.selective_from_key(key)
                                           for key in tape.blocks[a].selective]
            segments.append((a, b, draw.choice(options)))
        a = b
    return segments


def run_model(spec: dict) -> dict:
    rec: dict = {"spec": spec, "plans": [], "exc": None}
    model, x, loss_fn = build(spec)
    names = [f"blocks.{i}" for i in range(len(spec["kinds"]))]
    ctx = (torch.autocast(x.device.type, dtype=torch.bfloat16) if spec["autocast"]
           else contextlib.nullcontext())
    with ctx:
        try:
            tape = autoremat.profile(model, x, loss_fn=loss_fn, blocks=names, repeats=1,
                                     timing=False, with_selective=spec["selective"],
                                     with_head=False)
        except BlockError as e:
            rec["exc"] = ["BlockError", str(e)[:300]]
            return rec
        except Exception as e:
            rec["exc"] = [type(e).__name__, str(e)[:300], traceback.format_exc()[-1500:]]
            return rec
        n = len(tape.blocks)
        rec["tape_names"] = [b.name for b in tape.blocks]
        rec["chained"] = [b.chained for b in tape.blocks]
        rec["step_peak"] = tape.step_peak_bytes

        def seg(kind, segments):
            entry = {"kind": kind, "segs": [(a, b, _label(c)) for a, b, c in segments]}
            try:
                p, m = segments_peaks(model, x, tape, segments, loss_fn)
                entry.update(pred=p, meas=m)
            except Exception as e:
                entry["exc"] = [type(e).__name__, str(e)[:300]]
            rec["plans"].append(entry)

        # (a) one multi-block segment, the rest all KEEP or all RECOMPUTE
        for a in range(n):
            for b in range(a + 2, n + 1):
                if not all(tape.blocks[j].chained for j in range(a + 1, b)):
                    continue
                for rest in (KEEP, RECOMPUTE):
                    segments = ([(i, i + 1, rest) for i in range(a)] + [(a, b, RECOMPUTE)]
                                + [(i, i + 1, rest) for i in range(b, n)])
                    seg(f"seg/{'K' if rest is KEEP else 'R'}", segments)
        if n <= 4:
            for combo in itertools.product((KEEP, RECOMPUTE), repeat=n):
                seg("single", [(i, i + 1, c) for i, c in enumerate(combo)])

        # (c) random plans of several segments, single blocks kept, recomputed or
        # selective among them
        draw = random.Random(spec["seed"] + 7919)
        for _ in range(MIXED_PLANS if n >= 3 else 0):
            seg("mixed", _mixed_segments(tape, draw))

        # (b) strategies, verified
        try:
            smallest = smallest_feasible_bytes(tape)
        except Exception as e:
            smallest = None
            rec["plans"].append({"kind": "smallest", "exc": [type(e).__name__, str(e)[:300]]})
        jobs = []
        if smallest is not None:
            jobs.append(("optimal@min", smallest, "optimal"))
            jobs.append(("optimal@mid", (smallest + tape.step_peak_bytes) // 2, "optimal"))
        jobs += [("sqrt", None, "sqrt"), ("every:2", None, "every:2")]
        if spec["selective"]:
            jobs.append(("selective", None, "selective"))
        for label, budget, strategy in jobs:
            rec["plans"].append(strategy_entry(model, x, loss_fn, tape, label, budget,
                                               strategy))
    return rec


def strategy_entry(model: nn.Module, x: Any, loss_fn: Any, tape: autoremat.Tape, label: str,
                   budget: int | None, strategy: str) -> dict[str, Any]:
    """The log's entry of ``strategy`` at ``budget`` planned from ``tape``, verified:
    its budget, prediction, decisions, measured peak and gradients, or what it raised."""
    entry: dict[str, Any] = {"kind": label, "budget": budget}
    try:
        plan = autoremat.plan(tape, budget=budget, strategy=strategy)
        entry["budget"] = plan.budget_bytes
        entry["pred"] = plan.predicted_peak_bytes
        entry["decisions"] = [str(b.decision) + (
            f":{b.segment}" if hasattr(b, "segment") else "") for b in plan.blocks]
        rep = verified(model, x, plan, loss_fn=loss_fn, repeats=1)
        entry.update(meas=rep.peak_bytes, ok=rep.ok, grads_equal=rep.grads_equal,
                     max_grad_diff=rep.max_grad_diff)
    except BudgetError as e:
        entry["exc"] = ["BudgetError", str(e)[:200]]
    except Exception as e:
        entry["exc"] = [type(e).__name__, str(e)[:300], traceback.format_exc()[-1500:]]
    return entry


def run(start: int, count: int, log: str, limit: float = 1e9) -> None:
    """Models ``start`` .. ``start + count - 1`` (until ``limit`` seconds), appended to
    ``log``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _run(start, count, log, limit)
    finally:
        torch.set_num_threads(threads)


def _run(start: int, count: int, log: str, limit: float) -> None:
    t0 = time.time()
    for seed in range(start, start + count):
        if time.time() - t0 > limit:
            break
        t = time.time()
        spec = make_spec(seed)
        try:
            rec = run_model(spec)
        except Exception as e:
            rec = {"spec": spec, "plans": [], "exc": ["harness:" + type(e).__name__,
                                                      str(e)[:300],
                                                      traceback.format_exc()[-1500:]]}
        rec["secs"] = round(time.time() - t, 2)
        with open(log, "a") as f:
            f.write(json.dumps(rec) + "\n")


def summary(log: str) -> dict[str, Any]:
    """Counts of ``log``: models, plans, refusals, plans under their predictions (by
    kind, worst bytes and seeds), plans over their budgets, gradient mismatches."""
    out: dict[str, Any] = {"models": 0, "plans": 0, "refused": collections.Counter(),
                           "exact": collections.Counter(), "over_2pct": collections.Counter(),
                           "under": collections.defaultdict(list), "over_budget": [],
                           "grads_differ": []}
    with open(log) as f:
        for line in f:
            rec = json.loads(line)
            out["models"] += 1
            seed = rec["spec"]["seed"]
            if rec["exc"]:
                out["refused"][f"{rec['exc'][0]}: {rec['exc'][1][:60]}"] += 1
                continue
            for p in rec["plans"]:
                if "pred" not in p or "meas" not in p:
                    continue
                out["plans"] += 1
                d = p["meas"] - p["pred"]
                if d > 0:
                    out["under"][p["kind"]].append((d, seed))
                elif d == 0:
                    out["exact"][p["kind"]] += 1
                elif -d > 0.02 * p["meas"]:
                    out["over_2pct"][p["kind"]] += 1
                if p.get("budget") is not None and p["meas"] > p["budget"]:
                    out["over_budget"].append((p["meas"] - p["budget"], seed, p["kind"]))
                if "grads_equal" in p and not p["grads_equal"]:
                    out["grads_differ"].append((seed, p["kind"]))
    return out


def main() -> None:
    if len(sys.argv) >= 5 and sys.argv[1] == "run":
        run(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
            float(sys.argv[5]) if len(sys.argv) > 5 else 1e9)
    elif len(sys.argv) == 3 and sys.argv[1] == "summary":
        found = summary(sys.argv[2])
        for key in ("models", "plans", "refused", "exact", "over_2pct"):
            print(key, found[key] if isinstance(found[key], int) else dict(found[key]))
        for kind, rows in found["under"].items():
            print("under", kind, len(rows), "worst", max(rows),
                  "seeds", sorted({s for _, s in rows})[:20])
        print("over budget", len(found["over_budget"]), sorted(found["over_budget"])[-10:])
        print("gradients differ", found["grads_differ"])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
