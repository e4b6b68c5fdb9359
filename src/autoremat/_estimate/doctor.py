"""``autoremat doctor``: will this training step fit in this much memory, and if not, what to do.

The doctor measures the step on ``meta`` tensors with :func:`autoremat.estimate`
and compares the whole iteration's peak (parameters, optimizer state, batch, and the
larger of the forward/backward and the optimizer-step peaks) with the device's memory.
It prescribes, in order:

1. nothing, when the plain step fits (on CUDA with the margin a plan keeps to spare:
   NOTE [ The margin kept for the CUDA allocator ] in ``_plan/budget.py``);
2. activation checkpointing, when every block checkpointed fits: the cheapest plan the
   planner finds, with selective recompute among its options (or every block, when the
   planner finds none);
3. otherwise, remedies, each with its estimated effect: a fused optimizer, a chunked loss
   when the logits dominate, a smaller micro-batch with gradient accumulation
   (re-measured at that batch, not scaled), sharding optimizer state, gradients and
   parameters over N data-parallel ranks (ZeRO-1/2/3 arithmetic), and if none is enough
   alone, all of them together.

NOTE [ Hugging Face configs for training ]
    :func:`build_hf_model` sets ``use_cache=False``, as Transformers itself does when
    training with gradient checkpointing: with the cache on, every recompute appends its
    keys and values to the cache and the checkpointed step grows by two (B, heads, T,
    head_dim) tensors per layer. Attention is ``"sdpa"``, its masks built on meta as on a
    device (NOTE [ Hugging Face models on meta ] in ``fake.py``).

Known limitations:
    * ZeRO figures are arithmetic on the measured step: gradients shard as they are
      reduced (buckets ignored), and FSDP holds two blocks' parameters unsharded.
    * The chunked-loss figure assumes everything the head and loss create (except the
      head's weight gradients) shrinks with the chunk.
"""

from __future__ import annotations

import dataclasses
import math
import os
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoremat._core.errors import BudgetError, RematError, did_you_mean
from autoremat._core.files import dump_json
from autoremat._core.step import (
    LossFn,
    Step,
    as_step,
    flat_tensors,
    map_tensors,
    unique_storage_bytes,
)
from autoremat._core.units import format_bytes, parse_size
from autoremat._estimate.estimate import Estimate, estimate
from autoremat._estimate.fake import parse_dtype
from autoremat._estimate.tracked_step import LOSS_CHUNKS, StepPeak, meta_step_peak
from autoremat._measure.blocks import BlockSpec
from autoremat._measure.optimizers import takes_fused
from autoremat._plan.budget import budget_for, fsdp_param_bytes, margin_for

__all__ = [
    "HF_FAMILIES",
    "Prescription",
    "Remedy",
    "build_hf_model",
    "doctor",
    "memory_bars",
    "plot_memory",
]

DOCTOR_SCHEMA_VERSION = 1
_RANKS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # data-parallel sizes tried for sharding

# family -> (config class, model class) in transformers
HF_FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "bert": ("BertConfig", "BertForMaskedLM"),
}


# --- building targets ----------------------------------------------------------------------


