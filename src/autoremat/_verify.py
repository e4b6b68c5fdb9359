"""``verify``: run the step with and without the plan and compare what matters.

NOTE [ Judging gradients ]
    A correct plan recomputes exactly what the plain step computed, so on the CPU, where
    almost every kernel is deterministic, its gradients are ``torch.equal`` to the plain
    model's and nothing less is accepted, unless the plain step does not reproduce itself
    either: where the gradients differ, the CPU's default runs the plain step once more,
    and judges against that floor (below) where it is rounding (``_rounding_level``: at
    most 64 epsilons of the largest gradient; randomness no seed replays, numpy's, moves
    them far more and is still judged by ``torch.equal``). Found on a held-out
    Qwen3-MoE: its experts' grouped matmul sums in another order from run to run with
    two threads (1.5e-8, 2.5e-7 of the largest gradient), and ``verify`` failed a plan
    that keeps every block. On CUDA many kernels are not deterministic (atomic adds in
    reductions, attention and embedding backward): the plain model differs from *itself*
    by ~1e-8 from run to run, and so would every plan, correct ones included. Two ways
    out:

    * ``deterministic=True``: both steps run under
      ``torch.use_deterministic_algorithms(True)`` (restored afterwards) and are compared
      with ``torch.equal``. cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (or ``:16:8``)
      in the environment when it initialises, so verify checks it up front; an op with no
      deterministic implementation raises a :class:`~autoremat.DeterminismError`.
    * otherwise, on a device other than the CPU (or with ``measure_noise=True``): the
      **noise floor**. The plain step runs a second time from the same RNG state; the
      largest |difference| between the two runs' gradients is the floor. The plan's
      gradients are "equal" when ``torch.equal``, "within noise" when their largest
      |difference| from the plain step's is at most ``NOISE_MULTIPLE`` (4) times the
      floor, and "differ" otherwise. A floor of 0 (the plain step reproduced itself
      exactly) leaves no room: then only ``torch.equal`` passes.

    Why 4: the floor is one sample of the run-to-run noise and the plan's difference is
    another sample of the same noise (a correct plan runs the same kernels, a recompute
    once more), so the two are alike but not equal; the maximum over many gradient
    entries of one sample can be a few times another's. 4x leaves room for that, and is
    still 4-6 orders of magnitude below what a wrong plan does: a re-drawn dropout mask
    or a BatchNorm updated twice changes gradients by 1e-4 to 1, against a floor of
    ~1e-8. (The project states its tolerances as multiples or percentages of a measured
    reference, as with the 5% for predicted peaks; this is that, for gradients.)
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import warnings
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from autoremat._apply import applied_plan, apply, compile_model, remove
from autoremat._core.calls import calls_for
from autoremat._core.decisions import Decision
from autoremat._core.errors import (
    DeterminismError,
    LoopError,
    RematError,
    check_flag,
    check_whole,
)
from autoremat._core.head import HEAD_RTOL
from autoremat._core.step import LossFn, Step, as_step, training_config
from autoremat._core.tables import render_table
from autoremat._core.units import format_bytes
from autoremat._measure.flops import FlopCounter
from autoremat._measure.measured import measure_step
from autoremat._mechanism.compiled import compiled_forwards, forget_compiled, uncompiled
from autoremat._plan.plan import Plan
from autoremat._profile.runs import compile_settings

__all__ = ["NOISE_MULTIPLE", "GradientJudgement", "Report", "Verdict", "judge_gradients",
           "max_grad_diff", "step_measure", "verify"]

Verdict = Literal["equal", "within noise", "differ"]

NOISE_MULTIPLE = 4.0  # plan's max |Δgrad| allowed, in noise floors (NOTE [ Judging gradients ])

# cuBLAS workspace settings under which cuBLAS is deterministic (PyTorch's randomness notes)
_CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


@dataclass(frozen=True)
class Report:
    """What :func:`verify` measured. ``ok``: gradients equal (or within the noise floor,
    see NOTE [ Judging gradients ]) and peak within budget."""

    ok: bool
    grads_equal: bool  # every gradient torch.equal to the plain model's
    max_grad_diff: float  # max |grad - plain grad| over all parameters
    peak_bytes: int  # measured step peak with the plan (peak_source says how)
    plain_peak_bytes: int  # measured step peak without it
    predicted_peak_bytes: int  # the plan's prediction
    budget_bytes: int | None  # the plan's budget
    recompute_flops: int  # extra FLOPs of the planned step (flop counter)
    plain_flops: int  # FLOPs of the plain step
    step_ms: float  # median planned step time (interleaved with plain)
    plain_step_ms: float  # median plain step time
    time_spread: float  # (max - min) / median of the planned step times
    deterministic: bool = False  # both steps ran under torch.use_deterministic_algorithms
    noise_floor: float = 0.0  # max |grad - grad| of the plain step against itself; 0.0
    #                           when not measured (CPU, deterministic=True)
    noise_measured: bool = False  # the floor was measured (a second plain step ran)
    peak_source: Literal["tracker", "allocator"] = "tracker"  # storage accounting, or
    #                           the rise of torch.cuda.max_memory_allocated() (CUDA)
    tracked_peak_bytes: int | None = None  # the tracker's planned peak, when peak_bytes
    #                                        is the allocator's
    plain_time_spread: float = 0.0  # (max - min) / median of the plain step times
    timed_pairs: int = 0  # interleaved (plain, planned) pairs timed after the warm-up
    # A chunked loss head (plan.head): the gradients are judged by the largest
    # max |diff| / max |plain| of any parameter against head_bound (NOTE [ What a chunked
    # head changes in numerics ]); None: the plan keeps the head, judged as ever.
    head_rel_diff: float | None = None
    head_bound: float | None = None
    # The backend the plan was fitted with compiled whole (auto(compile=...)): the peaks
    # and the prediction are then of the step compiled whole, as auto measured it, and
    # tracked_peak_bytes the eager step's (NOTE [ Verifying a plan fitted compiled
    # whole ]); "": the steps ran as the model is
    compiled: str = ""
    # With ``compiled``: "whole" (a plan fitted compiled whole), or "blocks" (a plan from
    # a tape profiled compiled, each block compiled on its own: NOTE [ Verifying a plan
    # from a compiled tape ])
    compiled_as: Literal["", "whole", "blocks"] = ""
    # With ``compiled``: max |diff| of the gradients of the planned step run compiled
    # against the plain step run compiled, and what it may be: the compiled plain step's
    # own max |diff| to the eager plain step, or the noise floor's allowance if larger
    # (NOTE [ Compiled gradients ]); None: not compiled
    compiled_grad_diff: float | None = None
    compiled_grad_bound: float | None = None

    @property
    def compiled_grads_ok(self) -> bool:
        """The compiled steps' gradients within their bound (True when not compiled)."""
        return self.compiled_grad_diff is None or (
            self.compiled_grad_bound is not None
            and self.compiled_grad_diff <= self.compiled_grad_bound)

    @property
    def head_ok(self) -> bool:
        """With a chunked head, every gradient within its stated bound (True when the plan
        keeps the head)."""
        return self.head_rel_diff is None or (self.head_bound is not None
                                              and self.head_rel_diff <= self.head_bound)

    @property
    def grads_verdict(self) -> Verdict:
        """"equal", "within noise" (of the plain step's own noise floor) or "differ"."""
        return _verdict(self.grads_equal, self.max_grad_diff, self.noise_floor)

    @property
    def recompute_overhead(self) -> float:
        return self.recompute_flops / self.plain_flops if self.plain_flops else 0.0

    @property
    def time_ratio(self) -> float:
        return self.step_ms / self.plain_step_ms if self.plain_step_ms else float("nan")

    @property
    def time_noise(self) -> float:
        """How far ``time_ratio`` can stray from the truth on this machine: the larger
        relative spread ((max - min) / median) of the plain and the planned step times."""
        return max(self.time_spread, self.plain_time_spread)

    @property
    def time_within_noise(self) -> bool:
        """``time_ratio`` is within ``time_noise`` of 1: the runs cannot tell the plan's
        step time from the plain one's (and with one timed pair they cannot tell anything)."""
        return self.timed_pairs < 2 or abs(self.time_ratio - 1.0) <= self.time_noise

    @property
    def time_text(self) -> str:
        """``time_ratio`` with its noise, e.g. ``x0.74 ±0.31 (within noise)``."""
        if self.timed_pairs < 2:
            return f"x{self.time_ratio:.2f} (1 timed run: noise not measured)"
        noise = " (within noise)" if self.time_within_noise else ""
        return f"x{self.time_ratio:.2f} ±{self.time_noise:.2f}{noise}"

    @property
    def prediction_error(self) -> float:
        """(predicted - measured) / measured peak."""
        return (self.predicted_peak_bytes - self.peak_bytes) / max(self.peak_bytes, 1)

    def __str__(self) -> str:
        budget = format_bytes(self.budget_bytes) if self.budget_bytes is not None else "none"
        how = "block by block" if self.compiled_as == "blocks" else "whole"
        peak_row = "step peak" + (f" (compiled {how}, {self.compiled})" if self.compiled else
                                  " (allocator)" if self.peak_source == "allocator" else "")
        rows = [
            [peak_row, format_bytes(self.plain_peak_bytes), format_bytes(self.peak_bytes)],
            ["predicted peak", "", format_bytes(self.predicted_peak_bytes)],
            ["FLOPs", f"{self.plain_flops / 1e9:.3f} G",
             f"{(self.plain_flops + self.recompute_flops) / 1e9:.3f} G"],
            ["step time (median)", f"{self.plain_step_ms:.1f} ms", f"{self.step_ms:.1f} ms"],
        ]
        if self.tracked_peak_bytes is not None:
            rows.insert(1, ["step peak (eager)" if self.compiled else "step peak (tracker)",
                            "", format_bytes(self.tracked_peak_bytes)])
        verdict = "OK" if self.ok else "FAILED"
        grads = {"equal": "gradients equal", "within noise": "gradients within noise",
                 "differ": "gradients DIFFER"}[self.grads_verdict]
        if self.deterministic:
            floor = "deterministic algorithms"
        elif self.noise_measured:
            floor = f"noise floor {self.noise_floor:.3g}"
            if self.grads_verdict == "within noise":
                floor += f" (allowed: {NOISE_MULTIPLE:g}x)"
        else:
            floor = "noise floor not measured"
        if self.compiled_grad_diff is not None:
            grads += (f"; compiled: max |diff| {self.compiled_grad_diff:.3g} to the compiled "
                      f"plain step (allowed {self.compiled_grad_bound:.3g}, its own to eager"
                      + (")" if self.compiled_grads_ok else ": EXCEEDED)"))
        if self.head_rel_diff is not None:
            grads += (f"; chunked loss head: gradients within {self.head_rel_diff:.2g} of "
                      f"max |grad| (bound {self.head_bound:.2g}"
                      + (")" if self.head_ok else ": EXCEEDED)"))
        return (f"verify: {verdict} (budget {budget}; {grads}, max |diff| "
                f"{self.max_grad_diff:.3g}, {floor}; recompute "
                f"+{100 * self.recompute_overhead:.1f}% FLOPs, time {self.time_text}"
                + ("; FLOPs and times of the eager steps" if self.compiled else "") + ")\n"
                + render_table(["", "plain", "planned"], rows))


