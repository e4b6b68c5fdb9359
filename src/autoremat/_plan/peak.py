"""The peak model: what a plan of a chain of blocks holds, step by step, and its peak.

A plan cuts the chain into segments. Each segment is one kept block, or a run of
consecutive blocks checkpointed together (recomputed in backward from its first input),
or one selective block. Everything here is a pure function of the Tape; the solvers
(:mod:`autoremat._plan.chain`) search over it.

NOTE [ The peak model ]
    The tape gives, per block, windows of the measured timeline (forward and backward,
    plain and checkpointed). Levels compose: the level at any point is the sum of the
    deltas of the windows before it. For a plan, with ``F_i`` the level when block ``i``
    starts its forward, a segment ``s = [i, j]`` contributes

    * forward:   ``F_i + fwd_s``           (the segment's forward transient)
    * holds:     ``F_{j+1} = F_i + hold_s`` (what it keeps until its backward)
    * backward:  ``F_i + hold_s + Z_j + bwd_s``, where ``Z_j`` = post.delta + the
      net leftovers (gradients, mostly) of all blocks after ``j``, which do not depend
      on the plan, and ``bwd_s`` is the segment's backward transient (recompute
      included) above the level at its start.

    plus the plan-independent ``pre``, ``post`` (``F_n + post.peak``) and ``tail``.
    A single kept or checkpointed block uses its measured windows, so the model is
    exact for "none" and "full". A multi-block segment is composed: its forward drops
    the inner boundaries ``x_k`` (no checkpoint holds them), its backward recomputes
    every block but the last as in the plain run, then the last block's checkpointed
    backward window measured after a kept block (the block before it, recomputed as in
    the plain run, may save its own output, the last block's input, which then outlives
    the last block's backward: HGNetV2's stages end in a ReLU, and its segments measured
    up to 0.25% over a composition that took the window after a checkpointed block),
    then the others' plain backward windows. BatchNorm statistics are copied aside
    while the recompute runs only. The recompute holds the segment's first input
    throughout, which the first block's plain forward lets go of: its window is counted
    with that input held from where it died (``fwd_held``). Counted held from the
    window's start (as tapes without that window still are), a segment of two token
    mixers, which let go of their input after their peak, was that input (4,032 B) over
    its step (fuzz seed 160039). Before the recompute starts, the last block's
    backward runs the ops that need no saved tensor (the residual's gradient, a bias's
    gradient, the contiguous copy of a token mixer's transposed gradient), whose outputs
    stay held through the recompute of every block of the segment
    (``BlockProfile.recompute_after``; without it, a segment of an attention block and a
    token mixer measured their bytes over its prediction).

NOTE [ A selective block that keeps its output ]
    A selective block whose save-set keeps the output of its last op (a keep-set that
    keeps the final ReLU of a ResNet block, or the residual add) holds the boundary
    tensor after it until its own backward, as a kept block does; a checkpointed block
    holds only its input, so the next block frees that boundary in its backward. The
    levels of the model come from the plain windows (``Z_j``: the nets of the blocks
    after ``j`` as measured with ``j`` checkpointed), which count that free in the next
    block's backward; the selective window is measured after a next block that no longer
    frees it, so its backward peak stands on a level one boundary higher than the model's.
    So the bytes of each storage of the output the next block takes that the option
    keeps (``BlockProfile.output_ops``, the ops that made them) are added to its backward
    peak: exact where the next block would have freed the boundary, an over-prediction
    by at most one boundary elsewhere. Found on the zoo ResNet (two channels stages,
    batch 4, 16x16 images): a smallest-feasible plan with two selective blocks before
    kept ones measured one activation (32 KiB) over its prediction, as much as the plan
    that checkpoints those blocks. A kept next block that does not save a storage it
    takes (``output_unsaved``) lets go of it in its forward: RevNet's coupling blocks
    return (y1, y2), keep-sets keep y1 (a LayerNorm saves it), and the next block's
    first op only adds to y1; those bytes are held from the forward on instead
    (``hold``), counted twice where the next block is checkpointed and holds them too
    (one storage over, never under; counted in the backward only, they measured 8 KiB
    over their predictions). Tapes without ``output_ops`` (before 2026-11-30) add the
    whole output where the option keeps what the block's last op made (through views
    and in-place writes; unknown counts as kept).

NOTE [ The next block's backward under a selective block that keeps its output ]
    What such a block keeps (above) also outlives the next block's backward, whose
    windows after a checkpointed block (the ones a selective block is seen as) free it
    there: where that window's peak comes after the free (a layer shared by the next
    blocks, whose weight's gradient the next block adds to the other call's once it has
    freed its input), the peak stood one boundary above its prediction (fuzz seed 4593:
    a LayerNorm + Linear block under ``matmul``, then a residual call of a shared
    Linear, kept: 1,344 B, the block's output; 3160 and 6151 likewise). The profile
    records, per block and window, how far the window's peak rises where the storages
    the block before made and this window frees are held to its end
    (``BlockProfile.bwd_input_held``, from the same runs), and a segment after a
    selective block that keeps some of its output is lifted by that, at most by what
    it keeps: the most any selective option of that block keeps (``kept_outputs``), so
    that the DP, whose rows carry a bit for "the block before keeps its output" as for
    the inputs freed later in the chain (NOTE [ Releases in the DP ] in ``chain.py``),
    counts what ``predict_peak`` counts. A segment of several blocks is lifted by the
    larger of its first block's checkpointed and plain windows (it is recomputed, then
    runs its plain backward). Tapes without the field (before 2026-12-01) lift nothing,
    as before.

NOTE [ A block that lets its input go ]
    A block whose forward saves nothing for its backward (a parameter-free pool
    ``x.view(B, L // 2, 2, C).mean(2)``, a scale by a constant) holds nothing when it
    is checkpointed alone: no saved tensor refers to the checkpoint, so its input dies
    in its forward as in the plain step, and its measured checkpointed window shows
    that free. In a segment of several blocks the segment holds its first input (a later
    block's saved tensors keep the checkpoint alive, until the first block that saves
    something has run its backward: NOTE [ A segment's input goes with its earliest
    saver ]; where none saves anything it holds nothing: NOTE [ A segment of blocks that
    all save nothing ]), and an inner block's input is the boundary the composition drops
    itself (``chain_bytes``). Composed from the lone
    windows, a segment starting with such a block counted its input freed, and one
    holding such a block inside counted its input freed twice: one activation under
    the measured step (a fuzzed pooling model's ``optimal`` plans measured up to 9.9%
    over their budgets). So the profile also records each forward window with what it
    frees of the tensors made before it held on to the window's end
    (``BlockProfile.fwd_held``, from the same runs), and the segment's forward is
    composed from those. The recompute keeps the first block's freed input
    (``fwd_frees``), not an inner block's (its input, a tensor the recompute made,
    dies in the recompute as in the plain forward: counted held, segments with such a
    block inside were over by it). A segment ending in such a block is predicted above
    its step by up to a boundary: the recompute stops at the last saved tensor, before
    the block before it makes its output.
    Where the model holds such a block's input past the block (a list of skips popped
    after a later block, or when the forward returns), the plain step and the lone
    checkpoint free it there, and a segment of several starting at the block holds it
    until its backward: counted as the lone block's, such segments measured the input
    over their predictions (13 fuzzed models, up to 1 KiB; ``optimal`` at its smallest
    budget over it). The profile marks the blocks whose forward saves nothing
    (``BlockProfile.lets_input_go``, from the saved-tensor hooks of the step that finds
    the chain); their entries in ``tape.freed_later`` are what the plain step frees
    later, held by such segments only (``holds_later``), and a segment of several starting
    at one releases its inputs' bytes (``input_bytes``) less when the forward returns
    (``held_by_segment``).

NOTE [ A segment's last block that saves nothing ]
    A segment's recompute starts when its backward first needs a tensor the checkpoint
    saved. Where the last block saves nothing (a pool, a scale), its whole backward runs
    first and the gradient it makes stays through the recompute of the blocks before
    it (with the BatchNorm statistics copied aside), which the segment's backward
    counted from the level where the last block's own recompute would start
    (``recompute_after``, 0 for a block with no recompute): a fuzzed [Conv+BatchNorm,
    pool] segment measured that gradient less what the composition counted elsewhere
    (72-136 B, the statistics' bytes) over its prediction. It counts the last block's
    measured backward there (its window's delta). The backward runs on likewise through
    the blocks before it that save nothing (their plain windows' deltas) and into the
    ops of the first block that saves something that need no saved tensor (its
    ``recompute_after``, less its statistics' copy, which the segment counts apart): a
    Linear with an in-place ReLU makes the gradient buffers of the product it wrote
    over (``CopySlices``) before it needs the ReLU's output, and a fuzzed [Linear, pool,
    that, scale] segment measured them (2 KiB) over its prediction.
    The recompute stops at the last tensor the blocks before it saved, so it remakes
    the last block's input only where autograd saved it (the block before saves its
    output: a ReLU's). Where it did not (``BlockProfile.input_saved``), the levels from
    the last block's backward on are counted without it (they count the blocks before
    it recomputed whole): segments ending at a scale after an attention block (fuzz
    seed 120063) were one boundary (1,152 B, 8%) over their steps, now exact; on 14
    fuzzed models whose segments ending at a pool or a scale were over by about a
    boundary, the plans' over-predictions in all 141 KiB, 253 KiB before. The
    recompute's own peak stops there too: the block before's recompute stops at the
    last tensor it saves, before it makes its output where nothing saves that, as its
    recompute in the step with every block checkpointed did (``recompute_peak``, its
    peak there above where it starts; -1 in older tapes, which count its whole plain
    forward). The segment counts the less of that and its plain forward's peak: a
    fuzzed [LayerNorm + Linear, pool, attention] model's segments ending at the pool were
    its Linear's output (4,608 B, 14%) over their steps (seed 160038), now exact.

NOTE [ A segment holds what its blocks take ]
    A checkpoint of several blocks keeps every tensor its blocks were given until its
    backward ends, not only its first input. A tensor the model made before the chain
    and gives some blocks (a mask, position ids) dies in the plain step where the last
    block holding it runs its backward, or when the forward returns where no block
    saves it; a lone checkpoint of a block taking it holds it to that block's backward.
    A segment is composed of its last block's checkpointed window, which frees such a
    tensor where that block's checkpoint held it last in the step that measured it,
    then the plain windows of the blocks before it, which free it where a kept block
    saved it: in the segment it is held on through the windows of the blocks before.
    Jamba with a padded batch (a mask given to its attention layers, which add it and
    save none of it) measured its segments of a Mamba layer and the attention layer
    after it 2,304 B over their predictions (the mask and a 256-byte tensor; 18 of 169
    plans of several segments, the smallest feasible one over its budget). The profile
    records, per block and window, what its backward frees of the tensors made before
    the chain and how far its peak rises where they are held on
    (``BlockProfile.bwd_made_before_freed`` and ``bwd_made_before_held``, from the same
    runs), and a segment holds what its last block's checkpointed window and its inner
    blocks' plain windows free of them on through the windows after; its first block's
    window runs last, where the segment lets go of them. Tensors the model makes between
    blocks are not followed (NOTE [ Tensors held across stacks ]). Tapes without the
    fields (before 2026-12-01) add nothing.

NOTE [ Casts a segment's recompute makes again ]
    Under autocast, a layer called at several blocks casts its weights in its first call
    and finds the casts cached in the later ones (``tape.shared_saves``: the later calls
    save the first's cast). A segment's recompute runs under a cache emptied since, so a
    later call recomputed inside a segment that does not hold the first call casts them
    again and holds the cast until its backward; the segment's recompute is composed of
    the plain forward windows, which found it cached: a [later call, attention] segment
    measured the bf16 weight (128 B; 2 KiB at width 32) over its prediction (fuzzed:
    78 models). Each such block of the segment but its last (whose measured checkpointed
    window casts) holds those bytes from its recompute on.

NOTE [ Tensors held across stacks ]
    In an encoder-decoder planned as one chain, the encoder's output is made between
    the stacks (so in the last encoder block's forward window, NOTE [ Ops between
    blocks ] in ``_profile/runs.py``) and read by every decoder block. Each of them holds it
    whatever its decision: kept, its cross-attention saves it for the key and value
    projections; recomputed, its checkpoint keeps its inputs (a segment keeps its
    blocks' arguments). So it is freed in the backward of the first decoder block, in
    every plan, and the windows measured for that block's decisions already contain the
    release: the composed levels hold it from its creation to there, and no term is
    needed for it. On T5 and BART (both loops, budgets from 90% to the minimum) plans
    of single-block segments predict the measured peak to the byte, and composed
    multi-block segments at or a little above it (``tests/test_hf.py`` checks measured
    peaks against budgets).

NOTE [ Released when the forward returns ]
    A model can hold a block's input outside the chain until its forward returns (a
    U-Net's list of skips, a list of hidden states local to ``forward``). If no block
    holds that tensor for backward (the next block is frozen, or saves nothing of its
    input), the model's release frees it when the forward returns, in the ``post``
    window; if a checkpoint holds it, it lives until that block's backward. So what
    ``post`` frees depends on the decisions of blocks far from the last one, which keys it.
    The profile measures, per block and per key of its windows, the bytes of its input
    released there (``BlockProfile.fwd_end_release``); ``post_window`` corrects the
    measured ``post`` (taken from a step with every block under one decision) for what a
    plan releases instead: in :func:`predict_peak` by what the plan's blocks release
    under their decisions, and in the solver likewise (NOTE [ Releases in the DP ] in
    ``chain.py``; it counted the least any plan releases before, which over-predicted
    plans that checkpoint blocks under autocast by up to a block's weights each). The
    release happens when the forward returns, inside ``post``: the levels after the
    backward starts move by all of it, those before by none of what a plan releases
    more (``released_post_peak``, from ``tape.post_fwd_peak``: the peak before the
    backward starts). A Hugging Face model takes its loss in its forward and peaks in
    the head's backward: counted from the whole window, a GPT-2 under autocast whose last
    block is kept was predicted three blocks' bf16 weights (192 KiB, 5%) over.
    Only the inputs of the blocks up to ``j`` matter for ``Z_j`` (``suffix_z``): those
    of later blocks are gone by ``j``'s backward either way. What the model made before
    the first block and released when the forward returns (a Hugging Face Llama's
    ``position_ids``, passed to every layer) is the first block's: a checkpoint of any
    block it is passed to holds it until that block's backward, so a plan that
    checkpoints any block counts it held through the backward, as the least any mode
    releases (512 bytes under at 64 tokens before; exact where the first block
    checkpointed is the first that takes it, else over by it until then). The solver
    counts it held in every plan but the one that keeps every block, which
    ``chain.solve`` checks by itself first. Likewise a segment's
    recompute keeps what the plain forward of its first block freed (``fwd_frees``: an
    input nothing else keeps; NOTE [ A block that lets its input go ]), so the composed
    recompute counts it held, and before it starts it copies the BatchNorm statistics
    of all its blocks (``stash_bytes``), counted over
    the composed backward (an over-count of the last block's, which its measured window
    holds already). Found by the
    property test (``tests/test_properties.py``): a frozen block after one whose output
    the model keeps in a list, checkpointed, measured one boundary tensor over its
    prediction; so did a segment that starts with a frozen block, and one of blocks
    with BatchNorm.

NOTE [ Inputs the model frees later in the chain ]
    A model may hold a block's input outside the chain and let go of it in a later
    block's window (a U-Net pushes block ``i``'s input on a list of skips and pops it
    into an add after a later block ``w``). Where block ``i`` does not save its input
    (it is frozen, or under autocast it saves a cast), the plain step frees it in
    ``w``'s forward window; a checkpoint of block ``i`` (a segment starting there,
    recomputed or selective) holds it until ``i``'s backward. No window key sees that:
    ``w``'s windows are keyed by ``w - 1`` and ``w``, and the nets in ``Z_j`` come from the
    uniform steps, whose block ``i`` is kept (frees it in ``w``'s window) or checkpointed
    (frees it in ``i``'s backward). The profile records those bytes
    (``tape.freed_later``, "i:w": what the kept step frees there and the checkpointed
    one does not), and each segment's figures are corrected for whether the plan holds
    them (``later_terms``): the segment holding block ``w`` holds them on from there
    where its window was measured freeing them and the plan holds them (the step that
    measured key ``(a, b)`` had block ``i`` under ``b`` at an even distance, else ``a``;
    a composed segment's held windows never free them), and lets them go where it is
    the other way round; a segment ending at ``j``, ``i <= j < w``, has ``Z_j`` from the
    uniform step of its own decision, which holds them at ``j``'s backward where that
    decision checkpoints block ``i``, corrected to what the plan holds (a segment of
    several ending at block ``i`` holds none of its input). Inputs freed in the next
    block's window (``w = i + 1``) are recorded too: a window keyed by a checkpointed
    block ``i`` was measured with ``i``'s own checkpoint holding them, where a segment
    of several ending at ``i`` does not (a fuzzed model's skip around two blocks: 384 B,
    14%, over every plan with such a segment, seed 280736). The forward
    peak of ``w``'s window is raised by what its held window shows (``fwd_held``, at
    most the bytes). Found on a model holding a frozen block's input in a list of skips
    (and on a bf16-autocast one holding the first block's fp32 input): plans that
    checkpoint block ``i`` and keep ``i + 1`` measured the input (1 KiB) over their
    predictions, and the optimal plan over its budget; plans that keep ``i`` and
    checkpoint ``i + 1`` were over-predicted by as much. The solver carries, per row,
    the bits of the inputs its plan holds whose window it has not reached (NOTE
    [ Releases in the DP ] in ``chain.py``). A block that saves nothing holds none of
    its input checkpointed alone, only as the first of a segment of several (NOTE [ A
    block that lets its input go ]): its entries are what the plain step frees, and
    no uniform step's window or ``Z_j`` holds them.
    Block ``i - 1`` may save block ``i``'s input itself (its last op a ReLU, whose output
    the model pushes on the list: a view of it after a transpose). Kept, it holds it
    until its own backward, so neither uniform step frees it in the forward; a step
    with block ``i - 1`` recomputed and block ``i`` kept (one that saves none of it)
    frees it in block ``w``'s window, ``w >= i + 1``, and an alternating step measured
    that window keyed by ``w - 1`` and ``w`` alone: a plan keeping block ``i - 1`` and
    checkpointing block ``i + 1`` measured the input over its prediction (fuzzed: 14
    models, up to 8 KiB; ``optimal`` 3.9 KiB over its budget once), and one
    checkpointing block ``i - 1`` and keeping the rest was over-predicted by as much.
    The profile reads those bytes from the alternating steps (``tape.maker_freed_later``,
    what such a step frees there and the plain one does not), and the plan holds them
    where block ``i - 1`` is kept (or selective: held, over at worst) in a segment of
    its own or a checkpoint of block ``i`` holds them (``later_held``); the measuring
    step held them where its block ``i - 1`` was kept, and ``Z_j`` of a segment ending
    at ``j``, ``i <= j < w``, holds them in both uniform steps (by block ``i - 1``
    kept, by block ``i``'s checkpoint). In the solver, block ``i - 1`` kept on its own
    sets the row's bit that a checkpoint of block ``i`` sets otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoremat._core.decisions import OFFLOAD, OFFLOAD_INPUT, RECOMPUTE, Choice, Decision
from autoremat._core.errors import internal_assert
from autoremat._measure.ops import OpRecord
from autoremat._measure.tape import BlockProfile, SelectiveProfile, Tape, WindowKey, WindowMemory
from autoremat._plan.costs import (
    CostModel,
    cost_model_for,
    keep_set_cost,
    offload_cost,
    recompute_cost,
)

__all__ = [
    "SegmentCost",
    "Segments",
    "block_costs",
    "block_entries",
    "fixed_peaks",
    "freed_later",
    "held_at_return",
    "held_by_segment",
    "held_past_release",
    "holds_input",
    "holds_later",
    "last_inner_release",
    "last_input_through_head",
    "later_held",
    "later_terms",
    "least_release",
    "maker_holds",
    "plan_costs",
    "post_window",
    "predict_peak",
    "release_hidden",
    "release_of",
    "released_post_peak",
    "saves_nothing",
    "segment_cost",
    "segment_hidden",
    "segment_release",
    "segment_runs",
    "selective_options",
    "shared_held",
    "shared_saves",
    "suffix_z",
    "uniform_release",
    "with_head",
]

# A plan of the chain as the peak model reads it: consecutive (start, stop, choice).
Segments = Sequence[tuple[int, int, Choice]]
_KEEP, _RECOMPUTE = Decision.KEEP, Decision.RECOMPUTE


@dataclass(frozen=True)
class SegmentCost:
    """What a segment does to memory and time; see NOTE [ The peak model ]."""

    fwd_peak: int  # forward transient above F_i
    hold: int  # bytes held from the end of its forward until its backward
    bwd_peak: int  # backward transient above the level at its start
    flops: int  # recompute FLOPs
    seen_as: Decision  # what the next block's windows see (Decision.seen_as)
    cost: int | None = None  # what the planner minimises (FLOP-equivalents, see costs.py);
    # None: the recompute FLOPs themselves

    @property
    def rank_cost(self) -> int:
        return self.flops if self.cost is None else self.cost


def _measured_key(block: BlockProfile, key: WindowKey) -> WindowKey:
    """``key``, or where the tape measured no window for it, the key of the step with
    both blocks under this block's decision."""
    return key if key in block.fwd else (key[1], key[1])


