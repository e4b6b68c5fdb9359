"""The mechanism under ``apply``: checkpoint one module's forward in place.

NOTE [ Patching forward instead of wrapping the module ]
    Replacing ``blocks[3]`` with a wrapper module would rename every parameter
    (``blocks.3.inner.weight``) and break the user's state dicts, optimizers and hooks.
    We set an instance attribute ``forward`` instead: ``nn.Module.__call__`` still runs
    the module's hooks and then our forward, which runs the original one under
    ``torch.utils.checkpoint`` (non-reentrant: kwargs, non-tensor args and frozen inputs
    all work, RNG state is restored on recompute). ``unwrap`` deletes the attribute, so
    the module is exactly as before.

NOTE [ BatchNorm under recompute ]
    Recomputing a BatchNorm in training mode would update its running statistics a
    second time. Recompute saves the block's BatchNorm statistics (a few KiB) and puts
    them back when it ends. (Setting ``track_running_stats = False`` instead looks
    simpler, but the layer then saves a different number of tensors and checkpoint's
    recompute check fails.) Other buffers a forward changes are put back the same way,
    with a warning (NOTE [ What a recompute cannot see ]).

NOTE [ Copying and pickling an applied model ]
    ``copy.deepcopy(model)`` of an applied model (how EMA and teacher copies are made)
    must give a model whose wrapped blocks run the *copy's* modules, and
    ``torch.save(model)`` must pickle. ``deepcopy`` copies functions as they are, so a
    closure installed as a forward, hook or ``context_fn`` kept calling the original's
    blocks (the copy's parameters got no gradients, the original's did), and ``pickle``
    cannot store a closure at all. So everything ``apply`` installs is an object of a
    module-level class (``_Checkpointed``, ``RegionContexts``, ``_OffloadedForward``,
    ``SegmentRunner`` with its hooks as ``functools.partial`` of its methods, the
    model's hooks as ``partial`` objects over the applied state) that refers to the modules it
    runs: ``deepcopy`` copies those references along with the model (its memo maps
    each module to its copy), and ``pickle`` stores them. The original forward is
    ``_Original(module)``, not a bound method taken when wrapping. What one step leaves
    behind (an open segment frame, the last offloaded group) is not copied. The copy
    carries the plan (``applied_plan``) and ``remove`` undoes it on the copy alone.
"""

from __future__ import annotations

import random
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import checkpoint as _cp
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from autoremat._core import rng
from autoremat._core.decisions import Decision
from autoremat._core.errors import RematError, internal_assert
from autoremat._core.step import flat_tensors, scalar_attributes
from autoremat._mechanism.compiled import is_compiling, refuse_under_compile

__all__ = ["RegionContexts", "StatefulBlockWarning", "as_called", "checkpointed",
           "install_forward", "is_wrapped", "refuse_changed_input", "refuse_kv_cache",
           "refuse_under_func_transforms", "snapshot_arguments", "stashed_buffers", "unwrap",
           "watch_buffers", "wrap"]

_MARK = "_autoremat_wrap"

ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]
PolicyFactory = Callable[[], ContextFn | None]


@dataclass(frozen=True)
class _WrapState:
    user_forward: Any  # an instance-level forward that was there before us, or None
    tag: Decision  # what the wrapper does: recompute, selective, offload, offload_input


def _tracking_batchnorms(modules: list[nn.Module]) -> list[_BatchNorm]:
    return [m for module in modules for m in module.modules()
            if isinstance(m, _BatchNorm) and m.track_running_stats]


def _statistics(layer: _BatchNorm) -> list[torch.Tensor]:
    return [buf for buf in (layer.running_mean, layer.running_var, layer.num_batches_tracked)
            if buf is not None]


def stashed_buffers(modules: list[nn.Module]) -> list[torch.Tensor]:
    """The buffers a recompute of ``modules`` copies aside and puts back (NOTE
    [ BatchNorm under recompute ]): BatchNorm's statistics, and the buffers their forward
    is known to change (NOTE [ Buffers a forward changes ]); the profile counts their
    copies."""
    changed = [buf for _, m, name in _Layout.of(modules).buffers
               if name in _CHANGED.get(m, ()) and (buf := m._buffers[name]) is not None]
    return [buf for layer in _tracking_batchnorms(modules) for buf in _statistics(layer)] \
        + changed


class StatefulBlockWarning(UserWarning):
    """A checkpointed block changed one of its buffers (other than BatchNorm's running
    statistics) in forward: its recompute in backward runs that forward again (NOTE
    [ What a recompute cannot see ])."""


def _write_unversioned(buf: torch.Tensor, value: torch.Tensor) -> None:
    """``buf.copy_(value)`` without moving ``buf``'s version counter. A recompute puts a
    buffer as its forward found it and back as the forward left it, all in backward: a
    module that runs at two positions of a step (a block listed twice) saved the buffer
    for the backward of its other call, kept, and a moved version made autograd refuse
    that backward ("modified by an inplace operation"), where the plain step, whose
    BatchNorm updates its statistics without moving their versions, runs. The value the
    other call finds is the one it would in the plain step: what the forward left."""
    buf.data.copy_(value)


