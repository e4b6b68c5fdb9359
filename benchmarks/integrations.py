"""What the training-framework callbacks cost beyond ``profile``: the Hugging Face
``Trainer``'s, TRL's ``SFTTrainer``'s (both ``autoremat.hf.AutorematCallback``) and
Lightning's (``autoremat.lightning.AutorematCallback``).

Each callback plans once per training run (a re-plan is a new run). For each framework
and each of ``--repeats`` runs, on a fresh model (a randomly initialised Hugging Face Llama
built from its config class, nothing downloaded), it times:

* ``callback``: the wall time of the callback's planning hook (``on_train_begin``; under
  Lightning ``on_train_batch_start`` of the first batch): finding the batch and the loss
  the framework takes, ``profile``, ``plan``, ``apply`` and ``auto``'s measured check;
* ``profile``: ``autoremat.profile`` of the same step, with the options ``auto`` gives it
  (``timing=False``, the head kept), right after the run, on the same model;
* ``plain step``: that step's forward, loss and backward without a plan, the median of
  ``--steps`` after a warm-up;

and reports ``(callback - profile) / plain step``: the callback's cost beyond profile's own,
in plain steps (the target: at most 2 per re-plan), the median over the runs, and the same
from the fastest of each (a run that another process slowed down moves the median less
than the mean, and the fastest runs not at all).

Run:        OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/integrations.py
Quick test: python benchmarks/integrations.py --size tiny --repeats 1 --out /tmp/integ
Writes ``<out>/integrations_<device slug>.json`` and ``.md``; device, torch version, the
frameworks' versions, date and thread count in both. Times are wall clocks on whatever
else the machine is running: on a shared CPU they move by 10-30%.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import pathlib
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import datasets
import lightning
import tokenizers
import torch
import transformers
import trl
from torch import nn

import autoremat
from autoremat import hf
from autoremat import lightning as autoremat_lightning
from autoremat._bench.report import device_info, device_slug
from autoremat._callbacks import PlanArgs
from autoremat._core.files import dump_json
from autoremat._core.step import Step, preserved_state
from autoremat._measure.timing import time_ms

# (layers, width, seq, batch, vocab), and the budget: SFTTrainer's fused head's own
# buffers are much of a tiny model's step, which a tighter budget cannot fit
_SIZES = {"default": (6, 256, 256, 4, 2048), "tiny": (2, 32, 32, 2, 128)}
_BUDGETS = {"default": "85%", "tiny": "98%"}


def _model(size: str) -> nn.Module:
    layers, width, seq, _, vocab = _SIZES[size]
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=width, intermediate_size=width * 8 // 3 // 8 * 8,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
        max_position_embeddings=seq, use_cache=False, bos_token_id=1, eos_token_id=1,
        pad_token_id=0)).train()


def _ids(size: str) -> torch.Tensor:
    _, _, seq, batch, vocab = _SIZES[size]
    return torch.randint(3, vocab, (4 * batch, seq), generator=torch.Generator().manual_seed(2))


class _Recorded:
    """Keeps the step each callback plans for (``PlanArgs.plan`` wrapped), so that its
    profile can be timed on its own after the run."""

    def __init__(self) -> None:
        self.step: Step | None = None
        self.context: Callable[[], Any] | None = None
        self._plan = PlanArgs.plan

    def __enter__(self) -> _Recorded:
        recorded = self

        def plan(args: PlanArgs, step: Step, head: str | None = None) -> autoremat.Plan:
            recorded.step = step
            return recorded._plan(args, step, head)

        PlanArgs.plan = plan  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        PlanArgs.plan = self._plan  # type: ignore[method-assign]


def _timed(callback: Any, hook: str) -> list[float]:
    """Wrap ``callback``'s method ``hook``: each call's wall seconds go into the list."""
    seconds: list[float] = []
    original = getattr(callback, hook)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(callback, hook, timed)
    return seconds


def _labelled(size: str) -> list[dict[str, torch.Tensor]]:
    """The examples, each its own label."""
    return [{"input_ids": x, "labels": x.clone()} for x in _ids(size)]


def _trainer(size: str, out: str) -> tuple[float, Step]:
    batch = _SIZES[size][3]
    callback = hf.AutorematCallback(budget=_BUDGETS[size])
    seconds = _timed(callback, "on_train_begin")
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=1, per_device_train_batch_size=batch, report_to=[],
        use_cpu=True, save_strategy="no", disable_tqdm=True)
    with _Recorded() as recorded:
        transformers.Trainer(model=_model(size), args=args, train_dataset=_labelled(size),
                             callbacks=[callback]).train()
    assert recorded.step is not None
    return seconds[0], recorded.step


def _sft(size: str, out: str) -> tuple[float, Step]:
    _, _, seq, batch, vocab = _SIZES[size]
    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(words, "<unk>")),
        pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    data = datasets.Dataset.from_dict({"input_ids": _ids(size).tolist()})
    callback = hf.AutorematCallback(budget=_BUDGETS[size])
    seconds = _timed(callback, "on_train_begin")
    args = trl.SFTConfig(
        output_dir=out, max_steps=1, per_device_train_batch_size=batch, report_to=[],
        use_cpu=True, save_strategy="no", disable_tqdm=True, bf16=False, max_length=seq,
        gradient_checkpointing=False, activation_checkpointing=False)
    with _Recorded() as recorded:
        trl.SFTTrainer(model=_model(size), args=args, train_dataset=data,
                       processing_class=tokenizer, callbacks=[callback]).train()
    assert recorded.step is not None
    return seconds[0], recorded.step


class _Module(lightning.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _lightning(size: str, out: str) -> tuple[float, Step]:
    batch = _SIZES[size][3]
    callback = autoremat_lightning.AutorematCallback(budget=_BUDGETS[size])
    seconds = _timed(callback, "on_train_batch_start")
    trainer = lightning.Trainer(
        max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
        default_root_dir=out)
    with _Recorded() as recorded:
        trainer.fit(_Module(_model(size)), torch.utils.data.DataLoader(
            _labelled(size), batch_size=batch))  # type: ignore[arg-type]
    assert recorded.step is not None
    return seconds[0], recorded.step


FRAMEWORKS: dict[str, Callable[[str, str], tuple[float, Step]]] = {
    "transformers.Trainer": _trainer, "trl.SFTTrainer": _sft, "lightning.Trainer": _lightning}


def _as_measured(step: Step) -> Any:
    """What the callback measures the step under: Lightning's ``self.log`` off."""
    if isinstance(step.model, autoremat_lightning.LightningStep):
        return autoremat_lightning._logging_off(step.model.module)
    return contextlib.nullcontext()


