"""Tests for autoremat.profile: the Tape of one measured training step."""

from __future__ import annotations

import importlib
import itertools
import random
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import autoremat
from autoremat import Decision, StepMismatchWarning, Tape, zoo
from autoremat._core.decisions import KEEP, RECOMPUTE, Choice
from autoremat._core.errors import BlockError, RematError
from autoremat._core.step import run_step
from autoremat._measure import memory as memory_module
from autoremat._measure.blocks import discover_blocks
from autoremat._measure.memory import CUDA_SMALL_BYTES
from autoremat._measure.tape import WindowMemory
from autoremat._mechanism.wrap import is_wrapped
from autoremat._plan.strategies import smallest_feasible_bytes
from autoremat._profile.runs import _Probe

import conftest
from _steps import DenseLayer, ResidualMlp, segments_peaks, single_block_plans, verified

# conftest.SMALL with three transformer blocks, not two: these sizes matter, since
# test_profile_measures_every_block_and_leaves_no_trace asserts at least three blocks and
# test_mistyped_block_name_suggests_the_right_one counts on 'blocks.2'.
_SIZES: dict[str, dict[str, Any]] = {
    name: {**sizes, "n_layer": 3} if name in ("gpt2", "llama") else dict(sizes)
    for name, sizes in conftest.SMALL.items()
}


def _replay(tape: Tape, decision: Decision) -> tuple[int, int]:
    """Compose the step from the tape's windows: ``(peak, final level)``.

    ``decision`` is KEEP (the plain step) or RECOMPUTE (every block checkpointed on its
    own). The
    windows tile the step's timeline: pre, each block's forward, post (head, loss and
    their backward), each block's backward in reverse, tail. A window's peak is relative
    to the level at its start, so the step's peak is the max over windows of (level at
    the window's start + its peak).
    """
    level = peak = 0

    def visit(window: WindowMemory) -> None:
        nonlocal level, peak
        peak = max(peak, level + window.peak_bytes)
        level += window.delta_bytes

    # (previous block's decision, own decision); the first block follows the stem
    keys = [(Decision.KEEP, decision)] + [(decision, decision)] * (len(tape.blocks) - 1)
    visit(tape.pre)
    for block, key in zip(tape.blocks, keys, strict=True):
        visit(block.fwd[key])
    visit(tape.post[decision])
    for block, key in reversed(list(zip(tape.blocks, keys, strict=True))):
        visit(block.bwd[key])
    visit(tape.tail[decision])
    return peak, level


def _check_tape_invariants(tape: Tape) -> None:
    # the plain step's peak is the composition of its windows, exactly
    assert _replay(tape, Decision.KEEP) == (tape.step_peak_bytes, tape.grad_bytes)
    # and so is the peak with every block checkpointed
    assert _replay(tape, Decision.RECOMPUTE) == (tape.ckpt_step_peak_bytes, tape.grad_bytes)
    assert sum(tape.peak_breakdown.values()) == tape.step_peak_bytes
    # the forward leaves everything saved in and before the blocks: a lower bound
    fwd_end = tape.pre.delta_bytes + sum(b.keep_fwd.delta_bytes for b in tape.blocks)
    assert tape.block_saved_bytes <= fwd_end <= tape.step_peak_bytes
    for b in tape.blocks:
        assert b.saved_bytes == sum(b.saved_bytes_by_kind.values())
        assert b.grad_bytes <= b.param_bytes


def _snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "grad_values": {n: None if p.grad is None else p.grad.clone()
                        for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "cpu_rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
    }


def _assert_unchanged(model: nn.Module, before: dict[str, Any]) -> None:
    for n, p in model.named_parameters():
        assert torch.equal(p, before["params"][n]), n
        assert p.grad is before["grads"][n], n  # the very same tensor object
        if p.grad is not None:
            assert torch.equal(p.grad, before["grad_values"][n]), n
    buffers = dict(model.named_buffers())
    assert buffers.keys() == before["buffers"].keys()
    for n, b in buffers.items():
        assert torch.equal(b, before["buffers"][n]), n
    assert torch.equal(torch.get_rng_state(), before["cpu_rng"])
    assert random.getstate() == before["py_rng"]
    for name, module in model.named_modules():
        assert not module._forward_hooks and not module._forward_pre_hooks, name
        assert is_wrapped(module) is None and "forward" not in module.__dict__, name


@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama", marks=pytest.mark.slow),
                                  "mlp", "resnet"])  # llama: ~1.7 s
def test_profile_measures_every_block_and_leaves_no_trace(name: str) -> None:
    model, inputs = zoo.build(name, **_SIZES[name])
    run_step(model, inputs, None)  # gradients exist; BatchNorm statistics have moved
    half = list(model.parameters())[::2]
    for p in half:
        p.grad = None  # some None, some set: both must come back as they were
    before = _snapshot(model)

    tape = autoremat.profile(model, inputs, repeats=1)

    _assert_unchanged(model, before)
    names = discover_blocks(model)
    assert [b.name for b in tape.blocks] == names and len(names) >= 3
    for b in tape.blocks:
        assert b.fwd_flops > 0 and b.bwd_flops > 0, b.name
        assert b.saved_bytes > 0, b.name
        assert b.param_bytes > 0 and b.input_bytes > 0 and b.output_bytes > 0, b.name
        assert b.fwd_ms >= 0 and b.bwd_ms >= 0
    assert tape.step_fwd_flops >= sum(b.fwd_flops for b in tape.blocks)
    assert tape.model == type(model).__name__ and tape.device == "cpu"
    _check_tape_invariants(tape)

    for b in tape.blocks:  # the per-op trace adds up to the per-kind stats and saved bytes
        assert sum(r.kept_bytes for r in b.ops) == b.saved_bytes, b.name
        assert sum(r.flops for r in b.ops) == b.fwd_flops, b.name
        for kind, stats in b.op_stats.items():
            rows = [r for r in b.ops if r.kind == kind]
            assert len(rows) == stats.count and sum(r.out_bytes for r in rows) == stats.out_bytes
        assert all(r.out_bytes == r.kept_bytes == 0 for r in b.ops if r.view), b.name
        assert all(0 <= r.kept_bytes <= r.out_bytes for r in b.ops), b.name
        draws = [r for r in b.ops if r.random]
        assert all(r.inplace and r.kind == "dropout" for r in draws), b.name  # bernoulli_
        assert bool(draws) == (name != "resnet"), b.name  # resnet's only dropout is outside

    if name in ("gpt2", "llama"):  # identical blocks: identical figures
        first = tape.blocks[0]
        for b in tape.blocks[1:]:
            assert (b.fwd_flops, b.bwd_flops) == (first.fwd_flops, first.bwd_flops)
            assert b.saved_bytes == first.saved_bytes
            assert b.saved_bytes_by_kind == first.saved_bytes_by_kind

    # the state checks have teeth: a plain step does change what profile() must restore
    run_step(model, inputs, None)
    assert any(p.grad is not before["grads"][n] for n, p in model.named_parameters())
    if name == "resnet":
        assert any(not torch.equal(b, before["buffers"][n]) for n, b in model.named_buffers())


def test_mlp_block_flops_by_hand() -> None:
    # block i is Linear(d_in, d_out) on a (B, d_in) batch: one addmm of 2 * B * d_in * d_out
    # FLOPs (LayerNorm, GELU, ReLU and dropout count 0); backward is two mms of that size
    model, inputs = zoo.build("mlp", **_SIZES["mlp"])
    tape = autoremat.profile(model, inputs, repeats=1)
    B, dims = 16, (256, 64, 128, 32, 96)  # d_in, then the widths
    expected = [2 * B * d_in * d_out for d_in, d_out in itertools.pairwise(dims)]
    assert [b.fwd_flops for b in tape.blocks] == expected == [524288, 262144, 131072, 98304]
    # block 0's input does not require grad, so its backward only computes the weight grad
    assert [b.bwd_flops for b in tape.blocks] == [expected[0]] + [2 * f for f in expected[1:]]
    assert tape.step_fwd_flops == sum(expected) + 2 * B * 96 * 10  # + the head



def test_grouped_query_attention_flops_are_those_of_key_and_value_broadcast() -> None:
    # NOTE [ Grouped-query attention FLOPs ]: 8 query heads over 2 key/value heads count
    # as the same attention with key and value repeated to 8 heads, forward and backward
    # (before torch 2.13 the formula raised on these shapes)
    from autoremat._measure.flops import FlopCounter

    def counted(kv_repeat: int) -> dict[tuple[str, str], int]:
        torch.manual_seed(0)
        q = torch.randn(2, 8, 16, 32, requires_grad=True)
        k, v = (torch.randn(2, 2, 16, 32).repeat_interleave(kv_repeat, 1).requires_grad_()
                for _ in range(2))
        counter = FlopCounter()
        with counter:
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, enable_gqa=True).sum().backward()
        return counter.by_label

    grouped, repeated = counted(1), counted(4)
    assert grouped == repeated and grouped[("<outside>", "fwd")] == 2 * 2 * 2 * 8 * 16 * 16 * 32


@pytest.mark.parametrize(("at", "dim"), [(0, 1), (1, 1), (0, 2), (1, 2)])
def test_every_attention_formula_gets_key_and_value_with_the_query_heads(at: int,
                                                                        dim: int) -> None:
    from autoremat._measure.flops import _ATTENTION, _broadcast_kv, flop_formulas

    assert (at, dim) in set(_ATTENTION.values())
    seen: list[tuple[torch.Size, ...]] = []

    def strict(*args: Any, out_val: Any = None) -> int:  # what torch 2.11's formula asserts
        shapes = tuple(a if isinstance(a, torch.Size) else a.shape for a in args[at:at + 3])
        assert shapes[0][dim] == shapes[1][dim] == shapes[2][dim], shapes
        seen.append(shapes)
        return 1

    shape = [2, 4, 4, 4]
    q = torch.empty(shape, device="meta")
    shape[dim] = 2
    k = v = torch.empty(shape, device="meta")
    grad = torch.empty(q.shape, device="meta")
    args = (q, k, v) if at == 0 else (grad, q, k, v)
    assert _broadcast_kv(strict, at, dim)(*args, out_val=None) == 1
    assert seen[0][1] == seen[0][2] == q.shape
    # equal heads pass through untouched, tensors and all
    _broadcast_kv(strict, at, dim)(*((q, q, q) if at == 0 else (grad, q, q, q)))
    assert seen[1] == (q.shape,) * 3
    formulas = flop_formulas()
    wrapped = [name for name in _ATTENTION if getattr(torch.ops.aten, name, None) in formulas]
    assert "_scaled_dot_product_efficient_attention" in wrapped

def test_flop_counter_counts_what_torchs_flop_counter_counts() -> None:
    # NOTE [ Shapes for the formulas ]: the formulas get shapes without pytree; the FLOPs
    # are torch's own, op by op (convolutions, matmuls of every kind, forward and backward)
    from torch.utils.flop_counter import FlopCounterMode

    from autoremat._measure.flops import FlopCounter

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
    lin = torch.nn.Linear(8 * 4 * 4, 16)
    x = torch.randn(2, 3, 8, 8)
    w = torch.randn(2, 16, 5, requires_grad=True)

    def step() -> None:
        h = lin(conv(x).relu().flatten(1))
        (torch.bmm(h[:, None, :], w).sum() + torch.baddbmm(w, w, w.transpose(1, 2)[:, :5, :5]
                                                         .transpose(1, 2)).sum()).backward()

    ours = FlopCounter()
    with ours:
        step()
    theirs = FlopCounterMode(display=False)
    with theirs:
        step()
    assert ours.total == theirs.get_total_flops() > 0


def test_an_addmm_with_an_output_dtype_counts_as_an_addmm() -> None:
    # the chunked head's weight gradient on CUDA (``addmm.dtype_out``, bf16 into fp32):
    # its ``out_dtype`` took the formula's ``out_shape``, and the head's GPU step raised
    # "addmm_flop() got multiple values for argument 'out_shape'" (H200, 2026-11-30);
    # the op runs on CUDA and meta only
    from autoremat._measure.flops import FlopCounter

    a, b = (torch.empty(shape, dtype=torch.bfloat16, device="meta") for shape in ((4, 8), (8, 3)))
    c, out = torch.empty(4, 3, device="meta"), torch.empty(4, 3, device="meta")
    ours = FlopCounter()
    with ours:
        torch.ops.aten.addmm.dtype_out(c, a, b, torch.float32, out=out)
    assert ours.total == 2 * 4 * 8 * 3


def test_shapes_for_the_formulas_are_pytrees_shapes() -> None:
    from torch.utils._pytree import tree_map
    from torch.utils.flop_counter import get_shape

    from autoremat._measure.flops import _shapes

    t = torch.empty(2, 3)
    for value in (t, (t, None, 3), [t, [t, 1.5]], {"a": t, "b": [t]}, torch.Size([4, 5]),
                  torch.max(torch.ones(2, 2), 0), (), None, "mean"):
        assert _shapes(value) == tree_map(get_shape, value), value
    assert type(_shapes([t])) is list and type(_shapes(torch.Size([4]))) is torch.Size


