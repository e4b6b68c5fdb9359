"""What the training-framework callbacks share (``autoremat.hf``, ``autoremat.lightning``).

Each callback takes :func:`autoremat.auto`'s planning arguments, checks them when it is
made (before any training), and, once training begins, plans and applies in train mode
through ``auto`` itself. What differs between them is only the step they hand to
``auto``: the batch they find, the loss their framework takes and the loop it runs
(NOTE [ Which loop a step models ] in ``_core/step.py``).
"""

from __future__ import annotations

import importlib.util
import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from autoremat._auto import auto
from autoremat._core.errors import BudgetError, RematError
from autoremat._core.step import Loop, LossFn, Step, check_loop, check_loss_fn
from autoremat._measure.blocks import BlockSpec
from autoremat._plan.plan import Plan
from autoremat._plan.strategies import check_head, check_plan_args
from autoremat._profile.profile import compile_backend

__all__ = ["MissingExtraError", "PlanArgs", "forked_rngs", "log_plan",
           "require_extra"]


class MissingExtraError(RematError, ImportError):
    """An optional dependency an integration needs is not installed (an ``ImportError``
    too, raised when the integration's module is imported)."""


def require_extra(module: str, extra: str, what: str) -> None:
    """Raise :class:`MissingExtraError`, naming the pip command, when ``module`` is
    missing, before ``what`` imports it and before any work.

    Example:
        >>> require_extra("math", "hf", "autoremat.hf")
    """
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(f"{what} needs {module}, which is not installed here: pip "
                                f"install 'autoremat[{extra}]' (or pip install {module})")


@dataclass(frozen=True)
class PlanArgs:
    """A callback's planning arguments, as for :func:`autoremat.auto`, checked when made
    (:class:`~autoremat.BudgetError`, :class:`~autoremat.RematError`)."""

    budget: int | float | str | None
    strategy: str
    max_memory: int | str | None
    optimizer: str | int | None
    blocks: BlockSpec
    loss_fn: LossFn | None
    loop: Loop | None  # None: the loop the framework runs
    head: str | None
    compile: bool | str = False
    margin: float | None = None  # as for autoremat.plan (None: 3% on CUDA, else 0)

    def __post_init__(self) -> None:
        check_plan_args(self.budget, self.strategy, self.max_memory, self.optimizer,
                        margin=self.margin)
        check_head(self.head)
        check_loss_fn(self.loss_fn)
        if self.loop is not None:
            check_loop(self.loop)
        compile_backend(self.compile)
        if self.budget is None and self.max_memory is None and self.strategy == "optimal":
            raise BudgetError("AutorematCallback with neither budget= nor max_memory= would "
                              "keep every block and change nothing: give a budget (e.g. "
                              "budget='60%') or max_memory=, or a strategy such as 'full'")

    def plan(self, step: Step, head: str | None = None) -> Plan:
        """``auto`` on ``step`` with these arguments (``head`` in place of this one's),
        the model in train mode while it measures (restored after)."""
        model = step.model
        was_training = model.training
        model.train()  # a model from from_pretrained is in eval mode until the first step
        try:
            return auto(step, budget=self.budget, strategy=self.strategy,
                        blocks=self.blocks, max_memory=self.max_memory,
                        optimizer=self.optimizer, compile=self.compile, head=head,
                        margin=self.margin)
        finally:
            model.train(was_training)


def log_plan(log: logging.Logger, plan: Plan, where: str) -> None:
    """The plan, on ``log`` at INFO."""
    log.info("autoremat plan for this %s run (loop %s):\n%s", where, plan.loop, plan)


@contextmanager
def forked_rngs() -> Iterator[None]:
    """Python's, NumPy's and torch's random states are as before on exit."""
    py_state, np_state = random.getstate(), np.random.get_state()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else []):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
