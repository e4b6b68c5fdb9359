"""Tests for autoremat.hf (the Trainer callback) and for Hugging Face encoder-decoders.

A Trainer run with the callback is compared with the same run without it: after two
optimizer steps every parameter is ``torch.equal``, so the profile disturbed neither the
RNG (dropout, a collator that masks at random), nor the gradients, nor the optimizer.
T5 and BART plan over both stacks in one chain; their plans at 75% and at the smallest
feasible budget give the plain model's gradients and measure within the budget.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import pathlib
import warnings
from typing import Any

import pytest
import torch
import transformers
from torch import nn

import autoremat
from autoremat import BudgetError, Choice, Decision, RematError
from autoremat._measure.blocks import discover_blocks
from autoremat.hf import AutorematCallback

from _steps import Tokens, assert_same_step, recomputing

VOCAB, SEQ, BATCH = 128, 16, 2

# --- tiny models: 2 layers (2 + 2 for encoder-decoders), width 32, dropout on -------------


def _model(kind: str, **config_options: Any) -> nn.Module:
    """A tiny ``kind`` model, seed 0; ``config_options`` go into its config (every stack's:
    T5 copies its config for each)."""
    torch.manual_seed(0)
    return _build(kind, config_options)


def _build(kind: str, options: dict[str, Any]) -> nn.Module:
    if kind == "gpt2":
        config: Any = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
            bos_token_id=0, eos_token_id=0, attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1,
            **options)
        return transformers.GPT2LMHeadModel(config)
    if kind == "llama":
        config = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
            attention_dropout=0.1, **options)
        return transformers.LlamaForCausalLM(config)
    if kind == "bert":
        config = transformers.BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1, **options)
        return transformers.BertForMaskedLM(config)
    if kind == "t5":
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
            num_heads=4, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0, **options)
        return transformers.T5ForConditionalGeneration(config)
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.1, attention_dropout=0.1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, **options)
    return transformers.BartForConditionalGeneration(config)


def _batch(seed: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.flip(1).clone()}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """The gradients of one step on ``_batch()`` from a fixed RNG state (dropout drawn
    alike), left unset on the model."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    model(**_batch()).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _masking_collator(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Masked-language-model batches: 15% of the tokens, drawn from torch's RNG, become
    token 1 and are the only ones with a label."""
    ids = torch.stack([e["input_ids"] for e in examples])
    masked = torch.bernoulli(torch.full(ids.shape, 0.15)).bool()
    return {"input_ids": ids.masked_fill(masked, 1), "labels": ids.masked_fill(~masked, -100)}


def _train(kind: str, out: pathlib.Path, callbacks: list[Any],
           **args: Any) -> tuple[nn.Module, transformers.Trainer]:
    # NOTE [ The plain model has no cache ]: the Trainer sets model.config.use_cache from
    # args.use_cache (False), which misses T5's decoder, whose config is a copy; a T5
    # decoder with a cache rounds differently (1e-8) from one without. autoremat turns
    # every stack's cache off, so the plain run is made without one in any config.
    model = _model(kind, use_cache=False)
    arguments = transformers.TrainingArguments(
        output_dir=str(out), max_steps=2, per_device_train_batch_size=BATCH, report_to=[],
        use_cpu=True, logging_steps=1, save_strategy="no", disable_tqdm=True, **args)
    trainer = transformers.Trainer(
        model=model, args=arguments, train_dataset=Tokens(), callbacks=callbacks,
        data_collator=_masking_collator if kind == "bert" else None)
    trainer.train()
    return model, trainer


# --- the Trainer callback --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert", "t5"])
def test_trainer_with_the_callback_trains_as_without_it(
        kind: str, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    plain, plain_trainer = _train(kind, tmp_path / "plain", [])
    callback = AutorematCallback(budget="75%")
    with caplog.at_level(logging.INFO, logger="autoremat.hf"), warnings.catch_warnings():
        warnings.simplefilter("error", autoremat.ShapeMismatchWarning)  # num_items_in_batch
        planned, trainer = _train(kind, tmp_path / "planned", [callback])
    assert trainer.state.global_step == 2
    plan = callback.plan
    assert plan is not None and recomputing(plan), "75% should recompute something"
    assert plan.budget_bytes is not None and plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.loop == "loss_only"  # what Trainer.training_step keeps (NOTE in hf.py)
    assert any("autoremat plan" in r.getMessage() and plan.blocks[0].name in r.getMessage()
               for r in caplog.records)
    assert autoremat.applied_plan(planned) is None  # removed when training ended
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h]
              for t in (plain_trainer, trainer)]
    assert len(losses[1]) == 2 and all(math.isfinite(x) for x in losses[1])
    assert losses[0] == losses[1]
    moved = [n for n, p in planned.named_parameters()
             if not torch.equal(p, dict(plain.named_parameters())[n])]
    assert moved == [], f"parameters differ from the run without the callback: {moved[:3]}"


@pytest.mark.slow
def test_a_trainer_that_compiles_gets_a_plan_measured_compiled(tmp_path: pathlib.Path) -> None:
    """NOTE [ A Trainer that compiles ] in hf.py: the callback planned the eager step for a
    Trainer with torch_compile=True (at 60% a segment, whose first compiled forward
    raised; elsewhere a plan whose figures were not the compiled step's)."""
    options = dict(torch_compile=True, torch_compile_backend="aot_eager")
    plain, _ = _train("llama", tmp_path / "plain", [], **options)
    callback = AutorematCallback(budget="75%")
    planned, trainer = _train("llama", tmp_path / "planned", [callback], **options)
    plan = callback.plan
    assert trainer.state.global_step == 2 and plan is not None
    assert plan.compiled == "aot_eager" and plan.compiled_peak_bytes is not None
    assert plan.budget_bytes is not None and plan.compiled_peak_bytes <= plan.budget_bytes
    assert all(b.segment == i for i, b in enumerate(plan.blocks))  # no segments compiled
    moved = [n for n, p in planned.named_parameters()
             if not torch.equal(p, dict(plain.named_parameters())[n])]
    assert moved == [], f"parameters differ from the compiled run without it: {moved[:3]}"


class _MeasuredTrainer(transformers.Trainer):
    """A Trainer that measures the step peak of each of its training steps (forward,
    loss and backward, as ``training_step`` runs them)."""

    peaks: list[int]

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with autoremat.track_memory() as mem:
            out = super().training_step(*args, **kwargs)
        self.peaks = [*getattr(self, "peaks", []), mem.peak_bytes]
        return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_callbacks_plan_holds_in_the_trainers_own_steps(kind: str,
                                                            tmp_path: pathlib.Path) -> None:
    # the plan is for the loop the Trainer runs (it drops the output before backward:
    # loss_only), so the prediction is what its training steps measure, head kept
    model = _model(kind, use_cache=False)
    callback = AutorematCallback(budget="75%")
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=BATCH,
        report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = _MeasuredTrainer(model=model, args=arguments, train_dataset=Tokens(),
                               callbacks=[callback])
    trainer.train()
    plan = callback.plan
    assert plan is not None and plan.loop == "loss_only" and plan.head.decision is Decision.KEEP
    assert len(trainer.peaks) == 2
    # the loss held as training_step holds it (NOTE [ Which loss the Trainer takes ]):
    # at most the prediction, to the byte
    assert "held as Trainer.training_step holds it" in plan.loss
    for peak in trainer.peaks:
        assert 0.99 * plan.predicted_peak_bytes <= peak <= plan.predicted_peak_bytes, \
            (peak, plan.predicted_peak_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_trainer_with_a_chunked_head_trains_within_its_bound(
        kind: str, tmp_path: pathlib.Path) -> None:
    # gradient accumulation: the Trainer passes num_items_in_batch, which the chunked
    # head's loss divides by as the model's own loss does
    plain, plain_trainer = _train(kind, tmp_path / "plain", [], gradient_accumulation_steps=2)
    callback = AutorematCallback(strategy="full", head="chunked:4")
    planned, trainer = _train(kind, tmp_path / "planned", [callback],
                              gradient_accumulation_steps=2)
    assert callback.plan is not None and callback.plan.head == Choice(Decision.CHUNKED, chunks=4)
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h]
              for t in (plain_trainer, trainer)]
    assert len(losses[1]) == 2
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for name, p in planned.named_parameters():
        q = dict(plain.named_parameters())[name]
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), name
    with pytest.raises(autoremat.RematError, match="head must be"):
        AutorematCallback(budget="50%", head="chunky")


