"""The peak model never predicts below the measured step: regression cases found by
measuring ``plan()`` + ``apply()`` on the zoo (NOTE [ The peak model ] in
``_plan/peak.py``)."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoremat
from autoremat import Tape, zoo
from autoremat._core.decisions import KEEP, RECOMPUTE, Choice, Decision
from autoremat._plan.plan import plan_of_segments
from autoremat._plan.strategies import smallest_feasible_bytes
from autoremat._verify import step_measure

from _steps import ResidualMlp
from conftest import SMALL, plans_with_options


def _measured(name: str, plan: autoremat.Plan) -> int:
    model, inputs = zoo.build(name, **SMALL[name])  # the model the tape was measured on
    return _applied_peak(model, inputs, plan)


def _applied_peak(model: nn.Module, inputs: Any, plan: autoremat.Plan) -> int:
    """The step peak of ``model`` with ``plan`` applied; the model is left as it was."""
    autoremat.apply(model, plan)
    try:
        return step_measure(autoremat.Step(model, inputs)).peak_bytes
    finally:
        autoremat.remove(model)


@pytest.mark.parametrize("name", ["resnet", "gpt2"])
def test_a_selective_block_before_kept_ones_is_predicted_from_above(
        name: str, zoo_tapes: Callable[..., Tape]) -> None:
    # NOTE [ A selective block that keeps its output ]: on the ResNet a keep-set that
    # keeps the block's final ReLU, before kept blocks, measured one activation over
    # its prediction
    tape = zoo_tapes(name, **SMALL[name])
    n = len(tape.blocks)
    checked = 0
    for i, block in enumerate(tape.blocks):
        for key in sorted(block.selective):
            choice = Choice.selective_from_key(key)
            segments = [(k, k + 1, choice if k == i else KEEP) for k in range(n)]
            plan = plan_of_segments(tape, segments, "test")
            assert _measured(name, plan) <= plan.predicted_peak_bytes, (block.name, key)
            checked += 1
    assert checked >= n


def test_the_smallest_feasible_resnet_plan_fits_its_prediction(
        zoo_tapes: Callable[..., Tape]) -> None:
    # its BudgetError named a smallest feasible budget whose plan measured what the plan
    # that checkpoints the same blocks does, one activation over it
    tape = zoo_tapes("resnet", **SMALL["resnet"])
    least = smallest_feasible_bytes(tape)
    plan = autoremat.plan(tape, least)
    assert plan.predicted_peak_bytes <= least
    assert _measured("resnet", plan) <= least


def test_what_the_model_makes_before_the_first_block_is_counted_held() -> None:
    # NOTE [ Released when the forward returns ]: a Hugging Face Llama given no
    # position_ids makes them before its first layer and passes them to every layer; a
    # checkpoint of any layer holds them until its backward, where the plain step frees
    # them when the forward returns (measured 512 bytes over every plan that recomputed
    # block 0, at 64 tokens)
    from conftest import hf_model

    model, inputs = hf_model("llama", None, layers=4, seq_len=64)
    assert "position_ids" not in inputs
    tape = autoremat.profile(model, inputs, timing=False)
    kept = (autoremat.Decision.KEEP, autoremat.Decision.KEEP)
    assert tape.blocks[0].fwd_end_release.get(kept, 0) > 0
    for pattern in ("kkkk", "rkkk", "krkk", "kkkr", "rkrk", "rrrr"):
        segments = [(i, i + 1, RECOMPUTE if c == "r" else KEEP)
                    for i, c in enumerate(pattern)]
        plan = plan_of_segments(tape, segments, "test")
        measured = _applied_peak(model, inputs, plan)
        assert measured <= plan.predicted_peak_bytes, pattern
        assert plan.predicted_peak_bytes - measured <= 1024, pattern  # and no more
    assert [b.decision for b in autoremat.plan(tape, "100%").blocks] == ["keep"] * 4


class _Attention(nn.Module):
    """Eager attention: the mask is added to the scores, which saves nothing of it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / 8 + mask
        return x + self.out(scores.softmax(-1) @ v)


