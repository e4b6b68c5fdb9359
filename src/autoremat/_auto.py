"""``auto``: profile, plan and apply in one call, then measure that the plan fits.

The one place that composes the stages; each of them stays usable on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

from autoremat._apply import apply, remove
from autoremat._core.decisions import Choice, Decision
from autoremat._core.errors import BudgetError, check_flag
from autoremat._core.saves import is_keep_set, save_set_of
from autoremat._core.step import Loop, LossFn, Step, as_step
from autoremat._core.units import format_bytes
from autoremat._measure.blocks import BlockSpec
from autoremat._measure.measured import measure_step
from autoremat._measure.tape import Tape
from autoremat._mechanism.compiled import LEAST_COMPILE_BUDGET
from autoremat._mechanism.head import find_head
from autoremat._plan.plan import Plan, plan_key, plan_of_segments
from autoremat._plan.strategies import (
    budget_bytes_of,
    check_head,
    check_plan_args,
    keeps_head,
    plan,
    smallest_feasible_bytes,
)
from autoremat._profile.profile import compile_backend, profile
from autoremat._verify import compiled_whole

__all__ = ["auto"]


def auto(model: nn.Module | Step, inputs: Any = None,
         budget: int | float | str | None = None, strategy: str = "optimal", *,
         loss_fn: LossFn | None = None, blocks: BlockSpec = None,
         max_memory: int | str | None = None, optimizer: str | int | None = None,
         loop: Loop | None = None,
         compile: bool | str = False, offload: bool = False,
         head: str | None = None, margin: float | None = None) -> Plan:
    """Profile, plan and apply in one call; returns the plan applied.

    With a budget, ``auto`` then measures one step with the plan applied and, if the
    measured peak is over the budget, plans again for a budget smaller by the plan's
    prediction error (at most twice more); see NOTE [ auto measures what it applies ].

    Args:
        model, inputs, loss_fn, blocks: as for :func:`autoremat.profile`; an
            :class:`autoremat.Step` in place of the model carries inputs, loss_fn and
            loop (the rest by keyword: ``auto(step, budget="6GiB")``).
        budget, strategy, max_memory, optimizer: as for :func:`autoremat.plan`.
        loop: the training loop the budget must hold for, as for
            :func:`autoremat.profile` (recorded as ``plan.loop``). ``"holds_output"``
            (default, also for ``None``): ``out = model(**batch); out.loss.backward()``,
            and every loop that releases the output sooner. ``"loss_only"``: a tighter
            plan for a loop that keeps only the loss (``loss = model(**batch).loss``).
        compile: plan for the step as it runs under ``torch.compile`` (``True``:
            Inductor; or a backend name such as ``"aot_eager"``), as for
            :func:`autoremat.profile`: the tape is measured compiled and the plan
            (``plan.compiled``) checkpoints blocks one by one. The plan is chosen by
            measuring the model compiled whole, as ``torch.compile(model)`` runs it
            (``plan.compiled_peak_bytes``, which its budget holds for; NOTE [ Compiled
            plans are fitted by measurement ]); a budget given as a share is of the
            tape's peak, measured block by block. ``auto`` compiles only while it
            measures and leaves no compiled wrapper behind: compile the model as you
            train it (:func:`autoremat.compile_model`); run eagerly, the plan warns.
        offload: let the plan offload blocks to host memory, as for
            :func:`autoremat.plan` (the profile then measures offloaded blocks too). On
            a CPU the host is the device, so nothing is offloaded there.
        head: the loss head's decision, as for :func:`autoremat.plan` (``None``: keep it;
            ``"auto"``: chunk it where that is cheaper).
        margin: the share of the budget kept for the CUDA allocator's blocks, as for
            :func:`autoremat.plan` (``None``: 3% on CUDA, 0 elsewhere). A plan fitted for
            the step compiled whole (``compile=``) is judged by its measured peak alone.

    Raises:
        RematError: ``compile`` names no backend (before any work).
        BudgetError: no plan fits, or the plans tried still measure over the budget.

    Example:
        >>> import autoremat
        >>> model, inputs = autoremat.zoo.build("mlp", widths=(128,) * 4, batch_size=256)
        >>> plan = autoremat.auto(model, inputs, budget="75%")
        >>> autoremat.applied_plan(model) is plan
        True
    """
    step = as_step(model, inputs, loss_fn, loop, caller="auto", keyword="budget")
    check_plan_args(budget, strategy, max_memory, optimizer, margin=margin)  # before any work
    check_head(head)
    backend = compile_backend(compile)
    model = step.model
    remove(model)
    check_flag("offload", offload)
    if budget is None and max_memory is None and strategy == "optimal":
        raise BudgetError("auto() with neither budget= nor max_memory= would plan to keep "
                          "every block (the fastest step) and change nothing: give a budget "
                          "(e.g. budget='60%') or max_memory=, or a strategy such as 'full'")
    # plans read FLOPs and bytes, never the tape's times: no uninstrumented steps timed
    # the loss head's options cost a memory step each: measured only when the plan may
    # chunk the head
    def planned(tape: Tape, head: str | None) -> Plan:
        return plan(tape, budget, strategy, max_memory=max_memory, optimizer=optimizer,
                    offload=offload, head=head, margin=margin)

    def profiled(with_head: bool) -> Tape:
        return profile(step, blocks=blocks, compile=backend or False, offload=offload,
                       timing=False, with_head=with_head)

    tape = profiled(not keeps_head(head))
    limit = budget_bytes_of(tape, budget, max_memory, optimizer)
    if backend is not None and limit is not None and strategy == "optimal":
        return fit_compiled(step, tape, limit, backend)
    try:
        chosen = planned(tape, head)
    except BudgetError as exc:
        if not keeps_head(head):
            raise
        raise _with_head_hint(exc, step, lambda: planned(profiled(True), "auto")) from None
    apply(model, chosen, check_ranks=False)
    if chosen.budget_bytes is None:
        return chosen
    # NOTE [ auto measures what it applies ]
    #     The peak model composes per-block windows keyed by the modes of a block and its
    #     predecessor. Where a block's output lives on in code outside the chain (U-Net
    #     style skip connections held in a list), its lifetime depends on blocks further
    #     away, and a plan can measure one such tensor over its prediction. verify()
    #     reports that; auto(), which has the model, measures the plan it applied and
    #     plans again for the budget less that plan's prediction error (or less the
    #     overshoot, if that is tighter), until the measured step fits: the error is much
    #     the same from plan to plan, so one retry usually does it.
    limit, target = chosen.budget_bytes, chosen.budget_bytes
    for attempt in range(_AUTO_ATTEMPTS):
        peak = _measured_peak(step, chosen, backend)
        if peak <= limit:
            return chosen
        remove(model)
        if attempt == _AUTO_ATTEMPTS - 1:
            break
        target = min(target - (peak - limit), limit - (peak - chosen.predicted_peak_bytes))
        try:
            retry = plan(tape, target, strategy, offload=offload, head=head, margin=margin)
        except BudgetError as exc:
            raise exc.with_message(
                f"the plan for {format_bytes(limit)} measured {format_bytes(peak)}; a plan "
                f"for {format_bytes(target)} to make up for it does not exist: {exc}") from exc
        note = (f"planned for {format_bytes(target)} so that the measured step fits "
                f"{format_bytes(limit)} (a plan for {format_bytes(limit)} measured "
                f"{format_bytes(peak)}: the peak model missed tensors held outside the "
                "chain of blocks)")
        chosen = dataclasses.replace(retry, budget_bytes=limit,
                                     notes=(*retry.notes, note))
        apply(model, chosen, check_ranks=False)
    raise BudgetError(
        f"after {_AUTO_ATTEMPTS} plans the measured step peak is still "
        f"{format_bytes(peak)}, over the budget of {format_bytes(limit)}; give a smaller "
        "budget, or pass blocks=[...] so that tensors held between blocks are inside them",
        min_feasible_bytes=None, strategy=strategy)


_AUTO_ATTEMPTS = 3  # plans auto() measures before giving up (NOTE [ auto measures ... ])


def fit_compiled(step: Step, tape: Tape, limit: int, backend: str, *,
                 peaks: dict[Any, tuple[int, float]] | None = None) -> Plan:
    """The fastest plan found whose step, compiled whole (``torch.compile(model)`` with
    ``backend``), measures at most ``limit`` bytes; applied to ``step.model``, with
    ``plan.compiled_peak_bytes`` the peak measured (NOTE [ Compiled plans are fitted by
    measurement ]). ``tape`` is the step's compiled profile; ``peaks`` holds the peaks and
    times measured so far, by plan (shared between calls for one step, so that no plan is
    compiled and measured twice).

    Raises:
        BudgetError: even the smallest plans measure over ``limit``; its
            ``min_feasible_bytes`` is the least any of them measured.
    """
    # NOTE [ Compiled plans are fitted by measurement ]
    #     Users compile the whole model. Inductor then fuses across blocks, and AOT
    #     Autograd's partitioner decides around autoremat's checkpoint regions and SAC
    #     tags what the rest of the graph saves, so the step compiled whole peaks elsewhere
    #     than the tape's prediction (made with each block compiled on its own and the
    #     rest eager). Zoo gpt2 (4 x 128, seq 64, batch 2, Inductor, CPU): the plain step
    #     measured 6.95 MiB compiled whole, the smallest plan's prediction is 5.53 MiB
    #     while every block recomputed measures 5.21 MiB compiled whole, and a plan
    #     predicted at 5.53 MiB measured 5.59. A plan is therefore chosen by measuring
    #     the step compiled whole (the allocator's peak; on CUDA its counters), as few
    #     times as will do:
    #
    #     1. every block kept: if it fits, nothing is recomputed (compile's own plan);
    #     2. with Inductor, compile's own memory budget, made exact (NOTE [ Compile's
    #        own memory budget, exact ] in _mechanism/compiled.py), at 0.5, then 0.75
    #        after a fit or 0.25 and 0 after an overrun: where it fits it is often the
    #        fastest, since its recompute is fused into the backward; one that fits
    #        within _AS_FAST of step 1's time ends the search;
    #     3. the tape's error on step 1 calibrates the planning budget: plan at
    #        limit - (measured - predicted); a plan over the limit lowers the planning
    #        budget by its overshoot below its own prediction, until one fits (at most
    #        _FIT_ATTEMPTS plans); one that fits is followed by one plan for the room it
    #        leaves (kept too if it fits);
    #     4. every block selective under one save-set of op kinds the tape offers for all
    #        (matmul outputs saved, the rest recomputed: the SAC policies users write per
    #        block under compile, which the partitioner fuses into the backward);
    #     5. if nothing fits yet, every block recomputed (a plain checkpoint per block,
    #        which compile's partitioner trims best) and the tape's smallest plan.
    #
    #     Of the candidates that fit, the fastest measured (median of five steps)
    #     is applied. Each measurement compiles the model again (seconds on a GPU, 5-40 s
    #     on a CPU for the small models of the tests), so no plan is measured twice. The
    #     measured peak is the plan's compiled_peak_bytes; its predicted figures stay the
    #     tape's.
    model = step.model
    peaks = {} if peaks is None else peaks

    def measured(candidate: Plan) -> tuple[int, float]:
        key = plan_key(candidate)
        if key not in peaks:
            apply(model, candidate, check_ranks=False)
            try:
                peaks[key] = compiled_whole(step, candidate, backend)
            finally:
                remove(model)
        return peaks[key]

    def fitted(candidate: Plan, how: str) -> Plan:
        peak, ms = measured(candidate)
        chosen = dataclasses.replace(
            candidate, budget_bytes=limit, compiled_peak_bytes=peak, strategy="optimal",
            notes=(*candidate.notes, f"chosen by measuring the step compiled whole "
                                     f"(torch.compile(model), {backend}): {how}; it measured "
                                     f"{format_bytes(peak)} for a budget of "
                                     f"{format_bytes(limit)}, {ms:.1f} ms a step"))
        apply(model, chosen, check_ranks=False)
        return chosen

    keep = plan(tape, None, "none")
    if measured(keep)[0] <= limit:
        return fitted(keep, "every block kept fits")
    found: dict[str, Plan] = {}  # what fits, by how it was found
    if backend == "inductor":  # NOTE [ Compile's own memory budget, exact ]
        fraction: float | None = 0.5
        while fraction is not None:
            candidate = dataclasses.replace(keep, compile_memory_budget=fraction)
            fits = measured(candidate)[0] <= limit
            if fits:
                found[f"compile's activation_memory_budget={fraction:g}"] = candidate
            fraction = _next_fraction(fraction, fits)
    quick = [h for h in found if measured(found[h])[1] <= _AS_FAST * measured(keep)[1]]
    if quick:  # as fast as keeping every block: no plan can do better
        return fitted(found[quick[0]], f"{quick[0]}, as fast as every block kept")
    # the measured peak is the judge here: plans are asked for predictions, no margin
    floor = smallest_feasible_bytes(tape, margin=0)
    target = limit - (measured(keep)[0] - keep.predicted_peak_bytes)
    for _ in range(_FIT_ATTEMPTS):
        if target < floor:
            break
        candidate = plan(tape, target, margin=0)
        peak = measured(candidate)[0]
        if peak > limit:
            target = min(target, candidate.predicted_peak_bytes) - (peak - limit)
            continue
        found[f"planned for {format_bytes(target)}"] = candidate
        room = plan(tape, target + limit - peak, margin=0)
        if room.predicted_cost < candidate.predicted_cost and measured(room)[0] <= limit:
            found[f"planned for {format_bytes(target + limit - peak)}"] = room
        break
    for key, candidate in _uniform_save_sets(tape):
        if measured(candidate)[0] <= limit:
            found[f"every block saving the outputs of {key}"] = candidate
    if not found:
        for how, candidate in (("every block recomputed", plan(tape, None, "full")),
                               ("the tape's smallest plan", plan(tape, floor, margin=0))):
            if measured(candidate)[0] <= limit:
                found[how] = candidate
    if found:
        how = min(found, key=lambda h: measured(found[h])[1])
        return fitted(found[how], f"the fastest of {len(found)} that fit: {how}")
    least = min(peak for peak, _ in peaks.values())
    raise BudgetError(
        f"no plan measures within the budget of {format_bytes(limit)} with the model "
        f"compiled whole ({backend}): the smallest measured {format_bytes(least)} "
        f"({least} bytes); give a budget of at least that, a smaller batch, or plan the "
        f"eager step", min_feasible_bytes=least, strategy="optimal")


def _uniform_save_sets(tape: Tape) -> list[tuple[str, Plan]]:
    """Plans with every block selective under one save-set of op kinds (``matmul``,
    ``bmm+matmul``, ...) that every block offers: the SAC policies users apply per block
    under compile, whose partitioner then recomputes the rest fused into the backward."""
    keys = [set(k for k in b.selective if k and not is_keep_set(k)) for b in tape.blocks]
    common = sorted(set.intersection(*keys)) if keys else []
    n = len(tape.blocks)
    return [(key, plan_of_segments(tape, [(i, i + 1, Choice(Decision.SELECTIVE,
                                                            save_ops=save_set_of(key)))
                                          for i in range(n)], "optimal"))
            for key in common]


def _next_fraction(fraction: float, fits: bool) -> float | None:
    """The next of compile's budgets to try after ``fraction`` (0.5 first): 0.75 after a
    fit, to find a faster one; 0.25 then the least (never 0, where compile's partitioner
    drops the random draws autoremat saves: NOTE [ Compile's own memory budget, exact ])
    after an overrun; ``None``: done."""
    if fits:
        return 0.75 if fraction == 0.5 else None
    return {0.5: 0.25, 0.25: LEAST_COMPILE_BUDGET}.get(fraction)


_FIT_ATTEMPTS = 3  # plans fit_compiled measures below the plain step (NOTE above)
_AS_FAST = 1.01  # a fitting candidate within 1% of every block kept's time ends the search




def _with_head_hint(exc: BudgetError, step: Step, chunked: Callable[[], Plan]) -> BudgetError:
    """``exc`` (no plan fits with the loss head kept), saying what the model's head would
    reach computed in chunks, as ``plan`` says it on a tape that measured the head: the
    head's options are measured only now (``chunked`` profiles and plans them), since
    ``auto`` skips them when the head is kept."""
    site, _ = find_head(step.model, step.inputs, step.loss_fn)
    if site is None or "loss head" in str(exc):
        return exc
    changes = ("it changes the loss and the projection's weight gradient by summation "
               "order; auto(..., head='auto'), or AutorematCallback(head='auto') under the "
               "Trainer")
    try:
        fits = chunked()
    except BudgetError as again:
        if again.min_feasible_bytes is None or (exc.min_feasible_bytes is not None
                                                and again.min_feasible_bytes
                                                >= exc.min_feasible_bytes):
            return exc
        return exc.with_message(
            f"{exc}. The model's loss head {site} was kept (head=None); computed in chunks "
            f"of tokens, the smallest feasible budget is "
            f"{format_bytes(again.min_feasible_bytes)} ({again.min_feasible_bytes} bytes) "
            f"({changes})")
    return exc.with_message(
        f"{exc}. The model's loss head {site} was kept (head=None); computed in chunks of "
        f"tokens ({fits.head.head_key}) a plan fits this budget, predicted "
        f"{format_bytes(fits.predicted_peak_bytes)} ({changes})")


def _measured_peak(step: Step, applied: Plan, backend: str | None) -> int:
    """The step peak with ``applied`` applied: eagerly the allocator's on CUDA (the rise
    of ``max_memory_allocated``), the storage tracker's elsewhere; with ``backend`` the
    allocator's peak of the step compiled whole (NOTE [ Compiled plans are fitted by
    measurement ])."""
    if backend is not None:
        return compiled_whole(step, applied, backend, timed=False)[0]
    # on CUDA the caching allocator is the truth (docs/design.md): its rounding and the
    # blocks it hands out can put a step over a prediction made from storages, and the
    # retry below then plans for a budget smaller by that overrun
    step = dataclasses.replace(step, loop=applied.loop)
    found = measure_step(step, memory="storages", allocator=True)
    return found.allocator_peak_bytes if found.allocator_peak_bytes is not None \
        else found.peak_bytes
