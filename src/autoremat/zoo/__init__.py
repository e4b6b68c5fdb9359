"""Built-in models with sample batches, for demos, tests and benchmarks.

Four small models in plain PyTorch, each sized so that one forward+backward step at the
defaults takes well under a second on two CPU cores:

==========  =============================================================================
``gpt2``    GPT-2-style decoder (nanoGPT-like): learned positions, pre-LN, tied lm_head.
``llama``   Llama-style decoder: RMSNorm, rotary positions, SwiGLU, grouped-query attention.
``mlp``     A deep chain of Linear blocks with uneven widths, mixed GELU/ReLU and LayerNorm.
``resnet``  A small CIFAR-sized ResNet with BatchNorm and strided downsampling.
==========  =============================================================================

Every model returns an :class:`LMOutput` (``logits`` and ``loss``; ``loss`` is ``None``
without targets) and keeps its repeated blocks in one container a planner can find:
``model.blocks`` (gpt2, mlp), ``model.layers`` (llama), ``model.stages`` (resnet).

Example:
    >>> model, inputs = build("gpt2", n_layer=2, batch_size=2, seq_len=16)
    >>> out = model(**inputs)
    >>> tuple(out.logits.shape), out.loss.ndim
    ((2, 16, 1024), 0)
    >>> len(model.blocks)
    2
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoremat._core.errors import RematError, did_you_mean

__all__ = [
    "GPT",
    "ZOO",
    "GPTConfig",
    "LMOutput",
    "Llama",
    "LlamaConfig",
    "MLPChain",
    "MLPConfig",
    "ResNet",
    "ResNetConfig",
    "ZooEntry",
    "build",
    "names",
]


@dataclass(frozen=True)
class LMOutput:
    """What every zoo model returns: the logits, and the mean cross-entropy loss or ``None``."""

    logits: Tensor  # (B, T, vocab_size) for the language models, (B, n_classes) otherwise
    loss: Tensor | None  # scalar, or None when no targets were given


def _cross_entropy(logits: Tensor, targets: Tensor | None) -> Tensor | None:
    if targets is None:
        return None
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# -----------------------------------------------------------------------------
# gpt2: a GPT-2-style decoder, after nanoGPT's model.py


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
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2

        self.apply(_init_normal)
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
        logits = self.lm_head(x)  # (B, T, vocab_size)
        return LMOutput(logits=logits, loss=_cross_entropy(logits, targets))


def _init_normal(module: nn.Module) -> None:
    """GPT-2 / Llama init: N(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _build_gpt2(**overrides: Any) -> tuple[nn.Module, Any]:
    config, data = _split_overrides("gpt2", GPTConfig, {"batch_size": 4, "seq_len": 128}, overrides)
    B, T = data["batch_size"], data["seq_len"]
    if T > config.block_size:
        raise RematError(
            f"gpt2: seq_len={T} exceeds block_size={config.block_size}; also pass block_size={T}"
        )
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (B, T + 1))  # (B, T+1)
    # separate tensors, not two views of one storage, so each input owns its memory
    return model, {"idx": tokens[:, :-1].clone(), "targets": tokens[:, 1:].clone()}  # (B, T)


# -----------------------------------------------------------------------------
# llama: a Llama-style decoder


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
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # untied
        # NOTE [ Rotary tables are non-persistent buffers ]
        # They follow .to(device/dtype) but stay out of the state_dict: they are a function of
        # the config. A model built on meta and moved with to_empty() must recompute them.
        cos, sin = _rotary_tables(
            config.n_embd // config.n_head, config.max_seq_len, config.rope_theta
        )
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hs)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_seq_len, hs)
        self.apply(_init_normal)

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
        logits = self.lm_head(self.norm(x))  # (B, T, vocab_size)
        loss = None
        if labels is not None:  # position t predicts token t+1
            loss = _cross_entropy(logits[:, :-1], labels[:, 1:])
        return LMOutput(logits=logits, loss=loss)


