"""Tests for ``loop=``: which training loop a step, a tape and a plan's budget are for.

The loop most users write, ``out = model(**batch); out.loss.backward()``, keeps the
model's output (logits) alive through backward. autoremat measures that loop by default
(``"holds_output"``), so a budget it plans holds for it; ``"loss_only"`` measures a loop
that keeps only the loss. See NOTE [ Which loop a step models ] in ``step.py``.

The users' loops here are written by hand and measured with ``track_memory`` as docs/design.md
defines the step peak (gradients ``None`` first; bytes above the level before forward).
Tolerances: exact on zoo models; within 1% of the prediction on Hugging Face models,
where a few hundred bytes held outside the chain of blocks (rotary/mask tensors) may
move with the plan.
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import autoremat
from autoremat import LoopError, Plan, SchemaError, Tape, zoo
from autoremat._core.step import LOOPS, Loop, call_model, run_step
from autoremat._estimate.estimate import estimate
from autoremat._estimate.tracked_step import meta_step_peak

# Tiny transformers: 2 layers, width 32, a batch of 4 x 32 tokens, 128-token vocabulary,
# dropout on. Blocks' activations dominate the step, so that 75% and 62% are feasible.
_WIDTH, _SEQ, _BATCH, _VOCAB = 32, 32, 4, 128
_ZOO: dict[str, dict[str, Any]] = {
    "gpt2": {"n_layer": 2, "n_embd": _WIDTH, "n_head": 2, "vocab_size": _VOCAB,
             "batch_size": _BATCH, "seq_len": _SEQ},
    "llama": {"n_layer": 2, "n_embd": _WIDTH, "n_head": 2, "n_kv_head": 1,
              "ffn_hidden": 2 * _WIDTH, "vocab_size": _VOCAB, "batch_size": _BATCH,
              "seq_len": _SEQ},
}
_BUDGETS = ("75%", "62%")  # the smallest feasible budget is 53-59% of the plain peak here


def _hf(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "hf-gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=_WIDTH, n_head=2, vocab_size=_VOCAB, n_positions=_SEQ,
            attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1, bos_token_id=0, eos_token_id=0))
    else:
        config_class, model_class = {
            "hf-llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "hf-qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        }[name]
        model = model_class(config_class(
            hidden_size=_WIDTH, intermediate_size=2 * _WIDTH, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, vocab_size=_VOCAB,
            max_position_embeddings=_SEQ, attention_dropout=0.1))
    model.train()
    ids = torch.randint(0, _VOCAB, (_BATCH, _SEQ))  # (B, T)
    return model, {"input_ids": ids, "labels": ids.clone()}


def _build(name: str) -> tuple[nn.Module, Any]:
    return _hf(name) if name.startswith("hf-") else zoo.build(name, **_ZOO[name])


def _users_step(model: nn.Module, inputs: Any, *, keep_output: bool = True) -> int:
    """The step peak of a loop written by hand: ``out = model(**batch);
    out.loss.backward()``, or with ``keep_output=False`` ``loss = model(**batch).loss;
    loss.backward()``."""
    for p in model.parameters():
        p.grad = None
    with autoremat.track_memory() as mem:
        if keep_output:
            out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
            out.loss.backward()
            del out
        else:
            loss = (model(**inputs) if isinstance(inputs, dict) else model(*inputs)).loss
            loss.backward()
            del loss
    for p in model.parameters():
        p.grad = None
    return mem.peak_bytes


# --- the budget holds for the loop users write ----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "hf-gpt2", "hf-llama", "hf-qwen2"])
def test_a_loop_that_holds_the_output_stays_within_the_budget(name: str) -> None:
    model, inputs = _build(name)
    for budget in _BUDGETS:
        plan = autoremat.auto(model, inputs, budget=budget)
        assert plan.loop == "holds_output"
        assert plan.recompute_blocks > 0, "the budget should call for recomputation"
        peak = _users_step(model, inputs)
        autoremat.remove(model)
        assert plan.budget_bytes is not None
        assert peak <= plan.budget_bytes, (budget, peak, plan.budget_bytes)
        if name.startswith("hf-"):
            assert peak == pytest.approx(plan.predicted_peak_bytes, rel=0.01), budget
        else:
            assert peak == plan.predicted_peak_bytes, budget


# --- the difference is real: the held output --------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_holding_the_output_adds_its_bytes_to_the_step_peak(name: str) -> None:
    # Logits large next to the blocks' activations: a 512-class head on the MLP, and GPT-2
    # with its zoo vocabulary of 1024. The plain and the all-checkpointed peaks both fall
    # after the forward, while the output is held, so each rises by exactly its bytes.
    model, inputs = (zoo.build("mlp", widths=(64, 48, 64), d_in=32, n_classes=512,
                               batch_size=64) if name == "mlp" else
                     zoo.build("gpt2", n_layer=2, batch_size=2, seq_len=64))
    tapes = {loop: autoremat.profile(model, inputs, repeats=1, with_selective=False,
                                     timing=False, loop=loop) for loop in LOOPS}
    held, loss_only = tapes["holds_output"], tapes["loss_only"]
    logits = call_model(model, inputs).logits
    assert held.output_bytes == loss_only.output_bytes == logits.numel() * logits.element_size()
    assert held.loop == "holds_output" and loss_only.loop == "loss_only"
    assert held.step_peak_bytes - loss_only.step_peak_bytes == held.output_bytes
    assert held.ckpt_step_peak_bytes - loss_only.ckpt_step_peak_bytes == held.output_bytes
    # A plan made for the loss-only loop is exceeded by the user's loop that holds the
    # output by that much; the one made for it is exact.
    for tape in (loss_only, held):
        plan = autoremat.plan(tape, None, "full")
        autoremat.apply(model, plan)
        peak = _users_step(model, inputs)
        autoremat.remove(model)
        extra = held.output_bytes if tape is loss_only else 0
        assert peak == plan.predicted_peak_bytes + extra, tape.loop


def test_run_step_holds_the_output_until_backward_has_run() -> None:
    model, inputs = zoo.build("mlp", widths=(16, 16), d_in=8, batch_size=4)
    cases: tuple[tuple[Loop, bool], ...] = (("holds_output", True), ("loss_only", False))
    for loop, alive_in_backward in cases:
        refs: list[weakref.ref[Any]] = []
        seen: list[bool] = []

        def loss_fn(out: Any, refs: list[weakref.ref[Any]] = refs,
                    seen: list[bool] = seen) -> torch.Tensor:
            refs.append(weakref.ref(out))
            out.loss.register_hook(lambda g: seen.append(refs[0]() is not None))
            return out.loss  # type: ignore[no-any-return]

        run_step(model, inputs, loss_fn, loop=loop)
        assert seen == [alive_in_backward], loop
        assert refs[0]() is None, loop  # released before run_step returns
        for p in model.parameters():
            p.grad = None


# --- loss_only end to end ----------------------------------------------------------------


def test_a_loss_only_plan_fits_a_loop_that_keeps_only_the_loss() -> None:
    model, inputs = _build("gpt2")
    plan = autoremat.auto(model, inputs, budget="62%", loop="loss_only")
    assert plan.loop == "loss_only" and plan.recompute_blocks > 0
    peak = _users_step(model, inputs, keep_output=False)
    assert plan.budget_bytes is not None and peak <= plan.budget_bytes
    assert peak == plan.predicted_peak_bytes
    assert Plan.from_json(plan.to_json()).loop == "loss_only"


def test_estimate_and_meta_step_peak_take_the_loop() -> None:
    model, inputs = zoo.build("mlp", widths=(64, 48), d_in=32, n_classes=512, batch_size=64,
                              device="meta")
    held = estimate(model, inputs, device="cpu", selective=False)
    loss_only = estimate(model, inputs, device="cpu", selective=False, loop="loss_only")
    assert held.loop == "holds_output" and loss_only.loop == "loss_only"
    assert held.tape is not None and held.tape.output_bytes == 64 * 512 * 4
    assert held.step_peak_bytes - loss_only.step_peak_bytes == held.tape.output_bytes
    assert "loop holds_output" in str(held)
    assert json.loads(loss_only.to_json())["loop"] == "loss_only"
    steps = {loop: meta_step_peak(model, inputs, device="cpu", loop=loop) for loop in LOOPS}
    assert steps["holds_output"].peak_bytes == held.step_peak_bytes
    assert steps["loss_only"].peak_bytes == loss_only.step_peak_bytes


# --- a wrong loop name -----------------------------------------------------------------------


def test_an_unknown_loop_names_the_value_and_the_choices() -> None:
    model, inputs = zoo.build("mlp", widths=(16, 16), d_in=8, batch_size=4)
    bad: Any = "hold_output"  # a typo of "holds_output"
    calls = [
        lambda: run_step(model, inputs, None, loop=bad),
        lambda: autoremat.profile(model, inputs, loop=bad),
        lambda: autoremat.auto(model, inputs, budget="90%", loop=bad),
        lambda: estimate(model, inputs, loop=bad),
        lambda: meta_step_peak(model, inputs, loop=bad),
    ]
    for call in calls:
        with pytest.raises(LoopError) as info:
            call()
        message = str(info.value)
        assert all(f"'{name}'" in message for name in ("hold_output", *LOOPS))
        assert "Did you mean 'holds_output'?" in message
        assert isinstance(info.value, autoremat.RematError)
    assert all(p.grad is None for p in model.parameters())
    assert autoremat.applied_plan(model) is None


# --- old JSON: measured before the loop was recorded, so loss-only ------------------------------


def test_an_old_tape_without_the_loop_loads_as_loss_only(tiny_tape: Tape) -> None:
    assert tiny_tape.loop == "holds_output" and tiny_tape.output_bytes > 0
    data = json.loads(tiny_tape.to_json())
    del data["loop"], data["output_bytes"]
    old = Tape.from_json(json.dumps(data))
    assert old.loop == "loss_only" and old.output_bytes == -1
    assert Tape.from_json(old.to_json()) == old
    assert "loop loss_only" in str(old)
    plan = autoremat.plan(old, None, "full")  # a plan made from it says so
    assert plan.loop == "loss_only"


def test_an_old_plan_without_the_loop_loads_as_loss_only(tiny_tape: Tape) -> None:
    plan = autoremat.plan(tiny_tape, None, "full")
    assert plan.loop == "holds_output" and "loop holds_output" in str(plan)
    data = json.loads(plan.to_json())
    del data["loop"], data["seal"]  # as an old file: no loop, and not sealed
    with pytest.warns(UserWarning, match="no seal"):
        old = Plan.from_json(json.dumps(data))
    assert old.loop == "loss_only"
    assert old == dataclasses.replace(plan, loop="loss_only")


@pytest.mark.parametrize("value", ["holds", None, 1])
def test_a_malformed_loop_in_json_is_a_schema_error(tiny_tape: Tape, value: Any) -> None:
    for what, text in (("tape", tiny_tape.to_json()),
                       ("plan", autoremat.plan(tiny_tape, None, "full").to_json())):
        data = json.loads(text)
        data["loop"] = value
        cls = Tape if what == "tape" else Plan
        with pytest.raises(SchemaError, match=f"{what}.loop must be one of"):
            cls.from_json(json.dumps(data))  # type: ignore[attr-defined]
