"""``autoremat.hf``: plan activation checkpointing for a Hugging Face ``Trainer``.

Three lines turn it on::

    from autoremat.hf import AutorematCallback
    trainer = Trainer(model, args, train_dataset=data, callbacks=[AutorematCallback(budget="60%")])
    trainer.train()

When training begins, the callback profiles one training step of the model on a batch
made like the Trainer's first, plans for the budget, applies the plan (the same
``profile``/``plan``/``apply``, measured and corrected, as :func:`autoremat.auto`), and
logs the plan on the ``autoremat.hf`` logger. When training ends it removes the plan.

This module imports ``transformers`` (``pip install 'autoremat[hf]'``); ``import
autoremat`` does not.

NOTE [ Which batch the callback profiles ]
    No callback event is handed a batch, and iterating the Trainer's dataloader to peek
    at one would draw from the RNG its sampler shuffles with and, under ``accelerate``,
    register a dataloader that never ends with the gradient-accumulation state. So the
    callback makes a batch of its own: the dataset's first ``batch_size`` examples,
    through the dataloader's own collate function (the data collator, padding and the
    columns the Trainer removes included), moved to ``args.device``. It has the shape of
    every batch when the examples have one length (or are padded to one); with batches
    of varying length the plan warns (``ShapeMismatchWarning``) on a batch of another
    shape, and holds its budget only for batches no larger than the one it was made for.
    Collators that draw random numbers (masked-language-model masking) draw them under a
    forked RNG, so that training sees the same numbers as without the callback.

NOTE [ The Trainer's loop ]
    ``Trainer.compute_loss`` returns the loss and drops the model's output before
    ``training_step`` runs backward: the ``"loss_only"`` loop (NOTE [ Which loop a step
    models ] in ``_core/step.py``), the default here. A Trainer subclass whose
    ``compute_loss`` keeps the outputs through backward needs ``loop="holds_output"``.

NOTE [ One checkpointing at a time ]
    With ``args.gradient_checkpointing`` (``activation_checkpointing`` in recent
    Transformers) the Trainer checkpoints every layer itself; autoremat's plan on top
    would checkpoint inside checkpoints, and its profile would measure a model that is
    already recomputing. The callback refuses that combination rather than take it over:
    turning Hugging Face's checkpointing off behind the user's back would leave their
    arguments saying one thing and the model doing another.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.data import IterableDataset
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from autoremat._apply import remove
from autoremat._auto import auto
from autoremat._core.errors import BudgetError, RematError
from autoremat._core.step import Loop, LossFn, check_loop, check_loss_fn
from autoremat._measure.blocks import BlockSpec
from autoremat._plan.plan import Plan
from autoremat._plan.strategies import check_head, check_plan_args

__all__ = ["AutorematCallback"]

_log = logging.getLogger("autoremat.hf")


class AutorematCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that plans and applies activation checkpointing
    for a memory budget when training begins, and removes it when training ends.

    Args:
        budget: the step peak to fit, as for :func:`autoremat.plan`: bytes, a size string
            (``"6GiB"``) or a percentage of the unplanned step's peak (``"60%"``).
        strategy: as for :func:`autoremat.plan` (default ``"optimal"``).
        max_memory: an absolute device limit, as for :func:`autoremat.plan`; give
            ``optimizer=`` with it (``"adamw"`` for the Trainer's default optimizer).
        optimizer: the optimizer whose state ``max_memory`` must leave room for.
        blocks: the blocks to plan over, as for :func:`autoremat.profile` (default: the
            repeated layers; both stacks of an encoder-decoder).
        loss_fn: ``loss_fn(output) -> scalar`` for the profile; default ``output.loss``.
        loop: ``"loss_only"`` (default: what ``Trainer.training_step`` does, NOTE [ The
            Trainer's loop ]) or ``"holds_output"``.
        head: the loss head's decision, as for :func:`autoremat.plan` (``"auto"`` lets
            the plan chunk a causal LM's loss head where that is cheaper); the chunked
            head divides by the Trainer's ``num_items_in_batch`` as the model's loss does.

    Attributes:
        plan: the plan applied when training began (``None`` before); it stays here
            after training ends and the plan is removed.

    Raises:
        RematError: at construction, a malformed budget, strategy or loop; when the
            Trainer is built or training begins, Hugging Face gradient checkpointing is
            on (NOTE [ One checkpointing at a time ]), or the run has several processes.
        BudgetError: when training begins, no plan fits the budget (it says the smallest
            that does).

    Example:
        >>> from autoremat.hf import AutorematCallback
        >>> callback = AutorematCallback(budget="60%")
        >>> callback.plan is None
        True

    Known limitations:
        * The batch profiled is made from the dataset's first examples (NOTE [ Which
          batch the callback profiles ]); batches of another shape warn.
        * One process only: in a distributed run every rank would plan on its own, and
          ranks that recompute different blocks hang FSDP. Plan once, send
          ``plan.to_json()`` to the other ranks, and ``autoremat.apply`` it on each.
    """

    def __init__(self, budget: int | float | str | None = None, strategy: str = "optimal", *,
                 max_memory: int | str | None = None, optimizer: str | int | None = None,
                 blocks: BlockSpec = None, loss_fn: LossFn | None = None,
                 loop: Loop = "loss_only", head: str | None = None) -> None:
        check_plan_args(budget, strategy, max_memory, optimizer)  # before any training
        check_head(head)
        check_loss_fn(loss_fn)
        if budget is None and max_memory is None and strategy == "optimal":
            raise BudgetError("AutorematCallback with neither budget= nor max_memory= would "
                              "keep every block and change nothing: give a budget (e.g. "
                              "budget='60%') or max_memory=, or a strategy such as 'full'")
        self.budget = budget
        self.strategy = strategy
        self.max_memory = max_memory
        self.optimizer = optimizer
        self.blocks = blocks
        self.loss_fn = loss_fn
        self.loop = check_loop(loop)
        self.head = head
        self.plan: Plan | None = None
        self._model: nn.Module | None = None  # the model the plan is applied to

    def on_init_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        _check_args(args)  # refuse while the Trainer is being built, before any training

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, *, model: nn.Module | None = None,
                       train_dataloader: Any = None, **kwargs: Any) -> None:
        _check_args(args)
        if model is None or train_dataloader is None:
            raise RematError("AutorematCallback.on_train_begin needs the model and the "
                             "train dataloader, which the Trainer passes; call it from a "
                             "Trainer (or pass model= and train_dataloader=)")
        _check_model(model)
        batch = _batch_like_the_first(train_dataloader, args)
        was_training = model.training
        model.train()  # a model from from_pretrained is in eval mode until the first step
        try:
            self.plan = auto(model, batch, self.budget, self.strategy, loss_fn=self.loss_fn,
                             blocks=self.blocks, max_memory=self.max_memory,
                             optimizer=self.optimizer, loop=self.loop, head=self.head)
        finally:
            model.train(was_training)
        self._model = model
        if state.is_local_process_zero:
            _log.info("autoremat plan for this training run:\n%s", self.plan)

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        if self._model is not None:
            remove(self._model)
            self._model = None