# NOTE [ Do saved activations and gradients account for the peak? ]
#     Measured at the zoo's default sizes, (sum of the blocks' saved bytes + gradient
#     bytes) / step peak is: gpt2 0.977, llama 0.973, mlp 1.075, resnet 0.930 (gpt2 and
#     llama with the output, ``tape.output_bytes``, added: the default loop holds the
#     logits through backward, 2 MiB of gpt2's 56 MB peak; without them, 0.940).
#     * gpt2, llama: within 5% below the peak, as expected when activations dominate.
#     * mlp: above 1. Its peak is reached as backward starts (gradients at the peak:
#       15 KB of 7.7 MB); the gradients are made while the activations are freed, so the
#       two are never all alive together. The blocks' saved bytes alone are 98% of it.
#     * resnet: 7% below. The stem's output (conv + BatchNorm + ReLU at full resolution,
#       4 MiB, ``tape.pre.delta_bytes``) is saved outside the blocks; with it the saved
#       activations account for 96.9% of the peak, and only 0.6 of the 2.8 MB of
#       gradients are alive then.
_RELATION = {
    "gpt2": lambda t: 0.95 * t.step_peak_bytes
    <= t.block_saved_bytes + t.grad_bytes + t.output_bytes <= t.step_peak_bytes,
    "llama": lambda t: 0.95 * t.step_peak_bytes
    <= t.block_saved_bytes + t.grad_bytes + t.output_bytes <= t.step_peak_bytes,
    "mlp": lambda t: t.block_saved_bytes + t.grad_bytes > t.step_peak_bytes
    and 0.95 * t.step_peak_bytes <= t.block_saved_bytes <= t.step_peak_bytes
    and t.peak_breakdown["gradients"] < 0.01 * t.grad_bytes,
    "resnet": lambda t: t.block_saved_bytes + t.grad_bytes < 0.95 * t.step_peak_bytes
    and 0.95 * t.step_peak_bytes <= t.pre.delta_bytes + t.block_saved_bytes
    <= t.step_peak_bytes,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.names())
def test_saved_bytes_and_gradients_account_for_the_peak(
        name: str, zoo_tapes: Callable[..., Tape]) -> None:
    tape = zoo_tapes(name)  # default sizes (activations dominate), shared with test_plan
    ratio = (tape.block_saved_bytes + tape.grad_bytes) / tape.step_peak_bytes
    print(f"\n{name}: (saved {tape.block_saved_bytes} + grads {tape.grad_bytes}) / "
          f"peak {tape.step_peak_bytes} = {ratio:.4f}")
    _check_tape_invariants(tape)
    assert _RELATION[name](tape), (ratio, tape.pre.delta_bytes, tape.peak_breakdown)


# --- Hugging Face models ---------------------------------------------------------------

_V, _T, _B = 128, 16, 2  # vocabulary, sequence length, batch


def _hf(kind: str, use_cache: bool = False) -> nn.Module:
    # use_cache=False as for any training run with checkpointing (HF's own
    # gradient_checkpointing drops the cache too); the default is tested separately below
    tiny = {"vocab_size": _V, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
            "use_cache": use_cache}
    if kind == "gpt2":
        config = transformers.GPT2Config(n_positions=32, n_embd=32, n_layer=3, n_head=2, **tiny)
        return transformers.GPT2LMHeadModel(config)
    if kind == "llama":
        config = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32, **tiny,
        )
        return transformers.LlamaForCausalLM(config)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, **tiny,
    )
    return transformers.BertForMaskedLM(config)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "prefix"),
    [("gpt2", "transformer.h"), ("llama", "model.layers"), ("bert", "bert.encoder.layer")],
)
def test_hugging_face_models(kind: str, prefix: str) -> None:
    torch.manual_seed(0)
    model = _hf(kind).train()
    ids = torch.randint(3, _V, (_B, _T))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    names = [f"{prefix}.{i}" for i in range(3)]
    assert discover_blocks(model) == names
    before = _snapshot(model)

    tape = autoremat.profile(model, inputs, repeats=1)

    _assert_unchanged(model, before)
    assert [b.name for b in tape.blocks] == names
    first = tape.blocks[0]
    for b in tape.blocks:
        assert b.saved_bytes > 0 and b.fwd_flops > 0
        assert b.fwd_flops == first.fwd_flops
    _check_tape_invariants(tape)


def test_hugging_face_decoder_with_the_default_kv_cache() -> None:
    # with use_cache=True (the config default) every layer appends to a DynamicCache in
    # forward and a recompute would append again; profile() turns the cache off while
    # it measures, says so in the notes, and puts the setting back
    torch.manual_seed(0)
    model = _hf("llama", use_cache=True).train()
    ids = torch.randint(3, _V, (_B, _T))
    tape = autoremat.profile(model, {"input_ids": ids, "labels": ids.clone()}, repeats=1)
    assert [b.name for b in tape.blocks] == [f"model.layers.{i}" for i in range(3)]
    assert any("use_cache" in note for note in tape.notes), tape.notes
    assert model.config.use_cache is True
    _check_tape_invariants(tape)


# --- errors ---------------------------------------------------------------------------


def test_mistyped_block_name_suggests_the_right_one() -> None:
    model, inputs = zoo.build("gpt2", **_SIZES["gpt2"])
    with pytest.raises(BlockError) as info:
        autoremat.profile(model, inputs, blocks=["blocks.O"])
    message = str(info.value)
    assert "no submodule named 'blocks.O' in GPT." in message
    # difflib sees 'blocks.0', 'blocks.1' and 'blocks.2' as equally close to 'blocks.O'
    suggestion = re.search(r"Did you mean '([^']*)'\?", message)
    assert suggestion is not None, message
    assert suggestion.group(1) in discover_blocks(model)


