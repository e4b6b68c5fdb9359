"""The conditions a training step runs under, as a tape records them and a plan checks.

NOTE [ The conditions a step is measured under ]
    A tape's figures hold for the step it measured; a loop that runs the model under
    other conditions holds other tensors, and a plan made from the tape may go over its
    budget (up to 2x was seen) with nothing said. The tape therefore records, and the
    plan carries, what else shaped the step beyond its inputs, device and mode:
    * ``autocast``: the autocast regions the first block runs under (``"cpu:bfloat16"``;
      ``""``: none; a forward may enter autocast itself, as Accelerate's mixed precision
      does). Under autocast every matmul saves a cast copy of its weight: a loop under
      autocast of a plan profiled without (or the other way round) holds other bytes.
      Checked at the first block of each forward with gradients (warned once).
    * ``dtypes``: the floating dtypes of the model's parameters (``"float32"``). Checked
      at apply (each block's parameters, ``BlockDecision.params``) and at each forward
      with gradients (a model cast with ``.double()`` after apply; warned once).
    * ``loss``: which loss the step took (``loss_fn``, ``output.loss``, or the default sum
      of a tensor of the output, named with its shape). Said in the tape's and the
      plan's tables; a profile that sums logits (an output ``(*S, V)`` over an integer
      input ``S``: token ids) without ``loss_fn`` is warned about: a loop's
      cross-entropy holds its softmax besides (41.7 MB against a 22.8 MB budget).
    * ``structure``: how many modules each parent of a block holds (``"blocks=4"``): a
      plan of a 4-layer model applied to a 6-layer one of the same class (the blocks it
      names exist, the two it does not run kept) is refused at apply; a block appended or
      replaced after apply is warned about at the next forward with gradients.
    * ``hooks``: the forward hooks (pre and post) users registered on each block, and
      global ones, by name (``"blocks.0=train.tap"``; the hooks of torch, autoremat and
      the training libraries are theirs, not the user's, and left out). What a hook keeps
      or makes is part of the step: hooks registered between profile and apply, which the
      after-apply check does not see (it knows the hooks there at apply), measured 1.4-3.9%
      over the plan on a held-out MLP (an input-rescaling pre-hook). Checked at apply
      (warned).
    * ``cached``: whether the step ran under ``torch.nn.utils.parametrize.cached()``, on a
      model with parametrized modules (weight norm): the forward computes each
      parametrized weight once and holds it, and a recompute in backward (outside the
      cache) computes it again; a loop under ``cached()`` of a plan profiled without
      measured 6.9-14% over its budget (a held-out weight-normed MLP). A step measured
      under it runs as a loop that enters ``cached()`` for its forward does
      (:func:`loop_parametrize_cache`: the cache empty at the forward, emptied after the
      loss), where profile had raised "Trying to backward through the graph a second
      time" at its second step. Checked at the first block of each forward with
      gradients (warned once).
    * calls: every block runs once per forward (``profile`` refuses others); a block
      that runs more often (a keyword that makes blocks run twice) is warned about when
      the forward returns.
    The autocast cache is also part of the step: a loop that enters ``torch.autocast`` for
    each forward starts each iteration with an empty weight-cast cache, and frees it when
    the region exits (before backward), while the profile's steps all ran inside one
    region, the casts of one step still cached in the next (measured 8-15% under the
    loop's peak). Every step autoremat measures therefore runs as the loop does
    (:func:`loop_autocast`): the cache emptied before the forward and after the loss,
    and backward outside the region.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from autoremat._core.calls import call_of

__all__ = ["autocast_devices", "autocast_state", "conditions_line", "drop_forward_casts",
           "float_dtypes", "hook_name", "loop_autocast", "loop_parametrize_cache",
           "parametrize_cached", "structure_of", "user_hooks"]

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def autocast_devices() -> list[str]:
    """The device types whose autocast is enabled now."""
    enabled = []
    for device in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(device):
                enabled.append(device)
        except RuntimeError:  # a device type this build does not know
            continue
    return enabled


def autocast_state() -> str:
    """The autocast regions active now, e.g. ``"cpu:bfloat16"`` (``""``: none)."""
    return ",".join(f"{device}:{str(torch.get_autocast_dtype(device)).removeprefix('torch.')}"
                    for device in autocast_devices())


def float_dtypes(params: Iterable[torch.Tensor]) -> str:
    """The floating dtypes of ``params`` (a model's ``parameters()``), sorted, e.g.
    ``"float32"`` or ``"bfloat16,float32"``."""
    return ",".join(sorted({str(p.dtype).removeprefix("torch.") for p in params
                            if p.is_floating_point()}))


def structure_of(model: nn.Module, names: list[str]) -> str:
    """How many modules each parent of the blocks ``names`` holds, e.g. ``"blocks=4"``
    (``"=N"``: the model itself holds them)."""
    parents: dict[str, int] = {}
    for name in names:
        parent = name.rpartition(".")[0]
        if parent not in parents:
            parents[parent] = len(model.get_submodule(parent)._modules)
    return ",".join(f"{parent}={count}" for parent, count in parents.items())


# the libraries whose hooks are theirs, not the user's: FSDP2 and DeepSpeed gather
# parameters in hooks, and autoremat installs its own
_FRAMEWORKS = ("torch", "autoremat", "deepspeed", "accelerate", "transformers", "peft",
               "lightning", "pytorch_lightning", "trl")


def hook_name(hook: Any) -> str | None:
    """``hook``'s qualified name, or None where a framework installed it."""
    fn = hook.func if isinstance(hook, functools.partial) else hook
    module = getattr(fn, "__module__", None) or ""
    if module.split(".")[0] in _FRAMEWORKS:
        return None
    return f"{module}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def user_hooks(model: nn.Module, names: list[str]) -> str:
    """The forward hooks (pre and post) users registered on the blocks ``names``, and the
    global ones (``"*"``), as sorted ``"<block>=<hook>"`` entries joined by ``";"``."""
    from torch.nn.modules import module as torch_module
    places = [(layer, model.get_submodule(layer))
              for layer in dict.fromkeys(call_of(name)[0] for name in names)]
    entries = []
    for name, hooks in [*((name, (m._forward_pre_hooks, m._forward_hooks)) for name, m in places),
                        ("*", (torch_module._global_forward_pre_hooks,
                               torch_module._global_forward_hooks))]:
        entries += [f"{name}={found}" for d in hooks for hook in d.values()
                    if (found := hook_name(hook)) is not None]
    return ";".join(sorted(entries))


def drop_forward_casts() -> None:
    """Empty autocast's cache of weight casts where an autocast is on: called when a
    forward with gradients returns, by a measured step and a planned model alike (NOTE
    [ Backward inside autocast ] in _mechanism/wrap.py); what autograd saved of them
    stays."""
    if autocast_devices():
        torch.clear_autocast_cache()


@contextmanager
def loop_autocast() -> Iterator[Any]:
    """Run a step as a loop that enters autocast for the forward runs it (NOTE [ The
    conditions a step is measured under ]): yields a function to call after the loss,
    which leaves the autocast regions (the cache emptied, autocast off) until the step
    ends. Without autocast, a no-op."""
    devices = autocast_devices()
    if not devices:
        yield lambda: None
        return
    torch.clear_autocast_cache()
    left: list[int] = []

    def leave() -> None:
        depth = 0
        while torch.autocast_decrement_nesting() > 0:
            depth += 1
        left.append(depth + 1)
        torch.clear_autocast_cache()
        for device in devices:
            torch.set_autocast_enabled(device, False)

    try:
        yield leave
    finally:
        if left:
            for device in devices:
                torch.set_autocast_enabled(device, True)
            for _ in range(left[0]):
                torch.autocast_increment_nesting()
        torch.clear_autocast_cache()


def parametrize_cached(blocks: Iterable[nn.Module]) -> bool:
    """Whether ``torch.nn.utils.parametrize.cached()`` is on and a module in ``blocks``
    is parametrized, whose weights it then caches."""
    from torch.nn.utils import parametrize
    return bool(parametrize._cache_enabled) and any(
        parametrize.is_parametrized(m) for block in blocks for m in block.modules())


@contextmanager
def loop_parametrize_cache() -> Iterator[Any]:
    """Run a step as a loop that enters ``parametrize.cached()`` for its forward does
    (NOTE [ The conditions a step is measured under ]): under ``cached()``, the cache
    empty at the forward; yields a function to call after the loss, which leaves it
    (emptied, and off for the backward, whose recomputes make the weights anew; what
    autograd saved of them stays); the caller's cache, entries included, back
    afterwards. Outside ``cached()``, a no-op."""
    from torch.nn.utils import parametrize
    enabled = parametrize._cache_enabled
    if not enabled:
        yield lambda: None
        return
    found = dict(parametrize._cache)
    parametrize._cache.clear()

    def leave() -> None:
        parametrize._cache.clear()
        parametrize._cache_enabled = 0

    try:
        yield leave
    finally:
        parametrize._cache_enabled = enabled
        parametrize._cache.clear()
        parametrize._cache.update(found)


def conditions_line(loss: str, autocast: str, dtypes: str) -> str:
    """The line of a tape's or a plan's table saying what its step ran under ("" when
    nothing was recorded)."""
    if not dtypes:
        return ""
    return (f"measured with loss {loss or 'not recorded'}; "
            + (f"under autocast {autocast}" if autocast else "without autocast")
            + f"; parameters {dtypes}\n")