class _RestoredBuffers:
    """Puts ``buffers`` back as they were when entered. Re-entrant: each ``with`` copies
    them afresh (NOTE [ Contexts a backward may enter again ])."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self.saved: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def __enter__(self) -> None:
        self.saved.append([(buf, buf.detach().clone()) for buf in self.buffers])

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for buf, value in self.saved.pop():
                _write_unversioned(buf, value)


# NOTE [ Contexts a backward may enter again ]
#     ``checkpoint`` calls its ``context_fn`` once per forward and enters the recompute
#     context each time a backward needs the region's tensors: once per backward that
#     reaches it (``retain_graph=True`` then a second backward, two losses off one
#     forward) and again under ``create_graph=True`` (a gradient penalty). A
#     ``@contextmanager`` object can be entered once only (the second ``with`` fails
#     with "'_GeneratorContextManager' object has no attribute 'args'"), so every
#     context a region hands to checkpoint is an object whose ``__enter__`` starts
#     afresh: the RNG states are replayed from the forward's snapshot again, BatchNorm
#     statistics copied aside again, the selective mode's counters reset.
#
# NOTE [ What a recompute cannot see ]
#     A recompute runs the region's forward again on the same inputs, with the same
#     torch RNG states, and must dispatch the same ops: checkpoint matches the tensors
#     it saves one to one. What else a forward depends on is checked where it shows:
#     * Python's ``random`` (stochastic depth drawn with ``random.random()``): not
#       replayed, so a recompute takes another branch or scale (silently wrong
#       gradients where the shapes agree). Its state is compared before and after the
#       region's forwards until one in training mode has been checked (a comparison
#       costs ~50 us), and a region that drew from it is refused there.
#     * An in-place change of the region's input (``x.mul_(2)`` on the argument):
#       checkpoint keeps the input for the recompute, which would then see the changed
#       value; refused when the forward returns (the version counters moved).
#     * Control flow on anything but the inputs (an early exit on a call counter or a
#       schedule): the recompute saves fewer tensors than the forward did, which is
#       seen when it ends (with early stop, a recompute that matches the forward is
#       always stopped by checkpoint at its last saved tensor), or more, which
#       checkpoint raises inside it; either is re-raised naming the region.
#     * A ``torch.Generator`` a module holds as an attribute (when the region first
#       runs) is replayed like the default ones; one held elsewhere is not seen.
#     * A buffer other than BatchNorm's statistics changed in forward (a spectral norm's
#       power iteration, a counter, an EMA): the recompute must read it as the forward
#       found it, and the buffer must end as the forward left it (updated once, as in
#       the plain step). NOTE [ Buffers a forward changes ].
#     * What a recompute saves with other shapes than the forward (a slice whose length
#       comes from a counter): checkpoint compares what it saved with what the recompute
#       made after the recompute ends, outside every context of ours, and raises its
#       own CheckpointError, which names no block. Its frame's check is wrapped, on that
#       frame only, to raise a RematError naming the region (_NamedCheck); a torch
#       whose frame is not found where this looks keeps its own error.


class _NamedCheck:
    """A checkpoint frame's ``check_recomputed_tensors_match``, which raises a
    :class:`RematError` naming the region instead of checkpoint's own error (NOTE
    [ What a recompute cannot see ]). It holds the frame weakly: the frame holds it."""

    def __init__(self, frame: Any, label: str) -> None:
        self.frame = weakref.ref(frame)
        self.label = label

    def __call__(self, gid: Any) -> None:
        frame = self.frame()
        if frame is None:
            return
        try:
            type(frame).check_recomputed_tensors_match(frame, gid)
        except _cp.CheckpointError as exc:
            detail = " ".join(str(exc).split("\n")[1:4])
            raise RematError(
                f"block {self.label} saved tensors of other shapes, dtypes or number when "
                f"it was recomputed in backward than in its forward ({detail.strip()}): a "
                "recompute must run the same ops on tensors of the same shapes. Its forward "
                "depends on something besides its inputs and torch's RNG: a length, index "
                "or flag from a counter or schedule that changed since the forward, "
                "Python's or numpy's random (not replayed: draw from torch). Keep this "
                "block (leave it out of blocks= when profiling) or make its forward a "
                "function of its inputs") from exc


def _name_the_check(label: str) -> None:
    """Wrap the check of the checkpoint frame now recording (found through the saved-
    tensor hooks it installed) in a :class:`_NamedCheck`; nothing if not found."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    frame_type = getattr(_cp, "_CheckpointFrame", None)
    if not hooks or frame_type is None:
        return
    for cell in getattr(hooks[1], "__closure__", None) or ():
        try:
            frame = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(frame, frame_type):
            if "check_recomputed_tensors_match" not in vars(frame):
                frame.check_recomputed_tensors_match = _NamedCheck(frame, label)
            return


def _changed_inputs(tensors: list[torch.Tensor], versions: list[int]) -> list[int]:
    return [i for i, (t, v) in enumerate(zip(tensors, versions, strict=True)) if t._version != v]


def refuse_changed_input(label: str, tensors: list[torch.Tensor], versions: list[int]) -> None:
    """Raise a :class:`RematError` if ``label``'s forward changed one of its input
    ``tensors`` in place (their ``_version`` moved from ``versions``)."""
    changed = _changed_inputs(tensors, versions)
    if changed:
        t = tensors[changed[0]]
        raise RematError(
            f"block {label} changed its input in place (tensor argument {changed[0]}, "
            f"shape {tuple(t.shape)}): a checkpoint keeps the input for the recompute in "
            "backward, which would see the changed value. Keep this block (leave it out of "
            "blocks= when profiling) or make the change out of place (x = x * 2 rather "
            "than x.mul_(2))")


def _kv_cache(obj: Any) -> bool:
    """Whether ``obj`` is a Hugging Face KV cache (a subclass of Transformers' ``Cache``),
    told by its class's bases so that Transformers need not be imported."""
    return not isinstance(obj, torch.Tensor) and any(
        c.__name__ == "Cache" and c.__module__.startswith("transformers")
        for c in type(obj).__mro__)


