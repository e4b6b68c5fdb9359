"""Offload (issue 17): saved tensors, or a checkpoint's input, in host memory.

On this CPU the host is the device, so an offload plan frees nothing; ``simulated_host``
copies to memory the tracker does not count, which is what a GPU's allocator sees. The
tests check gradients (equal to the plain model's, dropout on, both ways), the peak model
against the measured peak (simulated host), the planner's use of offload, ``estimate``
for a CUDA target, and the refusals.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest
import torch

import autoremat
from autoremat import Decision, Plan, RematError, SchemaError, zoo
from autoremat._core.decisions import KEEP, OFFLOAD, Choice
from autoremat._core.step import describe_inputs, run_step
from autoremat._measure.blocks import resolve_blocks
from autoremat._measure.memory import track_memory
from autoremat._mechanism.offload import OffloadGroup, simulated_host
from autoremat._plan.peak import plan_costs
from autoremat._plan.plan import BlockDecision, plan_of_segments
from autoremat._plan.strategies import smallest_feasible_bytes

from _steps import DenseChain, verified
from conftest import SMALL, V1_PLAN, hf_model


def _grads(model: torch.nn.Module, inputs: Any) -> tuple[int, list[torch.Tensor]]:
    """Peak and gradients of one step from a fixed RNG state."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(7)
    with track_memory() as mem:
        run_step(model, inputs, None)
    return mem.peak_bytes, [p.grad.clone() for p in model.parameters()]


_KINDS = [Decision.OFFLOAD, Decision.OFFLOAD_INPUT, Decision.KEEP, Decision.RECOMPUTE]


def _mixed(tape: autoremat.Tape) -> Plan:
    """Offload, offloaded input, keep and recompute, in turn along the chain."""
    segments = [(i, i + 1, Choice(_KINDS[i % 4])) for i in range(len(tape.blocks))]
    return plan_of_segments(tape, segments, "test:mixed")


def _by_hand(model: torch.nn.Module, inputs: Any, names: list[str],
             kinds: list[Decision]) -> Plan:
    """A plan without a tape (its predictions are zeros): for tests of the mechanism."""
    blocks = tuple(BlockDecision(n, k, i)
                   for i, (n, k) in enumerate(zip(names, kinds, strict=True)))
    return Plan(strategy="test", blocks=blocks, budget_bytes=None, predicted_peak_bytes=0,
                predicted_recompute_flops=0, predicted_cost=0, unplanned_peak_bytes=0,
                step_flops=0, model=type(model).__name__, inputs=describe_inputs(inputs))


@pytest.fixture(scope="module")
def gpt2_offload_tape() -> tuple[torch.nn.Module, Any, autoremat.Tape]:
    model, inputs = zoo.build("gpt2", **_GPT2)
    with simulated_host():
        tape = autoremat.profile(model, inputs, offload=True, with_selective=False,
                                 timing=False)
    return model, inputs, tape


_GPT2 = {"n_layer": 4, "batch_size": 8, "seq_len": 128, "vocab_size": 128}  # activations dominate


@pytest.mark.parametrize("simulated", [False, True], ids=["host-is-device", "simulated-host"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "hf-gpt2", "hf-llama"])
def test_offload_plans_give_plain_gradients(name: str, simulated: bool) -> None:
    if name.startswith("hf-"):
        model, inputs = hf_model(name[3:], use_cache=None, layers=4, seq_len=32)
    else:
        model, inputs = zoo.build(name, **dict(SMALL[name], n_layer=4))
    _, plain = _grads(model, inputs)
    names = resolve_blocks(model, None)
    assert len(names) == 4
    for kinds in (_KINDS, [Decision.OFFLOAD] * 4, [Decision.OFFLOAD_INPUT] * 4):
        chosen = _by_hand(model, inputs, names, kinds)
        autoremat.apply(model, chosen)
        with simulated_host() if simulated else contextlib.nullcontext():
            _, got = _grads(model, inputs)
        autoremat.remove(model)
        assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True)), chosen


def test_an_offloaded_input_recomputes_on_a_list_as_it_was_called_with() -> None:
    """NOTE [ Arguments as they were called ] in _mechanism/wrap.py: a block given the
    list the model appends to after the call (DenseNet) recomputed on the longer list
    under an offload_input decision."""
    torch.manual_seed(0)
    model, inputs = DenseChain(), (torch.randn(64, 32),)
    _, plain = _grads(model, inputs)
    names = [f"blocks.{i}" for i in range(len(model.blocks))]
    chosen = _by_hand(model, inputs, names, [Decision.OFFLOAD_INPUT] * len(names))
    autoremat.apply(model, chosen)
    with simulated_host():
        _, got = _grads(model, inputs)
    autoremat.remove(model)
    assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))