def _fwd(tape: Tape, k: int, key: WindowKey) -> WindowMemory:
    b = tape.blocks[k]
    return b.fwd[_measured_key(b, key)]


def _fwd_held(tape: Tape, k: int, key: WindowKey) -> WindowMemory:
    """Block ``k``'s forward window with what it lets go of that was made before it held
    on (NOTE [ A block that lets its input go ])."""
    b = tape.blocks[k]
    found = _measured_key(b, key)
    return b.fwd_held.get(found, b.fwd[found])


def _bwd(tape: Tape, k: int, key: WindowKey) -> WindowMemory:
    b = tape.blocks[k]
    return b.bwd[_measured_key(b, key)]


def _uniform(i: int, decision: Decision) -> WindowKey:
    """Block ``i``'s window key in the step with every block under ``decision`` (the
    first block follows the stem, as a kept one)."""
    return (_KEEP if i == 0 else decision, decision)


def _net(tape: Tape, k: int, decision: Decision) -> int:
    """Bytes block ``k`` leaves behind after its backward in a run of uniform ``decision``."""
    b = tape.blocks[k]
    key = (decision, decision) if (decision, decision) in b.fwd else (_KEEP, decision)
    return b.fwd[key].delta_bytes + b.bwd[key].delta_bytes


def uniform_release(tape: Tape, decision: Decision) -> list[int]:
    """Per block, the bytes of its input released when the forward returns in the step
    with every block under ``decision``, which measured ``post[decision]`` and its nets."""
    return [b.fwd_end_release.get(_uniform(i, decision), 0) for i, b in enumerate(tape.blocks)]


def least_release(tape: Tape) -> list[int]:
    """Per block, the least of its input any plan releases when the forward returns."""
    return [min((b.fwd_end_release.get(key, 0) for key in b.fwd), default=0)
            for b in tape.blocks]


def release_of(tape: Tape, segments: Segments, costs: Sequence[SegmentCost]) -> list[int]:
    """Per block, the bytes of its input a plan's step releases when the forward
    returns: each segment's as :func:`segment_release` counts them, but the first
    block's in a plan that recomputes nothing, as measured (NOTE [ What the model made
    before the chain ])."""
    least = least_release(tape)
    out = list(least)
    prev = _KEEP
    for (start, stop, choice), cost in zip(segments, costs, strict=True):
        out[start:stop] = segment_release(tape, start, stop, choice, prev, cost.seen_as, least)
        prev = cost.seen_as
    if not any(choice.decision.recomputes for _, _, choice in segments):
        first = costs[0].seen_as
        out[0] = tape.blocks[0].fwd_end_release.get((_KEEP, first), 0)
        if len({choice.decision for _, _, choice in segments}) > 1:
            # NOTE [ What the model made before the chain ]
            out[0] = max(0, out[0] - tape.first_release_shared.get(first, 0))
    else:
        for block, size in made_before_released(tape, segments, least):
            out[block] += size
    return out


