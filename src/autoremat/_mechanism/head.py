"""Where a model's loss head is, and running it over token chunks (NOTE [ A chunked head ]
in ``_core/head.py``).

NOTE [ Which heads can be chunked ]
    Two kinds of model say where their head is, and what its loss means:
    * a Hugging Face ``*ForCausalLM`` given ``labels``, whose ``lm_head`` is a plain
      ``nn.Linear`` and whose forward calls its ``loss_function`` (the code of the
      forward names it; BART's, Whisper's and TrOCR's decoders take an unshifted
      ``nn.CrossEntropyLoss`` of their own instead: kind "ce" below), the library's
      causal-LM loss (``ForCausalLMLoss``:
      labels shifted by one, ``ignore_index=-100``, mean over counted tokens or the sum
      over ``num_items_in_batch``, logits upcast to float32). Chunked, ``lm_head``
      returns the hidden states unchanged and the model's ``loss_function`` takes the
      chunked loss of them; the output's ``logits`` is ``None``. In a forward without
      gradients (evaluation, generation) the head runs as the model's own and returns
      the logits: nothing is saved for backward there, and metrics read them. A model
      whose config names a transform of the logits between ``lm_head`` and its loss
      (Gemma's soft-cap, Cohere's logit scale, Granite's logit scaling) has it followed
      (NOTE [ Logit transforms ]); any other change of the logits (one no config names,
      a slice, a view) is found by the loss seeing another tensor than ``lm_head``
      returned, and refused;
    * a Hugging Face model given ``labels`` that takes ``cross_entropy`` of its output
      layer's result in its own forward (``*ForMaskedLM`` such as BERT's,
      ``*ForConditionalGeneration`` such as T5's and BART's, Whisper's): kind "ce", the
      layer ``get_output_embeddings()`` names. Chunked, that layer returns the hidden
      states as a :class:`_TracedLogits`, and the ``cross_entropy`` the model calls on
      it (after flattening it to rows, adding a bias such as BART's
      ``final_logits_bias``) runs as the chunked head (NOTE [ Logit transforms ]);
    * a model of one's own with one :class:`autoremat.LMHead` called with labels.
    Anything else (a ``loss_fn`` of the caller's, which reads the logits; no labels; a
    head of another shape) keeps its head as it is, and the tape says why.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoremat._core.errors import RematError
from autoremat._core.head import (
    HeadKind,
    LMHead,
    LogitOp,
    backend_unavailable,
    linear_cross_entropy,
)

__all__ = ["HeadInstall", "HeadNotFollowedError", "HeadSite", "find_head", "head_installed",
           "install_head", "uninstall_head"]

# The config fields of Hugging Face models that transform the logits before the loss
# (NOTE [ Logit transforms ]).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                     "output_multiplier_scale")


def logit_transform(model: nn.Module) -> str:
    """The config field (``"key=value"``) by which ``model`` transforms its logits before
    the loss, ``""`` where none does. A field set to 1 counts: Granite divides by its
    ``logits_scaling`` whatever its value, and the chunked head follows that op too."""
    config = getattr(model, "config", None)
    for key in _LOGIT_TRANSFORMS:
        value = getattr(config, key, None)
        if value is not None:
            return f"{key}={value!r}"
    return ""


@dataclass(frozen=True)
class HeadSite:
    """Where a model's loss head is: ``kind`` "hf" (``name`` is the ``lm_head``), "ce"
    (``name`` is the output layer whose ``cross_entropy`` the model's forward takes) or
    "module" (``name`` is the :class:`~autoremat.LMHead`)."""

    kind: HeadKind
    name: str
    vocab: int

    def __str__(self) -> str:
        what = {"hf": "Hugging Face causal-LM loss", "ce": "cross-entropy in the forward",
                "module": "LMHead"}[self.kind]
        return f"{self.name} ({what})"


def _lm_owner(model: nn.Module) -> tuple[str, nn.Module]:
    """The Hugging Face model whose forward takes the loss of its ``lm_head``, and its
    name: ``model`` itself, or the model a wrapper runs (PEFT's ``PeftModel`` holds it
    at ``base_model.model`` and forwards ``lm_head`` and ``loss_function`` to it, but the
    loss is taken in that model's forward, from its own ``loss_function``)."""
    if "lm_head" in model._modules or not isinstance(getattr(model, "lm_head", None),
                                                      nn.Module):
        return "", model
    for name, module in model.named_modules():
        if "lm_head" in module._modules and hasattr(module, "config") and \
                hasattr(module, "loss_function"):
            return name, module
    return "", model


def find_head(model: nn.Module, inputs: Any, loss_fn: Any) -> tuple[HeadSite | None, str]:
    """The model's chunkable head, or ``None`` and the reason (``""``: no LM head at all)."""
    heads = [(name, m) for name, m in model.named_modules() if isinstance(m, LMHead)]
    prefix, owner = _lm_owner(model)
    lm_head = getattr(owner, "lm_head", None)
    output = _output_layer(model)
    if not heads and lm_head is None and output is None:
        return None, ""
    if loss_fn is not None:
        return None, ("the loss is taken by the caller's loss_fn, which a plan cannot "
                      "compute in chunks (whether it reads the logits or returns a loss "
                      "the model computed): the loss head stays as the model computes it "
                      "(leave loss_fn out to let the plan chunk the model's own loss)")
    if len(heads) > 1:
        return None, (f"{len(heads)} LMHead modules ({heads[0][0]}, {heads[1][0]}, ...): "
                      f"the plan chunks one loss head; the heads stay as they are")
    if heads:
        name, head = heads[0]
        return HeadSite("module", name, head.out_features), ""
    if not hasattr(model, "config"):
        return None, ""  # some other model's lm_head: nothing says what its loss is
    why = ""
    if lm_head is not None and hasattr(owner, "loss_function"):
        why = _hf_unsupported(owner, lm_head, inputs)
        if not why:
            return HeadSite("hf", f"{prefix}.lm_head" if prefix else "lm_head",
                            int(lm_head.out_features)), ""
    # NOTE [ Which heads can be chunked ]: kind "ce", where the causal-LM loss is not
    # the model's (whether its forward takes cross_entropy of the layer shows in the step),
    # or where lm_head is a module around the output layer (RoBERTa's RobertaLMHead:
    # dense, norm, then the decoder get_output_embeddings() names)
    if output is not None and (not why or why.startswith(_NOT_CAUSAL)
                               or output[1] is not lm_head):
        name, layer = output
        why = _ce_unsupported(model, layer, inputs)
        if not why:
            return HeadSite("ce", name, cast(nn.Linear, layer).out_features), ""
    if not why:
        return None, ""
    return None, why + "; the loss head stays as the model computes it"


def _output_layer(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The name and module of a Hugging Face model's output layer
    (``get_output_embeddings()``), if it has one among its modules."""
    getter = getattr(model, "get_output_embeddings", None)
    if getter is None or not hasattr(model, "config"):
        return None
    layer = getter()
    if not isinstance(layer, nn.Module):
        return None
    return next(((name, m) for name, m in model.named_modules() if m is layer), None)


def _ce_unsupported(model: nn.Module, layer: nn.Module, inputs: Any) -> str:
    """Why a Hugging Face model's output layer cannot be chunked as a "ce" head ("" if
    it can; whether its forward takes ``cross_entropy`` of it shows in the step)."""
    return _layer_unsupported(model, layer, inputs, f"{type(model).__name__}'s output layer")


def _layer_unsupported(model: nn.Module, layer: Any, inputs: Any, where: str) -> str:
    """Why the layer ``where`` names cannot be a chunked head's projection, given the
    step's ``inputs`` ("" if it can)."""
    what = type(model).__name__
    if not (isinstance(inputs, Mapping) and isinstance(inputs.get("labels"), Tensor)):
        return (f"{what} gets no labels, so it computes no loss of its own: give labels "
                f"in the inputs to let the plan chunk its loss head")
    if type(layer) is not nn.Linear:
        return (f"{where} is a {type(layer).__name__}, not a plain nn.Linear (an adapter, "
                f"a quantised layer): the chunked head runs nn.Linear's weight itself")
    if layer._forward_hooks or layer._forward_pre_hooks:
        return f"{where} has hooks, which the chunked head would bypass"
    return ""


_NOT_CAUSAL = "not the causal-LM loss: "  # how a refusal of the "hf" kind starts where
# the model may take its own cross_entropy (kind "ce")


def _hf_unsupported(model: nn.Module, lm_head: Any, inputs: Any) -> str:
    """Why a Hugging Face model's head cannot be chunked ("" if it can)."""
    what = type(model).__name__
    why = _layer_unsupported(model, lm_head, inputs, f"{what}.lm_head")
    if why:
        return why
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        # T5's and BART's loss_function resolves to ForCausalLMLoss, but their forward
        # takes its own cross-entropy of lm_head's output (plus BART's logit bias)
        return (f"{_NOT_CAUSAL}{what} is an encoder-decoder, whose forward takes its own "
                f"loss of lm_head's output, not Hugging Face's causal-LM loss")
    if not _forward_names(model, "loss_function"):
        # BART's, Whisper's, TrOCR's *ForCausalLM take nn.CrossEntropyLoss of
        # logits.view(-1, vocab_size) in their forward, unshifted: kind "ce" follows that
        return (f"{_NOT_CAUSAL}{what}'s forward does not call its loss_function (it takes "
                f"a loss of its own)")
    loss = getattr(model.loss_function, "__name__", "")
    if loss != "ForCausalLMLoss":
        return (f"{_NOT_CAUSAL}{what}'s loss is "
                f"{loss or type(model.loss_function).__name__}, not Hugging Face's "
                f"causal-LM loss (ForCausalLMLoss)")
    if "_loss_function" in vars(model):
        return f"{what} has a loss_function of its own set"
    return ""


def _forward_names(model: nn.Module, name: str) -> bool:
    """Whether the code of ``model``'s forward (under the decorators that wrap it with
    ``functools.wraps``) reads an attribute or global called ``name``; ``False`` where its
    code cannot be read."""
    forward = inspect.unwrap(type(model).forward)
    code = getattr(forward, "__code__", None)
    return code is not None and name in code.co_names


# NOTE [ Logit transforms ]
#     Some models change the logits between ``lm_head`` and the loss: Gemma 2 and 3
#     soft-cap them (``/ c``, ``tanh``, ``* c``), Cohere multiplies them by a scale,
#     Granite divides them (their configs name it: :data:`_LOGIT_TRANSFORMS`). Under a
#     chunked head ``lm_head`` returns the hidden states, so for such a model it returns
#     them as a :class:`_TracedLogits`: the same tensor, which records the elementwise ops
#     the model applies to it (a Python scalar times or over it, ``tanh``, ``float``)
#     instead of running them, and the loss runs the same ops, in the same order and
#     dtype, on each chunk's logits, taking their backward through a local graph
#     (``_core/head.py``). Anything else done to it (a slice, a view, a reduction, an op
#     with a tensor) marks it: the loss then refuses the step, naming the op, rather than
#     compute a loss of something the logits were not. Models whose config names no
#     transform get the plain tensor back, which ``torch.compile`` traces as any other.
class _TracedLogits(Tensor):
    """The hidden states ``lm_head`` passed on, standing for the logits of a model that
    transforms them (NOTE [ Logit transforms ])."""

    _root: Tensor  # the hidden states
    _ops: tuple[LogitOp, ...]
    # shared by every tensor traced from one call: "escaped", the first op that was not a
    # logit transform; "vocab", the layer's output features; "ce", the chunked
    # cross-entropy of a "ce" head (None elsewhere)
    _state: dict[str, Any]

    @staticmethod
    def of(root: Tensor, ops: tuple[LogitOp, ...], state: dict[str, Any]) -> _TracedLogits:
        out = root.as_subclass(_TracedLogits)
        out._root, out._ops, out._state = root, ops, state
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        traced = args[0] if args and isinstance(args[0], _TracedLogits) else None
        if traced is not None:
            op = _logit_op(func, args, kwargs)
            if op is not None:
                return _TracedLogits.of(traced._root, (*traced._ops, op), traced._state)
            rows = _as_rows(func, args, kwargs, traced)
            if rows is not None:
                return _TracedLogits.of(rows, traced._ops, traced._state)
            ce = traced._state.get("ce")
            if ce is not None and func is F.cross_entropy and not traced._state.get("escaped"):
                return ce(traced, *args[1:], **kwargs)
        name = _function_name(func)
        if name not in _METADATA:
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, _TracedLogits):
                    arg._state.setdefault("escaped", name)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _as_rows(func: Any, args: Any, kwargs: Any, traced: _TracedLogits) -> Tensor | None:
    """The hidden states as rows, where ``func`` flattens the logits to rows of the
    vocabulary (``logits.view(-1, V)``, ``reshape``; a model may write its size as the
    layer's or as ``logits.size(-1)``, which a traced tensor answers with the hidden
    states' width); else ``None``."""
    if _function_name(func) not in ("view", "reshape") or kwargs:
        return None
    shape = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    root = traced._root
    width = root.shape[-1]
    if len(shape) != 2 or shape[1] not in (width, traced._state.get("vocab")):
        return None
    if shape[0] not in (-1, root.numel() // width):
        return None
    return root.reshape(-1, width)


# what reading a traced tensor may do without changing anything the loss sees
_METADATA = frozenset({"shape", "size", "dtype", "device", "dim", "ndim", "requires_grad",
                       "is_floating_point", "grad_fn", "is_leaf", "layout", "__repr__",
                       "__format__", "numel"})


def _function_name(func: Any) -> str:
    name = str(getattr(func, "__name__", func))
    if name in ("__get__", "__set__"):  # a property: its own name
        name = str(getattr(getattr(func, "__self__", None), "__name__", name))
    return name


def _logit_op(func: Any, args: Any, kwargs: Any) -> LogitOp | None:
    """The :class:`LogitOp` ``func(*args, **kwargs)`` applies to its first argument, or
    ``None`` where it is not one."""
    name = _function_name(func)
    number = len(args) == 2 and isinstance(args[1], (int, float)) \
        and not isinstance(args[1], bool) and not kwargs
    if name in ("__mul__", "__rmul__", "mul") and number:
        return LogitOp("mul", float(args[1]))
    if name in ("__truediv__", "div") and number:
        return LogitOp("div", float(args[1]))
    if name in ("__add__", "__radd__", "add") and len(args) == 2 and not kwargs \
            and isinstance(args[1], Tensor) and not isinstance(args[1], _TracedLogits) \
            and args[1].numel() == args[0]._state.get("vocab") and args[1].shape[-1] == \
            args[1].numel():  # a bias over the vocabulary (BART's final_logits_bias)
        return LogitOp("add", tensor=args[1].reshape(-1))
    if name == "tanh" and len(args) == 1 and not kwargs:
        return LogitOp("tanh")
    if name == "float" and len(args) == 1 and not kwargs:
        return LogitOp("float")
    return None


class HeadNotFollowedError(RematError):
    """The model did something to its logits, or took a loss of them, that a chunked
    loss head cannot follow. ``what`` says what, without the advice the message ends
    with (a profile notes it and measures no head options)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}: plan with head='keep' (autoremat.plan(tape, ..., "
                         f"head='keep'))")
        self.what = what


def _escaped(op: str, where: str) -> HeadNotFollowedError:
    """The error for a model that ran ``op``, no logit transform, on ``where``."""
    return HeadNotFollowedError(
        f"the model ran {op!r} on {where}, which a chunked loss head cannot follow (it "
        f"follows a number times or over the logits, a bias, tanh, an upcast, flattening "
        f"to rows and cross_entropy)")


class _PassHidden:
    """``lm_head.forward`` under a chunked head: with gradients enabled (a training step)
    the hidden states, unchanged (as a :class:`_TracedLogits` where the model transforms
    its logits: ``traced``), for the chunked loss; without (evaluation, generation) the
    logits, as the plain layer computes them."""

    def __init__(self, lm_head: nn.Linear, traced: bool = False, ce: Any = None) -> None:
        self.lm_head = lm_head
        self.traced = traced or ce is not None
        self.ce = ce  # a "ce" head's chunked cross-entropy (_ChunkedCrossEntropy)
        self.last: Any = None  # weakref to the hidden states passed on last
        self.state: dict[str, Any] = {}  # of the _TracedLogits passed on last

    def __call__(self, hidden: Tensor) -> Tensor:
        if not torch.is_grad_enabled():
            self.last = None
            return nn.Linear.forward(self.lm_head, hidden)
        self.last = weakref.ref(hidden)
        self.state = {"vocab": self.lm_head.out_features, "ce": self.ce}
        return _TracedLogits.of(hidden, (), self.state) if self.traced else hidden

    def returned(self, tensor: Any) -> bool:
        """Whether ``tensor`` is what this passed on last (or the ops traced on it)."""
        if self.last is None:
            return False
        if isinstance(tensor, _TracedLogits):
            tensor = tensor._root
        return self.last() is tensor

    def __getstate__(self) -> dict[str, Any]:
        return {"lm_head": self.lm_head, "traced": self.traced, "ce": self.ce,
                "last": None, "state": {}}  # a weakref does not pickle


class _ChunkedCausalLMLoss:
    """``model.loss_function`` under a chunked head: Hugging Face's ``ForCausalLMLoss``
    of the hidden states ``lm_head`` passed on, over ``chunks`` chunks of tokens; of
    logits (a step without gradients), the model's own loss."""

    def __init__(self, lm_head: nn.Linear, passed: _PassHidden, chunks: int,
                 install: HeadInstall, own: Any) -> None:
        self.lm_head, self.passed, self.chunks, self.install = lm_head, passed, chunks, install
        self.own = own  # the model's own loss function

    def __call__(self, logits: Tensor, labels: Tensor, vocab_size: int,
                 num_items_in_batch: Tensor | int | None = None, ignore_index: int = -100,
                 shift_labels: Tensor | None = None, **kwargs: Any) -> Tensor:
        if self.passed.last is None:  # the plain layer ran: logits, not hidden states
            return self.own(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                            ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        escaped = self.passed.state.get("escaped")
        if escaped is not None:  # NOTE [ Logit transforms ]
            raise _escaped(escaped, "its logits before taking its loss")
        if not self.passed.returned(logits):
            raise HeadNotFollowedError(
                "the model changed what lm_head returned before taking its loss (a "
                "soft-cap or a scale its config does not name, a slice), which a chunked "
                "loss head cannot follow")
        ops: tuple[LogitOp, ...] = ()
        if isinstance(logits, _TracedLogits):
            ops, logits = logits._ops, logits._root
        if shift_labels is None:  # as ForCausalLMLoss: tokens < n predict n
            padded = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = padded[..., 1:]
        self.install.calls += 1
        return linear_cross_entropy(
            logits, self.lm_head.weight, shift_labels.to(logits.device),
            bias=self.lm_head.bias, chunks=self.chunks, ignore_index=ignore_index,
            num_items_in_batch=num_items_in_batch, upcast=True, ops=ops,
            backend=self.install.backend)


class _ChunkedCrossEntropy:
    """The ``cross_entropy`` a "ce" head's model takes of its output layer's result in
    its own forward, over ``chunks`` chunks of tokens (NOTE [ Which heads can be
    chunked ])."""

    def __init__(self, layer: nn.Linear, chunks: int, install: HeadInstall) -> None:
        self.layer, self.chunks, self.install = layer, chunks, install

    def __call__(self, logits: _TracedLogits, target: Tensor, weight: Tensor | None = None,
                 size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
                 reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
        odd = [f"{k}={v!r}" for k, v, plain in (
            ("weight", weight, None), ("size_average", size_average, None),
            ("reduce", reduce, None), ("label_smoothing", label_smoothing, 0.0))
            if v is not plain and v != plain]
        if reduction not in ("mean", "sum"):
            odd.append(f"reduction={reduction!r}")
        rows = logits._root
        if odd or rows.dim() != 2 or tuple(target.shape) != tuple(rows.shape[:1]):
            raise HeadNotFollowedError(
                f"the model takes cross_entropy of its loss head's logits "
                f"{'with ' + ', '.join(odd) if odd else 'not as rows of tokens'}, which a "
                f"chunked loss head does not compute")
        self.install.calls += 1
        return linear_cross_entropy(
            rows, self.layer.weight, target.to(rows.device), bias=self.layer.bias,
            chunks=self.chunks, ignore_index=ignore_index,
            num_items_in_batch=1 if reduction == "sum" else None, ops=logits._ops,
            backend=self.install.backend)


class _DropLogits:
    """Forward hook of the model under a chunked head: its output's ``logits`` (the
    hidden states ``lm_head`` passed on) becomes ``None``."""

    def __init__(self, passed: _PassHidden) -> None:
        self.passed = passed

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, Mapping) and self.passed.returned(output.get("logits")):
            cast(Any, output)["logits"] = None  # a ModelOutput: an OrderedDict
        elif isinstance(output, tuple):
            output = tuple(None if self.passed.returned(t) else t for t in output)
        self.passed.last = None
        escaped = self.passed.state.get("escaped")
        if escaped is not None:  # NOTE [ Logit transforms ]
            raise _escaped(escaped, f"the output of {type(module).__name__}'s loss head "
                                    f"in a training step")
        return output


class _CountLabelled:
    """Forward pre-hook of an :class:`~autoremat.LMHead`: counts its calls with labels."""

    def __init__(self, install: HeadInstall) -> None:
        self.install = install

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        labels = args[1] if len(args) > 1 else kwargs.get("labels")
        if labels is not None:
            self.install.calls += 1


@dataclass
class HeadInstall:
    """A chunked head installed on a model; :func:`uninstall_head` undoes it. ``calls``
    counts the losses it took (a step whose head never ran chunked measured nothing)."""

    site: HeadSite
    chunks: int
    owner: nn.Module  # the model (for a Hugging Face head: the one that takes its loss)
    module: nn.Module  # its lm_head, or its LMHead
    handles: list[Any]
    calls: int = 0
    backend: str = ""  # whose kernel (NOTE [ Head backends ] in _core/head.py)
    passed: _PassHidden | None = None  # what lm_head returns (a Hugging Face head)

    def escaped(self) -> str | None:
        """The first op the model ran on its head's logits that the chunked head cannot
        follow, in the last training step (NOTE [ Logit transforms ]); else ``None``."""
        return None if self.passed is None else self.passed.state.get("escaped")


def install_head(model: nn.Module, site: HeadSite, chunks: int,
                 backend: str = "") -> HeadInstall:
    """Run the head at ``site`` over ``chunks`` chunks of tokens, by ``backend``'s kernel
    (NOTE [ Which heads can be chunked ], NOTE [ Head backends ])."""
    module = model.get_submodule(site.name)
    weight = getattr(module, "weight", None)
    if backend and isinstance(weight, Tensor):
        why = backend_unavailable(backend, weight.device,
                                  bias=getattr(module, "bias", None) is not None)
        if why:
            raise RematError(f"the plan computes the loss head with {backend!r}, which "
                             f"cannot run here: {why}; plan on this machine (its profile "
                             f"measures the kernels it can run)")
    install = HeadInstall(site, chunks, model, module, [], backend=backend)
    if site.kind == "module":
        if not isinstance(module, LMHead):
            raise RematError(f"{site.name!r} is a {type(module).__name__}, not the LMHead "
                             f"the plan chunks; was the model changed since it was planned?")
        module.chunks, module.backend = chunks, backend
        install.handles.append(module.register_forward_pre_hook(
            _CountLabelled(install), with_kwargs=True))
        return install
    if site.kind == "ce":
        why = _ce_unsupported(model, module, {"labels": torch.empty(0)})
        if why:
            raise RematError(f"cannot chunk the loss head: {why}; plan with head='keep'")
        layer = cast(nn.Linear, module)
        passed = _PassHidden(layer, ce=_ChunkedCrossEntropy(layer, chunks, install))
        install.passed = passed
        module.forward = passed  # type: ignore[method-assign]
        install.handles.append(model.register_forward_hook(_DropLogits(passed)))
        return install
    owner = model.get_submodule(site.name.rpartition(".")[0])  # (a wrapper's model)
    install.owner = owner
    why = _hf_unsupported(owner, module, {"labels": torch.empty(0)})
    if why:
        raise RematError(f"cannot chunk the loss head: {why}; plan with head='keep'")
    linear = cast(nn.Linear, module)
    passed = _PassHidden(linear, traced=bool(logit_transform(owner)))
    install.passed = passed
    own = owner.loss_function
    module.forward = passed  # type: ignore[method-assign]
    # the model's loss_function property returns _loss_function when one is set
    vars(owner)["_loss_function"] = _ChunkedCausalLMLoss(linear, passed, chunks, install, own)
    install.handles.append(owner.register_forward_hook(_DropLogits(passed)))
    return install


def uninstall_head(install: HeadInstall) -> None:
    """Undo :func:`install_head`."""
    for handle in install.handles:
        handle.remove()
    if install.site.kind == "module":
        install.module.chunks, install.module.backend = None, ""  # type: ignore[assignment]
        return
    vars(install.module).pop("forward", None)
    vars(install.owner).pop("_loss_function", None)


@contextmanager
def head_installed(model: nn.Module, site: HeadSite | None, chunks: int | None,
                   backend: str = "") -> Iterator[HeadInstall | None]:
    """:func:`install_head` for the block (nothing when ``site`` or ``chunks`` is None)."""
    if site is None or chunks is None:
        yield None
        return
    install = install_head(model, site, chunks, backend)
    try:
        yield install
    except Exception as exc:
        # NOTE [ Logit transforms ]: after an op the head cannot follow, the model
        # computes on the hidden states it took for logits, and may fail on them
        # (ProphetNet's nll_loss of its n-gram streams: "Target 83 is out of bounds")
        # before its loss or output would refuse the step: that op is the cause
        escaped = install.escaped()
        if escaped is None or isinstance(exc, HeadNotFollowedError):
            raise
        raise _escaped(escaped, "its loss head's logits") from exc
    finally:
        uninstall_head(install)
