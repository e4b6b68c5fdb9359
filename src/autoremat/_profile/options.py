"""Which options a profile measures, and in how many steps.

The patterns of whole-block modes (kept, checkpointed, offloaded) and their
windows by pair of modes, the blocks that measure alike, the selective
save-sets and keep-sets measured together, and the loss head's chunked
options; each measured with the steps of ``runs.py``.

NOTE [ Options measured together ]
    Most selective options are derived from the checkpointed step (NOTE [ Selective
    windows from the checkpointed step ] in ``derive.py``); the others are measured so.
    A selective option's windows are a block's own: from its forward start to the next
    block's, and from its output's gradient to its input's, in a step where the blocks
    around it are checkpointed. So one step measures options on many blocks at once, a
    different option on each, and blocks that measure alike share their figures: same
    class, parameters, input and output bytes, the same ops (kinds, bytes, FLOPs,
    dataflow) and the same windows checkpointed (keyed as in a selective step: after a
    checkpointed block, or for the first block after the kept stem). Each class of
    alike blocks spreads its options over its members, so a stack of identical layers
    takes ceil(options / layers) steps instead of one per option (GPT-2's 11 options on
    6 layers: 2; twice as many where the rule below applies). ``test_profile``
    checks that the figures equal those of one step per option.
    NOTE [ Options measured between checkpointed neighbours ]: a block measuring an
    option in a step has the block before it checkpointed whole there, not running an
    option of its own (until 2026-12-02 every block ran one). A window can depend on
    what the block before does: Autoformer's decoder layer's backward window runs on,
    after its recompute, through backward that the layer before's decision shapes (its
    figures checkpointed after a kept layer and after a checkpointed one differ by 52
    KiB), and the last decoder layer's options, measured after a selective layer, were
    up to 23,168 B (5.4%) under the steps that run them after a checkpointed one, the
    smallest-feasible plan among them, over its budget (a held-out check). The planner
    counts a selective block after a selective one as after a checkpointed one, so
    measured so they are exact. Where no block's windows depend on what the block
    before does (``BaseRuns.local``: NOTE [ Pairs that cannot differ ]; the zoo's and
    Hugging Face's decoders) neighbours still share a step; blocks whose options all
    derive (NOTE [ Selective windows from the checkpointed step ]) take no step, and
    the others at most twice the steps.
    Every run follows the training loop ``loop`` (NOTE [ Which loop a step models ] in
    ``step.py``), so with ``"holds_output"`` each window sees the model's output alive
    until backward has finished, and every prediction made from the tape includes it.
    All runs go through ``preserved_state``: BatchNorm statistics, gradients and RNG
    states are as they were when ``profile`` returns.

NOTE [ Alternations shared by alike blocks ]
    The two steps that alternate kept and checkpointed blocks exist to measure each
    block after a neighbour of the other decision (keys (RECOMPUTE, KEEP) and (KEEP,
    RECOMPUTE)); the first
    measures them on every other block, the second on the rest. Blocks that measure
    alike in the kept and the checkpointed steps (``_alike``: same class, parameters,
    ops, input and output bytes, windows and releases) measure alike in these too, so
    the second step is skipped when every block after the first has an alike block
    after the first that the first alternation measured with each missing pair, and
    takes that block's figures (``by_pairs``). Block 0 neither gives nor takes: its
    "previous block" is the stem, never a block of the chain. A stack of three or more
    identical layers saves a step; ``test_profile`` checks the figures against the
    second step's.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from torch import nn

from autoremat._core.conditions import autocast_state
from autoremat._core.decisions import Choice, Decision
from autoremat._core.errors import RematError, internal_assert
from autoremat._core.head import HEAD_KERNELS, HEAD_WATCH, HeadCall, backend_unavailable
from autoremat._core.saves import keep_keys, keep_set_name, op_signature, save_set_name, save_sets
from autoremat._core.step import clear_grads, unique_storage_bytes
from autoremat._measure.blocks import param_signature
from autoremat._measure.flops import FlopCounter
from autoremat._measure.memory import Rounding, active_tracker, track_memory
from autoremat._measure.ops import OpRecord, OpRecorder, OpStats
from autoremat._measure.regions import RegionCall, RegionTagger
from autoremat._measure.tape import (
    WINDOW_DECISIONS,
    HeadOption,
    HeadProfile,
    SelectiveProfile,
    WindowKey,
    WindowMemory,
)
from autoremat._measure.timing import time_ms
from autoremat._mechanism.compiled import compiled_context
from autoremat._mechanism.head import HeadNotFollowedError, HeadSite, find_head, head_installed
from autoremat._mechanism.offload import measure_host_bandwidth
from autoremat._mechanism.selective import selective_context
from autoremat._mechanism.wrap import ContextFn
from autoremat._plan.costs import CostModel, head_cost
from autoremat._plan.keepsets import keep_sets
from autoremat._profile.derive import HeldAfter, derive, held_after
from autoremat._profile.runs import (
    Contexts,
    MemoryRun,
    Pattern,
    Setup,
    checkpointed_flops,
    first_marks,
    forward_window,
    memory_run,
    recompute_flops_by_block,
    recorded_step,
    released_at_fwd_end,
)

__all__ = ["HEAD_CHUNKS"]


# The chunk counts of the loss head measured as options (NOTE [ Measuring the head ]).
HEAD_CHUNKS = (4, 32)


def _patterns(n: int, offload: bool) -> list[Pattern]:
    """The memory runs of a profile, as the decision of each block: every block kept,
    every one recomputed, then alternations so that each block is measured after a
    neighbour of each other decision (``by_pairs``); with ``offload``, the same for
    offload and offload_input."""
    def alternate(even: Decision, odd: Decision) -> Pattern:
        return tuple(even if i % 2 == 0 else odd for i in range(n))

    keep, recompute = Decision.KEEP, Decision.RECOMPUTE
    order = WINDOW_DECISIONS  # keep, recompute, offload, offload_input
    pairs = [(recompute, keep), (keep, recompute)]
    if offload:
        pairs += [(a, b) for new in order[2:] for old in order[:order.index(new)]
                  for a, b in ((new, old), (old, new))]
    whole = order if offload else order[:2]
    out = [(d,) * n for d in whole]
    if n > 1:
        out += [alternate(a, b) for a, b in pairs]
    return out


_T = TypeVar("_T")


def by_pairs(runs: dict[Pattern, MemoryRun], i: int,
              value: Callable[[Pattern, MemoryRun, int], _T],
              alike: Sequence[int] = (), local: bool = False) -> dict[WindowKey, _T]:
    """``value(pattern, run, i)`` keyed by block ``i``'s (previous decision, own
    decision), from the first run made with each pair (its windows and what else that
    run measured); with ``alike`` (``_alike``), a pair no run made for block ``i > 0``
    from the first block ``j > 0`` alike to it that has one: ``value(pattern, run, j)``
    (NOTE [ Alternations shared by alike blocks ]); with ``local`` (``_pairs_local``),
    (recompute, keep) and (keep, recompute) of a block ``i > 0`` no run made as its
    (keep, keep) and (recompute, recompute) (NOTE [ Pairs that cannot differ ])."""
    out: dict[WindowKey, _T] = {}
    others = [j for j in range(1, len(alike)) if j != i and alike[j] == alike[i]] if i else []
    for j in [i, *others]:
        for pattern, run in runs.items():
            key = (pattern[j - 1] if j > 0 else Decision.KEEP, pattern[j])
            if key not in out:
                out[key] = value(pattern, run, j)
    if local and i > 0:
        keep, recompute = Decision.KEEP, Decision.RECOMPUTE
        for pair, same in (((recompute, keep), (keep, keep)),
                           ((keep, recompute), (recompute, recompute))):
            if pair not in out and same in out:
                out[pair] = out[same]
    return dict(sorted(out.items()))


_Place = tuple[str, int]  # a window of a step: ("F" | "B", block), "pre", "post", "tail", "never"


def _placer(run: MemoryRun, n: int) -> Callable[[int | None], _Place]:
    """The window event ``k`` of ``run`` falls in (``None``: never freed)."""
    # bwd[i + 1] < k <= bwd[i]: block i's backward (NOTE [ Block boundaries in backward ])
    bwd = run.ends
    ascending = bwd[::-1]

    def place(event: int | None) -> _Place:
        if event is None:
            return ("never", 0)
        block = forward_window(run, event)
        if block is not None:
            return ("F", block)
        if event <= run.bounds[0]:
            return ("pre", 0)
        if event <= bwd[n]:
            return ("post", 0)
        if event > bwd[0]:
            return ("tail", 0)
        return ("B", n - bisect.bisect_left(ascending, event))
    return place


def _pairs_local(runs: dict[Pattern, MemoryRun], n: int) -> bool:
    """Whether no block's windows can depend on its predecessor's mode, read from the
    kept and the checkpointed steps (NOTE [ Pairs that cannot differ ])."""
    handed_on: list[list[list[int]]] = []  # per step, per block: bytes block i + 1 frees
    freed_by_first: list[list[int]] = []  # per step: bytes from before the chain block 0 frees
    returned: list[int] = []  # the kept step's: bytes from before the chain freed at return
    for kept, run in ((True, runs[(Decision.KEEP,) * n]),
                      (False, runs[(Decision.RECOMPUTE,) * n])):
        place = _placer(run, n)
        handed: list[list[int]] = [[] for _ in range(n)]
        first: list[int] = []
        for record in run.mem.records:
            (born, i), died = place(record.born), place(record.died)
            if died[0] in ("tail", "never"):
                continue  # held by the caller until the end, whatever the modes
            if born == "pre":
                if died[0] in "FB" and died[1] > 0:
                    return False
                if died == ("B", 0):
                    first.append(record.nbytes)
                elif died[0] == "post" and kept:
                    returned.append(record.nbytes)
            elif born == "F":
                if died in (("F", i), ("B", i)) or (i == n - 1 and died[0] == "post"):
                    continue
                if i + 1 < n and died in (("F", i + 1), ("B", i + 1)):
                    handed[i].append(record.nbytes)
                    continue
                return False
            elif born == "B":
                if died not in (("B", i), ("B", i - 1)):
                    return False
            elif born == "post" and died[0] in "FB" and died[1] < n - 1:
                return False
        handed_on.append([sorted(h) for h in handed])
        freed_by_first.append(sorted(first))
    # what the model made before the chain, held by the checkpoints of the blocks it is
    # passed to and freed when the forward returns in the kept step (a Hugging Face
    # Llama's position ids), may be freed by block 0 in the checkpointed step only (NOTE
    # [ Pairs that cannot differ ])
    by_kept, by_checkpointed = Counter(freed_by_first[0]), Counter(freed_by_first[1])
    return handed_on[0] == handed_on[1] and by_kept <= by_checkpointed \
        and by_checkpointed - by_kept <= Counter(returned)


def _pairs_missing(runs: dict[Pattern, MemoryRun], n: int, alike: Sequence[int],
                   measured: int) -> bool:
    """Whether some block ``i > 0`` has a pair of the ``measured`` whole-block
    decisions that neither it nor an alike block ``j > 0`` was measured with."""
    for i in range(1, n):
        have = by_pairs(runs, i, lambda _, run, k: None, alike)
        if len(have) < measured ** 2:
            return True
    return False


def selective_runs(names: list[str], base: BaseRuns, setup: Setup,
                    stage: Callable[[str], None] = lambda _: None,
                    ) -> list[dict[str, SelectiveProfile]]:
    """Each block's selective options (save-sets of op kinds, keep-sets by position),
    derived from the checkpointed step where its tags allow (NOTE [ Selective windows
    from the checkpointed step ]), else measured in steps where every other block is
    checkpointed or selective, several blocks' options in one step (NOTE [ Options
    measured together ]); block ``i`` takes the figures of block ``alike[i]`` where its
    own could not be derived (NOTE [ Alike blocks derive their own options ]). Recompute
    FLOPs are measured, as for whole blocks: checkpoint's early stop skips the ops after
    the last one backward needs."""
    step, plain = setup.step, base.counter
    ops = [plain.block_ops(name) for name in names]
    stage("selective keep-sets")  # a MILP per cap and distinct block (keepsets.py)
    options = _selective_options(names, [plain.block_stats(name) for name in names], ops,
                                 setup.cost_model)
    alike = base.alike
    members: dict[int, list[int]] = {}
    for i, like in enumerate(alike):
        members.setdefault(like, []).append(i)
        internal_assert(options[i].keys() == options[like].keys(),
                        f"blocks {names[like]} and {names[i]} have the same ops but not the "
                        "same selective options")
    measured: dict[tuple[int, str], tuple[WindowMemory, WindowMemory, int]] = {}
    if any(base.tags):  # NOTE [ Selective windows from the checkpointed step ]
        stage("selective options derived")
        # every block from its own tags (NOTE [ Alike blocks derive their own options ])
        for i, block_options in enumerate(options):
            for key in block_options:
                found = _derived(base, i, key, block_options[key][2], ops[i], setup)
                if found is not None:
                    measured[i, key] = found
    pending = {like: sorted(k for k in options[like] if (like, k) not in measured)
               for like in members}
    steps = max((len(keys) for keys in pending.values()), default=0)
    while any(pending.values()):
        stage(f"selective options {steps - max(len(k) for k in pending.values()) + 1}/{steps}")
        chosen: dict[int, str] = {}  # block -> the option it runs in this step
        for i, like in enumerate(alike):  # (NOTE [ Options measured between checkpointed
            keys = pending[like]  # neighbours ])
            if keys and (base.local or i - 1 not in chosen):
                chosen[i] = keys.pop(0)
        contexts = Contexts({names[i]: options[i][key][0] for i, key in chosen.items()},
                             {names[i]: options[i][key][1] for i, key in chosen.items()})
        counter = FlopCounter() if setup.backend is None else None
        run = memory_run(step, names, (Decision.RECOMPUTE,) * len(names), contexts,
                          rounding=setup.rounding, backend=setup.backend, counter=counter)
        flops = recompute_flops_by_block(counter, plain, names) if counter is not None else \
            checkpointed_flops(step, names, plain, contexts.eager)
        for i, key in chosen.items():
            measured[alike[i], key] = (run.fwd[i], run.bwd[i], flops[i])
    out: list[dict[str, SelectiveProfile]] = [{} for _ in names]
    for i, block_options in enumerate(options):
        # its own figures where its tags gave them, else those of the block it is alike to
        own = _tagged(base, i) is not None
        for key in sorted(block_options):
            fwd, bwd, flops_i = measured.get((i, key)) or measured[alike[i], key]
            held, spans = _held_after(base, i if own else alike[i], key,
                                      options[i if own else alike[i]][key][2])
            out[i][key] = dataclasses.replace(
                block_options[key][2], fwd=fwd, bwd=bwd, recompute_flops=flops_i,
                held_after=held.bytes, held_after_ops=held.ops,
                # (the post levels are the same step's wherever the block stands)
                kept_frees_at=tuple(at for at, _ in held.at_return),
                kept_frees_bytes=tuple(size for _, size in held.at_return),
                bwd_freed_ops=tuple(p for p, _, _ in held.in_backward),
                bwd_freed_bytes=tuple(size for _, size, _ in held.in_backward),
                bwd_freed_span=tuple(span for span, _ in spans),
                bwd_freed_lift=tuple(lift for _, lift in spans))
    return out


# NOTE [ Alike blocks derive their own options ]
#     Blocks alike (``_alike``: the same ops and the same figures in the kept and the
#     checkpointed step) share the selective options measured in steps of their own
#     (NOTE [ Options measured together ]). Options derived from the checkpointed step
#     are not shared: two blocks with the same windows there can free in another order
#     (fuzz seed 242196: two gated units, the second the chain's last, whose output a
#     skip adds to its input; the incoming gradient is the skip's too, so that block's
#     backward frees one tensor fewer before its sigmoid's backward), and an option moves
#     the levels of each by its own events. Taken from the first block, the last
#     block's option keeping the matmuls' outputs was one activation (960 B) under its
#     step in every plan choosing it; each block derived from its own tags, exact. The
#     derivation reads the step's timeline only, no step of its own.


def _derived(base: BaseRuns, i: int, key: str, option: SelectiveProfile,
             ops: tuple[OpRecord, ...], setup: Setup,
             ) -> tuple[WindowMemory, WindowMemory, int] | None:
    """Option ``key`` of block ``i`` derived from the checkpointed step, or ``None``
    (NOTE [ Selective windows from the checkpointed step ])."""
    found = _tagged(base, i)
    if found is None:
        return None
    tags, run = found
    ends = run.ends
    return derive(tags, ops, key, option,
                  windows=((run.bounds[i], run.bounds[i + 1]), (ends[i + 1], ends[i])),
                  backward=run.backward,
                  recompute_flops=base.recompute_flops[i], rounding=setup.rounding)


def _held_after(base: BaseRuns, i: int, key: str, option: SelectiveProfile
                ) -> tuple[HeldAfter, tuple[tuple[int, int], ...]]:
    """What option ``key`` of block ``i`` keeps that the checkpointed step freed between
    the block's forward and the backward (NOTE [ Kept outputs that outlive the forward ]
    in ``derive.py``), and of that what it freed after the chain's forward; 0 where the
    step did not tag the block. With it, ``_spans`` of what it freed in the backward
    before the block's own."""
    found = _tagged(base, i)
    if found is None:
        return HeldAfter(0, (), ()), ()
    tags, run = found
    held = held_after(tags, key, option, fwd_end=run.bounds[i + 1], backward=run.backward,
                      chain_end=run.bounds[-1], bwd_start=run.ends[i + 1])
    return held, _spans(run, i, held)