def made_before_released(tape: Tape, segments: Segments,
                         least: Sequence[int]) -> list[tuple[int, int]]:
    """Of the tensors the model made before the chain and blocks take, those a plan
    that recomputes releases when the forward returns beyond the least (no block of the
    plan taking them checkpoints), as (the first block taking them, bytes): released with
    that block's input, they lower the levels of the backward up to its own, where the
    step that measured the least held them in its checkpoint (the first taker runs its
    backward last); at most what the first block releases beyond its least with every
    block kept (NOTE [ Tensors made before the chain that later blocks take ])."""
    if not tape.freed_at_return:
        return []
    recomputed = _recomputed(segments)
    blocks = tape.blocks
    room = blocks[0].fwd_end_release.get((_KEEP, _KEEP), 0) - least[0]
    out = []
    for first, takers, size in block_entries(tape.freed_at_return):
        if takers[0] == first and not recomputed & set(takers) \
                and _made_before_chain(tape, first, size):
            size = max(0, min(room, size))
            room -= size
            out.append((first, size))
    return out


def _made_before_chain(tape: Tape, first: int, size: int) -> bool:
    """Whether a tensor of ``size`` bytes blocks take besides their input, first block
    ``first``, was made before the chain: taken by the first block, or one the first
    taker's own release (every block kept) is too small to hold (NOTE [ Tensors made
    before the chain that later blocks take ])."""
    return first == 0 or tape.blocks[first].fwd_end_release.get((_KEEP, _KEEP), 0) < size


def segment_release(tape: Tape, start: int, stop: int, choice: Choice, prev: Decision,
                    seen_as: Decision, least: Sequence[int]) -> list[int]:
    """The bytes of their inputs the blocks of segment ``[start, stop)`` under
    ``choice`` (after a block seen as ``prev``; its last block seen as ``seen_as``)
    release when the forward returns, in a plan that recomputes (the solver's moves
    count each as this): its first block as measured under its decision after its
    predecessor's (a segment's as checkpointed, a selective block's too: what it keeps
    of that, its option's ``held_after``, it holds on, NOTE [ Kept outputs that outlive
    the forward ]), less what a segment of several holds of what that block lets go
    (``held_by_segment``); block 0 the least (any checkpoint of a block what the model
    made before the chain is passed to may hold it, NOTE [ Released when the forward
    returns ]); inner blocks as checkpointed after a checkpointed block, at least the
    least any decision releases (NOTE [ Inner blocks' releases ]), the last block less
    its chain bytes (NOTE [ The last block's input after the chain ])."""
    first = least[0] + first_input_release(tape, seen_as, least) if start == 0 else \
        tape.blocks[start].fwd_end_release.get((prev, seen_as), 0)
    if stop - start > 1 and choice.decision.recomputes and saves_nothing(tape, start, stop):
        # NOTE [ A segment of blocks that all save nothing ]: and its input
        first += max(tape.blocks[start].fwd_frees, 0)
    out = [max(0, first - held_by_segment(tape, start, stop, choice.decision)),
           *(inner_release(tape, k, least) for k in range(start + 1, stop))]
    if stop == len(tape.blocks) and stop - start > 1:
        out[-1] = last_inner_release(tape, least)
    return out


def first_input_release(tape: Tape, decision: Decision, least: Sequence[int]) -> int:
    """What block 0 under ``decision`` releases when the forward returns beyond the
    least, less all the tensors blocks take besides their input that the model frees
    when it returns (which the checkpoint of any block taking them may hold): its own
    input, where it saves none of it (NOTE [ The first block's own input ])."""
    # every one, also those taken for made between blocks (a first taker whose own
    # release could hold it): the warm-up step cannot always tell where the model made
    # them, and one made before the chain counted as the first block's own input was
    # held by the checkpoint of a block taking it (a fuzzed model's mask, 400 B under)
    shared = sum(size for _, _, size in block_entries(tape.freed_at_return))
    measured = tape.blocks[0].fwd_end_release.get((_KEEP, decision), 0)
    return max(0, measured - least[0] - shared)


def inner_release(tape: Tape, k: int, least: Sequence[int]) -> int:
    """What block ``k > 0`` releases when the forward returns as an inner block of a
    segment (NOTE [ Inner blocks' releases ])."""
    return max(least[k], tape.blocks[k].fwd_end_release.get((_RECOMPUTE, _RECOMPUTE), 0))


def last_inner_release(tape: Tape, least: Sequence[int]) -> int:
    """What the last block releases when the forward returns as an inner block of a
    segment, which drops its input itself (NOTE [ The last block's input after the
    chain ])."""
    last = tape.blocks[-1]
    measured = last.fwd_end_release.get((_RECOMPUTE, _RECOMPUTE), 0)
    if _held_past_chain(tape, len(tape.blocks) - 1):
        return measured  # the segment does not drop it: the model lets go of it here
    # the step checkpointing every block let go of its input there only where its
    # checkpoint holds none of it
    measured -= last.chain_bytes if last.lets_input_go else 0
    return max(0, least[-1] - last.chain_bytes, measured)


def _held_past_chain(tape: Tape, k: int) -> bool:
    """Whether the model holds the input of block ``k``, the last, past the chain: it
    saves none of it, and the step checkpointing every block let go of it when the
    forward returns (a list of skips popped after the chain; NOTE [ The last block's
    input after the chain ])."""
    block = tape.blocks[k]
    return k == len(tape.blocks) - 1 and block.lets_input_go and \
        block.fwd_end_release.get((_RECOMPUTE, _RECOMPUTE), 0) >= block.chain_bytes > 0


# NOTE [ Inner blocks' releases ]
#     An inner block of a segment releases, when the forward returns, what the block
#     before it made and the step lets go of then: under autocast, that block's weight
#     casts, which nothing in a segment saves and autocast's cache holds until after the
#     loss. Counted at the least any decision releases (kept blocks save their casts:
#     none), every segment of several blocks under autocast was predicted its inner
#     blocks' casts over its step (a Transformers Llama under bf16 autocast, 3 layers:
#     a segment of all three 147 KiB over, 6%; GPT-2 200 KiB; a casts per layer of a
#     7B model are 400 MB). It is counted as the step checkpointing every block
#     measured it (``fwd_end_release`` under (recompute, recompute)): what that step
#     released a segment releases too (it holds only its first block's inputs; the
#     inner boundaries it drops, or lets go of when the forward returns where the model
#     holds them, which a checkpoint of the block would not: more, never less), and at
#     least the least.


# NOTE [ The last block's input after the chain ]
#     The model lets go of a block's input when it binds the block's output in its
#     place, after the block returns: for every block but the last, in the next block's
#     forward window; for the last, after the chain ends, where it is counted as released
#     when the forward returns (``fwd_end_release``) wherever the last block saves none
#     of it (a pool, a scale). A segment of several blocks ending at the last drops that
#     input itself (``chain_bytes``): counted released there as well, it was counted
#     twice, and such segments measured one activation over their predictions (a fuzzed
#     model's [Linear, scale] segment before an in-place ReLU: 4 KiB, 1.4x its prediction,
#     over its budget). As an inner block the last block releases the least it does less
#     its chain bytes (the solver's moves count it likewise, NOTE [ Releases in the DP ]).
#     Where the model holds that input past the chain itself (a list of skips popped
#     after the last block) and the last block saves none of it, the segment cannot
#     drop it: the step checkpointing every block let go of it when the forward
#     returned, and a segment does too (``_held_past_chain``: not dropped in its
#     forward, released as that step measured it). Dropped, a fuzzed [Linear + in-place
#     ReLU, scale] segment after kept blocks under autocast measured 892 B over its
#     prediction (seed 70276).


# NOTE [ A segment's last input its recompute lets go ]
#     A segment's backward counts its last block's checkpointed backward window (the
#     block checkpointed alone, after a kept block) above the blocks before it recomputed
#     as kept ones: those leave their output, the last block's input, behind. Alone, the
#     checkpoint holds that input through the block's backward; in the segment, it is a
#     tensor the recompute made, which lives on only where autograd saved it (the block
#     before saves its output, or the block its input: a float32 Linear). Under autocast
#     a layer saves the bf16 cast of its float32 residual input, not the input: the
#     recompute lets it go when it ends, and every plan of several segments of a
#     Transformers OLMo 2 under bf16 autocast was predicted one residual (16 KiB, 0.7%)
#     over its step (3 layers: all of them; 6 layers: 149 of 169). The warm-up step
#     records which blocks' inputs autograd saved, and, for those whose input it did
#     not, the step with every block checkpointed measures the block's backward window
#     with the input gone from where its recompute ends (``bwd_input_gone_peak``, from
#     its tags and the input's storage record: the checkpoint alone may let go of it
#     before its window peaks, when its first op's backward has run). Where the last
#     block's window after a kept block peaks as it does there, the segment counts that
#     peak (``_last_window``). Counted as the peak less the input, a fuzzed
#     [token mixer, Linear with a residual] segment under autocast measured 536 B over
#     its prediction (seed 2): alone, its window peaks with the input gone already. The
#     figure holds what the window frees of the tensors made before the chain to its
#     end, as the segment does (NOTE [ A segment holds what its blocks take ]): without
#     them, a fuzzed [token mixer, attention given a mask] segment measured 56 B over
#     its prediction (seed 150355 with ``FUZZ_MASK=1``, ``FUZZ_MAX_BLOCKS=8``), where the
#     window peaks after the mask is gone.


# NOTE [ What a segment's recompute lets go when it ends ]
#     The recompute of a segment's blocks before its last counts them as the plain
#     forward runs them (their plain forward windows' deltas), which leave behind what
#     the plain step holds until its forward returns: under autocast, the casts of the
#     weights no op saved, which autocast's cache holds to the end of its region (a
#     Linear whose input needs no gradient saves the cast of its input, not of its
#     weight), and outputs the model holds past the next block. A recompute lets those
#     go when it ends: autocast's region, and the recompute itself, end there. So the
#     levels after it (the blocks' plain backward windows after the last block's) are
#     counted without what each recomputed block's next block released when the plain
#     step's forward returned (``fwd_end_release`` with both kept), but the last
#     block's own input, which its window counts gone already (``input_released``:
#     the bytes of that release that were the block's input). A fuzzed [attention,
#     Linear, attention] model under bf16 autocast whose input needs no gradient (seed
#     161139): segments of the first two blocks were 4,928 B (14%) over their steps, the
#     first block's casts; now exact. The last block's window runs across the end: its
#     recompute is the last of the segment's. The step with every block checkpointed
#     splits that block's window where its recompute ends (``bwd_recompute_split``: the
#     peak until then, and from there on, with its input gone where autograd saves none
#     of it); where its peak there is the window's after a kept block, the levels until
#     the end count what the recompute holds (its cache, the statistics' copies) and
#     those after it count without what it let go: a fuzzed [gated unit, attention,
#     Conv+GroupNorm, attention, LayerNorm + Linear] model under bf16 autocast (seed
#     160234) had segments up to 1,376 B over their steps, now exact. Elsewhere (older
#     tapes, other windows) the window's peak is counted on the recompute's level.