@pytest.mark.slow
def test_trainer_in_bf16_plans_under_the_autocast_its_forward_runs_in(
        tmp_path: pathlib.Path) -> None:
    # Accelerate's mixed precision wraps the model's forward in autocast: the callback's
    # profile runs under it (its tape records it), and the steps match the plan
    # (NOTE [ The conditions a step is measured under ])
    callback = AutorematCallback(budget="75%")
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoremat.PlanMismatchWarning)
        _train("gpt2", tmp_path, [callback], bf16=True)
    assert callback.plan is not None and callback.plan.autocast == "cpu:bfloat16"


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("flag", ["gradient_checkpointing", "activation_checkpointing"])
def test_trainer_checkpointing_is_refused_when_the_trainer_is_built(
        flag: str, tmp_path: pathlib.Path) -> None:
    if flag not in transformers.TrainingArguments.__dataclass_fields__:
        pytest.skip(f"this transformers has no TrainingArguments.{flag}")
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[],
                                               use_cpu=True, **{flag: True})
    with pytest.raises(RematError) as info:
        transformers.Trainer(model=_model("gpt2"), args=arguments, train_dataset=Tokens(),
                             callbacks=[AutorematCallback(budget="75%")])
    message = str(info.value)
    assert "=True" in message and "=False" in message and "checkpoints every layer" in message


