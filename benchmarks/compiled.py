"""Compiled plans against compile's own options, at a short and a long step (issue 34).

Runs ``autoremat bench <target> --compile --budgets min --compile-fractions 1,0.5`` for
zoo ``gpt2``, zoo ``llama`` and Hugging Face GPT-2 (``autoremat.zoo:hf_gpt2``), each at
two shapes, one thread:

* ``short``: ``n_layer=4,n_embd=128,n_head=4,seq_len=64,batch_size=2`` (steps of a few
  tens of ms, where per-step overhead shows, as on a GPU);
* ``long``: ``n_layer=4,n_embd=256,n_head=4,seq_len=256,batch_size=8``.

Every row of a run is measured in one bench process and its compile subprocesses, each
against an eager plain step interleaved with it (``docs/bench.md``). The summary checks,
per run, the claims of ``gpu_suite.compile_claims``: at each compiled reference's
measured peak (``torch.compile`` at ``activation_memory_budget`` 1 and 0.5, and with a
checkpoint or the Megatron SAC policy per block), autoremat's compiled plan measures at
most that peak (the allocator's reports) and takes at most x1.02 the reference's time;
its smallest compiled plan is at or below ``torch.compile + checkpoint per block``'s peak.
Against a reference whose gradients are not exact (compile re-drawing dropout in backward,
pytorch#190758) a slower plan is reported, not judged: no exact peer runs at its peak.

Run:     PYTHONPATH=src python benchmarks/compiled.py            # CPU, about an hour
Subset:  PYTHONPATH=src python benchmarks/compiled.py --targets gpt2 --shapes short
Again:   PYTHONPATH=src python benchmarks/compiled.py --judge-only   # re-judge, run nothing
Writes ``benchmarks/results/compiled_<device>/<target>-<shape>/`` (bench's own files) and
``benchmarks/results/compiled_<device>/summary.md`` / ``summary.json`` (rewritten after
each run, so a sweep cut short still leaves its summary; a sweep of some runs keeps the
others).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

from gpu_suite import COMPILE_TIME_SLACK, compile_claims

from autoremat._bench.report import device_info, device_slug
from autoremat._core.files import dump_json

TARGETS = {"gpt2": "gpt2", "llama": "llama", "hf-gpt2": "autoremat.zoo:hf_gpt2"}
SHAPES = {
    "short": "n_layer=4,n_embd=128,n_head=4,seq_len=64,batch_size=2",
    "long": "n_layer=4,n_embd=256,n_head=4,seq_len=256,batch_size=8",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help=f"comma-separated, of {', '.join(TARGETS)}")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=11,
                        help="timed rounds of each row (bench's --repeats; default 11: "
                             "rows of identical steps then differ by under 2%%)")
    parser.add_argument("--judge-only", action="store_true",
                        help="run nothing: judge the runs already in --out again and "
                             "rewrite the summary")
    args = parser.parse_args(argv)
    targets, shapes = args.targets.split(","), args.shapes.split(",")
    if args.judge_only:
        targets, shapes = [], []
    unknown = [t for t in targets if t not in TARGETS] + [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown target or shape {unknown}: targets {list(TARGETS)}, shapes "
                     f"{list(SHAPES)}")
    out = args.out or Path(__file__).parent / "results" / f"compiled_{device_slug('cpu')}"
    claims, runs = _earlier(out, targets, shapes)
    for shape in shapes:  # every target's short step first
        for target in targets:
            folder = out / f"{target}-{shape}"
            command = [sys.executable, "-m", "autoremat", "bench", TARGETS[target],
                       "--compile", "--budgets", "min", "--compile-fractions", "1,0.5",
                       "--set", SHAPES[shape], "--repeats", str(args.repeats),
                       "--out", str(folder)]
            print(f"{target} {shape}: {' '.join(command[2:])}", flush=True)
            start = time.perf_counter()
            rc = subprocess.run(command, check=False, capture_output=True, text=True).returncode
            runs.append({"target": target, "shape": shape, "exit": rc,
                         "seconds": round(time.perf_counter() - start, 1)})
            for claim in compile_claims(folder, rc):
                claims.append(dict(dataclasses.asdict(claim), shape=shape))
                print(f"  {claim.status}: {claim.claim}: {claim.figure}", flush=True)
            _write(out, runs, claims, args.repeats)  # after each run: a partial sweep counts
    if args.judge_only:
        _write(out, runs, claims, args.repeats)
    return 0 if all(c["status"] in ("PASS", "MEASURED") for c in claims) else 1


def _earlier(out: Path, targets: list[str], shapes: list[str],
             ) -> tuple[list[dict[str, str]], list[dict[str, object]]]:
    """The runs of an earlier sweep into ``out`` that this one does not run again, and
    their claims, judged again from their results (the summary then covers both)."""
    path = out / "summary.json"
    if not path.exists():
        return [], []
    again = {(t, s) for t in targets for s in shapes}
    runs = [r for r in json.loads(path.read_text())["runs"]
            if (r["target"], r["shape"]) not in again]
    claims = [dict(dataclasses.asdict(claim), shape=r["shape"]) for r in runs
              for claim in compile_claims(out / f"{r['target']}-{r['shape']}", r["exit"])]
    return claims, runs


def _write(out: Path, runs: list[dict[str, object]], claims: list[dict[str, str]],
           repeats: int) -> None:
    passed = sum(c["status"] == "PASS" for c in claims)
    unjudged = sum(c["status"] == "MEASURED" for c in claims)
    lines = [
        "# Compiled plans against compile's own options (benchmarks/compiled.py)", "",
        f"Date: {datetime.date.today()}  ",
        f"Machine: {device_info('cpu')['device_name']}, one torch thread; {repeats} timed "
        f"rounds per row  ",
        f"Time slack: x{COMPILE_TIME_SLACK} the reference's time, the two timed "
        f"interleaved in one process. {passed} of {len(claims)} claims pass"
        + (f"; {unjudged} not judged (the reference's gradients are not exact)"
           if unjudged else "") + ".", "",
        "Each run's table: `<target>-<shape>/results.md`.", "",
        "| shape | claim | figure | status |", "|---|---|---|---|",
        *[f"| {c['shape']} | {c['claim']} | {c['figure']} | {c['status']} |" for c in claims],
        "", "| target | shape | exit | seconds |", "|---|---|---:|---:|",
        *[f"| {r['target']} | {r['shape']} | {r['exit']} | {r['seconds']} |" for r in runs], "",
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text("\n".join(lines))
    dump_json({"runs": runs, "claims": claims}, out / "summary.json")
    print(f"wrote {out / 'summary.md'}")


if __name__ == "__main__":
    sys.exit(main())
