"""RNG replay on every recompute path (NOTE [ Replaying the forward's RNG ] in rng.py).

On CUDA two kinds of draw went wrong in recompute: draws from a generator checkpoint did
not stash (a CUDA device's, in multi-block segments) and draws inside a kernel the
selective modes keep or skip (SDPA's ``dropout_p``), which shift the stream of every
random op after them. Both are reproduced here on the CPU, device-agnostically:

* a *device generator* is stood in for by an extra CPU ``torch.Generator`` the blocks
  draw from, listed by ``rng.generators`` as a CUDA device's generator would be;
* a *kernel that draws inside* is a custom op, tagged ``nondeterministic_seeded`` like
  PyTorch's fused attention kernels, whose implementation draws below the dispatcher.

Every plan's gradients must be ``torch.equal`` to the plain model's; and each test also
shows the check can fail (the generator left out, the tag ignored).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoremat
from autoremat._core import rng
from autoremat._core.decisions import KEEP, RECOMPUTE, Choice
from autoremat._mechanism.selective import _op_info
from autoremat._plan.plan import plan_of_segments


def _sel(key: str) -> Choice:
    return Choice.selective_from_key(key)

# --- a kernel that draws inside: a fused "attention" with dropout ------------------------


@torch.library.custom_op("autoremat_test::flash_attention_like", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def _fused(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    mask = (torch.rand_like(x) >= p).to(x.dtype)  # drawn inside: no op the modes see
    return x.tanh() * mask / (1 - p), mask


@_fused.register_fake
def _(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def _fused_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, p = inputs
    ctx.save_for_backward(x, output[1])
    ctx.p = p


def _fused_backward(ctx: Any, grad: torch.Tensor, _grad_mask: Any) -> tuple[Any, None]:
    x, mask = ctx.saved_tensors
    return grad * mask / (1 - ctx.p) * (1 - x.tanh() ** 2), None


_fused.register_autograd(_fused_backward, setup_context=_fused_setup)


# --- a model whose blocks draw in every way -----------------------------------------------


class _Block(nn.Module):
    def __init__(self, width: int, device_gen: torch.Generator) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.device_gen = device_gen

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, W)
        h = F.dropout(self.fc1(x), 0.3, self.training)  # bernoulli_ (kept as bits)
        h = torch.ops.autoremat_test.flash_attention_like(h, 0.2)[0]  # draws inside
        h = h * (torch.rand_like(h) >= 0.25)  # a random op recompute re-runs
        noise = torch.rand(h.shape, generator=self.device_gen)  # the "device" generator
        return x + self.fc2(h * (noise >= 0.1))


class _Net(nn.Module):
    def __init__(self, n: int = 4, width: int = 24) -> None:
        super().__init__()
        self.device_gen = torch.Generator()
        self.blocks = nn.ModuleList(_Block(width, self.device_gen) for _ in range(n))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


@pytest.fixture
def device_generator(monkeypatch: pytest.MonkeyPatch) -> Iterator[torch.Generator]:
    """A generator ``rng.generators`` lists beside the CPU's, as a CUDA device's is."""
    gen = torch.Generator()
    original = rng.generators
    monkeypatch.setattr(rng, "generators", lambda: [*original(), gen])
    yield gen


def _grads(model: _Net, x: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(11)
    model.device_gen.manual_seed(5)
    model.zero_grad(set_to_none=True)
    model(x).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _model_and_tape(device_gen: torch.Generator) -> tuple[_Net, torch.Tensor, Any]:
    torch.manual_seed(0)
    model = _Net()
    model.device_gen = device_gen
    for block in model.blocks:
        block.device_gen = device_gen
    x = torch.randn(16, 24, requires_grad=True)
    return model, x, autoremat.profile(model, x, repeats=1)


# Segments of (start, stop, option): per block, one segment of all, pairs, selective ones.
_LAYOUTS: dict[str, Any] = {
    "full": [(i, i + 1, RECOMPUTE) for i in range(4)],
    "one segment": [(0, 4, RECOMPUTE)],
    "pairs": [(0, 2, RECOMPUTE), (2, 4, RECOMPUTE)],
    "keep + segment": [(0, 1, KEEP), (1, 4, RECOMPUTE)],
}


def test_every_recompute_path_replays_every_generator(device_generator):  # type: ignore[no-untyped-def]
    model, x, tape = _model_and_tape(device_generator)
    plain = _grads(model, x)
    layouts = dict(_LAYOUTS)
    for i, block in enumerate(tape.blocks):  # every selective option each block has
        for key in block.selective:
            layouts[f"block {i} {key}"] = [(j, j + 1, _sel(key) if j == i else RECOMPUTE)
                                           for j in range(4)]
    assert any(k.split()[-1].startswith("#") for k in layouts)  # keep-sets are among them
    _assert_every_layout_exact(model, x, tape, layouts, plain)


def _assert_every_layout_exact(model: _Net, x: torch.Tensor, tape: Any,
                               layouts: dict[str, Any], plain: list[torch.Tensor]) -> None:
    for name, segments in layouts.items():
        autoremat.apply(model, plan_of_segments(tape, segments, name))
        try:
            assert _equal(_grads(model, x), plain), name
        finally:
            autoremat.remove(model)


def test_a_generator_left_out_is_redrawn_so_the_check_can_fail(monkeypatch):  # type: ignore[no-untyped-def]
    # The bug this replaces: a generator nobody stashes (CUDA's, in a segment) re-draws.
    # (A module's own generator attribute is now replayed too: hide it from that.)
    monkeypatch.setattr(rng, "generator_slots", lambda modules: [])
    gen = torch.Generator()
    model = _Net()
    model.device_gen = gen
    for block in model.blocks:
        block.device_gen = gen
    x = torch.randn(16, 24, requires_grad=True)
    plain = _grads(model, x)
    tape = autoremat.profile(model, x, repeats=1, with_selective=False)
    autoremat.apply(model, plan_of_segments(tape, [(0, 4, RECOMPUTE)], "segment"))
    try:
        assert not _equal(_grads(model, x), plain)  # gen is not in rng.generators()
    finally:
        autoremat.remove(model)


def test_the_fused_op_is_seen_as_drawing_but_stays_keepable() -> None:
    op = torch.ops.autoremat_test.flash_attention_like.default
    kind, random, draws = _op_info(op)
    assert (kind, random, draws) == ("attention", False, True)


def test_a_kernel_that_draws_inside_is_replayed_by_its_tag(  # type: ignore[no-untyped-def]
        monkeypatch, device_generator):
    # The fused op re-runs in recompute after a dropout whose draw is copied back (no
    # numbers drawn): without its own RNG states it would draw from where the stream
    # was before that dropout. Ignoring the tag shows the check can fail.
    from autoremat._mechanism import selective

    model, x, tape = _model_and_tape(device_generator)
    plain = _grads(model, x)
    rerun = [k for k in tape.blocks[0].selective
             if not k.startswith("#") and "attention" not in k.split("+")]
    assert rerun, tape.blocks[0].selective.keys()
    segments = [(0, 1, _sel(rerun[0]))] + [(j, j + 1, RECOMPUTE) for j in range(1, 4)]
    autoremat.apply(model, plan_of_segments(tape, segments, "selective"))
    cached = selective._op_info
    try:
        assert _equal(_grads(model, x), plain)

        def untagged(func: Any) -> tuple[str | None, bool, bool]:
            kind, random, _ = cached(func)
            return kind, random, random
        monkeypatch.setattr(selective, "_op_info", untagged)
        assert not _equal(_grads(model, x), plain)
    finally:
        autoremat.remove(model)


def test_every_path_replays_under_autocast(device_generator):  # type: ignore[no-untyped-def]
    model, x, tape = _model_and_tape(device_generator)
    layouts = dict(_LAYOUTS, selective=[(i, i + 1, _sel(sorted(b.selective)[0]))
                                        for i, b in enumerate(tape.blocks)])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_every_layout_exact(model, x, tape, layouts, _grads(model, x))


def test_replaying_restores_states_and_leaves_the_stream_as_it_was() -> None:
    gen = torch.Generator().manual_seed(3)
    start = rng.snapshot([torch.default_generator, gen])
    first = (torch.rand(4), torch.rand(4, generator=gen))
    after = (torch.rand(4), torch.rand(4, generator=gen))
    rng.snapshot([torch.default_generator, gen]).restore()  # (no-op: the states now)
    start_after = rng.snapshot([torch.default_generator, gen])
    with pytest.raises(RuntimeError, match="stop"), rng.replaying(start):
        again = (torch.rand(4), torch.rand(4, generator=gen))
        raise RuntimeError("stop")  # an early stop of recompute: states still restored
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    now = rng.snapshot([torch.default_generator, gen])
    for (_, a), (_, b) in zip(now.states, start_after.states, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(after[0], first[0])


def test_generators_lists_each_initialised_cuda_device(monkeypatch):  # type: ignore[no-untyped-def]
    fake = (torch.Generator(), torch.Generator())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "default_generators", fake)
    assert rng.generators() == [torch.default_generator, *fake]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert rng.generators() == [torch.default_generator]  # never initialises CUDA
