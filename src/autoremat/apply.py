"""``apply`` a plan to a model in place, ``remove`` it, or do it all with ``auto``."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .blocks import BlockSpec
from .errors import BudgetError, PlanMismatchError, RematError, did_you_mean
from .memory import track_memory
from .plan import Plan, plan
from .profile import profile
from .segments import SegmentRunner
from .step import Loop, LossFn, describe_inputs, preserved_state, run_step
from .units import format_bytes
from .wrap import is_wrapped, unwrap, wrap

__all__ = ["ShapeMismatchWarning", "applied_plan", "apply", "auto", "remove"]

_ATTR = "_autoremat_applied"


class ShapeMismatchWarning(UserWarning):
    """A model runs on inputs of another shape than its plan was made for."""


@dataclass
class _Applied:
    plan: Plan
    wrapped: list[nn.Module] = field(default_factory=list)
    runners: list[SegmentRunner] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)
    warned: set[str] = field(default_factory=set)
    config_restore: Any = None  # a Hugging Face config whose use_cache we turned off


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan currently applied to ``model``, or ``None``."""
    state = model.__dict__.get(_ATTR)
    return state.plan if state is not None else None


def apply(model: nn.Module, plan: Plan) -> nn.Module:
    """Apply ``plan`` to ``model`` in place and return it.

    Kept blocks are untouched; recomputed blocks run under non-reentrant
    ``torch.utils.checkpoint`` (RNG restored on recompute, kwargs and non-tensor
    arguments passed through, inputs that do not require grad are fine); consecutive
    blocks of one segment share one checkpoint. Parameters, state dict and hooks are
    unchanged. Applying again replaces the previous plan; :func:`remove` undoes it.

    A forward on inputs whose shapes differ from the ones the plan was made for warns
    with :class:`ShapeMismatchWarning` (the plan still runs, but may no longer fit).

    Raises:
        PlanMismatchError: the plan was made for another model class, or names blocks
            the model does not have.
    """
    if not isinstance(plan, Plan):
        raise RematError(f"apply() needs a Plan from autoremat.plan, got {type(plan).__name__}")
    if type(model).__name__ != plan.model:
        raise PlanMismatchError(f"this plan was made for a {plan.model}, not a "
                                f"{type(model).__name__}; profile and plan this model")
    modules = dict(model.named_modules())
    for block in plan.blocks:
        if block.name not in modules:
            raise PlanMismatchError(f"the plan names block {block.name!r}, which "
                                    f"{type(model).__name__} does not have."
                                    + did_you_mean(block.name, [n for n in modules if n]))
    remove(model)
    for name, module in modules.items():
        if name and is_wrapped(module):
            raise RematError(f"module {name!r} is already checkpointed by autoremat outside "
                             f"this plan; remove that wrapper first")
    state = _Applied(plan)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        # profile measured without a cache (step.training_config); a loop that holds
        # the output would hold the cache too, over the plan's budget
        why = ("is incompatible with recomputation (each recompute appends to the KV "
               "cache)" if plan.recompute_blocks else
               "keeps a KV cache the plan's figures do not include (it was profiled "
               "without one)")
        warnings.warn(f"autoremat: config.use_cache=True {why}; setting use_cache=False "
                      "until autoremat.remove(model)", UserWarning, stacklevel=2)
        config.use_cache = False  # type: ignore[union-attr]
        state.config_restore = config
    try:
        for start, stop, decision in plan.segments:
            blocks = [modules[b.name] for b in plan.blocks[start:stop]]
            if decision == "keep":
                continue
            if decision == "selective":
                from .selective import selective_context

                for b, module in zip(plan.blocks[start:stop], blocks, strict=False):
                    wrap(module, tag="selective", selective=selective_context(
                        b.save_ops, keep_ops=b.keep_ops, skip_ops=b.skip_ops,
                        signature=b.op_signature))
                    state.wrapped.append(module)
            elif stop == start + 1:
                wrap(blocks[0], tag="recompute")
                state.wrapped.append(blocks[0])
            else:
                runner = SegmentRunner(blocks, [b.name for b in plan.blocks[start:stop]])
                runner.install()
                state.runners.append(runner)
        state.handles.append(model.register_forward_pre_hook(_shape_check(state),
                                                             with_kwargs=True))
        state.handles.append(model.register_forward_hook(_close_segments(state),
                                                         always_call=True))
    except BaseException:
        _undo(state)
        raise
    setattr(model, _ATTR, state)
    return model


def _shape_check(state: _Applied) -> Any:
    def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        inputs: Any = kwargs if kwargs and not args else (args[0] if len(args) == 1 and
                                                          not kwargs else args)
        signature = describe_inputs(inputs)
        if signature != state.plan.inputs and signature not in state.warned:
            state.warned.add(signature)
            warnings.warn(
                f"autoremat: this plan was made for inputs {state.plan.inputs}; the model now "
                f"runs on {signature}. Its memory prediction no longer holds: re-plan "
                f"(autoremat.auto) for the new shapes.", ShapeMismatchWarning, stacklevel=2)
    return hook


