"""One training step of a user's model: call it, take the loss, run backward.

:class:`Step` holds what defines the step (model, inputs, loss, loop), checked once when
it is made; profile, verify, auto, estimate and bench all run it (``Step.run``), so every
figure comes from the same step.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import random
import reprlib
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

import numpy as np
import torch
from torch import nn

from autoremat._core.conditions import (
    drop_forward_casts,
    loop_autocast,
    loop_parametrize_cache,
)
from autoremat._core.errors import LoopError, RematError, did_you_mean

__all__ = [
    "LOOPS",
    "OWN_STEP",
    "Loop",
    "Preserved",
    "Step",
    "as_step",
    "cache_configs",
    "caches_off",
    "call_model",
    "check_loop",
    "check_no_cache",
    "clear_grads",
    "default_loss",
    "describe_inputs",
    "describe_loss",
    "device_of",
    "flat_tensors",
    "input_entries",
    "layer_drops",
    "map_tensors",
    "output_bytes",
    "preserved_state",
    "run_step",
    "scalar_in_output",
    "sparse_parts",
    "training_config",
    "unique_storage_bytes",
]

LossFn = Callable[[Any], torch.Tensor]

# True while autoremat runs a step of its own (Step.run: profile, verify, auto, bench),
# whose forwards check nothing the user's would be warned about
OWN_STEP: ContextVar[bool] = ContextVar("autoremat_own_step", default=False)

# NOTE [ Which loop a step models ]
#     What the user's training loop holds while backward runs is part of the step peak:
#     * "holds_output": ``out = model(**batch); out.loss.backward()``: the model's output
#       (logits, a KV cache if one is built) stays referenced until backward has finished.
#       The common idiom, and the default: a budget that holds for it also holds for a loop
#       that lets the output go earlier, since releasing a tensor sooner never raises a peak.
#     * "loss_only": ``loss = model(**batch).loss; loss.backward()`` (or ``del out`` before
#       backward): only the loss and what autograd saved survive the forward. Tighter.
#     Every measurement (profile, auto's check, estimate, bench) runs one loop, recorded in
#     the tape and the plan, so that a prediction and the step it predicts agree.
Loop = Literal["holds_output", "loss_only"]
LOOPS: tuple[Loop, ...] = get_args(Loop)  # ("holds_output", "loss_only")


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(x)``, ``model(*args)`` or ``model(**kwargs)`` by the type of ``inputs``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def check_inputs(inputs: Any) -> None:
    """Raise :class:`~autoremat.RematError` unless ``inputs`` holds a tensor: a step
    without one (``None``, a list of numbers) is a mistake in the call, not a model."""
    if not flat_tensors(inputs):
        raise RematError(f"inputs hold no tensor (got {type(inputs).__name__}: "
                         f"{reprlib.repr(inputs)}): pass a tensor, a tuple of positional "
                         f"arguments or a dict of keyword arguments for the model")


def check_loss_fn(loss_fn: Any) -> None:
    """Raise :class:`~autoremat.RematError` unless ``loss_fn`` is ``None`` or callable."""
    if loss_fn is not None and not callable(loss_fn):
        raise RematError(f"loss_fn must be a function of the model's output returning a "
                         f"scalar tensor (or None for the default loss), got "
                         f"{type(loss_fn).__name__} {reprlib.repr(loss_fn)}")


def parse_device(device: str | torch.device) -> torch.device:
    """``torch.device(device)``, or :class:`~autoremat.RematError` naming the value."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise RematError(f"cannot read device {device!r}: {exc}; e.g. 'cpu', 'cuda', "
                         f"'cuda:1'") from exc


