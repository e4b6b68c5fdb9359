"""Plain-text tables for tapes, plans and reports (``print`` shows these)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .units import format_bytes

if TYPE_CHECKING:
    from .tape import Tape

__all__ = ["ops_table", "render_table", "tape_table"]


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Align columns; numbers right, text left."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [
        all(_looks_numeric(row[i]) for row in cells[1:]) if rows else False
        for i in range(len(headers))
    ]

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if num else c.ljust(w)
                 for c, w, num in zip(row, widths, numeric, strict=False)]
        return "  ".join(parts).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out.extend(line(row) for row in cells[1:])
    return "\n".join(out)


def _looks_numeric(text: str) -> bool:
    head = text.split(" ")[0].replace(".", "", 1).replace("-", "", 1).replace("%", "")
    return head.isdigit()


def _flops(n: int) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def tape_table(tape: Tape) -> str:
    rows = []
    for b in tape.blocks:
        kinds = sorted(b.saved_bytes_by_kind.items(), key=lambda kv: -kv[1])[:3]
        top = ", ".join(f"{k} {100 * v / max(b.saved_bytes, 1):.0f}%" for k, v in kinds if v)
        rows.append([
            b.name, f"{b.fwd_ms:.2f}", f"{b.bwd_ms:.2f}", _flops(b.fwd_flops),
            format_bytes(b.saved_bytes), format_bytes(b.input_bytes),
            format_bytes(b.param_bytes), top,
        ])
    table = render_table(
        ["block", "fwd ms", "bwd ms", "fwd FLOPs", "saved", "input", "params", "saved by op kind"],
        rows,
    )
    bd = ", ".join(f"{k} {format_bytes(v)}" for k, v in tape.peak_breakdown.items())
    head = (f"Tape of {tape.model} on {tape.device}, inputs {tape.inputs}\n"
            f"step peak {format_bytes(tape.step_peak_bytes)} ({bd}); "
            f"all blocks checkpointed: {format_bytes(tape.ckpt_step_peak_bytes)}; "
            f"loop {tape.loop}{_held(tape)}\n"
            f"parameters {format_bytes(tape.param_bytes)}, buffers "
            f"{format_bytes(tape.buffer_bytes)}, gradients {format_bytes(tape.grad_bytes)}; "
            f"step {tape.step_ms:.1f} ms, {_flops(tape.step_flops)}FLOPs\n")
    notes = "".join(f"\nnote: {n}" for n in tape.notes)
    return head + table + notes


def _held(tape: Tape) -> str:
    if tape.output_bytes < 0:
        return ""
    what = "held through backward" if tape.loop == "holds_output" else "released before it"
    return f" (output {format_bytes(tape.output_bytes)}, {what})"


def ops_table(tape: Tape, block: str) -> str:
    """The forward ops of one block of ``tape``, in order, with what backward keeps."""
    from .errors import RematError, did_you_mean

    names = [b.name for b in tape.blocks]
    if block not in names:
        raise RematError(f"no block {block!r} in the tape of {tape.model}."
                         + did_you_mean(block, names) + f" Blocks: {', '.join(names[:8])}"
                         + (", ..." if len(names) > 8 else ""))
    profile = tape.blocks[names.index(block)]
    if not profile.ops:
        raise RematError(f"the tape has no per-op trace for {block!r} (made by an older "
                         "autoremat); profile the model again")
    rows = []
    for i, r in enumerate(profile.ops):
        flags = ",".join(f for f, on in (("random", r.random), ("view", r.view),
                                         ("in-place", r.inplace),
                                         ("not saved", r.kept_bytes > 0 and not r.saved))
                         if on)
        reads = ",".join(map(str, r.inputs)) + (f" (writes {r.target})" if r.target >= 0 else "")
        rows.append([i, r.op.removeprefix("aten."), r.kind, format_bytes(r.out_bytes),
                     format_bytes(r.kept_bytes) if r.kept_bytes else "-", _flops(r.flops),
                     f"{r.ms:.3f}", reads or "-", flags])
    kept = sum(r.kept_bytes for r in profile.ops)
    return (f"{block}: {len(profile.ops)} forward ops; backward keeps "
            f"{format_bytes(kept)} of them (\"kept\": alive when backward starts; \"reads\": "
            "the ops whose outputs it reads)\n"
            + render_table(["#", "op", "kind", "creates", "kept", "FLOPs", "ms", "reads",
                            "flags"], rows))
