"""``plan``: choose what each block keeps or recomputes so the step fits a budget.

A pure function of (Tape, budget, strategy), the strategies a registry of
functions (``STRATEGIES``). The :class:`Plan` it returns is plain, frozen
data (``plan.py``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch

from autoremat._core.decisions import KEEP, OFFLOAD, RECOMPUTE, Choice, Decision, is_head_key
from autoremat._core.errors import (
    BudgetError,
    RematError,
    check_flag,
    did_you_mean,
    internal_assert,
)
from autoremat._core.saves import MEGATRON, save_set_name
from autoremat._core.units import format_bytes, parse_budget, parse_size
from autoremat._measure.optimizers import resolve_optimizer
from autoremat._measure.tape import Tape
from autoremat._plan.budget import (
    budget_for,
    check_margin,
    check_shards,
    iteration_memory,
    margin_for,
    room_bytes,
    step_budget_bytes,
)
from autoremat._plan.chain import ChainSolution, solve
from autoremat._plan.peak import Segments, selective_options, with_head
from autoremat._plan.plan import _OFFLOAD_DTYPES, Plan, _with_head_fields, plan_of_segments

__all__ = [
    "STRATEGIES", "budget_bytes_of", "check_head", "check_plan_args", "head_choices",
    "keeps_head", "plan", "smallest_feasible_bytes",
]


def budget_bytes_of(tape: Tape, budget: int | float | str | None, max_memory: Any = None,
                    optimizer: str | int | None = None, shards: int = 1, *,
                    offload: bool = False, head: str | None = None,
                    margin: float | None = None) -> int | None:
    """The step-peak budget in bytes that ``budget`` and ``max_memory`` set on ``tape``
    (the smaller of the two), or ``None`` without either. A ``max_memory`` below what
    the iteration holds whatever is recomputed raises a :class:`BudgetError` whose
    smallest feasible figures are those of the plans ``offload``, ``head`` and ``margin``
    allow, as for :func:`plan`."""
    limits = []
    if budget is not None:
        limits.append(parse_budget(budget, tape.step_peak_bytes))
    if max_memory is not None:  # optimizer= without it: refused by check_plan_args
        try:
            limits.append(step_budget_bytes(max_memory, iteration_memory(tape, optimizer,
                                                                         shards)))
        except BudgetError as exc:
            if exc.min_feasible_bytes is None:
                raise
            raise _below_resting(exc, tape, optimizer, shards, offload, head,
                                 margin) from None
    return min(limits) if limits else None


Strategy = Callable[[Tape, int | None, str, bool], Segments]  # (tape, budget, arg, offload)


def _none(tape: Tape, budget: int | None, arg: str, offload: bool) -> Segments:
    return [(i, i + 1, KEEP) for i in range(len(tape.blocks))]


def _full(tape: Tape, budget: int | None, arg: str, offload: bool) -> Segments:
    return [(i, i + 1, RECOMPUTE) for i in range(len(tape.blocks))]


def _every(tape: Tape, budget: int | None, arg: str, offload: bool) -> Segments:
    k = int(arg)  # a whole number >= 1: check_plan_args refuses anything else
    return [(i, i + 1, RECOMPUTE if i % k == 0 else KEEP) for i in range(len(tape.blocks))]


def _sqrt(tape: Tape, budget: int | None, arg: str, offload: bool) -> Segments:
    n = len(tape.blocks)
    size = max(1, round(math.sqrt(n)))
    out: list[tuple[int, int, Choice]] = []
    start = 0
    while start < n:
        stop = start + 1
        while stop < min(start + size, n) and tape.joins_previous(stop):
            stop += 1
        out.append((start, stop, RECOMPUTE))
        start = stop
    return out


def _selective(tape: Tape, budget: int | None, arg: str, offload: bool) -> Segments:
    out: list[tuple[int, int, Choice]] = []
    for i, block in enumerate(tape.blocks):
        kinds = [k for k in MEGATRON if k in block.op_stats and block.op_stats[k].count]
        name = save_set_name(kinds)
        if kinds and name in block.selective:
            out.append((i, i + 1, Choice(Decision.SELECTIVE, save_ops=tuple(kinds))))
        else:
            out.append((i, i + 1, RECOMPUTE))  # nothing worth saving: recompute it all
    return out


def _optimal(tape: Tape, budget: int | None, arg: str, offload: bool) -> Segments:
    return list(solve(tape, budget, objective="cost",
                      options=selective_options(tape, offload)).segments)


def _offload(tape: Tape, budget: int | None, arg: str, offload: bool) -> Segments:
    return [(i, i + 1, OFFLOAD) for i in range(len(tape.blocks))]


STRATEGIES: dict[str, Strategy] = {
    "none": _none, "full": _full, "every": _every, "sqrt": _sqrt, "optimal": _optimal,
    "selective": _selective, "offload": _offload,
}


def _smallest(tape: Tape, offload: bool = False,
              heads: list[Choice] | None = None) -> ChainSolution:
    """The least-peak plan, over the head decisions ``heads`` (default: keep it)."""
    solutions = [solve(with_head(tape, h), None, objective="peak",
                       options=selective_options(tape, offload))
                 for h in (heads or [KEEP])]
    return min(solutions, key=lambda s: s.peak_bytes)


def _infeasible(strategy: str, budget: int | None, least_peak: int, margin: Fraction,
                predicted: int | None = None) -> BudgetError:
    """No plan of ``strategy`` fits ``budget``; the least peak any plan reaches is
    ``least_peak``, and the smallest feasible budget holds it with ``margin``."""
    need = budget_for(least_peak, margin)
    got = f" (it predicts {format_bytes(predicted)})" if predicted is not None else ""
    kept = (f", less the margin kept (plans predict at most the budget / "
            f"{1 + float(margin):g}: plan's margin={float(margin):g}, by "
            f"default 3% on a CUDA tape for the allocator's blocks: NOTE [ The margin kept "
            f"for the CUDA allocator ]; margin=0 plans without it)" if margin else "")
    return BudgetError(
        f"no {strategy!r} plan fits the budget of {format_bytes(budget or 0)}{kept}{got}. "
        f"The smallest feasible budget is {format_bytes(need)} ({need} bytes), reached by "
        f"strategy 'optimal'; use a budget of at least that, a smaller batch, or also "
        f"offload/shard",
        min_feasible_bytes=need, strategy="optimal")


def _in_max_memory(exc: BudgetError, tape: Tape, budget_bytes: int | None, max_memory: Any,
                   optimizer: str | int | None, shards: int) -> BudgetError:
    """``exc``, for a budget that ``max_memory`` set, told in its terms too: what the
    iteration holds besides the step, and the ``max_memory`` the smallest feasible
    budget needs (``exc.min_feasible_bytes`` stays a step budget, and
    ``min_feasible_max_memory`` is that ``max_memory``)."""
    memory = iteration_memory(tape, optimizer, shards)
    if budget_bytes != step_budget_bytes(max_memory, memory):
        return exc  # budget= was the tighter limit
    need = exc.min_feasible_bytes or 0
    held = f"{optimizer} optimizer state" if optimizer is not None else "no optimizer state"
    return exc.with_message(
        f"max_memory {format_bytes(parse_size(max_memory, what='max_memory'))} leaves a "
        f"step budget of {format_bytes(budget_bytes or 0)}: the iteration holds "
        f"{format_bytes(memory.resting_bytes)} besides the step (parameters, buffers, "
        f"{held}, the batch). {str(exc).rstrip('.')}. As max_memory: at least "
        f"{format_bytes(memory.peak_bytes(need))} ({memory.peak_bytes(need)} bytes)",
        min_feasible_max_memory=memory.peak_bytes(need))


def _below_resting(exc: BudgetError, tape: Tape, optimizer: str | int | None, shards: int,
                   offload: bool, head: str | None, margin: float | None) -> BudgetError:
    """``exc`` (``max_memory`` below what the iteration holds whatever is recomputed),
    with the smallest feasible figures in the units of every other ``BudgetError``: the
    step budget (``min_feasible_bytes``) and the ``max_memory`` holding it. It gave
    their lower bound as a step budget, which a retry with it refused in turn (a
    held-out check, 2026-11-30)."""
    least = smallest_feasible_bytes(tape, offload, head, margin)
    memory = iteration_memory(tape, optimizer, shards)
    whole = memory.peak_bytes(least)
    return BudgetError(
        f"{str(exc).rstrip('.')}. With the smallest step any plan reaches "
        f"({format_bytes(least)}), max_memory must be at least {format_bytes(whole)} "
        f"({whole} bytes)", min_feasible_bytes=least, strategy="optimal",
        min_feasible_max_memory=whole)


def smallest_feasible_bytes(tape: Tape, offload: bool = False,
                            head: str | None = None, margin: float | None = None) -> int:
    """The smallest budget any plan in autoremat's space fits for this tape (with
    ``offload``, offloading blocks too; with the loss head as ``head=`` allows, as for
    :func:`plan`: by default kept): the least step peak a plan reaches, plus on a CUDA
    tape the margin :func:`plan` keeps (``margin=`` as for it; NOTE [ The margin kept
    for the CUDA allocator ] in ``budget.py``)."""
    check_head(head)
    peak = _smallest(tape, offload, head_choices(tape, head)).peak_bytes
    return budget_for(peak, margin_for(tape.device, margin))


_STRATEGY_NAMES = ["optimal", "none", "full", "every:K", "sqrt", "selective", "offload"]


def check_plan_args(budget: int | float | str | None, strategy: str,
                    max_memory: int | str | None = None,
                    optimizer: str | int | None = None, shards: int = 1,
                    margin: float | None = None) -> tuple[str, str]:
    """Validate the arguments of :func:`plan` before any work (``auto`` and the CLI call
    it before they profile); returns the strategy's name and its argument.

    Raises:
        BudgetError: a malformed budget, max_memory, optimizer, shards or margin.
        RematError: an unknown or malformed strategy.

    Example:
        >>> check_plan_args("50%", "every:2")
        ('every', '2')
    """
    if not isinstance(strategy, str):
        raise RematError(f"strategy must be a string such as 'optimal', got {strategy!r}")
    name, _, arg = strategy.partition(":")
    if name not in STRATEGIES:
        raise RematError(f"unknown strategy {strategy!r}; choose from "
                         f"{_STRATEGY_NAMES}."
                         + did_you_mean(name, STRATEGIES))
    if arg and name != "every":
        raise RematError(f"strategy {name!r} takes no argument, got {strategy!r}")
    if name == "every" and not (arg.isdigit() and int(arg) >= 1):
        raise RematError(f"strategy 'every:K' needs a whole number K >= 1, got {strategy!r}")
    if budget is not None:
        parse_budget(budget, 1)  # the syntax; the percentage's reference comes with the tape
    if max_memory is not None:
        parse_size(max_memory, what="max_memory")
    if optimizer is not None:
        if max_memory is None:
            raise BudgetError("optimizer= only matters with max_memory=; pass both, or neither")
        resolve_optimizer(optimizer)
    check_shards(shards)
    check_margin(margin)
    return name, arg


def plan(tape: Tape, budget: int | float | str | None = None, strategy: str = "optimal", *,
         max_memory: int | str | None = None, optimizer: str | int | None = None,
         offload: bool = False, offload_dtype: str | torch.dtype | None = None,
         shards: int = 1, head: str | None = None, margin: float | None = None) -> Plan:
    """Choose, for every block of the tape, keep or recompute, to fit a memory budget.

    Args:
        tape: from :func:`autoremat.profile`.
        budget: the step peak to fit: bytes, a size string (``"6GiB"``, ``"500MB"``),
            or a percentage of the unplanned step peak (``"50%"``).
        strategy: ``"optimal"`` (least recompute FLOPs that fits), ``"none"``,
            ``"full"`` (every block on its own), ``"every:K"`` (one block in K),
            ``"sqrt"`` (Chen et al.: segments of about sqrt(n) blocks), ``"selective"``
            (Megatron-LM's policy in every block: keep linear/conv outputs, recompute
            the rest), ``"offload"`` (every block's saved tensors to host memory; needs
            a tape measured with ``offload=True``). ``"optimal"`` also considers
            selective save-sets per block, and with ``offload`` offloading a block.
        max_memory: an absolute device limit; parameters, buffers, optimizer state and
            the batch are subtracted from it (NOTE [ From max_memory to a step budget ]
            in ``budget.py``, the rule :func:`autoremat.estimate` follows too). With
            ``budget`` too, the tighter one wins.
        optimizer: optimizer name (``"adamw"``; see ``OPTIMIZERS``) or state bytes, for
            ``max_memory``.
        offload: let ``"optimal"`` offload blocks' saved tensors to host memory
            (decision ``"offload"``), costed by the copies' time not hidden behind
            compute (NOTE [ What offload costs ]). Needs a tape measured with
            ``profile(..., offload=True)``. A plan's ``predicted_host_bytes`` is the
            host memory it uses. A plan made for a compiled step cannot offload.
        offload_dtype: opt-in compressed offload, changing numerics: floating saved
            tensors wider than this dtype (``"bfloat16"`` or ``"float16"``) are stored in
            it in host memory, within a relative ``2**-8`` (bf16) of their values (NOTE
            [ Compressed offload ]). Needs ``offload`` or ``strategy="offload"``. The
            predictions and the ranking use uncompressed bytes.
        shards: the ranks that FSDP2 (``fully_shard``) shards the parameters over; 1
            (the default) for DDP or one process. With ``max_memory``, parameters,
            gradients and optimizer state count 1/``shards`` of their bytes (NOTE
            [ Sharded over N ranks ] in ``budget.py``); and above 1 the plan
            checkpoints blocks one by one, since a multi-block segment cannot run under
            FSDP (NOTE [ Plans under DDP and FSDP2 ] in ``_mechanism/engines.py``).
        head: the loss head's decision, among the chunked options the tape measured
            (``tape.head``: a Hugging Face causal LM given labels, or an
            :class:`autoremat.LMHead`). ``None`` (default) or ``"keep"``: keep it
            (gradients stay bitwise; a BudgetError says how far chunking would go);
            ``"auto"``: the least-cost plan over keeping and chunking; ``"chunked"``: the
            cheapest chunked option that fits; or an option's name such as
            ``"chunked:32"`` (NOTE [ Choosing the head ]). A chunked head
            never builds the full logits (``out.logits`` is ``None``) and changes the
            loss and the projection's weight gradient by summation order only (NOTE
            [ What a chunked head changes in numerics ]).
        margin: the share of the budget kept for what the CUDA caching allocator adds
            beyond the prediction (blocks it hands out whole): the plan predicts at most
            ``budget / (1 + margin)``, and ``plan.margin_bytes`` is the rest. ``None``
            (default): 0.03 on a tape for a CUDA device, 0 elsewhere, where the tracker's
            figures are exact (NOTE [ The margin kept for the CUDA allocator ] in
            ``budget.py``). ``0`` plans to the prediction alone.

    Returns:
        A frozen :class:`Plan`. ``plan`` has no ``compile`` option: a tape measured
        compiled (``profile(..., compile=True)``, ``tape.compiled``) already holds the
        compiled step's figures, and its plans (``plan.compiled``) predict that step,
        with every block compiled on its own (NOTE [ Profiling a compiled step ]).

    Raises:
        BudgetError: the budget cannot be read, or no plan of the strategy fits it;
            the message and ``err.min_feasible_bytes`` give the smallest feasible budget.

    Example:
        >>> import autoremat
        >>> model, inputs = autoremat.zoo.build("mlp", widths=(128,) * 4, batch_size=256)
        >>> p = autoremat.plan(autoremat.profile(model, inputs), budget="75%")
        >>> p.predicted_peak_bytes <= p.budget_bytes
        True
    """
    if not isinstance(tape, Tape):
        raise RematError(f"plan() needs a Tape from autoremat.profile(), got {type(tape).__name__}")
    name, arg = check_plan_args(budget, strategy, max_memory, optimizer, shards, margin)
    if max_memory is not None and optimizer is None:
        warnings.warn(
            "autoremat: max_memory= without optimizer= counts no optimizer state (AdamW "
            "holds two more copies of the trainable parameters: "
            f"{format_bytes(2 * tape.trainable_param_bytes)} here, in their dtype); pass "
            "optimizer='adamw' (or the one the loop steps; 'none' where it holds none)",
            UserWarning, stacklevel=2)
    check_head(head)
    if name == "optimal" and budget is None and max_memory is None and head in (None, "keep"):
        warnings.warn(
            "autoremat: plan() with strategy 'optimal' and no budget keeps every block: "
            "the least recompute is none where no memory limit is set, and the plan "
            "changes nothing. Pass budget= (bytes, '6GiB', '50%') or max_memory=, or "
            "another strategy ('full', 'sqrt', 'selective')", UserWarning, stacklevel=2)
    check_flag("offload", offload)
    dtype_name = _offload_dtype(offload_dtype, offload or name == "offload")
    notes: tuple[str, ...] = ()
    if offload and name != "offload" and not tape.offload and tape.device == "cpu":
        # NOTE [ Offloading saved tensors ]: on a CPU the host is the device, and
        # offloading frees nothing (tests/test_offload.py measures it), so no block would
        # be offloaded: plan without it, and say so
        offload = False
        notes = ("offload=True on a CPU tape: the host is the device there, offloading "
                 "frees nothing, so no block is offloaded",)
    if name == "offload" and tape.device == "cpu":
        notes = ("strategy='offload' on a CPU tape: the host is the device there, so the "
                 "copies free nothing and the plan's peak is the unplanned one (it runs "
                 "the mechanism, e.g. to test it before a GPU run)",)
    if (offload or name == "offload") and not tape.offload:
        raise RematError("this tape was measured without offloaded blocks; profile with "
                         "autoremat.profile(model, inputs, offload=True) to plan offload"
                         + (" (a compiled step cannot offload)" if tape.compiled else ""))
    if shards > 1:  # no multi-block segments under FSDP: no block joins its predecessor
        tape = dataclasses.replace(tape, blocks=tuple(
            dataclasses.replace(b, chained=False) for b in tape.blocks))
    budget_bytes = budget_bytes_of(tape, budget, max_memory, optimizer, shards,
                                   offload=offload or name == "offload", head=head,
                                   margin=margin)
    kept = margin_for(tape.device, margin)
    room = None if budget_bytes is None else room_bytes(budget_bytes, kept)
    heads = head_choices(tape, head, name)
    try:
        found = _best_over_heads(tape, heads, name, arg, strategy,
                                 (budget_bytes, room, kept), offload, head)
    except BudgetError as exc:
        if max_memory is None or exc.min_feasible_bytes is None:
            raise
        raise _in_max_memory(exc, tape, budget_bytes, max_memory, optimizer,
                             shards) from None
    found = dataclasses.replace(found, shards=shards, offload_dtype=dtype_name,
                                budget_bytes=budget_bytes,
                                margin_bytes=0 if budget_bytes is None or room is None
                                else budget_bytes - room)
    return dataclasses.replace(found, notes=(*found.notes, *notes)) if notes else found


def check_head(head: Any) -> None:
    """Refuse a ``head=`` that no tape could offer, before any work: ``None``, "keep",
    "auto", "chunked", or an option's name ("chunked:N", "torch:N", "liger", "cce")."""
    if head is None or head in ("keep", "auto", "chunked"):
        return
    if is_head_key(head):
        return
    raise RematError(f"head must be None, 'keep', 'auto', 'chunked', or an option's name: "
                     f"'chunked:N' (autoremat's head over N chunks of tokens, N >= 1), "
                     f"'torch:N', 'liger' or 'cce', got {head!r}."
                     + (did_you_mean(head, ["keep", "auto", "chunked", "liger", "cce"])
                        if isinstance(head, str) else ""))


