"""resnet: a small ResNet for 32x32 images, its stages in ``model.stages``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoremat._core.errors import RematError
from autoremat.zoo._common import LMOutput, cross_entropy, split_overrides


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
        return LMOutput(logits=logits, loss=cross_entropy(logits, y))


def build_resnet(**overrides: Any) -> tuple[nn.Module, Any]:
    config, data = split_overrides(
        "resnet", ResNetConfig, {"batch_size": 16, "image_size": 32}, overrides
    )
    model = ResNet(config)
    B, S = data["batch_size"], data["image_size"]
    x = torch.randn(B, config.in_channels, S, S)  # (B, C, H, W)
    y = torch.randint(0, config.n_classes, (B,))  # (B,)
    return model, (x, y)