def _spans(run: MemoryRun, i: int, held: HeldAfter) -> tuple[tuple[int, int], ...]:
    """For each storage of ``held.in_backward``, in the checkpointed step (``run``): how
    many later blocks' backward windows start at or after the event that freed it, and
    how far the peak of the window that freed it would rise with it held from there on;
    ``(-1, 0)`` for one freed before the chain's backward began (NOTE [ Kept outputs
    freed in the backward before the block's ] in ``derive.py``)."""
    ends, levels, n = run.ends, run.mem.levels, len(run.ends) - 1
    out = []
    for _, size, died in held.in_backward:
        if died < ends[n]:
            out.append((-1, 0))
            continue
        span = sum(1 for j in range(i + 1, n) if ends[j + 1] >= died)
        w = i + span + 1  # the window that freed it, where one did
        lift = 0 if w >= n or ends[w] <= died else max(
            0, max(levels[died:ends[w] + 1]) + size - levels[ends[w + 1]] - run.bwd[w].peak_bytes)
        out.append((span, lift))
    return tuple(out)


def post_ckpt_levels(base: BaseRuns, selective: Sequence[dict[str, SelectiveProfile]]
                     ) -> tuple[int, ...]:
    """``tape.post_ckpt_levels``: the checkpointed step's levels from the chain's end to
    the backward's start (above the first), where an option keeps something that step
    freed there (NOTE [ Where the forward returns ] in _plan/peak.py); else none."""
    if not any(option.kept_frees_at for options in selective for option in options.values()):
        return ()
    run = base.runs[(Decision.RECOMPUTE,) * len(selective)]
    start = run.bounds[-1]
    return tuple(level - run.mem.levels[start]
                 for level in run.mem.levels[start:run.backward + 1])