def test_a_model_with_hf_checkpointing_on_is_refused_when_training_begins(
        tmp_path: pathlib.Path) -> None:
    model = _model("gpt2")
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5
    (enable or model.gradient_checkpointing_enable)()
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1,
                                               report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=Tokens(),
                                   callbacks=[AutorematCallback(budget="75%")])
    with pytest.raises(RematError, match="gradient_checkpointing_disable"):
        trainer.train()
    assert autoremat.applied_plan(model) is None


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_profile_and_auto_refuse_a_model_with_hf_checkpointing_on(kind: str) -> None:
    """Transformers 5 recomputes a layer without calling it again, so no block is seen
    running twice: the flag is read, and the model is refused before any step (it would
    be measured recomputing every layer as its "plain" step); off again, it profiles."""
    model = _model(kind)
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5
    disable = getattr(model, "activation_checkpointing_disable", None)
    (enable or model.gradient_checkpointing_enable)()
    model.train()
    for call in (lambda: autoremat.profile(model, _batch(), timing=False),
                 lambda: autoremat.auto(model, _batch(), budget="90%")):
        with pytest.raises(autoremat.BlockError, match=r"checkpointing on .*"
                           r"gradient_checkpointing_disable\(\) .* let the plan decide"):
            call()
    assert autoremat.applied_plan(model) is None
    (disable or model.gradient_checkpointing_disable)()
    assert autoremat.profile(model, _batch(), timing=False).blocks


