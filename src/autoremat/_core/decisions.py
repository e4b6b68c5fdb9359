"""What a block (or the loss head) does in backward: one :class:`Decision`, everywhere.

The tape keys its memory windows by decisions, the peak model and the solvers cost a
:class:`Choice` (a decision and its payload) per segment, the plan records a decision
per block, and ``apply`` installs one. Letters and strings exist only in the JSON codec
(:func:`decision_of` reads them, ``Decision.value`` is what files hold).

NOTE [ Decisions compare equal to their names ]
    ``Decision`` is a ``str`` enum: ``Decision.OFFLOAD == "offload"`` holds, so code
    written against plans whose ``decision`` was a string (``b.decision == "keep"``)
    keeps working, and ``json.dumps`` writes a decision as its name. Inside autoremat a
    decision is always compared as a member (``b.decision is Decision.KEEP``);
    ``tests/test_layers.py`` fails on a decision written as a string outside the codec.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from autoremat._core.errors import RematError, did_you_mean, internal_assert
from autoremat._core.saves import (
    is_keep_set,
    keep_set_name,
    keep_set_number,
    save_set_name,
    save_set_of,
)

__all__ = [
    "BLOCK_DECISIONS",
    "HEAD_BACKENDS",
    "KEEP",
    "OFFLOAD",
    "OFFLOAD_INPUT",
    "RECOMPUTE",
    "Choice",
    "Decision",
    "decision_of",
    "is_head_key",
]


class Decision(str, enum.Enum):
    """What a block does with the tensors its forward makes for backward.

    Example:
        >>> Decision.RECOMPUTE.recomputes, Decision.OFFLOAD.recomputes
        (True, False)
        >>> Decision("offload_input") is Decision.OFFLOAD_INPUT
        True
    """

    KEEP = "keep"  # saved as the model computes it
    RECOMPUTE = "recompute"  # checkpointed: only its input is held, forward re-run
    SELECTIVE = "selective"  # some op outputs saved (by kind or by position), others re-run
    OFFLOAD = "offload"  # its saved tensors copied to host memory until backward
    OFFLOAD_INPUT = "offload_input"  # checkpointed, its input held in host memory
    CHUNKED = "chunked"  # the loss head only: run over chunks of tokens (Choice.chunks)

    def __str__(self) -> str:  # the name, as files and messages write it
        return self.value

    @property
    def recomputes(self) -> bool:
        """Whether backward re-runs any of the block's forward."""
        return self in (Decision.RECOMPUTE, Decision.SELECTIVE, Decision.OFFLOAD_INPUT)

    @property
    def offloads(self) -> bool:
        """Whether the block copies something to host memory (saved tensors or input)."""
        return self in (Decision.OFFLOAD, Decision.OFFLOAD_INPUT)

    @property
    def seen_as(self) -> Decision:
        """The whole-block decision the next block's windows were measured beside: a
        selective block is measured between checkpointed ones and holds, as they do, its
        input, so the next block sees it as recomputed."""
        return Decision.RECOMPUTE if self is Decision.SELECTIVE else self


# who computes a chunked loss head: autoremat ("", NOTE [ A chunked head ]), torch's
# linear_cross_entropy with chunking options, Liger-Kernel's and cut-cross-entropy's
# fused kernels (NOTE [ Head backends ] in _core/head.py)
HEAD_BACKENDS = frozenset({"", "torch", "liger", "cce"})
_SELF_CHUNKING = ("liger", "cce")  # their kernels choose their own chunks: no count

# the decisions a block of the chain can take (CHUNKED is the loss head's)
BLOCK_DECISIONS = tuple(d for d in Decision if d is not Decision.CHUNKED)


def decision_of(value: Decision | str, where: str = "decision",
                allowed: tuple[Decision, ...] = BLOCK_DECISIONS) -> Decision:
    """``value`` as a :class:`Decision`; a string is read by its name (the boundary
    where users and files may pass ``"keep"`` or ``"recompute"``).

    Raises:
        RematError: not one of ``allowed``, naming them and the closest.

    Example:
        >>> decision_of("recompute")
        <Decision.RECOMPUTE: 'recompute'>
    """
    if isinstance(value, Decision) and value in allowed:
        return value
    names = [d.value for d in allowed]
    if isinstance(value, str) and value in names:
        return Decision(value)
    raise RematError(f"{where} must be one of {names} (an autoremat.Decision or its name), "
                     f"got {value!r}."
                     + (did_you_mean(value, names) if isinstance(value, str) else ""))


