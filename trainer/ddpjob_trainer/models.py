"""The built-in models."""
from __future__ import annotations

import math

from torch import nn


def convnet(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Small CNN that works from 8x8 digits up to ImageNet-sized inputs."""
    c = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(c, 32, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d((4, 4)), nn.Flatten(),
        nn.Linear(64 * 16, 128), nn.ReLU(inplace=True), nn.Dropout(0.1),
        nn.Linear(128, num_classes),
    )


def mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Two hidden layers over the flattened input."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(math.prod(input_shape), 256), nn.ReLU(inplace=True),
        nn.Linear(256, 256), nn.ReLU(inplace=True), nn.Linear(256, num_classes),
    )


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The model named by spec.trainer.model, randomly initialised (no weight downloads)."""
    if name == "convnet":
        return convnet(input_shape, num_classes)
    if name == "mlp":
        return mlp(input_shape, num_classes)
    from torchvision import models as tvm

    return getattr(tvm, name)(weights=None, num_classes=num_classes)
