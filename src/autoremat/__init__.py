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
from .errors import BlockError, BudgetError, PlanMismatchError, RematError, SchemaError
from .memory import MemoryTracker, track_memory
from .profile import profile
from .tape import BlockProfile, Tape

__version__ = "0.1.0"

__all__ = [
    "BlockError",
    "BlockProfile",
    "BudgetError",
    "MemoryTracker",
    "PlanMismatchError",
    "RematError",
    "SchemaError",
    "Tape",
    "__version__",
    "profile",
    "track_memory",
    "zoo",
]
