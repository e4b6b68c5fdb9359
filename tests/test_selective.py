"""The selective-recompute mechanism: kept outputs, kept Bernoulli draws, and fallbacks.

Every test compares gradients with ``torch.equal`` against the same function run without
checkpointing, under the same seed (dropout on).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import autoremat
from autoremat import Decision, RematError, Tape, zoo
from autoremat._core.decisions import KEEP, Choice
from autoremat._core.saves import op_signature, save_set_name, save_set_of, save_sets
from autoremat._mechanism.selective import selective_context
from autoremat._mechanism.wrap import ContextFn
from autoremat._plan.peak import predict_peak

from conftest import SMALL


class _CountOps(TorchDispatchMode):
    """Counts ops by name, split into forward and backward (recompute included)."""

    def __init__(self) -> None:
        super().__init__()
        self.backward: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if torch._C._current_graph_task_id() != -1:
            name = func.__name__
            self.backward[name] = self.backward.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _grads(fn: Callable[[torch.Tensor], torch.Tensor], params: list[torch.Tensor],
           save: tuple[str, ...] | ContextFn | None,
           seed: int = 0) -> tuple[list[torch.Tensor], _CountOps]:
    torch.manual_seed(seed)
    x = torch.randn(6, 16, requires_grad=True)
    for p in params:
        p.grad = None
    counter = _CountOps()
    with counter:
        if save is None:
            out = fn(x)
        else:
            context = save if callable(save) else selective_context(save)
            out = checkpoint(fn, x, use_reentrant=False, context_fn=context)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [x.grad] + [p.grad for p in params]
    return [g.clone() for g in grads if g is not None], counter


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for ga, gb in zip(a, b, strict=True):
        assert torch.equal(ga, gb)


@pytest.fixture()
def mlp() -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(123)
    fc1, fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
    ln = torch.nn.LayerNorm(32)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.dropout(torch.nn.functional.gelu(ln(fc1(x))), 0.3, True)
        return torch.nn.functional.dropout(fc2(h), 0.2, True)

    return fn, [*fc1.parameters(), *fc2.parameters(), *ln.parameters()]


@pytest.mark.parametrize("save", [(), ("matmul",), ("matmul", "bmm")])
def test_gradients_equal_and_dropout_is_not_drawn_again(mlp, save):  # type: ignore[no-untyped-def]
    fn, params = mlp
    plain, _ = _grads(fn, params, None)
    sel, counter = _grads(fn, params, save)
    _assert_same(plain, sel)
    # The CPU dropout draws with bernoulli_; selective recompute copies the kept draws back.
    assert counter.backward.get("bernoulli_.float", 0) == 0
    # Linear's forward is addmm, its backward mm: an addmm in backward is a re-run.
    assert counter.backward.get("addmm.default", 0) == (0 if "matmul" in save else 2)


def test_whole_block_checkpoint_draws_again_for_reference(mlp):  # type: ignore[no-untyped-def]
    # The counter can see a re-draw: plain checkpointing replays both dropouts.
    fn, _ = mlp
    torch.manual_seed(0)
    x = torch.randn(6, 16, requires_grad=True)
    counter = _CountOps()
    with counter:
        checkpoint(fn, x, use_reentrant=False).sum().backward()
    assert counter.backward["bernoulli_.float"] == 2


def test_other_random_ops_replay_the_rng_and_stay_exact() -> None:
    # torch.rand after a dropout: the kept Bernoulli draw consumes no random numbers in
    # recompute, so rand replays from the RNG states noted just before it in forward.
    torch.manual_seed(7)
    lin = torch.nn.Linear(16, 16)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.dropout(lin(x), 0.5, True)
        return h * torch.rand_like(h) + torch.nn.functional.dropout(h.tanh(), 0.5, True)

    plain, _ = _grads(fn, list(lin.parameters()), None)
    sel, counter = _grads(fn, list(lin.parameters()), ("matmul",))
    _assert_same(plain, sel)
    assert counter.backward.get("bernoulli_.float", 0) == 0  # copied back, not drawn
    assert counter.backward["rand_like.default"] == 1  # replayed from its own states


def test_a_kept_output_changed_in_place_later_is_recomputed() -> None:
    torch.manual_seed(3)
    lin = torch.nn.Linear(16, 16)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = lin(x)  # kept (matmul) ...
        g = h.sigmoid()  # ... saved by sigmoid's backward through its output
        h.mul_(2.0)  # ... then changed in place: the kept copy is stale
        return g * h

    plain, _ = _grads(fn, list(lin.parameters()), None)
    sel, _ = _grads(fn, list(lin.parameters()), ("matmul",))
    _assert_same(plain, sel)


def test_retain_graph_allows_a_second_backward() -> None:
    torch.manual_seed(5)
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    out = checkpoint(lambda t: torch.dropout(lin(t).relu(), 0.5, True), x,
                     use_reentrant=False, context_fn=selective_context(["matmul"]))
    out.sum().backward(retain_graph=True)
    first = x.grad.clone()
    out.sum().backward()
    assert torch.equal(x.grad, 2 * first)


def test_unknown_kinds_are_refused() -> None:
    with pytest.raises(RematError, match=r"cannot save op kinds \['softmax'\]"):
        selective_context(["matmul", "softmax"])


def test_save_sets_are_the_non_empty_subsets_of_present_compute_kinds() -> None:
    assert save_sets(["matmul", "softmax", "bmm"]) == [("bmm", "matmul"), ("bmm",), ("matmul",)]
    assert save_sets(["softmax", "norm"]) == []


def test_blocks_with_dropout_also_get_the_empty_save_set() -> None:
    assert save_sets(["matmul", "dropout", "pointwise"]) == [("matmul",), ()]
    assert save_set_of(save_set_name(())) == ()
    assert save_set_of(save_set_name(("matmul", "bmm"))) == ("bmm", "matmul")


def test_plans_with_the_empty_save_set_apply_exactly_and_print(
        zoo_tapes: Callable[..., Tape]) -> None:
    model, inputs = zoo.build("gpt2", **SMALL["gpt2"])
    tape = zoo_tapes("gpt2", **SMALL["gpt2"])  # measured on a model built the same way
    assert all("" in b.selective for b in tape.blocks)
    base = autoremat.plan(tape, strategy="full")
    blocks = tuple(dataclasses.replace(b, decision=Decision.SELECTIVE, save_ops=())
                   for b in base.blocks)
    options = [(i, i + 1, Choice(Decision.SELECTIVE)) for i in range(len(blocks))]
    plan = dataclasses.replace(base, blocks=blocks,
                               predicted_peak_bytes=predict_peak(tape, options))
    assert "recompute all ops, keep the random draws" in str(plan)
    assert autoremat.Plan.from_json(plan.to_json()).blocks[0].save_ops == ()
    report = autoremat.verify(model, inputs, plan, repeats=1)
    assert report.grads_equal
    assert report.peak_bytes == report.predicted_peak_bytes


def test_print_plan_says_what_each_selective_block_saves_and_recomputes(
        zoo_tapes: Callable[..., Tape]) -> None:
    tape = zoo_tapes("gpt2", **SMALL["gpt2"])
    plan = autoremat.plan(tape, strategy="selective")
    for block, stats in zip(plan.blocks, (b.op_stats for b in tape.blocks), strict=True):
        assert block.save_ops == ("matmul",)  # gpt2's SDPA on CPU with dropout is bmm-based
        assert set(block.recompute_ops) == {k for k, s in stats.items() if s.count} - {"matmul"}
        assert "dropout" in block.recompute_ops and "softmax" in block.recompute_ops
    text = str(plan)
    assert "save matmul outputs; recompute bmm, copy, dropout" in text
    assert autoremat.Plan.from_json(plan.to_json()) == plan


class _OddBlock(torch.nn.Module):
    """In-place ops on matmul outputs, a non-Bernoulli random op, BatchNorm, kwargs."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.fc2 = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.act, self.bn = torch.nn.ReLU(inplace=True), torch.nn.BatchNorm1d(d)

    def forward(self, x: torch.Tensor, scale: float = 1.0, *,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.nn.functional.dropout(self.act(self.fc(x)), 0.3, True)  # relu_ on a kept output
        h = self.bn(h + 0.01 * torch.rand_like(h))
        h2 = self.fc2(h)
        h2.mul_(scale)  # changes a kept output in place
        return x + (h2 if bias is None else h2 + bias)


class _OddNet(torch.nn.Module):
    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_OddBlock(d) for _ in range(n))
        self.head = torch.nn.Linear(d, 3)
        self.blocks[2].fc2.weight = self.blocks[1].fc2.weight  # tied across blocks
        for p in self.blocks[3].fc.parameters():
            p.requires_grad_(False)  # frozen

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        bias = torch.ones(x.shape[-1])
        for block in self.blocks:
            x = block(x, 0.5, bias=bias)
        return torch.nn.functional.cross_entropy(self.head(x), y)


