"""``apply`` a plan to a model in place, and ``remove`` it again.

NOTE [ Every rank applies one plan ]
    In a distributed run every rank must recompute the same blocks: under FSDP2 a rank
    that recomputes a block all-gathers its parameters at another moment than a rank
    that keeps it, the collectives no longer pair up, and the job hangs; under DDP the
    gradients still agree, but the ranks' memory and speed do not. The plan is made once
    (on rank 0) and sent to the others (``autoremat.distributed.broadcast_plan``). When
    ``torch.distributed`` is initialized with more than one rank, ``apply`` therefore is
    a collective: it gathers every rank's decisions (model class, block names, keep /
    recompute / selective, segments and kept ops; not the predictions, which may differ
    in the last digits between ranks that planned alike) before it changes the model,
    and every rank raises :class:`PlanMismatchError` naming the ranks whose plan differs
    from rank 0's. A rank that does not call ``apply`` makes the others raise after
    ``rank_timeout_s`` (NOTE [ A collective that cannot hang ] in ``_core/ranks.py``).
    ``check_ranks=False`` skips the exchange: for runs whose ranks rightly apply
    different plans (pipeline stages), or ``apply`` on one rank only. autoremat's own
    callers (``auto``, ``verify``, ``bench``, the command line) apply without it: they
    run in one process, and a distributed run sends their plan on with
    ``broadcast_plan``.
"""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from autoremat._core.calls import call_modules, install_calls, remove_calls
from autoremat._core.conditions import float_dtypes, structure_of
from autoremat._core.decisions import Decision
from autoremat._core.errors import PlanMismatchError, RematError, check_flag, did_you_mean
from autoremat._core.ranks import gather_texts, rank_and_size
from autoremat._core.saves import parse_keep_keys
from autoremat._core.step import cache_configs, layer_drops
from autoremat._guards import (
    Applied,
    close_segments,
    shape_check,
    watch_blocks,
)
from autoremat._measure.blocks import param_signature
from autoremat._mechanism.compiled import (
    LEAST_COMPILE_BUDGET,
    budgeted_inductor,
    compile_budget,
    compile_budget_hook,
    compiled_context,
    compiled_parts,
    uncompiled,
)
from autoremat._mechanism.engines import model_class_name, unwrapped
from autoremat._mechanism.head import HeadSite, install_head, uninstall_head
from autoremat._mechanism.offload import offload
from autoremat._mechanism.segments import SegmentRunner, refuse_under_fsdp
from autoremat._mechanism.selective import selective_context
from autoremat._mechanism.wrap import PLAN_OWNER, is_wrapped, plan_states, unwrap, wrap
from autoremat._plan.plan import Plan
from autoremat._profile.runs import refuse_hf_checkpointing

__all__ = ["applied_plan", "apply", "compile_model", "remove"]

_ATTR = "_autoremat_applied"
_OWNER = PLAN_OWNER  # on each planned block: the state of the plan it is in

