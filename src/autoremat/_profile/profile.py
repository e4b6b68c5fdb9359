"""``profile``: measure one training step block by block and return a :class:`Tape`.

NOTE [ Three kinds of run ]
    Per-op instrumentation slows a step, so no time is taken from an instrumented one:
    * memory: four steps under ``track_memory`` (plain; every block checkpointed on its
      own; and two that alternate kept and checkpointed blocks), with marks at block
      boundaries. Windows between marks give what the planner composes (see
      ``tape.py``), for each pair (previous block's decision, this block's): who
      holds a boundary tensor depends on both its producer and its consumer. Memory
      is exact and deterministic. The selective options are derived from the
      checkpointed step (NOTE [ Selective windows from the checkpointed step ] in
      ``derive.py``), and those it cannot show measured, a few per step (NOTE [ Options
      measured together ]).
    * FLOPs: counted by block in the same steps (NOTE [ One pass for memory and FLOPs ]).
    * time: ``repeats`` steps with nothing but hooks at block boundaries; medians.
    Before them, one uninstrumented step finds the chain (and warms up: what a model
    makes lazily on its first step is not measured as the step's) and the inputs held
    outside it (NOTE [ Boundaries held outside the chain ] in ``runs.py``).

NOTE [ Pairs that cannot differ ]
    A block's windows depend on its predecessor's mode only through tensors that both
    can hold: a storage made in block ``i``'s forward and read by block ``i + 1`` (the
    boundary) is freed in the backward of its last holder, ``i`` when ``i`` is kept and
    saved it, else ``i + 1`` (kept: if it saved it; checkpointed: it holds its inputs),
    else in ``i + 1``'s forward. When no block holds what it hands on (and nothing is
    held across more than one boundary), every storage is freed where its own block's
    decision says, whatever the neighbour's, so (recompute, keep) equals (keep, keep)
    and (keep, recompute) equals (recompute, recompute): the alternating steps would
    measure nothing new. ``_pairs_local`` reads that from the kept and the checkpointed
    steps: per event, the window it falls in (``_placer``). A storage made in block
    ``i``'s forward must die in block ``i``'s windows, in ``i + 1``'s, or at or after
    the end (held by the caller); the bytes that die in ``i + 1``'s windows must be the
    same in both steps (what ``i + 1`` takes, none of it held by ``i`` kept: held by
    ``i``, it would die in ``i``'s backward in the kept step and in ``i + 1``'s in the
    checkpointed one); a storage made before the chain may die in no block's windows but
    block 0's, and the bytes block 0 frees in its backward must be the same in both
    steps (what block 0 holds either way, so no later block is ever its last holder);
    one made in a block's backward dies there, in the previous block's backward or
    never. Then the alternating steps are skipped and the pairs taken from the uniform
    steps (``by_pairs(..., local=True)``); ``test_profile`` checks the figures against
    the alternating steps'. Eager steps without offload only. What the model made before
    the chain and frees when the forward returns in the kept step may be freed by block
    0 in the checkpointed step only (a Hugging Face Llama's position ids, which every
    checkpoint of a layer holds): the peak model counts it held through the backward in
    any plan that checkpoints (NOTE [ Released when the forward returns ] in
    _plan/peak.py), which the measured pairs' windows (a checkpointed block 1 after a
    kept block 0 frees it in its backward) do not change; every single-block plan of
    such a Llama predicts the same from both, its measured peak (2026-11-30: profile
    x9.0 plain steps before, x7.3 without the two alternating steps).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from autoremat._core.calls import call_of, calls_for, unrolled
from autoremat._core.conditions import (
    float_dtypes,
    parametrize_cached,
    structure_of,
    user_hooks,
)
from autoremat._core.decisions import Decision
from autoremat._core.errors import BlockError, RematError, check_flag, check_whole, did_you_mean
from autoremat._core.step import (
    Loop,
    LossFn,
    Step,
    as_step,
    call_model,
    clear_grads,
    describe_inputs,
    flat_tensors,
    layer_drops,
    parse_device,
    preserved_state,
    router_noise,
    training_config,
    unique_storage_bytes,
)
from autoremat._core.units import format_bytes
from autoremat._measure.blocks import (
    BlockSpec,
    attribute_layers,
    discovery_notes,
    keyed_by_position,
    other_repeated_blocks,
    param_signature,
    resolve_blocks,
)
from autoremat._measure.measured import heap_frozen
from autoremat._measure.memory import Rounding, StorageRecord, counted_bytes
from autoremat._measure.tape import (
    WINDOW_DECISIONS,
    BlockProfile,
    HeadProfile,
    SelectiveProfile,
    Tape,
    WindowMemory,
)
from autoremat._mechanism.compiled import forget_compiled, uncompiled
from autoremat._mechanism.offload import OffloadStats
from autoremat._mechanism.wrap import refuse_applied, stashed_buffers
from autoremat._plan.costs import cost_model_for
from autoremat._profile.options import (
    BaseRuns,
    base_runs,
    by_pairs,
    check_head_backends,
    post_ckpt_levels,
    profile_head,
    selective_runs,
)
from autoremat._profile.runs import (
    SKIPS_SEEN,
    BlockTimes,
    Chain,
    MemoryRun,
    Pattern,
    RepeatedCalls,
    Setup,
    compile_settings,
    find_chain,
    freed_in_forward,
    held_forward_windows,
    held_input_lifts,
    held_peak,
    inputs_freed_later,
    inputs_released_at_fwd_end,
    made_before_freed,
    made_before_frees,
    post_bwd_peak,
    post_fwd_held_peak,
    post_fwd_held_peaks,
    refuse_hf_checkpointing,
    released_at_fwd_end,
    saved_by_block,
    step_as_run,
    timings,
)

__all__ = ["compile_backend", "profile"]


def compile_backend(compile: bool | str) -> str | None:
    """The Dynamo backend ``compile=`` names (``True``: Inductor), or ``None``."""
    if compile is False:
        return None
    if compile is True:
        return "inductor"
    known = torch._dynamo.list_backends(exclude_tags=())
    if not isinstance(compile, str) or compile not in known:
        raise RematError(f"compile must be True, False or a torch.compile backend name "
                         f"such as 'inductor' or 'aot_eager', got {compile!r}"
                         + (did_you_mean(compile, known) if isinstance(compile, str) else ""))
    return compile


_GIVE_BLOCKS = (": give blocks=[...] (on the command line, --blocks NAME,NAME,...) with "
                "the names of the layers to plan over")


def _why_no_chain(model: nn.Module) -> str:
    """Why discovery found no chain (nor ``_looped_layers``), and what to do: a module
    other than a list holding one module more than once, a list of layers holding a
    single one that runs once, or a ModuleDict (named parts)."""
    for name, module in model.named_modules():
        kids = [k for k in module._modules.values() if k is not None]
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) and \
                len({id(k) for k in kids}) < len(kids):
            return (f" ({name or 'the model'!r} holds one module more than once, and is "
                    "no list of layers (a ModuleList or Sequential, whose layers' calls "
                    "autoremat plans one by one)" + _GIVE_BLOCKS)
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) == 1:
            return (f" ({name or 'the model'!r} holds a single block, and a plan chooses "
                    "among two or more: build the model with more layers)" + _GIVE_BLOCKS)
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleDict) and not keyed_by_position(module):
            common = Counter(type(k) for k in module.children()).most_common(1)
            if common and common[0][1] >= 2:
                kind = common[0][0]
                layers = [f"{name}.{key}" if name else key
                          for key, k in module.named_children() if type(k) is kind]
                shown = ", ".join(repr(n) for n in layers[:3]) + (", ..." if len(layers) > 3
                                                                   else "")
                return (f" (the {kind.__name__} layers in the ModuleDict {name!r} are not "
                        f"searched: its keys name parts, not positions in a chain, as "
                        f"'0', '1', ... or 'layer0', 'layer1', ... would): give "
                        f"blocks=[{shown}] in the order the model runs them")
    return _GIVE_BLOCKS


def _looped_layers(model: nn.Module, inputs: Any) -> list[str] | None:
    """Where discovery found no chain, the layers whose calls may be one (NOTE [ A block
    that runs several times ] in _core/calls.py), else ``None``: the modules of a list
    that holds one of them more than once (weights shared by reuse), each named once; or
    the single layer of a list that holds one and runs it several times per forward
    (ALBERT's layer group, run as every layer). On ``meta``, where a forward does not
    run here, the first single layer (the first step tells whether it runs more than
    once)."""
    for name, module in model.named_modules():
        kids = [(key, k) for key, k in module._modules.items() if k is not None]
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and \
                len({id(k) for _, k in kids}) < len(kids):
            prefix = f"{name}." if name else ""
            return [f"{prefix}{key}" for key, k in kids
                    if next(first for first, other in kids if other is k) == key]
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) == 1:
            layer = f"{name}.0" if name else "0"
            if _calls_in_a_forward(model, inputs, module[0]) > 1:
                return [layer]
            if any(p.is_meta for p in model.parameters()):
                return [layer]
    return None


def _calls_in_a_forward(model: nn.Module, inputs: Any, block: nn.Module) -> int:
    """How many times ``block`` runs in one forward of ``model`` without gradients (its
    state as before); 1 for a model on ``meta``, which does not run here."""
    if any(p.is_meta for p in model.parameters()):
        return 1
    calls = 0

    def count(*_: Any) -> None:
        nonlocal calls
        calls += 1

    handle = block.register_forward_pre_hook(count)
    try:
        with preserved_state(model, inputs), torch.no_grad():
            call_model(model, inputs)
    finally:
        handle.remove()
    return calls


def _checked_setup(step: Step, blocks: BlockSpec, *, repeats: int, with_selective: bool,
                   timing: bool, rounding: Rounding | None,
                   device: str | torch.device | None, compile: bool | str, offload: bool,
                   host_bandwidth: float | None,
                   with_head: bool | Sequence[str] = True) -> Setup:
    """``profile``'s arguments checked (a mistake fails here, before any work; the step's
    own values were checked when it was made)."""
    backend = compile_backend(compile)
    if offload and backend is not None:
        raise RematError("profile(offload=True, compile=...) is not supported: offloaded "
                         "blocks run saved-tensor hooks that torch.compile does not trace. "
                         "Profile with one of them")
    if host_bandwidth is not None and not offload:
        raise RematError("host_bandwidth= only matters with offload=True; pass both, or "
                         "neither")
    if host_bandwidth is not None and (not isinstance(host_bandwidth, (int, float))
                                       or isinstance(host_bandwidth, bool)
                                       or not host_bandwidth > 0):
        raise RematError(f"host_bandwidth must be a positive number of bytes per second "
                         f"(e.g. 25e9), got {host_bandwidth!r}")
    step = dataclasses.replace(step, model=uncompiled(step.model))
    model = step.model
    lazy = [name for name, p in model.named_parameters()
            if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise RematError(
            f"the model has parameters not made yet ({lazy[0]!r}, {len(lazy)} in all: lazy "
            f"modules such as nn.LazyLinear make them in their first forward). Run one "
            f"forward on a batch first (with torch.no_grad()), then profile")
    check_whole("repeats", repeats, 1, "the uninstrumented steps timed")
    for flag, value in (("with_selective", with_selective), ("timing", timing),
                        ("offload", offload)):
        check_flag(flag, value)
    if not isinstance(with_head, bool):
        check_head_backends(with_head)
    if not torch.is_grad_enabled():
        raise RematError("profile() was called with gradients disabled (under "
                         "torch.no_grad() or torch.inference_mode()): it measures a training "
                         "step, whose backward needs them; call it outside that block")
    ran_on = step.device
    on_meta = [t for t in flat_tensors(step.inputs) if t.device.type == "meta"]
    if on_meta and ran_on.type != "meta":
        raise RematError(f"the inputs are on meta and the model on {ran_on}: profile() runs "
                         "a real step, which needs real inputs (build them on the model's "
                         "device); to predict on meta tensors use autoremat.estimate(model, "
                         "inputs)")
    if device is None and ran_on.type == "meta":
        raise RematError("profile() of a model on meta needs device=, the device the tape is "
                         "for (its recompute costs and tape.device), e.g. device='cuda'; or "
                         "use autoremat.estimate(), which gives it")
    target = str(ran_on if device is None else parse_device(device))
    # a device without rates fails before any work
    cost_model = cost_model_for(target, compiled=backend is not None)
    if rounding is None and ran_on.type == "meta":
        rounding = "cuda" if torch.device(target).type == "cuda" else "exact"
    names = resolve_blocks(model, blocks)
    if names == [""]:
        looped = _looped_layers(model, step.inputs)
        if looped is None:
            looped = attribute_layers(model) or None  # NOTE [ Layers held as attributes ]
        if looped is None:
            raise BlockError(f"found no chain of blocks in {type(model).__name__}"
                             f"{_why_no_chain(model)}")
        names = looped  # their calls are the chain (NOTE [ A block that runs several
        # times ] in _core/calls.py), found in the first step
    refuse_hf_checkpointing(model, "autoremat")
    scripted = [n for n in names if isinstance(model.get_submodule(n), torch.jit.ScriptModule)]
    if scripted:
        raise BlockError(f"block {scripted[0]!r} is a TorchScript module (torch.jit.script), "
                         "which autoremat can neither measure nor checkpoint (it takes no "
                         "hooks): plan the eager model, or leave the blocks unscripted")
    return Setup(step=step, backend=backend, ran_on=ran_on, target=target,
                  cost_model=cost_model, rounding=rounding, offload=offload,
                  host_bandwidth=host_bandwidth, names=names)


def _mode_notes(model: nn.Module, names: list[str], *, discovered: bool) -> list[str]:
    """Notes on what the tape holds for: the model's mode, and the blocks left out."""
    notes: list[str] = []
    if not model.training:
        # an eval() tape plans a train() step over its budget (dropout's masks are missing)
        eval_note = (f"{type(model).__name__} was profiled in eval() mode (dropout off, "
                     "BatchNorm on running statistics): its figures and plans hold for "
                     "that mode; profile it in the mode you train in (model.train())")
        notes.append(eval_note)
        warnings.warn(f"autoremat: {eval_note}", UserWarning, stacklevel=3)
    if discovered:
        notes.extend(discovery_notes(model))
        held = attribute_layers(model)
        if held and names == held:
            owner = held[0].rpartition(".")[0]
            notes.append(f"blocks: the {len(held)} modules "
                         f"{repr(owner) if owner else 'the model'} holds as attributes, in "
                         f"the order they run (no ModuleList or Sequential holds a chain: "
                         f"NOTE [ Layers held as attributes ]); each is one block, a stage "
                         f"too. Pass blocks=[...] to plan over the layers inside them")
        others = other_repeated_blocks(model, names)
        if others:
            notes.append(f"planning over the repeated blocks found; also smaller "
                         f"repeated, not planned over: {', '.join(others)} (pass "
                         "blocks=[...] with all of them, in the order they run)")
    return notes


