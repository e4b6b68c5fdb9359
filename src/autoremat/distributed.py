"""Plans in a distributed run (DDP, FSDP2): plan once, broadcast, apply on every rank.

Every rank must recompute the same blocks (NOTE [ Every rank applies one plan ] in
``_apply.py``), so one rank profiles and plans and the others receive its plan::

    import torch.distributed as dist
    import autoremat
    from autoremat.distributed import broadcast_plan

    dist.init_process_group(...)
    model, batch = build_model(), next(batches)  # the plain model, this rank's batch
    plan = None
    if dist.get_rank() == 0:
        tape = autoremat.profile(model, batch)
        plan = autoremat.plan(tape, max_memory="70GiB", optimizer="adamw",
                              shards=dist.get_world_size())  # shards: FSDP2 only
    plan = broadcast_plan(plan)          # every rank: rank 0's plan
    autoremat.apply(model, plan)         # every rank (a collective: it checks the plans)
    for block in model.blocks:           # then FSDP2 (or DDP(model)), or before apply
        fully_shard(block)
    fully_shard(model)

``apply`` goes on before or after ``DistributedDataParallel`` / ``fully_shard``
(NOTE [ Plans under DDP and FSDP2 ] in ``_mechanism/engines.py``). Profile the plain
model, before wrapping it, on the batch one rank sees.
"""

from __future__ import annotations

import torch.distributed as dist

from autoremat._core.errors import RematError
from autoremat._core.ranks import rank_and_size
from autoremat._plan.plan import Plan

__all__ = ["broadcast_plan"]

_ERROR = "autoremat-error:"  # what rank src sends instead of a plan it does not have


def broadcast_plan(plan: Plan | None, src: int = 0, group: dist.ProcessGroup | None = None
                   ) -> Plan:
    """Rank ``src``'s plan, on every rank of ``group``; every rank must call it.

    The plan travels as its JSON (``Plan.to_json``), never pickled, and each receiving
    rank loads it with ``Plan.from_json``. Outside a distributed run (``torch.distributed``
    not initialized, or one rank) it returns ``plan`` itself.

    Args:
        plan: on rank ``src``, the plan to send; on the others, ignored (pass ``None``).
        src: the global rank that made the plan.
        group: the process group (``None``: the default group, whose timeout applies
            while the others wait for ``src`` to finish planning).

    Returns:
        The plan, equal on every rank.

    Raises:
        RematError: rank ``src`` had no :class:`Plan` to send (raised on every rank, so
            none waits for a plan that never comes).

    Example:
        >>> import autoremat
        >>> model, inputs = autoremat.zoo.build("mlp", widths=(64,) * 3, batch_size=8)
        >>> p = autoremat.plan(autoremat.profile(model, inputs), strategy="every:2")
        >>> broadcast_plan(p) is p  # one process: nothing to send
        True
    """
    rank, size = rank_and_size()
    if size == 1:
        if not isinstance(plan, Plan):
            raise RematError(f"broadcast_plan() needs a Plan from autoremat.plan() in a run of "
                             f"one process, got {type(plan).__name__}")
        return plan
    message: list[object] = [None]
    if rank == src:
        message[0] = plan.to_json() if isinstance(plan, Plan) else (
            f"{_ERROR}broadcast_plan() on rank {src} (src) needs a Plan from "
            f"autoremat.plan(), got {type(plan).__name__}; make the plan on rank {src} and "
            "pass None on the others")
    dist.broadcast_object_list(message, src=src, group=group)
    text = message[0]
    if not isinstance(text, str):
        raise RematError(f"broadcast_plan() received {type(text).__name__} from rank {src}, "
                         "not a plan's JSON; call broadcast_plan on every rank, in the same "
                         "order as the job's other collectives")
    if text.startswith(_ERROR):
        raise RematError(text[len(_ERROR):])
    return plan if rank == src and isinstance(plan, Plan) else Plan.from_json(text)