def _close_segments(state: _Applied) -> Any:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        for runner in state.runners:
            runner.abort()  # no-op after a normal forward; closes frames after an error
    return hook


def _undo(state: _Applied) -> None:
    if state.config_restore is not None:
        state.config_restore.use_cache = True
    for handle in state.handles:
        handle.remove()
    for runner in state.runners:
        runner.uninstall()
    for module in state.wrapped:
        unwrap(module)


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: the model is exactly as before. A no-op without a plan."""
    state = model.__dict__.pop(_ATTR, None)
    if state is not None:
        _undo(state)
    return model


def auto(model: nn.Module, inputs: Any, budget: int | float | str | None = None,
         strategy: str = "optimal", *, loss_fn: LossFn | None = None,
         blocks: BlockSpec = None, max_memory: int | str | None = None,
         optimizer: str | int | None = None, loop: Loop = "holds_output") -> Plan:
    """Profile, plan and apply in one call; returns the plan applied.

    With a budget, ``auto`` then measures one step with the plan applied and, if the
    measured peak is over the budget, plans again for a budget smaller by the plan's
    prediction error (at most twice more); see NOTE [ auto measures what it applies ].

    Args:
        model, inputs, loss_fn, blocks: as for :func:`autoremat.profile`.
        budget, strategy, max_memory, optimizer: as for :func:`autoremat.plan`.
        loop: the training loop the budget must hold for, as for
            :func:`autoremat.profile` (recorded as ``plan.loop``). ``"holds_output"``
            (default): ``out = model(**batch); out.loss.backward()``, and every loop
            that releases the output sooner. ``"loss_only"``: a tighter plan for a loop
            that keeps only the loss (``loss = model(**batch).loss``).

    Raises:
        BudgetError: no plan fits, or the plans tried still measure over the budget.

    Example:
        >>> import autoremat
        >>> model, inputs = autoremat.zoo.build("gpt2")
        >>> plan = autoremat.auto(model, inputs, budget="50%")
        >>> autoremat.applied_plan(model) is plan
        True
    """
    remove(model)
    tape = profile(model, inputs, loss_fn=loss_fn, blocks=blocks, loop=loop)
    chosen = plan(tape, budget, strategy, max_memory=max_memory, optimizer=optimizer)
    apply(model, chosen)
    if chosen.budget_bytes is None:
        return chosen
    # NOTE [ auto measures what it applies ]
    #     The peak model composes per-block windows keyed by the modes of a block and its
    #     predecessor. Where a block's output lives on in code outside the chain (U-Net
    #     style skip connections held in a list), its lifetime depends on blocks further
    #     away, and a plan can measure one such tensor over its prediction. verify()
    #     reports that; auto(), which has the model, measures the plan it applied and
    #     plans again for the budget less that plan's prediction error (or less the
    #     overshoot, if that is tighter), until the measured step fits: the error is much
    #     the same from plan to plan, so one retry usually does it.
    limit, target = chosen.budget_bytes, chosen.budget_bytes
    for attempt in range(_AUTO_ATTEMPTS):
        peak = _measured_peak(model, inputs, loss_fn, chosen.loop)
        if peak <= limit:
            return chosen
        remove(model)
        if attempt == _AUTO_ATTEMPTS - 1:
            break
        target = min(target - (peak - limit), limit - (peak - chosen.predicted_peak_bytes))
        try:
            retry = plan(tape, target, strategy)
        except BudgetError as exc:
            raise BudgetError(
                f"the plan for {format_bytes(limit)} measured {format_bytes(peak)}; a plan "
                f"for {format_bytes(target)} to make up for it does not exist: {exc}",
                min_feasible_bytes=exc.min_feasible_bytes, strategy=exc.strategy) from exc
        note = (f"planned for {format_bytes(target)} so that the measured step fits "
                f"{format_bytes(limit)} (a plan for {format_bytes(limit)} measured "
                f"{format_bytes(peak)}: the peak model missed tensors held outside the "
                "chain of blocks)")
        chosen = dataclasses.replace(retry, budget_bytes=limit,
                                     notes=(*retry.notes, note))
        apply(model, chosen)
    raise BudgetError(
        f"after {_AUTO_ATTEMPTS} plans the measured step peak is still "
        f"{format_bytes(peak)}, over the budget of {format_bytes(limit)}; give a smaller "
        "budget, or pass blocks=[...] so that tensors held between blocks are inside them",
        min_feasible_bytes=None, strategy=strategy)


_AUTO_ATTEMPTS = 3  # plans auto() measures before giving up (NOTE [ auto measures ... ])


def _measured_peak(model: nn.Module, inputs: Any, loss_fn: LossFn | None, loop: Loop) -> int:
    with preserved_state(model), track_memory() as mem:
        run_step(model, inputs, loss_fn, loop=loop)
    return mem.peak_bytes