@dataclass(frozen=True)
class Choice:
    """What a segment of blocks (or the loss head) does: a decision and its payload.

    ``save_ops`` and ``keep_set`` are for :attr:`Decision.SELECTIVE` only: the op kinds
    whose outputs stay saved (``("matmul",)``; empty: recompute every op, keep the random
    draws), or the number of a keep-set the tape measured for the block (1, 2, ...: op
    positions kept, NOTE [ Dead ops ] in ``_mechanism/selective.py``). ``chunks`` is for
    :attr:`Decision.CHUNKED` only.

    Example:
        >>> choice = Choice.selective_from_key("#2")
        >>> choice.decision, choice.keep_set, choice.save_ops
        (<Decision.SELECTIVE: 'selective'>, 2, ())
        >>> Choice.selective_from_key("bmm+matmul").selective_key
        'bmm+matmul'
    """

    decision: Decision
    save_ops: tuple[str, ...] = ()  # selective by kind: kinds whose outputs stay saved
    keep_set: int = 0  # selective by position: the tape's keep-set number; 0: by kind
    chunks: int = 0  # chunked head: chunks of tokens
    backend: str = ""  # chunked head: whose kernel ("" autoremat's own; HEAD_BACKENDS)

    def __post_init__(self) -> None:
        selective = self.decision is Decision.SELECTIVE
        object.__setattr__(self, "save_ops", tuple(sorted(self.save_ops)))  # one spelling
        if not isinstance(self.decision, Decision):
            raise RematError(f"Choice.decision must be a Decision, got {self.decision!r}")
        if (self.save_ops or self.keep_set) and not selective:
            raise RematError(f"save_ops and keep_set belong to selective choices, got "
                             f"{self.decision.value} with save_ops {self.save_ops!r}, "
                             f"keep_set {self.keep_set!r}")
        if self.save_ops and self.keep_set:
            raise RematError(f"a selective choice saves by kind (save_ops) or by position "
                             f"(keep_set), not both: got {self.save_ops!r} and keep-set "
                             f"{self.keep_set}")
        if self.backend not in HEAD_BACKENDS or (self.backend and not self.chunks):
            raise RematError(f"a chunked head's backend is one of {sorted(HEAD_BACKENDS)}, "
                             f"got {self.backend!r}")
        if (self.chunks != 0) != (self.decision is Decision.CHUNKED) or self.chunks < 0:
            raise RematError(f"chunks (>= 1) belongs to the chunked head only, got "
                             f"{self.decision.value} with chunks {self.chunks!r}")

    @property
    def selective_key(self) -> str:
        """The key of this option in a tape block's ``selective`` measurements: the kinds
        joined by ``+`` ("" for none), or ``#k`` for keep-set ``k``."""
        if self.keep_set:
            return keep_set_name(self.keep_set)
        return save_set_name(self.save_ops)

    @property
    def head_key(self) -> str:
        """The name of a loss-head choice, as ``plan(head=...)``, files and a tape's
        ``head.options`` write it: "keep", "chunked:N" (autoremat's own head over N chunks
        of tokens), "torch:N" (torch's ``linear_cross_entropy`` over N), or "liger" /
        "cce" (those libraries' kernels, which chunk by themselves)."""
        if self.decision is Decision.CHUNKED:
            if self.backend in _SELF_CHUNKING:
                return self.backend
            return f"{self.backend or 'chunked'}:{self.chunks}"
        internal_assert(self.decision is Decision.KEEP,
                        f"a loss head is kept or chunked, not {self.decision.value}")
        return "keep"

    @classmethod
    def head_from_key(cls, key: str) -> Choice:
        """The loss-head choice ``key`` names ("keep", "chunked:N" or "torch:N" with
        N >= 1, "liger", "cce"; the inverse of :attr:`head_key`).

        Raises:
            RematError: ``key`` names no head choice.
        """
        choice = _head_choice(key)
        if choice is not None:
            return choice
        raise RematError(f"a loss head is 'keep', 'chunked:N' or 'torch:N' (N chunks of "
                         f"tokens, N >= 1), 'liger' or 'cce', got {key!r}")

    @classmethod
    def selective_from_key(cls, key: str) -> Choice:
        """The selective choice a tape block's ``selective`` key names (the inverse of
        :attr:`selective_key`)."""
        if is_keep_set(key):
            return cls(Decision.SELECTIVE, keep_set=keep_set_number(key))
        return cls(Decision.SELECTIVE, save_ops=save_set_of(key))


def _head_choice(key: object) -> Choice | None:
    """The loss-head choice ``key`` names, or ``None`` (:meth:`Choice.head_from_key`)."""
    if not isinstance(key, str):
        return None
    kind, _, count = key.partition(":")
    if key == "keep":
        return Choice(Decision.KEEP)
    if key in _SELF_CHUNKING:
        return Choice(Decision.CHUNKED, chunks=1, backend=key)
    if kind in ("chunked", "torch") and count.isdigit() and int(count) >= 1:
        return Choice(Decision.CHUNKED, chunks=int(count),
                      backend="" if kind == "chunked" else kind)
    return None


def is_head_key(key: object) -> bool:
    """Whether ``key`` names a loss-head choice ("keep", "chunked:N", "torch:N", "liger",
    "cce")."""
    return _head_choice(key) is not None


KEEP = Choice(Decision.KEEP)
RECOMPUTE = Choice(Decision.RECOMPUTE)
OFFLOAD = Choice(Decision.OFFLOAD)
OFFLOAD_INPUT = Choice(Decision.OFFLOAD_INPUT)
