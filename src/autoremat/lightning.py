"""``autoremat.lightning``: plan activation checkpointing for a Lightning ``Trainer``.

Two lines turn it on::

    from autoremat.lightning import AutorematCallback
    trainer = lightning.Trainer(callbacks=[AutorematCallback(budget="60%")])
    trainer.fit(module, datamodule)

On the first training batch (on the device Lightning placed the model and the batch on),
the callback profiles the step Lightning runs, plans for the budget and applies the plan
(the same ``profile``/``plan``/``apply``, measured and corrected, as
:func:`autoremat.auto`), before the first optimizer step; it logs the plan through
Lightning's loggers and on the ``autoremat.lightning`` logger, and removes it when the
fit is torn down.

This module imports ``lightning`` (``pip install 'autoremat[lightning]'``); ``import
autoremat`` does not.

NOTE [ The step Lightning runs ]
    Under automatic optimization Lightning runs, for each batch,
    ``strategy.training_step(batch, batch_idx)``: the module's ``training_step`` inside
    the precision plugin's ``train_step_context()`` (autocast under ``"bf16-mixed"``). It
    keeps what that returns (the loss, or a dict whose other entries its closure result
    holds until backward has run) and runs backward on the loss, outside that context.
    The callback profiles exactly that step: a module (:class:`LightningStep`) whose
    forward is the LightningModule's own ``training_step``, on the batch Lightning hands
    to ``on_train_batch_start``, inside the plugin's context, with backward outside it.
    The loop follows what ``training_step`` returns (NOTE [ Which loop a step models ] in
    ``_core/step.py``): ``"loss_only"`` for a tensor, ``"holds_output"`` for a dict; one
    forward without gradients finds out which, before the profile. While the callback
    measures, ``self.log`` and ``self.log_dict`` log nothing: the profile's steps are not
    training steps, and their values would be mixed into the first step's metrics. Each
    keeps a copy of the tensor it is given instead, as Lightning's results hold one until
    the next step (a scalar a call: measured, the step's peak held it, 4 bytes over the
    prediction, before they did).

NOTE [ Every training step through one module ]
    The plan is applied to the :class:`LightningStep` module, and until teardown the
    LightningModule's ``training_step`` is routed through it (an instance attribute, taken
    away at teardown): the checks a plan makes at each forward with gradients (a batch of
    another shape, another autocast, blocks changed; NOTE [ What a plan is checked
    against ] in ``_guards.py``) see every training step, as they see a plain model's
    forward. A dict batch goes in by keyword and a tuple by position, so that those
    checks read its tensors' shapes.

NOTE [ What the Lightning callback refuses ]
    * Several processes (DDP, FSDP, DeepSpeed): each rank would plan on its own, and ranks
      that recompute different blocks hang FSDP (as the Hugging Face callback).
    * Manual optimization (``automatic_optimization = False``): ``training_step`` runs
      backward and the optimizer itself, so there is no step of forward, loss and backward
      for autoremat to measure.
    * ``trainer.fit(torch.compile(module))`` without ``compile=`` here: the profile would
      measure the step eagerly and the plan would not hold compiled. With
      ``compile=True`` (or the backend's name) the profile measures the step compiled
      from the module's uncompiled ``training_step``, as ``autoremat.auto(...,
      compile=...)`` measures a model (the step compiled whole: Lightning's compiled
      ``training_step``).
    * Hugging Face gradient checkpointing already on in the module's model.
"""

from __future__ import annotations

from autoremat._callbacks import require_extra

require_extra("lightning", "lightning", "autoremat.lightning")

# ruff: noqa: E402  (the imports need lightning, checked above)
import dataclasses
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import lightning
import torch
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn

from autoremat._apply import remove
from autoremat._callbacks import PlanArgs, log_plan
from autoremat._core.decisions import Decision
from autoremat._core.errors import RematError
from autoremat._core.step import Loop, Step, preserved_state
from autoremat._measure.blocks import BlockSpec
from autoremat._plan.plan import Plan
from autoremat._profile.runs import refuse_hf_checkpointing

__all__ = ["AutorematCallback"]

