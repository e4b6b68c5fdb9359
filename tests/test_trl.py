"""Tests for autoremat.hf's callback under TRL's ``SFTTrainer``.

``SFTTrainer`` computes its loss with TRL's own fused LM head (``model(**batch,
fused_lm_head=True)``: log-probabilities over tiles of tokens, never the full logits), so
the callback profiles that call and leaves the head to TRL (NOTE [ Which loss the Trainer
takes ] in hf.py). A real ``SFTTrainer.train`` of small causal LMs (random init) with the
callback is compared with the same run without it: each step's gradients are
``torch.equal``, each step's measured peak is at most the plan's prediction, and the plan
is gone when training ends.
"""

from __future__ import annotations

import logging
import pathlib
import types
from typing import Any

import datasets
import pytest
import tokenizers
import torch
import transformers
import trl
from torch import nn

import autoremat
from autoremat import Decision, RematError
from autoremat.hf import AutorematCallback

from _steps import recomputing

VOCAB, SEQ, BATCH = 128, 64, 2


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ, use_cache=False,
            bos_token_id=1, eos_token_id=1))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
        attention_dropout=0.1, use_cache=False, bos_token_id=1, eos_token_id=1,
        pad_token_id=0))


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over ``VOCAB`` made-up tokens (no download)."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "<unk>")),
        pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _data() -> datasets.Dataset:
    """Eight sequences of ``SEQ`` token ids (already tokenized)."""
    ids = torch.randint(3, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(2))
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()})


class _MeasuredSFT(trl.SFTTrainer):
    """An SFTTrainer that measures the step peak of each training step (its loss,
    metrics and backward) and keeps a copy of the gradients it leaves."""

    peaks: list[int]
    grads: list[dict[str, torch.Tensor | None]]

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with autoremat.track_memory() as mem:
            out = super().training_step(*args, **kwargs)
        self.peaks = [*getattr(self, "peaks", []), mem.peak_bytes]
        self.grads = [*getattr(self, "grads", []), {
            n: None if p.grad is None else p.grad.clone()
            for n, p in self.model.named_parameters()}]
        return out


def _train(kind: str, out: pathlib.Path, callbacks: list[Any], **options: Any) -> _MeasuredSFT:
    args = trl.SFTConfig(
        output_dir=str(out), max_steps=2, per_device_train_batch_size=BATCH, report_to=[],
        use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1,
        gradient_checkpointing=False, activation_checkpointing=False, max_length=SEQ,
        **options)
    trainer = _MeasuredSFT(model=_model(kind), args=args, train_dataset=_data(),
                           processing_class=_tokenizer(), callbacks=callbacks)
    trainer.train()
    return trainer


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_sft_with_the_callback_has_the_plain_gradients_within_its_prediction(
        kind: str, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    plain = _train(kind, tmp_path / "plain", [])
    # TRL's head is much of a tiny model's step; head="auto" leaves it to TRL
    callback = AutorematCallback(budget="95%", head="auto" if kind == "gpt2" else None)
    with caplog.at_level(logging.INFO, logger="autoremat.hf"):
        trainer = _train(kind, tmp_path / "planned", [callback])
    plan = callback.plan
    assert trainer.state.global_step == 2
    assert plan is not None and recomputing(plan)
    # the step profiled is SFTTrainer's: its fused head's loss, which the plan says
    assert "fused_lm_head" in plan.inputs and "TRL's fused LM head" in plan.loss
    assert "TRL's fused LM head" in callback.loss
    assert any("TRL's fused LM head" in r.getMessage() for r in caplog.records)
    assert plan.head.decision is Decision.KEEP and plan.loop == "loss_only"
    assert plan.autocast == "cpu:bfloat16"  # SFTConfig's default bf16, Accelerate's autocast
    for ours, theirs in zip(trainer.grads, plain.grads, strict=True):
        differ = [n for n in ours if (ours[n] is None) != (theirs[n] is None)
                  or (ours[n] is not None and not torch.equal(ours[n], theirs[n]))]
        assert differ == [], f"gradients differ from the plain run: {differ[:3]}"
    assert len(trainer.peaks) == 2
    assert all(peak <= plan.predicted_peak_bytes for peak in trainer.peaks), \
        (trainer.peaks, plan.predicted_peak_bytes)
    assert trainer.peaks[0] >= 0.97 * plan.predicted_peak_bytes
    assert max(trainer.peaks) < min(plain.peaks)
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (plain, trainer)]
    assert losses[0] == losses[1] and len(losses[0]) == 2
    assert autoremat.applied_plan(trainer.model) is None  # removed when training ended


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_chunked_head_is_refused_where_trl_takes_the_loss(tmp_path: pathlib.Path) -> None:
    with pytest.raises(RematError, match="TRL's own fused LM head"):
        _train("llama", tmp_path, [AutorematCallback(budget="95%", head="chunked:4")])


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_label_smoothing_is_refused_before_any_step(tmp_path: pathlib.Path) -> None:
    with pytest.raises(RematError, match=r"label_smoothing_factor=0\.1"):
        _train("llama", tmp_path, [AutorematCallback(budget="95%")],
               label_smoothing_factor=0.1)


