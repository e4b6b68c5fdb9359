"""``estimate``: the peak memory of a training step, measured on fake (``meta``) tensors.

The same instrumented step :func:`autoremat.profile` runs, but on the ``meta`` device,
where every op computes shapes and allocates nothing. So the peak of a 7B-parameter
model's step can be measured on a laptop, for a device that is not there (``cuda`` at
``bf16``). To it we add what lives outside the step: parameters, buffers, the batch,
the optimizer's state (measured by running the real ``torch.optim`` class on ``meta``)
and the optimizer step's own temporaries.

How the step runs on ``meta`` for a device that is not there is explained in ``fake.py``:
NOTE [ Attention on meta ] (attention as the target device would run it) and
NOTE [ Hugging Face models on meta ] (Transformers models without mask building). The
tracked step is in ``tracked_step.py``, the optimizer's memory in ``optimizers.py``.

NOTE [ Total peak ]
    A training iteration has two peaks; the larger one is ``total_peak_bytes``::

        resting = parameters + buffers + optimizer state + batch
        forward/backward:  resting + step_peak_bytes        (step peak includes .grad)
        optimizer.step():  resting + grad_bytes + optimizer_step_bytes

    ``optimizer_step_bytes`` are the temporaries of a steady-state ``step()`` (the
    ``foreach`` AdamW used on CUDA holds one parameter-sized temporary). The rule lives
    in one place, ``IterationMemory`` in ``_plan/budget.py``, which also turns
    ``max_memory`` into the step budget for ``plan`` and ``estimate`` alike (NOTE [ From
    max_memory to a step budget ]).

Known limitations:
    * Those of ``fake.py``: attention bound at import (``from torch.nn.functional import
      scaled_dot_product_attention``) runs the math kernel, an overestimate; parameters
      that are views of one storage are counted once per parameter.
    * For a ``cuda`` target the step's storages are counted in the caching allocator's
      512-byte blocks (NOTE [ CUDA allocator rounding ] in ``memory.py``); parameters,
      buffers, the batch and optimizer state are counted in exact bytes (at most 511
      bytes a tensor less than the allocator). Not modelled: blocks the allocator leaves
      unsplit, fragmentation, and kernels' workspaces (cuBLAS, flash-attention backward's
      fp32 accumulators), invisible to storage accounting. Keep some headroom.
    * A model that reads tensor values in forward (``.item()``, data-dependent shapes)
      cannot run on ``meta``; the error says so and what to do. Transformers' attention
      masks and mixture-of-experts layers with grouped matmuls do run (NOTE [ Hugging
      Face models on meta ], NOTE [ Grouped matmuls on meta ] in ``fake.py``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import nn

from autoremat._core.conditions import autocast_devices
from autoremat._core.errors import (
    BudgetError,
    InternalError,
    RematError,
    check_flag,
    check_whole,
)
from autoremat._core.files import dump_json
from autoremat._core.step import (
    Loop,
    LossFn,
    Step,
    as_step,
    describe_inputs,
    preserved_state,
    unique_storage_bytes,
)
from autoremat._core.units import format_bytes, format_flops, parse_budget
from autoremat._estimate.fake import (
    _resolve_device,
    parse_dtype,
    refused_on_meta,
    step_as_on,
    to_meta,
)
from autoremat._estimate.tracked_step import (
    LOSS_CHUNKS,
    LiveTensor,
    _live_at_peak,
    _saved,
    _tracked_step,
    chunked_loss_peak,
    target_rounding,
)
from autoremat._measure.blocks import BlockSpec, resolve_blocks
from autoremat._measure.optimizers import _optimizer_class, optimizer_memory
from autoremat._measure.tape import Tape
from autoremat._mechanism.wrap import refuse_applied
from autoremat._plan.budget import (
    IterationMemory,
    check_shards,
    fsdp_param_bytes,
    step_budget_bytes,
)
from autoremat._plan.strategies import plan as make_plan
from autoremat._profile.profile import profile

__all__ = ["Estimate", "estimate"]

ESTIMATE_SCHEMA_VERSION = 1


# --- the result --------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """What one training step will need, measured on fake tensors. ``print(est)`` shows a
    breakdown; all memory figures are bytes on the estimated device."""

    model: str  # class name
    inputs: str  # shapes and dtypes of the batch (after the dtype cast)
    device: str  # the device estimated, e.g. "cuda"
    dtype: str | None  # the dtype floating parameters and inputs were cast to, if any
    step_peak_bytes: int  # forward+backward peak, no checkpointing (includes .grad)
    ckpt_step_peak_bytes: int  # the same with every block checkpointed
    peak_breakdown: dict[str, int]  # activations / gradients / temporaries at the step peak
    ckpt_peak_breakdown: dict[str, int]  # the same, every block checkpointed
    param_count: int  # number of parameters (unique)
    param_bytes: int  # all parameters
    trainable_param_bytes: int
    buffer_bytes: int
    input_bytes: int  # the batch
    grad_bytes: int  # one gradient per trainable parameter, in its dtype
    optimizer: str | None  # name, "<n> bytes" or None
    optimizer_bytes: int  # optimizer state
    optimizer_step_bytes: int  # temporaries of optimizer.step() (steady state)
    activation_bytes: int  # made in forward, alive when backward starts
    activations_by_block: dict[str, int]  # per block, plus "(outside blocks)"
    activations_by_kind: dict[str, int]  # by the kind of op that made them
    largest_tensors: tuple[LiveTensor, ...]  # the biggest storages alive at the step peak
    head_chunked_step_peak_bytes: int | None  # step peak with the loss in 8 chunks
    ckpt_head_chunked_step_peak_bytes: int | None  # the same, every block checkpointed
    step_fwd_flops: int
    step_bwd_flops: int
    ckpt_recompute_flops: int  # extra forward FLOPs with every block checkpointed
    budget_bytes: int | None = None  # the step budget a plan was asked for
    strategy: str | None = None
    plan_peak_bytes: int | None = None  # the plan's predicted step peak
    plan_recompute_flops: int | None = None
    throughput_flops: float | None = None  # FLOP/s the user said the device sustains
    loop: Loop = "holds_output"  # the training loop the step figures are for (step.Loop)
    # FSDP ranks the parameters, gradients and optimizer state are sharded over, which
    # the iteration's figures count per rank (NOTE [ Sharded over N ranks ] in budget.py)
    shards: int = 1
    notes: tuple[str, ...] = ()
    tape: Tape | None = field(default=None, repr=False, compare=False)
    plan: Any = field(default=None, repr=False, compare=False)

    # -- derived figures -------------------------------------------------------------
    @property
    def step_flops(self) -> int:
        return self.step_fwd_flops + self.step_bwd_flops

    @property
    def iteration_memory(self) -> IterationMemory:
        """What the iteration holds besides the step's peak, as ``plan`` reads it from a
        tape (NOTE [ From max_memory to a step budget ] in ``budget.py``), on one of
        ``shards`` ranks (NOTE [ Sharded over N ranks ]; the optimizer's step counters,
        measured within its state, are divided too: a few bytes per tensor)."""
        n = self.shards
        params = self.param_bytes if n == 1 else fsdp_param_bytes(
            self.param_bytes, [b.param_bytes for b in self.tape.blocks]
            if self.tape is not None else [], n)
        return IterationMemory(
            param_bytes=params, buffer_bytes=self.buffer_bytes,
            optimizer_bytes=self.optimizer_bytes // n, input_bytes=self.input_bytes,
            grad_bytes=self.grad_bytes // n, optimizer_step_bytes=self.optimizer_step_bytes // n)

    @property
    def resting_bytes(self) -> int:
        """Held for the whole iteration: parameters, buffers, optimizer state, the batch."""
        return self.iteration_memory.resting_bytes

    def total_for(self, step_peak: int) -> int:
        """Device peak of an iteration whose forward+backward peaks at ``step_peak``."""
        return self.iteration_memory.peak_bytes(step_peak)

    @property
    def total_peak_bytes(self) -> int:
        """Device peak of one iteration without checkpointing (see NOTE [ Total peak ])."""
        return self.total_for(self.step_peak_bytes)

    @property
    def ckpt_total_peak_bytes(self) -> int:
        return self.total_for(self.ckpt_step_peak_bytes)

    @property
    def plan_total_peak_bytes(self) -> int | None:
        return None if self.plan_peak_bytes is None else self.total_for(self.plan_peak_bytes)

    @property
    def recompute_overhead(self) -> float | None:
        """The plan's extra FLOPs over the plain step's (0.25 = 25% more)."""
        if self.plan_recompute_flops is None or not self.step_flops:
            return None
        return self.plan_recompute_flops / self.step_flops

    @property
    def ckpt_recompute_overhead(self) -> float:
        return self.ckpt_recompute_flops / self.step_flops if self.step_flops else 0.0

    @property
    def step_seconds(self) -> float | None:
        """Step time at ``throughput_flops`` (FLOPs / throughput), when it was given."""
        return None if not self.throughput_flops else self.step_flops / self.throughput_flops

    @property
    def plan_step_seconds(self) -> float | None:
        if not self.throughput_flops or self.plan_recompute_flops is None:
            return None
        return (self.step_flops + self.plan_recompute_flops) / self.throughput_flops

    def with_plan(self, budget: int | str | None = None, strategy: str = "optimal", *,
                  max_memory: int | str | None = None, offload: bool = False) -> Estimate:
        """This estimate plus the plan the planner makes from its tape for ``budget`` (the
        step's) or ``max_memory`` (the whole device); with ``offload`` (an estimate made
        with ``offload=True``), a plan that may offload. See :func:`estimate`."""
        if self.tape is None:
            raise RematError("this estimate has no tape to plan from (it was loaded from JSON)")
        if (budget is None) == (max_memory is None):
            raise BudgetError("give exactly one of budget= (the step's own budget) or "
                              "max_memory= (the whole device, parameters included)")
        return _with_plan(self, self.tape, budget, max_memory, strategy, offload)

    # -- output ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)
                                if f.name not in ("tape", "plan")}
        data["largest_tensors"] = [asdict(t) for t in self.largest_tensors]
        data["tape"] = self.tape.to_dict() if self.tape is not None else None
        for name in ("step_flops", "resting_bytes", "total_peak_bytes",
                     "ckpt_total_peak_bytes", "plan_total_peak_bytes", "recompute_overhead",
                     "ckpt_recompute_overhead", "step_seconds", "plan_step_seconds"):
            data[name] = getattr(self, name)
        data["plan"] = self.plan.to_dict() if self.plan is not None else None
        data["schema_version"] = ESTIMATE_SCHEMA_VERSION
        return data

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """The JSON text (``schema_version`` included); with ``path``, written atomically."""
        return dump_json(self.to_dict(), path)

    def __str__(self) -> str:
        return _render(self)


def _exact(n: int) -> str:
    return f"{format_bytes(n):>11}  ({n:,} B)"


def _breakdown(parts: dict[str, int]) -> str:
    return ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items() if v)


def _render(est: Estimate) -> str:
    dtype = f" at {est.dtype}" if est.dtype else ""
    opt = est.optimizer or "none"
    sharded = (f"; per rank, parameters, gradients and optimizer state sharded over "
               f"{est.shards} ranks (the figures below are whole)" if est.shards > 1 else "")
    lines = [
        f"Estimate for {est.model} on {est.device}{dtype}; batch {est.inputs}; loop {est.loop}"
        + sharded,
        f"  parameters        {_exact(est.param_bytes)}  {est.param_count:,} parameters",
        f"  gradients         {_exact(est.grad_bytes)}",
        f"  optimizer state   {_exact(est.optimizer_bytes)}  {opt}",
        f"  buffers           {_exact(est.buffer_bytes)}",
        f"  batch             {_exact(est.input_bytes)}",
        f"  step peak         {format_bytes(est.step_peak_bytes):>11}  forward+backward, "
        f"no checkpointing ({_breakdown(est.peak_breakdown)})",
        f"  all checkpointed  {format_bytes(est.ckpt_step_peak_bytes):>11}  every block "
        f"recomputed, +{100 * est.ckpt_recompute_overhead:.1f}% FLOPs",
        f"  optimizer step    {format_bytes(est.optimizer_step_bytes):>11}  temporaries of "
        f"step(), with the gradients alive",
        f"  total peak        {format_bytes(est.total_peak_bytes):>11}  no checkpointing; "
        f"{format_bytes(est.ckpt_total_peak_bytes)} with every block checkpointed",
    ]
    if est.plan_peak_bytes is not None and est.plan_total_peak_bytes is not None:
        overhead = est.recompute_overhead or 0.0
        lines.append(f"  with the plan     {format_bytes(est.plan_total_peak_bytes):>11}  "
                     f"step peak {format_bytes(est.plan_peak_bytes)} (budget "
                     f"{format_bytes(est.budget_bytes or 0)}, {est.strategy}), recompute "
                     f"+{100 * overhead:.1f}% FLOPs")
    lines.append(f"Saved for backward: {format_bytes(est.activation_bytes)}")
    lines.append("  by op kind: " + ", ".join(
        f"{k} {format_bytes(v)}" for k, v in est.activations_by_kind.items()))
    lines.extend(_block_lines(est.activations_by_block))
    lines.append("Largest tensors alive at the step peak:")
    for t in est.largest_tensors:
        lines.append(f"  {format_bytes(t.nbytes):>11}  {t.kind:<10}  {t.op:<40}  {t.where}")
    timing = f"; {est.step_seconds:.3f} s at {format_flops(est.throughput_flops or 0, 'FLOP')}/s" \
        if est.step_seconds is not None else ""
    fwd, bwd, step = (format_flops(n, "FLOP")
                      for n in (est.step_fwd_flops, est.step_bwd_flops, est.step_flops))
    lines.append(f"FLOPs: forward {fwd}, backward {bwd}, step {step}{timing}")
    if est.plan_step_seconds is not None:
        lines.append(f"  with the plan: {est.plan_step_seconds:.3f} s")
    lines.extend(f"Note: {n}" for n in est.notes)
    return "\n".join(lines)


def _block_lines(by_block: dict[str, int]) -> list[str]:
    blocks = {k: v for k, v in by_block.items() if k != "(outside blocks)"}
    outside = by_block.get("(outside blocks)", 0)
    sizes = set(blocks.values())
    if len(blocks) > 6 and len(sizes) == 1:
        out = [f"  by block: {len(blocks)} blocks x {format_bytes(sizes.pop())}"]
    elif len(blocks) > 6:
        names = list(blocks)
        shown = [*names[:3], *names[-2:]]
        out = ["  by block: " + ", ".join(f"{n} {format_bytes(blocks[n])}" for n in shown[:3])
               + f", ... ({len(names) - 5} more) ..., "
               + ", ".join(f"{n} {format_bytes(blocks[n])}" for n in shown[3:])]
    else:
        out = ["  by block: " + ", ".join(f"{n} {format_bytes(v)}" for n, v in blocks.items())]
    out[0] += f"; outside blocks {format_bytes(outside)}"
    return out


# --- the entry point ---------------------------------------------------------------------


def _recurrent_note(model: nn.Module) -> list[str]:
    """A note where ``model`` has recurrent layers, which meta runs another way than the
    devices do: ATen's generic loop over the steps, where the CPU runs oneDNN's kernels
    (an LSTM's keeps a workspace for backward) or projects every step's input at once,
    and CUDA runs cuDNN. Stacks of 3 layers, measured on the CPU against their estimate:
    LSTMs (4 x 16 x 32) 2.0x the estimate, plain RNNs 1.10x, GRUs 0.99x-1.04x."""
    rnns = [name for name, m in model.named_modules() if isinstance(m, nn.RNNBase)]
    if not rnns:
        return []
    return [f"{len(rnns)} recurrent layer(s) ({rnns[0]!r}{', ...' if len(rnns) > 1 else ''}) "
            f"run on meta as ATen's generic loop over the time steps; the CPU runs "
            f"oneDNN's kernels and CUDA cuDNN's, which keep other tensors for backward, so "
            f"their step peaks differ from this estimate, by up to 2x (3 LSTMs: 2.0x this "
            f"estimate on the CPU, 3 GRUs 1.04x): measure such a model with "
            f"autoremat.profile on the device"]


# NOTE [ Autocast on meta ]
#     Autocast casts by the device of the tensors an op gets, and no autocast mode covers
#     ``meta``: inside ``torch.autocast``, ``estimate`` ran the uncast step, and its tape
#     still recorded the autocast it was called under. A held-out sweep (2026-11-30) found
#     every bfloat16 estimate at its model's float32 figure (1.15-1.55x the profile), and,
#     where autocast's bfloat16 weight copies outweigh the activations, under the profile:
#     a plan at the estimate's smallest budget measured 5.7% over it. It is refused.


def estimate(
    model: nn.Module | Step,
    inputs: Any = None,
    budget: int | str | None = None,
    strategy: str = "optimal",
    *,
    loss_fn: LossFn | None = None,
    blocks: BlockSpec = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    optimizer: str | int | None = None,
    throughput_flops: float | None = None,
    max_memory: int | str | None = None,
    selective: bool = True,
    top: int = 8,
    loop: Loop | None = None,
    offload: bool = False,
    host_bandwidth: float | None = None,
    shards: int = 1,
    progress: Callable[[str], None] | None = None,
) -> Estimate:
    """Predict the memory of one training step without running it for real.

    Args:
        model: the model, in train mode; on ``meta`` (built under ``torch.device("meta")``)
            or on a real device, in which case a ``meta`` copy is made (no data copied).
            Or an :class:`autoremat.Step`, which carries ``inputs``, ``loss_fn`` and
            ``loop`` (the rest by keyword: ``estimate(step, device="cuda")``).
        inputs: a tensor, a tuple of positional args or a dict of keyword args, on any
            device; they are remade on ``meta``.
        budget: with ``strategy``, ask the planner for a plan under this step budget
            (bytes, ``"6GiB"``, ``"50%"`` of the unplanned step peak); for a CUDA device
            the plan keeps :func:`autoremat.plan`'s default margin (3%) of it for the
            allocator's blocks (NOTE [ The margin kept for the CUDA allocator ]).
        max_memory: instead of ``budget``, the device's whole memory: the step budget is
            what parameters, buffers, optimizer state and the batch leave of it, by the
            rule :func:`autoremat.plan` follows (NOTE [ From max_memory to a step
            budget ] in ``budget.py``).
        loss_fn, blocks: as for :func:`autoremat.profile`.
        device: the device to estimate for (``"cuda"``, ``"cpu"``); it need not exist.
            Default: the model's device, or ``"cuda"`` for a model on ``meta``.
        dtype: cast floating parameters, buffers and inputs to this (``"bf16"``).
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd-momentum"``, ``"rmsprop"``,
            ``"adagrad"`` (measured with the real class on ``meta``), a number of bytes,
            or ``None`` for no optimizer state.
        throughput_flops: sustained FLOP/s of the device, to turn FLOPs into seconds.
        selective: also measure selective-recompute options, so that plans made from
            this estimate can use them (derived from the checkpointed pass where they
            can be, else one more pass each; cheap on meta).
        top: how many of the largest live tensors to report.
        loop: the training loop to estimate, as for :func:`autoremat.profile`:
            ``"holds_output"`` (default, also for ``None``) keeps the model's output
            (logits) alive through backward, as ``out = model(**batch);
            out.loss.backward()`` does; ``"loss_only"`` releases it before backward.
        offload: also measure every block offloaded to host memory (and checkpointed
            with its input offloaded), and let the plan offload (``plan(...,
            offload=True)``). The step runs on ``meta``, so the host copies are simply
            not counted: the device peak of an offload plan is what the target's
            allocator would see (NOTE [ Offloading saved tensors ]).
        host_bandwidth: bytes per second between the target device and host memory,
            which cost offload in the plan; default ``DEFAULT_HOST_BANDWIDTH`` (25e9,
            pinned copies over PCIe 4.0 x16; measure yours with ``profile`` on the GPU).
        shards: the ranks FSDP2 shards parameters, gradients and optimizer state over,
            as for :func:`autoremat.plan`: the total peaks and ``max_memory``'s budget
            are per rank (the parameter, gradient and optimizer lines stay whole).
        progress: called with the name of each stage as it starts, for a progress
            display (as for :func:`autoremat.profile`); default: nothing.

    Returns:
        A frozen :class:`Estimate`.

    Raises:
        BudgetError: the budget cannot be met (``min_feasible_bytes`` says what can).
        RematError: the model cannot run on ``meta``, an option is wrong, or it was
            called inside ``torch.autocast``, which does not cast on ``meta`` (NOTE
            [ Autocast on meta ]).

    Example:
        >>> import autoremat
        >>> model, inputs = autoremat.zoo.build("gpt2", device="meta", n_layer=2, seq_len=32)
        >>> est = estimate(model, inputs, device="cuda", dtype="bf16", optimizer="adamw")
        >>> est.optimizer_bytes == 2 * est.trainable_param_bytes  # two bf16 states
        True
        >>> est.step_peak_bytes > 0
        True
    """
    step = as_step(model, inputs, loss_fn, loop, caller="estimate", keyword="budget")
    refuse_applied(step.model, "estimate")
    if budget is not None and max_memory is not None:
        raise BudgetError("give either budget= (the step's own budget) or max_memory= (the "
                          "whole device, parameters and optimizer included), not both")
    check_shards(shards)
    check_flag("offload", offload)
    check_flag("selective", selective)
    check_whole("top", top, 0, "how many of the largest live tensors to list")
    if throughput_flops is not None and not (isinstance(throughput_flops, (int, float))
                                             and math.isfinite(throughput_flops)
                                             and throughput_flops > 0):
        raise RematError(f"throughput_flops must be a positive number of FLOP/s, e.g. 4e14, "
                         f"got {throughput_flops!r}")
    if host_bandwidth is not None and not offload:
        raise RematError("host_bandwidth= only matters with offload=True; pass both, or "
                         "neither")
    casting = autocast_devices()
    if casting:  # NOTE [ Autocast on meta ]
        raise RematError(
            f"estimate() was called inside torch.autocast({casting[0]!r}): it runs the step "
            f"on meta tensors, where autocast casts nothing, so its figures would be those "
            f"of the uncast step (1.15-1.55x a bfloat16 profile on held-out models, and "
            f"under it where autocast's weight copies dominate), not the autocast step's. "
            f"Call it outside autocast: with dtype='bf16' for a step in bfloat16 throughout "
            f"(an approximation of mixed precision), or profile() the step under autocast "
            f"on a device for its figures")
    target = _resolve_device(step.model, device)
    target_type = torch.device(target).type
    rounding = target_rounding(target_type)  # NOTE [ CUDA allocator rounding ] in memory.py
    cast = parse_dtype(dtype)
    _optimizer_class(optimizer)  # a misspelt name fails before any work
    given = step.inputs  # the caller's batch: its attention masks have values
    model, inputs = to_meta(step.model, step.inputs, cast)
    step = dataclasses.replace(step, model=model, inputs=inputs)
    resolve_blocks(model, blocks)  # a wrong name fails before any work
    stage = progress or (lambda _: None)
    with refused_on_meta(model, given), preserved_state(model), \
            step_as_on(target_type, model, inputs, given) as hf_notes:
        # the tape is for the target (its costs, tape.device), not for meta
        # blocks as given: found ones are put in the order they run, as profile does
        tape = profile(step, blocks=blocks, repeats=1,
                       with_selective=selective, rounding=rounding,
                       device=target, offload=offload,
                       host_bandwidth=(host_bandwidth or DEFAULT_HOST_BANDWIDTH)
                       if offload else None, progress=progress)
        names = [b.name for b in tape.blocks]
        stage("tracked steps: what is live at the peak")
        plain = _tracked_step(step, names, checkpoint_all=False, rounding=rounding)
        ckpt = _tracked_step(step, names, checkpoint_all=True, rounding=rounding)
    opt_name = optimizer if isinstance(optimizer, str) or optimizer is None else \
        f"{optimizer} bytes"
    opt_bytes, opt_step_bytes = optimizer_memory(model, optimizer, target_type)

    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    saved = _saved(plain)
    by_kind: dict[str, int] = {}
    for _, kind, nbytes in saved:
        by_kind[kind] = by_kind.get(kind, 0) + nbytes
    activation_bytes = sum(n for _, _, n in saved)
    by_block = {b.name: b.saved_bytes for b in tape.blocks}
    by_block["(outside blocks)"] = max(0, activation_bytes - sum(by_block.values()))
    notes = [f"attention runs the kernel {target_type} would pick "
             f"(see NOTE [ Attention on meta ]); times are not measured on meta", *hf_notes]
    if rounding == "cuda":
        notes.append("the step's storages are counted in the CUDA caching allocator's "
                     "512-byte blocks (parameters, optimizer state and the batch exactly)")
    notes.extend(plain.mem.notes)
    notes.extend(_recurrent_note(model))

    est = Estimate(
        model=type(model).__name__, inputs=describe_inputs(inputs), device=target,
        dtype=str(cast).removeprefix("torch.") if cast is not None else None,
        step_peak_bytes=tape.step_peak_bytes, ckpt_step_peak_bytes=tape.ckpt_step_peak_bytes,
        peak_breakdown=dict(tape.peak_breakdown), ckpt_peak_breakdown=ckpt.mem.breakdown,
        param_count=sum(p.numel() for p in params),
        param_bytes=unique_storage_bytes(params),
        trainable_param_bytes=unique_storage_bytes(trainable),
        buffer_bytes=unique_storage_bytes(list(model.buffers())),
        input_bytes=unique_storage_bytes(inputs), grad_bytes=unique_storage_bytes(trainable),
        optimizer=opt_name, optimizer_bytes=opt_bytes, optimizer_step_bytes=opt_step_bytes,
        activation_bytes=activation_bytes, activations_by_block=by_block,
        activations_by_kind=dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        largest_tensors=_live_at_peak(plain, top),
        head_chunked_step_peak_bytes=chunked_loss_peak(plain, LOSS_CHUNKS),
        ckpt_head_chunked_step_peak_bytes=chunked_loss_peak(ckpt, LOSS_CHUNKS),
        step_fwd_flops=tape.step_fwd_flops, step_bwd_flops=tape.step_bwd_flops,
        ckpt_recompute_flops=sum(b.fwd_flops for b in tape.blocks),
        throughput_flops=throughput_flops, loop=step.loop, shards=shards, notes=tuple(notes),
        tape=tape,
    )
    if budget is None and max_memory is None:
        return est
    stage("planning")
    return est.with_plan(budget, strategy, max_memory=max_memory, offload=offload)


DEFAULT_HOST_BANDWIDTH = 25e9  # bytes/s: pinned copies over PCIe 4.0 x16, each way


def _with_plan(est: Estimate, tape: Tape, budget: int | str | None,
               max_memory: int | str | None, strategy: str, offload: bool = False) -> Estimate:
    if max_memory is not None:
        budget = step_budget_bytes(max_memory, est.iteration_memory)
    if budget is None:
        raise InternalError("autoremat internal error (please report it): no budget to plan for")
    budget_bytes = parse_budget(budget, tape.step_peak_bytes)
    plan = make_plan(tape, budget=budget_bytes, strategy=strategy, offload=offload,
                     shards=est.shards)
    return dataclasses.replace(est, budget_bytes=budget_bytes, strategy=strategy, plan=plan,
                               plan_peak_bytes=int(plan.predicted_peak_bytes),
                               plan_recompute_flops=int(plan.predicted_recompute_flops))