_log = logging.getLogger("autoremat.lightning")


class AutorematCallback(lightning.pytorch.Callback):
    """A Lightning ``Callback`` that plans and applies activation checkpointing for a
    memory budget on the first training batch, and removes it when the fit ends.

    Args:
        budget: the step peak to fit, as for :func:`autoremat.plan`: bytes, a size string
            (``"6GiB"``) or a percentage of the unplanned step's peak (``"60%"``).
        strategy: as for :func:`autoremat.plan` (default ``"optimal"``).
        max_memory: an absolute device limit, as for :func:`autoremat.plan`; give
            ``optimizer=`` with it.
        optimizer: the optimizer whose state ``max_memory`` must leave room for.
        blocks: the blocks to plan over, as for :func:`autoremat.profile`, named from the
            LightningModule (``"model.transformer.h.0"``; default: the repeated layers).
        loop: ``None`` (default: from what ``training_step`` returns, NOTE [ The step
            Lightning runs ]), ``"loss_only"`` or ``"holds_output"``.
        head: the loss head's decision, as for :func:`autoremat.plan`. Under Lightning
            the head that can be chunked is an :class:`autoremat.LMHead` in the module
            (the zoo's models); a Hugging Face causal LM's head stays as it computes it.
        compile: ``True`` or a backend name when the module is fitted compiled
            (``trainer.fit(torch.compile(module))``), as for :func:`autoremat.auto`.
        margin: the share of the budget kept for the CUDA caching allocator, as for
            :func:`autoremat.plan` (default: 3% on a CUDA device, none elsewhere).

    Attributes:
        plan: the plan applied on the first batch (``None`` before); it stays here after
            the fit ends and the plan is removed.

    Raises:
        RematError: at construction, a malformed budget, strategy, loop, head, compile or
            margin; on the first batch, what NOTE [ What the Lightning callback refuses ]
            lists.
        BudgetError: on the first batch, no plan fits the budget (it says the smallest
            that does).

    Example:
        >>> from autoremat.lightning import AutorematCallback
        >>> callback = AutorematCallback(budget="6GiB", head="auto")
        >>> callback.planning.loop is None  # from what training_step returns
        True

    Known limitations:
        * The plan is made for the first batch; batches larger in some dimension warn
          (``ShapeMismatchWarning``), smaller ones are within it.
        * One process only (NOTE [ What the Lightning callback refuses ]).
    """

    def __init__(self, budget: int | float | str | None = None, strategy: str = "optimal", *,
                 max_memory: int | str | None = None, optimizer: str | int | None = None,
                 blocks: BlockSpec = None, loop: Loop | None = None,
                 head: str | None = None, compile: bool | str = False,
                 margin: float | None = None) -> None:
        # checked here, before any training
        self.planning = PlanArgs(budget, strategy, max_memory, optimizer, blocks, None,
                                 loop, head, compile, margin)
        self.plan: Plan | None = None
        self._runner: LightningStep | None = None  # the module the plan is applied to
        self._pending = False  # a fit has started and not planned yet

    def on_fit_start(self, trainer: lightning.Trainer,
                     pl_module: lightning.LightningModule) -> None:
        _check_fit(trainer, pl_module, self.planning.compile)
        self._pending = True  # each fit plans on its first batch

    def on_train_batch_start(self, trainer: lightning.Trainer,
                             pl_module: lightning.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self._pending:
            return  # planned on this fit's first batch
        self._pending = False
        _check_fit(trainer, pl_module, self.planning.compile)
        refuse_hf_checkpointing(pl_module, "AutorematCallback", "let the callback plan")
        context = trainer.precision_plugin.train_step_context
        runner = LightningStep(pl_module, trainer.accumulate_grad_batches)
        inputs = runner.inputs_of(batch, batch_idx)
        planning = self.planning
        if isinstance(planning.blocks, (list, tuple)):  # named from the LightningModule
            planning = dataclasses.replace(
                planning, blocks=[f"module.{name}" for name in planning.blocks])
        with _logging_off(pl_module), context():
            loop = planning.loop or _loop_of(runner, inputs)
            step = Step(runner, inputs, None, loop)
            self.plan = planning.plan(step, head=planning.head)
            runner.result = None
        self._runner = runner
        runner.route()
        log_plan(_log, self.plan, "Lightning fit")
        for logger in trainer.loggers:
            logger.log_hyperparams(_summary(self.plan))

    def teardown(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule,
                 stage: str) -> None:
        self._pending = False
        if self._runner is not None:
            self._runner.unroute()
            remove(self._runner)
            self._runner = None

    def on_exception(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule,
                     exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")


class LightningStep(nn.Module):
    """The LightningModule's ``training_step`` as a module's forward (NOTE [ Every
    training step through one module ]): ``step(**batch)`` for a dict batch,
    ``step(*batch)`` for a tuple or list, ``step(batch)`` otherwise. The module is its
    child ``module``: the plan names blocks ``module.<name in the LightningModule>``."""

    def __init__(self, module: lightning.LightningModule, accumulate: int = 1) -> None:
        super().__init__()
        self.module = module
        self.accumulate = accumulate  # Lightning divides the loss by it
        self.result: Any = None  # the last measured step's ClosureResult, held as Lightning
        self.returned_dict = False  # whether training_step returned a dict (last call)
        ctx = module._compiler_ctx  # trainer.fit(torch.compile(module))
        self._run = ctx["original_training_step"] if ctx else module.training_step
        self._compiled_run = module.training_step  # what Lightning calls
        self._takes_idx = is_param_in_hook_signature(self._run, "batch_idx", min_args=2)
        self._batch_type: type = dict
        self._spread = "keywords"  # how a batch goes in: "keywords", "positions", "one"
        self._batch_idx = 0
        self._routed = False
        self._own: dict[str, Any] = {}  # the module's own instance training_step, if any

    def inputs_of(self, batch: Any, batch_idx: int) -> Any:
        """The inputs to call this module with for ``training_step(batch, batch_idx)``:
        a dict of keyword arguments, a tuple of positional ones, or the batch alone."""
        self._batch_type, self._batch_idx = type(batch), batch_idx
        if type(batch) is dict and all(isinstance(key, str) for key in batch):
            self._spread = "keywords"
            return batch
        if type(batch) in (tuple, list):
            self._spread = "positions"
            return tuple(batch)
        self._spread = "one"
        return (batch,)

    def call(self, inputs: Any) -> Any:
        """This module called with ``inputs`` (from :meth:`inputs_of`)."""
        return self(**inputs) if self._spread == "keywords" else self(*inputs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._spread == "keywords":
            batch: Any = dict(kwargs)
        elif self._spread == "positions":
            batch = self._batch_type(args)
        else:
            batch = args[0]
        if self._routed:  # Lightning's own call: it takes the loss from what returns
            run = self._compiled_run
            return run(batch, self._batch_idx) if self._takes_idx else run(batch)
        output = self._run(batch, self._batch_idx) if self._takes_idx else self._run(batch)
        # measured: the loss as Lightning's closure makes it (NOTE [ The step Lightning
        # runs ]), under "loss" for the step's default loss
        _loss_of(output)  # refuses an output without a loss
        self.returned_dict = isinstance(output, Mapping)
        self.result = ClosureResult.from_training_step_output(output, self.accumulate)
        return {**self.result.extra, "loss": self.result.closure_loss}

    def route(self) -> None:
        """Lightning's calls of ``training_step`` go through this module from now on."""
        self._routed = True
        self._own = {key: value for key, value in vars(self.module).items()
                     if key == "training_step"}  # torch.compile's, under Lightning
        vars(self.module)["training_step"] = self._step

    def unroute(self) -> None:
        """Undo :meth:`route` (the module's own ``training_step`` again)."""
        if self._routed and vars(self.module).get("training_step") == self._step:
            del vars(self.module)["training_step"]
            vars(self.module).update(self._own)
        self._routed = False

    def _step(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) > 1 or kwargs:  # a dataloader_idx and the like: not a step it knows
            return self._compiled_run(batch, *args, **kwargs)
        return self.call(self.inputs_of(batch, args[0] if args else 0))


def _check_fit(trainer: lightning.Trainer, pl_module: lightning.LightningModule,
               compile: bool | str) -> None:
    """Refuse what NOTE [ What the Lightning callback refuses ] lists."""
    if trainer.world_size > 1:
        raise RematError(
            f"AutorematCallback plans in one process, and this fit has {trainer.world_size} "
            f"({type(trainer.strategy).__name__}): each rank would plan on its own, and ranks "
            "that recompute different blocks hang FSDP. Plan once on rank 0 "
            "(autoremat.plan(autoremat.profile(...), ...)), send it with "
            "autoremat.distributed.broadcast_plan(plan) and autoremat.apply it on every rank")
    if not pl_module.automatic_optimization:
        raise RematError(
            f"{type(pl_module).__name__} uses manual optimization (automatic_optimization="
            "False): its training_step runs backward and the optimizer itself, so there is "
            "no step of forward, loss and backward for AutorematCallback to profile. Plan by "
            "hand before trainer.fit: autoremat.auto(model, batch, budget=...) on the model "
            "your training_step calls")
    if pl_module._compiler_ctx and not compile:
        raise RematError(
            f"{type(pl_module).__name__} is fitted compiled (trainer.fit(torch.compile("
            "module))), and AutorematCallback would profile its step eagerly: the plan would "
            "not hold compiled. Pass AutorematCallback(..., compile=True) (or the backend's "
            "name, e.g. compile='aot_eager') to plan for the compiled step")


def _loop_of(runner: LightningStep, inputs: Any) -> Loop:
    """The loop Lightning runs for this ``training_step`` (NOTE [ The step Lightning
    runs ]), from one forward without gradients."""
    with preserved_state(runner, inputs), torch.no_grad():
        runner.call(inputs)
        returned_dict = runner.returned_dict  # (the state puts the runner's flag back)
    runner.result = None
    return "holds_output" if returned_dict else "loss_only"


def _loss_of(output: Any) -> torch.Tensor:
    """The loss in ``training_step``'s output, as Lightning's closure reads it."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return cast(torch.Tensor, output["loss"])
    raise RematError(
        f"training_step returned {type(output).__name__}"
        + (f" with keys {sorted(output)}" if isinstance(output, Mapping) else "")
        + ": Lightning's automatic optimization takes the loss from a tensor or from a "
        "dict's 'loss', so AutorematCallback has no loss to profile (a training_step "
        "that returns None on its first batch skips it). Return the loss")


@contextmanager
def _logging_off(module: lightning.LightningModule) -> Iterator[None]:
    """``module.log`` and ``module.log_dict`` log nothing inside: each keeps a copy of
    the tensors it is given, as Lightning's results do until the next step (NOTE [ The
    step Lightning runs ])."""
    saved: dict[str, Any] = {name: vars(module)[name] for name in ("log", "log_dict")
                             if name in vars(module)}
    kept: dict[str, torch.Tensor] = {}

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, torch.Tensor):
            kept[name] = value.detach().clone()

    def log_dict(dictionary: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        for name, value in dictionary.items():
            log(name, value)

    try:
        vars(module).update(log=log, log_dict=log_dict)
        yield
    finally:
        for name in ("log", "log_dict"):
            vars(module).pop(name, None)
        vars(module).update(saved)


def _summary(plan: Plan) -> dict[str, Any]:
    """The plan's figures, for Lightning's loggers' hyperparameters."""
    return {
        "autoremat/strategy": plan.strategy,
        "autoremat/loop": plan.loop,
        "autoremat/budget_bytes": plan.budget_bytes,
        "autoremat/predicted_peak_bytes": plan.predicted_peak_bytes,
        "autoremat/unplanned_peak_bytes": plan.unplanned_peak_bytes,
        "autoremat/recomputed_blocks": sum(b.decision is not Decision.KEEP
                                           for b in plan.blocks),
        "autoremat/blocks": len(plan.blocks),
        "autoremat/head": str(plan.head),
        "autoremat/autocast": plan.autocast,
    }
