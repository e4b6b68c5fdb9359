"""What PyTorch's data-parallel engines do to a module, as ``apply`` needs to know it.

NOTE [ Plans under DDP and FSDP2 ]
    ``DistributedDataParallel(model)`` is a wrapper module: the model is its ``.module``
    and every name gains a ``module.`` prefix. ``apply`` looks through it (and through
    ``torch.compile``'s wrapper, in any nesting) to the model the plan names, so a plan
    goes on before or after wrapping alike. DDP's gradient hooks fire when autograd
    accumulates a parameter's gradient, which a non-reentrant checkpoint does once, as
    usual; no ``find_unused_parameters`` or ``static_graph`` is needed.

    ``fully_shard(module)`` (FSDP2) changes the module's class in place to a subclass
    ``FSDP<Name>(FSDPModule, <Name>)`` and registers forward hooks that all-gather its
    parameters before its forward and free them after (and again around its backward).
    Names stay as they were, so a plan finds its blocks; :func:`model_class_name` reads
    the class under the ``FSDP`` one. A checkpointed block runs its forward inside those
    hooks (our wrapper is the instance's ``forward``, which ``__call__`` runs between its
    hooks), and its recompute runs in its backward after FSDP's pre-backward all-gather:
    the order torchtitan gets with ``checkpoint_wrapper`` before ``fully_shard``. Either
    order of ``apply`` and ``fully_shard`` works.

    A multi-block segment does not compose with FSDP2: its recompute replays the blocks'
    own ``forward`` outside their hooks, when all but the last block's parameters are
    sharded, and FSDP's hooks also hand each block new tensor objects as inputs, which
    breaks the chaining the segment records (NOTE [ Segments without a wrapper module ]).
    ``plan(..., shards=N)`` makes segments of one block; a segment met on an FSDP module
    is refused with that advice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from autoremat._mechanism.compiled import uncompiled

__all__ = ["is_fsdp", "model_class_name", "unwrapped"]

if dist.is_available():
    from torch.distributed.fsdp import FSDPModule
    _FSDP: tuple[type, ...] = (FSDPModule,)
else:  # a torch built without distributed: no module can be sharded
    _FSDP = ()


def unwrapped(model: nn.Module) -> tuple[nn.Module, bool]:
    """The model inside ``DistributedDataParallel`` and ``torch.compile`` wrappers (any
    nesting), and whether one of them was ``torch.compile``'s."""
    inner, compiled = model, False
    while True:
        if isinstance(inner, DistributedDataParallel):
            inner = inner.module
        elif isinstance(inner, torch._dynamo.eval_frame.OptimizedModule):
            inner, compiled = uncompiled(inner), True
        else:
            return inner, compiled


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) was applied to ``module``."""
    return isinstance(module, _FSDP)


def model_class_name(model: nn.Module) -> str:
    """The name of the model's own class: under ``fully_shard``'s ``FSDP<Name>``, the
    ``<Name>``."""
    if is_fsdp(model):
        for cls in type(model).__mro__[1:]:
            if not issubclass(cls, _FSDP):
                return cls.__name__
    return type(model).__name__