def _tagged(base: BaseRuns, i: int) -> tuple[RegionCall, MemoryRun] | None:
    """What the checkpointed step tagged of block ``i``, and that step; ``None`` where it
    tagged nothing (NOTE [ Selective windows from the checkpointed step ])."""
    tags = base.tags[i] if base.tags else None
    if tags is None:
        return None
    return tags, base.runs[(Decision.RECOMPUTE,) * len(base.recompute_flops)]


_Option = tuple[ContextFn, Any, SelectiveProfile]  # eager context, compiled one, figures


def _selective_options(names: list[str], op_stats: list[dict[str, OpStats]],
                       block_ops: list[tuple[OpRecord, ...]],
                       cost_model: CostModel) -> list[dict[str, _Option]]:
    """Per block, its selective options keyed as the tape keys them: save-sets of op
    kinds (NOTE [ Save-sets by op kind ]) and keep-sets by position, ``#1``, ``#2``, ...
    (NOTE [ Dead ops ]), each with its contexts and static figures. Blocks with the same
    ops share their keep-sets (one MILP per distinct block)."""
    options: list[dict[str, _Option]] = [{} for _ in names]
    for i, stats in enumerate(op_stats):
        for save in save_sets(k for k, s in stats.items() if s.count):
            redo = [s for k, s in stats.items() if k not in save]
            options[i][save_set_name(save)] = (
                selective_context(save), compiled_context(save),
                _partial(sum(s.out_bytes for s in redo), sum(s.count for s in redo)))
    for i, ops in enumerate(block_ops):
        op_names = [o.op for o in ops]
        signature = op_signature(op_names)
        # alike blocks' sets are solved once (NOTE [ Keep-sets solved once per process ])
        for k, found in enumerate(keep_sets(ops, cost_model)):
            rerun = [o for j, o in enumerate(ops)
                     if j not in found.keep and j not in found.skip]
            options[i][keep_set_name(k + 1)] = (
                selective_context(keep_ops=found.keep, skip_ops=found.skip,
                                  signature=signature),
                compiled_context(keep=keep_keys(op_names, found.keep)),
                _partial(sum(o.out_bytes for o in rerun), len(rerun),
                         found.keep, found.skip))
    return options


