"""llama: a Llama-style decoder.

RMSNorm, rotary positions, SwiGLU and grouped-query attention; layers in ``model.layers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoremat._core.errors import RematError
from autoremat._core.head import LMHead
from autoremat.zoo._common import LMOutput, init_normal, split_overrides


@dataclass(frozen=True)
class LlamaConfig:
    max_seq_len: int = 1024  # longest sequence the rotary tables cover
    vocab_size: int = 1024  # small vocabulary to keep embedding and lm_head cheap
    n_layer: int = 6  # number of decoder layers
    n_head: int = 4  # query heads; head size is n_embd // n_head = 32
    n_kv_head: int = 2  # key/value heads; < n_head is grouped-query attention, = n_head is MHA
    n_embd: int = 128  # width of the residual stream
    ffn_hidden: int = 344  # SwiGLU hidden width: about 8/3 * n_embd rounded up to a multiple of 8
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # base of the rotary frequencies
    dropout: float = 0.1  # attention and residual dropout (Llama uses 0; non-zero so RNG matters)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``: LayerNorm without centring or bias."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        rms_inv = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (..., 1)
        return x * rms_inv * self.weight


def _rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, each (max_seq_len, head_dim), halves repeated."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # (T, hs/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hs)
    return angles.cos(), angles.sin()


def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[i], x[i + hs/2]) of ``x`` (B, nh, T, hs) by the angles in cos/sin (T, hs)."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs/2) each
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.q_proj = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape  # batch, sequence length, n_embd
        hs = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, nkv, T, hs)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        # grouped-query attention: each key/value head serves n_head // n_kv_head query heads
        k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)  # (B, nh, T, hs)
        v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)  # (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * hs)  # (B, T, C)
        out: Tensor = self.resid_dropout(self.o_proj(y))  # (B, T, C)
        return out


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, the Llama MLP."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)  # (B, T, ffn_hidden)
        out: Tensor = self.dropout(self.down_proj(h))  # (B, T, C)
        return out


class LlamaLayer(nn.Module):
    """One decoder layer; takes the rotary tables as extra arguments, as HF's layers do."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = LlamaAttention(config)
        self.post_attn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin)  # (B, T, C)
        x = x + self.mlp(self.post_attn_norm(x))  # (B, T, C)
        return x


class Llama(nn.Module):
    """Llama-style decoder. ``forward(input_ids, labels=None)``; labels are shifted inside, as
    in Hugging Face, so ``labels=input_ids`` trains next-token prediction."""

    rope_cos: Tensor  # (max_seq_len, hs), a buffer
    rope_sin: Tensor  # (max_seq_len, hs), a buffer

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0 or (config.n_embd // config.n_head) % 2 != 0:
            raise RematError(
                f"llama: n_embd={config.n_embd} must be divisible by n_head="
                f"{config.n_head} into an even head size (rotary rotates pairs)"
            )
        if config.n_head % config.n_kv_head != 0:
            raise RematError(
                f"llama: n_head={config.n_head} must be a multiple of n_kv_head="
                f"{config.n_kv_head}; e.g. n_kv_head={config.n_head} for MHA"
            )
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList([LlamaLayer(config) for _ in range(config.n_layer)])
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        # untied; position t predicts token t+1; a plan may compute it in chunks of tokens
        self.lm_head = LMHead(config.n_embd, config.vocab_size, bias=False, shift=True)
        # NOTE [ Rotary tables are non-persistent buffers ]
        # They follow .to(device/dtype) but stay out of the state_dict: they are a function of
        # the config. A model built on meta and moved with to_empty() must recompute them.
        cos, sin = _rotary_tables(
            config.n_embd // config.n_head, config.max_seq_len, config.rope_theta
        )
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hs)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_seq_len, hs)
        self.apply(init_normal)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> LMOutput:
        _, T = input_ids.shape  # (B, T)
        if T > self.config.max_seq_len:
            raise RematError(
                f"llama: sequence length {T} exceeds max_seq_len={self.config.max_seq_len}; "
                f"build the model with max_seq_len={T} or more"
            )
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, hs) each
        x = self.embed_tokens(input_ids)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, cos, sin)  # (B, T, C)
        # (B, T, vocab_size) logits, or None when a plan chunks the head
        logits, loss = self.lm_head(self.norm(x), labels)
        return LMOutput(logits=logits, loss=loss)


def build_llama(**overrides: Any) -> tuple[nn.Module, Any]:
    config, data = split_overrides(
        "llama", LlamaConfig, {"batch_size": 4, "seq_len": 128}, overrides
    )
    B, T = data["batch_size"], data["seq_len"]
    if T > config.max_seq_len:
        raise RematError(
            f"llama: seq_len={T} exceeds max_seq_len={config.max_seq_len}; "
            f"also pass max_seq_len={T}"
        )
    model = Llama(config)
    input_ids = torch.randint(0, config.vocab_size, (B, T))  # (B, T)
    return model, {"input_ids": input_ids, "labels": input_ids.clone()}