@pytest.mark.slow
def test_host_is_device_frees_nothing_and_changes_nothing(gpt2_offload_tape: Any) -> None:
    model, inputs, _ = gpt2_offload_tape
    tape = autoremat.profile(model, inputs, offload=True, with_selective=False, timing=False)
    assert tape.host_bandwidth == 0.0  # no copies on a CPU
    for b in tape.blocks[1:]:
        offloaded, kept = (Decision.OFFLOAD,) * 2, (Decision.KEEP,) * 2
        assert b.fwd[offloaded] == b.fwd[kept] and b.bwd[offloaded] == b.bwd[kept]
    # so the planner never offloads there: it costs hooks and frees nothing
    least = smallest_feasible_bytes(tape)
    for budget in (least, (least + tape.step_peak_bytes) // 2):
        assert autoremat.plan(tape, budget, offload=True) == autoremat.plan(tape, budget)


def test_offload_peak_model_is_exact(gpt2_offload_tape: Any) -> None:
    """With a separate host, each plan's measured peak equals its prediction."""
    model, inputs, tape = gpt2_offload_tape
    fast = dataclasses.replace(tape, host_bandwidth=1e15)  # copies all hidden: offload is cheap
    plans = [_mixed(tape), autoremat.plan(tape, strategy="offload")]
    for budget in ("80%", "55%", "35%"):
        plans.append(autoremat.plan(fast, budget, offload=True))
    assert any(p.offload_blocks for p in plans[2:])
    for chosen in plans:
        autoremat.apply(model, chosen)
        with simulated_host():
            peak, _ = _grads(model, inputs)
        autoremat.remove(model)
        assert peak == chosen.predicted_peak_bytes, chosen
        if chosen.budget_bytes is not None:
            assert peak <= chosen.budget_bytes


@pytest.mark.slow
def test_offload_input_goes_below_per_block_checkpointing() -> None:
    """Where the blocks' inputs are what per-block checkpointing keeps (many narrow
    blocks, long sequences), offloading them lowers the least feasible peak; the plan
    that reaches it measures its prediction."""
    model, inputs = zoo.build("gpt2", n_layer=12, n_embd=32, n_head=2, batch_size=8,
                              seq_len=256, vocab_size=64)
    with simulated_host():
        tape = autoremat.profile(model, inputs, offload=True, with_selective=False,
                                 timing=False)
    least = smallest_feasible_bytes(tape)
    with_offload = smallest_feasible_bytes(tape, offload=True)
    assert with_offload < least <= tape.ckpt_step_peak_bytes
    best = autoremat.plan(tape, with_offload, offload=True)
    assert any(b.offload_input for b in best.blocks)
    assert best.predicted_host_bytes == sum(
        b.offload_input_bytes if d.offload_input else b.offload_bytes if d.decision is
        Decision.OFFLOAD else 0 for b, d in zip(tape.blocks, best.blocks, strict=True))
    autoremat.apply(model, best)
    with simulated_host():
        peak, _ = _grads(model, inputs)
    assert peak == best.predicted_peak_bytes <= with_offload


def test_planner_offloads_when_copies_hide_and_not_when_they_do_not(
        gpt2_offload_tape: Any) -> None:
    _, _, tape = gpt2_offload_tape
    fast = dataclasses.replace(tape, host_bandwidth=1e15)
    slow = dataclasses.replace(tape, host_bandwidth=1e3)
    budget = "55%"
    recompute_only = autoremat.plan(fast, budget)
    cheap = autoremat.plan(fast, budget, offload=True)
    assert cheap.offload_blocks and cheap.predicted_cost < recompute_only.predicted_cost
    dear = autoremat.plan(slow, budget, offload=True)
    assert dear.predicted_cost <= recompute_only.predicted_cost
    assert dear.offload_blocks == 0 or dear.predicted_peak_bytes <= dear.budget_bytes


def test_offloading_a_block_lowers_the_device_level_by_its_offloaded_bytes(
        gpt2_offload_tape: Any) -> None:
    """With a separate host, what a block leaves on the device when the forward moves on
    drops by exactly the bytes it copied to host (every block but the last, whose output
    the head also reads), whatever its neighbour."""
    _, _, tape = gpt2_offload_tape
    for i, b in enumerate(tape.blocks[:-1]):
        for prev in ((Decision.KEEP,) if i == 0 else tape.window_decisions):
            assert b.fwd[prev, Decision.KEEP].delta_bytes \
                - b.fwd[prev, Decision.OFFLOAD].delta_bytes \
                == b.offload_bytes > 0


@pytest.mark.slow
def test_estimate_for_cuda_offload() -> None:
    """On meta for a CUDA target the host copies are not counted: the device level the
    forward leaves drops by at most the bytes copied (CUDA's attention kernel saves
    views of one buffer: less is freed than copied, see docs/offload.md), the peak drops, and
    an offload plan fits its budget."""
    model, inputs = zoo.build("gpt2", device="meta", **_GPT2)
    est = autoremat.estimate(model, inputs, device="cuda", offload=True, selective=False)
    tape = est.tape
    assert tape is not None and tape.offload and tape.host_bandwidth == 25e9
    n = len(tape.blocks)
    keep = [(i, i + 1, KEEP) for i in range(n)]
    some = [(i, i + 1, OFFLOAD if i < n - 1 else KEEP) for i in range(n)]
    held = [sum(c.hold for c in plan_costs(tape, s)) for s in (keep, some)]
    assert 0 < held[0] - held[1] <= sum(b.offload_bytes for b in tape.blocks[:-1])
    peaks = [plan_of_segments(tape, s, "test").predicted_peak_bytes for s in (keep, some)]
    assert peaks[1] < peaks[0]
    planned = est.with_plan("50%", offload=True)
    assert planned.plan is not None and planned.plan_peak_bytes <= planned.budget_bytes


def test_offload_refusals(gpt2_offload_tape: Any) -> None:
    model, inputs, tape = gpt2_offload_tape
    plain_tape = autoremat.profile(model, inputs, with_selective=False, timing=False)
    # on a CPU the host is the device: nothing to offload, and the plan says so
    budget = plain_tape.ckpt_step_peak_bytes * 2
    here = autoremat.plan(plain_tape, budget, offload=True)
    assert here.offload_blocks == 0 and "host is the device" in here.notes[-1]
    assert dataclasses.replace(here, notes=()) == autoremat.plan(plain_tape, budget)
    every = autoremat.plan(tape, strategy="offload")  # runs, and says it frees nothing
    assert every.offload_blocks == len(tape.blocks) and "copies free nothing" in every.notes[-1]
    with pytest.raises(RematError, match=r"profile\(model, inputs, offload=True\)"):
        autoremat.plan(dataclasses.replace(plain_tape, device="cuda"), budget, offload=True)
    with pytest.raises(RematError, match="offload=True"):
        autoremat.plan(plain_tape, strategy="offload")
    with pytest.raises(RematError, match="offload must be True or False"):
        autoremat.plan(tape, "60%", offload="yes")  # type: ignore[arg-type]
    with pytest.raises(RematError, match="not supported"):
        autoremat.profile(model, inputs, offload=True, compile="aot_eager")
    with pytest.raises(RematError, match="only matters with offload=True"):
        autoremat.profile(model, inputs, host_bandwidth=1e9)
    with pytest.raises(RematError, match="positive number"):
        autoremat.profile(model, inputs, offload=True, host_bandwidth=-1)
    chosen = autoremat.plan(tape, strategy="offload")
    with pytest.raises(RematError, match="offloads blocks"):
        autoremat.apply(torch.compile(model, backend="aot_eager"), chosen)
    assert autoremat.applied_plan(model) is None


def test_offload_plans_round_trip_and_bad_json_is_refused(gpt2_offload_tape: Any) -> None:
    _, _, tape = gpt2_offload_tape
    chosen = _mixed(tape)
    assert Plan.from_json(chosen.to_json()) == chosen
    assert "offload" in str(chosen) and "its input in host memory" in str(chosen)
    # a version-1 file wrote an offloaded input as a flag (NOTE [ Decisions in files ])
    data = V1_PLAN.read_text().replace('"offload_input": true', '"offload_input": 1')
    with pytest.raises(SchemaError, match="offload_input must be false, or true on a "
                                          "recompute block"):
        Plan.from_json(data)


def test_a_tensor_saved_twice_is_copied_once() -> None:
    group = OffloadGroup(frozen=set())
    x = torch.randn(64, 64)
    with simulated_host():
        a, b = group.pack(x), group.pack(x)
        assert a is b and group.stats.tensors == 1
        assert torch.equal(group.unpack(a), x)
    small = torch.randn(4)
    kept = group.pack(small)  # under _MIN_BYTES: stays, as an alias (no grad_fn)
    assert kept.untyped_storage().data_ptr() == small.untyped_storage().data_ptr()
    assert kept._version == small._version and kept.grad_fn is None


def test_compressed_offload_stays_within_its_documented_bounds() -> None:
    """NOTE [ Compressed offload ]: each compressed element within 2**-8 relative; the
    gradients of the zoo's gpt2 with every block compressed within 2**-5 of each
    gradient's largest element (and not equal: the numerics do change)."""
    x = torch.randn(256, 256) * torch.logspace(-20, 20, 256)
    group = OffloadGroup(frozen=set(), dtype=torch.bfloat16)
    with simulated_host():
        packed = group.pack(x)
        back = group.unpack(packed)
    assert back.dtype == x.dtype and group.stats.host_bytes == x.numel() * 2
    assert bool(((back - x).abs() <= 2.0 ** -8 * x.abs()).all())
    model, inputs = zoo.build("gpt2", **dict(SMALL["gpt2"], n_layer=4))
    _, plain = _grads(model, inputs)
    names = resolve_blocks(model, None)
    chosen = dataclasses.replace(_by_hand(model, inputs, names, _KINDS),
                                 offload_dtype="bfloat16")
    autoremat.apply(model, chosen)
    with simulated_host():
        _, got = _grads(model, inputs)
    autoremat.remove(model)
    worst = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                for a, b in zip(got, plain, strict=True))
    assert 0 < worst < 2.0 ** -5


