"""The :class:`Plan`: what each block does in backward, as plain frozen data.

A Plan prints as a table, round-trips through versioned JSON (sealed: NOTE
[ Sealed plan files ]), and records the model and input shapes it was made
for, so ``apply`` can refuse a mismatch. ``plan_of_segments`` gives the plan
a list of segments makes, with its predictions, and ``check_against_tape``
derives them again from a loaded plan's decisions. The functions that choose
a plan are in ``strategies.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from autoremat._core.conditions import conditions_line
from autoremat._core.decisions import BLOCK_DECISIONS, KEEP, Choice, Decision, decision_of
from autoremat._core.errors import RematError, SchemaError, did_you_mean
from autoremat._core.files import (
    SCHEMA_VERSION,
    build_dataclass,
    check_loop_field,
    dump_json,
    int_tuples,
    load_json,
)
from autoremat._core.head import HeadAt, HeadKind
from autoremat._core.saves import (
    format_keep_keys,
    is_keep_set,
    keep_keys,
    op_signature,
    parse_keep_keys,
    save_set_name,
)
from autoremat._core.step import Loop
from autoremat._core.tables import render_table
from autoremat._core.units import format_bytes
from autoremat._measure.tape import Tape
from autoremat._plan.peak import Segments, plan_costs, predict_peak, with_head

__all__ = ["BlockDecision", "Plan", "UnsealedPlanWarning", "check_against_tape", "plan_key",
           "plan_seal"]


@dataclass(frozen=True)
class BlockDecision:
    """What one block does in backward: its :class:`~autoremat.Decision` and what that
    needs (the op kinds or positions a selective block keeps). ``decision`` may be given
    by name (``"recompute"``); it is held as a ``Decision``."""

    name: str  # qualified module name
    # keep | recompute | selective | offload | offload_input (checkpointed, its input
    # waiting in host memory until the recompute, alone in its segment: NOTE
    # [ Offloading a checkpoint's input ] in _mechanism/offload.py)
    decision: Decision
    segment: int  # index of its segment; blocks sharing one are recomputed together
    save_ops: tuple[str, ...] = ()  # selective: op kinds whose outputs stay saved
    recompute_ops: tuple[str, ...] = ()  # selective: op kinds re-run in backward
    # selective with a keep-set (NOTE [ Dead ops ] in selective.py): op positions
    keep_ops: tuple[int, ...] = ()  # whose outputs stay saved
    skip_ops: tuple[int, ...] = ()  # that recompute skips (dead)
    op_signature: str = ""  # of the op sequence the positions index
    # the kept ops as "op#occurrence" (e.g. "aten.mm.default#1"): what they lower to
    # under torch.compile (NOTE [ Plans under torch.compile ] in _mechanism/compiled.py)
    keep_keys: tuple[str, ...] = ()
    # its parameters' fingerprint when planned (blocks.param_signature): apply refuses a
    # block whose parameters differ ("": not recorded, not checked)
    params: str = ""
    # a keep-set's seal: keep_set_seal(op_signature, keep_ops, skip_ops), so that an
    # edited keep-set (which could skip ops whose outputs backward needs) is refused
    keep_seal: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "decision",
                           decision_of(self.decision, f"the decision of block {self.name!r}"))

    @property
    def offload_input(self) -> bool:
        """Whether it is checkpointed with its input in host memory (``decision`` is
        ``Decision.OFFLOAD_INPUT``; a field of version-1 plan files)."""
        return self.decision is Decision.OFFLOAD_INPUT


@dataclass(frozen=True)
class Plan:
    """A checkpointing plan for one model and input shape. ``print(plan)`` shows a table."""

    strategy: str  # how it was chosen, e.g. "optimal" or "every:2"
    blocks: tuple[BlockDecision, ...]
    budget_bytes: int | None  # the step-peak budget it was made for (None: no budget)
    predicted_peak_bytes: int  # predicted step peak with the plan
    predicted_recompute_flops: int  # extra forward FLOPs from recomputation
    predicted_cost: int  # the planner's objective: FLOP-equivalents (see costs.py); below 0
    # where a chunked head saves more than the plan's recompute costs
    unplanned_peak_bytes: int  # measured step peak without checkpointing
    step_flops: int  # FLOPs of the plain step (forward + backward)
    model: str  # class name of the model it was made for
    inputs: str  # input signature it was made for
    # The training loop its tape measured, which its predictions and budget hold for
    # (step.Loop); plans saved before this field existed were made "loss_only".
    loop: Loop = "loss_only"
    # The torch.compile backend of the step its tape measured ("": eager), which its
    # predictions hold for (NOTE [ Profiling a compiled step ] in _profile/runs.py).
    compiled: str = ""
    # The step's peak compiled whole (``torch.compile(model)``) with this plan applied, as
    # ``auto`` measured it (the allocator's; NOTE [ Compiled plans are fitted by
    # measurement ] in _auto.py), which its budget rests on; None: not measured.
    compiled_peak_bytes: int | None = None
    # torch.compile's own activation_memory_budget the plan rests on, with random draws
    # saved (NOTE [ Compile's own memory budget, exact ] in _mechanism/compiled.py): the
    # plan keeps every block and the model runs through autoremat.compile_model. None:
    # compile's default.
    compile_memory_budget: float | None = None
    # Bytes the offloaded blocks copy to host memory in one step (their tape's figures,
    # uncompressed).
    predicted_host_bytes: int = 0
    # "": offloaded tensors are copied as they are; else the dtype their host copies
    # are stored in, which changes numerics (NOTE [ Compressed offload ] in offload.py)
    offload_dtype: str = ""
    # The ranks FSDP shards parameters, gradients and optimizer state over, which
    # max_memory counted (NOTE [ Sharded over N ranks ] in budget.py); 1: unsharded.
    shards: int = 1
    # Bytes of the budget held back for what the CUDA caching allocator adds beyond the
    # prediction (NOTE [ The margin kept for the CUDA allocator ] in budget.py): the plan
    # predicts at most budget_bytes - margin_bytes. 0: none (CPU, or margin=0).
    margin_bytes: int = 0
    # What else it was made for (NOTE [ What a plan is checked against ] in _guards.py):
    # the device its tape measured or targeted ("": saved before this field existed),
    # and the model's mode then (model.training).
    device: str = ""
    training: bool = True
    # What its tape's step ran under, as the tape records it (NOTE [ The conditions a
    # step is measured under ] in _core/conditions.py): autocast ("cpu:bfloat16"; "":
    # none), the parameters' floating dtypes, the loss taken, the blocks' parents' sizes
    # ("blocks=4"), the users' forward hooks on the blocks ("blocks.0=train.tap;...").
    # dtypes "": made from a tape that did not record them (not checked).
    autocast: str = ""
    dtypes: str = ""
    loss: str = ""
    structure: str = ""
    hooks: str = ""
    cached: bool = False  # its step ran under parametrize.cached(), on a parametrized model
    # The loss head: kept (as the model computes it) or chunked over N chunks of tokens
    # (NOTE [ A chunked head ] in _core/head.py; files write "keep" or "chunked:N"), and
    # where it is (files write "hf:lm_head", "module:<name>"; None: the head is kept).
    head: Choice = KEEP
    head_site: HeadAt | None = None
    schema_version: int = SCHEMA_VERSION
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def head_chunks(self) -> int | None:
        """The chunks of tokens the loss head runs in, or ``None`` when it is kept."""
        return self.head.chunks or None

    @property
    def recompute_overhead(self) -> float:
        """Recompute FLOPs as a fraction of the plain step's FLOPs."""
        return self.predicted_recompute_flops / self.step_flops if self.step_flops else 0.0

    @property
    def recompute_blocks(self) -> int:
        """How many blocks recompute anything in backward."""
        return sum(b.decision.recomputes for b in self.blocks)

    @property
    def offload_blocks(self) -> int:
        """How many blocks offload to host memory (their saved tensors, or their input)."""
        return sum(b.decision.offloads for b in self.blocks)

    @property
    def segments(self) -> list[tuple[int, int, Decision]]:
        """``(start, stop, decision)`` runs of blocks that share a segment."""
        out: list[tuple[int, int, Decision]] = []
        for i, b in enumerate(self.blocks):
            if out and b.segment == self.blocks[out[-1][0]].segment:
                out[-1] = (out[-1][0], i + 1, out[-1][2])
            else:
                out.append((i, i + 1, b.decision))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The JSON fields (unsealed), decisions by name (NOTE [ Decisions in files ] in
        tape.py)."""
        data = asdict(self)
        for block in data["blocks"]:
            block["decision"] = block["decision"].value
        data["head"] = self.head.head_key
        data["head_site"] = "" if self.head_site is None else str(self.head_site)
        return data

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """Return the JSON text, sealed (NOTE [ Sealed plan files ]); with ``path``, also
        write it there atomically."""
        data = self.to_dict()
        return dump_json(dict(data, seal=plan_seal(data)), path)

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike[str], *, tape: Tape | None = None
                  ) -> Plan:
        """Load a plan from JSON text or a file; says which field is wrong if any.

        A file is refused if it was edited after it was written (its ``seal`` does not
        match; NOTE [ Sealed plan files ]). A file saved before plans were sealed loads
        unchecked, with an :class:`UnsealedPlanWarning`.

        Args:
            text_or_path: JSON text, or the path of a file holding it.
            tape: the tape the plan was made from (optional): the plan's predictions are
                then derived again from its decisions and the tape, and a plan whose
                stated figures differ is refused, sealed or not.

        Raises:
            SchemaError: the text is not a plan, a field is malformed, the file was edited
                by hand, or (with ``tape``) its figures are not the ones its decisions
                give on that tape.
        """
        data = dict(load_json(text_or_path, what="plan"))
        seal = data.pop("seal", None)
        as_read = dict(data)  # what the seal covers: the fields as the file has them
        raw = data.get("blocks")
        if not isinstance(raw, list):
            raise SchemaError("plan.blocks must be a list")
        blocks = []
        for i, item in enumerate(raw):
            where = f"plan.blocks[{i}]"
            if isinstance(item, dict):
                item = dict(item, **{key: _strings(item.get(key, []), f"{where}.{key}")
                                     for key in ("save_ops", "recompute_ops", "keep_keys")})
                item["decision"] = _decision_field(item, data["schema_version"], where)
            item = int_tuples(item, ("keep_ops", "skip_ops"), where)
            block = build_dataclass(BlockDecision, item, where)
            _expect(block.op_signature, str, f"{where}.op_signature")
            _expect(block.name, str, f"{where}.name")
            _expect(block.params, str, f"{where}.params")
            _expect(block.keep_seal, str, f"{where}.keep_seal")
            _expect(block.segment, int, f"{where}.segment")
            _check_keep_set(block, where)
            blocks.append(block)
        _check_segments(blocks)
        data["blocks"] = tuple(blocks)
        data["schema_version"] = SCHEMA_VERSION  # read; it is written as this version
        data["notes"] = _strings(data.get("notes", []), "plan.notes")
        if "head" in data:
            data["head"] = _head_field(data["head"])
        data["head_site"] = _head_site_field(data.get("head_site", ""))
        loaded: Plan = build_dataclass(cls, data, "plan")
        _expect(loaded.predicted_cost, int, "plan.predicted_cost")  # < 0: a faster head
        for key in ("predicted_peak_bytes", "predicted_recompute_flops", "unplanned_peak_bytes",
                    "step_flops", "predicted_host_bytes", "margin_bytes"):
            _expect(getattr(loaded, key), int, f"plan.{key}")
            if getattr(loaded, key) < 0:
                raise SchemaError(f"plan.{key} must be >= 0, got {getattr(loaded, key)}")
        if loaded.offload_dtype not in ("", *_OFFLOAD_DTYPES):
            raise SchemaError(f"plan.offload_dtype must be one of "
                              f"{['', *_OFFLOAD_DTYPES]}, got {loaded.offload_dtype!r}")
        for key in ("strategy", "model", "inputs", "compiled", "device", "autocast",
                    "dtypes", "loss", "structure", "hooks"):
            _expect(getattr(loaded, key), str, f"plan.{key}")
        _check_head(loaded)
        _expect(loaded.training, bool, "plan.training")
        _expect(loaded.cached, bool, "plan.cached")
        check_loop_field(loaded.loop, "plan.loop")
        _expect(loaded.shards, int, "plan.shards")
        if loaded.shards < 1:
            raise SchemaError(f"plan.shards must be >= 1, got {loaded.shards}")
        if loaded.compiled_peak_bytes is not None:
            _expect(loaded.compiled_peak_bytes, int, "plan.compiled_peak_bytes")
        if loaded.compile_memory_budget is not None:
            fraction = loaded.compile_memory_budget
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
                    or not 0 < fraction < 1 or not loaded.compiled \
                    or loaded.recompute_blocks or loaded.offload_blocks:
                raise SchemaError(
                    f"plan.compile_memory_budget must be a number in (0, 1) on a compiled "
                    f"plan that keeps every block (at 0 compile's partitioner drops the "
                    f"random draws autoremat saves), got {fraction!r} (compiled "
                    f"{loaded.compiled!r}, {loaded.recompute_blocks} block(s) recomputed). "
                    f"{_REPLAN}")
        if loaded.budget_bytes is not None:
            _expect(loaded.budget_bytes, int, "plan.budget_bytes")
            if loaded.compiled_peak_bytes is not None:
                if loaded.compiled_peak_bytes > loaded.budget_bytes:
                    raise SchemaError(
                        f"plan.compiled_peak_bytes ({loaded.compiled_peak_bytes}) is above "
                        f"plan.budget_bytes ({loaded.budget_bytes}), which no plan autoremat "
                        f"makes states: the file was edited. {_REPLAN}")
            elif loaded.predicted_peak_bytes + loaded.margin_bytes > loaded.budget_bytes:
                raise SchemaError(
                    f"plan.predicted_peak_bytes ({loaded.predicted_peak_bytes}) plus "
                    f"plan.margin_bytes ({loaded.margin_bytes}) is above plan.budget_bytes "
                    f"({loaded.budget_bytes}), which no plan autoremat makes states: the "
                    f"file was edited. {_REPLAN}")
        elif loaded.margin_bytes:
            raise SchemaError(f"plan.margin_bytes is {loaded.margin_bytes} on a plan without a "
                              f"budget, which no plan autoremat makes states: the file was "
                              f"edited. {_REPLAN}")
        _check_seal(seal, as_read)
        if tape is not None:
            check_against_tape(loaded, tape)
        return loaded

    def __str__(self) -> str:
        rows = []
        for start, stop, decision in self.segments:
            for i in range(start, stop):
                block = self.blocks[i]
                what = (Decision.RECOMPUTE if decision is Decision.OFFLOAD_INPUT
                        else decision).value
                if decision is Decision.SELECTIVE and block.op_signature:
                    what += (f" (keep the outputs of {len(block.keep_ops)} ops, skip "
                             f"{len(block.skip_ops)} dead ops; recompute "
                             + ", ".join(block.recompute_ops) + ")")
                elif decision is Decision.SELECTIVE:
                    what += (" (save " + ", ".join(block.save_ops) + " outputs" if block.save_ops
                             else " (recompute all ops, keep the random draws")
                    if block.save_ops and block.recompute_ops:
                        what += "; recompute " + ", ".join(block.recompute_ops)
                    what += ")"
                if decision is Decision.OFFLOAD_INPUT:
                    what += " (its input in host memory)"
                if stop > start + 1:
                    what += f" (segment of {stop - start} blocks from {self.blocks[start].name})"
                rows.append([block.name, what])
        budget = format_bytes(self.budget_bytes) if self.budget_bytes is not None else "none"
        if self.margin_bytes:
            budget += (f" ({format_bytes(self.margin_bytes)} of it kept as margin"
                       + (" for the CUDA allocator's blocks" if self.device.startswith("cuda")
                          else "") + ")")
        head = (f"Plan ({self.strategy}) for {self.model}, inputs {self.inputs}\n"
                f"budget {budget}; predicted peak {format_bytes(self.predicted_peak_bytes)} "
                f"(unplanned {format_bytes(self.unplanned_peak_bytes)}); recompute "
                f"{self.predicted_recompute_flops / 1e9:.3f} GFLOPs = "
                f"{100 * self.recompute_overhead:.1f}% of the step; loop {self.loop}"
                + (f"; for the step compiled ({self.compiled})" if self.compiled else "")
                + (f"; compiled whole it measured {format_bytes(self.compiled_peak_bytes)}"
                   if self.compiled_peak_bytes is not None else "")
                + (f" under compile's activation_memory_budget={self.compile_memory_budget:g} "
                   f"(run it through autoremat.compile_model)"
                   if self.compile_memory_budget is not None else "")
                + (f"; {self.offload_blocks} block(s) offload "
                   f"{format_bytes(self.predicted_host_bytes)} to host memory"
                   if self.offload_blocks else "")
                + (f"; parameters sharded over {self.shards} ranks" if self.shards > 1
                   else "")
                + "\n" + conditions_line(self.loss, self.autocast, self.dtypes))
        if self.head.decision is Decision.CHUNKED:
            rows.append([f"{self.head_site.name if self.head_site else '?'} (loss head)",
                         f"chunked: {self.head_chunks} chunks of tokens, the full logits never "
                         f"built (out.logits is None); loss and the projection's weight "
                         f"gradient summed chunk by chunk"])
        notes = "".join(f"\nnote: {n}" for n in self.notes)
        return head + render_table(["block", "decision"], rows) + notes


def plan_key(chosen: Plan) -> tuple[Any, ...]:
    """What a plan runs: equal keys are the same plan (measured once). Keep-sets count:
    two plans that differ only in which op outputs a block keeps are different plans; so
    do compile's own memory budget and the loss head."""
    return (tuple((b.decision, b.segment, tuple(b.save_ops), tuple(b.keep_ops),
                   tuple(b.skip_ops)) for b in chosen.blocks),
            chosen.compile_memory_budget, chosen.head)


