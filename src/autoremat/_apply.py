"""``apply`` a plan to a model in place, and ``remove`` it again."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoremat._core.errors import PlanMismatchError, RematError, did_you_mean
from autoremat._core.step import cache_configs, describe_inputs
from autoremat._mechanism.compiled import (
    compiled_context,
    compiled_parts,
    parse_keep_keys,
    uncompiled,
)
from autoremat._mechanism.offload import offload
from autoremat._mechanism.segments import SegmentRunner
from autoremat._mechanism.selective import selective_context
from autoremat._mechanism.wrap import is_wrapped, unwrap, wrap
from autoremat._plan.plan import Plan

__all__ = ["ShapeMismatchWarning", "applied_plan", "apply", "remove"]

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
    cache_restore: list[tuple[Any, bool]] = field(default_factory=list)  # configs whose
    # use_cache we turned off, and their values (NOTE [ Every stack has its own config ])


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan currently applied to ``model``, or ``None``."""
    state = uncompiled(model).__dict__.get(_ATTR)
    return state.plan if state is not None else None


def apply(model: nn.Module, plan: Plan) -> nn.Module:
    """Apply ``plan`` to ``model`` in place and return it.

    Kept blocks are untouched; recomputed blocks run under non-reentrant
    ``torch.utils.checkpoint`` (RNG restored on recompute, kwargs and non-tensor
    arguments passed through, inputs that do not require grad are fine); consecutive
    blocks of one segment share one checkpoint; offloaded blocks copy their saved
    tensors to host memory and back (NOTE [ Offloading saved tensors ]). Parameters,
    state dict and hooks are unchanged. Applying again replaces the previous plan;
    :func:`remove` undoes it.

    A forward on inputs whose shapes differ from the ones the plan was made for warns
    with :class:`ShapeMismatchWarning` (the plan still runs, but may no longer fit).

    Raises:
        PlanMismatchError: the plan was made for another model class, or names blocks
            the model does not have.
    """
    if not isinstance(plan, Plan):
        raise RematError(f"apply() needs a Plan from autoremat.plan(), got {type(plan).__name__}")
    given, model = model, uncompiled(model)
    if type(model).__name__ != plan.model:
        raise PlanMismatchError(f"this plan was made for a {plan.model}, not a "
                                f"{type(model).__name__}; profile and plan this model")
    modules = dict(model.named_modules())
    for block in plan.blocks:
        if block.name not in modules:
            raise PlanMismatchError(f"the plan names block {block.name!r}, which "
                                    f"{type(model).__name__} does not have."
                                    + did_you_mean(block.name, [n for n in modules if n]))
    compiled = compiled_parts(model, given)
    joined = [start for start, stop, _ in plan.segments if stop > start + 1]
    if compiled and joined:
        raise RematError(
            f"this plan checkpoints multi-block segments (from {plan.blocks[joined[0]].name}), "
            f"which cannot run under torch.compile, and {compiled[0]} is compiled. Re-plan "
            "for the compiled step from a tape measured compiled: "
            "autoremat.plan(autoremat.profile(model, inputs, compile=True), budget)")
    if compiled and plan.offload_blocks:
        first = next(b.name for b in plan.blocks if b.decision == "offload")
        raise RematError(
            f"this plan offloads blocks (from {first}), which cannot run under "
            f"torch.compile, and {compiled[0]} is compiled. Plan without offload for the "
            "compiled step: autoremat.plan(autoremat.profile(model, inputs, compile=True), "
            "budget)")
    remove(model)
    for name, module in modules.items():
        if name and is_wrapped(module):
            raise RematError(f"module {name!r} is already checkpointed by autoremat outside "
                             f"this plan; remove that wrapper first")
    state = _Applied(plan)
    configs = cache_configs(model)
    if configs:
        # profile measured without a cache (step.training_config); a loop that holds
        # the output would hold the cache too, over the plan's budget
        why = ("is incompatible with recomputation (each recompute appends to the KV "
               "cache)" if plan.recompute_blocks else
               "keeps a KV cache the plan's figures do not include (it was profiled "
               "without one)")
        warnings.warn(f"autoremat: use_cache=True (in {', '.join(configs)}) {why}; setting "
                      "it to False until autoremat.remove(model)", UserWarning, stacklevel=2)
        state.cache_restore = [(config, config.use_cache) for config in configs.values()]
        for config in configs.values():
            config.use_cache = False
    try:
        for start, stop, decision in plan.segments:
            blocks = [modules[b.name] for b in plan.blocks[start:stop]]
            if decision == "keep":
                continue
            if decision == "offload":
                after = modules[plan.blocks[stop].name] if stop < len(plan.blocks) else None
                _, handle = offload(blocks[0], model, after)
                state.wrapped.append(blocks[0])
                if handle is not None:
                    state.handles.append(handle)
                continue
            if decision == "selective":
                for b, module in zip(plan.blocks[start:stop], blocks, strict=False):
                    wrap(module, tag="selective", selective=selective_context(
                        b.save_ops, keep_ops=b.keep_ops, skip_ops=b.skip_ops,
                        signature=b.op_signature),
                        compiled=compiled_context(b.save_ops, parse_keep_keys(b.keep_keys)))
                    state.wrapped.append(module)
            elif stop == start + 1 and plan.blocks[start].offload_input:
                after = modules[plan.blocks[stop].name] if stop < len(plan.blocks) else None
                _, handle = offload(blocks[0], model, after, input_only=True)
                state.wrapped.append(blocks[0])
                if handle is not None:
                    state.handles.append(handle)
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
    return given


def _shape_check(state: _Applied) -> Any:
    def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        inputs: Any = kwargs if kwargs and not args else (args[0] if len(args) == 1 and
                                                          not kwargs else args)
        signature = describe_inputs(inputs)
        if signature != state.plan.inputs and signature not in state.warned \
                and describe_inputs(_without_scalars(inputs)) != state.plan.inputs:
            state.warned.add(signature)
            warnings.warn(
                f"autoremat: this plan was made for inputs {state.plan.inputs}; the model now "
                f"runs on {signature}. Its memory prediction no longer holds: re-plan "
                f"(autoremat.auto) for the new shapes.", ShapeMismatchWarning, stacklevel=2)
    return hook


def _without_scalars(inputs: Any) -> Any:
    """Keyword inputs less 0-d tensors: a scalar that a training loop adds to the call
    (the Hugging Face Trainer's ``num_items_in_batch``) changes no shape the plan's
    memory depends on, so it is no reason to warn."""
    if not isinstance(inputs, dict):
        return inputs
    return {k: v for k, v in inputs.items() if not (isinstance(v, torch.Tensor) and v.dim() == 0)}


def _close_segments(state: _Applied) -> Any:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        for runner in state.runners:
            runner.abort()  # no-op after a normal forward; closes frames after an error
    return hook


def _undo(state: _Applied) -> None:
    for config, value in state.cache_restore:
        config.use_cache = value
    for handle in state.handles:
        handle.remove()
    for runner in state.runners:
        runner.uninstall()
    for module in state.wrapped:
        unwrap(module)


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: the model is exactly as before. A no-op without a plan."""
    state = uncompiled(model).__dict__.pop(_ATTR, None)
    if state is not None:
        _undo(state)
    return model