def _first_release_shared(released: dict[Pattern, list[int]], n: int) -> dict[Decision, int]:
    """Per decision ``d`` that recomputes nothing, what the first block releases when the
    forward returns in the step with every block under ``d`` beyond the least it releases
    under ``d`` in a step that recomputes nothing: what the model made before the chain
    and passes to several blocks, which one of them may hold (NOTE [ What the model made
    before the chain ] in _plan/peak.py). Only the non-zero ones."""
    out = {}
    for pattern, values in released.items():
        if n > 1 and pattern == (pattern[0],) * n and not pattern[0].recomputes:
            # (a plan that recomputes counts the least anyway: release_of)
            least = min(v[0] for p, v in released.items()
                        if p[0] == pattern[0] and not any(d.recomputes for d in p))
            if values[0] > least:
                out[pattern[0]] = values[0] - least
    return out


def _as_if_unshared(runs: dict[Pattern, MemoryRun], released: dict[Pattern, list[int]],
                    shared: Sequence[tuple[int, tuple[int, ...], int, bool]],
                    ) -> dict[Pattern, list[WindowMemory]]:
    """Per run, its blocks' backward windows, and (in place) its releases when the
    forward returns, as if no later block held what an earlier one saved first (NOTE
    [ Saves shared by calls through a cache ] in runs.py): in a run that does not keep
    that block and keeps a later one saving it, the first of those frees it in its
    backward, and the release of the block after the first saver lacks it; moved to the
    release, and counted held through that backward window (its peak by all of it: where
    in the window it died is not kept). A cast the first block made and did not save
    (``cast``: NOTE [ Casts a block makes that a later block saves ] in runs.py) is put
    as if that block saved it: in a run keeping it, freed in its backward window, not
    in the first kept later block's, nor when the forward returns where none is kept."""
    out = {pattern: list(run.bwd) for pattern, run in runs.items()}

    def held(windows: list[WindowMemory], q: int, size: int, peak: bool = True) -> None:
        w = windows[q]
        windows[q] = WindowMemory(peak_bytes=w.peak_bytes + (size if peak else 0),
                                  delta_bytes=w.delta_bytes + size)

    for pattern, windows in out.items():
        for p, savers, size, cast in shared:
            holders = [q for q in savers if pattern[q] is Decision.KEEP]
            if p + 1 >= len(pattern):
                continue
            if pattern[p] is Decision.KEEP:
                if not cast:
                    continue  # it holds them to its backward: as if unshared
                if holders:
                    held(windows, holders[0], size)
                else:
                    released[pattern][p + 1] -= size
                held(windows, p, -size, peak=False)  # freed in its backward
            elif holders:
                released[pattern][p + 1] += size
                held(windows, holders[0], size)
    return out


