"""Misuse sweep (issue 26): what a new user tries, and what autoremat does with it.

One command runs a table of misuse and ordinary-workflow cases, none of them repeated
from ``tests/test_validation.py`` or ``tests/test_misuse.py``, across the public API and
the command line, on small models (the zoo at tiny sizes, small Hugging Face models
built from their config classes with random weights, and plain ``nn.Module`` chains
written here). Each case is classified by what happened:

=========  ==============================================================================
ok         it worked and the result is right (checked: e.g. gradients ``torch.equal`` to
           the plain model's and the measured peak <= the prediction where a plan ran)
refused    a ``RematError`` (or, from the CLI, exit 2 with a one-line error) whose message
           names the problem (each case lists the words it must hold)
warned     an autoremat warning, and the result still right (or the warning says why not)
silent     a wrong result, or an input ignored, with no error or warning
raw        any other exception, a RematError that does not name the problem, or a
           traceback from the CLI
=========  ==============================================================================

Every judgement comes from a check that can fail: a case's ``run`` raises :class:`Wrong`
when its result is wrong.

Usage (from the repository root)::

    PYTHONPATH=src python benchmarks/misuse_sweep.py                # all, writes results
    PYTHONPATH=src python benchmarks/misuse_sweep.py --quick        # the CI subset, no files
    PYTHONPATH=src python benchmarks/misuse_sweep.py --only CLI,plan-files

Writes ``benchmarks/results/misuse_sweep.md`` and ``.json`` (``--out`` to choose).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import io
import json
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import nn

import autoremat
from autoremat import Plan, RematError, Tape, zoo
from autoremat._cli import main as cli_main
from autoremat._core.step import call_model, default_loss

SCHEMA_VERSION = 1
OUTCOMES = ("ok", "refused", "warned", "silent", "raw")
ROOT = Path(__file__).resolve().parents[1]


class Wrong(Exception):
    """A case's check failed: the result is wrong (or an input was ignored)."""


@dataclass(frozen=True)
class Case:
    """One thing a user tries. ``run`` raises :class:`Wrong` when the result is wrong;
    a refusal or warning counts only if its message holds every one of ``names``."""

    cls: str
    name: str
    run: Callable[[], object]
    names: tuple[str, ...] = ()
    quick: bool = False  # in the CI subset (no profile, well under a second)
    note: str = ""


@dataclass(frozen=True)
class Result:
    cls: str
    name: str
    outcome: str
    detail: str
    seconds: float
    note: str = ""


# --- models -----------------------------------------------------------------------------------

W = 32  # width of the hand-written models
B = 128  # their batch: activations well above the gradients, so budgets of 50-80% fit


class Block(nn.Module):
    """``x + Dropout(GELU(Linear(x)))``: something to save and a random draw."""

    def __init__(self, width: int = W) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(nn.functional.gelu(self.fc(x)))  # (B, W)


class Net(nn.Module):
    """An input projection, ``n`` blocks in a ModuleList, a head; returns logits."""

    def __init__(self, n: int = 4, width: int = W, block: Callable[[], nn.Module] = Block
                 ) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(block() for _ in range(n))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # (B, 4)


def net(n: int = 4, seed: int = 0, **kw: Any) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return Net(n, **kw), torch.randn(B, W)


def tiny_gpt2() -> tuple[nn.Module, Any]:
    return zoo.build("gpt2", n_layer=2, batch_size=4, seq_len=32, n_embd=32, n_head=2,
                     vocab_size=64)


def tiny_mlp() -> tuple[nn.Module, Any]:
    return zoo.build("mlp", widths=(32, 32, 32), d_in=32, batch_size=128)


_TAPES: dict[str, Tape] = {}


def quick_profile(model: nn.Module, inputs: Any, **kw: Any) -> Tape:
    return autoremat.profile(model, inputs, **{"repeats": 1, "timing": False,
                                               "with_selective": False, **kw})


def net_tape(n: int = 4) -> Tape:
    """The tape of ``net(n)`` (profiled once per process)."""
    key = f"net{n}"
    if key not in _TAPES:
        _TAPES[key] = quick_profile(*net(n))
    return _TAPES[key]


# --- checks -----------------------------------------------------------------------------------


