"""autoremat: activation checkpointing for PyTorch, planned under a memory budget.

Measure a training step block by block, plan what to keep and what to recompute so the
step fits a budget at the least recompute cost, apply the plan to an ordinary
``nn.Module`` and verify that gradients are unchanged.

Example:
    >>> import autoremat
    >>> model, inputs = autoremat.zoo.build("mlp")
    >>> tape = autoremat.profile(model, inputs)
    >>> tape.step_peak_bytes > 0
    True
"""

from . import zoo
from .apply import ShapeMismatchWarning, applied_plan, apply, auto, remove
from .errors import (
    BlockError,
    BudgetError,
    DeterminismError,
    LoopError,
    PlanMismatchError,
    RematError,
    SchemaError,
)
from .estimate import Estimate, estimate
from .memory import MemoryTracker, track_memory
from .plan import BlockDecision, Plan, plan
from .profile import profile
from .step import Loop
from .tape import BlockProfile, Tape
from .verify import Report, verify

__version__ = "0.1.0"

__all__ = [
    "BlockDecision",
    "BlockError",
    "BlockProfile",
    "BudgetError",
    "DeterminismError",
    "Estimate",
    "Loop",
    "LoopError",
    "MemoryTracker",
    "Plan",
    "PlanMismatchError",
    "RematError",
    "Report",
    "SchemaError",
    "ShapeMismatchWarning",
    "Tape",
    "__version__",
    "applied_plan",
    "apply",
    "auto",
    "estimate",
    "plan",
    "profile",
    "remove",
    "track_memory",
    "verify",
    "zoo",
]
