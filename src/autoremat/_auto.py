"""``auto``: profile, plan and apply in one call, then measure that the plan fits.

The one place that composes the stages; each of them stays usable on its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from autoremat._apply import apply, remove
from autoremat._core.errors import BudgetError, check_flag
from autoremat._core.step import Loop, LossFn, Step, as_step
from autoremat._core.units import format_bytes
from autoremat._measure.blocks import BlockSpec
from autoremat._measure.measured import measure_step
from autoremat._mechanism.compiled import compiled_forwards, uncompiled
from autoremat._mechanism.head import find_head
from autoremat._plan.plan import Plan
from autoremat._plan.strategies import check_head, check_plan_args, keeps_head, plan
from autoremat._profile.profile import compile_backend, profile
from autoremat._profile.runs import compile_settings

__all__ = ["auto"]


def auto(model: nn.Module | Step, inputs: Any = None,
         budget: int | float | str | None = None, strategy: str = "optimal", *,
         loss_fn: LossFn | None = None, blocks: BlockSpec = None,
         max_memory: int | str | None = None, optimizer: str | int | None = None,
         loop: Loop | None = None,
         compile: bool | str = False, offload: bool = False,
         head: str | None = None) -> Plan:
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
            (``plan.compiled``) checkpoints blocks one by one. Its prediction, and the
            measurement ``auto`` makes of it, are for regional compilation (each block
            compiled on its own, ``block.compile()``); under whole-model
            ``torch.compile(model)`` the peak can differ a little either way (NOTE [
            Profiling a compiled step ]). ``auto`` compiles only while it measures and
            leaves no compiled wrapper behind: compile the model as you train it.
        offload: let the plan offload blocks to host memory, as for
            :func:`autoremat.plan` (the profile then measures offloaded blocks too). On
            a CPU the host is the device, so nothing is offloaded there.
        head: the loss head's decision, as for :func:`autoremat.plan` (``None``: keep it;
            ``"auto"``: chunk it where that is cheaper).

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
    check_plan_args(budget, strategy, max_memory, optimizer)  # before any work
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
    tape = profile(step, blocks=blocks, compile=backend or False, offload=offload, timing=False,
                   with_head=not keeps_head(head))
    try:
        chosen = plan(tape, budget, strategy, max_memory=max_memory, optimizer=optimizer,
                      offload=offload, head=head)
    except BudgetError as exc:
        raise _with_head_hint(exc, step, head) from None
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
            retry = plan(tape, target, strategy, offload=offload, head=head)
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


def _with_head_hint(exc: BudgetError, step: Step, head: str | None) -> BudgetError:
    """``exc``, saying that the model's loss head could be chunked where ``auto`` kept it
    without measuring that (``plan`` on a tape that measured it says how far it goes)."""
    if not keeps_head(head) or "loss head" in str(exc):
        return exc
    site, _ = find_head(step.model, step.inputs, step.loss_fn)
    if site is None:
        return exc
    return exc.with_message(
        f"{exc}. The model's loss head {site} was kept (head=None): computed in chunks of "
        f"tokens it often needs far less; auto(..., head='auto') measures and plans that "
        f"(AutorematCallback(head='auto') under the Trainer)")


def _measured_peak(step: Step, applied: Plan, backend: str | None) -> int:
    """The step peak with ``applied`` applied: tracked eagerly, or with ``backend`` the
    allocator's peak of the step with every block compiled on its own, as ``profile``
    measured it (NOTE [ auto under torch.compile ])."""
    step = dataclasses.replace(step, loop=applied.loop)
    if backend is None:
        return measure_step(step, memory="storages").peak_bytes
    # NOTE [ auto under torch.compile ]
    #     The tracker's dispatch mode would make Dynamo run the blocks eagerly, so the
    #     compiled step is measured from the allocator's reports (track_allocations), after
    #     a first step that compiles (compiling allocates too). The blocks are compiled
    #     the way profile compiled them (compiled_forwards: each block's forward on its
    #     own, over the checkpoint wrapper the plan installed), which is the step the
    #     plan predicts, and only for the measurement: the user's model gets no compiled
    #     wrapper it did not ask for. A model compiled whole is measured through the
    #     module it wraps, block by block, like any other.
    inner = dataclasses.replace(step, model=uncompiled(step.model))
    names = [block.name for block in applied.blocks]
    with compile_settings(backend), compiled_forwards(inner.model, names, backend):
        return measure_step(inner, memory="allocations", warm_up=True).peak_bytes