def _head_field(value: Any) -> Choice:
    """A plan file's head: "keep" or "chunked:N" (N >= 1)."""
    try:
        return Choice.head_from_key(value)
    except RematError:
        raise SchemaError(f"plan.head must be 'keep' or 'chunked:N' (N >= 1), got "
                          f"{value!r}") from None


def _head_site_field(value: Any) -> HeadAt | None:
    """A plan file's head site: "" (no head option) or "kind:name"."""
    if value == "":
        return None
    try:
        return HeadAt.parse(value)
    except RematError as exc:
        raise SchemaError(f"plan.head_site: {exc}") from None


def _check_head(plan: Plan) -> None:
    """A loaded plan's chunked head is at a named site."""
    if plan.head.decision is Decision.CHUNKED and plan.head_site is None:
        raise SchemaError("plan.head_site must be 'hf:<name>', 'ce:<name>' or "
                          "'module:<name>' for a chunked head, got ''")


def _expect(value: Any, kind: type, where: str) -> None:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        what = {int: "an integer", str: "a string", bool: "true or false"}.get(
            kind, kind.__name__)
        raise SchemaError(f"{where} must be {what}, got {value!r}")


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise SchemaError(f"{where} must be a list of strings, got {value!r}")
    return tuple(value)


def _decision_field(item: dict[str, Any], version: int, where: str) -> Decision:
    """A block's decision as a version-``version`` file writes it (NOTE [ Decisions in
    files ] in tape.py): by name; in version 1, an input-offloaded block as "recompute"
    with ``offload_input: true``, a field version 2 does not have."""
    allowed = tuple(d for d in BLOCK_DECISIONS  # version 1: offload_input was a flag
                    if version >= 2 or d is not Decision.OFFLOAD_INPUT)
    name = item.get("decision")
    names = [d.value for d in allowed]
    if not isinstance(name, str) or name not in names:
        raise SchemaError(f"{where}.decision must be one of {names}, got {name!r}"
                          + (did_you_mean(name, names) if isinstance(name, str) else ""))
    decision = Decision(name)
    if version == 1:
        offload_input = item.pop("offload_input", False)
        if not isinstance(offload_input, bool) or (
                offload_input and decision is not Decision.RECOMPUTE):
            raise SchemaError(f"{where}.offload_input must be false, or true on a "
                              f"recompute block, got {offload_input!r} on a "
                              f"{name!r} block")
        if offload_input:
            return Decision.OFFLOAD_INPUT
    return decision


