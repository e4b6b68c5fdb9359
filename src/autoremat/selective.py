"""Selective recompute inside a block: save the outputs of some op kinds, recompute the rest.

NOTE [ Save-sets by op kind ]
    Following Korthikanti et al. (Megatron-LM, 2022), a block's compute-heavy ops
    (matmul, attention, conv) are worth saving and its memory-heavy, compute-light ops
    (norms, activations, dropout, elementwise) worth recomputing. A *save-set* names the
    op kinds whose outputs stay saved (``op_kind`` in ``profile.py``); the mechanism is
    PyTorch's selective activation checkpointing (``create_selective_checkpoint_contexts``).
    Random ops (dropout) are never saved: they are recomputed from the restored RNG
    state, so they draw the same mask. Views are never saved: they follow their base.
    The planner considers every non-empty subset of the compute kinds a block has.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from functools import partial
from typing import Any

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .errors import RematError
from .ops import is_random_op, op_kind
from .wrap import ContextFn

__all__ = ["MEGATRON", "SAVEABLE_KINDS", "save_set_name", "save_sets", "selective_context"]

SAVEABLE_KINDS = ("attention", "bmm", "conv", "matmul")  # compute-heavy: worth keeping
# strategy="selective": Megatron-LM's policy. Save what has weights (linear, conv) and
# fused attention kernels; recompute the attention core built from bmm/softmax/dropout.
MEGATRON = ("attention", "conv", "matmul")


def _policy(save: frozenset[str], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    name = str(op)
    if is_random_op(name) or getattr(op, "is_view", False):
        return CheckpointPolicy.PREFER_RECOMPUTE
    if op_kind(name) in save:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context(save_ops: Iterable[str]) -> ContextFn:
    """A ``context_fn`` for ``torch.utils.checkpoint`` saving the outputs of ``save_ops``."""
    save = frozenset(save_ops)
    unknown = save - set(SAVEABLE_KINDS)
    if unknown:
        raise RematError(f"cannot save op kinds {sorted(unknown)}; selective plans save a "
                         f"subset of {list(SAVEABLE_KINDS)}")
    return partial(create_selective_checkpoint_contexts, partial(_policy, save))


def save_sets(kinds_present: Iterable[str]) -> list[tuple[str, ...]]:
    """Every non-empty subset of the saveable kinds present in a block, largest first."""
    present = sorted(set(kinds_present) & set(SAVEABLE_KINDS))
    out: list[tuple[str, ...]] = []
    for size in range(len(present), 0, -1):
        out.extend(itertools.combinations(present, size))
    return out


def save_set_name(save: Iterable[str]) -> str:
    return "+".join(sorted(save))
