"""``autoremat.hf``: plan activation checkpointing for a Hugging Face ``Trainer``.

Three lines turn it on::

    from autoremat.hf import AutorematCallback
    trainer = Trainer(model, args, train_dataset=data, callbacks=[AutorematCallback(budget="60%")])
    trainer.train()

When training begins, the callback profiles one training step of the model on a batch
made like the Trainer's first, with the loss the Trainer takes (TRL's ``SFTTrainer``
takes its own: NOTE [ Which loss the Trainer takes ]), plans for the budget, applies the
plan (the same ``profile``/``plan``/``apply``, measured and corrected, as
:func:`autoremat.auto`), and logs the plan on the ``autoremat.hf`` logger. When training
ends it removes the plan.

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

from autoremat._callbacks import require_extra

require_extra("transformers", "hf", "autoremat.hf")

# ruff: noqa: E402  (the imports need transformers, checked above)
import dataclasses
import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from autoremat._apply import remove
from autoremat._callbacks import PlanArgs, forked_rngs, log_plan
from autoremat._core.errors import RematError
from autoremat._core.step import Loop, LossFn, Step, map_tensors
from autoremat._measure.blocks import BlockSpec
from autoremat._plan.plan import Plan
from autoremat._plan.strategies import keeps_head
from autoremat._profile.runs import refuse_hf_checkpointing

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
        margin: the share of the budget kept for the CUDA caching allocator, as for
            :func:`autoremat.plan` (default: 3% on a CUDA device, none elsewhere).

    Attributes:
        plan: the plan applied when training began (``None`` before); it stays here
            after training ends and the plan is removed.
        loss: which loss the profiled step took, in words (NOTE [ Which loss the
            Trainer takes ]).
        planning: the planning arguments, checked at construction.

    Raises:
        RematError: at construction, a malformed budget, strategy, loop, head or margin; when
            the Trainer is built or training begins, Hugging Face gradient checkpointing
            is on (NOTE [ One checkpointing at a time ]), or the run has several
            processes; when training begins, a loss the callback does not profile
            (label smoothing, a chunked head where TRL takes the loss); at the first
            step's forward, a call without the profiled batch's arguments
            (``compute_loss_func=``).
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
                 loop: Loop = "loss_only", head: str | None = None,
                 margin: float | None = None) -> None:
        # checked here, before any training
        self.planning = PlanArgs(budget, strategy, max_memory, optimizer, blocks, loss_fn,
                                 loop, head, margin=margin)
        self.plan: Plan | None = None
        self.loss: str = ""  # which loss the profiled step took, in words
        self._model: nn.Module | None = None  # the model the plan is applied to
        self._guard: Any = None  # the hook that checks the first step's forward

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
        refuse_hf_checkpointing(model, "AutorematCallback", "let the callback plan")
        loss = _trainer_loss(model, args, self.planning.loss_fn, self.planning.head)
        batch = _batch_like_the_first(train_dataloader, args)
        if isinstance(batch, Mapping):
            batch = {**batch, **loss.inputs}
        step = Step(model, batch, loss.loss_fn, self.planning.loop or "loss_only")
        planning = self.planning
        if args.torch_compile and not planning.compile:  # NOTE [ A Trainer that compiles ]
            planning = dataclasses.replace(planning, compile=args.torch_compile_backend or True)
        self.plan = planning.plan(step, head=loss.head)
        if isinstance(loss.loss_fn, _HeldLoss):
            loss.loss_fn.taken = None
        self.loss = loss.what
        self._model = model
        if isinstance(batch, Mapping):
            self._guard = model.register_forward_pre_hook(  # before the plan's own checks
                _FirstStep(self, sorted(batch)), with_kwargs=True, prepend=True)
        if state.is_local_process_zero:
            _log.info("autoremat: the loss of the step profiled: %s", loss.what)
            log_plan(_log, self.plan, "Trainer")

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self._take_off()

    def _take_off(self) -> None:
        """The plan and the first step's check removed from the model (``plan`` stays)."""
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        if self._model is not None:
            remove(self._model)
            self._model = None


# NOTE [ A Trainer that compiles ]
#     ``TrainingArguments(torch_compile=True)`` trains the model compiled whole
#     (``torch.compile(model, backend=torch_compile_backend)``). An eager profile's plan
#     does not hold there: a multi-block segment cannot run compiled, and what a
#     compiled step saves is not what the eager one does (a held-out check, 2026-11-30:
#     the callback planned eagerly, and at 60% the first compiled forward raised with a
#     remedy the callback could not reach). So the callback plans as
#     ``auto(..., compile=<that backend>)`` does: measured compiled whole, no segments.
#     ``torch_compile_mode`` is not followed: the plan is measured in the default mode.