def test_odd_blocks_are_exact_and_predicted_under_every_save_set() -> None:
    import autoremat
    from autoremat._core.saves import is_keep_set
    from autoremat._plan.plan import plan_of_segments

    torch.manual_seed(0)
    model = _OddNet()
    inputs = {"x": torch.randn(16, 32), "y": torch.randint(0, 3, (16,))}
    tape = autoremat.profile(model, inputs, loss_fn=lambda out: out, repeats=1)
    names = set.intersection(*(set(b.selective) for b in tape.blocks))
    assert {"", "matmul"} < names and all(is_keep_set(n) for n in names - {"", "matmul"})
    for name in sorted(names):
        options = [(i, i + 1, Choice.selective_from_key(name))
                   for i in range(len(tape.blocks))]
        plan = plan_of_segments(tape, options, f"selective:{name}")
        autoremat.apply(model, plan)
        report = autoremat.verify(model, inputs, loss_fn=lambda out: out, repeats=1)
        autoremat.remove(model)
        assert report.grads_equal, name
        assert report.peak_bytes == report.predicted_peak_bytes, name
        assert report.recompute_flops == plan.predicted_recompute_flops, name


def _watched(save: list[str]) -> tuple[ContextFn, list[Any]]:
    """A ``context_fn`` keeping the outputs of ``save``, and the forward modes it made
    (their ``kept`` holds what each call kept)."""
    seen: list[Any] = []

    def contexts():  # type: ignore[no-untyped-def]
        keep, reuse = selective_context(save)()
        seen.append(keep)
        return keep, reuse

    return contexts, seen


