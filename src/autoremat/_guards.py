"""What an applied plan checks while the model trains: the forward's hooks that refuse or
warn where the step runs differs from the one the plan was made for (NOTE [ What a plan
is checked against ]), and the state ``apply`` keeps on the model for them and for
``remove``. ``apply`` (``_apply.py``) installs them.
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
import weakref
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoremat._core.calls import calls_beyond, held_at
from autoremat._core.conditions import (
    autocast_state,
    drop_forward_casts,
    float_dtypes,
    hook_name,
    parametrize_cached,
    user_hooks,
)
from autoremat._core.decisions import Decision
from autoremat._core.errors import PlanMismatchError, RematError
from autoremat._core.step import OWN_STEP, describe_inputs, flat_tensors, input_entries
from autoremat._mechanism.head import HeadInstall
from autoremat._mechanism.segments import SEGMENT_ADVICE, SegmentRunner
from autoremat._plan.plan import Plan

__all__ = ["Applied", "PlanMismatchWarning", "ShapeMismatchWarning", "StepMismatchWarning",
           "close_segments", "shape_check", "watch_blocks"]


class PlanMismatchWarning(UserWarning):
    """A model runs in another setting than its plan was made for (NOTE [ What a plan is
    checked against ]): the plan still runs, but its memory figures may not hold."""


class ShapeMismatchWarning(PlanMismatchWarning):
    """A model runs on inputs of another shape than its plan was made for."""


class StepMismatchWarning(PlanMismatchWarning):
    """A model trains under other conditions than its plan's tape measured: another
    autocast, parameters cast to another dtype, blocks appended or replaced, or a block
    run more than once per forward (NOTE [ The conditions a step is measured under ] in
    ``_core/conditions.py``)."""


# NOTE [ What a plan is checked against ]
#     A plan records what it was made for; apply() and the model's forward compare, per
#     field, and refuse where running would be wrong or meaningless, warn where the plan
#     still runs correctly but its figures may not hold:
#     * model class, block names, each block's parameters (names, shapes, dtypes): a
#       mismatch is refused at apply() (PlanMismatchError): a wider or cast model's
#       memory is not what the plan describes, and a keep-set indexes another block's ops;
#     * input shapes and dtypes: warned at the first forward on other ones
#       (ShapeMismatchWarning; a training loop's last, smaller batch is common);
#     * device type (cpu / cuda / ...): warned at a forward with gradients enabled on
#       another device than the tape's (PlanMismatchWarning): costs and allocator
#       rounding differ;
#     * train/eval mode: warned when a plan profiled in eval() mode runs a model in
#       train() mode with gradients enabled (dropout and BatchNorm then save more: 35%
#       over budget was seen). The other way round holds less and is not warned about;
#       nor is any forward without gradients (evaluation), where nothing is recomputed;
#     * the conditions of the step (NOTE [ The conditions a step is measured under ] in
#       _core/conditions.py): the blocks' parents holding another number of modules and
#       the parameters' floating dtypes are refused at apply(); at a forward with
#       gradients, another autocast (refused for a plan whose chunked head cannot run
#       under it), another dtype, a block appended or replaced since apply(), and, when
#       the forward returns, a block that ran more than once are warned about once each
#       (StepMismatchWarning);
#     * forwards before one backward: a forward with gradients while the graph of the
#       last one is still alive and its backward has not reached the model's output (two
#       views through the model, then one loss: a siamese or contrastive loss, a
#       discriminator on real and fake) holds the activations of both, where the plan was
#       measured for one: warned once (StepMismatchWarning). A graph freed without a
#       backward (a forward with gradients whose output was dropped) is not counted: the
#       hooks that mark it go with it;
#     * forward hooks registered after apply() on a planned block (pre or post), or global
#       ones: what a hook keeps (a block's output, for a distillation or probing loss)
#       the plan did not measure (a Llama whose hook kept one layer's output: 1.8% over
#       the prediction). Warned once at a forward with gradients (StepMismatchWarning),
#       naming the blocks and the hooks; the hooks of torch (FSDP2's), DeepSpeed,
#       Accelerate, Transformers, PEFT, Lightning, TRL and autoremat are theirs, not
#       counted. Hooks on modules inside a block are not looked at (a walk of every
#       module on every forward);
#     * the model's own checkpointing: a model with Hugging Face gradient checkpointing on
#       is refused at apply() (each planned block would recompute inside its recompute);
#       turned on after apply() (``gradient_checkpointing_enable()``), warned at the next
#       forward with gradients (StepMismatchWarning): gradients stay the plain model's,
#       but every layer is recomputed (the planned ones inside their own recompute), and
#       the step holds what the plan did not measure.
#       Read from the flag of the modules that had one at apply() (``flagged``).
#     None of these is checked inside a compiled forward: whole-model torch.compile
#     traces the model's hooks into every step (Dynamo replays their Python side effects
#     after each graph: on zoo llama at 4 x 256, seq 256, batch 8, the step with the
#     checks measured x1.031 the plain compiled one, without them x0.986), and Dynamo
#     guards the shapes and dtypes itself, compiling again when they change.


@dataclass
class Applied:
    plan: Plan
    wrapped: list[nn.Module] = field(default_factory=list)
    runners: list[SegmentRunner] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)
    warned: set[str] = field(default_factory=set)
    warned_batches: list[str] = field(default_factory=list)  # the batches warned about as
    # beyond the plan's (NOTE [ Smaller batches are within the plan ])
    cache_restore: list[tuple[Any, bool]] = field(default_factory=list)  # configs whose
    # use_cache we turned off, and their values (NOTE [ Every stack has its own config ])
    head: HeadInstall | None = None  # the chunked loss head, when the plan chunks it
    saves: nn.Module | None = None  # the model whose save_pretrained saves cache_restore's
    # values (NOTE [ Saved with the user's config ] in _apply.py)
    # the planned blocks as (parent, key, block), the parents' sizes, some parameters
    # whose dtypes stand for the model's, and each block's calls in the forward now
    # running (None: no forward with gradients running) (NOTE [ What a plan is checked
    # against ])
    blocks: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)
    parents: list[tuple[str, nn.Module, int]] = field(default_factory=list)
    probes: list[nn.Parameter] = field(default_factory=list)
    flagged: list[nn.Module] = field(default_factory=list)  # modules with Hugging Face's
    # gradient_checkpointing flag (off at apply(), NOTE [ What a plan is checked against ])
    calls: list[int] | None = None
    hooks: list[set[int]] = field(default_factory=list)  # the handles of the forward
    # hooks on each block, and (last) the global ones, there at apply() or looked at since
    # (NOTE [ What a plan is checked against ])
    # the last forward with gradients, until its backward starts or its graph is freed
    # (NOTE [ What a plan is checked against ]: forwards before one backward)
    pending: weakref.ref[_Forward] | None = None
    undone: bool = False  # removed (NOTE [ A plan found from its blocks ] in _apply.py)

    def __getstate__(self) -> dict[str, Any]:
        # a pickled model (torch.save(model)) carries its plan, not the forward in flight:
        # the weak reference to it does not pickle (a copy.deepcopy keeps it, as it keeps
        # any weak reference)
        return {**self.__dict__, "pending": None, "calls": None}


class _Forward:
    """One forward with gradients: referenced only by the hooks on its output's graph
    nodes, so it lives as long as that graph, and marked when backward reaches it."""

    backward_ran = False


def _backward_reached(forward: _Forward, *grads: Any) -> None:
    if not forward.backward_ran:
        # a backward inside the autocast region holds its weight casts otherwise (NOTE
        # [ Backward inside autocast ] in _mechanism/wrap.py)
        torch.clear_autocast_cache()
    forward.backward_ran = True


def watch_blocks(model: nn.Module, plan: Plan, modules: dict[str, nn.Module],
                  state: Applied) -> None:
    """Note what the forward checks (NOTE [ What a plan is checked against ]): where each
    planned block sits, its parents' sizes, parameters that stand for the model's
    dtypes; and count each block's calls in a forward."""
    for block in plan.blocks:
        parent, _, key = block.name.rpartition(".")
        state.blocks.append((modules[parent], key, modules[block.name]))
    for parent in dict.fromkeys(block.name.rpartition(".")[0] for block in plan.blocks):
        state.parents.append((parent, modules[parent], len(modules[parent]._modules)))
    inside = {id(p) for _, _, module in state.blocks for p in module.parameters()}
    state.probes = [p for p in model.parameters() if id(p) not in inside][:16] + [
        p for _, _, module in state.blocks for p in list(module.parameters())[:1]]
    state.flagged = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    state.hooks = [{key for hooks in dicts for key in hooks} for _, dicts in _hooks(state)]
    if plan.dtypes:  # its tape recorded the step's conditions
        _check_hooks_since_profile(model, plan)
    for i, (_, _, module) in enumerate(state.blocks):
        state.handles.append(module.register_forward_pre_hook(
            functools.partial(_count_call, state, i)))


