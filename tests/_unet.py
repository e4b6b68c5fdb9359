"""A small U-Net for the skip-connection tests: the encoder's outputs wait in a list
outside the chain until the decoder reads them; BatchNorm and in-place ReLU in every
block; the stem and the head sit outside the ``ModuleList``s that discovery finds."""

from __future__ import annotations

import torch
from torch import nn


class DoubleConv(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn2(self.conv2(self.act(self.bn1(self.conv1(x))))))


class Down(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.pool = nn.MaxPool2d(2)
        self.conv = DoubleConv(c_in, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.pool(x))


class Up(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_in // 2, 2, stride=2)
        self.conv = DoubleConv(c_in, c_out)

    def forward(self, x: torch.Tensor, skip: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self.conv(torch.cat([skip, self.up(x) * scale], dim=1))


class UNet(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3, classes: int = 4) -> None:
        super().__init__()
        self.stem = DoubleConv(3, width)
        self.downs = nn.ModuleList(Down(width << i, width << (i + 1)) for i in range(depth))
        self.ups = nn.ModuleList(Up(width << (i + 1), width << i)
                                 for i in reversed(range(depth)))
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        skips = []
        x = self.stem(x)
        for down in self.downs:
            skips.append(x)
            x = down(x)
        for i, up in enumerate(self.ups):
            x = up(x, skips.pop(), scale=1.0 + i)  # a keyword flag between blocks
        return nn.functional.cross_entropy(self.head(x), target)


BLOCKS = ["stem", "downs.0", "downs.1", "downs.2", "ups.0", "ups.1", "ups.2", "head"]


def build(batch: int = 4, size: int = 32, width: int = 8,
          device: str = "cpu") -> tuple[UNet, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    with torch.device(device):
        model = UNet(width)
        inputs = (torch.randn(batch, 3, size, size),
                  torch.randint(0, 4, (batch, size, size)))
    return model, inputs
