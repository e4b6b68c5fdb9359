"""mlp: a deep chain of Linear blocks with uneven widths, in ``model.blocks``."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from autoremat._core.errors import RematError
from autoremat.zoo._common import LMOutput, cross_entropy, split_overrides


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
        return LMOutput(logits=logits, loss=cross_entropy(logits, y))


def build_mlp(**overrides: Any) -> tuple[nn.Module, Any]:
    config, data = split_overrides("mlp", MLPConfig, {"batch_size": 1024}, overrides)
    model = MLPChain(config)
    x = torch.randn(data["batch_size"], config.d_in)  # (B, d_in)
    y = torch.randint(0, config.n_classes, (data["batch_size"],))  # (B,)
    return model, (x, y)