def _count_call(state: Applied, i: int, module: nn.Module, args: Any) -> None:
    if state.calls is None:
        return  # no forward with gradients running (or a recompute, in backward)
    if not any(state.calls):  # the first block of this forward
        _check_first_block(state)
    state.calls[i] += 1


def _check_first_block(state: Applied) -> None:
    """At the first block of a forward with gradients, whether ``parametrize.cached()`` is
    on, and the autocast its blocks run under (a forward may enter autocast itself:
    Accelerate's mixed precision wraps it), against what the plan's tape measured (NOTE
    [ What a plan is checked against ])."""
    plan = state.plan
    if not plan.dtypes:
        return  # made from a tape that did not record the conditions
    cached = parametrize_cached(block for _, _, block in state.blocks)
    if cached != plan.cached and "cached" not in state.warned:
        state.warned.add("cached")
        warnings.warn(
            "autoremat: this plan was profiled "
            + ("under" if plan.cached else "outside")
            + " torch.nn.utils.parametrize.cached(), and the model now runs "
            + ("under it" if cached else "outside it")
            + ": the forward holds each parametrized weight once, where a recompute makes "
            f"it again, so the memory prediction does not hold; {_REDO}",
            StepMismatchWarning, stacklevel=5)
    here = autocast_state()
    if here == plan.autocast:
        return
    if plan.head.decision is Decision.CHUNKED and here:
        raise RematError(
            f"this plan computes the loss head in chunks ({plan.head.head_key}), which cannot run "
            f"under autocast ({here}); its tape was measured without. Re-plan under the "
            "loop's autocast (the head then stays as the model computes it)")
    if "autocast" not in state.warned:
        state.warned.add("autocast")
        warnings.warn(
            "autoremat: this plan was profiled "
            + (f"under autocast {plan.autocast}" if plan.autocast else "without autocast")
            + ", and the model now runs "
            + (f"under autocast {here}" if here else "without autocast")
            + f": the step saves tensors of other dtypes (and autocast's weight casts), so "
            f"its memory prediction does not hold; {_REDO}", StepMismatchWarning,
            stacklevel=5)


