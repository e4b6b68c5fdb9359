"""Tests for autoremat.lightning (the Lightning callback).

A ``lightning.Trainer.fit`` with the callback is compared with the same fit without it:
every gradient of every step is ``torch.equal`` (the head kept), the step peak measured
over each training step (``training_step``, the closure's loss and backward) is at most
the plan's prediction, and the plan is gone after the fit. Small Hugging Face causal LMs
(random init from their configs) and a zoo model, in float32 and in bf16-mixed, with a
``training_step`` that returns the loss and one that returns a dict.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import lightning
import pytest
import torch
import transformers
from torch import nn

import autoremat
from autoremat import Choice, Decision, RematError
from autoremat._callbacks import MissingExtraError, require_extra
from autoremat.lightning import AutorematCallback

from _steps import Tokens, recomputing, snapshot

VOCAB, SEQ, BATCH = 128, 16, 2


def _inner(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, use_cache=False,
            attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1))
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
            attention_dropout=0.1, use_cache=False))
    model, _ = autoremat.zoo.build("gpt2", n_layer=3, n_embd=32, n_head=4, vocab_size=VOCAB,
                                   block_size=SEQ, batch_size=BATCH, seq_len=SEQ)
    return model


class _Module(lightning.LightningModule):
    """A causal LM trained on ``{"input_ids", "labels"}`` batches; ``training_step``
    returns the loss, or with ``as_dict`` a dict that also holds the logits."""

    def __init__(self, kind: str, as_dict: bool = False) -> None:
        super().__init__()
        self.model = _inner(kind)
        self.kind, self.as_dict = kind, as_dict

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        if self.kind == "zoo":
            out = self.model(batch["input_ids"], batch["labels"])
        else:
            out = self.model(**batch)
        self.log("train_loss", out.loss)
        return {"loss": out.loss, "logits": out.logits} if self.as_dict else out.loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Measure(lightning.Callback):
    """Each training step's peak (``training_step``, the closure's loss and backward, up to
    the optimizer step) and a copy of its gradients."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self.grads: list[dict[str, torch.Tensor | None]] = []
        self._tracking: Any = None
        self._mem: Any = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self._tracking = autoremat.track_memory()
        self._mem = self._tracking.__enter__()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._tracking.__exit__(None, None, None)
        self.peaks.append(self._mem.peak_bytes)
        self.grads.append({n: None if p.grad is None else p.grad.clone()
                           for n, p in pl_module.named_parameters()})


class _Hparams(lightning.pytorch.loggers.Logger):
    """A logger that keeps what is logged to it."""

    def __init__(self) -> None:
        super().__init__()
        self.params: dict[str, Any] = {}

    @property
    def name(self) -> str:
        return "kept"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.params.update(params)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass


def _fit(module: lightning.LightningModule, callbacks: list[Any], precision: str = "32-true",
         logger: Any = False, steps: int = 2) -> lightning.Trainer:
    torch.manual_seed(1)  # the sampler's shuffle and dropout
    trainer = lightning.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=logger, precision=precision,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks)
    trainer.fit(module, torch.utils.data.DataLoader(Tokens(), batch_size=BATCH, shuffle=True))
    return trainer


@pytest.mark.parametrize(("kind", "as_dict", "precision"), [
    ("gpt2", False, "32-true"), ("llama", True, "bf16-mixed"), ("zoo", False, "32-true")])