# NOTE [ What a batch may hold ]
#     A step's inputs (and a model's outputs) are tensors in tuples, lists, named tuples,
#     dicts and other mappings (transformers' BatchEncoding is a UserDict) and
#     dataclasses (a ``Batch`` of a training script's own, a ModelOutput), nested to any
#     depth. torch's pytree opens the first three and a ModelOutput, not a user's
#     dataclass or mapping: a model taking ``forward(batch: Batch)`` was refused as
#     "inputs hold no tensor". :func:`flat_tensors` and :func:`map_tensors` open all of
#     them.


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def flat_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in a nested structure, in order (NOTE [ What a batch may hold ])."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in flat_tensors(v)]
    if _is_dataclass_instance(obj):
        return [t for f in dataclasses.fields(obj) for t in flat_tensors(getattr(obj, f.name))]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in flat_tensors(v)]
    return []


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with each tensor ``t`` in it replaced by ``fn(t)``, its containers rebuilt
    as the same types (NOTE [ What a batch may hold ]); anything else is kept as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, MutableMapping):
        new = copy.copy(obj)
        for k, v in obj.items():
            new[k] = map_tensors(fn, v)
        return new
    if isinstance(obj, Mapping):  # one that cannot be written to
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if _is_dataclass_instance(obj):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, map_tensors(fn, getattr(obj, f.name)))
        return new
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj


def _own_loss(output: Any) -> torch.Tensor | None:
    """The loss the model computed itself: ``output.loss`` (or ``output["loss"]``) when it
    is a tensor, else ``None``."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    return loss if isinstance(loss, torch.Tensor) else None


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` when present (and not None), else the sum of the first floating
    tensor in the output."""
    loss = _own_loss(output)
    if loss is not None:
        return loss
    tensors = flat_tensors(output)
    for item in tensors:
        if item.is_floating_point():
            return item.sum()
    found = (f"its tensors are {', '.join(sorted({str(t.dtype) for t in tensors}))}, which "
             f"carry no gradient" if tensors else "it holds no tensor")
    raise RematError(f"cannot find a loss in the model output of type {type(output).__name__} "
                     f"({found}): pass loss_fn=lambda out: ... returning a floating-point "
                     f"scalar tensor")


def describe_loss(output: Any, loss_fn: Any, inputs: Any) -> tuple[str, str]:
    """Which loss a step takes from ``output`` (as :func:`run_step` does), in words, and
    what a loop is likely to take instead when that is the default sum over an output that
    is not a loss: ``"logits"`` for a floating output ``(*S, V)`` over an integer input of
    shape ``S`` (token ids, trained with a cross-entropy over the vocabulary),
    ``"outputs"`` for another batch of vectors ``(..., D)`` with ``D > 1`` (trained with
    some loss of its own), ``""`` when the loss is the model's or the user's (NOTE [ The
    conditions a step is measured under ] in ``conditions.py``)."""
    if loss_fn is not None:
        return f"loss_fn {getattr(loss_fn, '__qualname__', type(loss_fn).__name__)}", ""
    if _own_loss(output) is not None:
        return "output.loss", ""
    first = next((t for t in flat_tensors(output) if t.is_floating_point()), None)
    if first is None:
        return "none found", ""
    shape = tuple(first.shape)
    ids = [tuple(t.shape) for t in flat_tensors(inputs) if not t.is_floating_point()
           and not t.is_complex() and t.dim() >= 1]
    vectors = first.dim() >= 2 and shape[-1] > 1
    kind = ("logits" if vectors and shape[:-1] in ids else "outputs" if vectors else "")
    dtype = str(first.dtype).removeprefix("torch.")
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return f"the output, a scalar {dtype} (no loss_fn)", ""
    return (f"the sum of the output's first floating tensor {shape} {dtype} "
            "(the default; no loss_fn)", kind)


def scalar_in_output(output: Any) -> str | None:
    """Where a tuple, list or mapping output holds a 0-d floating tensor that needs a
    gradient (the loss a model computed and returned beside its logits, as nanoGPT's
    ``logits, loss``), the expression that reads it (``"out[1]"``, ``"out['loss']"``);
    else ``None``. What the default loss's warning names, since the default reads
    ``output.loss`` only."""
    items: Any = output.items() if isinstance(output, Mapping) else \
        enumerate(output) if isinstance(output, (tuple, list)) else ()
    for key, item in items:
        if isinstance(item, torch.Tensor) and item.dim() == 0 and item.requires_grad \
                and item.is_floating_point():
            return f"out[{key!r}]"
    return None


def check_loop(loop: Any) -> Loop:
    """``loop`` if it is one of :data:`LOOPS`, else :class:`~autoremat.LoopError`."""
    if loop not in LOOPS:
        raise LoopError(f"unknown loop {loop!r}; choose one of {list(LOOPS)}: "
                        f"'holds_output' when your loop keeps the model's output until "
                        f"backward has run (out = model(**batch); out.loss.backward()), "
                        f"'loss_only' when only the loss survives the forward."
                        + did_you_mean(str(loop), LOOPS))
    return cast(Loop, loop)


