"""One training step of the plain model and one of the planned model, compared exactly.

``assert_same_step`` runs both from the same RNG state and BatchNorm statistics and
asserts ``torch.equal`` on the loss and on every gradient (independently of ``verify``);
``snapshot`` records what ``apply`` installs and ``remove`` must take away again. Shared by
test_apply.py and test_auto.py. ``Tokens`` is the token data set the training-framework
tests (test_hf.py, test_lightning.py) train on; ``ResidualMlp`` a block several tests
build chains of.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import autoremat
from autoremat import Decision, Plan


def call(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a dict, ``model(*inputs)`` for a tuple, else ``model(inputs)``."""
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


def _loss(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else out


def step(model: nn.Module, inputs: Any, seed: int = 0) -> tuple[torch.Tensor, dict[str, Any]]:
    """One step from a fixed RNG state; returns the loss and a copy of every gradient."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = _loss(call(model, inputs))
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    return loss.detach(), grads


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers()}


def _restore(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])


def assert_same_step(model: nn.Module, inputs: Any, plan: Plan) -> None:
    """A step of the plain model and one with ``plan`` applied (left applied) give equal
    losses, gradients and buffers (BatchNorm statistics: a recompute must not update
    them twice); the buffers are restored after each."""
    start = _buffers(model)
    autoremat.remove(model)
    plain_loss, plain = step(model, inputs)
    plain_buffers = _buffers(model)
    _restore(model, start)
    autoremat.apply(model, plan)
    planned_loss, planned = step(model, inputs)
    planned_buffers = _buffers(model)
    _restore(model, start)
    assert torch.equal(plain_loss, planned_loss)
    moved = [n for n in plain_buffers if not torch.equal(plain_buffers[n], planned_buffers[n])]
    assert moved == [], f"buffers differ under {plan.strategy}: {moved[:5]}"
    assert plain.keys() == planned.keys()
    differ = [n for n in plain if (plain[n] is None) != (planned[n] is None) or
              (plain[n] is not None and not torch.equal(plain[n], planned[n]))]
    assert differ == [], f"gradients differ under {plan.strategy}: {differ[:5]}"
    assert any(g is not None for g in planned.values())


def verified(model: nn.Module, inputs: Any, plan: Plan, **options: Any) -> Any:
    """``autoremat.verify`` of ``plan`` applied to ``model`` (removed after, whatever
    happens); ``options`` go to ``verify``."""
    autoremat.apply(model, plan)
    try:
        return autoremat.verify(model, inputs, plan, **options)
    finally:
        autoremat.remove(model)


def exact(model: nn.Module, inputs: Any, plan: Plan, **options: Any) -> Any:
    """:func:`verified`, which must give gradients equal to the plain model's and measure
    the plan's prediction to the byte; the report."""
    report = verified(model, inputs, plan, **options)
    assert report.ok and report.max_grad_diff == 0.0, (plan.strategy, report)
    assert report.peak_bytes == plan.predicted_peak_bytes, (plan.strategy, report)
    return report


def single_block_plans(model: nn.Module, inputs: Any, tape: autoremat.Tape,
                       loss_fn: Any = None, combos: Any = None
                       ) -> dict[tuple[Any, ...], tuple[int, int]]:
    """Every plan keeping or recomputing each block alone (or those of ``combos``),
    applied and run once under ``track_memory`` (in the caller's autocast, if any):
    ``(predicted, measured)`` peaks by the blocks' choices (``KEEP``, ``RECOMPUTE``)."""
    import itertools

    from autoremat._core.decisions import KEEP, RECOMPUTE

    if combos is None:
        combos = itertools.product((KEEP, RECOMPUTE), repeat=len(tape.blocks))
    return {combo: segments_peaks(model, inputs, tape,
                                  [(i, i + 1, c) for i, c in enumerate(combo)], loss_fn)
            for combo in combos}


def segments_peaks(model: nn.Module, inputs: Any, tape: autoremat.Tape,
                   segments: Any, loss_fn: Any = None) -> tuple[int, int]:
    """The plan of ``segments`` (``(start, stop, choice)``, as the peak model reads
    them), applied and run once under ``track_memory``: ``(predicted, measured)``."""
    from autoremat._core.step import run_step
    from autoremat._plan.plan import plan_of_segments

    plan = plan_of_segments(tape, segments, "t")
    autoremat.apply(model, plan)
    try:
        with autoremat.track_memory() as mem:
            run_step(model, inputs, loss_fn)
    finally:
        autoremat.remove(model)
        model.zero_grad(set_to_none=True)
    return plan.predicted_peak_bytes, mem.peak_bytes


def recomputing(plan: Plan) -> bool:
    """Whether ``plan`` recomputes anything."""
    return any(b.decision is not Decision.KEEP for b in plan.blocks)


def _hook_dicts(module: nn.Module) -> dict[str, list[int]]:
    return {attr: list(value) for attr, value in vars(module).items()
            if "hook" in attr and isinstance(value, dict)}


def snapshot(model: nn.Module) -> dict[str, Any]:
    """What ``apply`` may change and ``remove`` must restore: attributes, hooks, state-dict
    keys, parameter identities and train/eval flags of every submodule."""
    return {
        "attrs": {n: sorted(vars(m)) for n, m in model.named_modules(remove_duplicate=False)},
        "hooks": {n: _hook_dicts(m) for n, m in model.named_modules(remove_duplicate=False)},
        "state_dict": list(model.state_dict()),
        "params": [(n, id(p)) for n, p in model.named_parameters()],
        "training": [m.training for m in model.modules()],
    }


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Eight sequences of ``seq`` token ids below ``vocab`` (seed 2), each its own label."""

    def __init__(self, vocab: int = 128, seq: int = 16) -> None:
        self.ids = torch.randint(3, vocab, (8, seq), generator=torch.Generator().manual_seed(2))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


class ResidualMlp(nn.Module):
    """``x + down(relu(up(x)))``, ``expand`` times as wide inside: a residual MLP block."""

    def __init__(self, width: int, expand: int = 2) -> None:
        super().__init__()
        self.up = nn.Linear(width, expand * width)
        self.down = nn.Linear(expand * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class DenseLayer(nn.Module):
    """Takes the list of every feature so far (DenseNet's dense layer)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return F.gelu(self.fc(torch.stack(features).sum(0)))


class DenseChain(nn.Module):
    """Appends each layer's output to the list it passed the layer (DenseNet's block)."""

    def __init__(self, d: int = 32, n: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DenseLayer(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for block in self.blocks:
            features.append(block(features))
        return torch.stack(features).pow(2).mean()
