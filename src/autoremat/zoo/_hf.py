"""A small Hugging Face GPT-2 built from its config class (random weights, nothing
downloaded): the target that gives ``autoremat bench`` its ``gradient_checkpointing`` row.

Not in :data:`ZOO` (it needs ``transformers``); run it as ``autoremat.zoo:hf_gpt2``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoremat._core.errors import RematError

__all__ = ["hf_gpt2"]


def hf_gpt2(**overrides: Any) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A small randomly initialised ``transformers`` GPT-2 and a batch, for
    ``autoremat bench autoremat.zoo:hf_gpt2`` (the HF gradient-checkpointing row).

    Sizes as the zoo's gpt2: 6 layers, width 128, 4 heads, vocabulary 1024, batch 4 x 128
    tokens, dropout 0.1. ``overrides``: ``n_layer``, ``n_embd``, ``n_head``,
    ``batch_size``, ``seq_len``. Nothing is downloaded. Needs ``transformers``
    (``pip install autoremat[hf]``).
    """
    try:
        import transformers
    except ImportError as exc:
        raise RematError("hf_gpt2 needs transformers: pip install 'autoremat[hf]'") from exc
    sizes = {"n_layer": 6, "n_embd": 128, "n_head": 4, "batch_size": 4, "seq_len": 128}
    unknown = set(overrides) - set(sizes)
    if unknown:
        raise RematError(f"hf_gpt2: unknown option(s) {sorted(unknown)}; valid: {list(sizes)}")
    sizes.update(overrides)
    # use_cache=False as in any training script: with a KV cache, a recomputed layer
    # appends its keys to the cache a second time and attends over both
    config = transformers.GPT2Config(n_layer=sizes["n_layer"], n_embd=sizes["n_embd"],
                                    n_head=sizes["n_head"], vocab_size=1024, n_positions=1024,
                                    bos_token_id=0, eos_token_id=0, use_cache=False)
    config._attn_implementation = "sdpa"
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (sizes["batch_size"], sizes["seq_len"]))
    return model, {"input_ids": ids, "labels": ids.clone()}