_REDO = ("profile and plan the model as the loop runs it (autoremat.auto(model, inputs, "
         "budget=...) inside the loop's autocast, after any cast or change)")


def _check_pending(state: Applied) -> None:
    """At a forward with gradients: whether the last one's graph still waits for its
    backward (NOTE [ What a plan is checked against ]); never inside a compiled forward,
    where ``shape_check`` returns first."""
    last = state.pending() if state.pending is not None else None
    state.pending = None
    if last is None or last.backward_ran or "forwards" in state.warned:
        return
    state.warned.add("forwards")
    warnings.warn(
        "autoremat: the model runs a second forward with gradients before the backward of "
        "the first (two views through the model, then one loss?): both forwards' "
        "activations are held together, and the plan was measured for one forward per "
        "backward, so its memory prediction does not hold (up to twice the activations). "
        "Run the views as one batch (torch.cat) and profile that step, or plan for half "
        "the memory you have", StepMismatchWarning, stacklevel=4)


def _watch_backward(state: Applied, output: Any) -> None:
    """Mark the end of a forward with gradients: hooks on its output's graph nodes mark
    when backward reaches them (NOTE [ What a plan is checked against ])."""
    if torch.compiler.is_compiling():
        return  # not checked under torch.compile (NOTE [ What a plan is checked against ])
    nodes = {id(t.grad_fn): t.grad_fn for t in flat_tensors(output) if t.grad_fn is not None}
    if not nodes:
        return
    forward = _Forward()
    for node in nodes.values():
        node.register_prehook(functools.partial(_backward_reached, forward))
    state.pending = weakref.ref(forward)