def _profile_s(step: Step) -> float:
    """``profile`` of ``step`` as ``auto`` runs it, in wall seconds."""
    with _as_measured(step):
        start = time.perf_counter()
        autoremat.profile(step, timing=False, with_head=False)
        return time.perf_counter() - start


def _plain_step_s(step: Step, steps: int) -> float:
    """The median wall seconds of ``step`` without a plan (one warm-up step first)."""
    with _as_measured(step), preserved_state(step.model, step.inputs):
        step.run()
        times = [time_ms(step.run, step.device) / 1e3 for _ in range(steps)]
    return statistics.median(times)


def measure(name: str, size: str, repeats: int, steps: int) -> dict[str, Any]:
    """One framework's row: each run's callback, profile and plain-step seconds."""
    runs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as out:
            callback_s, step = FRAMEWORKS[name](size, out)
        autoremat.remove(step.model)
        profile_s = _profile_s(step)
        plain_s = _plain_step_s(step, steps)
        runs.append({"callback_s": callback_s, "profile_s": profile_s, "plain_step_s": plain_s,
                     "beyond_profile_steps": (callback_s - profile_s) / plain_s})
    fastest = {key: min(r[key] for r in runs) for key in ("callback_s", "profile_s",
                                                           "plain_step_s")}
    return {"framework": name, "loop": step.loop, "inputs": step.describe(), "runs": runs,
            "beyond_profile_steps": statistics.median(r["beyond_profile_steps"] for r in runs),
            "fastest_beyond_profile_steps": (fastest["callback_s"] - fastest["profile_s"])
            / fastest["plain_step_s"]}


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        "# The callbacks' cost beyond `profile` (`benchmarks/integrations.py`)", "",
        f"Command: `{report['command']}`  ",
        f"Machine: {report['device_name']}, torch {report['torch']}, transformers "
        f"{report['transformers']}, trl {report['trl']}, lightning {report['lightning']}, "
        f"{report['threads']} thread(s), {report['date']}  ",
        f"Model: Hugging Face Llama {report['size']} (layers, width, seq, batch, vocab = "
        f"{report['shape']}), budget {_BUDGETS[report['size']]}; median of "
        f"{report['repeats']} runs.", "",
        "| framework | loop | callback s | profile s | plain step s | beyond profile, in "
        "plain steps | the same from each one's fastest run |",
        "|---|---|---:|---:|---:|---:|---:|"]
    for row in report["rows"]:
        med = {k: statistics.median(r[k] for r in row["runs"])
               for k in ("callback_s", "profile_s", "plain_step_s")}
        lines.append(f"| {row['framework']} | {row['loop']} | {med['callback_s']:.3f} | "
                     f"{med['profile_s']:.3f} | {med['plain_step_s']:.4f} | "
                     f"{row['beyond_profile_steps']:.2f} | "
                     f"{row['fastest_beyond_profile_steps']:.2f} |")
    lines += ["", "Target: at most 2 plain steps per re-plan beyond `profile`'s own cost: "
              + ("met by every framework." if all(r["beyond_profile_steps"] <= 2
                                                 for r in report["rows"]) else
                 "**not met** where the last column is over 2."), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(_SIZES), default="default")
    parser.add_argument("--repeats", type=int, default=3, help="training runs per framework")
    parser.add_argument("--steps", type=int, default=5, help="plain steps timed per run")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    logging.disable(logging.INFO)  # the plans and the frameworks' chatter
    warnings.filterwarnings("ignore")
    rows = [measure(name, args.size, args.repeats, args.steps) for name in FRAMEWORKS]
    report = {
        "schema_version": 1, "command": "python benchmarks/integrations.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        **device_info("cpu"), "torch": torch.__version__,
        "transformers": transformers.__version__, "trl": trl.__version__,
        "lightning": lightning.__version__, "threads": torch.get_num_threads(),
        "date": datetime.date.today().isoformat(), "size": args.size,
        "shape": list(_SIZES[args.size]), "repeats": args.repeats, "rows": rows}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"integrations_{device_slug('cpu')}"
    dump_json(report, stem.with_suffix(".json"))
    stem.with_suffix(".md").write_text(_markdown(report))
    print(_markdown(report))


if __name__ == "__main__":
    main()