def _build_llama(**overrides: Any) -> tuple[nn.Module, Any]:
    config, data = _split_overrides(
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


# -----------------------------------------------------------------------------
# mlp: a deep chain of Linear blocks with uneven widths


@dataclass(frozen=True)
class MLPConfig:
    d_in: int = 256  # input features
    # output width of each block; uneven on purpose, so blocks differ in memory and compute
    # (activations, not weights, dominate the step at the default batch, as in training)
    widths: tuple[int, ...] = (512, 256, 1024, 192, 384, 768, 128, 512, 256, 1024, 192, 384)
    n_classes: int = 10  # output of the final Linear head
    norm_every: int = 3  # a LayerNorm after the Linear in every 3rd block (0: no LayerNorm)
    dropout: float = 0.1  # dropout at the end of every block


class MLPBlock(nn.Module):
    """``Linear -> [LayerNorm] -> GELU or ReLU -> Dropout``."""

    def __init__(self, d_in: int, d_out: int, *, act: str, norm: bool, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out) if norm else nn.Identity()
        self.act = nn.GELU() if act == "gelu" else nn.ReLU()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.dropout(self.act(self.norm(self.fc(x))))  # (B, d_out)
        return out


class MLPChain(nn.Module):
    """A deep MLP classifier. ``forward(x, y=None)`` with ``x`` (B, d_in) and ``y`` (B,)."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        if not config.widths:
            raise RematError("mlp: widths must name at least one block width, e.g. (512, 256)")
        self.config = config
        dims = (config.d_in, *config.widths)
        # GELU saves its input for backward, ReLU only its output: alternating them gives a
        # planner blocks whose saved activations differ, not a uniform stack
        blocks = []
        for i, (d_in, d_out) in enumerate(itertools.pairwise(dims)):
            act = "gelu" if i % 2 == 0 else "relu"
            norm = config.norm_every > 0 and (i + 1) % config.norm_every == 0
            blocks.append(MLPBlock(d_in, d_out, act=act, norm=norm, dropout=config.dropout))
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(dims[-1], config.n_classes)

    def forward(self, x: Tensor, y: Tensor | None = None) -> LMOutput:
        logits = self.head(self.blocks(x))  # (B, n_classes)
        return LMOutput(logits=logits, loss=_cross_entropy(logits, y))


def _build_mlp(**overrides: Any) -> tuple[nn.Module, Any]:
    config, data = _split_overrides("mlp", MLPConfig, {"batch_size": 1024}, overrides)
    model = MLPChain(config)
    x = torch.randn(data["batch_size"], config.d_in)  # (B, d_in)
    y = torch.randint(0, config.n_classes, (data["batch_size"],))  # (B,)
    return model, (x, y)


# -----------------------------------------------------------------------------
# resnet: a small ResNet for 32x32 images


@dataclass(frozen=True)
class ResNetConfig:
    in_channels: int = 3  # RGB input
    stem_channels: int = 32  # channels after the stem conv
    stage_channels: tuple[int, ...] = (32, 64, 128)  # per stage; stages after the first stride 2
    blocks_per_stage: int = 2  # BasicBlocks in each stage
    n_classes: int = 10  # output of the final Linear
    dropout: float = 0.1  # dropout before the final Linear (0: none)


class BasicBlock(nn.Module):
    """``relu(bn(conv(relu(bn(conv(x))))) + skip(x))``; skip is a strided 1x1 conv + BN when
    the shape changes, else the identity."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))  # (B, c_out, H/stride, W/stride)
        out = self.bn2(self.conv2(out))  # (B, c_out, H/stride, W/stride)
        return F.relu(out + self.downsample(x))


class ResNet(nn.Module):
    """A small ResNet classifier. ``forward(x, y=None)`` with ``x`` (B, 3, H, W), ``y`` (B,)."""

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        if not config.stage_channels or config.blocks_per_stage < 1:
            raise RematError(
                "resnet: need at least one stage and blocks_per_stage >= 1, got "
                f"stage_channels={config.stage_channels}, "
                f"blocks_per_stage={config.blocks_per_stage}"
            )
        self.config = config
        self.stem = nn.Sequential(
            nn.Conv2d(config.in_channels, config.stem_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(config.stem_channels),
            nn.ReLU(),
        )
        stages, c_in = [], config.stem_channels
        for i, c_out in enumerate(config.stage_channels):
            blocks = []
            for j in range(config.blocks_per_stage):
                stride = 2 if i > 0 and j == 0 else 1  # halve H and W entering stages 2, 3, ...
                blocks.append(BasicBlock(c_in, c_out, stride))
                c_in = c_out
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(config.dropout)
        self.fc = nn.Linear(c_in, config.n_classes)

    def forward(self, x: Tensor, y: Tensor | None = None) -> LMOutput:
        x = self.stages(self.stem(x))  # (B, C_last, H / 2**(n_stages-1), W / 2**(n_stages-1))
        x = self.pool(x).flatten(1)  # (B, C_last)
        logits = self.fc(self.dropout(x))  # (B, n_classes)
        return LMOutput(logits=logits, loss=_cross_entropy(logits, y))


def _build_resnet(**overrides: Any) -> tuple[nn.Module, Any]:
    config, data = _split_overrides(
        "resnet", ResNetConfig, {"batch_size": 16, "image_size": 32}, overrides
    )
    model = ResNet(config)
    B, S = data["batch_size"], data["image_size"]
    x = torch.randn(B, config.in_channels, S, S)  # (B, C, H, W)
    y = torch.randint(0, config.n_classes, (B,))  # (B,)
    return model, (x, y)


# -----------------------------------------------------------------------------
# the registry and its entry point

_Config = TypeVar("_Config")


def _split_overrides(
    model: str, config_cls: type[_Config], data_defaults: dict[str, int], overrides: dict[str, Any]
) -> tuple[_Config, dict[str, int]]:
    """Split ``overrides`` into a config of ``config_cls`` and the batch options; reject typos."""
    config_fields = [f.name for f in dataclasses.fields(config_cls)]  # type: ignore[arg-type]
    valid = [*config_fields, *data_defaults]
    unknown = [key for key in overrides if key not in valid]
    if unknown:
        key = unknown[0]
        raise RematError(
            f"{model}: unknown option {key!r}.{did_you_mean(key, valid)} "
            f"Valid options: {', '.join(valid)}"
        )
    config = config_cls(**{k: v for k, v in overrides.items() if k in config_fields})
    data = {k: overrides.get(k, default) for k, default in data_defaults.items()}
    return config, data


@dataclass(frozen=True)
class ZooEntry:
    """A named model: ``build(**size_overrides)`` returns ``(model, inputs)`` on the current
    default device in float32, without seeding; prefer the module-level :func:`build`."""

    name: str
    description: str
    build: Callable[..., tuple[nn.Module, Any]]


_ENTRIES = (
    ZooEntry("gpt2", "GPT-2-style decoder (nanoGPT-like), pre-LN model.blocks", _build_gpt2),
    ZooEntry("llama", "Llama-style decoder (RMSNorm, RoPE, SwiGLU), model.layers", _build_llama),
    ZooEntry("mlp", "deep MLP of uneven-width Linear blocks in model.blocks", _build_mlp),
    ZooEntry("resnet", "small BatchNorm ResNet for 32x32 images, model.stages", _build_resnet),
)
ZOO: Mapping[str, ZooEntry] = types.MappingProxyType({e.name: e for e in _ENTRIES})


def names() -> list[str]:
    """The names of the built-in models, e.g. ``['gpt2', 'llama', 'mlp', 'resnet']``."""
    return list(ZOO)


def build(
    name: str,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> tuple[nn.Module, Any]:
    """Build a zoo model in train mode and a sample batch for it.

    Args:
        name: one of :func:`names`.
        seed: passed to ``torch.manual_seed`` before anything is created, so two calls with
            the same arguments give identical weights and data.
        device: where model and inputs live; ``"meta"`` allocates no memory at all.
        dtype: floating-point dtype of parameters, buffers and float inputs. Integer inputs
            (token ids, labels) stay ``torch.long``.
        **overrides: fields of the model's config (e.g. ``n_layer=12``) and batch options:
            ``batch_size`` for all, ``seq_len`` for gpt2/llama, ``image_size`` for resnet.

    Returns:
        ``(model, inputs)``: call ``model(*inputs)`` when ``inputs`` is a tuple and
        ``model(**inputs)`` when it is a dict. The output is an :class:`LMOutput` whose
        ``loss`` is set, since the sample batch includes targets.

    Raises:
        RematError: unknown name or option, or inconsistent sizes.

    Example:
        >>> model, (x, y) = build("mlp", widths=(64, 32), batch_size=8)
        >>> model(x, y).logits.shape
        torch.Size([8, 10])

    Known limitations:
        ``build`` calls ``torch.manual_seed(seed)`` and does not restore the global RNG, so
        the first training step after it (dropout masks) is reproducible too. On ``meta``
        the init functions do nothing; a meta model moved with ``to_empty`` needs its
        weights (and llama's rotary tables) recomputed.
    """
    if name not in ZOO:
        raise RematError(
            f"unknown zoo model {name!r}.{did_you_mean(name, ZOO)} Available: {', '.join(names())}"
        )
    torch.manual_seed(seed)
    with torch.device(device):
        model, inputs = ZOO[name].build(**overrides)
    model.to(dtype=dtype)  # casts floating-point parameters and buffers only
    model.train()
    return model, _cast_floats(inputs, dtype)


def _cast_floats(inputs: Any, dtype: torch.dtype) -> Any:
    """Cast the floating-point tensors of a tuple or dict of inputs to ``dtype``."""

    def cast(value: Any) -> Any:
        if isinstance(value, Tensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    if isinstance(inputs, dict):
        return {key: cast(value) for key, value in inputs.items()}
    return tuple(cast(value) for value in inputs)