def test_offload_dtype_is_checked(gpt2_offload_tape: Any) -> None:
    _, _, tape = gpt2_offload_tape
    assert autoremat.plan(tape, strategy="offload",
                          offload_dtype=torch.bfloat16).offload_dtype == "bfloat16"
    with pytest.raises(RematError, match="offload_dtype must be one of"):
        autoremat.plan(tape, strategy="offload", offload_dtype="int8")
    with pytest.raises(RematError, match="only matters when the plan offloads"):
        autoremat.plan(tape, "90%", offload_dtype="bfloat16")
    data = autoremat.plan(tape, strategy="offload", offload_dtype="float16").to_json()
    with pytest.raises(SchemaError, match=r"plan\.offload_dtype"):
        Plan.from_json(data.replace('"float16"', '"fp8"'))


class _DropsASmallBranch(torch.nn.Module):
    """A block that builds a small softmax (under offload's 1 KiB, so kept on the device)
    and drops it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.side = torch.nn.Linear(8, 8)
        self.dropped: list[Any] = []  # a weak reference to the dropped softmax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import weakref

        self.dropped.append(weakref.ref(self.side(x).softmax(-1)))
        return self.lin(x).tanh()


def test_a_small_tensor_an_offloaded_block_drops_is_freed_when_dropped() -> None:
    # NOTE [ A pack hook keeps an alias ] in measure/ops.py: kept as itself, a saved
    # output and its grad_fn referred to each other until Python's cycle collector ran
    torch.manual_seed(0)
    model = torch.nn.Sequential(_DropsASmallBranch(), _DropsASmallBranch())
    x = torch.randn(4, 8, requires_grad=True)
    autoremat.apply(model, _by_hand(model, x, ["0", "1"], [Decision.OFFLOAD] * 2))
    try:
        loss = model(x).sum()
        assert all(ref() is None for block in model for ref in block.dropped)
        loss.backward()
    finally:
        autoremat.remove(model)


def test_a_plan_keeping_a_block_between_offloaded_ones_is_predicted_exactly() -> None:
    # NOTE [ What the model made before the chain ]: a Llama's rotary cos and sin, made
    # before the first block and passed to every one, are released when the forward
    # returns in the step with every block offloaded (where the first block's release was
    # measured) but held by a kept block: offload, keep, offload, offload measured 8 KiB
    # over its prediction
    model, inputs = hf_model("llama", use_cache=None, layers=4)
    with simulated_host():
        tape = autoremat.profile(model, inputs, offload=True, with_selective=False,
                                 timing=False)
        assert tape.first_release_shared.get(Decision.OFFLOAD, 0) > 0
        kinds = [Decision.OFFLOAD, Decision.KEEP, Decision.OFFLOAD, Decision.OFFLOAD]
        chosen = plan_of_segments(tape, [(i, i + 1, Choice(k)) for i, k in enumerate(kinds)],
                                  "test")
        report = verified(model, inputs, chosen, repeats=1)
    assert report.max_grad_diff == 0.0
    assert report.peak_bytes == chosen.predicted_peak_bytes
    loaded = autoremat.Tape.from_json(tape.to_json())  # the new field is kept
    assert loaded.first_release_shared == tape.first_release_shared