def _hooks(state: Applied) -> list[tuple[str, tuple[Mapping[int, Any], ...]]]:
    """The forward hooks (pre and post) of each planned block, by its name, then the
    global ones (``nn.modules.module.register_module_forward_hook``) as ``"*"``, as
    :func:`~autoremat._core.conditions.user_hooks` names them."""
    from torch.nn.modules import module as torch_module
    return [(b.name, (m._forward_pre_hooks, m._forward_hooks))
            for b, (_, _, m) in zip(state.plan.blocks, state.blocks, strict=True)] + [
        ("*", (torch_module._global_forward_pre_hooks, torch_module._global_forward_hooks))]


def _check_hooks_since_profile(model: nn.Module, plan: Plan) -> None:
    """Warn where users registered forward hooks on planned blocks (or global ones) after
    the step was profiled and before apply() (NOTE [ The conditions a step is measured
    under ]: hooks)."""
    def entries(hooks: str) -> Counter[str]:
        return Counter(entry for entry in hooks.split(";") if entry)

    added = entries(user_hooks(model, [b.name for b in plan.blocks])) - entries(plan.hooks)
    if added:
        _warn_hooks(sorted({entry.partition("=")[0] for entry in added}),
                    sorted({entry.partition("=")[2] for entry in added}),
                    "after the step was profiled", stacklevel=4)


def _warn_hooks(blocks: list[str], hooks: list[str], when: str, stacklevel: int) -> None:
    """Warn that users' forward hooks ``hooks`` on ``blocks`` (``"*"``: global ones) were
    registered ``when``."""
    where = ", ".join("every module (a global hook)" if b == "*" else b for b in blocks[:3])
    warnings.warn(
        f"autoremat: forward hooks were registered on {where}"
        f"{', ...' if len(blocks) > 3 else ''} {when} ({', '.join(hooks[:3])}): what a "
        "hook keeps or makes (a block's output kept for a distillation or probing loss, an "
        "input rescaled) is held beyond the plan's prediction, which was measured without "
        "it. Register the hooks first and then plan (autoremat.auto profiles the step with "
        "them); a hook that keeps and makes nothing changes nothing", StepMismatchWarning,
        stacklevel=stacklevel + 1)


def _check_hooks(state: Applied) -> None:
    """Warn once where the user registered forward hooks on planned blocks (or global
    ones) after apply(): what a hook keeps, the plan did not measure. Each new hook is
    looked at once (its handle's id is unique in the process): a framework's is then
    known, and a forward compares handles only."""
    added = []
    for (name, dicts), known in zip(_hooks(state), state.hooks, strict=True):
        new = [(key, hook) for hooks in dicts for key, hook in hooks.items()
               if key not in known]
        if not new:
            continue
        known.update(key for key, _ in new)
        users = [found for _, hook in new if (found := hook_name(hook)) is not None]
        if users:
            added.append((name, users))
    if not added:
        return
    state.warned.add("hooks")
    _warn_hooks([name for name, _ in added], sorted({h for _, found in added for h in found}),
                "after apply()", stacklevel=6)