# NOTE [ A plan found from its blocks ]
#     A plan's state lives on the model it was applied to; each planned block also names
#     it, so that a model holding only the blocks finds it. PEFT's ``merge_and_unload()``
#     returns the base model from inside the ``PeftModel`` a plan was applied to: its
#     blocks stayed wrapped (their recompute, ``use_cache`` off), ``applied_plan`` said
#     None and ``remove`` did nothing, silently (a held-out loop, 2026-11-29). Now both
#     find the plan through its blocks, and ``remove`` undoes it wherever it was applied.


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan currently applied to ``model``, or ``None``."""
    if not isinstance(model, nn.Module):
        raise RematError(f"applied_plan() needs an nn.Module, got {type(model).__name__}")
    inner = unwrapped(model)[0]
    state = inner.__dict__.get(_ATTR)
    if state is not None and not state.undone:
        return state.plan  # type: ignore[no-any-return]
    found = plan_states(inner)
    return found[0].plan if found else None


def compile_model(model: nn.Module, **kwargs: Any) -> nn.Module:
    """``torch.compile(model, **kwargs)``, compiled as the plan applied to ``model`` was
    measured: with the plan's backend by default (``plan.compiled``), and, for a plan
    that rests on compile's own memory budget (``plan.compile_memory_budget``), with
    that budget and random draws saved while each graph compiles (NOTE [ Compile's own
    memory budget, exact ] in ``_mechanism/compiled.py``). Without such a plan it is
    ``torch.compile`` itself.

    Raises:
        RematError: ``model`` is compiled already, or a plan that rests on compile's
            budget is given a backend other than Inductor (whose pass saves the draws).

    Example:
        >>> import autoremat
        >>> model, inputs = autoremat.zoo.build("mlp", widths=(8, 8), batch_size=2)
        >>> compiled = autoremat.compile_model(model)  # no plan: torch.compile(model)
        >>> compiled._orig_mod is model
        True
    """
    if not isinstance(model, nn.Module):
        raise RematError(f"compile_model() needs an nn.Module, got {type(model).__name__}")
    if uncompiled(model) is not model:
        raise RematError("compile_model() was given a model that torch.compile already "
                         "wraps; give it the model itself (compiled._orig_mod)")
    plan = applied_plan(model)
    if plan is not None and plan.compiled:
        kwargs.setdefault("backend", plan.compiled)
    fraction = plan.compile_memory_budget if plan is not None else None
    if fraction is not None and kwargs.get("backend", "inductor") != "inductor":
        raise RematError(f"the plan applied rests on compile's own memory budget, which "
                         f"autoremat makes exact with an Inductor pass; backend="
                         f"{kwargs['backend']!r} has no such pass: compile with Inductor "
                         f"(the default), or plan again")
    if fraction is None:
        return torch.compile(model, **kwargs)  # type: ignore[return-value]
    kwargs["backend"] = budgeted_inductor(fraction)
    compiled: nn.Module = torch.compile(model, **kwargs)  # type: ignore[assignment]
    forward = compiled.forward

    @functools.wraps(forward)
    def budgeted(*args: Any, **kw: Any) -> Any:
        with compile_budget(fraction):  # read while Dynamo traces and Inductor compiles
            return forward(*args, **kw)

    compiled.forward = budgeted  # type: ignore[method-assign]
    return compiled


def apply(model: nn.Module, plan: Plan, *, check_ranks: bool = True,
          rank_timeout_s: float = 30.0) -> nn.Module:
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

    ``model`` may be wrapped by ``torch.compile``, ``DistributedDataParallel`` or
    sharded by FSDP2's ``fully_shard``, before or after ``apply`` (NOTE [ Plans under
    DDP and FSDP2 ] in ``_mechanism/engines.py``).

    Args:
        model: the model the plan was made for.
        plan: from :func:`autoremat.plan` (in a distributed run: the same on every rank,
            from :func:`autoremat.distributed.broadcast_plan`).
        check_ranks: in a distributed run (``torch.distributed`` initialized, more
            than one rank), check that every rank applies the same decisions; this
            makes ``apply`` a collective that every rank must call (NOTE [ Every rank
            applies one plan ]). ``False`` skips it.
        rank_timeout_s: how long a rank waits for the others in that check (seconds > 0;
            checked in one process too).

    Raises:
        PlanMismatchError: the plan was made for another model class, or names blocks
            the model does not have, or (distributed) ranks apply different plans.
        RematError: (distributed) a rank did not call ``apply`` within
            ``rank_timeout_s``.
    """
    if not isinstance(plan, Plan):
        raise RematError(f"apply() needs a Plan from autoremat.plan(), got {type(plan).__name__}")
    fraction = plan.compile_memory_budget
    if fraction is not None and not 0 < fraction < 1:  # NOTE [ Compile's own memory
        # budget, exact ] in _mechanism/compiled.py
        raise PlanMismatchError(
            f"this plan rests on compile's own memory budget {fraction!r}, which must be "
            f"in (0, 1): at 0 compile's partitioner saves the graph's inputs alone and "
            f"draws dropout again in backward (wrong gradients). Plan again "
            f"(autoremat.auto(..., compile=True) tries {LEAST_COMPILE_BUDGET} at least)")
    given, (model, compiled_whole) = model, unwrapped(model)
    if not (isinstance(rank_timeout_s, (int, float)) and not isinstance(rank_timeout_s, bool)
            and rank_timeout_s > 0):
        raise RematError(f"rank_timeout_s (how long a rank waits for the others) must be a "
                         f"number of seconds > 0, got {rank_timeout_s!r}")
    if check_flag("check_ranks", check_ranks):
        _check_ranks_agree(plan, rank_timeout_s)
    if model_class_name(model) != plan.model:
        raise PlanMismatchError(f"this plan was made for a {plan.model}, not a "
                                f"{model_class_name(model)}; profile and plan this model")
    planned = [b.name for b in plan.blocks]
    modules = dict(model.named_modules()) | call_modules(model, planned)
    seen: set[str] = set()
    for block in plan.blocks:
        if block.name in seen:
            raise PlanMismatchError(f"the plan decides block {block.name!r} twice; a plan "
                                    "decides each block once (was it edited?). Plan again")
        seen.add(block.name)
        if block.name not in modules:
            raise PlanMismatchError(f"the plan names block {block.name!r}, which "
                                    f"{model_class_name(model)} does not have."
                                    + did_you_mean(block.name, [n for n in modules if n]))
        if block.params and param_signature(modules[block.name]) != block.params:
            shapes = ", ".join(f"{n} {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}"
                               for n, p in list(modules[block.name].named_parameters())[:3])
            raise PlanMismatchError(
                f"block {block.name!r} has parameters of other names, shapes or dtypes than "
                f"the block this plan was made for (here: {shapes or 'none'}, ...): a wider, "
                "narrower or cast model of the same class, whose memory the plan's figures "
                "do not describe. Profile and plan this model")
    refuse_hf_checkpointing(model, "apply()", would="would recompute inside its recompute")
    _check_conditions(model, plan)
    compiled = compiled_parts(model, given if compiled_whole else None)
    joined = [start for start, stop, _ in plan.segments if stop > start + 1]
    for start, stop, _ in plan.segments:
        if stop > start + 1:
            names = [b.name for b in plan.blocks[start:stop]]
            refuse_under_fsdp(names, [modules[name] for name in names])
    drops = layer_drops(model) if joined else []
    if drops:  # NOTE [ Random layer skipping ] in _core/step.py
        raise RematError(
            f"this plan checkpoints multi-block segments (from {plan.blocks[joined[0]].name}), "
            f"and the model skips layers at random in training ({drops[0][1]}="
            f"{drops[0][2]!r}): a segment's recompute would not replay the skips between "
            f"its blocks. Plan from a profile of this model (it joins no blocks then), or "
            f"set {drops[0][1]} to 0")
    if compiled and joined:
        raise RematError(
            f"this plan checkpoints multi-block segments (from {plan.blocks[joined[0]].name}), "
            f"which cannot run under torch.compile, and {compiled[0]} is compiled. Re-plan "
            "for the compiled step from a tape measured compiled: "
            "autoremat.plan(autoremat.profile(model, inputs, compile=True), budget)")
    if compiled and plan.offload_blocks:
        first = next(b.name for b in plan.blocks if b.decision.offloads)
        raise RematError(
            f"this plan offloads blocks (from {first}), which cannot run under "
            f"torch.compile, and {compiled[0]} is compiled. Plan without offload for the "
            "compiled step: autoremat.plan(autoremat.profile(model, inputs, compile=True), "
            "budget)")
    site = _head_site(plan, modules, model_class_name(model))
    remove(model)
    install_calls(model, planned)  # NOTE [ A block that runs several times ]
    modules |= call_modules(model, planned)
    for name, module in modules.items():
        if name and is_wrapped(module):
            raise RematError(f"module {name!r} is already checkpointed by autoremat outside "
                             f"this plan; remove that wrapper first")
    state = Applied(plan)
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
        save = getattr(model, "save_pretrained", None)
        if callable(save) and "save_pretrained" not in vars(model):
            model.save_pretrained = _SavedAsConfigured(  # type: ignore[assignment]
                save, state.cache_restore)
            state.saves = model
    dtype = getattr(torch, plan.offload_dtype) if plan.offload_dtype else None
    try:
        for start, stop, decision in plan.segments:
            blocks = [modules[b.name] for b in plan.blocks[start:stop]]
            if decision is Decision.KEEP:
                continue
            if decision.offloads:  # its saved tensors, or (checkpointed) its input
                after = modules[plan.blocks[stop].name] if stop < len(plan.blocks) else None
                _, handle = offload(blocks[0], model, after, dtype=dtype,
                                    input_only=decision is Decision.OFFLOAD_INPUT,
                                    name=plan.blocks[start].name)
                state.wrapped.append(blocks[0])
                if handle is not None:
                    state.handles.append(handle)
                continue
            if decision is Decision.SELECTIVE:
                for b, module in zip(plan.blocks[start:stop], blocks, strict=False):
                    wrap(module, decision, selective=selective_context(
                        b.save_ops, keep_ops=b.keep_ops, skip_ops=b.skip_ops,
                        signature=b.op_signature, label=b.name),
                        compiled=compiled_context(b.save_ops, parse_keep_keys(b.keep_keys)),
                        name=b.name)
                    state.wrapped.append(module)
            elif stop == start + 1:
                wrap(blocks[0], Decision.RECOMPUTE, name=plan.blocks[start].name)
                state.wrapped.append(blocks[0])
            else:
                runner = SegmentRunner(blocks, [b.name for b in plan.blocks[start:stop]])
                runner.install()
                state.runners.append(runner)
        if site is not None and plan.head_chunks is not None:
            state.head = install_head(model, site, plan.head_chunks, plan.head.backend)
        watch_blocks(model, plan, modules, state)
        if plan.compile_memory_budget is not None:
            state.handles.append(model.register_forward_pre_hook(
                compile_budget_hook(plan.compile_memory_budget)))
        state.handles.append(model.register_forward_pre_hook(
            functools.partial(shape_check, state), with_kwargs=True))
        state.handles.append(model.register_forward_hook(
            functools.partial(close_segments, state), always_call=True))
    except BaseException:
        _undo(state)
        remove_calls(model)
        raise
    for _, _, planned_block in state.blocks:
        planned_block.__dict__[_OWNER] = state  # NOTE [ A plan found from its blocks ]
    setattr(model, _ATTR, state)
    return given