# NOTE [ Tensors made before the chain that later blocks take ]
#     A model whose layers alternate kinds makes a mask per kind before its first layer
#     and passes each layer its own (Gemma 2's sliding and full masks, ModernBERT's local
#     and global ones). The step with every block kept lets go of them when the forward
#     returns, in the first block's release; the checkpoint of a layer taking one holds
#     it to that layer's backward; so a plan that recomputes releases the first block's
#     least (every layer checkpointed, every mask held) and, of the masks, those no
#     checkpointed layer takes. The warm-up step records each with the layers taking it
#     (``tape.freed_at_return``, keyed by its first taker: it cannot tell when the parent
#     made one the first block does not take, and keys it as made between blocks just
#     before its first taker); one the first block takes, or its first taker's own
#     release (block ``first``'s, every block kept) is too small to hold, was made before
#     the chain: counted released where no block taking it is checkpointed
#     (``made_before_released``), with the input of the first block taking it (the step
#     that measured the least held it in the checkpoints of its takers and let go of it
#     in the backward of the first, which runs last: counted with block 0's release, it
#     lowered the backward of the blocks before that a second time, and ModernBERT under
#     autocast measured 256 B over one plan), all of them at most what the first block
#     releases beyond its least with every block kept.
#     Counted at the least, plans keeping a block that takes one and recomputing another
#     were one mask over their predictions (Gemma 2, 3 layers at 2 x 32 tokens: 8 KiB, 6
#     of 8 plans; ModernBERT: 1 KiB); a mask is ``batch x length^2`` elements, a GiB at
#     4 x 8192 tokens in float32. The solver counts the least (over, never under): its
#     plans are predicted with it (``_best_final`` in ``chain.py``), and the smallest
#     feasible budget it names may be above the least by a mask.


# NOTE [ What the model made before the chain ]
#     The first block's release when the forward returns counts what the model made
#     before the chain and let go of then: the first block's input, and tensors it passes
#     to every block (a Llama's rotary cos and sin). The second are released only where no
#     block holds them: in the step with every block offloaded, where the first block's
#     release was measured, but not where a kept block saved them for its backward. A
#     held-out Llama's plan offloading blocks 0, 2 and 3 and keeping block 1 measured 8 KiB
#     (its cos and sin) over its prediction. ``tape.first_release_shared`` holds, per
#     decision, what the first block releases in the uniform step beyond the least it
#     releases under that decision in any step; a plan whose blocks are under more than
#     one decision counts the least.


# NOTE [ The first block's own input ]
#     In a plan that recomputes, the first block releases at least the least any step
#     measured (NOTE [ Released when the forward returns ]: what the model made before
#     the chain may be held by the checkpoint of any block it is passed to). Its own
#     input is not passed to another block: kept, a first block that saves none of it
#     (under autocast it saves the cast) lets go of it when the forward returns, in
#     every plan. Counted at the least, every plan keeping the first block and
#     recomputing another was one boundary over its step (a Transformers OLMo 2 under
#     bf16 autocast, 6 layers: 16 KiB, 1%, in 154 of 169 plans of several segments,
#     and in the single-block plans keeping the first layers). What the first block
#     releases under its decision beyond the least, less every tensor blocks take that
#     the model frees when it returns (``tape.freed_at_return``, also those taken for
#     made between blocks: a fuzzed model's mask, made before the chain and taken by its
#     last block alone, whose release could have held it, was counted the first block's
#     and measured 400 B over two plans), is its own (``first_input_release``); those
#     made before the chain are added where no block taking them is checkpointed
#     (``made_before_released``).


# NOTE [ A release that holds one tensor and lets go of another ]
#     What a block releases when the forward returns depends on its own decision (its
#     input, where the model holds it past the chain: a checkpoint holds it to the
#     block's backward) and on the block before's (under autocast, that block's weight
#     casts: a kept block saves them, a checkpointed one lets them go when autocast's
#     cache is emptied). The levels before the backward starts hold each block's
#     shortfall on the measured step's release (``post_window``), a net: a block under
#     both decisions other than the measured step's may hold its input, which the model
#     let go of before the head ran, and let go of the casts, which go after it. Netted,
#     a fuzzed [gated, mixer, Conv+BN] model under autocast whose skip holds block 1's
#     input past the chain measured that input less the casts (474 B) over the plan
#     checkpointing blocks 0 and 1 (seed 51087). Where a block's key differs from the
#     measured step's in both decisions, the keys between (one decision changed) part its
#     release: what it holds on the way through either beyond the net is held as well
#     (``release_hidden``; the larger of the two ways, over, never under). A segment of
#     several starting at a block that saves nothing holds its input, which the block's
#     own keys count released (``held_by_segment``): held too (a fuzzed [attention,
#     attention, scale, Linear, frozen] model whose skip holds the scale's input past
#     the chain, 690 B under the plan with the scale and the Linear one segment after
#     checkpointed blocks; seed 51294 with a mask, 654 B, its `optimal` plan over its
#     budget). Held in all, that input raised the levels by its bytes where it had been
#     alive at their peak anyway (2,240 B over): each block's release held alone has its
#     measured peak (``BlockProfile.post_held_peak``), and the levels rise by no more
#     than that block's with the others' held added. The solver's moves count what they
#     hold in ``over`` likewise, without the per-block peaks (over, never under).


def post_window(tape: Tape, last: Decision, release: Sequence[int] | None = None,
                before: Sequence[int] | None = None,
                hidden: Sequence[int] | None = None, *,
                returned: int = 0, unreturned: int = 0,
                kept_peak: int | None = None) -> WindowMemory:
    """``tape.post[last]`` (``last``: what the last block is seen as) for a plan whose
    blocks' inputs are released when the forward returns as ``release`` says
    (``None``: the least any plan releases), NOTE [ Released when the forward returns ].
    ``before``: the release that tells the levels before the forward returns, where
    ``release`` counts held what was alive before it in every step (NOTE [ Saves shared
    by calls of a layer ]); default ``release``. ``hidden``: per block, what the plan
    holds of the measured step's release beyond its shortfall (``release_hidden``).
    ``returned``, ``unreturned``, ``kept_peak``: as ``released_post_peak`` takes them."""
    release = least_release(tape) if release is None else release
    measured = uniform_release(tape, last)
    held = [m - r for m, r in zip(measured, release, strict=True)]
    extra = sum(held)  # held on, that was freed (less what the plan frees, that was held)
    window = tape.post[last]
    hidden = [0] * len(held) if hidden is None else hidden
    if not any(held) and not any(hidden) and not returned and not unreturned \
            and kept_peak is None:
        return window
    held_before = held if before is None else [
        m - r for m, r in zip(measured, before, strict=True)]
    by_block = [max(h, 0) + more for h, more in zip(held_before, hidden, strict=True)]
    return WindowMemory(
        peak_bytes=int(released_post_peak(tape, last, extra, sum(by_block), by_block,
                                          returned=returned, unreturned=unreturned,
                                          kept_peak=kept_peak)),
        delta_bytes=window.delta_bytes + extra)


def release_hidden(tape: Tape, k: int, key: WindowKey, last: Decision, held: int = 0) -> int:
    """What block ``k`` under ``key`` holds of what it releases when the forward returns
    in the uniform step of ``last`` beyond its shortfall on that release (NOTE [ A
    release that holds one tensor and lets go of another ]): where its key differs from
    that step's in both decisions, the larger sum of the shortfalls on the way through
    either key between (a key not measured: the shortfall), and ``held``, what its
    segment holds of the release under ``key`` (``held_by_segment``), less the plan's
    shortfall."""
    release = tape.blocks[k].fwd_end_release
    measured = _uniform(k, last)
    at_measured, at_key = release.get(measured, 0), release.get(key, 0)
    held = min(held, at_key)
    ways = [max(0, at_measured - release[at]) + max(0, release[at] - at_key)
            for at in ((measured[0], key[1]), (key[0], measured[1]))
            if at in release and at not in (measured, key)]
    most = max(ways, default=max(0, at_measured - at_key))
    # (of what that step released: no more than all of it)
    return min(most + held, at_measured) - max(0, at_measured - at_key + held)


def segment_hidden(tape: Tape, start: int, stop: int, choice: Choice, prev: Decision,
                   seen_as: Decision, last: Decision) -> list[int]:
    """``release_hidden`` of each block of segment ``[start, stop)`` under ``choice``
    (after a block seen as ``prev``, its first block seen as ``seen_as``; its inner
    blocks checkpointed after a checkpointed block, as ``segment_release`` counts
    them)."""
    first = release_hidden(tape, start, (_KEEP if start == 0 else prev, seen_as), last,
                           held_by_segment(tape, start, stop, choice.decision))
    return [first, *(release_hidden(tape, k, (_RECOMPUTE, _RECOMPUTE), last)
                     for k in range(start + 1, stop))]


def released_post_peak(tape: Tape, last: Decision, extra: int | np.ndarray,
                       held: int | np.ndarray | None = None,
                       by_block: Sequence[int] | None = None, *,
                       returned: int = 0, unreturned: int = 0,
                       kept_peak: int | None = None) -> np.ndarray:
    """The post window's peak where a plan holds ``extra`` bytes more (less, negative)
    than the step that measured ``tape.post[last]`` from when the forward returns, of
    which ``held`` (default ``extra``) are the blocks' bytes it holds more, without those
    it frees more: the levels before the backward starts (``tape.post_fwd_peak``) by at
    most ``held`` more, none less (where in them the forward returns is not recorded),
    those after by ``extra``; one per ``extra`` (a number, or an array of them). Counting
    ``held`` apart: a BERT under autocast whose first layer is recomputed holds on to
    32 KiB the model made before it (its checkpoint takes them) and lets go of 64 KiB of
    the next layer's weight casts; netted, its plan measured 32 KiB over its prediction.
    ``by_block``: ``held`` by block, where known: the levels rise by no more than all of
    one block's release held and the rest held by all of them (``post_held_peak``; NOTE
    [ A release that holds one tensor and lets go of another ]). Where the tape splits
    the window where the step first lets go of a tensor made before the chain's end,
    those moves start there, and ``returned`` more raise every level from there on,
    ``unreturned`` fewer lower those before; ``kept_peak``: the
    levels before the backward where the plan's selective blocks keep what the
    checkpointed step freed after the chain, less those bytes (``last`` checkpointed;
    NOTE [ Where the forward returns ])."""
    window = tape.post[last]
    split = last in tape.post_ret_peak and last in tape.post_returned_peak
    before = tape.post_returned_peak[last] if split else \
        tape.post_fwd_peak.get(last, window.peak_bytes)
    held = extra if held is None else held
    raised = before + np.maximum(held, 0)
    if last in tape.post_fwd_held_peak:  # by no more than all of it held
        raised = np.minimum(raised, max(before, tape.post_fwd_held_peak[last]))
        for k, size in enumerate(by_block or ()):  # (of the same window: not a head's)
            one = tape.blocks[k].post_held_peak.get(_uniform(k, last))
            if size > 0 and one is not None:
                raised = np.minimum(raised, max(before, one) + held - size)
    if split:
        raised = np.maximum(raised + returned, tape.post_ret_peak[last] - unreturned)
    else:
        raised = raised + returned
    if kept_peak is not None:
        raised = np.minimum(raised, kept_peak + np.maximum(held, 0) + returned)
    return np.maximum(raised, tape.post_bwd_peak.get(last, window.peak_bytes) + extra
                      + returned)


def suffix_z(tape: Tape, release: Sequence[int] | None = None,
             kept: set[int] | None = None) -> dict[Decision, list[int]]:
    """``Z[d][j]``: post.delta + net leftovers of the blocks after ``j``, when block
    ``j`` is seen as ``d``, for a plan that releases ``release`` when the forward returns
    (``None``: the least any plan releases). See NOTE [ Who frees a boundary tensor ]
    and NOTE [ Released when the forward returns ]: the inputs of blocks after ``j``
    are gone by ``j``'s backward whenever they were released; those of ``j`` and the
    blocks before it are held on where the plan keeps what the measured step freed.
    ``kept``: the blocks the plan keeps, whose saved tensors a later block takes are
    held on too (``_saved_by_maker``); ``None``, the solver's: left out."""
    n = len(tape.blocks)
    release = least_release(tape) if release is None else release
    out = {}
    for decision in tape.window_decisions:
        measured = uniform_release(tape, decision)
        held_on = [0] * n  # prefix sums of (measured - plan's) release up to j
        acc_held = 0
        for j in range(n):
            acc_held += measured[j] - release[j]
            held_on[j] = acc_held
        z = [0] * n
        acc = tape.post[decision].delta_bytes
        for j in range(n - 1, -1, -1):
            z[j] = acc + held_on[j]
            acc += _net(tape, j, decision)
        if decision.recomputes and kept is not None:
            _saved_by_maker(tape, z, kept)
        out[decision] = z
    return out