def _check_step(state: Applied) -> None:
    """At a forward with gradients: warn once per kind when the parameters' dtypes or the
    blocks differ from the step the plan's tape measured (NOTE [ What a plan is checked
    against ])."""
    plan = state.plan
    if not plan.dtypes:
        return  # made from a tape that did not record them
    dtypes = float_dtypes(state.probes)  # some parameters, on the hot path
    if dtypes and not set(dtypes.split(",")) <= set(plan.dtypes.split(",")) \
            and "dtypes" not in state.warned:
        state.warned.add("dtypes")
        warnings.warn(
            f"autoremat: this plan was made for parameters of {plan.dtypes}; the model's "
            f"are now {dtypes} (cast after apply?): its memory prediction does not "
            f"hold; {_REDO}", StepMismatchWarning, stacklevel=6)
    if "own checkpointing" not in state.warned and any(
            getattr(m, "gradient_checkpointing", False) is True for m in state.flagged):
        state.warned.add("own checkpointing")
        warnings.warn(
            "autoremat: the model's own (Hugging Face) gradient checkpointing was turned on "
            "after apply(): every layer is recomputed, the planned ones inside their own "
            "recompute, and the step's memory is not what the plan predicted. Use one: "
            "model.gradient_checkpointing_disable() (activation_checkpointing_disable() in "
            "Transformers 5), or autoremat.remove(model)", StepMismatchWarning, stacklevel=6)
    if plan.compiled and plan.compiled_peak_bytes is not None and not OWN_STEP.get() \
            and "eager" not in state.warned:
        state.warned.add("eager")
        warnings.warn(
            f"autoremat: this plan was chosen by measuring the model compiled whole "
            f"(torch.compile(model), {plan.compiled}), and its budget holds for that step; "
            f"this forward runs eagerly, whose step holds what compile's partitioner would "
            f"have trimmed (a held-out model: 18% over its budget). Compile the model "
            f"(autoremat.compile_model) or plan for the eager step (auto without compile=)",
            StepMismatchWarning, stacklevel=6)
    if plan.compiled and plan.compiled_peak_bytes is None and not OWN_STEP.get() \
            and "eager" not in state.warned and not any(
                getattr(m, "_compiled_call_impl", None) is not None for _, _, m in state.blocks):
        # the model's forward runs eagerly (compiled whole, this hook would not run), and
        # no block was compiled on its own (block.compile())
        state.warned.add("eager")
        warnings.warn(
            f"autoremat: this plan was made from a profile of the step with each block "
            f"compiled ({plan.compiled}), and this forward runs its blocks eagerly, whose "
            f"step holds what compile's partitioner would have trimmed (a held-out model: "
            f"1.24x its budget). Compile the blocks (block.compile() on each, or "
            f"torch.compile(model)), or profile the eager step", StepMismatchWarning,
            stacklevel=6)
    if "hooks" not in state.warned:
        _check_hooks(state)
    if "structure" not in state.warned:
        grown = [f"{name or type(parent).__name__} holds {len(parent._modules)} modules, "
                 f"not {count}" for name, parent, count in state.parents
                 if len(parent._modules) != count]
        replaced = [block.name for block, (parent, key, module) in
                    zip(plan.blocks, state.blocks, strict=True)
                    if not held_at(parent, key, module)]
        if grown or replaced:
            state.warned.add("structure")
            what = "; ".join(grown + ([f"{', '.join(replaced[:3])} replaced since apply() "
                                       "(the module there now runs kept)"] if replaced else []))
            warnings.warn(
                f"autoremat: the model's blocks changed since apply(): {what}. Its memory "
                f"prediction does not hold; {_REDO}", StepMismatchWarning, stacklevel=6)