def test_a_peft_lora_model_is_planned_through_its_wrapper() -> None:
    """PEFT's PeftModel forwards lm_head and loss_function to the model it wraps, whose
    forward takes the loss: the head is chunked there (it measured nothing and failed the
    profile before), the plan's gradients are the plain LoRA model's, and the adapter's
    plan verifies within its prediction."""
    peft = pytest.importorskip("peft")

    def lora() -> nn.Module:
        model = _model("llama")
        model.train()
        return peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))

    model = lora()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # use_cache turned off, said
        tape = autoremat.profile(model, _batch(), timing=False)
        assert tape.head is not None and tape.head.name == "base_model.model.lm_head"
        assert tape.head.options  # measured, through the wrapper
        kept = autoremat.plan(tape, budget="70%")
        reference, plain = _grads(lora()), autoremat.verify(model, _batch(), kept)
        assert plain.ok and plain.grads_equal
        try:
            chunked = autoremat.plan(tape, budget="45%", head="auto")
        except BudgetError as exc:
            chunked = autoremat.plan(tape, budget=exc.min_feasible_bytes, head="auto")
        assert chunked.head.decision is Decision.CHUNKED
        report = autoremat.verify(model, _batch(), chunked)
        assert report.ok and report.peak_bytes <= chunked.predicted_peak_bytes
        autoremat.apply(model, kept)
        try:
            got = _grads(model)
        finally:
            autoremat.remove(model)
        assert reference.keys() == got.keys() and all(
            n.count("lora_") for n in got)  # only the adapters train
        assert all(torch.equal(reference[n], got[n]) for n in reference)
        assert autoremat.estimate(lora(), _batch()).tape.head is not None


def test_a_checkpoint_saved_while_a_plan_is_applied_keeps_the_users_config(
        tmp_path: pathlib.Path) -> None:
    """apply() turns use_cache off while the plan is applied; save_pretrained (the Trainer's
    checkpoints, push_to_hub) still writes the user's value, also from a deep copy
    (NOTE [ Saved with the user's config ])."""
    model = _model("llama")
    assert model.config.use_cache is True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # use_cache turned off, said
        autoremat.auto(model, _batch(), budget="75%")
    assert model.config.use_cache is False
    twin = copy.deepcopy(model)
    for saved, folder in ((model, "model"), (twin, "twin")):
        saved.save_pretrained(tmp_path / folder)
        config = json.loads((tmp_path / folder / "config.json").read_text())
        assert config["use_cache"] is True, folder
        assert saved.config.use_cache is False  # still off while the plan is applied
    assert type(model).from_pretrained(tmp_path / "model").config.use_cache is True
    autoremat.remove(twin)
    assert "save_pretrained" not in vars(twin) and twin.config.use_cache is True
    assert model.config.use_cache is False  # the copy's remove() left the original applied
    autoremat.remove(model)
    assert "save_pretrained" not in vars(model) and model.config.use_cache is True


def test_apply_refuses_hf_checkpointing_and_warns_when_it_is_turned_on_after() -> None:
    """apply() onto a model with its own checkpointing on is refused as profile() is; turned
    on after apply(), the next forward with gradients warns once, and the gradients stay
    the plain model's."""
    model = _model("llama")
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5
    disable = getattr(model, "activation_checkpointing_disable", None)
    model.train()
    plan = autoremat.plan(autoremat.profile(model, _batch(), timing=False), budget="75%")
    reference = _grads(model)
    (enable or model.gradient_checkpointing_enable)()
    with pytest.raises(autoremat.BlockError, match=r"checkpointing on .* apply\(\) would "
                       r"recompute inside its recompute .*gradient_checkpointing_disable"):
        autoremat.apply(model, plan)
    assert autoremat.applied_plan(model) is None
    (disable or model.gradient_checkpointing_disable)()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # use_cache turned off
        autoremat.apply(model, plan)
    try:
        (enable or model.gradient_checkpointing_enable)()
        with pytest.warns(autoremat.StepMismatchWarning, match="own .*checkpointing was "
                          "turned on after apply"):
            got = _grads(model)
        assert all(torch.equal(reference[n], got[n]) for n in reference)
        with warnings.catch_warnings():
            warnings.simplefilter("error", autoremat.StepMismatchWarning)
            _grads(model)  # once
    finally:
        autoremat.remove(model)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"budget": "75 percent"}, "budget"),
    ({"budget": "75%", "strategy": "optimum"}, "unknown strategy"),
    ({"budget": "75%", "loop": "holds"}, "unknown loop"),
    ({"budget": "75%", "optimizer": "adamw"}, "only matters with max_memory"),
    ({"budget": "75%", "margin": -0.1}, "margin"),
])
def test_bad_arguments_fail_when_the_callback_is_made(kwargs: dict[str, Any],
                                                      message: str) -> None:
    with pytest.raises(RematError, match=message):
        AutorematCallback(**kwargs)