def _zero(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def step(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None,
         seed: int = 0) -> tuple[dict[str, torch.Tensor | None], int]:
    """One training step holding the output through backward: gradients and peak."""
    _zero(model)
    torch.manual_seed(seed)
    with autoremat.track_memory() as mem:
        out = call_model(model, inputs)
        (loss_fn or default_loss)(out).backward()
        del out
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    _zero(model)
    return grads, mem.peak_bytes


def same_grads(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> None:
    if a.keys() != b.keys():
        raise Wrong("the parameters differ")
    if all(g is None for g in a.values()):
        raise Wrong("the plain step computed no gradient")
    differ = [n for n in a if (a[n] is None) != (b[n] is None)
              or (a[n] is not None and not torch.equal(a[n], b[n]))]
    if differ:
        raise Wrong(f"gradients differ from the plain model's: {differ[:3]}")


def planned_step_right(model: nn.Module, inputs: Any, chosen: Plan,
                       loss_fn: Callable[[Any], torch.Tensor] | None = None,
                       after: Callable[[nn.Module], None] | None = None,
                       check_peak: bool = True) -> None:
    """Apply ``chosen`` (after a plain step), optionally change the model (``after``, to
    both copies), and check gradients equal and peak <= the prediction."""
    plain_model = copy.deepcopy(model)
    if after is not None:
        after(plain_model)
    plain, _ = step(plain_model, inputs, loss_fn)
    autoremat.apply(model, chosen)
    if after is not None:
        after(model)
    got, peak = step(model, inputs, loss_fn)
    same_grads(plain, got)
    if check_peak and peak > chosen.predicted_peak_bytes:
        raise Wrong(f"measured peak {peak} B is above the prediction "
                    f"{chosen.predicted_peak_bytes} B")


def expect(condition: bool, why: str) -> None:
    if not condition:
        raise Wrong(why)


# --- the command line -------------------------------------------------------------------------


class CLIRefusal(RematError):
    """The CLI exited 2 with a short error and no traceback."""


class CLIRaw(Exception):
    """The CLI printed a traceback, or an error of more than one line."""


def cli(argv: Sequence[str], cwd: str | None = None, codes: tuple[int, ...] = (0,)) -> str:
    """Run ``autoremat ARGV`` in this process: its output when it exits 0; a
    :class:`CLIRefusal` for exit 2 with one error line (argparse's usage lines
    allowed), :class:`CLIRaw` for a traceback, :class:`Wrong` for any other exit code."""
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    try:
        if cwd:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli_main(list(argv))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(old)
    text = out.getvalue() + err.getvalue()
    if "Traceback" in text:
        raise CLIRaw(text[-400:])
    if code == 2:
        lines = [line for line in text.splitlines()
                 if line.strip() and not line.startswith(("usage:", " "))]
        if len(lines) != 1:
            raise CLIRaw(f"exit 2 with {len(lines)} lines: {text[:300]}")
        raise CLIRefusal(lines[0])
    if code not in codes:
        raise Wrong(f"exit {code}: {text[-300:]}")
    return text


# --- the harness ------------------------------------------------------------------------------


def _ours(w: warnings.WarningMessage) -> bool:
    return (type(w.message).__module__.startswith("autoremat")
            or "autoremat" in str(w.message) or "autoremat" in str(w.filename))


# The sweep's little models return logits, and most cases profile them without loss_fn,
# which profile warns about (the default sum over a batch of outputs): a fact of the
# sweep's setup, not of the case, so it counts only for the cases about the loss.
_SETUP_WARNING = "returns a batch of outputs, not a loss"


def classify(case: Case) -> Result:
    start = time.perf_counter()
    outcome, detail = "ok", ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.random.fork_rng():
                case.run()
        except Wrong as exc:
            outcome, detail = "silent", f"wrong: {exc}"
        except RematError as exc:
            message = str(exc)
            missing = [n for n in case.names if n not in message]
            outcome = "raw" if missing else "refused"
            detail = (f"message lacks {missing}: " if missing else "") + message
        except Exception as exc:
            outcome, detail = "raw", f"{type(exc).__name__}: {exc}"
        ours = [str(w.message) for w in caught if _ours(w)
                and (_SETUP_WARNING not in str(w.message) or "loss" in case.names)]
    if ours and outcome in ("ok", "silent"):
        detail = (detail + "; " if detail else "") + "warned: " + ours[0]
        outcome = "warned"
    detail = " ".join(detail.split())
    return Result(case.cls, case.name, outcome, detail[:400], time.perf_counter() - start,
                  case.note)


def run_cases(cases: Sequence[Case], verbose: bool = True) -> list[Result]:
    results = []
    for case in cases:
        result = classify(case)
        results.append(result)
        if verbose:
            print(f"{result.outcome:8} {result.seconds:5.1f}s  {case.cls}: {case.name}"
                  + (f"  -- {result.detail[:160]}" if result.outcome in ("silent", "raw")
                     else ""), flush=True)
    return results


# --- cases: arguments -------------------------------------------------------------------------


def _arguments() -> list[Case]:
    c: list[Case] = []

    def add(name: str, run: Callable[[], object], *names: str, quick: bool = False,
            note: str = "") -> None:
        c.append(Case("arguments", name, run, tuple(names), quick, note))

    add("profile repeats=0", lambda: autoremat.profile(*net(), repeats=0), "repeats",
        quick=True)
    add("profile repeats=2.5", lambda: autoremat.profile(*net(), repeats=2.5), "repeats",
        quick=True)
    add("profile blocks=[] (empty list)", lambda: autoremat.profile(*net(), blocks=[]),
        "blocks", quick=True)
    add("profile blocks=predicate matching nothing",
        lambda: autoremat.profile(*net(), blocks=lambda n, m: False), "block")
    add("profile blocks naming one block twice",
        lambda: autoremat.profile(*net(), blocks=["blocks.0", "blocks.0"]), "blocks.0",
        quick=True)
    add("profile loop='loss-only' (typo)", lambda: autoremat.profile(*net(), loop="loss-only"),
        "loss_only", quick=True)
    add("profile rounding='tpu'", lambda: autoremat.profile(*net(), rounding="tpu"),
        "rounding", quick=True)
    add("profile compile='no_such_backend'",
        lambda: autoremat.profile(*net(), compile="no_such_backend"), "no_such_backend")
    add("profile device=[3] (a list)", lambda: autoremat.profile(*net(), device=[3]), "device",
        quick=True)
    add("profile with_head='yes'", lambda: autoremat.profile(*net(), with_head="yes"),
        "with_head", quick=True)

    def detached_loss() -> None:
        autoremat.profile(*net(), loss_fn=lambda out: out.detach().sum())
    add("profile loss_fn returning a detached loss", detached_loss, "loss")

    def python_float_loss() -> None:
        autoremat.profile(*net(), loss_fn=lambda out: float(out.sum()))
    add("profile loss_fn returning a Python float", python_float_loss, "loss_fn", quick=True)

    def list_inputs() -> None:
        model, x = net()
        tape = quick_profile(model, [x])  # a list of positional args, like a tuple
        expect(len(tape.blocks) == 4, f"found {len(tape.blocks)} blocks")
    add("profile inputs as a list of tensors", list_inputs)

    def tuple_blocks() -> None:
        tape = quick_profile(*net(), blocks=("blocks.0", "blocks.1"))
        expect([b.name for b in tape.blocks] == ["blocks.0", "blocks.1"],
               str([b.name for b in tape.blocks]))
    add("profile blocks as a tuple of names", tuple_blocks)

    def reversed_blocks() -> None:
        tape = quick_profile(*net(), blocks=["blocks.1", "blocks.0"])
        expect([b.name for b in tape.blocks] == ["blocks.0", "blocks.1"],
               f"blocks in the order given, not run: {[b.name for b in tape.blocks]}")
    add("profile blocks listed out of order", reversed_blocks, "order")

    tape = net_tape

    add("plan budget='50 %' (a space)", lambda: _budget_ok(tape(), "50 %"))
    add("plan budget='2 KiB'", lambda: _budget_ok(tape(), "2 KiB"), "budget")
    add("plan budget='6gib' (lower case)", lambda: _budget_ok(tape(), "6gib", want=6 * 2**30))
    add("plan budget='6G' (no B, read as GiB)", lambda: _budget_ok(tape(), "6G", want=6 * 2**30))
    add("plan budget=0", lambda: autoremat.plan(tape(), 0), "budget")
    add("plan budget=1.5 (fractional bytes)", lambda: autoremat.plan(tape(), 1.5), "budget")
    add("plan budget=0.5 (a fraction meant as 50%)", lambda: _budget_ok(tape(), 0.5),
        "budget")
    add("plan budget='150%'", lambda: _budget_ok(tape(), "150%"))
    add("plan strategy='Optimal' (capitals)", lambda: autoremat.plan(tape(), "50%", "Optimal"),
        "Optimal")
    add("plan strategy='every:1.5'", lambda: autoremat.plan(tape(), None, "every:1.5"),
        "every")
    add("plan strategy='full' with a budget below it",
        lambda: _fits_or_refused(tape(), "1%", "full"), "budget")
    add("plan strategy='none' with a budget below the plain peak",
        lambda: _fits_or_refused(tape(), "50%", "none"), "budget")
    add("plan strategy='sqrt' with a budget it meets",
        lambda: _fits_or_refused(tape(), "99%", "sqrt"))
    add("plan head='auto' on a model without a loss head",
        lambda: _budget_ok(tape(), "60%", head="auto"))
    add("plan max_memory='1KiB'", lambda: autoremat.plan(tape(), max_memory="1KiB"),
        "max_memory")
    add("plan shards=2.0", lambda: autoremat.plan(tape(), "60%", shards=2.0), "shards")
    add("plan offload_dtype without offload",
        lambda: autoremat.plan(tape(), "60%", offload_dtype="bfloat16"), "offload")
    add("plan(budget, tape) arguments swapped", lambda: autoremat.plan("50%", tape()),
        "Tape", quick=True)
    add("apply(plan, model) arguments swapped",
        lambda: autoremat.apply(autoremat.plan(tape(), None, "full"), net()[0]), "Plan")
    add("apply(model, tape) a Tape for a Plan",
        lambda: autoremat.apply(net()[0], tape()), "Plan")
    add("apply rank_timeout_s=0",
        lambda: autoremat.apply(net()[0], autoremat.plan(tape(), None, "full"),
                                rank_timeout_s=0), "rank_timeout_s")
    add("verify repeats=0", lambda: _verify_repeats(0), "repeats")
    add("auto strategy='none' with a budget",
        lambda: autoremat.auto(*net(), budget="50%", strategy="none"), "budget")
    add("auto budget='200%'", lambda: _auto_ok("200%"), "budget")
    def fp16() -> None:
        half = autoremat.estimate(*net(), device="cpu", dtype="fp16", selective=False)
        full = autoremat.estimate(*net(), device="cpu", selective=False)
        expect(half.step_peak_bytes < 0.6 * full.step_peak_bytes,
               f"fp16 {half.step_peak_bytes} B against fp32 {full.step_peak_bytes} B")
    add("estimate dtype='fp16'", fp16, "fp16")
    add("estimate dtype='int8'",
        lambda: autoremat.estimate(*net(), device="cpu", dtype="int8"), "int8", quick=True)
    add("estimate loop='bogus'",
        lambda: autoremat.estimate(*net(), device="cpu", loop="bogus"), "bogus", quick=True)
    add("estimate budget and max_memory both", lambda: _estimate_both(), "max_memory")
    add("doctor memory='lots'", lambda: autoremat.doctor(*net(), memory="lots", device="cpu"),
        "lots", quick=True)
    add("doctor memory=0", lambda: autoremat.doctor(*net(), memory=0, device="cpu"),
        "memory", quick=True)
    add("doctor optimizer='adamww'",
        lambda: autoremat.doctor(*net(), device="cpu", optimizer="adamww"), "adamww",
        quick=True)
    add("remove() of a model never applied", lambda: _remove_plain())
    add("broadcast_plan(None) in one process",
        lambda: autoremat.distributed.broadcast_plan(None), "Plan", quick=True)
    add("broadcast_plan(plan) in one process", lambda: expect(
        autoremat.distributed.broadcast_plan(p := autoremat.plan(tape(), None, "full")) is p,
        "another plan came back"))
    return c


def _budget_ok(tape: Tape, budget: Any, want: int | None = None, **kw: Any) -> None:
    chosen = autoremat.plan(tape, budget, **kw)
    if want is not None:
        expect(chosen.budget_bytes == want, f"{budget!r} read as {chosen.budget_bytes} B")
    expect(chosen.budget_bytes is not None and chosen.predicted_peak_bytes <= chosen.budget_bytes,
           f"predicted {chosen.predicted_peak_bytes} over budget {chosen.budget_bytes}")
    if isinstance(budget, str) and budget.strip().endswith("%"):
        want = int(tape.step_peak_bytes * float(budget.strip()[:-1].strip()) / 100)
        expect(abs(chosen.budget_bytes - want) <= 1,
               f"budget {budget!r} read as {chosen.budget_bytes} B, not {want}")
    if isinstance(budget, float) and budget < 1:
        raise Wrong(f"budget {budget} read as {chosen.budget_bytes} bytes")


def _fits_or_refused(tape: Tape, budget: str, strategy: str) -> None:
    chosen = autoremat.plan(tape, budget, strategy)
    expect(chosen.budget_bytes is not None
           and chosen.predicted_peak_bytes <= chosen.budget_bytes,
           f"{strategy} plan predicts {chosen.predicted_peak_bytes} B over the budget "
           f"{chosen.budget_bytes} B, and no error")


def _verify_repeats(repeats: int) -> None:
    model, x = net()
    autoremat.apply(model, autoremat.plan(net_tape(), None, "full"))
    autoremat.verify(model, x, repeats=repeats)


def _auto_ok(budget: str) -> None:
    model, x = net()
    chosen = autoremat.auto(model, x, budget=budget)
    expect(chosen.budget_bytes is not None and chosen.predicted_peak_bytes <= chosen.budget_bytes,
           "over budget")


def _estimate_both() -> None:
    est = autoremat.estimate(*net(), device="cpu", budget="50%", max_memory="1GiB",
                             selective=False)
    expect(est.plan is not None, "no plan")


def _remove_plain() -> None:
    model, _x = net()
    expect(autoremat.remove(model) is model, "remove did not return the model")
    expect(not any("forward" in vars(m) for m in model.modules()), "remove installed a forward")


# --- cases: models ----------------------------------------------------------------------------


class DictOut(Net):
    """Returns a dict {'logits', 'loss'} (a common hand-written model)."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        logits = super().forward(x)
        return {"logits": logits, "loss": logits.pow(2).mean()}


class TupleOut(Net):
    """Returns ``(loss, logits)``, loss first as HF's ``return_dict=False`` does."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        logits = super().forward(x)
        return logits.pow(2).mean(), logits


class _Stack(nn.Module):
    """An input projection, then the blocks ``_chain`` gives, in order; returns the hidden
    states. The cases below differ only in how they hold their blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(W, W)

    def _chain(self) -> Iterable[nn.Module]:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self._chain():
            h = b(h)
        return h


class SharedBlock(_Stack):
    """One block module run at every position (weights shared by reuse)."""

    def __init__(self) -> None:
        super().__init__()
        block = Block()
        self.blocks = nn.ModuleList([block, block, block])

    def _chain(self) -> Iterable[nn.Module]:
        return self.blocks


class TiedBlocks(Net):
    """Blocks 0 and 2 share their Linear weight (tied parameters, distinct modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[2].fc.weight = self.blocks[0].fc.weight


class DictBlocks(_Stack):
    """Blocks in an nn.ModuleDict keyed by position (``'layer0'``, ...; torchtitan's
    ``'0'``, ...), or by ``keys`` that name parts."""

    def __init__(self, keys: Iterable[str] = tuple(f"layer{i}" for i in range(4))) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({key: Block() for key in keys})

    def _chain(self) -> Iterable[nn.Module]:
        return self.blocks.values()


class ListBlocks(_Stack):
    """Blocks kept in a plain Python list: not registered as submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = [Block() for _ in range(3)]

    def _chain(self) -> Iterable[nn.Module]:
        return self.layers


class BNBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)
        self.bn = nn.BatchNorm1d(W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(self.fc(x)))


class TwoInputBlock(Block):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x) * mask


class MaskNet(Net):
    """Blocks take ``(h, mask)``; the model takes ``x`` and ``mask`` as keywords."""

    def __init__(self) -> None:
        super().__init__(block=TwoInputBlock)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,  # type: ignore[override]
                scale: float = 1.0) -> torch.Tensor:
        h = self.embed(x) * scale
        for block in self.blocks:
            h = block(h, mask)
        return self.head(h)


class TupleBlock(Block):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        y = super().forward(x)
        return y, y.pow(2).mean()


class AuxNet(Net):
    """Blocks return ``(h, aux)``; the loss adds the auxiliary terms (MoE style)."""

    def __init__(self) -> None:
        super().__init__(block=TupleBlock)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, aux = self.embed(x), x.new_zeros(())
        for block in self.blocks:
            h, a = block(h)
            aux = aux + a
        return self.head(h).pow(2).mean() + 0.1 * aux


class NoParamBlock(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x) * 2 + x


class LoRALinear(nn.Module):
    """A frozen base and a trainable low-rank adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(W, W)
        self.base.requires_grad_(False)
        self.a = nn.Linear(W, 2, bias=False)
        self.b = nn.Linear(2, W, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.base(x) + self.b(self.a(x)))


class EmbedNet(nn.Module):
    """Token ids -> frozen embedding -> blocks -> logits (integer inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, W)
        self.embed.requires_grad_(False)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(W, 32)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class FlagNet(Net):
    """``forward(x, training_flag: bool)``: a non-tensor positional argument."""

    def forward(self, x: torch.Tensor, double: bool) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x * 2 if double else x)


class NestedOut(Net):
    def forward(self, x: torch.Tensor) -> dict[str, Any]:  # type: ignore[override]
        logits = super().forward(x)
        return {"out": (logits, [logits.detach()]), "n": 3}


def _plan_and_check(model: nn.Module, inputs: Any, strategy: str = "full",
                    budget: Any = None, loss_fn: Any = None, **kw: Any) -> Plan:
    tape = quick_profile(model, inputs, loss_fn=loss_fn, **kw)
    chosen = autoremat.plan(tape, budget, strategy)
    planned_step_right(model, inputs, chosen, loss_fn=loss_fn)
    return chosen


def _models() -> list[Case]:
    c: list[Case] = []

    def add(name: str, run: Callable[[], object], *names: str, note: str = "") -> None:
        c.append(Case("models", name, run, tuple(names), note=note))

    x = lambda: torch.randn(B, W)  # noqa: E731

    def dict_out() -> None:
        torch.manual_seed(0)
        model = DictOut()
        tape = quick_profile(model, x())
        _, peak = step(copy.deepcopy(model), x(), loss_fn=lambda o: o["loss"])
        # the tape measured the step whose loss is out['loss'] (a dict's 'loss' key)
        expect(abs(tape.step_peak_bytes - peak) <= 0.02 * peak,
               f"tape {tape.step_peak_bytes} B, loop with out['loss'] {peak} B")
        planned_step_right(model, x(), autoremat.plan(tape, None, "full"),
                           loss_fn=lambda o: o["loss"])
    add("model returning a dict with 'loss'", dict_out)

    def tuple_out() -> None:
        torch.manual_seed(0)
        model = TupleOut()
        _plan_and_check(model, x(), loss_fn=lambda o: o[0])
    add("model returning (loss, logits)", tuple_out)

    def shared() -> None:  # planned call by call (NOTE [ A block that runs several times ])
        torch.manual_seed(0)
        _plan_and_check(SharedBlock(), x(), "every:2")
    add("one block module reused at every position", shared)

    def tied() -> None:
        torch.manual_seed(0)
        _plan_and_check(TiedBlocks(), x())
    add("tied weights across blocks", tied)

    def module_dict() -> None:
        torch.manual_seed(0)
        model = DictBlocks()
        tape = quick_profile(model, x())
        expect(len(tape.blocks) == 4, f"found {[b.name for b in tape.blocks]}")
        planned_step_right(model, x(), autoremat.plan(tape, None, "full"))
    add("blocks in an nn.ModuleDict keyed by position", module_dict)

    def named_dict() -> None:
        torch.manual_seed(0)
        tape = quick_profile(DictBlocks(keys=("attend", "mix", "project", "gate")), x())
        expect(False, f"planned over {[b.name for b in tape.blocks]}: a ModuleDict keyed "
               "by name holds parts, which need not run one after the other")
    add("blocks in an nn.ModuleDict keyed by name", named_dict)

    def py_list() -> None:
        torch.manual_seed(0)
        tape = quick_profile(ListBlocks(), x())
        expect(False, f"planned over {[b.name for b in tape.blocks]}, not the unregistered "
               "blocks, and said nothing")
    add("blocks in a plain Python list (unregistered)", py_list, "block")

    def one_block() -> None:
        torch.manual_seed(0)
        _plan_and_check(Net(1), x())
    add("a model with one block", one_block, "single block")

    def batchnorm() -> None:
        torch.manual_seed(0)
        model = Net(3, block=BNBlock)
        plain = copy.deepcopy(model)
        tape = quick_profile(model, x())
        autoremat.apply(model, autoremat.plan(tape, None, "full"))
        inputs = x()
        same_grads(step(plain, inputs)[0], step(model, inputs)[0])
        for (n, a), (_, b) in zip(plain.named_buffers(), model.named_buffers(), strict=True):
            expect(torch.equal(a, b), f"buffer {n} differs from the plain model's after a step")
    add("BatchNorm in every block (stats updated once)", batchnorm)

    def two_input() -> None:
        torch.manual_seed(0)
        model = MaskNet()
        inputs = {"x": torch.randn(B, W), "mask": (torch.rand(B, W) > 0.2).float(),
                  "scale": 0.5}
        _plan_and_check(model, inputs)
    add("kwargs inputs with a float scale and a mask", two_input)

    def aux() -> None:
        torch.manual_seed(0)
        _plan_and_check(AuxNet(), x())
    add("blocks returning (hidden, aux loss)", aux)

    def noparam() -> None:
        torch.manual_seed(0)
        model = Net(3, block=NoParamBlock)
        _plan_and_check(model, x())
    add("blocks without parameters", noparam)

    def lora() -> None:
        torch.manual_seed(0)
        _plan_and_check(Net(3, block=LoRALinear), x())
    add("LoRA-style frozen base + adapters", lora)

    def embed() -> None:
        torch.manual_seed(0)
        model = EmbedNet()
        ids = torch.randint(0, 32, (4, 6))
        _plan_and_check(model, (ids, ids))
    add("frozen embedding of integer ids", embed)

    def input_grad() -> None:
        torch.manual_seed(0)
        model = Net(3)
        inp = torch.randn(8, W, requires_grad=True)
        tape = quick_profile(model, inp)
        plain = copy.deepcopy(model)
        torch.manual_seed(0)
        plain(inp).sum().backward()
        want, inp.grad = inp.grad.clone(), None
        autoremat.apply(model, autoremat.plan(tape, None, "full"))
        torch.manual_seed(0)
        model(inp).sum().backward()
        expect(inp.grad is not None and torch.equal(inp.grad, want), "input grad differs")
    add("input that requires grad (input gradients)", input_grad)

    def flag() -> None:
        torch.manual_seed(0)
        _plan_and_check(FlagNet(), (torch.randn(B, W), True))
    add("a bool positional argument", flag)

    def nested() -> None:
        torch.manual_seed(0)
        _plan_and_check(NestedOut(), x(), loss_fn=lambda o: o["out"][0].sum())
    add("nested dict/tuple/list output", nested)

    def float64() -> None:
        torch.manual_seed(0)
        _plan_and_check(Net(3).double(), torch.randn(8, W, dtype=torch.float64))
    add("a float64 model", float64)

    def bf16() -> None:
        torch.manual_seed(0)
        _plan_and_check(Net(3).bfloat16(), torch.randn(8, W, dtype=torch.bfloat16))
    add("a bfloat16 model on CPU", bf16)

    def parametrized() -> None:
        torch.manual_seed(0)
        model = Net(3)
        for b in model.blocks:
            nn.utils.parametrizations.weight_norm(b.fc)
        _plan_and_check(model, x())
    add("weight_norm parametrizations in blocks", parametrized)

    def sequential() -> None:
        torch.manual_seed(0)
        model = nn.Sequential(*[Block() for _ in range(4)])
        _plan_and_check(model, x(), strategy="optimal", budget="70%")
    add("nn.Sequential of blocks, optimal 70%", sequential)

    def seq_layers() -> None:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(W, W), nn.GELU(), nn.Linear(W, W), nn.GELU(),
                          nn.Linear(W, W))
        _plan_and_check(m, x(), strategy="every:2")
    add("nn.Sequential of bare layers, every:2", seq_layers)

    def hooks() -> None:
        torch.manual_seed(0)
        model = Net(3)
        calls: list[int] = []
        model.blocks[0].register_forward_hook(lambda m, i, o: calls.append(1))
        tape = quick_profile(model, x())
        autoremat.apply(model, autoremat.plan(tape, None, "full"))
        calls.clear()
        model(x()).sum().backward()
        expect(len(calls) == 1, f"a user's forward hook ran {len(calls)} times in one step")
    add("a user's forward hook on a recomputed block", hooks, "hook")

    def hook_after_apply() -> None:
        torch.manual_seed(0)
        model = Net(3)
        tape = quick_profile(model, x())
        autoremat.apply(model, autoremat.plan(tape, None, "full"))
        kept: list[torch.Tensor] = []
        model.blocks[1].register_forward_hook(lambda m, i, o: kept.append(o))
        model(x()).sum().backward()
    add("a forward hook keeping a block's output, registered after apply", hook_after_apply,
        "hook")

    def jit_block() -> None:
        torch.manual_seed(0)
        model = Net(3)
        model.blocks[1] = torch.jit.script(model.blocks[1])
        _plan_and_check(model, x())
    add("a torch.jit.script block", jit_block)

    def data_parallel() -> None:
        torch.manual_seed(0)
        model = Net(3)
        tape = quick_profile(model, x())
        wrapped = nn.DataParallel(model)
        planned_step_right(wrapped, x(), autoremat.plan(tape, None, "full"))
    add("nn.DataParallel wrapper on CPU", data_parallel)

    def meta_profile() -> None:
        with torch.device("meta"):
            model = Net(3)
        autoremat.profile(model, torch.randn(8, W, device="meta"))
    add("profile a model on meta without device=", meta_profile, "meta")

    def meta_inputs() -> None:
        torch.manual_seed(0)
        autoremat.profile(Net(3), torch.randn(8, W, device="meta"))
    add("profile with inputs on meta, model on cpu", meta_inputs, "meta")

    def estimate_matches() -> None:
        torch.manual_seed(0)
        model = Net(3)
        tape = quick_profile(model, x())
        est = autoremat.estimate(model, x(), device="cpu", selective=False)
        expect(abs(est.step_peak_bytes - tape.step_peak_bytes) <= 0.01 * tape.step_peak_bytes,
               f"estimate {est.step_peak_bytes} B, profile {tape.step_peak_bytes} B")
    add("estimate equals profile on a hand-written model", estimate_matches)

    def estimate_bn() -> None:
        torch.manual_seed(0)
        model = Net(3, block=BNBlock)
        tape = quick_profile(model, x())
        est = autoremat.estimate(model, x(), device="cpu", selective=False)
        expect(abs(est.step_peak_bytes - tape.step_peak_bytes) <= 0.01 * tape.step_peak_bytes,
               f"estimate {est.step_peak_bytes} B, profile {tape.step_peak_bytes} B")
    add("estimate equals profile with BatchNorm blocks", estimate_bn)

    class OwnCheckpoint(Net):
        """Blocks the model checkpoints itself (issue 36)."""

        def __init__(self, reentrant: bool) -> None:
            super().__init__()
            self.reentrant = reentrant

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            for block in self.blocks:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.reentrant)
            return self.head(h)

    add("profile a model that checkpoints its blocks itself (non-reentrant)",
        lambda: quick_profile(OwnCheckpoint(False), x()), "ran again in backward",
        "checkpoints them itself", "gradient_checkpointing_disable")

    def own_reentrant() -> None:
        model = OwnCheckpoint(True)
        model.embed.requires_grad_(False)  # the blocks' input then needs no gradient
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # checkpoint's own "None of the inputs ..."
            quick_profile(model, x())

    add("profile a model that checkpoints its blocks itself (reentrant, frozen input)",
        own_reentrant, "reentrant torch.utils.checkpoint", "checkpoints them itself")

    class Stores(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(W, W)
            self.out: torch.Tensor | None = None

        def forward(self, h: torch.Tensor) -> None:
            self.out = self.fc(h)

    class StoresNet(Net):
        def __init__(self) -> None:
            super().__init__(block=Stores)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            for block in self.blocks:
                block(h)
                h = block.out
            return self.head(h)

    add("profile blocks that return None (their result kept on the module)",
        lambda: quick_profile(StoresNet(), x(), blocks=[f"blocks.{i}" for i in range(4)]),
        "return no tensor", "blocks=[...]")
    add("estimate(..., dtype=torch.int8)",
        lambda: autoremat.estimate(Net(), x(), device="cpu", dtype=torch.int8),
        "floating dtype", "torch.int8")

    class DepthNet(Net):
        def forward(self, x: torch.Tensor, depth: int | None = None) -> torch.Tensor:
            h = self.embed(x)
            for block in self.blocks[:depth]:
                h = block(h)
            return self.head(h)

    def depth_step(strategy: str, profiled: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = DepthNet(6)
        plain = copy.deepcopy(model)
        inputs = x()
        tape = quick_profile(model, {"x": inputs, **profiled}, loss_fn=default_loss)
        autoremat.apply(model, autoremat.plan(tape, None, strategy))
        same_grads(step(plain, {"x": inputs, "depth": 3})[0],
                   step(model, {"x": inputs, "depth": 3})[0])

    add("train with a keyword that skips the last block of a planned segment",
        lambda: depth_step("sqrt", {"depth": 6}), "did not run", "arguments the loop passes")
    add("train with a keyword that skips blocks planned one by one",
        lambda: depth_step("full", {"depth": 6}))
    add("train with a keyword the profile did not pass",
        lambda: depth_step("full", {}), "depth=3", "did not pass")
    return c


# --- cases: loops -----------------------------------------------------------------------------


def _applied_net(n: int = 4, strategy: str = "full") -> tuple[nn.Module, nn.Module, torch.Tensor,
                                                                Plan]:
    model, x = net(n)
    plain = copy.deepcopy(model)
    chosen = autoremat.plan(net_tape(n), None, strategy)
    autoremat.apply(model, chosen)
    return model, plain, x, chosen


def _loops() -> list[Case]:
    c: list[Case] = []

    def add(name: str, run: Callable[[], object], *names: str, note: str = "") -> None:
        c.append(Case("loops", name, run, tuple(names), note=note))

    def sgd_steps() -> None:
        model, plain, x, _ = _applied_net()
        for m in (plain, model):
            torch.manual_seed(1)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for _ in range(3):
                opt.zero_grad()
                m(x).sum().backward()
                opt.step()
        for a, b in zip(plain.parameters(), model.parameters(), strict=True):
            expect(torch.equal(a, b), "parameters differ after 3 SGD steps")
    add("three optimizer steps", sgd_steps)

    def accumulate() -> None:
        model, plain, x, _ = _applied_net()
        for m in (plain, model):
            torch.manual_seed(1)
            for chunk in x.chunk(2):
                m(chunk).sum().backward()
        for a, b in zip(plain.parameters(), model.parameters(), strict=True):
            expect(torch.equal(a.grad, b.grad), "accumulated gradients differ")
    add("gradient accumulation over micro-batches", accumulate)

    def eval_no_grad() -> None:
        model, plain, x, _ = _applied_net()
        model.eval()
        plain.eval()
        with torch.no_grad():
            expect(torch.equal(model(x), plain(x)), "eval outputs differ")
    add("eval() under no_grad", eval_no_grad)

    def inference_mode() -> None:
        model, plain, x, _ = _applied_net()
        with torch.inference_mode():
            torch.manual_seed(2)
            a = model(x)
            torch.manual_seed(2)
            expect(torch.equal(a, plain(x)), "outputs differ")
    add("forward under inference_mode", inference_mode)

    def eval_with_grad() -> None:
        model, plain, x, _ = _applied_net()
        model.eval()
        plain.eval()
        same_grads(step(plain, x)[0], step(model, x)[0])
    add("eval() mode with gradients (e.g. a probe)", eval_with_grad, "eval")

    def other_batch() -> None:
        model, plain, _x, _ = _applied_net()
        y = torch.randn(16, W)
        same_grads(step(plain, y)[0], step(model, y)[0])
    add("a larger batch than planned", other_batch, "shape")

    def smaller_batch() -> None:
        model, plain, _x, _ = _applied_net()
        y = torch.randn(4, W)
        same_grads(step(plain, y)[0], step(model, y)[0])
    add("a smaller batch than planned (last batch)", smaller_batch)

    def input_only_grad() -> None:
        model, plain, x, _ = _applied_net()
        xi = x.clone().requires_grad_(True)
        torch.manual_seed(0)
        (want,) = torch.autograd.grad(plain(xi).sum(), xi)
        torch.manual_seed(0)
        (got,) = torch.autograd.grad(model(xi).sum(), xi)
        expect(torch.equal(want, got), "input gradient differs")
    add("autograd.grad w.r.t. the input only", input_only_grad)

    def nonscalar_backward() -> None:
        model, plain, x, _ = _applied_net()
        for m in (plain, model):
            torch.manual_seed(0)
            out = m(x)
            out.backward(torch.ones_like(out))
        for a, b in zip(plain.parameters(), model.parameters(), strict=True):
            expect(torch.equal(a.grad, b.grad), "grads differ")
    add("backward(gradient=...) on a non-scalar output", nonscalar_backward)

    def anomaly() -> None:
        model, plain, x, _ = _applied_net()
        with torch.autograd.detect_anomaly(check_nan=True):
            same_grads(step(plain, x)[0], step(model, x)[0])
    add("under detect_anomaly", anomaly)

    def freeze_after() -> None:
        model, plain, x, _ = _applied_net()
        for m in (plain, model):
            m.blocks[0].requires_grad_(False)
        same_grads(step(plain, x)[0], step(model, x)[0])
    add("freezing a block after apply", freeze_after)

    def freeze_all_blocks() -> None:
        model, plain, x, _ = _applied_net()
        for m in (plain, model):
            m.blocks.requires_grad_(False)
            m.embed.requires_grad_(False)
        same_grads(step(plain, x)[0], step(model, x)[0])
    add("every block frozen after apply (head-only fine-tune)", freeze_all_blocks)

    def apply_twice() -> None:
        model, plain, x, chosen = _applied_net()
        autoremat.apply(model, chosen)
        same_grads(step(plain, x)[0], step(model, x)[0])
        autoremat.remove(model)
        expect(autoremat.applied_plan(model) is None, "still applied after one remove")
    add("apply twice, remove once", apply_twice)

    def remove_twice() -> None:
        model, plain, x, _ = _applied_net()
        autoremat.remove(model)
        autoremat.remove(model)
        same_grads(step(plain, x)[0], step(model, x)[0])
    add("remove twice", remove_twice)

    def state_dict_round() -> None:
        model, plain, x, _ = _applied_net()
        fresh = net(seed=5)[0]
        fresh.load_state_dict(model.state_dict())
        model.load_state_dict(plain.state_dict())
        same_grads(step(plain, x)[0], step(fresh, x)[0])
        same_grads(step(plain, x)[0], step(model, x)[0])
    add("state_dict to and from an applied model", state_dict_round)

    def reapply_other() -> None:
        model, plain, x, _ = _applied_net()
        every = autoremat.plan(net_tape(), None, "every:2")
        autoremat.apply(model, every)
        expect(autoremat.applied_plan(model) == every, "the old plan stayed")
        same_grads(step(plain, x)[0], step(model, x)[0])
    add("apply a second plan over the first", reapply_other)

    def set_to_zero() -> None:
        model, plain, x, _chosen = _applied_net()
        for m in (plain, model):
            m.zero_grad(set_to_none=False)  # grads exist as zeros
        for m in (plain, model):
            torch.manual_seed(0)
            m(x).sum().backward()
        for a, b in zip(plain.parameters(), model.parameters(), strict=True):
            expect(torch.equal(a.grad, b.grad), "grads differ")
    add("zero_grad(set_to_none=False) loop", set_to_zero)

    def two_forwards() -> None:
        model, plain, x, chosen = _applied_net()
        y = torch.randn(B, W)
        loss = lambda m: (m(x) + m(y)).sum()  # noqa: E731
        for m in (plain, model):
            _zero(m)
            torch.manual_seed(0)
            loss(m).backward()
        with autoremat.track_memory() as mem:
            torch.manual_seed(0)
            loss(model).backward()
        for a, b in zip(plain.parameters(), model.parameters(), strict=True):
            expect(torch.equal(a.grad * 2, b.grad), "grads differ")
        expect(mem.peak_bytes <= chosen.predicted_peak_bytes,
               f"two forwards per step: {mem.peak_bytes} B over the prediction "
               f"{chosen.predicted_peak_bytes} B")
    add("two forwards per step (siamese)", two_forwards, "call",
        note="a forward while the last one's graph waits for its backward: warned")

    def autocast() -> None:
        model, x = net()
        tape = quick_profile(model, x)
        chosen = autoremat.plan(tape, None, "full")
        plain = copy.deepcopy(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, _ = step(plain, x)
            autoremat.apply(model, chosen)
            got, peak = step(model, x)
        same_grads(want, got)
        expect(peak <= chosen.predicted_peak_bytes,
               f"under autocast: {peak} B over the prediction {chosen.predicted_peak_bytes} B")
    add("training under autocast after an fp32 profile", autocast, "autocast",
        note="tape conditions (autocast): a recorded condition")

    def cast_after() -> None:
        model, x = net()
        chosen = autoremat.plan(net_tape(), None, "full")
        autoremat.apply(model, chosen)
        model.double()
        _, peak = step(model, x.double())
        expect(peak <= chosen.predicted_peak_bytes,
               f"float64 after apply: {peak} B over the prediction {chosen.predicted_peak_bytes}")
    add("model.double() after apply", cast_after, "dtype",
        note="tape conditions (dtype after apply): a recorded condition")

    def append_block() -> None:
        model, _plain, x, chosen = _applied_net()
        model.blocks.append(Block())
        _, peak = step(model, x)
        expect(peak <= chosen.predicted_peak_bytes,
               f"a block appended after apply: {peak} B over {chosen.predicted_peak_bytes} B")
    add("a block appended after apply", append_block, "block",
        note="tape conditions (number of blocks): a recorded condition")

    def other_loss() -> None:
        model, x = net()
        tape = quick_profile(model, x)  # default loss: sum of logits
        chosen = autoremat.plan(tape, "80%")
        autoremat.apply(model, chosen)
        target = torch.randint(0, 4, (B,))
        _, peak = step(model, x, loss_fn=lambda o: nn.functional.cross_entropy(o, target))
        expect(peak <= chosen.predicted_peak_bytes,
               f"cross-entropy loop: {peak} B over {chosen.predicted_peak_bytes} B")
    add("profiled with the default loss, trained with cross-entropy", other_loss, "loss",
        note="no hook sees a loss taken outside the model: profile warns that it "
             "measured the default sum over a batch of outputs")
    return c


# --- cases: plan files ------------------------------------------------------------------------


def _plan_files() -> list[Case]:
    c: list[Case] = []

    def add(name: str, run: Callable[[], object], *names: str, quick: bool = False) -> None:
        c.append(Case("plan-files", name, run, tuple(names), quick))

    full = lambda: autoremat.plan(net_tape(), None, "full")  # noqa: E731

    def round_trip() -> None:
        p = full()
        expect(Plan.from_json(p.to_json()) == p, "plan changed through JSON")
    add("Plan JSON round trip", round_trip)

    def path_round_trip() -> None:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "plan.json"
            p = full()
            p.to_json(path)
            expect(Plan.from_json(path) == p, "plan changed through a file")
            expect(Plan.from_json(str(path)) == p, "plan changed through a str path")
    add("Plan to and from a pathlib.Path", path_round_trip)

    def tape_round_trip() -> None:
        tape = net_tape()
        again = Tape.from_json(tape.to_json())
        expect(autoremat.plan(again, "60%") == autoremat.plan(tape, "60%"),
               "a plan from the reloaded tape differs")
    add("Tape JSON round trip plans the same", tape_round_trip)

    add("Plan.from_json of a tape's JSON", lambda: Plan.from_json(net_tape().to_json()),
        "plan")
    add("Tape.from_json of a plan's JSON", lambda: Tape.from_json(full().to_json()), "tape")
    add("Plan.from_json('')", lambda: Plan.from_json(""), "JSON", quick=True)
    add("Plan.from_json('[]')", lambda: Plan.from_json("[]"), "plan", quick=True)
    add("Plan.from_json of a missing file", lambda: Plan.from_json("no/such/plan.json"),
        "no/such/plan.json", quick=True)
    add("Plan.from_json of bytes", lambda: Plan.from_json(full().to_json().encode()), "bytes")
    add("Plan.from_json of a dict", lambda: Plan.from_json(json.loads(full().to_json())),
        "dict")

    def edit(change: Callable[[dict[str, Any]], None], keep_seal: bool = True) -> Callable[[],
                                                                                           Plan]:
        def run() -> Plan:
            data = json.loads(full().to_json())
            change(data)
            if not keep_seal:
                data.pop("seal", None)
            return Plan.from_json(json.dumps(data))
        return run

    add("schema_version 99", edit(lambda d: d.update(schema_version=99)), "schema_version")
    add("a block renamed (sealed)", edit(lambda d: d["blocks"][0].update(name="blocks.9")),
        "edited")
    add("decision 'Recompute' (capitals)",
        edit(lambda d: d["blocks"][0].update(decision="Recompute")), "Recompute")
    add("an unknown top-level field", edit(lambda d: d.update(comment="mine")), "comment")
    add("predicted_peak_bytes as a string",
        edit(lambda d: d.update(predicted_peak_bytes="12"), keep_seal=False),
        "predicted_peak_bytes")
    add("a negative predicted peak (unsealed)",
        edit(lambda d: d.update(predicted_peak_bytes=-5), keep_seal=False),
        "predicted_peak_bytes")
    add("the seal changed", edit(lambda d: d.update(seal="0" * 16)), "seal")

    def to_missing_dir() -> None:
        full().to_json("/proc/no/such/dir/plan.json")
    add("to_json into a folder that does not exist", to_missing_dir, "plan.json")

    def other_class() -> None:
        autoremat.apply(MaskNet(), full())
    add("a plan applied to another model class", other_class, "Net")

    def bigger_model() -> None:
        model, x = net(6)
        chosen = autoremat.plan(net_tape(4), None, "full")
        autoremat.apply(model, chosen)
        _, peak = step(model, x)
        expect(peak <= chosen.predicted_peak_bytes,
               f"a 4-block plan on 6 blocks: {peak} B over {chosen.predicted_peak_bytes} B")
    c.append(Case("plan-files", "a 4-block plan applied to a 6-block model", bigger_model,
                  ("block",),
                  note="tape conditions (number of blocks): a recorded condition"))

    def with_tape_check() -> None:
        p = full()
        expect(Plan.from_json(p.to_json(), tape=net_tape()) == p, "changed")
    add("from_json(tape=) with its own tape", with_tape_check)

    def with_other_tape() -> None:
        Plan.from_json(full().to_json(), tape=net_tape(6))
    add("from_json(tape=) with another model's tape", with_other_tape, "tape")
    return c


# --- cases: CLI -------------------------------------------------------------------------------

_MLP = "widths=32,32,32,d_in=32,batch_size=128"

_FACTORIES = '''
import torch
from torch import nn

def make(width=8):
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(3)]), torch.ones(2, width)

def only_model():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

def three():
    return nn.Sequential(nn.Linear(4, 4)), torch.ones(2, 4), 3

def raises():
    raise ValueError("my factory is broken")

not_callable = 3
'''


@contextlib.contextmanager
def _factory_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "sweep_factories.py").write_text(_FACTORIES)
        (Path(d) / "sweep_syntax.py").write_text("def make(:\n    pass\n")
        sys.modules.pop("sweep_factories", None)
        sys.modules.pop("sweep_syntax", None)
        try:
            yield d
        finally:
            sys.modules.pop("sweep_factories", None)
            sys.modules.pop("sweep_syntax", None)


def _cli_in_factories(argv: list[str]) -> str:
    with _factory_dir() as d:
        return cli(argv, cwd=d)


def _cli_cases() -> list[Case]:
    c: list[Case] = []

    def add(name: str, argv: list[str], *names: str, check: Callable[[str], None] | None = None,
            quick: bool = False, factories: bool = False, codes: tuple[int, ...] = (0,)
            ) -> None:
        def run() -> None:
            text = _cli_in_factories(argv) if factories else cli(argv, codes=codes)
            if check is not None:
                check(text)
        c.append(Case("CLI", "autoremat " + " ".join(argv), run, tuple(names), quick))

    def has(*words: str) -> Callable[[str], None]:
        def check(text: str) -> None:
            missing = [w for w in words if w not in text]
            expect(not missing, f"output lacks {missing}: {text[-200:]}")
        return check

    add("no command", [], "command", quick=True)
    add("--version", ["--version"], "version", check=has(autoremat.__version__), quick=True)
    add("--help", ["--help"], check=has("usage"), quick=True)
    add("unknown command", ["planify", "mlp"], "planify", quick=True)
    add("profile --loop bogus", ["profile", "mlp", "--loop", "bogus"], "bogus", quick=True)
    add("demo --model nosuch", ["demo", "--model", "nosuch"], "nosuch", quick=True)
    add("plan --budget -5", ["plan", "mlp", "--budget", "-5"], "-5", quick=True)
    add("plan --budget ''", ["plan", "mlp", "--budget", ""], "budget", quick=True)
    add("plan --strategy every:2", ["plan", "mlp", "--set", _MLP, "--strategy", "every:2"],
        check=has("every:2"))
    add("plan --budget 50% --strategy full",
        ["plan", "mlp", "--set", _MLP, "--budget", "50%", "--strategy", "full"], "budget")
    add("plan --max-memory 1GiB --optimizer adamw",
        ["plan", "mlp", "--set", _MLP, "--max-memory", "1GiB", "--optimizer", "adamw"],
        check=has("plan"))
    add("plan --budget 70% --verify",
        ["plan", "mlp", "--set", _MLP, "--budget", "70%", "--verify"], check=has("equal"))
    add("plan --budget 60% --loop loss_only",
        ["plan", "mlp", "--set", _MLP, "--budget", "60%", "--loop", "loss_only"])
    add("plan --head auto on a model without a head",
        ["plan", "mlp", "--set", _MLP, "--budget", "60%", "--head", "auto"])
    add("profile --set widths= (empty value)", ["profile", "mlp", "--set", "widths="],
        "widths", quick=True)
    add("profile --set batch_size=1.5", ["profile", "mlp", "--set", "batch_size=1.5"],
        "batch_size", quick=True)
    add("profile --set with a space after the comma",
        ["profile", "mlp", "--set", "widths=8,8, batch_size=2"], "batch_size",
        check=has("inputs (2, 256)"), quick=True)
    add("profile --ops (no block)", ["profile", "mlp", "--ops"], "--ops", quick=True)

    def plan_from_tape_file() -> None:
        with tempfile.TemporaryDirectory() as d:
            tape = Path(d) / "tape.json"
            cli(["profile", "mlp", "--set", _MLP, "--out", str(tape)])
            cli(["plan", str(tape), "--budget", "60%"])
    c.append(Case("CLI", "autoremat plan tape.json (a saved tape)", plan_from_tape_file,
                  ("tape.json",)))
    add("profile missing/file.py:make", ["profile", "missing/file.py:make"], "missing/file.py",
        quick=True)
    add("profile a factory with a syntax error", ["profile", "sweep_syntax:make"],
        "sweep_syntax", factories=True, quick=True)
    add("profile a factory that raises", ["profile", "sweep_factories:raises"],
        "my factory is broken", factories=True, quick=True)
    add("profile a factory returning only a model", ["profile", "sweep_factories:only_model"],
        "only_model", factories=True, quick=True)
    add("profile a factory returning three things", ["profile", "sweep_factories:three"],
        "three", factories=True, quick=True)
    add("profile a target that is not callable", ["profile", "sweep_factories:not_callable"],
        "not_callable", factories=True, quick=True)
    add("profile module:factory", ["profile", "sweep_factories:make"], check=has("0"),
        factories=True)
    add("profile --set on a factory's own option",
        ["profile", "sweep_factories:make", "--set", "width=4"], check=has("0"),
        factories=True)
    add("doctor --device tpu", ["doctor", "mlp", "--device", "tpu"], "tpu", quick=True)
    add("doctor --dtype fp17", ["doctor", "mlp", "--dtype", "fp17"], "fp17", quick=True)
    add("doctor (no target)", ["doctor"], "--hf", quick=True)
    add("doctor mlp --hf llama", ["doctor", "mlp", "--hf", "llama"], "--hf", quick=True)
    add("doctor --hf nosuchfamily", ["doctor", "--hf", "nosuchfamily"], "nosuchfamily",
        quick=True)
    add("doctor --hf llama --config hidden_size=abc",
        ["doctor", "--hf", "llama", "--config", "hidden_size=abc"], "hidden_size")
    add("doctor mlp --memory 1KiB", ["doctor", "mlp", "--set", _MLP, "--memory", "1KiB",
                                     "--device", "cpu"], codes=(1,), check=has("1.00 KiB"))
    add("estimate mlp --budget 50%", ["estimate", "mlp", "--set", _MLP, "--budget", "50%",
                                      "--device", "cpu"], "--budget")
    add("estimate mlp --memory 1GiB", ["estimate", "mlp", "--set", _MLP, "--memory", "1GiB",
                                       "--device", "cpu"], check=has("FITS"))
    add("estimate --hf gpt2 tiny", ["estimate", "--hf", "gpt2", "--seq", "8", "--config",
                                    "n_layer=2,n_embd=16,n_head=2,vocab_size=64",
                                    "--device", "cpu"], check=has("GPT2LMHeadModel"))
    add("estimate --hf gpt2 with one layer", ["estimate", "--hf", "gpt2", "--seq", "8",
                                              "--config", "n_layer=1,n_embd=16,n_head=2",
                                              "--device", "cpu"], "single block")
    add("bench --budgets 50% --repeats 0 (no such repeat)",
        ["bench", "mlp", "--repeats", "-1"], "--repeats", quick=True)
    add("bench --no-such-flag", ["bench", "mlp", "--no-such-flag"], "--no-such-flag",
        quick=True)

    def module_entry() -> None:
        env = dict(os.environ, PYTHONPATH=str(Path(autoremat.__file__).parents[1]))
        done = subprocess.run([sys.executable, "-m", "autoremat", "plan", "mlp", "--budget",
                               "nope"], capture_output=True, text=True, env=env, timeout=120)
        text = done.stdout + done.stderr
        if "Traceback" in text:
            raise CLIRaw(text[-300:])
        expect(done.returncode == 2 and "cannot read budget" in text,
               f"exit {done.returncode}: {text[-200:]}")
        raise CLIRefusal(text.strip().splitlines()[-1])
    c.append(Case("CLI", "python -m autoremat plan mlp --budget nope (subprocess)",
                  module_entry, ("budget",)))
    return c


# --- cases: Hugging Face ----------------------------------------------------------------------


def _hf_gpt2(**config: Any) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(**{"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": 64,
                        "n_positions": 16, "use_cache": False, **config})
    model = GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 64, (2, 8))
    return model, {"input_ids": ids, "labels": ids}


def _hf() -> list[Case]:
    c: list[Case] = []
    try:
        import transformers  # noqa: F401
    except ImportError:
        return c

    def add(name: str, run: Callable[[], object], *names: str, quick: bool = False) -> None:
        c.append(Case("HF", name, run, tuple(names), quick))

    def gpt2_full() -> None:
        model, batch = _hf_gpt2()
        _plan_and_check(model, batch)
    add("GPT-2 with labels, every block recomputed", gpt2_full)

    def gpt2_no_labels() -> None:
        model, batch = _hf_gpt2()
        batch = {"input_ids": batch["input_ids"]}
        _plan_and_check(model, batch, loss_fn=lambda o: o.logits.float().pow(2).mean())
    add("GPT-2 without labels, own loss_fn", gpt2_no_labels)

    def gpt2_cache_on() -> None:
        model, batch = _hf_gpt2(use_cache=True)
        tape = quick_profile(model, batch)
        # apply turns the cache off (and warns): the reference is the plain model without
        # it, since Transformers' own step with the cache sums in another order (9e-10)
        planned_step_right(model, batch, autoremat.plan(tape, None, "full"),
                           after=lambda m: setattr(m.config, "use_cache", False))
    add("GPT-2 with use_cache=True", gpt2_cache_on, "use_cache")

    def gpt2_hf_ckpt() -> None:
        model, batch = _hf_gpt2()
        model.gradient_checkpointing_enable()
        _plan_and_check(model, batch)
    add("GPT-2 with HF gradient checkpointing already on", gpt2_hf_ckpt, "checkpointing")

    def batch_encoding() -> None:
        from transformers import BatchEncoding

        model, batch = _hf_gpt2()
        _plan_and_check(model, BatchEncoding(batch))
    add("a BatchEncoding batch (tokenizer output)", batch_encoding)

    def return_tuple() -> None:
        model, batch = _hf_gpt2()
        _plan_and_check(model, {**batch, "return_dict": False}, loss_fn=lambda o: o[0])
    add("return_dict=False (tuple output)", return_tuple)

    def attention_mask() -> None:
        model, batch = _hf_gpt2()
        mask = torch.ones_like(batch["input_ids"])
        mask[0, -3:] = 0
        _plan_and_check(model, {**batch, "attention_mask": mask})
    add("padding in attention_mask", attention_mask)

    def estimate_gpt2() -> None:
        model, batch = _hf_gpt2()
        tape = quick_profile(model, batch)
        est = autoremat.estimate(model, batch, device="cpu", selective=False)
        expect(abs(est.step_peak_bytes - tape.step_peak_bytes) <= 0.01 * tape.step_peak_bytes,
               f"estimate {est.step_peak_bytes} B, profile {tape.step_peak_bytes} B")
    add("estimate equals profile (HF GPT-2)", estimate_gpt2)

    def bert() -> None:
        from transformers import BertConfig, BertForMaskedLM

        torch.manual_seed(0)
        model = BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=16,
                                           num_attention_heads=2, intermediate_size=32,
                                           vocab_size=64, max_position_embeddings=16,
                                           use_cache=False)).train()
        ids = torch.randint(0, 64, (2, 8))
        _plan_and_check(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                "token_type_ids": torch.zeros_like(ids), "labels": ids})
    add("BERT masked LM with token_type_ids", bert)

    add("AutorematCallback(budget='abc')", lambda: _callback(budget="abc"), "abc", quick=True)
    add("AutorematCallback(loop='bogus')", lambda: _callback(budget="50%", loop="bogus"),
        "bogus", quick=True)
    add("AutorematCallback(strategy='nope')", lambda: _callback(budget="50%", strategy="nope"),
        "nope", quick=True)
    add("AutorematCallback() with no budget", lambda: _callback(), "budget", quick=True)
    add("AutorematCallback(head='chunky')", lambda: _callback(budget="50%", head="chunky"),
        "chunky", quick=True)
    return c


def _callback(**kw: Any) -> None:
    from autoremat.hf import AutorematCallback

    callback = AutorematCallback(**kw)
    expect(False, f"AutorematCallback({kw}) was built: {callback!r}")


# --- cases: compile and devices ---------------------------------------------------------------


def _compile_devices() -> list[Case]:
    c: list[Case] = []

    def add(cls: str, name: str, run: Callable[[], object], *names: str) -> None:
        c.append(Case(cls, name, run, tuple(names)))

    def compiled_block_plan() -> None:
        model, x = net(3)
        tape = net_tape(3)
        chosen = autoremat.plan(tape, None, "full")
        plain = copy.deepcopy(model)
        want, _ = step(plain, x)
        autoremat.apply(model, chosen)
        compiled = torch.compile(model, backend="aot_eager")
        got, _ = step(compiled, x)
        same_grads(want, {k.removeprefix("_orig_mod."): v for k, v in got.items()})
    add("compile", "torch.compile(aot_eager) over an applied eager plan", compiled_block_plan)

    def compiled_segments() -> None:
        model, _x = net(4)
        compiled = torch.compile(model, backend="aot_eager")
        autoremat.apply(compiled, autoremat.plan(net_tape(4), None, "sqrt"))
    add("compile", "a multi-block segment plan on a compiled model", compiled_segments,
        "segment")

    def compiled_tape() -> None:
        model, x = net(3)
        tape = quick_profile(model, x, compile="aot_eager")
        chosen = autoremat.plan(tape, None, "full")
        expect(bool(chosen.compiled), "the plan does not say it is for a compiled step")
        plain = copy.deepcopy(model)
        want, _ = step(plain, x)
        autoremat.apply(model, chosen)
        got, _ = step(torch.compile(model, backend="aot_eager"), x)
        same_grads(want, {k.removeprefix("_orig_mod."): v for k, v in got.items()})
    add("compile", "a plan from a compiled profile, run under torch.compile", compiled_tape)

    def compiled_plan_eager() -> None:
        model, x = net(3)
        tape = quick_profile(model, x, compile="aot_eager")
        planned_step_right(model, x, autoremat.plan(tape, None, "full"), check_peak=False)
    add("compile", "a plan from a compiled profile, run eagerly", compiled_plan_eager)

    def cuda1() -> None:
        tape = quick_profile(*net(3), device="cuda:1")
        expect(tape.device.startswith("cuda"), f"tape.device {tape.device}")
    add("devices", "profile costed for device='cuda:1'", cuda1)

    add("devices", "estimate for device='mps'",
        lambda: autoremat.estimate(*net(3), device="mps", selective=False), "mps")

    def cuda_plan_on_cpu() -> None:
        model, x = net(3)
        tape = quick_profile(model, x, device="cuda")
        planned_step_right(model, x, autoremat.plan(tape, None, "full"), check_peak=False)
    add("devices", "a plan costed for cuda applied on the CPU", cuda_plan_on_cpu, "cuda")

    def cuda_device() -> None:
        tape = quick_profile(*net(3), device="cuda")
        expect(tape.device.startswith("cuda"), f"tape.device {tape.device}")
    add("devices", "profile on CPU costed for device='cuda'", cuda_device)

    def estimate_cuda() -> None:
        est = autoremat.estimate(*net(3), device="cuda", selective=False)
        expect(est.step_peak_bytes > 0, "no peak")
    add("devices", "estimate for cuda on a CPU-only machine", estimate_cuda)

    def deterministic() -> None:
        model, _plain, x, _ = _applied_net(3)
        report = autoremat.verify(model, x, deterministic=True, repeats=1)
        expect(report.ok and report.grads_equal, str(report))
    add("devices", "verify(deterministic=True) on CPU", deterministic)

    def meta_estimate() -> None:
        with torch.device("meta"):
            model = Net(3)
        est = autoremat.estimate(model, torch.randn(B, W), device="cpu", selective=False)
        tape = net_tape(3)
        expect(abs(est.step_peak_bytes - tape.step_peak_bytes) <= 0.01 * tape.step_peak_bytes,
               f"estimate {est.step_peak_bytes} B, profile {tape.step_peak_bytes} B")
    add("devices", "estimate of a meta model with CPU inputs", meta_estimate)
    return c


# --- cases: the zoo ---------------------------------------------------------------------------


def _zoo_cases() -> list[Case]:
    c: list[Case] = []

    def add(name: str, run: Callable[[], object], *names: str, quick: bool = False) -> None:
        c.append(Case("zoo", name, run, tuple(names), quick))

    add("zoo.build('gtp2') (typo)", lambda: zoo.build("gtp2"), "gpt2", quick=True)
    add("zoo.build('mlp', width=8) (unknown option)", lambda: zoo.build("mlp", width=8),
        "width", quick=True)
    add("zoo.build('gpt2', n_head=3, n_embd=16)", lambda: zoo.build("gpt2", n_head=3, n_embd=16),
        "n_head", quick=True)
    add("zoo.build('gpt2', seq_len=4096) over n_positions",
        lambda: zoo.build("gpt2", n_layer=1, seq_len=4096, batch_size=1), "seq_len",
        quick=True)

    def gpt2_auto() -> None:
        model, inputs = tiny_gpt2()
        plain = copy.deepcopy(model)
        chosen = autoremat.auto(model, inputs, budget="70%")
        want, _ = step(plain, inputs)
        got, peak = step(model, inputs)
        same_grads(want, got)
        expect(peak <= chosen.predicted_peak_bytes, f"{peak} B over {chosen.predicted_peak_bytes}")
    add("auto on a tiny gpt2 at 70%", gpt2_auto)

    def mlp_verify() -> None:
        model, inputs = tiny_mlp()
        autoremat.auto(model, inputs, budget="80%")
        report = autoremat.verify(model, inputs, repeats=1)
        expect(report.ok, str(report))
    add("auto then verify on a tiny mlp", mlp_verify)

    def pickle_tape() -> None:
        tape = net_tape()
        expect(pickle.loads(pickle.dumps(tape)) == tape, "tape changed through pickle")
    add("pickle a Tape", pickle_tape)

    def str_everything() -> None:
        model, _plain, x, chosen = _applied_net()
        report = autoremat.verify(model, x, repeats=1)
        for obj in (net_tape(), chosen, report):
            expect(len(str(obj)) > 20, f"str({type(obj).__name__}) is empty")
    add("str() of tape, plan and report", str_everything)

    def lm_head() -> None:
        head = autoremat.LMHead(8, 50)
        hidden, labels = torch.randn(2, 5, 8), torch.full((2, 5), -100)
        _, loss = head(hidden, labels)
        want = nn.functional.cross_entropy(nn.functional.linear(hidden, head.weight, head.bias)
                                           .reshape(-1, 50), labels.reshape(-1))
        expect(torch.equal(loss, want) or (loss.isnan() and want.isnan()),
               f"LMHead loss {loss} vs cross_entropy {want}")
    add("LMHead with every label ignored", lm_head)
    add("zoo.build('gpt2', n_layer=0) (no blocks)", lambda: zoo.build("gpt2", n_layer=0),
        "n_layer=0", ">= 1", quick=True)
    add("zoo.build('mlp', widths=(64, 0))", lambda: zoo.build("mlp", widths=(64, 0)),
        "widths", ">= 1", quick=True)
    return c


# --- cases: workflows around apply, verify and auto ---------------------------------------


class HeadLM(nn.Module):
    """Token ids -> embedding -> blocks -> :class:`autoremat.LMHead` (logits, loss)."""

    def __init__(self, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, W)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.lm_head = autoremat.LMHead(W, vocab, shift=True)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        logits, loss = self.lm_head(h, labels)
        return zoo.LMOutput(logits=logits, loss=loss)


def _workflows() -> list[Case]:
    c: list[Case] = []

    def add(cls: str, name: str, run: Callable[[], object], *names: str,
            quick: bool = False) -> None:
        c.append(Case(cls, name, run, tuple(names), quick))

    def Step(*args: Any, **kwargs: Any) -> Any:  # the class, looked up when a case runs
        return autoremat.Step(*args, **kwargs)

    add("workflows", "Step(model, None)", lambda: Step(net()[0], None), "inputs", quick=True)
    add("workflows", "Step(model, x, loop='bogus')", lambda: Step(*net(), loop="bogus"),
        "bogus", quick=True)
    add("workflows", "Step(model, x, loss_fn='sum')", lambda: Step(*net(), loss_fn="sum"),
        "loss_fn", quick=True)
    add("workflows", "profile(step, x): a Step and loose inputs",
        lambda: autoremat.profile(Step(*net()), torch.randn(B, W)), "inputs", quick=True)
    add("workflows", "auto(step, '70%'): a budget where inputs go",
        lambda: autoremat.auto(Step(*net()), "70%"), "budget=", quick=True)

    def step_auto() -> None:
        model, x = net()
        plain = copy.deepcopy(model)
        step_ = Step(model, x, lambda o: o.pow(2).mean())
        chosen = autoremat.auto(step_, budget="70%")
        report = autoremat.verify(step_, plan=chosen, repeats=1)
        expect(report.ok and report.grads_equal, str(report))
        want, _ = step(plain, x, lambda o: o.pow(2).mean())
        got, peak = step(model, x, lambda o: o.pow(2).mean())
        same_grads(want, got)
        expect(peak <= chosen.predicted_peak_bytes, f"{peak} B over the prediction")
    add("workflows", "auto(Step(...)) then verify(step, plan=...)", step_auto)

    def step_loop_mismatch() -> None:
        model, x = net()
        chosen = autoremat.plan(net_tape(), "70%")
        autoremat.verify(Step(model, x, loop="loss_only"), plan=chosen, repeats=1)
    add("workflows", "verify a loss_only Step against a holds_output plan",
        step_loop_mismatch, "loop")

    def auto_twice() -> None:
        model, x = net()
        plain = copy.deepcopy(model)
        autoremat.auto(model, x, budget="80%")
        chosen = autoremat.auto(model, x, budget="60%")  # a notebook cell run again
        expect(autoremat.applied_plan(model) == chosen, "the second plan is not applied")
        expect(chosen.unplanned_peak_bytes == net_tape().step_peak_bytes,
               f"the second auto profiled {chosen.unplanned_peak_bytes} B, not the plain "
               f"model's {net_tape().step_peak_bytes} B")
        want, _ = step(plain, x)
        got, peak = step(model, x)
        same_grads(want, got)
        expect(peak <= chosen.predicted_peak_bytes, f"{peak} B over the prediction")
    add("workflows", "auto on a model already applied (cell run twice)", auto_twice)

    def profile_applied() -> None:
        model, _, x, _ = _applied_net()
        tape = quick_profile(model, x)
        expect(tape.step_peak_bytes == net_tape().step_peak_bytes,
               f"profile of an applied model measured {tape.step_peak_bytes} B, the plain "
               f"model {net_tape().step_peak_bytes} B")
    add("workflows", "profile a model with a plan applied", profile_applied, "remove")

    def estimate_applied() -> None:
        model, _, x, _ = _applied_net()
        est = autoremat.estimate(model, x, device="cpu", selective=False)
        want = net_tape().step_peak_bytes
        expect(abs(est.step_peak_bytes - want) <= 0.01 * want,
               f"estimate of an applied model {est.step_peak_bytes} B, plain {want} B")
    add("workflows", "estimate a model with a plan applied", estimate_applied, "remove")

    def verify_unapplied() -> None:
        model, x = net()
        chosen = autoremat.plan(net_tape(), "70%")
        report = autoremat.verify(model, x, chosen, repeats=1)
        expect(report.ok and report.grads_equal, str(report))
        expect(autoremat.applied_plan(model) is None, "verify left the plan applied")
    add("workflows", "verify(model, inputs, plan) on a model without a plan", verify_unapplied)

    def verify_loss_fn() -> None:
        model, _, x, _ = _applied_net()
        report = autoremat.verify(model, x, loss_fn=lambda o: o.pow(2).mean(), repeats=1)
        expect(report.grads_equal, str(report))
    add("workflows", "verify with a loss_fn", verify_loss_fn)

    def verify_keeps_grads() -> None:
        model, _, x, _ = _applied_net()
        model(x).sum().backward()
        before = [p.grad.clone() for p in model.parameters()]
        autoremat.verify(model, x, repeats=1)
        expect(all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters(),
                                                          strict=True)),
               "verify changed the gradients the model held")
    add("workflows", "verify between backward and optimizer.step", verify_keeps_grads)

    def auto_predicate() -> None:
        model, x = net()
        chosen = autoremat.auto(model, x, strategy="full",
                                blocks=lambda name, m: isinstance(m, Block))
        expect([b.name for b in chosen.blocks] == [f"blocks.{i}" for i in range(4)],
               str([b.name for b in chosen.blocks]))
    add("workflows", "auto with a blocks predicate", auto_predicate)

    def blocks_container() -> None:
        quick_profile(*net(), blocks=["blocks"])
    add("workflows", "blocks=['blocks'] (the ModuleList itself)", blocks_container, "blocks")

    def head_block() -> None:
        model, x = net()
        tape = quick_profile(model, x, blocks=["head"])
        planned_step_right(model, x, autoremat.plan(tape, None, "full"))
    add("workflows", "blocks=['head'] (one block named)", head_block)

    def offload_strategy() -> None:
        autoremat.plan(net_tape(), None, "offload")
    add("workflows", "strategy='offload' from a tape without offload", offload_strategy,
        "offload")

    def offload_cpu() -> None:
        model, x = net()
        tape = quick_profile(model, x, offload=True)
        chosen = autoremat.plan(tape, "80%", offload=True)
        expect(not chosen.offload_blocks, "offloaded on a CPU")
        planned_step_right(model, x, chosen)
    add("workflows", "offload=True on a CPU", offload_cpu)

    def selective_without() -> None:
        chosen = autoremat.plan(net_tape(), None, "selective")
        model, x = net()
        planned_step_right(model, x, chosen)
    add("workflows", "strategy='selective' from a tape without selective options",
        selective_without, "selective")

    def nested_tracking() -> None:
        w = torch.randn(64, 64, requires_grad=True)
        with autoremat.track_memory() as outer, autoremat.track_memory() as inner:
            (torch.randn(32, 64) @ w).relu().sum().backward()
        expect(outer.peak_bytes == inner.peak_bytes > 0,
               f"nested trackers disagree: {outer.peak_bytes} B and {inner.peak_bytes} B")
    add("workflows", "nested track_memory()", nested_tracking)

    add("workflows", "track_memory(rounding='gpu')",
        lambda: autoremat.track_memory(rounding="gpu").__enter__(), "rounding", quick=True)
    add("workflows", "remove(Net) (the class)", lambda: autoremat.remove(Net), "nn.Module",
        quick=True)
    add("workflows", "applied_plan('model')", lambda: autoremat.applied_plan("model"),
        "nn.Module", quick=True)

    def lmhead_chunked() -> None:
        torch.manual_seed(0)
        model = HeadLM()
        ids = torch.randint(0, 64, (4, 16))
        batch = {"ids": ids, "labels": ids}
        plain = copy.deepcopy(model)
        tape = quick_profile(model, batch)
        chosen = autoremat.plan(tape, None, "full", head="chunked")
        expect(chosen.head_chunks is not None, "the head was not chunked")
        autoremat.apply(model, chosen)
        torch.manual_seed(0)
        out = model(**batch)
        expect(out.logits is None, "a chunked head built the logits")
        torch.manual_seed(0)
        want = plain(**batch).loss
        expect(torch.allclose(out.loss, want, rtol=1e-5), f"loss {out.loss} vs {want}")
    add("HF", "LMHead chunked by a plan", lmhead_chunked)

    def lmhead_eval() -> None:
        torch.manual_seed(0)
        model = HeadLM()
        ids = torch.randint(0, 64, (4, 16))
        tape = quick_profile(model, {"ids": ids, "labels": ids})
        autoremat.apply(model, autoremat.plan(tape, None, "full", head="chunked"))
        with torch.no_grad():
            out = model(ids, ids)
        expect(out.logits is not None and out.logits.shape == (4, 16, 64),
               "no logits in evaluation")
    add("HF", "LMHead chunked, evaluated under no_grad", lmhead_eval)

    def head_on_headless() -> None:
        autoremat.plan(net_tape(), None, "full", head="chunked:2")
    add("HF", "head='chunked:2' on a model without a loss head", head_on_headless, "head")

    def zoo_resnet() -> None:
        model, inputs = zoo.build("resnet", stage_channels=(8, 16), stem_channels=8,
                                  batch_size=4, image_size=16)
        plain = copy.deepcopy(model)
        chosen = autoremat.auto(model, inputs, strategy="full")
        want, _ = step(plain, inputs)
        got, peak = step(model, inputs)
        same_grads(want, got)
        expect(peak <= chosen.predicted_peak_bytes, f"{peak} B over the prediction")
        for (n, a), (_, b) in zip(plain.named_buffers(), model.named_buffers(), strict=True):
            expect(torch.equal(a, b), f"buffer {n} differs after a step")
    add("zoo", "resnet, every block recomputed (BatchNorm)", zoo_resnet)

    def zoo_llama() -> None:
        model, inputs = zoo.build("llama", n_layer=2, batch_size=2, seq_len=16)
        plain = copy.deepcopy(model)
        chosen = autoremat.auto(model, inputs, strategy="sqrt")
        want, _ = step(plain, inputs)
        got, peak = step(model, inputs)
        same_grads(want, got)
        expect(peak <= chosen.predicted_peak_bytes, f"{peak} B over the prediction")
    add("zoo", "llama, sqrt segments", zoo_llama)

    def regulariser() -> None:
        model, x = net()
        plain = copy.deepcopy(model)

        def reg(m: nn.Module) -> Callable[[Any], torch.Tensor]:
            return lambda o: o.sum() + 1e-3 * sum(p.pow(2).sum() for p in m.parameters())

        chosen = autoremat.plan(quick_profile(model, x, loss_fn=reg(model)), "80%")
        want, _ = step(plain, x, reg(plain))
        autoremat.apply(model, chosen)
        got, peak = step(model, x, reg(model))
        same_grads(want, got)
        expect(peak <= chosen.predicted_peak_bytes, f"{peak} B over the prediction")
    add("loops", "a loss with a weight regulariser", regulariser)

    def none_output() -> None:
        class Nothing(Net):
            def forward(self, x: torch.Tensor) -> None:  # type: ignore[override]
                super().forward(x)

        quick_profile(Nothing(), torch.randn(B, W))
    add("models", "a model whose forward returns None", none_output, "loss")

    def cli_plan_file_applied() -> None:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "plan.json"
            cli(["plan", "mlp", "--set", _MLP, "--budget", "70%", "--out", str(path)])
            chosen = Plan.from_json(path)
            model, inputs = zoo.build("mlp", widths=(32, 32, 32), d_in=32, batch_size=128)
            planned_step_right(model, inputs, chosen)
    add("CLI", "autoremat plan --out plan.json, then Plan.from_json + apply",
        cli_plan_file_applied)

    def cli_tape_file() -> None:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "tape.json"
            cli(["profile", "mlp", "--set", _MLP, "--out", str(path)])
            tape = Tape.from_json(path)
            expect([b.name for b in tape.blocks] == ["blocks.0", "blocks.1", "blocks.2"],
                   str([b.name for b in tape.blocks]))
            chosen = autoremat.plan(tape, "70%")
            expect(chosen.predicted_peak_bytes <= chosen.budget_bytes, "over budget")
    add("CLI", "autoremat profile --out tape.json, then plan in Python", cli_tape_file)

    def cli_doctor_json() -> None:
        text = cli(["doctor", "mlp", "--set", _MLP, "--memory", "1GiB", "--device", "cpu",
                    "--json"])
        data = json.loads(text)
        expect(isinstance(data, dict) and data.get("fits") is True, str(data)[:200])
    add("CLI", "autoremat doctor --json", cli_doctor_json)

    add("CLI", "autoremat doctor --plot into a missing folder",
        lambda: cli(["doctor", "mlp", "--plot", "/proc/no/such/m.png"]), "m.png",
        quick=True)

    def cli_bench() -> None:
        with tempfile.TemporaryDirectory() as d:
            cli(["bench", "mlp", "--set", _MLP, "--budgets", "70%", "--repeats", "1",
                 "--no-compile", "--out", d])
            data = json.loads((Path(d) / "results.json").read_text())
            expect(data.get("schema_version") == 1 and data.get("models"), str(data)[:200])
    add("CLI", "autoremat bench mlp --budgets 70% --repeats 1 --no-compile", cli_bench)

    def cli_gpt2_head() -> None:
        text = cli(["plan", "gpt2", "--set", "n_layer=2,batch_size=2,seq_len=16,n_embd=32,"
                    "n_head=2,vocab_size=512", "--budget", "60%", "--head", "auto"])
        expect("predicted" in text or "peak" in text, text[-200:])
    add("CLI", "autoremat plan gpt2 --head auto", cli_gpt2_head)

    def train_hf_gpt2(callback: Any, **settings: Any) -> nn.Module:
        """Two examples of the HF GPT-2 trained by the Trainer with ``callback``."""
        from transformers import Trainer, TrainingArguments

        model, batch = _hf_gpt2()
        data = [{"input_ids": batch["input_ids"][i], "labels": batch["labels"][i]}
                for i in range(2)]
        with tempfile.TemporaryDirectory() as d:
            args = TrainingArguments(output_dir=d, per_device_train_batch_size=2,
                                     report_to=[], use_cpu=True, save_strategy="no",
                                     **settings)
            Trainer(model=model, args=args, train_dataset=data,
                    callbacks=[callback]).train()
        return model

    def trainer() -> None:
        from autoremat.hf import AutorematCallback

        callback = AutorematCallback(strategy="full")
        model = train_hf_gpt2(callback, max_steps=2, logging_strategy="no")
        expect(callback.plan is not None and callback.plan.recompute_blocks,
               "no plan was applied")
        expect(autoremat.applied_plan(model) is None, "the plan stayed after training")
    add("HF", "Trainer with AutorematCallback(strategy='full'), two steps", trainer)

    def trainer_hf_ckpt() -> None:
        from autoremat.hf import AutorematCallback

        train_hf_gpt2(AutorematCallback(budget="60%"), max_steps=1,
                      gradient_checkpointing=True)
    add("HF", "Trainer(gradient_checkpointing=True) with AutorematCallback", trainer_hf_ckpt,
        "gradient_checkpointing")
    return c


# --- cases: models that checkpoint themselves, distributed, more Hugging Face --------------


class SelfCheckpointed(Block):
    """A block that already runs its body under ``torch.utils.checkpoint``."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(super().forward, x,
                                                 use_reentrant=self.reentrant)


class InPlaceBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x))