def shape_check(state: Applied, module: nn.Module, args: Any, kwargs: Any) -> None:
    """The model's forward pre-hook (bound to ``state`` with ``functools.partial``, so
    that a copy of the model checks against the copy's state)."""
    if torch.compiler.is_compiling():
        return  # NOTE [ What a plan is checked against ]: not inside a compiled forward
    inputs, keywords = _call_inputs(args, kwargs)
    state.calls = None
    if not torch.is_grad_enabled():
        return  # evaluation: nothing is recomputed, and no prediction to hold
    _check_setting(module, inputs, state)
    _check_step(state)
    _check_pending(state)
    state.calls = [0] * len(state.blocks)
    signature = describe_inputs(inputs) if keywords is None else \
        f"{describe_inputs(args)}, {describe_inputs(keywords)}"  # the keywords named
    if _unnamed(signature) != _unnamed(state.plan.inputs) \
            and not _within(state.plan.inputs, _without_scalars(inputs)) \
            and not any(_within(told, _without_scalars(inputs)) for told in state.warned_batches):
        # (without its scalars, as batches are compared: with them, every later batch
        # was warned about, the Trainer's num_items_in_batch missing from each)
        state.warned_batches.append(describe_inputs(_without_scalars(inputs)))
        added = _added_settings(state.plan.inputs, inputs) if keywords is None else \
            _added_settings(state.plan.inputs, args[0] if len(args) == 1 else args, keywords)
        if added:
            warnings.warn(
                f"autoremat: the model now runs with {', '.join(added)}, which the step "
                f"profiled did not pass (it ran on {state.plan.inputs}). A setting can "
                f"change what the step holds (output_attentions=True holds every "
                f"attention map), and the plan's prediction is for the step without it: "
                f"profile and plan with the arguments the loop passes (autoremat.auto).",
                ShapeMismatchWarning, stacklevel=2)
            return
        grads = " (an input now requires a gradient, which the step then makes)" if \
            "requires_grad" in signature and "requires_grad" not in state.plan.inputs else ""
        warnings.warn(
            f"autoremat: this plan was made for inputs {state.plan.inputs}; the model now "
            f"runs on {signature}{grads}. Its memory prediction no longer holds: re-plan "
            f"(autoremat.auto) for these inputs.", ShapeMismatchWarning, stacklevel=2)