@dataclass(frozen=True, eq=False, repr=False)
class Step:
    """One training step of a model: forward on ``inputs``, the loss, backward, in the
    training loop ``loop``. What profile, verify, auto, estimate and doctor measure.

    Each of them takes a step in place of its first arguments: ``profile(step)`` measures
    exactly what ``profile(model, inputs, loss_fn=..., loop=...)`` does (same tape). The
    other arguments then go by keyword (``auto(step, budget="6GiB")``,
    ``verify(step, plan=plan)``): a step carries its inputs, so a second positional
    argument would be read as inputs and is refused. Make one step and pass it around
    when a script profiles, plans and verifies the same batch; loose arguments read as
    well for a single call.

    The values are checked when the step is made (:class:`~autoremat.RematError`,
    :class:`~autoremat.LoopError` for ``loop``); a step is frozen, and
    ``dataclasses.replace(step, inputs=...)`` makes a checked copy.

    Example:
        >>> import autoremat
        >>> model, inputs = autoremat.zoo.build("mlp", widths=(32,) * 2, batch_size=8)
        >>> def loss_of(out):
        ...     return out.loss
        >>> step = autoremat.Step(model, inputs, loss_of, loop="loss_only")
        >>> step.describe()
        'MLPChain on (8, 256) float32, (8,) int64; loss: loss_of; loop: loss_only'
        >>> autoremat.profile(step, timing=False, with_selective=False).loop
        'loss_only'
    """

    model: nn.Module  # in the mode it trains in (dropout and BatchNorm active)
    inputs: Any  # a tensor, a tuple of positional arguments or a dict of keyword arguments
    loss_fn: LossFn | None = None  # output -> scalar tensor; None: default_loss
    loop: Loop = "holds_output"  # NOTE [ Which loop a step models ]

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise RematError(f"a Step needs an nn.Module as its model, got "
                             f"{type(self.model).__name__} {reprlib.repr(self.model)}")
        check_inputs(self.inputs)
        check_loss_fn(self.loss_fn)
        check_loop(self.loop)

    def __repr__(self) -> str:
        return f"Step({self.describe()})"

    def describe(self) -> str:
        """The step in one line, for messages: model, inputs, loss and loop."""
        loss = ("the default (output.loss, else the sum of the first floating tensor)"
                if self.loss_fn is None else getattr(self.loss_fn, "__qualname__",
                                                     type(self.loss_fn).__name__))
        return (f"{type(self.model).__name__} on {describe_inputs(self.inputs)}; "
                f"loss: {loss}; loop: {self.loop}")

    @property
    def device(self) -> torch.device:
        """The device the step runs on (:func:`~autoremat._core.step.device_of`)."""
        return device_of(self.model, self.inputs)

    def run(self, between: Callable[[], None] | None = None) -> torch.Tensor:
        """Forward, loss, backward, as the training loop ``self.loop`` runs them.

        Args:
            between: runs after the loss and before backward.

        Returns:
            The loss, detached. ``"holds_output"`` keeps the model's output referenced
            until backward has finished, then releases it before returning;
            ``"loss_only"`` releases it before backward (NOTE [ Which loop a step
            models ]).
        """
        model, inputs = self.model, self.inputs
        token = OWN_STEP.set(True)
        try:
            return self._run(model, inputs, between)
        finally:
            OWN_STEP.reset(token)

    def _run(self, model: nn.Module, inputs: Any,
             between: Callable[[], None] | None) -> torch.Tensor:
        with loop_autocast() as leave_autocast, \
                loop_parametrize_cache() as leave_cache:  # NOTE [ The conditions a step
            # is measured under ] in conditions.py: autocast and cached() as a loop enters
            # them
            try:
                output = call_model(model, inputs)
            except Exception as exc:
                # the model's own error: it stays what it is, with where it was raised from
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(f"autoremat: raised by the forward of "
                                 f"{type(model).__name__} on inputs {describe_inputs(inputs)}, "
                                 f"in a training step autoremat ran (profile, verify, auto or "
                                 f"bench)")
                raise
            drop_forward_casts()  # as a planned model does (NOTE [ Backward inside autocast ])
            loss = (self.loss_fn or default_loss)(output)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise RematError(f"loss_fn must return a scalar tensor, got "
                                 f"{type(loss).__name__} {getattr(loss, 'shape', '')}")
            if not loss.requires_grad:
                raise RematError("the loss does not require grad: no parameter of the model "
                                 "is trainable, or the output was detached")
            held = output if self.loop == "holds_output" else None
            del output
            leave_autocast()
            leave_cache()
            if between is not None:
                between()
            loss.backward()
            del held  # backward has finished: "holds_output" lets the output go only now
        return loss.detach()