def keeps_head(head: str | None) -> bool:
    """Whether a ``head=`` argument keeps the loss head as the model computes it."""
    return head is None or head == "keep"


def head_choices(tape: Tape, head: str | None, strategy: str = "optimal") -> list[Choice]:
    """The loss-head choices a plan may take, in order of preference (NOTE [ Choosing
    the head ]), from ``plan``'s ``head=`` argument (a name)."""
    options = list(tape.head.options) if tape.head is not None else []
    chunked = [Choice.head_from_key(name) for name in options]
    if keeps_head(head):
        return [KEEP]
    if head == "auto":
        return [KEEP, *chunked]
    if head == "chunked" and options:
        return chunked
    if head in options:
        return [Choice.head_from_key(head)]  # type: ignore[arg-type]
    if not isinstance(head, str):
        raise RematError(f"head must be a string such as 'keep' or 'chunked:32', got {head!r}")
    if not options and (head == "chunked" or head.startswith("chunked:")):
        notes = [n for n in tape.notes if "head" in n]
        raise RematError(f"head {head!r}: this tape measured no chunked head option, so it "
                         f"offers 'keep' and 'auto' (which keeps the head) only"
                         + (f"; its note says why: {notes[0]}" if notes else
                            "; see its notes for why"))
    have = ["keep", "auto", *(["chunked"] if options else []), *options]
    raise RematError(f"unknown head {head!r}; this tape offers {have}."
                     + did_you_mean(head, have))


