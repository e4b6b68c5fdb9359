"""The plain data of ``autoremat bench``: method names, one row, one model's result, settings.

The sweep (:mod:`autoremat._bench.bench`) fills these and the report
(:mod:`autoremat._bench.report`) reads them; they live here so that neither imports the
other. All are frozen dataclasses that serialise with :func:`dataclasses.asdict`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from autoremat._core.step import Loop

__all__ = [
    "AUTO", "AUTO_COMPILE", "BLOCK", "COMPILE", "COMPILED_REFERENCES", "COMPILE_BLOCK",
    "COMPILE_EAGER", "COMPILE_SAC", "HF", "METHODS", "NONE", "SAC", "SEQ", "BenchRow",
    "ModelResult", "Settings", "Status",
]

NONE = "no checkpointing"
AUTO = "autoremat optimal"
BLOCK = "checkpoint per block"
HF = "HF gradient_checkpointing"
SEQ = "checkpoint_sequential"
SAC = "SAC per block"
COMPILE = "torch.compile"
COMPILE_EAGER = "no checkpointing (OS)"
COMPILE_BLOCK = "torch.compile + checkpoint per block"
COMPILE_SAC = "torch.compile + SAC per block"
AUTO_COMPILE = "autoremat + torch.compile"
METHODS = (NONE, AUTO, BLOCK, HF, SEQ, SAC, COMPILE, COMPILE_EAGER, COMPILE_BLOCK,
           COMPILE_SAC, AUTO_COMPILE)
# the compiled rows autoremat + torch.compile is planned against (at each one's peak)
COMPILED_REFERENCES = (COMPILE, COMPILE_BLOCK, COMPILE_SAC)

Status = Literal["ok", "infeasible", "n/a", "error"]


@dataclass(frozen=True)
class BenchRow:
    """One line of the benchmark. Figures are ``None`` when the row did not run."""

    method: str  # one of METHODS
    budget: str  # "75%", "min", "peak of <method>", or "-" for references without one
    status: Status  # ok | infeasible (budget below the smallest plan) | n/a | error
    peak_bytes: int | None = None  # measured step peak
    # storage accounting, OS VmHWM (compile on CPU), or the rise of
    # torch.cuda.max_memory_allocated() (every row with --device cuda)
    peak_source: Literal["tracker", "os", "allocator"] = "tracker"
    plain_peak_bytes: int | None = None  # no-checkpointing peak, same measurement system
    budget_bytes: int | None = None  # autoremat: the budget in bytes
    predicted_peak_bytes: int | None = None  # autoremat: the plan's prediction
    recompute_pct: float | None = None  # extra FLOPs / plain step FLOPs, in percent
    step_ms: float | None = None  # median step time
    time_ratio: float | None = None  # step_ms / median plain step time (same process)
    time_spread: float | None = None  # (max - min) / median of this row's steps
    time_ratio_range: tuple[float, float] | None = None  # (min, max) step / plain median
    cpu_ratio: float | None = None  # the same ratio in CPU time of the process (less noisy)
    max_grad_diff: float | None = None  # max |grad - plain grad|; 0.0 when all torch.equal
    grads_equal: bool | None = None  # every gradient torch.equal to the plain step's
    relative_grad_diff: float | None = None  # max_grad_diff / the largest plain |gradient|
    max_buffer_diff: float | None = None  # max |buffer - plain buffer| after the step
    note: str = ""
    tracker_peak_bytes: int | None = None  # the tracker's peak, when peak_bytes is the
    #                                        allocator's: the cross-check
    allocations_peak_bytes: int | None = None  # compiled rows on CPU: the peak from the
    #                     allocator's reports (track_allocations), beside the OS figure
    versus_ratio: float | None = None  # autoremat's compiled rows: median step time over
    #   the median of the reference whose peak is the budget, interleaved in one process

    @property
    def grads_rounding_only(self) -> bool:
        """Gradients differ, but only as float rounding does (< 1e-5 of the largest)."""
        return self.grads_equal is False and (self.relative_grad_diff or 0.0) < 1e-5

    @property
    def peak_fraction(self) -> float | None:
        """Peak over the plain peak of the same measurement system."""
        if self.peak_bytes is None or not self.plain_peak_bytes:
            return None
        return self.peak_bytes / self.plain_peak_bytes


@dataclass(frozen=True)
class ModelResult:
    """All rows of one target, and the verdicts drawn from them."""

    target: str  # as given on the command line
    model: str  # class name
    inputs: str  # input signature
    n_blocks: int
    plain_peak_bytes: int
    plain_step_ms: float
    plain_flops: int
    min_feasible_bytes: int | None  # smallest peak autoremat can plan (None: no tape)
    rows: tuple[BenchRow, ...]
    headline: tuple[str, ...]


@dataclass(frozen=True)
class Settings:
    """What one ``bench`` run does."""

    budgets: tuple[str, ...] = ("75%", "50%", "30%", "min")
    repeats: int = 5  # timed rounds per model (after one warm-up round)
    compile: bool = True  # run the torch.compile rows (subprocesses)
    # compile's activation_memory_budget values (None: from the budgets, and 1.0)
    compile_fractions: tuple[float, ...] | None = (1.0, 0.8, 0.5, 0.2)
    compile_backend: str = "inductor"  # torch.compile backend of every compiled row
    overrides: tuple[tuple[str, Any], ...] = ()  # size options for every target
    threads: int = 1  # torch threads (0: torch's default); NOTE [ Fair timing ] in bench.py
    compile_timeout_s: float = 1800.0
    loop: Loop = "holds_output"  # the training loop every step follows (step.Loop)
    device: str = "cpu"  # where models and inputs run: "cpu", "cuda", "cuda:1"
    dtype: str = "float32"  # floating dtype of zoo models and their inputs (measure.DTYPES)