def test_a_fit_with_the_callback_has_the_plain_gradients_within_its_prediction(
        kind: str, as_dict: bool, precision: str, caplog: pytest.LogCaptureFixture) -> None:
    plain = _Measure()
    _fit(_Module(kind, as_dict), [plain], precision)
    module = _Module(kind, as_dict)
    before = snapshot(module.model)
    callback, planned, logger = AutorematCallback(budget="75%"), _Measure(), _Hparams()
    with caplog.at_level(logging.INFO, logger="autoremat.lightning"), \
            warnings.catch_warnings():
        warnings.simplefilter("error", autoremat.ShapeMismatchWarning)
        warnings.simplefilter("error", autoremat.StepMismatchWarning)
        trainer = _fit(module, [callback, planned], precision, logger)
    plan = callback.plan
    assert trainer.global_step == 2
    assert plan is not None and recomputing(plan), "75% should recompute something"
    assert plan.head.decision is Decision.KEEP
    # the loop Lightning runs: its closure keeps a dict's entries through backward
    assert plan.loop == ("holds_output" if as_dict else "loss_only")
    assert plan.autocast == ("cpu:bfloat16" if precision == "bf16-mixed" else "")
    assert plan.blocks[0].name.startswith("module.model.")
    # every gradient of every step is the plain fit's, bit for bit
    assert len(planned.grads) == len(plain.grads) == 2
    for ours, theirs in zip(planned.grads, plain.grads, strict=True):
        assert ours.keys() == theirs.keys()
        differ = [n for n in ours if (ours[n] is None) != (theirs[n] is None)
                  or (ours[n] is not None and not torch.equal(ours[n], theirs[n]))]
        assert differ == [], f"gradients differ from the plain fit: {differ[:3]}"
    # the prediction is for the step Lightning runs: each step measures at most it, and
    # the first (no gradients held from a step before) close to it
    assert all(peak <= plan.predicted_peak_bytes for peak in planned.peaks), \
        (planned.peaks, plan.predicted_peak_bytes)
    assert planned.peaks[0] >= 0.97 * plan.predicted_peak_bytes
    assert max(planned.peaks) < min(plain.peaks)
    # logged through Lightning's logger and the python logger; removed at teardown
    assert logger.params["autoremat/predicted_peak_bytes"] == plan.predicted_peak_bytes
    assert logger.params["autoremat/loop"] == plan.loop
    assert any(plan.blocks[0].name in r.getMessage() for r in caplog.records)
    assert "training_step" not in vars(module)
    assert snapshot(module.model) == {**before, "training": snapshot(module.model)["training"]}


def test_a_chunked_head_of_a_zoo_model_is_planned_under_lightning() -> None:
    plain = _Measure()
    _fit(_Module("zoo"), [plain], steps=1)
    module, measured = _Module("zoo"), _Measure()
    callback = AutorematCallback(strategy="full", head="chunked:4")
    _fit(module, [callback, measured], steps=1)
    assert callback.plan is not None
    assert callback.plan.head == Choice(Decision.CHUNKED, chunks=4)
    assert measured.peaks[0] <= callback.plan.predicted_peak_bytes
    # a chunked head sums in another order (NOTE [ What a chunked head changes in
    # numerics ]): close, not bitwise
    for name, grad in measured.grads[0].items():
        assert grad is not None
        assert torch.allclose(grad, plain.grads[0][name], rtol=1e-4, atol=1e-6), name
    assert module.model.lm_head.chunks is None  # removed


