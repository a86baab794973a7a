"""A CIFAR-style ResNet (He et al. 2015, section 4.2) for 1-channel 28x28 MNIST.

The convolutional workload, and the one with BatchNorm: its running statistics are
*buffers* that each rank updates from its own batch, which matters to anything that
compares model state across ranks (DDP's ``broadcast_buffers=True`` re-syncs them from
rank 0 at the start of every forward, so between a step and the next forward the
ranks' buffers legitimately differ; parameters do not).

    paft train --workload resnet --world-size 4
    torchrun --nproc-per-node 2 -m paft.train --workload resnet

Layout: a 3x3 stem conv (1 -> ``width`` channels), three stages of ``n`` BasicBlocks
with ``width``, ``2*width``, ``4*width`` channels and strides 1, 2, 2
(28x28 -> 28 -> 14 -> 7), global average pooling and a linear classifier; depth is
``6n + 2`` (default 8, i.e. one block per stage). Where a block changes shape the
shortcut is a 1x1 strided conv + BatchNorm. Convs have no bias (BatchNorm follows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paft.values import require_positive_ints

__all__ = ["ResNetConfig", "ResNet", "BasicBlock"]


@dataclass
class ResNetConfig:
    """Size of :class:`ResNet`."""

    depth: int = 8
    """Total weighted layers, ``6n + 2`` for ``n`` blocks per stage: 8, 14, 20, 32, ..."""
    width: int = 16
    """Channels of the first stage; the next two stages use 2x and 4x."""
    num_classes: int = 10
    """Size of the classifier output."""
    in_channels: int = 1
    """Input image channels (1 for MNIST)."""

    def __post_init__(self) -> None:
        require_positive_ints(self, ("depth", "width", "num_classes", "in_channels"))
        if self.depth < 8 or (self.depth - 2) % 6 != 0:
            raise ValueError(f"depth must be 6n + 2 with n >= 1 (8, 14, 20, ...), got {self.depth}")

    @property
    def blocks_per_stage(self) -> int:
        return (self.depth - 2) // 6

    @property
    def parameter_count(self) -> int:
        """``sum(p.numel() for p in ResNet(self).parameters())``, without building it (a
        size far beyond memory is refused at once). Each BatchNorm has a weight and a
        bias (its running statistics are buffers); the first block of stages 2 and 3
        doubles the channels, through a 1x1 conv + BatchNorm shortcut."""
        w, n = self.width, self.blocks_per_stage

        def block(in_ch: int, out_ch: int) -> int:
            shortcut = in_ch * out_ch + 2 * out_ch if in_ch != out_ch else 0
            return 9 * in_ch * out_ch + 9 * out_ch * out_ch + 4 * out_ch + shortcut

        stages = sum(block(in_ch, out_ch) + (n - 1) * block(out_ch, out_ch)
                     for in_ch, out_ch in ((w, w), (w, 2 * w), (2 * w, 4 * w)))
        stem = 9 * self.in_channels * w + 2 * w
        return stem + stages + (4 * w + 1) * self.num_classes


class BasicBlock(nn.Module):
    """``relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))``."""

    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """``forward(images: (B, in_channels, H, W) float) -> logits (B, num_classes)``."""

    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.stem = nn.Conv2d(cfg.in_channels, w, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(w)
        stages: list[nn.Module] = []
        in_ch = w
        for i, out_ch in enumerate((w, 2 * w, 4 * w)):
            blocks = []
            for j in range(cfg.blocks_per_stage):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(BasicBlock(in_ch, out_ch, stride))
                in_ch = out_ch
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(4 * w, cfg.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(x)))
        x = self.stages(x)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)