def _alike(model: nn.Module, names: list[str], runs: dict[Pattern, MemoryRun],
           ops: list[tuple[OpRecord, ...]]) -> list[int]:
    """Per block, the first block that measures as it does (itself if none): the same
    class, parameters, input and output bytes and ops (``ms`` aside), and the same
    figures in the kept and the checkpointed step (``runs``: those two at least).
    NOTE [ Options measured together ], NOTE [ Alternations shared by alike blocks ]."""
    n = len(names)
    kept, ckpt = runs[(Decision.KEEP,) * n], runs[(Decision.RECOMPUTE,) * n]
    # what the model made before the chain and releases when the forward returns is
    # filed under block 0 but is not made by it: HF GPT-2's position ids made its first
    # layer unlike the others, and its 11 selective options took 11 steps instead of 2
    released = [released_at_fwd_end(run, n, before_chain=False) for run in (kept, ckpt)]
    first: dict[tuple[Any, ...], int] = {}
    out = []
    for i, name in enumerate(names):
        module = model.get_submodule(name)
        signature = (
            type(module), param_signature(module),
            kept.probe.input_bytes[i], kept.probe.output_bytes[i],
            tuple(dataclasses.replace(o, ms=0.0) for o in ops[i]),
            # block 0 checkpointed comes after the kept stem (KEEP, RECOMPUTE), any other
            # after a checkpointed block (RECOMPUTE, RECOMPUTE), as in a selective step
            kept.fwd[i], kept.bwd[i], ckpt.fwd[i], ckpt.bwd[i],
            released[0][i], released[1][i],
        )
        out.append(first.setdefault(signature, i))
    return out


