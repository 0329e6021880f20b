"""A small convolutional network for 8x8 images. A plain nn.Module: no Lightning in here."""

from torch import nn


def conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class SmallCNN(nn.Module):
    def __init__(self, in_channels: int = 1, channels: int = 32, num_classes: int = 10, dropout: float = 0.1):
        super().__init__()
        c = channels
        self.features = nn.Sequential(
            conv_bn(in_channels, c),
            conv_bn(c, c),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            conv_bn(c, 2 * c),
            conv_bn(2 * c, 2 * c),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * c, num_classes))

    def forward(self, x):
        return self.head(self.features(x))