def as_step(model: nn.Module | Step, inputs: Any, loss_fn: LossFn | None, loop: Any,
            *, caller: str, keyword: str) -> Step:
    """The step a public function was given: ``model`` itself when it is a :class:`Step`
    (then ``inputs``, ``loss_fn`` and ``loop`` must be left out), else a step made of the
    loose arguments (``loop=None``: ``"holds_output"``).

    Args:
        caller: the function's name, for messages (``"profile"``).
        keyword: an argument of ``caller`` that goes by keyword after a step, for the
            message when it was passed positionally (``"budget"``).

    Raises:
        RematError: a step and loose arguments both, or ``model`` neither a module nor a
            step; what :class:`Step` raises for a wrong value.
    """
    if isinstance(model, Step):
        given = [f"{name}={reprlib.repr(value)}" for name, value in
                 (("inputs", inputs), ("loss_fn", loss_fn), ("loop", loop))
                 if value is not None]
        if given:
            raise RematError(
                f"{caller}() was given a Step and {', '.join(given)}: the step carries its "
                f"inputs, loss_fn and loop. Pass the other arguments by keyword "
                f"({caller}(step, {keyword}=...)), or make the step with what you meant "
                f"(dataclasses.replace(step, ...))")
        return model
    if not isinstance(model, nn.Module):
        raise RematError(f"{caller}() needs an nn.Module, got {type(model).__name__}: pass "
                         f"the model and its inputs, or an autoremat.Step")
    return Step(model, inputs, loss_fn, "holds_output" if loop is None else loop)


def run_step(model: nn.Module, inputs: Any, loss_fn: LossFn | None,
             between: Callable[[], None] | None = None, *,
             loop: Loop = "holds_output") -> torch.Tensor:
    """``Step(model, inputs, loss_fn, loop).run(between)``: forward, loss, backward, as
    the training loop ``loop`` runs them (see :meth:`Step.run`)."""
    check_loop(loop)
    check_loss_fn(loss_fn)
    return Step(model, inputs, loss_fn, loop).run(between)


def output_bytes(output: Any, loss: torch.Tensor | None = None) -> int:
    """Bytes of the distinct storages in a model's output other than the loss's: what a
    loop that holds the output through backward keeps alive beyond the loss."""
    skip = loss.untyped_storage()._cdata if isinstance(loss, torch.Tensor) else None
    return unique_storage_bytes([t for t in flat_tensors(output)
                                 if t.untyped_storage()._cdata != skip])


def input_entries(inputs: Any) -> list[tuple[str | None, Any]]:
    """The inputs as ``(name, value)`` entries: keyword arguments by name, positional
    ones unnamed; a container among them that holds tensors (a dataclass batch, a list
    of masks) gives an entry per value inside, named by its path (``"batch.labels"``,
    ``"mask_labels.1"``, ``"0.x"`` for a positional one), so that a signature shows the
    shapes a plan depends on (NOTE [ What a batch may hold ])."""
    if isinstance(inputs, Mapping):  # a dict, or a UserDict such as a BatchEncoding
        top: list[tuple[str | None, Any]] = [(str(k), v) for k, v in inputs.items()]
    elif isinstance(inputs, (tuple, list)) and not hasattr(inputs, "_fields"):
        top = [(None, v) for v in inputs]
    else:
        top = [(None, inputs)]
    out: list[tuple[str | None, Any]] = []
    for i, (name, value) in enumerate(top):
        out.extend(_inside(name if name is not None else str(i), value)
                   if _holds_tensors(value) else [(name, value)])
    return out


def _holds_tensors(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) and bool(flat_tensors(value))


