"""The layers an :class:`~oakemu_core.policy.models.ActorCritic` is built from: picture encoders (Nature
CNN, IMPALA ResNet, a small CNN), MLP torsos, and a user's encoder loaded by import path.

Initialisation follows CleanRL: orthogonal weights with gain sqrt(2) for hidden layers, zero biases
(:func:`layer_init`).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from oakemu_core.errors import UserError

__all__ = [
    "ACTIVATION_MODULES",
    "UserEncoderError",
    "impala_cnn",
    "layer_init",
    "mlp",
    "nature_cnn",
    "small_cnn",
    "user_encoder",
]

ACTIVATION_MODULES: dict[str, type[nn.Module]] = {
    "tanh": nn.Tanh,
    "relu": nn.ReLU,
    "elu": nn.ELU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
}
"""The torsos' activations by :class:`~oakemu_core.policy.network.NetworkSpec` name (``auto``: tanh)."""


class UserEncoderError(UserError, ValueError):
    """A user's encoder (``policy_module``) cannot be imported, built or run on a probe batch: a
    :class:`~oakemu_core.errors.UserError`, so every ``oakemu`` command (train, evaluate, record, export)
    reports it in one line with exit status 2."""


def layer_init(layer: nn.Module, std: float = math.sqrt(2.0), bias_const: float = 0.0) -> nn.Module:
    """Orthogonal weight init with gain ``std`` and constant bias (CleanRL ``layer_init``)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


def nature_cnn(channels: int, height: int, width: int) -> tuple[nn.Module, int]:
    """The Nature CNN of Mnih et al. 2015 (conv 32x8/4, 64x4/2, 64x3/1, fc 512, ReLU; CleanRL
    ``ppo_atari.py``) for ``(channels, height, width)`` pictures of at least 36 x 36; returns the module
    and its 512 features."""
    out_h = ((height - 8) // 4 + 1 - 4) // 2 + 1 - 2
    out_w = ((width - 8) // 4 + 1 - 4) // 2 + 1 - 2
    torso = nn.Sequential(
        layer_init(nn.Conv2d(channels, 32, 8, stride=4)),
        nn.ReLU(),
        layer_init(nn.Conv2d(32, 64, 4, stride=2)),
        nn.ReLU(),
        layer_init(nn.Conv2d(64, 64, 3, stride=1)),
        nn.ReLU(),
        nn.Flatten(),
        layer_init(nn.Linear(64 * out_h * out_w, 512)),
        nn.ReLU(),
    )
    return torso, 512


def small_cnn(channels: int, height: int, width: int) -> tuple[nn.Module, int]:
    """Two 3x3 convolutions (16, 32) and fc 256, ReLU, for pictures of 5 to 35 pixels a side (the Nature
    CNN's kernels do not fit them); returns the module and its 256 features."""
    torso = nn.Sequential(
        layer_init(nn.Conv2d(channels, 16, 3, stride=1)),
        nn.ReLU(),
        layer_init(nn.Conv2d(16, 32, 3, stride=1)),
        nn.ReLU(),
        nn.Flatten(),
        layer_init(nn.Linear(32 * (height - 4) * (width - 4), 256)),
        nn.ReLU(),
    )
    return torso, 256


class _ResidualBlock(nn.Module):
    """``x + conv(relu(conv(relu(x))))``, 3x3 convolutions keeping the channels (IMPALA)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


def impala_cnn(
    channels: int, height: int, width: int, stages: tuple[int, ...] = (16, 32, 32)
) -> tuple[nn.Module, int]:
    """The IMPALA ResNet of Espeholt et al. 2018 (as CleanRL ``ppo_procgen.py``): per stage a 3x3
    convolution to that stage's channels, a 3x3 max-pool of stride 2 (padding 1: sides halve, rounded
    up) and two residual blocks; then ReLU, flatten and fc 256 with ReLU. Returns the module and its 256
    features. PyTorch's default initialisation in the convolutions (CleanRL's), orthogonal in the fc."""
    layers: list[nn.Module] = []
    for out in stages:
        layers += [
            nn.Conv2d(channels, out, 3, padding=1),
            nn.MaxPool2d(3, stride=2, padding=1),
            _ResidualBlock(out),
            _ResidualBlock(out),
        ]
        channels, height, width = out, (height + 1) // 2, (width + 1) // 2
    layers += [
        nn.ReLU(),
        nn.Flatten(),
        layer_init(nn.Linear(channels * height * width, 256)),
        nn.ReLU(),
    ]
    return nn.Sequential(*layers), 256


def mlp(in_features: int, sizes: tuple[int, ...], activation: str) -> tuple[nn.Module, int]:
    """Linear layers of ``sizes`` each followed by ``activation`` (:data:`ACTIVATION_MODULES`; ``auto``:
    tanh); an empty ``sizes`` is the identity. Returns the module and its output features."""
    act = ACTIVATION_MODULES["tanh" if activation == "auto" else activation]
    layers: list[nn.Module] = []
    for size in sizes:
        layers += [layer_init(nn.Linear(in_features, size)), act()]
        in_features = size
    return (nn.Sequential(*layers) if layers else nn.Identity()), in_features


def user_encoder(
    path: str, observation_layout: Mapping[str, tuple[tuple[int, ...], Any]]
) -> tuple[nn.Module, int]:
    """A user's encoder: ``Class(observation_layout)`` imported from ``path`` (``package.module:Class``).

    The interface: ``Class(observation_layout)``, ``observation_layout`` a dict key -> (per-env shape,
    numpy dtype), key ``""`` for a plain observation, builds an ``nn.Module`` with an int attribute
    ``out_features``; its ``forward`` takes the observations as float32 tensors, ``(B, *shape)`` for a
    plain observation or a dict key -> such tensor, pictures already scaled to [0, 1] and normalised keys
    normalised, and returns ``(B, out_features)`` float32 features. The core, torsos and heads follow it.

    Raises:
        UserEncoderError: the module or class cannot be imported (any error its import raises), the class
            cannot be built, or it has no positive int ``out_features`` (one line naming ``path`` and the
            cause).
    """
    module_name, _, class_name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except Exception as error:  # noqa: BLE001 - a user's module: any error at import is one line
        raise UserEncoderError(
            f"policy_module {path!r}: cannot import it ({type(error).__name__}: {error})"
        ) from None
    try:
        encoder = cls(dict(observation_layout))
    except Exception as error:  # noqa: BLE001 - a user's code: any error is reported in one line
        raise UserEncoderError(
            f"policy_module {path!r}: building it failed ({type(error).__name__}: {error})"
        ) from None
    features = getattr(encoder, "out_features", None)
    if (
        not isinstance(encoder, nn.Module)
        or isinstance(features, bool)
        or not isinstance(features, int)
    ):
        raise UserEncoderError(
            f"policy_module {path!r}: expected an nn.Module with an int attribute out_features, got "
            f"{type(encoder).__name__} with out_features={features!r}"
        )
    if features <= 0:
        raise UserEncoderError(
            f"policy_module {path!r}: out_features must be positive, got {features}"
        )
    return encoder, features
