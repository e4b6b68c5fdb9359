"""What recomputation costs, in FLOP-equivalents, from a block's op statistics.

NOTE [ Why not plain FLOPs, and why not measured times ]
    FLOPs count matmuls and convs but not the memory-bound ops (norms, activations,
    dropout) a recompute also re-runs, nor the per-op overhead of eager dispatch and of
    selective checkpointing's policy, which made SAC on an MLP chain 1.21x slower here
    at "zero" extra FLOPs. Measured times would capture all that but are noisy: two
    identical blocks would get different costs and the plan would flip between runs.
    So the cost is a fixed linear model of exact quantities: FLOPs, plus bytes the
    re-run ops create times a per-device rate, plus a per-op overhead. The rates are
    rough for each device type and only ever rank plans; every figure autoremat reports
    is FLOPs or measured time, never this cost.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from autoremat._core.errors import RematError
from autoremat._measure.ops import OpRecord, OpStats

__all__ = ["CostModel", "cost_model_for", "head_cost", "keep_set_cost", "offload_cost",
           "op_cost", "recompute_cost"]


@dataclass(frozen=True)
class CostModel:
    """Rates that turn op statistics into FLOP-equivalents."""

    flops_per_byte: float  # memory-bound work per byte an op creates
    flops_per_random_byte: float  # the same for random ops (RNG is slower than arithmetic)
    flops_per_op: float  # eager dispatch overhead of re-running one op
    flops_per_sac_op: float  # selective checkpointing: its dispatch modes see every op
    flops_per_second: float  # matmul throughput: turns a copy's exposed time into FLOPs


# ~100 GFLOP/s matmul, ~5 GB/s elementwise, ~10 us per op on a small multi-core CPU;
# ~300 TFLOP/s, ~2 TB/s, ~10 us per op on a data-centre GPU.
# Selective recompute, per op of the block: its two dispatch modes take ~9 us here
# (selective.py), but measured whole steps cost more: at the gpt2 zoo defaults, Megatron's
# policy on every block costs 0.8x of whole-block recompute (benchmarks/
# selective_overhead.md), which 30 us per op reproduces and 9 us (0.55x) does not.
_MODELS = {
    "cpu": CostModel(20.0, 80.0, 1e6, 3e6, 1e11),
    "cuda": CostModel(150.0, 150.0, 3e9, 6e9, 3e14),
}
# Under torch.compile there is no per-op dispatch (one kernel launch per fused group,
# and the SAC policy runs once, at trace time), and memory-bound ops fuse into their
# neighbours, reading and writing about a quarter of the bytes eager does.
_COMPILED = {
    "cpu": CostModel(5.0, 20.0, 0.0, 0.0, 1e11),
    "cuda": CostModel(40.0, 40.0, 0.0, 0.0, 3e14),
}


def cost_model_for(device: str, *, compiled: bool = False) -> CostModel:
    """The cost model for a device string such as ``"cpu"`` or ``"cuda:0"``, eager or
    (``compiled``) under ``torch.compile``.

    Raises:
        RematError: autoremat has no rates for the device type. There is no fallback:
            ``meta`` (where :func:`autoremat.estimate` runs) is no device a plan runs on,
            and the CPU and CUDA rates differ by orders of magnitude, so a guess would
            rank plans by another machine's costs without saying so.
    """
    kind = device.split(":")[0]
    if kind not in _MODELS:
        hint = (" A step measured on meta is for another device: give it as "
                "profile(..., device='cuda') or estimate(..., device=...)."
                if kind == "meta" else
                " To plan with the rates of a device autoremat knows, give it as "
                "profile(..., device='cuda' or 'cpu').")
        raise RematError(f"no recompute cost rates for device {device!r}; autoremat has "
                         f"them for {', '.join(sorted(_MODELS))}.{hint}")
    return (_COMPILED if compiled else _MODELS)[kind]


def recompute_cost(stats: dict[str, OpStats], fwd_flops: int, model: CostModel,
                   saved: Iterable[str] | None = None) -> int:
    """FLOP-equivalents of re-running a block's forward in backward.

    Args:
        stats: the block's forward op statistics by kind (empty: cost = ``fwd_flops``).
        saved: op kinds kept by selective checkpointing (``None``: whole-block recompute).
    """
    if not stats:
        return fwd_flops
    keep = set(saved or ())
    total = 0.0
    for kind, s in stats.items():
        if kind in keep:
            continue
        # Whole-block recompute draws random numbers again; selective recompute copies
        # the kept Bernoulli draws back (NOTE [ Our own selective contexts, and random bits ]).
        drawn = kind == "dropout" and saved is None
        rate = model.flops_per_random_byte if drawn else model.flops_per_byte
        total += s.flops + rate * s.out_bytes + model.flops_per_op * s.count
    if saved is not None:
        total += model.flops_per_sac_op * sum(s.count for s in stats.values())
    return int(total)


def op_cost(op: OpRecord, model: CostModel) -> float:
    """FLOP-equivalents of re-running one op under selective recompute (a random draw is
    copied back from the kept one, so it costs as memory, not as drawing)."""
    return op.flops + model.flops_per_byte * op.out_bytes + model.flops_per_op


def keep_set_cost(ops: Sequence[OpRecord], keep: Collection[int], skip: Collection[int],
                  model: CostModel) -> int:
    """FLOP-equivalents of a block's recompute under a keep-set: every op not kept or
    skipped re-runs, and the selective dispatch modes see every op."""
    total = sum(op_cost(o, model) for i, o in enumerate(ops) if i not in keep and i not in skip)
    return int(total + model.flops_per_sac_op * len(ops))


def offload_cost(nbytes: int, tensors: int, fwd_flops: int, bwd_flops: int,
                 bandwidth: float, model: CostModel) -> int:
    """FLOP-equivalents of offloading a block's saved tensors.

    NOTE [ What offload costs ]
        Each tensor is packed in forward and unpacked in backward by Python hooks (one
        op's dispatch each). The copies run on a side stream, so only the part of a copy
        that outlasts the compute it overlaps shows in the step: the copy to host
        overlaps the block's own forward (rather, the forward after it, which is as
        long for a chain of like blocks), the copy back the backward of the next block
        (likewise about the block's own backward). So each way costs
        ``max(0, bytes / bandwidth - compute time)``, with the compute time from FLOPs
        at the device's matmul rate (NOTE [ Why not plain FLOPs, and why not measured
        times ]). Copies of consecutive offloaded blocks share one link; this model
        treats them one at a time, so it is optimistic when the link is the bottleneck
        over several blocks. ``bandwidth`` 0: the host is the device, nothing is copied.
    """
    hooks = 2.0 * model.flops_per_op * tensors
    if bandwidth <= 0:
        return int(hooks)
    copy = nbytes / bandwidth
    exposed = (max(0.0, copy - fwd_flops / model.flops_per_second)
               + max(0.0, copy - bwd_flops / model.flops_per_second))
    return int(hooks + exposed * model.flops_per_second)


# ops a chunked head adds per chunk over the plain head: slicing, the matmuls into their
# buffers, the log-softmax, softmax and gradient in place, the scaled products
_HEAD_OPS_PER_CHUNK = 12


def head_cost(chunks: int, weight_bytes: int, model: CostModel, logits_bytes: int = 0) -> int:
    """FLOP-equivalents a chunked loss head costs over the plain one where it could not be
    timed (NOTE [ What a head option costs ] in ``_profile/options.py``): the same FLOPs,
    a few more ops per chunk, the weight gradient read once more per chunk after the first
    (it is accumulated), and two passes fewer over the float32 logits (``logits_bytes``:
    NOTE [ The softmax gradient in place ] in ``_core/head.py``)."""
    return int(chunks * _HEAD_OPS_PER_CHUNK * model.flops_per_op
               + (chunks - 1) * weight_bytes * model.flops_per_byte
               - 2 * logits_bytes * model.flops_per_byte)