def _check_conditions(model: nn.Module, plan: Plan) -> None:
    """Refuse a model whose blocks' parents hold another number of modules, or whose
    parameters have other floating dtypes, than the step the plan's tape measured (NOTE
    [ What a plan is checked against ])."""
    if not plan.dtypes:
        return  # made from a tape that did not record them
    here = structure_of(model, [b.name for b in plan.blocks])
    if plan.structure and here != plan.structure:
        raise PlanMismatchError(
            f"this plan was made for a {plan.model} of {plan.structure} (the modules each "
            f"parent of its blocks holds); this one is of {here}: the blocks the plan does "
            "not name would run kept, beyond its prediction (a plan of a smaller model of "
            "the same class?). Profile and plan this model")
    dtypes = float_dtypes(model.parameters())
    if dtypes != plan.dtypes:
        raise PlanMismatchError(
            f"this plan was made for a {plan.model} whose parameters are {plan.dtypes}; "
            f"this one's are {dtypes} (cast since it was profiled?): every tensor of the "
            "step has another size than the plan's figures count. Profile and plan the "
            "model as it trains (after the cast)")


def _check_ranks_agree(plan: Plan, timeout_s: float) -> None:
    """Every rank's decisions against rank 0's (NOTE [ Every rank applies one plan ])."""
    rank, size = rank_and_size()
    # the loss head too: a rank whose head is chunked returns no logits, and a collective
    # over them (a metric's all-reduce) would pair with nothing (a held-out check)
    mine = json.dumps({"model": plan.model, "blocks": [asdict(b) for b in plan.blocks],
                       "head": plan.head.head_key}, sort_keys=True)
    texts = gather_texts(mine, timeout_s=timeout_s, what="autoremat.apply")
    differ = [r for r, text in enumerate(texts) if text != texts[0]]
    if not differ:
        return
    first = json.loads(texts[0])
    other = json.loads(texts[differ[0]])
    where = _first_difference(first, other)
    raise PlanMismatchError(
        f"the ranks of this run apply different plans: rank(s) {differ} differ from rank 0 "
        f"(of {size}; this is rank {rank}); first difference: {where}. Ranks must "
        "recompute the same blocks, or FSDP's collectives no longer pair up: make the plan "
        "on one rank and send it to the others with "
        "autoremat.distributed.broadcast_plan(plan), then apply it on every rank")