def _own_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> Any:
    logits = outputs.logits[:, :-1].flatten(0, 1)
    return nn.functional.cross_entropy(logits, labels[:, 1:].flatten())


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_compute_loss_func_is_refused_at_the_first_forward(tmp_path: pathlib.Path) -> None:
    # no callback event shows compute_loss_func: the first step's forward, called without
    # the labels the profiled batch had, is refused before it runs
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=BATCH,
                         report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                         gradient_checkpointing=False, activation_checkpointing=False)
    model = _model("llama")
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=_data(),
                             processing_class=_tokenizer(), compute_loss_func=_own_loss,
                             callbacks=[AutorematCallback(budget="95%")])
    with pytest.raises(RematError, match="without fused_lm_head, labels"):
        trainer.train()
    # the model as it was: the plan off it (a held-out check found it left on)
    assert autoremat.applied_plan(model) is None


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_sfts_default_checkpointing_is_refused_when_the_trainer_is_built(
        tmp_path: pathlib.Path) -> None:
    args = trl.SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(RematError, match="checkpoints every layer"):
        trl.SFTTrainer(model=_model("llama"), args=args, train_dataset=_data(),
                       processing_class=_tokenizer(), callbacks=[AutorematCallback(budget="95%")])


def test_liger_kernels_are_named_and_the_loss_stays_trls() -> None:
    # use_liger_kernel=True: TRL keeps Liger's layer kernels and turns its fused
    # cross-entropy off, so the loss is still TRL's fused head (Liger is not installed
    # here: the detection is checked on the arguments the callback reads)
    from autoremat.hf import _trainer_loss

    model = _model("llama")
    trl.trainer.utils.add_fused_lm_head(model)
    args = types.SimpleNamespace(label_smoothing_factor=0.0, loss_type="nll",
                                 use_liger_kernel=True)
    loss = _trainer_loss(model, args, None, "auto")  # type: ignore[arg-type]
    assert "TRL's fused LM head" in loss.what and "Liger's layer kernels" in loss.what
    assert loss.inputs == {"fused_lm_head": True, "use_cache": False} and loss.head is None
    plain = _trainer_loss(_model("llama"), args, None, "auto")  # type: ignore[arg-type]
    assert plain.what == "the model's own loss (output.loss)" and plain.head == "auto"


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_trls_other_trainers_are_refused_when_training_begins(tmp_path: pathlib.Path) -> None:
    # DPOTrainer's batch has no labels, and its step runs a reference forward: the
    # callback profiled it as SFTTrainer's and failed inside TRL's fused head (TypeError)
    import copy

    tokenizer = _tokenizer()
    tokenizer._tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    g = torch.Generator().manual_seed(3)

    def text(n: int) -> str:
        return " ".join(f"t{i}" for i in torch.randint(3, VOCAB, (n,), generator=g).tolist())

    data = datasets.Dataset.from_dict({"prompt": [text(8) + " " for _ in range(4)],
                                       "chosen": [text(8) for _ in range(4)],
                                       "rejected": [text(8) for _ in range(4)]})
    args = trl.DPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=BATCH,
                         report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                         gradient_checkpointing=False, max_length=SEQ)
    model = _model("llama")
    trainer = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model).eval(), args=args,
                             train_dataset=data, processing_class=tokenizer,
                             callbacks=[AutorematCallback(budget="95%")])
    with pytest.raises(RematError, match=r"TRL's DPOConfig: DPOTrainer's step is not one "
                       r"AutorematCallback profiles.*autoremat\.auto\(model, batch"):
        trainer.train()
    assert autoremat.applied_plan(model) is None