def _saved_by_maker(tape: Tape, z: list[int], kept: set[int]) -> None:
    """Count held, in the suffixes ``z`` of checkpointed blocks between them, the tensors
    a block the plan keeps (``kept``) saves that a later block takes (NOTE [ Tensors a
    block saves that a later block takes ] in ``_profile/runs.py``): the nets of the step
    with every block checkpointed free them in the taker's backward, where a kept saver
    holds them on to its own."""
    for saver, takers, size in block_entries(tape.saved_by_maker):
        if saver in kept:
            for j in range(saver + 1, max(takers)):
                z[j] += size


def fixed_peaks(tape: Tape, first: Decision) -> int:
    """Peaks that do not depend on the plan's middle: pre, and the tail (``first``: what
    the first block is seen as)."""
    tail_level = (tape.pre.delta_bytes + tape.post[_KEEP].delta_bytes
                  + sum(_net(tape, k, _KEEP) for k in range(len(tape.blocks))))
    return max(tape.pre.peak_bytes, tail_level + tape.tail[first].peak_bytes)


def segment_cost(tape: Tape, start: int, stop: int, choice: Choice = RECOMPUTE,
                 prev: Decision = _KEEP) -> SegmentCost:
    """Figures of blocks ``start..stop-1`` as one segment under ``choice``, after a
    block seen as ``prev`` (KEEP before the first block)."""
    blocks = tape.blocks
    internal_assert(0 <= start < stop <= len(blocks), f"bad segment {start}:{stop}")
    decision = choice.decision
    if decision is _KEEP:
        internal_assert(stop == start + 1, "a kept segment is one block")
        fwd, bwd = _fwd(tape, start, (prev, _KEEP)), _bwd(tape, start, (prev, _KEEP))
        return SegmentCost(fwd.peak_bytes, fwd.delta_bytes, bwd.peak_bytes, 0, _KEEP)
    model = cost_model_for(tape.device, compiled=bool(tape.compiled))
    if decision.offloads:
        internal_assert(stop == start + 1 and tape.offload,
                        "an offloaded segment is one block of a tape measured offloaded")
        fwd, bwd = _fwd(tape, start, (prev, decision)), _bwd(tape, start, (prev, decision))
        b = tape.blocks[start]
        if decision is Decision.OFFLOAD:
            return SegmentCost(fwd.peak_bytes, fwd.delta_bytes, bwd.peak_bytes, 0, decision,
                               offload_cost(b.offload_bytes, b.offload_tensors, b.fwd_flops,
                                            b.bwd_flops, tape.host_bandwidth, model))
        cost = recompute_cost(b.op_stats, b.fwd_flops, model) + offload_cost(
            b.offload_input_bytes, 1, b.fwd_flops, b.bwd_flops, tape.host_bandwidth, model)
        return SegmentCost(fwd.peak_bytes, fwd.delta_bytes, bwd.peak_bytes,
                           b.recompute_flops, decision, cost)
    if decision is Decision.SELECTIVE:
        internal_assert(stop == start + 1, "a selective segment is one block")
        return _selective_cost(tape, start, choice, prev, model)
    internal_assert(decision is _RECOMPUTE, f"no segment of a chain is {decision.value}")
    return segment_runs(tape, start, stop, prev)[-1]


def block_costs(tape: Tape) -> list[int]:
    model = cost_model_for(tape.device, compiled=bool(tape.compiled))
    return [recompute_cost(b.op_stats, b.fwd_flops, model) for b in tape.blocks]


# NOTE [ A segment's input goes with its earliest saver ]
#     A checkpoint holds its segment's inputs for the recompute as long as a tensor its
#     blocks saved is waiting to be used: the saved tensors refer to it, and it is let
#     go when the last of them is used. The backward runs the segment's blocks last to
#     first, so that is in the backward of the first block that saves something. Where
#     blocks before it in the segment save nothing (pools, scales: NOTE [ A block that
#     lets its input go ]), their backward runs without the segment's first input; the
#     composed backward lets go then of what the segment held of it that the plain step
#     let go of in the first block's forward (``fwd_frees``). Counted held to the
#     segment's end, a fuzzed model's segment of two pools and a token mixer after an
#     embedding was 720 B (5.5%) over its step (seed 280395).
# NOTE [ A segment of blocks that all save nothing ]
#     Where no block of a segment saves anything (``BlockProfile.lets_input_go``: pools,
#     scales, reshapes without parameters), no saved tensor refers to its checkpoint:
#     the segment's runner holds its first input through the forward, as it holds
#     every segment's (NOTE [ Segments without a wrapper module ] in
#     ``_mechanism/segments.py``), and lets it go when the forward returns; its
#     backward recomputes nothing and runs as the plain one. So its first block releases,
#     when the forward returns, what the segment held of its input that the plain step
#     let go of in that block's forward (``fwd_frees``, in ``segment_release``), and
#     nothing past it (``held_by_segment``), and the backward is composed from the
#     blocks' plain windows. Composed as a segment holding its input through the
#     backward, with a recompute, a fuzzed model's two pools after an embedding (seed
#     280395) were one activation (3,072 B, 28%) over in every plan with a segment of
#     the two, ``sqrt``'s (26%) among them. Predicted as the pools checkpointed alone,
#     four models' plans were under their steps (up to 6,116 B): the runner's hold in
#     the forward.
# NOTE [ A recomputed input the model held outside the chain ]
#     The recompute of a segment remakes an inner block's input; the model's own copy,
#     which it held past the block (a list of skips, ``tape.freed_later``), is not that
#     copy. Where the block saves none of its input, the recompute's copy dies in the
#     block's recompute, not where the model let go of its own: the plain forward's
#     window, which the composed recompute follows, counts the input held on (it died
#     later), so the recompute's level counts it gone after the block (over every
#     segment recomputing such a block by it before: fuzz seed 280736, 368 B, 14%).
#     Where the block before saves it (``maker_freed_later``), the recompute holds its
#     copy for that block's backward.
def segment_runs(tape: Tape, start: int, last_stop: int, prev: Decision,
                 costs: list[int] | None = None) -> list[SegmentCost]:
    """Costs of the checkpointed segments ``[start, stop)`` for every ``stop`` up to
    ``last_stop``, built incrementally (O(length) for all of them)."""
    blocks = tape.blocks
    costs = costs if costs is not None else block_costs(tape)
    out: list[SegmentCost] = []
    f_level = f_peak = 0  # forward: every block as checkpointed; inner inputs released
    r_level = r_peak = 0  # backward: recompute all blocks as in the plain forward...
    back = 0  # ...then their plain backward: max over k of (deltas after k + peak of k)
    flops = cost = 0
    stash = 0  # a segment's recompute copies every block's BatchNorm statistics first
    # NOTE [ Casts a segment's recompute makes again ]
    recast = _recast(shared_saves(tape), start, last_stop)
    # NOTE [ Casts a later call takes from the cache and does not save ] in
    # _profile/runs.py: held by the cache from their block's recompute to the recompute's
    # end, not into the backward
    cached = _recast(block_entries(tape.cached_casts), start, last_stop)
    cache = 0  # what the cache holds of them in the recompute of the blocks so far
    # NOTE [ What a segment's recompute lets go when it ends ]: of the blocks recomputed
    # whole so far, what the plain step held until its forward returned
    let_go = 0
    # per block so far: the recompute's peak before it, the level the block's recompute
    # starts at, and the block's own peak above it (NOTE [ A segment's last block that
    # saves nothing ])
    before: list[tuple[int, int, int]] = []
    # NOTE [ A segment's input goes with its earliest saver ]: the first block of the
    # segment that saves something, and what the segment holds of its input that the
    # plain step let go of in the first block's forward
    saver = next((k for k in range(start, last_stop) if not blocks[k].lets_input_go),
                 last_stop)
    kept_input = max(blocks[start].fwd_frees, 0)
    # NOTE [ A recomputed input the model held outside the chain ]
    outside = [0] * len(blocks)
    for i, _, size, maker in freed_later(tape):
        outside[i] += 0 if maker else size
    for k in range(start, last_stop):
        b = blocks[k]
        cost += costs[k]
        stash += b.stash_bytes
        # NOTE [ A block that lets its input go ]
        window = _fwd_held(tape, k, (prev if k == start else _RECOMPUTE, _RECOMPUTE))
        f_peak = max(f_peak, f_level + window.peak_bytes)
        f_level += window.delta_bytes
        if k > start and not _held_past_chain(tape, k):
            f_level -= b.chain_bytes
        peak_so_far = r_peak  # the recompute of the blocks before k
        if k == start:  # a single block: its measured checkpointed windows
            fwd, bwd = _fwd(tape, k, (prev, _RECOMPUTE)), _bwd(tape, k, (prev, _RECOMPUTE))
            out.append(SegmentCost(fwd.peak_bytes, fwd.delta_bytes, bwd.peak_bytes,
                                   flops + b.recompute_flops, _RECOMPUTE, cost))
        else:
            # Blocks start..k-1 are recomputed in full (later ones need their outputs);
            # the last one stops early as a checkpointed block does, so its measured
            # checkpointed backward window (recompute included) applies, after a block
            # that holds what a kept one holds (the recomputed block k-1 may save its
            # output, the last block's input, which then outlives the last block's
            # backward); then the plain backward of the others. The statistics are
            # stashed while the recompute runs, and put back when it ends.
            last = _bwd(tape, k, (_KEEP, _RECOMPUTE))
            # NOTE [ A segment holds what its blocks take ]
            last_freed, last_held = _frees_made_before(b, (_KEEP, _RECOMPUTE))
            # the last block's backward ops that need no saved tensor run before the
            # recompute starts, and hold their outputs through it (recompute_after);
            # all of them where it saves nothing (NOTE [ A segment's last block that
            # saves nothing ])
            after, unmade = b.recompute_after, 0
            if b.lets_input_go:
                # NOTE [ A segment's last block that saves nothing ]: the backward runs on
                # into the blocks before it that save nothing, and those of the first
                # that saves something that need no saved tensor, before the recompute
                after, j = last.delta_bytes, k - 1
                while j > start and blocks[j].lets_input_go:
                    after += blocks[j].keep_bwd.delta_bytes
                    j -= 1
                # (its figure counts its statistics' copy, which stash counts here)
                after += max(0, blocks[j].recompute_after - blocks[j].stash_bytes)
                unmade = 0 if b.input_saved else b.chain_bytes
                # the recompute stops in block j, at the last tensor it saves
                if blocks[j].recompute_peak >= 0:
                    prior, level, own = before[j - start]
                    peak_so_far = max(prior, level + min(own, blocks[j].recompute_peak))
            gone = let_go + _let_go(b)  # NOTE [ What a segment's recompute lets go ... ]
            until, then = _last_window(b, last, last_held)
            if k < saver:  # NOTE [ A segment of blocks that all save nothing ]
                bwd_peak = _plain_back(b, back)
            else:
                # NOTE [ A segment's input goes with its earliest saver ]
                input_gone = kept_input if k == saver else 0
                bwd_peak = max(stash + after + peak_so_far,
                               stash - b.stash_bytes + r_level - unmade + cache + until,
                               r_level - unmade - gone + then,
                               r_level - unmade - gone + last.delta_bytes + back
                               + last_freed - input_gone)
            # NOTE [ The last block's input through the head's forward ]
            through = last_input_through_head(tape, start, k + 1)
            # (a segment of blocks that all save nothing recomputes nothing)
            out.append(SegmentCost(max(f_peak, f_level + through) if through else f_peak,
                                   f_level, bwd_peak,
                                   flops + b.recompute_flops if k >= saver else 0,
                                   _RECOMPUTE, cost))
        flops += b.fwd_flops
        # the recompute keeps what the plain forward freed in the first block (its
        # input, held by the segment): counted held from where it died
        kept = (max(b.fwd_frees, 0) if k == start else 0) + recast[k - start]
        own = _recomputed_fwd_peak(b, first=k == start) + recast[k - start]
        cache += cached[k - start]
        before.append((r_peak, r_level + cache, own))
        r_peak = max(r_peak, r_level + cache + own)
        r_level += b.keep_fwd.delta_bytes + kept
        if k > start and not b.input_saved:  # NOTE [ A recomputed input the model held ...
            r_level -= outside[k]
        if k > start:  # (block k's release counts what block k - 1 made)
            let_go += _let_go(b, whole=True)
        if k == start:  # its window runs last: what it frees goes with the segment
            back = b.keep_bwd.peak_bytes
        else:  # an inner block: held on through the windows of the blocks before it
            # (NOTE [ A segment's input goes with its earliest saver ])
            back = _plain_back(b, back, kept_input if k == saver else 0)
    return out