def refuse_kv_cache(label: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise a :class:`RematError` if a checkpointed block is called with a Hugging Face
    KV cache in training (NOTE [ A block passed a KV cache ])."""
    found = [(f"argument {i}", a) for i, a in enumerate(args) if _kv_cache(a)] + \
        [(f"argument {k}=", v) for k, v in kwargs.items() if _kv_cache(v)]
    if found:
        where, cache = found[0]
        raise RematError(
            f"block {label} is recomputed in backward and was called with a KV cache "
            f"({where}, of type {type(cache).__name__}) in a training forward: its forward appends "
            "its keys to the cache, and a recompute would append them a second time. Drop "
            "use_cache and any cache from the training inputs (use_cache=False); if the "
            "model builds the cache itself even then (Transformers' XLM and FlauBERT do), "
            "profile with blocks= naming modules that are not passed it (XLM's "
            "transformer.ffns.N), or keep this block")


# NOTE [ A block passed a KV cache ]
#     Hugging Face layers append their keys and values to a cache object passed to them.
#     With use_cache off (autoremat turns it off while training) layers are passed
#     ``None``; a cache reaches a block only when the inputs bring one (a prefix of
#     past_key_values) or the model builds it regardless (XLM builds an
#     EncoderDecoderCache in every forward). A recompute then appends a second time, and
#     fails in backward on shapes that no longer match ("the expanded size of the tensor
#     (128) must match the existing size (64)") or reads the keys the forward cached. It
#     is refused in the forward instead, naming the block and the argument.


def refuse_under_func_transforms(label: str) -> None:
    """Raise a :class:`RematError` under ``torch.func.grad`` (and ``vjp``, ``jacrev``,
    ``hessian``), which cannot run saved-tensor hooks, on which every checkpoint and
    offload rests."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return
    from_grad = [i for i in torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters()
                 if i.key() == torch._C._functorch.TransformType.Grad]
    if from_grad:
        raise RematError(
            f"block {label} is checkpointed by autoremat and runs under torch.func.grad "
            "(or vjp, jacrev, hessian), which does not support the saved-tensor hooks "
            "checkpoints and offload rest on. Call autoremat.remove(model) before the "
            "transform, or take gradients with loss.backward() / torch.autograd.grad")


@dataclass(frozen=True)
class _Layout:
    """Where a region's state lives, found once per region (walking the modules on every
    forward cost ~0.3 ms a block): slots, not tensors, since ``model.to(...)`` puts new
    buffer tensors in the same slots."""

    statistics: list[tuple[nn.Module, str]]  # BatchNorm statistics: (layer, buffer name)
    buffers: list[tuple[str, nn.Module, str]]  # other buffers: (qualified name, module, name)
    generators: list[tuple[nn.Module, str]]  # torch.Generator attributes: (module, name)
    submodules: list[tuple[str, nn.Module]]  # every module, by its qualified name
    parameters: list[tuple[str, nn.Module, str]]  # (qualified name, module, name)

    @staticmethod
    def of(modules: list[nn.Module]) -> _Layout:
        layers = {id(m) for m in _tracking_batchnorms(modules)}
        statistics: list[tuple[nn.Module, str]] = []
        buffers: list[tuple[str, nn.Module, str]] = []
        submodules: list[tuple[str, nn.Module]] = []
        parameters: list[tuple[str, nn.Module, str]] = []
        for module in modules:
            for prefix, m in module.named_modules():
                submodules.append((prefix, m))
                parameters += [(f"{prefix}.{name}" if prefix else name, m, name)
                               for name in m._parameters]
                for name in m._buffers:
                    if id(m) in layers and name in _STATISTICS:
                        statistics.append((m, name))
                    else:
                        buffers.append((f"{prefix}.{name}" if prefix else name, m, name))
        return _Layout(statistics, buffers, rng.generator_slots(modules), submodules,
                       parameters)

    def stashed(self) -> list[torch.Tensor]:
        return [buf for m, name in self.statistics if (buf := m._buffers[name]) is not None]

    def plain(self) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
        return [(q, m, name, buf) for q, m, name in self.buffers
                if (buf := m._buffers[name]) is not None]

    def weights(self) -> list[torch.Tensor | None]:
        """What each parameter slot holds now (``torch.func.functional_call`` puts other
        tensors in them for a call)."""
        return [m._parameters[name] for _, m, name in self.parameters]

    def gens(self) -> list[torch.Generator]:
        return [getattr(m, name) for m, name in self.generators]

    def scalars(self) -> list[tuple[str, nn.Module, str, Any]]:
        """The modules' Python number and string attributes, as (qualified name, module,
        name, value) (NOTE [ Buffers a forward changes ])."""
        return [(f"{prefix}.{name}" if prefix else name, m, name, value)
                for prefix, m in self.submodules for name, value in scalar_attributes(m)]


_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


# NOTE [ Buffers a forward changes ]
#     A spectral norm updates its vectors ``u`` and ``v`` in place in forward and then
#     computes the weight from them; a recompute that reads them as the forward left them
#     computes another weight, and the gradients differ from the plain model's (2e-3 on
#     four spectral-normed linear blocks). So a region's forward copies aside the buffers
#     known to change before it runs, and its recompute puts those values in first (the
#     buffers are then put back as the forward left them, so that they are updated once).
#     Which buffers change is seen by comparing their version counters around a forward:
#     the profile's first step does it for every block (``watch_buffers``), and a
#     region's own forward for its modules; either notes the buffer's slot (module and
#     name) here, for the process's life, and in the region (``RegionContexts.changing``),
#     which a copy of the applied model carries to its own modules. A region whose
#     forward changes a buffer not noted before (a plan applied to a model no profile of
#     this process ran) has no copy for that step: warned once (StatefulBlockWarning),
#     exact from its next forward.
#     The copies live from the forward to the recompute, and the profile's memory steps
#     (after its first step) measure them.
#     A module's Python number or string attribute changed in forward (a temperature
#     annealed, a call counter) is the same case without a version counter: compared by
#     value around the profile's first step and a region's first training forward (a
#     walk of the region's modules, once), noted alike, set to the value the forward found
#     before the recompute and back to the one it left after. So is a buffer the forward
#     gives another tensor (I-BERT's activation quantizers keep a moving average of their
#     range as ``self.x_min = self.x_min * momentum + ...``): its old tensor keeps its
#     version, and its slot is what changed, seen by identity at every forward. The
#     recompute runs with the tensor the forward found in the slot (its buffers were 2
#     updates ahead of the plain model's).
_CHANGED: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()
_CHANGED_ATTRS: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


class _Before:
    """A region's buffers (their version counters) and, with ``attributes``, its
    modules' Python number and string attributes, as a forward finds them; after it,
    which of them it changed (NOTE [ Buffers a forward changes ])."""

    def __init__(self, layout: _Layout, *, attributes: bool) -> None:
        self.buffers = layout.plain()
        self.versions = [buf._version for *_, buf in self.buffers]
        self.scalars = layout.scalars() if attributes else None

    def changed_buffers(self) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
        return [(q, m, name, buf) for (q, m, name, buf), v in
                zip(self.buffers, self.versions, strict=True) if buf._version != v]

    def changed_attributes(self) -> list[tuple[str, nn.Module, str]]:
        """The attributes changed by value (none without ``attributes``), and the buffers
        given another tensor (``self.x_min = ...``: its slot changed, not its tensor)."""
        return [(q, m, name) for q, m, name, value in self.scalars or ()
                if (now := vars(m).get(name, value)) is not value and now != value] + \
            [(q, m, name) for q, m, name, buf in self.buffers if m._buffers.get(name) is not buf]


def watch_buffers(module: nn.Module) -> Callable[[], None]:
    """Before a forward of ``module``: returns what to call after it, which notes the
    buffers and attributes it changed (NOTE [ Buffers a forward changes ]), by version
    and by value: an op may write a buffer without moving its version (torch.ao's fused
    fake-quantize updates its observer's range so; its recompute updated it twice, and
    the gradients of a QAT model drifted from the plain one's, silently)."""
    before = _Before(_Layout.of([module]), attributes=True)
    values = [None if buf.device.type == "meta" else buf.detach().clone()
              for *_, buf in before.buffers]  # (meta: no values to compare)

    def after() -> None:
        for _, m, name, _ in before.changed_buffers():
            _CHANGED.setdefault(m, set()).add(name)
        for (_, m, name, buf), value in zip(before.buffers, values, strict=True):
            if value is not None and (buf.shape != value.shape or not torch.equal(buf, value)):
                _CHANGED.setdefault(m, set()).add(name)
        for _, m, name in before.changed_attributes():
            _CHANGED_ATTRS.setdefault(m, set()).add(name)

    return after


class _ForwardContext:
    """A region's forward: notes the RNG states (NOTE [ Replaying the forward's RNG ]),
    the region's buffers and, until a training forward was checked, Python's ``random``
    state (NOTE [ What a recompute cannot see ]), and runs ``inner`` (the selective
    mode, or nothing)."""

    def __init__(self, region: RegionContexts, inner: AbstractContextManager[Any]) -> None:
        self.region = region
        self.layout = region.layout()
        self.inner = inner
        self.start: rng.RngSnapshot | None = None
        self.changed: list[torch.Tensor] = []  # buffers the forward changed
        self.found: list[tuple[torch.Tensor, torch.Tensor]] = []  # buffers, values before
        self.found_attrs: list[tuple[nn.Module, str, Any]] = []  # attributes, values before
        self.changed_attrs: list[tuple[nn.Module, str]] = []  # attributes the forward changed
        self.python: Any = None

    def __enter__(self) -> None:
        gens = rng.generators()
        for gen in self.layout.gens():  # (a generator the blocks share: once)
            if all(gen is not known for known in gens):
                gens.append(gen)
        self.start = rng.snapshot(gens)
        self.early_stop = _early_stop()  # as checkpoint's frame reads it, in forward
        if "python random" not in self.region.seen:
            self.python = random.getstate()
        # attributes compared until a training forward was
        self.before = _Before(self.layout, attributes="attributes" not in self.region.seen)
        # NOTE [ Buffers a forward changes ]: as this forward finds them, for its recompute
        self.found = [(buf, buf.detach().clone()) for _, m, name, buf in self.before.buffers
                      if self.region.changes(m, name)]
        self.found_attrs = [(m, name, _slot(m, name)) for m, name, attribute
                            in self.region.changing if attribute and _has_slot(m, name)]
        self.modules_as_found = _AsFound(self.layout)  # NOTE [ The modules as the forward
        # found them ]
        _name_the_check(self.region.label)
        self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        suppress = self.inner.__exit__(*exc)
        if exc[0] is None:
            self.modules_as_found.forward_ended()
            self._check()
        return suppress

    def _check(self) -> None:
        region = self.region
        label = region.label
        if self.python is not None:
            if random.getstate() != self.python:
                raise RematError(
                    f"block {label} draws from Python's random module in forward (stochastic "
                    "depth with random.random()?): a recompute in backward draws again and "
                    "can take another branch or scale, and Python's random is not replayed. "
                    "Draw from torch instead "
                    "(torch.rand(()) is replayed exactly), or keep this block (leave it out "
                    "of blocks= when profiling)")
            if region.modules[0].training:  # checked once in training: a cost per call of
                region.seen.add("python random")  # ~50 us otherwise
        changed = self.before.changed_buffers()
        self.changed = [buf for *_, buf in changed]
        copied = {id(buf) for buf, _ in self.found}
        unseen = [q for q, _, _, buf in changed if id(buf) not in copied]
        for _, m, name, _ in changed:  # NOTE [ Buffers a forward changes ]
            region.note(m, name)
        changed_attrs = self.before.changed_attributes()
        self.changed_attrs = [(m, name) for _, m, name in changed_attrs]
        known = {(id(m), name) for m, name, _ in self.found_attrs}
        unseen += [q for q, m, name in changed_attrs if (id(m), name) not in known]
        for _, m, name in changed_attrs:
            region.note(m, name, attribute=True)
        if self.before.scalars is not None and region.modules[0].training:
            region.seen.add("attributes")
        if unseen and "buffers" not in region.seen:
            region.seen.add("buffers")
            warnings.warn(
                f"autoremat: block {label} changes its buffer(s) or attribute(s) "
                f"{', '.join(sorted(set(unseen))[:3])} in forward, which no profile in this "
                "process had seen. autoremat puts them back after each recompute (so they "
                "are updated once, as BatchNorm's statistics), and from the next forward on "
                "copies them before it, so that the recompute reads them as the forward "
                "found them; this step's recompute reads them as the forward left them: if "
                "the forward reads a buffer after changing it, this step's gradients differ "
                "from the plain model's. Profile the model in this process before applying "
                "a plan (autoremat.auto), keep this block (leave it out of blocks= when "
                "profiling), or update the buffer outside it", StatefulBlockWarning,
                stacklevel=2)


def _has_slot(m: nn.Module, name: str) -> bool:
    return name in m._buffers or name in vars(m)


def _slot(m: nn.Module, name: str) -> Any:
    """What attribute ``name`` of ``m`` holds: a buffer, or a plain attribute (None when
    it has neither)."""
    return m._buffers[name] if name in m._buffers else vars(m).get(name)


def _put_attributes(values: list[tuple[nn.Module, str, Any]]) -> None:
    for m, name, value in values:
        if name in m._buffers:
            m._buffers[name] = value
        else:
            vars(m)[name] = value


# NOTE [ The modules as the forward found them ]
#     A recompute runs the region's modules again in backward; what they hold may have
#     changed since their forward. ``torch.func.functional_call`` puts other tensors in
#     their parameter slots for the call only (a hypernetwork's weights, MAML's fast
#     weights, perturbed or averaged ones): the recompute read the module's own, and the
#     gradients of the tensors passed were wrong with no warning (3.2 where the largest
#     was 4.4, on a plan recomputing three of four blocks). A schedule that sets an
#     attribute between a forward and its backward (``dropout.p``, a temperature), or
#     ``model.eval()`` there, changed the recompute alike. So a forward notes what each
#     parameter slot holds, each parameter's version, and each module's attributes
#     (``_AsFound``; a dict copy per module); its recompute puts back the tensors and
#     values that differ (a number or a string by value, any other object by identity:
#     a state a forward consumes, as block-recurrent-transformer-pytorch's state container
#     reads and clears ``self.next_read_state``, whose recompute raised before,
#     2026-12-02; not nn.Module's own dicts), for the recompute only, and after it every
#     attribute as it was before it: an MoE layer that keeps its auxiliary loss on itself
#     (``self.aux_loss = ...``, as fairseq's and DeepSpeed's do) got the recompute's, and
#     its graph held the recompute's tensors until the next forward (a segment of blocks
#     measured 16% over its budget; a single block stops its recompute before that
#     line, at the last tensor backward needs). A parameter changed in place since the
#     forward ended (not by the forward itself: ``nn.Embedding(max_norm=...)`` renormalizes
#     its rows, and its recompute does again, exact as before) (an optimizer step between
#     a forward and its backward: a GAN stepping
#     its discriminator before the generator's backward through it) is refused naming it:
#     plain PyTorch raises for a weight it saved ("modified by an inplace operation"), and
#     a recompute would compute with the new values. Found by held-out training loops on
#     2026-11-29 (seventeenth session). FSDP2 gathers its parameters into the same tensors
#     and keeps their versions, so nothing is put back or refused under it.


# NOTE [ Backward inside autocast ]
#     Autocast keeps the low-precision copies of the weights it casts in a cache until
#     the outermost autocast region exits. PyTorch advises running backward outside the
#     region, and the profile measures that loop; a loop that calls ``loss.backward()``
#     inside it keeps the forward's copies through the backward. A recompute then found
#     them cached and ran no cast where its forward had: a selective block was refused
#     ("ran aten.view as op 2 ... where its forward ran aten._to_copy"), and plans held
#     the copies of every block through the backward (a 'full' plan 27% over its
#     prediction on a held-out MLP). So the cache is cleared when backward reaches a
#     planned model's output (``_backward_reached`` in ``_guards.py``, as leaving the
#     region would), and around each recompute, which casts as its forward did: the step
#     is the profiled one, exact (a cleared cache only makes a later forward in the same
#     region cast again). Found 2026-11-29 (seventeenth session). And when a planned
#     model's forward with gradients returns (``close_segments``): a loss taken after the
#     forward runs its backward before backward reaches the model's output, and the copies
#     only checkpointed blocks used (autograd saved none of them) were held through it: an
#     LM whose head's backward peaks measured 4-15% over its prediction, the more the more
#     blocks it recomputed (a held-out check, 2026-11-30). A measured step empties it
#     there too (``Step.run``), so both loops measure the profiled step.


# what every nn.Module holds as attributes (its parameters', buffers', submodules' and
# hooks' dicts, ``training``): not the attributes a forward reads as it found them
_MODULE_STATE = frozenset(vars(nn.Module()))


class _AsFound:
    """A region's parameter slots (the tensors in them and their versions) and its
    modules' attributes, as a forward found them (NOTE [ The modules as the forward found
    them ])."""

    def __init__(self, layout: _Layout) -> None:
        self.weights = layout.weights()
        self.versions: list[int] = []  # as the forward left them (forward_ended)
        self.attributes = [dict(vars(m)) for _, m in layout.submodules]

    def forward_ended(self) -> None:
        """Note the parameters' versions as the forward leaves them: it may change a
        parameter itself (``nn.Embedding(max_norm=...)`` renormalizes its rows, a layer
        clamps its weight), which its recompute does again."""
        self.versions = [-1 if w is None else w._version for w in self.weights]

    def put(self, layout: _Layout, label: str, stack: ExitStack) -> None:
        """Put them back for a recompute, refusing a parameter changed in place since;
        ``stack`` puts back what is there now when the recompute ends."""
        versions = self.versions or [-1] * len(self.weights)
        for (q, m, name), weight, version in zip(layout.parameters, self.weights,
                                                 versions, strict=True):
            if weight is None:
                continue
            if version >= 0 and weight._version != version:
                raise RematError(
                    f"block {label}: its parameter {q!r} was changed in place after its "
                    f"forward and before its recompute in backward (version {version} -> "
                    f"{weight._version}): an optimizer step or a weight update between a "
                    "forward and its backward? The recompute would compute with the new "
                    "values, where plain PyTorch raises for a weight it saved ('modified by "
                    "an inplace operation'). Call backward before changing the parameters, "
                    "or keep this block (leave it out of blocks= when profiling)")
            now = m._parameters.get(name)
            if now is not weight:
                m._parameters[name] = weight  # type: ignore[assignment]
                stack.callback(m._parameters.__setitem__, name, now)
        for (_, m), found in zip(layout.submodules, self.attributes, strict=True):
            here = vars(m)
            stack.callback(_put_back, here, dict(here))  # what the recompute sets, too
            for name, value in found.items():
                if (now := here.get(name, value)) is value:
                    continue
                if type(value) in (bool, int, float, str):
                    if now != value:
                        here[name] = value
                elif name not in _MODULE_STATE:  # any other object, by identity
                    here[name] = value


def _put_back(here: dict[str, Any], then: dict[str, Any]) -> None:
    """Put a module's attributes back as ``then`` (NOTE [ The modules as the forward found
    them ]): what a recompute assigned (an MoE layer's ``self.aux_loss``, whose graph
    held the recompute's tensors until the next forward) goes."""
    for name in [name for name in here if name not in then]:
        del here[name]
    for name, value in then.items():
        if here.get(name, value) is not value or name not in here:
            here[name] = value


class _RecomputeContext:
    """A region's recompute, re-entrant (NOTE [ Contexts a backward may enter again ]):
    replays the forward's RNG states, puts BatchNorm statistics and the buffers the
    forward changed back, runs ``inner``; a recompute that ran other ops than the
    forward is refused naming the region (NOTE [ What a recompute cannot see ])."""

    def __init__(self, forward: _ForwardContext, inner: AbstractContextManager[Any]) -> None:
        self.forward = forward
        self.inner = inner
        self.stacks: list[ExitStack] = []

    def __enter__(self) -> None:
        forward = self.forward
        start = forward.start
        internal_assert(start is not None, "a checkpointed region is recomputed before its "
                                           "forward ran")
        assert start is not None  # (for the type checker)
        with ExitStack() as stack:
            changed = {id(buf): buf for buf in forward.changed} | \
                {id(buf): buf for buf, _ in forward.found}
            stack.enter_context(_RestoredBuffers([*forward.layout.stashed(), *changed.values()]))
            with torch.no_grad():  # as the forward found them (NOTE [ Buffers a forward ...])
                for buf, value in forward.found:
                    _write_unversioned(buf, value)
            slots = {(id(m), name): (m, name) for m, name, _ in forward.found_attrs} | \
                {(id(m), name): (m, name) for m, name in forward.changed_attrs}
            stack.callback(_put_attributes, [(m, name, _slot(m, name))
                                             for m, name in slots.values()])
            _put_attributes(forward.found_attrs)
            forward.modules_as_found.put(forward.layout, forward.region.label, stack)
            torch.clear_autocast_cache()  # NOTE [ Backward inside autocast ]
            stack.callback(torch.clear_autocast_cache)
            stack.enter_context(rng.replaying(start))
            stack.enter_context(self.inner)
            self.stacks.append(stack.pop_all())

    def __exit__(self, *exc: Any) -> Any:
        suppress = self.stacks.pop().__exit__(*exc)
        if exc[1] is not None and not isinstance(exc[1], _cp._StopRecomputationError) \
                and _stop_inside(exc[1]):
            raise _cp._StopRecomputationError  # NOTE [ An early stop the model wraps ]
        if exc[0] is None and self.forward.early_stop:
            raise RematError(self._message("the recompute saved fewer tensors for backward "
                                           "than the forward did"))
        if isinstance(exc[1], _cp.CheckpointError):  # it saved more
            raise RematError(self._message(str(exc[1]).splitlines()[0])) from exc[1]
        if isinstance(exc[1], RematError) and not str(exc[1]).startswith("block "):
            # the selective modes' checks, which do not know the region's name
            raise RematError(f"block {self.forward.region.label}: {exc[1]}") from exc[1]
        if isinstance(exc[1], Exception) and not isinstance(
                exc[1], (RematError, _cp._StopRecomputationError, torch.cuda.OutOfMemoryError)):
            # the forward ran on the same inputs: what raises now is what changed since
            what = f"{type(exc[1]).__name__}: {(str(exc[1]).splitlines() or [''])[0]}"
            raise RematError(self._message(what, raised=True)) from exc[1]
        return suppress

    def _message(self, what: str, *, raised: bool = False) -> str:
        did = ("raised when it was recomputed in backward, where its forward had run" if raised
               else "ran other ops when it was recomputed in backward than in its forward")
        from torch.nn.utils import parametrize
        if parametrize._cache_enabled:  # the recompute took the weights its forward made
            return (f"block {self.forward.region.label} {did} ({what}): backward runs under "
                    "torch.nn.utils.parametrize.cached(), and the recompute took from its "
                    "cache the weights its forward computed (and saved for backward). Leave "
                    "cached() before backward: with cached(): loss = loss_fn(model(x)); then "
                    "loss.backward()")
        return (f"block {self.forward.region.label} {did} ({what}): a recompute must run "
                "the same ops. "
                "Its forward depends on something besides its inputs and torch's RNG: a "
                "counter, flag or schedule that changed since the forward, an early exit "
                "on one, Python's or numpy's random (not replayed: draw from torch). Keep "
                "this block (leave it out of blocks= when profiling) or make its forward a "
                "function of its inputs")


# NOTE [ An early stop the model wraps ]
#     Checkpoint ends a recompute once it has made the last tensor the forward saved by
#     raising ``_StopRecomputationError`` from its pack hook, inside whatever op saved it,
#     and catches that error around the recompute. Code that catches errors around an op
#     and raises its own (einx, whose compiled ops raise ``CallOperationError`` from the
#     error they met: x-transformers' masked attention) hands checkpoint another error,
#     which ended the backward (autoremat called it a recompute that raised; a plain
#     ``torch.utils.checkpoint`` fails the same way). The recompute had made every tensor
#     the backward needs: where the error's causes hold the stop, it is the stop.
#     A fresh stop is raised, and each error of the chain lets go of its traceback and
#     causes first: where the model keeps the error it caught in a local, its traceback
#     holds that frame, which holds it, and the cycle held the recompute's tensors until
#     the garbage collector ran, above every later level (re-raising the stop itself
#     made such a cycle too, with the model's error as its context: x-transformers'
#     masked encoder measured up to 38% over its predictions).
def _stop_inside(exc: BaseException) -> bool:
    """Whether checkpoint's early-stop error is among ``exc``'s causes; if so, every
    error of the chain drops its traceback and causes (NOTE [ An early stop the model
    wraps ])."""
    chain: list[BaseException] = []
    at: BaseException | None = exc
    while at is not None and all(at is not seen for seen in chain):
        chain.append(at)
        at = at.__cause__ or at.__context__
    if not any(isinstance(e, _cp._StopRecomputationError) for e in chain):
        return False
    for e in chain:
        e.__traceback__ = e.__cause__ = e.__context__ = None
    return True


def _early_stop() -> bool:
    """Whether checkpoint stops a recompute at the last tensor the forward saved (its
    default; ``set_checkpoint_early_stop(False)`` turns it off)."""
    return _cp._enable_checkpoint_early_stop is not False


@dataclass(frozen=True)
class RegionContexts:
    """The ``context_fn`` of one checkpointed region (a block or a segment): forward
    notes the RNG states, recompute replays them (NOTE [ Replaying the forward's RNG ])
    and puts BatchNorm statistics back; ``selective`` adds its modes inside both.
    ``label`` names the region in errors and warnings.

    An object rather than a closure, so that a deep copy of an applied model checkpoints
    the copy's modules and the model pickles (NOTE [ Copying and pickling an applied
    model ])."""

    modules: list[nn.Module]
    selective: ContextFn | None = None
    label: str = "?"
    seen: set[str] = field(default_factory=set, compare=False)  # warned, or checked, once
    _layout: list[_Layout] = field(default_factory=list, compare=False)  # one, when first run
    # the buffers its forward is known to change, as (module, name) slots: a copy of the
    # model carries them to its own modules (NOTE [ Buffers a forward changes ])
    changing: list[tuple[nn.Module, str, bool]] = field(default_factory=list, compare=False)
    # (module, name, an attribute rather than a buffer)

    def layout(self) -> _Layout:
        """Where the region's BatchNorm statistics, buffers and generators are; the first
        time, the buffers noted as changing in forward are taken in ``changing``."""
        if not self._layout:
            self._layout.append(_Layout.of(self.modules))
            for _, m, name in self._layout[0].buffers:
                if name in _CHANGED.get(m, ()):
                    self.note(m, name)
            for _, m in self._layout[0].submodules:
                for name in _CHANGED_ATTRS.get(m, ()):
                    self.note(m, name, attribute=True)
        return self._layout[0]

    def changes(self, module: nn.Module, name: str, *, attribute: bool = False) -> bool:
        """Whether the forward is known to change buffer (or attribute) ``name`` of
        ``module``."""
        return name in (_CHANGED_ATTRS if attribute else _CHANGED).get(module, ()) or any(
            m is module and n == name and a is attribute for m, n, a in self.changing)

    def note(self, module: nn.Module, name: str, *, attribute: bool = False) -> None:
        """Note that the forward changes buffer (or attribute) ``name`` of ``module``."""
        (_CHANGED_ATTRS if attribute else _CHANGED).setdefault(module, set()).add(name)
        if not any(m is module and n == name and a is attribute for m, n, a in self.changing):
            self.changing.append((module, name, attribute))

    def __call__(self) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        forward_ctx, recompute_ctx = self.selective() if self.selective else \
            (nullcontext(), nullcontext())
        forward = _ForwardContext(self, forward_ctx)
        return forward, _RecomputeContext(forward, recompute_ctx)


# (the module's forward, a runner of a checkpoint of a function of no arguments) -> the
# forward to install: how offload.input_offloaded hands a checkpoint its input
InputRunner = Callable[[Callable[..., Any], Callable[[Callable[[], Any]], Any]],
                       Callable[..., Any]]


class _Original:
    """A module's own forward: the instance-level one that was there before us, else its
    class's, called on the module. It refers to the module, not to a bound method made
    when we wrapped it, so that a deep copy calls the copy's (NOTE [ Copying and
    pickling an applied model ])."""

    def __init__(self, module: nn.Module, user_forward: Callable[..., Any] | None) -> None:
        self.module = module
        self.user_forward = user_forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.user_forward is not None:
            return self.user_forward(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


# NOTE [ Arguments as they were called ]
#     A non-reentrant checkpoint keeps its function's arguments by reference and calls it
#     on them again in backward. A list or dict among them is the caller's, who may
#     change it in between: DenseNet passes each dense layer the list of every feature
#     map so far and appends the layer's output to it, so the recompute of a layer
#     concatenated every later layer's output too ("running_mean should contain 123
#     elements not 111"; a model whose channels matched would have recomputed other
#     values). torch.utils.checkpoint does the same with such arguments; torchvision's
#     DenseNet unpacks the list into its checkpoint's arguments for this reason. Where
#     the arguments hold a list or a dict, the recompute gets a copy of their containers
#     as they were when the forward was called (the tensors and other objects in them
#     shared): :func:`as_called`, :class:`_AsCalled`; a segment records its first
#     block's call so too (``segments.py``), and an offloaded input's recompute reads
#     them so (``offload.py``). The forward itself runs on the caller's containers, as
#     without a plan. Found 2026-11-29 (sixteenth session). Nor does the checkpoint hold
#     the caller's containers (it is given the tensors, and the forward's arguments are
#     let go of once it ran): holding DenseNet's list, a checkpoint of a layer kept every
#     later layer's output alive to that layer's backward, where the plain step frees
#     them when its forward returns: a plan recomputing the first layer and keeping four
#     measured four feature maps over its prediction (2026-11-30).


def _mutable(obj: Any) -> bool:
    """Whether ``obj`` is, or holds in its tuples, lists and dicts, a list or a dict."""
    if isinstance(obj, (list, dict)):
        return True
    return isinstance(obj, tuple) and any(_mutable(item) for item in obj)


def as_called(args: Any, kwargs: Any) -> tuple[Any, Any]:
    """``(args, kwargs)`` with their containers copied, what they hold shared (NOTE
    [ Arguments as they were called ])."""
    return tree_map(lambda x: x, (args, kwargs))  # type: ignore[no-any-return]


def snapshot_arguments(args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
    """:func:`as_called` of a call's arguments where they hold a list or a dict, which
    their caller may change; ``None`` for others (the call's own tuple and keyword dict
    are made for it)."""
    held = _mutable(args) or any(_mutable(value) for value in kwargs.values())
    return as_called(args, kwargs) if held else None


class _AsCalled:
    """``fn`` called first on the caller's arguments ``first`` (the forward), which it
    then lets go of, and after that on copies of their containers as they were then
    (NOTE [ Arguments as they were called ]). The checkpoint is given the tensors alone,
    which it ignores."""

    def __init__(self, fn: Callable[..., Any], called: tuple[Any, Any],
                 first: tuple[tuple[Any, ...], dict[str, Any]]) -> None:
        self.fn = fn
        self.called = called  # (snapshot_arguments)
        self._first: tuple[tuple[Any, ...], dict[str, Any]] | None = first

    def __call__(self, *_tensors: Any) -> Any:
        if self._first is None:
            args, kwargs = as_called(*self.called)
        else:
            (args, kwargs), self._first = self._first, None
        return self.fn(*args, **kwargs)


class _Checkpointed:
    """The forward ``wrap`` installs: the module's own forward under a non-reentrant
    checkpoint (see ``wrap`` for the arguments)."""

    def __init__(self, original: Callable[..., Any], context_fn: RegionContexts,
                 compiled: Any, inputs: InputRunner | None) -> None:
        self.original = original
        self.context_fn = context_fn
        self.compiled = compiled
        self.boxed = inputs(original, self._checkpoint) if inputs is not None else None

    def _checkpoint(self, fn: Callable[[], Any]) -> Any:
        return checkpoint(fn, use_reentrant=False, context_fn=self.context_fn,
                          preserve_rng_state=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        original = self.original
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)  # nothing is saved without grad
        if is_compiling():  # compile's own RNG handling and partitioner take over
            if self.boxed is not None:
                refuse_under_compile("a checkpoint with an offloaded input",
                                     "it copies between streams from Python")
            if self.compiled is None:
                return checkpoint(original, *args, use_reentrant=False, **kwargs)
            return checkpoint(original, *args, use_reentrant=False, context_fn=self.compiled,
                              **kwargs)
        refuse_under_func_transforms(self.context_fn.label)
        refuse_kv_cache(self.context_fn.label, args, kwargs)
        tensors = flat_tensors((args, kwargs))
        versions = [t._version for t in tensors]
        if self.boxed is not None:
            out = self.boxed(*args, **kwargs)
        else:
            called = snapshot_arguments(args, kwargs)
            if called is None:
                out = checkpoint(original, *args, use_reentrant=False,
                                 context_fn=self.context_fn,
                                 preserve_rng_state=False, **kwargs)  # we replay it ourselves
            else:  # the checkpoint keeps what it is given until the backward: the tensors,
                # not the caller's containers (NOTE [ Arguments as they were called ])
                out = checkpoint(_AsCalled(original, called, (args, kwargs)),
                                 *flat_tensors(called), use_reentrant=False,
                                 context_fn=self.context_fn, preserve_rng_state=False)
        refuse_changed_input(self.context_fn.label, tensors, versions)
        return out


def wrap(module: nn.Module, tag: Decision = Decision.RECOMPUTE, *,
         selective: ContextFn | None = None,
         compiled: Any = None, inputs: InputRunner | None = None, name: str = "") -> None:
    """Make ``module`` recompute its forward during backward. Idempotent; re-wrapping
    replaces the previous wrapper.

    Args:
        module: any ``nn.Module``; its parameters, hooks and state dict are untouched.
        tag: the decision the wrapper carries out, kept for inspection (``is_wrapped``
            returns it): recompute, selective, or offload_input.
        selective: a ``context_fn`` for ``torch.utils.checkpoint`` (autoremat's
            ``selective.selective_context``, or PyTorch's
            ``create_selective_checkpoint_contexts``), to save some op outputs instead
            of recomputing everything.
        compiled: the ``context_fn`` used instead while Dynamo traces the module
            (``compiled.compiled_context``; ``None``: a plain recompute). NOTE [ Plans
            under torch.compile ].
        inputs: how the checkpoint gets the module's arguments (``None``: as
            arguments); ``offload.input_offloaded`` offloads the input (NOTE
            [ Offloading a checkpoint's input ]). Not under compile.
        name: the module's qualified name, for errors and warnings (default: its class).
    """
    context_fn = RegionContexts([module], selective, repr(name or type(module).__name__))
    context_fn.layout()  # what a copy made before its first forward must carry
    install_forward(module, lambda original: _Checkpointed(original, context_fn, compiled,
                                                           inputs), tag)


def install_forward(module: nn.Module, make: Callable[[Callable[..., Any]], Callable[..., Any]],
                    tag: Decision) -> None:
    """Replace ``module``'s forward by ``make(its forward)`` (NOTE [ Patching forward
    instead of wrapping the module ]), replacing an earlier wrapper of ours; ``unwrap``
    undoes it."""
    if is_wrapped(module):
        unwrap(module)
    user_forward = module.__dict__.get("forward")
    module.forward = make(_Original(module, user_forward))  # type: ignore[method-assign]
    setattr(module, _MARK, _WrapState(user_forward=user_forward, tag=tag))


def unwrap(module: nn.Module) -> bool:
    """Undo :func:`wrap`; returns whether there was anything to undo."""
    state = module.__dict__.get(_MARK)
    if state is None:
        return False
    del module.__dict__[_MARK]
    if state.user_forward is not None:
        module.forward = state.user_forward  # type: ignore[method-assign]
    else:
        del module.__dict__["forward"]
    return True


PLAN_OWNER = "_autoremat_owner"  # on each block of an applied plan: that plan's state


def plan_states(model: nn.Module) -> list[Any]:
    """The states of the plans applied (not undone) that own blocks of ``model``, each
    once (``PLAN_OWNER``; NOTE [ A plan found from its blocks ] in ``_apply.py``)."""
    found: list[Any] = []
    for module in model.modules():
        state = module.__dict__.get(PLAN_OWNER)
        if state is not None and not state.undone and all(state is not f for f in found):
            found.append(state)
    return found


def refuse_applied(model: nn.Module, caller: str) -> None:
    """Raise a :class:`RematError` before any work where ``model`` has a plan applied
    (a block wrapped, or owned by a plan not undone): ``caller`` (profile, estimate)
    measures the plain step, and ran a forward of the planned one before refusing (a
    held-out check, 2026-11-30: estimate warned of a plan made for cpu running on meta,
    then refused as "profiling")."""
    if not isinstance(model, nn.Module):
        return
    if plan_states(model) or any(is_wrapped(module) for module in model.modules()):
        raise RematError(
            f"{caller}() measures the plain step, and {type(model).__name__} has a plan "
            f"applied: call autoremat.remove(model) first (and apply the plan again "
            f"after, or use autoremat.auto, which does both)")


def is_wrapped(module: nn.Module) -> Decision | None:
    """The decision the wrapper on ``module`` carries out, or ``None``."""
    state = module.__dict__.get(_MARK)
    return state.tag if state is not None else None


@contextmanager
def checkpointed(model: nn.Module, names: list[str],
                 selective: dict[str, ContextFn] | None = None,
                 compiled: dict[str, Any] | None = None) -> Iterator[None]:
    """Temporarily checkpoint the named submodules (each on its own); those named in
    ``selective`` with that selective ``context_fn``, and under compile with the one in
    ``compiled`` (``wrap``'s argument)."""
    selective = selective or {}
    compiled = compiled or {}
    modules = [model.get_submodule(n) for n in names]
    previous = [module.__dict__.get(_MARK) for module in modules]
    if any(p is not None for p in previous):
        raise RematError("the model already has autoremat wrappers; call "
                         "autoremat.remove(model) before profiling it")
    try:
        for name, module in zip(names, modules, strict=True):
            wrap(module, Decision.SELECTIVE if name in selective else Decision.RECOMPUTE,
                 selective=selective.get(name), compiled=compiled.get(name), name=name)
        yield
    finally:
        for module in modules:
            unwrap(module)