class _Tower(nn.Module):
    """Makes a mask, passes it to its attention blocks, then runs ``after`` more blocks
    before it returns and the mask is freed."""

    def __init__(self, width: int, after: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Attention(width) for _ in range(2))
        self.after = nn.ModuleList(nn.Linear(width, width) for _ in range(after))

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(x.shape[0], x.shape[1], x.shape[1]).masked_fill(
            ~valid[:, None, :], -1e9)
        for block in self.blocks:
            x = block(x, mask)
        for block in self.after:
            x = block(x)
        return x


class _Towered(nn.Module):
    def __init__(self, after: int, width: int = 32) -> None:
        super().__init__()
        self.tower = _Tower(width, after)
        self.text = nn.ModuleList(nn.Sequential(
            nn.Linear(width, 16 * width), nn.GELU(), nn.Linear(16 * width, width))
            for _ in range(2))

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        h = self.tower(x, valid)
        for block in self.text:
            h = h + block(h)
        return h.pow(2).mean()


@pytest.mark.parametrize("after", [0, 2])
def test_a_tensor_blocks_take_that_dies_later_in_the_chain_is_counted_held(
        after: int) -> None:
    # NOTE [ Tensors blocks take that die later in the chain ] in _profile/runs.py: the
    # tower's mask (4 x 64 x 64 floats) is freed when the tower returns; with two blocks
    # between the first block taking it and that return, a plan recomputing that block
    # alone measured the mask over its prediction. Right after the blocks taking it, the
    # windows measured see it, and nothing is added. Every pattern is predicted to the
    # byte: the mask counted where a tower block is recomputed, not for the text's.
    torch.manual_seed(0)
    model = _Towered(after)
    valid = torch.ones(4, 64, dtype=torch.bool)
    valid[1, 40:] = False
    inputs = (torch.randn(4, 64, 32), valid)
    names = ["tower.blocks.0", "tower.blocks.1",
             *(f"tower.after.{i}" for i in range(after)), "text.0", "text.1"]
    tape = autoremat.profile(model, inputs, blocks=names, timing=False, with_selective=False)
    mask_bytes = 4 * 64 * 64 * 4
    assert tape.held_past_release == ({f"0:{after + 1}": mask_bytes} if after else {})
    assert Tape.from_json(tape.to_json()).held_past_release == tape.held_past_release
    n = len(names)
    plans = {}
    for recomputed in [(0,), (1,), (0, 1), (n - 2,), (0, n - 2), tuple(range(n))]:
        segments = [(i, i + 1, RECOMPUTE if i in recomputed else KEEP) for i in range(n)]
        plans[recomputed] = plan = plan_of_segments(tape, segments, "test")
        measured = _applied_peak(model, inputs, plan)
        assert measured == plan.predicted_peak_bytes, recomputed
    # the planner counts the mask in the plans that hold it, not in all: at the budget
    # of recomputing a text block alone, which holds no mask, that plan fits (it was
    # charged the mask, and a dearer plan was chosen); the smallest feasible budget is
    # a plan's prediction
    text_alone = plans[(n - 2,)]
    best = autoremat.plan(tape, budget=text_alone.predicted_peak_bytes)
    assert best.predicted_cost <= text_alone.predicted_cost
    least = smallest_feasible_bytes(tape)
    best = autoremat.plan(tape, budget=least)
    assert best.predicted_peak_bytes == least <= min(p.predicted_peak_bytes
                                                     for p in plans.values())
    assert _applied_peak(model, inputs, best) == least


