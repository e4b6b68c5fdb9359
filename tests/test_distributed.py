"""Plans under DDP and FSDP2 (autoremat.distributed, plan(shards=N)).

The first tests run in this process: the sharded budget, its argument, and the
plan's JSON. The others run in two gloo processes on the CPU: one pair of processes
runs every case in turn (spawning a pair costs seconds), rank 0 writes what it saw to
a file, and the tests read it. Gradients are compared with ``torch.equal`` against a
single-process reference: the plain model stepped on each rank's batch with that rank's
dropout seed, the two gradients summed and halved.

NOTE [ Why two ranks are bitwise ]
    DDP divides each gradient by the world size and all-reduces the sum; FSDP2
    reduce-scatters float32 gradients with ``ReduceOp.AVG`` (torch 2.13,
    ``_get_gradient_divide_factors``). Halving is exact in floating point (barring
    underflow to subnormals), and a sum of two addends is the same in either order, so
    ``g0 / 2 + g1 / 2 == (g0 + g1) / 2``, whether the engine halves first or last,
    bit for bit whatever order gloo adds in. Each rank's own forward and backward are
    the single-process ones (same ops, one thread in both), and a plan's gradients are
    bitwise the plain model's (autoremat's contract). So every comparison here is
    ``torch.equal``; with more ranks the sums would reassociate and need a tolerance.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import autoremat
from autoremat._measure.optimizers import resolve_optimizer
from autoremat._plan.budget import fsdp_param_bytes
from autoremat.distributed import broadcast_plan

WORLD = 2
SIZES = {"n_layer": 4, "n_embd": 32, "n_head": 2, "vocab_size": 64, "seq_len": 32,
         "dropout": 0.1}
PER_RANK = 2  # batch rows per rank
JOIN_S = 120  # the whole run; a hang fails the test instead of blocking the suite
SUBSET_TIMEOUT_S = 3.0  # rank_timeout_s of the case where only rank 0 applies


# --- in this process -------------------------------------------------------------------

def test_shards_divide_parameters_gradients_and_optimizer_state(tiny_tape: autoremat.Tape) -> None:
    tape = tiny_tape
    limit = 64 * 2**20
    counters = resolve_optimizer("adamw").counter_bytes(tape.trainable_param_tensors, "cpu")
    for shards in (1, 2, 3):
        p = autoremat.plan(tape, max_memory=limit, optimizer="adamw", strategy="none",
                           shards=shards)
        # gathered whole: the root (outside the blocks) and two of the largest block
        units = [b.param_bytes for b in tape.blocks]
        gathered = tape.param_bytes - sum(units) + 2 * max(units) if shards > 1 else 0
        resting = (tape.param_bytes // shards + gathered + tape.buffer_bytes
                   + 2 * tape.trainable_param_bytes // shards + counters + tape.input_bytes)
        assert p.budget_bytes == limit - resting, shards
        assert p.shards == shards


def test_shards_need_the_whole_model_less_under_max_memory(tiny_tape: autoremat.Tape) -> None:
    tape = tiny_tape
    with pytest.raises(autoremat.BudgetError) as unsharded:
        autoremat.plan(tape, max_memory=tape.param_bytes * 2, optimizer="adamw")
    need = unsharded.value.min_feasible_max_memory  # (min_feasible_bytes: a step budget)
    assert need is not None
    with pytest.raises(autoremat.BudgetError) as sharded:
        autoremat.plan(tape, max_memory=tape.param_bytes * 2, optimizer="adamw", shards=4)
    assert sharded.value.min_feasible_max_memory is not None
    assert sharded.value.min_feasible_max_memory < need  # parameters, grads, adam state / 4


@pytest.mark.parametrize("shards", [0, -1, 1.5, True, "2", None])
def test_shards_must_be_a_whole_number_of_ranks(tiny_tape: autoremat.Tape, shards: Any) -> None:
    with pytest.raises(autoremat.BudgetError, match=r"shards must be a whole number >= 1"):
        autoremat.plan(tiny_tape, shards=shards)


def test_sharded_plans_checkpoint_blocks_one_by_one(tiny_tape: autoremat.Tape) -> None:
    tape = tiny_tape
    assert any(stop > start + 1 for start, stop, _ in
               autoremat.plan(tape, strategy="sqrt").segments)
    p = autoremat.plan(tape, strategy="sqrt", shards=2)
    assert [(start, stop) for start, stop, _ in p.segments] == [(0, 1), (1, 2), (2, 3)]
    assert "parameters sharded over 2 ranks" in str(p)
    assert autoremat.Plan.from_json(p.to_json()) == p


def test_a_plan_with_shards_below_one_does_not_load(tiny_tape: autoremat.Tape) -> None:
    text = autoremat.plan(tiny_tape).to_json().replace('"shards": 1', '"shards": 0')
    with pytest.raises(autoremat.SchemaError, match=r"plan.shards must be >= 1, got 0"):
        autoremat.Plan.from_json(text)


def test_broadcast_plan_in_one_process(tiny_tape: autoremat.Tape) -> None:
    p = autoremat.plan(tiny_tape)
    assert broadcast_plan(p) is p
    with pytest.raises(autoremat.RematError, match=r"needs a Plan .* got NoneType"):
        broadcast_plan(None)


@pytest.mark.slow
def test_estimate_counts_one_rank_of_shards() -> None:
    model, inputs = autoremat.zoo.build("gpt2", device="meta", n_layer=2, seq_len=32)
    whole = autoremat.estimate(model, inputs, device="cuda", optimizer="adamw",
                               selective=False)
    units = [b.param_bytes for b in whole.tape.blocks] if whole.tape else []
    for shards in (2, 4):
        est = autoremat.estimate(model, inputs, device="cuda", optimizer="adamw",
                                 shards=shards, max_memory="1GiB", selective=False)
        gathered = whole.param_bytes - sum(units) + 2 * max(units)
        assert est.resting_bytes == (whole.param_bytes // shards + gathered
                                     + whole.buffer_bytes + whole.optimizer_bytes // shards
                                     + whole.input_bytes)
        assert est.budget_bytes == 2**30 - est.resting_bytes
        assert est.plan is not None and est.plan.shards == shards
        assert f"sharded over {shards} ranks" in str(est)
    with pytest.raises(autoremat.BudgetError, match=r"shards must be a whole number"):
        autoremat.estimate(model, inputs, shards=0)


@pytest.mark.parametrize("timeout", [0, -1.0, "30", True])
def test_rank_timeout_must_be_positive_seconds(tiny_tape: autoremat.Tape, timeout: Any) -> None:
    model, _ = autoremat.zoo.build("mlp", widths=(32, 16, 24), d_in=16, batch_size=8)
    with pytest.raises(autoremat.RematError, match=r"must be a number of seconds > 0, got"):
        autoremat.apply(model, autoremat.plan(tiny_tape), rank_timeout_s=timeout)
    assert autoremat.applied_plan(model) is None


def test_ranks_whose_plans_differ_only_in_the_loss_head_disagree(
        tiny_tape: autoremat.Tape, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose head is chunked returns no logits: a collective over them on the
    others would pair with nothing. apply's rank check compared the blocks only."""
    import dataclasses
    import json

    import autoremat._apply as apply_module
    from autoremat._core.decisions import Choice, Decision

    plan = autoremat.plan(tiny_tape, None, "full")
    chunked = dataclasses.replace(plan, head=Choice(Decision.CHUNKED, chunks=4))
    texts: list[str] = []

    def gather(text: str, **_: Any) -> list[str]:
        texts.append(text)
        return [texts[0], text]

    monkeypatch.setattr(apply_module, "gather_texts", gather)
    monkeypatch.setattr(apply_module, "rank_and_size", lambda: (1, 2))
    apply_module._check_ranks_agree(plan, 1.0)  # rank 0's, as the first text
    with pytest.raises(autoremat.PlanMismatchError, match=r"the loss head 'keep' on rank 0, "
                       r"'chunked:4' on the other"):
        apply_module._check_ranks_agree(chunked, 1.0)
    assert json.loads(texts[1])["head"] == "chunked:4"