# --- encoder-decoders ---------------------------------------------------------------------


def test_both_stacks_of_an_encoder_decoder_are_one_chain_in_running_order() -> None:
    assert discover_blocks(_model("t5")) == ["encoder.block.0", "encoder.block.1",
                                             "decoder.block.0", "decoder.block.1"]
    assert discover_blocks(_model("bart")) == [
        "model.encoder.layers.0", "model.encoder.layers.1",
        "model.decoder.layers.0", "model.decoder.layers.1"]


def test_a_kv_cache_asked_for_in_training_is_refused_up_front() -> None:
    model = _model("t5").train()
    with pytest.raises(RematError, match="use_cache") as info:
        autoremat.profile(model, {**_batch(), "use_cache": True}, repeats=1)
    assert "KV cache" in str(info.value)
    assert model.config.use_cache and model.decoder.config.use_cache  # left as they were


def test_a_decoder_left_in_eval_mode_is_profiled_without_its_cache() -> None:
    """A causal LM in eval() mode (as ``from_pretrained`` returns it) built its KV cache
    in the profiled step, whose checkpoints refused it as the loop's ("drop use_cache"),
    though the batch asked for none (a held-out OLMo). Its cache is off for the step as
    in train mode; the eval mode is what the profile warns about."""
    from conftest import hf_model
    model, inputs = hf_model("llama", None, layers=2)
    model.eval()
    with pytest.warns(UserWarning, match=r"profiled in eval\(\) mode"):
        tape = autoremat.profile(model, inputs, timing=False, with_selective=False)
    assert tape.training is False and model.config.use_cache  # left as it was
    with torch.device("meta"):
        fake = copy.deepcopy(model).to("meta")
    with pytest.warns(UserWarning, match=r"profiled in eval\(\) mode"):
        est = autoremat.estimate(fake, inputs, device="cpu")
    assert est.step_peak_bytes == tape.step_peak_bytes


def _xlm() -> nn.Module:
    """A tiny XLM, which builds a KV cache in every forward, training or not."""
    torch.manual_seed(0)
    config = transformers.XLMConfig(emb_dim=32, n_layers=2, n_heads=4, vocab_size=VOCAB,
                                    max_position_embeddings=64, pad_token_id=0)
    return transformers.XLMWithLMHeadModel(config).train()


@pytest.mark.parametrize("joined", [False, True], ids=["blocks", "a-segment"])
def test_a_block_the_model_passes_a_kv_cache_is_refused_in_its_forward(joined: bool) -> None:
    # XLM's attention appends to the cache its model made; a recompute appended again and
    # failed in backward on shapes ("the expanded size of the tensor (32) must match...")
    model, batch = _xlm(), _batch()
    names = ["transformer.attentions.0", "transformer.attentions.1"]
    tape = autoremat.profile(model, batch, blocks=[f"transformer.ffns.{i}" for i in (0, 1)])
    chosen = autoremat.plan(tape, None, "full")  # moved onto the attentions, as a user could
    chosen = dataclasses.replace(chosen, structure="", blocks=tuple(
        dataclasses.replace(b, name=name, decision=Decision.RECOMPUTE, params="",
                            segment=0 if joined else i)
        for i, (b, name) in enumerate(zip(chosen.blocks, names, strict=True))))
    autoremat.apply(model, chosen)
    label = (r"transformer\.attentions\.0\.\.transformer\.attentions\.1 \(a segment\)"
             if joined else r"'transformer\.attentions\.0'")
    with pytest.raises(RematError, match=label + r" is recomputed in "
                       r"backward and was called with a KV cache \(argument cache=, of type "
                       r"EncoderDecoderCache\)") as info:
        model(**batch)
    assert "blocks=" in str(info.value), "and says what to do"