def test_kept_outputs_changed_in_place_in_forward_are_freed_when_it_ends() -> None:
    lin = torch.nn.Linear(16, 16)
    contexts, seen = _watched(["matmul"])

    def fn(x: torch.Tensor) -> torch.Tensor:
        a = lin(x)  # kept, then changed in place: its copy is stale
        a.mul_(2.0)
        b = lin(a.tanh())  # kept and unchanged
        return (a * b).sum()

    x = torch.randn(4, 16, requires_grad=True)
    out = checkpoint(fn, x, use_reentrant=False, context_fn=contexts)
    entries = seen[0].kept.entries[torch.ops.aten.addmm.default]
    assert entries[0] is None and entries[1] is not None
    out.backward()
    assert x.grad is not None



def test_outputs_kept_by_position_and_changed_in_forward_are_freed_too() -> None:
    from autoremat._mechanism.selective import _KeepOutputs

    torch.manual_seed(4)
    w = torch.randn(16, 16, requires_grad=True)
    ops = ["aten.mm.default", "aten.mul_.Tensor", "aten.tanh.default", "aten.mm.default",
           "aten.mul.Tensor", "aten.sum.default"]
    seen: list[_KeepOutputs] = []

    def contexts():  # type: ignore[no-untyped-def]
        keep, reuse = selective_context(keep_ops=(0, 3), skip_ops=(2,),
                                        signature=op_signature(ops))()
        seen.append(keep)
        return keep, reuse

    def fn(x: torch.Tensor) -> torch.Tensor:
        a = x @ w  # kept by position, then changed in place: its copy is stale
        a.mul_(2.0)
        b = a.tanh() @ w  # kept and unchanged
        return (a * b).sum()

    x = torch.randn(4, 16, requires_grad=True)
    plain = torch.autograd.grad(fn(x), [x, w])
    out = checkpoint(fn, x, use_reentrant=False, context_fn=contexts)
    kept = seen[0].kept
    assert sorted(kept.kept_at) == [3]  # no reference left to the stale copy
    assert kept.entries[torch.ops.aten.mm.default][0] is None
    assert not kept.skip  # re-running op 0 would need real inputs
    _assert_same(list(plain), list(torch.autograd.grad(out, [x, w])))