def _chain_bytes(chain: Chain, first: list[int], i: int, ran_on: torch.device,
                 rounding: Rounding | None) -> int:
    """What a segment drops at block ``i``'s input, not holding it (NOTE [ Boundaries held
    outside the chain ] in runs.py): its first input tensor where the model does not hold
    it (``first``: its size, per block), and the tensors the block before returned that
    only it takes (RevNet's second half of the pair) where the model lets go of them."""
    if i == 0:
        return 0
    sides = chain.chain_sides[i] if chain.chain_sides else ()
    return (0 if chain.held_inputs[i] else counted_bytes(first[i], ran_on, rounding)) + \
        sum(counted_bytes(size, ran_on, rounding) for size in sides)


def _held_past_release(chain: Chain, ran_on: torch.device,
                       rounding: Rounding | None) -> dict[str, int]:
    """``tape.held_past_release``: bytes by "first:window", the first block taking them
    and the block in whose forward window the plain step frees them."""
    out: dict[str, int] = {}
    for first, window, size in chain.held_past_release:
        key = f"{first}:{window}"
        out[key] = out.get(key, 0) + counted_bytes(size, ran_on, rounding)
    return out


def _split_post_peaks(runs: dict[Pattern, MemoryRun], n: int, measured: Sequence[Decision]
                      ) -> tuple[dict[Decision, int], dict[Decision, int]]:
    """``tape.post_ret_peak`` and ``tape.post_returned_peak``: the uniform steps' post
    peaks before and from where each first lets go of a tensor made before the chain's
    end, where it lets go of one before the backward."""
    split = {d: peaks for d in measured if (peaks := runs[(d,) * n].post_ret_peaks)}
    return ({d: peaks[0] for d, peaks in split.items()},
            {d: peaks[1] for d, peaks in split.items()})


