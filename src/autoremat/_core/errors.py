"""The exceptions autoremat raises: one root, :class:`RematError`, and a subclass per kind."""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Iterable

__all__ = ["BlockError", "BudgetError", "DeterminismError", "InternalError", "LoopError",
           "PlanMismatchError", "RematError", "SchemaError", "internal_assert"]


class RematError(Exception):
    """Root of every error autoremat raises on purpose; catch this to catch them all."""


class BudgetError(RematError):
    """The memory budget is malformed, or no plan of the requested strategy fits it.

    Attributes:
        min_feasible_bytes: the smallest step peak any plan reaches, a step budget
            (``None`` when the budget string itself was malformed).
        strategy: the strategy that reaches ``min_feasible_bytes``.
        min_feasible_max_memory: where ``max_memory=`` set the limit, the smallest
            ``max_memory`` that holds the iteration with that step (``None`` otherwise).
    """

    def __init__(
        self, message: str, *, min_feasible_bytes: int | None = None, strategy: str | None = None,
        min_feasible_max_memory: int | None = None,
    ) -> None:
        super().__init__(message)
        self.min_feasible_bytes = min_feasible_bytes
        self.strategy = strategy
        self.min_feasible_max_memory = min_feasible_max_memory

    def with_message(self, message: str, *,
                     min_feasible_max_memory: int | None = None) -> BudgetError:
        """The same error (its smallest feasible budget and strategy) told as ``message``."""
        return BudgetError(message, min_feasible_bytes=self.min_feasible_bytes,
                           strategy=self.strategy,
                           min_feasible_max_memory=min_feasible_max_memory
                           or self.min_feasible_max_memory)


class BlockError(RematError):
    """The blocks to checkpoint could not be found or were named wrongly."""


class LoopError(RematError):
    """An unknown training-loop name was given as ``loop=`` (see ``step.Loop``)."""


class DeterminismError(RematError):
    """``verify(deterministic=True)`` cannot make the step deterministic: cuBLAS is not
    configured for it (``CUBLAS_WORKSPACE_CONFIG``), or an op has no deterministic
    implementation on the device."""


class PlanMismatchError(RematError):
    """A plan was applied to a model or input shape it was not made for, or the ranks of
    a distributed run applied different plans."""


class SchemaError(RematError):
    """A saved tape or plan could not be loaded: wrong version or a malformed field."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest choice, or ``""`` when none is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def whole(value: object) -> int | None:
    """``value`` as an ``int`` where it is an integer of any integer type (Python's,
    numpy's: anything ``numbers.Integral``), ``None`` otherwise; a bool is not one.

    Example:
        >>> import numpy as np
        >>> whole(np.int64(3)), whole(3.0), whole(True)
        (3, None, None)
    """
    if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy's bool too
        return None
    return int(value) if isinstance(value, numbers.Integral) else None


def check_whole(name: str, value: object, minimum: int, meaning: str,
                error: type[RematError] = RematError) -> int:
    """Return ``value`` as an int if it is an integer (not a bool; numpy's are) of at
    least ``minimum``, else raise ``error`` naming it, its meaning and the value given.

    Example:
        >>> check_whole("repeats", 3, 1, "the steps timed")
        3
    """
    n = whole(value)
    if n is None or n < minimum:
        raise error(f"{name} must be a whole number >= {minimum} ({meaning}), got {value!r}")
    return n


def check_flag(name: str, value: object) -> bool:
    """Return ``value`` if it is a bool, else raise :class:`RematError` naming it: a
    truthy string such as ``"no"`` must not pass for ``True``.

    Example:
        >>> check_flag("timing", False)
        False
    """
    if not isinstance(value, bool):
        raise RematError(f"{name} must be True or False, got {value!r}")
    return value


class InternalError(AssertionError):
    """An invariant of autoremat itself failed: a bug in autoremat, not a user error.

    Deliberately not a :class:`RematError`: code that catches ``RematError`` to report a
    user's mistake must not present a bug as one, nor hide it.
    """


def internal_assert(condition: bool, message: str) -> None:
    """Check an invariant of autoremat itself; failing raises :class:`InternalError`."""
    if not condition:
        raise InternalError(f"autoremat internal error (please report it): {message}")