# NOTE [ Which loss the Trainer takes ]
#     The plan holds for the step profiled, so the callback profiles the loss the Trainer
#     takes, which is not always the model's own:
#     * the plain ``Trainer``: ``output.loss``, the model's loss of the labels; its loss head
#       may be planned (``head=``). Where the head is kept, the loss is held as
#       ``training_step`` holds it (``_HeldLoss``: the loss, and ``Accelerator.backward``'s
#       divided copy), so that the prediction is the step's peak to the byte; a planned
#       head needs the model's own loss, which leaves out that one scalar (4 bytes).
#     * TRL's ``SFTTrainer`` (``trl >= 1.16``) patches the model's forward with its own fused
#       LM head (``add_fused_lm_head``) and calls ``model(**batch, fused_lm_head=True)``:
#       the backbone, then log-probabilities of the labels over tiles of tokens, never
#       the full logits; its token-accuracy and entropy metrics come out of the same
#       kernel. The callback profiles that call. The model's ``lm_head`` is not called
#       there (the kernel reads its weight), so the head is TRL's and is not planned:
#       ``head="auto"`` keeps it, an explicit chunked head is refused. With
#       ``use_liger_kernel=True`` TRL applies Liger's layer kernels (profiled as they run)
#       and turns Liger's fused cross-entropy off, so the loss is still TRL's head.
#     * ``label_smoothing_factor > 0``: the Trainer (and SFTTrainer) take the loss of the
#       logits outside the model, and SFTTrainer runs a second, no-grad forward for its
#       metrics before backward; the callback refuses it rather than plan another step.
#     * TRL's other trainers (``DPOConfig``, ``GRPOConfig``, ``RewardConfig``, ...): each
#       calls the model with inputs of its own and takes a loss of its own (DPOTrainer runs
#       the reference model's forward while the policy's activations are held); refused
#       when training begins, by the class of the arguments, rather than profiled as
#       something they do not run (DPOTrainer's batch has no labels: the profile failed
#       inside TRL's fused head with a TypeError).
#     * ``compute_loss_func=`` (Trainer or SFTTrainer): the loss is the user's function of
#       the logits, and the model is called without labels. No callback event shows it,
#       so the callback checks the first training step's forward: a call with other
#       keyword arguments than the profiled batch's (no labels, no ``fused_lm_head``) is
#       refused before that forward runs, naming the way to plan it by hand.


@dataclass(frozen=True)
class _TrainerLoss:
    """The loss a Trainer takes, as the callback profiles it (NOTE [ Which loss the
    Trainer takes ])."""

    what: str  # in words, for the log
    inputs: dict[str, Any] = field(default_factory=dict)  # keyword arguments added
    loss_fn: LossFn | None = None  # None: output.loss
    head: str | None = None  # the head= to plan with


class _HeldLoss:
    """The loss a Trainer takes from the model's output, as its training step holds it:
    ``Trainer.training_step`` keeps the loss while ``Accelerator.backward`` runs backward
    from a copy divided by its accumulation steps, two scalars through backward (one
    scalar, 4 bytes, over the prediction when profiled as a plain ``loss.backward()``).
    ``name`` is what the tape's and the plan's loss line shows (``describe_loss`` reads
    ``__qualname__``)."""

    def __init__(self, name: str, fused: bool) -> None:
        self.__qualname__ = name
        self.fused = fused  # TRL's fused head's output: SFTTrainer's own reduction
        self.taken: torch.Tensor | None = None

    def __call__(self, output: Any) -> torch.Tensor:
        if self.fused:  # SFTTrainer.compute_loss's reduction of the per-token log-probs
            per_token_loss = -output.log_probs  # zero on ignored positions
            loss = per_token_loss.sum() / output.label_mask.sum().clamp(min=1)
        else:
            loss = output.loss
        self.taken = loss
        return loss / 1  # type: ignore[no-any-return]