class _SharedBlock(nn.Module):
    """Calls its first block twice per step (shared weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.blocks[0](x)


def test_block_that_runs_twice_is_planned_call_by_call_and_the_model_is_left_clean(
        ) -> None:
    # NOTE [ A block that runs several times ] (more in test_calls.py)
    model, x = _SharedBlock(), torch.randn(4, 8)
    before = _snapshot(model)
    tape = autoremat.profile(model, x)
    assert [b.name for b in tape.blocks] == ["blocks.0@0", "blocks.1", "blocks.2",
                                             "blocks.0@1"]
    _assert_unchanged(model, before)


class _TwoTowers(nn.Module):
    """A vision stack the step runs only when given an image, then a text stack."""

    def __init__(self) -> None:
        super().__init__()
        self.vision = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU())
                                     for _ in range(3)])
        self.text = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU())
                                   for _ in range(3)])

    def forward(self, x: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        if image is not None:
            for block in self.vision:
                image = block(image)
            x = x + image
        for block in self.text:
            x = block(x)
        return x.pow(2).mean()


def test_found_blocks_the_step_does_not_run_leave_the_chain_with_a_note() -> None:
    model, x = _TwoTowers(), torch.randn(4, 8)
    tape = autoremat.profile(model, (x,), timing=False, with_selective=False)
    assert [b.name for b in tape.blocks] == ["text.0", "text.1", "text.2"]
    assert any("3 of the blocks found did not run in the step profiled (vision.0, ..., "
               "vision.2" in note for note in tape.notes)
    assert not any("not planned over" in note for note in tape.notes)  # said already
    both = autoremat.profile(model, {"x": x, "image": torch.randn(4, 8)}, timing=False,
                             with_selective=False)
    assert len(both.blocks) == 6
    with pytest.raises(BlockError, match=r"block 'vision\.0' never ran"):  # named: refused
        autoremat.profile(model, (x,), blocks=["vision.0", "text.0"], timing=False)


class _SingleStream(nn.Module):
    """Flux's single-stream block: text and image tokens joined, one MLP, split again
    into (text, image); with ``router``, a mixture-of-experts block's router logits
    after its hidden states instead, which an auxiliary loss reads."""

    def __init__(self, router: bool = False) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.router = nn.Linear(16, 4) if router else None

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.router is not None:
            return image + self.mlp(image), self.router(image)
        joined = torch.cat([text, image], dim=1)
        joined = joined + self.mlp(joined)
        return joined[:, : text.shape[1]], joined[:, text.shape[1]:]


class _Flux(nn.Module):
    """The last block's text tokens are dropped (Flux's); with ``router``, the router
    logits of every block go to an auxiliary loss."""

    def __init__(self, router: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_SingleStream(router) for _ in range(4)])
        self.routed = router

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        aux = []
        for block in self.blocks:
            first, second = block(text, image)
            if self.routed:
                image, logits = first, second
                aux.append(logits.softmax(-1).pow(2).mean())
            else:
                text, image = first, second
        return image.pow(2).mean() + sum(aux)


@pytest.mark.parametrize("router", [False, True], ids=["dropped-text", "router-logits"])
def test_a_block_whose_first_output_is_dropped_or_read_by_a_loss_stays_in_the_chain(
        router: bool) -> None:
    """NOTE [ Where a block's backward starts ]: the last block's backward was marked by
    its dropped text tokens, which get no gradient, so it left the chain as frozen; the
    router logits' gradient comes first, from the loss, and must not mark it."""
    torch.manual_seed(0)
    model, inputs = _Flux(router), (torch.randn(2, 8, 16), torch.randn(2, 24, 16))
    tape = autoremat.profile(model, inputs, repeats=1, timing=False, with_selective=False)
    assert [b.name for b in tape.blocks] == [f"blocks.{i}" for i in range(4)], tape.notes
    assert not any("backward never runs through" in note for note in tape.notes)
    # sqrt: segments of two blocks, composed (docs/limitations.md: at or above the step)
    for strategy in ("full", "every:2", "sqrt"):
        plan = autoremat.plan(tape, None, strategy)
        report = verified(model, inputs, plan, repeats=1)
        assert report.ok and report.max_grad_diff == 0.0
        if strategy == "sqrt":
            assert report.peak_bytes <= plan.predicted_peak_bytes, report
        else:
            assert report.peak_bytes == plan.predicted_peak_bytes, (strategy, report)


def test_a_segment_records_none_of_the_tensors_the_block_before_returned() -> None:
    """NOTE [ Segments without a wrapper module ]: an inner block of a segment that takes
    both of the block before's outputs (Flux's text and image tokens, views of one
    storage) replays both from the recompute. Recording the second held that storage
    through the forward, where the plan counts it dropped: Flux under a LoRA measured
    18 KiB over each segment's prediction, its 60% plan over its budget."""
    import weakref

    torch.manual_seed(0)
    model, inputs = _Flux(), (torch.randn(2, 8, 16), torch.randn(2, 24, 16))
    tape = autoremat.profile(model, inputs, repeats=1, timing=False, with_selective=False)
    plan = autoremat.plan(tape, None, "sqrt")
    assert [b.segment for b in plan.blocks] == [0, 0, 1, 1]
    returned: list[weakref.ref[torch.Tensor]] = []
    model.blocks[0].register_forward_hook(
        lambda module, args, out: returned.extend(weakref.ref(t) for t in out))
    with pytest.warns(StepMismatchWarning, match="after the step was profiled"):
        autoremat.apply(model, plan)  # (the hook keeps nothing)
    try:
        loss = model(*inputs)
        assert [ref() is None for ref in returned] == [True, True]  # dropped in forward
        loss.backward()
    finally:
        autoremat.remove(model)


class _Coupling(nn.Module):
    """A RevNet block: additive coupling of a pair, both halves returned and taken by the
    next block; ``y1`` is read inside the block too."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                               nn.Linear(2 * width, width))
        self.g = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                               nn.Linear(2 * width, width))

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y1 = x1 + self.f(x2)
        return y1, x2 + self.g(y1)


class _RevNet(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(width, 2 * width)
        self.blocks = nn.ModuleList(_Coupling(width) for _ in range(depth))
        self.head = nn.Linear(2 * width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.inp(x).chunk(2, -1)
        for block in self.blocks:
            x1, x2 = block(x1, x2)
        return self.head(torch.cat([x1, x2], -1))


def _one_segment_plans(n: int) -> Iterator[tuple[Any, int, int, list[Any]]]:
    """Every plan of ``n`` blocks with one segment of two or more, the other blocks all
    kept or all recomputed alone: ``(rest, start, stop, segments)``."""
    from autoremat._core.decisions import KEEP, RECOMPUTE

    for rest in (KEEP, RECOMPUTE):
        for a, b in itertools.combinations(range(n + 1), 2):
            if b - a >= 2:
                yield rest, a, b, [(i, i + 1, rest) for i in range(a)] + \
                    [(a, b, RECOMPUTE)] + [(i, i + 1, rest) for i in range(b, n)]


def test_segments_and_selective_blocks_that_pass_a_pair_on_hold_their_predictions() -> None:
    """NOTE [ Where a block's backward starts ], NOTE [ Boundaries held outside the chain ]
    and NOTE [ A selective block that keeps its output ]: RevNet's blocks pass (y1, y2) on.
    Marked at y1, whose gradient is complete only after the block's recompute, and with a
    segment counted to drop y1 alone, segments measured up to 24 KiB over their
    predictions (over their budgets), and selective blocks keeping y1 8 KiB over."""
    from autoremat._core.decisions import KEEP, RECOMPUTE, Choice

    torch.manual_seed(0)
    model, x, y = _RevNet(), torch.randn(64, 32), torch.randint(0, 10, (64,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    tape = autoremat.profile(model, x, loss_fn=loss_fn, timing=False)
    n = len(tape.blocks)
    assert n == 4 and all(block.chain_bytes == 2 * 64 * 32 * 4 for block in tape.blocks[1:])

    def peaks(segments: list[tuple[int, int, Any]]) -> tuple[int, int]:
        return segments_peaks(model, x, tape, segments, loss_fn)

    for rest in (KEEP, RECOMPUTE):
        for a, b in itertools.combinations(range(n + 1), 2):
            if b - a >= 2:
                segments = [(i, i + 1, rest) for i in range(a)] + [(a, b, RECOMPUTE)] + \
                    [(i, i + 1, rest) for i in range(b, n)]
                predicted, measured = peaks(segments)
                assert measured == predicted, (rest, a, b, measured - predicted)
        for i, block in enumerate(tape.blocks):
            assert block.selective
            for key in block.selective:
                segments = [(j, j + 1, rest) for j in range(n)]
                segments[i] = (i, i + 1, Choice.selective_from_key(key))
                predicted, measured = peaks(segments)
                # never under; over by at most the boundary counted twice
                assert 0 <= predicted - measured <= block.output_bytes, (rest, i, key)


class _ResidualStream(nn.Module):
    """A Mamba-style block: takes and returns (hidden, residual); the first, given no
    residual, returns its own input as the residual."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mixer = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                   nn.Linear(2 * width, width))

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden + residual if residual is not None else hidden
        return self.mixer(self.norm(residual)), residual


class _Stream(nn.Module):
    def __init__(self, width: int = 32, depth: int = 5) -> None:
        super().__init__()
        self.emb = nn.Linear(width, width)
        self.layers = nn.ModuleList(_ResidualStream(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.emb(x), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        return self.norm(hidden + residual)


def test_a_segment_holds_what_its_first_block_passes_on_of_its_input() -> None:
    """``_HeldInputs.chain_sides``: the first block returns its input as the residual,
    which the next block takes beside its hidden states; a segment of the two holds it
    (it is the segment's input). Counted dropped, a segment of blocks 0 and 1 measured
    6784 B over its prediction, and plans at that budget over it (a held-out check)."""

    torch.manual_seed(0)
    model, x, y = _Stream(), torch.randn(4, 16, 32), torch.randn(4, 16, 32)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, y)

    tape = autoremat.profile(model, x, loss_fn=loss_fn, timing=False, with_selective=False)
    n = len(tape.blocks)
    assert tape.blocks[1].chain_bytes == 4 * 16 * 32 * 4  # the hidden states alone
    for rest, a, b, segments in _one_segment_plans(n):
        predicted, measured = segments_peaks(model, x, tape, segments, loss_fn)
        assert measured <= predicted, (rest, a, b, measured - predicted)


class _PairPool(nn.Module):
    """Mean over pairs of tokens: parameter-free, saves nothing for its backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        return x.view(batch, length // 2, 2, width).mean(2)


class _Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0  # saves nothing: a scalar factor


class _Tokens(nn.Module):
    def __init__(self, kinds: str, width: int = 32, vocab: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList({"M": ResidualMlp, "P": _PairPool, "S": _Scale}[k](
            *((width,) if k == "M" else ())) for k in kinds)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


@pytest.mark.parametrize("kinds", ["PMMM", "MSMM"])
def test_a_segment_holds_the_input_its_first_block_alone_lets_go_of(kinds: str) -> None:
    """NOTE [ A block that lets its input go ] in _plan/peak.py: a block that saves
    nothing (a pool, a scale) checkpointed alone holds nothing, so its input dies in its
    forward as in the plain step; in a segment of several the segment holds it. Composed
    from the lone block's window, a segment starting with such a block (a fuzzed pooling
    model's, 9.9% over its budget) or holding one inside measured one activation (128 KiB
    here) over its prediction. Segments ending in such a block are over-predicted (their
    recompute stops before the block), never under."""

    torch.manual_seed(0)
    model, tokens = _Tokens(kinds), torch.randint(0, 8, (32, 32))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean()

    tape = autoremat.profile(model, tokens, loss_fn=loss_fn, timing=False,
                             with_selective=False)
    n = len(tape.blocks)
    saves_nothing = {i for i, kind in enumerate(kinds) if kind != "M"}
    assert all(tape.blocks[i].fwd_held for i in saves_nothing)
    for rest, a, b, segments in _one_segment_plans(n):
        predicted, measured = segments_peaks(model, tokens, tape, segments, loss_fn)
        if b - 1 in saves_nothing:
            assert measured <= predicted, (rest, a, b, measured - predicted)
        else:
            assert measured == predicted, (rest, a, b, measured - predicted)


class _ConvNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv1d(width, width, 3, padding=1), nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x.transpose(1, 2))).relu().transpose(1, 2)


class _NormPool(nn.Module):
    """[Conv+BatchNorm, pool, residual MLP] on an input that needs no gradient."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_ConvNorm(width), _PairPool(), ResidualMlp(width)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


def test_a_segment_whose_last_block_saves_nothing_holds_its_gradient_through_the_recompute(
        ) -> None:
    """NOTE [ A segment's last block that saves nothing ] in _plan/peak.py: the pool's
    whole backward runs before the segment's recompute starts, and its gradient stays
    through the recompute of the Conv+BatchNorm block (with its statistics copied
    aside). Counted from where the pool's own recompute would start, the segment
    measured 72 B (the gradient less what the composition counted elsewhere) over its
    prediction (a fuzzed model's, 72-136 B); such segments are exact now, and none is
    under (those of all three blocks are over by up to 264 B, as before)."""
    torch.manual_seed(0)
    tape, off = _one_segment_misses(_NormPool(), torch.randn(2, 8, 16), exact_stop=2)
    assert [b.lets_input_go for b in tape.blocks] == [False, True, False]
    assert off == {}


def _one_segment_misses(model: nn.Module, x: torch.Tensor, exact_stop: int,
                        ) -> tuple[autoremat.Tape, dict[tuple[str, int, int], int]]:
    """``model``'s tape (a squared loss, its list of distinct layers as the chain: NOTE
    [ A list of distinct layers ]) and, of its one-segment plans, those measured over
    their predictions or, ending at ``exact_stop``, off them: by (the other blocks'
    decision, start, stop), measured less predicted."""

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean()

    tape = autoremat.profile(model, x, loss_fn=loss_fn, timing=False, with_selective=False,
                             with_head=False)
    off = {}
    for rest, a, b, segments in _one_segment_plans(len(tape.blocks)):
        predicted, measured = segments_peaks(model, x, tape, segments, loss_fn)
        if measured > predicted or (b == exact_stop and measured != predicted):
            off[rest.decision.value, a, b] = measured - predicted
    return tape, off


class _Transposed(nn.Module):
    """Linear + ReLU, returned transposed (its output a view the next Linear copies)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)).transpose(1, 2)


class _InPlaceRelu(nn.Module):
    """Linear + an in-place ReLU on its output (a view of the product): its backward
    makes the base's gradient buffers (``CopySlices``) before it needs the saved output."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(width, width), nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


class _InPlaceThenScale(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Transposed(width), nn.Linear(width, width), _PairPool(),
                                     _InPlaceRelu(width), _Scale()])
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_segment_ending_in_blocks_that_save_nothing_holds_the_next_ones_first_grads(
        ) -> None:
    """NOTE [ A segment's last block that saves nothing ] in _plan/peak.py: the backward
    runs on into the block before the scale, whose ops that need no saved tensor (the
    in-place ReLU's ``CopySlices`` buffers) run before the recompute and hold their
    outputs through it. Counted without them, the segments of the last four or five
    blocks measured 2 KiB over their predictions (a fuzzed model's); none is under
    now (segments ending in the pool are over, as before)."""
    torch.manual_seed(0)
    tape, off = _one_segment_misses(_InPlaceThenScale(), torch.randn(4, 16, 16), exact_stop=5)
    assert [b.lets_input_go for b in tape.blocks] == [False, False, True, False, True]
    assert tape.blocks[3].recompute_after > 0
    assert off == {}


class _SkipTokens(_Tokens):
    """:class:`_Tokens` whose model pushes block ``push``'s input on a list of skips and
    adds it back after block ``pop`` (``pop`` the last block: after the chain)."""

    def __init__(self, kinds: str, push: int, pop: int) -> None:
        super().__init__(kinds)
        self.push, self.pop = push, pop

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x, skips = self.emb(tokens), []
        for i, block in enumerate(self.blocks):
            if i == self.push:
                skips.append(x)
            x = block(x)
            if i == self.pop:
                x = x + skips.pop()
        return self.head(x.mean(1))


@pytest.mark.parametrize(("kinds", "push", "pop"), [
    ("SMMM", 0, 2), ("SMM", 0, 2), ("MSMMM", 1, 3), ("MSMM", 1, 3)],
    ids=["later", "at-return", "inner-later", "inner-at-return"])
def test_a_segment_holds_the_input_its_first_block_lets_go_of_that_a_skip_holds(
        kinds: str, push: int, pop: int) -> None:
    """NOTE [ A block that lets its input go ] and NOTE [ Inputs the model frees later in
    the chain ] in _plan/peak.py: the model holds a scale block's input in a list of
    skips past the block; checkpointed alone the block lets it go where the model does
    (a later block's window, or when the forward returns), a segment of several starting
    there holds it until its backward. Counted as the lone block's, such segments
    measured the input (4 KiB here) over their predictions, and
    the optimal plan at the smallest budget over it (13 fuzzed models, up to 1 KiB)."""
    torch.manual_seed(0)
    model, tokens = _SkipTokens(kinds, push, pop), torch.randint(0, 8, (4, 8))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean()

    tape = autoremat.profile(model, tokens, loss_fn=loss_fn, timing=False,
                             with_selective=False, with_head=False)
    assert [b.lets_input_go for b in tape.blocks] == [k == "S" for k in kinds]
    under = {}
    for rest, a, b, segments in _one_segment_plans(len(tape.blocks)):
        if all(tape.joins_previous(j) for j in range(a + 1, b)):
            predicted, measured = segments_peaks(model, tokens, tape, segments, loss_fn)
            if measured > predicted:
                under[rest.decision.value, a, b] = measured - predicted
    assert under == {}
    plan = autoremat.plan(tape, budget=smallest_feasible_bytes(tape))
    assert verified(model, tokens, plan, loss_fn=loss_fn).peak_bytes <= plan.budget_bytes


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.norm, self.heads = nn.LayerNorm(width), heads
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.norm(x)).split(width, dim=2))
        y = ((q @ k.transpose(-2, -1)) / (width // self.heads) ** 0.5).softmax(-1) @ v
        return x + self.out(y.transpose(1, 2).reshape(batch, length, width))


class _TokenMixer(nn.Module):
    """MLP-Mixer's token mixing: a Linear over the sequence, through a transpose."""

    def __init__(self, width: int, length: int) -> None:
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(width), nn.Linear(length, length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(self.norm(x).transpose(1, 2)).transpose(1, 2)


class _Mixer(nn.Module):
    def __init__(self, width: int = 16, length: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Attention(width), _TokenMixer(width, length),
                                     _Attention(width), _TokenMixer(width, length)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("with_selective", [True, False])
def test_a_segment_counts_what_its_last_block_s_backward_makes_before_the_recompute(
        with_selective: bool) -> None:
    """``BlockProfile.recompute_after``: a token mixer's backward computes its bias's
    gradient and a contiguous copy of the transposed gradient, which need no saved
    tensor, before its recompute starts; in a segment they stay held while every block
    of it is recomputed. A ``sqrt`` plan of [attention, mixer] segments measured them
    (1056 B) over its prediction (a fuzzed model's). It comes from the tags of the
    checkpointed step, which a profile without selective options did not take until
    2026-11-30 (fuzzed segments up to 8 KiB under: an in-place ReLU's backward copies
    its gradient before the recompute too)."""

    torch.manual_seed(0)
    model = _Mixer()
    x, y = torch.randn(2, 8, 16), torch.randint(0, 4, (2,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.mean(1), y)

    tape = autoremat.profile(model, x, loss_fn=loss_fn, timing=False,
                             with_selective=with_selective)
    assert tape.blocks[1].recompute_after > 0
    n = len(tape.blocks)
    for rest, a, b, segments in _one_segment_plans(n):
        predicted, measured = segments_peaks(model, x, tape, segments, loss_fn)
        assert measured == predicted, (rest, a, b, measured - predicted)


def _exact_plans(model: nn.Module, x: Any, tape: autoremat.Tape, loss_fn: Any,
                 strategies: tuple[str, ...]) -> None:
    """Each strategy's plan gives the plain gradients and measures its prediction."""
    for strategy in strategies:
        plan = autoremat.plan(tape, strategy=strategy)
        report = verified(model, x, plan, loss_fn=loss_fn, repeats=1)
        assert report.grads_equal, (strategy, report)
        assert report.peak_bytes == plan.predicted_peak_bytes, (strategy, report)


class _Feedforward(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class _Skips(nn.Module):
    """Feed-forward blocks without residuals, the first half's outputs added back in
    the second half (``skips``: a U-Net's), then a linear head."""

    def __init__(self, skips: bool, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Feedforward(width) for _ in range(depth))
        self.head, self.skips = nn.Linear(width, 4), skips

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        held, half = [], len(self.blocks) // 2
        for i, block in enumerate(self.blocks):
            if self.skips and i >= half:
                x = x + held.pop()
            x = block(x)
            if i < half:
                held.append(x)
        return self.head(x)


@pytest.mark.parametrize("skips", [False, True], ids=["chain", "u-net"])
def test_a_selective_last_block_keeps_the_output_the_head_saves(skips: bool) -> None:
    """NOTE [ A selective block that keeps its output ] in _plan/peak.py, for the last
    block: its last op is a matmul, which ``selective`` keeps, and the head saves the
    same output. In the checkpointed step the head's backward frees it; kept by the
    selective block it lives to the block's backward. The last block's output the step
    after the chain saves is now recorded (``output_ops``); every ``selective`` plan of
    these models measured one output (2048 B) over its prediction before."""
    torch.manual_seed(0)
    model, x, y = _Skips(skips), torch.randn(32, 16), torch.randint(0, 4, (32,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    tape = autoremat.profile(model, x, loss_fn=loss_fn, timing=False)
    assert tape.blocks[-1].output_ops
    _exact_plans(model, x, tape, loss_fn, ("selective", "none", "full"))


class _Affine(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class _ThenRelu(nn.Module):
    """[residual Linear, scale] as blocks, then an in-place ReLU entry of the list."""

    def __init__(self, first: type[nn.Module], width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([first(width), _Scale(), nn.ReLU(inplace=True)])
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("first", [_Affine, ResidualMlp])
def test_a_segment_ending_at_the_last_block_drops_its_input_once(
        first: type[nn.Module]) -> None:
    """NOTE [ The last block's input after the chain ] in _plan/peak.py: the model lets
    go of the last block's input after the chain ends, counted as released when the
    forward returns where the last block saves none of it; a segment ending there drops
    it as well. Counted twice, a fuzzed model's [Linear, scale] segment measured 4 KiB
    (1.4x) over its prediction, and an ``optimal`` plan over its budget. Where the
    segment's recompute runs, it stops before the scale's input is made again, which
    the composition counts (one boundary over, never under)."""
    from autoremat._core.decisions import RECOMPUTE

    torch.manual_seed(0)
    model, x, y = _ThenRelu(first), torch.randn(64, 16), torch.randint(0, 5, (64,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    tape = autoremat.profile(model, x, loss_fn=loss_fn, blocks=["blocks.0", "blocks.1"],
                             timing=False, with_selective=False)
    predicted, measured = segments_peaks(model, x, tape, [(0, 2, RECOMPUTE)], loss_fn)
    assert measured == predicted if first is _Affine else \
        0 <= predicted - measured <= tape.blocks[1].chain_bytes
    for budget in ("90%", measured, measured - 1):
        try:
            plan = autoremat.plan(tape, budget)
        except autoremat.BudgetError as exc:
            assert exc.min_feasible_bytes is not None and exc.min_feasible_bytes >= measured
            continue
        report = verified(model, x, plan, loss_fn=loss_fn, repeats=1)
        assert report.grads_equal and report.peak_bytes <= plan.predicted_peak_bytes \
            <= plan.budget_bytes


class _AsBuilt(nn.Module):
    """A view of its input: the same storage, another tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape)


class _BareAttention(_Attention):
    """``_Attention`` without its residual: its last op is the output projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.norm(x)).split(width, dim=2))
        y = ((q @ k.transpose(-2, -1)) / (width // self.heads) ** 0.5).softmax(-1) @ v
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class _Between(nn.Module):
    """An attention block without a residual, then an entry of the list that is no block
    of the chain (an in-place ReLU, or a view), then a feed-forward block."""

    def __init__(self, between: str, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([
            _BareAttention(width),
            nn.ReLU(inplace=True) if between == "relu_" else _AsBuilt(),
            _Feedforward(width)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("between", ["relu_", "view"])
def test_a_selective_block_keeps_the_output_the_next_block_takes_after_an_op_between(
        between: str) -> None:
    """NOTE [ What the next block takes of an output ] in _profile/runs.py: an in-place
    ReLU (or a view) between a selective block whose last op is a matmul and the next
    block hands the next block the block's output storage as another version (or as
    another tensor). Noted only where the next block took the output tensor itself,
    unchanged, the profile recorded no ``output_ops``, and the planner did not count the
    kept output held through the block's backward (NOTE [ A selective block that keeps
    its output ] in _plan/peak.py): the ``selective`` plans of these models measured one
    output (1024 B) over their predictions, as ~40 fuzzed attention models did."""
    torch.manual_seed(0)
    model, x = _Between(between), torch.randn(2, 8, 16)
    y = torch.randint(0, 4, (16,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, 4), y)

    tape = autoremat.profile(model, x, loss_fn=loss_fn, timing=False,
                             blocks=["blocks.0", "blocks.2"])
    assert tape.blocks[0].output_ops
    _exact_plans(model, x, tape, loss_fn, ("selective", "none", "full"))


class _NormLinear(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


class _NormThenShared(nn.Module):
    """A block ending in a matmul, then two residual blocks calling one linear layer:
    each saves its input for the weight's gradient, frees it when that is made, and
    then adds it to the gradient the other call made (its backward's peak)."""

    def __init__(self, width: int = 28) -> None:
        super().__init__()
        first, second = _Affine(width), _Affine(width)
        second.fc = first.fc
        self.blocks = nn.ModuleList([_NormLinear(width), first, second])
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_the_next_block_s_backward_under_a_selective_block_that_keeps_its_output() -> None:
    """NOTE [ The next block's backward under a selective block that keeps its output ]
    in _plan/peak.py: block 0's ``matmul`` option keeps its output, which block 1 saves
    and, measured after a checkpointed block 0, frees before the peak of its backward.
    Every plan of single blocks (kept, checkpointed, or under each selective option)
    measures at most its prediction, to the byte where block 0 is selective and block 1
    kept (fuzz seed 4593: 1,344 B, one output, under before); and the DP, whose rows
    carry whether the block before keeps its output, finds the least cost at each
    budget and the least peak that brute force over every plan finds."""
    from autoremat._plan.chain import solve
    from autoremat._plan.peak import kept_outputs, plan_costs, predict_peak

    torch.manual_seed(0)
    model, x = _NormThenShared(), torch.randn(2, 6, 28)
    tape = autoremat.profile(model, x, loss_fn=_mean_square, timing=False,
                             blocks=["blocks.0", "blocks.1", "blocks.2"])
    assert kept_outputs(tape) == [(1, tape.blocks[0].output_bytes)]
    assert Tape.from_json(tape.to_json()) == tape  # bwd_input_held, in files too
    options = [[Choice.selective_from_key(k) for k in sorted(b.selective)]
               for b in tape.blocks]
    singles = [[KEEP, RECOMPUTE, *o] for o in options]
    checked = 0
    for combo in itertools.product(*singles):
        segments = [(i, i + 1, c) for i, c in enumerate(combo)]
        predicted, measured = segments_peaks(model, x, tape, segments, _mean_square)
        assert measured <= predicted, combo
        if combo[0].decision is Decision.SELECTIVE and combo[0].save_ops and \
                combo[1] is KEEP:
            assert measured == predicted, combo
            checked += 1
    assert checked
    table = []
    for plan in conftest.plans_with_options(tape, options):
        table.append((predict_peak(tape, plan),
                      sum(c.rank_cost for c in plan_costs(tape, plan))))
    peaks = sorted({peak for peak, _ in table})
    assert solve(tape, None, objective="peak", options=options).peak_bytes == peaks[0]
    for budget in peaks:
        got = solve(tape, budget, objective="cost", options=options)
        assert got.cost == min(cost for peak, cost in table if peak <= budget), budget
        assert predict_peak(tape, got.segments) == got.peak_bytes <= budget


class _ConvNormed(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv1d(width, width, 3, padding=1), nn.GroupNorm(4, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x.transpose(1, 2)))).transpose(1, 2)


class _LinearThenConvs(nn.Module):
    def __init__(self, width: int = 20) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width), _ConvNormed(width),
                                     _ConvNormed(width)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x


def test_an_output_made_by_a_block_s_last_op_is_its_own_in_the_next_block_s_window() -> None:
    """NOTE [ The next block's backward under a selective block that keeps its output ]
    in _plan/peak.py: block 0's last op (an ``addmm``, under autocast) is counted at the
    event the next block's window starts at; taken for the next block's, the lift of the
    next block's backward, which frees it, was not measured, and block 0 under ``matmul``
    before kept blocks measured 160 B over its prediction (fuzz seeds 13290, 5613)."""
    torch.manual_seed(0)
    model, x = _LinearThenConvs(), torch.randn(2, 6, 20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tape = autoremat.profile(model, x, loss_fn=_mean_square, timing=False,
                                 blocks=["blocks.0", "blocks.1", "blocks.2"])
        assert tape.blocks[1].bwd_input_held
        for key in sorted(tape.blocks[0].selective):
            segments = [(0, 1, Choice.selective_from_key(key)), (1, 2, KEEP), (2, 3, KEEP)]
            predicted, measured = segments_peaks(model, x, tape, segments, _mean_square)
            assert measured <= predicted, (key, measured - predicted)


def _mean_square(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


class _SkippedAtRandom(nn.Module):
    """Stochastic depth by the whole batch: in training, skipped with probability ``p``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.mlp = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(),
                                 nn.Linear(64, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p and self.training and torch.rand(()) < self.p:
            return x
        return x + self.mlp(x)


def test_blocks_skipped_at_random_are_refused_saying_what_to_do() -> None:
    """NOTE [ Blocks skipped at random ]: each step of a profile skipped other blocks; the
    tape misled (held-out: "no gradient reached the output", blocks called frozen, or plans
    1.31-1.54x over their budgets in later steps). A block that always returns its input
    is planned as measured."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_SkippedAtRandom(0.3) for _ in range(6)])
    x = torch.randn(32, 16)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean()

    for seed in range(4):
        torch.manual_seed(seed)
        with pytest.raises(BlockError, match=r"returned its input unchanged in one step of "
                                             r"the profile and computed in another.*drop "
                                             r"probability to 0"):
            autoremat.profile(model, x, loss_fn, timing=False)
    for block in model:
        block.p = 0.0
    tape = autoremat.profile(model, x, loss_fn, timing=False, with_selective=False)
    assert len(tape.blocks) == 6
    model[2].p = 1.0  # skipped in every step: planned as measured
    tape = autoremat.profile(model, x, loss_fn, timing=False, with_selective=False)
    plan = autoremat.plan(tape, None, "full")
    report = verified(model, x, plan, loss_fn=loss_fn, repeats=1)
    assert report.ok and report.peak_bytes == plan.predicted_peak_bytes


def test_a_loss_that_runs_the_model_again_without_gradients_is_planned() -> None:
    """NOTE [ A block run again without gradients ]: a KL term against the model's own
    output under torch.no_grad() (DPO's reference forward of a PEFT model) called every
    block twice in the step; profile refused the model as one that "changes how often it
    runs its blocks from step to step"."""
    torch.manual_seed(0)
    model, x = _Stream(), torch.randn(4, 16, 32)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            reference = model(x)
        return F.mse_loss(out, reference + 1.0)

    tape = autoremat.profile(model, x, loss_fn, timing=False)
    assert [b.name for b in tape.blocks] == [f"layers.{i}" for i in range(5)]
    for budget in ("75%", smallest_feasible_bytes(tape)):
        plan = autoremat.plan(tape, budget)
        report = verified(model, x, plan, loss_fn=loss_fn, repeats=1)
        assert report.ok and report.grads_equal, (budget, report)
        assert report.peak_bytes <= plan.predicted_peak_bytes, (budget, report)


def test_blocks_listed_out_of_running_order_are_rejected() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    x = torch.randn(4, 8)
    before = _snapshot(model)
    with pytest.raises(BlockError, match=r"the blocks ran in the order \['0', '2'\], not in "
                                         r"the order given \(\['2', '0'\]\)"):
        autoremat.profile(model, x, blocks=["2", "0"])
    _assert_unchanged(model, before)


def test_loss_that_does_not_require_grad_is_rejected() -> None:
    model, inputs = zoo.build("mlp", **_SIZES["mlp"])
    with pytest.raises(RematError, match="the loss does not require grad"):
        autoremat.profile(model, inputs, loss_fn=lambda out: out.loss.detach())
    model.requires_grad_(False)
    with pytest.raises(RematError, match="the loss does not require grad"):
        autoremat.profile(model, inputs)


def test_model_without_a_chain_and_non_modules_are_rejected() -> None:
    with pytest.raises(BlockError, match="found no chain of blocks in Linear"):
        autoremat.profile(nn.Linear(4, 4), torch.randn(2, 4))
    with pytest.raises(RematError, match=r"needs an nn\.Module, got function"):
        autoremat.profile(lambda x: x, torch.randn(2, 4))  # type: ignore[arg-type]
    with pytest.raises(RematError, match="repeats must be a whole number >= 1"):
        autoremat.profile(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), torch.randn(1, 2),
                          repeats=0)


def test_the_tape_records_dataflow_and_what_autograd_saved() -> None:
    model, inputs = zoo.build("gpt2", n_layer=2)
    tape = autoremat.profile(model, inputs, repeats=1, with_selective=False, timing=False)
    ops = tape.blocks[1].ops
    names = [o.op for o in ops]
    assert "aten.detach.default" not in names  # checkpoint's own ops are not traced
    for i, o in enumerate(ops):
        assert all(0 <= j < i for j in o.inputs), (i, o)
        assert -1 <= o.target < i and (o.target == -1 or o.inplace)
    draws = [o for o in ops if o.op == "aten.bernoulli_.float"]
    assert len(draws) == 3  # attention, residual and MLP dropout
    for o in draws:  # each fills an empty_like, which reads no values (only a shape)
        assert ops[o.target].op == "aten.empty_like.default" and ops[o.target].inputs == ()
        assert ops[o.target].saved  # the mask: the dropout multiply's backward reads it
    soft = names.index("aten._safe_softmax.default")
    assert ops[soft].saved and ops[soft].kept_bytes == ops[soft].out_bytes
    assert ops[soft + 1].inputs == ()  # the empty_like of the attention dropout
    assert names.index("aten.bmm.default") in ops[soft - 1].inputs  # scores + causal mask
    # the block's output is alive when backward starts (the next block holds it), but
    # autograd did not save it: recompute need not make it again
    assert names[-1] == "aten.add.Tensor" and ops[-1].kept_bytes > 0 and not ops[-1].saved
    assert sum(o.kept_bytes for o in ops) == tape.blocks[1].saved_bytes


class _OutBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        c = torch.ones_like(h)  # no grad: out= is allowed
        buf = torch.empty_like(h)
        torch.add(c, c, out=buf)  # writes buf through a keyword after a defaulted one (alpha)
        return h * buf


def test_an_out_argument_is_the_target_of_the_op_that_writes_it() -> None:
    model = nn.Sequential(_OutBlock(), _OutBlock())
    tape = autoremat.profile(model, torch.randn(4, 8), loss_fn=lambda out: out.sum(),
                             blocks=["0", "1"], repeats=1, with_selective=False, timing=False)
    ops = tape.blocks[1].ops
    names = [o.op for o in ops]
    add = ops[names.index("aten.add.out")]
    assert add.inplace and ops[add.target].op == "aten.empty_like.default"


def test_a_tape_profiled_in_eval_mode_says_so() -> None:
    """Issue 16: an eval() tape planned a train() step 35% over budget, silently."""
    model, inputs = zoo.build("gpt2", n_layer=2, batch_size=2, seq_len=16)
    model.eval()
    with pytest.warns(UserWarning, match=r"profiled in eval\(\) mode"):
        tape = autoremat.profile(model, inputs, with_selective=False, timing=False)
    assert any("eval() mode" in n for n in tape.notes)
    model.train()
    assert not any("eval()" in n for n in autoremat.profile(
        model, inputs, with_selective=False, timing=False).notes)


@pytest.mark.parametrize(("name", "sizes"), [
    ("gpt2", _SIZES["gpt2"]),  # three identical layers
    ("mlp", {"widths": (64,) * 5, "batch_size": 16}),  # alike blocks 1 and 3, not adjacent
])
def test_options_measured_together_equal_one_step_per_option(
        name: str, sizes: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Options measured together ]: several blocks' options in one step, and
    # alike blocks sharing their figures, give what one step per option measures
    options_module = importlib.import_module("autoremat._profile.options")
    runs_module = importlib.import_module("autoremat._profile.runs")
    model, inputs = zoo.build(name, **sizes)
    steps: list[int] = []
    shared: list[list[int]] = []
    run_marked, alike = runs_module._run_marked, options_module._alike

    def counted(*args: Any, **kwargs: Any) -> Any:
        steps.append(1)
        return run_marked(*args, **kwargs)

    def seen(*args: Any) -> list[int]:
        shared.append(alike(*args))
        return shared[-1]

    monkeypatch.setattr(runs_module, "_run_marked", counted)
    monkeypatch.setattr(options_module, "_alike", seen)
    _measured_only(monkeypatch)  # the steps that measure options, as when none is derived
    together = autoremat.profile(model, inputs, timing=False)
    steps_together = len(steps)
    steps.clear()
    monkeypatch.setattr(options_module, "_alike",
                        lambda model, names, runs, ops: list(range(len(names))))
    apart = autoremat.profile(model, inputs, timing=False)

    assert any(like != i for i, like in enumerate(shared[0])), shared  # some share
    assert all(b.selective for b in together.blocks)
    assert [b.selective for b in together.blocks] == [b.selective for b in apart.blocks]
    # NOTE [ Alternations shared by alike blocks ]: and so are the windows of each pair
    assert [(b.fwd, b.bwd, b.fwd_end_release) for b in together.blocks] == \
        [(b.fwd, b.bwd, b.fwd_end_release) for b in apart.blocks]
    assert all(len(b.fwd) == 4 for b in together.blocks[1:])
    if name == "gpt2":  # all alike: ceil(options / 3) selective steps, not one per option
        # (its pairs cannot differ, so neighbours share a step: NOTE [ Options measured
        # between checkpointed neighbours ]; and no alternating step in either: NOTE
        # [ Pairs that cannot differ ])
        assert shared[0] == [0, 0, 0]
        options = len(together.blocks[0].selective)
        steps.clear()
        autoremat.profile(model, inputs, timing=False, with_selective=False)
        assert steps_together - len(steps) == -(-options // 3) < options


def test_options_are_measured_between_checkpointed_neighbours(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Options measured between checkpointed neighbours ]: a window can depend on
    # what the block before does (Autoformer's last decoder layer's options, measured
    # after a selective layer, were up to 5.4% under the steps running them after a
    # checkpointed one), so no two blocks next to each other run options in one step
    # where a block's windows depend on the one before (the MLP's pairs differ)
    options_module = importlib.import_module("autoremat._profile.options")
    contexts = options_module.Contexts
    ran: list[list[str]] = []

    def seen(eager: dict[str, Any], *args: Any) -> Any:
        if sys._getframe(1).f_code.co_name == "selective_runs":  # a selective step's
            ran.append(list(eager))
        return contexts(eager, *args)

    monkeypatch.setattr(options_module, "Contexts", seen)
    _measured_only(monkeypatch)
    model, inputs = zoo.build("mlp", widths=(64,) * 6, batch_size=16)
    tape = autoremat.profile(model, inputs, timing=False)
    names = [b.name for b in tape.blocks]
    assert ran and all(tape.blocks[i].selective for i in range(len(names)))
    for chosen in ran:
        at = sorted(names.index(name) for name in chosen)
        assert all(b - a > 1 for a, b in itertools.pairwise(at)), chosen
    assert max(len(chosen) for chosen in ran) > 1  # several blocks in a step still


@pytest.mark.parametrize(("name", "local"), [("gpt2", True), ("llama", True), ("mlp", False)])
def test_pairs_read_from_the_uniform_steps_equal_the_alternating_steps(
        name: str, local: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Pairs that cannot differ ]: where no block holds what it hands on (the zoo's
    # transformers) the alternating steps are skipped and CK, KC taken from KK, CC; the
    # figures are those the alternating steps measure. The MLP's Tanh saves its output,
    # which the next block saves too: its pairs differ, and are measured
    options_module = importlib.import_module("autoremat._profile.options")
    runs_module = importlib.import_module("autoremat._profile.runs")
    model, inputs = zoo.build(name, **_SIZES[name])
    steps: list[int] = []
    run_marked, pairs_local = runs_module._run_marked, options_module._pairs_local
    found: list[bool] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        steps.append(1)
        return run_marked(*args, **kwargs)

    def seen(*args: Any) -> bool:
        found.append(pairs_local(*args))
        return found[-1]

    monkeypatch.setattr(runs_module, "_run_marked", counted)
    monkeypatch.setattr(options_module, "_pairs_local", seen)
    shortcut = autoremat.profile(model, inputs, timing=False, with_selective=False)
    steps_shortcut = len(steps)
    steps.clear()
    monkeypatch.setattr(options_module, "_pairs_local", lambda runs, n: False)
    measured = autoremat.profile(model, inputs, timing=False, with_selective=False)

    assert found == [local]
    assert len(steps) - steps_shortcut == (1 if local else 0)
    assert all(len(b.fwd) == len(b.bwd) == 4 for b in shortcut.blocks[1:])
    assert [(b.fwd, b.bwd, b.fwd_end_release) for b in shortcut.blocks] == \
        [(b.fwd, b.bwd, b.fwd_end_release) for b in measured.blocks]
    assert (shortcut.post, shortcut.tail, shortcut.step_peak_bytes,
            shortcut.ckpt_step_peak_bytes) == (measured.post, measured.tail,
                                               measured.step_peak_bytes,
                                               measured.ckpt_step_peak_bytes)


def test_what_the_model_made_before_the_chain_and_frees_at_return_leaves_pairs_local(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Pairs that cannot differ ]: a Hugging Face Llama's position ids, made before
    the layers and passed to each, are freed when the forward returns in the kept step
    and by block 0 in the checkpointed one (every checkpoint holds them): its pairs were
    measured in two more steps (x9.0 plain steps for profile, x7.3 without). Every plan
    of single blocks predicts as from the measured pairs, and its measured peak."""
    options_module = importlib.import_module("autoremat._profile.options")
    pairs_local = options_module._pairs_local
    found: list[bool] = []

    def seen(*args: Any) -> bool:
        found.append(pairs_local(*args))
        return found[-1]

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, use_cache=False))
    ids = torch.randint(0, 256, (2, 32))
    inputs = {"input_ids": ids, "labels": ids}
    monkeypatch.setattr(options_module, "_pairs_local", seen)
    shortcut = autoremat.profile(model, inputs, timing=False, with_selective=False)
    monkeypatch.setattr(options_module, "_pairs_local", lambda runs, n: False)
    measured = autoremat.profile(model, inputs, timing=False, with_selective=False)
    assert found == [True]
    ours, theirs = (single_block_plans(model, inputs, tape) for tape in (shortcut, measured))
    assert {k: v[0] for k, v in ours.items()} == {k: v[0] for k, v in theirs.items()}
    assert all(predicted == peak for predicted, peak in ours.values()), ours


@pytest.mark.parametrize(("agree", "timing_steps"), [(float("inf"), 1), (-1.0, 2)])
def test_the_first_step_is_one_timing_sample_and_agreeing_steps_end_the_timing(
        agree: float, timing_steps: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Timing repeats ]: with repeats=3 the step that finds the chain is a sample;
    # one more step if it agrees with the next one (always, with an infinite tolerance),
    # two more if not (never, with a negative one)
    profile_module = importlib.import_module("autoremat._profile.runs")
    model, inputs = zoo.build("mlp", **_SIZES["mlp"])
    steps: list[str] = []
    run_marked = profile_module._run_marked

    def counted(*args: Any, **kwargs: Any) -> Any:
        steps.append(type(args[2]).__name__)  # on_mark: _Stamps in the timing steps
        return run_marked(*args, **kwargs)

    monkeypatch.setattr(profile_module, "_run_marked", counted)
    monkeypatch.setattr(profile_module, "_AGREE", agree)
    tape = autoremat.profile(model, inputs, repeats=3, with_selective=False)
    assert steps.count("_Stamps") == timing_steps
    assert tape.step_ms > 0 and all(b.fwd_ms > 0 and b.bwd_ms > 0 for b in tape.blocks)
    steps.clear()
    autoremat.profile(model, inputs, repeats=2, with_selective=False)
    assert steps.count("_Stamps") == 2  # fewer than three: the first step is not a sample


def test_hf_gpt2s_first_layer_measures_alike_despite_the_position_ids(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # HF GPT-2 makes its position ids before the first layer and releases them when the
    # forward returns; they are filed under block 0's release but are not made by it, so
    # they do not make it unlike the other layers: its selective options are measured
    # with theirs (2 steps for 11 options on 6 layers, not 11), and the figures are those
    # measured on block 0 itself
    profile_module = importlib.import_module("autoremat._profile.options")
    torch.manual_seed(0)
    model = _hf("gpt2").train()
    ids = torch.randint(0, _V, (_B, _T))
    inputs = {"input_ids": ids, "labels": ids}
    alike = profile_module._alike
    shared: list[list[int]] = []

    def seen(*args: Any) -> list[int]:
        shared.append(alike(*args))
        return shared[-1]

    monkeypatch.setattr(profile_module, "_alike", seen)
    _measured_only(monkeypatch)  # the steps that measure options, as when none is derived
    together = autoremat.profile(model, inputs, timing=False, with_head=False)
    monkeypatch.setattr(profile_module, "_alike",
                        lambda model, names, runs, ops: list(range(len(names))))
    apart = autoremat.profile(model, inputs, timing=False, with_head=False)

    assert shared == [[0, 0, 0]]
    assert together.blocks[0].fwd_end_release  # the position ids, released at the end
    assert all(b.selective for b in together.blocks)
    assert [b.selective for b in together.blocks] == [b.selective for b in apart.blocks]


def _measured_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Profiles measure every selective option in a step, none derived."""
    monkeypatch.setattr(importlib.import_module("autoremat._profile.options"), "_derived",
                        lambda *args: None)


def _odd() -> tuple[nn.Module, Any, Any]:
    from test_selective import _OddNet  # in-place ops on kept outputs, rand_like, BatchNorm

    torch.manual_seed(0)
    return _OddNet(), {"x": torch.randn(16, 32), "y": torch.randint(0, 3, (16,))}, \
        (lambda out: out)


def _hf_case(kind: str) -> Callable[[], tuple[nn.Module, Any, Any]]:
    def build() -> tuple[nn.Module, Any, Any]:
        torch.manual_seed(0)
        ids = torch.randint(0, _V, (_B, _T))
        return _hf(kind).train(), {"input_ids": ids, "labels": ids}, None
    return build


def _t5() -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=_V, d_model=32, d_kv=16, d_ff=64, num_layers=3,
                                   num_heads=2, decoder_start_token_id=0, pad_token_id=0,
                                   use_cache=False)
    inputs = {"input_ids": torch.randint(0, _V, (_B, _T)),
              "labels": torch.randint(0, _V, (_B, _T))}
    return transformers.T5ForConditionalGeneration(config).train(), inputs, None


def _zoo_case(name: str, **sizes: Any) -> Callable[[], tuple[nn.Module, Any, Any]]:
    def build() -> tuple[nn.Module, Any, Any]:
        model, inputs = zoo.build(name, **{**_SIZES[name], **sizes})
        return model, inputs, None
    return build


def check_derived_options(model: nn.Module, inputs: Any, loss_fn: Any,
                          monkeypatch: pytest.MonkeyPatch) -> dict[tuple[int, str], bool]:
    """Profiles ``model`` and runs every selective option derived from the checkpointed
    step alone on its block, the other blocks checkpointed: its windows and recompute
    FLOPs must equal the derived ones. Returns which options were derived (also for
    ``test_gpu``)."""
    from autoremat._core.saves import is_keep_set, op_signature, save_set_of
    from autoremat._core.step import Step
    from autoremat._measure.flops import FlopCounter
    from autoremat._mechanism.selective import selective_context
    from autoremat._profile.runs import Contexts, memory_run

    options_module = importlib.import_module("autoremat._profile.options")
    derived = options_module._derived
    found: dict[tuple[int, str], bool] = {}

    def spy(base: Any, i: int, key: str, *args: Any) -> Any:
        out = derived(base, i, key, *args)
        found[i, key] = out is not None
        return out

    monkeypatch.setattr(options_module, "_derived", spy)
    tape = autoremat.profile(model, inputs, loss_fn=loss_fn, timing=False, with_head=False)
    names, n = [b.name for b in tape.blocks], len(tape.blocks)
    step = Step(model, inputs, loss_fn)
    checked = 0
    for (i, key), ok in sorted(found.items()):
        if not ok:
            continue
        block = tape.blocks[i]
        option = block.selective[key]
        context = selective_context(keep_ops=option.keep_ops, skip_ops=option.skip_ops,
                                    signature=op_signature([o.op for o in block.ops])) \
            if is_keep_set(key) else selective_context(save_set_of(key))
        counter = FlopCounter()
        run = memory_run(step, names, (Decision.RECOMPUTE,) * n,
                          Contexts({names[i]: context}), rounding=None, counter=counter)
        for p in model.parameters():
            p.grad = None
        flops = counter.by_label.get((names[i], "bwd"), 0) - block.bwd_flops
        assert (option.fwd, option.bwd, option.recompute_flops) == \
            (run.fwd[i], run.bwd[i], flops), (i, key)
        checked += 1
    assert checked >= len(tape.blocks[-1].selective)
    assert all(b.selective for b in tape.blocks)
    return found


@pytest.mark.parametrize("case", [
    _zoo_case("gpt2"), _zoo_case("llama"), _zoo_case("mlp"), _zoo_case("resnet"), _odd,
    _hf_case("gpt2"), _hf_case("llama"), _hf_case("bert"), _t5,
], ids=["gpt2", "llama", "mlp", "resnet", "odd", "hf-gpt2", "hf-llama", "hf-bert", "hf-t5"])
def test_selective_options_derived_from_the_checkpointed_step_equal_measured_ones(
        case: Callable[[], tuple[nn.Module, Any, Any]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Selective windows from the checkpointed step ]: every option derived equals
    # a step that runs it on its block alone, the other blocks checkpointed: its windows
    # and recompute FLOPs. Options the tags cannot show (the odd net's kept outputs
    # changed in place, ResNet's kept block outputs) are measured instead.
    model, inputs, loss_fn = case()
    found = check_derived_options(model, inputs, loss_fn, monkeypatch)
    if case is _odd:
        assert not all(found.values())  # kept outputs changed in place: measured


def test_derived_options_count_what_a_kernel_holds_inside_an_op(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Memory a kernel allocates inside an op ]: on CUDA every matmul's working
    # memory is a transient on the timeline; an option that keeps a matmul's output
    # no longer runs it in recompute, nor holds its working memory there. A probe that
    # stands in for the allocator (4 MiB inside each forward matmul, addmm, more than the
    # block's activations) makes those spikes the windows' peaks.
    from test_memory import inside_probe

    probe = inside_probe(monkeypatch, nbytes=4 << 20, ops=("addmm",))
    model, inputs, loss_fn = _zoo_case("gpt2")()
    found = check_derived_options(model, inputs, loss_fn, monkeypatch)
    assert sum(found.values()) >= 4 and probe.seen


def test_what_checkpointed_blocks_release_under_autocast_is_predicted_exactly() -> None:
    # NOTE [ Released when the forward returns ] and [ Releases in the DP ]: under
    # autocast a checkpointed block lets go of its weights' bf16 copies (autocast's cache)
    # when the forward returns, a kept one holds them for its backward. Every plan of
    # whole blocks measures its prediction, and the smallest feasible budget is the
    # smallest plan's (the planner reported 9% more on a held-out Phi-3, and predicted
    # mixed plans up to 3 blocks' copies over on a GPT-2, whose post window peaks in the
    # head's backward, after the release).

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=512, n_positions=64, use_cache=False))
    ids = torch.randint(0, 512, (4, 64))
    inputs = {"input_ids": ids, "labels": ids}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tape = autoremat.profile(model, inputs, timing=False, with_selective=False)
        assert all(len(set(b.fwd_end_release.values())) == 2 for b in tape.blocks[1:])
        peaks = single_block_plans(model, inputs, tape)
        assert all(predicted == measured for predicted, measured in peaks.values()), peaks
        with pytest.raises(autoremat.BudgetError) as info:
            autoremat.plan(tape, 1)
    assert info.value.min_feasible_bytes is not None
    assert info.value.min_feasible_bytes <= min(measured for _, measured in peaks.values())


def test_what_a_plan_holds_on_and_lets_go_of_at_return_are_not_netted() -> None:
    # released_post_peak: a BERT under autocast whose first layer is recomputed holds on
    # to its input (32 KiB the model keeps until its forward returns, which the
    # checkpoint takes) and lets go of the next layer's weight casts (64 KiB); netted, the
    # levels before the backward were predicted without the first, and the plan measured
    # 32 KiB over its prediction. No plan of whole blocks measures over its prediction.
    from autoremat._core.decisions import KEEP, RECOMPUTE

    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(transformers.BertConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
        vocab_size=128, max_position_embeddings=64))
    ids = torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids.flip(1).clone()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tape = autoremat.profile(model, inputs, timing=False, with_selective=False)
        peaks = single_block_plans(model, inputs, tape)
    assert all(measured <= predicted for predicted, measured in peaks.values()), peaks
    predicted, measured = peaks[(RECOMPUTE, KEEP, KEEP)]
    assert measured == predicted


class _Cross(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.m = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return x + (h if memory is None else h + self.m(memory))


class _EncoderDecoder(nn.Module):
    """An encoder and a decoder as one chain; the parent norms the encoder's output and
    passes it to every decoder layer (a T5's)."""

    def __init__(self, d: int = 64, n: int = 2) -> None:
        super().__init__()
        self.enc = nn.ModuleList(_Cross(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.dec = nn.ModuleList(_Cross(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.enc:
            x = block(x)
        memory = self.norm(x)
        y = x * 0.5
        for block in self.dec:
            y = block(y, memory)
        return y.square().mean()


def test_a_tensor_the_parent_makes_between_blocks_and_frees_at_return_is_counted_held() -> None:
    # NOTE [ Tensors blocks take that the model frees when it returns ]: under autocast
    # nothing saves the normed encoder output (the decoder's linear saves its bf16 cast),
    # the model frees it when it returns, and a checkpoint of the last decoder layer holds
    # it to its backward: that plan measured it (64 KiB) over its prediction
    from autoremat._core.decisions import KEEP, RECOMPUTE

    torch.manual_seed(0)
    model, x = _EncoderDecoder(), torch.randn(8, 32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tape = autoremat.profile(model, x, loss_fn=lambda out: out,
                                 blocks=["enc.0", "enc.1", "dec.0", "dec.1"], timing=False,
                                 with_selective=False)
        assert tape.freed_at_return == {"2:2,3": 8 * 32 * 64 * 4}
        peaks = single_block_plans(model, x, tape, lambda out: out)
    assert all(measured <= predicted for predicted, measured in peaks.values()), peaks
    predicted, measured = peaks[(KEEP, KEEP, KEEP, RECOMPUTE)]
    assert measured == predicted


def test_a_tensor_one_checkpointed_block_takes_is_held_past_the_return() -> None:
    # held_at_return: a Funnel under autocast passes each encoder layer tensors its parent
    # made for it alone, freed when the forward returns; a plan recomputing the encoder
    # and keeping the decoder measured 16 KiB over its prediction and its budget when
    # they were counted held already, as for tensors several checkpointed blocks take
    from autoremat._core.decisions import KEEP, RECOMPUTE

    torch.manual_seed(0)
    model = transformers.FunnelForMaskedLM(transformers.FunnelConfig(
        vocab_size=128, d_model=32, n_head=2, d_head=16, d_inner=64, block_sizes=[2, 2],
        num_decoder_layers=2))
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tape = autoremat.profile(model, inputs, timing=False, with_selective=False)
        assert any(key.split(":")[1].count(",") == 0 for key in tape.freed_at_return)
        peaks = single_block_plans(model, inputs, tape,
                                   combos=[(RECOMPUTE,) * 4 + (KEEP,) * 2])
    (predicted, measured), = peaks.values()
    assert measured <= predicted


def test_layers_a_model_runs_without_gradients_itself_are_refused_for_what_they_are() -> None:
    # Reformer's reversible layers run under torch.no_grad() inside its own autograd
    # function; the refusal said to turn off the model's checkpointing, which was off.
    # Told apart from a reentrant checkpoint by torch.utils.checkpoint on the stack, not
    # by the model's flag: lucidrains' reversible models (reformer-pytorch,
    # performer-pytorch, routing- and sinkhorn-transformer) have none, and were told to
    # turn off a checkpointing they do not do
    torch.manual_seed(0)
    model = transformers.ReformerModelWithLMHead(transformers.ReformerConfig(
        vocab_size=128, hidden_size=32, num_attention_heads=2, attention_head_size=16,
        feed_forward_size=64, attn_layers=["local", "local"], axial_pos_shape=[8, 8],
        axial_pos_embds_dim=[16, 16], max_position_embeddings=64, is_decoder=True,
        local_attn_chunk_length=16, use_cache=False)).train()
    ids = torch.randint(0, 128, (2, 64))
    with pytest.raises(BlockError, match=r"not inside torch\.utils\.checkpoint") as info:
        autoremat.profile(model, {"input_ids": ids, "labels": ids}, repeats=1, timing=False)
    assert "gradient_checkpointing_disable" not in str(info.value)


class _Reversible(torch.autograd.Function):
    """Two-stream reversible layers (y1 = x1 + f(x2), y2 = x2 + g(y1)) run without
    gradients, their inputs remade from their outputs in backward, as lucidrains'
    ``ReversibleSequence`` does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layers: nn.ModuleList, *params: torch.Tensor
                ) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        with torch.no_grad():
            for f, g in zip(layers[::2], layers[1::2], strict=True):
                x1 = x1 + f(x2)
                x2 = x2 + g(x1)
        ctx.layers = layers
        y = torch.cat([x1, x2], dim=-1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        (y,) = ctx.saved_tensors
        y1, y2 = y.chunk(2, dim=-1)
        dy1, dy2 = dy.chunk(2, dim=-1)
        layers = [getattr(m, "inner", m) for m in ctx.layers]  # see _WrappedLayer
        for f, g in zip(layers[-2::-2], layers[::-2], strict=True):
            with torch.enable_grad():
                y1 = y1.detach().requires_grad_()
                gy = g(y1)
                torch.autograd.backward(gy, dy2)
            with torch.no_grad():
                x2 = y2 - gy
                dy1 = dy1 + y1.grad
            with torch.enable_grad():
                x2 = x2.detach().requires_grad_()
                fx = f(x2)
                torch.autograd.backward(fx, dy1)
            with torch.no_grad():
                y1, y2, dy2 = y1 - fx, x2, dy2 + x2.grad
        return (torch.cat([dy1, dy2], dim=-1), None, *[None] * len(ctx.needs_input_grad[2:]))


class _WrappedLayer(nn.Module):
    """A layer whose own forward runs only in forward: backward runs its inner layer."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class _ReversibleNet(nn.Module):
    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(2 * d, 2 * d)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh())
                                    for _ in range(n))
        self.out = nn.Linear(2 * d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = [p for p in self.layers.parameters()]
        return self.out(_Reversible.apply(self.inp(x), self.layers, *params)).sum()


def test_reversible_layers_without_a_flag_are_refused_for_what_they_are() -> None:
    model = _ReversibleNet()
    x = torch.randn(4, 32)
    model(x).backward()  # the plain step trains
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=True)
    # its layers run again in backward, by the model's own Function
    with pytest.raises(BlockError, match=r"ran again in backward, not inside torch\.utils\."
                                         r"checkpoint") as info:
        autoremat.profile(model, x, loss_fn=lambda out: out, repeats=1, timing=False)
    assert "reversible" in str(info.value) and "checkpoints them itself" not in str(info.value)
    # the layers' Sequential wrapped: the blocks found run under no_grad and never in
    # backward (lucidrains' ReversibleBlock runs its f and g, not itself, in backward)
    model.layers = nn.ModuleList(_WrappedLayer(layer) for layer in model.layers)
    with pytest.raises(BlockError, match=r"ran with gradients off .* not inside torch\.utils\."
                                         r"checkpoint") as info:
        autoremat.profile(model, x, loss_fn=lambda out: out, repeats=1, timing=False)
    assert "reversible" in str(info.value) and "checkpoints them itself" not in str(info.value)


class _PreNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _HeadLM(nn.Module):
    def __init__(self, d: int = 64, n: int = 4, vocab: int = 512) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_PreNorm(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_loss_taken_after_the_forward_and_its_backward_inside_autocast_is_planned() -> None:
    # NOTE [ Backward inside autocast ]: the loss's backward (the head's, where this step
    # peaks) runs before backward reaches the model's output, where the cache was
    # emptied; the casts only checkpointed blocks used were held through it: 4-15% over
    # the prediction, over the budget
    torch.manual_seed(0)
    model, ids, y = _HeadLM(), torch.randint(0, 512, (4, 32)), torch.randint(0, 512, (4, 32))
    loss_fn = lambda logits: F.cross_entropy(logits.float().flatten(0, 1), y.flatten())  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tape = autoremat.profile(model, ids, loss_fn=loss_fn, timing=False,
                                 with_selective=False)
        plan = autoremat.plan(tape, "70%")
    assert plan.recompute_blocks >= 2
    autoremat.apply(model, plan)
    try:
        for inside in (True, False):
            with autoremat.track_memory() as mem:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(ids)  # held through the backward: the profiled loop's
                    loss = loss_fn(out)
                    if inside:
                        loss.backward()
                if not inside:
                    loss.backward()
                del out, loss
            model.zero_grad(set_to_none=True)
            # (a segment of several blocks: over by up to a bias's gradient, 1,280 B;
            # NOTE [ Inner blocks' releases ] in _plan/peak.py made it the cheapest)
            assert 0 <= plan.predicted_peak_bytes - mem.peak_bytes <= 2048, inside
    finally:
        autoremat.remove(model)


class _SparseEmbedded(nn.Module):
    def __init__(self, vocab: int = 500, d: int = 32, n: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, sparse=True)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(),
                                                  nn.Linear(4 * d, d)) for _ in range(n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean()


def test_a_sparse_gradient_is_counted_and_compared() -> None:
    # nn.Embedding(sparse=True): its gradient has no storage of its own; track_memory,
    # profile and auto raised "Cannot access storage of SparseTensorImpl", verify's
    # torch.equal had no sparse kernel. Its indices and values are counted.
    torch.manual_seed(0)
    model, ids = _SparseEmbedded(), torch.randint(0, 500, (16, 12))
    with autoremat.track_memory() as mem:
        run_step(model, ids, None)
    grad = model.emb.weight.grad
    assert grad is not None and grad.is_sparse
    sparse = grad._indices().untyped_storage().nbytes() + grad._values().untyped_storage().nbytes()
    assert mem.current_bytes >= sparse
    model.zero_grad(set_to_none=True)
    tape = autoremat.profile(model, ids, timing=False)
    plan = autoremat.plan(tape, strategy="full")
    autoremat.apply(model, plan)
    try:
        report = autoremat.verify(model, ids, repeats=1)
    finally:
        autoremat.remove(model)
    assert report.ok and report.grads_equal and report.peak_bytes <= plan.predicted_peak_bytes


class _SparseGCN(nn.Module):
    """Graph convolutions over a sparse adjacency matrix (``torch.sparse.mm``, which
    saves it for backward), built in the block or given to the model."""

    def __init__(self, layout: torch.layout, inside: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.layout, self.inside = layout, inside
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, edges: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.inside:  # built from the edges in each layer
                adj = torch.sparse_coo_tensor(edges, torch.ones(edges.shape[1]),
                                              (x.shape[0],) * 2).coalesce()
                adj = adj if self.layout is torch.sparse_coo else adj.to_sparse_csr()
            x = x + F.relu(torch.sparse.mm(adj, layer(x)))
        return self.head(x)


@pytest.mark.parametrize("layout, inside", [(torch.sparse_coo, False), (torch.sparse_csr, False),
                                            (torch.sparse_coo, True)],
                         ids=["coo-given", "csr-given", "coo-in-blocks"])
def test_a_sparse_tensor_autograd_saves_is_profiled(layout: torch.layout, inside: bool) -> None:
    """A sparse adjacency matrix saved for backward: profile raised "Cannot access storage
    of SparseTensorImpl" (its saved-tensor hooks read storages; a held-out GCN). Its
    indices and values are followed instead."""
    torch.manual_seed(0)
    n = 64
    edges = torch.randint(0, n, (2, 256))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        adj = torch.sparse_coo_tensor(edges, torch.rand(256), (n, n)).coalesce()
        adj = adj if layout is torch.sparse_coo else adj.to_sparse_csr()
        model, x, y = _SparseGCN(layout, inside), torch.randn(n, 16), torch.randint(0, 3, (n,))
        tape = autoremat.profile(model, (x, edges, adj), loss_fn, timing=False)
        for strategy in ("full", "selective"):
            plan = autoremat.plan(tape, None, strategy)
            report = verified(model, (x, edges, adj), plan, loss_fn=loss_fn, repeats=1)
            assert report.ok and report.grads_equal, (strategy, report)
            over = plan.predicted_peak_bytes - report.peak_bytes
            # selective keeps the last layer's output, which the sparse product after
            # the chain saves too: counted held to its backward, at most that over
            # (NOTE [ A selective block that keeps its output ] in _plan/peak.py)
            limit = tape.blocks[-1].output_bytes if strategy == "selective" else 0
            assert 0 <= over <= limit, (strategy, report)



class _ComplexBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d, dtype=torch.cfloat)
        self.down = nn.Linear(2 * d, d, dtype=torch.cfloat)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.up(z)
        return z + self.down(h * torch.sigmoid(h.abs()))


class _Spectral(nn.Module):
    """Blocks over complex activations, between a Fourier transform and its inverse."""

    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ComplexBlock(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.fft.fft(x, dim=-1)
        for block in self.blocks:
            z = block(z)
        return torch.fft.ifft(z, dim=-1).real


def test_blocks_over_complex_activations_are_planned_exactly() -> None:
    """Complex activations between blocks: profile refused them as blocks "backward runs
    through none of" (its backward marks were set on floating tensors only; a held-out
    spectral model). They are planned like real ones, and estimated to the byte."""
    torch.manual_seed(0)
    model, x = _Spectral(), torch.randn(64, 32)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean()

    tape = autoremat.profile(model, x, loss_fn, timing=False)
    assert [b.name for b in tape.blocks] == [f"blocks.{i}" for i in range(4)]
    for strategy, budget in (("full", None), ("sqrt", None), ("selective", None),
                             ("optimal", "60%")):
        plan = autoremat.plan(tape, budget, strategy)
        assert plan.recompute_blocks, strategy
        report = verified(model, x, plan, loss_fn=loss_fn, repeats=1)
        assert report.ok and report.grads_equal, (strategy, report)
        assert report.peak_bytes == plan.predicted_peak_bytes, (strategy, report)
    with torch.device("meta"):
        fake = _Spectral()
    est = autoremat.estimate(fake, torch.empty(64, 32, device="meta"), loss_fn=loss_fn,
                             device="cpu")
    assert est.step_peak_bytes == tape.step_peak_bytes

class _WeightsBlock(nn.Module):
    """Attention with a bias and a causal mask (MPT's ALiBi) that returns its weights
    beside its output, as MPT's blocks do."""

    def __init__(self, d: int, heads: int, t: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.register_buffer("bias", torch.randn(heads, 1, t))
        self.register_buffer("mask", torch.ones(t, t, dtype=torch.bool).triu(1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5 + self.bias
        weights = scores.masked_fill(self.mask, torch.finfo(x.dtype).min).softmax(-1)
        x = x + self.out((weights @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x), weights


class _DropsWeights(nn.Module):
    """MPT's loop: ``outputs = block(hidden)`` holds a block's weights until the next
    block returns, and the last block's until the forward returns."""

    def __init__(self, n: int = 4, d: int = 32, heads: int = 2, t: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_WeightsBlock(d, heads, t) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = (x,)
        for block in self.blocks:
            outputs = block(outputs[0])
        return outputs[0].pow(2).mean()


def test_a_kept_output_the_model_drops_before_the_backward_is_held_in_the_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Kept outputs that outlive the forward ]: an option that keeps the softmax a
    # block returns holds it until the block's backward, where the checkpointed step
    # dropped it in the next block's forward. Found on a held-out MPT: 256 KiB over.
    from autoremat._core.decisions import KEEP, RECOMPUTE, Choice
    from autoremat._plan.plan import plan_of_segments

    torch.manual_seed(0)
    model, x = _DropsWeights(), torch.randn(4, 64, 32)
    found = check_derived_options(model, x, None, monkeypatch)
    assert found and all(found.values())  # derived, and each equal to a step running it
    tape = autoremat.profile(model, x, timing=False, with_head=False)
    weights = 4 * 2 * 64 * 64 * 4
    held = {key: o.held_after for key, o in tape.blocks[0].selective.items()}
    assert set(held.values()) == {0, weights}, held
    n = len(tape.blocks)
    for key in (k for k, v in held.items() if v):
        for other in (KEEP, RECOMPUTE):
            plan = plan_of_segments(tape, [(0, 1, Choice.selective_from_key(key))]
                                    + [(i, i + 1, other) for i in range(1, n)], "test")
            report = verified(model, x, plan, repeats=1)
            assert report.max_grad_diff == 0.0
            assert report.peak_bytes == plan.predicted_peak_bytes, (key, other)


def _one_selective(model: nn.Module, x: torch.Tensor, tape: Tape, i: int, key: str,
                   other: Choice) -> tuple[autoremat.Plan, Any]:
    """The plan running block ``i``'s option ``key`` and every other block as ``other``,
    verified (gradients equal to the plain model's): the plan and its report."""
    from autoremat._plan.plan import plan_of_segments

    segments = [(j, j + 1, other) for j in range(len(tape.blocks))]
    segments[i] = (i, i + 1, Choice.selective_from_key(key))
    plan = plan_of_segments(tape, segments, "test")
    report = verified(model, x, plan, repeats=1)
    assert report.max_grad_diff == 0.0
    return plan, report


class _KeepsWeights(nn.Module):
    """x-transformers' loop: every block's attention weights kept in a list until the
    forward returns. ``head``: "wide", a wide head whose backward the step peaks in;
    "transient", one whose forward it peaks in (a wide tensor nothing saves)."""

    def __init__(self, n: int = 4, d: int = 32, heads: int = 2, t: int = 64,
                 head: str = "") -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_WeightsBlock(d, heads, t) for _ in range(n))
        self.head = nn.Linear(d, 4096) if head == "wide" else None
        self.transient = head == "transient"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = []
        for block in self.blocks:
            x, weights = block(x)
            kept.append(weights)
        if self.transient:  # (the chain's output let go of first, as x-transformers'
            x = x * 2.0  # final norm lets go of the last layer's)
            return x.pow(2).mean() + x.repeat(1, 1, 64).mean()
        return (x if self.head is None else self.head(x)).pow(2).mean()


@pytest.mark.parametrize("head", ["", "wide", "transient"])
def test_a_kept_output_the_model_drops_when_it_returns_is_counted_from_the_return(
        head: str) -> None:
    # NOTE [ Where the forward returns ] in _plan/peak.py: the checkpointed step frees
    # each block's weights when the forward returns, so an option keeping them holds
    # them past that (``held_after``), but the levels before the return hold them in
    # every step: counted from the block's forward on, a plan peaking in the chain's
    # forward or in the model's own head before it returns was predicted them over
    # (x-transformers' decoders: up to 28% over; 128 KiB here)
    from autoremat._core.decisions import KEEP, RECOMPUTE

    torch.manual_seed(0)
    model, x = _KeepsWeights(head=head), torch.randn(4, 64, 32)
    tape = autoremat.profile(model, x, timing=False, with_head=False)
    assert tape.post_ret_peak and tape.post_returned_peak and tape.post_ckpt_levels
    assert autoremat.Tape.from_json(tape.to_json()) == tape  # the new figures saved too
    weights = 4 * 2 * 64 * 64 * 4
    n = len(tape.blocks)
    for i in range(n):
        options = tape.blocks[i].selective
        held = {key: (o.held_after, o.held_at_return) for key, o in options.items()}
        assert (weights, weights) in held.values(), held
        for key in (k for k, v in held.items() if v[1]):
            for other in (KEEP, RECOMPUTE):
                plan, report = _one_selective(model, x, tape, i, key, other)
                if head == "transient" and other is KEEP:
                    # peaking in the head's forward after the last block kept: the step
                    # it was measured in saved the weights, so where the plan's keeping
                    # lets go of them there is not known: over by them, never under
                    assert report.peak_bytes <= plan.predicted_peak_bytes \
                        <= report.peak_bytes + weights, (i, key)
                    continue
                assert report.peak_bytes == plan.predicted_peak_bytes, (i, key, other)


def _in_turn(n: int, d: int, attention: Callable[[int], nn.Module], hidden: int
             ) -> nn.ModuleList:
    """``n`` layers, attentions and MLPs (``hidden`` times as wide) in turn."""
    return nn.ModuleList(
        attention(d) if i % 2 == 0 else
        nn.Sequential(nn.LayerNorm(d), nn.Linear(d, hidden * d), nn.GELU(),
                      nn.Linear(hidden * d, d))
        for i in range(n))


class _ScaledOutside(nn.Module):
    """ViT-5's loop: each layer's output scaled by a parameter outside the layer
    (``attn(x) * ls1 + x``), whose ``mul`` saves that output until its own backward,
    just before the layer's; attentions and MLPs in turn."""

    def __init__(self, n: int = 4, d: int = 32) -> None:
        super().__init__()
        self.blocks = _in_turn(n, d, _Attention, 2)
        self.scales = nn.ParameterList(nn.Parameter(torch.full((d,), 0.1)) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, scale in zip(self.blocks, self.scales, strict=True):
            x = block(x) * scale + x
        return x.pow(2).mean()


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.norm = heads, nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)

    def _split(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        return self.qkv(h).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                shape: torch.Size) -> torch.Tensor:
        b, t, d = shape
        weights = (q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5).softmax(-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.norm(x))
        return self._attend(q, k, v, x.shape)


class _ValueResidual(nn.Module):
    """The simple ViT with value residual's loop: the first attention's values (a view
    of its projection's output) taken by every later one; attentions and MLPs in turn."""

    def __init__(self, n: int = 4, d: int = 32) -> None:
        super().__init__()
        self.blocks = _in_turn(n, d, _ValueAttention, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = None
        for block in self.blocks:
            if isinstance(block, _ValueAttention):
                out, values = block(x, residual)
                residual = values if residual is None else residual
            else:
                out = block(x)
            x = x + out
        return x.pow(2).mean()


class _ValueAttention(_Attention):
    def __init__(self, d: int, heads: int = 2) -> None:
        super().__init__(d, heads)
        self.mix = nn.Linear(d, heads)

    def forward(self, x: torch.Tensor,  # type: ignore[override]
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(x)
        q, k, v = self._split(h)
        if residual is not None:
            mix = torch.sigmoid(self.mix(h)).transpose(1, 2).unsqueeze(-1)
            v = v * mix + residual * (1.0 - mix)
        return self._attend(q, k, v, x.shape), v


@pytest.mark.parametrize(("make", "shape"), [(_ScaledOutside, (4, 64, 32)),
                                              (_ValueResidual, (4, 16, 32))])
def test_a_kept_output_freed_in_the_backward_before_the_blocks_is_held_in_the_plan(
        make: Callable[[], nn.Module], shape: tuple[int, ...]) -> None:
    # NOTE [ Kept outputs freed in the backward before the block's ]: an option keeping
    # an output the checkpointed step freed after the backward started, before the
    # block's own backward (a mul outside the block that saved it; later blocks that
    # took it), holds it into that backward, above the levels the step measured. Found
    # on held-out vit-pytorch models: ViT-5's `matmul` option one output (35,328 B, 2%)
    # under its step, and the simple ViT with value residual's first attention.

    torch.manual_seed(0)
    model, x = make(), torch.randn(*shape)
    tape = autoremat.profile(model, x, timing=False, with_head=False)
    assert autoremat.Tape.from_json(tape.to_json()) == tape  # the new figures saved too
    n, found = len(tape.blocks), set()
    for i in range(n):
        for key, option in tape.blocks[i].selective.items():
            if not option.bwd_freed_bytes:
                continue
            found.add((i, option.bwd_freed_span))
            for other in (KEEP, RECOMPUTE):
                plan, report = _one_selective(model, x, tape, i, key, other)
                assert report.peak_bytes == plan.predicted_peak_bytes, (i, key, other)
    if make is _ScaledOutside:  # each layer's output, freed as its backward begins
        assert found == {(i, (0,)) for i in range(n)}
    else:  # the first attention's values: freed in the second's backward, after the MLP's
        assert found == {(0, (1,))}


def test_options_are_derived_where_forward_and_recompute_meet_other_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Blocks the allocator does not split ]: on CUDA which cached block a large
    # output meets depends on the steps before, so an op's forward output and its
    # recompute's copy can count other remainders. A probe that stands in for that (every
    # forward output over 1 MiB handed a block 256 KiB larger, recompute's exact) must
    # leave the options derived (they were all measured, one step each, on an H200), and
    # each derived option equal to a step that runs it under the same stand-in.
    from test_memory import WholeBlockProbe

    class ForwardOnly(WholeBlockProbe):
        def after(self) -> tuple[int, int]:
            frame = sys._getframe(1).f_locals  # the tracker's, as WholeBlockProbe reads it
            out = frame["out"] if isinstance(frame["out"], torch.Tensor) else None
            made = 0 if out is None else out.untyped_storage().nbytes()
            large = made > CUDA_SMALL_BYTES and frame["func"]._overloadpacket.__name__ \
                != "view" and torch._C._current_graph_task_id() == -1  # not in backward
            self.large += large
            return 0, made + (self.extra if large else 0)

    probe = ForwardOnly(256 * 1024)
    probe.large = 0
    monkeypatch.setattr(memory_module, "allocator_probe", lambda: probe)
    model, inputs, loss_fn = _zoo_case("gpt2", n_layer=2, n_embd=256, n_head=4, seq_len=256,
                                       batch_size=4)()
    found = check_derived_options(model, inputs, loss_fn, monkeypatch)
    assert probe.large > 0 and found and all(found.values()), found


class _DroppedBranches(nn.Module):
    """Blocks beside a branch whose output the model drops (a pooling head it never
    reads, as PaliGemma's SigLIP has): softmax saves its output for backward."""

    def __init__(self, width: int = 32, n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.side = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh())
                                    for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        self.side(h).softmax(-1)  # built and dropped
        for block in self.blocks:
            h = block(h)
        return h.pow(2).mean()


def test_a_graph_the_forward_drops_is_freed_when_dropped_in_the_measured_step() -> None:
    # NOTE [ A pack hook keeps an alias ]: the recorder's pack hook returned the saved
    # tensor itself, a cycle with its grad_fn, so the dropped softmax stayed until Python's
    # cycle collector and the tape's plain step measured it over the user's (PaliGemma:
    # 13 KiB over in every plan)
    torch.manual_seed(0)
    model, x = _DroppedBranches(), torch.randn(64, 32)
    tape = autoremat.profile(model, x, timing=False, with_head=False)
    for strategy in ("none", "full"):
        plan = autoremat.plan(tape, strategy=strategy)
        report = verified(model, x, plan, repeats=1)
        assert report.peak_bytes == plan.predicted_peak_bytes, strategy


def _chained_after(reuse: bool) -> tuple[bool, bool]:
    """Whether the probe marks the second of two blocks chained when it is given the
    first one's output (``reuse`` False) or, that output dropped, a new tensor made at
    its Python object's address; and whether the tensor given is at that address."""
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    probe = _Probe(["a", "b"], on_mark=lambda label: None)
    x = torch.randn(2, 4)
    probe._pre(0)(a, (x,), {})
    out = a(x)
    probe._post(0)(a, (x,), out)
    gone, made = id(out), []
    if reuse:
        del out
        for _ in range(10_000):  # CPython gives a freed object's memory to the next one
            out = torch.zeros(1)
            if id(out) == gone:
                break
            made.append(out)
    probe._pre(1)(b, (out,), {})
    return probe.chained[1], id(out) == gone


def test_a_tensor_at_the_address_of_the_block_befores_dropped_output_is_not_chained() -> None:
    # NOTE [ The block before's output, by identity ]: timm's Visformer's stages were
    # marked chained in two profiles of three, and a plan joining them failed in its
    # forward ("does not take the previous block's output")
    assert _chained_after(reuse=False)[0]
    assert _chained_after(reuse=True) == (False, True)


class _BranchReturned(nn.Module):
    """Two blocks on one input, the second returning it: the backward reaches the second
    block's output (the stem's) only after the first block's (NOTE [ Blocks whose
    backwards do not run in reverse ]), as HRNet's side-by-side branches found as its
    chain do."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Identity()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return (self.blocks[0](h) * self.blocks[1](h)).sum()


def test_blocks_whose_backwards_run_out_of_order_are_refused_as_no_chain() -> None:
    # a bare "ValueError: max() arg is an empty sequence" before (timm's HRNet)
    with pytest.raises(BlockError, match=r"reached the output of block 'blocks\.1' after "
                                         r"that of block 'blocks\.0'.*Give blocks=\[\.\.\.\]"):
        autoremat.profile(_BranchReturned(), torch.randn(4, 8),
                          blocks=["blocks.0", "blocks.1"], timing=False)


def _segment_plan_peaks(model: nn.Module, x: torch.Tensor, tape: Tape,
                         loss: Callable[[Any], torch.Tensor] | None = None
                         ) -> Iterator[tuple[int, int, Choice, int, int]]:
    """Every plan of :func:`_one_segment_plans` whose segment's blocks chain, run once:
    ``(start, stop, the others' choice, predicted, measured)``."""
    for rest, a, b, segments in _one_segment_plans(len(tape.blocks)):
        if all(tape.blocks[j].chained for j in range(a + 1, b)):
            yield (a, b, rest, *segments_peaks(model, x, tape, segments, loss))


class _PoolHead(nn.Module):
    """Mean over the sequence, then a linear layer: saves only the pooled input."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(1))


def test_no_segment_runs_across_a_block_that_returns_its_input() -> None:
    # NOTE [ After a block that returns its input ]: timm's RegNet (stages, an Identity,
    # a pooling head): segments from a stage through the Identity to the head measured
    # one stage output over their predictions
    torch.manual_seed(0)
    model = nn.Sequential(ResidualMlp(16), ResidualMlp(16), ResidualMlp(16), nn.Identity(),
                          _PoolHead(16))
    x = torch.randn(4, 32, 16)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.square().mean()

    tape = autoremat.profile(model, x, loss, timing=False)
    assert [b.chained for b in tape.blocks] == [False, True, True, True, False]
    for a, b, rest, predicted, measured in _segment_plan_peaks(model, x, tape, loss):
        # never under; over by at most one activation (a segment ending in the Identity
        # is counted holding its input once more: 8 KiB over, on the safe side)
        assert measured <= predicted <= measured + x.nelement() * 4, (a, b, rest)


class _PoolThenDense(nn.Module):
    """A first block, then dense layers each taking the list of every feature so far
    (timm's DenseNet: ``pool0``, then a dense block): the first block's output is the
    first dense layer's input, and every later one's. With ``transition``, a block after
    them takes their sum, and the model lets go of the list in its forward window."""

    def __init__(self, d: int = 32, n: int = 4, transition: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.GELU())]
                                    + [DenseLayer(d) for _ in range(n)]
                                    + ([nn.Sequential(nn.Linear(d, d), nn.GELU())]
                                       if transition else []))
        self.transition = transition

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = list(self.blocks)
        if self.transition:
            return layers[-1](self._dense(layers[0](x), layers[1:-1])).pow(2).mean()
        features = [layers[0](x)]
        for block in layers[1:]:
            features.append(block(features))
        return torch.stack(features).pow(2).mean()

    @staticmethod
    def _dense(x: torch.Tensor, layers: list[nn.Module]) -> torch.Tensor:
        features = [x]  # let go of when this returns, in the last dense layer's window
        for block in layers:
            features.append(block(features))
        return torch.stack(features).sum(0)


def test_an_input_later_blocks_take_too_is_not_credited_as_freed() -> None:
    # NOTE [ An input later blocks take too ]: a segment of the first two blocks, the
    # dense layers after it checkpointed, measured the first block's output held by
    # their checkpoints, over its prediction (DenseNet-121: 88,064 B)
    # (without the transition, where the model lets go of the list when it returns, a
    # plan recomputing one later dense layer alone, the rest kept, is one feature map
    # under: docs/limitations.md, not fixed)
    torch.manual_seed(0)
    model, x = _PoolThenDense(transition=True), torch.randn(64, 32)
    tape = autoremat.profile(model, x, timing=False)
    for a, b, rest, predicted, measured in _segment_plan_peaks(model, x, tape):
        # never under; over by at most two feature maps (held by the later layers'
        # checkpoints from where the model lets go of the list)
        assert measured <= predicted <= measured + 2 * x.nelement() * 4, (
            a, b, rest, predicted, measured)
