"""Tests for autoremat in a training loop under Hugging Face Accelerate.

``accelerator.prepare(model)`` before ``autoremat.auto`` (the recipe in
docs/accelerate.md) and after ``apply`` both work: the loop's gradients are ``torch.equal``
to the same loop without a plan, the plan is removed cleanly, and, planned after
``prepare`` (so that the profile runs the forward Accelerate runs: its autocast, and the
float32 copies of the outputs under mixed precision), each step measures at most the
plan's prediction. Accelerate's mixed precision is recorded in ``plan.autocast``; a plan
made before ``prepare`` without it is warned about at the first forward.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import accelerate
import pytest
import torch
import transformers
from torch import nn

import autoremat
from autoremat import StepMismatchWarning

from _steps import recomputing, snapshot

VOCAB, SEQ, BATCH, STEPS = 128, 16, 2, 2


@pytest.fixture(autouse=True)
def _fresh_accelerator_state() -> Iterator[None]:
    # Accelerate keeps one state per process: a new mixed precision needs it reset
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    yield
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


def _model(kind: str) -> tuple[nn.Module, list[Any]]:
    """A small causal LM (dropout on) and ``STEPS`` batches for it."""
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    if kind == "zoo":
        model, _ = autoremat.zoo.build("llama", n_layer=2, n_embd=32, n_head=4, n_kv_head=2,
                                       ffn_hidden=64, vocab_size=VOCAB, batch_size=BATCH,
                                       seq_len=SEQ)
        return model.train(), [{"input_ids": x, "labels": x.roll(-1, 1)} for x in ids]
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, use_cache=False))
    return model.train(), [{"input_ids": x, "labels": x.clone()} for x in ids]


def _backward_loss(accelerator: accelerate.Accelerator) -> Any:
    """The loss as ``accelerator.backward`` takes it: ``out.loss`` divided by the
    accumulation steps, a copy held through backward beside ``out.loss``."""
    def loss(out: Any) -> torch.Tensor:
        return out.loss / accelerator.gradient_accumulation_steps  # type: ignore[no-any-return]
    return loss


def _loop(accelerator: accelerate.Accelerator, model: nn.Module,
          batches: list[Any]) -> tuple[list[int], list[dict[str, torch.Tensor]]]:
    """The Accelerate loop (``out = model(**batch); accelerator.backward(out.loss)``) for
    each batch: each step's measured peak and gradients."""
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    peaks, grads = [], []
    for i, batch in enumerate(batches):
        torch.manual_seed(10 + i)  # dropout
        with autoremat.track_memory() as mem:
            out = model(**batch)
            accelerator.backward(out.loss)
            del out
        peaks.append(mem.peak_bytes)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return peaks, grads


def _plain(kind: str, precision: str) -> tuple[list[int], list[dict[str, torch.Tensor]]]:
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision=precision)
    model, batches = _model(kind)
    result = _loop(accelerator, accelerator.prepare(model), batches)
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    return result


def _assert_same(ours: list[dict[str, torch.Tensor]],
                 theirs: list[dict[str, torch.Tensor]]) -> None:
    assert len(ours) == len(theirs) == STEPS
    for a, b in zip(ours, theirs, strict=True):
        assert a.keys() == b.keys() and a
        differ = [n for n in a if not torch.equal(a[n], b[n])]
        assert differ == [], f"gradients differ from the loop without a plan: {differ[:3]}"


@pytest.mark.parametrize(("kind", "precision"), [("gpt2", "no"), ("gpt2", "bf16"),
                                                 ("zoo", "bf16")])
def test_prepare_then_auto_fits_its_prediction_with_the_plain_gradients(
        kind: str, precision: str) -> None:
    plain_peaks, plain_grads = _plain(kind, precision)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision=precision)
    model, batches = _model(kind)
    model = accelerator.prepare(model)
    before = snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StepMismatchWarning)
        warnings.simplefilter("error", autoremat.ShapeMismatchWarning)
        plan = autoremat.auto(model, batches[0], budget="75%",
                              loss_fn=_backward_loss(accelerator))
        peaks, grads = _loop(accelerator, model, batches)
    assert recomputing(plan) and plan.loop == "holds_output"
    # Accelerate's mixed precision, which wraps the prepared forward in autocast
    assert plan.autocast == ("cpu:bfloat16" if precision == "bf16" else "")
    _assert_same(grads, plain_grads)
    assert all(peak <= plan.predicted_peak_bytes for peak in peaks), \
        (peaks, plan.predicted_peak_bytes)
    assert peaks[0] >= 0.97 * plan.predicted_peak_bytes and max(peaks) < min(plain_peaks)
    autoremat.remove(model)
    assert snapshot(model) == before


_PREPARE_ADDS = {"_is_accelerate_prepared"}  # the attribute accelerator.prepare sets


def test_apply_then_prepare_keeps_the_plan_and_the_plain_gradients() -> None:
    plain_peaks, plain_grads = _plain("gpt2", "no")
    model, batches = _model("gpt2")
    before = snapshot(model)
    accelerator = accelerate.Accelerator(cpu=True)
    plan = autoremat.auto(model, batches[0], budget="75%", loss_fn=_backward_loss(accelerator))
    prepared = accelerator.prepare(model)
    assert autoremat.applied_plan(prepared) is plan
    with warnings.catch_warnings():
        warnings.simplefilter("error", StepMismatchWarning)
        peaks, grads = _loop(accelerator, prepared, batches)
    _assert_same(grads, plain_grads)
    # without mixed precision prepare leaves the forward as it was: the step planned
    assert all(peak <= plan.predicted_peak_bytes for peak in peaks)
    assert max(peaks) < min(plain_peaks)
    autoremat.remove(prepared)
    after = snapshot(model)
    assert {k: v for k, v in after.items() if k != "attrs"} == \
        {k: v for k, v in before.items() if k != "attrs"}
    added = {a for name, attrs in after["attrs"].items()
             for a in set(attrs) - set(before["attrs"][name])}
    assert added <= _PREPARE_ADDS, added  # what prepare added, nothing of autoremat's


def test_mixed_precision_after_apply_is_warned_about_at_the_first_forward() -> None:
    # bf16 from Accelerate's config wraps the forward in autocast after the plan was made
    # without it: the plan's conditions say so at the first forward
    _, plain_grads = _plain("gpt2", "bf16")
    model, batches = _model("gpt2")
    plan = autoremat.auto(model, batches[0], budget="75%")
    assert plan.autocast == ""
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    prepared = accelerator.prepare(model)
    with pytest.warns(StepMismatchWarning, match="autocast cpu:bfloat16"):
        _, grads = _loop(accelerator, prepared, batches)
    _assert_same(grads, plain_grads)  # still the plain gradients
    autoremat.remove(prepared)
    assert autoremat.applied_plan(prepared) is None
