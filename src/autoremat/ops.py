"""Op kinds, and a per-op recorder used by ``profile`` for selective-recompute costing."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from .flops import FlopCounter

__all__ = ["OpRecorder", "OpStats", "is_random_op", "op_kind"]

_KINDS = (
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention")),
    ("bmm", ("aten.bmm", "aten.baddbmm")),  # activation x activation: attention cores
    ("matmul", ("aten.mm", "aten.addmm", "aten.matmul", "aten.linear", "aten._int_mm")),
    ("conv", ("convolution", "conv")),
    ("norm", ("layer_norm", "batch_norm", "group_norm", "rms_norm", "_native_batch_norm")),
    ("dropout", ("dropout", "bernoulli")),
    ("softmax", ("softmax",)),
    ("embedding", ("embedding",)),
    ("loss", ("nll_loss", "cross_entropy")),
    ("copy", ("clone", "_to_copy", "copy", "cat", "stack", "contiguous")),
)
_RANDOM = ("dropout", "bernoulli", "rand", "normal", "multinomial", "uniform_", "exponential")


def op_kind(op: str) -> str:
    """Coarse kind of an ATen op name: attention (fused kernels), bmm, matmul, conv, norm,
    dropout, softmax, embedding, loss, copy or pointwise.

    Example:
        >>> op_kind("aten.addmm.default"), op_kind("aten.bmm.default")
        ('matmul', 'bmm')
    """
    for kind, needles in _KINDS:
        if any(n in op for n in needles):
            return kind
    return "pointwise"


def is_random_op(op: str) -> bool:
    """Whether the op draws random numbers (its recompute needs the RNG state restored)."""
    return any(r in op for r in _RANDOM)


@dataclass(frozen=True)
class OpStats:
    """Forward ops of one kind inside one block."""

    count: int  # ops dispatched (views included)
    flops: int  # their FLOPs
    out_bytes: int  # bytes of the storages they create (views create none; random ops
    # count the bytes they draw, in place or not)
    ms: float  # their time, measured op by op (inflated a little by the measuring)


class OpRecorder(FlopCounter):
    """FLOPs by label and phase, plus per-kind forward stats by label."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: dict[str, dict[str, list[float]]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if torch._C._current_graph_task_id() != -1 or self.label == "<outside>":
            return super().__torch_dispatch__(func, types, args, kwargs)
        before = self.total
        flat_in = tree_flatten((args, kwargs or {}))[0]
        inputs = {t.untyped_storage()._cdata for t in flat_in if isinstance(t, torch.Tensor)}
        start = time.perf_counter()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        elapsed = (time.perf_counter() - start) * 1e3
        created = 0
        random = is_random_op(str(func))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st._cdata not in inputs:
                    created += st.nbytes()
                    inputs.add(st._cdata)
                elif random:  # an in-place draw (CPU dropout's bernoulli_): its bytes cost
                    created += t.nbytes
        row = self.stats.setdefault(self.label, {}).setdefault(op_kind(str(func)),
                                                               [0, 0, 0, 0.0])
        row[0] += 1
        row[1] += self.total - before
        row[2] += created
        row[3] += elapsed
        return out

    def block_stats(self, label: str) -> dict[str, OpStats]:
        rows = self.stats.get(label, {})
        return {k: OpStats(int(r[0]), int(r[1]), int(r[2]), round(float(r[3]), 4))
                for k, r in sorted(rows.items())}