# --- judging gradients (pure) ---------------------------------------------------------------

Grads = Mapping[str, torch.Tensor | None]


@dataclass(frozen=True)
class GradientJudgement:
    """What :func:`judge_gradients` found."""

    verdict: Verdict
    grads_equal: bool  # every gradient torch.equal (and both sides have the same ones)
    max_grad_diff: float  # max |a - b| over all entries; inf when one side lacks a gradient
    noise_floor: float  # the floor it was judged against


def max_grad_diff(a: Grads, b: Grads) -> tuple[bool, float]:
    """(every gradient ``torch.equal``, max |a - b|) over the parameters of ``a``.

    A gradient present on one side only, or of another shape, is unequal by ``inf``; a
    NaN difference makes the maximum NaN (which no floor accepts). NaN on both sides at
    the same entries is equal there (NOTE [ Gradients that are NaN in the plain step ]).
    """
    equal, worst = True, 0.0
    for name, x in a.items():
        y = b.get(name)
        if x is None or y is None:
            if (x is None) != (y is None):
                equal, worst = False, math.inf
            continue
        if x.shape != y.shape:
            equal, worst = False, math.inf
            continue
        if x.layout is not torch.strided or y.layout is not torch.strided:
            x, y = x.to_dense(), y.to_dense()  # nn.Embedding(sparse=True)'s, summed
        if torch.equal(x, y):
            continue
        x, y = _nan_matched(x, y)
        if torch.equal(x, y):
            continue
        equal = False
        if x.numel():
            diff = float((x.double() - y.double()).abs().max())
            worst = math.nan if math.isnan(diff) or math.isnan(worst) else max(worst, diff)
    return equal, worst