# --- in two processes --------------------------------------------------------------------

def _build() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The same model on every rank, and the batch of both ranks."""
    return autoremat.zoo.build("gpt2", seed=0, batch_size=PER_RANK * WORLD, **SIZES)


def _rows(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {k: v[rank * PER_RANK:(rank + 1) * PER_RANK] for k, v in batch.items()}


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor], rank: int) -> None:
    torch.manual_seed(1000 + rank)  # this rank's dropout masks
    model(**batch).loss.backward()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole gradients by name (an FSDP2 gradient is a sharded DTensor: gathered, which
    every rank must do)."""
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad
        out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
    return out


def _reference() -> dict[str, torch.Tensor]:
    """Single process: the plain model on each rank's rows, gradients summed and halved."""
    total: dict[str, torch.Tensor] = {}
    for rank in range(WORLD):
        model, batch = _build()
        _step(model, _rows(batch, rank), rank)
        for name, p in model.named_parameters():
            total[name] = total[name] + p.grad if name in total else p.grad.clone()
    return {name: g / WORLD for name, g in total.items()}


def _shard(model: torch.nn.Module) -> None:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def _case(rank: int, plan: autoremat.Plan | None, order: str, engine: str
          ) -> dict[str, torch.Tensor]:
    model, batch = _build()
    wrapped: torch.nn.Module = model
    if plan is not None and order == "before":
        autoremat.apply(model, plan)
    if engine == "ddp":
        wrapped = DistributedDataParallel(model)
    else:
        _shard(model)
    if plan is not None and order == "after":
        autoremat.apply(wrapped, plan)
        assert autoremat.applied_plan(wrapped) == plan
    _step(wrapped, _rows(batch, rank), rank)
    first = _grads(model)
    # A second step (same weights, batch and seed) must give the same gradients: DDP's
    # reducer would refuse it had the first left a parameter unreduced (no
    # find_unused_parameters needed), and FSDP2 must reshard and gather again.
    model.zero_grad(set_to_none=True)
    _step(wrapped, _rows(batch, rank), rank)
    second = _grads(model)
    assert all(torch.equal(first[name], second[name]) for name in first), \
        f"{engine} {order}: the second step's gradients differ from the first's"
    return first