def _partial(recompute_bytes: int, recompute_ops: int, keep: tuple[int, ...] = (),
             skip: tuple[int, ...] = ()) -> SelectiveProfile:
    """A selective option's static figures; the measured ones are filled in later."""
    empty = WindowMemory(peak_bytes=0, delta_bytes=0)
    return SelectiveProfile(fwd=empty, bwd=empty, recompute_flops=0,
                            recompute_bytes=recompute_bytes, recompute_ops=recompute_ops,
                            keep_ops=keep, skip_ops=skip)


@dataclass(frozen=True)
class BaseRuns:
    """The memory steps of whole-block decisions, and the FLOPs and ops counted in them."""

    runs: dict[Pattern, MemoryRun]  # by the decision of each block (_patterns)
    counter: OpRecorder  # the plain step's FLOPs by block, and its ops
    recompute_flops: list[int]  # per block, checkpointed on its own
    grad_bytes: int  # all gradients after the plain step
    block_grad_bytes: list[int]  # per block
    host_bandwidth: float  # bytes per second to host memory (0.0 without offload)
    alike: list[int]  # per block, the first block that measures alike (_alike)
    local: bool = False  # pairs read from the uniform steps (NOTE [ Pairs that cannot ... ])
    # per block, what the checkpointed step tagged (NOTE [ Selective windows from the
    # checkpointed step ]); None: not tagged (compiled, offload, no selective options)
    tags: list[RegionCall | None] = dataclasses.field(default_factory=list)

    @property
    def plain(self) -> MemoryRun:
        return self.runs[(Decision.KEEP,) * len(self.recompute_flops)]