class MaskedBlock(Block):
    """Computes a mask under ``torch.no_grad()`` inside the block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            keep = (x.abs() > 0.1).float()
        return super().forward(x) * keep


@contextlib.contextmanager
def _one_rank() -> Iterator[None]:
    """A gloo process group of one rank (this process), torn down after."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0,
                                world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _more_models() -> list[Case]:
    c: list[Case] = []

    def add(cls: str, name: str, run: Callable[[], object], *names: str) -> None:
        c.append(Case(cls, name, run, tuple(names)))

    def own(block: Callable[[], nn.Module], strategy: str = "full") -> Callable[[], None]:
        def run() -> None:
            torch.manual_seed(0)
            _plan_and_check(Net(3, block=block), torch.randn(B, W), strategy=strategy)
        return run

    add("models", "blocks that checkpoint themselves (non-reentrant)", own(SelfCheckpointed))
    add("models", "blocks that checkpoint themselves (reentrant)",
        own(functools.partial(SelfCheckpointed, True)), "reentrant")
    add("models", "an nn.Identity among the blocks", own(nn.Identity))
    add("models", "ReLU(inplace=True) in every block", own(InPlaceBlock))
    add("models", "a mask computed under no_grad inside each block", own(MaskedBlock))
    add("models", "sqrt segments over self-checkpointing blocks", own(SelfCheckpointed, "sqrt"))

    def adversarial() -> None:
        torch.manual_seed(0)
        model = Net(3)
        model.requires_grad_(False)
        inp = torch.randn(B, W, requires_grad=True)
        tape = quick_profile(model, inp)
        chosen = autoremat.plan(tape, None, "full")
        plain = copy.deepcopy(model)
        torch.manual_seed(0)
        (want,) = torch.autograd.grad(plain(inp).sum(), inp)
        autoremat.apply(model, chosen)
        torch.manual_seed(0)
        (got,) = torch.autograd.grad(model(inp).sum(), inp)
        expect(torch.equal(want, got), "the input's gradient differs")
    add("models", "a frozen model, gradients w.r.t. the input only (adversarial)",
        adversarial)

    def ddp() -> None:
        from torch.nn.parallel import DistributedDataParallel

        with _one_rank():
            model, x = net(3)
            plain = copy.deepcopy(model)
            wrapped = DistributedDataParallel(model)
            chosen = autoremat.distributed.broadcast_plan(
                autoremat.plan(net_tape(3), None, "full"))
            autoremat.apply(wrapped, chosen)
            want, _ = step(plain, x)
            got, _ = step(wrapped, x)
            same_grads(want, {k.removeprefix("module."): v for k, v in got.items()})
    add("distributed", "DDP over one gloo rank, plan broadcast and applied", ddp)

    def fsdp() -> None:
        from torch.distributed.fsdp import fully_shard

        with _one_rank():
            model, x = net(3)
            plain = copy.deepcopy(model)
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            chosen = autoremat.plan(net_tape(3), None, "full")
            autoremat.apply(model, chosen)
            want, _ = step(plain, x)
            got, _ = step(model, x)
            for name, g in want.items():
                h = got[name]
                h = h.full_tensor() if hasattr(h, "full_tensor") else h
                expect(g is not None and h is not None and torch.equal(g, h),
                       f"{name}: gradient differs")
    add("distributed", "FSDP2 fully_shard over one gloo rank", fsdp)

    def fsdp_segments() -> None:
        from torch.distributed.fsdp import fully_shard

        with _one_rank():
            model, _ = net(4)
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            autoremat.apply(model, autoremat.plan(net_tape(4), None, "sqrt"))
    add("distributed", "a multi-block segment plan under FSDP2", fsdp_segments, "FSDP")

    def apply_ranks_outside() -> None:
        model, _ = net()
        chosen = autoremat.plan(net_tape(), None, "full")
        expect(autoremat.apply(model, chosen, check_ranks=True) is model, "not returned")
    add("distributed", "apply(check_ranks=True) outside a distributed run", apply_ranks_outside)

    try:
        import transformers  # noqa: F401
    except ImportError:
        return c

    def llama_head_auto() -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=512, max_position_embeddings=64,
            use_cache=False)).train()
        ids = torch.randint(0, 512, (2, 32))
        batch = {"input_ids": ids, "labels": ids}
        plain = copy.deepcopy(model)
        chosen = autoremat.auto(model, batch, strategy="full", head="chunked")
        expect(chosen.head_chunks is not None, "the head was not chunked")
        torch.manual_seed(0)
        want = plain(**batch).loss
        _, peak = step(model, batch)
        torch.manual_seed(0)
        out = model(**batch)
        expect(out.logits is None, "the chunked head built logits")
        expect(torch.allclose(out.loss, want, rtol=1e-5), f"loss {out.loss} vs {want}")
        expect(peak <= chosen.predicted_peak_bytes, f"{peak} B over the prediction")
    add("HF", "Llama with a chunked loss head", llama_head_auto)

    def t5() -> None:
        from transformers import T5Config, T5ForConditionalGeneration

        torch.manual_seed(0)
        model = T5ForConditionalGeneration(T5Config(
            num_layers=2, num_decoder_layers=2, d_model=16, d_ff=32, num_heads=2, d_kv=8,
            vocab_size=64, use_cache=False, decoder_start_token_id=0, pad_token_id=0)).train()
        ids = torch.randint(0, 64, (2, 8))
        _plan_and_check(model, {"input_ids": ids, "labels": ids})
    add("HF", "T5 encoder-decoder, every block recomputed", t5)

    def llama_estimate() -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=128, max_position_embeddings=64,
            use_cache=False)).train()
        ids = torch.randint(0, 128, (2, 16))
        batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
        tape = quick_profile(model, batch)
        est = autoremat.estimate(model, batch, device="cpu", selective=False)
        expect(abs(est.step_peak_bytes - tape.step_peak_bytes) <= 0.01 * tape.step_peak_bytes,
               f"estimate {est.step_peak_bytes} B, profile {tape.step_peak_bytes} B")
    add("HF", "estimate equals profile (HF Llama with attention_mask)", llama_estimate)
    return c