def _plain_back(block: BlockProfile, back: int, gone: int = 0) -> int:
    """The peak of ``block``'s plain backward window and then ``back`` (the composed
    backward of the blocks before it in a segment) above the window's start, with what
    the window frees of the tensors made before the chain held on (NOTE [ A segment
    holds what its blocks take ]) and ``gone`` bytes let go when it ends."""
    freed, held = _frees_made_before(block, (_KEEP, _KEEP))
    return max(block.keep_bwd.peak_bytes + held,
               back + block.keep_bwd.delta_bytes + freed - gone)


def _recomputed_fwd_peak(block: BlockProfile, first: bool) -> int:
    """The peak of ``block``'s plain forward as a segment's recompute runs it: the
    segment's ``first`` block with what its plain forward lets go of that was made
    before it (its input) held from where it died (its held window with both kept;
    where not measured, held from the window's start), the others as measured."""
    if not first or block.fwd_frees <= 0:
        return block.keep_fwd.peak_bytes
    held = block.fwd_held.get((_KEEP, _KEEP))
    return held.peak_bytes if held is not None else \
        block.keep_fwd.peak_bytes + block.fwd_frees


def _let_go(block: BlockProfile, whole: bool = False) -> int:
    """What the plain step released of what the block before ``block`` made when its
    forward returned (its release with both kept), which a segment's recompute that
    remakes it lets go when it ends (NOTE [ What a segment's recompute lets go when it
    ends ]); for the segment's last block (not ``whole``), without its input, which
    the last block's window lets go of (all of it where that release was not measured
    and autograd does not save the input)."""
    release = block.fwd_end_release.get((_KEEP, _KEEP), 0)
    if whole:
        return release
    if block.input_released >= 0:
        return release - block.input_released
    return release if block.input_saved else max(0, release - block.chain_bytes)


def _last_window(block: BlockProfile, last: WindowMemory, held: int) -> tuple[int, int]:
    """The peak of ``last``, the checkpointed backward window of a segment's last block
    ``block`` after a kept one, with what it frees of the tensors made before the chain
    held on (raising it by ``held``), after the blocks before it recomputed as kept
    ones: while the segment's recompute runs, and after it ends. Where its peak is the
    one seen in the step with every block checkpointed, from that window split where its
    recompute ends (NOTE [ What a segment's recompute lets go when it ends ]), or, in
    older tapes, that window's peak with its input gone from there, where autograd
    saves none of it, for both (NOTE [ A segment's last input its recompute lets go ])."""
    whole = last.peak_bytes + held
    alone = block.bwd.get((_RECOMPUTE, _RECOMPUTE))  # where the recompute's end was seen
    if block.lets_input_go or alone is None or alone.peak_bytes != last.peak_bytes:
        return whole, whole
    until, then = block.bwd_recompute_split
    if until >= 0:
        # NOTE [ A segment's last block whose input the block before holds ]
        return min(whole, until), min(whole, max(then, block.bwd_recompute_then_held))
    if block.bwd_input_gone_peak >= 0:
        whole = min(whole, block.bwd_input_gone_peak)
    return whole, whole


# NOTE [ A segment's last block whose input the block before holds ]
#     The split of the last block's window where its recompute ends comes from the step
#     with every block checkpointed, where the block's own checkpoint alone holds its
#     input and lets it go when its backward no longer needs it. In a segment the input
#     is the block before's output, recomputed as the plain forward runs it: where that
#     block saves it (an in-place ReLU, a sigmoid), it outlives the last block's window.
#     Counted freed, the levels after the recompute were under the step by the input
#     wherever they peak after that free (fuzz seed 250385, reduced to a Linear with an
#     in-place ReLU before an attention block given a mask made before the chain, bf16
#     autocast: the segment of both 336 B under, its peak at the attention's weight
#     gradient's cast, after its checkpoint let the input and the mask go). The profile
#     measures that part of the window with the input held on too, where the plain step
#     holds it past the window (``bwd_recompute_then_held``); the whole window's figure
#     (the window after a kept block, the made-before tensors held) still bounds it.
def _frees_made_before(block: BlockProfile, key: WindowKey) -> tuple[int, int]:
    """What ``block``'s backward window under ``key`` frees of the tensors the model made
    before the chain, and how far its peak rises where they are held on (NOTE [ A segment
    holds what its blocks take ])."""
    key = _measured_key(block, key)
    return (block.bwd_made_before_freed.get(key, 0),
            block.bwd_made_before_held.get(key, 0))


def _recast(entries: Sequence[tuple[int, tuple[int, ...], int]], start: int,
            last_stop: int) -> list[int]:
    """Per block ``start..last_stop - 1``, the bytes of ``entries`` (casts: ``(the block
    that made them, the later blocks taking them, bytes)``) its recompute in a segment
    from ``start`` makes again: those of a later taker whose first is before
    ``start``."""
    out = [0] * (last_stop - start)
    for first, takers, size in entries:
        for k in takers:
            if first < start <= k < last_stop:
                out[k - start] += size
    return out


def _selective_cost(tape: Tape, i: int, choice: Choice, prev: Decision,
                    model: CostModel) -> SegmentCost:
    """A selective block, measured between checkpointed neighbours; after a kept block
    we add the difference that neighbour makes to the same block fully checkpointed."""
    block = tape.blocks[i]
    key = choice.selective_key
    internal_assert(key in block.selective, f"no selective profile {key!r} for {block.name}")
    sel = block.selective[key]
    # what it keeps that the model would have dropped before the backward stays held
    # (NOTE [ Kept outputs that outlive the forward ] in _profile/derive.py)
    held, freed_later = _kept_output_bytes(block, choice, sel.keep_ops, sel.held_after_ops)
    # what the checkpointed step freed in the backward before the block's (NOTE [ Kept
    # outputs freed in the backward before the block's ]): on its backward's level, or
    # held from the forward on where it was freed before the chain's backward
    freed = freed_in_backward(block, sel)
    early = sum(size for span, size, _ in freed if span < 0)
    fwd_peak = sel.fwd.peak_bytes
    hold = sel.fwd.delta_bytes + sel.held_after + held + early
    # NOTE [ A selective block that keeps its output ]
    bwd_peak = sel.bwd.peak_bytes + freed_later + sum(size for span, size, _ in freed
                                                      if span >= 0)
    ckpt = (_RECOMPUTE, _RECOMPUTE)
    if i > 0 and prev is not _RECOMPUTE:
        f_here, f_ref = _fwd(tape, i, (prev, _RECOMPUTE)), _fwd(tape, i, ckpt)
        b_here, b_ref = _bwd(tape, i, (prev, _RECOMPUTE)), _bwd(tape, i, ckpt)
        fwd_peak += f_here.peak_bytes - f_ref.peak_bytes
        hold += f_here.delta_bytes - f_ref.delta_bytes
        bwd_peak += b_here.peak_bytes - b_ref.peak_bytes
    if choice.keep_set:
        cost = keep_set_cost(block.ops, sel.keep_ops, sel.skip_ops, model)
    else:
        cost = recompute_cost(block.op_stats, block.fwd_flops, model, saved=choice.save_ops)
    return SegmentCost(fwd_peak, hold, bwd_peak, sel.recompute_flops, _RECOMPUTE, cost)


def freed_in_backward(block: BlockProfile, sel: SelectiveProfile
                      ) -> list[tuple[int, int, int]]:
    """What a selective option keeps that the checkpointed step freed in the backward
    by the start of the block's own backward window, other than the output the next
    block takes (``_kept_output_bytes`` counts that), as (how many later blocks'
    backward windows start after its free, -1 where it was freed before the chain's
    backward; its bytes; how far it lifts the window that freed it): NOTE [ Kept outputs
    freed in the backward before the block's ] in ``_profile/derive.py``."""
    taken = set(block.output_ops or ())
    return [(span, size, lift) for op, size, span, lift in zip(
        sel.bwd_freed_ops, sel.bwd_freed_bytes, sel.bwd_freed_span, sel.bwd_freed_lift,
        strict=True) if op not in taken]


def _with_freed_in_backward(tape: Tape, segments: Segments,
                            costs: Sequence[SegmentCost]) -> list[SegmentCost]:
    """``costs`` with the backward of each segment holding a block whose window a
    selective block's kept storage spans (``freed_in_backward``) lifted by its bytes,
    and the segment of the window that freed it by its lift (NOTE [ Kept outputs freed
    in the backward before the block's ])."""
    out = list(costs)
    for start, _, choice in segments:
        if choice.decision is not Decision.SELECTIVE:
            continue
        block = tape.blocks[start]
        option = block.selective[choice.selective_key]
        for span, size, lift in freed_in_backward(block, option):
            if span < 0:
                continue  # held from the forward on (_selective_cost)
            for k, (first, stop, _) in enumerate(segments):
                if first <= start + span and stop - 1 > start:
                    out[k] = dataclasses.replace(out[k], bwd_peak=out[k].bwd_peak + size)
                elif lift and first <= start + span + 1 < stop:
                    out[k] = dataclasses.replace(out[k], bwd_peak=out[k].bwd_peak + lift)
    return out


def _kept_output_bytes(block: BlockProfile, choice: Choice, keep_ops: tuple[int, ...],
                       counted: tuple[int, ...] = ()) -> tuple[int, int]:
    """The bytes of the block's output a selective option keeps (NOTE [ A selective
    block that keeps its output ]), as (those a kept next block lets go of in its
    forward, the others): each storage of the output the next block takes that the
    option keeps, where the tape records which ops made them (``output_ops``); else the
    whole output, among the others, where the option keeps what the block's last op
    made. Not those of the ops in ``counted``: the option's ``held_after`` holds them
    from the forward on already (a storage the checkpointed step freed before the
    backward: an x-transformers layer's output, which its residual's add lets go of, was
    counted twice, one activation over per selective layer)."""
    ops, keep_set = block.ops, bool(choice.keep_set)
    if block.output_ops is None:
        kept = _keeps_output(ops, choice.save_ops, keep_ops, keep_set)
        return 0, block.output_bytes if kept else 0
    held = freed_later = 0
    for j in block.output_ops:
        if j in keep_ops if keep_set else ops[j].kind in choice.save_ops:
            if j in block.output_unsaved and j in counted:
                continue
            if j in block.output_unsaved:
                held += ops[j].out_bytes
            else:
                freed_later += ops[j].out_bytes
    return held, freed_later


def _keeps_output(ops: Sequence[OpRecord], save: tuple[str, ...], keep_ops: tuple[int, ...],
                  keep_set: bool) -> bool:
    """Whether a selective option keeps the storage of the block's output: the one its
    last op created (through views and in-place writes); unknown counts as kept."""
    j = len(ops) - 1
    for _ in range(len(ops)):
        if j < 0:
            return True
        op = ops[j]
        if op.view or (op.inplace and op.target != j):
            nxt = op.target if op.inplace else (op.inputs[0] if op.inputs else -1)
            if nxt < 0 or nxt >= j:
                return True
            j = nxt
            continue
        return j in keep_ops if keep_set else op.kind in save
    return True


def kept_output_bytes(tape: Tape, i: int, choice: Choice) -> int:
    """The bytes of block ``i``'s output that ``choice`` keeps and a next block, kept,
    would free in its backward (``_kept_output_bytes``'s second figure); 0 for every
    choice but a selective one."""
    if choice.decision is not Decision.SELECTIVE:
        return 0
    block = tape.blocks[i]
    sel = block.selective.get(choice.selective_key)
    internal_assert(sel is not None, f"no selective profile {choice.selective_key!r} "
                    f"for {block.name}")
    assert sel is not None  # for mypy: internal_assert raised otherwise
    return _kept_output_bytes(block, choice, sel.keep_ops)[1]