def _freed_later(runs: dict[Pattern, MemoryRun], n: int, past_release: dict[str, int],
                 lets_go: Sequence[bool]) -> dict[str, int]:
    """``tape.freed_later``: by "i:w", the bytes of block ``i``'s input that the plain
    step frees in block ``w``'s forward window and the step with every block
    checkpointed does not (block ``i``'s checkpoint holds them until its backward), or,
    where block ``i`` saves nothing (``lets_go``; its checkpoint alone holds nothing, a
    segment of several starting there holds them), that the plain step frees there;
    less what ``tape.held_past_release`` counts of them (a tensor taken besides the
    input): NOTE [ Inputs the model frees later in the chain ] in _plan/peak.py."""
    # NOTE [ An input later blocks take too ]
    #     A block's input the model frees later in the chain is credited as freed there
    #     in a plan whose checkpoint of that block does not hold it (the block inside a
    #     segment). Where a block between takes it too, that block's checkpoint holds it
    #     as well: timm's DenseNet-121 passes each dense layer the list of every feature
    #     map so far, and a segment of its pool and first dense layer, every other block
    #     checkpointed, measured the pool's output (88,064 B above the prediction) held
    #     by the later layers' checkpoints (a held-out check, 2026-12-02). Such bytes are
    #     not credited: counted held, over by them where those blocks are kept.
    kept, ckpt = (inputs_freed_later(runs[(d,) * n], n, gap=1, taken_between=False)
                  for d in (Decision.KEEP, Decision.RECOMPUTE))
    out = {}
    for (i, w), size in sorted(kept.items()):
        key = f"{i}:{w}"
        held = size - (0 if lets_go[i] else ckpt.get((i, w), 0)) - past_release.get(key, 0)
        if held > 0:
            out[key] = held
    return out


def _maker_freed_later(runs: dict[Pattern, MemoryRun], n: int,
                       past_release: dict[str, int]) -> dict[str, int]:
    """``tape.maker_freed_later``: by "i:w", the bytes of block ``i``'s input that a
    step with block ``i - 1`` checkpointed and block ``i`` kept frees in block ``w``'s
    forward window, ``w >= i + 1``, and the plain step does not (block ``i - 1``, kept,
    saves them: a ReLU's output the model also holds in a list of skips), less what
    ``tape.held_past_release`` counts of them: NOTE [ Inputs the model frees later in the
    chain ] in _plan/peak.py. Read from the alternating steps; none where the profile
    took none (NOTE [ Pairs that cannot differ ])."""
    kept = inputs_freed_later(runs[(Decision.KEEP,) * n], n, gap=1)
    out: dict[str, int] = {}
    for pattern, run in runs.items():
        if len(set(pattern)) == 1:
            continue
        for (i, w), size in inputs_freed_later(run, n, gap=1).items():
            if i == 0 or pattern[i - 1] is not Decision.RECOMPUTE or \
                    pattern[i] is not Decision.KEEP:
                continue
            key = f"{i}:{w}"
            held = size - kept.get((i, w), 0) - past_release.get(key, 0)
            if held > out.get(key, 0):
                out[key] = held
    return out


def _by_takers(entries: tuple[tuple[int, tuple[int, ...], int], ...], ran_on: torch.device,
               rounding: Rounding | None) -> dict[str, int]:
    """``tape.freed_at_return`` and ``tape.saved_by_maker``: bytes by "block:takers", the
    block (after the one that returned them; the one saving them) and the blocks taking
    them ("9:12,15")."""
    out: dict[str, int] = {}
    for block, takers, size in entries:
        key = f"{block}:{','.join(map(str, takers))}"
        out[key] = out.get(key, 0) + counted_bytes(size, ran_on, rounding)
    return out


def _recompute_events(base: BaseRuns, i: int) -> tuple[MemoryRun, int, int] | None:
    """Block ``i``'s recompute in the step with every block checkpointed: that run, and
    the events its first op made to the event after its last's (``None`` where the step
    did not tag the block, or it recomputed nothing: NOTE [ Selective windows from the
    checkpointed step ] in derive.py)."""
    tags = base.tags[i] if base.tags else None
    if tags is None or tags.mem is None or not tags.recompute:
        return None
    run = base.runs[(Decision.RECOMPUTE,) * len(base.recompute_flops)]
    return run, tags.recompute[0].first, tags.recompute[-1].stop


def _recompute_after(base: BaseRuns, i: int) -> int:
    """``BlockProfile.recompute_after``: in the step with every block checkpointed, the
    level when block ``i``'s recompute starts above its backward window's start (0 where
    the step did not tag the block)."""
    found = _recompute_events(base, i)
    if found is None:
        return 0
    run, first, _ = found
    levels, start = run.mem.levels, run.ends[i + 1]
    return max(0, levels[first - 1] - levels[start]) if first > start else 0


# NOTE [ A recompute of views ]
#     A block whose ops before the last tensor it saves make no tensor (a Linear on the
#     block's input saves only that input, which its checkpoint holds; the ops its
#     recompute runs are views of it and of the weight) recomputes without a memory
#     event: its recompute peak is 0, not unmeasured. Taken as unmeasured, a segment of
#     such a block and a pool after it (which saves nothing, so the segment's recompute
#     stops in the block: NOTE [ A segment's last block that saves nothing ] in
#     _plan/peak.py) was composed as recomputing the block's whole forward: fuzz seed
#     280562 without autocast, 1,588 B (36%) over its step.
def _recompute_peak(base: BaseRuns, i: int) -> int:
    """``BlockProfile.recompute_peak``: in the step with every block checkpointed, the
    peak of block ``i``'s recompute above the level where it starts (0 where its ops
    made no tensor, NOTE [ A recompute of views ]; -1 where the step did not tag the
    block, or it recomputed nothing)."""
    found = _recompute_events(base, i)
    if found is None:
        return -1
    run, first, stop = found
    levels = run.mem.levels
    if first == stop and 0 < first <= len(levels):
        return 0  # NOTE [ A recompute of views ]
    if not 0 < first < stop <= len(levels):
        return -1
    return max(levels[first:stop]) - levels[first - 1]