# --- the table ---------------------------------------------------------------------------------


def all_cases(quick: bool = False) -> list[Case]:
    cases = (_arguments() + _models() + _loops() + _plan_files() + _cli_cases() + _hf()
             + _compile_devices() + _zoo_cases() + _workflows() + _more_models())
    names = [(c.cls, c.name) for c in cases]
    assert len(names) == len(set(names)), "two cases share a name"
    return [c for c in cases if c.quick] if quick else cases


def counts(results: Sequence[Result]) -> dict[str, dict[str, int]]:
    table: dict[str, Counter[str]] = {}
    for r in results:
        table.setdefault(r.cls, Counter())[r.outcome] += 1
    return {cls: {o: table[cls][o] for o in OUTCOMES} for cls in table}


def write_results(results: Sequence[Result], out: Path, seconds: float,
                  before: dict[str, Any] | None = None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    per_class = counts(results)
    total = {o: sum(c[o] for c in per_class.values()) for o in OUTCOMES}
    data = {"schema_version": SCHEMA_VERSION, "command": "python benchmarks/misuse_sweep.py",
            "torch": torch.__version__, "python": platform.python_version(),
            "autoremat": autoremat.__version__, "seconds": round(seconds, 1),
            "cases": len(results), "counts": per_class, "total": total,
            "before": before, "results": [dataclasses.asdict(r) for r in results]}
    if before:  # only the counts and the cases that were silent or raw
        data["before"] = {"counts": before["counts"], "total": before["total"],
                          "silent_or_raw": [f"{r['outcome']} {r['cls']}: {r['name']}"
                                            for r in before["results"]
                                            if r["outcome"] in ("silent", "raw")]}
    lines = ["# Misuse sweep (issue 26)", "",
             f"`PYTHONPATH=src python benchmarks/misuse_sweep.py`: {len(results)} cases, "
             f"{seconds:.0f} s on this machine (torch {torch.__version__}, Python "
             f"{platform.python_version()}). What each outcome means: the docstring of "
             "[`benchmarks/misuse_sweep.py`](../misuse_sweep.py).", "",
             "| class | " + " | ".join(OUTCOMES) + " | cases |",
             "|---|" + "---:|" * (len(OUTCOMES) + 1)]
    for cls, row in per_class.items():
        lines.append(f"| {cls} | " + " | ".join(str(row[o]) for o in OUTCOMES)
                     + f" | {sum(row.values())} |")
    lines.append("| **all** | " + " | ".join(f"**{total[o]}**" for o in OUTCOMES)
                 + f" | **{len(results)}** |")
    if before:
        lines += ["", "Before the fixes of the branch that added the sweep (the same cases "
                  "run on the code before them): "
                  + ", ".join(f"{o} {before['total'][o]}" for o in OUTCOMES) + ". By class:",
                  "", "| class | " + " | ".join(OUTCOMES) + " |",
                  "|---|" + "---:|" * len(OUTCOMES)]
        lines += [f"| {cls} | " + " | ".join(str(row[o]) for o in OUTCOMES) + " |"
                  for cls, row in before["counts"].items()]
    bad = [r for r in results if r.outcome in ("silent", "raw")]
    if bad:
        lines += ["", "## Silent and raw cases left", ""]
        lines += [f"- **{r.outcome}** {r.cls}: {r.name}. {r.detail}"
                  + (f" *({r.note})*" if r.note else "") for r in bad]
    lines += ["", "## Every case", "", "| class | case | outcome | what happened |",
              "|---|---|---|---|"]
    for r in results:
        detail = r.detail.replace("|", "\\|")[:200]
        lines.append(f"| {r.cls} | {r.name.replace('|', '/')} | {r.outcome} | {detail} |")
    paths = [out / "misuse_sweep.json", out / "misuse_sweep.md"]
    for path, text in ((paths[0], json.dumps(data, indent=1) + "\n"),
                       (paths[1], "\n".join(lines) + "\n")):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="only the CI subset (no profile); writes no files")
    parser.add_argument("--only", help="comma-separated classes, e.g. CLI,plan-files")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--before", help="a misuse_sweep.json from before the fixes, whose "
                                         "counts the report repeats")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cases = all_cases(args.quick)
    if args.only:
        keep = set(args.only.split(","))
        cases = [c for c in cases if c.cls in keep]
    start = time.perf_counter()
    results = run_cases(cases)
    seconds = time.perf_counter() - start
    per_class = counts(results)
    for cls, row in per_class.items():
        print(f"{cls:12} " + "  ".join(f"{o} {row[o]}" for o in OUTCOMES))
    if not args.quick and not args.only:
        before = json.loads(Path(args.before).read_text()) if args.before else None
        for path in write_results(results, Path(args.out), seconds, before):
            print(f"wrote {path}")
    bad = sum(row["silent"] + row["raw"] for row in per_class.values())
    print(f"{len(results)} cases in {seconds:.0f} s; silent + raw: {bad}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
