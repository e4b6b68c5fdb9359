"""From a device's memory to the step's budget: one rule for ``plan`` and ``estimate``.

NOTE [ From max_memory to a step budget ]
    The step peak (docs/design.md, "What peak means") is measured above the level just
    before the forward, with gradients set to ``None``: it includes activations,
    gradients and temporaries, and excludes everything alive before the forward. An
    iteration's device peak is therefore::

        resting = parameters + buffers + optimizer state + batch
        peak    = resting + max(step peak, gradients + optimizer.step()'s temporaries)

    and the step budget ``max_memory`` leaves is ``max_memory - resting``.

    * The batch is in ``resting``: it is on the device before the forward starts, so no
      step peak counts it. (``plan`` used to leave it out, and its plans could overrun
      ``max_memory`` by the batch.)
    * The optimizer state is the table's states per parameter, plus the scalar step
      counters on a CPU (``_measure/optimizers.py``); ``estimate`` measures the same figure
      with the real class, and ``tests/test_optimizers.py`` keeps the two equal.
    * Gradients and the optimizer step's temporaries are not subtracted: the gradients
      are inside the step peak already (subtracting them would count them twice), and
      ``optimizer.step()`` runs after backward has freed the activations, a second peak
      rather than a share of the first. They decide only whether ``max_memory`` can hold
      an iteration at all, whatever is recomputed: ``resting + gradients + temporaries``.
      (``estimate`` checked that and ``plan`` did not.) A tape does not know the
      temporaries (they depend on the implementation and on each tensor's size), so
      :func:`iteration_memory` leaves them at 0; ``estimate`` measures them.

NOTE [ Sharded over N ranks ]
    Under FSDP2's ``fully_shard`` each of N ranks holds 1/N of every parameter, of its
    gradient after the reduce-scatter, and of the optimizer state that follows the
    parameters; ``plan(..., shards=N)`` divides those three by N (FSDP pads a dimension
    0 that N does not divide, a few bytes per tensor that we ignore). Not divided:
    buffers (``fully_shard`` leaves them whole on every rank), the optimizer's scalar
    step counters (one per parameter tensor on every rank) and the batch (the tape
    measured one rank's batch). Under DDP nothing is sharded: ``shards=1``.

    A rank also holds whole the parameters of the units FSDP has all-gathered: the
    root's (the parameters outside the blocks: embeddings, the head), which FSDP2 does
    not reshard after the forward (its ``reshard_after_forward`` is False for the root),
    so they stay gathered for the whole step; and a block's, the one running and the one
    it prefetches. :func:`fsdp_param_bytes` counts the root's and two of the largest
    block's in the parameters, the rule ``autoremat doctor`` uses for its FSDP remedy
    too. Measured with two gloo ranks (``tests/test_distributed.py``): the root gathered
    at every block's forward and backward, one block besides it (no prefetch there; on
    CUDA FSDP2 prefetches the next block in backward). The rule before counted two of
    the largest unit, root included: 2.4 GiB over for a RecurrentGemma whose 256k-token
    embedding is 60 times a block, and under where the root is below twice a block (a 7B
    Llama's embedding and head are 1.3 blocks: 3.3 blocks gathered, 2.6 counted).

    The step peak itself comes from the tape, measured in one process with the whole
    model, and its gradients are whole: under FSDP a rank keeps 1/N of them, so late
    in the backward the tape's peak is above the rank's by up to (1 - 1/N) of the
    gradients. ``plan`` does not take that off (which gradients are alive at a plan's
    peak depends on the plan), so its plans are on the safe side; check a tight
    ``max_memory`` on one rank (``autoremat.track_memory``) before a long run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from autoremat._core.errors import BudgetError, check_whole
from autoremat._core.units import format_bytes, parse_size
from autoremat._measure.optimizers import OptimizerSpec, resolve_optimizer
from autoremat._measure.tape import Tape

__all__ = ["CUDA_MARGIN", "IterationMemory", "budget_for", "check_margin", "check_shards",
           "fsdp_param_bytes", "iteration_memory", "margin_for", "optimizer_state_bytes",
           "room_bytes", "step_budget_bytes"]

# The share of a CUDA budget a plan leaves for the allocator's whole blocks (NOTE [ The
# margin kept for the CUDA allocator ]): above the largest excess measured (2.33%).
CUDA_MARGIN = 0.03


def margin_for(device: str, margin: float | None = None) -> Fraction:
    """The margin a plan for a tape on ``device`` keeps: ``margin`` if given (a share of
    the budget's planned room, 0 <= margin < 1), else ``CUDA_MARGIN`` on a CUDA device
    and 0 elsewhere (NOTE [ The margin kept for the CUDA allocator ]).

    Raises:
        BudgetError: ``margin`` is not a number in [0, 1).

    Example:
        >>> margin_for("cuda"), margin_for("cuda:1", 0), margin_for("cpu")
        (Fraction(3, 100), Fraction(0, 1), Fraction(0, 1))
    """
    check_margin(margin)
    if margin is None:
        on_cuda = device.split(":")[0] == "cuda"
        return Fraction(str(CUDA_MARGIN)) if on_cuda else Fraction(0)
    return Fraction(str(margin))


def check_margin(margin: float | None) -> None:
    """Raise :class:`BudgetError` unless ``margin`` is ``None`` or a number in [0, 1).

    Example:
        >>> check_margin(0.03)
    """
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or not 0 <= margin < 1):
        raise BudgetError(f"margin must be a number in [0, 1), the share of the budget kept "
                          f"for what the CUDA allocator adds (0.03 is 3%), got {margin!r}")


def room_bytes(budget: int, margin: Fraction) -> int:
    """The step peak a plan may predict under ``budget`` keeping ``margin``:
    ``floor(budget / (1 + margin))``.

    Example:
        >>> room_bytes(1030, Fraction(3, 100)), room_bytes(1000, Fraction(0))
        (1000, 1000)
    """
    return math.floor(budget / (1 + margin))  # Fraction: exact


def budget_for(peak: int, margin: Fraction) -> int:
    """The smallest budget whose room (:func:`room_bytes`) holds a predicted ``peak``:
    ``ceil(peak * (1 + margin))``.

    Example:
        >>> budget_for(1000, Fraction(3, 100)), room_bytes(budget_for(999, Fraction(3, 100)),
        ...                                                Fraction(3, 100))
        (1030, 999)
    """
    return math.ceil(peak * (1 + margin))  # Fraction: exact


@dataclass(frozen=True)
class IterationMemory:
    """What a training iteration holds on the device besides its step's own peak, in
    bytes (NOTE [ From max_memory to a step budget ])."""

    param_bytes: int  # all parameters
    buffer_bytes: int
    optimizer_bytes: int  # optimizer state
    input_bytes: int  # the batch
    grad_bytes: int  # inside the step peak too; alive through optimizer.step()
    optimizer_step_bytes: int = 0  # temporaries of optimizer.step(); 0 where not measured

    @property
    def resting_bytes(self) -> int:
        """Held for the whole iteration: parameters, buffers, optimizer state, the batch."""
        return self.param_bytes + self.buffer_bytes + self.optimizer_bytes + self.input_bytes

    def peak_bytes(self, step_peak: int) -> int:
        """Device peak of an iteration whose forward+backward peaks at ``step_peak``."""
        return self.resting_bytes + max(step_peak, self.grad_bytes + self.optimizer_step_bytes)


def iteration_memory(tape: Tape, optimizer: str | int | None, shards: int = 1
                     ) -> IterationMemory:
    """An iteration's memory outside the step, from a tape and an optimizer (a name in
    ``OPTIMIZERS``, the state in bytes, or ``None``), on one of ``shards`` ranks that
    shard parameters, gradients and optimizer state (NOTE [ Sharded over N ranks ]); the
    optimizer step's temporaries are not known from a tape and are left at 0.

    Raises:
        BudgetError: an unknown optimizer, or a tape saved before autoremat recorded the
            batch's bytes and the number of trainable tensors.
    """
    if tape.input_bytes < 0 or tape.trainable_param_tensors < 0:
        raise BudgetError("this tape was saved by an older autoremat, which did not record "
                          "the batch's bytes (tape.input_bytes) or the trainable tensors "
                          "(tape.trainable_param_tensors) that max_memory= needs; profile "
                          "again, or give the step's own budget= instead")
    check_shards(shards)
    spec = resolve_optimizer(optimizer)
    state = optimizer_state_bytes(tape, optimizer) // shards
    if isinstance(spec, OptimizerSpec):
        state += spec.counter_bytes(tape.trainable_param_tensors, tape.device)
    params = tape.param_bytes if shards == 1 else fsdp_param_bytes(
        tape.param_bytes, [b.param_bytes for b in tape.blocks], shards)
    return IterationMemory(param_bytes=params, buffer_bytes=tape.buffer_bytes,
                           optimizer_bytes=state, input_bytes=tape.input_bytes,
                           grad_bytes=tape.grad_bytes // shards)


def fsdp_param_bytes(param_bytes: int, block_param_bytes: list[int], shards: int) -> int:
    """Parameter bytes one of ``shards`` FSDP ranks holds at most: its shard of all of
    them, plus the root whole (the parameters outside the blocks) and two of the largest
    block (NOTE [ Sharded over N ranks ]).

    Example:
        >>> fsdp_param_bytes(1000, [100, 100, 100], shards=4)  # 250 + root 700 + 2 * 100
        1150
    """
    root = max(param_bytes - sum(block_param_bytes), 0)
    return param_bytes // shards + root + 2 * max(block_param_bytes, default=0)


def check_shards(shards: int) -> None:
    """Raise :class:`BudgetError` unless ``shards`` is a whole number >= 1.

    Example:
        >>> check_shards(2)
    """
    check_whole("shards", shards, 1, "the ranks FSDP shards parameters, gradients and "
                "optimizer state over; 1 for DDP or one process", BudgetError)


def optimizer_state_bytes(tape: Tape, optimizer: str | int | None) -> int:
    """Bytes of parameter-sized optimizer state for the tape's trainable parameters.

    ``optimizer`` is a name in :data:`~autoremat._measure.optimizers.OPTIMIZERS` (states per
    parameter, in the parameters' dtype, as PyTorch's optimizers allocate them: adamw/adam
    2, sgd-momentum/adagrad/rmsprop 1, sgd 0) or a number of bytes, taken as given.
    """
    spec = resolve_optimizer(optimizer)
    if isinstance(spec, OptimizerSpec):
        return spec.state_bytes(tape.trainable_param_bytes)
    return spec or 0


def step_budget_bytes(max_memory: int | str, memory: IterationMemory) -> int:
    """The step-peak budget that ``max_memory`` (the whole device: bytes or a size
    string) leaves an iteration holding ``memory``: ``max_memory - resting``.

    Raises:
        BudgetError: ``max_memory`` cannot hold the iteration whatever is recomputed
            (``min_feasible_bytes`` says what can).

    Example:
        >>> memory = IterationMemory(param_bytes=1000, buffer_bytes=0, optimizer_bytes=2000,
        ...                          input_bytes=500, grad_bytes=1000)
        >>> step_budget_bytes("10000", memory)
        6500
    """
    limit = parse_size(max_memory, what="max_memory")
    resting = memory.resting_bytes
    update = memory.grad_bytes + memory.optimizer_step_bytes
    need = memory.peak_bytes(0)
    if limit < need or limit <= resting:
        raise BudgetError(
            f"max_memory {format_bytes(limit)} does not even hold the parameters, buffers "
            f"and optimizer state ({format_bytes(resting)} with the batch) plus the "
            f"gradients and the optimizer step's temporaries ({format_bytes(update)}), "
            f"which an iteration needs whatever is recomputed: {format_bytes(need)} "
            f"({need} bytes) before the step's own. Shard the model or the optimizer state, "
            f"use a smaller optimizer or batch, or a device with more memory",
            min_feasible_bytes=need)
    return limit - resting