def kept_outputs(tape: Tape) -> list[tuple[int, int]]:
    """``(block b, bytes)`` for each block whose backward frees the storages of its
    input that the block before it, selective, may keep (NOTE [ The next block's
    backward under a selective block that keeps its output ]): the most any selective
    option of that block keeps of them."""
    out = []
    for b in range(1, len(tape.blocks)):
        if not tape.blocks[b].bwd_input_held:
            continue
        size = max((kept_output_bytes(tape, b - 1, Choice.selective_from_key(key))
                    for key in sorted(tape.blocks[b - 1].selective)), default=0)
        if size:
            out.append((b, size))
    return out


def input_held_lift(tape: Tape, b: int, stop: int, choice: Choice, size: int) -> int:
    """What the backward peak of segment ``[b, stop)`` under ``choice`` rises by where
    the block before holds ``size`` bytes of block ``b``'s input through block ``b``'s
    backward (NOTE [ The next block's backward under a selective block that keeps its
    output ]): at most ``size``, by block ``b``'s window after a checkpointed block
    (that lets them go), under its decision; the first block of a segment of several is
    recomputed and then runs its plain backward, so both windows count."""
    block = tape.blocks[b]
    decision = choice.decision
    if stop - b > 1:
        keys = [(_RECOMPUTE, _RECOMPUTE), (_KEEP, _KEEP)]
    else:
        keys = [(_RECOMPUTE, _RECOMPUTE if decision is Decision.SELECTIVE else decision)]
    lift = max(block.bwd_input_held.get(_measured_key(block, key), 0) for key in keys)
    return min(size, lift)


def _with_kept_outputs(tape: Tape, segments: Segments,
                       costs: Sequence[SegmentCost]) -> list[SegmentCost]:
    """``costs`` with each segment after a selective block that keeps its output lifted
    by ``input_held_lift`` (NOTE [ The next block's backward under a selective block
    that keeps its output ])."""
    sizes = dict(kept_outputs(tape))
    if not sizes:
        return list(costs)
    out = list(costs)
    for k in range(1, len(segments)):
        start, stop, choice = segments[k]
        before = segments[k - 1]
        if start in sizes and kept_output_bytes(tape, before[0], before[2]):
            lift = input_held_lift(tape, start, stop, choice, sizes[start])
            out[k] = dataclasses.replace(out[k], bwd_peak=out[k].bwd_peak + lift)
    return out


def selective_options(tape: Tape, offload: bool = False) -> list[list[Choice]]:
    """Per block, the selective options its tape measured, and with ``offload`` (on a
    tape measured offloaded) offloading it."""
    extra = [OFFLOAD, OFFLOAD_INPUT] if offload and tape.offload else []
    return [[Choice.selective_from_key(key) for key in sorted(b.selective)] + extra
            for b in tape.blocks]


def plan_costs(tape: Tape, segments: Segments) -> list[SegmentCost]:
    """Costs of consecutive segments, each seeing its predecessor as it is seen."""
    out: list[SegmentCost] = []
    prev = _KEEP
    for start, stop, choice in segments:
        cost = segment_cost(tape, start, stop, choice, prev)
        out.append(cost)
        prev = cost.seen_as
    return out


def _recomputed(segments: Segments) -> set[int]:
    """The blocks a plan checkpoints (recomputed, selective or with their input
    offloaded): whose checkpoints hold what they take until their backward."""
    return {i for start, stop, choice in segments if choice.decision.recomputes
            for i in range(start, stop)}


# NOTE [ Saves shared by calls of a layer ]
#     A layer called at several blocks of the chain under autocast casts its weights in
#     its first call; its later calls find the casts in autocast's cache and save them
#     too (``tape.shared_saves``, NOTE [ Saves shared by calls through a cache ] in
#     ``_profile/runs.py``). The tape's windows count them as if no later call held them:
#     held until the first call's backward where it is kept, else released when the
#     forward returns (in the release of the block after it). A plan that does not keep
#     the first call and keeps a later one holds them from then until the backward of
#     the first of the kept later calls (the last of them to run backward): counted
#     there as that block releasing them less (``shared_held``), which lowers no level
#     before the forward returns, and holds them in the post window and the backward of
#     that block and every block after it. Exact where the release of the block after
#     the first call counts them (the first call's next block is checkpointed or kept
#     alone); an over-count of them where it does not (that block is an inner block of a
#     segment, counted at the least it releases), and within the window of the block
#     that frees them (where in it they die is not kept). On the repro of a ModuleList
#     holding one layer at positions 0 and 2 under CPU bf16 autocast, every plan that
#     recomputes the first call and keeps the second measured its casts (8 KiB, 6%)
#     over its prediction before. The solver carries, per row, the shared saves whose
#     first call it did not keep and no later call has held yet (NOTE [ Releases in
#     the DP ] in ``chain.py``).


def block_entries(entries: dict[str, int]) -> list[tuple[int, tuple[int, ...], int]]:
    """A tape's entries keyed by blocks, ``"first:later[,later...]"`` (``saved_by_maker``,
    ``freed_at_return``, ``held_past_release``, ``shared_saves``, ``freed_later``), as
    (first, the later blocks, bytes), in the order of their keys."""
    out = []
    for key, size in sorted(entries.items()):
        first, later = key.split(":")
        out.append((int(first), tuple(int(b) for b in later.split(",")), size))
    return out


def shared_saves(tape: Tape) -> list[tuple[int, tuple[int, ...], int]]:
    """``tape.shared_saves`` and ``tape.cast_saves`` (the profile put the latter's as if
    their first block saved them) as (the block that saves them first, the later blocks
    saving them, bytes), in a fixed order (NOTE [ Saves shared by calls of a layer ])."""
    if not tape.shared_saves and not tape.cast_saves:
        return []
    return sorted(block_entries(tape.shared_saves) + block_entries(tape.cast_saves))


def shared_held(tape: Tape, segments: Segments) -> list[tuple[int, int]]:
    """What a plan holds of the shared saves past where the tape's windows release them,
    as (the block whose backward frees them, bytes): NOTE [ Saves shared by calls of a
    layer ]."""
    if not tape.shared_saves and not tape.cast_saves:
        return []
    decision = [_KEEP] * len(tape.blocks)
    for start, stop, choice in segments:
        for i in range(start, stop):
            decision[i] = choice.decision
    out = []
    for first, savers, size in shared_saves(tape):
        kept = [q for q in savers if decision[q] is _KEEP]
        if decision[first] is not _KEEP and kept:
            out.append((kept[0], size))
    return out


# An input the model frees later in the chain: (block i, window w, bytes, whether block
# i - 1 saves it kept: from ``tape.maker_freed_later``)
Later = tuple[int, int, int, bool]


def freed_later(tape: Tape) -> list[Later]:
    """``tape.freed_later`` and ``tape.maker_freed_later`` as (block ``i``, window ``w``,
    bytes, from the latter), in a fixed order (NOTE [ Inputs the model frees later in
    the chain ])."""
    return sorted([(i, w, size, False) for i, (w,), size in block_entries(tape.freed_later)]
                  + [(i, w, size, True)
                     for i, (w,), size in block_entries(tape.maker_freed_later)])


def maker_holds(decision: Decision) -> bool:
    """Whether block ``i - 1``, a segment of its own under ``decision``, may hold an
    input of block ``i`` it saves (``tape.maker_freed_later``): kept, it saves it; a
    selective block may keep the op that made it (counted held: over, never under)."""
    return decision is _KEEP or decision is Decision.SELECTIVE


def later_held(tape: Tape, later: Later, segments: Segments) -> bool:
    """Whether ``segments`` hold ``later``'s input past its window: a checkpoint of its
    block holds it (``holds_later``), or, for one block ``i - 1`` saves, that block is
    kept in a segment of its own (``maker_holds``)."""
    i, _, _, maker = later
    return any(holds_later(tape, i, start, stop, choice.decision) or (
        maker and start == i - 1 and stop == i and maker_holds(choice.decision))
        for start, stop, choice in segments)


def holds_input(decision: Decision) -> bool:
    """Whether a block under ``decision``, first of its segment, holds its input on
    the device until its backward (its checkpoint does; an offloaded input is on host)."""
    return decision is _RECOMPUTE or decision is Decision.SELECTIVE


def holds_later(tape: Tape, i: int, start: int, stop: int, decision: Decision) -> bool:
    """Whether segment ``[start, stop)`` under ``decision`` holds block ``i``'s input
    until its backward (NOTE [ Inputs the model frees later in the chain ]): it starts
    there and checkpoints, and the block saves something or the segment has more blocks
    (NOTE [ A block that lets its input go ])."""
    return start == i and holds_input(decision) and (
        stop - start > 1 or not tape.blocks[i].lets_input_go)


def saves_nothing(tape: Tape, start: int, stop: int) -> bool:
    """Whether no block of ``start..stop-1`` saves anything for its backward (NOTE
    [ A segment of blocks that all save nothing ])."""
    return all(tape.blocks[i].lets_input_go for i in range(start, stop))


def held_by_segment(tape: Tape, start: int, stop: int, decision: Decision) -> int:
    """The bytes of its first block's inputs a segment of several blocks holds that the
    block's own checkpoint lets go (it saves nothing: NOTE [ A block that lets its input
    go ]), past the forward's return; 0 for any other segment, and for one whose blocks
    all save nothing (NOTE [ A segment of blocks that all save nothing ])."""
    block = tape.blocks[start]
    if stop - start > 1 and holds_input(decision) and block.lets_input_go \
            and not saves_nothing(tape, start, stop):
        return block.input_bytes
    return 0


def later_terms(tape: Tape, later: Later, start: int, stop: int,
                choice: Choice, prev: Decision, seen_as: Decision,
                held: bool) -> tuple[int, int, int]:
    """What to add to the ``(fwd_peak, hold, bwd_peak)`` of segment ``[start, stop)``
    under ``choice`` (after a block seen as ``prev``; its last block seen as
    ``seen_as``) for block ``i``'s input that the model frees in block ``w``'s window
    (``later``: ``(i, w, bytes, maker)``), where the plan holds it (``held``:
    ``later_held``) or not (NOTE [ Inputs the model frees later in the chain ]);
    ``bwd_peak``'s is above the level with the hold's added."""
    i, w, size, maker = later
    alone = not tape.blocks[i].lets_input_go  # block i's own checkpoint holds them
    fwd = hold = bwd = 0
    if start <= w < stop:
        decision = choice.decision
        if stop - start > 1:
            measured = True  # composed of held windows, or the checkpointed step's
        else:
            key = _measured_key(tape.blocks[w], (
                prev, _RECOMPUTE if decision is Decision.SELECTIVE else decision))

            def under(k: int) -> Decision:  # block k's decision in the step measuring key
                return key[1] if (w - k) % 2 == 0 else key[0]

            measured = (alone and holds_input(under(i))) or (maker and under(i - 1) is _KEEP)
        hold = size * (int(held) - int(measured))
        if held and not measured:
            fwd = size
            if stop - start == 1 and decision is not Decision.SELECTIVE:
                plain, kept = _fwd(tape, w, key), _fwd_held(tape, w, key)
                fwd = min(size, max(0, kept.peak_bytes - plain.peak_bytes))
    # Z of a segment ending before w comes from the uniform step of its last block: that
    # step's block i holds them checkpointed, its block i - 1 (one that saves them) kept
    if i <= stop - 1 < w:
        uniform = (alone and holds_input(seen_as)) or (maker and seen_as is _KEEP)
        bwd = size * (int(held) - int(uniform))
    return fwd, hold, bwd


def _with_later(tape: Tape, segments: Segments,
                costs: Sequence[SegmentCost]) -> list[SegmentCost]:
    """``costs`` with ``later_terms`` added (NOTE [ Inputs the model frees later in
    the chain ])."""
    later = freed_later(tape)
    if not later:
        return list(costs)
    held = [later_held(tape, entry, segments) for entry in later]
    out = []
    prev = _KEEP
    for (start, stop, choice), cost in zip(segments, costs, strict=True):
        fwd = hold = bwd = 0
        for entry, entry_held in zip(later, held, strict=True):
            f, h, b = later_terms(tape, entry, start, stop, choice, prev, cost.seen_as,
                                  entry_held)
            fwd, hold, bwd = fwd + f, hold + h, bwd + b
        out.append(dataclasses.replace(cost, fwd_peak=cost.fwd_peak + fwd,
                                       hold=cost.hold + hold, bwd_peak=cost.bwd_peak + bwd))
        prev = cost.seen_as
    return out