def _recompute_split(base: BaseRuns, i: int, before: Sequence[tuple[int, int]], *,
                     input_gone: bool) -> tuple[int, int] | None:
    """In the step with every block checkpointed, block ``i``'s backward window's peak
    until its recompute ends and from there on (above the window's start), what the
    window frees of the tensors made before the chain (``before``: ``(event, bytes)``)
    held on to its end; with ``input_gone``, the input's storage counted gone from where
    the recompute ends (NOTE [ A segment's last input its recompute lets go ] and NOTE
    [ What a segment's recompute lets go when it ends ] in _plan/peak.py). ``None``
    where the step did not tag the block, or (``input_gone``) its input was not made in
    the step. With ``input_gone``, the higher of the two is the block's
    ``bwd_input_gone_peak``."""
    window = _recompute_window(base, i)
    if window is None:
        return None
    run, start, gone, stop = window
    moves = list(before)
    if input_gone:
        record = _chain_record(run, i)
        if record is None:
            return None
        if record.died is None or record.died > gone:  # alive when the recompute ended:
            moves.append((gone, -record.nbytes))  # gone from there (a negative hold)...
            if record.died is not None and record.died <= stop:
                moves.append((record.died, record.nbytes))  # ...until it dies
    return _split_peaks(run, start, gone, stop, moves)


def _chain_record(run: MemoryRun, i: int) -> StorageRecord | None:
    """The tracker's record of block ``i``'s input in ``run`` where it is the block
    before's output, unchanged (``None``: not chained, or not recorded)."""
    return run.probe.chain_records[i] if run.probe.chain_records else None


def _recompute_window(base: BaseRuns, i: int) -> tuple[MemoryRun, int, int, int] | None:
    """Block ``i``'s backward window in the step with every block checkpointed: that run,
    the window's first event, the event after its recompute's last and the window's
    last event; ``None`` where the step did not tag the block or its recompute did not
    end inside the window."""
    found = _recompute_events(base, i)
    if found is None:
        return None
    run, _, gone = found
    start, stop = run.ends[i + 1], run.ends[i]
    return (run, start, gone, stop) if start < gone <= stop else None


