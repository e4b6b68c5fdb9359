"""The ranks of a ``torch.distributed`` run: how many, and one bounded all-gather.

NOTE [ A collective that cannot hang ]
    ``apply`` compares the plans of all ranks (NOTE [ Every rank applies one plan ] in
    ``_apply.py``). A collective on the job's own process group waits as long as that
    group's timeout, 30 minutes for gloo and 10 for NCCL by default, when a rank never
    joins it (a script that calls ``apply`` on rank 0 only), and an NCCL group would need
    the plan as a CUDA tensor. So :func:`gather_texts` makes a fresh gloo group with its
    own short timeout for each call and destroys it afterwards: a gloo group connects its
    ranks through the default group's store when it is made (or at its first
    collective), and a rank that does not come raises ``DistStoreError`` on the others
    once the timeout has passed (measured: 5.02 s for a 5 s timeout, torch 2.13, two
    processes). ``new_group`` is
    itself collective only in the numbering of groups: every rank must create the same
    groups in the same order, which holds when every rank calls ``apply``; after a rank
    missed one the numbering differs, and later groups of that run cannot connect (that
    run has already raised). A fresh group per call costs a few milliseconds (two
    processes on one machine) and keeps no state between calls.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from autoremat._core.errors import RematError

__all__ = ["gather_texts", "rank_and_size"]


def rank_and_size() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group; ``(0, 1)`` outside one."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def gather_texts(text: str, *, timeout_s: float, what: str) -> list[str]:
    """Every rank's ``text``, indexed by rank; every rank of the default group must call
    it. Waits at most about ``timeout_s`` for the others (NOTE [ A collective that
    cannot hang ]).

    Raises:
        RematError: a rank did not join within ``timeout_s``, or the exchange failed
            (the error from ``torch.distributed`` is chained).
    """
    if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
            and timeout_s > 0):
        raise RematError(f"the timeout for the ranks of {what} must be a number of seconds "
                         f"> 0, got {timeout_s!r}")
    rank, size = rank_and_size()
    if size == 1:
        return [text]
    if not dist.is_gloo_available():
        raise RematError(f"{what} checks the ranks over a gloo process group, and this "
                         "build of torch has no gloo backend; pass check_ranks=False (and "
                         "make sure every rank applies the plan from broadcast_plan)")
    texts: list[object] = [None] * size
    group = None
    try:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        dist.all_gather_object(texts, text, group=group)
    except RuntimeError as exc:  # DistStoreError, DistBackendError: a rank did not come
        raise RematError(
            f"rank {rank} of {size} waited {timeout_s:g} s for the other ranks in {what} "
            f"and not all of them came ({type(exc).__name__}: {exc}). {what} is collective "
            "in a distributed run: call it on every rank, with the same plan; or pass "
            "check_ranks=False where ranks rightly apply different plans") from exc
    finally:
        if group is not None:
            dist.destroy_process_group(group)
    return [str(t) for t in texts]