def predict_peak(tape: Tape, segments: Segments) -> int:
    """Predicted step peak of a plan given as consecutive ``(start, stop, choice)``."""
    costs = plan_costs(tape, segments)
    release = release_of(tape, segments, costs)
    at_return = held_at_return(tape, segments, costs, release)
    unshared, release = release, list(release)
    for freed_in, size in shared_held(tape, segments):
        release[freed_in] -= size  # NOTE [ Saves shared by calls of a layer ]
    z = suffix_z(tape, release, set(range(len(tape.blocks))) - _recomputed(segments))
    level = tape.pre.delta_bytes
    # the chain's forward windows come before the forward returns, the rest after: what
    # the plan holds of the model's release at the return (``at_return``) is in the
    # levels of the forward already (NOTE [ Held at the return, after the return ])
    peak, after = 0, fixed_peaks(tape, costs[0].seen_as)
    costs = _with_later(tape, segments, costs)  # NOTE [ Inputs the model frees later ... ]
    costs = _with_kept_outputs(tape, segments, costs)
    costs = _with_freed_in_backward(tape, segments, costs)
    kept_to_return = 0  # of the selective blocks' holds so far (NOTE [ Where the ... ])
    for (start, stop, choice), cost in zip(segments, costs, strict=True):
        bwd = level + cost.hold + z[cost.seen_as][stop - 1] + cost.bwd_peak
        peak = max(peak, level + cost.fwd_peak - kept_to_return)
        after = max(after, bwd)
        level += cost.hold
        kept_to_return += kept_at_return(tape, start, choice)
    last = costs[-1].seen_as
    prev, hidden = _KEEP, []
    for (start, stop, choice), cost in zip(segments, costs, strict=True):
        hidden += segment_hidden(tape, start, stop, choice, prev, cost.seen_as, last)
        prev = cost.seen_as
    kept_peak = kept_post_peak(tape, segments) - kept_to_return \
        if kept_to_return and last is _RECOMPUTE and tape.post_ckpt_levels else None
    post = post_window(tape, last, release, unshared, hidden, returned=at_return,
                       unreturned=kept_to_return, kept_peak=kept_peak)
    return max(peak, after + at_return, level + post.peak_bytes) \
        + held_past_release(tape, segments)


def kept_post_peak(tape: Tape, segments: Segments) -> int:
    """The checkpointed step's highest level after the chain and before the backward
    (``tape.post_ckpt_levels``) with what the plan's selective blocks keep of what it
    freed there held from where it died on (NOTE [ Where the forward returns ])."""
    added = np.zeros(len(tape.post_ckpt_levels), dtype=np.int64)
    for start, _, choice in segments:
        if choice.decision is Decision.SELECTIVE:
            option = tape.blocks[start].selective[choice.selective_key]
            for at, size in zip(option.kept_frees_at, option.kept_frees_bytes, strict=True):
                added[min(at, len(added) - 1)] += size
    return int(np.max(np.asarray(tape.post_ckpt_levels, dtype=np.int64) + np.cumsum(added)))


def kept_at_return(tape: Tape, start: int, choice: Choice) -> int:
    """Of what a selective block keeps past the forward and ``_selective_cost`` holds
    from it on (its option's ``held_after``), the bytes the checkpointed step freed when
    the forward returned: in the levels before the return already (NOTE [ Where the
    forward returns ]); 0 for other choices."""
    if choice.decision is not Decision.SELECTIVE:
        return 0
    option = tape.blocks[start].selective.get(choice.selective_key)
    return 0 if option is None else option.held_at_return


# NOTE [ The last block's input through the head's forward ]
#     A segment of several blocks ending at the last drops that block's input when the
#     block returns (``chain_bytes``), as the model lets go of it binding the block's
#     output in its place; the step with every block checkpointed held it through the
#     head (the last block's own checkpoint), so ``tape.post`` measured the head's forward
#     on a level with it. Where the model holds it past the block itself (a list of skips
#     popped into an add after the chain), it is still alive when that add makes its
#     output; where the last block saves that input, or its window does not free it, no
#     measured step tells when the model lets go of it. There the head's forward is
#     counted with the input held (the window's peak before the backward, on the level
#     with it, as the segment's forward peak, which the solver reads too): at most that
#     input over (where the model binds the output at once), never under (a fuzzed
#     [pool, scale, pool, Linear + in-place ReLU] model under autocast with a skip
#     around its last block, seed 291217: its ``sqrt`` plan 362 B under, exposed once its
#     segment of the pools was no longer over-counted).
def last_input_through_head(tape: Tape, start: int, stop: int) -> int:
    """The head's forward peak above the level after the chain's forward, with the
    last block's input held, for a segment of several ``[start, stop)`` ending at the
    last block where the model may hold that input past it; 0 otherwise (NOTE [ The
    last block's input through the head's forward ]). Counted in the segment's
    forward peak, which the solver reads too."""
    k = len(tape.blocks) - 1
    block = tape.blocks[k]
    if stop != k + 1 or stop - start < 2 or block.chain_bytes <= 0 \
            or _held_past_chain(tape, k) \
            or not (block.input_saved or block.fwd_frees < block.chain_bytes):
        return 0
    post = tape.post[_RECOMPUTE]
    return block.chain_bytes + tape.post_fwd_peak.get(_RECOMPUTE, post.peak_bytes)


# NOTE [ Held at the return, after the return ]
#     What ``held_at_return`` counts is a tensor the model holds until its forward
#     returns, so every step holds it through the chain's forward, and the forward
#     windows count it alive; what differs is after the return, where the plan's
#     checkpoint of a block taking it holds it on and the measured release let it go. It
#     was added to the whole peak, so a plan that peaks in a block's forward was predicted
#     it over (``test_a_tensor_blocks_take_that_the_model_frees_when_it_returns_is_
#     counted_held[forward-peak]``: 64 KiB). It lifts the levels from the return on: the
#     backward's, the tail's and the post window's from where the step first lets go of
#     a tensor made before the chain's end (NOTE [ Where the forward returns ]; the whole
#     post window where the tape does not say).

# NOTE [ Where the forward returns ]
#     The model lets go of what it holds outside the chain when the frame holding it
#     returns: the chain's caller, a sub-model (BERT's encoder model, before its head),
#     or the model itself (x-transformers' wrapper, after its logits). The tape splits the
#     post window's peak before the backward where each uniform step first frees a
#     storage made before the chain's end (``tape.post_ret_peak``: before;
#     ``tape.post_returned_peak``: from there on): before it no release has happened, so
#     what a plan holds of them raises only the levels from there on. Two counts that
#     were over where the step peaks in the model's own head:
#     * what a plan holds of the model's release (``held_at_return``, NOTE [ Held at the
#       return, after the return ]);
#     * what a selective option keeps that the checkpointed step freed after the chain
#       (``SelectiveProfile.held_at_return``, part of its ``held_after``): x-transformers'
#       decoders keep every attention's keys and values in a list until they return,
#       alive in every step until then, which the derived windows count already.
#       ``_selective_cost`` holds them from the block on (the next block's release lets
#       them go at the return), so the chain's later forward levels and the levels
#       before the first free subtract them (``kept_at_return``), and where the last
#       block is checkpointed the post window's levels before the backward are at most
#       that step's levels with them held from where each died (``tape.post_ckpt_levels``,
#       the option's ``kept_frees_*``: ``kept_post_peak``). With an option's output
#       counted once (``held_after_ops``, ``_kept_output_bytes``), the decoder's
#       ``selective`` plan went from 28% over to its measured peak (fp32 and bf16; 36%
#       to 8% with residual attention). After a kept last block the step that measured
#       the post window saved them, and where the plan's keeping lets go of them there
#       is not known: over by them in those levels, never under.
#     The solver's rows still count the second in the forward levels (over for such
#     plans: a plan found is predicted as above, and one a row's figure put over the
#     budget is not tried). Tapes before 2026-12-02 have none of these figures and count
#     both over the whole window.

def held_at_return(tape: Tape, segments: Segments,
                   costs: Sequence[SegmentCost] | None = None,
                   release: Sequence[int] | None = None) -> int:
    """What a plan holds through the step of the tensors blocks take besides their input
    that the model frees when its forward returns (NOTE [ Tensors blocks take that the
    model frees when it returns ] in ``_profile/runs.py``), where its windows count them
    freed: one a checkpointed block takes, as far as the plan counts it released then
    (``release_of``) with the block after the one that returned it. ``costs`` and
    ``release``: the plan's, where the caller has them."""
    if not tape.freed_at_return:
        return 0
    costs = plan_costs(tape, segments) if costs is None else costs
    release = release_of(tape, segments, costs) if release is None else release
    holding = _recomputed(segments)
    total = 0
    for first, takers, size in block_entries(tape.freed_at_return):
        if _made_before_chain(tape, first, size):
            continue  # the first block's release counts it by its takers (NOTE
            # [ Tensors made before the chain that later blocks take ]); the plan's
            # release of its first taker does not hold it (under autocast it holds the
            # block before's casts: Jamba's mask was counted held over them, 2 KiB over)
        taking = set(takers)
        if len(taking) > 1 and taking <= holding and {first - 1, first} <= holding:
            continue  # counted held where its release was measured: every taker (two or
            # more; one alone, Funnel under autocast measured up to 16 KiB over) and the
            # block before it checkpointed, as in the step that measured that release
        if holding & taking:
            total += min(size, release[first])
    return total


def held_past_release(tape: Tape, segments: Segments) -> int:
    """What a plan may hold past where the plain step frees it (NOTE [ Tensors blocks
    take that die later in the chain ] in ``_profile/runs.py``): a tensor taken first by
    block ``first`` and freed in block ``window``'s forward window, where the plan
    recomputes a block from ``first`` to ``window - 2``, unless ``window`` and the block
    before it are each checkpointed alone (the step checkpointing every block measured
    that window with it held)."""
    if not tape.held_past_release:
        return 0
    recomputed = _recomputed(segments)
    alone = {start for start, stop, choice in segments
             if choice.decision is _RECOMPUTE and stop == start + 1}
    total = 0
    for first, (window,), size in block_entries(tape.held_past_release):
        if any(first <= i <= window - 2 for i in recomputed) \
                and not {window - 1, window} <= alone:
            total += size
    return total


def _moved(option: WindowMemory, by_decision: WindowMemory,
           kept: WindowMemory) -> WindowMemory:
    """A head option's window (measured with the last or first block kept) for a block
    under another decision: moved by the difference that decision makes with the
    model's own head (NOTE [ Measuring the head ] in ``_profile/options.py``), its peak by at
    least nothing."""
    delta = by_decision.delta_bytes - kept.delta_bytes
    lift = max(0, delta, by_decision.peak_bytes - kept.peak_bytes)
    return WindowMemory(peak_bytes=option.peak_bytes + lift,
                        delta_bytes=option.delta_bytes + delta)


def with_head(tape: Tape, head: Choice) -> Tape:
    """The tape as the step runs with loss head ``head`` (kept: the tape itself, else one
    of ``tape.head.options``): its ``post`` and ``tail`` windows are the head's."""
    if head.decision is _KEEP:
        return tape
    internal_assert(tape.head is not None and head.head_key in tape.head.options,
                    f"no head option {head.head_key!r} in the tape")
    option = tape.head.options[head.head_key]  # type: ignore[union-attr]
    return dataclasses.replace(
        tape, post_fwd_peak={}, post_fwd_held_peak={}, post_bwd_peak={}, post_ret_peak={},
        post_returned_peak={}, post_ckpt_levels=(),  # the head's own: not recorded
        post={d: _moved(option.post, w, tape.post[_KEEP]) for d, w in tape.post.items()},
        tail={d: _moved(option.tail, w, tape.tail[_KEEP]) for d, w in tape.tail.items()})