def test_a_model_that_builds_a_kv_cache_plans_over_blocks_it_does_not_pass_it() -> None:
    model, batch = _xlm(), _batch()
    with pytest.raises(RematError, match=r"'transformer\.attentions\.0' .* KV cache"):
        autoremat.profile(model, batch)  # its attention is the chain it finds
    tape = autoremat.profile(model, batch, blocks=[f"transformer.ffns.{i}" for i in (0, 1)])
    chosen = autoremat.plan(tape, None, "full")
    autoremat.apply(model, chosen)
    result = autoremat.verify(model, batch, chosen)
    assert result.ok and result.max_grad_diff == 0.0
    assert result.peak_bytes == chosen.predicted_peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "loop"), [("t5", "loss_only"), ("bart", "holds_output")])
def test_encoder_decoders_plan_at_75_percent_and_at_the_minimum(kind: str, loop: str) -> None:
    # With the config's defaults (use_cache=True), as a new user has it, T5 used to crash
    # here inside torch.utils.checkpoint ("a different number of tensors was saved", 56
    # vs 52): its decoder's own copy of the config kept the cache on (NOTE [ Every stack
    # has its own config ] in step.py).
    model, inputs = _model(kind).train(), _batch()
    tape = autoremat.profile(model, inputs, repeats=1, loop=loop)  # type: ignore[arg-type]
    assert [b.name for b in tape.blocks] == discover_blocks(model)
    assert [b.chained for b in tape.blocks] == [False, True, False, True]  # 2 stacks
    with pytest.raises(BudgetError) as info:
        autoremat.plan(tape, 1)
    smallest = info.value.min_feasible_bytes
    assert smallest is not None
    configs = [model.config, model.get_decoder().config]
    assert all(c.use_cache for c in configs)
    with pytest.warns(UserWarning, match="use_cache=True"):
        autoremat.apply(model, autoremat.plan(tape, "75%"))
    assert not any(c.use_cache for c in configs)  # off in every stack...
    autoremat.remove(model)
    assert all(c.use_cache for c in configs)  # ...and back on
    for config in configs:  # the plain model: NOTE [ The plain model has no cache ]
        config.use_cache = False
    for budget in ("75%", smallest):
        plan = autoremat.plan(tape, budget)
        assert recomputing(plan)
        assert_same_step(model, inputs, plan)  # torch.equal loss and every gradient
        report = autoremat.verify(model, inputs, repeats=1)
        autoremat.remove(model)
        assert plan.budget_bytes is not None
        assert report.grads_equal and report.peak_bytes <= plan.budget_bytes, (
            f"{kind} at {budget}: measured {report.peak_bytes} B, budget "
            f"{plan.budget_bytes} B, predicted {plan.predicted_peak_bytes} B")


def test_the_callback_checks_its_arguments() -> None:
    from autoremat.hf import AutorematCallback

    with pytest.raises(BudgetError, match="would keep every block and change nothing"):
        AutorematCallback()
    with pytest.raises(RematError, match="loss_fn must be a function"):
        AutorematCallback(budget="50%", loss_fn="loss")
    assert AutorematCallback(strategy="full").planning.budget is None
    assert AutorematCallback(budget="60%", margin=0.05).planning.margin == 0.05