# NOTE [ Choosing the head ]
#     A chunked head changes the loss and the projection's weight gradient in the last
#     bits (NOTE [ What a chunked head changes in numerics ]); everything else a plan does
#     keeps gradients bitwise, which is autoremat's promise. So chunking is asked for:
#     by default (``head=None``, as ``"keep"``) a plan keeps the head, and a budget that
#     only a chunked head reaches is refused with a BudgetError that says so and gives
#     that smallest budget too. ``head="auto"`` takes the least-cost plan over keeping
#     and every chunked option (a chunked head is often far cheaper than recomputing
#     blocks), ``head="chunked"`` the least-cost chunked one, ``"chunked:N"`` that one.


def _with_head_hint(exc: BudgetError, tape: Tape, head: str | None,
                    offload: bool, margin: Fraction) -> BudgetError:
    """``exc``, saying how far a chunked loss head would go where the tape measured one
    and the plan was not allowed to chunk it (a budget, with ``margin``)."""
    if not keeps_head(head) or tape.head is None or not tape.head.options:
        return exc
    chunked = budget_for(_smallest(tape, offload, head_choices(tape, "auto")).peak_bytes,
                         margin)
    if exc.min_feasible_bytes is not None and chunked >= exc.min_feasible_bytes:
        return exc
    return exc.with_message(
        f"{str(exc).rstrip('.')}. With the loss head computed in chunks of tokens "
        f"(head='auto'; it changes the loss and the projection's weight gradient by "
        f"summation order) the smallest feasible budget is {format_bytes(chunked)} "
        f"({chunked} bytes)")