def base_runs(names: list[str], setup: Setup,
               stage: Callable[[str], None] = lambda _: None, *,
               tag: bool = False) -> BaseRuns:
    """One memory step per pattern of whole-block decisions (``_patterns``); eager, the plain
    one also records FLOPs and ops, and the checkpointed one recompute FLOPs
    (NOTE [ One pass for memory and FLOPs ]); compiled, two eager steps count them.
    ``tag``: eager and without offload, the checkpointed step also tags each block's
    ops, from which selective options are derived (NOTE [ Selective windows from the
    checkpointed step ])."""
    n, backend = len(names), setup.backend
    step, model = setup.step, setup.step.model
    eager = backend is None
    counter = OpRecorder()
    ckpt_counter = FlopCounter() if eager else None
    runs: dict[Pattern, MemoryRun] = {}
    bandwidth = 0.0
    alike: list[int] = []
    local = False
    patterns = _patterns(n, setup.offload)
    kept, ckpt = (Decision.KEEP,) * n, (Decision.RECOMPUTE,) * n
    taggers = {name: RegionTagger() for name in names} if tag and eager and not setup.offload \
        else {}
    for pattern in patterns:
        if len(runs) == 2:  # kept and checkpointed: which blocks measure alike
            if not eager:  # NOTE [ Profiling a compiled step ]: FLOPs and ops from eager
                counter = recorded_step(step, names)
            alike = _alike(model, names, runs, [counter.block_ops(name) for name in names])
            local = eager and not setup.offload and _pairs_local(runs, n)
            if local:
                break  # NOTE [ Pairs that cannot differ ]
        if len(runs) >= 3 and not setup.offload and \
                not _pairs_missing(runs, n, alike, 2):
            break  # NOTE [ Alternations shared by alike blocks ]
        stage(f"memory runs {len(runs) + 1}/{len(patterns)}")
        runs[pattern] = memory_run(step, names, pattern,
                                    Contexts(dict[str, ContextFn](taggers))
                                    if pattern == ckpt else None,
                                    rounding=setup.rounding, backend=backend,
                                    counter={kept: counter, ckpt: ckpt_counter}.get(pattern)
                                    if eager else None)
        if pattern == kept:  # the gradients the plain step left
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            grad_bytes = unique_storage_bytes(grads)
            block_grad_bytes = [
                unique_storage_bytes([p.grad for p in model.get_submodule(name).parameters()
                                      if p.grad is not None]) for name in names]
            if setup.offload:
                bandwidth = float(setup.host_bandwidth) \
                    if setup.host_bandwidth is not None else measure_host_bandwidth(setup.ran_on)
    clear_grads(model, step.inputs)
    if len(alike) != n:  # a chain of one block
        if not eager:
            counter = recorded_step(step, names)
        alike = _alike(model, names, runs, [counter.block_ops(name) for name in names])
    recompute_flops = recompute_flops_by_block(ckpt_counter, counter, names) \
        if ckpt_counter is not None else \
        checkpointed_flops(step, names, counter)
    tags = [taggers[name].calls[0] if name in taggers and len(taggers[name].calls) == 1
            else None for name in names]
    return BaseRuns(runs=runs, counter=counter, recompute_flops=recompute_flops,
                     grad_bytes=grad_bytes, block_grad_bytes=block_grad_bytes,
                     host_bandwidth=bandwidth, alike=alike, local=local, tags=tags)