def _inside(path: str, value: Any) -> list[tuple[str | None, Any]]:
    if isinstance(value, Mapping):
        items = [(str(k), v) for k, v in value.items()]
    elif _is_dataclass_instance(value):
        items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    else:  # a tuple or a list
        items = [(str(i), v) for i, v in enumerate(value)]
    return [entry for key, v in items for entry in (
        _inside(f"{path}.{key}", v) if _holds_tensors(v) else [(f"{path}.{key}", v)])]


def describe_inputs(inputs: Any) -> str:
    """``"idx: (4, 128) int64, targets: (4, 128) int64"``-style signature of the inputs
    (:func:`input_entries`); a tensor that requires a gradient says so (``"(8, 3, 32, 32)
    float32 requires_grad"``: an adversarial loop's input, whose gradient the step makes)."""
    def one(t: Any) -> str:
        if isinstance(t, torch.Tensor):  # a gradient wanted for it is part of the step
            return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" + \
                (" requires_grad" if t.requires_grad else "")
        return type(t).__name__
    return ", ".join(f"{name}: {one(v)}" if name is not None else one(v)
                     for name, v in input_entries(inputs))


def unique_storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages among the tensors in a (nested) structure (a
    sparse tensor's: its indices' and values')."""
    seen: dict[int, int] = {}
    for t in flat_tensors(tensors):
        for part in (t,) if t.layout is torch.strided else sparse_parts(t):
            st = part.untyped_storage()
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The dense tensors holding a sparse tensor's memory (its indices and values; a
    sparse tensor has no storage of its own: ``nn.Embedding(sparse=True)``'s gradient);
    none for a layout without them."""
    if t.layout is torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return []


def cache_configs(model: nn.Module) -> dict[str, Any]:
    """The distinct Hugging Face configs in ``model`` whose ``use_cache`` is on, by the
    name of the first module holding each (``"config"``, ``"decoder.config"``).

    NOTE [ Every stack has its own config ]
        An encoder-decoder (T5, and others built the same way) deep-copies its config for
        each stack, so ``model.config.use_cache = False`` leaves the decoder's own copy
        on. The decoder then builds a cache anyway: each checkpointed decoder block
        appends its keys to it in forward and again in recompute, and its cross-attention
        reads the keys cached by the forward instead of computing them, so the recompute
        saves fewer tensors (``torch.utils.checkpoint``: "a different number of tensors
        was saved", 56 vs 52 on a two-layer T5). Every config found on the model or its
        submodules is turned off, each once.
    """
    found: dict[int, tuple[str, Any]] = {}
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", False):
            found.setdefault(id(config), (f"{name}.config" if name else "config", config))
    return dict(found.values())


def check_no_cache(model: nn.Module, output: Any) -> None:
    """Refuse a training step whose output carries a Hugging Face KV cache.

    With every config's ``use_cache`` off (:func:`training_config`), a cache in the output
    was asked for by the inputs (``use_cache=True``, or a cache passed in). A recomputed
    block appends to it a second time (a GPT-2's cache ends the step with twice its
    keys), and an encoder-decoder's recomputed cross-attention reads the keys its forward
    cached instead of computing them, so ``torch.utils.checkpoint`` fails in backward
    ("a different number of tensors was saved"). We say why before any of that.

    Raises:
        RematError: the output holds a ``cache`` or ``past_key_values`` in train mode.
    """
    if not model.training or not isinstance(output, Mapping):
        return  # Hugging Face outputs are mappings holding the fields that are set
    for key in ("cache", "past_key_values"):
        if output.get(key) is not None:
            raise RematError(
                f"the model returned a KV cache (output[{key!r}], a "
                f"{type(output[key]).__name__}) in train mode: the inputs ask for one "
                "(use_cache=True, or a cache passed in). A recomputed block would append "
                "to it a second time and break its recompute; drop use_cache and the "
                "cache from the training inputs (or pass use_cache=False)")


@contextmanager
def caches_off(configs: list[Any]) -> Iterator[None]:
    """Set ``use_cache = False`` on ``configs`` and restore each one's value on exit."""
    saved = [(config, config.use_cache) for config in configs]
    try:
        for config, _ in saved:
            config.use_cache = False
        yield
    finally:
        for config, value in saved:
            config.use_cache = value


@contextmanager
def training_config(model: nn.Module) -> Iterator[list[str]]:
    """Turn off a Hugging Face KV cache while training (restored on exit).

    With ``config.use_cache`` on, every layer appends to the cache in forward, and a
    recompute appends again: wrong memory and a broken recompute. Hugging Face turns it
    off when gradient checkpointing is enabled; we do the same, on the configs of every
    stack (NOTE [ Every stack has its own config ]), and say so.
    """
    # in eval() mode too: the step measured still runs backward, and the cache built
    # there was refused by the checkpoints as the loop's (a held-out OLMo left in eval(),
    # as from_pretrained returns it, 2026-11-30); apply turns it off in either mode
    configs = list(cache_configs(model).values())
    notes: list[str] = []
    if configs:
        notes.append("config.use_cache was turned off while training (a KV cache is "
                     "useless in training and breaks recomputation)")
    with caches_off(configs), every_layer_runs(model) as dropped:
        if dropped:
            notes.append(f"layers skipped at random in training ({', '.join(dropped)}) ran "
                         f"every one while measuring: the plan holds for the step where "
                         f"none is skipped, and a skipped layer holds nothing")
        yield notes


# the attributes by which models skip layers at random in training (LayerDrop: Hugging
# Face's Wav2Vec2 and HuBERT read the config's at each step, BART and Whisper copy it to
# their encoder and decoder modules; x-transformers' and vit-pytorch's layers keep
# ``layer_dropout``, torchaudio's wav2vec2 encoder ``layer_drop``): NOTE [ Random layer
# skipping ]
_LAYERDROP = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop", "layer_dropout",
              "layer_dropouts", "layer_drop")


def layer_drops(model: nn.Module) -> list[tuple[Any, str, Any]]:
    """Where ``model`` (in training mode) skips layers at random: ``(owner, attribute,
    probability)`` for each config or module attribute of :data:`_LAYERDROP` above 0 (or
    a tuple of them, one per layer, any above 0: x-transformers' ``layer_dropouts``)."""
    found: list[tuple[Any, str, Any]] = []
    seen: set[int] = set()
    if not model.training:
        return found
    for module in model.modules():
        for owner in (module, getattr(module, "config", None)):
            if owner is None or id(owner) in seen:
                continue
            seen.add(id(owner))
            for key in _LAYERDROP:
                value = getattr(owner, key, None)
                if _skips(value) or (isinstance(value, tuple) and value
                                     and all(_number(v) for v in value)
                                     and any(_skips(v) for v in value)):
                    found.append((owner, key, value))
    return found


# the module attributes by which a mixture of experts draws noise into its routing in
# training: Hugging Face's SwitchTransformers, Mixtral and MiniMax routers copy the
# config's ``router_jitter_noise`` to ``jitter_noise``; PhiMoE's is ``input_jitter_noise``
# (its ``router_jitter_noise`` is a threshold, not noise, so configs are not read)
_ROUTER_NOISE = ("jitter_noise", "input_jitter_noise")


def router_noise(model: nn.Module) -> list[str]:
    """``"attribute=value"`` for each module attribute of :data:`_ROUTER_NOISE` above 0
    in ``model`` (in training mode): how many tokens each expert takes is drawn at
    random at every step (NOTE [ Experts chosen with noise ] in _profile/profile.py)."""
    if not model.training:
        return []
    return sorted({f"{key}={value!r}" for module in model.modules() for key in _ROUTER_NOISE
                   if _skips(value := getattr(module, key, None))})


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _skips(value: Any) -> bool:
    """Whether ``value`` is a probability of skipping a layer above 0."""
    return _number(value) and value > 0


# NOTE [ Random layer skipping ]
#     Wav2Vec2, HuBERT, Whisper, BART and others skip each layer at random in training
#     (LayerDrop: ``config.layerdrop``, ``encoder_layerdrop``, ...). A step where a layer is
#     skipped runs fewer blocks and holds less, so the step where every layer runs is the
#     largest: ``profile`` (and ``estimate``, ``verify``) measure that one, with the
#     skipping off and restored after (the tape's notes say so), and a plan for it holds
#     on every step. In training a skipped block is simply not called; each block's own
#     checkpoint is unaffected. A segment of several blocks is not: the skip is decided
#     between its blocks, by a random draw its recompute would not replay, so a model
#     that skips layers gets no multi-block segments (its blocks are not chained).
@contextmanager
def every_layer_runs(model: nn.Module) -> Iterator[list[str]]:
    """Turn random layer skipping off while measuring, restored on exit (NOTE [ Random
    layer skipping ]); yields what it turned off (``"layerdrop=0.1"``)."""
    saved = layer_drops(model)
    try:
        for owner, key, value in saved:
            setattr(owner, key, (0.0,) * len(value) if isinstance(value, tuple) else 0.0)
        yield sorted({f"{key}={value!r}" for _, key, value in saved})
    finally:
        for owner, key, value in saved:
            setattr(owner, key, value)


def scalar_attributes(module: nn.Module) -> list[tuple[str, Any]]:
    """``module``'s own Python number and string attributes (a call counter, an annealed
    temperature), by name: the state a forward may change that is neither a buffer nor a
    parameter, and that :func:`preserved_state` and a recompute put back."""
    return [(name, value) for name, value in vars(module).items()
            if type(value) in (bool, int, float, str)]


_INTERNAL = frozenset(vars(nn.Module()))  # a module's own bookkeeping (_parameters, ...)


class Preserved:
    """What :func:`preserved_state` saved, as its ``with`` gives it: the model's state on
    entry, which it puts back on exit, and the means to run another step from it
    (:meth:`rewind`) keeping what the steps have built (:meth:`built`)."""

    def __init__(self, model: nn.Module, inputs: Any) -> None:
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()
                        if b.device.type != "meta"]
        self.scalars = [(m, name, value) for m in model.modules()
                        for name, value in scalar_attributes(m)]
        # what each module holds by identity: a buffer or attribute the forward gives
        # another object (a memory of past segments, ``self.mems = ...``; an observer's
        # new range; a cache made in the first forward)
        self.slots = [(prefix, m, dict(m._buffers),
                       {k: v for k, v in vars(m).items() if k not in _INTERNAL})
                      for prefix, m in model.named_modules()]
        # the hooks each module holds (NOTE [ Hooks a forward registers ])
        self.hooks = [(hooks, dict(hooks)) for m in model.modules()
                      for name, hooks in vars(m).items()
                      if "hook" in name and isinstance(hooks, dict)]
        leaves = [t for t in flat_tensors(inputs) if t.is_leaf and t.requires_grad]
        self.grads = [(p, p.grad) for p in (*model.parameters(), *leaves)]
        # the random states (the CUDA ones where CUDA runs already, as fork_rng saves)
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self._rngs = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                      torch.cuda.get_rng_state_all() if cuda else None)

    def built(self) -> list[tuple[str, int]]:
        """The buffers and attributes that the steps run inside gave another object
        holding tensors, by qualified name, with the bytes of its storages: a cache the
        model makes in its first forward (ConViT's ``rel_indices``), a memory of past
        segments. Empty for a model whose forward keeps no tensor of its own.

        NOTE [ A step that builds the model's state ]
            :func:`preserved_state` puts back what a buffer or attribute held before the
            steps (Transformer-XL's memory must not carry the measurement's). A model
            that makes a cache in its first forward (timm's ConViT: ``rel_indices``, a
            placeholder buffer replaced by its relative positions on the first call) then
            makes it again in the next step, which holds it on top of the step: 30 KiB
            for a small ConViT, in every plan and in the plain step alike, so ``verify``
            judged an exact plan at its budget over it and ``auto`` planned again for a
            smaller budget, or gave up at the smallest (a held-out check, 2026-12-02).
            Every figure autoremat predicts is of a step after the first, as the profile
            measures them (its first step, which finds the blocks, builds the cache); so
            an isolated step that built such state (``measure_step``: verify's, auto's,
            bench's) is measured again from the same state, what it built kept
            (:meth:`rewind`). A model whose forward builds nothing is measured once, as
            before. The user's own first step after autoremat's calls builds it once
            more, on top of the predicted peak, like cuBLAS's workspace on a GPU; the
            profile names it (``tape.notes``).
        """
        found: list[tuple[str, int]] = []
        for prefix, m, held, attributes in self.slots:
            now = {**vars(m), **m._buffers}
            for name in sorted(set(now) - _INTERNAL):
                before = held.get(name, attributes.get(name))
                value = now[name]
                if value is before or not flat_tensors(value):
                    continue
                found.append((f"{prefix}.{name}" if prefix else name,
                              unique_storage_bytes(value)))
        return found

    def rewind(self) -> None:
        """Back to the state on entry for another step from it: buffers' values, number
        attributes, the random states, gradients ``None``; what the steps gave another
        object stays as they left it (:meth:`built`)."""
        self._put_values()
        for p, _ in self.grads:
            p.grad = None

    def _put_values(self) -> None:
        """Buffers' values, number attributes, the modules' hooks and the random states
        as on entry.

        NOTE [ Hooks a forward registers ]
            A model may register hooks on its modules in its first forward, behind a
            flag (vit-pytorch's ``Recorder``: ``if not self.hook_registered:``, a hook
            on every attention's softmax that records its output). The flag is a number
            attribute, put back; the hooks were left, so the user's next forward
            registered them again, and every step after recorded each attention twice,
            on top of the predicted peak (its plans 8-17% over their predictions, two
            over their budgets; a held-out check, 2026-12-02). The hooks each module
            holds are put back with the flag, so the model's next forward finds what it
            found before.
        """
        for hooks, on_entry in self.hooks:
            if hooks.keys() != on_entry.keys():
                hooks.clear()
                hooks.update(on_entry)
        with torch.no_grad():
            for b, saved in self.buffers:
                if b.shape != saved.shape:  # (an observer sized in its first forward)
                    b.resize_(saved.shape)
                b.copy_(saved)
        for m, name, value in self.scalars:
            vars(m)[name] = value
        py_state, np_state, cpu_state, cuda_states = self._rngs
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)

    def restore(self) -> None:
        """Everything as it was on entry (:func:`preserved_state`'s exit)."""
        for _, m, held, attributes in self.slots:
            for name, buffer in held.items():
                if m._buffers.get(name) is not buffer:
                    m._buffers[name] = buffer
            here = vars(m)
            for name, value in attributes.items():
                if name not in here or here[name] is not value:
                    here[name] = value
        self._put_values()
        for p, g in self.grads:
            p.grad = g