def _gathered() -> dict[str, Any]:
    """Bytes of parameters FSDP2 holds gathered (whole) at each block's forward and
    backward in a step, and the root's and a block's parameter bytes (NOTE [ Sharded
    over N ranks ] in _plan/budget.py). Reads FSDP2's own records of its parameters
    (torch 2.13: ``FSDPParam._unsharded_param``, freed by resizing its storage to 0)."""
    model, batch = _build()
    _shard(model)
    groups = [m._get_fsdp_state()._fsdp_param_group for m in (*model.blocks, model)]
    seen: list[int] = []

    def note(*_: Any) -> None:
        seen.append(sum(fp._unsharded_param.untyped_storage().nbytes()
                        for group in groups for fp in group.fsdp_params
                        if hasattr(fp, "_unsharded_param")))

    for block in model.blocks:
        block.register_forward_hook(note)
        block.register_full_backward_hook(note)
    _step(model, _rows(batch, dist.get_rank()), dist.get_rank())
    whole = _build()[0]
    blocks = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in whole.blocks]
    total = sum(p.numel() * p.element_size() for p in whole.parameters())
    return {"seen": seen, "root": total - sum(blocks), "blocks": blocks, "total": total}


def _error(fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
    except autoremat.RematError as exc:
        return {"type": type(exc).__name__, "message": str(exc),
                "seconds": time.monotonic() - start}
    return {"type": None, "message": "", "seconds": time.monotonic() - start}


def _worker(rank: int, port: int, out: str) -> None:
    try:
        _run(rank, port, Path(out))
    except BaseException:
        Path(out, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def _run(rank: int, port: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the reference runs with one thread too
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results: dict[str, Any] = {}
    plans: list[autoremat.Plan | None] = [None, None, None]
    if rank == 0:
        model, batch = _build()
        tape = autoremat.profile(model, _rows(batch, 0), repeats=1)
        plans = [autoremat.plan(tape, strategy="sqrt"),  # segments of two blocks
                 autoremat.plan(tape, "60%", shards=WORLD),
                 autoremat.plan(tape, strategy="selective", shards=WORLD)]
        results["reference"] = _reference()
        results["plans"] = [p.to_json() for p in plans]
    segmented, sharded, selective = (broadcast_plan(p) for p in plans)
    for engine, plan in (("ddp", segmented), ("fsdp", sharded)):
        results[f"{engine}-plain"] = _case(rank, None, "", engine)
        for order in ("before", "after"):
            results[f"{engine}-{order}"] = _case(rank, plan, order, engine)
    results["fsdp-gathered"] = _gathered()
    # selective blocks (autoremat's dispatch modes inside the checkpoint) under each engine
    results["ddp-selective"] = _case(rank, selective, "before", "ddp")
    results["fsdp-selective"] = _case(rank, selective, "after", "fsdp")
    # a plan with two-block segments after fully_shard: refused on every rank
    results["fsdp-segments"] = _error(lambda: _case(rank, segmented, "after", "fsdp"))
    # rank 0 has no plan to send: every rank raises, none waits
    results["no-plan"] = _error(lambda: broadcast_plan("a plan" if rank == 0 else None))
    # rank 1 applies another plan than rank 0: every rank raises
    mismatched = segmented if rank == 0 else sharded
    seen = _error(lambda: autoremat.apply(_build()[0], mismatched))
    for key, mine in (("mismatch", seen), ("no-plan", results["no-plan"])):
        results[key] = [None] * WORLD
        dist.all_gather_object(results[key], mine)
    # last (it leaves the ranks' group numbering apart): only rank 0 applies
    if rank == 0:
        results["subset"] = _error(lambda: autoremat.apply(
            _build()[0], segmented, rank_timeout_s=SUBSET_TIMEOUT_S))
    dist.barrier()
    if rank == 0:
        torch.save(results, out / "results.pt")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("distributed")
    context = mp.start_processes(_worker, args=(_free_port(), str(out)), nprocs=WORLD,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + JOIN_S
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise AssertionError(f"the {WORLD} processes did not finish in {JOIN_S} s")
    except mp.ProcessRaisedException as exc:
        errors = "\n".join(p.read_text() for p in sorted(out.glob("error-*.txt")))
        raise AssertionError(f"a rank raised:\n{errors or exc}") from exc
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    loaded: dict[str, Any] = torch.load(out / "results.pt")
    return loaded


@pytest.mark.slow
def test_fsdp_holds_the_root_gathered_and_a_block_beside_it(results: dict[str, Any]) -> None:
    # NOTE [ Sharded over N ranks ]: what a rank holds whole, within what the budget counts
    found = results["fsdp-gathered"]
    root, largest = found["root"], max(found["blocks"])
    assert len(found["seen"]) == 2 * len(found["blocks"])
    assert min(found["seen"]) >= root  # the root stays gathered for the whole step
    assert max(found["seen"]) >= root + largest  # and a block with it
    counted = fsdp_param_bytes(found["total"], found["blocks"], WORLD)
    assert max(found["seen"]) <= counted - found["total"] // WORLD


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ddp-plain", "ddp-before", "ddp-after", "ddp-selective",
                                  "fsdp-plain", "fsdp-before", "fsdp-after",
                                  "fsdp-selective"])
def test_gradients_equal_the_single_process_reference(results: dict[str, Any],
                                                      case: str) -> None:
    reference, grads = results["reference"], results[case]
    assert grads.keys() == reference.keys()
    differ = [name for name in reference if not torch.equal(grads[name], reference[name])]
    assert not differ, f"{case}: gradients differ from the reference in {differ}"


@pytest.mark.slow
def test_the_plans_recompute_something(results: dict[str, Any]) -> None:
    segmented, sharded, selective = (autoremat.Plan.from_json(p) for p in results["plans"])
    assert any(stop > start + 1 for start, stop, _ in segmented.segments)
    assert sharded.shards == WORLD and sharded.recompute_blocks > 0
    assert all(stop == start + 1 for start, stop, _ in sharded.segments)
    assert {b.decision for b in selective.blocks} == {autoremat.Decision.SELECTIVE}


@pytest.mark.slow
@pytest.mark.parametrize("rank", range(WORLD))
def test_mismatched_plans_raise_on_every_rank_quickly(results: dict[str, Any],
                                                     rank: int) -> None:
    seen = results["mismatch"][rank]
    assert seen["type"] == "PlanMismatchError", seen
    assert "rank(s) [1] differ from rank 0" in seen["message"]
    assert ("first difference: block 'blocks.1': segment 0 on rank 0, 1 on the other"
            in seen["message"])
    assert "broadcast_plan" in seen["message"]
    assert seen["seconds"] < 30


@pytest.mark.slow
@pytest.mark.parametrize("rank", range(WORLD))
def test_broadcast_without_a_plan_raises_on_every_rank(results: dict[str, Any],
                                                       rank: int) -> None:
    seen = results["no-plan"][rank]
    assert seen["type"] == "RematError", seen
    assert seen["message"] == ("broadcast_plan() on rank 0 (src) needs a Plan from "
                               "autoremat.plan(), got str; make the plan on rank 0 and pass "
                               "None on the others")


@pytest.mark.slow
def test_apply_on_one_rank_only_times_out(results: dict[str, Any]) -> None:
    seen = results["subset"]
    assert seen["type"] == "RematError", seen
    assert "waited 3 s for the other ranks" in seen["message"]
    assert SUBSET_TIMEOUT_S <= seen["seconds"] < SUBSET_TIMEOUT_S + 10


@pytest.mark.slow
def test_segments_are_refused_under_fsdp(results: dict[str, Any]) -> None:
    seen = results["fsdp-segments"]
    assert seen["type"] == "RematError", seen
    assert "sharded by FSDP2" in seen["message"] and "shards=" in seen["message"]