def _check_keep_set(block: BlockDecision, where: str) -> None:
    """A keep-set indexes the block's op sequence: never trusted from a file."""
    for key in ("keep_ops", "skip_ops"):
        positions = getattr(block, key)
        if positions and block.decision is not Decision.SELECTIVE:
            raise SchemaError(f"{where}.{key} is set on a {block.decision.value!r} block; op "
                              "positions belong to selective blocks only")
        if any(i < 0 for i in positions) or list(positions) != sorted(set(positions)):
            raise SchemaError(f"{where}.{key} must be distinct op positions >= 0 in "
                              f"increasing order, got {list(positions)}")
    both = sorted(set(block.keep_ops) & set(block.skip_ops))
    if both:
        raise SchemaError(f"{where}: ops {both} are both kept and skipped; an op whose "
                          "output is kept is never skipped. Plan again instead of editing")
    if block.keep_keys and not block.keep_ops:
        raise SchemaError(f"{where}.keep_keys is set without keep_ops; they name the same "
                          "kept ops. Plan again instead of editing")
    try:
        parse_keep_keys(block.keep_keys)
    except RematError as exc:
        raise SchemaError(f"{where}.keep_keys: {exc}") from exc
    if (block.keep_ops or block.skip_ops) and not block.op_signature:
        raise SchemaError(f"{where}.op_signature is empty, but keep_ops/skip_ops index an op "
                          "sequence it must name; plan again instead of editing")
    if (block.keep_ops or block.skip_ops) and block.keep_seal != keep_set_seal(
            block.op_signature, block.keep_ops, block.skip_ops):
        raise SchemaError(f"{where}: its keep-set (keep_ops {list(block.keep_ops)}, skip_ops "
                          f"{list(block.skip_ops)}) is not the one the planner sealed "
                          "(keep_seal): it was edited, and a keep-set that skips an op "
                          "whose output backward needs gives wrong gradients. Plan again "
                          "instead of editing")