def _call_inputs(args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """A call's arguments as a batch is given (its keywords, its one positional argument,
    or its positional ones), and where it has both, the keywords that turn nothing off,
    which follow the positional ones in the batch (a keyword tensor added to a positional
    call grows the step as a positional one does: it went unchecked until 2026-11-29)."""
    if not args:
        return kwargs, None
    added = {k: v for k, v in kwargs.items() if v is not None and v is not False}
    if added:  # the positional ones by their position, the keywords by name
        return {**{str(i): arg for i, arg in enumerate(args)}, **added}, added
    return (args[0] if len(args) == 1 else args), None


def _added_settings(planned: str, inputs: Any,
                    keywords: dict[str, Any] | None = None) -> list[str]:
    """The keywords, neither tensors nor turned off, that ``inputs`` (or ``keywords``
    passed besides positional ``inputs``) add to a batch otherwise within the plan's
    (NOTE [ Smaller batches are within the plan ]): the step they change is one the plan
    did not measure, which may hold more or less."""
    if keywords is None and not isinstance(inputs, Mapping):
        return []
    given = inputs if keywords is None else keywords
    known = {m["name"].split(".")[0] for m in _ENTRY.finditer(planned) if m["name"]}
    added = {k: v for k, v in given.items() if k not in known
             and not isinstance(v, torch.Tensor) and v is not None and v is not False}
    rest = {k: v for k, v in given.items() if k not in added}
    if keywords is not None:
        if rest:  # a keyword tensor: not a setting
            return []
        rest = inputs
    if not added or not _within(planned, _without_scalars(rest)):
        return []
    return [f"{k}={v!r}" if isinstance(v, (bool, int, float, str)) else k for k, v in added.items()]


def _unnamed(signature: str) -> str:
    """An inputs signature less its keyword names: ``"ids: (4, 16) int64"`` and
    ``"(4, 16) int64"`` are one batch, given by keyword or by position."""
    return re.sub(r"(^|, )[\w.]+: ", r"\1", signature)


def _check_setting(module: nn.Module, inputs: Any, state: Applied) -> None:
    """Warn once per kind when the device type or the mode differs from the plan's
    (NOTE [ What a plan is checked against ])."""
    plan = state.plan
    tensors = flat_tensors(inputs) or list(module.parameters())[:1]
    here = tensors[0].device.type if tensors else None
    there = torch.device(plan.device).type if plan.device else None
    if here and there and here != there and "device" not in state.warned:
        state.warned.add("device")
        warnings.warn(f"autoremat: this plan was made for {plan.device}; the model now runs "
                      f"on {here}. Its memory prediction and costs were figured for "
                      f"{plan.device}: re-plan on this device.", PlanMismatchWarning,
                      stacklevel=3)
    if module.training and not plan.training and "mode" not in state.warned:
        state.warned.add("mode")
        warnings.warn("autoremat: this plan was profiled with the model in eval() mode and "
                      "the model now trains (train() mode: dropout and BatchNorm save more); "
                      "its memory prediction does not hold: profile and plan in train() "
                      "mode.", PlanMismatchWarning, stacklevel=3)


# NOTE [ Smaller batches are within the plan ]
#     A plan's prediction is for the batch it was profiled on; the step's memory grows
#     with each dimension of its inputs (batch, sequence, image size), so a batch no
#     larger in any of them, of the same tensors and dtypes, is within it: the last,
#     smaller batch of an epoch, or the batches of a loop that pads each to its longest
#     sequence (Hugging Face's DataCollatorWithPadding), which a plan for the longest
#     length covers. So only a batch larger in some dimension, another set of tensors,
#     or another dtype is warned about; a keyword that turns something off (``False``,
#     ``None``: ``use_cache=False``) adds nothing to hold and is no reason either. A
#     keyword that is no tensor and that the profile did not pass (``depth=3``,
#     ``output_attentions=True``) makes a step the plan did not measure, which may hold
#     more or less: the warning names that keyword, not the shapes (``_added_settings``).
#     A batch within one already warned about is not warned about again: a loop padding
#     to each batch's longest sequence, profiled on a short one, is told at each new
#     longest length, not at every length it runs (``Applied.warned_batches``).
_ENTRY = re.compile(r"(?:(?P<name>[\w.]+): )?(?:\((?P<shape>[0-9, ]*)\) (?P<dtype>\w+)"
                    r"(?P<grad> requires_grad)?|(?P<type>\w+))(?:, |$)")


def _within(planned: str, inputs: Any) -> bool:
    """Whether ``inputs`` are within the batch the plan's signature ``planned``
    describes (NOTE [ Smaller batches are within the plan ]); matched by keyword where
    both name theirs, else by position."""
    entries = []
    for m in _ENTRY.finditer(planned):
        shape = None if m["shape"] is None else \
            tuple(int(d) for d in m["shape"].replace(",", " ").split())
        entries.append((m["name"], shape, m["dtype"] or m["type"], bool(m["grad"])))
    items = [(k, v) for k, v in input_entries(inputs)
             if not (v is None or v is False)]  # turns off
    names = [name for name, _, _, _ in entries]
    if all(names) and all(k is not None for k, _ in items):
        by_name = dict(zip(names, entries, strict=True))
        pairs = [(by_name.get(k), v) for k, v in items]
        missing = set(names) - {k for k, _ in items}
        if any(by_name[n][1] is not None for n in missing):  # a tensor it had is gone
            return False
    elif len(items) != len(entries):
        return False
    else:
        pairs = list(zip(entries, (v for _, v in items), strict=True))
    for entry, value in pairs:
        if entry is None:
            return False  # a tensor or a setting the plan did not have
        _, shape, kind, grad = entry
        if not isinstance(value, torch.Tensor):
            if shape is not None or kind != type(value).__name__:
                return False
            continue
        if shape is None or kind != str(value.dtype).removeprefix("torch.") \
                or (value.requires_grad and not grad) \
                or len(shape) != value.dim() \
                or any(n > p for n, p in zip(value.shape, shape, strict=True)):
            return False
    return True


def _without_scalars(inputs: Any) -> Any:
    """Keyword inputs less 0-d tensors: a scalar that a training loop adds to the call
    (the Hugging Face Trainer's ``num_items_in_batch``) changes no shape the plan's
    memory depends on, so it is no reason to warn."""
    if not isinstance(inputs, dict):
        return inputs
    return {k: v for k, v in inputs.items() if not (isinstance(v, torch.Tensor) and v.dim() == 0)}


def close_segments(state: Applied, module: nn.Module, args: Any, output: Any) -> None:
    waiting = [(runner, runner.waiting_for()) for runner in state.runners]
    unfinished = [(runner, name) for runner, name in waiting if name is not None]
    for runner in state.runners:
        runner.abort()  # no-op after a normal forward; closes frames after an error
    calls, state.calls = state.calls, None
    if unfinished and sys.exc_info()[0] is None:  # the forward ended, not raised
        runner, name = unfinished[0]
        skipped = [] if calls is None else [
            block.name for block, n in zip(state.plan.blocks, calls, strict=True) if n == 0]
        raise PlanMismatchError(
            f"segment {runner.names[0]}..{runner.names[-1]} began in this forward, but "
            f"its block {name!r} did not run"
            + (f" ({len(skipped)} of the plan's {len(calls or [])} blocks did not: "
               f"{', '.join(skipped[:3])}{', ...' if len(skipped) > 3 else ''})"
               if skipped else "")
            + f"; the plan was profiled on a step that runs every block once (an argument "
            f"that changes which blocks run?). {SEGMENT_ADVICE}")
    if calls is not None:  # a forward with gradients
        _watch_backward(state, output)
        # the casts only checkpointed blocks used, which a loop running its loss and
        # backward inside the region kept through the loss's backward (NOTE [ Backward
        # inside autocast ] in _mechanism/wrap.py)
        drop_forward_casts()
    again = [] if calls is None else [
        (block.name, n) for block, n in zip(state.plan.blocks, calls, strict=True) if n > 1]
    if again and "calls" not in state.warned:
        state.warned.add("calls")
        warnings.warn(
            f"autoremat: block {again[0][0]!r} ran {again[0][1]} times in one forward"
            + (f" (and {len(again) - 1} more blocks)" if len(again) > 1 else "")
            + "; its plan was profiled with each block running once (every run saves, or "
            "recomputes, its tensors again), so its memory prediction does not hold. "
            "Profile the step as the loop runs it, with the same arguments (a block that "
            "runs more than once per step in the profiled step is planned call by call)",
            StepMismatchWarning, stacklevel=5)
    beyond = [] if calls is None else calls_beyond(module)
    if beyond and "calls beyond" not in state.warned:
        state.warned.add("calls beyond")
        layer, ran, planned = beyond[0]
        warnings.warn(
            f"autoremat: {layer!r} ran {ran} times in this forward, and the plan was "
            f"profiled on a step that ran it {planned} times: its calls after the "
            f"{planned}th ran kept, outside the plan (a deeper loop than profiled?), so its "
            f"memory prediction does not hold. Profile the step as the loop runs it",
            StepMismatchWarning, stacklevel=5)