def test_a_kept_output_written_through_unsafe_chunk_pieces_is_recomputed() -> None:
    # unsafe_chunk's pieces share the matmul output's storage but not its version
    # counter: only the storage says the kept copy was changed (NOTE [ Writes through
    # unsafe pieces ]); handing it back wrote sigmoid_/tanh_ a second time
    torch.manual_seed(8)
    lin = torch.nn.Linear(16, 32)
    contexts, seen = _watched(["matmul"])

    def fn(x: torch.Tensor) -> torch.Tensor:
        a, b = lin(x).unsafe_chunk(2, -1)  # (6, 16) each, one storage
        a.sigmoid_()
        b.tanh_()
        return x + a * b

    plain, _ = _grads(fn, list(lin.parameters()), None)
    sel, counter = _grads(fn, list(lin.parameters()), contexts)
    _assert_same(plain, sel)
    assert seen[0].kept.entries[torch.ops.aten.addmm.default] == [None]  # freed in forward
    assert counter.backward["addmm.default"] == 1  # re-run, not handed back


class _GRUStack(torch.nn.Module):
    """CPU ``nn.GRU`` changes its gate matmuls in place through ``unsafe_split`` pieces."""

    def __init__(self, d: int = 16, n: int = 2) -> None:
        super().__init__()
        self.rnns = torch.nn.ModuleList(torch.nn.GRU(d, d, batch_first=True) for _ in range(n))
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, d)
        for rnn in self.rnns:
            x, _ = rnn(x)
        return self.head(x)


def test_gru_is_exact_and_predicted_under_every_selective_option() -> None:
    from autoremat._plan.plan import plan_of_segments

    torch.manual_seed(0)
    model, x = _GRUStack(), torch.randn(2, 5, 16)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.square().sum()

    tape = autoremat.profile(model, x, loss_fn=loss_fn, repeats=1)
    names = set.intersection(*(set(b.selective) for b in tape.blocks))
    assert "matmul" in names
    plans = [autoremat.plan(tape, strategy="selective")]
    plans += [plan_of_segments(tape, [(i, i + 1, Choice.selective_from_key(name))
                                      for i in range(len(tape.blocks))], f"selective:{name}")
              for name in sorted(names)]
    for plan in plans:
        autoremat.apply(model, plan)
        report = autoremat.verify(model, x, loss_fn=loss_fn, repeats=1)
        autoremat.remove(model)
        assert report.grads_equal, (plan.strategy, report.max_grad_diff)
        assert report.peak_bytes == report.predicted_peak_bytes, plan.strategy
        assert report.recompute_flops == plan.predicted_recompute_flops, plan.strategy


# --- keep-sets by position, and dead ops (NOTE [ Dead ops ]) --------------------------------

_CORE_OPS = ["aten.mm.default", "aten._softmax.default", "aten.empty_like.default",
             "aten.bernoulli_.float", "aten.div_.Scalar", "aten.mul.Tensor", "aten.mm.default"]