def build_hf_model(family: str, config_overrides: dict[str, Any] | None = None, batch: int = 1,
                   seq: int = 2048, dtype: torch.dtype | str | None = None, *,
                   device: str | torch.device = "meta",
                   seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Transformers model built from its config class (nothing downloaded), in train mode,
    and a batch of ``input_ids`` and ``labels`` of shape (batch, seq).

    Args:
        family: one of :data:`HF_FAMILIES` (``"llama"``, ``"mistral"``, ``"qwen2"``,
            ``"gpt2"``, ``"bert"``), or any Transformers ``model_type`` with a
            sequence-to-sequence, masked or causal language-model class (``"qwen3"``,
            ``"gemma3_text"``, ``"mixtral"``, ``"t5"``, ...: the first of those it has).
        config_overrides: fields of the family's config, e.g. ``{"num_hidden_layers": 32}``;
            a misspelt field is an error (Transformers would silently keep it).
        batch, seq: the batch shape.
        dtype: floating dtype of parameters and buffers (default: the config's float32).
        device: ``"meta"`` (default: nothing allocated) or a real device for comparisons.
        seed: seeds the weights and token ids on a real device.

    Example:
        >>> model, inputs = build_hf_model("gpt2", {"n_layer": 2}, batch=1, seq=16)
        >>> type(model).__name__, tuple(inputs["input_ids"].shape)
        ('GPT2LMHeadModel', (1, 16))
    """
    key = family.strip().lower()
    try:
        import transformers
    except ImportError as exc:
        raise RematError("--hf needs transformers: pip install 'autoremat[hf]'") from exc
    config_cls, model_cls, seq2seq = _hf_classes(transformers, key, family)
    overrides = dict(config_overrides or {})
    defaults = config_cls()
    valid = set(vars(defaults)) | set(getattr(config_cls, "attribute_map", {}))
    for name in overrides:
        if name not in valid:
            raise RematError(f"{config_cls.__name__} has no field {name!r}."
                             f"{did_you_mean(name, sorted(valid))}")
    overrides.setdefault("use_cache", False)
    if getattr(model_cls, "_supports_sdpa", True):  # else its own (eager), estimated too
        overrides.setdefault("attn_implementation", "sdpa")  # NOTE [ Hugging Face models on meta ]
    config = config_cls(**overrides)
    if seq2seq and getattr(config, "decoder_start_token_id", None) is None:
        # T5's config leaves it to the generation config: the decoder starts at padding
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    heads, kv_heads = (getattr(config, k, None) for k in ("num_attention_heads",
                                                          "num_key_value_heads"))
    if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 \
            and heads % kv_heads:
        raise RematError(f"{family}: num_attention_heads={heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads} (the config's value unless given), "
                         f"which attention needs; set num_key_value_heads to a divisor of "
                         f"{heads}")
    if batch < 1 or seq < 1:
        raise RematError(f"batch and seq must be at least 1, got batch={batch}, seq={seq}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config)
        ids = torch.randint(0, config.vocab_size, (batch, seq))  # (B, T)
    _check_position_table(model, config, family, seq)
    cast = parse_dtype(dtype)
    if cast is not None:
        model.to(dtype=cast)
    model.train()
    return model, {"input_ids": ids, "labels": ids.clone()}


def _hf_classes(transformers: Any, key: str, family: str) -> tuple[Any, Any, bool]:
    """The config and model classes of ``key``: a family of :data:`HF_FAMILIES`, or any
    Transformers ``model_type`` (``qwen3``, ``gemma3_text``, ``mixtral``, ...) with a
    sequence-to-sequence, masked or causal language-model class, taken in that order
    (BART and T5 train as encoder-decoders, BERT-like encoders by masked LM); and whether
    the model is an encoder-decoder."""
    if key in HF_FAMILIES:
        return (getattr(transformers, HF_FAMILIES[key][0]),
                getattr(transformers, HF_FAMILIES[key][1]), False)
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto

    types = list(CONFIG_MAPPING.keys())
    found = next((k for k in (key, key.replace("-", "_"), key.replace("_", "-"))
                  if k in types), None)
    names = [getattr(modeling_auto, f"MODEL_FOR_{kind}_MAPPING_NAMES", {}).get(found)
             for kind in ("SEQ_TO_SEQ_CAUSAL_LM", "MASKED_LM", "CAUSAL_LM")] \
        if found is not None else []
    name = next((n for n in names if n), None)
    if found is None or name is None or not hasattr(transformers, name):
        known = [*HF_FAMILIES, *(k for k in types if k not in HF_FAMILIES)]
        why = (f"Transformers' model type {found!r} has no language-model class "
               f"(sequence-to-sequence, masked or causal) to build." if found is not None
               else f"it is not a Transformers model type.{did_you_mean(key, known)}")
        raise RematError(f"unknown Hugging Face family {family!r}: {why} Give one of "
                         f"{', '.join(HF_FAMILIES)}, or a model type of your Transformers "
                         f"(e.g. qwen3, gemma3_text, mixtral, t5); or build the model "
                         f"yourself and call autoremat.estimate")
    return CONFIG_MAPPING[found], getattr(transformers, name), name == names[0]


def _check_position_table(model: nn.Module, config: Any, family: str, seq: int) -> None:
    """Refuse a ``seq`` longer than a learned position table of ``model`` holds (an
    embedding named for positions, or GPT-2's ``wpe``; rotary models have none): on
    ``meta`` a lookup past its end raises nothing, on a device it fails. Tables may hold
    a few more rows than positions (OPT's two): the check is by the table's rows, and
    names the config's field where one holds that many (GPT-2's ``n_positions``)."""
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if not (isinstance(module, nn.Embedding) and ("pos" in last or last == "wpe")
                and seq > module.num_embeddings):
            continue
        rows = module.num_embeddings
        field = next((k for k, v in vars(config).items()
                      if "position" in k and v == rows and not isinstance(v, bool)), None)
        fix = (f" ({field}={rows}): add {field}={seq} to the config" if field is not None
               else f"; raise the config's maximum positions (e.g. max_position_embeddings) "
                    f"to at least {seq}")
        raise RematError(f"{family}: seq={seq} exceeds the {rows} positions of its learned "
                         f"position table {name!r}{fix}")


# --- the prescription ----------------------------------------------------------------------


@dataclass(frozen=True)
class Remedy:
    """One thing to change, and the device peak it leads to."""

    name: str  # "fused-optimizer", "chunked-loss", "micro-batch", "zero-1", ..., "combined"
    action: str  # what to do, in one sentence
    total_peak_bytes: int  # the iteration's device peak with it (best checkpointing choice)
    fits: bool
    checkpointing: str  # "none" or "every block" (the lighter one that fits, if any)


@dataclass(frozen=True)
class Prescription:
    """The doctor's answer. ``print(p)`` shows it; ``p.fits_as_is`` / ``p.fits`` decide."""

    target: str
    memory_bytes: int
    estimate: Estimate
    fits_as_is: bool  # the plain step fits
    fits: bool  # fits as is or with checkpointing (no other change)
    verdict: str
    plan_total_peak_bytes: int | None  # with the prescribed checkpointing, when it fits
    plan_recompute_overhead: float | None  # its extra FLOPs over the plain step
    plan_source: str | None  # "planner" or "every block" (the planner is not available)
    remedies: tuple[Remedy, ...] = ()
    notes: tuple[str, ...] = ()
    plot_path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["estimate"] = self.estimate.to_dict()
        data["remedies"] = [dataclasses.asdict(r) for r in self.remedies]
        data["schema_version"] = DOCTOR_SCHEMA_VERSION
        return data

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        return dump_json(self.to_dict(), path)

    def __str__(self) -> str:
        lines = [str(self.estimate), "", self.verdict]
        if self.remedies:
            lines.append("Remedies, each on its own (peak of the iteration with it):")
            for r in self.remedies:
                ckpt = "no checkpointing" if r.checkpointing == "none" else \
                    f"{r.checkpointing} checkpointed"
                lines.append(f"  {'fits' if r.fits else 'no':<5}{r.name:<16}"
                             f"{format_bytes(r.total_peak_bytes):>11}  ({ckpt})")
                lines.append(textwrap.fill(r.action, width=100, initial_indent=" " * 21,
                                           subsequent_indent=" " * 21))
        lines.extend(f"Note: {n}" for n in self.notes)
        if self.plot_path:
            lines.append(f"Plot: {self.plot_path}")
        return "\n".join(lines)


@dataclass(frozen=True)
class _Setting:
    """One way to run the step, for the device-peak arithmetic."""

    ckpt: bool = False  # every block checkpointed
    chunked_loss: bool = False
    fused_optimizer: bool = False
    zero_stage: int = 0  # 0: none, 1: optimizer state, 2: + gradients, 3: + parameters
    ranks: int = 1
    step: StepPeak | None = None  # measured at another micro-batch (None: the estimate's)
    input_bytes: int | None = None
    # micro-batches with gradient accumulation: from the second on, every gradient is
    # held through the step, which then peaks elsewhere (the remedy said "fits" 2.8 GiB
    # short on a held-out OLMo2 until 2026-11-29, 3.8% short on an OLMo until
    # 2026-11-30: NOTE [ Steps that accumulate ] in tracked_step.py)
    accumulated: bool = False


def _device_peak(est: Estimate, s: _Setting, kept: bool = False) -> int:
    """The iteration's device peak under setting ``s`` (see NOTE [ Total peak ]); with
    ``kept``, what the device must hold for it to fit: the step's peak with the margin a
    plan keeps for a CUDA device (NOTE [ The margin kept for the CUDA allocator ] in
    ``_plan/budget.py``; 0 elsewhere)."""
    step = s.step or _steps(est)[s.ckpt]
    n = s.ranks if s.zero_stage else 1
    peak = step.peak_bytes
    chunked = s.chunked_loss and step.chunked_loss_peak_bytes is not None
    if chunked:
        peak = min(peak, step.chunked_loss_peak_bytes or peak)
    grads, at_peak = est.grad_bytes, step.grads_at_peak_bytes
    if s.zero_stage >= 2:
        peak -= at_peak - at_peak // n
        grads, at_peak = grads // n, at_peak // n
    if s.accumulated:  # the gradients held from the first micro-batch, besides the later
        # steps' peak (NOTE [ Steps that accumulate ] in tracked_step.py)
        later = step.accumulating_peak_bytes  # (measured with its chunked figure)
        if later is not None and chunked and step.accumulating_chunked_peak_bytes is not None:
            later = min(later, step.accumulating_chunked_peak_bytes)
        peak = peak + grads - at_peak if later is None else max(peak, grads + later)
    if kept:
        peak = budget_for(peak, margin_for(est.device))
    optimizer = est.optimizer_bytes // n if s.zero_stage >= 1 else est.optimizer_bytes
    opt_step = 0 if s.fused_optimizer else est.optimizer_step_bytes // n
    params = est.param_bytes
    if s.zero_stage >= 3:  # NOTE [ Sharded over N ranks ] in _plan/budget.py
        params = fsdp_param_bytes(params, [b.param_bytes for b in est.tape.blocks]
                                  if est.tape is not None else [], n)
    inputs = est.input_bytes if s.input_bytes is None else s.input_bytes
    held = dataclasses.replace(est.iteration_memory, param_bytes=params, optimizer_bytes=optimizer,
                               input_bytes=inputs, grad_bytes=grads,
                               optimizer_step_bytes=opt_step)
    return held.peak_bytes(peak)


def _steps(est: Estimate) -> dict[bool, StepPeak]:
    return {
        False: StepPeak(est.step_peak_bytes, est.peak_breakdown.get("gradients", 0),
                        est.head_chunked_step_peak_bytes),
        True: StepPeak(est.ckpt_step_peak_bytes, est.ckpt_peak_breakdown.get("gradients", 0),
                       est.ckpt_head_chunked_step_peak_bytes),
    }


def _fits(est: Estimate, s: _Setting, memory: int) -> bool:
    """Whether the iteration under setting ``s`` fits ``memory``, the CUDA margin kept."""
    return _device_peak(est, s, kept=True) <= memory


def _plain_or_checkpointed(est: Estimate, memory: int, name: str, action: str,
                           plain: _Setting, ckpt: _Setting) -> Remedy:
    """The remedy under setting ``plain`` (no checkpointing) if that fits, else under
    ``ckpt`` (every block checkpointed)."""
    if _fits(est, plain, memory):
        return Remedy(name, action, _device_peak(est, plain), True, "none")
    return Remedy(name, action, _device_peak(est, ckpt), _fits(est, ckpt, memory),
                  "every block")


def _best(est: Estimate, memory: int, name: str, action: str, **setting: Any) -> Remedy:
    """The remedy without checkpointing if that fits, else with every block checkpointed."""
    return _plain_or_checkpointed(est, memory, name, action, _Setting(ckpt=False, **setting),
                                  _Setting(ckpt=True, **setting))


def _batch_of(inputs: Any) -> int | None:
    """The leading size of the first tensor in ``inputs`` (the batch, by convention)."""
    tensors = [t for t in flat_tensors(inputs) if t.dim()]
    return int(tensors[0].shape[0]) if tensors else None


def _rebatch(inputs: Any, batch: int, new: int) -> Any:
    """The batch's first ``new`` rows: the real rows of a real batch, whose values a
    forward may read (NOTE [ Following the batch's values ] in ``fake.py``)."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() and t.shape[0] == batch:
            return t[:new] if not t.is_meta else torch.empty_like(t[:new], device="meta")
        return t

    return map_tensors(cut, inputs)


def _remedies(est: Estimate, memory: int, model: nn.Module, inputs: Any,
              measure: Callable[[Any, bool], StepPeak]) -> list[Remedy]:
    out: list[Remedy] = []
    if takes_fused(est.optimizer) and est.optimizer_step_bytes > 0:
        out.append(_best(est, memory, "fused-optimizer",
                         f"construct the optimizer with fused=True: it updates in place, without "
                         f"the {format_bytes(est.optimizer_step_bytes)} of foreach temporaries",
                         fused_optimizer=True))
    for ckpt, peak, chunked in ((False, est.step_peak_bytes, est.head_chunked_step_peak_bytes),
                                (True, est.ckpt_step_peak_bytes,
                                 est.ckpt_head_chunked_step_peak_bytes)):
        if chunked is None or chunked >= peak:
            continue
        chunks = _best(est, memory, "chunked-loss", "", chunked_loss=True)
        if (chunks.checkpointing != "none") != ckpt:
            continue  # the other configuration is the one that ends up used
        out.append(dataclasses.replace(chunks, action=(
            f"compute the logits and loss in {LOSS_CHUNKS} chunks of the sequence: the logits "
            f"and their gradient make the step's peak, which drops by about "
            f"{format_bytes(peak - chunked)}. autoremat applies it for a Hugging Face causal "
            f"LM given labels or a model with an autoremat.LMHead: autoremat.auto(model, "
            f"inputs, budget=..., head='auto')")))
    batch = _batch_of(inputs)
    micro = _micro_batch(est, memory, inputs, batch, measure) if batch and batch > 1 else None
    if micro is not None:
        out.append(micro)
    for stage, label, what in ((1, "zero-1", "optimizer state"),
                               (2, "zero-2", "optimizer state and gradients"),
                               (3, "fsdp", "parameters, gradients and optimizer state")):
        remedy = _sharded(est, memory, stage, label, what)
        if remedy is not None:
            out.append(remedy)
    if out and not any(r.fits for r in out):
        out.append(_combined(est, memory, inputs, batch, measure))
    return out


def _sharded(est: Estimate, memory: int, stage: int, label: str, what: str) -> Remedy | None:
    how = {1: "ZeRO-1, e.g. torch.distributed.optim.ZeroRedundancyOptimizer",
           2: "ZeRO-2, e.g. DeepSpeed stage 2", 3: "FSDP2 fully_shard or ZeRO-3"}[stage]
    remedy: Remedy | None = None
    for n in _RANKS:
        remedy = _best(est, memory, label,
                       f"shard the {what} over {n} data-parallel ranks ({how})",
                       zero_stage=stage, ranks=n)
        if remedy.fits:
            return remedy
    if remedy is None:
        return None
    return dataclasses.replace(remedy, action=f"sharding the {what} ({how}) is not enough "
                                              f"alone, even over {_RANKS[-1]} ranks")


def _micro_batch(est: Estimate, memory: int, inputs: Any, batch: int,
                 measure: Callable[[Any, bool], StepPeak]) -> Remedy | None:
    sizes = sorted({max(1, batch // 2**k) for k in range(1, 12)} - {batch}, reverse=True)
    last: Remedy | None = None
    for micro in sizes:
        small = _rebatch(inputs, batch, micro)
        steps = {False: measure(small, False), True: measure(small, True)}
        action = (f"micro-batch {micro} with {math.ceil(batch / micro)} gradient-accumulation "
                  f"steps (effective batch {batch}); re-measured at batch {micro}")
        input_bytes = unique_storage_bytes(small)
        last = _plain_or_checkpointed(
            est, memory, "micro-batch", action,
            _Setting(step=steps[False], input_bytes=input_bytes, accumulated=True),
            _Setting(ckpt=True, step=steps[True], input_bytes=input_bytes, accumulated=True))
        if last.fits:
            return last
    return last


def _combined(est: Estimate, memory: int, inputs: Any, batch: int | None,
              measure: Callable[[Any, bool], StepPeak]) -> Remedy:
    step, input_bytes, parts = None, None, ["every block checkpointed"]
    if batch and batch > 1:
        small = _rebatch(inputs, batch, 1)
        step, input_bytes = measure(small, True), unique_storage_bytes(small)
        parts.append(f"micro-batch 1 x {batch} accumulation steps")
    fused = takes_fused(est.optimizer)
    parts += ["fused optimizer"] * fused + [f"loss in {LOSS_CHUNKS} chunks"]
    setting = _Setting()
    for n in _RANKS:
        setting = _Setting(ckpt=True, chunked_loss=True, fused_optimizer=fused, zero_stage=3,
                           ranks=n, step=step, input_bytes=input_bytes,
                           accumulated=step is not None)
        if _fits(est, setting, memory):
            break
    return Remedy("combined", ", ".join([*parts, f"FSDP over {n} ranks"]),
                  _device_peak(est, setting), _fits(est, setting, memory), "every block")


def doctor(model: nn.Module | Step, inputs: Any = None, *, memory: int | str = "80GiB",
           device: str | torch.device | None = "cuda", dtype: torch.dtype | str | None = None,
           optimizer: str | int | None = "adamw", loss_fn: LossFn | None = None,
           blocks: BlockSpec = None, throughput_flops: float | None = None,
           plot_path: str | os.PathLike[str] | None = None,
           target: str | None = None,
           progress: Callable[[str], None] | None = None) -> Prescription:
    """Estimate a training step on ``meta`` and prescribe what makes it fit in ``memory``.

    Args:
        model, inputs: as for :func:`autoremat.estimate` (any device; ``meta``
            is cheapest); or an :class:`autoremat.Step` in place of both, which carries
            ``loss_fn`` and the loop too (``doctor(step, memory="24GiB")``).
        memory: the device's memory (``"80GiB"``, bytes).
        device, dtype, optimizer, loss_fn, blocks, throughput_flops: as for ``estimate``.
        plot_path: write a PNG of where the memory goes there (needs matplotlib).
        target: a label for the report (default: the model's class name).
        progress: called with the name of each stage as it starts, for a progress
            display (as for :func:`autoremat.profile`); default: nothing.

    Returns:
        A :class:`Prescription`.

    Example:
        >>> import autoremat
        >>> model, inputs = autoremat.zoo.build("gpt2", device="meta", n_layer=2)
        >>> p = doctor(model, inputs, memory="1GiB")
        >>> p.fits_as_is
        True
    """
    step = as_step(model, inputs, loss_fn, None, caller="doctor", keyword="memory")
    limit = parse_size(memory, what="memory")
    if limit <= 0:
        raise BudgetError(f"memory must be the device's memory in bytes (> 0), got "
                          f"{memory!r}; e.g. memory='80GiB'")
    options: dict[str, Any] = {"blocks": blocks, "device": device,
                               "dtype": dtype, "optimizer": optimizer,
                               "throughput_flops": throughput_flops}
    # selective-recompute options can cost more passes: measured only for a plan
    stage = progress or (lambda _: None)
    est = estimate(step, selective=False, progress=progress, **options)
    label = target or est.model
    plain, ckpt = est.total_peak_bytes, est.ckpt_total_peak_bytes
    notes: list[str] = []
    plan_total: int | None = None
    overhead: float | None = None
    source: str | None = None
    remedies: list[Remedy] = []
    fits_as_is, fits = _fits(est, _Setting(), limit), _fits(est, _Setting(ckpt=True), limit)
    margin = margin_for(est.device)
    if margin:
        notes.append(f"a step on {est.device} fits only with {float(margin):.0%} of its step peak "
                     f"to spare for the CUDA allocator's blocks, the margin a plan keeps "
                     f"(NOTE [ The margin kept for the CUDA allocator ])")
    if fits_as_is:
        verdict = (f"FITS in {format_bytes(limit)} without checkpointing: peak "
                   f"{format_bytes(plain)}, {format_bytes(limit - plain)} to spare.")
    elif fits:
        stage("planning under the limit")
        try:
            est = estimate(step, max_memory=limit, progress=progress, **options)
        except BudgetError as exc:
            notes.append(f"the planner found no plan under the limit ({exc}); the "
                         f"prescription checkpoints every block")
        if est.plan_total_peak_bytes is not None:
            plan_total, overhead, source = (est.plan_total_peak_bytes,
                                            est.recompute_overhead or 0.0, "planner")
        else:
            plan_total, overhead, source = (est.ckpt_total_peak_bytes,
                                            est.ckpt_recompute_overhead, "every block")
        verdict = (f"FITS in {format_bytes(limit)} with checkpointing ({source}): peak "
                   f"{format_bytes(plan_total)} instead of {format_bytes(plain)}, "
                   f"+{100 * overhead:.1f}% FLOPs recomputed.")
    else:
        def measure(small: Any, ckpt_all: bool) -> StepPeak:
            return meta_step_peak(step.model, small, loss_fn=step.loss_fn, blocks=blocks,
                                  device=est.device, dtype=dtype, checkpoint_all=ckpt_all,
                                  loop=step.loop, accumulating=True)  # (micro-batches)

        stage("remedies: fake steps at other settings")
        remedies = _remedies(est, limit, step.model, step.inputs, measure)
        verdict = (f"DOES NOT FIT in {format_bytes(limit)}: peak {format_bytes(plain)} without "
                   f"checkpointing, {format_bytes(ckpt)} with every block checkpointed"
                   + (f", each with {float(margin):.0%} of its step's peak to spare"
                      if margin else "") + ".")
    result = Prescription(
        target=label, memory_bytes=limit, estimate=est, fits_as_is=fits_as_is,
        fits=fits, verdict=verdict, plan_total_peak_bytes=plan_total,
        plan_recompute_overhead=overhead, plan_source=source, remedies=tuple(remedies),
        notes=tuple(notes))
    if plot_path is not None:
        stage("writing the plot")
        plot_memory(result, plot_path)
        result = dataclasses.replace(result, plot_path=str(plot_path))
    return result


# --- the plot ------------------------------------------------------------------------------


_SEGMENTS = ("parameters", "optimizer state", "buffers + batch", "activations", "gradients",
             "temporaries", "optimizer step temporaries",
             "step peak with the plan (not broken down)")


def memory_bars(prescription: Prescription) -> dict[str, list[int]]:
    """The bars :func:`plot_memory` draws: per phase, bytes per segment of ``_SEGMENTS``."""
    est = prescription.estimate
    resting = [est.param_bytes, est.optimizer_bytes, est.buffer_bytes + est.input_bytes]
    bars: dict[str, list[int]] = {}
    for label, breakdown in (("forward+backward\nno checkpointing", est.peak_breakdown),
                             ("forward+backward\nevery block\ncheckpointed",
                              est.ckpt_peak_breakdown)):
        bars[label] = [*resting, breakdown.get("activations", 0), breakdown.get("gradients", 0),
                       breakdown.get("temporaries", 0), 0, 0]
    if prescription.plan_total_peak_bytes is not None:  # the plan the verdict prescribes
        step = est.plan_peak_bytes if prescription.plan_source == "planner" and \
            est.plan_peak_bytes is not None else est.ckpt_step_peak_bytes
        overhead = 100 * (prescription.plan_recompute_overhead or 0.0)
        bars[f"forward+backward\nprescribed plan\n(+{overhead:.0f}% FLOPs)"] = \
            [*resting, 0, 0, 0, 0, step]
    bars["optimizer.step()"] = [*resting, 0, est.grad_bytes, 0, est.optimizer_step_bytes, 0]
    return bars


def plot_memory(prescription: Prescription, path: str | os.PathLike[str]) -> None:
    """Stacked bars of where the device's memory goes at the peak of each phase (forward+
    backward without checkpointing, with every block checkpointed, with the prescribed
    plan when there is one; the optimizer step), against the limit."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RematError("the plot needs matplotlib: pip install 'autoremat[plot]'") from exc
    est = prescription.estimate
    bars = memory_bars(prescription)
    segments = _SEGMENTS
    gib = 2**30
    figure = Figure(figsize=(4.5 + 1.6 * len(bars), 4.8))  # room for each bar's label
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    labelled: set[int] = set()  # each segment in the legend once, and only if drawn
    for x, values in enumerate(bars.values()):
        bottom = 0.0
        for i, value in enumerate(values):
            axes.bar(x, value / gib, bottom=bottom, color=f"C{i}", width=0.6,
                     label=segments[i] if value and i not in labelled else None)
            labelled.update([i] if value else [])
            bottom += value / gib
    axes.axhline(prescription.memory_bytes / gib, color="black", linestyle="--",
                 label=f"memory {format_bytes(prescription.memory_bytes)}")
    axes.set_xticks(range(len(bars)), list(bars))
    axes.set_ylabel("GiB on the device")
    axes.set_title(f"{prescription.target} on {est.device}: peak of each phase")
    handles, labels = axes.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda k: (labels[k] in segments and
                                                      segments.index(labels[k])))
    axes.legend([handles[k] for k in order], [labels[k] for k in order], fontsize="small",
                loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    figure.savefig(tmp, format="png", dpi=110)
    os.replace(tmp, target)