def _first_difference(first: dict[str, Any], other: dict[str, Any]) -> str:
    """Where two ranks' decisions part, in words."""
    if first["model"] != other["model"]:
        return f"model {first['model']!r} on rank 0, {other['model']!r} on the other"
    if first.get("head") != other.get("head"):
        return f"the loss head {first.get('head')!r} on rank 0, {other.get('head')!r} on the other"
    a, b = first["blocks"], other["blocks"]
    for x, y in zip(a, b, strict=False):
        if x != y:
            keys = [k for k in x if x[k] != y.get(k)]
            return (f"block {x['name']!r}: " + ", ".join(
                f"{k} {x[k]!r} on rank 0, {y.get(k)!r} on the other" for k in keys[:2]))
    return f"{len(a)} blocks on rank 0, {len(b)} on the other"


def _head_site(plan: Plan, modules: dict[str, nn.Module], model: str) -> HeadSite | None:
    """Where the plan's chunked head runs (``None``: the plan keeps the head)."""
    if plan.head.decision is Decision.KEEP:
        return None
    site = plan.head_site
    module = None if site is None else modules.get(site.name)
    vocab = getattr(module, "out_features", None)
    if site is None or not isinstance(vocab, int):
        raise PlanMismatchError(f"the plan chunks the loss head at {site and site.name!r}, "
                                f"which {model} does not have as a linear layer; profile and "
                                f"plan this model")
    return HeadSite(site.kind, site.name, vocab)