def keep_set_seal(signature: str, keep: tuple[int, ...], skip: tuple[int, ...]) -> str:
    """The seal of a keep-set the planner chose (see ``BlockDecision.keep_seal``).

    NOTE [ Sealed keep-sets ]
        Whether a keep-set's skipped ops are dead depends on the block's dataflow, which
        a plan file does not carry; the planner derived them from the tape. So a plan
        records a hash binding the op sequence to the positions it chose, and loading
        refuses positions that do not match it: an edit is caught, not trusted (an edited
        keep-set that skips an op backward needs gives gradients off by hundreds).
    """
    text = f"{signature}|{','.join(map(str, keep))}|{','.join(map(str, skip))}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_REPLAN = ("Plan again instead of editing: autoremat.plan(autoremat.profile(model, inputs), "
           "budget), or `autoremat plan TARGET --budget B --out plan.json`")


class UnsealedPlanWarning(UserWarning):
    """A plan file carries no seal (saved before plans were sealed): nothing shows
    whether it was edited, so its figures are not checked (NOTE [ Sealed plan files ])."""


def plan_seal(data: dict[str, Any]) -> str:
    """The seal of a plan's JSON fields (every field but ``seal``), as ``to_json`` writes
    it and ``from_json`` checks it.

    NOTE [ Sealed plan files ]
        A plan's figures (predicted peak, recompute FLOPs, cost) are derived by the
        planner from the tape and the decisions; the file carries the result, not the
        tape. An edited file (a decision changed from recompute to keep, a block entry
        duplicated or deleted, two blocks joined into one segment, the budget or the
        head changed) still loads and applies, and states a peak its decisions no longer
        give: edited plans measured up to 2.5x their stated peak. So ``to_json`` writes
        a hash over every other field as they are written (``seal``), and ``from_json``
        refuses a file whose fields do not hash to it. The hash covers the fields as the
        file has them, so a file written before a field was added still matches its own
        seal. A file without a seal (saved before plans were sealed) loads, with an
        :class:`UnsealedPlanWarning`, since nothing shows whether it was edited; it can
        only be checked against its tape: ``Plan.from_json(path, tape=tape)`` derives
        the predictions again from the decisions and the tape (:func:`check_against_tape`)
        and refuses a plan whose stated figures differ, sealed or not. A plan changed in
        memory (``dataclasses.replace``) is the caller's own and is sealed as it is when
        written; ``check_against_tape`` checks it too. The seal guards against edits,
        not forgery: it is a checksum, not a signature.
    """
    body = {key: value for key, value in data.items() if key != "seal"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_seal(seal: Any, data: dict[str, Any]) -> None:
    if seal is None or seal == "":
        warnings.warn("autoremat: this plan file has no seal (it was saved before plans "
                      "were sealed), so an edit of it cannot be detected and its predicted "
                      "peak is not checked; pass tape= to Plan.from_json to check it against "
                      "its tape, or plan again and save the new plan", UnsealedPlanWarning,
                      stacklevel=3)
        return
    if not isinstance(seal, str):
        raise SchemaError(f"plan.seal must be a string, got {seal!r}")
    if seal != plan_seal(data):
        raise SchemaError(
            f"this plan file was edited after autoremat wrote it (its fields do not match "
            f"its seal {seal!r}): an edited decision, segment, block entry, budget or head "
            f"changes the peak the plan gives, but not the peak it states, so it is not "
            f"trusted. {_REPLAN}")


def check_against_tape(plan: Plan, tape: Tape) -> None:
    """Derive ``plan``'s predictions again from its decisions and ``tape``, and refuse a
    plan that states other figures (NOTE [ Sealed plan files ]).

    Raises:
        SchemaError: the plan's blocks are not the tape's, its decisions name options the
            tape did not measure, or its predicted figures differ from the re-derived ones.

    Example:
        >>> import autoremat
        >>> model, inputs = autoremat.zoo.build("mlp", widths=(64,) * 4, batch_size=32)
        >>> tape = autoremat.profile(model, inputs, repeats=1)
        >>> check_against_tape(autoremat.plan(tape, None, "every:2"), tape)  # it holds
    """
    if not isinstance(plan, Plan) or not isinstance(tape, Tape):
        raise RematError(f"check_against_tape() needs a Plan and a Tape, got "
                         f"{type(plan).__name__} and {type(tape).__name__}")
    names = [b.name for b in tape.blocks]
    if plan.model != tape.model or [b.name for b in plan.blocks] != names:
        raise SchemaError(
            f"this plan (model {plan.model}, blocks {[b.name for b in plan.blocks]}) does "
            f"not decide the blocks of this tape (model {tape.model}, blocks {names}): a "
            f"block entry was added, deleted or renamed, or the tape is of another model. "
            f"Pass the tape the plan was made from. {_REPLAN}")
    if plan.head.decision is not Decision.KEEP and (
            tape.head is None or plan.head.head_key not in tape.head.options):
        have = ["keep", *(tape.head.options if tape.head is not None else [])]
        raise SchemaError(f"plan.head is {plan.head.head_key!r}, which this tape did not measure "
                          f"(it offers {have}). {_REPLAN}")
    segments = [(start, stop, _choice_of(tape, plan, start, stop, decision))
                for start, stop, decision in plan.segments]
    again = _with_head_fields(plan_of_segments(with_head(tape, plan.head), segments,
                                               plan.strategy, plan.budget_bytes),
                              tape, plan.head)
    wrong = [f"{key} {getattr(plan, key)} (it gives {getattr(again, key)})"
             for key in ("predicted_peak_bytes", "predicted_recompute_flops",
                         "predicted_cost", "predicted_host_bytes", "unplanned_peak_bytes",
                         "step_flops")
             if getattr(plan, key) != getattr(again, key)]
    if wrong:
        raise SchemaError(f"this plan's decisions do not give the figures it states on "
                          f"this tape: {'; '.join(wrong)}. It was edited, or made from "
                          f"another tape. {_REPLAN}")


def _choice_of(tape: Tape, plan: Plan, start: int, stop: int, decision: Decision) -> Choice:
    """The peak model's choice for the plan's segment ``[start, stop)``."""
    block = plan.blocks[start]
    where = f"plan.blocks[{start}] ({block.name})"
    for k in range(start + 1, stop):
        if not tape.joins_previous(k):
            raise SchemaError(f"plan.blocks[{k}] ({plan.blocks[k].name}) shares a segment "
                              f"with the block before it, which this tape does not allow "
                              f"(they are not chained, or the step is compiled). {_REPLAN}")
    if decision.offloads and not tape.offload:
        raise SchemaError(f"{where} is {decision.value!r}, which this tape did not measure "
                          f"(it was profiled without offload=True). {_REPLAN}")
    if decision is not Decision.SELECTIVE:
        return Choice(decision)
    measured = tape.blocks[start].selective
    if block.keep_ops or block.skip_ops:
        for name, sel in measured.items():
            if is_keep_set(name) and (sel.keep_ops, sel.skip_ops) == (block.keep_ops,
                                                                      block.skip_ops):
                return Choice.selective_from_key(name)
        raise SchemaError(f"{where} keeps ops {list(block.keep_ops)} and skips "
                          f"{list(block.skip_ops)}, a keep-set this tape did not measure. "
                          f"{_REPLAN}")
    name = save_set_name(block.save_ops)
    if name not in measured:
        raise SchemaError(f"{where} saves {list(block.save_ops)}, a save-set this tape did "
                          f"not measure (it has {sorted(measured)}). {_REPLAN}")
    return Choice(Decision.SELECTIVE, save_ops=block.save_ops)


def _check_segments(blocks: list[BlockDecision]) -> None:
    """Segments number the chain from 0 up, one step at a time; only recomputed blocks
    share one (a kept or selective block is a segment of its own); each block once."""
    seen: dict[str, int] = {}
    for i, block in enumerate(blocks):
        if block.name in seen:
            raise SchemaError(f"plan.blocks[{i}] names block {block.name!r} again (it is "
                              f"plan.blocks[{seen[block.name]}]); a plan decides each block "
                              f"once. {_REPLAN}")
        seen[block.name] = i
    for i, block in enumerate(blocks):
        prev = blocks[i - 1].segment if i else -1
        allowed = (prev, prev + 1) if i else (0,)
        if block.segment not in allowed:
            raise SchemaError(f"plan.blocks[{i}].segment must be "
                              f"{' or '.join(map(str, allowed))} (segments number the blocks "
                              f"in order from 0), got {block.segment}")
        if i and block.segment == prev and not (
                block.decision is blocks[i - 1].decision is Decision.RECOMPUTE):
            raise SchemaError(f"plan.blocks[{i - 1}] and plan.blocks[{i}] share segment "
                              f"{prev}, but only recomputed blocks whose input stays on the "
                              f"device can share one (got {blocks[i - 1].decision.value!r} "
                              f"and {block.decision.value!r})")


def _decision(tape: Tape, i: int, segment: int, choice: Choice) -> BlockDecision:
    """Block ``i``'s decision under ``choice``; a selective one names the op kinds it
    re-runs in backward (dropout copies its kept draws back; see NOTE [ Our own selective
    contexts, and random bits ])."""
    block = tape.blocks[i]
    kind = choice.decision
    if kind is not Decision.SELECTIVE:  # keep, recompute, offload, offload_input
        return BlockDecision(block.name, kind, segment, params=block.param_signature)
    if choice.keep_set:
        sel = block.selective[choice.selective_key]
        redo = sorted({o.kind for j, o in enumerate(block.ops) if not o.view
                       and j not in sel.keep_ops and j not in sel.skip_ops})
        op_names = [o.op for o in block.ops]
        signature = op_signature(op_names)
        return BlockDecision(block.name, kind, segment, (), tuple(redo), sel.keep_ops,
                             sel.skip_ops, signature,
                             format_keep_keys(keep_keys(op_names, sel.keep_ops)),
                             params=block.param_signature,
                             keep_seal=keep_set_seal(signature, sel.keep_ops, sel.skip_ops))
    save = choice.save_ops
    redo = [k for k, s in block.op_stats.items() if s.count and k not in save]
    return BlockDecision(block.name, kind, segment, save, tuple(redo),
                         params=block.param_signature)


def _with_head_fields(found: Plan, tape: Tape, head: Choice) -> Plan:
    if head.decision is Decision.KEEP or tape.head is None:
        return found
    option = tape.head.options[head.head_key]
    site = HeadAt(cast(HeadKind, tape.head.kind), tape.head.name)
    return dataclasses.replace(found, head=head, head_site=site,
                               predicted_cost=found.predicted_cost + option.cost)


_OFFLOAD_DTYPES = ("bfloat16", "float16")


def plan_of_segments(tape: Tape, segments: Segments, strategy: str,
                     budget_bytes: int | None = None) -> Plan:
    """The plan that runs ``segments`` (consecutive ``(start, stop, choice)``), with its
    predictions; no budget check."""
    costs = plan_costs(tape, segments)
    peak = predict_peak(tape, segments)
    decisions = []
    for seg_index, (start, stop, choice) in enumerate(segments):
        for i in range(start, stop):
            decisions.append(_decision(tape, i, seg_index, choice))
    return Plan(
        strategy=strategy, blocks=tuple(decisions), budget_bytes=budget_bytes,
        predicted_peak_bytes=peak,
        predicted_recompute_flops=sum(c.flops for c in costs),
        predicted_cost=sum(c.rank_cost for c in costs),
        predicted_host_bytes=sum(_host_bytes(tape, start, choice)
                                 for start, _, choice in segments),
        unplanned_peak_bytes=tape.step_peak_bytes, step_flops=tape.step_flops,
        model=tape.model, inputs=tape.inputs, loop=tape.loop, compiled=tape.compiled,
        device=tape.device, training=tape.training, autocast=tape.autocast,
        dtypes=tape.dtypes, loss=tape.loss, structure=tape.structure, hooks=tape.hooks,
        cached=tape.cached,
    )


def _host_bytes(tape: Tape, start: int, choice: Choice) -> int:
    """Bytes a segment copies to host memory in one step (the tape's, uncompressed)."""
    if choice.decision is Decision.OFFLOAD:
        return tape.blocks[start].offload_bytes
    if choice.decision is Decision.OFFLOAD_INPUT:
        return tape.blocks[start].offload_input_bytes
    return 0