@pytest.fixture()
def core() -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor]]:
    """mm -> softmax -> dropout -> mm: the ops of _CORE_OPS, in that order."""
    torch.manual_seed(11)
    w1, w2 = torch.randn(16, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(x @ w1, -1)
        return torch.nn.functional.dropout(p, 0.3, True) @ w2

    return fn, [w1, w2]


def test_a_kept_softmax_makes_the_matmuls_around_it_dead(core) -> None:  # type: ignore[no-untyped-def]
    fn, params = core
    plain, _ = _grads(fn, params, None)
    every, all_ops = _grads(fn, params, ())
    # keep the softmax output: the first mm only computed it, so it is not run again
    # (the last mm only makes the output: checkpoint's early stop spares it anyway); the
    # draw is copied back, not drawn
    dead = selective_context(keep_ops=(1,), skip_ops=(0, 6), signature=op_signature(_CORE_OPS))
    kept, counter = _grads(fn, params, dead)
    _assert_same(plain, every)
    _assert_same(plain, kept)
    assert counter.backward["mm.default"] == all_ops.backward["mm.default"] - 1
    assert "_softmax.default" not in counter.backward
    assert "bernoulli_.float" not in counter.backward


def test_a_keep_set_for_other_ops_falls_back_to_recomputing_everything(core) -> None:  # type: ignore[no-untyped-def]
    fn, params = core
    plain, _ = _grads(fn, params, None)
    wrong = selective_context(keep_ops=(1,), skip_ops=(0, 6), signature="0" * 16,
                              label="blocks.3")
    with pytest.warns(UserWarning, match="selective block 'blocks.3' ran a different "
                                         "sequence of ops than when it was profiled"):
        got, counter = _grads(fn, params, wrong)
    _assert_same(plain, got)
    assert counter.backward["_softmax.default"] == 1  # recomputed: nothing kept by position


def test_recompute_that_runs_other_ops_than_forward_raises() -> None:
    torch.manual_seed(2)
    w = torch.randn(16, 16, requires_grad=True)
    calls = [0]

    def fn(x: torch.Tensor) -> torch.Tensor:  # forward and recompute take different paths
        calls[0] += 1
        h = x @ w
        return (h.relu() if calls[0] == 1 else h.sigmoid()) * 2

    ops = ["aten.mm.default", "aten.relu.default", "aten.mul.Tensor"]
    context = selective_context(keep_ops=(), skip_ops=(2,), signature=op_signature(ops))
    with pytest.raises(RematError, match=r"ran aten.sigmoid.default as op 1 of the block, "
                                         r"where its forward ran aten.relu.default"):
        _grads(fn, [w], context)


def test_a_kept_output_changed_in_place_after_forward_turns_skipping_off() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = x + 1  # dead while `a` is kept ...
        a = t * 2  # ... kept by position and returned ...
        b = a.sigmoid()
        a.add_(1)  # ... but changed in place: recompute must rebuild it from real `t`
        return b * a

    ops = ["aten.add.Tensor", "aten.mul.Tensor", "aten.sigmoid.default", "aten.add_.Tensor",
           "aten.mul.Tensor"]
    plain, _ = _grads(fn, [], None)
    got, counter = _grads(fn, [], selective_context(keep_ops=(1,), skip_ops=(0,),
                                                    signature=op_signature(ops)))
    _assert_same(plain, got)
    assert counter.backward["add.Tensor"] >= 1  # the skipped op ran after all


def test_keep_sets_need_a_signature_and_cannot_also_skip_a_kept_op() -> None:
    with pytest.raises(RematError, match="needs the signature"):
        selective_context(keep_ops=(1,))
    with pytest.raises(RematError, match=r"op positions \[1\] are both kept and skipped"):
        selective_context(keep_ops=(1,), skip_ops=(1,), signature="x")


def test_kept_outputs_are_handed_back_as_fresh_aliases() -> None:
    """Recompute hands back an alias of each kept output, so the recompute's graph is not
    hung on the kept object (which lives to the end of the region's backward) and what
    that graph saved is freed as backward goes: the tensors recompute made die before
    the kept outputs do."""
    from autoremat._measure.memory import track_memory

    torch.manual_seed(5)
    fc1, fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
    contexts, seen = _watched(["matmul"])

    def fn(x: torch.Tensor) -> torch.Tensor:
        return fc2(torch.tanh(fc1(x)).exp())

    x = torch.randn(32, 16, requires_grad=True)
    with track_memory() as mem:
        out = checkpoint(fn, x, use_reentrant=False, context_fn=contexts)
        mem.mark("backward")
        out.sum().backward()
    kept = [e[0] for entries in seen[0].kept.entries.values() for e in entries if e is not None]
    assert len(kept) == 2 and all(t.grad_fn is None for t in kept)
    start = dict((label, event) for event, label in mem.marks)["backward"]
    recomputed = [r for r in mem.records if r.born > start and r.op == "aten.tanh.default"]
    assert len(recomputed) == 1 and recomputed[0].died is not None
    # the recomputed tanh output is freed once exp's backward has run, before the end of
    # the step (it used to live until the kept outputs went, when the frame was freed)
    assert recomputed[0].died < len(mem.levels) - 2


class _HookedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_HookedLayer() for _ in range(3))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