def _best_over_heads(tape: Tape, heads: list[Choice], name: str, arg: str, strategy: str,
                     budgets: tuple[int | None, int | None, Fraction], offload: bool,
                     head: str | None) -> Plan:
    """The least-cost plan of the strategy that fits, over the head decisions ``heads``
    (NOTE [ Choosing the head ]); ``budgets`` is the budget asked for, the room its
    prediction may take (the budget less the margin), and the margin."""
    budget_bytes, room, margin = budgets
    best: Plan | None = None
    predicted = None
    for head_choice in heads:
        view = with_head(tape, head_choice)
        try:
            segments = STRATEGIES[name](view, room, arg, offload)
        except BudgetError as exc:
            if len(heads) == 1:
                least = exc.min_feasible_bytes
                internal_assert(least is not None, "a strategy's BudgetError without a peak")
                raise _with_head_hint(_infeasible(strategy, budget_bytes, least or 0, margin),
                                      tape, head, offload, margin) from None
            continue
        found = _with_head_fields(plan_of_segments(view, segments, strategy, room),
                                  tape, head_choice)
        if room is not None and found.predicted_peak_bytes > room:
            predicted = found.predicted_peak_bytes if predicted is None else predicted
            continue
        if best is None or found.predicted_cost < best.predicted_cost:
            best = found
    if best is None:
        least = _smallest(tape, offload, heads).peak_bytes
        raise _with_head_hint(_infeasible(strategy, budget_bytes, least, margin, predicted),
                              tape, head, offload, margin)
    return best


def _offload_dtype(value: str | torch.dtype | None, offloading: bool) -> str:
    """The name of a compressed-offload dtype, checked; "" for none."""
    if value is None:
        return ""
    name = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
    if name not in _OFFLOAD_DTYPES:
        raise RematError(f"offload_dtype must be one of {list(_OFFLOAD_DTYPES)} (or the "
                         f"torch dtype), got {value!r}")
    if not offloading:
        raise RematError("offload_dtype= only matters when the plan offloads: pass "
                         "offload=True (or strategy='offload') too")
    return name