class _Pairs(lightning.LightningModule):
    """A zoo MLP on ``[x, y]`` batches (the default collate's list), with a
    ``training_step`` that takes no ``batch_idx``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model, self.data = autoremat.zoo.build("mlp", widths=(64,) * 6, batch_size=256)

    def training_step(self, batch: list[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return self.model(x, y).loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("margin", [None, 0.1])
def test_a_list_batch_and_a_training_step_without_batch_idx(margin: float | None) -> None:
    def fit(callbacks: list[Any]) -> _Pairs:
        module = _Pairs()
        data = torch.utils.data.TensorDataset(*(t.repeat(2, *[1] * (t.dim() - 1))
                                                for t in module.data))
        torch.manual_seed(1)
        lightning.Trainer(max_steps=2, accelerator="cpu", logger=False,
                          enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, callbacks=callbacks).fit(
            module, torch.utils.data.DataLoader(data, batch_size=256))
        return module
    plain, measured = _Measure(), _Measure()
    fit([plain])
    callback = AutorematCallback(budget="60%", margin=margin)
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoremat.ShapeMismatchWarning)
        fit([callback, measured])
    plan = callback.plan
    assert plan is not None and recomputing(plan) and plan.loop == "loss_only"
    # a CPU plan keeps no margin unless given one; given, it plans below the budget by it
    assert plan.budget_bytes is not None
    assert (plan.margin_bytes > 0) == (margin is not None)
    assert plan.predicted_peak_bytes + plan.margin_bytes <= plan.budget_bytes
    assert plan.inputs.startswith("(256, ")  # the list's tensors, by position
    for ours, theirs in zip(measured.grads, plain.grads, strict=True):
        assert all(torch.equal(ours[n], theirs[n]) for n in theirs)  # type: ignore[arg-type]
    assert all(peak <= plan.predicted_peak_bytes for peak in measured.peaks)


class _Manual(_Module):
    def __init__(self) -> None:
        super().__init__("gpt2")
        self.automatic_optimization = False

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        loss = self.model(**batch).loss
        self.manual_backward(loss)
        self.optimizers().step()  # type: ignore[union-attr]
        return loss


def test_manual_optimization_is_refused_before_any_step() -> None:
    module = _Manual()
    with pytest.raises(RematError, match="manual optimization"):
        _fit(module, [AutorematCallback(budget="75%")])
    assert "training_step" not in vars(module)


def test_a_module_fitted_compiled_needs_compile() -> None:
    module = _Module("gpt2")
    with pytest.raises(RematError, match="compile=True"):
        _fit(torch.compile(module), [AutorematCallback(budget="75%")])


@pytest.mark.slow  # about 30 s: auto compiles the step whole for each plan it measures
def test_a_module_fitted_compiled_is_planned_for_the_compiled_step() -> None:
    plain = _Measure()
    _fit(torch.compile(_Module("gpt2"), backend="aot_eager"), [plain])
    module, measured = _Module("gpt2"), _Measure()
    callback = AutorematCallback(budget="90%", compile="aot_eager")
    trainer = _fit(torch.compile(module, backend="aot_eager"), [callback, measured])
    plan = callback.plan
    assert trainer.global_step == 2
    # fitted by measuring the step compiled whole: it fits the budget there, recomputing
    # or not (NOTE [ Compiled plans are fitted by measurement ])
    assert plan is not None and plan.compiled == "aot_eager"
    assert plan.compiled_peak_bytes is not None and plan.budget_bytes is not None
    assert plan.compiled_peak_bytes <= plan.budget_bytes
    for ours, theirs in zip(measured.grads, plain.grads, strict=True):
        differ = [n for n in theirs if not torch.equal(ours[n], theirs[n])]  # type: ignore[arg-type]
        assert differ == [], differ[:3]
    # Lightning's compiled training_step is the module's own again after the fit
    assert getattr(vars(module).get("training_step"), "__wrapped__", None) is not None


def test_a_model_with_hf_checkpointing_on_is_refused() -> None:
    module = _Module("gpt2")
    module.model.gradient_checkpointing_enable()
    with pytest.raises(RematError, match="gradient_checkpointing_disable"):
        _fit(module, [AutorematCallback(budget="75%")])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"budget": "75 percent"}, "budget"),
    ({"budget": "75%", "loop": "holds"}, "unknown loop"),
    ({"budget": "75%", "head": "chunky"}, "head must be"),
    ({"budget": "75%", "compile": "inductr"}, "compile must be"),
    ({"budget": "75%", "margin": 1.5}, "margin"),
    ({}, "would keep every block"),
])
def test_bad_arguments_fail_when_the_callback_is_made(kwargs: dict[str, Any],
                                                      message: str) -> None:
    with pytest.raises(RematError, match=message):
        AutorematCallback(**kwargs)


def test_a_missing_extra_is_named_with_its_install_command() -> None:
    with pytest.raises(MissingExtraError, match=r"pip install 'autoremat\[lightning\]'"):
        require_extra("lightning_not_installed_here", "lightning", "autoremat.lightning")
    assert issubclass(MissingExtraError, ImportError) and issubclass(MissingExtraError,
                                                                     RematError)