def _check_args(args: TrainingArguments) -> None:
    """Refuse arguments the callback cannot work with (see the class's Raises)."""
    for flag in ("gradient_checkpointing", "activation_checkpointing"):
        if getattr(args, flag, None):
            raise RematError(
                f"TrainingArguments({flag}=True) checkpoints every layer with Hugging "
                "Face's own checkpointing, and AutorematCallback would plan on top of it "
                "(NOTE [ One checkpointing at a time ] in autoremat/hf.py). Set "
                f"{flag}=False and let the callback plan; or drop the callback")
    if args.world_size > 1:
        raise RematError(
            f"AutorematCallback plans in one process, and this run has {args.world_size}: "
            "each rank would plan on its own, and ranks that recompute different blocks "
            "hang FSDP. Plan once on rank 0 (autoremat.plan(autoremat.profile(model, batch), "
            "...)), send it to the others with autoremat.distributed.broadcast_plan(plan) and "
            "autoremat.apply(model, plan) on every rank before trainer.train()")


def _check_model(model: nn.Module) -> None:
    on = [name for name, m in model.named_modules() if getattr(m, "gradient_checkpointing",
                                                               False) is True]
    if on:
        raise RematError(
            f"the model already has Hugging Face gradient checkpointing on ({len(on)} "
            f"modules, e.g. {on[0] or type(model).__name__!r}); AutorematCallback would "
            "plan on top of it (NOTE [ One checkpointing at a time ] in autoremat/hf.py). "
            "Call model.gradient_checkpointing_disable() and let the callback plan")


def _batch_like_the_first(dataloader: Any, args: TrainingArguments) -> Any:
    """The dataset's first ``batch_size`` examples through the dataloader's collate
    function, on ``args.device`` (NOTE [ Which batch the callback profiles ])."""
    size = getattr(dataloader, "batch_size", None) or args.per_device_train_batch_size
    dataset = dataloader.dataset
    with _forked_rngs():
        if isinstance(dataset, IterableDataset):
            examples = list(itertools.islice(iter(dataset), size))
        else:
            examples = [dataset[i] for i in range(min(size, len(dataset)))]
        if not examples:
            raise RematError("the training dataset is empty: AutorematCallback has no "
                             "batch to profile")
        batch = dataloader.collate_fn(examples)
    return tree_map(lambda x: x.to(args.device) if isinstance(x, torch.Tensor) else x,
                    dict(batch) if isinstance(batch, Mapping) else batch)  # BatchEncoding


@contextmanager
def _forked_rngs() -> Iterator[None]:
    """Python's, NumPy's and torch's random states are as before on exit."""
    py_state, np_state = random.getstate(), np.random.get_state()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else []):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
