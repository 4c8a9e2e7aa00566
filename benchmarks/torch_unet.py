"""The project's U-Net (gluon_unet.model.UNet) rewritten layer for layer in PyTorch.

Benchmark-only: PyTorch is never a dependency of gluon_unet. Same layers, same
parameter count: (3x3 conv, no bias -> BatchNorm -> ReLU) x 2 per level, 2x2 max
pooling, 2x2 stride-2 transposed convs with bias, concat(upsampled, skip), 1x1 head.
"""
import torch
from torch import nn


class DoubleConv(nn.Sequential):
    def __init__(self, c_in, c_out, batch_norm=True):
        layers = []
        for c in (c_in, c_out):
            layers.append(nn.Conv2d(c, c_out, 3, padding=1, bias=not batch_norm))
            if batch_norm:
                layers.append(nn.BatchNorm2d(c_out))
            layers.append(nn.ReLU(inplace=True))
        super().__init__(*layers)


class Up(nn.Module):
    def __init__(self, c_in, c_out, batch_norm=True):
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_out, 2, stride=2)
        self.conv = DoubleConv(2 * c_out, c_out, batch_norm)

    def forward(self, x, skip):
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class TorchUNet(nn.Module):
    """``TorchUNet(in_channels, classes, width, depth)``: logits ``(N, classes, H, W)``."""

    def __init__(self, in_channels=1, classes=1, width=32, depth=4, batch_norm=True):
        super().__init__()
        self.down = nn.ModuleList()
        c_in = in_channels
        for level in range(depth):
            self.down.append(DoubleConv(c_in, width * 2 ** level, batch_norm))
            c_in = width * 2 ** level
        self.pool = nn.MaxPool2d(2, 2)
        self.bottom = DoubleConv(c_in, width * 2 ** depth, batch_norm)
        self.up = nn.ModuleList(Up(width * 2 ** (level + 1), width * 2 ** level, batch_norm)
                                for level in reversed(range(depth)))
        self.head = nn.Conv2d(width, classes, 1)
        for m in self.modules():  # He init, as gluon_unet.training.step.build_network
            if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
                nn.init.kaiming_normal_(m.weight, nonlinearity='relu')

    def forward(self, x):
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottom(x)
        for block, skip in zip(self.up, reversed(skips)):
            x = block(x, skip)
        return self.head(x)