# NOTE [ Saved with the user's config ]
#     apply() turns ``use_cache`` off in the model's configs while the plan is applied
#     (NOTE [ Every stack has its own config ] in _core/step.py). A checkpoint saved then
#     (the Trainer saves one every ``save_steps``, with AutorematCallback applied) would
#     carry ``"use_cache": false`` in its config.json, and the model loaded from it would
#     return no cache where its user's had. So the model's ``save_pretrained`` (the one
#     the Trainer, ``push_to_hub`` and users call) is wrapped to save the configs with
#     the user's values, and turns them off again after; remove() takes the wrapper away.
class _SavedAsConfigured:
    """``save_pretrained`` of a model whose configs apply() changed: the configs as the
    user had them while it saves (NOTE [ Saved with the user's config ])."""

    def __init__(self, original: Callable[..., Any], restore: list[tuple[Any, bool]]) -> None:
        self.original = original
        self.restore = restore  # the applied state's, so that a copy's follows its copy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for config, value in self.restore:
            config.use_cache = value
        try:
            return self.original(*args, **kwargs)
        finally:
            for config, _ in self.restore:
                config.use_cache = False


def _undo(state: Applied) -> None:
    if state.undone:
        return
    state.undone = True
    for _, _, block in state.blocks:
        if block.__dict__.get(_OWNER) is state:
            del block.__dict__[_OWNER]
    if state.head is not None:
        uninstall_head(state.head)
        state.head = None
    if state.saves is not None and \
            isinstance(vars(state.saves).get("save_pretrained"), _SavedAsConfigured):
        del state.saves.save_pretrained
        state.saves = None
    for config, value in state.cache_restore:
        config.use_cache = value
    for handle in state.handles:
        handle.remove()
    for runner in state.runners:
        runner.uninstall()
    for module in state.wrapped:
        unwrap(module)


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: the model is exactly as before. A no-op without a plan. Given a
    model whose blocks are in a plan applied to a model holding it (the base model
    PEFT's ``merge_and_unload()`` returns), it undoes that plan (NOTE [ A plan found from
    its blocks ])."""
    if not isinstance(model, nn.Module):
        raise RematError(f"remove() needs an nn.Module, got {type(model).__name__}")
    inner = unwrapped(model)[0]
    state = inner.__dict__.pop(_ATTR, None)
    if state is not None:
        _undo(state)
    for other in plan_states(inner):
        _undo(other)
    remove_calls(inner)
    return model