class _Alternating(nn.Module):
    """Gemma 2's shape in small: two masks made before the layers (a local window and a
    causal one), each layer given its kind's."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Attention(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        i = torch.arange(n)
        causal = (i[None, :] > i[:, None]).float().mul(-1e9).expand(x.shape[0], n, n)
        local = causal.masked_fill(i[:, None] - i[None, :] > 4, -1e9)
        masks = [local, causal.contiguous()]
        for k, layer in enumerate(self.layers):
            x = layer(x, masks[k % 2])
        return self.head(x).pow(2).mean()


def test_masks_made_before_the_chain_are_released_where_no_layer_taking_them_recomputes(
        ) -> None:
    # NOTE [ Tensors made before the chain that later blocks take ] in _plan/peak.py:
    # counted at the least, plans keeping the layers given one mask and recomputing
    # others were that mask (8 KiB) over their predictions: 11 of the 16 plans were
    # over, now 5, and those keeping every layer given a mask are exact. The rest hold
    # a mask in the backward where the last checkpointed layer taking it frees it: the
    # levels composed from the step checkpointing every layer hold it to layer 0's
    torch.manual_seed(0)
    model, x = _Alternating(), torch.randn(2, 32, 32)
    tape = autoremat.profile(model, x, timing=False, with_selective=False)
    mask = 2 * 32 * 32 * 4
    assert tape.freed_at_return == {"0:0,2": mask, "1:1,3": mask}
    over = []
    for pattern in itertools.product("kr", repeat=len(tape.blocks)):
        segments = [(i, i + 1, RECOMPUTE if c == "r" else KEEP)
                    for i, c in enumerate(pattern)]
        plan = plan_of_segments(tape, segments, "test")
        measured = _applied_peak(model, x, plan)
        assert measured <= plan.predicted_peak_bytes, pattern
        if measured < plan.predicted_peak_bytes:
            over.append(("".join(pattern), plan.predicted_peak_bytes - measured))
    assert len(over) <= 5 and all(size <= mask for _, size in over), over
    assert not {"kkkr", "kkrk", "krkk", "rkkk", "krkr", "rkrk"} & {p for p, _ in over}


class _Mlp(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 16 * width), nn.Linear(16 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class _Hybrid(nn.Module):
    """Jamba's shape in small: a mask made before the layers, given to every other one
    (attention between MLPs), which adds it and saves none of it."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Attention(width) if k % 2 else _Mlp(width)
                                    for k in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        i = torch.arange(n)
        mask = (i[None, :] > i[:, None]).float().mul(-1e9).expand(x.shape[0], n, n)
        for k, layer in enumerate(self.layers):
            x = layer(x, mask) if k % 2 else layer(x)
        return self.head(x).pow(2).mean()


def test_a_segment_holds_the_tensors_its_blocks_take_to_its_end() -> None:
    # NOTE [ A segment holds what its blocks take ] in _plan/peak.py: a segment of an MLP
    # and the attention after it holds the mask made before the layers to its end; the
    # attention's checkpointed window, which its composition takes, frees it, and the
    # MLPs' windows ran without it: 5 of these 18 plans measured 3,968 B (the mask
    # less 128 B) over their predictions, now 13 are exact and 5 over by 128 B (Jamba
    # with a padded batch: 18 of 169 plans of several segments 2,304 B over, the
    # smallest feasible one over its budget; now none)
    torch.manual_seed(0)
    model, x = _Hybrid(), torch.randn(2, 32, 32)
    tape = autoremat.profile(model, x, timing=False, with_selective=False)
    mask = 32 * 32 * 4  # one storage, expanded over the batch
    assert tape.freed_at_return == {"1:1,3": mask}
    assert tape.blocks[1].bwd_made_before_freed[Decision.KEEP, Decision.RECOMPUTE] == mask
    assert Tape.from_json(tape.to_json()).blocks[1] == tape.blocks[1]
    exact = 0
    for segments in plans_with_options(tape, [()] * len(tape.blocks)):
        if all(stop == start + 1 for start, stop, _ in segments):
            continue  # single blocks: measured windows (the test above)
        plan = plan_of_segments(tape, segments, "test")
        measured = _applied_peak(model, x, plan)
        assert measured <= plan.predicted_peak_bytes <= measured + mask, segments
        exact += measured == plan.predicted_peak_bytes
    assert exact >= 13