def _trainer_loss(model: nn.Module, args: TrainingArguments, loss_fn: LossFn | None,
                  head: str | None) -> _TrainerLoss:
    """Which loss the Trainer training ``model`` takes (NOTE [ Which loss the Trainer
    takes ]); refuses what the callback cannot profile."""
    trl = next((c.__name__ for c in type(args).__mro__
                if c.__module__.split(".")[0] == "trl"), None)
    if trl is not None and trl != "SFTConfig":
        trainer = trl.removesuffix("Config") + "Trainer"
        raise RematError(
            f"the Trainer's arguments are TRL's {trl}: {trainer}'s step is not one "
            "AutorematCallback profiles. The callback profiles the loss the Trainer and "
            "SFTTrainer take (NOTE [ Which loss the Trainer takes ] in autoremat/hf.py); "
            f"{trainer} calls the model with inputs of its own and takes a loss of its own "
            "(DPOTrainer: the policy's forward, then the reference model's forward without "
            "gradients while the policy's activations are held, then a preference loss of "
            "both). Plan by hand before trainer.train(), on a batch as the trainer calls "
            "the model and with a loss_fn that runs the rest of its step: "
            "autoremat.auto(model, batch, budget=..., loss_fn=..., loop='loss_only')")
    smoothing = getattr(args, "label_smoothing_factor", 0) or 0
    if smoothing and getattr(args, "loss_type", "nll") == "nll":
        raise RematError(
            f"label_smoothing_factor={smoothing}: the Trainer takes its label-smoothed loss "
            "of the logits outside the model (SFTTrainer also runs a second forward for its "
            "metrics before backward), a step AutorematCallback does not profile (NOTE [ "
            "Which loss the Trainer takes ] in autoremat/hf.py). Set label_smoothing_factor=0, "
            "or plan by hand before trainer.train(): autoremat.auto(model, batch, "
            "budget=..., loss_fn=<your smoothed loss of the output>, loop='loss_only')")
    fused = next((name for name, m in model.named_modules() if _trl_fused(m)), None)
    if fused is None:
        if loss_fn is not None:
            return _TrainerLoss(f"loss_fn {getattr(loss_fn, '__qualname__', loss_fn)}",
                                loss_fn=loss_fn, head=head)
        # a loss_fn keeps the head as the model computes it: held as the Trainer holds
        # it only where the head is kept anyway
        held = _HeldLoss("output.loss (held as Trainer.training_step holds it)", fused=False)
        return _TrainerLoss("the model's own loss (output.loss)",
                            loss_fn=held if keeps_head(head) else None, head=head)
    if not keeps_head(head) and head != "auto":
        raise RematError(
            f"head={head!r}: SFTTrainer computes the loss with TRL's own fused LM head, which "
            "never builds the logits and does not call the model's lm_head, so there is no "
            "head for autoremat to chunk (NOTE [ Which loss the Trainer takes ] in "
            "autoremat/hf.py). Leave head= out (or 'auto', which keeps TRL's head)")
    liger = (" with Liger's layer kernels (use_liger_kernel=True; its fused cross-entropy "
             "off)" if getattr(args, "use_liger_kernel", False) else "")
    kind = getattr(args, "loss_type", "nll")
    return _TrainerLoss(
        f"TRL's fused LM head ({kind} of the labels' log-probabilities in tiles of tokens, "
        f"no full logits; token accuracy and entropy from the same kernel){liger}; the "
        "model's loss head is TRL's and is not planned",
        inputs={"fused_lm_head": True, "use_cache": False},
        loss_fn=loss_fn or _HeldLoss(
            "TRL's fused LM head (model(**batch, fused_lm_head=True))", fused=True),
        head=None)


def _trl_fused(module: nn.Module) -> bool:
    """Whether ``module``'s forward is TRL's fused LM head (``add_fused_lm_head`` sets an
    instance ``forward``, which Accelerate's mixed precision may wrap again)."""
    func = getattr(vars(module).get("forward"), "__func__", None)
    for _ in range(8):  # the wrappers' chain: functools.wraps sets __wrapped__
        code = getattr(func, "__code__", None)
        if code is not None and code.co_name == "_fused_forward" and \
                "trl" in code.co_filename.replace("\\", "/").split("/"):
            return True
        func = getattr(func, "__wrapped__", None)
        if func is None:
            return False
    return False


class _FirstStep:
    """Forward pre-hook of the model for the first training step: a forward with
    gradients whose keyword arguments are not the profiled batch's is refused before it
    runs (NOTE [ Which loss the Trainer takes ]); then the hook removes itself."""

    def __init__(self, callback: AutorematCallback, keys: list[str]) -> None:
        self.callback = callback
        self.keys = keys

    def __call__(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            return
        if self.callback._guard is not None:
            self.callback._guard.remove()
            self.callback._guard = None
        missing = [key for key in self.keys if key not in kwargs]
        if missing:
            self.callback._take_off()  # the model as it was, before the error reaches them
            raise RematError(
                f"the Trainer's first training step calls {type(module).__name__} without "
                f"{', '.join(missing)}, which the step AutorematCallback profiled had "
                f"(it took {self.callback.loss}): the Trainer takes its loss another way "
                "(a compute_loss_func= of the logits, a compute_loss of its own), so the "
                "plan's figures do not hold for its steps (NOTE [ Which loss the Trainer "
                "takes ] in autoremat/hf.py). Plan by hand before trainer.train(): "
                "autoremat.auto(model, batch, budget=..., loss_fn=<your loss of the output>, "
                "loop='loss_only'), or give the callback loss_fn= for a Trainer subclass "
                "whose compute_loss calls the model with the batch")


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


def _batch_like_the_first(dataloader: Any, args: TrainingArguments) -> Any:
    """The dataset's first ``batch_size`` examples through the dataloader's collate
    function, on ``args.device`` (NOTE [ Which batch the callback profiles ])."""
    size = getattr(dataloader, "batch_size", None) or args.per_device_train_batch_size
    dataset = dataloader.dataset
    with forked_rngs():
        if isinstance(dataset, IterableDataset):
            examples = list(itertools.islice(iter(dataset), size))
        else:
            examples = [dataset[i] for i in range(min(size, len(dataset)))]
        if not examples:
            raise RematError("the training dataset is empty: AutorematCallback has no "
                             "batch to profile")
        batch = dataloader.collate_fn(examples)
    return map_tensors(lambda x: x.to(args.device),
                       dict(batch) if isinstance(batch, Mapping) else batch)  # BatchEncoding
