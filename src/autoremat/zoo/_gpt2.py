"""gpt2: a GPT-2-style decoder, after nanoGPT's model.py.

Learned positions, pre-LN blocks in ``model.blocks``, an lm_head tied to the token embedding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoremat._core.errors import RematError
from autoremat._core.head import LMHead
from autoremat.zoo._common import LMOutput, init_normal, split_overrides


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 1024  # longest sequence; GPT-2's value, so seq_len up to 1024 just works
    vocab_size: int = 1024  # small vocabulary (GPT-2 has 50257) to keep the lm_head cheap
    n_layer: int = 6  # number of transformer blocks
    n_head: int = 4  # attention heads; head size is n_embd // n_head = 32
    n_embd: int = 128  # width of the residual stream
    dropout: float = 0.1  # embedding, attention and residual dropout (non-zero: RNG matters)
    bias: bool = True  # biases in Linear and LayerNorm, as in GPT-2


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise RematError(
                f"gpt2: n_embd={config.n_embd} must be divisible by n_head={config.n_head}"
            )
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape  # batch, sequence length, n_embd
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        out: Tensor = self.resid_dropout(self.c_proj(y))  # (B, T, C)
        return out


class GPTMLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C)
        return out


class Block(nn.Module):
    """One pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = GPTMLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    """GPT-2-style decoder. ``forward(idx, targets=None)``; targets are ``idx`` shifted by one."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embedding
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        # the projection and its loss: a plan may compute them in chunks of tokens
        self.lm_head = LMHead(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2

        self.apply(init_normal)
        # GPT-2 scales the init of the projections into the residual stream by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> LMOutput:
        _, T = idx.shape  # (B, T)
        if T > self.config.block_size:
            raise RematError(
                f"gpt2: sequence length {T} exceeds block_size={self.config.block_size}; "
                f"build the model with block_size={T} or more"
            )
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        x = self.ln_f(x)
        logits, loss = self.lm_head(x, targets)  # (B, T, vocab_size) or None when chunked
        return LMOutput(logits=logits, loss=loss)


def build_gpt2(**overrides: Any) -> tuple[nn.Module, Any]:
    config, data = split_overrides("gpt2", GPTConfig, {"batch_size": 4, "seq_len": 128}, overrides)
    B, T = data["batch_size"], data["seq_len"]
    if T > config.block_size:
        raise RematError(
            f"gpt2: seq_len={T} exceeds block_size={config.block_size}; also pass block_size={T}"
        )
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (B, T + 1))  # (B, T+1)
    # separate tensors, not two views of one storage, so each input owns its memory
    return model, {"idx": tokens[:, :-1].clone(), "targets": tokens[:, 1:].clone()}  # (B, T)