@contextmanager
def preserved_state(model: nn.Module, inputs: Any = None) -> Iterator[Preserved]:
    """Run measurement steps without leaving a trace on the model, the inputs or the RNGs.

    Saves and restores: buffers (BatchNorm statistics), the modules' Python number and
    string attributes (a call counter, an annealed temperature), what their buffers and
    other attributes hold where a step gave them another object (Transformer-XL's
    memory, ``self.mems = ...``; until 2026-11-29 it kept the measurement steps'), the
    ``.grad`` of
    parameters and of the input tensors that are leaves requiring grad (an input whose
    gradient the user wants must not collect the measurement steps'), the Python, CPU
    and CUDA random states, and numpy's global one (models draw from it: Wav2Vec2's
    SpecAugment masks). Gradients are ``None`` inside. Gives a :class:`Preserved`.
    """
    kept = Preserved(model, inputs)
    try:
        for p, _ in kept.grads:
            p.grad = None
        yield kept
    finally:
        kept.restore()


def clear_grads(model: nn.Module, inputs: Any = None) -> None:
    """``.grad = None`` on the parameters of ``model`` and on the tensors of ``inputs``
    that are leaves requiring grad, before (or after) a measured step: a step starts with
    gradients ``None`` (DESIGN: step peak), the input's included. An input gradient left
    by an earlier step is accumulated into in place, so the next step would not allocate
    it (nor, for a non-contiguous input, AccumulateGrad's copy into the input's layout)
    and would measure low."""
    for p in model.parameters():
        p.grad = None
    for t in flat_tensors(inputs) if inputs is not None else ():
        if t.is_leaf and t.requires_grad:
            t.grad = None


def device_of(model: nn.Module, inputs: Any = None) -> torch.device:
    """The device a step of ``model`` runs on: its first parameter's (or buffer's), else
    the first tensor's among ``inputs``, else the CPU.

    Example:
        >>> device_of(nn.Linear(2, 2, device="meta")).type
        'meta'
    """
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    if first is not None:
        return first.device
    for t in flat_tensors(inputs):
        return t.device
    return torch.device("cpu")