# NOTE [ Measuring the head ]
#     Each head option is measured in a memory step, every block kept, with the head
#     chunked (``head_installed``), or replayed from such a step (NOTE [ One head option
#     measured, the others replayed ]): its ``post`` and ``tail`` windows are the head's. The block
#     windows do not depend on the head (they are relative to their start), and neither
#     does what a block's decision changes in ``post`` and ``tail`` (what the model releases
#     when the forward returns: a level that differs by a constant from there on), so a
#     plan with checkpointed blocks uses the option's windows moved by the difference
#     the decisions make with the model's own head (``peak.with_head``), its peak by at
#     least nothing: never below what it measures. Two chunk counts are measured
#     (:data:`HEAD_CHUNKS`): few chunks cost least, many hold least; the transient of a
#     chunk is proportional to its rows, so more options would add little.
# NOTE [ One head option measured, the others replayed ]
#     The chunk count changes nothing outside the chunked forward: before it and after it
#     the step runs the same ops on the same shapes, and the forward leaves the same
#     tensors behind (the loss and the two gradient buffers: NOTE [ A chunked head ]), so
#     the level after it is the same. Only the levels inside it differ, and those depend
#     on shapes, not values. So the first chunk count is measured in a step (the head
#     tells a watcher where its forward starts and ends: ``HEAD_WATCH``), and each other
#     one is that step with the forward's levels replaced by those of the same call run
#     again on its own, on stand-ins of the same shapes (``HeadCall.replay``), under the
#     tracker. The measured count is replayed too: where its replay's levels are not the
#     step's exactly, or a replay does not end at the same level, the others are
#     measured in steps of their own. ``test_head`` checks the replayed options against
#     measured ones.
def _head_options(names: list[str], site: HeadSite, setup: Setup,
                  backends: Sequence[str] = ("",)) -> tuple[HeadProfile | None, str]:
    """The head options of ``site`` by ``backends`` (NOTE [ Measuring the head ], NOTE
    [ One head option measured, the others replayed ], NOTE [ Head backends ]); or
    ``None`` and why, when the chunked head never ran in the step."""
    model = setup.step.model
    step = dataclasses.replace(setup.step, loss_fn=None)  # the chunked head takes the loss
    weight = model.get_submodule(site.name).weight
    weight_bytes = cast(torch.Tensor, weight).untyped_storage().nbytes()
    options = {}
    first: tuple[MemoryRun, HeadCall, int] | None = None
    for choice in head_options_of(backends):
        chunks, backend = choice.chunks, choice.backend
        replayed = _replayed(first, chunks, setup.rounding, backend) \
            if first is not None else None
        if replayed is not None:
            post, tail, peak = replayed
        else:
            calls: list[HeadCall] = []
            try:
                with head_installed(model, site, chunks, backend) as install, \
                        _head_watched(calls):
                    run = memory_run(step, names, (Decision.KEEP,) * len(names),
                                      rounding=setup.rounding)
            except HeadNotFollowedError as e:  # the model's own head, noted
                return None, f"{e.what}: the loss head {site} stays as the model computes it"
            except RematError:
                raise
            except Exception as e:  # the model's own error, said in the note
                # a forward that reads the logits besides the loss (a z-loss over an
                # LMHead's logits, None when chunked): it ran with the head as it is
                clear_grads(model, step.inputs)
                return None, (f"the model's forward raised {type(e).__name__} ({e}) with the "
                              f"loss head {site} chunked, whose logits are None in a step "
                              f"with gradients (does it read them besides the loss?): the "
                              f"head stays as the model computes it")
            if install is None or install.calls != 1:
                count = 0 if install is None else install.calls
                return None, (f"the loss head {site} took {count} losses in one step, not "
                              f"one (was it called without labels?): it stays as the model "
                              f"computes it")
            post, tail, peak = run.post, run.tail, run.mem.peak_bytes
            if first is None and len(calls) == 1 and not backend:
                first = (run, calls[0], chunks)
        tokens = first[1].hidden[0][0] if first is not None else 0
        options[choice.head_key] = HeadOption(
            chunks=chunks, post=post, tail=tail, step_peak_bytes=peak, backend=backend,
            cost=head_cost(chunks, weight_bytes, setup.cost_model, tokens * site.vocab * 4))
    clear_grads(model, step.inputs)
    if first is not None and first[1].hidden[2].type in ("cpu", "cuda"):
        costs = _head_costs(first[1], options, setup.cost_model)
        options = {k: dataclasses.replace(o, cost=costs[k]) for k, o in options.items()}
    return HeadProfile(kind=site.kind, name=site.name, vocab=site.vocab,
                       weight_bytes=weight_bytes, options=options), ""


def head_options_of(backends: Sequence[str]) -> list[Choice]:
    """The head options a profile measures for ``backends`` (NOTE [ Head backends ]):
    :data:`HEAD_CHUNKS` for autoremat's own head ("") and torch's, one for a kernel that
    chunks by itself."""
    found = []
    for backend in backends:
        counts = HEAD_CHUNKS if backend in ("", "torch") else (1,)
        found += [Choice(Decision.CHUNKED, chunks=c, backend=backend) for c in counts]
    return found


# NOTE [ What a head option costs ]
#     A chunked head is not only smaller than the plain one, it can be faster (it makes
#     fewer passes over the logits: NOTE [ The softmax gradient in place ]), or slower
#     (many small chunks use a matmul poorly). So each option's cost is measured, as the
#     plain head's: the head's forward and backward alone, replayed on stand-ins of the
#     step's shapes (``HeadCall.replay_step``), each timed once after the memory replays
#     warmed them (the plain head after one untimed run), in the plain step's units:
#     ``(option ms - plain ms) x the device's matmul rate``, negative where the option is
#     faster. A plan with ``head="auto"`` may then chunk the head where memory is not
#     short. Where nothing could be replayed (a meta step) ``costs.head_cost`` models it.
def _head_costs(call: HeadCall, options: Mapping[str, HeadOption],
                model: CostModel) -> dict[str, int]:
    """Each option's cost over the plain head, by its name (NOTE [ What a head option
    costs ])."""
    device = call.hidden[2]
    plain = call.replay_step(None)
    plain()  # a warm-up: the chunked calls ran in the memory replays
    base = time_ms(plain, device)
    del plain
    costs = {}
    for key, option in options.items():
        replay = call.replay_step(option.chunks, option.backend)
        if option.backend:
            replay()  # a warm-up: a backend measured in a step of its own is cold here
        ms = time_ms(replay, device)
        costs[key] = int((ms - base) / 1e3 * model.flops_per_second)
    return costs