def _split_peaks(run: MemoryRun, start: int, gone: int, stop: int,
                 moves: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The peaks of events ``start..gone-1`` and ``gone..stop`` of ``run`` above the level
    at ``start``, each of ``moves`` (``(event, bytes)``) held from its event on."""
    until, held = held_peak(run.mem, start, gone - 1, [m for m in moves if m[0] < gone])
    after, _ = held_peak(run.mem, gone, stop, [m for m in moves if m[0] >= gone])
    level = run.mem.levels[start]
    return until - level, after + held - level


def _recompute_then_held(base: BaseRuns, i: int, before: Sequence[tuple[int, int]],
                         plain: MemoryRun) -> int:
    """``BlockProfile.bwd_recompute_then_held``: in the step with every block
    checkpointed, block ``i``'s backward window's peak from where its recompute ends
    (above the window's start), what it frees of the tensors made before the chain
    (``before``) and of its input's storage held on to its end, where the plain step
    (``plain``) holds that input past the block's backward window (the block before
    saves it as its output, or the model holds it); -1 where it does not, where the
    checkpointed step does not free the input in the window, or where the step did not
    tag the block (NOTE [ A segment's last block whose input the block before holds ]
    in _plan/peak.py)."""
    window = _recompute_window(base, i)
    mine = _chain_record(plain, i)
    if window is None or mine is None or \
            (mine.died is not None and mine.died <= plain.ends[i]):
        return -1
    run, start, gone, stop = window
    record = _chain_record(run, i)
    if record is None or record.died is None or not start < record.died <= stop:
        return -1
    return _split_peaks(run, start, gone, stop, [*before, (record.died, record.nbytes)])[1]


def _tape(setup: Setup, chain: Chain, base: BaseRuns,
          selective: list[dict[str, SelectiveProfile]], times: BlockTimes, *,
          notes: list[str], head: HeadProfile | None = None) -> Tape:
    """The tape, from what the steps measured."""
    names, runs, plain, counter = chain.names, base.runs, base.plain, base.counter
    model, inputs = setup.step.model, setup.step.inputs
    skips = bool(layer_drops(model))  # NOTE [ Random layer skipping ]: no segments
    n, ran_on, rounding = len(names), setup.ran_on, setup.rounding
    measured = WINDOW_DECISIONS if setup.offload else WINDOW_DECISIONS[:2]
    released = {pattern: released_at_fwd_end(run, n) for pattern, run in runs.items()}
    past_release = _held_past_release(chain, ran_on, rounding)
    shared = [(p, savers, counted_bytes(size, ran_on, rounding), cast)
              for cast, entries in ((False, chain.shared_saves), (True, chain.cast_saves))
              for p, savers, size in entries]
    bwd = _as_if_unshared(runs, released, shared)  # NOTE [ Saves shared by calls ... ]
    frees = freed_in_forward(plain, n)
    held = {pattern: held_forward_windows(run, n) for pattern, run in runs.items()}
    lifts = {pattern: held_input_lifts(run, n) for pattern, run in runs.items()}
    made_before = {pattern: made_before_freed(run, n) for pattern, run in runs.items()}
    before = {pattern: made_before_frees(run, made_before[pattern])
              for pattern, run in runs.items()}
    one = {d: post_fwd_held_peaks(runs[(d,) * n], n) for d in measured}
    saved = saved_by_block(plain)
    released_inputs = inputs_released_at_fwd_end(plain, n)
    # the backward windows of the step with every block checkpointed, split where each
    # block's recompute ends, with the input gone there where autograd saved none of it
    gone = [bool(chain.input_saved) and not chain.input_saved[i] for i in range(n)]
    ckpt_made_before = made_before[(Decision.RECOMPUTE,) * n]
    splits = [_recompute_split(base, i, ckpt_made_before[i], input_gone=gone[i])
              for i in range(n)]
    lets_go = chain.saves_nothing or (False,) * n
    offload_stats, input_stats = ([runs[(d,) * n].offloaded.get(name, OffloadStats())
                                   if setup.offload else OffloadStats() for name in names]
                                  for d in (Decision.OFFLOAD, Decision.OFFLOAD_INPUT))
    block_list = []
    for i, (name, split) in enumerate(zip(names, splits, strict=True)):
        module = model.get_submodule(name)
        block_list.append(BlockProfile(
            name=name, fwd_ms=times.fwd_ms[i], bwd_ms=times.bwd_ms[i],
            fwd_flops=counter.by_label.get((name, "fwd"), 0),
            bwd_flops=counter.by_label.get((name, "bwd"), 0),
            recompute_flops=base.recompute_flops[i],
            saved_bytes=sum(saved[i].values()),
            saved_bytes_by_kind=dict(sorted(saved[i].items())),
            input_bytes=plain.probe.input_bytes[i], output_bytes=plain.probe.output_bytes[i],
            param_bytes=unique_storage_bytes(list(module.parameters())),
            param_signature=param_signature(module),
            grad_bytes=base.block_grad_bytes[i],
            fwd=by_pairs(runs, i, lambda _, run, k: run.fwd[k], base.alike, base.local),
            bwd=by_pairs(runs, i, lambda pattern, _, k: bwd[pattern][k], base.alike,
                         base.local),
            op_stats=counter.block_stats(name), ops=counter.block_ops(name),
            output_ops=counter.block_output_ops(name),
            output_unsaved=counter.block_unsaved_output_ops(name),
            selective=selective[i],
            chained=i > 0 and plain.probe.chained[i] and not skips,
            offload_bytes=offload_stats[i].host_bytes,
            offload_tensors=offload_stats[i].tensors,
            offload_input_bytes=input_stats[i].host_bytes,
            chain_bytes=_chain_bytes(chain, plain.probe.chain_bytes, i, ran_on, rounding),
            fwd_end_release={key: v for key, v in by_pairs(
                runs, i, lambda pattern, _, k: released[pattern][k], base.alike,
                base.local).items() if v},
            fwd_frees=frees[i],
            fwd_held={key: v for key, v in by_pairs(
                runs, i, lambda pattern, _, k: held[pattern][k], base.alike,
                base.local).items() if v is not None},
            bwd_input_held={key: v for key, v in by_pairs(
                runs, i, lambda pattern, _, k: lifts[pattern][k], base.alike,
                base.local).items() if v},
            bwd_made_before_freed={key: v for key, v in by_pairs(
                runs, i, lambda pattern, _, k: before[pattern][0][k], base.alike,
                base.local).items() if v},
            bwd_made_before_held={key: v for key, v in by_pairs(
                runs, i, lambda pattern, _, k: before[pattern][1][k], base.alike,
                base.local).items() if v},
            post_held_peak={(Decision.KEEP if i == 0 else d, d): one[d][i]
                            for d in measured if i in one[d]},
            recompute_after=_recompute_after(base, i),
            recompute_peak=_recompute_peak(base, i),
            bwd_recompute_then_held=_recompute_then_held(base, i, ckpt_made_before[i],
                                                         plain),
            lets_input_go=lets_go[i],
            bwd_input_gone_peak=max(split) if gone[i] and split is not None else -1,
            bwd_recompute_split=split or (-1, -1),
            input_saved=not chain.input_saved or chain.input_saved[i],
            input_released=released_inputs[i],
            stash_bytes=sum(counted_bytes(buf.untyped_storage().nbytes(), ran_on, rounding)
                            for buf in stashed_buffers([module])),
        ))
    params = list(model.parameters())
    split_post = _split_post_peaks(runs, n, measured)
    return Tape(
        model=type(model).__name__, inputs=describe_inputs(inputs),
        device=setup.target, training=model.training,
        blocks=tuple(block_list),
        step_peak_bytes=plain.mem.peak_bytes, peak_breakdown=plain.mem.breakdown,
        ckpt_step_peak_bytes=runs[(Decision.RECOMPUTE,) * n].mem.peak_bytes,
        param_bytes=unique_storage_bytes(params),
        trainable_param_bytes=unique_storage_bytes([p for p in params if p.requires_grad]),
        trainable_param_tensors=sum(p.requires_grad for p in params),
        input_bytes=unique_storage_bytes(inputs),
        buffer_bytes=unique_storage_bytes(list(model.buffers())),
        grad_bytes=base.grad_bytes,
        pre=plain.pre, post={d: runs[(d,) * n].post for d in measured},
        post_fwd_peak={d: runs[(d,) * n].post_fwd_peak for d in measured},
        post_fwd_held_peak={d: post_fwd_held_peak(runs[(d,) * n], n) for d in measured},
        post_bwd_peak={d: post_bwd_peak(runs[(d,) * n], n) for d in measured},
        post_ret_peak=split_post[0], post_returned_peak=split_post[1],
        post_ckpt_levels=post_ckpt_levels(base, selective),
        first_release_shared=_first_release_shared(released, n),
        held_past_release=past_release,
        freed_later=_freed_later(runs, n, past_release, lets_go),
        maker_freed_later=_maker_freed_later(runs, n, past_release),
        freed_at_return=_by_takers(chain.freed_at_return, ran_on, rounding),
        saved_by_maker=_by_takers(chain.saved_by_maker, ran_on, rounding),
        shared_saves=_by_takers(chain.shared_saves, ran_on, rounding),
        cast_saves=_by_takers(chain.cast_saves, ran_on, rounding),
        cached_casts=_by_takers(chain.cached_casts, ran_on, rounding),
        tail={d: runs[(d,) * n].tail for d in measured},
        offload=setup.offload, host_bandwidth=base.host_bandwidth,
        step_fwd_flops=counter.phase_total("fwd"), step_bwd_flops=counter.phase_total("bwd"),
        step_ms=times.step_ms, loop=setup.step.loop, output_bytes=chain.output_bytes,
        compiled=setup.backend or "", head=head, notes=tuple(notes),
        autocast=chain.autocast, dtypes=float_dtypes(model.parameters()), loss=chain.loss,
        structure=structure_of(model, names), hooks=user_hooks(model, names),
        cached=parametrize_cached(model.get_submodule(call_of(name)[0]) for name in names),
    )


def profile(model: nn.Module | Step, inputs: Any = None, loss_fn: LossFn | None = None,
            blocks: BlockSpec = None, *, repeats: int = 3,
            with_selective: bool = True, timing: bool = True,
            rounding: Rounding | None = None, loop: Loop | None = None,
            device: str | torch.device | None = None, compile: bool | str = False,
            offload: bool = False, host_bandwidth: float | None = None,
            with_head: bool | Sequence[str] = True,
            progress: Callable[[str], None] | None = None) -> Tape:
    """Measure one training step of ``model`` block by block.

    Args:
        model: the model, in the mode you train it in (dropout and BatchNorm active); or
            an :class:`autoremat.Step`, which carries ``inputs``, ``loss_fn`` and
            ``loop`` (then leave those out and pass the rest by keyword:
            ``profile(step, blocks=...)``; the tape is the same).
        inputs: a tensor, a tuple of positional args, or a dict of keyword args.
        loss_fn: ``loss_fn(output) -> scalar``; default ``output.loss`` when present,
            else the sum of the first floating tensor in the output.
        blocks: ``None`` to find the chain of repeated layers, a list of qualified
            module names in the order they run, or a predicate ``(name, module) ->
            bool`` (its blocks are planned in the order they run, which
            ``tape.notes`` gives where it is not the order they are defined in).
        repeats: uninstrumented steps timed, at most (medians are reported): the
            first step, which finds the blocks, counts as one when ``repeats >= 3``, and
            timing stops once two steps in a row agree within 10%
            (NOTE [ Timing repeats ]).
        with_selective: also measure selective-recompute options, so that plans can use
            them: derived from the checkpointed memory step (NOTE [ Selective windows
            from the checkpointed step ]), and those it cannot show measured, several
            blocks' in one more memory step.
        timing: time uninstrumented steps; ``False`` (or a model on ``meta``) reports
            all times as 0.0 and says so in ``tape.notes``. On CUDA, times are taken
            with CUDA events (see ``timing.py``).
        rounding: how storage bytes are counted, as in :func:`autoremat.track_memory`:
            by default by device (the CUDA caching allocator's blocks on a GPU);
            ``"cuda"`` predicts a GPU's bytes from a step on ``meta``.
        loop: the training loop to measure (recorded as ``tape.loop``; plans made from
            the tape hold for it). ``"holds_output"`` (default, also for ``None``): the
            output stays
            referenced until backward has finished (``out = model(**batch);
            out.loss.backward()``); a budget that holds for it also holds for a loop
            that releases the output earlier. ``"loss_only"``: only the loss survives
            the forward (``loss = model(**batch).loss``, or ``del out`` before
            backward); tighter, but a loop that holds the output goes over it by up to
            ``tape.output_bytes``.
        device: the device the tape is for (``tape.device``), whose rates cost
            recompute in plans made from it (``costs.py``). Default: the device the
            model runs on. A model on ``meta`` runs nowhere, so it must be given
            (:func:`autoremat.estimate` does); there ``rounding`` defaults to the given
            device's. On a real device, giving another one costs its plans as if they
            ran there (e.g. ``"cuda"`` for an accelerator autoremat has no rates for).
        compile: measure the step as it runs under ``torch.compile`` (``True``: Inductor;
            or a backend name such as ``"aot_eager"``): memory from the allocator's
            reports and times with every block compiled on its own, each option lowered
            as it runs compiled (NOTE [ Profiling a compiled step ]). Plans made from
            the tape (``tape.compiled``) hold for the compiled step, checkpoint blocks
            one by one (no multi-block segments) and run under both whole-model and
            regional compilation. Slow on CPU: every option is compiled.
        offload: also measure each block with its saved tensors offloaded to host
            memory (five more memory steps), so that plans can offload
            (``plan(..., offload=True)``; NOTE [ Offloading saved tensors ]). On a CPU
            the host is the device: offloading frees nothing there, and plans keep
            those blocks instead.
        host_bandwidth: bytes per second of copies between the device and host memory,
            which cost offload in plans. Default: measured on a GPU (pinned memory);
            must be given for a model on ``meta``.
        with_head: also measure the loss head computed over chunks of tokens (one more
            memory step for the first of :data:`HEAD_CHUNKS`, the others replayed from it:
            NOTE [ One head option measured, the others replayed ]; each option timed
            against the plain head: NOTE [ What a head option costs ]), where the model
            has a head autoremat can chunk: a Hugging Face ``*ForCausalLM``,
            ``*ForMaskedLM`` or ``*ForConditionalGeneration`` given ``labels``, or an
            :class:`autoremat.LMHead` (NOTE [ Which heads can be chunked ]). Plans may
            then chunk it (``tape.head``); the tape's notes say why a head is not. True
            measures autoremat's own head, and on CUDA the other kernels installed; a
            list names the kernels to measure: ``"autoremat"``, ``"torch"`` (torch's
            ``linear_cross_entropy``), ``"liger"``, ``"cce"`` (NOTE [ Head backends ]).
        progress: called with the name of each stage as it starts (``"memory runs
            2/4"``), for a progress display; default: nothing.

    Returns:
        A frozen :class:`~autoremat.Tape`. The model's buffers, gradients and the
        RNG states are left as they were.

    Example:
        >>> import autoremat
        >>> model, inputs = autoremat.zoo.build("mlp", widths=(128,) * 4, batch_size=256)
        >>> tape = autoremat.profile(model, inputs)
        >>> [block.name for block in tape.blocks]
        ['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3']

    Known limitations:
        * A block that runs more than once per step (shared weights) is rejected.
        * Times on a busy machine are noisy; planning uses FLOPs and bytes, not times.
    """
    step = as_step(model, inputs, loss_fn, loop, caller="profile", keyword="blocks")
    refuse_applied(step.model, "profile")
    setup = _checked_setup(step, blocks, repeats=repeats, with_selective=with_selective,
                           timing=timing, rounding=rounding, device=device, compile=compile,
                           offload=offload, host_bandwidth=host_bandwidth,
                           with_head=with_head)
    stage = progress or (lambda _: None)
    timed = timing and setup.ran_on.type != "meta"
    token = SKIPS_SEEN.set({})  # NOTE [ Blocks skipped at random ] in runs.py
    try:
        return _profiled(setup, blocks, repeats, with_selective, with_head, timed, stage)
    finally:
        SKIPS_SEEN.reset(token)


def _profiled(setup: Setup, blocks: BlockSpec, repeats: int, with_selective: bool,
              with_head: bool | Sequence[str], timed: bool,
              stage: Callable[[str], None]) -> Tape:
    """``profile``'s stages, its arguments checked (``setup``)."""
    step = setup.step
    # the stages: arguments checked (above), the chain found by a warm-up step, the
    # memory runs, the options (selective, head), timing; then the tape built from them
    # (the heap frozen for all of it: NOTE [ The heap frozen while steps are measured ])
    with heap_frozen(), preserved_state(step.model, step.inputs) as kept, \
            training_config(step.model) as cache_notes, compile_settings(setup.backend), \
            _forgetting(step.model, setup.backend), ExitStack() as calls:
        stage("warm-up step")
        given = None if blocks is None else "predicate" if callable(blocks) else "list"
        # (compiled: timed compiled, in _timing)
        chain, setup = _found_chain(setup, given, calls, timed=timed and setup.backend is None)
        try:
            # (tagged also without selective options: a segment's last block's
            # recompute_after comes from the tags)
            base = base_runs(chain.names, setup, stage, tag=True)
            selective = selective_runs(chain.names, base, setup, stage) \
                if with_selective else [{} for _ in chain.names]
            skipped: list[str] = []
        except RematError as exc:
            if not _cached_casts(exc, chain):
                raise
            # NOTE [ Calls of one layer under autocast ]
            base = base_runs(chain.names, setup, stage, tag=False)
            selective = [{} for _ in chain.names]
            skipped = [f"no selective options: a layer run several times per forward "
                       f"under autocast ({chain.autocast}) finds its weights' casts cached "
                       f"in its later calls, where a recompute casts them again; its "
                       f"blocks are kept, recomputed or offloaded whole"]
        notes = _mode_notes(step.model, setup.names, discovered=blocks is None)  # (found)
        notes += skipped
        head, why = profile_head(chain.names, setup, with_head, stage)
        times, untimed = _timing(setup, chain, repeats, timed, stage)
        notes += _built_notes(kept.built())
    notes += [why] if why else []
    notes += _noise_notes(step.model)
    # the model as given (its LayerDrop, its cache), with the calls the chain names
    with calls_for(step.model, chain.names):
        return _tape(setup, chain, base, selective, times, head=head,
                     notes=notes + untimed + chain.notes + cache_notes + base.plain.mem.notes)


def _noise_notes(model: nn.Module) -> list[str]:
    """The note, and a warning, where the model chooses its experts with noise in
    training.

    NOTE [ Experts chosen with noise ]
        A mixture of experts that draws noise into its routing in training (Hugging
        Face's routers copy ``router_jitter_noise`` to ``jitter_noise``: 0.01 by
        SwitchTransformers' default; PhiMoE's ``input_jitter_noise``) draws how many
        tokens each expert takes at every step, and with them the sizes of the experts'
        activations: a small SwitchTransformers measured 9 of its 22 held-out plans up to
        8.2% above their predictions, one over its budget (2026-12-02; with the noise and
        the dropout before the router off, none). The profile measures one draw; it
        says so, and warns, rather than turn the noise off (a step without it is not the
        largest). Dropout before the router draws them too, and is not detected.
    """
    noisy = router_noise(model)
    if not noisy:
        return []
    why = (f"the model chooses its experts with noise in training ({', '.join(noisy)}): "
           f"how many tokens each expert takes is drawn at random at every step, and the "
           f"plan holds for the step profiled; keep a margin below the device's memory "
           f"(a held-out SwitchTransformers: up to 8.2% above its predictions), or set "
           f"the noise to 0")
    warnings.warn(f"autoremat: {why}", UserWarning, stacklevel=4)
    return [why]


def _built_notes(built: list[tuple[str, int]]) -> list[str]:
    """The note naming the tensors the model's forward gave its buffers and attributes
    (NOTE [ A step that builds the model's state ] in ``_core/step.py``); none if it
    gave none."""
    if not built:
        return []
    names = ", ".join(f"{name} ({format_bytes(nbytes)})" for name, nbytes in built[:4])
    more = f" and {len(built) - 4} more" if len(built) > 4 else ""
    total = sum(nbytes for _, nbytes in built)
    return [f"the forward gives tensors to the model's own buffers or attributes, which it "
            f"keeps: {names}{more}; {format_bytes(total)} in all. The figures are of a "
            f"step after the first, as profile measured them; a step that makes them "
            f"anew where none were (the first after profile, auto or verify, which put "
            f"back what the model held) peaks up to that much higher"]


# NOTE [ Calls of one layer under autocast ]
#     Autocast caches the casts of the weights it casts until its region exits. A layer
#     run several times per forward (ALBERT's, a Siamese model's) casts its weights in its
#     first call and finds them cached in the later ones, where a recompute in backward
#     casts them again: the ops differ, and a selective option of a later call cannot be
#     measured (its recompute is refused: "selective recompute ran aten._to_copy as op 2
#     of the block, where its forward ran aten.view"). Such a profile measures no
#     selective option and says so in a note; whole-block decisions are exact (a held-out
#     check, 2026-11-29: profile raised before), with the casts a later kept call holds
#     for a first call that is not kept counted (NOTE [ Saves shared by calls through a
#     cache ] in runs.py). Since 2026-11-30 the recompute re-runs such casts and takes
#     no position for them (NOTE [ Weight casts autocast caches ] in
#     _mechanism/selective.py), so these options are measured; this stays a guard for
#     a recompute still refused so.


def _cached_casts(exc: RematError, chain: Chain) -> bool:
    """Whether ``exc`` is a selective recompute refused for the casts a later call of a
    layer found cached (NOTE [ Calls of one layer under autocast ])."""
    text = str(exc)
    return bool(chain.autocast) and any("@" in name for name in chain.names) \
        and "selective recompute ran" in text and "aten._to_copy" in text


def _found_chain(setup: Setup, given: str | None, calls: ExitStack, *,
                 timed: bool) -> tuple[Chain, Setup]:
    """The chain the first step finds (``find_chain``), and the setup it was found
    under: where blocks ran more than once per forward, each call is a block of its own,
    installed in ``calls`` for the rest of the profile, and the first step runs again
    (NOTE [ A block that runs several times ] in _core/calls.py)."""
    model = setup.step.model
    try:
        chain = find_chain(setup, given=given, timed=timed)
    except RepeatedCalls as exc:
        # the step that found the calls ran its backward
        clear_grads(model, setup.step.inputs)
        names = unrolled(exc.sequence)
        calls.enter_context(calls_for(model, names))
        setup = dataclasses.replace(setup, names=names)
        chain = find_chain(setup, given=given, timed=timed)
    if given is None and setup.names == chain.names and len(chain.names) == 1:
        # the single layer _looped_layers gave (discovery gives two or more) ran once
        raise BlockError(f"found no chain of blocks in {type(model).__name__}"
                         f"{_why_no_chain(model)}")
    return chain, setup


@contextmanager
def _forgetting(model: nn.Module, backend: str | None) -> Iterator[None]:
    """A compiled profile compiles every block once per option: afterwards Dynamo forgets
    that code, so that the user's own compile is not past its recompile limit
    (``forget_compiled``)."""
    try:
        yield
    finally:
        if backend is not None:
            forget_compiled(model)


def _timing(setup: Setup, chain: Chain, repeats: int, timed: bool,
            stage: Callable[[str], None]) -> tuple[BlockTimes, list[str]]:
    """The timing stage: up to ``repeats`` uninstrumented steps (medians; the warm-up
    step's times count as the first, NOTE [ Timing repeats ]), or zeros and a note that
    says why none were taken."""
    if not timed:
        why = "meta tensors" if setup.ran_on.type == "meta" else "timing=False"
        return BlockTimes.unmeasured(len(chain.names)), [f"times not measured ({why})"]
    stage(f"timing {repeats} steps")
    with step_as_run(setup.step.model, chain.names, [], None, setup.backend):
        return timings(setup.step, chain.names, repeats, first=chain.times), []