def _modernbert() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A three-layer ModernBERT (local and global attention, masks made before its
    layers) and a batch of 2 x 32 tokens, seed 0."""
    torch.manual_seed(0)
    model = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(
        num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        vocab_size=128, max_position_embeddings=64, global_attn_every_n_layers=2,
        local_attention=8, pad_token_id=0, eos_token_id=1, bos_token_id=2, cls_token_id=3,
        sep_token_id=4)).train()
    ids = torch.randint(0, 128, (2, 32))
    return model, {"input_ids": ids, "labels": ids}


def test_kept_layers_casts_under_autocast_are_not_counted_twice_in_the_post_window(
        ) -> None:
    # NOTE [ Released when the forward returns ] in _plan/peak.py: a ModernBERT under
    # bf16 autocast computes its loss in its forward; a layer checkpointed lets go of
    # its weights' casts when autocast's cache is emptied after the loss, a kept one
    # saves them. Against the step checkpointing every layer, a plan keeping layers 0
    # and 1 holds their casts more from the forward's return, which the post window's
    # levels before the backward starts were raised by, though that step held them too
    # until after its peak there: predicted above keeping every layer (72 KiB, 8% over
    # its step) before. The tape now records that peak with the releases held
    # (``post_fwd_held_peak``) and the peak from where the backward starts
    # (``post_bwd_peak``).
    from autoremat._plan.plan import plan_of_segments

    from _steps import segments_peaks

    model, batch = _modernbert()
    keep, recompute = Choice(Decision.KEEP), Choice(Decision.RECOMPUTE)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tape = autoremat.profile(model, batch, timing=False, with_selective=False)
        assert tape.post_fwd_held_peak and tape.post_bwd_peak
        assert autoremat.Tape.from_json(tape.to_json()) == tape
        predicted = {}
        for pattern in ("kkk", "kkr", "krk", "rkr", "rrr"):
            segments = [(i, i + 1, recompute if c == "r" else keep)
                        for i, c in enumerate(pattern)]
            predicted[pattern], measured = segments_peaks(model, batch, tape, segments)
            assert measured <= predicted[pattern], pattern
        assert predicted["kkr"] < predicted["kkk"]
        before = dataclasses.replace(tape, post_fwd_held_peak={}, post_bwd_peak={})
        kkr = [(0, 1, keep), (1, 2, keep), (2, 3, recompute)]
        assert plan_of_segments(before, kkr, "t").predicted_peak_bytes > predicted["kkk"]


def test_a_mask_made_before_the_chain_is_not_held_over_the_casts_under_autocast() -> None:
    # NOTE [ Tensors made before the chain that later blocks take ] in _plan/peak.py:
    # ModernBERT's global mask (1 KiB), made before its layers, first taken by layer 1,
    # was counted held through the step up to layer 1's release when the forward
    # returns, which under autocast holds layer 0's weight casts: every plan
    # checkpointing layer 1 was the mask over its step; made before the chain, it is
    # the first block's release's (released where no layer taking it is checkpointed)
    from _steps import segments_peaks

    model, batch = _modernbert()
    keep, recompute = Choice(Decision.KEEP), Choice(Decision.RECOMPUTE)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tape = autoremat.profile(model, batch, timing=False, with_selective=False)
        assert tape.freed_at_return == {"1:1": 1024}
        for segments in ([(0, 1, recompute), (1, 2, recompute), (2, 3, keep)],
                         [(0, 1, recompute), (1, 2, recompute), (2, 3, recompute)],
                         [(0, 3, recompute)], [(0, 2, recompute), (2, 3, recompute)],
                         [(0, 1, recompute), (1, 3, recompute)]):
            predicted, measured = segments_peaks(model, batch, tape, segments)
            assert measured == predicted, (segments, predicted - measured)


def test_a_kept_first_layer_lets_its_input_go_when_the_forward_returns() -> None:
    # NOTE [ The first block's own input ] in _plan/peak.py: OLMo 2 (norms after its
    # attention and MLP) under bf16 autocast saves only casts of its layers' inputs; the
    # model holds the embeddings (float32) until its forward returns. Plans keeping the
    # first layer and recomputing others counted them held through the backward: one
    # boundary (16 KiB) over their steps before, two with a segment
    from _steps import segments_peaks

    model, batch = _olmo2()
    keep, recompute = Choice(Decision.KEEP), Choice(Decision.RECOMPUTE)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tape = autoremat.profile(model, batch, timing=False, with_selective=False,
                                 with_head=False)
        for segments in ([(0, 1, keep), (1, 2, recompute), (2, 3, recompute)],
                         [(0, 1, keep), (1, 2, keep), (2, 3, recompute)],
                         [(0, 1, recompute), (1, 2, recompute), (2, 3, recompute)]):
            predicted, measured = segments_peaks(model, batch, tape, segments)
            assert measured == predicted, (segments, predicted - measured)


def _olmo2() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A 3-layer OLMo 2 (norms after its attention and MLP) and a batch of 2 x 32."""
    torch.manual_seed(0)
    model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(
        num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, pad_token_id=0,
        eos_token_id=1, bos_token_id=2)).train()
    ids = torch.randint(0, 128, (2, 32))
    return model, {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_segment_lets_its_last_input_go_when_its_recompute_ends(
        dtype: torch.dtype | None) -> None:
    # NOTE [ A segment's last input its recompute lets go ] in _plan/peak.py: under bf16
    # autocast OLMo 2's layers save the casts of their float32 residual inputs, not the
    # inputs, so a segment's recompute lets its last layer's input go when it ends,
    # which the layer's own checkpoint holds through its backward: every plan of several
    # segments was predicted one residual (16 KiB) over its step. In float32 the layers
    # save their inputs: held, as before
    from _steps import segments_peaks

    model, batch = _olmo2()
    keep, recompute = Choice(Decision.KEEP), Choice(Decision.RECOMPUTE)
    ctx = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
    with ctx:
        tape = autoremat.profile(model, batch, timing=False, with_selective=False,
                                 with_head=False)
        R = Decision.RECOMPUTE
        gone = [b.bwd[(R, R)].peak_bytes - b.bwd_input_gone_peak
                if b.bwd_input_gone_peak >= 0 else None for b in tape.blocks]
        assert gone == [None] + [16384 if dtype else None] * 2  # one residual, float32
        for segments in ([(0, 3, recompute)], [(0, 1, keep), (1, 3, recompute)],
                         [(0, 1, recompute), (1, 3, recompute)],
                         [(0, 2, recompute), (2, 3, keep)],
                         [(0, 2, recompute), (2, 3, recompute)]):
            predicted, measured = segments_peaks(model, batch, tape, segments)
            assert measured == predicted, (segments, predicted - measured)


def test_segments_under_autocast_release_their_inner_blocks_casts() -> None:
    # NOTE [ Inner blocks' releases ] in _plan/peak.py: a segment's inner blocks let go
    # of the block before's weight casts after the loss, as checkpointed blocks do;
    # counted at the least any decision releases (none: kept blocks save them), every
    # segment of several layers was predicted its inner layers' casts over its step
    # (a segment of all three layers: 147 KiB, 6%), so the planner passed them by
    from _steps import segments_peaks
    from conftest import hf_model

    model, batch = hf_model("llama", None, layers=3, seq_len=32)
    keep, recompute = Choice(Decision.KEEP), Choice(Decision.RECOMPUTE)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tape = autoremat.profile(model, batch, timing=False, with_selective=False,
                                 with_head=False)
        for segments in ([(0, 3, recompute)], [(0, 2, recompute), (2, 3, keep)],
                         [(0, 1, keep), (1, 3, recompute)]):
            predicted, measured = segments_peaks(model, batch, tape, segments)
            assert measured == predicted, (segments, predicted - measured)
