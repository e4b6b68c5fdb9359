"""The names of what a selective block keeps: save-sets, keep-sets and their keys.

Plain strings and tuples, no torch: the profiler writes these names into a tape, the
planner reads them back and writes plans with them, and the mechanism (``_mechanism``)
turns them into dispatch modes. What the names mean is in NOTE [ Save-sets by op kind ]
and NOTE [ Dead ops ] (``_mechanism/selective.py``) and NOTE [ Plans under
torch.compile ] (``_mechanism/compiled.py``).

* a *save-set* names op kinds whose outputs stay saved; in a tape its key is the kinds
  joined by ``+`` (``"bmm+matmul"``; ``""`` for none);
* a *keep-set* names op outputs by position in a block's op sequence; its key is ``#k``
  (the tape's k-th keep-set of that block), and it applies only to the op sequence whose
  :func:`op_signature` it carries;
* under ``torch.compile`` a keep-set is lowered to (op name, occurrence) keys
  (:func:`keep_keys`), written in a plan as ``"aten.mm.default#1"``.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from collections.abc import Iterable, Sequence

from autoremat._core.errors import RematError

__all__ = ["MEGATRON", "SAVEABLE_KINDS", "KeepKey", "format_keep_keys", "is_keep_set",
           "keep_keys", "keep_set_name", "keep_set_number", "op_signature",
           "parse_keep_keys", "save_set_name", "save_set_of", "save_sets"]

SAVEABLE_KINDS = ("attention", "bmm", "conv", "matmul")  # compute-heavy: worth keeping
# strategy="selective": Megatron-LM's policy. Save what has weights (linear, conv) and
# fused attention kernels; recompute the attention core built from bmm/softmax/dropout.
MEGATRON = ("attention", "conv", "matmul")

KeepKey = tuple[str, int]  # (op overload name, its occurrence in the region: 0, 1, ...)


def save_sets(kinds_present: Iterable[str]) -> list[tuple[str, ...]]:
    """The save-sets worth measuring for a block with these op kinds, largest first.

    Every non-empty subset of the saveable kinds present, and, if the block draws random
    numbers (``dropout``), the empty save-set: recompute every op but copy the kept
    draws back, which costs less than whole-block recompute where drawing is slow (CPU).

    Example:
        >>> save_sets(["matmul", "bmm", "softmax", "dropout"])
        [('bmm', 'matmul'), ('bmm',), ('matmul',), ()]
    """
    kinds = set(kinds_present)
    present = sorted(kinds & set(SAVEABLE_KINDS))
    out: list[tuple[str, ...]] = []
    for size in range(len(present), 0, -1):
        out.extend(itertools.combinations(present, size))
    if "dropout" in kinds:
        out.append(())
    return out


def save_set_name(save: Iterable[str]) -> str:
    """The key of a save-set in a tape: kinds joined by ``+`` ("" for the empty set)."""
    return "+".join(sorted(save))


def save_set_of(name: str) -> tuple[str, ...]:
    """The save-set a tape key names; the inverse of :func:`save_set_name`."""
    return tuple(name.split("+")) if name else ()


def keep_set_name(number: int) -> str:
    """The key of a block's keep-set ``number`` (1, 2, ...) in a tape: ``"#1"``, ..."""
    return f"#{number}"


def keep_set_number(name: str) -> int:
    """The number a keep-set's key names; the inverse of :func:`keep_set_name`."""
    return int(name[1:])


def is_keep_set(name: str) -> bool:
    """Whether a tape's selective key names a keep-set by position ("#1", "#2", ...)
    rather than a save-set of op kinds."""
    return name.startswith("#")


def op_signature(names: Iterable[str]) -> str:
    """A short hash of a region's op sequence, by op overload name: keep-sets index ops
    by position, so they apply only to the same ops.

    Example:
        >>> op_signature(["aten.mm.default", "aten.relu.default"])
        '4ee845a0f4e35ffa'
    """
    return hashlib.sha1("\n".join(names).encode()).hexdigest()[:16]


def keep_keys(names: Sequence[str], keep: Iterable[int]) -> frozenset[KeepKey]:
    """The (op name, occurrence) keys of the ops at positions ``keep`` of ``names``.

    Example:
        >>> sorted(keep_keys(["aten.mm.default", "aten.relu.default", "aten.mm.default"],
        ...                  [2]))
        [('aten.mm.default', 1)]
    """
    wanted = set(keep)
    seen: Counter[str] = Counter()
    out = set()
    for position, name in enumerate(names):
        if position in wanted:
            out.add((name, seen[name]))
        seen[name] += 1
    return frozenset(out)


def format_keep_keys(keys: Iterable[KeepKey]) -> tuple[str, ...]:
    """Keys as plan-file strings, sorted: ``("aten.mm.default#1", ...)``."""
    return tuple(f"{name}#{k}" for name, k in sorted(keys))


def parse_keep_keys(texts: Iterable[str]) -> frozenset[KeepKey]:
    """The inverse of :func:`format_keep_keys`; a malformed key raises ``RematError``.

    Example:
        >>> sorted(parse_keep_keys(["aten.mm.default#1"]))
        [('aten.mm.default', 1)]
    """
    out = set()
    for text in texts:
        name, _, k = text.rpartition("#")
        if not name or not k.isdigit():
            raise RematError(f"a keep key is 'op#occurrence', e.g. 'aten.mm.default#0'; got "
                             f"{text!r}")
        out.add((name, int(k)))
    return frozenset(out)