@contextmanager
def _head_watched(calls: list[HeadCall]) -> Iterator[None]:
    """Marks ``head:start`` and ``head:end`` on the tracker around each chunked forward,
    and notes what it was given in ``calls``."""
    def watch(phase: str, call: HeadCall | None) -> None:
        tracker = active_tracker()
        if tracker is not None:
            tracker.mark(f"head:{phase}")
        if call is not None:
            calls.append(call)

    token = HEAD_WATCH.set(watch)
    try:
        yield
    finally:
        HEAD_WATCH.reset(token)


def _replay_levels(call: HeadCall, chunks: int, rounding: Rounding | None,
                   backend: str = "") -> list[int]:
    """The levels of the chunked forward of ``call`` over ``chunks`` chunks by
    ``backend``, run on its own under the tracker, from its start to its end as the head
    marks them (the first level 0: before it)."""
    run = call.replay(chunks, backend)
    with track_memory(rounding) as mem, _head_watched([]):
        loss = run()
    del loss
    marks = first_marks(mem)
    return mem.levels[marks["head:start"]:marks["head:end"] + 1]


def _replayed(first: tuple[MemoryRun, HeadCall, int], chunks: int, rounding: Rounding | None,
              backend: str = "") -> tuple[WindowMemory, WindowMemory, int] | None:
    """``post``, ``tail`` and the step peak of the head over ``chunks`` chunks, from the
    step ``first`` measured with another count (NOTE [ One head option measured, the
    others replayed ]); ``None`` where the replay does not match that step."""
    run, call, measured_chunks = first
    marks = first_marks(run.mem)
    if "head:start" not in marks or "head:end" not in marks:
        return None
    a, b = marks["head:start"], marks["head:end"]
    levels = run.mem.levels
    measured = [level - levels[a] for level in levels[a:b + 1]]
    if _replay_levels(call, measured_chunks, rounding) != measured:
        return None
    inside = _replay_levels(call, chunks, rounding, backend)
    if inside[-1] != measured[-1]:
        return None
    new = levels[:a + 1] + [levels[a] + level for level in inside[1:]] + levels[b + 1:]
    shift = (len(inside) - 1) - (b - a)

    def at(event: int) -> int:
        return event if event <= a else event + shift

    ends = run.ends
    start, stop = run.bounds[-1], ends[-1]  # post: from the forward's end to the last
    # block's backward (the head runs inside it)
    if not start <= a < b < stop:
        return None

    def window(lo: int, hi: int) -> WindowMemory:
        lo, hi = at(lo), at(hi)
        return WindowMemory(peak_bytes=max(new[lo:hi + 1]) - new[lo],
                            delta_bytes=new[hi] - new[lo])

    return window(start, stop), window(ends[0], len(levels) - 1), max(new)


def profile_head(names: list[str], setup: Setup, with_head: bool | Sequence[str],
          stage: Callable[[str], None]) -> tuple[HeadProfile | None, str]:
    """The loss head's options, where the model has a head autoremat can chunk (NOTE
    [ Which heads can be chunked ]); else ``None`` and why ("" when it has no head)."""
    step = setup.step
    site, why = find_head(step.model, step.inputs, step.loss_fn) if with_head else (None, "")
    if site is not None and autocast_state():
        return None, (f"a profile under autocast ({autocast_state()}) measures no loss-head "
                      "options (the chunked head runs in the parameters' dtype): the head "
                      "stays as the model computes it")
    if site is not None and setup.backend is not None:
        return None, ("a compiled profile measures no loss-head options (the head is "
                      "outside the compiled blocks): the head stays as the model computes "
                      "it; plan it from an eager profile")
    if site is None:
        return None, why
    stage("loss head options")
    asked = with_head is not True
    kernels = tuple(HEAD_KERNELS) if with_head is True \
        else tuple(cast(Sequence[str], with_head))
    bias = getattr(step.model.get_submodule(site.name), "bias", None) is not None
    backends, skipped = [], []
    for kernel in kernels:
        backend = HEAD_KERNELS[kernel]
        unavailable = backend_unavailable(backend, setup.ran_on, bias=bias)
        if not unavailable and backend == "torch" and not asked \
                and setup.ran_on.type != "cuda":  # slower than autoremat's own on a CPU
            unavailable = "not measured by default on a CPU (benchmarks/head_kernels.py)"
        if unavailable:
            skipped.append(f"{kernel}: {unavailable}")
        else:
            backends.append(backend)
    if not backends:
        return None, f"no loss-head kernel could be measured: {'; '.join(skipped)}"
    head, why = _head_options(names, site, setup, backends)
    if asked and skipped:
        why = "; ".join([*([why] if why else []),
                         f"loss-head kernels not measured: {'; '.join(skipped)}"])
    return head, why


def check_head_backends(with_head: object) -> None:
    """Refuse a ``with_head=`` list naming a kernel autoremat does not know."""
    known = list(HEAD_KERNELS)
    if isinstance(with_head, str) or not isinstance(with_head, Sequence) or not with_head \
            or any(name not in known for name in with_head):
        raise RematError(f"with_head must be True, False or a list of loss-head kernels "
                         f"from {known}, got {with_head!r}")
