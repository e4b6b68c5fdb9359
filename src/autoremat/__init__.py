"""autoremat: activation checkpointing for PyTorch, planned under a memory budget.

Measure a training step block by block, plan what to keep and what to recompute so the
step fits a budget at the least recompute cost, apply the plan to an ordinary
``nn.Module`` and verify that gradients are unchanged.

Example:
    >>> import autoremat
    >>> model, inputs = autoremat.zoo.build("mlp", widths=(128,) * 4, batch_size=256)
    >>> tape = autoremat.profile(model, inputs)
    >>> tape.step_peak_bytes > 0
    True
"""

from autoremat import distributed, zoo
from autoremat._apply import applied_plan, apply, compile_model, remove
from autoremat._auto import auto
from autoremat._core.decisions import Choice, Decision
from autoremat._core.errors import (
    BlockError,
    BudgetError,
    DeterminismError,
    LoopError,
    PlanMismatchError,
    RematError,
    SchemaError,
)
from autoremat._core.head import LMHead
from autoremat._core.step import Loop, Step
from autoremat._core.version import __version__
from autoremat._estimate.doctor import Prescription, Remedy, doctor
from autoremat._estimate.estimate import Estimate, estimate
from autoremat._guards import PlanMismatchWarning, ShapeMismatchWarning, StepMismatchWarning
from autoremat._measure.memory import MemoryTracker, track_memory
from autoremat._measure.tape import BlockProfile, Tape
from autoremat._plan.plan import BlockDecision, Plan
from autoremat._plan.strategies import plan
from autoremat._profile.profile import profile
from autoremat._verify import Report, verify

__all__ = [
    "BlockDecision",
    "BlockError",
    "BlockProfile",
    "BudgetError",
    "Choice",
    "Decision",
    "DeterminismError",
    "Estimate",
    "LMHead",
    "Loop",
    "LoopError",
    "MemoryTracker",
    "Plan",
    "PlanMismatchError",
    "PlanMismatchWarning",
    "Prescription",
    "RematError",
    "Remedy",
    "Report",
    "SchemaError",
    "ShapeMismatchWarning",
    "Step",
    "StepMismatchWarning",
    "Tape",
    "__version__",
    "applied_plan",
    "apply",
    "auto",
    "compile_model",
    "distributed",
    "doctor",
    "estimate",
    "plan",
    "profile",
    "remove",
    "track_memory",
    "verify",
    "zoo",
]
