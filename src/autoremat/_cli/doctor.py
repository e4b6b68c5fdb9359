"""``autoremat doctor`` (alias ``estimate``): will a step fit, and if not, what to do.

Argument parsing and printing only; the work is :func:`autoremat.doctor`.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from autoremat import zoo
from autoremat._cli.extras import require, require_for_target
from autoremat._cli.progress import stages
from autoremat._core.errors import InternalError, RematError
from autoremat._core.files import check_writable
from autoremat._core.units import parse_size
from autoremat._estimate.doctor import HF_FAMILIES, build_hf_model, doctor
from autoremat._estimate.fake import parse_dtype
from autoremat._measure.optimizers import OPTIMIZERS
from autoremat._targets import (
    TARGET_HELP,
    check_not_negative,
    load_target,
    parse_blocks,
    parse_options,
)

__all__ = ["doctor_main"]


def _target(target: str | None, args: argparse.Namespace,
                 config: dict[str, Any]) -> tuple[str, nn.Module, Any]:
    """(description, model, inputs) for ``--hf``, a zoo name or ``module:factory``."""
    if args.hf is not None:
        if target is not None:
            raise RematError(f"give either a target ({target!r}) or --hf, not both")
        batch = 1 if args.batch is None else args.batch
        seq = 2048 if args.seq is None else args.seq
        return f"hf:{args.hf} batch {batch} seq {seq}", *_hf_model(args, config, batch, seq)
    if target is None:
        raise RematError("name what to examine: a zoo model (" + ", ".join(zoo.names()) +
                         "), module:factory, or --hf FAMILY --config ...")
    sizes = {k: v for k, v in (("batch_size", args.batch), ("seq_len", args.seq))
             if v is not None}
    clash = sorted(set(sizes) & set(config))
    if clash:
        raise RematError(f"{', '.join(clash)} given twice, in --config and as --batch/--seq; "
                         "give each once")
    dtype = parse_dtype(args.dtype)
    model, inputs = load_target(target, {**config, **sizes}, device="meta",
                                dtype=(dtype or torch.float32) if ":" not in target else None)
    return (target if ":" in target else f"zoo:{target}"), model, inputs




def _hf_model(args: argparse.Namespace, config: dict[str, Any], batch: int,
              seq: int) -> tuple[nn.Module, Any]:
    """``--hf FAMILY --config ...`` built on meta; a config Transformers refuses is one line.

    NOTE [ A config Transformers refuses ]
        Transformers checks a config in its own ways: its strict dataclasses raise
        exception classes of their own (``huggingface_hub`` ``StrictDataclassError``, a
        plain ``Exception``: "hidden size (4095) is not a multiple of the number of
        attention heads (32)"), and the model's constructor raises ``ValueError``,
        ``TypeError``, ``ZeroDivisionError`` or (from ``nn.Embedding``: a ``pad_token_id``
        past ``vocab_size``) ``AssertionError`` on sizes it cannot build
        (``num_attention_heads=0``). Those are about the user's ``--config`` and are
        reported in one line (chained to the original); anything else (an
        ``AttributeError`` of a Transformers version autoremat does not know, autoremat's
        own errors) passes through unchanged.
    """
    check_not_negative(config)
    try:
        return build_hf_model(args.hf, config, batch, seq, args.dtype)
    except Exception as exc:  # NOTE [ A config Transformers refuses ]
        refused = _config_refused(args, exc, "Transformers refused the config")
        if refused is None:
            raise
        raise refused from exc


def _config_refused(args: argparse.Namespace, exc: Exception, what: str) -> RematError | None:
    """``exc`` as the one-line error about ``--config`` of NOTE [ A config Transformers
    refuses ], or ``None`` where it is not one (autoremat's own errors, anything else)."""
    ours = isinstance(exc, (RematError, InternalError))
    about_config = isinstance(exc, (ValueError, TypeError, ArithmeticError, AssertionError)) \
        or type(exc).__module__.startswith(("transformers", "huggingface_hub"))
    if ours or not about_config:
        return None
    text = " ".join(str(exc).split()).rstrip(".") or type(exc).__name__
    return RematError(f"--hf {args.hf} --config {args.config!r}: {what}: {text}. Fix the "
                      f"values in --config")


def _in_transformers(exc: BaseException) -> str:
    """The last line of Transformers' code ``exc`` passed through (``file.py:line``), or
    ``""``."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f"{os.sep}transformers{os.sep}" in f.filename]
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, epilog=TARGET_HELP,
        description="Will a training step fit in this much memory, and if not, what to do. "
                    "Runs the step on fake (meta) tensors: nothing is allocated or downloaded. "
                    "Exit status: 0 fits (maybe with checkpointing), 1 does not fit, 2 error.")
    parser.add_argument("target", nargs="?",
                        help=f"a zoo model ({', '.join(zoo.names())}) or module:factory "
                             f"returning (model, inputs); or use --hf")
    parser.add_argument("--hf", metavar="FAMILY",
                        help=f"a Transformers family built from its config: "
                             f"{', '.join(HF_FAMILIES)}, or any model type of your "
                             f"Transformers with a language-model class (qwen3, "
                             f"gemma3_text, mixtral, t5, ...)")
    parser.add_argument("--config", "--set", default="", metavar="K=V,...",
                        help="config fields (Transformers config, zoo options or factory "
                             "keyword arguments), e.g. num_hidden_layers=32,hidden_size=4096 "
                             "(a tuple: widths=64,128)")
    parser.add_argument("--blocks", metavar="NAME,NAME,...",
                        help="the layers to plan over, in the order the model runs them "
                             "(default: the chain autoremat finds)")
    parser.add_argument("--batch", type=_positive_int, help="batch size (--hf default 1)")
    parser.add_argument("--seq", type=_positive_int,
                        help="sequence length (--hf default 2048)")
    parser.add_argument("--dtype", help="floating dtype of parameters and inputs: bf16, fp16, "
                                        "fp32")
    parser.add_argument("--optimizer", default="adamw",
                        help=f"{', '.join(OPTIMIZERS)} (default adamw), none, or the "
                             "state's size (e.g. 20GiB)")
    parser.add_argument("--memory", default="80GiB", help="device memory (default 80GiB)")
    parser.add_argument("--device", default="cuda", help="device to estimate for (default cuda)")
    parser.add_argument("--throughput", type=float, metavar="FLOP/S",
                        help="sustained FLOP/s of the device, to turn FLOPs into seconds")
    parser.add_argument("--plot", metavar="PNG",
                        help="write a stacked bar of the memory here (needs matplotlib: "
                             "pip install 'autoremat[plot]')")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    return parser


def _positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (0 must not fall back to a default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _optimizer_arg(text: str) -> str | int | None:
    if text.strip().lower() == "none":
        return None
    if text.strip()[:1].isdigit():
        return parse_size(text, what="optimizer state")
    return text


def doctor_main(argv: Sequence[str], prog: str = "autoremat doctor") -> int:
    """``autoremat doctor ...`` (``prog``: as the user called it, ``autoremat estimate``
    too); returns the exit status (0 fits, 1 does not fit, 2 error)."""
    args = _parser(prog).parse_args(list(argv))
    try:
        config = parse_options(args.config)
        blocks = parse_blocks(args.blocks)
        if args.plot:
            require("matplotlib", "--plot")
            check_writable(args.plot)
        if args.hf is not None:
            require("transformers", f"--hf {args.hf}")
        if args.target is not None:
            require_for_target(args.target)
        parse_size(args.memory, what="memory")
        _optimizer_arg(args.optimizer)
        with stages(f"examining {args.target or 'hf:' + str(args.hf)}") as stage:
            stage("building the model on meta")
            label, model, inputs = _target(args.target, args, config)
            try:
                result = doctor(model, inputs, memory=args.memory, device=args.device,
                                dtype=args.dtype, optimizer=_optimizer_arg(args.optimizer),
                                blocks=blocks, throughput_flops=args.throughput,
                                plot_path=args.plot,
                                target=label, progress=stage)
            except Exception as exc:  # a model built from --config that fails in its step
                where = _in_transformers(exc) if args.hf is not None else ""
                refused = _config_refused(args, exc, f"the model failed on this config at "
                                                     f"{where}") if where else None
                if refused is None:
                    raise
                raise refused from exc
    except RematError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(result.to_json() if args.json else result)
    return 0 if result.fits else 1