def test_a_block_with_a_full_backward_hook_keeps_its_keep_sets() -> None:
    # NOTE [ A block with a full backward hook ] in _measure/ops.py: torch wraps the
    # block's input in a view before its forward, which the profile recorded as the
    # block's first op; every keep-set of the block then fell back to recomputing the
    # whole block ("ran a different sequence of ops") and ran slower than its figure
    from autoremat._core.saves import is_keep_set
    from autoremat._plan.plan import plan_of_segments

    torch.manual_seed(0)
    model, x = _Hooked(), torch.randn(8, 16, 32)
    calls = []
    model.layers[1].register_full_backward_hook(lambda *_: calls.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback's warning, among others
        tape = autoremat.profile(model, x, repeats=1, timing=False)
        assert [o.op for o in tape.blocks[1].ops] == [o.op for o in tape.blocks[0].ops]
        keep_sets = sorted(n for n in tape.blocks[1].selective if is_keep_set(n))
        assert keep_sets
        for name in keep_sets:
            plan = plan_of_segments(tape, [(0, 1, KEEP), (1, 2, Choice.selective_from_key(
                name)), (2, 3, KEEP)], f"selective:{name}")
            autoremat.apply(model, plan)
            del calls[:]
            report = autoremat.verify(model, x, repeats=1)
            autoremat.remove(model)
            assert report.grads_equal and calls, name
            assert report.peak_bytes == report.predicted_peak_bytes, name
            assert report.recompute_flops == plan.predicted_recompute_flops, name


class _SharingBlock(nn.Module):
    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.shared, self.fc = shared, nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(torch.relu(self.shared(x)))


class _Sharing(nn.Module):
    """Blocks 0 and 2 call one Linear (weights shared by reuse), block 1 its own."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(16, 16)
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([_SharingBlock(shared), _SharingBlock(nn.Linear(16, 16)),
                                     _SharingBlock(shared)])
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).float().pow(2).mean()


@pytest.mark.parametrize("inside", [True, False], ids=["backward-in-autocast", "outside"])
def test_keep_sets_of_blocks_sharing_a_layer_under_autocast(inside: bool) -> None:
    # NOTE [ Weight casts autocast caches ] in _mechanism/selective.py: block 2 finds
    # the shared weight's bf16 cast cached in forward and casts it in its recompute;
    # profile raised "selective recompute ran aten._to_copy.default as op 1 of the block"
    # on every such model (128 of 6,803 fuzzed). Its keep-sets now give the plain
    # model's gradients, with the backward inside autocast or outside it (where a later
    # block's recompute may have cached a cast an earlier one's forward ran)
    import copy

    from autoremat._core.saves import is_keep_set
    from autoremat._plan.plan import plan_of_segments

    torch.manual_seed(0)
    model, x = _Sharing(), torch.randint(0, 32, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tape = autoremat.profile(model, x, repeats=1, timing=False)
    keys = sorted(k for k in tape.blocks[2].selective if is_keep_set(k))
    assert keys
    plain = copy.deepcopy(model)
    for key in keys:
        plan = plan_of_segments(tape, [(i, i + 1, Choice.selective_from_key(key))
                                       for i in range(3)], key)
        autoremat.apply(model, plan)
        grads = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for each in (plain, model):
                each.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = each(x)
                    if inside:
                        loss.backward()
                if not inside:
                    loss.backward()
                grads.append([p.grad for p in each.parameters()])
        autoremat.remove(model)
        assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True)), key