class _Fuse(nn.Module):
    """A fusion layer: reads its input through a ReLU (which saves its output, not the
    input) and adds a residual it is given besides, which nothing saves."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        h = self.lin(torch.relu(x))
        return h if residual is None else h + residual


class _Neck(nn.Module):
    """DPT's neck in small: each layer's output is kept in a list until the forward
    returns, and the last layer takes the first's output as its residual."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Fuse(width) for _ in range(depth))
        self.head = nn.Linear(width, 8 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x = layer(x, features[0] if i == len(self.layers) - 1 else None)
            features.append(x)
        return self.head(x).pow(2).mean()


class _WideFuse(_Fuse):
    """A fusion layer whose forward peaks on a wide tensor nothing saves (a repeat,
    reduced): the step peaks in the chain's forward."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, residual) + x.repeat(1, 16).view(*x.shape, 16).mean(-1)


class _WideNeck(_Neck):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__(width, depth)
        self.layers = nn.ModuleList(_WideFuse(width) for _ in range(depth))
        self.head = nn.Linear(width, width)


def _recomputed_exact(model: nn.Module, x: torch.Tensor, tape: Tape,
                      patterns: list[tuple[int, ...]]) -> None:
    """Each plan recomputing the blocks of one of ``patterns`` alone, the rest kept,
    measures its prediction."""
    n = len(tape.blocks)
    for recomputed in patterns:
        segments = [(i, i + 1, RECOMPUTE if i in recomputed else KEEP) for i in range(n)]
        plan = plan_of_segments(tape, segments, "test")
        measured = _applied_peak(model, x, plan)
        assert measured == plan.predicted_peak_bytes, (recomputed, measured)


@pytest.mark.parametrize("neck", [_Neck, _WideNeck], ids=["head-peak", "forward-peak"])
def test_a_tensor_blocks_take_that_the_model_frees_when_it_returns_is_counted_held(
        neck: type[_Neck]) -> None:
    # NOTE [ Tensors blocks take that the model frees when it returns ] in
    # _profile/runs.py: the first layer's output is the second's input (which saves
    # none of it) and the last layer's residual, kept in a list until the forward
    # returns. The model counted it released then under the second layer's decision; a
    # checkpoint of the last layer holds it through the head's backward, and a plan
    # recomputing the last layer alone measured it (64 KiB) over its prediction. It is
    # alive in every step until the return, so the levels before it count it already:
    # where the step peaks in the last layer's forward (``_WideNeck``), adding it to the
    # whole peak was 64 KiB over (NOTE [ Held at the return, after the return ] in
    # _plan/peak.py).
    torch.manual_seed(0)
    model, x = neck(), torch.randn(256, 64)
    tape = autoremat.profile(model, x, timing=False, with_selective=False)
    feature = 256 * 64 * 4
    assert tape.freed_at_return == {"1:3": feature}
    assert Tape.from_json(tape.to_json()).freed_at_return == tape.freed_at_return
    n = len(tape.blocks)
    _recomputed_exact(model, x, tape, [(n - 1,), (0, n - 1), (1, 2), tuple(range(n)), ()])
    least = smallest_feasible_bytes(tape)
    best = autoremat.plan(tape, budget=least)
    assert best.predicted_peak_bytes == least
    assert _applied_peak(model, x, best) <= least


class _Lookup(nn.Module):
    """LookViT's lookup layer in small: tokens attend to a context and the layer returns
    its scores too, as a view of the product that made them."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = (self.q(x) @ self.k(ctx).transpose(1, 2)).view(*x.shape[:2], -1)
        return x + scores.softmax(-1) @ self.v(ctx), scores


class _Reuse(nn.Module):
    """The context's layer: attends back with the lookup's scores, which it does not save."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.v = nn.Linear(d, d)

    def forward(self, ctx: torch.Tensor, x: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return ctx + scores.softmax(-1) @ self.v(x)


class _LookupReuse(nn.Module):
    """LookViT's layers: the lookup, the tokens' MLP, the context's layer."""

    def __init__(self, d: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleList([_Lookup(d), ResidualMlp(d), _Reuse(d)]) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = x.repeat(1, 4, 1)
        for lookup, mlp, reuse in self.layers:
            x, scores = lookup(x, ctx)
            x = mlp(x)
            scores = scores.transpose(1, 2)  # the view the layer returned let go of
            ctx = reuse(ctx, x, scores)
        return x.pow(2).mean() + ctx.pow(2).mean()


def test_a_view_of_a_returned_tensor_is_counted_with_the_block_that_returned_it() -> None:
    # freed_at_return follows the tensors blocks take besides their input to the block
    # that returned them, by the outputs it saw: the model transposed the scores the
    # lookup returned and let go of the view it was given, so the scores were taken for
    # the parent's, counted with the release of a block that does not release them, and
    # a plan recomputing the last context layer alone measured them (16 KiB in LookViT)
    # over its prediction (a held-out vit-pytorch check, 2026-12-02)
    torch.manual_seed(0)
    model, x = _LookupReuse(), torch.randn(2, 16, 32)
    tape = autoremat.profile(model, x, timing=False, with_selective=False)
    names = [b.name for b in tape.blocks]
    assert names == [f"layers.{i}.{j}" for i in range(2) for j in range(3)], names
    assert tape.freed_at_return == {"4:5": 2 * 16 * 64 * 4}  # the last lookup's scores
    _recomputed_exact(model, x, tape, [(5,), (4, 5), (3, 5), (2,), tuple(range(6)), ()])


class _Swap(nn.Module):
    """A layer that returns a view of its input (einops' ``Rearrange``, a transpose)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


@pytest.mark.parametrize("layers", [
    lambda: [nn.Linear(32, 32), _Swap(), ResidualMlp(16), ResidualMlp(16), ResidualMlp(16)],
    lambda: [nn.Linear(32, 32), ResidualMlp(32), nn.Flatten(), nn.Linear(512, 64),
             ResidualMlp(64), ResidualMlp(64)],
], ids=["transpose", "flatten"])
@pytest.mark.parametrize("named", [False, True], ids=["found", "named"])
def test_layers_that_return_a_view_of_their_input_run_between_the_blocks(
        layers: Callable[[], list[nn.Module]], named: bool) -> None:
    # NOTE [ After a block that returns its input ] in _profile/runs.py: a segment from
    # the layer before a view layer through it, or from the layer after it, was composed
    # as if the viewed tensor were made inside it and measured it over its prediction
    # (16 KiB here; LookViT's patch stem, a held-out check). Discovery leaves such
    # layers out, and no plan of one segment measures over its prediction (the
    # transpose's: up to 16 KiB under it, the flatten's: each to the byte). Named in
    # blocks=, such a layer leaves the chain too, with a warning (until 2026-12-02 it
    # stayed, and the segment after the transpose measured 16 KiB over its prediction).
    torch.manual_seed(0)
    model, x = nn.Sequential(*layers()), torch.randn(8, 16, 32)
    view = next(str(i) for i, m in enumerate(model) if isinstance(m, (_Swap, nn.Flatten)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tape = autoremat.profile(model, x, loss_fn=lambda y: y.pow(2).mean(), timing=False,
                                 with_selective=False,
                                 blocks=[str(i) for i in range(len(model))] if named else None)
    assert view not in [b.name for b in tape.blocks]
    how = "named" if named else "found"
    assert any(f"blocks {how} return a view of their input ({view}:" in note
               for note in tape.notes), tape.notes
    told = [str(w.message) for w in seen if "return a view of their input" in str(w.message)]
    assert len(told) == int(named), told
    n = len(tape.blocks)
    for a, b in itertools.combinations(range(n + 1), 2):
        if all(tape.blocks[j].chained for j in range(a + 1, b)):
            for rest in (KEEP, RECOMPUTE):
                segments = [(i, i + 1, rest) for i in range(a)] + [(a, b, RECOMPUTE)] \
                    + [(i, i + 1, rest) for i in range(b, n)]
                plan = plan_of_segments(tape, segments, "test")
                measured = _applied_peak(model, x, plan)
                assert measured <= plan.predicted_peak_bytes, (a, b, rest, measured)


class _Res(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1, self.norm1 = nn.Conv1d(channels, channels, 3, padding=1), \
            nn.GroupNorm(4, channels)
        self.conv2, self.norm2 = nn.Conv1d(channels, channels, 3, padding=1), \
            nn.GroupNorm(4, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm1(self.conv1(x)))
        return F.gelu(self.norm2(self.conv2(h)) + x)


class _Down(nn.Module):
    """Returns its downsampled output and the skip, which its downsampling convolution
    saves."""

    def __init__(self, channels: int, out: int) -> None:
        super().__init__()
        self.res = _Res(channels)
        self.down = nn.Conv1d(channels, out, 4, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        skip = self.res(x)
        return self.down(skip), skip


class _Up(nn.Module):
    def __init__(self, channels: int, out: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose1d(channels, out, 4, stride=2, padding=1)
        self.merge = nn.Conv1d(2 * out, out, 1)
        self.res = _Res(out)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.res(self.merge(torch.cat([self.up(x), skip], 1)))


class _Skips(nn.Module):
    """A 1-d U-Net whose skips are taken by up blocks two or more after their down
    block (blocks named: the down and up blocks, between a stem and a middle layer)."""

    def __init__(self, widths: tuple[int, ...] = (8, 16, 32, 64)) -> None:
        super().__init__()
        self.inc = nn.Conv1d(1, widths[0], 3, padding=1)
        self.downs = nn.ModuleList(_Down(widths[i], widths[i + 1])
                                   for i in range(len(widths) - 1))
        self.mid = _Res(widths[-1])
        self.ups = nn.ModuleList(_Up(widths[i + 1], widths[i])
                                 for i in reversed(range(len(widths) - 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inc(x)
        skips = []
        for down in self.downs:
            x, skip = down(x)
            skips.append(skip)
        x = self.mid(x)
        for up in self.ups:
            x = up(x, skips.pop())
        return x.pow(2).mean()


def test_a_tensor_a_kept_block_saves_that_a_later_block_takes_is_counted_held() -> None:
    # NOTE [ Tensors a block saves that a later block takes ] in _profile/runs.py: the
    # levels composed for checkpointed blocks came from the step with every block
    # checkpointed, where each skip was freed in its up block's backward; a kept down
    # block holds it on to its own. 32 of the 256 plans of whole blocks measured one or
    # two skips over their predictions (those below among them), none now
    torch.manual_seed(0)
    model, x = _Skips(), torch.randn(4, 1, 1024)
    names = ["inc", "downs.0", "downs.1", "downs.2", "mid", "ups.0", "ups.1", "ups.2"]
    tape = autoremat.profile(model, x, blocks=names, timing=False, with_selective=False)
    skip = 4 * 8 * 1024 * 4  # each down block's (channels double, length halves)
    assert tape.saved_by_maker == {"1:7": skip, "2:6": skip, "3:5": skip}
    assert Tape.from_json(tape.to_json()).saved_by_maker == tape.saved_by_maker
    n = len(names)
    exact = 0
    for recomputed in [(6, 7), (5, 6, 7), (4, 6, 7), (3, 5, 6, 7), (0, 2, 4, 6),
                       (1, 3, 5, 7), tuple(range(n)), ()]:
        segments = [(i, i + 1, RECOMPUTE if i in recomputed else KEEP) for i in range(n)]
        plan = plan_of_segments(tape, segments, "test")
        measured = _applied_peak(model, x, plan)
        assert measured <= plan.predicted_peak_bytes, (recomputed, measured)
        exact += measured == plan.predicted_peak_bytes
    assert exact >= 4  # (an over-count where a down block is checkpointed too)
    least = smallest_feasible_bytes(tape)
    best = autoremat.plan(tape, budget=least)
    assert best.predicted_peak_bytes == least
    assert _applied_peak(model, x, best) <= least