def _warn_not_finite(grads: Grads) -> None:
    """Warn where the plain step's gradients hold NaN or infinity (NOTE [ Gradients that
    are NaN in the plain step ]): a verdict of "equal" then says the plan gives the same
    ones, not that they train."""
    bad = [name for name, g in grads.items() if g is not None
           and (g.is_floating_point() or g.is_complex())
           and not bool(torch.isfinite(g.to_dense() if g.layout is not torch.strided
                                       else g).all())]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        warnings.warn(f"autoremat: the plain step's gradients are not finite (NaN or inf) "
                      f"in {shown}: verify judges the plan's against them as they are "
                      f"(NaN against NaN at the same entries is equal), and the model does "
                      f"not train so with or without a plan (a dtype that overflows, a "
                      f"learning rate, the data?)", UserWarning, stacklevel=3)


def _nan_matched(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and ``y`` with the entries that are NaN in both set to 0.

    NOTE [ Gradients that are NaN in the plain step ]
        ``torch.equal`` is False for NaN against NaN, so a plan that gives the plain
        step's NaN gradients bit for bit was judged "differ", max |diff| NaN. Entries
        NaN on both sides are equal; a NaN on one side only still differs, by NaN, and
        ``verify`` warns that the plain step's gradients are not finite. Found on timm's
        LambdaNet under bf16 autocast on the CPU (a held-out check, 2026-12-02), whose
        lambda convolutions' weight gradients are NaN: there the plain step puts its
        NaN at other entries from run to run (160 and 128 of one weight's), so its plans
        still differ, now with the warning that names them."""
    if not (x.is_floating_point() or x.is_complex()):
        return x, y
    both = x.isnan() & y.isnan()
    if not bool(both.any()):
        return x, y
    return x.masked_fill(both, 0), y.masked_fill(both, 0)


def _verdict(equal: bool, diff: float, floor: float) -> Verdict:
    if equal:
        return "equal"
    if floor > 0 and diff <= NOISE_MULTIPLE * floor:  # False for a NaN diff
        return "within noise"
    return "differ"


def judge_gradients(plain: Grads, planned: Grads, noise_floor: float = 0.0) -> GradientJudgement:
    """Judge a plan's gradients against the plain step's (NOTE [ Judging gradients ]).

    Args:
        plain, planned: gradients by parameter name (``None`` for none).
        noise_floor: max |difference| of the plain step against itself; 0 (the default,
            and what deterministic kernels give) accepts only ``torch.equal``.

    Example:
        >>> a = {"w": torch.tensor([1.0, 2.0])}
        >>> judge_gradients(a, {"w": torch.tensor([1.0, 2.0])}).verdict
        'equal'
        >>> judge_gradients(a, {"w": torch.tensor([1.0, 2.5])}, noise_floor=0.25).verdict
        'within noise'
        >>> judge_gradients(a, {"w": torch.tensor([1.0, 2.5])}).verdict
        'differ'
    """
    if not noise_floor >= 0 or math.isinf(noise_floor):  # also refuses NaN
        raise RematError(f"noise_floor must be a finite number >= 0, got {noise_floor!r}")
    equal, diff = max_grad_diff(plain, planned)
    return GradientJudgement(_verdict(equal, diff, noise_floor), equal, diff, noise_floor)


# --- determinism ------------------------------------------------------------------------------


def _check_cublas_workspace(device: torch.device | str,
                           environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`~autoremat.DeterminismError` when ``device`` is a CUDA device and
    cuBLAS is not configured to be deterministic (``CUBLAS_WORKSPACE_CONFIG``)."""
    if torch.device(device).type != "cuda":
        return
    value = (os.environ if environ is None else environ).get("CUBLAS_WORKSPACE_CONFIG")
    if value not in _CUBLAS_DETERMINISTIC:
        raise DeterminismError(
            f"verify(deterministic=True) on {device} needs cuBLAS's deterministic "
            f"workspace, but CUBLAS_WORKSPACE_CONFIG is {value!r}: start the process with "
            f"CUBLAS_WORKSPACE_CONFIG=:4096:8 (or :16:8) in its environment (cuBLAS reads "
            f"it when it initialises, so setting os.environ in a running process is too "
            f"late), or pass deterministic=False to judge the plan against the plain "
            f"model's own noise floor")


@contextmanager
def _deterministic_algorithms(device: torch.device) -> Iterator[None]:
    """Run the block under ``torch.use_deterministic_algorithms(True)``; the previous
    setting (``warn_only`` included) comes back on exit, also when the block raises. An
    op with no deterministic implementation becomes a :class:`~autoremat.DeterminismError`
    (chained to torch's error)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    except RuntimeError as exc:
        text = str(exc)
        marker = " does not have a deterministic implementation"
        if marker not in text and "CUBLAS_WORKSPACE_CONFIG" not in text:
            raise
        op = text.split(marker)[0].strip() if marker in text else "a cuBLAS call"
        raise DeterminismError(
            f"verify(deterministic=True): {op} has no deterministic implementation on "
            f"{device} (torch: {text.splitlines()[0][:300]}). Pass deterministic=False to "
            f"judge the plan against the plain model's own run-to-run noise floor instead"
        ) from exc
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


# --- measuring --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepMeasure:
    peak_bytes: int  # the storage tracker's step peak
    flops: int
    grads: dict[str, torch.Tensor | None]
    allocator_peak_bytes: int | None = None  # rise of max_memory_allocated (CUDA only)


def compiled_whole(step: Step, applied: Plan, backend: str, *, timed: bool = True,
                   rng: torch.Tensor | None = None, grads: GradsOut | None = None,
                   ) -> tuple[int, float]:
    """The step peak with ``applied`` applied and the model compiled whole
    (``compile_model``; ``_compiled_peak``, with ``rng`` and ``grads``), and (``timed``)
    its median time over ``_FIT_TIMED`` steps, else 0.0."""
    inner = uncompiled(step.model)
    compiled = compile_model(inner, backend=backend)
    run = dataclasses.replace(step, model=compiled, loop=applied.loop)
    try:
        peak = _compiled_peak(run, backend, rng, grads)
        with compile_settings(backend):
            times = [measure_step(run, timed=True).wall_ms or 0.0
                     for _ in range(_FIT_TIMED if timed else 0)]
    finally:
        forget_compiled(inner)  # the user's compile starts afresh (forget_compiled)
    return peak, statistics.median(times) if times else 0.0


def compiled_by_block(step: Step, names: list[str], backend: str,
                      rng: torch.Tensor | None = None, grads: GradsOut | None = None) -> int:
    """The step peak with each block of ``names`` compiled on its own, over whatever plan
    is applied, as ``profile(compile=...)`` measured the step (``compiled_forwards``;
    ``_compiled_peak``, with ``rng`` and ``grads``; NOTE [ Verifying a plan from a
    compiled tape ])."""
    model = step.model
    # blocks the user compiled (module.compile()) are measured as the profile measured
    # them, their own compile set aside: compiled again inside it, a mask model's plan
    # measured 5% over its step, and was judged FAILED (a held-out check, 2026-11-29)
    with calls_for(model, names):
        theirs = [(m, m._compiled_call_impl) for m in map(model.get_submodule, names)
                  if getattr(m, "_compiled_call_impl", None) is not None]
        for m, _ in theirs:
            m._compiled_call_impl = None
        if theirs:  # their compiles filled Dynamo's caches for these frames: start afresh
            torch._dynamo.reset()
        try:
            with compiled_forwards(model, names, backend):
                try:
                    return _compiled_peak(step, backend, rng, grads)
                finally:
                    forget_compiled(model)
        finally:
            for m, compiled in theirs:
                m._compiled_call_impl = compiled


GradsOut = dict[str, torch.Tensor | None]  # filled with the gradients of a step


def _compiled_peak(step: Step, backend: str, rng: torch.Tensor | None = None,
                   grads: GradsOut | None = None) -> int:
    """The peak of ``step``, run compiled, after a first step that compiles: the rise of
    the allocator's counters on CUDA, its reports elsewhere (a dispatch mode would make
    Dynamo run the step eagerly). The measured step starts from the RNG state ``rng``
    (default: where the first left it); ``grads``, if given, is filled with its
    gradients."""
    on_cuda = torch.device(step.device).type == "cuda"
    with compile_settings(backend):
        found = measure_step(step, memory=None if on_cuda else "allocations",
                             allocator=on_cuda, warm_up=True, rng=rng,
                             grads=grads is not None)
    if grads is not None and found.grads is not None:
        grads.update(_own_names(found.grads))
    return found.allocator_peak_bytes if found.allocator_peak_bytes is not None \
        else found.peak_bytes


def _own_names(grads: GradsOut) -> GradsOut:
    """``grads`` by the model's own parameter names: a torch.compile wrapper's carry its
    ``_orig_mod.`` (verify given the wrapper compared its eager steps' names with the
    compiled steps' own, found every gradient missing, and judged against an infinite
    bound: a held-out check, 2026-11-30)."""
    return {name.replace("_orig_mod.", ""): g for name, g in grads.items()}


_FIT_TIMED = 5  # timed steps of each plan fit_compiled measures


# NOTE [ Verifying a plan from a compiled tape ]
#     A tape profiled compiled (profile(compile=...)) predicts the step with each block
#     compiled on its own (NOTE [ Profiling a compiled step ] in _profile/runs.py); its
#     saves can differ from the eager step's (a GELU written in Python, "gelu_new": an
#     eager BERT step 1 MiB over its compiled prediction, compiled to the byte). So
#     verify measures both steps' peaks with each block compiled so (the plain step's
#     blocks too), and judges them against the budget and the prediction; gradients,
#     FLOPs and times stay the eager steps'.


# NOTE [ Verifying a plan fitted compiled whole ]
#     auto(compile=...) chooses its plan by the peak of the model compiled whole
#     (``plan.compiled_peak_bytes``; NOTE [ Compiled plans are fitted by measurement ] in
#     _auto.py). verify's steps run under the storage tracker, a dispatch mode, under which
#     Dynamo runs the model eagerly: a Gemma 2 whose plan measured 5.23 MB compiled, for a
#     5.32 MB budget, was reported FAILED at its eager 6.26 MB. For such a plan the peaks
#     of both steps are measured compiled whole, as auto measured them (the allocator's
#     rise on CUDA, its reports elsewhere), and judged against the budget and
#     ``compiled_peak_bytes``; gradients, FLOPs and times stay the eager steps', run on
#     the model itself where verify was given its compiled wrapper (whose alternating
#     plan on and off would recompile it at every step). Measuring compiled starts the
#     model's compiled code afresh, as auto does.


# NOTE [ Compiled gradients ]
#     Under torch.compile a plan's gradients are judged against the compiled plain step's,
#     within that step's own difference to the eager plain step (the standard of
#     docs/design.md): the two compiled steps verify measures peaks in (NOTE [ Verifying a
#     plan fitted compiled whole ], NOTE [ Verifying a plan from a compiled tape ]) start
#     from the eager steps' RNG state and keep their gradients. The eager steps' verdict
#     (``grads_equal``) says nothing of the compiled ones: in a loop that drops the
#     output, a Llama whose selective blocks save attention (torch's selective
#     checkpointing under compile, aot_eager) computed gradients 7.45e-9 from the compiled
#     plain step's, which equals the eager step's to the bit, and verify, comparing the
#     eager steps, said "max |diff| 0" (a held-out check, 2026-11-30; in verify's loop,
#     which holds the output, the compiled plain step is 7.45e-9 from eager itself and the
#     planned one equals it). ``ok`` now requires both verdicts.


def step_measure(step: Step, rng: torch.Tensor | None = None) -> StepMeasure:
    """One step from the RNG state ``rng`` (default: the current one): measured peak,
    FLOPs and gradients (clones), leaving no trace. On CUDA the allocator's peak is
    measured in the same step (the tracker allocates nothing)."""
    rng = torch.get_rng_state() if rng is None else rng
    measured = measure_step(step, memory="storages", allocator=True, rng=rng, grads=True)
    counter = FlopCounter()
    measure_step(step, counter=counter, rng=rng)
    assert measured.grads is not None  # for mypy: asked for
    return StepMeasure(measured.peak_bytes, counter.total, _own_names(measured.grads),
                       measured.allocator_peak_bytes)


def _head_params(model: nn.Module, plan: Plan) -> set[str]:
    """The parameters whose gradients a chunked head changes by summation order: its
    projection's, and through the hidden states' gradient (NOTE [ What a chunked head
    changes in numerics ]) possibly every one below it; so all of them, for a plan that
    chunks the head."""
    if plan.head.decision is Decision.KEEP:
        return set()
    return {name for name, _ in model.named_parameters()}


# NOTE [ Gradients that cancel ]
#     Some parameters' gradients are zero in exact arithmetic and only rounding noise in
#     floats: an attention key's bias (softmax does not change when one score is added to
#     a whole row) shows 1e-11 of the model's largest gradient. Relative to its own
#     maximum, any change of summation order below the head moves such a gradient by 100%,
#     though by 1e-11 of the step's gradients. So a chunked head's gradients are judged
#     relative to the larger of their own maximum and ``_CANCELLED`` times the largest
#     gradient of the step: a gradient a hundred times smaller than the largest one is
#     judged on that scale. A wrong head (a wrong normaliser, a missing transform) moves
#     the large gradients too, and still fails. The scale was a thousandth until a
#     held-out Funnel (its decoder's key bias, 1.6e-8 of the largest gradient, moved by
#     7e-9 to 1.1e-8 of it: 1.06e-5 on that scale, over float32's 1e-5, at 4 and 32
#     chunks): rounding in a cancelled sum is the rounding of its terms, which are as
#     large as other parameters' gradients, not its own.
_CANCELLED = 1e-2


def _judge_head(plain: Grads, planned: Grads, names: set[str]) -> tuple[float | None, float]:
    """Largest ``max |diff| / max |plain|`` over the head's gradients, and the bound of
    their dtype (:data:`HEAD_RTOL`); NOTE [ Gradients that cancel ]."""
    if not names:
        return None, 0.0
    worst, bound = 0.0, math.inf
    own = {n: float(g.double().abs().max()) for n in names
           if (g := plain.get(n)) is not None and g.numel()}  # each gradient's max |x|
    largest = max(own.values(), default=0.0)
    for name in names:
        x, y = plain.get(name), planned.get(name)
        if x is None or y is None or x.shape != y.shape:
            if (x is None) != (y is None) or (x is not None and y is not None):
                return math.inf, HEAD_RTOL.get(torch.float32, 0.0)
            continue
        bound = min(bound, HEAD_RTOL.get(x.dtype, HEAD_RTOL[torch.float32]))
        mine = own[name] if name in own else float(x.double().abs().max())
        scale = max(mine, _CANCELLED * largest) or 1.0
        diff = float((x.double() - y.double()).abs().max()) / scale
        worst = math.nan if math.isnan(diff) else max(worst, diff)
    return worst, bound


# A floor the CPU's default accepts: what another summation order can move a gradient
# by, in units of its dtype's epsilon times the step's largest gradient (a run-to-run
# floor of 2.5e-7 of it on Qwen3-MoE, fp32); a wrong plan moves them by 1e-4 to 1 of it
_ROUNDING_EPS = 64


def _rounding_level(grads: Grads) -> float:
    """The largest run-to-run difference of the plain step's gradients that rounding
    explains (:data:`_ROUNDING_EPS`); a larger one is randomness no seed replays, against
    which no plan can be judged (NOTE [ Judging gradients ])."""
    level = 0.0
    for g in grads.values():
        if g is not None and g.numel() and (g.is_floating_point() or g.is_complex()):
            level = max(level, _ROUNDING_EPS * torch.finfo(g.dtype).eps
                        * float(g.detach().abs().max()))
    return level


def _plain_grads(step: Step, rng: torch.Tensor) -> dict[str, torch.Tensor | None]:
    grads = measure_step(step, rng=rng, grads=True).grads
    assert grads is not None  # for mypy: asked for
    return _own_names(grads)


def _time_step(step: Step, rng: torch.Tensor) -> float:
    wall_ms = measure_step(step, rng=rng, timed=True).wall_ms
    assert wall_ms is not None  # for mypy: asked for
    return wall_ms


def verify(model: nn.Module | Step, inputs: Any = None, plan: Plan | None = None, *,
           loss_fn: LossFn | None = None, repeats: int = 3, deterministic: bool = False,
           measure_noise: bool | None = None) -> Report:
    """Run one step with and one without the plan and compare them.

    Both steps start from the same RNG state and BatchNorm statistics, so dropout draws
    the same masks, and follow the training loop the plan was made for (``plan.loop``);
    gradients are judged as NOTE [ Judging gradients ] says: with ``torch.equal``, or on
    CUDA against the plain model's own run-to-run noise. Times are medians of ``repeats``
    interleaved plain/planned steps after one warm-up each, CUDA-synchronised on a GPU,
    with the user's determinism setting. On CUDA the peak is the rise of
    ``torch.cuda.max_memory_allocated()`` (after one unmeasured warm-up step, so that
    one-time allocations such as cuBLAS's workspace are not in it), and the tracker's
    figure is reported beside it.

    Args:
        model, inputs, loss_fn: as for :func:`autoremat.profile`; or an
            :class:`autoremat.Step` in place of all three, with the plan by keyword
            (``verify(step, plan=plan)``), whose ``loop`` must be the plan's.
        plan: the plan to check; default the plan applied to ``model``.
        repeats: timed steps of each kind (after one warm-up).
        deterministic: run both measured steps under
            ``torch.use_deterministic_algorithms(True)`` and require ``torch.equal``. On
            CUDA the process must have been started with
            ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (or ``:16:8``).
        measure_noise: measure the plain step's noise floor (one more plain step) and
            judge against it. Default (``None``): on any device but the CPU, unless
            ``deterministic``; on the CPU only where the gradients are not
            ``torch.equal`` (a kernel that sums in another order from run to run).

    Returns:
        A :class:`Report`. ``report.ok`` is true only when the gradients are equal (or
        within the noise floor) and the measured peak is within the plan's budget (when
        it has one). The model is left with the plan applied, its gradients, buffers, the
        RNG and the determinism setting as before.

    Raises:
        DeterminismError: ``deterministic=True`` and cuBLAS is not configured for it, or
            an op has no deterministic implementation.

    Example:
        >>> import autoremat
        >>> model, inputs = autoremat.zoo.build("mlp", widths=(128,) * 4, batch_size=256)
        >>> plan = autoremat.auto(model, inputs, budget="75%")
        >>> autoremat.verify(model, inputs).grads_equal
        True
    """
    given = as_step(model, inputs, loss_fn, None, caller="verify", keyword="plan")
    before = applied_plan(given.model)
    plan = plan or before
    if plan is None:
        raise RematError("verify() needs a plan: pass plan=..., or apply one first "
                         "(autoremat.apply / autoremat.auto)")
    check_whole("repeats", repeats, 1, "the steps timed")
    check_flag("deterministic", deterministic)
    if measure_noise is not None:
        check_flag("measure_noise", measure_noise)
    if deterministic and measure_noise:
        raise RematError("deterministic=True requires torch.equal gradients and "
                         "measure_noise=True judges them against a noise floor: pass one")
    if isinstance(model, Step) and model.loop != plan.loop:
        raise LoopError(f"verify() was given a step in the loop {model.loop!r} and a plan "
                        f"made for the loop {plan.loop!r}: verify checks the step the plan "
                        f"was made for; pass dataclasses.replace(step, loop={plan.loop!r})")
    step = dataclasses.replace(given, loop=plan.loop)  # both steps in the plan's loop
    fitted_whole = bool(plan.compiled) and (plan.compiled_peak_bytes is not None
                                            or plan.compile_memory_budget is not None)
    if fitted_whole:  # the eager steps on the model itself, not on a compiled wrapper
        step = dataclasses.replace(step, model=uncompiled(step.model))
    model, device = step.model, step.device
    if deterministic:
        _check_cublas_workspace(device)
    measure_floor = not deterministic and (
        measure_noise if measure_noise is not None else device.type not in ("cpu", "meta"))
    rng = torch.get_rng_state()
    stack = ExitStack()
    remove(model)
    try:
        stack.enter_context(training_config(model))  # both steps without a KV cache
        if device.type == "cuda":
            _plain_grads(step, rng)  # warm-up: one-time allocations
        with _deterministic_algorithms(device) if deterministic else nullcontext():
            plain = step_measure(step, rng)
            floor = 0.0
            if measure_floor:
                _, floor = max_grad_diff(plain.grads,
                                          _plain_grads(step, rng))
            apply(model, plan, check_ranks=False)
            planned = step_measure(step, rng)
            if measure_noise is None and not measure_floor and not deterministic \
                    and not _head_params(model, plan) \
                    and not max_grad_diff(plain.grads, planned.grads)[0]:
                # the CPU's default: is the plain step its own noise? (NOTE [ Judging ...)
                remove(model)
                _, again = max_grad_diff(plain.grads, _plain_grads(step, rng))
                apply(model, plan, check_ranks=False)
                if again <= _rounding_level(plain.grads):
                    floor, measure_floor = again, True
        compiled: tuple[int, int] | None = None  # (planned, plain) peaks, run compiled
        compiled_grads: tuple[GradsOut, GradsOut] = ({}, {})  # (planned, plain)
        if plan.compiled:  # NOTE [ Verifying a plan fitted compiled whole ], NOTE
            # [ Verifying a plan from a compiled tape ], NOTE [ Compiled gradients ]
            def peak_of(grads: GradsOut) -> int:
                if fitted_whole:
                    return compiled_whole(step, plan, plan.compiled, timed=False, rng=rng,
                                          grads=grads)[0]
                return compiled_by_block(step, [b.name for b in plan.blocks], plan.compiled,
                                         rng, grads)
            planned_compiled = peak_of(compiled_grads[0])
            remove(model)
            compiled = (planned_compiled, peak_of(compiled_grads[1]))
        plain_ms, planned_ms = [], []
        for r in range(repeats + 1):
            remove(model)
            t_plain = _time_step(step, rng)
            apply(model, plan, check_ranks=False)
            t_planned = _time_step(step, rng)
            if r:  # the first pair is a warm-up
                plain_ms.append(t_plain)
                planned_ms.append(t_planned)
    finally:
        remove(model)
        stack.close()
        if before is not None:  # the user's plan put back, quietly: its apply warned
            with warnings.catch_warnings():  # of the KV cache turned off already
                warnings.filterwarnings("ignore", message="autoremat: use_cache=True")
                apply(model, before, check_ranks=False)
        torch.set_rng_state(rng)
        if any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()):
            # blocks the user compiled (module.compile()) ran with each plan verify put on
            # and took off: Dynamo compiled them again each time, and past its recompile
            # limit ran them eagerly from then on, silently, 22% over the plan's peak (a
            # held-out check, 2026-11-29). Their next call compiles afresh
            torch._dynamo.reset()
    if not math.isfinite(floor):
        raise RematError(f"the plain model's gradients differ between two runs from the same "
                         f"state by {floor} (a gradient missing in one run, or not finite): "
                         f"verify cannot judge a plan against that")
    head_names = _head_params(model, plan)
    head_rel, bound = _judge_head(plain.grads, planned.grads, head_names)
    judged = judge_gradients(plain.grads, planned.grads, floor)
    _warn_not_finite(plain.grads)
    peak, plain_peak = planned.peak_bytes, plain.peak_bytes
    on_allocator = False
    if planned.allocator_peak_bytes is not None and plain.allocator_peak_bytes is not None:
        peak, plain_peak = planned.allocator_peak_bytes, plain.allocator_peak_bytes
        on_allocator = True  # CUDA: the allocator is the truth (docs/design.md)
    predicted = plan.predicted_peak_bytes
    if compiled is not None:
        peak, plain_peak = compiled
        predicted = plan.compiled_peak_bytes or predicted
    within = plan.budget_bytes is None or peak <= plan.budget_bytes
    compiled_diff: float | None = None
    compiled_bound: float | None = None
    compiled_ok = True
    if compiled is not None:  # NOTE [ Compiled gradients ]
        diff = max_grad_diff(compiled_grads[1], compiled_grads[0])[1]
        allowed = max(max_grad_diff(plain.grads, compiled_grads[1])[1], NOISE_MULTIPLE * floor)
        compiled_diff, compiled_bound, compiled_ok = diff, allowed, diff <= allowed
    med, plain_med = statistics.median(planned_ms), statistics.median(plain_ms)
    return Report(
        ok=within and (judged.verdict != "differ" if head_rel is None else head_rel <= bound)
        and compiled_ok,
        grads_equal=judged.grads_equal, head_rel_diff=head_rel,
        head_bound=bound if head_rel is not None else None,
        max_grad_diff=judged.max_grad_diff,
        peak_bytes=peak, plain_peak_bytes=plain_peak,
        predicted_peak_bytes=predicted, budget_bytes=plan.budget_bytes,
        recompute_flops=planned.flops - plain.flops, plain_flops=plain.flops,
        step_ms=med, plain_step_ms=plain_med,
        time_spread=(max(planned_ms) - min(planned_ms)) / med if med else 0.0,
        plain_time_spread=(max(plain_ms) - min(plain_ms)) / plain_med if plain_med else 0.0,
        timed_pairs=len(planned_ms),
        deterministic=deterministic, noise_floor=floor, noise_measured=measure_floor,
        peak_source="allocator" if on_allocator else "tracker",
        tracked_peak_bytes=planned.peak_bytes if on_allocator or compiled else None,
        compiled=plan.compiled if compiled is not None else "",
        compiled_as="" if compiled is None else "whole" if fitted_whole else "blocks",
        compiled_grad_diff=compiled_diff, compiled_grad_bound=compiled_bound,
    )
